#include "server/rpc/meta_service.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/arena.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/grpc_security.h"
#include "common/log.h"
#include "server/rpc/meta_convert.h"

namespace ckpt::rpc {
namespace {

// WaitVersion never waits longer than this (meta.proto).
constexpr absl::Duration kMaxWait = absl::Hours(1);
// Long calls re-check cancellation and shutdown at least this often.
constexpr absl::Duration kPollSlice = absl::Seconds(1);
// An idle WatchTasks stream re-checks its incarnation every this many slices.
constexpr int kStaleCheckSlices = 5;

constexpr char kJobsTokenTag[] = "ckpt.jobs.1";
constexpr char kVersionsTokenTag[] = "ckpt.versions.1";

// Translates a failure for the caller. The core already explained it; the
// rpc layer only logs what is a bug (Internal, Unknown) above debug level.
grpc::Status Fail(const char* rpc, const absl::Status& status) {
  if (status.code() == absl::StatusCode::kInternal ||
      status.code() == absl::StatusCode::kUnknown) {
    log::Error("{} failed: {}", rpc, status.ToString());
  } else {
    log::Debug("{} failed: {}", rpc, status.ToString());
  }
  return ToGrpcStatus(status);
}

grpc::Status ShuttingDown(const char* rpc) {
  return Fail(rpc, absl::UnavailableError("ckpt-meta is shutting down; retry with backoff"));
}

uint32_t PageSize(uint32_t requested) {
  if (requested == 0) return kDefaultPageSize;
  return std::min(requested, kMaxPageSize);
}

absl::Status BadToken(const char* rpc) {
  return absl::InvalidArgumentError(
      absl::StrCat("page_token is not a ", rpc,
                   " token from this server; pass the previous response's next_page_token "
                   "unchanged, or an empty token for the first page"));
}

std::string EncodeJobsToken(const std::string& last_job_id) {
  return absl::WebSafeBase64Escape(absl::StrCat(kJobsTokenTag, "\n", last_job_id));
}

absl::StatusOr<std::string> DecodeJobsToken(const std::string& token) {
  std::string raw;
  if (!absl::WebSafeBase64Unescape(token, &raw)) return BadToken("ListJobs");
  const std::string prefix = absl::StrCat(kJobsTokenTag, "\n");
  if (raw.size() <= prefix.size() || raw.compare(0, prefix.size(), prefix) != 0) {
    return BadToken("ListJobs");
  }
  return raw.substr(prefix.size());
}

std::string EncodeVersionsToken(const std::string& job_id, bool newest_first, uint64_t step) {
  return absl::WebSafeBase64Escape(
      absl::StrCat(kVersionsTokenTag, "\n", job_id, "\n", newest_first ? "d" : "a", "\n", step));
}

absl::StatusOr<uint64_t> DecodeVersionsToken(const std::string& token, const std::string& job_id,
                                             bool newest_first) {
  std::string raw;
  if (!absl::WebSafeBase64Unescape(token, &raw)) return BadToken("ListVersions");
  std::vector<std::string> parts = absl::StrSplit(raw, '\n');
  uint64_t step = 0;
  if (parts.size() != 4 || parts[0] != kVersionsTokenTag || !absl::SimpleAtoi(parts[3], &step) ||
      (parts[2] != "a" && parts[2] != "d")) {
    return BadToken("ListVersions");
  }
  if (parts[1] != job_id) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_token belongs to a listing of job \"", parts[1],
                     "\", not of job_id \"", job_id, "\""));
  }
  if ((parts[2] == "d") != newest_first) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page_token was issued for newest_first=", parts[2] == "d" ? "true" : "false",
        "; keep newest_first unchanged while paging"));
  }
  return step;
}

// Appends the bundles to `tasks`; a bundle the core resolved inconsistently is
// logged and left out (it is re-delivered on the next heartbeat or stream
// open, so one bad task does not starve the node of the others).
void AppendTasks(const char* rpc, const std::vector<meta::TaskBundle>& bundles,
                 google::protobuf::RepeatedPtrField<v1::Task>* tasks) {
  for (const meta::TaskBundle& bundle : bundles) {
    v1::Task task;
    absl::Status s = TaskToProto(bundle, &task);
    if (!s.ok()) {
      log::Error("{}: cannot send task: {}", rpc, s.ToString());
      continue;
    }
    *tasks->Add() = std::move(task);
  }
}

absl::Duration UntilDeadline(const grpc::ServerContext* ctx) {
  const auto deadline = ctx->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteDuration();
  const auto now = std::chrono::system_clock::now();
  if (deadline <= now) return absl::ZeroDuration();
  return absl::FromChrono(
      std::chrono::duration_cast<std::chrono::microseconds>(deadline - now));
}

