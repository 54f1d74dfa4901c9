// MetaSession: the agent's session with ckpt-meta: registration (and
// re-registration when fenced), heartbeats, inventory, the outbox of
// messages meta must get in order (versions to begin, holding reports, task
// results), and the task stream.
//
// The outbox keeps everything until meta has answered it. Only an explicit
// refusal (InvalidArgument, FailedPrecondition, NotFound, OutOfRange) ends an
// entry; any other error (Unavailable, DeadlineExceeded, Internal, Unknown,
// Cancelled, ResourceExhausted, Aborted: meta restarting, overloaded, a
// transient RPC failure) keeps it queued and retries with backoff, so a
// transient error never costs committed shards.
//
// Threads: ControlOnce runs on the agent's control thread (one round: send
// what is due), WatchLoop on its own; other components only queue (Begin,
// Report, Result) and read snapshots. The lock is never held across a call to
// meta, the file system or the Delegate.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/status/statusor.h"
#include "common/clock.h"
#include "common/file_system.h"
#include "server/agent/agent_metrics.h"
#include "server/agent/membership.h"
#include "server/agent/meta_link.h"

namespace ckpt::agent {

// True for meta's answers that are final refusals (not worth a retry).
bool IsPermanentRefusal(const absl::Status& s);

// The incarnation file of a memory directory: one decimal number and a
// newline, a private file (common/file_system.h) replaced atomically.
std::string IncarnationPath(const std::string& memory_dir);
// The incarnation the file at `path` holds: 0 if there is none or its text
// is not a number (logged). FailedPrecondition (the message says what to
// remove) if it is not the agent's own private file (another user's, a
// symbolic link, writable by others); other read errors as the file
// system returns them. Blocks on the file system.
absl::StatusOr<uint64_t> ReadIncarnationFile(FileSystem* fs, const std::string& path);
// Replaces the file at `path` with `incarnation` (WritePrivateFileAtomically):
// on any error the previous file is left whole. Blocks on the file system.
absl::Status WriteIncarnationFile(FileSystem* fs, const std::string& path, uint64_t incarnation);

class MetaSession {
 public:
  // What the session needs from the rest of the agent. Called without the
  // session's lock, from the control or watch thread.
  class Delegate {
   public:
    virtual ~Delegate() = default;
    virtual std::vector<InventoryItem> InventoryItems() = 0;
    virtual LoadReport Load() = 0;
    virtual void OnTasks(std::vector<AgentTask> tasks, std::vector<std::string> cancelled) = 0;
    // Meta's inventory answer: holdings to delete.
    virtual void OnDrop(const std::vector<ShardId>& shards, const std::vector<SegmentId>& segments) = 0;
    // Meta refused a version for good: its shards here can never be staged.
    virtual void OnVersionRefused(const std::string& job, uint64_t step, const std::string& run_id,
                                  const absl::Status& why) = 0;
    // Meta refused a report of a VALID copy or segment (FailedPrecondition,
    // NotFound): drop it, it can never count.
    virtual void OnCopyRefused(const HoldingReport& report, const absl::Status& why) = 0;
  };

  struct Options {
    std::string node_id;
    // Called after every successful registration with meta's answer's
    // data-plane key (empty from an --insecure meta), outside the session's
    // lock, on the control thread; must not block. Unset: ignored.
    std::function<void(const std::string& key)> on_data_plane_key;
    std::string grpc_address;
    std::function<std::string()> data_address;  // what peers reach us on
    std::string failure_domain;
    std::string host_node_id;  // a DPU agent's host (registers as role DPU)
    uint64_t memory_capacity_bytes = 0;
    // The agent's incarnation is remembered in `<memory_dir>/incarnation`, a
    // private file written through `fs` (WriteIncarnationFile) after every
    // registration, so that the next start tells meta which incarnation to
    // fence. "": not remembered. `fs` is not owned; nullptr: PosixFileSystem().
    std::string memory_dir;
    FileSystem* fs = nullptr;
    // What the previous start left there (ReadIncarnationFile), 0 if none.
    uint64_t previous_incarnation = 0;
    // Kept up to date from heartbeat answers when set (outlives the session).
    PeerMembership* membership = nullptr;
  };

  struct Snapshot {
    uint64_t incarnation = 0;
    bool registered = false;
    bool meta_reachable = false;
    int64_t last_heartbeat_unix_ms = 0;
    int64_t lease_remaining_ms = 0;
    NodeState node_state = NodeState::kUnknown;
    size_t outbox = 0;
  };

  using Done = std::function<void(const absl::Status&)>;

  MetaSession(MetaLink* meta, Clock* clock, AgentMetrics* metrics, Options options, Delegate* delegate);

  // Queues a BeginVersion for (job, step, run) (once per key).
  void Begin(const std::string& job, uint64_t step, const std::string& run_id);
  // Queues a report; `on_done` runs (on the control thread, or with
  // Cancelled at Stop) once meta answered it, with its per-report status.
  void Report(HoldingReport report, Done on_done = nullptr);
  // Queues a task result; it goes out after the reports queued before it.
  void Result(const std::string& task_id, uint32_t attempt, const absl::Status& result, uint64_t bytes,
              int64_t duration_ms);
  // Drops queued STAGED reports of a version (meta refused it).
  void ForgetVersion(const std::string& job, uint64_t step);

