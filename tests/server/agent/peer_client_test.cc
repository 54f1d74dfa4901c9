// PeerClient on its own: one PeerNode's PeerClient against RawPeers that
// play the holder of a read or the target of a push by hand, so every way a
// peer can answer, misbehave or die is checked as the reader or pusher sees
// it: bytes checked chunk by chunk and as a whole (DataLoss when they do not
// match), the holder's refusal passed on naming the node, a holder that dies
// mid-read Unavailable, one that stalls DeadlineExceeded after the peer
// timeout; a push fanned out to several targets with one answer each, a
// target that dies after its acknowledgement, and one that never confirms
// told to let go.
//
// Time is the node's FakeClock: a test advances it only once the PeerClient
// waits on it (BlockUntilWaiters). Waits for the transport's thread are
// bounded condition waits (RawPeer::kWait).
#include "server/agent/peer_client.h"

#include <atomic>
#include <optional>
#include <string>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "peer_node.h"
#include "raw_peer.h"

namespace ckpt::agent {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kChunk = 1000;
constexpr int64_t kPeerTimeoutMs = 20000;

// What a hand-played push target does.
struct TargetScript {
  absl::Status ack = absl::OkStatus();   // the answer to the begin
  bool confirm = true;                   // send kPutDone once every byte arrived
  absl::Status done = absl::OkStatus();  // ... with this status
};

RawPeer::Responder Target(TargetScript script) {
  auto received = std::make_shared<std::map<uint64_t, uint64_t>>();  // xfer -> bytes (transport thread only)
  auto totals = std::make_shared<std::map<uint64_t, uint64_t>>();
  return [script = std::move(script), received, totals](RawPeer& self, const RawPeer::Message& m) {
    if (m.type == kPutBegin) {
      absl::StatusOr<PutBegin> b = DecodePutBegin(m.header);
      ASSERT_TRUE(b.ok()) << b.status();
      (*totals)[b->xfer] = b->total_bytes;
      self.Send(m.from, kPutAck, EncodeResult(Result{b->xfer, script.ack}));
    } else if (m.type == kPutChunk) {
      absl::StatusOr<Chunk> c = DecodeChunk(m.header);
      ASSERT_TRUE(c.ok()) << c.status();
      EXPECT_EQ(c->crc32c, Crc32c(m.payload)) << "chunk at " << c->offset;
      if ((*received)[c->id] += m.payload.size(); (*received)[c->id] == (*totals)[c->id] && script.confirm) {
        self.Send(m.from, kPutDone, EncodeResult(Result{c->id, script.done}));
      }
    }
  };
}

// The payloads of the kPutChunk messages `peer` got, put together by offset.
std::string Assembled(RawPeer& peer) {
  std::map<uint64_t, std::string> chunks;
  for (const RawPeer::Message& m : peer.Got()) {
    if (m.type != kPutChunk) continue;
    absl::StatusOr<Chunk> c = DecodeChunk(m.header);
    if (c.ok()) chunks[c->offset] = m.payload;
  }
  std::string out;
  for (const auto& [offset, piece] : chunks) out += piece;
  return out;
}

class PeerClientTest : public ::testing::Test {
 protected:
  PeerClientTest() : a_("a", PeerNode::Options{.peer_timeout_ms = kPeerTimeoutMs}) {}

  static PeerEndpoint Endpoint(const std::string& node, const RawPeer& peer, uint64_t incarnation = 4) {
    return PeerEndpoint{node, incarnation, peer.address(), false};
  }
  static ReadReq ShardRead(uint64_t offset, uint64_t length) {
    ReadReq r;
    r.what = ReadWhat::kShard;
    r.job_id = "job";
    r.step = 5;
    r.rank = 1;
    r.offset = offset;
    r.length = length;
    return r;
  }
  // Reads `length` bytes from `holder` into a fresh buffer; the result and the buffer.
  std::pair<absl::StatusOr<uint32_t>, std::string> ReadFrom(const RawPeer& holder, uint64_t offset, uint64_t length) {
    auto dest = std::make_shared<std::string>(length, '\0');
    absl::StatusOr<uint32_t> crc =
        a_.client().Read(Endpoint("h", holder), ShardRead(offset, length),
                         {std::as_writable_bytes(std::span<char>(dest->data(), dest->size()))}, dest);
    return {crc, *dest};
  }
  // Starts a read of `length` bytes from `holder` into a fresh buffer (kept
  // alive by the read); the read's id.
  absl::StatusOr<uint64_t> StartReadFrom(const RawPeer& holder, uint64_t length) {
    auto dest = std::make_shared<std::string>(length, '\0');
    return a_.client().StartRead(Endpoint("h", holder), ShardRead(0, length),
                                 {std::as_writable_bytes(std::span<char>(dest->data(), dest->size()))}, dest);
  }
  static PutBegin ReplicaBegin(const std::string& content) {
    PutBegin b;
    b.kind = PutKind::kReplica;
    b.task_id = "t-1";
    b.job_id = "job";
    b.step = 5;
    b.rank = 1;
    b.total_bytes = content.size();
    b.crc32c = Crc32c(content);
    return b;
  }
  static transport::ConstPieces Source(const std::string& content) {
    return {std::as_bytes(std::span<const char>(content.data(), content.size()))};
  }

