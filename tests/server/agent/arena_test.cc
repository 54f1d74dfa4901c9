#include "server/agent/arena.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <cstring>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "common/fault_file_system.h"
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

void Fill(const Reservation& r, uint64_t size, uint32_t seed) {
  std::mt19937 rng(seed);
  for (const auto& p : r.MutablePieces(0, size)) {
    for (auto& b : p) b = static_cast<std::byte>(rng());
  }
}

ShardRecord Record(const Reservation& bytes, std::string job, uint64_t step, uint32_t rank, uint64_t size) {
  ShardRecord r;
  r.id = {std::move(job), step, rank};
  r.size_bytes = size;
  r.extents = bytes.TrimmedExtents(size);
  r.crc32c = bytes.Crc(0, size);
  ManifestItem item;
  item.name = "w";
  item.dtype = kDTypeBytes;
  item.length_bytes = size;
  r.items.push_back(item);
  r.manifest_digest = ManifestDigest(r.items);
  return r;
}

size_t RecordFiles(const std::string& dir) {
  size_t n = 0;
  DIR* d = ::opendir((dir + "/records").c_str());
  while (dirent* e = ::readdir(d)) n += std::string(e->d_name).ends_with(".rec") ? 1 : 0;
  ::closedir(d);
  return n;
}

TEST(Arena, ReservesPagesAndFreesWithTheLastReference) {
  TempDir dir = *TempDir::Create();
  auto arena = OpenArena(dir.path(), 16 * kPage);
  EXPECT_EQ(arena->free_bytes(), 16 * kPage);
  ReservationPtr a = *arena->Reserve(1);          // 1 page
  ReservationPtr b = *arena->Reserve(3 * kPage);  // 3 pages
  ReservationPtr c = *arena->Reserve(kPage + 1);  // 2 pages
  EXPECT_EQ(a->extents(), (std::vector<Extent>{{0, kPage}}));
  EXPECT_EQ(b->extents(), (std::vector<Extent>{{kPage, 3 * kPage}}));
  EXPECT_EQ(c->extents(), (std::vector<Extent>{{4 * kPage, 2 * kPage}}));
  EXPECT_EQ(arena->free_bytes(), 10 * kPage);
  EXPECT_EQ(arena->live_reservations(), 3);
  ReservationPtr pin = b;  // a reader still holds b
  b.reset();
  EXPECT_EQ(arena->free_bytes(), 10 * kPage);
  pin.reset();
  a.reset();
  c.reset();
  EXPECT_EQ(arena->free_bytes(), 16 * kPage);
  EXPECT_EQ(arena->largest_free_extent(), 16 * kPage);
  EXPECT_EQ(arena->live_reservations(), 0);
}

TEST(Arena, SplitsAcrossHolesWhenNoSingleHoleFits) {
  TempDir dir = *TempDir::Create();
  auto arena = OpenArena(dir.path(), 8 * kPage);
  std::vector<ReservationPtr> pages;
  for (int i = 0; i < 8; ++i) pages.push_back(*arena->Reserve(kPage));
  pages[1].reset();
  pages[2].reset();
  pages[5].reset();
  ReservationPtr e = *arena->Reserve(3 * kPage);
  ASSERT_EQ(e->extents().size(), 2u);
  EXPECT_EQ(e->extents()[0], (Extent{kPage, 2 * kPage}));
  EXPECT_EQ(e->extents()[1], (Extent{5 * kPage, kPage}));
  EXPECT_EQ(arena->free_bytes(), 0u);
  EXPECT_EQ(arena->Reserve(1).status().code(), absl::StatusCode::kResourceExhausted);
  // Pieces and crc follow the extents in order.
  Fill(*e, 3 * kPage, 4);
  uint32_t crc = 0;
  for (const Extent& x : e->extents()) crc = Crc32cExtend(crc, arena->Data(x.offset), x.length);
  EXPECT_EQ(e->Crc(0, 3 * kPage), crc);
  EXPECT_EQ(e->Pieces(kPage + 10, kPage).size(), 2u);
}

