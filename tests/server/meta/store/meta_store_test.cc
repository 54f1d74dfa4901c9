// Behavioural tests of the MetaStore contract (meta_store.h), run over both
// implementations: the in-memory twin and RocksDB in a temporary directory.
#include "server/meta/store/meta_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/meta/store/mem_meta_store.h"
#include "server/meta/store/rocksdb_meta_store.h"

namespace ckpt::meta {
namespace {

using ::testing::HasSubstr;
using ::testing::Pair;
using KeyValues = std::vector<std::pair<std::string, std::string>>;

// A directory under the test temp dir, removed with everything in it.
class ScopedTempDir {
 public:
  ScopedTempDir() {
    std::string pattern = (std::filesystem::path(::testing::TempDir()) / "meta_store_test.XXXXXX");
    char* made = mkdtemp(pattern.data());
    EXPECT_NE(made, nullptr) << "mkdtemp " << pattern;
    path_ = pattern;
  }
  ~ScopedTempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Holds the store's writer inside the write hook while closed, so a test can
// keep batches pending (submitted, not durable) for as long as it likes.
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
  // Blocks while the gate is closed.
  void Pass() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(+[](bool* closed) { return !*closed; }, &closed_));
  }

 private:
  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

struct Param {
  std::string name;
  // Whether writes happen on another thread (a Gate may then hold them).
  bool async;

  friend void PrintTo(const Param& p, std::ostream* os) { *os << p.name; }
};

class MetaStoreTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override { store_ = Make({}); }

  // A fresh store (in its own directory for RocksDB) with `hook` installed.
  std::unique_ptr<MetaStore> Make(WriteHook hook) {
    if (GetParam().name == "Mem") return NewMemMetaStore({.test_write_hook = std::move(hook)});
    auto dir = std::make_unique<ScopedTempDir>();
    RocksDbOptions opts;
    opts.test_write_hook = std::move(hook);
    absl::StatusOr<std::unique_ptr<MetaStore>> store = OpenRocksDbMetaStore(dir->path(), opts);
    EXPECT_TRUE(store.ok()) << store.status();
    dirs_.push_back(std::move(dir));
    return store.ok() ? std::move(*store) : nullptr;
  }

  static KeyValues ScanAll(MetaStore& store, std::string_view prefix, size_t limit = SIZE_MAX) {
    KeyValues out;
    absl::Status s = store.Scan(prefix, [&](std::string_view k, std::string_view v) {
      out.emplace_back(std::string(k), std::string(v));
      return out.size() < limit;
    });
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }

  static std::string GetOr(MetaStore& store, std::string_view key) {
    absl::StatusOr<std::string> v = store.Get(key);
    if (absl::IsNotFound(v.status())) return "<absent>";
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : "<error>";
  }

  std::vector<std::unique_ptr<ScopedTempDir>> dirs_;  // outlive the stores below
  std::unique_ptr<MetaStore> store_;
};

TEST_P(MetaStoreTest, AppliesBatchOperationsInOrder) {
  WriteBatch b;
  b.Put("a", "1");
  b.Put("b", "2");
  b.Delete("a");
  b.Put("c", "3");
  b.Put("c", "4");
  b.Put("d", "x");
  b.Delete("d");
  b.Delete("never-existed");
  b.Put("e", "1");
  b.Delete("e");
  b.Put("e", "2");
  EXPECT_EQ(b.size(), 11u);
  ASSERT_TRUE(store_->Commit(std::move(b)).ok());
  EXPECT_EQ(GetOr(*store_, "a"), "<absent>");
  EXPECT_EQ(GetOr(*store_, "b"), "2");
  EXPECT_EQ(GetOr(*store_, "c"), "4");
  EXPECT_EQ(GetOr(*store_, "d"), "<absent>");
  EXPECT_EQ(GetOr(*store_, "e"), "2");

  WriteBatch b2;
  b2.Put("a", "again");
  b2.Delete("b");
  b2.Put("c", "5");
  ASSERT_TRUE(store_->Commit(std::move(b2)).ok());
  EXPECT_THAT(ScanAll(*store_, ""),
              ::testing::ElementsAre(Pair("a", "again"), Pair("c", "5"), Pair("e", "2")));
}

TEST_P(MetaStoreTest, GetOfMissingKeyIsNotFoundNamingTheKey) {
  absl::StatusOr<std::string> v = store_->Get(std::string("no\0such", 7));
  EXPECT_EQ(v.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("no\\000such"));
}

