#include "server/agent/flusher.h"

#include <algorithm>
#include <span>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/durable_format.h"
#include "common/lock_check.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt::agent {
namespace {

constexpr uint64_t kFlushChunkBytes = 8 << 20;

absl::Status NoDurableTier() {
  return absl::UnavailableError("this agent has no durable tier (--durable-root is not set)");
}

HoldingReport PersistedReport(const ShardId& id, const ShardRecord& rec, const std::string& path,
                              const std::string& task_id) {
  HoldingReport r;
  r.kind = HoldingReport::Kind::kPersisted;
  r.id = id;
  r.durable_path = path;
  r.size_bytes = rec.size_bytes;
  r.crc32c = rec.crc32c;
  r.task_id = task_id;
  return r;
}

}  // namespace

Flusher::Flusher(std::string durable_root, FileSystem* fs, HoldingTable* holdings, MetaSession* session,
                 MetaLink* meta, Clock* clock, AgentMetrics* metrics, std::string writer_name)
    : root_(std::move(durable_root)),
      fs_(fs),
      holdings_(holdings),
      session_(session),
      meta_(meta),
      clock_(clock),
      metrics_(metrics),
      writer_name_(std::move(writer_name)) {}

absl::StatusOr<std::string> Flusher::PathUnderRoot(const std::string& rel) const {
  std::vector<std::string> parts = absl::StrSplit(rel, '/');
  return JoinUnderRoot(root_, std::span<const std::string>(parts));
}

absl::Status Flusher::Step(QueuedTask& qt, bool* finished) {
  const AgentTask& t = qt.task;
  while (qt.next_shard < t.flush.size()) {
    const FlushOrder& o = t.flush[qt.next_shard];
    const ShardId id{t.job_id, t.step, o.rank};
    // Flush only verified bytes; wait (without blocking the loop) for the
    // verifier if it has not reached this shard yet.
    if (holdings_->HoldsValid(id) && !holdings_->Verified(id)) {
      *finished = false;
      return absl::OkStatus();
    }
    uint64_t bytes = 0;
    absl::Status s = FlushOne(t.id, o, t.job_id, t.step, &bytes);
    qt.bytes_done += bytes;
    CKPT_RETURN_IF_ERROR(s);
    qt.next_shard++;
  }
  return absl::OkStatus();
}

absl::Status Flusher::FlushOne(const std::string& task_id, const FlushOrder& order, const std::string& job,
                               uint64_t step, uint64_t* bytes) {
  if (root_.empty()) return NoDurableTier();
  const ShardId id{job, step, order.rank};
  CKPT_ASSIGN_OR_RETURN(Pin pin, holdings_->PinValid(id));
  const ShardRecord& rec = *pin.rec;
  if ((order.size_bytes != 0 && order.size_bytes != rec.size_bytes) ||
      (order.crc32c != 0 && order.crc32c != rec.crc32c)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "shard %s here is %d bytes crc 0x%08x but meta expects %d bytes crc 0x%08x", ShardIdString(id),
        rec.size_bytes, rec.crc32c, order.size_bytes, order.crc32c));
  }
  auto done = [&] {
    {
      CheckedLock lock(&mu_);
      waiting_.erase(id);
    }
    session_->Report(PersistedReport(id, rec, order.durable_path, task_id));
  };
  if (!rec.durable_path.empty() && rec.durable_path == order.durable_path) {
    done();  // written by an earlier attempt (or before a restart): report again
    return absl::OkStatus();
  }
  // Nothing leaves the node unchecked.
  if (!holdings_->Verified(id)) {
    std::string bad;
    if (absl::Status s = CheckShardBytes(rec, *pin.bytes, nullptr, &bad); !s.ok()) {
      holdings_->Quarantine(pin, std::string(s.message()));
      return s;
    }
    holdings_->MarkVerified(pin);
  }
  CKPT_ASSIGN_OR_RETURN(std::string path, PathUnderRoot(order.durable_path));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<RankFileWriter> writer,
                        RankFileWriter::Create(fs_, path, rec.size_bytes, rec.crc32c));
  for (const auto& piece : pin.bytes->Pieces(0, rec.size_bytes)) {
    for (uint64_t off = 0; off < piece.size(); off += kFlushChunkBytes) {
      const uint64_t len = std::min<uint64_t>(kFlushChunkBytes, piece.size() - off);
      CKPT_RETURN_IF_ERROR(writer->Append(piece.subspan(off, len)));
      *bytes += len;
    }
  }
  CKPT_RETURN_IF_ERROR(writer->Commit());
  metrics_->flush_bytes->Increment(static_cast<double>(rec.size_bytes));
  metrics_->flush_shards->Increment();
  if (absl::Status s = holdings_->SetDurablePath(pin, order.durable_path); !s.ok()) {
    log::Warn("cannot update the record of {}: {}", ShardIdString(id), s.ToString());
  }
  done();
  log::Debug("flushed {} ({} bytes) to {}", ShardIdString(id), rec.size_bytes, order.durable_path);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<FlushResult>> Flusher::FlushNow(const std::string& job, uint64_t step,
                                                           const std::vector<uint32_t>& ranks) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job));
  if (root_.empty()) return NoDurableTier();
  std::vector<FlushOrder> orders;
  for (const HoldingInfo& h : holdings_->Infos(job, step)) {
    if (h.role != CopyRole::kPrimary) continue;
    if (!ranks.empty() && std::find(ranks.begin(), ranks.end(), h.id.rank) == ranks.end()) continue;
    orders.push_back(FlushOrder{h.id.rank, absl::StrCat(job, "/", step, "/", RankFileName(h.id.rank)), h.size_bytes,
                                h.crc32c});
  }
  if (orders.empty()) return absl::NotFoundError(absl::StrCat("no shard of ", job, " step ", step, " is held here"));
  std::vector<FlushResult> out;
  for (const FlushOrder& o : orders) {
    uint64_t bytes = 0;
    absl::Status s = FlushOne("", o, job, step, &bytes);
    if (!s.ok()) RecordError(s);
    out.push_back(FlushResult{o.rank, o.durable_path, s});
  }
  return out;
}

