// The C++ client against real ckpt-meta and ckpt-agent processes: several
// ranks save, meta shows STAGED, the flush writes durable files that
// byte-match and carry correct crcs, meta shows PERSISTED; a trainer process
// killed right after its commit loses nothing; zero-copy and copy loads;
// corrupted bytes are DataLoss, never wrong bytes.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "ckpt/client.h"
#include "common/crc32c.h"
#include "common/durable_format.h"
#include "common/file_system.h"
#include "integration/agent_process.h"
#include "integration/meta_process.h"
#include "integration/node_cluster.h"
#include "integration/client_options.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using testing::AgentProcess;
using testing::AgentProcessOptions;
using testing::MetaProcess;
using testing::TempDir;

std::vector<float> Tensor(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng() % 100000) / 7.0f;
  return v;
}

std::span<const std::byte> Bytes(const std::vector<float>& v) { return std::as_bytes(std::span<const float>(v)); }

class ClientIntegrationTest : public testing::NodeClusterTest {
 protected:
  ClientIntegrationTest() : NodeClusterTest("64MiB") {}

  ClientOptions Options(const std::string& job, uint32_t rank, uint32_t world) {
    return testing::ClientOptionsFor(*meta_, *agent_, job, rank, world);
  }

};

TEST_F(ClientIntegrationTest, RanksSaveStagedThenFlushedPersistedWithByteExactDurableFiles) {
  constexpr uint32_t kWorld = 3;
  std::vector<Client> clients;
  for (uint32_t r = 0; r < kWorld; ++r) {
    ClientOptions o = Options("gpt", r, kWorld);
    o.flush_every_n_versions = 1;
    absl::StatusOr<Client> c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(*std::move(c));
  }
  std::vector<std::vector<float>> w, b;
  std::vector<SaveHandle> handles;
  for (uint32_t r = 0; r < kWorld; ++r) {
    w.push_back(Tensor(100000 + r * 1000, r));
    b.push_back(Tensor(17, r + 10));
    SaveBuilder s = clients[r].BeginSave(100);
    ASSERT_TRUE(s.Add("layer.w", Bytes(w[r]), DType::kF32, {w[r].size()}).ok());
    ASSERT_TRUE(s.Add("layer.b", Bytes(b[r]), DType::kF32, {b[r].size()}).ok());
    absl::StatusOr<SaveHandle> h = s.Commit();
    ASSERT_TRUE(h.ok()) << h.status();
    handles.push_back(*h);
  }
  ASSERT_TRUE(handles[0].Wait(Level::kStaged, absl::Now() + absl::Seconds(30)).ok());
  absl::Status persisted = handles[2].Wait(Level::kPersisted, absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(persisted.ok()) << persisted << "\n" << agent_->proc()->LogTail();
  absl::StatusOr<uint64_t> latest = clients[1].Latest(Level::kPersisted);
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(*latest, 100u);

  // The durable tier, read with no daemon involved.
  const std::string vdir = absl::StrCat(agent_->options().durable_root, "/gpt/100");
  absl::StatusOr<DurableManifest> m = ReadDurableManifest(PosixFileSystem(), vdir);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->shards.size(), kWorld);
  for (uint32_t r = 0; r < kWorld; ++r) {
    const DurableShard& s = m->shards[r];
    EXPECT_EQ(s.crc32c, handles[r].crc32c());
    std::vector<std::byte> bytes(s.size_bytes);
    ASSERT_TRUE(ReadRankFile(PosixFileSystem(), vdir, s, bytes).ok());
    for (const ManifestItem& item : s.items) {
      const std::vector<float>& want = item.name == "layer.w" ? w[r] : b[r];
      ASSERT_EQ(item.length_bytes, want.size() * sizeof(float));
      EXPECT_EQ(std::memcmp(bytes.data() + item.offset_bytes, want.data(), item.length_bytes), 0) << item.name;
      EXPECT_EQ(item.crc32c, Crc32c(want.data(), item.length_bytes));
    }
  }

  // Zero-copy and copy loads give the same bytes.
  absl::StatusOr<LoadedShard> shard = clients[1].Load(100);
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ(shard->served_from(), ServedFrom::kLocal);
  absl::StatusOr<std::span<const std::byte>> view = shard->View("layer.w");
  ASSERT_TRUE(view.ok());
  ASSERT_EQ(view->size(), w[1].size() * sizeof(float));
  EXPECT_EQ(std::memcmp(view->data(), w[1].data(), view->size()), 0);
  std::vector<float> into(b[2].size());
  absl::Status into_status = clients[2].LoadInto(100, {{"layer.b", std::as_writable_bytes(std::span<float>(into))}});
  ASSERT_TRUE(into_status.ok()) << into_status << "\n" << agent_->proc()->LogTail();
  EXPECT_EQ(into, b[2]);
}

