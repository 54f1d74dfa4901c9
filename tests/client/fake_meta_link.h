// FakeMetaLink: an in-process client::MetaLink (client/meta_link.h) for
// client unit tests: no server, no channel. It keeps jobs and versions in
// memory and answers the trainer's half of MetaService with meta's codes
// and messages (src/server/meta: meta_jobs.cc, meta_versions.cc,
// engine_versions.cc), each prefixed with the call's name as the gRPC link's
// are ("Locate: ..."):
//   - CreateJob: creates, or with open_if_exists opens a job of the same
//     world size (created=false); kAlreadyExists without open_if_exists;
//     kFailedPrecondition for another world size or a job being deleted;
//   - GetJob: the job; kNotFound;
//   - WaitVersion: OK once the version reached the level; else waits (real
//     time) up to the request's timeout_ms for a PutVersion that reaches it,
//     then kDeadlineExceeded saying its state; kNotFound for a step the job
//     has no version at;
//   - Latest: the newest version at min_level or better; kNotFound;
//   - Locate: the shard put for the rank, with its sources (items left out
//     with omit_items); kNotFound (no job, version or shard), kFailed-
//     Precondition (the version is OPEN), kDataLoss (no source);
//   - ClusterStatus: the response set with SetClusterStatus.
// Levels: a version's state satisfies a level if STAGED <= state <=
// PERSISTED and state >= the level's. FailNext makes the next call of a
// kind fail; AwaitRetry returns at once (counted). Every call is counted.
//
// Thread safety: all methods may be called from any thread.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/meta_link.h"

namespace ckpt::testing {

class FakeMetaLink final : public client::MetaLink {
 public:
  enum class Call { kCreateJob, kGetJob, kWaitVersion, kLatest, kLocate, kGetVersion, kClusterStatus };

  // A job as if created (world size from `spec`).
  void PutJob(const v1::JobSpec& spec, bool deleting = false);
  // Creates or moves version `step` of `job_id` to `state` (wakes waiters).
  void PutVersion(const std::string& job_id, uint64_t step, v1::VersionState state);
  // What Locate answers for a rank of a version (created OPEN if missing).
  void PutShard(const std::string& job_id, uint64_t step, uint32_t rank, const v1::LocateResponse& located);
  void SetClusterStatus(const v1::ClusterStatusResponse& resp);

  // The next call of `call` fails with `status` (queued, in order; the
  // call's name is prefixed to the message).
  void FailNext(Call call, absl::Status status);

  // Calls received of a kind, and AwaitRetry calls.
  int calls(Call call) const;
  int retries() const;
  // Requests received.
  std::vector<v1::CreateJobRequest> create_requests() const;
  std::vector<v1::LatestRequest> latest_requests() const;
  std::vector<v1::WaitVersionRequest> wait_requests() const;
  std::vector<v1::LocateRequest> locate_requests() const;
  // WaitVersion calls waiting now (blocked in their long poll).
  int waiting() const;
  // Blocks until at least `n` WaitVersion calls are waiting.
  void AwaitWaiting(int n) const;

  // client::MetaLink
  absl::Status CreateJob(const v1::CreateJobRequest& req, v1::CreateJobResponse* resp,
                         absl::Duration timeout) override;
  absl::Status GetJob(const v1::GetJobRequest& req, v1::GetJobResponse* resp, absl::Duration timeout) override;
  absl::Status WaitVersion(const v1::WaitVersionRequest& req, v1::WaitVersionResponse* resp,
                           absl::Duration timeout) override;
  absl::Status Latest(const v1::LatestRequest& req, v1::LatestResponse* resp, absl::Duration timeout) override;
  absl::Status Locate(const v1::LocateRequest& req, v1::LocateResponse* resp, absl::Duration timeout) override;
  // The version's state and world size, and every shard put (PutShard)
  // with its items when asked.
  absl::Status GetVersion(const v1::GetVersionRequest& req, v1::GetVersionResponse* resp,
                          absl::Duration timeout) override;
  absl::Status ClusterStatus(const v1::ClusterStatusRequest& req, v1::ClusterStatusResponse* resp,
                             absl::Duration timeout) override;
  void AwaitRetry(absl::Time until) override;

 private:
  struct Job {
    v1::JobSpec spec;
    bool deleting = false;
  };
  struct Version {
    v1::VersionState state = v1::VERSION_STATE_OPEN;
    std::map<uint32_t, v1::LocateResponse> shards;
  };

  // Counts the call and takes its queued failure, if any (OK otherwise).
  absl::Status Begin(Call call, const char* name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The version, or meta's NotFound (no job; no version at the step).
  absl::StatusOr<Version*> FindVersion(const std::string& job_id, uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::VersionInfo Info(const std::string& job_id, uint64_t step, const Version& v) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Job> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::map<uint64_t, Version>> versions_ ABSL_GUARDED_BY(mu_);
  v1::ClusterStatusResponse cluster_status_ ABSL_GUARDED_BY(mu_);
  std::map<Call, std::deque<absl::Status>> failures_ ABSL_GUARDED_BY(mu_);
  std::map<Call, int> calls_ ABSL_GUARDED_BY(mu_);
  int retries_ ABSL_GUARDED_BY(mu_) = 0;
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<v1::CreateJobRequest> create_requests_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::LatestRequest> latest_requests_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::WaitVersionRequest> wait_requests_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::LocateRequest> locate_requests_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::testing
