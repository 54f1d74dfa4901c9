// item_bench: the per-item cost of save and load, against a deep copy
// ("clone") of the same state measured in the same run.
//
// Starts a real ckpt-meta and ckpt-agent (memory tier on /dev/shm), then for
// every (item count, item size) pair builds a state of that many separately
// allocated tensors (f32, named like a model's parameters) and measures, each
// `--runs` times:
//   - clone: a fresh allocation and a memcpy per item (what torch's clone()
//     of every tensor does): the baseline;
//   - save blocking: BeginSave + Add per item + Commit (the lease, copy + crc
//     into the agent's pool; the commit RPC with the manifest goes in the
//     background), and apart, the time until the agent answered the commit
//     (SaveHandle::Committed), which a trainer does not wait for;
//   - load: Load (Locate at meta while the agent opens its local copy and the
//     client lists and checks its items) + View of every item, the zero-copy
//     restore; and apart, until the shard was dropped (its CloseShard goes in
//     the background; the clone's copies are not freed in its time either);
//   - load into: LoadInto of every item into live (warm) buffers.
// Prints the first run apart and the median of the others, each as a ratio to
// the clone's median of the same run. Each measurement follows a pause (a
// stand-in training step, --gap-ms) in which the daemons' background work
// (the agent's report to meta, meta's RocksDB write, crc verification) runs,
// as it would overlap a trainer's compute rather than its next save.
//
//   item_bench [--items 1000,10000] [--item-bytes 1KiB,4KiB] [--runs 7] [--gap-ms 300]
//              [--commit-in-background 1|0]   (0: Commit waits for the agent, as before)
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/bench_support.h"
#include "ckpt/client.h"
#include "common/config.h"
#include "integration/agent_process.h"
#include "integration/meta_process.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using bench::Seconds;
using testing::AgentProcess;
using testing::AgentProcessOptions;
using testing::MetaProcess;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::function<void()> g_cleanup = [] {};

void Die(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "item_bench: %s: %s\n", what, s.ToString().c_str());
  g_cleanup();
  std::exit(1);
}

