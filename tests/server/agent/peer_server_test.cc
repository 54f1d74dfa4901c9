// PeerServer on its own: one PeerNode (its PeerServer over a MemoryTier, a
// FakeMeta behind its MetaSession, the loopback transport) and a RawPeer
// that writes the data-plane messages by hand, so every answer to a push or
// a read, bad ones included, is checked as the sender sees it: replicas
// stored, reported to meta, then confirmed; bad pushes refused at once with
// the reason; chunks and wholes whose crc does not match refused as DataLoss
// with their space freed; a sender that dies or stalls mid-push leaves
// nothing behind; reads served in checked chunks, refused with the reason,
// and a copy that went bad in memory quarantined.
//
// Time is the node's FakeClock; waits for the transport's thread are bounded
// condition waits (RawPeer::kWait), and the few states with nothing to wait
// on (a push dropped when its sender died) are polled within that bound.
#include "server/agent/peer_server.h"

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "peer_node.h"
#include "raw_peer.h"
#include "support/eventually.h"

namespace ckpt::agent {
namespace {

using ::testing::HasSubstr;
using ckpt::testing::Eventually;

constexpr uint64_t kChunk = 1000;
constexpr int64_t kPeerTimeoutMs = 20000;

class PeerServerTest : public ::testing::Test {
 protected:
  PeerServerTest() : b_("b", PeerNode::Options{.peer_timeout_ms = kPeerTimeoutMs, .run_session = true}) {
    to_b_ = a_.Connect(b_.endpoint().data_address);
    free_at_start_ = b_.tier().arena().free_bytes();
  }

  // A replica push of `content` as shard `id`: its begin (with a record that
  // agrees with it) and the record.
  static std::pair<PutBegin, std::string> ReplicaPush(uint64_t xfer, const ShardId& id, const std::string& content) {
    const ShardRecord rec = RecordOf(id, content);
    PutBegin b;
    b.xfer = xfer;
    b.kind = PutKind::kReplica;
    b.task_id = absl::StrCat("t-", xfer);
    b.job_id = id.job_id;
    b.step = id.step;
    b.rank = id.rank;
    b.total_bytes = content.size();
    b.crc32c = rec.crc32c;
    b.sender_node_id = "a";
    b.sender_incarnation = 1;
    return {b, EncodeShardRecord(rec)};
  }

  // Sends the begin and returns the acknowledgement.
  absl::Status Begin(const PutBegin& b, const std::string& record) {
    a_.Send(to_b_, kPutBegin, EncodePutBegin(b), record);
    absl::StatusOr<Result> ack = a_.AwaitResult(kPutAck, b.xfer);
    if (!ack.ok()) return ack.status();
    return ack->status;
  }
  // Sends [from, to) of `content` in kChunk pieces, each with its crc.
  void SendChunks(uint64_t xfer, const std::string& content, uint64_t from = 0, uint64_t to = UINT64_MAX) {
    to = std::min<uint64_t>(to, content.size());
    for (uint64_t off = from; off < to; off += kChunk) {
      const std::string piece = content.substr(off, std::min(kChunk, to - off));
      a_.Send(to_b_, kPutChunk, EncodeChunk(Chunk{xfer, off, Crc32c(piece)}), piece);
    }
  }
  absl::Status Done(uint64_t xfer) {
    absl::StatusOr<Result> done = a_.AwaitResult(kPutDone, xfer);
    if (!done.ok()) return done.status();
    return done->status;
  }
  // Sends a read request and returns its end and the bytes of its chunks, in offset order.
  std::pair<Result, std::string> ReadFromB(ReadReq req) {
    a_.Send(to_b_, kReadReq, EncodeReadReq(req));
    absl::StatusOr<Result> end = a_.AwaitResult(kReadEnd, req.id);
    EXPECT_TRUE(end.ok()) << end.status();
    std::map<uint64_t, std::string> chunks;
    auto collect = [&] {
      chunks.clear();
      uint64_t n = 0;
      for (const RawPeer::Message& m : a_.Got()) {
        if (m.type != kReadChunk) continue;
        absl::StatusOr<Chunk> c = DecodeChunk(m.header);
        if (!c.ok() || c->id != req.id) continue;
        chunks[c->offset] = m.payload;
        n += m.payload.size();
      }
      return n;
    };
    // (The end may overtake the last chunk on a real transport.)
    EXPECT_TRUE(Eventually([&] { return !end.ok() || collect() >= end->bytes; }));
    for (const auto& [offset, piece] : chunks) {
      for (const RawPeer::Message& m : a_.Got()) {
        absl::StatusOr<Chunk> c = DecodeChunk(m.header);
        if (m.type == kReadChunk && c.ok() && c->id == req.id && c->offset == offset) {
          EXPECT_EQ(c->crc32c, Crc32c(piece)) << "chunk at " << offset;
        }
      }
    }
    std::string bytes;
    for (const auto& [offset, piece] : chunks) {
      EXPECT_EQ(offset, bytes.size());
      bytes += piece;
    }
    return {end.ok() ? *end : Result{}, bytes};
  }
  static ReadReq ShardRead(uint64_t id, const ShardId& shard, uint64_t offset, uint64_t length) {
    ReadReq r;
    r.id = id;
    r.what = ReadWhat::kShard;
    r.job_id = shard.job_id;
    r.step = shard.step;
    r.rank = shard.rank;
    r.offset = offset;
    r.length = length;
    r.sender_node_id = "a";
    r.sender_incarnation = 1;
    return r;
  }
  // Nothing of a push is left on b: no push in progress and all its space free.
  bool NothingLeft() {
    return Eventually([&] {
      return b_.server().receiving() == 0 && b_.tier().arena().free_bytes() == free_at_start_;
    });
  }

