#include "server/agent/holdings.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/config.h"
#include "common/crc32c.h"
#include "common/lock_check.h"
#include "common/log.h"
#include "common/names.h"

namespace ckpt::agent {

absl::Status CheckShardBytes(const ShardRecord& rec, const Reservation& bytes, uint32_t* actual_crc,
                             std::string* bad_item) {
  uint32_t crc = 0;
  uint64_t pos = 0;
  absl::Status first_bad = absl::OkStatus();
  for (const ManifestItem& item : rec.items) {
    if (item.ref_step) break;  // references come last; their bytes are in another shard
    if (item.offset_bytes > pos) {
      crc = Crc32cCombine(crc, bytes.Crc(pos, item.offset_bytes - pos), item.offset_bytes - pos);
    }
    const uint32_t c = bytes.Crc(item.offset_bytes, item.length_bytes);
    if (c != item.crc32c && first_bad.ok()) {
      if (bad_item != nullptr) *bad_item = item.name;
      first_bad = absl::DataLossError(absl::StrFormat("shard %s item %s: crc32c 0x%08x != manifest 0x%08x",
                                                      ShardIdString(rec.id), QuoteForMessage(item.name), c,
                                                      item.crc32c));
    }
    crc = Crc32cCombine(crc, c, item.length_bytes);
    pos = item.offset_bytes + item.length_bytes;
  }
  if (rec.size_bytes > pos) crc = Crc32cCombine(crc, bytes.Crc(pos, rec.size_bytes - pos), rec.size_bytes - pos);
  if (actual_crc != nullptr) *actual_crc = crc;
  if (!first_bad.ok()) return first_bad;
  if (crc != rec.crc32c) {
    return absl::DataLossError(absl::StrFormat("shard %s: crc32c 0x%08x != recorded 0x%08x (padding changed)",
                                               ShardIdString(rec.id), crc, rec.crc32c));
  }
  return absl::OkStatus();
}

HoldingTable::HoldingTable(Arena* arena, Clock* clock, AgentMetrics* metrics, ReportFn report)
    : arena_(arena), clock_(clock), metrics_(metrics), report_(std::move(report)) {}

std::vector<ShardRecord> HoldingTable::Adopt(std::vector<AdoptedHolding> adopted) {
  std::vector<ShardRecord> primaries;
  CheckedLock lock(&mu_);
  for (AdoptedHolding& a : adopted) {
    Holding h;
    h.verified = true;  // Open() checked the crc
    h.bytes = std::move(a.bytes);
    if (a.record.segment) {
      const SegmentId sid = *a.record.segment;
      h.rec = std::make_shared<const ShardRecord>(std::move(a.record));
      segments_[sid] = std::move(h);
      continue;
    }
    if (a.record.role == CopyRole::kPrimary) primaries.push_back(a.record);
    const ShardId id = a.record.id;
    h.rec = std::make_shared<const ShardRecord>(std::move(a.record));
    shards_[id] = std::move(h);
  }
  UpdateGauge();
  return primaries;
}

void HoldingTable::UpdateGauge() { metrics_->holdings->Set(static_cast<double>(shards_.size())); }

void HoldingTable::RemoveRecords(const std::vector<std::string>& files) {
  for (const std::string& f : files) {
    if (absl::Status s = arena_->RemoveRecord(f); !s.ok()) log::Error("cannot remove record {}: {}", f, s.ToString());
  }
}

absl::Status HoldingTable::Add(ShardRecord rec, ReservationPtr bytes, bool verified, bool if_absent,
                               std::shared_ptr<const ShardRecord>* stored) {
  rec.extents = bytes->TrimmedExtents(rec.size_bytes);
  rec.segment.reset();
  if (absl::Status s = arena_->WriteRecord(&rec); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot record ", ShardIdString(rec.id), " in the memory tier: ",
                                               s.message()));
  }
  const ShardId id = rec.id;
  std::string stale;
  {
    CheckedLock lock(&mu_);
    auto it = shards_.find(id);
    if (it != shards_.end() && if_absent && !it->second.corrupt) {
      stale = rec.file;  // ours: the held copy stays
    } else {
      if (it != shards_.end()) stale = it->second.rec->file;
      Holding h;
      h.rec = std::make_shared<const ShardRecord>(std::move(rec));
      if (stored != nullptr) *stored = h.rec;
      h.bytes = std::move(bytes);
      h.verified = verified;
      shards_[id] = std::move(h);
      UpdateGauge();
      bytes = nullptr;
    }
  }
  RemoveRecords({stale});
  if (bytes != nullptr) return absl::AlreadyExistsError(absl::StrCat(ShardIdString(id), " is already held here"));
  return absl::OkStatus();
}

