// MemoryTier: a test fixture piece for the agent's component tests: an Arena
// in a temp dir (its records written through a FaultFileSystem over the real
// one, so record writes can be failed), a HoldingTable over it on a FakeClock,
// the reports the table sends, and helpers that fill a reservation with
// seeded bytes and describe it as a shard record of a few items.
//
// Thread safety: the reports are guarded by their own mutex; the rest is
// used from the test's thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/crc32c.h"
#include "common/fault_file_system.h"
#include "common/metrics.h"
#include "server/agent/agent_metrics.h"
#include "server/agent/arena.h"
#include "server/agent/holdings.h"
#include "support/temp_dir.h"

namespace ckpt::agent {

// `size` bytes drawn from a generator seeded with `seed`.
inline std::string SeededBytes(uint64_t size, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string out(size, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

inline std::span<const std::byte> AsBytes(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

// A record describing `content` as `items` equal items (the last one takes
// the remainder), each with its crc, and the whole crc and digest.
inline ShardRecord RecordOf(const ShardId& id, const std::string& content, int items = 2,
                            CopyRole role = CopyRole::kPrimary) {
  ShardRecord r;
  r.id = id;
  r.role = role;
  r.size_bytes = content.size();
  r.crc32c = Crc32c(content);
  std::vector<ManifestItem> list;
  const uint64_t each = content.size() / items;
  for (int i = 0; i < items; ++i) {
    ManifestItem item;
    item.name = absl::StrCat("w", i);
    item.dtype = kDTypeBytes;
    item.offset_bytes = each * i;
    item.length_bytes = i + 1 == items ? content.size() - item.offset_bytes : each;
    item.shape = {item.length_bytes};
    item.crc32c = Crc32c(content.data() + item.offset_bytes, item.length_bytes);
    list.push_back(item);
  }
  SetItems(r, std::move(list));
  r.run_id = "run";
  return r;
}

// The bytes [0, size) of a reservation, as a string.
inline std::string ReadBack(const Reservation& r, uint64_t size) {
  std::string out(size, '\0');
  r.CopyOut(0, std::as_writable_bytes(std::span<char>(out.data(), out.size())));
  return out;
}

class MemoryTier {
 public:
  explicit MemoryTier(uint64_t capacity_bytes = 64 * kArenaPageBytes)
      : dir_(*ckpt::testing::TempDir::Create()), fault_fs_(PosixFileSystem()), agent_metrics_(metrics_) {
    Open(capacity_bytes);
  }
  ~MemoryTier() { Close(); }

  // Opens (or reopens, after Close) the arena on the same directory and a new
  // table over it. The adopted holdings are left in the arena.
  void Open(uint64_t capacity_bytes = 64 * kArenaPageBytes) {
    Arena::Options o;
    o.dir = dir_.path() + "/mem";
    o.capacity_bytes = capacity_bytes;
    o.populate = false;
    o.fs = &fault_fs_;
    absl::StatusOr<std::unique_ptr<Arena>> a = Arena::Open(o);
    ASSERT_TRUE(a.ok()) << a.status();
    arena_ = *std::move(a);
    holdings_ = std::make_unique<HoldingTable>(arena_.get(), &clock_, &agent_metrics_, [this](HoldingReport r) {
      absl::MutexLock lock(&mu_);
      reports_.push_back(std::move(r));
    });
  }
  // Drops the table and the arena (every reservation must be gone).
  void Close() {
    holdings_.reset();
    arena_.reset();
  }

  // A reservation holding `content`.
  ReservationPtr Hold(const std::string& content) {
    absl::StatusOr<ReservationPtr> r = arena_->Reserve(content.size());
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return nullptr;
    (*r)->CopyIn(0, AsBytes(content));
    return *r;
  }
  // Holds `content` as a VALID copy of `id` (verified or not). OK or the table's error.
  absl::Status AddShard(const ShardId& id, const std::string& content, bool verified = true,
                        CopyRole role = CopyRole::kPrimary) {
    return holdings_->Add(RecordOf(id, content, 2, role), Hold(content), verified, /*if_absent=*/false);
  }

  std::vector<HoldingReport> Reports() {
    absl::MutexLock lock(&mu_);
    return reports_;
  }
  void ClearReports() {
    absl::MutexLock lock(&mu_);
    reports_.clear();
  }
  // Record files in <mem>/records.
  size_t RecordFiles() {
    absl::StatusOr<std::vector<std::string>> names = PosixFileSystem()->ListDir(dir_.path() + "/mem/records");
    EXPECT_TRUE(names.ok()) << names.status();
    size_t n = 0;
    for (const std::string& f : names.ok() ? *names : std::vector<std::string>{}) n += f.ends_with(".rec") ? 1 : 0;
    return n;
  }

  Arena& arena() { return *arena_; }
  HoldingTable& holdings() { return *holdings_; }
  FaultFileSystem& fault_fs() { return fault_fs_; }
  FakeClock& clock() { return clock_; }
  AgentMetrics& metrics() { return agent_metrics_; }
  const std::string& dir() const { return dir_.path(); }

 private:
  ckpt::testing::TempDir dir_;
  FaultFileSystem fault_fs_;
  FakeClock clock_;
  MetricsRegistry metrics_;
  AgentMetrics agent_metrics_;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<HoldingTable> holdings_;
  absl::Mutex mu_;
  std::vector<HoldingReport> reports_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::agent
