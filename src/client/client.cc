// Client: Connect (create-or-open the job, agent status, pool mappings),
// Latest, WaitVersion, and the helpers shared by save.cc and load.cc.
#include "ckpt/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <functional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/client_core.h"
#include "common/grpc_security.h"
#include "common/log.h"
#include "common/manifest.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "common/unix_socket.h"

namespace ckpt {

uint32_t DTypeSize(DType dtype) {
  return DTypeElementSize(static_cast<int>(dtype));
}

// DType's numbers are ckpt.v1.DType's, which common/manifest.h's dtype rules
// are indexed by: the casts to and from ManifestItem::dtype rely on these.
#define CKPT_SAME_DTYPE(ours, proto) \
  static_assert(static_cast<int>(DType::ours) == v1::proto, #ours " != " #proto)
CKPT_SAME_DTYPE(kF32, DTYPE_F32);
CKPT_SAME_DTYPE(kF16, DTYPE_F16);
CKPT_SAME_DTYPE(kBF16, DTYPE_BF16);
CKPT_SAME_DTYPE(kF64, DTYPE_F64);
CKPT_SAME_DTYPE(kI8, DTYPE_I8);
CKPT_SAME_DTYPE(kI16, DTYPE_I16);
CKPT_SAME_DTYPE(kI32, DTYPE_I32);
CKPT_SAME_DTYPE(kI64, DTYPE_I64);
CKPT_SAME_DTYPE(kU8, DTYPE_U8);
CKPT_SAME_DTYPE(kU16, DTYPE_U16);
CKPT_SAME_DTYPE(kU32, DTYPE_U32);
CKPT_SAME_DTYPE(kU64, DTYPE_U64);
CKPT_SAME_DTYPE(kBool, DTYPE_BOOL);
CKPT_SAME_DTYPE(kBytes, DTYPE_BYTES);
CKPT_SAME_DTYPE(kC64, DTYPE_C64);
CKPT_SAME_DTYPE(kC128, DTYPE_C128);
CKPT_SAME_DTYPE(kF8E4M3FN, DTYPE_F8_E4M3FN);
CKPT_SAME_DTYPE(kF8E5M2, DTYPE_F8_E5M2);
#undef CKPT_SAME_DTYPE
static_assert(static_cast<int>(DType::kBytes) == kDTypeBytes && static_cast<int>(DType::kF8E5M2) == kMaxDType &&
              kMaxDType == v1::DType_MAX);

const char* ServedFromName(ServedFrom served_from) {
  switch (served_from) {
    case ServedFrom::kLocal:
      return "local";
    case ServedFrom::kReplica:
      return "replica";
    case ServedFrom::kEcDecode:
      return "ec_decode";
    case ServedFrom::kDurable:
      return "durable";
    case ServedFrom::kUnknown:
      break;
  }
  return "unknown";
}

namespace client {

absl::Status FromGrpc(const grpc::Status& status, const char* call) {
  if (status.ok()) return absl::OkStatus();
  // gRPC and absl share the canonical code numbers (0..16).
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(call, ": ", status.error_message()));
}

void AwaitChannel(grpc::Channel* channel, absl::Time until) {
  while (absl::Now() < until) {
    const grpc_connectivity_state state = channel->GetState(/*try_to_connect=*/true);
    if (state == GRPC_CHANNEL_READY) return;
    channel->WaitForStateChange(state, absl::ToChronoTime(until));
  }
}

std::unique_ptr<grpc::ClientContext> ContextWithTimeout(absl::Duration timeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  return ctx;
}

void CloseShardInBackground(ClientCore& core, std::string handle_id, std::string session_id) {
  auto close = [&core, id = std::move(handle_id), session = std::move(session_id)] {
    v1::CloseShardRequest req;
    req.set_handle_id(id);
    req.set_session_id(session);
    if (absl::Status s = core.agent->CloseShard(req, core.options.rpc_timeout); !s.ok()) {
      log::Warn("closing shard handle {}: {}", id, s.ToString());
    }
  };
  std::function<void()> fn = close;
  if (!core.calls.TrySubmit(std::move(fn))) close();
}

absl::StatusOr<std::vector<ShardRegion>> MapRegions(
    ClientCore& core, const google::protobuf::RepeatedPtrField<v1::MemoryRegion>& regions,
    uint64_t size, MappedFile::Access access, std::vector<std::shared_ptr<MappedFile>>* keep) {
  // What `keep` holds: the mappings and pins of the regions (the pool
  // warmer leaves pinned pages alone), released with the last of them.
  struct Held {
    std::vector<std::shared_ptr<MappedFile>> files;
    std::vector<std::shared_ptr<void>> pins;
  };
  auto held = std::make_shared<Held>();
  std::vector<ShardRegion> out;
  out.reserve(regions.size());
  for (const v1::MemoryRegion& r : regions) {
    CKPT_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> file,
                          core.mappings.Get(r.path(), r.file_offset_bytes(), r.length_bytes(),
                                            access));
    std::byte* const begin = file->data() + r.file_offset_bytes();
    out.push_back(ShardRegion{begin, r.length_bytes(), r.shard_offset_bytes()});
    held->pins.push_back(core.warmer.Pin(begin, begin + r.length_bytes()));
    // A save's regions: warm the rest of that pool in the background (once).
    if (access == MappedFile::Access::kReadWrite) core.warmer.Warm(file);
    if (std::find(held->files.begin(), held->files.end(), file) == held->files.end()) {
      held->files.push_back(std::move(file));
    }
  }
  CKPT_RETURN_IF_ERROR(CheckCoverage(out, size));
  for (const std::shared_ptr<MappedFile>& f : held->files) {
    keep->push_back(std::shared_ptr<MappedFile>(held, f.get()));  // shares `held`'s life
  }
  return out;
}

v1::DurabilityLevel ToProto(Level level) {
  switch (level) {
    case Level::kStaged:
      return v1::DURABILITY_LEVEL_STAGED;
    case Level::kProtected:
      return v1::DURABILITY_LEVEL_PROTECTED;
    case Level::kPersisted:
      return v1::DURABILITY_LEVEL_PERSISTED;
  }
  return v1::DURABILITY_LEVEL_UNSPECIFIED;
}

namespace {

// Longest single WaitVersion long poll; the server caps it at 1 hour.
constexpr absl::Duration kMaxPoll = absl::Minutes(10);
constexpr absl::Duration kMinBackoff = absl::Milliseconds(10);
constexpr absl::Duration kMaxBackoff = absl::Seconds(1);

// Waits `*backoff` (but not past `deadline`) before a call to meta is tried
// again, and doubles it. The gRPC link (meta_link_grpc.cc) waits on its
// channel (MetaLink::AwaitRetry -> AwaitChannel). The wait is spent in the channel's
// connectivity watch, not in a sleep: a call that failed because the server
// was down leaves a reconnect attempt behind, and gRPC notices its outcome
// only while some thread polls the channel. With plain sleeps between
// fail-fast calls nothing did, save gRPC's backup poller every 5 s, and a
// client kept failing for 9-20 s after meta was back (bench/meta_reconnect.py;
// 0.6 s with this). Returns early once the channel is READY.
absl::Time NextTry(absl::Duration* backoff, absl::Time deadline) {
  const absl::Time until = std::min(absl::Now() + *backoff, deadline);
  *backoff = std::min(*backoff * 2, kMaxBackoff);
  return until;
}
void Backoff(MetaLink& meta, absl::Duration* backoff, absl::Time deadline) {
  meta.AwaitRetry(NextTry(backoff, deadline));
}
// The same for a call to the agent: the link waits (AgentLink::AwaitRetry).
void Backoff(AgentLink& agent, absl::Duration* backoff, absl::Time deadline) {
  agent.AwaitRetry(NextTry(backoff, deadline));
}

v1::JobSpec MakeSpec(const ClientOptions& o) {
  v1::JobSpec spec;
  spec.set_job_id(o.job_id);
  spec.set_world_size(o.world_size);
  // Only what the user set: meta leaves unset policies uncompared when the
  // job exists (it keeps the stored ones) and applies its defaults when it
  // creates the job.
  if (o.protection.has_value()) {
    v1::ProtectionPolicy* p = spec.mutable_protection();
    switch (o.protection->kind) {
      case Protection::Kind::kNone:
        p->mutable_none();
        break;
      case Protection::Kind::kReplicate:
        p->mutable_replicate()->set_copies(o.protection->copies);
        p->mutable_replicate()->set_placement(o.protection->placement ==
                                                      Protection::Placement::kGroup
                                                  ? v1::REPLICA_PLACEMENT_GROUP
                                                  : v1::REPLICA_PLACEMENT_RING);
        break;
      case Protection::Kind::kErasureCode:
        p->mutable_ec()->set_data_k(o.protection->data_k);
        p->mutable_ec()->set_parity_m(o.protection->parity_m);
        break;
    }
  }
  if (o.flush_every_n_versions != 0 || o.flush_every_seconds != 0) {
    spec.mutable_flush()->set_every_n_versions(o.flush_every_n_versions);
    spec.mutable_flush()->set_every_seconds(o.flush_every_seconds);
  }
  if (o.keep_in_memory != 0 || o.keep_durable != 0) {
    spec.mutable_retention()->set_keep_in_memory(o.keep_in_memory);
    spec.mutable_retention()->set_keep_durable(o.keep_durable);
  }
  for (const auto& [k, v] : o.labels) (*spec.mutable_labels())[k] = v;
  return spec;
}

absl::Status ValidateOptions(const ClientOptions& o) {
  if (o.meta_address.empty()) return absl::InvalidArgumentError("meta_address is empty");
  if (o.agent_socket.empty()) return absl::InvalidArgumentError("agent_socket is empty");
  CKPT_RETURN_IF_ERROR(ValidateJobId(o.job_id));
  if (o.world_size == 0) return absl::InvalidArgumentError("world_size must be at least 1");
  if (o.rank >= o.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", o.rank, " is out of range: world size is ", o.world_size));
  }
  if (o.connect_timeout < absl::ZeroDuration() || o.rpc_timeout <= absl::ZeroDuration() ||
      o.load_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("timeouts must be positive");
  }
  return absl::OkStatus();
}

// Rank 0: create-or-open, retried while meta is unreachable.
absl::Status CreateOrOpenJob(ClientCore& core, absl::Time deadline) {
  v1::CreateJobRequest req;
  *req.mutable_spec() = MakeSpec(core.options);
  req.set_open_if_exists(true);
  req.set_resize_world(core.options.resize_world);
  absl::Duration backoff = kMinBackoff;
  while (true) {
    v1::CreateJobResponse resp;
    absl::Status s = core.meta->CreateJob(req, &resp, core.options.rpc_timeout);
    if (s.ok()) {
      log::Debug("job {} {} (world size {})", core.options.job_id,
                 resp.created() ? "created" : "opened", resp.job().spec().world_size());
      return absl::OkStatus();
    }
    if (!absl::IsUnavailable(s)) return s;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("ckpt-meta at ", core.options.meta_address,
                       " unreachable within the connect timeout: ", s.message()));
    }
    Backoff(*core.meta, &backoff, deadline);
  }
}

