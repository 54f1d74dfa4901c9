// The data plane is authenticated by default (issue 34 finding 7): ckpt-meta
// served with mutual TLS (as the tests' daemons are, and as shipped) keeps a
// data-plane key in its data directory and hands it to the agents it
// admits; agents started with no --token-file replicate with each other,
// and a process that reaches an agent's data port without the key is
// refused, without harming the agent. Real daemons on 127.0.0.1.
#include <sys/stat.h>

#include <atomic>
#include <fstream>
#include <list>
#include <optional>
#include <span>
#include <sstream>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "integration/cluster_fixture.h"
#include "server/agent/peer_wire.h"
#include "support/pki.h"
#include "support/sockets.h"
#include "transport/ucx/handshake.h"
#include "transport/ucx/node_identity.h"
#include "transport/ucx/ucx_transport.h"

namespace ckpt {
namespace {

using testing::kLong;
using DataPlaneAuthTest = testing::ClusterTest;

std::string ReadWhole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Node `id`'s credentials from the test CA (the same files its agent uses).
std::shared_ptr<const transport::NodeCredentials> NodeCreds(const std::string& id) {
  const testing::TlsFilePaths f = testing::TestPki::Shared().Node(id);
  absl::StatusOr<std::shared_ptr<const transport::NodeCredentials>> c =
      transport::NodeCredentials::FromPem(ReadWhole(f.ca), ReadWhole(f.cert), ReadWhole(f.key));
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : nullptr;
}

// A recording handler for the stranger's transport: nothing may arrive.
class Nothing : public transport::Handler {
 public:
  absl::StatusOr<transport::MutablePieces> Allocate(const transport::Inbound&) override {
    ++calls;
    return absl::UnavailableError("no");
  }
  void OnReceived(const transport::Inbound&, const absl::Status&) override { ++calls; }
  void OnPeerFailed(transport::PeerId, const absl::Status&) override {}
  std::atomic<int> calls{0};
};

TEST_F(DataPlaneAuthTest, AgentsOfATlsMetaReplicateWithoutATokenAndAStrangerIsRefused) {
  StartCluster(3);
  // Meta made the key: 0600 in its data directory.
  struct stat st {};
  const std::string key_path = dir_->path() + "/meta/data-plane.key";
  ASSERT_EQ(::stat(key_path.c_str(), &st), 0) << key_path << "\n" << Logs();
  EXPECT_EQ(st.st_mode & 07777, 0600u);

  constexpr size_t kBytes = 2 << 20;
  // Ring replicas: rank r on n<r>, its copy on n<r+1> (PROTECTED).
  SaveAll("dp-auth", 1, 3, Protection::Replicate(2, Protection::Placement::kRing), kBytes);

  // A stranger on the data network: a UCX transport without the key, and
  // one with another key (and a node certificate of the cluster's CA, so
  // that the agents get as far as checking its key), cannot connect to
  // either agent.
  Nothing h1, h2;
  transport::UcxOptions none;
  none.self_check_timeout_ms = 0;
  transport::UcxOptions other = none;
  other.auth_key = std::string(32, 'x');
  other.identity = [creds = NodeCreds("stranger")] { return creds; };
  auto keyless = transport::NewUcxTransport(none);
  auto wrong = transport::NewUcxTransport(other);
  ASSERT_TRUE(keyless->Start("127.0.0.1:0", &h1).ok());
  ASSERT_TRUE(wrong->Start("127.0.0.1:0", &h2).ok());
  for (int i = 0; i < 3; ++i) {
    const std::string data = absl::StrCat("127.0.0.1:", agents_[i]->data_port());
    absl::StatusOr<transport::PeerId> p = keyless->Connect(data, 10000);
    EXPECT_FALSE(p.ok()) << "n" << i << " took a connection without the key";
    p = wrong->Connect(data, 10000);
    ASSERT_FALSE(p.ok()) << "n" << i << " took a connection with another key";
    EXPECT_EQ(p.status().code(), absl::StatusCode::kPermissionDenied) << p.status();
    // A greeting by hand, without a key: closed unanswered (no worker address).
    testing::ListeningSocket port;
    port.address = "127.0.0.1";
    port.port = agents_[i]->data_port();
    const std::string greeting = *transport::ucx_wire::EncodeGreeting(
        {transport::ucx_wire::kAddress, 7, 8, "", std::string(200, 'w')});
    absl::StatusOr<testing::GarbageResult> r = testing::SendGarbage(port, greeting, absl::Seconds(20));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->closed_by_peer);
    EXPECT_EQ(r->bytes_received, 0u) << "n" << i << " answered a greeting without the key";
  }
  keyless->Stop();
  wrong->Stop();
  EXPECT_EQ(h1.calls.load() + h2.calls.load(), 0);

