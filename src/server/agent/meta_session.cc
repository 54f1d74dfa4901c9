#include "server/agent/meta_session.h"

#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/lock_check.h"
#include "common/log.h"

namespace ckpt::agent {
namespace {

constexpr size_t kMaxReportBatch = 512;
constexpr absl::Duration kFirstBackoff = absl::Milliseconds(200);
// At most as long as the channel takes to reconnect (SetReconnectArgs), both
// while meta cannot be reached and while it cannot begin a version yet (a
// begin sent while meta was away is parked too): a restarted meta, or a new
// leader among meta's replicas, hears from us within a second of serving
// rather than after a backoff that grew while it was away (measured with 5 s:
// a takeover's first PROTECTED save 3.1 s or 6.3 s, on that backoff).
constexpr absl::Duration kMaxBackoff = absl::Seconds(1);

bool IsFencing(const absl::Status& s) { return absl::IsFailedPrecondition(s) || absl::IsNotFound(s); }

// Operators drain, undrain and retire nodes with ckptctl; the agent says
// what meta's answer means for it.
void LogNodeState(NodeState state) {
  switch (state) {
    case NodeState::kAlive:
      log::Info("meta: this node is ALIVE");
      break;
    case NodeState::kDraining:
      log::Warn("meta: this node is DRAINING (ckptctl drain): it takes no new peer data and what it holds is "
                "re-protected elsewhere");
      break;
    case NodeState::kLeft:
      log::Warn("meta: this node is LEFT (drained; nothing depends on it): stop this agent to retire the node, "
                "or `ckptctl undrain` it");
      break;
    default:
      break;
  }
}

}  // namespace

bool IsPermanentRefusal(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kOutOfRange:
      return true;
    default:
      return false;
  }
}

std::string IncarnationPath(const std::string& memory_dir) { return memory_dir + "/incarnation"; }

absl::StatusOr<uint64_t> ReadIncarnationFile(FileSystem* fs, const std::string& path) {
  absl::StatusOr<std::string> text = ReadPrivateFileToString(fs, path);
  if (absl::IsNotFound(text.status())) return 0;
  if (absl::IsFailedPrecondition(text.status()) || absl::IsPermissionDenied(text.status())) {
    return absl::FailedPreconditionError(
        absl::StrCat("memory tier: ", text.status().message(), ", then start the agent again"));
  }
  if (!text.ok()) return text.status();
  uint64_t incarnation = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &incarnation)) {
    log::Warn("'{}' holds no incarnation number; meta is told of none", path);
    return 0;
  }
  return incarnation;
}

absl::Status WriteIncarnationFile(FileSystem* fs, const std::string& path, uint64_t incarnation) {
  return WritePrivateFileAtomically(fs, path, absl::StrCat(incarnation, "\n"));
}

MetaSession::MetaSession(MetaLink* meta, Clock* clock, AgentMetrics* metrics, Options options, Delegate* delegate)
    : meta_(meta), clock_(clock), metrics_(metrics), options_(std::move(options)), delegate_(delegate) {
  CheckedLock lock(&mu_);
  previous_incarnation_ = options_.previous_incarnation;
}

void MetaSession::PushLocked(Outbound o) {
  o.seq = next_seq_++;
  if (!parked_.empty()) {
    if (std::optional<VersionKey> v = VersionOf(o); v) {
      if (auto p = parked_.find(*v); p != parked_.end()) {
        p->second.items.push_back(std::move(o));  // after its Begin
        return;
      }
    }
  }
  outbox_.push_back(std::move(o));
  ++wake_;
}

std::optional<MetaSession::VersionKey> MetaSession::VersionOf(const Outbound& o) {
  if (o.kind == Outbound::Kind::kBegin) return VersionKey{o.report.id.job_id, o.report.id.step};
  if (o.kind == Outbound::Kind::kReport && o.report.kind == HoldingReport::Kind::kStaged && o.report.record) {
    return VersionKey{o.report.record->id.job_id, o.report.record->id.step};
  }
  return std::nullopt;
}