// Other ranks: wait for rank 0 to create the job, then check the world size.
absl::Status AwaitJob(ClientCore& core, absl::Time deadline) {
  v1::GetJobRequest req;
  req.set_job_id(core.options.job_id);
  absl::Duration backoff = kMinBackoff;
  while (true) {
    v1::GetJobResponse resp;
    absl::Status s = core.meta->GetJob(req, &resp, core.options.rpc_timeout);
    if (s.ok()) {
      const uint32_t stored = resp.job().spec().world_size();
      if (stored != core.options.world_size && core.options.resize_world && absl::Now() < deadline) {
        Backoff(*core.meta, &backoff, deadline);  // rank 0 resizes it
        continue;
      }
      if (stored != core.options.world_size) {
        return absl::FailedPreconditionError(
            absl::StrCat("job \"", core.options.job_id, "\" exists with world size ", stored,
                         ", this rank was started with ", core.options.world_size));
      }
      if (resp.job().deleting()) {
        return absl::FailedPreconditionError(
            absl::StrCat("job \"", core.options.job_id, "\" is being deleted"));
      }
      return absl::OkStatus();
    }
    if (!absl::IsNotFound(s) && !absl::IsUnavailable(s)) return s;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          absl::IsNotFound(s) ? "rank 0 did not create job \"" : "ckpt-meta unreachable for job \"",
          core.options.job_id, "\" within the connect timeout: ", s.message()));
    }
    Backoff(*core.meta, &backoff, deadline);
  }
}

}  // namespace

