#include "server/meta/etcd/replicated_store.h"

#include <pthread.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace ckpt::meta {
namespace {

bool Retryable(const absl::Status& s) { return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s); }

constexpr int64_t kReadPage = 64;  // entries per Range while catching up (<= 64 MiB)
constexpr absl::Duration kFollowRetry = absl::Milliseconds(200);

}  // namespace

// ---------------------------------------------------------------------------
// ReplicatedMetaStore

ReplicatedMetaStore::ReplicatedMetaStore(MetaStore* local, EtcdClient* etcd, EtcdElection* election,
                                         std::string root, uint64_t next_index, ReplicaOptions options)
    : local_(local),
      etcd_(etcd),
      election_(election),
      root_(std::move(root)),
      options_(options),
      next_index_(std::max<uint64_t>(next_index, 1)) {
  replica_.last_index = next_index_ - 1;
  writer_ = std::thread([this] { WriterLoop(); });
}

ReplicatedMetaStore::~ReplicatedMetaStore() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  writer_.join();
  if (snapshotter_.joinable()) snapshotter_.join();
}

absl::StatusOr<std::string> ReplicatedMetaStore::Get(std::string_view key) {
  {
    absl::MutexLock lock(&mu_);
    if (!error_.ok()) return internal::RefusedAfterWriteError(error_);
  }
  return local_->Get(key);
}

absl::Status ReplicatedMetaStore::Scan(std::string_view prefix,
                                       const std::function<bool(std::string_view, std::string_view)>& fn) {
  {
    absl::MutexLock lock(&mu_);
    if (!error_.ok()) return internal::RefusedAfterWriteError(error_);
  }
  return local_->Scan(prefix, fn);
}

bool ReplicatedMetaStore::HasRoom() const {
  return queued_bytes_ < options_.max_queued_bytes || !error_.ok() || stopping_;
}

uint64_t ReplicatedMetaStore::Enqueue(WriteBatch batch) {
  const uint64_t seq = ++last_seq_;
  if (!error_.ok()) return seq;  // refused; AwaitDurable says why
  queued_bytes_ += batch.byte_size();
  queue_.emplace_back(seq, std::move(batch));
  return seq;
}

uint64_t ReplicatedMetaStore::Submit(WriteBatch batch) {
  absl::MutexLock lock(&mu_);
  if (!HasRoom()) {
    ++stats_.submit_waits;
    // A batch bigger than the whole limit goes once the queue is empty.
    mu_.Await(absl::Condition(
        +[](ReplicatedMetaStore* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
          return s->HasRoom() || s->queue_.empty();
        },
        this));
  }
  return Enqueue(std::move(batch));
}

void ReplicatedMetaStore::WaitForRoom() {
  absl::MutexLock lock(&mu_);
  if (HasRoom()) return;
  ++stats_.submit_waits;
  mu_.Await(absl::Condition(
      +[](ReplicatedMetaStore* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) { return s->HasRoom(); }, this));
}

uint64_t ReplicatedMetaStore::SubmitNoWait(WriteBatch batch) {
  absl::MutexLock lock(&mu_);
  return Enqueue(std::move(batch));
}

absl::Status ReplicatedMetaStore::AwaitDurable(uint64_t seq) {
  absl::MutexLock lock(&mu_);
  if (seq > last_seq_) {
    return absl::InvalidArgumentError(
        absl::StrCat("AwaitDurable(", seq, "): no such batch (last submitted is ", last_seq_, ")"));
  }
  // Batches submitted after the failure was known are never queued: their
  // answer is known at once.
  struct Wait {
    ReplicatedMetaStore* store;
    uint64_t seq;
  } wait{this, seq};
  mu_.Await(absl::Condition(
      +[](Wait* w) ABSL_NO_THREAD_SAFETY_ANALYSIS { return w->store->done_seq_ >= w->seq || !w->store->error_.ok(); },
      &wait));
  if (seq <= ok_seq_) return absl::OkStatus();
  if (seq <= failed_through_) return error_;
  return internal::RefusedAfterWriteError(error_);
}

StoreStats ReplicatedMetaStore::stats() {
  const StoreStats local = local_->stats();
  absl::MutexLock lock(&mu_);
  StoreStats out = stats_;
  out.fsyncs = local.fsyncs;
  out.queued_bytes = queued_bytes_;
  return out;
}

ReplicaStats ReplicatedMetaStore::replica_stats() {
  absl::MutexLock lock(&mu_);
  return replica_;
}

