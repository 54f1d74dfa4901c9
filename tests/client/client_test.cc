// ckpt::Client against a real ckpt-meta process and an in-process fake agent
// (tests/client/fake_agent.h) on a unix socket in a temp dir.
#include "ckpt/client.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "ckpt/v1/meta.grpc.pb.h"
#include "client/fake_agent.h"
#include "common/crc32c.h"
#include "integration/meta_process.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using ::ckpt::testing::FakeAgent;
using ::ckpt::testing::MetaProcess;
using ::ckpt::testing::TempDir;
using ::testing::HasSubstr;

template <typename T>
std::span<const std::byte> Bytes(const std::vector<T>& v) {
  return std::as_bytes(std::span(v));
}

std::vector<float> Floats(size_t n, float seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = seed + static_cast<float>(i) * 0.25f;
  return v;
}

std::vector<std::byte> Pattern(size_t n, int seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 37 + seed) & 0xFF);
  return v;
}

// Commits and waits for the agent's answer (Commit returns before it): the
// fake agent's state is what these tests check next.
absl::StatusOr<SaveHandle> CommitAndWait(SaveBuilder& builder) {
  absl::StatusOr<SaveHandle> h = builder.Commit();
  if (!h.ok()) return h;
  if (absl::Status committed = h->Committed(); !committed.ok()) return committed;
  return h;
}

// Saves `items` (name, bytes) as u8 items of `step` and waits for the
// agent's answer.
absl::Status SaveBytes(Client& client, uint64_t step,
                       std::initializer_list<std::pair<const char*, const std::vector<std::byte>*>> items) {
  SaveBuilder save = client.BeginSave(step);
  for (const auto& [name, bytes] : items) {
    if (absl::Status s = save.Add(name, *bytes, DType::kU8, {bytes->size()}); !s.ok()) return s;
  }
  return CommitAndWait(save).status();
}

bool Equal(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size()) == 0;
}

class ClientTest : public ::testing::Test {
 protected:
  // One ckpt-meta per test binary run (ctest runs each test in its own
  // process, so this is one per test there, and shared when run by hand).
  static void SetUpTestSuite() {
    auto dir = TempDir::Create();
    ASSERT_TRUE(dir.ok()) << dir.status();
    meta_dir_ = new TempDir(std::move(*dir));
    auto data = meta_dir_->Sub("meta-data");
    auto logs = meta_dir_->Sub("logs");
    ASSERT_TRUE(data.ok() && logs.ok());
    // A long lease: the fake agent does not heartbeat.
    auto meta = MetaProcess::Start(*data, *logs, /*lease_ms=*/600000);
    ASSERT_TRUE(meta.ok()) << meta.status();
    meta_ = meta->release();
  }
  static void TearDownTestSuite() {
    delete meta_;
    meta_ = nullptr;
    delete meta_dir_;
    meta_dir_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(meta_, nullptr);
    auto dir = TempDir::Create();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::make_unique<TempDir>(std::move(*dir));
    // Job and node ids from the test name, so tests sharing a meta never meet.
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    job_ = name.substr(0, 50);
  }

  void TearDown() override {
    if (HasFailure() && meta_ != nullptr) {
      std::fprintf(stderr, "ckpt-meta log tail:\n%s\n", meta_->proc()->LogTail(4096).c_str());
    }
    agent_.reset();
  }

  // Starts the fake agent (once per test) with `o` completed.
  void StartAgent(FakeAgent::Options o = {}) {
    o.dir = dir_->path();
    o.node_id = "node-" + job_;
    o.meta_address = meta_->address();
    auto agent = FakeAgent::Start(std::move(o));
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
  }

  ClientOptions Options(uint32_t rank = 0, uint32_t world_size = 1) const {
    ClientOptions o;
    o.meta_address = meta_->address();
    o.agent_socket = dir_->path() + "/agent.sock";
    o.job_id = job_;
    o.rank = rank;
    o.world_size = world_size;
    o.run_id = "run-1";
    o.connect_timeout = absl::Seconds(20);
    o.rpc_timeout = absl::Seconds(20);
    return o;
  }

  Client Connect(uint32_t rank = 0, uint32_t world_size = 1) {
    auto c = Client::Connect(Options(rank, world_size));
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) std::abort();
    return *std::move(c);
  }

  static MetaProcess* meta_;
  static TempDir* meta_dir_;
  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<FakeAgent> agent_;
  std::string job_;
};

MetaProcess* ClientTest::meta_ = nullptr;
TempDir* ClientTest::meta_dir_ = nullptr;

// Socket errors waiting cannot heal fail at once with what to do (issue
// 40): Connect answers FAILED_PRECONDITION, where a wait would end in
// DEADLINE_EXCEEDED. No socket yet is waited for (an agent starting), and
// the error at the end says what the socket said.
TEST_F(ClientTest, ASocketThatCannotWorkFailsAtOnceSayingWhatToDo) {
  // The session socket (SOCK_SEQPACKET) instead of agent.sock.
  const std::string seq = dir_->path() + "/session.sock";
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, seq.c_str(), seq.size());
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  ASSERT_EQ(::listen(fd, 4), 0);
  ClientOptions o = Options();
  o.connect_timeout = absl::Hours(1);  // a wait would not end within the test's timeout
  o.agent_socket = seq;
  auto c = Client::Connect(o);
  ::close(fd);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("is not the agent's gRPC socket"));
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("CKPT_AGENT_SOCKET"));
  // A path through a regular file (ENOTDIR) never becomes a socket.
  const std::string file = dir_->path() + "/not-a-dir";
  std::ofstream(file) << "x";
  o.agent_socket = file + "/agent.sock";
  c = Client::Connect(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("no agent socket at " + o.agent_socket));
  // No socket at all: waited for until the connect timeout, then said.
  o.agent_socket = dir_->path() + "/agent.sock";
  o.connect_timeout = absl::Milliseconds(300);
  c = Client::Connect(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("is ckpt-agent running on this host?"));
}