TEST(Arena, TrimReturnsTheTail) {
  TempDir dir = *TempDir::Create();
  auto arena = OpenArena(dir.path(), 8 * kPage);
  ReservationPtr e = *arena->Reserve(6 * kPage);
  EXPECT_EQ(e->TrimmedExtents(2 * kPage - 10), (std::vector<Extent>{{0, 2 * kPage}}));
  e->Trim(2 * kPage - 10);
  EXPECT_EQ(e->extents(), (std::vector<Extent>{{0, 2 * kPage}}));
  EXPECT_EQ(arena->free_bytes(), 6 * kPage);
  e.reset();
  EXPECT_EQ(arena->free_bytes(), 8 * kPage);
}

// Issue 12 #6: sizes from the wire near 2^64 used to wrap in the page
// rounding and "succeed" with zero bytes.
TEST(Arena, SizesNearTwoToTheSixtyFourAreRefusedNotWrapped) {
  TempDir dir = *TempDir::Create();
  auto arena = OpenArena(dir.path(), 8 * kPage);
  for (uint64_t size : {UINT64_MAX, UINT64_MAX - 100, UINT64_MAX - kPage + 2, 8 * kPage + 1}) {
    absl::StatusOr<ReservationPtr> r = arena->Reserve(size);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << size;
  }
  EXPECT_EQ(arena->free_bytes(), 8 * kPage);
  EXPECT_EQ(arena->live_reservations(), 0);
}

// Issue 12 #6: a double free was caught only by assert (which aborted the
// daemon) or, without asserts, corrupted the free list.
TEST(Arena, DoubleFreeIsRefusedAndTheFreeListStaysIntact) {
  TempDir dir = *TempDir::Create();
  auto arena = OpenArena(dir.path(), 8 * kPage);
  ReservationPtr a = *arena->Reserve(2 * kPage);
  ReservationPtr b = *arena->Reserve(2 * kPage);
  const std::vector<Extent> a_extents = a->extents();
  a.reset();
  EXPECT_EQ(arena->free_bytes(), 6 * kPage);
  arena->FreeForTest(a_extents);                         // again: refused
  arena->FreeForTest(std::vector<Extent>{{kPage, 2 * kPage}});  // half free, half b's
  arena->FreeForTest(std::vector<Extent>{{64 * kPage, kPage}});  // outside the pool
  EXPECT_EQ(arena->bad_frees(), 3u);
  EXPECT_EQ(arena->free_bytes(), 6 * kPage);
  // b's pages are still b's: the next reservations never overlap them.
  ReservationPtr c = *arena->Reserve(6 * kPage);
  for (const Extent& x : c->extents()) {
    for (const Extent& y : b->extents()) EXPECT_TRUE(x.offset + x.length <= y.offset || y.offset + y.length <= x.offset);
  }
}

TEST(Arena, ReadoptsIntactRecordsAfterRestartAndReportsCorruptOnes) {
  TempDir dir = *TempDir::Create();
  const uint64_t size = 3 * kPage + 100;
  std::vector<Extent> good_ext;
  {
    auto arena = OpenArena(dir.path(), 32 * kPage);
    ReservationPtr good = *arena->Reserve(size);
    ReservationPtr bad = *arena->Reserve(size);
    ReservationPtr lease = *arena->Reserve(5 * kPage);  // an open lease: forgotten on restart
    Fill(*good, size, 1);
    Fill(*bad, size, 2);
    ShardRecord g = Record(*good, "job-a", 10, 0, size);
    ShardRecord b = Record(*bad, "job-a", 10, 1, size);
    ASSERT_TRUE(arena->WriteRecord(&g).ok());
    ASSERT_TRUE(arena->WriteRecord(&b).ok());
    EXPECT_NE(g.file, b.file);
    good_ext = good->extents();
    // Corrupt one byte of the second holding behind the record's back.
    arena->Data(bad->extents()[0].offset)[17] ^= std::byte{1};
    good.reset();
    bad.reset();
    lease.reset();
  }  // the agent "dies": the pool file stays on the tmpfs
  auto arena = OpenArena(dir.path(), 32 * kPage);
  std::vector<AdoptedHolding> adopted = arena->TakeAdopted();
  ASSERT_EQ(adopted.size(), 1u);
  const ShardRecord& r = adopted[0].record;
  EXPECT_EQ(r.id.rank, 0u);
  EXPECT_EQ(r.extents, good_ext);
  EXPECT_EQ(adopted[0].bytes->extents(), good_ext);
  EXPECT_EQ(r.items.size(), 1u);
  EXPECT_EQ(r.manifest_digest, ManifestDigest(r.items));
  ASSERT_EQ(arena->lost().size(), 1u);
  EXPECT_EQ(arena->lost()[0].id.rank, 1u);
  EXPECT_NE(arena->lost()[0].reason.find("crc32c"), std::string::npos);
  // Only the adopted holding's pages stay allocated.
  EXPECT_EQ(arena->free_bytes(), 32 * kPage - 4 * kPage);
  adopted.clear();
  EXPECT_EQ(arena->free_bytes(), 32 * kPage);
  arena.reset();
  // The lost record is gone for good.
  auto again = OpenArena(dir.path(), 32 * kPage);
  EXPECT_EQ(again->TakeAdopted().size(), 1u);
  EXPECT_TRUE(again->lost().empty());
}

