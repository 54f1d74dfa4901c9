// Issue 40 point 9: the node failures behind the MTBF (ClusterStatus, the
// recommended checkpoint interval) count crashes only: an agent that said
// it was stopping (HeartbeatRequest::stopping, sent on SIGTERM) or a drained
// node whose lease runs out is no failure.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "common/clock.h"
#include "server/meta/meta_core.h"
#include "server/meta/store/mem_meta_store.h"
#include "meta_fixture.h"

namespace ckpt::meta {
namespace {

class MetaMtbfTest : public MetaFixture {
 protected:
  void SetUp() override {
    MetaFixture::SetUp();
    Register("a");
    Register("b");
  }

  uint64_t Failures() {
    auto s = core_->ClusterStatus(false, 0, "");
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->failures : 0;
  }
};

TEST_F(MetaMtbfTest, ACrashIsAFailure) {
  Silence("a");
  EXPECT_EQ(Failures(), 1u);
}

TEST_F(MetaMtbfTest, ACleanStopIsNoFailure) {
  Beat("a", /*stopping=*/true);
  Silence("a");
  EXPECT_EQ(Failures(), 0u);
  auto s = core_->ClusterStatus(false, 0, "");
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->mtbf_is_lower_bound);
  // It comes back and crashes later: that one counts.
  Register("a");
  Pass(absl::Seconds(1));
  Silence("a");
  EXPECT_EQ(Failures(), 1u);
}

TEST_F(MetaMtbfTest, ACleanRestartWithinTheLeaseIsNoFailure) {
  Beat("a", /*stopping=*/true);
  Register("a");  // back before the lease ran out
  EXPECT_EQ(Failures(), 0u);
  Register("a");  // a crash and restart within the lease
  EXPECT_EQ(Failures(), 1u);
}

TEST_F(MetaMtbfTest, AHeartbeatWithoutStoppingTakesItBack) {
  Beat("a", /*stopping=*/true);
  Beat("a");  // the stop did not happen
  Silence("a");
  EXPECT_EQ(Failures(), 1u);
}

TEST_F(MetaMtbfTest, ADrainedNodeThatStopsIsNoFailure) {
  ASSERT_TRUE(core_->DrainNode("a").ok());  // (LEFT at once when nothing needs it)
  Silence("a");
  EXPECT_EQ(Failures(), 0u);
}

TEST_F(MetaMtbfTest, AMetaRestartRemembersTheCleanStop) {
  Beat("a", /*stopping=*/true);
  Reopen();  // a gets a fresh lease, and says nothing more
  Silence("a");
  EXPECT_EQ(Failures(), 0u);
}

}  // namespace
}  // namespace ckpt::meta
