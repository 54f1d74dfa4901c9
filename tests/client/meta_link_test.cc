// What the client does with meta's answers (client::MetaLink), against an
// in-process fake meta (tests/client/fake_meta_link.h) and fake agent
// (tests/client/fake_agent_link.h): no server, no socket. Joining the job
// (create-or-open, idempotent; other ranks wait), Latest, the WaitVersion
// long poll and its deadlines, Locate's errors, and a save loaded back
// byte-identical through both fakes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "ckpt/client.h"
#include "client/client_core.h"
#include "fake_agent_link.h"
#include "fake_meta_link.h"

namespace ckpt {
namespace {

using ::ckpt::testing::FakeAgentLink;
using ::ckpt::testing::FakeMetaLink;
using ::testing::HasSubstr;
using ::testing::StartsWith;

using MetaCall = FakeMetaLink::Call;

std::vector<std::byte> Pattern(size_t n, int seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 37 + seed) & 0xFF);
  return v;
}

v1::JobSpec Spec(uint32_t world_size) {
  v1::JobSpec spec;
  spec.set_job_id("job");
  spec.set_world_size(world_size);
  return spec;
}

// A ClientCore whose links are fakes (not connected: JoinJob and
// ConnectAgent are the tests' to call).
struct FakeCore {
  explicit FakeCore(uint32_t rank = 0, uint32_t world_size = 1, FakeAgentLink::Options agent_options = {}) {
    auto meta_link = std::make_unique<FakeMetaLink>();
    auto agent_link = std::make_unique<FakeAgentLink>(std::move(agent_options));
    meta = meta_link.get();
    agent = agent_link.get();
    core = client::NewClientCore();
    core->options.job_id = "job";
    core->options.world_size = world_size;
    core->options.rank = rank;
    core->options.meta_address = "fake-meta:1";
    core->options.agent_socket = "/nonexistent/agent.sock";
    core->options.rpc_timeout = absl::Seconds(5);
    core->meta = std::move(meta_link);
    core->agent = std::move(agent_link);
    absl::MutexLock lock(&core->session_mu);
    core->sessions_supported = false;  // no session socket: the pool is mapped by path
  }
  // Joins (rank 0 creates the job) and connects to the fake agent.
  Client Connect() {
    absl::Status joined = client::JoinJob(*core, absl::Now() + absl::Seconds(5));
    EXPECT_TRUE(joined.ok()) << joined;
    absl::Status connected = client::ConnectAgent(*core, absl::Now());
    EXPECT_TRUE(connected.ok()) << connected;
    return client::MakeClient(core);
  }

  FakeMetaLink* meta;    // owned by core
  FakeAgentLink* agent;  // owned by core
  std::shared_ptr<client::ClientCore> core;
};

// --- JoinJob ---

TEST(MetaLinkJoin, RankZeroCreatesThenOpensTheSameJob) {
  FakeCore first;
  ASSERT_TRUE(client::JoinJob(*first.core, absl::Now()).ok());
  ASSERT_EQ(first.meta->create_requests().size(), 1u);
  const v1::CreateJobRequest req = first.meta->create_requests()[0];
  EXPECT_TRUE(req.open_if_exists());
  EXPECT_EQ(req.spec().job_id(), "job");
  EXPECT_EQ(req.spec().world_size(), 1u);
  // Again (a restarted trainer): the job exists with the same spec: opened.
  absl::Status again = client::JoinJob(*first.core, absl::Now());
  EXPECT_TRUE(again.ok()) << again;
  EXPECT_EQ(first.meta->calls(MetaCall::kCreateJob), 2);
  EXPECT_EQ(first.meta->retries(), 0);
}

TEST(MetaLinkJoin, RankZeroWithAnotherWorldSizeIsRefusedAtOnce) {
  FakeCore c(/*rank=*/0, /*world_size=*/2);
  c.meta->PutJob(Spec(4));
  absl::Status s = client::JoinJob(*c.core, absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()), StartsWith("CreateJob: "));
  EXPECT_THAT(s.message(), HasSubstr("different spec"));
  EXPECT_EQ(c.meta->calls(MetaCall::kCreateJob), 1);
}

