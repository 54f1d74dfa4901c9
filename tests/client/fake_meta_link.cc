#include "fake_meta_link.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace ckpt::testing {
namespace {

// The least version state that satisfies `level` (STAGED 1 -> state 2, ...).
int MinState(v1::DurabilityLevel level) { return static_cast<int>(level) + 1; }

bool Satisfies(v1::VersionState state, v1::DurabilityLevel level) {
  return state >= v1::VERSION_STATE_STAGED && state <= v1::VERSION_STATE_PERSISTED && state >= MinState(level);
}

std::string LevelName(v1::DurabilityLevel level) {
  std::string name = v1::DurabilityLevel_Name(level);
  return name.substr(name.rfind('_') + 1);
}

std::string StateName(v1::VersionState state) {
  std::string name = v1::VersionState_Name(state);
  return name.substr(name.rfind('_') + 1);
}

absl::Status Named(const char* call, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(call, ": ", s.message()));
}

}  // namespace

void FakeMetaLink::PutJob(const v1::JobSpec& spec, bool deleting) {
  absl::MutexLock lock(&mu_);
  jobs_[spec.job_id()] = Job{spec, deleting};
}

void FakeMetaLink::PutVersion(const std::string& job_id, uint64_t step, v1::VersionState state) {
  absl::MutexLock lock(&mu_);
  versions_[job_id][step].state = state;
}

void FakeMetaLink::PutShard(const std::string& job_id, uint64_t step, uint32_t rank,
                            const v1::LocateResponse& located) {
  absl::MutexLock lock(&mu_);
  versions_[job_id][step].shards[rank] = located;
}

void FakeMetaLink::SetClusterStatus(const v1::ClusterStatusResponse& resp) {
  absl::MutexLock lock(&mu_);
  cluster_status_ = resp;
}

void FakeMetaLink::FailNext(Call call, absl::Status status) {
  absl::MutexLock lock(&mu_);
  failures_[call].push_back(std::move(status));
}

int FakeMetaLink::calls(Call call) const {
  absl::MutexLock lock(&mu_);
  auto it = calls_.find(call);
  return it == calls_.end() ? 0 : it->second;
}

int FakeMetaLink::retries() const {
  absl::MutexLock lock(&mu_);
  return retries_;
}

std::vector<v1::CreateJobRequest> FakeMetaLink::create_requests() const {
  absl::MutexLock lock(&mu_);
  return create_requests_;
}
std::vector<v1::LatestRequest> FakeMetaLink::latest_requests() const {
  absl::MutexLock lock(&mu_);
  return latest_requests_;
}
std::vector<v1::WaitVersionRequest> FakeMetaLink::wait_requests() const {
  absl::MutexLock lock(&mu_);
  return wait_requests_;
}
std::vector<v1::LocateRequest> FakeMetaLink::locate_requests() const {
  absl::MutexLock lock(&mu_);
  return locate_requests_;
}

int FakeMetaLink::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiting_;
}

void FakeMetaLink::AwaitWaiting(int n) const {
  absl::MutexLock lock(&mu_);
  auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return waiting_ >= n; };
  mu_.Await(absl::Condition(&enough));
}

absl::Status FakeMetaLink::Begin(Call call, const char* name) {
  ++calls_[call];
  auto it = failures_.find(call);
  if (it == failures_.end() || it->second.empty()) return absl::OkStatus();
  absl::Status s = std::move(it->second.front());
  it->second.pop_front();
  return Named(name, s);
}

absl::StatusOr<FakeMetaLink::Version*> FakeMetaLink::FindVersion(const std::string& job_id, uint64_t step) {
  if (!jobs_.contains(job_id)) return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" does not exist"));
  auto j = versions_.find(job_id);
  if (j != versions_.end()) {
    auto v = j->second.find(step);
    if (v != j->second.end()) return &v->second;
  }
  return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" has no version at step ", step));
}