absl::Status JoinJob(ClientCore& core, absl::Time deadline) {
  return core.options.rank == 0 ? CreateOrOpenJob(core, deadline) : AwaitJob(core, deadline);
}

std::string AgentSocketPath(const std::string& agent_socket) {
  if (absl::StartsWith(agent_socket, "unix:")) return agent_socket.substr(5);
  if (absl::StrContains(agent_socket, ":")) return "";  // another gRPC target (unix-abstract:, dns:)
  return agent_socket;
}

absl::Status ConnectAgent(ClientCore& core, absl::Time deadline) {
  absl::Duration backoff = kMinBackoff;
  v1::AgentStatusResponse resp;
  while (true) {
    absl::Status s = core.agent->AgentStatus(&resp, core.options.rpc_timeout);
    if (s.ok()) break;
    if (!absl::IsUnavailable(s)) return s;
    if (absl::Now() >= deadline) {
      // What the socket says now, in words, if it says anything.
      absl::Status probe = absl::OkStatus();
      if (std::string path = AgentSocketPath(core.options.agent_socket); !path.empty()) {
        probe = ProbeAgentSocket(path, kAgentSocketHow);
      }
      return absl::DeadlineExceededError(
          absl::StrCat("ckpt-agent at ", core.options.agent_socket, " unreachable within the connect timeout: ",
                       probe.ok() ? s.message() : probe.message()));
    }
    Backoff(*core.agent, &backoff, deadline);
  }
  core.node_id = resp.node_id();
  if (resp.pool_file_bytes_size() != 0 && resp.pool_file_bytes_size() != resp.pool_files_size()) {
    log::Warn("agent lists {} pool files but {} sizes; ignoring the sizes",
              resp.pool_files_size(), resp.pool_file_bytes_size());
  }
  // The pool comes over the session socket as a descriptor: the trainer
  // needs nothing of the agent's file system but the socket directory. An
  // older agent without one: map the pool files by path.
  absl::StatusOr<std::string> session = SessionId(core);
  if (!session.ok()) return session.status();
  if (session->empty()) {
    for (const std::string& path : resp.pool_files()) {
      CKPT_RETURN_IF_ERROR_CTX(core.mappings.AddPoolFile(path), "mapping the agent's pool file");
    }
  }
  // (Session ids are secrets of this process: logs show their first digits.)
  log::Debug("connected to agent {} (session {}, {} pool files mapped)", core.node_id,
             session->empty() ? "none" : session->substr(0, 8) + "...", resp.pool_files_size());
  return absl::OkStatus();
}

