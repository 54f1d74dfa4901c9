// MetaCore: the metadata service's state machine (docs/architecture.md "ckpt-meta").
//
// It owns the in-memory view of nodes, jobs, versions and tasks, persists every
// state change through a MetaStore (one WriteBatch per change, group-committed,
// sync), and implements every MetaService operation as a plain C++ call. The rpc
// layer (src/server/rpc/) translates ckpt.v1 messages to and from these calls.
//
// Durability: a call that changes state returns only after its batch is
// durable (MetaStore::AwaitDurable), so an OK answer survives kill -9. Changes
// are applied in memory and submitted under one mutex, so they reach the store
// in the order they were decided; the fsync wait happens outside the mutex, so
// concurrent callers share fsyncs (group commit). A call that changes state
// waits for room in the store's write queue (MetaStore::WaitForRoom) before it
// takes the mutex, so a slow disk slows writers down but never holds up
// readers.
//
// Answers come only from durable state. The in-memory state runs ahead of the
// disk by the batches submitted but not yet fsynced (another caller's change
// is visible in memory before its group commit completes). Every answer,
// success or error, of every call (reads such as GetVersion, WaitVersion,
// Latest and Locate included) is therefore returned only once the store
// sequence of the newest change visible when the answer was computed is
// durable: a crash can never roll back a state a caller was shown (a trainer
// told PROTECTED keeps a PROTECTED version). Readers never hold the mutex
// while they wait, and add no fsync of their own: they ride the group commit
// in flight. If that wait fails (the store's sticky write error) the call
// returns the store's error instead of its answer.
//
// Time: everything uses the injected Clock. Lease expiry, task time-outs,
// retries and the flush-by-time rule advance only in Tick(), which the daemon
// calls periodically and unit tests call after FakeClock::Advance().
//
// Errors follow docs/style.md "Errors": InvalidArgument (bad input; the message says what to
// change), NotFound (unknown job, step, node, task), FailedPrecondition (stale
// incarnation, illegal transition), AlreadyExists (identical replay),
// DataLoss (no readable source), DeadlineExceeded (wait timed out), Internal /
// Unavailable (the store failed; the process should restart).
//
// Non-blocking variants for the gRPC callback API: SubmitHeartbeat and
// SubmitReportShards apply and submit the change like Heartbeat and
// ReportShards but return before it is durable, with the store sequence number
// to wait for; WhenDurable(seq, done) then calls `done` from the core's
// durability thread ("ckpt-meta-dur") once that sequence is durable, so no
// caller thread parks in MetaStore::AwaitDurable.
//
// Thread safety: every public method may be called from any thread. The core
// owns one thread (the durability thread), started by Open() and joined by
// Stop() (called by the destructor).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "server/meta/model.h"
#include "server/meta/planner.h"
#include "server/meta/store/meta_store.h"

