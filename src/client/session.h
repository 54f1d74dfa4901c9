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
// A version-2 session (an agent that answers " open") also carries the
// client's staging leases and opens of its local copies (Request): one at a
// time, on the session's connection, with no gRPC round trip (docs/agent.md
// "Client sessions").
//
// Thread safety: immutable after Open, except Closed() which only polls and
// Request, which callers may share (one request on the wire at a time).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
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
  // True once the agent hung up (it stopped or restarted), or a request
  // broke off mid-reply. Never blocks.
  bool Closed() const;

  // Whether the agent takes requests on this session.
  bool serves_requests() const { return serves_requests_; }
  // Sends a request on the session and returns the serialized response:
  // kind "OPEN" with a serialized OpenShardRequest (the local copy alone),
  // "LEASE" with an AcquireStagingLeaseRequest. The agent's refusal comes
  // back with its status code (Unavailable: ask over gRPC); Unavailable
  // also if the session broke or the agent did not answer within `timeout`
  // (the session is then Closed(): a new one must be opened).
  absl::StatusOr<std::string> Request(std::string_view kind, const std::string& request,
                                      absl::Duration timeout) const;

  // The session socket that belongs to an agent socket (same directory).
  static std::string SocketFor(const std::string& agent_socket);

 private:
  AgentSession() = default;
  // Connects and sends `hello`; the reply (with descriptors) is parsed by Open.
  static absl::StatusOr<std::unique_ptr<AgentSession>> Greet(const std::string& socket_path, const std::string& hello,
                                                             absl::Duration timeout);
  int fd_ = -1;
  std::string id_;
  std::vector<Pool> pools_;
  bool serves_requests_ = false;
  mutable absl::Mutex call_mu_;  // one request on the wire
  mutable std::atomic<bool> broken_{false};
};

}  // namespace ckpt::client
