// Flush throughput: one rank file of 256 MiB and of 1 GiB written to a local
// disk three ways, in the same iteration so that drift in the machine's load
// hits all of them alike:
//   write_fsync   the machine's limit: plain write() of the buffer in 8 MiB
//                 chunks to a new file, then fsync, close
//   rank_writer   ckpt::RankFileWriter over PosixFileSystem: 8 MiB Appends
//                 (pwrite + crc32c), Commit (size/crc check, fdatasync,
//                 rename, fsync of the directory)
//   uring         io_uring (liburing, if built with it): 8 MiB writes at
//                 explicit offsets with kUringDepth in flight, then fsync
// Each variant writes a new file (the previous one is unlinked, untimed).
//
// Counters (medians over the repetitions): *_GBps = bytes / wall time of the
// variant, and ratios writer_vs_write = rank_writer / write_fsync,
// uring_vs_write = uring / write_fsync. A table of the same follows Google
// Benchmark's output. Timings are reported, never asserted (the disk here is
// a host-cached virtual disk and noisy).
//
//   CKPT_BENCH_DIR=/path/on/disk build/bench/flush_bench [--benchmark_repetitions=N]
// Files go to $CKPT_BENCH_DIR (default: <build dir>/bench-tmp), which must be
// on a real disk: the program warns if it is tmpfs. Defaults: 9 repetitions,
// medians compared; about 70 s here.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#if defined(CKPT_HAVE_URING)
#include <liburing.h>
#endif

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/crc32c.h"
#include "common/durable_format.h"
#include "common/file_system.h"

#ifndef CKPT_BINARY_DIR
#define CKPT_BINARY_DIR "."
#endif

namespace {

constexpr size_t kChunkBytes = size_t{8} << 20;
constexpr size_t kMaxBytes = size_t{1} << 30;
constexpr unsigned kUringDepth = 4;

using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "flush_bench: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(1);
}

struct Setup {
  std::string dir;
  std::byte* buffer = nullptr;  // kMaxBytes, touched once at start-up
  std::map<size_t, uint32_t> crc;  // crc32c of the first n bytes
  bool uring_available = false;
  std::string uring_problem;
};

Setup& S() {
  static Setup setup;
  return setup;
}

std::string PathFor(const char* variant) { return S().dir + "/" + variant + ".bin"; }

void Unlink(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) Die("unlink " + path);
}

// (a) plain write() + fsync.
double WriteFsync(size_t size) {
  const std::string path = PathFor("write_fsync");
  Unlink(path);
  const auto start = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) Die("open " + path);
  for (size_t off = 0; off < size;) {
    const ssize_t n = ::write(fd, S().buffer + off, std::min(kChunkBytes, size - off));
    if (n < 0) {
      if (errno == EINTR) continue;
      Die("write " + path);
    }
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) Die("fsync " + path);
  if (::close(fd) != 0) Die("close " + path);
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// (b) RankFileWriter.
double RankWriter(size_t size, benchmark::State& state) {
  const std::string path = PathFor("rank_writer");
  Unlink(path);
  const auto start = Clock::now();
  auto writer = ckpt::RankFileWriter::Create(ckpt::PosixFileSystem(), path, size, S().crc[size]);
  if (!writer.ok()) {
    state.SkipWithError(writer.status().ToString().c_str());
    return 0;
  }
  for (size_t off = 0; off < size; off += kChunkBytes) {
    const size_t n = std::min(kChunkBytes, size - off);
    if (absl::Status s = (*writer)->Append({S().buffer + off, n}); !s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      return 0;
    }
  }
  if (absl::Status s = (*writer)->Commit(); !s.ok()) {
    state.SkipWithError(s.ToString().c_str());
    return 0;
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
}

#if defined(CKPT_HAVE_URING)
// (c) io_uring with kUringDepth writes in flight, then fsync.
double Uring(size_t size) {
  const std::string path = PathFor("uring");
  Unlink(path);
  io_uring ring;
  if (int rc = io_uring_queue_init(kUringDepth, &ring, 0); rc < 0) {
    errno = -rc;
    Die("io_uring_queue_init");
  }
  const auto start = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) Die("open " + path);
  size_t submitted = 0;
  unsigned in_flight = 0;
  while (submitted < size || in_flight > 0) {
    while (in_flight < kUringDepth && submitted < size) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      if (sqe == nullptr) break;
      const size_t n = std::min(kChunkBytes, size - submitted);
      io_uring_prep_write(sqe, fd, S().buffer + submitted, static_cast<unsigned>(n), submitted);
      io_uring_sqe_set_data64(sqe, n);
      submitted += n;
      ++in_flight;
    }
    if (int rc = io_uring_submit(&ring); rc < 0) {
      errno = -rc;
      Die("io_uring_submit");
    }
    io_uring_cqe* cqe = nullptr;
    if (int rc = io_uring_wait_cqe(&ring, &cqe); rc < 0) {
      errno = -rc;
      Die("io_uring_wait_cqe");
    }
    // Regular files complete writes in full or fail; a short write here
    // would be a surprise worth stopping for.
    if (cqe->res < 0 || static_cast<uint64_t>(cqe->res) != io_uring_cqe_get_data64(cqe)) {
      errno = cqe->res < 0 ? -cqe->res : EIO;
      Die("io_uring write " + path);
    }
    io_uring_cqe_seen(&ring, cqe);
    --in_flight;
  }
  if (::fsync(fd) != 0) Die("fsync " + path);
  if (::close(fd) != 0) Die("close " + path);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  io_uring_queue_exit(&ring);
  return seconds;
}
#endif

