#include "server/agent/leases.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crypto.h"
#include "common/lock_check.h"
#include "common/log.h"

namespace ckpt::agent {
namespace {
constexpr size_t kCommittedLeaseMemory = 4096;
}  // namespace

std::vector<Region> RegionsOf(const std::string& pool_path, const std::vector<Extent>& extents, uint64_t size) {
  std::vector<Region> out;
  uint64_t shard_off = 0;
  for (const Extent& e : extents) {
    if (shard_off >= size) break;
    const uint64_t len = std::min(e.length, size - shard_off);
    out.push_back(Region{pool_path, e.offset, len, shard_off});
    shard_off += len;
  }
  return out;
}

LeaseTable::LeaseTable(Clock* clock, AgentMetrics* metrics, StateFn state)
    : clock_(clock), metrics_(metrics), state_(std::move(state)) {}

std::string IdForLog(const std::string& id) {
  // The prefix ("l-", "h-") and 8 hex digits: 32 of the 128 random bits.
  const size_t keep = id.find('-') == 1 ? 10 : 8;
  return id.size() <= keep ? id : absl::StrCat(id.substr(0, keep), "...");
}

std::string LeaseTable::NewId(const char* prefix) const {
  std::string id;
  do {
    id = RandomId(prefix);
  } while (leases_.count(id) != 0 || handles_.count(id) != 0 || committed_.count(id) != 0);
  return id;
}

namespace {

// Whether a call of session `session_id` acts for the holder of `held`.
bool SameHolder(const ClientRef& held, const std::string& session_id) { return held.session_id == session_id; }

// The refusal of a call of session `session_id` on `what` ("lease", "shard
// handle") of another holder.
absl::Status NotYours(const char* what, const std::string& id, const ClientRef& held, const std::string& session_id) {
  if (held.session_id.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(what, " ", IdForLog(id),
                                                    " was taken by a call without a client session: only calls "
                                                    "without a session_id may use it"));
  }
  return absl::PermissionDeniedError(absl::StrCat(
      what, " ", IdForLog(id), " belongs to another client session (pid ", held.pid,
      "): only the session that took it may use it", session_id.empty() ? " (this call names no session_id)" : ""));
}

}  // namespace

std::optional<LeaseTable::Holder> LeaseTable::OtherHolder(const ShardId& shard, const ClientRef& client) const {
  auto old = lease_of_shard_.find(shard);
  if (old == lease_of_shard_.end()) return std::nullopt;
  auto l = leases_.find(old->second);
  if (l == leases_.end() || SameHolder(l->second.client, client.session_id)) return std::nullopt;
  const absl::Duration left = l->second.expires - clock_->MonotonicNow();
  if (!l->second.committing && left <= absl::ZeroDuration()) return std::nullopt;  // expired: Expire's to release
  return Holder{l->first, l->second.client, l->second.committing, left};
}

absl::Status LeaseTable::HeldBy(const ShardId& shard, const Holder& holder) {
  if (holder.committing) {
    return absl::FailedPreconditionError(absl::StrCat("shard ", ShardIdString(shard),
                                                      " is being committed by another client (pid ",
                                                      holder.client.pid, "); a second lease for it is refused"));
  }
  if (holder.client.session_id.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shard ", ShardIdString(shard), " has an uncommitted lease of a client without a session (pid ",
        holder.client.pid, "), which it keeps until it commits or aborts it or for ",
        absl::FormatDuration(absl::Ceil(holder.ttl_left, absl::Seconds(1))),
        " more (its ttl); a second lease for it is refused: two trainers save the same rank?"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "shard ", ShardIdString(shard), " has an uncommitted lease of another client (pid ", holder.client.pid,
      ") whose session is connected; a second lease for it is refused: two trainers save the same rank? (once that "
      "client exits, its lease may be replaced)"));
}

bool LeaseTable::Replaceable(const ClientRef& holder) const {
  return state_ && state_(holder) != ClientState::kConnected;
}