TEST_F(ClientTest, SaveLoadRoundTrip) {
  StartAgent();
  Client client = Connect();
  EXPECT_EQ(client.node_id(), agent_->node_id());

  const auto w = Floats(1000, 1.5f);
  const std::string text = "tokenizer state";
  const std::vector<int64_t> scalar = {42};
  SaveBuilder save = client.BeginSave(100);
  ASSERT_TRUE(save.Add("model/w", Bytes(w), DType::kF32, {10, 100}).ok());
  ASSERT_TRUE(save.Add("extra", std::as_bytes(std::span(text)), DType::kBytes, {},
                       {{"py_type", "str"}})
                  .ok());
  ASSERT_TRUE(save.Add("step", Bytes(scalar), DType::kI64, {}).ok());
  EXPECT_EQ(save.item_count(), 3u);
  auto handle = CommitAndWait(save);
  ASSERT_TRUE(handle.ok()) << handle.status();
  EXPECT_EQ(handle->step(), 100u);

  // The agent re-read every item from the file: the client's crcs are right,
  // padding is zero, and the shard crc agrees.
  EXPECT_EQ(agent_->crc_mismatches(), 0);
  auto committed = agent_->Committed(job_, 100, 0);
  ASSERT_TRUE(committed.has_value());
  EXPECT_EQ(committed->crc32c(), handle->crc32c());
  EXPECT_EQ(committed->size_bytes(), handle->size_bytes());
  EXPECT_EQ(handle->size_bytes(), 4104u);  // w [0, 4000), text [4032, 4047), step [4096, 4104)

  ASSERT_TRUE(handle->Wait(Level::kStaged, absl::Now() + absl::Seconds(20)).ok());
  // Protection none: PROTECTED as soon as STAGED.
  ASSERT_TRUE(handle->Wait(Level::kProtected, absl::Now() + absl::Seconds(20)).ok());
  auto latest = client.Latest(Level::kProtected);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, 100u);

  {
    auto shard = client.Load(100);
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_EQ(shard->served_from(), ServedFrom::kLocal);
    EXPECT_STREQ(ServedFromName(shard->served_from()), "local");
    EXPECT_TRUE(shard->verified());
    EXPECT_EQ(shard->step(), 100u);
    EXPECT_EQ(shard->crc32c(), handle->crc32c());
    ASSERT_EQ(shard->items().size(), 3u);
    const LoadedItem* item = shard->Find("model/w");
    ASSERT_NE(item, nullptr);
    EXPECT_EQ(item->dtype, DType::kF32);
    EXPECT_EQ(item->shape, (std::vector<uint64_t>{10, 100}));
    EXPECT_EQ(item->offset_bytes, 0u);
    EXPECT_EQ(item->crc32c, Crc32c(Bytes(w)));
    const LoadedItem* extra = shard->Find("extra");
    ASSERT_NE(extra, nullptr);
    EXPECT_EQ(extra->offset_bytes % 64, 0u);
    EXPECT_EQ(extra->attributes.at("py_type"), "str");

    auto view = shard->View("model/w");
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_TRUE(Equal(*view, Bytes(w)));
    auto view2 = shard->View("extra");
    ASSERT_TRUE(view2.ok());
    EXPECT_TRUE(Equal(*view2, std::as_bytes(std::span(text))));
    auto view3 = shard->View("step");
    ASSERT_TRUE(view3.ok());
    EXPECT_TRUE(Equal(*view3, Bytes(scalar)));
    EXPECT_EQ(shard->View("nope").status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(agent_->open_handles(), 1);
    EXPECT_TRUE(shard->Close().ok());
    EXPECT_EQ(agent_->open_handles(), 0);
    EXPECT_EQ(shard->View("model/w").status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(shard->Close().ok());  // idempotent
  }

  std::vector<float> w_back(1000);
  int64_t step_back = 0;
  std::map<std::string, std::span<std::byte>> buffers = {
      {"model/w", std::as_writable_bytes(std::span(w_back))},
      {"step", std::as_writable_bytes(std::span(&step_back, 1))}};
  ASSERT_TRUE(client.LoadInto(100, buffers).ok());
  EXPECT_EQ(w_back, w);
  EXPECT_EQ(step_back, 42);
  EXPECT_EQ(agent_->WaitOpenHandles(0), 0);
}

TEST_F(ClientTest, LoadIntoChecksNamesAndSizesBeforeCopying) {
  StartAgent();
  Client client = Connect();
  const auto a = Pattern(1000, 1);
  SaveBuilder save = client.BeginSave(7);
  ASSERT_TRUE(save.Add("a", a, DType::kU8, {1000}).ok());
  ASSERT_TRUE(CommitAndWait(save).ok());

  std::vector<std::byte> small(999), right(1000);
  auto s = client.LoadInto(7, {{"a", std::span(small)}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("\"a\""));
  s = client.LoadInto(7, {{"a", std::span(right)}, {"b", std::span(right)}});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_EQ(right, std::vector<std::byte>(1000));  // nothing copied
  EXPECT_EQ(agent_->WaitOpenHandles(0), 0);
  // Unknown step.
  EXPECT_EQ(client.LoadInto(8, {}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client.Load(8).status().code(), absl::StatusCode::kNotFound);
}

// LoadIntoWhileOpening: the caller's buffers are worked out while the shard
// opens on the client's call thread. Its error comes back as it is, nothing
// copied and no handle left open; more loads at once than that executor has
// threads all finish (a call no thread took is run by its caller).
TEST_F(ClientTest, LoadIntoWhileOpeningTakesTheBuffersWhileTheShardOpens) {
  StartAgent();
  Client client = Connect();
  const auto a = Pattern(1000, 11);
  const auto b = Pattern(3000, 12);
  ASSERT_TRUE(SaveBytes(client, 9, {{"a", &a}, {"b", &b}}).ok());

  std::vector<std::byte> a_back(1000), b_back(3000);
  int calls = 0;
  absl::Status s = client.LoadIntoWhileOpening(9, [&]() -> absl::StatusOr<Client::Buffers> {
    ++calls;
    return Client::Buffers{{"a", std::span(a_back)}, {"b", std::span(b_back)}};
  });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(a_back, a);
  EXPECT_EQ(b_back, b);

  std::vector<std::byte> untouched(1000);
  s = client.LoadIntoWhileOpening(9, [&]() -> absl::StatusOr<Client::Buffers> {
    return absl::InvalidArgumentError("the caller's own reason");
  });
  EXPECT_EQ(s, absl::InvalidArgumentError("the caller's own reason"));
  EXPECT_EQ(client.LoadIntoWhileOpening(10, [&]() -> absl::StatusOr<Client::Buffers> {
              return Client::Buffers{{"a", std::span(untouched)}};
            }).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(untouched, std::vector<std::byte>(1000));
  EXPECT_EQ(agent_->WaitOpenHandles(0), 0);

  constexpr int kLoads = 6;
  std::vector<std::vector<std::byte>> backs(kLoads, std::vector<std::byte>(3000));
  std::vector<absl::Status> results(kLoads);
  std::vector<std::thread> loads;
  for (int i = 0; i < kLoads; ++i) {
    loads.emplace_back([&, i] {
      results[i] = client.LoadIntoWhileOpening(9, [&]() -> absl::StatusOr<Client::Buffers> {
        return Client::Buffers{{"b", std::span(backs[i])}};
      });
    });
  }
  for (std::thread& t : loads) t.join();
  for (int i = 0; i < kLoads; ++i) {
    EXPECT_TRUE(results[i].ok()) << i << ": " << results[i];
    EXPECT_EQ(backs[i], b) << i;
  }
}

TEST_F(ClientTest, CorruptedByteIsDataLossNeverWrongBytes) {
  StartAgent();
  Client client = Connect();
  const auto a = Pattern(5000, 3);
  const auto b = Pattern(3000, 4);
  absl::Status saved = SaveBytes(client, 1, {{"a", &a}, {"b", &b}});
  ASSERT_TRUE(saved.ok()) << saved;
  auto committed = agent_->Committed(job_, 1, 0);
  ASSERT_TRUE(committed.has_value());
  const uint64_t b_offset = committed->items(1).offset_bytes();
  ASSERT_TRUE(agent_->Corrupt(job_, 1, 0, b_offset + 17));

  std::vector<std::byte> a_back(5000), b_back(3000);
  absl::Status s = client.LoadInto(1, {{"a", std::span(a_back)}, {"b", std::span(b_back)}});
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("\"b\""));
  // The uncorrupted item alone still loads.
  EXPECT_TRUE(client.LoadInto(1, {{"a", std::span(a_back)}}).ok());
  EXPECT_EQ(a_back, a);
  // Zero-copy load: the agent verifies and refuses.
  EXPECT_EQ(client.Load(1).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(agent_->WaitOpenHandles(0), 0);
}

// Load checks the whole shard against its crc32c in one pass and item by item
// only when that fails: a changed byte of the padding between items fails the
// shard's crc but no item's, and the load goes on (with a warning), its views
// exact; a changed byte of an item is DataLoss naming it.
TEST_F(ClientTest, VerifiedLoadChecksTheShardThenTheItemsOnlyOnAMismatch) {
  StartAgent();
  Client client = Connect();
  const auto a = Pattern(5000, 7);  // then padding up to the next 64-byte boundary
  const auto b = Pattern(3000, 8);
  ASSERT_TRUE(SaveBytes(client, 3, {{"a", &a}, {"b", &b}}).ok());
  auto committed = agent_->Committed(job_, 3, 0);
  ASSERT_TRUE(committed.has_value());
  ASSERT_GT(committed->items(1).offset_bytes(), 5000u + 10);
  ASSERT_TRUE(agent_->Corrupt(job_, 3, 0, 5000 + 10));
  {
    auto shard = client.Load(3);
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_TRUE(shard->verified());
    for (const auto& [name, want] : {std::pair{"a", &a}, std::pair{"b", &b}}) {
      auto view = shard->View(name);
      ASSERT_TRUE(view.ok()) << view.status();
      ASSERT_EQ(view->size(), want->size());
      EXPECT_EQ(std::memcmp(view->data(), want->data(), view->size()), 0) << name;
    }
  }
  ASSERT_TRUE(agent_->Corrupt(job_, 3, 0, committed->items(1).offset_bytes() + 2999));
  absl::StatusOr<LoadedShard> bad = client.Load(3);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("\"b\""));
}

// Load without the agent's verification: CopyItem checks each item while
// copying it, and says which one is corrupt.
TEST_F(ClientTest, UnverifiedLoadCopyItemChecksEveryItem) {
  StartAgent();
  Client client = Connect();
  const auto a = Pattern(5000, 5);
  const auto b = Pattern(3000, 6);
  ASSERT_TRUE(SaveBytes(client, 2, {{"a", &a}, {"b", &b}}).ok());
  std::vector<std::byte> a_back(5000), b_back(3000), wrong(2999);
  {
    auto shard = client.Load(2, LoadOptions{.verify = false});
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_FALSE(shard->verified());
    ASSERT_EQ(shard->items().size(), 2u);
    ASSERT_EQ(shard->items()[1].name, "b");
    EXPECT_TRUE(shard->CopyItem(0, a_back).ok());
    EXPECT_TRUE(shard->CopyItem(1, b_back).ok());
    EXPECT_EQ(a_back, a);
    EXPECT_EQ(b_back, b);
    EXPECT_EQ(shard->CopyItem(1, wrong).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(shard->CopyItem(2, b_back).code(), absl::StatusCode::kOutOfRange);
    ASSERT_TRUE(shard->Close().ok());
    EXPECT_EQ(shard->CopyItem(0, a_back).code(), absl::StatusCode::kFailedPrecondition);
  }
  auto committed = agent_->Committed(job_, 2, 0);
  ASSERT_TRUE(committed.has_value());
  ASSERT_TRUE(agent_->Corrupt(job_, 2, 0, committed->items(1).offset_bytes() + 5));
  auto shard = client.Load(2, LoadOptions{.verify = false});
  ASSERT_TRUE(shard.ok()) << shard.status();  // nobody looked
  EXPECT_TRUE(shard->CopyItem(0, a_back).ok());
  absl::Status s = shard->CopyItem(1, b_back);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("\"b\""));
  // With verification the agent refuses the copy.
  EXPECT_EQ(client.Load(2).status().code(), absl::StatusCode::kDataLoss);
}

// An agent that predates packed manifests answers with shard.items: loads
// still work.
TEST_F(ClientTest, LoadsFromAnAgentThatDoesNotPackManifests) {
  FakeAgent::Options o;
  o.packs_manifests = false;
  StartAgent(o);
  Client client = Connect();
  const auto w = Floats(100, 2.0f);
  SaveBuilder save = client.BeginSave(3);
  ASSERT_TRUE(save.Add("w", Bytes(w), DType::kF32, {100}, {{"k", "v"}}).ok());
  ASSERT_TRUE(save.Add("b", Bytes(w), DType::kF32, {4, 25}).ok());
  ASSERT_TRUE(CommitAndWait(save).ok());
  auto shard = client.Load(3);
  ASSERT_TRUE(shard.ok()) << shard.status();
  ASSERT_EQ(shard->items().size(), 2u);
  EXPECT_EQ(shard->items()[0].attributes.at("k"), "v");
  EXPECT_EQ(shard->items()[1].shape, (std::vector<uint64_t>{4, 25}));
  auto view = shard->View("b");
  ASSERT_TRUE(view.ok());
  EXPECT_TRUE(Equal(*view, Bytes(w)));
  std::vector<float> back(100);
  EXPECT_TRUE(client.LoadInto(3, {{"w", std::as_writable_bytes(std::span(back))}}).ok());
  EXPECT_EQ(back, w);
}

// The same with a shard of a few MiB (the corrupt byte deep in an item).
TEST_F(ClientTest, CorruptedByteOfABigShardIsDataLossNeverWrongBytes) {
  StartAgent();
  Client client = Connect();
  const auto a = Pattern(3000, 7);
  const auto b = Pattern(3 << 20, 8);
  absl::Status saved = SaveBytes(client, 1, {{"a", &a}, {"b", &b}});
  ASSERT_TRUE(saved.ok()) << saved;
  auto committed = agent_->Committed(job_, 1, 0);
  ASSERT_TRUE(committed.has_value());
  const uint64_t b_offset = committed->items(1).offset_bytes();
  ASSERT_TRUE(agent_->Corrupt(job_, 1, 0, b_offset + (2 << 20) + 5));

  std::vector<std::byte> a_back(a.size()), b_back(b.size());
  absl::Status s = client.LoadInto(1, {{"a", std::span(a_back)}, {"b", std::span(b_back)}});
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("\"b\""));
  EXPECT_TRUE(client.LoadInto(1, {{"a", std::span(a_back)}}).ok());
  EXPECT_EQ(a_back, a);
  EXPECT_EQ(agent_->WaitOpenHandles(0), 0);
}

// A manifest that does not hash to the shard's digest is never used.
TEST_F(ClientTest, ManifestNotMatchingItsDigestIsDataLoss) {
  FakeAgent::Options o;
  o.tamper_manifest = true;
  StartAgent(o);
  Client client = Connect();
  const auto w = Floats(100, 3.0f);
  SaveBuilder save = client.BeginSave(4);
  ASSERT_TRUE(save.Add("w", Bytes(w), DType::kF32, {100}).ok());
  ASSERT_TRUE(CommitAndWait(save).ok());
  absl::Status s = client.Load(4).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("digest"));
  std::vector<float> back(100);
  s = client.LoadInto(4, {{"w", std::as_writable_bytes(std::span(back))}});
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(agent_->WaitOpenHandles(0), 0);
}

// A load opens the agent's own copy while meta answers where the shard
// lives: one OpenShard when that copy serves.
TEST_F(ClientTest, LoadOpensTheLocalCopyWhileMetaLocatesIt) {
  StartAgent();
  Client client = Connect();
  const auto w = Floats(64, 2.0f);
  SaveBuilder save = client.BeginSave(3);
  ASSERT_TRUE(save.Add("w", Bytes(w), DType::kF32, {64}).ok());
  ASSERT_TRUE(CommitAndWait(save).ok());
  {
    auto shard = client.Load(3);
    ASSERT_TRUE(shard.ok()) << shard.status();
    auto view = shard->View("w");
    ASSERT_TRUE(view.ok());
    EXPECT_TRUE(Equal(*view, Bytes(w)));
  }
  std::vector<float> back(64);
  ASSERT_TRUE(client.LoadInto(3, {{"w", std::as_writable_bytes(std::span(back))}}).ok());
  EXPECT_EQ(back, w);
  EXPECT_EQ(agent_->local_opens(), 2);
  EXPECT_EQ(agent_->located_opens(), 0);
  EXPECT_EQ(agent_->WaitOpenHandles(0), 0);
  // A step meta does not know: meta's answer, the local attempt closed.
  absl::Status s = client.Load(4).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("Locate"));
}

