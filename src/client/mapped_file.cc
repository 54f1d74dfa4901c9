#include "client/mapped_file.h"

#include "common/prefault.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/file_system.h"
#include "common/log.h"

namespace ckpt::client {

absl::StatusOr<std::shared_ptr<MappedFile>> MappedFile::Map(const std::string& path,
                                                            Access access, bool populate) {
  const bool rw = access == Access::kReadWrite;
  int fd = ::open(path.c_str(), (rw ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return PosixErrorToStatus(errno, "open", path);
  absl::StatusOr<std::shared_ptr<MappedFile>> m = MapFd(path, fd, access, populate);
  ::close(fd);  // the mapping keeps the file open
  return m;
}

absl::StatusOr<std::shared_ptr<MappedFile>> MappedFile::MapFd(const std::string& path, int fd, Access access,
                                                              bool populate) {
  const bool rw = access == Access::kReadWrite;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return PosixErrorToStatus(errno, "fstat", path);
  if (!S_ISREG(st.st_mode) || st.st_size <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot map '", path, "': ",
                     S_ISREG(st.st_mode) ? "the file is empty" : "not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  int flags = MAP_SHARED;
  if (populate) flags |= MAP_POPULATE;
  void* p = ::mmap(nullptr, size, rw ? (PROT_READ | PROT_WRITE) : PROT_READ, flags, fd, 0);
  if (p == MAP_FAILED) return PosixErrorToStatus(errno, "mmap", path);
  if (populate && rw) PrefaultForWrite(p, size);
  return std::shared_ptr<MappedFile>(new MappedFile(path, static_cast<std::byte*>(p), size, access,
                                                    {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)}));
}

MappedFile::~MappedFile() {
  if (::munmap(data_, size_) != 0) {
    log::Warn("munmap '{}' ({} bytes) failed: errno {}", path_, size_, errno);
  }
}

absl::Status MappingCache::AddPoolFile(const std::string& path) {
  absl::StatusOr<std::shared_ptr<MappedFile>> m =
      MappedFile::Map(path, MappedFile::Access::kReadWrite, /*populate=*/false);
  if (!m.ok()) return m.status();
  absl::MutexLock lock(&mu_);
  files_[path] = *std::move(m);
  return absl::OkStatus();
}

absl::Status MappingCache::AddPoolFd(const std::string& path, int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return PosixErrorToStatus(errno, "fstat", path);
  {
    absl::MutexLock lock(&mu_);
    auto it = files_.find(path);
    if (it != files_.end() && it->second->access() == MappedFile::Access::kReadWrite &&
        it->second->size() == static_cast<uint64_t>(st.st_size) &&
        it->second->identity() == std::make_pair(static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino))) {
      return absl::OkStatus();  // the same pool (e.g. after an agent restart): keep the mapping
    }
  }
  absl::StatusOr<std::shared_ptr<MappedFile>> m =
      MappedFile::MapFd(path, fd, MappedFile::Access::kReadWrite, /*populate=*/false);
  if (!m.ok()) return m.status();
  absl::MutexLock lock(&mu_);
  files_[path] = *std::move(m);  // views of the old pool keep their own mapping alive
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<MappedFile>> MappingCache::Get(const std::string& path,
                                                              uint64_t offset, uint64_t length,
                                                              MappedFile::Access access) {
  auto fits = [&](const MappedFile& m) {
    return offset <= m.size() && length <= m.size() - offset &&
           (access == MappedFile::Access::kReadOnly ||
            m.access() == MappedFile::Access::kReadWrite);
  };
  {
    absl::MutexLock lock(&mu_);
    auto it = files_.find(path);
    if (it != files_.end() && fits(*it->second)) return it->second;
  }
  // Map outside the lock (mmap of a large file takes a while). Writers get
  // their pages populated, readers fault them in as they read.
  absl::StatusOr<std::shared_ptr<MappedFile>> m =
      MappedFile::Map(path, access, /*populate=*/false);
  if (!m.ok()) return m.status();
  if (!fits(**m)) {
    return absl::OutOfRangeError(absl::StrCat("region [", offset, ", ", offset + length,
                                              ") lies beyond the end of '", path, "' (",
                                              (*m)->size(), " bytes)"));
  }
  absl::MutexLock lock(&mu_);
  auto& slot = files_[path];
  // Keep whichever mapping is more useful: a read-only mapping never
  // replaces a read-write one that covers as much.
  if (slot == nullptr || slot->size() < (*m)->size() ||
      slot->access() == MappedFile::Access::kReadOnly) {
    slot = *m;
  }
  return *std::move(m);
}

size_t MappingCache::size() const {
  absl::MutexLock lock(&mu_);
  return files_.size();
}

namespace {
#ifndef MADV_POPULATE_WRITE
constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14
#endif
constexpr uint64_t kWarmChunk = 2 << 20;
constexpr uint64_t kPage = 4096;
}  // namespace

PoolWarmer::PoolWarmer()
    : pins_(std::make_shared<Pins>()), thread_(std::make_unique<Executor>("ckpt-warm", 1, 16)) {}

PoolWarmer::~PoolWarmer() {
  stop_.store(true, std::memory_order_relaxed);
  { absl::MutexLock wake(&pins_->mu); }  // a warming waiting for pins to go sees stop_
  thread_->Stop();
}

void PoolWarmer::Warm(const std::shared_ptr<MappedFile>& m) {
  if (m == nullptr || m->access() != MappedFile::Access::kReadWrite) return;
  {
    absl::MutexLock lock(&mu_);
    std::erase_if(seen_, [](const std::weak_ptr<MappedFile>& w) { return w.expired(); });
    for (const std::weak_ptr<MappedFile>& w : seen_) {
      if (w.lock() == m) return;
    }
    seen_.push_back(m);
    ++pending_;
  }
  if (!thread_->TrySubmit([this, weak = std::weak_ptr<MappedFile>(m)] { Run(weak); })) {
    absl::MutexLock lock(&mu_);
    --pending_;  // not warmed; the saves fault their pages in
  }
}

std::shared_ptr<void> PoolWarmer::Pin(const std::byte* begin, const std::byte* end) {
  uint64_t id = 0;
  {
    absl::MutexLock lock(&pins_->mu);
    id = pins_->next_id++;
    pins_->ranges.emplace(id, std::make_pair(begin, end));
  }
  return std::shared_ptr<void>(nullptr, [pins = pins_, id](void*) {
    // A fork()ed child may inherit the mutex held by the parent's warmer
    // thread, which does not exist there: it leaves the pins alone.
    if (::getpid() != pins->creator_pid) return;
    absl::MutexLock lock(&pins->mu);
    pins->ranges.erase(id);
  });
}

void PoolWarmer::Run(std::weak_ptr<MappedFile> weak) {
  bool done = false;
  for (uint64_t off = 0;;) {
    // Only while this process touches no pool bytes itself: a save or a load
    // in flight (a pin) goes first, and the warming waits for it holding no
    // reference to the mapping.
    absl::MutexLock lock(&pins_->mu);
    pins_->mu.Await(absl::Condition(
        +[](PoolWarmer* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->pins_->mu) {
          return w->pins_->ranges.empty() || w->stop_.load(std::memory_order_relaxed);
        },
        this));
    if (stop_.load(std::memory_order_relaxed)) break;
    std::shared_ptr<MappedFile> m = weak.lock();  // held for one chunk only
    if (m == nullptr) break;
    if (off >= m->size()) {
      done = true;
      break;
    }
    const uint64_t n = std::min(kWarmChunk, m->size() - off);
    std::byte* const chunk = m->data() + off;
    // Page tables first; the touch only where that succeeded, so never past
    // the end of a file that shrank under an old mapping (EFAULT here, a
    // SIGBUS for a touch). EINVAL: a kernel before 5.14, where nothing is
    // warmed and the saves fault their pages in.
    if (::madvise(chunk, n, MADV_POPULATE_WRITE) != 0) {
      if (errno != EINVAL) log::Debug("warming '{}' stopped at {}: errno {}", m->path(), off, errno);
      break;
    }
    PrefaultForWrite(chunk, n, kPage);
    off += n;
  }
  absl::MutexLock lock(&mu_);
  --pending_;
  if (done) ++warmed_;
}

size_t PoolWarmer::warmed() const {
  absl::MutexLock lock(&mu_);
  return warmed_;
}

void PoolWarmer::WaitIdle() const {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(+[](const size_t* pending) { return *pending == 0; }, &pending_));
}

}  // namespace ckpt::client