  // The agents are unharmed: every rank restores through the node that
  // holds no copy of it (read from a peer's replica over the data plane),
  // byte-identical, and a new version still reaches PROTECTED.
  std::vector<ServedFrom> from =
      LoadAll("dp-auth", 1, 3, kBytes, [&](uint32_t r) { return static_cast<int>((r + 2) % 3); });
  for (ServedFrom f : from) EXPECT_EQ(f, ServedFrom::kReplica);
  SaveAll("dp-auth", 2, 3, Protection::Replicate(2, Protection::Placement::kRing), kBytes);
  EXPECT_TRUE(absl::StrContains(Logs(), "data plane: refused")) << Logs();
}

// With --data-encryption the payloads travel encrypted: versions still reach
// PROTECTED and restore byte-identical from the peer's replica.
TEST_F(DataPlaneAuthTest, EncryptedReplicasRestoreByteIdentical) {
  extra_agent_args_ = {"--data-encryption", "true"};
  StartCluster(3);
  constexpr size_t kBytes = 3 << 20;
  SaveAll("dp-enc", 1, 3, Protection::Replicate(2, Protection::Placement::kRing), kBytes);
  std::vector<ServedFrom> from =
      LoadAll("dp-enc", 1, 3, kBytes, [&](uint32_t r) { return static_cast<int>((r + 2) % 3); });
  for (ServedFrom f : from) EXPECT_EQ(f, ServedFrom::kReplica);
}

// A handler that keeps what arrives (the member's transport below).
class Keep : public transport::Handler {
 public:
  absl::StatusOr<transport::MutablePieces> Allocate(const transport::Inbound& msg) override {
    absl::MutexLock lock(&mu_);
    bufs_.emplace_back(msg.payload_bytes);
    return transport::MutablePieces{std::span<std::byte>(bufs_.back())};
  }
  void OnReceived(const transport::Inbound& msg, const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    got_.push_back({msg, status});
  }
  void OnPeerFailed(transport::PeerId, const absl::Status&) override {}
  // Waits (bounded) for a message of `type`.
  std::optional<transport::Inbound> WaitFor(uint16_t type) {
    absl::MutexLock lock(&mu_);
    auto has = [&] {
      for (const auto& g : got_) {
        if (g.first.type == type) return true;
      }
      return false;
    };
    mu_.AwaitWithTimeout(absl::Condition(&has), kLong);
    for (const auto& g : got_) {
      if (g.first.type == type) return g.first;
    }
    return std::nullopt;
  }
  // Waits (bounded) until `n` messages of `type` arrived; how many did.
  int WaitCount(uint16_t type, int n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&] { return CountLocked(type) >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&enough), kLong);
    return CountLocked(type);
  }
  int count(uint16_t type) {
    absl::MutexLock lock(&mu_);
    return CountLocked(type);
  }

 private:
  absl::Mutex mu_;
  int CountLocked(uint16_t type) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    int n = 0;
    for (const auto& g : got_) n += g.first.type == type ? 1 : 0;
    return n;
  }
  std::list<std::vector<std::byte>> bufs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<transport::Inbound, absl::Status>> got_ ABSL_GUARDED_BY(mu_);
};