absl::Status LeaseTable::MayLease(const ShardId& shard, const ClientRef& client) const {
  std::optional<Holder> holder;
  {
    CheckedLock lock(&mu_);
    holder = OtherHolder(shard, client);
  }
  if (!holder) return absl::OkStatus();
  // A committing lease stays; any other lease of a holder no longer
  // connected may be replaced (asked without the lock: it looks at sessions).
  if (!holder->committing && Replaceable(holder->client)) return absl::OkStatus();
  return HeldBy(shard, *holder);
}

absl::StatusOr<std::string> LeaseTable::Add(const ShardId& shard, uint64_t size_bytes, ReservationPtr bytes,
                                            const std::string& run_id, const ClientRef& client, absl::Duration ttl,
                                            bool ahead) {
  ReservationPtr replaced;
  std::string id;
  // The holder in the way, if any, must no longer be connected; that is
  // asked without the lock, then the lease of the shard must still be the
  // one asked about (else ask again).
  std::string gone_lease;  // a lease whose holder is no longer connected
  for (int round = 0;; ++round) {
    std::optional<Holder> holder;
    {
      CheckedLock lock(&mu_);
      holder = OtherHolder(shard, client);
      if (!holder || holder->lease_id == gone_lease) {
        // Ours to replace: the same holder's, expired, or its holder no
        // longer connected.
        if (auto old = lease_of_shard_.find(shard); old != lease_of_shard_.end()) {
          auto l = leases_.find(old->second);
          if (l != leases_.end() && !l->second.committing) {
            log::Info("lease {} for {} replaced by a new lease{}", IdForLog(l->first), ShardIdString(shard),
                      holder ? " (its client is no longer connected)" : "");
            replaced = std::move(l->second.bytes);
            leases_.erase(l);
          }
          lease_of_shard_.erase(old);
        }
        id = NewId("l-");
        Lease l;
        l.shard = shard;
        l.size_bytes = size_bytes;
        l.bytes = std::move(bytes);
        l.run_id = run_id;
        l.client = client;
        l.expires = clock_->MonotonicNow() + ttl;
        l.ahead = ahead;
        leases_.emplace(id, std::move(l));
        lease_of_shard_[shard] = id;
        break;
      }
    }
    if (holder->committing || !Replaceable(holder->client) || round >= 8) {
      return HeldBy(shard, *holder);  // (`bytes` is released here, without the lock)
    }
    gone_lease = holder->lease_id;
  }
  return id;
}

