#include "server/rpc/agent_service.h"

#include <algorithm>
#include <map>
#include <optional>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/grpc_security.h"
#include "common/manifest.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "server/rpc/agent_convert.h"
#include "server/rpc/status_convert.h"

namespace ckpt::rpc {
namespace {

grpc::Status Invalid(const std::string& msg) { return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, msg); }

// ReadShard chunk sizes: below 4 KiB the per-message cost dominates; above
// 4 MiB a message no longer fits gRPC's default receive limit, and the agent
// would hold that much per stream.
constexpr uint64_t kDefaultChunk = 1 << 20;
constexpr uint64_t kMinChunk = 4 << 10;
constexpr uint64_t kMaxChunk = 4 << 20;
// The largest local copy a session request verifies (about 10 ms of crc32c
// here): the session's requests share one thread, which must not stall on a
// shard of GiBs; a larger one is verified over OpenShard.
constexpr uint64_t kSessionVerifyBytes = 64ull << 20;

}  // namespace

AgentServiceImpl::AgentServiceImpl(agent::Agent* agent, std::string data_transport, std::string admin_token,
                                   bool require_identity, std::string host_node)
    : agent_(agent),
      data_transport_(std::move(data_transport)),
      auth_(require_identity, CallerTokens{std::move(admin_token), "", {}}, std::move(host_node)) {}

absl::StatusOr<agent::PullSource> AgentServiceImpl::PullSourceFromProto(const v1::PullSource& p,
                                                                         const char* field) {
  if (p.worker_address().empty() || p.rkey().empty() || p.address() == 0 || p.length_bytes() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, " needs worker_address, rkey, address and length_bytes"));
  }
  return agent::PullSource{p.worker_address(), p.rkey(), p.address(), p.length_bytes()};
}

grpc::Status AgentServiceImpl::AcquireStagingLease(grpc::ServerContext* ctx, const v1::AcquireStagingLeaseRequest* req,
                                                   v1::AcquireStagingLeaseResponse* resp) {
  if (grpc::Status a = auth_.AgentPortCall(*ctx, req->job_id(), Access::kSave, "AcquireStagingLease"); !a.ok()) return a;
  return LeaseChecked(req, /*without_meta=*/false, resp);
}

grpc::Status AgentServiceImpl::LeaseChecked(const v1::AcquireStagingLeaseRequest* req, bool without_meta,
                                            v1::AcquireStagingLeaseResponse* resp) {
  // Checked here, before the agent reserves memory or begins the version at
  // meta: a step such as 2^64-1 would otherwise open a version that refuses
  // every later save of the job.
  if (absl::Status s = ValidateStep(req->step()); !s.ok()) return ToGrpcStatus(s);
  agent::LeaseRequest r;
  r.job_id = req->job_id();
  r.step = req->step();
  r.rank = req->rank();
  r.size_bytes = req->size_bytes();
  r.run_id = req->run_id();
  r.client_pid = req->client_pid();
  r.ttl_ms = req->ttl_ms();
  r.session_id = req->session_id();
  r.base_steps.assign(req->base_steps().begin(), req->base_steps().end());
  r.without_meta = without_meta;
  r.begin_at_commit = req->begin_at_commit();
  if (r.ttl_ms < 0) return Invalid("ttl_ms must not be negative");
  absl::StatusOr<agent::LeaseGrant> g = agent_->AcquireLease(r);
  if (!g.ok()) return ToGrpcStatus(g.status());
  resp->set_lease_id(g->lease_id);
  for (const agent::Region& region : g->regions) RegionToProto(region, resp->add_regions());
  resp->set_expires_in_ms(g->expires_in_ms);
  resp->set_item_alignment_bytes(g->item_alignment_bytes);
  resp->set_pull(g->pull);
  resp->set_pull_token(g->pull_token);
  return grpc::Status::OK;
}

