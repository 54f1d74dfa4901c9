// Executor: a named, bounded pool of threads that one component owns.
//
// Work is queued (at most `max_queued` waiting functions) and run by
// `threads` named threads. Stop() is a gate: it refuses new work, lets every
// queued and running function finish (components make their waits return
// promptly when they stop, so this is quick), then joins the threads. Nothing
// is detached and nothing outlives Stop().
//
// Thread safety: every method may be called from any thread; a function
// running on the executor may call TrySubmit and queued, but not Stop or RunAll.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ckpt {

class Executor {
 public:
  Executor(std::string name, int threads, size_t max_queued);
  ~Executor();  // Stop()
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues `fn`. False (fn not run, not kept) when stopping or when
  // `max_queued` functions are already waiting: the caller decides what a
  // refusal means (e.g. answer the peer "busy").
  bool TrySubmit(std::function<void()> fn);

  // Runs every function and returns when all have finished. Functions go to
  // the pool while it has room and run on the caller's thread otherwise (and
  // always after Stop), so a full queue never makes it wait. Not to be called
  // from a function running on this executor: the functions it queued would
  // wait for a thread of the pool that is the caller's (the agent calls it
  // from its task and restore threads only).
  void RunAll(std::vector<std::function<void()>> fns);

  // Refuses new work, waits for queued and running work, joins. Idempotent.
  void Stop();

  size_t queued() const;

 private:
  void Loop();

  const std::string name_;
  const size_t max_queued_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
  absl::Mutex join_mu_;  // serialises Stop()
};

}  // namespace ckpt
