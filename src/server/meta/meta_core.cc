// MetaCore: construction, loading the store (Open), the durability thread,
// and the transaction's submit. The public operations live by concern in
// meta_nodes.cc, meta_jobs.cc, meta_versions.cc, meta_reports.cc,
// meta_tick.cc and meta_status.cc; the Engine they run on in engine_*.cc.
#include "server/meta/meta_core.h"

#include <pthread.h>
#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/meta/core_state.h"
#include "server/meta/transitions.h"

namespace ckpt::meta {

namespace {

uint64_t RandomInstanceId() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ 1;
}

}  // namespace

uint64_t Txn::Submit(MetaStore* store,
                     const std::map<std::string, std::map<uint64_t, Version>>& versions) {
  auto find = [&](const std::pair<std::string, uint64_t>& k) -> const Version* {
    auto j = versions.find(k.first);
    if (j == versions.end()) return nullptr;
    auto v = j->second.find(k.second);
    return v == j->second.end() ? nullptr : &v->second;
  };
  for (const auto& k : headers_) {
    if (const Version* v = find(k)) {
      batch_.Put(records::VersionKey(k.first, k.second), records::EncodeVersionHeader(*v));
    }
  }
  for (const auto& [k, rank] : shards_) {
    const Version* v = find(k);
    if (v == nullptr) continue;
    auto it = v->shards.find(rank);
    if (it != v->shards.end()) {
      batch_.Put(records::ShardKey(k.first, k.second, rank), records::EncodeShard(it->second));
    }
  }
  for (const auto& k : segments_) {
    if (const Version* v = find(k)) {
      batch_.Put(records::SegmentsKey(k.first, k.second), records::EncodeSegments(*v));
    }
  }
  if (batch_.empty()) return 0;
  // The caller waited for room before taking its lock (MetaCore::Apply).
  return store->SubmitNoWait(std::move(batch_));
}

Version Summary(const Version& v) {
  Version copy = v;
  for (auto& [rank, sh] : copy.shards) {
    sh.items.clear();
    sh.copies.clear();
  }
  copy.segments.clear();
  copy.blobs.clear();
  return copy;
}

MetaCore::MetaCore(MetaStore* store, Clock* clock, MetaOptions options)
    : store_(store),
      clock_(clock),
      options_(std::move(options)),
      instance_id_(RandomInstanceId()),
      start_ms_(clock->NowUnixMillis()),
      state_(std::make_unique<State>()) {}

MetaCore::~MetaCore() { Stop(); }

void MetaCore::Stop() {
  {
    absl::MutexLock lock(&durable_mu_);
    durable_stopping_ = true;
  }
  if (durable_thread_.joinable()) durable_thread_.join();
}

void MetaCore::WhenDurable(uint64_t seq, std::function<void(absl::Status)> done) {
  if (seq == 0) {
    done(absl::OkStatus());
    return;
  }
  {
    absl::MutexLock lock(&durable_mu_);
    if (!durable_stopping_) {
      durable_queue_.emplace_back(seq, std::move(done));
      return;
    }
  }
  done(store_->AwaitDurable(seq));  // after Stop(): nobody else would call it
}

uint64_t MetaCore::SubmitLocked(Txn& txn) {
  const uint64_t seq = txn.Submit(store_, state_->versions);
  if (seq != 0) state_->last_seq = seq;
  return state_->last_seq;
}

uint64_t MetaCore::VisibleSeqLocked() const { return state_->last_seq; }

void MetaCore::DurableLoop() {
  // Linux limits thread names to 15 bytes.
  pthread_setname_np(pthread_self(), "ckpt-meta-dur");
  std::deque<std::pair<uint64_t, std::function<void(absl::Status)>>> batch;
  for (;;) {
    {
      absl::MutexLock lock(&durable_mu_);
      durable_mu_.Await(absl::Condition(
          +[](MetaCore* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->durable_mu_) {
            return c->durable_stopping_ || !c->durable_queue_.empty();
          },
          this));
      if (durable_queue_.empty()) return;  // stopping, and everything completed
      batch.swap(durable_queue_);
    }
    // Durability is ordered: after the first wait, later sequences of the
    // same group commit return at once.
    for (auto& [seq, done] : batch) done(store_->AwaitDurable(seq));
    batch.clear();
  }
}

