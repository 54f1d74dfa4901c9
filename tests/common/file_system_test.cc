// One behavioural suite run over PosixFileSystem (in a fresh temporary
// directory) and MemFileSystem, so the test double is held to the real
// thing; then MemFileSystem's crash model (DropUnsyncedData).
#include "common/file_system.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/mem_file_system.h"

namespace ckpt {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

testing::AssertionResult IsOk(const absl::Status& status) {
  if (status.ok()) return testing::AssertionSuccess();
  return testing::AssertionFailure() << status;
}
template <typename T>
testing::AssertionResult IsOk(const absl::StatusOr<T>& result) {
  return IsOk(result.status());
}

std::span<std::byte> AsWritable(std::string& s) {
  return std::as_writable_bytes(std::span<char>(s));
}

enum class Kind { kPosix, kMem };
void PrintTo(Kind kind, std::ostream* os) { *os << (kind == Kind::kPosix ? "Posix" : "Mem"); }

class FileSystemTest : public testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    if (GetParam() == Kind::kPosix) {
      fs_ = PosixFileSystem();
      std::string dir_template = testing::TempDir() + "ckpt_file_system_test_XXXXXX";
      ASSERT_NE(::mkdtemp(dir_template.data()), nullptr);
      root_ = dir_template;
    } else {
      mem_ = std::make_unique<MemFileSystem>();
      fs_ = mem_.get();
      root_ = "/test";
      ASSERT_TRUE(IsOk(fs_->CreateDirs(root_)));
    }
  }

  void TearDown() override {
    if (GetParam() == Kind::kPosix && !root_.empty()) {
      EXPECT_TRUE(IsOk(DeleteRecursively(fs_, root_)));
      EXPECT_FALSE(*fs_->FileExists(root_));
    }
  }

  std::string Path(const std::string& name) const { return root_ + "/" + name; }

  // Writes `data` to `path` (truncating) and closes it; no sync.
  void Write(const std::string& path, std::string_view data) {
    absl::StatusOr<std::unique_ptr<WritableFile>> file =
        fs_->NewWritableFile(path, OpenMode::kTruncate);
    ASSERT_TRUE(IsOk(file));
    ASSERT_TRUE(IsOk((*file)->Append(data)));
    ASSERT_TRUE(IsOk((*file)->Close()));
  }

  std::string Read(const std::string& path) {
    absl::StatusOr<std::string> data = ReadFileToString(fs_, path);
    EXPECT_TRUE(IsOk(data));
    return data.ok() ? *data : "<error>";
  }

  FileSystem* fs_ = nullptr;
  std::unique_ptr<MemFileSystem> mem_;
  std::string root_;
};

TEST_P(FileSystemTest, AppendsAndReadsBack) {
  auto file = fs_->NewWritableFile(Path("f"), OpenMode::kTruncate);
  ASSERT_TRUE(IsOk(file));
  EXPECT_EQ((*file)->Size(), 0u);
  ASSERT_TRUE(IsOk((*file)->Append("hello, ")));
  ASSERT_TRUE(IsOk((*file)->Append(AsBytes("world"))));
  EXPECT_EQ((*file)->Size(), 12u);
  ASSERT_TRUE(IsOk((*file)->Sync()));
  ASSERT_TRUE(IsOk((*file)->Close()));
  EXPECT_EQ(Read(Path("f")), "hello, world");
  EXPECT_EQ(*fs_->GetFileSize(Path("f")), 12u);
}

TEST_P(FileSystemTest, EmptyFileReadsAsEmpty) {
  Write(Path("empty"), "");
  EXPECT_EQ(Read(Path("empty")), "");
  EXPECT_EQ(*fs_->GetFileSize(Path("empty")), 0u);
}

TEST_P(FileSystemTest, PositionedWritesLandWhereToldAndHolesReadAsZeros) {
  auto file = fs_->NewWritableFile(Path("f"), OpenMode::kTruncate);
  ASSERT_TRUE(IsOk(file));
  ASSERT_TRUE(IsOk((*file)->PositionedWrite(6, "world")));
  EXPECT_EQ((*file)->Size(), 11u);
  ASSERT_TRUE(IsOk((*file)->PositionedWrite(0, "hello")));
  EXPECT_EQ((*file)->Size(), 11u);
  ASSERT_TRUE(IsOk((*file)->Append("!")));  // at the end, not after the last write
  ASSERT_TRUE(IsOk((*file)->PositionedWrite(1, "E")));
  ASSERT_TRUE(IsOk((*file)->Close()));
  EXPECT_EQ(Read(Path("f")), std::string("hEllo\0world!", 12));
}

TEST_P(FileSystemTest, ConcurrentPositionedWritesOfDisjointRanges) {
  constexpr int kThreads = 4;
  constexpr int kChunksPerThread = 16;
  constexpr size_t kChunkBytes = 4096;
  auto file = fs_->NewWritableFile(Path("rank-00000.bin"), OpenMode::kTruncate);
  ASSERT_TRUE(IsOk(file));
  ASSERT_TRUE(IsOk((*file)->Preallocate(kThreads * kChunksPerThread * kChunkBytes)));
  std::vector<absl::Status> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Chunks interleave between threads: chunk c belongs to thread c % kThreads.
      for (int i = 0; i < kChunksPerThread && results[t].ok(); ++i) {
        const int chunk = i * kThreads + t;
        const std::string data(kChunkBytes, static_cast<char>('a' + chunk % 26));
        results[t] = (*file)->PositionedWrite(static_cast<uint64_t>(chunk) * kChunkBytes, data);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const absl::Status& status : results) EXPECT_TRUE(IsOk(status));
  ASSERT_TRUE(IsOk((*file)->Sync()));
  ASSERT_TRUE(IsOk((*file)->Close()));
  const std::string data = Read(Path("rank-00000.bin"));
  ASSERT_EQ(data.size(), kThreads * kChunksPerThread * kChunkBytes);
  for (int chunk = 0; chunk < kThreads * kChunksPerThread; ++chunk) {
    EXPECT_EQ(data.substr(chunk * kChunkBytes, kChunkBytes),
              std::string(kChunkBytes, static_cast<char>('a' + chunk % 26)))
        << "chunk " << chunk;
  }
}

