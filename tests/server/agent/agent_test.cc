// Agent: save path, bad input, budget, verification, flush and restart, all
// driven deterministically (FakeClock, fake MetaLink, in-memory durable tier,
// the loops called by hand; no threads, no sleeps).
#include "server/agent/agent.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <set>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/durable_format.h"
#include "common/fault_file_system.h"
#include "common/mem_file_system.h"
#include "common/names.h"
#include "support/temp_dir.h"
#include "fake_meta.h"

namespace ckpt::agent {
namespace {

using ::testing::HasSubstr;
using ckpt::testing::TempDir;

constexpr uint64_t kMiB = 1 << 20;

class AgentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<TempDir>(*TempDir::Create());
    meta_.world["job"] = 2;
    StartAgent();
  }

  void StartAgent() {
    AgentOptions o;
    o.node_id = "node-1";
    o.memory_dir = dir_->path() + "/mem";
    o.memory_bytes = 8 * kMiB;
    o.populate = false;
    o.durable_root = "/durable";
    o.flush_retry_initial_ms = 100;
    o.flush_max_tries = 3;
    o.memory_fs = &memory_fs_;
    o.on_data_plane_key = [this](const std::string& key) { data_plane_keys_.push_back(key); };
    absl::StatusOr<std::unique_ptr<Agent>> a = Agent::Create(o, &meta_, &clock_, &fault_fs_, &metrics_);
    ASSERT_TRUE(a.ok()) << a.status();
    agent_ = *std::move(a);
  }

  // Copies `bytes` into a lease's regions at shard offset `off`.
  void Write(const LeaseGrant& g, uint64_t off, const std::string& bytes) {
    for (size_t i = 0; i < bytes.size(); ++i) {
      const uint64_t pos = off + i;
      for (const Region& r : g.regions) {
        if (pos >= r.shard_offset && pos < r.shard_offset + r.length) {
          const_cast<std::byte*>(agent_->arena().Data(r.file_offset + pos - r.shard_offset))[0] =
              static_cast<std::byte>(bytes[i]);
        }
      }
    }
  }

  static ManifestItem Item(std::string name, uint64_t off, const std::string& bytes) {
    ManifestItem it;
    it.name = std::move(name);
    it.dtype = kDTypeBytes;
    it.offset_bytes = off;
    it.length_bytes = bytes.size();
    it.crc32c = Crc32c(bytes);
    return it;
  }

  // Saves two items for `rank` of `step`; returns the record.
  ShardRecord Save(uint64_t step, uint32_t rank, const std::string& a = "alpha-bytes",
                   const std::string& b = "bravo") {
    LeaseRequest req{"job", step, rank, 4096, "run-1", 0, 0, "", {}};
    absl::StatusOr<LeaseGrant> g = agent_->AcquireLease(req);
    EXPECT_TRUE(g.ok()) << g.status();
    Write(*g, 0, a);
    Write(*g, 64, b);
    absl::StatusOr<std::shared_ptr<const ShardRecord>> rec =
        agent_->Commit(g->lease_id, 128, {Item("a", 0, a), Item("b", 64, b)});
    EXPECT_TRUE(rec.ok()) << rec.status();
    return rec.ok() ? **rec : ShardRecord{};
  }

  // Runs meta's EVICT task for `step` of "job" on the agent.
  void RunEvictTask(uint64_t step) {
    AgentTask evict;
    evict.id = absl::StrCat("t-evict-", step);
    evict.kind = TaskKind::kEvict;
    evict.kind_name = "evict";
    evict.job_id = "job";
    evict.step = step;
    agent_->EnqueueTasks({evict});
    EXPECT_TRUE(agent_->TasksOnce());
  }

  std::unique_ptr<TempDir> dir_;
  FakeMeta meta_;
  FakeClock clock_;
  MemFileSystem mem_fs_;
  FaultFileSystem fault_fs_{&mem_fs_};
  // The memory tier's records and incarnation file (on the real memory dir).
  FaultFileSystem memory_fs_{PosixFileSystem()};
  MetricsRegistry metrics_;
  std::unique_ptr<Agent> agent_;
  std::vector<std::string> data_plane_keys_;  // what on_data_plane_key got (ControlOnce runs here)
};

