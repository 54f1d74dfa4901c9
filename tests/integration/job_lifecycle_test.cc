// Jobs and versions as a new user meets them, on real ckpt-meta and three
// ckpt-agent processes on 127.0.0.1 (issue 13 #2, #3, #7):
// - a job an operator created with `ckptctl create-job --replicate 2` or
//   `--ec 2+1` is opened by `ckptctl save` and by a client that states no
//   protection, with its stored policy (and reaches PROTECTED under it); a
//   client that states another protection gets FAILED_PRECONDITION naming
//   both; `create-job` with no protection flag gets the server's default;
// - a version a rank never finished (3 of 4 shards) does not stop the job:
//   the next save by every rank reaches PROTECTED and supersedes it (reason
//   visible in GetVersion and `ckptctl versions`); a step above 2^53-1 is
//   refused with INVALID_ARGUMENT at every entry (client, agent, meta,
//   ckptctl) and the job keeps working; a trainer waiting for a step meta
//   refuses is told why.
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "ckpt/client.h"
#include "ckpt/v1/agent.grpc.pb.h"
#include "ckpt/v1/meta.grpc.pb.h"
#include "integration/agent_process.h"
#include "integration/client_options.h"
#include "integration/meta_process.h"
#include "integration/node_cluster.h"
#include "support/process.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using testing::AgentProcess;
using testing::AgentProcessOptions;
using testing::MetaProcess;
using testing::RunResult;
using testing::TempDir;

constexpr absl::Duration kLong = absl::Seconds(60);
constexpr uint64_t kHugeStep = ~uint64_t{0};  // 2^64-1, the step of the issue

