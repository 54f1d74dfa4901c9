// Durability, group commit, locking and crash tests of the RocksDB MetaStore.
//
// The crash tests run this binary again as a child process (the disabled test
// RocksDbMetaStoreChild.DISABLED_Main, selected by environment variables): the
// child opens a store and reports each acknowledged commit on a pipe; the
// parent SIGKILLs it by PID, reaps it, reopens the store and checks that every
// acknowledged commit is there.
#include "server/meta/store/rocksdb_meta_store.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "power_cut_file_system.h"
#include "server/meta/store/meta_store.h"
#include "scratch_dir.h"

extern char** environ;

namespace ckpt::meta {
namespace {

using ::testing::HasSubstr;

constexpr char kChildModeEnv[] = "CKPT_META_STORE_TEST_CHILD";
constexpr char kChildDirEnv[] = "CKPT_META_STORE_TEST_DIR";
constexpr char kChildRoundEnv[] = "CKPT_META_STORE_TEST_ROUND";
// The child writes its reports to this descriptor (the pipe's write end).
constexpr int kChildReportFd = 3;
constexpr int kChildThreads = 8;

// Holds the writer inside the write hook while closed (see meta_store_test.cc).
class Gate {
 public:
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    closed_ = false;
  }
  void Pass() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(+[](bool* closed) { return !*closed; }, &closed_));
  }

 private:
  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

std::unique_ptr<MetaStore> OpenOrDie(const std::string& dir, const RocksDbOptions& opts = {}) {
  absl::StatusOr<std::unique_ptr<MetaStore>> store = OpenRocksDbMetaStore(dir, opts);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? std::move(*store) : nullptr;
}

