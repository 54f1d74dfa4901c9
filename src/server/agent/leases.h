// LeaseTable: what local clients hold: staging leases (pool space a trainer
// is copying a shard into, not yet committed) and open handles (pins on
// committed copies a trainer maps read-only).
//
// Ownership. A lease owns its pool space (a Reservation) until it is
// committed (the space moves to a holding), aborted, replaced by a new lease
// for the same rank, or expired. A handle owns a Pin: the copy's bytes stay
// allocated while the handle is open, even if the holding is dropped.
// Liveness: a lease or handle lives until its ttl passes or its client is
// known to be gone (Expire; see docs/agent.md "Leases and handles").
//
// Locking: one mutex over the maps, never held across I/O or calls into
// other components; space is released after the lock is dropped.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
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

// Who a lease or handle belongs to.
struct ClientRef {
  uint32_t pid = 0;         // 0: unknown (no liveness check by pid)
  std::string session_id;   // the client's session (empty: none)
};

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
  // `is_gone(client)` says whether a client is known to be gone; called
  // without the table's lock.
  using GoneFn = std::function<bool(const ClientRef&)>;
  LeaseTable(Clock* clock, AgentMetrics* metrics, GoneFn is_gone);

  // Adds a lease for `shard` over `bytes`, replacing (and releasing) an
  // older uncommitted lease for the same shard. Returns the new lease id.
  // `ahead`: asked for ahead of its save (begin_at_commit; counted apart in
  // LeasedAheadBytes).
  std::string Add(const ShardId& shard, uint64_t size_bytes, ReservationPtr bytes, const std::string& run_id,
                  const ClientRef& client, absl::Duration ttl, bool ahead = false);
  // Marks the lease as being committed with `size_bytes` (0: the lease's
  // size), returns the pages past it to the arena, and returns the lease.
  // FailedPrecondition (unknown, aborted, expired), AlreadyExists (committed
  // before), Aborted (a commit of it is in progress), InvalidArgument (size
  // over the lease's).
  absl::StatusOr<CommittingLease> BeginCommit(const std::string& lease_id, uint64_t size_bytes);
  // Ends a commit: the lease goes away (kept: its space now belongs to a
  // holding). False if the lease vanished meanwhile (replaced or expired).
  bool FinishCommit(const std::string& lease_id, const ShardId& shard);
  // A commit that failed validation: the lease stays usable (at the size
  // BeginCommit trimmed it to).
  void CancelCommit(const std::string& lease_id);
  // Releases an uncommitted lease. FailedPrecondition if it was committed.
  absl::Status Abort(const std::string& lease_id);

  // Opens a handle on a pinned copy. Returns its id.
  std::string OpenHandle(const ShardId& shard, Pin pin, const ClientRef& client, absl::Duration ttl);
  // Closes a handle (unknown ids are fine).
  void CloseHandle(const std::string& handle_id);
  // The pin an open handle holds (a copy: the bytes stay while it lives).
  // NotFound for an unknown or closed handle.
  absl::StatusOr<Pin> HandlePin(const std::string& handle_id) const;

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
  std::string NewId(const char* prefix) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Clock* const clock_;
  AgentMetrics* const metrics_;
  const GoneFn is_gone_;

  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, Lease> leases_ ABSL_GUARDED_BY(mu_);
  std::map<ShardId, std::string> lease_of_shard_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, ShardId> committed_ ABSL_GUARDED_BY(mu_);  // recent commits, for replays
  std::map<std::string, Handle> handles_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::agent
