// Meta's replicated log: the entry encoding (no etcd), and ReplicatedMetaStore
// + LogFollower against a real etcd (etcd_test_server.h; skipped without
// /usr/bin/etcd): what the leader acknowledges is what a follower applies, a
// deposed leader's writes fail, a new leader continues the log.
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/meta/etcd/etcd_client.h"
#include "server/meta/etcd/etcd_election.h"
#include "server/meta/etcd/etcd_session.h"
#include "server/meta/etcd/etcd_test_server.h"
#include "server/meta/etcd/meta_log.h"
#include "server/meta/etcd/replicated_store.h"
#include "server/meta/store/mem_meta_store.h"
#include "support/temp_dir.h"

namespace ckpt::meta {
namespace {

using ::ckpt::testing::EtcdTestServer;
using ::ckpt::testing::TempDir;
using ::testing::HasSubstr;

constexpr char kRoot[] = "/ckpt/test";

// Every key and value of `store` but the replica's own bookkeeping.
std::map<std::string, std::string> Contents(MetaStore* store) {
  std::map<std::string, std::string> out;
  EXPECT_TRUE(store
                  ->Scan("",
                         [&](std::string_view k, std::string_view v) {
                           if (k.substr(0, 1) != "~") out[std::string(k)] = std::string(v);
                           return true;
                         })
                  .ok());
  return out;
}

WriteBatch Batch(const std::string& key, const std::string& value) {
  WriteBatch b;
  b.Put(key, value);
  return b;
}

TEST(MetaLogTest, AGroupRoundTripsThroughItsEntries) {
  WriteBatch group;
  group.Put("n/a", "1");
  group.Delete("n/b");
  group.Put(std::string("k\0z", 3), std::string(10, '\0'));
  std::vector<std::string> entries = replica::EncodeEntries(group);
  ASSERT_EQ(entries.size(), 1u);
  replica::EntryAssembler a;
  absl::StatusOr<std::optional<WriteBatch>> out = a.Add(entries[0]);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_TRUE(out->has_value());
  ASSERT_EQ((*out)->size(), 3u);
  EXPECT_EQ((*out)->ops()[1].type, WriteBatch::OpType::kDelete);
  EXPECT_EQ((*out)->ops()[2].key, std::string("k\0z", 3));
  EXPECT_EQ((*out)->ops()[2].value, std::string(10, '\0'));
}

TEST(MetaLogTest, ABigGroupIsCutIntoEntriesAndAppliesOnlyWhole) {
  WriteBatch group;
  group.Put("v/big", std::string(3 * replica::kMaxEntryBytes, 'x'));
  group.Put("v/small", "y");
  std::vector<std::string> entries = replica::EncodeEntries(group);
  ASSERT_EQ(entries.size(), 4u);
  replica::EntryAssembler a;
  for (size_t i = 0; i + 1 < entries.size(); ++i) {
    EXPECT_LE(entries[i].size(), replica::kMaxEntryBytes);
    absl::StatusOr<std::optional<WriteBatch>> out = a.Add(entries[i]);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_FALSE(out->has_value()) << "applied before its last entry";
  }
  absl::StatusOr<std::optional<WriteBatch>> out = a.Add(entries.back());
  ASSERT_TRUE(out.ok() && out->has_value());
  EXPECT_EQ((*out)->ops()[0].value.size(), 3 * replica::kMaxEntryBytes);
}

TEST(MetaLogTest, AGroupLeftUnfinishedIsDroppedByTheNextAndDamageIsDataLoss) {
  WriteBatch big;
  big.Put("v/big", std::string(2 * replica::kMaxEntryBytes, 'x'));
  std::vector<std::string> unfinished = replica::EncodeEntries(big);
  replica::EntryAssembler a;
  ASSERT_TRUE(a.Add(unfinished[0]).ok());  // its leader died here
  absl::StatusOr<std::optional<WriteBatch>> next = a.Add(replica::EncodeEntries(Batch("n/a", "1"))[0]);
  ASSERT_TRUE(next.ok() && next->has_value());
  ASSERT_EQ((*next)->size(), 1u);
  EXPECT_EQ((*next)->ops()[0].key, "n/a");

  std::string damaged = replica::EncodeEntries(Batch("n/a", "1"))[0];
  damaged.back() ^= 1;
  EXPECT_TRUE(absl::IsDataLoss(a.Add(damaged).status()));
  EXPECT_TRUE(absl::IsDataLoss(a.Add("not an entry").status()));
  EXPECT_TRUE(absl::IsDataLoss(a.Add(unfinished[1]).status())) << "a group's tail without its head";
}

TEST(MetaLogTest, LogKeysSortByIndex) {
  EXPECT_LT(replica::LogKey(kRoot, 9), replica::LogKey(kRoot, 10));
  EXPECT_EQ(*replica::LogIndexOf(kRoot, replica::LogKey(kRoot, 12345)), 12345u);
  EXPECT_FALSE(replica::LogIndexOf(kRoot, "/ckpt/test/log/x").ok());
  EXPECT_FALSE(replica::LogIndexOf(kRoot, "/other/log/00000000000000000001").ok());
}

class ReplicatedStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!EtcdTestServer::Available()) GTEST_SKIP() << EtcdTestServer::MissingReason();
    absl::StatusOr<std::unique_ptr<EtcdTestServer>> server = EtcdTestServer::StartInTempDir(&tmp_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    EtcdOptions options;
    options.endpoints = {server_->endpoint()};
    options.call_timeout = absl::Seconds(3);
    absl::StatusOr<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(options);
    ASSERT_TRUE(client.ok()) << client.status();
    etcd_ = std::move(*client);
  }

