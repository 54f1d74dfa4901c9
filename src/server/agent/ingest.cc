#include "server/agent/ingest.h"

#include <algorithm>
#include <span>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/config.h"
#include "common/crc32c.h"
#include "common/lock_check.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt::agent {
namespace {

// A shard's crc from its items' crcs (`items` in canonical order) and the
// padding between them: no pass over the item bytes (the verifier does that
// in the background). References are another shard's bytes.
uint32_t ShardCrc(const std::vector<ManifestItem>& items, const Reservation& bytes, uint64_t size) {
  uint32_t crc = 0;
  uint64_t pos = 0;
  for (const ManifestItem& item : items) {
    if (item.ref_step) break;  // references come last
    if (item.offset_bytes > pos) {
      crc = Crc32cCombine(crc, bytes.Crc(pos, item.offset_bytes - pos), item.offset_bytes - pos);
    }
    crc = Crc32cCombine(crc, item.crc32c, item.length_bytes);
    pos = std::max(pos, item.offset_bytes + item.length_bytes);
  }
  if (size > pos) crc = Crc32cCombine(crc, bytes.Crc(pos, size - pos), size - pos);
  return crc;
}

// Leases and handles of a session never expire by ttl.
absl::Duration TtlFor(const std::string& session_id, int64_t ttl_ms, int64_t default_ms) {
  if (!session_id.empty()) return absl::InfiniteDuration();  // lives with the session
  return absl::Milliseconds(ttl_ms > 0 ? ttl_ms : default_ms);
}

}  // namespace

absl::Status CheckClientSession(const SessionServer* sessions, const std::string& session_id) {
  if (session_id.empty()) return absl::OkStatus();
  if (sessions == nullptr || !sessions->Open(session_id)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "client session \"", session_id, "\" is not open on this agent (it restarted, or the client's session "
        "connection closed); reconnect"));
  }
  return absl::OkStatus();
}

Ingest::Ingest(Deps deps) : deps_(std::move(deps)) {}

void Ingest::Stop() {
  CheckedLock lock(&jobs_mu_);
  stopping_ = true;
}

void Ingest::Changed() {
  if (deps_.on_changed) deps_.on_changed();
}

std::string Ingest::BudgetMessage(uint64_t want) const {
  return absl::StrCat("memory tier cannot hold ", FormatBytes(want), ": ", FormatBytes(deps_.arena->free_bytes()),
                      " free of ", FormatBytes(deps_.arena->capacity_bytes()), " (largest free run ",
                      FormatBytes(deps_.arena->largest_free_extent()), "); held by ", deps_.holdings->HeldSummary(),
                      "; open leases: ", FormatBytes(deps_.leases->LeasedBytes()), " in ", deps_.leases->lease_count(),
                      ". Older versions are evicted when meta's retention allows it (a newer version "
                      "PROTECTED); raise --memory or lower retention.keep_in_memory");
}

