// MetaCore answers only from durable state (issue 12 #9), shown on a store
// whose fsync the test holds back (held_meta_store.h): a change that is in
// memory but not yet on disk is never reported, it is reported once synced,
// and a crash before the sync never leaves a caller told PROTECTED about a
// version that comes back not PROTECTED. And a full write queue holds up
// only the writers: they wait for room before taking the core's lock.
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "server/meta/meta_core.h"
#include "held_meta_store.h"

namespace ckpt::meta {
namespace {

class DurableAnswersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = std::make_unique<HeldMetaStore>([this](uint64_t) {
      absl::MutexLock lock(&mu_);
      ++blocked_;
    });
    auto c = MetaCore::Open(store_.get(), &clock_, MetaOptions{});
    ASSERT_TRUE(c.ok()) << c.status();
    core_ = std::move(*c);
    RegisterRequest r;
    r.node_id = "n1";
    r.grpc_address = "n1:7401";
    r.data_address = "n1:7402";
    auto reg = core_->RegisterNode(r);
    ASSERT_TRUE(reg.ok()) << reg.status();
    incarnation_ = reg->incarnation;
    JobSpec spec;
    spec.job_id = "gpt";
    spec.world_size = 1;
    spec.protection = ProtectionPolicy::None();  // PROTECTED as soon as STAGED
    ASSERT_TRUE(core_->CreateJob(spec, false).ok());
    ASSERT_TRUE(core_->BeginVersion("gpt", 1, "").ok());
  }

  void TearDown() override {
    store_->Release();
    for (std::thread& t : threads_) t.join();
    core_.reset();
  }

  // Rank 0's shard of step 1 staged: the version is PROTECTED in memory at
  // once; its batch is submitted, durable only when the store says so.
  void StageWithoutWaiting() {
    ShardReport r;
    r.kind = ShardReport::Kind::kStaged;
    r.staged.job_id = "gpt";
    r.staged.step = 1;
    r.staged.shard.rank = 0;
    r.staged.shard.size_bytes = 64;
    r.staged.shard.crc32c = 0x1234;
    uint64_t seq = 0;
    auto res = core_->SubmitReportShards("n1", incarnation_, {r}, &seq);
    ASSERT_TRUE(res.ok()) << res.status();
    ASSERT_TRUE(res->results[0].ok()) << res->results[0];
    ASSERT_GT(seq, 0u);
  }

  // Runs `call` on its own thread and returns once it has either returned or
  // blocked waiting for the store's fsync (never on a timer).
  void Start(std::function<void()> call) {
    absl::MutexLock lock(&mu_);
    const int before = blocked_ + done_;
    threads_.emplace_back([this, call = std::move(call)] {
      call();
      absl::MutexLock l(&mu_);
      ++done_;
    });
    auto moved = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return blocked_ + done_ > before; };
    mu_.Await(absl::Condition(&moved));
  }

  int Done() {
    absl::MutexLock lock(&mu_);
    return done_;
  }

  void JoinAll() {
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

  FakeClock clock_;
  std::unique_ptr<HeldMetaStore> store_;
  std::unique_ptr<MetaCore> core_;
  uint64_t incarnation_ = 0;
  std::vector<std::thread> threads_;
  absl::Mutex mu_;
  int blocked_ ABSL_GUARDED_BY(mu_) = 0;
  int done_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST_F(DurableAnswersTest, StateNotYetSyncedIsNotReportedAndIsOnceSynced) {
  store_->Hold();
  StageWithoutWaiting();
  absl::StatusOr<Version> got = absl::UnknownError("not answered");
  absl::StatusOr<Version> latest = absl::UnknownError("not answered");
  absl::StatusOr<Version> waited = absl::UnknownError("not answered");
  absl::StatusOr<LocateResult> located = absl::UnknownError("not answered");
  absl::StatusOr<std::vector<Version>> listed = absl::UnknownError("not answered");
  absl::StatusOr<JobView> job = absl::UnknownError("not answered");
  Start([&] { got = core_->GetVersion("gpt", 1, false); });
  Start([&] { latest = core_->Latest("gpt", Level::kProtected); });
  Start([&] { waited = core_->WaitVersion("gpt", 1, Level::kProtected, absl::Hours(1)); });
  Start([&] { located = core_->Locate("gpt", 1, 0, "n1"); });
  Start([&] { listed = core_->ListVersions("gpt", {}, false, std::nullopt, 0); });
  Start([&] { job = core_->GetJob("gpt"); });
  // Every reader is parked on the fsync; none has answered from memory.
  EXPECT_EQ(Done(), 0) << "an answer came from state not yet durable: GetVersion "
                       << (got.ok() ? VersionStateName(got->state) : got.status().ToString());

  store_->Release();
  JoinAll();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->state, VersionState::kProtected);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->step, 1u);
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(waited->state, VersionState::kProtected);
  ASSERT_TRUE(located.ok()) << located.status();
  EXPECT_EQ(located->sources.front().kind, SourceKind::kLocal);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].state, VersionState::kProtected);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->latest_protected, std::optional<uint64_t>(1));
}

