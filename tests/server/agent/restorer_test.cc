// Restorer on its own: the reading node and its peers are PeerNodes (the
// agent's data-plane components over the loopback transport, no Agent), the
// durable tier a MemFileSystem, and meta's Locate a scripted MetaLink. Covers
// local opens (verification, quarantine, handles), the rule that only what
// meta lists is read and checked against meta's record, restores from the
// durable tier, a peer's replica (good, bad, dead) and a decode from EC
// stripes, and what errors tell the caller.
#include "server/agent/restorer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <optional>
#include <thread>

#include "absl/strings/str_format.h"
#include "common/mem_file_system.h"
#include "common/names.h"
#include "ec/codec.h"
#include "peer_node.h"
#include "raw_peer.h"

namespace ckpt::agent {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Answers Locate with what the test put in `located` (or `locate_error`).
class LocatingMeta : public FakeMeta {
 public:
  absl::StatusOr<LocatedShard> Locate(const ShardId& id, const std::string& near) override {
    absl::MutexLock lock(&mu);
    locates++;
    last_near = near;
    if (!locate_error.ok()) return locate_error;
    return located;
  }
  int Locates() {
    absl::MutexLock lock(&mu);
    return locates;
  }
  LocatedShard located;
  absl::Status locate_error;
  int locates = 0;
  std::string last_near;
};

const ShardId kId{"job", 5, 0};

ShardSource Durable(const std::string& path) {
  ShardSource s;
  s.kind = ShardSource::Kind::kDurable;
  s.durable_path = path;
  return s;
}
ShardSource Replica(const PeerEndpoint& holder) {
  ShardSource s;
  s.kind = ShardSource::Kind::kReplica;
  s.holder = holder;
  return s;
}

class RestorerTest : public ::testing::Test {
 protected:
  RestorerTest()
      : reader_("reader", {}),
        leases_(&reader_.tier().clock(), &reader_.tier().metrics(), [](const ClientRef&) { return ClientState::kConnected; }),
        reconstructor_(&reader_.client(), &reader_.tier().clock(), &reader_.tier().metrics(), Reconstructor::Options{}),
        stripes_("test-stripes", 2, 16),
        races_("test-races", 4, 16),
        content_(SeededBytes(3 * kArenaPageBytes + 100, 7)),
        record_(RecordOf(kId, content_, 3)) {
    restorer_ = std::make_unique<Restorer>(Restorer::Deps{
        .holdings = &reader_.holdings(), .leases = &leases_, .peers = &reader_.client(),
        .reconstructor = &reconstructor_, .stripes = &stripes_, .arena = &reader_.tier().arena(),
        .session = &reader_.session(), .meta = &meta_, .node_id = "reader", .durable_fs = &durable_fs_,
        .durable_root = "/durable", .clock = &reader_.tier().clock(), .metrics = &reader_.tier().metrics(),
        .default_handle_ttl_ms = 60000,
        .budget_message = [](uint64_t b) { return absl::StrCat("no room for ", b, " bytes here"); }});
    meta_.located.shard = record_;
  }
  ~RestorerTest() override {
    stripes_.Stop();
    reader_.Stop();  // ends every read an attempt may still wait on
    races_.Stop();
  }
  // A Restorer that reads a silent replica's next source beside it after
  // one second (of the reader's FakeClock).
  std::unique_ptr<Restorer> Hedging() {
    return std::make_unique<Restorer>(Restorer::Deps{
        .holdings = &reader_.holdings(), .leases = &leases_, .peers = &reader_.client(),
        .reconstructor = &reconstructor_, .stripes = &stripes_, .arena = &reader_.tier().arena(),
        .session = &reader_.session(), .meta = &meta_, .node_id = "reader", .durable_fs = &durable_fs_,
        .durable_root = "/durable", .clock = &reader_.tier().clock(), .metrics = &reader_.tier().metrics(),
        .default_handle_ttl_ms = 60000,
        .budget_message = [](uint64_t b) { return absl::StrCat("no room for ", b, " bytes here"); },
        .races = &races_, .hedge_after = absl::Seconds(1)});
  }