void ReplicatedMetaStore::WriterLoop() {
  pthread_setname_np(pthread_self(), "ckpt-meta-repl");
  for (;;) {
    std::vector<std::pair<uint64_t, WriteBatch>> taken;
    size_t bytes = 0;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ReplicatedMetaStore* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
            return s->stopping_ || !s->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping, everything written
      while (!queue_.empty()) {
        bytes += queue_.front().second.byte_size();
        taken.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    WriteBatch group;
    for (const auto& [seq, batch] : taken) {
      for (const WriteBatch::Op& op : batch.ops()) {
        if (op.type == WriteBatch::OpType::kPut) {
          group.Put(op.key, op.value);
        } else {
          group.Delete(op.key);
        }
      }
    }
    const uint64_t payload = group.byte_size();
    const absl::Status s = group.empty() ? absl::OkStatus() : Replicate(std::move(group));
    bool ok = false;
    {
      absl::MutexLock lock(&mu_);
      queued_bytes_ -= bytes;
      const uint64_t last = taken.back().first;
      if (s.ok() && error_.ok()) {
        ok = true;
        ok_seq_ = last;
        stats_.batches_written += taken.size();
        stats_.bytes_written += payload;
      } else if (error_.ok()) {
        // Not the caller's fault and not for good: this replica can no longer
        // commit (deposed, or etcd out of reach past its lease) and is about
        // to exit; another replica takes over. UNAVAILABLE tells callers to
        // retry (an agent drops a report refused with FAILED_PRECONDITION).
        error_ = absl::UnavailableError(absl::StrCat(
            "this ckpt-meta replica cannot replicate the change (", s.ToString(),
            "); it steps down and another replica takes over: retry"));
        failed_through_ = last_seq_;  // what was queued behind is failed with it
        log::Error("ckpt-meta: the replicated store failed at log index {}: {}", next_index_, s.ToString());
      }
      done_seq_ = last;
      if (!error_.ok()) {
        // Everything still queued fails with the same error.
        for (auto& [seq, batch] : queue_) queued_bytes_ -= batch.byte_size();
        if (!queue_.empty()) done_seq_ = queue_.back().first;
        queue_.clear();
      }
    }
    if (ok) MaybeSnapshot();
  }
}

absl::Status ReplicatedMetaStore::Replicate(WriteBatch group) {
  const absl::Time start = absl::Now();
  const std::vector<std::string> entries = replica::EncodeEntries(group);
  for (const std::string& entry : entries) {
    if (absl::Status s = Append(entry); !s.ok()) return s;
  }
  const absl::Duration took = absl::Now() - start;
  {
    absl::MutexLock lock(&mu_);
    replica_.entries_appended += entries.size();
    replica_.append_seconds += absl::ToDoubleSeconds(took);
    ++replica_.groups;
    replica_.last_index = next_index_ - 1;
  }
  group.Put(replica::kAppliedKey, replica::EncodeIndex(next_index_ - 1));
  return local_->Commit(std::move(group));
}

void ReplicatedMetaStore::MaybeSnapshot() {
  const uint64_t index = next_index_ - 1;
  if (options_.snapshot_every_entries == 0 || index < last_snapshot_index_ + options_.snapshot_every_entries ||
      snapshot_running_.load()) {
    return;
  }
  if (snapshotter_.joinable()) snapshotter_.join();
  // The local store holds exactly the state after `index`: this thread is
  // its only writer. Writes wait meanwhile (a scan of memory-sized state).
  WriteBatch state;
  const absl::Status scanned = local_->Scan("", [&](std::string_view k, std::string_view v) {
    if (k != replica::kAppliedKey) state.Put(std::string(k), std::string(v));
    return true;
  });
  if (!scanned.ok()) {
    log::Warn("ckpt-meta: no snapshot at log index {}: reading the store: {}", index, scanned.ToString());
    return;
  }
  last_snapshot_index_ = index;
  snapshot_running_ = true;
  snapshotter_ = std::thread([this, index, parts = replica::EncodeEntries(state)] {
    pthread_setname_np(pthread_self(), "ckpt-meta-snap");
    const absl::Time start = absl::Now();
    const absl::Status s = WriteSnapshot(index, parts);
    if (s.ok()) {
      log::Info("ckpt-meta: snapshot of log index {} ({} parts) written in {} ms; the log before it trimmed", index,
                parts.size(), absl::ToInt64Milliseconds(absl::Now() - start));
    } else {
      log::Warn("ckpt-meta: snapshot of log index {} failed (the log stays untrimmed): {}", index, s.ToString());
    }
    snapshot_running_ = false;
  });
}

absl::StatusOr<EtcdTxnResult> ReplicatedMetaStore::FencedRetried(const EtcdTxn& txn, const std::string& what) {
  const absl::Time deadline = absl::Now() + options_.append_timeout;
  absl::Duration backoff = absl::Milliseconds(20);
  for (;;) {
    absl::StatusOr<EtcdTxnResult> r = election_->FencedTxn(txn);
    if (r.ok() || !Retryable(r.status()) || absl::Now() + backoff >= deadline) {
      if (absl::IsFailedPrecondition(r.status())) {
        return absl::FailedPreconditionError(absl::StrCat("no longer the leader, ", what, ": ", r.status().message()));
      }
      return r;
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(500));
  }
}

absl::Status ReplicatedMetaStore::WriteSnapshot(uint64_t index, const std::vector<std::string>& parts) {
  for (size_t i = 0; i < parts.size(); ++i) {
    EtcdTxn put;
    put.success.push_back(EtcdOp::Put(replica::SnapshotPartKey(root_, index, static_cast<uint32_t>(i)), parts[i]));
    absl::StatusOr<EtcdTxnResult> r = FencedRetried(put, "writing a snapshot");
    if (!r.ok()) return r.status();
  }
  // The head, then what it makes redundant: log entries up to `index` and
  // older snapshots (keys sort by index).
  EtcdTxn head;
  head.success.push_back(EtcdOp::Put(replica::SnapshotHeadKey(root_),
                                     replica::EncodeSnapshotHead({index, static_cast<uint32_t>(parts.size())})));
  head.success.push_back(EtcdOp::Delete(replica::LogKey(root_, 1), replica::LogKey(root_, index + 1)));
  head.success.push_back(
      EtcdOp::Delete(replica::SnapshotPrefix(root_), replica::SnapshotPrefix(root_) + replica::EncodeIndex(index)));
  absl::StatusOr<EtcdTxnResult> r = FencedRetried(head, "trimming the log");
  if (!r.ok()) return r.status();
  // etcd keeps every old revision until compacted: free them. Followers
  // watching from before resynchronise (by reading).
  if (absl::Status s = etcd_->Compact(r->revision); !s.ok() && !absl::IsOutOfRange(s)) {
    log::Warn("ckpt-meta: compacting etcd at revision {}: {}", r->revision, s.ToString());
  }
  absl::MutexLock lock(&mu_);
  ++replica_.snapshots;
  replica_.snapshot_index = index;
  return absl::OkStatus();
}

absl::Status ReplicatedMetaStore::Append(const std::string& value) {
  const std::string key = replica::LogKey(root_, next_index_);
  const absl::Time deadline = absl::Now() + options_.append_timeout;
  absl::Duration backoff = absl::Milliseconds(20);
  for (;;) {
    EtcdTxn txn;
    txn.compare.push_back(EtcdCompare::CreateRevision(key, EtcdCompare::Result::kEqual, 0));
    txn.success.push_back(EtcdOp::Put(key, value));
    txn.failure.push_back(EtcdOp::Get(key));
    absl::StatusOr<EtcdTxnResult> r = election_->FencedTxn(std::move(txn));
    if (r.ok()) {
      if (r->succeeded) break;
      // The key exists: our own earlier try landed though its answer was lost,
      // or someone else wrote the log (which the fence rules out).
      if (r->results.empty() || r->results[0].kvs.empty() || r->results[0].kvs[0].value != value) {
        return absl::AbortedError(absl::StrCat("meta log entry ", key, " was written by another leader"));
      }
      break;
    }
    if (absl::IsFailedPrecondition(r.status())) {
      return absl::FailedPreconditionError(
          absl::StrCat("no longer the leader, appending ", key, ": ", r.status().message()));
    }
    if (!Retryable(r.status()) || absl::Now() + backoff >= deadline) return r.status();
    {
      absl::MutexLock lock(&mu_);
      ++replica_.append_retries;
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(500));
  }
  ++next_index_;
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// LogFollower

absl::StatusOr<std::unique_ptr<LogFollower>> LogFollower::Create(MetaStore* local, EtcdClient* etcd,
                                                                 std::string root) {
  absl::StatusOr<uint64_t> applied = replica::ReadAppliedIndex(local);
  if (!applied.ok()) return applied.status();
  return std::unique_ptr<LogFollower>(new LogFollower(local, etcd, std::move(root), *applied));
}

LogFollower::LogFollower(MetaStore* local, EtcdClient* etcd, std::string root, uint64_t applied)
    : local_(local), etcd_(etcd), root_(std::move(root)), next_(applied + 1), applied_(applied) {}

LogFollower::~LogFollower() { Stop(); }

void LogFollower::Start() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = false;
  }
  thread_ = std::thread([this] { Run(); });
}

