// Real ckpt-meta + ckpt-agent processes on 127.0.0.1, driven over the wire
// protocol (AgentService on the agent's unix socket, pool mapped with mmap):
// save, flush to PERSISTED, a clean SIGTERM stop after a workload, kill -9 of
// the agent between commit and flush, corrupted bytes, bad input, metrics.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/cpu_affinity.h"
#include "common/crc32c.h"
#include "common/durable_format.h"
#include "support/hex_id.h"
#include "common/file_system.h"
#include "common/manifest.h"
#include "integration/agent_process.h"
#include "integration/meta_process.h"
#include "integration/node_cluster.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using testing::AgentProcess;
using testing::AgentProcessOptions;
using testing::MetaProcess;
using testing::TempDir;

std::string Pattern(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// A client session on the agent's session socket (docs/agent.md "Client
// sessions"), spoken by hand: "HELLO 1", the id from "OK <id> <n>"; the pool
// descriptors that come with it are closed. The connection (the session's
// liveness) closes with the object.
class RawSession {
 public:
  static std::unique_ptr<RawSession> Open(const std::string& path) {
    auto s = std::unique_ptr<RawSession>(new RawSession);
    s->fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    if (s->fd_ < 0 || ::connect(s->fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return nullptr;
    const std::string hello = "HELLO 1\n";
    if (::send(s->fd_, hello.data(), hello.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(hello.size())) return nullptr;
    char buf[4096];
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 16)];
    iovec iov{buf, sizeof(buf) - 1};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = ::recvmsg(s->fd_, &msg, MSG_CMSG_CLOEXEC);
    if (n <= 0) return nullptr;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t fds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < fds; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        ::close(fd);
      }
    }
    const std::string reply(buf, static_cast<size_t>(n));
    if (reply.rfind("OK ", 0) != 0) return nullptr;
    s->id_ = reply.substr(3, reply.find(' ', 3) - 3);
    return s;
  }
  ~RawSession() {
    if (fd_ >= 0) ::close(fd_);
  }
  const std::string& id() const { return id_; }

 private:
  RawSession() = default;
  int fd_ = -1;
  std::string id_;
};

class AgentIntegrationTest : public testing::NodeClusterTest {
 protected:
  AgentIntegrationTest() : NodeClusterTest("16MiB") {}

  void SetUp() override {
    NodeClusterTest::SetUp();
    if (HasFatalFailure()) return;
    local_ = v1::AgentService::NewStub(
        grpc::CreateChannel("unix:" + agent_->socket_path(), grpc::InsecureChannelCredentials()));
  }

  grpc::Status CreateJob(const std::string& job, uint32_t world, uint32_t flush_every) {
    v1::CreateJobRequest req;
    req.mutable_spec()->set_job_id(job);
    req.mutable_spec()->set_world_size(world);
    req.mutable_spec()->mutable_protection()->mutable_none();
    if (flush_every > 0) req.mutable_spec()->mutable_flush()->set_every_n_versions(flush_every);
    v1::CreateJobResponse resp;
    grpc::ClientContext ctx;
    return meta_->stub()->CreateJob(&ctx, req, &resp);
  }

  grpc::Status Lease(const std::string& job, uint64_t step, uint32_t rank, uint64_t size,
                     v1::AcquireStagingLeaseResponse* resp, const std::string& session_id = "",
                     uint32_t pid = static_cast<uint32_t>(::getpid())) {
    v1::AcquireStagingLeaseRequest req;
    req.set_job_id(job);
    req.set_step(step);
    req.set_rank(rank);
    req.set_size_bytes(size);
    req.set_client_pid(pid);
    req.set_session_id(session_id);
    grpc::ClientContext ctx;
    return local_->AcquireStagingLease(&ctx, req, resp);
  }

