// AgentSession: the client's end of the agent's session socket
// (<run-dir>/session.sock; server side in src/server/agent/session_server.h,
// protocol in docs/agent.md "Client sessions").
//
// Opening a session hands the client the agent's pool files as descriptors
// (SCM_RIGHTS), so it maps them without seeing the agent's memory directory,
// and the open connection keeps the client's leases and handles alive: they
// are released (after a grace period) once it closes. A client reopens a
// closed session (agent restart) by resuming its id; a restarted agent gives
// a new id (the old session's leases died with it).
//
// Thread safety: immutable after Open, except Closed() which only polls.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ckpt::client {

class AgentSession {
 public:
  struct Pool {
    std::string path;  // the name regions use
    int fd = -1;       // owned by the session until it is destroyed
    uint64_t bytes = 0;
  };
  // Connects to the session socket and says hello (resuming `resume_id` if
  // not empty). NotFound when there is no session socket (an older agent:
  // the caller falls back to mapping the pool by path); Unavailable when the
  // agent does not answer within `timeout`; FailedPrecondition with the
  // agent's reason when it refuses.
  static absl::StatusOr<std::unique_ptr<AgentSession>> Open(const std::string& socket_path,
                                                             const std::string& resume_id, absl::Duration timeout);
  ~AgentSession();  // closes the connection (the agent starts the grace period) and the descriptors
  AgentSession(const AgentSession&) = delete;
  AgentSession& operator=(const AgentSession&) = delete;

  const std::string& id() const { return id_; }
  const std::vector<Pool>& pools() const { return pools_; }
  // True once the agent hung up (it stopped or restarted). Never blocks.
  bool Closed() const;

  // The session socket that belongs to an agent socket (same directory).
  static std::string SocketFor(const std::string& agent_socket);

 private:
  AgentSession() = default;
  int fd_ = -1;
  std::string id_;
  std::vector<Pool> pools_;
};

}  // namespace ckpt::client
