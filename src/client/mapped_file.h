// Memory mappings of the agent's memory-tier files, for the client library.
//
// The agent's memory tier is a few large files on a tmpfs (its "pool files");
// every MemoryRegion of a staging lease or an open shard is a range of one of
// them. The client maps each pool file whole once, MAP_SHARED and read-write,
// without populating it (that took seconds per GiB of pool on some machines,
// in Client::Connect, for every process, also those that only load), and
// turns regions into plain pointers. A PoolWarmer populates a pool mapping in
// the background once the process saves into it. A region of a file that is not mapped yet
// (or lies past the end of the current mapping, because the file grew) is
// mapped on demand, whole file again, and cached.
//
// A MappedFile unmaps itself when the last shared_ptr to it goes, so handles
// that hold views (LoadedShard) keep their mappings alive even if the cache
// replaced or dropped them.
//
// Thread safety: MappingCache is thread-safe; MappedFile is immutable.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/executor.h"

namespace ckpt::client {

class MappedFile {
 public:
  enum class Access { kReadOnly, kReadWrite };

  // Maps the whole of the file at `path` (its current size) with
  // MAP_SHARED; with `populate`, also MAP_POPULATE. Errors: open/fstat/mmap
  // failures as PosixErrorToStatus (kNotFound, kPermissionDenied,
  // kResourceExhausted, ...); kFailedPrecondition for an empty file or one
  // that is not a regular file.
  static absl::StatusOr<std::shared_ptr<MappedFile>> Map(const std::string& path, Access access,
                                                         bool populate);
  // Maps the whole of an open file (e.g. a pool descriptor the agent handed
  // over its session socket), naming it `path`. The caller keeps `fd`.
  static absl::StatusOr<std::shared_ptr<MappedFile>> MapFd(const std::string& path, int fd, Access access,
                                                           bool populate);

  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  // The mapped file's identity (st_dev, st_ino).
  std::pair<uint64_t, uint64_t> identity() const { return identity_; }
  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  Access access() const { return access_; }

 private:
  MappedFile(std::string path, std::byte* data, uint64_t size, Access access, std::pair<uint64_t, uint64_t> identity)
      : path_(std::move(path)), data_(data), size_(size), access_(access), identity_(identity) {}

  const std::string path_;
  std::byte* const data_;
  const uint64_t size_;
  const Access access_;
  const std::pair<uint64_t, uint64_t> identity_;
};

class MappingCache {
 public:
  // Maps `path` read-write (not populated) and keeps it (Client::Connect,
  // for every pool file). Errors as MappedFile::Map.
  absl::Status AddPoolFile(const std::string& path);
  // Maps a pool descriptor received from the agent's session socket under
  // the pool's `path` (the name its regions use), read-write and not
  // populated, unless the same file (st_dev, st_ino) is mapped there
  // already. The caller keeps `fd`. Errors as MappedFile::MapFd.
  absl::Status AddPoolFd(const std::string& path, int fd);

  // Returns a mapping of `path` that covers [offset, offset + length) and
  // allows `access` (a read-write mapping serves read-only requests too):
  // the cached one if it fits, else a new whole-file mapping (cached from
  // then on). Errors: those of MappedFile::Map; kOutOfRange if the file is
  // shorter than offset + length even after remapping.
  absl::StatusOr<std::shared_ptr<MappedFile>> Get(const std::string& path, uint64_t offset,
                                                  uint64_t length, MappedFile::Access access);

  // Number of files mapped (for tests).
  size_t size() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<MappedFile>> files_ ABSL_GUARDED_BY(mu_);
};

// Populates read-write pool mappings for write on a thread of its own, so
// that saves into parts of the pool this process has not written yet take no
// page fault per page. A client warms a mapping when it first saves into it.
// Per chunk of 2 MiB: MADV_POPULATE_WRITE (installs the page tables; enough on
// most machines), then a write-touch of every page (common/prefault.h: an
// atomic add of 0, contents unchanged), which VMs with shadow page tables need
// (this project's test machine: a first write per page and process costs a
// trap there even after MADV_POPULATE_WRITE).
//
// The touch never meets this process's own accesses, nor competes with them:
// every range of the pool this process reads or writes is pinned (Pin(),
// MapRegions does it for the life of a lease's or an open shard's regions),
// and the warmer touches a chunk only while nothing is pinned (a save or a
// load in flight goes first; a Pin waits at most for the chunk in progress). Other processes (the agent,
// other ranks) may write the same pages: the atomic add leaves their bytes as
// they are. The warmer never extends a mapping's life: it holds weak
// references and stops warming one that went.
class PoolWarmer {
 public:
  PoolWarmer();
  // Stops warming (within one chunk) and joins the thread.
  ~PoolWarmer();
  PoolWarmer(const PoolWarmer&) = delete;
  PoolWarmer& operator=(const PoolWarmer&) = delete;

  // Queues `m` (read-write mappings only) unless it was queued before;
  // returns at once. `m` must own the mapping itself (not an aliasing
  // pointer whose owner also holds pins: the warming would wait for them
  // while keeping them alive).
  void Warm(const std::shared_ptr<MappedFile>& m);

  // Marks [begin, end) as used by this process until the returned pin goes
  // (it may outlive the warmer). Blocks at most for one chunk in progress.
  std::shared_ptr<void> Pin(const std::byte* begin, const std::byte* end);

  // Mappings warmed to the end so far (for tests and logs).
  size_t warmed() const;
  // Blocks until every mapping queued so far was warmed or dropped (tests;
  // never while the caller holds a pin: the warming waits for it).
  void WaitIdle() const;

 private:
  struct Pins {
    const pid_t creator_pid = ::getpid();
    absl::Mutex mu;  // held by the warmer while it touches a chunk
    uint64_t next_id ABSL_GUARDED_BY(mu) = 0;
    std::map<uint64_t, std::pair<const std::byte*, const std::byte*>> ranges ABSL_GUARDED_BY(mu);
  };
  void Run(std::weak_ptr<MappedFile> weak);

  std::atomic<bool> stop_{false};
  const std::shared_ptr<Pins> pins_;
  mutable absl::Mutex mu_;
  std::vector<std::weak_ptr<MappedFile>> seen_ ABSL_GUARDED_BY(mu_);
  size_t pending_ ABSL_GUARDED_BY(mu_) = 0;
  size_t warmed_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<Executor> thread_;  // last: stopped first
};

}  // namespace ckpt::client
