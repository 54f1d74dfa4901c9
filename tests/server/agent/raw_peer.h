// RawPeer: a bare loopback endpoint that speaks the agents' data-plane
// protocol (src/server/agent/peer_wire.h) by hand, for the unit tests of
// PeerServer and PeerClient: it sends exactly the messages a test writes
// (bad ones included), records every message it gets with its payload, can
// answer from a responder on the transport's thread, and dies like a process
// (Stop: its peers see OnPeerFailed).
//
// Thread safety: Send, Await*, Got and Stop from any thread; the responder
// runs on the transport's thread and must not block (it may Send).
#pragma once

#include <unistd.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/crc32c.h"
#include "server/agent/peer_wire.h"
#include "transport/loopback/loopback_transport.h"

namespace ckpt::agent {

class RawPeer : public transport::Handler {
 public:
  struct Message {
    transport::PeerId from = 0;
    uint16_t type = 0;
    std::string header;
    std::string payload;
    absl::Status status;  // as OnReceived got it
  };
  using Responder = std::function<void(RawPeer&, const Message&)>;

  // Waits for the transport's thread are bounded by this (real time).
  static constexpr absl::Duration kWait = absl::Seconds(30);

  RawPeer() : transport_(transport::NewLoopbackTransport()) {
    static int counter = 0;
    const absl::Status s = transport_->Start(absl::StrCat("loop:raw-peer-", ::getpid(), "-", counter++), this);
    EXPECT_TRUE(s.ok()) << s;
  }
  ~RawPeer() override { Stop(); }

  std::string address() const { return transport_->address(); }
  transport::PeerId Connect(const std::string& address) {
    absl::StatusOr<transport::PeerId> p = transport_->Connect(address, 5000);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : 0;
  }
  // Sends a message; the payload is kept alive until the transport is done with it.
  void Send(transport::PeerId peer, uint16_t type, std::string header, std::string payload = "") {
    auto keep = std::make_shared<const std::string>(std::move(payload));
    transport::ConstPieces pieces;
    if (!keep->empty()) pieces.push_back(std::as_bytes(std::span<const char>(keep->data(), keep->size())));
    transport_->Send(peer, type, std::move(header), std::move(pieces), [keep](const absl::Status&) {});
  }
  void set_responder(Responder r) {
    absl::MutexLock lock(&mu_);
    responder_ = std::move(r);
  }
  // As a dead process: every connected peer sees OnPeerFailed.
  void Stop() { transport_->Stop(); }

  std::vector<Message> Got() {
    absl::MutexLock lock(&mu_);
    return got_;
  }
  // Waits (bounded) for the answer of `type` ({kPutAck, kPutDone, kReadEnd})
  // to transfer or read `id`; its decoded Result, or an Internal error naming
  // what never came.
  absl::StatusOr<Result> AwaitResult(uint16_t type, uint64_t id) {
    absl::MutexLock lock(&mu_);
    const Message* found = nullptr;
    auto has = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const Message& m : got_) {
        if (m.type != type) continue;
        absl::StatusOr<Result> r = DecodeResult(m.header);
        if (r.ok() && r->id == id) {
          found = &m;
          return true;
        }
      }
      return false;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&has), kWait)) {
      return absl::InternalError(absl::StrCat("no message of type ", type, " for id ", id));
    }
    return DecodeResult(found->header);
  }
  // Waits (bounded) until `n` messages of `type` arrived; returns them.
  std::vector<Message> AwaitType(uint16_t type, size_t n) {
    absl::MutexLock lock(&mu_);
    auto of_type = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      std::vector<Message> out;
      for (const Message& m : got_) {
        if (m.type == type) out.push_back(m);
      }
      return out;
    };
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return of_type().size() >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&enough), kWait);
    return of_type();
  }
  // Waits (bounded) until a peer of ours failed.
  bool AwaitPeerFailed() {
    absl::MutexLock lock(&mu_);
    auto failed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return failed_ > 0; };
    return mu_.AwaitWithTimeout(absl::Condition(&failed), kWait);
  }

  // transport::Handler (the transport's thread)
  absl::StatusOr<transport::MutablePieces> Allocate(const transport::Inbound& msg) override {
    absl::MutexLock lock(&mu_);
    std::string& buf = landing_[std::make_tuple(msg.from, msg.type, msg.header)];
    buf.assign(msg.payload_bytes, '\0');
    return transport::MutablePieces{std::as_writable_bytes(std::span<char>(buf.data(), buf.size()))};
  }
  void OnReceived(const transport::Inbound& msg, const absl::Status& status) override {
    Message m{msg.from, msg.type, msg.header, "", status};
    Responder responder;
    {
      absl::MutexLock lock(&mu_);
      if (auto it = landing_.find(std::make_tuple(msg.from, msg.type, msg.header)); it != landing_.end()) {
        m.payload = std::move(it->second);
        landing_.erase(it);
      }
      got_.push_back(m);
      responder = responder_;
    }
    if (responder) responder(*this, m);
  }
  void OnPeerFailed(transport::PeerId, const absl::Status&) override {
    absl::MutexLock lock(&mu_);
    ++failed_;
  }

 private:
  std::unique_ptr<transport::Transport> transport_;
  absl::Mutex mu_;
  std::map<std::tuple<transport::PeerId, uint16_t, std::string>, std::string> landing_ ABSL_GUARDED_BY(mu_);
  std::vector<Message> got_ ABSL_GUARDED_BY(mu_);
  Responder responder_ ABSL_GUARDED_BY(mu_);
  int failed_ ABSL_GUARDED_BY(mu_) = 0;
};

// What a hand-played holder does with a read request.
struct HolderScript {
  std::string content = "";
  // Chunks sent (from the first); SIZE_MAX: all.
  size_t chunks = SIZE_MAX;
  bool send_end = true;
  // Applied to each chunk's payload after its crc was computed (corruption on the way).
  std::function<void(uint64_t offset, std::string&)> spoil_chunk = nullptr;
  // Applied to the end before it is sent.
  std::function<void(Result&)> spoil_end = nullptr;
  uint64_t chunk_bytes = 1000;
};

inline RawPeer::Responder Holder(HolderScript script) {
  return [script = std::move(script)](RawPeer& self, const RawPeer::Message& m) {
    if (m.type != kReadReq) return;
    absl::StatusOr<ReadReq> req = DecodeReadReq(m.header);
    ASSERT_TRUE(req.ok()) << req.status();
    const std::string bytes = script.content.substr(req->offset, req->length);
    size_t sent = 0;
    for (uint64_t off = 0; off < bytes.size() && sent < script.chunks; off += script.chunk_bytes, ++sent) {
      std::string piece = bytes.substr(off, script.chunk_bytes);
      const uint32_t crc = Crc32c(piece);
      if (script.spoil_chunk) script.spoil_chunk(off, piece);
      self.Send(m.from, kReadChunk, EncodeChunk(Chunk{req->id, off, crc}), piece);
    }
    if (!script.send_end) return;
    Result end{req->id, absl::OkStatus(), Crc32c(bytes), bytes.size()};
    if (script.spoil_end) script.spoil_end(end);
    self.Send(m.from, kReadEnd, EncodeResult(end));
  };
}

}  // namespace ckpt::agent