void LogFollower::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

uint64_t LogFollower::applied_index() const {
  absl::MutexLock lock(&mu_);
  return applied_;
}

absl::Status LogFollower::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

bool LogFollower::WaitStopping(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(&stopping_), d);
}

absl::Status LogFollower::Apply(uint64_t index, std::string_view entry) {
  if (index < next_) return absl::OkStatus();  // seen already (a watch replaying what the read gave)
  if (index != next_) {
    return absl::AbortedError(absl::StrCat("meta log: entry ", index, " arrived while ", next_, " was due"));
  }
  absl::StatusOr<std::optional<WriteBatch>> group = assembler_.Add(entry);
  if (!group.ok()) return group.status();
  ++next_;
  if (!group->has_value()) return absl::OkStatus();
  WriteBatch batch = **std::move(group);
  batch.Put(replica::kAppliedKey, replica::EncodeIndex(index));
  if (absl::Status s = local_->Commit(std::move(batch)); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("the local store failed: ", s.message()));
  }
  absl::MutexLock lock(&mu_);
  applied_ = index;
  return absl::OkStatus();
}

absl::Status LogFollower::LoadSnapshotIfAhead() {
  absl::StatusOr<std::optional<EtcdKeyValue>> kv = etcd_->Get(replica::SnapshotHeadKey(root_));
  if (!kv.ok()) return kv.status();
  if (!kv->has_value()) return absl::OkStatus();
  absl::StatusOr<replica::SnapshotHead> head = replica::DecodeSnapshotHead((*kv)->value);
  if (!head.ok()) return head.status();
  if (head->index < next_) return absl::OkStatus();  // the log has what we need
  // Read the parts at the head's revision: a newer snapshot may be replacing them.
  EtcdRange range;
  const std::string dir = replica::SnapshotPrefix(root_) + replica::EncodeIndex(head->index) + "/";
  range.range_end = EtcdPrefixEnd(dir);
  range.revision = (*kv)->mod_revision;
  range.sort_target = EtcdRange::SortTarget::kKey;
  range.sort_order = EtcdRange::SortOrder::kAscend;
  replica::EntryAssembler assembler;
  std::optional<WriteBatch> state;
  std::string from = dir;
  uint32_t parts = 0;
  for (;;) {
    range.limit = kReadPage;
    absl::StatusOr<EtcdRangeResult> r = etcd_->Range(from, range);
    if (absl::IsOutOfRange(r.status())) return absl::AbortedError("the snapshot was replaced while read");
    if (!r.ok()) return r.status();
    for (const EtcdKeyValue& part : r->kvs) {
      ++parts;
      absl::StatusOr<std::optional<WriteBatch>> g = assembler.Add(part.value);
      if (!g.ok()) return g.status();
      if (g->has_value()) state = **std::move(g);
    }
    if (!r->more || r->kvs.empty()) break;
    from = r->kvs.back().key + std::string(1, '\0');
  }
  if (parts != head->parts || !state.has_value()) {
    return absl::AbortedError(absl::StrCat("snapshot ", head->index, " has ", parts, " of its ", head->parts, " parts"));
  }
  // One batch: everything we had goes, the snapshot comes, all or nothing.
  WriteBatch batch;
  CKPT_RETURN_IF_ERROR(local_->Scan("", [&](std::string_view k, std::string_view) {
    batch.Delete(std::string(k));
    return true;
  }));
  for (const WriteBatch::Op& op : state->ops()) batch.Put(op.key, op.value);
  batch.Put(replica::kAppliedKey, replica::EncodeIndex(head->index));
  if (absl::Status s = local_->Commit(std::move(batch)); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("the local store failed: ", s.message()));
  }
  log::Info("ckpt-meta: loaded the snapshot of log index {} ({} keys): the log before it is trimmed", head->index,
            state->size());
  next_ = head->index + 1;
  assembler_ = replica::EntryAssembler();
  absl::MutexLock lock(&mu_);
  applied_ = head->index;
  return absl::OkStatus();
}