TEST(MetaLinkJoin, RankZeroRetriesWhileMetaIsUnreachable) {
  FakeCore c;
  c.meta->FailNext(MetaCall::kCreateJob, absl::UnavailableError("connection refused"));
  c.meta->FailNext(MetaCall::kCreateJob, absl::UnavailableError("connection refused"));
  absl::Status s = client::JoinJob(*c.core, absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.meta->calls(MetaCall::kCreateJob), 3);
  EXPECT_EQ(c.meta->retries(), 2);
}

TEST(MetaLinkJoin, RankZeroGivesUpAtTheConnectDeadline) {
  FakeCore c;
  c.meta->FailNext(MetaCall::kCreateJob, absl::UnavailableError("connection refused"));
  absl::Status s = client::JoinJob(*c.core, absl::Now());  // already passed
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_EQ(s.message(),
            "ckpt-meta at fake-meta:1 unreachable within the connect timeout: CreateJob: connection refused");
}

TEST(MetaLinkJoin, OtherRanksWaitForTheJobAndCheckItsWorldSize) {
  FakeCore missing(/*rank=*/1, /*world_size=*/2);
  absl::Status s = client::JoinJob(*missing.core, absl::Now());
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()), StartsWith("rank 0 did not create job \"job\" within the connect timeout: GetJob: "));
  EXPECT_EQ(missing.meta->calls(MetaCall::kCreateJob), 0);

  FakeCore other(/*rank=*/1, /*world_size=*/2);
  other.meta->PutJob(Spec(3));
  s = client::JoinJob(*other.core, absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("exists with world size 3, this rank was started with 2"));

  FakeCore deleting(/*rank=*/1, /*world_size=*/2);
  deleting.meta->PutJob(Spec(2), /*deleting=*/true);
  s = client::JoinJob(*deleting.core, absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("is being deleted"));

  FakeCore ok(/*rank=*/1, /*world_size=*/2);
  ok.meta->PutJob(Spec(2));
  EXPECT_TRUE(client::JoinJob(*ok.core, absl::Now() + absl::Seconds(5)).ok());
}

