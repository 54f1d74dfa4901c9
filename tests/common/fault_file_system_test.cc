// FaultFileSystem over MemFileSystem (and once over PosixFileSystem): the
// Nth write or sync fails and later ones recover, a full disk fails writes
// until space is freed, counters count, and failed syncs really leave data
// unsynced for the crash model.
#include "common/fault_file_system.h"

#include <stdlib.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/file_system.h"
#include "common/mem_file_system.h"

namespace ckpt {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

testing::AssertionResult IsOk(const absl::Status& status) {
  if (status.ok()) return testing::AssertionSuccess();
  return testing::AssertionFailure() << status;
}
template <typename T>
testing::AssertionResult IsOk(const absl::StatusOr<T>& result) {
  return IsOk(result.status());
}

class FaultFileSystemTest : public testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(IsOk(mem_.CreateDirs("/d")));
    ASSERT_TRUE(IsOk(mem_.SyncDir("/")));
    ASSERT_TRUE(IsOk(mem_.SyncDir("/d")));
  }

  std::unique_ptr<WritableFile> Open(const std::string& path,
                                     OpenMode mode = OpenMode::kTruncate) {
    absl::StatusOr<std::unique_ptr<WritableFile>> file = fs_.NewWritableFile(path, mode);
    EXPECT_TRUE(IsOk(file));
    return file.ok() ? *std::move(file) : nullptr;
  }

  std::string Read(const std::string& path) {
    absl::StatusOr<std::string> data = ReadFileToString(&fs_, path);
    return data.ok() ? *data : data.status().ToString();
  }

  MemFileSystem mem_;
  FaultFileSystem fs_{&mem_};
};

