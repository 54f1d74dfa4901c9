// Peer protection across real ckpt-agent processes on 127.0.0.1, over the UCX
// data plane: replicas (ring and group), erasure-coded stripes, restore from
// peers and by decode after kill -9, re-protection, and meta restarting while
// protection is in flight. Every rank's restored bytes are compared with
// what it saved.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <functional>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "ckpt/client.h"
#include "ckpt/v1/meta.grpc.pb.h"
#include "integration/agent_process.h"
#include "integration/cluster_fixture.h"
#include "integration/client_options.h"
#include "integration/meta_process.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using testing::AgentProcess;
using testing::AgentProcessOptions;
using testing::MetaProcess;
using testing::TempDir;

using testing::kLong;
using testing::RankBytes;
using ProtectionTest = testing::ClusterTest;

TEST_F(ProtectionTest, RingReplicasSurviveAKillThenReprotectAndSurviveAnother) {
  StartCluster(4);
  constexpr size_t kBytes = 3 << 20;
  SaveAll("ring", 10, 4, Protection::Replicate(2, Protection::Placement::kRing), kBytes);
  // Ring: node i's copy is on i+1. Read every rank from a node holding none.
  std::vector<ServedFrom> from = LoadAll("ring", 10, 4, kBytes, [&](uint32_t r) {
    return AliveAfter(r, {static_cast<int>(r + 1) % 4});
  });
  for (ServedFrom f : from) EXPECT_EQ(f, ServedFrom::kReplica);

  Kill(1);
  ASSERT_TRUE(WaitDead(1)) << Logs();
  from = LoadAll("ring", 10, 4, kBytes, [&](uint32_t r) { return r == 1 ? 3 : AliveAfter(r); });
  EXPECT_NE(from[1], ServedFrom::kDurable);
  // Re-protection: rank 0 lost its copy on n1, rank 1 its primary; both get
  // new copies on survivors.
  ASSERT_TRUE(WaitState("ring", 10, v1::VERSION_STATE_PROTECTED)) << Logs();
  // n1 comes back (new incarnation, its memory tier intact): its replica of
  // rank 0 was re-protected elsewhere, so meta has it dropped; its primary of
  // rank 1 matches and is adopted again (the rank's own node keeps it).
  ASSERT_TRUE(agents_[1]->Restart().ok()) << Logs();
  alive_[1] = true;
  {
    const absl::Time deadline = absl::Now() + kLong;
    std::string held = "?";
    while (absl::Now() < deadline) {
      v1::GetInventoryRequest req;
      req.set_job_id("ring");
      v1::GetInventoryResponse inv;
      grpc::ClientContext ctx;
      if (agents_[1]->stub()->GetInventory(&ctx, req, &inv).ok()) {
        held.clear();
        for (const auto& e : inv.entries()) absl::StrAppend(&held, e.shard().rank(), ":", e.role(), " ");
        if (held == "1:1 ") break;
      }
      absl::SleepFor(absl::Milliseconds(50));  // bounded poll of a real process
    }
    EXPECT_EQ(held, "1:1 ") << "rank:role of what the restarted node holds\n" << Logs();
  }
  ASSERT_EQ(State("ring", 10), v1::VERSION_STATE_PROTECTED);
  Kill(2);
  ASSERT_TRUE(WaitDead(2)) << Logs();
  LoadAll("ring", 10, 4, kBytes, [&](uint32_t r) { return alive_[r] ? static_cast<int>(r) : AliveAfter(r); });
}

