// MetaCore::UpdateJob (issue 40, `ckptctl update-job`): a job's retention and
// flush policy change after creation; a tighter retention applies at once.
#include <gtest/gtest.h>

#include <map>

#include "absl/strings/match.h"
#include "common/clock.h"
#include "server/meta/meta_core.h"
#include "server/meta/store/mem_meta_store.h"

namespace ckpt::meta {
namespace {

class MetaUpdateJobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Reopen();
    RegisterRequest r;
    r.node_id = "a";
    r.grpc_address = "a:7401";
    r.data_address = "a:7402";
    r.memory_capacity_bytes = 1 << 30;
    auto res = core_->RegisterNode(r);
    ASSERT_TRUE(res.ok()) << res.status();
    inc_ = res->incarnation;
    JobSpec spec;
    spec.job_id = "gpt";
    spec.world_size = 1;
    spec.protection = ProtectionPolicy::None();
    ASSERT_TRUE(core_->CreateJob(spec, false).ok());
  }

  void Reopen() {
    core_.reset();
    auto c = MetaCore::Open(store_.get(), &clock_, options_);
    ASSERT_TRUE(c.ok()) << c.status();
    core_ = std::move(*c);
  }

  // Step `step` saved on node a (protection none: PROTECTED at once).
  void Save(uint64_t step) {
    ASSERT_TRUE(core_->BeginVersion("gpt", step, "").ok());
    ShardReport r;
    r.kind = ShardReport::Kind::kStaged;
    r.staged.job_id = "gpt";
    r.staged.step = step;
    r.staged.shard.rank = 0;
    r.staged.shard.size_bytes = 4096;
    r.staged.shard.crc32c = 1;
    r.staged.shard.manifest_digest = 2;
    Item it;
    it.name = "w";
    it.dtype = 9;  // u8
    it.shape = {4096};
    it.length_bytes = 4096;
    r.staged.shard.items.push_back(it);
    auto res = core_->ReportShards("a", inc_, {r});
    ASSERT_TRUE(res.ok()) << res.status();
    ASSERT_TRUE(res->results[0].ok()) << res->results[0];
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

  FakeClock clock_;
  MetaOptions options_;
  std::unique_ptr<MetaStore> store_ = NewMemMetaStore();
  std::unique_ptr<MetaCore> core_;
  uint64_t inc_ = 0;
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
