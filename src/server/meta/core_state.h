// Internal to MetaCore (meta_*.cc, engine_*.cc): the in-memory state, the
// transaction helper that records every change for the store, the Engine
// (the operations on the state, split by concern across engine_*.cc) and
// MetaCore's Read / Write / Apply. Not a public header.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "server/meta/meta_core.h"
#include "server/meta/records.h"
#include "server/meta/store/meta_store.h"

namespace ckpt::meta {

// Collects the records one operation changes, deduplicated, and turns them
// into one WriteBatch.
class Txn {
 public:
  void Node(const meta::Node& n) { batch_.Put(records::NodeKey(n.id), records::EncodeNode(n)); }
  void DeleteNode(const std::string& id) { batch_.Delete(records::NodeKey(id)); }
  void Job(const meta::Job& j) { batch_.Put(records::JobKey(j.spec.job_id), records::EncodeJob(j)); }
  void DeleteJob(const std::string& id) { batch_.Delete(records::JobKey(id)); }
  void Header(const Version& v) { headers_.insert({v.job_id, v.step}); }
  void ShardRecord(const Version& v, uint32_t rank) { shards_.insert({{v.job_id, v.step}, rank}); }
  void Segments(const Version& v) { segments_.insert({v.job_id, v.step}); }
  void Task(const meta::Task& t) { batch_.Put(records::TaskKey(t.id), records::EncodeTask(t)); }
  void DeleteTask(const std::string& id) { batch_.Delete(records::TaskKey(id)); }
  void Raw(std::string key, std::string value) { batch_.Put(std::move(key), std::move(value)); }
  void Delete(std::string key) { batch_.Delete(std::move(key)); }

  // Encodes the version records marked so far (from `versions`) and submits
  // them with MetaStore::SubmitNoWait (the caller waited for room before
  // taking its lock). Returns the sequence to await (0 when nothing changed).
  uint64_t Submit(MetaStore* store,
                  const std::map<std::string, std::map<uint64_t, Version>>& versions);

 private:
  WriteBatch batch_;
  std::set<std::pair<std::string, uint64_t>> headers_;
  std::set<std::pair<std::pair<std::string, uint64_t>, uint32_t>> shards_;
  std::set<std::pair<std::string, uint64_t>> segments_;
};

// A version without items, copies, blobs and segments (shard sizes kept, so
// counts and totals stay right).
Version Summary(const Version& v);

// "3 of 4 shards staged (rank 2 missing)": how far a version got, naming the
// first few ranks that never arrived.
std::string StagedRanksText(const Version& v);

// Version notices kept per node while no stream takes them.
inline constexpr size_t kMaxVersionNotices = 1024;

// A copy or segment in state `s` can be read: VALID.
inline bool Usable(CopyState s) { return s == CopyState::kValid; }

// Task priorities (agents run higher first).
inline constexpr int32_t kPriorityRecovery = 300;
inline constexpr int32_t kPriorityProtection = 200;
inline constexpr int32_t kPriorityFlush = 100;

// The planner's placement as a version's plan (epoch left 0).
absl::StatusOr<VersionPlan> PlanToVersionPlan(const PlacementPlan& plan);

struct UnknownHolding {
  Holding holding;
  int64_t since_ms = 0;
};

struct MetaCore::State {
  std::map<std::string, meta::Node> nodes;
  std::map<std::string, meta::Job> jobs;
  std::map<std::string, std::map<uint64_t, Version>> versions;
  std::map<std::string, meta::Task> tasks;
  // (job, step) -> ids of tasks for that version.
  std::map<std::pair<std::string, uint64_t>, std::set<std::string>> tasks_by_version;
  // Job -> node ids of the plan last used, to bump the epoch when it changes.
  std::map<std::string, std::vector<std::string>> last_plan_nodes;
  // Holdings agents reported that meta does not know (not persisted).
  std::map<std::string, std::vector<UnknownHolding>> unknown;
  uint64_t next_task_id = 1;
  uint64_t task_generation = 0;
  // Store sequence of the newest change applied to this state (0: none since
  // Open; what Open loaded is durable). Answers wait for it (meta_core.h).
  uint64_t last_seq = 0;
  // OPEN versions -> when this process last saw them progress (begun, or a
  // shard staged), on Clock::MonotonicNow(); for open_version_timeout. Not
  // persisted: Open() starts every OPEN version's count afresh.
  std::map<std::pair<std::string, uint64_t>, absl::Time> open_progress;
  // Versions kept although a shard has no readable copy, because the node
  // that held it died less than lost_copy_grace ago -> when the grace of the
  // newest such copy ends (NowMs). Tick recomputes them then. Not persisted:
  // Open() recomputes every version.
  std::map<std::pair<std::string, uint64_t>, int64_t> awaiting_return;
  // Pushes held off after a replicate or EC encode task failed for good
  // (ProtectionTaskFailed): (source node, target node, "" for an encode) ->
  // until when (NowMs), the versions waiting for the retry, and the task's
  // error. PlanRecovery plans no replica from the source to the target until
  // then; Tick retries (RetryHeldOffPushes). Not persisted: a restarted meta
  // tries every target again.
  struct HeldOffPush {
    int64_t until_ms = 0;
    std::set<std::pair<std::string, uint64_t>> versions;
    std::string error;
  };
  std::map<std::pair<std::string, std::string>, HeldOffPush> held_off_pushes;
  // Changes with every change of who may use the data plane (a node
  // registers, dies, leaves, drains, is undrained or removed). Starts at a
  // random value per meta process, so that an agent's generation from an
  // earlier process never matches by chance. Not persisted.
  uint64_t membership_generation = 0;
  // Node -> version notices not yet taken by its WatchTasks stream, oldest
  // first, at most kMaxVersionNotices (the oldest dropped: agents then ask
  // Locate). Not persisted.
  std::map<std::string, std::deque<VersionNotice>> version_notices;
  MetaCounters counters;
  // Tasks created during the current operation, for ReportShards' answer.
  std::vector<std::string> created_tasks;
};

}  // namespace ckpt::meta

