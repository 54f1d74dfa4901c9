// save_bench: what a trainer feels, against this machine's own memcpy and
// disk, measured in the same run.
//
// Starts a real ckpt-meta and ckpt-agent (memory tier on /dev/shm), then for
// each shard size:
//   - memcpy baseline: one copy of the shard into a pre-faulted private buffer
//     (median of 5);
//   - save blocking time (BeginSave + Add + Commit: copy + crc + commit RPC)
//     on the first save after the agent started and in steady state (median),
//     as a ratio to the memcpy; saves are spaced by a stand-in training step
//     (0.3 s + 0.15 s per GiB) in which the agent's background work runs;
//   - extra memory the agent and this (client) process hold while saving and
//     flushing, beyond the memory tier's one copy of the state, as a ratio to
//     the state;
//   - flush: FlushVersion -> PERSISTED time vs a plain sequential write+fsync
//     of the same bytes to the same disk (median of --flush-runs);
//   - load after a trainer restart: connect, zero-copy Load (agent verifies
//     every crc), and LoadInto pre-faulted live buffers vs memcpy.
//
//   save_bench [--sizes 1GiB,4GiB] [--steps 5] [--flush-runs 3] [--dir DIR]
// DIR holds the durable tier (default: the working directory; must be a disk).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <thread>
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

using testing::AgentProcess;
using testing::AgentProcessOptions;
using testing::MetaProcess;

using bench::Buffer;
using bench::Seconds;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}


uint64_t RssAnonBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("RssAnon:", 0) == 0) {
      uint64_t kb = 0;
      absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(8, line.size() - 8 - 3)), &kb);
      return kb * 1024;
    }
  }
  return 0;
}

// Samples the peak RssAnon of two processes until stopped.
class PeakSampler {
 public:
  PeakSampler(pid_t a, pid_t b) : a_(a), b_(b), base_a_(RssAnonBytes(a)), base_b_(RssAnonBytes(b)) {
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        peak_a_ = std::max(peak_a_.load(), RssAnonBytes(a_));
        peak_b_ = std::max(peak_b_.load(), RssAnonBytes(b_));
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
  }
  // Growth above the starting RssAnon of both processes.
  uint64_t Stop() {
    stop_.store(true);
    thread_.join();
    const uint64_t ga = peak_a_ > base_a_ ? peak_a_ - base_a_ : 0;
    const uint64_t gb = peak_b_ > base_b_ ? peak_b_ - base_b_ : 0;
    return ga + gb;
  }