absl::Status FromGrpc(const grpc::Status& s) {
  return s.ok() ? absl::OkStatus()
                : absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// A model-like state: `n` tensors of `bytes` each, separately allocated and
// touched once (first touch is slow on this VM and belongs to no measurement).
struct State {
  std::vector<std::string> names;
  std::vector<std::unique_ptr<std::byte[]>> data;
  size_t item_bytes = 0;

  State(size_t n, size_t bytes) : item_bytes(bytes) {
    std::mt19937_64 rng(42);
    for (size_t i = 0; i < n; ++i) {
      names.push_back(absl::StrCat("model/layers.", i / 8, ".block.", i % 8, ".weight"));
      auto p = std::make_unique_for_overwrite<std::byte[]>(bytes);
      for (size_t o = 0; o + 8 <= bytes; o += 8) {
        const uint64_t v = rng();
        std::memcpy(p.get() + o, &v, 8);
      }
      data.push_back(std::move(p));
    }
  }
  std::span<const std::byte> item(size_t i) const { return {data[i].get(), item_bytes}; }
};

// The baseline: a deep copy of every tensor into fresh allocations.
double Clone(const State& s) {
  const absl::Time t0 = absl::Now();
  std::vector<std::unique_ptr<std::byte[]>> copy;
  copy.reserve(s.data.size());
  for (size_t i = 0; i < s.data.size(); ++i) {
    auto p = std::make_unique_for_overwrite<std::byte[]>(s.item_bytes);
    std::memcpy(p.get(), s.data[i].get(), s.item_bytes);
    copy.push_back(std::move(p));
  }
  const double t = Seconds(absl::Now() - t0);
  // Read something so the copies cannot be optimised away.
  volatile std::byte sink = copy.back()[0];
  (void)sink;
  return t;
}

// The floor: a memcpy of every item into buffers that already exist and were
// written before (no allocation, no page fault).
double CopyWarm(const State& s, const std::vector<std::unique_ptr<std::byte[]>>& into) {
  const absl::Time t0 = absl::Now();
  for (size_t i = 0; i < s.data.size(); ++i) std::memcpy(into[i].get(), s.data[i].get(), s.item_bytes);
  const double t = Seconds(absl::Now() - t0);
  volatile std::byte sink = into.back()[0];
  (void)sink;
  return t;
}

struct Row {
  std::string what;
  std::vector<double> t;  // seconds, in run order
};

int Run(const std::vector<uint64_t>& counts, const std::vector<uint64_t>& sizes, int runs,
        absl::Duration gap, bool commit_in_background) {
  absl::StatusOr<testing::TempDir> tmp = testing::TempDir::Create();
  Die(tmp.status(), "temp dir");
  const std::string tmp_path = tmp->path();
  const std::string shm = absl::StrCat("/dev/shm/ckpt-item-bench-", ::getpid());
  g_cleanup = [&] {
    std::error_code ec;
    std::filesystem::remove_all(shm, ec);
    std::filesystem::remove_all(tmp_path, ec);
  };
  uint64_t max_state = 0;
  for (uint64_t n : counts)
    for (uint64_t b : sizes) max_state = std::max(max_state, n * ((b + 63) / 64 * 64));
  absl::StatusOr<std::unique_ptr<MetaProcess>> meta = MetaProcess::Start(*tmp->Sub("meta"), tmp->path());
  Die(meta.status(), "start ckpt-meta");
  AgentProcessOptions ao;
  ao.meta_address = (*meta)->address();
  ao.dir = *tmp->Sub("agent");
  ao.memory = absl::StrCat((4 * max_state + (64 << 20)) >> 20, "MiB");
  ao.memory_dir = shm;
  ao.extra_args = {"--log-level", "warn"};
  absl::StatusOr<std::unique_ptr<AgentProcess>> agent = AgentProcess::Start(ao);
  Die(agent.status(), "start ckpt-agent");
  std::printf("item_bench: %d runs per case; first run apart, then the median of the rest; "
              "ratios to the clone median of the same case\n\n", runs);
  std::printf("%-7s %-6s %-34s %10s %10s %8s\n", "items", "bytes", "measure", "first ms", "median ms",
              "ratio");
  int job_n = 0;
  for (const uint64_t n : counts) {
    for (const uint64_t bytes : sizes) {
      State state(n, bytes);
      ClientOptions co;
      co.meta_address = (*meta)->address();
      co.agent_socket = (*agent)->socket_path();
      co.job_id = absl::StrCat("items-", job_n++);
      co.world_size = 1;
      co.keep_in_memory = 2;
      co.commit_in_background = commit_in_background;
      absl::StatusOr<Client> client = Client::Connect(co);
      Die(client.status(), "connect");

      Row clone{"clone (alloc + memcpy per item)", {}};
      Row warm{"memcpy into warm buffers (floor)", {}};
      Row save{"save blocking (Add + Commit)", {}};
      Row adds{"  of which Add x items", {}};
      Row committed{"  until the agent holds it (Committed)", {}};
      Row load{"load (Load + View each)", {}};
      Row dropped{"  and the shard dropped", {}};
      Row into{"load into live buffers (LoadInto)", {}};
      std::vector<std::unique_ptr<std::byte[]>> live;
      std::map<std::string, std::span<std::byte>> targets;
      for (size_t i = 0; i < n; ++i) {
        live.push_back(std::make_unique<std::byte[]>(bytes));  // zeroed: touched
        targets.emplace(state.names[i], std::span<std::byte>(live.back().get(), bytes));
      }
      for (int r = 0; r < runs; ++r) {
        const uint64_t step = static_cast<uint64_t>(r) + 1;
        absl::SleepFor(gap);
        clone.t.push_back(Clone(state));
        warm.t.push_back(CopyWarm(state, live));

        absl::SleepFor(gap);
        const absl::Time t0 = absl::Now();
        SaveBuilder b = client->BeginSave(step);
        for (size_t i = 0; i < n; ++i) {
          Die(b.Add(state.names[i], state.item(i), DType::kF32, {bytes / 4}), "add");
        }
        adds.t.push_back(Seconds(absl::Now() - t0));
        absl::StatusOr<SaveHandle> h = b.Commit();
        save.t.push_back(Seconds(absl::Now() - t0));
        Die(h.status(), "commit");
        Die(h->Committed(), "committed");  // not blocking in a trainer; shown for comparison
        committed.t.push_back(Seconds(absl::Now() - t0));
        Die(h->Wait(Level::kStaged, absl::Now() + absl::Minutes(1)), "wait staged");

        absl::SleepFor(gap);
        const absl::Time t1 = absl::Now();
        {
          absl::StatusOr<LoadedShard> shard = client->Load(step);
          Die(shard.status(), "load");
          for (const LoadedItem& it : shard->items()) {
            absl::StatusOr<std::span<const std::byte>> v = shard->View(it.name);
            Die(v.status(), "view");
          }
          load.t.push_back(Seconds(absl::Now() - t1));
        }
        dropped.t.push_back(Seconds(absl::Now() - t1));

        absl::SleepFor(gap);
        const absl::Time t2 = absl::Now();
        Die(client->LoadInto(step, targets), "load into");
        into.t.push_back(Seconds(absl::Now() - t2));
        if (std::memcmp(live.back().get(), state.data.back().get(), bytes) != 0) {
          Die(absl::DataLossError("bytes differ"), "compare");
        }
      }
      const double base = Median(std::vector<double>(clone.t.begin() + 1, clone.t.end()));
      for (const Row* row : {&clone, &warm, &save, &adds, &committed, &load, &dropped, &into}) {
        const double med = Median(std::vector<double>(row->t.begin() + 1, row->t.end()));
        std::printf("%-7llu %-6llu %-34s %10.2f %10.2f %7.2fx\n", static_cast<unsigned long long>(n),
                    static_cast<unsigned long long>(bytes), row->what.c_str(), row->t[0] * 1e3, med * 1e3,
                    med / base);
      }
      v1::DeleteJobRequest req;
      req.set_job_id(co.job_id);
      v1::DeleteJobResponse resp;
      grpc::ClientContext ctx;
      Die(FromGrpc((*meta)->stub()->DeleteJob(&ctx, req, &resp)), "delete job");
      std::printf("\n");
    }
  }
  (*agent)->proc()->Terminate(absl::Seconds(10)).IgnoreError();
  g_cleanup();
  return 0;
}

bool ParseList(const std::string& value, std::vector<uint64_t>* out) {
  out->clear();
  for (absl::string_view s : absl::StrSplit(value, ',')) {
    absl::StatusOr<uint64_t> b = ParseBytes(std::string(s));
    if (!b.ok() || *b == 0) return false;
    out->push_back(*b);
  }
  return !out->empty();
}

}  // namespace
}  // namespace ckpt

int main(int argc, char** argv) {
  std::vector<uint64_t> counts = {1000, 10000};
  std::vector<uint64_t> sizes = {1024, 4096};
  int runs = 7;
  int gap_ms = 300;
  bool background = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    bool ok = true;
    if (flag == "--items") {
      ok = ckpt::ParseList(value, &counts);
    } else if (flag == "--item-bytes") {
      ok = ckpt::ParseList(value, &sizes);
    } else if (flag == "--runs") {
      runs = std::max(3, std::atoi(value.c_str()));
    } else if (flag == "--gap-ms") {
      gap_ms = std::max(0, std::atoi(value.c_str()));
    } else if (flag == "--commit-in-background") {
      ok = value == "0" || value == "1";
      background = value == "1";
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "usage: item_bench [--items 1000,10000] [--item-bytes 1KiB,4KiB] [--runs 7] [--gap-ms 300] [--commit-in-background 1|0]\n");
      return 2;
    }
  }
  return ckpt::Run(counts, sizes, runs, absl::Milliseconds(gap_ms), background);
}