  // Writes `data` at shard offset `off` through the lease's mapped regions.
  static void WriteRegions(const v1::AcquireStagingLeaseResponse& lease, uint64_t off, const std::string& data) {
    for (const v1::MemoryRegion& r : lease.regions()) {
      const uint64_t begin = std::max<uint64_t>(off, r.shard_offset_bytes());
      const uint64_t end = std::min<uint64_t>(off + data.size(), r.shard_offset_bytes() + r.length_bytes());
      if (begin >= end) continue;
      const int fd = ::open(r.path().c_str(), O_RDWR);
      ASSERT_GE(fd, 0) << r.path();
      const off_t pos = static_cast<off_t>(r.file_offset_bytes() + (begin - r.shard_offset_bytes()));
      ASSERT_EQ(::pwrite(fd, data.data() + (begin - off), end - begin, pos), static_cast<ssize_t>(end - begin));
      ::close(fd);
    }
  }

  static v1::Item MakeItem(const std::string& name, uint64_t off, const std::string& data) {
    v1::Item it;
    it.set_name(name);
    it.set_dtype(v1::DTYPE_U8);
    it.add_shape(data.size());
    it.set_offset_bytes(off);
    it.set_length_bytes(data.size());
    it.set_crc32c(Crc32c(data));
    return it;
  }

  grpc::Status Commit(const std::string& lease_id, uint64_t size, const std::vector<v1::Item>& items,
                      v1::CommitShardResponse* resp, const std::string& session_id = "") {
    v1::CommitShardRequest req;
    req.set_lease_id(lease_id);
    req.set_session_id(session_id);
    req.set_size_bytes(size);
    for (const v1::Item& it : items) *req.add_items() = it;
    grpc::ClientContext ctx;
    return local_->CommitShard(&ctx, req, resp);
  }

