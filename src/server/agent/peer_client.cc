#include "server/agent/peer_client.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "common/lock_check.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace ckpt::agent {

using transport::ConstPieces;
using transport::Inbound;
using transport::MutablePieces;
using transport::PeerId;

PeerClient::PeerClient(DataPlane* plane, Clock* clock, AgentMetrics* metrics, Options options)
    : plane_(plane), clock_(clock), metrics_(metrics), options_(std::move(options)) {}

bool PeerClient::AwaitLocked(const std::function<bool()>& cond) {
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || cond(); };
  clock_->AwaitWithTimeout(&mu_, absl::Condition(&ready), absl::Milliseconds(options_.peer_timeout_ms));
  return !stopping_ && cond();
}

// ---------------------------------------------------------------------------
// Pushes

std::vector<absl::Status> PeerClient::Push(const std::vector<PeerEndpoint>& targets, PutBegin begin,
                                           const std::string& meta, const ConstPieces& source,
                                           const std::function<void(size_t, PutBegin&)>& customize) {
  std::vector<absl::Status> out(targets.size());
  std::vector<uint64_t> xfers(targets.size(), 0);
  std::vector<PeerId> peers;
  std::vector<size_t> sending;  // indexes of targets that acked
  std::vector<PeerId> peer_of(targets.size(), 0);
  const auto shared_meta = std::make_shared<const std::string>(meta);
  for (size_t i = 0; i < targets.size(); ++i) {
    absl::StatusOr<PeerId> p = plane_->PeerFor(targets[i]);
    if (!p.ok()) {
      out[i] = p.status();
      continue;
    }
    PutBegin b = begin;
    b.target_incarnation = targets[i].incarnation;
    b.sender_node_id = options_.node_id;
    b.sender_incarnation = options_.incarnation ? options_.incarnation() : 0;
    if (customize) customize(i, b);
    {
      CheckedLock lock(&mu_);
      if (stopping_) {
        out[i] = absl::CancelledError("agent is shutting down");
        continue;
      }
      b.xfer = next_id_++;
      out_puts_[b.xfer].peer = *p;
    }
    xfers[i] = b.xfer;
    peer_of[i] = *p;
    // The begin's payload must outlive its send, which may complete after
    // Push gave up on a target that stopped answering.
    plane_->transport()->Send(
        *p, kPutBegin, EncodePutBegin(b),
        {std::span<const std::byte>(reinterpret_cast<const std::byte*>(shared_meta->data()), shared_meta->size())},
        [shared_meta](const absl::Status&) {});
  }
  // Tells a target we gave up, so it frees what it reserved at once.
  auto give_up = [&](size_t i, const absl::Status& why) {
    plane_->Send(peer_of[i], kPutAbort, EncodeResult(Result{xfers[i], why}));
  };
  // Wait for the acks.
  for (size_t i = 0; i < targets.size(); ++i) {
    if (xfers[i] == 0) continue;
    const uint64_t x = xfers[i];
    absl::Status ack;
    {
      CheckedLock lock(&mu_);
      const bool acked = AwaitLocked([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return out_puts_[x].acked; });
      if (!acked) {
        ack = stopping_ ? absl::CancelledError("agent is shutting down")
                        : absl::DeadlineExceededError(absl::StrCat("node \"", targets[i].node_id,
                                                                   "\" did not acknowledge a push within ",
                                                                   options_.peer_timeout_ms, " ms"));
      } else {
        ack = out_puts_[x].ack;
      }
    }
    if (absl::IsDeadlineExceeded(ack) || absl::IsCancelled(ack)) {
      if (absl::IsDeadlineExceeded(ack)) metrics_->peer_timeouts->Increment();
      give_up(i, ack);
    }
    if (absl::IsAlreadyExists(ack)) {
      out[i] = absl::OkStatus();  // it already holds this copy
    } else if (!ack.ok()) {
      out[i] = ack;
    } else if (begin.total_bytes > 0) {
      peers.push_back(peer_of[i]);
      sending.push_back(i);
      continue;
    } else {
      continue;  // nothing to send: wait for done below
    }
    CheckedLock lock(&mu_);
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
        *plane_->transport(), peers, kPutChunk, source, options_.bulk,
        [&](const transport::ChunkInfo& c, size_t peer) {
          if (c.index != crc_index) {
            chunk_crc = Crc32cOfPieces(*c.pieces);
            crc_index = c.index;
          }
          return EncodeChunk(Chunk{ids[peer], c.offset, chunk_crc});
        },
        clock_);
    for (size_t j = 0; j < peers.size(); ++j) {
      if (results[j].ok()) {
        metrics_->peer_sent_bytes->Increment(static_cast<double>(begin.total_bytes));
        continue;
      }
      out[sending[j]] = results[j];
      give_up(sending[j], results[j]);
    }
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    if (xfers[i] == 0) continue;
    const uint64_t x = xfers[i];
    bool timed_out = false;
    {
      CheckedLock lock(&mu_);
      if (out[i].ok()) {
        const bool done = AwaitLocked([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return out_puts_[x].done; });
        if (done) {
          out[i] = out_puts_[x].result;
        } else if (stopping_) {
          out[i] = absl::CancelledError("agent is shutting down");
        } else {
          timed_out = true;
          out[i] = absl::DeadlineExceededError(absl::StrCat("node \"", targets[i].node_id,
                                                            "\" did not confirm a push within ",
                                                            options_.peer_timeout_ms, " ms"));
        }
      }
      out_puts_.erase(x);
    }
    if (timed_out) {
      metrics_->peer_timeouts->Increment();
      give_up(i, out[i]);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// Reads

absl::StatusOr<uint64_t> PeerClient::StartRead(const PeerEndpoint& ep, ReadReq req, MutablePieces dest,
                                               std::shared_ptr<void> keep_alive, int64_t connect_timeout_ms) {
  CKPT_ASSIGN_OR_RETURN(PeerId peer, plane_->PeerFor(ep, connect_timeout_ms));
  req.target_incarnation = ep.incarnation;
  req.sender_node_id = options_.node_id;
  req.sender_incarnation = options_.incarnation ? options_.incarnation() : 0;
  {
    CheckedLock lock(&mu_);
    if (stopping_) return absl::CancelledError("agent is shutting down");
    req.id = next_id_++;
    PendingRead r;
    r.peer = peer;
    r.node_id = ep.node_id;
    r.dest = std::move(dest);
    r.keep_alive = std::move(keep_alive);
    r.expected = req.length;
    r.last_progress = clock_->MonotonicNow();
    reads_[req.id] = std::move(r);
  }
  plane_->Send(peer, kReadReq, EncodeReadReq(req));
  return req.id;
}

bool PeerClient::EndedLocked(uint64_t id) const {
  auto it = reads_.find(id);
  if (it == reads_.end()) return true;
  const PendingRead& r = it->second;
  // The end message may overtake the last chunk's data; wait for both.
  return r.ended && (!r.status.ok() || r.received == r.expected);
}

absl::Time PeerClient::ExpireStalledLocked(const std::vector<uint64_t>& ids) {
  const absl::Time now = clock_->MonotonicNow();
  const absl::Duration limit = absl::Milliseconds(options_.peer_timeout_ms);
  absl::Time next = absl::InfiniteFuture();
  for (uint64_t id : ids) {
    auto it = reads_.find(id);
    if (it == reads_.end() || EndedLocked(id)) continue;
    PendingRead& r = it->second;
    if (now - r.last_progress >= limit) {
      r.ended = true;
      r.status = absl::DeadlineExceededError(absl::StrCat("node \"", r.node_id, "\" sent nothing for ",
                                                          options_.peer_timeout_ms, " ms (", r.received, " of ",
                                                          r.expected, " bytes read)"));
      metrics_->peer_timeouts->Increment();
    } else {
      next = std::min(next, r.last_progress + limit);
    }
  }
  return next;
}

uint64_t PeerClient::AwaitAny(const std::vector<uint64_t>& ids, absl::Time until) {
  CheckedLock lock(&mu_);
  while (true) {
    const absl::Time stall = ExpireStalledLocked(ids);
    for (uint64_t id : ids) {
      if (EndedLocked(id)) return id;
    }
    if (stopping_) return 0;
    const absl::Time now = clock_->MonotonicNow();
    const absl::Time wake = std::min(until, stall);
    if (now >= until) return 0;
    auto any = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (stopping_) return true;
      for (uint64_t id : ids) {
        if (EndedLocked(id)) return true;
      }
      return false;
    };
    clock_->AwaitWithTimeout(&mu_, absl::Condition(&any), wake - now);
  }
}

absl::StatusOr<uint32_t> PeerClient::FinishRead(uint64_t id) {
  PendingRead r;
  {
    CheckedLock lock(&mu_);
    while (!EndedLocked(id) && !stopping_) {
      const absl::Time stall = ExpireStalledLocked({id});
      if (EndedLocked(id)) break;
      auto ended = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || EndedLocked(id); };
      clock_->AwaitWithTimeout(&mu_, absl::Condition(&ended), stall - clock_->MonotonicNow());
    }
    auto it = reads_.find(id);
    if (it == reads_.end()) return absl::InternalError(absl::StrCat("read ", id, " is unknown"));
    r = std::move(it->second);
    reads_.erase(it);
    if (!r.ended) r.status = absl::CancelledError("agent is shutting down");
  }
  if (!r.status.ok()) {
    metrics_->peer_errors->Increment();
    return absl::Status(r.status.code(), absl::StrCat("reading from node \"", r.node_id, "\": ", r.status.message()));
  }
  CKPT_ASSIGN_OR_RETURN(uint32_t crc, Crc32cOfChunks(r.chunks, r.expected));
  if (crc != r.end_crc) {
    return absl::DataLossError(absl::StrFormat("node \"%s\" sent bytes with crc32c 0x%08x, it announced 0x%08x",
                                               r.node_id, crc, r.end_crc));
  }
  return crc;
}

