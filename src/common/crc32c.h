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
#include <map>
#include <span>
#include <string_view>
#include <utility>

#include "absl/status/statusor.h"

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

// Returns Crc32cExtend(crc, ...) over `pieces` in order: the CRC-32C of their
// concatenation when crc == 0 (a shard or segment that lies in several
// memory pieces, e.g. transport::ConstPieces).
uint32_t Crc32cOfPieces(std::span<const std::span<const std::byte>> pieces, uint32_t crc = 0);
uint32_t Crc32cOfPieces(std::span<const std::span<std::byte>> pieces, uint32_t crc = 0);

// A transfer received in chunks, each checksummed on arrival: chunk offset ->
// (its CRC-32C, its length in bytes).
using Crc32cChunks = std::map<uint64_t, std::pair<uint32_t, uint64_t>>;

// Returns the CRC-32C of the whole transfer from its chunks' (Crc32cCombine,
// no data access). The chunks must tile [0, total_bytes) exactly: DataLoss
// ("chunks do not tile the transfer at N" for a gap or overlap, "received N of
// M bytes" for a short or long transfer) otherwise.
absl::StatusOr<uint32_t> Crc32cOfChunks(const Crc32cChunks& chunks, uint64_t total_bytes);

}  // namespace ckpt