TEST_F(ProtectionTest, AVerifiedLoadOfACorruptLocalCopyIsServedFromTheReplica) {
  // The client checks the local copy itself (no agent pass before it
  // answers); on the mismatch it opens again with the agent verifying, which
  // quarantines the copy and serves the replica: the right bytes, never the
  // flipped one.
  StartCluster(2);
  constexpr size_t kBytes = 6 << 20;  // checked beside the listing (4 MiB or more)
  SaveAll("flip", 1, 2, Protection::Replicate(2, Protection::Placement::kRing), kBytes);
  ASSERT_TRUE(WaitState("flip", 1, v1::VERSION_STATE_PROTECTED)) << Logs();
  {
    // Flip one byte of rank 0's primary in node 0's pool file.
    v1::OpenShardRequest req;
    req.mutable_key()->set_job_id("flip");
    req.mutable_key()->set_step(1);
    req.mutable_key()->set_rank(0);
    req.set_skip_verify(true);
    v1::OpenShardResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(agents_[0]->stub()->OpenShard(&ctx, req, &resp).ok());
    const v1::MemoryRegion& r = resp.regions(0);
    const int fd = ::open(r.path().c_str(), O_RDWR);
    ASSERT_GE(fd, 0) << r.path();
    const off_t at = static_cast<off_t>(r.file_offset_bytes() + std::min<uint64_t>(r.length_bytes() - 1, 12345));
    char b = 0;
    ASSERT_EQ(::pread(fd, &b, 1, at), 1);
    b ^= 0x20;
    ASSERT_EQ(::pwrite(fd, &b, 1, at), 1);
    ::close(fd);
    v1::CloseShardRequest close;
    close.set_handle_id(resp.handle_id());
    v1::CloseShardResponse closed;
    grpc::ClientContext cctx;
    ASSERT_TRUE(agents_[0]->stub()->CloseShard(&cctx, close, &closed).ok());
  }
  // The quarantine makes meta re-protect rank 0 (node 1 pushes its replica
  // back to node 0), which could land between the client's re-open and its
  // open with sources, and serve the repaired copy from node 0 (right bytes,
  // but not the path under test). Protection waits until the load is done.
  for (int i = 0; i < 2; ++i) {
    v1::PauseProtectionRequest req;
    req.set_duration_ms(60'000);
    v1::PauseProtectionResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(agents_[i]->stub()->PauseProtection(&ctx, req, &resp).ok());
  }
  std::vector<ServedFrom> from = LoadAll("flip", 1, 2, kBytes, [](uint32_t r) { return static_cast<int>(r); });
  ASSERT_EQ(from.size(), 2u);
  EXPECT_EQ(from[0], ServedFrom::kReplica) << Logs();
  EXPECT_EQ(from[1], ServedFrom::kLocal);
}

// A holder stopped (SIGSTOP) while meta still counts it alive is the first
// source of a restore: the restoring agent reads the next replica beside it
// after about a second (the hedge: min(1 s, peer timeout / 4)) instead of
// waiting out the peer timeout (60 s here), and the load returns the right
// bytes while the holder is still stopped.
TEST_F(ProtectionTest, ARestoreDoesNotWaitForAStoppedHolder) {
  meta_lease_ms_ = 120'000;  // meta does not notice the stop during the test
  extra_agent_args_ = {"--peer-timeout-ms", "60000"};
  StartCluster(3);
  constexpr size_t kBytes = 8 << 20;
  SaveAll("stall", 1, 3, Protection::Replicate(2, Protection::Placement::kRing), kBytes);
  // Rank 0: primary on n0 (listed first), replica on n1; n2 holds neither.
  ASSERT_EQ(::kill(agents_[0]->proc()->pid(), SIGSTOP), 0);
  const absl::Time t0 = absl::Now();
  // (Ranks 1 and 2 load from their own nodes.)
  std::vector<ServedFrom> from = LoadAll("stall", 1, 3, kBytes, [](uint32_t r) { return r == 0 ? 2 : r; });
  const absl::Duration took = absl::Now() - t0;
  ASSERT_EQ(::kill(agents_[0]->proc()->pid(), SIGCONT), 0);
  std::printf("restore of 3 ranks (8 MiB each, rank 0's first holder stopped): %.0f ms\n",
              absl::ToDoubleMilliseconds(took));
  ASSERT_EQ(from.size(), 3u);
  EXPECT_EQ(from[0], ServedFrom::kReplica);
  EXPECT_LT(took, absl::Seconds(30)) << "the restore waited for the stopped holder\n" << Logs();
  EXPECT_THAT(agents_[2]->proc()->LogTail(), ::testing::HasSubstr("reading the next source beside it")) << Logs();
  EXPECT_EQ(agents_[2]->Metric("ckpt_agent_hedged_restores_total"), 1.0);
}

// The same for a decode: rank 0's node is killed and a survivor of its
// stripes stopped (meta still counts it alive); the decode reads other
// survivors beside the silent one after about a second (the reconstructor's
// hedge) instead of the peer timeout.
TEST_F(ProtectionTest, ADecodeDoesNotWaitForAStoppedSurvivor) {
  meta_lease_ms_ = 120'000;
  extra_agent_args_ = {"--peer-timeout-ms", "60000"};
  StartCluster(5);
  constexpr size_t kBytes = 8 << 20;
  SaveAll("ecstall", 1, 4, Protection::ErasureCode(2, 2), kBytes);
  Kill(0);
  // n1 holds the other data segment of rank 0's stripes (the first survivor
  // a decode reads).
  ASSERT_EQ(::kill(agents_[1]->proc()->pid(), SIGSTOP), 0);
  const absl::Time t0 = absl::Now();
  std::vector<ServedFrom> from =
      LoadAll("ecstall", 1, 4, kBytes, [](uint32_t r) { return r == 0 ? 4 : r == 1 ? 2 : static_cast<int>(r); });
  const absl::Duration took = absl::Now() - t0;
  ASSERT_EQ(::kill(agents_[1]->proc()->pid(), SIGCONT), 0);
  std::printf("restore of 4 ranks (8 MiB each, rank 0 decoded, a survivor stopped): %.0f ms\n",
              absl::ToDoubleMilliseconds(took));
  ASSERT_EQ(from.size(), 4u);
  EXPECT_EQ(from[0], ServedFrom::kEcDecode);
  EXPECT_LT(took, absl::Seconds(30)) << "the decode waited for the stopped survivor\n" << Logs();
  EXPECT_GE(agents_[4]->Metric("ckpt_agent_hedged_reads_total"), 1.0) << Logs();
}

TEST_F(ProtectionTest, GroupReplicasSurviveAKillThenReprotectAndSurviveAnother) {
  StartCluster(4);
  constexpr size_t kBytes = 2 << 20;
  SaveAll("grp", 3, 4, Protection::Replicate(2, Protection::Placement::kGroup), kBytes);
  Kill(0);
  std::vector<ServedFrom> from =
      LoadAll("grp", 3, 4, kBytes, [&](uint32_t r) { return r == 0 ? 2 : static_cast<int>(r); });
  EXPECT_EQ(from[0], ServedFrom::kReplica);
  ASSERT_TRUE(WaitDead(0)) << Logs();
  ASSERT_TRUE(WaitState("grp", 3, v1::VERSION_STATE_PROTECTED)) << Logs();
  Kill(1);
  LoadAll("grp", 3, 4, kBytes, [&](uint32_t r) { return alive_[r] ? static_cast<int>(r) : AliveAfter(r); });
}

TEST_F(ProtectionTest, ErasureCodedStripesSurviveTwoKillsByDecodeAndReprotect) {
  StartCluster(6);
  constexpr size_t kBytes = 2 << 20;
  SaveAll("ec", 7, 6, Protection::ErasureCode(4, 2), kBytes);
  {
    // Every shard copy and every parity segment checks out.
    testing::SubprocessOptions o;
    o.argv = {testing::BinaryPath("ckptctl"), "--meta", meta_->address(), "--json", "verify", "ec", "7"};
    o.name = "ckptctl";
    absl::StatusOr<testing::RunResult> r = testing::RunToCompletion(o, kLong);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->status.success()) << r->stdout_text << r->stderr_text;
    EXPECT_THAT(r->stdout_text, ::testing::HasSubstr("\"segment\": \"g0.s0.p4\""));
    EXPECT_THAT(r->stdout_text, ::testing::HasSubstr("\"problems\": 0"));
  }
  Kill(1);
  Kill(4);
  {
    // An operator restores a dead node's rank with ckptctl: an agent decodes
    // it from the stripes, ckptctl checks every crc and writes it out.
    testing::SubprocessOptions o;
    const std::string out = *dir_->Sub("restored");
    o.argv = {testing::BinaryPath("ckptctl"), "--meta", meta_->address(), "restore", "ec", "7", "--rank", "4",
              "--out", out};
    o.name = "ckptctl";
    absl::StatusOr<testing::RunResult> r = testing::RunToCompletion(o, kLong);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->status.success()) << r->stdout_text << r->stderr_text << Logs();
    EXPECT_THAT(r->stdout_text, ::testing::HasSubstr("(ec decode)"));
    std::ifstream in(out + "/rank-00004.bin", std::ios::binary);
    const std::string got((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::vector<uint8_t> want = RankBytes(4, 7, kBytes + 4 * 4099);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size()), 0);
  }
  std::vector<ServedFrom> from =
      LoadAll("ec", 7, 6, kBytes, [&](uint32_t r) { return alive_[r] ? static_cast<int>(r) : AliveAfter(r); });
  ASSERT_EQ(from.size(), 6u);
  EXPECT_EQ(from[1], ServedFrom::kEcDecode);
  // Rank 4 may come from the copy ckptctl's decode left on a survivor.
  EXPECT_TRUE(from[4] == ServedFrom::kEcDecode || from[4] == ServedFrom::kReplica);
  EXPECT_EQ(from[0], ServedFrom::kLocal);
  ASSERT_TRUE(WaitDead(1) && WaitDead(4)) << Logs();
  // Every segment becomes VALID again, none on a dead node: the lost ones
  // are rebuilt on survivors.
  v1::GetVersionResponse resp;
  auto rebuilt_all = [&] {
    v1::GetVersionRequest req;
    req.set_job_id("ec");
    req.set_step(7);
    grpc::ClientContext ctx;
    resp.Clear();
    if (!meta_->stub()->GetVersion(&ctx, req, &resp).ok()) return false;
    for (const v1::SegmentInfo& seg : resp.version().segments()) {
      if (seg.state() != v1::COPY_STATE_VALID || seg.holder_node_id() == "n1" ||
          seg.holder_node_id() == "n4") {
        return false;
      }
    }
    return true;
  };
  const absl::Time deadline = absl::Now() + kLong;
  while (!rebuilt_all() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));  // bounded poll of real processes
  }
  ASSERT_EQ(resp.version().segments_size(), 6 * 6);
  // Four nodes cannot place a 6-wide stripe so that any two may fail: meta
  // says DEGRADED, not PROTECTED, until nodes join.
  EXPECT_EQ(resp.version().state(), v1::VERSION_STATE_DEGRADED);
  int rebuilt = 0;
  for (const v1::SegmentInfo& seg : resp.version().segments()) {
    EXPECT_EQ(seg.state(), v1::COPY_STATE_VALID) << seg.DebugString();
    EXPECT_NE(seg.holder_node_id(), "n1");
    EXPECT_NE(seg.holder_node_id(), "n4");
    if (seg.kind() == v1::SEGMENT_KIND_DATA && seg.holder_node_id() != seg.owner_node_id()) ++rebuilt;
  }
  EXPECT_GE(rebuilt, 4);  // n1's and n4's data segments (some may be empty)
  std::map<uint32_t, int> on_n0;  // stripe -> segments n0 holds
  for (const v1::SegmentInfo& seg : resp.version().segments())
    if (seg.holder_node_id() == "n0") ++on_n0[seg.key().stripe_index()];
  for (const auto& [stripe, count] : on_n0) EXPECT_LE(count, 2) << "stripe " << stripe << "\n" << resp.DebugString();
  // A third loss: rank 0 now comes back by decoding rebuilt segments.
  Kill(0);
  ASSERT_TRUE(WaitDead(0)) << Logs();
  from = LoadAll("ec", 7, 6, kBytes, [&](uint32_t r) { return r == 0 ? 3 : (alive_[r] ? static_cast<int>(r) : AliveAfter(r)); });
  ASSERT_EQ(from.size(), 6u);
  EXPECT_EQ(from[0], ServedFrom::kEcDecode);
}

