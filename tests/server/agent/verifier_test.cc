// Verifier on its own: a HoldingTable over an Arena in a temp dir
// (MemoryTier: records through a FaultFileSystem, a FakeClock), a ParityBuilder
// over it, and a MetaSession over FakeMeta for the EVICTED reports and meta's
// eviction facts. Covers the background check (good copies marked verified
// and the hook told, a crc mismatch quarantined and reported CORRUPT), the
// wake of the verify loop, Verify over shards and EC segments (dry run or
// not), and the node-local eviction rules. No threads but where a wait is
// what is tested; no sleeps.
#include "server/agent/verifier.h"

#include <atomic>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fake_meta.h"
#include "memory_tier.h"

namespace ckpt::agent {
namespace {

using ::testing::HasSubstr;

const ShardId kA{"job", 5, 0};
const ShardId kB{"job", 5, 1};
const ShardId kOther{"job", 6, 0};

ShardRecord SegmentRecord(const SegmentId& id, const std::string& content) {
  ShardRecord r;
  r.id = ShardId{id.job_id, id.step, 0};
  r.segment = id;
  r.segment_kind = SegmentKind::kParity;
  r.size_bytes = content.size();
  r.crc32c = Crc32c(content);
  return r;
}

class VerifierTest : public ::testing::Test {
 protected:
  VerifierTest()
      : parity_(&tier_.arena(), &tier_.holdings(), &tier_.clock(), &tier_.metrics(), absl::Seconds(30)),
        session_(&meta_, &tier_.clock(), &tier_.metrics(), SessionOptions(), &delegate_),
        verifier_(Verifier::Deps{.holdings = &tier_.holdings(),
                                 .parity = &parity_,
                                 .session = &session_,
                                 .meta = &meta_,
                                 .clock = &tier_.clock(),
                                 .on_verified = [this] { ++verified_hook_; },
                                 .on_freed = [this] { ++freed_hook_; }}) {}

  static MetaSession::Options SessionOptions() {
    MetaSession::Options o;
    o.node_id = "n0";
    return o;
  }

  // Holds `content` as an unverified copy of `id`, queued for the verifier.
  void Commit(const ShardId& id, const std::string& content) {
    ASSERT_TRUE(tier_.AddShard(id, content, /*verified=*/false).ok());
    tier_.holdings().QueueVerify(id);
  }
  // Flips one byte of the held copy of `id` at `offset`.
  void Spoil(const ShardId& id, uint64_t offset) {
    absl::StatusOr<Pin> pin = tier_.holdings().PinValid(id);
    ASSERT_TRUE(pin.ok()) << pin.status();
    std::string b = ReadBack(*pin->bytes, offset + 1);
    b[offset] ^= 0x40;
    pin->bytes->CopyIn(offset, AsBytes(b.substr(offset)));
  }
  // The EVICTED reports meta got (the session's outbox sent first).
  std::vector<HoldingReport> EvictedAtMeta() {
    session_.ControlOnce();
    std::vector<HoldingReport> out;
    absl::MutexLock lock(&meta_.mu);
    for (const HoldingReport& r : meta_.reports) {
      if (r.kind == HoldingReport::Kind::kCopyState && r.copy_state == CopyState::kEvicted) out.push_back(r);
    }
    return out;
  }

  MemoryTier tier_;
  FakeMeta meta_;
  NoDelegate delegate_;
  ParityBuilder parity_;
  MetaSession session_;
  int verified_hook_ = 0;
  int freed_hook_ = 0;
  Verifier verifier_;
};

TEST_F(VerifierTest, VerifyOnceMarksAGoodCopyVerifiedAndTellsTheHook) {
  EXPECT_FALSE(verifier_.VerifyOnce()) << "nothing queued";
  Commit(kA, SeededBytes(3000, 1));
  EXPECT_FALSE(tier_.holdings().Verified(kA));
  EXPECT_TRUE(verifier_.VerifyOnce());
  EXPECT_TRUE(tier_.holdings().Verified(kA));
  EXPECT_EQ(verified_hook_, 1);
  EXPECT_FALSE(verifier_.VerifyOnce()) << "the queue is empty again";
  EXPECT_TRUE(tier_.Reports().empty()) << "a good copy is not reported";
}

TEST_F(VerifierTest, ACrcMismatchIsQuarantinedAndReportedCorrupt) {
  Commit(kA, SeededBytes(3000, 2));
  Spoil(kA, 2000);  // inside the second item
  EXPECT_TRUE(verifier_.VerifyOnce());
  EXPECT_EQ(verified_hook_, 0) << "no task is woken for a bad copy";
  EXPECT_FALSE(tier_.holdings().HoldsValid(kA));
  absl::StatusOr<Pin> pin = tier_.holdings().PinValid(kA);
  EXPECT_EQ(pin.status().code(), absl::StatusCode::kDataLoss) << pin.status();
  std::vector<HoldingReport> reports = tier_.Reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].id, kA);
  EXPECT_EQ(reports[0].copy_state, CopyState::kCorrupt);
  EXPECT_THAT(reports[0].detail, HasSubstr("w1"));
}