// The order client_test cannot force with a real meta: rank 1 asks before
// rank 0 created the job, is told NotFound, waits and asks again, and joins
// once the job exists (created while it waited: the test waits until rank 1
// was refused twice before creating it).
TEST(MetaLinkJoin, ARankThatAsksBeforeRankZeroCreatedTheJobWaitsAndJoins) {
  FakeCore rank1(/*rank=*/1, /*world_size=*/2);
  absl::Status joined = absl::UnknownError("not run");
  std::thread t([&] { joined = client::JoinJob(*rank1.core, absl::Now() + absl::Minutes(1)); });
  const absl::Time deadline = absl::Now() + absl::Minutes(1);
  while (rank1.meta->calls(MetaCall::kGetJob) < 2 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  const int refused = rank1.meta->calls(MetaCall::kGetJob);
  EXPECT_GE(refused, 2) << "rank 1 never asked";
  rank1.meta->PutJob(Spec(2));  // rank 0 creates it now
  t.join();
  EXPECT_TRUE(joined.ok()) << joined;
  EXPECT_GT(rank1.meta->calls(MetaCall::kGetJob), refused) << "joined without asking after the job was created";
  EXPECT_GE(rank1.meta->retries(), refused) << "asked again without waiting";
  EXPECT_EQ(rank1.meta->calls(MetaCall::kCreateJob), 0);

  // The other order: the job exists before rank 1 asks: one GetJob, no wait.
  FakeCore late(/*rank=*/1, /*world_size=*/2);
  late.meta->PutJob(Spec(2));
  EXPECT_TRUE(client::JoinJob(*late.core, absl::Now() + absl::Minutes(1)).ok());
  EXPECT_EQ(late.meta->calls(MetaCall::kGetJob), 1);
  EXPECT_EQ(late.meta->retries(), 0);
}

// --- Latest ---

TEST(MetaLinkLatest, AsksForTheLevelAndGetsTheNewestVersionAtIt) {
  FakeCore c;
  Client client = c.Connect();
  c.meta->PutVersion("job", 10, v1::VERSION_STATE_PROTECTED);
  c.meta->PutVersion("job", 20, v1::VERSION_STATE_STAGED);
  c.meta->PutVersion("job", 30, v1::VERSION_STATE_OPEN);
  absl::StatusOr<uint64_t> protected_step = client.Latest(Level::kProtected);
  ASSERT_TRUE(protected_step.ok()) << protected_step.status();
  EXPECT_EQ(*protected_step, 10u);  // the newer STAGED one is not protected yet
  absl::StatusOr<uint64_t> staged_step = client.Latest(Level::kStaged);
  ASSERT_TRUE(staged_step.ok()) << staged_step.status();
  EXPECT_EQ(*staged_step, 20u);
  ASSERT_EQ(c.meta->latest_requests().size(), 2u);
  EXPECT_EQ(c.meta->latest_requests()[0].min_level(), v1::DURABILITY_LEVEL_PROTECTED);
  EXPECT_EQ(c.meta->latest_requests()[1].min_level(), v1::DURABILITY_LEVEL_STAGED);

  absl::StatusOr<uint64_t> none = client.Latest(Level::kPersisted);
  EXPECT_TRUE(absl::IsNotFound(none.status())) << none.status();
  EXPECT_THAT(std::string(none.status().message()), StartsWith("Latest: job \"job\" has no version at level PERSISTED"));
}

TEST(MetaLinkLatest, RetriesWhileMetaIsUnreachable) {
  FakeCore c;
  Client client = c.Connect();
  c.meta->PutVersion("job", 5, v1::VERSION_STATE_PERSISTED);
  c.meta->FailNext(MetaCall::kLatest, absl::UnavailableError("meta restarting"));
  absl::StatusOr<uint64_t> step = client.Latest(Level::kProtected);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(*step, 5u);
  EXPECT_EQ(c.meta->calls(MetaCall::kLatest), 2);
  EXPECT_EQ(c.meta->retries(), 1);
}

// --- WaitVersion ---

TEST(MetaLinkWaitVersion, ReachedLevelAnswersAtOnce) {
  FakeCore c;
  Client client = c.Connect();
  c.meta->PutVersion("job", 7, v1::VERSION_STATE_PROTECTED);
  EXPECT_TRUE(client.WaitVersion(7, Level::kStaged, absl::Now() + absl::Seconds(5)).ok());
  EXPECT_TRUE(client.WaitVersion(7, Level::kProtected, absl::Now() + absl::Seconds(5)).ok());
  ASSERT_EQ(c.meta->wait_requests().size(), 2u);
  EXPECT_EQ(c.meta->wait_requests()[1].level(), v1::DURABILITY_LEVEL_PROTECTED);
  EXPECT_EQ(c.meta->wait_requests()[1].step(), 7u);
}

TEST(MetaLinkWaitVersion, PassedDeadlineGivesMetasAnswer) {
  FakeCore c;
  Client client = c.Connect();
  c.meta->PutVersion("job", 7, v1::VERSION_STATE_STAGED);
  absl::Status s = client.WaitVersion(7, Level::kProtected, absl::Now());
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()), StartsWith("WaitVersion: version job/7 did not reach PROTECTED"));
  EXPECT_THAT(s.message(), HasSubstr("it is STAGED"));
  ASSERT_EQ(c.meta->wait_requests().size(), 1u);
  EXPECT_EQ(c.meta->wait_requests()[0].timeout_ms(), 0);
}

TEST(MetaLinkWaitVersion, PollsAgainAfterALongPollEnds) {
  FakeCore c;
  Client client = c.Connect();
  c.meta->PutVersion("job", 7, v1::VERSION_STATE_PROTECTED);
  c.meta->FailNext(MetaCall::kWaitVersion, absl::DeadlineExceededError("did not reach PROTECTED within 10m"));
  EXPECT_TRUE(client.WaitVersion(7, Level::kProtected, absl::Now() + absl::Seconds(30)).ok());
  EXPECT_EQ(c.meta->calls(MetaCall::kWaitVersion), 2);
  EXPECT_EQ(c.meta->retries(), 0);  // a poll that ended is not a failure
}

