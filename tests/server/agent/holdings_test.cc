// HoldingTable on its own: an Arena in a temp dir (records through a
// FaultFileSystem), a FakeClock, and the reports it sends collected. Covers
// publishing and replacing copies, pins that keep bytes alive past a drop,
// quarantine, the verify queue, blobs, segments, inventory, durable paths and
// re-adoption after a restart.
#include "server/agent/holdings.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "memory_tier.h"

namespace ckpt::agent {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kPage = kArenaPageBytes;

const ShardId kA{"job", 5, 0};
const ShardId kB{"job", 5, 1};

TEST(CheckShardBytes, AcceptsMatchingBytesAndNamesTheFirstBadItem) {
  MemoryTier tier;
  const std::string content = SeededBytes(3000, 1);
  ShardRecord rec = RecordOf(kA, content, 3);
  ReservationPtr bytes = tier.Hold(content);
  uint32_t crc = 0;
  std::string bad;
  ASSERT_TRUE(CheckShardBytes(rec, *bytes, &crc, &bad).ok());
  EXPECT_EQ(crc, Crc32c(content));
  EXPECT_EQ(bad, "");

  // One byte of the second item flips: DataLoss naming it, and the crc of
  // the bytes as they are.
  std::string rotten = content;
  rotten[1500] ^= 0x10;
  bytes->CopyIn(0, AsBytes(rotten));
  absl::Status s = CheckShardBytes(rec, *bytes, &crc, &bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("w1"));
  EXPECT_THAT(s.message(), HasSubstr("job/5/0"));
  EXPECT_EQ(bad, "w1");
  EXPECT_EQ(crc, Crc32c(rotten));
}

TEST(CheckShardBytes, CatchesAChangeOutsideEveryItem) {
  MemoryTier tier;
  const std::string content = SeededBytes(1000, 2);
  ShardRecord rec = RecordOf(kA, content, 1);
  // The only item covers bytes [100, 900): the rest is padding.
  std::vector<ManifestItem> items = rec.items;
  items[0].offset_bytes = 100;
  items[0].length_bytes = 800;
  items[0].crc32c = Crc32c(content.data() + 100, 800);
  SetItems(rec, items);
  ReservationPtr bytes = tier.Hold(content);
  ASSERT_TRUE(CheckShardBytes(rec, *bytes, nullptr, nullptr).ok());
  std::string padded = content;
  padded[950] ^= 1;
  bytes->CopyIn(0, AsBytes(padded));
  absl::Status s = CheckShardBytes(rec, *bytes, nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("padding changed"));
}

TEST(HoldingTable, AddPublishesACopyWithItsRecord) {
  MemoryTier tier;
  HoldingTable& h = tier.holdings();
  const std::string content = SeededBytes(2 * kPage + 17, 3);
  std::shared_ptr<const ShardRecord> stored;
  ASSERT_TRUE(h.Add(RecordOf(kA, content), tier.Hold(content), /*verified=*/false, /*if_absent=*/false, &stored).ok());
  ASSERT_NE(stored, nullptr);
  EXPECT_EQ(stored->extents, (std::vector<Extent>{{0, 3 * kPage}}));
  EXPECT_FALSE(stored->file.empty());
  EXPECT_EQ(tier.RecordFiles(), 1u);
  EXPECT_TRUE(h.Holds(kA));
  EXPECT_TRUE(h.HoldsValid(kA));
  EXPECT_FALSE(h.Verified(kA));
  EXPECT_FALSE(h.Holds(kB));
  EXPECT_EQ(h.SizeOf(kA), content.size());
  EXPECT_EQ(h.SizeOf(kB), 0u);
  EXPECT_EQ(h.shard_count(), 1u);
  EXPECT_EQ(tier.metrics().holdings->Value(), 1.0);

  absl::StatusOr<Pin> pin = h.PinValid(kA);
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(pin->rec, stored);
  EXPECT_EQ(ReadBack(*pin->bytes, content.size()), content);
  EXPECT_EQ(h.PinValid(kB).status().code(), absl::StatusCode::kNotFound);

  std::vector<HoldingInfo> infos = h.Infos("job", 5);
  ASSERT_EQ(infos.size(), 1u);
  EXPECT_EQ(infos[0].id, kA);
  EXPECT_EQ(infos[0].crc32c, Crc32c(content));
  EXPECT_EQ(infos[0].size_bytes, content.size());
  EXPECT_EQ(infos[0].state, CopyState::kValid);
  EXPECT_TRUE(h.Infos("other", std::nullopt).empty());
  EXPECT_TRUE(h.Infos("job", 6).empty());
  // Publishing reports nothing (the caller reports STAGED or the replica).
  EXPECT_TRUE(tier.Reports().empty());
}

TEST(HoldingTable, IfAbsentKeepsTheValidCopyButReplacesAQuarantinedOne) {
  MemoryTier tier;
  HoldingTable& h = tier.holdings();
  const std::string first = SeededBytes(1000, 4);
  const std::string second = SeededBytes(1000, 5);
  ASSERT_TRUE(tier.AddShard(kA, first).ok());
  const uint64_t free_before = tier.arena().free_bytes();
  absl::Status s = h.Add(RecordOf(kA, second), tier.Hold(second), true, /*if_absent=*/true);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_EQ(ReadBack(*h.PinValid(kA)->bytes, first.size()), first);
  EXPECT_EQ(tier.RecordFiles(), 1u);  // the new record was removed again
  EXPECT_EQ(tier.arena().free_bytes(), free_before);  // and its space freed

  h.Quarantine(*h.PinValid(kA), "rotten");
  ASSERT_TRUE(h.Add(RecordOf(kA, second), tier.Hold(second), true, /*if_absent=*/true).ok());
  EXPECT_TRUE(h.HoldsValid(kA));
  EXPECT_EQ(ReadBack(*h.PinValid(kA)->bytes, second.size()), second);
  EXPECT_EQ(tier.RecordFiles(), 1u);
  EXPECT_EQ(tier.arena().free_bytes(), free_before);  // the old copy's space is back
}

TEST(HoldingTable, AddWithoutIfAbsentReplacesTheHeldCopy) {
  MemoryTier tier;
  HoldingTable& h = tier.holdings();
  ASSERT_TRUE(tier.AddShard(kA, SeededBytes(5000, 6)).ok());
  const std::string second = SeededBytes(100, 7);
  ASSERT_TRUE(h.Add(RecordOf(kA, second), tier.Hold(second), false, false).ok());
  EXPECT_EQ(h.SizeOf(kA), 100u);
  EXPECT_FALSE(h.Verified(kA));
  EXPECT_EQ(tier.RecordFiles(), 1u);
  EXPECT_EQ(tier.arena().free_bytes(), tier.arena().capacity_bytes() - kPage);
}

TEST(HoldingTable, ARecordThatCannotBeWrittenKeepsNothing) {
  MemoryTier tier;
  HoldingTable& h = tier.holdings();
  tier.fault_fs().FailAllWrites(true);
  absl::Status s = tier.AddShard(kA, SeededBytes(1000, 8));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("job/5/0"));
  EXPECT_FALSE(h.Holds(kA));
  EXPECT_EQ(tier.RecordFiles(), 0u);
  EXPECT_EQ(tier.arena().free_bytes(), tier.arena().capacity_bytes());

