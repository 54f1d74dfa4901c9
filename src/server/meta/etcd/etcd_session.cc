#include "server/meta/etcd/etcd_session.h"

#include <pthread.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace ckpt::meta {

absl::StatusOr<std::unique_ptr<EtcdSession>> EtcdSession::Create(EtcdClient* client, absl::Duration ttl) {
  const absl::Time sent = absl::Now();
  absl::StatusOr<EtcdLeaseGrant> grant = client->LeaseGrant(ttl);
  if (!grant.ok()) return grant.status();
  std::unique_ptr<EtcdSession> session(new EtcdSession(client, grant->id, grant->ttl));
  {
    absl::MutexLock lock(&session->mu_);
    session->held_until_ = sent + grant->ttl;
  }
  EtcdSession* raw = session.get();
  session->thread_ = std::thread([raw] { raw->Run(); });
  return session;
}

EtcdSession::EtcdSession(EtcdClient* client, int64_t lease_id, absl::Duration ttl)
    : client_(client), lease_id_(lease_id), ttl_(ttl) {}

EtcdSession::~EtcdSession() { Abandon(); }

void EtcdSession::MarkLost(absl::Status why) {
  if (status_.ok()) status_ = std::move(why);
  held_until_ = absl::InfinitePast();
}

absl::Status EtcdSession::status() const {
  absl::MutexLock lock(&mu_);
  if (!status_.ok()) return status_;
  if (absl::Now() >= held_until_) {
    return absl::FailedPreconditionError(absl::StrCat("etcd lease ", absl::Hex(lease_id_), ": no refresh for ",
                                                      absl::FormatDuration(ttl_), " (its TTL): it may have expired"));
  }
  return absl::OkStatus();
}

absl::Time EtcdSession::held_until() const {
  absl::MutexLock lock(&mu_);
  return held_until_;
}

absl::Status EtcdSession::WaitLost(absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::Status s = status();
    if (!s.ok() || absl::Now() >= deadline) return s;
    absl::MutexLock lock(&mu_);
    // Wake when marked lost, or when the lease runs out by the clock.
    mu_.AwaitWithDeadline(absl::Condition(this, &EtcdSession::Lost), std::min(deadline, held_until_));
  }
}

void EtcdSession::Run() {
  pthread_setname_np(pthread_self(), "etcd-lease");
  absl::Duration interval = ttl_ / 3;
  // One refresh may take a quarter of the TTL: a member that does not answer
  // by then (cut off, or in a minority that cannot reach etcd's leader) is
  // left for the next one (EtcdClient moves on) while the lease still holds.
  const absl::Duration attempt = std::max(ttl_ / 4, absl::Milliseconds(250));
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(this, &EtcdSession::StoppingOrLost), interval);
      if (stopping_ || !status_.ok()) return;
      if (absl::Now() >= held_until_) {
        MarkLost(absl::FailedPreconditionError(absl::StrCat("etcd lease ", absl::Hex(lease_id_),
                                                            ": no refresh succeeded for ",
                                                            absl::FormatDuration(ttl_), " (its TTL)")));
        return;
      }
    }
    const absl::Time sent = absl::Now();
    absl::StatusOr<absl::Duration> refreshed = client_->LeaseKeepAliveOnce(lease_id_, attempt);  // no lock held
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    if (refreshed.ok()) {
      held_until_ = std::max(held_until_, sent + *refreshed);
      interval = ttl_ / 3;
    } else if (absl::IsNotFound(refreshed.status())) {
      MarkLost(absl::FailedPreconditionError(refreshed.status().message()));
      return;
    } else {
      // etcd unreachable or slow: retry soon (on the next member), until the
      // lease runs out.
      interval = std::min(ttl_ / 3, absl::Milliseconds(100));
      if (absl::Now() >= held_until_) {
        MarkLost(absl::FailedPreconditionError(absl::StrCat("etcd lease ", absl::Hex(lease_id_),
                                                            ": no refresh succeeded for ", absl::FormatDuration(ttl_),
                                                            " (its TTL); last error: ",
                                                            refreshed.status().ToString())));
        return;
      }
    }
  }
}

void EtcdSession::StopThread() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void EtcdSession::Abandon() {
  StopThread();
  absl::MutexLock lock(&mu_);
  MarkLost(absl::FailedPreconditionError(absl::StrCat("etcd lease ", absl::Hex(lease_id_), ": abandoned")));
}

absl::Status EtcdSession::Close() {
  StopThread();
  {
    absl::MutexLock lock(&mu_);
    MarkLost(absl::FailedPreconditionError(absl::StrCat("etcd lease ", absl::Hex(lease_id_), ": closed")));
  }
  return client_->LeaseRevoke(lease_id_);
}

}  // namespace ckpt::meta