grpc::Status AgentServiceImpl::CommitShard(grpc::ServerContext* ctx, const v1::CommitShardRequest* req,
                                           v1::CommitShardResponse* resp) {
  if (grpc::Status a = auth_.AgentPortCall(*ctx, "", Access::kSave, "CommitShard"); !a.ok()) return a;
  std::vector<ManifestItem> items;
  if (!req->manifest().empty()) {
    if (req->items_size() != 0) return Invalid("set either items or manifest, not both");
    absl::StatusOr<std::vector<ManifestItem>> decoded = DecodeManifest(req->manifest());
    if (!decoded.ok()) return ToGrpcStatus(decoded.status());
    items = *std::move(decoded);
  } else {
    items.reserve(static_cast<size_t>(req->items_size()));
    for (const v1::Item& item : req->items()) items.push_back(ItemFromProto(item));
  }
  std::optional<agent::PullSource> pull;
  if (req->has_pull_source()) {
    absl::StatusOr<agent::PullSource> p = PullSourceFromProto(req->pull_source(), "pull_source");
    if (!p.ok()) return ToGrpcStatus(p.status());
    pull = *std::move(p);
  }
  absl::StatusOr<std::shared_ptr<const agent::ShardRecord>> rec =
      agent_->Commit(req->lease_id(), req->size_bytes(), std::move(items), pull ? &*pull : nullptr, req->session_id());
  if (!rec.ok()) return ToGrpcStatus(rec.status());
  RecordToShardInfo(**rec, agent_->node_id(), /*with_items=*/false, resp->mutable_shard());
  return grpc::Status::OK;
}

grpc::Status AgentServiceImpl::AbortLease(grpc::ServerContext* ctx, const v1::AbortLeaseRequest* req,
                                          v1::AbortLeaseResponse*) {
  if (grpc::Status a = auth_.AgentPortCall(*ctx, "", Access::kSave, "AbortLease"); !a.ok()) return a;
  return ToGrpcStatus(agent_->AbortLease(req->lease_id(), req->session_id()));
}

grpc::Status AgentServiceImpl::OpenShard(grpc::ServerContext* ctx, const v1::OpenShardRequest* req,
                                         v1::OpenShardResponse* resp) {
  if (grpc::Status a = auth_.AgentPortCall(*ctx, req->key().job_id(), Access::kReadBytes, "OpenShard"); !a.ok()) return a;
  return OpenChecked(req, resp);
}

absl::StatusOr<std::string> AgentServiceImpl::OnSession(const std::string& session_id, std::string_view kind,
                                                        std::string_view request) {
  if (kind == "OPEN") return OpenOnSession(session_id, request);
  if (kind == "LEASE") return LeaseOnSession(session_id, request);
  return absl::InvalidArgumentError(absl::StrCat("unknown session request \"", std::string(kind), "\""));
}

absl::StatusOr<std::string> AgentServiceImpl::LeaseOnSession(const std::string& session_id,
                                                             std::string_view request) {
  v1::AcquireStagingLeaseRequest req;
  if (!req.ParseFromArray(request.data(), static_cast<int>(request.size()))) {
    return absl::InvalidArgumentError("the session request is not an AcquireStagingLeaseRequest");
  }
  req.set_session_id(session_id);  // the lease lives with this connection's session
  v1::AcquireStagingLeaseResponse resp;
  grpc::Status s = LeaseChecked(&req, /*without_meta=*/true, &resp);
  if (!s.ok()) return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  return resp.SerializeAsString();
}

absl::StatusOr<std::string> AgentServiceImpl::OpenOnSession(const std::string& session_id,
                                                            std::string_view request) {
  v1::OpenShardRequest req;
  if (!req.ParseFromArray(request.data(), static_cast<int>(request.size()))) {
    return absl::InvalidArgumentError("the session request is not an OpenShardRequest");
  }
  if (req.sources_size() != 0 || req.has_expected()) {
    return absl::InvalidArgumentError(
        "a session opens the local copy alone (no sources, no expected shard): use OpenShard");
  }
  req.set_session_id(session_id);  // the handle lives with this connection's session
  v1::OpenShardResponse resp;
  grpc::Status s = OpenChecked(&req, &resp, kSessionVerifyBytes);
  if (!s.ok()) return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  return resp.SerializeAsString();
}