// Incremental saves (docs/protocol.md "Incremental saves"): step 2 of every
// rank copies only the item that changed; a frozen item (declared
// unchanged) and an unchanged one (found by hashing) refer to step 1's bytes.
// After a node is killed, every rank of step 2 restores byte-identical
// through other nodes, with each item's step as saved.
class IncrementalProtectionTest : public ProtectionTest {
 protected:
  static constexpr size_t kFrozen = (4 << 20) + 1;  // 4 MiB + 1: past a message boundary
  static constexpr size_t kState = (1 << 20) - 1;

  std::vector<uint8_t> Frozen(uint32_t r) { return RankBytes(r, 0, kFrozen); }
  std::vector<uint8_t> Moment(uint32_t r) { return RankBytes(r, 99, 4096); }
  std::vector<uint8_t> StateBytes(uint32_t r, uint64_t step) { return RankBytes(r, step, kState); }

  // Rank r saves steps 1 (full) and 2 (incremental) on node r, both PROTECTED.
  void SaveTwo(const std::string& job, uint32_t world, Protection protection) {
    protection_ = protection;
    for (uint32_t r = 0; r < world; ++r) {
      ClientOptions o = testing::ClientOptionsFor(*meta_, *agents_[r], job, r, world);
      o.protection = protection;
      o.keep_in_memory = 1;  // step 1 stays only because step 2 refers to it
      absl::StatusOr<Client> c = Client::Connect(o);
      ASSERT_TRUE(c.ok()) << c.status();
      clients_.push_back(*std::move(c));
    }
    const std::vector<std::vector<uint8_t>> frozen = [&] {
      std::vector<std::vector<uint8_t>> v;
      for (uint32_t r = 0; r < world; ++r) v.push_back(Frozen(r));
      return v;
    }();
    for (uint64_t step : {1, 2}) {
      std::vector<SaveHandle> handles;
      for (uint32_t r = 0; r < world; ++r) {
        const std::vector<uint8_t> moment = Moment(r);
        const std::vector<uint8_t> state = StateBytes(r, step);
        SaveBuilder s = clients_[r].BeginSave(step);
        auto bytes = [](const std::vector<uint8_t>& v) { return std::as_bytes(std::span<const uint8_t>(v)); };
        ASSERT_TRUE(s.Add("frozen", bytes(frozen[r]), DType::kU8, {kFrozen}, {}, ItemChange::kUnchanged).ok());
        ASSERT_TRUE(s.Add("moment", bytes(moment), DType::kU8, {4096}, {}, ItemChange::kDetect).ok());
        ASSERT_TRUE(s.Add("state", bytes(state), DType::kU8, {kState}).ok());
        absl::StatusOr<SaveHandle> h = s.Commit();
        ASSERT_TRUE(h.ok()) << h.status();
        // Step 2's shard holds the changed item alone.
        if (step == 2) {
          EXPECT_LT(h->size_bytes(), kState + 4096) << "rank " << r;
        } else {
          EXPECT_GT(h->size_bytes(), kFrozen + kState) << "rank " << r;
        }
        handles.push_back(*h);
      }
      for (SaveHandle& h : handles) {
        absl::Status st = h.Wait(Level::kProtected, absl::Now() + kLong);
        ASSERT_TRUE(st.ok()) << st << "\n" << Logs();
      }
    }
  }

