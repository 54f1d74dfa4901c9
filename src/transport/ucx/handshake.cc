#include "transport/ucx/handshake.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/endian.h"

namespace ckpt::transport::ucx_wire {

namespace {

constexpr uint8_t kAllFlags = kKeyed | kProof | kAddress | kIdentity;

std::string FlagsText(uint8_t flags) {
  if (flags == 0) return "none";
  std::string out;
  for (auto [bit, name] : {std::pair{kKeyed, "keyed"}, std::pair{kProof, "proof"}, std::pair{kAddress, "address"},
                           std::pair{kIdentity, "identity"}}) {
    if ((flags & bit) == 0) continue;
    if (!out.empty()) out += "+";
    out += name;
  }
  if ((flags & ~kAllFlags) != 0) absl::StrAppend(&out, out.empty() ? "" : "+", "0x", absl::Hex(flags & ~kAllFlags));
  return out;
}

// Why a record with `got` flags is not the `want` one, as a peer's operator
// would want to read it.
std::string FlagsMismatch(uint8_t want, uint8_t got) {
  if ((want & kKeyed) != 0 && (got & ~kAllFlags) == 0 && (got & kKeyed) == 0) {
    return "the peer does not authenticate (it has no data-plane key) and this agent requires it";
  }
  if ((want & kKeyed) == 0 && (got & ~kAllFlags) == 0 && (got & kKeyed) != 0) {
    return "the peer authenticates with a data-plane key and this agent has none";
  }
  if ((want & kIdentity) != 0 && (got & ~kAllFlags) == 0 && (got & kIdentity) == 0 && (got & kKeyed) != 0) {
    return "the peer proves no node identity (an agent without a node certificate, or older than this one) and "
           "this agent requires one";
  }
  if ((want & kIdentity) == 0 && (got & ~kAllFlags) == 0 && (got & kIdentity) != 0 && (want & kKeyed) != 0) {
    return "the peer proves a node identity and this agent has no node certificate to prove its own";
  }
  return absl::StrCat("a data-plane greeting record with flags ", FlagsText(got), " where one with ", FlagsText(want),
                      " was expected");
}

}  // namespace

absl::StatusOr<std::string> EncodeGreeting(const Greeting& g) {
  if (g.peer_id == 0) return absl::InvalidArgumentError("greeting: peer id 0");
  if ((g.flags & ~kAllFlags) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("greeting: unknown flags 0x", absl::Hex(g.flags)));
  }
  if (g.proof.size() != ((g.flags & kProof) != 0 ? kProofBytes : 0)) {
    return absl::InvalidArgumentError(absl::StrCat("greeting: a proof of ", g.proof.size(), " bytes with flags ",
                                                   FlagsText(g.flags)));
  }
  if ((g.flags & kAddress) != 0) {
    if (g.worker_address.empty() || g.worker_address.size() > kMaxWorkerAddressBytes) {
      return absl::InvalidArgumentError(absl::StrCat("greeting: worker address of ", g.worker_address.size(),
                                                     " bytes (1..", kMaxWorkerAddressBytes, ")"));
    }
  } else if (!g.worker_address.empty()) {
    return absl::InvalidArgumentError("greeting: a worker address without the address flag");
  }
  if ((g.flags & kIdentity) != 0) {
    if (g.identity.empty() || g.identity.size() > kMaxIdentityBytes) {
      return absl::InvalidArgumentError(absl::StrCat("greeting: identity block of ", g.identity.size(),
                                                     " bytes (1..", kMaxIdentityBytes, ")"));
    }
  } else if (!g.identity.empty()) {
    return absl::InvalidArgumentError("greeting: an identity block without the identity flag");
  }
  std::string out(kGreetingMagic);
  out.reserve(kGreetingFixedBytes + kProofBytes + 2 + g.identity.size() + 4 + g.worker_address.size());
  out.push_back(static_cast<char>(g.flags));
  AppendLe64(out, g.peer_id);
  AppendLe64(out, g.nonce);
  out += g.proof;
  if ((g.flags & kIdentity) != 0) {
    AppendLe(out, g.identity.size(), 2);
    out += g.identity;
  }
  if ((g.flags & kAddress) != 0) {
    AppendLe32(out, static_cast<uint32_t>(g.worker_address.size()));
    out += g.worker_address;
  }
  return out;
}

GreetingReader::Part GreetingReader::NextPart(Part part) const {
  switch (part) {
    case Part::kHead:
      if ((expected_flags_ & kIdentity) != 0) return Part::kIdentityLength;
      [[fallthrough]];
    case Part::kIdentity:
      if ((expected_flags_ & kAddress) != 0) return Part::kAddressLength;
      return Part::kDone;
    case Part::kIdentityLength:
      return Part::kIdentity;
    case Part::kAddressLength:
      return Part::kAddress;
    case Part::kAddress:
    case Part::kDone:
      return Part::kDone;
  }
  return Part::kDone;
}