absl::StatusOr<int64_t> LogFollower::ReadToEnd(uint64_t* end_index) {
  if (absl::Status s = LoadSnapshotIfAhead(); !s.ok()) return s;
  int64_t revision = 0;
  for (;;) {
    EtcdRange range;
    range.range_end = EtcdPrefixEnd(replica::LogPrefix(root_));
    range.limit = kReadPage;
    range.revision = revision;
    range.sort_target = EtcdRange::SortTarget::kKey;
    range.sort_order = EtcdRange::SortOrder::kAscend;
    absl::StatusOr<EtcdRangeResult> r = etcd_->Range(replica::LogKey(root_, next_), range);
    if (!r.ok()) return r.status();
    if (revision == 0) revision = r->revision;
    for (const EtcdKeyValue& kv : r->kvs) {
      absl::StatusOr<uint64_t> index = replica::LogIndexOf(root_, kv.key);
      if (!index.ok()) return absl::DataLossError(index.status().message());
      if (*index > next_) {
        // Trimmed behind a snapshot taken since we looked: load it.
        return absl::AbortedError(absl::StrCat("meta log: entry ", next_, " is trimmed; reading the snapshot"));
      }
      if (absl::Status s = Apply(*index, kv.value); !s.ok()) return s;
    }
    if (!r->more || r->kvs.empty()) break;
  }
  // A snapshot written since LoadSnapshotIfAhead looked may have trimmed the
  // entries we needed before `revision`: then the read found none of them
  // (or later ones only, caught above). The head as of that revision says.
  EtcdRange at;
  at.revision = revision;
  absl::StatusOr<EtcdRangeResult> head = etcd_->Range(replica::SnapshotHeadKey(root_), at);
  if (!head.ok()) return head.status();
  if (!head->kvs.empty()) {
    absl::StatusOr<replica::SnapshotHead> h = replica::DecodeSnapshotHead(head->kvs[0].value);
    if (!h.ok()) return h.status();
    if (h->index >= next_) {
      return absl::AbortedError(absl::StrCat("meta log: entry ", next_, " was trimmed behind snapshot ", h->index,
                                             " while read; reading the snapshot"));
    }
  }
  *end_index = next_;
  return revision;
}