std::map<std::string, std::string> Dump(MetaStore& store) {
  std::map<std::string, std::string> out;
  absl::Status s = store.Scan("", [&](std::string_view k, std::string_view v) {
    out.emplace(k, v);
    return true;
  });
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// ---------------------------------------------------------------------------
// Child processes.

std::string ChildKey(int round, int thread, int i) {
  return absl::StrCat("r", round, "/t", thread, "/", absl::Dec(i, absl::kZeroPad8));
}
std::string ChildValue(int round, int thread, int i) {
  // Binary, and long enough that a group spans several WAL blocks.
  std::string v = absl::StrCat(std::string("value\0", 6), round, "/", thread, "/", i, "|");
  v.append(200 + i % 50, static_cast<char>('a' + (thread + i) % 26));
  return v;
}

void Report(const std::string& line) {
  // One write() of less than PIPE_BUF bytes: never interleaved with others.
  std::string out = line + "\n";
  if (write(kChildReportFd, out.data(), out.size()) != static_cast<ssize_t>(out.size())) _exit(3);
}

// Commits batches from kChildThreads threads until killed; reports "t i" after
// each acknowledged commit of thread t's batch i.
[[noreturn]] void ChildCommitLoop(const std::string& dir, int round) {
  absl::StatusOr<std::unique_ptr<MetaStore>> store = OpenRocksDbMetaStore(dir);
  if (!store.ok()) {
    Report(absl::StrCat("E ", store.status().ToString()));
    _exit(2);
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < kChildThreads; ++t) {
    threads.emplace_back([&store, round, t] {
      for (int i = 0;; ++i) {
        WriteBatch b;
        b.Put(ChildKey(round, t, i), ChildValue(round, t, i));
        b.Put(absl::StrCat("last/t", t), absl::StrCat(round, "/", i));
        b.Put(absl::StrCat("tmp/t", t), "x");
        b.Delete(absl::StrCat("tmp/t", t));
        absl::Status s = (*store)->Commit(std::move(b));
        if (!s.ok()) {
          Report(absl::StrCat("E ", s.ToString()));
          _exit(2);
        }
        Report(absl::StrCat(t, " ", i));
      }
    });
  }
  for (std::thread& t : threads) t.join();  // never: the parent kills us
  _exit(0);
}

// Tries to open the store; reports the status code name and message.
[[noreturn]] void ChildOpen(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<MetaStore>> store = OpenRocksDbMetaStore(dir);
  Report(store.ok() ? std::string("OK")
                    : absl::StrCat(absl::StatusCodeToString(store.status().code()), " ",
                                   store.status().message()));
  store = absl::CancelledError();  // close before exiting
  _exit(0);
}

TEST(RocksDbMetaStoreChild, DISABLED_Main) {
  const char* mode = getenv(kChildModeEnv);
  const char* dir = getenv(kChildDirEnv);
  if (mode == nullptr || dir == nullptr) GTEST_SKIP() << "only run as a child of the crash tests";
  if (std::string(mode) == "commit-loop") {
    int round = 0;
    const char* r = getenv(kChildRoundEnv);
    if (r == nullptr || !absl::SimpleAtoi(r, &round)) _exit(4);
    ChildCommitLoop(dir, round);
  }
  if (std::string(mode) == "open") ChildOpen(dir);
  _exit(5);
}

// A child process: this binary re-executed in one child mode, its reports
// arriving on `fd`. Killed (by PID) and reaped by the destructor if still
// running.
class Child {
 public:
  Child(const std::string& mode, const std::string& dir, int round) {
    // Everything execve needs is prepared before fork(): between fork and exec
    // only async-signal-safe calls are allowed (the parent has threads).
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0) {
      ADD_FAILURE() << "readlink /proc/self/exe: " << std::strerror(errno);
      return;
    }
    exe[n] = '\0';
    std::vector<std::string> args = {exe, "--gtest_filter=RocksDbMetaStoreChild.DISABLED_Main",
                                     "--gtest_also_run_disabled_tests"};
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    env.push_back(absl::StrCat(kChildModeEnv, "=", mode));
    env.push_back(absl::StrCat(kChildDirEnv, "=", dir));
    env.push_back(absl::StrCat(kChildRoundEnv, "=", round));
    std::vector<char*> argv, envp;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);

    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) {
      ADD_FAILURE() << "pipe2: " << std::strerror(errno);
      return;
    }
    const int devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
    pid_ = fork();
    if (pid_ == 0) {
      // dup2 clears FD_CLOEXEC on the new descriptor: only it survives exec.
      if (dup2(fds[1], kChildReportFd) < 0) _exit(126);
      if (devnull >= 0) dup2(devnull, STDOUT_FILENO);  // keep gtest's chatter out
      execve(argv[0], argv.data(), envp.data());
      _exit(127);
    }
    if (devnull >= 0) close(devnull);
    close(fds[1]);
    fd_ = fds[0];
    if (pid_ < 0) ADD_FAILURE() << "fork: " << std::strerror(errno);
  }

  ~Child() {
    if (pid_ > 0) {
      Kill();
      Wait();
    }
    if (fd_ >= 0) close(fd_);
  }

  // Reads the next report line; false at end of stream (the child is gone) or
  // if nothing arrives for a minute (a hung child; the test fails).
  bool ReadLine(std::string* line) {
    for (;;) {
      size_t nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        *line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return true;
      }
      if (fd_ < 0) return false;
      pollfd p = {fd_, POLLIN, 0};
      int ready = poll(&p, 1, /*timeout_ms=*/60000);
      if (ready == 0) {
        ADD_FAILURE() << "child " << pid_ << " sent nothing for 60 s";
        return false;
      }
      if (ready < 0 && errno == EINTR) continue;
      char buf[4096];
      ssize_t n = read(fd_, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      buffer_.append(buf, static_cast<size_t>(n));
    }
  }

  void Kill() {
    if (pid_ > 0) kill(pid_, SIGKILL);
  }

  // Reaps the child; returns its wait status.
  int Wait() {
    int status = 0;
    if (pid_ > 0) {
      while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
      pid_ = -1;
    }
    return status;
  }

  bool started() const { return pid_ > 0 && fd_ >= 0; }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  std::string buffer_;
};

