// DataPlane on its own: two planes over the loopback transport, each with a
// recording PeerFlows for its server and client halves. Covers the routing of
// every message type, payloads landing where the flow said, one connection
// per peer address, unreachable peers (not retried for 2 s on the FakeClock),
// a peer's death reaching both flows, and a node without a data plane.
// Waits for the transport's thread are bounded condition waits, no sleeps.
#include "server/agent/data_plane.h"

#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "server/agent/peer_wire.h"
#include "transport/loopback/loopback_transport.h"

namespace ckpt::agent {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(30);

// Records what reaches it: "<type>:<header>[:<payload>]" per message, and
// the peers reported failed. Payloads land in buffers it owns.
class RecordingFlows : public PeerFlows {
 public:
  absl::StatusOr<transport::MutablePieces> Allocate(const transport::Inbound& msg) override {
    absl::MutexLock lock(&mu_);
    if (refuse_payloads) return absl::ResourceExhaustedError("no room");
    std::string& buf = payloads_[msg.header];
    buf.assign(msg.payload_bytes, '\0');
    return transport::MutablePieces{std::span<std::byte>(reinterpret_cast<std::byte*>(buf.data()), buf.size())};
  }
  void OnReceived(const transport::Inbound& msg, const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    std::string e = absl::StrCat(msg.type, ":", msg.header);
    if (msg.payload_bytes > 0 && status.ok()) absl::StrAppend(&e, ":", payloads_[msg.header]);
    if (!status.ok()) absl::StrAppend(&e, ":", absl::StatusCodeToString(status.code()));
    got_.push_back(e);
    from_ = msg.from;
  }
  void OnPeerFailed(transport::PeerId peer, const absl::Status&) override {
    absl::MutexLock lock(&mu_);
    failed_.push_back(peer);
  }

  // Waits (bounded) until `n` messages arrived; returns them.
  std::vector<std::string> Await(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return got_.size() >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&enough), kWait);
    return got_;
  }
  std::vector<transport::PeerId> AwaitFailed(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return failed_.size() >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&enough), kWait);
    return failed_;
  }
  std::vector<std::string> Got() {
    absl::MutexLock lock(&mu_);
    return got_;
  }
  transport::PeerId from() {
    absl::MutexLock lock(&mu_);
    return from_;
  }

  bool refuse_payloads = false;

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> payloads_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> got_ ABSL_GUARDED_BY(mu_);
  std::vector<transport::PeerId> failed_ ABSL_GUARDED_BY(mu_);
  transport::PeerId from_ ABSL_GUARDED_BY(mu_) = 0;
};

std::string NewAddress() {
  static int counter = 0;
  return absl::StrCat("loop:data-plane-test-", ::getpid(), "-", counter++);
}

// A transport whose every connection's peer proved to be `identity`, as UCX
// with node certificates reports it (the loopback proves nothing).
class Proving : public transport::Transport {
 public:
  explicit Proving(std::unique_ptr<transport::Transport> inner) : inner_(std::move(inner)) {}
  absl::Status Start(const std::string& address, transport::Handler* h) override { return inner_->Start(address, h); }
  std::string address() const override { return inner_->address(); }
  absl::StatusOr<transport::PeerId> Connect(const std::string& address, int64_t timeout_ms) override {
    return inner_->Connect(address, timeout_ms);
  }
  void Send(transport::PeerId peer, uint16_t type, std::string header, transport::ConstPieces payload,
            transport::SendDone done) override {
    inner_->Send(peer, type, std::move(header), std::move(payload), std::move(done));
  }
  void Disconnect(transport::PeerId peer) override {
    {
      absl::MutexLock lock(&mu_);
      ++disconnects_;
    }
    inner_->Disconnect(peer);
  }
  absl::Status RegisterMemory(void* base, size_t length) override { return inner_->RegisterMemory(base, length); }
  void Stop() override { inner_->Stop(); }
  std::string PeerIdentity(transport::PeerId) const override {
    absl::MutexLock lock(&mu_);
    return identity_;
  }
  void set_identity(std::string id) {
    absl::MutexLock lock(&mu_);
    identity_ = std::move(id);
  }
  int disconnects() const {
    absl::MutexLock lock(&mu_);
    return disconnects_;
  }

 private:
  std::unique_ptr<transport::Transport> inner_;
  mutable absl::Mutex mu_;
  std::string identity_ ABSL_GUARDED_BY(mu_);
  int disconnects_ ABSL_GUARDED_BY(mu_) = 0;
};