// Allocates a call's request and response on one protobuf Arena whose first
// block lives in the holder itself: parsing a report and building its answer
// then take no heap allocation in the common case. Released holders are reset
// and kept for reuse (up to kMaxPooled), so steady-state calls touch warm
// memory and never reach malloc. Thread-safe: gRPC allocates and releases from
// any of its threads. Destroying the allocator frees the pooled holders;
// every holder must have been released by then (the server has stopped).
template <typename Request, typename Response>
class ArenaMessageAllocator final : public grpc::MessageAllocator<Request, Response> {
 public:
  ArenaMessageAllocator() = default;
  ArenaMessageAllocator(const ArenaMessageAllocator&) = delete;
  ArenaMessageAllocator& operator=(const ArenaMessageAllocator&) = delete;
  ~ArenaMessageAllocator() override {
    for (Holder* h : free_) delete h;
  }

  grpc::MessageHolder<Request, Response>* AllocateMessages() override {
    {
      absl::MutexLock lock(&mu_);
      if (!free_.empty()) {
        Holder* h = free_.back();
        free_.pop_back();
        return h;
      }
    }
    return new Holder(this);
  }

 private:
  // Fits the request and response of a ReportShards with a node's 8 ranks;
  // larger calls spill into blocks the arena allocates and frees itself.
  static constexpr size_t kInitialBlockBytes = 8 * 1024;
  // One per call in flight with 1,024 ranks reporting at once: 8 MiB.
  static constexpr size_t kMaxPooled = 1024;

  class Holder final : public grpc::MessageHolder<Request, Response> {
   public:
    explicit Holder(ArenaMessageAllocator* owner) : owner_(owner), arena_(Options(block_)) {
      NewMessages();
    }
    void Release() override { owner_->Recycle(this); }
    // Destroys the messages (and frees any extra arena blocks), then makes
    // fresh ones in the kept first block.
    void Reset() {
      arena_.Reset();
      NewMessages();
    }

   private:
    static google::protobuf::ArenaOptions Options(char* block) {
      google::protobuf::ArenaOptions options;
      options.initial_block = block;
      options.initial_block_size = kInitialBlockBytes;
      return options;
    }
    void NewMessages() {
      this->set_request(google::protobuf::Arena::CreateMessage<Request>(&arena_));
      this->set_response(google::protobuf::Arena::CreateMessage<Response>(&arena_));
    }
    ArenaMessageAllocator* const owner_;
    alignas(16) char block_[kInitialBlockBytes];  // before arena_: it is the arena's first block
    google::protobuf::Arena arena_;
  };

  void Recycle(Holder* h) {
    h->Reset();
    {
      absl::MutexLock lock(&mu_);
      if (free_.size() < kMaxPooled) {
        free_.push_back(h);
        return;
      }
    }
    delete h;
  }