namespace ckpt::meta {

class Engine;
class Txn;

struct MetaOptions {
  absl::Duration lease = absl::Seconds(5);
  absl::Duration heartbeat_interval = absl::Seconds(1);
  // A task with no progress or result for this long is re-issued.
  absl::Duration task_timeout = absl::Seconds(60);
  // Delay before re-issuing a failed attempt (doubles per attempt).
  absl::Duration task_retry_backoff = absl::Seconds(1);
  // A replicate or EC encode task that failed for good (its attempts used
  // up: a one-way cut, a target that refuses) holds off pushes from its node
  // to its target(s) for this long: the copy is planned on another node if
  // one can take it at once, and the held-off target is tried again when
  // this ends (a healed link recovers). Not persisted.
  absl::Duration push_retry_backoff = absl::Seconds(30);
  // Shown in ClusterStatus.
  std::string version = "0.1.0";
  // Survival estimates: samples for Monte Carlo.
  uint64_t survival_samples = 1'000'000;
  // The protection of a job created without one (CreateJob with no stated
  // protection). nullopt: the automatic default, AutoProtection().
  std::optional<ProtectionPolicy> default_protection;
  // An OPEN version with no progress (begun, or a rank's shard staged) for
  // this long is ABORTED with a reason saying which ranks never arrived, and
  // its shards are evicted: a rank that died while saving never leaves its
  // version OPEN for good. Zero disables the rule. Measured on the monotonic
  // clock from when this meta process last saw progress (a restart restarts
  // the count, as for leases).
  absl::Duration open_version_timeout = absl::Minutes(10);
  // A shard whose every readable copy was on a node that died (its lease
  // expired) is not declared lost at once: for this long after the death the
  // version keeps its state, so an agent that restarts and re-adopts its
  // memory tier (a restart, or a stall longer than the lease) brings the
  // copies back. When it ends, or when the node registers again and its
  // inventory lacks the copy, the version is ABORTED ("data lost"). Zero:
  // abort at once.
  absl::Duration lost_copy_grace = absl::Seconds(30);
  // The cluster's data-plane key (server/cmd/data_plane_key.h), handed to
  // every node that registers (RegisterResult::data_plane_key); the RPC layer
  // lets only authenticated agents register. Empty: none (an --insecure meta).
  std::string data_plane_key;
};

// The automatic default protection for a job created with none stated, over
// `alive_nodes` ALIVE (or SUSPECT) nodes: replicate{2, ring} (PROTECTED then
// means every shard has a copy on a second node and survives one node loss)
// when there are at least two, otherwise none (single-node cluster: PROTECTED
// then means STAGED, in the agent's memory: it survives a trainer crash but
// not the loss of the node). Never a policy the cluster cannot place, so a job
// created with the default can always reach PROTECTED.
ProtectionPolicy AutoProtection(size_t alive_nodes);

// ---- Requests and results (domain forms of the ckpt.v1 messages) ----------

struct RegisterRequest {
  std::string node_id;
  std::string grpc_address;
  std::string data_address;
  NodeRole role = NodeRole::kHost;
  uint64_t memory_capacity_bytes = 0;
  std::string failure_domain;
  std::string agent_version;
  uint64_t previous_incarnation = 0;
  std::string host_node_id;  // a DPU agent's host
};
struct RegisterResult {
  uint64_t incarnation = 0;
  absl::Duration lease;
  absl::Duration heartbeat_interval;
  uint64_t meta_instance_id = 0;
  std::string data_plane_key;  // MetaOptions::data_plane_key
};

struct TaskProgress {
  std::string task_id;
  uint32_t attempt = 0;
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
};

struct HeartbeatRequest {
  std::string node_id;
  uint64_t incarnation = 0;
  uint64_t memory_capacity_bytes = 0;
  uint64_t memory_used_bytes = 0;
  uint64_t memory_free_bytes = 0;
  uint64_t memory_leased_bytes = 0;
  uint64_t flush_lag_bytes = 0;
  int64_t flush_lag_ms = 0;
  uint64_t flush_errors_total = 0;
  std::vector<TaskProgress> running_tasks;
  uint64_t membership_generation = 0;  // what the agent holds (0: none)
  bool stopping = false;               // a clean shutdown: not a failure (Node::stopping)
};

// A node that may use the data plane (HeartbeatResult::members).
struct Member {
  std::string node_id;
  uint64_t incarnation = 0;
};

// The versions of a job an agent keeps as restorable (its own cap, Agent::
// kMaxStagedSteps): at most those a restarted agent is told of again.
inline constexpr size_t kMaxNoticedStepsPerJob = 64;

// A version of which a node holds a copy became restorable from memory
// (STAGED level or better, not evicted: `staged`) or stopped being so
// (ckpt.v1.VersionNotice). Delivered with the node's tasks, best effort.
struct VersionNotice {
  std::string job_id;
  uint64_t step = 0;
  bool staged = false;
};

// A task with everything an agent needs to run it, resolved at hand-out time.
struct TaskBundle {
  Task task;
  // The task's version (shards without items), if it has one.
  std::optional<Version> version;
  // Endpoints of every node the task names (targets, group members, holders).
  std::map<std::string, Endpoint> endpoints;
  // kFlush: per rank, sources to read from when this node has no VALID copy.
  std::map<uint32_t, std::vector<struct Source>> sources;
  // kRebuildSegments: per segment to rebuild, the stripe's other VALID
  // segments on usable nodes (never DEAD or LEFT), SUSPECT holders last.
  std::map<SegmentKey, std::vector<struct SegmentLocation>> segment_sources;
};

struct HeartbeatResult {
  absl::Duration lease;
  absl::Duration heartbeat_interval;
  NodeState node_state = NodeState::kAlive;
  uint64_t meta_instance_id = 0;
  bool inventory_required = false;
  std::vector<TaskBundle> tasks;
  std::vector<std::string> cancelled_task_ids;
  uint64_t membership_generation = 0;
  // Set when the request's generation differs: every node registered with
  // its current incarnation and not DEAD or LEFT.
  std::optional<std::vector<Member>> members;
};

enum class TaskDisposition { kCompleted = 1, kDuplicate, kCancelled, kRetry, kFailed };

struct InventoryDecision {
  enum class Action { kAdopted = 1, kDrop = 2, kUnknown = 3 };
  Holding holding;
  Action action = Action::kDrop;
  std::string reason;
};
struct InventoryResult {
  std::vector<InventoryDecision> decisions;
  uint32_t kept = 0;
  std::vector<Holding> missing;
};

// A CreateJob call: what the caller states about the job. Unstated parts take
// the stored values when the job exists (open mode) and are not compared;
// when the call creates the job they take the defaults. Only stated parts are
// compared with an existing job.
struct JobRequest {
  std::string job_id;
  // 0: unstated (creating a job requires it).
  uint32_t world_size = 0;
  // nullopt: unstated; creating uses MetaOptions::default_protection.
  std::optional<ProtectionPolicy> protection;
  // nullopt: unstated; creating means never flush automatically.
  std::optional<FlushPolicy> flush;
  // nullopt: unstated; creating means the server defaults.
  std::optional<RetentionPolicy> retention;
  // Stored when the call creates the job; never compared.
  std::map<std::string, std::string> labels;
  // Opening an existing job: a stated world_size that differs changes it
  // (CreateJobRequest.resize_world) instead of being refused.
  bool resize_world = false;

