#include "server/rpc/meta_link_grpc.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "ckpt/v1/meta.grpc.pb.h"
#include "common/grpc_security.h"
#include "common/lock_check.h"
#include "server/rpc/agent_convert.h"
#include "server/rpc/status_convert.h"

namespace ckpt::rpc {
namespace {

using agent::AgentTask;
using agent::TaskKind;

AgentTask TaskFromProto(const v1::Task& t) {
  AgentTask a;
  a.id = t.task_id();
  a.attempt = t.attempt();
  a.priority = t.priority();
  switch (t.kind_case()) {
    case v1::Task::kFlush:
      a.kind = TaskKind::kFlush;
      a.kind_name = "flush";
      a.job_id = t.flush().job_id();
      a.step = t.flush().step();
      a.durable_dir = t.flush().durable_dir();
      for (const v1::FlushShard& s : t.flush().shards()) {
        a.flush.push_back(agent::FlushOrder{s.rank(), s.durable_path(), s.size_bytes(), s.crc32c()});
      }
      break;
    case v1::Task::kCommitDurable:
      a.kind = TaskKind::kCommitDurable;
      a.kind_name = "commit_durable";
      a.job_id = t.commit_durable().job_id();
      a.step = t.commit_durable().step();
      a.durable_dir = t.commit_durable().durable_dir();
      a.world_size = t.commit_durable().world_size();
      break;
    case v1::Task::kEvict:
      a.kind = TaskKind::kEvict;
      a.kind_name = "evict";
      a.job_id = t.evict().job_id();
      a.step = t.evict().step();
      break;
    case v1::Task::kDrop:
      a.kind = TaskKind::kDrop;
      a.kind_name = "drop";
      a.reason = t.drop().reason();
      for (const v1::InventoryEntry& e : t.drop().entries()) {
        if (e.has_shard()) a.drop.push_back(agent::ShardId{e.shard().job_id(), e.shard().step(), e.shard().rank()});
        if (e.has_segment()) a.drop_segments.push_back(SegmentIdFromProto(e.segment()));
      }
      break;
    case v1::Task::kDeleteDurable:
      a.kind = TaskKind::kDeleteDurable;
      a.kind_name = "delete_durable";
      a.job_id = t.delete_durable().job_id();
      a.step = t.delete_durable().step();
      a.durable_dir = t.delete_durable().durable_dir();
      break;
    case v1::Task::kReplicate:
      a.kind = TaskKind::kReplicate;
      a.kind_name = "replicate";
      a.job_id = t.replicate().job_id();
      a.step = t.replicate().step();
      a.ranks.assign(t.replicate().ranks().begin(), t.replicate().ranks().end());
      for (const v1::NodeEndpoint& e : t.replicate().targets()) a.targets.push_back(EndpointFromProto(e));
      break;
    case v1::Task::kEcEncode:
      a.kind = TaskKind::kEcEncode;
      a.kind_name = "ec_encode";
      a.job_id = t.ec_encode().job_id();
      a.step = t.ec_encode().step();
      a.group = EcGroupFromProto(t.ec_encode().group());
      for (const v1::NodeBlob& b : t.ec_encode().blobs()) a.blobs.push_back(NodeBlobFromProto(b));
      for (const v1::NodeEndpoint& e : t.ec_encode().members()) a.members.push_back(EndpointFromProto(e));
      break;
    case v1::Task::kRebuildSegments:
      a.kind = TaskKind::kRebuildSegments;
      a.kind_name = "rebuild_segments";
      a.job_id = t.rebuild_segments().job_id();
      a.step = t.rebuild_segments().step();
      a.data_k = t.rebuild_segments().data_k();
      a.parity_m = t.rebuild_segments().parity_m();
      for (const v1::SegmentRebuild& r : t.rebuild_segments().segments()) {
        agent::SegmentRebuild o;
        o.target = SegmentIdFromProto(r.target());
        o.kind = SegmentKindFromProto(r.kind());
        o.length_bytes = r.length_bytes();
        o.stripe_length_bytes = r.stripe_length_bytes();
        if (r.has_expected_crc32c()) o.expected_crc32c = r.expected_crc32c();
        for (const v1::SegmentLocation& l : r.sources()) o.sources.push_back(SegmentLocationFromProto(l));
        a.rebuilds.push_back(std::move(o));
      }
      break;
    default:
      a.kind_name = "unknown";
  }
  return a;
}

// After meta restarts the agent must be back within a heartbeat or two, not
// after gRPC's default reconnect backoff (which grows to 2 minutes).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
  grpc::ChannelArguments args;
  SetReconnectArgs(&args, address);
  SetFailoverArgs(address, &args);
  return grpc::CreateCustomChannel(
      GrpcTargetOf(address), credentials != nullptr ? credentials : grpc::InsecureChannelCredentials(), args);
}

class GrpcMetaLink : public agent::MetaLink {
 public:
  GrpcMetaLink(const std::string& address, absl::Duration timeout,
               const std::shared_ptr<grpc::ChannelCredentials>& credentials, std::string token)
      : token_(std::move(token)),
        stub_(v1::MetaService::NewStub(MakeChannel(address, credentials))),
        timeout_(timeout) {}