TEST_P(MetaStoreTest, ScanVisitsPrefixInKeyOrder) {
  WriteBatch b;
  for (const char* k : {"node/1", "job/b", "jobx", "job/a/2", "jo", "job", "job/a/1", "job/"}) {
    b.Put(k, absl::StrCat("v-", k));
  }
  ASSERT_TRUE(store_->Commit(std::move(b)).ok());
  EXPECT_THAT(ScanAll(*store_, "job/"),
              ::testing::ElementsAre(Pair("job/", "v-job/"), Pair("job/a/1", "v-job/a/1"),
                                     Pair("job/a/2", "v-job/a/2"), Pair("job/b", "v-job/b")));
  std::vector<std::string> all;
  for (const auto& [k, v] : ScanAll(*store_, "")) all.push_back(k);
  EXPECT_THAT(all, ::testing::ElementsAre("jo", "job", "job/", "job/a/1", "job/a/2", "job/b",
                                          "jobx", "node/1"));
  EXPECT_TRUE(ScanAll(*store_, "zzz").empty());
  EXPECT_TRUE(ScanAll(*store_, "job/c").empty());
}

TEST_P(MetaStoreTest, ScanStopsWhenCallbackReturnsFalse) {
  WriteBatch b;
  for (int i = 0; i < 10; ++i) b.Put(absl::StrCat("k", i), "v");
  ASSERT_TRUE(store_->Commit(std::move(b)).ok());
  int calls = 0;
  absl::Status s = store_->Scan("k", [&](std::string_view, std::string_view) { return ++calls < 3; });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(calls, 3);
}

TEST_P(MetaStoreTest, ScanCallbackMayCallTheStore) {
  WriteBatch b;
  b.Put("s/1", "a");
  b.Put("s/2", "b");
  ASSERT_TRUE(store_->Commit(std::move(b)).ok());
  std::vector<std::string> seen;
  absl::Status s = store_->Scan("s/", [&](std::string_view k, std::string_view) {
    seen.emplace_back(k);
    WriteBatch inner;
    inner.Put(std::string(k) + "x", "new");  // sorts right after k: must not be seen
    EXPECT_TRUE(store_->Commit(std::move(inner)).ok());
    EXPECT_TRUE(store_->Get(k).ok());
    return true;
  });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_THAT(seen, ::testing::ElementsAre("s/1", "s/2"));
  EXPECT_EQ(ScanAll(*store_, "s/").size(), 4u);
}

TEST_P(MetaStoreTest, EmptyBatchesGetSequenceNumbersAndAreDurable) {
  WriteBatch empty;
  EXPECT_TRUE(empty.empty());
  EXPECT_EQ(empty.size(), 0u);
  const uint64_t s1 = store_->Submit(WriteBatch());
  WriteBatch b;
  b.Put("k", "v");
  const uint64_t s2 = store_->Submit(std::move(b));
  const uint64_t s3 = store_->Submit(WriteBatch());
  EXPECT_LT(s1, s2);
  EXPECT_LT(s2, s3);
  EXPECT_TRUE(store_->AwaitDurable(s3).ok());
  EXPECT_TRUE(store_->AwaitDurable(s1).ok());
  EXPECT_TRUE(store_->Commit(WriteBatch()).ok());
  EXPECT_EQ(GetOr(*store_, "k"), "v");
  StoreStats stats = store_->stats();
  EXPECT_EQ(stats.batches_written, 4u);
  EXPECT_GE(stats.fsyncs, 1u);
  EXPECT_LE(stats.fsyncs, 1u) << "an empty batch must cost no write";
}

