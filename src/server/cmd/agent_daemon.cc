// The node agent daemon (docs/architecture.md "Processes"): ckpt-agent, and ckpt-dpu-agent
// (src/dpu_agent/) which runs the same daemon with pull-mode ingest.
//
// Flags and layered configuration, wiring (memory tier -> Agent -> gRPC
// AgentService on the local unix socket and on TCP, MetaLink to ckpt-meta,
// /metrics), and signal handling. No logic: that lives in server/agent and
// server/rpc.
//
// Threads owned here: ckpt-agent-sig (sigwait), plus the Agent's loops
// (ckpt-agent-ctl, -vfy, -task), gRPC's and the metrics server's.
//
// Exit codes: 0 after a clean shutdown, 1 for a runtime failure (cannot bind,
// memory tier cannot be reserved), 2 for a usage or configuration error.
#include <signal.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <grpcpp/grpcpp.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/cpu_affinity.h"
#include "common/file_system.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "common/metrics.h"
#include "common/names.h"
#include "common/sd_notify.h"
#include "common/unix_socket.h"
#include "server/agent/agent.h"
#include "server/cmd/agent_daemon.h"
#include "server/cmd/daemon.h"
#include "server/cmd/memory_fs.h"
#include "server/cmd/daemon_tls.h"
#include "server/rpc/agent_service.h"
#include "server/rpc/meta_link_grpc.h"
#include "transport/ucx/node_identity.h"
#include "transport/ucx/ucx_transport.h"

