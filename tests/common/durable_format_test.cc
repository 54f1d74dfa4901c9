// The durable-tier format: round trips on MemFileSystem (and once on the real
// file system), the crash model (a crash at every file-system operation of a
// flush, a commit and a delete), injected disk faults, corrupted rank files,
// tampered manifests and commit markers, and names that try to leave the
// version directory.
#include "common/durable_format.h"

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "common/crc32c.h"
#include "common/fault_file_system.h"
#include "common/file_system.h"
#include "common/manifest.h"
#include "common/mem_file_system.h"
#include "common/names.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

testing::AssertionResult IsOk(const absl::Status& status) {
  if (status.ok()) return testing::AssertionSuccess();
  return testing::AssertionFailure() << status;
}
template <typename T>
testing::AssertionResult IsOk(const absl::StatusOr<T>& result) {
  return IsOk(result.status());
}

// Checks the code and that the message contains every fragment.
testing::AssertionResult HasError(const absl::Status& status, absl::StatusCode code,
                                  std::vector<std::string> fragments = {}) {
  if (status.code() != code) {
    return testing::AssertionFailure()
           << "expected " << absl::StatusCodeToString(code) << ", got " << status;
  }
  for (const std::string& f : fragments) {
    if (status.message().find(f) == absl::string_view::npos) {
      return testing::AssertionFailure() << "message lacks \"" << f << "\": " << status;
    }
  }
  return testing::AssertionSuccess();
}
template <typename T>
testing::AssertionResult HasError(const absl::StatusOr<T>& result, absl::StatusCode code,
                                  std::vector<std::string> fragments = {}) {
  return HasError(result.status(), code, std::move(fragments));
}

constexpr int kF32 = 1;
constexpr int kBF16 = 3;
constexpr int kU8 = 9;
constexpr char kRoot[] = "/durable";
constexpr char kDir[] = "/durable/gpt/7";

// One rank's shard: its bytes and its manifest entry.
struct TestShard {
  std::string bytes;
  DurableShard shard;
};

ManifestItem Item(std::string name, int dtype, std::vector<uint64_t> shape, uint64_t offset,
                  uint64_t length) {
  ManifestItem item;
  item.name = std::move(name);
  item.dtype = dtype;
  item.shape = std::move(shape);
  item.offset_bytes = offset;
  item.length_bytes = length;
  return item;
}

// A shard of `size` bytes (at least 300): items "w", "b", "meta" and an empty
// one, with padding (zeros) between them and at the end, listed out of
// offset order. Item bytes are pseudo-random from `seed`.
TestShard MakeShard(uint32_t rank, uint64_t size = 300, uint32_t seed = 1) {
  TestShard t;
  t.bytes.assign(size, '\0');
  std::vector<ManifestItem> items = {
      Item("b", kBF16, {16}, 192, 32),
      Item("w", kF32, {4, 8}, 0, 128),
      Item("meta", kDTypeBytes, {40}, 224, 40),
      Item("empty", kF32, {0}, 264, 0),
  };
  items[2].attributes = {{"kind", "json"}, {"codec", "none"}};
  if (size > 300) {  // one large item, so reads cross chunk boundaries inside it
    items.push_back(Item("big", kDTypeBytes, {size - 400}, 320, size - 400));
  }
  std::mt19937 rng(seed * 7919 + rank);
  for (ManifestItem& item : items) {
    for (uint64_t i = 0; i < item.length_bytes; ++i) {
      t.bytes[item.offset_bytes + i] = static_cast<char>(rng());
    }
    item.crc32c = Crc32c(t.bytes.data() + item.offset_bytes, item.length_bytes);
  }
  t.shard.rank = rank;
  t.shard.file = RankFileName(rank);
  t.shard.size_bytes = size;
  t.shard.crc32c = Crc32c(t.bytes);
  t.shard.manifest_digest = ManifestDigest(items);
  t.shard.items = std::move(items);
  return t;
}

DurableManifest MakeManifest(const std::vector<TestShard>& shards) {
  DurableManifest m;
  m.job_id = "gpt";
  m.step = 7;
  m.world_size = static_cast<uint32_t>(shards.size());
  m.writer = "ckpt-agent 0.1.0";
  m.created_unix_ms = 1767225600000;
  for (const TestShard& t : shards) m.shards.push_back(t.shard);
  return m;
}

std::vector<TestShard> MakeShards(uint32_t world_size, uint64_t size = 300, uint32_t seed = 1) {
  std::vector<TestShard> shards;
  for (uint32_t r = 0; r < world_size; ++r) shards.push_back(MakeShard(r, size, seed));
  return shards;
}

// Writes one rank file through a RankFileWriter in `chunk`-byte appends.
absl::Status WriteRankFile(FileSystem* fs, const std::string& dir, const TestShard& t,
                           size_t chunk = 7) {
  absl::StatusOr<std::unique_ptr<RankFileWriter>> writer = RankFileWriter::Create(
      fs, DurableRankFilePath(dir, t.shard.rank), t.shard.size_bytes, t.shard.crc32c);
  if (!writer.ok()) return writer.status();
  for (size_t off = 0; off < t.bytes.size(); off += chunk) {
    const size_t n = std::min(chunk, t.bytes.size() - off);
    if (absl::Status s = (*writer)->Append(AsBytes(std::string_view(t.bytes).substr(off, n)));
        !s.ok()) {
      return s;
    }
  }
  return (*writer)->Commit();
}

// The whole flush of a version: every rank file, then the commit.
absl::Status WriteVersion(FileSystem* fs, const std::string& dir,
                          const std::vector<TestShard>& shards) {
  for (const TestShard& t : shards) {
    if (absl::Status s = WriteRankFile(fs, dir, t); !s.ok()) return s;
  }
  return WriteDurableManifest(fs, dir, MakeManifest(shards));
}

// Reads the version back and compares everything with what was written.
testing::AssertionResult ReadsBack(FileSystem* fs, const std::string& dir,
                                   const std::vector<TestShard>& shards) {
  absl::StatusOr<DurableManifest> m = ReadDurableManifest(fs, dir);
  if (!m.ok()) return testing::AssertionFailure() << "ReadDurableManifest: " << m.status();
  if (!(*m == MakeManifest(shards))) return testing::AssertionFailure() << "manifest differs";
  for (const TestShard& t : shards) {
    std::string out(t.bytes.size(), 'x');
    absl::Status s = ReadRankFile(fs, dir, m->shards[t.shard.rank],
                                  std::as_writable_bytes(std::span<char>(out)));
    if (!s.ok()) return testing::AssertionFailure() << "ReadRankFile: " << s;
    if (out != t.bytes) return testing::AssertionFailure() << "rank " << t.shard.rank << " differs";
  }
  return testing::AssertionSuccess();
}

std::string Read(FileSystem* fs, const std::string& path) {
  absl::StatusOr<std::string> data = ReadFileToString(fs, path);
  return data.ok() ? *data : data.status().ToString();
}

std::vector<std::string> List(FileSystem* fs, const std::string& dir) {
  absl::StatusOr<std::vector<std::string>> names = fs->ListDir(dir);
  return names.ok() ? *names : std::vector<std::string>{names.status().ToString()};
}

// The COMMITTED marker that goes with manifest.json `json` (docs/format.md).
std::string MarkerFor(const std::string& json) {
  return absl::StrFormat(
      "{\"format_version\":1,\"manifest\":\"manifest.json\",\"manifest_size_bytes\":%d,"
      "\"manifest_crc32c\":\"0x%08x\"}\n",
      json.size(), Crc32c(json));
}

// A FileSystem decorator for crash points and failures FaultFileSystem does
// not inject (renames). Every operation that changes the file system is one
// "op": creating/opening a file for writing, writes, Preallocate, Sync,
// CreateDir(s), DeleteFile/Dir, Rename, SyncDir, Truncate. From op
// `crash_at` on (1-based), every op fails without reaching the base, as if
// the process had died just before it. Single-threaded (tests only).
class ScriptedFileSystem : public FileSystem {
 public:
  explicit ScriptedFileSystem(FileSystem* base) : base_(base) {}

  void CrashAtOp(int64_t n) { crash_at_ = n; }
  // Renames whose destination ends with `suffix` fail with Unavailable.
  void FailRenamesTo(std::string suffix) { fail_rename_suffix_ = std::move(suffix); }
  bool crashed() const { return crash_at_ > 0 && ops_ >= crash_at_; }
  // Every op attempted, as "<op> <path>".
  const std::vector<std::string>& log() const { return log_; }

