#include "server/agent/agent.h"

#include <pthread.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/lock_check.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt::agent {

absl::StatusOr<std::unique_ptr<Agent>> Agent::Create(const AgentOptions& options, MetaLink* meta, Clock* clock,
                                                     FileSystem* durable_fs, MetricsRegistry* metrics) {
  CKPT_RETURN_IF_ERROR(ValidateNodeId(options.node_id));
  if (options.peer_timeout_ms <= 0) return absl::InvalidArgumentError("peer_timeout_ms must be positive");
  std::unique_ptr<Agent> agent(new Agent(options, meta, clock, durable_fs, metrics));
  CKPT_RETURN_IF_ERROR(agent->Init());
  return agent;
}

Agent::Agent(const AgentOptions& options, MetaLink* meta, Clock* clock, FileSystem* durable_fs,
             MetricsRegistry* metrics)
    : options_(options),
      meta_(meta),
      clock_(clock),
      durable_fs_(durable_fs),
      started_(clock->MonotonicNow()),
      metrics_(*metrics) {}

absl::Status Agent::Init() {
  Arena::Options ao;
  ao.dir = options_.memory_dir;
  ao.capacity_bytes = options_.memory_bytes;
  ao.populate = options_.populate;
  ao.fs = options_.memory_fs != nullptr ? options_.memory_fs : PosixFileSystem();
  CKPT_ASSIGN_OR_RETURN(arena_, Arena::Open(ao));
  // The incarnation file lives in the tier and is checked like its records.
  CKPT_ASSIGN_OR_RETURN(const uint64_t previous_incarnation,
                        ReadIncarnationFile(ao.fs, IncarnationPath(options_.memory_dir)));
  // (ingest_ is made last; nothing asks for the budget before Init ends.)
  auto budget = [this](uint64_t bytes) { return ingest_->BudgetMessage(bytes); };

  MetaSession::Options so;
  so.node_id = options_.node_id;
  so.grpc_address = options_.grpc_address;
  so.data_address = [this] {
    if (!options_.data_address.empty()) return options_.data_address;
    std::string a = data_address();
    const size_t colon = a.rfind(':');
    const std::string host = colon == std::string::npos ? a : a.substr(0, colon);
    if (!options_.advertise_host.empty() && (host == "0.0.0.0" || host == "[::]" || host == "::")) {
      a = absl::StrCat(options_.advertise_host, a.substr(colon));
    }
    return a;
  };
  so.failure_domain = options_.failure_domain;
  so.host_node_id = options_.host_node_id;
  so.memory_capacity_bytes = arena_->capacity_bytes();
  so.memory_dir = options_.memory_dir;
  so.fs = ao.fs;
  so.previous_incarnation = previous_incarnation;
  so.on_data_plane_key = options_.on_data_plane_key;
  if (options_.check_peer_membership) {
    membership_ = std::make_unique<PeerMembership>(clock_, [this] { session_->HeartbeatSoon(); });
    so.membership = membership_.get();
  }
  session_ = std::make_unique<MetaSession>(meta_, clock_, &metrics_, so, static_cast<MetaSession::Delegate*>(this));
  // A stored segment or parity may be what a deferred EC task waits for.
  holdings_ = std::make_unique<HoldingTable>(arena_.get(), clock_, &metrics_, [this](HoldingReport r) {
    session_->Report(std::move(r));
    if (runner_) runner_->Poke();
  });
  // Liveness comes from the client's session connection, never from pids
  // (a trainer in its own PID namespace has a pid that means nothing here).
  leases_ = std::make_unique<LeaseTable>(clock_, &metrics_, [this](const ClientRef& c) {
    if (c.session_id.empty()) return ClientState::kConnected;  // its ttl rules
    if (sessions_ == nullptr) return ClientState::kGone;
    if (sessions_->Open(c.session_id)) return ClientState::kConnected;
    return sessions_->Alive(c.session_id) ? ClientState::kDisconnected : ClientState::kGone;
  });
  if (!options_.session_socket.empty()) {
    SessionServer::Options so;
    so.socket_path = options_.session_socket;
    so.grace = absl::Milliseconds(options_.session_grace_ms);
    so.allowed_gid = options_.socket_gid;
    CKPT_ASSIGN_OR_RETURN(
        sessions_, SessionServer::Start(so, {PoolFile{arena_->pool_path(), arena_->pool_fd(), arena_->capacity_bytes()}},
                                        clock_, [this](const std::string& id) {
                                          const int n = leases_->ReleaseSession(id);
                                          if (n > 0) {
                                            log::Info("released {} leases and handles of ended session {}", n,
                                                      IdForLog(id));
                                          }
                                          UpdateGauges();
                                        }));
  }
  flusher_ = std::make_unique<Flusher>(options_.durable_root, durable_fs_, holdings_.get(), session_.get(), meta_,
                                       clock_, &metrics_, absl::StrCat("ckpt-agent ", options_.node_id));
  TaskRunner::Hooks hooks;
  hooks.step = [this](QueuedTask& qt, bool* finished) { return RunStep(qt, finished); };
  hooks.on_queued = [this](const AgentTask& t) {
    if (t.kind == TaskKind::kFlush) flusher_->Want(t);
  };
  hooks.on_cancelled = [this](const AgentTask& t) {
    if (t.kind == TaskKind::kFlush) flusher_->Unwant(t);
    if (t.kind == TaskKind::kEcEncode) parity_->DropVersion(t.job_id, t.step);
  };
  hooks.on_flush_error = [this](const absl::Status& s) { flusher_->RecordError(s); };
  // A flush that failed for good leaves its unwritten shards to meta's retry
  // (here or on another holder): they stop counting as this node's lag.
  hooks.on_ended = [this](const AgentTask& t, const absl::Status&) {
    if (t.kind == TaskKind::kFlush) flusher_->Unwant(t);
  };
  runner_ = std::make_unique<TaskRunner>(
      clock_, session_.get(),
      TaskRunner::Options{options_.flush_retry_initial_ms, options_.flush_retry_max_ms, options_.flush_max_tries},
      std::move(hooks));
  stripes_ = std::make_unique<Executor>("ckpt-agent-strp", std::max(options_.stripe_threads, 1), 64);
  // Sources of restores read side by side (restorer.h "Hedging"); full, an
  // open reads its sources one after another.
  restore_races_ = std::make_unique<Executor>("ckpt-agent-race", 8, 64);

  plane_ = std::make_unique<DataPlane>(options_.transport, clock_, options_.peer_timeout_ms,
                                       options_.check_peer_identity);
  const absl::Duration peer_timeout = absl::Milliseconds(options_.peer_timeout_ms);
  const absl::Duration parity_expire = options_.parity_expire_ms > 0 ? absl::Milliseconds(options_.parity_expire_ms)
                                                                     : std::max(peer_timeout * 4, absl::Seconds(30));
  parity_ = std::make_unique<ParityBuilder>(arena_.get(), holdings_.get(), clock_, &metrics_, parity_expire);
  peer_client_ = std::make_unique<PeerClient>(
      plane_.get(), clock_, &metrics_,
      PeerClient::Options{options_.peer_timeout_ms, options_.bulk, options_.node_id,
                          [this] { return session_->incarnation(); }});
  PeerServer::Deps sd{plane_.get(), holdings_.get(), parity_.get(), session_.get(), arena_.get(), clock_, &metrics_,
                      [this] { return session_->incarnation(); }, budget, membership_.get()};
  PeerServer::Options po;
  po.node_id = options_.node_id;
  po.peer_timeout_ms = options_.peer_timeout_ms;
  po.bulk = options_.bulk;
  po.serve_threads = std::max(options_.serve_threads, 1);
  po.finish_threads = std::max(options_.finish_threads, 1);
  peer_server_ = std::make_unique<PeerServer>(sd, po);
  plane_->SetFlows(peer_server_.get(), peer_client_.get());

  Reconstructor::Options ro;
  ro.slice_bytes = std::max<uint64_t>(options_.bulk.chunk_bytes / 2, 1 << 20);
  ro.hedge_after = options_.hedge_ms > 0 ? absl::Milliseconds(options_.hedge_ms)
                                         : std::min(absl::Seconds(1), peer_timeout / 4);
  reconstructor_ = std::make_unique<Reconstructor>(peer_client_.get(), clock_, &metrics_, ro);
  const bool data_plane = options_.transport != nullptr;
  protector_ = std::make_unique<Protector>(Protector::Deps{
      .holdings = holdings_.get(), .peers = peer_client_.get(), .parity = parity_.get(),
      .reconstructor = reconstructor_.get(), .stripes = stripes_.get(), .arena = arena_.get(), .clock = clock_,
      .metrics = &metrics_, .node_id = options_.node_id, .peer_timeout_ms = options_.peer_timeout_ms,
      .data_plane = data_plane, .budget_message = budget,
      .report = [this](HoldingReport r) { session_->Report(std::move(r)); }});
  restorer_ = std::make_unique<Restorer>(Restorer::Deps{
      .holdings = holdings_.get(), .leases = leases_.get(), .peers = data_plane ? peer_client_.get() : nullptr,
      .reconstructor = reconstructor_.get(), .stripes = stripes_.get(), .arena = arena_.get(),
      .session = session_.get(), .meta = meta_, .node_id = options_.node_id, .durable_fs = durable_fs_,
      .durable_root = options_.durable_root, .clock = clock_, .metrics = &metrics_,
      .default_handle_ttl_ms = options_.default_handle_ttl_ms, .budget_message = budget,
      .races = restore_races_.get(), .hedge_after = ro.hedge_after});
  verifier_ = std::make_unique<Verifier>(Verifier::Deps{
      .holdings = holdings_.get(), .parity = parity_.get(), .session = session_.get(), .meta = meta_,
      .clock = clock_, .on_verified = [this] { runner_->Poke(); }, .on_freed = [this] { UpdateGauges(); }});
  ingest_ = std::make_unique<Ingest>(Ingest::Deps{
      .arena = arena_.get(), .holdings = holdings_.get(), .leases = leases_.get(), .session = session_.get(),
      .meta = meta_, .verifier = verifier_.get(), .sessions = sessions_.get(), .clock = clock_,
      .metrics = &metrics_, .puller = options_.puller, .item_alignment_bytes = options_.item_alignment_bytes,
      .default_lease_ttl_ms = options_.default_lease_ttl_ms, .peer_timeout_ms = options_.peer_timeout_ms,
      .on_changed = [this] { UpdateGauges(); }});

  // Re-adopt what a previous agent left; replay the STAGED reports (meta
  // answers a replay ALREADY_EXISTS).
  const size_t lost = arena_->lost().size();
  std::vector<AdoptedHolding> adopted = arena_->TakeAdopted();
  const size_t count = adopted.size();
  for (ShardRecord& rec : holdings_->Adopt(std::move(adopted))) {
    HoldingReport r;
    r.kind = HoldingReport::Kind::kStaged;
    r.record = std::make_shared<const ShardRecord>(std::move(rec));
    session_->Report(std::move(r));
  }
  if (count != 0 || lost != 0) log::Info("memory tier: re-adopted {} holdings, {} lost", count, lost);
  metrics_.capacity->Set(static_cast<double>(arena_->capacity_bytes()));
  metrics_.memory_dir_in_memory->Set(options_.memory_dir_in_memory ? 1 : 0);
  if (data_plane) {
    CKPT_RETURN_IF_ERROR(plane_->Start(options_.data_listen_address, arena_->Data(0), arena_->capacity_bytes()));
  }
  UpdateGauges();
  return absl::OkStatus();
}