  // Every field of `spec` stated, except a flush or retention policy left at
  // its defaults (all zero), which is unstated.
  static JobRequest Stating(const JobSpec& spec);
};

struct JobView {
  Job job;
  std::optional<uint64_t> latest_staged, latest_protected, latest_persisted;
  std::map<VersionState, uint64_t> version_counts;
  uint64_t memory_bytes = 0;
  uint64_t durable_bytes = 0;
};

struct PlacementView {
  VersionPlan plan;  // epoch 0 for a what-if plan
  std::vector<SurvivalEstimate> survival;
  std::string job_id;
  int64_t created_ms = 0;
};

// Reports (ReportShards entries).
struct StagedReport {
  std::string job_id;
  uint64_t step = 0;
  Shard shard;  // rank, size, crc, digest, items, primary_node_id, staged_ms
  std::string run_id;
};
struct CopyReport {
  std::string job_id;
  uint64_t step = 0;
  uint32_t rank = 0;
  CopyRole role = CopyRole::kReplica;
  CopyState state = CopyState::kValid;
  uint64_t size_bytes = 0;
  uint32_t crc32c = 0;
  std::string task_id;
  std::string detail;
};
struct SegmentReport {
  std::string job_id;
  uint64_t step = 0;
  SegmentKey key;
  SegmentKind kind = SegmentKind::kData;
  CopyState state = CopyState::kValid;
  uint64_t length_bytes = 0;
  uint32_t crc32c = 0;
  std::string task_id;
  std::string detail;
};
struct PersistedReport {
  std::string job_id;
  uint64_t step = 0;
  uint32_t rank = 0;
  std::string durable_path;
  uint64_t size_bytes = 0;
  uint32_t crc32c = 0;
  std::string task_id;
};
struct ShardReport {
  enum class Kind { kStaged, kCopy, kSegment, kPersisted } kind = Kind::kStaged;
  StagedReport staged;
  CopyReport copy;
  SegmentReport segment;
  PersistedReport persisted;
};
struct ReportResult {
  std::vector<absl::Status> results;  // one per report
  std::vector<TaskBundle> tasks;      // new tasks for the reporting node
};

// Restore sources.
struct SegmentLocation {
  SegmentKey key;
  SegmentKind kind = SegmentKind::kData;
  uint64_t length_bytes = 0;
  uint32_t crc32c = 0;
  Endpoint holder;
};
// EcStripeSource and EcDecodeSource mirror ckpt.v1's (and the agent's
// agent/meta_link.h): the same field names and types.
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
struct Source {
  SourceKind kind = SourceKind::kLocal;
  Endpoint holder;
  CopyRole role = CopyRole::kPrimary;
  EcDecodeSource ec;
  std::string durable_path;
};
struct LocateResult {
  Shard shard;  // with items, without copies
  std::vector<Source> sources;
};

struct Problem {
  enum class Kind {
    kNodeDead = 1, kNodeSuspect, kVersionDegraded, kVersionLost, kCorruptCopy,
    kFlushFailing, kFlushLagging, kUnknownData, kMemoryLow, kTaskFailing,
    kPlacementImpossible,
  };
  Kind kind = Kind::kNodeDead;
  bool error = false;  // severity: error (true) or warning
  std::string message;
  std::string node_id;
  std::string job_id;
  std::optional<uint64_t> step;
  int64_t since_ms = 0;
};

struct ClusterStatusView {
  uint64_t meta_instance_id = 0;
  int64_t meta_start_ms = 0;
  std::string meta_version;
  std::map<NodeState, uint32_t> nodes_by_state;
  std::vector<Node> nodes;
  uint32_t jobs = 0;
  std::map<VersionState, uint64_t> versions_by_state;
  uint64_t memory_capacity_bytes = 0;
  uint64_t memory_used_bytes = 0;
  uint64_t memory_free_bytes = 0;
  uint64_t flush_lag_bytes = 0;
  int64_t flush_lag_ms = 0;
  uint32_t tasks_pending = 0;
  uint32_t tasks_running = 0;
  uint32_t tasks_retrying = 0;
  std::vector<Problem> problems;
  uint32_t problems_total = 0;
  // Node failure history (ckpt.v1.FailureStats).
  int64_t observed_node_ms = 0;
  uint64_t failures = 0;
  int64_t node_mtbf_ms = 0;
  bool mtbf_is_lower_bound = true;
  uint32_t job_nodes = 0;
  int64_t job_mtbf_ms = 0;
};

// Counters for /metrics.
struct MetaCounters {
  uint64_t reports_total = 0;
  uint64_t reports_rejected_total = 0;
  uint64_t versions_begun_total = 0;
  uint64_t nodes_declared_dead_total = 0;
  uint64_t tasks_created_total = 0;
  uint64_t tasks_failed_total = 0;
};

class MetaCore {
 public:
  // Loads every record from `store` (which must outlive the core). Nodes that
  // were ALIVE get a fresh lease from now: an agent that does not heartbeat
  // within it is declared DEAD as usual. Errors: the store's, or Internal for
  // a record that does not parse (the message names its key).
  static absl::StatusOr<std::unique_ptr<MetaCore>> Open(MetaStore* store, Clock* clock,
                                                        MetaOptions options = {});
  // Calls Stop().
  ~MetaCore();

