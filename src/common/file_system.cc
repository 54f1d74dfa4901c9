// Helpers built only on the FileSystem interface, so they behave the same on
// every implementation (and can be crash-tested on MemFileSystem).
#include "common/file_system.h"

#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace ckpt {
namespace {

// The directory holding `path`: "." for a bare name, "/" for "/name".
std::string Dirname(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (!dir.empty() && dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

// 64 random bits from the kernel. Should getrandom fail (a kernel without
// it), a mix of the pid, a sequence and the clock: names are then unique but
// guessable, and the exclusive create still refuses whatever is there.
uint64_t RandomTempBits() {
  uint64_t v = 0;
  size_t got = 0;
  while (got < sizeof(v)) {
    const ssize_t n = ::getrandom(reinterpret_cast<char*>(&v) + got, sizeof(v) - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      static std::atomic<uint64_t> sequence{0};
      const uint64_t now = static_cast<uint64_t>(
          std::chrono::steady_clock::now().time_since_epoch().count());
      return (static_cast<uint64_t>(::getpid()) << 40) ^ (sequence.fetch_add(1) << 20) ^ now;
    }
  }
  return v;
}

// A name for a temporary file next to `path` that no one can guess (so no one
// can put something there first). The exclusive create guards against a
// collision anyway.
std::string TempPathFor(const std::string& path) {
  return absl::StrCat(path, std::string(kAtomicWriteTempInfix), absl::Hex(RandomTempBits(), absl::kZeroPad16));
}

// Deletes the temporary file after `error`; a failure to delete is reported in
// the returned message rather than dropped.
absl::Status CleanUpTemp(FileSystem* fs, const std::string& temp, absl::Status error) {
  absl::Status deleted = fs->DeleteFile(temp);
  if (deleted.ok() || absl::IsNotFound(deleted)) return error;
  return absl::Status(error.code(), std::string(error.message()) +
                                        " (and the temporary file was left behind: " +
                                        std::string(deleted.message()) + ")");
}

// Writes `data` to the open temporary `file`, syncs and closes it, renames it
// over `path` and syncs the parent: the commit protocol of the atomic writers.
absl::Status CommitTemp(FileSystem* fs, std::unique_ptr<WritableFile> file, const std::string& temp,
                        const std::string& path, std::string_view data) {
  absl::Status status = file->Append(data);
  if (status.ok()) status = file->Sync();
  absl::Status closed = file->Close();
  if (status.ok()) status = closed;
  if (!status.ok()) return CleanUpTemp(fs, temp, std::move(status));
  status = fs->Rename(temp, path);
  if (!status.ok()) return CleanUpTemp(fs, temp, std::move(status));
  return fs->SyncDir(Dirname(path));
}

// "0644"
std::string Octal(uint32_t mode) { return absl::StrFormat("%04o", mode & 07777); }

const char* KindOf(uint32_t st_mode) {
  if (S_ISREG(st_mode)) return "a regular file";
  if (S_ISDIR(st_mode)) return "a directory";
  if (S_ISLNK(st_mode)) return "a symbolic link";
  if (S_ISFIFO(st_mode)) return "a fifo";
  if (S_ISSOCK(st_mode)) return "a socket";
  if (S_ISCHR(st_mode) || S_ISBLK(st_mode)) return "a device";
  return "of an unknown kind";
}

// The whole of `file`, from offset 0.
absl::StatusOr<std::string> ReadAll(ReadableFile* file) {
  // Read Size() bytes, then keep going in case the file grew since it was
  // opened: only a short read proves we reached the end.
  constexpr size_t kProbeBytes = 64 << 10;
  std::string out(static_cast<size_t>(file->Size()), '\0');
  size_t filled = 0;
  for (;;) {
    if (filled == out.size()) out.resize(out.size() + kProbeBytes);
    std::span<std::byte> rest = std::as_writable_bytes(std::span<char>(out)).subspan(filled);
    CKPT_ASSIGN_OR_RETURN(size_t n, file->PositionedRead(filled, rest));
    filled += n;
    if (n < rest.size()) break;
  }
  out.resize(filled);
  return out;
}

}  // namespace

absl::StatusOr<bool> FileSystem::FileExists(const std::string& path) {
  absl::StatusOr<FileStat> stat = Stat(path);
  if (stat.ok()) return true;
  // FailedPrecondition from Stat means a component on the way is a file.
  if (absl::IsNotFound(stat.status()) || absl::IsFailedPrecondition(stat.status())) return false;
  return stat.status();
}

absl::StatusOr<uint64_t> FileSystem::GetFileSize(const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(FileStat stat, Stat(path));
  if (stat.is_directory) return PosixErrorToStatus(EISDIR, "get size of", path);
  return stat.size_bytes;
}

absl::StatusOr<std::string> ReadFileToString(FileSystem* fs, const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, fs->NewReadableFile(path));
  return ReadAll(file.get());
}

absl::Status WriteStringToFileAtomically(FileSystem* fs, const std::string& path,
                                         std::string_view data) {
  const std::string temp = TempPathFor(path);
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                        fs->NewWritableFile(temp, OpenMode::kCreateNew));
  return CommitTemp(fs, std::move(file), temp, path, data);
}

