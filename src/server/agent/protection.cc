#include "server/agent/protection.h"

#include <atomic>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/crc32c.h"
#include "common/lock_check.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace ckpt::agent {
namespace {

absl::Status NoDataPlane() { return absl::UnavailableError("this agent has no data plane"); }

}  // namespace

Protector::Protector(Deps deps) : d_(std::move(deps)) {}

void Protector::SettleLocked(absl::Time now) {
  if (pause_until_ == absl::InfinitePast() || now < pause_until_) return;
  d_.metrics->protection_paused_seconds->Increment(absl::ToDoubleSeconds(pause_until_ - pause_start_));
  d_.metrics->protection_paused->Set(0);
  pause_start_ = pause_until_ = absl::InfinitePast();
}

absl::Duration Protector::Pause(absl::Duration d) {
  const absl::Time now = d_.clock->MonotonicNow();
  CheckedLock lock(&pause_mu_);
  SettleLocked(now);
  if (d <= absl::ZeroDuration()) {  // resume: account what ran of the pause
    if (pause_until_ != absl::InfinitePast()) pause_until_ = now;
    SettleLocked(now);
    return absl::ZeroDuration();
  }
  if (pause_until_ == absl::InfinitePast()) {
    pause_start_ = now;
    d_.metrics->protection_paused->Set(1);
  }
  pause_until_ = std::max(pause_until_, now + d);
  return pause_until_ - now;
}

bool Protector::Paused() {
  CheckedLock lock(&pause_mu_);
  SettleLocked(d_.clock->MonotonicNow());
  return pause_until_ != absl::InfinitePast();
}

absl::Status Protector::Replicate(QueuedTask& qt, bool* finished) {
  const AgentTask& t = qt.task;
  if (!d_.data_plane) return NoDataPlane();
  if (Paused()) {  // a trainer's collectives first; come back later
    *finished = false;
    return absl::OkStatus();
  }
  // Never send bytes the verifier has not checked yet; come back later.
  for (uint32_t rank : t.ranks) {
    const ShardId id{t.job_id, t.step, rank};
    if (d_.holdings->HoldsValid(id) && !d_.holdings->Verified(id)) {
      *finished = false;
      return absl::OkStatus();
    }
  }
  std::vector<std::string> failures;
  for (uint32_t rank : t.ranks) {
    const ShardId id{t.job_id, t.step, rank};
    absl::StatusOr<Pin> pin = d_.holdings->PinValid(id);
    if (!pin.ok()) {
      failures.push_back(std::string(pin.status().message()));
      continue;
    }
    const ShardRecord& rec = *pin->rec;
    ShardRecord wire = rec;
    wire.extents.clear();
    wire.durable_path.clear();
    wire.file.clear();
    PutBegin b;
    b.kind = PutKind::kReplica;
    b.task_id = t.id;
    b.job_id = t.job_id;
    b.step = t.step;
    b.rank = rank;
    b.total_bytes = rec.size_bytes;
    b.crc32c = rec.crc32c;
    const absl::Time t0 = d_.clock->MonotonicNow();
    const std::vector<absl::Status> res =
        d_.peers->Push(t.targets, b, EncodeShardRecord(wire), pin->bytes->Pieces(0, rec.size_bytes));
    log::Debug("pushed {} ({} bytes) to {} nodes in {} ms", ShardIdString(id), rec.size_bytes, t.targets.size(),
               absl::ToInt64Milliseconds(d_.clock->MonotonicNow() - t0));
    for (size_t i = 0; i < res.size(); ++i) {
      if (res[i].ok()) {
        qt.bytes_done += rec.size_bytes;
      } else {
        failures.push_back(absl::StrCat("rank ", rank, " to node \"", t.targets[i].node_id, "\": ", res[i].message()));
      }
    }
  }
  if (!failures.empty()) {
    d_.metrics->peer_errors->Increment();
    return absl::UnavailableError(absl::StrJoin(failures, "; "));
  }
  return absl::OkStatus();
}

