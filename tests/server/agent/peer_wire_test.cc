// The data-plane header encodings: every message round-trips, and a short,
// truncated or malformed header is InvalidArgument (never read past its end).
#include "server/agent/peer_wire.h"

#include <gtest/gtest.h>

namespace ckpt::agent {
namespace {

TEST(PeerWire, EveryMessageRoundTrips) {
  PutBegin b;
  b.xfer = 7;
  b.kind = PutKind::kEcData;
  b.target_incarnation = 3;
  b.task_id = "t-1";
  b.job_id = "gpt";
  b.step = 100;
  b.rank = 5;
  b.total_bytes = 1ull << 40;
  b.crc32c = 0xE3069283;
  b.group = 1;
  b.stripe = 2;
  b.data_position = 3;
  b.parity_position = 5;
  b.data_k = 4;
  b.parity_m = 2;
  b.stripe_bytes = 4096;
  b.expect_mask = 0b1011;
  b.sender_node_id = "node-7";
  b.sender_incarnation = 12;
  absl::StatusOr<PutBegin> b2 = DecodePutBegin(EncodePutBegin(b));
  ASSERT_TRUE(b2.ok()) << b2.status();
  EXPECT_EQ(EncodePutBegin(*b2), EncodePutBegin(b));
  EXPECT_EQ(b2->job_id, "gpt");
  EXPECT_EQ(b2->sender_node_id, "node-7");
  EXPECT_EQ(b2->sender_incarnation, 12u);
  EXPECT_EQ(b2->kind, PutKind::kEcData);

  absl::StatusOr<Chunk> c = DecodeChunk(EncodeChunk(Chunk{9, 8 << 20, 0x1234}));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->offset, 8u << 20);
  EXPECT_EQ(c->crc32c, 0x1234u);

  absl::StatusOr<Result> r = DecodeResult(EncodeResult(Result{4, absl::DataLossError("bad chunk"), 77, 88}));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(r->status.message(), "bad chunk");
  EXPECT_EQ(r->bytes, 88u);

  ReadReq q;
  q.id = 11;
  q.what = ReadWhat::kSegment;
  q.job_id = "j";
  q.position = 4;
  q.offset = 5;
  q.length = 6;
  q.sender_node_id = "reader-node-0002";
  q.sender_incarnation = 3;
  absl::StatusOr<ReadReq> q2 = DecodeReadReq(EncodeReadReq(q));
  ASSERT_TRUE(q2.ok());
  EXPECT_EQ(EncodeReadReq(*q2), EncodeReadReq(q));
  EXPECT_EQ(q2->sender_node_id, "reader-node-0002");
  EXPECT_EQ(q2->sender_incarnation, 3u);
}

// The sender's identity is the last field: a header of an earlier version,
// which ends before it, still decodes (with no sender, which a receiver that
// checks membership refuses); a sender cut short is malformed.
TEST(PeerWire, TheSenderIsOptionalAtTheEnd) {
  PutBegin b;
  b.job_id = "gpt";
  const std::string sender = "a-node-with-a-long-id";
  b.sender_node_id = sender;
  b.sender_incarnation = 4;
  const std::string full = EncodePutBegin(b);
  const size_t old_size = full.size() - (4 + sender.size()) - 8;  // without Str(sender) and the u64
  absl::StatusOr<PutBegin> old = DecodePutBegin(full.substr(0, old_size));
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(old->sender_node_id, "");
  EXPECT_EQ(old->sender_incarnation, 0u);
  for (size_t n = old_size + 1; n < full.size(); ++n) {
    EXPECT_EQ(DecodePutBegin(full.substr(0, n)).status().code(), absl::StatusCode::kInvalidArgument) << n;
  }
  ReadReq q;
  q.sender_node_id = sender;
  const std::string read = EncodeReadReq(q);
  absl::StatusOr<ReadReq> old_read = DecodeReadReq(read.substr(0, read.size() - (4 + sender.size()) - 8));
  ASSERT_TRUE(old_read.ok()) << old_read.status();
  EXPECT_EQ(old_read->sender_node_id, "");
}

TEST(PeerWire, MalformedHeadersAreInvalidArgument) {
  PutBegin b;
  b.job_id = "gpt";
  const std::string full = EncodePutBegin(b);
  // Every cut short of the (optional) sender fields at the end is malformed.
  const size_t before_sender = full.size() - 4 - 8;
  for (size_t n = 0; n < full.size(); ++n) {
    if (n == before_sender) continue;
    EXPECT_EQ(DecodePutBegin(full.substr(0, n)).status().code(), absl::StatusCode::kInvalidArgument) << n;
  }
  std::string bad_kind = full;
  bad_kind[8] = 9;  // the kind byte follows the 8-byte transfer id
  EXPECT_EQ(DecodePutBegin(bad_kind).status().code(), absl::StatusCode::kInvalidArgument);
  // A string length pointing past the end.
  WireWriter w;
  w.U64(1);
  w.U32(1000000);
  EXPECT_EQ(DecodeChunk(w.Take()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeReadReq("").status().code(), absl::StatusCode::kInvalidArgument);
  WireWriter res;
  res.U64(1);
  res.U32(99);  // not a status code
  res.Str("");
  res.U32(0);
  res.U64(0);
  EXPECT_EQ(DecodeResult(res.Take()).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ckpt::agent
