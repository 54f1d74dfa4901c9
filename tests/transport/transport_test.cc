// Loopback transport, chunked sends and the fault decorator.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "transport/bulk.h"
#include "transport/fault/fault_transport.h"
#include "transport/loopback/loopback_transport.h"
#include "test_handler.h"

namespace ckpt::transport {
namespace {

ConstPieces AsPieces(const std::vector<std::byte>& v) { return {std::span<const std::byte>(v)}; }

std::string Unique(const char* base) {
  static std::atomic<int> n{0};
  return absl::StrCat("loop:", base, "-", n++);
}

// Two started loopback transports, a connected to b.
struct Pair {
  explicit Pair(Transport* a_in = nullptr) {
    if (a_in == nullptr) {
      a_owned = NewLoopbackTransport();
      a = a_owned.get();
    } else {
      a = a_in;
    }
    b = NewLoopbackTransport();
  }
  // A transport's handler must outlive it (transport.h), and `a` may belong to the test
  // (declared before the Pair, so destroyed after ha): stop both before ha and hb go.
  ~Pair() {
    a->Stop();
    b->Stop();
  }
  void Start() {
    ASSERT_TRUE(a->Start(Unique("a"), &ha).ok());
    ASSERT_TRUE(b->Start(Unique("b"), &hb).ok());
    auto id = a->Connect(b->address(), 1000);
    ASSERT_TRUE(id.ok()) << id.status();
    to_b = *id;
  }
  std::unique_ptr<Transport> a_owned;
  Transport* a;
  std::unique_ptr<Transport> b;
  TestHandler ha, hb;
  PeerId to_b = 0;
};

TEST(Loopback, RoundTripScattersPayloadIntoPieces) {
  Pair p;
  p.hb.pieces = 3;
  ASSERT_NO_FATAL_FAILURE(p.Start());
  const auto data = Pattern((1 << 20) + 7, 1);
  DoneLog done;
  p.a->Send(p.to_b, 7, "hdr", AsPieces(data), done.Callback());
  ASSERT_TRUE(p.hb.WaitReceived(1));
  ASSERT_TRUE(done.Wait(1));
  auto got = p.hb.received();
  EXPECT_TRUE(got[0].status.ok());
  EXPECT_EQ(got[0].msg.type, 7);
  EXPECT_EQ(got[0].msg.header, "hdr");
  EXPECT_EQ(got[0].msg.payload_bytes, data.size());
  EXPECT_EQ(got[0].bytes, data);
  EXPECT_TRUE(done.statuses()[0].ok());
}

TEST(Loopback, EmptyPayloadSkipsAllocate) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(p.Start());
  DoneLog done;
  p.a->Send(p.to_b, 1, "empty", {}, done.Callback());
  ASSERT_TRUE(p.hb.WaitReceived(1));
  // The completion runs after delivery, on a's thread: wait for it, or it would write
  // into `done` after the test returned.
  ASSERT_TRUE(done.Wait(1));
  EXPECT_TRUE(done.statuses()[0].ok());
  EXPECT_EQ(p.hb.allocations(), 0);
  EXPECT_TRUE(p.hb.received()[0].status.ok());
  EXPECT_EQ(p.hb.received()[0].msg.payload_bytes, 0u);
}

TEST(Loopback, ReplyReachesTheConnectingSide) {
  Pair p;
  Transport* b = nullptr;
  p.hb.on_received = [&b](const Inbound& msg, const absl::Status&) {
    b->Send(msg.from, 2, "pong", {}, [](const absl::Status&) {});
  };
  b = p.b.get();
  ASSERT_NO_FATAL_FAILURE(p.Start());
  p.a->Send(p.to_b, 1, "ping", {}, [](const absl::Status&) {});
  ASSERT_TRUE(p.ha.WaitReceived(1));
  EXPECT_EQ(p.ha.received()[0].msg.header, "pong");
  EXPECT_EQ(p.ha.received()[0].msg.from, p.to_b);
}

TEST(Loopback, AllocateErrorReachesOnReceived) {
  Pair p;
  p.hb.allocate_error = absl::ResourceExhaustedError("no room");
  ASSERT_NO_FATAL_FAILURE(p.Start());
  const auto data = Pattern(100, 2);
  DoneLog done;
  p.a->Send(p.to_b, 1, "x", AsPieces(data), done.Callback());
  ASSERT_TRUE(p.hb.WaitReceived(1));
  EXPECT_EQ(p.hb.received()[0].status.code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(done.Wait(1));
}

TEST(Loopback, PeerStopFailsPeerAndLaterSends) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(p.Start());
  p.b->Stop();
  ASSERT_TRUE(p.ha.WaitPeerFailed(1));
  EXPECT_EQ(p.ha.failed()[0].first, p.to_b);
  DoneLog done;
  p.a->Send(p.to_b, 1, "late", {}, done.Callback());
  ASSERT_TRUE(done.Wait(1));
  EXPECT_EQ(done.statuses()[0].code(), absl::StatusCode::kUnavailable);
}

// Two connections between the same pair (two threads connected at once and
// one is closed): closing one fails only that one, at both ends; replies on
// the other still arrive. The loopback used to fail every connection of the
// pair at the accepting end, so its replies went nowhere and a read waited
// out the peer timeout (the flaky ADecodeNeverWaitsOnAHolderMetaCallsSuspect).
TEST(Loopback, ClosingOneConnectionKeepsTheOther) {
  Pair p;
  Transport* b = nullptr;
  p.hb.on_received = [&b](const Inbound& msg, const absl::Status&) {
    b->Send(msg.from, 2, absl::StrCat("pong-", msg.header), {}, [](const absl::Status&) {});
  };
  b = p.b.get();
  ASSERT_NO_FATAL_FAILURE(p.Start());
  absl::StatusOr<PeerId> extra = p.a->Connect(p.b->address(), 1000);
  ASSERT_TRUE(extra.ok()) << extra.status();
  ASSERT_NE(*extra, p.to_b);
  p.a->Disconnect(*extra);
  ASSERT_TRUE(p.hb.WaitPeerFailed(1));  // b sees exactly the closed connection go
  ASSERT_TRUE(p.ha.WaitPeerFailed(1));
  EXPECT_EQ(p.ha.failed()[0].first, *extra);
  p.a->Send(p.to_b, 1, "ping", {}, [](const absl::Status&) {});
  ASSERT_TRUE(p.ha.WaitReceived(1));
  EXPECT_EQ(p.ha.received()[0].msg.header, "pong-ping");
  EXPECT_EQ(p.ha.received()[0].msg.from, p.to_b);
  EXPECT_EQ(p.hb.failed().size(), 1u);
  EXPECT_EQ(p.ha.failed().size(), 1u);
}

// Counts sends in flight per peer, to check SendChunked's window.
class CountingTransport : public Transport {
 public:
  explicit CountingTransport(Transport* inner) : inner_(inner) {}
  absl::Status Start(const std::string& a, Handler* h) override { return inner_->Start(a, h); }
  std::string address() const override { return inner_->address(); }
  absl::StatusOr<PeerId> Connect(const std::string& a, int64_t t) override { return inner_->Connect(a, t); }
  void Send(PeerId peer, uint16_t type, std::string header, ConstPieces payload, SendDone done) override {
    {
      absl::MutexLock lock(&mu_);
      int& n = in_flight_[peer];
      ++n;
      max_in_flight_ = std::max(max_in_flight_, n);
    }
    inner_->Send(peer, type, std::move(header), std::move(payload),
                 [this, peer, done = std::move(done)](const absl::Status& s) {
                   {
                     absl::MutexLock lock(&mu_);
                     --in_flight_[peer];
                   }
                   done(s);
                 });
  }
  void Disconnect(PeerId p) override { inner_->Disconnect(p); }
  absl::Status RegisterMemory(void* b, size_t l) override { return inner_->RegisterMemory(b, l); }
  void Stop() override { inner_->Stop(); }
  int max_in_flight() {
    absl::MutexLock lock(&mu_);
    return max_in_flight_;
  }