TEST_P(FileSystemTest, ConcurrentAppendsNeverOverlap) {
  constexpr int kThreads = 4;
  constexpr int kAppendsPerThread = 50;
  auto file = fs_->NewWritableFile(Path("log"), OpenMode::kTruncate);
  ASSERT_TRUE(IsOk(file));
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kAppendsPerThread && results[t].ok(); ++i) {
        results[t] = (*file)->Append(std::string(8, static_cast<char>('0' + t)));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const absl::Status& status : results) EXPECT_TRUE(IsOk(status));
  ASSERT_TRUE(IsOk((*file)->Close()));
  const std::string data = Read(Path("log"));
  ASSERT_EQ(data.size(), size_t{kThreads * kAppendsPerThread * 8});
  std::vector<int> records(kThreads, 0);
  for (size_t i = 0; i < data.size(); i += 8) {
    const char c = data[i];
    ASSERT_EQ(data.substr(i, 8), std::string(8, c)) << "torn record at " << i;
    ++records[c - '0'];
  }
  for (int count : records) EXPECT_EQ(count, kAppendsPerThread);
}

TEST_P(FileSystemTest, AppendModeKeepsContentAndContinuesAtEnd) {
  Write(Path("f"), "abc");
  auto file = fs_->NewWritableFile(Path("f"), OpenMode::kAppend);
  ASSERT_TRUE(IsOk(file));
  EXPECT_EQ((*file)->Size(), 3u);
  ASSERT_TRUE(IsOk((*file)->Append("def")));
  ASSERT_TRUE(IsOk((*file)->PositionedWrite(0, "A")));  // not forced to the end
  ASSERT_TRUE(IsOk((*file)->Close()));
  EXPECT_EQ(Read(Path("f")), "Abcdef");
}

TEST_P(FileSystemTest, AppendModeCreatesMissingFile) {
  auto file = fs_->NewWritableFile(Path("new"), OpenMode::kAppend);
  ASSERT_TRUE(IsOk(file));
  ASSERT_TRUE(IsOk((*file)->Append("x")));
  ASSERT_TRUE(IsOk((*file)->Close()));
  EXPECT_EQ(Read(Path("new")), "x");
}

TEST_P(FileSystemTest, TruncateModeDiscardsContent) {
  Write(Path("f"), "old content");
  Write(Path("f"), "new");
  EXPECT_EQ(Read(Path("f")), "new");
}

TEST_P(FileSystemTest, CreateNewFailsIfFileExists) {
  auto file = fs_->NewWritableFile(Path("f"), OpenMode::kCreateNew);
  ASSERT_TRUE(IsOk(file));
  ASSERT_TRUE(IsOk((*file)->Close()));
  auto again = fs_->NewWritableFile(Path("f"), OpenMode::kCreateNew);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists) << again.status();
}

TEST_P(FileSystemTest, ReadsAreShortOnlyAtEndOfFile) {
  Write(Path("f"), "0123456789");
  auto file = fs_->NewReadableFile(Path("f"));
  ASSERT_TRUE(IsOk(file));
  EXPECT_EQ((*file)->Size(), 10u);
  std::string buf(4, '\0');
  EXPECT_EQ(*(*file)->PositionedRead(3, AsWritable(buf)), 4u);
  EXPECT_EQ(buf, "3456");
  EXPECT_EQ(*(*file)->PositionedRead(8, AsWritable(buf)), 2u);
  EXPECT_EQ(buf.substr(0, 2), "89");
  EXPECT_EQ(*(*file)->PositionedRead(10, AsWritable(buf)), 0u);
  EXPECT_EQ(*(*file)->PositionedRead(1000, AsWritable(buf)), 0u);
}

TEST_P(FileSystemTest, ReaderSeesDataWrittenAfterItOpened) {
  auto writer = fs_->NewWritableFile(Path("f"), OpenMode::kTruncate);
  ASSERT_TRUE(IsOk(writer));
  ASSERT_TRUE(IsOk((*writer)->Append("ab")));
  auto reader = fs_->NewReadableFile(Path("f"));
  ASSERT_TRUE(IsOk(reader));
  ASSERT_TRUE(IsOk((*writer)->Append("cd")));
  EXPECT_EQ((*reader)->Size(), 2u);  // the size at open
  std::string buf(8, '\0');
  EXPECT_EQ(*(*reader)->PositionedRead(0, AsWritable(buf)), 4u);
  EXPECT_EQ(buf.substr(0, 4), "abcd");
  EXPECT_EQ(Read(Path("f")), "abcd");  // ReadFileToString reads past Size() too
  ASSERT_TRUE(IsOk((*writer)->Close()));
}

TEST_P(FileSystemTest, CallsAfterCloseFailButCloseAgainIsOk) {
  auto file = fs_->NewWritableFile(Path("f"), OpenMode::kTruncate);
  ASSERT_TRUE(IsOk(file));
  ASSERT_TRUE(IsOk((*file)->Append("x")));
  ASSERT_TRUE(IsOk((*file)->Close()));
  EXPECT_TRUE(IsOk((*file)->Close()));
  EXPECT_EQ((*file)->Append("y").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*file)->PositionedWrite(0, "y").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*file)->Sync().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*file)->Preallocate(10).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Read(Path("f")), "x");
}

TEST_P(FileSystemTest, DestructorClosesUnclosedFile) {
  {
    auto file = fs_->NewWritableFile(Path("f"), OpenMode::kTruncate);
    ASSERT_TRUE(IsOk(file));
    ASSERT_TRUE(IsOk((*file)->Append("kept")));
  }
  EXPECT_EQ(Read(Path("f")), "kept");
}

TEST_P(FileSystemTest, PreallocateKeepsSize) {
  auto file = fs_->NewWritableFile(Path("f"), OpenMode::kTruncate);
  ASSERT_TRUE(IsOk(file));
  ASSERT_TRUE(IsOk((*file)->Preallocate(1 << 20)));
  EXPECT_EQ((*file)->Size(), 0u);
  ASSERT_TRUE(IsOk((*file)->Append("abc")));
  ASSERT_TRUE(IsOk((*file)->Close()));
  EXPECT_EQ(*fs_->GetFileSize(Path("f")), 3u);
}

