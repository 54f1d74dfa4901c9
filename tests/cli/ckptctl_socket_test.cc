// The real ckptctl `save` against agent sockets that cannot work (issue 40,
// item 2): no socket, the session socket instead of agent.sock, a socket
// nobody accepts on, one it may not open. Each fails at once (not after the
// 30 s connect timeout) saying what to do. No daemon runs: nothing listens
// at --meta either.
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "support/process.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using testing::RunResult;
using testing::TempDir;

// A unix socket of `type` bound at `path`, listening if `listen`.
int BindUnix(const std::string& path, int type, bool listen) {
  const int fd = ::socket(AF_UNIX, type, 0);
  EXPECT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  EXPECT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  if (listen) {
    EXPECT_EQ(::listen(fd, 4), 0);
  }
  return fd;
}

class CkptctlSocketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TempDir> t = TempDir::Create();
    ASSERT_TRUE(t.ok()) << t.status();
    tmp_ = std::make_unique<TempDir>(*std::move(t));
    std::ofstream(P("data.bin")) << "some bytes";
  }
  void TearDown() override {
    for (int fd : fds_) ::close(fd);
  }
  std::string P(const std::string& name) const { return tmp_->path() + "/" + name; }

  // `ckptctl save` through `socket`: must fail (exit 1) within 10 s; returns
  // its stderr.
  std::string SaveFails(const std::string& socket) {
    testing::SubprocessOptions o;
    o.argv = {testing::BinaryPath("ckptctl"), "--meta", "127.0.0.1:1", "save", "j", "1", P("data.bin"), "--rank", "0",
              "--world-size", "1", "--agent-socket", socket};
    o.env = {{"CKPT_TLS_CA", ""}, {"CKPT_TLS_CERT", ""}, {"CKPT_TLS_KEY", ""}, {"CKPT_AGENT_SOCKET", ""}};
    const absl::Time start = absl::Now();
    absl::StatusOr<RunResult> r = testing::RunToCompletion(o, absl::Seconds(60));
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return "";
    EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "waited before failing: " << r->stderr_text;
    EXPECT_TRUE(r->status.exited() && r->status.exit_code() == 1) << r->status << "\n" << r->stderr_text;
    return r->stderr_text;
  }

  std::unique_ptr<TempDir> tmp_;
  std::vector<int> fds_;
};

TEST_F(CkptctlSocketTest, NoSocketSaysIsTheAgentRunningAndWhichFlag) {
  const std::string err = SaveFails(P("run/agent.sock"));
  EXPECT_THAT(err, HasSubstr(absl::StrCat("no agent socket at ", P("run/agent.sock"),
                                          ": is ckpt-agent running on this host?")));
  EXPECT_THAT(err, HasSubstr("--agent-socket or CKPT_AGENT_SOCKET"));
}

TEST_F(CkptctlSocketTest, TheSessionSocketIsNamedAndAgentSockBesideItSuggested) {
  fds_.push_back(BindUnix(P("session.sock"), SOCK_SEQPACKET, /*listen=*/true));
  const std::string err = SaveFails(P("session.sock"));
  EXPECT_THAT(err, HasSubstr("the session socket); trainers and ckptctl use " + P("agent.sock")));
}

TEST_F(CkptctlSocketTest, ASocketNobodyAcceptsOnIsConnectionRefusedAtOnce) {
  fds_.push_back(BindUnix(P("agent.sock"), SOCK_STREAM, /*listen=*/false));
  const std::string err = SaveFails(P("agent.sock"));
  EXPECT_THAT(err, HasSubstr(absl::StrCat("nothing accepts on ", P("agent.sock"), " (connection refused)")));
}

TEST_F(CkptctlSocketTest, ASocketWeMayNotOpenSaysWhichGroup) {
  if (::geteuid() == 0) GTEST_SKIP() << "root opens any socket";
  fds_.push_back(BindUnix(P("agent.sock"), SOCK_STREAM, /*listen=*/true));
  ASSERT_EQ(::chmod(P("agent.sock").c_str(), 0), 0);
  const std::string err = SaveFails(P("agent.sock"));
  EXPECT_THAT(err, HasSubstr(absl::StrCat("permission denied on ", P("agent.sock"))));
  EXPECT_THAT(err, HasSubstr("--socket-group"));
}

}  // namespace
}  // namespace ckpt