std::vector<uint8_t> RankBytes(uint32_t rank, uint64_t step, size_t n) {
  std::mt19937 rng(static_cast<uint32_t>(rank * 7919 + step));
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

class JobLifecycleTest : public testing::NodesClusterTest {
 protected:
  JobLifecycleTest() : NodesClusterTest(3, "48MiB") {}

  RunResult Ctl(std::vector<std::string> args) {
    testing::SubprocessOptions o;
    o.argv = {testing::BinaryPath("ckptctl"), "--meta", meta_->address()};
    for (std::string& a : args) o.argv.push_back(std::move(a));
    absl::StatusOr<RunResult> r = testing::RunToCompletion(o, absl::Seconds(60));
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return RunResult{testing::ExitStatus(-1), "", ""};
    return *std::move(r);
  }

  // A file of `n` bytes under the test dir.
  std::string File(const std::string& name, size_t n, uint32_t seed) {
    const std::string path = absl::StrCat(dir_->path(), "/", name);
    const std::vector<uint8_t> bytes = RankBytes(seed, 0, n);
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return path;
  }

  ClientOptions Options(const std::string& job, uint32_t rank, uint32_t world) {
    return testing::ClientOptionsFor(*meta_, *agents_[rank % agents_.size()], job, rank, world);
  }

  // Rank `rank` (on node rank % 3) saves `step`; the handle, or the error.
  absl::StatusOr<SaveHandle> Save(Client& c, uint64_t step) {
    const std::vector<uint8_t> data = RankBytes(c.options().rank, step, 64 << 10);
    SaveBuilder s = c.BeginSave(step);
    absl::Status added = s.Add("state", std::as_bytes(std::span<const uint8_t>(data)), DType::kU8, {data.size()});
    if (!added.ok()) return added;
    return s.Commit();
  }

  v1::VersionInfo Version(const std::string& job, uint64_t step) {
    v1::GetVersionRequest req;
    req.set_job_id(job);
    req.set_step(step);
    v1::GetVersionResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = meta_->stub()->GetVersion(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.version();
  }

  grpc::Status WaitProtected(const std::string& job, uint64_t step) {
    v1::WaitVersionRequest req;
    req.set_job_id(job);
    req.set_step(step);
    req.set_level(v1::DURABILITY_LEVEL_PROTECTED);
    req.set_timeout_ms(absl::ToInt64Milliseconds(kLong));
    // The agents begin versions in the background: NOT_FOUND is retried for
    // 10 s (bounded polling), as the client's SaveHandle::Wait does.
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (true) {
      v1::WaitVersionResponse resp;
      grpc::ClientContext ctx;
      grpc::Status s = meta_->stub()->WaitVersion(&ctx, req, &resp);
      if (s.error_code() != grpc::StatusCode::NOT_FOUND || absl::Now() > give_up) return s;
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  v1::JobSpec Spec(const std::string& job) {
    v1::GetJobRequest req;
    req.set_job_id(job);
    v1::GetJobResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = meta_->stub()->GetJob(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.job().spec();
  }
};

TEST_F(JobLifecycleTest, OperatorCreatedJobsOpenWithoutRepeatingTheirProtection) {
  RunResult r = Ctl({"create-job", "rep", "--world-size", "4", "--replicate", "2"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  r = Ctl({"create-job", "ec", "--world-size", "3", "--ec", "2+1"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;

  // `ckptctl save` into the replicated job, with and without --world-size.
  const std::string file = File("shard.bin", 200 << 10, 1);
  for (uint32_t rank = 0; rank < 4; ++rank) {
    std::vector<std::string> args = {"save", "rep", "10", file, "--rank", std::to_string(rank),
                                     "--agent-socket", agents_[rank % 3]->socket_path()};
    if (rank >= 2) args.insert(args.end(), {"--world-size", "4"});
    r = Ctl(args);
    ASSERT_TRUE(r.status.success()) << "rank " << rank << ": " << r.stderr_text;
  }
  grpc::Status w = WaitProtected("rep", 10);
  ASSERT_TRUE(w.ok()) << w.error_message() << "\n" << Logs();
  ASSERT_TRUE(Spec("rep").protection().has_replicate());
  EXPECT_EQ(Spec("rep").protection().replicate().copies(), 2u);
  const v1::VersionInfo rep10 = Version("rep", 10);
  for (const v1::ShardDetail& s : rep10.shards()) {
    EXPECT_EQ(s.copies_size(), 2) << "rank " << s.info().key().rank() << " is not replicated";
  }

  // A C++ client that states no protection, into the EC job.
  std::vector<Client> clients;
  std::vector<SaveHandle> handles;
  for (uint32_t rank = 0; rank < 3; ++rank) {
    absl::StatusOr<Client> c = Client::Connect(Options("ec", rank, 3));
    ASSERT_TRUE(c.ok()) << "rank " << rank << ": " << c.status();
    absl::StatusOr<SaveHandle> h = Save(*c, 5);
    ASSERT_TRUE(h.ok()) << h.status();
    handles.push_back(*h);
    clients.push_back(*std::move(c));
  }
  for (SaveHandle& h : handles) {
    absl::Status st = h.Wait(Level::kProtected, absl::Now() + kLong);
    ASSERT_TRUE(st.ok()) << st << "\n" << Logs();
  }
  EXPECT_TRUE(Spec("ec").protection().has_ec());
  EXPECT_EQ(Version("ec", 5).segments_size(), 3 * 3) << "3 stripes of 2+1 segments";

  // A client that states another protection is refused, naming both.
  ClientOptions other = Options("rep", 0, 4);
  other.protection = Protection::None();
  absl::StatusOr<Client> refused = Client::Connect(other);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("protection (stored replicate{2, ring}, asked none)"));
  other.protection = Protection::Replicate(2);
  EXPECT_TRUE(Client::Connect(other).ok()) << "the same protection, stated, opens the job";

  // No protection flag: the server's default, replicate:2:ring on 3 nodes.
  r = Ctl({"create-job", "dflt", "--world-size", "1"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("protection replicate:2:ring, the server's default"));
  r = Ctl({"save", "dflt", "1", file, "--rank", "0", "--agent-socket", agents_[0]->socket_path()});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  w = WaitProtected("dflt", 1);
  EXPECT_TRUE(w.ok()) << w.error_message() << "\n" << Logs();
}

TEST_F(JobLifecycleTest, AVersionARankNeverFinishedNeverBlocksTheJob) {
  constexpr uint32_t kWorld = 4;
  std::vector<Client> clients;
  for (uint32_t rank = 0; rank < kWorld; ++rank) {
    absl::StatusOr<Client> c = Client::Connect(Options("train", rank, kWorld));
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(*std::move(c));
  }
  // Step 100: ranks 0-2 save; rank 3 dies before its save.
  for (uint32_t rank = 0; rank < 3; ++rank) ASSERT_TRUE(Save(clients[rank], 100).ok());
  // The agents report in the background: wait (bounded) until meta has the three.
  const absl::Time give_up = absl::Now() + kLong;
  auto staged_ranks = [&] {
    v1::GetVersionRequest req;
    req.set_job_id("train");
    req.set_step(100);
    v1::GetVersionResponse resp;
    grpc::ClientContext ctx;
    // NOT_FOUND until an agent has begun the version.
    return meta_->stub()->GetVersion(&ctx, req, &resp).ok() ? resp.version().shards_staged() : 0;
  };
  while (staged_ranks() < 3 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));  // bounded poll of real processes
  }
  absl::Status staged = clients[0].WaitVersion(100, Level::kStaged, absl::Now() + absl::Seconds(1));
  EXPECT_EQ(staged.code(), absl::StatusCode::kDeadlineExceeded) << staged;
  EXPECT_THAT(std::string(staged.message()), HasSubstr("3 of 4 shards staged (rank 3 missing)"));
  clients.pop_back();
  absl::StatusOr<Client> restarted = Client::Connect(Options("train", 3, kWorld));
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  clients.push_back(*std::move(restarted));

  // The next save by every rank reaches PROTECTED and ends step 100.
  auto save_all = [&](uint64_t step) {
    std::vector<SaveHandle> handles;
    for (Client& c : clients) {
      absl::StatusOr<SaveHandle> h = Save(c, step);
      ASSERT_TRUE(h.ok()) << h.status();
      handles.push_back(*h);
    }
    for (SaveHandle& h : handles) {
      absl::Status st = h.Wait(Level::kProtected, absl::Now() + kLong);
      ASSERT_TRUE(st.ok()) << "step " << step << ": " << st << "\n" << Logs();
    }
  };
  save_all(110);
  const v1::VersionInfo old = Version("train", 100);
  EXPECT_EQ(old.state(), v1::VERSION_STATE_ABORTED);
  EXPECT_THAT(old.abort_reason(), HasSubstr("superseded: step 110 was staged first"));
  EXPECT_THAT(old.abort_reason(), HasSubstr("rank 3 missing"));
  absl::Status waited = clients[0].WaitVersion(100, Level::kProtected, absl::Now() + kLong);
  EXPECT_EQ(waited.code(), absl::StatusCode::kFailedPrecondition) << waited;
  EXPECT_THAT(std::string(waited.message()), HasSubstr("superseded"));
  RunResult r = Ctl({"versions", "train"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("REASON"));
  EXPECT_THAT(r.stdout_text, HasSubstr("superseded: step 110"));

  // A step of 2^64-1 is refused at every entry, and opens nothing.
  absl::StatusOr<SaveHandle> huge = Save(clients[0], kHugeStep);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument) << huge.status();
  EXPECT_THAT(std::string(huge.status().message()), HasSubstr("9007199254740991"));
  {
    auto agent = v1::AgentService::NewStub(
        grpc::CreateChannel("unix:" + agents_[0]->socket_path(), grpc::InsecureChannelCredentials()));
    v1::AcquireStagingLeaseRequest req;
    req.set_job_id("train");
    req.set_step(kHugeStep);
    req.set_rank(0);
    req.set_size_bytes(4096);
    v1::AcquireStagingLeaseResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = agent->AcquireStagingLease(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("out of range"));
  }
  {
    v1::BeginVersionRequest req;
    req.set_job_id("train");
    req.set_step(kHugeStep);
    v1::BeginVersionResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = meta_->NodeStub(agents_[0]->options().node_id)->BeginVersion(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }
  r = Ctl({"save", "train", std::to_string(kHugeStep), File("x.bin", 100, 2), "--rank", "0", "--agent-socket",
           agents_[0]->socket_path()});
  EXPECT_EQ(r.status.exit_code(), 2) << r.stdout_text << r.stderr_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("9007199254740991"));

  // The job keeps working.
  save_all(120);
  absl::StatusOr<uint64_t> latest = clients[1].Latest(Level::kProtected);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, 120u);
  v1::ListVersionsRequest lreq;
  lreq.set_job_id("train");
  v1::ListVersionsResponse lresp;
  grpc::ClientContext lctx;
  ASSERT_TRUE(meta_->stub()->ListVersions(&lctx, lreq, &lresp).ok());
  for (const v1::VersionInfo& v : lresp.versions()) EXPECT_LE(v.step(), 120u);

  // A lower step is refused by meta; the trainer's wait says why.
  ASSERT_TRUE(Save(clients[0], 115).ok());
  absl::Status lower = clients[0].WaitVersion(115, Level::kStaged, absl::Now() + kLong);
  EXPECT_EQ(lower.code(), absl::StatusCode::kNotFound) << lower;
  EXPECT_THAT(std::string(lower.message()), HasSubstr("newest version is step 120 (PROTECTED)"));
}

}  // namespace
}  // namespace ckpt
