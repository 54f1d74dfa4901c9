// LeaseTable: what local clients hold: staging leases (pool space a trainer
// is copying a shard into, not yet committed) and open handles (pins on
// committed copies a trainer maps read-only).
//
// Ownership. A lease owns its pool space (a Reservation) until it is
// committed (the space moves to a holding), aborted, replaced by a new lease
// for the same rank, or expired. A handle owns a Pin: the copy's bytes stay
// allocated while the handle is open, even if the holding is dropped.
// Liveness: a lease or handle lives until its ttl passes or its client is
// known to be gone (Expire; see docs/agent.md "Client sessions").
//
// Ids and holders (docs/security.md "Ids and tokens"). Lease and handle ids
// are 128 random bits (common/crypto.h RandomId), so nobody guesses one; and
// each belongs to the client session that took it (ClientRef::session_id):
// only a call naming that same session may commit, abort, close or deliver
// it (PermissionDenied otherwise, and nothing changes). Calls without a
// session (gRPC with no session_id: tools, tests) form one holder of their
// own: what they take, only calls without a session use. A new lease for a
// (job, step, rank) replaces an uncommitted one of the same holder (a
// trainer that lost its lease id asks again); another holder's only once
// that holder is no longer connected (its session's connection closed: the
// client exited, crashed or was killed, and the lease would go with the
// session's grace period anyway; or the ttl of a lease taken without a
// session passed). While the holder is connected, the new lease is refused
// (FailedPrecondition naming the holder's pid, never its ids): a restarted
// trainer never waits for its predecessor's grace period, and no live
// trainer loses its lease to another.
//
// Locking: one mutex over the maps, never held across I/O or calls into
// other components; space is released after the lock is dropped.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/agent/agent_metrics.h"
#include "server/agent/holdings.h"

namespace ckpt::agent {

// A region of the pool file a client maps.
struct Region {
  std::string path;
  uint64_t file_offset = 0;
  uint64_t length = 0;
  uint64_t shard_offset = 0;
};
std::vector<Region> RegionsOf(const std::string& pool_path, const std::vector<Extent>& extents, uint64_t size);

// Where a client stands, as the agent's sessions know it.
enum class ClientState {
  kConnected,     // its session is open (or it has none: its ttl rules)
  kDisconnected,  // its session's connection closed, within the grace period
  kGone,          // its session ended: what it held is released
};

// Who a lease or handle belongs to.
struct ClientRef {
  uint32_t pid = 0;         // as the client said (for messages; 0: unknown)
  std::string session_id;   // the client's session (empty: none)
};

// An id (lease, handle, session) as logs and messages show it: its first
// characters, enough to tell ids apart, too few to use one.
std::string IdForLog(const std::string& id);

// A lease being committed: its shard, size and space (still owned by the
// table until FinishCommit).
struct CommittingLease {
  std::string lease_id;
  ShardId shard;
  uint64_t size_bytes = 0;
  std::string run_id;
  ReservationPtr bytes;
};

class LeaseTable {
 public:
  // `state(client)` says where a client stands (a client without a session:
  // kConnected); called without the table's lock. Expire releases what a
  // kGone client held; a lease of a client that is not kConnected may be
  // replaced by another's.
  using StateFn = std::function<ClientState(const ClientRef&)>;
  LeaseTable(Clock* clock, AgentMetrics* metrics, StateFn state);

