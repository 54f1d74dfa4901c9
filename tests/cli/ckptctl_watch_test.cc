// The real ckptctl binary against real ckpt-meta and ckpt-agent processes
// (issue 40, item 4): `versions -w` and `status -w` (refreshes, one block each
// off a terminal, JSON Lines with --json, --count, a version saved meanwhile
// shows up, an unknown job fails at once, Ctrl-C ends it with exit 0, meta
// going away is shown and the watch goes on), progress lines of `verify` and
// the state changes of `flush --wait --progress`.
#include <signal.h>

#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/file_system.h"
#include "integration/node_cluster.h"
#include "support/process.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::RunResult;
using Json = nlohmann::json;

class CkptctlWatchTest : public testing::NodeClusterTest {
 protected:
  CkptctlWatchTest() : NodeClusterTest("64MiB") {}

  void Save(const std::string& job, uint64_t step, uint64_t bytes) {
    std::string content(bytes, '\0');
    std::mt19937 rng(static_cast<uint32_t>(step));
    for (char& c : content) c = static_cast<char>(rng());
    const std::string file = absl::StrCat(dir_->path(), "/", job, "-", step, ".bin");
    std::ofstream(file, std::ios::binary) << content;
    RunResult s = Ctl({"save", job, std::to_string(step), file, "--rank", "0", "--world-size", "1", "--agent-socket",
                       agent_->socket_path()});
    ASSERT_TRUE(s.status.success()) << s.stderr_text;
  }

  static std::string Read(const std::string& path) {
    absl::StatusOr<std::string> t = ReadFileToString(PosixFileSystem(), path);
    return t.ok() ? *t : "";
  }

  static int Count(const std::string& text, const std::string& what) {
    int n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  }
};

TEST_F(CkptctlWatchTest, VersionsWatchRefreshesAndSeesAVersionSavedMeanwhile) {
  ASSERT_NO_FATAL_FAILURE(Save("v", 1, 50000));
  {
    // --count: exactly that many blocks, numbered, off a terminal.
    RunResult r = Ctl({"versions", "v", "-w", "--interval", "100ms", "--count", "3"});
    ASSERT_TRUE(r.status.success()) << r.stderr_text;
    EXPECT_EQ(Count(r.stdout_text, "Every 100ms: ckptctl versions v    "), 3) << r.stdout_text;
    EXPECT_THAT(r.stdout_text, HasSubstr("(1/3)\n\nSTEP"));
    EXPECT_THAT(r.stdout_text, HasSubstr("(3/3)\n\nSTEP"));
    EXPECT_THAT(r.stdout_text, Not(HasSubstr("\033[")));  // no screen clearing off a terminal
    EXPECT_EQ(r.stderr_text, "");
  }
  // A watch with no count sees a version saved while it runs, however long
  // the save takes on a loaded machine; Ctrl-C ends it.
  testing::SubprocessOptions o;
  o.argv = Argv({"versions", "v", "-w", "--interval", "200ms"});
  const std::string out = dir_->path() + "/watch.out";
  o.stdout_path = out;
  o.stderr_path = out + ".err";
  absl::StatusOr<std::unique_ptr<testing::Subprocess>> p = testing::Subprocess::Start(o);
  ASSERT_TRUE(p.ok()) << p.status();
  for (int i = 0; i < 600 && Read(out).find("STEP") == std::string::npos; ++i) absl::SleepFor(absl::Milliseconds(50));
  ASSERT_THAT(Read(out), HasSubstr("STEP"));
  ASSERT_NO_FATAL_FAILURE(Save("v", 2, 50000));
  auto last_block = [&] {
    const std::vector<std::string> blocks = absl::StrSplit(Read(out), "Every 200ms: ", absl::SkipEmpty());
    return blocks.empty() ? std::string() : blocks.back();
  };
  for (int i = 0; i < 1200 && last_block().find("\n2 ") == std::string::npos; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE((*p)->Kill(SIGINT).ok());
  absl::StatusOr<testing::ExitStatus> st = (*p)->WaitFor(absl::Seconds(60));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->success()) << *st << Read(out + ".err");
  const std::string text = Read(out);
  const std::vector<std::string> blocks = absl::StrSplit(text, "Every 200ms: ", absl::SkipEmpty());
  ASSERT_GE(blocks.size(), 2u) << text;
  EXPECT_THAT(blocks.front(), HasSubstr("\n1 "));
  EXPECT_THAT(blocks.front(), Not(HasSubstr("\n2 ")));
  EXPECT_THAT(blocks.back(), HasSubstr("\n1 "));
  EXPECT_THAT(blocks.back(), HasSubstr("\n2 ")) << text;
  EXPECT_EQ(Read(out + ".err"), "");
}

