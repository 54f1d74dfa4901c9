// FaultTransport: a Transport decorator that injects faults into sends.
//
// Wraps any Transport (loopback in unit tests, UCX in fault tests) so callers
// such as SendChunked or the agent's replication see realistic failures
// without a real network fault. A plan of one-shot rules matches the Nth send
// (counted from 1, over all sends or only those of one message type):
//   FailNthSend     the send completes with Unavailable; nothing is delivered.
//   StallNthSend    the send is held until Release(); then it goes through.
//   CorruptNthSend  the payload is copied to a private buffer, one byte of it
//                   flipped, and the copy is sent (the caller's memory is
//                   untouched).
// DropPeer(p) disconnects p in the inner transport; later sends to p fail
// with Unavailable and messages still arriving from p are ignored.
// On the receiving side, StallNthReceive holds the Nth received payload as if
// the transport were still writing it (rendezvous/RDMA data that lands late):
// the application's Allocate runs, the bytes wait in a private buffer, and
// they are written into the application's pieces, followed by OnReceived,
// only on ReleaseReceives() (from the calling thread).
//
// Completions the decorator produces itself (failed sends) run on its own
// completion thread, never inline, so callers keep transport.h's "done runs
// later" contract. Counting happens in Send's caller, in call order.
//
// Thread safety: every method may be called from any thread. The inner
// transport must outlive the decorator unless it is owned by it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "transport/transport.h"

namespace ckpt::transport {

class FaultTransport : public Transport {
 public:
  explicit FaultTransport(Transport* inner);
  explicit FaultTransport(std::unique_ptr<Transport> inner);
  ~FaultTransport() override;

  // One-shot rules. `type` restricts counting to sends of that message type.
  void FailNthSend(int n, std::optional<uint16_t> type = std::nullopt);
  void StallNthSend(int n, std::optional<uint16_t> type = std::nullopt);
  // Flips all bits of the payload byte at `offset` (modulo the payload size).
  // A send without payload is passed through unchanged.
  void CorruptNthSend(int n, uint64_t offset = 0, std::optional<uint16_t> type = std::nullopt);
  // Disconnects `peer` in the inner transport and blackholes it from now on.
  void DropPeer(PeerId peer);
  // Lets every stalled send through (in the order they were stalled).
  void Release();
  // Receive-side stall of the Nth payload received (of `type` if given).
  void StallNthReceive(int n, std::optional<uint16_t> type = std::nullopt);
  // Lands every stalled receive now (copies into the application's pieces,
  // then calls its OnReceived), in the order they were stalled.
  void ReleaseReceives();
  int stalled_receives() const;

  // Sends seen so far (all types, or of one type), and sends currently stalled.
  // Count by type where other traffic may still be going out (a read served
  // on another thread), so a rule fires on the message the test means.
  int sends() const;
  int sends(uint16_t type) const;
  int stalled() const;

  absl::Status Start(const std::string& listen_address, Handler* handler) override;
  std::string address() const override;
  absl::StatusOr<PeerId> Connect(const std::string& address, int64_t timeout_ms) override;
  void Send(PeerId peer, uint16_t type, std::string header, ConstPieces payload,
            SendDone done) override;
  void Disconnect(PeerId peer) override;
  absl::Status RegisterMemory(void* base, size_t length) override;
  std::string PeerIdentity(PeerId peer) const override;
  // Stops the inner transport (whether owned or not), then completes stalled
  // sends with Cancelled and joins the completion thread.
  void Stop() override;

 private:
  struct State;
  std::unique_ptr<Transport> owned_;
  Transport* inner_;
  std::unique_ptr<State> state_;
};

}  // namespace ckpt::transport