TEST_F(FaultFileSystemTest, NthWriteFailsWithoutWritingThenWritesRecover) {
  auto file = Open("/d/f");
  ASSERT_NE(file, nullptr);
  fs_.FailNthWrite(3, absl::StatusCode::kInternal);
  EXPECT_TRUE(IsOk(file->Append("a")));
  EXPECT_TRUE(IsOk(file->PositionedWrite(1, "b")));
  const absl::Status third = file->Append("c");
  EXPECT_EQ(third.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(third.message(), HasSubstr("/d/f"));
  EXPECT_THAT(third.message(), HasSubstr("injected fault (write #3)"));
  EXPECT_TRUE(IsOk(file->Append("d")));
  EXPECT_TRUE(IsOk(file->Close()));
  EXPECT_EQ(Read("/d/f"), "abd");
  EXPECT_EQ(fs_.WritesIssued(), 4);
}

TEST_F(FaultFileSystemTest, NthWriteCountsFromWhenItIsArmed) {
  auto file = Open("/d/f");
  ASSERT_NE(file, nullptr);
  ASSERT_TRUE(IsOk(file->Append("x")));
  ASSERT_TRUE(IsOk(file->Append("x")));
  fs_.FailNthWrite(1);  // the very next write
  EXPECT_EQ(file->Append("y").code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(IsOk(file->Append("z")));
  EXPECT_EQ(fs_.WritesIssued(), 4);
}

TEST_F(FaultFileSystemTest, RearmingReplacesAndZeroDisarms) {
  auto file = Open("/d/f");
  ASSERT_NE(file, nullptr);
  fs_.FailNthWrite(1);
  fs_.FailNthWrite(2);  // replaces: the first write now succeeds
  EXPECT_TRUE(IsOk(file->Append("a")));
  EXPECT_FALSE(file->Append("b").ok());
  fs_.FailNthWrite(1);
  fs_.FailNthWrite(0);
  EXPECT_TRUE(IsOk(file->Append("c")));
}

TEST_F(FaultFileSystemTest, NthSyncCountsFileAndDirectorySyncs) {
  auto file = Open("/d/f");
  ASSERT_NE(file, nullptr);
  fs_.FailNthSync(2, absl::StatusCode::kDataLoss);
  EXPECT_TRUE(IsOk(file->Sync()));
  const absl::Status second = fs_.SyncDir("/d");
  EXPECT_EQ(second.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(second.message(), HasSubstr("sync '/d': injected fault (sync #2)"));
  EXPECT_TRUE(IsOk(fs_.SyncDir("/d")));
  EXPECT_TRUE(IsOk(file->Sync()));
  EXPECT_EQ(fs_.SyncsIssued(), 4);
  EXPECT_EQ(fs_.WritesIssued(), 0);
}

TEST_F(FaultFileSystemTest, FailAllWritesAndSyncsUntilCleared) {
  auto file = Open("/d/f");
  ASSERT_NE(file, nullptr);
  fs_.FailAllWrites(true);
  fs_.FailAllSyncs(true);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(file->Append("x").code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(file->PositionedWrite(0, "x").code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(file->Sync().code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(fs_.SyncDir("/d").code(), absl::StatusCode::kUnavailable);
  }
  // Reads and metadata operations are never failed.
  EXPECT_TRUE(IsOk(fs_.CreateDir("/d/sub")));
  EXPECT_THAT(*fs_.ListDir("/d"), ElementsAre("f", "sub"));
  fs_.FailAllWrites(false);
  EXPECT_TRUE(IsOk(file->Append("ok")));
  EXPECT_EQ(file->Sync().code(), absl::StatusCode::kUnavailable);
  fs_.FailAllSyncs(false);
  EXPECT_TRUE(IsOk(file->Sync()));
  EXPECT_EQ(Read("/d/f"), "ok");
  EXPECT_EQ(fs_.WritesIssued(), 7);
  EXPECT_EQ(fs_.SyncsIssued(), 8);
}

TEST_F(FaultFileSystemTest, FailedSyncLeavesDataUnsyncedForTheCrash) {
  auto file = Open("/d/f");
  ASSERT_NE(file, nullptr);
  ASSERT_TRUE(IsOk(file->Append("synced")));
  ASSERT_TRUE(IsOk(file->Sync()));
  ASSERT_TRUE(IsOk(fs_.SyncDir("/d")));
  ASSERT_TRUE(IsOk(file->Append(" and more")));
  fs_.FailNthSync(1);
  EXPECT_FALSE(file->Sync().ok());
  mem_.DropUnsyncedData();
  EXPECT_EQ(Read("/d/f"), "synced");
}

TEST_F(FaultFileSystemTest, AtomicWriteSurvivesEveryInjectedFailure) {
  // Fail each write and each sync of the commit protocol in turn, crash, and
  // check that the marker holds the old or the new content, never anything
  // else, and that no temporary file is visible.
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&fs_, "/d/COMMITTED", "old")));
  struct Fault {
    bool sync;
    int n;
  };
  for (const Fault& fault : {Fault{false, 1}, Fault{true, 1}, Fault{true, 2}}) {
    SCOPED_TRACE(std::string(fault.sync ? "sync #" : "write #") + std::to_string(fault.n));
    if (fault.sync) {
      fs_.FailNthSync(fault.n);
    } else {
      fs_.FailNthWrite(fault.n);
    }
    const absl::Status status = WriteStringToFileAtomically(&fs_, "/d/COMMITTED", "new");
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    // Only a failed directory sync (the last step) leaves the new content
    // visible before the crash.
    EXPECT_EQ(Read("/d/COMMITTED"), fault.sync && fault.n == 2 ? "new" : "old");
    EXPECT_THAT(*fs_.ListDir("/d"), ElementsAre("COMMITTED"));
    mem_.DropUnsyncedData();
    EXPECT_EQ(Read("/d/COMMITTED"), "old");
    EXPECT_THAT(*fs_.ListDir("/d"), ElementsAre("COMMITTED"));
  }
  // With no fault the new content is durable.
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&fs_, "/d/COMMITTED", "new")));
  mem_.DropUnsyncedData();
  EXPECT_EQ(Read("/d/COMMITTED"), "new");
}