TEST_P(FileSystemTest, OpenHandleFollowsRename) {
  auto file = fs_->NewWritableFile(Path("tmp"), OpenMode::kTruncate);
  ASSERT_TRUE(IsOk(file));
  ASSERT_TRUE(IsOk((*file)->Append("one ")));
  ASSERT_TRUE(IsOk(fs_->Rename(Path("tmp"), Path("final"))));
  ASSERT_TRUE(IsOk((*file)->Append("two")));
  ASSERT_TRUE(IsOk((*file)->Close()));
  EXPECT_FALSE(*fs_->FileExists(Path("tmp")));
  EXPECT_EQ(Read(Path("final")), "one two");
}

TEST_P(FileSystemTest, RenameReplacesExistingFile) {
  Write(Path("a"), "new");
  Write(Path("b"), "old");
  ASSERT_TRUE(IsOk(fs_->Rename(Path("a"), Path("b"))));
  EXPECT_FALSE(*fs_->FileExists(Path("a")));
  EXPECT_EQ(Read(Path("b")), "new");
  EXPECT_THAT(*fs_->ListDir(root_), ElementsAre("b"));
}

TEST_P(FileSystemTest, RenameMovesDirectoriesWithTheirContent) {
  ASSERT_TRUE(IsOk(fs_->CreateDirs(Path("d/sub"))));
  Write(Path("d/sub/f"), "data");
  ASSERT_TRUE(IsOk(fs_->CreateDir(Path("empty"))));
  ASSERT_TRUE(IsOk(fs_->Rename(Path("d"), Path("empty"))));  // over an empty directory
  EXPECT_EQ(Read(Path("empty/sub/f")), "data");
  EXPECT_FALSE(*fs_->FileExists(Path("d")));
}

