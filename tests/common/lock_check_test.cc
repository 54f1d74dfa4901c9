// The run-time check behind "no lock is held across crc, file or network
// I/O": the I/O paths abort when the calling thread holds a CheckedLock, and
// only then.
#include "common/lock_check.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/crc32c.h"
#include "common/mem_file_system.h"

namespace ckpt {
namespace {

#ifndef NDEBUG

TEST(LockCheckDeathTest, LargeCrcUnderACheckedLockAborts) {
  absl::Mutex mu;
  const std::vector<char> page(4096, 'x');
  EXPECT_DEATH(
      {
        CheckedLock lock(&mu);
        Crc32c(page.data(), page.size());
      },
      "crc32c of 4 KiB or more while holding 1 checked lock");
}

TEST(LockCheckDeathTest, FileIoUnderACheckedLockAborts) {
  absl::Mutex mu;
  MemFileSystem fs;
  EXPECT_DEATH(
      {
        CheckedLock lock(&mu);
        fs.CreateDir("/d").IgnoreError();
      },
      "file I/O while holding 1 checked lock");
}

TEST(LockCheck, OutsideTheLockAndSmallCrcsAreFine) {
  absl::Mutex mu;
  MemFileSystem fs;
  const std::vector<char> page(4096, 'x');
  {
    CheckedLock lock(&mu);
    Crc32c(page.data(), 4095);  // a header or a record: fine under a lock
  }
  EXPECT_NE(Crc32c(page.data(), page.size()), 0u);
  EXPECT_TRUE(fs.CreateDir("/d").ok());
  {
    CheckedLock a(&mu);
    absl::Mutex other;
    { CheckedLock b(&other); }
  }
  AssertNoCheckedLock("nothing");  // back to zero after nested locks
}

#else

TEST(LockCheck, CompiledOutUnderNdebug) { GTEST_SKIP() << "NDEBUG: the check is compiled out"; }

#endif

}  // namespace
}  // namespace ckpt
