// The save path's steps (src/client/save.cc, steps listed in
// client/save_state.h) against an in-process fake agent
// (tests/client/fake_agent_link.h): no server, no socket, no meta. What the
// client does with each answer of the agent: a lease refused, regions that
// do not cover the lease, a pull lease it cannot stage, a commit refused,
// lost, replayed or answered with another crc, an alignment that makes it
// ask again, a base the agent no longer holds. Every lease granted ends
// committed or released.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "absl/time/clock.h"
#include "ckpt/client.h"
#include "client/client_core.h"
#include "fake_agent_link.h"
#include "common/crc32c.h"
#include "common/manifest.h"

namespace ckpt {
namespace {

using ::ckpt::testing::FakeAgentLink;
using ::testing::HasSubstr;

std::vector<std::byte> Pattern(size_t n, int seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 37 + seed) & 0xFF);
  return v;
}

// A Client whose agent is a FakeAgentLink (and no meta: saves need none).
struct FakeClient {
  explicit FakeClient(FakeAgentLink::Options agent_options = {}, bool background = false) {
    auto link = std::make_unique<FakeAgentLink>(std::move(agent_options));
    agent = link.get();
    std::shared_ptr<client::ClientCore> core = client::NewClientCore();
    core->options.job_id = "job";
    core->options.world_size = 1;
    core->options.agent_socket = "/nonexistent/agent.sock";
    core->options.commit_in_background = background;
    core->agent = std::move(link);
    {
      absl::MutexLock lock(&core->session_mu);
      core->sessions_supported = false;  // no session socket: the pool is mapped by path
    }
    absl::Status connected = client::ConnectAgent(*core, absl::Now());
    EXPECT_TRUE(connected.ok()) << connected;
    client.emplace(client::MakeClient(std::move(core)));
  }

  FakeAgentLink* agent;  // owned by the client's core
  std::optional<Client> client;
};

// Two items: the shard spans more than one 4096-byte page.
struct TwoItems {
  std::vector<std::byte> a = Pattern(6000, 1);
  std::vector<std::byte> b = Pattern(300, 2);
  absl::Status AddTo(SaveBuilder& save) const {
    if (absl::Status s = save.Add("a", a, DType::kU8, {a.size()}); !s.ok()) return s;
    return save.Add("b", b, DType::kU8, {b.size()});
  }
};

TEST(SaveSteps, CopiesAndCommitsIntoOneLease) {
  FakeClient c;
  TwoItems items;
  SaveBuilder save = c.client->BeginSave(1);
  ASSERT_TRUE(items.AddTo(save).ok());
  absl::StatusOr<SaveHandle> h = save.Commit();
  ASSERT_TRUE(h.ok()) << h.status();

  ASSERT_EQ(c.agent->leases().size(), 1u);
  EXPECT_TRUE(c.agent->leases()[0].committed);
  EXPECT_TRUE(c.agent->aborts().empty());
  EXPECT_EQ(c.agent->open_leases(), 0u);
  ASSERT_EQ(c.agent->commits().size(), 1u);
  absl::StatusOr<std::vector<ManifestItem>> manifest = DecodeManifest(c.agent->commits()[0].manifest());
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  ASSERT_EQ(manifest->size(), 2u);
  EXPECT_EQ((*manifest)[0].name, "a");
  EXPECT_EQ((*manifest)[0].crc32c, Crc32c(std::span<const std::byte>(items.a)));
  EXPECT_EQ((*manifest)[1].name, "b");
  EXPECT_EQ((*manifest)[1].offset_bytes % 64, 0u);
  EXPECT_EQ((*manifest)[1].crc32c, Crc32c(std::span<const std::byte>(items.b)));
  EXPECT_EQ(h->size_bytes(), c.agent->commits()[0].size_bytes());
}

TEST(SaveSteps, ALeaseRefusedLeavesNothingToRelease) {
  FakeClient c;
  c.agent->FailNext(FakeAgentLink::Call::kAcquireStagingLease, absl::ResourceExhaustedError("pool full"));
  TwoItems items;
  SaveBuilder save = c.client->BeginSave(1);
  ASSERT_TRUE(items.AddTo(save).ok());
  absl::StatusOr<SaveHandle> h = save.Commit();
  EXPECT_EQ(h.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("AcquireStagingLease"));
  EXPECT_TRUE(c.agent->leases().empty());
  EXPECT_TRUE(c.agent->aborts().empty());
}

TEST(SaveSteps, RegionsThatDoNotCoverTheLeaseReleaseIt) {
  FakeAgentLink::Options o;
  o.short_regions = true;
  FakeClient c(o);
  TwoItems items;
  SaveBuilder save = c.client->BeginSave(1);
  ASSERT_TRUE(items.AddTo(save).ok());
  absl::StatusOr<SaveHandle> h = save.Commit();
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("staging lease lease-1"));
  EXPECT_EQ(c.agent->aborts(), std::vector<std::string>{"lease-1"});
  EXPECT_EQ(c.agent->open_leases(), 0u);
  EXPECT_TRUE(c.agent->commits().empty());
}

