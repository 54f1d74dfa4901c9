#include "common/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

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

}  // namespace ckpt
