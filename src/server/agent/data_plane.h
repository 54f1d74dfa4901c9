// DataPlane: the agent's side of the transport: it starts the transport,
// keeps one connection per peer address, and hands every inbound message to
// the component that owns its flow: pushes and read requests to the
// PeerServer (this node as a receiver or holder), acknowledgements and read
// data to the PeerClient (this node as a sender or reader). Protocol in
// peer_wire.h and docs/protocol.md "Data plane".
//
// Threads: the Handler callbacks run on the transport's thread and go
// straight to the owning component, which must not block in them. PeerFor
// may block (it connects) and must not be called from a callback.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/agent/meta_link.h"
#include "transport/transport.h"

namespace ckpt::agent {

// The receiving half of a component's flows (see PeerServer, PeerClient).
class PeerFlows {
 public:
  virtual ~PeerFlows() = default;
  virtual absl::StatusOr<transport::MutablePieces> Allocate(const transport::Inbound& msg) = 0;
  virtual void OnReceived(const transport::Inbound& msg, const absl::Status& status) = 0;
  virtual void OnPeerFailed(transport::PeerId peer, const absl::Status& why) = 0;
};

class DataPlane : public transport::Handler {
 public:
  // `transport` may be null (no data plane: every peer call is Unavailable).
  // `require_identity`: every connection must have proven which node it is
  // (transport::Transport::PeerIdentity; UCX with node certificates): PeerFor
  // refuses a peer that is not the node it was asked for, and CheckSender a
  // message that claims another node than its connection proved.
  DataPlane(transport::Transport* transport, Clock* clock, int64_t connect_timeout_ms,
            bool require_identity = false);

  // Routes flows; both must be set before Start and outlive the DataPlane's
  // transport.
  void SetFlows(PeerFlows* server, PeerFlows* client);
  // Starts listening and registers the pool. A registration failure is only
  // logged (transfers then copy).
  absl::Status Start(const std::string& listen_address, void* pool, size_t pool_bytes);
  // Stops the transport: sends in flight complete with Cancelled and no
  // callback runs after this returns. Idempotent.
  void Stop();

  bool started() const { return started_; }
  std::string address() const;
  transport::Transport* transport() const { return transport_; }

  // The connection to a peer (connecting if needed). Unavailable naming the
  // node when it cannot be reached; a node that just refused is not retried
  // for 2 s (a decode would otherwise try a dead holder once per slice).
  // `connect_timeout_ms` (0: the plane's own) bounds a new connection's
  // set-up: a caller with other sources to try (a decode's survivors) gives
  // up on a silent peer early; the failure is remembered for 2 s like any.
  // With require_identity, a connection whose peer proved another node
  // (another agent now at that address, or one that took it over) is closed
  // and PermissionDenied names both; one that proved none, Unavailable.
  absl::StatusOr<transport::PeerId> PeerFor(const PeerEndpoint& ep, int64_t connect_timeout_ms = 0);
  // OK if a message on connection `from` may speak for node `node_id`: always
  // without require_identity; with it, iff the connection proved to be that
  // node (PermissionDenied naming both otherwise). Any thread, callbacks
  // included.
  absl::Status CheckSender(transport::PeerId from, const std::string& node_id) const;
  // Sends a control message (header only or with a small payload whose
  // memory the caller keeps until done); failures are logged at debug level
  // (the protocol's timeouts and acknowledgements handle them).
  void Send(transport::PeerId peer, uint16_t type, std::string header, transport::ConstPieces payload = {});

  // transport::Handler
  absl::StatusOr<transport::MutablePieces> Allocate(const transport::Inbound& msg) override;
  void OnReceived(const transport::Inbound& msg, const absl::Status& status) override;
  void OnPeerFailed(transport::PeerId peer, const absl::Status& why) override;

 private:
  PeerFlows* FlowsFor(uint16_t type) const;
  // PeerFor without the identity check.
  absl::StatusOr<transport::PeerId> ConnectionTo(const PeerEndpoint& ep, int64_t connect_timeout_ms);

  transport::Transport* const transport_;
  Clock* const clock_;
  const int64_t connect_timeout_ms_;
  const bool require_identity_;
  PeerFlows* server_ = nullptr;
  PeerFlows* client_ = nullptr;
  bool started_ = false;

  absl::Mutex mu_;
  std::map<std::string, transport::PeerId> peer_by_address_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::pair<absl::Time, absl::Status>> failed_connects_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::agent