  absl::StatusOr<agent::RegistrationReply> Register(const agent::NodeRegistration& n) override {
    AssertNoCheckedLock("an RPC to meta");
    v1::RegisterNodeRequest req;
    req.set_node_id(n.node_id);
    req.set_grpc_address(n.grpc_address);
    req.set_data_address(n.data_address);
    req.set_role(n.host_node_id.empty() ? v1::NODE_ROLE_HOST : v1::NODE_ROLE_DPU);
    req.set_host_node_id(n.host_node_id);
    req.set_memory_capacity_bytes(n.memory_capacity_bytes);
    req.set_failure_domain(n.failure_domain);
    req.set_agent_version(n.agent_version);
    req.set_previous_incarnation(n.previous_incarnation);
    v1::RegisterNodeResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    absl::Status s = FromGrpcStatus(stub_->RegisterNode(&ctx, req, &resp));
    if (!s.ok()) return s;
    return agent::RegistrationReply{resp.incarnation(), resp.lease_ms(), resp.heartbeat_interval_ms(),
                                    resp.meta_instance_id(), resp.data_plane_key()};
  }

  absl::StatusOr<agent::HeartbeatReply> Heartbeat(const std::string& node_id, uint64_t incarnation,
                                                  const agent::LoadReport& load) override {
    AssertNoCheckedLock("an RPC to meta");
    v1::HeartbeatRequest req;
    req.set_node_id(node_id);
    req.set_incarnation(incarnation);
    req.set_memory_capacity_bytes(load.memory_capacity_bytes);
    req.set_memory_used_bytes(load.memory_used_bytes);
    req.set_memory_free_bytes(load.memory_free_bytes);
    req.set_memory_leased_bytes(load.memory_leased_bytes);
    req.set_flush_lag_bytes(load.flush_lag_bytes);
    req.set_flush_lag_ms(load.flush_lag_ms);
    req.set_flush_errors_total(load.flush_errors_total);
    req.set_membership_generation(load.membership_generation);
    req.set_stopping(load.stopping);
    for (const agent::RunningTask& t : load.running) {
      v1::TaskProgress* p = req.add_running_tasks();
      p->set_task_id(t.task_id);
      p->set_attempt(t.attempt);
      p->set_bytes_done(t.bytes_done);
      p->set_bytes_total(t.bytes_total);
    }
    v1::HeartbeatResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    absl::Status s = FromGrpcStatus(stub_->Heartbeat(&ctx, req, &resp));
    if (!s.ok()) return s;
    agent::HeartbeatReply r;
    r.node_state = static_cast<agent::NodeState>(resp.node_state());
    r.inventory_required = resp.inventory_required();
    r.lease_ms = resp.lease_ms();
    r.heartbeat_ms = resp.heartbeat_interval_ms();
    r.meta_instance_id = resp.meta_instance_id();
    for (const v1::Task& t : resp.tasks()) r.tasks.push_back(TaskFromProto(t));
    r.cancelled_task_ids.assign(resp.cancelled_task_ids().begin(), resp.cancelled_task_ids().end());
    r.membership_generation = resp.membership_generation();
    if (resp.members_included()) {
      std::vector<agent::Member>& members = r.members.emplace();
      members.reserve(resp.members_size());
      for (const v1::Member& m : resp.members()) members.push_back(agent::Member{m.node_id(), m.incarnation()});
    }
    return r;
  }