TEST(SaveSteps, APullLeaseThatCannotBeStagedIsReleased) {
  FakeAgentLink::Options o;
  o.pull = true;
  o.pull_token = std::string(65, 't');  // longer than the staging header
  FakeClient c(o);
  TwoItems items;
  SaveBuilder save = c.client->BeginSave(1);
  ASSERT_TRUE(items.AddTo(save).ok());
  absl::StatusOr<SaveHandle> h = save.Commit();
  // The token check, or (without UCX here) the staging buffer itself.
  EXPECT_FALSE(h.ok());
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("staging lease lease-1"));
  EXPECT_EQ(c.agent->aborts(), std::vector<std::string>{"lease-1"});
  EXPECT_EQ(c.agent->open_leases(), 0u);
  EXPECT_TRUE(c.agent->commits().empty());
}

TEST(SaveSteps, ACommitTheAgentRefusesReleasesTheLease) {
  FakeClient c;
  c.agent->FailNext(FakeAgentLink::Call::kCommitShard, absl::UnavailableError("agent stopping"));
  TwoItems items;
  SaveBuilder save = c.client->BeginSave(1);
  ASSERT_TRUE(items.AddTo(save).ok());
  absl::StatusOr<SaveHandle> h = save.Commit();
  EXPECT_EQ(h.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("CommitShard: agent stopping"));
  EXPECT_EQ(c.agent->aborts(), std::vector<std::string>{"lease-1"});
  EXPECT_EQ(c.agent->open_leases(), 0u);
}

TEST(SaveSteps, ABackgroundCommitFailureIsReportedByCommittedAndReleasesTheLease) {
  FakeClient c({}, /*background=*/true);
  c.agent->FailNext(FakeAgentLink::Call::kCommitShard, absl::FailedPreconditionError("lease expired"));
  TwoItems items;
  SaveBuilder save = c.client->BeginSave(1);
  ASSERT_TRUE(items.AddTo(save).ok());
  absl::StatusOr<SaveHandle> h = save.Commit();
  ASSERT_TRUE(h.ok()) << h.status();  // the copy is done; the commit is in flight
  absl::Status committed = h->Committed();
  EXPECT_EQ(committed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(committed.message()), HasSubstr("lease expired"));
  EXPECT_EQ(c.agent->aborts(), std::vector<std::string>{"lease-1"});
  EXPECT_EQ(c.agent->open_leases(), 0u);
}

TEST(SaveSteps, ACommitWhoseAnswerWasLostIsASuccess) {
  FakeClient c;
  c.agent->LoseNextCommitAnswer(absl::DeadlineExceededError("answer lost"));
  TwoItems items;
  SaveBuilder save = c.client->BeginSave(1);
  ASSERT_TRUE(items.AddTo(save).ok());
  absl::StatusOr<SaveHandle> h = save.Commit();
  // AbortLease said the lease is committed: the commit took effect.
  EXPECT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(c.agent->aborts(), std::vector<std::string>{"lease-1"});
  ASSERT_EQ(c.agent->commits().size(), 1u);
  EXPECT_TRUE(c.agent->leases()[0].committed);
}

TEST(SaveSteps, ACrcTheAgentComputesOtherwiseIsDataLoss) {
  FakeClient c;
  c.agent->MisreportNextCommitCrc();
  TwoItems items;
  SaveBuilder save = c.client->BeginSave(1);
  ASSERT_TRUE(items.AddTo(save).ok());
  absl::StatusOr<SaveHandle> h = save.Commit();
  EXPECT_EQ(h.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("shard crc32c"));
}

TEST(SaveSteps, ACoarserAlignmentThatNoLongerFitsAsksForASecondLease) {
  FakeAgentLink::Options o;
  o.item_alignment = 4096;
  FakeClient c(o);
  TwoItems items;
  SaveBuilder save = c.client->BeginSave(1);
  ASSERT_TRUE(items.AddTo(save).ok());
  absl::StatusOr<SaveHandle> h = save.Commit();
  ASSERT_TRUE(h.ok()) << h.status();
  const std::vector<FakeAgentLink::Lease> leases = c.agent->leases();
  ASSERT_EQ(leases.size(), 2u);
  EXPECT_TRUE(leases[0].aborted);  // replaced by the second
  EXPECT_TRUE(leases[1].committed);
  EXPECT_GT(leases[1].size_bytes, leases[0].size_bytes);
  absl::StatusOr<std::vector<ManifestItem>> manifest = DecodeManifest(c.agent->commits()[0].manifest());
  ASSERT_TRUE(manifest.ok());
  EXPECT_EQ((*manifest)[1].offset_bytes, 8192u);
}

