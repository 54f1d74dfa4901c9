// PowerCutFileSystem: a RocksDB file system for tests that simulates a power
// cut: everything written but not synced is lost.
//
// It forwards every call to a real file system (writes go to the real files at
// once, so reads see them) and remembers what a power cut would keep:
//   - per file, the length at its last Sync/Fsync (RangeSync, Flush and Close
//     make nothing durable, as with RocksDB's FaultInjectionTestFS);
//   - per directory entry created, deleted or renamed since the directory's
//     last Fsync, what the entry held durably before (a file's synced bytes,
//     or nothing): such a change is undone by a cut.
// Files not written through it since the last Cut() are durable as they are.
//
// A test runs the database on it, then cuts the power at some point:
//   PowerOff()          at once, or
//   PowerOffAtSync(n)   when the n-th file sync from now starts (it fails);
// from then on every change (append, sync, create, delete, rename, directory
// sync) fails with an I/O error, as nothing reaches the disk any more. The test
// then closes or abandons the database (its last writes fail), calls Cut(),
// which truncates each file to its synced length, undoes the directory changes
// not synced and turns the power back on, and reopens the database on it.
//
// Not modelled: files written through NewRandomRWFile (RocksDB uses them only
// for features the meta store does not use); ReuseWritableFile (WAL recycling)
// is refused; directories themselves are durable.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "rocksdb/file_system.h"

namespace ckpt::meta {

class PowerCutFileSystem : public rocksdb::FileSystemWrapper {
 public:
  explicit PowerCutFileSystem(
      const std::shared_ptr<rocksdb::FileSystem>& base = rocksdb::FileSystem::Default());

  const char* Name() const override { return "PowerCutFileSystem"; }

  // The power goes off now.
  void PowerOff();
  // The power goes off when the n-th (n >= 1) file Sync/Fsync from now of a
  // file whose name ends with `suffix` starts; that sync fails. 0 disarms.
  void PowerOffAtSync(uint64_t n, std::string suffix = "");
  bool powered() const;

  // Drops every change not synced (see above) and turns the power back on.
  // Call it after the database is closed or abandoned: no file may be open
  // for writing. Errors come from the real file system.
  absl::Status Cut();

  // Syncs (Sync/Fsync) that succeeded of files whose name ends with `suffix`
  // (RocksDB's WAL files end with ".log"), since this object was made.
  uint64_t syncs(const std::string& suffix = "") const;

  // --- rocksdb::FileSystem ---
  rocksdb::IOStatus NewWritableFile(const std::string& fname, const rocksdb::FileOptions& options,
                                    std::unique_ptr<rocksdb::FSWritableFile>* result,
                                    rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus ReopenWritableFile(const std::string& fname,
                                       const rocksdb::FileOptions& options,
                                       std::unique_ptr<rocksdb::FSWritableFile>* result,
                                       rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus ReuseWritableFile(const std::string& fname, const std::string& old_fname,
                                      const rocksdb::FileOptions& options,
                                      std::unique_ptr<rocksdb::FSWritableFile>* result,
                                      rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus NewDirectory(const std::string& name, const rocksdb::IOOptions& options,
                                 std::unique_ptr<rocksdb::FSDirectory>* result,
                                 rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus DeleteFile(const std::string& fname, const rocksdb::IOOptions& options,
                               rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus RenameFile(const std::string& src, const std::string& target,
                               const rocksdb::IOOptions& options,
                               rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus LinkFile(const std::string& src, const std::string& target,
                             const rocksdb::IOOptions& options,
                             rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus Truncate(const std::string& fname, size_t size,
                             const rocksdb::IOOptions& options,
                             rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus CreateDir(const std::string& dirname, const rocksdb::IOOptions& options,
                              rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus CreateDirIfMissing(const std::string& dirname,
                                       const rocksdb::IOOptions& options,
                                       rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus DeleteDir(const std::string& dirname, const rocksdb::IOOptions& options,
                              rocksdb::IODebugContext* dbg) override;

  // --- called by the files and directories it hands out ---
  struct Inode {
    uint64_t size = 0;    // bytes written
    uint64_t synced = 0;  // bytes durable (a prefix)
  };
  // An error if the power is off (`what` names the call).
  rocksdb::IOStatus CheckPower(const char* what) const;
  // Called before a file sync: counts it against PowerOffAtSync and fails if
  // the power is (or now goes) off.
  rocksdb::IOStatus BeforeSync(const std::string& fname);
  void Appended(Inode* inode, uint64_t end);
  void Truncated(Inode* inode, uint64_t size);
  void Synced(Inode* inode, const std::string& fname);
  void DirSynced(const std::string& dir);

 private:
  // A directory entry changed since its directory was last synced.
  struct Entry {
    std::shared_ptr<Inode> inode;       // the file now there (null: none)
    bool durable = true;                // the entry itself survives a cut
    std::optional<std::string> prior;   // if !durable: what a cut restores
  };

  // The entry for `path`, made for a file not seen before (durable as it is on
  // disk: size and synced are its current size).
  Entry& EntryFor(const std::string& path) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks `path`'s entry as changing: its durable content is kept as `prior`.
  void Changing(const std::string& path) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Opens `fname` for writing: truncated (NewWritableFile) or appended to
  // (ReopenWritableFile).
  rocksdb::IOStatus OpenWritable(const std::string& fname, const rocksdb::FileOptions& options,
                                 bool truncate, std::unique_ptr<rocksdb::FSWritableFile>* result,
                                 rocksdb::IODebugContext* dbg);

  mutable absl::Mutex mu_;
  bool powered_ ABSL_GUARDED_BY(mu_) = true;
  uint64_t off_at_sync_ ABSL_GUARDED_BY(mu_) = 0;  // 0: not armed
  std::string off_at_sync_suffix_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);  // by normalised path
  std::map<std::string, uint64_t> syncs_ ABSL_GUARDED_BY(mu_); // by path
};

}  // namespace ckpt::meta
