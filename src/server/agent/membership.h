// PeerMembership: which nodes may push to and read from this agent on the
// data plane.
//
// Meta's membership is every node registered with its current incarnation
// and not DEAD or LEFT. Meta sends it with a heartbeat answer whenever it
// differs from the generation the agent holds (MetaSession). The PeerServer
// admits a push or a read only when its header names a member with exactly
// that incarnation (docs/security.md "Data plane"). A sender that is not in
// the table may simply be newer than it (it registered since this agent's
// last heartbeat, as a restarted agent reading a replica right away): Admit
// then asks for a heartbeat at once and waits, bounded, for an answer that
// meta gave after the request arrived, and decides on that.
//
// Thread safety: every method may be called from any thread. `refresh` runs
// without this class's lock held.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/agent/meta_link.h"

namespace ckpt::agent {

class PeerMembership {
 public:
  // `refresh` asks for a heartbeat soon (MetaSession::HeartbeatSoon).
  PeerMembership(Clock* clock, std::function<void()> refresh);

  // A heartbeat is about to be sent: its number, for Update.
  uint64_t Sending();
  // Applies the answer to heartbeat `sent` (Sending's number): the
  // generation meta has and, when it sent them, the members.
  void Update(uint64_t sent, uint64_t generation, const std::optional<std::vector<Member>>& members);
  // The generation held; 0 before meta sent any members.
  uint64_t generation() const;
  size_t size() const;

  // OK if `node_id` is a member with `incarnation`. Otherwise waits (up to
  // `wait`) for a heartbeat answer newer than this call and checks again.
  // PermissionDenied saying who the sender claimed to be and what meta's
  // membership says; Unavailable if no membership arrived yet.
  absl::Status Admit(const std::string& node_id, uint64_t incarnation, absl::Duration wait);

 private:
  absl::Status CheckLocked(const std::string& node_id, uint64_t incarnation) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Clock* const clock_;
  const std::function<void()> refresh_;
  mutable absl::Mutex mu_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t sent_ ABSL_GUARDED_BY(mu_) = 0;      // heartbeats sent so far
  uint64_t answered_ ABSL_GUARDED_BY(mu_) = 0;  // the newest one answered
  std::map<std::string, uint64_t> incarnations_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::agent