struct Side {
  explicit Side(bool require_identity = false)
      : transport(std::make_unique<Proving>(transport::NewLoopbackTransport())),
        plane(transport.get(), &clock, 1000, require_identity) {
    plane.SetFlows(&server, &client);
  }
  ~Side() { plane.Stop(); }
  absl::Status Start(const std::string& address) { return plane.Start(address, pool, sizeof(pool)); }
  PeerEndpoint Endpoint(const std::string& node) const { return PeerEndpoint{node, 1, plane.address(), false}; }

  FakeClock clock;
  std::unique_ptr<Proving> transport;
  RecordingFlows server, client;
  DataPlane plane;
  char pool[4096] = {};
};

TEST(DataPlane, RoutesEveryMessageTypeToTheFlowThatOwnsIt) {
  Side a, b;
  ASSERT_TRUE(a.Start(NewAddress()).ok());
  ASSERT_TRUE(b.Start(NewAddress()).ok());
  EXPECT_TRUE(b.plane.started());
  EXPECT_THAT(b.plane.address(), HasSubstr("loop:data-plane-test-"));
  absl::StatusOr<transport::PeerId> to_b = a.plane.PeerFor(b.Endpoint("b"));
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  const std::string chunk = "chunk bytes";
  const transport::ConstPieces payload{std::as_bytes(std::span<const char>(chunk.data(), chunk.size()))};
  // Pushes and read requests go to the receiver's server half...
  a.plane.Send(*to_b, kPutBegin, "begin");
  a.plane.Send(*to_b, kPutChunk, "chunk", payload);
  a.plane.Send(*to_b, kPutAbort, "abort");
  a.plane.Send(*to_b, kReadReq, "req");
  EXPECT_THAT(b.server.Await(4), ElementsAre("1:begin", "3:chunk:chunk bytes", "8:abort", "5:req"));
  // ...acknowledgements and read data to its client half.
  a.plane.Send(*to_b, kPutAck, "ack");
  a.plane.Send(*to_b, kPutDone, "done");
  a.plane.Send(*to_b, kReadChunk, "data", payload);
  a.plane.Send(*to_b, kReadEnd, "end");
  EXPECT_THAT(b.client.Await(4), ElementsAre("2:ack", "4:done", "6:data:chunk bytes", "7:end"));
  EXPECT_EQ(b.server.Got().size(), 4u);
  // The reply goes back on the connection the message came in on.
  a.plane.Send(*to_b, kPutBegin, "again");
  ASSERT_EQ(b.server.Await(5).size(), 5u);
  b.plane.Send(b.server.from(), kPutAck, "reply");
  EXPECT_THAT(a.client.Await(1), ElementsAre("2:reply"));
  EXPECT_TRUE(a.server.Got().empty());
}

TEST(DataPlane, AFlowThatRefusesAPayloadGetsTheError) {
  Side a, b;
  ASSERT_TRUE(a.Start(NewAddress()).ok());
  ASSERT_TRUE(b.Start(NewAddress()).ok());
  b.server.refuse_payloads = true;
  const std::string chunk = "x";
  a.plane.Send(*a.plane.PeerFor(b.Endpoint("b")), kPutChunk, "chunk",
               {std::as_bytes(std::span<const char>(chunk.data(), 1))});
  EXPECT_THAT(b.server.Await(1), ElementsAre("3:chunk:RESOURCE_EXHAUSTED"));
}

TEST(DataPlane, UnknownMessageTypesAreRefused) {
  Side a;
  ASSERT_TRUE(a.Start(NewAddress()).ok());
  transport::Inbound msg;
  msg.type = 99;
  msg.payload_bytes = 10;
  absl::StatusOr<transport::MutablePieces> p = a.plane.Allocate(msg);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("99"));
  a.plane.OnReceived(msg, absl::OkStatus());  // logged, handed to no one
  EXPECT_TRUE(a.server.Got().empty());
  EXPECT_TRUE(a.client.Got().empty());
}

TEST(DataPlane, KeepsOneConnectionPerPeerAddress) {
  Side a, b;
  ASSERT_TRUE(a.Start(NewAddress()).ok());
  ASSERT_TRUE(b.Start(NewAddress()).ok());
  absl::StatusOr<transport::PeerId> first = a.plane.PeerFor(b.Endpoint("b"));
  absl::StatusOr<transport::PeerId> second = a.plane.PeerFor(b.Endpoint("b-under-another-name"));
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(*first, *second);
}