TEST_F(VerifierTest, ANotifyIsNotLostAndStopEndsTheWait) {
  // A wake that came before the wait (while VerifyOnce ran) ends the next
  // wait at once: with a fake clock that never moves, it would block forever.
  verifier_.Notify();
  verifier_.AwaitWork(absl::Hours(1));
  // With no wake, the wait lasts until the clock passes the timeout.
  std::atomic<bool> done{false};
  std::thread waiter([&] {
    verifier_.AwaitWork(absl::Milliseconds(200));
    done = true;
  });
  tier_.clock().BlockUntilWaiters(1);
  EXPECT_FALSE(done);
  tier_.clock().Advance(absl::Milliseconds(200));
  waiter.join();
  EXPECT_TRUE(done);
  // Stop wakes a wait for good.
  verifier_.Stop();
  verifier_.AwaitWork(absl::Hours(1));
  verifier_.AwaitWork(absl::Hours(1));
}

TEST_F(VerifierTest, VerifyChecksEveryShardAndSegmentOfAVersion) {
  EXPECT_EQ(verifier_.Verify("job", 5, false, nullptr).status().code(), absl::StatusCode::kNotFound);
  const std::string a = SeededBytes(3000, 3);
  const std::string b = SeededBytes(2000, 4);
  Commit(kA, a);
  Commit(kB, b);
  Commit(kOther, SeededBytes(100, 5));  // another version: not checked
  const SegmentId seg{"job", 5, 0, 0, 2};
  const std::string parity = SeededBytes(500, 6);
  ASSERT_TRUE(tier_.holdings().AddSegment(SegmentRecord(seg, parity), tier_.Hold(parity), "t-1").ok());
  Spoil(kB, 10);

  uint64_t checked = 0;
  absl::StatusOr<std::vector<VerifyFinding>> found = verifier_.Verify("job", 5, /*dry_run=*/true, &checked);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(checked, a.size() + b.size() + parity.size());
  ASSERT_EQ(found->size(), 3u);
  // Segments first, then shards in id order.
  EXPECT_TRUE((*found)[0].ok);
  EXPECT_EQ((*found)[0].holding.segment, seg);
  EXPECT_TRUE((*found)[1].ok);
  EXPECT_EQ((*found)[1].holding.id, kA);
  EXPECT_TRUE((*found)[1].holding.verified) << "a good shard is marked verified";
  EXPECT_FALSE((*found)[2].ok);
  EXPECT_EQ((*found)[2].holding.id, kB);
  EXPECT_EQ((*found)[2].bad_item, "w0");
  std::string spoiled = b;
  spoiled[10] ^= 0x40;
  EXPECT_EQ((*found)[2].actual_crc32c, Crc32c(spoiled));
  // A dry run quarantines nothing.
  EXPECT_TRUE(tier_.holdings().HoldsValid(kB));

  found = verifier_.Verify("job", 5, /*dry_run=*/false, nullptr);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_FALSE(tier_.holdings().HoldsValid(kB)) << "quarantined";
  EXPECT_EQ((*found)[2].holding.state, CopyState::kCorrupt);
  EXPECT_TRUE(tier_.holdings().HoldsValid(kA));
}

TEST_F(VerifierTest, ABadSegmentIsQuarantinedUnlessADryRun) {
  const SegmentId seg{"job", 5, 0, 0, 2};
  const std::string parity = SeededBytes(500, 7);
  ASSERT_TRUE(tier_.holdings().AddSegment(SegmentRecord(seg, parity), tier_.Hold(parity), "t-1").ok());
  {
    absl::StatusOr<Pin> pin = tier_.holdings().PinSegment(seg);
    ASSERT_TRUE(pin.ok()) << pin.status();
    (*pin).bytes->CopyIn(0, AsBytes(std::string(1, static_cast<char>(parity[0] ^ 1))));
  }
  absl::StatusOr<std::vector<VerifyFinding>> found = verifier_.Verify("job", 5, true, nullptr);
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_EQ(found->size(), 1u);
  EXPECT_FALSE((*found)[0].ok);
  EXPECT_THAT((*found)[0].message, HasSubstr("segment crc32c"));
  EXPECT_EQ((*found)[0].holding.state, CopyState::kValid) << "a dry run leaves it";
  EXPECT_TRUE(tier_.holdings().HasValidSegment(seg));

  found = verifier_.Verify("job", 5, false, nullptr);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ((*found)[0].holding.state, CopyState::kCorrupt);
  EXPECT_FALSE(tier_.holdings().HasValidSegment(seg));
}