absl::StatusOr<Pin> HoldingTable::PinValid(const ShardId& id) const {
  CheckedLock lock(&mu_);
  auto it = shards_.find(id);
  if (it == shards_.end()) {
    return absl::NotFoundError(absl::StrCat("shard ", ShardIdString(id), " is not held by this agent"));
  }
  if (it->second.corrupt) {
    return absl::DataLossError(absl::StrCat("the copy of ", ShardIdString(id),
                                            " on this node is quarantined: ", it->second.corrupt_detail));
  }
  return Pin{it->second.rec, it->second.bytes};
}

bool HoldingTable::HoldsValid(const ShardId& id) const {
  CheckedLock lock(&mu_);
  auto it = shards_.find(id);
  return it != shards_.end() && !it->second.corrupt;
}

bool HoldingTable::Holds(const ShardId& id) const {
  CheckedLock lock(&mu_);
  return shards_.count(id) != 0;
}

bool HoldingTable::Verified(const ShardId& id) const {
  CheckedLock lock(&mu_);
  auto it = shards_.find(id);
  return it != shards_.end() && it->second.verified;
}

void HoldingTable::MarkVerified(const Pin& pin) {
  CheckedLock lock(&mu_);
  auto it = shards_.find(pin.rec->id);
  if (it != shards_.end() && it->second.bytes == pin.bytes) it->second.verified = true;
}

void HoldingTable::Quarantine(const Pin& pin, const std::string& why) {
  HoldingReport r;
  {
    CheckedLock lock(&mu_);
    auto it = shards_.find(pin.rec->id);
    if (it == shards_.end() || it->second.bytes != pin.bytes || it->second.corrupt) return;
    it->second.corrupt = true;
    it->second.corrupt_detail = why;
    r.kind = HoldingReport::Kind::kCopyState;
    r.id = pin.rec->id;
    r.copy_role = pin.rec->role;
    r.copy_state = CopyState::kCorrupt;
    r.size_bytes = pin.rec->size_bytes;
    r.crc32c = pin.rec->crc32c;
    r.detail = why;
  }
  metrics_->corrupt->Increment();
  log::Error("quarantined corrupt copy of {}: {}", ShardIdString(pin.rec->id), why);
  report_(std::move(r));
}

absl::Status HoldingTable::SetDurablePath(const Pin& pin, const std::string& path) {
  ShardRecord rec = *pin.rec;
  rec.durable_path = path;
  if (absl::Status s = arena_->WriteRecord(&rec); !s.ok()) return s;
  std::string stale = rec.file;
  {
    CheckedLock lock(&mu_);
    auto it = shards_.find(rec.id);
    if (it != shards_.end() && it->second.bytes == pin.bytes) {
      stale = it->second.rec->file;
      it->second.rec = std::make_shared<const ShardRecord>(std::move(rec));
    }
  }
  RemoveRecords({stale});
  return absl::OkStatus();
}

