// ckpt-meta: the metadata service daemon (docs/architecture.md "Processes", "Interfaces").
//
// Flags and layered configuration, wiring (RocksDB store -> MetaCore ->
// gRPC service, plus /metrics), a ticker, and signal handling. No logic: the
// state machine lives in server/meta, the protocol translation in server/rpc.
//
// Threads owned here, each named and joined on the way out:
//   ckpt-meta-sig    sigwait() for SIGTERM/SIGINT (blocked in every thread;
//                    no signal handler runs any code)
//   ckpt-meta-tick   MetaCore::Tick() every 200 ms; a failed store is fatal
//   ckpt-meta-stats  refreshes the Prometheus gauges every second
// plus those of the store (its writer), the core (ckpt-meta-dur, which finishes
// the callback RPCs once durable), gRPC and the metrics HTTP server.
//
// Exit codes: 0 after a clean shutdown, 1 for a runtime failure (cannot bind,
// store failure), 2 for a usage or configuration error.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/file_system.h"
#include "common/grpc_security.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/sd_notify.h"
#include "common/status_macros.h"
#include "server/meta/meta_core.h"
#include "server/meta/model.h"
#include "server/meta/policy.h"
#include "server/meta/store/meta_store.h"
#include "server/meta/store/rocksdb_meta_store.h"
#include "server/rpc/meta_service.h"
#include "server/cmd/daemon.h"
#include "server/cmd/data_plane_key.h"
#include "server/cmd/meta_replica.h"
#include "server/cmd/daemon_tls.h"

namespace ckpt {

namespace {

using daemon::HostOf;
using daemon::PeriodicThread;
using daemon::SignalThread;
using daemon::StopRequest;
using daemon::ValidateHostPort;

using daemon::kExitFailure;
using daemon::kExitOk;
using daemon::kExitUsage;

constexpr char kProgram[] = "ckpt-meta";
constexpr char kDefaultListen[] = "127.0.0.1:7400";
constexpr char kDefaultMetricsListen[] = "127.0.0.1:9400";
constexpr int64_t kDefaultLeaseMs = 5000;
constexpr int64_t kDefaultHeartbeatMs = 1000;
constexpr int64_t kDefaultOpenVersionTimeoutMs = 10 * 60 * 1000;
constexpr int64_t kDefaultLostCopyGraceMs = 30 * 1000;
constexpr int kMaxReceiveMessageBytes = 64 << 20;  // ReportInventory (meta.proto)
constexpr absl::Duration kTickInterval = absl::Milliseconds(200);
constexpr absl::Duration kStatsInterval = absl::Seconds(1);
// The store is probed for a sticky write error every this many ticks (and
// after every failed tick): a failed store means the in-memory state has
// diverged from disk, and only a restart (reload) fixes that.
constexpr int kStoreProbeEveryTicks = 5;
constexpr auto kDrainDeadline = std::chrono::seconds(5);
constexpr auto kDeposedDrainDeadline = std::chrono::seconds(1);

// Config keys this daemon reads (file keys, and flags spelled with '-').
const std::set<std::string>& KnownKeys() {
  static const auto* keys = new std::set<std::string>{
      "listen",       "data_dir",  "metrics_listen", "lease_ms",
      "heartbeat_ms", "log_level", "log_json",       "log_file",
      "default_protection", "open_version_timeout_ms", "lost_copy_grace_ms",
      "tls_ca",       "tls_cert",  "tls_key", "tls_reload_seconds", "tls_crl_dir",
      "admin_token_file", "agent_token_file",
      "trainer_tokens_file", "insecure",
      "replica_of", "replica_lease_ms", "etcd_ca", "etcd_cert", "etcd_key", "etcd_plaintext",
  };
  return *keys;
}

struct Settings {
  std::string listen;
  std::string data_dir;
  std::string metrics_listen;
  absl::Duration lease;
  absl::Duration heartbeat;
  // nullopt: "auto" (meta::AutoProtection).
  std::optional<meta::ProtectionPolicy> default_protection;
  absl::Duration open_version_timeout;
  absl::Duration lost_copy_grace;
  log::Level log_level = log::Level::kInfo;
  bool log_json = false;
  std::string log_file;
  TlsFiles tls;  // checked; the credentials are made once signals are blocked
  bool insecure = false;  // --insecure: plaintext, loopback only, no caller identities
  std::string admin_token;  // empty: admin RPCs open to every caller
  std::string agent_token;  // empty: agent RPCs open to every caller
  std::vector<TrainerToken> trainers;  // empty: job RPCs open to every caller
  // --replica-of: one of several replicas on etcd (meta_replica.h).
  std::optional<daemon::ReplicaSettings> replica;
};

// Reads a PEM file for the etcd client's TLS.
absl::StatusOr<std::string> ReadPem(const std::string& key, const std::string& path) {
  absl::StatusOr<std::string> pem = ReadFileToString(PosixFileSystem(), path);
  if (!pem.ok()) return absl::InvalidArgumentError(absl::StrCat(key, ": ", pem.status().message()));
  return pem;
}

// The replica settings (none without replica_of).
absl::StatusOr<std::optional<daemon::ReplicaSettings>> LoadReplicaSettings(const Config& config,
                                                                           const std::string& listen) {
  const std::string url = config.GetStringOr("replica_of", "");
  for (const char* key : {"replica_lease_ms", "etcd_ca", "etcd_cert", "etcd_key", "etcd_plaintext"}) {
    if (url.empty() && config.Has(key)) {
      return absl::InvalidArgumentError(absl::StrCat(key, " is only for replicas: give replica_of too"));
    }
  }
  if (url.empty()) return std::nullopt;
  if (!daemon::ReplicasSupported()) {
    return absl::InvalidArgumentError(
        "replica_of: this ckpt-meta was built without the etcd client (install golang-etcd-server-dev and "
        "rebuild)");
  }
  CKPT_ASSIGN_OR_RETURN(daemon::ReplicaSettings r, daemon::ParseReplicaOf(url));
  if (listen.substr(listen.rfind(':') + 1) == "0") {
    return absl::InvalidArgumentError(
        "replica_of needs a fixed --listen port: clients are given every replica's address");
  }
  // How the others and `ckptctl status` name this replica: its listen
  // address, with this host's name for a wildcard host.
  r.name = listen;
  if (const std::string host = HostOf(listen); host == "0.0.0.0" || host == "[::]") {
    char name[256] = {};
    if (gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0') {
      r.name = absl::StrCat(name, listen.substr(host.size()));
    }
  }
  CKPT_ASSIGN_OR_RETURN(r.lease, config.GetDurationOr("replica_lease_ms", absl::Seconds(5)));
  if (r.lease < absl::Seconds(1)) {
    return absl::InvalidArgumentError("replica_lease_ms must be at least 1000 (etcd leases are whole seconds)");
  }
  const std::string ca = config.GetStringOr("etcd_ca", ""), cert = config.GetStringOr("etcd_cert", ""),
                    key = config.GetStringOr("etcd_key", "");
  if (cert.empty() != key.empty() || (ca.empty() && !cert.empty())) {
    return absl::InvalidArgumentError("etcd_cert and etcd_key go together, and need etcd_ca");
  }
  if (!ca.empty() && cert.empty()) {
    return absl::InvalidArgumentError(
        "etcd_ca without etcd_cert and etcd_key: etcd must know meta by a client certificate (anyone who can "
        "write the log writes meta's state)");
  }
  if (!ca.empty()) {
    grpc::SslCredentialsOptions ssl;
    CKPT_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPem("etcd_ca", ca));
    if (!cert.empty()) {
      CKPT_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadPem("etcd_cert", cert));
      CKPT_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPem("etcd_key", key));
    }
    r.credentials = grpc::SslCredentials(ssl);
  }
  // The log holds every record and the data-plane key, and whoever can write
  // it writes meta's state: TLS with a client certificate unless the operator
  // says otherwise, and then only on loopback (a test cluster).
  CKPT_ASSIGN_OR_RETURN(const bool plaintext, config.GetBoolOr("etcd_plaintext", false));
  if (plaintext && !ca.empty()) {
    return absl::InvalidArgumentError("etcd_plaintext and etcd_ca exclude each other");
  }
  if (ca.empty() && !plaintext) {
    return absl::InvalidArgumentError(
        "replica_of needs TLS to etcd: give etcd_ca, etcd_cert and etcd_key (etcd started with "
        "--client-cert-auth), or etcd_plaintext for a test cluster on loopback");
  }
  for (const std::string& e : r.endpoints) {
    if (plaintext && !IsLoopbackListen(e)) {
      return absl::InvalidArgumentError(absl::StrCat("etcd_plaintext: etcd member ", e,
                                                     " is not on loopback; give etcd_ca, etcd_cert and etcd_key"));
    }
  }
  return r;
}