  // Segments likewise.
  ShardRecord seg;
  seg.id = ShardId{"job", 5, 0};
  seg.segment = SegmentId{"job", 5, 0, 0, 2};
  seg.segment_kind = SegmentKind::kParity;
  seg.size_bytes = 10;
  s = h.AddSegment(seg, tier.Hold(std::string(10, 'p')), "t-1");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_FALSE(h.HasValidSegment(*seg.segment));
  EXPECT_TRUE(tier.Reports().empty());
}

TEST(HoldingTable, APinKeepsTheBytesOfADroppedCopy) {
  MemoryTier tier;
  HoldingTable& h = tier.holdings();
  const std::string content = SeededBytes(3 * kPage, 9);
  ASSERT_TRUE(tier.AddShard(kA, content).ok());
  const uint64_t cap = tier.arena().capacity_bytes();
  absl::StatusOr<Pin> pin = h.PinValid(kA);
  ASSERT_TRUE(pin.ok());
  std::vector<HoldingInfo> dropped = h.DropShards([](const ShardRecord& r) { return r.id.rank == 0; });
  ASSERT_EQ(dropped.size(), 1u);
  EXPECT_EQ(dropped[0].id, kA);
  EXPECT_FALSE(h.Holds(kA));
  EXPECT_EQ(tier.RecordFiles(), 0u);  // the record goes at once
  EXPECT_EQ(tier.arena().free_bytes(), cap - 3 * kPage);  // the bytes do not
  EXPECT_EQ(ReadBack(*pin->bytes, content.size()), content);
  *pin = Pin{};
  EXPECT_EQ(tier.arena().free_bytes(), cap);
}

