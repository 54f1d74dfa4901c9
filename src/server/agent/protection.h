// Protector: the protection tasks meta hands a node: push replicas of its
// shards (ReplicateTask), push its EC data segments to their parity holders
// and wait for its own parity (EcEncodeTask), and rebuild lost segments
// (RebuildSegmentsTask). docs/agent.md "Peer protection".
//
// Nothing leaves the node unverified: a step whose shards the verifier has
// not checked yet returns "not finished" and is retried. Pushes pin what they
// send; stripes go out concurrently on the `stripes` executor.
//
// Thread safety: the methods run on task threads, several at once.
#pragma once

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/agent/agent_metrics.h"
#include "common/executor.h"
#include "server/agent/holdings.h"
#include "server/agent/parity_builder.h"
#include "server/agent/peer_client.h"
#include "server/agent/reconstructor.h"
#include "server/agent/task_runner.h"

namespace ckpt::agent {

class Protector {
 public:
  struct Deps {
    HoldingTable* holdings;
    PeerClient* peers;
    ParityBuilder* parity;
    Reconstructor* reconstructor;
    Executor* stripes;
    Arena* arena;
    Clock* clock;
    AgentMetrics* metrics;
    std::string node_id;
    int64_t peer_timeout_ms = 30000;
    bool data_plane = false;  // false: every task fails with Unavailable
    std::function<std::string(uint64_t bytes)> budget_message;
    std::function<void(HoldingReport)> report;  // queues a report for meta
  };
  explicit Protector(Deps deps);

  absl::Status Replicate(QueuedTask& qt, bool* finished);
  absl::Status EcEncode(QueuedTask& qt, bool* finished);
  absl::Status RebuildSegments(QueuedTask& qt);

  // A trainer's pause (AgentService.PauseProtection): for `d` (0: resume now)
  // Replicate and EcEncode start no new push; their tasks come back later
  // (*finished = false). A push already sending finishes. Returns how long
  // the pause in force lasts from now.
  absl::Duration Pause(absl::Duration d);
  // True while a pause is in force (and accounts the paused time).
  bool Paused();

 private:
  absl::Status PushDataSegments(QueuedTask& qt, bool* finished);
  // Ends a pause that ran out, adding its time to the metric.
  void SettleLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pause_mu_);

  const Deps d_;
  absl::Mutex pause_mu_;
  absl::Time pause_start_ ABSL_GUARDED_BY(pause_mu_) = absl::InfinitePast();
  absl::Time pause_until_ ABSL_GUARDED_BY(pause_mu_) = absl::InfinitePast();
};

}  // namespace ckpt::agent