grpc::Status AgentServiceImpl::OpenChecked(const v1::OpenShardRequest* req, v1::OpenShardResponse* resp,
                                           uint64_t verify_at_most_bytes) {
  absl::StatusOr<agent::ShardId> id = ShardIdFromProto(req->key(), "key");
  if (!id.ok()) return ToGrpcStatus(id.status());
  if (req->ttl_ms() < 0) return Invalid("ttl_ms must not be negative");
  agent::OpenRequest open;
  open.id = *id;
  open.skip_verify = req->skip_verify();
  open.verify_at_most_bytes = verify_at_most_bytes;
  open.client = agent::ClientRef{req->client_pid(), req->session_id()};
  open.ttl_ms = req->ttl_ms();
  if (req->has_expected() && req->expected().size_bytes() != 0) {
    agent::ShardRecord expected;
    expected.id = *id;
    expected.size_bytes = req->expected().size_bytes();
    expected.crc32c = req->expected().crc32c();  // (its items are not needed: see below)
    open.expected = std::move(expected);
  }
  // Sources other than LOCAL are read only as meta's Locate lists them, and
  // checked against meta's record of the shard, which the agent asks for
  // itself (agent::Restorer): `expected` checks a local copy only.
  for (const v1::ShardSource& src : req->sources()) {
    absl::StatusOr<agent::ShardSource> s = ShardSourceFromProto(src);
    if (!s.ok()) return ToGrpcStatus(s.status());
    open.sources.push_back(*std::move(s));
  }
  if (static_cast<size_t>(req->ranges_size()) > agent::kMaxOpenRanges) {
    return Invalid(absl::StrCat(req->ranges_size(), " byte ranges; at most ", agent::kMaxOpenRanges));
  }
  if (!agent_->delivers()) {
    for (const v1::ByteRange& r : req->ranges()) open.ranges.push_back(agent::ByteRange{r.offset(), r.length()});
  }
  absl::StatusOr<agent::OpenOutcome> r = agent_->Open(open);
  if (!r.ok()) return ToGrpcStatus(r.status());
  for (const agent::SourceAttempt& a : r->failed) {
    v1::SourceAttempt* attempt = resp->add_failed_sources();
    *attempt->mutable_source() = req->sources(static_cast<int>(a.index));
    ToProto(a.status, attempt->mutable_status());
  }
  if (r->served_by) {
    *resp->mutable_served_from() = req->sources(static_cast<int>(*r->served_by));
  } else {
    resp->mutable_served_from()->set_kind(v1::SOURCE_KIND_LOCAL);
  }
  const agent::OpenResult& o = r->result;
  resp->set_handle_id(o.handle_id);
  RecordToShardInfo(*o.shard.record, agent_->node_id(), /*with_items=*/!req->packed_manifest(),
                    resp->mutable_shard());
  if (req->packed_manifest()) resp->set_manifest(PackedManifest(*o.shard.record));
  if (agent_->delivers()) {
    resp->set_deliver(true);
    resp->set_deliver_token(agent_->DeliverToken(o.handle_id));
  } else {
    for (const agent::Region& region : o.shard.regions) RegionToProto(region, resp->add_regions());
  }
  resp->set_verified(o.verified);
  resp->set_ranges_only(o.ranges_only);
  resp->set_expires_in_ms(o.expires_in_ms);
  resp->set_version_staged(o.version_staged);
  return grpc::Status::OK;
}

