// Ingest on its own: the save path over a HoldingTable and an Arena in a temp
// dir (MemoryTier: records through a FaultFileSystem, a FakeClock), a
// LeaseTable, a Verifier, and a MetaSession over FakeMeta whose refusals come
// back to the Ingest through a test Delegate (as in the agent). Pull mode
// runs over an in-process Puller that reads a string as the client's staging
// memory. Covers leases (the job's world size asked once, bad requests, the
// budget), commits (records, the STAGED report, the version's Begin, bad
// manifests, replays, unknown leases), pulls (tokens, failures, crc
// mismatches), references, the compaction of a shard whose base meta no
// longer holds, and meta's refusals. Every control round is run by the test;
// no threads, no sleeps.
#include "server/agent/ingest.h"

#include <cstring>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/lock_check.h"
#include "fake_meta.h"
#include "memory_tier.h"

namespace ckpt::agent {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kLeaseBytes = 4096;

// The client's staging memory of a pull-mode save: the header (the token
// the client put there) then the shard.
class StringPuller : public Puller {
 public:
  absl::Status Pull(const PullSource& source, const std::string& token, ReservationPtr dst, uint64_t size,
                    absl::Duration timeout) override {
    AssertNoCheckedLock("a pull");
    absl::MutexLock lock(&mu);
    ++pulls;
    if (!fail.ok()) return fail;
    if (staging.size() < kPullHeaderBytes + size) return absl::InvalidArgumentError("staging too short");
    if (staging.compare(0, token.size(), token) != 0) return absl::PermissionDeniedError("not the lease's token");
    dst->CopyIn(0, AsBytes(staging.substr(kPullHeaderBytes, size)));
    return absl::OkStatus();
  }
  absl::Status Push(const PullSource&, const std::string&, ReservationPtr, uint64_t, absl::Duration) override {
    return absl::UnimplementedError("restores are not tested here");
  }
  // The client stages `shard` for a lease whose token is `token`.
  void Stage(const std::string& token, const std::string& shard) {
    absl::MutexLock lock(&mu);
    staging = token + std::string(kPullHeaderBytes - token.size(), '\0') + shard;
  }

  absl::Mutex mu;
  std::string staging ABSL_GUARDED_BY(mu);
  absl::Status fail ABSL_GUARDED_BY(mu);
  int pulls ABSL_GUARDED_BY(mu) = 0;
};

ManifestItem Item(std::string name, uint64_t off, const std::string& bytes) {
  ManifestItem it;
  it.name = std::move(name);
  it.dtype = kDTypeBytes;
  it.offset_bytes = off;
  it.length_bytes = bytes.size();
  it.crc32c = Crc32c(bytes);
  return it;
}

ManifestItem Ref(std::string name, uint64_t step, uint64_t off, const std::string& bytes) {
  ManifestItem it = Item(std::move(name), off, bytes);
  it.ref_step = step;
  return it;
}

class IngestTest : public ::testing::Test {
 protected:
  // What the agent does with meta's refusals: hands them to the Ingest.
  class Delegate : public MetaSession::Delegate {
   public:
    explicit Delegate(IngestTest* t) : t_(t) {}
    std::vector<InventoryItem> InventoryItems() override { return t_->tier_.holdings().InventoryItems(); }
    LoadReport Load() override { return {}; }
    void OnTasks(std::vector<AgentTask>, std::vector<std::string>) override {}
    void OnDrop(const std::vector<ShardId>&, const std::vector<SegmentId>&) override {}
    void OnVersionRefused(const std::string& job, uint64_t step, const std::string& run_id,
                          const absl::Status&) override {
      t_->ingest_->OnVersionRefused(job, step, run_id);
    }
    void OnCopyRefused(const HoldingReport& r, const absl::Status& why) override {
      t_->ingest_->OnShardRefused(r, why);
    }

   private:
    IngestTest* const t_;
  };