void PeerClient::Abandon(uint64_t id) {
  CheckedLock lock(&mu_);
  reads_.erase(id);  // landings in flight keep the memory alive
}

void PeerClient::Cancel(uint64_t id, const absl::Status& why) {
  CheckedLock lock(&mu_);
  auto it = reads_.find(id);
  if (it == reads_.end() || it->second.ended) return;
  it->second.ended = true;
  it->second.status = why.ok() ? absl::CancelledError("read cancelled") : why;
}

std::optional<absl::Time> PeerClient::LastChunk(uint64_t id) const {
  CheckedLock lock(&mu_);
  auto it = reads_.find(id);
  if (it == reads_.end() || EndedLocked(id)) return std::nullopt;
  return it->second.last_chunk;
}

absl::StatusOr<uint32_t> PeerClient::Read(const PeerEndpoint& ep, ReadReq req, MutablePieces dest,
                                          std::shared_ptr<void> keep_alive) {
  CKPT_ASSIGN_OR_RETURN(uint64_t id, StartRead(ep, std::move(req), std::move(dest), std::move(keep_alive)));
  return FinishRead(id);
}

void PeerClient::Stop() {
  CheckedLock lock(&mu_);
  stopping_ = true;
}

size_t PeerClient::landings() const {
  CheckedLock lock(&mu_);
  return landings_.size();
}

