// Verifier: checks the bytes this node holds against their crc32c and acts
// on what it finds, and decides the node-local eviction command.
//
//   - Background verification: every shard committed here is queued in the
//     HoldingTable (QueueVerify); VerifyOnce checks the next one (every item
//     crc and the shard crc) and marks it verified, which lets tasks that
//     wait for verified bytes go on (flush, replicate, EC encode: the
//     `on_verified` hook pokes the TaskRunner), or quarantines it: the copy
//     is reported CORRUPT and later pins of it fail with DataLoss.
//   - Verify (AgentService.Verify): the same checks, on demand, over one
//     version's shards and EC segments, quarantining what is bad unless it
//     is a dry run.
//   - Evict (AgentService.Evict): frees a version's holdings here only if
//     meta's facts allow it (see Evict); EvictVersion runs meta's EvictTask.
//
// Owns: the wake count of the verify loop and its stop flag; nothing else
// (the queue and the verified / quarantined marks are the HoldingTable's).
//
// Locking: one mutex over the wake count and the stop flag, a leaf: never
// held across a crc, a call to meta or a call into another component. The
// crcs run on pinned bytes without any lock.
//
// Threads: VerifyOnce and AwaitWork are called by the agent's verify thread
// (ckpt-agent-vfy) or by tests by hand; AwaitWork has one consumer. Verify
// and Evict run on rpc threads.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/agent/holdings.h"
#include "server/agent/meta_link.h"
#include "server/agent/meta_session.h"
#include "server/agent/parity_builder.h"

namespace ckpt::agent {

// What Verify found for one holding.
struct VerifyFinding {
  HoldingInfo holding;
  bool ok = true;
  uint32_t actual_crc32c = 0;
  std::string bad_item;
  std::string message;
};

class Verifier {
 public:
  struct Deps {
    HoldingTable* holdings = nullptr;
    ParityBuilder* parity = nullptr;   // Evict lets go of the version's parity
    MetaSession* session = nullptr;    // EVICTED reports
    MetaLink* meta = nullptr;          // Evict asks for the version's facts
    Clock* clock = nullptr;
    // A copy was found good: a task may be waiting for it (TaskRunner::Poke).
    // Called without the verifier's lock. Unset: nothing.
    std::function<void()> on_verified;
    // Evict or EvictVersion freed holdings (the agent's gauges). Without the
    // lock. Unset: nothing.
    std::function<void()> on_freed;
  };
  // Every pointer must outlive the verifier.
  explicit Verifier(Deps deps);

  // Checks the next queued copy (reads its bytes: call without locks).
  // Returns true if there was one to check.
  bool VerifyOnce();
  // Something was queued (HoldingTable::QueueVerify): wakes AwaitWork.
  void Notify();
  // Waits until Notify was called since the last wait, Stop, or `timeout`
  // passes (on the clock). A Notify between VerifyOnce and AwaitWork is not
  // lost.
  void AwaitWork(absl::Duration timeout);
  // Wakes AwaitWork for good. Idempotent.
  void Stop();

  // Checks every shard and EC segment of (job_id, step) held here now. A bad
  // shard or segment is quarantined (reported CORRUPT) unless `dry_run`; a
  // good shard is marked verified. *bytes_checked (if given) counts the bytes
  // read. NotFound when nothing of the version is held here. Reads every
  // byte: blocks for as long as that takes.
  absl::StatusOr<std::vector<VerifyFinding>> Verify(const std::string& job_id, uint64_t step, bool dry_run,
                                                    uint64_t* bytes_checked);

  // Node-local eviction (AgentService.Evict): frees this node's holdings of
  // a version if meta's facts allow it: the version is PERSISTED, ABORTED or
  // DELETED, and it is not the job's newest version at PROTECTED level or
  // better (unless ended). Reports each freed copy EVICTED. With dry_run,
  // only checks and lists. Errors: InvalidArgument (a bad job id), NotFound
  // (nothing held here, or meta does not know the version),
  // FailedPrecondition (retention forbids it: the message says why),
  // Unavailable (meta unreachable: nothing is freed). Blocks on one call to
  // meta.
  absl::StatusOr<std::vector<HoldingInfo>> Evict(const std::string& job_id, uint64_t step, bool dry_run);
  // Meta's EvictTask: frees this node's holdings of (job_id, step) and the
  // parity being built for it, without the checks above (meta's retention
  // decided). Returns how many holdings were dropped.
  size_t EvictVersion(const std::string& job_id, uint64_t step);

 private:
  const Deps deps_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t wake_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t wake_seen_ ABSL_GUARDED_BY(mu_) = 0;  // wake_ when AwaitWork last returned
};

}  // namespace ckpt::agent