// A local copy whose crc32c is not the version's is never served: the
// client asks again with meta's answer, and the agent refuses it.
TEST_F(ClientTest, LocalCopyThatIsNotTheVersionsIsNotUsed) {
  FakeAgent::Options o;
  o.local_copy_differs = true;
  StartAgent(o);
  Client client = Connect();
  const auto w = Floats(64, 2.0f);
  SaveBuilder save = client.BeginSave(3);
  ASSERT_TRUE(save.Add("w", Bytes(w), DType::kF32, {64}).ok());
  ASSERT_TRUE(CommitAndWait(save).ok());
  absl::Status s = client.Load(3).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("differs from the expected shard"));
  std::vector<float> back(64);
  s = client.LoadInto(3, {{"w", std::as_writable_bytes(std::span(back))}});
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(back, std::vector<float>(64));  // nothing copied
  EXPECT_EQ(agent_->local_opens(), 2);
  EXPECT_EQ(agent_->located_opens(), 2);
  EXPECT_EQ(agent_->WaitOpenHandles(0), 0);
}

// The agent reports a commit to meta in the background: a load right after
// the save finds the version still OPEN at meta, and waits for it (this
// client committed it moments ago) instead of failing.
TEST_F(ClientTest, LoadRightAfterTheSaveWaitsForTheAgentsReport) {
  FakeAgent::Options o;
  o.report_at_next_close = true;  // STAGED only after the load's first attempt
  StartAgent(o);
  Client client = Connect();
  const auto w = Floats(64, 5.0f);
  SaveBuilder save = client.BeginSave(6);
  ASSERT_TRUE(save.Add("w", Bytes(w), DType::kF32, {64}).ok());
  ASSERT_TRUE(CommitAndWait(save).ok());
  auto shard = client.Load(6);
  ASSERT_TRUE(shard.ok()) << shard.status();
  auto view = shard->View("w");
  ASSERT_TRUE(view.ok());
  EXPECT_TRUE(Equal(*view, Bytes(w)));
  EXPECT_EQ(agent_->local_opens(), 2);  // the first attempt, then the one after STAGED
  // A step this client did not save is not waited for.
  absl::Status s = client.Load(7).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
}