// Meta's data-plane key reaches the daemon's hook (its UCX transport) at
// each registration, before anything else happens with meta; an --insecure
// meta's empty key is passed on as it is (the daemon then keeps its token).
TEST_F(AgentTest, MetasDataPlaneKeyIsHandedOnAtEachRegistration) {
  EXPECT_TRUE(data_plane_keys_.empty()) << "nothing before registering";
  meta_.data_plane_key = std::string(32, 'k');
  agent_->ControlOnce();
  ASSERT_EQ(data_plane_keys_.size(), 1u);
  EXPECT_EQ(data_plane_keys_[0], std::string(32, 'k'));
  agent_->ControlOnce();
  EXPECT_EQ(data_plane_keys_.size(), 1u) << "registered once";
  // A restarted agent registers again and gets the key again (it is not kept
  // on disk: without meta a restarted agent still serves local restores).
  agent_.reset();
  data_plane_keys_.clear();
  meta_.data_plane_key.clear();
  StartAgent();
  agent_->ControlOnce();
  ASSERT_EQ(data_plane_keys_.size(), 1u);
  EXPECT_EQ(data_plane_keys_[0], "");
}

TEST_F(AgentTest, CommitRecordsShardReportsStagedAndVerifiesInBackground) {
  ShardRecord rec = Save(10, 1);
  EXPECT_EQ(rec.size_bytes, 128u);
  EXPECT_EQ(rec.items.size(), 2u);
  EXPECT_EQ(rec.manifest_digest, ManifestDigest(rec.items));
  // The shard crc covers items and zero padding.
  std::string whole(128, '\0');
  std::memcpy(whole.data(), "alpha-bytes", 11);
  std::memcpy(whole.data() + 64, "bravo", 5);
  EXPECT_EQ(rec.crc32c, Crc32c(whole));

  agent_->ControlOnce();  // registers, reports STAGED, sends the inventory
  ASSERT_EQ(meta_.staged.size(), 1u);
  EXPECT_EQ(meta_.staged.begin()->second.crc32c, rec.crc32c);
  EXPECT_EQ(meta_.inventories.size(), 1u);
  EXPECT_FALSE(agent_->Inventory("job", 10)[0].verified);
  EXPECT_TRUE(agent_->VerifyOnce());
  EXPECT_TRUE(agent_->Inventory("job", 10)[0].verified);
  EXPECT_TRUE(agent_->Status().registered);
  EXPECT_EQ(meta_.begins, 1);
  Save(10, 0);  // second rank: the version is begun once
  agent_->ControlOnce();
  EXPECT_EQ(meta_.begins, 1);
}