  PeerNode b_;
  RawPeer a_;
  transport::PeerId to_b_ = 0;
  uint64_t free_at_start_ = 0;
};

TEST_F(PeerServerTest, StoresAReplicaReportsItToMetaAndThenConfirms) {
  const ShardId id{"job", 5, 1};
  const std::string content = SeededBytes(4500, 1);
  auto [begin, record] = ReplicaPush(1, id, content);
  ASSERT_TRUE(Begin(begin, record).ok());
  SendChunks(1, content);
  ASSERT_TRUE(Done(1).ok());

  absl::StatusOr<Pin> held = b_.holdings().PinValid(id);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->rec->role, CopyRole::kReplica);
  EXPECT_EQ(held->rec->crc32c, Crc32c(content));
  EXPECT_EQ(ReadBack(*held->bytes, content.size()), content);
  // Meta heard of the copy, with the task that made it, before the sender was told.
  absl::MutexLock lock(&b_.meta().mu);
  ASSERT_EQ(b_.meta().reports.size(), 1u);
  EXPECT_EQ(b_.meta().reports[0].kind, HoldingReport::Kind::kCopyState);
  EXPECT_EQ(b_.meta().reports[0].copy_role, CopyRole::kReplica);
  EXPECT_EQ(b_.meta().reports[0].copy_state, CopyState::kValid);
  EXPECT_EQ(b_.meta().reports[0].task_id, "t-1");
}

TEST_F(PeerServerTest, ABadPushIsRefusedAtOnceWithTheReason) {
  const ShardId id{"job", 5, 1};
  const std::string content = SeededBytes(3000, 2);
  struct Case {
    std::string what;
    std::function<void(PutBegin&, std::string&)> spoil;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"size differs from the record", [](PutBegin& b, std::string&) { b.total_bytes += 1; },
       absl::StatusCode::kInvalidArgument, "push header and shard record disagree"},
      {"crc differs from the record", [](PutBegin& b, std::string&) { b.crc32c ^= 1; },
       absl::StatusCode::kInvalidArgument, "push header and shard record disagree"},
      {"record is not a record", [](PutBegin&, std::string& r) { r = "not a record"; },
       absl::StatusCode::kInvalidArgument, ""},
      {"another incarnation", [](PutBegin& b, std::string&) { b.target_incarnation = 7; },
       absl::StatusCode::kFailedPrecondition, "push is for incarnation 7, this agent is 1"},
      {"a job id that is not a name", [](PutBegin& b, std::string&) { b.job_id = "../etc"; },
       absl::StatusCode::kInvalidArgument, ""},
      {"larger than the memory tier",
       [&](PutBegin& b, std::string& r) {
         ShardRecord rec = RecordOf(id, std::string(2 << 20, 'x'));
         b.total_bytes = rec.size_bytes;
         b.crc32c = rec.crc32c;
         r = EncodeShardRecord(rec);
       },
       absl::StatusCode::kResourceExhausted, "no room for 2097152 bytes"},
      {"an EC push with its data position outside k",
       [](PutBegin& b, std::string& r) {
         b.kind = PutKind::kEcData;
         b.data_k = 2;
         b.parity_m = 1;
         b.data_position = 2;
         b.parity_position = 2;
         b.stripe_bytes = b.total_bytes;
         b.expect_mask = 0b111;
         r.clear();
       },
       absl::StatusCode::kInvalidArgument, "malformed EC push"},
      // A header this agent cannot read is still answered (not left to the
      // sender's timeout).
      {"an unknown kind", [](PutBegin& b, std::string&) { b.kind = static_cast<PutKind>(9); },
       absl::StatusCode::kInvalidArgument, "this agent cannot read the push's header: unknown put kind 9"},
  };
  uint64_t xfer = 100;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    auto [begin, record] = ReplicaPush(++xfer, id, content);
    c.spoil(begin, record);
    const absl::Status ack = Begin(begin, record);
    EXPECT_EQ(ack.code(), c.code) << ack;
    EXPECT_THAT(ack.message(), HasSubstr(c.message));
  }
  EXPECT_TRUE(NothingLeft());
  EXPECT_FALSE(b_.holdings().PinValid(id).ok());
}