// Reads the layered configuration (file, CKPT_* environment, set flags) into
// Settings. Every error is a usage error.
absl::StatusOr<Settings> LoadSettings(const std::string& config_file,
                                      const std::map<std::string, std::string>& flags) {
  absl::StatusOr<Config> config = daemon::LoadDaemonConfig(config_file, flags, KnownKeys());
  if (!config.ok()) return config.status();

  Settings out;
  out.listen = config->GetStringOr("listen", kDefaultListen);
  if (absl::Status s = ValidateHostPort("listen", out.listen); !s.ok()) return s;
  out.metrics_listen = config->GetStringOr("metrics_listen", kDefaultMetricsListen);
  if (absl::Status s = ValidateHostPort("metrics_listen", out.metrics_listen); !s.ok()) return s;
  out.data_dir = config->GetStringOr("data_dir", "");
  if (out.data_dir.empty()) {
    return absl::InvalidArgumentError(
        "the data directory is required: pass --data-dir DIR (or set data_dir in the config "
        "file, or CKPT_DATA_DIR); ckpt-meta keeps its RocksDB store there");
  }
  absl::StatusOr<absl::Duration> lease =
      config->GetDurationOr("lease_ms", absl::Milliseconds(kDefaultLeaseMs));
  if (!lease.ok()) return lease.status();
  absl::StatusOr<absl::Duration> heartbeat =
      config->GetDurationOr("heartbeat_ms", absl::Milliseconds(kDefaultHeartbeatMs));
  if (!heartbeat.ok()) return heartbeat.status();
  if (*lease < absl::Milliseconds(1) || *heartbeat < absl::Milliseconds(1)) {
    return absl::InvalidArgumentError("lease_ms and heartbeat_ms must be at least 1 ms");
  }
  if (*heartbeat >= *lease) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heartbeat_ms (", absl::ToInt64Milliseconds(*heartbeat), ") must be less than lease_ms (",
        absl::ToInt64Milliseconds(*lease),
        "), or every node would be declared dead between two heartbeats; the defaults are "
        "1000 and 5000"));
  }
  out.lease = *lease;
  out.heartbeat = *heartbeat;
  const std::string protection = config->GetStringOr("default_protection", "auto");
  if (protection != "auto") {
    absl::StatusOr<meta::ProtectionPolicy> p = meta::ParseProtectionPolicy(protection);
    if (!p.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("default_protection: ", p.status().message(), ", or auto"));
    }
    out.default_protection = *p;
  }
  absl::StatusOr<absl::Duration> open_timeout = config->GetDurationOr(
      "open_version_timeout_ms", absl::Milliseconds(kDefaultOpenVersionTimeoutMs));
  if (!open_timeout.ok()) return open_timeout.status();
  if (*open_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("open_version_timeout_ms must not be negative (0: never)");
  }
  out.open_version_timeout = *open_timeout;
  absl::StatusOr<absl::Duration> grace = config->GetDurationOr(
      "lost_copy_grace_ms", absl::Milliseconds(kDefaultLostCopyGraceMs));
  if (!grace.ok()) return grace.status();
  if (*grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "lost_copy_grace_ms must not be negative (0: a version whose last copy was on a dead "
        "node is aborted at once)");
  }
  out.lost_copy_grace = *grace;
  absl::StatusOr<log::Level> level = log::ParseLevel(config->GetStringOr("log_level", "info"));
  if (!level.ok()) return level.status();
  out.log_level = *level;
  absl::StatusOr<bool> json = config->GetBoolOr("log_json", false);
  if (!json.ok()) return json.status();
  out.log_json = *json;
  out.log_file = config->GetStringOr("log_file", "");
  CKPT_ASSIGN_OR_RETURN(out.tls, daemon::TlsSettings(*config));
  CKPT_RETURN_IF_ERROR(CheckTlsFiles(out.tls, /*server=*/true));
  CKPT_ASSIGN_OR_RETURN(out.insecure,
                        daemon::InsecureSetting(*config, out.tls, {{"--listen", out.listen}}));
  if (!out.insecure) CKPT_RETURN_IF_ERROR(daemon::CheckOwnIdentity(out.tls, pki::Identity{pki::Role::kMeta, "", {}}));
  CKPT_ASSIGN_OR_RETURN(out.replica, LoadReplicaSettings(*config, out.listen));
  CKPT_ASSIGN_OR_RETURN(out.admin_token, daemon::TokenSetting(*config, "admin_token_file"));
  CKPT_ASSIGN_OR_RETURN(out.agent_token, daemon::TokenSetting(*config, "agent_token_file"));
  if (const std::string f = config->GetStringOr("trainer_tokens_file", ""); !f.empty()) {
    absl::StatusOr<std::vector<TrainerToken>> t = ReadTrainerTokensFile(f);
    if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat("trainer_tokens_file: ", t.status().message()));
    out.trainers = *std::move(t);
    if (out.admin_token.empty() || out.agent_token.empty()) {
      return absl::InvalidArgumentError(
          "trainer_tokens_file needs admin_token_file and agent_token_file too: with trainer tokens every job "
          "call needs a token, and the operators' tools and the agents send those two");
    }
  }
  return out;
}