TEST(Arena, UnreadableAndOverlappingRecordsAreLostNotTrusted) {
  TempDir dir = *TempDir::Create();
  {
    auto arena = OpenArena(dir.path(), 16 * kPage);
    ReservationPtr e = *arena->Reserve(kPage);
    Fill(*e, kPage, 3);
    ShardRecord r0 = Record(*e, "j", 1, 0, kPage);
    ShardRecord r1 = Record(*e, "j", 1, 1, kPage);  // a second record claiming the same pages
    ShardRecord r2 = Record(*e, "j", 1, 2, kPage);
    r2.extents = {{64 * kPage, kPage}};  // past the pool
    ASSERT_TRUE(arena->WriteRecord(&r0).ok());
    ASSERT_TRUE(arena->WriteRecord(&r1).ok());
    ASSERT_TRUE(arena->WriteRecord(&r2).ok());
  }
  {
    const std::string junk = dir.path() + "/records/j.1.9.rec";
    int fd = ::open(junk.c_str(), O_WRONLY | O_CREAT, 0600);
    ASSERT_EQ(::write(fd, "{not json", 9), 9);
    ::close(fd);
  }
  auto arena = OpenArena(dir.path(), 16 * kPage);
  std::vector<AdoptedHolding> adopted = arena->TakeAdopted();
  ASSERT_EQ(adopted.size(), 1u);
  EXPECT_EQ(adopted[0].record.id.rank, 0u);
  EXPECT_EQ(arena->lost().size(), 3u);
}

