// fuzz_seeds DIR: writes valid inputs of every fuzzed format into
// DIR/<target>/seed-N, the seed corpora checked in under tests/fuzz/corpus.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/crc32c.h"
#include "common/durable_format.h"
#include "common/global_tensor.h"
#include "common/manifest.h"
#include "common/names.h"
#include "server/agent/arena.h"
#include "server/agent/peer_wire.h"
#include "transport/ucx/handshake.h"
#include "transport/ucx/node_identity.h"

namespace {

void WriteNamed(const std::filesystem::path& dir, const std::string& target, const std::string& name,
                const std::string& bytes) {
  std::filesystem::create_directories(dir / target);
  std::ofstream(dir / target / name, std::ios::binary) << bytes;
}

void Write(const std::filesystem::path& dir, const std::string& target, int n, const std::string& bytes) {
  WriteNamed(dir, target, "seed-" + std::to_string(n), bytes);
}

// Issue 34 finding 5: c128 [2^63, 2^61] is 2^128 bytes, which wrapped to the
// 0 the item claims; validation accepted it. A regression input for each
// target that validates manifests (ValidateManifest must refuse it, or the
// target's invariant check aborts).
ckpt::ManifestItem WrappingItem() {
  ckpt::ManifestItem huge;
  huge.name = "huge";
  huge.dtype = 16;  // c128
  huge.shape = {uint64_t{1} << 63, uint64_t{1} << 61};
  return huge;
}

std::vector<ckpt::ManifestItem> Items() {
  ckpt::ManifestItem a;
  a.name = "model/layers.0.weight";
  a.dtype = 1;
  a.shape = {4, 4};
  a.offset_bytes = 0;
  a.length_bytes = 64;
  a.crc32c = 0x1234;
  ckpt::ManifestItem b = a;
  b.name = "optimizer/step";
  b.dtype = ckpt::kDTypeBytes;
  b.shape = {};
  b.offset_bytes = 64;
  b.length_bytes = 8;
  b.attributes = {{"torch.dtype", "int64"}};
  return {a, b};
}

// fuzz_durable_version's records (fuzz_durable_version.cc): a tag, a 2-byte
// little-endian length, the bytes.
std::string Record(char tag, const std::string& bytes) {
  std::string out(1, tag);
  out += static_cast<char>(bytes.size() & 0xFF);
  out += static_cast<char>((bytes.size() >> 8) & 0xFF);
  return out + bytes;
}

// A rank file and its shard: f32 items of `shapes`, each 64-byte aligned,
// filled with a pattern; `global` gives an item's (global name, global
// shape, offsets), or none.
struct SeedItem {
  std::string name;
  std::vector<uint64_t> shape;
  std::string global_name;
  std::vector<uint64_t> global_shape, offsets;
  std::optional<uint64_t> ref_step;  // a reference: placed as in `base`
};
std::pair<ckpt::DurableShard, std::string> RankFile(uint32_t rank, const std::vector<SeedItem>& items,
                                                    const ckpt::DurableShard* base = nullptr) {
  ckpt::DurableShard shard;
  shard.rank = rank;
  shard.file = ckpt::RankFileName(rank);
  std::string bytes;
  for (const SeedItem& s : items) {
    ckpt::ManifestItem item;
    item.name = s.name;
    item.dtype = 1;  // f32
    item.shape = s.shape;
    item.length_bytes = 4;
    for (uint64_t d : s.shape) item.length_bytes *= d;
    if (!s.global_shape.empty() || !s.global_name.empty()) {
      item.attributes = ckpt::GlobalAttributes(s.name, s.global_name.empty() ? s.name : s.global_name,
                                               s.global_shape, s.offsets);
    }
    if (s.ref_step) {
      for (const ckpt::ManifestItem& b : base->items) {
        if (b.name == s.name) {
          item.offset_bytes = b.offset_bytes;
          item.crc32c = b.crc32c;
        }
      }
      item.ref_step = s.ref_step;
      shard.items.push_back(item);
      continue;
    }
    bytes.resize((bytes.size() + 63) / 64 * 64, '\0');
    item.offset_bytes = bytes.size();
    for (uint64_t i = 0; i < item.length_bytes; ++i) bytes += static_cast<char>((i * 31 + rank * 7 + s.name.size()) & 0xFF);
    item.crc32c = ckpt::Crc32c(bytes.data() + item.offset_bytes, item.length_bytes);
    shard.items.push_back(item);
  }
  if (bytes.empty()) bytes.assign(1, '\0');
  shard.size_bytes = bytes.size();
  shard.crc32c = ckpt::Crc32c(bytes.data(), bytes.size());
  shard.items = ckpt::SortedByOffset(shard.items);
  shard.manifest_digest = ckpt::ManifestDigest(shard.items);
  return {shard, bytes};
}

ckpt::DurableManifest Version(uint64_t step, std::vector<ckpt::DurableShard> shards) {
  ckpt::DurableManifest m;
  m.job_id = "job";
  m.step = step;
  m.world_size = static_cast<uint32_t>(shards.size());
  m.writer = "fuzz_seeds";
  m.shards = std::move(shards);
  for (const ckpt::DurableShard& s : m.shards) {
    if (!ckpt::RefSteps(s.items).empty()) m.format_version = 2;
  }
  return m;
}

std::string Json(const ckpt::DurableManifest& m) {
  absl::StatusOr<std::string> json = ckpt::EncodeDurableManifest(m);
  if (!json.ok()) {
    std::fprintf(stderr, "fuzz_seeds: %s\n", json.status().ToString().c_str());
    std::exit(1);
  }
  return *json;
}

void DurableVersionSeeds(const std::filesystem::path& dir) {
  // 0: one rank, a tensor whole and a rank's own item.
  auto [r0, b0] = RankFile(0, {{"w", {4, 3}, "", {4, 3}, {0, 0}, {}}, {"own", {5}, "", {}, {}, {}}});
  Write(dir, "fuzz_durable_version", 0, Record('M', Json(Version(9, {r0}))) + Record('R', b0));
  // 1: two ranks: "w" split by rows, "b" replicated on both.
  auto [s0, c0] = RankFile(0, {{"w.0", {2, 3}, "w", {4, 3}, {0, 0}, {}}, {"b", {3}, "", {3}, {0}, {}}});
  auto [s1, c1] = RankFile(1, {{"w.1", {2, 3}, "w", {4, 3}, {2, 0}, {}}, {"b", {3}, "", {3}, {0}, {}}});
  Write(dir, "fuzz_durable_version", 1,
        Record('M', Json(Version(9, {s0, s1}))) + Record('R', c0) + Record('R', c1));
  // 2: an incremental version: "w" from version 7, "b" its own.
  auto [o0, d0] = RankFile(0, {{"w", {4, 3}, "", {4, 3}, {0, 0}, {}}, {"b", {3}, "", {}, {}, {}}});
  auto [n0, e0] = RankFile(0, {{"b", {3}, "", {}, {}, {}}, {"w", {4, 3}, "", {4, 3}, {0, 0}, 7}}, &o0);
  Write(dir, "fuzz_durable_version", 2,
        Record('m', Json(Version(7, {o0}))) + Record('r', d0) + Record('M', Json(Version(9, {n0}))) +
            Record('R', e0));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seeds DIR\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  const auto items = Items();
  Write(dir, "fuzz_manifest", 0, ckpt::EncodeManifest(items));
  Write(dir, "fuzz_manifest", 1, ckpt::EncodeManifest({}));
  {  // v2: with a reference (incremental save)
    auto with_ref = items;
    with_ref[1].ref_step = 7;
    Write(dir, "fuzz_manifest", 2, ckpt::EncodeManifest(with_ref));
  }

  ckpt::DurableManifest m;
  m.job_id = "llm";
  m.step = 100;
  m.world_size = 1;
  m.writer = "fuzz_seeds";
  ckpt::DurableShard s;
  s.rank = 0;
  s.file = ckpt::RankFileName(0);
  s.size_bytes = 72;
  s.crc32c = 0xabcd;
  s.items = items;
  s.manifest_digest = ckpt::ManifestDigest(items);
  m.shards = {s};
  auto json = ckpt::EncodeDurableManifest(m);
  if (!json.ok()) {
    std::fprintf(stderr, "fuzz_seeds: %s\n", json.status().ToString().c_str());
    return 1;
  }
  Write(dir, "fuzz_durable_manifest", 0, *json);

  ckpt::agent::ShardRecord r;
  r.id = {"llm", 100, 0};
  r.size_bytes = 72;
  r.crc32c = 0xabcd;
  r.items = items;
  r.manifest_digest = ckpt::ManifestDigest(items);
  r.extents = {{4096, 4096}};
  r.run_id = "run-1";
  Write(dir, "fuzz_agent_record", 0, ckpt::agent::EncodeShardRecord(r));
  ckpt::agent::ShardRecord seg = r;
  seg.items.clear();
  seg.segment = ckpt::agent::SegmentId{"llm", 100, 0, 1, 4};
  Write(dir, "fuzz_agent_record", 1, ckpt::agent::EncodeShardRecord(seg));

  ckpt::agent::PutBegin pb;
  pb.xfer = 7;
  pb.task_id = "t-1";
  pb.job_id = "llm";
  pb.step = 100;
  pb.total_bytes = 72;
  // Seeds 0 and 3: headers as agents sent them before the sender's identity
  // (an empty name and incarnation 0 take 12 bytes at the end).
  auto before_sender = [](std::string h) { return h.substr(0, h.size() - 12); };
  Write(dir, "fuzz_peer_wire", 0, std::string(1, '\0') + before_sender(ckpt::agent::EncodePutBegin(pb)));
  Write(dir, "fuzz_peer_wire", 1, std::string(1, '\1') + ckpt::agent::EncodeChunk({7, 0, 0x55}));
  ckpt::agent::Result res;
  res.id = 7;
  res.status = absl::DataLossError("crc mismatch");
  Write(dir, "fuzz_peer_wire", 2, std::string(1, '\2') + ckpt::agent::EncodeResult(res));
  ckpt::agent::ReadReq rr;
  rr.id = 9;
  rr.job_id = "llm";
  rr.step = 100;
  rr.length = 72;
  Write(dir, "fuzz_peer_wire", 3, std::string(1, '\3') + before_sender(ckpt::agent::EncodeReadReq(rr)));
  // With the sender's identity (membership check, issue 17).
  pb.sender_node_id = "node-2";
  pb.sender_incarnation = 3;
  Write(dir, "fuzz_peer_wire", 4, std::string(1, '\0') + ckpt::agent::EncodePutBegin(pb));
  rr.sender_node_id = "node-2";
  rr.sender_incarnation = 3;
  Write(dir, "fuzz_peer_wire", 5, std::string(1, '\3') + ckpt::agent::EncodeReadReq(rr));

  {
    // One seed per record kind of the handshake (the input's second byte
    // picks the kind the reader expects).
    namespace w = ckpt::transport::ucx_wire;
    for (size_t i = 0; i < std::size(w::kRecordKinds); ++i) {
      w::Greeting g;
      g.flags = w::kRecordKinds[i];
      g.peer_id = 42;
      g.nonce = 99;
      if ((g.flags & w::kProof) != 0) g.proof = w::HandshakeProof("seed-key", 'a', 42, 99, 7, 8);
      if ((g.flags & w::kAddress) != 0) g.worker_address = std::string(200, 'w');
      if ((g.flags & w::kIdentity) != 0) {
        g.identity = ckpt::transport::EncodeIdentityBlock(
            {std::string(600, 'c'), std::string(ckpt::transport::kX25519Bytes, 'k'), std::string(70, 's')});
      }
      auto greeting = w::EncodeGreeting(g);
      if (!greeting.ok()) return 1;
      Write(dir, "fuzz_greeting", static_cast<int>(i), std::string(1, '\x07') + std::string(1, static_cast<char>(i)) + *greeting);
    }
  }

  {
    const std::vector<ckpt::ManifestItem> wrapping = {WrappingItem()};
    WriteNamed(dir, "fuzz_manifest", "regression-wrapping-shape", ckpt::EncodeManifest(wrapping));
    // By hand: the writer refuses it (EncodeDurableManifest validates).
    char json[1024];
    std::snprintf(json, sizeof json,
                  "{\"format_version\":1,\"job_id\":\"gpt\",\"step\":7,\"world_size\":1,\"writer\":\"t\","
                  "\"created_unix_ms\":0,\"shards\":[{\"rank\":0,\"file\":\"rank-00000.bin\",\"size_bytes\":64,"
                  "\"crc32c\":\"0x00000000\",\"manifest_digest\":\"0x%016llx\",\"items\":[{\"name\":\"huge\","
                  "\"dtype\":\"c128\",\"shape\":[9223372036854775808,2305843009213693952],\"offset_bytes\":0,"
                  "\"length_bytes\":0,\"crc32c\":\"0x00000000\",\"attributes\":{}}]}]}",
                  static_cast<unsigned long long>(ckpt::ManifestDigest(wrapping)));
    WriteNamed(dir, "fuzz_durable_manifest", "regression-wrapping-shape", json);
    ckpt::agent::ShardRecord wrapped = r;
    wrapped.size_bytes = 64;
    wrapped.items = wrapping;
    wrapped.manifest_digest = ckpt::ManifestDigest(wrapping);
    WriteNamed(dir, "fuzz_agent_record", "regression-wrapping-shape", ckpt::agent::EncodeShardRecord(wrapped));
  }

  Write(dir, "fuzz_config", 0,
        "listen: 127.0.0.1:7400\nmemory: 4GiB\nlease_ms: 5s\nlog_json: true\ndata_rate: 0\n");
  Write(dir, "fuzz_config", 1, "agent:\n  memory: 1GiB\n  peer_timeout_ms: 30000\n");
  DurableVersionSeeds(dir);
  return 0;
}