  // Every rank of step 2 through `via(rank)`'s agent: every item
  // byte-identical, with the step it was copied at. Returns where each
  // rank's shard came from.
  std::vector<ServedFrom> LoadStep2(const std::string& job, uint32_t world, const std::function<int(uint32_t)>& via) {
    std::vector<ServedFrom> from;
    for (uint32_t r = 0; r < world; ++r) {
      const int node = via(r);
      ClientOptions o = testing::ClientOptionsFor(*meta_, *agents_[node], job, r, world);
      absl::StatusOr<Client> c = Client::Connect(o);
      EXPECT_TRUE(c.ok()) << c.status();
      if (!c.ok()) return from;
      absl::StatusOr<LoadedShard> shard = c->Load(2);
      EXPECT_TRUE(shard.ok()) << "rank " << r << " via n" << node << ": " << shard.status() << "\n" << Logs();
      if (!shard.ok()) return from;
      const std::map<std::string, std::pair<std::vector<uint8_t>, uint64_t>> want = {
          {"frozen", {Frozen(r), 1}}, {"moment", {Moment(r), 1}}, {"state", {StateBytes(r, 2), 2}}};
      EXPECT_EQ(shard->items().size(), want.size());
      for (const auto& [name, expect] : want) {
        const LoadedItem* item = shard->Find(name);
        EXPECT_NE(item, nullptr) << name;
        if (item == nullptr) continue;
        EXPECT_EQ(item->step, expect.second) << "rank " << r << " " << name;
        absl::StatusOr<std::span<const std::byte>> view = shard->View(name);
        EXPECT_TRUE(view.ok()) << view.status();
        if (!view.ok()) continue;
        EXPECT_EQ(view->size(), expect.first.size()) << "rank " << r << " " << name;
        EXPECT_EQ(std::memcmp(view->data(), expect.first.data(), std::min(view->size(), expect.first.size())), 0)
            << "rank " << r << " " << name;
        // The copy path reads the same bytes (and checks their crc).
        std::vector<uint8_t> copy(expect.first.size());
        EXPECT_TRUE(c->LoadInto(2, {{name, std::as_writable_bytes(std::span<uint8_t>(copy))}}).ok()) << name;
        EXPECT_EQ(copy, expect.first) << "rank " << r << " " << name;
      }
      from.push_back(shard->served_from());
    }
    return from;
  }
};

