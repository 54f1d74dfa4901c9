// The real ckptctl binary against real ckpt-meta and ckpt-agent processes:
// create-job, jobs/versions/status/nodes/inspect in human and --json form, a
// version saved through ckpt::Client, flush to PERSISTED and a byte-exact
// restore from the durable tier, server errors (exit 1) and usage errors
// (exit 2).
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "ckpt/client.h"
#include "common/durable_format.h"
#include "common/file_system.h"
#include "integration/agent_process.h"
#include "integration/meta_process.h"
#include "integration/node_cluster.h"
#include "integration/client_options.h"
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
using Json = nlohmann::json;

std::vector<float> Tensor(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng() % 100000) / 7.0f;
  return v;
}

class CkptctlTest : public testing::NodeClusterTest {
 protected:
  CkptctlTest() : NodeClusterTest("64MiB") {}

  Json CtlJson(std::vector<std::string> args) {
    args.insert(args.begin(), "--json");
    RunResult r = Ctl(args);
    EXPECT_TRUE(r.status.success()) << r.status << "\n" << r.stderr_text;
    Json j = Json::parse(r.stdout_text, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(j.is_discarded()) << r.stdout_text;
    return j;
  }

  ClientOptions Options(const std::string& job, uint32_t rank, uint32_t world) {
    return testing::ClientOptionsFor(*meta_, *agent_, job, rank, world);
  }

};

TEST_F(CkptctlTest, CreateJobThenJobsVersionsStatusNodesHumanAndJson) {
  RunResult r = Ctl({"create-job", "llm", "--world-size", "4", "--no-protection",
                     "--flush-every", "5", "--keep-in-memory", "2"});
  ASSERT_TRUE(r.status.success()) << r.status << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("llm"));