  // Completes every WhenDurable() callback already queued (waiting for the
  // store as needed), then joins the durability thread. Later WhenDurable()
  // calls run `done` inline. Blocks; idempotent.
  void Stop();

  uint64_t instance_id() const { return instance_id_; }

  // ---- Nodes ----
  absl::StatusOr<RegisterResult> RegisterNode(const RegisterRequest& req);
  absl::StatusOr<HeartbeatResult> Heartbeat(const HeartbeatRequest& req);
  // Heartbeat without the durability wait: on success *durable_seq is the store
  // sequence to pass to WhenDurable() (0: nothing to wait for), and the result
  // must not be shown to the caller before that reports OK. Never blocks on
  // I/O (except for room in the store's write queue, MetaStore::WaitForRoom,
  // before the core's lock is taken).
  absl::StatusOr<HeartbeatResult> SubmitHeartbeat(const HeartbeatRequest& req,
                                                  uint64_t* durable_seq);
  absl::StatusOr<TaskDisposition> ReportTaskResult(const std::string& node_id,
                                                   uint64_t incarnation,
                                                   const std::string& task_id, uint32_t attempt,
                                                   const absl::Status& outcome);
  absl::StatusOr<InventoryResult> ReportInventory(const std::string& node_id,
                                                  uint64_t incarnation,
                                                  const std::vector<Holding>& holdings);
  // Marks the node drained: DRAINING now (a DEAD or LEFT node keeps its state)
  // and at every later registration, LEFT once nothing depends on it.
  // NotFound if unknown.
  absl::StatusOr<Node> DrainNode(const std::string& node_id);
  // Clears the drain mark: a DRAINING node (or a LEFT one whose agent still
  // heartbeats) is ALIVE at once, a LEFT or DEAD one when its agent registers
  // again. NotFound; FailedPrecondition if the node is not drained.
  absl::StatusOr<Node> UndrainNode(const std::string& node_id);
  absl::Status RemoveNode(const std::string& node_id);
  absl::StatusOr<std::vector<Node>> ListNodes(const std::vector<NodeState>& states) const;
  // Unfinished tasks of a node incarnation not yet acknowledged, or (all=true)
  // every unfinished one (WatchTasks on open). FailedPrecondition if stale.
  // `notices`, if not null, receives (and meta forgets) the node's version
  // notices, oldest first; like the tasks, they are returned once the state
  // they describe is durable.
  absl::StatusOr<std::vector<TaskBundle>> PendingTasks(const std::string& node_id,
                                                       uint64_t incarnation, bool all,
                                                       std::vector<VersionNotice>* notices = nullptr);
  // Blocks until a task for the node is created or `timeout` passes or the
  // incarnation becomes stale; returns the generation counter to pass next time.
  uint64_t WaitForTaskChange(uint64_t seen_generation, absl::Duration timeout);