// The daemon's Prometheus metrics, refreshed from the core and the store.
class MetaMetrics {
 public:
  MetaMetrics(MetricsRegistry* r, bool replica) : r_(r) {
    if (replica) {
      leader_ = &r->AddGauge("ckpt_meta_replica_leader", "1 while this replica leads, 0 while it follows");
      applied_index_ = &r->AddGauge("ckpt_meta_replica_applied_index",
                                    "Index of the last log entry this replica wrote (leader) or applied (follower)");
      entries_ = &r->AddCounter("ckpt_meta_replica_log_entries_total", "Log entries this replica appended to etcd");
      groups_ = &r->AddCounter("ckpt_meta_replica_log_groups_total",
                               "Store batch groups this replica replicated through etcd");
      append_seconds_ = &r->AddCounter("ckpt_meta_replica_append_seconds_total",
                                       "Time spent appending to the log in etcd (per group: divide by groups)");
    }
    for (meta::NodeState s : {meta::NodeState::kAlive, meta::NodeState::kSuspect,
                              meta::NodeState::kDead, meta::NodeState::kDraining,
                              meta::NodeState::kLeft}) {
      nodes_[s] = &r->AddGauge("ckpt_meta_nodes", "Nodes known to ckpt-meta, by membership state",
                               {{"state", Lower(meta::NodeStateName(s))}});
    }
    for (meta::VersionState s :
         {meta::VersionState::kOpen, meta::VersionState::kStaged, meta::VersionState::kProtected,
          meta::VersionState::kPersisted, meta::VersionState::kDegraded,
          meta::VersionState::kAborted, meta::VersionState::kDeleted}) {
      versions_[s] = &r->AddGauge("ckpt_meta_versions", "Checkpoint versions, by state",
                                  {{"state", Lower(meta::VersionStateName(s))}});
    }
    const char* tasks_help = "Tasks not finished: pending, running or waiting for a retry";
    tasks_pending_ = &r->AddGauge("ckpt_meta_tasks", tasks_help, {{"state", "pending"}});
    tasks_running_ = &r->AddGauge("ckpt_meta_tasks", tasks_help, {{"state", "running"}});
    tasks_retrying_ = &r->AddGauge("ckpt_meta_tasks", tasks_help, {{"state", "retrying"}});
    jobs_ = &r->AddGauge("ckpt_meta_jobs", "Jobs known to ckpt-meta");
    problems_ = &r->AddGauge("ckpt_meta_problems", "Problems listed by ClusterStatus");
    memory_capacity_ = &r->AddGauge("ckpt_meta_memory_capacity_bytes",
                                    "Memory-tier capacity of ALIVE and DRAINING nodes");
    memory_used_ = &r->AddGauge("ckpt_meta_memory_used_bytes",
                                "Memory-tier bytes in use on ALIVE and DRAINING nodes");
    memory_free_ = &r->AddGauge("ckpt_meta_memory_free_bytes",
                                "Memory-tier bytes free on ALIVE and DRAINING nodes");
    flush_lag_bytes_ = &r->AddGauge("ckpt_meta_flush_lag_bytes", "Bytes awaiting flush");
    flush_lag_seconds_ = &r->AddGauge("ckpt_meta_flush_lag_seconds",
                                      "Age of the oldest shard awaiting flush");
    start_time_ = &r->AddGauge("ckpt_meta_start_time_seconds",
                               "When this ckpt-meta process started (Unix time)");
    queued_bytes_ = &r->AddGauge("ckpt_meta_store_queued_bytes",
                                 "Bytes of store batches submitted but not yet durable");
    AddCounter("ckpt_meta_reports_total", "Shard reports received",
               [](const Sample& s) { return s.core.reports_total; });
    AddCounter("ckpt_meta_reports_rejected_total", "Shard reports rejected",
               [](const Sample& s) { return s.core.reports_rejected_total; });
    AddCounter("ckpt_meta_versions_begun_total", "Versions begun",
               [](const Sample& s) { return s.core.versions_begun_total; });
    AddCounter("ckpt_meta_nodes_declared_dead_total", "Nodes declared dead (lease expired)",
               [](const Sample& s) { return s.core.nodes_declared_dead_total; });
    AddCounter("ckpt_meta_tasks_created_total", "Tasks created",
               [](const Sample& s) { return s.core.tasks_created_total; });
    AddCounter("ckpt_meta_tasks_failed_total", "Tasks given up on",
               [](const Sample& s) { return s.core.tasks_failed_total; });
    AddCounter("ckpt_meta_store_fsyncs_total", "Synchronous store writes (write groups)",
               [](const Sample& s) { return s.store.fsyncs; });
    AddCounter("ckpt_meta_store_batches_written_total",
               "Store batches made durable (batches / fsyncs = group-commit factor)",
               [](const Sample& s) { return s.store.batches_written; });
    AddCounter("ckpt_meta_store_bytes_written_total", "Payload bytes written to the store",
               [](const Sample& s) { return s.store.bytes_written; });
    AddCounter("ckpt_meta_store_submit_waits_total",
               "Store submits that waited for queue space (backpressure)",
               [](const Sample& s) { return s.store.submit_waits; });
  }