// ---------------------------------------------------------------------------

TEST(RocksDbMetaStore, CreatesDirectoryAndReopenKeepsEverything) {
  ScratchDir tmp;
  const std::string dir = tmp.Sub("a/b/meta");
  std::map<std::string, std::string> expected;
  {
    std::unique_ptr<MetaStore> store = OpenOrDie(dir);
    ASSERT_NE(store, nullptr);
    for (int i = 0; i < 300; ++i) {
      WriteBatch b;
      const std::string key = absl::StrCat("k/", i % 100);
      const std::string value = absl::StrCat("v", i, std::string("\0\xff", 2));
      b.Put(key, value);
      expected[key] = value;
      if (i % 7 == 0) {
        b.Delete(absl::StrCat("k/", (i + 50) % 100));
        expected.erase(absl::StrCat("k/", (i + 50) % 100));
      }
      if (i % 2 == 0) {
        ASSERT_TRUE(store->Commit(std::move(b)).ok());
      } else {
        store->Submit(std::move(b));  // left for the destructor to drain
      }
    }
    EXPECT_EQ(Dump(*store), expected);
  }
  std::unique_ptr<MetaStore> store = OpenOrDie(dir);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(Dump(*store), expected);
  EXPECT_EQ(store->stats().batches_written, 0u);
  // Sequence numbers restart with the process; the data does not.
  EXPECT_EQ(store->Submit(WriteBatch()), 1u);
}

// Group commit, deterministically: in each round 64 committers submit while
// the writer is held (after it has taken at most the first batch), then wait
// for durability together; the round costs at most two WAL syncs, as counted
// both by stats().fsyncs and by the file system RocksDB writes through. (The
// grouping factor under free-running load is measured by
// bench/meta_store_bench.cc, not asserted here.)
TEST(RocksDbMetaStore, GroupCommitSharesFsyncsAmongConcurrentCommitters) {
  ScratchDir tmp;
  Gate gate;
  auto fs = std::make_shared<PowerCutFileSystem>();
  RocksDbOptions opts;
  opts.test_file_system = fs;
  opts.test_write_hook = [&gate] {
    gate.Pass();
    return absl::OkStatus();
  };
  std::unique_ptr<MetaStore> store = OpenOrDie(tmp.path(), opts);
  ASSERT_NE(store, nullptr);
  const uint64_t wal_syncs_before = fs->syncs(".log");
  constexpr int kThreads = 64;
  constexpr int kRounds = 5;
  for (int round = 0; round < kRounds; ++round) {
    gate.Close();
    std::atomic<int> submitted{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        WriteBatch b;
        b.Put(absl::StrCat("t/", t, "/", round), std::string(100, 'x'));
        const uint64_t seq = store->Submit(std::move(b));
        ++submitted;
        EXPECT_TRUE(store->AwaitDurable(seq).ok());
      });
    }
    // Wait (without sleeping) until every committer has submitted.
    while (submitted.load() < kThreads) std::this_thread::yield();
    gate.Open();
    for (std::thread& t : threads) t.join();
  }
  const StoreStats stats = store->stats();
  EXPECT_EQ(stats.batches_written, uint64_t{kThreads * kRounds});
  EXPECT_GE(stats.fsyncs, uint64_t{kRounds});
  EXPECT_LE(stats.fsyncs, uint64_t{2 * kRounds})
      << stats.fsyncs << " fsyncs for " << stats.batches_written << " batches";
  EXPECT_EQ(stats.fsyncs, fs->syncs(".log") - wal_syncs_before)
      << "stats().fsyncs must count the WAL syncs that happened";
  EXPECT_EQ(Dump(*store).size(), size_t{kThreads * kRounds});
}