// A trainer that resumes right after ckpt-meta restarted: the channel's first
// call used to fail UNAVAILABLE ("failed to connect to all addresses"), since
// a load's Locate and Latest are single calls (bench/meta_reconnect.py
// --call load: 4 of 4 failed). Now a read-only call that meets UNAVAILABLE
// waits on the channel and is sent again, within rpc_timeout.
TEST_F(ClientIntegrationTest, ALoadRightAfterAMetaRestartSucceeds) {
  absl::StatusOr<Client> c = Client::Connect(Options("resume", 0, 1));
  ASSERT_TRUE(c.ok()) << c.status();
  const std::vector<float> w = Tensor(5000, 3);
  SaveBuilder s = c->BeginSave(7);
  ASSERT_TRUE(s.Add("w", Bytes(w), DType::kF32, {w.size()}).ok());
  absl::StatusOr<SaveHandle> h = s.Commit();
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(h->Wait(Level::kStaged, absl::Now() + absl::Seconds(30)).ok());
  ASSERT_TRUE(meta_->proc()->Kill(SIGKILL).ok());
  (void)meta_->proc()->Wait();
  // A call while meta is down leaves the channel failed.
  EXPECT_FALSE(h->Wait(Level::kStaged, absl::Now() + absl::Milliseconds(300)).ok());
  ASSERT_TRUE(meta_->Restart().ok());
  absl::StatusOr<LoadedShard> shard = c->Load(7);
  ASSERT_TRUE(shard.ok()) << shard.status() << "\n" << meta_->proc()->LogTail();
  absl::StatusOr<std::span<const std::byte>> view = shard->View("w");
  ASSERT_TRUE(view.ok()) << view.status();
  ASSERT_EQ(view->size(), w.size() * sizeof(float));
  EXPECT_EQ(std::memcmp(view->data(), w.data(), view->size()), 0);
  absl::StatusOr<uint64_t> latest = c->Latest(Level::kStaged);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, 7u);
}

TEST_F(ClientIntegrationTest, TrainerKilledRightAfterCommitLosesNothingAndResumesExactly) {
  // ckpt-train-demo commits step 4 and SIGKILLs itself; a new process resumes
  // from the newest protected version and checks its final state against an
  // uninterrupted run.
  auto run = [&](std::vector<std::string> extra) {
    testing::SubprocessOptions o;
    o.argv = {testing::BinaryPath("ckpt-train-demo"), "--meta", meta_->address(), "--agent-socket",
              agent_->socket_path(), "--job", "demo", "--rank", "0", "--world-size", "1", "--steps", "8",
              "--every", "2", "--mib", "4"};
    for (std::string& e : extra) o.argv.push_back(std::move(e));
    o.name = "ckpt-train-demo";
    return testing::RunToCompletion(o, absl::Seconds(120));
  };
  absl::StatusOr<testing::RunResult> crashed = run({"--crash-at", "4"});
  ASSERT_TRUE(crashed.ok()) << crashed.status();
  EXPECT_TRUE(crashed->status.signaled());
  absl::StatusOr<testing::RunResult> resumed = run({"--resume"});
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_TRUE(resumed->status.success()) << resumed->stdout_text << resumed->stderr_text;
  EXPECT_THAT(resumed->stdout_text, HasSubstr("resumed from step 4 (served from local)"));
  EXPECT_THAT(resumed->stdout_text, HasSubstr("final state matches an uninterrupted run: yes"));
}