void MetaSession::ParkHeadLocked(const absl::Status& why) {
  Outbound& head = outbox_.front();
  const VersionKey key{head.report.id.job_id, head.report.id.step};
  head.park_backoff = head.park_backoff == absl::ZeroDuration() ? kFirstBackoff
                                                                : std::min(head.park_backoff * 2, kMaxBackoff);
  Parked& p = parked_[key];
  p.due = clock_->MonotonicNow() + head.park_backoff;
  std::erase_if(outbox_, [&](Outbound& o) {
    std::optional<VersionKey> v = VersionOf(o);
    if (!v || *v != key) return false;
    p.items.push_back(std::move(o));
    return true;
  });
  const absl::Duration wait = p.items.front().park_backoff;
  if (wait == kFirstBackoff) {
    log::Warn("meta cannot begin version {} step {} yet ({}); its {} report(s) wait here, other reports go on",
              key.first, key.second, why.ToString(), p.items.size() - 1);
  } else {
    log::Debug("version {} step {} still cannot begin ({}); retry in {} ms", key.first, key.second,
               why.ToString(), absl::ToInt64Milliseconds(wait));
  }
}

void MetaSession::UnparkDueLocked() {
  const absl::Time now = clock_->MonotonicNow();
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (it->second.due > now) {
      ++it;
      continue;
    }
    std::vector<Outbound>& items = it->second.items;
    outbox_.insert(outbox_.begin(), std::make_move_iterator(items.begin()), std::make_move_iterator(items.end()));
    it = parked_.erase(it);
    ++wake_;
  }
}

void MetaSession::Begin(const std::string& job, uint64_t step, const std::string& run_id) {
  Outbound o;
  o.kind = Outbound::Kind::kBegin;
  o.report.id = ShardId{job, step, 0};
  o.run_id = run_id;
  CheckedLock lock(&mu_);
  PushLocked(std::move(o));
}

void MetaSession::Report(HoldingReport report, Done on_done) {
  Outbound o;
  o.report = std::move(report);
  o.on_done = std::move(on_done);
  {
    CheckedLock lock(&mu_);
    if (!stopping_) {
      PushLocked(std::move(o));
      return;
    }
  }
  if (o.on_done) o.on_done(absl::CancelledError("agent is shutting down"));
}

void MetaSession::Result(const std::string& task_id, uint32_t attempt, const absl::Status& result, uint64_t bytes,
                         int64_t duration_ms) {
  Outbound o;
  o.kind = Outbound::Kind::kResult;
  o.task_id = task_id;
  o.attempt = attempt;
  o.result = result;
  o.bytes = bytes;
  o.duration_ms = duration_ms;
  CheckedLock lock(&mu_);
  PushLocked(std::move(o));
}

void MetaSession::ForgetVersion(const std::string& job, uint64_t step) {
  std::vector<Done> cancelled;
  {
    CheckedLock lock(&mu_);
    if (auto p = parked_.find(VersionKey{job, step}); p != parked_.end()) {
      for (Outbound& o : p->second.items) {
        if (o.on_done) cancelled.push_back(std::move(o.on_done));
      }
      parked_.erase(p);
    }
    std::erase_if(outbox_, [&](Outbound& o) {
      const bool match = o.kind == Outbound::Kind::kReport && o.report.kind == HoldingReport::Kind::kStaged &&
                         o.report.record != nullptr && o.report.record->id.job_id == job &&
                         o.report.record->id.step == step;
      if (match && o.on_done) cancelled.push_back(std::move(o.on_done));
      return match;
    });
  }
  for (Done& d : cancelled) d(absl::CancelledError("the version was refused by meta"));
}

void MetaSession::BackOffLocked(const absl::Status& why) {
  metrics_->meta_errors->Increment();
  if (meta_reachable_) log::Warn("meta call failed, will retry: {}", why.ToString());
  meta_reachable_ = false;
  backoff_ = backoff_ == absl::ZeroDuration() ? kFirstBackoff : std::min(backoff_ * 2, kMaxBackoff);
  next_send_ = clock_->MonotonicNow() + backoff_;
}

void MetaSession::FencedLocked(const absl::Status& why) {
  metrics_->meta_errors->Increment();
  log::Warn("meta fenced this agent ({}); registering again", why.ToString());
  registered_ = false;
  inventory_applied_ = false;
  metrics_->registered->Set(0);
  next_register_ = clock_->MonotonicNow();
}