TEST(HoldingTable, QuarantineReportsOnceAndRefusesLaterPins) {
  MemoryTier tier;
  HoldingTable& h = tier.holdings();
  const std::string content = SeededBytes(700, 10);
  ASSERT_TRUE(tier.AddShard(kA, content, true, CopyRole::kReplica).ok());
  const Pin pin = *h.PinValid(kA);
  h.Quarantine(pin, "item w0: crc32c mismatch");
  h.Quarantine(pin, "again");  // already quarantined: nothing more
  std::vector<HoldingReport> reports = tier.Reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].kind, HoldingReport::Kind::kCopyState);
  EXPECT_EQ(reports[0].id, kA);
  EXPECT_EQ(reports[0].copy_role, CopyRole::kReplica);
  EXPECT_EQ(reports[0].copy_state, CopyState::kCorrupt);
  EXPECT_EQ(reports[0].crc32c, Crc32c(content));
  EXPECT_EQ(reports[0].size_bytes, content.size());
  EXPECT_EQ(reports[0].detail, "item w0: crc32c mismatch");
  EXPECT_EQ(tier.metrics().corrupt->Value(), 1.0);

  absl::StatusOr<Pin> again = h.PinValid(kA);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(again.status().message(), HasSubstr("quarantined: item w0: crc32c mismatch"));
  EXPECT_TRUE(h.Holds(kA));
  EXPECT_FALSE(h.HoldsValid(kA));
  EXPECT_EQ(h.Infos("job", 5)[0].state, CopyState::kCorrupt);
  EXPECT_EQ(h.InventoryItems()[0].state, CopyState::kCorrupt);
}

TEST(HoldingTable, AStalePinChangesNothing) {
  MemoryTier tier;
  HoldingTable& h = tier.holdings();
  ASSERT_TRUE(tier.AddShard(kA, SeededBytes(500, 11), /*verified=*/false).ok());
  const Pin old = *h.PinValid(kA);
  ASSERT_TRUE(tier.AddShard(kA, SeededBytes(500, 12), /*verified=*/false).ok());  // replaced
  h.MarkVerified(old);
  EXPECT_FALSE(h.Verified(kA));
  h.Quarantine(old, "old bytes");
  EXPECT_TRUE(h.HoldsValid(kA));
  EXPECT_TRUE(tier.Reports().empty());
  ASSERT_TRUE(h.SetDurablePath(old, "job/5/rank-0.bin").ok());
  EXPECT_EQ(h.Infos("job", 5)[0].durable_path, "");
  EXPECT_EQ(tier.RecordFiles(), 1u);  // the record written for the stale pin is gone again
  h.MarkVerified(*h.PinValid(kA));
  EXPECT_TRUE(h.Verified(kA));
}

TEST(HoldingTable, SetDurablePathRewritesTheRecord) {
  MemoryTier tier;
  HoldingTable& h = tier.holdings();
  ASSERT_TRUE(tier.AddShard(kA, SeededBytes(500, 13)).ok());
  const Pin pin = *h.PinValid(kA);
  const std::string old_file = pin.rec->file;
  ASSERT_TRUE(h.SetDurablePath(pin, "job/5/rank-0.bin").ok());
  const Pin now = *h.PinValid(kA);
  EXPECT_EQ(now.rec->durable_path, "job/5/rank-0.bin");
  EXPECT_NE(now.rec->file, old_file);
  EXPECT_GT(now.rec->seq, pin.rec->seq);
  EXPECT_EQ(now.bytes, pin.bytes);
  EXPECT_EQ(tier.RecordFiles(), 1u);
  EXPECT_EQ(h.InventoryItems()[0].durable_path, "job/5/rank-0.bin");
  // A write failure leaves the held record as it was.
  tier.fault_fs().FailAllWrites(true);
  EXPECT_FALSE(h.SetDurablePath(now, "elsewhere").ok());
  EXPECT_EQ(h.PinValid(kA)->rec->durable_path, "job/5/rank-0.bin");
}

