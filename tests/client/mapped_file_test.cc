// Pool mappings: Connect maps the agent's pool without populating it (its
// cost grew with the pool: seconds per GiB on some machines, for every client,
// also those that only load), and the PoolWarmer populates a mapping in the
// background once the process saves into it.
#include "client/mapped_file.h"

#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace ckpt::client {
namespace {

constexpr uint64_t kPool = 64 << 20;

// Resident bytes of the mapping that starts at `start` (/proc/self/smaps "Rss"), or -1.
int64_t RssOf(const void* start) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool in = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    // A mapping's header line: "lo-hi perms offset dev inode path"; field lines are "Name: value".
    if (line.find(':') > line.find(' ') && std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {
      in = lo == reinterpret_cast<uintptr_t>(start);
      continue;
    }
    if (in && line.rfind("Rss:", 0) == 0) {
      std::istringstream kb(line.substr(4));
      int64_t v = 0;
      kb >> v;
      return v * 1024;
    }
  }
  return -1;
}

// A pool as the agent hands it over: a memfd of kPool bytes, every page written
// (the agent's own mapping populated it).
int FilledPool() {
  const int fd = ::memfd_create("ckpt-test-pool", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, kPool) != 0) return -1;
  void* p = ::mmap(nullptr, kPool, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return -1;
  for (uint64_t off = 0; off < kPool; off += 4096) static_cast<char*>(p)[off] = 1;
  ::munmap(p, kPool);
  return fd;
}

TEST(MappingCache, APoolIsMappedWithoutPopulatingIt) {
  const int fd = FilledPool();
  ASSERT_GE(fd, 0);
  MappingCache cache;
  ASSERT_TRUE(cache.AddPoolFd("/pool", fd).ok());
  absl::StatusOr<std::shared_ptr<MappedFile>> m = cache.Get("/pool", 0, kPool, MappedFile::Access::kReadWrite);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ((*m)->size(), kPool);
  const int64_t rss = RssOf((*m)->data());
  ASSERT_GE(rss, 0) << "no smaps entry for the mapping";
  EXPECT_LE(rss, 1 << 20) << "the pool mapping was populated at connect";
  ::close(fd);
}

TEST(PoolWarmer, PopulatesAMappingOnceAndNeverKeepsItAlive) {
  const int fd = FilledPool();
  ASSERT_GE(fd, 0);
  auto cache = std::make_unique<MappingCache>();
  ASSERT_TRUE(cache->AddPoolFd("/pool", fd).ok());
  std::shared_ptr<MappedFile> m = *cache->Get("/pool", 0, kPool, MappedFile::Access::kReadWrite);
  PoolWarmer warmer;
  warmer.Warm(m);
  warmer.Warm(m);  // once only
  warmer.WaitIdle();
  if (warmer.warmed() == 0) GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)";
  EXPECT_EQ(warmer.warmed(), 1u);
  EXPECT_GE(RssOf(m->data()), static_cast<int64_t>(kPool) - (1 << 20)) << "not populated";

  // A read-only mapping is never warmed; a dropped mapping is not kept.
  std::shared_ptr<MappedFile> ro = *MappedFile::MapFd("/pool", fd, MappedFile::Access::kReadOnly, false);
  warmer.Warm(ro);
  warmer.WaitIdle();
  EXPECT_EQ(warmer.warmed(), 1u);
  std::weak_ptr<MappedFile> weak = m;
  m.reset();
  cache.reset();
  EXPECT_TRUE(weak.expired()) << "the warmer kept a mapping alive";
  ::close(fd);
}

// The warming waits while this process touches pool bytes itself (a pin):
// its own accesses never meet a touch (under TSan that would be a reported
// race) nor compete with one.
TEST(PoolWarmer, WaitsWhileThisProcessUsesThePool) {
  const int fd = FilledPool();
  ASSERT_GE(fd, 0);
  std::shared_ptr<MappedFile> m = *MappedFile::MapFd("/pool", fd, MappedFile::Access::kReadWrite, false);
  std::byte* const mine = m->data() + (16 << 20);
  const size_t n = 8 << 20;
  PoolWarmer warmer;
  std::shared_ptr<void> pin = warmer.Pin(mine, mine + n);
  warmer.Warm(m);
  for (int pass = 0; pass < 8; ++pass) std::memset(mine, 0x40 + pass, n);  // a save's copy
  EXPECT_EQ(warmer.warmed(), 0u) << "warmed while the pool was in use";
  pin.reset();  // the save is done: the warming goes on
  warmer.WaitIdle();
  EXPECT_EQ(warmer.warmed(), 1u);
  for (size_t i = 0; i < n; i += 4093) ASSERT_EQ(mine[i], std::byte{0x47}) << "byte " << i;
  ::close(fd);
}

