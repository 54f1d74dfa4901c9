#include "support/temp_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file_system.h"

namespace ckpt::testing {
namespace {

bool KeepTestDirs() {
  const char* keep = std::getenv("CKPT_KEEP_TEST_DIRS");
  return keep != nullptr && std::strcmp(keep, "1") == 0;
}

// Deletes the entry `name` in the directory `parent_fd` (AT_FDCWD for a path
// relative to the working directory, or an absolute `name`) and, if it is a
// directory, everything below it. `display` is the full path, for messages.
// Symbolic links are unlinked, never followed: unlinkat without AT_REMOVEDIR
// removes a link or file and fails with EISDIR only for a real directory.
absl::Status RemoveTree(int parent_fd, const std::string& name, const std::string& display) {
  if (::unlinkat(parent_fd, name.c_str(), 0) == 0 || errno == ENOENT) return absl::OkStatus();
  if (errno != EISDIR) return PosixErrorToStatus(errno, "unlink", display);

  // A test may have made the directory read-only (or unreadable) to provoke
  // errors; its owner can always chmod it back.
  ::fchmodat(parent_fd, name.c_str(), S_IRWXU, 0);
  const int fd = ::openat(parent_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return PosixErrorToStatus(errno, "open", display);
  DIR* dir = ::fdopendir(fd);
  if (dir == nullptr) {
    const int err = errno;
    ::close(fd);
    return PosixErrorToStatus(err, "opendir", display);
  }
  // Collect the names first: deleting while readdir() iterates may skip entries.
  std::vector<std::string> children;
  absl::Status status;
  while (true) {
    errno = 0;
    const dirent* entry = ::readdir(dir);
    if (entry == nullptr) {
      if (errno != 0) status = PosixErrorToStatus(errno, "readdir", display);
      break;
    }
    if (std::strcmp(entry->d_name, ".") == 0 || std::strcmp(entry->d_name, "..") == 0) continue;
    children.emplace_back(entry->d_name);
  }
  for (const std::string& child : children) {
    absl::Status removed = RemoveTree(::dirfd(dir), child, absl::StrCat(display, "/", child));
    if (status.ok()) status = removed;
  }
  ::closedir(dir);
  if (!status.ok()) return status;
  if (::unlinkat(parent_fd, name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
    return PosixErrorToStatus(errno, "rmdir", display);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TempDir> TempDir::Create() {
  const char* tmpdir = std::getenv("TMPDIR");
  std::string base = (tmpdir != nullptr && tmpdir[0] != '\0') ? tmpdir : "/tmp";
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  std::string templ = absl::StrCat(base == "/" ? "" : base, "/ckpt-test-XXXXXX");
  if (::mkdtemp(templ.data()) == nullptr) return PosixErrorToStatus(errno, "mkdtemp", templ);
  if (templ.front() != '/') {
    // A relative $TMPDIR: make path() absolute so it survives a chdir and can
    // be handed to daemons running in another working directory.
    char* absolute = ::realpath(templ.c_str(), nullptr);
    if (absolute == nullptr) {
      const int err = errno;
      ::rmdir(templ.c_str());
      return PosixErrorToStatus(err, "realpath", templ);
    }
    templ = absolute;
    std::free(absolute);
  }
  return TempDir(std::move(templ));
}

TempDir::TempDir(TempDir&& other) noexcept : path_(std::exchange(other.path_, std::string())) {}

TempDir& TempDir::operator=(TempDir&& other) noexcept {
  if (this != &other) {
    absl::Status removed = Remove();
    if (!removed.ok()) std::fprintf(stderr, "[ckpt] TempDir: %s\n", removed.ToString().c_str());
    path_ = std::exchange(other.path_, std::string());
  }
  return *this;
}

TempDir::~TempDir() {
  absl::Status removed = Remove();
  if (!removed.ok()) std::fprintf(stderr, "[ckpt] TempDir: %s\n", removed.ToString().c_str());
}

absl::Status TempDir::Remove() {
  if (path_.empty()) return absl::OkStatus();
  const std::string path = std::exchange(path_, std::string());
  if (KeepTestDirs()) {
    std::fprintf(stderr, "[ckpt] CKPT_KEEP_TEST_DIRS=1: keeping test dir %s\n", path.c_str());
    return absl::OkStatus();
  }
  return RemoveTree(AT_FDCWD, path, path);
}

absl::StatusOr<std::string> TempDir::Sub(const std::string& name) const {
  if (path_.empty()) return absl::FailedPreconditionError("TempDir::Sub on a moved-from TempDir");
  if (name.empty() || name.front() == '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("TempDir::Sub: '", name, "' is not a relative path"));
  }
  std::string path = path_;
  for (absl::string_view component : absl::StrSplit(name, '/')) {
    if (component.empty() || component == "." || component == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat("TempDir::Sub: '", name, "' has an empty, '.' or '..' component"));
    }
    absl::StrAppend(&path, "/", component);
    if (::mkdir(path.c_str(), 0755) == 0) continue;
    const int err = errno;
    struct stat st;
    if (err == EEXIST && ::lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) continue;
    if (err == EEXIST) {
      return absl::FailedPreconditionError(
          absl::StrCat("TempDir::Sub: '", path, "' exists and is not a directory"));
    }
    return PosixErrorToStatus(err, "mkdir", path);
  }
  return path;
}

}  // namespace ckpt::testing