TEST(HoldingTable, TheVerifyQueueSkipsWhatIsGoneCheckedOrQuarantined) {
  MemoryTier tier;
  HoldingTable& h = tier.holdings();
  const ShardId ids[4] = {{"job", 1, 0}, {"job", 1, 1}, {"job", 1, 2}, {"job", 1, 3}};
  for (const ShardId& id : ids) {
    ASSERT_TRUE(tier.AddShard(id, SeededBytes(100, id.rank), /*verified=*/false).ok());
    h.QueueVerify(id);
  }
  h.QueueVerify(ShardId{"job", 1, 9});  // never held
  h.DropShard(ids[0]);
  h.MarkVerified(*h.PinValid(ids[1]));
  h.Quarantine(*h.PinValid(ids[2]), "bad");
  std::optional<Pin> next = h.NextToVerify();
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ(next->rec->id, ids[3]);
  EXPECT_FALSE(h.NextToVerify().has_value());
}

TEST(HoldingTable, PinBlobIsThePrimariesInRankOrder) {
  MemoryTier tier;
  HoldingTable& h = tier.holdings();
  const std::string r0 = SeededBytes(kPage + 5, 20);
  const std::string r2 = SeededBytes(300, 22);
  ASSERT_TRUE(tier.AddShard(ShardId{"job", 7, 2}, r2).ok());
  ASSERT_TRUE(tier.AddShard(ShardId{"job", 7, 0}, r0).ok());
  ASSERT_TRUE(tier.AddShard(ShardId{"job", 7, 1}, SeededBytes(50, 21), true, CopyRole::kReplica).ok());
  ASSERT_TRUE(tier.AddShard(ShardId{"job", 8, 0}, SeededBytes(50, 23)).ok());
  absl::StatusOr<BlobPin> blob = h.PinBlob("job", 7);
  ASSERT_TRUE(blob.ok()) << blob.status();
  ASSERT_EQ(blob->shards.size(), 2u);
  EXPECT_EQ(blob->shards[0].rec->id.rank, 0u);
  EXPECT_EQ(blob->shards[1].rec->id.rank, 2u);
  EXPECT_EQ(blob->size_bytes, r0.size() + r2.size());
  std::string joined;
  for (const auto& p : blob->pieces) joined.append(reinterpret_cast<const char*>(p.data()), p.size());
  EXPECT_EQ(joined, r0 + r2);

  // An unverified primary holds the blob back; a quarantined one loses it.
  ASSERT_TRUE(tier.AddShard(ShardId{"job", 7, 0}, r0, /*verified=*/false).ok());
  EXPECT_EQ(h.PinBlob("job", 7).status().code(), absl::StatusCode::kFailedPrecondition);
  h.Quarantine(*h.PinValid(ShardId{"job", 7, 0}), "bad");
  EXPECT_EQ(h.PinBlob("job", 7).status().code(), absl::StatusCode::kDataLoss);
  // No primaries: an empty blob.
  absl::StatusOr<BlobPin> none = h.PinBlob("job", 9);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->size_bytes, 0u);
  EXPECT_TRUE(none->shards.empty());
}

ShardRecord SegmentRecord(const SegmentId& id, const std::string& content, SegmentKind kind) {
  ShardRecord r;
  r.id = ShardId{id.job_id, id.step, 0};
  r.segment = id;
  r.segment_kind = kind;
  r.size_bytes = content.size();
  r.crc32c = Crc32c(content);
  return r;
}

