// Flusher on its own: holdings in a MemoryTier, the durable tier a
// MemFileSystem (behind a FaultFileSystem to fail writes), meta a FakeMeta
// reached through a MetaSession whose rounds the test runs (ControlOnce), on
// a FakeClock. Files written are read back and compared byte for byte.
#include "server/agent/flusher.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/durable_format.h"
#include "common/mem_file_system.h"
#include "common/names.h"
#include "fake_meta.h"
#include "memory_tier.h"

namespace ckpt::agent {
namespace {

using ::testing::HasSubstr;

const ShardId kR0{"job", 5, 0};
const ShardId kR1{"job", 5, 1};

FlushOrder OrderFor(const ShardId& id, const std::string& content) {
  return FlushOrder{id.rank, absl::StrCat(id.job_id, "/", id.step, "/", RankFileName(id.rank)), content.size(),
                    Crc32c(content)};
}

class FlusherTest : public ::testing::Test {
 protected:
  FlusherTest()
      : fault_fs_(&mem_fs_),
        session_(&meta_, &tier_.clock(), &tier_.metrics(), SessionOptions(), &delegate_),
        flusher_("/durable", &fault_fs_, &tier_.holdings(), &session_, &meta_, &tier_.clock(), &tier_.metrics(),
                 "ckpt-agent test") {
    meta_.world["job"] = 2;
  }
  ~FlusherTest() override { session_.Stop(); }

  static MetaSession::Options SessionOptions() {
    MetaSession::Options o;
    o.node_id = "n0";
    return o;
  }
  std::string FileAt(const std::string& rel) {
    absl::StatusOr<std::string> s = ReadFileToString(&mem_fs_, "/durable/" + rel);
    return s.ok() ? *s : "<" + s.status().ToString() + ">";
  }
  // The reports meta got of `kind`, after one control round.
  std::vector<HoldingReport> SentReports(HoldingReport::Kind kind) {
    session_.ControlOnce();
    absl::MutexLock lock(&meta_.mu);
    std::vector<HoldingReport> out;
    for (const HoldingReport& r : meta_.reports)
      if (r.kind == kind) out.push_back(r);
    return out;
  }

