// MetaServiceImpl: the gRPC face of ckpt-meta. Every MetaService RPC of
// proto/ckpt/v1/meta.proto is served here by translating the request
// (meta_convert.h), calling the MetaCore, and translating the answer or the
// error (same code, same message).
//
// The hot RPCs, Heartbeat and ReportShards (every rank of every job reports
// each checkpoint), use the gRPC callback API: the handler applies the change
// on gRPC's callback thread (MetaCore::Submit*) and the core's durability
// thread finishes the reactor once the change is fsynced (WhenDurable), so no
// thread parks in the store's group commit. The other RPCs use the
// synchronous API.
//
// It holds no state of its own beyond a shutdown flag: the core is the single
// source of truth. Successful calls log nothing (debug level at most);
// failures are logged at debug level (the core logs the ones it decides), except
// Internal/Unknown, which are logged as errors.
//
// Long calls: WaitVersion waits at most min(timeout_ms, the call's deadline,
// 1 hour), and WatchTasks streams until the client cancels or the incarnation
// becomes stale. Both wake at least once per second to notice cancellation and
// Shutdown(), so a server drain never waits for them.
//
// Pagination: ListJobs and ListVersions page tokens are opaque strings that
// encode the last returned job id (resp. job id, order and step); a token from
// another call is rejected with InvalidArgument.
//
// Thread safety: every method may be called concurrently from gRPC's threads.
// `core` must outlive the service; the service must outlive the grpc::Server it
// is registered with.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "ckpt/v1/meta.grpc.pb.h"
#include "common/clock.h"
#include "common/grpc_security.h"
#include "server/rpc/authorize.h"
#include "server/meta/meta_core.h"

namespace ckpt::rpc {

using MetaServiceBase = ckpt::v1::MetaService::WithCallbackMethod_Heartbeat<
    ckpt::v1::MetaService::WithCallbackMethod_ReportShards<ckpt::v1::MetaService::Service>>;

class MetaServiceImpl final : public MetaServiceBase {
 public:
  // `core` and `clock` are not owned and must outlive this object. `clock`
  // paces WaitVersion's slices (use the core's clock).
  // A non-empty `admin_token` guards the admin RPCs (DeleteVersion,
  // DeleteJob, UpdateJob, DrainNode, UndrainNode, RemoveNode), a non-empty `agent_token` the RPCs
  // only agents make (RegisterNode, Heartbeat, WatchTasks, ReportTaskResult,
  // ReportInventory, ReportShards, BeginVersion), and trainer tokens limit
  // the job RPCs to the jobs each token names (CheckJobCaller): see
  // common/grpc_security.h.
  // `require_identity`: the server serves mutual TLS and every caller must
  // carry a ckpt certificate identity allowed to make the call
  // (server/rpc/authorize.h), checked before the tokens.
  explicit MetaServiceImpl(meta::MetaCore* core, Clock* clock = RealClock(), CallerTokens tokens = {},
                           bool require_identity = false);
  ~MetaServiceImpl() override;

  MetaServiceImpl(const MetaServiceImpl&) = delete;
  MetaServiceImpl& operator=(const MetaServiceImpl&) = delete;

  // Meta's replicas as ClusterStatus lists them (ckpt-meta --replica-of):
  // set once before serving; called on the RPC's thread (it may read etcd).
  struct ReplicaInfo {
    std::string address;
    bool leader = false;
    uint64_t applied_index = 0;
  };
  void set_replicas_source(std::function<std::vector<ReplicaInfo>()> source) { replicas_ = std::move(source); }

  // Starts draining: open WatchTasks streams end with UNAVAILABLE and
  // WaitVersion calls return UNAVAILABLE within about a second; new calls of
  // either kind return UNAVAILABLE at once. Other RPCs keep being served until
  // the grpc::Server stops taking calls. Non-blocking; idempotent.
  void Shutdown();
  bool shutting_down() const { return shutting_down_.load(std::memory_order_acquire); }

  // ---- Nodes and leases
  grpc::Status RegisterNode(grpc::ServerContext* ctx, const v1::RegisterNodeRequest* req,
                            v1::RegisterNodeResponse* resp) override;
  // Callback API; never blocks (see the file comment).
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse* resp) override;
  // Sends every unfinished task of the incarnation at open, then new and
  // re-issued ones (a task id + attempt is sent once per stream). Ends with
  // FAILED_PRECONDITION when the incarnation is stale (noticed at the next task
  // change, or within about 5 s when nothing changes), UNAVAILABLE on
  // Shutdown(), CANCELLED when the client goes away.
  grpc::Status WatchTasks(grpc::ServerContext* ctx, const v1::WatchTasksRequest* req,
                          grpc::ServerWriter<v1::WatchTasksResponse>* writer) override;
  grpc::Status ReportTaskResult(grpc::ServerContext* ctx, const v1::ReportTaskResultRequest* req,
                                v1::ReportTaskResultResponse* resp) override;
  grpc::Status ReportInventory(grpc::ServerContext* ctx, const v1::ReportInventoryRequest* req,
                               v1::ReportInventoryResponse* resp) override;
  grpc::Status DrainNode(grpc::ServerContext* ctx, const v1::DrainNodeRequest* req,
                         v1::DrainNodeResponse* resp) override;
  grpc::Status UndrainNode(grpc::ServerContext* ctx, const v1::UndrainNodeRequest* req,
                           v1::UndrainNodeResponse* resp) override;
  grpc::Status RemoveNode(grpc::ServerContext* ctx, const v1::RemoveNodeRequest* req,
                          v1::RemoveNodeResponse* resp) override;
  grpc::Status ListNodes(grpc::ServerContext* ctx, const v1::ListNodesRequest* req,
                         v1::ListNodesResponse* resp) override;