void MetaSession::Register() {
  NodeRegistration reg;
  reg.node_id = options_.node_id;
  reg.grpc_address = options_.grpc_address;
  reg.data_address = options_.data_address ? options_.data_address() : std::string();
  reg.failure_domain = options_.failure_domain;
  reg.host_node_id = options_.host_node_id;
  reg.agent_version = "0.1.0";
  reg.memory_capacity_bytes = options_.memory_capacity_bytes;
  {
    CheckedLock lock(&mu_);
    reg.previous_incarnation = std::max(previous_incarnation_, incarnation_);
  }
  absl::StatusOr<RegistrationReply> r = meta_->Register(reg);
  if (r.ok() && !options_.memory_dir.empty()) {
    // Remembered across restarts so meta can fence the old incarnation. A
    // failed write leaves the previous file whole (the next start then names
    // an older incarnation): worth a warning, not a failed registration.
    FileSystem* fs = options_.fs != nullptr ? options_.fs : PosixFileSystem();
    const std::string path = IncarnationPath(options_.memory_dir);
    if (absl::Status s = WriteIncarnationFile(fs, path, r->incarnation); !s.ok()) {
      log::Warn("cannot remember incarnation {} in '{}': {}", r->incarnation, path, s.ToString());
    }
  }
  if (r.ok()) {
    // The data plane takes the key at once: peers that meta now tells about
    // this agent connect to it.
    if (options_.on_data_plane_key) options_.on_data_plane_key(r->data_plane_key);
  }
  CheckedLock lock(&mu_);
  const absl::Time now = clock_->MonotonicNow();
  if (!r.ok()) {
    metrics_->meta_errors->Increment();
    // Said once per kind of failure: a refusal (UNAUTHENTICATED, a bad
    // certificate) that follows a timeout must still reach the log.
    if (meta_reachable_ || next_register_ == absl::InfinitePast() || r.status().code() != last_register_error_) {
      log::Warn("cannot register with meta: {}", r.status().ToString());
    }
    last_register_error_ = r.status().code();
    meta_reachable_ = false;
    next_register_ = now + absl::Seconds(1);
    return;
  }
  incarnation_ = r->incarnation;
  registered_ = true;
  meta_reachable_ = true;
  inventory_due_ = true;
  inventory_applied_ = false;
  deferred_tasks_.clear();  // the new incarnation's stream delivers them again
  backoff_ = absl::ZeroDuration();
  next_send_ = absl::InfinitePast();
  heartbeat_ms_ = r->heartbeat_ms > 0 ? r->heartbeat_ms : 1000;
  lease_ms_ = r->lease_ms > 0 ? r->lease_ms : 5000;
  lease_valid_until_ = now + absl::Milliseconds(lease_ms_);
  next_heartbeat_ = now + absl::Milliseconds(heartbeat_ms_);
  last_heartbeat_unix_ms_ = clock_->NowUnixMillis();
  metrics_->registered->Set(1);
  log::Info("registered with meta as {} incarnation {}", options_.node_id, incarnation_);
}

void MetaSession::SendInventory() {
  const std::vector<InventoryItem> items = delegate_->InventoryItems();
  uint64_t inc;
  {
    CheckedLock lock(&mu_);
    inc = incarnation_;
  }
  absl::StatusOr<InventoryReply> r = meta_->ReportInventory(options_.node_id, inc, items);
  {
    CheckedLock lock(&mu_);
    if (!r.ok()) {
      if (IsFencing(r.status())) {
        FencedLocked(r.status());
      } else {
        BackOffLocked(r.status());
      }
      return;
    }
    inventory_due_ = false;
  }
  for (const ShardId& id : r->unknown) {
    log::Warn("meta does not know {} (kept; see ckptctl status)", ShardIdString(id));
  }
  if (!r->drop.empty() || !r->drop_segments.empty()) delegate_->OnDrop(r->drop, r->drop_segments);
  std::vector<AgentTask> deferred;
  {
    CheckedLock lock(&mu_);
    if (inventory_due_) return;  // meta restarted meanwhile: another inventory first
    inventory_applied_ = true;  // opens the task stream
    deferred.swap(deferred_tasks_);
  }
  if (!deferred.empty()) delegate_->OnTasks(std::move(deferred), {});
}

void MetaSession::DeferTasksLocked(std::vector<AgentTask>& tasks) {
  if (inventory_applied_) return;
  for (AgentTask& t : tasks) deferred_tasks_.push_back(std::move(t));
  tasks.clear();
}