TEST_P(FileSystemTest, RenameErrors) {
  Write(Path("f"), "x");
  ASSERT_TRUE(IsOk(fs_->CreateDirs(Path("d/sub"))));
  ASSERT_TRUE(IsOk(fs_->CreateDir(Path("e"))));
  absl::Status missing = fs_->Rename(Path("missing"), Path("g"));
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_THAT(missing.message(), HasSubstr("missing"));
  EXPECT_EQ(fs_->Rename(Path("f"), Path("no/such/dir")).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(fs_->Rename(Path("f"), Path("d")).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs_->Rename(Path("e"), Path("f")).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs_->Rename(Path("e"), Path("d")).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs_->Rename(Path("d"), Path("d/sub/inside")).code(),
            absl::StatusCode::kInvalidArgument);
  // Nothing moved.
  EXPECT_THAT(*fs_->ListDir(root_), ElementsAre("d", "e", "f"));
  EXPECT_TRUE(IsOk(fs_->Rename(Path("f"), Path("f"))));
  EXPECT_EQ(Read(Path("f")), "x");
}

TEST_P(FileSystemTest, ListDirReturnsSortedNamesOnly) {
  Write(Path("b"), "");
  Write(Path("a"), "");
  Write(Path("C"), "");
  ASSERT_TRUE(IsOk(fs_->CreateDir(Path("dir"))));
  Write(Path("dir/inner"), "");
  EXPECT_THAT(*fs_->ListDir(root_), ElementsAre("C", "a", "b", "dir"));
  EXPECT_THAT(*fs_->ListDir(Path("dir")), ElementsAre("inner"));
  ASSERT_TRUE(IsOk(fs_->CreateDir(Path("empty"))));
  EXPECT_THAT(*fs_->ListDir(Path("empty")), IsEmpty());
}

TEST_P(FileSystemTest, StatAndFileExists) {
  Write(Path("f"), "12345");
  ASSERT_TRUE(IsOk(fs_->CreateDir(Path("d"))));
  absl::StatusOr<FileStat> file = fs_->Stat(Path("f"));
  ASSERT_TRUE(IsOk(file));
  EXPECT_FALSE(file->is_directory);
  EXPECT_EQ(file->size_bytes, 5u);
  absl::StatusOr<FileStat> dir = fs_->Stat(Path("d"));
  ASSERT_TRUE(IsOk(dir));
  EXPECT_TRUE(dir->is_directory);
  EXPECT_TRUE(*fs_->FileExists(Path("f")));
  EXPECT_TRUE(*fs_->FileExists(Path("d")));
  EXPECT_FALSE(*fs_->FileExists(Path("missing")));
  EXPECT_FALSE(*fs_->FileExists(Path("missing/below")));
  EXPECT_FALSE(*fs_->FileExists(Path("f/below")));  // a file on the way
  EXPECT_EQ(fs_->Stat(Path("missing")).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(fs_->GetFileSize(Path("d")).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_P(FileSystemTest, DeleteFile) {
  Write(Path("f"), "x");
  ASSERT_TRUE(IsOk(fs_->DeleteFile(Path("f"))));
  EXPECT_FALSE(*fs_->FileExists(Path("f")));
  absl::Status again = fs_->DeleteFile(Path("f"));
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound) << again;
  ASSERT_TRUE(IsOk(fs_->CreateDir(Path("d"))));
  EXPECT_EQ(fs_->DeleteFile(Path("d")).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_P(FileSystemTest, OpenHandleOutlivesDelete) {
  Write(Path("f"), "still here");
  auto reader = fs_->NewReadableFile(Path("f"));
  ASSERT_TRUE(IsOk(reader));
  ASSERT_TRUE(IsOk(fs_->DeleteFile(Path("f"))));
  std::string buf(10, '\0');
  EXPECT_EQ(*(*reader)->PositionedRead(0, AsWritable(buf)), 10u);
  EXPECT_EQ(buf, "still here");
}

TEST_P(FileSystemTest, DeleteDirOnlyWhenEmpty) {
  ASSERT_TRUE(IsOk(fs_->CreateDir(Path("d"))));
  Write(Path("d/f"), "x");
  EXPECT_EQ(fs_->DeleteDir(Path("d")).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(IsOk(fs_->DeleteFile(Path("d/f"))));
  ASSERT_TRUE(IsOk(fs_->DeleteDir(Path("d"))));
  EXPECT_FALSE(*fs_->FileExists(Path("d")));
  EXPECT_EQ(fs_->DeleteDir(Path("d")).code(), absl::StatusCode::kNotFound);
  Write(Path("f"), "x");
  EXPECT_EQ(fs_->DeleteDir(Path("f")).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_P(FileSystemTest, CreateDirNeedsParentAndFreshName) {
  ASSERT_TRUE(IsOk(fs_->CreateDir(Path("d"))));
  EXPECT_EQ(fs_->CreateDir(Path("d")).code(), absl::StatusCode::kAlreadyExists);
  Write(Path("f"), "");
  EXPECT_EQ(fs_->CreateDir(Path("f")).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(fs_->CreateDir(Path("x/y")).code(), absl::StatusCode::kNotFound);
}

TEST_P(FileSystemTest, CreateDirsIsMkdirP) {
  ASSERT_TRUE(IsOk(fs_->CreateDirs(Path("job/42/ranks"))));
  EXPECT_TRUE(fs_->Stat(Path("job/42/ranks"))->is_directory);
  EXPECT_TRUE(IsOk(fs_->CreateDirs(Path("job/42/ranks"))));   // idempotent
  EXPECT_TRUE(IsOk(fs_->CreateDirs(Path("job//43/"))));       // odd spelling
  EXPECT_THAT(*fs_->ListDir(Path("job")), ElementsAre("42", "43"));
  Write(Path("file"), "");
  EXPECT_EQ(fs_->CreateDirs(Path("file")).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs_->CreateDirs(Path("file/sub")).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_P(FileSystemTest, MissingPathsAreNotFoundAndNamed) {
  const std::string missing = Path("no-such-file");
  const std::vector<absl::Status> errors = {
      fs_->NewReadableFile(missing).status(),
      fs_->GetFileSize(missing).status(),
      fs_->ListDir(missing).status(),
      fs_->Truncate(missing, 0),
      fs_->SyncDir(missing),
      fs_->FreeSpaceBytes(missing).status(),
      fs_->NewWritableFile(Path("no-such-dir/f"), OpenMode::kTruncate).status(),
      ReadFileToString(fs_, missing).status(),
  };
  for (const absl::Status& error : errors) {
    EXPECT_EQ(error.code(), absl::StatusCode::kNotFound) << error;
    EXPECT_THAT(error.message(), HasSubstr(root_ + "/no-such-"));
    EXPECT_THAT(error.message(), HasSubstr("No such file or directory"));
  }
}

TEST_P(FileSystemTest, WrongKindOfObjectIsFailedPrecondition) {
  ASSERT_TRUE(IsOk(fs_->CreateDir(Path("d"))));
  Write(Path("f"), "x");
  EXPECT_EQ(fs_->NewReadableFile(Path("d")).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs_->NewWritableFile(Path("d"), OpenMode::kAppend).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs_->ListDir(Path("f")).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs_->SyncDir(Path("f")).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs_->Truncate(Path("d"), 0).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs_->NewWritableFile(Path("f/g"), OpenMode::kTruncate).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_P(FileSystemTest, TruncateShrinksAndExtendsWithZeros) {
  Write(Path("f"), "0123456789");
  ASSERT_TRUE(IsOk(fs_->Truncate(Path("f"), 4)));
  EXPECT_EQ(Read(Path("f")), "0123");
  ASSERT_TRUE(IsOk(fs_->Truncate(Path("f"), 6)));
  EXPECT_EQ(Read(Path("f")), std::string("0123\0\0", 6));
}

TEST_P(FileSystemTest, SyncAndSyncDirSucceed) {
  ASSERT_TRUE(IsOk(fs_->CreateDir(Path("d"))));
  auto file = fs_->NewWritableFile(Path("d/f"), OpenMode::kTruncate);
  ASSERT_TRUE(IsOk(file));
  ASSERT_TRUE(IsOk((*file)->Append("x")));
  EXPECT_TRUE(IsOk((*file)->Sync()));
  EXPECT_TRUE(IsOk((*file)->Close()));
  EXPECT_TRUE(IsOk(fs_->SyncDir(Path("d"))));
  EXPECT_TRUE(IsOk(fs_->SyncDir(root_)));
}

TEST_P(FileSystemTest, FreeSpaceIsReported) {
  absl::StatusOr<uint64_t> free_bytes = fs_->FreeSpaceBytes(root_);
  ASSERT_TRUE(IsOk(free_bytes));
  EXPECT_GT(*free_bytes, 0u);
}

TEST_P(FileSystemTest, WriteStringToFileAtomicallyCreatesAndReplaces) {
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(fs_, Path("COMMITTED"), "v1")));
  EXPECT_EQ(Read(Path("COMMITTED")), "v1");
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(fs_, Path("COMMITTED"), "version two")));
  EXPECT_EQ(Read(Path("COMMITTED")), "version two");
  EXPECT_THAT(*fs_->ListDir(root_), ElementsAre("COMMITTED"));  // no temporary left
}

TEST_P(FileSystemTest, WriteStringToFileAtomicallyNeedsParent) {
  absl::Status status = WriteStringToFileAtomically(fs_, Path("missing/manifest.json"), "{}");
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(*fs_->ListDir(root_), IsEmpty());
}

TEST_P(FileSystemTest, WriteStringToFileAtomicallyIntoDirectoryNameFails) {
  ASSERT_TRUE(IsOk(fs_->CreateDir(Path("d"))));
  absl::Status status = WriteStringToFileAtomically(fs_, Path("d"), "x");
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(*fs_->ListDir(root_), ElementsAre("d"));  // temporary cleaned up
}

TEST_P(FileSystemTest, DeleteRecursivelyRemovesTree) {
  ASSERT_TRUE(IsOk(fs_->CreateDirs(Path("job/1/a"))));
  ASSERT_TRUE(IsOk(fs_->CreateDirs(Path("job/2"))));
  Write(Path("job/1/a/rank-00000.bin"), "x");
  Write(Path("job/1/manifest.json"), "{}");
  Write(Path("job/2/COMMITTED"), "");
  Write(Path("keep"), "k");
  ASSERT_TRUE(IsOk(DeleteRecursively(fs_, Path("job"))));
  EXPECT_THAT(*fs_->ListDir(root_), ElementsAre("keep"));
  EXPECT_TRUE(IsOk(DeleteRecursively(fs_, Path("job"))));  // already gone: OK
  ASSERT_TRUE(IsOk(DeleteRecursively(fs_, Path("keep"))));  // a plain file
  EXPECT_THAT(*fs_->ListDir(root_), IsEmpty());
}

TEST_P(FileSystemTest, PrivateFilesAreCreatedExclusivelyAndReadBack) {
  absl::StatusOr<std::unique_ptr<WritableFile>> file = fs_->NewPrivateWritableFile(Path("rec"));
  ASSERT_TRUE(IsOk(file));
  ASSERT_TRUE(IsOk((*file)->Append("record")));
  ASSERT_TRUE(IsOk((*file)->Close()));
  EXPECT_EQ(fs_->NewPrivateWritableFile(Path("rec")).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(*ReadPrivateFileToString(fs_, Path("rec")), "record");
  EXPECT_EQ(ReadPrivateFileToString(fs_, Path("missing")).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_P(FileSystemTest, WritePrivateFileAtomicallyCreatesAndReplaces) {
  ASSERT_TRUE(IsOk(WritePrivateFileAtomically(fs_, Path("incarnation"), "1\n")));
  ASSERT_TRUE(IsOk(WritePrivateFileAtomically(fs_, Path("incarnation"), "2\n")));
  EXPECT_EQ(*ReadPrivateFileToString(fs_, Path("incarnation")), "2\n");
  EXPECT_THAT(*fs_->ListDir(root_), ElementsAre("incarnation"));  // no temporary left
}

INSTANTIATE_TEST_SUITE_P(AllFileSystems, FileSystemTest, testing::Values(Kind::kPosix, Kind::kMem),
                         [](const testing::TestParamInfo<Kind>& info) {
                           return info.param == Kind::kPosix ? "Posix" : "Mem";
                         });

TEST(PosixErrorToStatus, MapsErrnoAndNamesOperationAndPath) {
  const absl::Status status = PosixErrorToStatus(ENOSPC, "write", "/d/f");
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(), "write '/d/f': No space left on device");
  EXPECT_EQ(PosixErrorToStatus(ENOENT, "op", "p").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(PosixErrorToStatus(EEXIST, "op", "p").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(PosixErrorToStatus(EDQUOT, "op", "p").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(PosixErrorToStatus(EACCES, "op", "p").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(PosixErrorToStatus(EPERM, "op", "p").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(PosixErrorToStatus(EINVAL, "op", "p").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PosixErrorToStatus(EIO, "op", "p").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(PosixErrorToStatus(ENOTEMPTY, "op", "p").code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(PosixErrorToStatus(EPIPE, "op", "p").code(), absl::StatusCode::kInternal);
}

// One instance for every caller (the first calls racing on 8 threads agree),
// and it is the real file system: bytes written with write(2) are read back
// through it, and what it writes is what stat(2) sees.
TEST(PosixFileSystem, IsOneInstanceOverTheRealFileSystem) {
  std::vector<FileSystem*> seen(8, nullptr);
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < seen.size(); ++i) threads.emplace_back([&seen, i] { seen[i] = PosixFileSystem(); });
    for (std::thread& t : threads) t.join();
  }
  ASSERT_NE(seen[0], nullptr);
  for (FileSystem* fs : seen) EXPECT_EQ(fs, seen[0]);
  FileSystem* fs = seen[0];
  std::string root = testing::TempDir() + "ckpt_file_system_test_XXXXXX";
  ASSERT_NE(::mkdtemp(root.data()), nullptr);
  const std::string by_posix = root + "/by_posix";
  {
    const int fd = ::open(by_posix.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, "written by write(2)", 19), 19);
    ASSERT_EQ(::close(fd), 0);
  }
  const absl::StatusOr<std::string> read = ReadFileToString(fs, by_posix);
  ASSERT_TRUE(IsOk(read));
  EXPECT_EQ(*read, "written by write(2)");
  const absl::StatusOr<FileStat> stat = fs->Stat(by_posix);
  ASSERT_TRUE(IsOk(stat));
  EXPECT_EQ(stat->size_bytes, 19u);
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(fs, root + "/by_fs", "0123456789abc")));
  struct stat st {};
  ASSERT_EQ(::stat((root + "/by_fs").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_size, 13);
  EXPECT_TRUE(IsOk(DeleteRecursively(fs, root)));
  EXPECT_NE(::access(root.c_str(), F_OK), 0);
}

TEST(PosixFileSystem, DeleteRecursivelyRemovesSymlinksWithoutFollowingThem) {
  FileSystem* fs = PosixFileSystem();
  std::string root = testing::TempDir() + "ckpt_file_system_test_XXXXXX";
  ASSERT_NE(::mkdtemp(root.data()), nullptr);
  ASSERT_TRUE(IsOk(fs->CreateDirs(root + "/outside")));
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(fs, root + "/outside/precious", "keep")));
  ASSERT_TRUE(IsOk(fs->CreateDirs(root + "/tree")));
  ASSERT_EQ(::symlink((root + "/outside").c_str(), (root + "/tree/link").c_str()), 0);
  ASSERT_TRUE(IsOk(DeleteRecursively(fs, root + "/tree")));
  EXPECT_FALSE(*fs->FileExists(root + "/tree"));
  EXPECT_EQ(*ReadFileToString(fs, root + "/outside/precious"), "keep");
  EXPECT_TRUE(IsOk(DeleteRecursively(fs, root)));
}

// ---- Private files on POSIX: what is checked, on the opened descriptor ----

class PrivateFileTest : public testing::Test {
 protected:
  void SetUp() override {
    root_ = testing::TempDir() + "ckpt_private_file_test_XXXXXX";
    ASSERT_NE(::mkdtemp(root_.data()), nullptr);
  }
  void TearDown() override { EXPECT_TRUE(IsOk(DeleteRecursively(fs_, root_))); }

  // A plain file of `mode` (not through the private calls).
  std::string Plant(const std::string& name, mode_t mode, std::string_view data = "x") {
    const std::string path = root_ + "/" + name;
    EXPECT_TRUE(IsOk(WriteStringToFileAtomically(fs_, path, data)));
    EXPECT_EQ(::chmod(path.c_str(), mode), 0);
    return path;
  }

  static mode_t ModeOf(const std::string& path) {
    struct stat st {};
    EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
    return st.st_mode & 07777;
  }

  FileSystem* fs_ = PosixFileSystem();
  std::string root_;
};

TEST_F(PrivateFileTest, CreatedFilesAreOwnerOnlyWhateverTheUmask) {
  const mode_t old = ::umask(0);
  absl::Status written = WritePrivateFileAtomically(fs_, root_ + "/rec", "r");
  ::umask(old);
  ASSERT_TRUE(IsOk(written));
  EXPECT_EQ(ModeOf(root_ + "/rec"), 0600u);
  EXPECT_THAT(*fs_->ListDir(root_), ElementsAre("rec"));
}

TEST_F(PrivateFileTest, CreateNeverFollowsOrReusesWhatIsThere) {
  const std::string target = Plant("target", 0600, "precious");
  ASSERT_EQ(::symlink(target.c_str(), (root_ + "/link").c_str()), 0);
  EXPECT_EQ(fs_->NewPrivateWritableFile(root_ + "/link").status().code(),
            absl::StatusCode::kAlreadyExists);
  // A symlink to a name that does not exist yet is not followed either.
  ASSERT_EQ(::symlink((root_ + "/nowhere").c_str(), (root_ + "/dangling").c_str()), 0);
  EXPECT_EQ(fs_->NewPrivateWritableFile(root_ + "/dangling").status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_FALSE(*fs_->FileExists(root_ + "/nowhere"));
  EXPECT_EQ(*ReadFileToString(fs_, target), "precious");
}

TEST_F(PrivateFileTest, ReadRefusesLinksOtherKindsAndFilesOthersMayWrite) {
  const std::string target = Plant("target", 0600);
  ASSERT_EQ(::symlink(target.c_str(), (root_ + "/link").c_str()), 0);
  absl::Status s = ReadPrivateFileToString(fs_, root_ + "/link").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("'" + root_ + "/link' (owner uid"));
  EXPECT_THAT(s.message(), HasSubstr("is a symbolic link"));
  EXPECT_THAT(s.message(), HasSubstr("remove it (rm '" + root_ + "/link')"));

  s = ReadPrivateFileToString(fs_, Plant("group-writable", 0620)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("mode 0620) is writable by other users"));
  s = ReadPrivateFileToString(fs_, Plant("world-writable", 0606)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;

  const std::string linked = Plant("linked", 0600);
  ASSERT_EQ(::link(linked.c_str(), (root_ + "/second-name").c_str()), 0);
  s = ReadPrivateFileToString(fs_, linked).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("has 2 hard links"));

  ASSERT_EQ(::mkfifo((root_ + "/fifo").c_str(), 0600), 0);
  s = ReadPrivateFileToString(fs_, root_ + "/fifo").status();  // must not block
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("is a fifo, not a regular file"));

  // Others may read (files of earlier versions were 0640): still private.
  EXPECT_EQ(*ReadPrivateFileToString(fs_, Plant("readable", 0644, "ok")), "ok");
}

TEST_F(PrivateFileTest, ReadRefusesAnotherUsersFileEvenAsRoot) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to uid 65534";
  const std::string path = Plant("foreign", 0600);
  ASSERT_EQ(::chown(path.c_str(), 65534, 65534), 0);
  absl::Status s = ReadPrivateFileToString(fs_, path).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("'" + path + "' belongs to uid 65534 (mode 0600), not to this "
                                     "process's user (uid 0)"));
}

TEST(CheckPrivateEntry, SaysWhatIsWrongAndWhatToRemove) {
  const uint32_t me = ::geteuid();
  EXPECT_TRUE(IsOk(CheckPrivateEntry("/m/pool.bin", PrivateKind::kFile, S_IFREG | 0600, me, 1,
                                     kNoAccessByOthers)));
  absl::Status s = CheckPrivateEntry("/m/pool.bin", PrivateKind::kFile, S_IFREG | 0666, me + 1, 1,
                                     kNoAccessByOthers);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("'/m/pool.bin' belongs to uid ", me + 1,
                                                  " (mode 0666), not to this process's user")));
  EXPECT_THAT(s.message(), HasSubstr("remove it (rm '/m/pool.bin')"));
  s = CheckPrivateEntry("/m/pool.bin", PrivateKind::kFile, S_IFREG | 0640, me, 1,
                        kNoAccessByOthers);
  EXPECT_THAT(s.message(), HasSubstr("mode 0640) is open to other users (at most 0600"));
  s = CheckPrivateEntry("/m", PrivateKind::kDirectory, S_IFDIR | 0777, me, 2, kNoWriteByOthers);
  EXPECT_THAT(s.message(), HasSubstr("mode 0777) is writable by other users (at most 0755"));
  EXPECT_THAT(s.message(), HasSubstr("remove it (rm -r '/m')"));
  s = CheckPrivateEntry("/m", PrivateKind::kDirectory, S_IFREG | 0600, me, 1, kNoWriteByOthers);
  EXPECT_THAT(s.message(), HasSubstr("is a regular file, not a directory"));
  EXPECT_TRUE(IsOk(
      CheckPrivateEntry("/m", PrivateKind::kDirectory, S_IFDIR | 0755, me, 2, kNoWriteByOthers)));
}

// ---- MemFileSystem's crash model ------------------------------------------

class MemFileSystemCrashTest : public testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(IsOk(fs_.CreateDirs("/ckpt/job"))); }

  // Creates /ckpt/job durably (each new directory's parent synced).
  void MakeDirsDurable() {
    ASSERT_TRUE(IsOk(fs_.SyncDir("/")));
    ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt")));
    ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/job")));
  }

  // Writes `data` to `path` and syncs the file (not its directory).
  void WriteSynced(const std::string& path, std::string_view data) {
    auto file = fs_.NewWritableFile(path, OpenMode::kTruncate);
    ASSERT_TRUE(IsOk(file));
    ASSERT_TRUE(IsOk((*file)->Append(data)));
    ASSERT_TRUE(IsOk((*file)->Sync()));
    ASSERT_TRUE(IsOk((*file)->Close()));
  }

  std::string Read(const std::string& path) {
    absl::StatusOr<std::string> data = ReadFileToString(&fs_, path);
    return data.ok() ? *data : data.status().ToString();
  }

  MemFileSystem fs_;
};

TEST_F(MemFileSystemCrashTest, SyncedFileInSyncedDirectorySurvives) {
  MakeDirsDurable();
  WriteSynced("/ckpt/job/f", "durable");
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/job")));
  fs_.DropUnsyncedData();
  EXPECT_EQ(Read("/ckpt/job/f"), "durable");
}

TEST_F(MemFileSystemCrashTest, UnsyncedBytesAreLost) {
  MakeDirsDurable();
  auto file = fs_.NewWritableFile("/ckpt/job/f", OpenMode::kTruncate);
  ASSERT_TRUE(IsOk(file));
  ASSERT_TRUE(IsOk((*file)->Append("synced ")));
  ASSERT_TRUE(IsOk((*file)->Sync()));
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/job")));
  ASSERT_TRUE(IsOk((*file)->Append("unsynced")));
  ASSERT_TRUE(IsOk((*file)->PositionedWrite(0, "S")));
  ASSERT_TRUE(IsOk((*file)->Close()));  // Close does not sync
  EXPECT_EQ(Read("/ckpt/job/f"), "Synced unsynced");
  fs_.DropUnsyncedData();
  EXPECT_EQ(Read("/ckpt/job/f"), "synced ");
}

TEST_F(MemFileSystemCrashTest, NeverSyncedFileInSyncedDirectoryComesBackEmpty) {
  MakeDirsDurable();
  auto file = fs_.NewWritableFile("/ckpt/job/f", OpenMode::kTruncate);
  ASSERT_TRUE(IsOk(file));
  ASSERT_TRUE(IsOk((*file)->Append("lost")));
  ASSERT_TRUE(IsOk((*file)->Close()));
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/job")));
  fs_.DropUnsyncedData();
  EXPECT_EQ(Read("/ckpt/job/f"), "");
}

TEST_F(MemFileSystemCrashTest, SyncedFileWithoutDirectorySyncDisappears) {
  MakeDirsDurable();
  WriteSynced("/ckpt/job/f", "data");
  fs_.DropUnsyncedData();
  EXPECT_FALSE(*fs_.FileExists("/ckpt/job/f"));
}

TEST_F(MemFileSystemCrashTest, NewDirectoryNeedsItsParentSynced) {
  MakeDirsDurable();
  ASSERT_TRUE(IsOk(fs_.CreateDir("/ckpt/job/7")));
  WriteSynced("/ckpt/job/7/rank-00000.bin", "bytes");
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/job/7")));  // not enough: /ckpt/job not synced
  fs_.DropUnsyncedData();
  EXPECT_FALSE(*fs_.FileExists("/ckpt/job/7"));

  ASSERT_TRUE(IsOk(fs_.CreateDir("/ckpt/job/7")));
  WriteSynced("/ckpt/job/7/rank-00000.bin", "bytes");
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/job/7")));
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/job")));
  fs_.DropUnsyncedData();
  EXPECT_EQ(Read("/ckpt/job/7/rank-00000.bin"), "bytes");
}

TEST_F(MemFileSystemCrashTest, UnsyncedDirectoryTreeVanishesEntirely) {
  // Nothing made durable since construction: everything below "/" goes.
  WriteSynced("/ckpt/job/f", "data");
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/job")));
  fs_.DropUnsyncedData();
  EXPECT_THAT(*fs_.ListDir("/"), IsEmpty());
}

TEST_F(MemFileSystemCrashTest, DeleteIsUndoneWithoutDirectorySync) {
  MakeDirsDurable();
  WriteSynced("/ckpt/job/f", "data");
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/job")));
  ASSERT_TRUE(IsOk(fs_.DeleteFile("/ckpt/job/f")));
  fs_.DropUnsyncedData();
  EXPECT_EQ(Read("/ckpt/job/f"), "data");

  ASSERT_TRUE(IsOk(fs_.DeleteFile("/ckpt/job/f")));
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/job")));
  fs_.DropUnsyncedData();
  EXPECT_FALSE(*fs_.FileExists("/ckpt/job/f"));
}

TEST_F(MemFileSystemCrashTest, RenameIsUndoneWithoutDirectorySync) {
  MakeDirsDurable();
  WriteSynced("/ckpt/job/COMMITTED", "old");
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/job")));
  WriteSynced("/ckpt/job/COMMITTED.tmp", "new");
  ASSERT_TRUE(IsOk(fs_.Rename("/ckpt/job/COMMITTED.tmp", "/ckpt/job/COMMITTED")));
  EXPECT_EQ(Read("/ckpt/job/COMMITTED"), "new");
  fs_.DropUnsyncedData();
  EXPECT_EQ(Read("/ckpt/job/COMMITTED"), "old");
  EXPECT_THAT(*fs_.ListDir("/ckpt/job"), ElementsAre("COMMITTED"));
}

TEST_F(MemFileSystemCrashTest, RenameOfUnsyncedFileIsDurableButContentIsNot) {
  // The classic bug the temp+Sync+rename protocol avoids: renaming before Sync.
  MakeDirsDurable();
  WriteSynced("/ckpt/job/COMMITTED", "old");
  auto file = fs_.NewWritableFile("/ckpt/job/tmp", OpenMode::kTruncate);
  ASSERT_TRUE(IsOk(file));
  ASSERT_TRUE(IsOk((*file)->Append("new")));
  ASSERT_TRUE(IsOk((*file)->Close()));
  ASSERT_TRUE(IsOk(fs_.Rename("/ckpt/job/tmp", "/ckpt/job/COMMITTED")));
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/job")));
  fs_.DropUnsyncedData();
  EXPECT_EQ(Read("/ckpt/job/COMMITTED"), "");  // the name survived, the bytes did not
}

TEST_F(MemFileSystemCrashTest, WriteStringToFileAtomicallyIsDurableAndAllOrNothing) {
  MakeDirsDurable();
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&fs_, "/ckpt/job/manifest.json", "{\"v\":1}")));
  fs_.DropUnsyncedData();
  EXPECT_EQ(Read("/ckpt/job/manifest.json"), "{\"v\":1}");
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&fs_, "/ckpt/job/manifest.json", "{\"v\":2}")));
  fs_.DropUnsyncedData();
  EXPECT_EQ(Read("/ckpt/job/manifest.json"), "{\"v\":2}");
  EXPECT_THAT(*fs_.ListDir("/ckpt/job"), ElementsAre("manifest.json"));
}