absl::Status CallMetaRetrying(const ClientCore& core, const std::function<absl::Status(absl::Duration)>& call) {
  const absl::Time deadline = absl::Now() + core.options.rpc_timeout;
  absl::Duration backoff = kMinBackoff;
  while (true) {
    absl::Status s = call(std::max(deadline - absl::Now(), absl::Milliseconds(1)));
    if (!absl::IsUnavailable(s) || absl::Now() >= deadline) return s;
    Backoff(*core.meta, &backoff, deadline);
  }
}

absl::StatusOr<std::shared_ptr<PullStaging::Buffer>> StagingBuffer(ClientCore& core, uint64_t size) {
  std::shared_ptr<PullStaging> staging;
  {
    absl::MutexLock lock(&core.staging_mu);
    staging = core.staging;
  }
  if (staging == nullptr) {
    absl::StatusOr<std::shared_ptr<PullStaging>> made = PullStaging::Create();
    if (!made.ok()) return made.status();
    absl::MutexLock lock(&core.staging_mu);
    if (core.staging == nullptr) core.staging = *std::move(made);  // else a racing save's wins
    staging = core.staging;
  }
  return staging->Acquire(size);
}

absl::StatusOr<std::string> SessionId(ClientCore& core) {
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<AgentSession> session, OpenSession(core));
  return session == nullptr ? std::string() : session->id();
}

