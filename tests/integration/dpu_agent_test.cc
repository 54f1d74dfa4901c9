// ckpt-dpu-agent (issue 14, docs/dpu.md) as real processes on 127.0.0.1: a
// mixed cluster of host agents (push) and DPU agents (pull-mode ingest over
// UCX one-sided gets, here shared-memory RMA); a DPU agent killed and its
// shards restored from peers, restarted and re-adopting its tier; erasure
// coding across DPU agents; a client that dies with its commit unpulled,
// and malformed pull sources. Every restored byte is compared with what was
// saved; shard sizes straddle 4 MiB message boundaries.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "ckpt/client.h"
#include "ckpt/v1/agent.grpc.pb.h"
#include "client/pull_staging.h"
#include "common/crc32c.h"
#include "integration/cluster_fixture.h"
#include "support/process.h"

namespace ckpt {
namespace {

using testing::kLong;
class DpuAgentTest : public testing::ClusterTest {
 protected:
  std::set<uint32_t> HeldRanks(int node, const std::string& job);
  void CreateJob(const std::string& job);
  // A staging lease of `size` bytes for step `step` of `job` (world size 1)
  // from DPU agent `dpu`: (lease id, pull token).
  std::pair<std::string, std::string> Lease(testing::AgentProcess& dpu, const std::string& job, uint64_t step,
                                            uint64_t size);
  // Commits the lease as one u8 item of `size` bytes with crc32c `crc`,
  // pulled from `src` (none if null).
  grpc::Status Commit(testing::AgentProcess& dpu, const std::string& lease_id, uint64_t size, uint32_t crc,
                      const v1::PullSource* src);
  // A stand-in trainer (dpu_staging_helper) whose staging memory holds
  // `token` and `size` bytes of 'x'; `src` names that memory.
  std::unique_ptr<testing::Subprocess> StartTrainer(const std::string& token, uint64_t size, v1::PullSource* src);
  v1::AgentStatusResponse Status(testing::AgentProcess& a);
};

// The ranks of `job` a node holds copies of.
std::set<uint32_t> HeldRanksOf(testing::AgentProcess& a, const std::string& job) {
  v1::GetInventoryRequest req;
  req.set_job_id(job);
  v1::GetInventoryResponse inv;
  grpc::ClientContext ctx;
  std::set<uint32_t> out;
  if (!a.stub()->GetInventory(&ctx, req, &inv).ok()) return out;
  for (const auto& e : inv.entries()) out.insert(e.shard().rank());
  return out;
}

// 4 MiB +- 1 byte around the data plane's message boundaries (1 MiB chunks).
constexpr size_t kBytes = (size_t{4} << 20) + 1;

std::set<uint32_t> DpuAgentTest::HeldRanks(int node, const std::string& job) {
  return HeldRanksOf(*agents_[node], job);
}

void DpuAgentTest::CreateJob(const std::string& job) {
  v1::CreateJobRequest req;
  req.mutable_spec()->set_job_id(job);
  req.mutable_spec()->set_world_size(1);
  v1::CreateJobResponse resp;
  grpc::ClientContext ctx;
  grpc::Status s = meta_->stub()->CreateJob(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
}

std::pair<std::string, std::string> DpuAgentTest::Lease(testing::AgentProcess& dpu, const std::string& job,
                                                        uint64_t step, uint64_t size) {
  v1::AcquireStagingLeaseRequest req;
  req.set_job_id(job);
  req.set_step(step);
  req.set_size_bytes(size);
  v1::AcquireStagingLeaseResponse resp;
  grpc::ClientContext ctx;
  grpc::Status s = dpu.stub()->AcquireStagingLease(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(resp.pull());
  EXPECT_EQ(resp.regions_size(), 0);
  EXPECT_EQ(resp.pull_token().size(), 32u);  // HMAC-SHA256
  return std::make_pair(resp.lease_id(), resp.pull_token());
}

grpc::Status DpuAgentTest::Commit(testing::AgentProcess& dpu, const std::string& lease_id, uint64_t size,
                                  uint32_t crc, const v1::PullSource* src) {
  v1::CommitShardRequest req;
  req.set_lease_id(lease_id);
  v1::Item* item = req.add_items();
  item->set_name("w");
  item->set_dtype(v1::DTYPE_U8);
  item->add_shape(size);
  item->set_length_bytes(size);
  item->set_crc32c(crc);
  if (src != nullptr) *req.mutable_pull_source() = *src;
  v1::CommitShardResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return dpu.stub()->CommitShard(&ctx, req, &resp);
}

std::unique_ptr<testing::Subprocess> DpuAgentTest::StartTrainer(const std::string& token, uint64_t size,
                                                                v1::PullSource* src) {
  const std::string out = dir_->path() + "/staging-" + absl::BytesToHexString(token) + ".pb";
  testing::SubprocessOptions helper;
  helper.argv = {testing::BinaryPath("dpu_staging_helper"), out, absl::BytesToHexString(token), absl::StrCat(size)};
  helper.log_dir = dir_->path();
  absl::StatusOr<std::unique_ptr<testing::Subprocess>> child = testing::Subprocess::Start(helper);
  EXPECT_TRUE(child.ok()) << child.status();
  if (!child.ok()) return nullptr;
  std::string wire;
  for (const absl::Time until = absl::Now() + kLong; absl::Now() < until;) {
    std::ifstream f(out, std::ios::binary);
    if (f.good()) {
      wire.assign(std::istreambuf_iterator<char>(f), {});
      break;
    }
    absl::SleepFor(absl::Milliseconds(10));  // bounded poll of a real process
  }
  EXPECT_FALSE(wire.empty()) << (*child)->LogTail();
  EXPECT_TRUE(src->ParseFromString(wire));
  return *std::move(child);
}

v1::AgentStatusResponse DpuAgentTest::Status(testing::AgentProcess& a) {
  v1::AgentStatusResponse st;
  grpc::ClientContext ctx;
  grpc::Status s = a.stub()->AgentStatus(&ctx, {}, &st);
  EXPECT_TRUE(s.ok()) << s.error_message() << "\n" << Logs();
  return st;
}

TEST_F(DpuAgentTest, MixedClusterPullsProtectsAndRestoresAfterADpuAgentDiesAndOneRestarts) {
  // n2 is the DPU of host n0 and n3 of n1: two machines, two failure domains.
  StartCluster(4, "96MiB", /*dpu=*/{{2, "n0"}, {3, "n1"}});
  {
    // Meta knows the DPU agents as such, each with its host.
    v1::ListNodesResponse nodes;
    grpc::ClientContext ctx;
    ASSERT_TRUE(meta_->stub()->ListNodes(&ctx, {}, &nodes).ok());
    std::vector<std::string> seen;
    for (const auto& n : nodes.nodes()) {
      seen.push_back(absl::StrCat(n.endpoint().node_id(), ":", v1::NodeRole_Name(n.role()), ":", n.host_node_id()));
    }
    EXPECT_THAT(seen, ::testing::ElementsAre("n0:NODE_ROLE_HOST:", "n1:NODE_ROLE_HOST:", "n2:NODE_ROLE_DPU:n0",
                                             "n3:NODE_ROLE_DPU:n1"));
  }
  SaveAll("mixed", 5, 4, Protection::Replicate(2, Protection::Placement::kRing), kBytes);
  // The DPU agents pulled their ranks' bytes; the host agents pulled nothing.
  EXPECT_EQ(agents_[0]->Metric("ckpt_agent_pulled_bytes_total"), 0);
  EXPECT_EQ(agents_[1]->Metric("ckpt_agent_pulled_bytes_total"), 0);
  EXPECT_GE(agents_[2]->Metric("ckpt_agent_pulled_bytes_total"), static_cast<double>(kBytes + 2 * 4099));
  EXPECT_GE(agents_[3]->Metric("ckpt_agent_pulled_bytes_total"), static_cast<double>(kBytes + 3 * 4099));
  EXPECT_EQ(agents_[2]->Metric("ckpt_agent_pull_errors_total"), 0);
  // Placement keeps each replica off the machine of its primary: rank 0's
  // copy is not on n2 (n0's DPU), nor rank 2's on n0, and so on.
  for (int node = 0; node < 4; ++node) {
    const int same_machine = (node + 2) % 4;
    EXPECT_FALSE(HeldRanks(node, "mixed").count(same_machine))
        << "n" << node << " holds a copy of rank " << same_machine << ", whose primary is on the same machine";
  }
  std::vector<ServedFrom> from = LoadAll("mixed", 5, 4, kBytes, [](uint32_t r) { return static_cast<int>(r); });
  for (ServedFrom f : from) EXPECT_EQ(f, ServedFrom::kLocal);
  // The DPU agents wrote their restores into the clients' staging memory
  // (one-sided puts); the host agents handed out regions to map.
  EXPECT_GE(agents_[2]->Metric("ckpt_agent_delivered_bytes_total"), static_cast<double>(kBytes + 2 * 4099));
  EXPECT_EQ(agents_[0]->Metric("ckpt_agent_delivered_bytes_total"), 0);

  // kill -9 of DPU agent n3 and an immediate restart: it re-adopts its tier.
  ASSERT_TRUE(agents_[3]->proc()->Kill().ok());
  (void)agents_[3]->proc()->Wait();
  ASSERT_TRUE(agents_[3]->Restart().ok()) << Logs();
  from = LoadAll("mixed", 5, 4, kBytes, [](uint32_t r) { return r == 3 ? 3 : static_cast<int>(r); });
  ASSERT_EQ(from.size(), 4u);
  EXPECT_EQ(from[3], ServedFrom::kLocal) << "the restarted DPU agent re-adopted rank 3's shard\n" << Logs();

  // DPU agent n2 dies for good: rank 2 comes back from its replica on n3,
  // read through n0 (which held none: same machine; by the time meta has
  // declared n2 dead it may have re-protected rank 2 onto n0).
  Kill(2);
  ASSERT_TRUE(WaitDead(2)) << Logs();
  from = LoadAll("mixed", 5, 4, kBytes, [](uint32_t r) { return r == 2 ? 0 : static_cast<int>(r); });
  ASSERT_EQ(from.size(), 4u);
  EXPECT_THAT(from[2], ::testing::AnyOf(ServedFrom::kReplica, ServedFrom::kLocal));
  ASSERT_TRUE(WaitState("mixed", 5, v1::VERSION_STATE_PROTECTED)) << Logs();
}

TEST_F(DpuAgentTest, ErasureCodedStripesAcrossDpuAgentsSurviveTwoKillsByDecode) {
  StartCluster(4, "96MiB", /*dpu=*/{{0, "h0"}, {1, "h1"}, {2, "h2"}, {3, "h3"}});
  SaveAll("dpu-ec", 9, 4, Protection::ErasureCode(2, 2), kBytes - 1);
  Kill(1);
  Kill(3);
  std::vector<ServedFrom> from = LoadAll("dpu-ec", 9, 4, kBytes - 1, [](uint32_t r) { return r % 2 == 0 ? r : r - 1; });
  ASSERT_EQ(from.size(), 4u);
  EXPECT_EQ(from[1], ServedFrom::kEcDecode);
  EXPECT_EQ(from[3], ServedFrom::kEcDecode);
}

TEST_F(DpuAgentTest, AClientThatDiesBeforeItsPullAndBadPullSourcesLoseNothing) {
  StartCluster(1, "64MiB", /*dpu=*/{{0, "h0"}});
  testing::AgentProcess& dpu = *agents_[0];
  CreateJob("gone");
  const std::string bytes(size_t{4} << 20, 'x');
  const uint32_t crc = Crc32c(bytes.data(), bytes.size());
  auto lease = [&](uint64_t step) { return Lease(dpu, "gone", step, bytes.size()); };
  auto commit = [&](const std::string& lease_id, const v1::PullSource* src) {
    return Commit(dpu, lease_id, bytes.size(), crc, src);
  };

  // A commit without a pull source, and ones naming garbage: clear errors.
  const auto [l1, token1] = lease(1);
  grpc::Status s = commit(l1, nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("pull_source"));
  v1::PullSource empty;
  EXPECT_EQ(commit(l1, &empty).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // A client that registered its staging memory and died before the agent
  // read it: the commit fails UNAVAILABLE, the lease stays open and aborts.
  // A stand-in trainer process: its staging memory holds l1's token and
  // the shard; it says where in a file.
  v1::PullSource src;
  std::unique_ptr<testing::Subprocess> child = StartTrainer(token1, bytes.size(), &src);
  ASSERT_NE(child, nullptr);
  {
    // Live memory of another lease (or process): its header does not hold
    // this lease's token, and nothing of it is read.
    const auto [l2, token2] = lease(2);
    s = commit(l2, &src);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("pull token"));
    v1::AbortLeaseRequest req;
    req.set_lease_id(l2);
    v1::AbortLeaseResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(dpu.stub()->AbortLease(&ctx, req, &resp).ok());
  }
  {
    v1::PullSource short_src = src;
    short_src.set_length_bytes(client::kPullHeaderBytes + bytes.size() - 1);
    s = commit(l1, &short_src);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }
  {
    // Garbage where UCX expects a worker address or a packed rkey: refused,
    // and the agent lives on (checked below).
    std::mt19937_64 rng(14);
    auto garbage = [&rng](size_t n) {
      std::string g(n, '\0');
      for (char& c : g) c = static_cast<char>(rng());
      return g;
    };
    for (int round = 0; round < 4; ++round) {
      v1::PullSource bad = src;
      if (round % 2 == 0) bad.set_rkey(garbage(src.rkey().size()));
      if (round >= 1) bad.set_worker_address(garbage(src.worker_address().size()));
      s = commit(l1, &bad);
      EXPECT_FALSE(s.ok()) << "round " << round;
    }
  }
  ASSERT_TRUE(child->Kill().ok());
  (void)child->Wait();
  s = commit(l1, &src);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  {
    v1::AbortLeaseRequest req;
    req.set_lease_id(l1);
    v1::AbortLeaseResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(dpu.stub()->AbortLease(&ctx, req, &resp).ok());
  }
  v1::AgentStatusResponse st;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(dpu.stub()->AgentStatus(&ctx, {}, &st).ok()) << "the DPU agent survived\n" << Logs();
  }
  EXPECT_EQ(st.open_leases(), 0u);
  EXPECT_EQ(st.holdings_size(), 0);
  EXPECT_GE(dpu.Metric("ckpt_agent_pull_errors_total"), 1);

  // The agent still takes a real save, byte for byte, at a boundary size.
  SaveAll("after", 2, 1, Protection::None(), kBytes + 1);
  LoadAll("after", 2, 1, kBytes + 1, [](uint32_t) { return 0; });

  // Restores the other way: OpenShard gives a token instead of regions, and
  // DeliverShard writes only into memory that holds it.
  v1::OpenShardRequest open;
  open.mutable_key()->set_job_id("after");
  open.mutable_key()->set_step(2);
  open.mutable_key()->set_rank(0);
  v1::OpenShardResponse opened;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(dpu.stub()->OpenShard(&ctx, open, &opened).ok());
  }
  EXPECT_TRUE(opened.deliver());
  EXPECT_EQ(opened.regions_size(), 0);
  const uint64_t size = opened.shard().size_bytes();
  absl::StatusOr<std::shared_ptr<client::PullStaging>> staging = client::PullStaging::Create();
  ASSERT_TRUE(staging.ok()) << staging.status();
  absl::StatusOr<std::shared_ptr<client::PullStaging::Buffer>> buf =
      (*staging)->Acquire(client::kPullHeaderBytes + size);
  ASSERT_TRUE(buf.ok()) << buf.status();
  std::memset((*buf)->data(), 0, client::kPullHeaderBytes + size);
  auto deliver = [&](const std::string& handle) {
    v1::DeliverShardRequest req;
    req.set_handle_id(handle);
    req.mutable_target()->set_worker_address((*buf)->worker_address());
    req.mutable_target()->set_rkey((*buf)->rkey());
    req.mutable_target()->set_address(reinterpret_cast<uint64_t>((*buf)->data()));
    req.mutable_target()->set_length_bytes((*buf)->length());
    v1::DeliverShardResponse resp;
    grpc::ClientContext ctx;
    return dpu.stub()->DeliverShard(&ctx, req, &resp);
  };
  s = deliver(opened.handle_id());  // the header does not hold the token
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_EQ(std::count((*buf)->data(), (*buf)->data() + client::kPullHeaderBytes + size, std::byte{0}),
            static_cast<ptrdiff_t>(client::kPullHeaderBytes + size))
      << "nothing was written";
  EXPECT_EQ(deliver("no-such-handle").error_code(), grpc::StatusCode::NOT_FOUND);
  std::memcpy((*buf)->data(), opened.deliver_token().data(), opened.deliver_token().size());
  s = deliver(opened.handle_id());
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(Crc32c((*buf)->data() + client::kPullHeaderBytes, size), opened.shard().crc32c());
}

// A trainer stopped (SIGSTOP) while the DPU agent pulls its shard, over a
// transport whose one-sided reads need the trainer's side to move (UCX's
// tcp: software gets), then killed while stopped: the commit answers
// UNAVAILABLE by --peer-timeout-ms, not when the trainer moves; the lease
// aborts; every byte the pull held is free again once the trainer is gone;
// the agent then takes a real save. (Over shared memory, and RDMA on a real
// DPU, the reads need nothing of the trainer: only such a transport stalls.)
TEST_F(DpuAgentTest, ATrainerStoppedMidPullTimesOutAndItsMemoryIsFreedWhenItDies) {
  ASSERT_EQ(::setenv("UCX_TLS", "tcp", 1), 0);  // the daemons and the trainer inherit it
  struct Unset {
    ~Unset() { ::unsetenv("UCX_TLS"); }
  } unset;
  extra_agent_args_ = {"--peer-timeout-ms", "2000"};
  StartCluster(1, "128MiB", /*dpu=*/{{0, "h0"}});
  testing::AgentProcess& dpu = *agents_[0];
  CreateJob("stall");
  const uint64_t used0 = Status(dpu).memory_used_bytes();
  const uint64_t size = uint64_t{32} << 20;
  const std::string bytes(size, 'x');
  const uint32_t crc = Crc32c(bytes.data(), bytes.size());
  const auto [lease_id, token] = Lease(dpu, "stall", 1, size);
  v1::PullSource src;
  std::unique_ptr<testing::Subprocess> trainer = StartTrainer(token, size, &src);
  ASSERT_NE(trainer, nullptr);
  ASSERT_EQ(::kill(trainer->pid(), SIGSTOP), 0);
  const absl::Time t0 = absl::Now();
  grpc::Status s = Commit(dpu, lease_id, size, crc, &src);
  const absl::Duration took = absl::Now() - t0;
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_LT(took, absl::Seconds(30)) << "the commit waited for the stopped trainer";
  {
    v1::AbortLeaseRequest req;
    req.set_lease_id(lease_id);
    v1::AbortLeaseResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(dpu.stub()->AbortLease(&ctx, req, &resp).ok());
  }
  // While the trainer stays stopped its reads stay in flight, and the memory
  // they write into stays reserved (UCX 1.13 cancels nothing on an endpoint
  // without peer-failure handling, which shared-memory reads need:
  // docs/dpu.md); the trainer's death ends them.
  ASSERT_TRUE(trainer->Kill().ok());  // SIGKILL ends a stopped process too
  (void)trainer->Wait();
  v1::AgentStatusResponse st = Status(dpu);
  for (const absl::Time until = absl::Now() + kLong;
       absl::Now() < until && (st.memory_used_bytes() != used0 || st.memory_leased_bytes() != 0);) {
    absl::SleepFor(absl::Milliseconds(100));  // bounded poll of a real process
    st = Status(dpu);
  }
  EXPECT_EQ(st.memory_used_bytes(), used0) << "the stalled pull's memory was not freed\n" << Logs();
  EXPECT_EQ(st.memory_leased_bytes(), 0u);
  EXPECT_EQ(st.open_leases(), 0u);
  EXPECT_EQ(st.holdings_size(), 0);
  EXPECT_GE(dpu.Metric("ckpt_agent_pull_errors_total"), 1);
  // A real save and load through the same agent and transport.
  SaveAll("after", 2, 1, Protection::None(), kBytes);
  LoadAll("after", 2, 1, kBytes, [](uint32_t) { return 0; });
}

}  // namespace
}  // namespace ckpt