TEST(HoldingTable, SegmentsAreReportedReplacedAndQuarantined) {
  MemoryTier tier;
  HoldingTable& h = tier.holdings();
  const SegmentId sid{"job", 5, 0, 1, 2};
  const std::string first = SeededBytes(900, 30);
  ASSERT_TRUE(h.AddSegment(SegmentRecord(sid, first, SegmentKind::kParity), tier.Hold(first), "t-enc").ok());
  std::vector<HoldingReport> reports = tier.Reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].kind, HoldingReport::Kind::kSegment);
  EXPECT_EQ(reports[0].segment, sid);
  EXPECT_EQ(reports[0].segment_kind, SegmentKind::kParity);
  EXPECT_EQ(reports[0].copy_state, CopyState::kValid);
  EXPECT_EQ(reports[0].size_bytes, 900u);
  EXPECT_EQ(reports[0].crc32c, Crc32c(first));
  EXPECT_EQ(reports[0].task_id, "t-enc");
  EXPECT_TRUE(h.HasValidSegment(sid));
  EXPECT_EQ(ReadBack(*h.PinSegment(sid)->bytes, 900), first);
  // Segments are not shard copies.
  EXPECT_EQ(h.shard_count(), 0u);
  EXPECT_TRUE(h.Infos("job", 5).empty());
  ASSERT_EQ(h.SegmentInfos("job", 5).size(), 1u);

  // A newer one replaces it (old record gone, old space freed).
  const std::string second = SeededBytes(900, 31);
  ASSERT_TRUE(h.AddSegment(SegmentRecord(sid, second, SegmentKind::kParity), tier.Hold(second), "t-rb").ok());
  EXPECT_EQ(tier.RecordFiles(), 1u);
  EXPECT_EQ(tier.arena().free_bytes(), tier.arena().capacity_bytes() - kPage);
  const Pin pin = *h.PinSegment(sid);
  EXPECT_EQ(ReadBack(*pin.bytes, 900), second);

  tier.ClearReports();
  h.QuarantineSegment(pin, "crc mismatch", 0x1234);
  h.QuarantineSegment(pin, "again", 0x1);
  reports = tier.Reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].copy_state, CopyState::kCorrupt);
  EXPECT_EQ(reports[0].crc32c, 0x1234u);
  EXPECT_EQ(reports[0].detail, "crc mismatch");
  EXPECT_FALSE(h.HasValidSegment(sid));
  EXPECT_EQ(h.PinSegment(sid).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(h.SegmentInfos("job", 5)[0].state, CopyState::kCorrupt);

  // Not a segment record: refused.
  EXPECT_EQ(h.AddSegment(RecordOf(kA, first), tier.Hold(first), "").code(), absl::StatusCode::kInvalidArgument);
}

TEST(HoldingTable, InventoryListsCopiesSegmentsAndOwnedSegmentsOnce) {
  MemoryTier tier;
  HoldingTable& h = tier.holdings();
  ASSERT_TRUE(tier.AddShard(kA, SeededBytes(100, 40)).ok());
  const SegmentId held{"job", 5, 0, 0, 2};
  const SegmentId owned_only{"job", 5, 0, 1, 0};
  const std::string parity = SeededBytes(60, 41);
  ASSERT_TRUE(h.AddSegment(SegmentRecord(held, parity, SegmentKind::kParity), tier.Hold(parity), "").ok());
  h.SetOwned(owned_only, OwnedSegment{50, 0xabcd, 2, 1});
  h.SetOwned(held, OwnedSegment{60, 0x1, 2, 0});  // a held segment is listed as the holding
  ASSERT_TRUE(h.Owned(owned_only).has_value());
  EXPECT_EQ(h.Owned(owned_only)->blob_segment_index, 1u);
  EXPECT_FALSE(h.Owned(SegmentId{"job", 5, 0, 9, 0}).has_value());

  std::vector<InventoryItem> inv = h.InventoryItems();
  ASSERT_EQ(inv.size(), 3u);
  EXPECT_FALSE(inv[0].is_segment);
  EXPECT_EQ(inv[0].id, kA);
  EXPECT_TRUE(inv[1].is_segment);
  EXPECT_EQ(inv[1].segment, held);
  EXPECT_EQ(inv[1].segment_kind, SegmentKind::kParity);
  EXPECT_EQ(inv[1].crc32c, Crc32c(parity));
  EXPECT_TRUE(inv[2].is_segment);
  EXPECT_EQ(inv[2].segment, owned_only);
  EXPECT_EQ(inv[2].segment_kind, SegmentKind::kData);
  EXPECT_EQ(inv[2].size_bytes, 50u);
  EXPECT_EQ(inv[2].crc32c, 0xabcdu);

  h.DropSegment(held);
  EXPECT_FALSE(h.HasValidSegment(held));
  EXPECT_FALSE(h.Owned(held).has_value());
  EXPECT_EQ(h.InventoryItems().size(), 2u);
}

