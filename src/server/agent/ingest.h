// Ingest: the save path of the agent. It takes staging leases (pool space a
// client writes a shard into), validates and records commits, pulls a
// shard from the client's staging memory on a DPU agent (pull mode,
// puller.h), checks the references of incremental saves against the base
// shards held here, and stores self-contained a committed shard whose base
// meta no longer holds (docs/agent.md "Save path").
//
// Owns:
//   - which versions this node began at meta and each known job's world size
//     (a job's first lease here asks meta once; later ones never wait for it);
//   - the pins of the base shards of committed shards with references, kept
//     until meta answers their STAGED report (CompactRefused copies from
//     them if meta refused it);
//   - the key of this process's pull and deliver tokens (a restarted agent
//     honours none of its predecessor's).
// Leases are the LeaseTable's, copies the HoldingTable's, pool space the
// Arena's; Ingest decides and calls them.
//
// Locking: two leaf mutexes (the jobs; the base pins, shared with report
// completion callbacks). Neither is held across a call to meta, a pull, a
// crc or a call into another component. Commit never waits for meta: the
// version's Begin and the STAGED report are queued on the MetaSession.
//
// Threads: AcquireLease, Commit run on rpc and session threads, several at
// once; OnVersionRefused and OnShardRefused on the MetaSession's control
// thread.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/crypto.h"
#include "common/manifest.h"
#include "server/agent/agent_metrics.h"
#include "server/agent/arena.h"
#include "server/agent/holdings.h"
#include "server/agent/leases.h"
#include "server/agent/meta_link.h"
#include "server/agent/meta_session.h"
#include "server/agent/puller.h"
#include "server/agent/session_server.h"
#include "server/agent/verifier.h"

namespace ckpt::agent {

struct LeaseRequest {
  std::string job_id;
  uint64_t step = 0;
  uint32_t rank = 0;
  uint64_t size_bytes = 0;
  std::string run_id;
  uint32_t client_pid = 0;
  int64_t ttl_ms = 0;
  std::string session_id;
  // An incremental save's base versions: each must be held here (VALID).
  std::vector<uint64_t> base_steps;
  // Asked on a session connection (SessionServer): Unavailable instead of
  // a look-up at meta (the job's first lease here); the client asks again
  // over gRPC.
  bool without_meta = false;
  // The version is begun at meta by the commit, not by the lease (a lease
  // asked for ahead of its save).
  bool begin_at_commit = false;
};

struct LeaseGrant {
  std::string lease_id;
  std::vector<Region> regions;
  int64_t expires_in_ms = 0;
  uint64_t item_alignment_bytes = 0;
  bool pull = false;  // pull-mode ingest: no regions; commit with a PullSource
  std::string pull_token;  // pull mode: what the staging header must start with
};

// A session the client names must be open on `sessions` (nullptr: the agent
// has no session socket): FailedPrecondition otherwise. "" is no session (OK).
absl::Status CheckClientSession(const SessionServer* sessions, const std::string& session_id);

class Ingest {
 public:
  struct Deps {
    Arena* arena = nullptr;
    HoldingTable* holdings = nullptr;
    LeaseTable* leases = nullptr;
    MetaSession* session = nullptr;
    MetaLink* meta = nullptr;  // a job's world size, once per job
    Verifier* verifier = nullptr;  // woken when a commit queues a copy to check
    SessionServer* sessions = nullptr;  // client sessions (nullptr: none)
    Clock* clock = nullptr;
    AgentMetrics* metrics = nullptr;
    // Pull-mode ingest (AgentOptions::puller); nullptr: push mode.
    Puller* puller = nullptr;
    uint64_t item_alignment_bytes = 64;
    int64_t default_lease_ttl_ms = 60000;
    int64_t peer_timeout_ms = 30000;  // a pull's timeout
    // Leases or holdings changed (the agent's gauges). Called without locks.
    std::function<void()> on_changed;
  };
  // Every pointer must outlive the ingest.
  explicit Ingest(Deps deps);

  // See AgentService.AcquireStagingLease. Validates the request, refuses a
  // shard already committed here or leased by another live client, checks
  // the base versions are held, looks up the job's world size (at meta only
  // for the job's first lease here, never with `without_meta`: Unavailable
  // then), queues the version's Begin (unless begin_at_commit) and reserves
  // the space. Errors: InvalidArgument (bad id, size, rank),
  // ResourceExhausted (the budget message), AlreadyExists (committed here),
  // FailedPrecondition (a session not open, another holder's lease, a base
  // not held), Unavailable (Stop was called; meta unreachable), meta's
  // refusal of the job. Blocks on meta only for the job's first lease.
  absl::StatusOr<LeaseGrant> AcquireLease(const LeaseRequest& request);
  // See AgentService.CommitShard: validates the manifest and its references
  // (CheckRefs), records the copy, queues its verification, the version's
  // Begin (a begin_at_commit lease) and the STAGED report; never waits for
  // meta. AlreadyExists for a lease committed before. A pull-mode agent
  // first reads the bytes from `pull` (required there, refused otherwise)
  // and checks every item's crc32c: Unavailable if the read fails, DataLoss
  // if an item does not match. A commit that fails validation leaves the
  // lease open. `session_id`: the committing call's client session ("" for
  // none); LeaseTable::BeginCommit's errors.
  absl::StatusOr<std::shared_ptr<const ShardRecord>> Commit(const std::string& lease_id, uint64_t size_bytes,
                                                            std::vector<ManifestItem> items,
                                                            const PullSource* pull = nullptr,
                                                            const std::string& session_id = "");

  // Meta refused version (job, step, run_id) for good: it is no longer
  // begun here, and this node's primaries of it are dropped.
  void OnVersionRefused(const std::string& job, uint64_t step, const std::string& run_id);
  // Meta refused the report `r` of a shard copy with `why`. A STAGED report
  // refused because a base version it refers to is gone there
  // (IsMissingBaseRefusal) is stored self-contained when the bases are still
  // pinned (CompactRefused); otherwise, or if that fails, the copy is
  // dropped. Nothing happens if the copy held now is another one (another
  // crc).
  void OnShardRefused(const HoldingReport& r, const absl::Status& why);

  // Why the memory tier cannot take `want` more bytes now: its free space,
  // what holds the rest (holdings, open leases) and what to do about it (the
  // message of every ResourceExhausted of the agent's memory budget).
  std::string BudgetMessage(uint64_t want) const;

  // The pull token of a lease and the deliver token of a handle
  // (kPullTokenBytes): HMAC-SHA256 of the id under this process's key.
  // Derived, not stored: worthless for any other id.
  std::string PullToken(const std::string& lease_id) const;
  std::string DeliverToken(const std::string& handle_id) const;

  // New leases are refused (Unavailable) from now on. Idempotent.
  void Stop();

  // ---- parts of the save path (public for tests) ----
  // The references among `items` (a commit of `id`) each name an item of
  // the same rank's shard of their ref_step held here (same offset, length
  // and crc32c): FailedPrecondition if that shard is not held,
  // InvalidArgument if it has no such item. The base shards are pinned into
  // *bases (their bytes stay while the pins live, even if meta has them
  // dropped meanwhile).
  absl::Status CheckRefs(const ShardId& id, const std::vector<ManifestItem>& items, std::vector<Pin>* bases) const;
  // Replaces the held copy of `rec` (a committed shard with references) by a
  // self-contained one: the referred items are copied from `bases` after
  // the shard's own bytes, and the new copy is queued for verification and
  // reported STAGED. FailedPrecondition (the copy was replaced meanwhile, a
  // base not pinned), ResourceExhausted (no memory), DataLoss (a base item's
  // crc wrong), InvalidArgument (sizes overflow); the caller then drops the
  // shard. Copies without any lock.
  absl::Status CompactRefused(const ShardRecord& rec, const std::vector<Pin>& bases);

 private:
  // Pull-mode ingest: reads the lease's bytes from the client's staging
  // memory and checks each of the shard's own items against its crc32c.
  absl::Status PullInto(const CommittingLease& l, const std::vector<ManifestItem>& items, const PullSource& pull);
  void Changed();  // deps_.on_changed

  const Deps deps_;
  const std::string token_key_ = RandomBytes(32);  // 256 random bits, this process's

  mutable absl::Mutex jobs_mu_;
  bool stopping_ ABSL_GUARDED_BY(jobs_mu_) = false;
  // (job, step, run_id) begun at meta, with the job's world size.
  std::map<std::tuple<std::string, uint64_t, std::string>, uint32_t> begun_ ABSL_GUARDED_BY(jobs_mu_);
  std::map<std::string, uint32_t> job_world_ ABSL_GUARDED_BY(jobs_mu_);

  // The base shards of committed shards with references, pinned until meta
  // answers their STAGED report. Shared with the reports' completion
  // callbacks, which release them.
  struct BasePins {
    absl::Mutex mu;
    std::map<ShardId, std::pair<uint32_t, std::vector<Pin>>> by_shard ABSL_GUARDED_BY(mu);  // crc, pins
    // The pins of `id`'s copy with `crc32c` (none if another copy's).
    std::vector<Pin> Take(const ShardId& id, uint32_t crc32c);
  };
  const std::shared_ptr<BasePins> base_pins_ = std::make_shared<BasePins>();
};

}  // namespace ckpt::agent