  // One rank's shard: items "w" (data) and "b" (8 bytes) at offset 4096.
  void Save(const std::string& job, uint64_t step, uint32_t rank, const std::string& data) {
    const std::string bias = Pattern(8, rank + 100);
    v1::AcquireStagingLeaseResponse lease;
    grpc::Status s = Lease(job, step, rank, data.size() + 8192, &lease);
    ASSERT_TRUE(s.ok()) << s.error_message();
    const uint64_t b_off = (data.size() + 4095) / 4096 * 4096;
    WriteRegions(lease, 0, data);
    WriteRegions(lease, b_off, bias);
    v1::CommitShardResponse resp;
    s = Commit(lease.lease_id(), b_off + 8, {MakeItem("w", 0, data), MakeItem("b", b_off, bias)}, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }

  // The agent begins versions at meta in the background, so right after a
  // commit meta may not know the version yet: NotFound is retried for 10 s
  // (bounded polling), as the client's SaveHandle::Wait does.
  grpc::Status WaitVersion(const std::string& job, uint64_t step, v1::DurabilityLevel level) {
    v1::WaitVersionRequest req;
    req.set_job_id(job);
    req.set_step(step);
    req.set_level(level);
    req.set_timeout_ms(60000);
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (true) {
      v1::WaitVersionResponse resp;
      grpc::ClientContext ctx;
      grpc::Status s = meta_->stub()->WaitVersion(&ctx, req, &resp);
      if (s.error_code() != grpc::StatusCode::NOT_FOUND || absl::Now() > give_up) return s;
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  void ExpectDurable(const std::string& job, uint64_t step, const std::vector<std::string>& data) {
    const std::string dir = absl::StrCat(agent_->options().durable_root, "/", job, "/", step);
    absl::StatusOr<DurableManifest> m = ReadDurableManifest(PosixFileSystem(), dir);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_EQ(m->shards.size(), data.size());
    for (size_t r = 0; r < data.size(); ++r) {
      std::vector<std::byte> bytes(m->shards[r].size_bytes);
      ASSERT_TRUE(ReadRankFile(PosixFileSystem(), dir, m->shards[r], bytes).ok());
      EXPECT_EQ(std::memcmp(bytes.data(), data[r].data(), data[r].size()), 0) << "rank " << r;
    }
  }

  std::unique_ptr<v1::AgentService::Stub> local_;
};

TEST_F(AgentIntegrationTest, RanksSaveMetaSeesStagedFlushWritesDurableFilesPersisted) {
  ASSERT_TRUE(CreateJob("train", 3, 1).ok());
  std::vector<std::string> data = {Pattern(100000, 1), Pattern(5000, 2), Pattern(1 << 20, 3)};
  for (uint32_t r = 0; r < 3; ++r) Save("train", 20, r, data[r]);
  grpc::Status s = WaitVersion("train", 20, v1::DURABILITY_LEVEL_STAGED);
  ASSERT_TRUE(s.ok()) << s.error_message();
  s = WaitVersion("train", 20, v1::DURABILITY_LEVEL_PERSISTED);
  ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << agent_->proc()->LogTail();
  ExpectDurable("train", 20, data);
  int code = 0;
  absl::StatusOr<std::string> metrics = testing::HttpGet("127.0.0.1", agent_->metrics_port(), "/metrics", &code);
  ASSERT_TRUE(metrics.ok());
  EXPECT_THAT(*metrics, HasSubstr("ckpt_agent_flush_shards_total 3"));
  EXPECT_THAT(*metrics, HasSubstr("ckpt_agent_staged_shards_total 3"));
}

// Most tests end with SIGKILL; this one stops both daemons the way systemd and Kubernetes
// do, after a save and a flush, and expects exit code 0. Under ASan/UBSan that exit is
// where the daemons check for leaks, so a leak on these paths fails here.
// ckpt-agent --cpus: every thread of a running agent (transport, gRPC,
// flush, logging) runs on the CPU named only, and it serves as any other; a
// CPU the agent may not use is a usage error naming those it may.
TEST_F(AgentIntegrationTest, CpusConfinesEveryThreadOfTheAgent) {
  const std::vector<int> allowed = AllowedCpus();
  ASSERT_FALSE(allowed.empty());
  const std::string cpu = std::to_string(allowed.back());
  AgentProcessOptions o;
  o.node_id = "node-pinned";
  o.meta_address = meta_->address();
  o.dir = *dir_->Sub("pinned");
  o.memory = "16MiB";
  o.extra_args = {"--cpus", cpu};
  absl::StatusOr<std::unique_ptr<AgentProcess>> pinned = AgentProcess::Start(o);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  const pid_t pid = (*pinned)->proc()->pid();
  int threads = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task")) {
    std::ifstream in(task.path() / "status");
    std::string line, name, list;
    while (std::getline(in, line)) {
      if (line.rfind("Name:", 0) == 0) name = line.substr(6);
      if (line.rfind("Cpus_allowed_list:", 0) == 0) list = line.substr(line.find_first_not_of(" \t", 18));
    }
    if (list.empty()) continue;  // the thread ended meanwhile
    ++threads;
    EXPECT_EQ(list, cpu) << "thread " << task.path().filename() << " (" << name << ")";
  }
  EXPECT_GT(threads, 3);  // gRPC's, the transport's and the agent's own
  EXPECT_THAT((*pinned)->proc()->LogTail(65536), HasSubstr("runs on CPUs " + cpu + " only (--cpus)"));
  ExpectCleanStop(*(*pinned)->proc());

  const std::string run = *dir_->Sub("refused");
  testing::SubprocessOptions bad;
  bad.argv = {testing::BinaryPath("ckpt-agent"), "--node-id", "node-refused", "--meta", meta_->address(), "--listen",
              "127.0.0.1:0", "--data-listen", "127.0.0.1:0", "--run-dir", run + "/run", "--memory-dir",
              run + "/mem", "--memory", "16MiB", "--cpus", "1023"};
  absl::StatusOr<testing::RunResult> r = testing::RunToCompletion(bad, absl::Seconds(60));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->status.exited() && r->status.exit_code() == 2) << r->status << "\n" << r->stderr_text;
  EXPECT_THAT(r->stderr_text, HasSubstr("--cpus 1023: CPU 1023 is not one this agent may run on (it may use " +
                                        FormatCpuList(allowed) + ")"));
  bad.argv.back() = "2-1";
  r = testing::RunToCompletion(bad, absl::Seconds(60));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->status.exited() && r->status.exit_code() == 2) << r->status;
  EXPECT_THAT(r->stderr_text, HasSubstr("range 2-1 ends below its start"));
  EXPECT_FALSE(std::filesystem::exists(run + "/mem"));
}