void MetaSession::SendOutbox() {
  while (true) {
    std::vector<Outbound> batch;  // reports: copies (the originals stay queued until answered)
    std::optional<Outbound> head;
    uint64_t inc;
    {
      CheckedLock lock(&mu_);
      if (!parked_.empty()) UnparkDueLocked();
      if (outbox_.empty() || !registered_ || stopping_ || clock_->MonotonicNow() < next_send_) return;
      inc = incarnation_;
      if (outbox_.front().kind != Outbound::Kind::kReport) {
        head = outbox_.front();
        head->on_done = nullptr;
      } else {
        for (const Outbound& o : outbox_) {
          if (o.kind != Outbound::Kind::kReport || batch.size() == kMaxReportBatch) break;
          Outbound copy = o;
          copy.on_done = nullptr;
          batch.push_back(std::move(copy));
        }
      }
    }
    if (head && head->kind == Outbound::Kind::kBegin) {
      const ShardId& v = head->report.id;
      absl::StatusOr<uint32_t> ws = meta_->BeginVersion(v.job_id, v.step, head->run_id, options_.node_id);
      {
        CheckedLock lock(&mu_);
        if (!ws.ok() && !IsPermanentRefusal(ws.status())) {
          // Keep the version's shards (they are committed) and try again
          // later; the rest of the outbox goes on (if meta is away, its next
          // call fails too and backs off).
          if (!outbox_.empty() && outbox_.front().seq == head->seq) ParkHeadLocked(ws.status());
          continue;
        }
        backoff_ = absl::ZeroDuration();
        meta_reachable_ = true;
        if (!outbox_.empty() && outbox_.front().seq == head->seq) outbox_.pop_front();
      }
      if (!ws.ok()) {
        // Meta refused the version for good (a step lower than the job's
        // newest, a deleted job...): its shards here can never be staged.
        log::Error("meta refused version {} step {} ({}); dropping its shards on this node", v.job_id, v.step,
                   ws.status().ToString());
        ForgetVersion(v.job_id, v.step);
        delegate_->OnVersionRefused(v.job_id, v.step, head->run_id, ws.status());
      }
      continue;
    }
    if (head) {  // a task result
      absl::Status s = meta_->ReportTaskResult(options_.node_id, inc, head->task_id, head->attempt, head->result,
                                               head->bytes, head->duration_ms);
      CheckedLock lock(&mu_);
      if (!s.ok() && absl::IsFailedPrecondition(s)) {
        FencedLocked(s);
        return;  // keep it: the new incarnation sends it
      }
      if (!s.ok() && !IsPermanentRefusal(s)) {
        BackOffLocked(s);
        return;
      }
      if (!s.ok()) log::Warn("task result for {} not accepted: {}", head->task_id, s.ToString());
      backoff_ = absl::ZeroDuration();
      meta_reachable_ = true;
      if (!outbox_.empty() && outbox_.front().seq == head->seq) outbox_.pop_front();
      continue;
    }
    std::vector<HoldingReport> reports;
    reports.reserve(batch.size());
    for (const Outbound& o : batch) reports.push_back(o.report);
    absl::StatusOr<ReportReply> r = meta_->ReportShards(options_.node_id, inc, reports);
    std::vector<std::pair<Done, absl::Status>> done;
    std::vector<std::pair<HoldingReport, absl::Status>> refused;
    {
      CheckedLock lock(&mu_);
      if (!r.ok()) {
        if (IsFencing(r.status())) {
          FencedLocked(r.status());
        } else {
          BackOffLocked(r.status());
        }
        return;  // everything stays queued
      }
      backoff_ = absl::ZeroDuration();
      meta_reachable_ = true;
      std::map<uint64_t, absl::Status> answered;
      for (size_t i = 0; i < reports.size(); ++i) {
        const absl::Status s = i < r->results.size() ? r->results[i] : absl::OkStatus();
        answered[batch[i].seq] = s;
        const bool staged = reports[i].kind == HoldingReport::Kind::kStaged;
        const ShardId id = staged ? reports[i].record->id : reports[i].id;
        if (!s.ok() && !absl::IsAlreadyExists(s)) {
          // FailedPrecondition: meta refuses this copy (it does not match, its
          // version ended); NotFound: meta has no such version (refused or
          // deleted). Either way a copy that was reported VALID can never count:
          // it must not stay in memory for good.
          const bool valid_copy = staged || ((reports[i].kind == HoldingReport::Kind::kCopyState ||
                                              reports[i].kind == HoldingReport::Kind::kSegment) &&
                                             reports[i].copy_state == CopyState::kValid);
          if (valid_copy && (absl::IsFailedPrecondition(s) || absl::IsNotFound(s))) {
            refused.emplace_back(reports[i], s);
          } else {
            log::Warn("meta refused a report about {}: {}", ShardIdString(id), s.ToString());
          }
        }
      }
      std::erase_if(outbox_, [&](Outbound& o) {
        auto a = answered.find(o.seq);
        if (a == answered.end()) return false;
        if (o.on_done) done.emplace_back(std::move(o.on_done), a->second);
        return true;
      });
    }
    for (auto& [report, s] : refused) delegate_->OnCopyRefused(report, s);
    for (auto& [fn, s] : done) fn(s);
    {
      CheckedLock lock(&mu_);
      DeferTasksLocked(r->tasks);
    }
    if (!r->tasks.empty()) delegate_->OnTasks(std::move(r->tasks), {});
  }
}