TEST_F(MemFileSystemCrashTest, TruncateIsDurableOnlyAfterFileSync) {
  MakeDirsDurable();
  WriteSynced("/ckpt/job/f", "0123456789");
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/job")));
  ASSERT_TRUE(IsOk(fs_.Truncate("/ckpt/job/f", 3)));
  fs_.DropUnsyncedData();
  EXPECT_EQ(Read("/ckpt/job/f"), "0123456789");

  ASSERT_TRUE(IsOk(fs_.Truncate("/ckpt/job/f", 3)));
  auto file = fs_.NewWritableFile("/ckpt/job/f", OpenMode::kAppend);
  ASSERT_TRUE(IsOk(file));
  ASSERT_TRUE(IsOk((*file)->Sync()));
  fs_.DropUnsyncedData();
  EXPECT_EQ(Read("/ckpt/job/f"), "012");
}

TEST_F(MemFileSystemCrashTest, HandlesOpenedBeforeCrashAreInvalidated) {
  MakeDirsDurable();
  WriteSynced("/ckpt/job/f", "data");
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/job")));
  auto writer = fs_.NewWritableFile("/ckpt/job/f", OpenMode::kAppend);
  ASSERT_TRUE(IsOk(writer));
  auto reader = fs_.NewReadableFile("/ckpt/job/f");
  ASSERT_TRUE(IsOk(reader));
  fs_.DropUnsyncedData();
  EXPECT_EQ((*writer)->Append("x").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*writer)->Sync().code(), absl::StatusCode::kFailedPrecondition);
  std::string buf(4, '\0');
  EXPECT_EQ((*reader)->PositionedRead(0, AsWritable(buf)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(IsOk((*writer)->Close()));
  EXPECT_EQ(Read("/ckpt/job/f"), "data");
}

TEST_F(MemFileSystemCrashTest, CrossDirectoryRenameRevertsPerDirectory) {
  // Documented model: each directory reverts on its own, so a rename out of an
  // unsynced source into a synced destination leaves both names.
  ASSERT_TRUE(IsOk(fs_.CreateDirs("/ckpt/other")));
  MakeDirsDurable();
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt")));
  WriteSynced("/ckpt/job/f", "data");
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/job")));
  ASSERT_TRUE(IsOk(fs_.Rename("/ckpt/job/f", "/ckpt/other/f")));
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/other")));
  fs_.DropUnsyncedData();
  EXPECT_EQ(Read("/ckpt/job/f"), "data");
  EXPECT_EQ(Read("/ckpt/other/f"), "data");
}

TEST_F(MemFileSystemCrashTest, DirectoryWithTwoSyncedNamesKeepsTheFirst) {
  // /ckpt/x and /ckpt/y are durable; then y moves into x (only x synced),
  // back to /ckpt, and x moves into y (only y synced): the synced sets now say
  // x contains y and y contains x. A crash must still give a tree.
  ASSERT_TRUE(IsOk(fs_.CreateDir("/ckpt/x")));
  ASSERT_TRUE(IsOk(fs_.CreateDir("/ckpt/y")));
  ASSERT_TRUE(IsOk(fs_.SyncDir("/")));
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt")));
  ASSERT_TRUE(IsOk(fs_.Rename("/ckpt/y", "/ckpt/x/y")));
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/x")));
  ASSERT_TRUE(IsOk(fs_.Rename("/ckpt/x/y", "/ckpt/y")));
  ASSERT_TRUE(IsOk(fs_.Rename("/ckpt/x", "/ckpt/y/x")));
  ASSERT_TRUE(IsOk(fs_.SyncDir("/ckpt/y")));
  fs_.DropUnsyncedData();
  // Breadth-first in name order, /ckpt's synced entries job, x and y come
  // first; x's synced child y and y's synced child x are second names, dropped.
  EXPECT_THAT(*fs_.ListDir("/ckpt"), ElementsAre("job", "x", "y"));
  EXPECT_THAT(*fs_.ListDir("/ckpt/x"), IsEmpty());
  EXPECT_THAT(*fs_.ListDir("/ckpt/y"), IsEmpty());
  EXPECT_TRUE(IsOk(DeleteRecursively(&fs_, "/ckpt")));
}

TEST(MemFileSystem, RejectsRelativeAndDotDotPaths) {
  MemFileSystem fs;
  EXPECT_EQ(fs.CreateDir("relative").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fs.NewWritableFile("", OpenMode::kTruncate).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fs.Stat("/a/../b").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(IsOk(fs.CreateDirs("/a/./b/")));
  EXPECT_TRUE(fs.Stat("/a//b")->is_directory);
}

TEST(MemFileSystem, RootCannotBeRemovedOrRenamed) {
  MemFileSystem fs;
  EXPECT_EQ(fs.DeleteDir("/").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs.Rename("/", "/x").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs.CreateDir("/").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(IsOk(fs.CreateDirs("/")));
  EXPECT_THAT(*fs.ListDir("/"), IsEmpty());
}

TEST(MemFileSystem, HugeWritesFailInsteadOfAllocating) {
  MemFileSystem fs;
  auto file = fs.NewWritableFile("/f", OpenMode::kTruncate);
  ASSERT_TRUE(IsOk(file));
  EXPECT_EQ((*file)->PositionedWrite(~uint64_t{0} - 1, "xy").code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(fs.Truncate("/f", uint64_t{1} << 60).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*file)->Size(), 0u);
}

}  // namespace
}  // namespace ckpt
