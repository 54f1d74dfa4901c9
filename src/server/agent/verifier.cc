#include "server/agent/verifier.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/lock_check.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt::agent {

Verifier::Verifier(Deps deps) : deps_(std::move(deps)) {}

bool Verifier::VerifyOnce() {
  std::optional<Pin> pin = deps_.holdings->NextToVerify();
  if (!pin) return false;
  absl::Status s = CheckShardBytes(*pin->rec, *pin->bytes, nullptr, nullptr);
  if (s.ok()) {
    deps_.holdings->MarkVerified(*pin);
    if (deps_.on_verified) deps_.on_verified();  // a task may be waiting for it
  } else {
    deps_.holdings->Quarantine(*pin, std::string(s.message()));
  }
  return true;
}

void Verifier::Notify() {
  CheckedLock lock(&mu_);
  ++wake_;
}

void Verifier::AwaitWork(absl::Duration timeout) {
  // The loop is the one consumer of wake_: a wake that came while
  // VerifyOnce ran is not lost.
  CheckedLock lock(&mu_);
  auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || wake_ != wake_seen_; };
  deps_.clock->AwaitWithTimeout(&mu_, absl::Condition(&woken), timeout);
  wake_seen_ = wake_;
}

void Verifier::Stop() {
  CheckedLock lock(&mu_);
  stopping_ = true;
  ++wake_;
}

absl::StatusOr<std::vector<VerifyFinding>> Verifier::Verify(const std::string& job_id, uint64_t step, bool dry_run,
                                                            uint64_t* bytes_checked) {
  HoldingTable* const holdings = deps_.holdings;
  const std::vector<Pin> shards = holdings->PinShardsOf(job_id, step);
  const std::vector<Pin> segments = holdings->PinSegmentsOf(job_id, step);
  if (shards.empty() && segments.empty()) {
    return absl::NotFoundError(absl::StrCat("nothing of ", job_id, " step ", step, " is held here"));
  }
  std::vector<VerifyFinding> out;
  uint64_t checked = 0;
  // EC segments (parity, rebuilt data): their bytes against their crc32c.
  for (const Pin& pin : segments) {
    const ShardRecord& rec = *pin.rec;
    VerifyFinding f;
    f.actual_crc32c = pin.bytes->Crc(0, rec.size_bytes);
    checked += rec.size_bytes;
    f.ok = f.actual_crc32c == rec.crc32c;
    if (!f.ok) {
      f.message = absl::StrFormat("segment crc32c 0x%08x != recorded 0x%08x", f.actual_crc32c, rec.crc32c);
      if (!dry_run) holdings->QuarantineSegment(pin, f.message, f.actual_crc32c);
    }
    f.holding.id = rec.id;
    f.holding.segment = rec.segment;
    f.holding.segment_kind = rec.segment_kind;
    f.holding.state = f.ok || dry_run ? CopyState::kValid : CopyState::kCorrupt;
    f.holding.size_bytes = rec.size_bytes;
    f.holding.crc32c = rec.crc32c;
    f.holding.stored_unix_ms = rec.staged_unix_ms;
    out.push_back(std::move(f));
  }
  for (const Pin& pin : shards) {
    VerifyFinding f;
    absl::Status s = CheckShardBytes(*pin.rec, *pin.bytes, &f.actual_crc32c, &f.bad_item);
    checked += pin.rec->size_bytes;
    f.ok = s.ok();
    f.message = std::string(s.message());
    if (s.ok()) {
      holdings->MarkVerified(pin);
    } else if (!dry_run) {
      holdings->Quarantine(pin, f.message);
    }
    for (const HoldingInfo& h : holdings->Infos(pin.rec->id.job_id, pin.rec->id.step)) {
      if (h.id == pin.rec->id) f.holding = h;
    }
    if (f.holding.id.job_id.empty()) {
      f.holding.id = pin.rec->id;
      f.holding.role = pin.rec->role;
      f.holding.size_bytes = pin.rec->size_bytes;
      f.holding.crc32c = pin.rec->crc32c;
    }
    out.push_back(std::move(f));
  }
  if (bytes_checked != nullptr) *bytes_checked = checked;
  return out;
}

absl::StatusOr<std::vector<HoldingInfo>> Verifier::Evict(const std::string& job_id, uint64_t step, bool dry_run) {
  HoldingTable* const holdings = deps_.holdings;
  CKPT_RETURN_IF_ERROR(ValidateJobId(job_id));
  if (holdings->Infos(job_id, step).empty()) {
    return absl::NotFoundError(absl::StrCat("nothing of ", job_id, " step ", step, " is held here"));
  }
  CKPT_ASSIGN_OR_RETURN(MetaLink::EvictFacts facts, deps_.meta->GetEvictFacts(job_id, step));
  const auto state = static_cast<VersionState>(facts.version_state);
  const bool ended = state == VersionState::kAborted || state == VersionState::kDeleted;
  if (facts.newest_protected_step == step && !ended) {
    return absl::FailedPreconditionError(absl::StrCat(
        job_id, " step ", step, " is the job's newest version at PROTECTED level or better; it is never evicted"));
  }
  if (state != VersionState::kPersisted && !ended) {
    return absl::FailedPreconditionError(absl::StrCat(
        job_id, " step ", step,
        " is not PERSISTED: this node's copy may be the last readable one; flush it first (ckptctl flush) "
        "or let retention evict it"));
  }
  if (dry_run) return holdings->Infos(job_id, step);
  std::vector<HoldingInfo> out =
      holdings->DropShards([&](const ShardRecord& r) { return r.id.job_id == job_id && r.id.step == step; });
  for (const HoldingInfo& info : out) {
    HoldingReport r;
    r.kind = HoldingReport::Kind::kCopyState;
    r.id = info.id;
    r.copy_role = info.role;
    r.copy_state = CopyState::kEvicted;
    r.size_bytes = info.size_bytes;
    r.crc32c = info.crc32c;
    r.detail = "evicted by a node-local command";
    deps_.session->Report(std::move(r));
  }
  deps_.parity->EvictVersion(job_id, step);
  if (deps_.on_freed) deps_.on_freed();
  log::Info("evicted {} holdings of {} step {} (node-local command)", out.size(), job_id, step);
  return out;
}

size_t Verifier::EvictVersion(const std::string& job_id, uint64_t step) {
  deps_.parity->EvictVersion(job_id, step);
  const size_t n = deps_.holdings->DropVersion(job_id, step);
  if (n != 0) log::Info("evicted {} holdings of {} step {}", n, job_id, step);
  if (deps_.on_freed) deps_.on_freed();
  return n;
}

}  // namespace ckpt::agent
