// In-process cost of MetaCore::ReportShards (no gRPC, in-memory store): the
// domain work per shard report, to separate it from RPC and fsync costs in
// meta_report_bench.
#include <benchmark/benchmark.h>

#include "server/meta/meta_core.h"
#include "server/meta/store/mem_meta_store.h"

namespace ckpt::meta {
namespace {

void BM_StagedReports(benchmark::State& state) {
  const int nodes = 128, per_node = 8, ranks = nodes * per_node;
  auto store = NewMemMetaStore();
  FakeClock clock;
  auto core = std::move(MetaCore::Open(store.get(), &clock).value());
  std::vector<uint64_t> inc(nodes);
  for (int n = 0; n < nodes; ++n) {
    RegisterRequest r;
    r.node_id = "node-" + std::to_string(n);
    r.grpc_address = r.node_id + ":1";
    r.data_address = r.node_id + ":2";
    inc[n] = core->RegisterNode(r).value().incarnation;
  }
  JobSpec spec;
  spec.job_id = "bench";
  spec.world_size = ranks;
  spec.protection = ProtectionPolicy::None();
  (void)core->CreateJob(spec, false).value();
  uint64_t step = 0;
  for (auto _ : state) {
    ++step;
    (void)core->BeginVersion("bench", step, "").value();
    for (int n = 0; n < nodes; ++n) {
      std::vector<ShardReport> reports;
      for (int k = 0; k < per_node; ++k) {
        ShardReport r;
        r.kind = ShardReport::Kind::kStaged;
        r.staged.job_id = "bench";
        r.staged.step = step;
        Shard& s = r.staged.shard;
        s.rank = n * per_node + k;
        s.size_bytes = 64 << 20;
        s.crc32c = s.rank;
        for (int i = 0; i < 4; ++i) {
          Item it;
          it.name = "layer." + std::to_string(i) + ".weight";
          it.dtype = 3;
          it.shape = {8 << 20};
          it.offset_bytes = uint64_t(i) * (16 << 20);
          it.length_bytes = 16 << 20;
          s.items.push_back(it);
        }
        reports.push_back(std::move(r));
      }
      auto res = core->ReportShards("node-" + std::to_string(n), inc[n], reports);
      if (!res.ok()) state.SkipWithError("report failed");
    }
  }
  state.SetItemsProcessed(state.iterations() * ranks);
}
BENCHMARK(BM_StagedReports)->Unit(benchmark::kMillisecond)->Iterations(20);

}  // namespace
}  // namespace ckpt::meta

BENCHMARK_MAIN();
