#include "common/unix_socket.h"

#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <limits>
#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace ckpt {

absl::Status RestrictSocketBeforeBind(int fd) {
  if (::fchmod(fd, 0600) != 0) {
    return absl::InternalError(absl::StrCat("fchmod 0600 on a unix socket: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

OwnerOnlyUmask::OwnerOnlyUmask() : old_(::umask(0177)) {}

OwnerOnlyUmask::~OwnerOnlyUmask() { ::umask(old_); }

absl::Status OpenSocketToGroup(const std::string& path, int gid) {
  if (::chmod(path.c_str(), 0660) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("chmod 0660 '", path, "': ", std::strerror(errno)));
  }
  if (gid >= 0 && ::chown(path.c_str(), static_cast<uid_t>(-1), static_cast<gid_t>(gid)) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("cannot give '", path, "' to group ", gid, ": ",
                                                    std::strerror(errno),
                                                    " (run the agent as root or as a member of that group)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> SocketGroupId(const std::string& group) {
  constexpr char flag[] = "--socket-group";
  if (group.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": empty group name"));
  uint64_t gid = 0;
  if (absl::SimpleAtoi(group, &gid)) {
    // A negative gid means "no group" to OpenSocketToGroup and PeerOutsideGroup.
    if (gid > static_cast<uint64_t>(std::numeric_limits<int>::max())) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": group id ", group, " is out of range (0..", std::numeric_limits<int>::max(), ")"));
    }
    return static_cast<int>(gid);
  }
  struct group info {};
  std::vector<char> buf(16384);
  struct group* found = nullptr;
  const int rc = ::getgrnam_r(group.c_str(), &info, buf.data(), buf.size(), &found);
  if (rc != 0 || found == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": no group named \"", group, "\"",
                                                   rc != 0 ? absl::StrCat(" (", std::strerror(rc), ")") : ""));
  }
  if (found->gr_gid > static_cast<gid_t>(std::numeric_limits<int>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": group \"", group, "\" has id ", found->gr_gid, ", out of range"));
  }
  return static_cast<int>(found->gr_gid);
}

std::string PeerOutsideGroup(int fd, int gid, const std::string& where) {
  if (gid < 0) return "";
  const auto allowed = static_cast<gid_t>(gid);
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return absl::StrCat("cannot read the peer's credentials: ", std::strerror(errno));
  }
  if (cred.uid == 0 || cred.uid == ::geteuid() || cred.gid == allowed) return "";
  // The supplementary groups the process had when it connected.
  std::vector<gid_t> groups(64);
  socklen_t glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
  int rc = ::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen);
  if (rc != 0 && errno == ERANGE) {
    groups.resize(glen / sizeof(gid_t));
    rc = ::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen);
  }
  if (rc == 0) {
    groups.resize(glen / sizeof(gid_t));
    if (std::find(groups.begin(), groups.end(), allowed) != groups.end()) return "";
  }
  return absl::StrCat("uid ", cred.uid, " gid ", cred.gid, " (pid ", cred.pid, ") is not in ", where);
}

absl::Status ProbeAgentSocket(const std::string& path, const std::string& how, bool* may_heal) {
  if (may_heal != nullptr) *may_heal = false;
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const std::string agent_sock = (dir.empty() ? std::string(".") : dir) + "/agent.sock";
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("agent socket path \"", path, "\" is longer than ",
                                                   sizeof(addr.sun_path) - 1, " bytes"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  ::close(fd);
  if (rc == 0) return absl::OkStatus();
  switch (err) {
    case ENOTDIR:
    case ENOENT:
      if (may_heal != nullptr) *may_heal = err == ENOENT;  // an agent starting creates it
      return absl::FailedPreconditionError(absl::StrCat(
          "no agent socket at ", path, ": is ckpt-agent running on this host? It serves <run-dir>/agent.sock "
          "(--run-dir, default /run/ckpt); point ", how, " at it"));
    case EPROTOTYPE:
      return absl::FailedPreconditionError(absl::StrCat(
          path, " is not the agent's gRPC socket (it is a SOCK_SEQPACKET socket: the session socket); trainers "
          "and ckptctl use ", agent_sock, " (", how, ")"));
    case ECONNREFUSED:
      if (may_heal != nullptr) *may_heal = true;  // an agent restarting binds it again
      return absl::FailedPreconditionError(absl::StrCat(
          "nothing accepts on ", path, " (connection refused): a socket left by a ckpt-agent that stopped, or "
          "not a socket; start ckpt-agent, or point ", how, " at the running agent's agent.sock"));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(absl::StrCat(
          "permission denied on ", path, ": the socket is mode 0660 for the agent's user and group (ckpt-agent "
          "--socket-group); run ckptctl or the trainer as that user or in that group"));
    default:
      // Anything else may heal (EAGAIN: the backlog is full): the client
      // retries within its timeout.
      return absl::OkStatus();
  }
}

}  // namespace ckpt
