#include "common/crc32c.h"

#include <isa-l/crc.h>

#include <array>
#include <cassert>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/lock_check.h"

namespace ckpt {
namespace {

// Reflected CRC-32C polynomial.
constexpr uint32_t kPoly = 0x82F63B78u;

// Multiplies a(x) * b(x) modulo the CRC polynomial, in the reflected bit order
// the CRC register uses (bit 31 is x^0).
uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) {
      product ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// powers[k] = x^(2^k) mod P, for every k XPow2N can reach (3 + 64 bits of n).
// zlib's CRC-32 code indexes a 32-entry table modulo 32, relying on
// x^(2^32) = x mod its polynomial; that does not hold for CRC-32C's, so
// combining with 512 MiB or more gave wrong crcs. The table is simply long
// enough instead.
constexpr size_t kPowers = 3 + 64 + 1;
std::array<uint32_t, kPowers> MakePowers() {
  std::array<uint32_t, kPowers> powers{};
  uint32_t p = 1u << 30;  // x^1
  for (auto& entry : powers) {
    entry = p;
    p = MultModP(p, p);
  }
  return powers;
}

// Returns x^(n * 2^k) mod P.
uint32_t XPow2N(uint64_t n, unsigned k) {
  static const std::array<uint32_t, kPowers> powers = MakePowers();
  uint32_t p = 1u << 31;  // x^0
  while (n != 0) {
    assert(k < kPowers);
    if (n & 1) p = MultModP(powers[k], p);
    n >>= 1;
    ++k;
  }
  return p;
}

// Bytes copied between checksum steps: small enough that the block is still in
// L2 when crc32_iscsi reads it back.
constexpr size_t kCopyBlock = 64 * 1024;

}  // namespace

uint32_t Crc32c(const void* data, size_t size) { return Crc32cExtend(0, data, size); }

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  // A page or more is real work: never under a component's lock.
  if (size >= 4096) AssertNoCheckedLock("crc32c of 4 KiB or more");
  // ISA-L's crc32_iscsi has neither the initial nor the final inversion, and
  // takes an int length: feed it at most 1 GiB at a time.
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  uint32_t reg = ~crc;
  while (size > 0) {
    const size_t n = size < (size_t{1} << 30) ? size : (size_t{1} << 30);
    reg = crc32_iscsi(p, static_cast<int>(n), reg);
    p += n;
    size -= n;
  }
  return ~reg;
}

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t size_b) {
  // Appending size_b bytes multiplies A's register by x^(8*size_b); the
  // initial/final inversions cancel (same algebra as zlib's crc32_combine).
  // Shards of many items combine one crc per item, mostly of a few sizes:
  // the power for the last size is kept per thread.
  thread_local uint64_t last_size = 0;
  thread_local uint32_t last_power = 1u << 31;  // x^0 = x^(8*0)
  if (size_b != last_size) {
    last_power = XPow2N(size_b, 3);
    last_size = size_b;
  }
  return MultModP(last_power, crc_a) ^ crc_b;
}

uint32_t Crc32cCopy(void* dst, const void* src, size_t size, uint32_t crc) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  while (size > 0) {
    const size_t n = size < kCopyBlock ? size : kCopyBlock;
    std::memcpy(d, s, n);
    crc = Crc32cExtend(crc, d, n);
    d += n;
    s += n;
    size -= n;
  }
  return crc;
}

uint32_t Crc32cOfPieces(std::span<const std::span<const std::byte>> pieces, uint32_t crc) {
  for (const auto& p : pieces) crc = Crc32cExtend(crc, p.data(), p.size());
  return crc;
}

uint32_t Crc32cOfPieces(std::span<const std::span<std::byte>> pieces, uint32_t crc) {
  for (const auto& p : pieces) crc = Crc32cExtend(crc, p.data(), p.size());
  return crc;
}

absl::StatusOr<uint32_t> Crc32cOfChunks(const Crc32cChunks& chunks, uint64_t total_bytes) {
  uint32_t crc = 0;
  uint64_t pos = 0;
  for (const auto& [off, c] : chunks) {
    if (off != pos) return absl::DataLossError(absl::StrCat("chunks do not tile the transfer at ", pos));
    crc = Crc32cCombine(crc, c.first, c.second);
    pos += c.second;
  }
  if (pos != total_bytes) return absl::DataLossError(absl::StrCat("received ", pos, " of ", total_bytes, " bytes"));
  return crc;
}

}  // namespace ckpt
