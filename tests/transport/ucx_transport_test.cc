// UCX transport over 127.0.0.1: two transports in one process.
//
// Every wait is bounded (30 s) so a broken transport fails instead of hanging.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <sstream>
#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "test_handler.h"
#include "transport/bulk.h"
#include "transport/fault/fault_transport.h"
#include "common/pki.h"
#include "support/pki.h"
#include "support/sockets.h"
#include "support/temp_dir.h"
#include "transport/ucx/handshake.h"
#include "transport/ucx/node_identity.h"
#include "transport/ucx/ucx_transport.h"

namespace ckpt::transport {
namespace {

using ckpt::testing::GarbagePayloads;
using ckpt::testing::GarbageResult;
using ckpt::testing::ListeningSocket;
using ckpt::testing::SendGarbage;

constexpr int64_t kConnectMs = 10000;

ConstPieces AsPieces(const std::vector<std::byte>& v) { return {std::span<const std::byte>(v)}; }

// Start's self-check opens and closes sockets, and UCX 1.13 aborts when two
// workers in one process reuse each other's socket fds while an async event
// is pending (async.c:643); the fewer sockets churn, the rarer that is. Only
// the test of the self-check itself runs it.
UcxOptions NoSelfCheck() {
  UcxOptions o;
  o.self_check_timeout_ms = 0;
  return o;
}

struct UcxPair {
  UcxPair() : a(NewUcxTransport(NoSelfCheck())), b(NewUcxTransport(NoSelfCheck())) {}
  void Start() {
    absl::Status s = a->Start("127.0.0.1:0", &ha);
    ASSERT_TRUE(s.ok()) << s;
    s = b->Start("127.0.0.1:0", &hb);
    ASSERT_TRUE(s.ok()) << s;
    auto id = a->Connect(b->address(), kConnectMs);
    ASSERT_TRUE(id.ok()) << id.status();
    to_b = *id;
  }
  TestHandler ha, hb;
  std::unique_ptr<Transport> a, b;
  PeerId to_b = 0;
};

TEST(UcxTransport, AddressHasTheBoundPort) {
  TestHandler h;
  auto t = NewUcxTransport(NoSelfCheck());
  ASSERT_TRUE(t->Start("127.0.0.1:0", &h).ok());
  EXPECT_TRUE(absl::StartsWith(t->address(), "127.0.0.1:")) << t->address();
  EXPECT_FALSE(absl::EndsWith(t->address(), ":0")) << t->address();
}

TEST(UcxTransport, RejectsBadAddresses) {
  TestHandler h;
  auto t = NewUcxTransport(NoSelfCheck());
  EXPECT_EQ(t->Start("no-port", &h).code(), absl::StatusCode::kInvalidArgument);
}

TEST(UcxTransport, Sends64MiBIntoThreePiecesByteExact) {
  UcxPair p;
  p.hb.pieces = 3;
  ASSERT_NO_FATAL_FAILURE(p.Start());
  const auto data = Pattern(64 << 20, 11);
  // The sender gathers from two pieces too.
  ConstPieces src{std::span<const std::byte>(data).subspan(0, 12345),
                  std::span<const std::byte>(data).subspan(12345)};
  DoneLog done;
  p.a->Send(p.to_b, 3, "big", src, done.Callback());
  ASSERT_TRUE(done.Wait(1));
  EXPECT_TRUE(done.statuses()[0].ok()) << done.statuses()[0];
  ASSERT_TRUE(p.hb.WaitReceived(1));
  const auto got = p.hb.received();
  EXPECT_TRUE(got[0].status.ok()) << got[0].status;
  EXPECT_EQ(got[0].msg.type, 3);
  EXPECT_EQ(got[0].msg.header, "big");
  EXPECT_TRUE(got[0].bytes == data);
}

TEST(UcxTransport, ManySmallMessagesArriveIntact) {
  UcxPair p;
  p.hb.pieces = 2;
  ASSERT_NO_FATAL_FAILURE(p.Start());
  constexpr int kCount = 2000;
  std::vector<std::vector<std::byte>> payloads;
  for (int i = 0; i < kCount; ++i) payloads.push_back(Pattern(i % 3 == 0 ? 0 : 1 + i % 700, i));
  DoneLog done;
  for (int i = 0; i < kCount; ++i) {
    p.a->Send(p.to_b, 1, absl::StrCat(i), payloads[i].empty() ? ConstPieces{} : AsPieces(payloads[i]),
              done.Callback());
  }
  ASSERT_TRUE(done.Wait(kCount));
  ASSERT_TRUE(p.hb.WaitReceived(kCount));
  for (const auto& s : done.statuses()) EXPECT_TRUE(s.ok()) << s;
  for (const auto& g : p.hb.received()) {
    int i = 0;
    ASSERT_TRUE(absl::SimpleAtoi(g.msg.header, &i));
    EXPECT_TRUE(g.status.ok());
    EXPECT_EQ(g.msg.payload_bytes, payloads[i].size());
    EXPECT_TRUE(g.bytes == payloads[i]) << i;
  }
}

TEST(UcxTransport, HeaderOfMaxSizeArrives) {
  UcxPair p;
  ASSERT_NO_FATAL_FAILURE(p.Start());
  const std::string header(kMaxHeaderBytes, 'h');
  const auto data = Pattern(1 << 20, 5);
  DoneLog done;
  p.a->Send(p.to_b, 1, header, AsPieces(data), done.Callback());
  p.a->Send(p.to_b, 1, header + "x", {}, done.Callback());
  ASSERT_TRUE(done.Wait(2));
  ASSERT_TRUE(p.hb.WaitReceived(1));
  EXPECT_EQ(p.hb.received()[0].msg.header, header);
  int invalid = 0;
  for (const auto& s : done.statuses()) invalid += s.code() == absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(invalid, 1);
}

TEST(UcxTransport, ReplyOnInboundConnection) {
  // Declared before the pair: the reply's bytes and its completion log outlive
  // the transports (a CI run under ASan once freed `reply` while B's
  // rendezvous send still read its last bytes: the receiver had them all, the
  // sender's completion had not run yet).
  std::vector<std::byte> reply = Pattern(1 << 20, 7);  // rendezvous-sized reply
  DoneLog replied;
  UcxPair p;
  Transport* b = nullptr;
  p.hb.on_received = [&](const Inbound& msg, const absl::Status&) {
    b->Send(msg.from, 2, "pong", AsPieces(reply), replied.Callback());
  };
  b = p.b.get();
  ASSERT_NO_FATAL_FAILURE(p.Start());
  p.a->Send(p.to_b, 1, "ping", {}, [](const absl::Status&) {});
  ASSERT_TRUE(p.ha.WaitReceived(1));
  ASSERT_TRUE(replied.Wait(1));  // the reply's memory is B's until its send completed
  EXPECT_TRUE(replied.statuses()[0].ok()) << replied.statuses()[0];
  const auto got = p.ha.received();
  EXPECT_EQ(got[0].msg.header, "pong");
  EXPECT_EQ(got[0].msg.from, p.to_b);
  EXPECT_TRUE(got[0].bytes == reply);
}

TEST(UcxTransport, AllocateErrorReachesOnReceived) {
  UcxPair p;
  p.hb.allocate_error = absl::ResourceExhaustedError("full");
  ASSERT_NO_FATAL_FAILURE(p.Start());
  const auto small = Pattern(100, 1);
  const auto large = Pattern(4 << 20, 2);
  DoneLog done;
  p.a->Send(p.to_b, 1, "s", AsPieces(small), done.Callback());
  p.a->Send(p.to_b, 1, "l", AsPieces(large), done.Callback());
  ASSERT_TRUE(done.Wait(2));
  ASSERT_TRUE(p.hb.WaitReceived(2));
  for (const auto& g : p.hb.received()) EXPECT_EQ(g.status.code(), absl::StatusCode::kResourceExhausted);
}

TEST(UcxTransport, SendChunked256MiBIn8MiBChunks) {
  UcxPair p;
  const auto data = Pattern(256 << 20, 13);
  std::vector<std::byte> dest(data.size());
  p.hb.keep_bytes = false;
  p.hb.allocate = [&dest](const Inbound& msg) -> absl::StatusOr<MutablePieces> {
    uint64_t offset = 0;
    if (!absl::SimpleAtoi(msg.header, &offset)) return absl::InvalidArgumentError("header");
    return MutablePieces{std::span<std::byte>(dest).subspan(offset, msg.payload_bytes)};
  };
  ASSERT_NO_FATAL_FAILURE(p.Start());
  BulkOptions opt;
  opt.chunk_bytes = 8 << 20;
  opt.max_in_flight = 4;
  const PeerId peer = p.to_b;
  auto st = SendChunked(*p.a, std::span<const PeerId>(&peer, 1), 4, AsPieces(data), opt,
                        [](const ChunkInfo& c) { return absl::StrCat(c.offset); }, RealClock());
  ASSERT_TRUE(st[0].ok()) << st[0];
  ASSERT_TRUE(p.hb.WaitReceived(32));
  for (const auto& g : p.hb.received()) EXPECT_TRUE(g.status.ok()) << g.status;
  EXPECT_TRUE(dest == data);
}

TEST(UcxTransport, PeerStopFailsPeerAndSends) {
  UcxPair p;
  ASSERT_NO_FATAL_FAILURE(p.Start());
  // Make sure b has accepted the connection before it goes away.
  p.a->Send(p.to_b, 1, "hello", {}, [](const absl::Status&) {});
  ASSERT_TRUE(p.hb.WaitReceived(1));
  p.b->Stop();
  ASSERT_TRUE(p.ha.WaitPeerFailed(1));
  EXPECT_EQ(p.ha.failed()[0].first, p.to_b);
  EXPECT_EQ(p.ha.failed()[0].second.code(), absl::StatusCode::kUnavailable);
  DoneLog done;
  const auto data = Pattern(1 << 20, 3);
  p.a->Send(p.to_b, 1, "late", AsPieces(data), done.Callback());
  ASSERT_TRUE(done.Wait(1));
  EXPECT_EQ(done.statuses()[0].code(), absl::StatusCode::kUnavailable);
}

TEST(UcxTransport, PeerStopMidTransferCompletesEverySend) {
  UcxPair p;
  ASSERT_NO_FATAL_FAILURE(p.Start());
  const auto data = Pattern(16 << 20, 8);
  constexpr int kSends = 16;
  DoneLog done;
  for (int i = 0; i < kSends; ++i) p.a->Send(p.to_b, 1, absl::StrCat(i), AsPieces(data), done.Callback());
  ASSERT_TRUE(p.hb.WaitReceived(1));
  p.b->Stop();
  // No hang: every send ends, delivered (OK) or failed with the peer.
  ASSERT_TRUE(done.Wait(kSends));
  for (const auto& s : done.statuses()) {
    EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kUnavailable) << s;
  }
  ASSERT_TRUE(p.ha.WaitPeerFailed(1));
}

TEST(UcxTransport, DisconnectTellsBothSides) {
  UcxPair p;
  ASSERT_NO_FATAL_FAILURE(p.Start());
  p.a->Send(p.to_b, 1, "hello", {}, [](const absl::Status&) {});
  ASSERT_TRUE(p.hb.WaitReceived(1));
  p.a->Disconnect(p.to_b);
  ASSERT_TRUE(p.ha.WaitPeerFailed(1));
  EXPECT_EQ(p.ha.failed()[0].second.code(), absl::StatusCode::kCancelled);
  ASSERT_TRUE(p.hb.WaitPeerFailed(1));
  EXPECT_EQ(p.hb.failed()[0].first, p.hb.received()[0].msg.from);
}

// Sends of 4 MiB (rendezvous), not 16: UCX 1.13 aborts in ucp_worker_destroy
// when Stop's flushing closes are still busy after stop_timeout_ms (2 s), and
// 256 MiB did not always drain in 2 s on a loaded CI machine (docs/testing.md,
// "Known failures").
TEST(UcxTransport, StopCompletesSendsInFlight) {
  UcxPair p;
  ASSERT_NO_FATAL_FAILURE(p.Start());
  const auto data = Pattern(4 << 20, 9);
  constexpr int kSends = 16;
  DoneLog done;
  for (int i = 0; i < kSends; ++i) p.a->Send(p.to_b, 1, absl::StrCat(i), AsPieces(data), done.Callback());
  p.a->Stop();
  // Every send completed, before Stop returned. (How long Stop takes is not
  // asserted here: its waits are bounded by stop_timeout_ms and
  // stop_limit_ms, StopEndsSendsAPeerDoesNotTake.)
  ASSERT_TRUE(done.Wait(kSends, absl::ZeroDuration()));
  for (const auto& s : done.statuses()) {
    EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kCancelled) << s;
  }
  DoneLog after;
  p.a->Send(p.to_b, 1, "after", {}, after.Callback());
  ASSERT_TRUE(after.Wait(1, absl::ZeroDuration()));
  EXPECT_EQ(after.statuses()[0].code(), absl::StatusCode::kCancelled);
  p.a->Stop();  // idempotent
}