 private:
  Transport* inner_;
  absl::Mutex mu_;
  std::map<PeerId, int> in_flight_ ABSL_GUARDED_BY(mu_);
  int max_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

// A receiver that reassembles chunks by the offset in their header.
struct Reassembler {
  explicit Reassembler(size_t n) : dest(n) {
    handler.allocate = [this](const Inbound& msg) -> absl::StatusOr<MutablePieces> {
      uint64_t offset = 0;
      if (!absl::SimpleAtoi(msg.header, &offset)) return absl::InvalidArgumentError("header");
      // Two pieces per chunk, to exercise scatter on the receiving side.
      MutablePieces whole{std::span<std::byte>(dest).subspan(offset, msg.payload_bytes)};
      const uint64_t half = msg.payload_bytes / 2;
      MutablePieces out = SlicePieces(whole, 0, half);
      for (auto& s : SlicePieces(whole, half, msg.payload_bytes - half)) out.push_back(s);
      return out;
    };
    handler.keep_bytes = false;
  }
  std::vector<std::byte> dest;
  TestHandler handler;
};

std::string OffsetHeader(const ChunkInfo& c) { return absl::StrCat(c.offset); }

TEST(Bulk, FanOutToTwoPeersReassemblesAndKeepsWindow) {
  // Handlers first: a transport's handler must outlive it (destroyed in reverse order).
  const auto data = Pattern((1 << 20) + 12345, 3);
  TestHandler ha;
  Reassembler r1(data.size()), r2(data.size());
  auto a_inner = NewLoopbackTransport();
  CountingTransport a(a_inner.get());
  auto b1 = NewLoopbackTransport();
  auto b2 = NewLoopbackTransport();
  ASSERT_TRUE(a.Start(Unique("a"), &ha).ok());
  ASSERT_TRUE(b1->Start(Unique("b1"), &r1.handler).ok());
  ASSERT_TRUE(b2->Start(Unique("b2"), &r2.handler).ok());
  std::vector<PeerId> peers{*a.Connect(b1->address(), 1000), *a.Connect(b2->address(), 1000)};
  // Source gathered from three pieces of uneven size.
  ConstPieces source{std::span<const std::byte>(data).subspan(0, 1000),
                     std::span<const std::byte>(data).subspan(1000, 500000),
                     std::span<const std::byte>(data).subspan(501000)};
  BulkOptions opt;
  opt.chunk_bytes = 64 << 10;
  opt.max_in_flight = 2;
  auto st = SendChunked(a, peers, 9, source, opt, OffsetHeader, RealClock());
  ASSERT_EQ(st.size(), 2u);
  EXPECT_TRUE(st[0].ok()) << st[0];
  EXPECT_TRUE(st[1].ok()) << st[1];
  const size_t chunks = (data.size() + opt.chunk_bytes - 1) / opt.chunk_bytes;
  ASSERT_TRUE(r1.handler.WaitReceived(chunks));
  ASSERT_TRUE(r2.handler.WaitReceived(chunks));
  EXPECT_TRUE(r1.dest == data);
  EXPECT_TRUE(r2.dest == data);
  EXPECT_LE(a.max_in_flight(), opt.max_in_flight);
  EXPECT_GE(a.max_in_flight(), 1);
}

TEST(Bulk, OnePeerFailingLeavesTheOtherOk) {
  // Handlers first: a transport's handler must outlive it (destroyed in reverse order).
  const auto data = Pattern(10 * 1000, 4);
  TestHandler ha;
  Reassembler r1(data.size()), r2(data.size());
  auto a_inner = NewLoopbackTransport();
  FaultTransport a(a_inner.get());
  auto b1 = NewLoopbackTransport();
  auto b2 = NewLoopbackTransport();
  ASSERT_TRUE(a.Start(Unique("a"), &ha).ok());
  ASSERT_TRUE(b1->Start(Unique("b1"), &r1.handler).ok());
  ASSERT_TRUE(b2->Start(Unique("b2"), &r2.handler).ok());
  std::vector<PeerId> peers{*a.Connect(b1->address(), 1000), *a.Connect(b2->address(), 1000)};
  // Chunk-major order: sends alternate b1, b2; the third is b1's second chunk.
  a.FailNthSend(3);
  BulkOptions opt;
  opt.chunk_bytes = 1000;
  auto st = SendChunked(a, peers, 9, AsPieces(data), opt, OffsetHeader, RealClock());
  EXPECT_EQ(st[0].code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(st[1].ok()) << st[1];
  ASSERT_TRUE(r2.handler.WaitReceived(10));
  EXPECT_TRUE(r2.dest == data);
}

TEST(Bulk, RateLimitPacesChunksOnTheClock) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(p.Start());
  FakeClock clock;
  const absl::Time t0 = clock.MonotonicNow();
  const auto data = Pattern(4 * 1024, 5);
  BulkOptions opt;
  opt.chunk_bytes = 1024;
  opt.max_bytes_per_second = 1024;  // one chunk per second
  std::vector<absl::Status> st;
  std::thread sender([&] {
    PeerId peer = p.to_b;
    st = SendChunked(*p.a, std::span<const PeerId>(&peer, 1), 1, AsPieces(data), opt,
                     [](const ChunkInfo& c) { return absl::StrCat("c", c.index); }, &clock);
  });
  for (size_t k = 1; k <= 3; ++k) {
    ASSERT_TRUE(p.hb.WaitReceived(k));
    clock.BlockUntilWaiters(1);
    EXPECT_EQ(p.hb.received().size(), k) << "a chunk went out before its time";
    clock.Advance(absl::Seconds(1));
  }
  sender.join();
  ASSERT_TRUE(p.hb.WaitReceived(4));
  EXPECT_TRUE(st[0].ok());
  EXPECT_EQ(clock.MonotonicNow() - t0, absl::Seconds(3));
}

TEST(FaultTransport, FailsTheNthSendWithoutDelivering) {
  auto inner = std::make_unique<FaultTransport>(NewLoopbackTransport());
  FaultTransport* f = inner.get();
  Pair p(f);
  ASSERT_NO_FATAL_FAILURE(p.Start());
  f->FailNthSend(2);
  DoneLog done;
  for (int i = 0; i < 3; ++i) p.a->Send(p.to_b, 1, absl::StrCat("m", i), {}, done.Callback());
  ASSERT_TRUE(done.Wait(3));
  ASSERT_TRUE(p.hb.WaitReceived(2));
  int unavailable = 0;
  for (const auto& s : done.statuses()) unavailable += s.code() == absl::StatusCode::kUnavailable;
  EXPECT_EQ(unavailable, 1);
  auto got = p.hb.received();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].msg.header, "m0");
  EXPECT_EQ(got[1].msg.header, "m2");
  EXPECT_EQ(f->sends(), 3);
}

