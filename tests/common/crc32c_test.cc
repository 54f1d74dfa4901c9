#include "common/crc32c.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace ckpt {
namespace {

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

TEST(Crc32c, MatchesStandardCheckValue) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
  EXPECT_EQ(Crc32c(nullptr, 0), 0u);
}

TEST(Crc32c, KnownVectorsFromRfc3720) {
  // RFC 3720 B.4: 32 bytes of zeros / ones / incrementing.
  std::string zeros(32, '\0');
  std::string ones(32, '\xff');
  std::string inc(32, '\0');
  for (int i = 0; i < 32; ++i) inc[i] = static_cast<char>(i);
  EXPECT_EQ(Crc32c(zeros), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(ones), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(inc), 0x46DD794Eu);
}

TEST(Crc32c, ExtendEqualsWhole) {
  const std::string data = RandomBytes(10000, 1);
  for (size_t cut : {0, 1, 7, 64, 4096, 9999, 10000}) {
    uint32_t crc = Crc32c(data.data(), cut);
    crc = Crc32cExtend(crc, data.data() + cut, data.size() - cut);
    EXPECT_EQ(crc, Crc32c(data)) << "cut at " << cut;
  }
}

TEST(Crc32c, CombineEqualsWholeForAnySplit) {
  std::mt19937 rng(42);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t n = rng() % 5000;
    const std::string data = RandomBytes(n, trial);
    const size_t cut = n == 0 ? 0 : rng() % (n + 1);
    const uint32_t a = Crc32c(data.data(), cut);
    const uint32_t b = Crc32c(data.data() + cut, n - cut);
    EXPECT_EQ(Crc32cCombine(a, b, n - cut), Crc32c(data)) << "n=" << n << " cut=" << cut;
  }
}

TEST(Crc32c, CombineManyChunksInAnyGrouping) {
  const std::string data = RandomBytes(1 << 20, 7);
  const size_t chunk = 65536 + 3;
  uint32_t combined = 0;
  for (size_t off = 0; off < data.size(); off += chunk) {
    const size_t n = std::min(chunk, data.size() - off);
    combined = Crc32cCombine(combined, Crc32c(data.data() + off, n), n);
  }
  EXPECT_EQ(combined, Crc32c(data));
}

// Regression: combining with a second part of 512 MiB or more used to index a
// 32-entry power table modulo 32, which is wrong for CRC-32C's polynomial.
TEST(Crc32c, CombineIsExactForPartsOfManyGigabytes) {
  const std::string head = "head bytes";
  const std::vector<char> zeros(16 << 20, 0);
  for (uint64_t size : {uint64_t{512} << 20, (uint64_t{1} << 30) + 5, (uint64_t{5} << 30) + 4096}) {
    uint32_t tail = 0;     // crc of `size` zero bytes, by brute force
    uint32_t whole = Crc32c(head);
    for (uint64_t done = 0; done < size;) {
      const uint64_t n = std::min<uint64_t>(zeros.size(), size - done);
      tail = Crc32cExtend(tail, zeros.data(), n);
      whole = Crc32cExtend(whole, zeros.data(), n);
      done += n;
    }
    EXPECT_EQ(Crc32cCombine(Crc32c(head), tail, size), whole) << size;
  }
}

TEST(Crc32c, CombineWithEmptyIsIdentity) {
  const uint32_t a = Crc32c("abc");
  EXPECT_EQ(Crc32cCombine(a, 0, 0), a);
  EXPECT_EQ(Crc32cCombine(0, a, 3), a);
}

TEST(Crc32c, CopyCopiesAndChecksums) {
  for (size_t n : {0u, 1u, 65535u, 65536u, 65537u, 300001u}) {
    const std::string src = RandomBytes(n, static_cast<uint32_t>(n));
    std::vector<char> dst(n + 1, 'x');
    EXPECT_EQ(Crc32cCopy(dst.data(), src.data(), n), Crc32c(src));
    EXPECT_EQ(std::string(dst.data(), n), src);
    EXPECT_EQ(dst[n], 'x') << "wrote past the end";
  }
}

TEST(Crc32c, CopyExtendsGivenCrc) {
  const std::string a = RandomBytes(1000, 3), b = RandomBytes(2000, 4);
  std::vector<char> dst(b.size());
  EXPECT_EQ(Crc32cCopy(dst.data(), b.data(), b.size(), Crc32c(a)), Crc32c(a + b));
}

TEST(Crc32c, DetectsSingleBitFlip) {
  std::string data = RandomBytes(4096, 9);
  const uint32_t good = Crc32c(data);
  data[1234] ^= 0x10;
  EXPECT_NE(Crc32c(data), good);
}

}  // namespace
}  // namespace ckpt