  absl::Status Op(const char* what, const std::string& path) {
    log_.push_back(absl::StrCat(what, " ", path));
    ++ops_;
    if (crash_at_ > 0 && ops_ >= crash_at_) {
      return absl::UnavailableError(absl::StrCat(what, " '", path, "': crashed (test)"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                                OpenMode mode) override {
    if (absl::Status s = Op("open", path); !s.ok()) return s;
    absl::StatusOr<std::unique_ptr<WritableFile>> file = base_->NewWritableFile(path, mode);
    if (!file.ok()) return file.status();
    return std::unique_ptr<WritableFile>(new File(this, *std::move(file), path));
  }
  absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override {
    return base_->NewReadableFile(path);
  }
  absl::StatusOr<FileStat> Stat(const std::string& path) override { return base_->Stat(path); }
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override {
    return base_->ListDir(path);
  }
  absl::Status CreateDir(const std::string& path) override {
    if (absl::Status s = Op("mkdir", path); !s.ok()) return s;
    return base_->CreateDir(path);
  }
  absl::Status CreateDirs(const std::string& path) override {
    if (absl::Status s = Op("mkdirs", path); !s.ok()) return s;
    return base_->CreateDirs(path);
  }
  absl::Status DeleteFile(const std::string& path) override {
    if (absl::Status s = Op("unlink", path); !s.ok()) return s;
    return base_->DeleteFile(path);
  }
  absl::Status DeleteDir(const std::string& path) override {
    if (absl::Status s = Op("rmdir", path); !s.ok()) return s;
    return base_->DeleteDir(path);
  }
  absl::Status Rename(const std::string& src, const std::string& dst) override {
    if (absl::Status s = Op("rename", dst); !s.ok()) return s;
    if (!fail_rename_suffix_.empty() && dst.ends_with(fail_rename_suffix_)) {
      return absl::UnavailableError(absl::StrCat("rename '", src, "' to '", dst,
                                                 "': injected fault (test)"));
    }
    return base_->Rename(src, dst);
  }
  absl::Status SyncDir(const std::string& path) override {
    if (absl::Status s = Op("syncdir", path); !s.ok()) return s;
    return base_->SyncDir(path);
  }
  absl::Status Truncate(const std::string& path, uint64_t size_bytes) override {
    if (absl::Status s = Op("truncate", path); !s.ok()) return s;
    return base_->Truncate(path, size_bytes);
  }
  absl::StatusOr<uint64_t> FreeSpaceBytes(const std::string& path) override {
    return base_->FreeSpaceBytes(path);
  }

 private:
  class File : public WritableFile {
   public:
    File(ScriptedFileSystem* fs, std::unique_ptr<WritableFile> base, std::string path)
        : fs_(fs), base_(std::move(base)), path_(std::move(path)) {}
    absl::Status Append(std::span<const std::byte> data) override {
      if (absl::Status s = fs_->Op("write", path_); !s.ok()) return s;
      return base_->Append(data);
    }
    absl::Status PositionedWrite(uint64_t offset, std::span<const std::byte> data) override {
      if (absl::Status s = fs_->Op("pwrite", path_); !s.ok()) return s;
      return base_->PositionedWrite(offset, data);
    }
    absl::Status Preallocate(uint64_t size_bytes) override {
      if (absl::Status s = fs_->Op("fallocate", path_); !s.ok()) return s;
      return base_->Preallocate(size_bytes);
    }
    absl::Status Sync() override {
      if (absl::Status s = fs_->Op("sync", path_); !s.ok()) return s;
      return base_->Sync();
    }
    absl::Status Close() override { return base_->Close(); }
    uint64_t Size() const override { return base_->Size(); }

   private:
    ScriptedFileSystem* const fs_;
    const std::unique_ptr<WritableFile> base_;
    const std::string path_;
  };

  FileSystem* const base_;
  int64_t ops_ = 0;
  int64_t crash_at_ = 0;
  std::string fail_rename_suffix_;
  std::vector<std::string> log_;
};

class DurableFormatTest : public testing::Test {
 protected:
  void SetUp() override {
    // The durable root is configuration: it exists (durably) before any flush.
    ASSERT_TRUE(IsOk(mem_.CreateDirs(kRoot)));
    ASSERT_TRUE(IsOk(mem_.SyncDir("/")));
  }

  MemFileSystem mem_;
};

// --- paths ---

TEST(DurableVersionDir, JoinsRootJobAndDecimalStep) {
  EXPECT_EQ(*DurableVersionDir("/mnt/ckpt", "gpt-7b", 1200), "/mnt/ckpt/gpt-7b/1200");
  EXPECT_EQ(*DurableVersionDir("/mnt/ckpt/", "gpt", 0), "/mnt/ckpt/gpt/0");
  EXPECT_EQ(*DurableVersionDir("rel", "a.b_c", UINT64_MAX), "rel/a.b_c/18446744073709551615");
  EXPECT_EQ(DurableRankFilePath("/mnt/ckpt/gpt/3", 12), "/mnt/ckpt/gpt/3/rank-00012.bin");
}

TEST(DurableVersionDir, RejectsBadJobIdsAndRoots) {
  for (std::string bad : {"", "..", "../etc", "a/b", "Upper", ".hidden", "a..b"}) {
    EXPECT_TRUE(HasError(DurableVersionDir("/mnt/ckpt", bad, 1),
                         absl::StatusCode::kInvalidArgument, {"job id"}))
        << bad;
  }
  EXPECT_TRUE(HasError(DurableVersionDir("", "gpt", 1), absl::StatusCode::kInvalidArgument));
}

// --- round trip ---

TEST_F(DurableFormatTest, RoundTrip) {
  const std::vector<TestShard> shards = MakeShards(3);
  ASSERT_TRUE(IsOk(WriteVersion(&mem_, kDir, shards)));
  EXPECT_TRUE(ReadsBack(&mem_, kDir, shards));
  EXPECT_THAT(List(&mem_, kDir),
              testing::ElementsAre("COMMITTED", "manifest.json", "rank-00000.bin",
                                   "rank-00001.bin", "rank-00002.bin"));
  // And it all survives a crash.
  mem_.DropUnsyncedData();
  EXPECT_TRUE(ReadsBack(&mem_, kDir, shards));
}

// Format 2 (incremental versions): version 9's rank file holds one new item;
// its manifest refers to "w" and "meta" of version 7. Read offline, the
// shard comes out whole and self-contained; a reference that names no item
// of version 7, a version 7 that is not committed or a changed byte are
// errors, never wrong bytes.
TEST_F(DurableFormatTest, IncrementalVersionsReferToOlderVersionsFiles) {
  const std::vector<TestShard> base = MakeShards(1);
  ASSERT_TRUE(IsOk(WriteVersion(&mem_, kDir, base)));  // version 7
  const std::string dir9 = "/durable/gpt/9";
  EXPECT_EQ(DurableRefDir(dir9, 7), kDir);
  EXPECT_EQ(DurableRefDir(dir9 + "/", 7), kDir);
  TestShard t;
  t.bytes = std::string(64, '\x5a');
  ManifestItem own = Item("b", kBF16, {32}, 0, 64);
  own.crc32c = Crc32c(t.bytes);
  std::vector<ManifestItem> items = {own};
  for (const ManifestItem& b : base[0].shard.items) {
    if (b.name == "w" || b.name == "meta") {
      ManifestItem ref = b;
      ref.ref_step = 7;
      items.push_back(ref);
    }
  }
  t.shard.rank = 0;
  t.shard.file = RankFileName(0);
  t.shard.size_bytes = 64;
  t.shard.crc32c = Crc32c(t.bytes);
  t.shard.manifest_digest = ManifestDigest(items);
  t.shard.items = SortedByOffset(items);
  ASSERT_TRUE(IsOk(WriteRankFile(&mem_, dir9, t)));
  DurableManifest m = MakeManifest({t});
  m.step = 9;
  ASSERT_TRUE(IsOk(WriteDurableManifest(&mem_, dir9, m)));
  EXPECT_THAT(Read(&mem_, dir9 + "/manifest.json"), HasSubstr("\"format_version\": 2"));
  EXPECT_THAT(Read(&mem_, dir9 + "/manifest.json"), HasSubstr("\"ref_step\":7"));
  EXPECT_THAT(Read(&mem_, dir9 + "/COMMITTED"), HasSubstr("\"format_version\":2"));
  absl::StatusOr<DurableManifest> back = ReadDurableManifest(&mem_, dir9);
  ASSERT_TRUE(IsOk(back));
  EXPECT_EQ(back->format_version, 2);
  EXPECT_EQ(back->shards[0].items, t.shard.items);
  // The rank file alone checks out (references are not in it).
  std::string own_bytes(64, 'x');
  EXPECT_TRUE(IsOk(ReadRankFile(&mem_, dir9, back->shards[0], std::as_writable_bytes(std::span<char>(own_bytes)))));
  std::vector<std::byte> out;
  absl::StatusOr<DurableShard> dense = MaterializeDurableShard(&mem_, dir9, *back, back->shards[0], &out);
  ASSERT_TRUE(IsOk(dense));
  EXPECT_EQ(dense->size_bytes, out.size());
  EXPECT_EQ(dense->crc32c, Crc32c(out.data(), out.size()));
  EXPECT_EQ(dense->manifest_digest, ManifestDigest(dense->items));
  ASSERT_EQ(dense->items.size(), 3u);
  for (const ManifestItem& item : dense->items) {
    EXPECT_FALSE(item.ref_step) << item.name;
    EXPECT_EQ(item.offset_bytes % 64, 0u) << item.name;
    const std::string got(reinterpret_cast<const char*>(out.data()) + item.offset_bytes, item.length_bytes);
    if (item.name == "b") {
      EXPECT_EQ(got, t.bytes);
    } else {
      const auto& src = *std::find_if(base[0].shard.items.begin(), base[0].shard.items.end(),
                                      [&](const ManifestItem& b) { return b.name == item.name; });
      EXPECT_EQ(got, base[0].bytes.substr(src.offset_bytes, src.length_bytes)) << item.name;
    }
  }
  // A self-contained copy encodes as format 1 and reads back.
  DurableManifest copy = *back;
  copy.shards[0] = *dense;
  copy.format_version = kDurableFormatVersion;
  absl::StatusOr<std::string> json = EncodeDurableManifest(copy);
  ASSERT_TRUE(IsOk(json));
  EXPECT_THAT(*json, HasSubstr("\"format_version\": 1"));
  // A reference to bytes version 7 has no item at.
  DurableShard moved = back->shards[0];
  for (ManifestItem& item : moved.items) {
    if (item.name == "meta") item.offset_bytes += 1;
  }
  EXPECT_TRUE(HasError(MaterializeDurableShard(&mem_, dir9, *back, moved, &out), absl::StatusCode::kDataLoss,
                       {"holds no such item"}));
  // A flipped byte in version 7's "w": DataLoss naming it.
  const std::string file7 = DurableRankFilePath(kDir, 0);
  std::string corrupt = Read(&mem_, file7);
  corrupt[5] ^= 1;
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&mem_, file7, corrupt)));
  EXPECT_TRUE(HasError(MaterializeDurableShard(&mem_, dir9, *back, back->shards[0], &out),
                       absl::StatusCode::kDataLoss, {"\"w\""}));
  // Version 7 no longer committed: NotFound, naming it.
  ASSERT_TRUE(IsOk(DeleteDurableVersion(&mem_, kDir)));
  EXPECT_TRUE(HasError(MaterializeDurableShard(&mem_, dir9, *back, back->shards[0], &out),
                       absl::StatusCode::kNotFound, {"version 7"}));
  // A reference in a format-1 file, or to a version not older: invalid.
  std::string v1 = Read(&mem_, dir9 + "/manifest.json");
  v1 = absl::StrReplaceAll(v1, {{"\"format_version\": 2", "\"format_version\": 1"}});
  EXPECT_TRUE(HasError(ParseDurableManifest(v1), absl::StatusCode::kDataLoss, {"format_version 1"}));
  // Format 2 without any reference is not canonical (the writer says 1).
  absl::StatusOr<std::string> full = EncodeDurableManifest(MakeManifest(base));
  ASSERT_TRUE(IsOk(full));
  EXPECT_TRUE(HasError(ParseDurableManifest(absl::StrReplaceAll(*full, {{"\"format_version\": 1", "\"format_version\": 2"}})),
                       absl::StatusCode::kDataLoss, {"no item with a \"ref_step\""}));
  std::string later = absl::StrReplaceAll(Read(&mem_, dir9 + "/manifest.json"), {{"\"ref_step\":7", "\"ref_step\":9"}});
  EXPECT_TRUE(HasError(ParseDurableManifest(later), absl::StatusCode::kDataLoss, {"not older"}));
}

