#include "server/agent/data_plane.h"

#include "absl/strings/str_cat.h"
#include "common/lock_check.h"
#include "common/log.h"
#include "common/pki.h"
#include "common/status_macros.h"
#include "server/agent/peer_wire.h"

namespace ckpt::agent {

using transport::PeerId;

DataPlane::DataPlane(transport::Transport* transport, Clock* clock, int64_t connect_timeout_ms,
                     bool require_identity)
    : transport_(transport),
      clock_(clock),
      connect_timeout_ms_(connect_timeout_ms),
      require_identity_(require_identity) {}

void DataPlane::SetFlows(PeerFlows* server, PeerFlows* client) {
  server_ = server;
  client_ = client;
}

absl::Status DataPlane::Start(const std::string& listen_address, void* pool, size_t pool_bytes) {
  if (transport_ == nullptr) return absl::OkStatus();
  CKPT_RETURN_IF_ERROR(transport_->Start(listen_address, this));
  if (absl::Status s = transport_->RegisterMemory(pool, pool_bytes); !s.ok()) {
    log::Warn("data plane: cannot register the memory tier ({}); transfers will copy", s.ToString());
  }
  started_ = true;
  log::Info("data plane listening on {}", transport_->address());
  return absl::OkStatus();
}

void DataPlane::Stop() {
  if (started_) transport_->Stop();
}

std::string DataPlane::address() const { return started_ ? transport_->address() : std::string(); }

absl::StatusOr<PeerId> DataPlane::PeerFor(const PeerEndpoint& ep, int64_t connect_timeout_ms) {
  CKPT_ASSIGN_OR_RETURN(PeerId peer, ConnectionTo(ep, connect_timeout_ms));
  if (!require_identity_) return peer;
  const std::string got = transport_->PeerIdentity(peer);
  const std::string want = pki::NodeUri(ep.node_id);
  if (got == want) return peer;
  const absl::Status why =
      got.empty() ? absl::UnavailableError(absl::StrCat("the connection to node \"", ep.node_id, "\" at ",
                                                        ep.data_address, " is gone"))
                  : absl::PermissionDeniedError(absl::StrCat(
                        "the agent at ", ep.data_address, " proved to be ", got, ", not ", want,
                        " (meta lists node \"", ep.node_id, "\" there): nothing was sent to it"));
  if (!got.empty()) log::Warn("data plane: {}", std::string(why.message()));
  {
    // Not remembered as a failed connect: a caller asking for the node that
    // is there now must get it.
    CheckedLock lock(&mu_);
    auto it = peer_by_address_.find(ep.data_address);
    if (it != peer_by_address_.end() && it->second == peer) peer_by_address_.erase(it);
  }
  transport_->Disconnect(peer);
  return why;
}

absl::Status DataPlane::CheckSender(PeerId from, const std::string& node_id) const {
  if (!require_identity_) return absl::OkStatus();
  const std::string got = transport_ != nullptr ? transport_->PeerIdentity(from) : std::string();
  if (got == pki::NodeUri(node_id)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat("the message claims to come from node \"", node_id,
                                                  "\" but its connection proved to be ",
                                                  got.empty() ? "no node" : got));
}

absl::StatusOr<PeerId> DataPlane::ConnectionTo(const PeerEndpoint& ep, int64_t connect_timeout_ms) {
  AssertNoCheckedLock("a data-plane connect");
  if (!started_) return absl::UnavailableError("this agent has no data plane");
  if (ep.data_address.empty()) {
    return absl::UnavailableError(absl::StrCat("node \"", ep.node_id, "\" has no data-plane address"));
  }
  {
    CheckedLock lock(&mu_);
    auto it = peer_by_address_.find(ep.data_address);
    if (it != peer_by_address_.end()) return it->second;
    auto f = failed_connects_.find(ep.data_address);
    if (f != failed_connects_.end() && clock_->MonotonicNow() - f->second.first < absl::Seconds(2)) {
      return f->second.second;
    }
  }
  absl::StatusOr<PeerId> p =
      transport_->Connect(ep.data_address, connect_timeout_ms > 0 ? connect_timeout_ms : connect_timeout_ms_);
  if (!p.ok()) {
    const absl::Status why = absl::UnavailableError(absl::StrCat("cannot reach node \"", ep.node_id, "\" at ",
                                                                 ep.data_address, ": ", p.status().message()));
    CheckedLock lock(&mu_);
    failed_connects_[ep.data_address] = {clock_->MonotonicNow(), why};
    return why;
  }
  PeerId extra = 0;
  PeerId keep = *p;
  {
    CheckedLock lock(&mu_);
    failed_connects_.erase(ep.data_address);
    auto [it, added] = peer_by_address_.emplace(ep.data_address, *p);
    if (!added) {
      // Another thread connected meanwhile; keep one connection.
      extra = *p;
      keep = it->second;
    }
  }
  if (extra != 0) transport_->Disconnect(extra);
  return keep;
}

void DataPlane::Send(PeerId peer, uint16_t type, std::string header, transport::ConstPieces payload) {
  AssertNoCheckedLock("a data-plane send");
  transport_->Send(peer, type, std::move(header), std::move(payload), [type](const absl::Status& s) {
    if (!s.ok()) log::Debug("data plane: message {} not sent: {}", type, s.ToString());
  });
}

PeerFlows* DataPlane::FlowsFor(uint16_t type) const {
  switch (type) {
    case kPutBegin:
    case kPutChunk:
    case kPutAbort:
    case kReadReq:
      return server_;
    case kPutAck:
    case kPutDone:
    case kReadChunk:
    case kReadEnd:
      return client_;
    default:
      return nullptr;
  }
}

absl::StatusOr<transport::MutablePieces> DataPlane::Allocate(const transport::Inbound& msg) {
  PeerFlows* f = FlowsFor(msg.type);
  if (f == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown message type ", msg.type));
  return f->Allocate(msg);
}

void DataPlane::OnReceived(const transport::Inbound& msg, const absl::Status& status) {
  PeerFlows* f = FlowsFor(msg.type);
  if (f == nullptr) {
    log::Warn("data plane: unknown message type {} from peer {}", msg.type, msg.from);
    return;
  }
  f->OnReceived(msg, status);
}

void DataPlane::OnPeerFailed(PeerId peer, const absl::Status& why) {
  {
    CheckedLock lock(&mu_);
    for (auto it = peer_by_address_.begin(); it != peer_by_address_.end();) {
      it = it->second == peer ? peer_by_address_.erase(it) : std::next(it);
    }
  }
  if (server_ != nullptr) server_->OnPeerFailed(peer, why);
  if (client_ != nullptr) client_->OnPeerFailed(peer, why);
}

}  // namespace ckpt::agent