std::vector<HoldingInfo> HoldingTable::DropShards(const std::function<bool(const ShardRecord&)>& which) {
  std::vector<HoldingInfo> out;
  std::vector<std::string> files;
  std::vector<ReservationPtr> release;  // freed after the lock
  {
    CheckedLock lock(&mu_);
    for (auto it = shards_.begin(); it != shards_.end();) {
      if (!which(*it->second.rec)) {
        ++it;
        continue;
      }
      out.push_back(InfoOf(it->second));
      files.push_back(it->second.rec->file);
      release.push_back(std::move(it->second.bytes));
      it = shards_.erase(it);
    }
    UpdateGauge();
  }
  RemoveRecords(files);
  return out;
}

void HoldingTable::DropShard(const ShardId& id) {
  DropShards([&](const ShardRecord& r) { return r.id == id; });
}

void HoldingTable::QueueVerify(const ShardId& id) {
  CheckedLock lock(&mu_);
  verify_queue_.push_back(id);
}

std::optional<Pin> HoldingTable::NextToVerify() {
  CheckedLock lock(&mu_);
  while (!verify_queue_.empty()) {
    const ShardId id = verify_queue_.front();
    verify_queue_.pop_front();
    auto it = shards_.find(id);
    if (it == shards_.end() || it->second.verified || it->second.corrupt) continue;
    return Pin{it->second.rec, it->second.bytes};
  }
  return std::nullopt;
}

absl::StatusOr<BlobPin> HoldingTable::PinBlob(const std::string& job, uint64_t step) const {
  BlobPin out;
  CheckedLock lock(&mu_);
  for (auto it = shards_.lower_bound(ShardId{job, step, 0});
       it != shards_.end() && it->first.job_id == job && it->first.step == step; ++it) {
    const Holding& h = it->second;
    if (h.rec->role != CopyRole::kPrimary) continue;  // the blob is the node's primaries only
    if (h.corrupt) {
      return absl::DataLossError(absl::StrCat("primary ", ShardIdString(it->first), " is quarantined here"));
    }
    if (!h.verified) {
      return absl::FailedPreconditionError(absl::StrCat("primary ", ShardIdString(it->first), " is not verified yet"));
    }
    for (const auto& p : h.bytes->Pieces(0, h.rec->size_bytes)) out.pieces.push_back(p);
    out.size_bytes += h.rec->size_bytes;
    out.shards.push_back(Pin{h.rec, h.bytes});
  }
  return out;
}

absl::Status HoldingTable::AddSegment(ShardRecord rec, ReservationPtr bytes, const std::string& task_id) {
  rec.extents = bytes->TrimmedExtents(rec.size_bytes);
  if (!rec.segment) return absl::InvalidArgumentError("not a segment record");
  if (absl::Status s = arena_->WriteRecord(&rec); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot record segment ", SegmentIdString(*rec.segment), ": ",
                                               s.message()));
  }
  const SegmentId id = *rec.segment;
  HoldingReport r;
  r.kind = HoldingReport::Kind::kSegment;
  r.segment = id;
  r.segment_kind = rec.segment_kind;
  r.copy_state = CopyState::kValid;
  r.size_bytes = rec.size_bytes;
  r.crc32c = rec.crc32c;
  r.task_id = task_id;
  std::string stale;
  ReservationPtr old;
  {
    CheckedLock lock(&mu_);
    auto it = segments_.find(id);
    if (it != segments_.end()) {
      stale = it->second.rec->file;
      old = std::move(it->second.bytes);
    }
    Holding h;
    h.rec = std::make_shared<const ShardRecord>(std::move(rec));
    h.bytes = std::move(bytes);
    h.verified = true;
    segments_[id] = std::move(h);
  }
  RemoveRecords({stale});
  report_(std::move(r));
  return absl::OkStatus();
}

absl::StatusOr<Pin> HoldingTable::PinSegment(const SegmentId& id) const {
  CheckedLock lock(&mu_);
  auto it = segments_.find(id);
  if (it == segments_.end() || it->second.corrupt) {
    return absl::NotFoundError(absl::StrCat("segment ", SegmentIdString(id), " is not held here"));
  }
  return Pin{it->second.rec, it->second.bytes};
}