  // ---- versions restorable from memory ----
  // Whether meta said (job, step) is restorable from memory (a staged
  // VersionNotice) and no shard of it was committed here since. Local opens
  // of such a version say version_staged.
  bool VersionStaged(const std::string& job, uint64_t step) const;
  // Applies meta's version notices, oldest first (WatchLoop does with the
  // task stream's; public for tests): a staged one is remembered (at most
  // kMaxStagedSteps steps per job, the lowest forgotten first), any other
  // forgotten.
  void ApplyVersionNotices(const std::vector<VersionNotice>& notices);
  // A shard of (job, step) was committed here: a new instance of the version
  // (one deleted and saved again), not staged until meta says so again.
  void ForgetStaged(const std::string& job, uint64_t step);
  static constexpr size_t kMaxStagedSteps = 64;

  // One control round: register if due, send the outbox, the inventory and
  // the heartbeat. Public for deterministic tests.
  void ControlOnce();
  // Keeps meta's task stream open until Stop().
  void WatchLoop();
  // Wakes waits, ends the task stream, cancels pending callbacks. Idempotent.
  void Stop();
  // A clean shutdown begins: heartbeats from now on (one at once, if
  // registered) tell meta the agent is stopping on purpose, so that its
  // lease running out is not counted as a node failure (the MTBF). Best
  // effort: when the last heartbeat failed (meta unreachable) nothing is
  // sent now, so a stop never waits for meta, and the lease expiry counts.
  void AnnounceStop();

  // Waits until something is queued or `timeout` passes (or Stop).
  void AwaitWork(absl::Duration timeout);
  // The next control round heartbeats at once (PeerMembership refresh).
  void HeartbeatSoon();
  Snapshot Status() const;
  uint64_t incarnation() const;

 private:
  struct Outbound {
    enum class Kind { kReport, kResult, kBegin };
    Kind kind = Kind::kReport;
    uint64_t seq = 0;    // queue order, unique
    std::string run_id;  // kBegin (report.id names the version)
    HoldingReport report;
    Done on_done;
    std::string task_id;
    uint32_t attempt = 0;
    absl::Status result;
    uint64_t bytes = 0;
    int64_t duration_ms = 0;
    absl::Duration park_backoff = absl::ZeroDuration();  // kBegin: the last wait while parked
  };
  using VersionKey = std::pair<std::string, uint64_t>;
  // A Begin that meta could not take yet (too few nodes alive, meta away)
  // with the STAGED reports of its version: they wait here, off the outbox,
  // so that they do not hold up the reports of other versions.
  struct Parked {
    std::vector<Outbound> items;  // the Begin first, in queue order
    absl::Time due;
  };
  // The version a Begin or STAGED report is about (nullopt for the rest).
  static std::optional<VersionKey> VersionOf(const Outbound& o);
  // Moves the version at the outbox's head (a Begin that failed with `why`)
  // and its STAGED reports to parked_, to try again after a backoff.
  void ParkHeadLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Puts parked versions that are due back at the head of the outbox.
  void UnparkDueLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void Register();
  void SendOutbox();
  void SendInventory();
  void Heartbeat();
  // After a transient failure: keep everything queued, back off.
  void BackOffLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Until the inventory is applied, moves `tasks` to deferred_tasks_.
  void DeferTasksLocked(std::vector<AgentTask>& tasks) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FencedLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PushLocked(Outbound o) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  MetaLink* const meta_;
  Clock* const clock_;
  AgentMetrics* const metrics_;
  const Options options_;
  Delegate* const delegate_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool announced_stop_ ABSL_GUARDED_BY(mu_) = false;  // AnnounceStop
  uint64_t wake_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t wake_seen_ ABSL_GUARDED_BY(mu_) = 0;  // wake_ when AwaitWork last returned
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  std::deque<Outbound> outbox_ ABSL_GUARDED_BY(mu_);
  std::map<VersionKey, Parked> parked_ ABSL_GUARDED_BY(mu_);
  absl::Time next_send_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Duration backoff_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  bool inventory_due_ ABSL_GUARDED_BY(mu_) = false;
  // Meta's answer to the last inventory was applied (its drops done). Tasks
  // wait for it: a task that stores a copy here before the drops would have
  // that copy dropped with the stale one of the same id.
  bool inventory_applied_ ABSL_GUARDED_BY(mu_) = false;
  // Tasks that came with report or heartbeat answers before that: run once
  // the inventory is applied.
  std::vector<AgentTask> deferred_tasks_ ABSL_GUARDED_BY(mu_);
  uint64_t incarnation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t previous_incarnation_ ABSL_GUARDED_BY(mu_) = 0;
  bool meta_reachable_ ABSL_GUARDED_BY(mu_) = false;
  NodeState node_state_ ABSL_GUARDED_BY(mu_) = NodeState::kUnknown;
  int64_t heartbeat_ms_ ABSL_GUARDED_BY(mu_) = 1000;
  int64_t lease_ms_ ABSL_GUARDED_BY(mu_) = 5000;
  absl::Time next_heartbeat_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time next_register_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::StatusCode last_register_error_ ABSL_GUARDED_BY(mu_) = absl::StatusCode::kOk;  // the last one logged
  absl::Time lease_valid_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t last_heartbeat_unix_ms_ ABSL_GUARDED_BY(mu_) = 0;
  // Versions meta said are restorable from memory, by job (VersionStaged).
  std::map<std::string, std::set<uint64_t>> staged_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::agent
