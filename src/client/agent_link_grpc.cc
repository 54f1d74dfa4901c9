// AgentLink over gRPC: the AgentService stub on the agent's unix socket.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <utility>

#include "client/agent_link.h"
#include "client/client_core.h"
#include "ckpt/v1/agent.grpc.pb.h"
#include "common/grpc_security.h"

namespace ckpt::client {
namespace {

class GrpcAgentLink final : public AgentLink {
 public:
  explicit GrpcAgentLink(std::shared_ptr<grpc::Channel> channel)
      : channel_(std::move(channel)), stub_(v1::AgentService::NewStub(channel_)) {}

  absl::Status AgentStatus(v1::AgentStatusResponse* resp, absl::Duration timeout) override {
    return CallUnary(*stub_, &Stub::AgentStatus, v1::AgentStatusRequest{}, resp, timeout, "AgentStatus");
  }
  absl::Status AcquireStagingLease(const v1::AcquireStagingLeaseRequest& req, v1::AcquireStagingLeaseResponse* resp,
                                   absl::Duration timeout) override {
    return CallUnary(*stub_, &Stub::AcquireStagingLease, req, resp, timeout, "AcquireStagingLease");
  }
  absl::Status AbortLease(const v1::AbortLeaseRequest& req, absl::Duration timeout) override {
    return CallUnary(*stub_, &Stub::AbortLease, req, timeout, "AbortLease");
  }
  absl::Status CommitShard(const v1::CommitShardRequest& req, v1::CommitShardResponse* resp,
                           absl::Duration timeout) override {
    return CallUnary(*stub_, &Stub::CommitShard, req, resp, timeout, "CommitShard");
  }
  absl::Status OpenShard(const v1::OpenShardRequest& req, v1::OpenShardResponse* resp,
                         absl::Duration timeout) override {
    return CallUnary(*stub_, &Stub::OpenShard, req, resp, timeout, "OpenShard");
  }
  absl::Status CloseShard(const v1::CloseShardRequest& req, absl::Duration timeout) override {
    return CallUnary(*stub_, &Stub::CloseShard, req, timeout, "CloseShard");
  }
  absl::Status DeliverShard(const v1::DeliverShardRequest& req, absl::Duration timeout) override {
    return CallUnary(*stub_, &Stub::DeliverShard, req, timeout, "DeliverShard");
  }
  absl::Status PauseProtection(const v1::PauseProtectionRequest& req, v1::PauseProtectionResponse* resp,
                               absl::Duration timeout) override {
    return CallUnary(*stub_, &Stub::PauseProtection, req, resp, timeout, "PauseProtection");
  }
  void AwaitRetry(absl::Time until) override { AwaitChannel(channel_.get(), until); }

 private:
  const std::shared_ptr<grpc::Channel> channel_;
  using Stub = v1::AgentService::Stub;
  const std::unique_ptr<Stub> stub_;
};

}  // namespace

std::unique_ptr<AgentLink> NewGrpcAgentLink(const std::string& target) {
  grpc::ChannelArguments args;
  SetReconnectArgs(&args);  // quick reconnects, unlimited message sizes
  return std::make_unique<GrpcAgentLink>(
      ChannelWithToken(target, grpc::InsecureChannelCredentials(), args, /*token=*/""));
}

}  // namespace ckpt::client