// stats().fsyncs counts syncs RocksDB did, not writes: one per commit done
// one at a time, none when writes are not synced (RocksDbOptions::
// test_sync_writes = false), matching the syncs the file system saw.
TEST(RocksDbMetaStore, FsyncsCountsSyncsNotWrites) {
  for (bool sync : {true, false}) {
    SCOPED_TRACE(sync ? "sync on" : "sync off");
    ScratchDir tmp;
    auto fs = std::make_shared<PowerCutFileSystem>();
    RocksDbOptions opts;
    opts.test_file_system = fs;
    opts.test_sync_writes = sync;
    std::unique_ptr<MetaStore> store = OpenOrDie(tmp.path(), opts);
    ASSERT_NE(store, nullptr);
    const uint64_t wal_syncs_before = fs->syncs(".log");
    for (int i = 0; i < 10; ++i) {
      WriteBatch b;
      b.Put(absl::StrCat("k", i), "v");
      ASSERT_TRUE(store->Commit(std::move(b)).ok());
    }
    ASSERT_TRUE(store->Commit(WriteBatch()).ok());  // empty: no write, no sync
    const StoreStats stats = store->stats();
    EXPECT_EQ(stats.batches_written, 11u);
    EXPECT_EQ(stats.fsyncs, sync ? 10u : 0u);
    EXPECT_EQ(fs->syncs(".log") - wal_syncs_before, stats.fsyncs);
  }
}

