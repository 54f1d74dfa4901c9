// MetaCore, shard reports (ReportShards): a rank staged, a copy or segment
// changed state, a durable file written; each checked, then applied.
#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/manifest.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "server/meta/core_state.h"

namespace ckpt::meta {

namespace {

// The manifest rules of common/manifest.h (ValidateItems), as the agent
// applied them when the rank committed.
absl::Status ValidateManifest(const Shard& shard, uint64_t step) {
  std::vector<ItemView> views;
  views.reserve(shard.items.size());
  for (const Item& it : shard.items) {
    std::optional<uint64_t> ref;
    if (it.ref_step >= 0) ref = static_cast<uint64_t>(it.ref_step);
    views.push_back(ItemView{it.name, it.dtype, it.shape, it.offset_bytes, it.length_bytes, ref});
  }
  return ValidateItems(views, shard.size_bytes, step);
}

// Every version `shard` refers to must still hold this rank's bytes in
// memory: not ended (aborted, deleted), not evicted, the rank staged.
absl::Status CheckRefs(Engine& e, const Version& v, const Shard& shard) {
  for (uint64_t base : shard.ref_steps) {
    absl::StatusOr<Version*> b = e.FindVersion(v.job_id, base);
    const char* why = nullptr;
    if (!b.ok()) {
      why = "is unknown";
    } else if ((*b)->evicted) {
      why = "is no longer in memory";
    } else if ((*b)->shards.count(shard.rank) == 0) {
      why = "has no shard of this rank";
    }
    if (why != nullptr) {
      return MissingBaseError(shard.rank, v.job_id, v.step, base, why);
    }
  }
  return absl::OkStatus();
}

// Takes the shard out of `r` (it is not used after).
absl::StatusOr<Shard*> StagedShard(Version* v, uint32_t rank) {
  auto it = v->shards.find(rank);
  if (it == v->shards.end()) {
    return absl::NotFoundError(
        absl::StrCat("rank ", rank, " of ", v->job_id, "/", v->step, " is not staged"));
  }
  return &it->second;
}

absl::Status ApplyStaged(Engine& e, const std::string& node_id, StagedReport& r) {
  CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(r.job_id, r.step));
  const Shard& in = r.shard;
  if (in.rank >= v->world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", in.rank, " is out of range: job \"",
                                                   r.job_id, "\" has world size ", v->world_size));
  }
  if (!in.primary_node_id.empty() && in.primary_node_id != node_id) {
    return absl::InvalidArgumentError(absl::StrCat("primary node \"", in.primary_node_id,
                                                   "\" is not the reporting node \"", node_id,
                                                   "\""));
  }
  CKPT_RETURN_IF_ERROR(ValidateManifest(in, r.step));
  auto existing = v->shards.find(in.rank);
  if (existing != v->shards.end()) {
    const Shard& have = existing->second;
    if (have.size_bytes == in.size_bytes && have.crc32c == in.crc32c &&
        have.manifest_digest == in.manifest_digest && have.primary_node_id == node_id) {
      return absl::AlreadyExistsError("shard already staged");
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", in.rank, " of ", r.job_id, "/", r.step, " is already staged on node \"",
        have.primary_node_id, "\" with different contents (crc ", absl::Hex(have.crc32c),
        " vs ", absl::Hex(in.crc32c), ")"));
  }
  if (v->state != VersionState::kOpen) {
    return absl::FailedPreconditionError(absl::StrCat(
        "version ", r.job_id, "/", r.step, " is ", VersionStateName(v->state),
        v->abort_reason.empty() ? "" : absl::StrCat(" (", v->abort_reason, ")"),
        "; it accepts no new shards"));
  }
  if (!r.run_id.empty() && !v->run_id.empty() && r.run_id != v->run_id) {
    return absl::FailedPreconditionError(absl::StrCat("shard's run \"", r.run_id,
                                                      "\" differs from the version's run \"",
                                                      v->run_id, "\""));
  }
  const uint32_t rank = in.rank;
  Shard sh = std::move(r.shard);
  sh.ref_steps = RefStepsOf(sh.items);
  CKPT_RETURN_IF_ERROR(CheckRefs(e, *v, sh));
  sh.primary_node_id = node_id;
  sh.copies.clear();
  sh.copies.push_back(Copy{node_id, CopyRole::kPrimary, CopyState::kValid, e.NowMs(), ""});
  sh.durable_written = false;
  if (v->flush_planned) sh.durable_path = absl::StrCat(v->durable_dir, "/", RankFileName(rank));
  v->shards[rank] = std::move(sh);
  e.txn().ShardRecord(*v, rank);

  // Replication starts per shard, as soon as it is committed.
  if (v->plan.policy.kind == ProtectionPolicy::Kind::kReplicate) {
    e.PlanRecovery(*v);
  }
  // An incremental version is flushed with references to the versions it
  // refers to, which are flushed too (their files must be committed first).
  if (v->flush_planned) {
    for (uint64_t base : v->shards[rank].ref_steps) {
      if (absl::StatusOr<Version*> b = e.FindVersion(v->job_id, base); b.ok()) e.StartFlush(**b);
    }
  }
  e.PlanFlush(*v);
  if (v->shards.size() == v->world_size) {
    v->staged_ms = e.NowMs();
    CKPT_RETURN_IF_ERROR(e.SetState(*v, VersionState::kStaged));
    if (v->plan.policy.kind == ProtectionPolicy::Kind::kErasureCode) {
      e.TakeInShardsOutsideTheGroups(*v);
      e.StartErasureCoding(*v);
    }
    e.Recompute(*v);
    // Older versions still OPEN can never be the newest restorable one now.
    e.AbortOpenVersionsBelow(*v);
  } else if (v->state == VersionState::kOpen) {
    e.state().open_progress[{v->job_id, v->step}] = e.Mono();
  }
  return absl::OkStatus();
}