TEST_F(DurableAnswersTest, CrashBeforeSyncNeverLeavesACallerToldProtected) {
  store_->Hold();
  StageWithoutWaiting();
  absl::StatusOr<Version> got = absl::UnknownError("not answered");
  absl::StatusOr<Version> waited = absl::UnknownError("not answered");
  Start([&] { got = core_->GetVersion("gpt", 1, false); });
  Start([&] { waited = core_->WaitVersion("gpt", 1, Level::kProtected, absl::Hours(1)); });
  EXPECT_EQ(Done(), 0);

  store_->Crash();  // meta dies before the group commit reaches the disk
  JoinAll();
  EXPECT_FALSE(got.ok()) << "told " << VersionStateName(got->state)
                         << " about a state that was never durable";
  EXPECT_FALSE(waited.ok()) << "told PROTECTED about a state that was never durable";
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kUnavailable) << waited.status();

  // The restarted meta loads what reached the disk: the version is OPEN,
  // which no caller was told otherwise.
  std::unique_ptr<MetaStore> image = store_->DurableImage();
  ASSERT_NE(image, nullptr);
  auto restarted = MetaCore::Open(image.get(), &clock_, MetaOptions{});
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  auto v = (*restarted)->GetVersion("gpt", 1, false);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->state, VersionState::kOpen);
  EXPECT_EQ((*restarted)->Latest("gpt", Level::kProtected).status().code(),
            absl::StatusCode::kNotFound);
}

// An answer that changes nothing itself (an idempotent BeginVersion, a
// create-or-open) still reflects another caller's change: it waits for that
// change's fsync too.
TEST_F(DurableAnswersTest, IdempotentAnswersWaitForTheChangeTheyReflect) {
  store_->Hold();
  absl::StatusOr<std::pair<Version, bool>> first = absl::UnknownError("not answered");
  absl::StatusOr<std::pair<Version, bool>> again = absl::UnknownError("not answered");
  absl::StatusOr<std::pair<JobView, bool>> opened = absl::UnknownError("not answered");
  Start([&] { first = core_->BeginVersion("gpt", 2, ""); });
  Start([&] { again = core_->BeginVersion("gpt", 2, ""); });
  JobRequest open;
  open.job_id = "gpt";
  Start([&] { opened = core_->CreateJob(open, true); });
  EXPECT_EQ(Done(), 0) << "version 2 was reported before it was durable";
  store_->Release();
  JoinAll();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->second);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->second);
  EXPECT_EQ(again->first.step, 2u);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_FALSE(opened->second);
}

// The store's write queue is at its limit (a slow disk): a writer waits for
// room before it takes the core's lock (MetaStore::WaitForRoom), so readers,
// which take that lock, are answered meanwhile; the writer goes on once the
// queue drains. (Before, the writer waited inside MetaStore::Submit holding
// the lock, and every reader waited with it.)
TEST_F(DurableAnswersTest, AFullWriteQueueDoesNotBlockReaders) {
  int room_waits = 0;
  bool writer_done = false;
  store_->Fill([&] {
    absl::MutexLock lock(&mu_);
    ++room_waits;
  });
  std::thread writer([&] {
    auto begun = core_->BeginVersion("gpt", 2, "");
    EXPECT_TRUE(begun.ok()) << begun.status();
    absl::MutexLock lock(&mu_);
    writer_done = true;
  });
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(+[](int* n) { return *n > 0; }, &room_waits));
  }
  // The writer is parked waiting for room; readers take the lock and answer.
  auto job = core_->GetJob("gpt");
  ASSERT_TRUE(job.ok()) << job.status();
  auto nodes = core_->ListNodes({});
  ASSERT_TRUE(nodes.ok()) << nodes.status();
  EXPECT_EQ(nodes->size(), 1u);
  auto v1 = core_->GetVersion("gpt", 1, false);
  ASSERT_TRUE(v1.ok()) << v1.status();
  EXPECT_TRUE(core_->ClusterStatus(false, 0).ok());
  EXPECT_TRUE(absl::IsNotFound(core_->GetVersion("gpt", 2, false).status()));  // not begun yet
  {
    absl::MutexLock lock(&mu_);
    EXPECT_FALSE(writer_done);
  }
  store_->Drain();
  writer.join();
  EXPECT_TRUE(writer_done);
  auto v2 = core_->GetVersion("gpt", 2, false);
  ASSERT_TRUE(v2.ok()) << v2.status();
  EXPECT_EQ(v2->state, VersionState::kOpen);
}

}  // namespace
}  // namespace ckpt::meta
