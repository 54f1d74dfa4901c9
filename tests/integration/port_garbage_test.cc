// Garbage on every socket the daemons listen on (issue 13 item 8): a real
// ckpt-meta and three ckpt-agents on 127.0.0.1; every listening TCP socket
// and bound unix socket each process holds (found in /proc, so UCX's own
// sockets count too) gets 16 B, 4 KiB, 64 KiB and 1 MiB of zeros and of
// seeded random bytes and a partial HTTP/2 preface, all connections to a
// process at once. Every daemon must live on and still work: a replicated
// save across the agents and a restore of each rank through a node that holds
// none of it, over the UCX data plane, byte-exact.
//
// Before the fix, the first payload on an agent's --data-listen port aborted
// it (SIGABRT in UCX 1.13's TCP connection manager, tcp_sockcm_ep.c:825).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "ckpt/client.h"
#include "ckpt/v1/meta.grpc.pb.h"
#include "integration/agent_process.h"
#include "integration/client_options.h"
#include "integration/meta_process.h"
#include "integration/node_cluster.h"
#include "support/sockets.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using testing::AgentProcess;
using testing::AgentProcessOptions;
using testing::GarbageResult;
using testing::ListeningSocket;
using testing::MetaProcess;
using testing::TempDir;

constexpr absl::Duration kLong = absl::Seconds(90);
// How long each garbage connection waits for the daemon to close it. A
// server that waits for the rest of a frame (gRPC, civetweb) keeps it open
// until then; that is fine, the point is that it survives.
constexpr absl::Duration kWaitForClose = absl::Seconds(3);

std::vector<uint8_t> RankBytes(uint32_t rank, size_t n) {
  std::mt19937_64 rng(rank * 1000003ull + 17);
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = static_cast<uint8_t>(rng());
  return v;
}

struct Hit {
  ListeningSocket target;
  std::string payload;
  absl::StatusOr<GarbageResult> result = absl::UnknownError("not run");
};

class PortGarbageTest : public testing::NodesClusterTest {
 protected:
  PortGarbageTest() : NodesClusterTest(3, "48MiB", {"--data-chunk", "1MiB"}) {}

  // Every listening socket of `pid`, checked to include `must_have`
  // ("tcp 127.0.0.1:7402", ...).
  std::vector<ListeningSocket> SocketsOf(pid_t pid, const std::vector<std::string>& must_have) {
    absl::StatusOr<std::vector<ListeningSocket>> sockets = testing::ListeningSockets(pid);
    EXPECT_TRUE(sockets.ok()) << sockets.status();
    if (!sockets.ok()) return {};
    std::vector<std::string> names;
    for (const ListeningSocket& s : *sockets) names.push_back(s.ToString());
    for (const std::string& want : must_have) {
      EXPECT_TRUE(std::find(names.begin(), names.end(), want) != names.end())
          << want << " not among " << absl::StrJoin(names, ", ");
    }
    return *sockets;
  }

  // All payloads on all of `sockets` at once; returns what each connection saw.
  std::vector<Hit> ThrowGarbage(const std::vector<ListeningSocket>& sockets, uint64_t seed) {
    std::vector<Hit> hits;
    for (const ListeningSocket& s : sockets) {
      for (testing::NamedBytes& g : testing::GarbagePayloads(seed)) {
        hits.push_back({s, std::move(g.name), absl::UnknownError("not run")});
      }
    }
    const std::vector<testing::NamedBytes> payloads = testing::GarbagePayloads(seed);
    std::vector<std::thread> threads;
    for (size_t i = 0; i < hits.size(); ++i) {
      threads.emplace_back([&hits, &payloads, i] {
        hits[i].result = testing::SendGarbage(hits[i].target, payloads[i % payloads.size()].bytes, kWaitForClose);
      });
    }
    for (std::thread& t : threads) t.join();
    for (const Hit& h : hits) {
      // A refused connection would mean a socket went away (its owner died).
      EXPECT_TRUE(h.result.ok()) << h.target.ToString() << " / " << h.payload << ": " << h.result.status();
    }
    return hits;
  }

  void ExpectAlive() {
    EXPECT_TRUE(meta_->proc()->IsRunning()) << Logs();
    for (auto& a : agents_) EXPECT_TRUE(a->proc()->IsRunning()) << a->options().node_id << "\n" << Logs();
    int code = 0;
    absl::StatusOr<std::string> body = testing::HttpGet("127.0.0.1", meta_->metrics_port(), "/metrics", &code);
    EXPECT_TRUE(body.ok() && code == 200) << body.status() << " " << code;
    for (auto& a : agents_) {
      body = testing::HttpGet("127.0.0.1", a->metrics_port(), "/metrics", &code);
      EXPECT_TRUE(body.ok() && code == 200) << body.status() << " " << code;
      v1::AgentStatusResponse st;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      const grpc::Status s = a->stub()->AgentStatus(&ctx, {}, &st);
      EXPECT_TRUE(s.ok() && st.registered()) << s.error_message();
    }
  }
};

