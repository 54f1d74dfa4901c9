// MetaCore, jobs: CreateJob (open mode and the spec comparison), GetJob,
// ListJobs, DeleteJob, GetPlacement.
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "server/meta/core_state.h"

namespace ckpt::meta {

namespace {

absl::Status ValidateWorldSize(uint32_t world_size) {
  if (world_size == 0 || world_size > JobSpec::kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "world size ", world_size, " is invalid: it must be 1..", JobSpec::kMaxWorldSize,
        " (the number of ranks that save a shard per version)"));
  }
  return absl::OkStatus();
}

// Checks what the request states; whether a job can be created from it is
// checked when it is (a world size is then required).
absl::Status ValidateRequest(const JobRequest& req) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(req.job_id));
  if (req.world_size != 0) CKPT_RETURN_IF_ERROR(ValidateWorldSize(req.world_size));
  if (req.protection.has_value()) CKPT_RETURN_IF_ERROR(req.protection->Validate());
  if (req.labels.size() > 32) {
    return absl::InvalidArgumentError("a job may carry at most 32 labels");
  }
  for (const auto& [k, v] : req.labels) {
    if (k.empty() || k.size() > 256 || v.size() > 256) {
      return absl::InvalidArgumentError(
          "label keys must be 1..256 bytes and values at most 256 bytes");
    }
  }
  return absl::OkStatus();
}

// Policies equal in the fields their kind uses.
bool SamePolicy(const ProtectionPolicy& a, const ProtectionPolicy& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case ProtectionPolicy::Kind::kReplicate:
      return a.copies == b.copies && a.placement == b.placement;
    case ProtectionPolicy::Kind::kErasureCode:
      return a.data_k == b.data_k && a.parity_m == b.parity_m;
    case ProtectionPolicy::Kind::kNone:
      break;
  }
  return true;
}

std::string FlushString(const FlushPolicy& f) {
  if (f.every_n_versions == 0 && f.every_seconds == 0) return "never";
  std::vector<std::string> rules;
  if (f.every_n_versions != 0) {
    rules.push_back(absl::StrCat("every ", f.every_n_versions, " versions"));
  }
  if (f.every_seconds != 0) rules.push_back(absl::StrCat("every ", f.every_seconds, " s"));
  return absl::StrJoin(rules, " or ");
}

std::string RetentionString(const RetentionPolicy& r) {
  return absl::StrCat("keep_in_memory ", r.EffectiveKeepInMemory(), ", keep_durable ",
                      r.keep_durable == 0 ? std::string("all") : absl::StrCat(r.keep_durable));
}

// The stated parts of `asked` that differ from `stored`, each with both
// values; empty when the job can be opened.
std::string DiffSpecs(const JobSpec& stored, const JobRequest& asked) {
  std::vector<std::string> diffs;
  if (asked.world_size != 0 && stored.world_size != asked.world_size)
    diffs.push_back(absl::StrCat("world_size (stored ", stored.world_size, ", asked ",
                                 asked.world_size, ")"));
  if (asked.protection.has_value() && !SamePolicy(stored.protection, *asked.protection))
    diffs.push_back(absl::StrCat("protection (stored ", stored.protection.ToString(), ", asked ",
                                 asked.protection->ToString(), ")"));
  if (asked.flush.has_value() &&
      (stored.flush.every_n_versions != asked.flush->every_n_versions ||
       stored.flush.every_seconds != asked.flush->every_seconds))
    diffs.push_back(absl::StrCat("flush (stored ", FlushString(stored.flush), ", asked ",
                                 FlushString(*asked.flush), ")"));
  if (asked.retention.has_value() &&
      (stored.retention.EffectiveKeepInMemory() != asked.retention->EffectiveKeepInMemory() ||
       stored.retention.keep_durable != asked.retention->keep_durable))
    diffs.push_back(absl::StrCat("retention (stored ", RetentionString(stored.retention),
                                 ", asked ", RetentionString(*asked.retention), ")"));
  return absl::StrJoin(diffs, ", ");
}

