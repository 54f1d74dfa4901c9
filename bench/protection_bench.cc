// protection_bench: how fast versions become PROTECTED across real agents,
// and how fast a lost rank comes back from a peer or through decode, against
// this machine's UCX tag bandwidth (ucx_perftest) and memcpy measured in the
// same run.
//
// For each policy it starts ckpt-meta and N ckpt-agent processes on
// 127.0.0.1 (memory tiers on /dev/shm), one rank per node, and:
//   - saves one version (S bytes per node) from all ranks, back to back, and
//     times commit -> PROTECTED; per-node protection bandwidth = S / time;
//     then a second version the same way (steady state);
//   - reports each save's blocking time as a ratio to one memcpy of S (the
//     later ranks save while earlier ranks' protection runs);
//   - reports the memory tier bytes used per node after PROTECTED, against
//     what replicate{3} would hold (3 S) for the same two tolerated losses;
//   - restores one rank through a node without a copy: from a peer replica
//     (replicate), or, after kill -9 of its node, by decode (ec).
// The baseline is `ucx_perftest -t tag_bw` with 256 MiB messages, run inside
// a private network namespace (unshare -n, loopback only) with the same
// UCX_TLS as the agents. Without unshare rights it says so and prints "n/a".
//
// --security runs each policy once per mode, in the same run: "mac" (as
// shipped: mutual TLS, and the data-plane key meta hands out, so every
// data-plane message is authenticated), "encrypt" (the same with
// --data-encryption true on every agent) and "off" (every daemon
// --insecure: no TLS, no data-plane key, nothing authenticated; what ckpt
// did before issue 34). Rows are named <policy>/<mode>.
//
// --pin true runs the agents on half of the CPUs (ckpt-agent --cpus) and
// the bench, which plays every trainer, on the other half (rows named
// <policy>/<mode>/pinned): how much of the save's blocking is the agents
// taking the trainers' CPUs.
//
//   protection_bench [--size 512MiB] [--tls tcp|default] [--policies ring,ec] [--security mac] [--pin true]
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/bench_support.h"
#include "ckpt/client.h"
#include "common/config.h"
#include "common/cpu_affinity.h"
#include "integration/agent_process.h"
#include "integration/meta_process.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using testing::AgentProcess;
using testing::AgentProcessOptions;
using testing::MetaProcess;

using bench::Buffer;
using bench::Seconds;
double GBps(uint64_t bytes, double s) { return s > 0 ? bytes / s / 1e9 : 0; }


std::function<void()> g_cleanup = [] {};

void Die(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "protection_bench: %s: %s\n", what, s.ToString().c_str());
  g_cleanup();
  std::exit(1);
}

// ucx_perftest tag bandwidth in GB/s over loopback in a private namespace, or
// a negative value if it cannot run here.
double PerftestGBps(const std::string& tls) {
  const int port = 20000 + static_cast<int>(::getpid() % 20000);
  const std::string env = tls == "default" ? "" : absl::StrCat("UCX_TLS=", tls, " ");
  const std::string cmd = absl::StrCat(
      "timeout 120 unshare -n sh -c 'ip link set lo up && ", env, "ucx_perftest -p ", port,
      " -t tag_bw -s 268435456 -n 16 -w 4 >/dev/null 2>&1 & sleep 1; ", env, "ucx_perftest 127.0.0.1 -p ", port,
      " -t tag_bw -s 268435456 -n 16 -w 4 2>&1; wait' 2>&1");
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char line[512];
  double mbs = -1;
  while (std::fgets(line, sizeof(line), p) != nullptr) {
    if (std::strncmp(line, "Final:", 6) != 0) continue;
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    // Final: iters p50 avg overall bw_avg bw_overall ...
    if (f.size() >= 7) mbs = std::atof(f[6].c_str());
  }
  ::pclose(p);
  return mbs < 0 ? -1 : mbs * (1 << 20) / 1e9;  // ucx_perftest's MB is MiB
}

struct Cluster {
  std::unique_ptr<testing::TempDir> tmp;
  std::unique_ptr<MetaProcess> meta;
  std::vector<std::unique_ptr<AgentProcess>> agents;
  std::vector<std::string> shm_dirs;

  ~Cluster() {
    agents.clear();
    meta.reset();
    std::error_code ec;
    for (const auto& d : shm_dirs) std::filesystem::remove_all(d, ec);
    if (tmp && std::getenv("CKPT_BENCH_KEEP") == nullptr) std::filesystem::remove_all(tmp->path(), ec);
  }
};

// --pin: the CPUs the agents run on (ckpt-agent --cpus); the bench itself,
// which plays every trainer, runs on the others.
std::string g_agent_cpus;
std::vector<int> g_trainer_cpus;

