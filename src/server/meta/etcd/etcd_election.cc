#include "server/meta/etcd/etcd_election.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace ckpt::meta {
namespace {

bool Retryable(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
}

}  // namespace

EtcdElection::EtcdElection(EtcdClient* client, EtcdSession* session, std::string prefix)
    : client_(client),
      session_(session),
      prefix_(std::move(prefix)),
      key_(absl::StrCat(prefix_, "/", absl::Hex(session->lease_id()))) {}

std::string EtcdElection::key() const { return key_; }

int64_t EtcdElection::create_revision() const {
  absl::MutexLock lock(&mu_);
  return create_revision_;
}

absl::Status EtcdElection::Enter(const std::string& value) {
  if (create_revision() != 0) return absl::OkStatus();  // already queued: WaitForPredecessors checks the key
  EtcdTxn txn;
  txn.compare.push_back(EtcdCompare::CreateRevision(key_, EtcdCompare::Result::kEqual, 0));
  txn.success.push_back(EtcdOp::Put(key_, value, session_->lease_id()));
  txn.failure.push_back(EtcdOp::Get(key_));
  absl::StatusOr<EtcdTxnResult> r = client_->Txn(txn);
  if (!r.ok()) return r.status();
  int64_t rev = r->revision;
  if (!r->succeeded) {
    // Our lease's key exists already (another EtcdElection on the same
    // session and prefix, or a retry after a lost answer): keep its place.
    if (r->results.empty() || r->results[0].kvs.empty()) {
      return absl::AbortedError(absl::StrCat("election ", prefix_, ": key ", key_, " vanished while entering"));
    }
    const EtcdKeyValue& kv = r->results[0].kvs[0];
    rev = kv.create_revision;
    if (kv.value != value) {
      absl::StatusOr<int64_t> put = client_->Put(key_, value, session_->lease_id());  // keeps create_revision
      if (!put.ok()) return put.status();
    }
  }
  absl::MutexLock lock(&mu_);
  create_revision_ = rev;
  return absl::OkStatus();
}

absl::Status EtcdElection::Campaign(const std::string& value, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last;
  while (true) {
    absl::Status s = session_->status();
    if (!s.ok()) return absl::FailedPreconditionError(absl::StrCat("election ", prefix_, ": ", s.message()));
    s = Enter(value);
    if (s.ok()) return WaitForPredecessors(deadline);
    if (!Retryable(s) || absl::Now() >= deadline) return s;
    absl::SleepFor(std::min(absl::Milliseconds(200), deadline - absl::Now()));
  }
}

absl::Status EtcdElection::WaitForPredecessors(absl::Time deadline) {
  const int64_t my_rev = create_revision();
  const std::string dir = prefix_ + "/";
  absl::Status last_error;
  while (true) {
    absl::Status s = session_->status();
    if (!s.ok()) return absl::FailedPreconditionError(absl::StrCat("election ", prefix_, ": ", s.message()));
    if (absl::Now() >= deadline) break;
    // Our key and the one created just before it, in one read.
    EtcdRange range;
    range.range_end = EtcdPrefixEnd(dir);
    range.max_create_revision = my_rev;
    range.sort_target = EtcdRange::SortTarget::kCreateRevision;
    range.sort_order = EtcdRange::SortOrder::kDescend;
    range.limit = 2;
    absl::StatusOr<EtcdRangeResult> r = client_->Range(dir, range);
    if (!r.ok()) {
      if (!Retryable(r.status())) return r.status();
      last_error = r.status();
      absl::SleepFor(std::min(absl::Milliseconds(200), std::max(absl::ZeroDuration(), deadline - absl::Now())));
      continue;
    }
    if (r->kvs.empty() || r->kvs[0].key != key_ || r->kvs[0].create_revision != my_rev) {
      return absl::FailedPreconditionError(absl::StrCat("election ", prefix_, ": our key ", key_,
                                                        " (create_revision ", my_rev,
                                                        ") was deleted: the lease expired or someone removed it"));
    }
    if (r->kvs.size() == 1) return absl::OkStatus();  // nobody older: we lead
    const std::string predecessor = r->kvs[1].key;
    absl::StatusOr<std::unique_ptr<EtcdWatch>> watch = client_->Watch(predecessor, "", r->revision + 1);
    if (!watch.ok()) {
      if (!Retryable(watch.status())) return watch.status();
      last_error = watch.status();
      absl::SleepFor(std::min(absl::Milliseconds(200), std::max(absl::ZeroDuration(), deadline - absl::Now())));
      continue;
    }
    bool gone = false;
    while (!gone) {
      s = session_->status();
      if (!s.ok()) return absl::FailedPreconditionError(absl::StrCat("election ", prefix_, ": ", s.message()));
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) break;
      // Slices of at most a second, so a lost session is noticed while waiting.
      absl::StatusOr<std::vector<EtcdEvent>> events = (*watch)->Next(std::min(left, absl::Seconds(1)));
      if (absl::IsDeadlineExceeded(events.status())) continue;
      if (!events.ok()) {  // the watch ended: look again
        last_error = events.status();
        break;
      }
      for (const EtcdEvent& e : *events) gone = gone || e.type == EtcdEvent::Type::kDelete;
    }
    if (!gone && absl::Now() >= deadline) break;
  }
  absl::StatusOr<EtcdKeyValue> leader = Leader();
  return absl::DeadlineExceededError(absl::StrCat(
      "election ", prefix_, ": not the leader by the deadline; leader: ",
      leader.ok() ? absl::StrCat(leader->key, " (", absl::CHexEscape(leader->value), ")") : leader.status().ToString(),
      last_error.ok() ? "" : absl::StrCat("; last etcd error: ", last_error.ToString())));
}

