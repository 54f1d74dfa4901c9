#include "server/agent/restorer.h"

#include <algorithm>
#include <span>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/crc32c.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt::agent {
namespace {

constexpr uint64_t kReadChunkBytes = 8 << 20;

bool Decides(const absl::StatusOr<OpenResult>& local) {
  // A VALID local copy decides; so does an error of the agent's own. A copy
  // that is not held, or is quarantined (now or by this check), falls
  // through: the source's copy replaces it (HoldingTable::Add).
  return local.ok() || !(absl::IsNotFound(local.status()) || absl::IsDataLoss(local.status()));
}

}  // namespace

const char* SourceKindName(ShardSource::Kind kind) {
  switch (kind) {
    case ShardSource::Kind::kLocal:
      return "SOURCE_KIND_LOCAL";
    case ShardSource::Kind::kReplica:
      return "SOURCE_KIND_REPLICA";
    case ShardSource::Kind::kEcDecode:
      return "SOURCE_KIND_EC_DECODE";
    case ShardSource::Kind::kDurable:
      return "SOURCE_KIND_DURABLE";
  }
  return "SOURCE_KIND_UNKNOWN";
}

Restorer::Restorer(Deps deps) : d_(std::move(deps)) {}

absl::StatusOr<OpenResult> Restorer::OpenLocal(const ShardId& id, bool skip_verify, const ClientRef& client,
                                               int64_t ttl_ms, uint64_t verify_at_most_bytes) {
  CKPT_ASSIGN_OR_RETURN(Pin pin, d_.holdings->PinValid(id));
  if (!skip_verify && verify_at_most_bytes != 0 && pin.rec->size_bytes > verify_at_most_bytes) {
    return absl::UnavailableError(absl::StrCat("the local copy of ", ShardIdString(id), " (", pin.rec->size_bytes,
                                               " bytes) is verified only over OpenShard (at most ",
                                               verify_at_most_bytes, " bytes here)"));
  }
  bool verified = false;
  if (!skip_verify) {
    std::string bad;
    if (absl::Status s = CheckShardBytes(*pin.rec, *pin.bytes, nullptr, &bad); !s.ok()) {
      d_.holdings->Quarantine(pin, std::string(s.message()));
      return s;
    }
    d_.holdings->MarkVerified(pin);
    verified = true;
  }
  // A session's handles live as long as the session; others by ttl.
  const absl::Duration ttl = !client.session_id.empty() ? absl::InfiniteDuration()
                                                        : absl::Milliseconds(ttl_ms > 0 ? ttl_ms : d_.default_handle_ttl_ms);
  OpenResult out;
  out.shard.record = pin.rec;
  out.shard.regions = RegionsOf(d_.arena->pool_path(), pin.rec->extents, pin.rec->size_bytes);
  out.verified = verified;
  out.expires_in_ms = ttl == absl::InfiniteDuration() ? 0 : absl::ToInt64Milliseconds(ttl);
  out.handle_id = d_.leases->OpenHandle(id, std::move(pin), client, ttl);
  return out;
}

absl::StatusOr<OpenOutcome> Restorer::Open(const OpenRequest& req) {
  OpenOutcome out;
  absl::StatusOr<OpenResult> r = OpenLocal(req.id, req.skip_verify, req.client, req.ttl_ms, req.verify_at_most_bytes);
  const absl::Status local = r.status();
  if (!r.ok() && (absl::IsNotFound(local) || absl::IsDataLoss(local))) {
    for (size_t i = 0; i < req.sources.size(); ++i) {
      const ShardSource& src = req.sources[i];
      if (src.kind == ShardSource::Kind::kLocal) continue;
      if (!req.expected || req.expected->size_bytes == 0) {
        return absl::InvalidArgumentError(
            "expected (the shard's size, crc32c and items from Locate) is required with sources");
      }
      ShardRecord expected = *req.expected;
      expected.id = req.id;
      switch (src.kind) {
        case ShardSource::Kind::kReplica:
          r = FromPeer(expected, src.holder, req.client, req.ttl_ms);
          break;
        case ShardSource::Kind::kEcDecode:
          r = ByDecode(expected, src.ec, req.client, req.ttl_ms);
          break;
        case ShardSource::Kind::kDurable:
          r = FromDurable(expected, src.durable_path, req.client, req.ttl_ms);
          break;
        default:
          r = absl::InvalidArgumentError("unknown source kind");
      }
      if (r.ok()) {
        out.served_by = i;
        break;
      }
      out.failed.push_back(SourceAttempt{i, r.status()});
    }
    if (!r.ok()) {
      std::string why(local.message());
      for (const SourceAttempt& a : out.failed) {
        absl::StrAppend(&why, "; source ", SourceKindName(req.sources[a.index].kind), ": ", a.status.message());
      }
      return absl::Status(out.failed.empty() ? local.code() : absl::StatusCode::kDataLoss, why);
    }
  }
  CKPT_RETURN_IF_ERROR(r.status());
  if (req.expected && req.expected->size_bytes != 0 &&
      (req.expected->size_bytes != r->shard.record->size_bytes || req.expected->crc32c != r->shard.record->crc32c)) {
    d_.leases->CloseHandle(r->handle_id);
    return absl::DataLossError(absl::StrCat("the local copy of ", ShardIdString(req.id),
                                            " differs from the expected shard (size/crc32c)"));
  }
  out.result = *std::move(r);
  return out;
}