// Threads of this process named `name` (/proc/self/task/*/comm).
int ThreadsNamed(const std::string& name) {
  int n = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ++n;
  }
  return n;
}

// Waits (bounded) until ThreadsNamed(name) == n: a new thread names itself
// once it runs.
bool EventuallyThreadsNamed(const std::string& name, int n) {
  const absl::Time deadline = absl::Now() + absl::Minutes(1);
  while (ThreadsNamed(name) != n) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

// Destroys `warmer` on a thread of its own; false if that has not returned
// within a minute (the destructor waits for the pin, or the warming never
// stops). Then `unblock` runs, so the thread can end and the test fails
// itself rather than hang until ctest's timeout.
bool DestroyedWithinAMinute(std::unique_ptr<PoolWarmer> warmer, const std::function<void()>& unblock) {
  absl::Notification done;
  std::thread t([&] {
    warmer.reset();
    done.Notify();
  });
  const bool in_time = done.WaitForNotificationWithTimeout(absl::Minutes(1));
  if (!in_time) unblock();
  t.join();
  return in_time;
}

TEST(PoolWarmer, DestructionEndsAWarmingThatWaitsForAPin) {
  const int fd = FilledPool();
  ASSERT_GE(fd, 0);
  std::shared_ptr<MappedFile> m = *MappedFile::MapFd("/pool", fd, MappedFile::Access::kReadWrite, false);
  ASSERT_EQ(RssOf(m->data()), 0);
  std::shared_ptr<void> pin;
  auto warmer = std::make_unique<PoolWarmer>();
  ASSERT_TRUE(EventuallyThreadsNamed("ckpt-warm", 1));
  pin = warmer->Pin(m->data(), m->data() + 4096);
  warmer->Warm(m);
  // Returns although the pin is still held...
  EXPECT_TRUE(DestroyedWithinAMinute(std::move(warmer), [&] { pin.reset(); }))
      << "the destructor waited for the pin to go";
  // ...having joined its thread, and touched no page: the warming waited
  // for the pin from its first chunk on.
  EXPECT_TRUE(EventuallyThreadsNamed("ckpt-warm", 0)) << "the warmer's thread outlived it";
  EXPECT_EQ(RssOf(m->data()), 0) << "warmed a chunk while the pool was pinned";
  pin.reset();  // a pin may outlive its warmer
  std::weak_ptr<MappedFile> weak = m;
  m.reset();
  EXPECT_TRUE(weak.expired());
  ::close(fd);
}

TEST(PoolWarmer, DestructionStopsAWarmingInProgress) {
  const int fd = FilledPool();
  ASSERT_GE(fd, 0);
  std::shared_ptr<MappedFile> m = *MappedFile::MapFd("/pool", fd, MappedFile::Access::kReadWrite, false);
  auto warmer = std::make_unique<PoolWarmer>();
  warmer->Warm(m);
  ASSERT_TRUE(EventuallyThreadsNamed("ckpt-warm", 1));
  // The warming has begun (a first chunk is resident; bounded wait).
  const absl::Time deadline = absl::Now() + absl::Minutes(1);
  while (RssOf(m->data()) <= 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  if (RssOf(m->data()) <= 0) GTEST_SKIP() << "nothing warmed: this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)";
  // Destruction returns (within one chunk: the warming stopped, or done)...
  EXPECT_TRUE(DestroyedWithinAMinute(std::move(warmer), [] {})) << "the destructor did not stop the warming";
  // ...and nothing runs after this: the warmer's thread is gone.
  EXPECT_TRUE(EventuallyThreadsNamed("ckpt-warm", 0)) << "the warmer's thread outlived it";
  std::weak_ptr<MappedFile> weak = m;
  m.reset();
  EXPECT_TRUE(weak.expired()) << "the stopped warming kept the mapping alive";
  ::close(fd);
}

}  // namespace
}  // namespace ckpt::client
