// The metadata service's domain model: nodes, jobs, versions, shards, copies,
// EC segments and tasks, as plain C++ values (docs/architecture.md "Data model").
//
// These mirror the meanings of the ckpt.v1 protocol messages (the rpc layer
// translates; enum values are numerically equal to the proto enums so the
// translation is a cast). Times named *_ms are wall-clock Unix milliseconds from
// meta's Clock unless stated otherwise.
//
// Thread safety: plain values; MetaCore owns the live instances under its lock
// and hands out copies.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/time/time.h"
#include "common/names.h"
#include "server/meta/policy.h"

namespace ckpt::meta {

enum class VersionState {
  kOpen = 1,
  kStaged = 2,
  kProtected = 3,
  kPersisted = 4,
  kDegraded = 5,
  kAborted = 6,
  kDeleted = 7,
};
enum class Level { kStaged = 1, kProtected = 2, kPersisted = 3 };
enum class NodeState { kAlive = 1, kSuspect = 2, kDead = 3, kDraining = 4, kLeft = 5 };
enum class NodeRole { kHost = 1, kDpu = 2 };
enum class CopyRole { kPrimary = 1, kReplica = 2, kRestored = 3 };
enum class CopyState { kPending = 1, kValid = 2, kCorrupt = 3, kLost = 4, kEvicted = 5 };
enum class SegmentKind { kData = 1, kParity = 2 };
enum class SourceKind { kLocal = 1, kReplica = 2, kEcDecode = 3, kDurable = 4 };

const char* VersionStateName(VersionState s);  // "OPEN", "STAGED", ...
const char* NodeStateName(NodeState s);        // "ALIVE", ...
const char* LevelName(Level l);                // "STAGED", ...
const char* CopyStateName(CopyState s);        // "VALID", ...

// Whether a version in state `s` satisfies durability level `l`:
//   STAGED: STAGED, PROTECTED, PERSISTED, DEGRADED; PROTECTED: PROTECTED,
//   PERSISTED; PERSISTED: PERSISTED.
bool SatisfiesLevel(VersionState s, Level l);
// ABORTED and DELETED.
inline bool IsTerminal(VersionState s) {
  return s == VersionState::kAborted || s == VersionState::kDeleted;
}
// A node in state `s` can serve reads and run tasks: ALIVE, SUSPECT or
// DRAINING (not DEAD or LEFT). MetaCore's Engine::IsUsable(node_id).
inline bool NodeIsUsable(NodeState s) {
  return s == NodeState::kAlive || s == NodeState::kSuspect || s == NodeState::kDraining;
}
// Holdings on a node in state `s` count toward protection: ALIVE or SUSPECT.
inline bool NodeCountsForProtection(NodeState s) {
  return s == NodeState::kAlive || s == NodeState::kSuspect;
}

// ---------------------------------------------------------------------------
// Nodes

struct Node {
  std::string id;
  std::string grpc_address;
  std::string data_address;
  NodeRole role = NodeRole::kHost;
  std::string failure_domain;
  std::string agent_version;
  uint64_t incarnation = 0;
  NodeState state = NodeState::kAlive;
  uint64_t memory_capacity_bytes = 0;
  uint64_t memory_used_bytes = 0;
  uint64_t memory_free_bytes = 0;
  uint64_t memory_leased_bytes = 0;
  uint64_t flush_lag_bytes = 0;
  int64_t flush_lag_ms = 0;
  uint64_t flush_errors_total = 0;
  int64_t registered_ms = 0;
  int64_t last_heartbeat_ms = 0;
  int64_t lease_expiry_ms = 0;
  int64_t state_since_ms = 0;
  int64_t first_seen_ms = 0;  // first registration of this node id (any incarnation)
  // Leases expired + re-registrations while the lease ran, except after a
  // clean stop (`stopping`) or a drain: what the MTBF counts.
  uint64_t failures = 0;
  // The agent said it is stopping on purpose (HeartbeatRequest::stopping);
  // cleared when it registers again.
  bool stopping = false;
  // Set by DrainNode, cleared only by UndrainNode (or RemoveNode): a drained
  // node registers again as DRAINING, whatever its agent does meanwhile.
  bool drained = false;
  // A DPU agent: the node id of the host it serves ("" for a host agent).
  std::string host_node_id;