absl::StatusOr<ReservationPtr> Restorer::ReserveFor(const ShardRecord& expected) {
  CKPT_RETURN_IF_ERROR(ValidateManifest(expected.items, expected.size_bytes));
  absl::StatusOr<ReservationPtr> r = d_.arena->Reserve(expected.size_bytes);
  if (!r.ok()) return absl::ResourceExhaustedError(d_.budget_message(expected.size_bytes));
  return r;
}

absl::StatusOr<OpenResult> Restorer::Adopt(const ShardRecord& expected, ReservationPtr bytes,
                                           const std::string& durable_path, const std::string& source,
                                           const ClientRef& client, int64_t ttl_ms) {
  ShardRecord rec = expected;
  rec.role = CopyRole::kRestored;
  SetItems(rec, SortedByOffset(expected.items));
  rec.durable_path = durable_path;
  rec.segment.reset();
  rec.staged_unix_ms = d_.clock->NowUnixMillis();
  absl::Status s = d_.holdings->Add(rec, std::move(bytes), /*verified=*/true, /*if_absent=*/true);
  if (!s.ok() && !absl::IsAlreadyExists(s)) return s;
  // Pinned (the handle) before meta hears of the copy: meta may have it
  // dropped at once (a version beyond keep_in_memory, restored from disk),
  // which must not pull it from under this open.
  absl::StatusOr<OpenResult> opened = OpenLocal(rec.id, /*skip_verify=*/true, client, ttl_ms);
  if (s.ok()) {
    HoldingReport r;
    r.kind = HoldingReport::Kind::kCopyState;
    r.id = rec.id;
    r.copy_role = CopyRole::kRestored;
    r.copy_state = CopyState::kValid;
    r.size_bytes = rec.size_bytes;
    r.crc32c = rec.crc32c;
    d_.session->Report(std::move(r));
    log::Info("restored {} ({} bytes) from {}", ShardIdString(rec.id), rec.size_bytes, source);
  }
  // (AlreadyExists: another restore of the same shard won meanwhile; this
  // opened that one.)
  return opened;
}

absl::StatusOr<OpenResult> Restorer::FromPeer(const ShardRecord& expected, const PeerEndpoint& holder,
                                              const ClientRef& client, int64_t ttl_ms) {
  if (absl::StatusOr<OpenResult> held = OpenLocal(expected.id, false, client, ttl_ms); Decides(held)) return held;
  if (d_.peers == nullptr) return absl::UnavailableError("this agent has no data plane");
  CKPT_ASSIGN_OR_RETURN(ReservationPtr bytes, ReserveFor(expected));
  ReadReq req;
  req.what = ReadWhat::kShard;
  req.job_id = expected.id.job_id;
  req.step = expected.id.step;
  req.rank = expected.id.rank;
  req.length = expected.size_bytes;
  // The read keeps `bytes` alive while payloads may still land in them, so a
  // failure below only drops our reference.
  absl::StatusOr<uint32_t> crc = d_.peers->Read(holder, req, bytes->MutablePieces(0, expected.size_bytes), bytes);
  if (crc.ok() && *crc != expected.crc32c) {
    crc = absl::DataLossError(absl::StrFormat("copy on node \"%s\" has crc32c 0x%08x, the shard 0x%08x",
                                              holder.node_id, *crc, expected.crc32c));
  }
  if (!crc.ok()) {
    d_.metrics->peer_errors->Increment();
    return crc.status();
  }
  d_.metrics->peer_restores->Increment();
  return Adopt(expected, std::move(bytes), "", absl::StrCat("node \"", holder.node_id, "\""), client, ttl_ms);
}