TEST(MetaLinkWaitVersion, ReturnsOnceTheVersionReachesTheLevel) {
  FakeCore c;
  Client client = c.Connect();
  c.meta->PutVersion("job", 7, v1::VERSION_STATE_STAGED);
  std::thread protect([&] {
    c.meta->AwaitWaiting(1);
    c.meta->PutVersion("job", 7, v1::VERSION_STATE_PROTECTED);
  });
  absl::Status s = client.WaitVersion(7, Level::kProtected, absl::Now() + absl::Seconds(60));
  protect.join();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.meta->calls(MetaCall::kWaitVersion), 1);
}

TEST(MetaLinkWaitVersion, UnreachableMetaUntilTheDeadline) {
  FakeCore c;
  Client client = c.Connect();
  c.meta->FailNext(MetaCall::kWaitVersion, absl::UnavailableError("connection refused"));
  absl::Status s = client.WaitVersion(7, Level::kStaged, absl::Now());
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_EQ(s.message(), "waiting for job/7: ckpt-meta unreachable: WaitVersion: connection refused");

  c.meta->PutVersion("job", 7, v1::VERSION_STATE_STAGED);
  c.meta->FailNext(MetaCall::kWaitVersion, absl::UnavailableError("connection refused"));
  s = client.WaitVersion(7, Level::kStaged, absl::Now() + absl::Seconds(30));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.meta->retries(), 1);
}

TEST(MetaLinkWaitVersion, UnknownStepIsRetriedOnlyWithinTheBeginGrace) {
  FakeCore c;
  Client client = c.Connect();
  // No grace (this client did not commit step 7): NotFound at once.
  absl::Status s = client.WaitVersion(7, Level::kStaged, absl::Now() + absl::Seconds(30));
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_EQ(s.message(), "WaitVersion: job \"job\" has no version at step 7");
  EXPECT_EQ(c.meta->calls(MetaCall::kWaitVersion), 1);

  // Within the grace: retried until the agent has begun it.
  c.meta->PutVersion("job", 8, v1::VERSION_STATE_STAGED);
  c.meta->FailNext(MetaCall::kWaitVersion, absl::NotFoundError("job \"job\" has no version at step 8"));
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  s = client::WaitForVersion(*c.core, 8, Level::kStaged, deadline, /*not_found_until=*/deadline);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.meta->calls(MetaCall::kWaitVersion), 3);

  // ... unless meta says the step is refused.
  c.meta->FailNext(MetaCall::kWaitVersion,
                   absl::NotFoundError("job \"job\" has no version at step 6; a save of step 6 is refused because "
                                       "the job's newest version is step 8"));
  s = client::WaitForVersion(*c.core, 6, Level::kStaged, deadline, /*not_found_until=*/deadline);
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("is refused"));
  EXPECT_EQ(c.meta->calls(MetaCall::kWaitVersion), 4);
}

// --- Locate, through Load ---

