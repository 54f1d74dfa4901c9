// MetaCore::Locate while the only holder of a shard is down (issue 40 point
// 7): within lost_copy_grace the copy may come back with its node, so Locate
// answers UNAVAILABLE naming the node and the time left, not DATA_LOSS.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "server/meta/meta_core.h"
#include "server/meta/store/mem_meta_store.h"
#include "meta_fixture.h"

namespace ckpt::meta {
namespace {

class MetaLocateTest : public MetaFixture {
 protected:
  void Kill(const std::string& node) { Silence(node); }

  // Nodes a and b; job "gpt" of one rank (2 copies); step 1 staged on a
  // only (its replication not run): a holds the only copy.
  void StageOnAOnly() {
    Register("a");
    Register("b");
    JobSpec spec;
    spec.job_id = "gpt";
    spec.world_size = 1;
    spec.protection = ProtectionPolicy::Replicate(2, ProtectionPolicy::Placement::kRing);
    ASSERT_TRUE(core_->CreateJob(spec, false).ok());
    ASSERT_TRUE(core_->BeginVersion("gpt", 1, "").ok());
    ASSERT_TRUE(Stage("a", "gpt", 1, 0).ok());
  }
};

TEST_F(MetaLocateTest, TheOnlyHolderDownWithinTheGraceIsUnavailableNotDataLoss) {
  StageOnAOnly();
  ASSERT_TRUE(core_->Locate("gpt", 1, 0, "b").ok());
  Kill("a");
  auto located = core_->Locate("gpt", 1, 0, "b");
  ASSERT_FALSE(located.ok());
  EXPECT_TRUE(absl::IsUnavailable(located.status())) << located.status();
  const std::string msg(located.status().message());
  EXPECT_TRUE(absl::StrContains(msg, "rank 0 of gpt/1")) << msg;
  EXPECT_TRUE(absl::StrContains(msg, "node a holds it and is down (DEAD for 2 s)")) << msg;
  // Lost 2 s ago (lease 5 s, 7 s without heartbeats), grace 30 s.
  EXPECT_TRUE(absl::StrContains(msg, "it may come back within 28 s")) << msg;
  EXPECT_FALSE(absl::StrContains(msg, "no readable source left")) << msg;
}

TEST_F(MetaLocateTest, TheTimeLeftShrinksAndAfterTheGraceTheVersionIsLost) {
  StageOnAOnly();
  Kill("a");
  Pass(absl::Seconds(20));
  auto located = core_->Locate("gpt", 1, 0, "b");
  ASSERT_TRUE(absl::IsUnavailable(located.status())) << located.status();
  EXPECT_TRUE(absl::StrContains(located.status().message(), "within 8 s")) << located.status();
  Pass(absl::Seconds(10));  // the grace is over: the copy is taken as lost
  located = core_->Locate("gpt", 1, 0, "b");
  ASSERT_FALSE(located.ok());
  EXPECT_FALSE(absl::IsUnavailable(located.status())) << located.status();
  EXPECT_TRUE(absl::StrContains(located.status().message(), "lost")) << located.status();
}

TEST_F(MetaLocateTest, ANodeBackWithoutItsInventoryYetIsStillAwaitedThenServes) {
  StageOnAOnly();
  Kill("a");
  Register("a");  // back; its inventory is not in yet
  auto located = core_->Locate("gpt", 1, 0, "b");
  ASSERT_TRUE(absl::IsUnavailable(located.status())) << located.status();
  EXPECT_TRUE(absl::StrContains(located.status().message(),
                                "node a holds it and came back and has not reported its memory tier yet"))
      << located.status();
  Holding h;
  h.job_id = "gpt";
  h.step = 1;
  h.rank = 0;
  h.role = CopyRole::kPrimary;
  h.size_bytes = 4096;
  h.crc32c = 0x1000;
  h.manifest_digest = 77;
  ASSERT_TRUE(core_->ReportInventory("a", inc_["a"], {h}).ok());
  located = core_->Locate("gpt", 1, 0, "b");
  ASSERT_TRUE(located.ok()) << located.status();
  ASSERT_FALSE(located->sources.empty());
  EXPECT_EQ(located->sources[0].holder.node_id, "a");
}

TEST_F(MetaLocateTest, AMetaRestartKeepsTheAnswer) {
  StageOnAOnly();
  Kill("a");
  Reopen();
  auto located = core_->Locate("gpt", 1, 0, "b");
  ASSERT_TRUE(absl::IsUnavailable(located.status())) << located.status();
  EXPECT_TRUE(absl::StrContains(located.status().message(), "node a holds it")) << located.status();
}

TEST_F(MetaLocateTest, WithoutAGraceNothingIsAwaited) {
  options_.lost_copy_grace = absl::ZeroDuration();
  Reopen();
  StageOnAOnly();
  Kill("a");
  auto located = core_->Locate("gpt", 1, 0, "b");
  ASSERT_FALSE(located.ok());
  EXPECT_FALSE(absl::IsUnavailable(located.status())) << located.status();
}

}  // namespace
}  // namespace ckpt::meta