// While alive (with --pin), this process's threads run on g_trainer_cpus
// only; the agents, started before, keep theirs.
class PinTrainers {
 public:
  PinTrainers() {
    if (g_trainer_cpus.empty()) return;
    all_ = AllowedCpus();
    Die(SetAffinityOfEveryThread(g_trainer_cpus), "pin the trainers");
  }
  ~PinTrainers() {
    if (!all_.empty()) (void)SetAffinityOfEveryThread(all_);
  }

 private:
  std::vector<int> all_;
};

std::unique_ptr<Cluster> StartCluster(int n, uint64_t memory, const std::string& security) {
  const bool insecure = security == "off";
  if (insecure) {
    // The bench's own clients then call the insecure meta in plaintext.
    for (const char* v : {"CKPT_TLS_CA", "CKPT_TLS_CERT", "CKPT_TLS_KEY"}) ::unsetenv(v);
  }
  auto c = std::make_unique<Cluster>();
  absl::StatusOr<testing::TempDir> tmp = testing::TempDir::Create();
  Die(tmp.status(), "temp dir");
  c->tmp = std::make_unique<testing::TempDir>(*std::move(tmp));
  const char* keep = std::getenv("CKPT_BENCH_KEEP");
  if (keep != nullptr) std::filesystem::create_directories(keep);
  absl::StatusOr<std::unique_ptr<MetaProcess>> meta =
      MetaProcess::Start(*c->tmp->Sub("meta"), keep != nullptr ? keep : c->tmp->path(), 5000, insecure);
  Die(meta.status(), "start ckpt-meta");
  c->meta = *std::move(meta);
  for (int i = 0; i < n; ++i) {
    AgentProcessOptions o;
    o.node_id = absl::StrCat("n", i);
    o.meta_address = c->meta->address();
    o.dir = *c->tmp->Sub(o.node_id);
    if (keep != nullptr) {
      o.dir = absl::StrCat(keep, "/", o.node_id);  // logs kept for a look at the timeline
      std::filesystem::create_directories(o.dir);
    }
    o.memory = absl::StrCat(memory >> 20, "MiB");
    o.memory_dir = absl::StrCat("/dev/shm/ckpt-pbench-", ::getpid(), "-", i);
    const char* level = std::getenv("CKPT_BENCH_LOG_LEVEL");  // e.g. info, to see the timeline
    o.extra_args = {"--log-level", level != nullptr ? level : "warn"};
    o.insecure = insecure;
    if (security == "encrypt") o.extra_args.insert(o.extra_args.end(), {"--data-encryption", "true"});
    if (!g_agent_cpus.empty()) o.extra_args.insert(o.extra_args.end(), {"--cpus", g_agent_cpus});
    c->shm_dirs.push_back(o.memory_dir);
    absl::StatusOr<std::unique_ptr<AgentProcess>> a = AgentProcess::Start(o);
    Die(a.status(), "start ckpt-agent");
    c->agents.push_back(*std::move(a));
  }
  return c;
}

uint64_t UsedBytes(AgentProcess& a) {
  v1::AgentStatusResponse st;
  grpc::ClientContext ctx;
  if (!a.stub()->AgentStatus(&ctx, {}, &st).ok()) return 0;
  return st.memory_used_bytes();
}

void Row(const std::string& policy, const std::string& what, double value, const char* unit,
         const std::string& ratio) {
  std::printf("%-20s %-46s %10.3f %-5s %s\n", policy.c_str(), what.c_str(), value, unit, ratio.c_str());
}

std::string Ratio(double r, const char* of) { return r > 0 ? absl::StrFormat("%.2fx %s", r, of) : "n/a"; }

