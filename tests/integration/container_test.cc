// A trainer in its own container, as Kubernetes runs one next to the agent's
// DaemonSet pod: its own mount, PID and IPC namespaces (unshare), a private
// /dev/shm (so the agent's memory tier is not visible), and of the agent only
// the socket directory, bind-mounted at another path. It saves, crashes
// (SIGKILL) right after a commit, the agent is killed with SIGKILL and
// restarted (re-adopting its memory tier), and a new trainer container
// resumes from the saved step and checks its final state against an
// uninterrupted run. Needs root (mount namespaces); skipped otherwise.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "integration/agent_process.h"
#include "integration/meta_process.h"
#include "support/process.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using testing::AgentProcess;
using testing::AgentProcessOptions;
using testing::MetaProcess;
using testing::TempDir;

// Quotes for sh -c.
std::string Q(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

bool CanUnshare() {
  if (::geteuid() != 0) return false;
  testing::SubprocessOptions o;
  o.argv = {"/usr/bin/unshare", "--mount", "--pid", "--ipc", "--fork", "/bin/true"};
  absl::StatusOr<testing::RunResult> r = testing::RunToCompletion(o, absl::Seconds(20));
  return r.ok() && r->status.success();
}

class ContainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CanUnshare()) GTEST_SKIP() << "needs root and unshare(1) for mount/PID/IPC namespaces";
    dir_ = std::make_unique<TempDir>(*TempDir::Create());
    meta_ = *MetaProcess::Start(*dir_->Sub("meta"), dir_->path());
    shm_dir_ = absl::StrCat("/dev/shm/ckpt-container-test-", ::getpid());
    AgentProcessOptions o;
    o.meta_address = meta_->address();
    o.dir = *dir_->Sub("agent");
    o.memory_dir = shm_dir_;
    o.memory = "64MiB";
    absl::StatusOr<std::unique_ptr<AgentProcess>> agent = AgentProcess::Start(o);
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = *std::move(agent);
    view_ = *dir_->Sub("view");
  }
  void TearDown() override {
    agent_.reset();
    if (!shm_dir_.empty()) std::filesystem::remove_all(shm_dir_);
  }

  // Runs ckpt-train-demo in a fresh container; the agent's socket directory
  // is visible at <view>/ckpt only.
  absl::StatusOr<testing::RunResult> RunTrainer(std::vector<std::string> extra) {
    const std::string sock_dir = view_ + "/ckpt";
    std::vector<std::string> demo = {testing::BinaryPath("ckpt-train-demo"), "--meta", meta_->address(),
                                     "--agent-socket", sock_dir + "/agent.sock", "--job", "boxed", "--rank", "0",
                                     "--world-size", "1", "--steps", "8", "--every", "2", "--mib", "4"};
    for (std::string& e : extra) demo.push_back(std::move(e));
    std::vector<std::string> quoted;
    for (const std::string& a : demo) quoted.push_back(Q(a));
    const std::string script = absl::StrCat(
        "set -e\n",
        "mount --make-rprivate /\n",
        // A private /dev/shm: the agent's pool file is not there.
        "mount -t tmpfs -o size=16m ckpt-private-shm /dev/shm\n",
        "mkdir -p ", Q(sock_dir), "\n",
        "mount --bind ", Q(agent_->run_dir()), " ", Q(sock_dir), "\n",
        // Hide the rest of the agent's directory (its run dir path, logs).
        "mount -t tmpfs ckpt-hide ", Q(agent_->options().dir), "\n",
        "if [ -e ", Q(shm_dir_ + "/pool.bin"), " ] || [ -e ", Q(agent_->socket_path()), " ]; then\n",
        "  echo 'the agent is visible in the container' >&2; exit 97\n",
        "fi\n",
        "echo \"container pid $$\"\n",
        // Not exec'd: the namespace's init (PID 1) could not SIGKILL itself.
        "set +e\n", absl::StrJoin(quoted, " "), "\n",
        "exit $?\n");
    testing::SubprocessOptions o;
    o.argv = {"/usr/bin/unshare", "--mount", "--pid", "--ipc", "--fork", "--kill-child", "/bin/sh", "-c", script};
    o.name = "trainer-container";
    return testing::RunToCompletion(o, absl::Seconds(120));
  }

  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<MetaProcess> meta_;
  std::unique_ptr<AgentProcess> agent_;
  std::string shm_dir_;
  std::string view_;
};

TEST_F(ContainerTest, TrainerInItsOwnNamespacesSavesCrashesAndResumesAcrossAnAgentRestart) {
  absl::StatusOr<testing::RunResult> crashed = RunTrainer({"--crash-at", "4"});
  ASSERT_TRUE(crashed.ok()) << crashed.status();
  EXPECT_THAT(crashed->stdout_text, HasSubstr("container pid 1"));  // its own PID namespace
  EXPECT_THAT(crashed->stdout_text, HasSubstr("step 4 saved"));
  EXPECT_THAT(crashed->stdout_text, HasSubstr("crashing now"));
  EXPECT_EQ(crashed->status.exit_code(), 128 + SIGKILL) << crashed->stdout_text << crashed->stderr_text;

  // The agent dies too, and comes back on the same memory tier.
  ASSERT_TRUE(agent_->proc()->Kill().ok());
  ASSERT_TRUE(agent_->proc()->Wait().ok());
  ASSERT_TRUE(agent_->Restart().ok());

  absl::StatusOr<testing::RunResult> resumed = RunTrainer({"--resume"});
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_TRUE(resumed->status.success()) << resumed->stdout_text << resumed->stderr_text << "\n"
                                         << agent_->proc()->LogTail();
  EXPECT_THAT(resumed->stdout_text, HasSubstr("resumed from step 4 (served from local)"));
  EXPECT_THAT(resumed->stdout_text, HasSubstr("final state matches an uninterrupted run: yes"));

  // Both trainers' sessions ended with them: nothing they held is left
  // behind once the grace period passed.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  ckpt::v1::AgentStatusResponse st;
  while (absl::Now() < deadline) {
    grpc::ClientContext ctx;
    ASSERT_TRUE(agent_->stub()->AgentStatus(&ctx, {}, &st).ok());
    if (st.open_leases() == 0 && st.open_handles() == 0) break;
    absl::SleepFor(absl::Milliseconds(100));  // bounded poll of another process
  }
  EXPECT_EQ(st.open_leases(), 0u);
  EXPECT_EQ(st.open_handles(), 0u);
}

}  // namespace
}  // namespace ckpt