// Node identities on the data plane (issue 34: "each connection
// authenticated by both nodes' identities"). A member holds the cluster's
// data-plane key and n2's certificate (say it stole them, or it is n2 gone
// rogue). It connects to n1 as n2, and n1 knows it is n2. It then asks n1
// for rank 1's shard in n0's name (with n0's real incarnation): before node
// identities the claim was all n1 went by, and it served the bytes; now the
// claim must match the certificate, and n1 refuses with nothing sent.
TEST_F(DataPlaneAuthTest, AMemberCannotSpeakForAnotherNodeOnTheDataPlane) {
  StartCluster(3);
  constexpr size_t kBytes = 1 << 20;
  SaveAll("dp-id", 1, 3, Protection::Replicate(2, Protection::Placement::kRing), kBytes);
  // The key file holds 64 hex digits (server/cmd/data_plane_key.h).
  const std::string hex = ReadWhole(dir_->path() + "/meta/data-plane.key").substr(0, 64);
  ASSERT_EQ(hex.size(), 64u);
  const std::string key = absl::HexStringToBytes(hex);
  // Meta's incarnation of a node (what a real push or read states).
  auto incarnation_of = [&](const std::string& node) -> uint64_t {
    v1::ListNodesRequest req;
    v1::ListNodesResponse resp;
    grpc::ClientContext ctx;
    if (!meta_->stub()->ListNodes(&ctx, req, &resp).ok()) return 0;
    for (const auto& n : resp.nodes()) {
      if (n.endpoint().node_id() == node) return n.endpoint().incarnation();
    }
    return 0;
  };
  const uint64_t n0_incarnation = incarnation_of("n0");
  ASSERT_NE(n0_incarnation, 0u);

  Keep h;
  transport::UcxOptions as_n2;
  as_n2.self_check_timeout_ms = 0;
  as_n2.auth_key = key;
  as_n2.identity = [creds = NodeCreds("n2")] { return creds; };
  auto member = transport::NewUcxTransport(as_n2);
  ASSERT_TRUE(member->Start("127.0.0.1:0", &h).ok());
  absl::StatusOr<transport::PeerId> to_n1 =
      member->Connect(absl::StrCat("127.0.0.1:", agents_[1]->data_port()), 10000);
  ASSERT_TRUE(to_n1.ok()) << to_n1.status() << "\n" << Logs();
  EXPECT_EQ(member->PeerIdentity(*to_n1), "ckpt://node/n1");

  agent::ReadReq req;
  req.id = 77;
  req.what = agent::ReadWhat::kShard;
  req.job_id = "dp-id";
  req.step = 1;
  req.rank = 1;  // n1's own primary
  req.offset = 0;
  req.length = kBytes;
  req.sender_node_id = "n0";
  req.sender_incarnation = n0_incarnation;
  member->Send(*to_n1, agent::kReadReq, agent::EncodeReadReq(req), {}, [](const absl::Status&) {});
  std::optional<transport::Inbound> end = h.WaitFor(agent::kReadEnd);
  ASSERT_TRUE(end.has_value()) << "no answer\n" << Logs();
  absl::StatusOr<agent::Result> result = agent::DecodeResult(end->header);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->status.code(), absl::StatusCode::kPermissionDenied) << result->status;
  EXPECT_TRUE(absl::StrContains(result->status.message(), "proved to be ckpt://node/n2")) << result->status;
  EXPECT_EQ(h.count(agent::kReadChunk), 0) << "n1 sent shard bytes to a node speaking for another";

  // In its own name, the same member is served (membership allows any
  // member to read; what it may not do is borrow another's name).
  req.id = 78;
  req.sender_node_id = "n2";
  req.sender_incarnation = incarnation_of("n2");
  ASSERT_NE(req.sender_incarnation, 0u);
  member->Send(*to_n1, agent::kReadReq, agent::EncodeReadReq(req), {}, [](const absl::Status&) {});
  EXPECT_EQ(h.WaitCount(agent::kReadEnd, 2), 2);
  EXPECT_GT(h.count(agent::kReadChunk), 0) << Logs();
  member->Stop();
  EXPECT_TRUE(absl::StrContains(Logs(), "claims to come from node \"n0\"")) << Logs();
}

}  // namespace
}  // namespace ckpt
