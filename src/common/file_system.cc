// Helpers built only on the FileSystem interface, so they behave the same on
// every implementation (and can be crash-tested on MemFileSystem).
#include "common/file_system.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <string>
#include <utility>

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

// A name for a temporary file next to `path`, unique within this process (the
// sequence) and across processes on one host (the pid). kCreateNew guards
// against anything else.
std::string TempPathFor(const std::string& path) {
  static std::atomic<uint64_t> sequence{0};
  return path + std::string(kAtomicWriteTempInfix) + std::to_string(::getpid()) + "-" +
         std::to_string(sequence.fetch_add(1, std::memory_order_relaxed));
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

absl::Status WriteStringToFileAtomically(FileSystem* fs, const std::string& path,
                                         std::string_view data) {
  const std::string temp = TempPathFor(path);
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                        fs->NewWritableFile(temp, OpenMode::kCreateNew));
  absl::Status status = file->Append(data);
  if (status.ok()) status = file->Sync();
  absl::Status closed = file->Close();
  if (status.ok()) status = closed;
  if (!status.ok()) return CleanUpTemp(fs, temp, std::move(status));
  status = fs->Rename(temp, path);
  if (!status.ok()) return CleanUpTemp(fs, temp, std::move(status));
  return fs->SyncDir(Dirname(path));
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