namespace ckpt::meta {

// The operations on State, used by MetaCore's public methods while they hold
// the lock. Every change goes through `txn`.
class Engine {
 public:
  Engine(MetaCore::State& s, Clock* clock, const MetaOptions& options, Txn& txn)
      : s_(s), clock_(clock), options_(options), txn_(txn) {}

  int64_t NowMs() { return clock_->NowUnixMillis(); }
  absl::Time Mono() { return clock_->MonotonicNow(); }
  MetaCore::State& state() { return s_; }
  Txn& txn() { return txn_; }
  const MetaOptions& options() const { return options_; }

  // ---- versions: lookups (engine_versions.cc)
  absl::StatusOr<Job*> FindJob(const std::string& job_id);
  // InvalidArgument for a step above kMaxStep; NotFound for an unknown job or
  // step (saying when a newer version refuses the step, see
  // NewestReadableAbove).
  absl::StatusOr<Version*> FindVersion(const std::string& job_id, uint64_t step);
  // The job's newest version above `step` at STAGED level or better (not
  // OPEN, not ABORTED or DELETED), or nullptr: the version that makes a new
  // version at `step` a rewind.
  const Version* NewestReadableAbove(const std::string& job_id, uint64_t step) const;

  // ---- membership (engine_membership.cc)
  // The node, if `incarnation` is current and it is not DEAD/LEFT (or, with
  // `allow_left`, LEFT: a drained node's agent that keeps running heartbeats
  // without registering again).
  absl::StatusOr<Node*> CheckNode(const std::string& node_id, uint64_t incarnation,
                                  bool allow_left = false);
  // Can serve reads and run tasks: ALIVE, SUSPECT or DRAINING.
  bool IsUsable(const std::string& node_id) const;
  // Holdings on it count toward protection: ALIVE or SUSPECT.
  bool CountsForProtection(const std::string& node_id) const;
  // Missing heartbeats: read from it only when nothing else serves.
  bool IsSuspect(const std::string& node_id) const;
  Endpoint EndpointOf(const std::string& node_id) const;
  // The first usable node by id, or "" if none.
  std::string AnyUsableNode() const;

