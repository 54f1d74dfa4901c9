// AgentService over gRPC: translates ckpt.v1 requests into calls on
// agent::Agent (server/agent/agent.h) and the results back. No logic here.
//
// Served (synchronously, on gRPC's thread pool) on the agent's unix socket for
// local trainers and on its TCP port for tools. Handlers block only as the
// Agent calls they make do (AcquireStagingLease may wait for meta's
// BeginVersion; OpenShard and Verify read the shard).
#pragma once

#include <string>
#include <string_view>

#include "ckpt/v1/agent.grpc.pb.h"
#include "server/agent/agent.h"
#include "server/rpc/authorize.h"

namespace ckpt::rpc {

class AgentServiceImpl final : public v1::AgentService::Service {
 public:
  // `agent` must outlive the service. Calls over the local unix socket are
  // guarded by its mode and group. On TCP: with `require_identity` (the
  // port serves mutual TLS) the caller's certificate identity decides
  // (server/rpc/authorize.h: admin, operator, trainer of the job); without
  // it (--insecure, loopback only) a non-empty `admin_token` guards every
  // call (CheckAdminToken). `host_node`: a DPU agent's --host-node, whose
  // node certificate (its ckpt-dpu-proxy) makes trainer calls on TCP.
  AgentServiceImpl(agent::Agent* agent, std::string data_transport, std::string admin_token = "",
                   bool require_identity = false, std::string host_node = "");

  grpc::Status AcquireStagingLease(grpc::ServerContext*, const v1::AcquireStagingLeaseRequest*,
                                   v1::AcquireStagingLeaseResponse*) override;
  grpc::Status CommitShard(grpc::ServerContext*, const v1::CommitShardRequest*, v1::CommitShardResponse*) override;
  grpc::Status AbortLease(grpc::ServerContext*, const v1::AbortLeaseRequest*, v1::AbortLeaseResponse*) override;
  grpc::Status OpenShard(grpc::ServerContext*, const v1::OpenShardRequest*, v1::OpenShardResponse*) override;
  // OpenShard for a request that came on client session `session_id`'s
  // connection (SessionServer): the local copy alone (no sources, no
  // expected shard), so that it answers quickly: verified here only up to
  // kSessionVerifyBytes (Unavailable for a larger one: the client asks over
  // gRPC); the handle belongs to that session. The serialized
  // OpenShardResponse.
  absl::StatusOr<std::string> OpenOnSession(const std::string& session_id, std::string_view request);
  // AcquireStagingLease for a request on session `session_id`'s connection:
  // the lease belongs to that session; Unavailable instead of a look-up at
  // meta (LeaseRequest::without_meta). The serialized response.
  absl::StatusOr<std::string> LeaseOnSession(const std::string& session_id, std::string_view request);
  // A session request of `kind` ("OPEN", "LEASE"): SessionServer::RequestHandler.
  absl::StatusOr<std::string> OnSession(const std::string& session_id, std::string_view kind,
                                        std::string_view request);
  grpc::Status CloseShard(grpc::ServerContext*, const v1::CloseShardRequest*, v1::CloseShardResponse*) override;
  grpc::Status DeliverShard(grpc::ServerContext*, const v1::DeliverShardRequest*, v1::DeliverShardResponse*) override;
  grpc::Status ReadShard(grpc::ServerContext*, const v1::ReadShardRequest*,
                         grpc::ServerWriter<v1::ReadShardResponse>*) override;
  grpc::Status GetInventory(grpc::ServerContext*, const v1::GetInventoryRequest*,
                            v1::GetInventoryResponse*) override;
  grpc::Status Flush(grpc::ServerContext*, const v1::FlushRequest*, v1::FlushResponse*) override;
  grpc::Status Evict(grpc::ServerContext*, const v1::EvictRequest*, v1::EvictResponse*) override;
  grpc::Status Verify(grpc::ServerContext*, const v1::VerifyRequest*, v1::VerifyResponse*) override;
  grpc::Status AgentStatus(grpc::ServerContext*, const v1::AgentStatusRequest*, v1::AgentStatusResponse*) override;
  grpc::Status PauseProtection(grpc::ServerContext*, const v1::PauseProtectionRequest*,
                               v1::PauseProtectionResponse*) override;

 private:
  grpc::Status OpenChecked(const v1::OpenShardRequest* req, v1::OpenShardResponse* resp,
                           uint64_t verify_at_most_bytes = 0);
  grpc::Status LeaseChecked(const v1::AcquireStagingLeaseRequest* req, bool without_meta,
                            v1::AcquireStagingLeaseResponse* resp);
  // A PullSource with every field set (InvalidArgument naming `field`).
  static absl::StatusOr<agent::PullSource> PullSourceFromProto(const v1::PullSource& p, const char* field);

  agent::Agent* const agent_;
  const std::string data_transport_;
  const Authorizer auth_;
};

}  // namespace ckpt::rpc