TEST(MetaLinkLocate, ErrorsReachTheCallerWithTheirCodes) {
  FakeCore c;
  Client client = c.Connect();
  // No version at the step (nor a local copy).
  absl::StatusOr<LoadedShard> none = client.Load(3);
  EXPECT_TRUE(absl::IsNotFound(none.status())) << none.status();
  EXPECT_EQ(none.status().message(), "Locate: job \"job\" has no version at step 3");

  // Still OPEN: cannot be restored.
  c.meta->PutVersion("job", 4, v1::VERSION_STATE_OPEN);
  absl::StatusOr<LoadedShard> open = client.Load(4);
  EXPECT_TRUE(absl::IsFailedPrecondition(open.status())) << open.status();
  EXPECT_THAT(std::string(open.status().message()), StartsWith("Locate: version job/4 is OPEN"));

  // Staged, but no source left.
  c.meta->PutVersion("job", 5, v1::VERSION_STATE_STAGED);
  c.meta->PutShard("job", 5, 0, v1::LocateResponse());
  absl::StatusOr<LoadedShard> lost = client.Load(5);
  EXPECT_TRUE(absl::IsDataLoss(lost.status())) << lost.status();
  EXPECT_EQ(lost.status().message(), "Locate: rank 0 of job/5 has no readable source left");

  ASSERT_GE(c.meta->locate_requests().size(), 3u);
  const v1::LocateRequest req = c.meta->locate_requests()[0];
  EXPECT_EQ(req.job_id(), "job");
  EXPECT_EQ(req.step(), 3u);
  EXPECT_EQ(req.rank(), 0u);
  EXPECT_EQ(req.near_node_id(), "fake-node");
  EXPECT_EQ(c.agent->open_handles(), 0u);
}

TEST(MetaLinkLocate, UnknownJob) {
  FakeCore c;
  Client client = c.Connect();
  c.core->options.job_id = "other";  // a job meta does not have
  absl::StatusOr<LoadedShard> s = client.Load(3);
  EXPECT_TRUE(absl::IsNotFound(s.status())) << s.status();
  EXPECT_EQ(s.status().message(), "Locate: job \"other\" does not exist");
}

// --- Save, then load through both fakes ---

TEST(MetaLinkLoad, SaveThenLoadByteIdenticalThroughTheFakes) {
  FakeCore c;
  Client client = c.Connect();
  const std::vector<std::byte> a = Pattern(6000, 1);
  const std::vector<std::byte> b = Pattern(300, 2);
  SaveBuilder save = client.BeginSave(1);
  ASSERT_TRUE(save.Add("a", a, DType::kU8, {a.size()}).ok());
  ASSERT_TRUE(save.Add("b", b, DType::kU8, {b.size()}).ok());
  absl::StatusOr<SaveHandle> h = save.Commit();
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(h->Committed(absl::Now() + absl::Seconds(5)).ok());

  // What meta learns from the agent: the version, and where the shard is.
  v1::LocateResponse located;
  *located.mutable_shard() = c.agent->committed_shard(1);
  located.mutable_shard()->mutable_key()->set_job_id("job");
  located.mutable_shard()->mutable_key()->set_rank(0);
  located.add_sources()->set_kind(v1::SOURCE_KIND_LOCAL);
  ASSERT_NE(located.shard().manifest_digest(), 0u);
  c.meta->PutVersion("job", 1, v1::VERSION_STATE_PROTECTED);
  c.meta->PutShard("job", 1, 0, located);

  absl::StatusOr<uint64_t> latest = client.Latest(Level::kProtected);
  ASSERT_TRUE(latest.ok()) << latest.status();
  ASSERT_EQ(*latest, 1u);
  {
    absl::StatusOr<LoadedShard> shard = client.Load(*latest);
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_EQ(shard->served_from(), ServedFrom::kLocal);
    EXPECT_EQ(shard->crc32c(), located.shard().crc32c());
    ASSERT_EQ(shard->items().size(), 2u);
    absl::StatusOr<std::span<const std::byte>> va = shard->View("a");
    absl::StatusOr<std::span<const std::byte>> vb = shard->View("b");
    ASSERT_TRUE(va.ok()) << va.status();
    ASSERT_TRUE(vb.ok()) << vb.status();
    EXPECT_TRUE(std::equal(va->begin(), va->end(), a.begin(), a.end()));
    EXPECT_TRUE(std::equal(vb->begin(), vb->end(), b.begin(), b.end()));
    EXPECT_EQ(c.agent->open_handles(), 1u);
    EXPECT_TRUE(shard->Close().ok());
  }
  EXPECT_EQ(c.agent->open_handles(), 0u);
  ASSERT_EQ(c.meta->locate_requests().size(), 1u);
  EXPECT_TRUE(c.meta->locate_requests()[0].omit_items());
}

}  // namespace
}  // namespace ckpt