// Issue 12 #10: an extent [24186880, 2^64-4096] passed `offset + length >
// capacity` (the sum wraps), was adopted, and wrapped the free total too.
TEST(Arena, ExtentsWhoseEndWrapsAreLostNotAdopted) {
  TempDir dir = *TempDir::Create();
  const uint64_t capacity = 8192 * kPage;  // 32 MiB
  {
    auto arena = OpenArena(dir.path(), capacity);
    ReservationPtr e = *arena->Reserve(kPage);
    Fill(*e, kPage, 5);
    ShardRecord r = Record(*e, "j", 3, 0, kPage);
    r.extents = {{24186880, UINT64_MAX - 4095}};
    ASSERT_TRUE(arena->WriteRecord(&r).ok());
    ShardRecord r2 = Record(*e, "j", 3, 1, kPage);
    r2.extents = {{0, kPage}, {kPage, UINT64_MAX - kPage + 1}};  // the sum of lengths wraps
    ASSERT_TRUE(arena->WriteRecord(&r2).ok());
  }
  auto arena = OpenArena(dir.path(), capacity);
  EXPECT_TRUE(arena->TakeAdopted().empty());
  EXPECT_EQ(arena->lost().size(), 2u);
  EXPECT_EQ(arena->free_bytes(), capacity);
  // The whole pool is still usable, once.
  ReservationPtr all = *arena->Reserve(capacity);
  EXPECT_EQ(arena->Reserve(1).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(Arena, ANewerRecordOfAHoldingSupersedesTheOlderOne) {
  TempDir dir = *TempDir::Create();
  {
    auto arena = OpenArena(dir.path(), 16 * kPage);
    ReservationPtr e = *arena->Reserve(kPage);
    Fill(*e, kPage, 6);
    ShardRecord r = Record(*e, "j", 4, 0, kPage);
    ASSERT_TRUE(arena->WriteRecord(&r).ok());
    const std::string first = r.file;
    r.durable_path = "j/4/rank-00000.bin";
    ASSERT_TRUE(arena->WriteRecord(&r).ok());  // a crash before `first` was removed
    EXPECT_NE(r.file, first);
    EXPECT_EQ(RecordFiles(dir.path()), 2u);
  }
  auto arena = OpenArena(dir.path(), 16 * kPage);
  std::vector<AdoptedHolding> adopted = arena->TakeAdopted();
  ASSERT_EQ(adopted.size(), 1u);
  EXPECT_EQ(adopted[0].record.durable_path, "j/4/rank-00000.bin");
  EXPECT_TRUE(arena->lost().empty());
  EXPECT_EQ(RecordFiles(dir.path()), 1u);
  ASSERT_TRUE(arena->RemoveRecord(adopted[0].record.file).ok());
  EXPECT_EQ(RecordFiles(dir.path()), 0u);
  EXPECT_FALSE(arena->RemoveRecord("../pool.bin").ok());
}

TEST(Arena, RecordRoundTripsEveryField) {
  ShardRecord r;
  r.id = {"job", 7, 3};
  r.role = CopyRole::kReplica;
  r.size_bytes = 12345;
  r.crc32c = 0xdeadbeef;
  r.manifest_digest = 0xfedcba9876543210ull;
  r.extents = {{4096, 8192}, {65536, 4096}};
  r.run_id = "run-1";
  r.staged_unix_ms = 1700000000000;
  r.durable_path = "job/7/rank-00003.bin";
  r.seq = 99;
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
  EXPECT_EQ(back->role, CopyRole::kReplica);
  EXPECT_EQ(back->size_bytes, r.size_bytes);
  EXPECT_EQ(back->crc32c, r.crc32c);
  EXPECT_EQ(back->manifest_digest, r.manifest_digest);
  EXPECT_EQ(back->extents, r.extents);
  EXPECT_EQ(back->items, r.items);
  EXPECT_EQ(back->run_id, r.run_id);
  EXPECT_EQ(back->staged_unix_ms, r.staged_unix_ms);
  EXPECT_EQ(back->durable_path, r.durable_path);
  EXPECT_EQ(back->seq, 99u);
  EXPECT_FALSE(back->segment.has_value());
  // The packed manifest comes back with it (served to clients without
  // encoding it again), equal to the items' encoding.
  EXPECT_EQ(back->packed, EncodeManifest(r.items));
  EXPECT_EQ(PackedManifest(*back), EncodeManifest(r.items));
  // SetItems keeps items, encoding and digest together; a record built
  // without it encodes on demand.
  ShardRecord set;
  SetItems(set, r.items);
  EXPECT_EQ(set.packed, EncodeManifest(r.items));
  EXPECT_EQ(set.manifest_digest, ManifestDigest(r.items));
  EXPECT_EQ(PackedManifest(r), EncodeManifest(r.items));
  // An EC segment holding: no items, the segment's key and kind.
  r.items.clear();
  r.segment = SegmentId{"job", 7, 1, 2, 3};
  r.segment_kind = SegmentKind::kParity;
  back = DecodeShardRecord(EncodeShardRecord(r));
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_TRUE(back->segment.has_value());
  EXPECT_EQ(*back->segment, *r.segment);
  EXPECT_EQ(back->segment_kind, SegmentKind::kParity);
  EXPECT_TRUE(back->items.empty());
  EXPECT_FALSE(DecodeShardRecord("{\"format\":1,\"job\":\"../x\"}").ok());
  // A role or segment kind out of range is refused, in either format.
  EXPECT_FALSE(DecodeShardRecord(
                   R"({"format":1,"job":"j","step":1,"rank":0,"role":9,"size":1,"crc32c":0,"digest":"0x0",)"
                   R"("extents":[],"items":[]})")
                   .ok());
  r.role = static_cast<CopyRole>(9);
  EXPECT_FALSE(DecodeShardRecord(EncodeShardRecord(r)).ok());
  r.role = CopyRole::kPrimary;
  r.segment_kind = static_cast<SegmentKind>(7);
  EXPECT_FALSE(DecodeShardRecord(EncodeShardRecord(r)).ok());
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
    ReservationPtr e = *arena->Reserve(2 * kPage);
    ASSERT_EQ(e->extents(), (std::vector<Extent>{{0, 2 * kPage}}));
    Fill(*e, 5000, 11);
    crc = e->Crc(0, 5000);
  }
  // What the format-1 encoder wrote (nlohmann::json::dump of the record).
  const std::string json = absl::StrFormat(
      R"({"crc32c":%u,"digest":"0x00000000deadbeef","durable_path":"j/4/rank-00002.bin","extents":[[0,8192]],)"
      R"("format":1,"items":[{"attributes":{"py.type":"torch"},"crc32c":7,"dtype":1,"length":4000,"name":"w",)"
      R"("offset":0,"shape":[10,100]},{"crc32c":8,"dtype":14,"length":1000,"name":"b","offset":4000,"shape":[]}],)"
      R"("job":"j","rank":2,"role":1,"run_id":"r1","seq":5,"size":5000,"staged_ms":1700000000000,"step":4})",
      crc);
  {
    const std::string path = dir.path() + "/records/j.4.2.0000000000000005.rec";
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT, 0600);
    ASSERT_EQ(::write(fd, json.data(), json.size()), static_cast<ssize_t>(json.size()));
    ::close(fd);
  }
  auto arena = OpenArena(dir.path(), 16 * kPage);
  ASSERT_TRUE(arena->lost().empty()) << arena->lost()[0].reason;
  std::vector<AdoptedHolding> adopted = arena->TakeAdopted();
  ASSERT_EQ(adopted.size(), 1u);
  ShardRecord r = adopted[0].record;
  EXPECT_EQ(r.id, (ShardId{"j", 4, 2}));
  EXPECT_EQ(r.size_bytes, 5000u);
  EXPECT_EQ(r.crc32c, crc);
  EXPECT_EQ(r.manifest_digest, 0xdeadbeefu);
  EXPECT_EQ(r.run_id, "r1");
  EXPECT_EQ(r.seq, 5u);
  EXPECT_EQ(r.durable_path, "j/4/rank-00002.bin");
  ASSERT_EQ(r.items.size(), 2u);
  EXPECT_EQ(r.items[0].shape, (std::vector<uint64_t>{10, 100}));
  EXPECT_EQ(r.items[0].attributes.at("py.type"), "torch");
  EXPECT_EQ(r.items[1].offset_bytes, 4000u);
  EXPECT_EQ(arena->free_bytes(), 14 * kPage);
  // Written again (e.g. on flush), it is in the current format and supersedes
  // the JSON one.
  const std::string old_file = r.file;
  ASSERT_TRUE(arena->WriteRecord(&r).ok());
  EXPECT_GT(r.seq, 5u);
  ASSERT_TRUE(arena->RemoveRecord(old_file).ok());
  adopted.clear();
  arena.reset();
  auto again = OpenArena(dir.path(), 16 * kPage);
  std::vector<AdoptedHolding> back = again->TakeAdopted();
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(back[0].record.items, r.items);
  EXPECT_TRUE(again->lost().empty());
}