namespace ckpt {
namespace {

using daemon::kExitFailure;
using daemon::kExitOk;
using daemon::kExitUsage;

constexpr char kDefaultListen[] = "127.0.0.1:7401";
constexpr char kDefaultDataListen[] = "127.0.0.1:7402";
constexpr char kDefaultMetricsListen[] = "127.0.0.1:9401";
constexpr char kDefaultRunDir[] = "/run/ckpt";
constexpr uint64_t kDefaultMemoryBytes = uint64_t{4} << 30;
constexpr auto kDrainDeadline = std::chrono::seconds(5);
constexpr int kMaxMessageBytes = 256 << 20;  // manifests of huge shards

const std::set<std::string>& KnownKeys() {
  static const auto* keys = new std::set<std::string>{
      "node_id", "meta", "listen", "data_listen", "run_dir", "memory", "memory_dir", "durable_root",
      "failure_domain", "metrics_listen", "lease_ttl_ms", "rpc_timeout_ms", "log_level", "log_json", "log_file",
      "data_transport", "data_chunk", "data_rate", "data_in_flight", "peer_timeout_ms", "session_grace_ms",
      "advertise_host", "tls_ca", "tls_cert", "tls_key", "tls_reload_seconds", "tls_crl_dir", "token_file",
      "admin_token_file", "socket_group", "peer_membership", "host_node", "insecure",
      "data_encryption", "cpus",
  };
  return *keys;
}

struct Settings {
  agent::AgentOptions agent;
  std::string meta;
  std::string listen;
  std::string data_listen;
  std::string data_transport;  // "ucx" or "none"
  bool data_encryption = false;  // payloads encrypted on the data plane (UcxOptions::encrypt_payloads)
  std::string advertise_host;  // for wildcard listen addresses
  std::string run_dir;
  std::string metrics_listen;
  absl::Duration rpc_timeout;
  log::Level log_level = log::Level::kInfo;
  bool log_json = false;
  std::string log_file;
  TlsFiles tls;  // checked; credentials are made once signals are blocked (gRPC starts threads)
  bool insecure = false;  // --insecure: plaintext on loopback only, no caller identities
  std::string meta_token;  // sent with every call to ckpt-meta (--token-file)
  std::string admin_token;  // calls on the TCP endpoint need it (--admin-token-file); empty: open
  std::vector<int> cpus;  // --cpus: the only CPUs the agent's threads run on (empty: all it may use)
};

using daemon::AgentFlavor;

absl::StatusOr<Settings> LoadSettings(const std::string& config_file, const std::map<std::string, std::string>& flags,
                                      const AgentFlavor& flavor) {
  absl::StatusOr<Config> config = daemon::LoadDaemonConfig(config_file, flags, KnownKeys());
  if (!config.ok()) return config.status();
  Settings out;
  agent::AgentOptions& a = out.agent;
  a.node_id = config->GetStringOr("node_id", "");
  if (a.node_id.empty()) {
    char host[256] = {};
    if (::gethostname(host, sizeof(host) - 1) == 0) a.node_id = host;
  }
  if (absl::Status s = ValidateNodeId(a.node_id); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--node-id: ", s.message()));
  }
  out.meta = config->GetStringOr("meta", "");
  if (out.meta.empty()) {
    return absl::InvalidArgumentError("the meta address is required: pass --meta HOST:PORT (or CKPT_META)");
  }
  if (absl::Status s = daemon::ValidateMetaAddresses("meta", out.meta); !s.ok()) return s;
  out.listen = config->GetStringOr("listen", kDefaultListen);
  if (absl::Status s = daemon::ValidateHostPort("listen", out.listen); !s.ok()) return s;
  out.data_listen = config->GetStringOr("data_listen", kDefaultDataListen);
  if (absl::Status s = daemon::ValidateHostPort("data_listen", out.data_listen); !s.ok()) return s;
  out.advertise_host = config->GetStringOr("advertise_host", "");
  if (out.advertise_host.find_first_of(":/ ") != std::string::npos && out.advertise_host.front() != '[') {
    return absl::InvalidArgumentError("--advertise-host must be a host name or address (IPv6 in brackets)");
  }
  out.data_transport = config->GetStringOr("data_transport", "ucx");
  if (out.data_transport != "ucx" && out.data_transport != "none") {
    return absl::InvalidArgumentError(
        absl::StrCat("--data-transport must be ucx or none, not \"", out.data_transport, "\""));
  }
  absl::StatusOr<uint64_t> chunk = config->GetBytesOr("data_chunk", uint64_t{8} << 20);
  if (!chunk.ok()) return chunk.status();
  if (*chunk < 4096 || *chunk > (uint64_t{1} << 30)) {
    return absl::InvalidArgumentError("--data-chunk must be between 4KiB and 1GiB (default 8MiB)");
  }
  out.agent.bulk.chunk_bytes = *chunk;
  absl::StatusOr<uint64_t> rate = config->GetBytesOr("data_rate", 0);
  if (!rate.ok()) return rate.status();
  out.agent.bulk.max_bytes_per_second = *rate;
  absl::StatusOr<uint64_t> in_flight = config->GetBytesOr("data_in_flight", 4);
  if (!in_flight.ok()) return in_flight.status();
  if (*in_flight < 1 || *in_flight > 64) return absl::InvalidArgumentError("--data-in-flight must be 1..64");
  out.agent.bulk.max_in_flight = static_cast<int>(*in_flight);
  absl::StatusOr<absl::Duration> peer_timeout = config->GetDurationOr("peer_timeout_ms", absl::Seconds(30));
  if (!peer_timeout.ok()) return peer_timeout.status();
  out.agent.peer_timeout_ms = absl::ToInt64Milliseconds(*peer_timeout);
  absl::StatusOr<bool> membership = config->GetBoolOr("peer_membership", true);
  if (!membership.ok()) return membership.status();
  out.agent.check_peer_membership = *membership;
  if (const std::string cpus = config->GetStringOr("cpus", ""); !cpus.empty()) {
    absl::StatusOr<std::vector<int>> list = ParseCpuList(cpus);
    if (!list.ok()) return absl::InvalidArgumentError(absl::StrCat("--cpus: ", list.status().message()));
    if (absl::Status s = CheckCpusAllowed(*list, "this agent"); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--cpus ", cpus, ": ", s.message()));
    }
    out.cpus = *std::move(list);
  }
  out.metrics_listen = config->GetStringOr("metrics_listen", kDefaultMetricsListen);
  if (absl::Status s = daemon::ValidateHostPort("metrics_listen", out.metrics_listen); !s.ok()) return s;
  out.run_dir = config->GetStringOr("run_dir", kDefaultRunDir);
  absl::StatusOr<uint64_t> memory = config->GetBytesOr("memory", kDefaultMemoryBytes);
  if (!memory.ok()) return memory.status();
  if (*memory < (uint64_t{1} << 20)) {
    return absl::InvalidArgumentError("--memory must be at least 1MiB (e.g. 4GiB)");
  }
  a.memory_bytes = *memory;
  a.memory_dir = config->GetStringOr("memory_dir", absl::StrCat("/dev/shm/ckpt-", a.node_id));
  a.durable_root = config->GetStringOr("durable_root", "");
  a.failure_domain = config->GetStringOr("failure_domain", "");
  if (flavor.dpu) {
    a.host_node_id = config->GetStringOr("host_node", "");
    CKPT_RETURN_IF_ERROR(ValidateHostNodeId(a.node_id, a.host_node_id, "--host-node"));
  } else if (!config->GetStringOr("host_node", "").empty()) {
    return absl::InvalidArgumentError("--host-node is only for ckpt-dpu-agent");
  }
  absl::StatusOr<absl::Duration> ttl = config->GetDurationOr("lease_ttl_ms", absl::Seconds(60));
  if (!ttl.ok()) return ttl.status();
  a.default_lease_ttl_ms = absl::ToInt64Milliseconds(*ttl);
  absl::StatusOr<absl::Duration> grace = config->GetDurationOr("session_grace_ms", absl::Seconds(10));
  if (!grace.ok()) return grace.status();
  if (*grace < absl::ZeroDuration()) return absl::InvalidArgumentError("--session-grace-ms must not be negative");
  a.session_grace_ms = absl::ToInt64Milliseconds(*grace);
  if (const std::string group = config->GetStringOr("socket_group", ""); !group.empty()) {
    CKPT_ASSIGN_OR_RETURN(a.socket_gid, SocketGroupId(group));
  }
  absl::StatusOr<absl::Duration> rpc_timeout = config->GetDurationOr("rpc_timeout_ms", absl::Seconds(10));
  if (!rpc_timeout.ok()) return rpc_timeout.status();
  out.rpc_timeout = *rpc_timeout;
  absl::StatusOr<log::Level> level = log::ParseLevel(config->GetStringOr("log_level", "info"));
  if (!level.ok()) return level.status();
  out.log_level = *level;
  absl::StatusOr<bool> json = config->GetBoolOr("log_json", false);
  if (!json.ok()) return json.status();
  out.log_json = *json;
  out.log_file = config->GetStringOr("log_file", "");
  CKPT_ASSIGN_OR_RETURN(out.tls, daemon::TlsSettings(*config));
  if (absl::Status s = CheckTlsFiles(out.tls, /*server=*/true, /*also_client=*/true); !s.ok()) return s;
  CKPT_ASSIGN_OR_RETURN(out.insecure, daemon::InsecureSetting(*config, out.tls,
                                                              {{"--listen", out.listen},
                                                               {"--data-listen", out.data_listen}}));
  if (!out.insecure) {
    // The certificate must be this node's: meta accepts a node's calls only
    // from its own certificate, and tools check it before they send anything.
    CKPT_RETURN_IF_ERROR(
        daemon::CheckOwnIdentity(out.tls, pki::Identity{pki::Role::kNode, a.node_id, {}, a.host_node_id}));
  }
  CKPT_ASSIGN_OR_RETURN(out.meta_token, daemon::TokenSetting(*config, "token_file"));
  CKPT_ASSIGN_OR_RETURN(out.admin_token, daemon::TokenSetting(*config, "admin_token_file"));
  CKPT_ASSIGN_OR_RETURN(out.data_encryption, config->GetBoolOr("data_encryption", false));
  if (out.data_encryption && !out.tls.enabled() && out.meta_token.empty()) {
    return absl::InvalidArgumentError(
        "--data-encryption needs a data-plane key: run with TLS (ckpt-meta hands the key out) or give "
        "--token-file");
  }
  return out;
}

// Creates the run directory and removes a stale socket; refuses to take over
// a socket another live agent is serving.
absl::Status PrepareSocket(const std::string& run_dir, const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(run_dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("create run dir '", run_dir, "': ", ec.message()));
  if (path.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path '", path, "' is too long for a unix socket (max ",
                                                   sizeof(sockaddr_un::sun_path) - 1, " bytes)"));
  }
  if (::access(path.c_str(), F_OK) == 0) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    const bool live = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    if (live) {
      return absl::FailedPreconditionError(
          absl::StrCat("another agent is serving '", path, "'; use a different --run-dir"));
    }
    ::unlink(path.c_str());
  }
  return absl::OkStatus();
}

