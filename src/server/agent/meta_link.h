// MetaLink: what the agent needs from ckpt-meta, in domain types.
//
// The agent's logic (agent.h) talks to meta only through this interface:
// src/server/rpc/meta_link_grpc.* implements it over MetaService, and unit
// tests use an in-memory fake, so the agent's behaviour under meta failures
// (unreachable, restarted, fencing) is testable without processes.
//
// Every call blocks until meta answered or the call's deadline passed; errors
// are meta's (or UNAVAILABLE / DEADLINE_EXCEEDED when it cannot be reached).
// Implementations must be safe to call from several threads at once.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/durable_format.h"
#include "server/agent/types.h"

namespace ckpt::agent {

struct NodeRegistration {
  std::string node_id;
  std::string grpc_address;
  std::string data_address;
  std::string failure_domain;
  std::string agent_version;
  uint64_t memory_capacity_bytes = 0;
  uint64_t previous_incarnation = 0;
  std::string host_node_id;  // non-empty: a DPU agent serving that host
};

struct RegistrationReply {
  uint64_t incarnation = 0;
  int64_t lease_ms = 5000;
  int64_t heartbeat_ms = 1000;
  uint64_t meta_instance_id = 0;
  // The cluster's data-plane key from a meta that serves TLS; empty from an
  // --insecure one (RegisterNodeResponse.data_plane_key).
  std::string data_plane_key;
};

struct RunningTask {
  std::string task_id;
  uint32_t attempt = 0;
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
};

struct LoadReport {
  uint64_t memory_capacity_bytes = 0;
  uint64_t memory_used_bytes = 0;
  uint64_t memory_free_bytes = 0;
  uint64_t memory_leased_bytes = 0;
  uint64_t flush_lag_bytes = 0;
  int64_t flush_lag_ms = 0;
  uint64_t flush_errors_total = 0;
  std::vector<RunningTask> running;
  // Not load: the membership generation this agent holds (0: none), so that
  // meta sends the members only when they changed.
  uint64_t membership_generation = 0;
  // Not load: the agent is stopping on purpose (MetaSession::AnnounceStop),
  // so meta does not count its lease running out as a failure.
  bool stopping = false;
};

// A node that may push to and read from this agent (membership.h).
struct Member {
  std::string node_id;
  uint64_t incarnation = 0;
};

// One shard to write in a flush task.
struct FlushOrder {
  uint32_t rank = 0;
  std::string durable_path;  // relative to the durable root
  uint64_t size_bytes = 0;
  uint32_t crc32c = 0;
};

enum class TaskKind {
  kFlush,
  kCommitDurable,
  kEvict,
  kDrop,
  kDeleteDurable,
  kReplicate,
  kEcEncode,
  kRebuildSegments,
  kUnsupported,  // a kind this agent does not know
};

// How to reach a peer agent's data plane (ckpt.v1.NodeEndpoint).
struct PeerEndpoint {
  std::string node_id;
  uint64_t incarnation = 0;
  std::string data_address;
  // Meta saw the node SUSPECT (missed heartbeats) when it answered: read
  // from it last.
  bool suspect = false;
};


// Where one EC segment can be read (ckpt.v1.SegmentLocation).
struct SegmentLocation {
  SegmentId key;
  SegmentKind kind = SegmentKind::kData;
  uint64_t length_bytes = 0;
  uint32_t crc32c = 0;
  PeerEndpoint holder;
};

// ckpt.v1.EcStripeLayout / EcGroupLayout / BlobPart / NodeBlob.
struct EcStripeLayout {
  uint32_t stripe_index = 0;
  std::vector<std::string> data_node_ids;       // k
  std::vector<uint32_t> data_segment_indices;   // k
  std::vector<std::string> parity_node_ids;     // m
};
struct EcGroupLayout {
  uint32_t group_index = 0;
  std::vector<std::string> node_ids;
  uint32_t data_k = 0;
  uint32_t parity_m = 0;
  std::vector<EcStripeLayout> stripes;
};
struct BlobPart {
  uint32_t rank = 0;
  uint64_t blob_offset_bytes = 0;
  uint64_t size_bytes = 0;
};
struct NodeBlob {
  std::string node_id;
  std::vector<BlobPart> parts;
  uint64_t size_bytes = 0;
  uint64_t segment_bytes = 0;
};

// One segment to rebuild (ckpt.v1.SegmentRebuild).
struct SegmentRebuild {
  SegmentId target;
  SegmentKind kind = SegmentKind::kData;
  uint64_t length_bytes = 0;
  uint64_t stripe_length_bytes = 0;
  // The crc32c the rebuilt segment must have; nullopt when meta has never
  // seen the segment's contents (a parity that was never completed).
  std::optional<uint32_t> expected_crc32c;
  std::vector<SegmentLocation> sources;
};

// Restore sources (ckpt.v1.ShardSource and its EC parts), best first.
struct EcStripeSource {
  uint32_t stripe_index = 0;
  uint32_t blob_segment_index = 0;
  uint32_t position = 0;
  uint64_t stripe_length_bytes = 0;
  std::vector<SegmentLocation> segments;
};
struct EcDecodeSource {
  uint32_t group_index = 0;
  uint32_t data_k = 0;
  uint32_t parity_m = 0;
  std::string owner_node_id;
  uint64_t blob_offset_bytes = 0;
  uint64_t segment_bytes = 0;
  std::vector<EcStripeSource> stripes;
};

// Where a shard may be restored from (ckpt.v1.ShardSource).
struct ShardSource {
  enum class Kind { kLocal, kReplica, kEcDecode, kDurable };
  Kind kind = Kind::kLocal;
  PeerEndpoint holder;        // kLocal, kReplica
  EcDecodeSource ec;          // kEcDecode
  std::string durable_path;   // kDurable, relative to the durable root
};

// Meta's answer to Locate (ckpt.v1.LocateResponse): the shard as the version
// records it (id, size, crc32c, manifest digest and items, set with
// SetItems) and where it can be read, best first.
struct LocatedShard {
  ShardRecord shard;
  std::vector<ShardSource> sources;
};

// A work order from meta (see docs/protocol.md §7), reduced to what the
// agent runs.
struct AgentTask {
  std::string id;
  uint32_t attempt = 1;
  TaskKind kind = TaskKind::kUnsupported;
  std::string kind_name;  // for logs and errors
  int32_t priority = 0;
  std::string job_id;
  uint64_t step = 0;
  std::string durable_dir;         // flush, commit, delete
  std::vector<FlushOrder> flush;   // flush
  uint32_t world_size = 0;         // commit
  std::vector<ShardId> drop;       // drop (shard holdings)
  std::vector<SegmentId> drop_segments;  // drop (segment holdings)
  std::string reason;              // drop
  std::vector<uint32_t> ranks;             // replicate
  std::vector<PeerEndpoint> targets;       // replicate
  EcGroupLayout group;                     // ec_encode
  std::vector<NodeBlob> blobs;             // ec_encode
  std::vector<PeerEndpoint> members;       // ec_encode, group order
  uint32_t data_k = 0;                     // rebuild_segments
  uint32_t parity_m = 0;                   // rebuild_segments
  std::vector<SegmentRebuild> rebuilds;    // rebuild_segments
};

struct HeartbeatReply {
  NodeState node_state = NodeState::kAlive;
  bool inventory_required = false;
  int64_t lease_ms = 5000;
  int64_t heartbeat_ms = 1000;
  uint64_t meta_instance_id = 0;
  std::vector<AgentTask> tasks;
  std::vector<std::string> cancelled_task_ids;
  uint64_t membership_generation = 0;  // 0: meta sends no membership
  std::optional<std::vector<Member>> members;  // when it differs from ours
};

// A report about one of this node's holdings (ReportShards).
struct HoldingReport {
  enum class Kind { kStaged, kPersisted, kCopyState, kSegment };
  Kind kind = Kind::kStaged;
  // kStaged: the full record (items, crc, digest, run id), shared with the
  // holding table (a commit of 10,000 items does not copy them again).
  std::shared_ptr<const ShardRecord> record;
  ShardId id;          // kPersisted, kCopyState
  std::string durable_path;
  uint64_t size_bytes = 0;
  uint32_t crc32c = 0;
  std::string task_id;
  CopyRole copy_role = CopyRole::kPrimary;
  CopyState copy_state = CopyState::kValid;  // kCopyState, kSegment
  std::string detail;
  SegmentId segment;   // kSegment (size_bytes = unpadded length)
  SegmentKind segment_kind = SegmentKind::kData;
};

struct ReportReply {
  std::vector<absl::Status> results;  // one per report
  std::vector<AgentTask> tasks;
};

// An entry of this node's inventory (ReportInventory).
struct InventoryItem {
  ShardId id;
  bool is_segment = false;  // then `segment` and `segment_kind` say which
  SegmentId segment;
  SegmentKind segment_kind = SegmentKind::kData;
  CopyRole role = CopyRole::kPrimary;
  CopyState state = CopyState::kValid;
  uint64_t size_bytes = 0;
  uint32_t crc32c = 0;
  uint64_t manifest_digest = 0;
  int64_t stored_unix_ms = 0;
  std::string durable_path;
};

struct InventoryReply {
  std::vector<ShardId> drop;  // holdings meta says to delete
  std::vector<SegmentId> drop_segments;
  std::vector<ShardId> unknown;
  uint32_t kept = 0;
};

// A version this node holds a copy of became restorable from memory
// (`staged`: STAGED or better, not evicted) or stopped being so
// (ckpt.v1.VersionNotice).
struct VersionNotice {
  std::string job_id;
  uint64_t step = 0;
  bool staged = false;
};

class MetaLink {
 public:
  virtual ~MetaLink() = default;
  virtual absl::StatusOr<RegistrationReply> Register(const NodeRegistration& node) = 0;
  virtual absl::StatusOr<HeartbeatReply> Heartbeat(const std::string& node_id, uint64_t incarnation,
                                                   const LoadReport& load) = 0;
  virtual absl::StatusOr<InventoryReply> ReportInventory(const std::string& node_id,
                                                         uint64_t incarnation,
                                                         const std::vector<InventoryItem>& items) = 0;
  // The job's world size (read-only: no write at meta). NotFound for an
  // unknown job.
  virtual absl::StatusOr<uint32_t> JobWorldSize(const std::string& job_id) = 0;
  // Begins (or finds) the version; returns the job's world size.
  virtual absl::StatusOr<uint32_t> BeginVersion(const std::string& job_id, uint64_t step,
                                                const std::string& run_id,
                                                const std::string& node_id) = 0;
  virtual absl::StatusOr<ReportReply> ReportShards(const std::string& node_id, uint64_t incarnation,
                                                   const std::vector<HoldingReport>& reports) = 0;
  // Returns OK when meta recorded the result (any disposition).
  virtual absl::Status ReportTaskResult(const std::string& node_id, uint64_t incarnation,
                                        const std::string& task_id, uint32_t attempt,
                                        const absl::Status& result, uint64_t bytes_processed,
                                        int64_t duration_ms) = 0;
  // What node-local eviction needs to know about a version: its state
  // (ckpt.v1.VersionState number) and the job's newest step at PROTECTED
  // level or better (nullopt if none). NotFound for an unknown job/version.
  struct EvictFacts {
    int version_state = 0;
    std::optional<uint64_t> newest_protected_step;
  };
  virtual absl::StatusOr<EvictFacts> GetEvictFacts(const std::string& job_id, uint64_t step) = 0;