bool HoldingTable::HasValidSegment(const SegmentId& id) const {
  CheckedLock lock(&mu_);
  auto it = segments_.find(id);
  return it != segments_.end() && !it->second.corrupt;
}

void HoldingTable::QuarantineSegment(const Pin& pin, const std::string& why, uint32_t actual_crc) {
  HoldingReport r;
  {
    CheckedLock lock(&mu_);
    auto it = segments_.find(*pin.rec->segment);
    if (it == segments_.end() || it->second.bytes != pin.bytes || it->second.corrupt) return;
    it->second.corrupt = true;
    it->second.corrupt_detail = why;
    r.kind = HoldingReport::Kind::kSegment;
    r.segment = *pin.rec->segment;
    r.segment_kind = pin.rec->segment_kind;
    r.copy_state = CopyState::kCorrupt;
    r.size_bytes = pin.rec->size_bytes;
    r.crc32c = actual_crc;
    r.detail = why;
  }
  metrics_->corrupt->Increment();
  log::Error("quarantined corrupt segment {}: {}", SegmentIdString(*pin.rec->segment), why);
  report_(std::move(r));
}

void HoldingTable::SetOwned(const SegmentId& id, const OwnedSegment& owned) {
  CheckedLock lock(&mu_);
  owned_[id] = owned;
}

std::optional<OwnedSegment> HoldingTable::Owned(const SegmentId& id) const {
  CheckedLock lock(&mu_);
  auto it = owned_.find(id);
  if (it == owned_.end()) return std::nullopt;
  return it->second;
}

void HoldingTable::DropSegment(const SegmentId& id) {
  std::string file;
  ReservationPtr release;
  {
    CheckedLock lock(&mu_);
    owned_.erase(id);
    auto it = segments_.find(id);
    if (it == segments_.end()) return;
    file = it->second.rec->file;
    release = std::move(it->second.bytes);
    segments_.erase(it);
  }
  RemoveRecords({file});
}

size_t HoldingTable::DropVersion(const std::string& job, uint64_t step) {
  const size_t shards =
      DropShards([&](const ShardRecord& r) { return r.id.job_id == job && r.id.step == step; }).size();
  std::vector<std::string> files;
  std::vector<ReservationPtr> release;
  {
    CheckedLock lock(&mu_);
    for (auto it = segments_.begin(); it != segments_.end();) {
      if (it->first.job_id == job && it->first.step == step) {
        files.push_back(it->second.rec->file);
        release.push_back(std::move(it->second.bytes));
        it = segments_.erase(it);
      } else {
        ++it;
      }
    }
    std::erase_if(owned_, [&](const auto& kv) { return kv.first.job_id == job && kv.first.step == step; });
  }
  RemoveRecords(files);
  return shards + files.size();
}

HoldingInfo HoldingTable::InfoOf(const Holding& h) {
  HoldingInfo i;
  i.id = h.rec->id;
  i.segment = h.rec->segment;
  i.segment_kind = h.rec->segment_kind;
  i.role = h.rec->role;
  i.state = h.corrupt ? CopyState::kCorrupt : CopyState::kValid;
  i.size_bytes = h.rec->size_bytes;
  i.crc32c = h.rec->crc32c;
  i.manifest_digest = h.rec->manifest_digest;
  i.stored_unix_ms = h.rec->staged_unix_ms;
  i.durable_path = h.rec->durable_path;
  i.verified = h.verified;
  return i;
}

std::vector<HoldingInfo> HoldingTable::Infos(const std::string& job, std::optional<uint64_t> step) const {
  CheckedLock lock(&mu_);
  std::vector<HoldingInfo> out;
  for (const auto& [id, h] : shards_) {
    if (!job.empty() && id.job_id != job) continue;
    if (step && id.step != *step) continue;
    out.push_back(InfoOf(h));
  }
  return out;
}

