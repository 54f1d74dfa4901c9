// Power-cut tests of the RocksDB MetaStore (docs/meta.md "Durability").
//
// RocksDB runs on a PowerCutFileSystem. A seeded sequence of changes is
// committed through the store's public API; the power goes off at a seeded
// point (at the n-th sync of any file: during recovery, a commit or a flush;
// at the n-th WAL sync: in the middle of a commit; or right after the last
// acknowledgement); the store is destroyed with the power off (its last writes
// fail: an abandoned process), everything RocksDB wrote but did not sync is
// dropped (Cut), and the store reopened on the same directory must hold every
// change acknowledged before the cut, with its content (the commit whose write
// the cut interrupted may be there or not, whole). The kill -9 test in
// rocksdb_meta_store_test.cc cannot show this: the page cache survives it.
//
// The harness can fail: with the store's syncs turned off
// (RocksDbOptions::test_sync_writes = false) the same cuts lose acknowledged
// changes, and SyncOffLosesAcknowledgedChanges asserts that the loss is found.
// To see the main test itself fail that way:
//   CKPT_POWERCUT_SYNC_WRITES=0 rocksdb_meta_store_powercut_test
//       --gtest_filter='*AcknowledgedChangesSurvive*'
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/escaping.h"
#include "power_cut_file_system.h"
#include "rocksdb/file_system.h"
#include "scratch_dir.h"
#include "server/meta/store/meta_store.h"
#include "server/meta/store/rocksdb_meta_store.h"