  absl::StatusOr<agent::InventoryReply> ReportInventory(const std::string& node_id, uint64_t incarnation,
                                                        const std::vector<agent::InventoryItem>& items) override {
    AssertNoCheckedLock("an RPC to meta");
    v1::ReportInventoryRequest req;
    req.set_node_id(node_id);
    req.set_incarnation(incarnation);
    for (const agent::InventoryItem& i : items) {
      v1::InventoryEntry* e = req.add_entries();
      if (i.is_segment) {
        SegmentIdToProto(i.segment, e->mutable_segment());
        e->set_segment_kind(static_cast<v1::SegmentKind>(i.segment_kind));
      } else {
        ShardIdToProto(i.id, e->mutable_shard());
        e->set_role(static_cast<v1::CopyRole>(i.role));
      }
      e->set_size_bytes(i.size_bytes);
      e->set_crc32c(i.crc32c);
      e->set_manifest_digest(i.manifest_digest);
      e->set_state(static_cast<v1::CopyState>(i.state));
      e->set_stored_unix_ms(i.stored_unix_ms);
      e->set_durable_path(i.durable_path);
    }
    v1::ReportInventoryResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    absl::Status s = FromGrpcStatus(stub_->ReportInventory(&ctx, req, &resp));
    if (!s.ok()) return s;
    agent::InventoryReply r;
    r.kept = resp.kept();
    for (const v1::InventoryDecision& d : resp.decisions()) {
      if (d.entry().has_segment() && d.action() == v1::INVENTORY_ACTION_DROP) {
        r.drop_segments.push_back(SegmentIdFromProto(d.entry().segment()));
      }
      if (!d.entry().has_shard()) continue;
      const agent::ShardId id{d.entry().shard().job_id(), d.entry().shard().step(), d.entry().shard().rank()};
      if (d.action() == v1::INVENTORY_ACTION_DROP) r.drop.push_back(id);
      if (d.action() == v1::INVENTORY_ACTION_UNKNOWN) r.unknown.push_back(id);
    }
    return r;
  }

  absl::StatusOr<uint32_t> JobWorldSize(const std::string& job_id) override {
    AssertNoCheckedLock("an RPC to meta");
    v1::GetJobRequest req;
    req.set_job_id(job_id);
    v1::GetJobResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    absl::Status s = FromGrpcStatus(stub_->GetJob(&ctx, req, &resp));
    if (!s.ok()) return s;
    return resp.job().spec().world_size();
  }

  absl::StatusOr<uint32_t> BeginVersion(const std::string& job_id, uint64_t step, const std::string& run_id,
                                        const std::string& node_id) override {
    AssertNoCheckedLock("an RPC to meta");
    v1::BeginVersionRequest req;
    req.set_job_id(job_id);
    req.set_step(step);
    req.set_run_id(run_id);
    req.set_node_id(node_id);
    v1::BeginVersionResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    absl::Status s = FromGrpcStatus(stub_->BeginVersion(&ctx, req, &resp));
    if (!s.ok()) return s;
    return resp.version().world_size();
  }

