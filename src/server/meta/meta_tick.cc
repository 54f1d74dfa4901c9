// MetaCore::Tick: the time-driven work, as named steps of the Engine, each
// doing one job, run in this order under one lock and one transaction.
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/meta/core_state.h"
#include "server/meta/records.h"

namespace ckpt::meta {

absl::Status MetaCore::Tick() {
  return Write([&](Engine& e) -> absl::Status {
    // One reading of the clocks for every step, as one decision.
    const absl::Time mono = e.Mono();
    const int64_t now = e.NowMs();
    e.ExpireLeases(mono, now);
    e.RetireDrainedNodes(now);
    e.RetryAndTimeOutTasks(mono, now);
    e.RetryHeldOffPushes(now);
    e.EndLostCopyGraces(now);
    e.AbortStalledOpenVersions(mono);
    e.RemoveDeletedJobs();
    return absl::OkStatus();
  });
}

void Engine::ExpireLeases(absl::Time mono, int64_t now) {
  std::vector<std::string> dead;
  for (auto& [id, n] : s_.nodes) {
    if (!IsUsable(id)) continue;
    if (mono >= n.lease_deadline) {
      dead.push_back(id);
    } else if (n.state == NodeState::kAlive &&
               mono >= n.lease_deadline - options_.lease + 2 * options_.heartbeat_interval) {
      SetNodeState(n, NodeState::kSuspect).IgnoreError();  // transient: not persisted
    }
  }
  for (const std::string& id : dead) {
    Node& n = s_.nodes[id];
    SetNodeState(n, NodeState::kDead).IgnoreError();  // a refusal is logged by SetNodeState
    n.state_since_ms = now;
    // A clean stop (the agent said so) or a drained node is no failure:
    // the MTBF behind the recommended interval counts crashes only.
    const bool graceful = n.stopping || n.drained;
    if (!graceful) ++n.failures;
    txn_.Node(n);
    ++s_.counters.nodes_declared_dead_total;
    ++s_.membership_generation;
    log::Warn("node {} declared DEAD: lease expired (last heartbeat {} ms ago){}", id,
              now - n.last_heartbeat_ms,
              n.stopping  ? "; it had stopped cleanly: not counted as a failure"
              : n.drained ? "; it was drained: not counted as a failure"
                          : "");
    NodeLost(id, "node died (lease expired)");
  }
}

void Engine::RetireDrainedNodes(int64_t now) {
  for (auto& [id, n] : s_.nodes) {
    if (n.state != NodeState::kDraining) continue;
    bool needed = false;
    for (auto& [job_id, by_step] : s_.versions) {
      for (auto& [step, v] : by_step) {
        if (IsTerminal(v.state) || v.evicted) continue;
        if (v.state != VersionState::kProtected && v.state != VersionState::kPersisted) {
          for (const auto& [r, sh] : v.shards)
            for (const Copy& c : sh.copies)
              needed = needed || (c.node_id == id && c.state == CopyState::kValid);
          for (const Segment& seg : v.segments)
            needed = needed || (seg.holder_node_id == id && seg.state == CopyState::kValid);
        }
      }
    }
    if (!needed) {
      SetNodeState(n, NodeState::kLeft).IgnoreError();  // a refusal is logged by SetNodeState
      n.state_since_ms = now;
      txn_.Node(n);
      ++s_.membership_generation;
      log::Info("node {} drained: now LEFT", id);
    }
  }
}

void Engine::RetryAndTimeOutTasks(absl::Time mono, int64_t now) {
  std::vector<std::string> failed;
  for (auto& [id, t] : s_.tasks) {
    if (t.state == TaskState::kRetryWait && now >= t.retry_at_ms) {
      ++t.attempt;
      SetTaskState(t, TaskState::kPending).IgnoreError();  // a refusal is logged by SetTaskState
      t.last_progress = mono;
      txn_.Task(t);
      ++s_.task_generation;
    } else if ((t.state == TaskState::kPending || t.state == TaskState::kRunning) &&
               mono - t.last_progress >= absl::Milliseconds(t.timeout_ms)) {
      if (t.attempt >= static_cast<uint32_t>(Task::kMaxAttempts)) {
        SetTaskState(t, TaskState::kFailed).IgnoreError();  // logged if refused
        t.last_error = "timed out";
        ++s_.counters.tasks_failed_total;
        failed.push_back(id);
      } else {
        ++t.attempt;
        SetTaskState(t, TaskState::kPending).IgnoreError();  // logged if refused
        t.last_progress = mono;
        ++s_.task_generation;
      }
      txn_.Task(t);
    }
  }
  for (const std::string& id : failed) ProtectionTaskFailed(s_.tasks.at(id));
}

void Engine::RetryHeldOffPushes(int64_t now) {
  std::set<std::pair<std::string, uint64_t>> versions;
  for (auto it = s_.held_off_pushes.begin(); it != s_.held_off_pushes.end();) {
    if (now < it->second.until_ms) {
      ++it;
      continue;
    }
    const auto& [source, target] = it->first;
    log::Info("pushes from node {} to {} are tried again ({} version(s) wait)", source,
              target.empty() ? std::string("its EC group") : target, it->second.versions.size());
    if (target.empty()) {
      for (Version* v : ResumeStalledEncodes(source)) versions.insert({v->job_id, v->step});
    }
    versions.insert(it->second.versions.begin(), it->second.versions.end());
    it = s_.held_off_pushes.erase(it);
  }
  for (const auto& [job_id, step] : versions) {
    auto v = FindVersion(job_id, step);
    if (v.ok()) Recompute(**v);
  }
}

void Engine::EndLostCopyGraces(int64_t now) {
  // (AwaitLostCopies aborts them now, unless a later loss extends the wait.)
  std::vector<std::pair<std::string, uint64_t>> due;
  for (const auto& [key, deadline] : s_.awaiting_return) {
    if (now >= deadline) due.push_back(key);
  }
  for (const auto& [job_id, step] : due) {
    s_.awaiting_return.erase({job_id, step});
    auto v = FindVersion(job_id, step);
    if (v.ok()) Recompute(**v);
  }
}

void Engine::AbortStalledOpenVersions(absl::Time mono) {
  if (options_.open_version_timeout <= absl::ZeroDuration()) return;
  std::vector<std::pair<std::string, uint64_t>> stalled;
  for (const auto& [key, since] : s_.open_progress) {
    if (mono - since >= options_.open_version_timeout) stalled.push_back(key);
  }
  for (const auto& [job_id, step] : stalled) {
    auto v = FindVersion(job_id, step);
    if (!v.ok() || (*v)->state != VersionState::kOpen) {
      s_.open_progress.erase({job_id, step});
      continue;
    }
    AbortOpenVersion(**v, absl::StrCat("no progress for ",
                                       absl::FormatDuration(options_.open_version_timeout), " with ",
                                       StagedRanksText(**v), " (did a rank die while saving?)"));
  }
}

void Engine::RemoveDeletedJobs() {
  // Clean-up still running for a version: eviction and durable deletion.
  auto cleaning = [&](const Version& v) {
    for (TaskKind k : {TaskKind::kEvict, TaskKind::kDeleteDurable}) {
      if (!ActiveTasks(v.job_id, v.step, k).empty()) return true;
    }
    return false;
  };
  std::vector<std::string> gone;
  for (auto& [job_id, job] : s_.jobs) {
    if (!job.deleting) continue;
    bool busy = false;
    for (auto& [step, v] : s_.versions[job_id]) busy = busy || cleaning(v);
    if (!busy) gone.push_back(job_id);
  }
  for (const std::string& job_id : gone) {
    for (auto& [step, v] : s_.versions[job_id]) {
      txn_.Delete(records::VersionKey(job_id, step));
      txn_.Delete(records::SegmentsKey(job_id, step));
      for (const auto& [rank, sh] : v.shards) txn_.Delete(records::ShardKey(job_id, step, rank));
    }
    s_.versions.erase(job_id);
    s_.jobs.erase(job_id);
    s_.last_plan_nodes.erase(job_id);
    txn_.DeleteJob(job_id);
    log::Info("job {} removed", job_id);
  }
}

}  // namespace ckpt::meta
