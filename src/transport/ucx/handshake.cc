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

constexpr uint8_t kAllFlags = kKeyed | kProof | kAddress;

std::string FlagsText(uint8_t flags) {
  if (flags == 0) return "none";
  std::string out;
  for (auto [bit, name] : {std::pair{kKeyed, "keyed"}, std::pair{kProof, "proof"}, std::pair{kAddress, "address"}}) {
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
  std::string out(kGreetingMagic);
  out.reserve(kGreetingFixedBytes + kProofBytes + 4 + g.worker_address.size());
  out.push_back(static_cast<char>(g.flags));
  AppendLe64(out, g.peer_id);
  AppendLe64(out, g.nonce);
  out += g.proof;
  if ((g.flags & kAddress) != 0) {
    AppendLe32(out, static_cast<uint32_t>(g.worker_address.size()));
    out += g.worker_address;
  }
  return out;
}

size_t GreetingReader::HeadBytes() const {
  return kGreetingFixedBytes + ((expected_flags_ & kProof) != 0 ? kProofBytes : 0) +
         ((expected_flags_ & kAddress) != 0 ? 4 : 0);
}

size_t GreetingReader::wanted() const {
  if (done_ || !error_.ok()) return 0;
  if (head_.size() < HeadBytes()) return HeadBytes() - head_.size();
  return address_bytes_ - greeting_.worker_address.size();
}

absl::StatusOr<size_t> GreetingReader::Feed(std::string_view data) {
  if (!error_.ok()) return error_;
  size_t taken = 0;
  const size_t head_bytes = HeadBytes();
  while (taken < data.size() && !done_) {
    if (head_.size() < head_bytes) {
      const char c = data[taken];
      const size_t at = head_.size();
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
      head_.push_back(c);
      ++taken;
      ++consumed_;
      if (head_.size() == kGreetingFixedBytes) {
        greeting_.flags = static_cast<uint8_t>(head_[8]);
        greeting_.peer_id = LoadLe64(head_.data() + 9);
        greeting_.nonce = LoadLe64(head_.data() + 17);
        if (greeting_.peer_id == 0) {
          error_ = absl::InvalidArgumentError("data-plane greeting with peer id 0");
          return error_;
        }
      }
      if (head_.size() == head_bytes) {
        size_t at_field = kGreetingFixedBytes;
        if ((expected_flags_ & kProof) != 0) {
          greeting_.proof = head_.substr(at_field, kProofBytes);
          at_field += kProofBytes;
        }
        if ((expected_flags_ & kAddress) == 0) {
          done_ = true;
          break;
        }
        address_bytes_ = LoadLe32(head_.data() + at_field);
        if (address_bytes_ == 0 || address_bytes_ > kMaxWorkerAddressBytes) {
          error_ = absl::InvalidArgumentError(absl::StrCat("data-plane greeting announces a worker address of ",
                                                           address_bytes_, " bytes (1..", kMaxWorkerAddressBytes,
                                                           ")"));
          return error_;
        }
        greeting_.worker_address.reserve(address_bytes_);
      }
      continue;
    }
    const size_t n = std::min(data.size() - taken, address_bytes_ - greeting_.worker_address.size());
    greeting_.worker_address.append(data.data() + taken, n);
    taken += n;
    consumed_ += n;
    if (greeting_.worker_address.size() == address_bytes_) done_ = true;
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