absl::Status ApplyCopy(Engine& e, const std::string& node_id, const CopyReport& r) {
  CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(r.job_id, r.step));
  CKPT_ASSIGN_OR_RETURN(Shard * shard, StagedShard(v, r.rank));
  Shard& sh = *shard;
  if (IsTerminal(v->state) || v->evicted) {
    return absl::FailedPreconditionError(absl::StrCat("version ", r.job_id, "/", r.step, " is ",
                                                      VersionStateName(v->state),
                                                      v->evicted ? " and evicted" : "",
                                                      "; drop the copy"));
  }
  if (r.state == CopyState::kValid && (r.crc32c != sh.crc32c || r.size_bytes != sh.size_bytes)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "copy of rank ", r.rank, " on node \"", node_id, "\" (", r.size_bytes, " bytes, crc ",
        absl::Hex(r.crc32c), ") does not match the staged shard (", sh.size_bytes,
        " bytes, crc ", absl::Hex(sh.crc32c), "); drop it"));
  }
  Copy* copy = nullptr;
  for (Copy& c : sh.copies)
    if (c.node_id == node_id) copy = &c;
  if (copy != nullptr && copy->state == r.state && copy->role == r.role) {
    return absl::AlreadyExistsError("copy state unchanged");
  }
  if (copy == nullptr) {
    sh.copies.push_back(Copy{node_id, r.role, r.state, e.NowMs(), r.detail});
  } else {
    // A primary copy stays primary whatever role the report names.
    if (copy->role != CopyRole::kPrimary) copy->role = r.role;
    copy->state = r.state;
    copy->updated_ms = e.NowMs();
    copy->detail = r.detail;
  }
  e.txn().ShardRecord(*v, r.rank);
  e.Recompute(*v);
  return absl::OkStatus();
}

absl::Status ApplySegment(Engine& e, const std::string& node_id, const SegmentReport& r) {
  CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(r.job_id, r.step));
  Segment* seg = nullptr;
  for (Segment& s : v->segments)
    if (s.key == r.key) seg = &s;
  if (seg == nullptr) {
    return absl::NotFoundError(absl::StrCat("version ", r.job_id, "/", r.step,
                                            " has no segment group ", r.key.group, " stripe ",
                                            r.key.stripe, " position ", r.key.position));
  }
  if (IsTerminal(v->state) || v->evicted) {
    return absl::FailedPreconditionError(absl::StrCat("version ", r.job_id, "/", r.step, " is ",
                                                      VersionStateName(v->state),
                                                      "; drop the segment"));
  }
  if (r.state == CopyState::kValid) {
    if (r.length_bytes != seg->length_bytes) {
      return absl::FailedPreconditionError(absl::StrCat("segment length ", r.length_bytes,
                                                        " differs from the layout's ",
                                                        seg->length_bytes));
    }
    if (seg->state == CopyState::kValid && (seg->crc_known || seg->crc32c != 0) && seg->crc32c != r.crc32c &&
        seg->holder_node_id != node_id) {
      // A rebuilt copy must reproduce the known contents.
      return absl::FailedPreconditionError(absl::StrCat("segment crc ", absl::Hex(r.crc32c),
                                                        " differs from the known ",
                                                        absl::Hex(seg->crc32c)));
    }
    if (seg->state == CopyState::kValid && seg->holder_node_id == node_id &&
        seg->crc32c == r.crc32c) {
      return absl::AlreadyExistsError("segment state unchanged");
    }
    if (seg->state == CopyState::kValid && seg->holder_node_id != node_id &&
        seg->length_bytes > 0 && e.IsUsable(seg->holder_node_id)) {
      // Moved (a rebalance of a stripe doubled up on one node): the old
      // holder's copy would otherwise stay in its memory for good.
      Holding h;
      h.is_segment = true;
      h.job_id = r.job_id;
      h.step = r.step;
      h.segment = seg->key;
      h.kind = seg->kind;
      h.size_bytes = seg->length_bytes;
      h.crc32c = seg->crc32c;
      Task& t = e.NewTask(seg->holder_node_id, TaskKind::kDrop, "", 0, 0);
      t.drop = {h};
      t.reason = absl::StrCat("segment moved to node \"", node_id, "\"");
      e.txn().Task(t);
    }
    seg->holder_node_id = node_id;
    seg->crc32c = r.crc32c;
    seg->crc_known = true;
  } else {
    if (seg->holder_node_id != node_id) {
      return absl::FailedPreconditionError(absl::StrCat("node \"", node_id,
                                                        "\" does not hold this segment"));
    }
    if (seg->state == r.state) return absl::AlreadyExistsError("segment state unchanged");
  }
  seg->state = r.state;
  seg->updated_ms = e.NowMs();
  seg->detail = r.detail;
  e.txn().Segments(*v);
  e.Recompute(*v);
  return absl::OkStatus();
}