// A damaged manifest claiming an item of 1 TiB in a 100-byte file: DataLoss
// naming the file, before anything the size of the claim is allocated (it
// was allocated first: bad_alloc, or an ASan allocation-size error).
TEST_F(DurableFormatTest, AClaimBeyondTheFileIsDataLossNotAnAllocation) {
  const std::string path = "/ckpt/claims/rank-00000.bin";
  ASSERT_TRUE(IsOk(mem_.CreateDirs("/ckpt/claims")));
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&mem_, path, std::string(100, 'x'))));
  DurableShard shard;
  shard.rank = 0;
  shard.file = RankFileName(0);
  ManifestItem small = Item("small", kU8, {64}, 0, 64);
  small.crc32c = Crc32c(std::string(64, 'x'));
  ManifestItem huge = Item("huge", kU8, {uint64_t{1} << 40}, 64, uint64_t{1} << 40);
  shard.items = {small, huge};
  shard.size_bytes = (uint64_t{1} << 40) + 64;
  std::vector<std::byte> out;
  EXPECT_TRUE(HasError(MaterializeShard(&mem_, shard, [&](const ManifestItem&) { return path; }, &out),
                       absl::StatusCode::kDataLoss, {path, "(100 bytes) ends before item \"huge\""}));
  EXPECT_TRUE(out.empty());
  // Past the end by one byte, as well.
  shard.items = {small, Item("edge", kU8, {37}, 64, 37)};
  shard.size_bytes = 101;
  EXPECT_TRUE(HasError(MaterializeShard(&mem_, shard, [&](const ManifestItem&) { return path; }, &out),
                       absl::StatusCode::kDataLoss, {"ends before item \"edge\""}));
  shard.items[1] = Item("edge", kU8, {36}, 64, 36);
  shard.items[1].crc32c = Crc32c(std::string(36, 'x'));
  shard.size_bytes = 100;
  absl::StatusOr<DurableShard> dense =
      MaterializeShard(&mem_, shard, [&](const ManifestItem&) { return path; }, &out);
  ASSERT_TRUE(IsOk(dense));
  EXPECT_EQ(out.size(), dense->size_bytes);
}

TEST_F(DurableFormatTest, ReadsItemsAcrossChunkBoundaries) {
  // 9 MiB + 300: the item "big" spans the 8 MiB read chunk boundary.
  const std::vector<TestShard> shards = MakeShards(1, (uint64_t{9} << 20) + 300);
  for (const TestShard& t : shards) ASSERT_TRUE(IsOk(WriteRankFile(&mem_, kDir, t, 1 << 20)));
  ASSERT_TRUE(IsOk(WriteDurableManifest(&mem_, kDir, MakeManifest(shards))));
  EXPECT_TRUE(ReadsBack(&mem_, kDir, shards));
}

TEST_F(DurableFormatTest, RoundTripOnPosixFileSystem) {
  std::string root = testing::TempDir() + "ckpt_durable_format_test_XXXXXX";
  ASSERT_NE(::mkdtemp(root.data()), nullptr);
  FileSystem* fs = PosixFileSystem();
  const std::string dir = *DurableVersionDir(root, "gpt", 7);
  const std::vector<TestShard> shards = MakeShards(2);
  ASSERT_TRUE(IsOk(WriteVersion(fs, dir, shards)));
  EXPECT_TRUE(ReadsBack(fs, dir, shards));
  EXPECT_TRUE(IsOk(DeleteDurableVersion(fs, dir)));
  EXPECT_FALSE(*fs->FileExists(dir));
  EXPECT_TRUE(IsOk(DeleteRecursively(fs, root)));
}

TEST_F(DurableFormatTest, WriteIsIdempotentAndDeterministic) {
  const std::vector<TestShard> shards = MakeShards(2);
  ASSERT_TRUE(IsOk(WriteVersion(&mem_, kDir, shards)));
  const std::string manifest = Read(&mem_, absl::StrCat(kDir, "/manifest.json"));
  const std::string marker = Read(&mem_, absl::StrCat(kDir, "/COMMITTED"));
  EXPECT_EQ(marker, MarkerFor(manifest));
  ASSERT_TRUE(IsOk(WriteDurableManifest(&mem_, kDir, MakeManifest(shards))));
  EXPECT_EQ(Read(&mem_, absl::StrCat(kDir, "/manifest.json")), manifest);
  EXPECT_EQ(Read(&mem_, absl::StrCat(kDir, "/COMMITTED")), marker);
  EXPECT_EQ(*EncodeDurableManifest(MakeManifest(shards)), manifest);
  EXPECT_TRUE(ReadsBack(&mem_, kDir, shards));
  // No temporary files left behind.
  EXPECT_EQ(List(&mem_, kDir).size(), 4u);
}

TEST_F(DurableFormatTest, RewriteWithOtherContentReplacesTheMarker) {
  const std::vector<TestShard> shards = MakeShards(1);
  ASSERT_TRUE(IsOk(WriteVersion(&mem_, kDir, shards)));
  DurableManifest changed = MakeManifest(shards);
  changed.writer = "ckpt-agent 0.2.0";
  ASSERT_TRUE(IsOk(WriteDurableManifest(&mem_, kDir, changed)));
  absl::StatusOr<DurableManifest> read = ReadDurableManifest(&mem_, kDir);
  ASSERT_TRUE(IsOk(read));
  EXPECT_EQ(read->writer, "ckpt-agent 0.2.0");
}

// The manifest of docs/format.md's example.
DurableManifest ExampleManifest() {
  ManifestItem w = Item("layers.0.weight", kBF16, {2, 2}, 0, 8);
  w.crc32c = 0x1a2b3c4d;
  ManifestItem s = Item("step", 8 /* i64 */, {}, 64, 8);
  s.crc32c = 0x00c0ffee;
  s.attributes = {{"source", "optimizer"}};
  DurableManifest m;
  m.job_id = "gpt-7b";
  m.step = 1200;
  m.world_size = 1;
  m.writer = "ckpt-agent 0.1.0";
  m.created_unix_ms = 1767225600000;
  DurableShard shard;
  shard.rank = 0;
  shard.file = "rank-00000.bin";
  shard.size_bytes = 72;
  shard.crc32c = 0xe3069283;
  shard.items = {w, s};
  shard.manifest_digest = ManifestDigest(shard.items);
  m.shards = {shard};
  return m;
}