 private:
  pid_t a_, b_;
  uint64_t base_a_, base_b_;
  std::atomic<uint64_t> peak_a_{0}, peak_b_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

double WriteFsyncSeconds(const std::string& path, const std::byte* data, size_t n) {
  const absl::Time t0 = absl::Now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  for (size_t off = 0; off < n;) {
    const ssize_t w = ::write(fd, data + off, std::min<size_t>(8 << 20, n - off));
    if (w <= 0) {
      std::perror("write");
      std::exit(1);
    }
    off += static_cast<size_t>(w);
  }
  ::fsync(fd);
  ::close(fd);
  const double s = Seconds(absl::Now() - t0);
  ::unlink(path.c_str());
  return s;
}

absl::Status FromGrpc(const grpc::Status& s) {
  return s.ok() ? absl::OkStatus() : absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// Removes what the run created (the daemons die with this process).
std::function<void()> g_cleanup = [] {};

void Die(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "save_bench: %s: %s\n", what, s.ToString().c_str());
  g_cleanup();
  std::exit(1);
}

int Run(const std::vector<uint64_t>& sizes, int steps, int flush_runs, const std::string& dir) {
  absl::StatusOr<testing::TempDir> tmp = testing::TempDir::Create();
  Die(tmp.status(), "temp dir");
  const std::string tmp_path = tmp->path();
  uint64_t max_size = *std::max_element(sizes.begin(), sizes.end());
  const std::string shm = absl::StrCat("/dev/shm/ckpt-bench-", ::getpid());
  const std::string durable = absl::StrCat(dir, "/save-bench-durable-", ::getpid());
  g_cleanup = [&] {
    std::error_code ec;
    std::filesystem::remove_all(shm, ec);
    std::filesystem::remove_all(durable, ec);
    std::filesystem::remove_all(tmp_path, ec);
  };
  std::printf("save_bench: sizes up to %.2f GiB, memory tier %s, durable tier %s\n",
              max_size / double(1 << 30), shm.c_str(), durable.c_str());

  absl::StatusOr<std::unique_ptr<MetaProcess>> meta = MetaProcess::Start(*tmp->Sub("meta"), tmp->path());
  Die(meta.status(), "start ckpt-meta");
  AgentProcessOptions ao;
  ao.meta_address = (*meta)->address();
  ao.dir = *tmp->Sub("agent");
  ao.durable_root = durable;
  ao.memory = absl::StrCat((2 * max_size + (64 << 20)) >> 20, "MiB");
  ao.extra_args = {"--log-level", "warn"};
  ao.memory_dir = shm;  // the memory tier on a real tmpfs, as in production
  const absl::Time agent_t0 = absl::Now();
  absl::StatusOr<std::unique_ptr<AgentProcess>> agent = AgentProcess::Start(ao);
  Die(agent.status(), "start ckpt-agent");
  std::printf("agent ready (pool of %s reserved and pre-faulted) in %.2f s\n\n", ao.memory.c_str(),
              Seconds(absl::Now() - agent_t0));

  std::printf("%-8s %-34s %12s %10s\n", "size", "measure", "value", "ratio");
  int job_n = 0;
  for (const uint64_t size : sizes) {
    const std::string size_name = absl::StrCat(size >> 20, "MiB");
    Buffer src(size);
    {
      std::mt19937_64 rng(42);
      auto* w = reinterpret_cast<uint64_t*>(src.data);
      for (size_t i = 0; i < size / 8; ++i) w[i] = rng();
    }
    double memcpy_s;
    {
      Buffer dst(size);
      std::vector<double> t;
      for (int i = 0; i < 5; ++i) {
        const absl::Time t0 = absl::Now();
        std::memcpy(dst.data, src.data, size);
        t.push_back(Seconds(absl::Now() - t0));
      }
      memcpy_s = Median(t);
    }
    auto row = [&](const char* what, double v, const char* unit, double ratio) {
      std::printf("%-8s %-34s %9.3f %-2s %9.3fx\n", size_name.c_str(), what, v, unit, ratio);
    };
    row("memcpy into pre-faulted buffer", memcpy_s, "s", 1.0);

    ClientOptions co;
    co.meta_address = (*meta)->address();
    co.agent_socket = (*agent)->socket_path();
    co.job_id = absl::StrCat("bench-", job_n++);
    co.world_size = 1;
    co.keep_in_memory = 1;
    const absl::Time c0 = absl::Now();
    absl::StatusOr<Client> client = Client::Connect(co);
    Die(client.status(), "connect");
    row("client connect (maps the pool)", Seconds(absl::Now() - c0), "s", 0);

    // Room for the next save: free memory, or the lease the client took ahead
    // for it after its last commit (ClientOptions::lease_ahead, on by default:
    // the next save copies into it). Counting free memory alone waited for
    // room the save never needs, and timed out whenever the lease ahead came
    // before the check (the tier holds one kept version and that lease).
    auto wait_free = [&](uint64_t want) {
      for (int i = 0; i < 2000; ++i) {
        v1::AgentStatusResponse st;
        grpc::ClientContext ctx;
        if ((*agent)->stub()->AgentStatus(&ctx, {}, &st).ok() &&
            st.memory_free_bytes() + st.memory_leased_bytes() >= want) {
          return;
        }
        absl::SleepFor(absl::Milliseconds(5));
      }
      v1::AgentStatusResponse st;
      grpc::ClientContext ctx;
      (*agent)->stub()->AgentStatus(&ctx, {}, &st).IgnoreError();
      Die(absl::DeadlineExceededError(absl::StrCat("memory tier did not free ", want, " bytes in 10 s: ", st.ShortDebugString())), "evict");
    };

    const absl::Duration gap = absl::Milliseconds(300) + absl::Milliseconds(150 * (size >> 30));
    std::vector<double> blocking;
    uint64_t extra_peak = 0;
    uint64_t step = 0;
    for (int i = 0; i < steps; ++i) {
      ++step;
      // A training step's worth of compute between saves, during which the
      // agent verifies, evicts and reports in the background (as it would
      // overlap a real trainer's compute, not its next save).
      absl::SleepFor(gap);
      wait_free(size + 4096);
      PeakSampler sampler((*agent)->proc()->pid(), ::getpid());
      const absl::Time t0 = absl::Now();
      SaveBuilder b = client->BeginSave(step);
      Die(b.Add("state", std::span<const std::byte>(src.data, size), DType::kF32, {size / 4}), "add");
      absl::StatusOr<SaveHandle> h = b.Commit();
      const double t = Seconds(absl::Now() - t0);
      Die(h.status(), "commit");
      Die(h->Wait(Level::kProtected, absl::Now() + absl::Minutes(2)), "wait protected");
      extra_peak = std::max(extra_peak, sampler.Stop());
      blocking.push_back(t);
    }
    row("save blocking, first save", blocking[0], "s", blocking[0] / memcpy_s);
    std::vector<double> steady(blocking.begin() + 1, blocking.end());
    const double steady_s = Median(steady);
    row("save blocking, steady (median)", steady_s, "s", steady_s / memcpy_s);

    // Flush: FlushVersion -> PERSISTED vs write+fsync.
    std::vector<double> flush_t, raw_t;
    for (int i = 0; i < flush_runs; ++i) {
      raw_t.push_back(WriteFsyncSeconds(absl::StrCat(dir, "/save-bench-raw-", ::getpid()), src.data, size));
      ++step;
      wait_free(size + 4096);
      SaveBuilder b = client->BeginSave(step);
      Die(b.Add("state", std::span<const std::byte>(src.data, size), DType::kF32, {size / 4}), "add");
      absl::StatusOr<SaveHandle> h = b.Commit();
      Die(h.status(), "commit");
      Die(h->Wait(Level::kProtected, absl::Now() + absl::Minutes(2)), "wait protected");
      PeakSampler sampler((*agent)->proc()->pid(), ::getpid());
      const absl::Time t0 = absl::Now();
      v1::FlushVersionRequest req;
      req.set_job_id(co.job_id);
      req.set_step(step);
      v1::FlushVersionResponse resp;
      grpc::ClientContext ctx;
      Die(FromGrpc((*meta)->stub()->FlushVersion(&ctx, req, &resp)), "flush");
      Die(h->Wait(Level::kPersisted, absl::Now() + absl::Minutes(10)), "wait persisted");
      flush_t.push_back(Seconds(absl::Now() - t0));
      extra_peak = std::max(extra_peak, sampler.Stop());
    }
    const double flush_s = Median(flush_t), raw_s = Median(raw_t);
    row("write+fsync baseline (median)", raw_s, "s", 1.0);
    row("flush to PERSISTED (median)", flush_s, "s", flush_s / raw_s);
    std::printf("%-8s %-34s %9.3f %-2s\n", size_name.c_str(), "flush throughput", size / flush_s / 1e9, "GB/s");
    row("extra memory, save+flush (peak)", extra_peak / double(1 << 20), "MB",
        (size + extra_peak) / double(size));

    // Load after a trainer restart: a new client.
    {
      const absl::Time t0 = absl::Now();
      absl::StatusOr<Client> fresh = Client::Connect(co);
      Die(fresh.status(), "reconnect");
      const double connect_s = Seconds(absl::Now() - t0);
      row("restart: connect", connect_s, "s", 0);
      const absl::Time t1 = absl::Now();
      absl::StatusOr<LoadedShard> shard = fresh->Load(step);
      Die(shard.status(), "load");
      absl::StatusOr<std::span<const std::byte>> view = shard->View("state");
      Die(view.status(), "view");
      const double open_s = Seconds(absl::Now() - t1);
      row("restart: zero-copy Load (verified)", open_s, "s", open_s / memcpy_s);
      Die(shard->Close(), "close");
      Buffer live(size);
      std::vector<double> t;
      for (int i = 0; i < 4; ++i) {
        const absl::Time t2 = absl::Now();
        Die(fresh->LoadInto(step, {{"state", std::span<std::byte>(live.data, size)}}), "load into");
        t.push_back(Seconds(absl::Now() - t2));
      }
      // The first copy into a never-written buffer pays this VM's first-touch
      // cost (docs/benchmarks.md); live tensors of a trainer are warm.
      row("restart: LoadInto fresh buffers", t[0], "s", t[0] / memcpy_s);
      const double into_s = Median(std::vector<double>(t.begin() + 1, t.end()));
      row("restart: LoadInto live buffers", into_s, "s", into_s / memcpy_s);
      if (std::memcmp(live.data, src.data, size) != 0) Die(absl::DataLossError("bytes differ"), "compare");
    }
    // Free the memory tier for the next size.
    {
      v1::DeleteJobRequest req;
      req.set_job_id(co.job_id);
      req.set_delete_durable_files(true);
      v1::DeleteJobResponse resp;
      grpc::ClientContext ctx;
      Die(FromGrpc((*meta)->stub()->DeleteJob(&ctx, req, &resp)), "delete job");
    }
    std::printf("\n");
  }
  (*agent)->proc()->Terminate(absl::Seconds(10)).IgnoreError();
  g_cleanup();
  return 0;
}

}  // namespace
}  // namespace ckpt

int main(int argc, char** argv) {
  std::vector<uint64_t> sizes = {uint64_t{1} << 30, uint64_t{4} << 30};
  int steps = 5, flush_runs = 3;
  std::string dir = std::filesystem::current_path().string();
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--sizes") {
      sizes.clear();
      for (absl::string_view s : absl::StrSplit(value, ',')) {
        absl::StatusOr<uint64_t> b = ckpt::ParseBytes(std::string(s));
        if (!b.ok()) {
          std::fprintf(stderr, "save_bench: %s\n", b.status().ToString().c_str());
          return 2;
        }
        sizes.push_back(*b);
      }
    } else if (flag == "--steps") {
      steps = std::max(2, std::atoi(value.c_str()));
    } else if (flag == "--flush-runs") {
      flush_runs = std::max(1, std::atoi(value.c_str()));
    } else if (flag == "--dir") {
      dir = value;
    } else {
      std::fprintf(stderr, "usage: save_bench [--sizes 1GiB,4GiB] [--steps 5] [--flush-runs 3] [--dir DIR]\n");
      return 2;
    }
  }
  return ckpt::Run(sizes, steps, flush_runs, dir);
}
