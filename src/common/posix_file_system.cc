// FileSystem on the POSIX API (Linux): open/pwrite/pread/fdatasync/rename,
// fsync of directories, mkdir/unlink/rmdir/readdir/stat/truncate, statvfs for
// free space and fallocate for preallocation. EINTR and short transfers are
// retried; errno becomes a Status through PosixErrorToStatus.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/file_system.h"
#include "common/lock_check.h"

namespace ckpt {
namespace {

// glibc's strerror_r is the GNU variant (returns char*) under _GNU_SOURCE,
// which g++ defines; other C libraries have the XSI one (returns int). These
// overloads accept either.
[[maybe_unused]] const char* StrErrorResult(const char* result, const char* /*buf*/) {
  return result;
}
[[maybe_unused]] const char* StrErrorResult(int result, const char* buf) {
  return result == 0 ? buf : "Unknown error";
}

std::string ErrnoDescription(int error_number) {
  char buf[128];
  buf[0] = '\0';
  return StrErrorResult(strerror_r(error_number, buf, sizeof(buf)), buf);
}

absl::StatusCode ErrnoToCode(int error_number) {
  switch (error_number) {
    case ENOENT:
      return absl::StatusCode::kNotFound;
    case EEXIST:
      return absl::StatusCode::kAlreadyExists;
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
    case EMFILE:
    case ENFILE:
    case ENOMEM:
      return absl::StatusCode::kResourceExhausted;
    case EACCES:
    case EPERM:
      return absl::StatusCode::kPermissionDenied;
    case EINVAL:
    case ENAMETOOLONG:
    case ELOOP:
    case EBADF:
      return absl::StatusCode::kInvalidArgument;
    case ENOTDIR:
    case EISDIR:
    case ENOTEMPTY:
    case EBUSY:
    case EROFS:
    case EXDEV:
    case ETXTBSY:
      return absl::StatusCode::kFailedPrecondition;
    case EIO:
    case EAGAIN:
    case ETIMEDOUT:
    case ESTALE:
    case ENOLINK:
    case ECONNRESET:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

// Runs `call` (returning -1 with errno on failure) until it does not fail with
// EINTR; returns its last result and leaves errno as the call set it.
template <typename Call>
auto RetryOnEintr(Call call) {
  for (;;) {
    auto result = call();
    if (result != -1 || errno != EINTR) return result;
  }
}

// Writes all of `data` at `offset`, retrying short writes and EINTR.
absl::Status PwriteAll(int fd, uint64_t offset, std::span<const std::byte> data,
                       const std::string& path) {
  while (!data.empty()) {
    const ssize_t n = RetryOnEintr(
        [&] { return ::pwrite(fd, data.data(), data.size(), static_cast<off_t>(offset)); });
    if (n < 0) return PosixErrorToStatus(errno, "write", path);
    // pwrite returns 0 only for a zero-length request; guard anyway.
    if (n == 0) return PosixErrorToStatus(EIO, "write (no progress)", path);
    data = data.subspan(static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

class PosixWritableFile : public WritableFile {
 public:
  PosixWritableFile(std::string path, int fd, uint64_t size)
      : path_(std::move(path)), fd_(fd), size_(size) {}

  ~PosixWritableFile() override {
    // Close() reports errors; here there is no one to report them to.
    absl::MutexLock lock(&mu_);
    if (!closed_) ::close(fd_);
  }

  absl::Status Append(std::span<const std::byte> data) override {
    AssertNoCheckedLock("file I/O");
    uint64_t offset;
    {
      absl::MutexLock lock(&mu_);
      if (closed_) return Closed("append to");
      offset = size_;
      size_ += data.size();  // reserve the range so concurrent Appends don't overlap
    }
    return PwriteAll(fd_, offset, data, path_);
  }

  absl::Status PositionedWrite(uint64_t offset, std::span<const std::byte> data) override {
    AssertNoCheckedLock("file I/O");
    {
      absl::MutexLock lock(&mu_);
      if (closed_) return Closed("write to");
      if (offset > std::numeric_limits<uint64_t>::max() - data.size()) {
        return PosixErrorToStatus(EFBIG, "write", path_);
      }
      size_ = std::max<uint64_t>(size_, offset + data.size());
    }
    return PwriteAll(fd_, offset, data, path_);
  }

  absl::Status Preallocate(uint64_t size_bytes) override {
    AssertNoCheckedLock("file I/O");
    if (absl::Status s = CheckOpen("preallocate"); !s.ok()) return s;
    if (size_bytes == 0) return absl::OkStatus();
    const int rc = RetryOnEintr(
        [&] { return ::fallocate(fd_, FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(size_bytes)); });
    if (rc == 0) return absl::OkStatus();
    // Best effort by contract: some file systems cannot preallocate.
    if (errno == EOPNOTSUPP || errno == ENOSYS) return absl::OkStatus();
    return PosixErrorToStatus(errno, "preallocate", path_);
  }

  absl::Status Sync() override {
    AssertNoCheckedLock("file I/O");
    if (absl::Status s = CheckOpen("sync"); !s.ok()) return s;
    if (RetryOnEintr([&] { return ::fdatasync(fd_); }) != 0) {
      return PosixErrorToStatus(errno, "fdatasync", path_);
    }
    return absl::OkStatus();
  }

  absl::Status Close() override {
    AssertNoCheckedLock("file I/O");
    {
      absl::MutexLock lock(&mu_);
      if (closed_) return absl::OkStatus();
      closed_ = true;
    }
    // Never retry close(): on Linux the descriptor is released even when it
    // reports EINTR, and a retry could close someone else's descriptor.
    if (::close(fd_) != 0 && errno != EINTR) return PosixErrorToStatus(errno, "close", path_);
    return absl::OkStatus();
  }

  uint64_t Size() const override {
    absl::MutexLock lock(&mu_);
    return size_;
  }

 private:
  absl::Status Closed(std::string_view operation) const {
    return absl::FailedPreconditionError(std::string(operation) + " '" + path_ +
                                         "': file already closed");
  }
  absl::Status CheckOpen(std::string_view operation) const {
    absl::MutexLock lock(&mu_);
    return closed_ ? Closed(operation) : absl::OkStatus();
  }

  const std::string path_;
  // Valid until closed_ is set. A call racing with Close() is a caller bug (as
  // with any close()): it may use a released descriptor.
  const int fd_;
  mutable absl::Mutex mu_;
  uint64_t size_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

class PosixReadableFile : public ReadableFile {
 public:
  PosixReadableFile(std::string path, int fd, uint64_t size)
      : path_(std::move(path)), fd_(fd), size_(size) {}
  ~PosixReadableFile() override { ::close(fd_); }  // read-only: nothing to lose

  absl::StatusOr<size_t> PositionedRead(uint64_t offset, std::span<std::byte> out) override {
    AssertNoCheckedLock("file I/O");
    size_t total = 0;
    while (total < out.size()) {
      const ssize_t n = RetryOnEintr([&] {
        return ::pread(fd_, out.data() + total, out.size() - total,
                       static_cast<off_t>(offset + total));
      });
      if (n < 0) return PosixErrorToStatus(errno, "read", path_);
      if (n == 0) break;  // end of file
      total += static_cast<size_t>(n);
    }
    return total;
  }

  uint64_t Size() const override { return size_; }

 private:
  const std::string path_;
  const int fd_;
  const uint64_t size_;
};

class PosixFileSystemImpl : public FileSystem {
 public:
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                                OpenMode mode) override {
    int flags = O_WRONLY | O_CREAT | O_CLOEXEC;
    if (mode == OpenMode::kTruncate) flags |= O_TRUNC;
    if (mode == OpenMode::kCreateNew) flags |= O_EXCL;
    const int fd = RetryOnEintr([&] { return ::open(path.c_str(), flags, 0644); });
    if (fd < 0) return PosixErrorToStatus(errno, "open", path);
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      return PosixErrorToStatus(err, "stat", path);
    }
    return std::make_unique<PosixWritableFile>(path, fd, static_cast<uint64_t>(st.st_size));
  }

  absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override {
    AssertNoCheckedLock("file I/O");
    const int fd = RetryOnEintr([&] { return ::open(path.c_str(), O_RDONLY | O_CLOEXEC); });
    if (fd < 0) return PosixErrorToStatus(errno, "open", path);
    struct stat st;
    int err = 0;
    if (::fstat(fd, &st) != 0) {
      err = errno;
    } else if (S_ISDIR(st.st_mode)) {
      err = EISDIR;  // open(O_RDONLY) succeeds on a directory; reads would not
    }
    if (err != 0) {
      ::close(fd);
      return PosixErrorToStatus(err, "open", path);
    }
    return std::make_unique<PosixReadableFile>(path, fd, static_cast<uint64_t>(st.st_size));
  }

  absl::StatusOr<FileStat> Stat(const std::string& path) override {
    AssertNoCheckedLock("file I/O");
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return PosixErrorToStatus(errno, "stat", path);
    FileStat result;
    result.size_bytes = static_cast<uint64_t>(st.st_size);
    result.is_directory = S_ISDIR(st.st_mode);
    return result;
  }

  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override {
    AssertNoCheckedLock("file I/O");
    DIR* dir = ::opendir(path.c_str());
    if (dir == nullptr) return PosixErrorToStatus(errno, "opendir", path);
    std::vector<std::string> names;
    int err = 0;
    for (;;) {
      errno = 0;
      const struct dirent* entry = ::readdir(dir);
      if (entry == nullptr) {
        err = errno;  // 0 at the end of the directory
        break;
      }
      const std::string_view name = entry->d_name;
      if (name == "." || name == "..") continue;
      names.emplace_back(name);
    }
    ::closedir(dir);
    if (err != 0) return PosixErrorToStatus(err, "readdir", path);
    std::sort(names.begin(), names.end());
    return names;
  }

  absl::Status CreateDir(const std::string& path) override {
    AssertNoCheckedLock("file I/O");
    if (::mkdir(path.c_str(), 0755) != 0) return PosixErrorToStatus(errno, "mkdir", path);
    return absl::OkStatus();
  }

  absl::Status CreateDirs(const std::string& path) override {
    AssertNoCheckedLock("file I/O");
    if (path.empty()) return PosixErrorToStatus(ENOENT, "mkdir", path);
    // Create each prefix ending before a '/' (skipping the root and repeated
    // slashes), then the whole path.
    for (size_t pos = path.find('/', 1); ; pos = path.find('/', pos + 1)) {
      const std::string prefix = path.substr(0, pos);
      const bool last = pos == std::string::npos;
      if (!prefix.empty() && prefix.back() != '/') {
        if (::mkdir(prefix.c_str(), 0755) != 0) {
          const int err = errno;
          if (err != EEXIST) return PosixErrorToStatus(err, "mkdir", prefix);
          // Exists: fine if it is a directory (perhaps just made by someone else).
          struct stat st;
          if (::stat(prefix.c_str(), &st) != 0) return PosixErrorToStatus(errno, "stat", prefix);
          if (!S_ISDIR(st.st_mode)) return PosixErrorToStatus(ENOTDIR, "mkdir", prefix);
        }
      }
      if (last) break;
    }
    return absl::OkStatus();
  }

  absl::Status DeleteFile(const std::string& path) override {
    AssertNoCheckedLock("file I/O");
    if (::unlink(path.c_str()) != 0) return PosixErrorToStatus(errno, "unlink", path);
    return absl::OkStatus();
  }

  absl::Status DeleteDir(const std::string& path) override {
    AssertNoCheckedLock("file I/O");
    if (::rmdir(path.c_str()) != 0) {
      // POSIX allows EEXIST for a non-empty directory; report it as Linux does.
      const int err = errno == EEXIST ? ENOTEMPTY : errno;
      return PosixErrorToStatus(err, "rmdir", path);
    }
    return absl::OkStatus();
  }

  absl::Status Rename(const std::string& src, const std::string& dst) override {
    AssertNoCheckedLock("file I/O");
    if (::rename(src.c_str(), dst.c_str()) != 0) {
      const int err = errno == EEXIST ? ENOTEMPTY : errno;
      return PosixErrorToStatus(err, "rename", src + "' to '" + dst);
    }
    return absl::OkStatus();
  }

  absl::Status SyncDir(const std::string& path) override {
    AssertNoCheckedLock("file I/O");
    const int fd = RetryOnEintr(
        [&] { return ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); });
    if (fd < 0) return PosixErrorToStatus(errno, "open directory", path);
    absl::Status status;
    if (RetryOnEintr([&] { return ::fsync(fd); }) != 0) {
      status = PosixErrorToStatus(errno, "fsync directory", path);
    }
    ::close(fd);  // read-only descriptor: nothing to lose
    return status;
  }

  absl::Status Truncate(const std::string& path, uint64_t size_bytes) override {
    AssertNoCheckedLock("file I/O");
    if (RetryOnEintr([&] { return ::truncate(path.c_str(), static_cast<off_t>(size_bytes)); }) !=
        0) {
      return PosixErrorToStatus(errno, "truncate", path);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<WritableFile>> NewPrivateWritableFile(
      const std::string& path) override {
    AssertNoCheckedLock("file I/O");
    // O_EXCL fails on anything at `path`, a symbolic link included (never
    // followed with O_CREAT | O_EXCL); O_NOFOLLOW says so once more.
    const int fd = RetryOnEintr([&] {
      return ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    });
    if (fd < 0) return PosixErrorToStatus(errno, "create private file", path);
    return std::make_unique<PosixWritableFile>(path, fd, 0);
  }

  absl::StatusOr<std::unique_ptr<ReadableFile>> NewPrivateReadableFile(
      const std::string& path) override {
    AssertNoCheckedLock("file I/O");
    // O_NONBLOCK: a fifo put here must not hang the open (it is refused
    // below); reads of a regular file ignore the flag.
    const int fd = RetryOnEintr(
        [&] { return ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC); });
    if (fd < 0) {
      const int err = errno;
      // A symbolic link (ELOOP), or a file we may not open (EACCES): say
      // what is there, from lstat, rather than the bare errno.
      struct stat st;
      if (err != ENOENT && ::lstat(path.c_str(), &st) == 0) {
        absl::Status s = CheckPrivateEntry(path, PrivateKind::kFile, st.st_mode, st.st_uid,
                                           st.st_nlink, kNoWriteByOthers);
        if (!s.ok()) return s;
      }
      return PosixErrorToStatus(err, "open private file", path);
    }
    struct stat st;
    absl::Status status;
    if (::fstat(fd, &st) != 0) {
      status = PosixErrorToStatus(errno, "stat", path);
    } else {
      status = CheckPrivateEntry(path, PrivateKind::kFile, st.st_mode, st.st_uid, st.st_nlink,
                                 kNoWriteByOthers);
    }
    if (!status.ok()) {
      ::close(fd);
      return status;
    }
    return std::make_unique<PosixReadableFile>(path, fd, static_cast<uint64_t>(st.st_size));
  }

  absl::StatusOr<uint64_t> FreeSpaceBytes(const std::string& path) override {
    AssertNoCheckedLock("file I/O");
    struct statvfs st;
    if (RetryOnEintr([&] { return ::statvfs(path.c_str(), &st); }) != 0) {
      return PosixErrorToStatus(errno, "statvfs", path);
    }
    return static_cast<uint64_t>(st.f_bavail) * static_cast<uint64_t>(st.f_frsize);
  }
};

}  // namespace

absl::Status PosixErrorToStatus(int error_number, std::string_view operation,
                                std::string_view path) {
  std::string message;
  message.reserve(operation.size() + path.size() + 48);
  message.append(operation).append(" '").append(path).append("': ");
  message.append(ErrnoDescription(error_number));
  return absl::Status(ErrnoToCode(error_number), message);
}

FileSystem* PosixFileSystem() {
  static FileSystem* const fs = new PosixFileSystemImpl();
  return fs;
}

}  // namespace ckpt
