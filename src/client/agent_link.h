// AgentLink: the calls the client makes to its node's agent (AgentService,
// proto/ckpt/v1/agent.proto), behind an interface, as the agent reaches meta
// through its MetaLink (src/server/agent/meta_link.h).
//
// The client's save and load paths (save.cc, load.cc, client.cc) talk to the
// agent's gRPC service only through this: NewGrpcAgentLink (agent_link_grpc.cc)
// implements it over the agent's unix socket, and unit tests use an
// in-process fake (tests/client/fake_agent_link.h), so a save's handling of
// the agent's answers (a lease refused, a commit lost, a pull lease that
// cannot be staged) is testable without a server. The session socket
// (client/session.h), which carries descriptors, is not behind it.
//
// Messages are the protocol's (ckpt.v1); no gRPC type appears here. Every
// call blocks until the agent answered or `timeout` passed. Errors keep the
// agent's code and message, prefixed with the call's name ("CommitShard:
// ..."), as FromGrpc does; kUnavailable when the agent cannot be reached,
// kDeadlineExceeded at the timeout.
//
// Thread safety: implementations must be safe to call from several threads
// at once.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "ckpt/v1/agent.pb.h"

namespace ckpt::client {

class AgentLink {
 public:
  virtual ~AgentLink() = default;

  // The agent's node id and pool files.
  virtual absl::Status AgentStatus(v1::AgentStatusResponse* resp, absl::Duration timeout) = 0;
  // A staging lease for a save (regions of the pool, or a pull lease).
  virtual absl::Status AcquireStagingLease(const v1::AcquireStagingLeaseRequest& req,
                                           v1::AcquireStagingLeaseResponse* resp, absl::Duration timeout) = 0;
  // Releases a lease not committed into. kFailedPrecondition: the lease is
  // committed (or gone).
  virtual absl::Status AbortLease(const v1::AbortLeaseRequest& req, absl::Duration timeout) = 0;
  // Commits a filled lease. kAlreadyExists: a replay of a commit the agent holds.
  virtual absl::Status CommitShard(const v1::CommitShardRequest& req, v1::CommitShardResponse* resp,
                                   absl::Duration timeout) = 0;
  // Opens a shard for reading (fetching it first if it is not local).
  virtual absl::Status OpenShard(const v1::OpenShardRequest& req, v1::OpenShardResponse* resp,
                                 absl::Duration timeout) = 0;
  // Releases an open shard's handle.
  virtual absl::Status CloseShard(const v1::CloseShardRequest& req, absl::Duration timeout) = 0;
  // A pull-mode agent writes an open shard into the client's staging memory.
  virtual absl::Status DeliverShard(const v1::DeliverShardRequest& req, absl::Duration timeout) = 0;
  // Holds protection traffic back.
  virtual absl::Status PauseProtection(const v1::PauseProtectionRequest& req, v1::PauseProtectionResponse* resp,
                                       absl::Duration timeout) = 0;

  // Before a call that failed kUnavailable is tried again: returns at
  // `until`, or earlier once the link is ready for it. The gRPC link spends
  // the wait in its channel's connectivity watch (so that a reconnect is
  // noticed at once; see client.cc Backoff); a fake may return at once.
  virtual void AwaitRetry(absl::Time until) = 0;
};

// The link to the agent at `target`, a gRPC target ("unix:/run/ckpt/agent.sock").
std::unique_ptr<AgentLink> NewGrpcAgentLink(const std::string& target);

}  // namespace ckpt::client