// Stop's wait goes on while sends keep moving: 48 sends of 16 MiB, all
// handed to UCX (the first has arrived) when Stop starts, take longer in all
// than a short stop_timeout_ms, but UCX keeps moving their fragments. Before,
// Stop destroyed the worker once the timeout had passed with sends in
// flight, and UCX 1.13 aborted (ucp_ep.c:437); a first fix counted only
// whole sends finishing, and under TSan on a loaded machine one 16 MiB send
// took longer than the limit (the worker was left and sends cancelled).
TEST(UcxTransport, StopWaitsWhileSendsKeepFinishing) {
  UcxOptions o = NoSelfCheck();
  o.stop_timeout_ms = 500;
  o.stop_limit_ms = 300000;  // only "no progress" ends this wait
  DoneLog done;  // outlives the transports, whose Stop may still report sends
  TestHandler ha, hb;
  hb.keep_bytes = false;
  auto a = NewUcxTransport(o);
  auto b = NewUcxTransport(NoSelfCheck());
  ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
  ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());
  auto to_b = a->Connect(b->address(), kConnectMs);
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  const auto data = Pattern(16 << 20, 10);
  constexpr int kSends = 48;
  for (int i = 0; i < kSends; ++i) a->Send(*to_b, 1, absl::StrCat(i), AsPieces(data), done.Callback());
  ASSERT_TRUE(hb.WaitReceived(1, absl::Seconds(120)));
  a->Stop();
  // Stop reports every send (its peer is gone: Cancelled) before it returns...
  ASSERT_TRUE(done.Wait(kSends, absl::ZeroDuration()));
  for (const auto& s : done.statuses()) {
    EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kCancelled) << s;
  }
  // ...and UCX delivered every one of them before the worker went.
  EXPECT_TRUE(hb.WaitReceived(kSends)) << hb.received().size() << " of " << kSends << " arrived";
  b->Stop();
}

// A peer that takes nothing (its progress thread is held inside Allocate):
// Stop's flushing closes and sends cannot finish, so after stop_timeout_ms
// without progress it ends the sends itself; every one completes (not OK)
// before Stop returns, and the process does not abort (UCX 1.13 asserts
// when a worker is destroyed with operations on an endpoint: the worker is
// left to the process's exit instead). The process test
// UcxPeerProcess.StopWhileTheReceiverIsStopped does the same with a SIGSTOPped peer.
TEST(UcxTransport, StopEndsSendsAPeerDoesNotTake) {
  DoneLog done;  // outlives the transports
  TestHandler ha, hb;
  absl::Notification entered, release;
  hb.allocate = [&](const Inbound&) -> absl::StatusOr<MutablePieces> {
    if (!entered.HasBeenNotified()) entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(60));
    return absl::UnavailableError("the test held this receive");
  };
  UcxOptions quick = NoSelfCheck();
  quick.stop_timeout_ms = 200;
  auto a = NewUcxTransport(quick);
  auto b = NewUcxTransport(quick);
  ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
  ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());
  absl::StatusOr<PeerId> to_b = a->Connect(b->address(), kConnectMs);
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  const auto data = Pattern(4 << 20, 3);  // rendezvous-sized
  constexpr int kSends = 4;
  for (int i = 0; i < kSends; ++i) a->Send(*to_b, 1, absl::StrCat(i), AsPieces(data), done.Callback());
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(30)));
  a->Stop();
  ASSERT_TRUE(done.Wait(kSends, absl::ZeroDuration()));
  for (const auto& st : done.statuses()) EXPECT_FALSE(st.ok()) << "a send the peer never took succeeded";
  release.Notify();
  b->Stop();
}

TEST(UcxTransport, ConnectToNothingFailsInTime) {
  TestHandler h, hdead;
  auto dead = NewUcxTransport(NoSelfCheck());
  ASSERT_TRUE(dead->Start("127.0.0.1:0", &hdead).ok());
  const std::string address = dead->address();
  dead->Stop();
  auto t = NewUcxTransport(NoSelfCheck());
  ASSERT_TRUE(t->Start("127.0.0.1:0", &h).ok());
  // Not timed: the failure is the refusal itself, not the 5 s timeout
  // running out (that would say it timed out).
  auto id = t->Connect(address, 5000);
  EXPECT_EQ(id.status().code(), absl::StatusCode::kUnavailable) << id.status();
  EXPECT_TRUE(absl::StrContains(id.status().message(), address)) << id.status();
  EXPECT_TRUE(absl::StrContains(id.status().message(), "Connection refused")) << id.status();
}

TEST(UcxTransport, NoUsableTransportIsAClearStartError) {
  UcxOptions opt;
  opt.config = {{"TLS", "cma"}};  // cma alone can neither carry AM nor listen
  TestHandler h;
  auto t = NewUcxTransport(opt);
  const absl::Status s = t->Start("127.0.0.1:0", &h);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "UCX")) << s;
  t->Stop();
}

TEST(UcxTransport, FaultDecoratorCorruptsOneChunkOverUcx) {
  TestHandler ha, hb;
  const auto data = Pattern(8 << 20, 21);
  std::vector<std::byte> dest(data.size());
  hb.keep_bytes = false;
  hb.allocate = [&dest](const Inbound& msg) -> absl::StatusOr<MutablePieces> {
    uint64_t offset = 0;
    if (!absl::SimpleAtoi(msg.header, &offset)) return absl::InvalidArgumentError("header");
    return MutablePieces{std::span<std::byte>(dest).subspan(offset, msg.payload_bytes)};
  };
  FaultTransport a(NewUcxTransport(NoSelfCheck()));
  auto b = NewUcxTransport(NoSelfCheck());
  ASSERT_TRUE(a.Start("127.0.0.1:0", &ha).ok());
  ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());
  auto peer = a.Connect(b->address(), kConnectMs);
  ASSERT_TRUE(peer.ok()) << peer.status();
  a.CorruptNthSend(3, 17);  // chunk 2 (1 MiB chunks), byte 17 of it
  BulkOptions opt;
  opt.chunk_bytes = 1 << 20;
  const PeerId p = *peer;
  auto st = SendChunked(a, std::span<const PeerId>(&p, 1), 1, AsPieces(data), opt,
                        [](const ChunkInfo& c) { return absl::StrCat(c.offset); }, RealClock());
  ASSERT_TRUE(st[0].ok()) << st[0];
  ASSERT_TRUE(hb.WaitReceived(8));
  std::vector<size_t> diffs;
  for (size_t i = 0; i < data.size(); ++i)
    if (dest[i] != data[i]) diffs.push_back(i);
  ASSERT_EQ(diffs.size(), 1u);
  EXPECT_EQ(diffs[0], (2u << 20) + 17);
}

// True once `t`'s progress thread has slept through `n` rounds in a row (no
// woken round between them); false if that did not happen within a minute.
bool SleepsThroughRounds(const UcxTransport& t, uint64_t n) {
  const absl::Time deadline = absl::Now() + absl::Minutes(1);
  UcxTransport::ProgressRounds from = t.TEST_progress_rounds();
  while (absl::Now() < deadline) {
    const UcxTransport::ProgressRounds now = t.TEST_progress_rounds();
    if (now.woken != from.woken) {
      from = now;  // work (e.g. UCX's keepalive): count again from here
    } else if (now.slept >= from.slept + n) {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(1));  // polls a counter; asserts no duration
  }
  return false;
}

// The progress threads sleep on their fds: an idle connected pair burns no
// CPU (this machine's 2 cores are shared by several agents). Counted, not
// timed: once idle, each progress thread's rounds end in a long wait that
// expired with nothing ready; a spinning thread's rounds never do (a poll
// that returns at once, an eventfd left readable, a worker that never arms).
TEST(UcxTransport, IdleTransportsSleepInTheirWaits) {
  TestHandler ha, hb;
  auto a = NewUcxTransport(NoSelfCheck());
  auto b = NewUcxTransport(NoSelfCheck());
  ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
  ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());
  absl::StatusOr<PeerId> to_b = a->Connect(b->address(), kConnectMs);
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  a->Send(*to_b, 1, "hello", {}, [](const absl::Status&) {});
  ASSERT_TRUE(hb.WaitReceived(1));
  const UcxTransport::ProgressRounds busy = a->TEST_progress_rounds();
  EXPECT_GT(busy.woken, 0u) << "the connect and the send woke a's progress thread";
  EXPECT_TRUE(SleepsThroughRounds(*a, 2)) << "a's progress thread spins while idle";
  EXPECT_TRUE(SleepsThroughRounds(*b, 2)) << "b's progress thread spins while idle";
}

// Several connections between the same two transports, both ways, and one
// of them closed: the others keep carrying messages both ways. (UCX pairs the
// endpoints two workers open to each other by a sequence number, not by
// connection; with an endpoint per connection, closing one broke another's
// replies, which then vanished until UCX's keepalive reset it ~20 s later.)
void CloseOneOfSeveral() {
  TestHandler ha, hb;
  auto a = NewUcxTransport(NoSelfCheck());
  auto b = NewUcxTransport(NoSelfCheck());
  Transport* braw = b.get();
  Transport* araw = a.get();
  auto pong = [](Transport** t) {
    return [t](const Inbound& msg, const absl::Status&) {
      if (absl::StartsWith(msg.header, "ping")) {
        (*t)->Send(msg.from, 2, "pong" + msg.header.substr(4), {}, [](const absl::Status&) {});
      }
    };
  };
  hb.on_received = pong(&braw);
  ha.on_received = pong(&araw);
  ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
  ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());
  // Connections opened at the same moment both ways (as agents pushing EC
  // segments to each other do, with duplicates they then close): when each
  // side opens its outbound endpoint before the inbound one, UCX pairs a's
  // outbound endpoint with b's outbound one.
  absl::StatusOr<PeerId> ab1, ab2, ba;
  {
    std::thread t1([&] { ab1 = a->Connect(b->address(), kConnectMs); });
    std::thread t2([&] { ab2 = a->Connect(b->address(), kConnectMs); });
    std::thread t3([&] { ba = b->Connect(a->address(), kConnectMs); });
    t1.join();
    t2.join();
    t3.join();
  }
  ASSERT_TRUE(ab1.ok()) << ab1.status();
  ASSERT_TRUE(ab2.ok()) << ab2.status();
  ASSERT_TRUE(ba.ok()) << ba.status();
  // Close one; the other two must still carry messages and replies.
  a->Disconnect(*ab1);
  ASSERT_TRUE(hb.WaitPeerFailed(1));
  for (int round = 0; round < 3; ++round) {
    a->Send(*ab2, 1, absl::StrCat("ping", round), {}, [](const absl::Status&) {});
    b->Send(*ba, 1, absl::StrCat("ping", round), {}, [](const absl::Status&) {});
  }
  // Within 10 s: well before UCX's keepalive would notice a lost endpoint.
  ASSERT_TRUE(ha.WaitReceived(6, absl::Seconds(10))) << ha.received().size() << " of 6 arrived at a";
  ASSERT_TRUE(hb.WaitReceived(6, absl::Seconds(10))) << hb.received().size() << " of 6 arrived at b";
  int pongs_at_a = 0, pongs_at_b = 0;
  for (const auto& g : ha.received()) pongs_at_a += absl::StartsWith(g.msg.header, "pong") && g.msg.from == *ab2;
  for (const auto& g : hb.received()) pongs_at_b += absl::StartsWith(g.msg.header, "pong") && g.msg.from == *ba;
  EXPECT_EQ(pongs_at_a, 3);
  EXPECT_EQ(pongs_at_b, 3);
  EXPECT_EQ(ha.failed().size(), 1u) << "only the connection a closed itself";
  EXPECT_EQ(hb.failed().size(), 1u);
}

TEST(UcxTransport, ClosingOneOfSeveralConnectionsLeavesTheOthersWorking) {
  // The race (each side opening its outbound endpoint first) does not happen
  // every time: before the fix about one attempt in 40 lost messages.
  for (int attempt = 0; attempt < 40; ++attempt) {
    SCOPED_TRACE(absl::StrCat("attempt ", attempt));
    ASSERT_NO_FATAL_FAILURE(CloseOneOfSeveral());
  }
}

// The transport's data port, from its address ("127.0.0.1:port").
ListeningSocket DataPort(const Transport& t) {
  ListeningSocket s;
  const std::string a = t.address();
  s.address = a.substr(0, a.rfind(':'));
  EXPECT_TRUE(absl::SimpleAtoi(a.substr(a.rfind(':') + 1), &s.port)) << a;
  return s;
}

// A plain TCP connection to `port` on 127.0.0.1 that says nothing.
int IdleConnection(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << strerror(errno);
  return fd;
}

// Garbage of every size and kind on the data port (issue 13 item 8: 1 MiB of
// zeros used to abort the process inside UCX's TCP connection manager): the
// transport refuses each connection at its first byte, answers nothing,
// keeps its established connection working and accepts new ones.
TEST(UcxTransport, GarbageOnTheDataPortIsRefusedAndHarmsNothing) {
  UcxPair p;
  ASSERT_NO_FATAL_FAILURE(p.Start());
  p.a->Send(p.to_b, 1, "before", {}, [](const absl::Status&) {});
  ASSERT_TRUE(p.hb.WaitReceived(1));
  const ListeningSocket port = DataPort(*p.b);
  const std::vector<ckpt::testing::NamedBytes> payloads = GarbagePayloads(7);
  for (const auto& g : payloads) {
    absl::StatusOr<GarbageResult> r = SendGarbage(port, g.bytes, absl::Seconds(20));
    ASSERT_TRUE(r.ok()) << g.name << ": " << r.status();
    EXPECT_TRUE(r->closed_by_peer) << g.name;
    EXPECT_EQ(r->bytes_received, 0u) << g.name;
  }
  // All of them at once.
  std::vector<std::thread> threads;
  std::atomic<int> closed{0};
  for (const auto& g : payloads) {
    threads.emplace_back([&, bytes = g.bytes] {
      absl::StatusOr<GarbageResult> r = SendGarbage(port, bytes, absl::Seconds(20));
      if (r.ok() && r->closed_by_peer && r->bytes_received == 0) ++closed;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(closed.load(), static_cast<int>(payloads.size()));
  // The established connection still carries bytes both ways.
  const auto data = Pattern(1 << 20, 4);
  DoneLog done;
  p.a->Send(p.to_b, 1, "after", AsPieces(data), done.Callback());
  ASSERT_TRUE(done.Wait(1));
  EXPECT_TRUE(done.statuses()[0].ok()) << done.statuses()[0];
  ASSERT_TRUE(p.hb.WaitReceived(2));
  EXPECT_TRUE(p.hb.received()[1].bytes == data);
  EXPECT_TRUE(p.hb.failed().empty());
  EXPECT_TRUE(p.ha.failed().empty());
  // And a new connection works.
  auto again = p.a->Connect(p.b->address(), kConnectMs);
  ASSERT_TRUE(again.ok()) << again.status();
  p.a->Send(*again, 1, "new", {}, [](const absl::Status&) {});
  ASSERT_TRUE(p.hb.WaitReceived(3));
  EXPECT_EQ(p.hb.received()[2].msg.header, "new");
}

// Half a greeting, then silence: closed once the handshake time is up.
TEST(UcxTransport, AStalledHandshakeIsClosedInTime) {
  TestHandler h;
  UcxOptions o = NoSelfCheck();
  o.handshake_timeout_ms = 200;
  auto t = NewUcxTransport(o);
  ASSERT_TRUE(t->Start("127.0.0.1:0", &h).ok());
  const std::string greeting = *ucx_wire::EncodeGreeting({ucx_wire::kAddress, 1, 2, "", "whatever"});
  absl::StatusOr<GarbageResult> r = SendGarbage(DataPort(*t), greeting.substr(0, 20), absl::Seconds(20));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->closed_by_peer);
  EXPECT_EQ(r->bytes_received, 0u);
}

// A well-formed greeting with a made-up worker address is answered (the
// transport's own greeting), but the address is never handed to UCX: with
// no UCX hello following, the connection is closed at the handshake timeout.
TEST(UcxTransport, AGreetingWithoutAUcxHelloIsAnsweredThenClosed) {
  TestHandler h;
  UcxOptions o = NoSelfCheck();
  o.handshake_timeout_ms = 200;
  auto t = NewUcxTransport(o);
  ASSERT_TRUE(t->Start("127.0.0.1:0", &h).ok());
  const std::string greeting = *ucx_wire::EncodeGreeting({ucx_wire::kAddress, 1, 2, "", ckpt::testing::SeededRandomBytes(300, 3)});
  absl::StatusOr<GarbageResult> r = SendGarbage(DataPort(*t), greeting, absl::Seconds(20));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->closed_by_peer);
  EXPECT_GT(r->bytes_received, ucx_wire::kGreetingFixedBytes);
  EXPECT_TRUE(h.failed().empty());
  // Bytes after a complete greeting are a protocol violation: closed at once.
  UcxOptions slow = NoSelfCheck();
  slow.handshake_timeout_ms = 60000;
  TestHandler h2;
  auto t2 = NewUcxTransport(slow);
  ASSERT_TRUE(t2->Start("127.0.0.1:0", &h2).ok());
  r = SendGarbage(DataPort(*t2), greeting + "extra", absl::Seconds(20));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->closed_by_peer);
}

// Idle or half-done connections cannot pile up: beyond max_pending_handshakes
// a new one is closed at once; once they go, peers connect again.
TEST(UcxTransport, IdleConnectionsBeyondTheLimitAreClosedAtOnce) {
  UcxOptions o = NoSelfCheck();
  o.max_pending_handshakes = 2;
  o.handshake_timeout_ms = 60000;
  TestHandler ha, hb;
  auto a = NewUcxTransport(NoSelfCheck());
  auto b = NewUcxTransport(o);
  ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
  ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());
  const ListeningSocket port = DataPort(*b);
  const int idle1 = IdleConnection(port.port);
  // The second sends a whole greeting but never the UCX hello: it counts too.
  const int idle2 = IdleConnection(port.port);
  const std::string greeting = *ucx_wire::EncodeGreeting({ucx_wire::kAddress, 9, 9, "", ckpt::testing::SeededRandomBytes(200, 9)});
  ASSERT_EQ(send(idle2, greeting.data(), greeting.size(), MSG_NOSIGNAL), static_cast<ssize_t>(greeting.size()));
  char reply[ucx_wire::kGreetingFixedBytes];
  ASSERT_EQ(recv(idle2, reply, sizeof(reply), MSG_WAITALL), static_cast<ssize_t>(sizeof(reply)));
  // The third: closed without waiting for the 60 s handshake timeout.
  absl::StatusOr<GarbageResult> r = SendGarbage(port, "", absl::Seconds(20));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->closed_by_peer);
  close(idle1);
  close(idle2);
  // The transport notices the two closes; a real peer then gets in.
  absl::StatusOr<PeerId> peer = absl::UnavailableError("not tried");
  for (int i = 0; i < 100 && !peer.ok(); ++i) {
    peer = a->Connect(b->address(), kConnectMs);
    if (!peer.ok()) absl::SleepFor(absl::Milliseconds(50));  // bounded retry on real sockets
  }
  ASSERT_TRUE(peer.ok()) << peer.status();
}

// Started on loopback, neither the data port nor UCX's own TCP transport
// listens anywhere but on loopback (UCX would otherwise open a port on every
// interface of the machine).
TEST(UcxTransport, ALoopbackTransportListensOnLoopbackOnly) {
  TestHandler h;
  auto t = NewUcxTransport(NoSelfCheck());
  ASSERT_TRUE(t->Start("127.0.0.1:0", &h).ok());
  absl::StatusOr<std::vector<ListeningSocket>> sockets = ckpt::testing::ListeningSockets(getpid());
  ASSERT_TRUE(sockets.ok()) << sockets.status();
  int tcp = 0;
  bool data_port = false;
  for (const ListeningSocket& s : *sockets) {
    if (s.kind != ListeningSocket::Kind::kTcp) continue;
    ++tcp;
    EXPECT_TRUE(absl::StartsWith(s.address, "127.")) << s.ToString();
    data_port |= absl::StrCat(s.address, ":", s.port) == t->address();
  }
  EXPECT_TRUE(data_port) << t->address();
  EXPECT_GE(tcp, 2) << "the data port and UCX's tcp transport on lo";
}

// Start's self-check connects the transport to itself through its data port.
TEST(UcxTransport, SelfCheckPassesAndPeersConnectAfterIt) {
  TestHandler ha, hb;
  auto a = NewUcxTransport(NoSelfCheck());
  auto b = NewUcxTransport();  // self-check on
  ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
  const absl::Status s = b->Start("127.0.0.1:0", &hb);
  ASSERT_TRUE(s.ok()) << s;
  auto peer = a->Connect(b->address(), kConnectMs);
  ASSERT_TRUE(peer.ok()) << peer.status();
  a->Send(*peer, 1, "x", {}, [](const absl::Status&) {});
  ASSERT_TRUE(hb.WaitReceived(1));
  EXPECT_TRUE(hb.failed().empty()) << "the self-check's connection is never reported";
}

// Connection ids are random, with or without a key: a process that reaches
// the UCX worker cannot guess the id of another connection (they used to be
// 1, 2, 3... without a key).
TEST(UcxTransport, ConnectionIdsAreRandomWithoutAKey) {
  TestHandler ha, hb;
  auto a = NewUcxTransport(NoSelfCheck());
  auto b = NewUcxTransport(NoSelfCheck());
  ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
  ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());
  std::vector<PeerId> ids;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<PeerId> id = a->Connect(b->address(), kConnectMs);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
    a->Send(*id, 1, absl::StrCat("m", i), {}, [](const absl::Status&) {});
  }
  ASSERT_TRUE(hb.WaitReceived(4));
  for (const auto& got : hb.received()) ids.push_back(got.msg.from);  // b's ids for them
  for (size_t i = 0; i < ids.size(); ++i) {
    // Each below 2^32 with probability 2^-32: small numbers are a counter.
    EXPECT_GE(ids[i], uint64_t{1} << 32) << "id " << ids[i];
    for (size_t j = 0; j < i; ++j) {
      EXPECT_NE(ids[i], ids[j]);
      EXPECT_NE(ids[i], ids[j] + 1) << "consecutive ids";
    }
  }
}

// A message that names an open connection's id but arrives on another UCX
// endpoint (another worker: c, which has a connection of its own to b) is
// dropped: it never reaches b's handler as a message from a.
TEST(UcxTransport, AMessageNamingAConnectionOnAnotherEndpointIsDropped) {
  // Before the transports: their threads run completions until they stop.
  DoneLog done;
  TestHandler ha, hb, hc;
  auto a = NewUcxTransport(NoSelfCheck());
  auto b = NewUcxTransport(NoSelfCheck());
  auto c = NewUcxTransport(NoSelfCheck());
  ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
  ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());
  ASSERT_TRUE(c->Start("127.0.0.1:0", &hc).ok());
  absl::StatusOr<PeerId> a_to_b = a->Connect(b->address(), kConnectMs);
  ASSERT_TRUE(a_to_b.ok()) << a_to_b.status();
  a->Send(*a_to_b, 1, "from a", {}, done.Callback());
  ASSERT_TRUE(hb.WaitReceived(1));
  const PeerId a_at_b = hb.received()[0].msg.from;  // what a's messages name at b
  absl::StatusOr<PeerId> c_to_b = c->Connect(b->address(), kConnectMs);
  ASSERT_TRUE(c_to_b.ok()) << c_to_b.status();
  // c slips a message naming a's connection in over its own endpoint, then
  // sends one of its own on the same endpoint (delivered after it).
  c->TEST_SendTampered(*c_to_b, a_at_b, TestTamper::kNone, 1, "forged", {}, done.Callback());
  c->Send(*c_to_b, 1, "from c", {}, done.Callback());
  ASSERT_TRUE(hb.WaitReceived(2));
  ASSERT_TRUE(done.Wait(3));
  // a's connection still works, and nothing failed.
  a->Send(*a_to_b, 1, "a again", {}, done.Callback());
  ASSERT_TRUE(hb.WaitReceived(3));
  std::vector<std::string> got;
  for (const auto& g : hb.received()) got.push_back(absl::StrCat(g.msg.header, g.msg.from == a_at_b ? " (a)" : ""));
  EXPECT_EQ(got, (std::vector<std::string>{"from a (a)", "from c", "a again (a)"}));
  EXPECT_TRUE(ha.failed().empty());
  EXPECT_TRUE(hb.failed().empty());
  EXPECT_TRUE(hc.failed().empty());
}

TEST(UcxTransport, RegisterMemoryMapsARange) {
  TestHandler h;
  auto t = NewUcxTransport(NoSelfCheck());
  ASSERT_TRUE(t->Start("127.0.0.1:0", &h).ok());
  std::vector<std::byte> arena(8 << 20);
  EXPECT_TRUE(t->RegisterMemory(arena.data(), arena.size()).ok());
}

}  // namespace
}  // namespace ckpt::transport

namespace ckpt::transport {
namespace {

UcxOptions Keyed(const std::string& key) {
  UcxOptions o = NoSelfCheck();
  o.auth_key = key;
  return o;
}

// With a cluster key, peers that hold it connect and exchange messages both
// ways (and the self-check, which connects to itself, passes).
TEST(UcxAuth, PeersWithTheSameKeyConnectAndExchange) {
  // The payloads and completion logs are declared before the transports and
  // each send's completion is waited for: a sender reads its payload until
  // its completion runs, which can follow the receiver's delivery.
  const std::vector<std::byte> reply = Pattern(1 << 20, 5);
  const std::vector<std::byte> data = Pattern(3 << 20, 9);
  DoneLog sent, replied;
  TestHandler ha, hb;
  UcxOptions checked = Keyed("cluster-key-0123456789");
  checked.self_check_timeout_ms = 5000;
  auto a = NewUcxTransport(checked);
  auto b = NewUcxTransport(Keyed("cluster-key-0123456789"));
  Transport* bp = b.get();
  hb.on_received = [&](const Inbound& msg, const absl::Status&) {
    bp->Send(msg.from, 2, "pong", AsPieces(reply), replied.Callback());
  };
  ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
  ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());
  absl::StatusOr<PeerId> to_b = a->Connect(b->address(), kConnectMs);
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  a->Send(*to_b, 1, "ping", AsPieces(data), sent.Callback());
  ASSERT_TRUE(hb.WaitReceived(1));
  EXPECT_TRUE(hb.received()[0].bytes == data);
  ASSERT_TRUE(ha.WaitReceived(1));
  EXPECT_TRUE(ha.received()[0].bytes == reply);
  ASSERT_TRUE(sent.Wait(1));
  ASSERT_TRUE(replied.Wait(1));
}

// A peer with another key, or none, never gets a connection: Connect fails,
// nothing reaches the other side's handler, and the refusing side still
// serves peers with its key.
TEST(UcxAuth, APeerWithAnotherKeyOrNoneIsRefused) {
  TestHandler hb;
  auto b = NewUcxTransport(Keyed("the-right-key-0123456"));
  ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());
  for (const std::string key : {"another-key-012345678", ""}) {
    TestHandler ha;
    auto a = NewUcxTransport(Keyed(key));
    ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
    absl::StatusOr<PeerId> to_b = a->Connect(b->address(), kConnectMs);
    EXPECT_FALSE(to_b.ok()) << "key \"" << key << "\" connected";
    // And the other way round: b refuses what a answers.
    absl::StatusOr<PeerId> to_a = b->Connect(a->address(), kConnectMs);
    EXPECT_FALSE(to_a.ok()) << "key \"" << key << "\" accepted";
    if (to_a.ok()) b->Send(*to_a, 1, "x", {}, [](const absl::Status&) {});
    if (to_b.ok()) a->Send(*to_b, 1, "x", {}, [](const absl::Status&) {});
    a->Stop();
    EXPECT_TRUE(ha.received().empty());
  }
  EXPECT_TRUE(hb.received().empty());
  TestHandler hc;
  auto c = NewUcxTransport(Keyed("the-right-key-0123456"));
  ASSERT_TRUE(c->Start("127.0.0.1:0", &hc).ok());
  absl::StatusOr<PeerId> ok = c->Connect(b->address(), kConnectMs);
  ASSERT_TRUE(ok.ok()) << ok.status();
  c->Send(*ok, 1, "hello", {}, [](const absl::Status&) {});
  ASSERT_TRUE(hb.WaitReceived(1));
  EXPECT_EQ(hb.received()[0].msg.header, "hello");
}

UcxOptions KeyLater() {
  UcxOptions o = NoSelfCheck();
  o.require_auth = true;
  return o;
}

// An agent whose meta serves TLS starts with require_auth and no key (meta
// hands it out at registration). Until it has one it connects to no one and
// answers no one, not even with its greeting (its worker address), and
// neither side is harmed: once the key is set, both ways work. Its Start's
// self-check passes without a key (it proves a throwaway one to itself).
TEST(UcxAuth, RequireAuthWithoutAKeyRefusesBothWaysUntilSetAuthKey) {
  const std::string key = "cluster-key-0123456789abcdef";
  TestHandler ha, hb;
  UcxOptions waiting = KeyLater();
  waiting.self_check_timeout_ms = 5000;
  auto a = NewUcxTransport(waiting);
  auto b = NewUcxTransport(Keyed(key));
  ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
  ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());

  absl::StatusOr<PeerId> to_b = a->Connect(b->address(), kConnectMs);
  ASSERT_FALSE(to_b.ok());
  EXPECT_EQ(to_b.status().code(), absl::StatusCode::kUnavailable) << to_b.status();
  EXPECT_TRUE(absl::StrContains(to_b.status().message(), "no data-plane key")) << to_b.status();
  absl::StatusOr<PeerId> to_a = b->Connect(a->address(), kConnectMs);
  ASSERT_FALSE(to_a.ok());
  EXPECT_EQ(to_a.status().code(), absl::StatusCode::kUnavailable) << to_a.status();
  // A well-formed greeting gets nothing back: the connection is closed
  // before a says anything.
  const std::string greeting = *ucx_wire::EncodeGreeting({ucx_wire::kKeyed, 7, 8, "", ""});
  absl::StatusOr<GarbageResult> r = SendGarbage(DataPort(*a), greeting, absl::Seconds(20));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->closed_by_peer);
  EXPECT_EQ(r->bytes_received, 0u);

  a->SetAuthKey(key);
  to_b = a->Connect(b->address(), kConnectMs);
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  to_a = b->Connect(a->address(), kConnectMs);
  ASSERT_TRUE(to_a.ok()) << to_a.status();
  DoneLog done;
  a->Send(*to_b, 1, "a->b", {}, done.Callback());
  b->Send(*to_a, 1, "b->a", {}, done.Callback());
  ASSERT_TRUE(done.Wait(2));
  ASSERT_TRUE(hb.WaitReceived(1));
  ASSERT_TRUE(ha.WaitReceived(1));
  EXPECT_EQ(hb.received()[0].msg.header, "a->b");
  EXPECT_EQ(ha.received()[0].msg.header, "b->a");
  EXPECT_TRUE(ha.failed().empty());
  EXPECT_TRUE(hb.failed().empty());
}

// Keys set with SetAuthKey: peers with another key are refused both ways;
// a connection keeps the key its handshake started with when the key
// changes, and new connections use the new one.
TEST(UcxAuth, SetAuthKeyAppliesToNewConnectionsAndAnotherKeyIsRefused) {
  const std::string k1 = "first-cluster-key-0123456789", k2 = "second-cluster-key-012345678";
  TestHandler ha, hb, hc;
  auto a = NewUcxTransport(KeyLater());
  auto b = NewUcxTransport(KeyLater());
  auto c = NewUcxTransport(KeyLater());
  a->SetAuthKey(k1);  // before Start
  ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
  ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());
  ASSERT_TRUE(c->Start("127.0.0.1:0", &hc).ok());
  b->SetAuthKey(k1);  // after Start
  c->SetAuthKey(k2);
  absl::StatusOr<PeerId> a_to_b = a->Connect(b->address(), kConnectMs);
  ASSERT_TRUE(a_to_b.ok()) << a_to_b.status();

  absl::StatusOr<PeerId> c_to_b = c->Connect(b->address(), kConnectMs);
  // The accepting side proves its key first: the connecting side refuses
  // it, and says why.
  ASSERT_FALSE(c_to_b.ok());
  EXPECT_EQ(c_to_b.status().code(), absl::StatusCode::kPermissionDenied) << c_to_b.status();
  absl::StatusOr<PeerId> b_to_c = b->Connect(c->address(), kConnectMs);
  ASSERT_FALSE(b_to_c.ok());
  EXPECT_EQ(b_to_c.status().code(), absl::StatusCode::kPermissionDenied) << b_to_c.status();
  EXPECT_TRUE(hc.received().empty());

  // b moves to k2: its connection with a (made under k1) goes on working,
  // a new one from a (still k1) is refused, c (k2) gets in.
  b->SetAuthKey(k2);
  DoneLog done;
  a->Send(*a_to_b, 1, "still", {}, done.Callback());
  ASSERT_TRUE(done.Wait(1));
  EXPECT_TRUE(done.statuses()[0].ok()) << done.statuses()[0];
  ASSERT_TRUE(hb.WaitReceived(1));
  EXPECT_EQ(hb.received()[0].msg.header, "still");
  const PeerId b_to_a = hb.received()[0].msg.from;
  b->Send(b_to_a, 1, "back", {}, done.Callback());
  ASSERT_TRUE(ha.WaitReceived(1));
  EXPECT_EQ(ha.received()[0].msg.header, "back");
  absl::StatusOr<PeerId> again = a->Connect(b->address(), kConnectMs);
  EXPECT_FALSE(again.ok()) << "a new connection under the old key";
  c_to_b = c->Connect(b->address(), kConnectMs);
  ASSERT_TRUE(c_to_b.ok()) << c_to_b.status();
  c->Send(*c_to_b, 1, "from c", {}, done.Callback());
  ASSERT_TRUE(hb.WaitReceived(2));
  EXPECT_EQ(hb.received()[1].msg.header, "from c");
  ASSERT_TRUE(done.Wait(3));
}

// With a key, the data port names its worker address (the way into UCX) only
// to a peer that proved the key: a greeting without a key is closed
// unanswered; a keyed one gets the accepting side's proof (and no address),
// and is closed, still without an address, when its own proof is wrong.
TEST(UcxAuth, AKeyedDataPortNamesItsWorkerOnlyToAPeerThatProvedTheKey) {
  const std::string key = "cluster-key-0123456789abcdef";
  TestHandler h;
  auto t = NewUcxTransport(Keyed(key));
  ASSERT_TRUE(t->Start("127.0.0.1:0", &h).ok());
  const std::string address = ckpt::testing::SeededRandomBytes(300, 5);
  absl::StatusOr<GarbageResult> r = SendGarbage(
      DataPort(*t), *ucx_wire::EncodeGreeting({ucx_wire::kAddress, 5, 6, "", address}), absl::Seconds(20));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->closed_by_peer);
  EXPECT_EQ(r->bytes_received, 0u);

  const int fd = IdleConnection(DataPort(*t).port);
  timeval tv{20, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  const std::string first = *ucx_wire::EncodeGreeting({ucx_wire::kKeyed, 5, 6, "", ""});
  ASSERT_EQ(send(fd, first.data(), first.size(), MSG_NOSIGNAL), static_cast<ssize_t>(first.size()));
  std::string reply(ucx_wire::kGreetingFixedBytes + ucx_wire::kProofBytes, '\0');
  ASSERT_EQ(recv(fd, reply.data(), reply.size(), MSG_WAITALL), static_cast<ssize_t>(reply.size()));
  ucx_wire::GreetingReader reader(ucx_wire::kKeyed | ucx_wire::kProof);
  absl::StatusOr<size_t> took = reader.Feed(reply);
  ASSERT_TRUE(took.ok()) << took.status();
  ASSERT_TRUE(reader.done());
  const ucx_wire::Greeting& g = reader.greeting();
  EXPECT_TRUE(g.worker_address.empty());
  EXPECT_TRUE(ucx_wire::SameProof(g.proof, ucx_wire::HandshakeProof(key, 'a', g.peer_id, g.nonce, 5, 6)))
      << "the accepting side proves the key first";
  const std::string wrong = *ucx_wire::EncodeGreeting(
      {ucx_wire::kKeyed | ucx_wire::kProof | ucx_wire::kAddress, 5, 6,
       ucx_wire::HandshakeProof("another-key-0123456789abcd", 'c', g.peer_id, g.nonce, 5, 6), address});
  ASSERT_EQ(send(fd, wrong.data(), wrong.size(), MSG_NOSIGNAL), static_cast<ssize_t>(wrong.size()));
  char more[64];
  EXPECT_LE(recv(fd, more, sizeof(more), 0), 0) << "closed, and no worker address";
  close(fd);
  EXPECT_TRUE(h.failed().empty());
  EXPECT_TRUE(h.received().empty());
}

// On a keyed connection every message is authenticated: a header whose tag
// does not match, a payload changed after it was tagged (eager or
// rendezvous, authenticated or encrypted) and a replayed sequence number
// are refused, never delivered as good, and the connection is closed (both
// sides learn it). The message before it arrived intact.
TEST(UcxAuth, ATamperedOrReplayedMessageIsRefusedAndClosesTheConnection) {
  const std::string key = "cluster-key-0123456789abcdef";
  struct Case {
    const char* name;
    TestTamper tamper;
    size_t payload;
    bool encrypt;
    bool delivered_as_error;  // the header passed: OnReceived gets DataLoss
  };
  const std::vector<Case> cases = {
      {"header tag", TestTamper::kHeaderTag, 0, false, false},
      {"replay", TestTamper::kReplay, 100, false, false},
      {"eager payload", TestTamper::kPayload, 1000, false, true},
      {"rendezvous payload", TestTamper::kPayload, 1 << 20, false, true},
      {"encrypted eager payload", TestTamper::kPayload, 1000, true, true},
      {"encrypted rendezvous payload", TestTamper::kPayload, 3 << 20, true, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::vector<std::byte> data = Pattern(std::max<size_t>(c.payload, 1), 3);
    DoneLog done;
    TestHandler ha, hb;
    UcxOptions sender = Keyed(key);
    sender.encrypt_payloads = c.encrypt;
    auto a = NewUcxTransport(sender);
    auto b = NewUcxTransport(Keyed(key));
    ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
    ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());
    absl::StatusOr<PeerId> to_b = a->Connect(b->address(), kConnectMs);
    ASSERT_TRUE(to_b.ok()) << to_b.status();
    const ConstPieces payload = c.payload == 0 ? ConstPieces{} : AsPieces(data);
    a->Send(*to_b, 1, "good", payload, done.Callback());
    ASSERT_TRUE(hb.WaitReceived(1));
    EXPECT_TRUE(hb.received()[0].status.ok()) << hb.received()[0].status;
    if (c.payload > 0) {
      EXPECT_TRUE(hb.received()[0].bytes == data);
    }
    a->TEST_SendTampered(*to_b, 0, c.tamper, 1, "bad", payload, done.Callback());
    ASSERT_TRUE(hb.WaitPeerFailed(1)) << "b closes the connection";
    ASSERT_TRUE(ha.WaitPeerFailed(1)) << "and a learns it";
    EXPECT_EQ(hb.failed()[0].second.code(), absl::StatusCode::kPermissionDenied) << hb.failed()[0].second;
    ASSERT_TRUE(done.Wait(2));
    const auto got = hb.received();
    ASSERT_EQ(got.size(), c.delivered_as_error ? 2u : 1u);
    if (c.delivered_as_error) {
      EXPECT_EQ(got[1].msg.header, "bad");
      EXPECT_EQ(got[1].status.code(), absl::StatusCode::kDataLoss) << got[1].status;
    }
  }
}

// With encrypt_payloads, payloads arrive intact, eager and rendezvous, in
// one piece or several; the receiver needs no setting (it takes either), and
// the other direction, not encrypted, works alongside.
TEST(UcxAuth, EncryptedPayloadsArriveIntact) {
  const std::string key = "cluster-key-0123456789abcdef";
  const std::vector<std::byte> small = Pattern(3000, 1), large = Pattern(5 << 20, 2), reply = Pattern(2 << 20, 3);
  DoneLog done;
  TestHandler ha, hb;
  hb.pieces = 3;
  UcxOptions encrypting = Keyed(key);
  encrypting.encrypt_payloads = true;
  auto a = NewUcxTransport(encrypting);
  auto b = NewUcxTransport(Keyed(key));
  ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
  ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());
  absl::StatusOr<PeerId> to_b = a->Connect(b->address(), kConnectMs);
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  a->Send(*to_b, 1, "small", AsPieces(small), done.Callback());
  const size_t half = large.size() / 2;
  a->Send(*to_b, 1, "large",
          {std::span<const std::byte>(large.data(), half), std::span<const std::byte>(large.data() + half, half)},
          done.Callback());
  ASSERT_TRUE(hb.WaitReceived(2));
  const PeerId to_a = hb.received()[0].msg.from;
  b->Send(to_a, 1, "reply", AsPieces(reply), done.Callback());
  ASSERT_TRUE(ha.WaitReceived(1));
  ASSERT_TRUE(done.Wait(3));
  for (const absl::Status& s : done.statuses()) EXPECT_TRUE(s.ok()) << s;
  const auto got = hb.received();
  EXPECT_TRUE(got[0].status.ok() && got[0].bytes == small) << got[0].status;
  EXPECT_TRUE(got[1].status.ok() && got[1].bytes == large) << got[1].status;
  EXPECT_TRUE(ha.received()[0].status.ok() && ha.received()[0].bytes == reply) << ha.received()[0].status;
  EXPECT_TRUE(ha.failed().empty());
  EXPECT_TRUE(hb.failed().empty());
}

TEST(UcxAuth, ProofsDependOnKeyRoleIdsAndNonces) {
  const std::string p = ucx_wire::HandshakeProof("k", 'h', 1, 2, 3, 4);
  EXPECT_EQ(p.size(), ucx_wire::kProofBytes);
  EXPECT_TRUE(ucx_wire::SameProof(p, ucx_wire::HandshakeProof("k", 'h', 1, 2, 3, 4)));
  EXPECT_FALSE(ucx_wire::SameProof(p, ucx_wire::HandshakeProof("K", 'h', 1, 2, 3, 4)));
  EXPECT_FALSE(ucx_wire::SameProof(p, ucx_wire::HandshakeProof("k", 'r', 1, 2, 3, 4)));
  EXPECT_FALSE(ucx_wire::SameProof(p, ucx_wire::HandshakeProof("k", 'h', 1, 2, 4, 3)));
  EXPECT_FALSE(ucx_wire::SameProof(p, ucx_wire::HandshakeProof("k", 'h', 2, 2, 3, 4)));
  EXPECT_FALSE(ucx_wire::SameProof(p, p.substr(0, 31)));
  EXPECT_NE(ucx_wire::RandomU64(), ucx_wire::RandomU64());
}

// --- node identities (node_identity.h) ---

std::string ReadWhole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::shared_ptr<const NodeCredentials> CredsOf(const ckpt::testing::TlsFilePaths& f) {
  absl::StatusOr<std::shared_ptr<const NodeCredentials>> c =
      NodeCredentials::FromPem(ReadWhole(f.ca), ReadWhole(f.cert), ReadWhole(f.key));
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : nullptr;
}

UcxOptions Identified(const std::string& key, std::shared_ptr<const NodeCredentials> creds) {
  UcxOptions o = Keyed(key);
  o.identity = [creds] { return creds; };
  return o;
}

constexpr char kClusterKey[] = "cluster-key-0123456789abcdef";

// Two nodes of the cluster's CA connect; each side knows which node the
// other is, messages flow both ways under keys that include the X25519
// secret (a side that mixed another secret would fail every message's
// MAC), and the self-check, which connects to itself, passes.
TEST(UcxIdentity, NodesProveWhoTheyAreAndEachSideKnowsTheOther) {
  const std::vector<std::byte> data = Pattern(2 << 20, 3);
  DoneLog sent, replied;
  TestHandler ha, hb;
  UcxOptions checked = Identified(kClusterKey, CredsOf(ckpt::testing::TestPki::Shared().Node("n1")));
  checked.self_check_timeout_ms = 5000;
  checked.encrypt_payloads = true;
  auto a = NewUcxTransport(checked);
  auto b = NewUcxTransport(Identified(kClusterKey, CredsOf(ckpt::testing::TestPki::Shared().Node("n2"))));
  Transport* bp = b.get();
  std::string b_saw;
  hb.on_received = [&](const Inbound& msg, const absl::Status&) {
    b_saw = bp->PeerIdentity(msg.from);
    bp->Send(msg.from, 2, "pong", {}, replied.Callback());
  };
  ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
  ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());
  absl::StatusOr<PeerId> to_b = a->Connect(b->address(), kConnectMs);
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  EXPECT_EQ(a->PeerIdentity(*to_b), "ckpt://node/n2");
  a->Send(*to_b, 1, "ping", AsPieces(data), sent.Callback());
  ASSERT_TRUE(hb.WaitReceived(1));
  EXPECT_TRUE(hb.received()[0].bytes == data);
  EXPECT_EQ(b_saw, "ckpt://node/n1");
  ASSERT_TRUE(ha.WaitReceived(1));
  EXPECT_EQ(ha.received()[0].msg.header, "pong");
  ASSERT_TRUE(sent.Wait(1));
  ASSERT_TRUE(replied.Wait(1));
  EXPECT_TRUE(ha.failed().empty());
  EXPECT_TRUE(hb.failed().empty());
  // Unknown and failed connections have no identity.
  EXPECT_EQ(a->PeerIdentity(*to_b + 1), "");
  a->Disconnect(*to_b);
  ASSERT_TRUE(ha.WaitPeerFailed(1));  // Disconnect reports the connection failed
  EXPECT_EQ(a->PeerIdentity(*to_b), "");
}

// The cluster key alone no longer connects: a process that holds it but no
// node certificate, or a node certificate of another CA, gets no connection
// either way, nothing reaches a handler, and a node of the cluster still
// connects afterwards.
TEST(UcxIdentity, TheKeyWithoutANodeCertificateOfTheClusterIsRefused) {
  TestHandler hb;
  auto b = NewUcxTransport(Identified(kClusterKey, CredsOf(ckpt::testing::TestPki::Shared().Node("n2"))));
  ASSERT_TRUE(b->Start("127.0.0.1:0", &hb).ok());

  absl::StatusOr<ckpt::testing::TempDir> made = ckpt::testing::TempDir::Create();
  ASSERT_TRUE(made.ok()) << made.status();
  const ckpt::testing::TempDir& dir = *made;
  ASSERT_TRUE(pki::CreateCa(dir.path() + "/ca").ok());
  pki::CertOptions o;
  o.identity = pki::Identity(pki::Role::kNode, "n1");
  o.hosts = {"127.0.0.1"};
  ASSERT_TRUE(pki::IssueCertificate(dir.path() + "/ca", o, dir.path() + "/n1").ok());
  std::shared_ptr<const NodeCredentials> foreign =
      CredsOf({dir.path() + "/ca/ca.pem", dir.path() + "/n1.pem", dir.path() + "/n1.key"});
  ASSERT_NE(foreign, nullptr);

  struct Stranger {
    std::string name;
    UcxOptions options;
  };
  for (const Stranger& who : {Stranger{"the key alone", Keyed(kClusterKey)},
                              Stranger{"another CA's node certificate", Identified(kClusterKey, foreign)}}) {
    SCOPED_TRACE(who.name);
    TestHandler ha;
    auto a = NewUcxTransport(who.options);
    ASSERT_TRUE(a->Start("127.0.0.1:0", &ha).ok());
    absl::StatusOr<PeerId> to_b = a->Connect(b->address(), kConnectMs);
    EXPECT_FALSE(to_b.ok()) << "connected";
    absl::StatusOr<PeerId> to_a = b->Connect(a->address(), kConnectMs);
    EXPECT_FALSE(to_a.ok()) << "accepted";
    if (to_a.ok()) b->Send(*to_a, 1, "x", {}, [](const absl::Status&) {});
    if (to_b.ok()) a->Send(*to_b, 1, "x", {}, [](const absl::Status&) {});
    a->Stop();
    EXPECT_TRUE(ha.received().empty());
  }
  EXPECT_TRUE(hb.received().empty());
  TestHandler hc;
  auto c = NewUcxTransport(Identified(kClusterKey, CredsOf(ckpt::testing::TestPki::Shared().Node("n3"))));
  ASSERT_TRUE(c->Start("127.0.0.1:0", &hc).ok());
  absl::StatusOr<PeerId> ok = c->Connect(b->address(), kConnectMs);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(c->PeerIdentity(*ok), "ckpt://node/n2");
  c->Send(*ok, 1, "hello", {}, [](const absl::Status&) {});
  ASSERT_TRUE(hb.WaitReceived(1));
  EXPECT_EQ(hb.received()[0].msg.header, "hello");
}

}  // namespace
}  // namespace ckpt::transport
