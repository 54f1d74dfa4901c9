// ckptctl: the admin CLI of ckpt. Talks gRPC to ckpt-meta (MetaService) only;
// `restore` reads a durable-tier version directory with no daemon at all.
//
// Exit codes: 0 ok; 1 failure (the server's code and message, or a local
// error, on stderr as "ckptctl: CODE: message"); 2 usage error.
// Output: aligned tables for people, or with --json one JSON document per
// command (field names in docs/cli.md).
#include <grpcpp/grpcpp.h>

#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <csignal>
#include <functional>
#include <sstream>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "ckpt/v1/meta.grpc.pb.h"
#include "cli/cert_commands.h"
#include "cli/data_commands.h"
#include "cli/progress.h"
#include "common/config.h"
#include "common/durable_format.h"
#include "common/grpc_security.h"
#include "common/names.h"
#include "common/file_system.h"

namespace ckpt::cli {
namespace {

using Json = nlohmann::ordered_json;

constexpr char kProgram[] = "ckptctl";
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr char kDefaultMeta[] = "127.0.0.1:7400";
constexpr char kDefaultMetaPort[] = "7400";

// Set once --json is parsed: errors then go to stderr as one JSON object,
// {"error": {"code": "NOT_FOUND", "message": "..."}}, instead of a line.
bool g_json_errors = false;

// An error on stderr: "ckptctl: CODE: message", or with --json the object
// above (code "USAGE" for usage errors, exit 2).
void PrintError(bool json, const std::string& code, const std::string& message) {
  if (json) {
    std::fprintf(stderr, "%s\n",
                 nlohmann::ordered_json{{"error", {{"code", code}, {"message", message}}}}.dump().c_str());
  } else {
    std::fprintf(stderr, "%s: %s: %s\n", kProgram, code.c_str(), message.c_str());
  }
}

// A usage error (exit 2): "ckptctl: message", or the JSON object above.
int UsageError(const std::string& message) {
  if (g_json_errors) {
    PrintError(true, "USAGE", message);
  } else {
    std::fprintf(stderr, "%s: %s\n", kProgram, message.c_str());
  }
  return 2;
}

// restore --world-size W [--split NAME=DIM ...]: checked and parsed into
// `splits`; 0, or UsageError's exit status.
int ParseReshard(uint32_t world_size, const std::vector<std::string>& split_args,
                 std::map<std::string, uint32_t>* splits) {
  if (world_size == 0 || world_size > kMaxWorldSize) {
    return UsageError(absl::StrCat("restore: --world-size ", world_size, " is invalid: it must be 1..",
                                   kMaxWorldSize, " (one rank file is written per rank)"));
  }
  for (const std::string& s : split_args) {
    const size_t eq = s.rfind('=');
    uint32_t dim = 0;
    if (eq == std::string::npos || eq == 0 || !absl::SimpleAtoi(s.substr(eq + 1), &dim)) {
      return UsageError(absl::StrCat("restore: --split wants NAME=DIM, got '", s, "'"));
    }
    (*splits)[s.substr(0, eq)] = dim;
  }
  return 0;
}

// --meta HOST (no port) means HOST:7400, as ckpt-meta's default --listen.
// "[::1]" gets the port too; a bare IPv6 address ("::1") is refused by gRPC
// as before, since its last group reads as a port.
std::string WithDefaultPort(const std::string& meta) {
  if (meta.empty() || meta.rfind("unix:", 0) == 0 || meta.rfind("dns:", 0) == 0 || meta.rfind("ipv", 0) == 0) {
    return meta;
  }
  if (meta.front() == '[') return meta.back() == ']' ? meta + ":" + kDefaultMetaPort : meta;
  if (meta.find(':') == std::string::npos) return meta + ":" + kDefaultMetaPort;
  return meta;
}

// ---------------------------------------------------------------------------
// Formatting helpers.

// "NODE_STATE_ALIVE" with prefix "NODE_STATE_" -> "alive".
std::string EnumName(const std::string& full, const std::string& prefix) {
  std::string s = full.rfind(prefix, 0) == 0 ? full.substr(prefix.size()) : full;
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string NodeStateName(v1::NodeState s) { return EnumName(v1::NodeState_Name(s), "NODE_STATE_"); }
std::string VersionStateName(v1::VersionState s) {
  return EnumName(v1::VersionState_Name(s), "VERSION_STATE_");
}
std::string CopyRoleName(v1::CopyRole r) { return EnumName(v1::CopyRole_Name(r), "COPY_ROLE_"); }
std::string CopyStateName(v1::CopyState s) { return EnumName(v1::CopyState_Name(s), "COPY_STATE_"); }
std::string ProblemKindName(v1::ProblemKind k) {
  return EnumName(v1::ProblemKind_Name(k), "PROBLEM_KIND_");
}
std::string SeverityName(v1::Severity s) { return EnumName(v1::Severity_Name(s), "SEVERITY_"); }

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// "3s ago", "5m ago", "2h ago", "4d ago"; "-" for 0 (never).
std::string Age(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  int64_t s = std::max<int64_t>(0, (NowUnixMs() - unix_ms) / 1000);
  if (s < 60) return absl::StrCat(s, "s ago");
  if (s < 3600) return absl::StrCat(s / 60, "m ago");
  if (s < 86400) return absl::StrCat(s / 3600, "h ago");
  return absl::StrCat(s / 86400, "d ago");
}

std::string DurationMs(int64_t ms) {
  if (ms < 1000) return absl::StrCat(ms, "ms");
  if (ms < 60000) return absl::StrFormat("%.1fs", static_cast<double>(ms) / 1000.0);
  return absl::StrCat(ms / 60000, "m");
}

// Long durations (node time, MTBF): "42s", "12.5m", "3.2h", "4.1d".
std::string LongDuration(int64_t ms) {
  const double s = static_cast<double>(ms) / 1000.0;
  if (s < 60) return absl::StrFormat("%.0fs", s);
  if (s < 3600) return absl::StrFormat("%.1fm", s / 60);
  if (s < 2 * 86400) return absl::StrFormat("%.1fh", s / 3600);
  return absl::StrFormat("%.1fd", s / 86400);
}

// Prints `rows` under `header`, columns left-aligned and separated by two
// spaces.
void PrintTable(const std::vector<std::string>& header,
                const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(header.size(), 0);
  for (size_t i = 0; i < header.size(); ++i) width[i] = header[i].size();
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size() && i < width.size(); ++i) {
      width[i] = std::max(width[i], row[i].size());
    }
  }
  auto print_row = [&](const std::vector<std::string>& row) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line += std::string(width[i] - row[i].size() + 2, ' ');
    }
    std::cout << line << "\n";
  };
  print_row(header);
  for (const auto& row : rows) print_row(row);
}

std::string ProtectionString(const v1::ProtectionPolicy& p) {
  switch (p.kind_case()) {
    case v1::ProtectionPolicy::kNone:
      return "none";
    case v1::ProtectionPolicy::kReplicate:
      return absl::StrCat("replicate:", p.replicate().copies(), ":",
                          EnumName(v1::ReplicaPlacement_Name(p.replicate().placement()),
                                   "REPLICA_PLACEMENT_"));
    case v1::ProtectionPolicy::kEc:
      return absl::StrCat("ec:", p.ec().data_k(), "+", p.ec().parity_m());
    default:
      return "default";
  }
}

// ---------------------------------------------------------------------------
// JSON of proto messages.

Json NodeJson(const v1::NodeInfo& n) {
  return Json{{"id", n.endpoint().node_id()},
              {"state", NodeStateName(n.state())},
              {"address", n.endpoint().grpc_address()},
              {"data_address", n.endpoint().data_address()},
              {"role", EnumName(v1::NodeRole_Name(n.role()), "NODE_ROLE_")},
              {"failure_domain", n.failure_domain()},
              {"host_node_id", n.host_node_id()},
              {"memory_capacity_bytes", n.memory_capacity_bytes()},
              {"memory_used_bytes", n.memory_used_bytes()},
              {"memory_free_bytes", n.memory_free_bytes()},
              {"flush_lag_bytes", n.flush_lag_bytes()},
              {"flush_lag_ms", n.flush_lag_ms()},
              {"pending_tasks", n.pending_tasks()},
              {"last_heartbeat_unix_ms", n.last_heartbeat_unix_ms()},
              {"agent_version", n.agent_version()},
              {"drained", n.drained()}};
}

uint64_t VersionCount(const v1::JobInfo& j) {
  uint64_t total = 0;
  for (const auto& c : j.version_counts()) {
    if (c.state() != v1::VERSION_STATE_DELETED) total += c.count();
  }
  return total;
}

std::optional<uint64_t> NewestStep(const v1::JobInfo& j) {
  std::optional<uint64_t> newest;
  auto take = [&](bool has, uint64_t v) {
    if (has && (!newest || v > *newest)) newest = v;
  };
  take(j.has_latest_staged_step(), j.latest_staged_step());
  take(j.has_latest_protected_step(), j.latest_protected_step());
  take(j.has_latest_persisted_step(), j.latest_persisted_step());
  return newest;
}

