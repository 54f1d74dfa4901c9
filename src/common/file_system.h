// FileSystem: the one way ckpt code touches files and directories.
//
// Modelled on LevelDB's Env. Everything that reads or writes the durable tier
// (rank files, manifest.json, the COMMITTED marker) or any other on-disk state
// goes through a FileSystem*, so that tests can substitute
//   - MemFileSystem (mem_file_system.h): in memory, models what survives a
//     crash (DropUnsyncedData), for deterministic crash-consistency tests;
//   - FaultFileSystem (fault_file_system.h): a decorator over any FileSystem
//     that fails the Nth write or sync, or simulates a full disk.
// PosixFileSystem() below is the real thing.
//
// Paths are plain strings handed to the implementation as is (PosixFileSystem
// resolves relative paths against the working directory; MemFileSystem accepts
// absolute paths only). Names returned by ListDir are single components.
//
// Errors: every call returns absl::Status / absl::StatusOr, never throws, and
// every implementation uses the same codes (PosixFileSystem derives them from
// errno with PosixErrorToStatus below; the others mimic it):
//   NotFound           the path, or a directory on the way to it, does not exist
//   AlreadyExists      CreateDir of an existing path; OpenMode::kCreateNew of one
//   FailedPrecondition wrong kind of object (a directory where a file is needed
//                      or vice versa, a file used as a directory on the way),
//                      directory not empty, handle closed or invalidated
//   ResourceExhausted  no space left (ENOSPC, EDQUOT), too many open files
//   PermissionDenied   EACCES, EPERM
//   InvalidArgument    EINVAL, name too long, bad path
//   Unavailable        I/O error (EIO) and other transient conditions: retry
//   Internal           anything else
// Messages name the operation, the path and the system's description, e.g.
//   open '/ckpt/job/7/rank-00000.bin': No such file or directory
//
// Durability contract (what a crash may lose; MemFileSystem models exactly this):
//   - Data written to a file is durable only after WritableFile::Sync() returns
//     OK. Close() does not sync.
//   - A directory entry (a created, renamed or deleted name) is durable only
//     after SyncDir() of the directory that holds it returns OK. Syncing a file
//     does not make its name durable, and syncing a directory does not sync the
//     files or subdirectories in it.
// Hence the commit protocol WriteStringToFileAtomically() implements: write a
// temporary file, Sync, Close, Rename over the target, SyncDir the parent.
//
// Private files: state that no other user may read or change, such as the
// agent's memory tier (its holding records and incarnation file,
// docs/agent.md "Memory tier"). NewPrivateWritableFile creates one
// exclusively with mode 0600; NewPrivateReadableFile never opens one through
// a symbolic link and checks what it opened (fstat on the descriptor, not
// the path, so a file swapped in after a check is not the one read):
// CheckPrivateEntry below says what passes. WritePrivateFileAtomically and
// ReadPrivateFileToString build on them.
//
// Thread safety: every FileSystem method may be called concurrently from any
// thread. A WritableFile or ReadableFile may also be used from several threads
// at once (e.g. positioned writes of disjoint ranges); see the classes. Files
// must not outlive the FileSystem that opened them. All calls block until the
// operation is done (there is no asynchronous I/O here).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt {

// Views a string's characters as bytes, for the span-taking calls below.
inline std::span<const std::byte> AsBytes(std::string_view s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

// A file open for writing. Obtained from FileSystem::NewWritableFile.
//
// Thread safety: all methods may be called concurrently. Concurrent writes to
// overlapping ranges leave the overlap with either writer's bytes. Append()
// reserves its range atomically, so concurrent Appends never overlap each
// other. Only one WritableFile per path at a time is supported: Size() and
// Append() track this handle's view of the file.
//
// After a failed write, the bytes in the range that was being written are
// unspecified (they may be partly written); the file should be rewritten or
// abandoned. The destructor closes the file if Close() was not called, dropping
// any error: call Close() to learn whether it succeeded.
class WritableFile {
 public:
  WritableFile() = default;
  WritableFile(const WritableFile&) = delete;
  WritableFile& operator=(const WritableFile&) = delete;
  virtual ~WritableFile() = default;

  // Writes `data` at the current end of the file (Size()) and extends it.
  // Short writes and EINTR are retried until all bytes are written or an error
  // occurs. Fails with FailedPrecondition after Close().
  virtual absl::Status Append(std::span<const std::byte> data) = 0;
  absl::Status Append(std::string_view data) { return Append(AsBytes(data)); }

  // Writes `data` at byte `offset`, extending the file if the range ends past
  // Size(); a gap between the old end and `offset` reads back as zeros. Does
  // not move the append position except by extending the file.
  virtual absl::Status PositionedWrite(uint64_t offset, std::span<const std::byte> data) = 0;
  absl::Status PositionedWrite(uint64_t offset, std::string_view data) {
    return PositionedWrite(offset, AsBytes(data));
  }

  // Reserves disk space for the first `size_bytes` bytes of the file without
  // changing Size() (fallocate with FALLOC_FL_KEEP_SIZE), so that later writes
  // in that range cannot fail for lack of space. Fails with ResourceExhausted
  // if the space is not available. Best effort: returns OK without reserving
  // anything on file systems that cannot preallocate (e.g. some NFS servers).
  virtual absl::Status Preallocate(uint64_t size_bytes) = 0;

  // Makes everything written so far durable (fdatasync). Blocks until the
  // device acknowledges. Does not make the file's directory entry durable:
  // see FileSystem::SyncDir.
  virtual absl::Status Sync() = 0;

  // Releases the handle. Does not sync. A second Close() returns OK; every
  // other method fails with FailedPrecondition after Close().
  virtual absl::Status Close() = 0;

  // Current size in bytes as seen through this handle: the size at open
  // (0 for kTruncate / kCreateNew) extended by every write through it.
  virtual uint64_t Size() const = 0;
};

// A file open for reading. Obtained from FileSystem::NewReadableFile.
// Thread safety: all methods may be called concurrently (reads are positioned;
// there is no shared cursor).
class ReadableFile {
 public:
  ReadableFile() = default;
  ReadableFile(const ReadableFile&) = delete;
  ReadableFile& operator=(const ReadableFile&) = delete;
  virtual ~ReadableFile() = default;

  // Reads up to out.size() bytes starting at `offset` into `out` and returns
  // how many were read. Fewer than out.size() only when the end of the file is
  // reached (0 when `offset` is at or past the end); EINTR and short reads are
  // retried. Data written to the file after it was opened is visible.
  virtual absl::StatusOr<size_t> PositionedRead(uint64_t offset, std::span<std::byte> out) = 0;

  // Size of the file when it was opened, in bytes.
  virtual uint64_t Size() const = 0;
};

// How NewWritableFile treats an existing file. Every mode creates a missing
// file (mode 0644 on POSIX); none of them follows with a Sync.
enum class OpenMode {
  kTruncate,   // Existing content is discarded (O_TRUNC).
  kAppend,     // Existing content is kept; Append() continues at its end and
               // PositionedWrite() may overwrite it. (No O_APPEND: positioned
               // writes go where they are told.)
  kCreateNew,  // The file must not exist yet: AlreadyExists if it does (O_EXCL).
};

// What Stat() reports.
struct FileStat {
  uint64_t size_bytes = 0;  // of a regular file; unspecified for a directory
  bool is_directory = false;
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;

  // Opens `path` for writing as `mode` says. The parent directory must exist
  // (NotFound otherwise). FailedPrecondition if `path` is a directory.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                                        OpenMode mode) = 0;

  // Opens an existing regular file for reading. NotFound if it does not exist,
  // FailedPrecondition if it is a directory.
  virtual absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) = 0;

  // Size and kind of whatever is at `path` (symlinks are followed). NotFound if
  // nothing is there.
  virtual absl::StatusOr<FileStat> Stat(const std::string& path) = 0;

  // Whether anything (file or directory) exists at `path`. False when `path`
  // or a directory on the way to it is missing, or a component on the way is
  // a regular file; an error only when the answer cannot be known (e.g.
  // PermissionDenied on a parent directory).
  absl::StatusOr<bool> FileExists(const std::string& path);

  // Size of the regular file at `path`. NotFound if missing,
  // FailedPrecondition if it is a directory.
  absl::StatusOr<uint64_t> GetFileSize(const std::string& path);

  // Names of the entries of directory `path`, sorted bytewise, without "." and
  // "..". NotFound if missing, FailedPrecondition if not a directory.
  virtual absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) = 0;

  // Creates directory `path` (mode 0755). The parent must exist (NotFound);
  // AlreadyExists if anything is at `path` already.
  virtual absl::Status CreateDir(const std::string& path) = 0;

  // Creates `path` and any missing parents (mkdir -p). OK if it already is a
  // directory; FailedPrecondition if it or a component on the way is a file.
  // Safe against concurrent creators of the same directories. Not durable until
  // each new directory's parent is synced.
  virtual absl::Status CreateDirs(const std::string& path) = 0;

  // Removes the file (or symlink) at `path`. NotFound if missing,
  // FailedPrecondition if it is a directory. Open handles keep working on the
  // now nameless file.
  virtual absl::Status DeleteFile(const std::string& path) = 0;

  // Removes the empty directory `path`. NotFound if missing,
  // FailedPrecondition if not empty or not a directory.
  virtual absl::Status DeleteDir(const std::string& path) = 0;

  // Atomically renames `src` to `dst`, replacing `dst` if it is a file (or an
  // empty directory, when `src` is one). NotFound if `src` or `dst`'s parent
  // is missing; FailedPrecondition if a file would replace a directory or vice
  // versa, or `dst` is a non-empty directory; InvalidArgument if `dst` is
  // inside `src`. Open handles follow the file. Durable after SyncDir of both
  // parents.
  virtual absl::Status Rename(const std::string& src, const std::string& dst) = 0;

  // Makes the entries of directory `path` durable (open it, fsync, close):
  // creations, renames and deletions of names in it done before this call
  // survive a crash once it returns OK. NotFound if missing,
  // FailedPrecondition if not a directory.
  virtual absl::Status SyncDir(const std::string& path) = 0;

  // Sets the size of the file at `path`, dropping bytes past `size_bytes` or
  // extending with zeros. Not durable until the file is synced through a
  // handle (open it with OpenMode::kAppend and Sync()). NotFound if missing,
  // FailedPrecondition if a directory.
  virtual absl::Status Truncate(const std::string& path, uint64_t size_bytes) = 0;

  // Bytes available to this (unprivileged) process on the file system holding
  // `path` (statvfs f_bavail * f_frsize). NotFound if `path` does not exist.
  virtual absl::StatusOr<uint64_t> FreeSpaceBytes(const std::string& path) = 0;

  // Creates the private file `path` for writing: it must not exist yet
  // (AlreadyExists if anything is there, a symbolic link included: O_CREAT |
  // O_EXCL | O_NOFOLLOW), and gets mode 0600 (narrower if the umask says
  // so). Otherwise as NewWritableFile(path, OpenMode::kCreateNew). This base
  // implementation fails with Unimplemented: a decorator that does not
  // forward it never skips the checks silently.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> NewPrivateWritableFile(
      const std::string& path);

  // Opens the existing private file `path` for reading, never through a
  // symbolic link (O_NOFOLLOW), and checks the opened file:
  // CheckPrivateEntry(kFile, kNoWriteByOthers). NotFound if missing;
  // FailedPrecondition with CheckPrivateEntry's message (path, owner uid,
  // mode, what to remove) if it fails the check, is a symbolic link or not a
  // regular file; otherwise as NewReadableFile. This base implementation
  // fails with Unimplemented.
  virtual absl::StatusOr<std::unique_ptr<ReadableFile>> NewPrivateReadableFile(
      const std::string& path);
};