namespace ckpt::meta {
namespace {

using State = std::map<std::string, std::string>;

State Dump(MetaStore& store) {
  State out;
  absl::Status s = store.Scan("", [&](std::string_view k, std::string_view v) {
    out.emplace(k, v);
    return true;
  });
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// A seeded random batch over the keys "<prefix>NN", applied to `*state` too.
// Values are binary, mostly small, some spanning RocksDB's 32 KiB WAL blocks.
WriteBatch RandomBatch(std::mt19937_64& rng, const std::string& prefix, State* state) {
  auto uniform = [&rng](uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  WriteBatch batch;
  const uint64_t ops = uniform(1, 4);
  for (uint64_t i = 0; i < ops; ++i) {
    std::string key = absl::StrCat(prefix, absl::Dec(uniform(0, 47), absl::kZeroPad2));
    if (uniform(0, 3) == 0) {
      state->erase(key);
      batch.Delete(std::move(key));
      continue;
    }
    const uint64_t kind = uniform(0, 19);
    const uint64_t size = kind < 14 ? uniform(0, 64) : kind < 19 ? uniform(100, 2000)
                                                                 : uniform(20000, 40000);
    std::string value(size, '\0');
    for (char& c : value) c = static_cast<char>(rng());
    (*state)[key] = value;
    batch.Put(std::move(key), std::move(value));
  }
  return batch;
}

std::string Describe(const State& state, const std::string& key) {
  auto it = state.find(key);
  if (it == state.end()) return "absent";
  return absl::StrCat(it->second.size(), " bytes \"",
                      absl::CHexEscape(it->second.substr(0, 8)), "...\"");
}

struct CutReport {
  int cuts = 0;
  int cuts_in_open = 0;
  int acknowledged = 0;      // commits that returned OK
  int interrupted_kept = 0;  // commits the cut interrupted, found whole after it
  int lost = 0;              // acknowledged key states missing or wrong after a cut
  std::vector<std::string> losses;  // the first few, described
};

// Checks a store reopened after a cut against `acked` (the state every
// acknowledged commit made) and `interrupted` (that plus the commit the cut
// interrupted, if any). Continues from what is on disk.
void CheckAfterCut(MetaStore& store, State* acked, std::optional<State>* interrupted,
                   CutReport* report, const std::string& where) {
  const State found = Dump(store);
  if (found == *acked) {
  } else if (interrupted->has_value() && found == **interrupted) {
    ++report->interrupted_kept;
  } else {
    std::map<std::string, bool> keys;
    for (const auto& [k, v] : *acked) keys[k] = true;
    for (const auto& [k, v] : found) keys[k] = true;
    for (const auto& [k, unused] : keys) {
      auto a = acked->find(k);
      auto f = found.find(k);
      if (a != acked->end() && f != found.end() && a->second == f->second) continue;
      if (a == acked->end() && f == found.end()) continue;
      ++report->lost;
      if (report->losses.size() < 5) {
        report->losses.push_back(absl::StrCat("after ", where, ": key ", k, " acknowledged ",
                                              Describe(*acked, k), ", found ",
                                              Describe(found, k)));
      }
    }
  }
  *acked = found;
  interrupted->reset();
}

// `rounds` power cuts over one directory, single committer; see the top.
CutReport RunPowerCuts(const std::string& dir, bool sync_writes, uint64_t seed, int rounds) {
  auto fs = std::make_shared<PowerCutFileSystem>();
  RocksDbOptions opts;
  opts.test_file_system = fs;
  opts.test_sync_writes = sync_writes;
  std::mt19937_64 rng(seed);
  auto uniform = [&rng](uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  CutReport report;
  State acked;
  std::optional<State> interrupted;
  std::string previous_cut;  // where the last cut came, for messages
  for (int round = 0; round <= rounds; ++round) {
    const bool last = round == rounds;  // only reopens and checks
    const uint64_t commits = uniform(1, 40);
    const uint64_t mode = uniform(0, 2);
    uint64_t at_sync = 0;
    if (!last && mode == 0) {
      at_sync = uniform(1, 12);
      fs->PowerOffAtSync(at_sync);
    } else if (!last && mode == 1) {
      at_sync = uniform(1, commits);
      fs->PowerOffAtSync(at_sync, ".log");
    }
    const std::string where =
        absl::StrCat("round ", round, " (cut ",
                     mode == 0 ? absl::StrCat("at sync ", at_sync)
                               : mode == 1 ? absl::StrCat("at WAL sync ", at_sync) : "after acks",
                     ")");
    {
      absl::StatusOr<std::unique_ptr<MetaStore>> store = OpenRocksDbMetaStore(dir, opts);
      if (!store.ok()) {
        EXPECT_FALSE(fs->powered()) << where << ": open failed with the power on: "
                                    << store.status();
        ++report.cuts_in_open;
      } else {
        // What the previous cut left.
        if (round > 0) CheckAfterCut(**store, &acked, &interrupted, &report, previous_cut);
        if (last) break;
        for (uint64_t i = 0; i < commits; ++i) {
          State next = acked;
          WriteBatch batch = RandomBatch(rng, "k/", &next);
          absl::Status s = (*store)->Commit(std::move(batch));
          if (!s.ok()) {
            EXPECT_FALSE(fs->powered()) << where << ": commit failed with the power on: " << s;
            interrupted = std::move(next);
            break;
          }
          acked = std::move(next);
          ++report.acknowledged;
        }
      }
      fs->PowerOff();
    }  // the store is destroyed with the power off: its last writes fail
    absl::Status cut = fs->Cut();
    EXPECT_TRUE(cut.ok()) << cut;
    ++report.cuts;
    previous_cut = where;
  }
  return report;
}

std::ostream& operator<<(std::ostream& out, const CutReport& r) {
  out << r.cuts << " power cuts (" << r.cuts_in_open << " during open), " << r.acknowledged
      << " acknowledged commits, " << r.interrupted_kept
      << " interrupted commits found whole, " << r.lost << " acknowledged key states lost";
  for (const std::string& loss : r.losses) out << "\n    " << loss;
  return out;
}

bool SyncWritesFromEnv() {
  const char* v = getenv("CKPT_POWERCUT_SYNC_WRITES");
  return v == nullptr || std::string(v) != "0";
}

TEST(RocksDbMetaStorePowerCut, AcknowledgedChangesSurvivePowerCuts) {
  const bool sync_writes = SyncWritesFromEnv();
  for (uint64_t seed : {41u, 42u, 43u}) {
    ScratchDir tmp;
    const CutReport report = RunPowerCuts(tmp.Sub("meta"), sync_writes, seed, /*rounds=*/12);
    std::cout << "[ info ] seed " << seed << (sync_writes ? "" : " (sync off)") << ": " << report
              << "\n";
    EXPECT_EQ(report.lost, 0) << "seed " << seed << ": " << report;
    EXPECT_GE(report.acknowledged, 20) << "seed " << seed << ": too few commits to prove much";
  }
}

// The harness can fail: without sync the same cuts lose acknowledged changes.
TEST(RocksDbMetaStorePowerCut, SyncOffLosesAcknowledgedChanges) {
  ScratchDir tmp;
  const CutReport report = RunPowerCuts(tmp.Sub("meta"), /*sync_writes=*/false, 41, 12);
  std::cout << "[ info ] sync off: " << report << "\n";
  EXPECT_GT(report.lost, 0) << "the power-cut harness did not notice unsynced commits: "
                            << report;
}

// Eight committers share group commits; the power goes off in the middle of
// the n-th WAL sync, with batches of several threads in the group. Each
// thread's acknowledged commits are all there; its interrupted one may be.
TEST(RocksDbMetaStorePowerCut, ConcurrentCommittersKeepTheirAcknowledgedChanges) {
  constexpr int kThreads = 8;
  constexpr int kMaxCommits = 400;  // per thread and round, should no cut come
  ScratchDir tmp;
  const std::string dir = tmp.Sub("meta");
  auto fs = std::make_shared<PowerCutFileSystem>();
  RocksDbOptions opts;
  opts.test_file_system = fs;
  std::vector<State> acked(kThreads);
  std::vector<std::optional<State>> interrupted(kThreads);
  CutReport report;
  std::mt19937_64 rng(41);
  for (int round = 0; round <= 4; ++round) {
    const uint64_t at_sync = std::uniform_int_distribution<uint64_t>(5, 60)(rng);
    absl::StatusOr<std::unique_ptr<MetaStore>> store = OpenRocksDbMetaStore(dir, opts);
    ASSERT_TRUE(store.ok()) << store.status();
    if (round > 0) {
      const State all = Dump(**store);
      for (int t = 0; t < kThreads; ++t) {
        // Each thread's keys are apart: check them as a store of their own.
        const std::string prefix = absl::StrCat("t", t, "/");
        State found;
        for (const auto& [k, v] : all) {
          if (k.starts_with(prefix)) found.emplace(k, v);
        }
        if (found == acked[t]) {
        } else if (interrupted[t].has_value() && found == *interrupted[t]) {
          ++report.interrupted_kept;
        } else {
          ++report.lost;
          ADD_FAILURE() << "round " << round << " thread " << t << ": acknowledged changes lost ("
                        << acked[t].size() << " keys acknowledged, " << found.size()
                        << " found)";
        }
        acked[t] = std::move(found);
        interrupted[t].reset();
      }
    }
    if (round == 4) break;
    fs->PowerOffAtSync(at_sync, ".log");
    std::vector<std::thread> threads;
    std::atomic<int> acks{0};
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 own_rng(static_cast<uint64_t>(round * kThreads + t));
        for (int i = 0; i < kMaxCommits; ++i) {
          State next = acked[t];
          WriteBatch batch = RandomBatch(own_rng, absl::StrCat("t", t, "/"), &next);
          if (!(*store)->Commit(std::move(batch)).ok()) {
            interrupted[t] = std::move(next);
            return;
          }
          acked[t] = std::move(next);
          ++acks;
        }
      });
    }
    for (std::thread& t : threads) t.join();
    EXPECT_FALSE(fs->powered()) << "round " << round << ": no cut within " << kMaxCommits
                                << " commits per thread";
    report.acknowledged += acks.load();
    fs->PowerOff();
    store = absl::CancelledError("abandoned");  // destroyed with the power off
    ASSERT_TRUE(fs->Cut().ok());
    ++report.cuts;
  }
  std::cout << "[ info ] " << kThreads << " committers: " << report << "\n";
  EXPECT_EQ(report.lost, 0);
  EXPECT_GE(report.acknowledged, 4 * 5);
}

// The file system itself: what a cut keeps.
std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(PowerCutFileSystem, CutKeepsSyncedBytesAndSyncedDirectoryEntriesOnly) {
  ScratchDir tmp;
  PowerCutFileSystem fs;
  const rocksdb::IOOptions io;
  const rocksdb::FileOptions fo;
  auto write = [&](const std::string& name, const std::string& a, bool sync_a,
                   const std::string& b) {
    std::unique_ptr<rocksdb::FSWritableFile> f;
    ASSERT_TRUE(fs.NewWritableFile(tmp.Sub(name), fo, &f, nullptr).ok());
    ASSERT_TRUE(f->Append(a, io, nullptr).ok());
    if (sync_a) {
      ASSERT_TRUE(f->Sync(io, nullptr).ok());
    }
    ASSERT_TRUE(f->Append(b, io, nullptr).ok());
    ASSERT_TRUE(f->RangeSync(0, a.size() + b.size(), io, nullptr).ok());
    ASSERT_TRUE(f->Close(io, nullptr).ok());
  };
  { std::ofstream(tmp.Sub("old")) << "durable before"; }  // never seen: durable

  std::unique_ptr<rocksdb::FSDirectory> dir;
  ASSERT_TRUE(fs.NewDirectory(tmp.path(), io, &dir, nullptr).ok());
  write("synced", "kept", true, "+lost");
  ASSERT_TRUE(dir->Fsync(io, nullptr).ok());  // "synced" is now in the directory for good
  write("entry-not-synced", "data", true, "");
  write("current.tmp", "new", true, "");
  ASSERT_TRUE(fs.RenameFile(tmp.Sub("current.tmp"), tmp.Sub("old"), io, nullptr).ok());
  ASSERT_TRUE(fs.DeleteFile(tmp.Sub("synced"), io, nullptr).ok());
  EXPECT_EQ(ReadAll(tmp.Sub("old")), "new");
  EXPECT_EQ(fs.syncs(), 3u);

  fs.PowerOff();
  std::unique_ptr<rocksdb::FSWritableFile> f;
  EXPECT_TRUE(fs.NewWritableFile(tmp.Sub("after"), fo, &f, nullptr).IsIOError());
  EXPECT_TRUE(dir->Fsync(io, nullptr).IsIOError()) << "nothing syncs with the power off";

  ASSERT_TRUE(fs.Cut().ok());
  EXPECT_TRUE(fs.powered());
  EXPECT_EQ(ReadAll(tmp.Sub("synced")), "kept") << "unsynced tail dropped, delete undone";
  EXPECT_FALSE(std::filesystem::exists(tmp.Sub("entry-not-synced")));
  EXPECT_FALSE(std::filesystem::exists(tmp.Sub("current.tmp")));
  EXPECT_EQ(ReadAll(tmp.Sub("old")), "durable before") << "rename undone";

  // Synced data and a synced directory survive.
  write("wal.log", "abc", true, "def");
  ASSERT_TRUE(dir->Fsync(io, nullptr).ok());
  fs.PowerOffAtSync(1, ".log");
  {
    std::unique_ptr<rocksdb::FSWritableFile> wal;
    ASSERT_TRUE(fs.ReopenWritableFile(tmp.Sub("wal.log"), fo, &wal, nullptr).ok());
    ASSERT_TRUE(wal->Append("ghi", io, nullptr).ok());
    EXPECT_TRUE(wal->Sync(io, nullptr).IsIOError()) << "the power goes off at this sync";
    EXPECT_FALSE(fs.powered());
    EXPECT_TRUE(wal->Close(io, nullptr).ok());
  }
  ASSERT_TRUE(fs.Cut().ok());
  EXPECT_EQ(ReadAll(tmp.Sub("wal.log")), "abc");
  EXPECT_EQ(fs.syncs(".log"), 1u);
}

}  // namespace
}  // namespace ckpt::meta