v1::VersionInfo FakeMetaLink::Info(const std::string& job_id, uint64_t step, const Version& v) const {
  v1::VersionInfo info;
  info.set_job_id(job_id);
  info.set_step(step);
  info.set_state(v.state);
  auto j = jobs_.find(job_id);
  if (j != jobs_.end()) info.set_world_size(j->second.spec.world_size());
  info.set_shards_staged(static_cast<uint32_t>(v.shards.size()));
  return info;
}

absl::Status FakeMetaLink::CreateJob(const v1::CreateJobRequest& req, v1::CreateJobResponse* resp, absl::Duration) {
  absl::MutexLock lock(&mu_);
  create_requests_.push_back(req);
  CKPT_RETURN_IF_ERROR(Begin(Call::kCreateJob, "CreateJob"));
  const std::string& id = req.spec().job_id();
  auto it = jobs_.find(id);
  if (it != jobs_.end()) {
    if (!req.open_if_exists()) {
      return Named("CreateJob", absl::AlreadyExistsError(absl::StrCat("job \"", id, "\" already exists")));
    }
    if (it->second.deleting) {
      return Named("CreateJob", absl::FailedPreconditionError(
                                    absl::StrCat("job \"", id, "\" is being deleted; use another id")));
    }
    if (req.spec().world_size() != it->second.spec.world_size()) {
      return Named("CreateJob", absl::FailedPreconditionError(absl::StrCat(
                                    "job \"", id, "\" exists with a different spec: world_size ",
                                    it->second.spec.world_size(), " -> ", req.spec().world_size())));
    }
    *resp->mutable_job()->mutable_spec() = it->second.spec;
    resp->set_created(false);
    return absl::OkStatus();
  }
  if (req.spec().world_size() == 0) {
    return Named("CreateJob", absl::InvalidArgumentError("world_size must be at least 1"));
  }
  jobs_[id] = Job{req.spec(), false};
  *resp->mutable_job()->mutable_spec() = req.spec();
  resp->set_created(true);
  return absl::OkStatus();
}

absl::Status FakeMetaLink::GetJob(const v1::GetJobRequest& req, v1::GetJobResponse* resp, absl::Duration) {
  absl::MutexLock lock(&mu_);
  CKPT_RETURN_IF_ERROR(Begin(Call::kGetJob, "GetJob"));
  auto it = jobs_.find(req.job_id());
  if (it == jobs_.end()) {
    return Named("GetJob", absl::NotFoundError(absl::StrCat("job \"", req.job_id(), "\" does not exist")));
  }
  *resp->mutable_job()->mutable_spec() = it->second.spec;
  resp->mutable_job()->set_deleting(it->second.deleting);
  return absl::OkStatus();
}

absl::Status FakeMetaLink::WaitVersion(const v1::WaitVersionRequest& req, v1::WaitVersionResponse* resp,
                                       absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  wait_requests_.push_back(req);
  CKPT_RETURN_IF_ERROR(Begin(Call::kWaitVersion, "WaitVersion"));
  absl::StatusOr<Version*> found = FindVersion(req.job_id(), req.step());
  if (!found.ok()) return Named("WaitVersion", found.status());
  const absl::Duration poll = std::min(absl::Milliseconds(req.timeout_ms()), timeout);
  auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return Satisfies(versions_[req.job_id()][req.step()].state, req.level());
  };
  ++waiting_;
  mu_.AwaitWithTimeout(absl::Condition(&reached), poll);
  --waiting_;
  const Version& v = versions_[req.job_id()][req.step()];
  if (Satisfies(v.state, req.level())) {
    *resp->mutable_version() = Info(req.job_id(), req.step(), v);
    return absl::OkStatus();
  }
  return Named("WaitVersion", absl::DeadlineExceededError(absl::StrCat(
                                  "version ", req.job_id(), "/", req.step(), " did not reach ",
                                  LevelName(req.level()), " within ", absl::FormatDuration(poll), "; it is ",
                                  StateName(v.state))));
}