// ---------------------------------------------------------------------------
// Transport thread

absl::StatusOr<MutablePieces> PeerClient::Allocate(const Inbound& msg) {
  if (msg.type != kReadChunk) {
    return absl::InvalidArgumentError(absl::StrCat("message type ", msg.type, " carries no payload"));
  }
  CKPT_ASSIGN_OR_RETURN(Chunk c, DecodeChunk(msg.header));
  CheckedLock lock(&mu_);
  auto it = reads_.find(c.id);
  // (Ids are unique per requester; `from` is not compared: with connections
  // both ways between two nodes a reply may name either.)
  if (it == reads_.end() || it->second.ended) {
    return absl::FailedPreconditionError(absl::StrCat("unknown read ", c.id));
  }
  PendingRead& r = it->second;
  if (c.offset > r.expected || msg.payload_bytes > r.expected - c.offset) {
    return absl::InvalidArgumentError("read chunk beyond the requested range");
  }
  auto [slot, added] = landings_.emplace(std::make_pair(c.id, c.offset), r.keep_alive);
  if (!added) return absl::InvalidArgumentError("a chunk at this offset is already landing");
  return transport::SlicePieces(r.dest, c.offset, msg.payload_bytes);
}

void PeerClient::OnReceived(const Inbound& msg, const absl::Status& status) {
  switch (msg.type) {
    case kPutAck:
      return OnAck(msg, /*done=*/false);
    case kPutDone:
      return OnAck(msg, /*done=*/true);
    case kReadChunk:
      return OnReadChunk(msg, status);
    case kReadEnd:
      return OnReadEnd(msg);
    default:
      return;
  }
}