  PeerNode a_;
};

TEST_F(PeerClientTest, AReadChecksEveryChunkAndTheWholeAndSaysWhoAsks) {
  RawPeer h;
  const std::string content = SeededBytes(4500, 1);
  h.set_responder(Holder({.content = content}));
  auto [crc, bytes] = ReadFrom(h, 0, content.size());
  ASSERT_TRUE(crc.ok()) << crc.status();
  EXPECT_EQ(*crc, Crc32c(content));
  EXPECT_EQ(bytes, content);

  auto [part_crc, part] = ReadFrom(h, 1234, 2000);
  ASSERT_TRUE(part_crc.ok()) << part_crc.status();
  EXPECT_EQ(part, content.substr(1234, 2000));

  // The request names the reader and the incarnation of the holder it meant.
  const std::vector<RawPeer::Message> reqs = h.AwaitType(kReadReq, 1);
  ASSERT_FALSE(reqs.empty());
  absl::StatusOr<ReadReq> req = DecodeReadReq(reqs[0].header);
  ASSERT_TRUE(req.ok());
  EXPECT_EQ(req->sender_node_id, "a");
  EXPECT_EQ(req->sender_incarnation, 1u);
  EXPECT_EQ(req->target_incarnation, 4u);
}

TEST_F(PeerClientTest, AChunkCorruptedOnTheWayIsDataLoss) {
  RawPeer h;
  const std::string content = SeededBytes(4500, 2);
  h.set_responder(Holder({.content = content, .spoil_chunk = [](uint64_t offset, std::string& piece) {
                            if (offset == 2 * kChunk) piece[5] ^= 0x10;
                          }}));
  auto [crc, bytes] = ReadFrom(h, 0, content.size());
  EXPECT_EQ(crc.status().code(), absl::StatusCode::kDataLoss) << crc.status();
  EXPECT_THAT(crc.status().message(), HasSubstr("reading from node \"h\": chunk at offset 2000: crc32c"));
}

TEST_F(PeerClientTest, BytesThatDoNotMatchTheHoldersAnnouncedCrcAreDataLoss) {
  // Every chunk is as sent, but the whole is not what the holder announced.
  RawPeer h;
  const std::string content = SeededBytes(4500, 3);
  h.set_responder(Holder({.content = content, .spoil_end = [](Result& end) { end.crc32c ^= 1; }}));
  auto [crc, bytes] = ReadFrom(h, 0, content.size());
  EXPECT_EQ(crc.status().code(), absl::StatusCode::kDataLoss) << crc.status();
  EXPECT_THAT(crc.status().message(), HasSubstr("node \"h\" sent bytes with crc32c"));
}

TEST_F(PeerClientTest, TheHoldersRefusalIsPassedOnNamingTheNode) {
  RawPeer h;
  h.set_responder(Holder({.content = SeededBytes(4500, 4), .chunks = 0, .spoil_end = [](Result& end) {
                            end.status = absl::NotFoundError("shard job/5/1 is not held here");
                            end.bytes = 0;
                          }}));
  auto [crc, bytes] = ReadFrom(h, 0, 4500);
  EXPECT_EQ(crc.status().code(), absl::StatusCode::kNotFound) << crc.status();
  EXPECT_THAT(crc.status().message(), HasSubstr("reading from node \"h\": shard job/5/1 is not held here"));
}

TEST_F(PeerClientTest, AnUnreachableHolderIsUnavailable) {
  RawPeer h;
  const std::string address = h.address();
  h.Stop();
  auto dest = std::make_shared<std::string>(10, '\0');
  absl::StatusOr<uint32_t> crc =
      a_.client().Read(PeerEndpoint{"h", 4, address, false}, ShardRead(0, 10),
                       {std::as_writable_bytes(std::span<char>(dest->data(), dest->size()))}, dest);
  EXPECT_EQ(crc.status().code(), absl::StatusCode::kUnavailable) << crc.status();
}

TEST_F(PeerClientTest, AHolderThatDiesMidReadIsUnavailableAndNoLandingOutlivesIt) {
  RawPeer h;
  const std::string content = SeededBytes(4500, 5);
  h.set_responder(Holder({.content = content, .chunks = 2, .send_end = false}));
  absl::StatusOr<uint64_t> id = StartReadFrom(h, content.size());
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_EQ(h.AwaitType(kReadReq, 1).size(), 1u);
  h.Stop();  // as the holder's process dying
  absl::StatusOr<uint32_t> crc = a_.client().FinishRead(*id);
  EXPECT_EQ(crc.status().code(), absl::StatusCode::kUnavailable) << crc.status();
  EXPECT_THAT(crc.status().message(), HasSubstr("reading from node \"h\": peer connection lost"));
  EXPECT_EQ(a_.client().landings(), 0u);
}

TEST_F(PeerClientTest, AHolderThatStallsIsDeadlineExceededAfterThePeerTimeout) {
  RawPeer h;
  const std::string content = SeededBytes(4500, 6);
  // Nothing comes back (a chunk landing after the clock moved would count as
  // progress: this test leaves no such race).
  h.set_responder(Holder({.content = content, .chunks = 0, .send_end = false}));
  absl::StatusOr<uint64_t> id = StartReadFrom(h, content.size());
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<uint32_t> crc = absl::UnknownError("not finished");
  std::thread reader([&] { crc = a_.client().FinishRead(*id); });
  a_.tier().clock().BlockUntilWaiters(1);
  a_.tier().clock().Advance(absl::Milliseconds(kPeerTimeoutMs));
  reader.join();
  EXPECT_EQ(crc.status().code(), absl::StatusCode::kDeadlineExceeded) << crc.status();
  EXPECT_THAT(crc.status().message(), HasSubstr("node \"h\" sent nothing for 20000 ms (0 of 4500 bytes read)"));
}

// What a racing restore sees of a read (restorer.h "Hedging"): when its last
// chunk landed (none yet: the infinite past) and, once it is cancelled, the
// cancel's status at once, with no landing left behind.
TEST_F(PeerClientTest, AReadShowsItsLastChunkAndEndsAtOnceWhenCancelled) {
  RawPeer h;
  const std::string content = SeededBytes(4500, 7);
  h.set_responder(Holder({.content = content, .chunks = 2, .send_end = false}));
  absl::StatusOr<uint64_t> id = StartReadFrom(h, content.size());
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_EQ(h.AwaitType(kReadReq, 1).size(), 1u);
  while (a_.tier().metrics().peer_received_bytes->Value() < 2.0 * kChunk) std::this_thread::yield();
  const absl::Time landed = a_.tier().clock().MonotonicNow();
  a_.tier().clock().Advance(absl::Seconds(3));  // the last chunk stays where it landed
  EXPECT_EQ(a_.client().LastChunk(*id), std::optional<absl::Time>(landed));
  a_.client().Cancel(*id, absl::CancelledError("another source served"));
  EXPECT_EQ(a_.client().LastChunk(*id), std::nullopt);  // ended
  absl::StatusOr<uint32_t> crc = a_.client().FinishRead(*id);
  EXPECT_EQ(crc.status().code(), absl::StatusCode::kCancelled) << crc.status();
  EXPECT_THAT(crc.status().message(), HasSubstr("another source served"));
  EXPECT_EQ(a_.client().LastChunk(*id), std::nullopt);  // forgotten
  a_.client().Cancel(*id, absl::CancelledError("again"));  // no-op on a forgotten read
  EXPECT_EQ(a_.client().landings(), 0u);
}

TEST_F(PeerClientTest, AReadBeforeItsFirstChunkHasNoLastChunk) {
  RawPeer h;  // answers nothing
  absl::StatusOr<uint64_t> id = StartReadFrom(h, 100);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(a_.client().LastChunk(*id), std::optional<absl::Time>(absl::InfinitePast()));
  a_.client().Cancel(*id, absl::OkStatus());  // an OK status still ends it, as cancelled
  EXPECT_EQ(a_.client().FinishRead(*id).status().code(), absl::StatusCode::kCancelled);
}

TEST_F(PeerClientTest, APushGetsOneAnswerPerTargetEachWithItsOwnTransfer) {
  RawPeer b, c, d;
  b.set_responder(Target({}));
  c.set_responder(Target({.ack = absl::ResourceExhaustedError("no room for 4500 bytes")}));
  d.set_responder(Target({.ack = absl::AlreadyExistsError("held here")}));
  const std::string content = SeededBytes(4500, 7);
  const std::vector<absl::Status> out =
      a_.client().Push({Endpoint("b", b, 2), Endpoint("c", c, 3), Endpoint("d", d)}, ReplicaBegin(content), "record",
                       Source(content));
  ASSERT_EQ(out.size(), 3u);
  EXPECT_TRUE(out[0].ok()) << out[0];
  EXPECT_EQ(out[1].code(), absl::StatusCode::kResourceExhausted) << out[1];
  EXPECT_THAT(out[1].message(), HasSubstr("no room for 4500 bytes"));
  EXPECT_TRUE(out[2].ok()) << out[2];  // it holds the copy already

  EXPECT_EQ(Assembled(b), content);
  EXPECT_TRUE(Assembled(c).empty());  // refused: no bytes sent
  EXPECT_TRUE(Assembled(d).empty());
  // Each begin names its target's incarnation, the sender, and carries the record.
  for (auto [peer, incarnation] : std::vector<std::pair<RawPeer*, uint64_t>>{{&b, 2}, {&c, 3}}) {
    const std::vector<RawPeer::Message> begins = peer->AwaitType(kPutBegin, 1);
    ASSERT_EQ(begins.size(), 1u);
    absl::StatusOr<PutBegin> begin = DecodePutBegin(begins[0].header);
    ASSERT_TRUE(begin.ok());
    EXPECT_EQ(begin->target_incarnation, incarnation);
    EXPECT_EQ(begin->sender_node_id, "a");
    EXPECT_EQ(begins[0].payload, "record");
  }
}

TEST_F(PeerClientTest, ATargetThatRefusesTheBytesAtTheEndIsItsRefusal) {
  RawPeer b;
  b.set_responder(Target({.done = absl::DataLossError("received bytes have crc32c 0x1, expected 0x2")}));
  const std::string content = SeededBytes(4500, 8);
  const std::vector<absl::Status> out = a_.client().Push({Endpoint("b", b)}, ReplicaBegin(content), "", Source(content));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].code(), absl::StatusCode::kDataLoss) << out[0];
  EXPECT_THAT(out[0].message(), HasSubstr("received bytes have crc32c"));
}