// The JSON layout is part of the format.
TEST(DurableManifestJson, HasTheDocumentedLayout) {
  const DurableManifest m = ExampleManifest();
  const std::string expected = absl::StrFormat(R"({
  "format_version": 1,
  "job_id": "gpt-7b",
  "step": 1200,
  "world_size": 1,
  "writer": "ckpt-agent 0.1.0",
  "created_unix_ms": 1767225600000,
  "shards": [
    {
      "rank": 0,
      "file": "rank-00000.bin",
      "size_bytes": 72,
      "crc32c": "0xe3069283",
      "manifest_digest": "0x%016x",
      "items": [
        {"name":"layers.0.weight","dtype":"bf16","shape":[2,2],"offset_bytes":0,"length_bytes":8,"crc32c":"0x1a2b3c4d","attributes":{}},
        {"name":"step","dtype":"i64","shape":[],"offset_bytes":64,"length_bytes":8,"crc32c":"0x00c0ffee","attributes":{"source":"optimizer"}}
      ]
    }
  ]
}
)",
                                               m.shards[0].manifest_digest);
  absl::StatusOr<std::string> json = EncodeDurableManifest(m);
  ASSERT_TRUE(IsOk(json));
  EXPECT_EQ(*json, expected);
  absl::StatusOr<DurableManifest> parsed = ParseDurableManifest(*json);
  ASSERT_TRUE(IsOk(parsed));
  EXPECT_EQ(*parsed, m);
}

TEST(DurableManifestJson, ItemsWithoutItemsAndEmptyShardsEncode) {
  DurableManifest m;
  m.job_id = "j";
  m.world_size = 1;
  DurableShard shard;
  shard.file = RankFileName(0);
  shard.manifest_digest = ManifestDigest({});
  m.shards = {shard};
  absl::StatusOr<std::string> json = EncodeDurableManifest(m);
  ASSERT_TRUE(IsOk(json));
  EXPECT_THAT(*json, HasSubstr("\"items\": []"));
  EXPECT_EQ(*ParseDurableManifest(*json), m);
}

TEST(DurableManifestJson, EncodeRejectsInconsistentManifests) {
  const DurableManifest good = MakeManifest(MakeShards(2));
  ASSERT_TRUE(IsOk(EncodeDurableManifest(good)));
  struct Case {
    std::string what;
    std::function<void(DurableManifest&)> change;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {"bad job id", [](DurableManifest& m) { m.job_id = "../etc"; }, "job id"},
      {"world size 0", [](DurableManifest& m) { m.world_size = 0; }, "world_size is 0"},
      {"world size", [](DurableManifest& m) { m.world_size = 3; }, "world_size is 3"},
      {"rank order", [](DurableManifest& m) { std::swap(m.shards[0], m.shards[1]); }, "shard 0 has rank 1"},
      {"escaping file", [](DurableManifest& m) { m.shards[1].file = "../x"; }, "rank 1 has file \"../x\""},
      {"other rank's file", [](DurableManifest& m) { m.shards[0].file = RankFileName(1); }, "must be \"rank-00000.bin\""},
      {"digest", [](DurableManifest& m) { m.shards[0].manifest_digest ^= 1; }, "manifest_digest"},
      {"overlap", [](DurableManifest& m) { m.shards[0].items[0].offset_bytes = 100; }, "overlap"},
      {"unknown dtype", [](DurableManifest& m) { m.shards[0].items[0].dtype = 99; }, "unknown dtype"},
      {"format version", [](DurableManifest& m) { m.format_version = 3; }, "format_version 3"},
      {"step above 2^53", [](DurableManifest& m) { m.step = uint64_t{1} << 53; }, "step is 9007199254740992"},
      {"attribute not UTF-8",
       [](DurableManifest& m) {
         // (assigned from a std::string: GCC 12 warns falsely on the literal)
         m.shards[0].items[2].attributes["k"] = std::string(1, '\xff');
         m.shards[0].manifest_digest = ManifestDigest(m.shards[0].items);
       },
       "UTF-8"},
  };
  for (const Case& c : cases) {
    DurableManifest m = good;
    c.change(m);
    EXPECT_TRUE(HasError(EncodeDurableManifest(m), absl::StatusCode::kInvalidArgument,
                         {c.fragment}))
        << c.what;
  }
}

// A manifest.json with one item of rank 0, its digest right (as a writer
// with a bug, or someone with write access to the durable root, would make).
std::string OneItemManifestJson(const ManifestItem& item, uint64_t size_bytes) {
  std::string shape;
  for (uint64_t d : item.shape) absl::StrAppend(&shape, shape.empty() ? "" : ",", d);
  return absl::StrFormat(
      R"({"format_version":1,"job_id":"gpt","step":7,"world_size":1,"writer":"t","created_unix_ms":0,)"
      R"("shards":[{"rank":0,"file":"rank-00000.bin","size_bytes":%d,"crc32c":"0x00000000",)"
      R"("manifest_digest":"0x%016x","items":[{"name":"%s","dtype":"%s","shape":[%s],"offset_bytes":%d,)"
      R"("length_bytes":%d,"crc32c":"0x%08x","attributes":{}}]}]})",
      size_bytes, ManifestDigest(std::vector<ManifestItem>{item}), item.name, DTypeName(item.dtype), shape,
      item.offset_bytes, item.length_bytes, item.crc32c);
}

// Issue 34 finding 5 in the durable tier: c128 [2^63, 2^61] of length 0
// (2^128 bytes, which wrapped to 0) was a valid manifest.json.
TEST(DurableManifestJson, ReaderRefusesAShapeWhoseSizeWrapsAround) {
  ManifestItem huge;
  huge.name = "huge";
  huge.dtype = 16;  // c128
  huge.shape = {uint64_t{1} << 63, uint64_t{1} << 61};
  const std::string json = OneItemManifestJson(huge, 64);
  EXPECT_TRUE(HasError(ParseDurableManifest(json), absl::StatusCode::kDataLoss,
                       {"rank 0", "\"huge\"", "is 0 bytes", "c128", "[9223372036854775808, 2305843009213693952]",
                        "more than 2^64"}));
  MemFileSystem fs;
  ASSERT_TRUE(IsOk(fs.CreateDirs(kDir)));
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&fs, absl::StrCat(kDir, "/manifest.json"), json)));
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&fs, absl::StrCat(kDir, "/COMMITTED"), MarkerFor(json))));
  EXPECT_TRUE(HasError(ReadDurableManifest(&fs, kDir), absl::StatusCode::kDataLoss, {"\"huge\"", "more than 2^64"}));
  // The writer refuses it as well (InvalidArgument, before any file).
  DurableManifest m;
  m.job_id = "gpt";
  m.step = 7;
  m.world_size = 1;
  DurableShard shard;
  shard.file = RankFileName(0);
  shard.size_bytes = 64;
  shard.items = {huge};
  shard.manifest_digest = ManifestDigest(shard.items);
  m.shards = {shard};
  EXPECT_TRUE(HasError(EncodeDurableManifest(m), absl::StatusCode::kInvalidArgument, {"\"huge\"", "more than 2^64"}));
}

// The reader holds manifest.json to the writer's number rule (at most 2^53-1,
// docs/format.md): what it accepts, the writer can write back.
TEST(DurableManifestJson, ReaderRefusesIntegersTheWriterWouldRefuse) {
  ManifestItem blob;
  blob.name = "blob";
  blob.dtype = kDTypeBytes;  // any length and shape
  blob.shape = {uint64_t{1} << 60};
  blob.length_bytes = 8;
  EXPECT_TRUE(HasError(ParseDurableManifest(OneItemManifestJson(blob, 64)), absl::StatusCode::kDataLoss,
                       {"\"blob\"", "shape dimension is 1152921504606846976", "above 2^53-1"}));
  blob.shape = {8};
  EXPECT_TRUE(IsOk(ParseDurableManifest(OneItemManifestJson(blob, 64))));
}

// --- RankFileWriter ---

