// MetaCore::UpdateJob (issue 40, `ckptctl update-job`): a job's retention and
// flush policy change after creation; a tighter retention applies at once.
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
