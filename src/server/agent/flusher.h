// Flusher: moves verified shard copies to the durable tier and commits,
// lists and deletes durable versions (docs/format.md), and keeps the flush
// lag and error figures that status and metrics show.
//
// A flush pins the copy (HoldingTable), writes `<root>/<job>/<step>/rank-N.bin`
// through RankFileWriter straight from the pool (no lock held), records the
// durable path and reports PERSISTED to meta. Errors keep the memory copy;
// the TaskRunner retries with backoff.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/file_system.h"
#include "server/agent/agent_metrics.h"
#include "server/agent/holdings.h"
#include "server/agent/meta_session.h"
#include "server/agent/task_runner.h"

namespace ckpt::agent {

struct FlushResult {
  uint32_t rank = 0;
  std::string durable_path;
  absl::Status status;
};

struct FlushStats {
  uint32_t pending_shards = 0;
  uint64_t lag_bytes = 0;
  int64_t lag_ms = 0;
  uint64_t errors_total = 0;
  std::string last_error;
  int64_t last_error_unix_ms = 0;
};

class Flusher {
 public:
  // `durable_root` empty: this node has no durable tier (flushes fail with
  // Unavailable). Pointers must outlive the flusher.
  Flusher(std::string durable_root, FileSystem* fs, HoldingTable* holdings, MetaSession* session, MetaLink* meta,
          Clock* clock, AgentMetrics* metrics, std::string writer_name);

  // One step of a FlushTask (TaskRunner): writes its shards in order from
  // qt.next_shard on, counting qt.bytes_done. Only verified copies are
  // written: at a shard the verifier has not checked yet it returns OK with
  // *finished = false (the runner calls again later). FlushOne's errors.
  absl::Status Step(QueuedTask& qt, bool* finished);
  // Writes one shard (a flush order of task `task_id`; "" for a node-local
  // flush). *bytes counts what was written. FailedPrecondition when the copy
  // here differs from what meta expects; the holding's errors (NotFound,
  // DataLoss); file system errors as they are.
  absl::Status FlushOne(const std::string& task_id, const FlushOrder& order, const std::string& job, uint64_t step,
                        uint64_t* bytes);
  // Writes this node's primaries of a version now (AgentService.Flush).
  absl::StatusOr<std::vector<FlushResult>> FlushNow(const std::string& job, uint64_t step,
                                                    const std::vector<uint32_t>& ranks);
  // CommitDurableTask / DeleteDurableTask.
  absl::Status CommitVersion(const AgentTask& t);
  absl::Status DeleteVersion(const AgentTask& t);

  // A flush task was queued: its shards count as lag until written.
  void Want(const AgentTask& t);
  void Unwant(const AgentTask& t);
  void RecordError(const absl::Status& s);
  FlushStats Stats() const;
  void UpdateGauges() const;

  const std::string& durable_root() const { return root_; }

 private:
  absl::StatusOr<std::string> PathUnderRoot(const std::string& rel) const;

  const std::string root_;
  FileSystem* const fs_;
  HoldingTable* const holdings_;
  MetaSession* const session_;
  MetaLink* const meta_;
  Clock* const clock_;
  AgentMetrics* const metrics_;
  const std::string writer_name_;

  mutable absl::Mutex mu_;
  mutable std::map<ShardId, absl::Time> waiting_ ABSL_GUARDED_BY(mu_);  // wanted, not yet durable
  uint64_t errors_total_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  int64_t last_error_unix_ms_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt::agent