void MetaSession::Heartbeat() {
  LoadReport load = delegate_->Load();
  uint64_t inc;
  {
    CheckedLock lock(&mu_);
    inc = incarnation_;
    load.stopping = announced_stop_;
  }
  uint64_t number = 0;
  if (options_.membership != nullptr) {
    load.membership_generation = options_.membership->generation();
    number = options_.membership->Sending();
  }
  const absl::Time sent = clock_->MonotonicNow();
  absl::StatusOr<HeartbeatReply> r = meta_->Heartbeat(options_.node_id, inc, load);
  if (r.ok() && options_.membership != nullptr) {
    options_.membership->Update(number, r->membership_generation, r->members);
  }
  {
    CheckedLock lock(&mu_);
    const absl::Time now = clock_->MonotonicNow();
    if (!r.ok()) {
      if (IsFencing(r.status())) {
        FencedLocked(r.status());
      } else {
        metrics_->meta_errors->Increment();
        if (meta_reachable_) log::Warn("heartbeat failed: {}", r.status().ToString());
        meta_reachable_ = false;
        next_heartbeat_ = now + absl::Milliseconds(heartbeat_ms_);
      }
      return;
    }
    meta_reachable_ = true;
    if (r->node_state != node_state_ && (node_state_ != NodeState::kUnknown || r->node_state != NodeState::kAlive)) {
      LogNodeState(r->node_state);
    }
    node_state_ = r->node_state;
    lease_ms_ = r->lease_ms > 0 ? r->lease_ms : lease_ms_;
    heartbeat_ms_ = r->heartbeat_ms > 0 ? r->heartbeat_ms : heartbeat_ms_;
    lease_valid_until_ = sent + absl::Milliseconds(lease_ms_);
    next_heartbeat_ = now + absl::Milliseconds(heartbeat_ms_);
    last_heartbeat_unix_ms_ = clock_->NowUnixMillis();
    if (r->inventory_required) {  // meta restarted
      inventory_due_ = true;
      inventory_applied_ = false;
    }
    DeferTasksLocked(r->tasks);
  }
  if (!r->tasks.empty() || !r->cancelled_task_ids.empty()) {
    delegate_->OnTasks(std::move(r->tasks), std::move(r->cancelled_task_ids));
  }
}

void MetaSession::ControlOnce() {
  const absl::Time round_start = clock_->MonotonicNow();
  bool registered, register_due, inventory_due, heartbeat_due, have_outbox;
  {
    CheckedLock lock(&mu_);
    if (stopping_) return;
    const absl::Time now = clock_->MonotonicNow();
    registered = registered_;
    register_due = !registered_ && now >= next_register_;
  }
  if (!registered) {
    if (register_due) Register();
    CheckedLock lock(&mu_);
    if (!registered_) return;
  }
  {
    CheckedLock lock(&mu_);
    inventory_due = inventory_due_;
    have_outbox = !outbox_.empty() || !parked_.empty();
  }
  // Reports before the inventory: meta must know a shard before it judges
  // the holding.
  const absl::Time outbox_start = clock_->MonotonicNow();
  if (have_outbox || inventory_due) SendOutbox();
  const absl::Time outbox_done = clock_->MonotonicNow();
  {
    CheckedLock lock(&mu_);
    inventory_due = inventory_due_ && registered_;
  }
  if (inventory_due) SendInventory();
  {
    CheckedLock lock(&mu_);
    heartbeat_due = registered_ && clock_->MonotonicNow() >= next_heartbeat_;
  }
  if (heartbeat_due) Heartbeat();
  // A slow round delays the heartbeat and risks the lease: say why.
  const absl::Duration took = clock_->MonotonicNow() - round_start;
  if (took > absl::Milliseconds(500)) {
    log::Warn("control round took {} ms (outbox {} ms, rest {} ms)", absl::ToInt64Milliseconds(took),
              absl::ToInt64Milliseconds(outbox_done - outbox_start),
              absl::ToInt64Milliseconds(clock_->MonotonicNow() - outbox_done));
  }
}

