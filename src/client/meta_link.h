// client::MetaLink: the calls the client makes to ckpt-meta (MetaService,
// proto/ckpt/v1/meta.proto), behind an interface, as client::AgentLink
// (client/agent_link.h) puts the agent's. Not to be confused with the
// agent's ckpt::agent::MetaLink (src/server/agent/meta_link.h), the server
// side's link to meta: this one is the trainer library's, in namespace
// ckpt::client, and has only what a trainer asks meta.
//
// The client (client.cc, load.cc) talks to meta only through this:
// NewGrpcMetaLink (meta_link_grpc.cc) implements it over a gRPC channel to
// meta's address, and unit tests use an in-process fake
// (tests/client/fake_meta_link.h), so what the client does with meta's
// answers (retries, deadlines, the codes it passes on) is testable without a
// server.
//
// Every call is one attempt: it blocks until meta answered or `timeout`
// passed. The retry policies (create-or-open at Connect, the long-poll loop
// of WaitVersion, read-only calls retried while meta is unreachable) stay in
// client.cc, which waits between attempts with AwaitRetry. Messages are the
// protocol's (ckpt.v1); errors keep meta's code and message, prefixed with
// the call's name ("Locate: ..."), as FromGrpc does; kUnavailable when meta
// cannot be reached, kDeadlineExceeded at the timeout.
//
// Thread safety: implementations must be safe to call from several threads
// at once.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "ckpt/v1/meta.pb.h"

namespace grpc {
class ChannelCredentials;
}

namespace ckpt::client {

class MetaLink {
 public:
  virtual ~MetaLink() = default;

  // Creates the job, or opens it with req.open_if_exists (resp.created()
  // says which). kFailedPrecondition: it exists with another spec, or is
  // being deleted; kAlreadyExists without open_if_exists.
  virtual absl::Status CreateJob(const v1::CreateJobRequest& req, v1::CreateJobResponse* resp,
                                 absl::Duration timeout) = 0;
  // The job's spec and state. kNotFound: no such job.
  virtual absl::Status GetJob(const v1::GetJobRequest& req, v1::GetJobResponse* resp, absl::Duration timeout) = 0;
  // Long poll: OK once the version reached req.level; kDeadlineExceeded
  // after req.timeout_ms (meta's message says the version's state);
  // kNotFound for a version meta does not know (or deleted).
  virtual absl::Status WaitVersion(const v1::WaitVersionRequest& req, v1::WaitVersionResponse* resp,
                                   absl::Duration timeout) = 0;
  // The newest version at req.min_level or better. kNotFound: none.
  virtual absl::Status Latest(const v1::LatestRequest& req, v1::LatestResponse* resp, absl::Duration timeout) = 0;
  // Where a rank's shard of a version can be read. kNotFound: no such job,
  // version or staged rank; kFailedPrecondition: the version cannot be
  // restored; kDataLoss: no readable source left.
  virtual absl::Status Locate(const v1::LocateRequest& req, v1::LocateResponse* resp, absl::Duration timeout) = 0;
  // One version with every shard (items included with req.include_items).
  // kNotFound: no such job or version.
  virtual absl::Status GetVersion(const v1::GetVersionRequest& req, v1::GetVersionResponse* resp,
                                  absl::Duration timeout) = 0;
  // The cluster's (and the job's) state and failure statistics.
  virtual absl::Status ClusterStatus(const v1::ClusterStatusRequest& req, v1::ClusterStatusResponse* resp,
                                     absl::Duration timeout) = 0;

  // Before a call that failed kUnavailable is tried again: returns at
  // `until`, or earlier once the link is ready for it. The gRPC link spends
  // the wait in its channel's connectivity watch (so that meta's restart is
  // noticed at once; see client.cc Backoff); a fake may return at once.
  virtual void AwaitRetry(absl::Time until) = 0;
};

// The link to meta at `target` (host:port), over `credentials` (TLS or
// insecure: common/grpc_security.h ChannelCredentials), sending `token` (""
// for none) with every call; quick reconnects, unlimited message sizes.
std::unique_ptr<MetaLink> NewGrpcMetaLink(const std::string& target,
                                          std::shared_ptr<grpc::ChannelCredentials> credentials,
                                          const std::string& token);

}  // namespace ckpt::client