  r = Ctl({"jobs"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("JOB"));
  EXPECT_THAT(r.stdout_text, HasSubstr("llm"));
  Json jobs = CtlJson({"jobs"});
  ASSERT_EQ(jobs["jobs"].size(), 1u);
  EXPECT_EQ(jobs["jobs"][0]["id"], "llm");
  EXPECT_EQ(jobs["jobs"][0]["world_size"], 4);
  EXPECT_EQ(jobs["jobs"][0]["protection"], "none");
  EXPECT_EQ(jobs["jobs"][0]["flush_every_n_versions"], 5);
  EXPECT_EQ(jobs["jobs"][0]["keep_in_memory"], 2);
  EXPECT_EQ(jobs["jobs"][0]["versions"], 0);

  r = Ctl({"versions", "llm"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("STEP"));
  Json versions = CtlJson({"versions", "llm"});
  EXPECT_EQ(versions["job"], "llm");
  EXPECT_TRUE(versions["versions"].empty());

  r = Ctl({"status"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("1 alive"));
  Json status = CtlJson({"status"});
  EXPECT_EQ(status["jobs"], 1);
  EXPECT_EQ(status["nodes_by_state"]["alive"], 1);
  EXPECT_GT(status["memory_capacity_bytes"].get<uint64_t>(), 0u);
  EXPECT_TRUE(status["problems"].is_array());
  // The failure history (no failure yet: the MTBF is a lower bound).
  EXPECT_EQ(status["failure_stats"]["failures"], 0);
  EXPECT_EQ(status["failure_stats"]["mtbf_is_lower_bound"], true);
  r = Ctl({"status", "--job", "llm"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("failures:  0 seen in"));
  EXPECT_THAT(r.stdout_text, HasSubstr("job llm on 1 node(s): >= "));
  Json job_status = CtlJson({"status", "--job", "llm"});
  EXPECT_EQ(job_status["failure_stats"]["job_nodes"], 1);
  EXPECT_EQ(job_status["failure_stats"]["job_mtbf_ms"], job_status["failure_stats"]["node_mtbf_ms"]);

  r = Ctl({"nodes"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("node-1"));
  EXPECT_THAT(r.stdout_text, HasSubstr("alive"));
  EXPECT_THAT(r.stdout_text, HasSubstr("s ago"));
  Json nodes = CtlJson({"nodes"});
  ASSERT_EQ(nodes["nodes"].size(), 1u);
  EXPECT_EQ(nodes["nodes"][0]["id"], "node-1");
  EXPECT_EQ(nodes["nodes"][0]["state"], "alive");

  // Creating it again with another spec is the server's error: exit 1.
  r = Ctl({"create-job", "llm", "--world-size", "8"});
  EXPECT_EQ(r.status.exit_code(), 1) << r.stdout_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("ckptctl: "));

  // No protection flag: the server's default, none on this one-node cluster
  // (issue 13 #3: this used to be refused with "spec.protection is required").
  r = Ctl({"create-job", "solo", "--world-size", "1"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("protection none, the server's default"));
}

TEST_F(CkptctlTest, SavedVersionVisibleThenFlushedPersistedAndRestoredByteExact) {
  ClientOptions o = Options("gpt", 0, 1);
  absl::StatusOr<Client> c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<float> w = Tensor(50000, 1);
  SaveBuilder s = c->BeginSave(7);
  ASSERT_TRUE(s.Add("w", std::as_bytes(std::span<const float>(w)), DType::kF32, {w.size()}).ok());
  absl::StatusOr<SaveHandle> h = s.Commit();
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(h->Wait(Level::kStaged, absl::Now() + absl::Seconds(30)).ok());

  RunResult r = Ctl({"versions", "gpt"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("1/1"));
  EXPECT_THAT(r.stdout_text, HasSubstr("KiB"));
  Json versions = CtlJson({"versions", "gpt"});
  ASSERT_EQ(versions["versions"].size(), 1u);
  EXPECT_EQ(versions["versions"][0]["step"], 7);
  EXPECT_EQ(versions["versions"][0]["shards_staged"], 1);

  r = Ctl({"inspect", "gpt", "7"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("node-1(primary/valid)"));
  Json v = CtlJson({"inspect", "gpt", "7"});
  ASSERT_EQ(v["shards"].size(), 1u);
  EXPECT_EQ(v["shards"][0]["rank"], 0);
  EXPECT_EQ(v["shards"][0]["crc32c"], absl::StrFormat("%08x", h->crc32c()));
  EXPECT_EQ(v["shards"][0]["copies"][0]["node_id"], "node-1");

  r = Ctl({"flush", "gpt", "7"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  ASSERT_TRUE(h->Wait(Level::kPersisted, absl::Now() + absl::Seconds(60)).ok())
      << agent_->proc()->LogTail();
  // Meta's view catches up with the client's wait: bounded poll.
  std::string state;
  for (int i = 0; i < 300 && state != "persisted"; ++i) {
    state = CtlJson({"inspect", "gpt", "7"})["state"];
    if (state != "persisted") absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_EQ(state, "persisted");

  const std::string vdir = absl::StrCat(agent_->options().durable_root, "/gpt/7");
  const std::string out = absl::StrCat(dir_->path(), "/restored");
  r = Ctl({"restore", "--from-dir", vdir, "--out", out});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  absl::StatusOr<std::string> want = ReadFileToString(PosixFileSystem(), vdir + "/rank-00000.bin");
  absl::StatusOr<std::string> got = ReadFileToString(PosixFileSystem(), out + "/rank-00000.bin");
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_EQ(*want, *got);
  EXPECT_EQ(std::memcmp(got->data(), w.data(), w.size() * sizeof(float)), 0);
  absl::StatusOr<std::string> manifest = ReadFileToString(PosixFileSystem(), out + "/manifest.json");
  ASSERT_TRUE(manifest.ok());

  // A flipped byte in a rank file: DataLoss, exit 1, naming the item.
  std::string bad = *want;
  bad[10] ^= 0x5a;
  ASSERT_TRUE(WriteStringToFileAtomically(PosixFileSystem(), vdir + "/rank-00000.bin", bad).ok());
  r = Ctl({"restore", "--from-dir", vdir, "--out", out + "2"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_THAT(r.stderr_text, HasSubstr("DATA_LOSS"));
  EXPECT_THAT(r.stderr_text, HasSubstr("item "));

  // Delete the version; then it is gone from or marked deleted in the list.
  r = Ctl({"delete", "gpt", "7", "--force"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  Json after = CtlJson({"versions", "gpt"});
  for (const Json& ver : after["versions"]) EXPECT_NE(ver["state"], "persisted");
}

TEST_F(CkptctlTest, ServerErrorsExitOneWithTheServersMessage) {
  RunResult r = Ctl({"versions", "nosuchjob"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_THAT(r.stderr_text, HasSubstr("ckptctl: NOT_FOUND"));
  EXPECT_THAT(r.stderr_text, HasSubstr("nosuchjob"));
  r = Ctl({"inspect", "nosuchjob", "3"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_THAT(r.stderr_text, HasSubstr("NOT_FOUND"));
  r = Ctl({"drain", "nosuchnode"});
  EXPECT_EQ(r.status.exit_code(), 1);
  r = Ctl({"restore", "--from-dir", dir_->path() + "/none/1", "--out", dir_->path() + "/o"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_THAT(r.stderr_text, HasSubstr("NOT_FOUND"));
}

// A shard several ReadShard chunks long (4 MiB each, plus the message's own
// fields: more than gRPC's default 4 MiB receive limit) comes back whole.
// Found by the chaos soak (tests/chaos): ckptctl's agent channels kept the
// default limit, so every online restore of a shard over 4 MiB failed.
TEST_F(CkptctlTest, OnlineRestoreOfAShardOfSeveralChunks) {
  std::string content(9 * (1 << 20) + 1, '\0');
  std::mt19937 rng(7);
  for (char& c : content) c = static_cast<char>(rng());
  const std::string file = dir_->path() + "/big.bin";
  std::ofstream(file, std::ios::binary) << content;
  RunResult s = Ctl({"save", "big", "1", file, "--rank", "0", "--world-size", "1", "--agent-socket",
                     agent_->socket_path()});
  ASSERT_TRUE(s.status.success()) << s.stderr_text;
  const std::string out = dir_->path() + "/big-restored";
  RunResult r = Ctl({"restore", "big", "1", "--out", out});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  absl::StatusOr<DurableManifest> m = ReadDurableManifest(PosixFileSystem(), out);
  ASSERT_TRUE(m.ok()) << m.status();
  std::vector<std::byte> bytes(m->shards[0].size_bytes);
  ASSERT_TRUE(ReadRankFile(PosixFileSystem(), out, m->shards[0], bytes).ok());
  ASSERT_GE(bytes.size(), content.size());
  EXPECT_EQ(std::memcmp(bytes.data(), content.data(), content.size()), 0);
}

TEST_F(CkptctlTest, SaveThenOnlineRestoreAndVerify) {
  // Two ranks saved from files with `ckptctl save`.
  std::vector<std::string> contents;
  for (uint32_t r = 0; r < 2; ++r) {
    std::vector<float> t = Tensor(20000 + r, r + 40);
    contents.emplace_back(reinterpret_cast<const char*>(t.data()), t.size() * sizeof(float));
    const std::string file = absl::StrCat(dir_->path(), "/weights-", r, ".bin");
    std::ofstream(file, std::ios::binary) << contents.back();
    std::vector<std::string> args = {"save", "files", "3", file, "--rank", std::to_string(r),
                                     "--agent-socket", agent_->socket_path()};
    if (r == 0) args.insert(args.end(), {"--world-size", "2"});
    RunResult s = Ctl(args);
    ASSERT_TRUE(s.status.success()) << s.stderr_text;
    EXPECT_THAT(s.stdout_text, HasSubstr("saved"));
  }
  // Online restore: every rank from the agent holding it, crc-checked; the
  // output is itself a loadable version directory.
  const std::string out = dir_->path() + "/restored";
  Json j = CtlJson({"restore", "files", "3", "--out", out});
  EXPECT_EQ(j["committed"], true);
  ASSERT_EQ(j["files"].size(), 2u);
  EXPECT_EQ(j["files"][0]["served_from"], "node-1");
  absl::StatusOr<DurableManifest> m = ReadDurableManifest(PosixFileSystem(), out);
  ASSERT_TRUE(m.ok()) << m.status();
  for (uint32_t r = 0; r < 2; ++r) {
    std::vector<std::byte> bytes(m->shards[r].size_bytes);
    ASSERT_TRUE(ReadRankFile(PosixFileSystem(), out, m->shards[r], bytes).ok());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(bytes.data()), contents[r].size()), contents[r]);
  }
  RunResult again = Ctl({"restore", "--from-dir", out, "--out", dir_->path() + "/again"});
  EXPECT_TRUE(again.status.success()) << again.stderr_text;
  // One rank only.
  RunResult one = Ctl({"restore", "files", "3", "--rank", "1", "--out", dir_->path() + "/one"});
  EXPECT_TRUE(one.status.success()) << one.stderr_text;
  EXPECT_TRUE(std::filesystem::exists(dir_->path() + "/one/rank-00001.bin"));
  EXPECT_FALSE(std::filesystem::exists(dir_->path() + "/one/rank-00000.bin"));
  // Verify: the holder re-reads both shards.
  Json v = CtlJson({"verify", "files", "3"});
  EXPECT_EQ(v["problems"], 0);
  EXPECT_EQ(v["findings"].size(), 2u);
  // What the node holds, from its agent: both primaries of files/3.
  Json h = CtlJson({"holdings", "node-1", "--job", "files"});
  EXPECT_EQ(h["node_id"], "node-1");
  ASSERT_EQ(h["holdings"].size(), 2u);
  EXPECT_EQ(h["holdings"][0]["job"], "files");
  EXPECT_EQ(h["holdings"][0]["step"], 3);
  EXPECT_EQ(h["holdings"][0]["role"], "primary");
  EXPECT_EQ(h["holdings"][0]["state"], "valid");
  RunResult table = Ctl({"holdings", "node-1"});
  EXPECT_TRUE(table.status.success()) << table.stderr_text;
  EXPECT_THAT(table.stdout_text, HasSubstr("files/3 rank 1  primary"));
  EXPECT_EQ(Ctl({"holdings", "no-such-node"}).status.exit_code(), 1);
  // Bad input: unknown step, a rank out of range, both forms of restore.
  EXPECT_EQ(Ctl({"restore", "files", "99", "--out", out}).status.exit_code(), 1);
  EXPECT_EQ(Ctl({"restore", "files", "3", "--rank", "5", "--out", out}).status.exit_code(), 1);
  EXPECT_EQ(Ctl({"restore", "files", "3", "--from-dir", out, "--out", out}).status.exit_code(), 2);
  EXPECT_EQ(Ctl({"save", "nojob", "1", dir_->path() + "/weights-0.bin", "--rank", "0", "--agent-socket",
                 agent_->socket_path()})
                .status.exit_code(),
            1);
}

// Writes bytes [start, start + n) of an endless seeded pattern (splitmix64,
// one 8-byte word per index) to `p`, so that any piece can be regenerated.
void FillPattern(std::byte* p, size_t n, uint64_t seed, uint64_t start = 0) {
  for (uint64_t k = start; k < start + n;) {
    uint64_t z = seed + (k / 8 + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const uint64_t in = k % 8;
    const uint64_t take = std::min<uint64_t>(8 - in, start + n - k);
    std::memcpy(p + (k - start), reinterpret_cast<const char*>(&z) + in, take);
    k += take;
  }
}

// Saves one shard of exactly `size` bytes for `rank` of (job, step): an item
// "head" of `head` bytes and an item "tail" filling the rest (items start at
// 64-byte offsets), each a seeded pattern. Returns the shard's bytes.
std::vector<std::byte> SaveExactShard(const ClientOptions& o, uint64_t step, uint64_t size, uint64_t head) {
  const uint64_t tail_off = (head + 63) / 64 * 64;
  std::vector<std::byte> shard(size);
  FillPattern(shard.data(), head, 1000 + o.rank);
  FillPattern(shard.data() + tail_off, size - tail_off, 2000 + o.rank);
  absl::StatusOr<Client> c = Client::Connect(o);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return {};
  SaveBuilder b = c->BeginSave(step);
  EXPECT_TRUE(b.Add("head", std::span(shard).first(head), DType::kBytes, {head}).ok());
  EXPECT_TRUE(b.Add("tail", std::span(shard).subspan(tail_off), DType::kBytes, {size - tail_off}).ok());
  absl::StatusOr<SaveHandle> h = b.Commit();
  EXPECT_TRUE(h.ok()) << h.status();
  if (!h.ok()) return {};
  EXPECT_EQ(h->size_bytes(), size);  // the padding between head and tail is zero
  return shard;
}

std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// gRPC's default message limit is 4 MiB: shards just under, at and over it
// (and items crossing ReadShard's chunks) restore byte for byte.
TEST_F(CkptctlTest, OnlineRestoreOfShardsAroundTheGrpcMessageLimit) {
  const std::vector<uint64_t> sizes = {(4u << 20) - 1, 4u << 20, (4u << 20) + 1};
  std::vector<std::vector<std::byte>> shards;
  for (uint32_t r = 0; r < sizes.size(); ++r) {
    shards.push_back(SaveExactShard(Options("big", r, 3), 5, sizes[r], (1u << 20) + 3));
    ASSERT_EQ(shards.back().size(), sizes[r]);
  }
  const std::string out = dir_->path() + "/restored";
  RunResult r = Ctl({"--json", "restore", "big", "5", "--out", out});
  ASSERT_TRUE(r.status.success()) << r.status << "\n" << r.stderr_text;
  Json j = Json::parse(r.stdout_text);
  EXPECT_EQ(j["committed"], true);
  ASSERT_EQ(j["files"].size(), 3u);
  for (uint32_t rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(j["files"][rank]["size_bytes"], sizes[rank]);
    EXPECT_EQ(j["files"][rank]["served_from"], "node-1");
    const std::string bytes = ReadWholeFile(absl::StrFormat("%s/rank-%05d.bin", out, rank));
    ASSERT_EQ(bytes.size(), sizes[rank]);
    EXPECT_EQ(std::memcmp(bytes.data(), shards[rank].data(), bytes.size()), 0) << "rank " << rank;
  }
  // The result is a complete version directory: every checksum verifies.
  RunResult again = Ctl({"restore", "--from-dir", out, "--out", dir_->path() + "/again"});
  EXPECT_TRUE(again.status.success()) << again.stderr_text;
}

// A shard of 1 GiB, far beyond any gRPC message: streamed chunk by chunk to
// the file, so ckptctl holds a small bounded amount of memory (its peak RSS
// is checked against the shard's size).
class CkptctlBigShardTest : public testing::NodeClusterTest {
 protected:
  CkptctlBigShardTest() : NodeClusterTest("1040MiB") {}
};

TEST_F(CkptctlBigShardTest, OnlineRestoreOfAOneGiBShardStreams) {
  constexpr uint64_t kSize = uint64_t{1} << 30;
  constexpr uint64_t kHead = (300u << 20) + 5;
  constexpr uint64_t kTailOff = (kHead + 63) / 64 * 64;
  {
    ClientOptions o = testing::ClientOptionsFor(*meta_, *agent_, "huge", 0, 1);
    std::vector<std::byte> shard = SaveExactShard(o, 1, kSize, kHead);
    ASSERT_EQ(shard.size(), kSize);
  }
  // The shard's buffer is freed: ckptctl, forked from this process, starts
  // small, so its peak RSS is its own.
  const std::string out = dir_->path() + "/restored";
  testing::SubprocessOptions so;
  so.argv = {testing::BinaryPath("ckptctl"), "--meta", meta_->address(), "--timeout", "180", "--json", "restore", "huge", "1",
             "--out", out};
  absl::StatusOr<RunResult> r = testing::RunToCompletion(so, absl::Minutes(4));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->status.success()) << r->status << "\n" << r->stderr_text;
  Json j = Json::parse(r->stdout_text);
  ASSERT_EQ(j["files"].size(), 1u);
  EXPECT_EQ(j["files"][0]["size_bytes"], kSize);
  // Streams: a few chunks in flight, never the shard (about 25 MB here). Under
  // ASan freed chunks sit in its quarantine (256 MiB by default) and every
  // byte has shadow (TSan: shadow and metadata): the bound there is only "well
  // under the 1 GiB shard".
#if defined(__SANITIZE_ADDRESS__) || defined(CKPT_UNDER_TSAN)  // TSan builds undefine __SANITIZE_THREAD__
  constexpr uint64_t kMaxRss = uint64_t{640} << 20;
#else
  constexpr uint64_t kMaxRss = uint64_t{64} << 20;
#endif
  EXPECT_LT(r->max_rss_bytes, kMaxRss) << "ckptctl held " << r->max_rss_bytes << " bytes";
  // Byte for byte, read back in pieces against the regenerated pattern.
  std::ifstream in(out + "/rank-00000.bin", std::ios::binary);
  constexpr uint64_t kPiece = 16 << 20;
  std::vector<char> got(kPiece);
  std::vector<std::byte> want(kPiece);
  uint64_t off = 0;
  while (off < kSize && in.read(got.data(), static_cast<std::streamsize>(kPiece))) {
    for (uint64_t i = 0; i < kPiece;) {  // head, zero padding, tail
      const uint64_t at = off + i;
      uint64_t n;
      if (at < kHead) {
        n = std::min(kPiece - i, kHead - at);
        FillPattern(want.data() + i, n, 1000, at);
      } else if (at < kTailOff) {
        n = std::min(kPiece - i, kTailOff - at);
        std::memset(want.data() + i, 0, n);
      } else {
        n = kPiece - i;
        FillPattern(want.data() + i, n, 2000, at - kTailOff);
      }
      i += n;
    }
    ASSERT_EQ(std::memcmp(got.data(), want.data(), kPiece), 0) << "in the 16 MiB at " << off;
    off += kPiece;
  }
  EXPECT_EQ(off, kSize);
  EXPECT_EQ(in.peek(), std::char_traits<char>::eof());
}

TEST_F(CkptctlTest, PlacementShowsThePlanAndSurvival) {
  RunResult r = Ctl({"create-job", "plc", "--world-size", "2", "--no-protection"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  Json p = CtlJson({"placement", "plc", "--failures", "0", "1"});
  EXPECT_EQ(p["job"], "plc");
  EXPECT_EQ(p["protection"], "none");
  ASSERT_EQ(p["survival"].size(), 2u);
  EXPECT_EQ(p["survival"][1]["failures"], 1);
  EXPECT_EQ(p["survival"][0]["probability"], 1.0);
  // One node, no redundancy: losing it loses the data.
  EXPECT_EQ(p["survival"][1]["probability"], 0.0);
  // More failures than nodes: the server's clear error, exit 1.
  r = Ctl({"placement", "plc", "--failures", "2"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_THAT(r.stderr_text, HasSubstr("number of nodes"));
  r = Ctl({"placement", "plc", "--failures", "1"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("P(NO DATA LOST)"));
  r = Ctl({"placement", "nosuchjob"});
  EXPECT_EQ(r.status.exit_code(), 1);
}

// A drain sticks while the node's agent keeps running (it heartbeats as LEFT
// instead of registering again as ALIVE) until `undrain`; `remove-node`
// forgets a LEFT node whose agent was stopped.
TEST_F(CkptctlTest, DrainSticksUntilUndrainAndRemoveNodeForgetsIt) {
  Json node = CtlJson({"drain", "node-1"});
  EXPECT_EQ(node["id"], "node-1");
  EXPECT_EQ(node["state"], "draining");
  EXPECT_EQ(node["drained"], true);
  auto state = [&]() -> std::string {
    Json nodes = CtlJson({"nodes"})["nodes"];
    return nodes.empty() ? "none" : nodes[0]["state"].get<std::string>();
  };
  // Holding nothing, it is LEFT at meta's next tick.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (state() != "left" && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(100));
  ASSERT_EQ(state(), "left");
  // Several heartbeat intervals later (meta's default is 1 s), still LEFT,
  // with the agent running.
  const absl::Time watch_until = absl::Now() + absl::Seconds(4);
  while (absl::Now() < watch_until) {
    ASSERT_EQ(state(), "left") << agent_->proc()->LogTail(4096);
    absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_TRUE(agent_->proc()->IsRunning());
  EXPECT_THAT(agent_->proc()->LogTail(65536), HasSubstr("meta: this node is LEFT"));
  RunResult r = Ctl({"remove-node", "node-1"});
  EXPECT_NE(r.status.exit_code(), 0);
  EXPECT_THAT(r.stderr_text, HasSubstr("its agent is still running"));
  node = CtlJson({"undrain", "node-1"});
  EXPECT_EQ(node["state"], "alive");
  EXPECT_EQ(node["drained"], false);
  r = Ctl({"undrain", "node-1"});
  EXPECT_NE(r.status.exit_code(), 0);
  EXPECT_THAT(r.stderr_text, HasSubstr("not drained"));
  r = Ctl({"remove-node", "node-1"});
  EXPECT_NE(r.status.exit_code(), 0);
  EXPECT_THAT(r.stderr_text, HasSubstr("only DEAD or LEFT nodes can be removed"));

  // Retire it: drain, stop the agent, remove.
  ASSERT_EQ(CtlJson({"drain", "node-1"})["state"], "draining");
  ASSERT_TRUE(agent_->proc()->Kill().ok());
  const absl::Time left_by = absl::Now() + absl::Seconds(30);
  while (state() != "left" && absl::Now() < left_by) absl::SleepFor(absl::Milliseconds(100));
  ASSERT_EQ(state(), "left");
  // Removable once its lease (5 s here) has run out.
  const absl::Time removed_by = absl::Now() + absl::Seconds(30);
  do {
    r = Ctl({"remove-node", "node-1"});
    if (!r.status.success()) absl::SleepFor(absl::Milliseconds(200));
  } while (!r.status.success() && absl::Now() < removed_by);
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("node node-1 removed"));
  EXPECT_EQ(state(), "none");
  r = Ctl({"undrain", "node-9"});
  EXPECT_NE(r.status.exit_code(), 0);
  EXPECT_THAT(r.stderr_text, HasSubstr("not registered"));
}

TEST_F(CkptctlTest, UsageErrorsExitTwo) {
  for (std::vector<std::string> args : std::vector<std::vector<std::string>>{
           {"frobnicate"},
           {},
           {"create-job", "j", "--world-size", "2", "--ec", "4x2"},
           {"create-job", "j", "--world-size", "2", "--ec", "4+"},
           {"create-job", "j", "--world-size", "2", "--replicate", "2", "--ec", "4+2"},
           {"create-job", "j", "--world-size", "2", "--replicate", "2", "--no-protection"},
           {"create-job", "j", "--world-size", "2", "--replicate", "2", "--placement", "star"},
           {"create-job", "j"},
           {"inspect", "j", "notanumber"},
           {"inspect", "j", "9007199254740992"},  // steps stop at 2^53-1
           {"flush", "j", "18446744073709551615"},
           {"--timeout", "-1", "jobs"},
       }) {
    RunResult r = Ctl(args);
    EXPECT_EQ(r.status.exit_code(), 2) << absl::StrJoin(args, " ") << "\n" << r.stderr_text;
  }
  // Nothing reached the server.
  EXPECT_TRUE(CtlJson({"jobs"})["jobs"].empty());
}

// Issue 40, item 5: delete-job, create-job of the same spec is OK
// ("unchanged") and of another names the differing field, global flags after
// the subcommand, --json errors as one JSON object, meta_instance_id a string,
// --meta HOST meaning port 7400, a negative step refused as negative.
TEST_F(CkptctlTest, DeleteJobIdempotentCreateGlobalFlagsAnywhereJsonErrors) {
  RunResult r = Ctl({"create-job", "ops", "--world-size", "2", "--no-protection", "--keep-in-memory", "2"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("created job ops"));
  r = Ctl({"create-job", "ops", "--world-size", "2", "--no-protection", "--keep-in-memory", "2"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("job ops unchanged"));
  // --json after the subcommand.
  r = Ctl({"create-job", "ops", "--world-size", "2", "--no-protection", "--keep-in-memory", "2", "--json"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_EQ(Json::parse(r.stdout_text)["created"], false);
  r = Ctl({"create-job", "ops", "--world-size", "3", "--no-protection", "--keep-in-memory", "2"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_THAT(r.stderr_text, HasSubstr("FAILED_PRECONDITION"));
  EXPECT_THAT(r.stderr_text, HasSubstr("world_size (stored 2, asked 3)"));

  // Errors under --json: one object on stderr, nothing on stdout.
  r = Ctl({"versions", "nosuchjob", "--json"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_TRUE(r.stdout_text.empty()) << r.stdout_text;
  Json err = Json::parse(r.stderr_text, nullptr, false);
  ASSERT_FALSE(err.is_discarded()) << r.stderr_text;
  EXPECT_EQ(err["error"]["code"], "NOT_FOUND");
  EXPECT_THAT(err["error"]["message"].get<std::string>(), HasSubstr("nosuchjob"));
  r = Ctl({"--json", "inspect", "ops", "-1"});
  EXPECT_EQ(r.status.exit_code(), 2);
  err = Json::parse(r.stderr_text, nullptr, false);
  ASSERT_FALSE(err.is_discarded()) << r.stderr_text;
  EXPECT_EQ(err["error"]["code"], "USAGE");
  // A negative step is refused as negative, not as 2^64-1.
  r = Ctl({"flush", "ops", "-1"});
  EXPECT_EQ(r.status.exit_code(), 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("step must be >= 0 (got -1)"));
  EXPECT_THAT(r.stderr_text, ::testing::Not(HasSubstr("18446744073709551615")));

  // 64-bit ids as strings (jq reads numbers as doubles).
  Json status = CtlJson({"status"});
  ASSERT_TRUE(status["meta_instance_id"].is_string()) << status.dump();
  EXPECT_NE(status["meta_instance_id"], "0");

  // --meta HOST: the default port 7400 (nothing listens there in this test:
  // the error names the address dialed).
  testing::SubprocessOptions o;
  o.argv = {testing::BinaryPath("ckptctl"), "--timeout", "2", "jobs", "--meta", "127.0.0.1"};
  absl::StatusOr<RunResult> dialed = testing::RunToCompletion(o, absl::Seconds(60));
  ASSERT_TRUE(dialed.ok()) << dialed.status();
  EXPECT_THAT(dialed->stderr_text, HasSubstr("ckpt-meta at 127.0.0.1:7400"));

  // delete-job (global flag --meta after it, too).
  r = Ctl({"delete-job", "ops"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("deleting job ops"));
  r = Ctl({"delete-job", "nosuchjob"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_THAT(r.stderr_text, HasSubstr("NOT_FOUND"));
}

// update-job: retention and flush policy after creation; flags left out keep
// their value; the same values again are "unchanged" (issue 40).
TEST_F(CkptctlTest, UpdateJobChangesRetentionAndFlush) {
  RunResult r = Ctl({"create-job", "upd", "--world-size", "1", "--no-protection", "--keep-durable", "5"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  r = Ctl({"update-job", "upd", "--keep-in-memory", "1", "--flush-every", "4"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text,
              HasSubstr("updated job upd: keeps 1 version(s) in memory and 5 durable; flushes every 4 versions"));
  r = Ctl({"update-job", "upd", "--keep-in-memory", "1"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("job upd unchanged"));
  Json j = CtlJson({"update-job", "upd", "--flush-every-seconds", "600"});
  EXPECT_EQ(j["changed"], true) << j.dump();
  EXPECT_EQ(j["keep_in_memory"], 1) << j.dump();
  EXPECT_EQ(j["keep_durable"], 5) << j.dump();
  EXPECT_EQ(j["flush_every_n_versions"], 4) << j.dump();
  r = Ctl({"update-job", "upd"});
  EXPECT_EQ(r.status.exit_code(), 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("give at least one of --keep-in-memory"));
  r = Ctl({"update-job", "nosuchjob", "--keep-durable", "3"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_THAT(r.stderr_text, HasSubstr("NOT_FOUND"));
  // Protection (meta_update_job_test has a change that takes): one agent cannot place 2 copies,
  // and the job keeps its policy; the same policy is unchanged; a malformed --ec is a usage error.
  r = Ctl({"update-job", "upd", "--replicate", "2"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_THAT(r.stderr_text, HasSubstr("FAILED_PRECONDITION"));
  EXPECT_THAT(r.stderr_text, HasSubstr("cannot be placed on the nodes alive now"));
  r = Ctl({"update-job", "upd", "--no-protection"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("job upd unchanged"));
  EXPECT_THAT(r.stdout_text, HasSubstr("protects new versions with none"));
  r = Ctl({"update-job", "upd", "--ec", "2+"});
  EXPECT_EQ(r.status.exit_code(), 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("--ec: expected K+M"));
  r = Ctl({"update-job", "upd", "--ec", "2+1", "--replicate", "2"});
  EXPECT_EQ(r.status.exit_code(), 2);
}

}  // namespace
}  // namespace ckpt
