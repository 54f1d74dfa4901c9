// An in-process fake of ckpt-agent's AgentService for client tests, served on
// a unix socket in a test's temp dir.
//
// It keeps its memory tier in one pool file (ftruncate'd, mapped by the fake
// too) and serves the local-client half of the service the way the real agent
// is specified to (proto/ckpt/v1/agent.proto):
//   - AgentStatus: node id and the pool file (unless told not to list it);
//   - AcquireStagingLease: a bump-allocated, 4096-aligned range of the pool
//     file, optionally cut into two regions (adjacent in the file or with a
//     hole between them) to exercise items that straddle regions; the first
//     lease of a (job, step) calls meta's BeginVersion (if a meta address is
//     given); a new lease for a (job, step, rank) with an open lease aborts
//     the old one;
//   - CommitShard: validates the manifest, re-reads every item from the pool
//     file and compares its crc with the client's (mismatches are counted and
//     rejected with INVALID_ARGUMENT), checks that padding is zero, computes the
//     shard crc from the file, records the shard and reports it STAGED to meta
//     (RegisterNode at start); replays give ALREADY_EXISTS;
//   - AbortLease (idempotent; FAILED_PRECONDITION for a committed lease);
//   - OpenShard (local copies only; verifies item crcs unless skip_verify:
//     DATA_LOSS naming the item) and CloseShard.
// Everything else is UNIMPLEMENTED. Fault knobs make the next commit fail.
//
// Thread safety: all methods may be called from any thread.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "ckpt/v1/agent.grpc.pb.h"
#include "ckpt/v1/meta.grpc.pb.h"

namespace ckpt::testing {

class FakeAgent final : public ckpt::v1::AgentService::Service {
 public:
  struct Options {
    // Directory for agent.sock and pool-0.bin.
    std::string dir{};
    std::string node_id = "fake-node";
    // ckpt-meta "host:port"; empty: no meta calls (leases need no version).
    std::string meta_address{};
    uint64_t pool_bytes = 64ull << 20;
    // Cut every lease larger than split_at bytes into two regions: the
    // first split_at bytes, then the rest, `hole_bytes` further on in the
    // file (0: adjacent). split_at must be a multiple of 4096; 0: one region.
    uint64_t split_at = 0;
    uint64_t hole_bytes = 4096;
    uint64_t item_alignment = 64;
    // List the pool file in AgentStatus (false: the client must map the
    // regions' file on demand).
    bool list_pool_files = true;
    // Answer OpenShardRequest.packed_manifest with a packed manifest (false:
    // as an agent that predates it, with shard.items).
    bool packs_manifests = true;
    // Change one byte of every packed manifest it returns (its digest then
    // no longer matches).
    bool tamper_manifest = false;
    // Report its copies with another crc32c than the committed one (as a
    // copy that is not the version's): an OpenShard with `expected` then
    // fails as the real agent does (DATA_LOSS).
    bool local_copy_differs = false;
    // Report a commit to meta only when the next CloseShard arrives (as the
    // real agent reports in the background: the version is still OPEN at
    // meta when CommitShard returns).
    bool report_at_next_close = false;
  };

  static absl::StatusOr<std::unique_ptr<FakeAgent>> Start(Options options);
  ~FakeAgent() override;

  std::string socket_path() const { return options_.dir + "/agent.sock"; }
  std::string pool_path() const { return options_.dir + "/pool-0.bin"; }
  const std::string& node_id() const { return options_.node_id; }

  // The next CommitShard returns `status`; with `apply_first`, the commit
  // takes effect before (a lost response).
  void FailNextCommit(grpc::Status status, bool apply_first);
  // While held, AcquireStagingLease waits (up to 60 s) before it answers.
  void HoldLeases(bool hold);
  // While held, CommitShard waits (up to 60 s) before it looks at the commit.
  void HoldCommits(bool hold);
  // Flips the bits of shard byte `shard_offset` of a committed shard, in the
  // pool file. False if there is no such shard.
  bool Corrupt(const std::string& job, uint64_t step, uint32_t rank, uint64_t shard_offset);

