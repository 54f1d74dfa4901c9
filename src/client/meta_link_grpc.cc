// client::MetaLink over gRPC: the MetaService stub on a channel to meta.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <utility>

#include "ckpt/v1/meta.grpc.pb.h"
#include "client/client_core.h"
#include "client/meta_link.h"
#include "common/grpc_security.h"

namespace ckpt::client {
namespace {

class GrpcMetaLink final : public MetaLink {
 public:
  explicit GrpcMetaLink(std::shared_ptr<grpc::Channel> channel)
      : channel_(std::move(channel)), stub_(v1::MetaService::NewStub(channel_)) {}

  absl::Status CreateJob(const v1::CreateJobRequest& req, v1::CreateJobResponse* resp,
                         absl::Duration timeout) override {
    return CallUnary(*stub_, &Stub::CreateJob, req, resp, timeout, "CreateJob");
  }
  absl::Status GetJob(const v1::GetJobRequest& req, v1::GetJobResponse* resp, absl::Duration timeout) override {
    return CallUnary(*stub_, &Stub::GetJob, req, resp, timeout, "GetJob");
  }
  absl::Status WaitVersion(const v1::WaitVersionRequest& req, v1::WaitVersionResponse* resp,
                           absl::Duration timeout) override {
    return CallUnary(*stub_, &Stub::WaitVersion, req, resp, timeout, "WaitVersion");
  }
  absl::Status Latest(const v1::LatestRequest& req, v1::LatestResponse* resp, absl::Duration timeout) override {
    return CallUnary(*stub_, &Stub::Latest, req, resp, timeout, "Latest");
  }
  absl::Status Locate(const v1::LocateRequest& req, v1::LocateResponse* resp, absl::Duration timeout) override {
    return CallUnary(*stub_, &Stub::Locate, req, resp, timeout, "Locate");
  }
  absl::Status GetVersion(const v1::GetVersionRequest& req, v1::GetVersionResponse* resp,
                          absl::Duration timeout) override {
    return CallUnary(*stub_, &Stub::GetVersion, req, resp, timeout, "GetVersion");
  }
  absl::Status ClusterStatus(const v1::ClusterStatusRequest& req, v1::ClusterStatusResponse* resp,
                             absl::Duration timeout) override {
    return CallUnary(*stub_, &Stub::ClusterStatus, req, resp, timeout, "ClusterStatus");
  }
  void AwaitRetry(absl::Time until) override { AwaitChannel(channel_.get(), until); }

 private:
  const std::shared_ptr<grpc::Channel> channel_;
  using Stub = v1::MetaService::Stub;
  const std::unique_ptr<Stub> stub_;
};

}  // namespace

std::unique_ptr<MetaLink> NewGrpcMetaLink(const std::string& target,
                                          std::shared_ptr<grpc::ChannelCredentials> credentials,
                                          const std::string& token) {
  grpc::ChannelArguments args;
  SetReconnectArgs(&args, target);  // quick reconnects, unlimited message sizes
  return std::make_unique<GrpcMetaLink>(ChannelWithToken(target, std::move(credentials), args, token));
}

}  // namespace ckpt::client