absl::StatusOr<std::shared_ptr<AgentSession>> OpenSession(ClientCore& core) {
  std::string resume;
  {
    absl::MutexLock lock(&core.session_mu);
    if (!core.sessions_supported) return std::shared_ptr<AgentSession>();
    if (core.session != nullptr && !core.session->Closed()) return core.session;
    if (core.session != nullptr) resume = core.session->id();
  }
  // (Re)open without holding the lock: it talks to the agent.
  absl::StatusOr<std::unique_ptr<AgentSession>> opened =
      AgentSession::Open(AgentSession::SocketFor(core.options.agent_socket), resume, core.options.rpc_timeout);
  // A connection this client dropped itself (a request broke off) may not
  // have been seen closed by the agent yet.
  for (int i = 0; i < 20 && !resume.empty() && absl::IsFailedPrecondition(opened.status()) &&
                  absl::StrContains(opened.status().message(), "in use");
       ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    opened = AgentSession::Open(AgentSession::SocketFor(core.options.agent_socket), resume, core.options.rpc_timeout);
  }
  if (absl::IsNotFound(opened.status()) && resume.empty()) {
    absl::MutexLock lock(&core.session_mu);
    core.sessions_supported = false;  // an older agent: leases expire by ttl
    return std::shared_ptr<AgentSession>();
  }
  if (!opened.ok()) return opened.status();
  for (const AgentSession::Pool& pool : (*opened)->pools()) {
    CKPT_RETURN_IF_ERROR_CTX(core.mappings.AddPoolFd(pool.path, pool.fd), "mapping the agent's pool");
  }
  absl::MutexLock lock(&core.session_mu);
  if (core.session != nullptr && !core.session->Closed()) return core.session;  // another thread won
  if (!resume.empty() && (*opened)->id() != resume) {
    log::Warn("the agent restarted: new session {}... (leases and handles of session {}... are gone)",
              (*opened)->id().substr(0, 8), resume.substr(0, 8));
  }
  core.session = *std::move(opened);
  return core.session;
}

absl::Status WaitForVersion(const ClientCore& core, uint64_t step, Level level,
                            absl::Time deadline, absl::Time not_found_until) {
  CKPT_RETURN_IF_ERROR(ValidateStep(step));
  v1::WaitVersionRequest req;
  req.set_job_id(core.options.job_id);
  req.set_step(step);
  req.set_level(ToProto(level));
  absl::Duration backoff = kMinBackoff;
  absl::Status last;
  while (true) {
    const absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
    const absl::Duration poll = std::min(left, kMaxPoll);
    req.set_timeout_ms(absl::ToInt64Milliseconds(poll));
    // The server answers at timeout_ms; the gRPC deadline leaves it room.
    v1::WaitVersionResponse resp;
    last = core.meta->WaitVersion(req, &resp, poll + core.options.rpc_timeout);
    if (last.ok()) return last;
    const bool time_left = absl::Now() < deadline;
    if (absl::IsDeadlineExceeded(last)) {
      if (time_left) continue;  // one long poll ended; poll again
      return last;              // says the version's current state
    }
    // Right after a commit the agent may not have begun the version at meta
    // yet: NotFound is retried for a grace period, unless meta already says
    // why the step can never appear (a newer version refuses it).
    const bool begin_pending = absl::IsNotFound(last) && absl::Now() < not_found_until &&
                               last.message().find("no version") != absl::string_view::npos &&
                               last.message().find("is refused") == absl::string_view::npos;
    if (!absl::IsUnavailable(last) && !begin_pending) return last;
    if (!time_left) {
      return absl::DeadlineExceededError(absl::StrCat(
          "waiting for ", core.options.job_id, "/", step, ": ckpt-meta unreachable: ",
          last.message()));
    }
    Backoff(*core.meta, &backoff, deadline);
  }
}

}  // namespace client

