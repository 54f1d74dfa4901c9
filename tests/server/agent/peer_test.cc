// The agent's peer data plane across several in-process agents joined by the
// loopback transport: replica pushes, restore from a peer (and from a peer
// whose copy went bad), EC parity folding, restore by decode with the owner
// gone, and rebuilding a lost parity segment. The agents run their threads
// on the real clock; every wait is bounded, nothing sleeps.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "agent_cluster.h"
#include "ec/codec.h"

namespace ckpt::agent {
namespace {

using ::testing::HasSubstr;
using PeerTest = AgentCluster;

TEST_F(PeerTest, ReplicatesRestoresFromPeerAndQuarantinesABadCopy) {
  Node& a = AddNode(1);
  Node& b = AddNode(1);
  Node& c = AddNode(1);
  Node& d = AddNode(1);
  const ShardRecord rec = Save(a, 5, 0, 5000, 1);
  for (auto& n : nodes_) n->agent->Start();

  AgentTask t;
  t.id = "t-rep";
  t.kind = TaskKind::kReplicate;
  t.kind_name = "replicate";
  t.job_id = "job";
  t.step = 5;
  t.ranks = {0};
  t.targets = {b.endpoint, c.endpoint};
  a.agent->EnqueueTasks({t});
  ASSERT_TRUE(WaitResult(a, "t-rep").ok());
  const ShardId id{"job", 5, 0};
  for (Node* n : {&b, &c}) {
    std::vector<HoldingInfo> inv = n->agent->Inventory("job", 5);
    ASSERT_EQ(inv.size(), 1u) << n->id;
    EXPECT_EQ(inv[0].role, CopyRole::kReplica);
    EXPECT_EQ(inv[0].crc32c, rec.crc32c);
    EXPECT_EQ(Bytes(*n->agent, id), Content("n0", 0));
    // The replica was reported to meta before the sender's result.
    absl::MutexLock lock(&n->meta.mu);
    bool reported = false;
    for (const HoldingReport& r : n->meta.reports)
      reported |= r.kind == HoldingReport::Kind::kCopyState && r.copy_role == CopyRole::kReplica && r.task_id == "t-rep";
    EXPECT_TRUE(reported) << n->id;
  }
  // Running the task again changes nothing (receivers already hold it).
  t.id = "t-rep2";
  a.agent->EnqueueTasks({t});
  ASSERT_TRUE(WaitResult(a, "t-rep2").ok());

  // Restore on d from b's replica.
  absl::StatusOr<OpenResult> r = d.agent->RestoreFromPeer(rec, b.endpoint, 0, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Bytes(*d.agent, id), Content("n0", 0));
  EXPECT_EQ(d.agent->Inventory("job", 5)[0].role, CopyRole::kRestored);
  ASSERT_TRUE(d.agent->CloseShard(r->handle_id).ok());

  // c's copy rots in memory: a restore from it fails with DataLoss, c
  // quarantines its copy, and nothing is kept on the reader.
  {
    std::vector<HoldingInfo> inv = c.agent->Inventory("job", 5);
    std::string bytes = Bytes(*c.agent, id);
    absl::Status s = c.agent->ReadShard(id, 100, 1, [](const std::byte* p, uint64_t) {
      const_cast<std::byte*>(p)[0] ^= std::byte{0x40};
      return absl::OkStatus();
    }, nullptr);
    ASSERT_TRUE(s.ok());
  }
  Node& e = AddNode(1);
  e.agent->Start();
  absl::StatusOr<OpenResult> bad = e.agent->RestoreFromPeer(rec, c.endpoint, 0, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
  EXPECT_TRUE(e.agent->Inventory("job", 5).empty());
  EXPECT_EQ(c.agent->Inventory("job", 5)[0].state, CopyState::kCorrupt);
  // A dead peer: Unavailable, promptly.
  b.agent->Stop();
  absl::StatusOr<OpenResult> gone = e.agent->RestoreFromPeer(rec, b.endpoint, 0, 0);
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable) << gone.status();
  // Bad input on a push is refused with a clear error: a peer whose
  // incarnation is not the one addressed.
  PeerEndpoint stale = d.endpoint;
  stale.incarnation = 99;
  t.id = "t-stale";
  t.targets = {stale};
  a.agent->EnqueueTasks({t});
  absl::Status st = WaitResult(a, "t-stale");
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(st.message(), HasSubstr("incarnation"));
}

// Three nodes, RS(2,1): stripe s has its parity on node s and data segments
// of nodes s+1 (position 0) and s+2 (position 1); each blob is cut in 2.
TEST_F(PeerTest, EncodesParityDecodesWithOwnerGoneAndRebuildsParity) {
  for (int i = 0; i < 3; ++i) AddNode(3);
  const uint64_t sizes[3] = {4097, 3000, 1};  // unequal blobs, one tiny
  std::map<uint32_t, std::map<uint32_t, HoldingReport>> seg = EncodeRs21(9, sizes);  // stripe -> position -> report
  ASSERT_FALSE(HasFailure());
  const std::vector<ShardRecord>& recs = recs_;
  // Parity equals a full encode of each stripe's (zero-padded) data.
  auto codec = ec::Codec::Create(2, 1);
  for (uint32_t s = 0; s < 3; ++s) {
    const std::string& d0 = contents_[{nodes_[(s + 1) % 3]->id, (s + 1) % 3}];
    const std::string& d1 = contents_[{nodes_[(s + 2) % 3]->id, (s + 2) % 3}];
    const uint64_t seg0 = (d0.size() + 1) / 2;
    const std::string a = d0.substr(0, seg0);
    const std::string b = d1.size() > (d1.size() + 1) / 2 ? d1.substr((d1.size() + 1) / 2) : std::string();
    std::vector<uint8_t> parity(std::max(a.size(), b.size()));
    std::vector<ec::ConstBuffer> data{ec::ConstBuffer(reinterpret_cast<const uint8_t*>(a.data()), a.size()),
                                      ec::ConstBuffer(reinterpret_cast<const uint8_t*>(b.data()), b.size())};
    std::vector<ec::MutableBuffer> par{ec::MutableBuffer(parity)};
    ASSERT_TRUE((*codec)->Encode(data, par).ok());
    ASSERT_TRUE(seg[s].count(2)) << "stripe " << s;
    EXPECT_EQ(seg[s][2].size_bytes, parity.size());
    EXPECT_EQ(seg[s][2].crc32c, Crc32c(parity.data(), parity.size())) << "stripe " << s;
    EXPECT_EQ(seg[s][0].crc32c, Crc32c(a)) << "stripe " << s;
  }

  // Node 0 dies. Its shard is rebuilt on node 1: its segment 0 sits in
  // stripe 2 (position 0), its segment 1 in stripe 1 (position 1).
  nodes_[0]->agent->Stop();
  auto loc = [&](uint32_t s, uint32_t p, const Node& holder) { return Loc(9, s, p, holder); };
  const EcDecodeSource src = N0DecodeSource(9, sizes);
  absl::StatusOr<OpenResult> r = nodes_[1]->agent->RestoreByDecode(recs[0], src, 0, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Bytes(*nodes_[1]->agent, ShardId{"job", 9, 0}), Content("n0", 0));

  // Node 0's parity (stripe 0) is rebuilt on node 1 from the stripe's data.
  AgentTask rb;
  rb.id = "t-rb";
  rb.kind = TaskKind::kRebuildSegments;
  rb.kind_name = "rebuild_segments";
  rb.job_id = "job";
  rb.step = 9;
  rb.data_k = 2;
  rb.parity_m = 1;
  SegmentRebuild want;
  want.target = SegmentId{"job", 9, 0, 0, 2};
  want.kind = SegmentKind::kParity;
  want.length_bytes = seg[0][2].size_bytes;
  want.stripe_length_bytes = seg[0][2].size_bytes;
  want.expected_crc32c = seg[0][2].crc32c;
  want.sources = {loc(0, 0, *nodes_[1]), loc(0, 1, *nodes_[2])};
  rb.rebuilds = {want};
  nodes_[1]->agent->EnqueueTasks({rb});
  ASSERT_TRUE(WaitResult(*nodes_[1], "t-rb").ok());
  bool rebuilt = false;
  for (const HoldingReport& rep : SegmentReports(*nodes_[1])) {
    rebuilt |= rep.segment == want.target && rep.crc32c == want.expected_crc32c && rep.task_id == "t-rb";
  }
  EXPECT_TRUE(rebuilt);
  // With two of three gone, decode is impossible and says so.
  nodes_[2]->agent->Stop();
  Node& fresh = AddNode(3);
  fresh.agent->Start();
  absl::StatusOr<OpenResult> lost = fresh.agent->RestoreByDecode(recs[0], src, 0, 0);
  ASSERT_FALSE(lost.ok());
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kDataLoss) << lost.status();
}

// Faults in flight never leave wrong bytes anywhere: a push that fails
// midway, a chunk corrupted on the wire (push and read), a receiver that dies
// mid-push. Each failure is visible in the task result or the restore error,
// and the receiver keeps nothing of a failed transfer.
TEST_F(PeerTest, FaultsInFlightAreVisibleAndLeaveNoBytesBehind) {
  Node& a = AddNode(1, NodeOptions{.faulty = true});
  Node& b = AddNode(1);
  Node& c = AddNode(1);
  Node& d = AddNode(1);
  const ShardRecord rec = Save(a, 5, 0, 9000, 7);  // 9 chunks of 1000 bytes
  for (auto& n : nodes_) n->agent->Start();
  const uint64_t b_free = b.agent->arena().free_bytes();
  auto replicate = [&](const std::string& id, const Node& to) {
    AgentTask t;
    t.id = id;
    t.kind = TaskKind::kReplicate;
    t.kind_name = "replicate";
    t.job_id = "job";
    t.step = 5;
    t.ranks = {0};
    t.targets = {to.endpoint};
    a.agent->EnqueueTasks({t});
    return WaitResult(a, id);
  };

  // 1. The 3rd chunk is lost: the task fails, b frees its reservation.
  a.fault->FailNthSend(a.fault->sends(kPutChunk) + 3, kPutChunk);  // chunk 3
  absl::Status failed = replicate("t-fail", b);
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;
  // 2. A chunk is corrupted on the wire: c refuses it (crc), keeps nothing.
  a.fault->CorruptNthSend(a.fault->sends(kPutChunk) + 2, 17, kPutChunk);  // chunk 2
  absl::Status corrupt = replicate("t-corrupt", c);
  EXPECT_EQ(corrupt.code(), absl::StatusCode::kUnavailable) << corrupt;
  EXPECT_THAT(corrupt.message(), HasSubstr("crc32c"));
  EXPECT_TRUE(c.agent->Inventory("job", 5).empty());
  // b let go of the failed push (abandon message) before or after this point.
  {
    absl::Time deadline = absl::Now() + kWait;
    while (b.agent->arena().free_bytes() != b_free && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));  // bounded wait for the other agent's thread
    }
  }
  EXPECT_EQ(b.agent->arena().free_bytes(), b_free);
  EXPECT_TRUE(b.agent->Inventory("job", 5).empty());

  // 3. A read chunk is corrupted on the way to d: DataLoss, nothing kept;
  // the next attempt gets the right bytes.
  a.fault->CorruptNthSend(a.fault->sends(kReadChunk) + 2, 5, kReadChunk);  // read chunk 2
  absl::StatusOr<OpenResult> bad = d.agent->RestoreFromPeer(rec, a.endpoint, 0, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
  EXPECT_TRUE(d.agent->Inventory("job", 5).empty());
  absl::StatusOr<OpenResult> good = d.agent->RestoreFromPeer(rec, a.endpoint, 0, 0);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(Bytes(*d.agent, ShardId{"job", 5, 0}), Content("n0", 0));
  // a's own copy was never touched by any of this.
  EXPECT_EQ(a.agent->Inventory("job", 5)[0].state, CopyState::kValid);

  // 4. The receiver dies mid-push: the sender's task fails promptly
  // (Unavailable), not after the peer timeout.
  // Counted by type: the bad read above may still be sending its last chunks
  // (its reader gave up at the bad one), which would shift a count of all sends.
  a.fault->StallNthSend(a.fault->sends(kPutChunk) + 2, kPutChunk);  // chunk 2
  AgentTask t;
  t.id = "t-dies";
  t.kind = TaskKind::kReplicate;
  t.kind_name = "replicate";
  t.job_id = "job";
  t.step = 5;
  t.ranks = {0};
  t.targets = {b.endpoint};
  a.agent->EnqueueTasks({t});
  {
    absl::Time deadline = absl::Now() + kWait;
    while (a.fault->stalled() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(a.fault->stalled(), 1);
  b.agent->Stop();
  a.fault->Release();
  absl::Status died = WaitResult(a, "t-dies");
  EXPECT_EQ(died.code(), absl::StatusCode::kUnavailable) << died;
}

// Issue 17: pushes and reads are served only to the nodes meta lists as
// members, with the incarnation they state; anyone else who completes the
// data-plane handshake is refused, counted and logged, and nothing is stored.
TEST_F(PeerTest, PushesAndReadsComeOnlyFromMetasMembers) {
  NodeOptions no;
  no.check_membership = true;
  Node& a = AddNode(1, no);
  Node& b = AddNode(1, no);
  Node& c = AddNode(1, no);
  // b's meta does not list a (a stranger with the cluster key, or a node
  // meta never registered); a's and c's list everyone.
  SetMembers(a, 5, {{"n0", 1}, {"n1", 1}, {"n2", 1}});
  SetMembers(b, 5, {{"n1", 1}, {"n2", 1}});
  SetMembers(c, 5, {{"n0", 1}, {"n1", 1}, {"n2", 1}});
  const ShardRecord rec = Save(a, 5, 0, 5000, 1);
  for (auto& n : nodes_) n->agent->Start();
  const ShardId id{"job", 5, 0};

  a.agent->EnqueueTasks({ReplicateTask("t-stranger", 5, 0, {b.endpoint})});
  absl::Status refused = WaitResult(a, "t-stranger");
  EXPECT_FALSE(refused.ok());
  EXPECT_THAT(refused.message(), HasSubstr("\"n0\" is not a member")) << refused;
  EXPECT_TRUE(b.agent->Inventory("job", 5).empty());
  EXPECT_GE(Metric(b, "ckpt_agent_peer_refused_total"), 1);

  // c is glad to take it; then b's meta registers a (a node that joined
  // since b's last heartbeat): b fetches the membership again and takes it.
  a.agent->EnqueueTasks({ReplicateTask("t-member", 5, 0, {c.endpoint})});
  ASSERT_TRUE(WaitResult(a, "t-member").ok());
  SetMembers(b, 6, {{"n0", 1}, {"n1", 1}, {"n2", 1}});
  a.agent->EnqueueTasks({ReplicateTask("t-joined", 5, 0, {b.endpoint})});
  ASSERT_TRUE(WaitResult(a, "t-joined").ok());
  EXPECT_EQ(Bytes(*b.agent, id), Content("n0", 0));

  // Reads: a new node n3 reads the shard. c's meta says n3 restarted
  // (incarnation 2), so n3's reads, stating incarnation 1, are refused
  // there; b's meta lists n3 at 1 and serves them.
  Node& d = AddNode(1, no);
  SetMembers(d, 7, {{"n0", 1}, {"n1", 1}, {"n2", 1}, {"n3", 1}});
  SetMembers(c, 7, {{"n0", 1}, {"n1", 1}, {"n2", 1}, {"n3", 2}});
  SetMembers(b, 7, {{"n0", 1}, {"n1", 1}, {"n2", 1}, {"n3", 1}});
  d.agent->Start();
  absl::StatusOr<OpenResult> stale = d.agent->RestoreFromPeer(rec, c.endpoint, 0, 0);
  ASSERT_FALSE(stale.ok());
  EXPECT_THAT(stale.status().message(), HasSubstr("incarnation 1 is not current")) << stale.status();
  EXPECT_TRUE(d.agent->Inventory("job", 5).empty());
  absl::StatusOr<OpenResult> fine = d.agent->RestoreFromPeer(rec, b.endpoint, 0, 0);
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_EQ(Bytes(*d.agent, id), Content("n0", 0));
  ASSERT_TRUE(d.agent->CloseShard(fine->handle_id).ok());
  // c refused n3's read by name and incarnation.
  EXPECT_GE(Metric(c, "ckpt_agent_peer_refused_total"), 1);
}

}  // namespace
}  // namespace ckpt::agent
