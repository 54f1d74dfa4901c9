// ckpt-meta as a real process: gRPC from a test client, kill -9 right after
// acknowledged transitions, restart on the same data dir, bad input, health
// and metrics endpoints, clean shutdown.
#include <gtest/gtest.h>

#include <csignal>
#include <tuple>

#include "integration/meta_process.h"
#include "support/temp_dir.h"

namespace ckpt::testing {
namespace {

using grpc::ClientContext;
using grpc::StatusCode;
namespace v1 = ::ckpt::v1;

class MetaIntegration : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = TempDir::Create();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::make_unique<TempDir>(std::move(*dir));
    auto data = dir_->Sub("meta-data");
    auto logs = dir_->Sub("logs");
    ASSERT_TRUE(data.ok() && logs.ok());
    auto meta = MetaProcess::Start(*data, *logs);
    ASSERT_TRUE(meta.ok()) << meta.status();
    meta_ = std::move(*meta);
  }

  void TearDown() override {
    if (HasFailure() && meta_ != nullptr) {
      std::fprintf(stderr, "ckpt-meta log tail:\n%s\n", meta_->proc()->LogTail(8192).c_str());
    }
  }

  v1::MetaService::Stub* stub() { return meta_->stub(); }

  static std::unique_ptr<ClientContext> Ctx() {
    auto c = std::make_unique<ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    return c;
  }