TEST_F(PeerServerTest, APushOfACopyHeldHereIsAlreadyDoneAndOfADifferentOneRefused) {
  const ShardId id{"job", 5, 1};
  const std::string content = SeededBytes(3000, 3);
  ASSERT_TRUE(b_.tier().AddShard(id, content).ok());
  auto [same, record] = ReplicaPush(1, id, content);
  EXPECT_EQ(Begin(same, record).code(), absl::StatusCode::kAlreadyExists);

  const std::string other = SeededBytes(3000, 4);
  auto [different, other_record] = ReplicaPush(2, id, other);
  const absl::Status ack = Begin(different, other_record);
  EXPECT_EQ(ack.code(), absl::StatusCode::kFailedPrecondition) << ack;
  EXPECT_THAT(ack.message(), HasSubstr("a different copy of"));
}

TEST_F(PeerServerTest, ASecondBeginOfAPushInProgressIsRefused) {
  const ShardId id{"job", 5, 1};
  const std::string content = SeededBytes(3000, 5);
  auto [begin, record] = ReplicaPush(1, id, content);
  ASSERT_TRUE(Begin(begin, record).ok());
  a_.Send(to_b_, kPutBegin, EncodePutBegin(begin), record);
  const std::vector<RawPeer::Message> acks = a_.AwaitType(kPutAck, 2);
  ASSERT_EQ(acks.size(), 2u);
  absl::StatusOr<Result> second = DecodeResult(acks[1].header);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(second->status.message(), HasSubstr("this push has begun already"));
  // The first one goes on.
  SendChunks(1, content);
  EXPECT_TRUE(Done(1).ok());
  EXPECT_TRUE(b_.holdings().PinValid(id).ok());
}

TEST_F(PeerServerTest, AChunkCorruptedOnTheWayFailsThePushAsDataLossAndFreesItsSpace) {
  const ShardId id{"job", 5, 1};
  const std::string content = SeededBytes(4500, 6);
  auto [begin, record] = ReplicaPush(1, id, content);
  ASSERT_TRUE(Begin(begin, record).ok());
  SendChunks(1, content, 0, kChunk);
  std::string bad = content.substr(kChunk, kChunk);
  const uint32_t sent_crc = Crc32c(bad);
  bad[17] ^= 0x40;  // flipped after the sender computed its crc
  a_.Send(to_b_, kPutChunk, EncodeChunk(Chunk{1, kChunk, sent_crc}), bad);

  const absl::Status done = Done(1);
  EXPECT_EQ(done.code(), absl::StatusCode::kDataLoss) << done;
  EXPECT_THAT(done.message(), HasSubstr("chunk at offset 1000 arrived with crc32c"));
  EXPECT_TRUE(NothingLeft());
  EXPECT_FALSE(b_.holdings().PinValid(id).ok());
}