// A client belongs to the process that connected it: in a fork()ed child
// (none of its threads; its channels and agent session are the parent's)
// every call says so instead of hanging, and dropping it there does not hang
// either. The parent's client keeps working.
TEST_F(ClientTest, AForkedChildGetsAClearErrorAndDropsTheClientWithoutHanging) {
  StartAgent();
  std::optional<Client> client = Connect();
  const auto w = Floats(64, 3.0f);
  SaveBuilder save = client->BeginSave(1);
  ASSERT_TRUE(save.Add("w", Bytes(w), DType::kF32, {64}).ok());
  ASSERT_TRUE(CommitAndWait(save).ok());
  SaveBuilder lazy_save = client->BeginSave(2);
  ASSERT_TRUE(lazy_save.Add("w", Bytes(w), DType::kF32, {64}).ok());
  std::optional<absl::StatusOr<LazySave>> lazy = lazy_save.CommitLazy();
  ASSERT_TRUE(lazy->ok()) << lazy->status();
  ASSERT_TRUE((*lazy)->WaitCopied(absl::Now() + absl::Seconds(30)).ok());

  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int failures = 0;
    auto refused = [&](const absl::Status& s) {
      if (s.code() != absl::StatusCode::kFailedPrecondition || !absl::StrContains(s.message(), "fork()")) {
        std::fprintf(stderr, "not refused as forked: %s\n", s.ToString().c_str());
        ++failures;
      }
    };
    SaveBuilder child_save = client->BeginSave(3);
    if (!child_save.Add("w", Bytes(w), DType::kF32, {64}).ok()) ++failures;
    refused(child_save.Commit().status());
    refused(client->Load(1).status());
    std::vector<float> out(64);
    refused(client->LoadInto(1, {{"w", std::as_writable_bytes(std::span(out))}}));
    refused(client->WaitVersion(1, Level::kStaged, absl::Now() + absl::Seconds(1)));
    refused(client->Latest(Level::kStaged).status());
    refused((*lazy)->WaitCopied(absl::Now() + absl::Seconds(1)));
    refused((*lazy)->Wait(absl::Now() + absl::Seconds(1)).status());
    lazy.reset();    // the last handle of the lazy save: frees nothing here
    client.reset();  // nor does the client
    ::_exit(failures == 0 ? 0 : 1);
  }
  int status = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  pid_t done = 0;
  while ((done = ::waitpid(pid, &status, WNOHANG)) == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (done == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    FAIL() << "the forked child hung";
  }
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << "see the child's stderr above";
  // The parent's client is untouched.
  auto shard = client->Load(1);
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_TRUE(Equal(*shard->View("w"), Bytes(w)));
  ASSERT_TRUE((*lazy)->Wait(absl::Now() + absl::Seconds(30)).ok());
}

// Tens of thousands of items in one save (names checked for duplicates in
// constant time) round-trip with every name, shape and attribute.
TEST_F(ClientTest, ManyItemsRoundTrip) {
  StartAgent();
  Client client = Connect();
  constexpr size_t kItems = 20000;
  std::vector<uint32_t> values(kItems);
  SaveBuilder save = client.BeginSave(5);
  for (size_t i = 0; i < kItems; ++i) {
    values[i] = static_cast<uint32_t>(i * 2654435761u);
    std::map<std::string, std::string> attrs;
    if (i % 3 == 0) attrs.emplace("i", absl::StrCat(i));
    ASSERT_TRUE(save.Add(absl::StrCat("layers.", i / 10, ".p", i % 10), std::as_bytes(std::span(&values[i], 1)),
                         DType::kU32, {1}, std::move(attrs))
                    .ok());
  }
  absl::Status dup = save.Add("layers.7.p3", std::as_bytes(std::span(&values[0], 1)), DType::kU32, {1});
  EXPECT_EQ(dup.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(dup.message()), HasSubstr("already added"));
  EXPECT_EQ(save.item_count(), kItems);
  ASSERT_TRUE(CommitAndWait(save).ok());
  auto shard = client.Load(5);
  ASSERT_TRUE(shard.ok()) << shard.status();
  ASSERT_EQ(shard->items().size(), kItems);
  for (size_t i = 0; i < kItems; i += 997) {
    const LoadedItem* it = shard->Find(absl::StrCat("layers.", i / 10, ".p", i % 10));
    ASSERT_NE(it, nullptr) << i;
    EXPECT_EQ(it->attributes.size(), i % 3 == 0 ? 1u : 0u);
    auto v = shard->View(it->name);
    ASSERT_TRUE(v.ok());
    uint32_t got = 0;
    std::memcpy(&got, v->data(), 4);
    EXPECT_EQ(got, values[i]);
  }
}