TEST_F(DurableFormatTest, RankFileAppearsOnlyOnCommit) {
  const TestShard t = MakeShard(0);
  const std::string path = DurableRankFilePath(kDir, 0);
  absl::StatusOr<std::unique_ptr<RankFileWriter>> w =
      RankFileWriter::Create(&mem_, path, t.shard.size_bytes, t.shard.crc32c);
  ASSERT_TRUE(IsOk(w));
  // Parent directories were created; the data goes to a hidden temp file.
  const std::string temp = (*w)->temp_path();
  EXPECT_THAT(temp, testing::StartsWith(absl::StrCat(kDir, "/.rank-00000.bin.tmp-")));
  EXPECT_THAT(List(&mem_, kDir), testing::ElementsAre(temp.substr(temp.rfind('/') + 1)));
  ASSERT_TRUE(IsOk((*w)->Append(AsBytes(std::string_view(t.bytes).substr(0, 100)))));
  ASSERT_TRUE(IsOk((*w)->Append(AsBytes(std::string_view(t.bytes).substr(100)))));
  EXPECT_FALSE(*mem_.FileExists(path));
  EXPECT_EQ((*w)->bytes_written(), t.bytes.size());
  EXPECT_EQ((*w)->crc32c(), t.shard.crc32c);
  ASSERT_TRUE(IsOk((*w)->Commit()));
  EXPECT_THAT(List(&mem_, kDir), testing::ElementsAre("rank-00000.bin"));
  EXPECT_EQ(Read(&mem_, path), t.bytes);
  // Spent: later calls fail, Abandon and the destructor leave the file alone.
  EXPECT_TRUE(HasError((*w)->Append(AsBytes("x")), absl::StatusCode::kFailedPrecondition,
                       {"already committed"}));
  EXPECT_TRUE(HasError((*w)->Commit(), absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(IsOk((*w)->Abandon()));
  w->reset();
  EXPECT_EQ(Read(&mem_, path), t.bytes);
  // Committed means durable, including the new directories' names.
  mem_.DropUnsyncedData();
  EXPECT_EQ(Read(&mem_, path), t.bytes);
}

TEST_F(DurableFormatTest, CommitRefusesBytesThatDoNotMatch) {
  const TestShard t = MakeShard(0);
  const std::string path = DurableRankFilePath(kDir, 0);
  {  // One byte changed since the crc was taken.
    std::string changed = t.bytes;
    changed[5] ^= 1;
    auto w = *RankFileWriter::Create(&mem_, path, t.shard.size_bytes, t.shard.crc32c);
    ASSERT_TRUE(IsOk(w->Append(AsBytes(changed))));
    EXPECT_TRUE(HasError(w->Commit(), absl::StatusCode::kDataLoss,
                         {absl::StrFormat("crc32c 0x%08x", Crc32c(changed)),
                          absl::StrFormat("crc32c 0x%08x", t.shard.crc32c), "300 bytes"}));
    EXPECT_THAT(List(&mem_, kDir), IsEmpty());  // temp deleted, nothing renamed
    EXPECT_TRUE(HasError(w->Commit(), absl::StatusCode::kFailedPrecondition, {"failed earlier"}));
  }
  {  // Short.
    auto w = *RankFileWriter::Create(&mem_, path, t.shard.size_bytes, t.shard.crc32c);
    ASSERT_TRUE(IsOk(w->Append(AsBytes(std::string_view(t.bytes).substr(0, 299)))));
    EXPECT_TRUE(HasError(w->Commit(), absl::StatusCode::kDataLoss, {"wrote 299 bytes"}));
    EXPECT_THAT(List(&mem_, kDir), IsEmpty());
  }
  {  // Too long: refused at the Append.
    auto w = *RankFileWriter::Create(&mem_, path, t.shard.size_bytes, t.shard.crc32c);
    ASSERT_TRUE(IsOk(w->Append(AsBytes(t.bytes))));
    EXPECT_TRUE(HasError(w->Append(AsBytes("x")), absl::StatusCode::kInvalidArgument,
                         {"exceed the expected size of 300"}));
    EXPECT_THAT(List(&mem_, kDir), IsEmpty());
  }
}

TEST_F(DurableFormatTest, AbandonAndDestructorDeleteTheTempFile) {
  const TestShard t = MakeShard(0);
  const std::string path = DurableRankFilePath(kDir, 0);
  {
    auto w = *RankFileWriter::Create(&mem_, path, t.shard.size_bytes, t.shard.crc32c);
    ASSERT_TRUE(IsOk(w->Append(AsBytes(t.bytes))));
    EXPECT_EQ(List(&mem_, kDir).size(), 1u);
    EXPECT_TRUE(IsOk(w->Abandon()));
    EXPECT_THAT(List(&mem_, kDir), IsEmpty());
    EXPECT_TRUE(IsOk(w->Abandon()));
    EXPECT_TRUE(HasError(w->Commit(), absl::StatusCode::kFailedPrecondition, {"abandoned"}));
  }
  {
    auto w = *RankFileWriter::Create(&mem_, path, t.shard.size_bytes, t.shard.crc32c);
    ASSERT_TRUE(IsOk(w->Append(AsBytes(t.bytes))));
  }
  EXPECT_THAT(List(&mem_, kDir), IsEmpty());
  // A writer that replaces an existing rank file (a retried flush).
  ASSERT_TRUE(IsOk(WriteRankFile(&mem_, kDir, t)));
  ASSERT_TRUE(IsOk(WriteRankFile(&mem_, kDir, t)));
  EXPECT_THAT(List(&mem_, kDir), testing::ElementsAre("rank-00000.bin"));
}

TEST_F(DurableFormatTest, CreateRejectsPathsWithoutDirectoryOrName) {
  for (std::string bad : {"rank-00000.bin", "/durable/gpt/7/", "/durable/gpt/7/.."}) {
    EXPECT_TRUE(HasError(RankFileWriter::Create(&mem_, bad, 1, 0),
                         absl::StatusCode::kInvalidArgument))
        << bad;
  }
  // A file where a directory should be.
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&mem_, "/durable/gpt", "x")));
  EXPECT_TRUE(HasError(RankFileWriter::Create(&mem_, DurableRankFilePath(kDir, 0), 1, 0),
                       absl::StatusCode::kFailedPrecondition));
}

// --- crash model ---

// A crash at every single file-system operation of a flush (rank files and
// commit): before WriteDurableManifest returns OK the version is never
// readable after the crash, afterwards it always is, and a retry from
// scratch after the crash always succeeds.
TEST(DurableFormatCrash, CrashAtEveryOperationOfAFlush) {
  const std::vector<TestShard> shards = MakeShards(2);
  int64_t total_ops = 0;
  for (int64_t crash_at = 1;; ++crash_at) {
    MemFileSystem mem;
    ASSERT_TRUE(IsOk(mem.CreateDirs(kRoot)));
    ASSERT_TRUE(IsOk(mem.SyncDir("/")));
    ScriptedFileSystem fs(&mem);
    fs.CrashAtOp(crash_at);
    const absl::Status written = WriteVersion(&fs, kDir, shards);
    const bool crashed = fs.crashed();
    mem.DropUnsyncedData();
    if (!crashed) {
      ASSERT_TRUE(IsOk(written));
      EXPECT_TRUE(ReadsBack(&mem, kDir, shards));
      total_ops = crash_at - 1;
      break;
    }
    ASSERT_FALSE(written.ok()) << "crash at op " << crash_at;
    EXPECT_TRUE(HasError(ReadDurableManifest(&mem, kDir), absl::StatusCode::kNotFound))
        << "crash at op " << crash_at << " (" << fs.log().back() << ")";
    // The agent retries the task after restarting.
    ASSERT_TRUE(IsOk(WriteVersion(&mem, kDir, shards))) << "crash at op " << crash_at;
    mem.DropUnsyncedData();
    EXPECT_TRUE(ReadsBack(&mem, kDir, shards)) << "retry after crash at op " << crash_at;
  }
  EXPECT_GT(total_ops, 20);
}

// Same for a commit whose marker already exists for other content: the old
// marker must never be seen next to the new manifest.
TEST(DurableFormatCrash, CrashWhileReplacingACommittedManifest) {
  const std::vector<TestShard> shards = MakeShards(1);
  DurableManifest changed = MakeManifest(shards);
  changed.writer = "other";
  for (int64_t crash_at = 1;; ++crash_at) {
    MemFileSystem mem;
    ASSERT_TRUE(IsOk(mem.CreateDirs(kRoot)));
    ASSERT_TRUE(IsOk(mem.SyncDir("/")));
    ASSERT_TRUE(IsOk(WriteVersion(&mem, kDir, shards)));
    ScriptedFileSystem fs(&mem);
    fs.CrashAtOp(crash_at);
    const absl::Status written = WriteDurableManifest(&fs, kDir, changed);
    const bool crashed = fs.crashed();
    mem.DropUnsyncedData();
    absl::StatusOr<DurableManifest> read = ReadDurableManifest(&mem, kDir);
    if (!crashed) {
      ASSERT_TRUE(IsOk(written));
      ASSERT_TRUE(IsOk(read));
      EXPECT_EQ(read->writer, "other");
      break;
    }
    // Old version, new version or not committed; never a mismatch.
    EXPECT_TRUE(read.ok() || absl::IsNotFound(read.status()))
        << "crash at op " << crash_at << ": " << read.status();
  }
}

// A crash at every operation of a delete leaves the complete committed
// version or an uncommitted one, and deleting again finishes the job.
TEST(DurableFormatCrash, CrashAtEveryOperationOfADelete) {
  const std::vector<TestShard> shards = MakeShards(2);
  for (int64_t crash_at = 1;; ++crash_at) {
    MemFileSystem mem;
    ASSERT_TRUE(IsOk(mem.CreateDirs(kRoot)));
    ASSERT_TRUE(IsOk(mem.SyncDir("/")));
    ASSERT_TRUE(IsOk(WriteVersion(&mem, kDir, shards)));
    ScriptedFileSystem fs(&mem);
    fs.CrashAtOp(crash_at);
    const absl::Status deleted = DeleteDurableVersion(&fs, kDir);
    const bool crashed = fs.crashed();
    mem.DropUnsyncedData();
    if (!crashed) {
      ASSERT_TRUE(IsOk(deleted));
      EXPECT_FALSE(*mem.FileExists(kDir));
      break;
    }
    absl::StatusOr<DurableManifest> read = ReadDurableManifest(&mem, kDir);
    if (read.ok()) {
      EXPECT_TRUE(ReadsBack(&mem, kDir, shards)) << "crash at op " << crash_at;
    } else {
      EXPECT_TRUE(HasError(read, absl::StatusCode::kNotFound)) << "crash at op " << crash_at;
    }
    ASSERT_TRUE(IsOk(DeleteDurableVersion(&mem, kDir)));
    mem.DropUnsyncedData();
    EXPECT_FALSE(*mem.FileExists(kDir)) << "crash at op " << crash_at;
  }
}

// --- injected faults ---