void RunPolicy(const std::string& policy, const std::string& security, Protection protection, int nodes,
               uint64_t size, double memcpy_s, double perf_gbps) {
  const std::string name = absl::StrCat(policy, "/", security, g_agent_cpus.empty() ? "" : "/pinned");
  const bool ec = protection.kind == Protection::Kind::kErasureCode;
  // Room for two versions in flight plus their redundancy plus a restore.
  const double redundancy = ec ? static_cast<double>(protection.parity_m) / protection.data_k
                               : static_cast<double>(protection.copies - 1);
  const uint64_t memory = static_cast<uint64_t>((2 * (1 + redundancy) + 1.2) * size) + (64 << 20);
  std::unique_ptr<Cluster> c = StartCluster(nodes, memory, security);
  g_cleanup = [&c] { c.reset(); };
  PinTrainers pinned;

  std::vector<std::unique_ptr<Buffer>> src;
  for (int r = 0; r < nodes; ++r) {
    src.push_back(std::make_unique<Buffer>(size));
    std::mt19937_64 rng(r + 1);
    auto* w = reinterpret_cast<uint64_t*>(src.back()->data);
    for (size_t i = 0; i < size / 8; ++i) w[i] = rng();
  }
  std::vector<Client> clients;
  for (int r = 0; r < nodes; ++r) {
    ClientOptions o;
    o.meta_address = c->meta->address();
    o.agent_socket = c->agents[r]->socket_path();
    o.job_id = policy;
    o.rank = r;
    o.world_size = nodes;
    o.protection = protection;
    o.keep_in_memory = 1;
    absl::StatusOr<Client> cl = Client::Connect(o);
    Die(cl.status(), "connect");
    clients.push_back(*std::move(cl));
  }
  const uint64_t last_step = 4;
  // Versions 1 and 2 land on pool pages untouched since the agents started
  // (this VM reclaims idle memory: fresh pages run at ~0.4 GB/s); from
  // version 3 on they reuse the pages version 1 freed (steady state).
  for (uint64_t step = 1; step <= last_step; ++step) {
    const std::string phase = step <= 2 ? absl::StrCat("v", step, " (cold pages)") : absl::StrCat("v", step, " (steady)");
    std::vector<double> blocking;
    std::vector<SaveHandle> handles;
    for (int r = 0; r < nodes; ++r) {
      const absl::Time t0 = absl::Now();
      SaveBuilder s = clients[r].BeginSave(step);
      Die(s.Add("state", std::span<const std::byte>(src[r]->data, size), DType::kU8, {size}), "add");
      absl::StatusOr<SaveHandle> h = s.Commit();
      Die(h.status(), "commit");
      blocking.push_back(Seconds(absl::Now() - t0));
      handles.push_back(*h);
    }
    const absl::Time committed = absl::Now();
    for (SaveHandle& h : handles) Die(h.Wait(Level::kProtected, absl::Now() + absl::Seconds(600)), "protect");
    const double t = Seconds(absl::Now() - committed);
    std::sort(blocking.begin(), blocking.end());
    Row(name, absl::StrCat("save blocking, ", phase, " (max of ", nodes, " ranks)"), blocking.back(), "s",
        Ratio(blocking.back() / memcpy_s, "memcpy"));
    Row(name, absl::StrCat("last commit -> PROTECTED, ", phase), t, "s", "");
    const double bw = GBps(size, t);
    Row(name, absl::StrCat("protection bandwidth per node, ", phase), bw, "GB/s",
        perf_gbps > 0 ? Ratio(bw / perf_gbps, "ucx_perftest") : "n/a");
    // What crossed the network in that time, all nodes together: replicas
    // send copies-1 blobs per node, EC sends m blobs per node.
    const double per_node = ec ? protection.parity_m : protection.copies - 1;
    const double agg = GBps(static_cast<uint64_t>(size * per_node * nodes), t);
    Row(name, absl::StrCat("aggregate network bandwidth, ", phase), agg, "GB/s",
        perf_gbps > 0 ? Ratio(agg / perf_gbps, "ucx_perftest") : "n/a");
  }
  uint64_t used = 0;
  for (auto& a : c->agents) used = std::max(used, UsedBytes(*a));
  // keep_in_memory=1: after step 2 is PROTECTED, step 1 is evicted; allow a moment.
  absl::SleepFor(absl::Seconds(1));
  used = 0;
  for (auto& a : c->agents) used = std::max(used, UsedBytes(*a));
  Row(name, "memory tier used per node (max), one version", used / 1e9, "GB",
      absl::StrFormat("%.2fx S; replicate{3}: 3.00x", static_cast<double>(used) / size));

  // Restore rank 1 through a node without a copy of it.
  const int via = ec ? 2 : 3;
  if (ec) {
    Die(c->agents[1]->proc()->Kill(), "kill");
    (void)c->agents[1]->proc()->Wait();
  }
  ClientOptions o;
  o.meta_address = c->meta->address();
  o.agent_socket = c->agents[via]->socket_path();
  o.job_id = policy;
  o.rank = 1;
  o.world_size = nodes;
  o.protection = protection;
  absl::StatusOr<Client> reader = Client::Connect(o);
  Die(reader.status(), "connect reader");
  const absl::Time t0 = absl::Now();
  absl::StatusOr<LoadedShard> shard = reader->Load(last_step);
  const double t = Seconds(absl::Now() - t0);
  Die(shard.status(), "restore");
  absl::StatusOr<std::span<const std::byte>> view = shard->View("state");
  Die(view.status(), "view");
  if (view->size() != size || std::memcmp(view->data(), src[1]->data, size) != 0) {
    Die(absl::DataLossError("restored bytes differ"), "restore");
  }
  const double bw = GBps(size, t);
  Row(name, absl::StrCat("restore 1 rank (", ServedFromName(shard->served_from()), ")"), bw, "GB/s",
      perf_gbps > 0 ? Ratio(bw / perf_gbps, "ucx_perftest") : "n/a");
  g_cleanup = [] {};
}

}  // namespace
}  // namespace ckpt

