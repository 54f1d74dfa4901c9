// MetaCore, versions: BeginVersion, the reads (GetVersion, ListVersions,
// Latest, Locate, WaitVersion), FlushVersion and DeleteVersion.
#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "server/meta/core_state.h"
#include "server/meta/records.h"

namespace ckpt::meta {

namespace {

// Why `shard` of `v` has no source while meta waits for a node that held it
// to come back (Engine::AwaitLostCopies, within lost_copy_grace): "node a
// holds it and is down ...; it may come back within 24 s ...". Empty when
// meta waits for nothing: the data is lost.
std::string AwaitedHolderText(const std::map<std::pair<std::string, uint64_t>, int64_t>& awaiting_return,
                              const std::map<std::string, Node>& nodes, const Version& v,
                              const Shard& shard, int64_t now) {
  auto awaited = awaiting_return.find({v.job_id, v.step});
  if (awaited == awaiting_return.end() || awaited->second <= now) return "";
  // The holder lost last (the one the wait is for): the shard's own copies
  // first, else (erasure coding) any segment of the version.
  std::string holder;
  int64_t lost_ms = -1;
  auto consider = [&](CopyState state, const std::string& node, int64_t ms) {
    if (state != CopyState::kLost || ms <= lost_ms) return;
    auto n = nodes.find(node);
    if (n == nodes.end()) return;
    if (NodeIsUsable(n->second.state) && n->second.inventory_received) return;  // it said: gone
    holder = node;
    lost_ms = ms;
  };
  for (const Copy& c : shard.copies) consider(c.state, c.node_id, c.updated_ms);
  if (holder.empty()) {
    for (const Segment& seg : v.segments) consider(seg.state, seg.holder_node_id, seg.updated_ms);
  }
  if (holder.empty()) return "";
  const Node& n = nodes.at(holder);
  const int64_t left_s = (awaited->second - now + 999) / 1000;
  const std::string how =
      NodeIsUsable(n.state)
          ? std::string("came back and has not reported its memory tier yet")
          : absl::StrCat("is down (", NodeStateName(n.state), " for ",
                         std::max<int64_t>(0, now - n.state_since_ms) / 1000, " s)");
  return absl::StrCat("node ", holder, " holds it and ", how, "; it may come back within ",
                      left_s, " s (meta's lost_copy_grace), and a restore then reads it; "
                      "after that the version is aborted as data lost");
}

}  // namespace

absl::StatusOr<std::pair<Version, bool>> MetaCore::BeginVersion(const std::string& job_id,
                                                                uint64_t step,
                                                                const std::string& run_id) {
  CKPT_RETURN_IF_ERROR(ValidateStep(step));
  return Write([&](Engine& e) -> absl::StatusOr<std::pair<Version, bool>> {
    Txn& txn = e.txn();
    CKPT_ASSIGN_OR_RETURN(Job * job, e.FindJob(job_id));
    if (job->deleting) {
      return absl::FailedPreconditionError(
          absl::StrCat("job \"", job_id, "\" is being deleted"));
    }
    auto& by_step = state_->versions[job_id];
    auto it = by_step.find(step);
    bool superseded = false;
    if (it != by_step.end()) {
      Version& v = it->second;
      superseded = v.state == VersionState::kOpen && !run_id.empty() && !v.run_id.empty() &&
                   v.run_id != run_id;
      if (!superseded && !IsTerminal(v.state)) {
        return std::make_pair(Summary(v), false);
      }
      // An OPEN step of another run, or an ABORTED or DELETED step, is begun
      // afresh below.
    }
    // Everything that can refuse the version comes before any change.
    if (const Version* newer = e.NewestReadableAbove(job_id, step)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", step, " is lower than job \"", job_id, "\"'s newest version ", newer->step,
          " (", VersionStateName(newer->state),
          "); steps must increase: delete the newer versions to rewind (ckptctl delete ", job_id,
          " ", newer->step, ")"));
    }
    absl::StatusOr<VersionPlan> planned = e.CurrentPlan(*job);
    if (absl::IsFailedPrecondition(planned.status())) {
      // Too few nodes alive for the policy: a node that is restarting or
      // was stopped for a moment comes back. Retryable, so the agent keeps
      // the committed shards and begins again (they would be dropped for good
      // on a refusal).
      return absl::UnavailableError(absl::StrCat("cannot begin ", job_id, "/", step, " now: ",
                                                 planned.status().message(), "; retry when nodes return"));
    }
    CKPT_RETURN_IF_ERROR(planned.status());
    VersionPlan plan = *std::move(planned);
    if (superseded) {
      Version& v = it->second;
      e.CancelVersionTasks(v);
      e.EvictVersion(v);
      CKPT_RETURN_IF_ERROR(e.SetState(v, VersionState::kAborted, absl::StrCat("superseded by run ", run_id)));
    }
    if (it != by_step.end()) {
      // Replace the terminal version's records.
      for (const auto& [rank, sh] : it->second.shards) {
        txn.Delete(records::ShardKey(job_id, step, rank));
      }
      txn.Delete(records::SegmentsKey(job_id, step));
      by_step.erase(it);
    }
    Version v;
    v.job_id = job_id;
    v.step = step;
    v.state = VersionState::kOpen;
    v.world_size = job->spec.world_size;
    v.plan = std::move(plan);
    v.run_id = run_id;
    v.created_ms = e.NowMs();
    // Flush policy.
    const FlushPolicy& fp = job->spec.flush;
    bool flush = false;
    if (fp.every_n_versions > 0 &&
        (!job->any_flushed || job->versions_since_flush + 1 >= fp.every_n_versions)) {
      flush = true;
    }
    if (fp.every_seconds > 0 &&
        (!job->any_flushed ||
         v.created_ms - job->last_flush_begin_ms >= int64_t{fp.every_seconds} * 1000)) {
      flush = true;
    }
    if (flush) {
      v.flush_planned = true;
      v.durable_dir = absl::StrCat(job_id, "/", step);
      job->any_flushed = true;
      job->versions_since_flush = 0;
      job->last_flush_begin_ms = v.created_ms;
    } else {
      ++job->versions_since_flush;
    }
    txn.Job(*job);
    Version& stored = by_step[step] = std::move(v);
    txn.Header(stored);
    state_->open_progress[{job_id, step}] = e.Mono();
    ++state_->counters.versions_begun_total;
    Version result = stored;
    return std::make_pair(std::move(result), true);
  });
}