absl::Status Flusher::CommitVersion(const AgentTask& t) {
  if (root_.empty()) return NoDurableTier();
  CKPT_ASSIGN_OR_RETURN(DurableManifest manifest, meta_->GetVersionManifest(t.job_id, t.step));
  manifest.writer = writer_name_;
  CKPT_ASSIGN_OR_RETURN(std::string dir, PathUnderRoot(t.durable_dir));
  return WriteDurableManifest(fs_, dir, manifest);
}

absl::Status Flusher::DeleteVersion(const AgentTask& t) {
  if (root_.empty()) return absl::OkStatus();
  CKPT_ASSIGN_OR_RETURN(std::string dir, PathUnderRoot(t.durable_dir));
  return DeleteDurableVersion(fs_, dir);
}

void Flusher::Want(const AgentTask& t) {
  CheckedLock lock(&mu_);
  const absl::Time now = clock_->MonotonicNow();
  for (const FlushOrder& o : t.flush) waiting_.emplace(ShardId{t.job_id, t.step, o.rank}, now);
}

void Flusher::Unwant(const AgentTask& t) {
  CheckedLock lock(&mu_);
  for (const FlushOrder& o : t.flush) waiting_.erase(ShardId{t.job_id, t.step, o.rank});
}

void Flusher::RecordError(const absl::Status& s) {
  metrics_->flush_errors->Increment();
  CheckedLock lock(&mu_);
  errors_total_++;
  last_error_ = s.ToString();
  last_error_unix_ms_ = clock_->NowUnixMillis();
}

FlushStats Flusher::Stats() const {
  std::map<ShardId, absl::Time> waiting;
  FlushStats s;
  {
    CheckedLock lock(&mu_);
    waiting = waiting_;
    s.errors_total = errors_total_;
    s.last_error = last_error_;
    s.last_error_unix_ms = last_error_unix_ms_;
  }
  const absl::Time now = clock_->MonotonicNow();
  absl::Time oldest = now;
  std::vector<ShardId> gone;
  for (const auto& [id, since] : waiting) {
    if (!holdings_->HoldsValid(id)) {
      gone.push_back(id);  // dropped or quarantined here: nothing to flush
      continue;
    }
    s.lag_bytes += holdings_->SizeOf(id);
    oldest = std::min(oldest, since);
    s.pending_shards++;
  }
  s.lag_ms = absl::ToInt64Milliseconds(now - oldest);
  if (!gone.empty()) {
    CheckedLock lock(&mu_);
    for (const ShardId& id : gone) waiting_.erase(id);
  }
  return s;
}

void Flusher::UpdateGauges() const {
  const FlushStats s = Stats();
  metrics_->flush_lag_bytes->Set(static_cast<double>(s.lag_bytes));
  metrics_->flush_lag_seconds->Set(static_cast<double>(s.lag_ms) / 1000.0);
}

}  // namespace ckpt::agent
