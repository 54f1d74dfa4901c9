#include "common/unix_socket.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ckpt {

std::string StagingSocketPath(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  return absl::StrCat(dir, "/.", name.empty() ? "s" : name.substr(0, 1), ::getpid());
}

absl::Status PublishSocket(const std::string& staged, const std::string& path, int gid) {
  auto fail = [&](const std::string& what, int err, const char* hint) {
    ::unlink(staged.c_str());
    return absl::PermissionDeniedError(absl::StrCat(what, ": ", std::strerror(err), hint));
  };
  if (::chmod(staged.c_str(), 0660) != 0) return fail(absl::StrCat("chmod 0660 '", staged, "'"), errno, "");
  if (gid >= 0 && ::chown(staged.c_str(), static_cast<uid_t>(-1), static_cast<gid_t>(gid)) != 0) {
    return fail(absl::StrCat("cannot give '", path, "' to group ", gid), errno,
                " (run the agent as root or as a member of that group)");
  }
  if (::rename(staged.c_str(), path.c_str()) != 0) {
    return fail(absl::StrCat("rename '", staged, "' to '", path, "'"), errno, "");
  }
  return absl::OkStatus();
}

}  // namespace ckpt