Client client::MakeClient(std::shared_ptr<ClientCore> core) { return Client(std::move(core)); }

Client::Client(std::shared_ptr<client::ClientCore> core) : core_(std::move(core)) {}
Client::Client(Client&&) noexcept = default;
Client& Client::operator=(Client&&) noexcept = default;
Client::~Client() = default;

absl::StatusOr<Client> Client::Connect(const ClientOptions& options) {
  CKPT_RETURN_IF_ERROR(client::ValidateOptions(options));
  // A socket that cannot work (the session socket, a path through a file,
  // one we may not open) fails at once, saying what to do; no socket yet or
  // nobody accepting may pass (an agent starting), so those are waited for.
  if (std::string path = client::AgentSocketPath(options.agent_socket); !path.empty()) {
    bool may_heal = false;
    if (absl::Status s = ProbeAgentSocket(path, client::kAgentSocketHow, &may_heal); !s.ok() && !may_heal) return s;
  }
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  std::shared_ptr<client::ClientCore> core = client::NewClientCore();
  core->options = options;
  TlsFiles tls;
  tls.ca_file = options.tls_ca_file;
  tls.cert_file = options.tls_cert_file;
  tls.key_file = options.tls_key_file;
  TlsFilesFromEnvironment(&tls);
  tls.expect_peer_uri = MetaPeerUri();  // only ckpt-meta's certificate, whatever its address
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> meta_credentials, ChannelCredentials(tls));
  absl::StatusOr<std::string> token = TokenFromEnvironment(options.token_file);
  if (!token.ok()) return token.status();
  core->meta = client::NewGrpcMetaLink(options.meta_address, std::move(meta_credentials), *token);
  const std::string agent_target = absl::StartsWith(options.agent_socket, "unix:")
                                       ? options.agent_socket
                                       : absl::StrCat("unix:", options.agent_socket);
  core->agent = client::NewGrpcAgentLink(agent_target);
  CKPT_RETURN_IF_ERROR(client::JoinJob(*core, deadline));
  CKPT_RETURN_IF_ERROR(client::ConnectAgent(*core, deadline));
  return Client(std::move(core));
}

const ClientOptions& Client::options() const { return core_->options; }
const std::string& Client::node_id() const { return core_->node_id; }

absl::Status Client::WaitVersion(uint64_t step, Level level, absl::Time deadline) const {
  CKPT_RETURN_IF_ERROR(core_->CheckProcess());
  if (!core_->WaitSaves(deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("WaitVersion of step ", step, ": this client's last save has not committed yet (a lazy save still copying, or the agent has not answered its commit)"));
  }
  return client::WaitForVersion(*core_, step, level, deadline, core_->GraceEnd(step));
}

absl::Status SaveHandle::Committed(absl::Time deadline) const {
  if (core_ == nullptr) return absl::FailedPreconditionError("SaveHandle is empty");
  CKPT_RETURN_IF_ERROR(core_->CheckProcess());
  if (commit_ == nullptr) return absl::OkStatus();
  return commit_->Wait(deadline);
}

absl::Status SaveHandle::Wait(Level level, absl::Time deadline) const {
  CKPT_RETURN_IF_ERROR(Committed(deadline));
  return client::WaitForVersion(*core_, step_, level, deadline, committed_at_ + client::kBeginGrace);
}

absl::StatusOr<uint64_t> Client::Latest(Level level) const {
  CKPT_RETURN_IF_ERROR(core_->CheckProcess());
  core_->WaitSaves();
  v1::LatestRequest req;
  req.set_job_id(core_->options.job_id);
  req.set_min_level(client::ToProto(level));
  v1::LatestResponse resp;
  CKPT_RETURN_IF_ERROR(client::CallMetaRetrying(
      *core_, [&](absl::Duration timeout) { return core_->meta->Latest(req, &resp, timeout); }));
  return resp.version().step();
}

