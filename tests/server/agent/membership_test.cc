// PeerMembership (membership.h): who may use this agent's data plane.
#include "server/agent/membership.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "common/clock.h"

namespace ckpt::agent {
namespace {

using ::testing::HasSubstr;

class MembershipTest : public ::testing::Test {
 protected:
  // A heartbeat answered at once: what the refresh callback would cause.
  void Answer(uint64_t generation, std::optional<std::vector<Member>> members) {
    members_.Update(members_.Sending(), generation, members);
  }

  FakeClock clock_;
  int refreshes_ = 0;
  PeerMembership members_{&clock_, [this] { ++refreshes_; }};
};

TEST_F(MembershipTest, AdmitsOnlyMembersWithTheirCurrentIncarnation) {
  EXPECT_EQ(members_.generation(), 0u);
  // Nothing from meta yet: not a refusal for good.
  EXPECT_EQ(members_.Admit("n1", 1, absl::ZeroDuration()).code(), absl::StatusCode::kUnavailable);
  Answer(40, std::vector<Member>{{"n1", 1}, {"n2", 3}});
  EXPECT_EQ(members_.generation(), 40u);
  EXPECT_TRUE(members_.Admit("n1", 1, absl::ZeroDuration()).ok());
  EXPECT_TRUE(members_.Admit("n2", 3, absl::ZeroDuration()).ok());
  absl::Status stale = members_.Admit("n2", 2, absl::ZeroDuration());
  EXPECT_EQ(stale.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(stale.message(), HasSubstr("\"n2\" incarnation 2 is not current: meta lists incarnation 3"));
  absl::Status stranger = members_.Admit("intruder", 1, absl::ZeroDuration());
  EXPECT_EQ(stranger.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(stranger.message(), HasSubstr("\"intruder\" is not a member"));
  absl::Status nobody = members_.Admit("", 0, absl::Seconds(2));
  EXPECT_EQ(nobody.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(refreshes_, 0);  // nobody is never worth a refresh
  // An answer without members keeps the table; new members replace it.
  Answer(40, std::nullopt);
  EXPECT_TRUE(members_.Admit("n1", 1, absl::ZeroDuration()).ok());
  Answer(41, std::vector<Member>{{"n2", 3}});
  EXPECT_EQ(members_.Admit("n1", 1, absl::ZeroDuration()).code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(MembershipTest, ASenderNewerThanTheTableWaitsForTheNextAnswer) {
  Answer(7, std::vector<Member>{{"n1", 1}});
  absl::Status admitted = absl::UnknownError("not run");
  std::thread reader([&] { admitted = members_.Admit("n1", 2, absl::Seconds(2)); });
  clock_.BlockUntilWaiters(1);
  EXPECT_EQ(refreshes_, 1);
  // An answer to a heartbeat sent before the request does not decide it.
  const uint64_t early = 1;  // Answer's Sending() above was number 1
  members_.Update(early, 7, std::nullopt);
  EXPECT_EQ(clock_.NumWaiters(), 1);
  Answer(8, std::vector<Member>{{"n1", 2}});  // n1 restarted and registered
  reader.join();
  EXPECT_TRUE(admitted.ok()) << admitted;
}

TEST_F(MembershipTest, ASenderMetaNeverListsIsRefusedWhenTheWaitEnds) {
  Answer(7, std::vector<Member>{{"n1", 1}});
  absl::Status admitted;
  std::thread reader([&] { admitted = members_.Admit("n9", 1, absl::Seconds(2)); });
  clock_.BlockUntilWaiters(1);
  clock_.Advance(absl::Seconds(2));  // no answer (meta away)
  reader.join();
  EXPECT_EQ(admitted.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(admitted.message(), HasSubstr("\"n9\" is not a member"));
}

}  // namespace
}  // namespace ckpt::agent