absl::StatusOr<Version> MetaCore::GetVersion(const std::string& job_id, uint64_t step,
                                             bool include_items) const {
  return Read([&](Engine& e) -> absl::StatusOr<Version> {
    CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(job_id, step));
    Version copy = *v;
    if (!include_items) {
      for (auto& [rank, sh] : copy.shards) sh.items.clear();
    }
    return copy;
  });
}

absl::StatusOr<std::vector<Version>> MetaCore::ListVersions(
    const std::string& job_id, const std::vector<VersionState>& states, bool newest_first,
    std::optional<uint64_t> after, uint32_t limit) const {
  return Read([&](Engine& e) -> absl::StatusOr<std::vector<Version>> {
    CKPT_RETURN_IF_ERROR(e.FindJob(job_id).status());
    std::vector<Version> out;
    auto add = [&](const Version& v) {
      const bool match = states.empty() ? v.state != VersionState::kDeleted
                                        : std::find(states.begin(), states.end(), v.state) !=
                                              states.end();
      if (!match) return;
      out.push_back(Summary(v));
    };
    const auto& by_step = state_->versions[job_id];
    if (newest_first) {
      for (auto it = by_step.rbegin(); it != by_step.rend(); ++it) {
        if (after.has_value() && it->first >= *after) continue;
        if (limit != 0 && out.size() >= limit) break;
        add(it->second);
      }
    } else {
      for (auto it = after.has_value() ? by_step.upper_bound(*after) : by_step.begin();
           it != by_step.end(); ++it) {
        if (limit != 0 && out.size() >= limit) break;
        add(it->second);
      }
    }
    return out;
  });
}