  // OK if `client` may take a lease for `shard` now: no uncommitted lease of
  // another connected holder is open for it (see the file comment).
  // Otherwise FailedPrecondition naming the holder's pid (never its session
  // or lease id). Add checks the same again; this lets a caller refuse
  // before it does anything else. Blocks only on `state` (without the lock).
  absl::Status MayLease(const ShardId& shard, const ClientRef& client) const;
  // Adds a lease for `shard` over `bytes`, replacing (and releasing) an
  // older uncommitted lease for the same shard of the same holder, or of a
  // holder no longer connected. Returns the new lease id (RandomId "l-").
  // FailedPrecondition as MayLease (then `bytes` is released and nothing
  // else changes). `ahead`: asked for ahead of its save (begin_at_commit;
  // counted apart in LeasedAheadBytes).
  absl::StatusOr<std::string> Add(const ShardId& shard, uint64_t size_bytes, ReservationPtr bytes,
                                  const std::string& run_id, const ClientRef& client, absl::Duration ttl,
                                  bool ahead = false);
  // Marks the lease as being committed with `size_bytes` (0: the lease's
  // size), returns the pages past it to the arena, and returns the lease.
  // `session_id`: the committing call's session ("" for none).
  // PermissionDenied (the lease, or the commit that consumed it, is another
  // holder's: nothing changes), FailedPrecondition (unknown, aborted,
  // expired), AlreadyExists (committed before by this holder), Aborted (a
  // commit of it is in progress), InvalidArgument (size over the lease's).
  absl::StatusOr<CommittingLease> BeginCommit(const std::string& lease_id, uint64_t size_bytes,
                                              const std::string& session_id);
  // Ends a commit: the lease goes away (kept: its space now belongs to a
  // holding). False if the lease vanished meanwhile (replaced or expired).
  bool FinishCommit(const std::string& lease_id, const ShardId& shard);
  // A commit that failed validation: the lease stays usable (at the size
  // BeginCommit trimmed it to).
  void CancelCommit(const std::string& lease_id);
  // Releases an uncommitted lease for a call of session `session_id` ("":
  // none). OK for an unknown id (aborted or expired before).
  // PermissionDenied (another holder's), FailedPrecondition if it was
  // committed (or is being committed).
  absl::Status Abort(const std::string& lease_id, const std::string& session_id);

  // Opens a handle on a pinned copy. Returns its id (RandomId "h-").
  std::string OpenHandle(const ShardId& shard, Pin pin, const ClientRef& client, absl::Duration ttl);
  // Closes a handle for a call of session `session_id` ("": none). OK for
  // an unknown id (closed before); PermissionDenied if the handle is another
  // holder's (it stays open).
  absl::Status CloseHandle(const std::string& handle_id, const std::string& session_id);
  // The agent's own close of a handle it just opened (any holder's; unknown
  // ids are fine).
  void CloseHandle(const std::string& handle_id);
  // The pin an open handle holds (a copy: the bytes stay while it lives),
  // for a call of session `session_id`. NotFound for an unknown or closed
  // handle, PermissionDenied for another holder's.
  absl::StatusOr<Pin> HandlePin(const std::string& handle_id, const std::string& session_id) const;

  // Releases leases and handles whose ttl passed or whose client is gone.
  // Returns how many were released.
  int Expire();
  // Releases everything of a client session (it disconnected for good).
  int ReleaseSession(const std::string& session_id);

  uint64_t LeasedBytes() const;
  // Of which leases asked for ahead of their save (Add's `ahead`).
  uint64_t LeasedAheadBytes() const;
  uint32_t lease_count() const;
  uint32_t handle_count() const;

 private:
  struct Lease {
    ShardId shard;
    uint64_t size_bytes = 0;
    ReservationPtr bytes;
    std::string run_id;
    ClientRef client;
    absl::Time expires;
    bool committing = false;
    bool ahead = false;
  };
  struct Handle {
    ShardId shard;
    Pin pin;
    ClientRef client;
    absl::Time expires;
  };
  // A lease committed, kept for replays of its commit.
  struct Committed {
    ShardId shard;
    std::string session_id;  // its holder's
  };
  // A lease of another holder that stands in the way of a new one.
  struct Holder {
    std::string lease_id;
    ClientRef client;
    bool committing = false;
    absl::Duration ttl_left;  // a lease without a session: until it expires
  };
  // A new id with `prefix` that no lease or handle has.
  std::string NewId(const char* prefix) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The uncommitted lease of `shard` that `client` may not replace without
  // asking whether its holder is gone: another holder's, and not expired.
  std::optional<Holder> OtherHolder(const ShardId& shard, const ClientRef& client) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether another client may replace a lease of `holder` (not
  // kConnected). Calls state_: never under the lock.
  bool Replaceable(const ClientRef& holder) const;
  // The refusal of a lease for `shard` that `holder` holds.
  static absl::Status HeldBy(const ShardId& shard, const Holder& holder);

  Clock* const clock_;
  AgentMetrics* const metrics_;
  const StateFn state_;

  mutable absl::Mutex mu_;
  std::map<std::string, Lease> leases_ ABSL_GUARDED_BY(mu_);
  std::map<ShardId, std::string> lease_of_shard_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Committed> committed_ ABSL_GUARDED_BY(mu_);  // recent commits, for replays
  std::deque<std::string> committed_order_ ABSL_GUARDED_BY(mu_);     // their ids, oldest first
  std::map<std::string, Handle> handles_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::agent