class DurableFormatFaultTest : public DurableFormatTest {
 protected:
  // After a failed attempt: nothing committed (also after a crash), no rank
  // file or temp file of `rank` in the directory.
  void ExpectNothingCommitted() {
    EXPECT_TRUE(HasError(ReadDurableManifest(&fault_, kDir), absl::StatusCode::kNotFound));
  }
  void ExpectRetrySucceeds(const std::vector<TestShard>& shards) {
    fault_.Reset();
    ASSERT_TRUE(IsOk(WriteVersion(&fault_, kDir, shards)));
    mem_.DropUnsyncedData();
    EXPECT_TRUE(ReadsBack(&mem_, kDir, shards));
    EXPECT_EQ(List(&mem_, kDir).size(), shards.size() + 2);  // no leftovers
  }

  FaultFileSystem fault_{&mem_};
};

TEST_F(DurableFormatFaultTest, DiskFullOnAppend) {
  const std::vector<TestShard> shards = MakeShards(2);
  ASSERT_TRUE(IsOk(WriteRankFile(&fault_, kDir, shards[0])));
  // A file system that cannot preallocate reports ENOSPC on the write.
  fault_.FailNthWrite(3, absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(HasError(WriteRankFile(&fault_, kDir, shards[1]),
                       absl::StatusCode::kResourceExhausted, {"rank-00001.bin"}));
  EXPECT_THAT(List(&mem_, kDir), testing::ElementsAre("rank-00000.bin"));
  EXPECT_TRUE(HasError(WriteDurableManifest(&fault_, kDir, MakeManifest(shards)),
                       absl::StatusCode::kFailedPrecondition, {"rank 1", "does not exist"}));
  ExpectNothingCommitted();
  ExpectRetrySucceeds(shards);
}

TEST_F(DurableFormatFaultTest, DiskFullAtPreallocate) {
  const std::vector<TestShard> shards = MakeShards(2);
  ASSERT_TRUE(IsOk(WriteRankFile(&fault_, kDir, shards[0])));
  fault_.SetCapacityBytes(fault_.UsedBytes() + 299);  // one byte short
  EXPECT_TRUE(HasError(WriteRankFile(&fault_, kDir, shards[1]),
                       absl::StatusCode::kResourceExhausted, {"reserving 300 bytes"}));
  EXPECT_THAT(List(&mem_, kDir), testing::ElementsAre("rank-00000.bin"));
  ExpectNothingCommitted();
  ExpectRetrySucceeds(shards);
}

TEST_F(DurableFormatFaultTest, IoErrorOnAppend) {
  const std::vector<TestShard> shards = MakeShards(1);
  fault_.FailNthWrite(5);
  EXPECT_TRUE(HasError(WriteRankFile(&fault_, kDir, shards[0]), absl::StatusCode::kUnavailable,
                       {"injected fault"}));
  EXPECT_THAT(List(&mem_, kDir), IsEmpty());
  ExpectNothingCommitted();
  ExpectRetrySucceeds(shards);
}

TEST_F(DurableFormatFaultTest, FailedSyncs) {
  const std::vector<TestShard> shards = MakeShards(1);
  // Count the syncs of a whole flush, then fail each one in turn.
  {
    MemFileSystem mem;
    ASSERT_TRUE(IsOk(mem.CreateDirs(kRoot)));
    FaultFileSystem counter(&mem);
    ASSERT_TRUE(IsOk(WriteVersion(&counter, kDir, shards)));
    ASSERT_GE(counter.SyncsIssued(), 8);
  }
  for (int n = 1;; ++n) {
    MemFileSystem mem;
    ASSERT_TRUE(IsOk(mem.CreateDirs(kRoot)));
    ASSERT_TRUE(IsOk(mem.SyncDir("/")));
    FaultFileSystem fs(&mem);
    fs.FailNthSync(n);
    const absl::Status written = WriteVersion(&fs, kDir, shards);
    if (fs.SyncsIssued() < n) {  // every sync done: the flush is complete
      ASSERT_TRUE(IsOk(written));
      break;
    }
    EXPECT_TRUE(HasError(written, absl::StatusCode::kUnavailable, {"injected fault"}))
        << "sync " << n;
    // Live, the version is not committed, or (only the last directory sync
    // failed) complete but maybe not durable; after a crash, not committed.
    absl::StatusOr<DurableManifest> live = ReadDurableManifest(&fs, kDir);
    EXPECT_TRUE(live.ok() || absl::IsNotFound(live.status())) << live.status();
    mem.DropUnsyncedData();
    EXPECT_TRUE(HasError(ReadDurableManifest(&mem, kDir), absl::StatusCode::kNotFound))
        << "sync " << n;
    fs.Reset();
    ASSERT_TRUE(IsOk(WriteVersion(&fs, kDir, shards)));
    mem.DropUnsyncedData();
    EXPECT_TRUE(ReadsBack(&mem, kDir, shards)) << "sync " << n;
    EXPECT_EQ(List(&mem, kDir).size(), 3u) << "sync " << n;
  }
}

TEST_F(DurableFormatFaultTest, FailedRenames) {
  const std::vector<TestShard> shards = MakeShards(2);
  for (std::string target : {"rank-00001.bin", "manifest.json", "COMMITTED"}) {
    MemFileSystem mem;
    ASSERT_TRUE(IsOk(mem.CreateDirs(kRoot)));
    ASSERT_TRUE(IsOk(mem.SyncDir("/")));
    ScriptedFileSystem fs(&mem);
    fs.FailRenamesTo(target);
    EXPECT_TRUE(HasError(WriteVersion(&fs, kDir, shards), absl::StatusCode::kUnavailable,
                         {"injected fault"}))
        << target;
    EXPECT_TRUE(HasError(ReadDurableManifest(&mem, kDir), absl::StatusCode::kNotFound)) << target;
    for (const std::string& name : List(&mem, kDir)) {
      EXPECT_THAT(name, testing::Not(HasSubstr(".tmp-"))) << "leftover after " << target;
    }
    fs.FailRenamesTo("");
    ASSERT_TRUE(IsOk(WriteVersion(&fs, kDir, shards))) << target;
    mem.DropUnsyncedData();
    EXPECT_TRUE(ReadsBack(&mem, kDir, shards)) << target;
  }
}

// --- corrupted rank files ---

TEST_F(DurableFormatTest, CorruptedRankFileNamesTheItem) {
  const std::vector<TestShard> shards = MakeShards(2);
  ASSERT_TRUE(IsOk(WriteVersion(&mem_, kDir, shards)));
  const DurableManifest m = *ReadDurableManifest(&mem_, kDir);
  const std::string path = DurableRankFilePath(kDir, 1);
  std::string out(300, '\0');
  const auto read = [&] {
    return ReadRankFile(&mem_, kDir, m.shards[1], std::as_writable_bytes(std::span<char>(out)));
  };
  const auto flip = [&](uint64_t offset) {
    std::string bytes = shards[1].bytes;
    bytes[offset] ^= 0x10;
    ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&mem_, path, bytes)));
  };
  const auto item_crc = [&](const std::string& name) {
    for (const ManifestItem& item : m.shards[1].items) {
      if (item.name == name) return absl::StrFormat("0x%08x", item.crc32c);
    }
    return std::string("?");
  };

  flip(200);  // inside "b" [192, +32)
  EXPECT_TRUE(HasError(read(), absl::StatusCode::kDataLoss,
                       {"rank 1", "item \"b\" [192, +32)", item_crc("b"), "rank-00001.bin"}));
  flip(0);  // first byte of "w"
  EXPECT_TRUE(HasError(read(), absl::StatusCode::kDataLoss, {"item \"w\"", item_crc("w")}));
  flip(150);  // padding between "w" and "b"
  EXPECT_TRUE(HasError(read(), absl::StatusCode::kDataLoss, {"padding", "0x"}));
  flip(299);  // trailing padding
  EXPECT_TRUE(HasError(read(), absl::StatusCode::kDataLoss, {"padding"}));

  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&mem_, path, shards[1].bytes.substr(0, 299))));
  EXPECT_TRUE(HasError(read(), absl::StatusCode::kDataLoss, {"is 299 bytes", "says 300"}));
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&mem_, path, shards[1].bytes + "x")));
  EXPECT_TRUE(HasError(read(), absl::StatusCode::kDataLoss, {"is 301 bytes"}));
  ASSERT_TRUE(IsOk(mem_.DeleteFile(path)));
  EXPECT_TRUE(HasError(read(), absl::StatusCode::kNotFound));

  // The intact rank still reads.
  EXPECT_TRUE(IsOk(ReadRankFile(&mem_, kDir, m.shards[0],
                                std::as_writable_bytes(std::span<char>(out)))));
}

TEST_F(DurableFormatTest, CorruptionInsideALargeItemIsFoundAcrossChunks) {
  const std::vector<TestShard> shards = MakeShards(1, (uint64_t{9} << 20) + 300);
  ASSERT_TRUE(IsOk(WriteVersion(&mem_, kDir, shards)));
  std::string bytes = shards[0].bytes;
  bytes[(uint64_t{8} << 20) + 5] ^= 1;  // just past the first chunk, inside "big"
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&mem_, DurableRankFilePath(kDir, 0), bytes)));
  std::string out(bytes.size(), '\0');
  EXPECT_TRUE(HasError(ReadRankFile(&mem_, kDir, shards[0].shard,
                                    std::as_writable_bytes(std::span<char>(out))),
                       absl::StatusCode::kDataLoss, {"item \"big\""}));
}