absl::StatusOr<LeaseGrant> Ingest::AcquireLease(const LeaseRequest& req) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(req.job_id));
  if (req.size_bytes == 0) return absl::InvalidArgumentError("size_bytes must be larger than 0");
  if (req.size_bytes > deps_.arena->capacity_bytes()) {
    deps_.metrics->lease_rejected->Increment();
    return absl::ResourceExhaustedError(absl::StrCat("a shard of ", FormatBytes(req.size_bytes),
                                                     " is larger than the whole memory tier (",
                                                     FormatBytes(deps_.arena->capacity_bytes()), "); raise --memory"));
  }
  {
    CheckedLock lock(&jobs_mu_);
    if (stopping_) return absl::UnavailableError("agent is shutting down");
  }
  CKPT_RETURN_IF_ERROR(CheckClientSession(deps_.sessions, req.session_id));
  const ShardId id{req.job_id, req.step, req.rank};
  const ClientRef client{req.client_pid, req.session_id};
  // Another live client's uncommitted lease for the shard: refused before
  // anything is begun at meta or reserved (Add checks again).
  if (absl::Status may = deps_.leases->MayLease(id, client); !may.ok()) {
    deps_.metrics->lease_rejected->Increment();
    return may;
  }
  if (deps_.holdings->HoldsValid(id)) {
    return absl::AlreadyExistsError(absl::StrCat("shard ", ShardIdString(id), " is already committed on this node"));
  }
  for (uint64_t base : req.base_steps) {
    if (base >= req.step || !deps_.holdings->HoldsValid(ShardId{req.job_id, base, req.rank})) {
      return absl::FailedPreconditionError(absl::StrCat("base version ", base, " of ", req.job_id, " rank ", req.rank,
                                                        " is not held on this node: save in full"));
    }
  }
  const auto begun_key = std::make_tuple(req.job_id, req.step, req.run_id);
  std::optional<uint32_t> world_size;
  {
    CheckedLock lock(&jobs_mu_);
    if (auto b = begun_.find(begun_key); b != begun_.end()) world_size = b->second;
    if (auto j = job_world_.find(req.job_id); !world_size && j != job_world_.end()) world_size = j->second;
  }
  // A rank beyond the size known here: the job may have been resized since
  // (CreateJob resize_world): meta says.
  if (world_size && req.rank >= *world_size && !req.without_meta) world_size.reset();
  if (!world_size && req.without_meta) {
    return absl::UnavailableError("this job's first lease on this node asks meta: use AcquireStagingLease");
  }
  if (!world_size) {
    // First save of the job on this node: a read-only look-up at meta, so an
    // unknown job is the lease's error (no write, no fsync on this path).
    absl::StatusOr<uint32_t> ws = deps_.meta->JobWorldSize(req.job_id);
    if (!ws.ok()) {
      if (!IsPermanentRefusal(ws.status())) deps_.metrics->meta_errors->Increment();
      return ws.status();
    }
    world_size = *ws;
  }
  if (req.rank >= *world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", req.rank, " is out of range: job ", req.job_id,
                                                   " has world size ", *world_size));
  }
  bool begin = false;
  {
    CheckedLock lock(&jobs_mu_);
    job_world_[req.job_id] = *world_size;
    if (!req.begin_at_commit) begin = begun_.emplace(begun_key, *world_size).second;
  }
  // Begin the version at meta in the background, before its STAGED reports:
  // a save never waits for meta's fsync, nor for meta at all once the job is
  // known here.
  if (begin) deps_.session->Begin(req.job_id, req.step, req.run_id);
  absl::StatusOr<ReservationPtr> bytes = deps_.arena->Reserve(req.size_bytes);
  if (!bytes.ok()) {
    deps_.metrics->lease_rejected->Increment();
    return absl::ResourceExhaustedError(BudgetMessage(req.size_bytes));
  }
  const absl::Duration ttl = TtlFor(req.session_id, req.ttl_ms, deps_.default_lease_ttl_ms);
  LeaseGrant grant;
  grant.regions = RegionsOf(deps_.arena->pool_path(), (*bytes)->extents(), req.size_bytes);
  grant.expires_in_ms = ttl == absl::InfiniteDuration() ? 0 : absl::ToInt64Milliseconds(ttl);
  grant.item_alignment_bytes = deps_.item_alignment_bytes;
  if (deps_.puller != nullptr) {
    // The client cannot map this agent's memory (on a DPU it is not even on
    // the same machine): it stages the shard itself and commits naming it.
    grant.pull = true;
    grant.regions.clear();
  }
  absl::StatusOr<std::string> lease_id =
      deps_.leases->Add(id, req.size_bytes, *std::move(bytes), req.run_id, client, ttl, req.begin_at_commit);
  if (!lease_id.ok()) {
    deps_.metrics->lease_rejected->Increment();
    return lease_id.status();
  }
  grant.lease_id = *std::move(lease_id);
  if (grant.pull) grant.pull_token = PullToken(grant.lease_id);
  Changed();
  return grant;
}

