// Engine, versions: finding them, their state (SetState, over the table of
// transitions.h), re-deriving it from the holdings (Recompute), ending OPEN
// versions, the references between incremental versions, and the flush.
#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "server/meta/core_state.h"
#include "server/meta/transitions.h"

namespace ckpt::meta {

absl::StatusOr<Job*> Engine::FindJob(const std::string& job_id) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job_id));
  auto it = s_.jobs.find(job_id);
  if (it == s_.jobs.end()) {
    return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" does not exist"));
  }
  return &it->second;
}

absl::StatusOr<Version*> Engine::FindVersion(const std::string& job_id, uint64_t step) {
  CKPT_RETURN_IF_ERROR(ValidateStep(step));
  CKPT_RETURN_IF_ERROR(FindJob(job_id).status());
  auto& by_step = s_.versions[job_id];
  auto it = by_step.find(step);
  if (it == by_step.end()) {
    std::string why;
    if (const Version* newer = NewestReadableAbove(job_id, step)) {
      // The usual reason a trainer waits for a step that never appears: its
      // agent's BeginVersion was refused.
      why = absl::StrCat("; a save of step ", step,
                         " is refused because the job's newest version is step ", newer->step,
                         " (", VersionStateName(newer->state),
                         ") and steps must increase (delete the newer versions to rewind)");
    }
    return absl::NotFoundError(
        absl::StrCat("job \"", job_id, "\" has no version at step ", step, why));
  }
  return &it->second;
}

const Version* Engine::NewestReadableAbove(const std::string& job_id, uint64_t step) const {
  auto j = s_.versions.find(job_id);
  if (j == s_.versions.end()) return nullptr;
  for (auto r = j->second.rbegin(); r != j->second.rend() && r->first > step; ++r) {
    const Version& v = r->second;
    if (!IsTerminal(v.state) && v.state != VersionState::kOpen) return &v;
  }
  return nullptr;
}

absl::Status Engine::SetState(Version& v, VersionState to, const std::string& reason) {
  if (v.state == to) return absl::OkStatus();
  const VersionState from = v.state;
  if (absl::Status st = Transition(&v.state, to); !st.ok()) {
    log::Error("version {}/{}: {}", v.job_id, v.step, std::string(st.message()));
    return st;
  }
  if (from == VersionState::kOpen) s_.open_progress.erase({v.job_id, v.step});
  const int64_t now = NowMs();
  switch (to) {
    case VersionState::kStaged:
      if (v.staged_ms == 0) v.staged_ms = now;
      break;
    case VersionState::kProtected:
      if (v.protected_ms == 0) v.protected_ms = now;
      break;
    case VersionState::kPersisted:
      if (v.persisted_ms == 0) v.persisted_ms = now;
      break;
    case VersionState::kAborted:
    case VersionState::kDeleted:
      v.ended_ms = now;
      v.abort_reason = reason;
      break;
    default:
      break;
  }
  txn_.Header(v);
  log::Info("version {}/{}: {} -> {}{}{}", v.job_id, v.step, VersionStateName(from),
            VersionStateName(to), reason.empty() ? "" : ": ", reason);
  const bool was_staged = SatisfiesLevel(from, Level::kStaged) && !v.evicted;
  const bool is_staged = SatisfiesLevel(to, Level::kStaged) && !v.evicted;
  if (was_staged != is_staged) NoticeStaged(v, is_staged);
  if (to == VersionState::kPersisted) {
    // Incremental versions waiting for this one's files commit now.
    for (uint64_t step : Dependents(v.job_id, v.step)) {
      Version& d = s_.versions[v.job_id][step];
      if (d.flush_planned) PlanFlush(d);
    }
    return absl::OkStatus();
  }
  // (Versions that refer to its items stay: their own bytes may be referred
  // to in turn. They no longer load whole, and Latest skips them: RefsAvailable.)
  return absl::OkStatus();
}

std::string StagedRanksText(const Version& v) {
  std::string text = absl::StrCat(v.shards.size(), " of ", v.world_size, " shards staged");
  if (v.shards.size() >= v.world_size) return text;
  constexpr int kNamed = 8;
  std::vector<std::string> missing;
  uint32_t more = 0;
  for (uint32_t r = 0; r < v.world_size; ++r) {
    if (v.shards.count(r)) continue;
    if (missing.size() < kNamed) {
      missing.push_back(absl::StrCat(r));
    } else {
      ++more;
    }
  }
  absl::StrAppend(&text, " (rank", missing.size() + more > 1 ? "s " : " ",
                  absl::StrJoin(missing, ", "),
                  more > 0 ? absl::StrCat(" and ", more, " more") : "", " missing)");
  return text;
}

