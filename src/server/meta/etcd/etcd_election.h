// EtcdElection: leader election on etcd, after etcd's v3 election
// (go.etcd.io/etcd/clientv3/concurrency/election.go).
//
// Each candidate puts a key "<prefix>/<lease id in hex>" attached to its
// session's lease. etcd gives every creation a new revision, so the keys
// under the prefix form a queue: the leader is the key with the lowest
// create_revision. A candidate whose key is not the lowest waits (a watch, no
// polling) for the deletion of the key just before its own -- its
// predecessor's, not the leader's, so a departure wakes one candidate, not all
// -- and then looks again. A key goes when its owner resigns, or when its
// lease expires because the owner died or lost etcd: that is how a dead
// leader is replaced.
//
// Fencing: leadership is a belief that can be stale (a paused leader wakes up
// after its lease expired). FencedTxn() makes a write conditional on our key
// still existing with our create_revision, in the same etcd transaction, so a
// deposed leader's write fails (FAILED_PRECONDITION) instead of landing after
// the new leader's. Appending to a replicated log through FencedTxn is the
// "append only if I am still leader" pattern.
//
//   auto session = EtcdSession::Create(etcd.get(), absl::Seconds(5));
//   EtcdElection election(etcd.get(), session->get(), "/ckpt/c1/leader");
//   CKPT_RETURN_IF_ERROR(election.Campaign("meta-1:7000", absl::Minutes(1)));
//   EtcdTxn append;  append.success.push_back(EtcdOp::Put("/ckpt/c1/log/00000042", batch));
//   CKPT_ASSIGN_OR_RETURN(EtcdTxnResult r, election.FencedTxn(append));   // or step down
//
// Thread safety: one thread at a time per EtcdElection (campaign, then write
// from the same owner); Leader() may be called from any thread. The client
// and the session must outlive it.
#pragma once

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/meta/etcd/etcd_client.h"
#include "server/meta/etcd/etcd_session.h"

namespace ckpt::meta {

class EtcdElection {
 public:
  // `prefix` names the election, e.g. "/ckpt/<cluster>/leader" (no trailing
  // '/'); candidates' keys are prefix + "/" + hex lease id.
  EtcdElection(EtcdClient* client, EtcdSession* session, std::string prefix);

  // Enters the election with `value` (e.g. our address; Leader() shows it)
  // and blocks until we lead. Re-entrant: after a DEADLINE_EXCEEDED the key
  // stays in the queue, and calling again goes on waiting with it.
  // OK: we are the leader (until the session is lost or we resign).
  // DEADLINE_EXCEEDED: not leader within `timeout`. FAILED_PRECONDITION: the
  // session is lost, or our key was deleted under us. Other etcd errors as
  // EtcdClient's (a watch that broke is re-made; the error is returned only
  // if etcd cannot be reached until the timeout).
  absl::Status Campaign(const std::string& value, absl::Duration timeout);

  // The current leader's key and value: the oldest key under the prefix.
  // NOT_FOUND if there is no candidate.
  absl::StatusOr<EtcdKeyValue> Leader();

  // Leaves the election: deletes our key (if we put one), which hands the
  // leadership to the next candidate at once. OK if we had no key.
  absl::Status Resign();

  // `txn` with one more comparison in front: our key exists with the
  // create_revision it had when we campaigned (such a key is never re-created
  // with the same revision, so this holds exactly while we have not resigned
  // or lost the lease). Campaign() must have returned OK before: the fence
  // proves the key, not that it was the oldest.
  // OK with the result when the fence held (succeeded tells whether the
  // caller's own comparisons held too). FAILED_PRECONDITION naming our key if
  // the fence failed: we are no longer the leader (the failure ops ran, if
  // any); also before any Campaign. Errors of etcd as EtcdClient::Txn.
  absl::StatusOr<EtcdTxnResult> FencedTxn(EtcdTxn txn);

  // Our key (fixed by the session's lease) and its create_revision (0 before
  // Campaign put it).
  std::string key() const;
  int64_t create_revision() const;

 private:
  // Puts our key if it is not there yet; records its create_revision.
  absl::Status Enter(const std::string& value);
  // Waits until no key older than ours remains, or the deadline.
  absl::Status WaitForPredecessors(absl::Time deadline);

  EtcdClient* const client_;
  EtcdSession* const session_;
  const std::string prefix_;
  const std::string key_;

  mutable absl::Mutex mu_;  // only for key()/create_revision() from other threads
  int64_t create_revision_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt::meta
