// The UCX transport's data-port greeting records (transport/ucx/handshake.h):
// round trips in any split, each kind of record read only where it is
// expected, and garbage refused at the first byte that cannot be part of
// the expected record.
#include "transport/ucx/handshake.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"

namespace ckpt::transport::ucx_wire {
namespace {

// Every record a handshake uses (handshake.h).
const std::vector<uint8_t>& Kinds() {
  static const auto* kinds = new std::vector<uint8_t>(std::begin(kRecordKinds), std::end(kRecordKinds));
  return *kinds;
}

// An identity block's bytes (opaque here: node_identity.h reads them).
const std::string kIdentityBytes(700, 'i');

Greeting Make(uint8_t flags, uint64_t id, uint64_t nonce, const std::string& address) {
  Greeting g;
  g.flags = flags;
  g.peer_id = id;
  g.nonce = nonce;
  if ((flags & kProof) != 0) g.proof = HandshakeProof("key", 'a', id, nonce, 1, 2);
  if ((flags & kAddress) != 0) g.worker_address = address;
  if ((flags & kIdentity) != 0) g.identity = kIdentityBytes;
  return g;
}

std::string Encoded(const Greeting& g) {
  absl::StatusOr<std::string> s = EncodeGreeting(g);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : std::string();
}

TEST(Greeting, EveryKindRoundTripsWhateverTheSplit) {
  std::string address(300, '\0');
  for (size_t i = 0; i < address.size(); ++i) address[i] = static_cast<char>(i * 7);
  for (uint8_t kind : Kinds()) {
    const Greeting want = Make(kind, 0x0102030405060708, 0xfedcba9876543210, address);
    const std::string bytes = Encoded(want);
    EXPECT_EQ(bytes.substr(0, 8), "CKPTDP02");
    EXPECT_EQ(static_cast<uint8_t>(bytes[8]), kind);
    EXPECT_EQ(bytes.size(), kGreetingFixedBytes + ((kind & kProof) != 0 ? kProofBytes : 0) +
                                ((kind & kAddress) != 0 ? 4 + address.size() : 0) +
                                ((kind & kIdentity) != 0 ? 2 + kIdentityBytes.size() : 0));
    for (size_t step : {size_t{1}, size_t{3}, size_t{24}, size_t{25}, size_t{26}, size_t{57}, bytes.size()}) {
      SCOPED_TRACE(::testing::Message() << "kind " << int{kind} << " step " << step);
      GreetingReader r(kind);
      size_t at = 0;
      while (!r.done()) {
        ASSERT_GT(r.wanted(), 0u);
        const size_t n = std::min(step, bytes.size() - at);
        absl::StatusOr<size_t> took = r.Feed(std::string_view(bytes).substr(at, n));
        ASSERT_TRUE(took.ok()) << took.status();
        at += *took;
      }
      EXPECT_EQ(at, bytes.size());
      EXPECT_EQ(r.wanted(), 0u);
      EXPECT_EQ(r.greeting().flags, kind);
      EXPECT_EQ(r.greeting().peer_id, want.peer_id);
      EXPECT_EQ(r.greeting().nonce, want.nonce);
      EXPECT_EQ(r.greeting().proof, want.proof);
      EXPECT_EQ(r.greeting().worker_address, want.worker_address);
      EXPECT_EQ(r.greeting().identity, want.identity);
    }
  }
}

TEST(Greeting, NeverConsumesPastTheRecord) {
  for (uint8_t kind : Kinds()) {
    const std::string bytes = Encoded(Make(kind, 5, 6, "addr"));
    GreetingReader r(kind);
    absl::StatusOr<size_t> took = r.Feed(bytes + "trailing bytes");
    ASSERT_TRUE(took.ok()) << took.status();
    EXPECT_EQ(*took, bytes.size());
    EXPECT_TRUE(r.done());
    took = r.Feed("x");  // done: takes nothing more
    ASSERT_TRUE(took.ok());
    EXPECT_EQ(*took, 0u);
  }
}

// A record of another kind than expected is refused at its flags byte, with
// a message an operator understands (a key on one side only).
TEST(Greeting, ARecordOfAnotherKindIsRefusedAtItsFlags) {
  for (uint8_t want : Kinds()) {
    for (uint8_t got : Kinds()) {
      if (want == got) continue;
      GreetingReader r(want);
      absl::StatusOr<size_t> took = r.Feed(Encoded(Make(got, 5, 6, "addr")));
      ASSERT_FALSE(took.ok());
      EXPECT_EQ(r.consumed(), 8u) << "refused at the flags byte";
      EXPECT_EQ(took.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
  GreetingReader keyed(kKeyed);
  absl::StatusOr<size_t> took = keyed.Feed(Encoded(Make(kAddress, 5, 6, "addr")));
  ASSERT_FALSE(took.ok());
  EXPECT_TRUE(absl::StrContains(took.status().message(), "does not authenticate")) << took.status();
  GreetingReader plain(kAddress);
  took = plain.Feed(Encoded(Make(kKeyed, 5, 6, "")));
  ASSERT_FALSE(took.ok());
  EXPECT_TRUE(absl::StrContains(took.status().message(), "this agent has none")) << took.status();
  GreetingReader identified(kKeyed | kIdentity);
  took = identified.Feed(Encoded(Make(kKeyed, 5, 6, "")));
  ASSERT_FALSE(took.ok());
  EXPECT_TRUE(absl::StrContains(took.status().message(), "proves no node identity")) << took.status();
  GreetingReader anonymous(kKeyed);
  took = anonymous.Feed(Encoded(Make(kKeyed | kIdentity, 5, 6, "")));
  ASSERT_FALSE(took.ok());
  EXPECT_TRUE(absl::StrContains(took.status().message(), "no node certificate")) << took.status();
  GreetingReader unknown(kAddress);
  std::string bytes = Encoded(Make(kAddress, 5, 6, "addr"));
  bytes[8] = static_cast<char>(0x84);
  took = unknown.Feed(bytes);
  ASSERT_FALSE(took.ok());
  EXPECT_TRUE(absl::StrContains(took.status().message(), "0x80")) << took.status();
}

TEST(Greeting, RefusesGarbageAtTheFirstWrongByte) {
  struct Case {
    std::string name;
    std::string bytes;
    size_t bad_byte;
  };
  std::mt19937_64 rng(42);
  std::string random(4096, '\0');
  for (char& c : random) c = static_cast<char>(rng());
  random[0] = 'Q';  // never 'C' by chance
  const std::vector<Case> cases = {
      {"zeros", std::string(1 << 20, '\0'), 0},
      {"random", random, 0},
      {"http2 preface", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 0},
      {"http/1", "GET /metrics HTTP/1.1\r\n\r\n", 0},
      {"the previous version", "CKPTDP01" + std::string(20, '\1'), 7},
      {"ucx tcp magic", std::string("\x78\x56\x34\x12\xbe\xba\xfe\xca", 8), 0},
  };
  for (const Case& c : cases) {
    GreetingReader r;
    absl::StatusOr<size_t> took = r.Feed(c.bytes);
    ASSERT_FALSE(took.ok()) << c.name;
    EXPECT_EQ(took.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_TRUE(absl::StrContains(took.status().message(), "not a ckpt data-plane greeting")) << took.status();
    EXPECT_EQ(r.consumed(), c.bad_byte) << c.name;
    EXPECT_FALSE(r.done());
    EXPECT_EQ(r.wanted(), 0u);
    // Stays failed.
    EXPECT_FALSE(r.Feed("CKPTDP02").ok());
  }
}

TEST(Greeting, RefusesBadFieldsOnceTheyAreComplete) {
  auto head = [](uint64_t id, uint32_t length) {
    std::string s = "CKPTDP02";
    s.push_back(static_cast<char>(kAddress));
    for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>(id >> (8 * i)));
    s += std::string(8, '\0');  // nonce
    for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>(length >> (8 * i)));
    return s;
  };
  struct Case {
    std::string name;
    std::string bytes;
    std::string message;
    size_t refused_at;
  };
  const std::vector<Case> cases = {
      {"peer id 0", head(0, 10), "peer id 0", kGreetingFixedBytes - 1},
      {"empty address", head(1, 0), "worker address of 0 bytes", kGreetingFixedBytes + 3},
      {"huge address", head(1, 0xffffffff), "worker address of 4294967295 bytes", kGreetingFixedBytes + 3},
      {"just over", head(1, kMaxWorkerAddressBytes + 1), "bytes (1..", kGreetingFixedBytes + 3},
  };
  // An identity block of 0 bytes, or more than kMaxIdentityBytes.
  auto identity_head = [](uint16_t length) {
    std::string s = "CKPTDP02";
    s.push_back(static_cast<char>(kKeyed | kIdentity));
    s.push_back(1);
    s += std::string(7 + 8, '\0');  // rest of the id, nonce
    s.push_back(static_cast<char>(length & 0xff));
    s.push_back(static_cast<char>(length >> 8));
    return s;
  };
  for (uint16_t length : {uint16_t{0}, static_cast<uint16_t>(kMaxIdentityBytes + 1), uint16_t{0xffff}}) {
    GreetingReader r(kKeyed | kIdentity);
    absl::StatusOr<size_t> took = r.Feed(identity_head(length));
    ASSERT_FALSE(took.ok()) << length;
    EXPECT_TRUE(absl::StrContains(took.status().message(), "identity block of")) << took.status();
    EXPECT_EQ(r.consumed(), kGreetingFixedBytes + 2) << "refused at the length's last byte";
  }
  for (const Case& c : cases) {
    GreetingReader r(kAddress);
    // Byte by byte: accepted up to the field's last byte, refused there.
    absl::Status last;
    for (size_t i = 0; i < c.bytes.size(); ++i) {
      absl::StatusOr<size_t> took = r.Feed(c.bytes.substr(i, 1));
      if (!took.ok()) {
        last = took.status();
        EXPECT_EQ(i, c.refused_at) << c.name;
        break;
      }
    }
    EXPECT_EQ(last.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_TRUE(absl::StrContains(last.message(), c.message)) << last;
  }
}

TEST(Greeting, EncodeRefusesWhatReadersWouldRefuse) {
  auto code = [](const Greeting& g) { return EncodeGreeting(g).status().code(); };
  const std::string proof(kProofBytes, 'p');
  EXPECT_EQ(code({kAddress, 0, 1, "", "a"}), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({kAddress, 1, 1, "", ""}), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({kAddress, 1, 1, "", std::string(kMaxWorkerAddressBytes + 1, 'a')}),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(EncodeGreeting({kAddress, 1, 1, "", std::string(kMaxWorkerAddressBytes, 'a')}).ok());
  EXPECT_EQ(code({kKeyed, 1, 1, "", "a"}), absl::StatusCode::kInvalidArgument) << "an address without the flag";
  EXPECT_EQ(code({kKeyed | kProof, 1, 1, "short", ""}), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({kKeyed, 1, 1, proof, ""}), absl::StatusCode::kInvalidArgument) << "a proof without the flag";
  EXPECT_EQ(code({0x10, 1, 1, "", ""}), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({kKeyed | kIdentity, 1, 1, "", ""}), absl::StatusCode::kInvalidArgument) << "no identity block";
  EXPECT_EQ(code({kKeyed | kIdentity, 1, 1, "", "", std::string(kMaxIdentityBytes + 1, 'i')}),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({kKeyed, 1, 1, "", "", "i"}), absl::StatusCode::kInvalidArgument) << "a block without the flag";
  EXPECT_TRUE(EncodeGreeting({kKeyed | kIdentity, 1, 1, "", "", std::string(kMaxIdentityBytes, 'i')}).ok());
  EXPECT_TRUE(EncodeGreeting({kKeyed | kProof, 1, 1, proof, ""}).ok());
}

}  // namespace
}  // namespace ckpt::transport::ucx_wire