TEST_F(IncrementalProtectionTest, IncrementalVersionsOfReplicasRestoreByteIdenticalAfterAKill) {
  StartCluster(4);
  SaveTwo("inc-rep", 4, Protection::Replicate(2, Protection::Placement::kRing));
  // keep_in_memory=1, step 2 PROTECTED: step 1 stays (step 2 refers to it).
  EXPECT_EQ(State("inc-rep", 1), v1::VERSION_STATE_PROTECTED);
  Kill(1);
  ASSERT_TRUE(WaitDead(1)) << Logs();
  // Ring: rank 1's replica is on n2; read it through n3, which holds none.
  std::vector<ServedFrom> from = LoadStep2("inc-rep", 4, [&](uint32_t r) { return r == 1 ? 3 : static_cast<int>(r); });
  ASSERT_EQ(from.size(), 4u);
  EXPECT_EQ(from[1], ServedFrom::kReplica);
  EXPECT_EQ(from[0], ServedFrom::kLocal);
}

TEST_F(IncrementalProtectionTest, IncrementalVersionsOfErasureCodedStripesRestoreByDecodeAfterAKill) {
  StartCluster(4);
  SaveTwo("inc-ec", 4, Protection::ErasureCode(3, 1));
  EXPECT_EQ(State("inc-ec", 1), v1::VERSION_STATE_PROTECTED);
  Kill(2);
  ASSERT_TRUE(WaitDead(2)) << Logs();
  std::vector<ServedFrom> from =
      LoadStep2("inc-ec", 4, [&](uint32_t r) { return alive_[r] ? static_cast<int>(r) : AliveAfter(r); });
  ASSERT_EQ(from.size(), 4u);
  EXPECT_EQ(from[2], ServedFrom::kEcDecode);
}

