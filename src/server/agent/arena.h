// Arena: the agent's memory tier, a pre-allocated pool on a tmpfs, and
// Reservation, the one owner of pool space.
//
// Shard bytes live in one file, `<memory-dir>/pool.bin`, sized to the agent's
// memory budget, allocated (fallocate) and mapped with MAP_POPULATE when the
// arena opens, so a save never pays for page faults or allocation: clients map
// the same file (MAP_SHARED) and copy straight into it. Because the file lives
// on a tmpfs owned by the agent, its bytes outlive both the trainer and the
// agent process; they are lost only with the machine.
//
// Space is handed out in 4 KiB pages as a Reservation: a list of extents
// (first fit, several extents when no single hole is large enough) that is
// returned to the free list when the Reservation is destroyed. Reservations
// are shared (std::shared_ptr) by everything that may still touch their
// bytes: the holding that keeps them, an open client handle, a read or push
// whose data may still land, a parity fold in progress. So pool space is freed
// exactly when the last of those lets go, never earlier; nothing else in the
// agent frees pool space.
//
// The tier is the agent's alone (docs/agent.md "Memory tier"): Open creates
// `<memory-dir>` and `records/` with mode 0700 and the pool with 0600, and
// opens nothing through a symbolic link. What it finds already there it
// checks on the opened descriptor (fstat): both directories must be the
// agent's user's (its effective uid, root too) and writable by no one else
// (one of its own that others may only read, as an earlier version left
// them, is narrowed to 0700); the pool must be the agent's, a regular file
// with one link and mode 0600 or narrower: someone else may hold open a
// pool that was ever open to them, and would read every shard saved into
// it. Anything else stops Open with FailedPrecondition naming the path, its
// owner uid and mode, and what to remove (CheckPrivateEntry).
//
// Every holding has a record file in `<memory-dir>/records/` (binary, format
// in docs/agent.md "Records"), a private file written through the
// FileSystem given in Options (WritePrivateFileAtomically: an exclusively
// created temporary file of mode 0600, synced and renamed, so a record is
// either whole or absent; each write gets a new file name, so writing and
// removing records needs no lock).
// On Open() after a restart, the newest record of each holding whose extents
// lie inside the pool, do not overlap, and still hash to its crc32c is
// re-adopted; the others are returned as lost (and their records removed),
// and all space not covered by an adopted record is free again.
//
// One agent per memory directory: Open() takes an exclusive flock on the
// directory (never on the pool, whose descriptor clients hold) for the arena's
// lifetime, so a second agent on the same tier is refused instead of sharing
// the pool, and the lock ends with the process (kill -9 included). Holding it
// is also how a restarted agent proves to meta that the node it names is the
// one whose tier it read (docs/meta.md "Registration").
//
// Thread safety: all methods are safe to call concurrently. The bytes of a
// reservation are not protected by the arena's lock: its owners coordinate.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/file_system.h"
#include "server/agent/types.h"
#include "transport/transport.h"

namespace ckpt::agent {

class Arena;

// Pool space owned by whoever holds the (shared) pointer; freed on
// destruction. Immutable once made, except Trim before it is shared.
class Reservation {
 public:
  ~Reservation();
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

  const std::vector<Extent>& extents() const { return extents_; }
  // Bytes reserved (whole pages).
  uint64_t reserved_bytes() const { return reserved_; }

  // Gather lists over [offset, offset + length) of the reservation's bytes
  // (clamped to what is reserved), in order.
  transport::ConstPieces Pieces(uint64_t offset, uint64_t length) const;
  transport::MutablePieces MutablePieces(uint64_t offset, uint64_t length) const;
  // CRC-32C of [offset, offset + length).
  uint32_t Crc(uint64_t offset, uint64_t length) const;
  // Copies [offset, offset + out.size()) out / `in` to [offset, ...).
  void CopyOut(uint64_t offset, std::span<std::byte> out) const;
  void CopyIn(uint64_t offset, std::span<const std::byte> in) const;
  void Zero(uint64_t offset, uint64_t length) const;

  // The extents that would remain after Trim(size_bytes).
  std::vector<Extent> TrimmedExtents(uint64_t size_bytes) const;
  // Returns the pages past `size_bytes` to the arena. Only while no other
  // thread reads this reservation's extents.
  void Trim(uint64_t size_bytes);

