#include "server/cmd/data_plane_key.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ckpt::daemon {
namespace {

constexpr size_t kHexChars = 2 * kDataPlaneKeyBytes;

std::string Errno(int err) { return std::strerror(err); }

std::string RandomKey() {
  std::string key(kDataPlaneKeyBytes, '\0');
  size_t got = 0;
  while (got < key.size()) {
    const ssize_t n = getrandom(key.data() + got, key.size() - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (errno != EINTR) {
      std::abort();  // no randomness from the kernel: nothing safe to fall back to
    }
  }
  return key;
}

// NotFound if there is no file at `path` (the caller creates it).
absl::StatusOr<std::string> ReadKey(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat("no data-plane key at ", path));
    if (err == ELOOP) {
      return absl::FailedPreconditionError(absl::StrCat(
          "data-plane key ", path, " is a symbolic link; ckpt-meta reads only a regular file of its own there "
          "(remove the link: meta makes a new key)"));
    }
    return absl::UnavailableError(absl::StrCat("cannot open data-plane key ", path, ": ", Errno(err)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("cannot stat data-plane key ", path, ": ", Errno(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("data-plane key ", path, " is not a regular file; remove it (meta makes a new key)"));
  }
  if (st.st_uid != ::geteuid()) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat("data-plane key ", path, " is owned by uid ", st.st_uid,
                                                      ", not by ckpt-meta's uid ", ::geteuid(),
                                                      "; remove it (meta makes a new key) or chown it"));
  }
  if ((st.st_mode & 077) != 0) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "data-plane key ", path, " has mode ", absl::StrFormat("%04o", st.st_mode & 07777),
        ": group or others may read it; it may have leaked, so remove it (meta makes a new key, then restart the "
        "agents) or, if it did not, chmod 600 it"));
  }
  char buf[kHexChars + 2];
  size_t have = 0;
  for (;;) {
    const ssize_t n = ::read(fd, buf + have, sizeof(buf) - have);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return absl::UnavailableError(absl::StrCat("cannot read data-plane key ", path, ": ", Errno(err)));
    }
    if (n == 0) break;
    have += static_cast<size_t>(n);
    if (have == sizeof(buf)) break;
  }
  ::close(fd);
  std::string text(buf, have);
  if (!text.empty() && text.back() == '\n') text.pop_back();
  const bool hex = text.size() == kHexChars &&
                   std::all_of(text.begin(), text.end(), [](char c) { return absl::ascii_isxdigit(c); });
  if (!hex) {
    return absl::DataLossError(absl::StrCat("data-plane key ", path, " does not hold ", kHexChars,
                                            " hex digits (damaged?); remove it so that meta makes a new key, "
                                            "then restart the agents"));
  }
  return absl::HexStringToBytes(text);
}

// AlreadyExists if another process made the file meanwhile.
absl::Status CreateKey(const std::string& path) {
  // A name no other creator uses (another process, or another thread).
  const std::string tmp =
      absl::StrCat(path, ".tmp.", ::getpid(), ".", absl::BytesToHexString(RandomKey().substr(0, 8)));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("cannot create data-plane key ", tmp, ": ", Errno(errno)));
  }
  const std::string text = absl::StrCat(absl::BytesToHexString(RandomKey()), "\n");
  size_t done = 0;
  int err = 0;
  if (::fchmod(fd, 0600) != 0) err = errno;  // O_CREAT's mode is reduced by the umask, never widened
  while (err == 0 && done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      err = errno;
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  ::close(fd);
  if (err == 0 && ::link(tmp.c_str(), path.c_str()) != 0) err = errno;
  ::unlink(tmp.c_str());
  if (err == EEXIST) return absl::AlreadyExistsError(path);
  if (err != 0) return absl::UnavailableError(absl::StrCat("cannot create data-plane key ", path, ": ", Errno(err)));
  // The name is durable once its directory is.
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> LoadOrCreateDataPlaneKey(const std::string& path) {
  absl::StatusOr<std::string> key = ReadKey(path);
  if (key.ok() || !absl::IsNotFound(key.status())) return key;
  if (absl::Status s = CreateKey(path); !s.ok() && !absl::IsAlreadyExists(s)) return s;
  return ReadKey(path);
}

}  // namespace ckpt::daemon