int main(int argc, char** argv) {
  uint64_t size = uint64_t{512} << 20;
  std::string tls = "tcp";
  std::vector<std::string> policies = {"ring", "ec"};
  std::vector<std::string> security = {"mac"};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--size") {
      absl::StatusOr<uint64_t> b = ckpt::ParseBytes(value);
      if (!b.ok()) {
        std::fprintf(stderr, "protection_bench: %s\n", b.status().ToString().c_str());
        return 2;
      }
      size = *b;
    } else if (flag == "--tls") {
      tls = value;
    } else if (flag == "--policies") {
      policies = absl::StrSplit(value, ',');
    } else if (flag == "--pin") {
      if (value != "true" && value != "false") {
        std::fprintf(stderr, "protection_bench: --pin takes true or false\n");
        return 2;
      }
      if (value == "true") {
        // The trainers (this process, while a policy runs) on the first
        // half of the CPUs it may use, the agents on the rest: 0 and 1 on a
        // 2-core machine.
        const std::vector<int> cpus = ckpt::AllowedCpus();
        if (cpus.size() < 2) {
          std::fprintf(stderr, "protection_bench: --pin needs 2 CPUs or more\n");
          return 2;
        }
        const size_t half = cpus.size() / 2;
        ckpt::g_agent_cpus = ckpt::FormatCpuList(std::vector<int>(cpus.begin() + half, cpus.end()));
        ckpt::g_trainer_cpus.assign(cpus.begin(), cpus.begin() + half);
        std::printf("protection_bench: trainers on CPUs %s, agents on %s (--pin)\n",
                    ckpt::FormatCpuList(ckpt::g_trainer_cpus).c_str(), ckpt::g_agent_cpus.c_str());
      }
    } else if (flag == "--security") {
      security = absl::StrSplit(value, ',');
      for (const std::string& s : security) {
        if (s != "off" && s != "mac" && s != "encrypt") {
          std::fprintf(stderr, "protection_bench: --security takes off, mac, encrypt (not %s)\n", s.c_str());
          return 2;
        }
      }
    } else {
      std::fprintf(stderr,
                   "usage: protection_bench [--size 512MiB] [--tls tcp|default] [--policies ring,ec] "
                   "[--security off,mac,encrypt] [--pin false|true]\n");
      return 2;
    }
  }
  if (tls != "default") ::setenv("UCX_TLS", tls.c_str(), 1);  // the agents inherit it
  // Memory tiers left by an earlier run that was killed (they hold real
  // memory on the tmpfs): remove those whose process is gone.
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("ckpt-pbench-", 0) != 0) continue;
    const int pid = std::atoi(name.c_str() + 12);
    if (pid > 0 && ::kill(pid, 0) != 0) std::filesystem::remove_all(e.path(), ec);
  }
  const double perf = ckpt::PerftestGBps(tls);
  double memcpy_s;
  {
    ckpt::bench::Buffer a(size), b(size);
    std::memset(a.data, 1, size);
    std::vector<double> t;
    for (int i = 0; i < 5; ++i) {
      const absl::Time t0 = absl::Now();
      std::memcpy(b.data, a.data, size);
      t.push_back(ckpt::bench::Seconds(absl::Now() - t0));
    }
    std::sort(t.begin(), t.end());
    memcpy_s = t[2];
  }
  std::printf("protection_bench: S = %.0f MiB per node, UCX_TLS=%s\n", size / double(1 << 20), tls.c_str());
  std::printf("%-20s %-46s %10.3f %-5s\n", "baseline", "memcpy of S", memcpy_s, "s");
  if (perf > 0) {
    std::printf("%-20s %-46s %10.3f %-5s\n", "baseline", "ucx_perftest tag_bw, 256 MiB messages", perf, "GB/s");
  } else {
    std::printf("%-20s %-46s %10s\n", "baseline", "ucx_perftest (needs unshare -n)", "n/a");
  }
  for (const std::string& p : policies) {
    for (const std::string& sec : security) {
      if (p == "ring") {
        ckpt::RunPolicy("replicate2", sec, ckpt::Protection::Replicate(2, ckpt::Protection::Placement::kRing), 4,
                        size, memcpy_s, perf);
      } else if (p == "group") {
        ckpt::RunPolicy("group2", sec, ckpt::Protection::Replicate(2, ckpt::Protection::Placement::kGroup), 4,
                        size, memcpy_s, perf);
      } else if (p == "ec") {
        ckpt::RunPolicy("ec4-2", sec, ckpt::Protection::ErasureCode(4, 2), 6, size, memcpy_s, perf);
      } else {
        std::fprintf(stderr, "protection_bench: unknown policy %s (ring, group, ec)\n", p.c_str());
        return 2;
      }
    }
  }
  return 0;
}