TEST_F(FaultFileSystemTest, PrivateAtomicWriteIsCoveredAndLeavesTheOldFileOnFailure) {
  // The memory tier's records and incarnation file go through here: every
  // write and sync of the protocol is counted and may fail, and a failure
  // before the rename leaves the old file whole and no temporary behind.
  ASSERT_TRUE(IsOk(WritePrivateFileAtomically(&fs_, "/d/incarnation", "1\n")));
  EXPECT_EQ(fs_.WritesIssued(), 1);
  EXPECT_EQ(fs_.SyncsIssued(), 2);  // the file, then its directory
  struct Fault {
    bool sync;
    int n;
  };
  for (const Fault& fault : {Fault{false, 1}, Fault{true, 1}, Fault{true, 2}}) {
    SCOPED_TRACE(std::string(fault.sync ? "sync #" : "write #") + std::to_string(fault.n));
    if (fault.sync) {
      fs_.FailNthSync(fault.n);
    } else {
      fs_.FailNthWrite(fault.n);
    }
    const absl::Status status = WritePrivateFileAtomically(&fs_, "/d/incarnation", "2\n");
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_THAT(status.message(), HasSubstr("injected fault"));
    EXPECT_EQ(*ReadPrivateFileToString(&fs_, "/d/incarnation"),
              fault.sync && fault.n == 2 ? "2\n" : "1\n");
    EXPECT_THAT(*fs_.ListDir("/d"), ElementsAre("incarnation"));
    mem_.DropUnsyncedData();
    EXPECT_EQ(*ReadPrivateFileToString(&fs_, "/d/incarnation"), "1\n");
  }
  fs_.SetCapacityBytes(fs_.UsedBytes());  // a full disk
  EXPECT_EQ(WritePrivateFileAtomically(&fs_, "/d/incarnation", "3\n").code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(*ReadPrivateFileToString(&fs_, "/d/incarnation"), "1\n");
}

TEST_F(FaultFileSystemTest, FullDiskFailsWritesUntilSpaceIsFreed) {
  fs_.SetCapacityBytes(100);
  auto a = Open("/d/a");
  auto b = Open("/d/b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(IsOk(a->Append(std::string(60, 'a'))));
  EXPECT_EQ(fs_.UsedBytes(), 60u);
  EXPECT_EQ(*fs_.FreeSpaceBytes("/d"), 40u);

  const absl::Status full = b->Append(std::string(50, 'b'));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(full.message(), "write '/d/b': No space left on device");
  EXPECT_EQ(b->Size(), 0u);  // nothing was written
  EXPECT_FALSE(b->PositionedWrite(30, std::string(11, 'b')).ok());

  ASSERT_TRUE(IsOk(b->Append(std::string(40, 'b'))));  // exactly fills the disk
  EXPECT_EQ(*fs_.FreeSpaceBytes("/d"), 0u);
  EXPECT_TRUE(IsOk(a->PositionedWrite(0, "overwrite")));  // takes no new space
  EXPECT_EQ(b->Append("!").code(), absl::StatusCode::kResourceExhausted);

  ASSERT_TRUE(IsOk(a->Close()));
  ASSERT_TRUE(IsOk(fs_.DeleteFile("/d/a")));
  EXPECT_EQ(*fs_.FreeSpaceBytes("/d"), 60u);
  EXPECT_TRUE(IsOk(b->Append(std::string(60, 'b'))));
  EXPECT_EQ(fs_.UsedBytes(), 100u);
  ASSERT_TRUE(IsOk(b->Close()));
  EXPECT_EQ(*fs_.GetFileSize("/d/b"), 100u);
}

TEST_F(FaultFileSystemTest, TruncateRenameAndReopenFreeSpace) {
  fs_.SetCapacityBytes(100);
  auto a = Open("/d/a");
  ASSERT_NE(a, nullptr);
  ASSERT_TRUE(IsOk(a->Append(std::string(80, 'a'))));
  ASSERT_TRUE(IsOk(a->Close()));
  EXPECT_EQ(fs_.Truncate("/d/a", 101).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(*fs_.GetFileSize("/d/a"), 80u);  // the base was not touched
  ASSERT_TRUE(IsOk(fs_.Truncate("/d/a", 30)));
  EXPECT_EQ(fs_.UsedBytes(), 30u);

  auto b = Open("/d/b");
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(IsOk(b->Append(std::string(70, 'b'))));
  ASSERT_TRUE(IsOk(b->Close()));
  ASSERT_TRUE(IsOk(fs_.Rename("/d/b", "/d/a")));  // the old 30 bytes are freed
  EXPECT_EQ(fs_.UsedBytes(), 70u);

  auto reopened = Open("/d/a", OpenMode::kTruncate);
  ASSERT_NE(reopened, nullptr);
  EXPECT_EQ(fs_.UsedBytes(), 0u);
  auto appended = Open("/d/a", OpenMode::kAppend);
  ASSERT_NE(appended, nullptr);
  EXPECT_TRUE(IsOk(appended->Append(std::string(100, 'x'))));
}

TEST_F(FaultFileSystemTest, RenamedDirectoryKeepsItsFilesCounted) {
  fs_.SetCapacityBytes(100);
  ASSERT_TRUE(IsOk(fs_.CreateDir("/d/7")));
  auto file = Open("/d/7/rank-00000.bin");
  ASSERT_NE(file, nullptr);
  ASSERT_TRUE(IsOk(file->Append(std::string(50, 'r'))));
  ASSERT_TRUE(IsOk(fs_.Rename("/d/7", "/d/8")));
  EXPECT_EQ(fs_.UsedBytes(), 50u);
  ASSERT_TRUE(IsOk(DeleteRecursively(&fs_, "/d/8")));
  EXPECT_EQ(fs_.UsedBytes(), 0u);
}

TEST_F(FaultFileSystemTest, PreallocationTakesSpaceUpFront) {
  fs_.SetCapacityBytes(100);
  auto a = Open("/d/a");
  ASSERT_NE(a, nullptr);
  ASSERT_TRUE(IsOk(a->Preallocate(80)));
  EXPECT_EQ(a->Size(), 0u);
  EXPECT_EQ(fs_.UsedBytes(), 80u);
  ASSERT_TRUE(IsOk(a->Append(std::string(80, 'a'))));  // inside the reservation
  EXPECT_EQ(fs_.UsedBytes(), 80u);
  const absl::Status too_big = a->Preallocate(101);
  EXPECT_EQ(too_big.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(too_big.message(), HasSubstr("preallocate '/d/a'"));
  auto b = Open("/d/b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->Append(std::string(21, 'b')).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(IsOk(b->Append(std::string(20, 'b'))));
}

TEST_F(FaultFileSystemTest, ResetClearsFaultsCountersAndCapacity) {
  auto file = Open("/d/f");
  ASSERT_NE(file, nullptr);
  ASSERT_TRUE(IsOk(file->Append("abc")));
  fs_.FailNthWrite(1);
  fs_.FailNthSync(1);
  fs_.FailAllWrites(true);
  fs_.FailAllSyncs(true);
  fs_.SetCapacityBytes(0);
  fs_.Reset();
  EXPECT_EQ(fs_.WritesIssued(), 0);
  EXPECT_EQ(fs_.SyncsIssued(), 0);
  EXPECT_EQ(fs_.UsedBytes(), 3u);  // kept: the files are still there
  EXPECT_TRUE(IsOk(file->Append("def")));
  EXPECT_TRUE(IsOk(file->Sync()));
  EXPECT_EQ(*fs_.FreeSpaceBytes("/d"), MemFileSystem::kMemFreeSpaceBytes);
  EXPECT_EQ(fs_.WritesIssued(), 1);
  EXPECT_EQ(fs_.SyncsIssued(), 1);
}

TEST_F(FaultFileSystemTest, CountsConcurrentWritesExactly) {
  constexpr int kThreads = 4;
  constexpr int kWritesPerThread = 100;
  auto file = Open("/d/f");
  ASSERT_NE(file, nullptr);
  fs_.FailNthWrite(kThreads * kWritesPerThread / 2);
  std::vector<int> failures(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kWritesPerThread; ++i) {
        const uint64_t offset = static_cast<uint64_t>(i * kThreads + t);
        if (!file->PositionedWrite(offset, "x").ok()) ++failures[t];
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(fs_.WritesIssued(), kThreads * kWritesPerThread);
  int total_failures = 0;
  for (int f : failures) total_failures += f;
  EXPECT_EQ(total_failures, 1);
}

TEST(FaultFileSystemOverPosix, InjectsAndRecoversOnARealDirectory) {
  std::string dir = testing::TempDir() + "ckpt_fault_file_system_test_XXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  FaultFileSystem fs(PosixFileSystem());
  const std::string path = dir + "/f";
  {
    auto file = fs.NewWritableFile(path, OpenMode::kTruncate);
    ASSERT_TRUE(IsOk(file));
    fs.FailNthWrite(2);
    fs.SetCapacityBytes(10);
    EXPECT_TRUE(IsOk((*file)->Append("12345")));
    EXPECT_EQ((*file)->Append("678").code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ((*file)->Append("678901").code(), absl::StatusCode::kResourceExhausted);
    EXPECT_TRUE(IsOk((*file)->Append("67890")));
    EXPECT_TRUE(IsOk((*file)->Sync()));
    EXPECT_TRUE(IsOk((*file)->Close()));
  }
  EXPECT_EQ(*ReadFileToString(&fs, path), "1234567890");
  EXPECT_EQ(*fs.FreeSpaceBytes(dir), 0u);
  EXPECT_TRUE(IsOk(WriteStringToFileAtomically(&fs, dir + "/COMMITTED", "")));  // 0 bytes fit
  EXPECT_TRUE(IsOk(DeleteRecursively(&fs, dir)));
  EXPECT_FALSE(*PosixFileSystem()->FileExists(dir));
}

}  // namespace
}  // namespace ckpt