absl::Status WritePrivateFileAtomically(FileSystem* fs, const std::string& path,
                                        std::string_view data) {
  const std::string temp = TempPathFor(path);
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, fs->NewPrivateWritableFile(temp));
  return CommitTemp(fs, std::move(file), temp, path, data);
}

absl::StatusOr<std::string> ReadPrivateFileToString(FileSystem* fs, const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, fs->NewPrivateReadableFile(path));
  return ReadAll(file.get());
}

absl::StatusOr<std::unique_ptr<WritableFile>> FileSystem::NewPrivateWritableFile(
    const std::string& path) {
  return absl::UnimplementedError(
      absl::StrCat("create private file '", path, "': not supported by this file system"));
}

absl::StatusOr<std::unique_ptr<ReadableFile>> FileSystem::NewPrivateReadableFile(
    const std::string& path) {
  return absl::UnimplementedError(
      absl::StrCat("open private file '", path, "': not supported by this file system"));
}

absl::Status CheckPrivateEntry(const std::string& path, PrivateKind kind, uint32_t st_mode,
                               uint32_t owner_uid, uint64_t links, uint32_t forbidden_permissions) {
  const bool dir = kind == PrivateKind::kDirectory;
  const std::string facts = absl::StrCat("owner uid ", owner_uid, ", mode ", Octal(st_mode));
  const std::string remove =
      absl::StrCat("remove it (", dir && S_ISDIR(st_mode) ? "rm -r '" : "rm '", path, "')");
  const uid_t me = ::geteuid();
  if (S_ISLNK(st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "'", path, "' (", facts, ") is a symbolic link, which is never followed here; ", remove));
  }
  if (dir ? !S_ISDIR(st_mode) : !S_ISREG(st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("'", path, "' (", facts, ") is ",
                                                      KindOf(st_mode), ", not ",
                                                      dir ? "a directory" : "a regular file", "; ",
                                                      remove));
  }
  if (owner_uid != me) {
    return absl::FailedPreconditionError(absl::StrCat(
        "'", path, "' belongs to uid ", owner_uid, " (mode ", Octal(st_mode),
        "), not to this process's user (uid ", me, "): that user can read and change what is ",
        dir ? "kept in it" : "in it", "; ", remove));
  }
  if ((st_mode & forbidden_permissions) != 0) {
    const bool writable = (st_mode & forbidden_permissions & 0022) != 0;
    return absl::FailedPreconditionError(absl::StrCat(
        "'", path, "' (", facts, ") is ",
        writable ? "writable by other users" : "open to other users", " (at most ",
        Octal((dir ? 0777 : 0666) & ~forbidden_permissions), " is allowed): ",
        dir ? "they may have put or replaced files in it"
            : writable ? "one of them may have changed it or hold it open"
                       : "one of them may hold it open",
        "; ", remove));
  }
  if (!dir && links != 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", path, "' (", facts, ") has ", links,
                     " hard links: another name for it may be in someone else's hands; ", remove));
  }
  return absl::OkStatus();
}

absl::Status DeleteRecursively(FileSystem* fs, const std::string& path) {
  // Try it as a file first: unlink removes a symlink itself, so a link to a
  // directory is never followed (Stat would follow it). It fails with
  // FailedPrecondition (EISDIR) for a real directory. NotFound anywhere on the
  // way down means someone else deleted it: that counts as done.
  absl::Status deleted = fs->DeleteFile(path);
  if (deleted.ok() || absl::IsNotFound(deleted)) return absl::OkStatus();
  if (!absl::IsFailedPrecondition(deleted)) return deleted;
  absl::StatusOr<std::vector<std::string>> names = fs->ListDir(path);
  if (absl::IsNotFound(names.status())) return absl::OkStatus();
  // Not a directory after all (e.g. a file under a path that is not a
  // directory): report the original error.
  if (absl::IsFailedPrecondition(names.status())) return deleted;
  CKPT_RETURN_IF_ERROR(names);
  for (const std::string& name : *names) {
    CKPT_RETURN_IF_ERROR(DeleteRecursively(fs, JoinPath(path, name)));
  }
  deleted = fs->DeleteDir(path);
  return absl::IsNotFound(deleted) ? absl::OkStatus() : deleted;
}

}  // namespace ckpt