void Engine::EvictUnlessReferred(Version& v) {
  // Shards a newer version refers to (an incremental save whose base was this
  // version, on ranks that did save it) stay until nothing refers to them
  // (ApplyRetention); the version itself is never offered, but Locate serves
  // them to those loads.
  if (Dependents(v.job_id, v.step).empty()) EvictVersion(v);
}

void Engine::AbortOpenVersion(Version& v, const std::string& reason) {
  CancelVersionTasks(v);
  EvictUnlessReferred(v);
  SetState(v, VersionState::kAborted, reason).IgnoreError();  // a refusal is logged by SetState
}

void Engine::AbortOpenVersionsBelow(const Version& staged) {
  if (IsTerminal(staged.state) || staged.state == VersionState::kOpen) return;
  auto j = s_.versions.find(staged.job_id);
  if (j == s_.versions.end()) return;
  for (auto it = j->second.begin(); it != j->second.end() && it->first < staged.step; ++it) {
    Version& old = it->second;
    if (old.state != VersionState::kOpen) continue;
    AbortOpenVersion(old, absl::StrCat("superseded: step ", staged.step,
                                       " was staged first, while this version had ",
                                       StagedRanksText(old)));
  }
}

bool Engine::ShardReadable(const Version& v, const Shard& shard) const {
  return !Sources(v, shard, "").empty();
}

void Engine::Recompute(Version& v) {
  if (IsTerminal(v.state) || v.state == VersionState::kOpen) {
    if (v.state == VersionState::kOpen) {
      // A staged shard that lost every copy before the version completed.
      bool awaiting = false;
      for (const auto& [rank, sh] : v.shards) {
        bool any = false;
        for (const Copy& c : sh.copies) any = any || (Usable(c.state) && IsUsable(c.node_id));
        if (!any) {
          if (AwaitLostCopies(v, rank)) {
            awaiting = true;  // the other ranks are protected meanwhile
            break;
          }
          CancelVersionTasks(v);
          EvictUnlessReferred(v);  // the ranks that survive can never be restored
          SetState(v, VersionState::kAborted,
                   absl::StrCat("rank ", rank, " was lost on node ", sh.primary_node_id,
                                " before every rank was staged"))
              .IgnoreError();  // a refusal is logged by SetState
          return;
        }
      }
      if (!awaiting) s_.awaiting_return.erase({v.job_id, v.step});
      PlanRecovery(v);
    }
    return;
  }
  if (v.state == VersionState::kPersisted) {
    PlanFlush(v);
    ReleaseSurplusReplicas(v);
    return;
  }
  // Readability.
  for (const auto& [rank, sh] : v.shards) {
    if (!ShardReadable(v, sh)) {
      if (AwaitLostCopies(v, rank)) {
        // The state stays while the rank's node may come back with it, but
        // the other ranks are not left unprotected meanwhile: a rack lost
        // at once takes several nodes, and the ranks with a survivor are
        // copied again.
        PlanRecovery(v);
        return;
      }
      CancelVersionTasks(v);
      EvictUnlessReferred(v);  // the other ranks' copies can never be restored
      SetState(v, VersionState::kAborted,
               absl::StrCat("data lost: rank ", rank, " has no readable copy left"))
          .IgnoreError();  // a refusal is logged by SetState
      ++s_.counters.reports_rejected_total;  // visible in metrics as a failure
      return;
    }
  }
  s_.awaiting_return.erase({v.job_id, v.step});
  // Protection completeness.
  bool complete = true;
  bool lost_something = false;
  const ProtectionPolicy& policy = v.plan.policy;
  for (const auto& [rank, sh] : v.shards) {
    int protective = 0;
    for (const Copy& c : sh.copies) {
      if (c.state == CopyState::kLost || c.state == CopyState::kCorrupt) lost_something = true;
      if (Usable(c.state) && c.role != CopyRole::kRestored && CountsForProtection(c.node_id)) {
        ++protective;
      }
    }
    if (policy.kind == ProtectionPolicy::Kind::kReplicate) {
      if (protective < policy.copies) complete = false;
    } else if (policy.kind == ProtectionPolicy::Kind::kErasureCode) {
      // A shard in no stripe (TakeInShardsOutsideTheGroups) needs whole copies.
      if (!InStripes(v, sh) && protective < ReplicasOutsideStripes(v)) complete = false;
    } else if (policy.kind == ProtectionPolicy::Kind::kNone) {
      if (protective < 1) complete = false;
    }
  }
  if (policy.kind == ProtectionPolicy::Kind::kErasureCode) {
    if (v.segments.empty()) complete = false;
    std::set<std::pair<int, int>> stripes;
    for (const Segment& seg : v.segments) {
      if (seg.state == CopyState::kLost || seg.state == CopyState::kCorrupt) lost_something = true;
      if (!Usable(seg.state) || !CountsForProtection(seg.holder_node_id)) complete = false;
      stripes.insert({seg.key.group, seg.key.stripe});
    }
    // Every segment in place is not enough: a stripe whose rebuilt segments
    // share a node would not survive m losses.
    for (const EcGroup& g : v.plan.groups) {
      for (const auto& [group, stripe] : stripes) {
        if (complete && group == g.index && !StripeTolerates(v, g, stripe)) complete = false;
      }
    }
  }
  if (complete) {
    if (v.state != VersionState::kProtected) {
      SetState(v, VersionState::kProtected).IgnoreError();  // a refusal is logged by SetState
      if (auto job = s_.jobs.find(v.job_id); job != s_.jobs.end()) ApplyRetention(job->second);
    }
  } else if (v.state == VersionState::kProtected ||
             (v.state == VersionState::kStaged && lost_something)) {
    SetState(v, VersionState::kDegraded, "redundancy lost; re-protecting").IgnoreError();  // logged if refused
  }
  if (!complete) PlanRecovery(v);
  if (complete) ReleaseSurplusReplicas(v);
  PlanFlush(v);
}

