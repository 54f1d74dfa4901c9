// The real ckptctl binary against real ckpt-meta and ckpt-agent processes
// (issue 40, items 3, 4 and 8): a restore interrupted by SIGINT or SIGTERM
// removes its temporary files and says so (exit 130 / 143); a later restore
// sweeps stale ones of ours (and nothing else); progress lines for save and
// restore (--progress, as off a terminal); `flush --wait`, `wait JOB STEP
// LEVEL` (reached, timeout, unknown job or step, aborted); `restore
// --from-dir` output is a committed version directory.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/durable_format.h"
#include "common/file_system.h"
#include "integration/agent_process.h"
#include "integration/meta_process.h"
#include "integration/node_cluster.h"
#include "support/process.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::RunResult;
using Json = nlohmann::json;

constexpr char kPaused[] = "ckptctl: test hook: paused after the first chunk";

class CkptctlProgressTest : public testing::NodeClusterTest {
 protected:
  CkptctlProgressTest() : NodeClusterTest("64MiB") {}

  // A file of `bytes` random bytes, saved as rank `rank` of job/step.
  std::string SaveRandom(const std::string& job, uint64_t step, uint64_t bytes, uint32_t rank = 0,
                         uint32_t world = 1) {
    std::string content(bytes, '\0');
    std::mt19937 rng(static_cast<uint32_t>(step * 31 + rank));
    for (char& c : content) c = static_cast<char>(rng());
    const std::string file = absl::StrCat(dir_->path(), "/", job, "-", step, "-", rank, ".bin");
    std::ofstream(file, std::ios::binary) << content;
    RunResult s = Ctl({"save", job, std::to_string(step), file, "--rank", std::to_string(rank), "--world-size",
                       std::to_string(world), "--agent-socket", agent_->socket_path()});
    EXPECT_TRUE(s.status.success()) << s.stderr_text;
    return content;
  }

  // Starts ckptctl with the test hook that pauses after the first chunk it
  // writes, waits until it says so, sends `sig` and returns how it ended and
  // its stderr.
  std::pair<testing::ExitStatus, std::string> InterruptMidway(std::vector<std::string> args, int sig,
                                                             const std::string& out_dir) {
    testing::SubprocessOptions o;
    o.argv = Argv(std::move(args));
    o.env = {{"CKPTCTL_TEST_PAUSE_AFTER_FIRST_CHUNK", "1"}};
    const std::string err = absl::StrCat(dir_->path(), "/ctl-", sig, ".err");
    o.stderr_path = err;
    o.stdout_path = err + ".out";
    absl::StatusOr<std::unique_ptr<testing::Subprocess>> p = testing::Subprocess::Start(o);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return {testing::ExitStatus(-1), ""};
    std::string text;
    for (int i = 0; i < 600 && text.find(kPaused) == std::string::npos; ++i) {  // bounded: 60 s
      absl::StatusOr<std::string> t = ReadFileToString(PosixFileSystem(), err);
      if (t.ok()) text = *t;
      if (text.find(kPaused) == std::string::npos) absl::SleepFor(absl::Milliseconds(100));
    }
    EXPECT_THAT(text, HasSubstr(kPaused));
    // Mid-way: this process's temporary rank file is there.
    std::vector<std::string> temps = Hidden(out_dir);
    EXPECT_FALSE(temps.empty()) << "no temporary file while paused";
    for (const std::string& t : temps) EXPECT_THAT(t, HasSubstr(absl::StrCat(".tmp-", (*p)->pid())));
    EXPECT_TRUE((*p)->Kill(sig).ok());
    absl::StatusOr<testing::ExitStatus> st = (*p)->WaitFor(absl::Seconds(30));
    EXPECT_TRUE(st.ok()) << st.status();
    absl::StatusOr<std::string> t = ReadFileToString(PosixFileSystem(), err);
    return {st.ok() ? *st : testing::ExitStatus(-1), t.ok() ? *t : ""};
  }

  // Names starting with '.' in `dir`.
  static std::vector<std::string> Hidden(const std::string& dir) {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      if (!name.empty() && name[0] == '.') out.push_back(name);
    }
    return out;
  }

  static std::set<std::string> Names(const std::string& dir) {
    std::set<std::string> out;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) out.insert(e.path().filename().string());
    return out;
  }

  // Reads the version directory `dir` as ckpt.read_durable does (the commit
  // marker, the manifest, every rank file with every crc).
  static void ExpectLoadable(const std::string& dir, const std::vector<std::string>& contents) {
    absl::StatusOr<DurableManifest> m = ReadDurableManifest(PosixFileSystem(), dir);
    ASSERT_TRUE(m.ok()) << dir << ": " << m.status();
    ASSERT_EQ(m->shards.size(), contents.size());
    for (size_t r = 0; r < contents.size(); ++r) {
      std::vector<std::byte> bytes(m->shards[r].size_bytes);
      ASSERT_TRUE(ReadRankFile(PosixFileSystem(), dir, m->shards[r], bytes).ok());
      ASSERT_GE(bytes.size(), contents[r].size());
      EXPECT_EQ(std::memcmp(bytes.data(), contents[r].data(), contents[r].size()), 0) << "rank " << r;
    }
  }
};