TEST_P(MetaStoreTest, AwaitDurableOfUnknownSequenceIsInvalidArgument) {
  EXPECT_TRUE(store_->AwaitDurable(0).ok());
  EXPECT_EQ(store_->AwaitDurable(1).code(), absl::StatusCode::kInvalidArgument);
  const uint64_t seq = store_->Submit(WriteBatch());
  EXPECT_TRUE(store_->AwaitDurable(seq).ok());
  EXPECT_EQ(store_->AwaitDurable(seq + 1).code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(MetaStoreTest, BinaryKeysAndValuesWithNulBytes) {
  const std::string k_a("a", 1), k_a0("a\0", 2), k_a0b("a\0b", 3), k_a01("a\x01", 2),
      k_a7f("a\x7f", 2), k_a80("a\x80", 2), k_aff("a\xff", 2), k_aff0("a\xff\0", 3);
  const std::string v_nul("\0\0\0", 3), v_mixed("x\0y\xffz", 5);
  std::string v_big(100000, '\0');
  for (size_t i = 0; i < v_big.size(); i += 7) v_big[i] = static_cast<char>(i);
  WriteBatch b;
  // Added out of order: the store orders them bytewise (unsigned).
  b.Put(k_aff0, "7");
  b.Put(k_a80, "5");
  b.Put(k_a0b, v_mixed);
  b.Put(k_a, "");
  b.Put(k_aff, v_big);
  b.Put(k_a0, v_nul);
  b.Put(k_a7f, "4");
  b.Put(k_a01, "3");
  ASSERT_TRUE(store_->Commit(std::move(b)).ok());
  EXPECT_EQ(GetOr(*store_, k_a), "");
  EXPECT_EQ(GetOr(*store_, k_a0), v_nul);
  EXPECT_EQ(GetOr(*store_, k_a0b), v_mixed);
  EXPECT_EQ(GetOr(*store_, k_aff), v_big);
  EXPECT_EQ(GetOr(*store_, std::string("a\0c", 3)), "<absent>");
  std::vector<std::string> keys;
  for (const auto& [k, v] : ScanAll(*store_, "a")) keys.push_back(k);
  EXPECT_THAT(keys,
              ::testing::ElementsAre(k_a, k_a0, k_a0b, k_a01, k_a7f, k_a80, k_aff, k_aff0));
  EXPECT_THAT(ScanAll(*store_, k_a0), ::testing::ElementsAre(Pair(k_a0, v_nul), Pair(k_a0b, v_mixed)));
  EXPECT_THAT(ScanAll(*store_, k_aff), ::testing::ElementsAre(Pair(k_aff, v_big), Pair(k_aff0, "7")));

  WriteBatch del;
  del.Delete(k_a0);
  ASSERT_TRUE(store_->Commit(std::move(del)).ok());
  EXPECT_EQ(GetOr(*store_, k_a0), "<absent>");
  EXPECT_EQ(GetOr(*store_, k_a0b), v_mixed);
}

// Reads see submitted batches before they are durable. With RocksDB a gate
// holds the writer, so these reads are served while nothing has been written.
TEST_P(MetaStoreTest, ReadsSeeSubmittedButNotYetDurableBatches) {
  Gate gate;
  std::unique_ptr<MetaStore> store = Make([&gate] {
    gate.Pass();
    return absl::OkStatus();
  });
  WriteBatch durable;
  durable.Put("k/a", "1");
  durable.Put("k/c", "3");
  durable.Put("k/e", "5");
  ASSERT_TRUE(store->Commit(std::move(durable)).ok());
  const uint64_t fsyncs_before = store->stats().fsyncs;

  if (GetParam().async) gate.Close();
  WriteBatch b1;
  b1.Put("k/b", "2");
  b1.Delete("k/c");
  const uint64_t s1 = store->Submit(std::move(b1));
  WriteBatch b2;
  b2.Put("k/e", "5-new");
  b2.Put("k/f", "6");
  b2.Delete("k/f");
  b2.Put("k/g", "7");
  const uint64_t s2 = store->Submit(std::move(b2));

  EXPECT_EQ(GetOr(*store, "k/a"), "1");
  EXPECT_EQ(GetOr(*store, "k/b"), "2");
  EXPECT_EQ(GetOr(*store, "k/c"), "<absent>");
  EXPECT_EQ(GetOr(*store, "k/e"), "5-new");
  EXPECT_EQ(GetOr(*store, "k/f"), "<absent>");
  const KeyValues expected = {{"k/a", "1"}, {"k/b", "2"}, {"k/e", "5-new"}, {"k/g", "7"}};
  EXPECT_EQ(ScanAll(*store, "k/"), expected);
  if (GetParam().async) {
    EXPECT_EQ(store->stats().fsyncs, fsyncs_before) << "the gate should hold every write";
    EXPECT_GT(store->stats().queued_bytes, 0u);
  }

  gate.Open();
  EXPECT_TRUE(store->AwaitDurable(s2).ok());
  EXPECT_TRUE(store->AwaitDurable(s1).ok());
  EXPECT_EQ(ScanAll(*store, "k/"), expected);
  EXPECT_EQ(store->stats().queued_bytes, 0u);
}

// Many threads submit concurrently; the final state is that of the batch with
// the highest sequence number, for the shared key and for each thread's keys.
TEST_P(MetaStoreTest, ConcurrentSubmittersFinalStateFollowsSubmitOrder) {
  constexpr int kThreads = 16;
  constexpr int kPerThread = 150;
  absl::Mutex mu;
  std::vector<std::pair<uint64_t, std::string>> shared_writes;  // (seq, value)
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::pair<uint64_t, std::string>> mine;
      uint64_t last = 0;
      for (int i = 0; i < kPerThread; ++i) {
        WriteBatch b;
        const std::string value = absl::StrCat(t, "/", i);
        b.Put("shared", value);
        b.Put(absl::StrCat("own/", t), value);
        if (i % 3 == 0) b.Delete(absl::StrCat("own/", t));
        b.Put(absl::StrCat("own/", t), value);
        const uint64_t seq = store_->Submit(std::move(b));
        EXPECT_GT(seq, last) << "sequence numbers grow within a thread";
        last = seq;
        mine.emplace_back(seq, value);
        if (t % 2 == 0 && i % 10 == 0) {
          EXPECT_TRUE(store_->AwaitDurable(seq).ok());
        }
      }
      EXPECT_TRUE(store_->AwaitDurable(last).ok());
      absl::MutexLock lock(&mu);
      shared_writes.insert(shared_writes.end(), mine.begin(), mine.end());
    });
  }
  for (std::thread& t : threads) t.join();

  std::sort(shared_writes.begin(), shared_writes.end());
  ASSERT_EQ(shared_writes.size(), size_t{kThreads * kPerThread});
  for (size_t i = 0; i < shared_writes.size(); ++i) {
    ASSERT_EQ(shared_writes[i].first, i + 1) << "sequence numbers are 1, 2, 3, ...";
  }
  EXPECT_EQ(GetOr(*store_, "shared"), shared_writes.back().second);
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(GetOr(*store_, absl::StrCat("own/", t)), absl::StrCat(t, "/", kPerThread - 1));
  }
  StoreStats stats = store_->stats();
  EXPECT_EQ(stats.batches_written, uint64_t{kThreads * kPerThread});
  EXPECT_LE(stats.fsyncs, stats.batches_written);
  EXPECT_GT(stats.bytes_written, 0u);
  EXPECT_EQ(stats.queued_bytes, 0u);
}