absl::StatusOr<CommittingLease> LeaseTable::BeginCommit(const std::string& lease_id, uint64_t size_bytes,
                                                        const std::string& session_id) {
  CheckedLock lock(&mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) {
    if (auto c = committed_.find(lease_id); c != committed_.end()) {
      if (c->second.session_id != session_id) {
        return NotYours("lease", lease_id, ClientRef{0, c->second.session_id}, session_id);
      }
      return absl::AlreadyExistsError(absl::StrCat("lease ", IdForLog(lease_id), " is already committed"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("lease \"", IdForLog(lease_id), "\" is unknown, aborted or expired; acquire a new one"));
  }
  if (!SameHolder(it->second.client, session_id)) return NotYours("lease", lease_id, it->second.client, session_id);
  if (it->second.committing) {
    return absl::AbortedError(absl::StrCat("lease ", IdForLog(lease_id), " is being committed by another call"));
  }
  Lease& l = it->second;
  if (size_bytes == 0) size_bytes = l.size_bytes;
  if (size_bytes > l.size_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("commit of ", size_bytes, " bytes exceeds the lease's ", l.size_bytes, " bytes"));
  }
  // Nobody else reads the lease's extents (the client is done writing), so
  // the unused tail can go back to the pool now.
  l.bytes->Trim(size_bytes);
  l.size_bytes = size_bytes;
  l.committing = true;
  return CommittingLease{lease_id, it->second.shard, it->second.size_bytes, it->second.run_id, it->second.bytes};
}

bool LeaseTable::FinishCommit(const std::string& lease_id, const ShardId& shard) {
  ReservationPtr release;
  CheckedLock lock(&mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) return false;
  release = std::move(it->second.bytes);
  const std::string session_id = it->second.client.session_id;
  leases_.erase(it);
  if (auto s = lease_of_shard_.find(shard); s != lease_of_shard_.end() && s->second == lease_id) {
    lease_of_shard_.erase(s);
  }
  committed_[lease_id] = Committed{shard, session_id};
  committed_order_.push_back(lease_id);
  if (committed_order_.size() > kCommittedLeaseMemory) {
    committed_.erase(committed_order_.front());
    committed_order_.pop_front();
  }
  return true;
}

void LeaseTable::CancelCommit(const std::string& lease_id) {
  CheckedLock lock(&mu_);
  auto it = leases_.find(lease_id);
  if (it != leases_.end()) it->second.committing = false;
}

absl::Status LeaseTable::Abort(const std::string& lease_id, const std::string& session_id) {
  ReservationPtr release;
  CheckedLock lock(&mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) {
    if (auto c = committed_.find(lease_id); c != committed_.end()) {
      if (c->second.session_id != session_id) {
        return NotYours("lease", lease_id, ClientRef{0, c->second.session_id}, session_id);
      }
      return absl::FailedPreconditionError(absl::StrCat("lease ", IdForLog(lease_id), " is committed"));
    }
    return absl::OkStatus();
  }
  if (!SameHolder(it->second.client, session_id)) return NotYours("lease", lease_id, it->second.client, session_id);
  if (it->second.committing) {
    return absl::FailedPreconditionError(absl::StrCat("lease ", IdForLog(lease_id), " is being committed"));
  }
  release = std::move(it->second.bytes);
  if (auto s = lease_of_shard_.find(it->second.shard); s != lease_of_shard_.end() && s->second == lease_id) {
    lease_of_shard_.erase(s);
  }
  leases_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<Pin> LeaseTable::HandlePin(const std::string& handle_id, const std::string& session_id) const {
  CheckedLock lock(&mu_);
  auto it = handles_.find(handle_id);
  if (it == handles_.end()) {
    return absl::NotFoundError(
        absl::StrCat("shard handle \"", IdForLog(handle_id), "\" is not open (closed or expired)"));
  }
  if (!SameHolder(it->second.client, session_id)) {
    return NotYours("shard handle", handle_id, it->second.client, session_id);
  }
  return it->second.pin;
}

std::string LeaseTable::OpenHandle(const ShardId& shard, Pin pin, const ClientRef& client, absl::Duration ttl) {
  CheckedLock lock(&mu_);
  const std::string id = NewId("h-");
  handles_.emplace(id, Handle{shard, std::move(pin), client, clock_->MonotonicNow() + ttl});
  return id;
}

absl::Status LeaseTable::CloseHandle(const std::string& handle_id, const std::string& session_id) {
  Pin release;
  CheckedLock lock(&mu_);
  auto it = handles_.find(handle_id);
  if (it == handles_.end()) return absl::OkStatus();
  if (!SameHolder(it->second.client, session_id)) {
    return NotYours("shard handle", handle_id, it->second.client, session_id);
  }
  release = std::move(it->second.pin);
  handles_.erase(it);
  return absl::OkStatus();
}

void LeaseTable::CloseHandle(const std::string& handle_id) {
  Pin release;
  CheckedLock lock(&mu_);
  auto it = handles_.find(handle_id);
  if (it == handles_.end()) return;
  release = std::move(it->second.pin);
  handles_.erase(it);
}

int LeaseTable::Expire() {
  // Decide liveness without the lock (it may look at processes or sessions).
  std::vector<std::pair<std::string, ClientRef>> leases, handles;
  const absl::Time now = clock_->MonotonicNow();
  {
    CheckedLock lock(&mu_);
    for (const auto& [id, l] : leases_) {
      if (!l.committing) leases.emplace_back(id, l.client);
    }
    for (const auto& [id, h] : handles_) handles.emplace_back(id, h.client);
  }
  std::vector<std::string> gone_leases, gone_handles;
  for (const auto& [id, c] : leases) {
    if (state_ && state_(c) == ClientState::kGone) gone_leases.push_back(id);
  }
  for (const auto& [id, c] : handles) {
    if (state_ && state_(c) == ClientState::kGone) gone_handles.push_back(id);
  }
  std::vector<ReservationPtr> release;
  std::vector<Pin> unpin;
  int n = 0;
  {
    CheckedLock lock(&mu_);
    for (auto it = leases_.begin(); it != leases_.end();) {
      const bool gone = std::find(gone_leases.begin(), gone_leases.end(), it->first) != gone_leases.end();
      if (it->second.committing || (!gone && it->second.expires > now)) {
        ++it;
        continue;
      }
      log::Info("lease {} for {} released ({})", IdForLog(it->first), ShardIdString(it->second.shard),
                gone ? "its client is gone" : "its ttl passed");
      release.push_back(std::move(it->second.bytes));
      if (auto s = lease_of_shard_.find(it->second.shard); s != lease_of_shard_.end() && s->second == it->first) {
        lease_of_shard_.erase(s);
      }
      it = leases_.erase(it);
      ++n;
    }
    for (auto it = handles_.begin(); it != handles_.end();) {
      const bool gone = std::find(gone_handles.begin(), gone_handles.end(), it->first) != gone_handles.end();
      if (!gone && it->second.expires > now) {
        ++it;
        continue;
      }
      unpin.push_back(std::move(it->second.pin));
      it = handles_.erase(it);
      ++n;
    }
  }
  if (n > 0) metrics_->leases_expired->Increment(n);
  return n;
}

int LeaseTable::ReleaseSession(const std::string& session_id) {
  if (session_id.empty()) return 0;
  std::vector<ReservationPtr> release;
  std::vector<Pin> unpin;
  int n = 0;
  {
    CheckedLock lock(&mu_);
    for (auto it = leases_.begin(); it != leases_.end();) {
      if (it->second.committing || it->second.client.session_id != session_id) {
        ++it;
        continue;
      }
      log::Info("lease {} for {} released (its client's session ended)", IdForLog(it->first),
                ShardIdString(it->second.shard));
      release.push_back(std::move(it->second.bytes));
      if (auto s = lease_of_shard_.find(it->second.shard); s != lease_of_shard_.end() && s->second == it->first) {
        lease_of_shard_.erase(s);
      }
      it = leases_.erase(it);
      ++n;
    }
    for (auto it = handles_.begin(); it != handles_.end();) {
      if (it->second.client.session_id != session_id) {
        ++it;
        continue;
      }
      unpin.push_back(std::move(it->second.pin));
      it = handles_.erase(it);
      ++n;
    }
  }
  if (n > 0) metrics_->leases_expired->Increment(n);
  return n;
}

uint64_t LeaseTable::LeasedBytes() const {
  CheckedLock lock(&mu_);
  uint64_t total = 0;
  for (const auto& [id, l] : leases_) total += l.bytes->reserved_bytes();
  return total;
}

uint64_t LeaseTable::LeasedAheadBytes() const {
  CheckedLock lock(&mu_);
  uint64_t total = 0;
  for (const auto& [id, l] : leases_) {
    if (l.ahead) total += l.bytes->reserved_bytes();
  }
  return total;
}

uint32_t LeaseTable::lease_count() const {
  CheckedLock lock(&mu_);
  return static_cast<uint32_t>(leases_.size());
}

uint32_t LeaseTable::handle_count() const {
  CheckedLock lock(&mu_);
  return static_cast<uint32_t>(handles_.size());
}

}  // namespace ckpt::agent