std::vector<HoldingInfo> HoldingTable::SegmentInfos(const std::string& job, std::optional<uint64_t> step) const {
  CheckedLock lock(&mu_);
  std::vector<HoldingInfo> out;
  for (const auto& [id, h] : segments_) {
    if (!job.empty() && id.job_id != job) continue;
    if (step && id.step != *step) continue;
    out.push_back(InfoOf(h));
  }
  return out;
}

std::vector<InventoryItem> HoldingTable::InventoryItems() const {
  CheckedLock lock(&mu_);
  std::vector<InventoryItem> items;
  for (const auto& [id, h] : shards_) {
    InventoryItem it;
    it.id = id;
    it.role = h.rec->role;
    it.state = h.corrupt ? CopyState::kCorrupt : CopyState::kValid;
    it.size_bytes = h.rec->size_bytes;
    it.crc32c = h.rec->crc32c;
    it.manifest_digest = h.rec->manifest_digest;
    it.stored_unix_ms = h.rec->staged_unix_ms;
    it.durable_path = h.rec->durable_path;
    items.push_back(std::move(it));
  }
  for (const auto& [id, h] : segments_) {
    InventoryItem it;
    it.is_segment = true;
    it.segment = id;
    it.segment_kind = h.rec->segment_kind;
    it.state = h.corrupt ? CopyState::kCorrupt : CopyState::kValid;
    it.size_bytes = h.rec->size_bytes;
    it.crc32c = h.rec->crc32c;
    it.stored_unix_ms = h.rec->staged_unix_ms;
    items.push_back(std::move(it));
  }
  for (const auto& [id, o] : owned_) {
    if (segments_.count(id)) continue;
    InventoryItem it;
    it.is_segment = true;
    it.segment = id;
    it.segment_kind = SegmentKind::kData;
    it.state = CopyState::kValid;
    it.size_bytes = o.length_bytes;
    it.crc32c = o.crc32c;
    items.push_back(std::move(it));
  }
  return items;
}

std::vector<Pin> HoldingTable::PinShardsOf(const std::string& job, uint64_t step) const {
  CheckedLock lock(&mu_);
  std::vector<Pin> out;
  for (auto it = shards_.lower_bound(ShardId{job, step, 0});
       it != shards_.end() && it->first.job_id == job && it->first.step == step; ++it) {
    out.push_back(Pin{it->second.rec, it->second.bytes});
  }
  return out;
}

std::vector<Pin> HoldingTable::PinSegmentsOf(const std::string& job, uint64_t step) const {
  CheckedLock lock(&mu_);
  std::vector<Pin> out;
  for (const auto& [id, h] : segments_) {
    if (id.job_id == job && id.step == step) out.push_back(Pin{h.rec, h.bytes});
  }
  return out;
}

std::string HoldingTable::HeldSummary() const {
  std::map<std::pair<std::string, uint64_t>, std::pair<uint64_t, int>> by_version;
  {
    CheckedLock lock(&mu_);
    for (const auto& [id, h] : shards_) {
      auto& v = by_version[{id.job_id, id.step}];
      v.first += h.bytes->reserved_bytes();
      v.second++;
    }
  }
  std::string held;
  int shown = 0;
  for (const auto& [key, v] : by_version) {
    if (shown++ == 8) {
      absl::StrAppend(&held, ", ...");
      break;
    }
    absl::StrAppend(&held, shown > 1 ? ", " : "", key.first, " step ", key.second, ": ", FormatBytes(v.first), " (",
                    v.second, v.second == 1 ? " shard)" : " shards)");
  }
  return held.empty() ? "no committed versions" : held;
}

size_t HoldingTable::shard_count() const {
  CheckedLock lock(&mu_);
  return shards_.size();
}

uint64_t HoldingTable::SizeOf(const ShardId& id) const {
  CheckedLock lock(&mu_);
  auto it = shards_.find(id);
  return it == shards_.end() ? 0 : it->second.rec->size_bytes;
}

}  // namespace ckpt::agent
