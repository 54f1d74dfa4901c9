// MetaCore::UpdateJob (issue 40, `ckptctl update-job`): a job's retention and
// flush and protection policy change after creation; a tighter retention applies
// at once, a new protection to the versions begun after it.
#include <gtest/gtest.h>

#include <map>

#include "absl/strings/match.h"
#include "common/clock.h"
#include "server/meta/meta_core.h"
#include "server/meta/store/mem_meta_store.h"
#include "meta_fixture.h"

namespace ckpt::meta {
namespace {

class MetaUpdateJobTest : public MetaFixture {
 protected:
  void SetUp() override {
    MetaFixture::SetUp();
    Register("a");
    CreateJob("gpt", 1, ProtectionPolicy::None());
  }

  // Step `step` saved on node a (protection none: PROTECTED at once).
  void Save(uint64_t step) {
    ASSERT_TRUE(core_->BeginVersion("gpt", step, "").ok());
    ASSERT_TRUE(Stage("a", "gpt", step, 0).ok());
  }

  bool Evicted(uint64_t step) {
    auto v = core_->GetVersion("gpt", step, false);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() && v->evicted;
  }

  static RetentionPolicy Keep(uint32_t in_memory, uint32_t durable = 0) {
    RetentionPolicy r;
    r.keep_in_memory = in_memory;
    r.keep_durable = durable;
    return r;
  }
};

TEST_F(MetaUpdateJobTest, ALowerKeepInMemoryEvictsAtOnce) {
  Save(1);
  Save(2);
  EXPECT_FALSE(Evicted(1));  // the default keeps 2
  auto u = core_->UpdateJob("gpt", std::nullopt, Keep(1));
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_TRUE(u->second);
  EXPECT_EQ(u->first.job.spec.retention.keep_in_memory, 1u);
  EXPECT_TRUE(Evicted(1));
  EXPECT_FALSE(Evicted(2));
  Save(3);
  EXPECT_TRUE(Evicted(2));
}

TEST_F(MetaUpdateJobTest, AHigherKeepInMemoryKeepsMore) {
  ASSERT_TRUE(core_->UpdateJob("gpt", std::nullopt, Keep(3)).ok());
  Save(1);
  Save(2);
  Save(3);
  EXPECT_FALSE(Evicted(1));
  Save(4);
  EXPECT_TRUE(Evicted(1));
}

TEST_F(MetaUpdateJobTest, TheSamePoliciesAreUnchangedAndTheFlushPolicyIsKeptApart) {
  FlushPolicy every3;
  every3.every_n_versions = 3;
  auto u = core_->UpdateJob("gpt", every3, std::nullopt);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_TRUE(u->second);
  EXPECT_EQ(u->first.job.spec.flush.every_n_versions, 3u);
  EXPECT_EQ(u->first.job.spec.retention.keep_in_memory, 0u);  // untouched
  u = core_->UpdateJob("gpt", every3, std::nullopt);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_FALSE(u->second);
  // Persisted: a meta restart keeps it.
  Reopen();
  auto j = core_->GetJob("gpt");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->job.spec.flush.every_n_versions, 3u);
  // All zero turns automatic flushes off again.
  u = core_->UpdateJob("gpt", FlushPolicy{}, std::nullopt);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_TRUE(u->second);
  EXPECT_EQ(u->first.job.spec.flush.every_n_versions, 0u);
}

// A new protection plans the versions begun after it; the ones before keep the
// policy they were planned with. It must be plannable now, and it persists.
TEST_F(MetaUpdateJobTest, ANewProtectionPlansNewVersionsAndOldOnesKeepTheirs) {
  Register("b");
  Save(1);
  const uint64_t epoch = core_->GetJob("gpt")->job.plan_epoch;
  const ProtectionPolicy two = ProtectionPolicy::Replicate(2, ProtectionPolicy::Placement::kRing);
  // Not plannable on the 2 alive nodes: refused, nothing changed.
  auto u = core_->UpdateJob("gpt", std::nullopt, std::nullopt,
                            ProtectionPolicy::Replicate(3, ProtectionPolicy::Placement::kRing));
  EXPECT_TRUE(absl::IsFailedPrecondition(u.status())) << u.status();
  EXPECT_TRUE(absl::StrContains(u.status().message(), "cannot be placed on the nodes alive now")) << u.status();
  EXPECT_EQ(core_->GetJob("gpt")->job.spec.protection.kind, ProtectionPolicy::Kind::kNone);
  // Invalid: refused as such.
  u = core_->UpdateJob("gpt", std::nullopt, std::nullopt,
                       ProtectionPolicy::Replicate(1, ProtectionPolicy::Placement::kRing));
  EXPECT_TRUE(absl::IsInvalidArgument(u.status())) << u.status();

  u = core_->UpdateJob("gpt", std::nullopt, std::nullopt, two);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_TRUE(u->second);
  EXPECT_EQ(u->first.job.spec.protection.kind, ProtectionPolicy::Kind::kReplicate);
  EXPECT_EQ(u->first.job.spec.protection.copies, 2);
  EXPECT_GT(u->first.job.plan_epoch, epoch);
  // The same again: unchanged.
  u = core_->UpdateJob("gpt", std::nullopt, std::nullopt, two);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_FALSE(u->second);

  ASSERT_TRUE(core_->BeginVersion("gpt", 2, "").ok());
  auto v1 = core_->GetVersion("gpt", 1, false);
  auto v2 = core_->GetVersion("gpt", 2, false);
  ASSERT_TRUE(v1.ok() && v2.ok());
  EXPECT_EQ(v1->plan.policy.kind, ProtectionPolicy::Kind::kNone);  // kept
  EXPECT_EQ(v1->state, VersionState::kProtected);
  EXPECT_EQ(v2->plan.policy.kind, ProtectionPolicy::Kind::kReplicate);
  EXPECT_EQ(v2->plan.policy.copies, 2);
  Reopen();
  auto j = core_->GetJob("gpt");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->job.spec.protection.kind, ProtectionPolicy::Kind::kReplicate);
  // A trainer that states the old policy when it opens the job is told both.
  JobRequest open;
  open.job_id = "gpt";
  open.protection = ProtectionPolicy::None();
  auto opened = core_->CreateJob(open, /*open_if_exists=*/true);
  EXPECT_TRUE(absl::IsFailedPrecondition(opened.status())) << opened.status();
  EXPECT_TRUE(absl::StrContains(opened.status().message(), "protection (stored replicate")) << opened.status();
}

TEST_F(MetaUpdateJobTest, Refusals) {
  auto u = core_->UpdateJob("gpt", std::nullopt, std::nullopt);
  EXPECT_TRUE(absl::IsInvalidArgument(u.status())) << u.status();
  EXPECT_TRUE(absl::StrContains(u.status().message(), "changes nothing")) << u.status();
  u = core_->UpdateJob("nope", std::nullopt, Keep(1));
  EXPECT_TRUE(absl::IsNotFound(u.status())) << u.status();
  u = core_->UpdateJob("Bad Id", std::nullopt, Keep(1));
  EXPECT_TRUE(absl::IsInvalidArgument(u.status())) << u.status();
  ASSERT_TRUE(core_->DeleteJob("gpt", false).ok());
  u = core_->UpdateJob("gpt", std::nullopt, Keep(1));
  EXPECT_TRUE(absl::IsFailedPrecondition(u.status())) << u.status();
}

}  // namespace
}  // namespace ckpt::meta
