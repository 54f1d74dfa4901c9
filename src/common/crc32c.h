// CRC-32C (Castagnoli), the checksum on every byte ckpt stores or moves.
//
// Values are the standard CRC-32C (iSCSI, RFC 3720): Crc32c("123456789") ==
// 0xE3069283. Computed with ISA-L's crc32_iscsi (SSE4.2 / PCLMUL / AVX-512 as the
// CPU allows). All functions are pure and thread-safe; none allocates or blocks.
//
// Pieces combine: for buffers A and B,
//   Crc32cExtend(Crc32c(A), B) == Crc32c(A + B)
//   Crc32cCombine(Crc32c(A), Crc32c(B), size(B)) == Crc32c(A + B)
// so chunks checksummed independently (in parallel, or as they arrive over the
// network) yield the whole shard's crc without a second pass over the bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace ckpt {

// Returns the CRC-32C of `size` bytes at `data` (`data` may be null when size==0).
uint32_t Crc32c(const void* data, size_t size);
inline uint32_t Crc32c(std::string_view s) { return Crc32c(s.data(), s.size()); }
inline uint32_t Crc32c(std::span<const std::byte> s) { return Crc32c(s.data(), s.size()); }

// Returns the CRC-32C of (the bytes that produced `crc`) followed by `data`.
// Crc32cExtend(0, data, n) == Crc32c(data, n).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);

// Returns the CRC-32C of A followed by B, given crc_a = Crc32c(A),
// crc_b = Crc32c(B) and size_b = size of B in bytes. O(log size_b), no data access.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t size_b);

// Copies `size` bytes from `src` to `dst` (non-overlapping) and returns
// Crc32cExtend(crc, src, size), reading each block while it is still in cache
// so the checksum costs little beyond the copy. This is the trainer's save path.
uint32_t Crc32cCopy(void* dst, const void* src, size_t size, uint32_t crc = 0);

}  // namespace ckpt
