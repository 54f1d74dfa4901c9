// ckpt-dpu-proxy through the real binaries (docs/dpu.md "Control path: a
// host-side socket proxy"): ckpt-meta, ckpt-dpu-agents serving hosts h0 and
// h1 (their certificates name them: ckptctl certs create-node --host-node),
// and host h0's ckpt-dpu-proxy with h0's node certificate in front of its DPU
// agent's TLS port. Trainers use the proxy's plain unix socket: the C++
// client and ckpt-train-demo save, crash, resume and restore through it,
// byte-identical. A proxy with another node's certificate, or another node
// calling the DPU agent's port, is refused; so is a DPU agent claiming a host
// its certificate does not name (at start, and by meta at RegisterNode).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "ckpt/client.h"
#include "ckpt/v1/agent.grpc.pb.h"
#include "ckpt/v1/meta.grpc.pb.h"
#include "integration/client_options.h"
#include "integration/cluster_fixture.h"
#include "support/ports.h"
#include "support/process.h"
#include "support/test_tls.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using testing::kLong;
using testing::TestPki;
using testing::TlsFilePaths;

constexpr size_t kBytes = (size_t{4} << 20) + 1;

class DpuProxyTest : public testing::ClusterTest {
 protected:
  // n0 is the DPU of host h0, n1 the DPU of host h1.
  void SetUp() override { StartCluster(2, "96MiB", {{0, "h0"}, {1, "h1"}}); }
  void TearDown() override {
    for (auto& p : proxies_) {
      if (p->IsRunning()) (void)p->Terminate(absl::Seconds(20));
    }
  }

  // ckpt-dpu-proxy as `as` in front of DPU agent `node`, serving
  // <dir>/<name>/agent.sock; waits (bounded) until the socket exists.
  std::string StartProxy(const std::string& name, const TlsFilePaths& as, int node,
                         std::vector<std::string> extra = {}) {
    const std::string socket = *dir_->Sub(name) + "/agent.sock";
    absl::StatusOr<int> metrics = testing::PickFreePort();
    EXPECT_TRUE(metrics.ok()) << metrics.status();
    proxy_metrics_ports_.push_back(metrics.ok() ? *metrics : 0);
    testing::SubprocessOptions o;
    o.argv = {testing::BinaryPath("ckpt-dpu-proxy"), "--dpu-address",
              absl::StrCat("127.0.0.1:", agents_[node]->port()), "--socket", socket, "--tls-ca", as.ca,
              "--tls-cert", as.cert, "--tls-key", as.key, "--log-level", "debug", "--metrics-listen",
              absl::StrCat("127.0.0.1:", proxy_metrics_ports_.back())};
    for (std::string& e : extra) o.argv.push_back(std::move(e));
    o.name = "ckpt-dpu-proxy-" + name;
    o.log_dir = dir_->path();
    absl::StatusOr<std::unique_ptr<testing::Subprocess>> p = testing::Subprocess::Start(o);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return socket;
    // Ready once the socket is open to the group: the proxy binds it 0600
    // and opens it (0660) before it listens; a test that looked as soon as
    // the file appeared saw 0600 (CI, under ASan).
    for (const absl::Time until = absl::Now() + kLong; absl::Now() < until && (*p)->IsRunning();) {
      struct stat st {};
      if (::stat(socket.c_str(), &st) == 0 && (st.st_mode & 0777) == 0660) break;
      absl::SleepFor(absl::Milliseconds(10));  // bounded poll of a real process
    }
    EXPECT_EQ(::access(socket.c_str(), F_OK), 0) << (*p)->LogTail();
    proxies_.push_back(*std::move(p));
    return socket;
  }

  ClientOptions Via(const std::string& socket, const std::string& job) {
    ClientOptions o = testing::ClientOptionsFor(*meta_, *agents_[0], job, 0, 1);
    o.agent_socket = socket;
    o.protection = Protection::Replicate(2, Protection::Placement::kRing);
    return o;
  }