size_t GreetingReader::PartBytes() const {
  switch (part_) {
    case Part::kHead:
      return kGreetingFixedBytes + ((expected_flags_ & kProof) != 0 ? kProofBytes : 0);
    case Part::kIdentityLength:
      return 2;
    case Part::kIdentity:
      return identity_bytes_;
    case Part::kAddressLength:
      return 4;
    case Part::kAddress:
      return address_bytes_;
    case Part::kDone:
      return 0;
  }
  return 0;
}

size_t GreetingReader::wanted() const {
  if (done_ || !error_.ok()) return 0;
  return PartBytes() - part_bytes_.size();
}

absl::Status GreetingReader::EndPart() {
  switch (part_) {
    case Part::kHead:
      greeting_.flags = static_cast<uint8_t>(part_bytes_[8]);
      greeting_.peer_id = LoadLe64(part_bytes_.data() + 9);
      greeting_.nonce = LoadLe64(part_bytes_.data() + 17);
      if (greeting_.peer_id == 0) return absl::InvalidArgumentError("data-plane greeting with peer id 0");
      if ((expected_flags_ & kProof) != 0) greeting_.proof = part_bytes_.substr(kGreetingFixedBytes, kProofBytes);
      break;
    case Part::kIdentityLength:
      identity_bytes_ = LoadLe(part_bytes_.data(), 2);
      if (identity_bytes_ == 0 || identity_bytes_ > kMaxIdentityBytes) {
        return absl::InvalidArgumentError(absl::StrCat("data-plane greeting announces an identity block of ",
                                                       identity_bytes_, " bytes (1..", kMaxIdentityBytes, ")"));
      }
      break;
    case Part::kIdentity:
      greeting_.identity = std::move(part_bytes_);
      break;
    case Part::kAddressLength:
      address_bytes_ = LoadLe32(part_bytes_.data());
      if (address_bytes_ == 0 || address_bytes_ > kMaxWorkerAddressBytes) {
        return absl::InvalidArgumentError(absl::StrCat("data-plane greeting announces a worker address of ",
                                                       address_bytes_, " bytes (1..", kMaxWorkerAddressBytes, ")"));
      }
      break;
    case Part::kAddress:
      greeting_.worker_address = std::move(part_bytes_);
      break;
    case Part::kDone:
      break;
  }
  part_bytes_.clear();
  part_ = NextPart(part_);
  if (part_ == Part::kDone) done_ = true;
  return absl::OkStatus();
}

absl::StatusOr<size_t> GreetingReader::Feed(std::string_view data) {
  if (!error_.ok()) return error_;
  size_t taken = 0;
  while (taken < data.size() && !done_) {
    if (part_ == Part::kHead) {
      // Byte by byte: garbage is refused at its first wrong byte.
      const char c = data[taken];
      const size_t at = part_bytes_.size();
      if (at < kGreetingMagic.size() && c != kGreetingMagic[at]) {
        error_ = absl::InvalidArgumentError(absl::StrCat(
            "not a ckpt data-plane greeting: byte ", consumed_, " is 0x",
            absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2), " (expected \"",
            std::string(kGreetingMagic), "\")"));
        return error_;
      }
      if (at == kGreetingMagic.size() && static_cast<uint8_t>(c) != expected_flags_) {
        error_ = absl::InvalidArgumentError(FlagsMismatch(expected_flags_, static_cast<uint8_t>(c)));
        return error_;
      }
      part_bytes_.push_back(c);
      ++taken;
      ++consumed_;
    } else {
      const size_t n = std::min(data.size() - taken, PartBytes() - part_bytes_.size());
      if (part_bytes_.empty()) part_bytes_.reserve(PartBytes());
      part_bytes_.append(data.data() + taken, n);
      taken += n;
      consumed_ += n;
    }
    if (part_bytes_.size() == PartBytes()) {
      if (absl::Status s = EndPart(); !s.ok()) {
        error_ = s;
        return error_;
      }
    }
  }
  return taken;
}

std::string HandshakeProof(std::string_view key, char role, uint64_t acceptor_id, uint64_t acceptor_nonce,
                           uint64_t connector_id, uint64_t connector_nonce) {
  std::string msg(1, role);
  for (uint64_t v : {acceptor_id, acceptor_nonce, connector_id, connector_nonce}) AppendLe64(msg, v);
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(msg.data()),
       msg.size(), out, &len);
  return std::string(reinterpret_cast<const char*>(out), std::min<size_t>(len, kProofBytes));
}

bool SameProof(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

uint64_t RandomU64() {
  uint64_t v = 0;
  size_t got = 0;
  while (got < sizeof(v)) {
    const ssize_t n = getrandom(reinterpret_cast<char*>(&v) + got, sizeof(v) - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (errno != EINTR) {
      std::abort();  // the kernel's random source is gone: nothing safe to fall back to
    }
  }
  return v;
}

}  // namespace ckpt::transport::ucx_wire