 private:
  friend class Arena;
  Reservation(Arena* arena, std::vector<Extent> extents);
  Arena* const arena_;
  std::vector<Extent> extents_;
  uint64_t reserved_ = 0;
};
using ReservationPtr = std::shared_ptr<Reservation>;

// A record found on Open() whose bytes no longer match (or whose record was
// unreadable): the holding is gone.
struct LostHolding {
  ShardId id;        // empty job_id if the record itself was unreadable
  std::string file;  // record file name
  std::string reason;
};

// A holding re-adopted by Open(), with the space it owns.
struct AdoptedHolding {
  ShardRecord record;
  ReservationPtr bytes;
};

class Arena {
 public:
  struct Options {
    std::string dir;              // the memory directory (created 0700 if missing)
    uint64_t capacity_bytes = 0;  // rounded up to a page
    bool populate = true;         // fallocate + MAP_POPULATE now (tests may skip)
    // Reads, writes and removes the records. Not owned; nullptr:
    // PosixFileSystem(). It must see the real `dir` (the pool next to the
    // records is mapped from there): PosixFileSystem or a decorator over it,
    // such as FaultFileSystem.
    FileSystem* fs = nullptr;
  };

  // Opens (creating if needed) the pool and re-adopts committed holdings.
  // Fails with InvalidArgument for a zero capacity, FailedPrecondition if the
  // directory, records/, the pool or a record is not the agent's own (see
  // above: the message says what to remove) or another process holds the
  // directory's lock (another agent on the same tier), ResourceExhausted if the tmpfs
  // cannot hold the pool (the message says how much it has), or the
  // underlying I/O error. Blocks while pre-faulting (about 0.1 s per GiB).
  static absl::StatusOr<std::unique_ptr<Arena>> Open(const Options& options);
  // Every Reservation must be gone first (logged as an error otherwise).
  ~Arena();

  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Reserves `size_bytes` (rounded up to pages; 0 reserves one page).
  // ResourceExhausted if the free space is smaller (the caller adds context),
  // also for sizes near 2^64.
  absl::StatusOr<ReservationPtr> Reserve(uint64_t size_bytes);

  // Writes `record`'s file atomically (WritePrivateFileAtomically) under a
  // new name, which it stores in record->file, and gives it the next sequence
  // number. The previous file (if any) is left for the caller to remove.
  // Errors from the file system are returned as they are, and leave every
  // existing record as it was. No lock held during the I/O.
  absl::Status WriteRecord(ShardRecord* record);
  // Removes a record file by name; OK if it is already gone or `file` is "".
  absl::Status RemoveRecord(const std::string& file);

  // Holdings re-adopted by Open(); the caller takes them once.
  std::vector<AdoptedHolding> TakeAdopted();
  const std::vector<LostHolding>& lost() const { return lost_; }

  // Address of pool byte `offset` in the agent's own mapping.
  std::byte* Data(uint64_t offset) const { return base_ + offset; }

  const std::string& pool_path() const { return pool_path_; }
  // The pool file's descriptor (handed to clients over the session socket).
  int pool_fd() const { return fd_; }
  const std::string& dir() const { return dir_; }
  uint64_t capacity_bytes() const { return capacity_; }
  uint64_t free_bytes() const;
  uint64_t largest_free_extent() const;
  // Live reservations (for leak checks in tests and status).
  int64_t live_reservations() const { return live_.load(); }
  // Extents a Free refused because they were not allocated (a bug; logged).
  uint64_t bad_frees() const { return bad_frees_.load(); }
  // Frees extents directly, as a Reservation's destructor does (tests of the
  // double-free guard only).
  void FreeForTest(std::span<const Extent> extents) { Free(extents); }

 private:
  friend class Reservation;
  Arena() = default;
  absl::Status Init(const Options& options);
  // Re-adopts the holdings of the records found; FailedPrecondition (and
  // nothing adopted) if a record is not the agent's own.
  absl::Status Adopt();
  // Returns extents to the free list and coalesces. An extent that is not
  // wholly allocated (outside the pool, or overlapping free space: a double
  // free) is refused and logged; the free list is never corrupted.
  void Free(std::span<const Extent> extents);
  bool ExtentFreeLocked(const Extent& e) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReserveLocked(const Extent& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string RecordName(const ShardRecord& r, uint64_t seq) const;

  FileSystem* fs_ = nullptr;
  std::string dir_;
  std::string pool_path_;
  std::string records_dir_;
  uint64_t capacity_ = 0;
  int fd_ = -1;
  int dir_lock_fd_ = -1;  // the memory directory, flock(LOCK_EX) while open
  std::byte* base_ = nullptr;

  mutable absl::Mutex mu_;
  std::map<uint64_t, uint64_t> free_ ABSL_GUARDED_BY(mu_);  // offset -> length
  uint64_t free_total_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_seq_ ABSL_GUARDED_BY(mu_) = 0;

  std::atomic<int64_t> live_{0};
  std::atomic<uint64_t> bad_frees_{0};
  std::vector<AdoptedHolding> adopted_;
  std::vector<LostHolding> lost_;
};

// Record (de)serialisation, exposed for tests: Encode writes format 2 (binary,
// docs/agent.md "Records"); Decode reads it and format 1 (the JSON records of
// earlier versions).
std::string EncodeShardRecord(const ShardRecord& record);
absl::StatusOr<ShardRecord> DecodeShardRecord(std::string_view json);

}  // namespace ckpt::agent