bool Engine::AwaitLostCopies(const Version& v, uint32_t rank) {
  const std::pair<std::string, uint64_t> key{v.job_id, v.step};
  if (options_.lost_copy_grace <= absl::ZeroDuration()) return false;
  const int64_t grace_ms = absl::ToInt64Milliseconds(options_.lost_copy_grace);
  int64_t deadline = 0;
  std::string node_id;
  auto consider = [&](CopyState state, const std::string& holder, int64_t lost_ms) {
    if (state != CopyState::kLost) return;
    auto n = s_.nodes.find(holder);
    if (n == s_.nodes.end()) return;
    // Its inventory, once received, said whether the copy is still there.
    if (n->second.state != NodeState::kDead && n->second.inventory_received) return;
    if (lost_ms + grace_ms > deadline) {
      deadline = lost_ms + grace_ms;
      node_id = holder;
    }
  };
  for (const auto& [r, sh] : v.shards)
    for (const Copy& c : sh.copies) consider(c.state, c.node_id, c.updated_ms);
  for (const Segment& seg : v.segments) consider(seg.state, seg.holder_node_id, seg.updated_ms);
  if (deadline <= NowMs()) {
    s_.awaiting_return.erase(key);
    return false;
  }
  auto [it, first] = s_.awaiting_return.insert({key, deadline});
  if (first) {
    log::Warn("version {}/{}: rank {} has no readable copy left; waiting {} ms for node {} "
              "(it held the copies) to come back with its memory tier before declaring the "
              "data lost",
              v.job_id, v.step, rank, deadline - NowMs(), node_id);
  }
  it->second = deadline;
  return true;
}