  // A sample of proxy `i`'s /metrics ("name" or "name{labels}"), -1 if absent.
  double ProxyMetric(size_t i, const std::string& sample) {
    int code = 0;
    absl::StatusOr<std::string> body = testing::HttpGet("127.0.0.1", proxy_metrics_ports_[i], "/metrics", &code);
    if (!body.ok() || code != 200) return -1;
    for (absl::string_view line : absl::StrSplit(*body, '\n')) {
      if (absl::StartsWith(line, sample + " ")) {
        double v = -1;
        return absl::SimpleAtod(line.substr(sample.size() + 1), &v) ? v : -1;
      }
    }
    return -1;
  }

  std::vector<std::unique_ptr<testing::Subprocess>> proxies_;
  std::vector<int> proxy_metrics_ports_;
};

TEST_F(DpuProxyTest, TrainersSaveAndRestoreThroughTheHostsProxy) {
  const std::string socket = StartProxy("h0-run", TestPki::Shared().Node("h0"), 0, {"--dpu-node", "n0"});
  struct stat st {};
  ASSERT_EQ(::stat(socket.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);

  // The library trainers link: a save (pulled by the DPU agent from the
  // trainer's staging memory), protected on n1, restored byte-identical.
  const std::vector<uint8_t> data = testing::RankBytes(0, 5, kBytes);
  {
    absl::StatusOr<Client> c = Client::Connect(Via(socket, "via-proxy"));
    ASSERT_TRUE(c.ok()) << c.status() << "\n" << Logs() << proxies_[0]->LogTail();
    SaveBuilder s = c->BeginSave(5);
    ASSERT_TRUE(s.Add("state", std::as_bytes(std::span<const uint8_t>(data)), DType::kU8, {data.size()}).ok());
    absl::StatusOr<SaveHandle> h = s.Commit();
    ASSERT_TRUE(h.ok()) << h.status();
    absl::Status w = h->Wait(Level::kProtected, absl::Now() + kLong);
    ASSERT_TRUE(w.ok()) << w << "\n" << Logs();
  }
  EXPECT_GE(agents_[0]->Metric("ckpt_agent_pulled_bytes_total"), static_cast<double>(kBytes));
  {
    absl::StatusOr<Client> c = Client::Connect(Via(socket, "via-proxy"));
    ASSERT_TRUE(c.ok()) << c.status();
    absl::StatusOr<LoadedShard> shard = c->Load(5);
    ASSERT_TRUE(shard.ok()) << shard.status() << "\n" << Logs();
    absl::StatusOr<std::span<const std::byte>> view = shard->View("state");
    ASSERT_TRUE(view.ok());
    ASSERT_EQ(view->size(), data.size());
    EXPECT_EQ(std::memcmp(view->data(), data.data(), data.size()), 0);
    EXPECT_EQ(shard->served_from(), ServedFrom::kLocal);
  }
  EXPECT_GE(agents_[0]->Metric("ckpt_agent_delivered_bytes_total"), static_cast<double>(kBytes));
  // The proxy's own counters (docs/dpu.md "Control path"): the connections it carried.
  EXPECT_GE(ProxyMetric(0, "ckpt_dpu_proxy_connections_total"), 1) << proxies_[0]->LogTail();
  EXPECT_EQ(ProxyMetric(0, "ckpt_dpu_proxy_upstream_failed_total"), 0);
  EXPECT_EQ(ProxyMetric(0, "ckpt_dpu_proxy_refused_total{reason=\"max_connections\"}"), 0);

  // A trainer process: commits step 4 and SIGKILLs itself; a new process
  // resumes through the proxy and ends with the uninterrupted run's state.
  auto run = [&](std::vector<std::string> extra) {
    testing::SubprocessOptions o;
    o.argv = {testing::BinaryPath("ckpt-train-demo"), "--meta", meta_->address(), "--agent-socket", socket, "--job",
              "demo", "--rank", "0", "--world-size", "1", "--steps", "8", "--every", "2", "--mib", "4"};
    for (std::string& e : extra) o.argv.push_back(std::move(e));
    o.name = "ckpt-train-demo";
    return testing::RunToCompletion(o, absl::Seconds(120));
  };
  absl::StatusOr<testing::RunResult> crashed = run({"--crash-at", "4"});
  ASSERT_TRUE(crashed.ok()) << crashed.status();
  EXPECT_TRUE(crashed->status.signaled()) << crashed->stdout_text << crashed->stderr_text;
  absl::StatusOr<testing::RunResult> resumed = run({"--resume"});
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_TRUE(resumed->status.success()) << resumed->stdout_text << resumed->stderr_text;
  EXPECT_THAT(resumed->stdout_text, HasSubstr("resumed from step 4 (served from local)"));
  EXPECT_THAT(resumed->stdout_text, HasSubstr("final state matches an uninterrupted run: yes"));

  // The proxy stops cleanly on SIGTERM and removes its socket.
  absl::StatusOr<testing::ExitStatus> exit = proxies_[0]->Terminate(absl::Seconds(20));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_TRUE(exit->success()) << exit->ToString() << proxies_[0]->LogTail();
  EXPECT_NE(::access(socket.c_str(), F_OK), 0);
}

TEST_F(DpuProxyTest, OnlyTheHostsNodeCertificateMakesTrainerCallsOnADpuAgent) {
  // A proxy holding another node's certificate (h1's) in front of h0's DPU:
  // it refuses the DPU (its certificate names host h0), so the trainer gets
  // nothing through it.
  const std::string wrong = StartProxy("h1-run", TestPki::Shared().Node("h1"), 0);
  ClientOptions o = Via(wrong, "wrong-host");
  o.connect_timeout = absl::Seconds(3);
  absl::StatusOr<Client> c = Client::Connect(o);
  EXPECT_FALSE(c.ok());
  EXPECT_THAT(proxies_[0]->LogTail(), HasSubstr("serving host h0: a DPU agent of this host has a node certificate "
                                                "naming ckpt://host/h1"));

  // The DPU agent's own check, without a proxy in between: h1's certificate
  // (or n1's, a DPU's) is refused naming the one node that may; h0's takes a
  // lease, but may not flush.
  v1::AcquireStagingLeaseRequest lease;
  lease.set_job_id("any-job");
  lease.set_step(1);
  lease.set_size_bytes(4096);
  for (const TlsFilePaths& as : {TestPki::Shared().Node("h1"), TestPki::Shared().Dpu("n1", "h1")}) {
    auto stub = v1::AgentService::NewStub(testing::TestChannel(absl::StrCat("127.0.0.1:", agents_[0]->port()), as));
    grpc::ClientContext ctx;
    v1::AcquireStagingLeaseResponse resp;
    grpc::Status s = stub->AcquireStagingLease(&ctx, lease, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("only ckpt://node/h0, the host this DPU agent serves"));
  }
  auto host = v1::AgentService::NewStub(
      testing::TestChannel(absl::StrCat("127.0.0.1:", agents_[0]->port()), TestPki::Shared().Node("h0")));
  {
    v1::CreateJobRequest req;
    req.mutable_spec()->set_job_id("any-job");
    req.mutable_spec()->set_world_size(1);
    v1::CreateJobResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(meta_->stub()->CreateJob(&ctx, req, &resp).ok());
  }
  {
    grpc::ClientContext ctx;
    v1::AcquireStagingLeaseResponse resp;
    grpc::Status s = host->AcquireStagingLease(&ctx, lease, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_TRUE(resp.pull());
    v1::AbortLeaseRequest abort;
    abort.set_lease_id(resp.lease_id());
    v1::AbortLeaseResponse aborted;
    grpc::ClientContext ctx2;
    EXPECT_TRUE(host->AbortLease(&ctx2, abort, &aborted).ok());
  }
  {
    grpc::ClientContext ctx;
    v1::FlushResponse resp;
    grpc::Status s = host->Flush(&ctx, {}, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(s.error_message(), HasSubstr("not flush, evict or pause"));
  }
  // A host agent's port takes no node at all (unchanged).
}

TEST_F(DpuProxyTest, ADpuClaimingAHostItsCertificateDoesNotNameIsRefused) {
  // ckpt-dpu-agent refuses to start with a certificate naming another host.
  testing::SubprocessOptions o;
  const TlsFilePaths cert = TestPki::Shared().Dpu("n7", "h0");
  o.argv = {testing::BinaryPath("ckpt-dpu-agent"), "--node-id", "n7", "--host-node", "h1", "--meta",
            meta_->address(), "--listen", "127.0.0.1:0", "--run-dir", *dir_->Sub("n7-run"), "--memory", "8MiB",
            "--memory-dir", *dir_->Sub("n7-mem") + "/tier", "--tls-ca", cert.ca, "--tls-cert", cert.cert,
            "--tls-key", cert.key};
  o.name = "ckpt-dpu-agent-n7";
  absl::StatusOr<testing::RunResult> r = testing::RunToCompletion(o, absl::Seconds(60));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->status.exited() && r->status.exit_code() == 2) << r->status << r->stderr_text;
  EXPECT_THAT(r->stderr_text, HasSubstr("names host \"h0\" (ckpt://host/h0) but --host-node is \"h1\""));
  EXPECT_THAT(r->stderr_text, HasSubstr("ckptctl certs create-node --node-id n7 --host ... --host-node h1"));

  // Meta refuses a RegisterNode whose host is not the certificate's (an agent
  // that skipped its own check, or swapped its files since).
  v1::RegisterNodeRequest req;
  req.set_grpc_address("127.0.0.1:1");
  req.set_data_address("127.0.0.1:2");
  req.set_role(v1::NODE_ROLE_DPU);
  req.set_memory_capacity_bytes(1 << 30);
  struct Case {
    std::string node, cert_host, claim, want;
  };
  for (const Case& c : std::vector<Case>{
           {"n7", "h0", "h1", "the request claims to serve host \"h1\" but the caller's certificate ckpt://node/n7 "
                              "(a DPU of host h0) names host \"h0\""},
           {"n8", "", "h0", "names no host (no ckpt://host/ URI)"}}) {
    req.set_node_id(c.node);
    req.set_host_node_id(c.claim);
    const TlsFilePaths as =
        c.cert_host.empty() ? TestPki::Shared().Node(c.node) : TestPki::Shared().Dpu(c.node, c.cert_host);
    auto stub = v1::MetaService::NewStub(testing::TestChannel(meta_->address(), as));
    grpc::ClientContext ctx;
    v1::RegisterNodeResponse resp;
    grpc::Status s = stub->RegisterNode(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << c.node;
    EXPECT_THAT(s.error_message(), HasSubstr(c.want));
  }
  // ... and admits the same request from a certificate that names the host.
  req.set_node_id("n9");
  req.set_host_node_id("h1");
  {
    auto stub = v1::MetaService::NewStub(testing::TestChannel(meta_->address(), TestPki::Shared().Dpu("n9", "h1")));
    grpc::ClientContext ctx;
    v1::RegisterNodeResponse resp;
    grpc::Status s = stub->RegisterNode(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  v1::ListNodesResponse nodes;
  grpc::ClientContext ctx;
  ASSERT_TRUE(meta_->stub()->ListNodes(&ctx, {}, &nodes).ok());
  std::vector<std::string> seen;
  for (const auto& n : nodes.nodes()) seen.push_back(absl::StrCat(n.endpoint().node_id(), ":", n.host_node_id()));
  EXPECT_THAT(seen, ::testing::UnorderedElementsAre("n0:h0", "n1:h1", "n9:h1"));
}

}  // namespace
}  // namespace ckpt