Json OptStep(bool has, uint64_t v) { return has ? Json(v) : Json(nullptr); }

Json JobJson(const v1::JobInfo& j) {
  std::optional<uint64_t> newest = NewestStep(j);
  Json counts = Json::object();
  for (const auto& c : j.version_counts()) counts[VersionStateName(c.state())] = c.count();
  return Json{{"id", j.spec().job_id()},
              {"world_size", j.spec().world_size()},
              {"protection", ProtectionString(j.spec().protection())},
              {"flush_every_n_versions", j.spec().flush().every_n_versions()},
              {"keep_in_memory", j.spec().retention().keep_in_memory()},
              {"keep_durable", j.spec().retention().keep_durable()},
              {"versions", VersionCount(j)},
              {"versions_by_state", counts},
              {"newest_step", newest ? Json(*newest) : Json(nullptr)},
              {"latest_staged_step", OptStep(j.has_latest_staged_step(), j.latest_staged_step())},
              {"latest_protected_step",
               OptStep(j.has_latest_protected_step(), j.latest_protected_step())},
              {"latest_persisted_step",
               OptStep(j.has_latest_persisted_step(), j.latest_persisted_step())},
              {"memory_bytes", j.memory_bytes()},
              {"durable_bytes", j.durable_bytes()},
              {"created_unix_ms", j.created_unix_ms()},
              {"deleting", j.deleting()}};
}

std::string CrcHex(uint32_t crc) { return absl::StrFormat("%08x", crc); }

Json VersionJson(const v1::VersionInfo& v, bool with_shards) {
  Json out{{"job", v.job_id()},
           {"step", v.step()},
           {"state", VersionStateName(v.state())},
           {"world_size", v.world_size()},
           {"shards_staged", v.shards_staged()},
           {"total_bytes", v.total_bytes()},
           {"flush_planned", v.flush_planned()},
           {"created_unix_ms", v.created_unix_ms()},
           {"staged_unix_ms", v.staged_unix_ms()},
           {"protected_unix_ms", v.protected_unix_ms()},
           {"persisted_unix_ms", v.persisted_unix_ms()},
           {"durable_dir", v.durable_dir()},
           {"abort_reason", v.abort_reason()}};
  if (with_shards) {
    Json shards = Json::array();
    for (const v1::ShardDetail& s : v.shards()) {
      Json copies = Json::array();
      for (const v1::ShardCopy& c : s.copies()) {
        copies.push_back(Json{{"node_id", c.node_id()},
                              {"role", CopyRoleName(c.role())},
                              {"state", CopyStateName(c.state())}});
      }
      shards.push_back(Json{{"rank", s.info().key().rank()},
                            {"size_bytes", s.info().size_bytes()},
                            {"crc32c", CrcHex(s.info().crc32c())},
                            {"primary_node_id", s.info().primary_node_id()},
                            {"copies", copies},
                            {"durable_path", s.durable().path()},
                            {"durable_written", s.durable().written()}});
    }
    out["shards"] = shards;
    // EC versions: every segment of every stripe, where it is and its state.
    if (v.segments_size() > 0) {
      Json segments = Json::array();
      for (const v1::SegmentInfo& seg : v.segments()) {
        segments.push_back(Json{{"group", seg.key().group_index()},
                                {"stripe", seg.key().stripe_index()},
                                {"position", seg.key().position()},
                                {"kind", EnumName(v1::SegmentKind_Name(seg.kind()), "SEGMENT_KIND_")},
                                {"owner_node_id", seg.owner_node_id()},
                                {"holder_node_id", seg.holder_node_id()},
                                {"state", CopyStateName(seg.state())},
                                {"length_bytes", seg.length_bytes()},
                                {"detail", seg.detail()}});
      }
      out["segments"] = segments;
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// Ctrl-C of a watch: ends it after the refresh being drawn, exit 0.

volatile std::sig_atomic_t g_interrupted = 0;

void OnInterrupt(int) { g_interrupted = 1; }

void StopOnInterrupt() {
  struct sigaction sa {};
  sa.sa_handler = OnInterrupt;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
}

bool Interrupted() { return g_interrupted != 0; }

// ---------------------------------------------------------------------------
// Commands.

struct Globals {
  std::string meta;
  bool json = false;
  double timeout_s = 30;
  TlsFiles tls;                                         // --tls-*, else CKPT_TLS_*
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // from tls
  std::string token_file;                               // --token-file
  std::string token;                                    // sent with every call to meta
  bool progress = false;                                // --progress: progress lines even off a terminal
  bool quiet = false;                                   // --quiet: none even on a terminal
};

class Ctl {
 public:
  explicit Ctl(const Globals& g) : g_(g) {
    // Versions and shards of big models carry megabytes of manifest
    // (inspect): no limit on what we receive.
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    SetFailoverArgs(g.meta, &args);
    stub_ = v1::MetaService::NewStub(grpc::CreateCustomChannel(GrpcTargetOf(g.meta), g.credentials, args));
  }

  // Runs `call` on a fresh context with the --timeout deadline. Returns true
  // on success; otherwise prints the server's code and message.
  template <typename Fn>
  bool Call(Fn&& call) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(g_.timeout_s * 1000)));
    AddToken(&ctx, g_.token);
    grpc::Status st = call(&ctx);
    if (st.ok()) return true;
    std::string code = absl::StatusCodeToString(static_cast<absl::StatusCode>(st.error_code()));
    std::string msg = st.error_message();
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE ||
        st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      msg = absl::StrCat("ckpt-meta at ", g_.meta, ": ", msg);
      // A TLS mismatch looks like a closed socket from here.
      if (st.error_code() == grpc::StatusCode::UNAVAILABLE) {
        absl::StrAppend(&msg, g_.tls.enabled()
                                  ? " (TLS: is --tls-ca the CA that signed ckpt-meta's certificate, and "
                                    "does ckpt-meta's CA accept --tls-cert? docs/security.md)"
                                  : " (if ckpt-meta requires TLS: --tls-ca, --tls-cert, --tls-key; "
                                    "docs/security.md)");
      }
    }
    if (watching_) {  // shown in the refresh (Watch)
      error_code_ = code;
      error_message_ = msg;
      return false;
    }
    PrintError(g_.json, code, msg);
    return false;
  }

  void PrintJson(const Json& j) {
    if (watching_) {
      captured_ = j;
      return;
    }
    std::cout << j.dump(2) << "\n";
  }

  // `-w`: runs `refresh` (Status or Versions) every `interval` until Ctrl-C
  // (exit 0) or `count` refreshes (0: no limit). On a terminal each refresh
  // clears the screen and draws a header line (interval, command, time) and
  // the table; elsewhere the blocks follow one another, a blank line
  // between; with --json one JSON object per line (JSON Lines): "refresh",
  // "time", "unix_ms" and the command's own fields, or "error". An error of
  // the first refresh is the command's error (an unknown job: exit 1 at
  // once) unless meta is unreachable; later errors are shown in their
  // refresh and the watch goes on.
  int Watch(const std::string& title, absl::Duration interval, uint64_t count, const std::function<int()>& refresh) {
    StopOnInterrupt();
    const bool tty = !g_.json && ::isatty(STDOUT_FILENO) == 1;
    for (uint64_t n = 1; count == 0 || n <= count; ++n) {
      const absl::Time now = absl::Now();
      error_code_.clear();
      error_message_.clear();
      captured_.reset();
      std::ostringstream body;
      std::streambuf* const saved = std::cout.rdbuf(body.rdbuf());
      watching_ = true;
      const int rc = refresh();
      watching_ = false;
      std::cout.rdbuf(saved);
      if (rc != kExitOk && n == 1 && error_code_ != "UNAVAILABLE" && error_code_ != "DEADLINE_EXCEEDED") {
        PrintError(g_.json, error_code_.empty() ? "UNKNOWN" : error_code_, error_message_);
        return kExitFailure;
      }
      if (g_.json) {
        Json line{{"refresh", n},
                  {"time", absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", now, absl::UTCTimeZone())},
                  {"unix_ms", absl::ToUnixMillis(now)}};
        if (rc == kExitOk && captured_) {
          for (auto it = captured_->begin(); it != captured_->end(); ++it) line[it.key()] = it.value();
        } else {
          line["error"] = Json{{"code", error_code_}, {"message", error_message_}};
        }
        std::cout << line.dump() << "\n";
      } else {
        if (tty) {
          std::cout << "\033[H\033[2J";  // home, clear
        } else if (n > 1) {
          std::cout << "\n";
        }
        std::cout << "Every " << absl::FormatDuration(interval) << ": ckptctl " << title << "    "
                  << absl::FormatTime("%Y-%m-%d %H:%M:%S %Z", now, absl::LocalTimeZone())
                  << (count != 0 ? absl::StrCat("  (", n, "/", count, ")") : std::string()) << "\n\n";
        if (rc == kExitOk) {
          std::cout << body.str();
        } else {
          std::cout << kProgram << ": " << error_code_ << ": " << error_message_ << "\n(still watching; next try in "
                    << absl::FormatDuration(interval) << ")\n";
        }
      }
      std::cout << std::flush;
      if (count != 0 && n == count) break;
      // Sleep in short steps so Ctrl-C ends the watch at once.
      const absl::Time next = now + interval;
      while (!Interrupted() && absl::Now() < next) {
        absl::SleepFor(std::min(absl::Milliseconds(50), next - absl::Now()));
      }
      if (Interrupted()) break;
    }
    if (Interrupted() && tty) std::cout << "\n" << std::flush;  // after the terminal's "^C"
    return kExitOk;
  }

  // `job` (may be empty): also that job's MTBF.
  int Status(const std::string& job) {
    v1::ClusterStatusRequest req;
    req.set_include_nodes(false);
    req.set_max_problems(100);
    req.set_job_id(job);
    v1::ClusterStatusResponse resp;
    if (!Call([&](grpc::ClientContext* c) { return stub_->ClusterStatus(c, req, &resp); })) {
      return kExitFailure;
    }
    Json nodes = Json::object(), versions = Json::object(), problems = Json::array();
    for (const auto& n : resp.nodes_by_state()) nodes[NodeStateName(n.state())] = n.count();
    for (const auto& v : resp.versions_by_state()) versions[VersionStateName(v.state())] = v.count();
    for (const auto& p : resp.problems()) {
      problems.push_back(Json{{"kind", ProblemKindName(p.kind())},
                              {"severity", SeverityName(p.severity())},
                              {"message", p.message()},
                              {"node_id", p.node_id()},
                              {"job_id", p.job_id()},
                              {"step", p.has_step() ? Json(p.step()) : Json(nullptr)},
                              {"since_unix_ms", p.since_unix_ms()}});
    }
    const v1::FailureStats& f = resp.failure_stats();
    // Meta replicas (--replica-of): who leads, how far each follower is.
    Json replicas = Json::array();
    uint64_t leader_index = 0;
    for (const v1::MetaReplica& r : resp.meta_replicas()) {
      if (r.leader()) leader_index = r.applied_index();
      replicas.push_back(Json{{"address", r.address()}, {"leader", r.leader()}, {"applied_index", r.applied_index()}});
    }
    if (g_.json) {
      PrintJson(Json{{"meta_instance_id", std::to_string(resp.meta_instance_id())},  // above 2^53: a string
                     {"meta_version", resp.meta_version()},
                     {"meta_start_unix_ms", resp.meta_start_unix_ms()},
                     {"meta_replicas", replicas},
                     {"nodes_by_state", nodes},
                     {"jobs", resp.jobs()},
                     {"versions_by_state", versions},
                     {"memory_capacity_bytes", resp.memory_capacity_bytes()},
                     {"memory_used_bytes", resp.memory_used_bytes()},
                     {"memory_free_bytes", resp.memory_free_bytes()},
                     {"flush_lag_bytes", resp.flush_lag_bytes()},
                     {"flush_lag_ms", resp.flush_lag_ms()},
                     {"tasks_pending", resp.tasks_pending()},
                     {"tasks_running", resp.tasks_running()},
                     {"tasks_retrying", resp.tasks_retrying()},
                     {"problems", problems},
                     {"problems_total", resp.problems_total()},
                     {"failure_stats", Json{{"observed_node_ms", f.observed_node_ms()},
                                            {"failures", f.failures()},
                                            {"node_mtbf_ms", f.node_mtbf_ms()},
                                            {"mtbf_is_lower_bound", f.mtbf_is_lower_bound()},
                                            {"job_id", job},
                                            {"job_nodes", f.job_nodes()},
                                            {"job_mtbf_ms", f.job_mtbf_ms()}}}});
      return kExitOk;
    }
    auto counts = [](const Json& j) {
      if (j.empty()) return std::string("none");
      std::string s;
      for (auto it = j.begin(); it != j.end(); ++it) {
        if (!s.empty()) s += ", ";
        absl::StrAppend(&s, it.value().get<uint64_t>(), " ", it.key());
      }
      return s;
    };
    std::cout << "meta:      " << resp.meta_version() << " (up since "
              << Age(resp.meta_start_unix_ms()) << ")\n";
    if (resp.meta_replicas_size() > 0) {
      std::cout << "replicas:  ";
      for (const v1::MetaReplica& r : resp.meta_replicas()) {
        if (&r != &resp.meta_replicas(0)) std::cout << ", ";
        std::cout << r.address();
        if (r.leader()) {
          std::cout << " (leader, log index " << r.applied_index() << ")";
        } else {
          std::cout << " (follower, " << (leader_index > r.applied_index() ? leader_index - r.applied_index() : 0)
                    << " behind)";
        }
      }
      std::cout << "\n";
    }
    std::cout << "nodes:     " << counts(nodes) << "\n"
              << "jobs:      " << resp.jobs() << "\n"
              << "versions:  " << counts(versions) << "\n"
              << "memory:    " << FormatBytes(resp.memory_used_bytes()) << " used, "
              << FormatBytes(resp.memory_free_bytes()) << " free of "
              << FormatBytes(resp.memory_capacity_bytes()) << "\n"
              << "flush lag: " << FormatBytes(resp.flush_lag_bytes()) << ", "
              << DurationMs(resp.flush_lag_ms()) << "\n"
              << "tasks:     " << resp.tasks_pending() << " pending, " << resp.tasks_running()
              << " running, " << resp.tasks_retrying() << " retrying\n"
              << "failures:  " << f.failures() << " seen in " << LongDuration(f.observed_node_ms())
              << " of node time; MTBF per node " << (f.mtbf_is_lower_bound() ? ">= " : "")
              << LongDuration(f.node_mtbf_ms());
    if (!job.empty()) {
      std::cout << "; job " << job << " on " << f.job_nodes() << " node(s): "
                << (f.mtbf_is_lower_bound() ? ">= " : "") << LongDuration(f.job_mtbf_ms());
    }
    std::cout << "\n"
              << "problems:  " << resp.problems_total() << "\n";
    for (const auto& p : resp.problems()) {
      std::cout << "  [" << SeverityName(p.severity()) << "] " << ProblemKindName(p.kind())
                << ": " << p.message() << "\n";
    }
    return kExitOk;
  }

  int Nodes() {
    v1::ListNodesRequest req;
    v1::ListNodesResponse resp;
    if (!Call([&](grpc::ClientContext* c) { return stub_->ListNodes(c, req, &resp); })) {
      return kExitFailure;
    }
    if (g_.json) {
      Json arr = Json::array();
      for (const auto& n : resp.nodes()) arr.push_back(NodeJson(n));
      PrintJson(Json{{"nodes", arr}});
      return kExitOk;
    }
    std::vector<std::vector<std::string>> rows;
    for (const auto& n : resp.nodes()) {
      const bool marked = n.drained() && n.state() != v1::NODE_STATE_DRAINING && n.state() != v1::NODE_STATE_LEFT;
      rows.push_back({n.endpoint().node_id(), NodeStateName(n.state()) + std::string(marked ? " (drained)" : ""),
                      n.endpoint().grpc_address(), FormatBytes(n.memory_used_bytes()),
                      FormatBytes(n.memory_free_bytes()), Age(n.last_heartbeat_unix_ms())});
    }
    PrintTable({"NODE", "STATE", "ADDRESS", "USED", "FREE", "HEARTBEAT"}, rows);
    return kExitOk;
  }

  int Jobs() {
    std::vector<v1::JobInfo> jobs;
    std::string token;
    do {
      v1::ListJobsRequest req;
      req.set_page_token(token);
      v1::ListJobsResponse resp;
      if (!Call([&](grpc::ClientContext* c) { return stub_->ListJobs(c, req, &resp); })) {
        return kExitFailure;
      }
      for (const auto& j : resp.jobs()) jobs.push_back(j);
      token = resp.next_page_token();
    } while (!token.empty());
    if (g_.json) {
      Json arr = Json::array();
      for (const auto& j : jobs) arr.push_back(JobJson(j));
      PrintJson(Json{{"jobs", arr}});
      return kExitOk;
    }
    std::vector<std::vector<std::string>> rows;
    for (const auto& j : jobs) {
      std::optional<uint64_t> newest = NewestStep(j);
      rows.push_back({j.spec().job_id(), std::to_string(j.spec().world_size()),
                      ProtectionString(j.spec().protection()), std::to_string(VersionCount(j)),
                      newest ? std::to_string(*newest) : "-", FormatBytes(j.memory_bytes())});
    }
    PrintTable({"JOB", "WORLD", "PROTECTION", "VERSIONS", "NEWEST", "MEMORY"}, rows);
    return kExitOk;
  }

  int Versions(const std::string& job) {
    std::vector<v1::VersionInfo> versions;
    std::string token;
    do {
      v1::ListVersionsRequest req;
      req.set_job_id(job);
      req.set_page_token(token);
      v1::ListVersionsResponse resp;
      if (!Call([&](grpc::ClientContext* c) { return stub_->ListVersions(c, req, &resp); })) {
        return kExitFailure;
      }
      for (const auto& v : resp.versions()) versions.push_back(v);
      token = resp.next_page_token();
    } while (!token.empty());
    if (g_.json) {
      Json arr = Json::array();
      for (const auto& v : versions) arr.push_back(VersionJson(v, false));
      PrintJson(Json{{"job", job}, {"versions", arr}});
      return kExitOk;
    }
    std::vector<std::vector<std::string>> rows;
    for (const auto& v : versions) {
      rows.push_back({std::to_string(v.step()), VersionStateName(v.state()),
                      absl::StrCat(v.shards_staged(), "/", v.world_size()),
                      FormatBytes(v.total_bytes()), Age(v.created_unix_ms()),
                      v.abort_reason().empty() ? "-" : v.abort_reason()});
    }
    PrintTable({"STEP", "STATE", "SHARDS", "SIZE", "CREATED", "REASON"}, rows);
    return kExitOk;
  }

  int PrintVersion(const v1::VersionInfo& v, bool with_shards) {
    if (g_.json) {
      PrintJson(VersionJson(v, with_shards));
      return kExitOk;
    }
    std::cout << "job:      " << v.job_id() << "\n"
              << "step:     " << v.step() << "\n"
              << "state:    " << VersionStateName(v.state()) << "\n"
              << "shards:   " << v.shards_staged() << "/" << v.world_size() << "\n"
              << "size:     " << FormatBytes(v.total_bytes()) << "\n"
              << "created:  " << Age(v.created_unix_ms()) << "\n";
    if (!v.durable_dir().empty()) std::cout << "durable:  " << v.durable_dir() << "\n";
    if (!v.abort_reason().empty()) std::cout << "aborted:  " << v.abort_reason() << "\n";
    if (!with_shards) return kExitOk;
    std::vector<std::vector<std::string>> rows;
    for (const v1::ShardDetail& s : v.shards()) {
      std::string copies;
      for (const v1::ShardCopy& c : s.copies()) {
        if (!copies.empty()) copies += " ";
        absl::StrAppend(&copies, c.node_id(), "(", CopyRoleName(c.role()), "/",
                        CopyStateName(c.state()), ")");
      }
      std::string durable = s.durable().path().empty() ? "-" : s.durable().path();
      if (!s.durable().path().empty() && !s.durable().written()) durable += " (not written)";
      rows.push_back({std::to_string(s.info().key().rank()), FormatBytes(s.info().size_bytes()),
                      CrcHex(s.info().crc32c()), copies.empty() ? "-" : copies, durable});
    }
    std::cout << "\n";
    PrintTable({"RANK", "SIZE", "CRC32C", "COPIES", "DURABLE"}, rows);
    if (v.segments_size() > 0) {
      std::vector<std::vector<std::string>> segs;
      for (const v1::SegmentInfo& seg : v.segments()) {
        const std::string kind = EnumName(v1::SegmentKind_Name(seg.kind()), "SEGMENT_KIND_");
        segs.push_back({absl::StrCat(seg.key().group_index(), "/", seg.key().stripe_index(), "/", seg.key().position()),
                        kind == "data" ? absl::StrCat("data of ", seg.owner_node_id()) : kind,
                        seg.holder_node_id(), FormatBytes(seg.length_bytes()),
                        seg.detail().empty() ? CopyStateName(seg.state())
                                             : absl::StrCat(CopyStateName(seg.state()), " (", seg.detail(), ")")});
      }
      std::cout << "\n";
      PrintTable({"SEGMENT", "KIND", "HOLDER", "SIZE", "STATE"}, segs);
    }
    return kExitOk;
  }

  int Inspect(const std::string& job, uint64_t step) {
    v1::GetVersionRequest req;
    req.set_job_id(job);
    req.set_step(step);
    req.set_include_items(false);
    v1::GetVersionResponse resp;
    if (!Call([&](grpc::ClientContext* c) { return stub_->GetVersion(c, req, &resp); })) {
      return kExitFailure;
    }
    return PrintVersion(resp.version(), true);
  }

  int CreateJob(const v1::JobSpec& spec) {
    const bool defaulted = !spec.has_protection();
    v1::CreateJobRequest req;
    *req.mutable_spec() = spec;
    // Idempotent: the same spec again is OK ("unchanged"); a different one is
    // FAILED_PRECONDITION, meta's message naming each differing field.
    req.set_open_if_exists(true);
    v1::CreateJobResponse resp;
    if (!Call([&](grpc::ClientContext* c) { return stub_->CreateJob(c, req, &resp); })) {
      return kExitFailure;
    }
    if (g_.json) {
      Json j = JobJson(resp.job());
      j["created"] = resp.created();
      PrintJson(j);
    } else if (!resp.created()) {
      std::cout << "job " << resp.job().spec().job_id() << " unchanged (it exists with this spec)\n";
    } else {
      std::cout << "created job " << resp.job().spec().job_id() << " (world size "
                << resp.job().spec().world_size() << ", protection "
                << ProtectionString(resp.job().spec().protection())
                << (defaulted ? ", the server's default" : "") << ")\n";
    }
    return kExitOk;
  }

  // `wait`: with a value, then waits until the version is PERSISTED (Wait).
  int Flush(const std::string& job, uint64_t step, std::optional<std::optional<absl::Duration>> wait,
            ProgressMode mode) {
    v1::FlushVersionRequest req;
    req.set_job_id(job);
    req.set_step(step);
    v1::FlushVersionResponse resp;
    if (!Call([&](grpc::ClientContext* c) { return stub_->FlushVersion(c, req, &resp); })) {
      return kExitFailure;
    }
    if (!g_.json) std::cout << "flush requested\n";
    if (!wait) return PrintVersion(resp.version(), false);
    if (!g_.json) PrintVersion(resp.version(), false);
    return Wait(job, step, v1::DURABILITY_LEVEL_PERSISTED, *wait, mode, resp.version().state());
  }

  // Waits until (job, step) reaches `level` (WaitVersion long polls; meta
  // being unreachable is ridden out until `timeout`; none: no limit). Exit 0
  // once reached; 1 on timeout (DEADLINE_EXCEEDED, with the version's state
  // as meta says it), for a version or job meta does not know (NOT_FOUND), or
  // one that can never get there (aborted: DATA_LOSS or FAILED_PRECONDITION,
  // meta's reason).
  // `known_state`: the version's state as the caller last saw it (flush).
  int Wait(const std::string& job, uint64_t step, v1::DurabilityLevel level, std::optional<absl::Duration> timeout,
           ProgressMode mode, std::optional<v1::VersionState> known_state = std::nullopt) {
    const std::string level_name = EnumName(v1::DurabilityLevel_Name(level), "DURABILITY_LEVEL_");
    const std::string what = absl::StrCat(job, "/", step);
    const absl::Time start = absl::Now();
    const absl::Time deadline = timeout ? start + *timeout : absl::InfiniteFuture();
    Progress meter(absl::StrCat("waiting for ", what, " to be ", level_name), 0, mode);
    v1::WaitVersionRequest req;
    req.set_job_id(job);
    req.set_step(step);
    // With progress on: one level after the other (staged, protected, ...),
    // each state change a line as it happens ("w/1: staged -> protected
    // after 0.4s"); else straight to `level`.
    v1::DurabilityLevel stage = mode.on ? v1::DURABILITY_LEVEL_STAGED : level;
    std::optional<v1::VersionState> shown = known_state;
    if (shown) meter.Line(absl::StrCat(what, ": ", VersionStateName(*shown)));
    req.set_level(stage);
    absl::Duration backoff = absl::Milliseconds(100);
    std::string last;
    while (true) {
      const absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
      // Short polls while a progress line shows the time waited.
      const absl::Duration poll = std::min(left, mode.on ? absl::Seconds(1) : absl::Minutes(10));
      req.set_timeout_ms(absl::ToInt64Milliseconds(poll));
      v1::WaitVersionResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + poll + absl::Seconds(g_.timeout_s)));
      AddToken(&ctx, g_.token);
      const grpc::Status st = stub_->WaitVersion(&ctx, req, &resp);
      const absl::Duration waited = absl::Now() - start;
      if (st.ok() && mode.on) {
        const v1::VersionState now_state = resp.version().state();
        if (!shown || *shown != now_state) {
          meter.Line(shown ? absl::StrCat(what, ": ", VersionStateName(*shown), " -> ", VersionStateName(now_state),
                                          " after ", DurationMs(absl::ToInt64Milliseconds(waited)))
                           : absl::StrCat(what, ": ", VersionStateName(now_state)));
          shown = now_state;
        }
      }
      if (st.ok() && stage != level) {
        stage = static_cast<v1::DurabilityLevel>(static_cast<int>(stage) + 1);
        req.set_level(stage);
        continue;
      }
      if (st.ok()) {
        meter.Clear();
        if (g_.json) {
          Json j = VersionJson(resp.version(), false);
          j["level"] = level_name;
          j["waited_ms"] = absl::ToInt64Milliseconds(waited);
          PrintJson(j);
        } else {
          std::cout << what << " reached " << level_name << " after " << DurationMs(absl::ToInt64Milliseconds(waited))
                    << " (state " << VersionStateName(resp.version().state()) << ")\n";
        }
        return kExitOk;
      }
      const bool time_left = absl::Now() < deadline;
      if (st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED || st.error_code() == grpc::StatusCode::UNAVAILABLE) {
        last = st.error_message();
        // "version J/S did not reach L within <this poll>; it is OPEN with ...":
        // the state, without the poll's own limit.
        if (const size_t cut = last.find("; "); cut != std::string::npos &&
                                                last.find(" did not reach ") < cut) {
          last = last.substr(cut + 2);
        }
        if (time_left) {
          meter.Note(absl::StrCat(DurationMs(absl::ToInt64Milliseconds(waited)), " so far"));
          if (st.error_code() == grpc::StatusCode::UNAVAILABLE) {
            absl::SleepFor(std::min(backoff, std::max(deadline - absl::Now(), absl::ZeroDuration())));
            backoff = std::min(backoff * 2, absl::Seconds(2));
          }
          continue;
        }
        meter.Clear();
        PrintError(g_.json, "DEADLINE_EXCEEDED",
                   absl::StrCat(what, " did not reach ", level_name, " within ", absl::FormatDuration(*timeout),
                                st.error_code() == grpc::StatusCode::UNAVAILABLE
                                    ? absl::StrCat(": ckpt-meta at ", g_.meta, " unreachable: ")
                                    : ": ",
                                last));
        return kExitFailure;
      }
      meter.Clear();
      std::string code = absl::StatusCodeToString(static_cast<absl::StatusCode>(st.error_code()));
      std::string reason = st.error_code() == grpc::StatusCode::DATA_LOSS ||
                                   st.error_code() == grpc::StatusCode::FAILED_PRECONDITION
                               ? absl::StrCat(what, " will never be ", level_name, ": ")
                               : absl::StrCat("waiting for ", what, " to be ", level_name, ": ");
      PrintError(g_.json, code, reason + st.error_message());
      return kExitFailure;
    }
  }

  int Delete(const std::string& job, uint64_t step, bool force) {
    v1::DeleteVersionRequest req;
    req.set_job_id(job);
    req.set_step(step);
    req.set_force(force);
    v1::DeleteVersionResponse resp;
    if (!Call([&](grpc::ClientContext* c) { return stub_->DeleteVersion(c, req, &resp); })) {
      return kExitFailure;
    }
    if (!g_.json) std::cout << "deleting\n";
    return PrintVersion(resp.version(), false);
  }

  int DeleteJob(const std::string& job, bool delete_durable_files) {
    v1::DeleteJobRequest req;
    req.set_job_id(job);
    req.set_delete_durable_files(delete_durable_files);
    v1::DeleteJobResponse resp;
    if (!Call([&](grpc::ClientContext* c) { return stub_->DeleteJob(c, req, &resp); })) {
      return kExitFailure;
    }
    if (g_.json) {
      PrintJson(JobJson(resp.job()));
    } else {
      std::cout << "deleting job " << job << " (its versions are deleted and its memory copies evicted; durable "
                << (delete_durable_files ? "files deleted too" : "files kept: `ckptctl restore --from-dir` reads them")
                << ")\n";
    }
    return kExitOk;
  }

  // update-job: each policy given (even in part) is read from the job, the
  // flags given applied, and sent whole; UpdateJob replaces it.
  int UpdateJob(const std::string& job, std::optional<uint32_t> keep_mem, std::optional<uint32_t> keep_durable,
                std::optional<uint32_t> flush_every, std::optional<uint32_t> flush_seconds,
                const std::optional<v1::ProtectionPolicy>& protection) {
    v1::GetJobRequest greq;
    greq.set_job_id(job);
    v1::GetJobResponse got;
    if (!Call([&](grpc::ClientContext* c) { return stub_->GetJob(c, greq, &got); })) return kExitFailure;
    v1::UpdateJobRequest req;
    req.set_job_id(job);
    if (keep_mem || keep_durable) {
      *req.mutable_retention() = got.job().spec().retention();
      if (keep_mem) req.mutable_retention()->set_keep_in_memory(*keep_mem);
      if (keep_durable) req.mutable_retention()->set_keep_durable(*keep_durable);
    }
    if (flush_every || flush_seconds) {
      *req.mutable_flush() = got.job().spec().flush();
      if (flush_every) req.mutable_flush()->set_every_n_versions(*flush_every);
      if (flush_seconds) req.mutable_flush()->set_every_seconds(*flush_seconds);
    }
    if (protection) *req.mutable_protection() = *protection;
    v1::UpdateJobResponse resp;
    if (!Call([&](grpc::ClientContext* c) { return stub_->UpdateJob(c, req, &resp); })) return kExitFailure;
    if (g_.json) {
      Json j = JobJson(resp.job());
      j["changed"] = resp.changed();
      PrintJson(j);
      return kExitOk;
    }
    const v1::RetentionPolicy& r = resp.job().spec().retention();
    const v1::FlushPolicy& f = resp.job().spec().flush();
    std::string flush_text;
    if (f.every_n_versions() != 0) absl::StrAppend(&flush_text, "every ", f.every_n_versions(), " versions");
    if (f.every_seconds() != 0) {
      absl::StrAppend(&flush_text, flush_text.empty() ? "" : " or ", "every ", f.every_seconds(), " s");
    }
    std::cout << (resp.changed() ? "updated job " : "job ") << job << (resp.changed() ? "" : " unchanged")
              << ": keeps " << (r.keep_in_memory() == 0 ? 2 : r.keep_in_memory()) << " version(s) in memory and "
              << (r.keep_durable() == 0 ? std::string("every") : absl::StrCat(r.keep_durable()))
              << " durable; flushes " << (flush_text.empty() ? std::string("only when asked") : flush_text)
              << "; protects new versions with " << ProtectionString(resp.job().spec().protection())
              << (protection && resp.changed() ? " (versions begun before keep the policy they were planned with)" : "")
              << "\n";
    return kExitOk;
  }

  int Drain(const std::string& node) {
    v1::DrainNodeRequest req;
    req.set_node_id(node);
    v1::DrainNodeResponse resp;
    if (!Call([&](grpc::ClientContext* c) { return stub_->DrainNode(c, req, &resp); })) {
      return kExitFailure;
    }
    return PrintNodeChange(resp.node());
  }

  int Undrain(const std::string& node) {
    v1::UndrainNodeRequest req;
    req.set_node_id(node);
    v1::UndrainNodeResponse resp;
    if (!Call([&](grpc::ClientContext* c) { return stub_->UndrainNode(c, req, &resp); })) {
      return kExitFailure;
    }
    return PrintNodeChange(resp.node());
  }

  int RemoveNode(const std::string& node) {
    v1::RemoveNodeRequest req;
    req.set_node_id(node);
    v1::RemoveNodeResponse resp;
    if (!Call([&](grpc::ClientContext* c) { return stub_->RemoveNode(c, req, &resp); })) {
      return kExitFailure;
    }
    if (g_.json) {
      PrintJson(Json{{"id", node}, {"removed", true}});
    } else {
      std::cout << "node " << node << " removed\n";
    }
    return kExitOk;
  }

  int PrintNodeChange(const v1::NodeInfo& n) {
    if (g_.json) {
      PrintJson(NodeJson(n));
      return kExitOk;
    }
    std::cout << "node " << n.endpoint().node_id() << " is " << NodeStateName(n.state());
    if (n.drained() && n.state() != v1::NODE_STATE_DRAINING && n.state() != v1::NODE_STATE_LEFT) {
      std::cout << " (drained: it registers as draining)";
    } else if (!n.drained() && n.state() == v1::NODE_STATE_LEFT) {
      std::cout << " (undrained: alive when its agent registers)";
    }
    std::cout << "\n";
    return kExitOk;
  }

  // The job's placement plan and its survival probability for each number
  // of simultaneous node failures.
  int Placement(const std::string& job, const std::vector<uint32_t>& failures) {
    v1::GetPlacementRequest req;
    req.set_job_id(job);
    for (uint32_t f : failures) req.add_failures(f);
    v1::GetPlacementResponse resp;
    if (!Call([&](grpc::ClientContext* c) { return stub_->GetPlacement(c, req, &resp); })) {
      return kExitFailure;
    }
    const v1::PlacementPlan& plan = resp.plan();
    Json survival = Json::array();
    for (const v1::SurvivalEstimate& e : resp.survival()) {
      survival.push_back(Json{{"failures", e.failures()},
                              {"probability", e.probability()},
                              {"exact", e.exact()},
                              {"samples", e.samples()}});
    }
    Json sets = Json::array();
    for (const v1::ReplicaSet& r : plan.replica_sets()) {
      sets.push_back(Json{{"source", r.source_node_id()},
                          {"targets", std::vector<std::string>(r.target_node_ids().begin(),
                                                               r.target_node_ids().end())},
                          {"group", r.group_index()}});
    }
    Json groups = Json::array();
    for (const v1::EcGroupLayout& gr : plan.ec_groups()) {
      groups.push_back(Json{{"group", gr.group_index()},
                            {"nodes", std::vector<std::string>(gr.node_ids().begin(), gr.node_ids().end())},
                            {"data_k", gr.data_k()},
                            {"parity_m", gr.parity_m()}});
    }
    if (g_.json) {
      PrintJson(Json{{"job", plan.job_id()},
                     {"plan_epoch", plan.plan_epoch()},
                     {"protection", ProtectionString(plan.policy())},
                     {"nodes", std::vector<std::string>(plan.node_ids().begin(), plan.node_ids().end())},
                     {"replica_sets", sets},
                     {"ec_groups", groups},
                     {"survival", survival}});
      return kExitOk;
    }
    std::cout << "job " << plan.job_id() << ": " << ProtectionString(plan.policy()) << " over "
              << plan.node_ids_size() << " node(s), plan epoch " << plan.plan_epoch() << "\n";
    if (plan.replica_sets_size() > 0) {
      std::vector<std::vector<std::string>> rows;
      for (const v1::ReplicaSet& r : plan.replica_sets()) {
        std::string targets;
        for (const std::string& t : r.target_node_ids()) absl::StrAppend(&targets, targets.empty() ? "" : ",", t);
        rows.push_back({r.source_node_id(), targets.empty() ? "-" : targets, absl::StrCat(r.group_index())});
      }
      PrintTable({"SOURCE", "REPLICAS ON", "GROUP"}, rows);
    }
    if (plan.ec_groups_size() > 0) {
      std::vector<std::vector<std::string>> rows;
      for (const v1::EcGroupLayout& gr : plan.ec_groups()) {
        std::string nodes;
        for (const std::string& n : gr.node_ids()) absl::StrAppend(&nodes, nodes.empty() ? "" : ",", n);
        rows.push_back({absl::StrCat(gr.group_index()), absl::StrCat(gr.data_k(), "+", gr.parity_m()), nodes});
      }
      PrintTable({"GROUP", "EC", "NODES"}, rows);
    }
    if (resp.survival_size() > 0) {
      std::vector<std::vector<std::string>> rows;
      for (const v1::SurvivalEstimate& e : resp.survival()) {
        rows.push_back({absl::StrCat(e.failures()), absl::StrFormat("%.6f", e.probability()),
                        e.exact() ? "exact" : absl::StrCat("monte carlo, ", e.samples(), " samples")});
      }
      PrintTable({"FAILED NODES", "P(NO DATA LOST)", "METHOD"}, rows);
    }
    return kExitOk;
  }

 private:
  Globals g_;
  std::unique_ptr<v1::MetaService::Stub> stub_;
  // Watch: errors and JSON documents are kept for the refresh, not printed.
  bool watching_ = false;
  std::string error_code_, error_message_;
  std::optional<Json> captured_;
};