  // ---- placement (engine_placement.cc)
  // The nodes that count for protection, with their placement domains.
  std::vector<PlannerNode> AliveNodes() const;
  // The job's plan over the alive nodes; bumps and persists the epoch when
  // the node set changed since the last plan.
  absl::StatusOr<VersionPlan> CurrentPlan(Job& job);

  // ---- tasks (engine_tasks.cc)
  // Issues a DeleteDurableTask for the version on any usable node; false if
  // there is none.
  bool DeleteDurable(const Version& v);
  Task& NewTask(const std::string& node_id, TaskKind kind, const std::string& job_id,
                uint64_t step, int32_t priority);
  static bool Active(const Task& t) {
    return t.state == TaskState::kPending || t.state == TaskState::kRunning ||
           t.state == TaskState::kRetryWait;
  }
  std::vector<Task*> ActiveTasks(const std::string& job_id, uint64_t step, TaskKind kind);
  void CancelTask(Task& t);
  void CancelVersionTasks(const Version& v);
  TaskBundle Bundle(const Task& t);

  // ---- state changes (transitions.h): the only writers of Node::state,
  // Task::state and Version::state (engine_membership.cc, engine_tasks.cc,
  // engine_versions.cc). A move the table does not list leaves the state
  // unchanged, is logged here as an error and returned (FailedPrecondition
  // naming both states). It is a bug in meta, never the caller's input: a
  // caller with no error to return ignores it (IgnoreError), it was reported
  // here. Setting the current state again is a no-op. Side effects
  // (persisting, timestamps, generations) stay with the caller, except for
  // versions (SetState).
  absl::Status SetNodeState(meta::Node& n, NodeState to);
  absl::Status SetTaskState(meta::Task& t, TaskState to);
  // Also stamps the state's time, records `reason` for ABORTED and DELETED,
  // persists the header, and tells the nodes holding a copy of the version
  // when it becomes, or stops being, restorable from memory (NoticeStaged).
  absl::Status SetState(Version& v, VersionState to, const std::string& reason = "");

  // ---- membership, continued (engine_membership.cc)
  // The node's holdings are gone (death) or leaving (drain).
  void NodeLost(const std::string& node_id, const std::string& reason);
  // Recomputes every version a change of the node set may affect.
  void ReplanAll();
  // Queues a VersionNotice for every node holding a copy of a shard of `v`
  // and wakes the task streams.
  void NoticeStaged(const Version& v, bool staged);
  // Queues a staged VersionNotice for `node_id` of each restorable version
  // (at most the newest kMaxNoticedStepsPerJob of a job) of which its
  // inventory lists a shard that meta counts as a valid copy there: a
  // restarted agent knows of none (ReportInventory).
  void NoticeHeldVersions(const std::string& node_id, const std::vector<Holding>& holdings);

  // ---- versions: state and flush (engine_versions.cc)
  // Re-derives the version's state from its holdings (PROTECTED, DEGRADED,
  // ABORTED), then plans recovery and flush and applies retention.
  void Recompute(Version& v);
  // `staged` just became STAGED: every OPEN version of its job with a lower
  // step is ABORTED (superseded) and its shards evicted. No-op if `staged`
  // is terminal.
  void AbortOpenVersionsBelow(const Version& staged);
  // Aborts an OPEN version that can never complete (superseded, no
  // progress): cancels its tasks, evicts its shards, records `reason`.
  void AbortOpenVersion(Version& v, const std::string& reason);
  bool ShardReadable(const Version& v, const Shard& shard) const;
  // A shard of `v` (`rank`) has no readable copy left. True if a copy or
  // segment of the version was lost with a node that may still bring it
  // back (DEAD, or registered again but its inventory not yet received)
  // less than lost_copy_grace ago: the version is then kept as it is and
  // recorded in awaiting_return. False (and forgotten) once that is over.
  bool AwaitLostCopies(const Version& v, uint32_t rank);
  // Flush tasks for planned shards not yet written; commit when all are.
  void PlanFlush(Version& v);
  // Plans the flush of a version not planned yet (FlushVersion, and the
  // versions an incremental version being flushed refers to). No-op if it is
  // planned, PERSISTED, ended or evicted.
  void StartFlush(Version& v);
  // Every version the version refers to is PERSISTED, or gone for good (its
  // commit may go); starts the flush of those that are neither.
  bool RefsPersisted(Version& v);
  // Every version the version refers to is still readable (not ended, in
  // memory or PERSISTED): it loads whole.
  bool RefsAvailable(const Version& v) const;
  // Versions of the job above `step` that refer to items of it and still
  // need them: not ended, and in memory or PERSISTED (ascending).
  std::vector<uint64_t> Dependents(const std::string& job_id, uint64_t step) const;