Agent::~Agent() { Stop(); }

void Agent::Start() {
  auto loop = [this](const char* name, auto once, auto wait) {
    threads_.emplace_back([this, name, once, wait] {
      pthread_setname_np(pthread_self(), name);
      while (true) {
        {
          CheckedLock lock(&loop_mu_);
          if (stopping_) return;
        }
        if (!once()) wait();
      }
    });
  };
  loop("ckpt-agent-ctl", [this] { ControlOnce(); return false; },
       [this] { session_->AwaitWork(absl::Milliseconds(50)); });
  loop("ckpt-agent-vfy", [this] { return VerifyOnce(); },
       [this] { verifier_->AwaitWork(absl::Milliseconds(200)); });
  loop("ckpt-agent-task", [this] { return TasksOnce(); }, [this] { runner_->AwaitWork(absl::Milliseconds(100)); });
  threads_.emplace_back([this] {
    pthread_setname_np(pthread_self(), "ckpt-agent-wtch");
    session_->WatchLoop();
  });
}

void Agent::Stop() {
  // A gate, not state: held across the whole shutdown (which joins threads and
  // makes RPCs) by design, so a plain lock, not a CheckedLock.
  absl::MutexLock stop(&stop_mu_);
  {
    CheckedLock lock(&loop_mu_);
    stopping_ = true;
  }
  if (ingest_) ingest_->Stop();
  if (verifier_) verifier_->Stop();
  // Each component may be missing: Create stops an agent whose Init failed
  // part of the way (e.g. a memory tier that is not the agent's own).
  if (session_) session_->Stop();
  if (runner_) runner_->Stop();
  if (peer_client_) peer_client_->Stop();
  // No transport callback runs after this; in-flight sends end Cancelled.
  if (plane_) plane_->Stop();
  if (peer_server_) peer_server_->Stop();
  if (stripes_) stripes_->Stop();
  if (restore_races_) restore_races_->Stop();
  if (sessions_) sessions_->Stop();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

absl::StatusOr<absl::Duration> Agent::PauseProtection(absl::Duration d) {
  if (d < absl::ZeroDuration() || d > absl::Seconds(60)) {
    return absl::InvalidArgumentError(absl::StrCat("a pause lasts 0 to 60000 ms, not ", absl::ToInt64Milliseconds(d),
                                                   " (renew a longer one by calling again)"));
  }
  return protector_->Pause(d);
}

// ---------------------------------------------------------------------------
// Save path

absl::Status Agent::AbortLease(const std::string& lease_id, const std::string& session_id) {
  absl::Status s = leases_->Abort(lease_id, session_id);
  UpdateGauges();
  return s;
}

// ---------------------------------------------------------------------------
// Restore path

absl::StatusOr<OpenOutcome> Agent::Open(const OpenRequest& request) {
  CKPT_RETURN_IF_ERROR(CheckClientSession(sessions_.get(), request.client.session_id));
  absl::StatusOr<OpenOutcome> outcome = restorer_->Open(request);
  if (outcome.ok() && !outcome->served_by) {
    outcome->result.version_staged = session_->VersionStaged(request.id.job_id, request.id.step);
  }
  return outcome;
}

absl::Status Agent::Deliver(const std::string& handle_id, const PullSource& target, const std::string& session_id) {
  if (options_.puller == nullptr) {
    return absl::FailedPreconditionError("this agent does not deliver restores (a host ckpt-agent): map the regions "
                                         "OpenShard returned");
  }
  CKPT_ASSIGN_OR_RETURN(Pin pin, leases_->HandlePin(handle_id, session_id));
  const uint64_t size = pin.rec->size_bytes;
  absl::Status s = options_.puller->Push(target, ingest_->DeliverToken(handle_id), pin.bytes, size,
                                         absl::Milliseconds(options_.peer_timeout_ms));
  if (!s.ok()) {
    metrics_.pull_errors->Increment();
    log::Warn("cannot deliver {} ({} bytes) to the client: {}", ShardIdString(pin.rec->id), size, s.ToString());
    return s;
  }
  metrics_.delivered_bytes->Increment(static_cast<double>(size));
  return absl::OkStatus();
}

absl::Status Agent::CloseShard(const std::string& handle_id, const std::string& session_id) {
  absl::Status s = leases_->CloseHandle(handle_id, session_id);
  UpdateGauges();
  return s;
}

absl::Status Agent::ReadShard(const ShardId& id, uint64_t offset, uint64_t length,
                              const std::function<absl::Status(const std::byte*, uint64_t)>& fn,
                              ShardRecord* record) {
  absl::StatusOr<Pin> pin = holdings_->PinValid(id);
  if (!pin.ok()) return absl::NotFoundError(pin.status().message());
  const ShardRecord& rec = *pin->rec;
  if (offset > rec.size_bytes) {
    return absl::OutOfRangeError(absl::StrCat("offset ", offset, " is beyond the shard's ", rec.size_bytes, " bytes"));
  }
  if (record != nullptr) *record = rec;
  if (length == 0 || length > rec.size_bytes - offset) length = rec.size_bytes - offset;
  for (const auto& piece : pin->bytes->Pieces(offset, length)) {
    CKPT_RETURN_IF_ERROR(fn(piece.data(), piece.size()));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Inventory and commands

AgentStatusSnapshot Agent::Status() const {
  AgentStatusSnapshot s;
  const MetaSession::Snapshot m = session_->Status();
  s.node_id = options_.node_id;
  s.incarnation = m.incarnation;
  s.registered = m.registered;
  s.meta_reachable = m.meta_reachable;
  s.last_heartbeat_unix_ms = m.last_heartbeat_unix_ms;
  s.lease_remaining_ms = m.lease_remaining_ms;
  s.node_state = m.node_state;
  s.uptime_ms = absl::ToInt64Milliseconds(clock_->MonotonicNow() - started_);
  s.capacity_bytes = arena_->capacity_bytes();
  s.free_bytes = arena_->free_bytes();
  s.used_bytes = s.capacity_bytes - s.free_bytes;
  s.leased_bytes = leases_->LeasedBytes();
  s.open_leases = leases_->lease_count();
  s.open_handles = leases_->handle_count();
  s.holdings = holdings_->Infos("", std::nullopt);
  const FlushStats f = flusher_->Stats();
  s.flush_pending_shards = f.pending_shards;
  s.flush_lag_bytes = f.lag_bytes;
  s.flush_lag_ms = f.lag_ms;
  s.flush_errors_total = f.errors_total;
  s.last_flush_error = f.last_error;
  s.last_flush_error_unix_ms = f.last_error_unix_ms;
  s.running_tasks = runner_->Running();
  s.memory_dir = options_.memory_dir;
  s.memory_dir_fs = options_.memory_dir_fs;
  s.memory_dir_in_memory = options_.memory_dir_in_memory;
  s.durable_root = options_.durable_root;
  s.pool_path = arena_->pool_path();
  s.pool_bytes = arena_->capacity_bytes();
  return s;
}

// ---------------------------------------------------------------------------
// Loops and tasks

void Agent::ControlOnce() {
  leases_->Expire();
  peer_server_->Expire();
  parity_->Expire();
  UpdateGauges();
  session_->ControlOnce();
}

absl::Status Agent::RunStep(QueuedTask& qt, bool* finished) {
  const AgentTask& t = qt.task;
  *finished = true;
  switch (t.kind) {
    case TaskKind::kFlush:
      return flusher_->Step(qt, finished);
    case TaskKind::kCommitDurable:
      return flusher_->CommitVersion(t);
    case TaskKind::kDeleteDurable:
      return flusher_->DeleteVersion(t);
    case TaskKind::kEvict:
      verifier_->EvictVersion(t.job_id, t.step);
      return absl::OkStatus();
    case TaskKind::kDrop: {
      for (const ShardId& id : t.drop) holdings_->DropShard(id);
      for (const SegmentId& id : t.drop_segments) holdings_->DropSegment(id);
      log::Info("dropped {} holdings: {}", t.drop.size() + t.drop_segments.size(), t.reason);
      UpdateGauges();
      return absl::OkStatus();
    }
    case TaskKind::kReplicate:
      return protector_->Replicate(qt, finished);
    case TaskKind::kEcEncode:
      return protector_->EcEncode(qt, finished);
    case TaskKind::kRebuildSegments:
      return protector_->RebuildSegments(qt);
    case TaskKind::kUnsupported:
      return absl::UnimplementedError(absl::StrCat("this agent cannot run ", t.kind_name, " tasks"));
  }
  return absl::InternalError("unknown task kind");
}

void Agent::UpdateGauges() {
  const uint64_t free = arena_->free_bytes();
  metrics_.free->Set(static_cast<double>(free));
  metrics_.used->Set(static_cast<double>(arena_->capacity_bytes() - free));
  metrics_.leased->Set(static_cast<double>(leases_->LeasedBytes()));
  metrics_.leased_ahead->Set(static_cast<double>(leases_->LeasedAheadBytes()));
  metrics_.reservations->Set(static_cast<double>(arena_->live_reservations()));
  metrics_.open_leases->Set(static_cast<double>(leases_->lease_count()));
  metrics_.open_handles->Set(static_cast<double>(leases_->handle_count()));
  flusher_->UpdateGauges();
}

// ---------------------------------------------------------------------------
// MetaSession::Delegate

LoadReport Agent::Load() {
  LoadReport load;
  load.memory_capacity_bytes = arena_->capacity_bytes();
  load.memory_free_bytes = arena_->free_bytes();
  load.memory_used_bytes = load.memory_capacity_bytes - load.memory_free_bytes;
  load.memory_leased_bytes = leases_->LeasedBytes();
  const FlushStats f = flusher_->Stats();
  load.flush_lag_bytes = f.lag_bytes;
  load.flush_lag_ms = f.lag_ms;
  load.flush_errors_total = f.errors_total;
  load.running = runner_->Running();
  return load;
}

void Agent::OnTasks(std::vector<AgentTask> tasks, std::vector<std::string> cancelled) {
  if (!cancelled.empty()) runner_->Cancel(cancelled);
  if (!tasks.empty()) runner_->Enqueue(std::move(tasks));
}

void Agent::OnDrop(const std::vector<ShardId>& shards, const std::vector<SegmentId>& segments) {
  for (const ShardId& id : shards) {
    log::Info("meta says drop {}", ShardIdString(id));
    holdings_->DropShard(id);
  }
  for (const SegmentId& id : segments) {
    log::Info("meta says drop segment {}", SegmentIdString(id));
    holdings_->DropSegment(id);
  }
  UpdateGauges();
}

void Agent::OnVersionRefused(const std::string& job, uint64_t step, const std::string& run_id,
                             const absl::Status& why) {
  ingest_->OnVersionRefused(job, step, run_id);
  UpdateGauges();
}

void Agent::OnCopyRefused(const HoldingReport& r, const absl::Status& why) {
  if (r.kind == HoldingReport::Kind::kSegment) {
    log::Warn("meta refused segment {}: {}; dropping it", SegmentIdString(r.segment), why.ToString());
    holdings_->DropSegment(r.segment);
  } else {
    ingest_->OnShardRefused(r, why);
  }
  UpdateGauges();
}

}  // namespace ckpt::agent