absl::StatusOr<std::shared_ptr<const ShardRecord>> Ingest::Commit(const std::string& lease_id, uint64_t size_bytes,
                                                                  std::vector<ManifestItem> items,
                                                                  const PullSource* pull,
                                                                  const std::string& session_id) {
  CKPT_ASSIGN_OR_RETURN(CommittingLease l, deps_.leases->BeginCommit(lease_id, size_bytes, session_id));
  // Validation, the pull and the crcs run without any lock; the lease stays
  // usable if they fail.
  std::vector<Pin> bases;
  absl::Status valid = ValidateManifest(items, l.size_bytes, l.shard.step);
  if (valid.ok()) valid = CheckRefs(l.shard, items, &bases);
  if (valid.ok() && (deps_.puller != nullptr) != (pull != nullptr)) {
    valid = absl::FailedPreconditionError(
        deps_.puller != nullptr
            ? "this agent pulls shards from the client's staging memory (ckpt-dpu-agent): the commit must name it "
              "(pull_source); the client library is too old for a DPU agent"
            : "this agent does not pull (a host ckpt-agent): the shard is written into the lease's regions, and the "
              "commit names no pull_source");
  }
  const bool pulled = valid.ok() && pull != nullptr;
  if (pulled) valid = PullInto(l, items, *pull);
  if (!valid.ok()) {
    deps_.leases->CancelCommit(lease_id);
    return valid;
  }
  SortByOffset(items);
  ShardRecord rec;
  rec.id = l.shard;
  rec.role = CopyRole::kPrimary;
  rec.size_bytes = l.size_bytes;
  rec.crc32c = ShardCrc(items, *l.bytes, l.size_bytes);
  SetItems(rec, std::move(items));
  rec.run_id = l.run_id;
  rec.staged_unix_ms = deps_.clock->NowUnixMillis();
  const ShardId id = rec.id;
  const uint64_t size = rec.size_bytes;
  deps_.session->ForgetStaged(id.job_id, id.step);  // a new instance of the version
  std::shared_ptr<const ShardRecord> stored;  // the held record: no copy of its items
  if (absl::Status s = deps_.holdings->Add(std::move(rec), l.bytes, /*verified=*/pulled, /*if_absent=*/true, &stored);
      !s.ok()) {
    deps_.leases->CancelCommit(lease_id);
    if (absl::IsAlreadyExists(s)) {
      return absl::AlreadyExistsError(absl::StrCat("shard ", ShardIdString(id), " is already committed on this node"));
    }
    log::Error("cannot record shard {}: {}", ShardIdString(id), s.ToString());
    return s;
  }
  if (!deps_.leases->FinishCommit(lease_id, id)) {
    // The lease vanished meanwhile (replaced by a newer lease of the rank):
    // the newer save wins.
    deps_.holdings->DropShard(id);
    return absl::FailedPreconditionError(absl::StrCat("lease \"", lease_id, "\" was replaced while committing"));
  }
  if (!pulled) {  // a pulled shard's items were checked as it arrived
    deps_.holdings->QueueVerify(id);
    deps_.verifier->Notify();
  }
  HoldingReport r;
  r.kind = HoldingReport::Kind::kStaged;
  r.record = stored;
  MetaSession::Done released;
  if (!bases.empty()) {
    {
      CheckedLock lock(&base_pins_->mu);
      base_pins_->by_shard[id] = {stored->crc32c, std::move(bases)};
    }
    released = [pins = base_pins_, id, crc = stored->crc32c](const absl::Status&) { pins->Take(id, crc); };
  }
  // A lease asked for ahead of its save (begin_at_commit) begins the version
  // now, ahead of the report (the outbox keeps their order); any other lease
  // began it already.
  bool begin = false;
  {
    CheckedLock lock(&jobs_mu_);
    if (auto j = job_world_.find(id.job_id); j != job_world_.end()) {
      begin = begun_.emplace(std::make_tuple(id.job_id, id.step, l.run_id), j->second).second;
    }
  }
  if (begin) deps_.session->Begin(id.job_id, id.step, l.run_id);
  deps_.session->Report(std::move(r), std::move(released));
  deps_.metrics->staged_bytes->Increment(static_cast<double>(size));
  deps_.metrics->staged_shards->Increment();
  Changed();
  return stored;
}

std::string Ingest::PullToken(const std::string& lease_id) const {
  static_assert(kPullTokenBytes == kHmacSha256Bytes);
  return HmacSha256(token_key_, absl::StrCat("pull:", lease_id));
}

std::string Ingest::DeliverToken(const std::string& handle_id) const {
  return HmacSha256(token_key_, absl::StrCat("deliver:", handle_id));
}

absl::Status Ingest::PullInto(const CommittingLease& l, const std::vector<ManifestItem>& items,
                              const PullSource& pull) {
  const absl::Time t0 = absl::Now();
  absl::Status s = deps_.puller->Pull(pull, PullToken(l.lease_id), l.bytes, l.size_bytes,
                                      absl::Milliseconds(deps_.peer_timeout_ms));
  if (!s.ok()) {
    deps_.metrics->pull_errors->Increment();
    log::Warn("cannot pull {} ({} bytes) from the client: {}", ShardIdString(l.shard), l.size_bytes, s.ToString());
    return s;
  }
  // Every byte that arrived is checked before the shard is recorded.
  for (const ManifestItem& item : items) {
    if (item.ref_step || item.length_bytes == 0) continue;
    const uint32_t crc = l.bytes->Crc(item.offset_bytes, item.length_bytes);
    if (crc != item.crc32c) {
      deps_.metrics->pull_errors->Increment();
      return absl::DataLossError(absl::StrCat("item ", QuoteForMessage(item.name), " of ", ShardIdString(l.shard),
                                              " pulled from the client has crc32c ", absl::Hex(crc, absl::kZeroPad8),
                                              ", its manifest says ", absl::Hex(item.crc32c, absl::kZeroPad8)));
    }
  }
  deps_.metrics->pulled_bytes->Increment(static_cast<double>(l.size_bytes));
  deps_.metrics->pull_seconds->Increment(absl::ToDoubleSeconds(absl::Now() - t0));
  return absl::OkStatus();
}