TEST_F(PortGarbageTest, EveryDaemonSurvivesGarbageOnEverySocketAndStillWorks) {
  // What each daemon must be listening on (more is fine: all of it is hit).
  std::vector<std::vector<ListeningSocket>> per_process;
  per_process.push_back(SocketsOf(meta_->proc()->pid(), {absl::StrCat("tcp 127.0.0.1:", meta_->port()),
                                                         absl::StrCat("tcp 127.0.0.1:", meta_->metrics_port())}));
  for (auto& a : agents_) {
    per_process.push_back(SocketsOf(a->proc()->pid(), {absl::StrCat("tcp 127.0.0.1:", a->port()),
                                                       absl::StrCat("tcp 127.0.0.1:", a->data_port()),
                                                       absl::StrCat("tcp 127.0.0.1:", a->metrics_port()),
                                                       "unix-stream " + a->socket_path(),
                                                       "unix-seqpacket " + a->run_dir() + "/session.sock"}));
  }
  std::vector<std::string> all;
  for (const auto& sockets : per_process) {
    for (const ListeningSocket& s : sockets) all.push_back(s.ToString());
  }
  std::cout << "listening sockets hit: " << absl::StrJoin(all, ", ") << "\n";
  // Every daemon's sockets at once, twice (different random bytes).
  for (uint64_t seed : {1u, 2u}) {
    std::vector<std::thread> threads;
    std::vector<std::vector<Hit>> hits(per_process.size());
    for (size_t i = 0; i < per_process.size(); ++i) {
      threads.emplace_back([&, i] { hits[i] = ThrowGarbage(per_process[i], seed); });
    }
    for (std::thread& t : threads) t.join();
    // The data ports speak only the handshake: each garbage connection is
    // closed by the agent, unanswered.
    for (size_t i = 0; i < agents_.size(); ++i) {
      for (const Hit& h : hits[i + 1]) {
        if (h.target.kind != ListeningSocket::Kind::kTcp || h.target.port != agents_[i]->data_port() ||
            !h.result.ok()) {
          continue;
        }
        EXPECT_TRUE(h.result->closed_by_peer) << h.target.ToString() << " / " << h.payload;
        EXPECT_EQ(h.result->bytes_received, 0u) << h.target.ToString() << " / " << h.payload;
      }
    }
    ExpectAlive();
    ASSERT_FALSE(HasFailure()) << Logs();
  }
  absl::StatusOr<std::string> log = agents_[0]->proc()->ReadLog();
  ASSERT_TRUE(log.ok());
  EXPECT_TRUE(absl::StrContains(*log, "data plane: refused a connection from 127.0.0.1:")) << Logs();

  // The data plane still works: ring replicas across the three agents, then
  // every rank restored through the node that holds none of it, so its bytes
  // come from a peer over UCX.
  constexpr size_t kBytes = 3 << 20;
  const Protection protection = Protection::Replicate(2, Protection::Placement::kRing);
  std::vector<Client> clients;
  std::vector<SaveHandle> handles;
  for (uint32_t r = 0; r < 3; ++r) {
    ClientOptions o = testing::ClientOptionsFor(*meta_, *agents_[r], "garbage", r, 3);
    o.protection = protection;
    absl::StatusOr<Client> c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    const std::vector<uint8_t> data = RankBytes(r, kBytes + r * 4099);
    SaveBuilder s = c->BeginSave(5);
    ASSERT_TRUE(s.Add("state", std::as_bytes(std::span<const uint8_t>(data)), DType::kU8, {data.size()}).ok());
    absl::StatusOr<SaveHandle> h = s.Commit();
    ASSERT_TRUE(h.ok()) << h.status();
    handles.push_back(*h);
    clients.push_back(*std::move(c));
  }
  for (SaveHandle& h : handles) {
    absl::Status st = h.Wait(Level::kProtected, absl::Now() + kLong);
    ASSERT_TRUE(st.ok()) << st << "\n" << Logs();
  }
  for (uint32_t r = 0; r < 3; ++r) {
    const int via = static_cast<int>((r + 2) % 3);  // rank r lives on r and r+1
    ClientOptions o = testing::ClientOptionsFor(*meta_, *agents_[via], "garbage", r, 3);
    o.protection = protection;
    absl::StatusOr<Client> c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    absl::StatusOr<LoadedShard> shard = c->Load(5);
    ASSERT_TRUE(shard.ok()) << "rank " << r << " via n" << via << ": " << shard.status() << "\n" << Logs();
    EXPECT_EQ(shard->served_from(), ServedFrom::kReplica) << "rank " << r;
    absl::StatusOr<std::span<const std::byte>> view = shard->View("state");
    ASSERT_TRUE(view.ok()) << view.status();
    const std::vector<uint8_t> want = RankBytes(r, kBytes + r * 4099);
    ASSERT_EQ(view->size(), want.size()) << "rank " << r;
    EXPECT_EQ(std::memcmp(view->data(), want.data(), want.size()), 0) << "rank " << r;
  }
  ExpectAlive();
}

}  // namespace
}  // namespace ckpt