// ---- The tier is the agent's own (issue 34 finding 2) ----------------------

mode_t ModeOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

// A file of `mode` at `path`, as someone else might have left it.
void Plant(const std::string& path, mode_t mode, uid_t owner = ::geteuid()) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, mode);
  ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);
  ASSERT_EQ(::fchmod(fd, mode), 0);
  if (owner != ::geteuid()) {
    ASSERT_EQ(::fchown(fd, owner, owner), 0);
  }
  ::close(fd);
}

// Opening the arena on `dir` fails with FailedPrecondition saying each of `says`.
void ExpectRefused(const std::string& dir, std::initializer_list<std::string> says) {
  absl::StatusOr<std::unique_ptr<Arena>> a = Arena::Open({dir, 16 * kPage, true});
  ASSERT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition) << a.status();
  for (const std::string& s : says) EXPECT_THAT(a.status().message(), ::testing::HasSubstr(s));
  EXPECT_THAT(a.status().message(), ::testing::HasSubstr("then start the agent again"));
}

TEST(ArenaOwnership, MakesItsDirectoriesAndPoolOwnerOnly) {
  TempDir dir = *TempDir::Create();
  const std::string mem = dir.path() + "/mem";
  const mode_t old = ::umask(0);  // as some container runtimes set it
  {
    auto arena = OpenArena(mem, 16 * kPage);
    ::umask(old);
    ReservationPtr e = *arena->Reserve(kPage);
    ShardRecord r = Record(*e, "j", 1, 0, kPage);
    ASSERT_TRUE(arena->WriteRecord(&r).ok());
    EXPECT_EQ(ModeOf(mem), 0700u);
    EXPECT_EQ(ModeOf(mem + "/records"), 0700u);
    EXPECT_EQ(ModeOf(mem + "/pool.bin"), 0600u);
    EXPECT_EQ(ModeOf(mem + "/records/" + r.file), 0600u);
  }
  ::umask(old);
  // Its own tier, as left: re-adopted.
  auto again = OpenArena(mem, 16 * kPage);
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(again->TakeAdopted().size(), 1u);
}