  void WriteDurable(const std::string& rel, const std::string& bytes) {
    ASSERT_TRUE(durable_fs_.CreateDirs("/durable/job/5").ok());
    ASSERT_TRUE(WriteStringToFileAtomically(&durable_fs_, "/durable/" + rel, bytes).ok());
  }
  // The bytes an open handle shows, read through its pin.
  std::string HandleBytes(const OpenResult& r) {
    absl::StatusOr<Pin> pin = leases_.HandlePin(r.handle_id, "");
    EXPECT_TRUE(pin.ok()) << pin.status();
    return pin.ok() ? ReadBack(*pin->bytes, pin->rec->size_bytes) : "";
  }
  // Copy-state reports the reader's session sent meta.
  std::vector<HoldingReport> RestoredReports() {
    reader_.session().ControlOnce();
    absl::MutexLock lock(&reader_.meta().mu);
    std::vector<HoldingReport> out;
    for (const HoldingReport& r : reader_.meta().reports)
      if (r.kind == HoldingReport::Kind::kCopyState && r.copy_role == CopyRole::kRestored) out.push_back(r);
    return out;
  }
  OpenRequest Request(std::vector<ShardSource> sources) {
    OpenRequest req;
    req.id = kId;
    req.sources = std::move(sources);
    return req;
  }

  PeerNode reader_;
  LocatingMeta meta_;
  MemFileSystem durable_fs_;
  LeaseTable leases_;
  Reconstructor reconstructor_;
  Executor stripes_;
  Executor races_;
  std::string content_;
  ShardRecord record_;
  std::unique_ptr<Restorer> restorer_;
};

TEST_F(RestorerTest, OpenLocalChecksTheCopyAndOpensAHandle) {
  ASSERT_TRUE(reader_.tier().AddShard(kId, content_, /*verified=*/false).ok());
  absl::StatusOr<OpenResult> r = restorer_->OpenLocal(kId, false, ClientRef{42, ""}, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->verified);
  EXPECT_TRUE(reader_.holdings().Verified(kId));
  EXPECT_EQ(r->expires_in_ms, 60000);  // the default ttl
  EXPECT_EQ(r->shard.record->crc32c, Crc32c(content_));
  ASSERT_EQ(r->shard.regions.size(), 1u);
  EXPECT_EQ(r->shard.regions[0].path, reader_.tier().arena().pool_path());
  EXPECT_EQ(r->shard.regions[0].length, content_.size());
  EXPECT_EQ(HandleBytes(*r), content_);
  EXPECT_EQ(leases_.handle_count(), 1u);
  // A session's handle lives with the session: no ttl.
  absl::StatusOr<OpenResult> s = restorer_->OpenLocal(kId, true, ClientRef{42, "session-1"}, 5);
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s->verified);
  EXPECT_EQ(s->expires_in_ms, 0);
  absl::StatusOr<OpenResult> t = restorer_->OpenLocal(kId, true, ClientRef{}, 1234);
  EXPECT_EQ(t->expires_in_ms, 1234);
  EXPECT_EQ(restorer_->OpenLocal(ShardId{"job", 5, 9}, false, {}, 0).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(RestorerTest, OpenLocalQuarantinesACopyThatDoesNotMatchItsItems) {
  std::string rotten = content_;
  rotten[5000] ^= 1;
  ASSERT_TRUE(reader_.holdings().Add(record_, reader_.tier().Hold(rotten), false, false).ok());
  // Unchecked, it opens (the caller asked not to verify).
  absl::StatusOr<OpenResult> unchecked = restorer_->OpenLocal(kId, /*skip_verify=*/true, {}, 0);
  ASSERT_TRUE(unchecked.ok());
  EXPECT_FALSE(unchecked->verified);
  absl::StatusOr<OpenResult> r = restorer_->OpenLocal(kId, false, {}, 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_FALSE(reader_.holdings().HoldsValid(kId));
  ASSERT_EQ(reader_.tier().Reports().size(), 1u);
  EXPECT_EQ(reader_.tier().Reports()[0].copy_state, CopyState::kCorrupt);
}

TEST_F(RestorerTest, OpenLocalLeavesLargeChecksToTheCaller) {
  ASSERT_TRUE(reader_.tier().AddShard(kId, content_, false).ok());
  absl::StatusOr<OpenResult> r = restorer_->OpenLocal(kId, false, {}, 0, /*verify_at_most_bytes=*/100);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("at most 100 bytes"));
  EXPECT_FALSE(reader_.holdings().Verified(kId));
  EXPECT_TRUE(restorer_->OpenLocal(kId, /*skip_verify=*/true, {}, 0, 100).ok());
}

TEST_F(RestorerTest, ALocalCopyServesWithoutAskingMeta) {
  ASSERT_TRUE(reader_.tier().AddShard(kId, content_).ok());
  absl::StatusOr<OpenOutcome> o = restorer_->Open(Request({Durable("job/5/rank-00000.bin")}));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->served_by.has_value());
  EXPECT_TRUE(o->failed.empty());
  EXPECT_EQ(meta_.Locates(), 0);
  EXPECT_EQ(HandleBytes(o->result), content_);
}

TEST_F(RestorerTest, ALocalCopyThatDiffersFromTheExpectedShardIsRefused) {
  ASSERT_TRUE(reader_.tier().AddShard(kId, content_).ok());
  OpenRequest req = Request({});
  req.expected = record_;
  req.expected->crc32c ^= 1;
  absl::StatusOr<OpenOutcome> o = restorer_->Open(req);
  EXPECT_EQ(o.status().code(), absl::StatusCode::kDataLoss) << o.status();
  EXPECT_EQ(leases_.handle_count(), 0u);  // the handle it opened is closed again
  req.expected = record_;
  EXPECT_TRUE(restorer_->Open(req).ok());
}

TEST_F(RestorerTest, NothingHereAndNoSourceIsTheLocalError) {
  absl::StatusOr<OpenOutcome> o = restorer_->Open(Request({}));
  EXPECT_EQ(o.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(meta_.Locates(), 0);
}

TEST_F(RestorerTest, RestoresFromTheDurableTierMetaListsAndKeepsARestoredCopy) {
  WriteDurable("job/5/rank-00000.bin", content_);
  meta_.located.sources = {Durable("job/5/rank-00000.bin")};
  OpenRequest req = Request({Durable("job/5/rank-00000.bin")});
  req.expected = record_;
  req.expected->crc32c ^= 1;  // the caller's belief decides nothing for a source
  absl::StatusOr<OpenOutcome> o = restorer_->Open(req);
  ASSERT_TRUE(o.ok()) << o.status();
  ASSERT_TRUE(o->served_by.has_value());
  EXPECT_EQ(*o->served_by, 0u);
  EXPECT_EQ(meta_.Locates(), 1);
  EXPECT_EQ(meta_.last_near, "reader");
  EXPECT_EQ(HandleBytes(o->result), content_);
  std::vector<HoldingInfo> held = reader_.holdings().Infos("job", 5);
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].role, CopyRole::kRestored);
  EXPECT_EQ(held[0].durable_path, "job/5/rank-00000.bin");
  EXPECT_TRUE(held[0].verified);
  std::vector<HoldingReport> reports = RestoredReports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].id, kId);
  EXPECT_EQ(reports[0].crc32c, record_.crc32c);
  EXPECT_EQ(reports[0].copy_state, CopyState::kValid);
}