TEST_F(AgentIntegrationTest, AfterAWorkloadBothDaemonsStopCleanlyOnSigterm) {
  ASSERT_TRUE(CreateJob("stop", 2, 1).ok());
  const std::vector<std::string> data = {Pattern(300000, 7), Pattern(4000, 8)};
  for (uint32_t r = 0; r < 2; ++r) Save("stop", 5, r, data[r]);
  grpc::Status s = WaitVersion("stop", 5, v1::DURABILITY_LEVEL_PERSISTED);
  ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << agent_->proc()->LogTail();
  ExpectCleanStop(*agent_->proc());
  ExpectCleanStop(*meta_->proc());
}

TEST_F(AgentIntegrationTest, Kill9BetweenCommitAndFlushReadoptsAndFlushCompletes) {
  ASSERT_TRUE(CreateJob("k9", 2, 0).ok());  // no flush policy: nothing is flushed yet
  std::vector<std::string> data = {Pattern(300000, 7), Pattern(70000, 8)};
  Save("k9", 5, 0, data[0]);
  Save("k9", 5, 1, data[1]);
  ASSERT_TRUE(WaitVersion("k9", 5, v1::DURABILITY_LEVEL_PROTECTED).ok());
  ASSERT_TRUE(agent_->proc()->Kill(SIGKILL).ok());
  ASSERT_TRUE(agent_->proc()->Wait().ok());
  ASSERT_TRUE(agent_->Restart().ok());
  absl::StatusOr<std::string> log = agent_->proc()->ReadLog();
  EXPECT_THAT(*log, HasSubstr("re-adopted 2 holdings, 0 lost"));
  v1::FlushVersionRequest req;
  req.set_job_id("k9");
  req.set_step(5);
  v1::FlushVersionResponse resp;
  grpc::ClientContext ctx;
  ASSERT_TRUE(meta_->stub()->FlushVersion(&ctx, req, &resp).ok());
  grpc::Status s = WaitVersion("k9", 5, v1::DURABILITY_LEVEL_PERSISTED);
  ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << agent_->proc()->LogTail();
  ExpectDurable("k9", 5, data);
}