  // ---- recovery (engine_recovery.cc)
  // After the last rank staged, before StartErasureCoding: a rank staged on
  // a node outside every EC group of the version's plan (the node was away
  // when the version began) gets the groups planned again over the nodes
  // that count now, if that takes every rank in; else those ranks are
  // protected by whole copies (InStripes).
  void TakeInShardsOutsideTheGroups(Version& v);
  // After the last rank staged: EC layout + encode tasks.
  void StartErasureCoding(Version& v);
  // Replication tasks for shards with too few copies, rebuild tasks for lost
  // EC segments.
  void PlanRecovery(Version& v);
  // Replicate tasks until each shard `wanted` picks has `copies` copies on
  // nodes that count for protection.
  void PlanReplicas(Version& v, int copies, const std::function<bool(const Shard&)>& wanted);
  // Rebuild tasks for lost EC segments, and moves of segments doubled up on
  // one node.
  void PlanRebuilds(Version& v);
  // A PROTECTED (or PERSISTED) replicated version with no replicate or flush
  // task running: a shard
  // with more copies that count for protection than the policy's (a node
  // came back with its primaries, always re-adopted, on top of the replicas
  // re-protection made while it was away) keeps its primary and the
  // replicas best placed (distinct failure domains first, then the plan's
  // protectors, then the oldest), and each other replica gets a drop task
  // and leaves meta's record. Nothing is released while a holder of the
  // shard is SUSPECT. Readers told of a released copy fall back to the next
  // source; the agent frees the bytes once no read holds them.
  void ReleaseSurplusReplicas(Version& v);
  // The shard's node is a member of one of the version's EC groups, so its
  // bytes are in stripes. A shard staged on a node the plan left out (it
  // was away when the version began) is not, and is protected by
  // ReplicasOutsideStripes whole copies instead (as many losses survived).
  bool InStripes(const Version& v, const Shard& sh) const;
  static int ReplicasOutsideStripes(const Version& v);
  // `node_id` restarted (a new incarnation while its lease ran): each EC
  // group with a parity still being built there encodes again on every
  // member whose encode task had finished.
  void RestartEncodesBuiltOn(const std::string& node_id);
  // `node_id`'s inventory came in (it came back, or meta restarted): each EC
  // group it belongs to with a stripe never built (HasUnbuiltStripe) and
  // whose encode failed for good on some member encodes again on every
  // member without an encode running, if every member is usable and holds
  // its primaries (meta's view). The encodes failed while a member was
  // away, and the stripe has too few segments to rebuild from. Returns the
  // versions it changed.
  std::vector<Version*> ResumeStalledEncodes(const std::string& node_id);
  // Whether a stripe of `g` has a data segment that is not VALID (never
  // pushed, or LOST with a member that died mid-encode) and fewer than k
  // readable segments: only an encode builds it.
  bool HasUnbuiltStripe(const Version& v, const EcGroup& g) const;
  // A replicate or EC encode task used up its attempts (task `t`, now
  // FAILED): pushes from its node to its targets (to "" for an encode) are
  // held off for push_retry_backoff, and its version is recomputed, so that
  // PlanRecovery puts the copy on another node that can take it.
  void ProtectionTaskFailed(const Task& t);
  // PlanRecovery does not push from `source` to `target` now.
  bool PushHeldOff(const std::string& source, const std::string& target) const;
  // The stripe survives any `parity_m` of the nodes holding it failing: its
  // VALID segments on nodes that count for protection, less those on the m
  // nodes holding most of them, still number `data_k` (empty segments need
  // no node). False when a rebuild doubled segments up on one node.
  bool StripeTolerates(const Version& v, const EcGroup& group, int stripe) const;