  // Not persisted: per meta process.
  absl::Time lease_deadline;        // on Clock::MonotonicNow()
  bool inventory_received = false;  // since this meta process started
  // Filled in query results only: tasks assigned and not finished.
  uint32_t pending_tasks = 0;
};

// The failure domain placement uses for node `id` (docs/dpu.md): its own
// label, except that a DPU agent and the host it serves are one domain (the
// host's label if it has one, else "host:<host id>" for both).
std::string PlacementDomain(const std::map<std::string, Node>& nodes, const std::string& id, const Node& node);

// How to reach a node (a resolved snapshot).
struct Endpoint {
  std::string node_id;
  uint64_t incarnation = 0;
  std::string grpc_address;
  std::string data_address;
  // The node's state when the snapshot was taken (readers may start a
  // fallback early for a SUSPECT holder).
  NodeState state = NodeState::kAlive;
};

// ---------------------------------------------------------------------------
// Jobs

struct FlushPolicy {
  uint32_t every_n_versions = 0;  // 0: rule off
  uint32_t every_seconds = 0;     // 0: rule off
};

struct RetentionPolicy {
  static constexpr uint32_t kDefaultKeepInMemory = 2;
  uint32_t keep_in_memory = 0;  // 0: kDefaultKeepInMemory
  uint32_t keep_durable = 0;    // 0: keep all
  uint32_t EffectiveKeepInMemory() const {
    return keep_in_memory == 0 ? kDefaultKeepInMemory : keep_in_memory;
  }
};

struct JobSpec {
  static constexpr uint32_t kMaxWorldSize = ckpt::kMaxWorldSize;  // common/names.h
  std::string job_id;
  uint32_t world_size = 0;
  ProtectionPolicy protection;
  FlushPolicy flush;
  RetentionPolicy retention;
  std::map<std::string, std::string> labels;
};

struct Job {
  JobSpec spec;
  int64_t created_ms = 0;
  uint64_t plan_epoch = 0;
  bool deleting = false;
  bool delete_durable_files = false;
  // Flush policy bookkeeping.
  uint64_t versions_since_flush = 0;
  int64_t last_flush_begin_ms = 0;
  bool any_flushed = false;
};

// ---------------------------------------------------------------------------
// Versions

struct Item {
  std::string name;
  int dtype = 0;  // ckpt.v1.DType number
  std::vector<uint64_t> shape;
  uint64_t offset_bytes = 0;
  uint64_t length_bytes = 0;
  uint32_t crc32c = 0;
  std::map<std::string, std::string> attributes;
  // >= 0: a reference to the same rank's item bytes in version ref_step
  // (docs/protocol.md "Incremental saves"); -1: the bytes are in this shard.
  int64_t ref_step = -1;
};

// The distinct ref_steps of `items`, ascending.
std::vector<uint64_t> RefStepsOf(const std::vector<Item>& items);

struct Copy {
  std::string node_id;
  CopyRole role = CopyRole::kPrimary;
  CopyState state = CopyState::kValid;
  int64_t updated_ms = 0;
  std::string detail;
};

struct Shard {
  uint32_t rank = 0;
  uint64_t size_bytes = 0;
  uint32_t crc32c = 0;
  uint64_t manifest_digest = 0;
  std::vector<Item> items;
  // The versions this shard's references point to, ascending (derived from
  // items when it is staged or loaded; not stored on its own).
  std::vector<uint64_t> ref_steps;
  std::string primary_node_id;
  int64_t staged_ms = 0;  // agent's clock
  std::vector<Copy> copies;
  std::string durable_path;  // relative to the durable root; set when planned
  bool durable_written = false;
  int64_t durable_written_ms = 0;
};

// One node's blob: its primary shards end to end in rank order (EC unit).
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

// An EC group as frozen into a version: members in group order.
struct EcGroup {
  int index = 0;
  std::vector<std::string> members;
  int data_k = 0;
  int parity_m = 0;
};

struct SegmentKey {
  int group = 0;
  int stripe = 0;
  int position = 0;  // 0..k-1 data, k..k+m-1 parity
  friend bool operator==(const SegmentKey&, const SegmentKey&) = default;
  friend auto operator<=>(const SegmentKey&, const SegmentKey&) = default;
};

struct Segment {
  SegmentKey key;
  SegmentKind kind = SegmentKind::kData;
  std::string owner_node_id;  // data only
  int blob_segment = 0;       // data only
  uint64_t length_bytes = 0;  // unpadded (parity: stripe length)
  uint32_t crc32c = 0;        // 0 until reported
  bool crc_known = false;     // crc32c was reported (0 is a valid crc)
  std::string holder_node_id;
  CopyState state = CopyState::kPending;
  int64_t updated_ms = 0;
  std::string detail;
};

// The plan a version is protected under (frozen at BeginVersion).
struct VersionPlan {
  ProtectionPolicy policy;
  uint64_t epoch = 0;
  std::vector<std::string> nodes;                          // plan order
  std::map<std::string, std::vector<std::string>> protectors;  // replicate
  std::vector<EcGroup> groups;                             // ec
};

struct Version {
  std::string job_id;
  uint64_t step = 0;
  VersionState state = VersionState::kOpen;
  uint32_t world_size = 0;
  VersionPlan plan;
  bool flush_planned = false;
  std::string durable_dir;
  std::string run_id;
  int64_t created_ms = 0;
  int64_t staged_ms = 0;
  int64_t protected_ms = 0;
  int64_t persisted_ms = 0;
  int64_t ended_ms = 0;
  std::string abort_reason;
  bool commit_issued = false;  // CommitDurableTask created
  bool evicted = false;        // memory holdings released by retention/delete
  std::map<uint32_t, Shard> shards;  // staged ranks only
  std::vector<NodeBlob> blobs;       // ec, once STAGED
  std::vector<Segment> segments;     // ec, once STAGED