TEST_F(DurableFormatTest, ReadRankFileChecksItsArguments) {
  const std::vector<TestShard> shards = MakeShards(1);
  ASSERT_TRUE(IsOk(WriteVersion(&mem_, kDir, shards)));
  std::string out(299, '\0');
  EXPECT_TRUE(HasError(ReadRankFile(&mem_, kDir, shards[0].shard,
                                    std::as_writable_bytes(std::span<char>(out))),
                       absl::StatusCode::kInvalidArgument, {"buffer of 299 bytes"}));
  out.resize(300);
  for (std::string bad : {"../x", "rank-00000.bin/../..", "rank-00001.bin", "manifest.json"}) {
    DurableShard shard = shards[0].shard;
    shard.file = bad;
    EXPECT_TRUE(HasError(ReadRankFile(&mem_, kDir, shard,
                                      std::as_writable_bytes(std::span<char>(out))),
                         absl::StatusCode::kInvalidArgument, {"is not \"rank-00000.bin\""}))
        << bad;
  }
}

// --- tampered manifests and markers ---

class DurableManifestTamperTest : public DurableFormatTest {
 protected:
  void SetUp() override {
    DurableFormatTest::SetUp();
    shards_ = MakeShards(2);
    ASSERT_TRUE(IsOk(WriteVersion(&mem_, kDir, shards_)));
    json_ = Read(&mem_, ManifestPath());
  }
  std::string ManifestPath() const { return absl::StrCat(kDir, "/manifest.json"); }
  std::string MarkerPath() const { return absl::StrCat(kDir, "/COMMITTED"); }

  // Replaces manifest.json with `json` and writes the marker that matches it,
  // as a writer with a bug (or a person) might.
  void Install(const std::string& json) {
    ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&mem_, ManifestPath(), json)));
    ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&mem_, MarkerPath(), MarkerFor(json))));
  }

  // json_ with the first `from` replaced by `to`.
  std::string Edited(const std::string& from, const std::string& to) const {
    std::string out = json_;
    const size_t pos = out.find(from);
    EXPECT_NE(pos, std::string::npos) << from;
    if (pos != std::string::npos) out.replace(pos, from.size(), to);
    return out;
  }

  std::vector<TestShard> shards_;
  std::string json_;
};

TEST_F(DurableManifestTamperTest, ManifestThatDoesNotMatchTheMarker) {
  std::string changed = json_;
  changed[changed.find("gpt")] = 'h';
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&mem_, ManifestPath(), changed)));
  EXPECT_TRUE(HasError(ReadDurableManifest(&mem_, kDir), absl::StatusCode::kDataLoss,
                       {"manifest.json", "COMMITTED marker records"}));
  ASSERT_TRUE(IsOk(mem_.DeleteFile(ManifestPath())));
  EXPECT_TRUE(HasError(ReadDurableManifest(&mem_, kDir), absl::StatusCode::kDataLoss,
                       {"no manifest.json"}));
}

TEST_F(DurableManifestTamperTest, BadMarkers) {
  struct Case {
    std::string marker;
    absl::StatusCode code;
    std::string fragment;
  };
  const std::string good = MarkerFor(json_);
  const std::vector<Case> cases = {
      {"", absl::StatusCode::kDataLoss, "not valid JSON"},
      {"COMMITTED\n", absl::StatusCode::kDataLoss, "not valid JSON"},
      {"[]", absl::StatusCode::kDataLoss, "not a JSON object"},
      {"{\"format_version\":1}", absl::StatusCode::kDataLoss, "no \"manifest\" field"},
      {absl::StrReplaceAll(good, {{"\"format_version\":1", "\"format_version\":3"}}),
       absl::StatusCode::kFailedPrecondition, "format_version 3"},
      {absl::StrReplaceAll(good, {{"\"manifest.json\"", "\"../other.json\""}}),
       absl::StatusCode::kDataLoss, "names manifest \"../other.json\""},
      {absl::StrReplaceAll(good, {{"\"0x", "\"0X"}}), absl::StatusCode::kDataLoss,
       "hex digits"},
  };
  for (const Case& c : cases) {
    ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&mem_, MarkerPath(), c.marker)));
    EXPECT_TRUE(HasError(ReadDurableManifest(&mem_, kDir), c.code, {c.fragment})) << c.marker;
  }
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&mem_, MarkerPath(), good)));
  EXPECT_TRUE(ReadsBack(&mem_, kDir, shards_));
}

TEST_F(DurableManifestTamperTest, MalformedManifests) {
  struct Case {
    std::string what;
    std::string json;
    absl::StatusCode code;
    std::string fragment;
  };
  const std::string file0 = "\"file\": \"rank-00000.bin\"";
  const DurableShard& s0 = shards_[0].shard;
  const std::vector<Case> cases = {
      {"not JSON", "{\"format_version\": 1,", absl::StatusCode::kDataLoss, "not valid JSON"},
      {"array", "[1, 2]", absl::StatusCode::kDataLoss, "not a JSON object"},
      {"newer format", Edited("\"format_version\": 1", "\"format_version\": 3"),
       absl::StatusCode::kFailedPrecondition, "format_version 3"},
      {"format as string", Edited("\"format_version\": 1", "\"format_version\": \"1\""),
       absl::StatusCode::kDataLoss, "\"format_version\" is of type string"},
      {"missing shards", Edited("\"shards\"", "\"shardz\""), absl::StatusCode::kDataLoss,
       "no \"shards\" field"},
      {"step as string", Edited("\"step\": 7", "\"step\": \"7\""), absl::StatusCode::kDataLoss,
       "\"step\" is of type string"},
      {"negative step", Edited("\"step\": 7", "\"step\": -7"), absl::StatusCode::kDataLoss,
       "\"step\" is a negative integer"},
      {"fractional size", Edited("\"size_bytes\": 300", "\"size_bytes\": 300.5"),
       absl::StatusCode::kDataLoss, "shard 0 field \"size_bytes\" is a fractional number"},
      {"bad job id", Edited("\"job_id\": \"gpt\"", "\"job_id\": \"../etc\""),
       absl::StatusCode::kDataLoss, "job id \"../etc\""},
      {"world size", Edited("\"world_size\": 2", "\"world_size\": 3"),
       absl::StatusCode::kDataLoss, "world_size 3 but 2 shards"},
      {"rank order", Edited("\"rank\": 0", "\"rank\": 1"), absl::StatusCode::kDataLoss,
       "shard 0 has rank 1"},
      {"escaping file", Edited(file0, "\"file\": \"../x\""), absl::StatusCode::kDataLoss,
       "rank 0 has file \"../x\""},
      {"escaping file 2", Edited(file0, "\"file\": \"rank-00000.bin/../..\""),
       absl::StatusCode::kDataLoss, "rank-00000.bin/../.."},
      {"absolute file", Edited(file0, "\"file\": \"/etc/passwd\""), absl::StatusCode::kDataLoss,
       "must be \"rank-00000.bin\""},
      {"other rank's file", Edited(file0, "\"file\": \"rank-00001.bin\""),
       absl::StatusCode::kDataLoss, "must be \"rank-00000.bin\""},
      {"unknown dtype", Edited("\"dtype\":\"bf16\"", "\"dtype\":\"bf17\""),
       absl::StatusCode::kDataLoss, "unknown dtype \"bf17\""},
      {"dtype as number", Edited("\"dtype\":\"bf16\"", "\"dtype\":3"),
       absl::StatusCode::kDataLoss, "\"dtype\" is a number, not a string"},
      {"shape element", Edited("\"shape\":[16]", "\"shape\":[\"16\"]"),
       absl::StatusCode::kDataLoss, "\"shape\" has an element"},
      {"attribute type", Edited("\"kind\":\"json\"", "\"kind\":1"), absl::StatusCode::kDataLoss,
       "attribute \"kind\" is not a string"},
      {"missing attributes", Edited(",\"attributes\":{}", ""), absl::StatusCode::kDataLoss,
       "no \"attributes\" field"},
      {"short crc", Edited(absl::StrFormat("\"crc32c\": \"0x%08x\"", s0.crc32c), "\"crc32c\": \"0x1\""),
       absl::StatusCode::kDataLoss, "\"crc32c\" is \"0x1\", not \"0x\" and 8 hex digits"},
      {"crc as number", Edited(absl::StrFormat("\"crc32c\": \"0x%08x\"", s0.crc32c), "\"crc32c\": 5"),
       absl::StatusCode::kDataLoss, "\"crc32c\" is a number, not a string"},
      {"digest", Edited(absl::StrFormat("\"0x%016x\"", s0.manifest_digest),
                        absl::StrFormat("\"0x%016x\"", s0.manifest_digest ^ 1)),
       absl::StatusCode::kDataLoss, "manifest_digest"},
      {"item crc changed (digest)",
       Edited(absl::StrFormat("\"crc32c\":\"0x%08x\"", s0.items[0].crc32c),
              absl::StrFormat("\"crc32c\":\"0x%08x\"", s0.items[0].crc32c ^ 1)),
       absl::StatusCode::kDataLoss, "items' digest"},
      {"item outside shard", Edited("\"offset_bytes\":192", "\"offset_bytes\":290"),
       absl::StatusCode::kDataLoss, "outside the shard"},
      {"overlap", Edited("\"offset_bytes\":192", "\"offset_bytes\":100"),
       absl::StatusCode::kDataLoss, "overlap"},
  };
  for (const Case& c : cases) {
    Install(c.json);
    EXPECT_TRUE(HasError(ReadDurableManifest(&mem_, kDir), c.code, {c.fragment})) << c.what;
    EXPECT_TRUE(HasError(ParseDurableManifest(c.json), c.code, {c.fragment})) << c.what;
  }
  // Unknown keys are ignored (format_version 1 grows additively).
  Install(Edited("\"writer\":", "\"comment\": {\"a\": [1]},\n  \"writer\":"));
  EXPECT_TRUE(ReadsBack(&mem_, kDir, shards_));
}

