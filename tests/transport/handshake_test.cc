// The UCX transport's data-port greeting (transport/ucx/handshake.h): round
// trips in any split, and garbage refused at the first byte that cannot be
// part of a greeting.
#include "transport/ucx/handshake.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

#include "absl/strings/match.h"

namespace ckpt::transport::ucx_wire {
namespace {

std::string Encoded(uint64_t id, uint64_t nonce, std::string address) {
  absl::StatusOr<std::string> s = EncodeGreeting({id, nonce, std::move(address)});
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : std::string();
}

TEST(Greeting, RoundTripsWhateverTheSplit) {
  std::string address(300, '\0');
  for (size_t i = 0; i < address.size(); ++i) address[i] = static_cast<char>(i * 7);
  const std::string bytes = Encoded(0x0102030405060708, 0xfedcba9876543210, address);
  ASSERT_EQ(bytes.size(), kGreetingFixedBytes + address.size());
  EXPECT_EQ(bytes.substr(0, 8), "CKPTDP01");
  for (size_t step : {size_t{1}, size_t{3}, size_t{27}, size_t{28}, size_t{29}, bytes.size()}) {
    GreetingReader r;
    size_t at = 0;
    while (!r.done()) {
      ASSERT_GT(r.wanted(), 0u);
      const size_t n = std::min(step, bytes.size() - at);
      absl::StatusOr<size_t> took = r.Feed(std::string_view(bytes).substr(at, n));
      ASSERT_TRUE(took.ok()) << took.status();
      at += *took;
    }
    EXPECT_EQ(at, bytes.size()) << step;
    EXPECT_EQ(r.wanted(), 0u);
    EXPECT_EQ(r.greeting().peer_id, 0x0102030405060708u);
    EXPECT_EQ(r.greeting().nonce, 0xfedcba9876543210u);
    EXPECT_EQ(r.greeting().worker_address, address);
  }
}

TEST(Greeting, NeverConsumesPastTheGreeting) {
  const std::string bytes = Encoded(5, 6, "addr");
  GreetingReader r;
  absl::StatusOr<size_t> took = r.Feed(bytes + "trailing bytes");
  ASSERT_TRUE(took.ok()) << took.status();
  EXPECT_EQ(*took, bytes.size());
  EXPECT_TRUE(r.done());
  // Done: takes nothing more.
  took = r.Feed("x");
  ASSERT_TRUE(took.ok());
  EXPECT_EQ(*took, 0u);
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
      {"near miss", "CKPTDP02" + std::string(20, '\1'), 7},
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
    EXPECT_FALSE(r.Feed("CKPTDP01").ok());
  }
}

TEST(Greeting, RefusesBadFieldsOnceTheyAreComplete) {
  auto fixed = [](uint64_t id, uint32_t length) {
    std::string s = "CKPTDP01";
    for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>(id >> (8 * i)));
    s += std::string(8, '\0');  // nonce
    for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>(length >> (8 * i)));
    return s;
  };
  struct Case {
    std::string name;
    std::string bytes;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"peer id 0", fixed(0, 10), "peer id 0"},
      {"empty address", fixed(1, 0), "worker address of 0 bytes"},
      {"huge address", fixed(1, 0xffffffff), "worker address of 4294967295 bytes"},
      {"just over", fixed(1, kMaxWorkerAddressBytes + 1), "bytes (1.."},
  };
  for (const Case& c : cases) {
    GreetingReader r;
    // Byte by byte: accepted up to the last fixed byte, refused there.
    absl::Status last;
    for (size_t i = 0; i < c.bytes.size(); ++i) {
      absl::StatusOr<size_t> took = r.Feed(c.bytes.substr(i, 1));
      if (!took.ok()) {
        last = took.status();
        EXPECT_EQ(i, kGreetingFixedBytes - 1) << c.name;
        break;
      }
    }
    EXPECT_EQ(last.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_TRUE(absl::StrContains(last.message(), c.message)) << last;
  }
}

TEST(Greeting, EncodeRefusesWhatReadersWouldRefuse) {
  EXPECT_EQ(EncodeGreeting({0, 1, "a"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodeGreeting({1, 1, ""}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodeGreeting({1, 1, std::string(kMaxWorkerAddressBytes + 1, 'a')}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(EncodeGreeting({1, 1, std::string(kMaxWorkerAddressBytes, 'a')}).ok());
}

}  // namespace
}  // namespace ckpt::transport::ucx_wire