  absl::StatusOr<agent::ReportReply> ReportShards(const std::string& node_id, uint64_t incarnation,
                                                  const std::vector<agent::HoldingReport>& reports) override {
    AssertNoCheckedLock("an RPC to meta");
    v1::ReportShardsRequest req;
    req.set_node_id(node_id);
    req.set_incarnation(incarnation);
    for (const agent::HoldingReport& r : reports) {
      v1::ShardReport* out = req.add_reports();
      switch (r.kind) {
        case agent::HoldingReport::Kind::kStaged: {
          v1::StagedReport* st = out->mutable_staged();
          RecordToShardInfo(*r.record, node_id, /*with_items=*/true, st->mutable_shard());
          st->set_run_id(r.record->run_id);
          break;
        }
        case agent::HoldingReport::Kind::kPersisted: {
          v1::PersistedReport* p = out->mutable_persisted();
          ShardIdToProto(r.id, p->mutable_key());
          p->set_durable_path(r.durable_path);
          p->set_size_bytes(r.size_bytes);
          p->set_crc32c(r.crc32c);
          p->set_task_id(r.task_id);
          break;
        }
        case agent::HoldingReport::Kind::kCopyState: {
          v1::CopyReport* c = out->mutable_copy();
          ShardIdToProto(r.id, c->mutable_key());
          c->set_role(static_cast<v1::CopyRole>(r.copy_role));
          c->set_state(static_cast<v1::CopyState>(r.copy_state));
          c->set_size_bytes(r.size_bytes);
          c->set_crc32c(r.crc32c);
          c->set_task_id(r.task_id);
          c->set_detail(r.detail);
          break;
        }
        case agent::HoldingReport::Kind::kSegment: {
          v1::SegmentReport* g = out->mutable_segment();
          SegmentIdToProto(r.segment, g->mutable_key());
          g->set_kind(static_cast<v1::SegmentKind>(r.segment_kind));
          g->set_state(static_cast<v1::CopyState>(r.copy_state));
          g->set_length_bytes(r.size_bytes);
          g->set_crc32c(r.crc32c);
          g->set_task_id(r.task_id);
          g->set_detail(r.detail);
          break;
        }
      }
    }
    v1::ReportShardsResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    absl::Status s = FromGrpcStatus(stub_->ReportShards(&ctx, req, &resp));
    if (!s.ok()) return s;
    agent::ReportReply r;
    for (const v1::EntryStatus& e : resp.results()) {
      absl::StatusOr<absl::Status> st = StatusFromProto(e, "results");
      r.results.push_back(st.ok() ? *st : st.status());
    }
    for (const v1::Task& t : resp.tasks()) r.tasks.push_back(TaskFromProto(t));
    return r;
  }

  absl::Status ReportTaskResult(const std::string& node_id, uint64_t incarnation, const std::string& task_id,
                                uint32_t attempt, const absl::Status& result, uint64_t bytes_processed,
                                int64_t duration_ms) override {
    AssertNoCheckedLock("an RPC to meta");
    v1::ReportTaskResultRequest req;
    req.set_node_id(node_id);
    req.set_incarnation(incarnation);
    req.set_task_id(task_id);
    req.set_attempt(attempt);
    ToProto(result, req.mutable_status());
    req.set_bytes_processed(bytes_processed);
    req.set_duration_ms(duration_ms);
    v1::ReportTaskResultResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    return FromGrpcStatus(stub_->ReportTaskResult(&ctx, req, &resp));
  }

  absl::StatusOr<EvictFacts> GetEvictFacts(const std::string& job_id, uint64_t step) override {
    AssertNoCheckedLock("an RPC to meta");
    EvictFacts facts;
    {
      v1::GetVersionRequest req;
      req.set_job_id(job_id);
      req.set_step(step);
      v1::GetVersionResponse resp;
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      absl::Status s = FromGrpcStatus(stub_->GetVersion(&ctx, req, &resp));
      if (!s.ok()) return s;
      facts.version_state = resp.version().state();
    }
    v1::LatestRequest req;
    req.set_job_id(job_id);
    req.set_min_level(v1::DURABILITY_LEVEL_PROTECTED);
    v1::LatestResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    absl::Status s = FromGrpcStatus(stub_->Latest(&ctx, req, &resp));
    if (s.ok()) {
      facts.newest_protected_step = resp.version().step();
    } else if (!absl::IsNotFound(s)) {
      return s;
    }
    return facts;
  }

  absl::StatusOr<DurableManifest> GetVersionManifest(const std::string& job_id, uint64_t step) override {
    AssertNoCheckedLock("an RPC to meta");
    v1::GetVersionRequest req;
    req.set_job_id(job_id);
    req.set_step(step);
    req.set_include_items(true);
    v1::GetVersionResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    absl::Status s = FromGrpcStatus(stub_->GetVersion(&ctx, req, &resp));
    if (!s.ok()) return s;
    return ManifestFromVersion(resp.version());
  }