TEST_F(RestorerTest, ASourceMetaDoesNotListIsRefusedUnread) {
  WriteDurable("job/5/rank-00000.bin", content_);
  WriteDurable("job/5/other.bin", content_);
  meta_.located.sources = {Durable("job/5/rank-00000.bin")};
  absl::StatusOr<OpenOutcome> o = restorer_->Open(Request({Durable("job/5/other.bin")}));
  EXPECT_EQ(o.status().code(), absl::StatusCode::kPermissionDenied) << o.status();
  EXPECT_FALSE(reader_.holdings().Holds(kId));
  // Listed next to it, the listed one serves; the other is named as failed.
  o = restorer_->Open(Request({Durable("job/5/other.bin"), Durable("job/5/rank-00000.bin")}));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(*o->served_by, 1u);
  ASSERT_EQ(o->failed.size(), 1u);
  EXPECT_EQ(o->failed[0].index, 0u);
  EXPECT_EQ(o->failed[0].status.code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(RestorerTest, WhenMetaCannotBeAskedNothingButTheLocalCopyIsRead) {
  WriteDurable("job/5/rank-00000.bin", content_);
  meta_.located.sources = {Durable("job/5/rank-00000.bin")};
  meta_.locate_error = absl::UnavailableError("meta down");
  absl::StatusOr<OpenOutcome> o = restorer_->Open(Request({Durable("job/5/rank-00000.bin")}));
  EXPECT_EQ(o.status().code(), absl::StatusCode::kUnavailable) << o.status();
  meta_.locate_error = absl::FailedPreconditionError("version 5 of secret-job is ABORTED");
  o = restorer_->Open(Request({Durable("job/5/rank-00000.bin")}));
  EXPECT_EQ(o.status().code(), absl::StatusCode::kPermissionDenied) << o.status();
  EXPECT_THAT(std::string(o.status().message()), Not(HasSubstr("secret-job")));
  EXPECT_FALSE(reader_.holdings().Holds(kId));
}

TEST_F(RestorerTest, ADurableFileThatDoesNotMatchMetasRecordIsDataLossWithoutItsDetails) {
  std::string bad = content_;
  bad[0] ^= 1;
  WriteDurable("job/5/rank-00000.bin", bad);
  WriteDurable("job/5/short.bin", content_.substr(1));
  meta_.located.sources = {Durable("job/5/rank-00000.bin"), Durable("job/5/short.bin"), Durable("job/5/gone.bin")};
  absl::StatusOr<OpenOutcome> o = restorer_->Open(
      Request({Durable("job/5/rank-00000.bin"), Durable("job/5/short.bin"), Durable("job/5/gone.bin")}));
  EXPECT_EQ(o.status().code(), absl::StatusCode::kDataLoss) << o.status();
  const std::string msg(o.status().message());
  EXPECT_THAT(msg, HasSubstr("does not match the shard"));
  EXPECT_THAT(msg, HasSubstr("was not found"));
  EXPECT_THAT(msg, Not(HasSubstr(absl::StrFormat("%08x", Crc32c(bad)))));
  EXPECT_THAT(msg, Not(HasSubstr(absl::StrCat(content_.size() - 1))));
  EXPECT_FALSE(reader_.holdings().Holds(kId));
  EXPECT_EQ(reader_.tier().arena().free_bytes(), reader_.tier().arena().capacity_bytes());
}

TEST_F(RestorerTest, FromDurableRefusesPathsOutsideTheRootAndAShardWithoutRoom) {
  EXPECT_EQ(restorer_->FromDurable(record_, "../etc/passwd", {}, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  WriteDurable("job/5/rank-00000.bin", content_);
  ShardRecord huge = RecordOf(kId, content_, 1);
  PeerNode small("small", PeerNode::Options{.capacity_bytes = kArenaPageBytes});
  Restorer tight(Restorer::Deps{.holdings = &small.holdings(), .leases = &leases_, .peers = nullptr,
                                .reconstructor = nullptr, .stripes = &stripes_, .arena = &small.tier().arena(),
                                .session = &small.session(), .meta = &meta_, .node_id = "small",
                                .durable_fs = &durable_fs_, .durable_root = "/durable", .clock = &small.tier().clock(),
                                .metrics = &small.tier().metrics(),
                                .budget_message = [](uint64_t b) { return absl::StrCat("no room for ", b); }});
  absl::StatusOr<OpenResult> r = tight.FromDurable(huge, "job/5/rank-00000.bin", {}, 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(absl::StrCat("no room for ", content_.size())));
  // No data plane: a peer source is Unavailable.
  EXPECT_EQ(tight.FromPeer(record_, reader_.endpoint(), {}, 0).status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(RestorerTest, RestoresAPeersReplicaFromWhereMetaSaysItIs) {
  PeerNode holder("holder", {});
  ASSERT_TRUE(holder.tier().AddShard(kId, content_, true, CopyRole::kReplica).ok());
  // The caller names the holder with a stale address; meta's endpoint is read.
  PeerEndpoint named = holder.endpoint();
  named.data_address = "loop:nowhere";
  meta_.located.sources = {Replica(holder.endpoint())};
  absl::StatusOr<OpenOutcome> o = restorer_->Open(Request({Replica(named)}));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(HandleBytes(o->result), content_);
  EXPECT_EQ(reader_.holdings().Infos("job", 5)[0].role, CopyRole::kRestored);
  EXPECT_EQ(reader_.tier().metrics().peer_restores->Value(), 1.0);
  EXPECT_EQ(RestoredReports().size(), 1u);
}

TEST_F(RestorerTest, APeersBadCopyIsDataLossAndADeadPeerUnavailable) {
  PeerNode holder("holder", {});
  std::string rotten = content_;
  rotten[100] ^= 2;
  // The holder's copy is recorded with meta's crc but its bytes rotted: the
  // read's whole crc no longer matches.
  ASSERT_TRUE(holder.holdings().Add(record_, holder.tier().Hold(rotten), true, false).ok());
  absl::StatusOr<OpenResult> r = restorer_->FromPeer(record_, holder.endpoint(), {}, 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_FALSE(reader_.holdings().Holds(kId));
  // Counted once by the read (PeerClient) and once by the restore.
  EXPECT_EQ(reader_.tier().metrics().peer_errors->Value(), 2.0);
  // The holder saw that its copy no longer hashes to its crc: quarantined.
  EXPECT_FALSE(holder.holdings().HoldsValid(kId));
  holder.Stop();
  r = restorer_->FromPeer(record_, holder.endpoint(), {}, 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_FALSE(reader_.holdings().Holds(kId));
  EXPECT_EQ(reader_.tier().arena().free_bytes(), reader_.tier().arena().capacity_bytes());
}

// A slice of a global tensor needs part of a shard: a peer's replica sends
// only the ranges asked, into a reservation the handle alone keeps (no
// RESTORED copy here, nothing reported to meta), back to back in the order
// asked. The holder checks its whole copy first, once.
TEST_F(RestorerTest, ByteRangesAreReadFromAPeerAloneAndKeptByTheHandleOnly) {
  PeerNode holder("holder", {});
  ASSERT_TRUE(holder.tier().AddShard(kId, content_, /*verified=*/false, CopyRole::kReplica).ok());
  meta_.located.sources = {Replica(holder.endpoint())};
  const uint64_t free_before = reader_.tier().arena().free_bytes();
  OpenRequest req = Request(meta_.located.sources);
  req.ranges = {{17, 40}, {kArenaPageBytes + 5, 3000}, {content_.size() - 9, 9}};
  absl::StatusOr<OpenOutcome> o = restorer_->Open(req);
  ASSERT_TRUE(o.ok()) << o.status();
  ASSERT_TRUE(o->result.ranges_only);
  EXPECT_EQ(HandleBytes(o->result), content_.substr(17, 40) + content_.substr(kArenaPageBytes + 5, 3000) +
                                        content_.substr(content_.size() - 9));
  EXPECT_EQ(o->result.shard.record->size_bytes, 3049u);
  EXPECT_EQ(o->result.shard.record->crc32c, Crc32c(HandleBytes(o->result)));
  EXPECT_EQ(o->result.shard.regions.size() >= 1, true);
  EXPECT_EQ(holder.tier().metrics().peer_sent_bytes->Value(), 3049.0);  // not the shard's 12 KiB
  EXPECT_FALSE(reader_.holdings().Holds(kId));
  EXPECT_TRUE(RestoredReports().empty());
  EXPECT_TRUE(holder.holdings().Verified(kId));  // checked whole before the first part left
  leases_.CloseHandle(o->result.handle_id);
  EXPECT_EQ(reader_.tier().arena().free_bytes(), free_before);
  // Ranges that would take what this node read of the shard past half of
  // it (other ranks here need parts too): the whole shard is restored here,
  // as a RESTORED copy the node's ranks share.
  req.ranges = {{0, 3200}};
  o = restorer_->Open(req);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->result.ranges_only);
  EXPECT_EQ(HandleBytes(o->result), content_);
  EXPECT_EQ(reader_.holdings().Infos("job", 5)[0].role, CopyRole::kRestored);
  EXPECT_EQ(RestoredReports().size(), 1u);
  leases_.CloseHandle(o->result.handle_id);
  // And the local copy serves the next opens whole (mapping it costs nothing).
  o = restorer_->Open(req);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->result.ranges_only);
  EXPECT_FALSE(o->served_by.has_value());
  leases_.CloseHandle(o->result.handle_id);
}

TEST_F(RestorerTest, ByteRangesOfARottenCopyAreDataLossAndBadRangesRefusedUnread) {
  PeerNode holder("holder", {});
  std::string rotten = content_;
  rotten[3 * kArenaPageBytes] ^= 2;  // outside the range asked
  ASSERT_TRUE(holder.holdings().Add(record_, holder.tier().Hold(rotten), /*verified=*/false, false).ok());
  meta_.located.sources = {Replica(holder.endpoint())};
  OpenRequest req = Request(meta_.located.sources);
  req.ranges = {{0, 100}};
  absl::StatusOr<OpenOutcome> o = restorer_->Open(req);
  EXPECT_EQ(o.status().code(), absl::StatusCode::kDataLoss) << o.status();
  EXPECT_FALSE(holder.holdings().HoldsValid(kId));  // quarantined by the holder's check
  EXPECT_EQ(holder.tier().metrics().peer_sent_bytes->Value(), 0.0);
  EXPECT_EQ(reader_.tier().arena().free_bytes(), reader_.tier().arena().capacity_bytes());
  // Ranges outside meta's record of the shard, empty or too many: refused
  // before anything is read.
  for (const std::vector<ByteRange>& bad :
       {std::vector<ByteRange>{{content_.size() - 1, 2}}, std::vector<ByteRange>{{5, 0}},
        std::vector<ByteRange>{{content_.size() + 1, 1}}, std::vector<ByteRange>(kMaxOpenRanges + 1, {0, 1}),
        std::vector<ByteRange>{{100, 50}, {120, 10}}, std::vector<ByteRange>{{100, 50}, {0, 10}},
        std::vector<ByteRange>(2, {0, content_.size()})}) {
    req.ranges = bad;
    o = restorer_->Open(req);
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << o.status();
  }
}

// A holder that goes silent (SIGSTOP, overload) before its first byte or in
// the middle of the read (three chunks sent, then nothing) holds a restore
// up for the hedge delay, not the peer timeout (20 s here): the next
// replica is read beside it and serves; the silent read is cancelled.
class RestorerHedgeTest : public RestorerTest, public ::testing::WithParamInterface<bool> {};

TEST_P(RestorerHedgeTest, ASilentReplicaHolderIsRacedByTheNextSource) {
  const bool mid_read = GetParam();
  RawPeer slow;  // a hand-played holder
  if (mid_read) slow.set_responder(Holder({.content = content_, .chunks = 3, .send_end = false}));
  PeerNode good("good", {});
  ASSERT_TRUE(good.tier().AddShard(kId, content_, true, CopyRole::kReplica).ok());
  meta_.located.sources = {Replica(PeerEndpoint{"slow", 1, slow.address(), false}), Replica(good.endpoint())};
  std::unique_ptr<Restorer> hedging = Hedging();
  absl::StatusOr<OpenOutcome> o;
  std::thread t([&] { o = hedging->Open(Request(meta_.located.sources)); });
  // Once the holder has the request (and, mid-read, its chunks landed), the
  // open and the silent read both wait on the clock; one second later the
  // next replica is read.
  ASSERT_EQ(slow.AwaitType(kReadReq, 1).size(), 1u);
  while (reader_.tier().metrics().peer_received_bytes->Value() < (mid_read ? 3000.0 : 0.0)) {
    std::this_thread::yield();
  }
  reader_.tier().clock().BlockUntilWaiters(2);
  EXPECT_EQ(reader_.tier().metrics().hedged_restores->Value(), 0.0);
  reader_.tier().clock().Advance(absl::Seconds(1));
  t.join();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->served_by, std::optional<size_t>(1));
  EXPECT_TRUE(o->failed.empty());  // the silent one was cancelled, not failed
  EXPECT_EQ(HandleBytes(o->result), content_);
  EXPECT_EQ(reader_.tier().metrics().hedged_restores->Value(), 1.0);
  EXPECT_EQ(RestoredReports().size(), 1u);
  races_.Stop();  // the silent attempt has ended (cancelled): it returns at once
  EXPECT_EQ(leases_.handle_count(), 1u);
  leases_.CloseHandle(o->result.handle_id);
}

INSTANTIATE_TEST_SUITE_P(BeforeAndDuringTheRead, RestorerHedgeTest, ::testing::Bool());

TEST_F(RestorerTest, WithoutASilentHolderNothingIsHedged) {
  PeerNode first("first", {}), second("second", {});
  ASSERT_TRUE(first.tier().AddShard(kId, content_, true, CopyRole::kReplica).ok());
  ASSERT_TRUE(second.tier().AddShard(kId, content_, true, CopyRole::kReplica).ok());
  meta_.located.sources = {Replica(first.endpoint()), Replica(second.endpoint())};
  absl::StatusOr<OpenOutcome> o = Hedging()->Open(Request(meta_.located.sources));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->served_by, std::optional<size_t>(0));
  EXPECT_EQ(HandleBytes(o->result), content_);
  EXPECT_EQ(reader_.tier().metrics().hedged_restores->Value(), 0.0);
  EXPECT_EQ(second.tier().metrics().peer_sent_bytes->Value(), 0.0);
}

TEST_F(RestorerTest, AHedgedOpenListsTheSourcesThatFailedInOrder) {
  PeerNode dead("dead", {}), good("good", {});
  ASSERT_TRUE(good.tier().AddShard(kId, content_, true, CopyRole::kReplica).ok());
  dead.Stop();
  WriteDurable("job/5/0.shard", "not the shard");
  meta_.located.sources = {Replica(dead.endpoint()), Durable("job/5/0.shard"), Replica(good.endpoint())};
  absl::StatusOr<OpenOutcome> o = Hedging()->Open(Request(meta_.located.sources));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->served_by, std::optional<size_t>(2));
  ASSERT_EQ(o->failed.size(), 2u);
  EXPECT_EQ(o->failed[0].index, 0u);
  EXPECT_EQ(o->failed[0].status.code(), absl::StatusCode::kUnavailable) << o->failed[0].status;
  EXPECT_EQ(o->failed[1].index, 1u);
  EXPECT_EQ(o->failed[1].status.code(), absl::StatusCode::kDataLoss) << o->failed[1].status;
  EXPECT_EQ(HandleBytes(o->result), content_);
}

// RS(2, 1). The owner's blob (just this shard) is cut in two segments:
// segment 0 is position 0 of stripe 0, segment 1 position 1 of stripe 1.
// Node b holds the other data segment of each stripe, node c the parities.
TEST_F(RestorerTest, DecodesTheShardFromEcStripesWithItsOwnerGone) {
  PeerNode b("b", {}), c("c", {});
  const uint64_t seg = (content_.size() + 1) / 2;
  const std::string own[2] = {content_.substr(0, seg), content_.substr(seg)};
  const std::string other[2] = {SeededBytes(seg - 7, 30), SeededBytes(seg, 31)};
  auto codec = *ec::Codec::Create(2, 1);
  EcDecodeSource src;
  src.data_k = 2;
  src.parity_m = 1;
  src.owner_node_id = "gone";
  src.blob_offset_bytes = 0;
  src.segment_bytes = seg;
  for (uint32_t s = 0; s < 2; ++s) {
    const std::string& d0 = s == 0 ? own[0] : other[0];
    const std::string& d1 = s == 0 ? other[1] : own[1];
    std::vector<uint8_t> parity(seg);
    std::vector<ec::ConstBuffer> data{ec::ConstBuffer(reinterpret_cast<const uint8_t*>(d0.data()), d0.size()),
                                      ec::ConstBuffer(reinterpret_cast<const uint8_t*>(d1.data()), d1.size())};
    std::vector<ec::MutableBuffer> par{ec::MutableBuffer(parity)};
    ASSERT_TRUE(codec->Encode(data, par).ok());
    const std::string p(parity.begin(), parity.end());
    const std::string& survivor = s == 0 ? d1 : d0;
    const uint32_t survivor_pos = s == 0 ? 1 : 0;
    auto hold = [&](PeerNode& n, uint32_t pos, const std::string& bytes, SegmentKind kind) {
      ShardRecord r;
      r.id = ShardId{"job", 5, 0};
      r.segment = SegmentId{"job", 5, 0, s, pos};
      r.segment_kind = kind;
      r.size_bytes = bytes.size();
      r.crc32c = Crc32c(bytes);
      ASSERT_TRUE(n.holdings().AddSegment(r, n.tier().Hold(bytes), "").ok());
      src.stripes.resize(2);
      src.stripes[s].segments.push_back(SegmentLocation{*r.segment, kind, bytes.size(), r.crc32c, n.endpoint()});
    };
    hold(b, survivor_pos, survivor, SegmentKind::kData);
    hold(c, 2, p, SegmentKind::kParity);
    src.stripes[s].stripe_index = s;
    src.stripes[s].blob_segment_index = s;
    src.stripes[s].position = s;
    src.stripes[s].stripe_length_bytes = seg;
  }
  absl::StatusOr<OpenResult> r = restorer_->ByDecode(record_, src, {}, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(HandleBytes(*r), content_);
  EXPECT_EQ(reader_.holdings().Infos("job", 5)[0].role, CopyRole::kRestored);

  // With the parities gone too, fewer than k fragments: DataLoss naming the stripe.
  reader_.holdings().DropShard(kId);
  c.Stop();
  r = restorer_->ByDecode(record_, src, {}, 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("stripe"));
  EXPECT_FALSE(reader_.holdings().Holds(kId));
}

}  // namespace
}  // namespace ckpt::agent
