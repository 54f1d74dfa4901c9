// The state of a lazy save (ckpt::LazySave): shared by the LazySave handles;
// the thread that runs the save only borrows it (the last handle joins that
// thread before the state goes). Internal to src/client.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "ckpt/client.h"

namespace ckpt::client {

struct LazyState {
  explicit LazyState(SaveBuilder b) : builder(std::move(b)) {}
  ~LazyState();  // joins the thread: the save has finished when the state goes

  // Runs the save on `thread` (called once, by CommitLazy).
  void Start();

  // Called by the save's thread: items 0..n-1 are copied.
  void MarkCopied(size_t n);

  SaveBuilder builder;  // the save's thread alone uses it while it runs
  std::shared_ptr<ClientCore> core;  // for the save's cost (AddSaveCost)
  size_t items = 0;     // const after Start
  // The lazy saves of the client still running when this one began: its
  // commit is sent after theirs (const after CommitLazy).
  std::vector<std::weak_ptr<LazyState>> before;
  std::thread thread;

  mutable absl::Mutex mu;
  size_t copied ABSL_GUARDED_BY(mu) = 0;      // items copied so far, Add order
  bool copy_ended ABSL_GUARDED_BY(mu) = false;  // all copied, or failed first
  bool done ABSL_GUARDED_BY(mu) = false;        // committed or failed
  absl::Status status ABSL_GUARDED_BY(mu);      // the save's error once done (or copy_ended by it)
  std::optional<SaveHandle> handle ABSL_GUARDED_BY(mu);
};

// Blocks until every save in `before` has committed or failed (those gone
// are). A save sends its commit after its client's earlier lazy saves sent
// theirs: commits reach the agent, and STAGED reports meta, in step order
// (else meta takes the older version for one a rank gave up: "superseded").
void AwaitEarlierCommits(const std::vector<std::weak_ptr<LazyState>>& before);

}  // namespace ckpt::client
