// ckpt-dpu-proxy: the host side of a DPU agent's control path (docs/dpu.md
// "Control path: a host-side socket proxy"). Serves the host's
// <run-dir>/agent.sock to trainers and carries each connection to the DPU
// agent's gRPC port over mutual TLS as the host's node (dpu_agent/dpu_proxy.h).
//
// Exit codes: 0 after SIGTERM/SIGINT, 1 for a runtime failure (the socket
// cannot be made), 2 for a usage or configuration error.
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <map>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/log.h"
#include "common/sd_notify.h"
#include "common/unix_socket.h"
#include "dpu_agent/dpu_proxy.h"
#include "server/cmd/daemon.h"

namespace ckpt {
namespace {

constexpr char kProgram[] = "ckpt-dpu-proxy";
constexpr char kDefaultSocket[] = "/run/ckpt/agent.sock";
// Beside a host agent's 9401 (a host with a DPU runs none, but a test may).
constexpr char kDefaultMetricsListen[] = "127.0.0.1:9402";

const std::set<std::string>& KnownKeys() {
  static const auto* keys = new std::set<std::string>{
      "dpu_address", "dpu_node", "socket", "socket_group", "max_connections", "connect_timeout_ms",
      "tls_ca",      "tls_cert", "tls_key", "tls_crl_dir", "log_level",     "log_json",           "log_file",
      "metrics_listen",
  };
  return *keys;
}

struct Settings {
  dpu::DpuProxyOptions proxy;
  std::string metrics_listen;  // "" or "off": none
  log::Options log;
};

absl::StatusOr<Settings> LoadSettings(const std::string& config_file, const std::map<std::string, std::string>& flags) {
  absl::StatusOr<Config> config = daemon::LoadDaemonConfig(config_file, flags, KnownKeys());
  if (!config.ok()) return config.status();
  Settings out;
  dpu::DpuProxyOptions& p = out.proxy;
  p.dpu_address = config->GetStringOr("dpu_address", "");
  if (p.dpu_address.empty()) {
    return absl::InvalidArgumentError(
        "--dpu-address is required: the DPU agent's gRPC address on the host-to-DPU link (its --listen), e.g. "
        "192.168.100.2:7401");
  }
  if (absl::Status s = daemon::ValidateHostPort("dpu_address", p.dpu_address); !s.ok()) return s;
  p.dpu_node = config->GetStringOr("dpu_node", "");
  out.metrics_listen = config->GetStringOr("metrics_listen", kDefaultMetricsListen);
  if (out.metrics_listen == "off") out.metrics_listen.clear();
  if (!out.metrics_listen.empty()) {
    if (absl::Status s = daemon::ValidateHostPort("metrics_listen", out.metrics_listen); !s.ok()) return s;
  }
  p.socket_path = config->GetStringOr("socket", kDefaultSocket);
  if (const std::string group = config->GetStringOr("socket_group", ""); !group.empty()) {
    absl::StatusOr<int> gid = SocketGroupId(group);
    if (!gid.ok()) return gid.status();
    p.socket_gid = *gid;
  }
  absl::StatusOr<uint64_t> max = config->GetUint64Or("max_connections", 256);
  if (!max.ok()) return max.status();
  if (*max < 1 || *max > 65536) return absl::InvalidArgumentError("--max-connections must be 1..65536");
  p.max_connections = static_cast<size_t>(*max);
  absl::StatusOr<absl::Duration> timeout = config->GetDurationOr("connect_timeout_ms", absl::Seconds(10));
  if (!timeout.ok()) return timeout.status();
  if (*timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("--connect-timeout-ms must be positive");
  p.connect_timeout = *timeout;
  p.tls_ca = config->GetStringOr("tls_ca", "");
  p.tls_cert = config->GetStringOr("tls_cert", "");
  p.tls_key = config->GetStringOr("tls_key", "");
  p.tls_crl_dir = config->GetStringOr("tls_crl_dir", "");
  absl::StatusOr<log::Level> level = log::ParseLevel(config->GetStringOr("log_level", "info"));
  if (!level.ok()) return level.status();
  out.log.level = *level;
  absl::StatusOr<bool> json = config->GetBoolOr("log_json", false);
  if (!json.ok()) return json.status();
  out.log.json = *json;
  out.log.file = config->GetStringOr("log_file", "");
  out.log.name = kProgram;
  return out;
}

int Run(int argc, char** argv) {
  CLI::App app{
      "ckpt-dpu-proxy: the host side of a DPU agent's control path (docs/dpu.md). Serves the host's agent socket "
      "(--socket, default /run/ckpt/agent.sock) to trainers as a host agent would, and carries each connection "
      "to the DPU agent's gRPC port (--dpu-address) over mutual TLS (HTTP/2), presenting the host's node "
      "certificate (ckpt://node/<host>, the DPU agent's --host-node) and accepting only a DPU whose "
      "certificate names this host (ckptctl certs create-node --host-node).\n\n"
      "Configuration is layered: a YAML file (--config), then CKPT_* environment variables, then flags. "
      "SIGTERM or SIGINT exits 0 after closing every connection.",
      kProgram};
  app.get_formatter()->column_width(34);
  std::map<std::string, std::string> values;
  std::map<std::string, CLI::Option*> opts;
  auto option = [&](const std::string& flag, const std::string& help, const std::string& type,
                    const std::string& def = "") {
    CLI::Option* o = app.add_option(flag, values[flag], help)->type_name(type);
    if (!def.empty()) o->default_str(def);
    opts[flag] = o;
  };
  option("--dpu-address", "The DPU agent's gRPC address (its --listen on the host-to-DPU link). Required.",
         "HOST:PORT");
  option("--dpu-node", "The DPU's node id (its --node-id); default: any node certificate naming this host.", "ID");
  option("--socket", "The unix socket trainers connect to (the host's <run-dir>/agent.sock); mode 0660.", "PATH",
         kDefaultSocket);
  option("--socket-group",
         "Group (name or gid) given the socket; only processes the kernel reports in it (SO_PEERCRED, "
         "SO_PEERGROUPS), root and the proxy's user are served. Default: the socket's mode (the proxy's group).",
         "GROUP");
  option("--max-connections", "Trainer connections carried at once; more are closed at once (and logged).", "N",
         "256");
  option("--connect-timeout-ms", "TCP connect plus TLS handshake with the DPU agent, per connection.", "MS", "10000");
  option("--tls-ca", "PEM file of the cluster CA (checks the DPU agent's certificate). Required.", "FILE");
  option("--tls-cert", "PEM certificate chain of this host's node (ckpt://node/<host>). Required.", "FILE");
  option("--tls-key", "Its private key. Re-read with the certificate when they change (new connections).", "FILE");
  option("--tls-crl-dir",
         "Directory of the CA's revocation lists (PEM, as `ckptctl certs revoke` writes them): a DPU agent whose "
         "certificate is revoked is refused. Re-read when the directory changes (new connections).",
         "DIR");
  option("--metrics-listen",
         "HTTP address of /metrics (ckpt_dpu_proxy_*), /healthz and /readyz; \"off\" for none.", "HOST:PORT",
         kDefaultMetricsListen);
  option("--log-level", "trace, debug, info, warn, error or off.", "LEVEL", "info");
  option("--log-file", "Append logs to this file instead of stderr.", "FILE");
  std::string config_file;
  app.add_option("--config", config_file, "YAML config file with any of these keys.")->type_name("FILE");
  bool log_json = false;
  CLI::Option* json_opt = app.add_flag("--log-json", log_json, "Write logs as JSON lines.");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? daemon::kExitOk : daemon::kExitUsage;
  }
  std::map<std::string, std::string> flags;
  for (const auto& [flag, o] : opts) {
    if (o->count() > 0) flags[flag] = values[flag];
  }
  if (json_opt->count() > 0) flags["--log-json"] = log_json ? "true" : "false";
  absl::StatusOr<Settings> settings = LoadSettings(config_file, flags);
  if (!settings.ok()) {
    std::fprintf(stderr, "%s: %s\nRun with --help for more information.\n", kProgram,
                 std::string(settings.status().message()).c_str());
    return daemon::kExitUsage;
  }
  sigset_t signals;
  if (int rc = daemon::InitLoggingAndSignals(kProgram, settings->log, &signals); rc != daemon::kExitOk) return rc;
  MetricsRegistry registry;  // outlives the proxy and the metrics server
  settings->proxy.metrics = &registry;
  absl::StatusOr<std::unique_ptr<dpu::DpuProxy>> proxy = dpu::DpuProxy::Start(settings->proxy);
  if (!proxy.ok()) {
    log::Error("{}: {}", kProgram, std::string(proxy.status().message()));
    log::Flush();
    return absl::IsInvalidArgument(proxy.status()) ? daemon::kExitUsage : daemon::kExitFailure;
  }
  std::unique_ptr<MetricsServer> metrics;
  if (!settings->metrics_listen.empty()) {
    absl::StatusOr<std::unique_ptr<MetricsServer>> m = MetricsServer::Start(settings->metrics_listen, &registry);
    if (!m.ok()) {
      log::Error("{}: cannot serve metrics on {}: {}", kProgram, settings->metrics_listen,
                 std::string(m.status().message()));
      (*proxy)->Stop();
      log::Flush();
      return daemon::kExitFailure;
    }
    metrics = *std::move(m);
    log::Info("{}: metrics on http://{}/metrics", kProgram, settings->metrics_listen);
  }
  daemon::StopRequest stop;
  daemon::SignalThread signal_thread(kProgram, "ckpt-proxy-sig", signals, &stop);
  sd::NotifyReady(absl::StrCat("serving unix:", settings->proxy.socket_path, " -> ", settings->proxy.dpu_address));
  stop.Wait();
  log::Info("{} stopping ({})", kProgram, stop.reason());
  sd::NotifyStopping(absl::StrCat("stopping: ", stop.reason()));
  const dpu::DpuProxy::Stats st = (*proxy)->stats();
  (*proxy)->Stop();
  log::Info("{} stopped: {} connections carried, {} refused (socket group), {} refused (full), {} not forwarded "
            "(DPU unreachable or refused)",
            kProgram, st.accepted, st.refused_peer, st.refused_full, st.upstream_failed);
  proxy->reset();
  metrics.reset();
  signal_thread.Stop();
  log::Flush();
  return stop.exit_code();
}

}  // namespace
}  // namespace ckpt

int main(int argc, char** argv) { return ckpt::Run(argc, argv); }