TEST_F(ClientIntegrationTest, CorruptedMemoryTierByteIsDataLossOnBothLoadPaths) {
  absl::StatusOr<Client> c = Client::Connect(Options("bad", 0, 1));
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<float> w = Tensor(5000, 3);
  SaveBuilder s = c->BeginSave(1);
  ASSERT_TRUE(s.Add("w", Bytes(w), DType::kF32, {w.size()}).ok());
  ASSERT_TRUE(s.Commit().ok());
  ASSERT_TRUE(c->WaitVersion(1, Level::kStaged, absl::Now() + absl::Seconds(30)).ok());
  // Flip one byte of the shard inside the agent's pool file.
  {
    absl::StatusOr<LoadedShard> shard = c->Load(1);
    ASSERT_TRUE(shard.ok()) << shard.status();
    absl::StatusOr<std::span<const std::byte>> v = shard->View("w");
    ASSERT_TRUE(v.ok());
    const_cast<std::byte*>(v->data())[1234] ^= std::byte{0x10};
  }
  std::vector<float> into(w.size());
  absl::Status s1 = c->LoadInto(1, {{"w", std::as_writable_bytes(std::span<float>(into))}});
  // Either the load finds the bad item, or the agent's background verifier
  // got there first and meta already aborted the version as data lost.
  EXPECT_TRUE(absl::IsDataLoss(s1) || absl::StrContains(s1.message(), "data lost")) << s1;
  // The only copy is quarantined: meta aborts the version as data lost.
  // (or, until meta has the CORRUPT report, the agent refuses the copy).
  absl::StatusOr<LoadedShard> again = c->Load(1);
  EXPECT_TRUE(absl::IsDataLoss(again.status()) || absl::StrContains(again.status().message(), "data lost"))
      << again.status();
}