  IngestTest()
      : leases_(&tier_.clock(), &tier_.metrics(), [](const ClientRef&) { return ClientState::kConnected; }),
        delegate_(this),
        session_(&meta_, &tier_.clock(), &tier_.metrics(), SessionOptions(), &delegate_),
        verifier_(Verifier::Deps{.holdings = &tier_.holdings(),
                                 .parity = nullptr,
                                 .session = &session_,
                                 .meta = &meta_,
                                 .clock = &tier_.clock(),
                                 .on_verified = nullptr,
                                 .on_freed = nullptr}) {
    meta_.world["job"] = 2;
    NewIngest(nullptr);
  }

  static MetaSession::Options SessionOptions() {
    MetaSession::Options o;
    o.node_id = "n0";
    return o;
  }

  void NewIngest(Puller* puller) {
    ingest_ = std::make_unique<Ingest>(Ingest::Deps{.arena = &tier_.arena(),
                                                    .holdings = &tier_.holdings(),
                                                    .leases = &leases_,
                                                    .session = &session_,
                                                    .meta = &meta_,
                                                    .verifier = &verifier_,
                                                    .sessions = nullptr,
                                                    .clock = &tier_.clock(),
                                                    .metrics = &tier_.metrics(),
                                                    .puller = puller,
                                                    .item_alignment_bytes = 64,
                                                    .default_lease_ttl_ms = 60000,
                                                    .peer_timeout_ms = 1000,
                                                    .on_changed = [this] { ++changed_; }});
  }

  static LeaseRequest Request(uint64_t step, uint32_t rank, std::vector<uint64_t> bases = {}) {
    LeaseRequest r;
    r.job_id = "job";
    r.step = step;
    r.rank = rank;
    r.size_bytes = kLeaseBytes;
    r.run_id = "run-1";
    r.base_steps = std::move(bases);
    return r;
  }

  LeaseGrant Lease(uint64_t step, uint32_t rank, std::vector<uint64_t> bases = {}) {
    absl::StatusOr<LeaseGrant> g = ingest_->AcquireLease(Request(step, rank, std::move(bases)));
    EXPECT_TRUE(g.ok()) << g.status();
    return g.ok() ? *g : LeaseGrant{};
  }

  // Copies `bytes` into a lease's regions at shard offset `off` (what a
  // trainer does through its mapping of the pool).
  void Write(const LeaseGrant& g, uint64_t off, const std::string& bytes) {
    for (size_t i = 0; i < bytes.size(); ++i) {
      const uint64_t pos = off + i;
      for (const Region& r : g.regions) {
        if (pos >= r.shard_offset && pos < r.shard_offset + r.length) {
          tier_.arena().Data(r.file_offset + pos - r.shard_offset)[0] = static_cast<std::byte>(bytes[i]);
        }
      }
    }
  }

  // Saves items "a" (at 0) and "b" (at 64) of 128 bytes for (step, rank).
  std::shared_ptr<const ShardRecord> Save(uint64_t step, uint32_t rank, const std::string& a = "alpha-bytes",
                                          const std::string& b = "bravo") {
    const LeaseGrant g = Lease(step, rank);
    Write(g, 0, a);
    Write(g, 64, b);
    absl::StatusOr<std::shared_ptr<const ShardRecord>> rec =
        ingest_->Commit(g.lease_id, 128, {Item("a", 0, a), Item("b", 64, b)});
    EXPECT_TRUE(rec.ok()) << rec.status();
    return rec.ok() ? *rec : nullptr;
  }

  // The bytes of the VALID copy of `id` held now.
  std::string HeldBytes(const ShardId& id) {
    absl::StatusOr<Pin> pin = tier_.holdings().PinValid(id);
    EXPECT_TRUE(pin.ok()) << pin.status();
    return pin.ok() ? ReadBack(*pin->bytes, pin->rec->size_bytes) : "";
  }

  int Begins() {
    absl::MutexLock lock(&meta_.mu);
    return meta_.begins;
  }
  std::optional<ShardRecord> StagedAtMeta(const ShardId& id) {
    absl::MutexLock lock(&meta_.mu);
    auto it = meta_.staged.find(id);
    if (it == meta_.staged.end()) return std::nullopt;
    return it->second;
  }

