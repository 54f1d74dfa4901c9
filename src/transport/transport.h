// Transport: the peer data plane between agents (docs/architecture.md "Transport").
//
// A Transport moves messages between processes. A message is a small typed
// header (application bytes, at most kMaxHeaderBytes) plus an optional bulk
// payload. The sender gathers the payload from memory it owns (a list of
// pieces, e.g. the extents of a shard in the arena); the receiver decides,
// when the header arrives, where the payload lands (Handler::Allocate returns
// a scatter list, e.g. freshly allocated arena extents or a reusable chunk
// buffer), so no transfer ever needs a second copy of the whole blob.
//
// Implementations:
//   ucx/       UCX active messages with rendezvous: zero-copy RDMA over
//              rdma-core on InfiniBand/RoCE, TCP or shared memory elsewhere
//              (UCX_TLS passes through). One worker and one progress thread.
//   loopback/  in-process, for unit tests (addresses "loop:<name>").
//   fault/     a decorator that fails, stalls or corrupts the Nth send and
//              drops peers, without touching callers.
// Large transfers are cut into chunks and pipelined by transport/bulk.h.
//
// Threading: every method may be called from any thread, except that Connect
// must not be called from a Handler callback (it blocks on the progress
// thread). Handler callbacks and send completions run on the transport's own
// thread, one at a time; they must not block (a callback may call Send).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt::transport {

// A connection to one peer process. Ids are never reused within a Transport;
// 0 is never a valid id.
using PeerId = uint64_t;

inline constexpr size_t kMaxHeaderBytes = 4096;

using ConstPieces = std::vector<std::span<const std::byte>>;
using MutablePieces = std::vector<std::span<std::byte>>;

uint64_t TotalBytes(const ConstPieces& pieces);
uint64_t TotalBytes(const MutablePieces& pieces);

// A message as the receiver sees it.
struct Inbound {
  PeerId from = 0;          // reply with Send(from, ...)
  uint16_t type = 0;        // application message type
  std::string header;       // application header bytes
  uint64_t payload_bytes = 0;
};

// The receiving side's callbacks. All run on the transport's thread.
class Handler {
 public:
  virtual ~Handler() = default;
  // Where the payload of `msg` (payload_bytes > 0) must land: pieces totalling
  // exactly payload_bytes, owned by the handler and left untouched until
  // OnReceived for this message. An error refuses the payload (it is
  // discarded and OnReceived gets the error). Not called for empty payloads.
  virtual absl::StatusOr<MutablePieces> Allocate(const Inbound& msg) = 0;
  // The message, and its payload if any, has arrived (OK), or the payload
  // could not be received (Allocate's error; Unavailable if the peer failed
  // mid-transfer, in which case the pieces hold partial bytes).
  virtual void OnReceived(const Inbound& msg, const absl::Status& status) = 0;
  // The connection to `peer` is gone (peer process died, network error,
  // Disconnect). Sends to it fail with Unavailable from now on.
  virtual void OnPeerFailed(PeerId peer, const absl::Status& why) = 0;
};

// Runs when a send's payload memory may be reused: OK once the message has
// been handed to the peer's transport (not a proof that the peer's
// application processed it: protocols acknowledge at their own level), or
// Unavailable if the peer failed first, Cancelled on Disconnect/Stop.
using SendDone = std::function<void(const absl::Status&)>;

class Transport {
 public:
  virtual ~Transport() = default;

  // Starts the transport: listens on `listen_address` ("host:port"; port 0
  // picks a free one; "loop:<name>" for loopback) and starts the progress
  // thread. `handler` must outlive the transport. InvalidArgument for a bad
  // address, Unavailable if it cannot listen (the message says why).
  virtual absl::Status Start(const std::string& listen_address, Handler* handler) = 0;

  // The address peers can Connect() to, valid after Start().
  virtual std::string address() const = 0;

  // Connects to a peer's address and returns its id. Blocks until connected
  // or failed (Unavailable, naming the address), at most `timeout_ms`.
  virtual absl::StatusOr<PeerId> Connect(const std::string& address, int64_t timeout_ms) = 0;

  // Sends a message. Never blocks: `done` runs later on the transport's
  // thread (exactly once). `payload` memory must stay valid and unchanged
  // until then. InvalidArgument (through done) for a header over
  // kMaxHeaderBytes; Unavailable for an unknown or failed peer.
  virtual void Send(PeerId peer, uint16_t type, std::string header, ConstPieces payload,
                    SendDone done) = 0;

  // Closes a connection; its sends in flight complete with Cancelled and the
  // handler's OnPeerFailed runs for it. Unknown ids are ignored.
  virtual void Disconnect(PeerId peer) = 0;

  // Registers memory that payloads are sent from or received into (e.g. the
  // arena's pool), so an RDMA-capable implementation can move it zero-copy.
  // Optional for correctness: implementations without registration return OK.
  virtual absl::Status RegisterMemory(void* base, size_t length) = 0;

  // Stops the progress thread; every send in flight completes with
  // Cancelled; no callback runs after Stop returns. Idempotent.
  virtual void Stop() = 0;

  // Who the peer of a connection proved to be when it was made: the node
  // identity of its certificate ("ckpt://node/<id>"; UCX with node
  // identities, transport/ucx/node_identity.h), or "" when the connection
  // was made without identities, or `peer` is unknown or has failed. May be
  // called from any thread, Handler callbacks included; never blocks on the
  // progress thread.
  virtual std::string PeerIdentity(PeerId peer) const {
    (void)peer;
    return {};
  }
};

}  // namespace ckpt::transport
