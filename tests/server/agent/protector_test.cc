// (protector_test, not protection_test: tests/integration has a protection_test target.)
// Protector on its own: the protecting node and its peers are PeerNodes (the
// agent's data-plane components over the loopback transport, no Agent), time
// the sender's FakeClock. Covers a trainer's pause, replica pushes (waiting
// for the verifier, dead targets), an EC encode whose parity is checked
// against a full ISA-L encode, waiting for this node's own parity until its
// deadline, and segment rebuilds checked against meta's crc.
#include "server/agent/protection.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ec/codec.h"
#include "peer_node.h"

namespace ckpt::agent {
namespace {

using ::testing::HasSubstr;

const ShardId kId{"job", 5, 0};
// A node that takes pushes answers them once meta answered its report.
const PeerNode::Options kReceiver{.run_session = true};

class ProtectorTest : public ::testing::Test {
 protected:
  ProtectorTest()
      : n0_("n0", {}),
        reconstructor_(&n0_.client(), &n0_.tier().clock(), &n0_.tier().metrics(), Reconstructor::Options{}),
        stripes_("test-stripes", 2, 16),
        protector_(Deps(true)) {}
  ~ProtectorTest() override {
    stripes_.Stop();
    n0_.Stop();
  }

  Protector::Deps Deps(bool data_plane) {
    return Protector::Deps{
        .holdings = &n0_.holdings(), .peers = &n0_.client(), .parity = &n0_.parity(),
        .reconstructor = &reconstructor_, .stripes = &stripes_, .arena = &n0_.tier().arena(),
        .clock = &n0_.tier().clock(), .metrics = &n0_.tier().metrics(), .node_id = "n0",
        .peer_timeout_ms = 1000, .data_plane = data_plane,
        .budget_message = [](uint64_t b) { return absl::StrCat("no room for ", b, " bytes"); },
        .report = [this](HoldingReport r) {
          absl::MutexLock lock(&mu_);
          reports_.push_back(std::move(r));
        }};
  }
  std::vector<HoldingReport> Reports() {
    absl::MutexLock lock(&mu_);
    return reports_;
  }
  static QueuedTask Task(TaskKind kind, std::vector<PeerEndpoint> targets = {}) {
    QueuedTask qt;
    qt.task.id = "t-1";
    qt.task.kind = kind;
    qt.task.job_id = "job";
    qt.task.step = 5;
    qt.task.ranks = {0};
    qt.task.targets = std::move(targets);
    return qt;
  }