  MemoryTier tier_;
  FakeMeta meta_;
  LeaseTable leases_;
  Delegate delegate_;
  MetaSession session_;
  Verifier verifier_;
  int changed_ = 0;
  std::unique_ptr<Ingest> ingest_;
};

TEST_F(IngestTest, ACommitIsRecordedQueuedForTheVerifierAndReportedStaged) {
  const LeaseGrant g = Lease(10, 1);
  EXPECT_FALSE(g.lease_id.empty());
  EXPECT_FALSE(g.pull);
  EXPECT_EQ(g.item_alignment_bytes, 64u);
  EXPECT_EQ(g.expires_in_ms, 60000);
  uint64_t covered = 0;
  for (const Region& r : g.regions) covered += r.length;
  EXPECT_EQ(covered, kLeaseBytes);
  EXPECT_EQ(leases_.lease_count(), 1u);

  Write(g, 0, "alpha-bytes");
  Write(g, 64, "bravo");
  // The items in any order: the record keeps them by offset.
  absl::StatusOr<std::shared_ptr<const ShardRecord>> rec =
      ingest_->Commit(g.lease_id, 128, {Item("b", 64, "bravo"), Item("a", 0, "alpha-bytes")});
  ASSERT_TRUE(rec.ok()) << rec.status();
  EXPECT_EQ((*rec)->id, (ShardId{"job", 10, 1}));
  EXPECT_EQ((*rec)->role, CopyRole::kPrimary);
  EXPECT_EQ((*rec)->size_bytes, 128u);
  EXPECT_EQ((*rec)->run_id, "run-1");
  ASSERT_EQ((*rec)->items.size(), 2u);
  EXPECT_EQ((*rec)->items[0].name, "a");
  // The shard crc covers the items and the zero padding between them.
  std::string whole(128, '\0');
  std::memcpy(whole.data(), "alpha-bytes", 11);
  std::memcpy(whole.data() + 64, "bravo", 5);
  EXPECT_EQ((*rec)->crc32c, Crc32c(whole));
  EXPECT_EQ(HeldBytes((*rec)->id), whole);
  EXPECT_EQ(leases_.lease_count(), 0u) << "the lease became the holding";
  EXPECT_GT(changed_, 0);

  // Checked in the background, not by the commit.
  EXPECT_FALSE(tier_.holdings().Verified((*rec)->id));
  EXPECT_TRUE(verifier_.VerifyOnce());
  EXPECT_TRUE(tier_.holdings().Verified((*rec)->id));

  // The version's Begin and the STAGED report go out with the next round.
  EXPECT_EQ(Begins(), 0);
  session_.ControlOnce();
  EXPECT_EQ(Begins(), 1);
  ASSERT_TRUE(StagedAtMeta((*rec)->id).has_value());
  EXPECT_EQ(StagedAtMeta((*rec)->id)->crc32c, (*rec)->crc32c);
  // Another rank of the same version: begun once.
  Save(10, 0);
  session_.ControlOnce();
  EXPECT_EQ(Begins(), 1);
  EXPECT_TRUE(StagedAtMeta(ShardId{"job", 10, 0}).has_value());
}

TEST_F(IngestTest, OnlyAJobsFirstLeaseHereAsksMeta) {
  meta_.up = false;
  EXPECT_EQ(ingest_->AcquireLease(Request(1, 0)).status().code(), absl::StatusCode::kUnavailable);
  LeaseRequest session_lease = Request(1, 0);
  session_lease.without_meta = true;
  absl::Status s = ingest_->AcquireLease(session_lease).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("use AcquireStagingLease"));
  meta_.up = true;
  Lease(1, 0);
  // Known now: meta away changes nothing for the job's next saves.
  meta_.up = false;
  Lease(2, 1);
  EXPECT_TRUE(ingest_->AcquireLease(session_lease).ok());
  meta_.up = true;
  LeaseRequest unknown = Request(1, 0);
  unknown.job_id = "nojob";
  EXPECT_EQ(ingest_->AcquireLease(unknown).status().code(), absl::StatusCode::kNotFound);
  s = ingest_->AcquireLease(Request(3, 2)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("world size 2"));
}