  void TearDown() override {
    etcd_.reset();
    if (server_ != nullptr && server_->process()->IsRunning()) {
      EXPECT_TRUE(server_->Kill().ok());
    }
  }

  // A replica: its own store, session and election.
  struct Replica {
    std::unique_ptr<MetaStore> local = NewMemMetaStore();
    std::unique_ptr<EtcdSession> session;
    std::unique_ptr<EtcdElection> election;
    std::unique_ptr<LogFollower> follower;
    std::unique_ptr<ReplicatedMetaStore> store;
  };

  std::unique_ptr<Replica> NewReplica() {
    auto r = std::make_unique<Replica>();
    absl::StatusOr<std::unique_ptr<EtcdSession>> session = EtcdSession::Create(etcd_.get(), absl::Seconds(2));
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return nullptr;
    r->session = std::move(*session);
    r->election = std::make_unique<EtcdElection>(etcd_.get(), r->session.get(), replica::LeaderPrefix(kRoot));
    absl::StatusOr<std::unique_ptr<LogFollower>> follower = LogFollower::Create(r->local.get(), etcd_.get(), kRoot);
    EXPECT_TRUE(follower.ok()) << follower.status();
    if (!follower.ok()) return nullptr;
    r->follower = std::move(*follower);
    return r;
  }

  // Campaigns, catches up and opens the replicated store.
  void Lead(Replica* r, ReplicaOptions options = {}) {
    ASSERT_TRUE(r->election->Campaign("me", absl::Seconds(10)).ok());
    r->follower->Stop();
    absl::StatusOr<uint64_t> next = r->follower->CatchUp();
    ASSERT_TRUE(next.ok()) << next.status();
    r->store =
        std::make_unique<ReplicatedMetaStore>(r->local.get(), etcd_.get(), r->election.get(), kRoot, *next, options);
  }

  static bool WaitApplied(Replica* r, uint64_t index) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (r->follower->applied_index() < index) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return true;
  }

  std::unique_ptr<TempDir> tmp_;
  std::unique_ptr<EtcdTestServer> server_;
  std::unique_ptr<EtcdClient> etcd_;
};