TEST(SaveSteps, ASecondLeaseRefusedReleasesTheFirst) {
  FakeAgentLink::Options o;
  o.item_alignment = 4096;
  FakeClient c(o);
  c.agent->FailNext(FakeAgentLink::Call::kAcquireStagingLease, absl::OkStatus());
  c.agent->FailNext(FakeAgentLink::Call::kAcquireStagingLease, absl::ResourceExhaustedError("pool full"));
  TwoItems items;
  SaveBuilder save = c.client->BeginSave(1);
  ASSERT_TRUE(items.AddTo(save).ok());
  absl::StatusOr<SaveHandle> h = save.Commit();
  EXPECT_EQ(h.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(c.agent->leases().size(), 1u);
  EXPECT_EQ(c.agent->aborts(), std::vector<std::string>{"lease-1"});
  EXPECT_EQ(c.agent->open_leases(), 0u);
}

TEST(SaveSteps, ABaseTheAgentNoLongerHoldsIsSavedInFull) {
  FakeAgentLink::Options o;
  o.bases_gone = true;
  FakeClient c(o);
  TwoItems items;
  {
    SaveBuilder save = c.client->BeginSave(1);
    ASSERT_TRUE(items.AddTo(save).ok());
    ASSERT_TRUE(save.Commit().ok());
  }
  SaveBuilder save = c.client->BeginSave(2);
  ASSERT_TRUE(save.Add("a", items.a, DType::kU8, {items.a.size()}, {}, ItemChange::kUnchanged).ok());
  ASSERT_TRUE(save.Add("b", items.b, DType::kU8, {items.b.size()}).ok());
  absl::StatusOr<SaveHandle> h = save.Commit();
  ASSERT_TRUE(h.ok()) << h.status();
  const std::vector<v1::AcquireStagingLeaseRequest> asked = c.agent->lease_requests();
  ASSERT_EQ(asked.size(), 3u);  // step 1; step 2 with its base, refused; step 2 in full
  EXPECT_EQ(asked[1].base_steps_size(), 1);
  EXPECT_EQ(asked[2].base_steps_size(), 0);
  EXPECT_GT(asked[2].size_bytes(), asked[1].size_bytes());
  ASSERT_EQ(c.agent->commits().size(), 2u);
  absl::StatusOr<std::vector<ManifestItem>> manifest = DecodeManifest(c.agent->commits()[1].manifest());
  ASSERT_TRUE(manifest.ok());
  for (const ManifestItem& it : *manifest) EXPECT_FALSE(it.ref_step.has_value()) << it.name;
  EXPECT_EQ(c.agent->open_leases(), 0u);
}

TEST(SaveSteps, AnUnchangedItemIsAReferenceToTheBase) {
  FakeClient c;
  TwoItems items;
  {
    SaveBuilder save = c.client->BeginSave(1);
    ASSERT_TRUE(items.AddTo(save).ok());
    ASSERT_TRUE(save.Commit().ok());
  }
  SaveBuilder save = c.client->BeginSave(2);
  ASSERT_TRUE(save.Add("a", items.a, DType::kU8, {items.a.size()}, {}, ItemChange::kUnchanged).ok());
  ASSERT_TRUE(save.Add("b", items.b, DType::kU8, {items.b.size()}).ok());
  ASSERT_TRUE(save.Commit().ok());
  const std::vector<v1::AcquireStagingLeaseRequest> asked = c.agent->lease_requests();
  ASSERT_EQ(asked.size(), 2u);
  ASSERT_EQ(asked[1].base_steps_size(), 1);
  EXPECT_EQ(asked[1].base_steps(0), 1u);
  absl::StatusOr<std::vector<ManifestItem>> manifest = DecodeManifest(c.agent->commits()[1].manifest());
  ASSERT_TRUE(manifest.ok());
  ASSERT_EQ(manifest->size(), 2u);
  const ManifestItem* a = (*manifest)[0].name == "a" ? &(*manifest)[0] : &(*manifest)[1];
  ASSERT_TRUE(a->ref_step.has_value());
  EXPECT_EQ(*a->ref_step, 1u);
}

TEST(SaveSteps, APartialSaveWithoutABaseAsksForNoLease) {
  FakeClient c;
  TwoItems items;
  SaveBuilder save = c.client->BeginSave(1);
  ASSERT_TRUE(items.AddTo(save).ok());
  save.CarryRest();
  absl::StatusOr<SaveHandle> h = save.Commit();
  EXPECT_EQ(h.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("needs a base"));
  EXPECT_TRUE(c.agent->lease_requests().empty());
}

TEST(SaveSteps, ALazySaveWhoseLeaseCannotBeMappedReleasesIt) {
  FakeAgentLink::Options o;
  o.short_regions = true;
  FakeClient c(o);
  TwoItems items;
  SaveBuilder save = c.client->BeginSave(1);
  ASSERT_TRUE(items.AddTo(save).ok());
  absl::StatusOr<LazySave> lazy = save.CommitLazy();
  ASSERT_TRUE(lazy.ok()) << lazy.status();
  EXPECT_EQ(lazy->WaitCopied().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(lazy->Wait().status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(c.agent->aborts(), std::vector<std::string>{"lease-1"});
  EXPECT_EQ(c.agent->open_leases(), 0u);
}

}  // namespace
}  // namespace ckpt