JobView MakeJobView(const Job& job, const std::map<uint64_t, Version>* versions) {
  JobView view;
  view.job = job;
  if (versions == nullptr) return view;
  for (const auto& [step, v] : *versions) {
    ++view.version_counts[v.state];
    if (SatisfiesLevel(v.state, Level::kStaged)) view.latest_staged = step;
    if (SatisfiesLevel(v.state, Level::kProtected)) view.latest_protected = step;
    if (SatisfiesLevel(v.state, Level::kPersisted)) view.latest_persisted = step;
    for (const auto& [rank, sh] : v.shards) {
      for (const Copy& c : sh.copies) {
        if (c.state == CopyState::kValid) view.memory_bytes += sh.size_bytes;
      }
      if (sh.durable_written) view.durable_bytes += sh.size_bytes;
    }
    for (const Segment& seg : v.segments) {
      if (seg.state == CopyState::kValid && seg.kind == SegmentKind::kParity) {
        view.memory_bytes += seg.length_bytes;
      }
    }
  }
  return view;
}

}  // namespace

JobRequest JobRequest::Stating(const JobSpec& spec) {
  JobRequest r;
  r.job_id = spec.job_id;
  r.world_size = spec.world_size;
  r.protection = spec.protection;
  if (spec.flush.every_n_versions != 0 || spec.flush.every_seconds != 0) r.flush = spec.flush;
  if (spec.retention.keep_in_memory != 0 || spec.retention.keep_durable != 0) {
    r.retention = spec.retention;
  }
  r.labels = spec.labels;
  return r;
}

ProtectionPolicy AutoProtection(size_t alive_nodes) {
  return alive_nodes >= 2 ? ProtectionPolicy::Replicate(2, ProtectionPolicy::Placement::kRing)
                          : ProtectionPolicy::None();
}

absl::StatusOr<std::pair<JobView, bool>> MetaCore::CreateJob(const JobSpec& spec,
                                                            bool open_if_exists) {
  return CreateJob(JobRequest::Stating(spec), open_if_exists);
}

absl::StatusOr<std::pair<JobView, bool>> MetaCore::CreateJob(const JobRequest& req,
                                                            bool open_if_exists) {
  CKPT_RETURN_IF_ERROR(ValidateRequest(req));
  return Write([&](Engine& e) -> absl::StatusOr<std::pair<JobView, bool>> {
    Txn& txn = e.txn();
    auto it = state_->jobs.find(req.job_id);
    if (it != state_->jobs.end()) {
      if (!open_if_exists) {
        return absl::AlreadyExistsError(absl::StrCat("job \"", req.job_id, "\" already exists"));
      }
      if (it->second.deleting) {
        return absl::FailedPreconditionError(
            absl::StrCat("job \"", req.job_id, "\" is being deleted; use another id"));
      }
      const bool resizing = req.resize_world && req.world_size != 0 && req.world_size != it->second.spec.world_size;
      JobRequest compared = req;
      if (resizing) compared.world_size = 0;
      const std::string diff = DiffSpecs(it->second.spec, compared);
      if (!diff.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "job \"", req.job_id, "\" exists with a different spec: ", diff,
            "; leave out what you do not mean to change (it is then taken from the stored job), "
            "or create a job with another id"));
      }
      auto vs = state_->versions.find(req.job_id);
      if (resizing) {
        // Versions keep the world size they were begun with (a restore
        // reshards them); one still OPEN at the old size can never complete
        // now, and must not take shards of the new size.
        const uint32_t old_size = it->second.spec.world_size;
        it->second.spec.world_size = req.world_size;
        txn.Job(it->second);
        if (vs != state_->versions.end()) {
          for (auto& [step, v] : vs->second) {
            if (v.state != VersionState::kOpen) continue;
            e.AbortOpenVersion(v, absl::StrCat("the job was resized from ", old_size, " to ", req.world_size,
                                               " ranks while this version had ", v.shards.size(), " of ",
                                               v.world_size, " shards staged"));
          }
        }
        log::Info("job {} resized: world size {} -> {}", req.job_id, old_size, req.world_size);
      }
      return std::make_pair(
          MakeJobView(it->second, vs == state_->versions.end() ? nullptr : &vs->second), false);
    }
    if (req.world_size == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job \"", req.job_id, "\" does not exist; creating it needs a world size (1..",
          JobSpec::kMaxWorldSize, ")"));
    }
    const std::vector<PlannerNode> alive = e.AliveNodes();
    const bool defaulted = !req.protection.has_value();
    Job job;
    job.spec.job_id = req.job_id;
    job.spec.world_size = req.world_size;
    job.spec.protection = req.protection.value_or(
        options_.default_protection.value_or(AutoProtection(alive.size())));
    job.spec.flush = req.flush.value_or(FlushPolicy{});
    job.spec.retention = req.retention.value_or(RetentionPolicy{});
    job.spec.labels = req.labels;
    job.created_ms = e.NowMs();
    // The policy must be plannable over the nodes that are alive now.
    if (job.spec.protection.kind != ProtectionPolicy::Kind::kNone) {
      auto plan = PlanPlacement(alive, job.spec.protection);
      if (!plan.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "job \"", req.job_id, "\": ", defaulted ? "the server's default " : "",
            "protection policy ", job.spec.protection.ToString(), " cannot be placed: ",
            plan.status().message()));
      }
    }
    // Planned before the job enters the state, so a failure leaves nothing.
    CKPT_RETURN_IF_ERROR(e.CurrentPlan(job).status());
    Job& stored = state_->jobs[req.job_id] = std::move(job);
    txn.Job(stored);
    log::Info("job {} created: world size {}, protection {}{}", req.job_id, req.world_size,
              stored.spec.protection.ToString(), defaulted ? " (server default)" : "");
    JobView view = MakeJobView(stored, nullptr);
    return std::make_pair(std::move(view), true);
  });
}