TEST_F(DurableFormatTest, CommitChecksTheRankFiles) {
  const std::vector<TestShard> shards = MakeShards(3);
  ASSERT_TRUE(IsOk(WriteRankFile(&mem_, kDir, shards[0])));
  ASSERT_TRUE(IsOk(WriteRankFile(&mem_, kDir, shards[2])));
  EXPECT_TRUE(HasError(WriteDurableManifest(&mem_, kDir, MakeManifest(shards)),
                       absl::StatusCode::kFailedPrecondition,
                       {"rank 1 file '/durable/gpt/7/rank-00001.bin' does not exist"}));
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&mem_, DurableRankFilePath(kDir, 1), "short")));
  EXPECT_TRUE(HasError(WriteDurableManifest(&mem_, kDir, MakeManifest(shards)),
                       absl::StatusCode::kFailedPrecondition,
                       {"rank 1", "is 5 bytes, the manifest says 300 bytes"}));
  DurableManifest escaping = MakeManifest(shards);
  escaping.shards[1].file = "../../etc/passwd";
  EXPECT_TRUE(HasError(WriteDurableManifest(&mem_, kDir, escaping),
                       absl::StatusCode::kInvalidArgument, {"rank 1 has file"}));
  EXPECT_THAT(List(&mem_, kDir),
              UnorderedElementsAre("rank-00000.bin", "rank-00001.bin", "rank-00002.bin"));
}

TEST_F(DurableFormatTest, NotCommittedIsNotFound) {
  EXPECT_TRUE(HasError(ReadDurableManifest(&mem_, kDir), absl::StatusCode::kNotFound,
                       {"does not exist"}));
  const std::vector<TestShard> shards = MakeShards(1);
  ASSERT_TRUE(IsOk(WriteRankFile(&mem_, kDir, shards[0])));
  EXPECT_TRUE(HasError(ReadDurableManifest(&mem_, kDir), absl::StatusCode::kNotFound,
                       {"not committed"}));
  // manifest.json alone does not commit a version.
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(&mem_, absl::StrCat(kDir, "/manifest.json"),
                                               *EncodeDurableManifest(MakeManifest(shards)))));
  EXPECT_TRUE(HasError(ReadDurableManifest(&mem_, kDir), absl::StatusCode::kNotFound,
                       {"not committed"}));
}

// --- delete ---

TEST_F(DurableFormatTest, DeleteRemovesTheMarkerFirstAndIsIdempotent) {
  const std::vector<TestShard> shards = MakeShards(2);
  ASSERT_TRUE(IsOk(WriteVersion(&mem_, kDir, shards)));
  // Leftovers of an interrupted flush go too.
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(
      &mem_, absl::StrCat(kDir, "/.rank-00000.bin.tmp-1-2"), "partial")));
  ScriptedFileSystem fs(&mem_);
  ASSERT_TRUE(IsOk(DeleteDurableVersion(&fs, kDir)));
  ASSERT_GE(fs.log().size(), 3u);
  EXPECT_EQ(fs.log()[0], "unlink /durable/gpt/7/COMMITTED");
  EXPECT_EQ(fs.log()[1], "syncdir /durable/gpt/7");
  EXPECT_EQ(fs.log().back(), "syncdir /durable/gpt");
  EXPECT_FALSE(*mem_.FileExists(kDir));
  EXPECT_TRUE(*mem_.FileExists("/durable/gpt"));
  mem_.DropUnsyncedData();
  EXPECT_FALSE(*mem_.FileExists(kDir));
  // Again, and on something that never existed.
  EXPECT_TRUE(IsOk(DeleteDurableVersion(&mem_, kDir)));
  EXPECT_TRUE(IsOk(DeleteDurableVersion(&mem_, "/durable/nothing/1")));
  EXPECT_TRUE(IsOk(DeleteDurableVersion(&mem_, "/nowhere/at/all")));
}

TEST_F(DurableFormatTest, DeleteOfAnUncommittedDirectory) {
  const std::vector<TestShard> shards = MakeShards(2);
  ASSERT_TRUE(IsOk(WriteRankFile(&mem_, kDir, shards[0])));
  EXPECT_TRUE(IsOk(DeleteDurableVersion(&mem_, kDir)));
  EXPECT_FALSE(*mem_.FileExists(kDir));
}

TEST_F(DurableFormatFaultTest, DeleteReportsAFailedMarkerSync) {
  const std::vector<TestShard> shards = MakeShards(1);
  ASSERT_TRUE(IsOk(WriteVersion(&mem_, kDir, shards)));
  fault_.FailNthSync(1);
  EXPECT_TRUE(HasError(DeleteDurableVersion(&fault_, kDir), absl::StatusCode::kUnavailable));
  // Nothing but the marker was touched; after a crash the version is whole.
  EXPECT_EQ(List(&mem_, kDir).size(), 2u);
  mem_.DropUnsyncedData();
  EXPECT_TRUE(ReadsBack(&mem_, kDir, shards));
  EXPECT_TRUE(IsOk(DeleteDurableVersion(&fault_, kDir)));
  EXPECT_FALSE(*mem_.FileExists(kDir));
}

// --- docs/format.md stays true ---

// The first fenced block of docs/format.md that opens with `fence`.
std::string DocBlock(const std::string& fence) {
  absl::StatusOr<std::string> doc =
      ReadFileToString(PosixFileSystem(), CKPT_SOURCE_DIR "/docs/format.md");
  if (!doc.ok()) return doc.status().ToString();
  const size_t start = doc->find(fence + "\n");
  if (start == std::string::npos) return "no " + fence + " block";
  const size_t body = start + fence.size() + 1;
  const size_t end = doc->find("\n```", body);
  return doc->substr(body, end - body + 1);
}

TEST(DurableFormatDoc, JsonExampleIsWhatTheWriterWrites) {
  absl::StatusOr<std::string> json = EncodeDurableManifest(ExampleManifest());
  ASSERT_TRUE(IsOk(json));
  EXPECT_EQ(DocBlock("```json"), *json);
}

// Runs `script` with /usr/bin/python3 and `arg`; returns (exit status, output).
std::pair<int, std::string> RunPython(const std::string& dir, const std::string& script,
                                      const std::string& arg) {
  const std::string script_path = dir + "/load.py";
  const std::string out_path = dir + "/load.out";
  EXPECT_TRUE(IsOk(WriteStringToFileAtomically(PosixFileSystem(), script_path, script)));
  const std::string command =
      absl::StrCat("/usr/bin/python3 '", script_path, "' '", arg, "' > '", out_path, "' 2>&1");
  const int status = std::system(command.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, Read(PosixFileSystem(), out_path)};
}

TEST(DurableFormatDoc, PythonLoaderReadsAVersion) {
  if (::access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "no /usr/bin/python3";
  std::string root = testing::TempDir() + "ckpt_durable_format_doc_XXXXXX";
  ASSERT_NE(::mkdtemp(root.data()), nullptr);
  FileSystem* fs = PosixFileSystem();
  const std::string dir = *DurableVersionDir(root, "gpt", 7);
  const std::vector<TestShard> shards = MakeShards(2);
  ASSERT_TRUE(IsOk(WriteVersion(fs, dir, shards)));

  const std::string script = DocBlock("```python") + R"(
import sys
v = load_version(sys.argv[1])
for rank in sorted(v):
    for name in sorted(v[rank]):
        print(rank, name, len(v[rank][name]), "%08x" % crc32c(v[rank][name]))
)";
  std::string expected;
  for (const TestShard& t : shards) {
    std::vector<ManifestItem> items = t.shard.items;
    std::sort(items.begin(), items.end(),
              [](const ManifestItem& a, const ManifestItem& b) { return a.name < b.name; });
    for (const ManifestItem& item : items) {
      absl::StrAppendFormat(&expected, "%d %s %d %08x\n", t.shard.rank, item.name,
                            item.length_bytes, item.crc32c);
    }
  }
  auto [status, output] = RunPython(root, script, dir);
  EXPECT_EQ(status, 0) << output;
  EXPECT_EQ(output, expected);

  // A flipped byte is refused.
  std::string bytes = shards[1].bytes;
  bytes[200] ^= 1;
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(fs, DurableRankFilePath(dir, 1), bytes)));
  std::tie(status, output) = RunPython(root, script, dir);
  EXPECT_NE(status, 0);
  EXPECT_THAT(output, HasSubstr("rank 1: size or crc32c mismatch"));
  EXPECT_TRUE(IsOk(DeleteRecursively(fs, root)));
}

}  // namespace
}  // namespace ckpt