void PeerClient::OnAck(const Inbound& msg, bool done) {
  absl::StatusOr<Result> r = DecodeResult(msg.header);
  if (!r.ok()) {
    log::Warn("data plane: bad acknowledgement from peer {}: {}", msg.from, r.status().ToString());
    return;
  }
  CheckedLock lock(&mu_);
  auto it = out_puts_.find(r->id);
  if (it == out_puts_.end()) return;
  if (done) {
    it->second.done = true;
    it->second.result = r->status;
  } else {
    it->second.acked = true;
    it->second.ack = r->status;
  }
}

void PeerClient::OnReadChunk(const Inbound& msg, const absl::Status& status) {
  absl::StatusOr<Chunk> c = DecodeChunk(msg.header);
  if (!c.ok()) return;
  std::shared_ptr<void> landed;  // keeps the bytes alive while we check them; released last
  MutablePieces where;
  {
    CheckedLock lock(&mu_);
    if (msg.payload_bytes > 0) {
      auto slot = landings_.find({c->id, c->offset});
      if (slot == landings_.end()) return;  // Allocate refused it: nothing landed
      landed = std::move(slot->second);
      landings_.erase(slot);
    }
    auto it = reads_.find(c->id);
    if (it == reads_.end() || it->second.ended) return;
    if (!status.ok()) {
      it->second.ended = true;
      it->second.status = status;
      return;
    }
    where = transport::SlicePieces(it->second.dest, c->offset, msg.payload_bytes);
  }
  // The crc runs without the lock, on memory `landed` keeps alive.
  const uint32_t crc = Crc32cOfPieces(where);
  CheckedLock lock(&mu_);
  auto it = reads_.find(c->id);
  if (it == reads_.end() || it->second.ended) return;
  PendingRead& r = it->second;
  if (crc != c->crc32c) {
    r.ended = true;
    r.status = absl::DataLossError(absl::StrFormat("chunk at offset %d: crc32c 0x%08x != sender's 0x%08x",
                                                   c->offset, crc, c->crc32c));
    return;
  }
  r.chunks[c->offset] = {crc, msg.payload_bytes};
  r.received += msg.payload_bytes;
  r.last_progress = clock_->MonotonicNow();
  r.last_chunk = r.last_progress;
  metrics_->peer_received_bytes->Increment(static_cast<double>(msg.payload_bytes));
}

void PeerClient::OnReadEnd(const Inbound& msg) {
  absl::StatusOr<Result> e = DecodeResult(msg.header);
  if (!e.ok()) return;
  CheckedLock lock(&mu_);
  auto it = reads_.find(e->id);
  if (it == reads_.end() || it->second.ended) return;
  it->second.ended = true;
  it->second.status = e->status;
  it->second.end_crc = e->crc32c;
  it->second.last_progress = clock_->MonotonicNow();
}

void PeerClient::OnPeerFailed(PeerId peer, const absl::Status& why) {
  const absl::Status lost = absl::UnavailableError(absl::StrCat("peer connection lost: ", why.message()));
  CheckedLock lock(&mu_);
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
}

}  // namespace ckpt::agent