absl::StatusOr<EtcdKeyValue> EtcdElection::Leader() {
  const std::string dir = prefix_ + "/";
  EtcdRange range;
  range.range_end = EtcdPrefixEnd(dir);
  range.sort_target = EtcdRange::SortTarget::kCreateRevision;
  range.sort_order = EtcdRange::SortOrder::kAscend;
  range.limit = 1;
  absl::StatusOr<EtcdRangeResult> r = client_->Range(dir, range);
  if (!r.ok()) return r.status();
  if (r->kvs.empty()) return absl::NotFoundError(absl::StrCat("election ", prefix_, ": no candidate"));
  return std::move(r->kvs[0]);
}

absl::Status EtcdElection::Resign() {
  const int64_t rev = create_revision();
  if (rev == 0) return absl::OkStatus();
  // Delete our key only if it is still ours (not re-created by another
  // election on the same lease).
  EtcdTxn txn;
  txn.compare.push_back(EtcdCompare::CreateRevision(key_, EtcdCompare::Result::kEqual, rev));
  txn.success.push_back(EtcdOp::Delete(key_));
  absl::StatusOr<EtcdTxnResult> r = client_->Txn(txn);
  if (!r.ok()) return r.status();
  absl::MutexLock lock(&mu_);
  create_revision_ = 0;
  return absl::OkStatus();
}

absl::StatusOr<EtcdTxnResult> EtcdElection::FencedTxn(EtcdTxn txn) {
  const int64_t rev = create_revision();
  if (rev == 0) {
    return absl::FailedPreconditionError(absl::StrCat("election ", prefix_, ": not a candidate (no Campaign)"));
  }
  // A lease we can no longer vouch for: the fence would refuse the txn, if
  // etcd could be reached at all; say so now rather than after a deadline.
  if (absl::Status s = session_->status(); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("election ", prefix_, ": not the leader: ", s.message()));
  }
  txn.compare.insert(txn.compare.begin(), EtcdCompare::CreateRevision(key_, EtcdCompare::Result::kEqual, rev));
  // No longer than the lease is known to hold (at least 100 ms): a write
  // stuck on a member that cannot answer would otherwise outlast it, and the
  // leader's step-down with it.
  const absl::Duration left = std::max(session_->held_until() - absl::Now(), absl::Milliseconds(100));
  absl::StatusOr<EtcdTxnResult> r = client_->Txn(txn, left);
  if (!r.ok()) return r.status();
  if (!r->succeeded) {
    // The caller's own comparisons may have failed too; tell which.
    absl::StatusOr<std::optional<EtcdKeyValue>> mine = client_->Get(key_);
    // A create_revision is never reused, so our key seen now means it was
    // there at the txn: the caller's comparisons failed, not the fence.
    if (!mine.ok()) return mine.status();
    if (mine->has_value() && (*mine)->create_revision == rev) return r;
    return absl::FailedPreconditionError(absl::StrCat("election ", prefix_, ": not the leader: our key ", key_,
                                                      " (create_revision ", rev, ") is gone"));
  }
  return r;
}

}  // namespace ckpt::meta