  int leases_granted() const;
  int open_leases() const;
  int aborts() const;          // AbortLease calls that released an open lease
  int commits() const;         // shards committed
  int crc_mismatches() const;  // client crcs that did not match the file
  int open_handles() const;
  // open_handles() once it is `want` (closes sent in the background arrive
  // after the call that sent them returned), or after 30 s.
  int WaitOpenHandles(int want) const;
  // OpenShard calls: for the local copy alone (no sources, no expected
  // shard) and with Locate's answer.
  int local_opens() const;
  int located_opens() const;
  // The committed shard (with items), if any.
  std::optional<ckpt::v1::ShardInfo> Committed(const std::string& job, uint64_t step,
                                               uint32_t rank) const;

  grpc::Status AgentStatus(grpc::ServerContext*, const ckpt::v1::AgentStatusRequest*,
                           ckpt::v1::AgentStatusResponse*) override;
  grpc::Status AcquireStagingLease(grpc::ServerContext*,
                                   const ckpt::v1::AcquireStagingLeaseRequest*,
                                   ckpt::v1::AcquireStagingLeaseResponse*) override;
  grpc::Status CommitShard(grpc::ServerContext*, const ckpt::v1::CommitShardRequest*,
                           ckpt::v1::CommitShardResponse*) override;
  grpc::Status AbortLease(grpc::ServerContext*, const ckpt::v1::AbortLeaseRequest*,
                          ckpt::v1::AbortLeaseResponse*) override;
  grpc::Status OpenShard(grpc::ServerContext*, const ckpt::v1::OpenShardRequest*,
                         ckpt::v1::OpenShardResponse*) override;
  grpc::Status CloseShard(grpc::ServerContext*, const ckpt::v1::CloseShardRequest*,
                          ckpt::v1::CloseShardResponse*) override;

 private:
  using Key = std::tuple<std::string, uint64_t, uint32_t>;  // job, step, rank
  enum class LeaseState { kOpen, kCommitted, kAborted };
  struct Lease {
    Key key;
    uint64_t size = 0;
    std::string run_id;
    std::vector<ckpt::v1::MemoryRegion> regions;
    LeaseState state = LeaseState::kOpen;
  };
  struct Shard {
    ckpt::v1::ShardInfo info;
    std::string manifest;  // packed, in offset order
    std::vector<ckpt::v1::MemoryRegion> regions;
  };

  explicit FakeAgent(Options options) : options_(std::move(options)) {}
  // CRC-32C of shard bytes [offset, offset + n) read from the pool mapping.
  uint32_t CrcOf(const std::vector<ckpt::v1::MemoryRegion>& regions, uint64_t offset,
                 uint64_t n) const;
  std::byte* ByteAt(const std::vector<ckpt::v1::MemoryRegion>& regions, uint64_t offset) const;
  grpc::Status ApplyCommit(Lease& lease, const ckpt::v1::CommitShardRequest& req,
                           ckpt::v1::ShardInfo* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  std::byte* pool_ = nullptr;  // mapping of the pool file
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ckpt::v1::MetaService::Stub> meta_;
  uint64_t incarnation_ = 0;

  mutable absl::Mutex mu_;
  uint64_t next_free_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, Lease> leases_ ABSL_GUARDED_BY(mu_);
  std::map<Key, Shard> shards_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Key> handles_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, uint64_t>, bool> begun_ ABSL_GUARDED_BY(mu_);
  std::optional<std::pair<grpc::Status, bool>> fail_next_commit_ ABSL_GUARDED_BY(mu_);
  absl::Mutex hold_mu_;
  bool hold_leases_ ABSL_GUARDED_BY(hold_mu_) = false;
  bool hold_commits_ ABSL_GUARDED_BY(hold_mu_) = false;
  int leases_granted_ ABSL_GUARDED_BY(mu_) = 0;
  int aborts_ ABSL_GUARDED_BY(mu_) = 0;
  int commits_ ABSL_GUARDED_BY(mu_) = 0;
  int crc_mismatches_ ABSL_GUARDED_BY(mu_) = 0;
  int local_opens_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<ckpt::v1::ReportShardsRequest> deferred_reports_ ABSL_GUARDED_BY(mu_);
  int located_opens_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt::testing