  PeerNode n0_;
  Reconstructor reconstructor_;
  Executor stripes_;
  Protector protector_;
  absl::Mutex mu_;
  std::vector<HoldingReport> reports_ ABSL_GUARDED_BY(mu_);
};

TEST_F(ProtectorTest, APauseHoldsBackNewPushesForItsTimeAndIsAccounted) {
  FakeClock& clock = n0_.tier().clock();
  AgentMetrics& m = n0_.tier().metrics();
  EXPECT_FALSE(protector_.Paused());
  EXPECT_EQ(protector_.Pause(absl::Seconds(10)), absl::Seconds(10));
  EXPECT_TRUE(protector_.Paused());
  EXPECT_EQ(m.protection_paused->Value(), 1.0);
  clock.Advance(absl::Seconds(4));
  EXPECT_EQ(protector_.Pause(absl::Seconds(2)), absl::Seconds(6));  // a shorter pause does not cut it
  EXPECT_EQ(protector_.Pause(absl::Seconds(8)), absl::Seconds(8));  // a longer one extends it
  // While paused, a replicate task comes back later and sends nothing.
  ASSERT_TRUE(n0_.tier().AddShard(kId, SeededBytes(100, 1)).ok());
  QueuedTask qt = Task(TaskKind::kReplicate, {PeerEndpoint{"x", 1, "loop:nowhere", false}});
  bool finished = true;
  ASSERT_TRUE(protector_.Replicate(qt, &finished).ok());
  EXPECT_FALSE(finished);
  EXPECT_EQ(qt.bytes_done, 0u);
  clock.Advance(absl::Seconds(8));
  EXPECT_FALSE(protector_.Paused());
  EXPECT_EQ(m.protection_paused->Value(), 0.0);
  EXPECT_EQ(m.protection_paused_seconds->Value(), 12.0);
  // Resuming early counts only what ran.
  protector_.Pause(absl::Seconds(30));
  clock.Advance(absl::Seconds(3));
  EXPECT_EQ(protector_.Pause(absl::ZeroDuration()), absl::ZeroDuration());
  EXPECT_FALSE(protector_.Paused());
  EXPECT_EQ(m.protection_paused_seconds->Value(), 15.0);
}

TEST_F(ProtectorTest, WithoutADataPlaneEveryTaskIsUnavailable) {
  Protector none(Deps(false));
  QueuedTask qt = Task(TaskKind::kReplicate);
  bool finished = true;
  EXPECT_EQ(none.Replicate(qt, &finished).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(none.EcEncode(qt, &finished).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(none.RebuildSegments(qt).code(), absl::StatusCode::kUnavailable);
}

TEST_F(ProtectorTest, ReplicatesAVerifiedCopyToEveryTarget) {
  PeerNode b("b", kReceiver), c("c", kReceiver);
  const std::string content = SeededBytes(7000, 2);
  ASSERT_TRUE(n0_.tier().AddShard(kId, content, /*verified=*/false).ok());
  QueuedTask qt = Task(TaskKind::kReplicate, {b.endpoint(), c.endpoint()});
  bool finished = true;
  // Not checked yet: nothing leaves the node.
  ASSERT_TRUE(protector_.Replicate(qt, &finished).ok());
  EXPECT_FALSE(finished);
  EXPECT_FALSE(b.holdings().Holds(kId));
  n0_.holdings().MarkVerified(*n0_.holdings().PinValid(kId));
  finished = true;
  ASSERT_TRUE(protector_.Replicate(qt, &finished).ok());
  EXPECT_TRUE(finished);
  EXPECT_EQ(qt.bytes_done, 2 * content.size());
  for (PeerNode* n : {&b, &c}) {
    absl::StatusOr<Pin> pin = n->holdings().PinValid(kId);
    ASSERT_TRUE(pin.ok()) << n->id() << ": " << pin.status();
    EXPECT_EQ(pin->rec->role, CopyRole::kReplica);
    EXPECT_EQ(pin->rec->items, n0_.holdings().PinValid(kId)->rec->items);
    EXPECT_EQ(ReadBack(*pin->bytes, content.size()), content);
  }
}

TEST_F(ProtectorTest, AFailedReplicaNamesTheRankAndTheTarget) {
  PeerNode b("b", kReceiver), dead("dead", {});
  const PeerEndpoint gone = dead.endpoint();
  dead.Stop();
  ASSERT_TRUE(n0_.tier().AddShard(kId, SeededBytes(3000, 3)).ok());
  QueuedTask qt = Task(TaskKind::kReplicate, {b.endpoint(), gone});
  qt.task.ranks = {0, 1};  // rank 1 is not held here
  bool finished = true;
  absl::Status s = protector_.Replicate(qt, &finished);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 0 to node \"dead\""));
  EXPECT_THAT(std::string(s.message()), HasSubstr("job/5/1"));
  EXPECT_TRUE(b.holdings().HoldsValid(kId));  // the live target got it
  EXPECT_EQ(qt.bytes_done, 3000u);
  EXPECT_EQ(n0_.tier().metrics().peer_errors->Value(), 1.0);
}

// RS(2, 1), one stripe: both data segments are n0's blob (segments 0 and 1),
// the parity is n2's.
AgentTask EncodeTask(const PeerEndpoint& parity_holder, uint64_t blob_bytes) {
  AgentTask t;
  t.id = "t-enc";
  t.kind = TaskKind::kEcEncode;
  t.job_id = "job";
  t.step = 5;
  t.group.group_index = 0;
  t.group.data_k = 2;
  t.group.parity_m = 1;
  t.group.node_ids = {"n0", parity_holder.node_id};
  EcStripeLayout s;
  s.stripe_index = 0;
  s.data_node_ids = {"n0", "n0"};
  s.data_segment_indices = {0, 1};
  s.parity_node_ids = {parity_holder.node_id};
  t.group.stripes = {s};
  t.blobs = {NodeBlob{"n0", {BlobPart{0, 0, blob_bytes}}, blob_bytes, (blob_bytes + 1) / 2}};
  t.members = {PeerEndpoint{"n0", 1, "", false}, parity_holder};
  return t;
}

TEST_F(ProtectorTest, EcEncodePushesTheBlobsSegmentsIntoTheParity) {
  PeerNode n2("n2", kReceiver);
  const std::string blob = SeededBytes(5001, 4);
  ASSERT_TRUE(n0_.tier().AddShard(kId, blob).ok());
  QueuedTask qt;
  qt.task = EncodeTask(n2.endpoint(), blob.size());
  bool finished = true;
  ASSERT_TRUE(protector_.EcEncode(qt, &finished).ok());
  EXPECT_TRUE(finished);  // no parity of n0's to wait for
  EXPECT_TRUE(qt.sends_done);
  EXPECT_EQ(qt.bytes_done, blob.size());
  // The parity on n2 is the encoder's.
  const std::string d0 = blob.substr(0, 2501), d1 = blob.substr(2501);
  auto codec = *ec::Codec::Create(2, 1);
  std::vector<uint8_t> p(2501);
  std::vector<ec::ConstBuffer> data{ec::ConstBuffer(reinterpret_cast<const uint8_t*>(d0.data()), d0.size()),
                                    ec::ConstBuffer(reinterpret_cast<const uint8_t*>(d1.data()), d1.size())};
  std::vector<ec::MutableBuffer> par{ec::MutableBuffer(p)};
  ASSERT_TRUE(codec->Encode(data, par).ok());
  absl::StatusOr<Pin> parity = n2.holdings().PinSegment(SegmentId{"job", 5, 0, 0, 2});
  ASSERT_TRUE(parity.ok()) << parity.status();
  EXPECT_EQ(ReadBack(*parity->bytes, 2501), std::string(p.begin(), p.end()));
  // n0 describes the data segments its blob provides, and reports them.
  std::optional<OwnedSegment> owned = n0_.holdings().Owned(SegmentId{"job", 5, 0, 0, 1});
  ASSERT_TRUE(owned.has_value());
  EXPECT_EQ(owned->length_bytes, 2500u);
  EXPECT_EQ(owned->crc32c, Crc32c(d1));
  EXPECT_EQ(owned->blob_segment_index, 1u);
  std::vector<HoldingReport> reports = Reports();
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_EQ(reports[0].kind, HoldingReport::Kind::kSegment);
  EXPECT_EQ(reports[0].task_id, "t-enc");
}

TEST_F(ProtectorTest, EcEncodeRefusesABadLayoutAndWaitsForTheVerifier) {
  PeerNode n2("n2", kReceiver);
  const std::string blob = SeededBytes(5001, 5);
  ASSERT_TRUE(n0_.tier().AddShard(kId, blob, /*verified=*/false).ok());
  QueuedTask qt;
  qt.task = EncodeTask(n2.endpoint(), blob.size());
  bool finished = true;
  ASSERT_TRUE(protector_.EcEncode(qt, &finished).ok());
  EXPECT_FALSE(finished);
  EXPECT_FALSE(qt.sends_done);
  n0_.holdings().MarkVerified(*n0_.holdings().PinValid(kId));
  qt.task = EncodeTask(n2.endpoint(), blob.size() + 1);  // meta's blob differs from ours
  absl::Status s = protector_.EcEncode(qt, &finished);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("5001 bytes, the layout says 5002"));
  qt.task.group.data_k = 0;
  EXPECT_EQ(protector_.EcEncode(qt, &finished).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ProtectorTest, EcEncodeWaitsForItsOwnParityUntilTheDeadline) {
  PeerNode n2("n2", kReceiver);
  const std::string blob = SeededBytes(3000, 6);
  ASSERT_TRUE(n0_.tier().AddShard(kId, blob).ok());
  QueuedTask qt;
  qt.task = EncodeTask(n2.endpoint(), blob.size());
  // A second stripe of n1's data whose parity is n0's: n1 never pushes.
  EcStripeLayout s1;
  s1.stripe_index = 1;
  s1.data_node_ids = {"n1", "n1"};
  s1.data_segment_indices = {0, 1};
  s1.parity_node_ids = {"n0"};
  qt.task.group.stripes.push_back(s1);
  qt.task.blobs.push_back(NodeBlob{"n1", {}, 100, 50});
  bool finished = true;
  ASSERT_TRUE(protector_.EcEncode(qt, &finished).ok());
  EXPECT_FALSE(finished);
  EXPECT_TRUE(qt.sends_done);
  n0_.tier().clock().Advance(absl::Seconds(4));  // 4 peer timeouts
  finished = true;
  ASSERT_TRUE(protector_.EcEncode(qt, &finished).ok());
  EXPECT_FALSE(finished);
  n0_.tier().clock().Advance(absl::Milliseconds(1));
  absl::Status st = protector_.EcEncode(qt, &finished);
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("job/5/g0.s1.p2"));
}

class ProtectorRebuildTest : public ProtectorTest {
 protected:
  // n1 and n2 hold an RS(2, 1) stripe's data segments; its parity is lost.
  ProtectorRebuildTest() : n1_("n1", {}), n2_("n2", {}) {
    d_[0] = SeededBytes(3000, 7);
    d_[1] = SeededBytes(2000, 8);
    auto codec = *ec::Codec::Create(2, 1);
    std::vector<uint8_t> p(3000);
    std::vector<ec::ConstBuffer> data{ec::ConstBuffer(reinterpret_cast<const uint8_t*>(d_[0].data()), 3000),
                                      ec::ConstBuffer(reinterpret_cast<const uint8_t*>(d_[1].data()), 2000)};
    std::vector<ec::MutableBuffer> par{ec::MutableBuffer(p)};
    EXPECT_TRUE(codec->Encode(data, par).ok());
    parity_.assign(p.begin(), p.end());
    PeerNode* holders[2] = {&n1_, &n2_};
    for (uint32_t pos = 0; pos < 2; ++pos) {
      ShardRecord r;
      r.id = ShardId{"job", 5, 0};
      r.segment = SegmentId{"job", 5, 0, 0, pos};
      r.segment_kind = SegmentKind::kData;
      r.size_bytes = d_[pos].size();
      r.crc32c = Crc32c(d_[pos]);
      EXPECT_TRUE(holders[pos]->holdings().AddSegment(r, holders[pos]->tier().Hold(d_[pos]), "").ok());
      sources_.push_back(SegmentLocation{*r.segment, SegmentKind::kData, r.size_bytes, r.crc32c,
                                         holders[pos]->endpoint()});
    }
  }
  QueuedTask RebuildTask(std::optional<uint32_t> expected_crc) {
    QueuedTask qt;
    qt.task.id = "t-rb";
    qt.task.kind = TaskKind::kRebuildSegments;
    qt.task.job_id = "job";
    qt.task.step = 5;
    qt.task.data_k = 2;
    qt.task.parity_m = 1;
    SegmentRebuild r;
    r.target = SegmentId{"job", 5, 0, 0, 2};
    r.kind = SegmentKind::kParity;
    r.length_bytes = 3000;
    r.stripe_length_bytes = 3000;
    r.expected_crc32c = expected_crc;
    r.sources = sources_;
    qt.task.rebuilds = {r};
    return qt;
  }