TEST(HoldingTable, DropVersionTakesShardsSegmentsAndOwnedOfThatVersionOnly) {
  MemoryTier tier;
  HoldingTable& h = tier.holdings();
  ASSERT_TRUE(tier.AddShard(ShardId{"job", 5, 0}, SeededBytes(100, 50)).ok());
  ASSERT_TRUE(tier.AddShard(ShardId{"job", 5, 1}, SeededBytes(100, 51)).ok());
  ASSERT_TRUE(tier.AddShard(ShardId{"job", 6, 0}, SeededBytes(100, 52)).ok());
  const std::string p = SeededBytes(10, 53);
  ASSERT_TRUE(h.AddSegment(SegmentRecord({"job", 5, 0, 0, 2}, p, SegmentKind::kParity), tier.Hold(p), "").ok());
  ASSERT_TRUE(h.AddSegment(SegmentRecord({"job", 6, 0, 0, 2}, p, SegmentKind::kParity), tier.Hold(p), "").ok());
  h.SetOwned({"job", 5, 0, 1, 0}, OwnedSegment{10, 1, 2, 0});
  EXPECT_EQ(h.DropVersion("job", 5), 3u);  // two shards and a segment
  EXPECT_EQ(h.shard_count(), 1u);
  EXPECT_TRUE(h.Holds(ShardId{"job", 6, 0}));
  EXPECT_TRUE(h.HasValidSegment({"job", 6, 0, 0, 2}));
  EXPECT_FALSE(h.Owned({"job", 5, 0, 1, 0}).has_value());
  EXPECT_EQ(tier.RecordFiles(), 2u);
  EXPECT_TRUE(h.PinShardsOf("job", 5).empty());
  EXPECT_EQ(h.PinShardsOf("job", 6).size(), 1u);
  EXPECT_EQ(h.PinSegmentsOf("job", 6).size(), 1u);
  EXPECT_EQ(h.DropVersion("job", 5), 0u);
}

TEST(HoldingTable, HeldSummaryNamesVersionsWithTheirSpace) {
  MemoryTier tier;
  HoldingTable& h = tier.holdings();
  EXPECT_EQ(h.HeldSummary(), "no committed versions");
  ASSERT_TRUE(tier.AddShard(ShardId{"job", 5, 0}, SeededBytes(100, 60)).ok());
  ASSERT_TRUE(tier.AddShard(ShardId{"job", 5, 1}, SeededBytes(kPage + 1, 61)).ok());
  ASSERT_TRUE(tier.AddShard(ShardId{"job", 6, 0}, SeededBytes(1, 62)).ok());
  EXPECT_EQ(h.HeldSummary(), "job step 5: 12 KiB (2 shards), job step 6: 4 KiB (1 shard)");
}

TEST(HoldingTable, AdoptTakesBackWhatTheArenaFoundAndReturnsThePrimaries) {
  MemoryTier tier;
  {
    HoldingTable& h = tier.holdings();
    ASSERT_TRUE(tier.AddShard(kA, SeededBytes(300, 70)).ok());
    ASSERT_TRUE(tier.AddShard(kB, SeededBytes(300, 71), true, CopyRole::kReplica).ok());
    const std::string p = SeededBytes(40, 72);
    ASSERT_TRUE(h.AddSegment(SegmentRecord({"job", 5, 0, 0, 2}, p, SegmentKind::kParity), tier.Hold(p), "").ok());
  }
  tier.Close();
  tier.Open();
  HoldingTable& h = tier.holdings();
  std::vector<ShardRecord> primaries = h.Adopt(tier.arena().TakeAdopted());
  ASSERT_EQ(primaries.size(), 1u);
  EXPECT_EQ(primaries[0].id, kA);
  EXPECT_EQ(primaries[0].crc32c, Crc32c(SeededBytes(300, 70)));
  EXPECT_TRUE(h.HoldsValid(kA));
  EXPECT_TRUE(h.Verified(kA));  // the arena checked the crcs
  EXPECT_TRUE(h.HoldsValid(kB));
  EXPECT_TRUE(h.HasValidSegment({"job", 5, 0, 0, 2}));
  EXPECT_EQ(ReadBack(*h.PinValid(kB)->bytes, 300), SeededBytes(300, 71));
  EXPECT_EQ(tier.metrics().holdings->Value(), 2.0);
}

}  // namespace
}  // namespace ckpt::agent