TEST_F(CkptctlProgressTest, InterruptedRestoreRemovesItsTempFilesAndALaterRestoreSweepsStaleOnes) {
  const std::string content = SaveRandom("big", 1, (5 << 20) + 3);  // 6 chunks of 1 MiB
  // SIGINT mid-way through an online restore: exit 130, nothing of ours left.
  const std::string out = dir_->path() + "/out";
  auto [st, err] = InterruptMidway({"restore", "big", "1", "--out", out}, SIGINT, out);
  EXPECT_EQ(st.exit_code(), 130) << st << "\n" << err;
  EXPECT_THAT(err, HasSubstr("ckptctl: CANCELLED: interrupted by SIGINT: removed 1 temporary file(s) of this restore"));
  EXPECT_THAT(err, HasSubstr(out + "/.rank-00000.bin.tmp-"));
  EXPECT_THAT(err, HasSubstr("is not a committed version (no COMMITTED marker"));
  EXPECT_TRUE(Names(out).empty()) << absl::StrJoin(Names(out), " ");

  // Stale files of ours, of processes that are gone (pid 99999999 is above
  // any pid_max), are swept; anything else stays: a live process's (this
  // test's), names that only look alike, other files.
  const std::string live = absl::StrCat(".rank-00000.bin.tmp-", ::getpid(), "-7");
  const std::vector<std::string> stale = {".rank-00000.bin.tmp-99999999-0", ".rank-00000.bin.ref-3.tmp-99999999",
                                          "..rank-00000.bin.ref-3.tmp-99999999.tmp-99999999-2"};
  const std::vector<std::string> kept = {live, ".rank-00000.bin.tmp-abc", "rank-00000.bin.tmp-99999999-0",
                                         ".rank-1.bin.tmp-99999999-0", "notes.txt", ".manifest.json.swp"};
  for (const std::string& n : stale) std::ofstream(out + "/" + n) << "x";
  for (const std::string& n : kept) std::ofstream(out + "/" + n) << "x";
  RunResult r = Ctl({"restore", "big", "1", "--out", out});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text,
              HasSubstr(absl::StrCat("removed 3 stale temporary file(s) of an earlier, interrupted restore in ", out)));
  std::set<std::string> names = Names(out);
  for (const std::string& n : stale) EXPECT_EQ(names.count(n), 0u) << n;
  for (const std::string& n : kept) EXPECT_EQ(names.count(n), 1u) << n;
  ExpectLoadable(out, {content});
  // Nothing stale the next time; --json counts it.
  r = Ctl({"--json", "restore", "big", "1", "--out", out});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_EQ(Json::parse(r.stdout_text)["stale_temp_files_removed"], 0);

  // SIGTERM mid-way through `restore --from-dir`, with --json: exit 143 and
  // the error as one JSON object naming what it removed.
  const std::string out2 = dir_->path() + "/out2";
  auto [st2, err2] = InterruptMidway({"--json", "restore", "--from-dir", out, "--out", out2}, SIGTERM, out2);
  EXPECT_EQ(st2.exit_code(), 143) << st2 << "\n" << err2;
  Json e = Json::parse(err2.substr(err2.find('{')), nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(e.is_discarded()) << err2;
  EXPECT_EQ(e["error"]["code"], "CANCELLED");
  EXPECT_THAT(e["error"]["message"].get<std::string>(), HasSubstr("interrupted by SIGTERM: removed 1 temporary"));
  ASSERT_EQ(e["error"]["removed"].size(), 1u);
  EXPECT_TRUE(Names(out2).empty()) << absl::StrJoin(Names(out2), " ");
}

TEST_F(CkptctlProgressTest, ProgressLinesForSaveAndRestoreOnlyWhenAsked) {
  const std::string file = dir_->path() + "/p.bin";
  std::ofstream(file, std::ios::binary) << std::string((3 << 20) + 11, 'p');
  // --progress: one line per update off a terminal (the first at once, then
  // at most one a second), and the total at the end.
  RunResult s = Ctl({"--progress", "save", "p", "1", file, "--rank", "0", "--world-size", "1", "--agent-socket",
                     agent_->socket_path()});
  ASSERT_TRUE(s.status.success()) << s.stderr_text;
  EXPECT_THAT(s.stderr_text, HasSubstr("save p/1 rank 0: "));
  EXPECT_THAT(s.stderr_text, HasSubstr(" / 3 MiB ("));
  EXPECT_THAT(s.stderr_text, HasSubstr("/s, ETA "));
  EXPECT_THAT(s.stderr_text, HasSubstr("save p/1 rank 0: read 3 MiB; copying into the agent's memory tier"));
  EXPECT_THAT(s.stderr_text, HasSubstr("save p/1 rank 0: 3 MiB in "));
  EXPECT_THAT(s.stdout_text, HasSubstr("saved "));
  const std::string out = dir_->path() + "/p-out";
  RunResult r = Ctl({"restore", "p", "1", "--out", out, "--progress"});  // a global flag after the command too
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("restore p/1: 1 MiB / 3 MiB (33%), "));
  EXPECT_THAT(r.stderr_text, HasSubstr("restore p/1: 3 MiB in "));
  EXPECT_THAT(r.stdout_text, HasSubstr("rank 0: "));
  // Off a terminal, without --progress (and with --quiet): nothing on stderr.
  r = Ctl({"restore", "p", "1", "--out", out});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_EQ(r.stderr_text, "");
  s = Ctl({"-q", "save", "p", "2", file, "--rank", "0", "--agent-socket", agent_->socket_path()});
  ASSERT_TRUE(s.status.success()) << s.stderr_text;
  EXPECT_EQ(s.stderr_text, "");
}

