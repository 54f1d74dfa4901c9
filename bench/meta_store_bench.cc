// Commit throughput and latency of the RocksDB MetaStore under 1, 8 and 64
// concurrent committers, showing group commit: every Commit() waits for its
// own fsync, yet N committers share one fsync per write group, so commits/s
// grows with concurrency far past the disk's sync rate (the 1-thread figure
// is about one sync RocksDB write each).
//
// Each commit is one batch shaped like a shard report: a ~200-byte shard
// record and a ~60-byte index entry. Counters per case:
//   items_per_second   commits/s (all threads)
//   batches_per_fsync  group-commit factor (stats().batches_written / fsyncs)
//   p50_us, p99_us     Commit() latency over all threads
//
//   build/bench/meta_store_bench [--benchmark_min_time=S] [--benchmark_repetitions=N]
// The store lives in a fresh directory under $TMPDIR (or /tmp), removed at exit.
#include <benchmark/benchmark.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/meta/store/meta_store.h"
#include "server/meta/store/rocksdb_meta_store.h"

namespace {

ckpt::meta::MetaStore* g_store = nullptr;

// Latencies gathered from every thread of the running case.
struct Gather {
  absl::Mutex mu;
  std::vector<double> latencies_us ABSL_GUARDED_BY(mu);
  int arrived ABSL_GUARDED_BY(mu) = 0;
};
Gather g_gather;

void BM_Commit(benchmark::State& state) {
  ckpt::meta::MetaStore& store = *g_store;
  ckpt::meta::StoreStats before;
  if (state.thread_index() == 0) {
    absl::MutexLock lock(&g_gather.mu);
    g_gather.latencies_us.clear();
    g_gather.arrived = 0;
    before = store.stats();
  }
  std::vector<double> mine;
  mine.reserve(1 << 16);
  const std::string record(200, 'r');
  uint64_t i = 0;
  for (auto _ : state) {
    ckpt::meta::WriteBatch b;
    const std::string shard = absl::StrCat("shard/job-a/", state.thread_index(), "/", i++);
    b.Put(shard, record);
    b.Put(absl::StrCat("idx/", shard), "STAGED");
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = store.Commit(std::move(b));
    const auto end = std::chrono::steady_clock::now();
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      break;
    }
    mine.push_back(std::chrono::duration<double, std::micro>(end - start).count());
  }
  state.SetItemsProcessed(state.iterations());

  absl::MutexLock lock(&g_gather.mu);
  g_gather.latencies_us.insert(g_gather.latencies_us.end(), mine.begin(), mine.end());
  ++g_gather.arrived;
  if (state.thread_index() != 0) return;
  // Thread 0 reports for everyone once all threads have added theirs.
  struct AllArrived {
    int* arrived;
    int threads;
  } all{&g_gather.arrived, state.threads()};
  g_gather.mu.Await(
      absl::Condition(+[](AllArrived* a) { return *a->arrived == a->threads; }, &all));
  const ckpt::meta::StoreStats after = store.stats();
  std::vector<double>& lat = g_gather.latencies_us;
  if (!lat.empty()) {
    std::sort(lat.begin(), lat.end());
    state.counters["p50_us"] = lat[lat.size() / 2];
    state.counters["p99_us"] = lat[std::min(lat.size() - 1, lat.size() * 99 / 100)];
  }
  const double fsyncs = static_cast<double>(after.fsyncs - before.fsyncs);
  if (fsyncs > 0) {
    state.counters["batches_per_fsync"] = (after.batches_written - before.batches_written) / fsyncs;
  }
}
BENCHMARK(BM_Commit)->Threads(1)->Threads(8)->Threads(64)->UseRealTime()->MinTime(2.0);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;

  const char* tmp = getenv("TMPDIR");
  std::string pattern = (std::filesystem::path(tmp != nullptr ? tmp : "/tmp") /
                         "meta_store_bench.XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) {
    std::perror(("mkdtemp " + pattern).c_str());
    return 1;
  }
  int rc = 0;
  {
    auto store = ckpt::meta::OpenRocksDbMetaStore(pattern);
    if (!store.ok()) {
      std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
      rc = 1;
    } else {
      g_store = store->get();
      benchmark::RunSpecifiedBenchmarks();
      const ckpt::meta::StoreStats stats = (*store)->stats();
      std::printf("total: %llu batches in %llu fsyncs (%.1f batches per fsync), %llu bytes\n",
                  static_cast<unsigned long long>(stats.batches_written),
                  static_cast<unsigned long long>(stats.fsyncs),
                  stats.fsyncs ? static_cast<double>(stats.batches_written) / stats.fsyncs : 0.0,
                  static_cast<unsigned long long>(stats.bytes_written));
      g_store = nullptr;
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(pattern, ec);
  benchmark::Shutdown();
  return rc;
}