  void RefreshReplica(daemon::MetaReplica* replica) {
    leader_->Set(replica->leading() ? 1 : 0);
    applied_index_->Set(static_cast<double>(replica->applied_index()));
    Advance(entries_, &last_entries_, static_cast<double>(replica->entries_appended()));
    Advance(groups_, &last_groups_, static_cast<double>(replica->groups_appended()));
    Advance(append_seconds_, &last_append_seconds_, replica->append_seconds());
  }

  void Refresh(meta::MetaCore* core, meta::MetaStore* store) {
    absl::StatusOr<meta::ClusterStatusView> answer =
        core->ClusterStatus(/*include_nodes=*/false, /*max_problems=*/1);
    if (!answer.ok()) return;  // the store failed: the daemon is exiting
    const meta::ClusterStatusView& status = *answer;
    for (auto& [state, gauge] : nodes_) {
      auto it = status.nodes_by_state.find(state);
      gauge->Set(it == status.nodes_by_state.end() ? 0 : it->second);
    }
    for (auto& [state, gauge] : versions_) {
      auto it = status.versions_by_state.find(state);
      gauge->Set(it == status.versions_by_state.end() ? 0 : static_cast<double>(it->second));
    }
    tasks_pending_->Set(status.tasks_pending);
    tasks_running_->Set(status.tasks_running);
    tasks_retrying_->Set(status.tasks_retrying);
    jobs_->Set(status.jobs);
    problems_->Set(status.problems_total);
    memory_capacity_->Set(static_cast<double>(status.memory_capacity_bytes));
    memory_used_->Set(static_cast<double>(status.memory_used_bytes));
    memory_free_->Set(static_cast<double>(status.memory_free_bytes));
    flush_lag_bytes_->Set(static_cast<double>(status.flush_lag_bytes));
    flush_lag_seconds_->Set(static_cast<double>(status.flush_lag_ms) / 1000.0);
    start_time_->Set(static_cast<double>(status.meta_start_ms) / 1000.0);

    const Sample sample{core->counters(), store->stats()};
    queued_bytes_->Set(static_cast<double>(sample.store.queued_bytes));
    for (MonotonicCounter& c : counters_) {
      const uint64_t value = c.read(sample);
      if (value > c.last) c.counter->Increment(static_cast<double>(value - c.last));
      c.last = value;
    }
  }

 private:
  struct Sample {
    meta::MetaCounters core;
    meta::StoreStats store;
  };
  // A Prometheus counter following a monotonic value read from a sample.
  struct MonotonicCounter {
    Counter* counter;
    std::function<uint64_t(const Sample&)> read;
    uint64_t last = 0;
  };

  static void Advance(Counter* c, double* last, double now) {
    if (now > *last) c->Increment(now - *last);
    *last = now;
  }

  static std::string Lower(std::string_view s) {
    return absl::AsciiStrToLower(absl::string_view(s.data(), s.size()));
  }

  void AddCounter(const char* name, const char* help,
                  std::function<uint64_t(const Sample&)> read) {
    counters_.push_back({&r_->AddCounter(name, help), std::move(read)});
  }