std::vector<Pin> Ingest::BasePins::Take(const ShardId& id, uint32_t crc32c) {
  std::vector<Pin> out;
  {
    CheckedLock lock(&mu);
    auto it = by_shard.find(id);
    if (it == by_shard.end() || it->second.first != crc32c) return out;
    out = std::move(it->second.second);
    by_shard.erase(it);
  }
  return out;  // (the pins go with the caller's copy, outside the lock)
}

absl::Status Ingest::CheckRefs(const ShardId& id, const std::vector<ManifestItem>& items,
                               std::vector<Pin>* bases) const {
  std::map<uint64_t, std::vector<const ManifestItem*>> by_base;
  for (const ManifestItem& item : items) {
    if (item.ref_step) by_base[*item.ref_step].push_back(&item);
  }
  for (const auto& [base, refs] : by_base) {
    const ShardId base_id{id.job_id, base, id.rank};
    absl::StatusOr<Pin> pin = deps_.holdings->PinValid(base_id);
    if (!pin.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("shard ", ShardIdString(id), " refers to items of ",
                                                        ShardIdString(base_id), ", which is not held on this node (",
                                                        pin.status().message(), "): save in full"));
    }
    // The base's own items, by offset: each reference must be one of them.
    std::map<uint64_t, const ManifestItem*> own;
    for (const ManifestItem& it : pin->rec->items) {
      if (!it.ref_step && it.length_bytes > 0) own.emplace(it.offset_bytes, &it);
    }
    for (const ManifestItem* ref : refs) {
      if (ref->length_bytes == 0) continue;
      auto it = own.find(ref->offset_bytes);
      if (it == own.end() || it->second->length_bytes != ref->length_bytes || it->second->crc32c != ref->crc32c) {
        return absl::InvalidArgumentError(absl::StrCat(
            "item ", QuoteForMessage(ref->name), " refers to [", ref->offset_bytes, ", +", ref->length_bytes,
            ") with crc32c ", absl::Hex(ref->crc32c, absl::kZeroPad8), " of ", ShardIdString(base_id),
            ", which holds no such item"));
      }
    }
    bases->push_back(*std::move(pin));
  }
  return absl::OkStatus();
}