// After a failed write the failed batch, everything queued behind it, later
// submits and reads all report the original error; earlier batches stay OK.
TEST_P(MetaStoreTest, WriteErrorIsSticky) {
  std::atomic<bool> fail{false};
  std::unique_ptr<MetaStore> store = Make([&fail] {
    return fail.load() ? absl::UnavailableError("disk on fire") : absl::OkStatus();
  });
  WriteBatch ok_batch;
  ok_batch.Put("k1", "v1");
  const uint64_t ok_seq = store->Submit(std::move(ok_batch));
  ASSERT_TRUE(store->AwaitDurable(ok_seq).ok());

  fail = true;
  WriteBatch bad;
  bad.Put("k2", "v2");
  absl::Status failed = store->Commit(std::move(bad));
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(failed.message()), HasSubstr("disk on fire"));

  fail = false;  // the store must not recover by itself
  WriteBatch later;
  later.Put("k3", "v3");
  const uint64_t later_seq = store->Submit(std::move(later));
  absl::Status refused = store->AwaitDurable(later_seq);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("disk on fire"));
  EXPECT_EQ(store->Commit(WriteBatch()).code(), absl::StatusCode::kUnavailable);

  EXPECT_TRUE(store->AwaitDurable(ok_seq).ok()) << "batches before the failure stay durable";
  EXPECT_EQ(store->Get("k1").status().code(), absl::StatusCode::kUnavailable);
  absl::Status scan = store->Scan("", [](std::string_view, std::string_view) { return true; });
  EXPECT_EQ(scan.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(scan.message()), HasSubstr("disk on fire"));
}

TEST_P(MetaStoreTest, WriteBatchAccountsBytesAndClears) {
  WriteBatch b;
  b.Put("key", "value");
  b.Delete("gone");
  EXPECT_EQ(b.byte_size(), 3 + 5 + 4 + 2 * WriteBatch::kOpOverheadBytes);
  ASSERT_EQ(b.ops().size(), 2u);
  EXPECT_EQ(b.ops()[0].type, WriteBatch::OpType::kPut);
  EXPECT_EQ(b.ops()[1].type, WriteBatch::OpType::kDelete);
  EXPECT_EQ(b.ops()[1].key, "gone");
  WriteBatch copy = b;
  b.Clear();
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(b.byte_size(), 0u);
  EXPECT_EQ(copy.size(), 2u);
  ASSERT_TRUE(store_->Commit(std::move(copy)).ok());
  EXPECT_EQ(GetOr(*store_, "key"), "value");
}

INSTANTIATE_TEST_SUITE_P(Stores, MetaStoreTest,
                         ::testing::Values(Param{"Mem", false}, Param{"RocksDb", true}),
                         [](const ::testing::TestParamInfo<Param>& info) { return info.param.name; });

}  // namespace
}  // namespace ckpt::meta
