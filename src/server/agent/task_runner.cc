#include "server/agent/task_runner.h"

#include <algorithm>

#include "common/lock_check.h"
#include "common/log.h"

namespace ckpt::agent {
namespace {
constexpr size_t kFinishedMemory = 100000;
}  // namespace

TaskRunner::TaskRunner(Clock* clock, MetaSession* session, Options options, Hooks hooks)
    : clock_(clock), session_(session), options_(options), hooks_(std::move(hooks)) {}

void TaskRunner::Enqueue(std::vector<AgentTask> tasks) {
  std::vector<AgentTask> queued;
  {
    CheckedLock lock(&mu_);
    const absl::Time now = clock_->MonotonicNow();
    for (AgentTask& t : tasks) {
      if (auto f = finished_.find(t.id); f != finished_.end()) {
        if (t.attempt <= f->second) continue;  // a duplicate of what already ended
        finished_.erase(f);                      // meta retries it: run it again
      }
      auto it = tasks_.find(t.id);
      if (it != tasks_.end()) {
        it->second.task.attempt = std::max(it->second.task.attempt, t.attempt);
        continue;
      }
      QueuedTask qt;
      qt.task = std::move(t);
      qt.not_before = now;
      qt.started = now;
      log::Debug("task {} ({}) for {} step {} queued", qt.task.id, qt.task.kind_name, qt.task.job_id,
                 qt.task.step);
      queued.push_back(qt.task);
      tasks_.emplace(qt.task.id, std::move(qt));
    }
    ++wake_;
  }
  if (hooks_.on_queued) {
    for (const AgentTask& t : queued) hooks_.on_queued(t);
  }
}

void TaskRunner::Cancel(const std::vector<std::string>& ids) {
  std::vector<AgentTask> cancelled;
  {
    CheckedLock lock(&mu_);
    for (const std::string& id : ids) {
      auto it = tasks_.find(id);
      if (it != tasks_.end()) {
        cancelled.push_back(it->second.task);
        tasks_.erase(it);  // a running step finds it gone and drops its result
      }
      finished_[id] = UINT32_MAX;  // never again
    }
  }
  for (const AgentTask& t : cancelled) {
    log::Info("task {} ({} {} step {}) cancelled by meta", t.id, t.kind_name, t.job_id, t.step);
    if (hooks_.on_cancelled) hooks_.on_cancelled(t);
  }
}

bool TaskRunner::RunOnce() {
  QueuedTask qt;
  {
    CheckedLock lock(&mu_);
    if (stopping_) return false;
    const absl::Time now = clock_->MonotonicNow();
    const QueuedTask* best = nullptr;
    for (const auto& [id, t] : tasks_) {
      if (t.not_before > now || running_.count(id) != 0) continue;
      if (best == nullptr || t.task.priority > best->task.priority) best = &t;
    }
    if (best == nullptr) return false;
    qt = *best;
    running_.insert(qt.task.id);
  }
  bool finished = true;
  const absl::Status s = hooks_.step(qt, &finished);
  const bool is_flush = qt.task.kind == TaskKind::kFlush;
  if (!s.ok() && is_flush && hooks_.on_flush_error) hooks_.on_flush_error(s);
  {
    CheckedLock lock(&mu_);
    running_.erase(qt.task.id);
    auto it = tasks_.find(qt.task.id);
    if (it == tasks_.end()) return true;  // cancelled meanwhile
    qt.task.attempt = std::max(qt.task.attempt, it->second.task.attempt);
    if (s.ok() && !finished) {
      qt.not_before = clock_->MonotonicNow() + absl::Milliseconds(20);
      qt.deferred = true;
      it->second = qt;
      return false;
    }
    const bool retryable = is_flush && (absl::IsResourceExhausted(s) || absl::IsUnavailable(s) ||
                                        absl::IsInternal(s) || absl::IsPermissionDenied(s));
    if (!s.ok() && retryable && qt.tries + 1 < options_.flush_max_tries) {
      qt.tries++;
      int64_t backoff = options_.flush_retry_initial_ms << std::min(qt.tries - 1, 20);
      backoff = std::min(backoff, options_.flush_retry_max_ms);
      log::Warn("task {} ({} {} step {}) failed, retry {} in {} ms: {}", qt.task.id, qt.task.kind_name,
                qt.task.job_id, qt.task.step, qt.tries, backoff, s.ToString());
      qt.not_before = clock_->MonotonicNow() + absl::Milliseconds(backoff);
      qt.deferred = false;  // a backoff is not cut short by Poke
      it->second = qt;
      return true;
    }
    if (!s.ok()) {
      log::Error("task {} ({} {} step {}) failed: {}", qt.task.id, qt.task.kind_name, qt.task.job_id,
                 qt.task.step, s.ToString());
    }
    tasks_.erase(it);
    finished_[qt.task.id] = qt.task.attempt;
    if (finished_.size() > kFinishedMemory) finished_.erase(finished_.begin());
    ++wake_;
  }
  // The task has left the queue: the hook and the result run without the
  // runner's lock (each takes its component's own). The result follows the
  // reports the task produced (both leave in order from the session's
  // outbox).
  if (hooks_.on_ended) hooks_.on_ended(qt.task, s);
  session_->Result(qt.task.id, qt.task.attempt, s, qt.bytes_done,
                   absl::ToInt64Milliseconds(clock_->MonotonicNow() - qt.started));
  return true;
}

std::vector<RunningTask> TaskRunner::Running() const {
  CheckedLock lock(&mu_);
  std::vector<RunningTask> out;
  for (const auto& [id, t] : tasks_) out.push_back(RunningTask{id, t.task.attempt, t.bytes_done, 0});
  return out;
}

void TaskRunner::Poke() {
  CheckedLock lock(&mu_);
  const absl::Time now = clock_->MonotonicNow();
  for (auto& [id, t] : tasks_) {
    if (t.deferred && t.not_before > now) t.not_before = now;
  }
  ++wake_;
}

void TaskRunner::AwaitWork(absl::Duration timeout) {
  CheckedLock lock(&mu_);
  const absl::Time now = clock_->MonotonicNow();
  for (const auto& [id, t] : tasks_) {
    if (running_.count(id) == 0) timeout = std::min(timeout, std::max(t.not_before - now, absl::ZeroDuration()));
  }
  auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || wake_ != wake_seen_; };
  if (timeout > absl::ZeroDuration()) clock_->AwaitWithTimeout(&mu_, absl::Condition(&woken), timeout);
  wake_seen_ = wake_;
}

void TaskRunner::Stop() {
  CheckedLock lock(&mu_);
  stopping_ = true;
  ++wake_;
}

}  // namespace ckpt::agent