// Incremental saves: a lease names the base versions it will refer to and
// the agent must hold them; a commit's references must each be one of the
// base shard's own items. Otherwise nothing is committed and the lease stays.
TEST_F(AgentTest, ReferencesMustNameItemsOfABaseHeldHere) {
  const ShardRecord base = Save(10, 0, "alpha-bytes", "bravo");
  absl::Status s = agent_->AcquireLease(LeaseRequest{"job", 11, 0, 4096, "run-1", 0, 0, "", {9}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("base version 9"), std::string::npos) << s;
  s = agent_->AcquireLease(LeaseRequest{"job", 11, 0, 4096, "run-1", 0, 0, "", {11}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;  // not older
  absl::StatusOr<LeaseGrant> g = agent_->AcquireLease(LeaseRequest{"job", 11, 0, 4096, "run-1", 0, 0, "", {10}});
  ASSERT_TRUE(g.ok()) << g.status();
  Write(*g, 0, "charlie");
  auto ref = [&](std::string name, uint64_t step, uint64_t off, const std::string& bytes) {
    ManifestItem it = Item(std::move(name), off, bytes);
    it.ref_step = step;
    return it;
  };
  // A reference to a version not held here, then to bytes the base has no item at.
  auto rec = agent_->Commit(g->lease_id, 64, {Item("c", 0, "charlie"), ref("a", 9, 0, "alpha-bytes")});
  EXPECT_EQ(rec.status().code(), absl::StatusCode::kFailedPrecondition) << rec.status();
  rec = agent_->Commit(g->lease_id, 64, {Item("c", 0, "charlie"), ref("a", 10, 1, "lpha-bytes")});
  EXPECT_EQ(rec.status().code(), absl::StatusCode::kInvalidArgument) << rec.status();
  EXPECT_NE(rec.status().message().find("holds no such item"), std::string::npos) << rec.status();
  rec = agent_->Commit(g->lease_id, 64, {Item("c", 0, "charlie"), ref("a", 10, 0, "alpha-bytez")});
  EXPECT_EQ(rec.status().code(), absl::StatusCode::kInvalidArgument) << rec.status();  // other crc
  // The lease is still usable: a good commit goes through. The shard is 64
  // bytes (its own item); its crc covers those alone.
  rec = agent_->Commit(g->lease_id, 64,
                       {Item("c", 0, "charlie"), ref("a", 10, 0, "alpha-bytes"), ref("b", 10, 64, "bravo")});
  ASSERT_TRUE(rec.ok()) << rec.status();
  std::string own(64, '\0');
  std::memcpy(own.data(), "charlie", 7);
  EXPECT_EQ((*rec)->crc32c, Crc32c(own));
  EXPECT_EQ((*rec)->items.size(), 3u);
  EXPECT_EQ(RefSteps((*rec)->items), std::vector<uint64_t>{10});
  // The background verification checks the own item and skips the references.
  while (agent_->VerifyOnce()) {
  }
  for (const auto& info : agent_->Inventory("job", 11)) EXPECT_TRUE(info.verified);
  EXPECT_EQ(base.items.size(), 2u);
}

// The race the chaos soak found: this node accepted a commit referring to
// version 10 while meta was aborting and evicting 10 (it never completed).
// Meta refuses the STAGED report; the agent, which pinned 10's bytes at the
// commit, stores the shard self-contained instead of dropping it, so the
// version can still complete.
TEST_F(AgentTest, AShardWhoseBaseMetaDiscardedIsStoredSelfContained) {
  Save(10, 0, "alpha-bytes", "bravo");
  agent_->ControlOnce();
  ASSERT_EQ(meta_.staged.count(ShardId{"job", 10, 0}), 1u);
  absl::StatusOr<LeaseGrant> g = agent_->AcquireLease(LeaseRequest{"job", 11, 0, 4096, "run-1", 0, 0, "", {10}});
  ASSERT_TRUE(g.ok()) << g.status();
  Write(*g, 0, "charlie");
  auto ref = [&](std::string name, uint64_t off, const std::string& bytes) {
    ManifestItem it = Item(std::move(name), off, bytes);
    it.ref_step = 10;
    return it;
  };
  auto rec = agent_->Commit(g->lease_id, 7,
                            {Item("c", 0, "charlie"), ref("a", 0, "alpha-bytes"), ref("b", 64, "bravo")});
  ASSERT_TRUE(rec.ok()) << rec.status();
  // Meta evicts 10 (the drop reaches this node first), then refuses 11.
  const uint64_t free_before = agent_->arena().free_bytes();
  RunEvictTask(10);
  EXPECT_TRUE(agent_->Inventory("job", 10).empty());
  EXPECT_EQ(agent_->arena().free_bytes(), free_before);  // 10's bytes still pinned by 11
  meta_.gone_bases.insert(10);
  agent_->ControlOnce();
  // 11 was stored again with every item its own, and reported.
  ASSERT_EQ(meta_.staged.count(ShardId{"job", 11, 0}), 1u);
  const ShardRecord& staged = meta_.staged[ShardId{"job", 11, 0}];
  EXPECT_TRUE(RefSteps(staged.items).empty());
  ASSERT_EQ(staged.items.size(), 3u);
  absl::StatusOr<OpenResult> open = agent_->OpenShard(ShardId{"job", 11, 0}, false, 0, 0);
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_EQ(open->shard.record->crc32c, staged.crc32c);
  std::string bytes(open->shard.record->size_bytes, '\0');
  for (const Region& r : open->shard.regions) {
    std::memcpy(bytes.data() + r.shard_offset, agent_->arena().Data(r.file_offset), r.length);
  }
  EXPECT_EQ(Crc32c(bytes), staged.crc32c);
  for (const ManifestItem& it : staged.items) {
    const std::string want = it.name == "a" ? "alpha-bytes" : it.name == "b" ? "bravo" : "charlie";
    EXPECT_EQ(bytes.substr(it.offset_bytes, it.length_bytes), want) << it.name;
    EXPECT_EQ(it.crc32c, Crc32c(want));
  }
  ASSERT_TRUE(agent_->CloseShard(open->handle_id).ok());
  while (agent_->VerifyOnce()) {
  }
  for (const auto& info : agent_->Inventory("job", 11)) EXPECT_TRUE(info.verified);
  // The pins of 10 are gone with the answer: its space is free again.
  EXPECT_EQ(agent_->arena().free_bytes(), free_before + 4096);
}

// Without the pins (a STAGED report replayed after a restart, say), a
// refused shard is dropped as before: nothing half-stored stays.
TEST_F(AgentTest, AnAcceptedShardReleasesItsBasesAndARefusedOneWithoutPinsIsDropped) {
  Save(20, 0, "alpha-bytes", "bravo");
  Save(21, 0, "alpha-bytes", "bravo");
  agent_->ControlOnce();
  const uint64_t free_before = agent_->arena().free_bytes();
  absl::StatusOr<LeaseGrant> g = agent_->AcquireLease(LeaseRequest{"job", 22, 0, 4096, "run-1", 0, 0, "", {20}});
  ASSERT_TRUE(g.ok()) << g.status();
  Write(*g, 0, "charlie");
  ManifestItem a = Item("a", 0, "alpha-bytes");
  a.ref_step = 20;
  ASSERT_TRUE(agent_->Commit(g->lease_id, 7, {Item("c", 0, "charlie"), a}).ok());
  agent_->ControlOnce();  // accepted: 20 is no longer pinned by 22
  EXPECT_EQ(meta_.staged.count(ShardId{"job", 22, 0}), 1u);
  RunEvictTask(20);
  EXPECT_EQ(agent_->arena().free_bytes(), free_before);  // 20's 4096 freed, 22's 4096 taken
  // A restart replays 22's STAGED report with no pins; meta refuses it now.
  agent_.reset();
  meta_.staged.erase(ShardId{"job", 22, 0});
  meta_.gone_bases.insert(20);
  StartAgent();
  agent_->ControlOnce();
  agent_->ControlOnce();
  EXPECT_EQ(meta_.staged.count(ShardId{"job", 22, 0}), 0u);
  EXPECT_TRUE(agent_->Inventory("job", 22).empty());
  EXPECT_EQ(agent_->Inventory("job", 21).size(), 1u);
}

TEST_F(AgentTest, RejectsBadLeasesAndCommits) {
  auto lease = [&](std::string job, uint32_t rank, uint64_t size) {
    return agent_->AcquireLease(LeaseRequest{std::move(job), 1, rank, size, "", 0, 0, "", {}}).status();
  };
  EXPECT_EQ(lease("../etc", 0, 10).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(lease("job", 0, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(lease("nojob", 0, 10).code(), absl::StatusCode::kNotFound);
  absl::Status rank = lease("job", 2, 10);
  EXPECT_EQ(rank.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rank.message(), HasSubstr("world size 2"));
  absl::Status big = lease("job", 0, 64 * kMiB);
  EXPECT_EQ(big.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(big.message(), HasSubstr("larger than the whole memory tier"));

  absl::StatusOr<LeaseGrant> g = agent_->AcquireLease(LeaseRequest{"job", 1, 0, 4096, "", 0, 0, "", {}});
  ASSERT_TRUE(g.ok());
  Write(*g, 0, "abcdefgh");
  // Overlapping items, an item outside the shard, a commit larger than the lease.
  EXPECT_THAT(agent_->Commit(g->lease_id, 0, {Item("x", 0, "abcdefgh"), Item("y", 4, "efgh")}).status().message(),
              HasSubstr("overlap"));
  EXPECT_THAT(agent_->Commit(g->lease_id, 16, {Item("x", 12, "abcdefgh")}).status().message(),
              HasSubstr("outside"));
  EXPECT_EQ(agent_->Commit(g->lease_id, 8192, {}).status().code(), absl::StatusCode::kInvalidArgument);
  // The lease survives bad commits; a good one succeeds, a replay is ALREADY_EXISTS.
  ASSERT_TRUE(agent_->Commit(g->lease_id, 8, {Item("x", 0, "abcdefgh")}).ok());
  EXPECT_EQ(agent_->Commit(g->lease_id, 8, {Item("x", 0, "abcdefgh")}).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(agent_->Commit("l-unknown", 8, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(agent_->AbortLease(g->lease_id).code(), absl::StatusCode::kFailedPrecondition);
  // The rank is committed here now.
  EXPECT_EQ(lease("job", 0, 10).code(), absl::StatusCode::kAlreadyExists);
}

TEST_F(AgentTest, FullTierSaysWhatIsFreeAndWhatHoldsIt) {
  Save(1, 0);
  absl::StatusOr<LeaseGrant> g = agent_->AcquireLease(LeaseRequest{"job", 2, 0, 7 * kMiB, "", 0, 0, "", {}});
  ASSERT_TRUE(g.ok()) << g.status();
  absl::Status s = agent_->AcquireLease(LeaseRequest{"job", 2, 1, 2 * kMiB, "", 0, 0, "", {}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("free of 8 MiB"));
  EXPECT_THAT(s.message(), HasSubstr("job step 1: 4 KiB (1 shard)"));
  EXPECT_THAT(s.message(), HasSubstr("open leases: 7 MiB in 1"));
  // Aborting frees the space.
  ASSERT_TRUE(agent_->AbortLease(g->lease_id).ok());
  EXPECT_TRUE(agent_->AcquireLease(LeaseRequest{"job", 2, 1, 2 * kMiB, "", 0, 0, "", {}}).ok());
}

TEST_F(AgentTest, UncommittedLeaseExpiresAndANewLeaseReplacesAnOldOne) {
  const uint64_t free0 = agent_->arena().free_bytes();
  absl::StatusOr<LeaseGrant> g = agent_->AcquireLease(LeaseRequest{"job", 1, 0, 4096, "", 0, 1000, "", {}});
  ASSERT_TRUE(g.ok());
  // A restarted trainer asks again for the same rank: the old lease is void.
  absl::StatusOr<LeaseGrant> g2 = agent_->AcquireLease(LeaseRequest{"job", 1, 0, 4096, "", 0, 1000, "", {}});
  ASSERT_TRUE(g2.ok());
  EXPECT_EQ(agent_->Commit(g->lease_id, 0, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  clock_.Advance(absl::Milliseconds(1001));
  agent_->ControlOnce();
  EXPECT_EQ(agent_->arena().free_bytes(), free0);
  EXPECT_EQ(agent_->Commit(g2->lease_id, 0, {}).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(AgentTest, CorruptByteIsDataLossOnOpenAndReportedCorrupt) {
  ShardRecord rec = Save(3, 0);
  agent_->ControlOnce();
  const_cast<std::byte*>(agent_->arena().Data(rec.extents[0].offset))[66] ^= std::byte{0x20};
  absl::StatusOr<OpenResult> open = agent_->OpenShard(rec.id, /*skip_verify=*/false, 0, 0);
  EXPECT_EQ(open.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(open.status().message(), HasSubstr("\"b\""));
  agent_->ControlOnce();
  bool reported = false;
  for (const HoldingReport& r : meta_.reports) {
    reported |= r.kind == HoldingReport::Kind::kCopyState && r.copy_state == CopyState::kCorrupt;
  }
  EXPECT_TRUE(reported);
  // Quarantined: never served again, and never flushed.
  EXPECT_EQ(agent_->OpenShard(rec.id, true, 0, 0).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(agent_->FlushNow("job", 3, {})->at(0).status.code(), absl::StatusCode::kDataLoss);
}

TEST_F(AgentTest, OpenShardReturnsRegionsOfTheCommittedBytes) {
  ShardRecord rec = Save(4, 1);
  absl::StatusOr<OpenResult> open = agent_->OpenShard(rec.id, false, 0, 0);
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_TRUE(open->verified);
  ASSERT_EQ(open->shard.regions.size(), 1u);
  const Region& r = open->shard.regions[0];
  EXPECT_EQ(r.path, agent_->arena().pool_path());
  EXPECT_EQ(r.length, 128u);
  EXPECT_EQ(std::memcmp(agent_->arena().Data(r.file_offset + 64), "bravo", 5), 0);
  EXPECT_EQ(agent_->Status().open_handles, 1u);
  EXPECT_TRUE(agent_->CloseShard(open->handle_id).ok());
  EXPECT_TRUE(agent_->CloseShard(open->handle_id).ok());  // idempotent
  EXPECT_EQ(agent_->OpenShard(ShardId{"job", 99, 0}, false, 0, 0).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(AgentTest, FlushTaskWritesVerifiedFileReportsItThenCommitsTheVersion) {
  meta_.flush_on_stage = true;
  ShardRecord r0 = Save(5, 0, "zero-zero", "z");
  ShardRecord r1 = Save(5, 1, "one-one-one", "o");
  agent_->ControlOnce();  // STAGED -> flush tasks come back in the reply
  EXPECT_EQ(agent_->Status().flush_pending_shards, 2u);
  // Not verified yet: the task waits for the verifier.
  EXPECT_FALSE(agent_->TasksOnce());
  while (agent_->VerifyOnce()) {
  }
  clock_.Advance(absl::Milliseconds(50));
  EXPECT_TRUE(agent_->TasksOnce());
  EXPECT_TRUE(agent_->TasksOnce());
  agent_->ControlOnce();  // persisted reports, then the task results
  ASSERT_EQ(meta_.results.size(), 2u);
  EXPECT_TRUE(meta_.results[0].second.ok()) << meta_.results[0].second;
  int persisted = 0;
  for (const HoldingReport& r : meta_.reports) persisted += r.kind == HoldingReport::Kind::kPersisted;
  EXPECT_EQ(persisted, 2);
  EXPECT_EQ(agent_->Status().flush_pending_shards, 0u);

  AgentTask commit;
  commit.id = "t-commit";
  commit.kind = TaskKind::kCommitDurable;
  commit.kind_name = "commit_durable";
  commit.job_id = "job";
  commit.step = 5;
  commit.durable_dir = "job/5";
  commit.world_size = 2;
  agent_->EnqueueTasks({commit});
  EXPECT_TRUE(agent_->TasksOnce());
  agent_->ControlOnce();
  ASSERT_EQ(meta_.results.size(), 3u);
  EXPECT_TRUE(meta_.results[2].second.ok()) << meta_.results[2].second;

  // What a reader with no daemon sees.
  absl::StatusOr<DurableManifest> m = ReadDurableManifest(&mem_fs_, "/durable/job/5");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->shards.size(), 2u);
  std::vector<std::byte> bytes(m->shards[1].size_bytes);
  ASSERT_TRUE(ReadRankFile(&mem_fs_, "/durable/job/5", m->shards[1], bytes).ok());
  EXPECT_EQ(std::memcmp(bytes.data(), "one-one-one", 11), 0);
  EXPECT_EQ(Crc32c(bytes.data(), bytes.size()), r1.crc32c);
}

TEST_F(AgentTest, FullDiskKeepsMemoryCopyRetriesWithBackoffAndRecovers) {
  meta_.flush_on_stage = true;
  Save(6, 0);
  agent_->ControlOnce();
  agent_->VerifyOnce();
  fault_fs_.SetCapacityBytes(10);  // ENOSPC on the first write
  EXPECT_TRUE(agent_->TasksOnce());
  AgentStatusSnapshot st = agent_->Status();
  EXPECT_EQ(st.flush_errors_total, 1u);
  EXPECT_THAT(st.last_flush_error, HasSubstr("No space left"));
  EXPECT_EQ(st.flush_pending_shards, 1u);
  EXPECT_FALSE(agent_->TasksOnce());  // backing off: not runnable yet
  fault_fs_.Reset();
  fault_fs_.FailNthSync(1);  // then a failed fsync
  clock_.Advance(absl::Milliseconds(100));
  EXPECT_TRUE(agent_->TasksOnce());
  EXPECT_EQ(agent_->Status().flush_errors_total, 2u);
  clock_.Advance(absl::Milliseconds(200));
  EXPECT_TRUE(agent_->TasksOnce());  // third try works
  agent_->ControlOnce();
  ASSERT_EQ(meta_.results.size(), 1u);
  EXPECT_TRUE(meta_.results[0].second.ok());
  EXPECT_EQ(agent_->Status().flush_pending_shards, 0u);
  // The memory copy is still there.
  EXPECT_EQ(agent_->Inventory("job", 6).size(), 1u);
}

TEST_F(AgentTest, FlushGivesUpAfterMaxTriesAndReportsTheError) {
  meta_.flush_on_stage = true;
  Save(7, 0);
  agent_->ControlOnce();
  agent_->VerifyOnce();
  fault_fs_.FailAllWrites(true);
  for (int i = 0; i < 3; ++i) {
    clock_.Advance(absl::Seconds(10));
    EXPECT_TRUE(agent_->TasksOnce());
  }
  agent_->ControlOnce();
  ASSERT_EQ(meta_.results.size(), 1u);
  EXPECT_EQ(meta_.results[0].second.code(), absl::StatusCode::kUnavailable);
  // The task left this node: its shard is meta's to retry (here or on another
  // holder) and no longer this node's flush lag (it stayed stuck before).
  EXPECT_EQ(agent_->Status().flush_pending_shards, 0u);
  EXPECT_EQ(agent_->Status().flush_lag_bytes, 0u);
  // Meta retries the failed task under the same id with the next attempt
  // number: it runs again (the disk is fine now) and succeeds. A replay of
  // an attempt that already ended is ignored.
  fault_fs_.FailAllWrites(false);
  AgentTask retry;
  {
    absl::MutexLock lock(&meta_.mu);
    ASSERT_FALSE(meta_.flushes.empty());
    retry = meta_.flushes.back();
  }
  const std::string id = meta_.results[0].first;
  retry.id = id;
  agent_->EnqueueTasks({retry});  // attempt 1 again: a duplicate
  EXPECT_FALSE(agent_->TasksOnce());
  retry.attempt = 2;
  agent_->EnqueueTasks({retry});
  EXPECT_TRUE(agent_->TasksOnce());
  agent_->ControlOnce();
  ASSERT_EQ(meta_.results.size(), 2u);
  EXPECT_EQ(meta_.results[1].first, id);
  EXPECT_TRUE(meta_.results[1].second.ok()) << meta_.results[1].second;
}

TEST_F(AgentTest, RestartReadoptsHoldingsAndReplaysStagedReports) {
  ShardRecord rec = Save(8, 1);
  agent_->ControlOnce();
  agent_.reset();  // the agent dies (its threads were never started)
  meta_.staged.clear();  // meta lost the report (e.g. it was never acknowledged)
  StartAgent();
  ASSERT_EQ(agent_->Inventory("job", 8).size(), 1u);
  EXPECT_TRUE(agent_->Inventory("job", 8)[0].verified);
  agent_->ControlOnce();
  EXPECT_EQ(meta_.registrations, 2);
  ASSERT_EQ(meta_.staged.size(), 1u);
  EXPECT_EQ(meta_.staged.begin()->second.crc32c, rec.crc32c);
  ASSERT_EQ(meta_.inventories.size(), 2u);
  EXPECT_EQ(meta_.inventories[1].size(), 1u);
  absl::StatusOr<OpenResult> open = agent_->OpenShard(rec.id, false, 0, 0);
  ASSERT_TRUE(open.ok()) << open.status();
}

// The incarnation file goes through the memory tier's FileSystem: written
// atomically as a private file after each registration; a failed write
// leaves the previous one whole (and the agent registered).
TEST_F(AgentTest, TheIncarnationFileIsPrivateAndAFailedWriteKeepsThePreviousOne) {
  const std::string path = dir_->path() + "/mem/incarnation";
  agent_->ControlOnce();  // registers: incarnation 1
  EXPECT_EQ(*ReadPrivateFileToString(PosixFileSystem(), path), "1\n");
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  agent_.reset();
  memory_fs_.FailNthWrite(1);
  StartAgent();
  agent_->ControlOnce();  // registers as incarnation 2, naming 1 as the previous one
  EXPECT_EQ(meta_.registrations, 2);
  EXPECT_TRUE(agent_->Status().registered);
  EXPECT_EQ(*ReadPrivateFileToString(PosixFileSystem(), path), "1\n");
  EXPECT_THAT(*PosixFileSystem()->ListDir(dir_->path() + "/mem"), ::testing::Not(::testing::Contains(HasSubstr(".tmp-"))));
  agent_.reset();
  memory_fs_.FailNthSync(1);  // the file's sync, before the rename
  StartAgent();
  agent_->ControlOnce();
  EXPECT_EQ(*ReadPrivateFileToString(PosixFileSystem(), path), "1\n");
  agent_.reset();
  StartAgent();
  agent_->ControlOnce();
  EXPECT_EQ(*ReadPrivateFileToString(PosixFileSystem(), path), "4\n");
}

TEST_F(AgentTest, AnIncarnationFileThatIsNotTheAgentsOwnStopsItAtStart) {
  agent_.reset();
  const std::string path = dir_->path() + "/mem/incarnation";
  ASSERT_EQ(::unlink(path.c_str()) == 0 || errno == ENOENT, true);
  ASSERT_EQ(::symlink((dir_->path() + "/elsewhere").c_str(), path.c_str()), 0);
  AgentOptions o;
  o.node_id = "node-1";
  o.memory_dir = dir_->path() + "/mem";
  o.memory_bytes = 8 * kMiB;
  o.populate = false;
  o.memory_fs = &memory_fs_;
  absl::StatusOr<std::unique_ptr<Agent>> a = Agent::Create(o, &meta_, &clock_, &fault_fs_, &metrics_);
  ASSERT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition) << a.status();
  EXPECT_THAT(a.status().message(), HasSubstr("memory tier: '" + path + "'"));
  EXPECT_THAT(a.status().message(), HasSubstr("is a symbolic link"));
  EXPECT_THAT(a.status().message(), HasSubstr("remove it (rm '" + path + "')"));
  ASSERT_EQ(::unlink(path.c_str()), 0);
  ASSERT_EQ(::close(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600)), 0);
  ASSERT_EQ(::chmod(path.c_str(), 0666), 0);
  a = Agent::Create(o, &meta_, &clock_, &fault_fs_, &metrics_);
  ASSERT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition) << a.status();
  EXPECT_THAT(a.status().message(), HasSubstr("writable by other users"));
}

TEST_F(AgentTest, ReportsWaitWhileMetaIsDownAndGoOutWhenItReturns) {
  Save(9, 0);  // begins the version at meta
  meta_.up = false;
  Save(9, 1);  // the version is known here: saving needs no meta
  agent_->ControlOnce();
  EXPECT_FALSE(agent_->Status().meta_reachable);
  EXPECT_TRUE(meta_.staged.empty());
  meta_.up = true;
  clock_.Advance(absl::Seconds(2));
  agent_->ControlOnce();
  EXPECT_EQ(meta_.staged.size(), 2u);
}

TEST_F(AgentTest, SavesNeverWaitForMetaToBeginAVersion) {
  Save(20, 0);  // first save of the job here: a read-only job look-up only
  EXPECT_EQ(meta_.begins, 0);
  meta_.up = false;
  Save(21, 0);  // meta is down: the save still succeeds
  Save(22, 1);
  EXPECT_EQ(meta_.begins, 0);
  meta_.up = true;
  agent_->ControlOnce();  // begins 20, 21 and 22, then their STAGED reports
  EXPECT_EQ(meta_.begins, 3);
  EXPECT_EQ(meta_.staged.size(), 3u);
}

TEST_F(AgentTest, AVersionMetaRefusesInTheBackgroundIsDroppedHere) {
  Save(30, 0);
  meta_.refuse_step.insert(25);
  Save(25, 0);
  Save(25, 1);
  agent_->ControlOnce();
  EXPECT_EQ(meta_.staged.size(), 1u);  // only step 30
  EXPECT_TRUE(agent_->Inventory("job", 25).empty());
  EXPECT_EQ(agent_->Inventory("job", 30).size(), 1u);
}

// Issue 12 #4: a transient error from meta on BeginVersion (Internal,
// Unknown, Cancelled: meta restarting or a broken RPC) used to drop the
// version's committed shards; only a refusal may.
TEST_F(AgentTest, TransientMetaErrorsNeverDropCommittedShards) {
  Save(50, 0);
  Save(50, 1);
  meta_.begin_errors = {absl::InternalError("boom"), absl::UnknownError("rpc broke"),
                        absl::CancelledError("meta stopping"), absl::ResourceExhaustedError("busy"),
                        absl::AbortedError("conflict"), absl::DeadlineExceededError("slow")};
  for (int i = 0; i < 8; ++i) {
    agent_->ControlOnce();
    clock_.Advance(absl::Seconds(10));
  }
  EXPECT_EQ(agent_->Inventory("job", 50).size(), 2u);
  EXPECT_EQ(meta_.staged.size(), 2u);
  EXPECT_TRUE(meta_.begin_errors.empty());
}

// Meta cannot begin a version while too few nodes are alive for its policy
// (UNAVAILABLE). That version's shards wait on this node, and the reports of
// other versions go on meanwhile (they queued behind its Begin before).
TEST_F(AgentTest, AVersionMetaCannotBeginYetWaitsWithoutHoldingUpOthers) {
  Save(60, 0);
  Save(61, 0);
  meta_.begin_errors = {absl::UnavailableError("ec{2, 2} needs at least 4 alive nodes; 3 present")};
  agent_->ControlOnce();
  EXPECT_EQ(meta_.staged.count(ShardId{"job", 61, 0}), 1u);
  EXPECT_EQ(meta_.staged.count(ShardId{"job", 60, 0}), 0u);
  EXPECT_EQ(agent_->Inventory("job", 60).size(), 1u);  // kept
  Save(60, 1);  // another rank of the waiting version waits with it
  agent_->ControlOnce();
  EXPECT_EQ(meta_.staged.count(ShardId{"job", 60, 1}), 0u);
  clock_.Advance(absl::Milliseconds(200));  // the first retry
  agent_->ControlOnce();
  EXPECT_EQ(meta_.staged.count(ShardId{"job", 60, 0}), 1u);
  EXPECT_EQ(meta_.staged.count(ShardId{"job", 60, 1}), 1u);
  EXPECT_EQ(meta_.begins, 2);
}

TEST_F(AgentTest, NodeLocalEvictFollowsRetentionRules) {
  Save(40, 0);
  Save(41, 0);
  meta_.newest_protected = 41;
  meta_.version_state[40] = 3;  // PROTECTED, not persisted: maybe the last copy
  meta_.version_state[41] = 4;  // PERSISTED but the newest
  EXPECT_THAT(agent_->Evict("job", 40, false).status().message(), HasSubstr("not PERSISTED"));
  EXPECT_THAT(agent_->Evict("job", 41, false).status().message(), HasSubstr("newest"));
  EXPECT_EQ(agent_->Evict("job", 42, false).status().code(), absl::StatusCode::kNotFound);
  meta_.version_state[40] = 4;
  absl::StatusOr<std::vector<HoldingInfo>> dry = agent_->Evict("job", 40, true);
  ASSERT_TRUE(dry.ok()) << dry.status();
  EXPECT_EQ(dry->size(), 1u);
  EXPECT_EQ(agent_->Inventory("job", 40).size(), 1u);  // dry run frees nothing
  ASSERT_TRUE(agent_->Evict("job", 40, false).ok());
  EXPECT_TRUE(agent_->Inventory("job", 40).empty());
  meta_.up = false;  // meta unreachable: nothing is freed
  EXPECT_EQ(agent_->Evict("job", 41, false).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(agent_->Inventory("job", 41).size(), 1u);
}

TEST_F(AgentTest, EvictTaskFreesTheVersionButWaitsForOpenHandles) {
  ShardRecord rec = Save(11, 0);
  const uint64_t free_before = agent_->arena().free_bytes();
  absl::StatusOr<OpenResult> open = agent_->OpenShard(rec.id, true, 0, 0);
  ASSERT_TRUE(open.ok());
  RunEvictTask(11);
  EXPECT_EQ(agent_->arena().free_bytes(), free_before);  // still mapped by a reader
  ASSERT_TRUE(agent_->CloseShard(open->handle_id).ok());
  EXPECT_EQ(agent_->arena().free_bytes(), free_before + 4096);
  EXPECT_TRUE(agent_->Inventory("job", 11).empty());
}

}  // namespace
}  // namespace ckpt::agent