void BM_Flush(benchmark::State& state) {
  const size_t size = static_cast<size_t>(state.range(0)) << 20;
  double t_write = 0, t_writer = 0, t_uring = 0;
  int rotation = 0;
  for (auto _ : state) {
    // Rotate the order so no variant always runs right after another's
    // writeback.
    for (int k = 0; k < 3; ++k) {
      switch ((rotation + k) % 3) {
        case 0:
          t_write += WriteFsync(size);
          break;
        case 1:
          t_writer += RankWriter(size, state);
          break;
        case 2:
#if defined(CKPT_HAVE_URING)
          if (S().uring_available) t_uring += Uring(size);
#endif
          break;
      }
    }
    ++rotation;
  }
  const double bytes = static_cast<double>(size) * static_cast<double>(state.iterations());
  state.counters["write_fsync_GBps"] = bytes / t_write / 1e9;
  state.counters["rank_writer_GBps"] = t_writer > 0 ? bytes / t_writer / 1e9 : 0;
  state.counters["writer_vs_write"] = t_writer > 0 ? t_write / t_writer : 0;
  if (t_uring > 0) {
    state.counters["uring_GBps"] = bytes / t_uring / 1e9;
    state.counters["uring_vs_write"] = t_write / t_uring;
  }
}

// Keeps the median counters of each benchmark for the closing table.
class MedianReporter : public benchmark::ConsoleReporter {
 public:
  MedianReporter()
      : ConsoleReporter(::isatty(STDOUT_FILENO) ? OO_ColorTabular : OO_Tabular) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.error_occurred) continue;
      const bool aggregate = r.run_type == Run::RT_Aggregate;
      if (aggregate && r.aggregate_name != "median") continue;
      // run_name.args is "MiB:<size>".
      const std::string& args = r.run_name.args;
      const size_t colon = args.find(':');
      auto& row = rows_[std::atoi(args.c_str() + (colon == std::string::npos ? 0 : colon + 1))];
      if (!aggregate && !row.empty()) continue;  // single runs: keep the first
      for (const auto& [name, counter] : r.counters) row[name] = counter.value;
    }
  }
  // By size in MiB.
  const std::map<int, std::map<std::string, double>>& rows() const { return rows_; }

 private:
  std::map<int, std::map<std::string, double>> rows_;
};