TEST_F(IngestTest, BadLeasesAreRefusedBeforeAnythingIsReserved) {
  const uint64_t free_before = tier_.arena().free_bytes();
  LeaseRequest r = Request(1, 0);
  r.job_id = "../etc";
  EXPECT_EQ(ingest_->AcquireLease(r).status().code(), absl::StatusCode::kInvalidArgument);
  r = Request(1, 0);
  r.size_bytes = 0;
  EXPECT_EQ(ingest_->AcquireLease(r).status().code(), absl::StatusCode::kInvalidArgument);
  r.size_bytes = tier_.arena().capacity_bytes() + 1;
  absl::Status s = ingest_->AcquireLease(r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("larger than the whole memory tier"));
  // A session the agent does not have.
  r = Request(1, 0);
  r.session_id = std::string(32, 'a');
  s = ingest_->AcquireLease(r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("is not open on this agent"));
  // Bases must be older and held here.
  s = ingest_->AcquireLease(Request(11, 0, {9})).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("base version 9"));
  EXPECT_EQ(tier_.arena().free_bytes(), free_before);
  EXPECT_EQ(leases_.lease_count(), 0u);

  // A shard committed here already.
  Save(10, 0);
  EXPECT_EQ(ingest_->AcquireLease(Request(11, 0, {11})).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ingest_->AcquireLease(Request(10, 0)).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(ingest_->AcquireLease(Request(11, 0, {10})).ok());

  // After Stop: no new lease.
  ingest_->Stop();
  s = ingest_->AcquireLease(Request(12, 0)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("shutting down"));
}

TEST_F(IngestTest, AFullTierSaysWhatIsFreeAndWhatHoldsIt) {
  Save(10, 0);
  absl::StatusOr<ReservationPtr> rest = tier_.arena().Reserve(tier_.arena().free_bytes());
  ASSERT_TRUE(rest.ok()) << rest.status();
  absl::Status s = ingest_->AcquireLease(Request(11, 0)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("memory tier cannot hold"));
  EXPECT_THAT(s.message(), HasSubstr("job step 10"));
  EXPECT_THAT(s.message(), HasSubstr("raise --memory"));
  EXPECT_EQ(s.message(), ingest_->BudgetMessage(kLeaseBytes));
}