TEST_F(PeerClientTest, ATargetThatDiesAfterItsAcknowledgementIsUnavailable) {
  RawPeer b;
  b.set_responder(Target({.confirm = false}));
  const std::string content = SeededBytes(4500, 9);
  std::vector<absl::Status> out;
  std::thread pusher([&] { out = a_.client().Push({Endpoint("b", b)}, ReplicaBegin(content), "", Source(content)); });
  ASSERT_GE(b.AwaitType(kPutChunk, 1).size(), 1u);
  b.Stop();
  pusher.join();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].code(), absl::StatusCode::kUnavailable) << out[0];
}

TEST_F(PeerClientTest, ATargetThatNeverConfirmsIsDeadlineExceededAndToldToLetGo) {
  RawPeer b;
  b.set_responder(Target({.confirm = false}));
  const std::string content = SeededBytes(4500, 10);
  std::vector<absl::Status> out;
  std::thread pusher([&] { out = a_.client().Push({Endpoint("b", b)}, ReplicaBegin(content), "", Source(content)); });
  ASSERT_EQ(b.AwaitType(kPutChunk, 5).size(), 5u);  // every byte arrived; the client now waits for the confirmation
  a_.tier().clock().BlockUntilWaiters(1);
  a_.tier().clock().Advance(absl::Milliseconds(kPeerTimeoutMs));
  pusher.join();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].code(), absl::StatusCode::kDeadlineExceeded) << out[0];
  EXPECT_THAT(out[0].message(), HasSubstr("node \"b\" did not confirm a push within 20000 ms"));
  // The target is told to let go of what it reserved.
  const std::vector<RawPeer::Message> aborts = b.AwaitType(kPutAbort, 1);
  ASSERT_EQ(aborts.size(), 1u);
  absl::StatusOr<Result> abort = DecodeResult(aborts[0].header);
  ASSERT_TRUE(abort.ok());
  EXPECT_EQ(abort->status.code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(PeerClientTest, AfterStopNoPushOrReadStarts) {
  RawPeer b;
  b.set_responder(Target({}));
  a_.client().Stop();
  const std::string content = SeededBytes(100, 11);
  const std::vector<absl::Status> out = a_.client().Push({Endpoint("b", b)}, ReplicaBegin(content), "", Source(content));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].code(), absl::StatusCode::kCancelled) << out[0];
  auto dest = std::make_shared<std::string>(10, '\0');
  absl::StatusOr<uint64_t> id = a_.client().StartRead(
      Endpoint("b", b), ShardRead(0, 10), {std::as_writable_bytes(std::span<char>(dest->data(), dest->size()))}, dest);
  EXPECT_EQ(id.status().code(), absl::StatusCode::kCancelled) << id.status();
}

}  // namespace
}  // namespace ckpt::agent