absl::StatusOr<uint64_t> LogFollower::CatchUp() {
  uint64_t end = 0;
  absl::StatusOr<int64_t> r = ReadToEnd(&end);
  if (!r.ok()) return r.status();
  return end;
}

void LogFollower::Run() {
  pthread_setname_np(pthread_self(), "ckpt-meta-follow");
  absl::Status last;
  auto fail = [&](const absl::Status& s) {
    if (absl::IsDataLoss(s) || absl::IsFailedPrecondition(s)) {  // damaged log, failed store: for good
      log::Error("ckpt-meta: the follower stops applying the log: {}", s.ToString());
      absl::MutexLock lock(&mu_);
      status_ = s;
      return true;
    }
    if (s.ToString() != last.ToString()) log::Warn("ckpt-meta: following the log: {}; retrying", s.ToString());
    last = s;
    return WaitStopping(kFollowRetry);
  };
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
    }
    uint64_t end = 0;
    absl::StatusOr<int64_t> revision = ReadToEnd(&end);
    if (!revision.ok()) {
      if (fail(revision.status())) return;
      continue;
    }
    absl::StatusOr<std::unique_ptr<EtcdWatch>> watch =
        etcd_->Watch(replica::LogPrefix(root_), EtcdPrefixEnd(replica::LogPrefix(root_)), *revision + 1);
    if (!watch.ok()) {
      if (fail(watch.status())) return;
      continue;
    }
    absl::Status broke;
    while (broke.ok()) {
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return;
      }
      absl::StatusOr<std::vector<EtcdEvent>> events = (*watch)->Next(kFollowRetry);
      if (absl::IsDeadlineExceeded(events.status())) continue;
      if (!events.ok()) {
        broke = events.status();
        break;
      }
      for (const EtcdEvent& e : *events) {
        if (e.type != EtcdEvent::Type::kPut) continue;  // trimmed entries
        absl::StatusOr<uint64_t> index = replica::LogIndexOf(root_, e.kv.key);
        broke = index.ok() ? Apply(*index, e.kv.value) : absl::DataLossError(index.status().message());
        if (!broke.ok()) break;
      }
    }
    if (fail(broke)) return;
  }
}

}  // namespace ckpt::meta