absl::StatusOr<JobView> MetaCore::GetJob(const std::string& job_id) const {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job_id));
  return Read([&](Engine& e) -> absl::StatusOr<JobView> {
    auto it = state_->jobs.find(job_id);
    if (it == state_->jobs.end()) {
      return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" does not exist"));
    }
    auto vs = state_->versions.find(job_id);
    return MakeJobView(it->second, vs == state_->versions.end() ? nullptr : &vs->second);
  });
}

absl::StatusOr<std::vector<JobView>> MetaCore::ListJobs(const std::string& after,
                                                        uint32_t limit) const {
  return Read([&](Engine& e) -> absl::StatusOr<std::vector<JobView>> {
    std::vector<JobView> out;
    for (auto it = state_->jobs.upper_bound(after); it != state_->jobs.end(); ++it) {
      if (limit != 0 && out.size() >= limit) break;
      auto vs = state_->versions.find(it->first);
      out.push_back(
          MakeJobView(it->second, vs == state_->versions.end() ? nullptr : &vs->second));
    }
    return out;
  });
}

absl::StatusOr<JobView> MetaCore::DeleteJob(const std::string& job_id, bool delete_durable_files) {
  return Write([&](Engine& e) -> absl::StatusOr<JobView> {
    Txn& txn = e.txn();
    CKPT_ASSIGN_OR_RETURN(Job * job, e.FindJob(job_id));
    if (!job->deleting) {
      job->deleting = true;
      job->delete_durable_files = delete_durable_files;
      txn.Job(*job);
      for (auto& [step, v] : state_->versions[job_id]) {
        if (v.state == VersionState::kDeleted) continue;
        e.CancelVersionTasks(v);
        e.EvictVersion(v);
        if (delete_durable_files && !v.durable_dir.empty()) {
          e.DeleteDurable(v);
        }
        if (v.state != VersionState::kAborted) {
          CKPT_RETURN_IF_ERROR(e.SetState(v, VersionState::kDeleted, "job deleted"));
        }
      }
      log::Info("job {} deleted (durable files {})", job_id,
                delete_durable_files ? "deleted" : "kept");
    }
    auto vs = state_->versions.find(job_id);
    JobView view = MakeJobView(*job, vs == state_->versions.end() ? nullptr : &vs->second);
    return view;
  });
}