TEST_F(ClientIntegrationTest, AnyRanksShardAndAnySliceOfAGlobalTensorLoad) {
  // Two ranks each save half of a [6, 5] tensor's rows (3 and 3) and their
  // own scalar; rank 0 then reads rank 1's shard, and any slice of the whole.
  std::vector<float> whole(30);
  for (size_t i = 0; i < whole.size(); ++i) whole[i] = static_cast<float>(i) + 0.5f;
  std::vector<Client> clients;
  for (uint32_t r = 0; r < 2; ++r) {
    absl::StatusOr<Client> c = Client::Connect(Options("reshard", r, 2));
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(*std::move(c));
  }
  for (uint32_t r = 0; r < 2; ++r) {
    SaveBuilder s = clients[r].BeginSave(4);
    std::span<const float> rows(whole.data() + r * 15, 15);
    const std::vector<uint64_t> global = {6, 5}, offsets = {3 * r, 0};
    ASSERT_TRUE(s.Add("w", std::as_bytes(rows), DType::kF32, {3, 5}, GlobalAttributes("w", "w", global, offsets)).ok());
    const float own = 100.0f + static_cast<float>(r);
    ASSERT_TRUE(s.Add("own", std::as_bytes(std::span<const float>(&own, 1)), DType::kF32, {}).ok());
    // Malformed global attributes are refused at Add.
    EXPECT_EQ(s.Add("bad", std::as_bytes(rows), DType::kF32, {3, 5},
                    GlobalAttributes("bad", "bad", global, std::vector<uint64_t>{4, 0}))
                  .code(),
              absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(s.Commit().ok());
  }
  ASSERT_TRUE(clients[0].WaitVersion(4, Level::kStaged, absl::Now() + absl::Seconds(30)).ok());
  absl::StatusOr<LoadedShard> other = clients[0].Load(4, LoadOptions{.verify = true, .rank = 1});
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->rank(), 1u);
  absl::StatusOr<std::span<const std::byte>> own = other->View("own");
  ASSERT_TRUE(own.ok());
  float v = 0;
  std::memcpy(&v, own->data(), sizeof(v));
  EXPECT_EQ(v, 101.0f);
  absl::StatusOr<LoadedShard> beyond = clients[0].Load(4, LoadOptions{.verify = true, .rank = 2});
  EXPECT_EQ(beyond.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(beyond.status().message(), HasSubstr("has world size 2")) << beyond.status();

  absl::StatusOr<std::map<std::string, GlobalTensor>> index = clients[1].GlobalTensors(4);
  ASSERT_TRUE(index.ok()) << index.status();
  ASSERT_EQ(index->size(), 1u);
  EXPECT_EQ(index->at("w").shape, (std::vector<uint64_t>{6, 5}));
  EXPECT_EQ(index->at("w").pieces.size(), 2u);
  // Rows 2..4, columns 1..3: across both ranks' pieces.
  std::vector<float> out(3 * 3, -1.0f);
  const SliceRequest req{"w", {2, 1}, {3, 3}, std::as_writable_bytes(std::span<float>(out))};
  ASSERT_TRUE(clients[1].LoadSlices(4, {&req, 1}).ok());
  for (uint64_t i = 0; i < 3; ++i) {
    for (uint64_t j = 0; j < 3; ++j) EXPECT_EQ(out[i * 3 + j], whole[(2 + i) * 5 + 1 + j]) << i << "," << j;
  }
}

class ClientLargeShardTest : public testing::NodeClusterTest {
 protected:
  ClientLargeShardTest() : NodeClusterTest("320MiB") {}
};

TEST_F(ClientLargeShardTest, VerifiedLoadsOnTheSessionUpTo64MiBAndOverGrpcBeyond) {
  // A load with verification opens the local copy on the client's session
  // when it is at most 64 MiB; the agent refuses a larger one there (its
  // session requests share one thread) and the client asks over gRPC. Both
  // verified, both byte-exact, at the edge and either side of it.
  absl::StatusOr<Client> c = Client::Connect(testing::ClientOptionsFor(*meta_, *agent_, "big", 0, 1));
  ASSERT_TRUE(c.ok()) << c.status();
  const std::vector<size_t> floats = {(64u << 20) / 4 - 16, (64u << 20) / 4 + 1, (80u << 20) / 4};
  for (size_t i = 0; i < floats.size(); ++i) {
    const uint64_t step = i + 1;
    const std::vector<float> w = Tensor(floats[i], static_cast<uint32_t>(step));
    SaveBuilder s = c->BeginSave(step);
    ASSERT_TRUE(s.Add("w", Bytes(w), DType::kF32, {w.size()}).ok());
    absl::StatusOr<SaveHandle> h = s.Commit();
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE(h->Wait(Level::kStaged, absl::Now() + absl::Seconds(60)).ok());
    absl::StatusOr<LoadedShard> shard = c->Load(step, LoadOptions{.verify = true});
    ASSERT_TRUE(shard.ok()) << step << ": " << shard.status();
    EXPECT_TRUE(shard->verified()) << step;
    absl::StatusOr<std::span<const std::byte>> view = shard->View("w");
    ASSERT_TRUE(view.ok()) << view.status();
    ASSERT_EQ(view->size(), w.size() * sizeof(float));
    EXPECT_EQ(std::memcmp(view->data(), w.data(), view->size()), 0) << step;
  }
}

// Meta tells the agents holding a version's copies when it becomes
// restorable (STAGED); a load of such a local copy then needs nothing from
// meta: it works with meta down, byte-exact, on both load paths. A version
// the agent was not told about still asks meta (Locate). An agent restarted
// with its tier is told again of what it holds.
// LoadedShard::CopyItems: 400 items (about 13 MiB, so the copy is split
// over the copy threads, items straddling the parts) come back byte for
// byte; a bad call is refused before anything is copied; a flipped byte is
// DataLoss naming its item.
TEST_F(ClientIntegrationTest, CopyItemsLoadsManyItemsAndRefusesBadCallsFirst) {
  absl::StatusOr<Client> c = Client::Connect(Options("many", 0, 1));
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<std::vector<float>> tensors;
  SaveBuilder s = c->BeginSave(1);
  for (int i = 0; i < 400; ++i) {
    tensors.push_back(Tensor(1 + (i * 7919) % 16384, i));
    ASSERT_TRUE(s.Add(absl::StrCat("t", i), Bytes(tensors.back()), DType::kF32, {tensors.back().size()}).ok());
  }
  ASSERT_TRUE(s.Commit().ok());
  ASSERT_TRUE(c->WaitVersion(1, Level::kStaged, absl::Now() + absl::Seconds(30)).ok());
  LoadOptions unchecked;
  unchecked.verify = false;
  absl::StatusOr<LoadedShard> shard = c->Load(1, unchecked);
  ASSERT_TRUE(shard.ok()) << shard.status();
  ASSERT_EQ(shard->items().size(), tensors.size());
  std::vector<std::vector<float>> into(tensors.size());
  std::vector<size_t> index;
  std::vector<std::span<std::byte>> dst;
  for (size_t i = 0; i < shard->items().size(); ++i) {
    const LoadedItem& item = shard->items()[i];
    const int t = std::stoi(item.name.substr(1));
    into[t].assign(item.length_bytes / sizeof(float), -1.0f);
    index.push_back(i);
    dst.push_back(std::as_writable_bytes(std::span<float>(into[t])));
  }
  // Refused before anything is copied: the buffers keep their -1s.
  EXPECT_EQ(shard->CopyItems(std::span(index).first(3), dst).code(), absl::StatusCode::kInvalidArgument);
  std::vector<size_t> beyond = index;
  beyond.back() = index.size();
  EXPECT_EQ(shard->CopyItems(beyond, dst).code(), absl::StatusCode::kOutOfRange);
  std::vector<std::span<std::byte>> short_dst = dst;
  short_dst.back() = short_dst.back().first(short_dst.back().size() - 1);
  absl::Status bad = shard->CopyItems(index, short_dst);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_TRUE(absl::StrContains(bad.message(), "bytes, the item is")) << bad;
  for (const auto& v : into) ASSERT_EQ(v.front(), -1.0f);
  // All of them.
  absl::Status copied = shard->CopyItems(index, dst);
  ASSERT_TRUE(copied.ok()) << copied;
  for (size_t t = 0; t < tensors.size(); ++t) ASSERT_EQ(into[t], tensors[t]) << "t" << t;
  // One byte flipped in the agent's memory tier under item t123.
  {
    absl::StatusOr<std::span<const std::byte>> v = shard->View("t123");
    ASSERT_TRUE(v.ok()) << v.status();
    const_cast<std::byte*>(v->data())[v->size() / 2] ^= std::byte{0x01};
  }
  absl::Status lost = shard->CopyItems(index, dst);
  EXPECT_TRUE(absl::IsDataLoss(lost)) << lost;
  EXPECT_TRUE(absl::StrContains(lost.message(), "\"t123\"")) << lost;
}

TEST_F(ClientIntegrationTest, ALocalCopyMetaSaidIsStagedLoadsWithoutAskingMeta) {
  absl::StatusOr<Client> c = Client::Connect(Options("told", 0, 1));
  ASSERT_TRUE(c.ok()) << c.status();
  const std::vector<float> w = Tensor(300000, 5), b = Tensor(33, 6);
  SaveBuilder s = c->BeginSave(11);
  ASSERT_TRUE(s.Add("w", Bytes(w), DType::kF32, {w.size()}).ok());
  ASSERT_TRUE(s.Add("b", Bytes(b), DType::kF32, {b.size()}).ok());
  absl::StatusOr<SaveHandle> h = s.Commit();
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(h->Wait(Level::kStaged, absl::Now() + absl::Seconds(30)).ok());
  // Bounded poll of the agent's gauge (another process).
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (agent_->Metric("ckpt_agent_restorable_versions") < 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(agent_->Metric("ckpt_agent_restorable_versions"), 1) << agent_->proc()->LogTail();
  ASSERT_TRUE(meta_->proc()->Kill(SIGKILL).ok());
  (void)meta_->proc()->Wait();

  absl::StatusOr<LoadedShard> shard = c->Load(11);
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ(shard->served_from(), ServedFrom::kLocal);
  absl::StatusOr<std::span<const std::byte>> view = shard->View("w");
  ASSERT_TRUE(view.ok()) << view.status();
  ASSERT_EQ(view->size(), w.size() * sizeof(float));
  EXPECT_EQ(std::memcmp(view->data(), w.data(), view->size()), 0);
  std::vector<float> into(b.size());
  absl::Status loaded = c->LoadInto(11, {{"b", std::as_writable_bytes(std::span<float>(into))}});
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ(into, b);
  LoadOptions unchecked;
  unchecked.verify = false;
  absl::StatusOr<LoadedShard> fast = c->Load(11, unchecked);
  ASSERT_TRUE(fast.ok()) << fast.status();
  std::vector<float> copied(w.size());
  size_t w_index = 0;
  while (w_index < fast->items().size() && fast->items()[w_index].name != "w") ++w_index;
  ASSERT_TRUE(fast->CopyItem(w_index, std::as_writable_bytes(std::span<float>(copied))).ok());
  EXPECT_EQ(copied, w);

  // Meta back: a step saved and loaded before the agent could be told goes
  // through Locate as before (the agent's answer does not vouch for it).
  ASSERT_TRUE(meta_->Restart().ok());
  SaveBuilder s2 = c->BeginSave(12);
  ASSERT_TRUE(s2.Add("w", Bytes(w), DType::kF32, {w.size()}).ok());
  absl::StatusOr<SaveHandle> h2 = s2.Commit();
  ASSERT_TRUE(h2.ok()) << h2.status();
  absl::StatusOr<LoadedShard> right_after = c->Load(12);  // waits for STAGED (one rank)
  ASSERT_TRUE(right_after.ok()) << right_after.status();
  absl::StatusOr<std::span<const std::byte>> again = right_after->View("w");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(std::memcmp(again->data(), w.data(), again->size()), 0);
  right_after = absl::CancelledError("dropped");

  // The agent restarts (kill -9; its tier re-adopted): its inventory has meta
  // tell it again of the versions it holds, and loads ask meta nothing again.
  ASSERT_TRUE(agent_->proc()->Kill(SIGKILL).ok());
  (void)agent_->proc()->Wait();
  ASSERT_TRUE(agent_->Restart().ok());
  const absl::Time told_by = absl::Now() + absl::Seconds(30);
  while (agent_->Metric("ckpt_agent_restorable_versions") < 2 && absl::Now() < told_by) {
    absl::SleepFor(absl::Milliseconds(20));  // bounded poll of another process
  }
  ASSERT_EQ(agent_->Metric("ckpt_agent_restorable_versions"), 2) << agent_->proc()->LogTail();
  ASSERT_TRUE(meta_->proc()->Kill(SIGKILL).ok());
  (void)meta_->proc()->Wait();
  for (uint64_t step : {11, 12}) {
    absl::StatusOr<LoadedShard> after_restart = c->Load(step);
    ASSERT_TRUE(after_restart.ok()) << step << ": " << after_restart.status();
    EXPECT_EQ(after_restart->served_from(), ServedFrom::kLocal);
    absl::StatusOr<std::span<const std::byte>> restored = after_restart->View("w");
    ASSERT_TRUE(restored.ok()) << restored.status();
    ASSERT_EQ(restored->size(), w.size() * sizeof(float));
    EXPECT_EQ(std::memcmp(restored->data(), w.data(), restored->size()), 0) << step;
  }
  ASSERT_TRUE(meta_->Restart().ok());
}

TEST_F(ClientIntegrationTest, ASaveCommitsIntoTheLeaseBeginSaveAskedForOrReleasesIt) {
  // After a save that copied every item, BeginSave asks the agent at once
  // (while the caller adds items) for a lease of that save's size. Commit
  // uses it when the shard fits: one lease request on the session for the
  // whole save. A larger shard, one under half of it, or a builder dropped
  // without Commit releases it. Every save loads back byte-exact.
  ClientOptions o = Options("early", 0, 1);
  o.keep_in_memory = 8;
  o.lease_ahead = false;  // counted apart (ALeaseAskedAheadServesTheNextSaveAtTheSameInterval)
  absl::StatusOr<Client> c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  const std::vector<float> a = Tensor(100000, 1), b = Tensor(100000, 2), big = Tensor(300000, 3);
  const std::vector<std::vector<const std::vector<float>*>> saves = {
      {&a, &b}, {&a, &b}, {&a, &b, &big}, {&a}};
  auto name = [](size_t i) { return absl::StrCat("t", i); };
  for (size_t i = 0; i < saves.size(); ++i) {
    const uint64_t step = i + 1;
    const double requests = agent_->Metric("ckpt_agent_session_requests_total");
    SaveBuilder s = c->BeginSave(step);
    for (size_t k = 0; k < saves[i].size(); ++k) {
      ASSERT_TRUE(s.Add(name(k), Bytes(*saves[i][k]), DType::kF32, {saves[i][k]->size()}).ok());
    }
    absl::StatusOr<SaveHandle> h = s.Commit();
    ASSERT_TRUE(h.ok()) << step << ": " << h.status();
    ASSERT_TRUE(h->Wait(Level::kStaged, absl::Now() + absl::Seconds(60)).ok()) << step;
    // Step 2 is the size of step 1: its early lease is the only one. Steps 3
    // (larger) and 4 (under half) ask again.
    EXPECT_EQ(agent_->Metric("ckpt_agent_session_requests_total") - requests, step == 2 ? 1 : step == 1 ? 1 : 2)
        << step;
  }
  // Bounded polls of the agent's gauge (another process).
  auto await_open_leases = [&](double want) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (agent_->Metric("ckpt_agent_open_leases") != want && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    return agent_->Metric("ckpt_agent_open_leases");
  };
  {
    SaveBuilder dropped = c->BeginSave(5);
    ASSERT_TRUE(dropped.Add(name(0), Bytes(a), DType::kF32, {a.size()}).ok());
    EXPECT_EQ(await_open_leases(1), 1);  // asked for by BeginSave
  }
  EXPECT_EQ(await_open_leases(0), 0);  // released in the background
  for (size_t i = 0; i < saves.size(); ++i) {
    absl::StatusOr<LoadedShard> shard = c->Load(i + 1);
    ASSERT_TRUE(shard.ok()) << i + 1 << ": " << shard.status();
    ASSERT_EQ(shard->items().size(), saves[i].size());
    for (size_t k = 0; k < saves[i].size(); ++k) {
      absl::StatusOr<std::span<const std::byte>> view = shard->View(name(k));
      ASSERT_TRUE(view.ok()) << view.status();
      ASSERT_EQ(view->size(), saves[i][k]->size() * sizeof(float));
      EXPECT_EQ(std::memcmp(view->data(), saves[i][k]->data(), view->size()), 0) << i + 1 << " " << k;
    }
  }
}

TEST_F(ClientIntegrationTest, ALeaseAskedAheadServesTheNextSaveAtTheSameInterval) {
  // Saves at steps 10 and 20: after 20 committed, the client asks for the
  // lease of step 30 at once, and the save of 30 asks the agent nothing.
  // That lease begins nothing at meta until a commit. A save at another step
  // (35) releases the guess and asks as before. Every save loads back
  // byte-exact, and the lease held ahead goes with the client.
  ClientOptions o = Options("ahead", 0, 1);
  o.keep_in_memory = 8;
  absl::StatusOr<Client> c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  auto await_open_leases = [&](double want) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (agent_->Metric("ckpt_agent_open_leases") != want && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    return agent_->Metric("ckpt_agent_open_leases");
  };
  std::map<uint64_t, std::vector<float>> saved;
  auto save = [&](uint64_t step) {
    saved[step] = Tensor(50000, static_cast<uint32_t>(step));
    SaveBuilder s = c->BeginSave(step);
    EXPECT_TRUE(s.Add("w", Bytes(saved[step]), DType::kF32, {saved[step].size()}).ok());
    absl::StatusOr<SaveHandle> h = s.Commit();
    ASSERT_TRUE(h.ok()) << step << ": " << h.status();
    ASSERT_TRUE(h->Wait(Level::kStaged, absl::Now() + absl::Seconds(60)).ok()) << step;
  };
  save(10);
  save(20);
  EXPECT_EQ(await_open_leases(1), 1);  // step 30's, asked ahead
  absl::StatusOr<uint64_t> latest = c->Latest(Level::kStaged);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, 20u);  // nothing begun for 30 at meta
  double requests = agent_->Metric("ckpt_agent_session_requests_total");
  save(30);
  EXPECT_EQ(await_open_leases(1), 1);  // step 40's
  // The only request since: the lease of step 40 (the save of 30 asked none).
  EXPECT_EQ(agent_->Metric("ckpt_agent_session_requests_total") - requests, 1);
  save(35);  // not the guess: 40's lease is released, 35 asks for its own
  EXPECT_EQ(await_open_leases(1), 1);  // the guess after 35: 40 again
  for (const auto& [step, want] : saved) {
    absl::StatusOr<LoadedShard> shard = c->Load(step);
    ASSERT_TRUE(shard.ok()) << step << ": " << shard.status();
    absl::StatusOr<std::span<const std::byte>> view = shard->View("w");
    ASSERT_TRUE(view.ok()) << view.status();
    ASSERT_EQ(view->size(), want.size() * sizeof(float));
    EXPECT_EQ(std::memcmp(view->data(), want.data(), view->size()), 0) << step;
  }
  c = absl::CancelledError("closed");  // the client goes, with its session: so does the lease held ahead
  EXPECT_EQ(await_open_leases(0), 0);
}

TEST_F(ClientIntegrationTest, SavesBegunBeforeTheLastCommitWentKeepTheirOwnLeases) {
  // Back to back, each save begins while the previous commit may still be on
  // its way: a lease asked ahead after that commit would be for the step
  // already begun, and the agent would replace the builder's own lease with
  // it. It is not asked then; every save commits and loads back byte-exact.
  ClientOptions o = Options("back-to-back", 0, 1);
  o.keep_in_memory = 16;
  absl::StatusOr<Client> c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<std::vector<float>> saved;
  std::vector<SaveHandle> handles;
  for (uint64_t step = 1; step <= 12; ++step) {
    saved.push_back(Tensor(20000, static_cast<uint32_t>(step + 100)));
    SaveBuilder s = c->BeginSave(step);
    ASSERT_TRUE(s.Add("w", Bytes(saved.back()), DType::kF32, {saved.back().size()}).ok());
    absl::StatusOr<SaveHandle> h = s.Commit();
    ASSERT_TRUE(h.ok()) << step << ": " << h.status();
    handles.push_back(*h);
  }
  for (size_t i = 0; i < handles.size(); ++i) {
    ASSERT_TRUE(handles[i].Committed().ok()) << i + 1 << ": " << handles[i].Committed();
    ASSERT_TRUE(handles[i].Wait(Level::kStaged, absl::Now() + absl::Seconds(60)).ok()) << i + 1;
    absl::StatusOr<LoadedShard> shard = c->Load(i + 1);
    ASSERT_TRUE(shard.ok()) << i + 1 << ": " << shard.status();
    absl::StatusOr<std::span<const std::byte>> view = shard->View("w");
    ASSERT_TRUE(view.ok()) << view.status();
    ASSERT_EQ(view->size(), saved[i].size() * sizeof(float));
    EXPECT_EQ(std::memcmp(view->data(), saved[i].data(), view->size()), 0) << i + 1;
  }
}

TEST_F(ClientIntegrationTest, ALeaseAskedForAtBeginSaveDiesWithItsAgentAndCommitAsksAgain) {
  // The agent is killed and restarted between BeginSave (whose lease it had
  // granted) and Commit: the lease went with the agent's session, so Commit
  // asks the restarted agent for a new one rather than writing into regions
  // the restarted agent may have given to someone else.
  ClientOptions o = Options("early-restart", 0, 1);
  o.lease_ahead = false;
  o.keep_in_memory = 8;
  absl::StatusOr<Client> c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  const std::vector<float> w1 = Tensor(100000, 1), w2 = Tensor(100000, 2);
  {
    SaveBuilder s = c->BeginSave(1);
    ASSERT_TRUE(s.Add("w", Bytes(w1), DType::kF32, {w1.size()}).ok());
    absl::StatusOr<SaveHandle> h = s.Commit();
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE(h->Wait(Level::kStaged, absl::Now() + absl::Seconds(60)).ok());
  }
  SaveBuilder s = c->BeginSave(2);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (agent_->Metric("ckpt_agent_open_leases") != 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));  // bounded poll of another process
  }
  ASSERT_EQ(agent_->Metric("ckpt_agent_open_leases"), 1);  // the lease BeginSave asked for
  ASSERT_TRUE(agent_->proc()->Kill(SIGKILL).ok());
  (void)agent_->proc()->Wait();
  ASSERT_TRUE(agent_->Restart().ok());
  ASSERT_TRUE(s.Add("w", Bytes(w2), DType::kF32, {w2.size()}).ok());
  absl::StatusOr<SaveHandle> h = s.Commit();
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(h->Committed().ok()) << h->Committed();
  ASSERT_TRUE(h->Wait(Level::kStaged, absl::Now() + absl::Seconds(60)).ok());
  for (const auto& [step, want] : {std::pair{uint64_t{1}, &w1}, std::pair{uint64_t{2}, &w2}}) {
    absl::StatusOr<LoadedShard> shard = c->Load(step);
    ASSERT_TRUE(shard.ok()) << step << ": " << shard.status();
    absl::StatusOr<std::span<const std::byte>> view = shard->View("w");
    ASSERT_TRUE(view.ok()) << view.status();
    ASSERT_EQ(view->size(), want->size() * sizeof(float));
    EXPECT_EQ(std::memcmp(view->data(), want->data(), view->size()), 0) << step;
  }
}

