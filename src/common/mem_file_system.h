// MemFileSystem: an in-memory FileSystem for unit tests that models what a
// crash keeps (after LevelDB's helpers/memenv and db/fault_injection_test.cc).
//
// It behaves like PosixFileSystem on Linux for everything in file_system.h:
// same status codes and messages, open handles follow renames and outlive
// unlinks, kTruncate keeps the file's identity, holes read as zeros.
//
// Durability model. Besides the live tree, MemFileSystem keeps what the
// durability contract in file_system.h says is on "disk":
//   - per file: its content as of the last successful WritableFile::Sync()
//     (empty if never synced);
//   - per directory: its set of entries (name -> file or directory) as of the
//     last successful SyncDir() of that directory (empty if never synced; the
//     root "/" is synced at construction).
// DropUnsyncedData() simulates a power loss: starting from "/", every
// directory's entries revert to their synced set, recursively through the
// directories that remain, and every file that remains reverts to its synced
// content. So:
//   - bytes written (or truncated away) since the file's last Sync are lost;
//   - a name created, renamed or deleted since its directory's last SyncDir is
//     undone, whether or not the file itself was synced: a new, synced file
//     whose directory was never synced disappears; a deleted file comes back;
//   - a new directory disappears with everything in it unless its parent was
//     synced after it was created (syncing the new directory alone is not
//     enough), exactly like a new file.
// Each directory reverts independently, so a rename between two directories
// of which only one was synced may come back as both names (sharing one
// file, like a hard link) or as neither. If the synced sets would give a
// directory two names (only possible after such renames of directories), the
// first one in breadth-first, name order is kept. What is not modelled: torn
// writes (a synced prefix of unsynced data, or a partly applied write),
// reordering that real file systems may allow beyond the rules above, sizes
// and timestamps beyond content, permissions, symlinks and hard links, and
// capacity (see FaultFileSystem for a full disk).
//
// DropUnsyncedData() also invalidates every handle opened before it (the
// process that held them "died"): their methods then fail with
// FailedPrecondition (Close() returns OK). Open new handles after a crash.
//
// Paths must be absolute ("/a/b"); repeated slashes, a trailing slash and "."
// components are ignored, ".." components and relative paths are
// InvalidArgument. FreeSpaceBytes() reports kMemFreeSpaceBytes for any
// existing path.
//
// Thread safety: every method of the file system and of its handles may be
// called concurrently; one mutex serialises them all (it is a test double).
// Handles must not outlive the MemFileSystem.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/file_system.h"

namespace ckpt {
namespace mem_fs_internal {
struct Node;  // a file or directory; defined in mem_file_system.cc
}  // namespace mem_fs_internal

class MemFileSystem : public FileSystem {
 public:
  // What FreeSpaceBytes() reports: effectively unlimited (1 PiB).
  static constexpr uint64_t kMemFreeSpaceBytes = uint64_t{1} << 50;

  // An empty file system holding only the (synced) root directory "/".
  MemFileSystem();
  ~MemFileSystem() override;

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                                OpenMode mode) override;
  absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override;
  absl::StatusOr<FileStat> Stat(const std::string& path) override;
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override;
  absl::Status CreateDir(const std::string& path) override;
  absl::Status CreateDirs(const std::string& path) override;
  absl::Status DeleteFile(const std::string& path) override;
  absl::Status DeleteDir(const std::string& path) override;
  absl::Status Rename(const std::string& src, const std::string& dst) override;
  absl::Status SyncDir(const std::string& path) override;
  absl::Status Truncate(const std::string& path, uint64_t size_bytes) override;
  absl::StatusOr<uint64_t> FreeSpaceBytes(const std::string& path) override;
  // Every file here is this process's user's, with one name and no links to
  // follow: a private file is a file created exclusively (kCreateNew) and
  // read as any other.
  absl::StatusOr<std::unique_ptr<WritableFile>> NewPrivateWritableFile(
      const std::string& path) override;
  absl::StatusOr<std::unique_ptr<ReadableFile>> NewPrivateReadableFile(
      const std::string& path) override;

  // Simulates a crash: reverts to what was durable, as described at the top of
  // this file, and invalidates every open handle. Never fails.
  void DropUnsyncedData();

 private:
  class MemWritableFile;  // the handles, defined in mem_file_system.cc
  class MemReadableFile;

  using Node = mem_fs_internal::Node;

  // Guards the whole tree: this class's members, every Node's fields and
  // every handle's state (thread-safety analysis cannot name a mutex held
  // through another object, so the Node fields are not annotated).
  mutable absl::Mutex mu_;
  std::shared_ptr<Node> root_ ABSL_GUARDED_BY(mu_);
  // Every directory ever created, to break reference cycles between synced
  // entry sets on destruction.
  std::vector<std::weak_ptr<Node>> all_dirs_ ABSL_GUARDED_BY(mu_);
  // Incremented by DropUnsyncedData(); handles remember the value at open.
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt
