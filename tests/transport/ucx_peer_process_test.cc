// UCX transport with the peer in another process that goes away in the
// middle of a transfer, as a crashed or restarting agent does: killed (-9)
// or stopped (Transport::Stop), while receiving or while sending. This
// process must report the failure, complete every send, and never crash.
//
// Before endpoints were flushed on close, a peer that stopped while bytes were
// flowing made the other side abort inside UCX 1.13 (tcp_ep.c:939) or crash
// with a corrupted heap in about one run of this test in three: UCX's TCP transport,
// torn down with a message half written, wrote its goodbye into the middle of
// that message.
//
// The peer is this test binary run again (Subprocess, cleaned up by PID) with
// CKPT_UCX_PEER_ROLE set; it prints its data-plane address on stdout.
#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "support/process.h"
#include "support/temp_dir.h"
#include "test_handler.h"
#include "transport/ucx/ucx_transport.h"

namespace ckpt::transport {
namespace {

constexpr int kRounds = 24;
constexpr int kSends = 16;
constexpr size_t kPayloadBytes = 16 << 20;

UcxOptions Options() {
  UcxOptions o;
  o.self_check_timeout_ms = 0;
  return o;
}

const std::vector<std::byte>& Payload() {
  static const auto* p = new std::vector<std::byte>(Pattern(kPayloadBytes, 8));
  return *p;
}

// Round r: the peer goes away after a few messages, by Stop on odd rounds
// and kill -9 on even ones.
[[noreturn]] void GoAway(Transport* t, int round) {
  if (round % 2 == 1) {
    t->Stop();
    _exit(0);
  }
  kill(getpid(), SIGKILL);
  _exit(1);  // not reached
}

// The child's side; never returns.
[[noreturn]] void RunPeer(const std::string& role, int round) {
  TestHandler h;
  h.keep_bytes = false;
  auto t = NewUcxTransport(Options());
  if (!t->Start("127.0.0.1:0", &h).ok()) _exit(2);
  if (role == "receiver" || role == "sink") {
    std::printf("ADDRESS %s\n", t->address().c_str());
    std::fflush(stdout);
    if (role == "sink") {  // takes what comes until it is killed (or a minute)
      h.WaitReceived(kSends + 1, absl::Seconds(60));
      _exit(0);
    }
    h.WaitReceived(1 + round % 4, absl::Seconds(60));
    GoAway(t.get(), round);
  }
  const char* address = std::getenv("CKPT_UCX_PEER_ADDRESS");
  absl::StatusOr<PeerId> peer = t->Connect(address == nullptr ? "" : address, 10000);
  if (!peer.ok()) _exit(3);
  DoneLog done;
  for (int i = 0; i < kSends; ++i) {
    t->Send(*peer, 1, absl::StrCat(round, "/", i), {std::span<const std::byte>(Payload())}, done.Callback());
  }
  done.Wait(1 + round % 3, absl::Seconds(60));
  GoAway(t.get(), round);
}

bool ChildMode() {
  const char* role = std::getenv("CKPT_UCX_PEER_ROLE");
  const char* round = std::getenv("CKPT_UCX_PEER_ROUND");
  int r = 0;
  if (role == nullptr || round == nullptr || !absl::SimpleAtoi(round, &r)) return false;
  RunPeer(role, r);
}

std::unique_ptr<testing::Subprocess> StartPeer(const testing::TempDir& dir, const std::string& test,
                                               const std::string& role, int round,
                                               const std::string& address = "") {
  testing::SubprocessOptions o;
  o.argv = {"/proc/self/exe", "--gtest_filter=UcxPeerProcess." + test};
  o.env = {{"CKPT_UCX_PEER_ROLE", role}, {"CKPT_UCX_PEER_ROUND", absl::StrCat(round)},
           {"CKPT_UCX_PEER_ADDRESS", address}};
  o.name = absl::StrCat(role, "-", round);
  o.log_dir = dir.path();
  absl::StatusOr<std::unique_ptr<testing::Subprocess>> p = testing::Subprocess::Start(o);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *std::move(p) : nullptr;
}

// The address a receiver child printed (bounded poll of a real process).
std::string WaitForAddress(testing::Subprocess* child) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline && child->IsRunning()) {
    absl::StatusOr<std::string> log = child->ReadLog();
    if (log.ok()) {
      const size_t at = log->find("ADDRESS ");
      const size_t end = at == std::string::npos ? at : log->find('\n', at);
      if (end != std::string::npos) return log->substr(at + 8, end - at - 8);
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return "";
}

TEST(UcxPeerProcess, ReceiverGoesAwayMidTransfer) {
  if (ChildMode()) return;
  absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create();
  ASSERT_TRUE(dir.ok()) << dir.status();
  TestHandler h;
  auto t = NewUcxTransport(Options());
  ASSERT_TRUE(t->Start("127.0.0.1:0", &h).ok());
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    std::unique_ptr<testing::Subprocess> child = StartPeer(*dir, "ReceiverGoesAwayMidTransfer", "receiver", round);
    ASSERT_NE(child, nullptr);
    const std::string address = WaitForAddress(child.get());
    ASSERT_FALSE(address.empty()) << child->LogTail();
    absl::StatusOr<PeerId> peer = t->Connect(address, 10000);
    ASSERT_TRUE(peer.ok()) << peer.status();
    DoneLog done;
    for (int i = 0; i < kSends; ++i) {
      t->Send(*peer, 1, absl::StrCat(i), {std::span<const std::byte>(Payload())}, done.Callback());
    }
    ASSERT_TRUE(done.Wait(kSends, absl::Seconds(60)));
    for (const absl::Status& s : done.statuses()) {
      EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kUnavailable) << s;
    }
    ASSERT_TRUE(h.WaitPeerFailed(round + 1)) << child->LogTail();
    ASSERT_TRUE(child->Wait().ok());
  }
}

TEST(UcxPeerProcess, SenderGoesAwayMidTransfer) {
  if (ChildMode()) return;
  absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create();
  ASSERT_TRUE(dir.ok()) << dir.status();
  TestHandler h;
  h.keep_bytes = false;
  auto t = NewUcxTransport(Options());
  ASSERT_TRUE(t->Start("127.0.0.1:0", &h).ok());
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    std::unique_ptr<testing::Subprocess> child =
        StartPeer(*dir, "SenderGoesAwayMidTransfer", "sender", round, t->address());
    ASSERT_NE(child, nullptr);
    ASSERT_TRUE(child->Wait().ok());
    ASSERT_TRUE(h.WaitPeerFailed(round + 1)) << child->LogTail();
  }
  // Whatever arrived arrived whole or with an error; nothing else.
  for (const auto& g : h.received()) {
    EXPECT_TRUE(g.status.ok() || g.status.code() == absl::StatusCode::kUnavailable) << g.status;
  }
}

// A receiver that is stopped (SIGSTOP: a hung or swapped-out agent) while
// this process pushes to it, then this process stops its transport: sends
// that make no progress at all must not keep Stop from ending, and
// destroying the UCX worker with them still in flight must not abort
// (UCX 1.13: ucp_ep.c proto_reqs not empty). Every send completes.
TEST(UcxPeerProcess, StopWhileTheReceiverIsStopped) {
  if (ChildMode()) return;
  absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create();
  ASSERT_TRUE(dir.ok()) << dir.status();
  std::unique_ptr<testing::Subprocess> child = StartPeer(*dir, "StopWhileTheReceiverIsStopped", "sink", 0);
  ASSERT_NE(child, nullptr);
  const std::string address = WaitForAddress(child.get());
  ASSERT_FALSE(address.empty()) << child->LogTail();
  DoneLog done;  // outlives the transport, whose Stop reports the sends
  TestHandler h;
  UcxOptions o = Options();
  o.stop_timeout_ms = 300;
  auto t = NewUcxTransport(o);
  ASSERT_TRUE(t->Start("127.0.0.1:0", &h).ok());
  absl::StatusOr<PeerId> peer = t->Connect(address, 10000);
  ASSERT_TRUE(peer.ok()) << peer.status();
  for (int i = 0; i < kSends; ++i) {
    t->Send(*peer, 1, absl::StrCat(i), {std::span<const std::byte>(Payload())}, done.Callback());
  }
  ASSERT_TRUE(done.Wait(1, absl::Seconds(60)));
  ASSERT_TRUE(child->Kill(SIGSTOP).ok());
  t->Stop();  // aborted here before the fix
  EXPECT_TRUE(done.Wait(kSends, absl::Seconds(1)));
  for (const absl::Status& s : done.statuses()) {
    EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kCancelled ||
                s.code() == absl::StatusCode::kUnavailable) << s;
  }
  EXPECT_GT(done.statuses().size(), 0u);
  ASSERT_TRUE(child->Kill(SIGKILL).ok());
  ASSERT_TRUE(child->Kill(SIGCONT).ok());
  absl::StatusOr<testing::ExitStatus> exit = child->Wait();
  ASSERT_TRUE(exit.ok()) << exit.status();
}

}  // namespace
}  // namespace ckpt::transport