TEST_F(VerifierTest, EvictRefusesWhatRetentionForbidsAndFreesWhatItAllows) {
  EXPECT_EQ(verifier_.Evict("../job", 5, false).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(verifier_.Evict("job", 5, false).status().code(), absl::StatusCode::kNotFound) << "nothing held";
  Commit(kA, SeededBytes(1000, 8));
  Commit(kB, SeededBytes(1000, 9));
  Commit(kOther, SeededBytes(1000, 10));

  // Meta away: nothing is freed.
  meta_.up = false;
  EXPECT_EQ(verifier_.Evict("job", 5, false).status().code(), absl::StatusCode::kUnavailable);
  meta_.up = true;
  // Not PERSISTED: this node's copy may be the last one.
  absl::Status s = verifier_.Evict("job", 5, false).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("not PERSISTED"));
  // The job's newest version at PROTECTED level or better: never.
  meta_.version_state[5] = static_cast<int>(VersionState::kPersisted);
  meta_.newest_protected = 5;
  s = verifier_.Evict("job", 5, false).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("newest version"));
  EXPECT_TRUE(tier_.holdings().HoldsValid(kA));
  EXPECT_EQ(freed_hook_, 0);

  // A newer version protected: allowed. A dry run only lists.
  meta_.newest_protected = 6;
  absl::StatusOr<std::vector<HoldingInfo>> listed = verifier_.Evict("job", 5, /*dry_run=*/true);
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->size(), 2u);
  EXPECT_TRUE(tier_.holdings().HoldsValid(kA));
  EXPECT_TRUE(EvictedAtMeta().empty());

  const uint64_t free_before = tier_.arena().free_bytes();
  absl::StatusOr<std::vector<HoldingInfo>> freed = verifier_.Evict("job", 5, false);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(freed->size(), 2u);
  EXPECT_FALSE(tier_.holdings().Holds(kA));
  EXPECT_FALSE(tier_.holdings().Holds(kB));
  EXPECT_TRUE(tier_.holdings().HoldsValid(kOther));
  EXPECT_GT(tier_.arena().free_bytes(), free_before);
  EXPECT_EQ(freed_hook_, 1);
  std::vector<HoldingReport> evicted = EvictedAtMeta();
  ASSERT_EQ(evicted.size(), 2u);
  EXPECT_EQ(evicted[0].id, kA);
  EXPECT_EQ(evicted[1].id, kB);
  EXPECT_EQ(evicted[0].detail, "evicted by a node-local command");
}

TEST_F(VerifierTest, AnAbortedVersionIsEvictedEvenIfNewestProtected) {
  Commit(kA, SeededBytes(1000, 11));
  meta_.version_state[5] = static_cast<int>(VersionState::kAborted);
  meta_.newest_protected = 5;
  absl::StatusOr<std::vector<HoldingInfo>> freed = verifier_.Evict("job", 5, false);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(freed->size(), 1u);
  EXPECT_FALSE(tier_.holdings().Holds(kA));
}

TEST_F(VerifierTest, EvictVersionFreesEverythingOfTheVersionWithoutAsking) {
  Commit(kA, SeededBytes(1000, 12));
  Commit(kB, SeededBytes(1000, 13));
  Commit(kOther, SeededBytes(1000, 14));
  const SegmentId seg{"job", 5, 0, 0, 2};
  const std::string parity = SeededBytes(500, 15);
  ASSERT_TRUE(tier_.holdings().AddSegment(SegmentRecord(seg, parity), tier_.Hold(parity), "t-1").ok());
  meta_.up = false;  // meta decided already: it is not asked
  EXPECT_EQ(verifier_.EvictVersion("job", 5), 3u);
  EXPECT_FALSE(tier_.holdings().Holds(kA));
  EXPECT_FALSE(tier_.holdings().HasValidSegment(seg));
  EXPECT_TRUE(tier_.holdings().HoldsValid(kOther));
  EXPECT_EQ(freed_hook_, 1);
  EXPECT_EQ(verifier_.EvictVersion("job", 5), 0u);
}

}  // namespace
}  // namespace ckpt::agent