absl::StatusOr<Version> MetaCore::Latest(const std::string& job_id, Level min_level) const {
  return Read([&](Engine& e) -> absl::StatusOr<Version> {
    CKPT_RETURN_IF_ERROR(e.FindJob(job_id).status());
    const auto& by_step = state_->versions[job_id];
    for (auto it = by_step.rbegin(); it != by_step.rend(); ++it) {
      // (An incremental version whose referred versions are gone does not
      // load whole: not a restore target.)
      if (SatisfiesLevel(it->second.state, min_level) && e.RefsAvailable(it->second)) {
        Version copy = it->second;
        for (auto& [rank, sh] : copy.shards) sh.items.clear();
        return copy;
      }
    }
    return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" has no version at level ",
                                            LevelName(min_level), " or better"));
  });
}

absl::StatusOr<LocateResult> MetaCore::Locate(const std::string& job_id, uint64_t step,
                                              uint32_t rank,
                                              const std::string& near_node_id) const {
  return Read([&](Engine& e) -> absl::StatusOr<LocateResult> {
    CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(job_id, step));
    if (rank >= v->world_size) {
      return absl::NotFoundError(absl::StrCat("rank ", rank, " is out of range: version ",
                                              job_id, "/", step, " has world size ",
                                              v->world_size));
    }
    // An aborted version's shards that newer versions refer to (incremental
    // saves) are still served, to those loads.
    const bool referred = v->state == VersionState::kAborted && !v->evicted && !e.Dependents(job_id, step).empty();
    if (!SatisfiesLevel(v->state, Level::kStaged) && !referred) {
      return absl::FailedPreconditionError(
          absl::StrCat("version ", job_id, "/", step, " is ", VersionStateName(v->state),
                       v->abort_reason.empty() ? "" : absl::StrCat(" (", v->abort_reason, ")"),
                       "; it cannot be restored"));
    }
    auto it = v->shards.find(rank);
    if (it == v->shards.end()) {
      return absl::NotFoundError(absl::StrCat("rank ", rank, " of ", job_id, "/", step,
                                              " is not staged"));
    }
    LocateResult result;
    result.shard = it->second;
    result.shard.copies.clear();
    result.sources = e.Sources(*v, it->second, near_node_id);
    if (result.sources.empty()) {
      // Meta still waits (lost_copy_grace) for the node that held the copy
      // to come back with its memory tier: the data is not lost yet, and a
      // later try may read it.
      if (std::string awaited = AwaitedHolderText(state_->awaiting_return, state_->nodes, *v, it->second,
                                                         clock_->NowUnixMillis());
          !awaited.empty()) {
        return absl::UnavailableError(absl::StrCat("rank ", rank, " of ", job_id, "/", step,
                                                   " has no readable copy now: ", awaited));
      }
      return absl::DataLossError(absl::StrCat("rank ", rank, " of ", job_id, "/", step,
                                              " has no readable source left"));
    }
    return result;
  });
}