TEST(FaultTransport, CountsOnlyTheFilteredType) {
  auto inner = std::make_unique<FaultTransport>(NewLoopbackTransport());
  FaultTransport* f = inner.get();
  Pair p(f);
  ASSERT_NO_FATAL_FAILURE(p.Start());
  f->FailNthSend(1, /*type=*/5);
  DoneLog done;
  p.a->Send(p.to_b, 4, "a", {}, done.Callback());
  p.a->Send(p.to_b, 5, "b", {}, done.Callback());
  ASSERT_TRUE(done.Wait(2));
  ASSERT_TRUE(p.hb.WaitReceived(1));
  EXPECT_EQ(p.hb.received()[0].msg.header, "a");
}

TEST(FaultTransport, CorruptsExactlyOneByteInFlight) {
  auto inner = std::make_unique<FaultTransport>(NewLoopbackTransport());
  FaultTransport* f = inner.get();
  Pair p(f);
  p.hb.pieces = 2;
  ASSERT_NO_FATAL_FAILURE(p.Start());
  f->CorruptNthSend(1, 1234);
  const auto data = Pattern(4096, 6);
  const auto before = data;
  ConstPieces src{std::span<const std::byte>(data).subspan(0, 1000),
                  std::span<const std::byte>(data).subspan(1000)};
  DoneLog done;
  p.a->Send(p.to_b, 1, "c", src, done.Callback());
  ASSERT_TRUE(p.hb.WaitReceived(1));
  ASSERT_TRUE(done.Wait(1));
  const std::vector<TestHandler::Got> received = p.hb.received();  // a copy: keep it alive
  const std::vector<std::byte>& got = received[0].bytes;
  ASSERT_EQ(got.size(), data.size());
  int diffs = 0;
  for (size_t i = 0; i < got.size(); ++i) diffs += got[i] != data[i];
  EXPECT_EQ(diffs, 1);
  EXPECT_NE(got[1234], data[1234]);
  EXPECT_EQ(data, before) << "the sender's memory must stay intact";
}