TEST_F(PeerServerTest, BytesThatDoNotMatchTheAnnouncedCrcAreNotStored) {
  // Every chunk arrives as sent, but the whole is not what the sender
  // announced (its copy was bad): nothing is stored.
  const ShardId id{"job", 5, 1};
  const std::string content = SeededBytes(4500, 7);
  ShardRecord rec = RecordOf(id, content);
  rec.crc32c ^= 0x1234;
  auto [begin, record] = ReplicaPush(1, id, content);
  begin.crc32c = rec.crc32c;
  ASSERT_TRUE(Begin(begin, EncodeShardRecord(rec)).ok());
  SendChunks(1, content);
  const absl::Status done = Done(1);
  EXPECT_EQ(done.code(), absl::StatusCode::kDataLoss) << done;
  EXPECT_THAT(done.message(), HasSubstr("received bytes have crc32c"));
  EXPECT_TRUE(NothingLeft());
  EXPECT_FALSE(b_.holdings().PinValid(id).ok());
  absl::MutexLock lock(&b_.meta().mu);
  EXPECT_TRUE(b_.meta().reports.empty());
}

TEST_F(PeerServerTest, ASenderThatDiesMidPushLeavesNothingBehind) {
  const ShardId id{"job", 5, 1};
  const std::string content = SeededBytes(4500, 8);
  auto [begin, record] = ReplicaPush(1, id, content);
  ASSERT_TRUE(Begin(begin, record).ok());
  SendChunks(1, content, 0, 2 * kChunk);
  ASSERT_LT(b_.tier().arena().free_bytes(), free_at_start_);  // the push's space is reserved
  a_.Stop();
  EXPECT_TRUE(NothingLeft());
  EXPECT_FALSE(b_.holdings().PinValid(id).ok());
}

TEST_F(PeerServerTest, ASenderThatGivesUpIsForgottenAtOnce) {
  const ShardId id{"job", 5, 1};
  const std::string content = SeededBytes(4500, 9);
  auto [begin, record] = ReplicaPush(1, id, content);
  ASSERT_TRUE(Begin(begin, record).ok());
  SendChunks(1, content, 0, kChunk);
  a_.Send(to_b_, kPutAbort, EncodeResult(Result{1, absl::DeadlineExceededError("gave up")}));
  EXPECT_TRUE(NothingLeft());
  EXPECT_FALSE(b_.holdings().PinValid(id).ok());
}

TEST_F(PeerServerTest, APushWithNoProgressForThePeerTimeoutIsDroppedAndTheSenderTold) {
  const ShardId id{"job", 5, 1};
  const std::string content = SeededBytes(4500, 10);
  auto [begin, record] = ReplicaPush(1, id, content);
  ASSERT_TRUE(Begin(begin, record).ok());
  EXPECT_EQ(b_.server().Expire(), 0);
  b_.tier().clock().Advance(absl::Milliseconds(kPeerTimeoutMs - 1));
  EXPECT_EQ(b_.server().Expire(), 0);
  b_.tier().clock().Advance(absl::Milliseconds(2));
  EXPECT_EQ(b_.server().Expire(), 1);
  const absl::Status done = Done(1);
  EXPECT_EQ(done.code(), absl::StatusCode::kDeadlineExceeded) << done;
  EXPECT_THAT(done.message(), HasSubstr("no data for 20000 ms"));
  EXPECT_TRUE(NothingLeft());
}