  // ---- Jobs and placement
  grpc::Status CreateJob(grpc::ServerContext* ctx, const v1::CreateJobRequest* req,
                         v1::CreateJobResponse* resp) override;
  grpc::Status GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest* req,
                      v1::GetJobResponse* resp) override;
  grpc::Status ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest* req,
                        v1::ListJobsResponse* resp) override;
  grpc::Status DeleteJob(grpc::ServerContext* ctx, const v1::DeleteJobRequest* req,
                         v1::DeleteJobResponse* resp) override;
  grpc::Status UpdateJob(grpc::ServerContext* ctx, const v1::UpdateJobRequest* req,
                         v1::UpdateJobResponse* resp) override;
  grpc::Status GetPlacement(grpc::ServerContext* ctx, const v1::GetPlacementRequest* req,
                            v1::GetPlacementResponse* resp) override;

  // ---- Versions
  grpc::Status BeginVersion(grpc::ServerContext* ctx, const v1::BeginVersionRequest* req,
                            v1::BeginVersionResponse* resp) override;
  // Malformed entries get INVALID_ARGUMENT in their own result slot; the
  // others are passed to the core in order. Callback API; never blocks.
  grpc::ServerUnaryReactor* ReportShards(grpc::CallbackServerContext* ctx,
                                         const v1::ReportShardsRequest* req,
                                         v1::ReportShardsResponse* resp) override;
  grpc::Status GetVersion(grpc::ServerContext* ctx, const v1::GetVersionRequest* req,
                          v1::GetVersionResponse* resp) override;
  grpc::Status ListVersions(grpc::ServerContext* ctx, const v1::ListVersionsRequest* req,
                            v1::ListVersionsResponse* resp) override;
  grpc::Status Latest(grpc::ServerContext* ctx, const v1::LatestRequest* req,
                      v1::LatestResponse* resp) override;
  grpc::Status Locate(grpc::ServerContext* ctx, const v1::LocateRequest* req,
                      v1::LocateResponse* resp) override;
  grpc::Status WaitVersion(grpc::ServerContext* ctx, const v1::WaitVersionRequest* req,
                           v1::WaitVersionResponse* resp) override;
  grpc::Status FlushVersion(grpc::ServerContext* ctx, const v1::FlushVersionRequest* req,
                            v1::FlushVersionResponse* resp) override;
  grpc::Status DeleteVersion(grpc::ServerContext* ctx, const v1::DeleteVersionRequest* req,
                             v1::DeleteVersionResponse* resp) override;

  // ---- Cluster
  grpc::Status ClusterStatus(grpc::ServerContext* ctx, const v1::ClusterStatusRequest* req,
                             v1::ClusterStatusResponse* resp) override;

 private:
  // DeadlineExceeded for a WaitVersion that waited `waited` in several slices,
  // with the version's current state (or GetVersion's error).
  absl::Status WaitTimedOut(const std::string& job_id, uint64_t step, meta::Level level,
                            absl::Duration waited) const;

  meta::MetaCore* const core_;
  Clock* const clock_;
  std::function<std::vector<ReplicaInfo>()> replicas_;
  const Authorizer auth_;
  // An RPC only agents make, for node `node_id` (the caller must be it).
  grpc::Status AgentCall(const grpc::ServerContextBase& ctx, const std::string& node_id, const char* rpc) const {
    return auth_.AgentCall(ctx, node_id, rpc);
  }
  grpc::Status AdminCall(const grpc::ServerContextBase& ctx, const char* rpc) const {
    return auth_.AdminCall(ctx, rpc);
  }
  // A job RPC (or, with an empty job id, a cluster-wide read).
  grpc::Status JobCall(const grpc::ServerContextBase& ctx, const std::string& job_id, const char* rpc,
                       Access access = Access::kRead) const {
    return auth_.JobCall(ctx, job_id, access, rpc);
  }
  // Put each hot call's request and response on one protobuf arena (one
  // allocation per call instead of one per string and repeated field).
  std::unique_ptr<grpc::MessageAllocator<v1::ReportShardsRequest, v1::ReportShardsResponse>>
      report_allocator_;
  std::unique_ptr<grpc::MessageAllocator<v1::HeartbeatRequest, v1::HeartbeatResponse>>
      heartbeat_allocator_;
  std::atomic<bool> shutting_down_{false};
};

}  // namespace ckpt::rpc
