// MetaCore, cluster status: node and version counts, memory, problems, and
// the failure history (MTBF).
#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/meta/core_state.h"

namespace ckpt::meta {

void MetaCore::FailureStatsLocked(const std::string& job_id, ClusterStatusView* out) const {
  const int64_t now = clock_->NowUnixMillis();
  uint32_t alive = 0;
  for (const auto& [id, n] : state_->nodes) {
    const int64_t since = n.first_seen_ms != 0 ? n.first_seen_ms : n.registered_ms;
    const int64_t until = n.state == NodeState::kLeft ? n.state_since_ms : now;
    out->observed_node_ms += std::max<int64_t>(0, until - since);
    out->failures += n.failures;
    if (NodeIsUsable(n.state)) ++alive;
  }
  out->mtbf_is_lower_bound = out->failures == 0;
  out->node_mtbf_ms = out->observed_node_ms / static_cast<int64_t>(std::max<uint64_t>(out->failures, 1));
  if (job_id.empty()) return;
  std::set<std::string> nodes;  // holding the newest version's shards
  if (auto it = state_->versions.find(job_id); it != state_->versions.end()) {
    for (auto v = it->second.rbegin(); v != it->second.rend() && nodes.empty(); ++v) {
      for (const auto& [rank, shard] : v->second.shards) nodes.insert(shard.primary_node_id);
    }
  }
  out->job_nodes = nodes.empty() ? alive : static_cast<uint32_t>(nodes.size());
  out->job_mtbf_ms = out->node_mtbf_ms / std::max<uint32_t>(out->job_nodes, 1);
}

absl::StatusOr<ClusterStatusView> MetaCore::ClusterStatus(bool include_nodes, uint32_t max_problems,
                                                         const std::string& job_id) const {
  return Read([&](Engine& e) -> absl::StatusOr<ClusterStatusView> {
    return ClusterStatusLocked(include_nodes, max_problems, job_id);
  });
}

ClusterStatusView MetaCore::ClusterStatusLocked(bool include_nodes, uint32_t max_problems,
                                                const std::string& job_id) const {
  ClusterStatusView out;
  out.meta_instance_id = instance_id_;
  out.meta_start_ms = start_ms_;
  out.meta_version = options_.version;
  FailureStatsLocked(job_id, &out);
  std::vector<Problem> problems;
  std::map<std::string, uint32_t> pending;
  for (const auto& [id, t] : state_->tasks) {
    if (Engine::Active(t)) ++pending[t.node_id];
  }
  for (const auto& [id, n] : state_->nodes) {
    ++out.nodes_by_state[n.state];
    if (include_nodes) {
      out.nodes.push_back(n);
      out.nodes.back().pending_tasks = pending[id];
    }
    if (NodeIsUsable(n.state)) {
      out.memory_capacity_bytes += n.memory_capacity_bytes;
      out.memory_used_bytes += n.memory_used_bytes;
      out.memory_free_bytes += n.memory_free_bytes;
      out.flush_lag_bytes += n.flush_lag_bytes;
      out.flush_lag_ms = std::max(out.flush_lag_ms, n.flush_lag_ms);
      if (n.memory_capacity_bytes > 0 && n.memory_free_bytes * 10 < n.memory_capacity_bytes) {
        problems.push_back({Problem::Kind::kMemoryLow, false,
                            absl::StrCat("node ", id, " memory tier is ",
                                         100 - n.memory_free_bytes * 100 /
                                                   n.memory_capacity_bytes,
                                         "% full"),
                            id, "", std::nullopt, n.last_heartbeat_ms});
      }
      if (n.flush_errors_total > 0) {
        problems.push_back({Problem::Kind::kFlushFailing, false,
                            absl::StrCat("node ", id, " had ", n.flush_errors_total,
                                         " durable-tier write errors"),
                            id, "", std::nullopt, n.last_heartbeat_ms});
      }
    }
    if (n.state == NodeState::kDead) {
      problems.push_back({Problem::Kind::kNodeDead, true,
                          absl::StrCat("node ", id, " is dead (lease expired)"), id, "",
                          std::nullopt, n.state_since_ms});
    } else if (n.state == NodeState::kSuspect) {
      problems.push_back({Problem::Kind::kNodeSuspect, false,
                          absl::StrCat("node ", id, " is missing heartbeats"), id, "",
                          std::nullopt, n.last_heartbeat_ms});
    }
  }
  for (const auto& [node, list] : state_->unknown) {
    for (const auto& u : list) {
      problems.push_back({Problem::Kind::kUnknownData, false,
                          absl::StrCat("node ", node, " holds data of unknown ", u.holding.job_id,
                                       "/", u.holding.step),
                          node, u.holding.job_id, u.holding.step, u.since_ms});
    }
  }
  out.jobs = static_cast<uint32_t>(state_->jobs.size());
  Txn unused;
  Engine e(*state_, clock_, options_, unused);
  for (const auto& [job_id, job] : state_->jobs) {
    if (job.spec.protection.kind != ProtectionPolicy::Kind::kNone &&
        !PlanPlacement(e.AliveNodes(), job.spec.protection).ok()) {
      problems.push_back({Problem::Kind::kPlacementImpossible, true,
                          absl::StrCat("job ", job_id, ": not enough alive nodes for ",
                                       job.spec.protection.ToString()),
                          "", job_id, std::nullopt, clock_->NowUnixMillis()});
    }
  }
  for (const auto& [job_id, by_step] : state_->versions) {
    for (const auto& [step, v] : by_step) {
      if (v.state != VersionState::kDeleted) ++out.versions_by_state[v.state];
      if (v.state == VersionState::kDegraded) {
        problems.push_back({Problem::Kind::kVersionDegraded, false,
                            absl::StrCat("version ", job_id, "/", step,
                                         " lost redundancy and is being re-protected"),
                            "", job_id, step, v.protected_ms});
      } else if (v.state == VersionState::kAborted &&
                 v.abort_reason.find("lost") != std::string::npos) {
        problems.push_back({Problem::Kind::kVersionLost, true,
                            absl::StrCat("version ", job_id, "/", step, ": ", v.abort_reason), "",
                            job_id, step, v.ended_ms});
      }
      if (IsTerminal(v.state)) continue;
      for (const auto& [rank, sh] : v.shards) {
        for (const Copy& c : sh.copies) {
          if (c.state == CopyState::kCorrupt) {
            problems.push_back({Problem::Kind::kCorruptCopy, true,
                                absl::StrCat("copy of ", job_id, "/", step, " rank ", rank,
                                             " on node ", c.node_id, " is corrupt: ", c.detail),
                                c.node_id, job_id, step, c.updated_ms});
          }
        }
      }
    }
  }
  // Versions waiting for a held-off push (ProtectionTaskFailed) to be tried
  // again: why they are not PROTECTED yet.
  for (const auto& [key, held] : state_->held_off_pushes) {
    const int64_t now = clock_->NowUnixMillis();
    if (now >= held.until_ms) continue;
    for (const auto& [job_id, step] : held.versions) {
      auto v = e.FindVersion(job_id, step);
      if (!v.ok() || IsTerminal((*v)->state) || (*v)->state == VersionState::kProtected ||
          (*v)->state == VersionState::kPersisted) {
        continue;
      }
      problems.push_back(
          {Problem::Kind::kTaskFailing, false,
           absl::StrCat("version ", job_id, "/", step, " is ", VersionStateName((*v)->state),
                        ", not protected: pushes from node ", key.first, " to ",
                        key.second.empty() ? std::string("its EC group") : key.second,
                        " failed for good (", held.error, "); ",
                        key.second.empty() ? "encoding" : "another node takes the copy if one can, else "
                                                          "that node",
                        " is tried again in ", (held.until_ms - now + 999) / 1000, " s"),
           key.first, job_id, step, now});
    }
  }
  for (const auto& [id, t] : state_->tasks) {
    switch (t.state) {
      case TaskState::kPending: ++out.tasks_pending; break;
      case TaskState::kRunning: ++out.tasks_running; break;
      case TaskState::kRetryWait: ++out.tasks_retrying; break;
      default: break;
    }
    if ((t.state == TaskState::kFailed && t.created_ms > 0) ||
        (e.Active(t) && t.attempt >= 3)) {
      if (t.state == TaskState::kFailed && t.kind == TaskKind::kDrop) continue;
      problems.push_back({Problem::Kind::kTaskFailing, t.state == TaskState::kFailed,
                          absl::StrCat("task ", id, " (", TaskKindName(t.kind), " ", t.job_id,
                                       "/", t.step, ") on node ", t.node_id, " ",
                                       TaskStateName(t.state), " after ", t.attempt,
                                       " attempts: ", t.last_error),
                          t.node_id, t.job_id, t.step, t.created_ms});
    }
  }
  std::stable_sort(problems.begin(), problems.end(), [](const Problem& a, const Problem& b) {
    if (a.error != b.error) return a.error;
    return a.since_ms < b.since_ms;
  });
  out.problems_total = static_cast<uint32_t>(problems.size());
  const uint32_t limit = max_problems == 0 ? 100 : max_problems;
  if (problems.size() > limit) problems.resize(limit);
  out.problems = std::move(problems);
  return out;
}

}  // namespace ckpt::meta