  // The version's full manifest for its durable directory (every rank's size,
  // crc, digest and items). FailedPrecondition if some rank is not staged.
  virtual absl::StatusOr<DurableManifest> GetVersionManifest(const std::string& job_id,
                                                             uint64_t step) = 0;

  // Where meta says `id` can be read from (MetaService.Locate, with items),
  // asked for a caller on `near_node_id` (a VALID copy there comes back as
  // kLocal). The restorer reads only sources this names (docs/security.md).
  // Meta's errors: NotFound (unknown job, version or rank), FailedPrecondition
  // (the version is not restorable), DataLoss (no readable source left).
  // This default (a link that cannot ask): Unimplemented, and restores from
  // anything but the local copy are refused.
  virtual absl::StatusOr<LocatedShard> Locate(const ShardId& id, const std::string& near_node_id) {
    return absl::UnimplementedError("this meta link cannot ask meta where a shard lives (Locate)");
  }

  // Opens meta's task stream for one incarnation and calls `on_push` for
  // every push (new tasks, cancelled task ids, version notices) until the stream ends (stale
  // incarnation, meta shutting down or unreachable) or CancelWatch() is
  // called; returns why it ended. Implementations without a stream return
  // Unimplemented at once (tasks then arrive with heartbeats only).
  using TaskPush = std::function<void(std::vector<AgentTask> tasks, std::vector<std::string> cancelled,
                                      std::vector<VersionNotice> versions)>;
  virtual absl::Status WatchTasks(const std::string& node_id, uint64_t incarnation, const TaskPush& on_push) {
    return absl::UnimplementedError("no task stream");
  }
  // Ends a WatchTasks call in progress (from another thread). Idempotent.
  virtual void CancelWatch() {}
};

}  // namespace ckpt::agent
