// Shard reports per second and per-report latency through a real ckpt-meta
// process (gRPC, RocksDB with sync, group commit), with 1,024 ranks reporting
// concurrently: 128 registered nodes x 8 ranks, several versions in a row,
// async gRPC client. Three modes: every rank sends its STAGED report as its own
// ReportShards call, all 1,024 in flight at once (burst: latency is mostly
// queueing behind the other 1,023); the 8 ranks of a node batched into one call
// as an agent does (burst); and one report per call offered at a steady 20,000
// reports/s (the goal rate: p99 here is the latency a report sees at that load).
//
//   build/bench/meta_report_bench [versions=20] [replicas=0] [nodes=128]
//
// nodes: registered nodes of 8 ranks each (2048: the 16,384 ranks of a large
// job; the burst modes then have 16,384 or 2,048 calls in flight).
//
// replicas > 0: ckpt-meta runs as that many replicas (--replica-of) on a
// single-member etcd the benchmark starts (/usr/bin/etcd), the first one
// leading: every acknowledged change also went through etcd (docs/meta.md
// "Replicas on etcd"). 0: one meta with its RocksDB only.
//
// Prints reports/s and p50/p99 latency per mode, next to the goal
// (>= 20,000 reports/s, p99 < 10 ms on this 2-core machine). Then the cost of
// answering only from durable state (docs/meta.md): GetVersion latency with
// meta idle, and while the last mode's reports (and their group commits) flow,
// when every read waits for the fsync of the newest change it could see.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "integration/meta_process.h"
#if !CKPT_NO_ETCD_TEST_SERVER
#include "server/meta/etcd/etcd_test_server.h"
#endif
#include "support/temp_dir.h"

namespace v1 = ckpt::v1;
using Clock = std::chrono::steady_clock;