// The process-wide file system on the real POSIX API. Stateless; safe to use
// from any thread; never destroyed (do not delete it).
FileSystem* PosixFileSystem();

// Maps an errno value to a Status with the codes listed at the top of this
// file and the message "<operation> '<path>': <strerror>". Also used by the
// in-memory file systems so that their errors read the same.
absl::Status PosixErrorToStatus(int error_number, std::string_view operation,
                                std::string_view path);

// Reads the whole file at `path`. Errors as NewReadableFile / PositionedRead.
absl::StatusOr<std::string> ReadFileToString(FileSystem* fs, const std::string& path);

// Temporary files written by WriteStringToFileAtomically and
// WritePrivateFileAtomically are named "<path><kAtomicWriteTempInfix><16 hex
// digits>", the digits random (getrandom), so no one can guess a name and
// put something there first (the file is created exclusively anyway). A
// crash may leave them behind: readers skip names containing this and
// cleanup may delete them.
inline constexpr std::string_view kAtomicWriteTempInfix = ".tmp-";

// Replaces the file at `path` with `data` so that after a crash `path` holds
// either its old content (or nothing, if it did not exist) or all of `data`,
// never a mix: writes a temporary file in the same directory, Syncs and Closes
// it, Renames it over `path`, then SyncDirs the parent. The parent directory
// must exist. On an error before the rename the temporary file is deleted and
// `path` is untouched. If only the final SyncDir fails, `path` already holds
// `data` but may not survive a crash: repeating the call is safe.
absl::Status WriteStringToFileAtomically(FileSystem* fs, const std::string& path,
                                         std::string_view data);

