// FakeAgentLink: an in-process client::AgentLink for client unit tests: no
// socket, no server, no files. Its memory tier is one memfd (named by its
// /proc/self/fd path, which the client maps as it maps a pool file), and it
// serves the save half of AgentService as the agent is specified to
// (proto/ckpt/v1/agent.proto):
//   - AgentStatus: node id and the pool;
//   - AcquireStagingLease: a bump-allocated, 4096-aligned range of the pool
//     (or a pull lease), with the configured item alignment; a new lease for
//     a (job, step, rank) with an open one aborts the old one; a request
//     naming base steps is refused when told the bases are gone;
//   - AbortLease: idempotent; kFailedPrecondition for a committed lease;
//   - CommitShard: the lease must be open; computes the shard's crc32c from
//     the pool and answers it; a replay of a committed lease gives
//     kAlreadyExists;
// and the load half, for the shards committed into it:
//   - OpenShard: the newest committed shard of the key's step (any job and
//     rank): its ShardInfo (crc32c from the pool, manifest digest of its
//     packed manifest), the packed manifest, its region of the pool, served
//     from LOCAL, verified if not skip_verify; version_staged as configured;
//     kNotFound for a step with no committed shard;
//   - CloseShard: releases the handle; kNotFound for an unknown one.
// DeliverShard and PauseProtection answer kUnimplemented. Fault knobs make
// the next call of a kind fail. Lease requests, leases, commits, aborts and
// open handles are recorded.
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
#include "absl/synchronization/mutex.h"
#include "client/agent_link.h"

namespace ckpt::testing {

class FakeAgentLink final : public client::AgentLink {
 public:
  struct Options {
    std::string node_id = "fake-node";
    uint64_t pool_bytes = 16ull << 20;
    // Reported in every lease (0: none).
    uint64_t item_alignment = 64;
    // Leases are pull-mode (no regions; the client stages the shard itself)
    // with this token.
    bool pull = false;
    std::string pull_token = std::string(32, 't');
    // Regions that cover 4096 bytes less than the lease (the client must
    // refuse them).
    bool short_regions = false;
    // Refuse every lease that names base steps ("base version ... is not
    // held"), as an agent that evicted or never held the base.
    bool bases_gone = false;
    // OpenShard answers version_staged (meta told the agent the version is
    // restorable from memory: the client need not ask meta).
    bool version_staged = false;
  };

  enum class Call { kAcquireStagingLease, kAbortLease, kCommitShard, kOpenShard };

  // One lease granted.
  struct Lease {
    std::string id;
    uint64_t step = 0;
    uint64_t size_bytes = 0;
    uint64_t pool_offset = 0;
    std::vector<uint64_t> base_steps;
    bool aborted = false;    // by AbortLease, or replaced by a newer lease
    bool committed = false;
    // Once committed: the shard as the agent holds it (key.step only), and
    // its packed manifest.
    v1::ShardInfo shard;
    std::string manifest;
  };

  explicit FakeAgentLink(Options options);
  FakeAgentLink() : FakeAgentLink(Options{}) {}
  ~FakeAgentLink() override;
  FakeAgentLink(const FakeAgentLink&) = delete;
  FakeAgentLink& operator=(const FakeAgentLink&) = delete;

  // The pool's path, as AgentStatus lists it and regions name it.
  const std::string& pool_path() const { return pool_path_; }

  // The next call of `call` fails with `status` (queued, in order).
  void FailNext(Call call, absl::Status status);
  // The next commit takes effect, but its caller hears `status`.
  void LoseNextCommitAnswer(absl::Status status);
  // The next commit answers a shard crc32c other than the pool's.
  void MisreportNextCommitCrc();

  std::vector<Lease> leases() const;
  // Leases granted and neither aborted nor committed.
  size_t open_leases() const;
  // Commits that took effect, in order.
  std::vector<v1::CommitShardRequest> commits() const;
  // AbortLease calls received (lease ids).
  std::vector<std::string> aborts() const;
  // The committed shard of `step` (the newest lease's), as OpenShard and
  // Locate describe it; an empty ShardInfo if none.
  v1::ShardInfo committed_shard(uint64_t step) const;
  // Shard handles opened and not closed.
  size_t open_handles() const;
  // AcquireStagingLease requests received.
  std::vector<v1::AcquireStagingLeaseRequest> lease_requests() const;

  // client::AgentLink
  absl::Status AgentStatus(v1::AgentStatusResponse* resp, absl::Duration timeout) override;
  absl::Status AcquireStagingLease(const v1::AcquireStagingLeaseRequest& req, v1::AcquireStagingLeaseResponse* resp,
                                   absl::Duration timeout) override;
  absl::Status AbortLease(const v1::AbortLeaseRequest& req, absl::Duration timeout) override;
  absl::Status CommitShard(const v1::CommitShardRequest& req, v1::CommitShardResponse* resp,
                           absl::Duration timeout) override;
  absl::Status OpenShard(const v1::OpenShardRequest& req, v1::OpenShardResponse* resp,
                         absl::Duration timeout) override;
  absl::Status CloseShard(const v1::CloseShardRequest& req, absl::Duration timeout) override;
  absl::Status DeliverShard(const v1::DeliverShardRequest& req, absl::Duration timeout) override;
  absl::Status PauseProtection(const v1::PauseProtectionRequest& req, v1::PauseProtectionResponse* resp,
                               absl::Duration timeout) override;
  void AwaitRetry(absl::Time until) override {}

 private:
  // The queued failure of `call`, if any (OK otherwise).
  absl::Status TakeFailure(Call call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  int fd_ = -1;
  std::string pool_path_;
  mutable absl::Mutex mu_;
  uint64_t next_offset_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<Call, std::deque<absl::Status>> failures_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::Status> lost_answers_ ABSL_GUARDED_BY(mu_);
  int misreport_crc_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Lease> leases_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::CommitShardRequest> commits_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> aborts_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::AcquireStagingLeaseRequest> lease_requests_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> handles_ ABSL_GUARDED_BY(mu_);  // open handle id -> step
};

}  // namespace ckpt::testing