absl::Status Protector::PushDataSegments(QueuedTask& qt, bool* finished) {
  const AgentTask& t = qt.task;
  const EcGroupLayout& g = t.group;
  const uint32_t k = g.data_k;
  const uint32_t m = g.parity_m;
  std::map<std::string, const NodeBlob*> blobs;
  for (const NodeBlob& b : t.blobs) blobs[b.node_id] = &b;
  std::map<std::string, PeerEndpoint> members;
  for (const PeerEndpoint& e : t.members) members[e.node_id] = e;
  auto seg_len = [&](const std::string& node, uint32_t idx) -> uint64_t {
    auto it = blobs.find(node);
    return it == blobs.end() ? 0 : BlobLayout{it->second->size_bytes, k}.SegmentLength(idx);
  };
  absl::StatusOr<BlobPin> blob = d_.holdings->PinBlob(t.job_id, t.step);
  if (absl::IsFailedPrecondition(blob.status())) {
    *finished = false;  // wait for the verifier
    return absl::OkStatus();
  }
  CKPT_RETURN_IF_ERROR(blob.status());
  const NodeBlob* mine = blobs.count(d_.node_id) ? blobs[d_.node_id] : nullptr;
  if ((mine == nullptr ? 0 : mine->size_bytes) != blob->size_bytes) {
    return absl::FailedPreconditionError(absl::StrCat("this node's blob is ", blob->size_bytes,
                                                      " bytes, the layout says ",
                                                      mine == nullptr ? 0 : mine->size_bytes));
  }
  const BlobLayout layout{blob->size_bytes, k};
  // Each stripe carrying one of this node's segments is pushed to its
  // parity holders in one fan-out; the stripes go out concurrently.
  absl::Mutex fail_mu;
  std::vector<std::string> failures;
  std::atomic<uint64_t> sent{0};
  std::vector<std::function<void()>> pushes;
  for (const EcStripeLayout& s : g.stripes) {
    for (uint32_t d = 0; d < k && d < s.data_node_ids.size() && d < s.data_segment_indices.size(); ++d) {
      if (s.data_node_ids[d] != d_.node_id) continue;
      if (seg_len(d_.node_id, s.data_segment_indices[d]) == 0) continue;  // meta knows it is empty
      pushes.push_back([&, d, sp = &s] {
        const EcStripeLayout& st = *sp;
        uint64_t stripe_bytes = 0;
        uint64_t mask = 0;
        for (uint32_t e = 0; e < k && e < st.data_node_ids.size() && e < st.data_segment_indices.size(); ++e) {
          const uint64_t l = seg_len(st.data_node_ids[e], st.data_segment_indices[e]);
          stripe_bytes = std::max(stripe_bytes, l);
          if (l > 0) mask |= uint64_t{1} << e;
        }
        const uint32_t idx = st.data_segment_indices[d];
        const uint64_t len = layout.SegmentLength(idx);
        const SegmentId sid{t.job_id, t.step, g.group_index, st.stripe_index, d};
        const transport::ConstPieces seg = transport::SlicePieces(blob->pieces, layout.SegmentStart(idx), len);
        const uint32_t crc = Crc32cOfPieces(seg);
        std::vector<PeerEndpoint> targets;
        std::vector<uint32_t> positions;
        for (uint32_t p = 0; p < st.parity_node_ids.size(); ++p) {
          auto e = members.find(st.parity_node_ids[p]);
          if (e == members.end()) {
            CheckedLock lock(&fail_mu);
            failures.push_back(absl::StrCat("parity node \"", st.parity_node_ids[p], "\" has no endpoint"));
            continue;
          }
          targets.push_back(e->second);
          positions.push_back(k + p);
        }
        PutBegin b;
        b.kind = PutKind::kEcData;
        b.task_id = t.id;
        b.job_id = t.job_id;
        b.step = t.step;
        b.total_bytes = len;
        b.crc32c = crc;
        b.group = g.group_index;
        b.stripe = st.stripe_index;
        b.data_position = d;
        b.data_k = k;
        b.parity_m = m;
        b.stripe_bytes = stripe_bytes;
        b.expect_mask = mask;
        const std::vector<absl::Status> r =
            d_.peers->Push(targets, b, "", seg, [&](size_t i, PutBegin& pb) { pb.parity_position = positions[i]; });
        for (size_t i = 0; i < r.size(); ++i) {
          if (r[i].ok()) {
            sent += len;
            continue;
          }
          CheckedLock lock(&fail_mu);
          failures.push_back(
              absl::StrCat("stripe ", st.stripe_index, " to node \"", targets[i].node_id, "\": ", r[i].message()));
        }
        d_.holdings->SetOwned(sid, OwnedSegment{len, crc, k, idx});
        HoldingReport rep;
        rep.kind = HoldingReport::Kind::kSegment;
        rep.segment = sid;
        rep.segment_kind = SegmentKind::kData;
        rep.copy_state = CopyState::kValid;
        rep.size_bytes = len;
        rep.crc32c = crc;
        rep.task_id = t.id;
        d_.report(std::move(rep));
      });
    }
  }
  d_.stripes->RunAll(std::move(pushes));
  qt.bytes_done += sent.load();
  if (!failures.empty()) {
    d_.metrics->peer_errors->Increment();
    return absl::UnavailableError(absl::StrJoin(failures, "; "));
  }
  return absl::OkStatus();
}