TEST_F(ProtectionTest, MetaRestartWhileProtectingStillCompletes) {
  StartCluster(3);
  constexpr size_t kBytes = 8 << 20;
  std::vector<SaveHandle> handles;
  for (uint32_t r = 0; r < 3; ++r) {
    ClientOptions o = testing::ClientOptionsFor(*meta_, *agents_[r], "mr", r, 3);
    o.protection = protection_ = Protection::Replicate(3, Protection::Placement::kRing);
    absl::StatusOr<Client> c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    const std::vector<uint8_t> data = RankBytes(r, 1, kBytes + r * 4099);
    SaveBuilder s = c->BeginSave(1);
    ASSERT_TRUE(s.Add("state", std::as_bytes(std::span<const uint8_t>(data)), DType::kU8, {data.size()}).ok());
    absl::StatusOr<SaveHandle> h = s.Commit();
    ASSERT_TRUE(h.ok()) << h.status();
    handles.push_back(*h);
    clients_.push_back(*std::move(c));
  }
  ASSERT_TRUE(meta_->proc()->Kill().ok());
  (void)meta_->proc()->Wait();
  ASSERT_TRUE(meta_->Restart().ok());
  for (SaveHandle& h : handles) {
    absl::Status st = h.Wait(Level::kProtected, absl::Now() + kLong);
    ASSERT_TRUE(st.ok()) << st << "\n" << Logs();
  }
  Kill(0);
  LoadAll("mr", 1, 3, kBytes, [&](uint32_t r) { return r == 0 ? 1 : static_cast<int>(r); });
}

}  // namespace
}  // namespace ckpt