namespace {

int kNodes = 128;  // argv[3]
constexpr int kRanksPerNode = 8;
int kRanks = kNodes * kRanksPerNode;

v1::ShardReport Staged(uint64_t step, uint32_t rank) {
  v1::ShardReport r;
  auto* s = r.mutable_staged()->mutable_shard();
  s->mutable_key()->set_job_id("bench");
  s->mutable_key()->set_step(step);
  s->mutable_key()->set_rank(rank);
  s->set_size_bytes(64 << 20);
  s->set_crc32c(rank * 2654435761u);
  s->set_manifest_digest(rank + 1);
  for (int i = 0; i < 4; ++i) {
    auto* item = s->add_items();
    item->set_name("layer." + std::to_string(i) + ".weight");
    item->set_dtype(v1::DTYPE_BF16);
    item->add_shape(8 << 20);
    item->set_offset_bytes(uint64_t(i) * (16 << 20));
    item->set_length_bytes(16 << 20);
  }
  return r;
}

struct Call {
  v1::ReportShardsResponse resp;
  grpc::Status status;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientAsyncResponseReader<v1::ReportShardsResponse>> reader;
  Clock::time_point start;
  int reports = 0;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

}  // namespace

int main(int argc, char** argv) {
  const int versions = argc > 1 ? std::atoi(argv[1]) : 20;
  const int replicas = argc > 2 ? std::atoi(argv[2]) : 0;
  if (argc > 3) {
    kNodes = std::atoi(argv[3]);
    if (kNodes < 1 || kNodes > 65536) {
      std::fprintf(stderr, "nodes must be 1..65536, got %s\n", argv[3]);
      return 2;
    }
    kRanks = kNodes * kRanksPerNode;
  }
  auto dir = ckpt::testing::TempDir::Create();
  if (!dir.ok()) return 1;
  std::vector<std::string> replica_args;
#if CKPT_NO_ETCD_TEST_SERVER
  if (replicas > 0) {
    std::fprintf(stderr, "built without etcd's protos: no replicas\n");
    return 1;
  }
#else
  std::unique_ptr<ckpt::testing::EtcdTestServer> etcd;
  if (replicas > 0) {
    auto e = ckpt::testing::EtcdTestServer::Start(*dir->Sub("etcd"));
    if (!e.ok()) {
      std::fprintf(stderr, "cannot start etcd: %s\n", e.status().ToString().c_str());
      return 1;
    }
    etcd = std::move(*e);
    replica_args = {"--replica-of", "etcd://" + etcd->endpoint() + "/ckpt/bench", "--etcd-plaintext"};
  }
#endif
  auto meta = ckpt::testing::MetaProcess::Start(*dir->Sub("data"), *dir->Sub("logs"),
                                                /*lease_ms=*/600000, /*insecure=*/false, replica_args);
  if (!meta.ok()) {
    std::fprintf(stderr, "cannot start ckpt-meta: %s\n", meta.status().ToString().c_str());
    return 1;
  }
  // The followers, once the first leads: each applies the log as it grows
  // (killed by PID when the benchmark ends).
  std::vector<std::unique_ptr<ckpt::testing::Subprocess>> followers;
  for (int i = 1; i < replicas; ++i) {
    auto ports = ckpt::testing::PickFreePorts(2);
    if (!ports.ok()) return 1;
    const ckpt::testing::TlsFilePaths tls = ckpt::testing::TestPki::Shared().Meta();
    ckpt::testing::SubprocessOptions o;
    o.argv = {ckpt::testing::BinaryPath("ckpt-meta"), "--listen", "127.0.0.1:" + std::to_string((*ports)[0]),
              "--metrics-listen", "127.0.0.1:" + std::to_string((*ports)[1]), "--data-dir",
              *dir->Sub("data" + std::to_string(i)), "--tls-ca", tls.ca, "--tls-cert", tls.cert, "--tls-key", tls.key};
    o.argv.insert(o.argv.end(), replica_args.begin(), replica_args.end());
    o.name = "ckpt-meta-" + std::to_string(i);
    o.log_dir = *dir->Sub("logs");
    auto p = ckpt::testing::Subprocess::Start(o);
    if (!p.ok()) return 1;
    followers.push_back(std::move(*p));
  }
  auto* stub = (*meta)->stub();
  std::vector<uint64_t> inc(kNodes);
  for (int n = 0; n < kNodes; ++n) {
    v1::RegisterNodeRequest req;
    req.set_node_id("node-" + std::to_string(n));
    req.set_grpc_address("127.0.0.1:" + std::to_string(20000 + n));
    req.set_data_address("127.0.0.1:" + std::to_string(30000 + n));
    req.set_role(v1::NODE_ROLE_HOST);
    req.set_memory_capacity_bytes(uint64_t{64} << 30);
    v1::RegisterNodeResponse resp;
    grpc::ClientContext ctx;
    // As that node: meta takes a node's calls only from its own certificate.
    if (!(*meta)->NodeStub(req.node_id())->RegisterNode(&ctx, req, &resp).ok()) return 1;
    inc[n] = resp.incarnation();
  }
  {
    v1::CreateJobRequest req;
    req.mutable_spec()->set_job_id("bench");
    req.mutable_spec()->set_world_size(kRanks);
    req.mutable_spec()->mutable_protection()->mutable_none();
    v1::CreateJobResponse resp;
    grpc::ClientContext ctx;
    auto st = stub->CreateJob(&ctx, req, &resp);
    if (!st.ok()) {
      std::fprintf(stderr, "CreateJob: %s\n", st.error_message().c_str());
      return 1;
    }
  }

  uint64_t step = 0;
  std::printf("ckpt-meta report benchmark: %d nodes x %d ranks = %d ranks, %d versions per mode, %s\n",
              kNodes, kRanksPerNode, kRanks, versions,
              replicas == 0 ? "one meta (RocksDB)" : (std::to_string(replicas) + " replicas on etcd").c_str());
  std::printf("%-44s %12s %10s %10s\n", "mode", "reports/s", "p50 ms", "p99 ms");
  struct Mode {
    std::string name;
    int batch;
    double rate;  // reports/s offered; 0 = all calls at once
  };
  const Mode modes[] = {
      {"burst: " + std::to_string(kRanks) + " calls at once, 1 report each", 1, 0},
      {"burst: " + std::to_string(kNodes) + " calls at once, 8 reports each", kRanksPerNode, 0},
      {"paced: 20,000 reports/s offered, 1 each", 1, 20000},
      {"paced: 20,000 reports/s offered, 8 per call", kRanksPerNode, 20000},
  };
  // Reads of the newest version, one at a time, while `reading` holds.
  std::atomic<bool> reading{false};
  std::atomic<uint64_t> read_step{0};
  std::vector<double> read_ms;
  auto read_loop = [&] {
    while (reading.load()) {
      v1::GetVersionRequest req;
      req.set_job_id("bench");
      req.set_step(read_step.load());
      v1::GetVersionResponse resp;
      grpc::ClientContext ctx;
      const auto t = Clock::now();
      grpc::Status st = stub->GetVersion(&ctx, req, &resp);
      if (!st.ok()) continue;
      read_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t).count());
    }
  };
  std::thread reader;
  struct StopReader {  // so that an early return never leaves it joinable
    std::atomic<bool>& flag;
    std::thread& thread;
    ~StopReader() {
      flag = false;
      if (thread.joinable()) thread.join();
    }
  } stop_reader{reading, reader};
  for (const Mode& mode : modes) {
    const int batch = mode.batch;
    if (&mode == &modes[std::size(modes) - 1]) {  // reads during the last mode
      read_step = step;
      reading = true;
      reader = std::thread(read_loop);
    }
    std::vector<double> latencies_ms;
    uint64_t reports = 0;
    double seconds = 0;
    for (int v = 0; v < versions; ++v) {
      ++step;
      if (step > 1) read_step = step - 1;
      {
        v1::BeginVersionRequest req;
        req.set_job_id("bench");
        req.set_step(step);
        v1::BeginVersionResponse resp;
        grpc::ClientContext ctx;
        if (!(*meta)->NodeStub("node-0")->BeginVersion(&ctx, req, &resp).ok()) return 1;
      }
      grpc::CompletionQueue cq;
      std::vector<std::unique_ptr<Call>> calls;
      // Build every request first so the timed part is the RPCs only.
      std::vector<v1::ReportShardsRequest> reqs;
      for (int n = 0; n < kNodes; ++n) {
        for (int first = 0; first < kRanksPerNode; first += batch) {
          v1::ReportShardsRequest req;
          req.set_node_id("node-" + std::to_string(n));
          req.set_incarnation(inc[n]);
          for (int r = first; r < first + batch; ++r) {
            *req.add_reports() = Staged(step, n * kRanksPerNode + r);
          }
          reqs.push_back(std::move(req));
        }
      }
      calls.reserve(reqs.size());
      std::map<std::string, v1::MetaService::Stub*> node_stubs;  // made before the timed part
      for (const v1::ReportShardsRequest& r : reqs) node_stubs[r.node_id()] = (*meta)->NodeStub(r.node_id());
      for (size_t i = 0; i < reqs.size(); ++i) calls.push_back(std::make_unique<Call>());
      // Completions are drained on their own thread so that pacing is not
      // disturbed by them.
      bool failed = false;
      std::thread drain([&] {
        for (size_t done = 0; done < calls.size(); ++done) {
          void* tag;
          bool ok;
          if (!cq.Next(&tag, &ok)) {
            failed = true;
            return;
          }
          auto* c = static_cast<Call*>(tag);
          const double ms =
              std::chrono::duration<double, std::milli>(Clock::now() - c->start).count();
          if (!c->status.ok()) {
            std::fprintf(stderr, "ReportShards: %s\n", c->status.error_message().c_str());
            failed = true;
            continue;
          }
          for (const auto& r : c->resp.results()) {
            if (r.code() != 0) {
              std::fprintf(stderr, "report rejected: %s\n", r.message().c_str());
              failed = true;
            }
          }
          latencies_ms.push_back(ms);
          reports += c->reports;
        }
      });
      const auto t0 = Clock::now();
      for (size_t i = 0; i < reqs.size(); ++i) {
        if (mode.rate > 0) {
          std::this_thread::sleep_until(
              t0 + std::chrono::duration_cast<Clock::duration>(
                       std::chrono::duration<double>(i * batch / mode.rate)));
        }
        Call* c = calls[i].get();
        c->start = Clock::now();
        c->reports = reqs[i].reports_size();
        c->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
        c->reader = node_stubs[reqs[i].node_id()]->AsyncReportShards(&c->ctx, reqs[i], &cq);
        c->reader->Finish(&c->resp, &c->status, c);
      }
      drain.join();
      if (failed) return 1;
      seconds += std::chrono::duration<double>(Clock::now() - t0).count();
      cq.Shutdown();
      void* tag;
      bool ok;
      while (cq.Next(&tag, &ok)) {
      }
    }
    std::printf("%-44s %12.0f %10.2f %10.2f\n", mode.name.c_str(), reports / seconds,
                Percentile(latencies_ms, 0.50), Percentile(latencies_ms, 0.99));
  }
  std::printf("goal: >= 20000 reports/s, p99 < 10 ms\n");
  reading = false;
  reader.join();
  const std::vector<double> busy = std::move(read_ms);
  read_ms.clear();
  reading = true;
  reader = std::thread(read_loop);
  std::this_thread::sleep_for(std::chrono::seconds(2));  // idle meta: only these reads
  reading = false;
  reader.join();
  std::printf("GetVersion, meta idle:                      %8zu reads   p50 %.3f ms  p99 %.3f ms\n",
              read_ms.size(), Percentile(read_ms, 0.50), Percentile(read_ms, 0.99));
  std::printf("GetVersion, during the last mode's reports: %8zu reads   p50 %.3f ms  p99 %.3f ms\n",
              busy.size(), Percentile(busy, 0.50), Percentile(busy, 0.99));
  return 0;
}