void Engine::PlanFlush(Version& v) {
  if (!v.flush_planned || IsTerminal(v.state) || v.state == VersionState::kPersisted) return;
  std::set<uint32_t> covered;
  for (Task* t : ActiveTasks(v.job_id, v.step, TaskKind::kFlush)) {
    if (!IsUsable(t->node_id)) {
      CancelTask(*t);
      continue;
    }
    covered.insert(t->ranks.begin(), t->ranks.end());
  }
  std::map<std::string, std::vector<uint32_t>> by_node;
  bool all_written = v.shards.size() == v.world_size;
  for (const auto& [rank, sh] : v.shards) {
    if (sh.durable_written) continue;
    all_written = false;
    if (covered.count(rank)) continue;
    std::string node;
    for (const Copy& c : sh.copies) {
      if (!Usable(c.state) || !IsUsable(c.node_id)) continue;
      if (node.empty() || c.node_id == sh.primary_node_id) node = c.node_id;
    }
    if (node.empty()) {
      // No full copy: any usable node reads through the EC sources.
      if (Sources(v, sh, "").empty()) continue;
      node = AnyUsableNode();
    }
    if (!node.empty()) by_node[node].push_back(rank);
  }
  for (auto& [node, ranks] : by_node) {
    Task& t = NewTask(node, TaskKind::kFlush, v.job_id, v.step, kPriorityFlush);
    t.ranks = ranks;
    txn_.Task(t);
  }
  // The commit goes out again if its task was cancelled (its node died
  // before running it): issued once only, the version stayed unflushed and,
  // planned for flush, was never evicted from memory either.
  bool committing = false;
  for (Task* t : ActiveTasks(v.job_id, v.step, TaskKind::kCommitDurable)) {
    if (!IsUsable(t->node_id)) {
      CancelTask(*t);
      continue;
    }
    committing = true;
  }
  // An incremental version commits after the versions it refers to (its
  // manifest names their files); their PERSISTED state plans it again.
  if (all_written && !committing && RefsPersisted(v)) {
    std::string node;
    auto r0 = v.shards.find(0);
    if (r0 != v.shards.end() && IsUsable(r0->second.primary_node_id)) {
      node = r0->second.primary_node_id;
    }
    if (node.empty()) node = AnyUsableNode();
    if (!node.empty()) {
      Task& t = NewTask(node, TaskKind::kCommitDurable, v.job_id, v.step, kPriorityFlush);
      txn_.Task(t);
      v.commit_issued = true;
      txn_.Header(v);
    }
  }
}

void Engine::StartFlush(Version& v) {
  if (v.flush_planned || IsTerminal(v.state) || v.state == VersionState::kPersisted || v.evicted) return;
  v.flush_planned = true;
  v.durable_dir = absl::StrCat(v.job_id, "/", v.step);
  for (auto& [rank, sh] : v.shards) {
    sh.durable_path = absl::StrCat(v.durable_dir, "/", RankFileName(rank));
    txn_.ShardRecord(v, rank);
  }
  txn_.Header(v);
  PlanFlush(v);
}

bool Engine::RefsPersisted(Version& v) {
  auto by_step = s_.versions.find(v.job_id);
  if (by_step == s_.versions.end()) return true;
  bool ready = true;
  for (const auto& [rank, sh] : v.shards) {
    for (uint64_t base : sh.ref_steps) {
      auto b = by_step->second.find(base);
      // Gone (ended, or evicted before it was flushed): never will be. The
      // version commits anyway; its own bytes are whole, and what the
      // versions referring to it need of it is its own items.
      if (b == by_step->second.end() || IsTerminal(b->second.state) ||
          (b->second.evicted && b->second.state != VersionState::kPersisted)) {
        continue;
      }
      if (b->second.state != VersionState::kPersisted) {
        StartFlush(b->second);
        ready = false;
      }
    }
  }
  return ready;
}

bool Engine::RefsAvailable(const Version& v) const {
  auto by_step = s_.versions.find(v.job_id);
  for (const auto& [rank, sh] : v.shards) {
    for (uint64_t base : sh.ref_steps) {
      if (by_step == s_.versions.end()) return false;
      auto b = by_step->second.find(base);
      // (An aborted version whose shards are kept for the versions referring
      // to it still serves them.)
      if (b == by_step->second.end() || (b->second.evicted && b->second.state != VersionState::kPersisted)) {
        return false;
      }
    }
  }
  return true;
}

std::vector<uint64_t> Engine::Dependents(const std::string& job_id, uint64_t step) const {
  std::vector<uint64_t> out;
  auto by_step = s_.versions.find(job_id);
  if (by_step == s_.versions.end()) return out;
  for (auto it = by_step->second.upper_bound(step); it != by_step->second.end(); ++it) {
    const Version& v = it->second;
    // (An evicted PERSISTED version still refers to the files of its bases.)
    if (IsTerminal(v.state) || (v.evicted && v.state != VersionState::kPersisted)) continue;
    for (const auto& [rank, sh] : v.shards) {
      if (std::binary_search(sh.ref_steps.begin(), sh.ref_steps.end(), step)) {
        out.push_back(v.step);
        break;
      }
    }
  }
  return out;
}

}  // namespace ckpt::meta