  // ---- retention (engine_retention.cc)
  // Evicts and deletes the job's versions its RetentionPolicy no longer
  // keeps (in memory, then on the durable tier).
  void ApplyRetention(Job& job);
  // Evicts every memory holding of the version (EvictTask per holder).
  void EvictVersion(Version& v);
  // EvictVersion unless a newer version refers to its shards (incremental
  // saves): an aborted base keeps serving them (Locate) until retention.
  void EvictUnlessReferred(Version& v);

  // ---- placement: reads (engine_placement.cc)
  // Where the shard can be read, best first (MetaCore::Locate's order).
  std::vector<Source> Sources(const Version& v, const Shard& shard,
                              const std::string& near_node_id) const;
  // The VALID segments of one stripe on usable nodes (never DEAD or LEFT),
  // `exclude` left out: in position order, those on SUSPECT nodes last.
  std::vector<SegmentLocation> StripeLocations(const Version& v, int group, int stripe,
                                               const SegmentKey* exclude) const;

  // ---- time-driven steps of MetaCore::Tick, in its order (meta_tick.cc)
  // Nodes whose lease ran out are DEAD (NodeLost); ALIVE ones that missed
  // two heartbeat intervals are SUSPECT.
  void ExpireLeases(absl::Time mono, int64_t now);
  // DRAINING nodes that no version still needs are LEFT.
  void RetireDrainedNodes(int64_t now);
  // Tasks whose retry time came are PENDING again; tasks with no progress
  // for their time-out are re-issued, or FAILED after the last attempt.
  void RetryAndTimeOutTasks(absl::Time mono, int64_t now);
  // Versions kept for a dead node's copies (awaiting_return) whose grace is
  // over are recomputed (and so aborted unless a copy came back).
  void EndLostCopyGraces(int64_t now);
  // Held-off pushes (ProtectionTaskFailed) whose time is over are forgotten
  // and their versions recomputed (the target is tried again); an encode
  // that failed for good starts again (ResumeStalledEncodes).
  void RetryHeldOffPushes(int64_t now);
  // OPEN versions with no progress for open_version_timeout are ABORTED.
  void AbortStalledOpenVersions(absl::Time mono);
  // Jobs being deleted whose clean-up tasks finished are forgotten.
  void RemoveDeletedJobs();

 private:
  MetaCore::State& s_;
  Clock* clock_;
  const MetaOptions& options_;
  Txn& txn_;
};

// ---- MetaCore's Apply / Write / Read (meta_core.h)

template <typename Fn>
auto MetaCore::Apply(Fn&& fn, uint64_t* seq) {
  // Backpressure from a slow disk is taken here, before mu_: a full write
  // queue holds up writers, never readers (Txn::Submit uses SubmitNoWait).
  store_->WaitForRoom();
  absl::MutexLock lock(&mu_);
  Txn txn;
  Engine e(*state_, clock_, options_, txn);
  auto answer = fn(e);
  *seq = SubmitLocked(txn);
  return answer;
}

template <typename Fn>
auto MetaCore::Write(Fn&& fn) {
  uint64_t seq = 0;
  auto answer = Apply(std::forward<Fn>(fn), &seq);
  return WhenDurableAnswer(seq, std::move(answer));
}

template <typename Fn>
auto MetaCore::Read(Fn&& fn) const {
  uint64_t seq = 0;
  auto answer = [&] {
    absl::MutexLock lock(&mu_);
    Txn unused;  // a reader records nothing
    Engine e(*state_, clock_, options_, unused);
    auto a = fn(e);
    seq = VisibleSeqLocked();
    return a;
  }();
  return WhenDurableAnswer(seq, std::move(answer));
}

}  // namespace ckpt::meta
