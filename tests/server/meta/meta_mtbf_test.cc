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

namespace ckpt::meta {
namespace {

class MetaMtbfTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Reopen();
    Register("a");
    Register("b");
  }

  void Reopen() {
    core_.reset();
    auto c = MetaCore::Open(store_.get(), &clock_, options_);
    ASSERT_TRUE(c.ok()) << c.status();
    core_ = std::move(*c);
  }

  void Register(const std::string& id) {
    RegisterRequest r;
    r.node_id = id;
    r.grpc_address = id + ":7401";
    r.data_address = id + ":7402";
    r.memory_capacity_bytes = 1 << 30;
    auto res = core_->RegisterNode(r);
    ASSERT_TRUE(res.ok()) << res.status();
    inc_[id] = res->incarnation;
    dead_.erase(id);
  }

  void Beat(const std::string& id, bool stopping = false) {
    HeartbeatRequest h;
    h.node_id = id;
    h.incarnation = inc_[id];
    h.stopping = stopping;
    auto res = core_->Heartbeat(h);
    ASSERT_TRUE(res.ok()) << res.status();
  }

  // Every live node heartbeats each second of `d`; meta ticks.
  void Pass(absl::Duration d) {
    for (absl::Duration t; t < d; t += absl::Seconds(1)) {
      clock_.Advance(absl::Seconds(1));
      for (const auto& [n, inc] : inc_)
        if (!dead_.count(n)) Beat(n);
      ASSERT_TRUE(core_->Tick().ok());
    }
  }

  // `node` stops heartbeating until meta declares it DEAD (lease 5 s).
  void Silence(const std::string& node) {
    dead_.insert(node);
    Pass(absl::Seconds(7));
  }

  uint64_t Failures() {
    auto s = core_->ClusterStatus(false, 0, "");
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->failures : 0;
  }

  FakeClock clock_;
  MetaOptions options_;
  std::unique_ptr<MetaStore> store_ = NewMemMetaStore();
  std::unique_ptr<MetaCore> core_;
  std::map<std::string, uint64_t> inc_;
  std::set<std::string> dead_;
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