  PeerNode n1_, n2_;
  std::string d_[2];
  std::string parity_;
  std::vector<SegmentLocation> sources_;
};

TEST_F(ProtectorRebuildTest, RebuildsALostParityAndKeepsIt) {
  QueuedTask qt = RebuildTask(Crc32c(parity_));
  ASSERT_TRUE(protector_.RebuildSegments(qt).ok());
  EXPECT_EQ(qt.bytes_done, 3000u);
  absl::StatusOr<Pin> pin = n0_.holdings().PinSegment(SegmentId{"job", 5, 0, 0, 2});
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(ReadBack(*pin->bytes, 3000), parity_);
  EXPECT_EQ(pin->rec->segment_kind, SegmentKind::kParity);
  EXPECT_EQ(n0_.tier().metrics().segments_rebuilt->Value(), 1.0);
  std::vector<HoldingReport> reports = n0_.tier().Reports();  // the table reports it, with the task
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].task_id, "t-rb");
  EXPECT_EQ(reports[0].crc32c, Crc32c(parity_));
  // Held now: running the task again rebuilds nothing.
  QueuedTask again = RebuildTask(Crc32c(parity_));
  ASSERT_TRUE(protector_.RebuildSegments(again).ok());
  EXPECT_EQ(again.bytes_done, 0u);
}