absl::Status ApplyPersisted(Engine& e, const std::string& node_id, const PersistedReport& r) {
  CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(r.job_id, r.step));
  CKPT_ASSIGN_OR_RETURN(Shard * shard, StagedShard(v, r.rank));
  Shard& sh = *shard;
  if (IsTerminal(v->state)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "version ", r.job_id, "/", r.step, " is ", VersionStateName(v->state)));
  }
  if (!v->flush_planned) {
    return absl::FailedPreconditionError(absl::StrCat("version ", r.job_id, "/", r.step,
                                                      " is not planned for flush"));
  }
  if (r.durable_path != sh.durable_path) {
    return absl::InvalidArgumentError(absl::StrCat("durable path \"", r.durable_path,
                                                   "\" differs from the planned \"",
                                                   sh.durable_path, "\""));
  }
  if (r.crc32c != sh.crc32c || r.size_bytes != sh.size_bytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "durable file of rank ", r.rank, " (", r.size_bytes, " bytes, crc ",
        absl::Hex(r.crc32c), ") does not match the shard (", sh.size_bytes, " bytes, crc ",
        absl::Hex(sh.crc32c), ")"));
  }
  if (sh.durable_written) return absl::AlreadyExistsError("already persisted");
  sh.durable_written = true;
  sh.durable_written_ms = e.NowMs();
  e.txn().ShardRecord(*v, r.rank);
  e.PlanFlush(*v);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ReportResult> MetaCore::ReportShards(const std::string& node_id,
                                                    uint64_t incarnation,
                                                    const std::vector<ShardReport>& reports) {
  uint64_t seq = 0;
  CKPT_ASSIGN_OR_RETURN(ReportResult result,
                        SubmitReportShards(node_id, incarnation, std::vector(reports), &seq));
  CKPT_RETURN_IF_ERROR(store_->AwaitDurable(seq));
  return result;
}

absl::StatusOr<ReportResult> MetaCore::SubmitReportShards(const std::string& node_id,
                                                          uint64_t incarnation,
                                                          std::vector<ShardReport> reports,
                                                          uint64_t* durable_seq) {
  *durable_seq = 0;
  uint64_t seq = 0;
  absl::StatusOr<ReportResult> answer = Apply([&](Engine& e) -> absl::StatusOr<ReportResult> {
    CKPT_RETURN_IF_ERROR(e.CheckNode(node_id, incarnation).status());
    ReportResult result;
    result.results.reserve(reports.size());
    state_->created_tasks.clear();
    for (ShardReport& r : reports) {
      absl::Status st;
      switch (r.kind) {
        case ShardReport::Kind::kStaged: st = ApplyStaged(e, node_id, r.staged); break;
        case ShardReport::Kind::kCopy: st = ApplyCopy(e, node_id, r.copy); break;
        case ShardReport::Kind::kSegment: st = ApplySegment(e, node_id, r.segment); break;
        case ShardReport::Kind::kPersisted: st = ApplyPersisted(e, node_id, r.persisted); break;
      }
      ++state_->counters.reports_total;
      if (!st.ok() && !absl::IsAlreadyExists(st)) ++state_->counters.reports_rejected_total;
      result.results.push_back(st);
    }
    for (const std::string& id : state_->created_tasks) {
      auto t = state_->tasks.find(id);
      if (t != state_->tasks.end() && t->second.node_id == node_id &&
          t->second.state == TaskState::kPending) {
        result.tasks.push_back(e.Bundle(t->second));
      }
    }
    state_->created_tasks.clear();
    return result;
  }, &seq);
  if (answer.ok()) *durable_seq = seq;  // an error is answered at once
  return answer;
}

}  // namespace ckpt::meta