grpc::Status AgentServiceImpl::DeliverShard(grpc::ServerContext* ctx, const v1::DeliverShardRequest* req,
                                            v1::DeliverShardResponse*) {
  if (grpc::Status a = auth_.AgentPortCall(*ctx, "", Access::kOwnHandle, "DeliverShard"); !a.ok()) return a;
  absl::StatusOr<agent::PullSource> target = PullSourceFromProto(req->target(), "target");
  if (!target.ok()) return ToGrpcStatus(target.status());
  return ToGrpcStatus(agent_->Deliver(req->handle_id(), *target, req->session_id()));
}

grpc::Status AgentServiceImpl::CloseShard(grpc::ServerContext* ctx, const v1::CloseShardRequest* req,
                                          v1::CloseShardResponse*) {
  if (grpc::Status a = auth_.AgentPortCall(*ctx, "", Access::kOwnHandle, "CloseShard"); !a.ok()) return a;
  return ToGrpcStatus(agent_->CloseShard(req->handle_id(), req->session_id()));
}

grpc::Status AgentServiceImpl::ReadShard(grpc::ServerContext* ctx, const v1::ReadShardRequest* req,
                                         grpc::ServerWriter<v1::ReadShardResponse>* writer) {
  if (grpc::Status a = auth_.AgentPortCall(*ctx, req->shard().job_id(), Access::kReadBytes, "ReadShard"); !a.ok()) return a;
  if (!req->has_shard()) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "reading EC segments is not built yet");
  }
  absl::StatusOr<agent::ShardId> id = ShardIdFromProto(req->shard(), "shard");
  if (!id.ok()) return ToGrpcStatus(id.status());
  const uint64_t chunk = req->chunk_bytes() == 0 ? kDefaultChunk : req->chunk_bytes();
  if (chunk < kMinChunk || chunk > kMaxChunk) {
    return Invalid(absl::StrCat("chunk_bytes ", chunk, " is out of range: a ReadShard message carries ",
                                kMinChunk, " to ", kMaxChunk, " bytes (0 means ", kDefaultChunk, ")"));
  }
  // Message 1 carries the shard's record only, so that no data message is
  // larger than chunk_bytes plus a few bytes of framing whatever the size of
  // the manifest. The data buffer (msg.data) is reused from chunk to chunk.
  agent::ShardRecord rec;
  bool header_sent = false;
  uint64_t offset = req->offset_bytes();
  v1::ReadShardResponse msg;
  std::string* buf = msg.mutable_data();
  buf->reserve(chunk);
  auto send_header = [&]() -> absl::Status {
    header_sent = true;
    v1::ReadShardResponse head;
    RecordToShardInfo(rec, agent_->node_id(), /*with_items=*/true, head.mutable_shard());
    head.set_offset_bytes(offset);
    if (!writer->Write(head)) return absl::CancelledError("client went away");
    return absl::OkStatus();
  };
  auto send_data = [&]() -> absl::Status {
    msg.set_offset_bytes(offset);
    msg.set_chunk_crc32c(Crc32c(*buf));
    if (!writer->Write(msg)) return absl::CancelledError("client went away");
    offset += buf->size();
    buf->clear();  // keeps its capacity
    return absl::OkStatus();
  };
  // The callback sees the record before the first piece.
  absl::Status s = agent_->ReadShard(
      *id, req->offset_bytes(), req->length_bytes(),
      [&](const std::byte* p, uint64_t n) -> absl::Status {
        if (ctx->IsCancelled()) return absl::CancelledError("client went away");
        if (!header_sent) CKPT_RETURN_IF_ERROR(send_header());
        while (n > 0) {
          const uint64_t take = std::min<uint64_t>(n, chunk - buf->size());
          buf->append(reinterpret_cast<const char*>(p), take);
          p += take;
          n -= take;
          if (buf->size() == chunk) CKPT_RETURN_IF_ERROR(send_data());
        }
        return absl::OkStatus();
      },
      &rec);
  if (!s.ok()) return ToGrpcStatus(s);
  if (!header_sent) s = send_header();
  if (s.ok() && !buf->empty()) s = send_data();
  return ToGrpcStatus(s);
}