TEST_F(PeerServerTest, ServesAReadOfAHeldCopyInCheckedChunks) {
  const ShardId id{"job", 5, 1};
  const std::string content = SeededBytes(4500, 11);
  ASSERT_TRUE(b_.tier().AddShard(id, content).ok());

  auto [whole_end, whole] = ReadFromB(ShardRead(1, id, 0, content.size()));
  EXPECT_TRUE(whole_end.status.ok()) << whole_end.status;
  EXPECT_EQ(whole_end.bytes, content.size());
  EXPECT_EQ(whole_end.crc32c, Crc32c(content));
  EXPECT_EQ(whole, content);

  auto [part_end, part] = ReadFromB(ShardRead(2, id, 1234, 2000));
  EXPECT_TRUE(part_end.status.ok()) << part_end.status;
  EXPECT_EQ(part, content.substr(1234, 2000));
  EXPECT_EQ(part_end.crc32c, Crc32c(part));
}

TEST_F(PeerServerTest, ABadReadIsAnsweredWithTheReason) {
  const ShardId id{"job", 5, 1};
  const std::string content = SeededBytes(4500, 12);
  ASSERT_TRUE(b_.tier().AddShard(id, content).ok());

  auto [missing, b1] = ReadFromB(ShardRead(1, ShardId{"job", 5, 2}, 0, 10));
  EXPECT_EQ(missing.status.code(), absl::StatusCode::kNotFound) << missing.status;

  auto [beyond, b2] = ReadFromB(ShardRead(2, id, 4000, 1000));
  EXPECT_EQ(beyond.status.code(), absl::StatusCode::kOutOfRange) << beyond.status;
  EXPECT_THAT(beyond.status.message(), HasSubstr("read [4000, +1000) beyond 4500 bytes"));
  EXPECT_TRUE(b2.empty());

  ReadReq stale = ShardRead(3, id, 0, 10);
  stale.target_incarnation = 3;
  auto [other, b3] = ReadFromB(stale);
  EXPECT_EQ(other.status.code(), absl::StatusCode::kFailedPrecondition) << other.status;
  EXPECT_THAT(other.status.message(), HasSubstr("read is for incarnation 3, this agent is 1"));

  ReadReq unknown = ShardRead(5, id, 0, 10);
  unknown.what = static_cast<ReadWhat>(7);
  auto [unreadable, b5] = ReadFromB(unknown);
  EXPECT_EQ(unreadable.status.code(), absl::StatusCode::kInvalidArgument) << unreadable.status;
  EXPECT_THAT(unreadable.status.message(), HasSubstr("this agent cannot read the request's header: unknown read kind 7"));

  ReadReq segment = ShardRead(4, id, 0, 10);
  segment.what = ReadWhat::kSegment;
  segment.position = 2;
  auto [no_segment, b4] = ReadFromB(segment);
  EXPECT_EQ(no_segment.status.code(), absl::StatusCode::kNotFound) << no_segment.status;
  EXPECT_THAT(no_segment.status.message(), HasSubstr("is not held here"));
}

TEST_F(PeerServerTest, ACopyThatWentBadInMemoryIsQuarantinedAndTheReaderToldDataLoss) {
  const ShardId id{"job", 5, 1};
  const std::string content = SeededBytes(4500, 13);
  std::string rotten = content;
  rotten[3333] ^= 0x01;
  // The record describes the good bytes; memory holds one flipped bit.
  ASSERT_TRUE(b_.holdings()
                  .Add(RecordOf(id, content), b_.tier().Hold(rotten), /*verified=*/true, /*if_absent=*/false)
                  .ok());
  auto [end, bytes] = ReadFromB(ShardRead(1, id, 0, content.size()));
  EXPECT_EQ(end.status.code(), absl::StatusCode::kDataLoss) << end.status;
  EXPECT_THAT(end.status.message(), HasSubstr("node \"b\": copy has crc32c"));
  // Quarantined: no later reader gets it.
  absl::StatusOr<Pin> again = b_.holdings().PinValid(id);
  EXPECT_FALSE(again.ok());
  auto [end2, bytes2] = ReadFromB(ShardRead(2, id, 0, content.size()));
  EXPECT_FALSE(end2.status.ok());
  EXPECT_TRUE(bytes2.empty());
}

}  // namespace
}  // namespace ckpt::agent