// Two regions with a hole between them in the file: an item that crosses the
// boundary is copied in two pieces on save, and View copies it out (checked).
TEST_F(ClientTest, ItemStraddlingNonAdjacentRegions) {
  StartAgent({.split_at = 4096, .hole_bytes = 8192});
  Client client = Connect();
  const auto a = Pattern(3000, 5);
  const auto b = Pattern(5000, 6);  // at 3008: crosses shard byte 4096
  const auto c = Pattern(100, 7);   // wholly in region 2
  SaveBuilder save = client.BeginSave(3);
  ASSERT_TRUE(save.Add("a", a, DType::kU8, {3000}).ok());
  ASSERT_TRUE(save.Add("b", b, DType::kU8, {5000}).ok());
  ASSERT_TRUE(save.Add("c", c, DType::kU8, {100}).ok());
  auto handle = CommitAndWait(save);
  ASSERT_TRUE(handle.ok()) << handle.status();
  EXPECT_EQ(agent_->crc_mismatches(), 0);
  auto committed = agent_->Committed(job_, 3, 0);
  ASSERT_TRUE(committed.has_value());
  EXPECT_EQ(committed->crc32c(), handle->crc32c());
  EXPECT_EQ(committed->items(1).offset_bytes(), 3008u);
  EXPECT_EQ(committed->items(1).crc32c(), Crc32c(std::span<const std::byte>(b)));

  auto shard = client.Load(3);
  ASSERT_TRUE(shard.ok()) << shard.status();
  auto va = shard->View("a");
  auto vb = shard->View("b");
  auto vc = shard->View("c");
  ASSERT_TRUE(va.ok() && vb.ok() && vc.ok());
  EXPECT_TRUE(Equal(*va, a));
  EXPECT_TRUE(Equal(*vb, b));
  EXPECT_TRUE(Equal(*vc, c));
  // b is a private copy, not a view at its place after a.
  EXPECT_NE(vb->data(), va->data() + 3008);
  auto vb2 = shard->View("b");
  ASSERT_TRUE(vb2.ok());
  EXPECT_EQ(vb2->data(), vb->data());  // copied once

  std::vector<std::byte> b_back(5000);
  ASSERT_TRUE(client.LoadInto(3, {{"b", std::span(b_back)}}).ok());
  EXPECT_EQ(b_back, b);
}

// Two regions adjacent in the file: the straddling item is still zero copy.
TEST_F(ClientTest, ItemStraddlingAdjacentRegionsIsZeroCopy) {
  StartAgent({.split_at = 4096, .hole_bytes = 0});
  Client client = Connect();
  const auto a = Pattern(3000, 8);
  const auto b = Pattern(5000, 9);
  ASSERT_TRUE(SaveBytes(client, 4, {{"a", &a}, {"b", &b}}).ok());
  EXPECT_EQ(agent_->crc_mismatches(), 0);
  auto shard = client.Load(4);
  ASSERT_TRUE(shard.ok()) << shard.status();
  auto va = shard->View("a");
  auto vb = shard->View("b");
  ASSERT_TRUE(va.ok() && vb.ok());
  EXPECT_TRUE(Equal(*vb, b));
  EXPECT_EQ(vb->data(), va->data() + 3008);
}