  uint64_t Register(const std::string& id, const std::string& addr_suffix = "") {
    v1::RegisterNodeRequest req;
    req.set_node_id(id);
    req.set_grpc_address("127.0.0.1:1" + addr_suffix);
    req.set_data_address("127.0.0.1:2" + addr_suffix);
    req.set_role(v1::NODE_ROLE_HOST);
    req.set_memory_capacity_bytes(1 << 30);
    v1::RegisterNodeResponse resp;
    auto st = meta_->NodeStub(id)->RegisterNode(Ctx().get(), req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    inc_[id] = resp.incarnation();
    return resp.incarnation();
  }

  grpc::Status CreateJob(const std::string& id, uint32_t world, bool replicate = true) {
    v1::CreateJobRequest req;
    req.mutable_spec()->set_job_id(id);
    req.mutable_spec()->set_world_size(world);
    req.mutable_spec()->mutable_retention()->set_keep_in_memory(10);
    if (replicate) {
      req.mutable_spec()->mutable_protection()->mutable_replicate()->set_copies(2);
      req.mutable_spec()->mutable_protection()->mutable_replicate()->set_placement(
          v1::REPLICA_PLACEMENT_RING);
    } else {
      req.mutable_spec()->mutable_protection()->mutable_none();
    }
    v1::CreateJobResponse resp;
    return stub()->CreateJob(Ctx().get(), req, &resp);
  }

  grpc::Status Begin(const std::string& job, uint64_t step) {
    v1::BeginVersionRequest req;
    req.set_job_id(job);
    req.set_step(step);
    v1::BeginVersionResponse resp;
    return meta_->NodeStub("node-a")->BeginVersion(Ctx().get(), req, &resp);  // agents begin versions
  }

  // One report; returns the entry's code (or the call's).
  int Report(const std::string& node, v1::ShardReport report) {
    v1::ReportShardsRequest req;
    req.set_node_id(node);
    req.set_incarnation(inc_[node]);
    *req.add_reports() = std::move(report);
    v1::ReportShardsResponse resp;
    auto st = meta_->NodeStub(node)->ReportShards(Ctx().get(), req, &resp);
    if (!st.ok()) return st.error_code();
    return resp.results(0).code();
  }

  static v1::ShardReport Staged(const std::string& job, uint64_t step, uint32_t rank) {
    v1::ShardReport r;
    auto* s = r.mutable_staged()->mutable_shard();
    s->mutable_key()->set_job_id(job);
    s->mutable_key()->set_step(step);
    s->mutable_key()->set_rank(rank);
    s->set_size_bytes(1024);
    s->set_crc32c(0xC0FFEE00 + rank);
    s->set_manifest_digest(rank + 1);
    auto* item = s->add_items();
    item->set_name("weights");
    item->set_dtype(v1::DTYPE_F32);
    item->add_shape(256);
    item->set_length_bytes(1024);
    item->set_crc32c(0xC0FFEE00 + rank);
    return r;
  }

  static v1::ShardReport Replica(const std::string& job, uint64_t step, uint32_t rank) {
    v1::ShardReport r;
    auto* c = r.mutable_copy();
    c->mutable_key()->set_job_id(job);
    c->mutable_key()->set_step(step);
    c->mutable_key()->set_rank(rank);
    c->set_role(v1::COPY_ROLE_REPLICA);
    c->set_state(v1::COPY_STATE_VALID);
    c->set_size_bytes(1024);
    c->set_crc32c(0xC0FFEE00 + rank);
    return r;
  }

  v1::VersionInfo GetVersion(const std::string& job, uint64_t step, grpc::Status* st = nullptr) {
    v1::GetVersionRequest req;
    req.set_job_id(job);
    req.set_step(step);
    v1::GetVersionResponse resp;
    auto s = stub()->GetVersion(Ctx().get(), req, &resp);
    if (st != nullptr) *st = s;
    return resp.version();
  }

  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<MetaProcess> meta_;
  std::map<std::string, uint64_t> inc_;
};

TEST_F(MetaIntegration, AcknowledgedTransitionsSurviveKill9) {
  const std::vector<std::string> nodes = {"node-a", "node-b", "node-c", "node-d"};
  for (const auto& n : nodes) Register(n);
  ASSERT_TRUE(CreateJob("gpt", 4).ok());
  for (int cycle = 0; cycle < 3; ++cycle) {
    const uint64_t step = 100 + cycle;
    ASSERT_TRUE(Begin("gpt", step).ok());
    for (uint32_t r = 0; r < 4; ++r) {
      ASSERT_EQ(Report(nodes[r], Staged("gpt", step, r)), 0) << "rank " << r;
    }
    // Ring: node i's blob goes to node i+1 (plan order is by id here).
    for (uint32_t r = 0; r < 4; ++r) {
      ASSERT_EQ(Report(nodes[(r + 1) % 4], Replica("gpt", step, r)), 0) << "rank " << r;
    }
    EXPECT_EQ(GetVersion("gpt", step).state(), v1::VERSION_STATE_PROTECTED);
    // kill -9 right after the acknowledgement, restart on the same data dir.
    ASSERT_TRUE(meta_->proc()->Kill(SIGKILL).ok());
    ASSERT_TRUE(meta_->proc()->Wait().ok());
    ASSERT_TRUE(meta_->Restart().ok());
    for (uint64_t s = 100; s <= step; ++s) {
      grpc::Status st;
      const v1::VersionInfo v = GetVersion("gpt", s, &st);
      ASSERT_TRUE(st.ok()) << st.error_message();
      EXPECT_EQ(v.state(), v1::VERSION_STATE_PROTECTED) << "step " << s;
      ASSERT_EQ(v.shards_size(), 4);
      for (const auto& sh : v.shards()) EXPECT_EQ(sh.copies_size(), 2);
    }
    // Agents re-register after a meta restart: incarnations only grow.
    for (const auto& n : nodes) {
      const uint64_t before = inc_[n];
      EXPECT_GT(Register(n), before);
    }
  }
  v1::LatestRequest lreq;
  lreq.set_job_id("gpt");
  lreq.set_min_level(v1::DURABILITY_LEVEL_PROTECTED);
  v1::LatestResponse lresp;
  ASSERT_TRUE(stub()->Latest(Ctx().get(), lreq, &lresp).ok());
  EXPECT_EQ(lresp.version().step(), 102u);
}

TEST_F(MetaIntegration, BadInputGetsClearErrors) {
  Register("node-a");
  for (const char* bad : {"", "../etc", "a/b", "Caps", ".hidden"}) {
    auto st = CreateJob(bad, 1, false);
    EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT) << bad;
  }
  auto st = CreateJob(std::string(64, 'x'), 1, false);
  EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT);
  st = CreateJob("zero", 0, false);
  EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("world size"), std::string::npos) << st.error_message();
  st = CreateJob("huge", 4'000'000'000u, false);
  EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT);

  EXPECT_EQ(Begin("no-such-job", 1).error_code(), StatusCode::NOT_FOUND);
  ASSERT_TRUE(CreateJob("ok", 1, false).ok());
  ASSERT_TRUE(Begin("ok", 10).ok());
  // An OPEN newer version does not refuse a lower step; a staged one does.
  EXPECT_TRUE(Begin("ok", 7).ok());
  ASSERT_EQ(Report("node-a", Staged("ok", 10, 0)), 0);
  st = Begin("ok", 5);
  EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("steps must increase"), std::string::npos);
  // Steps stop at 2^53-1.
  st = Begin("ok", ~uint64_t{0});
  EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("9007199254740991"), std::string::npos) << st.error_message();
  grpc::Status gst;
  GetVersion("ok", 11, &gst);
  EXPECT_EQ(gst.error_code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(Report("node-a", Staged("ok", 10, 5)), StatusCode::INVALID_ARGUMENT);  // rank

  // Same node id, different address, lease still valid.
  v1::RegisterNodeRequest req;
  req.set_node_id("node-a");
  req.set_grpc_address("127.0.0.9:1");
  req.set_data_address("127.0.0.9:2");
  req.set_role(v1::NODE_ROLE_HOST);
  v1::RegisterNodeResponse resp;
  st = meta_->NodeStub("node-a")->RegisterNode(Ctx().get(), req, &resp);
  EXPECT_EQ(st.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(st.error_message().find("127.0.0.1:1"), std::string::npos) << st.error_message();
  // A DPU agent must name the host it serves (a node id, not its own); a
  // host agent names none.
  req.set_node_id("dpu-a");
  for (const auto& [role, host, why] : std::vector<std::tuple<v1::NodeRole, std::string, std::string>>{
           {v1::NODE_ROLE_DPU, "", "must name the host"},
           {v1::NODE_ROLE_DPU, "dpu-a", "of its own"},
           {v1::NODE_ROLE_DPU, "../etc", "host_node_id"},
           {v1::NODE_ROLE_HOST, "node-a", "only for a DPU agent"}}) {
    req.set_role(role);
    req.set_host_node_id(host);
    st = meta_->NodeStub("dpu-a")->RegisterNode(Ctx().get(), req, &resp);
    EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT) << host;
    EXPECT_NE(st.error_message().find(why), std::string::npos) << st.error_message();
  }
  // Stale incarnation.
  v1::HeartbeatRequest hb;
  hb.set_node_id("node-a");
  hb.set_incarnation(inc_["node-a"] + 7);
  v1::HeartbeatResponse hresp;
  EXPECT_EQ(meta_->NodeStub("node-a")->Heartbeat(Ctx().get(), hb, &hresp).error_code(),
            StatusCode::FAILED_PRECONDITION);
}

TEST_F(MetaIntegration, HealthMetricsAndCleanShutdown) {
  int code = 0;
  auto body = HttpGet("127.0.0.1", meta_->metrics_port(), "/healthz", &code);
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_EQ(code, 200);
  body = HttpGet("127.0.0.1", meta_->metrics_port(), "/readyz", &code);
  ASSERT_TRUE(body.ok());
  EXPECT_EQ(code, 200);
  Register("node-a");
  body = HttpGet("127.0.0.1", meta_->metrics_port(), "/metrics", &code);
  ASSERT_TRUE(body.ok());
  EXPECT_EQ(code, 200);
  EXPECT_NE(body->find("ckpt_meta_"), std::string::npos) << *body;
  auto exit = meta_->proc()->Terminate(absl::Seconds(20));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_TRUE(exit->success()) << exit->ToString();
}

}  // namespace
}  // namespace ckpt::testing
