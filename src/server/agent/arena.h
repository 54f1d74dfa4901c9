// Arena: the agent's memory tier, a pre-allocated pool on a tmpfs.
//
// Shard bytes live in one file, `<memory-dir>/pool.bin`, sized to the agent's
// memory budget, allocated (fallocate) and mapped with MAP_POPULATE when the
// arena opens, so a save never pays for page faults or allocation: clients map
// the same file (MAP_SHARED) and copy straight into it. Because the file lives
// on a tmpfs owned by the agent, its bytes outlive both the trainer and the
// agent process; they are lost only with the machine.
//
// Space is handed out in 4 KiB pages as a list of extents (first fit, several
// extents when no single hole is large enough). Every committed holding has a
// record, `<memory-dir>/records/<job>.<step>.<rank>.rec` (JSON, written to a
// temporary name and renamed, so a record is either whole or absent). On
// Open() after a restart, every record whose extents still hash to its crc32c
// is re-adopted; the others are returned as lost (and their records removed),
// and all space not covered by an adopted record is free again (open leases
// of a crashed agent are simply forgotten).
//
// Thread safety: all methods are safe to call concurrently. The bytes of an
// extent are not protected by the arena's lock: whoever holds the allocation
// owns them (a client writing a lease, readers of a committed holding).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/manifest.h"

namespace ckpt::agent {

inline constexpr uint64_t kArenaPageBytes = 4096;

// A byte range of the pool file. offset and length are multiples of
// kArenaPageBytes except that the last extent of an allocation may be used
// only partly (the allocation's size says how much).
struct Extent {
  uint64_t offset = 0;
  uint64_t length = 0;
  bool operator==(const Extent&) const = default;
};

// Identifies a shard: one rank's bytes of one version.
struct ShardId {
  std::string job_id;
  uint64_t step = 0;
  uint32_t rank = 0;
  auto operator<=>(const ShardId&) const = default;
};
std::string ShardIdString(const ShardId& id);  // "job/step/rank" for messages

// One EC segment of a version (ckpt.v1.SegmentKey): position `position` of
// stripe `stripe` of group `group`; positions k.. are parity.
struct SegmentId {
  std::string job_id;
  uint64_t step = 0;
  uint32_t group = 0;
  uint32_t stripe = 0;
  uint32_t position = 0;
  auto operator<=>(const SegmentId&) const = default;
};
std::string SegmentIdString(const SegmentId& id);  // "job/step/g0.s1.p2"

inline constexpr int kSegmentData = 1;    // ckpt.v1.SegmentKind
inline constexpr int kSegmentParity = 2;

// What the agent keeps about a committed shard, persisted in its record.
struct ShardRecord {
  ShardId id;
  int role = 1;  // ckpt.v1.CopyRole number (1 primary, 2 replica, 3 restored)
  uint64_t size_bytes = 0;
  uint32_t crc32c = 0;
  uint64_t manifest_digest = 0;
  std::vector<ManifestItem> items;
  std::vector<Extent> extents;  // cover size_bytes, in shard order
  std::string run_id;
  int64_t staged_unix_ms = 0;
  // Relative durable path once this node wrote the shard to the durable tier.
  std::string durable_path;
  // Set for an EC segment holding (parity, or a data segment rebuilt on this
  // node) instead of a shard copy: id.rank is then 0 and items are empty.
  std::optional<SegmentId> segment;
  int segment_kind = 0;  // kSegmentData / kSegmentParity
};

// A record found on Open() whose bytes no longer match (or whose record was
// unreadable): the holding is gone.
struct LostHolding {
  ShardId id;        // empty job_id if the record itself was unreadable
  std::string file;  // record file name
  std::string reason;
};

class Arena {
 public:
  struct Options {
    std::string dir;            // the memory directory (created 0750 if missing)
    uint64_t capacity_bytes = 0;  // rounded up to a page
    bool populate = true;       // fallocate + MAP_POPULATE now (tests may skip)
  };

  // Opens (creating if needed) the pool and re-adopts committed holdings.
  // Fails with InvalidArgument for a zero capacity, ResourceExhausted if the
  // tmpfs cannot hold the pool (the message says how much it has), or the
  // underlying I/O error. Blocks while pre-faulting (about 0.1 s per GiB).
  static absl::StatusOr<std::unique_ptr<Arena>> Open(const Options& options);
  ~Arena();

  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Reserves `size_bytes` (rounded up to pages) as one or more extents.
  // ResourceExhausted if the free space is smaller (the caller adds context).
  absl::StatusOr<std::vector<Extent>> Allocate(uint64_t size_bytes);

  // Returns extents to the free list (and coalesces). Extents must come from
  // Allocate() and must not be freed twice.
  void Free(std::span<const Extent> extents);

  // Shrinks an allocation to `size_bytes` (page-rounded), freeing the tail.
  std::vector<Extent> Trim(std::vector<Extent> extents, uint64_t size_bytes);

  // Writes `record`'s file atomically (temp + rename). The extents must be
  // allocated. Errors from the file system are returned as they are.
  absl::Status WriteRecord(const ShardRecord& record);

  // Removes a record file; OK if it is already gone.
  absl::Status RemoveRecord(const ShardId& id);
  absl::Status RemoveSegmentRecord(const SegmentId& id);

  // Holdings re-adopted by Open() (their extents are allocated), and the ones
  // that were lost. Both are filled once, at Open().
  const std::vector<ShardRecord>& adopted() const { return adopted_; }
  const std::vector<LostHolding>& lost() const { return lost_; }

  // Address of pool byte `offset` in the agent's own mapping.
  std::byte* Data(uint64_t offset) const { return base_ + offset; }

  // Calls fn(ptr, len) for the bytes [0, size) of an allocation, extent by
  // extent, in shard order.
  template <typename Fn>
  void ForEachPiece(std::span<const Extent> extents, uint64_t size, Fn&& fn) const {
    uint64_t left = size;
    for (const Extent& e : extents) {
      if (left == 0) break;
      const uint64_t n = e.length < left ? e.length : left;
      fn(Data(e.offset), n);
      left -= n;
    }
  }

  // CRC-32C of the first `size` bytes of an allocation.
  uint32_t Checksum(std::span<const Extent> extents, uint64_t size) const;

  const std::string& pool_path() const { return pool_path_; }
  const std::string& dir() const { return dir_; }
  uint64_t capacity_bytes() const { return capacity_; }
  uint64_t free_bytes() const;
  uint64_t largest_free_extent() const;

 private:
  Arena() = default;
  absl::Status Init(const Options& options);
  void Adopt();
  std::string RecordPath(const ShardId& id) const;
  std::string SegmentRecordPath(const SegmentId& id) const;
  void ReserveLocked(const Extent& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::string dir_;
  std::string pool_path_;
  std::string records_dir_;
  uint64_t capacity_ = 0;
  int fd_ = -1;
  std::byte* base_ = nullptr;

  mutable absl::Mutex mu_;
  std::map<uint64_t, uint64_t> free_ ABSL_GUARDED_BY(mu_);  // offset -> length
  uint64_t free_total_ ABSL_GUARDED_BY(mu_) = 0;

  std::vector<ShardRecord> adopted_;
  std::vector<LostHolding> lost_;
};

// Record (de)serialisation, exposed for tests.
std::string EncodeShardRecord(const ShardRecord& record);
absl::StatusOr<ShardRecord> DecodeShardRecord(std::string_view json);

}  // namespace ckpt::agent