absl::Status Protector::EcEncode(QueuedTask& qt, bool* finished) {
  const AgentTask& t = qt.task;
  const EcGroupLayout& g = t.group;
  const uint32_t k = g.data_k;
  if (!d_.data_plane) return NoDataPlane();
  if (!ec::ValidateShape(k, g.parity_m).ok()) return absl::InvalidArgumentError("bad EC group in task");
  if (!qt.sends_done && Paused()) {
    *finished = false;
    return absl::OkStatus();
  }
  if (!qt.sends_done) {
    // A failed push fails this task (meta retries it), but the parities
    // this node is building stay: other nodes' data segments already folded
    // into them are not sent again (their pushes succeeded). They end when
    // complete, when they make no progress for a while (ParityBuilder::
    // Expire), or when the version is evicted or the task cancelled.
    absl::Status s = PushDataSegments(qt, finished);
    if (!s.ok()) return s;
    if (!*finished) return absl::OkStatus();
    qt.sends_done = true;
    qt.deadline = d_.clock->MonotonicNow() + absl::Milliseconds(d_.peer_timeout_ms) * 4;
  }
  // Then wait (without blocking the task loop) for this node's parity.
  std::map<std::string, uint64_t> blob_sizes;
  for (const NodeBlob& b : t.blobs) blob_sizes[b.node_id] = b.size_bytes;
  std::vector<std::string> waiting;
  for (const EcStripeLayout& s : g.stripes) {
    for (uint32_t p = 0; p < s.parity_node_ids.size(); ++p) {
      if (s.parity_node_ids[p] != d_.node_id) continue;
      uint64_t stripe_bytes = 0;
      for (uint32_t d = 0; d < k && d < s.data_node_ids.size() && d < s.data_segment_indices.size(); ++d) {
        stripe_bytes = std::max(stripe_bytes,
                                BlobLayout{blob_sizes[s.data_node_ids[d]], k}.SegmentLength(s.data_segment_indices[d]));
      }
      if (stripe_bytes == 0) continue;
      const SegmentId sid{t.job_id, t.step, g.group_index, s.stripe_index, k + p};
      if (d_.holdings->HasValidSegment(sid)) continue;
      if (absl::Status e = d_.parity->TakeFailure(sid); !e.ok()) return e;  // (that build is gone)
      waiting.push_back(SegmentIdString(sid));
    }
  }
  if (waiting.empty()) return absl::OkStatus();
  if (d_.clock->MonotonicNow() > qt.deadline) {
    return absl::DeadlineExceededError(absl::StrCat("parity never completed: ", absl::StrJoin(waiting, ", ")));
  }
  *finished = false;
  return absl::OkStatus();
}

absl::Status Protector::RebuildSegments(QueuedTask& qt) {
  const AgentTask& t = qt.task;
  if (!d_.data_plane) return NoDataPlane();
  std::vector<std::string> failures;
  for (const SegmentRebuild& r : t.rebuilds) {
    if (d_.holdings->HasValidSegment(r.target)) continue;
    absl::StatusOr<ReservationPtr> bytes = d_.arena->Reserve(std::max<uint64_t>(r.length_bytes, 1));
    if (!bytes.ok()) {
      failures.push_back(absl::StrCat(SegmentIdString(r.target), ": ", d_.budget_message(r.length_bytes)));
      continue;
    }
    absl::Status s = d_.reconstructor->Rebuild(r.sources, t.data_k, t.parity_m, r.stripe_length_bytes,
                                               r.target.position, 0, 0, (*bytes)->MutablePieces(0, r.length_bytes));
    const uint32_t crc = s.ok() ? (*bytes)->Crc(0, r.length_bytes) : 0;
    if (s.ok() && r.expected_crc32c && crc != *r.expected_crc32c) {
      s = absl::DataLossError(absl::StrFormat("rebuilt %s has crc32c 0x%08x, expected 0x%08x",
                                              SegmentIdString(r.target), crc, *r.expected_crc32c));
    }
    if (s.ok()) {
      ShardRecord rec;
      rec.id = ShardId{t.job_id, t.step, 0};
      rec.segment = r.target;
      rec.segment_kind = r.kind;
      rec.size_bytes = r.length_bytes;
      rec.crc32c = crc;
      rec.staged_unix_ms = d_.clock->NowUnixMillis();
      s = d_.holdings->AddSegment(std::move(rec), *std::move(bytes), t.id);
    }
    if (s.ok()) {
      qt.bytes_done += r.length_bytes;
      d_.metrics->segments_rebuilt->Increment();
      log::Info("rebuilt segment {} ({} bytes)", SegmentIdString(r.target), r.length_bytes);
    } else {
      failures.push_back(absl::StrCat(SegmentIdString(r.target), ": ", s.message()));
    }
  }
  if (!failures.empty()) return absl::UnavailableError(absl::StrJoin(failures, "; "));
  return absl::OkStatus();
}

}  // namespace ckpt::agent
