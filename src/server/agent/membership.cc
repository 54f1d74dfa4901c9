#include "server/agent/membership.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace ckpt::agent {

PeerMembership::PeerMembership(Clock* clock, std::function<void()> refresh)
    : clock_(clock), refresh_(std::move(refresh)) {}

uint64_t PeerMembership::Sending() {
  absl::MutexLock lock(&mu_);
  return ++sent_;
}

void PeerMembership::Update(uint64_t sent, uint64_t generation,
                            const std::optional<std::vector<Member>>& members) {
  absl::MutexLock lock(&mu_);
  if (sent < answered_) return;  // an older answer that arrived late
  answered_ = sent;
  if (!members) return;
  incarnations_.clear();
  for (const Member& m : *members) incarnations_[m.node_id] = m.incarnation;
  generation_ = generation;
}

uint64_t PeerMembership::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

size_t PeerMembership::size() const {
  absl::MutexLock lock(&mu_);
  return incarnations_.size();
}

absl::Status PeerMembership::CheckLocked(const std::string& node_id, uint64_t incarnation) const {
  if (node_id.empty()) {
    return absl::PermissionDeniedError(
        "the sender did not say which node it is (a peer of an earlier version?); this agent "
        "takes pushes and reads only from nodes meta registered");
  }
  if (generation_ == 0) {
    return absl::UnavailableError("this agent has no membership from meta yet; retry");
  }
  auto it = incarnations_.find(node_id);
  if (it == incarnations_.end()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "node \"", node_id, "\" is not a member: meta does not list it as registered and alive "
        "(membership generation ", generation_, ")"));
  }
  if (it->second != incarnation) {
    return absl::PermissionDeniedError(absl::StrCat(
        "node \"", node_id, "\" incarnation ", incarnation, " is not current: meta lists incarnation ",
        it->second, " (membership generation ", generation_, ")"));
  }
  return absl::OkStatus();
}

absl::Status PeerMembership::Admit(const std::string& node_id, uint64_t incarnation, absl::Duration wait) {
  uint64_t asked_at;
  {
    absl::MutexLock lock(&mu_);
    absl::Status st = CheckLocked(node_id, incarnation);
    if (st.ok() || node_id.empty() || wait <= absl::ZeroDuration()) return st;
    asked_at = sent_;
  }
  if (refresh_) refresh_();
  absl::MutexLock lock(&mu_);
  // An answer to a heartbeat sent after this call began.
  auto fresh = [this, asked_at]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return answered_ > asked_at; };
  clock_->AwaitWithTimeout(&mu_, absl::Condition(&fresh), wait);
  return CheckLocked(node_id, incarnation);
}

}  // namespace ckpt::agent