  absl::Mutex mu_;
  std::vector<Holder*> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::Status MetaServiceImpl::WaitTimedOut(const std::string& job_id, uint64_t step,
                                           meta::Level level, absl::Duration waited) const {
  absl::StatusOr<meta::Version> v = core_->GetVersion(job_id, step, /*include_items=*/false);
  if (!v.ok()) return v.status();  // e.g. deleted meanwhile: NOT_FOUND says so
  return absl::DeadlineExceededError(absl::StrCat(
      "version ", job_id, "/", step, " did not reach ", meta::LevelName(level), " within ",
      absl::FormatDuration(waited), "; it is ", meta::VersionStateName(v->state), " with ",
      v->shards.size(), " of ", v->world_size, " shards staged"));
}

MetaServiceImpl::MetaServiceImpl(meta::MetaCore* core, Clock* clock, CallerTokens tokens, bool require_identity)
    : core_(core),
      clock_(clock),
      auth_(require_identity, std::move(tokens)),
      report_allocator_(std::make_unique<ArenaMessageAllocator<v1::ReportShardsRequest,
                                                               v1::ReportShardsResponse>>()),
      heartbeat_allocator_(
          std::make_unique<ArenaMessageAllocator<v1::HeartbeatRequest, v1::HeartbeatResponse>>()) {
  SetMessageAllocatorFor_ReportShards(report_allocator_.get());
  SetMessageAllocatorFor_Heartbeat(heartbeat_allocator_.get());
}
MetaServiceImpl::~MetaServiceImpl() = default;

void MetaServiceImpl::Shutdown() { shutting_down_.store(true, std::memory_order_release); }

// ---------------------------------------------------------------------------
// Nodes and leases

grpc::Status MetaServiceImpl::RegisterNode(grpc::ServerContext* ctx,
                                           const v1::RegisterNodeRequest* req,
                                           v1::RegisterNodeResponse* resp) {
  if (grpc::Status a = AgentCall(*ctx, req->node_id(), "RegisterNode"); !a.ok()) return a;
  absl::StatusOr<meta::RegisterRequest> request = RegisterFromProto(*req);
  if (!request.ok()) return Fail("RegisterNode", request.status());
  // A DPU's claim of the host it serves (placement's failure domain, the
  // host whose proxy it takes trainers from) must be its certificate's.
  if (grpc::Status a = auth_.HostClaim(*ctx, req->host_node_id(), "RegisterNode"); !a.ok()) return a;
  absl::StatusOr<meta::RegisterResult> result = core_->RegisterNode(*request);
  if (!result.ok()) return Fail("RegisterNode", result.status());
  ToProto(*result, resp);
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* MetaServiceImpl::Heartbeat(grpc::CallbackServerContext* ctx,
                                                     const v1::HeartbeatRequest* req,
                                                     v1::HeartbeatResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (grpc::Status a = AgentCall(*ctx, req->node_id(), "Heartbeat"); !a.ok()) {
    reactor->Finish(a);
    return reactor;
  }
  uint64_t seq = 0;
  absl::StatusOr<meta::HeartbeatResult> result =
      core_->SubmitHeartbeat(HeartbeatFromProto(*req), &seq);
  if (!result.ok()) {
    reactor->Finish(Fail("Heartbeat", result.status()));
    return reactor;
  }
  resp->set_lease_ms(absl::ToInt64Milliseconds(result->lease));
  resp->set_heartbeat_interval_ms(absl::ToInt64Milliseconds(result->heartbeat_interval));
  resp->set_node_state(ToProto(result->node_state));
  resp->set_meta_instance_id(result->meta_instance_id);
  resp->set_inventory_required(result->inventory_required);
  AppendTasks("Heartbeat", result->tasks, resp->mutable_tasks());
  for (const std::string& id : result->cancelled_task_ids) resp->add_cancelled_task_ids(id);
  resp->set_membership_generation(result->membership_generation);
  if (result->members) {
    resp->set_members_included(true);
    for (const meta::Member& m : *result->members) {
      v1::Member* out = resp->add_members();
      out->set_node_id(m.node_id);
      out->set_incarnation(m.incarnation);
    }
  }
  // The answer leaves only once the change is durable.
  core_->WhenDurable(seq, [reactor](absl::Status durable) {
    reactor->Finish(durable.ok() ? grpc::Status::OK : Fail("Heartbeat", durable));
  });
  return reactor;
}

grpc::Status MetaServiceImpl::WatchTasks(grpc::ServerContext* ctx,
                                         const v1::WatchTasksRequest* req,
                                         grpc::ServerWriter<v1::WatchTasksResponse>* writer) {
  if (shutting_down()) return ShuttingDown("WatchTasks");
  if (grpc::Status a = AgentCall(*ctx, req->node_id(), "WatchTasks"); !a.ok()) return a;
  const std::string& node = req->node_id();
  const uint64_t incarnation = req->incarnation();

  // Take the generation before reading the tasks so that a task created in
  // between wakes the first wait instead of being missed.
  uint64_t generation = core_->WaitForTaskChange(0, absl::ZeroDuration());

  // (task id, attempt) sent on this stream, limited to unfinished tasks.
  std::set<std::pair<std::string, uint32_t>> sent;
  bool first = true;
  int idle_slices = 0;  // wake-ups in a row without a task change
  for (;;) {
    std::vector<meta::VersionNotice> notices;
    absl::StatusOr<std::vector<meta::TaskBundle>> pending =
        core_->PendingTasks(node, incarnation, /*all=*/true, &notices);
    if (!pending.ok()) return Fail("WatchTasks", pending.status());

    // Every unfinished (id, attempt) counts as sent from now on, including a
    // bundle AppendTasks had to leave out (logged once per stream, not once
    // per wake-up); what finished is forgotten, which keeps `sent` bounded.
    std::set<std::pair<std::string, uint32_t>> unfinished;
    std::vector<meta::TaskBundle> fresh;
    for (meta::TaskBundle& bundle : *pending) {
      auto key = std::make_pair(bundle.task.id, bundle.task.attempt);
      if (sent.count(key) == 0) fresh.push_back(std::move(bundle));
      unfinished.insert(std::move(key));
    }
    sent = std::move(unfinished);
    v1::WatchTasksResponse response;
    AppendTasks("WatchTasks", fresh, response.mutable_tasks());
    for (meta::VersionNotice& n : notices) {
      v1::VersionNotice* out = response.add_versions();
      out->set_job_id(std::move(n.job_id));
      out->set_step(n.step);
      out->set_staged(n.staged);
    }

    // The first message goes out even when empty: it tells the agent the
    // stream is established.
    if (first || response.tasks_size() > 0 || response.versions_size() > 0) {
      if (!writer->Write(response)) {
        log::Debug("WatchTasks: stream of node {} closed by the client", node);
        return grpc::Status(grpc::StatusCode::CANCELLED, "the client closed the stream");
      }
      first = false;
    }

    // Wait for a task change. Without one, re-read the tasks only every
    // kStaleCheckSlices wake-ups: that is what notices a stale incarnation
    // (a node declared DEAD need not change any task), and it keeps idle
    // streams from copying task bundles every second.
    for (;;) {
      if (shutting_down()) return ShuttingDown("WatchTasks");
      if (ctx->IsCancelled()) {
        return grpc::Status(grpc::StatusCode::CANCELLED, "the client cancelled the stream");
      }
      const uint64_t seen = generation;
      generation = core_->WaitForTaskChange(seen, kPollSlice);
      if (generation != seen || ++idle_slices >= kStaleCheckSlices) break;
    }
    idle_slices = 0;
  }
}

grpc::Status MetaServiceImpl::ReportTaskResult(grpc::ServerContext* ctx,
                                               const v1::ReportTaskResultRequest* req,
                                               v1::ReportTaskResultResponse* resp) {
  if (grpc::Status a = AgentCall(*ctx, req->node_id(), "ReportTaskResult"); !a.ok()) return a;
  absl::StatusOr<absl::Status> outcome = StatusFromProto(req->status(), "status");
  if (!outcome.ok()) return Fail("ReportTaskResult", outcome.status());
  absl::StatusOr<meta::TaskDisposition> disposition = core_->ReportTaskResult(
      req->node_id(), req->incarnation(), req->task_id(), req->attempt(), *outcome);
  if (!disposition.ok()) return Fail("ReportTaskResult", disposition.status());
  resp->set_disposition(ToProto(*disposition));
  return grpc::Status::OK;
}

grpc::Status MetaServiceImpl::ReportInventory(grpc::ServerContext* ctx,
                                              const v1::ReportInventoryRequest* req,
                                              v1::ReportInventoryResponse* resp) {
  if (grpc::Status a = AgentCall(*ctx, req->node_id(), "ReportInventory"); !a.ok()) return a;
  // The list must be complete (missing holdings become LOST), so one bad
  // entry rejects the whole report.
  std::vector<meta::Holding> holdings;
  holdings.reserve(static_cast<size_t>(req->entries_size()));
  for (int i = 0; i < req->entries_size(); ++i) {
    absl::StatusOr<meta::Holding> h =
        HoldingFromProto(req->entries(i), absl::StrCat("entries[", i, "]"));
    if (!h.ok()) return Fail("ReportInventory", h.status());
    holdings.push_back(*std::move(h));
  }
  absl::StatusOr<meta::InventoryResult> result =
      core_->ReportInventory(req->node_id(), req->incarnation(), holdings);
  if (!result.ok()) return Fail("ReportInventory", result.status());
  ToProto(*result, resp);
  return grpc::Status::OK;
}

grpc::Status MetaServiceImpl::DrainNode(grpc::ServerContext* ctx, const v1::DrainNodeRequest* req,
                                        v1::DrainNodeResponse* resp) {
  if (grpc::Status a = AdminCall(*ctx, "DrainNode"); !a.ok()) return a;
  absl::StatusOr<meta::Node> node = core_->DrainNode(req->node_id());
  if (!node.ok()) return Fail("DrainNode", node.status());
  ToProto(*node, resp->mutable_node());
  return grpc::Status::OK;
}

grpc::Status MetaServiceImpl::UndrainNode(grpc::ServerContext* ctx, const v1::UndrainNodeRequest* req,
                                          v1::UndrainNodeResponse* resp) {
  if (grpc::Status a = AdminCall(*ctx, "UndrainNode"); !a.ok()) return a;
  absl::StatusOr<meta::Node> node = core_->UndrainNode(req->node_id());
  if (!node.ok()) return Fail("UndrainNode", node.status());
  ToProto(*node, resp->mutable_node());
  return grpc::Status::OK;
}

grpc::Status MetaServiceImpl::RemoveNode(grpc::ServerContext* ctx, const v1::RemoveNodeRequest* req,
                                         v1::RemoveNodeResponse*) {
  if (grpc::Status a = AdminCall(*ctx, "RemoveNode"); !a.ok()) return a;
  absl::Status s = core_->RemoveNode(req->node_id());
  if (!s.ok()) return Fail("RemoveNode", s);
  return grpc::Status::OK;
}

grpc::Status MetaServiceImpl::ListNodes(grpc::ServerContext* ctx, const v1::ListNodesRequest* req,
                                        v1::ListNodesResponse* resp) {
  if (grpc::Status a = JobCall(*ctx, std::string(), "ListNodes"); !a.ok()) return a;
  std::vector<meta::NodeState> states;
  for (int i = 0; i < req->states_size(); ++i) {
    absl::StatusOr<meta::NodeState> state =
        NodeStateFromProto(req->states(i), absl::StrCat("states[", i, "]"));
    if (!state.ok()) return Fail("ListNodes", state.status());
    states.push_back(*state);
  }
  if (states.empty()) {  // all, spelled out so the meaning does not hang on the core
    states = {meta::NodeState::kAlive, meta::NodeState::kSuspect, meta::NodeState::kDead,
              meta::NodeState::kDraining, meta::NodeState::kLeft};
  }
  absl::StatusOr<std::vector<meta::Node>> nodes = core_->ListNodes(states);
  if (!nodes.ok()) return Fail("ListNodes", nodes.status());
  for (const meta::Node& node : *nodes) ToProto(node, resp->add_nodes());
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------
// Jobs and placement

grpc::Status MetaServiceImpl::CreateJob(grpc::ServerContext* ctx, const v1::CreateJobRequest* req,
                                        v1::CreateJobResponse* resp) {
  if (grpc::Status a = JobCall(*ctx, req->spec().job_id(), "CreateJob", Access::kWrite); !a.ok()) return a;
  if (!req->has_spec()) {
    return Fail("CreateJob", absl::InvalidArgumentError(
                                 "spec is required: job_id, and world_size to create the job"));
  }
  absl::StatusOr<meta::JobRequest> spec = JobRequestFromProto(req->spec(), "spec");
  if (!spec.ok()) return Fail("CreateJob", spec.status());
  spec->resize_world = req->resize_world();
  absl::StatusOr<std::pair<meta::JobView, bool>> result =
      core_->CreateJob(*spec, req->open_if_exists());
  if (!result.ok()) return Fail("CreateJob", result.status());
  ToProto(result->first, resp->mutable_job());
  resp->set_created(result->second);
  return grpc::Status::OK;
}

grpc::Status MetaServiceImpl::GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest* req,
                                     v1::GetJobResponse* resp) {
  if (grpc::Status a = JobCall(*ctx, req->job_id(), "GetJob"); !a.ok()) return a;
  absl::StatusOr<meta::JobView> job = core_->GetJob(req->job_id());
  if (!job.ok()) return Fail("GetJob", job.status());
  ToProto(*job, resp->mutable_job());
  return grpc::Status::OK;
}

grpc::Status MetaServiceImpl::ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest* req,
                                       v1::ListJobsResponse* resp) {
  if (grpc::Status a = JobCall(*ctx, std::string(), "ListJobs"); !a.ok()) return a;
  std::string after;
  if (!req->page_token().empty()) {
    absl::StatusOr<std::string> decoded = DecodeJobsToken(req->page_token());
    if (!decoded.ok()) return Fail("ListJobs", decoded.status());
    after = *std::move(decoded);
  }
  const uint32_t limit = PageSize(req->page_size());
  // One more than the page: tells whether another page follows.
  absl::StatusOr<std::vector<meta::JobView>> listed = core_->ListJobs(after, limit + 1);
  if (!listed.ok()) return Fail("ListJobs", listed.status());
  std::vector<meta::JobView>& jobs = *listed;
  const bool more = jobs.size() > limit;
  if (more) jobs.resize(limit);
  // A trainer token lists only its jobs (a page may then hold fewer).
  const std::optional<std::vector<std::string>> visible = auth_.VisibleJobs(*ctx);
  for (const meta::JobView& job : jobs) {
    if (visible && std::none_of(visible->begin(), visible->end(), [&](const std::string& p) {
          return JobPatternMatches(p, job.job.spec.job_id);
        })) {
      continue;
    }
    ToProto(job, resp->add_jobs());
  }
  if (more && !jobs.empty()) resp->set_next_page_token(EncodeJobsToken(jobs.back().job.spec.job_id));
  return grpc::Status::OK;
}

grpc::Status MetaServiceImpl::DeleteJob(grpc::ServerContext* ctx, const v1::DeleteJobRequest* req,
                                        v1::DeleteJobResponse* resp) {
  if (grpc::Status a = AdminCall(*ctx, "DeleteJob"); !a.ok()) return a;
  absl::StatusOr<meta::JobView> job = core_->DeleteJob(req->job_id(), req->delete_durable_files());
  if (!job.ok()) return Fail("DeleteJob", job.status());
  ToProto(*job, resp->mutable_job());
  return grpc::Status::OK;
}

grpc::Status MetaServiceImpl::UpdateJob(grpc::ServerContext* ctx, const v1::UpdateJobRequest* req,
                                        v1::UpdateJobResponse* resp) {
  if (grpc::Status a = AdminCall(*ctx, "UpdateJob"); !a.ok()) return a;
  std::optional<meta::FlushPolicy> flush;
  if (req->has_flush()) flush = meta::FlushPolicy{req->flush().every_n_versions(), req->flush().every_seconds()};
  std::optional<meta::RetentionPolicy> retention;
  if (req->has_retention()) {
    retention.emplace();
    retention->keep_in_memory = req->retention().keep_in_memory();
    retention->keep_durable = req->retention().keep_durable();
  }
  std::optional<meta::ProtectionPolicy> protection;
  if (req->has_protection()) {
    absl::StatusOr<meta::ProtectionPolicy> p = PolicyFromProto(req->protection(), "protection");
    if (!p.ok()) return Fail("UpdateJob", p.status());
    protection = *p;
  }
  absl::StatusOr<std::pair<meta::JobView, bool>> job =
      core_->UpdateJob(req->job_id(), flush, retention, protection);
  if (!job.ok()) return Fail("UpdateJob", job.status());
  ToProto(job->first, resp->mutable_job());
  resp->set_changed(job->second);
  return grpc::Status::OK;
}

grpc::Status MetaServiceImpl::GetPlacement(grpc::ServerContext* ctx,
                                           const v1::GetPlacementRequest* req,
                                           v1::GetPlacementResponse* resp) {
  if (grpc::Status a = JobCall(*ctx, req->job_id(), "GetPlacement"); !a.ok()) return a;
  std::vector<int> failures;
  failures.reserve(static_cast<size_t>(req->failures_size()));
  for (int i = 0; i < req->failures_size(); ++i) {
    if (req->failures(i) > static_cast<uint32_t>(INT_MAX)) {
      return Fail("GetPlacement", absl::InvalidArgumentError(absl::StrCat(
                                      "failures[", i, "] is ", req->failures(i),
                                      "; it must be at most the number of plan nodes")));
    }
    failures.push_back(static_cast<int>(req->failures(i)));
  }
  std::optional<meta::ProtectionPolicy> policy_override;
  if (req->has_policy_override()) {
    absl::StatusOr<meta::ProtectionPolicy> p =
        PolicyFromProto(req->policy_override(), "policy_override");
    if (!p.ok()) return Fail("GetPlacement", p.status());
    policy_override = *p;
  }
  absl::StatusOr<meta::SurvivalOptions> survival = SurvivalOptionsFromProto(*req);
  if (!survival.ok()) return Fail("GetPlacement", survival.status());
  absl::StatusOr<meta::PlacementView> view =
      core_->GetPlacement(req->job_id(), failures, policy_override, *survival);
  if (!view.ok()) return Fail("GetPlacement", view.status());
  if (absl::Status s = ToProto(*view, resp); !s.ok()) return Fail("GetPlacement", s);
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------
// Versions

grpc::Status MetaServiceImpl::BeginVersion(grpc::ServerContext* ctx,
                                           const v1::BeginVersionRequest* req,
                                           v1::BeginVersionResponse* resp) {
  if (grpc::Status a = AgentCall(*ctx, req->node_id(), "BeginVersion"); !a.ok()) return a;
  absl::StatusOr<std::pair<meta::Version, bool>> result =
      core_->BeginVersion(req->job_id(), req->step(), req->run_id());
  if (!result.ok()) return Fail("BeginVersion", result.status());
  const meta::Version& v = result->first;
  if (result->second) {
    log::Debug("BeginVersion {}/{} by node \"{}\" run \"{}\"", v.job_id, v.step, req->node_id(),
               req->run_id());
  }
  VersionSummaryToProto(v, resp->mutable_version());
  resp->set_created(result->second);
  if (absl::Status s = PlanToProto(v.job_id, v.plan, v.created_ms, resp->mutable_plan()); !s.ok()) {
    return Fail("BeginVersion", s);
  }
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* MetaServiceImpl::ReportShards(grpc::CallbackServerContext* ctx,
                                                        const v1::ReportShardsRequest* req,
                                                        v1::ReportShardsResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto finish = [reactor](const grpc::Status& status) {
    reactor->Finish(status);
    return reactor;
  };
  if (grpc::Status a = AgentCall(*ctx, req->node_id(), "ReportShards"); !a.ok()) return finish(a);
  const int n = req->reports_size();
  std::vector<absl::Status> results(static_cast<size_t>(n));
  std::vector<meta::ShardReport> reports;
  std::vector<int> request_index;  // reports[j] is req->reports(request_index[j])
  reports.reserve(static_cast<size_t>(n));
  request_index.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<meta::ShardReport> r =
        ShardReportFromProto(req->reports(i), absl::StrCat("reports[", i, "]"));
    if (!r.ok()) {
      results[static_cast<size_t>(i)] = r.status();
      continue;
    }
    reports.push_back(*std::move(r));
    request_index.push_back(i);
  }
  // Called even with no well-formed report: the incarnation check still applies.
  uint64_t seq = 0;
  absl::StatusOr<meta::ReportResult> result =
      core_->SubmitReportShards(req->node_id(), req->incarnation(), std::move(reports), &seq);
  if (!result.ok()) return finish(Fail("ReportShards", result.status()));
  if (result->results.size() != request_index.size()) {
    // Still wait for the change (if any) before answering, as for success.
    const absl::Status bug = absl::InternalError(absl::StrCat(
        "the core answered ", result->results.size(), " results for ", request_index.size(),
        " reports"));
    core_->WhenDurable(seq, [reactor, bug](absl::Status) {
      reactor->Finish(Fail("ReportShards", bug));
    });
    return reactor;
  }
  for (size_t j = 0; j < request_index.size(); ++j) {
    results[static_cast<size_t>(request_index[j])] = std::move(result->results[j]);
  }
  resp->mutable_results()->Reserve(n);
  for (const absl::Status& s : results) ToProto(s, resp->add_results());
  AppendTasks("ReportShards", result->tasks, resp->mutable_tasks());
  // The answer leaves only once the change is durable.
  core_->WhenDurable(seq, [reactor](absl::Status durable) {
    reactor->Finish(durable.ok() ? grpc::Status::OK : Fail("ReportShards", durable));
  });
  return reactor;
}

grpc::Status MetaServiceImpl::GetVersion(grpc::ServerContext* ctx, const v1::GetVersionRequest* req,
                                         v1::GetVersionResponse* resp) {
  if (grpc::Status a = JobCall(*ctx, req->job_id(), "GetVersion"); !a.ok()) return a;
  absl::StatusOr<meta::Version> v =
      core_->GetVersion(req->job_id(), req->step(), req->include_items());
  if (!v.ok()) return Fail("GetVersion", v.status());
  if (absl::Status s = VersionDetailToProto(*v, req->include_items(), resp->mutable_version());
      !s.ok()) {
    return Fail("GetVersion", s);
  }
  return grpc::Status::OK;
}

grpc::Status MetaServiceImpl::ListVersions(grpc::ServerContext* ctx,
                                           const v1::ListVersionsRequest* req,
                                           v1::ListVersionsResponse* resp) {
  if (grpc::Status a = JobCall(*ctx, req->job_id(), "ListVersions"); !a.ok()) return a;
  std::vector<meta::VersionState> states;
  for (int i = 0; i < req->states_size(); ++i) {
    absl::StatusOr<meta::VersionState> state =
        VersionStateFromProto(req->states(i), absl::StrCat("states[", i, "]"));
    if (!state.ok()) return Fail("ListVersions", state.status());
    states.push_back(*state);
  }
  if (states.empty()) {  // every state except DELETED (meta.proto)
    states = {meta::VersionState::kOpen,      meta::VersionState::kStaged,
              meta::VersionState::kProtected, meta::VersionState::kPersisted,
              meta::VersionState::kDegraded,  meta::VersionState::kAborted};
  }
  std::optional<uint64_t> after;
  if (!req->page_token().empty()) {
    absl::StatusOr<uint64_t> step =
        DecodeVersionsToken(req->page_token(), req->job_id(), req->newest_first());
    if (!step.ok()) return Fail("ListVersions", step.status());
    after = *step;
  }
  const uint32_t limit = PageSize(req->page_size());
  absl::StatusOr<std::vector<meta::Version>> versions =
      core_->ListVersions(req->job_id(), states, req->newest_first(), after, limit + 1);
  if (!versions.ok()) return Fail("ListVersions", versions.status());
  const bool more = versions->size() > limit;
  if (more) versions->resize(limit);
  for (const meta::Version& v : *versions) VersionSummaryToProto(v, resp->add_versions());
  if (more && !versions->empty()) {
    resp->set_next_page_token(
        EncodeVersionsToken(req->job_id(), req->newest_first(), versions->back().step));
  }
  return grpc::Status::OK;
}

grpc::Status MetaServiceImpl::Latest(grpc::ServerContext* ctx, const v1::LatestRequest* req,
                                     v1::LatestResponse* resp) {
  if (grpc::Status a = JobCall(*ctx, req->job_id(), "Latest"); !a.ok()) return a;
  absl::StatusOr<meta::Level> level = LevelFromProto(req->min_level(), "min_level");
  if (!level.ok()) return Fail("Latest", level.status());
  absl::StatusOr<meta::Version> v = core_->Latest(req->job_id(), *level);
  if (!v.ok()) return Fail("Latest", v.status());
  VersionSummaryToProto(*v, resp->mutable_version());
  return grpc::Status::OK;
}

grpc::Status MetaServiceImpl::Locate(grpc::ServerContext* ctx, const v1::LocateRequest* req,
                                     v1::LocateResponse* resp) {
  if (grpc::Status a = JobCall(*ctx, req->job_id(), "Locate"); !a.ok()) return a;
  absl::StatusOr<meta::LocateResult> result =
      core_->Locate(req->job_id(), req->step(), req->rank(), req->near_node_id());
  if (!result.ok()) return Fail("Locate", result.status());
  ToProto(req->job_id(), req->step(), *result, resp, /*include_items=*/!req->omit_items());
  return grpc::Status::OK;
}

grpc::Status MetaServiceImpl::WaitVersion(grpc::ServerContext* ctx,
                                          const v1::WaitVersionRequest* req,
                                          v1::WaitVersionResponse* resp) {
  if (grpc::Status a = JobCall(*ctx, req->job_id(), "WaitVersion"); !a.ok()) return a;
  absl::StatusOr<meta::Level> level = LevelFromProto(req->level(), "level");
  if (!level.ok()) return Fail("WaitVersion", level.status());
  if (req->timeout_ms() < 0) {
    return Fail("WaitVersion", absl::InvalidArgumentError(absl::StrCat(
                                   "timeout_ms is ", req->timeout_ms(),
                                   "; it must be >= 0 (0 checks once without waiting)")));
  }
  if (shutting_down()) return ShuttingDown("WaitVersion");
  const absl::Duration budget =
      std::min({absl::Milliseconds(req->timeout_ms()), UntilDeadline(ctx), kMaxWait});
  const absl::Time end = clock_->MonotonicNow() + budget;
  // Waits in slices so that cancellation and Shutdown() are noticed promptly.
  for (;;) {
    const absl::Duration remaining = std::max(end - clock_->MonotonicNow(), absl::ZeroDuration());
    const absl::Duration slice = std::min(remaining, kPollSlice);
    absl::StatusOr<meta::Version> v =
        core_->WaitVersion(req->job_id(), req->step(), *level, slice);
    if (v.ok()) {
      VersionSummaryToProto(*v, resp->mutable_version());
      return grpc::Status::OK;
    }
    if (v.status().code() != absl::StatusCode::kDeadlineExceeded) {
      return Fail("WaitVersion", v.status());
    }
    if (remaining <= slice) {
      // The core's message names the last slice's duration; when the wait took
      // several slices, say how long the caller actually waited.
      if (budget <= kPollSlice) return Fail("WaitVersion", v.status());
      return Fail("WaitVersion", WaitTimedOut(req->job_id(), req->step(), *level, budget));
    }
    if (shutting_down()) return ShuttingDown("WaitVersion");
    if (ctx->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the client cancelled the call");
    }
  }
}

grpc::Status MetaServiceImpl::FlushVersion(grpc::ServerContext* ctx,
                                           const v1::FlushVersionRequest* req,
                                           v1::FlushVersionResponse* resp) {
  if (grpc::Status a = JobCall(*ctx, req->job_id(), "FlushVersion", Access::kWrite); !a.ok()) return a;
  absl::StatusOr<meta::Version> v = core_->FlushVersion(req->job_id(), req->step());
  if (!v.ok()) return Fail("FlushVersion", v.status());
  VersionSummaryToProto(*v, resp->mutable_version());
  return grpc::Status::OK;
}

grpc::Status MetaServiceImpl::DeleteVersion(grpc::ServerContext* ctx,
                                            const v1::DeleteVersionRequest* req,
                                            v1::DeleteVersionResponse* resp) {
  if (grpc::Status a = AdminCall(*ctx, "DeleteVersion"); !a.ok()) return a;
  absl::StatusOr<meta::Version> v = core_->DeleteVersion(req->job_id(), req->step(), req->force());
  if (!v.ok()) return Fail("DeleteVersion", v.status());
  VersionSummaryToProto(*v, resp->mutable_version());
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------
// Cluster

grpc::Status MetaServiceImpl::ClusterStatus(grpc::ServerContext* ctx,
                                            const v1::ClusterStatusRequest* req,
                                            v1::ClusterStatusResponse* resp) {
  if (grpc::Status a = JobCall(*ctx, std::string(), "ClusterStatus"); !a.ok()) return a;
  const uint32_t max_problems = req->max_problems() == 0 ? kDefaultMaxProblems : req->max_problems();
  absl::StatusOr<meta::ClusterStatusView> status =
      core_->ClusterStatus(req->include_nodes(), max_problems, req->job_id());
  if (!status.ok()) return Fail("ClusterStatus", status.status());
  ToProto(*status, resp);
  if (replicas_) {
    for (const ReplicaInfo& r : replicas_()) {
      v1::MetaReplica* out = resp->add_meta_replicas();
      out->set_address(r.address);
      out->set_leader(r.leader);
      out->set_applied_index(r.applied_index);
    }
  }
  return grpc::Status::OK;
}

}  // namespace ckpt::rpc
