#include "server/agent/peer_server.h"

#include <algorithm>
#include <optional>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "common/lock_check.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt::agent {

using transport::ConstPieces;
using transport::Inbound;
using transport::MutablePieces;
using transport::PeerId;

namespace {

constexpr uint64_t kBeginSlot = UINT64_MAX;  // landing key of a begin's record payload
constexpr size_t kMaxRecordBytes = 64 << 20;  // a shard record (manifest) sent with a push
constexpr size_t kScratchPool = 8;
// How long a push or read from a sender missing from the membership waits for
// a fresher one (a node that registered since this agent's last heartbeat).
constexpr absl::Duration kMembershipWait = absl::Seconds(2);

// The id a push's begin or a read request starts with (its xfer, its request
// id), so that a header that does not decode is still answered with the
// reason rather than left to the sender's timeout; nullopt if even that is
// missing.
std::optional<uint64_t> LeadingId(std::string_view header) {
  WireReader r(header);
  const uint64_t id = r.U64();
  if (!r.ok()) return std::nullopt;
  return id;
}

}  // namespace

PeerServer::PeerServer(Deps deps, Options options)
    : d_(std::move(deps)),
      options_(std::move(options)),
      finish_("ckpt-agent-fin", options_.finish_threads, options_.max_queued),
      serve_("ckpt-agent-srv", options_.serve_threads, options_.max_queued) {}

PeerServer::~PeerServer() { Stop(); }

void PeerServer::Stop() {
  finish_.Stop();
  serve_.Stop();
}

size_t PeerServer::receiving() const {
  CheckedLock lock(&mu_);
  return in_puts_.size();
}

std::shared_ptr<std::vector<std::byte>> PeerServer::TakeScratch(uint64_t size) {
  std::shared_ptr<std::vector<std::byte>> buf;
  {
    CheckedLock lock(&mu_);
    if (!scratch_free_.empty()) {
      buf = std::move(scratch_free_.back());
      scratch_free_.pop_back();
    }
  }
  if (buf == nullptr) buf = std::make_shared<std::vector<std::byte>>();
  buf->resize(size);
  return buf;
}

void PeerServer::ReturnScratch(std::shared_ptr<std::vector<std::byte>> buf) {
  if (buf == nullptr || buf.use_count() != 1) return;
  CheckedLock lock(&mu_);
  if (scratch_free_.size() < kScratchPool) scratch_free_.push_back(std::move(buf));
}

// ---------------------------------------------------------------------------
// Transport thread

absl::StatusOr<MutablePieces> PeerServer::Allocate(const Inbound& msg) {
  switch (msg.type) {
    case kPutBegin: {
      CKPT_ASSIGN_OR_RETURN(PutBegin b, DecodePutBegin(msg.header));
      if (msg.payload_bytes > kMaxRecordBytes) {
        return absl::InvalidArgumentError(absl::StrCat("a push's record of ", msg.payload_bytes, " bytes is too large"));
      }
      auto buf = std::make_shared<std::vector<std::byte>>(msg.payload_bytes);
      CheckedLock lock(&mu_);
      auto [slot, added] = landings_.emplace(std::make_tuple(msg.from, b.xfer, kBeginSlot), Landing{nullptr, buf});
      if (!added) return absl::InvalidArgumentError("this push has begun already");
      return MutablePieces{std::span<std::byte>(buf->data(), buf->size())};
    }
    case kPutChunk: {
      CKPT_ASSIGN_OR_RETURN(Chunk c, DecodeChunk(msg.header));
      std::shared_ptr<std::vector<std::byte>> scratch;
      {
        CheckedLock lock(&mu_);
        auto it = in_puts_.find({msg.from, c.id});
        if (it == in_puts_.end() || it->second.finishing) {
          return absl::FailedPreconditionError(absl::StrCat("unknown push ", c.id));
        }
        InPut& in = it->second;
        if (c.offset > in.begin.total_bytes || msg.payload_bytes > in.begin.total_bytes - c.offset) {
          return absl::InvalidArgumentError("chunk beyond the end of the push");
        }
        const auto key = std::make_tuple(msg.from, c.id, c.offset);
        if (landings_.count(key) != 0) return absl::InvalidArgumentError("a chunk at this offset is already landing");
        if (in.begin.kind == PutKind::kReplica) {
          landings_.emplace(key, Landing{in.bytes, nullptr});
          return in.bytes->MutablePieces(c.offset, msg.payload_bytes);
        }
      }
      // EC data: into a scratch buffer, folded into the parity on arrival.
      scratch = TakeScratch(msg.payload_bytes);
      CheckedLock lock(&mu_);
      landings_.emplace(std::make_tuple(msg.from, c.id, c.offset), Landing{nullptr, scratch});
      return MutablePieces{std::span<std::byte>(scratch->data(), scratch->size())};
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat("message type ", msg.type, " carries no payload"));
  }
}

