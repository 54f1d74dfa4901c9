#include "common/secret_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ckpt {
namespace {

constexpr size_t kMaxSecretFileBytes = 1 << 20;
constexpr mode_t kWidestMode = 0640;

std::string Mode(mode_t m) { return absl::StrFormat("%04o", m & 07777); }

}  // namespace

absl::StatusOr<std::string> ReadSecretFile(const std::string& path, const std::string& what, bool follow_symlink) {
  const int fd =
      ::open(path.c_str(), O_RDONLY | (follow_symlink ? 0 : O_NOFOLLOW) | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) {
    const int e = errno;
    if (e == ELOOP) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " \"", path, "\" is a symbolic link: name the file itself (a Kubernetes Secret volume: "
          "DIR/..data/NAME, or mount the key with subPath)"));
    }
    return absl::InvalidArgumentError(absl::StrCat(what, " \"", path, "\" cannot be opened: ", std::strerror(e)));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " \"", path, "\": fstat failed: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " \"", path, "\" is not a regular file"));
  }
  const uid_t euid = ::geteuid();
  if (st.st_uid != euid && st.st_uid != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " \"", path, "\" is owned by uid ", st.st_uid, ": it must belong to this process's user (uid ", euid,
        ") or to root, so that no other user can change it (chown it)"));
  }
  if ((st.st_mode & 07777 & ~kWidestMode) != 0) {
    const bool world = (st.st_mode & 0007) != 0;
    return absl::InvalidArgumentError(absl::StrCat(
        what, " \"", path, "\" has mode ", Mode(st.st_mode),
        world ? " (readable by every user)" : "", "; it must be no wider than 0640: chmod 0600 ", path));
  }
  if (static_cast<uint64_t>(st.st_size) > kMaxSecretFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " \"", path, "\" is ", st.st_size, " bytes; a secret file is at most 1 MiB"));
  }
  std::string text;
  char buf[4096];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InvalidArgumentError(absl::StrCat(what, " \"", path, "\" cannot be read: ", std::strerror(errno)));
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > kMaxSecretFileBytes) {
      return absl::InvalidArgumentError(absl::StrCat(what, " \"", path, "\" grew past 1 MiB while it was read"));
    }
  }
  return text;
}

absl::Status CheckTokenStrength(const std::string& token, const std::string& where) {
  if (token.size() >= kMinTokenChars) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(where, " holds a token of ", token.size(),
                                                 " characters; at least ", kMinTokenChars,
                                                 " (128 bits) are needed: ", kMakeTokenHint));
}

}  // namespace ckpt