  MemoryTier tier_;
  MemFileSystem mem_fs_;
  FaultFileSystem fault_fs_;
  FakeMeta meta_;
  NoDelegate delegate_;
  MetaSession session_;
  Flusher flusher_;
};

TEST_F(FlusherTest, WritesTheRankFileFromThePoolAndReportsPersisted) {
  const std::string content = SeededBytes(3 * kArenaPageBytes + 11, 1);
  ASSERT_TRUE(tier_.AddShard(kR0, content).ok());
  uint64_t bytes = 0;
  ASSERT_TRUE(flusher_.FlushOne("t-1", OrderFor(kR0, content), "job", 5, &bytes).ok());
  EXPECT_EQ(bytes, content.size());
  EXPECT_EQ(FileAt("job/5/rank-00000.bin"), content);
  EXPECT_EQ(tier_.holdings().Infos("job", 5)[0].durable_path, "job/5/rank-00000.bin");
  EXPECT_EQ(tier_.metrics().flush_bytes->Value(), static_cast<double>(content.size()));
  EXPECT_EQ(tier_.metrics().flush_shards->Value(), 1.0);
  std::vector<HoldingReport> persisted = SentReports(HoldingReport::Kind::kPersisted);
  ASSERT_EQ(persisted.size(), 1u);
  EXPECT_EQ(persisted[0].id, kR0);
  EXPECT_EQ(persisted[0].durable_path, "job/5/rank-00000.bin");
  EXPECT_EQ(persisted[0].size_bytes, content.size());
  EXPECT_EQ(persisted[0].crc32c, Crc32c(content));
  EXPECT_EQ(persisted[0].task_id, "t-1");
}

TEST_F(FlusherTest, AShardAlreadyWrittenThereIsReportedAgainNotRewritten) {
  const std::string content = SeededBytes(500, 2);
  ASSERT_TRUE(tier_.AddShard(kR0, content).ok());
  uint64_t bytes = 0;
  ASSERT_TRUE(flusher_.FlushOne("t-1", OrderFor(kR0, content), "job", 5, &bytes).ok());
  ASSERT_TRUE(mem_fs_.DeleteFile("/durable/job/5/rank-00000.bin").ok());
  bytes = 0;
  ASSERT_TRUE(flusher_.FlushOne("t-2", OrderFor(kR0, content), "job", 5, &bytes).ok());
  EXPECT_EQ(bytes, 0u);
  EXPECT_FALSE(mem_fs_.Stat("/durable/job/5/rank-00000.bin").ok());
  std::vector<HoldingReport> persisted = SentReports(HoldingReport::Kind::kPersisted);
  ASSERT_EQ(persisted.size(), 2u);
  EXPECT_EQ(persisted[1].task_id, "t-2");
  // Another path is a new write.
  FlushOrder elsewhere = OrderFor(kR0, content);
  elsewhere.durable_path = "job/5/again/rank-00000.bin";
  ASSERT_TRUE(flusher_.FlushOne("t-3", elsewhere, "job", 5, &bytes).ok());
  EXPECT_EQ(FileAt("job/5/again/rank-00000.bin"), content);
}

TEST_F(FlusherTest, RefusesACopyThatDiffersFromWhatMetaExpects) {
  const std::string content = SeededBytes(500, 3);
  ASSERT_TRUE(tier_.AddShard(kR0, content).ok());
  uint64_t bytes = 0;
  FlushOrder o = OrderFor(kR0, content);
  o.size_bytes = 501;
  absl::Status s = flusher_.FlushOne("t-1", o, "job", 5, &bytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("meta expects 501 bytes"));
  o = OrderFor(kR0, content);
  o.crc32c ^= 1;
  EXPECT_EQ(flusher_.FlushOne("t-1", o, "job", 5, &bytes).code(), absl::StatusCode::kFailedPrecondition);
  // Zero means "not said": accepted.
  o.size_bytes = 0;
  o.crc32c = 0;
  EXPECT_TRUE(flusher_.FlushOne("t-1", o, "job", 5, &bytes).ok());
  EXPECT_EQ(FileAt("job/5/rank-00000.bin"), content);
}

TEST_F(FlusherTest, NothingHeldOrQuarantinedIsTheHoldingsError) {
  uint64_t bytes = 0;
  const std::string content = SeededBytes(100, 4);
  EXPECT_EQ(flusher_.FlushOne("t-1", OrderFor(kR0, content), "job", 5, &bytes).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(tier_.AddShard(kR0, content).ok());
  tier_.holdings().Quarantine(*tier_.holdings().PinValid(kR0), "rotten");
  EXPECT_EQ(flusher_.FlushOne("t-1", OrderFor(kR0, content), "job", 5, &bytes).code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(mem_fs_.Stat("/durable/job/5/rank-00000.bin").ok());
}

TEST_F(FlusherTest, AnUncheckedCopyIsCheckedFirstAndQuarantinedIfBad) {
  const std::string good = SeededBytes(800, 5);
  ASSERT_TRUE(tier_.AddShard(kR1, good, /*verified=*/false).ok());
  uint64_t bytes = 0;
  ASSERT_TRUE(flusher_.FlushOne("t-1", OrderFor(kR1, good), "job", 5, &bytes).ok());
  EXPECT_TRUE(tier_.holdings().Verified(kR1));

  // Rank 0's bytes rotted after commit: nothing leaves the node.
  const std::string content = SeededBytes(800, 6);
  std::string rotten = content;
  rotten[10] ^= 4;
  ASSERT_TRUE(tier_.holdings().Add(RecordOf(kR0, content), tier_.Hold(rotten), false, false).ok());
  absl::Status s = flusher_.FlushOne("t-2", OrderFor(kR0, content), "job", 5, &bytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("item \"w0\""));
  EXPECT_FALSE(tier_.holdings().HoldsValid(kR0));
  EXPECT_FALSE(mem_fs_.Stat("/durable/job/5/rank-00000.bin").ok());
  std::vector<HoldingReport> reports = tier_.Reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].copy_state, CopyState::kCorrupt);
}

TEST_F(FlusherTest, AFailedWriteLeavesNoFileAndKeepsTheCopyForARetry) {
  const std::string content = SeededBytes(2000, 7);
  ASSERT_TRUE(tier_.AddShard(kR0, content).ok());
  fault_fs_.FailNthWrite(1);
  uint64_t bytes = 0;
  absl::Status s = flusher_.FlushOne("t-1", OrderFor(kR0, content), "job", 5, &bytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  absl::StatusOr<std::vector<std::string>> left = mem_fs_.ListDir("/durable/job/5");
  if (left.ok()) {
    EXPECT_TRUE(left->empty()) << left->front();  // no rank file, no temporary
  } else {
    EXPECT_EQ(left.status().code(), absl::StatusCode::kNotFound) << left.status();
  }
  EXPECT_TRUE(tier_.holdings().HoldsValid(kR0));
  EXPECT_EQ(tier_.holdings().Infos("job", 5)[0].durable_path, "");
  EXPECT_TRUE(SentReports(HoldingReport::Kind::kPersisted).empty());
  bytes = 0;
  ASSERT_TRUE(flusher_.FlushOne("t-1", OrderFor(kR0, content), "job", 5, &bytes).ok());
  EXPECT_EQ(FileAt("job/5/rank-00000.bin"), content);
}

TEST_F(FlusherTest, ADurablePathOutsideTheRootIsRefused) {
  const std::string content = SeededBytes(100, 8);
  ASSERT_TRUE(tier_.AddShard(kR0, content).ok());
  FlushOrder o = OrderFor(kR0, content);
  o.durable_path = "../outside/rank-00000.bin";
  uint64_t bytes = 0;
  EXPECT_EQ(flusher_.FlushOne("t-1", o, "job", 5, &bytes).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(mem_fs_.Stat("/outside").ok());
}

TEST_F(FlusherTest, FlushNowWritesThePrimariesAskedFor) {
  const std::string r0 = SeededBytes(300, 9), r1 = SeededBytes(400, 10);
  ASSERT_TRUE(tier_.AddShard(kR0, r0).ok());
  ASSERT_TRUE(tier_.AddShard(kR1, r1).ok());
  ASSERT_TRUE(tier_.AddShard(ShardId{"job", 5, 2}, SeededBytes(10, 11), true, CopyRole::kReplica).ok());
  absl::StatusOr<std::vector<FlushResult>> only1 = flusher_.FlushNow("job", 5, {1});
  ASSERT_TRUE(only1.ok()) << only1.status();
  ASSERT_EQ(only1->size(), 1u);
  EXPECT_EQ((*only1)[0].rank, 1u);
  EXPECT_EQ((*only1)[0].durable_path, "job/5/rank-00001.bin");
  EXPECT_TRUE((*only1)[0].status.ok());
  EXPECT_EQ(FileAt("job/5/rank-00001.bin"), r1);
  EXPECT_FALSE(mem_fs_.Stat("/durable/job/5/rank-00000.bin").ok());

  // All primaries (the replica is not this node's to write); a failure is
  // listed and counted.
  fault_fs_.FailAllWrites(true);
  absl::StatusOr<std::vector<FlushResult>> all = flusher_.FlushNow("job", 5, {});
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].rank, 0u);
  EXPECT_EQ((*all)[0].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE((*all)[1].status.ok());  // already written: reported again
  EXPECT_EQ(flusher_.Stats().errors_total, 1u);

  EXPECT_EQ(flusher_.FlushNow("job", 6, {}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(flusher_.FlushNow("../job", 5, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(FlusherTest, CommitsMetasManifestAndDeletesTheVersion) {
  const std::string r0 = SeededBytes(300, 12), r1 = SeededBytes(400, 13);
  ASSERT_TRUE(tier_.AddShard(kR0, r0).ok());
  ASSERT_TRUE(tier_.AddShard(kR1, r1).ok());
  ASSERT_TRUE(flusher_.FlushNow("job", 5, {}).ok());
  {
    absl::MutexLock lock(&meta_.mu);
    meta_.staged[kR0] = RecordOf(kR0, r0);
    meta_.staged[kR1] = RecordOf(kR1, r1);
  }
  AgentTask t;
  t.kind = TaskKind::kCommitDurable;
  t.job_id = "job";
  t.step = 5;
  t.durable_dir = "job/5";
  t.world_size = 2;
  ASSERT_TRUE(flusher_.CommitVersion(t).ok());
  absl::StatusOr<DurableManifest> m = ReadDurableManifest(&mem_fs_, "/durable/job/5");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->writer, "ckpt-agent test");
  EXPECT_EQ(m->world_size, 2u);
  ASSERT_EQ(m->shards.size(), 2u);
  EXPECT_EQ(m->shards[1].crc32c, Crc32c(r1));
  EXPECT_EQ(m->shards[1].items, RecordOf(kR1, r1).items);

  ASSERT_TRUE(flusher_.DeleteVersion(t).ok());
  EXPECT_EQ(ReadDurableManifest(&mem_fs_, "/durable/job/5").status().code(), absl::StatusCode::kNotFound);
  // A manifest that does not hold together (meta has no rank of step 6) is
  // refused and nothing is committed.
  t.step = 6;
  t.durable_dir = "job/6";
  EXPECT_FALSE(flusher_.CommitVersion(t).ok());
  EXPECT_FALSE(ReadDurableManifest(&mem_fs_, "/durable/job/6").ok());
}

TEST_F(FlusherTest, LagCountsWantedShardsUntilTheyAreDurable) {
  const std::string r0 = SeededBytes(300, 14), r1 = SeededBytes(5000, 15);
  ASSERT_TRUE(tier_.AddShard(kR0, r0).ok());
  ASSERT_TRUE(tier_.AddShard(kR1, r1).ok());
  AgentTask t;
  t.job_id = "job";
  t.step = 5;
  t.flush = {OrderFor(kR0, r0), OrderFor(kR1, r1), OrderFor(ShardId{"job", 5, 7}, "x")};
  flusher_.Want(t);
  tier_.clock().Advance(absl::Milliseconds(1500));
  FlushStats s = flusher_.Stats();
  EXPECT_EQ(s.pending_shards, 2u);  // rank 7 is not held here
  EXPECT_EQ(s.lag_bytes, r0.size() + r1.size());
  EXPECT_EQ(s.lag_ms, 1500);
  flusher_.UpdateGauges();
  EXPECT_EQ(tier_.metrics().flush_lag_bytes->Value(), static_cast<double>(r0.size() + r1.size()));
  EXPECT_EQ(tier_.metrics().flush_lag_seconds->Value(), 1.5);

  uint64_t bytes = 0;
  ASSERT_TRUE(flusher_.FlushOne("t", OrderFor(kR1, r1), "job", 5, &bytes).ok());
  s = flusher_.Stats();
  EXPECT_EQ(s.pending_shards, 1u);
  EXPECT_EQ(s.lag_bytes, r0.size());
  tier_.holdings().DropShard(kR0);  // dropped here: nothing left to flush
  s = flusher_.Stats();
  EXPECT_EQ(s.pending_shards, 0u);
  EXPECT_EQ(s.lag_ms, 0);

  ASSERT_TRUE(tier_.AddShard(kR0, r0).ok());
  flusher_.Want(t);
  flusher_.Unwant(t);
  EXPECT_EQ(flusher_.Stats().pending_shards, 0u);
}

TEST_F(FlusherTest, RecordErrorKeepsTheLastOneWithItsTime) {
  flusher_.RecordError(absl::UnavailableError("disk gone"));
  tier_.clock().Advance(absl::Seconds(2));
  flusher_.RecordError(absl::ResourceExhaustedError("disk full"));
  const FlushStats s = flusher_.Stats();
  EXPECT_EQ(s.errors_total, 2u);
  EXPECT_THAT(s.last_error, HasSubstr("disk full"));
  EXPECT_EQ(s.last_error_unix_ms, tier_.clock().NowUnixMillis());
  EXPECT_EQ(tier_.metrics().flush_errors->Value(), 2.0);
}

class NoDurableTierTest : public FlusherTest {
 protected:
  NoDurableTierTest() : bare_(std::string(), &mem_fs_, &tier_.holdings(), &session_, &meta_, &tier_.clock(),
                              &tier_.metrics(), "w") {}
  Flusher bare_;
};

TEST_F(NoDurableTierTest, FlushesAndCommitsAreUnavailableDeletesAreNoOps) {
  const std::string content = SeededBytes(100, 16);
  ASSERT_TRUE(tier_.AddShard(kR0, content).ok());
  uint64_t bytes = 0;
  absl::Status s = bare_.FlushOne("t", OrderFor(kR0, content), "job", 5, &bytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("--durable-root"));
  EXPECT_EQ(bare_.FlushNow("job", 5, {}).status().code(), absl::StatusCode::kUnavailable);
  AgentTask t;
  t.job_id = "job";
  t.step = 5;
  t.durable_dir = "job/5";
  EXPECT_EQ(bare_.CommitVersion(t).code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(bare_.DeleteVersion(t).ok());
  EXPECT_EQ(bare_.durable_root(), "");
}

}  // namespace
}  // namespace ckpt::agent