grpc::Status AgentServiceImpl::GetInventory(grpc::ServerContext* ctx, const v1::GetInventoryRequest* req,
                                            v1::GetInventoryResponse* resp) {
  if (grpc::Status a = auth_.AgentPortCall(*ctx, req->job_id(), Access::kRead, "GetInventory"); !a.ok()) return a;
  std::optional<uint64_t> step;
  if (req->has_step()) step = req->step();
  const agent::AgentStatusSnapshot st = agent_->Status();
  resp->set_node_id(st.node_id);
  resp->set_incarnation(st.incarnation);
  for (const agent::HoldingInfo& h : agent_->Inventory(req->job_id(), step)) HoldingToProto(h, resp->add_entries());
  return grpc::Status::OK;
}

grpc::Status AgentServiceImpl::Flush(grpc::ServerContext* ctx, const v1::FlushRequest* req, v1::FlushResponse* resp) {
  if (grpc::Status a = auth_.AgentPortCall(*ctx, req->job_id(), Access::kWrite, "Flush"); !a.ok()) return a;
  std::vector<uint32_t> ranks(req->ranks().begin(), req->ranks().end());
  absl::StatusOr<std::vector<agent::FlushResult>> r = agent_->FlushNow(req->job_id(), req->step(), ranks);
  if (!r.ok()) return ToGrpcStatus(r.status());
  for (const agent::FlushResult& f : *r) {
    v1::ShardFlushResult* out = resp->add_results();
    out->set_rank(f.rank);
    out->set_durable_path(f.durable_path);
    ToProto(f.status, out->mutable_status());
  }
  return grpc::Status::OK;
}

grpc::Status AgentServiceImpl::Evict(grpc::ServerContext* ctx, const v1::EvictRequest* req, v1::EvictResponse* resp) {
  if (grpc::Status a = auth_.AgentPortCall(*ctx, req->job_id(), Access::kWrite, "Evict"); !a.ok()) return a;
  absl::StatusOr<std::vector<agent::HoldingInfo>> held = agent_->Evict(req->job_id(), req->step(), req->dry_run());
  if (!held.ok()) return ToGrpcStatus(held.status());
  uint64_t freed = 0;
  for (const agent::HoldingInfo& h : *held) {
    HoldingToProto(h, resp->add_evicted());
    freed += h.size_bytes;
  }
  resp->set_freed_bytes(freed);
  return grpc::Status::OK;
}

grpc::Status AgentServiceImpl::Verify(grpc::ServerContext* ctx, const v1::VerifyRequest* req, v1::VerifyResponse* resp) {
  if (grpc::Status a = auth_.AgentPortCall(*ctx, req->job_id(), Access::kRead, "Verify"); !a.ok()) return a;
  if (req->check_parity()) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "parity checks arrive with erasure coding");
  }
  uint64_t checked = 0;
  absl::StatusOr<std::vector<agent::VerifyFinding>> r = agent_->Verify(req->job_id(), req->step(), req->dry_run(), &checked);
  if (!r.ok()) return ToGrpcStatus(r.status());
  uint32_t problems = 0;
  for (const agent::VerifyFinding& f : *r) {
    v1::VerifyFinding* out = resp->add_findings();
    HoldingToProto(f.holding, out->mutable_holding());
    out->set_ok(f.ok);
    out->set_expected_crc32c(f.holding.crc32c);
    out->set_actual_crc32c(f.actual_crc32c);
    out->set_bad_item(f.bad_item);
    out->set_message(f.message);
    problems += f.ok ? 0 : 1;
  }
  resp->set_bytes_checked(checked);
  resp->set_problems(problems);
  return grpc::Status::OK;
}

