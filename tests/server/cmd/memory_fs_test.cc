// What the agent's memory dir lives on (issue 40 point 6).
#include "server/cmd/memory_fs.h"

#include <sys/statfs.h>

#include <gtest/gtest.h>

#include "absl/strings/match.h"

namespace ckpt::daemon {
namespace {

TEST(MemoryFs, MemoryFileSystemsAreMemoryAndDisksAreNot) {
  EXPECT_EQ(DescribeFsType(0x01021994).name, "tmpfs");
  EXPECT_TRUE(DescribeFsType(0x01021994).in_memory);
  EXPECT_TRUE(DescribeFsType(0x958458f6).in_memory);  // hugetlbfs
  EXPECT_TRUE(DescribeFsType(0x858458f6).in_memory);  // ramfs
  EXPECT_EQ(DescribeFsType(0xEF53).name, "ext4");
  EXPECT_FALSE(DescribeFsType(0xEF53).in_memory);
  EXPECT_FALSE(DescribeFsType(0x58465342).in_memory);  // xfs
  EXPECT_EQ(DescribeFsType(0x12345678).name, "0x12345678");
  EXPECT_FALSE(DescribeFsType(0x12345678).in_memory);
}

TEST(MemoryFs, APathNotMadeYetIsJudgedByItsParent) {
  // /proc is procfs on every Linux; a directory below it cannot exist.
  auto kind = FsKindOf("/proc/no-such-ckpt-dir/mem");
  ASSERT_TRUE(kind.ok()) << kind.status();
  EXPECT_EQ(kind->name, "proc");
  EXPECT_FALSE(kind->in_memory);
}

TEST(MemoryFs, DevShmIsMemoryWhereItIsTmpfs) {
  struct statfs sfs {};
  if (::statfs("/dev/shm", &sfs) != 0 || sfs.f_type != 0x01021994) GTEST_SKIP() << "/dev/shm is not tmpfs here";
  auto kind = FsKindOf("/dev/shm/ckpt-memory-fs-test-not-made");
  ASSERT_TRUE(kind.ok()) << kind.status();
  EXPECT_EQ(kind->name, "tmpfs");
  EXPECT_TRUE(kind->in_memory);
}

TEST(MemoryFs, TheWarningNamesTheDirTheFileSystemAndTheFix) {
  EXPECT_EQ(MemoryDirWarning("/dev/shm/x", {"tmpfs", true}), "");
  const std::string w = MemoryDirWarning("/var/tmp/mem", {"ext4", false});
  EXPECT_TRUE(absl::StrContains(w, "memory dir /var/tmp/mem is on ext4, not on tmpfs or hugetlbfs")) << w;
  EXPECT_TRUE(absl::StrContains(w, "/dev/shm")) << w;
  EXPECT_TRUE(absl::StrContains(w, "--memory-dir")) << w;
}

}  // namespace
}  // namespace ckpt::daemon