TEST(FaultTransport, StallsUntilReleased) {
  auto inner = std::make_unique<FaultTransport>(NewLoopbackTransport());
  FaultTransport* f = inner.get();
  Pair p(f);
  ASSERT_NO_FATAL_FAILURE(p.Start());
  f->StallNthSend(1);
  DoneLog done;
  p.a->Send(p.to_b, 1, "held", {}, done.Callback());
  EXPECT_EQ(f->stalled(), 1);
  EXPECT_TRUE(done.statuses().empty());
  EXPECT_TRUE(p.hb.received().empty());
  f->Release();
  ASSERT_TRUE(p.hb.WaitReceived(1));
  ASSERT_TRUE(done.Wait(1));
  EXPECT_TRUE(done.statuses()[0].ok());
  EXPECT_EQ(f->stalled(), 0);
}

TEST(FaultTransport, StopCancelsStalledSends) {
  auto f = std::make_unique<FaultTransport>(NewLoopbackTransport());
  Pair p(f.get());
  ASSERT_NO_FATAL_FAILURE(p.Start());
  f->StallNthSend(1);
  DoneLog done;
  p.a->Send(p.to_b, 1, "held", {}, done.Callback());
  f->Stop();
  ASSERT_TRUE(done.Wait(1, absl::ZeroDuration()));
  EXPECT_EQ(done.statuses()[0].code(), absl::StatusCode::kCancelled);
}

TEST(FaultTransport, DroppedPeerFailsSends) {
  auto inner = std::make_unique<FaultTransport>(NewLoopbackTransport());
  FaultTransport* f = inner.get();
  Pair p(f);
  ASSERT_NO_FATAL_FAILURE(p.Start());
  f->DropPeer(p.to_b);
  ASSERT_TRUE(p.ha.WaitPeerFailed(1));
  ASSERT_TRUE(p.hb.WaitPeerFailed(1));  // the other side sees the connection go
  DoneLog done;
  p.a->Send(p.to_b, 1, "x", {}, done.Callback());
  ASSERT_TRUE(done.Wait(1));
  EXPECT_EQ(done.statuses()[0].code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(p.hb.received().empty());
}

}  // namespace
}  // namespace ckpt::transport
