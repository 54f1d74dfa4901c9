// PublishSocket: the final path appears only with mode 0660 and its group.
#include "common/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <grp.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "support/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::StartsWith;

// A listening unix socket bound at `path`; closed by the caller.
int BindAt(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  EXPECT_EQ(::listen(fd, 4), 0);
  return fd;
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

TEST(UnixSocket, StagingNameIsShortAndNextToThePath) {
  const std::string staged = StagingSocketPath("/run/ckpt/agent.sock");
  EXPECT_THAT(staged, StartsWith("/run/ckpt/.a"));
  EXPECT_EQ(staged, "/run/ckpt/.a" + std::to_string(::getpid()));
  EXPECT_LE(staged.size(), std::string("/run/ckpt/agent.sock").size());
  EXPECT_THAT(StagingSocketPath("session.sock"), StartsWith("./.s"));
}

TEST(UnixSocket, PublishGivesModeAndGroupThenRenames) {
  testing::TempDir dir = *testing::TempDir::Create();
  const std::string path = dir.path() + "/agent.sock";
  const std::string staged = StagingSocketPath(path);
  const mode_t old_mask = ::umask(022);
  const int fd = BindAt(staged);
  ::umask(old_mask);
  ASSERT_TRUE(PublishSocket(staged, path, static_cast<int>(::getegid())).ok());
  EXPECT_FALSE(Exists(staged));
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  EXPECT_EQ(st.st_gid, ::getegid());
  // Still the listening socket: a client connects through the final name.
  const int c = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  EXPECT_EQ(::connect(c, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  ::close(c);
  ::close(fd);
}

// Run as a user that is not root and not in group 4242 (as root, in a child
// that drops to uid/gid 4343 first), so that chown to 4242 fails.
TEST(UnixSocket, AGroupThatCannotBeGivenLeavesNothingBehind) {
  testing::TempDir dir = *testing::TempDir::Create();
  ASSERT_EQ(::chmod(dir.path().c_str(), 0777), 0);
  const std::string path = dir.path() + "/session.sock";
  auto check = [&]() -> std::string {
    const std::string staged = StagingSocketPath(path);
    const int fd = BindAt(staged);
    absl::Status s = PublishSocket(staged, path, 4242);
    ::close(fd);
    if (s.code() != absl::StatusCode::kPermissionDenied) return "not PermissionDenied: " + s.ToString();
    if (s.message().find("group 4242") == absl::string_view::npos ||
        s.message().find("as root or as a member") == absl::string_view::npos) {
      return "unclear message: " + s.ToString();
    }
    if (Exists(staged) || Exists(path)) return "a socket file was left behind";
    return "";
  };
  if (::geteuid() != 0) {
    EXPECT_EQ(check(), "");
    return;
  }
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setgid(4343) != 0 || ::setuid(4343) != 0) ::_exit(3);
    const std::string failure = check();
    if (!failure.empty()) std::fprintf(stderr, "%s\n", failure.c_str());
    ::_exit(failure.empty() ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "see the child's stderr above (3: could not drop to uid 4343)";
}

}  // namespace
}  // namespace ckpt