void PeerServer::OnReceived(const Inbound& msg, const absl::Status& status) {
  switch (msg.type) {
    case kPutBegin:
      return OnPutBegin(msg, status);
    case kPutChunk:
      return OnPutChunk(msg, status);
    case kPutAbort:
      return OnPutAbort(msg);
    case kReadReq:
      return OnReadReq(msg);
    default:
      return;
  }
}

absl::Status PeerServer::AdmitSender(PeerId from, const std::string& node_id, uint64_t incarnation) {
  absl::Status st = d_.plane->CheckSender(from, node_id);
  if (st.ok() && d_.membership == nullptr) return absl::OkStatus();
  if (st.ok()) st = d_.membership->Admit(node_id, incarnation, kMembershipWait);
  if (!st.ok()) {
    d_.metrics->peer_refused->Increment();
    log::Warn("data plane: refused a peer claiming to be {} incarnation {}: {}", node_id.empty() ? "(nobody)" : node_id,
              incarnation, std::string(st.message()));
  }
  return st;
}

absl::StatusOr<PeerServer::InPut> PeerServer::Check(PeerId from, const PutBegin& b, const std::string& record) {
  CKPT_RETURN_IF_ERROR(AdmitSender(from, b.sender_node_id, b.sender_incarnation));
  if (b.target_incarnation != 0 && b.target_incarnation != d_.incarnation()) {
    return absl::FailedPreconditionError(absl::StrCat("push is for incarnation ", b.target_incarnation,
                                                      ", this agent is ", d_.incarnation()));
  }
  CKPT_RETURN_IF_ERROR(ValidateJobId(b.job_id));
  InPut in;
  in.begin = b;
  if (b.kind == PutKind::kReplica) {
    CKPT_ASSIGN_OR_RETURN(ShardRecord rec, DecodeShardRecord(record));
    const ShardId id{b.job_id, b.step, b.rank};
    if (rec.id != id || rec.size_bytes != b.total_bytes || rec.crc32c != b.crc32c || rec.segment) {
      return absl::InvalidArgumentError("push header and shard record disagree");
    }
    CKPT_RETURN_IF_ERROR(ValidateManifest(rec.items, rec.size_bytes));
    if (absl::StatusOr<Pin> held = d_.holdings->PinValid(id); held.ok()) {
      if (held->rec->crc32c == b.crc32c) {
        return absl::AlreadyExistsError(absl::StrCat(ShardIdString(id), " is already held here"));
      }
      return absl::FailedPreconditionError(absl::StrCat("a different copy of ", ShardIdString(id), " is held here"));
    }
    absl::StatusOr<ReservationPtr> r = d_.arena->Reserve(b.total_bytes);
    if (!r.ok()) return absl::ResourceExhaustedError(d_.budget_message(b.total_bytes));
    in.bytes = *std::move(r);
    in.rec = std::move(rec);
    in.rec.role = CopyRole::kReplica;
    in.rec.durable_path.clear();
    return in;
  }
  if (b.kind == PutKind::kEcData) {
    if (b.data_k == 0 || b.data_k > 32 || b.parity_m == 0 || b.parity_m > 8 || b.data_position >= b.data_k ||
        b.parity_position < b.data_k || b.parity_position >= b.data_k + b.parity_m ||
        b.total_bytes > b.stripe_bytes || (b.expect_mask >> b.data_position & 1) == 0 ||
        b.stripe_bytes > d_.arena->capacity_bytes()) {
      return absl::InvalidArgumentError("malformed EC push");
    }
    // The parity is complete and held: this data segment is in it (a retried
    // encode pushes again what an earlier attempt delivered).
    if (d_.holdings->HasValidSegment(SegmentId{b.job_id, b.step, b.group, b.stripe, b.parity_position})) {
      return absl::AlreadyExistsError("this stripe's parity is complete here");
    }
    absl::Status s = d_.parity->BeginPush(b);
    if (absl::IsResourceExhausted(s)) return absl::ResourceExhaustedError(d_.budget_message(b.stripe_bytes));
    CKPT_RETURN_IF_ERROR(s);
    return in;
  }
  return absl::InvalidArgumentError("unsupported push kind");
}

void PeerServer::OnPutBegin(const Inbound& msg, const absl::Status& status) {
  absl::StatusOr<PutBegin> b = DecodePutBegin(msg.header);
  if (!b.ok()) {
    log::Warn("data plane: bad push from peer {}: {}", msg.from, b.status().ToString());
    if (const std::optional<uint64_t> xfer = LeadingId(msg.header)) {
      d_.plane->Send(msg.from, kPutAck,
                     EncodeResult(Result{*xfer, Annotate(b.status(), "this agent cannot read the push's header")}));
    }
    return;
  }
  const PushKey key{msg.from, b->xfer};
  std::shared_ptr<std::vector<std::byte>> record;
  bool duplicate = false;
  {
    CheckedLock lock(&mu_);
    auto slot = landings_.find(std::make_tuple(msg.from, b->xfer, kBeginSlot));
    if (slot != landings_.end()) {
      record = std::move(slot->second.scratch);
      landings_.erase(slot);
    }
    duplicate = in_puts_.count(key) != 0 || !admitting_.insert(key).second;
  }
  if (duplicate) {
    d_.plane->Send(msg.from, kPutAck,
                   EncodeResult(Result{b->xfer, absl::InvalidArgumentError("this push has begun already")}));
    return;
  }
  // Admission (parsing the record, reserving, zeroing a new parity) can take
  // a while on big shards and stripes: off the transport's thread.
  if (!finish_.TrySubmit([this, key, begin = *b, record, status] { Admit(key, begin, record, status); })) {
    {
      CheckedLock lock(&mu_);
      admitting_.erase(key);
    }
    d_.plane->Send(msg.from, kPutAck,
                   EncodeResult(Result{b->xfer, absl::ResourceExhaustedError("this agent is too busy; retry")}));
  }
}

void PeerServer::Admit(const PushKey& key, const PutBegin& b, std::shared_ptr<std::vector<std::byte>> record,
                       const absl::Status& status) {
  absl::StatusOr<InPut> in = absl::UnknownError("unset");
  if (!status.ok()) {
    in = status;
  } else {
    in = Check(key.first, b, record == nullptr ? std::string()
                                    : std::string(reinterpret_cast<const char*>(record->data()), record->size()));
  }
  if (in.ok()) {
    in->last_progress = d_.clock->MonotonicNow();
    in->finishing = b.total_bytes == 0;
  }
  {
    CheckedLock lock(&mu_);
    admitting_.erase(key);
    if (in.ok()) {
      in_puts_.emplace(key, *std::move(in));
      d_.metrics->pushes_receiving->Set(static_cast<double>(in_puts_.size()));
    }
  }
  if (!in.ok()) {
    d_.plane->Send(key.first, kPutAck, EncodeResult(Result{b.xfer, in.status()}));
    return;
  }
  d_.plane->Send(key.first, kPutAck, EncodeResult(Result{b.xfer, absl::OkStatus()}));
  if (b.total_bytes == 0) FinishPut(key.first, key.second);
}

void PeerServer::OnPutChunk(const Inbound& msg, const absl::Status& status) {
  absl::StatusOr<Chunk> c = DecodeChunk(msg.header);
  if (!c.ok()) return;
  const PushKey key{msg.from, c->id};
  Landing landed;
  PutBegin begin;
  ReservationPtr bytes;
  absl::Status fail = status;
  {
    CheckedLock lock(&mu_);
    bool had_landing = false;
    auto slot = landings_.find(std::make_tuple(msg.from, c->id, c->offset));
    if (slot != landings_.end()) {
      landed = std::move(slot->second);
      landings_.erase(slot);
      had_landing = true;
    }
    auto it = in_puts_.find(key);
    if (it == in_puts_.end() || it->second.finishing) return;  // dropped meanwhile
    if (!had_landing && msg.payload_bytes > 0 && fail.ok()) fail = absl::InternalError("chunk landed nowhere");
    begin = it->second.begin;
    bytes = it->second.bytes;
  }
  uint32_t crc = 0;
  if (fail.ok()) {
    if (begin.kind == PutKind::kReplica) {
      crc = bytes->Crc(c->offset, msg.payload_bytes);
    } else if (landed.scratch != nullptr) {
      crc = Crc32c(landed.scratch->data(), landed.scratch->size());
    }
    if (crc != c->crc32c) {
      fail = absl::DataLossError(absl::StrFormat("chunk at offset %d arrived with crc32c 0x%08x, sent 0x%08x",
                                                 c->offset, crc, c->crc32c));
    }
  }
  if (fail.ok() && begin.kind == PutKind::kEcData && landed.scratch != nullptr) {
    fail = d_.parity->Fold(begin, c->offset, std::span<const std::byte>(*landed.scratch));
  }
  ReturnScratch(std::move(landed.scratch));
  if (!fail.ok()) {
    log::Warn("data plane: push {} from peer {} failed: {}", c->id, msg.from, fail.ToString());
    DropPush(key, fail);
    d_.plane->Send(msg.from, kPutDone, EncodeResult(Result{c->id, fail}));
    return;
  }
  bool complete = false;
  {
    CheckedLock lock(&mu_);
    auto it = in_puts_.find(key);
    if (it == in_puts_.end()) return;
    InPut& in = it->second;
    in.chunks[c->offset] = {crc, msg.payload_bytes};
    in.received += msg.payload_bytes;
    in.last_progress = d_.clock->MonotonicNow();
    if (in.received >= in.begin.total_bytes && !in.finishing) {
      in.finishing = true;
      complete = true;
    }
  }
  d_.metrics->peer_received_bytes->Increment(static_cast<double>(msg.payload_bytes));
  if (complete) {
    if (!finish_.TrySubmit([this, key] { FinishPut(key.first, key.second); })) {
      const absl::Status busy = absl::ResourceExhaustedError("this agent is too busy to store pushes; retry");
      DropPush(key, busy);
      d_.plane->Send(msg.from, kPutDone, EncodeResult(Result{c->id, busy}));
    }
  }
}

void PeerServer::DropPush(const PushKey& key, const absl::Status& why) {
  std::optional<InPut> dropped;
  {
    CheckedLock lock(&mu_);
    auto it = in_puts_.find(key);
    if (it == in_puts_.end()) return;
    dropped = std::move(it->second);
    in_puts_.erase(it);
    d_.metrics->pushes_receiving->Set(static_cast<double>(in_puts_.size()));
  }
  if (dropped->begin.kind == PutKind::kEcData) d_.parity->PushFailed(dropped->begin, why);
  // dropped->bytes goes now, or with the last landing still in flight.
}

void PeerServer::OnPutAbort(const Inbound& msg) {
  absl::StatusOr<Result> r = DecodeResult(msg.header);
  if (!r.ok()) return;
  {
    CheckedLock lock(&mu_);
    auto it = in_puts_.find({msg.from, r->id});
    if (it == in_puts_.end() || it->second.finishing) return;
    log::Warn("data plane: peer {} abandoned push {} ({} of {} bytes): {}", msg.from, r->id, it->second.received,
              it->second.begin.total_bytes, r->status.ToString());
  }
  DropPush({msg.from, r->id}, r->status.ok() ? absl::AbortedError("the sender gave up") : r->status);
}

void PeerServer::OnPeerFailed(PeerId peer, const absl::Status& why) {
  std::vector<PushKey> gone;
  {
    CheckedLock lock(&mu_);
    for (const auto& [key, in] : in_puts_) {
      if (key.first == peer && !in.finishing) gone.push_back(key);
    }
  }
  const absl::Status lost = absl::UnavailableError(absl::StrCat("peer connection lost: ", why.message()));
  for (const PushKey& key : gone) {
    log::Warn("data plane: push {} from a failed peer abandoned", key.second);
    DropPush(key, lost);
  }
}

int PeerServer::Expire() {
  std::vector<PushKey> stale;
  {
    CheckedLock lock(&mu_);
    const absl::Time now = d_.clock->MonotonicNow();
    for (const auto& [key, in] : in_puts_) {
      if (!in.finishing && now - in.last_progress > absl::Milliseconds(options_.peer_timeout_ms)) {
        stale.push_back(key);
      }
    }
  }
  for (const PushKey& key : stale) {
    const absl::Status why = absl::DeadlineExceededError(
        absl::StrCat("no data for ", options_.peer_timeout_ms, " ms; the receiver dropped the push"));
    log::Warn("data plane: push {} from peer {} dropped: {}", key.second, key.first, why.ToString());
    DropPush(key, why);
    d_.metrics->pushes_expired->Increment();
    d_.plane->Send(key.first, kPutDone, EncodeResult(Result{key.second, why}));
  }
  return static_cast<int>(stale.size());
}

// ---------------------------------------------------------------------------
// Finish executor

void PeerServer::FinishPut(PeerId from, uint64_t xfer) {
  std::optional<InPut> taken;
  {
    CheckedLock lock(&mu_);
    auto it = in_puts_.find({from, xfer});
    if (it == in_puts_.end()) return;
    taken = std::move(it->second);
    in_puts_.erase(it);
    d_.metrics->pushes_receiving->Set(static_cast<double>(in_puts_.size()));
  }
  InPut& in = *taken;
  absl::StatusOr<uint32_t> crc = Crc32cOfChunks(in.chunks, in.begin.total_bytes);
  if (crc.ok() && *crc != in.begin.crc32c) {
    crc = absl::DataLossError(
        absl::StrFormat("received bytes have crc32c 0x%08x, expected 0x%08x", *crc, in.begin.crc32c));
  }
  auto ack = [plane = d_.plane, from, xfer](const absl::Status& s) {
    plane->Send(from, kPutDone, EncodeResult(Result{xfer, s}));
  };
  if (in.begin.kind == PutKind::kEcData) {
    absl::Status s = crc.status();
    if (s.ok()) {
      s = d_.parity->PushComplete(in.begin);
    } else {
      d_.parity->PushFailed(in.begin, s);
    }
    ack(s);
    return;
  }
  if (!crc.ok()) {
    ack(crc.status());
    return;
  }
  const ShardId id = in.rec.id;
  const uint64_t size = in.rec.size_bytes;
  const uint32_t rec_crc = in.rec.crc32c;
  in.rec.staged_unix_ms = d_.clock->NowUnixMillis();
  absl::Status s = d_.holdings->Add(std::move(in.rec), std::move(in.bytes), /*verified=*/true, /*if_absent=*/true);
  if (absl::IsAlreadyExists(s)) {
    ack(absl::OkStatus());  // arrived twice (a re-sent task): the first copy stays
    return;
  }
  if (!s.ok()) {
    ack(s);
    return;
  }
  d_.metrics->replicas_stored->Increment();
  log::Info("stored replica of {} ({} bytes) from peer {}", ShardIdString(id), size, from);
  // Report before acknowledging, so meta sees the copy before the sender's
  // task result (otherwise it would plan the copy again).
  HoldingReport r;
  r.kind = HoldingReport::Kind::kCopyState;
  r.id = id;
  r.copy_role = CopyRole::kReplica;
  r.copy_state = CopyState::kValid;
  r.size_bytes = size;
  r.crc32c = rec_crc;
  r.task_id = in.begin.task_id;
  d_.session->Report(std::move(r), [ack](const absl::Status&) { ack(absl::OkStatus()); });
}

// ---------------------------------------------------------------------------
// Serving reads

void PeerServer::OnReadReq(const Inbound& msg) {
  absl::StatusOr<ReadReq> req = DecodeReadReq(msg.header);
  if (!req.ok()) {
    log::Warn("data plane: bad read request from peer {}: {}", msg.from, req.status().ToString());
    if (const std::optional<uint64_t> id = LeadingId(msg.header)) {
      d_.plane->Send(msg.from, kReadEnd,
                     EncodeResult(Result{*id, Annotate(req.status(), "this agent cannot read the request's header"),
                                         0, 0}));
    }
    return;
  }
  const PeerId from = msg.from;
  const uint64_t id = req->id;
  if (!serve_.TrySubmit([this, from, rq = *std::move(req)]() mutable { ServeRead(from, std::move(rq)); })) {
    d_.plane->Send(from, kReadEnd,
                   EncodeResult(Result{id, absl::ResourceExhaustedError("too many reads in progress; retry"), 0, 0}));
  }
}

void PeerServer::ServeRead(PeerId from, ReadReq req) {
  ConstPieces source;
  std::vector<Pin> pins;  // keep the bytes until the send is done
  std::optional<uint32_t> whole_crc;
  std::optional<Pin> whole_segment;
  absl::Status st;
  uint64_t total = 0;
  if (absl::Status who = AdmitSender(from, req.sender_node_id, req.sender_incarnation); !who.ok()) {
    st = who;
  } else if (req.target_incarnation != 0 && req.target_incarnation != d_.incarnation()) {
    st = absl::FailedPreconditionError(absl::StrCat("read is for incarnation ", req.target_incarnation,
                                                    ", this agent is ", d_.incarnation()));
  } else if (req.what == ReadWhat::kShard) {
    absl::StatusOr<Pin> pin = d_.holdings->PinValid(ShardId{req.job_id, req.step, req.rank});
    if (!pin.ok()) {
      st = pin.status();
    } else {
      total = pin->rec->size_bytes;
      if (req.offset <= total) {
        source = pin->bytes->Pieces(req.offset, std::min(req.length, total - req.offset));
      }
      if (req.offset == 0 && req.length == total) {
        whole_crc = pin->rec->crc32c;
      } else if (!d_.holdings->Verified(pin->rec->id)) {
        // Part of the copy: its crc32c says nothing of the part, so the
        // whole copy is checked against the shard's first (once: the mark
        // stays until the copy changes), and the part sent is what was saved.
        std::string bad;
        if (absl::Status s = CheckShardBytes(*pin->rec, *pin->bytes, nullptr, &bad); !s.ok()) {
          d_.holdings->Quarantine(*pin, std::string(s.message()));
          st = absl::DataLossError(absl::StrCat("node \"", options_.node_id, "\": ", s.message()));
        } else {
          d_.holdings->MarkVerified(*pin);
        }
      }
      pins.push_back(*std::move(pin));
    }
  } else {
    const SegmentId sid{req.job_id, req.step, req.group, req.stripe, req.position};
    const std::optional<OwnedSegment> own = d_.holdings->Owned(sid);
    if (absl::StatusOr<Pin> seg = d_.holdings->PinSegment(sid); seg.ok()) {
      total = seg->rec->size_bytes;
      if (req.offset <= total) source = seg->bytes->Pieces(req.offset, std::min(req.length, total - req.offset));
      if (req.offset == 0 && req.length == total) {
        whole_crc = seg->rec->crc32c;
        whole_segment = *seg;
      }
      pins.push_back(*std::move(seg));
    } else if (own || (req.position < req.data_k && req.data_k > 0)) {
      if (own) {
        req.data_k = own->data_k;
        req.blob_segment_index = own->blob_segment_index;
      }
      absl::StatusOr<BlobPin> blob = d_.holdings->PinBlob(req.job_id, req.step);
      if (!blob.ok()) {
        st = blob.status();
      } else if (blob->size_bytes == 0) {
        st = absl::NotFoundError(absl::StrCat("no blob of ", req.job_id, "/", req.step, " here"));
      } else {
        const BlobLayout layout{blob->size_bytes, req.data_k};
        total = layout.SegmentLength(req.blob_segment_index);
        if (req.offset <= total) {
          source = transport::SlicePieces(blob->pieces, layout.SegmentStart(req.blob_segment_index) + req.offset,
                                          std::min(req.length, total - req.offset));
        }
        if (own && req.offset == 0 && req.length == total) whole_crc = own->crc32c;
        pins = std::move(blob->shards);
      }
    } else {
      st = absl::NotFoundError(absl::StrCat("segment ", SegmentIdString(sid), " is not held here"));
    }
  }
  if (st.ok() && (req.offset > total || req.length > total - req.offset)) {
    st = absl::OutOfRangeError(absl::StrCat("read [", req.offset, ", +", req.length, ") beyond ", total, " bytes"));
  }
  uint32_t crc = 0;
  if (st.ok() && req.length > 0) {
    std::vector<PeerId> peers{from};
    const std::vector<absl::Status> sent = transport::SendChunked(
        *d_.plane->transport(), peers, kReadChunk, source, options_.bulk,
        [&](const transport::ChunkInfo& c) {
          const uint32_t cc = Crc32cOfPieces(*c.pieces);
          crc = Crc32cCombine(crc, cc, c.length);
          return EncodeChunk(Chunk{req.id, c.offset, cc});
        },
        d_.clock);
    st = sent[0];
    if (st.ok()) d_.metrics->peer_sent_bytes->Increment(static_cast<double>(req.length));
  }
  if (st.ok() && whole_crc && crc != *whole_crc) {
    // This node's copy went bad in memory: quarantine and report it, and
    // tell the reader (which then tries its next source).
    const std::string why = absl::StrFormat("copy has crc32c 0x%08x, recorded 0x%08x", crc, *whole_crc);
    if (req.what == ReadWhat::kShard) {
      d_.holdings->Quarantine(pins.front(), why);
    } else if (whole_segment) {
      d_.holdings->QuarantineSegment(*whole_segment, why, crc);
    }
    st = absl::DataLossError(absl::StrCat("node \"", options_.node_id, "\": ", why));
  }
  pins.clear();
  d_.plane->Send(from, kReadEnd, EncodeResult(Result{req.id, st, crc, st.ok() ? req.length : 0}));
}

}  // namespace ckpt::agent