// Replaces `path` with `data` exactly as WriteStringToFileAtomically does,
// but the temporary file is made by NewPrivateWritableFile, so the file that
// takes `path`'s place is private (mode 0600, this process's user) and was
// created by this call (no one can have it open already). Errors as
// WriteStringToFileAtomically; on an error before the rename `path` is
// untouched and the temporary file deleted.
absl::Status WritePrivateFileAtomically(FileSystem* fs, const std::string& path,
                                        std::string_view data);

// Reads the whole private file `path` (NewPrivateReadableFile's checks).
absl::StatusOr<std::string> ReadPrivateFileToString(FileSystem* fs, const std::string& path);

// What may be trusted as a private file or directory, judged from what
// lstat or fstat reported of it: `st_mode` (type and permission bits), the
// owner's uid and the number of links. It must be of kind `kind` (a symbolic
// link never is), owned by this process's effective uid (root included: root
// trusts only its own files here), have none of the permission bits
// `forbidden_permissions`, and, a file, one link only (a second name could
// be in someone else's hands). OK, or FailedPrecondition with a message
// naming `path`, its owner uid and mode, what is wrong and what to remove,
// e.g.
//   '/dev/shm/ckpt-n0/pool.bin' belongs to uid 65534 (mode 0666), not to
//   this process's user (uid 0): that user can read and change what is kept
//   in it; remove it (rm '/dev/shm/ckpt-n0/pool.bin')
enum class PrivateKind { kFile, kDirectory };
// Nothing for group or others (a file at most 0600, a directory 0700).
inline constexpr uint32_t kNoAccessByOthers = 0077;
// Group and others may read (and search) but never write.
inline constexpr uint32_t kNoWriteByOthers = 0022;
absl::Status CheckPrivateEntry(const std::string& path, PrivateKind kind, uint32_t st_mode,
                               uint32_t owner_uid, uint64_t links, uint32_t forbidden_permissions);

// Deletes `path` and, if it is a directory, everything below it (rm -rf).
// Symbolic links are removed, never followed. OK if `path` does not exist.
// Not durable: sync the parent afterwards if it must be. Not atomic: on
// error, part of the tree may be gone.
absl::Status DeleteRecursively(FileSystem* fs, const std::string& path);

}  // namespace ckpt
