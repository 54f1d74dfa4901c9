// LeaseTable: lease and handle ids are random and belong to the session that
// took them (issue 34 finding 6; docs/security.md "Ids and tokens"). A fake
// clock and a liveness function the test sets; a real arena in a temp dir.
#include "server/agent/leases.h"

#include <set>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/clock.h"
#include "support/hex_id.h"
#include "common/metrics.h"
#include "server/agent/arena.h"
#include "support/temp_dir.h"

namespace ckpt::agent {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ckpt::testing::TempDir;

constexpr uint64_t kPage = kArenaPageBytes;

class LeaseTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Arena>> a = Arena::Open({dir_.path(), 16 * kPage, false});
    ASSERT_TRUE(a.ok()) << a.status();
    arena_ = *std::move(a);
  }

  // A table whose clients' sessions are disconnected when in
  // `disconnected_`, gone (ended) when in `gone_`, connected otherwise.
  std::unique_ptr<LeaseTable> NewTable() {
    return std::make_unique<LeaseTable>(&clock_, &metrics_, [this](const ClientRef& c) {
      if (gone_.count(c.session_id) != 0) return ClientState::kGone;
      if (disconnected_.count(c.session_id) != 0) return ClientState::kDisconnected;
      return ClientState::kConnected;
    });
  }

  ReservationPtr Bytes() { return *arena_->Reserve(kPage); }

  absl::StatusOr<std::string> Add(LeaseTable& t, const ShardId& shard, const ClientRef& client,
                                  absl::Duration ttl = absl::InfiniteDuration()) {
    return t.Add(shard, kPage, Bytes(), "run", client, ttl);
  }

  // A pinned copy for handles.
  Pin CopyPin(const ShardId& id) {
    auto rec = std::make_shared<ShardRecord>();
    rec->id = id;
    rec->size_bytes = kPage;
    return Pin{rec, Bytes()};
  }

  TempDir dir_ = *TempDir::Create();
  std::unique_ptr<Arena> arena_;
  FakeClock clock_;
  MetricsRegistry registry_;
  AgentMetrics metrics_{registry_};
  std::set<std::string> gone_;
  std::set<std::string> disconnected_;
  const ShardId shard_{"job", 7, 0};
  const ClientRef a_{111, "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"};
  const ClientRef b_{222, "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"};
};

TEST_F(LeaseTableTest, IdsAre128RandomBitsInHexThatNoOtherTableRepeats) {
  auto t1 = NewTable();
  auto t2 = NewTable();
  std::vector<std::string> ids1, ids2;
  for (uint32_t rank = 0; rank < 4; ++rank) {
    absl::StatusOr<std::string> id1 = Add(*t1, ShardId{"job", 1, rank}, a_);
    absl::StatusOr<std::string> id2 = Add(*t2, ShardId{"job", 1, rank}, a_);
    ASSERT_TRUE(id1.ok() && id2.ok());
    EXPECT_TRUE(ckpt::testing::IsHexId(*id1, "l-")) << *id1;
    EXPECT_TRUE(ckpt::testing::IsHexId(*id2, "l-")) << *id2;
    ids1.push_back(*id1);
    ids2.push_back(*id2);
  }
  // Made at the same (fake) time in the same order: a time and a counter
  // would give both tables the same ids.
  const std::string h1 = t1->OpenHandle(shard_, CopyPin(shard_), a_, absl::InfiniteDuration());
  const std::string h2 = t2->OpenHandle(shard_, CopyPin(shard_), a_, absl::InfiniteDuration());
  EXPECT_TRUE(ckpt::testing::IsHexId(h1, "h-")) << h1;
  ids1.push_back(h1);
  ids2.push_back(h2);
  std::set<std::string> all(ids1.begin(), ids1.end());
  all.insert(ids2.begin(), ids2.end());
  EXPECT_EQ(all.size(), ids1.size() + ids2.size());
  // Consecutive ids share no long prefix (no counter in the low digits).
  EXPECT_NE(ids1[0].substr(0, 12), ids1[1].substr(0, 12));
}