TEST_F(ProtectorRebuildTest, ARebuildThatDoesNotMatchMetasCrcIsNotKept) {
  QueuedTask qt = RebuildTask(Crc32c(parity_) ^ 1);
  absl::Status s = protector_.RebuildSegments(qt);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("job/5/g0.s0.p2: rebuilt job/5/g0.s0.p2 has crc32c"));
  EXPECT_FALSE(n0_.holdings().HasValidSegment(SegmentId{"job", 5, 0, 0, 2}));
  EXPECT_EQ(n0_.tier().arena().free_bytes(), n0_.tier().arena().capacity_bytes());
  // Without an expected crc (a parity meta never saw) it is kept.
  QueuedTask unknown = RebuildTask(std::nullopt);
  ASSERT_TRUE(protector_.RebuildSegments(unknown).ok());
  EXPECT_TRUE(n0_.holdings().HasValidSegment(SegmentId{"job", 5, 0, 0, 2}));
}

TEST_F(ProtectorRebuildTest, TooFewSourcesOrNoRoomFailTheTask) {
  n2_.Stop();
  QueuedTask qt = RebuildTask(Crc32c(parity_));
  absl::Status s = protector_.RebuildSegments(qt);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("only 1 of the 2"));
  qt.task.rebuilds[0].length_bytes = n0_.tier().arena().capacity_bytes() + 1;
  s = protector_.RebuildSegments(qt);
  EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat("no room for ", n0_.tier().arena().capacity_bytes() + 1)));
}

}  // namespace
}  // namespace ckpt::agent