absl::Status Ingest::CompactRefused(const ShardRecord& rec, const std::vector<Pin>& bases) {
  CKPT_ASSIGN_OR_RETURN(Pin self, deps_.holdings->PinValid(rec.id));
  if (self.rec->crc32c != rec.crc32c) {
    return absl::FailedPreconditionError("another copy of the shard was stored meanwhile");
  }
  // The own items keep their offsets; each referred item goes after them.
  struct Move {
    const Pin* from;
    uint64_t from_offset;
    uint64_t to_offset;
    uint64_t length;
  };
  std::vector<Move> moves;
  std::vector<ManifestItem> items = self.rec->items;
  uint64_t pos = self.rec->size_bytes;
  const uint64_t align = std::max<uint64_t>(deps_.item_alignment_bytes, 1);
  for (ManifestItem& item : items) {
    if (!item.ref_step) continue;
    auto base = std::find_if(bases.begin(), bases.end(), [&](const Pin& p) { return p.rec->id.step == *item.ref_step; });
    if (base == bases.end()) {
      return absl::FailedPreconditionError(absl::StrCat("version ", *item.ref_step, " is not pinned here"));
    }
    item.ref_step.reset();
    if (item.length_bytes == 0) {
      item.offset_bytes = 0;
      continue;
    }
    // Several references may name the same base item: the total is checked
    // (a wrapped size would reserve too little for the copies below).
    uint64_t at = 0;
    if (__builtin_add_overflow(pos, align - 1, &at) ||
        __builtin_add_overflow(at / align * align, item.length_bytes, &pos)) {
      return absl::InvalidArgumentError(absl::StrCat("shard ", ShardIdString(rec.id), ": its items up to ",
                                                     QuoteForMessage(item.name), " (", item.length_bytes,
                                                     " bytes) add up to more than 2^64 bytes"));
    }
    at = at / align * align;
    moves.push_back(Move{&*base, item.offset_bytes, at, item.length_bytes});
    item.offset_bytes = at;
  }
  const uint64_t size = pos;
  absl::StatusOr<ReservationPtr> bytes = deps_.arena->Reserve(size);
  if (!bytes.ok()) return absl::ResourceExhaustedError(BudgetMessage(size));
  // Copies and crcs without any lock: the pins keep every source alive.
  const auto copy = [&](const Reservation& from, uint64_t from_offset, uint64_t to_offset, uint64_t length) {
    for (std::span<const std::byte> piece : from.Pieces(from_offset, length)) {
      (*bytes)->CopyIn(to_offset, piece);
      to_offset += piece.size();
    }
  };
  copy(*self.bytes, 0, 0, self.rec->size_bytes);
  (*bytes)->Zero(self.rec->size_bytes, size - self.rec->size_bytes);
  for (const Move& m : moves) {
    copy(*m.from->bytes, m.from_offset, m.to_offset, m.length);
  }
  SortByOffset(items);
  for (const ManifestItem& item : items) {
    if (item.length_bytes > 0 && item.offset_bytes >= self.rec->size_bytes &&
        (*bytes)->Crc(item.offset_bytes, item.length_bytes) != item.crc32c) {
      return absl::DataLossError(absl::StrCat("item ", QuoteForMessage(item.name),
                                              " of the referred version does not match its crc32c"));
    }
  }
  ShardRecord out;
  out.id = rec.id;
  out.role = CopyRole::kPrimary;
  out.size_bytes = size;
  out.crc32c = ShardCrc(items, **bytes, size);
  SetItems(out, std::move(items));
  out.run_id = self.rec->run_id;
  out.staged_unix_ms = self.rec->staged_unix_ms;
  std::shared_ptr<const ShardRecord> stored;
  deps_.session->ForgetStaged(rec.id.job_id, rec.id.step);
  CKPT_RETURN_IF_ERROR(deps_.holdings->Add(std::move(out), *std::move(bytes), /*verified=*/false,
                                            /*if_absent=*/false, &stored));
  log::Warn("meta no longer holds a version {} refers to: stored it self-contained ({} instead of {})",
            ShardIdString(rec.id), FormatBytes(size), FormatBytes(rec.size_bytes));
  deps_.metrics->shards_compacted->Increment();
  deps_.holdings->QueueVerify(rec.id);
  deps_.verifier->Notify();
  HoldingReport r;
  r.kind = HoldingReport::Kind::kStaged;
  r.record = std::move(stored);
  deps_.session->Report(std::move(r));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Meta's refusals

void Ingest::OnVersionRefused(const std::string& job, uint64_t step, const std::string& run_id) {
  {
    CheckedLock lock(&jobs_mu_);
    begun_.erase(std::make_tuple(job, step, run_id));
  }
  deps_.holdings->DropShards([&](const ShardRecord& r) {
    return r.id.job_id == job && r.id.step == step && r.run_id == run_id && r.role == CopyRole::kPrimary;
  });
}

void Ingest::OnShardRefused(const HoldingReport& r, const absl::Status& why) {
  const bool staged = r.kind == HoldingReport::Kind::kStaged && r.record != nullptr;
  const ShardId id = staged ? r.record->id : r.id;
  const uint32_t crc = staged ? r.record->crc32c : r.crc32c;
  // Only the copy the report was about (a newer one of the same shard may
  // have been stored since).
  absl::StatusOr<Pin> held = deps_.holdings->PinValid(id);
  if (held.ok() && held->rec->crc32c != crc) return;
  if (staged && IsMissingBaseRefusal(why)) {
    if (std::vector<Pin> bases = base_pins_->Take(id, crc); !bases.empty()) {
      absl::Status s = CompactRefused(*r.record, bases);
      if (s.ok()) return;
      log::Warn("cannot store {} self-contained: {}", ShardIdString(id), s.ToString());
    }
  }
  log::Warn("meta refused {}: {}; dropping this copy", ShardIdString(id), why.ToString());
  deps_.holdings->DropShard(id);
}

}  // namespace ckpt::agent
