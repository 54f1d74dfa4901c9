// The data plane is authenticated by default (issue 34 finding 7): ckpt-meta
// served with mutual TLS (as the tests' daemons are, and as shipped) keeps a
// data-plane key in its data directory and hands it to the agents it
// admits; agents started with no --token-file replicate with each other,
// and a process that reaches an agent's data port without the key is
// refused, without harming the agent. Real daemons on 127.0.0.1.
#include <sys/stat.h>

#include <atomic>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "integration/cluster_fixture.h"
#include "support/sockets.h"
#include "transport/ucx/handshake.h"
#include "transport/ucx/ucx_transport.h"

namespace ckpt {
namespace {

using testing::kLong;
using DataPlaneAuthTest = testing::ClusterTest;

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
  // one with another key, cannot connect to either agent.
  Nothing h1, h2;
  transport::UcxOptions none;
  none.self_check_timeout_ms = 0;
  transport::UcxOptions other = none;
  other.auth_key = std::string(32, 'x');
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

}  // namespace
}  // namespace ckpt