TEST_F(ReplicatedStoreTest, WhatTheLeaderAcknowledgesAFollowerApplies) {
  std::unique_ptr<Replica> leader = NewReplica();
  std::unique_ptr<Replica> follower = NewReplica();
  ASSERT_TRUE(leader && follower);
  follower->follower->Start();
  Lead(leader.get());
  std::vector<uint64_t> seqs;
  for (int i = 0; i < 50; ++i) seqs.push_back(leader->store->Submit(Batch(absl::StrCat("n/", i), "v")));
  WriteBatch del;
  del.Delete("n/7");
  seqs.push_back(leader->store->Submit(std::move(del)));
  WriteBatch big;
  big.Put("v/big", std::string(2 * replica::kMaxEntryBytes + 5, 'b'));  // three entries
  seqs.push_back(leader->store->Submit(std::move(big)));
  for (uint64_t s : seqs) ASSERT_TRUE(leader->store->AwaitDurable(s).ok());
  const ReplicaStats stats = leader->store->replica_stats();
  EXPECT_GE(stats.entries_appended, 3u);
  EXPECT_EQ(*replica::ReadAppliedIndex(leader->local.get()), stats.last_index);
  ASSERT_TRUE(WaitApplied(follower.get(), stats.last_index)) << follower->follower->status();
  EXPECT_EQ(Contents(follower->local.get()), Contents(leader->local.get()));
  EXPECT_EQ(Contents(leader->local.get()).size(), 50u);  // 49 nodes and the big value
  EXPECT_EQ(*leader->store->Get("n/3"), "v");
}

TEST_F(ReplicatedStoreTest, ADeposedLeaderCannotWriteAndTheNextContinuesTheLog) {
  std::unique_ptr<Replica> a = NewReplica();
  std::unique_ptr<Replica> b = NewReplica();
  ASSERT_TRUE(a && b);
  Lead(a.get());
  ASSERT_TRUE(a->store->Commit(Batch("j/one", "1")).ok());
  // b queues behind a, then a's lease goes (as if it were paused past it).
  b->follower->Start();
  a->session->Abandon();
  ASSERT_FALSE(a->session->WaitLost(absl::Seconds(10)).ok());
  Lead(b.get());
  const absl::Status late = a->store->Commit(Batch("j/stale", "x"));
  // UNAVAILABLE, not FAILED_PRECONDITION: callers retry and reach the new
  // leader (an agent drops a report meta refuses with FAILED_PRECONDITION,
  // which lost a shard's report in netns_meta_replica_test).
  EXPECT_TRUE(absl::IsUnavailable(late)) << late;
  EXPECT_THAT(std::string(late.message()), HasSubstr("no longer the leader"));
  EXPECT_THAT(std::string(late.message()), HasSubstr("another replica takes over: retry"));
  // Sticky: later writes are refused too.
  EXPECT_TRUE(absl::IsUnavailable(a->store->Commit(Batch("j/later", "y"))));
  ASSERT_TRUE(b->store->Commit(Batch("j/two", "2")).ok());
  auto contents = Contents(b->local.get());
  EXPECT_EQ(contents.count("j/one"), 1u);
  EXPECT_EQ(contents.count("j/two"), 1u);
  EXPECT_EQ(contents.count("j/stale"), 0u);

  // A replica that lost its disk replays the whole log.
  std::unique_ptr<Replica> fresh = NewReplica();
  ASSERT_TRUE(fresh);
  fresh->follower->Start();
  ASSERT_TRUE(WaitApplied(fresh.get(), b->store->replica_stats().last_index));
  EXPECT_EQ(Contents(fresh->local.get()), contents);
}

TEST_F(ReplicatedStoreTest, AFollowerResumesWhereItsStoreSaysItStopped) {
  std::unique_ptr<Replica> leader = NewReplica();
  ASSERT_TRUE(leader);
  Lead(leader.get());
  auto store = NewMemMetaStore();
  ASSERT_TRUE(leader->store->Commit(Batch("n/1", "a")).ok());
  {
    absl::StatusOr<std::unique_ptr<LogFollower>> f = LogFollower::Create(store.get(), etcd_.get(), kRoot);
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*f)->CatchUp().ok());
    EXPECT_EQ((*f)->applied_index(), 1u);
  }
  ASSERT_TRUE(leader->store->Commit(Batch("n/1", "b")).ok());
  ASSERT_TRUE(leader->store->Commit(Batch("n/2", "c")).ok());
  absl::StatusOr<std::unique_ptr<LogFollower>> f = LogFollower::Create(store.get(), etcd_.get(), kRoot);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ((*f)->applied_index(), 1u);
  absl::StatusOr<uint64_t> end = (*f)->CatchUp();
  ASSERT_TRUE(end.ok());
  EXPECT_EQ(*end, 4u);
  EXPECT_EQ(*store->Get("n/1"), "b");
  EXPECT_EQ(*store->Get("n/2"), "c");
}