TEST_F(ClientIntegrationTest, BadInputThroughTheClient) {
  // Unknown job for a non-zero rank: Connect waits for rank 0, then times out.
  ClientOptions o = Options("nobody", 1, 2);
  o.connect_timeout = absl::Milliseconds(300);
  EXPECT_FALSE(Client::Connect(o).ok());
  EXPECT_EQ(Client::Connect(Options("../escape", 0, 1)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Client::Connect(Options("job", 3, 2)).status().code(), absl::StatusCode::kInvalidArgument);
  // A save larger than the agent's whole memory tier.
  absl::StatusOr<Client> c = Client::Connect(Options("big", 0, 1));
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<std::byte> huge(65 << 20);
  SaveBuilder s = c->BeginSave(1);
  ASSERT_TRUE(s.Add("x", huge, DType::kU8, {huge.size()}).ok());
  absl::StatusOr<SaveHandle> h = s.Commit();
  EXPECT_EQ(h.status().code(), absl::StatusCode::kResourceExhausted) << h.status();
  EXPECT_THAT(h.status().message(), HasSubstr("larger than the whole memory tier"));
  // Duplicate names and a length that does not match the shape.
  SaveBuilder s2 = c->BeginSave(2);
  std::vector<float> w(10);
  ASSERT_TRUE(s2.Add("w", Bytes(w), DType::kF32, {10}).ok());
  EXPECT_EQ(s2.Add("w", Bytes(w), DType::kF32, {10}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s2.Add("v", Bytes(w), DType::kF32, {11}).code(), absl::StatusCode::kInvalidArgument);
  // Loading a step that was never saved.
  EXPECT_EQ(c->Load(77).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace ckpt
