#include "client/region_io.h"

#include <algorithm>
#include <cassert>
#include <cstring>
#include <thread>
#include <vector>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"

namespace ckpt::client {

namespace {
constexpr size_t kParallelCopyMinBytes = 8 << 20;  // below: one thread is faster
constexpr size_t kCopyAlign = 64 << 10;
}  // namespace
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

unsigned CopyThreadCount() {
  static const unsigned kThreads = std::clamp(std::thread::hardware_concurrency(), 1u, 4u);
  return kThreads;
}

uint32_t ParallelCrc32cCopy(void* dst, const void* src, size_t n, uint32_t crc, unsigned threads) {
  // One memcpy stream does not saturate memory bandwidth: with 2 cores, copy +
  // crc on 2 threads runs at about 0.6x of one plain memcpy here. The trainer
  // is blocked anyway, so its idle cores help.
  const unsigned kThreads = threads == 0 ? CopyThreadCount() : threads;
  if (n < kParallelCopyMinBytes || kThreads == 1) return Crc32cCopy(dst, src, n, crc);
  // Each part is ceil(n / kThreads) rounded up to kCopyAlign, so the parts
  // cover all n bytes (rounding n / kThreads down would drop the remainder
  // whenever n / kThreads is already aligned).
  const size_t per_thread = (n + kThreads - 1) / kThreads;
  const size_t part = (per_thread + kCopyAlign - 1) / kCopyAlign * kCopyAlign;
  std::vector<uint32_t> crcs(kThreads, 0);
  std::vector<size_t> lens(kThreads, 0);
  std::vector<std::thread> helpers;
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  for (unsigned t = 0; t < kThreads; ++t) {
    const size_t begin = std::min(n, t * part);
    lens[t] = std::min(n, begin + part) - begin;
    if (t == 0 || lens[t] == 0) continue;
    helpers.emplace_back([&, t, begin] { crcs[t] = Crc32cCopy(d + begin, s + begin, lens[t]); });
  }
  crcs[0] = Crc32cCopy(d, s, lens[0]);
  for (std::thread& h : helpers) h.join();
  for (unsigned t = 0; t < kThreads; ++t) crc = Crc32cCombine(crc, crcs[t], lens[t]);
  return crc;
}

uint32_t CopyToShard(std::span<const ShardRegion> regions, uint64_t offset,
                     std::span<const std::byte> src, uint32_t crc, CopyThreads threads) {
  ForEachPiece(regions, offset, src.size(), [&](std::byte* p, uint64_t n, uint64_t done) {
    crc = threads == CopyThreads::kAll ? ParallelCrc32cCopy(p, src.data() + done, n, crc)
                                       : Crc32cCopy(p, src.data() + done, n, crc);
  });
  return crc;
}

uint32_t CopyFromShard(std::span<const ShardRegion> regions, uint64_t offset,
                       std::span<std::byte> dst) {
  uint32_t crc = 0;
  ForEachPiece(regions, offset, dst.size(), [&](std::byte* p, uint64_t n, uint64_t done) {
    crc = ParallelCrc32cCopy(dst.data() + done, p, n, crc);
  });
  return crc;
}

std::vector<uint32_t> CopyItemsFromShard(std::span<const ItemRead> items, unsigned threads) {
  const unsigned k = threads == 0 ? CopyThreadCount() : threads;
  std::vector<uint32_t> crcs(items.size(), 0);
  // starts[i]: where item i begins in the stream of all items' bytes.
  std::vector<uint64_t> starts(items.size() + 1, 0);
  for (size_t i = 0; i < items.size(); ++i) starts[i + 1] = starts[i] + items[i].dst.size();
  const uint64_t total = starts.back();
  // Stream bytes [begin, end) of item i, from the calling thread.
  auto copy = [&](size_t i, uint64_t begin, uint64_t end) {
    uint32_t crc = 0;
    ForEachPiece(items[i].regions, items[i].offset + begin, end - begin, [&](std::byte* p, uint64_t n, uint64_t done) {
      crc = Crc32cCopy(items[i].dst.data() + begin + done, p, n, crc);
    });
    return crc;
  };
  if (k == 1 || total < kParallelCopyMinBytes) {
    for (size_t i = 0; i < items.size(); ++i) crcs[i] = copy(i, 0, items[i].dst.size());
    return crcs;
  }
  // Part t is stream bytes [t * part, (t + 1) * part): the pieces of the
  // items it overlaps, with their crcs, combined in stream order at the end.
  const uint64_t part = ((total + k - 1) / k + kCopyAlign - 1) / kCopyAlign * kCopyAlign;
  struct Piece {
    size_t item;
    uint64_t length;
    uint32_t crc;
  };
  std::vector<std::vector<Piece>> pieces(k);
  auto run = [&](unsigned t) {
    const uint64_t begin = std::min(total, t * part), end = std::min(total, begin + part);
    if (begin == end) return;
    // The first item that ends after `begin` (empty items are skipped).
    size_t i = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin()) - 1;
    for (; i < items.size() && starts[i] < end; ++i) {
      const uint64_t from = std::max(begin, starts[i]) - starts[i];
      const uint64_t to = std::min(end, starts[i + 1]) - starts[i];
      if (from < to) pieces[t].push_back(Piece{i, to - from, copy(i, from, to)});
    }
  };
  std::vector<std::thread> helpers;
  helpers.reserve(k - 1);
  for (unsigned t = 1; t < k; ++t) helpers.emplace_back(run, t);
  run(0);
  for (std::thread& h : helpers) h.join();
  for (const std::vector<Piece>& list : pieces) {
    for (const Piece& p : list) crcs[p.item] = Crc32cCombine(crcs[p.item], p.crc, p.length);
  }
  return crcs;
}

std::vector<CopiedItem> CopyItemsToShard(std::span<const ShardRegion> regions, std::span<const ItemCopy> items,
                                         unsigned threads) {
  const unsigned kThreads = threads == 0 ? CopyThreadCount() : threads;
  uint64_t total = 0;
  for (const ItemCopy& it : items) total += it.src.size();
  if (kThreads == 1 || items.size() < 64 || total < (4u << 20)) return {};
  std::vector<CopiedItem> out(items.size());
  // Items [begin, end): padding before each zeroed, bytes copied, crcs kept.
  auto run = [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const uint64_t prev_end = i == 0 ? 0 : items[i - 1].offset + items[i - 1].src.size();
      if (items[i].offset > prev_end) out[i].gap_crc = ZeroShard(regions, prev_end, items[i].offset - prev_end);
      out[i].crc = CopyToShard(regions, items[i].offset, items[i].src, 0, CopyThreads::kOne);
    }
  };
  // Cut points: the first item at or past each 1/kThreads of the bytes.
  std::vector<size_t> cut = {0};
  uint64_t seen = 0;
  for (size_t i = 0; i < items.size() && cut.size() < kThreads; ++i) {
    if (seen >= total / kThreads * cut.size() && i > cut.back()) cut.push_back(i);
    seen += items[i].src.size();
  }
  cut.push_back(items.size());
  std::vector<std::thread> helpers;
  for (size_t t = 1; t + 1 < cut.size(); ++t) helpers.emplace_back(run, cut[t], cut[t + 1]);
  run(cut[0], cut[1]);
  for (std::thread& h : helpers) h.join();
  return out;
}

uint32_t ShardRangeCrc(std::span<const ShardRegion> regions, uint64_t offset, uint64_t n) {
  uint32_t crc = 0;
  ForEachPiece(regions, offset, n, [&](std::byte* p, uint64_t len, uint64_t) { crc = Crc32cExtend(crc, p, len); });
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