// Deterministic: while the writer is held, every batch submitted queues up;
// once released they go to disk in at most two writes (the one the writer had
// already taken, and all the rest).
TEST(RocksDbMetaStore, BatchesQueuedDuringAWriteShareTheNextFsync) {
  ScratchDir tmp;
  Gate gate;
  RocksDbOptions opts;
  opts.test_write_hook = [&gate] {
    gate.Pass();
    return absl::OkStatus();
  };
  std::unique_ptr<MetaStore> store = OpenOrDie(tmp.path(), opts);
  ASSERT_NE(store, nullptr);
  gate.Close();
  std::atomic<uint64_t> max_seq{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 32; ++t) {
    threads.emplace_back([&, t] {
      WriteBatch b;
      b.Put(absl::StrCat("k", t), "v");
      const uint64_t seq = store->Submit(std::move(b));
      uint64_t seen = max_seq.load();
      while (seq > seen && !max_seq.compare_exchange_weak(seen, seq)) {
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(store->stats().fsyncs, 0u);
  gate.Open();
  ASSERT_TRUE(store->AwaitDurable(max_seq.load()).ok());
  EXPECT_EQ(store->stats().batches_written, 32u);
  EXPECT_LE(store->stats().fsyncs, 2u);
}

TEST(RocksDbMetaStore, SubmitWaitsWhenQueuedBytesReachTheLimit) {
  ScratchDir tmp;
  Gate gate;
  RocksDbOptions opts;
  opts.max_queued_bytes = 4096;
  opts.test_write_hook = [&gate] {
    gate.Pass();
    return absl::OkStatus();
  };
  std::unique_ptr<MetaStore> store = OpenOrDie(tmp.path(), opts);
  ASSERT_NE(store, nullptr);
  auto batch = [](int i) {
    WriteBatch b;
    b.Put(absl::StrCat("k", i), std::string(1500, 'v'));
    return b;
  };
  const size_t one = batch(0).byte_size();

  // A batch larger than the whole limit is admitted into an empty queue.
  WriteBatch huge;
  huge.Put("huge", std::string(10000, 'h'));
  ASSERT_TRUE(store->Commit(std::move(huge)).ok());

  gate.Close();
  store->Submit(batch(1));
  const uint64_t s2 = store->Submit(batch(2));
  EXPECT_EQ(store->stats().queued_bytes, 2 * one);
  EXPECT_EQ(store->stats().submit_waits, 0u);

  std::atomic<uint64_t> s3{0};
  std::thread blocked([&] { s3 = store->Submit(batch(3)); });
  // Wait (without sleeping) until the third Submit has found the queue full.
  while (store->stats().submit_waits == 0) std::this_thread::yield();
  EXPECT_EQ(s3.load(), 0u) << "Submit returned although the queue was full";
  EXPECT_EQ(store->stats().queued_bytes, 2 * one) << "the queue grew past its limit";

  gate.Open();
  blocked.join();
  ASSERT_GT(s3.load(), s2);
  ASSERT_TRUE(store->AwaitDurable(s3.load()).ok());
  EXPECT_EQ(store->stats().queued_bytes, 0u);
  EXPECT_EQ(Dump(*store).size(), 4u);
}

// For callers that decide their batches under a lock of their own: they
// wait for room before taking it (WaitForRoom), then SubmitNoWait under it,
// which never waits even when the queue is past its limit.
TEST(RocksDbMetaStore, WaitForRoomWaitsForTheLimitAndSubmitNoWaitNever) {
  ScratchDir tmp;
  Gate gate;
  RocksDbOptions opts;
  opts.max_queued_bytes = 4096;
  opts.test_write_hook = [&gate] {
    gate.Pass();
    return absl::OkStatus();
  };
  std::unique_ptr<MetaStore> store = OpenOrDie(tmp.path(), opts);
  ASSERT_NE(store, nullptr);
  auto batch = [](int i) {
    WriteBatch b;
    b.Put(absl::StrCat("k", i), std::string(1500, 'v'));
    return b;
  };
  const size_t one = batch(0).byte_size();

  store->WaitForRoom();  // empty queue: at once
  gate.Close();
  store->SubmitNoWait(batch(1));
  store->SubmitNoWait(batch(2));
  const uint64_t s3 = store->SubmitNoWait(batch(3));  // past the limit, admitted at once
  EXPECT_EQ(store->stats().queued_bytes, 3 * one);
  EXPECT_EQ(store->stats().submit_waits, 0u);

  std::atomic<bool> room{false};
  std::thread waiter([&] {
    store->WaitForRoom();
    room = true;
  });
  // Wait (without sleeping) until WaitForRoom has found the queue full.
  while (store->stats().submit_waits == 0) std::this_thread::yield();
  EXPECT_FALSE(room.load()) << "WaitForRoom returned although the queue was full";

  gate.Open();
  waiter.join();
  EXPECT_TRUE(room.load());
  ASSERT_TRUE(store->AwaitDurable(s3).ok());
  EXPECT_EQ(store->stats().queued_bytes, 0u);
  EXPECT_EQ(Dump(*store).size(), 3u);
}

TEST(RocksDbMetaStore, SecondOpenInThisProcessFailsWithLockError) {
  ScratchDir tmp;
  std::unique_ptr<MetaStore> store = OpenOrDie(tmp.path());
  ASSERT_NE(store, nullptr);
  absl::StatusOr<std::unique_ptr<MetaStore>> second = OpenRocksDbMetaStore(tmp.path());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(tmp.path()));
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("already open"));
  EXPECT_TRUE(store->Commit(WriteBatch()).ok()) << "the first store is unaffected";
}

TEST(RocksDbMetaStore, SecondOpenFromAnotherProcessFailsWithLockError) {
  ScratchDir tmp;
  std::unique_ptr<MetaStore> store = OpenOrDie(tmp.path());
  ASSERT_NE(store, nullptr);
  std::string report;
  {
    Child child("open", tmp.path(), 0);
    ASSERT_TRUE(child.started());
    ASSERT_TRUE(child.ReadLine(&report));
    const int status = child.Wait();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "wait status " << status;
  }
  EXPECT_THAT(report, ::testing::StartsWith("FAILED_PRECONDITION"));
  EXPECT_THAT(report, HasSubstr("already open"));
  EXPECT_THAT(report, HasSubstr(tmp.path()));
  WriteBatch b;
  b.Put("still", "works");
  EXPECT_TRUE(store->Commit(std::move(b)).ok());
}

TEST(RocksDbMetaStore, OtherFormatVersionIsRefused) {
  ScratchDir tmp;
  {
    RocksDbOptions opts;
    opts.test_create_format_version = "2";
    std::unique_ptr<MetaStore> store = OpenOrDie(tmp.path(), opts);
    ASSERT_NE(store, nullptr);
  }
  absl::StatusOr<std::unique_ptr<MetaStore>> store = OpenRocksDbMetaStore(tmp.path());
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition) << store.status();
  EXPECT_THAT(std::string(store.status().message()), HasSubstr("format version \"2\""));
  EXPECT_THAT(std::string(store.status().message()), HasSubstr(tmp.path()));
}

TEST(RocksDbMetaStore, BadPathsAreRefused) {
  ScratchDir tmp;
  const std::string file = tmp.Sub("file");
  { std::ofstream(file) << "not a directory"; }
  absl::StatusOr<std::unique_ptr<MetaStore>> store = OpenRocksDbMetaStore(file);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument) << store.status();
  EXPECT_THAT(std::string(store.status().message()), HasSubstr(file));

  store = OpenRocksDbMetaStore(file + "/below");
  EXPECT_FALSE(store.ok());
  EXPECT_THAT(std::string(store.status().message()), HasSubstr(file));

  EXPECT_EQ(OpenRocksDbMetaStore("").status().code(), absl::StatusCode::kInvalidArgument);
  RocksDbOptions no_queue;
  no_queue.max_queued_bytes = 0;
  EXPECT_EQ(OpenRocksDbMetaStore(tmp.Sub("x"), no_queue).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RocksDbMetaStore, FailedWriteIsNotPersistedAndEarlierOnesAre) {
  ScratchDir tmp;
  std::atomic<bool> fail{false};
  {
    RocksDbOptions opts;
    opts.test_write_hook = [&fail] {
      return fail.load() ? absl::ResourceExhaustedError("disk full") : absl::OkStatus();
    };
    std::unique_ptr<MetaStore> store = OpenOrDie(tmp.path(), opts);
    ASSERT_NE(store, nullptr);
    WriteBatch good;
    good.Put("good", "1");
    ASSERT_TRUE(store->Commit(std::move(good)).ok());
    fail = true;
    WriteBatch bad;
    bad.Put("bad", "1");
    absl::Status s = store->Commit(std::move(bad));
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(std::string(s.message()), HasSubstr(tmp.path()));
    EXPECT_THAT(std::string(s.message()), HasSubstr("disk full"));
    WriteBatch refused;
    refused.Put("refused", "1");
    EXPECT_EQ(store->Commit(std::move(refused)).code(), absl::StatusCode::kUnavailable);
  }
  std::unique_ptr<MetaStore> store = OpenOrDie(tmp.path());
  ASSERT_NE(store, nullptr);
  EXPECT_EQ((std::map<std::string, std::string>{{"good", "1"}}), Dump(*store));
}

TEST(RocksDbMetaStore, FinalStateOfConcurrentSubmittersSurvivesReopen) {
  ScratchDir tmp;
  std::map<std::string, std::string> before;
  {
    std::unique_ptr<MetaStore> store = OpenOrDie(tmp.path());
    ASSERT_NE(store, nullptr);
    std::vector<std::thread> threads;
    for (int t = 0; t < 16; ++t) {
      threads.emplace_back([&store, t] {
        for (int i = 0; i < 100; ++i) {
          WriteBatch b;
          b.Put("shared", absl::StrCat(t, "/", i));
          b.Put(absl::StrCat("own/", t, "/", i % 10), absl::StrCat(i));
          if (i % 10 == 9) b.Delete(absl::StrCat("own/", t, "/", i % 7));
          store->Submit(std::move(b));
        }
      });
    }
    for (std::thread& t : threads) t.join();
    before = Dump(*store);  // includes batches not yet durable
  }
  std::unique_ptr<MetaStore> store = OpenOrDie(tmp.path());
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(Dump(*store), before);
}

// kill -9 of a process committing from several threads, three times over the
// same directory: every commit acknowledged before the kill is on disk, with
// its value, and each thread's commits are a gap-free prefix (Submit order).
TEST(RocksDbMetaStore, AcknowledgedCommitsSurviveKill9) {
  ScratchDir tmp;
  constexpr int kRounds = 3;
  constexpr int kAcksBeforeKill = 300;
  // acked[round][thread] = highest acknowledged i (-1: none).
  std::vector<std::vector<int>> acked(kRounds, std::vector<int>(kChildThreads, -1));
  for (int round = 0; round < kRounds; ++round) {
    Child child("commit-loop", tmp.path(), round);
    ASSERT_TRUE(child.started());
    int acks = 0;
    int acks_after_kill = 0;
    bool killed = false;
    std::string line;
    while (child.ReadLine(&line)) {  // until EOF: acks sent before death count too
      ASSERT_FALSE(line.starts_with("E ")) << "child failed: " << line;
      std::vector<std::string> parts = absl::StrSplit(line, ' ');
      int t = 0, i = 0;
      ASSERT_TRUE(parts.size() == 2 && absl::SimpleAtoi(parts[0], &t) &&
                  absl::SimpleAtoi(parts[1], &i) && t >= 0 && t < kChildThreads)
          << "bad report: " << line;
      EXPECT_EQ(i, acked[round][t] + 1) << "a thread acknowledges in order";
      acked[round][t] = i;
      if (killed) ++acks_after_kill;
      if (++acks == kAcksBeforeKill && !killed) {
        child.Kill();
        killed = true;
      }
    }
    std::cout << "[ info ] round " << round << ": " << acks << " acknowledged commits, "
              << acks_after_kill << " reported after SIGKILL was sent\n";
    const int status = child.Wait();
    ASSERT_TRUE(killed) << "child ended after " << acks << " acks, wait status " << status;
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "wait status " << status;

    std::unique_ptr<MetaStore> store = OpenOrDie(tmp.path());
    ASSERT_NE(store, nullptr);
    for (int r = 0; r <= round; ++r) {
      for (int t = 0; t < kChildThreads; ++t) {
        for (int i = 0; i <= acked[r][t]; ++i) {
          absl::StatusOr<std::string> v = store->Get(ChildKey(r, t, i));
          ASSERT_TRUE(v.ok()) << "round " << r << " thread " << t << " commit " << i
                              << " was acknowledged but is lost: " << v.status();
          ASSERT_EQ(*v, ChildValue(r, t, i));
        }
        // A thread commits one batch at a time: what survives is a prefix.
        int present = 0;
        absl::Status s = store->Scan(absl::StrCat("r", r, "/t", t, "/"),
                                     [&](std::string_view k, std::string_view) {
                                       EXPECT_EQ(k, ChildKey(r, t, present));
                                       ++present;
                                       return true;
                                     });
        ASSERT_TRUE(s.ok()) << s;
        EXPECT_LE(present, acked[r][t] + 2) << "at most one unacknowledged commit per thread";
      }
    }
    for (int t = 0; t < kChildThreads; ++t) {
      absl::StatusOr<std::string> last = store->Get(absl::StrCat("last/t", t));
      if (acked[round][t] < 0) continue;
      ASSERT_TRUE(last.ok()) << last.status();
      std::vector<std::string> parts = absl::StrSplit(*last, '/');
      int r = -1, i = -1;
      ASSERT_TRUE(parts.size() == 2 && absl::SimpleAtoi(parts[0], &r) && absl::SimpleAtoi(parts[1], &i));
      EXPECT_EQ(r, round);
      EXPECT_GE(i, acked[round][t]);
      EXPECT_EQ(store->Get(absl::StrCat("tmp/t", t)).status().code(), absl::StatusCode::kNotFound);
    }
  }
  int total = 0;
  for (const auto& per_round : acked) {
    for (int a : per_round) total += a + 1;
  }
  EXPECT_GE(total, kRounds * kAcksBeforeKill);
}

}  // namespace
}  // namespace ckpt::meta