TEST_F(ReplicatedStoreTest, SnapshotsTrimTheLogAndBringUpAReplicaThatIsFarBehind) {
  std::unique_ptr<Replica> leader = NewReplica();
  ASSERT_TRUE(leader);
  ReplicaOptions options;
  options.snapshot_every_entries = 5;
  Lead(leader.get(), options);
  // A follower that applied the start of the log, then stopped.
  auto behind = NewMemMetaStore();
  ASSERT_TRUE(leader->store->Commit(Batch("n/0", "first")).ok());
  {
    absl::StatusOr<std::unique_ptr<LogFollower>> f = LogFollower::Create(behind.get(), etcd_.get(), kRoot);
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*f)->CatchUp().ok());
  }
  WriteBatch big;
  big.Put("v/big", std::string(replica::kMaxEntryBytes + 7, 'b'));  // a snapshot of two parts
  ASSERT_TRUE(leader->store->Commit(std::move(big)).ok());
  for (int i = 1; i <= 30; ++i) ASSERT_TRUE(leader->store->Commit(Batch(absl::StrCat("n/", i % 7), absl::StrCat(i))).ok());
  WriteBatch del;
  del.Delete("n/3");
  ASSERT_TRUE(leader->store->Commit(std::move(del)).ok());
  // Snapshots run beside the writer: wait for one past the start of the log.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  // A snapshot is started by a write after it is due (not while the previous
  // one is still being written): keep writing until one past index 20 is done.
  for (int i = 0; leader->store->replica_stats().snapshot_index < 20 && absl::Now() < deadline; ++i) {
    ASSERT_TRUE(leader->store->Commit(Batch("n/tick", absl::StrCat(i))).ok());
    absl::SleepFor(absl::Milliseconds(20));
  }
  const ReplicaStats stats = leader->store->replica_stats();
  ASSERT_GE(stats.snapshot_index, 20u);
  absl::StatusOr<std::optional<EtcdKeyValue>> first = etcd_->Get(replica::LogKey(kRoot, 1));
  ASSERT_TRUE(first.ok());
  EXPECT_FALSE(first->has_value()) << "the log before the snapshot is still there";

  // The stopped follower and a replica with nothing both come up from the snapshot.
  const auto want = Contents(leader->local.get());
  EXPECT_EQ(want.count("n/3"), 0u);
  for (MetaStore* store : {behind.get()}) {
    absl::StatusOr<std::unique_ptr<LogFollower>> f = LogFollower::Create(store, etcd_.get(), kRoot);
    ASSERT_TRUE(f.ok());
    absl::StatusOr<uint64_t> end = absl::AbortedError("");
    for (int i = 0; i < 10 && absl::IsAborted(end.status()); ++i) end = (*f)->CatchUp();
    ASSERT_TRUE(end.ok()) << end.status();
    EXPECT_EQ(*end, stats.last_index + 1);
    EXPECT_EQ(Contents(store), want);
  }
  std::unique_ptr<Replica> fresh = NewReplica();
  ASSERT_TRUE(fresh);
  fresh->follower->Start();
  ASSERT_TRUE(WaitApplied(fresh.get(), stats.last_index)) << fresh->follower->status();
  EXPECT_EQ(Contents(fresh->local.get()), want);
  // And it leads on from there.
  fresh->follower->Stop();
  leader->store.reset();
  ASSERT_TRUE(leader->election->Resign().ok());
  Lead(fresh.get());
  ASSERT_TRUE(fresh->store->Commit(Batch("n/after", "x")).ok());
  EXPECT_EQ(*fresh->store->Get("n/after"), "x");
}

}  // namespace
}  // namespace ckpt::meta