  absl::StatusOr<agent::LocatedShard> Locate(const agent::ShardId& id, const std::string& near_node_id) override {
    AssertNoCheckedLock("an RPC to meta");
    v1::LocateRequest req;
    req.set_job_id(id.job_id);
    req.set_step(id.step);
    req.set_rank(id.rank);
    req.set_near_node_id(near_node_id);
    v1::LocateResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    absl::Status s = FromGrpcStatus(stub_->Locate(&ctx, req, &resp));
    if (!s.ok()) return s;
    agent::LocatedShard out;
    out.shard.id = id;
    out.shard.size_bytes = resp.shard().size_bytes();
    out.shard.crc32c = resp.shard().crc32c();
    std::vector<ManifestItem> items;
    items.reserve(static_cast<size_t>(resp.shard().items_size()));
    for (const v1::Item& item : resp.shard().items()) items.push_back(ItemFromProto(item));
    agent::SetItems(out.shard, std::move(items));
    if (resp.shard().manifest_digest() != 0 && out.shard.manifest_digest != resp.shard().manifest_digest()) {
      return absl::DataLossError(absl::StrCat("meta's Locate answer for ", agent::ShardIdString(id),
                                              " has items that do not match its manifest digest"));
    }
    for (const v1::ShardSource& src : resp.sources()) {
      absl::StatusOr<agent::ShardSource> domain = ShardSourceFromProto(src);
      if (!domain.ok()) continue;  // a kind this agent does not know: not one it can read
      out.sources.push_back(*std::move(domain));
    }
    return out;
  }

  absl::Status WatchTasks(const std::string& node_id, uint64_t incarnation, const TaskPush& on_push) override {
    AssertNoCheckedLock("an RPC to meta");
    v1::WatchTasksRequest req;
    req.set_node_id(node_id);
    req.set_incarnation(incarnation);
    grpc::ClientContext ctx;
    AddToken(&ctx, token_);
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) return absl::CancelledError("agent stopping");
      watch_ctx_ = &ctx;
    }
    std::unique_ptr<grpc::ClientReader<v1::WatchTasksResponse>> reader = stub_->WatchTasks(&ctx, req);
    v1::WatchTasksResponse msg;
    while (reader->Read(&msg)) {
      std::vector<agent::AgentTask> tasks;
      for (const v1::Task& t : msg.tasks()) tasks.push_back(TaskFromProto(t));
      std::vector<agent::VersionNotice> versions;
      versions.reserve(static_cast<size_t>(msg.versions_size()));
      for (const v1::VersionNotice& n : msg.versions()) versions.push_back({n.job_id(), n.step(), n.staged()});
      on_push(std::move(tasks),
              std::vector<std::string>(msg.cancelled_task_ids().begin(), msg.cancelled_task_ids().end()),
              std::move(versions));
    }
    absl::Status s = FromGrpcStatus(reader->Finish());
    absl::MutexLock lock(&mu_);
    watch_ctx_ = nullptr;
    return s;
  }

  void CancelWatch() override {
    AssertNoCheckedLock("an RPC to meta");
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    if (watch_ctx_ != nullptr) watch_ctx_->TryCancel();
  }

 private:
  void SetDeadline(grpc::ClientContext* ctx) const {
    AssertNoCheckedLock("an RPC to meta");
    ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout_));
    AddToken(ctx, token_);
  }

  const std::string token_;
  std::unique_ptr<v1::MetaService::Stub> stub_;
  const absl::Duration timeout_;
  absl::Mutex mu_;
  grpc::ClientContext* watch_ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

std::unique_ptr<agent::MetaLink> NewGrpcMetaLink(const std::string& meta_address, absl::Duration rpc_timeout,
                                                 std::shared_ptr<grpc::ChannelCredentials> credentials,
                                                 std::string token) {
  return std::make_unique<GrpcMetaLink>(meta_address, rpc_timeout, credentials, std::move(token));
}

}  // namespace ckpt::rpc