void SetUp() {
  Setup& s = S();
  const char* env = std::getenv("CKPT_BENCH_DIR");
  const std::string base = env != nullptr && *env != '\0' ? env : CKPT_BINARY_DIR "/bench-tmp";
  if (::mkdir(base.c_str(), 0755) != 0 && errno != EEXIST) Die("mkdir " + base);
  std::string dir = base + "/flush_bench.XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) Die("mkdtemp " + dir);
  s.dir = dir;
  struct statfs fs_info;
  if (::statfs(s.dir.c_str(), &fs_info) != 0) Die("statfs " + s.dir);
  std::printf("flush_bench: writing to %s\n", s.dir.c_str());
  if (fs_info.f_type == TMPFS_MAGIC || fs_info.f_type == RAMFS_MAGIC) {
    std::printf("flush_bench: WARNING: %s is in memory (tmpfs/ramfs), not a disk; "
                "set CKPT_BENCH_DIR\n", s.dir.c_str());
  }

  s.buffer = static_cast<std::byte*>(std::aligned_alloc(4096, kMaxBytes));
  if (s.buffer == nullptr) Die("allocate 1 GiB");
  // Touch every page once (first touch is slow on this VM) with bytes that
  // do not compress.
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < kMaxBytes; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(s.buffer + i, &x, 8);
  }
  for (size_t mib : {256, 1024}) s.crc[mib << 20] = ckpt::Crc32c(s.buffer, mib << 20);

#if defined(CKPT_HAVE_URING)
  io_uring ring;
  if (int rc = io_uring_queue_init(kUringDepth, &ring, 0); rc < 0) {
    s.uring_problem = std::string("io_uring_queue_init: ") + std::strerror(-rc);
  } else {
    io_uring_queue_exit(&ring);
    s.uring_available = true;
  }
#else
  s.uring_problem = "built without liburing";
#endif
  if (!s.uring_available) std::printf("flush_bench: io_uring skipped (%s)\n", s.uring_problem.c_str());

  // The first write of a run is reported apart from steady state.
  const double first = WriteFsync(size_t{256} << 20);
  std::printf("flush_bench: first run (write+fsync, 256 MiB, cold): %.2f GB/s\n",
              (256.0 * (1 << 20)) / first / 1e9);
}

void TearDown() {
  for (const char* v : {"write_fsync", "rank_writer", "uring"}) Unlink(PathFor(v));
  if (::rmdir(S().dir.c_str()) != 0) Die("rmdir " + S().dir);
  std::free(S().buffer);
}

}  // namespace

int main(int argc, char** argv) {
  // Defaults, overridable on the command line (later flags win).
  std::vector<char*> args(argv, argv + argc);
  std::string reps = "--benchmark_repetitions=9";
  args.insert(args.begin() + 1, reps.data());
  argc = static_cast<int>(args.size());
  argv = args.data();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;

  SetUp();
  // Fixed iterations keep the run predictable (~3 GiB written per 1 GiB
  // iteration); medians over the repetitions smooth the disk's noise.
  benchmark::RegisterBenchmark("flush", BM_Flush)
      ->ArgName("MiB")
      ->Arg(256)
      ->Iterations(2)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime()
      ->ReportAggregatesOnly(true);
  benchmark::RegisterBenchmark("flush", BM_Flush)
      ->ArgName("MiB")
      ->Arg(1024)
      ->Iterations(1)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime()
      ->ReportAggregatesOnly(true);
  MedianReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);

  std::printf("\nmedians over the repetitions (single run if 1):\n");
  std::printf("%-12s %16s %16s %12s %12s %12s\n", "size", "write+fsync GB/s",
              "RankFileWriter", "io_uring", "writer/write", "uring/write");
  for (const auto& [mib, c] : reporter.rows()) {
    const auto get = [&](const char* key) {
      auto it = c.find(key);
      return it == c.end() ? 0.0 : it->second;
    };
    const std::string name = std::to_string(mib) + " MiB";
    std::printf("%-12s %16.2f %16.2f %12.2f %12.3f %12.3f\n", name.c_str(), get("write_fsync_GBps"),
                get("rank_writer_GBps"), get("uring_GBps"), get("writer_vs_write"),
                get("uring_vs_write"));
  }
  TearDown();
  benchmark::Shutdown();
  return 0;
}