  MetricsRegistry* const r_;
  std::map<meta::NodeState, Gauge*> nodes_;
  std::map<meta::VersionState, Gauge*> versions_;
  Gauge* tasks_pending_;
  Gauge* tasks_running_;
  Gauge* tasks_retrying_;
  Gauge* jobs_;
  Gauge* problems_;
  Gauge* memory_capacity_;
  Gauge* memory_used_;
  Gauge* memory_free_;
  Gauge* flush_lag_bytes_;
  Gauge* flush_lag_seconds_;
  Gauge* start_time_;
  Gauge* queued_bytes_;
  std::vector<MonotonicCounter> counters_;
  Gauge* leader_ = nullptr;  // the replica's, when --replica-of
  Gauge* applied_index_ = nullptr;
  Counter* entries_ = nullptr;
  Counter* groups_ = nullptr;
  Counter* append_seconds_ = nullptr;
  double last_entries_ = 0, last_groups_ = 0, last_append_seconds_ = 0;
};

// Everything after the settings are known. Returns the exit code.
int Serve(const Settings& settings, const sigset_t& signals) {
  StopRequest stop;
  SignalThread signal_thread(kProgram, "ckpt-meta-sig", signals, &stop);

  log::Info("{} starting: data dir {}, lease {} ms, heartbeat {} ms", kProgram, settings.data_dir,
            absl::ToInt64Milliseconds(settings.lease),
            absl::ToInt64Milliseconds(settings.heartbeat));

  absl::StatusOr<std::unique_ptr<meta::MetaStore>> store =
      meta::OpenRocksDbMetaStore(settings.data_dir);
  if (!store.ok()) {
    log::Error("{}: cannot open the metadata store: {}", kProgram, store.status().ToString());
    return kExitFailure;
  }

  // A replica follows the log on etcd until it leads (meta_replica.h).
  std::unique_ptr<daemon::MetaReplica> replica;
  if (settings.replica.has_value()) {
    absl::StatusOr<std::unique_ptr<daemon::MetaReplica>> r = daemon::MetaReplica::Start(*settings.replica, store->get());
    if (!r.ok()) {
      log::Error("{}: cannot join the replicas on etcd: {}", kProgram, r.status().ToString());
      return kExitFailure;
    }
    replica = std::move(*r);
  }

  MetricsRegistry registry;
  MetaMetrics metrics(&registry, replica != nullptr);
  std::atomic<bool> ready{false};
  std::atomic<bool> stopping{false};
  absl::StatusOr<std::unique_ptr<MetricsServer>> metrics_server = MetricsServer::Start(
      settings.metrics_listen, &registry, [&](std::string* reason) {
        if (ready.load()) return true;
        *reason = stopping.load()                           ? "shutting down"
                  : replica != nullptr && !replica->leading() ? replica->Role()
                                                              : "starting";
        return false;
      });
  if (!metrics_server.ok()) {
    log::Error("{}: cannot serve metrics on {}: {}", kProgram, settings.metrics_listen,
               metrics_server.status().ToString());
    return kExitFailure;
  }
  std::atomic<meta::MetaCore*> live_core{nullptr};
  std::atomic<meta::MetaStore*> live_store{nullptr};
  PeriodicThread stats("ckpt-meta-stats", kStatsInterval, [&] {
    if (replica != nullptr) {
      metrics.RefreshReplica(replica.get());
      replica->Publish();
    }
    if (meta::MetaCore* c = live_core.load(); c != nullptr) metrics.Refresh(c, live_store.load());
  });

  if (replica != nullptr) {
    const absl::Status led = replica->Lead(&stop);
    if (!led.ok()) {
      const int code = absl::IsCancelled(led) ? stop.exit_code() : kExitFailure;
      if (!absl::IsCancelled(led)) log::Error("{}: replica: {}", kProgram, led.ToString());
      stats.Stop();
      metrics_server->reset();
      replica.reset();
      store->reset();
      signal_thread.Stop();
      log::Info("{} stopped", kProgram);
      log::Flush();
      return code;
    }
  }
  meta::MetaStore* const s = replica != nullptr ? replica->store() : store->get();

  meta::MetaOptions options;
  options.lease = settings.lease;
  options.heartbeat_interval = settings.heartbeat;
  options.default_protection = settings.default_protection;
  options.open_version_timeout = settings.open_version_timeout;
  options.lost_copy_grace = settings.lost_copy_grace;
  // Served over TLS, meta hands every agent that registers (authenticated by
  // its certificate) the cluster's data-plane key, which the agents prove to
  // each other in the UCX handshake (data_plane_key.h). An --insecure meta
  // hands out none: its agents use their agent token, if any. Replicas keep
  // it in the replicated store, so that every leader hands out the same one.
  if (settings.tls.enabled()) {
    absl::StatusOr<std::string> key;
    std::string where;
    if (replica != nullptr) {
      key = daemon::LoadOrCreateReplicatedDataPlaneKey(s);
      where = "the replicated store";
    } else {
      where = absl::StrCat(settings.data_dir, "/", daemon::kDataPlaneKeyFile);
      key = daemon::LoadOrCreateDataPlaneKey(where);
    }
    if (!key.ok()) {
      log::Error("{}: {}", kProgram, key.status().ToString());
      return kExitFailure;
    }
    options.data_plane_key = *std::move(key);
    log::Info("{}: data-plane key in {}; registered agents get it", kProgram, where);
  }
  absl::StatusOr<std::unique_ptr<meta::MetaCore>> core =
      meta::MetaCore::Open(s, RealClock(), options);
  if (!core.ok()) {
    log::Error("{}: cannot load the metadata from {}: {}", kProgram, settings.data_dir,
               core.status().ToString());
    return kExitFailure;
  }
  meta::MetaCore* const c = core->get();

  // Ticker: time-driven state (leases, task time-outs, flush schedule), and
  // the fatal-store check.
  int ticks = 0;
  PeriodicThread ticker("ckpt-meta-tick", kTickInterval, [&] {
    const absl::Status tick = c->Tick();
    if (!tick.ok()) log::Error("{}: tick failed: {}", kProgram, tick.ToString());
    if (!tick.ok() || ++ticks % kStoreProbeEveryTicks == 0) {
      // An empty batch costs no I/O; it fails iff an earlier write failed.
      const absl::Status store_ok = s->AwaitDurable(s->Submit(meta::WriteBatch()));
      if (!store_ok.ok()) {
        log::Error("{}: the metadata store failed ({}); exiting so that the service restarts "
                   "and reloads its state",
                   kProgram, store_ok.ToString());
        stop.Request(kExitFailure, "metadata store failure");
      }
    }
  });
  // A leader whose etcd lease is gone cannot write (its appends are fenced)
  // and another replica is taking over: stop serving at once.
  std::thread lease_watch;
  if (replica != nullptr) {
    lease_watch = std::thread([&] {
      pthread_setname_np(pthread_self(), "ckpt-meta-lease");
      while (!stop.requested()) {
        const absl::Status lost = replica->WaitLost(absl::Milliseconds(200));
        if (!lost.ok()) {
          log::Error("{}: lost the leadership ({}); exiting, to come back as a follower", kProgram, lost.ToString());
          stop.Request(kExitFailure, "lost the leadership");
          return;
        }
      }
    });
  }

  metrics.Refresh(c, s);
  live_store.store(s);
  live_core.store(c);

  // Every caller on TCP shows a certificate with a ckpt identity unless
  // --insecure (loopback only): server/rpc/authorize.h.
  rpc::MetaServiceImpl service(c, RealClock(),
                               CallerTokens{settings.admin_token, settings.agent_token, settings.trainers},
                               /*require_identity=*/!settings.insecure);
  if (replica != nullptr) {
    service.set_replicas_source([r = replica.get()] {
      std::vector<rpc::MetaServiceImpl::ReplicaInfo> out;
      absl::StatusOr<std::vector<daemon::MetaReplica::View>> views = r->Replicas();
      if (!views.ok()) return out;  // etcd unreachable: the rest of the status still answers
      for (const daemon::MetaReplica::View& v : *views) out.push_back({v.name, v.leader, v.applied_index});
      return out;
    });
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = ServerCredentials(settings.tls);
  if (settings.insecure) {
    log::Warn("{}: --insecure: serving plaintext on {} with no caller authentication (loopback only)", kProgram,
              settings.listen);
  }
  std::unique_ptr<grpc::Server> server;
  if (!credentials.ok()) {  // (the files were checked at start; changed since?)
    log::Error("{}: {}", kProgram, credentials.status().ToString());
    stop.Request(kExitFailure, "TLS files unreadable");
  } else {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(settings.listen, *credentials, &port);
    builder.SetMaxReceiveMessageSize(kMaxReceiveMessageBytes);
    // gRPC sets SO_REUSEPORT by default, which would let a second ckpt-meta
    // bind the same port and silently share the traffic: refuse instead.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    // Callers given several replicas ping every 2 s to notice a leader that
    // stopped answering (SetFailoverArgs): allow it.
    SetFailoverServerArgs(&builder);
    // Heartbeat and ReportShards are callback reactors finished by the core's
    // durability thread, so many reports share each fsync without parking a
    // thread each. The other RPCs are synchronous and may block on the group
    // commit; gRPC adds threads for them as they block.
    builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 2);
    builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 4);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    if (server == nullptr || port == 0) {
      log::Error("{}: cannot listen on {} (address in use, or not an address of this host?)",
                 kProgram, settings.listen);
      stop.Request(kExitFailure, "gRPC server failed to start");
    } else {
      log::Info("{} listening on {}:{}", kProgram, HostOf(settings.listen), port);
      ready.store(true);
      // systemd Type=notify: ready once the store is loaded and gRPC serves.
      sd::NotifyReady(absl::StrCat("serving on ", settings.listen));
    }
  }

  stop.Wait();
  const int exit_code = stop.exit_code();
  log::Info("{} stopping ({})", kProgram, stop.reason());
  sd::NotifyStopping(absl::StrCat("stopping: ", stop.reason()));
  ready.store(false);
  stopping.store(true);
  service.Shutdown();  // streams and waits end with UNAVAILABLE within ~1 s
  if (server != nullptr) {
    // A deposed leader has nothing to finish (its writes are fenced) and a
    // replica is taking over: callers are sent on at once.
    const bool deposed = replica != nullptr && replica->leading() && !replica->WaitLost(absl::ZeroDuration()).ok();
    server->Shutdown(std::chrono::system_clock::now() + (deposed ? kDeposedDrainDeadline : kDrainDeadline));
    server->Wait();
    server.reset();
  }
  ticker.Stop();
  stats.Stop();
  if (lease_watch.joinable()) lease_watch.join();
  metrics_server->reset();
  core->reset();    // no more state changes
  replica.reset();  // replicates what is queued, resigns: the next replica leads at once
  store->reset();   // writes what is queued, fsyncs, closes RocksDB
  signal_thread.Stop();
  log::Info("{} stopped", kProgram);
  log::Flush();
  return exit_code;
}

