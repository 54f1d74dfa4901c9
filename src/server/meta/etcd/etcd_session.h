// EtcdSession: an etcd lease kept alive by a thread of its own, the "session"
// of etcd's v3 concurrency pattern. Keys put with lease_id() live as long as
// the process keeps refreshing: when it dies (kill -9, machine lost, cut from
// etcd) they vanish about a TTL later, and another replica can take over.
//
//   CKPT_ASSIGN_OR_RETURN(auto session, EtcdSession::Create(etcd.get(), absl::Seconds(5)));
//   ... etcd->Put(key, value, session->lease_id()) ...
//   if (!session->status().ok()) { /* step down: the lease may be gone */ }
//   CKPT_RETURN_IF_ERROR(session->Close());   // revoke: our keys go at once
//
// The thread refreshes every ttl/3 (LeaseKeepAliveOnce, each with a deadline).
// The session counts as lost, for good, when etcd says the lease is gone, or
// when no refresh has succeeded for a whole TTL counted from the moment the
// last successful refresh was *sent* (so this process gives up no later than
// etcd expires the lease: it never believes in a lease etcd has dropped,
// clock rates aside). Times are the machine's monotonic clock via absl::Now().
//
// Thread safety: thread-safe. The EtcdClient must outlive the session.
#pragma once

#include <cstdint>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/meta/etcd/etcd_client.h"

namespace ckpt::meta {

class EtcdSession {
 public:
  // Grants a lease of `ttl` (etcd rounds it up to whole seconds and to its
  // minimum) and starts keeping it alive. Errors: LeaseGrant's.
  static absl::StatusOr<std::unique_ptr<EtcdSession>> Create(EtcdClient* client, absl::Duration ttl);
  // Stops refreshing (Abandon()); does not revoke.
  ~EtcdSession();
  EtcdSession(const EtcdSession&) = delete;
  EtcdSession& operator=(const EtcdSession&) = delete;

  int64_t lease_id() const { return lease_id_; }
  absl::Duration ttl() const { return ttl_; }

  // OK while the lease is held; once lost, why (FAILED_PRECONDITION naming the
  // lease, with etcd's error or how long since the last refresh), for good.
  absl::Status status() const;
  // Until when the lease is surely held (the last refresh's send time plus
  // the TTL); absl::InfinitePast() once lost.
  absl::Time held_until() const;
  // Blocks until the session is lost or `timeout` passes; returns status().
  absl::Status WaitLost(absl::Duration timeout) const;

  // Stops refreshing and revokes the lease, deleting its keys now. The
  // session is lost afterwards. Errors: LeaseRevoke's (NOT_FOUND if it had
  // expired already).
  absl::Status Close();
  // Stops refreshing without revoking: the lease expires a TTL after its last
  // refresh, as if this process had died. The session is lost afterwards.
  void Abandon();

 private:
  EtcdSession(EtcdClient* client, int64_t lease_id, absl::Duration ttl);
  void Run();
  void StopThread();
  void MarkLost(absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool StoppingOrLost() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || !status_.ok(); }
  bool Lost() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !status_.ok(); }

  EtcdClient* const client_;
  const int64_t lease_id_;
  const absl::Duration ttl_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  absl::Time held_until_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::meta