TEST_F(IngestTest, ABadCommitLeavesTheLeaseUsable) {
  EXPECT_EQ(ingest_->Commit("l-unknown", 0, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  const LeaseGrant g = Lease(10, 0);
  Write(g, 0, "alpha-bytes");
  // An item past the shard's end; overlapping items.
  absl::Status s = ingest_->Commit(g.lease_id, 128, {Item("a", 120, "alpha-bytes")}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = ingest_->Commit(g.lease_id, 128, {Item("a", 0, "alpha-bytes"), Item("b", 4, "bravo")}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // A push-mode agent takes no pull source.
  PullSource pull;
  s = ingest_->Commit(g.lease_id, 128, {Item("a", 0, "alpha-bytes")}, &pull).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("does not pull"));
  // Another holder's commit.
  s = ingest_->Commit(g.lease_id, 128, {Item("a", 0, "alpha-bytes")}, nullptr, std::string(32, 'b')).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_FALSE(tier_.holdings().Holds(ShardId{"job", 10, 0}));
  EXPECT_EQ(leases_.lease_count(), 1u);

  ASSERT_TRUE(ingest_->Commit(g.lease_id, 128, {Item("a", 0, "alpha-bytes")}).ok());
  // A replay of the commit.
  EXPECT_EQ(ingest_->Commit(g.lease_id, 128, {Item("a", 0, "alpha-bytes")}).status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST_F(IngestTest, ReferencesMustNameItemsOfABaseHeldHere) {
  const std::shared_ptr<const ShardRecord> base = Save(10, 0);
  const ShardId id{"job", 11, 0};
  std::vector<Pin> bases;
  absl::Status s = ingest_->CheckRefs(id, {Item("c", 0, "charlie"), Ref("a", 9, 0, "alpha-bytes")}, &bases);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("save in full"));
  s = ingest_->CheckRefs(id, {Ref("a", 10, 1, "lpha-bytes")}, &bases);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("holds no such item"));
  s = ingest_->CheckRefs(id, {Ref("a", 10, 0, "alpha-bytez")}, &bases);  // another crc
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(bases.empty());
  ASSERT_TRUE(ingest_->CheckRefs(id, {Item("c", 0, "charlie"), Ref("a", 10, 0, "alpha-bytes"),
                                      Ref("b", 10, 64, "bravo")},
                                 &bases)
                  .ok());
  ASSERT_EQ(bases.size(), 1u) << "one pin per base version";
  EXPECT_EQ(bases[0].rec, base);

  // Through a commit: refused, then accepted on the same lease; the shard's
  // crc covers its own bytes only.
  const LeaseGrant g = Lease(11, 0, {10});
  Write(g, 0, "charlie");
  EXPECT_FALSE(ingest_->Commit(g.lease_id, 64, {Item("c", 0, "charlie"), Ref("a", 10, 8, "alpha-bytes")}).ok());
  absl::StatusOr<std::shared_ptr<const ShardRecord>> rec =
      ingest_->Commit(g.lease_id, 64, {Item("c", 0, "charlie"), Ref("a", 10, 0, "alpha-bytes")});
  ASSERT_TRUE(rec.ok()) << rec.status();
  std::string own(64, '\0');
  std::memcpy(own.data(), "charlie", 7);
  EXPECT_EQ((*rec)->crc32c, Crc32c(own));
  EXPECT_EQ((*rec)->items.size(), 2u);
}

// Meta refuses the STAGED report of a shard that refers to a version it no
// longer holds (aborted and evicted after this node accepted the commit):
// the shard is stored self-contained from the bases pinned at the commit,
// and reported again.
TEST_F(IngestTest, AShardWhoseBaseMetaDiscardedIsStoredSelfContained) {
  Save(10, 0);
  session_.ControlOnce();
  const LeaseGrant g = Lease(11, 0, {10});
  Write(g, 0, "charlie");
  ASSERT_TRUE(ingest_
                  ->Commit(g.lease_id, 7,
                           {Item("c", 0, "charlie"), Ref("a", 10, 0, "alpha-bytes"), Ref("b", 10, 64, "bravo")})
                  .ok());
  // 10 goes here before 11's report is answered: its bytes stay pinned.
  const uint64_t free_before = tier_.arena().free_bytes();
  tier_.holdings().DropVersion("job", 10);
  EXPECT_EQ(tier_.arena().free_bytes(), free_before);
  meta_.gone_bases.insert(10);
  session_.ControlOnce();  // refused, compacted, reported again
  session_.ControlOnce();  // the new report accepted

  const ShardId id{"job", 11, 0};
  std::optional<ShardRecord> staged = StagedAtMeta(id);
  ASSERT_TRUE(staged.has_value());
  EXPECT_TRUE(RefSteps(staged->items).empty());
  ASSERT_EQ(staged->items.size(), 3u);
  const std::string bytes = HeldBytes(id);
  EXPECT_EQ(Crc32c(bytes), staged->crc32c);
  for (const ManifestItem& it : staged->items) {
    EXPECT_EQ(it.offset_bytes % 64, 0u) << it.name << ": aligned";
    const std::string want = it.name == "a" ? "alpha-bytes" : it.name == "b" ? "bravo" : "charlie";
    EXPECT_EQ(bytes.substr(it.offset_bytes, it.length_bytes), want) << it.name;
  }
  EXPECT_EQ(tier_.metrics().shards_compacted->Value(), 1.0);
  // The new copy is checked like any commit.
  EXPECT_TRUE(verifier_.VerifyOnce());
  EXPECT_TRUE(tier_.holdings().Verified(id));
  // The pins of 10 went with meta's answer: its space is free again.
  EXPECT_GT(tier_.arena().free_bytes(), free_before);
}

TEST_F(IngestTest, ARefusedShardWithoutPinsIsDroppedButANewerCopyIsLeftAlone) {
  const std::shared_ptr<const ShardRecord> rec = Save(10, 0);
  HoldingReport r;
  r.kind = HoldingReport::Kind::kStaged;
  // About another copy of the shard (another crc): nothing happens.
  auto other = std::make_shared<ShardRecord>(*rec);
  other->crc32c ^= 1;
  r.record = other;
  ingest_->OnShardRefused(r, MissingBaseError(0, "job", 10, 9, "is gone"));
  EXPECT_TRUE(tier_.holdings().HoldsValid(rec->id));
  // About this copy, with no pins to compact from: dropped.
  r.record = rec;
  ingest_->OnShardRefused(r, MissingBaseError(0, "job", 10, 9, "is gone"));
  EXPECT_FALSE(tier_.holdings().Holds(rec->id));
  // A refused copy-state report of a copy no longer held: nothing to do.
  HoldingReport state;
  state.kind = HoldingReport::Kind::kCopyState;
  state.id = rec->id;
  ingest_->OnShardRefused(state, absl::FailedPreconditionError("unknown"));
}

TEST_F(IngestTest, CompactRefusedFailsWithoutChangingTheHeldCopy) {
  Save(10, 0);
  const LeaseGrant g = Lease(11, 0, {10});
  Write(g, 0, "charlie");
  absl::StatusOr<std::shared_ptr<const ShardRecord>> rec =
      ingest_->Commit(g.lease_id, 7, {Item("c", 0, "charlie"), Ref("a", 10, 0, "alpha-bytes")});
  ASSERT_TRUE(rec.ok()) << rec.status();
  const ShardRecord& committed = **rec;
  std::vector<Pin> bases;
  ASSERT_TRUE(ingest_->CheckRefs(committed.id, committed.items, &bases).ok());

  // Another copy was stored meanwhile.
  ShardRecord stale = committed;
  stale.crc32c ^= 1;
  absl::Status s = ingest_->CompactRefused(stale, bases);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  // The referred version is not among the pins.
  s = ingest_->CompactRefused(committed, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("version 10 is not pinned"));
  // No room for the self-contained copy.
  {
    absl::StatusOr<ReservationPtr> rest = tier_.arena().Reserve(tier_.arena().free_bytes());
    ASSERT_TRUE(rest.ok()) << rest.status();
    s = ingest_->CompactRefused(committed, bases);
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  }
  // The base's bytes no longer match its item.
  bases[0].bytes->CopyIn(0, AsBytes(std::string("A")));
  s = ingest_->CompactRefused(committed, bases);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  // Each time the copy held stayed the committed one.
  absl::StatusOr<Pin> held = tier_.holdings().PinValid(committed.id);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->rec->crc32c, committed.crc32c);
  EXPECT_EQ(RefSteps(held->rec->items), std::vector<uint64_t>{10});
}

TEST_F(IngestTest, AVersionMetaRefusesIsDroppedAndBegunAgainByTheNextLease) {
  meta_.refuse_step.insert(10);
  Save(10, 0);
  Save(11, 0);
  session_.ControlOnce();
  EXPECT_FALSE(tier_.holdings().Holds(ShardId{"job", 10, 0})) << "refused version dropped";
  EXPECT_TRUE(tier_.holdings().HoldsValid(ShardId{"job", 11, 0}));
  EXPECT_EQ(Begins(), 1);
  // No longer begun here: a new save of it begins it again.
  meta_.refuse_step.clear();
  Save(10, 0);
  session_.ControlOnce();
  EXPECT_EQ(Begins(), 2);
  EXPECT_TRUE(tier_.holdings().HoldsValid(ShardId{"job", 10, 0}));
}

TEST_F(IngestTest, ALeaseTakenAheadOfItsSaveBeginsTheVersionAtCommit) {
  LeaseRequest r = Request(10, 0);
  r.begin_at_commit = true;
  absl::StatusOr<LeaseGrant> g = ingest_->AcquireLease(r);
  ASSERT_TRUE(g.ok()) << g.status();
  session_.ControlOnce();
  EXPECT_EQ(Begins(), 0);
  Write(*g, 0, "alpha");
  ASSERT_TRUE(ingest_->Commit(g->lease_id, 8, {Item("a", 0, "alpha")}).ok());
  session_.ControlOnce();
  EXPECT_EQ(Begins(), 1);
  EXPECT_TRUE(StagedAtMeta(ShardId{"job", 10, 0}).has_value());
}

TEST_F(IngestTest, ACommitForgetsThatTheVersionWasStaged) {
  session_.ApplyVersionNotices({VersionNotice{"job", 10, /*staged=*/true}});
  EXPECT_TRUE(session_.VersionStaged("job", 10));
  Save(10, 0);
  EXPECT_FALSE(session_.VersionStaged("job", 10)) << "a new instance of the version";
}

TEST_F(IngestTest, APullModeCommitReadsAndChecksTheClientsBytes) {
  StringPuller puller;
  NewIngest(&puller);
  const LeaseGrant g = Lease(10, 0);
  EXPECT_TRUE(g.pull);
  EXPECT_TRUE(g.regions.empty()) << "the client cannot map a DPU's memory";
  EXPECT_EQ(g.pull_token.size(), kPullTokenBytes);
  EXPECT_EQ(g.pull_token, ingest_->PullToken(g.lease_id));
  EXPECT_NE(g.pull_token, ingest_->PullToken(Lease(10, 1).lease_id));
  EXPECT_NE(g.pull_token, ingest_->DeliverToken(g.lease_id));

  std::string shard(128, '\0');
  std::memcpy(shard.data(), "alpha-bytes", 11);
  std::memcpy(shard.data() + 64, "bravo", 5);
  const std::vector<ManifestItem> items = {Item("a", 0, "alpha-bytes"), Item("b", 64, "bravo")};
  PullSource source;
  source.length = kPullHeaderBytes + shard.size();

  // A pull-mode agent needs the source.
  absl::Status s = ingest_->Commit(g.lease_id, 128, items).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("must name it"));
  // The client is gone: the lease stays.
  {
    absl::MutexLock lock(&puller.mu);
    puller.fail = absl::UnavailableError("client gone");
  }
  EXPECT_EQ(ingest_->Commit(g.lease_id, 128, items, &source).status().code(), absl::StatusCode::kUnavailable);
  {
    absl::MutexLock lock(&puller.mu);
    puller.fail = absl::OkStatus();
  }
  // Staging memory that is not this lease's (another token).
  puller.Stage(ingest_->PullToken("l-other"), shard);
  EXPECT_EQ(ingest_->Commit(g.lease_id, 128, items, &source).status().code(), absl::StatusCode::kPermissionDenied);
  // A byte changed on the way: DataLoss naming the item.
  std::string bad = shard;
  bad[66] ^= 1;
  puller.Stage(g.pull_token, bad);
  s = ingest_->Commit(g.lease_id, 128, items, &source).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("\"b\""));
  EXPECT_EQ(tier_.metrics().pull_errors->Value(), 3.0);
  EXPECT_EQ(leases_.lease_count(), 2u);

  puller.Stage(g.pull_token, shard);
  absl::StatusOr<std::shared_ptr<const ShardRecord>> rec = ingest_->Commit(g.lease_id, 128, items, &source);
  ASSERT_TRUE(rec.ok()) << rec.status();
  EXPECT_EQ((*rec)->crc32c, Crc32c(shard));
  EXPECT_EQ(HeldBytes((*rec)->id), shard);
  // Checked as it arrived: verified at once, nothing queued for the verifier.
  EXPECT_TRUE(tier_.holdings().Verified((*rec)->id));
  EXPECT_FALSE(verifier_.VerifyOnce());
  session_.ControlOnce();
  EXPECT_TRUE(StagedAtMeta((*rec)->id).has_value());
}

}  // namespace
}  // namespace ckpt::agent
