// PeerNode: one node's data plane built from the agent's components alone
// (no Agent): a MemoryTier, a FakeMeta behind a MetaSession, a loopback
// transport (optionally behind a FaultTransport), the DataPlane, a
// ParityBuilder, the PeerServer (serves reads of what the tier holds, takes
// pushes) and the PeerClient (reads and pushes). Nodes made in one process
// reach each other by their endpoint. Time is each node's FakeClock (waits
// end when their condition holds; timeouts only when a test advances it).
//
// Thread safety: as the components; a test drives a node from its thread.
#pragma once

#include <unistd.h>

#include <memory>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "fake_meta.h"
#include "memory_tier.h"
#include "server/agent/data_plane.h"
#include "server/agent/meta_session.h"
#include "server/agent/parity_builder.h"
#include "server/agent/peer_client.h"
#include "server/agent/peer_server.h"
#include "transport/fault/fault_transport.h"
#include "transport/loopback/loopback_transport.h"

namespace ckpt::agent {

class PeerNode {
 public:
  struct Options {
    bool faulty = false;               // the transport is a FaultTransport
    int64_t peer_timeout_ms = 20000;   // on the node's FakeClock
    uint64_t chunk_bytes = 1000;       // several chunks per transfer, unaligned
    uint64_t capacity_bytes = 256 * kArenaPageBytes;
    // Runs the session's control rounds on a thread whenever something is
    // queued, as the agent's control thread does: a receiver of replica
    // pushes acknowledges only once meta answered its report. The thread
    // waits on the node's FakeClock (it counts as one of its waiters).
    bool run_session = false;
  };

  PeerNode(std::string node_id, Options o)
      : id_(std::move(node_id)),
        tier_(o.capacity_bytes),
        session_(&meta_, &tier_.clock(), &tier_.metrics(), SessionOptions(id_), &delegate_) {
    transport_ = transport::NewLoopbackTransport();
    if (o.faulty) {
      auto f = std::make_unique<transport::FaultTransport>(std::move(transport_));
      fault_ = f.get();
      transport_ = std::move(f);
    }
    plane_ = std::make_unique<DataPlane>(transport_.get(), &tier_.clock(), 5000);
    parity_ = std::make_unique<ParityBuilder>(&tier_.arena(), &tier_.holdings(), &tier_.clock(), &tier_.metrics(),
                                              absl::Minutes(5));
    transport::BulkOptions bulk;
    bulk.chunk_bytes = o.chunk_bytes;
    bulk.max_in_flight = 2;
    client_ = std::make_unique<PeerClient>(plane_.get(), &tier_.clock(), &tier_.metrics(),
                                           PeerClient::Options{o.peer_timeout_ms, bulk, id_, [] { return uint64_t{1}; }});
    PeerServer::Deps sd{plane_.get(), &tier_.holdings(), parity_.get(), &session_, &tier_.arena(), &tier_.clock(),
                        &tier_.metrics(), [] { return uint64_t{1}; },
                        [](uint64_t bytes) { return absl::StrCat("no room for ", bytes, " bytes"); }};
    PeerServer::Options po;
    po.node_id = id_;
    po.peer_timeout_ms = o.peer_timeout_ms;
    po.bulk = bulk;
    server_ = std::make_unique<PeerServer>(sd, po);
    plane_->SetFlows(server_.get(), client_.get());
    static int counter = 0;
    absl::Status s = plane_->Start(absl::StrCat("loop:peer-node-", ::getpid(), "-", counter++), tier_.arena().Data(0),
                                   tier_.arena().capacity_bytes());
    EXPECT_TRUE(s.ok()) << s;
    endpoint_ = PeerEndpoint{id_, 1, plane_->address(), false};
    if (o.run_session) {
      control_ = std::thread([this] {
        while (true) {
          session_.ControlOnce();
          {
            absl::MutexLock lock(&control_mu_);
            if (control_stop_) return;
          }
          session_.AwaitWork(absl::Hours(1));
        }
      });
    }
  }
  ~PeerNode() { Stop(); }

  // As a dead process: peers see it fail; its waits end.
  void Stop() {
    if (stopped_) return;
    stopped_ = true;
    client_->Stop();
    plane_->Stop();
    server_->Stop();
    {
      absl::MutexLock lock(&control_mu_);
      control_stop_ = true;
    }
    session_.Stop();  // ends the control thread's wait
    if (control_.joinable()) control_.join();
  }

  static MetaSession::Options SessionOptions(const std::string& id) {
    MetaSession::Options o;
    o.node_id = id;
    return o;
  }

  const std::string& id() const { return id_; }
  const PeerEndpoint& endpoint() const { return endpoint_; }
  MemoryTier& tier() { return tier_; }
  HoldingTable& holdings() { return tier_.holdings(); }
  FakeMeta& meta() { return meta_; }
  MetaSession& session() { return session_; }
  DataPlane& plane() { return *plane_; }
  PeerClient& client() { return *client_; }
  PeerServer& server() { return *server_; }
  ParityBuilder& parity() { return *parity_; }
  transport::FaultTransport* fault() { return fault_; }

 private:
  const std::string id_;
  MemoryTier tier_;
  FakeMeta meta_;
  NoDelegate delegate_;
  MetaSession session_;
  std::unique_ptr<transport::Transport> transport_;
  transport::FaultTransport* fault_ = nullptr;
  std::unique_ptr<DataPlane> plane_;
  std::unique_ptr<ParityBuilder> parity_;
  std::unique_ptr<PeerClient> client_;
  std::unique_ptr<PeerServer> server_;
  PeerEndpoint endpoint_;
  bool stopped_ = false;
  absl::Mutex control_mu_;
  bool control_stop_ ABSL_GUARDED_BY(control_mu_) = false;
  std::thread control_;
};

}  // namespace ckpt::agent
