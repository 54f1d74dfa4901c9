// Unix sockets created owner-only and then opened to their group.
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

mode_t ModeOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 0777;
}

// With umask 0, a plain bind makes the socket 0777; restricted first, 0600.
TEST(UnixSocket, RestrictedBeforeBindItIsCreatedOwnerOnly) {
  testing::TempDir dir = *testing::TempDir::Create();
  const mode_t old_mask = ::umask(0);
  const int plain = BindAt(dir.path() + "/plain.sock");
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_TRUE(RestrictSocketBeforeBind(fd).ok());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = dir.path() + "/agent.sock";
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  ::umask(old_mask);
  EXPECT_EQ(ModeOf(dir.path() + "/plain.sock"), 0777u);
  EXPECT_EQ(ModeOf(path), 0600u);
  ::close(fd);
  ::close(plain);
}

// A library's bind under OwnerOnlyUmask: 0600; the umask is restored after.
TEST(UnixSocket, OwnerOnlyUmaskCoversALibrarysBind) {
  testing::TempDir dir = *testing::TempDir::Create();
  const mode_t old_mask = ::umask(0);
  int fd = -1;
  {
    OwnerOnlyUmask owner_only;
    fd = BindAt(dir.path() + "/agent.sock");
  }
  EXPECT_EQ(::umask(old_mask), 0u);
  EXPECT_EQ(ModeOf(dir.path() + "/agent.sock"), 0600u);
  ::close(fd);
}

TEST(UnixSocket, OpenToGroupGivesModeAndGroup) {
  testing::TempDir dir = *testing::TempDir::Create();
  const std::string path = dir.path() + "/agent.sock";
  const int fd = BindAt(path);
  ASSERT_TRUE(OpenSocketToGroup(path, static_cast<int>(::getegid())).ok());
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  EXPECT_EQ(st.st_gid, ::getegid());
  EXPECT_EQ(OpenSocketToGroup(dir.path() + "/none.sock", -1).code(), absl::StatusCode::kPermissionDenied);
  ::close(fd);
}

// Run as a user that is not root and not in group 4242 (as root, in a child
// that drops to uid/gid 4343 first), so that chown to 4242 fails.
TEST(UnixSocket, AGroupThatCannotBeGivenIsAClearError) {
  testing::TempDir dir = *testing::TempDir::Create();
  ASSERT_EQ(::chmod(dir.path().c_str(), 0777), 0);
  const std::string path = dir.path() + "/session.sock";
  auto check = [&]() -> std::string {
    const int fd = BindAt(path);
    absl::Status s = OpenSocketToGroup(path, 4242);
    ::close(fd);
    if (s.code() != absl::StatusCode::kPermissionDenied) return "not PermissionDenied: " + s.ToString();
    if (s.message().find("group 4242") == absl::string_view::npos ||
        s.message().find("as root or as a member") == absl::string_view::npos) {
      return "unclear message: " + s.ToString();
    }
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0 || st.st_gid == 4242) return "the socket changed group";
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

TEST(SocketGroupId, TakesANumberAsTheGroupId) {
  EXPECT_EQ(*SocketGroupId("0"), 0);
  EXPECT_EQ(*SocketGroupId("4242"), 4242);
  EXPECT_EQ(*SocketGroupId("2147483647"), 2147483647);
}

TEST(SocketGroupId, LooksANameUpInTheGroupDatabase) {
  // Our own group, by the name the group database gives it.
  const struct group* own = ::getgrgid(::getegid());
  if (own == nullptr) GTEST_SKIP() << "gid " << ::getegid() << " has no name in the group database";
  const std::string name = own->gr_name;
  absl::StatusOr<int> gid = SocketGroupId(name);
  ASSERT_TRUE(gid.ok()) << gid.status();
  EXPECT_EQ(*gid, static_cast<int>(::getegid()));
}

TEST(SocketGroupId, AnUnknownNameIsAClearError) {
  absl::StatusOr<int> gid = SocketGroupId("ckpt-no-such-group-xyz");
  EXPECT_EQ(gid.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(gid.status().message(),
              ::testing::HasSubstr("--socket-group: no group named \"ckpt-no-such-group-xyz\""));
}

// A gid that does not fit an int would read as "no group" (negative) to the
// socket's checks: refused, not taken as "anyone may connect".
TEST(SocketGroupId, AnIdOutOfRangeOrAnEmptyNameIsRefused) {
  for (const char* bad : {"2147483648", "4294967295", "18446744073709551615", ""}) {
    absl::StatusOr<int> gid = SocketGroupId(bad);
    EXPECT_EQ(gid.status().code(), absl::StatusCode::kInvalidArgument) << "\"" << bad << "\"";
    EXPECT_THAT(gid.status().message(), ::testing::HasSubstr("--socket-group")) << bad;
  }
  EXPECT_THAT(SocketGroupId("2147483648").status().message(), ::testing::HasSubstr("out of range"));
}

}  // namespace
}  // namespace ckpt