absl::StatusOr<std::unique_ptr<MetaCore>> MetaCore::Open(MetaStore* store, Clock* clock,
                                                         MetaOptions options) {
  std::unique_ptr<MetaCore> core(new MetaCore(store, clock, std::move(options)));
  absl::MutexLock lock(&core->mu_);
  State& s = *core->state_;
  absl::Status err;
  auto scan = [&](std::string_view prefix, auto fn) -> absl::Status {
    absl::Status st = store->Scan(prefix, [&](std::string_view k, std::string_view v) {
      err = fn(k, v);
      return err.ok();
    });
    return st.ok() ? err : st;
  };
  const absl::Time mono = clock->MonotonicNow();
  CKPT_RETURN_IF_ERROR(scan(records::kNodePrefix, [&](std::string_view k, std::string_view v) {
    CKPT_ASSIGN_OR_RETURN(Node n, records::DecodeNode(k, v));
    n.lease_deadline = mono + core->options_.lease;
    n.inventory_received = false;
    s.nodes[n.id] = std::move(n);
    return absl::OkStatus();
  }));
  CKPT_RETURN_IF_ERROR(scan(records::kJobPrefix, [&](std::string_view k, std::string_view v) {
    CKPT_ASSIGN_OR_RETURN(Job j, records::DecodeJob(k, v));
    s.jobs[j.spec.job_id] = std::move(j);
    return absl::OkStatus();
  }));
  CKPT_RETURN_IF_ERROR(
      scan(records::kAllVersionsPrefix, [&](std::string_view k, std::string_view v) {
        CKPT_ASSIGN_OR_RETURN(Version ver, records::DecodeVersionHeader(k, v));
        s.versions[ver.job_id][ver.step] = std::move(ver);
        return absl::OkStatus();
      }));
  auto version_of = [&](const std::string& job, uint64_t step) -> Version* {
    auto j = s.versions.find(job);
    if (j == s.versions.end()) return nullptr;
    auto it = j->second.find(step);
    return it == j->second.end() ? nullptr : &it->second;
  };
  CKPT_RETURN_IF_ERROR(
      scan(records::kAllShardsPrefix, [&](std::string_view k, std::string_view v) {
        // s/<job>/<step>/<rank>
        const std::string key(k);
        const size_t a = key.find('/', 2), b = key.rfind('/');
        Version* ver = version_of(key.substr(2, a - 2), std::stoull(key.substr(a + 1, b - a - 1)));
        if (ver == nullptr) return absl::OkStatus();  // orphan of a removed version
        CKPT_ASSIGN_OR_RETURN(Shard sh, records::DecodeShard(k, v));
        ver->shards[sh.rank] = std::move(sh);
        return absl::OkStatus();
      }));
  CKPT_RETURN_IF_ERROR(
      scan(records::kAllSegmentsPrefix, [&](std::string_view k, std::string_view v) {
        const std::string key(k);
        const size_t a = key.rfind('/');
        Version* ver = version_of(key.substr(2, a - 2), std::stoull(key.substr(a + 1)));
        if (ver == nullptr) return absl::OkStatus();
        return records::DecodeSegments(k, v, ver);
      }));
  CKPT_RETURN_IF_ERROR(scan(records::kTaskPrefix, [&](std::string_view k, std::string_view v) {
    CKPT_ASSIGN_OR_RETURN(Task t, records::DecodeTask(k, v));
    t.last_progress = mono;
    if (t.state == TaskState::kRunning) {
      CKPT_RETURN_IF_ERROR(Transition(&t.state, TaskState::kPending));  // re-deliver
    }
    s.tasks_by_version[{t.job_id, t.step}].insert(t.id);
    s.tasks[t.id] = std::move(t);
    return absl::OkStatus();
  }));
  for (const auto& [job_id, by_step] : s.versions) {
    for (const auto& [step, v] : by_step) {
      if (v.state == VersionState::kOpen) s.open_progress[{job_id, step}] = mono;
      // A version kept for a dead node's copies before the restart: Tick
      // decides once their grace is over, even if nothing else touches it.
      if (IsTerminal(v.state)) continue;
      int64_t lost_ms = 0;
      for (const auto& [rank, sh] : v.shards)
        for (const Copy& c : sh.copies)
          if (c.state == CopyState::kLost) lost_ms = std::max(lost_ms, c.updated_ms);
      for (const Segment& seg : v.segments)
        if (seg.state == CopyState::kLost) lost_ms = std::max(lost_ms, seg.updated_ms);
      if (lost_ms != 0) {
        s.awaiting_return[{job_id, step}] =
            lost_ms + absl::ToInt64Milliseconds(core->options_.lost_copy_grace);
      }
    }
  }
  auto next = store->Get(records::kNextTaskIdKey);
  if (next.ok()) {
    s.next_task_id = std::stoull(*next);
  } else if (!absl::IsNotFound(next.status())) {
    return next.status();
  }
  log::Info("meta state loaded: {} nodes, {} jobs, {} tasks", s.nodes.size(), s.jobs.size(),
            s.tasks.size());
  s.membership_generation = core->instance_id_ | 1;
  MetaCore* const c = core.get();
  core->durable_thread_ = std::thread([c] { c->DurableLoop(); });
  return core;
}

MetaCounters MetaCore::counters() const {
  absl::MutexLock lock(&mu_);
  return state_->counters;
}

}  // namespace ckpt::meta
