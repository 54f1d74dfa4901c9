#include "client/region_io.h"

#include <algorithm>
#include <cassert>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"

namespace ckpt::client {
namespace {

// Index of the region holding shard byte `offset` (the last region for
// offset == size).
size_t RegionOf(std::span<const ShardRegion> regions, uint64_t offset) {
  auto it = std::upper_bound(regions.begin(), regions.end(), offset,
                             [](uint64_t off, const ShardRegion& r) { return off < r.shard_offset; });
  assert(it != regions.begin());
  return static_cast<size_t>(it - regions.begin()) - 1;
}

// Calls fn(region_ptr, n, done) for each piece of [offset, offset + n) in
// order, where `done` is the number of bytes handled before the piece.
template <typename Fn>
void ForEachPiece(std::span<const ShardRegion> regions, uint64_t offset, uint64_t n, Fn&& fn) {
  if (n == 0) return;
  size_t r = RegionOf(regions, offset);
  uint64_t done = 0;
  while (done < n) {
    assert(r < regions.size());
    const ShardRegion& reg = regions[r];
    const uint64_t in_region = offset + done - reg.shard_offset;
    const uint64_t piece = std::min(n - done, reg.length - in_region);
    fn(reg.data + in_region, piece, done);
    done += piece;
    ++r;
  }
}

}  // namespace

absl::Status CheckCoverage(std::span<const ShardRegion> regions, uint64_t size) {
  uint64_t next = 0;
  for (size_t i = 0; i < regions.size(); ++i) {
    const ShardRegion& r = regions[i];
    if (r.length == 0 || r.data == nullptr) {
      return absl::InternalError(absl::StrCat("region ", i, " of the shard is empty"));
    }
    if (r.shard_offset != next) {
      return absl::InternalError(absl::StrCat("region ", i, " starts at shard offset ",
                                              r.shard_offset, ", expected ", next,
                                              " (regions must cover the shard in order)"));
    }
    if (r.length > std::numeric_limits<uint64_t>::max() - next) {
      return absl::InternalError(absl::StrCat("region ", i, " overflows"));
    }
    next += r.length;
  }
  if (next < size) {
    return absl::InternalError(
        absl::StrCat("regions cover ", next, " bytes, the shard needs ", size));
  }
  return absl::OkStatus();
}

uint32_t CopyToShard(std::span<const ShardRegion> regions, uint64_t offset,
                     std::span<const std::byte> src, uint32_t crc) {
  ForEachPiece(regions, offset, src.size(), [&](std::byte* p, uint64_t n, uint64_t done) {
    crc = Crc32cCopy(p, src.data() + done, n, crc);
  });
  return crc;
}

uint32_t CopyFromShard(std::span<const ShardRegion> regions, uint64_t offset,
                       std::span<std::byte> dst) {
  uint32_t crc = 0;
  ForEachPiece(regions, offset, dst.size(), [&](std::byte* p, uint64_t n, uint64_t done) {
    crc = Crc32cCopy(dst.data() + done, p, n, crc);
  });
  return crc;
}

uint32_t ZeroShard(std::span<const ShardRegion> regions, uint64_t offset, uint64_t n) {
  uint32_t crc = 0;
  ForEachPiece(regions, offset, n, [&](std::byte* p, uint64_t len, uint64_t) {
    std::memset(p, 0, len);
    crc = Crc32cExtend(crc, p, len);
  });
  return crc;
}

const std::byte* ContiguousRange(std::span<const ShardRegion> regions, uint64_t offset,
                                 uint64_t n) {
  if (regions.empty()) return nullptr;
  if (n == 0) {
    const ShardRegion& r = regions[RegionOf(regions, offset)];
    return r.data + (offset - r.shard_offset);
  }
  const std::byte* start = nullptr;
  const std::byte* expect = nullptr;
  bool contiguous = true;
  ForEachPiece(regions, offset, n, [&](std::byte* p, uint64_t len, uint64_t done) {
    if (done == 0) {
      start = p;
    } else if (p != expect) {
      contiguous = false;
    }
    expect = p + len;
  });
  return contiguous ? start : nullptr;
}

absl::StatusOr<Layout> LayOut(std::span<const uint64_t> lengths, uint64_t alignment) {
  if (alignment == 0) alignment = 1;
  if ((alignment & (alignment - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("item alignment ", alignment, " is not a power of two"));
  }
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  Layout layout;
  layout.offsets.reserve(lengths.size());
  uint64_t end = 0;
  for (uint64_t len : lengths) {
    if (end > kMax - (alignment - 1)) {
      return absl::InvalidArgumentError("shard size overflows 64 bits");
    }
    const uint64_t off = (end + alignment - 1) & ~(alignment - 1);
    if (len > kMax - off) return absl::InvalidArgumentError("shard size overflows 64 bits");
    layout.offsets.push_back(off);
    end = off + len;
  }
  layout.size = std::max<uint64_t>(end, 1);
  return layout;
}

}  // namespace ckpt::client