absl::Status FakeMetaLink::Latest(const v1::LatestRequest& req, v1::LatestResponse* resp, absl::Duration) {
  absl::MutexLock lock(&mu_);
  latest_requests_.push_back(req);
  CKPT_RETURN_IF_ERROR(Begin(Call::kLatest, "Latest"));
  if (!jobs_.contains(req.job_id())) {
    return Named("Latest", absl::NotFoundError(absl::StrCat("job \"", req.job_id(), "\" does not exist")));
  }
  const auto& by_step = versions_[req.job_id()];
  for (auto it = by_step.rbegin(); it != by_step.rend(); ++it) {
    if (Satisfies(it->second.state, req.min_level())) {
      *resp->mutable_version() = Info(req.job_id(), it->first, it->second);
      return absl::OkStatus();
    }
  }
  return Named("Latest", absl::NotFoundError(absl::StrCat("job \"", req.job_id(), "\" has no version at level ",
                                                          LevelName(req.min_level()), " or better")));
}

absl::Status FakeMetaLink::Locate(const v1::LocateRequest& req, v1::LocateResponse* resp, absl::Duration) {
  absl::MutexLock lock(&mu_);
  locate_requests_.push_back(req);
  CKPT_RETURN_IF_ERROR(Begin(Call::kLocate, "Locate"));
  absl::StatusOr<Version*> found = FindVersion(req.job_id(), req.step());
  if (!found.ok()) return Named("Locate", found.status());
  const Version& v = **found;
  const std::string name = absl::StrCat(req.job_id(), "/", req.step());
  if (!Satisfies(v.state, v1::DURABILITY_LEVEL_STAGED)) {
    return Named("Locate", absl::FailedPreconditionError(absl::StrCat(
                               "version ", name, " is ", StateName(v.state), "; it cannot be restored")));
  }
  auto it = v.shards.find(req.rank());
  if (it == v.shards.end()) {
    return Named("Locate",
                 absl::NotFoundError(absl::StrCat("rank ", req.rank(), " of ", name, " is not staged")));
  }
  if (it->second.sources_size() == 0) {
    return Named("Locate", absl::DataLossError(
                               absl::StrCat("rank ", req.rank(), " of ", name, " has no readable source left")));
  }
  *resp = it->second;
  if (req.omit_items()) resp->mutable_shard()->clear_items();
  return absl::OkStatus();
}

absl::Status FakeMetaLink::GetVersion(const v1::GetVersionRequest& req, v1::GetVersionResponse* resp,
                                      absl::Duration) {
  absl::MutexLock lock(&mu_);
  CKPT_RETURN_IF_ERROR(Begin(Call::kGetVersion, "GetVersion"));
  absl::StatusOr<Version*> v = FindVersion(req.job_id(), req.step());
  if (!v.ok()) return Named("GetVersion", v.status());
  *resp->mutable_version() = Info(req.job_id(), req.step(), **v);
  for (const auto& [rank, located] : (*v)->shards) {
    v1::ShardInfo* info = resp->mutable_version()->add_shards()->mutable_info();
    *info = located.shard();
    if (!req.include_items()) info->clear_items();
  }
  return absl::OkStatus();
}

absl::Status FakeMetaLink::ClusterStatus(const v1::ClusterStatusRequest&, v1::ClusterStatusResponse* resp,
                                         absl::Duration) {
  absl::MutexLock lock(&mu_);
  CKPT_RETURN_IF_ERROR(Begin(Call::kClusterStatus, "ClusterStatus"));
  *resp = cluster_status_;
  return absl::OkStatus();
}

void FakeMetaLink::AwaitRetry(absl::Time) {
  absl::MutexLock lock(&mu_);
  ++retries_;
}

}  // namespace ckpt::testing