  // ---- Jobs ----
  // Creates the job, or (open_if_exists) opens it when it exists and every
  // stated part of `req` equals the stored one (see JobRequest). Returns the
  // job and whether this call created it. Errors: InvalidArgument (bad id,
  // world size or policy; creating without a world size; a policy the alive
  // nodes cannot place), AlreadyExists (exists, not open mode),
  // FailedPrecondition (exists with a different stated part: the message
  // names each with the stored and the asked value; or being deleted).
  absl::StatusOr<std::pair<JobView, bool>> CreateJob(const JobRequest& req, bool open_if_exists);
  // CreateJob(JobRequest::Stating(spec), open_if_exists).
  absl::StatusOr<std::pair<JobView, bool>> CreateJob(const JobSpec& spec, bool open_if_exists);
  absl::StatusOr<JobView> GetJob(const std::string& job_id) const;
  // Jobs with id > after (empty: from the start), at most `limit`.
  absl::StatusOr<std::vector<JobView>> ListJobs(const std::string& after, uint32_t limit) const;
  absl::StatusOr<JobView> DeleteJob(const std::string& job_id, bool delete_durable_files);
  // Replaces the job's flush, retention and/or protection policy (nullopt:
  // kept); a tighter retention applies at once (ApplyRetention). A new
  // protection applies to versions begun from then on (each version keeps the
  // policy it was planned with: its copies, stripes and recovery); it must be
  // plannable over the nodes alive now, and the plan epoch moves on. Returns
  // the job and whether anything changed. Errors: NotFound,
  // FailedPrecondition (being deleted; a protection the alive nodes cannot
  // place), InvalidArgument (nothing given; an invalid policy).
  absl::StatusOr<std::pair<JobView, bool>> UpdateJob(const std::string& job_id,
                                                     const std::optional<FlushPolicy>& flush,
                                                     const std::optional<RetentionPolicy>& retention,
                                                     const std::optional<ProtectionPolicy>& protection = std::nullopt);
  // The job's current plan (or `override`'s over the same alive nodes) and
  // survival estimates for each failure count.
  absl::StatusOr<PlacementView> GetPlacement(const std::string& job_id,
                                             const std::vector<int>& failures,
                                             const std::optional<ProtectionPolicy>& override,
                                             SurvivalOptions survival) const;