int Serve(const Settings& settings, const sigset_t& signals, const AgentFlavor& flavor) {
  const char* const kProgram = flavor.program;
  daemon::StopRequest stop;
  daemon::SignalThread signal_thread(kProgram, "ckpt-agent-sig", signals, &stop);
  log::Info("{} starting: node {}, meta {}, memory {} bytes in {}, durable root {}", kProgram,
            settings.agent.node_id, settings.meta, settings.agent.memory_bytes, settings.agent.memory_dir,
            settings.agent.durable_root.empty() ? "(none)" : settings.agent.durable_root);

  const std::string socket_path = settings.run_dir + "/agent.sock";
  if (absl::Status s = PrepareSocket(settings.run_dir, socket_path); !s.ok()) {
    log::Error("{}: {}", kProgram, s.ToString());
    return kExitFailure;
  }

  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server_credentials = ServerCredentials(settings.tls);
  TlsFiles to_meta = settings.tls;
  to_meta.expect_peer_uri = MetaPeerUri();  // only ckpt-meta's certificate, whatever its address
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> meta_credentials = ChannelCredentials(to_meta);
  if (!server_credentials.ok() || !meta_credentials.ok()) {  // checked at start; changed since?
    log::Error("{}: {}", kProgram,
               (!server_credentials.ok() ? server_credentials.status() : meta_credentials.status()).ToString());
    return kExitFailure;
  }
  MetricsRegistry registry;
  std::unique_ptr<agent::MetaLink> meta =
      rpc::NewGrpcMetaLink(settings.meta, settings.rpc_timeout, *meta_credentials, settings.meta_token);
  agent::AgentOptions options = settings.agent;
  // The memory tier is meant to be memory: on a disk file system it works,
  // but as a disk file. Said loudly, and in AgentStatus and /metrics.
  if (absl::StatusOr<daemon::FsKind> fs = daemon::FsKindOf(options.memory_dir); fs.ok()) {
    options.memory_dir_fs = fs->name;
    options.memory_dir_in_memory = fs->in_memory;
    if (std::string warning = daemon::MemoryDirWarning(options.memory_dir, *fs); !warning.empty()) {
      log::Warn("{}: WARNING: {}", kProgram, warning);
    }
  } else {
    log::Warn("{}: cannot tell what file system memory dir {} is on: {}", kProgram, options.memory_dir,
              fs.status().ToString());
  }
  // Peers and tools dial what the agent advertises: never a wildcard.
  absl::StatusOr<std::string> grpc_address = daemon::AdvertisedAddress(settings.listen, settings.advertise_host);
  if (!grpc_address.ok()) {
    log::Error("{}: {}", kProgram, grpc_address.status().ToString());
    return kExitFailure;
  }
  options.grpc_address = *grpc_address;

  // Clients keep a session open on this socket: it hands them the pool's
  // descriptor and its hang-up releases their leases (docs/agent.md).
  options.session_socket = settings.run_dir + "/session.sock";
  // The data plane: UCX picks RDMA, shared memory or TCP from what both
  // ends have (UCX_TLS and other UCX_* variables pass through).
  std::unique_ptr<transport::Transport> data_plane;
  if (settings.data_transport == "ucx") {
    // The data port speaks only ckpt's handshake (no UCX listener behind
    // it) and reuses its address, so a restarted agent listens again at once.
    // Peers prove the cluster's data-plane key in the handshake, so only
    // agents of this cluster connect (docs/protocol.md §8b). Over TLS the key
    // comes from meta at registration (meta hands it only to agents whose
    // certificate it accepted; it is not mixed with the agent token, which
    // meta has then already checked): until then the data plane refuses
    // every connection, and peers retry. With an --insecure meta, which
    // hands out no key, it is the agent token (--token-file), if any, from
    // the start.
    // Over TLS each connection also proves which node each side is, with
    // the node certificates (--tls-cert, re-read as --tls-reload-seconds
    // says), and the agent serves a message only for the node its connection
    // proved and connects only to the node meta lists at an address
    // (docs/protocol.md §8b "Identities").
    transport::UcxOptions ucx;
    ucx.encrypt_payloads = settings.data_encryption;
    const bool key_from_meta = settings.tls.enabled();
    if (key_from_meta) {
      ucx.require_auth = true;
      absl::StatusOr<std::shared_ptr<transport::NodeCredentialsFiles>> identity =
          transport::NodeCredentialsFiles::Open({settings.tls.ca_file, settings.tls.cert_file, settings.tls.key_file,
                                                 settings.tls.crl_dir, settings.tls.reload_seconds});
      if (!identity.ok()) {
        log::Error("{}: {}", kProgram, identity.status().ToString());
        return kExitFailure;
      }
      ucx.identity = [files = *std::move(identity)] { return files->Current(); };
      options.check_peer_identity = true;
    } else {
      ucx.auth_key = settings.meta_token;
    }
    std::unique_ptr<transport::UcxTransport> ucx_transport = transport::NewUcxTransport(ucx);
    if (key_from_meta) {
      transport::UcxTransport* const t = ucx_transport.get();
      options.on_data_plane_key = [t, token = settings.meta_token, kProgram](const std::string& key) {
        if (!key.empty()) {
          t->SetAuthKey(key);
        } else if (!token.empty()) {
          t->SetAuthKey(token);  // a meta that hands out no key (older than this agent)
        } else {
          log::Error("{}: ckpt-meta handed out no data-plane key and there is no --token-file: the data plane "
                     "refuses every peer (is meta running --insecure while this agent uses TLS?)",
                     kProgram);
        }
      };
    }
    data_plane = std::move(ucx_transport);
    options.transport = data_plane.get();
    options.data_listen_address = settings.data_listen;
    // Port 0 picks a free port: advertise what the transport bound.
    absl::StatusOr<std::string> data = daemon::AdvertisedAddress(settings.data_listen, settings.advertise_host);
    if (!data.ok()) {
      log::Error("{}: {}", kProgram, data.status().ToString());
      return kExitFailure;
    }
    if (!absl::EndsWith(settings.data_listen, ":0")) {
      options.data_address = *data;
    } else {
      options.advertise_host = daemon::HostOf(*data);
    }
  }
  // Pull-mode ingest (ckpt-dpu-agent): outlives the agent below.
  std::unique_ptr<agent::Puller> puller;
  if (flavor.make_puller) {
    absl::StatusOr<std::unique_ptr<agent::Puller>> p = flavor.make_puller();
    if (!p.ok()) {
      log::Error("{}: cannot start pull-mode ingest: {}", kProgram, p.status().ToString());
      return kExitFailure;
    }
    puller = *std::move(p);
    options.puller = puller.get();
  }
  const absl::Time t0 = absl::Now();
  absl::StatusOr<std::unique_ptr<agent::Agent>> agent =
      agent::Agent::Create(options, meta.get(), RealClock(), PosixFileSystem(), &registry);
  if (!agent.ok()) {
    log::Error("{}: cannot start (memory tier or data plane): {}", kProgram, agent.status().ToString());
    return kExitFailure;
  }
  log::Info("{}: memory tier ready in {} ms ({} bytes free)", kProgram,
            absl::ToInt64Milliseconds(absl::Now() - t0), (*agent)->arena().free_bytes());
  agent::Agent* const a = agent->get();

  std::atomic<bool> ready{false};
  absl::StatusOr<std::unique_ptr<MetricsServer>> metrics_server =
      MetricsServer::Start(settings.metrics_listen, &registry, [&](std::string* reason) {
        if (!ready.load()) {
          *reason = "starting";
          return false;
        }
        if (!a->Status().registered) {
          *reason = "not registered with ckpt-meta";
          return false;
        }
        return true;
      });
  // A DPU agent takes its trainers' calls on TCP from its host's node
  // certificate (the host's ckpt-dpu-proxy, docs/dpu.md).
  rpc::AgentServiceImpl service(a, "none", settings.admin_token, /*require_identity=*/!settings.insecure,
                                settings.agent.host_node_id);
  // Local clients take leases and open their own copies on their session
  // connections too (no gRPC round trip on a save's or a restore's path:
  // docs/agent.md "Client sessions").
  a->SetSessionRequestHandler([&service](const std::string& session_id, std::string_view kind,
                                          std::string_view request) {
    return service.OnSession(session_id, kind, request);
  });
  if (settings.insecure) {
    log::Warn("{}: --insecure: serving plaintext on {} and an unauthenticated data plane on {} (loopback only)",
              kProgram, settings.listen, settings.data_listen);
  }
  std::unique_ptr<grpc::Server> server;
  if (!metrics_server.ok()) {
    log::Error("{}: cannot serve metrics on {}: {}", kProgram, settings.metrics_listen,
               metrics_server.status().ToString());
    stop.Request(kExitFailure, "metrics server failed to start");
  } else {
    grpc::ServerBuilder builder;
    int port = 0;
    // TCP (peers' tools, ckptctl) with TLS when configured; the local socket
    // is guarded by its mode (0660, the agent's group).
    builder.AddListeningPort(settings.listen, *server_credentials, &port);
    builder.AddListeningPort("unix:" + socket_path, grpc::InsecureServerCredentials());
    builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
    builder.SetMaxSendMessageSize(kMaxMessageBytes);
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.RegisterService(&service);
    {
      // The socket file is created owner-only and opened to the group below
      // (common/unix_socket.h).
      OwnerOnlyUmask owner_only;
      server = builder.BuildAndStart();
    }
    if (server == nullptr || port == 0) {
      log::Error("{}: cannot listen on {} and {}", kProgram, settings.listen, socket_path);
      stop.Request(kExitFailure, "gRPC server failed to start");
    } else {
      // Trainers in the agent's group (or --socket-group) may connect.
      if (absl::Status opened = OpenSocketToGroup(socket_path, settings.agent.socket_gid); !opened.ok()) {
        log::Error("{}: {}", kProgram, std::string(opened.message()));
        stop.Request(kExitFailure, "--socket-group could not be applied");
      }
      a->Start();
      log::Info("{} listening on {}:{} and unix:{}", kProgram, daemon::HostOf(settings.listen), port, socket_path);
      ready.store(true);
      // systemd Type=notify: ready once the memory tier is open and both gRPC
      // endpoints serve; registration with meta happens in the background
      // (/readyz reports it), so a slow or absent meta does not fail the unit.
      sd::NotifyReady(absl::StrCat("serving on ", settings.listen, " and unix:", socket_path));
    }
  }

  stop.Wait();
  const int exit_code = stop.exit_code();
  log::Info("{} stopping ({})", kProgram, stop.reason());
  sd::NotifyStopping(absl::StrCat("stopping: ", stop.reason()));
  ready.store(false);
  if (exit_code == kExitOk) a->AnnounceStop();  // SIGTERM/SIGINT: a clean stop, not a failure in meta's MTBF
  if (server != nullptr) {
    server->Shutdown(std::chrono::system_clock::now() + kDrainDeadline);
    server->Wait();
    server.reset();
  }
  a->SetSessionRequestHandler(nullptr);  // before `service` goes
  a->Stop();  // committed shards stay in the memory tier for the next start
  agent->reset();
  ::unlink(socket_path.c_str());
  if (metrics_server.ok()) metrics_server->reset();
  signal_thread.Stop();
  log::Info("{} stopped", kProgram);
  log::Flush();
  return exit_code;
}

}  // namespace

