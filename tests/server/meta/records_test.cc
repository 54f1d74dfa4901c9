// Metadata records: encodings read back to what was written.
#include "server/meta/records.h"

#include <gtest/gtest.h>

#include <string>

namespace ckpt::meta::records {
namespace {

Shard OddShard() {
  Shard s;
  s.rank = 4294967295u;
  s.size_bytes = 18446744073709551615ull;
  s.crc32c = 0xE3069283u;
  s.manifest_digest = 0x0123456789abcdefull;
  Item a;
  a.name = std::string("layer.0/\"w\"\\\b\f\n\r\t\x01\x1f end");
  a.dtype = 7;
  a.shape = {1, 4096, 0, 18446744073709551615ull};
  a.offset_bytes = 64;
  a.length_bytes = 1u << 20;
  a.crc32c = 1;
  a.attributes = {{"k\"ey", "v\\al"}, {"unicode", "gr\xc3\xbc\xc3\x9f" "e \xe2\x82\xac"}, {"", ""}};
  Item b;  // empty shape and attributes
  b.name = "b";
  Item r;  // a reference (incremental save)
  r.name = "r";
  r.ref_step = 9007199254740991;
  r.offset_bytes = 4096;
  s.items = {a, b, r};
  s.primary_node_id = "node-1";
  s.staged_ms = -5;
  Copy c;
  c.node_id = "node-2";
  c.role = CopyRole::kReplica;
  c.state = CopyState::kValid;
  c.updated_ms = 1700000000000;
  c.detail = "tab\there";
  s.copies = {c, Copy{}};
  s.durable_path = "job/step/rank \xc3\xa9.bin";
  s.durable_written = true;
  s.durable_written_ms = 42;
  return s;
}

TEST(Records, ShardRoundTripsEveryField) {
  const Shard s = OddShard();
  const std::string encoded = EncodeShard(s);
  absl::StatusOr<Shard> d = DecodeShard("s/j/1/2", encoded);
  ASSERT_TRUE(d.ok()) << d.status() << "\n" << encoded;
  EXPECT_EQ(d->rank, s.rank);
  EXPECT_EQ(d->size_bytes, s.size_bytes);
  EXPECT_EQ(d->crc32c, s.crc32c);
  EXPECT_EQ(d->manifest_digest, s.manifest_digest);
  ASSERT_EQ(d->items.size(), 3u);
  EXPECT_EQ(d->items[0].name, s.items[0].name);
  EXPECT_EQ(d->items[0].dtype, 7);
  EXPECT_EQ(d->items[0].shape, s.items[0].shape);
  EXPECT_EQ(d->items[0].offset_bytes, 64u);
  EXPECT_EQ(d->items[0].length_bytes, 1u << 20);
  EXPECT_EQ(d->items[0].crc32c, 1u);
  EXPECT_EQ(d->items[0].attributes, s.items[0].attributes);
  EXPECT_EQ(d->items[1].name, "b");
  EXPECT_TRUE(d->items[1].shape.empty());
  EXPECT_TRUE(d->items[1].attributes.empty());
  EXPECT_EQ(d->items[1].ref_step, -1);
  EXPECT_EQ(d->items[2].ref_step, 9007199254740991);
  EXPECT_EQ(d->items[2].offset_bytes, 4096u);
  EXPECT_EQ(d->ref_steps, (std::vector<uint64_t>{9007199254740991}));  // derived
  EXPECT_EQ(d->primary_node_id, "node-1");
  EXPECT_EQ(d->staged_ms, -5);
  ASSERT_EQ(d->copies.size(), 2u);
  EXPECT_EQ(d->copies[0].node_id, "node-2");
  EXPECT_EQ(d->copies[0].role, CopyRole::kReplica);
  EXPECT_EQ(d->copies[0].state, CopyState::kValid);
  EXPECT_EQ(d->copies[0].updated_ms, 1700000000000);
  EXPECT_EQ(d->copies[0].detail, "tab\there");
  EXPECT_EQ(d->durable_path, s.durable_path);
  EXPECT_TRUE(d->durable_written);
  EXPECT_EQ(d->durable_written_ms, 42);
  EXPECT_EQ(EncodeShard(*d), encoded);
}

TEST(Records, EmptyShardRoundTrips) {
  const std::string encoded = EncodeShard(Shard{});
  absl::StatusOr<Shard> d = DecodeShard("s/j/1/0", encoded);
  ASSERT_TRUE(d.ok()) << d.status() << "\n" << encoded;
  EXPECT_EQ(EncodeShard(*d), encoded);
}

}  // namespace
}  // namespace ckpt::meta::records