  // ---- Versions ----
  // Every call naming a step refuses one above kMaxStep (common/names.h) with
  // InvalidArgument.
  //
  // Begins version `step` of the job, or returns the existing one (idempotent
  // per run). Returns (version summary, created). A step lower than the job's
  // newest version at STAGED level or better is refused (InvalidArgument,
  // naming that version: steps must increase; delete newer versions to
  // rewind); newer versions that are still OPEN do not block it. An OPEN
  // version of the same step begun by another run is ABORTED and replaced.
  absl::StatusOr<std::pair<Version, bool>> BeginVersion(const std::string& job_id, uint64_t step,
                                                        const std::string& run_id);
  absl::StatusOr<ReportResult> ReportShards(const std::string& node_id, uint64_t incarnation,
                                            const std::vector<ShardReport>& reports);
  // ReportShards without the durability wait; see SubmitHeartbeat. Takes the
  // reports by value: staged shards are moved into the state, not copied.
  absl::StatusOr<ReportResult> SubmitReportShards(const std::string& node_id,
                                                  uint64_t incarnation,
                                                  std::vector<ShardReport> reports,
                                                  uint64_t* durable_seq);
  // Calls done(MetaStore::AwaitDurable(seq)) exactly once: inline when seq is 0
  // (with OK) or after Stop(), otherwise from the durability thread, which
  // completes callbacks in the order their sequences become durable. `done`
  // must not block (it runs on the one thread that completes every waiter);
  // it may call any method of the core except Stop(). Never blocks.
  void WhenDurable(uint64_t seq, std::function<void(absl::Status)> done);
  absl::StatusOr<Version> GetVersion(const std::string& job_id, uint64_t step,
                                     bool include_items) const;
  // Summaries (no shards) in ascending step order (or newest first), with
  // step > after (< after when newest_first; nullopt: from the start).
  absl::StatusOr<std::vector<Version>> ListVersions(const std::string& job_id,
                                                    const std::vector<VersionState>& states,
                                                    bool newest_first,
                                                    std::optional<uint64_t> after,
                                                    uint32_t limit) const;
  absl::StatusOr<Version> Latest(const std::string& job_id, Level min_level) const;
  // Where rank's shard of the version can be read, best first. Holders on
  // nodes meta considers DEAD (or LEFT) are never listed; holders on SUSPECT
  // nodes (missing heartbeats) come after every other holder of the same
  // kind, and an EC stripe lists its segments on SUSPECT nodes last. Errors:
  // NotFound (job, step or rank), FailedPrecondition (version not restorable:
  // OPEN, ABORTED, DELETED), DataLoss (no readable source left).
  absl::StatusOr<LocateResult> Locate(const std::string& job_id, uint64_t step, uint32_t rank,
                                      const std::string& near_node_id) const;
  // Blocks (on the Clock) until the version satisfies `level` or `timeout`.
  // Errors: NotFound (no such version: the message names the job's newest
  // version when that explains why, e.g. a save refused because a newer
  // version exists), FailedPrecondition or DataLoss (ABORTED: the message
  // gives the reason), DeadlineExceeded (the message gives the state and the
  // ranks still missing).
  absl::StatusOr<Version> WaitVersion(const std::string& job_id, uint64_t step, Level level,
                                      absl::Duration timeout);
  absl::StatusOr<Version> FlushVersion(const std::string& job_id, uint64_t step);
  absl::StatusOr<Version> DeleteVersion(const std::string& job_id, uint64_t step, bool force);