TEST_F(CkptctlProgressTest, FlushWaitAndWaitForLevels) {
  const std::string content = SaveRandom("w", 1, 100000);
  RunResult r = Ctl({"wait", "w", "1", "staged"});
  EXPECT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("w/1 reached staged after "));
  // flush --wait returns once the version is PERSISTED.
  r = Ctl({"flush", "w", "1", "--wait", "--timeout", "60s"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("flush requested"));
  EXPECT_THAT(r.stdout_text, HasSubstr("w/1 reached persisted after "));
  EXPECT_THAT(r.stdout_text, HasSubstr("(state persisted)"));
  r = Ctl({"--json", "flush", "w", "1", "--wait"});  // one JSON document: the version once persisted
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  Json j = Json::parse(r.stdout_text);
  EXPECT_EQ(j["state"], "persisted");
  EXPECT_EQ(j["level"], "persisted");
  EXPECT_TRUE(j["waited_ms"].is_number());
  r = Ctl({"--timeout", "5", "wait", "w", "1", "persisted", "--timeout", "0"});  // global and own --timeout
  EXPECT_TRUE(r.status.success()) << r.stderr_text;

  // The durable copy the agent wrote, restored with --from-dir: a committed
  // version directory, loadable as it is.
  const std::string vdir = absl::StrCat(agent_->options().durable_root, "/w/1");
  const std::string out = dir_->path() + "/from-dir";
  r = Ctl({"restore", "--from-dir", vdir, "--out", out});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("wrote manifest.json and COMMITTED: a loadable version directory"));
  EXPECT_TRUE(std::filesystem::exists(out + "/COMMITTED"));
  ExpectLoadable(out, {content});
  // And again from that copy (it is a version directory itself), as JSON.
  r = Ctl({"--json", "restore", "--from-dir", out, "--out", out + "2"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_EQ(Json::parse(r.stdout_text)["committed"], true);
  ExpectLoadable(out + "2", {content});

  // A version that never gets there in time: rank 1 of 2 never saved.
  SaveRandom("two", 1, 4096, /*rank=*/0, /*world=*/2);
  r = Ctl({"wait", "two", "1", "staged", "--timeout", "1s"});
  EXPECT_EQ(r.status.exit_code(), 1) << r.stdout_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("ckptctl: DEADLINE_EXCEEDED: two/1 did not reach staged within 1s: "));
  r = Ctl({"--json", "wait", "two", "1", "protected", "--timeout", "200ms", "--progress"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_EQ(r.stdout_text, "");
  const std::string last_line = r.stderr_text.substr(r.stderr_text.find("{\"error\""));
  Json e = Json::parse(last_line, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(e.is_discarded()) << r.stderr_text;
  EXPECT_EQ(e["error"]["code"], "DEADLINE_EXCEEDED");
  // Step 2 staged in full first: step 1 is aborted, and can never be staged.
  SaveRandom("two", 2, 4096, 0, 2);
  SaveRandom("two", 2, 4096, 1, 2);
  r = Ctl({"wait", "two", "1", "staged", "--timeout", "30s"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_THAT(r.stderr_text, HasSubstr("two/1 will never be staged: "));
  EXPECT_THAT(r.stderr_text, HasSubstr("superseded"));

  // Unknown job, unknown step: at once, NOT_FOUND.
  r = Ctl({"wait", "nosuchjob", "1", "staged"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_THAT(r.stderr_text, HasSubstr("ckptctl: NOT_FOUND: waiting for nosuchjob/1 to be staged: "));
  r = Ctl({"--json", "flush", "w", "99", "--wait"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_EQ(Json::parse(r.stderr_text)["error"]["code"], "NOT_FOUND");
  r = Ctl({"wait", "w", "99", "persisted", "--timeout", "5s"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_THAT(r.stderr_text, HasSubstr("NOT_FOUND"));

  // Usage errors: exit 2.
  EXPECT_EQ(Ctl({"wait", "w", "1", "durable"}).status.exit_code(), 2);
  EXPECT_EQ(Ctl({"wait", "w", "1", "staged", "--timeout", "soon"}).status.exit_code(), 2);
  r = Ctl({"flush", "w", "1", "--timeout", "5s"});
  EXPECT_EQ(r.status.exit_code(), 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("--timeout needs --wait"));
}

}  // namespace
}  // namespace ckpt
