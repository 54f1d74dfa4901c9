// Shard bytes spread over mapped regions: copies in and out with CRC-32C, and
// the save layout. Pure functions over memory (no I/O, no RPC), so the
// straddling cases are unit-tested without an agent.
//
// A shard of `size` bytes is handed out by the agent as one or more regions
// that cover [0, size) in order without gaps; each region is a range of a
// mapped file, so consecutive regions need not be adjacent in memory. An item
// whose bytes cross a region boundary is copied in pieces and its crc
// combined from the pieces' crcs.
//
// Thread safety: all functions are pure (apart from the memory they are told
// to write) and safe to call concurrently on disjoint destinations.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt::client {

// One region of a shard, mapped into this process.
struct ShardRegion {
  std::byte* data = nullptr;      // first byte of the region in this process
  uint64_t length = 0;            // bytes
  uint64_t shard_offset = 0;      // offset within the shard of data[0]
};

// OK iff `regions` cover [0, size) in order without gaps or overlaps, each
// non-empty and with a non-null address. kInternal naming the first problem
// otherwise (the agent's answer does not fit the request).
absl::Status CheckCoverage(std::span<const ShardRegion> regions, uint64_t size);

// The following require CheckCoverage(regions, size) to be OK and
// [offset, offset + n) to lie within [0, size).

// The threads a parallel copy uses by default: min(4, cores), at least 1.
unsigned CopyThreadCount();

// Crc32cCopy, split over `threads` threads (0: CopyThreadCount()) for copies
// of 8 MiB and more (the calling thread takes part). Returns
// Crc32cExtend(crc, src, n). Tests force `threads` to cover the 3- and
// 4-thread splits on machines with fewer cores.
uint32_t ParallelCrc32cCopy(void* dst, const void* src, size_t n, uint32_t crc = 0, unsigned threads = 0);

// How a copy into the shard may use the machine's cores.
enum class CopyThreads {
  kAll,  // ParallelCrc32cCopy: the trainer waits for the copy, its cores help
  kOne,  // the calling thread only: the copy runs beside training (a lazy
         // save), which needs the other cores
};

// Copies `src` to shard bytes [offset, offset + src.size()) and returns the
// CRC-32C of src (continued from `crc`), computed while copying.
uint32_t CopyToShard(std::span<const ShardRegion> regions, uint64_t offset,
                     std::span<const std::byte> src, uint32_t crc = 0,
                     CopyThreads threads = CopyThreads::kAll);

// One item of a save for CopyItemsToShard: its bytes and where they go.
struct ItemCopy {
  std::span<const std::byte> src;
  uint64_t offset = 0;
};
struct CopiedItem {
  uint32_t gap_crc = 0;  // of the zero padding between the previous item's end (or 0) and this item
  uint32_t crc = 0;      // of the item's bytes
};

// Copies many items into the shard (in ascending offset order, not
// overlapping), zeroing the padding before each, on up to `threads`
// threads (the caller's among them), each a run of consecutive items of about
// equal bytes: a model's thousands of small tensors are each too short for
// ParallelCrc32cCopy to split. Returns each item's crcs; empty, having copied
// nothing, when there are fewer than 64 items or less than 4 MiB in all (the
// caller copies them one by one). `threads` as for ParallelCrc32cCopy (0:
// CopyThreadCount(); 1 copies nothing, as on one core).
std::vector<CopiedItem> CopyItemsToShard(std::span<const ShardRegion> regions, std::span<const ItemCopy> items,
                                         unsigned threads = 0);

// Copies shard bytes [offset, offset + dst.size()) to `dst` and returns their
// CRC-32C, computed while copying.
uint32_t CopyFromShard(std::span<const ShardRegion> regions, uint64_t offset,
                       std::span<std::byte> dst);

// One item of a load for CopyItemsFromShard: where its bytes are (each item
// may come from another shard: an incremental version's references) and
// where they go.
struct ItemRead {
  std::span<const ShardRegion> regions;
  uint64_t offset = 0;
  std::span<std::byte> dst;
};

// Copies every item's shard bytes to its dst and returns each item's
// CRC-32C, computed while copying. The items' bytes, taken as one stream,
// are split into `threads` equal parts (the caller's thread among them):
// a model's hundreds of tensors of a few MiB each, too short for
// ParallelCrc32cCopy to split, then load on every core, and an item that
// straddles two parts gets its crc combined from both. Below 8 MiB in all,
// or with `threads` 1, the calling thread copies them in order. `threads`
// as for ParallelCrc32cCopy (0: CopyThreadCount()).
std::vector<uint32_t> CopyItemsFromShard(std::span<const ItemRead> items, unsigned threads = 0);

// The CRC-32C of shard bytes [offset, offset + n) (the calling thread).
uint32_t ShardRangeCrc(std::span<const ShardRegion> regions, uint64_t offset, uint64_t n);

// Zeroes shard bytes [offset, offset + n) and returns the CRC-32C of n zero
// bytes.
uint32_t ZeroShard(std::span<const ShardRegion> regions, uint64_t offset, uint64_t n);

// A pointer to shard bytes [offset, offset + n) if they are contiguous in this
// process's memory (inside one region, or spanning regions that happen to be
// adjacent), else nullptr. n == 0 gives the address of `offset` (or of the
// shard's end).
const std::byte* ContiguousRange(std::span<const ShardRegion> regions, uint64_t offset,
                                 uint64_t n);

// Save layout: item i of `lengths` starts at offsets[i], the first offset at
// or after the end of item i-1 that is a multiple of `alignment` (a power of
// two; 0 or 1 = unaligned). `size` is the end of the last item, at least 1 (a
// lease cannot be empty; a shard of empty items holds one zero byte).
struct Layout {
  std::vector<uint64_t> offsets;
  uint64_t size = 0;
};
// kInvalidArgument if `alignment` is not a power of two or the total
// overflows 64 bits.
absl::StatusOr<Layout> LayOut(std::span<const uint64_t> lengths, uint64_t alignment);

}  // namespace ckpt::client