namespace {

// "12.3 ms", "4.5 s", "3.2 h": durations for people.
std::string Human(absl::Duration d) {
  const double s = absl::ToDoubleSeconds(d);
  if (s < 1) return absl::StrFormat("%.1f ms", s * 1e3);
  if (s < 120) return absl::StrFormat("%.1f s", s);
  if (s < 7200) return absl::StrFormat("%.1f min", s / 60);
  if (s < 2 * 86400) return absl::StrFormat("%.1f h", s / 3600);
  return absl::StrFormat("%.1f days", s / 86400);
}

}  // namespace

absl::StatusOr<absl::Duration> Client::PauseProtection(absl::Duration d) const {
  CKPT_RETURN_IF_ERROR(core_->CheckProcess());
  v1::PauseProtectionRequest req;
  req.set_duration_ms(absl::ToInt64Milliseconds(d));
  v1::PauseProtectionResponse resp;
  CKPT_RETURN_IF_ERROR(core_->agent->PauseProtection(req, &resp, core_->options.rpc_timeout));
  return absl::Milliseconds(resp.remaining_ms());
}

IntervalAdvice YoungDalyInterval(absl::Duration checkpoint_cost, absl::Duration mtbf, absl::Duration step_time) {
  IntervalAdvice a;
  a.checkpoint_cost = checkpoint_cost;
  a.mtbf = mtbf;
  const double t = std::sqrt(2.0 * absl::ToDoubleSeconds(checkpoint_cost) * absl::ToDoubleSeconds(mtbf));
  a.interval = absl::Seconds(t);
  const double steps = std::round(t / absl::ToDoubleSeconds(step_time));
  a.steps = steps < 1 ? 1 : static_cast<uint64_t>(std::min(steps, 1e18));
  return a;
}

absl::StatusOr<IntervalAdvice> Client::RecommendedInterval(absl::Duration step_time) const {
  if (step_time <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("step_time must be positive, got ", absl::FormatDuration(step_time)));
  }
  std::vector<absl::Duration> costs;
  {
    absl::MutexLock lock(&core_->cost_mu);
    for (const auto& [step, d] : core_->save_costs) costs.push_back(d);
  }
  if (costs.empty()) {
    return absl::FailedPreconditionError(
        "no save of this client measured yet: the interval needs what a checkpoint costs (save once, then ask)");
  }
  std::sort(costs.begin(), costs.end());
  IntervalAdvice a;
  a.checkpoint_cost = costs[costs.size() / 2];
  v1::ClusterStatusRequest req;
  req.set_job_id(core_->options.job_id);
  req.set_max_problems(1);
  v1::ClusterStatusResponse resp;
  CKPT_RETURN_IF_ERROR(client::CallMetaRetrying(*core_, [&](absl::Duration timeout) {
    return core_->meta->ClusterStatus(req, &resp, timeout);
  }));
  const v1::FailureStats& f = resp.failure_stats();
  if (f.job_mtbf_ms() <= 0) {
    return absl::FailedPreconditionError("meta has observed no node time yet: no MTBF to plan with");
  }
  a.mtbf = absl::Milliseconds(f.job_mtbf_ms());
  a.mtbf_is_lower_bound = f.mtbf_is_lower_bound();
  a.failures_seen = f.failures();
  a.observed_node_time = absl::Milliseconds(f.observed_node_ms());
  a.job_nodes = f.job_nodes();
  const IntervalAdvice young = YoungDalyInterval(a.checkpoint_cost, a.mtbf, step_time);
  a.interval = young.interval;
  a.steps = young.steps;
  a.explanation = absl::StrCat(
      "Young/Daly: sqrt(2 x checkpoint cost ", Human(a.checkpoint_cost), " x MTBF ", a.mtbf_is_lower_bound ? ">= " : "",
      Human(a.mtbf), ") = ", Human(a.interval), " = ", a.steps, " step(s) of ", Human(step_time), "; MTBF: ",
      a.failures_seen, " failure(s) in ", Human(a.observed_node_time), " of node time, job on ", a.job_nodes,
      " node(s)", a.mtbf_is_lower_bound ? " (no failure seen yet: a lower bound)" : "", "; cost: median of ",
      costs.size(), " save(s)");
  return a;
}

}  // namespace ckpt