TEST_F(CkptctlWatchTest, StatusWatchJsonLinesAndErrors) {
  ASSERT_NO_FATAL_FAILURE(Save("s", 1, 1000));
  RunResult r = Ctl({"status", "-w", "--json", "--count", "2", "--interval", "100ms"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  const std::vector<std::string> lines = absl::StrSplit(r.stdout_text, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u) << r.stdout_text;
  for (size_t i = 0; i < lines.size(); ++i) {
    Json j = Json::parse(lines[i], nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(j.is_discarded()) << lines[i];
    EXPECT_EQ(j["refresh"], i + 1);
    EXPECT_TRUE(j["time"].is_string());
    EXPECT_TRUE(j["unix_ms"].is_number());
    EXPECT_EQ(j["jobs"], 1);
    EXPECT_TRUE(j["meta_instance_id"].is_string());
  }
  // versions --json -w: the versions document per line.
  r = Ctl({"versions", "s", "--watch", "--count", "1", "--json"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  Json v = Json::parse(r.stdout_text, nullptr, false);
  ASSERT_FALSE(v.is_discarded()) << r.stdout_text;
  EXPECT_EQ(v["job"], "s");
  EXPECT_EQ(v["versions"].size(), 1u);

  // An unknown job: an error at once (no refresh drawn), exit 1.
  const absl::Time start = absl::Now();
  r = Ctl({"versions", "nosuchjob", "-w", "--interval", "10s"});
  EXPECT_EQ(r.status.exit_code(), 1);
  EXPECT_LT(absl::Now() - start, absl::Seconds(9));
  EXPECT_THAT(r.stderr_text, HasSubstr("ckptctl: NOT_FOUND: "));
  EXPECT_EQ(r.stdout_text, "");
  // Ctrl-C (SIGINT) ends a watch with no --count: exit 0, after whole refreshes.
  {
    testing::SubprocessOptions o;
    o.argv = Argv({"versions", "s", "-w", "--interval", "100ms"});
    const std::string out = dir_->path() + "/int.out";
    o.stdout_path = out;
    o.stderr_path = out + ".err";
    absl::StatusOr<std::unique_ptr<testing::Subprocess>> p = testing::Subprocess::Start(o);
    ASSERT_TRUE(p.ok()) << p.status();
    for (int i = 0; i < 300 && Count(Read(out), "Every 100ms: ") < 2; ++i) absl::SleepFor(absl::Milliseconds(50));
    ASSERT_GE(Count(Read(out), "Every 100ms: "), 2);
    ASSERT_TRUE((*p)->Kill(SIGINT).ok());
    absl::StatusOr<testing::ExitStatus> st = (*p)->WaitFor(absl::Seconds(30));
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_TRUE(st->success()) << *st;
    EXPECT_EQ(Read(out + ".err"), "");
  }
  // Usage.
  EXPECT_EQ(Ctl({"versions", "s", "-w", "--interval", "soon"}).status.exit_code(), 2);
  EXPECT_EQ(Ctl({"versions", "s", "--count", "2"}).status.exit_code(), 2);

  // Meta going away while watching: shown in each refresh, the watch goes on
  // and ends with --count, exit 0.
  const std::string address = meta_->address();
  ExpectCleanStop(*meta_->proc());
  testing::SubprocessOptions o;
  o.argv = {testing::BinaryPath("ckptctl"), "--meta", address, "--timeout", "2", "status", "-w", "--count", "2",
            "--interval", "100ms"};
  absl::StatusOr<RunResult> down = testing::RunToCompletion(o, absl::Seconds(60));
  ASSERT_TRUE(down.ok()) << down.status();
  EXPECT_TRUE(down->status.success()) << down->stderr_text;
  EXPECT_EQ(Count(down->stdout_text, "ckptctl: UNAVAILABLE: ckpt-meta at "), 2) << down->stdout_text;
  EXPECT_THAT(down->stdout_text, HasSubstr("(still watching; next try in 100ms)"));
}

TEST_F(CkptctlWatchTest, VerifyProgressAndFlushWaitStates) {
  ASSERT_NO_FATAL_FAILURE(Save("p", 1, 3 << 20));
  RunResult r = Ctl({"verify", "p", "1", "--progress"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("verifying p/1: 3 MiB on 1 holder(s)\n"));
  EXPECT_THAT(r.stderr_text,
              HasSubstr("verifying p/1: 3 MiB / 3 MiB (100%), "));
  EXPECT_THAT(r.stderr_text, HasSubstr(", 1/1 holder(s), 1 shard(s)/segment(s) checked, 0 problem(s)\n"));
  EXPECT_THAT(r.stderr_text, HasSubstr("verifying p/1: 3 MiB in "));
  EXPECT_THAT(r.stdout_text, HasSubstr("1 holder(s), 3145728 bytes checked, 0 problem(s)"));
  // Without --progress, off a terminal: nothing on stderr.
  r = Ctl({"verify", "p", "1"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_EQ(r.stderr_text, "");

  // flush --wait --progress: each state as it is reached, with the time.
  r = Ctl({"flush", "p", "1", "--wait", "--progress", "--timeout", "60s"});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("p/1: protected\n"));  // one agent: protection none, protected at once
  EXPECT_THAT(r.stderr_text, HasSubstr("p/1: protected -> persisted after "));
  EXPECT_THAT(r.stdout_text, HasSubstr("p/1 reached persisted after "));
}

}  // namespace
}  // namespace ckpt
