// CreateJob with resize_world (issue 38): a job relaunched on another number
// of ranks changes its world size; the versions saved before keep theirs
// (and stay restorable, rank by rank, for a resharding restore), and a
// version still OPEN at the old size is aborted so no version mixes sizes.
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "meta_fixture.h"
#include "server/meta/meta_core.h"

namespace ckpt::meta {
namespace {

class MetaResizeTest : public MetaFixture {
 protected:
  void SetUp() override {
    MetaFixture::SetUp();
    Register("a");
    CreateJob("gpt", 4, ProtectionPolicy::None());
  }

  void Save(uint64_t step, std::initializer_list<uint32_t> ranks) {
    ASSERT_TRUE(core_->BeginVersion("gpt", step, "").ok());
    for (uint32_t r : ranks) ASSERT_TRUE(Stage("a", "gpt", step, r).ok()) << r;
  }

  VersionState StateOf(const std::string& job, uint64_t step) {
    auto v = core_->GetVersion(job, step, false);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? v->state : VersionState::kDeleted;
  }

  absl::StatusOr<std::pair<JobView, bool>> Open(uint32_t world, bool resize) {
    JobRequest req;
    req.job_id = "gpt";
    req.world_size = world;
    req.resize_world = resize;
    return core_->CreateJob(req, /*open_if_exists=*/true);
  }
};

TEST_F(MetaResizeTest, AResizedJobKeepsItsVersionsAndAbortsTheOpenOne) {
  Save(1, {0, 1, 2, 3});
  Save(2, {0, 1});  // the old run died while saving step 2
  EXPECT_EQ(StateOf("gpt", 2), VersionState::kOpen);

  auto refused = Open(2, false);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "world_size (stored 4, asked 2)")) << refused.status();
  EXPECT_EQ(StateOf("gpt", 2), VersionState::kOpen);  // a refusal changes nothing

  auto resized = Open(2, true);
  ASSERT_TRUE(resized.ok()) << resized.status();
  EXPECT_EQ(resized->first.job.spec.world_size, 2u);
  auto v2 = core_->GetVersion("gpt", 2, false);
  ASSERT_TRUE(v2.ok());
  EXPECT_EQ(v2->state, VersionState::kAborted);
  EXPECT_TRUE(absl::StrContains(v2->abort_reason, "resized from 4 to 2")) << v2->abort_reason;
  // Step 1 keeps its four ranks, each restorable on its own.
  auto v1 = core_->GetVersion("gpt", 1, false);
  ASSERT_TRUE(v1.ok());
  EXPECT_EQ(v1->world_size, 4u);
  EXPECT_EQ(StateOf("gpt", 1), VersionState::kProtected);
  for (uint32_t r = 0; r < 4; ++r) EXPECT_TRUE(core_->Locate("gpt", 1, r, "a").ok()) << r;

  // New versions have two ranks; a third is refused.
  Save(3, {0, 1});
  EXPECT_EQ(StateOf("gpt", 3), VersionState::kProtected);
  ASSERT_TRUE(core_->BeginVersion("gpt", 4, "").ok());
  EXPECT_EQ(Stage("a", "gpt", 4, 2).code(), absl::StatusCode::kInvalidArgument);

  // Opening again with the new size (a rank's Connect) changes nothing; the
  // size survives a meta restart.
  auto same = Open(2, true);
  ASSERT_TRUE(same.ok());
  Reopen();
  auto job = core_->GetJob("gpt");
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->job.spec.world_size, 2u);
  EXPECT_EQ(core_->GetVersion("gpt", 1, false)->world_size, 4u);
  // And it grows back the same way.
  ASSERT_TRUE(Open(8, true).ok());
  Save(5, {0, 1, 2, 3, 4, 5, 6, 7});
  EXPECT_EQ(StateOf("gpt", 5), VersionState::kProtected);
}

TEST_F(MetaResizeTest, ResizeStillRefusesOtherDifferences) {
  JobRequest req;
  req.job_id = "gpt";
  req.world_size = 2;
  req.resize_world = true;
  req.protection = ProtectionPolicy::Replicate(2, ProtectionPolicy::Placement::kRing);
  auto r = core_->CreateJob(req, true);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(core_->GetJob("gpt")->job.spec.world_size, 4u);
}

}  // namespace
}  // namespace ckpt::meta
