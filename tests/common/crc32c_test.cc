#include "common/crc32c.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <random>
#include <span>
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

// `data` cut at `cuts` (ascending offsets) into pieces.
std::vector<std::span<const std::byte>> Cut(const std::string& data, const std::vector<size_t>& cuts) {
  const std::span<const std::byte> all(reinterpret_cast<const std::byte*>(data.data()), data.size());
  std::vector<std::span<const std::byte>> pieces;
  size_t pos = 0;
  for (size_t c : cuts) {
    pieces.push_back(all.subspan(pos, c - pos));
    pos = c;
  }
  pieces.push_back(all.subspan(pos));
  return pieces;
}

TEST(Crc32cOfPieces, EqualsTheCrcOfTheConcatenation) {
  const std::string data = RandomBytes(10000, 11);
  EXPECT_EQ(Crc32cOfPieces(Cut(data, {})), Crc32c(data));
  EXPECT_EQ(Crc32cOfPieces(Cut(data, {1, 1, 4096, 9999})), Crc32c(data));  // empty pieces too
  EXPECT_EQ(Crc32cOfPieces(std::span<const std::span<const std::byte>>()), 0u);
  // Extends a given crc.
  const std::string head = RandomBytes(77, 12);
  EXPECT_EQ(Crc32cOfPieces(Cut(data, {5000}), Crc32c(head)), Crc32c(head + data));
  // Writable pieces (transport::MutablePieces) likewise.
  std::string copy = data;
  std::vector<std::span<std::byte>> mutable_pieces{
      std::span<std::byte>(reinterpret_cast<std::byte*>(copy.data()), 3000),
      std::span<std::byte>(reinterpret_cast<std::byte*>(copy.data()) + 3000, copy.size() - 3000)};
  EXPECT_EQ(Crc32cOfPieces(mutable_pieces), Crc32c(data));
}

TEST(Crc32cOfChunks, CombinesChunksThatTileTheTransfer) {
  const std::string data = RandomBytes(10000, 13);
  Crc32cChunks chunks;
  // Arrival order does not matter: the map orders them by offset.
  for (uint64_t off : {8000, 0, 3000, 1000}) {
    const uint64_t end = off == 8000 ? 10000 : off == 0 ? 1000 : off == 1000 ? 3000 : 8000;
    chunks[off] = {Crc32c(data.data() + off, end - off), end - off};
  }
  absl::StatusOr<uint32_t> crc = Crc32cOfChunks(chunks, data.size());
  ASSERT_TRUE(crc.ok()) << crc.status();
  EXPECT_EQ(*crc, Crc32c(data));
  // No chunks: the crc of nothing, if nothing was expected.
  EXPECT_EQ(Crc32cOfChunks({}, 0).value(), 0u);
}

TEST(Crc32cOfChunks, RefusesGapsOverlapsAndWrongTotals) {
  const Crc32cChunks gap = {{0, {1, 100}}, {200, {2, 100}}};
  EXPECT_EQ(Crc32cOfChunks(gap, 300).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(Crc32cOfChunks(gap, 300).status().message(), "chunks do not tile the transfer at 100");
  const Crc32cChunks overlap = {{0, {1, 100}}, {50, {2, 100}}};
  EXPECT_EQ(Crc32cOfChunks(overlap, 150).status().code(), absl::StatusCode::kDataLoss);
  const Crc32cChunks two = {{0, {1, 100}}, {100, {2, 100}}};
  EXPECT_EQ(Crc32cOfChunks(two, 300).status().message(), "received 200 of 300 bytes");
  EXPECT_EQ(Crc32cOfChunks(two, 150).status().message(), "received 200 of 150 bytes");
  EXPECT_EQ(Crc32cOfChunks({}, 1).status().code(), absl::StatusCode::kDataLoss);
  const Crc32cChunks late = {{10, {1, 100}}};
  EXPECT_EQ(Crc32cOfChunks(late, 110).status().message(), "chunks do not tile the transfer at 0");
}

}  // namespace
}  // namespace ckpt
