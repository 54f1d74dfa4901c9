#include "server/agent/arena.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include <gtest/gtest.h>

#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "support/temp_dir.h"

namespace ckpt::agent {
namespace {

using ckpt::testing::TempDir;

constexpr uint64_t kPage = kArenaPageBytes;

std::unique_ptr<Arena> OpenArena(const std::string& dir, uint64_t capacity) {
  absl::StatusOr<std::unique_ptr<Arena>> a = Arena::Open({dir, capacity, true});
  EXPECT_TRUE(a.ok()) << a.status();
  return a.ok() ? *std::move(a) : nullptr;
}

void Fill(Arena& arena, const std::vector<Extent>& extents, uint64_t size, uint32_t seed) {
  std::mt19937 rng(seed);
  arena.ForEachPiece(extents, size, [&](std::byte* p, uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>(rng());
  });
}

ShardRecord Record(Arena& arena, std::string job, uint64_t step, uint32_t rank,
                   std::vector<Extent> extents, uint64_t size) {
  ShardRecord r;
  r.id = {std::move(job), step, rank};
  r.size_bytes = size;
  r.extents = std::move(extents);
  r.crc32c = arena.Checksum(r.extents, size);
  ManifestItem item;
  item.name = "w";
  item.dtype = kDTypeBytes;
  item.length_bytes = size;
  r.items.push_back(item);
  r.manifest_digest = ManifestDigest(r.items);
  return r;
}

TEST(Arena, AllocatesPagesAndCoalescesOnFree) {
  TempDir dir = *TempDir::Create();
  auto arena = OpenArena(dir.path(), 16 * kPage);
  EXPECT_EQ(arena->free_bytes(), 16 * kPage);
  auto a = *arena->Allocate(1);          // 1 page
  auto b = *arena->Allocate(3 * kPage);  // 3 pages
  auto c = *arena->Allocate(kPage + 1);  // 2 pages
  EXPECT_EQ(a, (std::vector<Extent>{{0, kPage}}));
  EXPECT_EQ(b, (std::vector<Extent>{{kPage, 3 * kPage}}));
  EXPECT_EQ(c, (std::vector<Extent>{{4 * kPage, 2 * kPage}}));
  EXPECT_EQ(arena->free_bytes(), 10 * kPage);
  arena->Free(b);
  arena->Free(a);
  arena->Free(c);
  EXPECT_EQ(arena->free_bytes(), 16 * kPage);
  EXPECT_EQ(arena->largest_free_extent(), 16 * kPage);
}

TEST(Arena, SplitsAcrossHolesWhenNoSingleHoleFits) {
  TempDir dir = *TempDir::Create();
  auto arena = OpenArena(dir.path(), 8 * kPage);
  std::vector<std::vector<Extent>> pages;
  for (int i = 0; i < 8; ++i) pages.push_back(*arena->Allocate(kPage));
  arena->Free(pages[1]);
  arena->Free(pages[2]);
  arena->Free(pages[5]);
  auto e = *arena->Allocate(3 * kPage);
  ASSERT_EQ(e.size(), 2u);
  EXPECT_EQ(e[0], (Extent{kPage, 2 * kPage}));
  EXPECT_EQ(e[1], (Extent{5 * kPage, kPage}));
  EXPECT_EQ(arena->free_bytes(), 0u);
  absl::StatusOr<std::vector<Extent>> full = arena->Allocate(1);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(Arena, TrimReturnsTheTail) {
  TempDir dir = *TempDir::Create();
  auto arena = OpenArena(dir.path(), 8 * kPage);
  auto e = *arena->Allocate(6 * kPage);
  e = arena->Trim(e, 2 * kPage - 10);
  EXPECT_EQ(e, (std::vector<Extent>{{0, 2 * kPage}}));
  EXPECT_EQ(arena->free_bytes(), 6 * kPage);
}

TEST(Arena, ReadoptsIntactRecordsAfterRestartAndReportsCorruptOnes) {
  TempDir dir = *TempDir::Create();
  const uint64_t size = 3 * kPage + 100;
  std::vector<Extent> good_ext, bad_ext;
  {
    auto arena = OpenArena(dir.path(), 32 * kPage);
    good_ext = *arena->Allocate(size);
    bad_ext = *arena->Allocate(size);
    auto lease = *arena->Allocate(5 * kPage);  // an open lease: forgotten on restart
    Fill(*arena, good_ext, size, 1);
    Fill(*arena, bad_ext, size, 2);
    ASSERT_TRUE(arena->WriteRecord(Record(*arena, "job-a", 10, 0, good_ext, size)).ok());
    ASSERT_TRUE(arena->WriteRecord(Record(*arena, "job-a", 10, 1, bad_ext, size)).ok());
    // Corrupt one byte of the second holding behind the record's back.
    arena->Data(bad_ext[0].offset)[17] ^= std::byte{1};
  }  // the agent "dies": the pool file stays on the tmpfs
  auto arena = OpenArena(dir.path(), 32 * kPage);
  ASSERT_EQ(arena->adopted().size(), 1u);
  const ShardRecord& r = arena->adopted()[0];
  EXPECT_EQ(r.id.rank, 0u);
  EXPECT_EQ(r.extents, good_ext);
  EXPECT_EQ(r.items.size(), 1u);
  EXPECT_EQ(r.manifest_digest, ManifestDigest(r.items));
  ASSERT_EQ(arena->lost().size(), 1u);
  EXPECT_EQ(arena->lost()[0].id.rank, 1u);
  EXPECT_NE(arena->lost()[0].reason.find("crc32c"), std::string::npos);
  // Only the adopted holding's pages stay allocated.
  EXPECT_EQ(arena->free_bytes(), 32 * kPage - 4 * kPage);
  // The lost record is gone for good.
  auto again = OpenArena(dir.path(), 32 * kPage);
  EXPECT_EQ(again->adopted().size(), 1u);
  EXPECT_TRUE(again->lost().empty());
}

TEST(Arena, UnreadableAndOverlappingRecordsAreLostNotTrusted) {
  TempDir dir = *TempDir::Create();
  {
    auto arena = OpenArena(dir.path(), 16 * kPage);
    auto e = *arena->Allocate(kPage);
    Fill(*arena, e, kPage, 3);
    ASSERT_TRUE(arena->WriteRecord(Record(*arena, "j", 1, 0, e, kPage)).ok());
    // A second record claiming the same pages.
    ASSERT_TRUE(arena->WriteRecord(Record(*arena, "j", 1, 1, e, kPage)).ok());
    // A record pointing past the pool.
    ASSERT_TRUE(arena->WriteRecord(Record(*arena, "j", 1, 2, {{64 * kPage, kPage}}, kPage)).ok());
  }
  {
    const std::string junk = dir.path() + "/records/j.1.9.rec";
    int fd = ::open(junk.c_str(), O_WRONLY | O_CREAT, 0600);
    ASSERT_EQ(::write(fd, "{not json", 9), 9);
    ::close(fd);
  }
  auto arena = OpenArena(dir.path(), 16 * kPage);
  ASSERT_EQ(arena->adopted().size(), 1u);
  EXPECT_EQ(arena->adopted()[0].id.rank, 0u);
  EXPECT_EQ(arena->lost().size(), 3u);
}

TEST(Arena, RecordRoundTripsEveryField) {
  ShardRecord r;
  r.id = {"job", 7, 3};
  r.role = 2;
  r.size_bytes = 12345;
  r.crc32c = 0xdeadbeef;
  r.manifest_digest = 0xfedcba9876543210ull;
  r.extents = {{4096, 8192}, {65536, 4096}};
  r.run_id = "run-1";
  r.staged_unix_ms = 1700000000000;
  r.durable_path = "job/7/rank-00003.bin";
  ManifestItem it;
  it.name = "layer.0/w";
  it.dtype = 1;
  it.shape = {3, 4};
  it.offset_bytes = 64;
  it.length_bytes = 48;
  it.crc32c = 42;
  it.attributes = {{"k", "v"}};
  r.items = {it};
  const std::string enc = EncodeShardRecord(r);
  EXPECT_EQ(enc.rfind("ckpt-record-v2\n", 0), 0u);
  absl::StatusOr<ShardRecord> back = DecodeShardRecord(enc);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->id, r.id);
  EXPECT_EQ(back->role, 2);
  EXPECT_EQ(back->size_bytes, r.size_bytes);
  EXPECT_EQ(back->crc32c, r.crc32c);
  EXPECT_EQ(back->manifest_digest, r.manifest_digest);
  EXPECT_EQ(back->extents, r.extents);
  EXPECT_EQ(back->items, r.items);
  EXPECT_EQ(back->run_id, r.run_id);
  EXPECT_EQ(back->staged_unix_ms, r.staged_unix_ms);
  EXPECT_EQ(back->durable_path, r.durable_path);
  EXPECT_FALSE(back->segment.has_value());
  // An EC segment holding: no items, the segment's key and kind.
  r.items.clear();
  r.segment = SegmentId{"job", 7, 1, 2, 3};
  r.segment_kind = kSegmentParity;
  back = DecodeShardRecord(EncodeShardRecord(r));
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_TRUE(back->segment.has_value());
  EXPECT_EQ(*back->segment, *r.segment);
  EXPECT_EQ(back->segment_kind, kSegmentParity);
  EXPECT_TRUE(back->items.empty());
  EXPECT_FALSE(DecodeShardRecord("{\"format\":1,\"job\":\"../x\"}").ok());
}

TEST(Arena, TornOrCorruptRecordsAreRefused) {
  ShardRecord r;
  r.id = {"job", 7, 3};
  r.size_bytes = 100;
  r.extents = {{0, 4096}};
  ManifestItem it;
  it.name = "w";
  it.dtype = kDTypeBytes;
  it.length_bytes = 100;
  r.items = {it};
  const std::string enc = EncodeShardRecord(r);
  for (size_t n = 0; n < enc.size(); ++n) {
    EXPECT_FALSE(DecodeShardRecord(enc.substr(0, n)).ok()) << n;
  }
  for (size_t i = 0; i < enc.size(); i += 7) {
    std::string bad = enc;
    bad[i] ^= 0x20;
    EXPECT_FALSE(DecodeShardRecord(bad).ok()) << i;
  }
  EXPECT_FALSE(DecodeShardRecord(enc + "x").ok());
  EXPECT_FALSE(DecodeShardRecord("").ok());
  r.id.job_id = "../x";
  EXPECT_FALSE(DecodeShardRecord(EncodeShardRecord(r)).ok());
}

// Records written by earlier versions (JSON, format 1) are still re-adopted
// after an upgrade.
TEST(Arena, ReadoptsRecordsOfThePreviousJsonFormat) {
  TempDir dir = *TempDir::Create();
  uint32_t crc = 0;
  {
    auto arena = OpenArena(dir.path(), 16 * kPage);
    auto e = *arena->Allocate(2 * kPage);
    ASSERT_EQ(e, (std::vector<Extent>{{0, 2 * kPage}}));
    Fill(*arena, e, 5000, 11);
    crc = arena->Checksum(e, 5000);
  }
  // What the format-1 encoder wrote (nlohmann::json::dump of the record).
  const std::string json = absl::StrFormat(
      R"({"crc32c":%u,"digest":"0x00000000deadbeef","durable_path":"j/4/rank-00002.bin","extents":[[0,8192]],)"
      R"("format":1,"items":[{"attributes":{"py.type":"torch"},"crc32c":7,"dtype":1,"length":4000,"name":"w",)"
      R"("offset":0,"shape":[10,100]},{"crc32c":8,"dtype":14,"length":1000,"name":"b","offset":4000,"shape":[]}],)"
      R"("job":"j","rank":2,"role":1,"run_id":"r1","size":5000,"staged_ms":1700000000000,"step":4})",
      crc);
  {
    const std::string path = dir.path() + "/records/j.4.2.rec";
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT, 0600);
    ASSERT_EQ(::write(fd, json.data(), json.size()), static_cast<ssize_t>(json.size()));
    ::close(fd);
  }
  auto arena = OpenArena(dir.path(), 16 * kPage);
  ASSERT_TRUE(arena->lost().empty()) << arena->lost()[0].reason;
  ASSERT_EQ(arena->adopted().size(), 1u);
  const ShardRecord& r = arena->adopted()[0];
  EXPECT_EQ(r.id, (ShardId{"j", 4, 2}));
  EXPECT_EQ(r.size_bytes, 5000u);
  EXPECT_EQ(r.crc32c, crc);
  EXPECT_EQ(r.manifest_digest, 0xdeadbeefu);
  EXPECT_EQ(r.run_id, "r1");
  EXPECT_EQ(r.durable_path, "j/4/rank-00002.bin");
  ASSERT_EQ(r.items.size(), 2u);
  EXPECT_EQ(r.items[0].shape, (std::vector<uint64_t>{10, 100}));
  EXPECT_EQ(r.items[0].attributes.at("py.type"), "torch");
  EXPECT_EQ(r.items[1].offset_bytes, 4000u);
  EXPECT_EQ(arena->free_bytes(), 14 * kPage);
  // Written again (e.g. on flush), it is in the current format.
  ASSERT_TRUE(arena->WriteRecord(r).ok());
  auto again = OpenArena(dir.path(), 16 * kPage);
  ASSERT_EQ(again->adopted().size(), 1u);
  EXPECT_EQ(again->adopted()[0].items, r.items);
}

TEST(Arena, RefusesZeroCapacity) {
  TempDir dir = *TempDir::Create();
  EXPECT_EQ(Arena::Open({dir.path(), 0, true}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ckpt::agent