TEST_F(LeaseTableTest, AnotherSessionCannotCommitOrAbortALease) {
  auto t = NewTable();
  absl::StatusOr<std::string> id = Add(*t, shard_, a_);
  ASSERT_TRUE(id.ok()) << id.status();
  for (const std::string& other : {b_.session_id, std::string()}) {
    absl::StatusOr<CommittingLease> c = t->BeginCommit(*id, 0, other);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kPermissionDenied) << c.status();
    EXPECT_THAT(c.status().message(), Not(HasSubstr(a_.session_id)));
    EXPECT_EQ(t->Abort(*id, other).code(), absl::StatusCode::kPermissionDenied);
  }
  // Nothing changed: the lease is still open, and its own session commits.
  EXPECT_EQ(t->lease_count(), 1u);
  absl::StatusOr<CommittingLease> c = t->BeginCommit(*id, 0, a_.session_id);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(t->FinishCommit(*id, shard_));
  // A replay: AlreadyExists for its session, PermissionDenied for another.
  EXPECT_EQ(t->BeginCommit(*id, 0, a_.session_id).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(t->BeginCommit(*id, 0, b_.session_id).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(t->Abort(*id, b_.session_id).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(t->Abort(*id, a_.session_id).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(LeaseTableTest, ALeaseTakenWithoutASessionIsUsedOnlyWithoutOne) {
  auto t = NewTable();
  const ClientRef tool{333, ""};
  absl::StatusOr<std::string> id = Add(*t, shard_, tool, absl::Seconds(60));
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(t->BeginCommit(*id, 0, a_.session_id).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(t->Abort(*id, a_.session_id).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(t->Abort(*id, "").ok());
  EXPECT_EQ(t->lease_count(), 0u);
}

TEST_F(LeaseTableTest, AnotherSessionCannotCloseOrUseAHandle) {
  auto t = NewTable();
  const std::string h = t->OpenHandle(shard_, CopyPin(shard_), a_, absl::InfiniteDuration());
  EXPECT_EQ(t->CloseHandle(h, b_.session_id).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(t->CloseHandle(h, "").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(t->HandlePin(h, b_.session_id).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(t->handle_count(), 1u);
  EXPECT_TRUE(t->HandlePin(h, a_.session_id).ok());
  EXPECT_TRUE(t->CloseHandle(h, a_.session_id).ok());
  EXPECT_TRUE(t->CloseHandle(h, b_.session_id).ok());  // closed: unknown ids are fine
  EXPECT_EQ(t->handle_count(), 0u);
  EXPECT_EQ(t->HandlePin(h, a_.session_id).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(LeaseTableTest, ALeaseOfAnotherLiveSessionIsNotReplaced) {
  auto t = NewTable();
  absl::StatusOr<std::string> first = Add(*t, shard_, a_);
  ASSERT_TRUE(first.ok());
  const uint64_t free_before = arena_->free_bytes();
  EXPECT_EQ(t->MayLease(shard_, b_).code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<std::string> second = Add(*t, shard_, b_);
  ASSERT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  // The refusal names the holder's pid, never its session or lease id.
  EXPECT_THAT(second.status().message(), HasSubstr("pid 111"));
  EXPECT_THAT(second.status().message(), HasSubstr("job/7/0"));
  EXPECT_THAT(second.status().message(), Not(HasSubstr(a_.session_id)));
  EXPECT_THAT(second.status().message(), Not(HasSubstr(*first)));
  // Nothing changed: the first lease is open and commits; the refused
  // lease's space went back to the arena.
  EXPECT_EQ(arena_->free_bytes(), free_before);
  EXPECT_EQ(t->lease_count(), 1u);
  ASSERT_TRUE(t->BeginCommit(*first, 0, a_.session_id).ok());
  // Being committed: refused too.
  EXPECT_EQ(Add(*t, shard_, b_).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(t->FinishCommit(*first, shard_));
}

TEST_F(LeaseTableTest, ALeaseOfASessionThatIsGoneIsReplaced) {
  auto t = NewTable();
  absl::StatusOr<std::string> first = Add(*t, shard_, a_);
  ASSERT_TRUE(first.ok());
  gone_.insert(a_.session_id);  // closed, and its grace passed (Expire has not run yet)
  EXPECT_TRUE(t->MayLease(shard_, b_).ok());
  absl::StatusOr<std::string> second = Add(*t, shard_, b_);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(t->lease_count(), 1u);
  EXPECT_EQ(t->BeginCommit(*first, 0, a_.session_id).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(t->BeginCommit(*second, 0, b_.session_id).ok());
}

// A trainer killed right after a commit holds the lease it asked for ahead
// of its next save; the restarted trainer (a new session) saves that step
// at once, within the dead session's grace period.
TEST_F(LeaseTableTest, ALeaseOfADisconnectedSessionIsReplacedButNotExpired) {
  auto t = NewTable();
  absl::StatusOr<std::string> first = Add(*t, shard_, a_);
  const std::string h = t->OpenHandle(shard_, CopyPin(shard_), a_, absl::InfiniteDuration());
  ASSERT_TRUE(first.ok());
  disconnected_.insert(a_.session_id);
  EXPECT_EQ(t->Expire(), 0);  // within the grace period: kept for a resumed session
  EXPECT_EQ(t->lease_count(), 1u);
  absl::StatusOr<std::string> second = Add(*t, shard_, b_);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(t->lease_count(), 1u);
  EXPECT_EQ(t->handle_count(), 1u);  // its other holdings stay until the session ends
  EXPECT_TRUE(t->BeginCommit(*second, 0, b_.session_id).ok());
  gone_.insert(a_.session_id);
  EXPECT_EQ(t->Expire(), 1);  // the handle
  EXPECT_EQ(t->handle_count(), 0u);
  (void)h;
}

TEST_F(LeaseTableTest, TheSameSessionReplacesItsOwnLease) {
  auto t = NewTable();
  absl::StatusOr<std::string> first = Add(*t, shard_, a_);
  absl::StatusOr<std::string> second = Add(*t, shard_, a_);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_NE(*first, *second);
  EXPECT_EQ(t->lease_count(), 1u);
  EXPECT_EQ(arena_->free_bytes(), 15 * kPage);  // the first lease's page is back
  EXPECT_EQ(t->BeginCommit(*first, 0, a_.session_id).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(t->BeginCommit(*second, 0, a_.session_id).ok());
}

TEST_F(LeaseTableTest, ALeaseWithoutASessionIsReplacedOnlyAfterItsTtlByASession) {
  auto t = NewTable();
  const ClientRef tool{333, ""};
  absl::StatusOr<std::string> first = Add(*t, shard_, tool, absl::Seconds(60));
  ASSERT_TRUE(first.ok());
  absl::StatusOr<std::string> refused = Add(*t, shard_, a_);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("pid 333"));
  // Another call without a session cannot be told from the one that took it
  // (a tool that lost the id asks again): it replaces it, as before.
  absl::StatusOr<std::string> again = Add(*t, shard_, tool, absl::Seconds(60));
  ASSERT_TRUE(again.ok());
  clock_.Advance(absl::Seconds(61));
  absl::StatusOr<std::string> after = Add(*t, shard_, a_);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(t->lease_count(), 1u);
  // And a session's lease is not replaced by a call without one.
  EXPECT_EQ(Add(*t, shard_, tool, absl::Seconds(60)).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(IdForLog, ShowsTooFewCharactersToUseTheId) {
  EXPECT_EQ(IdForLog("l-0123456789abcdef0123456789abcdef"), "l-01234567...");
  EXPECT_EQ(IdForLog("0123456789abcdef0123456789abcdef"), "01234567...");
  EXPECT_EQ(IdForLog("short"), "short");
}

}  // namespace
}  // namespace ckpt::agent