TEST_F(AgentIntegrationTest, AfterMemoryIsLostAPersistedShardIsRestoredFromTheDurableTier) {
  ASSERT_TRUE(CreateJob("dur", 1, 1).ok());
  const std::string data = Pattern(200000, 11);
  Save("dur", 3, 0, data);
  ASSERT_TRUE(WaitVersion("dur", 3, v1::DURABILITY_LEVEL_PERSISTED).ok());
  // The node reboots: the agent and its tmpfs are gone.
  ASSERT_TRUE(agent_->proc()->Kill(SIGKILL).ok());
  ASSERT_TRUE(agent_->proc()->Wait().ok());
  std::filesystem::remove_all(agent_->memory_dir());
  ASSERT_TRUE(agent_->Restart().ok());

  v1::LocateRequest lreq;
  lreq.set_job_id("dur");
  lreq.set_step(3);
  lreq.set_rank(0);
  lreq.set_near_node_id("node-1");
  v1::LocateResponse loc;
  {
    grpc::ClientContext ctx;
    grpc::Status s = meta_->stub()->Locate(&ctx, lreq, &loc);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  v1::OpenShardRequest req;
  *req.mutable_key() = loc.shard().key();
  *req.mutable_sources() = loc.sources();
  *req.mutable_expected() = loc.shard();
  v1::OpenShardResponse resp;
  grpc::ClientContext ctx;
  grpc::Status s = local_->OpenShard(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.served_from().kind(), v1::SOURCE_KIND_DURABLE);
  ASSERT_EQ(resp.regions_size(), 1);
  std::string got(data.size(), '\0');
  const int fd = ::open(resp.regions(0).path().c_str(), O_RDONLY);
  ASSERT_EQ(::pread(fd, got.data(), got.size(), static_cast<off_t>(resp.regions(0).file_offset_bytes())),
            static_cast<ssize_t>(got.size()));
  ::close(fd);
  EXPECT_EQ(got, data);
}

TEST_F(AgentIntegrationTest, MetaRestartAgentReReportsAndKeepsServing) {
  ASSERT_TRUE(CreateJob("mr", 1, 0).ok());
  const std::string one = Pattern(50000, 21);
  Save("mr", 1, 0, one);
  ASSERT_TRUE(WaitVersion("mr", 1, v1::DURABILITY_LEVEL_PROTECTED).ok());
  ASSERT_TRUE(meta_->proc()->Kill(SIGKILL).ok());
  ASSERT_TRUE(meta_->proc()->Wait().ok());
  // While meta is down, a new step of the known job still saves.
  const std::string two = Pattern(60000, 22);
  Save("mr", 2, 0, two);
  ASSERT_TRUE(meta_->Restart().ok());
  // The agent re-registers or re-reports its inventory, then begins step 2
  // and reports it: the version reaches PROTECTED with no client action.
  grpc::Status s;
  for (int i = 0; i < 300; ++i) {  // bounded: until the agent has begun step 2
    s = WaitVersion("mr", 2, v1::DURABILITY_LEVEL_PROTECTED);
    if (s.error_code() != grpc::StatusCode::NOT_FOUND) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << agent_->proc()->LogTail();
  v1::ListNodesRequest req;
  v1::ListNodesResponse resp;
  grpc::ClientContext ctx;
  ASSERT_TRUE(meta_->stub()->ListNodes(&ctx, req, &resp).ok());
  ASSERT_EQ(resp.nodes_size(), 1);
  EXPECT_EQ(resp.nodes(0).state(), v1::NODE_STATE_ALIVE);
  // Step 1's copy is still known to meta as readable.
  v1::LocateRequest lreq;
  lreq.set_job_id("mr");
  lreq.set_step(1);
  lreq.set_rank(0);
  v1::LocateResponse loc;
  grpc::ClientContext lctx;
  grpc::Status ls = meta_->stub()->Locate(&lctx, lreq, &loc);
  ASSERT_TRUE(ls.ok()) << ls.error_message();
  EXPECT_GE(loc.sources_size(), 1);
}

TEST_F(AgentIntegrationTest, CorruptedPoolByteIsDataLossOnOpen) {
  ASSERT_TRUE(CreateJob("bad", 1, 0).ok());
  v1::AcquireStagingLeaseResponse lease;
  ASSERT_TRUE(Lease("bad", 1, 0, 4096, &lease).ok());
  const std::string data = Pattern(1000, 9);
  WriteRegions(lease, 0, data);
  v1::CommitShardResponse committed;
  ASSERT_TRUE(Commit(lease.lease_id(), 1000, {MakeItem("w", 0, data)}, &committed).ok());
  ASSERT_TRUE(WaitVersion("bad", 1, v1::DURABILITY_LEVEL_STAGED).ok());
  std::string flipped = data.substr(500, 1);
  flipped[0] ^= 0x01;
  WriteRegions(lease, 500, flipped);  // the pool is the agent's now: simulate a memory error
  v1::OpenShardRequest req;
  req.mutable_key()->set_job_id("bad");
  req.mutable_key()->set_step(1);
  req.mutable_key()->set_rank(0);
  v1::OpenShardResponse resp;
  grpc::ClientContext ctx;
  grpc::Status s = local_->OpenShard(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_THAT(s.error_message(), HasSubstr("\"w\""));
}

TEST_F(AgentIntegrationTest, BadInputGetsClearErrors) {
  ASSERT_TRUE(CreateJob("job", 2, 0).ok());
  v1::AcquireStagingLeaseResponse lease;
  grpc::Status s = Lease("job", 1, 0, 64 << 20, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("larger than the whole memory tier"));
  s = Lease("nosuchjob", 1, 0, 100, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  s = Lease("job", 1, 2, 100, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  s = Lease("../../etc", 1, 0, 100, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr(".."));

  ASSERT_TRUE(Lease("job", 1, 0, 8192, &lease).ok());
  const std::string a = Pattern(100, 1);
  WriteRegions(lease, 0, a);
  v1::CommitShardResponse resp;
  s = Commit(lease.lease_id(), 0, {MakeItem("a", 0, a), MakeItem("b", 50, a)}, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("overlap"));
  s = Commit(lease.lease_id(), 0, {MakeItem("a", 8150, a)}, &resp);
  EXPECT_THAT(s.error_message(), HasSubstr("outside"));
  s = Commit(lease.lease_id(), 0, {MakeItem("bad\x01name", 0, a)}, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(Commit(lease.lease_id(), 100, {MakeItem("a", 0, a)}, &resp).ok());
  EXPECT_EQ(resp.shard().crc32c(), Crc32c(a));
  s = Commit(lease.lease_id(), 100, {MakeItem("a", 0, a)}, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  s = Commit("no-such-lease", 100, {}, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

// Issue 34 finding 5, through the real daemons: an item c128 [2^63, 2^61] of
// length 0 (2^128 bytes, which wrapped to 0) was accepted by CommitShard and
// the version reached PROTECTED. It is refused with InvalidArgument naming
// the item and the numbers, sent packed (as the client sends manifests) or as
// items; meta never hears of a staged shard, and the lease stays usable for a
// correct commit, after which the version holds only that commit's items.
TEST_F(AgentIntegrationTest, ManifestWhoseSizeWrapsAroundIsRefusedAndNothingIsStaged) {
  ASSERT_TRUE(CreateJob("wrap", 1, 0).ok());
  v1::AcquireStagingLeaseResponse lease;
  ASSERT_TRUE(Lease("wrap", 1, 0, 4096, &lease).ok());
  const std::string data = Pattern(64, 5);
  WriteRegions(lease, 0, data);
  const v1::Item w = MakeItem("w", 0, data);
  v1::Item huge;
  huge.set_name("huge");
  huge.set_dtype(v1::DTYPE_C128);
  huge.add_shape(uint64_t{1} << 63);
  huge.add_shape(uint64_t{1} << 61);
  huge.set_offset_bytes(64);
  huge.set_length_bytes(0);

  std::vector<ManifestItem> packed(2);
  for (size_t i = 0; i < 2; ++i) {
    const v1::Item& from = i == 0 ? w : huge;
    packed[i].name = from.name();
    packed[i].dtype = from.dtype();
    packed[i].shape.assign(from.shape().begin(), from.shape().end());
    packed[i].offset_bytes = from.offset_bytes();
    packed[i].length_bytes = from.length_bytes();
    packed[i].crc32c = from.crc32c();
  }
  v1::CommitShardRequest req;
  req.set_lease_id(lease.lease_id());
  req.set_size_bytes(64);
  req.set_manifest(EncodeManifest(packed));
  v1::CommitShardResponse resp;
  grpc::ClientContext ctx;
  grpc::Status s = local_->CommitShard(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  for (const char* want : {"\"huge\"", "is 0 bytes", "c128", "[9223372036854775808, 2305843009213693952]",
                           "more than 2^64"}) {
    EXPECT_THAT(s.error_message(), HasSubstr(want));
  }
  s = Commit(lease.lease_id(), 64, {w, huge}, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("more than 2^64"));

  // Nothing staged at meta: the version is unknown (the agent begins it in
  // the background) or open with no shard.
  {
    v1::GetVersionRequest get;
    get.set_job_id("wrap");
    get.set_step(1);
    v1::GetVersionResponse version;
    grpc::ClientContext get_ctx;
    const grpc::Status got = meta_->stub()->GetVersion(&get_ctx, get, &version);
    if (got.ok()) {
      EXPECT_EQ(version.version().state(), v1::VERSION_STATE_OPEN);
      EXPECT_EQ(version.version().shards_staged(), 0u);
    } else {
      EXPECT_EQ(got.error_code(), grpc::StatusCode::NOT_FOUND) << got.error_message();
    }
  }

  // The same lease, a correct manifest: the version is protected with "w" alone.
  ASSERT_TRUE(Commit(lease.lease_id(), 64, {w}, &resp).ok());
  ASSERT_TRUE(WaitVersion("wrap", 1, v1::DURABILITY_LEVEL_PROTECTED).ok());
  v1::GetVersionRequest get;
  get.set_job_id("wrap");
  get.set_step(1);
  get.set_include_items(true);
  v1::GetVersionResponse version;
  grpc::ClientContext get_ctx;
  ASSERT_TRUE(meta_->stub()->GetVersion(&get_ctx, get, &version).ok());
  ASSERT_EQ(version.version().shards_size(), 1);
  const v1::ShardInfo& info = version.version().shards(0).info();
  ASSERT_EQ(info.items_size(), 1);
  EXPECT_EQ(info.items(0).name(), "w");
}

// ReadShard on the wire: the first message is the shard's record alone, every
// data message carries at most chunk_bytes (so any shard size fits any
// client's message limit), and a chunk size out of range is a clear error.
TEST_F(AgentIntegrationTest, ReadShardStreamsBoundedChunksAfterTheRecord) {
  ASSERT_TRUE(CreateJob("rd", 1, 0).ok());
  const std::string data = Pattern(50000, 9);
  Save("rd", 1, 0, data);
  auto read = [&](uint64_t chunk, std::vector<v1::ReadShardResponse>* msgs) {
    v1::ReadShardRequest req;
    req.mutable_shard()->set_job_id("rd");
    req.mutable_shard()->set_step(1);
    req.mutable_shard()->set_rank(0);
    req.set_chunk_bytes(chunk);
    grpc::ClientContext ctx;
    auto reader = local_->ReadShard(&ctx, req);
    v1::ReadShardResponse m;
    while (reader->Read(&m)) msgs->push_back(m);
    return reader->Finish();
  };
  std::vector<v1::ReadShardResponse> msgs;
  grpc::Status s = read(4096, &msgs);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_GE(msgs.size(), 2u);
  EXPECT_TRUE(msgs[0].has_shard());
  EXPECT_TRUE(msgs[0].data().empty());
  EXPECT_EQ(msgs[0].shard().items_size(), 2);
  const uint64_t size = msgs[0].shard().size_bytes();
  std::string got;
  for (size_t i = 1; i < msgs.size(); ++i) {
    EXPECT_FALSE(msgs[i].has_shard());
    EXPECT_EQ(msgs[i].offset_bytes(), got.size());
    EXPECT_LE(msgs[i].data().size(), 4096u);
    EXPECT_EQ(Crc32c(msgs[i].data()), msgs[i].chunk_crc32c());
    got += msgs[i].data();
  }
  ASSERT_EQ(got.size(), size);
  EXPECT_EQ(got.substr(0, data.size()), data);
  EXPECT_EQ(Crc32c(got), msgs[0].shard().crc32c());

  for (uint64_t bad : {uint64_t{1}, uint64_t{4095}, (uint64_t{4} << 20) + 1, uint64_t{1} << 40}) {
    msgs.clear();
    s = read(bad, &msgs);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
    EXPECT_THAT(s.error_message(), HasSubstr("chunk_bytes")) << bad;
    EXPECT_TRUE(msgs.empty());
  }
}

}  // namespace
}  // namespace ckpt

namespace ckpt {
namespace {

// Issue 34 finding 6, through the real daemons: two trainers of one job and
// rank, each with its own session. Lease ids are 128 random bits; the second
// trainer's lease for the rank the first holds is refused (naming the
// holder's pid, not its ids); neither it nor a call without a session can
// commit, abort or close what the first took; the first's commit goes
// through and the shard is its bytes exactly. Once the first trainer's
// connection is gone (it exited), its lease may be replaced at once.
TEST_F(AgentIntegrationTest, ALeaseAndAHandleBelongToTheSessionThatTookThem) {
  ASSERT_TRUE(CreateJob("two", 1, 0).ok());
  const std::string sessions = agent_->run_dir() + "/session.sock";
  std::unique_ptr<RawSession> a = RawSession::Open(sessions);
  std::unique_ptr<RawSession> b = RawSession::Open(sessions);
  ASSERT_TRUE(a != nullptr && b != nullptr);
  EXPECT_TRUE(ckpt::testing::IsHexId(a->id(), "")) << a->id();
  EXPECT_NE(a->id(), b->id());

  const std::string data = Pattern(3000, 61);
  v1::AcquireStagingLeaseResponse la;
  grpc::Status s = Lease("two", 1, 0, 8192, &la, a->id(), 4242);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(ckpt::testing::IsHexId(la.lease_id(), "l-")) << la.lease_id();
  WriteRegions(la, 0, data);

  // The second trainer's lease for the same (job, step, rank): refused.
  v1::AcquireStagingLeaseResponse lb;
  s = Lease("two", 1, 0, 8192, &lb, b->id());
  ASSERT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("pid 4242"));
  EXPECT_THAT(s.error_message(), ::testing::Not(HasSubstr(a->id())));
  EXPECT_THAT(s.error_message(), ::testing::Not(HasSubstr(la.lease_id())));
  EXPECT_EQ(Lease("two", 1, 0, 8192, &lb, "").error_code(), grpc::StatusCode::FAILED_PRECONDITION);

  // Nobody else commits or aborts it: PERMISSION_DENIED, nothing changes.
  const std::string other(data.size(), 'x');
  for (const std::string& session : {b->id(), std::string()}) {
    v1::CommitShardResponse resp;
    s = Commit(la.lease_id(), data.size(), {MakeItem("w", 0, other)}, &resp, session);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    v1::AbortLeaseRequest abort;
    abort.set_lease_id(la.lease_id());
    abort.set_session_id(session);
    v1::AbortLeaseResponse aresp;
    grpc::ClientContext ctx;
    s = local_->AbortLease(&ctx, abort, &aresp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  }

  // The first trainer's commit goes through: its bytes, exactly.
  v1::CommitShardResponse committed;
  s = Commit(la.lease_id(), data.size(), {MakeItem("w", 0, data)}, &committed, a->id());
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(committed.shard().crc32c(), Crc32c(data));
  {
    v1::ReadShardRequest req;
    req.mutable_shard()->set_job_id("two");
    req.mutable_shard()->set_step(1);
    req.mutable_shard()->set_rank(0);
    grpc::ClientContext ctx;
    auto reader = local_->ReadShard(&ctx, req);
    v1::ReadShardResponse m;
    std::string got;
    while (reader->Read(&m)) got += m.data();
    ASSERT_TRUE(reader->Finish().ok());
    EXPECT_EQ(got, data);
  }

  // A handle is its session's too.
  v1::OpenShardRequest open;
  open.mutable_key()->set_job_id("two");
  open.mutable_key()->set_step(1);
  open.mutable_key()->set_rank(0);
  open.set_session_id(a->id());
  v1::OpenShardResponse opened;
  {
    grpc::ClientContext ctx;
    s = local_->OpenShard(&ctx, open, &opened);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_TRUE(ckpt::testing::IsHexId(opened.handle_id(), "h-")) << opened.handle_id();
  auto close = [&](const std::string& session) {
    v1::CloseShardRequest req;
    req.set_handle_id(opened.handle_id());
    req.set_session_id(session);
    v1::CloseShardResponse resp;
    grpc::ClientContext ctx;
    return local_->CloseShard(&ctx, req, &resp);
  };
  EXPECT_EQ(close(b->id()).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(close("").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(close(a->id()).ok());

  // The first trainer exits with a lease open: a restarted trainer (a new
  // session) gets the rank's lease as soon as the agent saw the hang-up,
  // without waiting for the dead session's grace period.
  ASSERT_TRUE(Lease("two", 2, 0, 8192, &la, a->id()).ok());
  a.reset();
  const absl::Time give_up = absl::Now() + absl::Seconds(5);  // well inside the 10 s grace
  while (true) {
    s = Lease("two", 2, 0, 8192, &lb, b->id());
    if (s.ok() || s.error_code() != grpc::StatusCode::FAILED_PRECONDITION || absl::Now() > give_up) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(s.ok()) << s.error_message();
  WriteRegions(lb, 0, other);
  v1::CommitShardResponse again;
  s = Commit(lb.lease_id(), other.size(), {MakeItem("w", 0, other)}, &again, b->id());
  EXPECT_TRUE(s.ok()) << s.error_message();
}

}  // namespace
}  // namespace ckpt