void MetaSession::WatchLoop() {
  while (true) {
    uint64_t inc;
    {
      CheckedLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || (registered_ && inventory_applied_);
      };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      inc = incarnation_;
    }
    absl::Status s = meta_->WatchTasks(options_.node_id, inc,
                                       [this](std::vector<AgentTask> tasks, std::vector<std::string> cancelled,
                                              std::vector<VersionNotice> versions) {
                                         if (!versions.empty()) ApplyVersionNotices(versions);
                                         if (!tasks.empty() || !cancelled.empty()) {
                                           delegate_->OnTasks(std::move(tasks), std::move(cancelled));
                                         }
                                       });
    CheckedLock lock(&mu_);
    if (stopping_) return;
    if (absl::IsUnimplemented(s)) return;  // no stream: heartbeats deliver tasks
    log::Debug("task stream ended: {}", s.ToString());
    // Reopen after a pause (or at once after re-registration).
    const uint64_t seen = incarnation_;
    auto changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || incarnation_ != seen; };
    clock_->AwaitWithTimeout(&mu_, absl::Condition(&changed), absl::Seconds(1));
  }
}

void MetaSession::AnnounceStop() {
  {
    CheckedLock lock(&mu_);
    if (announced_stop_) return;
    announced_stop_ = true;
    if (incarnation_ == 0) return;  // never registered: nothing to tell
    // Meta did not answer the last heartbeat: a stop must not wait out an
    // RPC deadline for it (the lease expiry then counts, as before).
    if (!meta_reachable_) return;
  }
  Heartbeat();
}

void MetaSession::Stop() {
  std::vector<Done> cancelled;
  {
    CheckedLock lock(&mu_);
    stopping_ = true;
    ++wake_;
    for (Outbound& o : outbox_) {
      if (o.on_done) cancelled.push_back(std::move(o.on_done));
    }
    for (auto& [key, p] : parked_) {
      for (Outbound& o : p.items) {
        if (o.on_done) cancelled.push_back(std::move(o.on_done));
      }
    }
  }
  meta_->CancelWatch();
  for (Done& d : cancelled) d(absl::CancelledError("agent is shutting down"));
}

void MetaSession::HeartbeatSoon() {
  CheckedLock lock(&mu_);
  next_heartbeat_ = absl::InfinitePast();
  ++wake_;
}

void MetaSession::AwaitWork(absl::Duration timeout) {
  CheckedLock lock(&mu_);
  auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || wake_ != wake_seen_; };
  clock_->AwaitWithTimeout(&mu_, absl::Condition(&woken), timeout);
  wake_seen_ = wake_;
}

MetaSession::Snapshot MetaSession::Status() const {
  CheckedLock lock(&mu_);
  Snapshot s;
  s.incarnation = incarnation_;
  s.registered = registered_ && !inventory_due_;
  s.meta_reachable = meta_reachable_;
  s.last_heartbeat_unix_ms = last_heartbeat_unix_ms_;
  s.lease_remaining_ms =
      registered_ ? absl::ToInt64Milliseconds(lease_valid_until_ - clock_->MonotonicNow()) : 0;
  s.node_state = node_state_;
  s.outbox = outbox_.size();
  for (const auto& [key, p] : parked_) s.outbox += p.items.size();
  return s;
}

uint64_t MetaSession::incarnation() const {
  CheckedLock lock(&mu_);
  return incarnation_;
}

bool MetaSession::VersionStaged(const std::string& job, uint64_t step) const {
  CheckedLock lock(&mu_);
  auto it = staged_.find(job);
  return it != staged_.end() && it->second.contains(step);
}

void MetaSession::ApplyVersionNotices(const std::vector<VersionNotice>& notices) {
  CheckedLock lock(&mu_);
  for (const VersionNotice& n : notices) {
    if (n.staged) {
      std::set<uint64_t>& steps = staged_[n.job_id];
      steps.insert(n.step);
      if (steps.size() > kMaxStagedSteps) steps.erase(steps.begin());
    } else if (auto it = staged_.find(n.job_id); it != staged_.end()) {
      it->second.erase(n.step);
      if (it->second.empty()) staged_.erase(it);
    }
  }
  size_t count = 0;
  for (const auto& [job, steps] : staged_) count += steps.size();
  metrics_->restorable_versions->Set(static_cast<double>(count));
}

void MetaSession::ForgetStaged(const std::string& job, uint64_t step) {
  ApplyVersionNotices({VersionNotice{job, step, /*staged=*/false}});
}

}  // namespace ckpt::agent
