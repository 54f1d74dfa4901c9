#include "server/agent/parity_builder.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/lock_check.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/agent/ec_support.h"

namespace ckpt::agent {
namespace {
constexpr size_t kFailureMemory = 4096;
}  // namespace

ParityBuilder::ParityBuilder(Arena* arena, HoldingTable* holdings, Clock* clock, AgentMetrics* metrics,
                             absl::Duration expire_after)
    : arena_(arena), holdings_(holdings), clock_(clock), metrics_(metrics), expire_after_(expire_after) {}

SegmentId ParityBuilder::KeyOf(const PutBegin& b) {
  return SegmentId{b.job_id, b.step, b.group, b.stripe, b.parity_position};
}

void ParityBuilder::DropLocked(std::map<SegmentId, Build>::iterator it, const char* why) {
  log::Warn("parity {} abandoned ({}): {} of {} data segments folded", SegmentIdString(it->first), why,
            it->second.complete.size(), it->second.data_k);
  metrics_->parity_builds_dropped->Increment();
  builds_.erase(it);  // the space goes when the last fold in progress lets go
  metrics_->parity_builds->Set(static_cast<double>(builds_.size()));
}

absl::Status ParityBuilder::BeginPush(const PutBegin& b) {
  const SegmentId sid = KeyOf(b);
  if (holdings_->HasValidSegment(sid)) {
    return absl::AlreadyExistsError("this parity is complete and held here");
  }
  {
    CheckedLock lock(&mu_);
    auto e = evicted_.find({b.job_id, b.step});
    if (e != evicted_.end() && clock_->MonotonicNow() - e->second <= expire_after_) {
      return absl::FailedPreconditionError(absl::StrCat("version ", b.job_id, "/", b.step,
                                                        " was evicted here; its parity is no longer built"));
    }
  }
  ReservationPtr fresh;
  for (int round = 0; round < 2; ++round) {
    {
      CheckedLock lock(&mu_);
      auto it = builds_.find(sid);
      if (it == builds_.end() && fresh != nullptr) {
        Build nb;
        nb.data_k = b.data_k;
        nb.parity_m = b.parity_m;
        nb.stripe_bytes = b.stripe_bytes;
        nb.expect_mask = b.expect_mask;
        nb.bytes = std::move(fresh);
        nb.last_activity = clock_->MonotonicNow();
        it = builds_.emplace(sid, std::move(nb)).first;
        failures_.erase(sid);
        metrics_->parity_builds->Set(static_cast<double>(builds_.size()));
      }
      if (it != builds_.end()) {
        Build& pb = it->second;
        if (pb.data_k != b.data_k || pb.parity_m != b.parity_m || pb.stripe_bytes != b.stripe_bytes ||
            pb.expect_mask != b.expect_mask) {
          return absl::InvalidArgumentError(absl::StrCat(
              "push geometry (k ", b.data_k, ", m ", b.parity_m, ", stripe ", b.stripe_bytes, " bytes, mask ",
              b.expect_mask, ") differs from the parity being built (k ", pb.data_k, ", m ", pb.parity_m,
              ", stripe ", pb.stripe_bytes, " bytes, mask ", pb.expect_mask, ")"));
        }
        if (!pb.error.ok()) return pb.error;
        if (pb.finishing || pb.complete.count(b.data_position) != 0) {
          // Folding the same segment twice would cancel it out (XOR).
          return absl::AlreadyExistsError("this data segment is already folded into the parity");
        }
        if (pb.receiving.count(b.data_position) != 0) {
          return absl::AbortedError("this data segment is being received from another push");
        }
        pb.receiving.insert(b.data_position);
        pb.folded[b.data_position] = 0;
        pb.last_activity = clock_->MonotonicNow();
        return absl::OkStatus();
      }
    }
    // First push of this stripe: a new parity starts as zeros. Zeroing
    // (possibly cold) memory takes a while, so not under the lock.
    absl::StatusOr<ReservationPtr> r = arena_->Reserve(std::max<uint64_t>(b.stripe_bytes, 1));
    if (!r.ok()) return r.status();
    fresh = *std::move(r);
    fresh->Zero(0, b.stripe_bytes);
  }
  return absl::InternalError("parity build vanished while being created");
}

absl::Status ParityBuilder::Fold(const PutBegin& b, uint64_t offset, std::span<const std::byte> data) {
  ReservationPtr bytes;
  uint32_t k, m;
  {
    CheckedLock lock(&mu_);
    auto it = builds_.find(KeyOf(b));
    if (it == builds_.end() || it->second.finishing || !it->second.error.ok() ||
        it->second.receiving.count(b.data_position) == 0) {
      return absl::FailedPreconditionError("no parity is being built for this stripe");
    }
    if (offset > it->second.stripe_bytes || data.size() > it->second.stripe_bytes - offset) {
      return absl::InvalidArgumentError("chunk beyond the stripe");
    }
    bytes = it->second.bytes;
    k = it->second.data_k;
    m = it->second.parity_m;
  }
  CKPT_ASSIGN_OR_RETURN(const ec::Codec* codec, CodecFor(k, m));
  uint64_t done = 0;
  for (const auto& piece : bytes->MutablePieces(offset, data.size())) {
    CKPT_RETURN_IF_ERROR(codec->EncodeUpdateRow(
        static_cast<int>(b.data_position), static_cast<int>(b.parity_position - k),
        ec::ConstBuffer(reinterpret_cast<const uint8_t*>(data.data()) + done, piece.size()),
        ec::MutableBuffer(reinterpret_cast<uint8_t*>(piece.data()), piece.size())));
    done += piece.size();
  }
  CheckedLock lock(&mu_);
  auto it = builds_.find(KeyOf(b));
  if (it != builds_.end() && it->second.bytes == bytes) {
    it->second.folded[b.data_position] += data.size();
    it->second.last_activity = clock_->MonotonicNow();
  }
  return absl::OkStatus();
}

void ParityBuilder::PushFailed(const PutBegin& b, const absl::Status& why) {
  CheckedLock lock(&mu_);
  auto it = builds_.find(KeyOf(b));
  if (it == builds_.end() || it->second.finishing) return;
  Build& pb = it->second;
  if (pb.receiving.erase(b.data_position) == 0) return;
  auto f = pb.folded.find(b.data_position);
  if (f != pb.folded.end() && f->second > 0 && pb.error.ok()) {
    // A partial fold spoils the parity: the task fails and meta re-plans.
    pb.error = absl::Status(why.code(), absl::StrCat("parity ", SegmentIdString(it->first),
                                                     " spoiled by a broken push: ", why.message()));
  }
  pb.folded.erase(b.data_position);
  if (!pb.error.ok() && pb.receiving.empty()) {
    failures_[it->first] = pb.error;
    if (failures_.size() > kFailureMemory) failures_.erase(failures_.begin());
    DropLocked(it, "a push broke off mid-fold");
  }
}

absl::Status ParityBuilder::PushComplete(const PutBegin& b) {
  const SegmentId sid = KeyOf(b);
  ReservationPtr bytes;
  uint64_t stripe_bytes = 0;
  {
    CheckedLock lock(&mu_);
    auto it = builds_.find(sid);
    if (it == builds_.end()) return absl::FailedPreconditionError("the parity build was dropped");
    Build& pb = it->second;
    pb.receiving.erase(b.data_position);
    if (!pb.error.ok()) return pb.error;
    pb.complete.insert(b.data_position);
    pb.last_activity = clock_->MonotonicNow();
    for (uint32_t d = 0; d < pb.data_k; ++d) {
      if ((pb.expect_mask >> d & 1) != 0 && pb.complete.count(d) == 0) return absl::OkStatus();
    }
    if (pb.finishing) return absl::OkStatus();
    pb.finishing = true;
    bytes = pb.bytes;
    stripe_bytes = pb.stripe_bytes;
  }
  // Every data segment is in: checksum, record and store, without the lock.
  ShardRecord rec;
  rec.id = ShardId{b.job_id, b.step, 0};
  rec.segment = sid;
  rec.segment_kind = SegmentKind::kParity;
  rec.size_bytes = stripe_bytes;
  rec.crc32c = bytes->Crc(0, stripe_bytes);
  rec.staged_unix_ms = clock_->NowUnixMillis();
  absl::Status s = holdings_->AddSegment(rec, bytes, "");
  CheckedLock lock(&mu_);
  auto it = builds_.find(sid);
  if (!s.ok()) {
    log::Error("cannot store parity {}: {}", SegmentIdString(sid), s.ToString());
    failures_[sid] = s;
    if (it != builds_.end()) DropLocked(it, "its record could not be written");
    return s;
  }
  if (it != builds_.end()) builds_.erase(it);
  metrics_->parity_builds->Set(static_cast<double>(builds_.size()));
  metrics_->parity_stored->Increment();
  log::Info("parity {} complete ({} bytes)", SegmentIdString(sid), stripe_bytes);
  return absl::OkStatus();
}

absl::Status ParityBuilder::TakeFailure(const SegmentId& id) {
  CheckedLock lock(&mu_);
  auto it = builds_.find(id);
  if (it != builds_.end() && !it->second.error.ok() && !it->second.finishing) {
    const absl::Status e = it->second.error;
    DropLocked(it, "its task gave up on it");
    return e;
  }
  auto f = failures_.find(id);
  if (f == failures_.end()) return absl::OkStatus();
  const absl::Status e = f->second;
  failures_.erase(f);
  return e;
}

void ParityBuilder::DropVersion(const std::string& job, uint64_t step) {
  CheckedLock lock(&mu_);
  for (auto it = builds_.begin(); it != builds_.end();) {
    auto next = std::next(it);
    if (it->first.job_id == job && it->first.step == step && !it->second.finishing) {
      DropLocked(it, "its version was evicted or its task cancelled");
    }
    it = next;
  }
  std::erase_if(failures_, [&](const auto& kv) { return kv.first.job_id == job && kv.first.step == step; });
}

void ParityBuilder::EvictVersion(const std::string& job, uint64_t step) {
  {
    CheckedLock lock(&mu_);
    evicted_[{job, step}] = clock_->MonotonicNow();
    if (evicted_.size() > kFailureMemory) {
      auto oldest = std::min_element(evicted_.begin(), evicted_.end(),
                                     [](const auto& a, const auto& b) { return a.second < b.second; });
      evicted_.erase(oldest);
    }
  }
  DropVersion(job, step);
}

int ParityBuilder::Expire() {
  CheckedLock lock(&mu_);
  const absl::Time now = clock_->MonotonicNow();
  std::erase_if(evicted_, [&](const auto& kv) { return now - kv.second > expire_after_; });
  int n = 0;
  for (auto it = builds_.begin(); it != builds_.end();) {
    auto next = std::next(it);
    if (!it->second.finishing && now - it->second.last_activity > expire_after_) {
      failures_[it->first] = absl::DeadlineExceededError(
          absl::StrCat("parity ", SegmentIdString(it->first), " made no progress for ",
                       absl::FormatDuration(expire_after_)));
      DropLocked(it, "no progress");
      ++n;
    }
    it = next;
  }
  if (failures_.size() > kFailureMemory) failures_.erase(failures_.begin());
  return n;
}

size_t ParityBuilder::size() const {
  CheckedLock lock(&mu_);
  return builds_.size();
}

}  // namespace ckpt::agent
