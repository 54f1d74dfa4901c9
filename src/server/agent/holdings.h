// HoldingTable: what this node holds in its memory tier: shard copies
// (primary, replica, restored), EC segments (parity, rebuilt data), the data
// segments its blobs provide, which copies are verified or quarantined, and
// the queue of copies the verifier has yet to check.
//
// Ownership. A holding owns its bytes through a shared Reservation
// (arena.h). Whoever reads or sends a holding's bytes first takes a Pin (the
// record and a reference to the bytes); dropping a holding removes it from
// the table and its record file at once, but its pool space is freed only when
// the last Pin is released. So a drop, an eviction or a quarantine never pulls
// memory from under a transfer, a verification or a client handle.
//
// Locking. One mutex guards the maps. It is never held across a crc, a file
// write or a call into another component: records are written before a
// holding is published and removed after it is unpublished (each record write
// gets a fresh file name, so neither needs the lock), and reports to meta go
// out through the report callback after the lock is released. The only lock
// taken under it is the arena's (a Reservation freed when a map entry goes).
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "server/agent/agent_metrics.h"
#include "server/agent/arena.h"
#include "server/agent/meta_link.h"

namespace ckpt::agent {

// A holding as status and inventory calls show it.
struct HoldingInfo {
  ShardId id;
  std::optional<SegmentId> segment;  // set for an EC segment holding
  SegmentKind segment_kind = SegmentKind::kData;
  CopyRole role = CopyRole::kPrimary;
  CopyState state = CopyState::kValid;
  uint64_t size_bytes = 0;
  uint32_t crc32c = 0;
  uint64_t manifest_digest = 0;
  int64_t stored_unix_ms = 0;
  std::string durable_path;
  bool verified = false;
};

// A holding's record and bytes, kept alive while the Pin lives.
struct Pin {
  std::shared_ptr<const ShardRecord> rec;
  ReservationPtr bytes;
};

// The primaries of one version on this node (its "blob", in rank order),
// pinned.
struct BlobPin {
  std::vector<Pin> shards;
  transport::ConstPieces pieces;
  uint64_t size_bytes = 0;
};

// A data segment this node's blob provides (not a separate holding).
struct OwnedSegment {
  uint64_t length_bytes = 0;
  uint32_t crc32c = 0;
  uint32_t data_k = 0;
  uint32_t blob_segment_index = 0;
};

// Checks every item crc and the shard crc of `rec`'s bytes. OK, or DataLoss
// naming the first bad item; *actual_crc gets the bytes' crc. Reads the bytes
// (call without locks).
absl::Status CheckShardBytes(const ShardRecord& rec, const Reservation& bytes, uint32_t* actual_crc,
                             std::string* bad_item);

class HoldingTable {
 public:
  using ReportFn = std::function<void(HoldingReport)>;
  // `arena`, `clock` and `metrics` must outlive the table; `report` queues a
  // report for meta (called without the table's lock).
  HoldingTable(Arena* arena, Clock* clock, AgentMetrics* metrics, ReportFn report);

  // Takes the holdings the arena re-adopted (their crcs were checked).
  // Returns the primaries among them (their STAGED reports are replayed).
  std::vector<ShardRecord> Adopt(std::vector<AdoptedHolding> adopted);

  // ---- shard copies ----
  // Records `rec` (its extents are `bytes`') and publishes it. With
  // if_absent, AlreadyExists when a VALID copy is already held (and nothing
  // changes); otherwise a held copy (e.g. a quarantined one) is replaced.
  // Unavailable when the record cannot be written (nothing is kept).
  // `stored`, if given, receives the record as held (no copy of its items).
  absl::Status Add(ShardRecord rec, ReservationPtr bytes, bool verified, bool if_absent,
                   std::shared_ptr<const ShardRecord>* stored = nullptr);
  // A VALID copy, pinned. NotFound when none is held; DataLoss naming the
  // reason when the copy here is quarantined.
  absl::StatusOr<Pin> PinValid(const ShardId& id) const;
  bool HoldsValid(const ShardId& id) const;
  bool Holds(const ShardId& id) const;
  // Whether the copy's bytes were checked (false if not held).
  bool Verified(const ShardId& id) const;
  // Marks the pinned copy (if it is still the one held) verified, or
  // quarantined (reported CORRUPT; later pins get DataLoss).
  void MarkVerified(const Pin& pin);
  void Quarantine(const Pin& pin, const std::string& why);
  // Records that the pinned copy is in the durable tier at `path`.
  absl::Status SetDurablePath(const Pin& pin, const std::string& path);
  // Drops shard copies (records removed now, bytes freed with the last pin).
  // Returns what was dropped.
  std::vector<HoldingInfo> DropShards(const std::function<bool(const ShardRecord&)>& which);
  void DropShard(const ShardId& id);

  // Verification queue: copies committed here and not yet checked.
  void QueueVerify(const ShardId& id);
  std::optional<Pin> NextToVerify();

  // ---- EC ----
  // This node's primaries of (job, step) in rank order, pinned. DataLoss if
  // one is quarantined; FailedPrecondition if one is not verified yet.
  absl::StatusOr<BlobPin> PinBlob(const std::string& job, uint64_t step) const;
  // Records and publishes a segment holding, replacing an older one, and
  // reports it VALID (with `task_id`). Unavailable if the record cannot be
  // written.
  absl::Status AddSegment(ShardRecord rec, ReservationPtr bytes, const std::string& task_id);
  absl::StatusOr<Pin> PinSegment(const SegmentId& id) const;
  bool HasValidSegment(const SegmentId& id) const;
  void QuarantineSegment(const Pin& pin, const std::string& why, uint32_t actual_crc);
  void SetOwned(const SegmentId& id, const OwnedSegment& owned);
  std::optional<OwnedSegment> Owned(const SegmentId& id) const;
  void DropSegment(const SegmentId& id);  // holding and owned descriptor
  // Drops everything of a version (shards, segments, owned segments).
  size_t DropVersion(const std::string& job, uint64_t step);

  // ---- views ----
  std::vector<HoldingInfo> Infos(const std::string& job, std::optional<uint64_t> step) const;
  std::vector<HoldingInfo> SegmentInfos(const std::string& job, std::optional<uint64_t> step) const;
  std::vector<InventoryItem> InventoryItems() const;
  std::vector<Pin> PinShardsOf(const std::string& job, uint64_t step) const;
  std::vector<Pin> PinSegmentsOf(const std::string& job, uint64_t step) const;
  // "job step 7: 1.0 GiB (4 shards), ..." for budget errors.
  std::string HeldSummary() const;
  size_t shard_count() const;
  uint64_t SizeOf(const ShardId& id) const;  // 0 if not held

 private:
  struct Holding {
    std::shared_ptr<const ShardRecord> rec;
    ReservationPtr bytes;
    bool corrupt = false;
    std::string corrupt_detail;
    bool verified = false;
  };
  static HoldingInfo InfoOf(const Holding& h);
  // Removes record files (outside the lock), logging failures.
  void RemoveRecords(const std::vector<std::string>& files);
  void UpdateGauge() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Arena* const arena_;
  Clock* const clock_;
  AgentMetrics* const metrics_;
  const ReportFn report_;

  mutable absl::Mutex mu_;
  std::map<ShardId, Holding> shards_ ABSL_GUARDED_BY(mu_);
  std::map<SegmentId, Holding> segments_ ABSL_GUARDED_BY(mu_);
  std::map<SegmentId, OwnedSegment> owned_ ABSL_GUARDED_BY(mu_);
  std::deque<ShardId> verify_queue_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::agent
