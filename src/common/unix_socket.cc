#include "common/unix_socket.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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

}  // namespace ckpt