// "4+2" -> (4, 2); nullopt if malformed or zero.
std::optional<std::pair<uint32_t, uint32_t>> ParseEc(const std::string& s) {
  size_t plus = s.find('+');
  if (plus == std::string::npos) return std::nullopt;
  uint32_t k = 0, m = 0;
  if (!absl::SimpleAtoi(s.substr(0, plus), &k) || !absl::SimpleAtoi(s.substr(plus + 1), &m)) {
    return std::nullopt;
  }
  if (k == 0 || m == 0) return std::nullopt;
  return std::make_pair(k, m);
}

// The protection flags of create-job and update-job.
struct ProtectionFlags {
  uint32_t copies = 0;
  std::string placement = "ring";
  std::string ec_spec;
  bool none = false;
  CLI::Option* replicate_opt = nullptr;
  CLI::Option* ec_opt = nullptr;
  CLI::Option* none_opt = nullptr;

  void Add(CLI::App* cmd, const std::string& none_help) {
    replicate_opt = cmd->add_option("--replicate", copies, "Keep COPIES copies of every shard")
                        ->type_name("COPIES")
                        ->check(CLI::PositiveNumber);
    cmd->add_option("--placement", placement, "Replica placement: ring or group")
        ->check(CLI::IsMember({"ring", "group"}))
        ->needs(replicate_opt);
    ec_opt = cmd->add_option("--ec", ec_spec, "Erasure coding with K data and M parity segments")->type_name("K+M");
    none_opt = cmd->add_flag("--no-protection", none, none_help);
    replicate_opt->excludes(ec_opt)->excludes(none_opt);
    ec_opt->excludes(none_opt)->excludes(replicate_opt);
    none_opt->excludes(replicate_opt)->excludes(ec_opt);
  }
  bool Given() const { return replicate_opt->count() + ec_opt->count() + none_opt->count() > 0; }
  // The policy the flags name; nullopt when none was given; a usage error
  // message for a malformed --ec.
  absl::StatusOr<std::optional<v1::ProtectionPolicy>> Policy() const {
    v1::ProtectionPolicy p;
    if (replicate_opt->count() > 0) {
      p.mutable_replicate()->set_copies(copies);
      p.mutable_replicate()->set_placement(placement == "group" ? v1::REPLICA_PLACEMENT_GROUP
                                                                : v1::REPLICA_PLACEMENT_RING);
    } else if (ec_opt->count() > 0) {
      std::optional<std::pair<uint32_t, uint32_t>> km = ParseEc(ec_spec);
      if (!km) {
        return absl::InvalidArgumentError(
            absl::StrCat("--ec: expected K+M with positive integers, e.g. 4+2; got '", ec_spec, "'"));
      }
      p.mutable_ec()->set_data_k(km->first);
      p.mutable_ec()->set_parity_m(km->second);
    } else if (none_opt->count() > 0) {
      p.mutable_none();
    } else {
      return std::optional<v1::ProtectionPolicy>();
    }
    return std::make_optional(p);
  }
};

int Main(int argc, char** argv) {
  CLI::App app{
      "ckptctl: administer a ckpt cluster through ckpt-meta. Exit codes: 0 ok, 1 failure "
      "(the server's error on stderr), 2 usage error.",
      kProgram};
  app.require_subcommand(1);
  // Global options (--json, --meta, --timeout, the TLS and token flags) are
  // taken after the subcommand too: `ckptctl versions JOB --json`.
  app.fallthrough();
  Globals g;
  const char* env_meta = std::getenv("CKPT_META");
  g.meta = env_meta != nullptr && *env_meta != '\0' ? env_meta : kDefaultMeta;
  app.add_option("--meta", g.meta, "host:port of ckpt-meta, or of each meta replica separated by commas "
                                   "(IP literals; the leader answers) (default: $CKPT_META, else " +
                                       std::string(kDefaultMeta) + ")")
      ->type_name("HOST:PORT");
  app.add_flag("--json", g.json, "Print one JSON document per command (see docs/cli.md).");
  app.add_option("--timeout", g.timeout_s, "Deadline of each RPC in seconds.")
      ->check(CLI::PositiveNumber)
      ->default_str("30");
  app.add_flag("--progress", g.progress,
               "Progress of save, restore, verify and waits on stderr even when it is not a terminal (one line per update).");
  app.add_flag("-q,--quiet", g.quiet, "No progress on stderr, even on a terminal.");
  app.add_option("--tls-ca", g.tls.ca_file,
                 "PEM file of the CA that signed ckpt-meta's and the agents' certificates: talk "
                 "TLS (default: $CKPT_TLS_CA; docs/security.md)")
      ->type_name("FILE");
  app.add_option("--tls-cert", g.tls.cert_file,
                 "PEM certificate to present (servers with mutual TLS require one; default: "
                 "$CKPT_TLS_CERT)")
      ->type_name("FILE");
  app.add_option("--tls-key", g.tls.key_file, "PEM key of --tls-cert (default: $CKPT_TLS_KEY)")
      ->type_name("FILE");
  app.add_option("--tls-crl-dir", g.tls.crl_dir,
                 "Directory of hashed CRLs (openssl rehash): refuse a server whose certificate one revokes "
                 "(default: $CKPT_TLS_CRL_DIR)")
      ->type_name("DIR");
  app.add_option("--token-file", g.token_file,
                 "File holding the token to send (the admin token for delete, delete-job, update-job, drain, "
                 "remove-node; default: $CKPT_TOKEN_FILE, else $CKPT_TOKEN)")
      ->type_name("FILE");

  CLI::App* status = app.add_subcommand("status", "Cluster summary, node failure history (MTBF) and problems.");
  std::string status_job;
  status->add_option("--job", status_job, "Also the MTBF of this job's nodes");
  // -w on status and versions (one set of variables: one subcommand runs).
  bool watch = false;
  std::string watch_interval = "2s";
  uint64_t watch_count = 0;
  std::vector<CLI::Option*> watch_opts;  // --interval, --count of both
  auto add_watch = [&](CLI::App* cmd) {
    cmd->add_flag("-w,--watch", watch,
                  "Refresh every --interval until Ctrl-C (exit 0): redrawn on a terminal, one block per refresh "
                  "elsewhere, one JSON object per line with --json");
    watch_opts.push_back(
        cmd->add_option("--interval", watch_interval, "With --watch: time between refreshes (default 2s; 500ms, 1m, ...)")
            ->type_name("DUR"));
    watch_opts.push_back(
        cmd->add_option("--count", watch_count, "With --watch: stop after N refreshes (default 0: until Ctrl-C)")
            ->type_name("N"));
  };
  add_watch(status);
  CLI::App* nodes = app.add_subcommand("nodes", "List agent nodes.");
  CLI::App* jobs = app.add_subcommand("jobs", "List jobs.");

  std::string job;
  uint64_t step = 0;
  // Before the conversion to uint64 (which would wrap -1 to 2^64-1).
  const CLI::Validator non_negative_step(
      [](std::string& v) -> std::string {
        if (!v.empty() && v.front() == '-') return "step must be >= 0 (got " + v + ")";
        return "";
      },
      "STEP>=0");
  CLI::App* versions = app.add_subcommand("versions", "List a job's versions.");
  versions->add_option("JOB", job, "Job id")->required();
  add_watch(versions);
  CLI::App* inspect = app.add_subcommand("inspect", "Show one version shard by shard.");
  inspect->add_option("JOB", job, "Job id")->required();
  inspect->add_option("STEP", step, "Step")->check(non_negative_step)->required();

  CLI::App* create = app.add_subcommand("create-job", "Create a job.");
  uint32_t world_size = 0, flush_every = 0, keep_mem = 0, keep_durable = 0;
  ProtectionFlags create_protection;
  create->add_option("JOB", job, "Job id")->required();
  create->add_option("--world-size", world_size, "Number of ranks")
      ->required()
      ->check(CLI::PositiveNumber);
  create_protection.Add(create,
                        "No protection (local memory only). With no protection flag the server's default applies "
                        "(ckpt-meta --default-protection; auto: replicate 2 on two or more nodes, none on one)");
  create->add_option("--flush-every", flush_every, "Flush every Nth version to durable storage");
  create->add_option("--keep-in-memory", keep_mem, "Versions kept in memory");
  create->add_option("--keep-durable", keep_durable, "Versions kept on durable storage");

  bool force = false;
  CLI::App* flush = app.add_subcommand("flush", "Flush a version to durable storage.");
  flush->add_option("JOB", job, "Job id")->required();
  flush->add_option("STEP", step, "Step")->check(non_negative_step)->required();
  bool flush_wait = false;
  std::string wait_timeout;
  flush->add_flag("--wait", flush_wait, "Then wait until the version is PERSISTED");
  CLI::Option* flush_timeout =
      flush->add_option("--timeout", wait_timeout,
                        "With --wait: give up after DUR (30s, 5m, 1h; a plain number is seconds); default: no limit")
          ->type_name("DUR");
  CLI::App* wait_cmd = app.add_subcommand(
      "wait", "Wait until a version reaches a level: exit 0 then, 1 on timeout or if it can never get there.");
  std::string wait_level;
  wait_cmd->add_option("JOB", job, "Job id")->required();
  wait_cmd->add_option("STEP", step, "Step")->check(non_negative_step)->required();
  wait_cmd->add_option("LEVEL", wait_level, "staged, protected or persisted")
      ->check(CLI::IsMember({"staged", "protected", "persisted"}))
      ->required();
  CLI::Option* wait_timeout_opt =
      wait_cmd->add_option("--timeout", wait_timeout, "Give up after DUR (30s, 5m, 1h; a plain number is seconds); "
                                                      "default: no limit")
          ->type_name("DUR");
  CLI::App* del = app.add_subcommand("delete", "Delete a version.");
  del->add_option("JOB", job, "Job id")->required();
  del->add_option("STEP", step, "Step")->check(non_negative_step)->required();
  del->add_flag("--force", force, "Delete even if it is the newest protected version");

  bool delete_durable = false;
  CLI::App* del_job = app.add_subcommand(
      "delete-job", "Delete a job: every version DELETED, memory copies evicted (admin token).");
  del_job->add_option("JOB", job, "Job id")->required();
  del_job->add_flag("--delete-durable-files", delete_durable,
                    "Also delete its files in the durable tier (default: kept, readable with restore --from-dir)");

  uint32_t upd_keep_mem = 0, upd_keep_durable = 0, upd_flush_every = 0, upd_flush_seconds = 0;
  CLI::App* update_job = app.add_subcommand(
      "update-job",
      "Change a job's retention, flush or protection policy (admin token); flags left out keep their value. A "
      "lower --keep-in-memory evicts the oldest versions beyond it at once; a new protection applies to versions "
      "begun from now on (existing ones keep theirs).");
  update_job->add_option("JOB", job, "Job id")->required();
  CLI::Option* upd_keep_mem_opt =
      update_job->add_option("--keep-in-memory", upd_keep_mem, "Versions kept in memory (0: the default, 2)");
  CLI::Option* upd_keep_durable_opt =
      update_job->add_option("--keep-durable", upd_keep_durable, "Versions kept on durable storage (0: all)");
  CLI::Option* upd_flush_every_opt = update_job->add_option(
      "--flush-every", upd_flush_every, "Flush every Nth version to durable storage (0: not by count)");
  CLI::Option* upd_flush_seconds_opt = update_job->add_option(
      "--flush-every-seconds", upd_flush_seconds, "Flush a version when this many seconds passed since the last (0: not by time)");
  ProtectionFlags upd_protection;
  upd_protection.Add(update_job, "No protection (local memory only) for versions begun from now on");

  std::vector<uint32_t> failures = {1};
  CLI::App* placement_cmd =
      app.add_subcommand("placement", "Show a job's placement plan and its survival probability.");
  placement_cmd->add_option("JOB", job, "Job id")->required();
  placement_cmd->add_option("--failures", failures, "Numbers of simultaneous node failures (default 1)")
      ->type_name("F")
      ->expected(1, 64);

  std::string node;
  CLI::App* drain = app.add_subcommand(
      "drain", "Drain a node: no new data, its data re-protected elsewhere, then LEFT; it stays drained (also "
               "across agent restarts) until `undrain`.");
  drain->add_option("NODE", node, "Node id")->required();
  CLI::App* undrain = app.add_subcommand("undrain", "Put a drained node back into service.");
  undrain->add_option("NODE", node, "Node id")->required();
  CLI::App* remove_node =
      app.add_subcommand("remove-node", "Forget a DEAD or LEFT node (a later registration is a new node).");
  remove_node->add_option("NODE", node, "Node id")->required();

  std::string from_dir, out_dir;
  std::optional<uint32_t> restore_rank;
  CLI::App* restore = app.add_subcommand(
      "restore",
      "Write a version's rank files, verifying every checksum: `restore JOB STEP --out DIR [--rank R]` from "
      "the agents holding it, or `restore --from-dir PATH --out DIR` from a durable-tier directory with no "
      "daemon running.");
  restore->add_option("JOB", job, "Job id");
  CLI::Option* restore_step = restore->add_option("STEP", step, "Step")->check(non_negative_step);
  CLI::Option* from_opt =
      restore->add_option("--from-dir", from_dir, "Version directory <durable_root>/JOB/STEP");
  restore->add_option("--rank", restore_rank, "Only this rank");
  std::optional<uint32_t> reshard_world;
  std::vector<std::string> reshard_splits;
  restore->add_option("--world-size", reshard_world,
                      "Write the version resharded for this many ranks (its global tensors; docs/python.md "
                      "\"Another layout\"): from --from-dir, or JOB STEP from the agents' memory");
  restore->add_option("--split", reshard_splits,
                      "With --world-size: NAME=DIM, split global tensor NAME along DIM over the ranks "
                      "(repeatable; a tensor not named is written whole to every rank)");
  restore->add_option("--out", out_dir, "Output directory")->required();

  std::string agent_socket;
  {
    const char* env = std::getenv("CKPT_AGENT_SOCKET");
    agent_socket = env != nullptr && *env != '\0' ? env : "/run/ckpt/agent.sock";
  }
  std::string file;
  uint32_t save_rank = 0, save_world = 0;
  CLI::App* save = app.add_subcommand("save", "Store a file as one rank's shard (one item) through the local agent.");
  save->add_option("JOB", job, "Job id")->required();
  save->add_option("STEP", step, "Step")->check(non_negative_step)->required();
  save->add_option("FILE", file, "File to store")->required();
  save->add_option("--rank", save_rank, "Rank")->required();
  save->add_option("--world-size", save_world, "World size (needed to create the job; default: the job's)");
  save->add_option("--agent-socket", agent_socket,
                   "The local agent's socket (default: $CKPT_AGENT_SOCKET, else /run/ckpt/agent.sock)");

  CLI::App* holdings = app.add_subcommand("holdings", "What one node holds in its memory tier (from its agent).");
  std::string holdings_node, holdings_job;
  holdings->add_option("NODE", holdings_node, "Node id")->required();
  holdings->add_option("--job", holdings_job, "Only this job");
  CLI::App* verify = app.add_subcommand("verify", "Have every holder re-read a version and check its crcs.");
  verify->add_option("JOB", job, "Job id")->required();
  verify->add_option("STEP", step, "Step")->check(non_negative_step)->required();

  // `certs ...`: local files only, so dispatched before any TLS or token
  // setting is read.
  CertCommands certs(&app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    bool json = false;
    for (int i = 1; i < argc; ++i) json = json || std::string(argv[i]) == "--json";
    if (json && e.get_exit_code() != 0) {
      g_json_errors = true;
      return UsageError(e.what());
    }
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitUsage;
  }
  g_json_errors = g.json;
  SetJsonErrors(g.json);
  // Before any thread starts (gRPC's): they inherit SIGINT and SIGTERM
  // blocked, and the watcher removes the restore's temporary files.
  if (*restore) StartInterruptWatcher(g.json);
  g.meta = WithDefaultPort(g.meta);
  if (certs.chosen()) return certs.Run(g.json);
  // Every STEP argument, whatever the command: a step above 2^53-1 is a
  // usage error, refused before anything is sent.
  if (absl::Status s = ValidateStep(step); !s.ok()) {
    return UsageError(absl::StrCat("STEP: ", s.message()));
  }

  TlsFilesFromEnvironment(&g.tls);
  // ckpt's daemons serve mutual TLS only: a CA without a certificate can
  // never get through, and the handshake's failure would point at the CA.
  if (!g.tls.ca_file.empty() && g.tls.cert_file.empty() && g.tls.key_file.empty()) {
    return UsageError(
        "--tls-ca is set but no client certificate is: give --tls-cert and --tls-key (or CKPT_TLS_CERT, "
        "CKPT_TLS_KEY); ckpt-meta and the agents require one (mutual TLS). Make one with `ckptctl certs "
        "create-client --ca-dir DIR --role admin|operator --name NAME --out PREFIX` (docs/security.md)");
  }
  TlsFiles to_meta = g.tls;
  to_meta.expect_peer_uri = MetaPeerUri();  // only ckpt-meta's certificate, whatever its address
  if (absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> c = ChannelCredentials(to_meta); c.ok()) {
    g.credentials = *c;
  } else {
    return UsageError(std::string(c.status().message()));
  }
  if (absl::StatusOr<std::string> t = TokenFromEnvironment(g.token_file); t.ok()) {
    g.token = *t;
  } else {
    return UsageError(std::string(t.status().message()));
  }
  const ProgressMode progress = ChooseProgressMode(g.progress, g.quiet, g.json);
  DataOptions data{g.meta, agent_socket, g.timeout_s, g.json, g.credentials, g.token, g.tls, g.token_file, progress};
  // `wait` and `flush --wait`: DUR, or none (no limit).
  std::optional<absl::Duration> wait_limit;
  if (flush_timeout->count() > 0 || wait_timeout_opt->count() > 0) {
    wait_limit = ParseWaitTimeout(wait_timeout);
    if (!wait_limit) {
      return UsageError(absl::StrCat("--timeout: expected a duration such as 30s, 5m, 1h30m or a number of seconds; "
                                     "got '", wait_timeout, "'"));
    }
    if (*flush && !flush_wait) return UsageError("flush: --timeout needs --wait");
  }
  if (*restore) {
    if (from_opt->count() > 0) {
      if (!job.empty()) {
        return UsageError("restore takes either JOB STEP or --from-dir, not both");
      }
      if (reshard_world) {
        std::map<std::string, uint32_t> splits;
        if (int rc = ParseReshard(*reshard_world, reshard_splits, &splits); rc != 0) return rc;
        return RestoreResharded(data, from_dir, out_dir, *reshard_world, splits);
      }
      if (!reshard_splits.empty()) return UsageError("restore: --split needs --world-size");
      return RestoreFromDir(data, from_dir, out_dir);
    }
    if (job.empty() || restore_step->count() == 0) {
      return UsageError("restore needs JOB STEP (or --from-dir PATH)");
    }
    if (reshard_world) {
      if (restore_rank) return UsageError("restore: --world-size writes every new rank; --rank does not go with it");
      std::map<std::string, uint32_t> splits;
      if (int rc = ParseReshard(*reshard_world, reshard_splits, &splits); rc != 0) return rc;
      return RestoreOnlineResharded(data, job, step, out_dir, *reshard_world, splits);
    }
    return RestoreOnline(data, job, step, restore_rank, out_dir);
  }
  if (*save) return SaveFile(data, job, step, save_rank, save_world, file);
  if (*verify) return VerifyVersion(data, job, step);
  if (*holdings) return NodeHoldings(data, holdings_node, holdings_job);

  Ctl ctl(g);
  if ((*status || *versions) && watch) {
    std::optional<absl::Duration> interval = ParseWaitTimeout(watch_interval);
    if (!interval || *interval < absl::Milliseconds(100)) {
      return UsageError(absl::StrCat("--interval: expected a duration of at least 100ms such as 2s, 500ms or 1m; got '",
                                     watch_interval, "'"));
    }
    if (*status) {
      return ctl.Watch(status_job.empty() ? "status" : "status --job " + status_job, *interval, watch_count,
                       [&] { return ctl.Status(status_job); });
    }
    return ctl.Watch("versions " + job, *interval, watch_count, [&] { return ctl.Versions(job); });
  }
  if (!watch && std::any_of(watch_opts.begin(), watch_opts.end(), [](CLI::Option* o) { return o->count() > 0; })) {
    return UsageError("--interval and --count need --watch");
  }
  if (*status) return ctl.Status(status_job);
  if (*nodes) return ctl.Nodes();
  if (*jobs) return ctl.Jobs();
  if (*versions) return ctl.Versions(job);
  if (*inspect) return ctl.Inspect(job, step);
  if (*create) {
    v1::JobSpec spec;
    spec.set_job_id(job);
    spec.set_world_size(world_size);
    absl::StatusOr<std::optional<v1::ProtectionPolicy>> policy = create_protection.Policy();
    if (!policy.ok()) return UsageError(std::string(policy.status().message()));
    if (policy->has_value()) *spec.mutable_protection() = **policy;  // else the server's default applies
    spec.mutable_flush()->set_every_n_versions(flush_every);
    spec.mutable_retention()->set_keep_in_memory(keep_mem);
    spec.mutable_retention()->set_keep_durable(keep_durable);
    return ctl.CreateJob(spec);
  }
  if (*flush) {
    return ctl.Flush(job, step, flush_wait ? std::make_optional(wait_limit) : std::nullopt, progress);
  }
  if (*wait_cmd) {
    const v1::DurabilityLevel level = wait_level == "staged"      ? v1::DURABILITY_LEVEL_STAGED
                                      : wait_level == "protected" ? v1::DURABILITY_LEVEL_PROTECTED
                                                                  : v1::DURABILITY_LEVEL_PERSISTED;
    return ctl.Wait(job, step, level, wait_limit, progress);
  }
  if (*del) return ctl.Delete(job, step, force);
  if (*del_job) return ctl.DeleteJob(job, delete_durable);
  if (*update_job) {
    auto given = [](CLI::Option* o, uint32_t v) { return o->count() > 0 ? std::make_optional(v) : std::nullopt; };
    if (upd_keep_mem_opt->count() + upd_keep_durable_opt->count() + upd_flush_every_opt->count() +
                upd_flush_seconds_opt->count() ==
            0 &&
        !upd_protection.Given()) {
      return UsageError("update-job: give at least one of --keep-in-memory, --keep-durable, --flush-every, "
                        "--flush-every-seconds, --replicate, --ec, --no-protection");
    }
    absl::StatusOr<std::optional<v1::ProtectionPolicy>> policy = upd_protection.Policy();
    if (!policy.ok()) return UsageError(std::string(policy.status().message()));
    return ctl.UpdateJob(job, given(upd_keep_mem_opt, upd_keep_mem), given(upd_keep_durable_opt, upd_keep_durable),
                         given(upd_flush_every_opt, upd_flush_every), given(upd_flush_seconds_opt, upd_flush_seconds),
                         *policy);
  }
  if (*drain) return ctl.Drain(node);
  if (*undrain) return ctl.Undrain(node);
  if (*remove_node) return ctl.RemoveNode(node);
  if (*placement_cmd) return ctl.Placement(job, failures);
  return kExitUsage;
}

}  // namespace
}  // namespace ckpt::cli

int main(int argc, char** argv) { return ckpt::cli::Main(argc, argv); }