absl::StatusOr<std::pair<JobView, bool>> MetaCore::UpdateJob(const std::string& job_id,
                                                            const std::optional<FlushPolicy>& flush,
                                                            const std::optional<RetentionPolicy>& retention,
                                                            const std::optional<ProtectionPolicy>& protection) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job_id));
  if (!flush.has_value() && !retention.has_value() && !protection.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("update of job \"", job_id,
                                                   "\" changes nothing: give a flush, retention or protection policy"));
  }
  if (protection.has_value()) CKPT_RETURN_IF_ERROR(protection->Validate());
  return Write([&](Engine& e) -> absl::StatusOr<std::pair<JobView, bool>> {
    CKPT_ASSIGN_OR_RETURN(Job * job, e.FindJob(job_id));
    if (job->deleting) {
      return absl::FailedPreconditionError(absl::StrCat("job \"", job_id, "\" is being deleted"));
    }
    const bool protection_changed = protection.has_value() && !SamePolicy(job->spec.protection, *protection);
    // Checked before anything changes: a refusal leaves the job as it was.
    if (protection_changed && protection->kind != ProtectionPolicy::Kind::kNone) {
      if (absl::StatusOr<PlacementPlan> plan = PlanPlacement(e.AliveNodes(), *protection); !plan.ok()) {
        return absl::FailedPreconditionError(absl::StrCat("job \"", job_id, "\": protection policy ",
                                                          protection->ToString(),
                                                          " cannot be placed on the nodes alive now: ",
                                                          plan.status().message()));
      }
    }
    std::vector<std::string> what;
    if (protection_changed) {
      size_t existing = 0;
      if (auto vs = state_->versions.find(job_id); vs != state_->versions.end()) existing = vs->second.size();
      what.push_back(absl::StrCat("protection ", protection->ToString(), " for versions begun from now on (was ",
                                  job->spec.protection.ToString(), "; the ", existing,
                                  " existing version(s) keep the policy they were planned with)"));
      job->spec.protection = *protection;
      // The next version is planned afresh, under a new epoch.
      state_->last_plan_nodes.erase(job_id);
      CKPT_RETURN_IF_ERROR(e.CurrentPlan(*job).status());
    }
    if (flush.has_value() && (flush->every_n_versions != job->spec.flush.every_n_versions ||
                              flush->every_seconds != job->spec.flush.every_seconds)) {
      what.push_back(absl::StrCat("flush every ", flush->every_n_versions, " versions / ", flush->every_seconds,
                                  " s (was ", job->spec.flush.every_n_versions, " / ",
                                  job->spec.flush.every_seconds, ")"));
      job->spec.flush = *flush;
    }
    bool retention_changed = false;
    if (retention.has_value() && (retention->keep_in_memory != job->spec.retention.keep_in_memory ||
                                  retention->keep_durable != job->spec.retention.keep_durable)) {
      what.push_back(absl::StrCat("keep ", retention->EffectiveKeepInMemory(), " in memory and ",
                                  retention->keep_durable == 0 ? std::string("every")
                                                               : absl::StrCat(retention->keep_durable),
                                  " durable (was ", job->spec.retention.EffectiveKeepInMemory(), " and ",
                                  job->spec.retention.keep_durable == 0
                                      ? std::string("every")
                                      : absl::StrCat(job->spec.retention.keep_durable),
                                  ")"));
      job->spec.retention = *retention;
      retention_changed = true;
    }
    if (!what.empty()) {
      e.txn().Job(*job);
      if (retention_changed) e.ApplyRetention(*job);
      log::Info("job {} updated: {}", job_id, absl::StrJoin(what, "; "));
    }
    auto vs = state_->versions.find(job_id);
    return std::make_pair(MakeJobView(*job, vs == state_->versions.end() ? nullptr : &vs->second),
                          !what.empty());
  });
}

absl::StatusOr<PlacementView> MetaCore::GetPlacement(
    const std::string& job_id, const std::vector<int>& failures,
    const std::optional<ProtectionPolicy>& override, SurvivalOptions survival) const {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job_id));
  // The plan is over the alive nodes and the job as they are durably; the
  // survival estimates are computed after, without the lock.
  PlacementView view;
  CKPT_ASSIGN_OR_RETURN(PlacementPlan plan, Read([&](Engine& e) -> absl::StatusOr<PlacementPlan> {
    auto it = state_->jobs.find(job_id);
    if (it == state_->jobs.end()) {
      return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" does not exist"));
    }
    const ProtectionPolicy policy = override.has_value() ? *override : it->second.spec.protection;
    CKPT_RETURN_IF_ERROR(policy.Validate());
    view.plan.epoch = override.has_value() ? 0 : it->second.plan_epoch;
    view.job_id = job_id;
    view.created_ms = clock_->NowUnixMillis();
    return PlanPlacement(e.AliveNodes(), policy);
  }));
  CKPT_ASSIGN_OR_RETURN(VersionPlan vp, PlanToVersionPlan(plan));
  vp.epoch = view.plan.epoch;
  view.plan = std::move(vp);
  for (int f : failures) {
    CKPT_ASSIGN_OR_RETURN(SurvivalEstimate est, SurvivalProbability(plan, f, survival));
    view.survival.push_back(est);
  }
  return view;
}

}  // namespace ckpt::meta
