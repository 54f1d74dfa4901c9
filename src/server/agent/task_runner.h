// TaskRunner: the queue of work meta handed this node (flush, commit and
// delete durable versions, evict, drop, replicate, EC encode, rebuild), run
// highest priority first, one step at a time. A step may finish the task,
// ask to be called again later (e.g. waiting for the verifier or for parity
// from peers) or fail; retryable flush failures come back with exponential
// backoff. Every finished task's result goes to meta through the
// MetaSession, after the reports the task produced.
//
// Threads: RunOnce is called by the agent's task threads (or by tests, which
// call it by hand). A task runs on one thread at a time. The lock is never
// held while a step runs, nor while a hook or the MetaSession is called.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/agent/meta_link.h"
#include "server/agent/meta_session.h"

namespace ckpt::agent {

// A task and its progress between steps.
struct QueuedTask {
  AgentTask task;
  absl::Time not_before;
  int tries = 0;
  size_t next_shard = 0;  // flush: shards before it are done
  uint64_t bytes_done = 0;
  absl::Time started;
  bool sends_done = false;                       // ec_encode: data segments delivered
  absl::Time deadline = absl::InfiniteFuture();  // ec_encode: give up waiting for parity
  bool deferred = false;  // its last step asked to be called again (not a backoff)
};

class TaskRunner {
 public:
  struct Hooks {
    // Runs one step; sets *finished = false to be called again later.
    std::function<absl::Status(QueuedTask& qt, bool* finished)> step;
    // Every hook is called without the runner's lock held, so it may call
    // into other components and back into the runner.
    //
    // A task was queued / cancelled by meta (e.g. to track flush lag, or to
    // let go of parity being built for it).
    std::function<void(const AgentTask&)> on_queued;
    std::function<void(const AgentTask&)> on_cancelled;
    // A task left the queue, finished or failed for good (its result goes to
    // meta right after, which may retry it here or elsewhere). Called on the
    // thread that ran the last step, before the result is queued.
    std::function<void(const AgentTask&, const absl::Status&)> on_ended;
    // A flush step failed (counted in the flush error metrics).
    std::function<void(const absl::Status&)> on_flush_error;
  };
  struct Options {
    int64_t flush_retry_initial_ms = 500;
    int64_t flush_retry_max_ms = 30000;
    int flush_max_tries = 8;
  };

  TaskRunner(Clock* clock, MetaSession* session, Options options, Hooks hooks);

  // Queues tasks. A known id only raises the attempt number; a finished one
  // runs again only as a later attempt (meta's retry of a failure).
  void Enqueue(std::vector<AgentTask> tasks);
  // Meta cancelled these tasks: they are dropped (a running one when its
  // step returns) and never reported.
  void Cancel(const std::vector<std::string>& ids);
  // Runs one step of the highest-priority runnable task. True if it ran one
  // that finished or failed (more may be runnable at once).
  bool RunOnce();
  std::vector<RunningTask> Running() const;
  // Something a deferred task may wait for happened (the verifier checked a
  // shard, a segment or parity was stored): deferred tasks run again at once.
  void Poke();
  // Waits until a task may be runnable (woken since the last wait, or the
  // earliest deferred task is due) or `timeout` passes (or Stop). A wake
  // between RunOnce and AwaitWork is never lost: the loop that calls both is
  // the one consumer of the wake count.
  void AwaitWork(absl::Duration timeout);
  void Stop();

 private:
  Clock* const clock_;
  MetaSession* const session_;
  const Options options_;
  const Hooks hooks_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t wake_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t wake_seen_ ABSL_GUARDED_BY(mu_) = 0;  // wake_ when AwaitWork last returned
  std::map<std::string, QueuedTask> tasks_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> running_ ABSL_GUARDED_BY(mu_);
  // Tasks this node finished or that meta cancelled, with the attempt that
  // ended them: meta retries a failed task under the same id with a higher
  // attempt number, and only such a retry runs again.
  std::map<std::string, uint32_t> finished_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::agent
