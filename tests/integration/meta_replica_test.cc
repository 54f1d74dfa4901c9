// Three ckpt-meta replicas on one real etcd (issue 37), started as shipped
// (mutual TLS, the test CA's meta certificate) with --replica-of, and called
// the way agents and ckptctl call them: one channel given every replica's
// address (ChannelWithToken with "A,B,C", as --meta A,B,C), which connects to
// the one that listens, the leader.
//
// - kill -9 of the leader during a burst of CreateJob calls: another replica
//   takes over and every call that was answered OK is in its state.
// - a leader paused (SIGSTOP) past its lease is replaced; when it wakes it
//   cannot write (its appends are fenced) and exits; nothing it had not
//   acknowledged appears.
// - a replica that lost its data directory replays the log and, once it
//   leads, has everything.
// Takeover times are printed (RecordProperty "takeover_ms").
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "ckpt/v1/meta.grpc.pb.h"
#include "common/grpc_security.h"
#include "gtest/gtest.h"
#include "server/meta/etcd/etcd_test_server.h"
#include "support/ports.h"
#include "support/process.h"
#include "support/temp_dir.h"
#include "support/test_tls.h"

namespace ckpt::testing {
namespace {

namespace v1 = ::ckpt::v1;

constexpr int kReplicas = 3;
constexpr int kLeaseMs = 2000;

class MetaReplicaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!EtcdTestServer::Available()) GTEST_SKIP() << EtcdTestServer::MissingReason();
    absl::StatusOr<std::unique_ptr<EtcdTestServer>> etcd = EtcdTestServer::StartInTempDir(&tmp_);
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = std::move(*etcd);
    absl::StatusOr<std::vector<int>> ports = PickFreePorts(2 * kReplicas);
    ASSERT_TRUE(ports.ok()) << ports.status();
    std::vector<std::string> addresses;
    for (int i = 0; i < kReplicas; ++i) {
      port_[i] = (*ports)[2 * i];
      metrics_port_[i] = (*ports)[2 * i + 1];
      addresses.push_back(absl::StrCat("127.0.0.1:", port_[i]));
    }
    for (int i = 0; i < kReplicas; ++i) ASSERT_TRUE(StartReplica(i).ok());
    // As ckptctl and the agents: meta's identity checked, not a host name
    // (the replicas' addresses are several).
    const TlsFilePaths admin = AdminTls();
    TlsFiles tls;
    tls.ca_file = admin.ca;
    tls.cert_file = admin.cert;
    tls.key_file = admin.key;
    tls.expect_peer_uri = MetaPeerUri();
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials = ChannelCredentials(tls);
    ASSERT_TRUE(credentials.ok()) << credentials.status();
    grpc::ChannelArguments args;
    SetReconnectArgs(&args);
    credentials_ = *credentials;
    channel_ = ChannelWithToken(absl::StrJoin(addresses, ","), credentials_, args, /*token=*/"");
    stub_ = v1::MetaService::NewStub(channel_);
  }

  void TearDown() override {
    for (auto& p : proc_) {
      if (p != nullptr && p->IsRunning()) {
        (void)p->Kill(SIGCONT);
        EXPECT_TRUE(p->Kill().ok());
      }
    }
    if (etcd_ != nullptr) {
      EXPECT_TRUE(etcd_->Kill().ok());
    }
  }

  std::string DataDir(int i) const { return absl::StrCat(tmp_->path(), "/meta-", i); }

  absl::Status StartReplica(int i) {
    const TlsFilePaths tls = TestPki::Shared().Meta();
    SubprocessOptions o;
    o.argv = {BinaryPath("ckpt-meta"),
              "--listen", absl::StrCat("127.0.0.1:", port_[i]),
              "--metrics-listen", absl::StrCat("127.0.0.1:", metrics_port_[i]),
              "--data-dir", DataDir(i),
              "--replica-of", absl::StrCat("etcd://", etcd_->endpoint(), "/ckpt/test"),
              "--replica-lease-ms", std::to_string(kLeaseMs), "--etcd-plaintext",
              "--tls-ca", tls.ca, "--tls-cert", tls.cert, "--tls-key", tls.key};
    o.name = absl::StrCat("ckpt-meta-", i);
    o.log_dir = tmp_->path();
    absl::StatusOr<std::unique_ptr<Subprocess>> p = Subprocess::Start(o);
    if (!p.ok()) return p.status();
    proc_[i] = std::move(*p);
    return absl::OkStatus();
  }

  // The replica whose /readyz says ready (the leader), or -1.
  int Leader() {
    for (int i = 0; i < kReplicas; ++i) {
      if (proc_[i] == nullptr || !proc_[i]->IsRunning()) continue;
      int code = 0;
      absl::StatusOr<std::string> body = HttpGet("127.0.0.1", metrics_port_[i], "/readyz", &code, absl::Seconds(1));
      if (body.ok() && code == 200) return i;
    }
    return -1;
  }

  // A channel to replica i alone.
  std::shared_ptr<grpc::Channel> channel_for(int i) {
    grpc::ChannelArguments args;
    SetReconnectArgs(&args);
    return ChannelWithToken(absl::StrCat("127.0.0.1:", port_[i]), credentials_, args, /*token=*/"");
  }

  int WaitLeader(absl::Duration timeout, int other_than = -1) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      const int l = Leader();
      if (l >= 0 && l != other_than) return l;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return -1;
  }

  // Creates (or opens) job `id` through `stub` (default: every replica's address).
  grpc::Status CreateJob(const std::string& id, absl::Duration timeout = absl::Seconds(3),
                         v1::MetaService::Stub* stub = nullptr, bool wait_for_ready = true) {
    v1::CreateJobRequest req;
    req.mutable_spec()->set_job_id(id);
    req.mutable_spec()->set_world_size(1);
    req.mutable_spec()->mutable_protection()->mutable_none();
    req.set_open_if_exists(true);
    v1::CreateJobResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    ctx.set_wait_for_ready(wait_for_ready);
    return (stub != nullptr ? stub : stub_.get())->CreateJob(&ctx, req, &resp);
  }

  // Every job the leader knows.
  std::set<std::string> Jobs() {
    std::set<std::string> out;
    for (int attempt = 0; attempt < 100; ++attempt) {
      v1::ListJobsRequest req;
      v1::ListJobsResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
      ctx.set_wait_for_ready(true);
      grpc::Status s = stub_->ListJobs(&ctx, req, &resp);
      if (s.ok()) {
        for (const v1::JobInfo& j : resp.jobs()) out.insert(j.spec().job_id());
        return out;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    ADD_FAILURE() << "ListJobs never answered";
    return out;
  }

  std::unique_ptr<TempDir> tmp_;
  std::unique_ptr<EtcdTestServer> etcd_;
  int port_[kReplicas] = {}, metrics_port_[kReplicas] = {};
  std::unique_ptr<Subprocess> proc_[kReplicas];
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::MetaService::Stub> stub_;
};

TEST_F(MetaReplicaTest, KillingTheLeaderDuringABurstLosesNoAcknowledgedCall) {
  const int first = WaitLeader(absl::Seconds(30));
  ASSERT_GE(first, 0) << "no replica became leader";
  const grpc::Status warm = CreateJob("warmup");
  ASSERT_TRUE(warm.ok()) << warm.error_code() << " " << warm.error_message();

  absl::Mutex mu;
  std::set<std::string> acked;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> first_ok_after_kill_ms{-1};
  std::atomic<bool> killed{false};
  absl::Time kill_time;
  std::vector<std::thread> writers;
  for (int t = 0; t < 4; ++t) {
    writers.emplace_back([&, t] {
      for (int i = 0; !stop.load(); ++i) {
        const std::string id = absl::StrCat("job-", t, "-", i);
        const grpc::Status s = CreateJob(id, absl::Seconds(2));
        if (!s.ok()) continue;  // not acknowledged: may or may not exist
        absl::MutexLock lock(&mu);
        acked.insert(id);
        if (killed.load() && first_ok_after_kill_ms.load() < 0) {
          first_ok_after_kill_ms = absl::ToInt64Milliseconds(absl::Now() - kill_time);
        }
      }
    });
  }
  // Let the burst run, then kill the leader in the middle of it.
  auto wait_acked = [&](size_t n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      {
        absl::MutexLock lock(&mu);
        if (acked.size() >= n) return true;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  };
  ASSERT_TRUE(wait_acked(100));
  {
    absl::MutexLock lock(&mu);
    kill_time = absl::Now();
  }
  ASSERT_TRUE(proc_[first]->Kill().ok());
  killed = true;
  size_t before_kill;
  {
    absl::MutexLock lock(&mu);
    before_kill = acked.size();
  }
  const bool went_on = wait_acked(before_kill + 100);
  stop = true;
  for (std::thread& w : writers) w.join();
  ASSERT_TRUE(went_on) << "no write succeeded after the leader was killed";
  const int second = WaitLeader(absl::Seconds(10));
  ASSERT_GE(second, 0);
  EXPECT_NE(second, first);
  RecordProperty("takeover_ms", static_cast<int>(first_ok_after_kill_ms.load()));
  std::printf("takeover after kill -9 of the leader: %lld ms (lease %d ms)\n",
              static_cast<long long>(first_ok_after_kill_ms.load()), kLeaseMs);

  const std::set<std::string> jobs = Jobs();
  std::vector<std::string> lost;
  for (const std::string& id : acked) {
    if (jobs.count(id) == 0) lost.push_back(id);
  }
  EXPECT_TRUE(lost.empty()) << lost.size() << " acknowledged jobs lost, e.g. " << lost.front();
  EXPECT_GE(jobs.size(), acked.size());

  // The killed replica comes back as a follower and catches up; ClusterStatus
  // (ckptctl status) lists the three, the leader flagged, none behind.
  ASSERT_TRUE(StartReplica(first).ok());
  ASSERT_TRUE(CreateJob("after-restart").ok());
  EXPECT_EQ(WaitLeader(absl::Seconds(5)), second);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  std::string seen;
  for (;;) {
    v1::ClusterStatusRequest req;
    v1::ClusterStatusResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    ASSERT_TRUE(stub_->ClusterStatus(&ctx, req, &resp).ok());
    int leaders = 0;
    uint64_t lo = UINT64_MAX, hi = 0;
    seen.clear();
    for (const v1::MetaReplica& r : resp.meta_replicas()) {
      leaders += r.leader() && r.address() == absl::StrCat("127.0.0.1:", port_[second]);
      lo = std::min<uint64_t>(lo, r.applied_index());
      hi = std::max<uint64_t>(hi, r.applied_index());
      absl::StrAppend(&seen, r.address(), r.leader() ? " leader " : " follower ", r.applied_index(), "; ");
    }
    if (resp.meta_replicas_size() == kReplicas && leaders == 1 && lo == hi && hi > 0) break;
    ASSERT_LT(absl::Now(), deadline) << "ClusterStatus lists: " << seen;
    absl::SleepFor(absl::Milliseconds(100));
  }
}

TEST_F(MetaReplicaTest, APausedLeaderIsReplacedAndCannotWriteWhenItWakes) {
  const int first = WaitLeader(absl::Seconds(30));
  ASSERT_GE(first, 0);
  ASSERT_TRUE(CreateJob("before").ok());
  // A call that reaches the old leader while it is paused, and is handled
  // when it wakes, after another replica took over: it must not succeed.
  std::shared_ptr<grpc::Channel> to_old = channel_for(first);
  ASSERT_TRUE(to_old->WaitForConnected(absl::ToChronoTime(absl::Now() + absl::Seconds(10))));
  std::unique_ptr<v1::MetaService::Stub> old_leader = v1::MetaService::NewStub(to_old);
  ASSERT_TRUE(proc_[first]->Kill(SIGSTOP).ok());
  const absl::Time paused = absl::Now();
  grpc::Status stale_status;
  std::thread stale([&] { stale_status = CreateJob("stale", absl::Seconds(60), old_leader.get(), false); });
  const int second = WaitLeader(absl::Seconds(30), first);
  ASSERT_GE(second, 0) << "nobody took over from a paused leader";
  std::printf("takeover after SIGSTOP of the leader: %lld ms (lease %d ms)\n",
              static_cast<long long>(absl::ToInt64Milliseconds(absl::Now() - paused)), kLeaseMs);
  // The new leader serves while the old one is still paused.
  {
    std::unique_ptr<v1::MetaService::Stub> new_leader = v1::MetaService::NewStub(channel_for(second));
    const grpc::Status s = CreateJob("during", absl::Seconds(10), new_leader.get());
    ASSERT_TRUE(s.ok()) << s.error_message();
  }

  // Wakes up: its lease is gone, so its writes are fenced, and it exits.
  ASSERT_TRUE(proc_[first]->Kill(SIGCONT).ok());
  stale.join();
  EXPECT_FALSE(stale_status.ok()) << "the deposed leader acknowledged a write";
  std::printf("the call the paused leader took: %d %s\n", stale_status.error_code(),
              stale_status.error_message().c_str());
  absl::StatusOr<ExitStatus> exit = proc_[first]->WaitFor(absl::Seconds(20));
  ASSERT_TRUE(exit.ok()) << "the deposed leader did not exit: " << proc_[first]->LogTail();
  EXPECT_TRUE(exit->exited() && exit->exit_code() == 1) << *exit;
  const std::string log = proc_[first]->LogTail(16384);
  EXPECT_TRUE(log.find("lost the leadership") != std::string::npos ||
              log.find("no longer the leader") != std::string::npos)
      << log;
  // Callers given every address reach the new leader.
  const std::set<std::string> jobs = Jobs();
  EXPECT_EQ(jobs.count("before"), 1u);
  EXPECT_EQ(jobs.count("during"), 1u);
  EXPECT_EQ(jobs.count("stale"), 0u);
}

TEST_F(MetaReplicaTest, AReplicaThatLostItsDiskReplaysTheLogAndLeadsWithEverything) {
  const int first = WaitLeader(absl::Seconds(30));
  ASSERT_GE(first, 0);
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(CreateJob(absl::StrCat("j", i)).ok());
  const int wiped = (first + 1) % kReplicas;
  ASSERT_TRUE(proc_[wiped]->Kill().ok());
  ASSERT_TRUE(proc_[wiped]->Wait().ok());
  std::filesystem::remove_all(DataDir(wiped));
  ASSERT_TRUE(StartReplica(wiped).ok());
  ASSERT_TRUE(CreateJob("after-wipe").ok());
  // Leave the wiped replica alone: it must lead, from what it replayed.
  for (int i = 0; i < kReplicas; ++i) {
    if (i != wiped) {
      ASSERT_TRUE(proc_[i]->Kill().ok());
    }
  }
  ASSERT_EQ(WaitLeader(absl::Seconds(30)), wiped);
  const std::set<std::string> jobs = Jobs();
  for (int i = 0; i < 20; ++i) EXPECT_EQ(jobs.count(absl::StrCat("j", i)), 1u) << i;
  EXPECT_EQ(jobs.count("after-wipe"), 1u);
}

// Bad replica settings: ckpt-meta (and an agent given a bad list of meta
// addresses) exits 2 naming the problem, before it touches its data dir or
// reaches for etcd.
TEST(MetaReplicaUsageTest, BadReplicaSettingsAreRefusedClearlyAndCreateNothing) {
  absl::StatusOr<TempDir> tmp = TempDir::Create();
  ASSERT_TRUE(tmp.ok()) << tmp.status();
  const std::string data = tmp->path() + "/meta-data";
  auto run = [&](std::vector<std::string> argv) {
    SubprocessOptions o;
    o.argv = std::move(argv);
    o.env = {{"CKPT_META", ""}, {"CKPT_TLS_CA", ""}, {"CKPT_TLS_CERT", ""}, {"CKPT_TLS_KEY", ""}};
    absl::StatusOr<RunResult> r = RunToCompletion(o, absl::Seconds(60));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : RunResult{ExitStatus(-1), "", ""};
  };
  const std::vector<std::string> meta = {BinaryPath("ckpt-meta"), "--insecure", "--listen", "127.0.0.1:17400",
                                         "--data-dir", data};
  const struct {
    std::vector<std::string> args;
    const char* want;
  } cases[] = {
      {{"--replica-of", "http://127.0.0.1:2379/ckpt/a", "--etcd-plaintext"}, "not an etcd:// address"},
      {{"--replica-of", "etcd://127.0.0.1:2379", "--etcd-plaintext"}, "no prefix after the members"},
      {{"--replica-of", "etcd://127.0.0.1:2379/ckpt/../x", "--etcd-plaintext"}, "prefix element '..'"},
      {{"--replica-of", "etcd://127.0.0.1/ckpt/a", "--etcd-plaintext"}, "no ':port'"},
      {{"--replica-of", "etcd://127.0.0.1:2379/ckpt/a"}, "needs TLS to etcd"},
      {{"--replica-of", "etcd://10.0.0.1:2379/ckpt/a", "--etcd-plaintext"}, "10.0.0.1:2379 is not on loopback"},
      {{"--replica-of", "etcd://127.0.0.1:2379/ckpt/a", "--etcd-ca", "/nonexistent/ca.pem"},
       "etcd_ca without etcd_cert and etcd_key"},
      {{"--replica-of", "etcd://127.0.0.1:2379/ckpt/a", "--etcd-plaintext", "--replica-lease-ms", "500"},
       "at least 1000"},
      {{"--etcd-plaintext"}, "only for replicas"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = meta;
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const RunResult r = run(argv);
    EXPECT_TRUE(r.status.exited() && r.status.exit_code() == 2) << absl::StrJoin(c.args, " ") << ": " << r.status;
    EXPECT_NE(r.stderr_text.find(c.want), std::string::npos) << absl::StrJoin(c.args, " ") << ": " << r.stderr_text;
  }
  // Replicas need a fixed port: clients are given every replica's address.
  RunResult r = run({BinaryPath("ckpt-meta"), "--insecure", "--listen", "127.0.0.1:0", "--data-dir", data,
                     "--replica-of", "etcd://127.0.0.1:2379/ckpt/a", "--etcd-plaintext"});
  EXPECT_EQ(r.status.exit_code(), 2);
  EXPECT_NE(r.stderr_text.find("fixed --listen port"), std::string::npos) << r.stderr_text;
  EXPECT_FALSE(std::filesystem::exists(data)) << "a refused start created its data dir";
  // An agent given a list of meta addresses that are not IP literals.
  r = run({BinaryPath("ckpt-agent"), "--node-id", "n1", "--meta", "127.0.0.1:7400,meta-b.example:7400", "--run-dir",
           tmp->path(), "--memory", "64MiB"});
  EXPECT_EQ(r.status.exit_code(), 2) << r.stderr_text;
  EXPECT_NE(r.stderr_text.find("must be IP literals"), std::string::npos) << r.stderr_text;
}

}  // namespace
}  // namespace ckpt::testing