int Main(int argc, char** argv) {
  CLI::App app{
      "ckpt-meta: the ckpt metadata service. Keeps node membership and leases, jobs, "
      "checkpoint versions and their states, placement plans, and the tasks agents run, in a "
      "RocksDB store under --data-dir; serves the ckpt.v1.MetaService gRPC API on --listen and "
      "Prometheus /metrics, /healthz and /readyz on --metrics-listen.\n\n"
      "Configuration is layered: a YAML file (--config), then CKPT_* environment variables "
      "(CKPT_DATA_DIR, CKPT_LEASE_MS, ...), then the flags given here, later ones winning. File "
      "keys are the flag names with '_' for '-' (data_dir, lease_ms, ...).\n\n"
      "SIGTERM or SIGINT drains in-flight calls (up to 5 s) and exits 0; a second signal exits "
      "at once. Exit codes: 0 clean shutdown, 1 runtime failure, 2 usage or configuration error.",
      kProgram};
  app.get_formatter()->column_width(34);

  std::string listen, data_dir, metrics_listen, config_file, lease_ms, heartbeat_ms, log_level,
      log_file, default_protection, open_version_timeout_ms, lost_copy_grace_ms, admin_token_file, agent_token_file,
      trainer_tokens_file, replica_of, replica_lease_ms, etcd_ca, etcd_cert, etcd_key;
  bool etcd_plaintext = false;
  daemon::TlsFlags tls_flags;
  bool log_json = false;
  CLI::Option* listen_opt =
      app.add_option("--listen", listen,
                     "host:port for the gRPC MetaService (agents, clients and ckptctl connect "
                     "here). Port 0 picks a free port; the bound address is logged as "
                     "'ckpt-meta listening on HOST:PORT'.")
          ->type_name("HOST:PORT")
          ->default_str(kDefaultListen);
  CLI::Option* data_dir_opt =
      app.add_option("--data-dir", data_dir,
                     "Directory of the RocksDB metadata store (created if missing). Required. "
                     "Every acknowledged change is fsynced here before the answer is sent.")
          ->type_name("DIR");
  CLI::Option* metrics_opt =
      app.add_option("--metrics-listen", metrics_listen,
                     "host:port of the HTTP endpoint serving Prometheus /metrics, /healthz "
                     "(process up) and /readyz (store loaded and gRPC serving). Port 0 picks a "
                     "free port.")
          ->type_name("HOST:PORT")
          ->default_str(kDefaultMetricsListen);
  app.add_option("--config", config_file,
                 "YAML config file with any of the keys below (flat or nested, e.g. "
                 "'lease_ms: 5000'). Unknown keys are an error.")
      ->type_name("FILE");
  CLI::Option* lease_opt =
      app.add_option("--lease-ms", lease_ms,
                     "Agent lease: a node that sends no heartbeat for this long is declared DEAD "
                     "and its data is re-protected. Milliseconds, or a duration such as 5s.")
          ->type_name("MS")
          ->default_str(std::to_string(kDefaultLeaseMs));
  CLI::Option* heartbeat_opt =
      app.add_option("--heartbeat-ms", heartbeat_ms,
                     "Heartbeat interval told to agents; a node that misses two is SUSPECT. Must "
                     "be less than --lease-ms.")
          ->type_name("MS")
          ->default_str(std::to_string(kDefaultHeartbeatMs));
  CLI::Option* default_protection_opt =
      app.add_option("--default-protection", default_protection,
                     "Protection of a job created without one (ckptctl create-job with no "
                     "protection flag, clients that state none): none, "
                     "replicate:COPIES[:ring|group], ec:K+M, or auto = replicate:2 when at least "
                     "two nodes are alive when the job is created, none on a single node.")
          ->type_name("POLICY")
          ->default_str("auto");
  CLI::Option* open_timeout_opt =
      app.add_option("--open-version-timeout-ms", open_version_timeout_ms,
                     "An OPEN version no rank has staged a shard of for this long is ABORTED "
                     "(reason shown by ckptctl versions) and its shards are freed. 0: never.")
          ->type_name("MS")
          ->default_str(std::to_string(kDefaultOpenVersionTimeoutMs));
  CLI::Option* grace_opt =
      app.add_option("--lost-copy-grace-ms", lost_copy_grace_ms,
                     "A version whose last copy of a shard was on a node that died is kept this "
                     "long for the node to come back with its memory tier (an agent restart "
                     "re-adopts it) before it is ABORTED as data lost. 0: at once.")
          ->type_name("MS")
          ->default_str(std::to_string(kDefaultLostCopyGraceMs));
  CLI::Option* log_level_opt =
      app.add_option("--log-level", log_level,
                     "Log level: trace, debug, info, warn, error or off. Successful RPCs are "
                     "logged at debug at most.")
          ->type_name("LEVEL")
          ->default_str("info");
  CLI::Option* log_json_opt =
      app.add_flag("--log-json", log_json,
                   "Write logs as JSON lines (ts, level, logger, thread, msg) instead of text.");
  CLI::Option* log_file_opt =
      app.add_option("--log-file", log_file, "Append logs to this file instead of stderr.")
          ->type_name("FILE");

  daemon::AddTlsFlags(app, &tls_flags, /*server=*/true);
  CLI::Option* admin_token_opt =
      app.add_option("--admin-token-file", admin_token_file,
                     "File holding the admin token (mode 0600 or 0640). With it, DeleteVersion, "
                     "DeleteJob, DrainNode, UndrainNode and RemoveNode need 'authorization: Bearer TOKEN' "
                     "(ckptctl --token-file); without it they are open to every caller.")
          ->type_name("FILE");
  CLI::Option* agent_token_opt =
      app.add_option("--agent-token-file", agent_token_file,
                     "File holding the agents' token. With it, the RPCs only agents make "
                     "(RegisterNode, Heartbeat, WatchTasks, ReportTaskResult, ReportInventory, "
                     "ReportShards, BeginVersion) need it (ckpt-agent --token-file) or the admin token.")
          ->type_name("FILE");
  CLI::Option* trainer_tokens_opt =
      app.add_option("--trainer-tokens-file", trainer_tokens_file,
                     "File of trainer identities, a line 'TOKEN JOB[,JOB...]' each (a job is an id, a prefix "
                     "ending in '*', or '*'); mode 0600 or 0640. With it, every job call (CreateJob, Latest, "
                     "Locate, WaitVersion, ...) needs a trainer token for that job, the admin token or the "
                     "agent token, and listings show a trainer only its jobs. Needs --admin-token-file and "
                     "--agent-token-file.")
          ->type_name("FILE");

  CLI::Option* replica_of_opt =
      app.add_option("--replica-of", replica_of,
                     "Run as one of several replicas of this meta (3 is usual), sharing a log on etcd: "
                     "etcd://HOST:PORT[,HOST:PORT...]/PREFIX. One replica leads and serves; the others follow the "
                     "log in their own --data-dir, keep --listen closed, and take over when the leader's etcd lease "
                     "ends. Give clients and agents every replica's address (--meta A,B,C). Without it: one meta, "
                     "no etcd.")
          ->type_name("URL");
  CLI::Option* replica_lease_opt =
      app.add_option("--replica-lease-ms", replica_lease_ms,
                     "The leader's etcd lease: a leader that dies or is cut from etcd is replaced this long after "
                     "(whole seconds, at least 1000; etcd raises it to its own minimum).")
          ->type_name("MS")
          ->default_str("5000");
  CLI::Option* etcd_ca_opt = app.add_option("--etcd-ca", etcd_ca,
                                            "CA certificate (PEM) of etcd's members: talk to etcd over TLS, "
                                            "with --etcd-cert and --etcd-key. Required with --replica-of unless "
                                            "--etcd-plaintext.")
                                 ->type_name("FILE");
  CLI::Option* etcd_cert_opt =
      app.add_option("--etcd-cert", etcd_cert, "Client certificate (PEM) meta shows etcd, with --etcd-key.")
          ->type_name("FILE");
  CLI::Option* etcd_key_opt =
      app.add_option("--etcd-key", etcd_key, "Private key (PEM) of --etcd-cert.")->type_name("FILE");
  CLI::Option* etcd_plaintext_opt = app.add_flag(
      "--etcd-plaintext", etcd_plaintext,
      "Talk to etcd without TLS: only for a test cluster whose etcd members are all on loopback (anyone who can "
      "write etcd's log writes meta's state).");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints help, or the error and a hint
    return code == 0 ? kExitOk : kExitUsage;
  }

  // Only flags the user set reach the config, so defaults never override the
  // file or the environment.
  std::map<std::string, std::string> flags;
  auto set = [&](CLI::Option* opt, const char* flag, const std::string& value) {
    if (opt->count() > 0) flags[flag] = value;
  };
  set(listen_opt, "--listen", listen);
  set(data_dir_opt, "--data-dir", data_dir);
  set(metrics_opt, "--metrics-listen", metrics_listen);
  set(lease_opt, "--lease-ms", lease_ms);
  set(heartbeat_opt, "--heartbeat-ms", heartbeat_ms);
  set(default_protection_opt, "--default-protection", default_protection);
  set(open_timeout_opt, "--open-version-timeout-ms", open_version_timeout_ms);
  set(grace_opt, "--lost-copy-grace-ms", lost_copy_grace_ms);
  set(log_level_opt, "--log-level", log_level);
  set(log_json_opt, "--log-json", log_json ? "true" : "false");
  set(log_file_opt, "--log-file", log_file);
  set(admin_token_opt, "--admin-token-file", admin_token_file);
  set(agent_token_opt, "--agent-token-file", agent_token_file);
  set(trainer_tokens_opt, "--trainer-tokens-file", trainer_tokens_file);
  set(replica_of_opt, "--replica-of", replica_of);
  set(replica_lease_opt, "--replica-lease-ms", replica_lease_ms);
  set(etcd_ca_opt, "--etcd-ca", etcd_ca);
  set(etcd_cert_opt, "--etcd-cert", etcd_cert);
  set(etcd_key_opt, "--etcd-key", etcd_key);
  set(etcd_plaintext_opt, "--etcd-plaintext", etcd_plaintext ? "true" : "false");
  daemon::SetTlsFlags(tls_flags, &flags);

  absl::StatusOr<Settings> settings = LoadSettings(config_file, flags);
  if (!settings.ok()) {
    std::fprintf(stderr, "%s: %s\nRun with --help for more information.\n", kProgram,
                 std::string(settings.status().message()).c_str());
    return kExitUsage;
  }

  log::Options log_options;
  log_options.level = settings->log_level;
  log_options.json = settings->log_json;
  log_options.file = settings->log_file;
  log_options.name = kProgram;
  sigset_t signals;
  if (int rc = daemon::InitLoggingAndSignals(kProgram, log_options, &signals); rc != kExitOk) return rc;
  return Serve(*settings, signals);
}

}  // namespace
}  // namespace ckpt

int main(int argc, char** argv) {
  // Keep assert() on in release builds, but not Abseil's mutex deadlock
  // detector, which costs a graph update on every lock in the hot path.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return ckpt::Main(argc, argv);
}