  uint64_t TotalBytes() const;
};

// ---------------------------------------------------------------------------
// Holdings (agent inventory)

struct Holding {
  bool is_segment = false;
  std::string job_id;
  uint64_t step = 0;
  uint32_t rank = 0;      // shards
  SegmentKey segment;     // segments
  CopyRole role = CopyRole::kPrimary;
  SegmentKind kind = SegmentKind::kData;
  uint64_t size_bytes = 0;
  uint32_t crc32c = 0;
  uint64_t manifest_digest = 0;
  CopyState state = CopyState::kValid;
  int64_t stored_ms = 0;
  std::string durable_path;
};

// ---------------------------------------------------------------------------
// Tasks

enum class TaskKind {
  kReplicate = 1,
  kEcEncode,
  kRebuildSegments,
  kFlush,
  kCommitDurable,
  kEvict,
  kDrop,
  kDeleteDurable,
};
const char* TaskKindName(TaskKind k);

enum class TaskState {
  kPending = 1,  // not yet acknowledged by the agent
  kRunning,      // acknowledged (listed in a heartbeat)
  kRetryWait,    // last attempt failed; re-issued at retry_at_ms
  kDone,
  kFailed,
  kCancelled,
};
const char* TaskStateName(TaskState s);

struct Task {
  static constexpr int kMaxAttempts = 5;
  std::string id;  // "t-000000000123"
  std::string node_id;
  uint32_t attempt = 1;
  TaskKind kind = TaskKind::kReplicate;
  TaskState state = TaskState::kPending;
  int32_t priority = 0;
  int64_t created_ms = 0;
  int64_t timeout_ms = 0;
  std::string job_id;
  uint64_t step = 0;
  std::vector<uint32_t> ranks;            // replicate, flush
  std::vector<std::string> targets;       // replicate
  int group = -1;                         // ec encode
  std::vector<SegmentKey> segments;       // rebuild
  std::vector<Holding> drop;              // drop
  std::string reason;                     // drop, for logs
  int64_t retry_at_ms = 0;
  std::string last_error;
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
  // Not persisted: last sign of life (monotonic), for the timeout; whether
  // the agent was told of the cancellation.
  absl::Time last_progress;
  bool cancel_notified = false;
};

}  // namespace ckpt::meta
