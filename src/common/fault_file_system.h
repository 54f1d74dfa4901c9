// FaultFileSystem: a FileSystem decorator that injects write and sync failures
// and simulates a full disk, for deterministic failure tests (after LevelDB's
// db/fault_injection_test.cc and Mooncake's fault proxy transport). Code under
// test takes a FileSystem* and cannot tell it apart from the real one.
//
// Everything forwards to the base FileSystem except:
//   - Writes: every WritableFile::Append / PositionedWrite on a file opened
//     through this decorator is one write. It fails, without reaching the base
//     (nothing is written), when FailAllWrites(true) is set, when it is the
//     write armed by FailNthWrite, or when it would take more space than the
//     capacity allows (SetCapacityBytes). Injected failures have the code
//     given (default Unavailable, as EIO maps) and a message
//       "write '/d/f': injected fault (write #3)"
//     capacity failures are ResourceExhausted, exactly as ENOSPC maps:
//       "write '/d/f': No space left on device".
//   - Syncs: every WritableFile::Sync and FileSystem::SyncDir is one sync,
//     failed likewise by FailAllSyncs / FailNthSync without reaching the base.
//     Over a MemFileSystem, data whose sync failed is therefore still unsynced
//     and lost by DropUnsyncedData(), as after a real failed fsync.
// Counters include failed calls. Reads, Close and directory operations are
// never failed (they still report the base's own errors).
//
// Capacity model: used bytes are the sum, over files this decorator created or
// opened for writing (kAppend counts their size at open) and that still exist
// under the path they were last given here, of each file's size, or of its
// preallocated size if larger. Writes that extend a file, Preallocate and
// Truncate that grows it take space; overwriting existing bytes takes none;
// DeleteFile, a shrinking Truncate, reopening with kTruncate and a Rename over
// another tracked file free space. Files written around the decorator are not
// counted. FreeSpaceBytes() reports min(base's answer, capacity - used).
// Paths are compared as strings: use one spelling per file.
//
// Thread safety: all methods, and the handles' methods, may be called
// concurrently. The decorator and its base must outlive every handle opened
// through it; the base is not owned.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
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

class FaultFileSystem : public FileSystem {
 public:
  // SetCapacityBytes(kUnlimitedCapacity) removes the limit (the default).
  static constexpr uint64_t kUnlimitedCapacity = std::numeric_limits<uint64_t>::max();

  // `base` is not owned and must outlive this object and its handles.
  explicit FaultFileSystem(FileSystem* base);

  // Fault controls. Each takes effect for calls that start after it returns.

  // The n-th write from now (1 = the next one) fails with `code`; later writes
  // succeed again. n <= 0 disarms. A new call replaces the previous arming.
  void FailNthWrite(int64_t n, absl::StatusCode code = absl::StatusCode::kUnavailable);
  // The n-th sync (file Sync or SyncDir) from now fails with `code`, as above.
  void FailNthSync(int64_t n, absl::StatusCode code = absl::StatusCode::kUnavailable);
  // While true, every write (sync) fails with Unavailable.
  void FailAllWrites(bool fail);
  void FailAllSyncs(bool fail);
  // Simulates a disk of `capacity_bytes` (see the capacity model above). Does
  // not affect files already larger; only growth beyond it fails.
  void SetCapacityBytes(uint64_t capacity_bytes);
  // Clears every fault above and both counters, and removes the capacity
  // limit. The record of file sizes (UsedBytes) is kept.
  void Reset();

  // Writes and syncs issued through this decorator since construction or
  // Reset(), including the ones that failed.
  int64_t WritesIssued() const;
  int64_t SyncsIssued() const;
  // Bytes counted against the capacity (see above).
  uint64_t UsedBytes() const;

  // FileSystem.
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
  // Forwarded to the base; a private file's writes and syncs are counted and
  // failed like any other's, and it takes space as a kCreateNew file does.
  absl::StatusOr<std::unique_ptr<WritableFile>> NewPrivateWritableFile(
      const std::string& path) override;
  absl::StatusOr<std::unique_ptr<ReadableFile>> NewPrivateReadableFile(
      const std::string& path) override;

 private:
  class FaultWritableFile;

  // Space accounted to one file, shared by its path entry and its handles.
  struct Usage;

  // Wraps a file the base opened at `path` (as `mode`) so that its writes
  // and syncs are counted, failed and accounted.
  std::unique_ptr<WritableFile> Track(std::unique_ptr<WritableFile> file, const std::string& path,
                                      OpenMode mode);
  // Counts a write or sync and returns the injected failure, if any.
  absl::Status CountWriteLocked(const std::string& path) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CountSyncLocked(const std::string& path) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets `usage` to `resized` if the growth (if any) fits the capacity, else
  // fails like ENOSPC and leaves `usage` unchanged.
  absl::Status ResizeLocked(Usage& usage, const Usage& resized, std::string_view operation,
                            const std::string& path) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t UsedBytesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  FileSystem* const base_;

  mutable absl::Mutex mu_;
  int64_t writes_issued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t syncs_issued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t fail_write_at_ ABSL_GUARDED_BY(mu_) = 0;  // writes_issued_ value to fail; 0: none
  int64_t fail_sync_at_ ABSL_GUARDED_BY(mu_) = 0;
  absl::StatusCode fail_write_code_ ABSL_GUARDED_BY(mu_) = absl::StatusCode::kUnavailable;
  absl::StatusCode fail_sync_code_ ABSL_GUARDED_BY(mu_) = absl::StatusCode::kUnavailable;
  bool fail_all_writes_ ABSL_GUARDED_BY(mu_) = false;
  bool fail_all_syncs_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t capacity_bytes_ ABSL_GUARDED_BY(mu_) = kUnlimitedCapacity;
  // Files counted against the capacity, by path.
  std::map<std::string, std::shared_ptr<Usage>> files_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt
