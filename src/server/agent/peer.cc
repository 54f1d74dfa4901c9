// The agent's peer data plane: replicas, EC parity, remote restore, rebuild.
// Protocol in server/agent/peer_wire.h and docs/protocol.md "Data plane".
//
// Threads: transport callbacks (OnAllocate / OnMessage / OnPeerFailed) run on
// the transport's progress thread and only take mu_ briefly; anything slow
// (whole-shard crc, record writes, meta reports, serving reads) runs on the
// agent's work threads (PostWork). Nothing calls into the transport while
// holding mu_, because a transport may complete a send inline.
#include <algorithm>
#include <atomic>
#include <thread>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/crc32c.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "ec/codec.h"
#include "server/agent/agent.h"

namespace ckpt::agent {

using transport::ConstPieces;
using transport::Inbound;
using transport::MutablePieces;
using transport::PeerId;

namespace {
constexpr int kCopyValid = 2;
constexpr int kCopyCorrupt = 3;
constexpr int kRoleReplica = 2;

absl::StatusOr<const ec::Codec*> CodecFor(uint32_t k, uint32_t m) {
  static absl::Mutex mu;
  static auto* codecs = new std::map<std::pair<uint32_t, uint32_t>, std::unique_ptr<ec::Codec>>();
  absl::MutexLock lock(&mu);
  auto& c = (*codecs)[{k, m}];
  if (c == nullptr) {
    CKPT_ASSIGN_OR_RETURN(c, ec::Codec::Create(static_cast<int>(k), static_cast<int>(m)));
  }
  return c.get();
}

// CRC of the concatenation of chunks given as offset -> (crc, length); the
// chunks must tile [0, total).
absl::StatusOr<uint32_t> CombineChunks(const std::map<uint64_t, std::pair<uint32_t, uint64_t>>& chunks,
                                       uint64_t total) {
  uint32_t crc = 0;
  uint64_t pos = 0;
  for (const auto& [off, c] : chunks) {
    if (off != pos) return absl::DataLossError(absl::StrCat("chunks do not tile the transfer at ", pos));
    crc = Crc32cCombine(crc, c.first, c.second);
    pos += c.second;
  }
  if (pos != total) return absl::DataLossError(absl::StrCat("received ", pos, " of ", total, " bytes"));
  return crc;
}

uint32_t PiecesCrc(const ConstPieces& pieces) {
  uint32_t crc = 0;
  for (const auto& p : pieces) crc = Crc32cExtend(crc, p.data(), p.size());
  return crc;
}

// Length of segment t of a blob of `size` bytes cut into k segments.
uint64_t SegmentLength(uint64_t size, uint32_t k, uint32_t t) {
  const uint64_t seg = (size + k - 1) / k;
  const uint64_t start = static_cast<uint64_t>(t) * seg;
  return start >= size ? 0 : std::min(seg, size - start);
}
}  // namespace

// ---------------------------------------------------------------------------
// Transport glue

class Agent::PeerHandler : public transport::Handler {
 public:
  explicit PeerHandler(Agent* a) : a_(a) {}
  absl::StatusOr<MutablePieces> Allocate(const Inbound& msg) override { return a_->OnAllocate(msg); }
  void OnReceived(const Inbound& msg, const absl::Status& status) override { a_->OnMessage(msg, status); }
  void OnPeerFailed(PeerId peer, const absl::Status& why) override { a_->OnPeerFailed(peer, why); }

 private:
  Agent* a_;
};

absl::Status Agent::StartDataPlane() {
  if (options_.transport == nullptr) return absl::OkStatus();
  peer_handler_ = std::make_unique<PeerHandler>(this);
  CKPT_RETURN_IF_ERROR(options_.transport->Start(options_.data_listen_address, peer_handler_.get()));
  if (absl::Status s = options_.transport->RegisterMemory(arena_->Data(0), arena_->capacity_bytes()); !s.ok()) {
    log::Warn("data plane: cannot register the memory tier ({}); transfers will copy", s.ToString());
  }
  data_plane_started_ = true;
  log::Info("data plane listening on {}", options_.transport->address());
  return absl::OkStatus();
}

std::string Agent::data_address() const {
  return data_plane_started_ ? options_.transport->address() : std::string();
}

void Agent::PostWork(std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  work_.push_back(std::move(fn));
}

void Agent::WorkLoop() {
  for (;;) {
    std::function<void()> fn;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Agent* a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(a->mu_) { return a->stopping_ || !a->work_.empty(); },
          this));
      if (work_.empty()) return;  // stopping
      fn = std::move(work_.front());
      work_.pop_front();
    }
    fn();
  }
}

absl::StatusOr<PeerId> Agent::PeerFor(const PeerEndpoint& ep) {
  if (!data_plane_started_) return absl::UnavailableError("this agent has no data plane");
  if (ep.data_address.empty()) {
    return absl::UnavailableError(absl::StrCat("node \"", ep.node_id, "\" has no data-plane address"));
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = peer_by_address_.find(ep.data_address);
    if (it != peer_by_address_.end()) return it->second;
    // A node that just refused us is not asked again for a moment (a decode
    // would otherwise try a dead holder once per stripe).
    auto f = failed_connects_.find(ep.data_address);
    if (f != failed_connects_.end() && clock_->MonotonicNow() - f->second.first < absl::Seconds(2)) {
      return f->second.second;
    }
  }
  absl::StatusOr<PeerId> p = options_.transport->Connect(ep.data_address, options_.peer_timeout_ms);
  if (!p.ok()) {
    const absl::Status why = absl::UnavailableError(absl::StrCat(
        "cannot reach node \"", ep.node_id, "\" at ", ep.data_address, ": ", p.status().message()));
    absl::MutexLock lock(&mu_);
    failed_connects_[ep.data_address] = {clock_->MonotonicNow(), why};
    return why;
  }
  absl::MutexLock lock(&mu_);
  failed_connects_.erase(ep.data_address);
  auto [it, added] = peer_by_address_.emplace(ep.data_address, *p);
  if (!added) {
    // Another thread connected meanwhile; keep one connection.
    const PeerId extra = *p;
    const PeerId keep = it->second;
    mu_.Unlock();
    options_.transport->Disconnect(extra);
    mu_.Lock();
    return keep;
  }
  return *p;
}

void Agent::SendMessage(PeerId peer, uint16_t type, std::string header, ConstPieces payload) {
  options_.transport->Send(peer, type, std::move(header), std::move(payload), [type](const absl::Status& s) {
    if (!s.ok()) log::Debug("data plane: message {} not sent: {}", type, s.ToString());
  });
}

void Agent::OnPeerFailed(PeerId peer, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  for (auto it = peer_by_address_.begin(); it != peer_by_address_.end();) {
    it = it->second == peer ? peer_by_address_.erase(it) : std::next(it);
  }
  const absl::Status lost = absl::UnavailableError(absl::StrCat("peer connection lost: ", why.message()));
  for (auto& [id, op] : out_puts_) {
    if (op.peer != peer) continue;
    if (!op.acked) {
      op.acked = true;
      op.ack = lost;
    }
    if (!op.done) {
      op.done = true;
      op.result = lost;
    }
  }
  for (auto& [id, r] : reads_) {
    if (r.peer == peer && !r.ended) {
      r.ended = true;
      r.status = lost;
    }
  }
  for (auto it = in_puts_.begin(); it != in_puts_.end();) {
    if (it->first.first == peer && !it->second.finishing) {
      if (it->second.begin.kind == PutKind::kEcData) {
        const PutBegin& b = it->second.begin;
        auto pb = parity_builds_.find(SegmentId{b.job_id, b.step, b.group, b.stripe, b.parity_position});
        if (pb != parity_builds_.end() && !pb->second.finished) pb->second.error = lost;
      }
      log::Warn("data plane: push {} from a failed peer abandoned ({} of {} bytes)", it->first.second,
                it->second.received, it->second.begin.total_bytes);
      arena_->Free(it->second.extents);
      it = in_puts_.erase(it);
    } else {
      ++it;
    }
  }
}

// ---------------------------------------------------------------------------
// Receiving

absl::StatusOr<MutablePieces> Agent::OnAllocate(const Inbound& msg) {
  switch (msg.type) {
    case kPutBegin: {
      CKPT_ASSIGN_OR_RETURN(PutBegin b, DecodePutBegin(msg.header));
      absl::MutexLock lock(&mu_);
      InPut& in = in_puts_[{msg.from, b.xfer}];
      in.begin = b;
      in.meta.assign(msg.payload_bytes, '\0');
      return MutablePieces{std::span<std::byte>(reinterpret_cast<std::byte*>(in.meta.data()), in.meta.size())};
    }
    case kPutChunk: {
      CKPT_ASSIGN_OR_RETURN(Chunk c, DecodeChunk(msg.header));
      absl::MutexLock lock(&mu_);
      auto it = in_puts_.find({msg.from, c.id});
      if (it == in_puts_.end()) return absl::FailedPreconditionError(absl::StrCat("unknown push ", c.id));
      InPut& in = it->second;
      if (c.offset + msg.payload_bytes > in.begin.total_bytes) {
        return absl::InvalidArgumentError("chunk beyond the end of the push");
      }
      if (in.begin.kind == PutKind::kReplica) {
        return MutablePiecesOf(in.extents, c.offset, msg.payload_bytes);
      }
      // EC data: into a scratch buffer, folded into parity on arrival.
      std::vector<std::byte> buf;
      if (!scratch_free_.empty()) {
        buf = std::move(scratch_free_.back());
        scratch_free_.pop_back();
      }
      buf.resize(msg.payload_bytes);
      auto& slot = scratch_used_[{msg.from, {c.id, c.offset}}];
      slot = std::move(buf);
      return MutablePieces{std::span<std::byte>(slot.data(), slot.size())};
    }
    case kReadChunk: {
      CKPT_ASSIGN_OR_RETURN(Chunk c, DecodeChunk(msg.header));
      absl::MutexLock lock(&mu_);
      auto it = reads_.find(c.id);
      if (it == reads_.end() || it->second.ended) {
        return absl::FailedPreconditionError(absl::StrCat("unknown read ", c.id));
      }
      if (c.offset + msg.payload_bytes > it->second.expected) {
        return absl::InvalidArgumentError("read chunk beyond the requested range");
      }
      return transport::SlicePieces(it->second.dest, c.offset, msg.payload_bytes);
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat("message type ", msg.type, " carries no payload"));
  }
}

void Agent::OnMessage(const Inbound& msg, const absl::Status& status) {
  switch (msg.type) {
    case kPutBegin:
      HandlePutBegin(msg, status);
      return;
    case kPutChunk:
      HandlePutChunk(msg, status);
      return;
    case kPutAck:
    case kPutDone: {
      absl::StatusOr<Result> r = DecodeResult(msg.header);
      if (!r.ok()) return;
      absl::MutexLock lock(&mu_);
      if (msg.type == kPutDone && !r->status.ok()) {
        // The sender gave up on a push it was sending us: free what it had
        // reserved (a partial EC fold spoils that parity).
        auto in = in_puts_.find({msg.from, r->id});
        if (in != in_puts_.end() && !in->second.finishing) {
          if (in->second.begin.kind == PutKind::kEcData) {
            const PutBegin& b = in->second.begin;
            auto pb = parity_builds_.find(SegmentId{b.job_id, b.step, b.group, b.stripe, b.parity_position});
            if (pb != parity_builds_.end() && !pb->second.finished) pb->second.error = r->status;
          }
          log::Warn("data plane: peer {} abandoned push {}: {}", msg.from, r->id, r->status.ToString());
          arena_->Free(in->second.extents);
          in_puts_.erase(in);
          return;
        }
      }
      auto it = out_puts_.find(r->id);
      if (it == out_puts_.end()) return;
      if (msg.type == kPutAck) {
        it->second.acked = true;
        it->second.ack = r->status;
      } else {
        it->second.done = true;
        it->second.result = r->status;
      }
      return;
    }
    case kReadReq: {
      absl::StatusOr<ReadReq> req = DecodeReadReq(msg.header);
      if (!req.ok()) {
        log::Warn("data plane: bad read request: {}", req.status().ToString());
        return;
      }
      const PeerId from = msg.from;
      PostWork([this, from, rq = *std::move(req)]() mutable { ServeRead(from, std::move(rq)); });
      return;
    }
    case kReadChunk: {
      absl::StatusOr<Chunk> c = DecodeChunk(msg.header);
      if (!c.ok()) return;
      absl::MutexLock lock(&mu_);
      auto it = reads_.find(c->id);
      if (it == reads_.end() || it->second.ended) return;
      PendingRead& r = it->second;
      if (!status.ok()) {
        r.ended = true;
        r.status = status;
        return;
      }
      uint32_t crc = 0;
      for (const auto& p : transport::SlicePieces(r.dest, c->offset, msg.payload_bytes)) {
        crc = Crc32cExtend(crc, p.data(), p.size());
      }
      if (crc != c->crc32c) {
        r.ended = true;
        r.status = absl::DataLossError(absl::StrFormat(
            "chunk at offset %d: crc32c 0x%08x != sender's 0x%08x", c->offset, crc, c->crc32c));
        return;
      }
      r.chunks[c->offset] = {crc, msg.payload_bytes};
      r.received += msg.payload_bytes;
      m_peer_received_bytes_->Increment(static_cast<double>(msg.payload_bytes));
      return;
    }
    case kReadEnd: {
      absl::StatusOr<Result> e = DecodeResult(msg.header);
      if (!e.ok()) return;
      absl::MutexLock lock(&mu_);
      auto it = reads_.find(e->id);
      if (it == reads_.end() || it->second.ended) return;
      it->second.ended = true;
      it->second.status = e->status;
      it->second.end_crc = e->crc32c;
      return;
    }
    default:
      log::Warn("data plane: unknown message type {} from peer {}", msg.type, msg.from);
  }
}

void Agent::HandlePutBegin(const Inbound& msg, const absl::Status& status) {
  absl::StatusOr<PutBegin> b = DecodePutBegin(msg.header);
  if (!b.ok()) return;
  auto refuse = [&](absl::Status why) {
    {
      absl::MutexLock lock(&mu_);
      auto it = in_puts_.find({msg.from, b->xfer});
      if (it != in_puts_.end()) {
        arena_->Free(it->second.extents);
        in_puts_.erase(it);
      }
    }
    SendMessage(msg.from, kPutAck, EncodeResult(Result{b->xfer, std::move(why)}));
  };
  if (!status.ok()) return refuse(status);
  absl::Status ack = absl::OkStatus();
  {
    absl::MutexLock lock(&mu_);
    if (b->target_incarnation != 0 && b->target_incarnation != incarnation_) {
      ack = absl::FailedPreconditionError(absl::StrCat("push is for incarnation ", b->target_incarnation,
                                                       ", this agent is ", incarnation_));
    } else if (absl::Status v = ValidateJobId(b->job_id); !v.ok()) {
      ack = v;
    }
    InPut& in = in_puts_[{msg.from, b->xfer}];
    in.begin = *b;
    if (ack.ok() && b->kind == PutKind::kReplica) {
      absl::StatusOr<ShardRecord> rec = DecodeShardRecord(in.meta);
      const ShardId id{b->job_id, b->step, b->rank};
      if (!rec.ok()) {
        ack = rec.status();
      } else if (rec->id != id || rec->size_bytes != b->total_bytes || rec->crc32c != b->crc32c) {
        ack = absl::InvalidArgumentError("push header and shard record disagree");
      } else if (absl::Status m = ValidateManifest(rec->items, rec->size_bytes); !m.ok()) {
        ack = m;
      } else if (auto h = holdings_.find(id);
                 h != holdings_.end() && !h->second.corrupt && !h->second.evict_pending) {
        ack = h->second.rec.crc32c == b->crc32c
                  ? absl::AlreadyExistsError(absl::StrCat(ShardIdString(id), " is already held here"))
                  : absl::FailedPreconditionError(
                        absl::StrCat("a different copy of ", ShardIdString(id), " is held here"));
      } else {
        absl::StatusOr<std::vector<Extent>> e = arena_->Allocate(b->total_bytes);
        if (!e.ok()) {
          ack = absl::ResourceExhaustedError(BudgetMessageLocked(b->total_bytes));
        } else {
          in.extents = *std::move(e);
          in.rec = *std::move(rec);
          in.rec.role = kRoleReplica;
          in.rec.extents = in.extents;
          in.rec.durable_path.clear();
        }
      }
    } else if (ack.ok() && b->kind == PutKind::kEcData) {
      if (b->data_k == 0 || b->data_k > 32 || b->parity_m == 0 || b->parity_m > 8 ||
          b->data_position >= b->data_k || b->parity_position < b->data_k ||
          b->parity_position >= b->data_k + b->parity_m || b->total_bytes > b->stripe_bytes) {
        ack = absl::InvalidArgumentError("malformed EC push");
      } else {
        ParityBuild* pb = ParityBuildLocked(*b);
        if (pb == nullptr) {
          ack = absl::ResourceExhaustedError(BudgetMessageLocked(b->stripe_bytes));
        } else if (!pb->error.ok()) {
          ack = pb->error;
        } else if (pb->finished || pb->complete.count(b->data_position) != 0) {
          // Folding the same segment twice would cancel it out (XOR).
          ack = absl::AlreadyExistsError("this data segment is already folded into the parity");
        } else if (pb->receiving.count(b->data_position) != 0) {
          ack = absl::AbortedError("this data segment is being received from another push");
        } else {
          pb->receiving.insert(b->data_position);
        }
      }
    } else if (ack.ok()) {
      ack = absl::InvalidArgumentError("unsupported push kind");
    }
    if (ack.ok() && b->total_bytes == 0) in.finishing = true;
  }
  if (!ack.ok()) return refuse(ack);
  if (b->kind == PutKind::kEcData) {
    // A new parity starts as zeros; zeroing (possibly cold) memory takes a
    // while, so not under the lock. No chunk of this stripe is folded before
    // this returns: they arrive on this same thread.
    std::vector<Extent> zero;
    {
      absl::MutexLock lock(&mu_);
      auto pit = parity_builds_.find(SegmentId{b->job_id, b->step, b->group, b->stripe, b->parity_position});
      if (pit != parity_builds_.end() && pit->second.needs_zeroing) {
        zero = pit->second.rec.extents;
        pit->second.needs_zeroing = false;
      }
    }
    arena_->ForEachPiece(zero, b->stripe_bytes, [](std::byte* p, uint64_t n) { std::memset(p, 0, n); });
  }
  SendMessage(msg.from, kPutAck, EncodeResult(Result{b->xfer, absl::OkStatus()}));
  if (b->total_bytes == 0) {
    const PeerId from = msg.from;
    const uint64_t xfer = b->xfer;
    PostWork([this, from, xfer] { FinishPut(from, xfer); });
  }
}

void Agent::HandlePutChunk(const Inbound& msg, const absl::Status& status) {
  absl::StatusOr<Chunk> c = DecodeChunk(msg.header);
  if (!c.ok()) return;
  // Look up under the lock, then check and fold without it (the heartbeat
  // and the trainers' calls must never wait behind a fold). Only this
  // transport thread touches a push's bytes and a parity being folded until
  // the push completes, so the extents stay put meanwhile.
  std::vector<std::byte> scratch;
  PutBegin begin;
  MutablePieces target;  // replica: where the chunk landed; EC: the parity range
  uint32_t data_k = 0, parity_m = 0;
  absl::Status fail = status;
  {
    absl::MutexLock lock(&mu_);
    if (auto sc = scratch_used_.find({msg.from, {c->id, c->offset}}); sc != scratch_used_.end()) {
      scratch = std::move(sc->second);
      scratch_used_.erase(sc);
    }
    auto it = in_puts_.find({msg.from, c->id});
    if (it == in_puts_.end()) return;
    begin = it->second.begin;
    if (begin.kind == PutKind::kReplica) {
      target = MutablePiecesOf(it->second.extents, c->offset, msg.payload_bytes);
    } else if (fail.ok()) {
      auto pit = parity_builds_.find(
          SegmentId{begin.job_id, begin.step, begin.group, begin.stripe, begin.parity_position});
      if (pit == parity_builds_.end() || pit->second.finished || !pit->second.error.ok()) {
        fail = absl::FailedPreconditionError("no parity is being built for this stripe");
      } else {
        target = MutablePiecesOf(pit->second.rec.extents, c->offset, scratch.size());
        data_k = pit->second.data_k;
        parity_m = pit->second.parity_m;
      }
    }
  }
  uint32_t crc = 0;
  if (fail.ok()) {
    if (begin.kind == PutKind::kReplica) {
      for (const auto& p : target) crc = Crc32cExtend(crc, p.data(), p.size());
    } else {
      crc = Crc32c(scratch.data(), scratch.size());
    }
    if (crc != c->crc32c) {
      fail = absl::DataLossError(absl::StrFormat("chunk at offset %d arrived with crc32c 0x%08x, sent 0x%08x",
                                                 c->offset, crc, c->crc32c));
    }
  }
  if (fail.ok() && begin.kind == PutKind::kEcData) {
    absl::StatusOr<const ec::Codec*> codec = CodecFor(data_k, parity_m);
    if (!codec.ok()) fail = codec.status();
    uint64_t done = 0;
    for (const auto& piece : target) {
      if (!fail.ok()) break;
      fail = (*codec)->EncodeUpdateRow(
          static_cast<int>(begin.data_position), static_cast<int>(begin.parity_position - data_k),
          ec::ConstBuffer(reinterpret_cast<const uint8_t*>(scratch.data()) + done, piece.size()),
          ec::MutableBuffer(reinterpret_cast<uint8_t*>(piece.data()), piece.size()));
      done += piece.size();
    }
  }
  bool complete = false;
  {
    absl::MutexLock lock(&mu_);
    if (!scratch.empty() || scratch.capacity() > 0) {
      scratch.clear();
      if (scratch_free_.size() < 8) scratch_free_.push_back(std::move(scratch));
    }
    auto it = in_puts_.find({msg.from, c->id});
    if (it == in_puts_.end()) return;
    InPut& in = it->second;
    auto pit = begin.kind == PutKind::kEcData
                   ? parity_builds_.find(SegmentId{begin.job_id, begin.step, begin.group, begin.stripe,
                                                   begin.parity_position})
                   : parity_builds_.end();
    if (fail.ok()) {
      in.chunks[c->offset] = {crc, msg.payload_bytes};
      in.received += msg.payload_bytes;
      if (pit != parity_builds_.end()) pit->second.folded[begin.data_position] += msg.payload_bytes;
      m_peer_received_bytes_->Increment(static_cast<double>(msg.payload_bytes));
      if (in.received == in.begin.total_bytes && !in.finishing) {
        in.finishing = true;
        complete = true;
      }
    } else {
      // A partial fold spoils the parity: the task fails and meta re-plans.
      if (pit != parity_builds_.end() && !pit->second.finished) pit->second.error = fail;
      arena_->Free(in.extents);
      in_puts_.erase(it);
    }
  }
  if (!fail.ok()) {
    log::Warn("data plane: push {} from peer {} failed: {}", c->id, msg.from, fail.ToString());
    SendMessage(msg.from, kPutDone, EncodeResult(Result{c->id, fail}));
    return;
  }
  if (complete) {
    const PeerId from = msg.from;
    const uint64_t xfer = c->id;
    PostWork([this, from, xfer] { FinishPut(from, xfer); });
  }
}

// Runs on a work thread once every byte of a push has arrived.
void Agent::FinishPut(PeerId from, uint64_t xfer) {
  absl::Status result;
  std::vector<HoldingReport> direct;
  {
    absl::MutexLock lock(&mu_);
    auto it = in_puts_.find({from, xfer});
    if (it == in_puts_.end()) return;
    InPut in = std::move(it->second);
    in_puts_.erase(it);
    absl::StatusOr<uint32_t> crc = CombineChunks(in.chunks, in.begin.total_bytes);
    if (crc.ok() && *crc != in.begin.crc32c) {
      crc = absl::DataLossError(absl::StrFormat("received bytes have crc32c 0x%08x, expected 0x%08x", *crc,
                                                in.begin.crc32c));
    }
    if (in.begin.kind == PutKind::kReplica) {
      const ShardId id = in.rec.id;
      if (!crc.ok()) {
        arena_->Free(in.extents);
        result = crc.status();
      } else if (auto h = holdings_.find(id); h != holdings_.end()) {
        arena_->Free(in.extents);  // arrived twice (a re-sent task): keep the first
        result = absl::OkStatus();
      } else if (absl::Status w = arena_->WriteRecord(in.rec); !w.ok()) {
        arena_->Free(in.extents);
        result = absl::UnavailableError(absl::StrCat("cannot record the replica: ", w.message()));
      } else {
        Holding h;
        h.rec = in.rec;
        h.rec.staged_unix_ms = clock_->NowUnixMillis();
        h.verified = true;  // every chunk and the whole were crc-checked
        h.committed_at = clock_->MonotonicNow();
        holdings_[id] = std::move(h);
        HoldingReport r;
        r.kind = HoldingReport::Kind::kCopyState;
        r.id = id;
        r.copy_role = kRoleReplica;
        r.copy_state = kCopyValid;
        r.size_bytes = in.rec.size_bytes;
        r.crc32c = in.rec.crc32c;
        r.task_id = in.begin.task_id;
        direct.push_back(std::move(r));
        UpdateGauges();
        m_replicas_stored_->Increment();
        log::Info("stored replica of {} ({} bytes) from peer {}", ShardIdString(id), in.rec.size_bytes, from);
      }
    } else {
      // EC data folded in: the parity may now be complete.
      result = crc.status();
      const SegmentId sid{in.begin.job_id, in.begin.step, in.begin.group, in.begin.stripe,
                          in.begin.parity_position};
      auto pit = parity_builds_.find(sid);
      if (pit != parity_builds_.end() && !pit->second.finished) {
        ParityBuild& pb = pit->second;
        pb.receiving.erase(in.begin.data_position);
        if (!result.ok()) {
          pb.error = result;  // a partial fold spoils the parity
        } else {
          pb.complete.insert(in.begin.data_position);
          bool every = pb.error.ok();
          for (uint32_t d = 0; d < pb.data_k; ++d) {
            if ((pb.expect_mask >> d & 1) != 0 && pb.complete.count(d) == 0) every = false;
          }
          if (every) FinishParityLocked(sid, pb);
        }
      }
    }
  }
  if (!direct.empty()) {
    // Report before acknowledging, so meta sees the copy before the sender's
    // task result (otherwise it would plan the copy again).
    uint64_t inc;
    {
      absl::MutexLock lock(&mu_);
      inc = incarnation_;
    }
    absl::StatusOr<ReportReply> r = meta_->ReportShards(options_.node_id, inc, direct);
    if (!r.ok()) {
      absl::MutexLock lock(&mu_);
      for (HoldingReport& h : direct) QueueReportLocked(std::move(h));
    }
  }
  SendMessage(from, kPutDone, EncodeResult(Result{xfer, result}));
}

Agent::ParityBuild* Agent::ParityBuildLocked(const PutBegin& b) {
  const SegmentId sid{b.job_id, b.step, b.group, b.stripe, b.parity_position};
  auto it = parity_builds_.find(sid);
  if (it != parity_builds_.end()) return &it->second;
  absl::StatusOr<std::vector<Extent>> e = arena_->Allocate(std::max<uint64_t>(b.stripe_bytes, 1));
  if (!e.ok()) return nullptr;
  ParityBuild pb;
  pb.rec.id = ShardId{b.job_id, b.step, 0};
  pb.rec.segment = sid;
  pb.rec.segment_kind = kSegmentParity;
  pb.rec.size_bytes = b.stripe_bytes;
  pb.rec.extents = *std::move(e);
  pb.data_k = b.data_k;
  pb.parity_m = b.parity_m;
  pb.expect_mask = b.expect_mask;
  pb.needs_zeroing = true;  // done by the caller outside the lock
  return &parity_builds_.emplace(sid, std::move(pb)).first->second;
}

void Agent::FinishParityLocked(const SegmentId& id, ParityBuild& pb) {
  pb.finished = true;
  ShardRecord rec = pb.rec;
  rec.crc32c = arena_->Checksum(rec.extents, rec.size_bytes);
  rec.staged_unix_ms = clock_->NowUnixMillis();
  pb.rec.extents.clear();  // ownership moves to the segment holding
  if (absl::Status s = StoreSegmentLocked(rec, ""); !s.ok()) {
    pb.error = s;
    log::Error("cannot store parity {}: {}", SegmentIdString(id), s.ToString());
    return;
  }
  m_parity_stored_->Increment();
  log::Info("parity {} complete ({} bytes)", SegmentIdString(id), rec.size_bytes);
}

absl::Status Agent::StoreSegmentLocked(ShardRecord rec, const std::string& task_id) {
  const SegmentId id = *rec.segment;
  if (absl::Status s = arena_->WriteRecord(rec); !s.ok()) {
    arena_->Free(rec.extents);
    return absl::UnavailableError(absl::StrCat("cannot record segment ", SegmentIdString(id), ": ", s.message()));
  }
  if (auto old = segments_.find(id); old != segments_.end()) FreeSegmentLocked(id);
  SegHolding h;
  h.rec = rec;
  segments_[id] = std::move(h);
  QueueSegmentReportLocked(id, rec.segment_kind, kCopyValid, rec.size_bytes, rec.crc32c, task_id, "");
  UpdateGauges();
  return absl::OkStatus();
}

void Agent::FreeSegmentLocked(const SegmentId& id) {
  auto it = segments_.find(id);
  if (it == segments_.end()) return;
  if (it->second.pins > 0) {
    it->second.evict_pending = true;
    return;
  }
  if (absl::Status s = arena_->RemoveSegmentRecord(id); !s.ok()) {
    log::Error("cannot remove the record of {}: {}", SegmentIdString(id), s.ToString());
  }
  arena_->Free(it->second.rec.extents);
  segments_.erase(it);
}

void Agent::QueueSegmentReportLocked(const SegmentId& id, int kind, int state, uint64_t length, uint32_t crc,
                                     const std::string& task_id, const std::string& detail) {
  HoldingReport r;
  r.kind = HoldingReport::Kind::kSegment;
  r.segment = id;
  r.segment_kind = kind;
  r.copy_state = state;
  r.size_bytes = length;
  r.crc32c = crc;
  r.task_id = task_id;
  r.detail = detail;
  QueueReportLocked(std::move(r));
}

// ---------------------------------------------------------------------------
// Serving reads

transport::ConstPieces Agent::PiecesOf(const std::vector<Extent>& extents, uint64_t offset,
                                       uint64_t length) const {
  ConstPieces out;
  uint64_t pos = 0;
  for (const Extent& e : extents) {
    if (length == 0) break;
    const uint64_t end = pos + e.length;
    if (offset < end) {
      const uint64_t in = offset - pos;
      const uint64_t n = std::min(length, e.length - in);
      out.emplace_back(arena_->Data(e.offset + in), n);
      offset += n;
      length -= n;
    }
    pos = end;
  }
  return out;
}

transport::MutablePieces Agent::MutablePiecesOf(const std::vector<Extent>& extents, uint64_t offset,
                                                uint64_t length) const {
  MutablePieces out;
  for (const auto& p : PiecesOf(extents, offset, length)) {
    out.emplace_back(const_cast<std::byte*>(p.data()), p.size());
  }
  return out;
}

absl::StatusOr<transport::ConstPieces> Agent::BlobPiecesLocked(const std::string& job, uint64_t step,
                                                               std::vector<ShardId>* pinned, uint64_t* size) {
  ConstPieces out;
  *size = 0;
  for (auto it = holdings_.lower_bound(ShardId{job, step, 0});
       it != holdings_.end() && it->first.job_id == job && it->first.step == step; ++it) {
    const Holding& h = it->second;
    if (h.rec.role != 1) continue;  // the blob is the node's primaries only
    if (h.corrupt || h.evict_pending) {
      return absl::DataLossError(absl::StrCat("primary ", ShardIdString(it->first), " is not readable here"));
    }
    for (const auto& p : PiecesOf(h.rec.extents, 0, h.rec.size_bytes)) out.push_back(p);
    *size += h.rec.size_bytes;
    it->second.pins++;
    pinned->push_back(it->first);
  }
  return out;
}

void Agent::UnpinAllLocked(const std::vector<ShardId>& ids) {
  for (const ShardId& id : ids) UnpinLocked(id);
}

void Agent::ServeRead(PeerId from, ReadReq req) {
  ConstPieces source;
  std::vector<ShardId> pinned;
  std::optional<SegmentId> pinned_seg;
  absl::Status st;
  std::optional<uint32_t> whole_crc;  // a whole shard copy: what its bytes must hash to
  {
    absl::MutexLock lock(&mu_);
    uint64_t total = 0;
    if (req.target_incarnation != 0 && req.target_incarnation != incarnation_) {
      st = absl::FailedPreconditionError(absl::StrCat("read is for incarnation ", req.target_incarnation,
                                                      ", this agent is ", incarnation_));
    } else if (req.what == ReadWhat::kShard) {
      const ShardId id{req.job_id, req.step, req.rank};
      absl::StatusOr<Holding*> h = ValidHoldingLocked(id);
      if (!h.ok()) {
        st = h.status();
      } else {
        total = (*h)->rec.size_bytes;
        if (req.offset <= total) {
          source = PiecesOf((*h)->rec.extents, req.offset, std::min(req.length, total - req.offset));
        }
        if (req.offset == 0 && req.length == total) whole_crc = (*h)->rec.crc32c;
        (*h)->pins++;
        pinned.push_back(id);
      }
    } else {
      const SegmentId sid{req.job_id, req.step, req.group, req.stripe, req.position};
      auto seg = segments_.find(sid);
      if (seg != segments_.end() && !seg->second.corrupt && !seg->second.evict_pending) {
        total = seg->second.rec.size_bytes;
        if (req.offset <= total) {
          source = PiecesOf(seg->second.rec.extents, req.offset, std::min(req.length, total - req.offset));
        }
        seg->second.pins++;
        pinned_seg = sid;
      } else if (auto own = owned_segments_.find(sid);
                 own != owned_segments_.end() || (req.position < req.data_k && req.data_k > 0)) {
        if (own != owned_segments_.end()) {
          req.data_k = own->second.data_k;
          req.blob_segment_index = own->second.blob_segment_index;
        }
        uint64_t blob = 0;
        absl::StatusOr<ConstPieces> pieces = BlobPiecesLocked(req.job_id, req.step, &pinned, &blob);
        if (!pieces.ok()) {
          st = pieces.status();
        } else if (blob == 0) {
          st = absl::NotFoundError(absl::StrCat("no blob of ", req.job_id, "/", req.step, " here"));
        } else {
          const uint64_t seg_bytes = (blob + req.data_k - 1) / req.data_k;
          const uint64_t start = static_cast<uint64_t>(req.blob_segment_index) * seg_bytes;
          total = SegmentLength(blob, req.data_k, req.blob_segment_index);
          if (req.offset <= total) {
            source = transport::SlicePieces(*pieces, start + req.offset, std::min(req.length, total - req.offset));
          }
        }
      } else {
        st = absl::NotFoundError(absl::StrCat("segment ", SegmentIdString(sid), " is not held here"));
      }
    }
    if (st.ok() && (req.offset > total || req.length > total - req.offset)) {
      st = absl::OutOfRangeError(absl::StrCat("read [", req.offset, ", +", req.length, ") beyond ", total, " bytes"));
    }
  }
  uint32_t crc = 0;
  if (st.ok() && req.length > 0) {
    std::vector<PeerId> peers{from};
    std::vector<uint32_t> chunk_crcs;
    const std::vector<absl::Status> sent = transport::SendChunked(
        *options_.transport, peers, kReadChunk, source, options_.bulk,
        [&](const transport::ChunkInfo& c) {
          const uint32_t cc = PiecesCrc(*c.pieces);
          crc = Crc32cCombine(crc, cc, c.length);
          return EncodeChunk(Chunk{req.id, c.offset, cc});
        },
        clock_);
    st = sent[0];
    if (st.ok()) m_peer_sent_bytes_->Increment(static_cast<double>(req.length));
  }
  {
    absl::MutexLock lock(&mu_);
    if (st.ok() && whole_crc && crc != *whole_crc) {
      // This node's copy went bad in memory: quarantine and report it, and
      // tell the reader (which then tries its next source).
      const std::string why = absl::StrFormat("copy has crc32c 0x%08x, recorded 0x%08x", crc, *whole_crc);
      auto h = holdings_.find(pinned.front());
      if (h != holdings_.end()) QuarantineLocked(h->second, why);
      st = absl::DataLossError(absl::StrCat("node \"", options_.node_id, "\": ", why));
    }
    UnpinAllLocked(pinned);
    if (pinned_seg) {
      auto seg = segments_.find(*pinned_seg);
      if (seg != segments_.end() && --seg->second.pins == 0 && seg->second.evict_pending) {
        FreeSegmentLocked(*pinned_seg);
      }
    }
  }
  SendMessage(from, kReadEnd, EncodeResult(Result{req.id, st, crc, st.ok() ? req.length : 0}));
}

// ---------------------------------------------------------------------------
// Requesting

std::vector<absl::Status> Agent::Push(const std::vector<PeerEndpoint>& targets, PutBegin begin,
                                      const std::string& meta, const ConstPieces& source,
                                      const std::function<void(size_t, PutBegin&)>& customize) {
  std::vector<absl::Status> out(targets.size());
  std::vector<uint64_t> xfers(targets.size(), 0);
  std::vector<PeerId> peers;
  std::vector<size_t> sending;  // indexes of targets that acked
  const absl::Duration timeout = absl::Milliseconds(options_.peer_timeout_ms);
  for (size_t i = 0; i < targets.size(); ++i) {
    absl::StatusOr<PeerId> p = PeerFor(targets[i]);
    if (!p.ok()) {
      out[i] = p.status();
      continue;
    }
    PutBegin b = begin;
    b.target_incarnation = targets[i].incarnation;
    if (customize) customize(i, b);
    {
      absl::MutexLock lock(&mu_);
      b.xfer = next_xfer_++;
      out_puts_[b.xfer].peer = *p;
    }
    xfers[i] = b.xfer;
    options_.transport->Send(*p, kPutBegin, EncodePutBegin(b),
                             {std::span<const std::byte>(reinterpret_cast<const std::byte*>(meta.data()), meta.size())},
                             [](const absl::Status&) {});
  }
  // Wait for the acks (the meta payload is ours until then: `meta` outlives this).
  for (size_t i = 0; i < targets.size(); ++i) {
    if (xfers[i] == 0) continue;
    absl::MutexLock lock(&mu_);
    const uint64_t x = xfers[i];
    auto acked = [this, x]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return out_puts_[x].acked; };
    if (!clock_->AwaitWithTimeout(&mu_, absl::Condition(&acked), timeout)) {
      out[i] = absl::DeadlineExceededError(absl::StrCat("node \"", targets[i].node_id, "\" did not acknowledge"));
    } else if (absl::IsAlreadyExists(out_puts_[x].ack)) {
      out[i] = absl::OkStatus();  // it already holds this copy
    } else if (!out_puts_[x].ack.ok()) {
      out[i] = out_puts_[x].ack;
    } else if (begin.total_bytes > 0) {
      peers.push_back(out_puts_[x].peer);
      sending.push_back(i);
      continue;
    } else {
      continue;  // nothing to send: wait for done below
    }
    out_puts_.erase(x);
    xfers[i] = 0;
  }
  if (!peers.empty()) {
    // One fan-out: each chunk is read once and sent to every target that
    // acknowledged, each under its own transfer id.
    std::vector<uint64_t> ids;
    for (size_t idx : sending) ids.push_back(xfers[idx]);
    uint64_t crc_index = UINT64_MAX;
    uint32_t chunk_crc = 0;
    const std::vector<absl::Status> results = transport::SendChunked(
        *options_.transport, peers, kPutChunk, source, options_.bulk,
        [&](const transport::ChunkInfo& c, size_t peer) {
          if (c.index != crc_index) {
            chunk_crc = PiecesCrc(*c.pieces);
            crc_index = c.index;
          }
          return EncodeChunk(Chunk{ids[peer], c.offset, chunk_crc});
        },
        clock_);
    for (size_t j = 0; j < peers.size(); ++j) {
      if (results[j].ok()) {
        m_peer_sent_bytes_->Increment(static_cast<double>(begin.total_bytes));
        continue;
      }
      out[sending[j]] = results[j];
      // Tell the receiver to let go of what it reserved for this push.
      SendMessage(peers[j], kPutDone, EncodeResult(Result{ids[j], results[j]}));
    }
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    if (xfers[i] == 0) continue;
    absl::MutexLock lock(&mu_);
    const uint64_t x = xfers[i];
    auto done = [this, x]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return out_puts_[x].done; };
    if (out[i].ok()) {
      if (!clock_->AwaitWithTimeout(&mu_, absl::Condition(&done), timeout)) {
        out[i] = absl::DeadlineExceededError(absl::StrCat("node \"", targets[i].node_id, "\" did not confirm"));
      } else {
        out[i] = out_puts_[x].result;
      }
    }
    out_puts_.erase(x);
  }
  return out;
}

absl::StatusOr<uint64_t> Agent::StartRead(const PeerEndpoint& ep, ReadReq req, MutablePieces dest) {
  CKPT_ASSIGN_OR_RETURN(PeerId peer, PeerFor(ep));
  req.target_incarnation = ep.incarnation;
  {
    absl::MutexLock lock(&mu_);
    req.id = next_xfer_++;
    PendingRead r;
    r.peer = peer;
    r.dest = std::move(dest);
    r.expected = req.length;
    reads_[req.id] = std::move(r);
  }
  SendMessage(peer, kReadReq, EncodeReadReq(req));
  return req.id;
}

absl::StatusOr<uint32_t> Agent::FinishRead(uint64_t id, const std::string& node_id) {
  absl::MutexLock lock(&mu_);
  auto complete = [this, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const PendingRead& r = reads_[id];
    return r.ended && (!r.status.ok() || r.received == r.expected);
  };
  // The end message may overtake the last chunk's data; wait for both.
  const bool ok = clock_->AwaitWithTimeout(&mu_, absl::Condition(&complete),
                                           absl::Milliseconds(options_.peer_timeout_ms));
  PendingRead r = std::move(reads_[id]);
  reads_.erase(id);
  if (!ok) {
    return absl::DeadlineExceededError(absl::StrCat("node \"", node_id, "\" did not answer a read within ",
                                                    options_.peer_timeout_ms, " ms"));
  }
  if (!r.status.ok()) {
    return absl::Status(r.status.code(), absl::StrCat("reading from node \"", node_id, "\": ", r.status.message()));
  }
  CKPT_ASSIGN_OR_RETURN(uint32_t crc, CombineChunks(r.chunks, r.expected));
  if (crc != r.end_crc) {
    return absl::DataLossError(absl::StrFormat("node \"%s\" sent bytes with crc32c 0x%08x, it announced 0x%08x",
                                               node_id, crc, r.end_crc));
  }
  return crc;
}

absl::StatusOr<uint32_t> Agent::ReadFromPeer(const PeerEndpoint& ep, ReadReq req, MutablePieces dest) {
  CKPT_ASSIGN_OR_RETURN(uint64_t id, StartRead(ep, std::move(req), std::move(dest)));
  return FinishRead(id, ep.node_id);
}

// ---------------------------------------------------------------------------
// Restores

absl::Status Agent::AdoptRestoredLocked(const ShardRecord& expected, std::vector<Extent> extents,
                                        const std::string& durable_path, const std::string& source) {
  const ShardId& id = expected.id;
  ShardRecord rec = expected;
  rec.role = 3;  // RESTORED
  rec.items = SortedByOffset(expected.items);
  rec.manifest_digest = ManifestDigest(rec.items);
  rec.extents = std::move(extents);
  rec.durable_path = durable_path;
  rec.segment.reset();
  rec.staged_unix_ms = clock_->NowUnixMillis();
  if (absl::Status s = arena_->WriteRecord(rec); !s.ok()) {
    arena_->Free(rec.extents);
    return absl::UnavailableError(absl::StrCat("cannot record the restored shard: ", s.message()));
  }
  Holding h;
  h.rec = rec;
  h.verified = true;
  h.committed_at = clock_->MonotonicNow();
  holdings_[id] = std::move(h);
  HoldingReport r;
  r.kind = HoldingReport::Kind::kCopyState;
  r.id = id;
  r.copy_role = 3;
  r.copy_state = kCopyValid;
  r.size_bytes = rec.size_bytes;
  r.crc32c = rec.crc32c;
  QueueReportLocked(std::move(r));
  log::Info("restored {} ({} bytes) from {}", ShardIdString(id), rec.size_bytes, source);
  UpdateGauges();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<Extent>> Agent::ReserveForRestore(const ShardRecord& expected) {
  CKPT_RETURN_IF_ERROR(ValidateManifest(expected.items, expected.size_bytes));
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::vector<Extent>> e = arena_->Allocate(expected.size_bytes);
  if (!e.ok()) return absl::ResourceExhaustedError(BudgetMessageLocked(expected.size_bytes));
  return *std::move(e);
}

absl::StatusOr<OpenResult> Agent::FinishPeerRestore(const ShardRecord& expected, std::vector<Extent> extents,
                                                    const absl::Status& fetched, const std::string& source,
                                                    uint32_t client_pid, int64_t ttl_ms) {
  {
    absl::MutexLock lock(&mu_);
    if (!fetched.ok()) {
      arena_->Free(extents);
      m_peer_errors_->Increment();
      return fetched;
    }
    CKPT_RETURN_IF_ERROR(AdoptRestoredLocked(expected, std::move(extents), "", source));
    m_peer_restores_->Increment();
  }
  return OpenShard(expected.id, true, client_pid, ttl_ms);
}

absl::StatusOr<OpenResult> Agent::RestoreFromPeer(const ShardRecord& expected, const PeerEndpoint& holder,
                                                  uint32_t client_pid, int64_t ttl_ms) {
  const ShardId& id = expected.id;
  if (absl::StatusOr<OpenResult> held = OpenShard(id, false, client_pid, ttl_ms);
      held.ok() || !absl::IsNotFound(held.status())) {
    return held;  // a local copy (or its quarantine) decides
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<Extent> extents, ReserveForRestore(expected));
  ReadReq req;
  req.what = ReadWhat::kShard;
  req.job_id = id.job_id;
  req.step = id.step;
  req.rank = id.rank;
  req.length = expected.size_bytes;
  absl::StatusOr<uint32_t> crc = ReadFromPeer(holder, req, MutablePiecesOf(extents, 0, expected.size_bytes));
  if (crc.ok() && *crc != expected.crc32c) {
    crc = absl::DataLossError(absl::StrFormat("copy on node \"%s\" has crc32c 0x%08x, the shard 0x%08x",
                                              holder.node_id, *crc, expected.crc32c));
  }
  return FinishPeerRestore(expected, std::move(extents), crc.status(), absl::StrCat("node \"", holder.node_id, "\""),
                           client_pid, ttl_ms);
}

ReadReq Agent::SegmentReadReq(const SegmentLocation& loc, uint32_t data_k, uint32_t blob_segment_index,
                              uint64_t offset, uint64_t length) {
  ReadReq req;
  req.what = ReadWhat::kSegment;
  req.job_id = loc.key.job_id;
  req.step = loc.key.step;
  req.group = loc.key.group;
  req.stripe = loc.key.stripe;
  req.position = loc.key.position;
  req.data_k = data_k;
  req.blob_segment_index = blob_segment_index;
  req.offset = offset;
  req.length = length;
  return req;
}

absl::Status Agent::DecodeRange(const std::vector<SegmentLocation>& sources, uint32_t data_k, uint32_t parity_m,
                                uint64_t stripe_bytes, uint32_t position, uint64_t offset, const MutablePieces& out) {
  CKPT_ASSIGN_OR_RETURN(const ec::Codec* codec, CodecFor(data_k, parity_m));
  const uint64_t len = transport::TotalBytes(out);
  if (len == 0) return absl::OkStatus();
  const uint32_t n = data_k + parity_m;
  if (position >= n || offset + len > stripe_bytes) {
    return absl::InvalidArgumentError("decode range outside the stripe");
  }
  // Bytes [x, y) of the missing fragment depend only on bytes [x, y) of k
  // others. The range is decoded slice by slice: each slice's bytes are read
  // from k survivors at once into small buffers that are reused (and so stay
  // hot), decoded, and written out; nothing the size of a stripe is buffered.
  const uint64_t slice = std::min<uint64_t>(len, std::max<uint64_t>(options_.bulk.chunk_bytes / 2, 1 << 20));
  std::vector<std::vector<uint8_t>> bufs(n + 1, std::vector<uint8_t>(slice));
  std::vector<bool> usable(sources.size(), true);  // false once a source failed
  std::vector<std::string> errors;
  std::vector<int> chosen;  // source indexes in use, by position order of choice
  std::vector<ec::Fragment> frags(n);
  for (uint64_t off = 0; off < len; off += slice) {
    const uint64_t cnt = std::min(slice, len - off);
    std::vector<bool> present(n, false);
    std::vector<uint64_t> real(n, 0);
    size_t next = 0;
    uint32_t have = 0;
    std::vector<int> keep;
    // Start with the sources that worked for the previous slice.
    std::vector<int> order = chosen;
    for (size_t i = 0; i < sources.size(); ++i) {
      if (std::find(chosen.begin(), chosen.end(), static_cast<int>(i)) == chosen.end()) {
        order.push_back(static_cast<int>(i));
      }
    }
    while (have < data_k && next < order.size()) {
      std::vector<std::pair<int, uint64_t>> started;  // (source index, read id or 0)
      while (have + started.size() < data_k && next < order.size()) {
        const int si = order[next++];
        const SegmentLocation& loc = sources[si];
        const uint32_t p = loc.key.position;
        if (!usable[si] || p >= n || p == position || present[p]) continue;
        bool dup = false;
        for (const auto& [other, id] : started) dup |= sources[other].key.position == p;
        if (dup) continue;
        const uint64_t at = offset + off;
        real[p] = loc.length_bytes > at ? std::min(cnt, loc.length_bytes - at) : 0;
        uint64_t id = 0;
        if (real[p] > 0) {
          absl::StatusOr<uint64_t> r =
              StartRead(loc.holder, SegmentReadReq(loc, 0, 0, at, real[p]),
                        MutablePieces{std::span<std::byte>(reinterpret_cast<std::byte*>(bufs[p].data()), real[p])});
          if (!r.ok()) {
            usable[si] = false;
            errors.push_back(std::string(r.status().message()));
            continue;
          }
          id = *r;
        }
        started.emplace_back(si, id);
      }
      for (const auto& [si, id] : started) {
        const uint32_t p = sources[si].key.position;
        if (id != 0) {
          absl::StatusOr<uint32_t> crc = FinishRead(id, sources[si].holder.node_id);
          if (!crc.ok()) {
            usable[si] = false;
            errors.push_back(std::string(crc.status().message()));
            continue;
          }
        }
        std::memset(bufs[p].data() + real[p], 0, cnt - real[p]);  // zero padding of a short fragment
        present[p] = true;
        keep.push_back(si);
        ++have;
      }
    }
    if (have < data_k) {
      return absl::DataLossError(absl::StrCat("only ", have, " of the ", data_k, " segments needed could be read",
                                              errors.empty() ? "" : ": ", absl::StrJoin(errors, "; ")));
    }
    chosen = keep;
    for (uint32_t p = 0; p < n; ++p) {
      if (present[p]) {
        frags[p] = ec::Fragment{bufs[p].data(), cnt, true};
      } else if (p == position) {
        frags[p] = ec::Fragment{bufs[n].data(), cnt, false};
      } else {
        frags[p] = ec::Fragment{bufs[n].data(), 0, false};  // missing, nothing wanted
      }
    }
    CKPT_RETURN_IF_ERROR(codec->Decode(frags, cnt));
    uint64_t done = 0;
    for (const auto& piece : transport::SlicePieces(out, off, cnt)) {
      std::memcpy(piece.data(), bufs[n].data() + done, piece.size());
      done += piece.size();
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<OpenResult> Agent::RestoreByDecode(const ShardRecord& expected, const EcDecodeSource& src,
                                                  uint32_t client_pid, int64_t ttl_ms) {
  const ShardId& id = expected.id;
  if (absl::StatusOr<OpenResult> held = OpenShard(id, false, client_pid, ttl_ms);
      held.ok() || !absl::IsNotFound(held.status())) {
    return held;  // a local copy (or its quarantine) decides
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<Extent> extents, ReserveForRestore(expected));
  const uint64_t shard_start = src.blob_offset_bytes;
  const uint64_t shard_end = shard_start + expected.size_bytes;
  // Each stripe holding part of the shard is rebuilt straight into the
  // shard's extents: read from the surviving data segment, else decoded.
  // Stripes run concurrently.
  std::vector<absl::Status> results(src.stripes.size());
  auto one = [&](size_t i) {
    const EcStripeSource& s = src.stripes[i];
    const uint64_t seg_start = static_cast<uint64_t>(s.blob_segment_index) * src.segment_bytes;
    const uint64_t a = std::max(seg_start, shard_start);
    const uint64_t b = std::min(seg_start + src.segment_bytes, shard_end);
    if (a >= b) return;
    const MutablePieces dest = MutablePiecesOf(extents, a - shard_start, b - a);
    for (const SegmentLocation& l : s.segments) {
      if (l.kind != kSegmentData || l.key.position != s.position) continue;
      absl::StatusOr<uint32_t> got = ReadFromPeer(
          l.holder, SegmentReadReq(l, src.data_k, s.blob_segment_index, a - seg_start, b - a), dest);
      if (got.ok()) return;
      log::Warn("restore {}: reading stripe {} directly failed ({}); decoding", ShardIdString(id), s.stripe_index,
                got.status().ToString());
    }
    absl::Status d =
        DecodeRange(s.segments, src.data_k, src.parity_m, s.stripe_length_bytes, s.position, a - seg_start, dest);
    if (!d.ok()) results[i] = absl::Status(d.code(), absl::StrCat("stripe ", s.stripe_index, ": ", d.message()));
  };
  {
    std::vector<std::thread> workers;
    for (size_t i = 0; i < src.stripes.size(); ++i) workers.emplace_back(one, i);
    for (std::thread& w : workers) w.join();
  }
  absl::Status st;
  for (const absl::Status& r : results) {
    if (!r.ok() && st.ok()) st = r;
  }
  uint32_t crc = 0;
  if (st.ok()) {
    crc = arena_->Checksum(extents, expected.size_bytes);
    if (crc != expected.crc32c) {
      st = absl::DataLossError(absl::StrFormat("decoded shard has crc32c 0x%08x, the shard 0x%08x", crc,
                                               expected.crc32c));
    }
  }
  return FinishPeerRestore(expected, std::move(extents), st,
                           absl::StrCat("EC stripes of node \"", src.owner_node_id, "\""), client_pid, ttl_ms);
}

// ---------------------------------------------------------------------------
// Tasks

absl::Status Agent::RunReplicate(QueuedTask& qt, bool* finished) {
  const AgentTask& t = qt.task;
  if (!data_plane_started_) return absl::UnavailableError("this agent has no data plane");
  {
    // Never send bytes the verifier has not checked yet; come back later.
    absl::MutexLock lock(&mu_);
    for (uint32_t rank : t.ranks) {
      auto it = holdings_.find(ShardId{t.job_id, t.step, rank});
      if (it != holdings_.end() && !it->second.verified && !it->second.corrupt) {
        *finished = false;
        return absl::OkStatus();
      }
    }
  }
  std::vector<std::string> failures;
  for (uint32_t rank : t.ranks) {
    const ShardId id{t.job_id, t.step, rank};
    ShardRecord rec;
    {
      absl::MutexLock lock(&mu_);
      absl::StatusOr<Holding*> h = ValidHoldingLocked(id);
      if (!h.ok()) {
        failures.push_back(std::string(h.status().message()));
        continue;
      }
      (*h)->pins++;
      rec = (*h)->rec;
    }
    ShardRecord wire = rec;
    wire.extents.clear();
    wire.durable_path.clear();
    PutBegin b;
    b.kind = PutKind::kReplica;
    b.task_id = t.id;
    b.job_id = t.job_id;
    b.step = t.step;
    b.rank = rank;
    b.total_bytes = rec.size_bytes;
    b.crc32c = rec.crc32c;
    const absl::Time t0 = clock_->MonotonicNow();
    const std::vector<absl::Status> res = Push(t.targets, b, EncodeShardRecord(wire),
                                               PiecesOf(rec.extents, 0, rec.size_bytes));
    log::Debug("pushed {} ({} bytes) to {} nodes in {} ms", ShardIdString(id), rec.size_bytes, t.targets.size(),
               absl::ToInt64Milliseconds(clock_->MonotonicNow() - t0));
    {
      absl::MutexLock lock(&mu_);
      UnpinLocked(id);
    }
    for (size_t i = 0; i < res.size(); ++i) {
      if (res[i].ok()) {
        qt.bytes_done += rec.size_bytes;
      } else {
        failures.push_back(absl::StrCat("rank ", rank, " to node \"", t.targets[i].node_id, "\": ", res[i].message()));
      }
    }
  }
  if (!failures.empty()) {
    m_peer_errors_->Increment();
    return absl::UnavailableError(absl::StrJoin(failures, "; "));
  }
  return absl::OkStatus();
}

absl::Status Agent::RunEcEncode(QueuedTask& qt, bool* finished) {
  const AgentTask& t = qt.task;
  const EcGroupLayout& g = t.group;
  const uint32_t k = g.data_k;
  const uint32_t m = g.parity_m;
  if (!data_plane_started_) return absl::UnavailableError("this agent has no data plane");
  if (k == 0 || m == 0 || k > 32 || m > 8) return absl::InvalidArgumentError("bad EC group in task");
  std::map<std::string, const NodeBlob*> blobs;
  for (const NodeBlob& b : t.blobs) blobs[b.node_id] = &b;
  std::map<std::string, PeerEndpoint> members;
  for (const PeerEndpoint& e : t.members) members[e.node_id] = e;
  auto seg_len = [&](const std::string& node, uint32_t idx) -> uint64_t {
    auto it = blobs.find(node);
    return it == blobs.end() ? 0 : SegmentLength(it->second->size_bytes, k, idx);
  };
  if (!qt.sends_done) {
    // This node's data segments go to their stripes' parity holders.
    std::vector<ShardId> pinned;
    uint64_t blob = 0;
    ConstPieces pieces;
    {
      absl::MutexLock lock(&mu_);
      for (auto it = holdings_.lower_bound(ShardId{t.job_id, t.step, 0});
           it != holdings_.end() && it->first.job_id == t.job_id && it->first.step == t.step; ++it) {
        if (it->second.rec.role == 1 && !it->second.verified && !it->second.corrupt) {
          *finished = false;  // wait for the verifier
          return absl::OkStatus();
        }
      }
      absl::StatusOr<ConstPieces> p = BlobPiecesLocked(t.job_id, t.step, &pinned, &blob);
      if (!p.ok()) {
        UnpinAllLocked(pinned);
        return p.status();
      }
      pieces = *std::move(p);
    }
    const NodeBlob* mine = blobs.count(options_.node_id) ? blobs[options_.node_id] : nullptr;
    absl::Status st;
    if ((mine == nullptr ? 0 : mine->size_bytes) != blob) {
      st = absl::FailedPreconditionError(absl::StrCat("this node's blob is ", blob, " bytes, the layout says ",
                                                      mine == nullptr ? 0 : mine->size_bytes));
    }
    // Each stripe carrying one of this node's segments is pushed to its
    // parity holders in one fan-out; the stripes go out concurrently.
    absl::Mutex fail_mu;
    std::vector<std::string> failures;
    std::atomic<uint64_t> sent{0};
    auto push_stripe = [&](const EcStripeLayout& s, uint32_t d) {
      uint64_t stripe_bytes = 0;
      uint64_t mask = 0;
      for (uint32_t e = 0; e < k && e < s.data_node_ids.size(); ++e) {
        const uint64_t l = seg_len(s.data_node_ids[e], s.data_segment_indices[e]);
        stripe_bytes = std::max(stripe_bytes, l);
        if (l > 0) mask |= uint64_t{1} << e;
      }
      const uint32_t idx = s.data_segment_indices[d];
      const uint64_t len = seg_len(options_.node_id, idx);
      const SegmentId sid{t.job_id, t.step, g.group_index, s.stripe_index, d};
      const uint64_t seg_bytes = (blob + k - 1) / k;
      ConstPieces seg = transport::SlicePieces(pieces, static_cast<uint64_t>(idx) * seg_bytes, len);
      const uint32_t crc = PiecesCrc(seg);
      std::vector<PeerEndpoint> targets;
      std::vector<uint32_t> positions;
      for (uint32_t p = 0; p < s.parity_node_ids.size(); ++p) {
        auto e = members.find(s.parity_node_ids[p]);
        if (e == members.end()) {
          absl::MutexLock lock(&fail_mu);
          failures.push_back(absl::StrCat("parity node \"", s.parity_node_ids[p], "\" has no endpoint"));
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
      b.stripe = s.stripe_index;
      b.data_position = d;
      b.data_k = k;
      b.parity_m = m;
      b.stripe_bytes = stripe_bytes;
      b.expect_mask = mask;
      const std::vector<absl::Status> r =
          Push(targets, b, "", seg, [&](size_t i, PutBegin& pb) { pb.parity_position = positions[i]; });
      for (size_t i = 0; i < r.size(); ++i) {
        if (r[i].ok()) {
          sent += len;
          continue;
        }
        absl::MutexLock lock(&fail_mu);
        failures.push_back(
            absl::StrCat("stripe ", s.stripe_index, " to node \"", targets[i].node_id, "\": ", r[i].message()));
      }
      absl::MutexLock lock(&mu_);
      owned_segments_[sid] = OwnedSegment{len, crc, k, idx};
      QueueSegmentReportLocked(sid, kSegmentData, kCopyValid, len, crc, t.id, "");
    };
    std::vector<std::thread> pushers;
    for (const EcStripeLayout& s : g.stripes) {
      if (!st.ok()) break;
      for (uint32_t d = 0; d < k && d < s.data_node_ids.size(); ++d) {
        if (s.data_node_ids[d] != options_.node_id) continue;
        if (seg_len(options_.node_id, s.data_segment_indices[d]) == 0) continue;  // meta knows it is empty
        pushers.emplace_back(push_stripe, std::cref(s), d);
      }
    }
    for (std::thread& th : pushers) th.join();
    qt.bytes_done += sent.load();
    {
      absl::MutexLock lock(&mu_);
      UnpinAllLocked(pinned);
    }
    if (!st.ok()) return st;
    if (!failures.empty()) return absl::UnavailableError(absl::StrJoin(failures, "; "));
    qt.sends_done = true;
    qt.deadline = clock_->MonotonicNow() + absl::Milliseconds(options_.peer_timeout_ms) * 4;
  }
  // Then wait (without blocking the task loop) for this node's parity.
  absl::MutexLock lock(&mu_);
  std::vector<std::string> waiting;
  for (const EcStripeLayout& s : g.stripes) {
    for (uint32_t p = 0; p < s.parity_node_ids.size(); ++p) {
      if (s.parity_node_ids[p] != options_.node_id) continue;
      uint64_t stripe_bytes = 0;
      for (uint32_t d = 0; d < k && d < s.data_node_ids.size(); ++d) {
        stripe_bytes = std::max(stripe_bytes, seg_len(s.data_node_ids[d], s.data_segment_indices[d]));
      }
      if (stripe_bytes == 0) continue;
      const SegmentId sid{t.job_id, t.step, g.group_index, s.stripe_index, k + p};
      if (segments_.count(sid)) continue;
      auto pb = parity_builds_.find(sid);
      if (pb != parity_builds_.end() && !pb->second.error.ok()) {
        const absl::Status e = pb->second.error;
        arena_->Free(pb->second.rec.extents);
        parity_builds_.erase(pb);
        return e;
      }
      waiting.push_back(SegmentIdString(sid));
    }
  }
  if (waiting.empty()) {
    for (auto it = parity_builds_.begin(); it != parity_builds_.end();) {
      it = it->second.finished && it->first.job_id == t.job_id && it->first.step == t.step
               ? parity_builds_.erase(it)
               : std::next(it);
    }
    return absl::OkStatus();
  }
  if (clock_->MonotonicNow() > qt.deadline) {
    return absl::DeadlineExceededError(absl::StrCat("parity never completed: ", absl::StrJoin(waiting, ", ")));
  }
  *finished = false;
  return absl::OkStatus();
}

absl::Status Agent::RunRebuild(QueuedTask& qt) {
  const AgentTask& t = qt.task;
  if (!data_plane_started_) return absl::UnavailableError("this agent has no data plane");
  std::vector<std::string> failures;
  for (const SegmentRebuild& r : t.rebuilds) {
    {
      absl::MutexLock lock(&mu_);
      if (auto it = segments_.find(r.target); it != segments_.end() && !it->second.corrupt) continue;
    }
    std::vector<Extent> extents;
    {
      absl::MutexLock lock(&mu_);
      absl::StatusOr<std::vector<Extent>> e = arena_->Allocate(std::max<uint64_t>(r.length_bytes, 1));
      if (!e.ok()) {
        failures.push_back(absl::StrCat(SegmentIdString(r.target), ": ", BudgetMessageLocked(r.length_bytes)));
        continue;
      }
      extents = *std::move(e);
    }
    absl::Status s = DecodeRange(r.sources, t.data_k, t.parity_m, r.stripe_length_bytes, r.target.position, 0,
                                 MutablePiecesOf(extents, 0, r.length_bytes));
    const uint32_t crc = s.ok() ? arena_->Checksum(extents, r.length_bytes) : 0;
    if (s.ok() && r.expected_crc32c != 0 && crc != r.expected_crc32c) {
      s = absl::DataLossError(absl::StrFormat("rebuilt %s has crc32c 0x%08x, expected 0x%08x",
                                              SegmentIdString(r.target), crc, r.expected_crc32c));
    }
    {
      absl::MutexLock lock(&mu_);
      if (!s.ok()) {
        arena_->Free(extents);
      } else {
        ShardRecord rec;
        rec.id = ShardId{t.job_id, t.step, 0};
        rec.segment = r.target;
        rec.segment_kind = r.kind;
        rec.size_bytes = r.length_bytes;
        rec.crc32c = crc;
        rec.extents = std::move(extents);
        rec.staged_unix_ms = clock_->NowUnixMillis();
        s = StoreSegmentLocked(std::move(rec), t.id);
        if (s.ok()) {
          qt.bytes_done += r.length_bytes;
          m_segments_rebuilt_->Increment();
          log::Info("rebuilt segment {} ({} bytes)", SegmentIdString(r.target), r.length_bytes);
        }
      }
    }
    if (!s.ok()) failures.push_back(absl::StrCat(SegmentIdString(r.target), ": ", s.message()));
  }
  if (!failures.empty()) return absl::UnavailableError(absl::StrJoin(failures, "; "));
  return absl::OkStatus();
}

}  // namespace ckpt::agent