// With node identities: a connection is used only for the node its peer
// proved to be, and a message may speak only for that node.
TEST(DataPlane, WithIdentitiesAPeerMustBeTheNodeItIsTakenFor) {
  Side a(/*require_identity=*/true), b;
  ASSERT_TRUE(a.Start(NewAddress()).ok());
  ASSERT_TRUE(b.Start(NewAddress()).ok());
  a.transport->set_identity("ckpt://node/b");
  absl::StatusOr<transport::PeerId> to_b = a.plane.PeerFor(b.Endpoint("b"));
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  // Meta lists node "c" at b's address (b took it over, or c moved): the
  // connection is dropped and nothing can be sent to "c" through it.
  absl::StatusOr<transport::PeerId> to_c = a.plane.PeerFor(b.Endpoint("c"));
  ASSERT_FALSE(to_c.ok());
  EXPECT_EQ(to_c.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(to_c.status().message()), HasSubstr("proved to be ckpt://node/b, not ckpt://node/c"));
  EXPECT_EQ(a.transport->disconnects(), 1);
  // b itself is still reachable there at once (not refused for 2 s).
  to_b = a.plane.PeerFor(b.Endpoint("b"));
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  // A peer that proved nothing (its connection failed meanwhile): Unavailable.
  a.transport->set_identity("");
  absl::StatusOr<transport::PeerId> gone = a.plane.PeerFor(b.Endpoint("b"));
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable) << gone.status();

  // Senders: a message may speak only for the node its connection proved.
  a.transport->set_identity("ckpt://node/b");
  EXPECT_TRUE(a.plane.CheckSender(*to_b, "b").ok());
  absl::Status other = a.plane.CheckSender(*to_b, "n0");
  EXPECT_EQ(other.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(other.message()), HasSubstr("claims to come from node \"n0\""));
  a.transport->set_identity("");
  EXPECT_EQ(a.plane.CheckSender(*to_b, "b").code(), absl::StatusCode::kPermissionDenied);
  // Without identities the claim is all there is (an --insecure cluster).
  EXPECT_TRUE(b.plane.CheckSender(b.server.from(), "anyone").ok());
}

TEST(DataPlane, AnUnreachablePeerIsNotAskedAgainFor2Seconds) {
  Side a;
  ASSERT_TRUE(a.Start(NewAddress()).ok());
  const std::string later = NewAddress();
  PeerEndpoint ep{"late", 1, later, false};
  absl::StatusOr<transport::PeerId> p = a.plane.PeerFor(ep);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnavailable) << p.status();
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("cannot reach node \"late\" at " + later));
  // It comes up; the refusal stands for 2 s, then it is reached.
  Side b;
  ASSERT_TRUE(b.Start(later).ok());
  a.clock.Advance(absl::Milliseconds(1999));
  EXPECT_EQ(a.plane.PeerFor(ep).status().code(), absl::StatusCode::kUnavailable);
  a.clock.Advance(absl::Milliseconds(1));
  EXPECT_TRUE(a.plane.PeerFor(ep).ok());
}

TEST(DataPlane, APeersDeathReachesBothFlowsAndDropsItsConnection) {
  Side a;
  ASSERT_TRUE(a.Start(NewAddress()).ok());
  transport::PeerId to_b = 0;
  PeerEndpoint ep;
  {
    Side b;
    ASSERT_TRUE(b.Start(NewAddress()).ok());
    ep = b.Endpoint("b");
    to_b = *a.plane.PeerFor(ep);
    b.plane.Stop();
    EXPECT_THAT(a.server.AwaitFailed(1), ElementsAre(to_b));
    EXPECT_THAT(a.client.AwaitFailed(1), ElementsAre(to_b));
  }
  // The connection is forgotten: the next PeerFor connects anew (and fails).
  EXPECT_EQ(a.plane.PeerFor(ep).status().code(), absl::StatusCode::kUnavailable);
}

TEST(DataPlane, WithoutATransportEveryPeerIsUnavailable) {
  FakeClock clock;
  DataPlane none(nullptr, &clock, 1000);
  EXPECT_TRUE(none.Start("loop:unused", nullptr, 0).ok());
  EXPECT_FALSE(none.started());
  EXPECT_EQ(none.address(), "");
  absl::StatusOr<transport::PeerId> p = none.PeerFor(PeerEndpoint{"b", 1, "loop:x", false});
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("no data plane"));
  none.Stop();
  // A started plane and a peer without an address.
  Side a;
  ASSERT_TRUE(a.Start(NewAddress()).ok());
  p = a.plane.PeerFor(PeerEndpoint{"b", 1, "", false});
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("no data-plane address"));
}

}  // namespace
}  // namespace ckpt::agent