absl::StatusOr<OpenResult> Restorer::ByDecode(const ShardRecord& expected, const EcDecodeSource& src,
                                              const ClientRef& client, int64_t ttl_ms) {
  if (absl::StatusOr<OpenResult> held = OpenLocal(expected.id, false, client, ttl_ms); Decides(held)) return held;
  if (d_.peers == nullptr) return absl::UnavailableError("this agent has no data plane");
  CKPT_ASSIGN_OR_RETURN(ReservationPtr bytes, ReserveFor(expected));
  const uint64_t shard_start = src.blob_offset_bytes;
  const uint64_t shard_end = shard_start + expected.size_bytes;
  // Each stripe holding part of the shard is rebuilt into the shard's space
  // (read from the surviving data segment, else decoded); stripes run
  // concurrently. The reconstructor lands peer data in its own buffers, so a
  // failed stripe never leaves a transfer writing into `bytes`.
  std::vector<absl::Status> results(src.stripes.size());
  std::vector<std::function<void()>> work;
  for (size_t i = 0; i < src.stripes.size(); ++i) {
    work.push_back([&, i] {
      const EcStripeSource& s = src.stripes[i];
      const uint64_t seg_start = static_cast<uint64_t>(s.blob_segment_index) * src.segment_bytes;
      const uint64_t a = std::max(seg_start, shard_start);
      const uint64_t b = std::min(seg_start + src.segment_bytes, shard_end);
      if (a >= b) return;
      absl::Status st = d_.reconstructor->Rebuild(s.segments, src.data_k, src.parity_m, s.stripe_length_bytes,
                                                  s.position, s.blob_segment_index, a - seg_start,
                                                  bytes->MutablePieces(a - shard_start, b - a));
      if (!st.ok()) results[i] = absl::Status(st.code(), absl::StrCat("stripe ", s.stripe_index, ": ", st.message()));
    });
  }
  d_.stripes->RunAll(std::move(work));
  absl::Status st;
  for (const absl::Status& r : results) {
    if (!r.ok() && st.ok()) st = r;
  }
  if (st.ok()) {
    const uint32_t crc = bytes->Crc(0, expected.size_bytes);
    if (crc != expected.crc32c) {
      st = absl::DataLossError(
          absl::StrFormat("decoded shard has crc32c 0x%08x, the shard 0x%08x", crc, expected.crc32c));
    }
  }
  if (!st.ok()) {
    d_.metrics->peer_errors->Increment();
    return st;
  }
  d_.metrics->peer_restores->Increment();
  return Adopt(expected, std::move(bytes), "", absl::StrCat("EC stripes of node \"", src.owner_node_id, "\""),
               client, ttl_ms);
}

absl::StatusOr<OpenResult> Restorer::FromDurable(const ShardRecord& expected, const std::string& durable_path,
                                                 const ClientRef& client, int64_t ttl_ms) {
  if (absl::StatusOr<OpenResult> held = OpenLocal(expected.id, false, client, ttl_ms); Decides(held)) return held;
  if (d_.durable_root.empty()) {
    return absl::UnavailableError("this agent has no durable tier (--durable-root is not set)");
  }
  CKPT_RETURN_IF_ERROR(ValidateManifest(expected.items, expected.size_bytes));
  std::vector<std::string> parts = absl::StrSplit(durable_path, '/');
  CKPT_ASSIGN_OR_RETURN(std::string path, JoinUnderRoot(d_.durable_root, std::span<const std::string>(parts)));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, d_.durable_fs->NewReadableFile(path));
  if (file->Size() != expected.size_bytes) {
    return absl::DataLossError(absl::StrCat("durable file '", path, "' is ", file->Size(), " bytes, the shard ",
                                            expected.size_bytes));
  }
  CKPT_ASSIGN_OR_RETURN(ReservationPtr bytes, ReserveFor(expected));
  uint32_t crc = 0;
  uint64_t file_off = 0;
  for (const auto& piece : bytes->MutablePieces(0, expected.size_bytes)) {
    for (uint64_t off = 0; off < piece.size(); off += kReadChunkBytes) {
      const uint64_t len = std::min<uint64_t>(kReadChunkBytes, piece.size() - off);
      CKPT_ASSIGN_OR_RETURN(size_t got, file->PositionedRead(file_off, piece.subspan(off, len)));
      if (got != len) return absl::DataLossError(absl::StrCat("durable file '", path, "' ended early"));
      crc = Crc32cExtend(crc, piece.data() + off, len);
      file_off += len;
    }
  }
  if (crc != expected.crc32c) {
    return absl::DataLossError(
        absl::StrFormat("durable file '%s': crc32c 0x%08x != shard 0x%08x", path, crc, expected.crc32c));
  }
  return Adopt(expected, std::move(bytes), durable_path, "the durable tier", client, ttl_ms);
}

}  // namespace ckpt::agent