TEST(ArenaOwnership, NarrowsItsOwnDirectoriesThatOthersMayOnlyRead) {
  TempDir dir = *TempDir::Create();
  const std::string mem = dir.path() + "/mem";
  ASSERT_EQ(::mkdir(mem.c_str(), 0755), 0);  // as an earlier version left it
  ASSERT_EQ(::chmod(mem.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((mem + "/records").c_str(), 0755), 0);
  ASSERT_EQ(::chmod((mem + "/records").c_str(), 0755), 0);
  ASSERT_NE(OpenArena(mem, 16 * kPage), nullptr);
  EXPECT_EQ(ModeOf(mem), 0700u);
  EXPECT_EQ(ModeOf(mem + "/records"), 0700u);
}

TEST(ArenaOwnership, RefusesAPoolOthersMayOpenOrThatIsALink) {
  TempDir dir = *TempDir::Create();
  const std::string pool = dir.path() + "/pool.bin";
  Plant(pool, 0666);
  ExpectRefused(dir.path(), {"'" + pool + "'", "mode 0666", "writable by other users", "at most 0600",
                             "remove it (rm '" + pool + "')"});
  EXPECT_EQ(ModeOf(pool), 0666u);  // left as found, not resized
  struct stat st {};
  ASSERT_EQ(::stat(pool.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 0);
  ASSERT_EQ(::unlink(pool.c_str()), 0);

  Plant(pool, 0640);
  ExpectRefused(dir.path(), {"mode 0640", "open to other users"});
  ASSERT_EQ(::unlink(pool.c_str()), 0);

  // A symbolic link to a file elsewhere: never followed, the target untouched.
  const std::string target = dir.path() + "/elsewhere";
  Plant(target, 0600);
  ASSERT_EQ(::symlink(target.c_str(), pool.c_str()), 0);
  ExpectRefused(dir.path(), {"'" + pool + "'", "is a symbolic link"});
  ASSERT_EQ(::stat(target.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 0);
  ASSERT_EQ(::unlink(pool.c_str()), 0);
  // Dangling: not created through it either.
  ASSERT_EQ(::symlink((dir.path() + "/nowhere").c_str(), pool.c_str()), 0);
  ExpectRefused(dir.path(), {"is a symbolic link"});
  EXPECT_NE(::access((dir.path() + "/nowhere").c_str(), F_OK), 0);
  ASSERT_EQ(::unlink(pool.c_str()), 0);

  // A second name for the pool.
  Plant(pool, 0600);
  ASSERT_EQ(::link(pool.c_str(), (target + "-2").c_str()), 0);
  ExpectRefused(dir.path(), {"has 2 hard links"});
  ASSERT_EQ(::unlink(pool.c_str()), 0);

  // Not a file at all.
  ASSERT_EQ(::mkfifo(pool.c_str(), 0600), 0);
  ExpectRefused(dir.path(), {"is a fifo, not a regular file"});
}

TEST(ArenaOwnership, RefusesADirectoryOthersMayWriteOrThatIsALink) {
  TempDir dir = *TempDir::Create();
  const std::string mem = dir.path() + "/mem";
  ASSERT_EQ(::mkdir(mem.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(mem.c_str(), 0777), 0);
  ExpectRefused(mem, {"'" + mem + "'", "mode 0777", "writable by other users", "remove it (rm -r '" + mem + "')"});
  EXPECT_NE(::access((mem + "/pool.bin").c_str(), F_OK), 0);  // nothing made in it
  ASSERT_EQ(::chmod(mem.c_str(), 0770), 0);
  ExpectRefused(mem, {"mode 0770"});
  ASSERT_EQ(::chmod(mem.c_str(), 0700), 0);

  const std::string link = dir.path() + "/link";
  ASSERT_EQ(::symlink(mem.c_str(), link.c_str()), 0);
  ExpectRefused(link, {"'" + link + "'", "is a symbolic link"});
  EXPECT_NE(::access((mem + "/pool.bin").c_str(), F_OK), 0);

  // records/ likewise.
  ASSERT_EQ(::mkdir((mem + "/records").c_str(), 0700), 0);
  ASSERT_EQ(::chmod((mem + "/records").c_str(), 0733), 0);
  ExpectRefused(mem, {"'" + mem + "/records'", "mode 0733"});
}

TEST(ArenaOwnership, RefusesARecordThatIsALinkOrThatOthersMayWrite) {
  TempDir dir = *TempDir::Create();
  {
    auto arena = OpenArena(dir.path(), 16 * kPage);
    ReservationPtr e = *arena->Reserve(kPage);
    ShardRecord r = Record(*e, "j", 1, 0, kPage);
    ASSERT_TRUE(arena->WriteRecord(&r).ok());
  }
  const std::string rec = dir.path() + "/records/j.1.1.0000000000000009.rec";
  ASSERT_EQ(::symlink((dir.path() + "/pool.bin").c_str(), rec.c_str()), 0);
  ExpectRefused(dir.path(), {"'" + rec + "'", "is a symbolic link", "remove it (rm '" + rec + "')"});
  ASSERT_EQ(::unlink(rec.c_str()), 0);
  Plant(rec, 0666);
  ExpectRefused(dir.path(), {"'" + rec + "'", "writable by other users"});
  ASSERT_EQ(::unlink(rec.c_str()), 0);
  auto arena = OpenArena(dir.path(), 16 * kPage);  // the agent's own again
  ASSERT_NE(arena, nullptr);
  EXPECT_EQ(arena->TakeAdopted().size(), 1u);
}

// CI runs as root: root must not adopt what another user left either.
TEST(ArenaOwnership, RefusesWhatAnotherUserLeftEvenAsRoot) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give files to uid 65534";
  TempDir dir = *TempDir::Create();
  const std::string pool = dir.path() + "/pool.bin";
  Plant(pool, 0600, 65534);
  ExpectRefused(dir.path(), {"'" + pool + "' belongs to uid 65534 (mode 0600), not to this process's user (uid 0)",
                             "remove it (rm '" + pool + "')"});
  ASSERT_EQ(::unlink(pool.c_str()), 0);

  const std::string mem = dir.path() + "/mem";
  ASSERT_EQ(::mkdir(mem.c_str(), 0700), 0);
  ASSERT_EQ(::chown(mem.c_str(), 65534, 65534), 0);
  ExpectRefused(mem, {"'" + mem + "' belongs to uid 65534", "remove it (rm -r '" + mem + "')"});
  ASSERT_EQ(::chown(mem.c_str(), 0, 0), 0);

  ASSERT_NE(OpenArena(mem, 16 * kPage), nullptr);
  const std::string rec = mem + "/records/j.1.0.0000000000000001.rec";
  Plant(rec, 0600, 65534);
  ExpectRefused(mem, {"'" + rec + "' belongs to uid 65534"});
  EXPECT_EQ(::access(rec.c_str(), F_OK), 0);  // left for the operator
}

TEST(ArenaRecords, GoThroughTheFileSystemAndAFailedWriteChangesNothing) {
  TempDir dir = *TempDir::Create();
  FaultFileSystem fs(PosixFileSystem());
  uint32_t crc = 0;
  {
    absl::StatusOr<std::unique_ptr<Arena>> a = Arena::Open({dir.path(), 16 * kPage, true, &fs});
    ASSERT_TRUE(a.ok()) << a.status();
    Arena& arena = **a;
    ReservationPtr e = *arena.Reserve(kPage);
    Fill(*e, kPage, 7);
    crc = e->Crc(0, kPage);
    ShardRecord r = Record(*e, "j", 2, 0, kPage);
    ASSERT_TRUE(arena.WriteRecord(&r).ok());
    EXPECT_EQ(fs.WritesIssued(), 1);
    EXPECT_EQ(fs.SyncsIssued(), 2);  // the record, then records/
    const ShardRecord before = r;
    // Each failure before the rename: an error, the record as it was, the
    // old file whole, no temporary left.
    for (int which = 0; which < 2; ++which) {
      if (which == 0) fs.FailNthWrite(1);
      if (which == 1) fs.FailNthSync(1);
      r.durable_path = "j/2/rank-00000.bin";
      absl::Status s = arena.WriteRecord(&r);
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
      EXPECT_EQ(r.file, before.file);
      EXPECT_EQ(r.seq, before.seq);
      EXPECT_THAT(*fs.ListDir(dir.path() + "/records"), ::testing::ElementsAre(before.file));
    }
  }
  // The old record is what a restart finds.
  absl::StatusOr<std::unique_ptr<Arena>> a = Arena::Open({dir.path(), 16 * kPage, true, &fs});
  ASSERT_TRUE(a.ok()) << a.status();
  std::vector<AdoptedHolding> adopted = (*a)->TakeAdopted();
  ASSERT_EQ(adopted.size(), 1u);
  EXPECT_EQ(adopted[0].record.crc32c, crc);
  EXPECT_EQ(adopted[0].record.durable_path, "");
}

// One agent per tier: a second Open of the same directory is refused while the
// first arena lives, and works once it is closed.
TEST(ArenaLock, ASecondArenaOnTheSameTierIsRefusedUntilTheFirstCloses) {
  TempDir dir = *TempDir::Create();
  auto first = OpenArena(dir.path(), 16 * kPage);
  ASSERT_NE(first, nullptr);
  absl::StatusOr<std::unique_ptr<Arena>> second = Arena::Open({dir.path(), 16 * kPage, true});
  ASSERT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_THAT(second.status().message(), ::testing::HasSubstr("is in use by another process"));
  EXPECT_THAT(second.status().message(), ::testing::HasSubstr("its own --memory-dir"));
  first.reset();
  EXPECT_NE(OpenArena(dir.path(), 16 * kPage), nullptr);
}

// The lock dies with its process (kill -9): a restarted agent takes the tier over
// and re-adopts what the dead one committed.
TEST(ArenaLock, IsReleasedWhenItsProcessIsKilled) {
  TempDir dir = *TempDir::Create();
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(ready[0]);
    absl::StatusOr<std::unique_ptr<Arena>> a = Arena::Open({dir.path(), 16 * kPage, true});
    if (!a.ok()) ::_exit(2);
    ReservationPtr e = *(*a)->Reserve(kPage);
    Fill(*e, kPage, 11);
    ShardRecord r = Record(*e, "j", 1, 0, kPage);
    if (!(*a)->WriteRecord(&r).ok()) ::_exit(3);
    const char ok = 'k';
    if (::write(ready[1], &ok, 1) != 1) ::_exit(4);
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char got = 0;
  ASSERT_EQ(::read(ready[0], &got, 1), 1) << "the child could not open its arena";
  ::close(ready[0]);
  absl::StatusOr<std::unique_ptr<Arena>> while_alive = Arena::Open({dir.path(), 16 * kPage, true});
  EXPECT_EQ(while_alive.status().code(), absl::StatusCode::kFailedPrecondition) << while_alive.status();
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  absl::StatusOr<std::unique_ptr<Arena>> after = Arena::Open({dir.path(), 16 * kPage, true});
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ((*after)->TakeAdopted().size(), 1u);
}

TEST(Arena, RefusesZeroCapacity) {
  TempDir dir = *TempDir::Create();
  EXPECT_EQ(Arena::Open({dir.path(), 0, true}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ckpt::agent