namespace daemon {

int RunAgentDaemon(int argc, char** argv, const AgentFlavor& flavor) {
  const char* const kProgram = flavor.program;
  CLI::App app{
      flavor.description.empty() ? std::string("ckpt-agent: the ckpt node agent. Keeps trainers' checkpoint shards in a pre-allocated memory "
      "tier on a tmpfs (--memory-dir), serves local trainers on <run-dir>/agent.sock and tools on "
      "--listen (ckpt.v1.AgentService), reports to ckpt-meta (--meta) and writes the versions meta "
      "chooses to --durable-root.\n\n"
      "Configuration is layered: a YAML file (--config), then CKPT_* environment variables, then "
      "flags. File keys are the flag names with '_' for '-'.\n\n"
      "Committed shards survive a restart of the agent (kill -9 included): on start it re-adopts "
      "every shard whose crc32c still matches. SIGTERM or SIGINT exits 0 after draining calls.")
                                 : flavor.description,
      kProgram};
  app.get_formatter()->column_width(34);
  std::map<std::string, std::string> flags;
  std::map<std::string, std::string> values;
  std::map<std::string, CLI::Option*> opts;
  std::string config_file;
  auto option = [&](const std::string& flag, const std::string& help, const std::string& type,
                    const std::string& def = "") {
    CLI::Option* o = app.add_option(flag, values[flag], help)->type_name(type);
    if (!def.empty()) o->default_str(def);
    opts[flag] = o;
  };
  option("--node-id", "Stable id of this node ([A-Za-z0-9][A-Za-z0-9._-]{0,62}); default: the host name.", "ID");
  option("--meta", "ckpt-meta's gRPC address. Required.", "HOST:PORT");
  option("--listen", "host:port of the agent's gRPC service for tools and peers.", "HOST:PORT", kDefaultListen);
  option("--data-listen", "host:port of the data plane (advertised to peers).", "HOST:PORT", kDefaultDataListen);
  option("--data-transport", "ucx (RDMA, shared memory or TCP, as UCX finds) or none (no peer protection).",
         "KIND", "ucx");
  option("--data-chunk", "Size of the pieces large transfers are cut into (4KiB..1GiB).", "SIZE", "8MiB");
  option("--data-in-flight", "Chunks in flight per peer.", "N", "4");
  option("--data-rate", "Per-peer send limit in bytes per second (e.g. 2GiB); 0: unlimited.", "SIZE", "0");
  option("--peer-timeout-ms", "How long a peer may take to answer one step of a transfer.", "MS", "30000");
  option("--cpus",
         "The only CPUs the agent's threads run on, as taskset -c takes them (e.g. 6-7), so that the trainers keep "
         "the others; default: every CPU the agent may use.",
         "LIST");
  option("--data-encryption",
         "true: payloads this agent sends to peers travel encrypted (AES-256-GCM under a key of the connection); "
         "false: authenticated only (every message is, whenever the data plane has a key). Peers take either.",
         "BOOL", "false");
  option("--run-dir", "Directory of the local sockets agent.sock and session.sock (mode 0660); the only thing "
         "a trainer needs mounted.", "DIR", kDefaultRunDir);
  option("--advertise-host", "Host peers and tools dial when --listen/--data-listen is a wildcard (0.0.0.0); "
         "default: this machine's first non-loopback IPv4 address.", "HOST");
  option("--socket-group",
         "Group (name or gid) given agent.sock and session.sock; a session is then opened only for processes the "
         "kernel reports in that group (SO_PEERCRED, SO_PEERGROUPS), root or the agent's user. Default: the "
         "sockets' mode (0660, the agent's group) alone.",
         "GROUP");
  option("--session-grace-ms", "How long a client's leases and handles outlive its session connection.", "MS",
         "10000");
  option("--memory", "Memory-tier budget, reserved and pre-faulted at start (e.g. 4GiB).", "SIZE", "4GiB");
  option("--memory-dir", "tmpfs directory of the memory tier; default /dev/shm/ckpt-<node-id>.", "DIR");
  option("--durable-root", "Root of the durable tier (local path or a shared mount); empty: no flush.", "DIR");
  option("--failure-domain", "Failure-domain label (e.g. rack-12) for placement.", "LABEL");
  if (flavor.dpu) {
    option("--host-node", "Node id of the host this DPU serves (its ckpt-agent's --node-id, if it runs one): "
           "placement keeps a DPU and its host in one failure domain. Required.", "ID");
  }
  option("--metrics-listen", "host:port serving /metrics, /healthz and /readyz.", "HOST:PORT",
         kDefaultMetricsListen);
  option("--lease-ttl-ms", "Default life of an uncommitted staging lease.", "MS", "60000");
  option("--rpc-timeout-ms", "Deadline of each call to ckpt-meta.", "MS", "10000");
  option("--token-file", "File holding the token sent to ckpt-meta (its --agent-token-file); mode 0600.", "FILE");
  option("--admin-token-file",
         "File holding the admin token (the one ckpt-meta's --admin-token-file holds); mode 0600 or 0640. With "
         "it, every call on --listen (ckptctl restore, verify, holdings; evict, flush, pause) needs it; the "
         "local socket is unchanged.",
         "FILE");
  option("--peer-membership",
         "true: take pushes and reads only from nodes ckpt-meta lists as registered and alive, with the "
         "incarnation they state (docs/security.md); false: from any peer that completes the handshake (a "
         "rolling upgrade from agents that do not state who they are).",
         "BOOL", "true");
  option("--log-level", "trace, debug, info, warn, error or off.", "LEVEL", "info");
  option("--log-file", "Append logs to this file instead of stderr.", "FILE");
  app.add_option("--config", config_file, "YAML config file with any of these keys.")->type_name("FILE");
  bool log_json = false;
  CLI::Option* json_opt = app.add_flag("--log-json", log_json, "Write logs as JSON lines.");
  daemon::TlsFlags tls_flags;
  daemon::AddTlsFlags(app, &tls_flags, /*server=*/true);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitUsage;
  }
  for (const auto& [flag, o] : opts) {
    if (o->count() > 0) flags[flag] = values[flag];
  }
  if (json_opt->count() > 0) flags["--log-json"] = log_json ? "true" : "false";
  daemon::SetTlsFlags(tls_flags, &flags);
  absl::StatusOr<Settings> settings = LoadSettings(config_file, flags, flavor);
  if (!settings.ok()) {
    std::fprintf(stderr, "%s: %s\nRun with --help for more information.\n", kProgram,
                 std::string(settings.status().message()).c_str());
    return kExitUsage;
  }
  // Before logging and gRPC start their threads (those running already are
  // moved too).
  if (!settings->cpus.empty()) {
    if (absl::Status s = ConfineToCpus(settings->cpus); !s.ok()) {
      std::fprintf(stderr, "%s: --cpus: %s\n", kProgram, std::string(s.message()).c_str());
      return kExitUsage;
    }
  }
  log::Options log_options;
  log_options.level = settings->log_level;
  log_options.json = settings->log_json;
  log_options.file = settings->log_file;
  log_options.name = kProgram;
  sigset_t signals;
  if (int rc = daemon::InitLoggingAndSignals(kProgram, log_options, &signals); rc != kExitOk) return rc;
  if (!settings->cpus.empty()) log::Info("{}: runs on CPUs {} only (--cpus)", kProgram, FormatCpuList(settings->cpus));
  return Serve(*settings, signals, flavor);
}

}  // namespace daemon
}  // namespace ckpt