absl::StatusOr<Version> MetaCore::WaitVersion(const std::string& job_id, uint64_t step,
                                              Level level, absl::Duration timeout) {
  return Read([&](Engine& e) -> absl::StatusOr<Version> {
    CKPT_RETURN_IF_ERROR(e.FindVersion(job_id, step).status());
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      auto j = state_->versions.find(job_id);
      if (j == state_->versions.end()) return true;
      auto v = j->second.find(step);
      if (v == j->second.end()) return true;
      return SatisfiesLevel(v->second.state, level) || IsTerminal(v->second.state);
    };
    clock_->AwaitWithTimeout(&mu_, absl::Condition(&done), timeout);
    // The answer reflects the state now; it is returned once that is durable.
    auto v = e.FindVersion(job_id, step);
    if (!v.ok()) return v.status();
    const Version& ver = **v;
    if (SatisfiesLevel(ver.state, level)) {
      Version copy = ver;
      for (auto& [rank, sh] : copy.shards) sh.items.clear();
      return copy;
    }
    if (ver.state == VersionState::kDeleted) {
      return absl::NotFoundError(absl::StrCat("version ", job_id, "/", step, " was deleted",
                                              ver.abort_reason.empty() ? "" : absl::StrCat(
                                                  " (", ver.abort_reason, ")")));
    }
    if (ver.state == VersionState::kAborted) {
      const bool lost = ver.abort_reason.find("lost") != std::string::npos;
      const std::string msg = absl::StrCat("version ", job_id, "/", step,
                                           " was aborted: ", ver.abort_reason);
      return lost ? absl::DataLossError(msg) : absl::FailedPreconditionError(msg);
    }
    return absl::DeadlineExceededError(absl::StrCat(
        "version ", job_id, "/", step, " did not reach ", LevelName(level), " within ",
        absl::FormatDuration(timeout), "; it is ", VersionStateName(ver.state), " with ",
        StagedRanksText(ver)));
  });
}

absl::StatusOr<Version> MetaCore::FlushVersion(const std::string& job_id, uint64_t step) {
  return Write([&](Engine& e) -> absl::StatusOr<Version> {
    CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(job_id, step));
    if (IsTerminal(v->state)) {
      return absl::FailedPreconditionError(absl::StrCat("version ", job_id, "/", step, " is ",
                                                        VersionStateName(v->state)));
    }
    if (v->evicted && v->state != VersionState::kPersisted) {
      return absl::FailedPreconditionError(absl::StrCat("version ", job_id, "/", step,
                                                        " was evicted from memory"));
    }
    e.StartFlush(*v);
    Version result = *v;
    for (auto& [rank, sh] : result.shards) sh.items.clear();
    return result;
  });
}

absl::StatusOr<Version> MetaCore::DeleteVersion(const std::string& job_id, uint64_t step,
                                                bool force) {
  return Write([&](Engine& e) -> absl::StatusOr<Version> {
    CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(job_id, step));
    if (v->state != VersionState::kDeleted) {
      if (!force && SatisfiesLevel(v->state, Level::kProtected)) {
        const auto& by_step = state_->versions[job_id];
        for (auto it = by_step.rbegin(); it != by_step.rend(); ++it) {
          if (!SatisfiesLevel(it->second.state, Level::kProtected)) continue;
          if (it->first == step) {
            return absl::FailedPreconditionError(absl::StrCat(
                "version ", job_id, "/", step,
                " is the job's newest protected version; deleting it leaves nothing to "
                "restore from (use force to delete it anyway)"));
          }
          break;
        }
      }
      if (const std::vector<uint64_t> dependents = e.Dependents(job_id, step); !dependents.empty() && !force) {
        return absl::FailedPreconditionError(absl::StrCat(
            "version ", job_id, "/", step, " holds items that version(s) ", absl::StrJoin(dependents, ", "),
            " refer to (incremental saves); deleted, they would no longer load (use force to delete it anyway)"));
      }
      e.CancelVersionTasks(*v);
      e.EvictVersion(*v);
      bool durable = false;
      for (const auto& [rank, sh] : v->shards) durable = durable || sh.durable_written;
      if (durable || v->state == VersionState::kPersisted) {
        e.DeleteDurable(*v);
      }
      CKPT_RETURN_IF_ERROR(e.SetState(*v, VersionState::kDeleted, "deleted by operator"));
    }
    Version result = *v;
    for (auto& [rank, sh] : result.shards) sh.items.clear();
    return result;
  });
}

}  // namespace ckpt::meta
