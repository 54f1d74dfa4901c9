// Restores read only what meta placed (issue 34 finding 3, docs/security.md):
// a real ckpt-meta and two ckpt-agents (n0, n1) sharing one durable root, and
// raw OpenShard calls on n0's unix socket (the trainer's way in) and TCP port
// (ckptctl's) that name sources meta never listed for the shard asked: another
// job's durable file, a file put under the durable root by hand, a replica of
// a version meta does not serve. Each is refused, nothing lands in n0's memory
// tier, and no error states the size or crc32c of the file or copy. A source
// meta does list still restores.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "integration/agent_process.h"
#include "integration/meta_process.h"
#include "integration/node_cluster.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::AgentProcess;
using testing::AgentProcessOptions;

std::string Pattern(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class RestoreSourcesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(testing::StartMetaInTempDir(&dir_, &meta_));
    durable_ = *dir_->Sub("durable");
    for (int i = 0; i < 2; ++i) {
      AgentProcessOptions o;
      o.node_id = absl::StrCat("n", i);
      o.meta_address = meta_->address();
      o.dir = *dir_->Sub(o.node_id);
      o.durable_root = durable_;  // one shared durable tier, as on a cluster file system
      o.memory = "32MiB";
      absl::StatusOr<std::unique_ptr<AgentProcess>> a = AgentProcess::Start(o);
      ASSERT_TRUE(a.ok()) << a.status();
      agents_.push_back(*std::move(a));
      sockets_.push_back(v1::AgentService::NewStub(
          grpc::CreateChannel("unix:" + agents_.back()->socket_path(), grpc::InsecureChannelCredentials())));
    }
  }

  std::string Logs() {
    std::string out = "--- meta ---\n" + meta_->proc()->LogTail();
    for (size_t i = 0; i < agents_.size(); ++i) {
      absl::StrAppend(&out, "--- n", i, " ---\n", agents_[i]->proc()->LogTail());
    }
    return out;
  }

  void CreateJob(const std::string& job, uint32_t world, bool flush) {
    v1::CreateJobRequest req;
    req.mutable_spec()->set_job_id(job);
    req.mutable_spec()->set_world_size(world);
    req.mutable_spec()->mutable_protection()->mutable_none();
    if (flush) req.mutable_spec()->mutable_flush()->set_every_n_versions(1);
    v1::CreateJobResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = meta_->stub()->CreateJob(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
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

  // Saves `data` as rank `rank`'s shard (one item "w") through node `node`'s
  // socket; returns the shard as committed.
  v1::ShardInfo Save(int node, const std::string& job, uint64_t step, uint32_t rank, const std::string& data) {
    v1::AcquireStagingLeaseRequest lreq;
    lreq.set_job_id(job);
    lreq.set_step(step);
    lreq.set_rank(rank);
    lreq.set_size_bytes(data.size());
    lreq.set_client_pid(static_cast<uint32_t>(::getpid()));
    v1::AcquireStagingLeaseResponse lease;
    {
      grpc::ClientContext ctx;
      grpc::Status s = sockets_[node]->AcquireStagingLease(&ctx, lreq, &lease);
      EXPECT_TRUE(s.ok()) << s.error_message();
      if (!s.ok()) return {};
    }
    for (const v1::MemoryRegion& r : lease.regions()) {
      const uint64_t begin = r.shard_offset_bytes();
      const uint64_t end = std::min<uint64_t>(data.size(), r.shard_offset_bytes() + r.length_bytes());
      if (begin >= end) continue;
      const int fd = ::open(r.path().c_str(), O_RDWR);
      EXPECT_GE(fd, 0) << r.path();
      EXPECT_EQ(::pwrite(fd, data.data() + begin, end - begin, static_cast<off_t>(r.file_offset_bytes())),
                static_cast<ssize_t>(end - begin));
      ::close(fd);
    }
    v1::CommitShardRequest creq;
    creq.set_lease_id(lease.lease_id());
    creq.set_size_bytes(data.size());
    *creq.add_items() = MakeItem("w", 0, data);
    v1::CommitShardResponse committed;
    grpc::ClientContext ctx;
    grpc::Status s = sockets_[node]->CommitShard(&ctx, creq, &committed);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return committed.shard();
  }

  // The agent begins versions at meta in the background: NotFound is
  // retried for 10 s (bounded polling).
  void WaitVersion(const std::string& job, uint64_t step, v1::DurabilityLevel level) {
    v1::WaitVersionRequest req;
    req.set_job_id(job);
    req.set_step(step);
    req.set_level(level);
    req.set_timeout_ms(60000);
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    grpc::Status s;
    while (true) {
      v1::WaitVersionResponse resp;
      grpc::ClientContext ctx;
      s = meta_->stub()->WaitVersion(&ctx, req, &resp);
      if (s.error_code() != grpc::StatusCode::NOT_FOUND || absl::Now() > give_up) break;
      absl::SleepFor(absl::Milliseconds(20));
    }
    ASSERT_TRUE(s.ok()) << job << "/" << step << ": " << s.error_message() << "\n" << Logs();
  }

  v1::LocateResponse Locate(const std::string& job, uint64_t step, uint32_t rank) {
    v1::LocateRequest req;
    req.set_job_id(job);
    req.set_step(step);
    req.set_rank(rank);
    req.set_near_node_id("n0");
    v1::LocateResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = meta_->stub()->Locate(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  // An OpenShard of `key` on n0 (its socket, or its TCP port) naming `source`
  // and claiming the shard is `size` bytes with crc `crc` (one u8 item).
  grpc::Status OpenOnN0(const std::string& job, uint64_t step, uint32_t rank, const v1::ShardSource& source,
                        uint64_t size, uint32_t crc, bool tcp = false, v1::OpenShardResponse* out = nullptr) {
    v1::OpenShardRequest req;
    req.mutable_key()->set_job_id(job);
    req.mutable_key()->set_step(step);
    req.mutable_key()->set_rank(rank);
    *req.add_sources() = source;
    v1::ShardInfo* expected = req.mutable_expected();
    *expected->mutable_key() = req.key();
    expected->set_size_bytes(size);
    expected->set_crc32c(crc);
    v1::Item* item = expected->add_items();
    item->set_name("w");
    item->set_dtype(v1::DTYPE_U8);
    item->add_shape(size);
    item->set_length_bytes(size);
    item->set_crc32c(crc);
    req.set_client_pid(static_cast<uint32_t>(::getpid()));
    v1::OpenShardResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::Status s = tcp ? agents_[0]->stub()->OpenShard(&ctx, req, &resp) : sockets_[0]->OpenShard(&ctx, req, &resp);
    if (out != nullptr) *out = resp;
    return s;
  }

  static v1::ShardSource Durable(const std::string& path) {
    v1::ShardSource s;
    s.set_kind(v1::SOURCE_KIND_DURABLE);
    s.set_durable_path(path);
    return s;
  }

  // Refused (PERMISSION_DENIED or FAILED_PRECONDITION), naming the source
  // kind, and the message states neither `size` nor `crc` in any usual form.
  static void ExpectRefusedWithoutLeak(const grpc::Status& s, uint64_t size, uint32_t crc, const char* kind) {
    EXPECT_TRUE(s.error_code() == grpc::StatusCode::PERMISSION_DENIED ||
                s.error_code() == grpc::StatusCode::FAILED_PRECONDITION)
        << s.error_code() << ": " << s.error_message();
    const std::string msg = absl::AsciiStrToLower(s.error_message());
    EXPECT_THAT(msg, HasSubstr(absl::AsciiStrToLower(kind))) << s.error_message();
    EXPECT_THAT(msg, Not(HasSubstr(absl::StrCat(size)))) << s.error_message();
    EXPECT_THAT(msg, Not(HasSubstr(absl::StrFormat("%08x", crc)))) << s.error_message();
    EXPECT_THAT(msg, Not(HasSubstr(absl::StrFormat("%x", crc)))) << s.error_message();
    EXPECT_THAT(msg, Not(HasSubstr(absl::StrCat(crc)))) << s.error_message();
  }

  // Nothing of `job` is held on n0 (no restored copy landed in its pool) and
  // no handle is open there.
  void ExpectNothingLandedOnN0(const std::string& job) {
    v1::GetInventoryRequest req;
    req.set_job_id(job);
    v1::GetInventoryResponse inv;
    grpc::ClientContext ctx;
    ASSERT_TRUE(sockets_[0]->GetInventory(&ctx, req, &inv).ok());
    EXPECT_EQ(inv.entries_size(), 0) << inv.DebugString();
    v1::AgentStatusResponse st;
    grpc::ClientContext sctx;
    ASSERT_TRUE(sockets_[0]->AgentStatus(&sctx, {}, &st).ok());
    EXPECT_EQ(st.open_handles(), 0u);
  }

  std::unique_ptr<testing::TempDir> dir_;
  std::unique_ptr<testing::MetaProcess> meta_;
  std::string durable_;
  std::vector<std::unique_ptr<AgentProcess>> agents_;
  std::vector<std::unique_ptr<v1::AgentService::Stub>> sockets_;
};

// (a) Another job's file, flushed by a real flush: named as the DURABLE
// source of a shard of a job meta knows (whose own file is elsewhere) and of
// one it does not, with a made-up size/crc and then with the file's real
// ones (what the old errors told): every call is refused, nothing lands.
TEST_F(RestoreSourcesTest, AnotherJobsDurableFileIsRefusedEvenWithItsSizeAndCrc) {
  CreateJob("victim", 1, /*flush=*/true);
  CreateJob("mine", 1, /*flush=*/true);
  const std::string secret = Pattern(200000, 1);
  Save(1, "victim", 3, 0, secret);  // on n1: n0 holds no copy of it
  Save(1, "mine", 1, 0, Pattern(100000, 2));
  WaitVersion("victim", 3, v1::DURABILITY_LEVEL_PERSISTED);
  WaitVersion("mine", 1, v1::DURABILITY_LEVEL_PERSISTED);
  const std::string victim_file = "victim/3/rank-00000.bin";
  ASSERT_EQ(ReadFile(durable_ + "/" + victim_file), secret);
  const uint64_t size = secret.size();
  const uint32_t crc = Crc32c(secret);

  for (bool tcp : {false, true}) {
    SCOPED_TRACE(tcp ? "agent's TCP port" : "agent's unix socket");
    // A job meta knows, whose version meta serves from its own file.
    ExpectRefusedWithoutLeak(OpenOnN0("mine", 1, 0, Durable(victim_file), 4096, 0x12345678, tcp), size, crc,
                             "SOURCE_KIND_DURABLE");
    ExpectRefusedWithoutLeak(OpenOnN0("mine", 1, 0, Durable(victim_file), size, crc, tcp), size, crc,
                             "SOURCE_KIND_DURABLE");
    // A shard meta never heard of.
    ExpectRefusedWithoutLeak(OpenOnN0("mine", 9, 0, Durable(victim_file), 4096, 0x12345678, tcp), size, crc,
                             "SOURCE_KIND_DURABLE");
    ExpectRefusedWithoutLeak(OpenOnN0("mine", 9, 0, Durable(victim_file), size, crc, tcp), size, crc,
                             "SOURCE_KIND_DURABLE");
    ExpectRefusedWithoutLeak(OpenOnN0("nosuchjob", 1, 0, Durable(victim_file), size, crc, tcp), size, crc,
                             "SOURCE_KIND_DURABLE");
  }
  ExpectNothingLandedOnN0("mine");
  ExpectNothingLandedOnN0("nosuchjob");
  ExpectNothingLandedOnN0("victim");

  // The source meta lists for the shard asked still restores (here from
  // n1's copy, else the durable file), with the caller's `expected` left out:
  // the agent takes the shard's record from meta.
  const v1::LocateResponse loc = Locate("mine", 1, 0);
  v1::OpenShardRequest req;
  *req.mutable_key() = loc.shard().key();
  *req.mutable_sources() = loc.sources();
  req.set_packed_manifest(true);
  v1::OpenShardResponse resp;
  grpc::ClientContext ctx;
  grpc::Status s = sockets_[0]->OpenShard(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << Logs();
  EXPECT_NE(resp.served_from().kind(), v1::SOURCE_KIND_LOCAL);
  EXPECT_EQ(resp.shard().size_bytes(), loc.shard().size_bytes());
  EXPECT_EQ(resp.shard().crc32c(), loc.shard().crc32c());
  EXPECT_EQ(resp.shard().manifest_digest(), loc.shard().manifest_digest());
}

// (b) A file put under --durable-root by hand, which meta never knew of:
// refused as the source of an unknown shard and of a known one.
TEST_F(RestoreSourcesTest, AFileMetaNeverKnewOfUnderTheDurableRootIsRefused) {
  CreateJob("known", 1, /*flush=*/true);
  Save(1, "known", 1, 0, Pattern(50000, 3));
  WaitVersion("known", 1, v1::DURABILITY_LEVEL_PERSISTED);
  const std::string planted = Pattern(70000, 4);
  std::filesystem::create_directories(durable_ + "/planted/7");
  {
    std::ofstream out(durable_ + "/planted/7/rank-00000.bin", std::ios::binary);
    out.write(planted.data(), static_cast<std::streamsize>(planted.size()));
  }
  const uint64_t size = planted.size();
  const uint32_t crc = Crc32c(planted);
  const v1::ShardSource src = Durable("planted/7/rank-00000.bin");
  ExpectRefusedWithoutLeak(OpenOnN0("planted", 7, 0, src, size, crc), size, crc, "SOURCE_KIND_DURABLE");
  ExpectRefusedWithoutLeak(OpenOnN0("known", 1, 0, src, size, crc), size, crc, "SOURCE_KIND_DURABLE");
  ExpectRefusedWithoutLeak(OpenOnN0("known", 1, 0, src, 4096, 0x0badf00d), size, crc, "SOURCE_KIND_DURABLE");
  ExpectNothingLandedOnN0("planted");
  ExpectNothingLandedOnN0("known");
}

// (c) A REPLICA source meta did not place: n1 holds rank 0 of a version that
// is still OPEN (rank 1 never committed), which meta does not serve; n0 is
// asked to read it from n1 with the right size and crc. Refused, and n1's
// copy is not read.
TEST_F(RestoreSourcesTest, AReplicaMetaDoesNotServeIsRefused) {
  CreateJob("open", 2, /*flush=*/false);
  const std::string data = Pattern(80000, 5);
  const v1::ShardInfo committed = Save(1, "open", 1, 0, data);
  ASSERT_EQ(committed.crc32c(), Crc32c(data));
  // n1 has reported the copy (meta knows the version, still OPEN).
  v1::GetVersionRequest vreq;
  vreq.set_job_id("open");
  vreq.set_step(1);
  v1::GetVersionResponse version;
  for (int i = 0; i < 500; ++i) {  // bounded: the report goes in the background
    grpc::ClientContext ctx;
    if (meta_->stub()->GetVersion(&ctx, vreq, &version).ok() && version.version().shards_size() > 0) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(version.version().state(), v1::VERSION_STATE_OPEN) << version.DebugString();
  v1::ListNodesResponse nodes;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(meta_->stub()->ListNodes(&ctx, {}, &nodes).ok());
  }
  v1::ShardSource replica;
  replica.set_kind(v1::SOURCE_KIND_REPLICA);
  replica.set_role(v1::COPY_ROLE_PRIMARY);
  for (const v1::NodeInfo& n : nodes.nodes()) {
    if (n.endpoint().node_id() == "n1") *replica.mutable_holder() = n.endpoint();
  }
  ASSERT_FALSE(replica.holder().node_id().empty()) << nodes.DebugString();
  const uint64_t size = data.size();
  const uint32_t crc = Crc32c(data);
  ExpectRefusedWithoutLeak(OpenOnN0("open", 1, 0, replica, size, crc), size, crc, "SOURCE_KIND_REPLICA");
  ExpectRefusedWithoutLeak(OpenOnN0("open", 1, 0, replica, size, crc, /*tcp=*/true), size, crc,
                           "SOURCE_KIND_REPLICA");
  ExpectNothingLandedOnN0("open");
}

// (c') A REPLICA source naming a node meta lists, at an address meta does not
// (the caller's data_address is not used: meta's endpoint is), and a node that
// holds no copy: the first restores from the real n1, the second is refused.
TEST_F(RestoreSourcesTest, AReplicaIsReadOnlyAtTheNodeAndAddressMetaLists) {
  CreateJob("solo", 1, /*flush=*/false);
  const std::string data = Pattern(60000, 6);
  Save(1, "solo", 1, 0, data);
  WaitVersion("solo", 1, v1::DURABILITY_LEVEL_STAGED);
  const v1::LocateResponse loc = Locate("solo", 1, 0);
  ASSERT_GE(loc.sources_size(), 1);
  ASSERT_EQ(loc.sources(0).kind(), v1::SOURCE_KIND_REPLICA) << loc.DebugString();
  v1::ShardSource elsewhere = loc.sources(0);
  elsewhere.mutable_holder()->set_node_id("n9");  // no such node: meta lists no copy there
  ExpectRefusedWithoutLeak(OpenOnN0("solo", 1, 0, elsewhere, data.size(), Crc32c(data)), data.size(),
                           Crc32c(data), "SOURCE_KIND_REPLICA");
  ExpectNothingLandedOnN0("solo");
  v1::ShardSource rerouted = loc.sources(0);
  rerouted.mutable_holder()->set_data_address("127.0.0.1:1");  // nobody listens there
  v1::OpenShardResponse resp;
  grpc::Status s = OpenOnN0("solo", 1, 0, rerouted, 1, 1, /*tcp=*/false, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << Logs();
  EXPECT_EQ(resp.served_from().kind(), v1::SOURCE_KIND_REPLICA);
  EXPECT_EQ(resp.shard().size_bytes(), data.size());
  EXPECT_EQ(resp.shard().crc32c(), Crc32c(data));
}

}  // namespace
}  // namespace ckpt