  // ---- Cluster ----
  // `job_id` (may be empty): also that job's MTBF (ClusterStatusView::job_*).
  absl::StatusOr<ClusterStatusView> ClusterStatus(bool include_nodes, uint32_t max_problems,
                                                  const std::string& job_id = "") const;
  MetaCounters counters() const;
  // True once Open() loaded the store (readiness).
  bool ready() const { return true; }

  // Advances time-driven state: lease expiry (SUSPECT, DEAD and recovery),
  // task time-outs and retries, flush lag. Idempotent; cheap when nothing is due.
  absl::Status Tick();

 private:
  friend class Engine;
  struct State;
  MetaCore(MetaStore* store, Clock* clock, MetaOptions options);
  // Body of the durability thread.
  void DurableLoop();
  // ---- The lock, the log and the wait, in one place (core_state.h). Every
  // public method that reads or changes the state goes through one of these;
  // `fn` gets an Engine over the state (its Txn collects what fn changes)
  // and returns the answer (absl::Status or absl::StatusOr<T>).
  //
  // Apply(fn, &seq): waits for room in the store's write queue (without any
  // lock), takes mu_, runs fn, submits the Txn (also when fn
  // fails: what it changed in memory reaches the store, in decision order),
  // lets go of mu_ and returns fn's answer; `seq` is the store sequence the
  // answer must wait for (the newest change visible to fn).
  template <typename Fn>
  auto Apply(Fn&& fn, uint64_t* seq);
  // Write(fn): Apply, then the answer once that sequence is durable, or the
  // store's error. Blocks on the store without holding mu_.
  template <typename Fn>
  auto Write(Fn&& fn);
  // Read(fn): takes mu_, runs fn (which changes nothing persisted; it may
  // wait on mu_, as WaitVersion does), lets go of mu_, and returns the answer
  // once the newest change visible when fn returned is durable.
  template <typename Fn>
  auto Read(Fn&& fn) const;
  // Looks the node up and applies `change` (which records what it changes in
  // the Txn), under mu_; then waits for the change to be durable. NotFound
  // for an unknown node; `change`'s error unchanged.
  absl::StatusOr<Node> ChangeNode(const std::string& node_id,
                                  absl::FunctionRef<absl::Status(Engine&, Txn&, Node&)> change);
  // Submits `txn` and returns the store sequence an answer computed now must
  // wait for: the newest change visible in memory (this one, or an earlier
  // one when `txn` is empty).
  uint64_t SubmitLocked(Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fills `out`'s failure history fields (and the job's, if `job_id` is set).
  void FailureStatsLocked(const std::string& job_id, ClusterStatusView* out) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ClusterStatusView ClusterStatusLocked(bool include_nodes, uint32_t max_problems, const std::string& job_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The sequence of the newest change visible in memory.
  uint64_t VisibleSeqLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `answer` once batch `seq` (and so every earlier one) is durable, or the
  // store's error. Blocks on the store; never call it holding mu_.
  template <typename T>
  T WhenDurableAnswer(uint64_t seq, T answer) const {
    absl::Status st = store_->AwaitDurable(seq);
    if (!st.ok()) return st;
    return answer;
  }

  MetaStore* const store_;
  Clock* const clock_;
  const MetaOptions options_;
  const uint64_t instance_id_;
  const int64_t start_ms_;
  mutable absl::Mutex mu_;
  std::unique_ptr<State> state_ ABSL_GUARDED_BY(mu_);

  // WhenDurable() waiters in call order (sequences roughly ascending: a
  // waiter whose batch is already durable costs one cheap AwaitDurable).
  absl::Mutex durable_mu_;
  std::deque<std::pair<uint64_t, std::function<void(absl::Status)>>> durable_queue_
      ABSL_GUARDED_BY(durable_mu_);
  bool durable_stopping_ ABSL_GUARDED_BY(durable_mu_) = false;
  std::thread durable_thread_;  // started by Open(), joined by Stop()
};

}  // namespace ckpt::meta