// GCC 12 warns about a std::string copy inlined into this test (a false
// -Wrestrict, GCC bug 105329) once this file holds enough other tests.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wrestrict"
TEST_F(ClientTest, BadItemsAreRejectedAtAdd) {
  StartAgent();
  Client client = Connect();
  const std::vector<float> f(10);
  SaveBuilder save = client.BeginSave(1);
  ASSERT_TRUE(save.Add("x", Bytes(f), DType::kF32, {10}).ok());
  EXPECT_EQ(save.Add("x", Bytes(f), DType::kF32, {10}).code(),
            absl::StatusCode::kInvalidArgument);  // duplicate
  EXPECT_EQ(save.Add("y", Bytes(f), DType::kF32, {11}).code(),
            absl::StatusCode::kInvalidArgument);  // shape says 44 bytes
  EXPECT_EQ(save.Add("y", Bytes(f), DType::kF64, {10}).code(),
            absl::StatusCode::kInvalidArgument);  // dtype says 80 bytes
  EXPECT_EQ(save.Add("y", Bytes(f), DType::kF32, {}).code(),
            absl::StatusCode::kInvalidArgument);  // scalar is 4 bytes
  EXPECT_EQ(save.Add("y", Bytes(f), static_cast<DType>(99), {10}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(save.Add("", Bytes(f), DType::kF32, {10}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(save.Add(std::string("a\0b", 3), Bytes(f), DType::kF32, {10}).code(),
            absl::StatusCode::kInvalidArgument);
  std::map<std::string, std::string> too_many;
  for (int i = 0; i < 17; ++i) too_many[absl::StrCat("k", i)] = "v";
  EXPECT_EQ(save.Add("y", Bytes(f), DType::kF32, {10}, too_many).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(save.Add("opaque", Bytes(f), DType::kBytes, {}).ok());  // any length
  EXPECT_TRUE(save.Add("empty", {}, DType::kF32, {0, 5}).ok());
  EXPECT_EQ(save.item_count(), 3u);
  auto handle = CommitAndWait(save);
  ASSERT_TRUE(handle.ok()) << handle.status();
  EXPECT_EQ(save.Add("z", Bytes(f), DType::kF32, {10}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CommitAndWait(save).status().code(), absl::StatusCode::kFailedPrecondition);
  // Saving the same step again on this node: the agent already holds it.
  SaveBuilder again = client.BeginSave(1);
  ASSERT_TRUE(again.Add("x", Bytes(f), DType::kF32, {10}).ok());
  EXPECT_EQ(CommitAndWait(again).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(agent_->open_leases(), 0);
}

#pragma GCC diagnostic pop

TEST_F(ClientTest, ConnectRejectsBadOptions) {
  StartAgent();
  ClientOptions o = Options(/*rank=*/2, /*world_size=*/2);
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options(0, 0);
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options();
  o.job_id = "../etc";
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.job_id = "Upper";
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options();
  o.meta_address.clear();
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  // Meta rejects a policy it cannot place (40 nodes needed).
  o = Options();
  o.protection = Protection::ErasureCode(32, 8);
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientTest, RanksOpenTheJobRankZeroCreates) {
  StartAgent();
  // Rank 1 alone: the job never appears.
  ClientOptions o1 = Options(1, 2);
  o1.connect_timeout = absl::Milliseconds(300);
  auto early = Client::Connect(o1);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded) << early.status();

  EXPECT_THAT(std::string(early.status().message()), HasSubstr("rank 0 did not create job"));

  // Rank 0 creates it; rank 1, asking afterwards, opens it. (Rank 1 asking
  // first, waiting and joining once rank 0 created the job, is forced in that
  // order against a fake meta: MetaLinkJoin in meta_link_test. Here the two
  // used to race, and the test passed whichever went first.)
  auto rank0 = Client::Connect(Options(0, 2));
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  auto rank1 = Client::Connect(Options(1, 2));
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  // Rank 0 again (a restart): create-or-open.
  EXPECT_TRUE(Client::Connect(Options(0, 2)).ok());
  // Another world size or protection: refused.
  EXPECT_EQ(Client::Connect(Options(0, 3)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Client::Connect(Options(1, 3)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ClientOptions ec = Options(0, 2);
  ec.protection = Protection::ErasureCode(1, 1);
  EXPECT_EQ(Client::Connect(ec).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ClientTest, WaitReportsStateAtDeadline) {
  StartAgent();
  Client client = Connect(0, 2);
  EXPECT_EQ(client.Latest(Level::kStaged).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client.WaitVersion(5, Level::kStaged, absl::Now() + absl::Seconds(5)).code(),
            absl::StatusCode::kNotFound);

  const auto a = Pattern(100, 1);
  SaveBuilder save = client.BeginSave(5);
  ASSERT_TRUE(save.Add("a", a, DType::kU8, {100}).ok());
  auto handle = CommitAndWait(save);
  ASSERT_TRUE(handle.ok()) << handle.status();
  // Rank 1 never saves: the version stays OPEN.
  absl::Status s = handle->Wait(Level::kStaged, absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("OPEN"));
  // A deadline in the past checks once.
  EXPECT_EQ(handle->Wait(Level::kStaged, absl::InfinitePast()).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(client.Latest(Level::kStaged).status().code(), absl::StatusCode::kNotFound);
  // Not restorable until staged.
  EXPECT_EQ(client.Load(5).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ClientTest, FailedCommitAbortsTheLease) {
  StartAgent();
  const auto a = Pattern(100, 1);
  for (bool background : {true, false}) {
    SCOPED_TRACE(background ? "commit in the background" : "commit before Commit returns");
    ClientOptions o = Options();
    o.commit_in_background = background;
    auto client = Client::Connect(o);
    ASSERT_TRUE(client.ok()) << client.status();
    const uint64_t step = background ? 9 : 19;
    const int commits = agent_->commits();
    const int aborts = agent_->aborts();
    agent_->FailNextCommit(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "injected"), false);
    SaveBuilder save = client->BeginSave(step);
    ASSERT_TRUE(save.Add("a", a, DType::kU8, {100}).ok());
    auto handle = save.Commit();
    absl::Status s = handle.status();
    if (background) {
      // Commit returned after the copy; the agent's answer is the handle's.
      ASSERT_TRUE(handle.ok()) << handle.status();
      s = handle->Committed();
      EXPECT_EQ(handle->Wait(Level::kStaged, absl::Now() + absl::Seconds(20)).code(),
                absl::StatusCode::kInvalidArgument);
    }
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("CommitShard: injected"));
    EXPECT_EQ(agent_->aborts(), aborts + 1);
    EXPECT_EQ(agent_->open_leases(), 0);
    EXPECT_EQ(agent_->commits(), commits);

    // A retry of the same step succeeds.
    SaveBuilder retry = client->BeginSave(step);
    ASSERT_TRUE(retry.Add("a", a, DType::kU8, {100}).ok());
    auto retried = retry.Commit();
    ASSERT_TRUE(retried.ok()) << retried.status();
    ASSERT_TRUE(retried->Committed().ok());
    EXPECT_EQ(agent_->commits(), commits + 1);
  }
}

TEST_F(ClientTest, CommitReturnsBeforeTheAgentAnswersAndTheClientsLoadsWaitForIt) {
  StartAgent();
  Client client = Connect();
  const auto a = Pattern(100, 7);
  agent_->HoldCommits(true);
  SaveBuilder save = client.BeginSave(12);
  ASSERT_TRUE(save.Add("a", a, DType::kU8, {100}).ok());
  auto handle = save.Commit();  // returns while the agent holds the commit
  ASSERT_TRUE(handle.ok()) << handle.status();
  absl::Status pending = handle->Committed(absl::Now());
  EXPECT_EQ(pending.code(), absl::StatusCode::kDeadlineExceeded) << pending;
  EXPECT_EQ(agent_->commits(), 0);
  // A wait with a deadline keeps it, even while the commit is pending.
  absl::Status waited = client.WaitVersion(12, Level::kStaged, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded) << waited;
  EXPECT_THAT(std::string(waited.message()), HasSubstr("not answered"));

  // This client's own load of the step waits for the commit: it is not
  // known anywhere until the agent took it.
  absl::StatusOr<LoadedShard> loaded = absl::UnknownError("not run");
  std::thread loader([&] { loaded = client.Load(12); });
  agent_->HoldCommits(false);
  loader.join();
  ASSERT_TRUE(handle->Committed().ok());
  EXPECT_EQ(agent_->commits(), 1);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto view = loaded->View("a");
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_TRUE(Equal(*view, a));
}

TEST_F(ClientTest, ClosingTheClientSendsTheCommitsItHasNotSentYet) {
  StartAgent();
  const auto a = Pattern(100, 3);
  agent_->HoldCommits(true);
  std::optional<Client> client(Connect());
  absl::StatusOr<SaveHandle> handle = absl::UnknownError("not saved");
  {
    SaveBuilder save = client->BeginSave(13);  // holds the connection too: gone at the brace
    ASSERT_TRUE(save.Add("a", a, DType::kU8, {100}).ok());
    handle = save.Commit();
  }
  ASSERT_TRUE(handle.ok()) << handle.status();
  EXPECT_EQ(agent_->commits(), 0);
  // The client goes (its destructor waits for the committer); the handle
  // keeps the connection's state alive, so it goes only after the handle.
  std::thread closer([&] {
    client.reset();
    handle = absl::UnknownError("dropped");
  });
  agent_->HoldCommits(false);
  closer.join();
  EXPECT_EQ(agent_->commits(), 1);
  EXPECT_TRUE(agent_->Committed(job_, 13, 0).has_value());
}

TEST_F(ClientTest, ReplayedOrLostCommitResponseIsSuccess) {
  StartAgent();
  Client client = Connect();
  const auto a = Pattern(100, 1);
  // The commit took effect but its response was lost: AbortLease then says
  // the lease is committed.
  agent_->FailNextCommit(grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection reset"), true);
  SaveBuilder save = client.BeginSave(10);
  ASSERT_TRUE(save.Add("a", a, DType::kU8, {100}).ok());
  auto handle = CommitAndWait(save);
  ASSERT_TRUE(handle.ok()) << handle.status();
  EXPECT_EQ(handle->crc32c(), agent_->Committed(job_, 10, 0)->crc32c());
  EXPECT_EQ(agent_->aborts(), 0);

  // ALREADY_EXISTS from CommitShard: a replay.
  agent_->FailNextCommit(grpc::Status(grpc::StatusCode::ALREADY_EXISTS, "replay"), true);
  SaveBuilder save2 = client.BeginSave(11);
  ASSERT_TRUE(save2.Add("a", a, DType::kU8, {100}).ok());
  auto handle2 = CommitAndWait(save2);
  ASSERT_TRUE(handle2.ok()) << handle2.status();
  EXPECT_EQ(handle2->crc32c(), agent_->Committed(job_, 11, 0)->crc32c());
  EXPECT_EQ(agent_->commits(), 2);
}

TEST_F(ClientTest, UsesTheAgentsItemAlignment) {
  StartAgent({.item_alignment = 4096});
  Client client = Connect();
  const auto a = Pattern(100, 1);
  const auto b = Pattern(100, 2);
  for (uint64_t step : {1, 2}) {
    SaveBuilder save = client.BeginSave(step);
    ASSERT_TRUE(save.Add("a", a, DType::kU8, {100}).ok());
    ASSERT_TRUE(save.Add("b", b, DType::kU8, {100}).ok());
    auto handle = CommitAndWait(save);
    ASSERT_TRUE(handle.ok()) << handle.status();
    auto committed = agent_->Committed(job_, step, 0);
    ASSERT_TRUE(committed.has_value());
    EXPECT_EQ(committed->items(1).offset_bytes(), 4096u) << "step " << step;
  }
  // The first save learnt the alignment (a second lease), the second used it.
  EXPECT_EQ(agent_->leases_granted(), 3);
  EXPECT_EQ(agent_->open_leases(), 0);
}

TEST_F(ClientTest, LoadedShardOutlivesTheClient) {
  StartAgent();
  const auto a = Pattern(10000, 1);
  absl::StatusOr<LoadedShard> shard = absl::UnknownError("not loaded");
  {
    Client client = Connect();
    SaveBuilder save = client.BeginSave(1);
    ASSERT_TRUE(save.Add("a", a, DType::kU8, {10000}).ok());
    ASSERT_TRUE(CommitAndWait(save).ok());
    shard = client.Load(1);
    ASSERT_TRUE(shard.ok()) << shard.status();
  }
  auto view = shard->View("a");
  ASSERT_TRUE(view.ok());
  EXPECT_TRUE(Equal(*view, a));
  EXPECT_EQ(agent_->open_handles(), 1);
  LoadedShard moved = *std::move(shard);
  shard = absl::UnknownError("moved");
  EXPECT_EQ(agent_->open_handles(), 1);
  { LoadedShard gone = std::move(moved); }
  EXPECT_EQ(agent_->WaitOpenHandles(0), 0);
}

TEST_F(ClientTest, MapsFilesTheAgentDidNotListOnDemand) {
  StartAgent({.list_pool_files = false});
  Client client = Connect();
  const auto a = Pattern(70000, 1);
  for (uint64_t step : {1, 2}) {
    SaveBuilder save = client.BeginSave(step);
    ASSERT_TRUE(save.Add("a", a, DType::kU8, {70000}).ok());
    auto handle = CommitAndWait(save);
    ASSERT_TRUE(handle.ok()) << handle.status();
  }
  EXPECT_EQ(agent_->crc_mismatches(), 0);
  auto shard = client.Load(2);
  ASSERT_TRUE(shard.ok()) << shard.status();
  auto view = shard->View("a");
  ASSERT_TRUE(view.ok());
  EXPECT_TRUE(Equal(*view, a));
}

TEST_F(ClientTest, ConnectGivesUpWhenTheAgentIsAbsent) {
  ClientOptions o = Options();
  o.agent_socket = dir_->path() + "/no-agent.sock";
  o.connect_timeout = absl::Milliseconds(300);
  const absl::Time start = absl::Now();
  auto c = Client::Connect(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("no-agent.sock"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST_F(ClientTest, EmptySaveStagesTheRank) {
  StartAgent();
  Client client = Connect();
  auto handle = client.BeginSave(1).Commit();
  ASSERT_TRUE(handle.ok()) << handle.status();
  EXPECT_EQ(handle->size_bytes(), 1u);
  EXPECT_TRUE(handle->Wait(Level::kStaged, absl::Now() + absl::Seconds(20)).ok());
  auto shard = client.Load(1);
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_TRUE(shard->items().empty());
}

// Issue 16: a lazy save returns before anything is copied (the agent holds
// the lease back), the trainer waits for the copy only before it changes the
// items, and what is committed is what was there before the change.
TEST_F(ClientTest, LazySaveCommitsTheBytesAsTheyWereBeforeTheyChanged) {
  StartAgent();
  Client client = Connect();
  std::vector<float> w = Floats(5000, 1.0f);
  std::vector<float> b = Floats(300, 7.0f);
  const std::vector<float> w0 = w, b0 = b;
  SaveBuilder save = client.BeginSave(20);
  ASSERT_TRUE(save.Add("w", Bytes(w), DType::kF32, {5000}).ok());
  ASSERT_TRUE(save.Add("b", Bytes(b), DType::kF32, {300}).ok());
  agent_->HoldLeases(true);
  absl::StatusOr<LazySave> lazy = save.CommitLazy();
  ASSERT_TRUE(lazy.ok()) << lazy.status();
  EXPECT_EQ(lazy->step(), 20u);
  EXPECT_EQ(lazy->item_count(), 2u);
  EXPECT_EQ(lazy->copied_items(), 0u);  // returned while the lease is still held back
  EXPECT_EQ(lazy->WaitCopied(absl::Now()).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(lazy->Wait(absl::Now()).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(CommitAndWait(save).status().code(), absl::StatusCode::kFailedPrecondition);  // spent
  agent_->HoldLeases(false);
  ASSERT_TRUE(lazy->WaitItemCopied(0).ok());
  EXPECT_GE(lazy->copied_items(), 1u);
  ASSERT_TRUE(lazy->WaitCopied().ok());
  EXPECT_EQ(lazy->copied_items(), 2u);
  // The optimizer step: every item changes in place.
  for (float& x : w) x += 100.0f;
  for (float& x : b) x = -x;
  absl::StatusOr<SaveHandle> handle = lazy->Wait();
  ASSERT_TRUE(handle.ok()) << handle.status();
  EXPECT_EQ(agent_->crc_mismatches(), 0);
  EXPECT_EQ(handle->crc32c(), agent_->Committed(job_, 20, 0)->crc32c());
  std::vector<float> w_back(5000), b_back(300);
  ASSERT_TRUE(client
                  .LoadInto(20, {{"w", std::as_writable_bytes(std::span(w_back))},
                                 {"b", std::as_writable_bytes(std::span(b_back))}})
                  .ok());
  EXPECT_EQ(w_back, w0);
  EXPECT_EQ(b_back, b0);
  EXPECT_EQ(lazy->WaitItemCopied(2).code(), absl::StatusCode::kInvalidArgument);
}

// A wait or load of the step a lazy save is still copying waits for that
// save's commit: it used to answer "no version" at once, since the step was
// known to the client only once committed (the Python client waited on its
// own; C++ callers got NotFound).
TEST_F(ClientTest, AWaitOrLoadOfALazySavesStepWaitsForItsCommit) {
  StartAgent();
  Client client = Connect();
  std::vector<float> w = Floats(5000, 3.0f);
  const std::vector<float> w0 = w;
  SaveBuilder save = client.BeginSave(21);
  ASSERT_TRUE(save.Add("w", Bytes(w), DType::kF32, {5000}).ok());
  agent_->HoldLeases(true);
  absl::StatusOr<LazySave> lazy = save.CommitLazy();
  ASSERT_TRUE(lazy.ok()) << lazy.status();
  const absl::Status early = client.WaitVersion(21, Level::kStaged, absl::Now());
  EXPECT_EQ(early.code(), absl::StatusCode::kDeadlineExceeded) << early;
  EXPECT_THAT(std::string(early.message()), HasSubstr("lazy save still copying"));
  agent_->HoldLeases(false);
  // Neither WaitCopied nor Wait first: the client's own waits see to it.
  const absl::Status staged = client.WaitVersion(21, Level::kStaged, absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(staged.ok()) << staged;
  std::vector<float> back(5000);
  ASSERT_TRUE(client.LoadInto(21, {{"w", std::as_writable_bytes(std::span(back))}}).ok());
  EXPECT_EQ(back, w0);
  ASSERT_TRUE(lazy->Wait().ok());
}

// A lazy save reports what Commit would: a failed lease before the copy (the
// items were never read), a failed commit after it (the lease is released).
TEST_F(ClientTest, LazySaveReportsFailuresThroughItsWaits) {
  StartAgent(FakeAgent::Options{.pool_bytes = 1 << 20});
  Client client = Connect();
  const auto big = Pattern(2 << 20, 3);
  SaveBuilder save = client.BeginSave(30);
  ASSERT_TRUE(save.Add("big", big, DType::kU8, {big.size()}).ok());
  absl::StatusOr<LazySave> lazy = save.CommitLazy();
  ASSERT_TRUE(lazy.ok()) << lazy.status();
  const absl::Status copied = lazy->WaitCopied();
  EXPECT_FALSE(copied.ok());
  EXPECT_EQ(lazy->copied_items(), 0u);
  EXPECT_EQ(lazy->Wait().status(), copied);
  EXPECT_EQ(agent_->commits(), 0);

  const auto a = Pattern(100, 1);
  agent_->FailNextCommit(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "injected"), false);
  SaveBuilder save2 = client.BeginSave(31);
  ASSERT_TRUE(save2.Add("a", a, DType::kU8, {100}).ok());
  absl::StatusOr<LazySave> lazy2 = save2.CommitLazy();
  ASSERT_TRUE(lazy2.ok());
  EXPECT_TRUE(lazy2->WaitCopied().ok());
  absl::StatusOr<SaveHandle> h = lazy2->Wait();
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("CommitShard: injected"));
  EXPECT_EQ(agent_->open_leases(), 0);

  // Checks that need no I/O fail at once.
  SaveBuilder bad = client.BeginSave(uint64_t{1} << 60);
  EXPECT_EQ(bad.CommitLazy().status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LazySave().WaitCopied().code(), absl::StatusCode::kFailedPrecondition);
}

// Dropping every handle of a lazy save waits for it: nothing reads the items
// after that, and the save is committed.
TEST_F(ClientTest, DroppingALazySaveWaitsForItAndItCommits) {
  StartAgent();
  Client client = Connect();
  {
    const auto a = Pattern(70000, 5);
    SaveBuilder save = client.BeginSave(40);
    ASSERT_TRUE(save.Add("a", a, DType::kU8, {a.size()}).ok());
    absl::StatusOr<LazySave> lazy = save.CommitLazy();
    ASSERT_TRUE(lazy.ok());
    LazySave copy = *lazy;  // copies share the save
  }  // `a` goes after the handles: their destructor waited for the copy
  EXPECT_EQ(agent_->commits(), 1);
  EXPECT_TRUE(agent_->Committed(job_, 40, 0).has_value());
  // An empty lazy save stages the rank as an empty Commit does.
  SaveBuilder empty = client.BeginSave(41);
  absl::StatusOr<LazySave> lazy = empty.CommitLazy();
  ASSERT_TRUE(lazy.ok());
  EXPECT_TRUE(lazy->WaitCopied().ok());
  EXPECT_TRUE(lazy->Wait().ok());
}

// Issue 16: the Young/Daly interval from this client's measured save cost and
// the MTBF meta reports (here: a node meta has watched without a failure, so
// the MTBF is a lower bound: the time observed).
TEST_F(ClientTest, RecommendedIntervalIsYoungDalyFromTheSaveCostAndMetasMtbf) {
  StartAgent();
  Client client = Connect();
  EXPECT_EQ(client.RecommendedInterval(absl::Milliseconds(100)).status().code(),
            absl::StatusCode::kFailedPrecondition);  // nothing saved yet
  EXPECT_EQ(client.RecommendedInterval(absl::ZeroDuration()).status().code(), absl::StatusCode::kInvalidArgument);
  const auto a = Pattern(1 << 20, 2);
  SaveBuilder save = client.BeginSave(1);
  ASSERT_TRUE(save.Add("a", a, DType::kU8, {a.size()}).ok());
  ASSERT_TRUE(CommitAndWait(save).ok());
  // The fake agent does not register with meta: register a node by hand.
  {
    const std::string node = "mtbf-" + job_.substr(0, 20);
    ckpt::v1::MetaService::Stub* stub = meta_->NodeStub(node);
    ckpt::v1::RegisterNodeRequest req;
    req.set_node_id(node);
    req.set_grpc_address("127.0.0.1:1");
    req.set_data_address("127.0.0.1:2");
    req.set_memory_capacity_bytes(1 << 20);
    req.set_role(ckpt::v1::NODE_ROLE_HOST);
    ckpt::v1::RegisterNodeResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status st = stub->RegisterNode(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_code() << " " << st.error_message() << " " << meta_->address();
  }
  absl::SleepFor(absl::Milliseconds(50));  // some node time to observe (real meta, real clock)
  absl::StatusOr<IntervalAdvice> adv = client.RecommendedInterval(absl::Milliseconds(10));
  ASSERT_TRUE(adv.ok()) << adv.status();
  EXPECT_GT(adv->checkpoint_cost, absl::ZeroDuration());
  EXPECT_GT(adv->mtbf, absl::ZeroDuration());
  EXPECT_GE(adv->job_nodes, 1u);
  EXPECT_EQ(adv->mtbf_is_lower_bound, adv->failures_seen == 0);
  // The interval is Young's formula (checked against known values below) of
  // the cost and MTBF the advice reports.
  const IntervalAdvice young = YoungDalyInterval(adv->checkpoint_cost, adv->mtbf, absl::Milliseconds(10));
  EXPECT_EQ(adv->interval, young.interval);
  EXPECT_EQ(adv->steps, young.steps);
  EXPECT_THAT(adv->explanation, HasSubstr("Young/Daly"));
}

// Young's interval sqrt(2 x C x M) against values worked out by hand (not
// recomputed from what the code returned).
TEST(YoungDalyInterval, KnownValues) {
  // C = 10 s, M = 1 h: sqrt(2 x 10 x 3600) = sqrt(72000) = 268.3282 s.
  IntervalAdvice a = YoungDalyInterval(absl::Seconds(10), absl::Hours(1), absl::Seconds(1));
  EXPECT_NEAR(absl::ToDoubleSeconds(a.interval), 268.3282, 1e-4);
  EXPECT_EQ(a.steps, 268u);  // 268.33 steps of 1 s, rounded
  EXPECT_EQ(a.checkpoint_cost, absl::Seconds(10));
  EXPECT_EQ(a.mtbf, absl::Hours(1));
  EXPECT_EQ(YoungDalyInterval(absl::Seconds(10), absl::Hours(1), absl::Milliseconds(500)).steps, 537u);  // 536.66
  // C = 8 s, M = 1 h: sqrt(57600) = 240 s exactly; 960 steps of 250 ms.
  a = YoungDalyInterval(absl::Seconds(8), absl::Hours(1), absl::Milliseconds(250));
  EXPECT_EQ(a.interval, absl::Seconds(240));
  EXPECT_EQ(a.steps, 960u);
  // C = 2 s, M = 1 day: sqrt(345600) = 587.8775 s, 59 steps of 10 s (58.79).
  a = YoungDalyInterval(absl::Seconds(2), absl::Hours(24), absl::Seconds(10));
  EXPECT_NEAR(absl::ToDoubleSeconds(a.interval), 587.8775, 1e-4);
  EXPECT_EQ(a.steps, 59u);
  // A step longer than the interval: at least 1 step (240 s / 1000 s rounds to 0).
  EXPECT_EQ(YoungDalyInterval(absl::Seconds(8), absl::Hours(1), absl::Seconds(1000)).steps, 1u);
  // 100 ms cost, 50 ms MTBF: sqrt(2 x 0.1 x 0.05) = 0.1 s.
  EXPECT_NEAR(absl::ToDoubleSeconds(YoungDalyInterval(absl::Milliseconds(100), absl::Milliseconds(50),
                                                      absl::Milliseconds(10)).interval),
              0.1, 1e-9);
}

}  // namespace
}  // namespace ckpt
