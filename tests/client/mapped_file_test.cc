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
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

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

TEST(PoolWarmer, DestructionEndsAWarmingThatWaitsForAPin) {
  const int fd = FilledPool();
  ASSERT_GE(fd, 0);
  std::shared_ptr<MappedFile> m = *MappedFile::MapFd("/pool", fd, MappedFile::Access::kReadWrite, false);
  std::shared_ptr<void> pin;
  {
    PoolWarmer warmer;
    pin = warmer.Pin(m->data(), m->data() + 4096);
    warmer.Warm(m);
  }  // returns although the pin is still held
  pin.reset();  // a pin may outlive its warmer
  ::close(fd);
}

TEST(PoolWarmer, DestructionStopsAWarmingInProgress) {
  const int fd = FilledPool();
  ASSERT_GE(fd, 0);
  std::shared_ptr<MappedFile> m = *MappedFile::MapFd("/pool", fd, MappedFile::Access::kReadWrite, false);
  {
    PoolWarmer warmer;
    warmer.Warm(m);
  }  // joins (within one chunk); nothing runs after this
  SUCCEED();
  ::close(fd);
}

}  // namespace
}  // namespace ckpt::client