grpc::Status AgentServiceImpl::PauseProtection(grpc::ServerContext* ctx, const v1::PauseProtectionRequest* req,
                                               v1::PauseProtectionResponse* resp) {
  if (grpc::Status a = auth_.AgentPortCall(*ctx, "", Access::kWrite, "PauseProtection"); !a.ok()) return a;
  absl::StatusOr<absl::Duration> left = agent_->PauseProtection(absl::Milliseconds(req->duration_ms()));
  if (!left.ok()) return ToGrpcStatus(left.status());
  resp->set_remaining_ms(absl::ToInt64Milliseconds(*left));
  return grpc::Status::OK;
}

grpc::Status AgentServiceImpl::AgentStatus(grpc::ServerContext* ctx, const v1::AgentStatusRequest*,
                                           v1::AgentStatusResponse* resp) {
  if (grpc::Status a = auth_.AgentPortCall(*ctx, "", Access::kRead, "AgentStatus"); !a.ok()) return a;
  const agent::AgentStatusSnapshot s = agent_->Status();
  resp->set_node_id(s.node_id);
  resp->set_incarnation(s.incarnation);
  resp->set_role(v1::NODE_ROLE_HOST);
  resp->set_agent_version("0.1.0");
  resp->set_uptime_ms(s.uptime_ms);
  resp->set_registered(s.registered);
  resp->set_meta_reachable(s.meta_reachable);
  resp->set_last_heartbeat_unix_ms(s.last_heartbeat_unix_ms);
  resp->set_lease_remaining_ms(s.lease_remaining_ms);
  resp->set_node_state(static_cast<v1::NodeState>(s.node_state));
  resp->set_memory_capacity_bytes(s.capacity_bytes);
  resp->set_memory_used_bytes(s.used_bytes);
  resp->set_memory_free_bytes(s.free_bytes);
  resp->set_memory_leased_bytes(s.leased_bytes);
  std::map<std::tuple<int, int>, std::pair<uint32_t, uint64_t>> counts;
  for (const agent::HoldingInfo& h : s.holdings) {
    auto& c = counts[{static_cast<int>(h.role), static_cast<int>(h.state)}];
    c.first++;
    c.second += h.size_bytes;
  }
  for (const auto& [key, c] : counts) {
    v1::HoldingCount* out = resp->add_holdings();
    out->set_role(static_cast<v1::CopyRole>(std::get<0>(key)));
    out->set_state(static_cast<v1::CopyState>(std::get<1>(key)));
    out->set_count(c.first);
    out->set_bytes(c.second);
  }
  resp->set_open_leases(s.open_leases);
  resp->set_open_handles(s.open_handles);
  resp->set_flush_pending_shards(s.flush_pending_shards);
  resp->set_flush_lag_bytes(s.flush_lag_bytes);
  resp->set_flush_lag_ms(s.flush_lag_ms);
  resp->set_flush_errors_total(s.flush_errors_total);
  resp->set_last_flush_error(s.last_flush_error);
  resp->set_last_flush_error_unix_ms(s.last_flush_error_unix_ms);
  for (const agent::RunningTask& t : s.running_tasks) {
    v1::TaskProgress* p = resp->add_running_tasks();
    p->set_task_id(t.task_id);
    p->set_attempt(t.attempt);
    p->set_bytes_done(t.bytes_done);
    p->set_bytes_total(t.bytes_total);
  }
  resp->set_memory_dir(s.memory_dir);
  resp->set_memory_dir_fs(s.memory_dir_fs);
  resp->set_memory_dir_in_memory(s.memory_dir_in_memory);
  resp->set_durable_root(s.durable_root);
  resp->set_data_transport(data_transport_);
  // A pull-mode agent's pool is not for trainers to map (on a DPU it is not
  // even on their machine): they stage shards in memory of their own. A
  // trainer behind a ckpt-dpu-proxy, which has no session socket, would
  // otherwise try to map it by this path.
  if (!agent_->delivers()) {
    resp->add_pool_files(s.pool_path);
    resp->add_pool_file_bytes(s.pool_bytes);
  }
  return grpc::Status::OK;
}

}  // namespace ckpt::rpc
