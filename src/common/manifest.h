// Shard manifests: the named items (tensors) a rank's shard is made of.
//
// A shard is `size_bytes` contiguous bytes; its manifest lists items, each a
// byte range [offset_bytes, offset_bytes + length_bytes) with a name, a dtype
// (ckpt.v1.DType number), a shape and the CRC-32C of its bytes. Bytes not
// covered by any item are padding (zero by convention, still covered by the
// shard's crc). The same rules apply wherever a manifest enters: the agent's
// CommitShard, the client before it commits, the durable-tier reader.
//
// ManifestDigest() implements docs/protocol.md "Manifest digest" (XXH3-64 over
// a canonical encoding): equal size, crc32c and digest identify the same shard
// contents and layout. The same canonical encoding ("packed manifest",
// EncodeManifest / ManifestEncoder / DecodeManifest) carries manifests of
// thousands of items on the wire and in the agent's records at a fraction of
// the cost of one message or JSON object per item.
//
// Thread safety: all functions are pure and safe to call concurrently.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt {

// One named item of a shard. dtype is the ckpt.v1.DType enum number.
struct ManifestItem {
  std::string name;
  int dtype = 0;
  std::vector<uint64_t> shape;
  uint64_t offset_bytes = 0;
  uint64_t length_bytes = 0;
  uint32_t crc32c = 0;
  std::map<std::string, std::string> attributes;

  bool operator==(const ManifestItem&) const = default;
};

// DType numbers (ckpt.v1.DType) used by code that needs a specific one.
inline constexpr int kDTypeBytes = 14;
inline constexpr int kMaxDType = 18;

// Bytes per element of a dtype: 1, 2, 4, 8 or 16; 0 for DTYPE_BYTES (opaque,
// any length) and for numbers that are not a known dtype.
uint32_t DTypeElementSize(int dtype);

// Short lower-case name of a dtype ("f32", "bf16", "bytes", ...); "unknown" for
// numbers that are not a DType. These names appear in manifest.json.
const char* DTypeName(int dtype);

// Inverse of DTypeName(); InvalidArgument for an unknown name.
absl::StatusOr<int> DTypeFromName(const std::string& name);

// Checks a manifest against a shard of `shard_size_bytes` bytes: every name
// valid (ValidateItemName) and unique, dtype known (1..kMaxDType), every item
// inside the shard, no two non-empty items overlapping, and length consistent
// with the dtype and shape (length == element size x product of dims, except
// for DTYPE_BYTES whose length is free; an empty shape is a scalar). Returns
// InvalidArgument naming the first offending item and the rule it broke.
// Linear in the number of items when they come in offset order.
absl::Status ValidateManifest(std::span<const ManifestItem> items, uint64_t shard_size_bytes);

// XXH3-64 (seed 0) of the canonical manifest encoding (docs/protocol.md
// "Manifest digest"): items in ascending offset order, attributes in key order.
// The order of `items` does not matter.
uint64_t ManifestDigest(std::span<const ManifestItem> items);

// The canonical encoding itself ("packed manifest"): items in ascending
// offset order (equal offsets keep their order in `items`). Pure.
std::string EncodeManifest(std::span<const ManifestItem> items);

// XXH3-64 of an encoding: ManifestDigest(items) ==
// ManifestDigestOfEncoding(EncodeManifest(items)).
uint64_t ManifestDigestOfEncoding(std::string_view encoded);

// Decodes a packed manifest. InvalidArgument if it is truncated, has bytes
// left over, does not start with the encoding's tag, declares more items,
// dimensions or attributes than its bytes can hold, or lists items out of
// offset order (then it is not canonical and its digest would be wrong). It
// does not check the items themselves: use ValidateManifest.
absl::StatusOr<std::vector<ManifestItem>> DecodeManifest(std::string_view encoded);

// Builds a packed manifest item by item, for writers that know their items in
// offset order (a client laying out a shard) and need no ManifestItem for
// each. Add() items in ascending offset order; Finish() returns the encoding
// (equal to EncodeManifest of the same items) and resets the encoder. Not
// thread-safe.
class ManifestEncoder {
 public:
  // `reserve_bytes`: expected size of the encoding (a hint).
  explicit ManifestEncoder(size_t reserve_bytes = 0);
  void Add(std::string_view name, int dtype, std::span<const uint64_t> shape, uint64_t offset_bytes,
           uint64_t length_bytes, uint32_t crc32c, const std::map<std::string, std::string>& attributes);
  void Add(const ManifestItem& item) {
    Add(item.name, item.dtype, item.shape, item.offset_bytes, item.length_bytes, item.crc32c, item.attributes);
  }
  size_t count() const { return count_; }
  std::string Finish();

 private:
  std::string out_;
  uint32_t count_ = 0;
};

// Returns `items` sorted by offset_bytes (the order shards are laid out in).
std::vector<ManifestItem> SortedByOffset(std::span<const ManifestItem> items);
// The same, in place (no copy of the items when they are in order already).
void SortByOffset(std::vector<ManifestItem>& items);

// Checks every item's CRC-32C while a shard's bytes go by once, in order
// (e.g. streamed from an agent into a file), without holding the shard:
//
//   ItemCrcStream check(items);           // a manifest ValidateManifest accepts
//   for (each piece, in shard order from byte 0) CKPT_RETURN_IF_ERROR(check.Update(piece));
//   CKPT_RETURN_IF_ERROR(check.Finish());
//
// Update() extends the crc of the items the piece touches and returns
// DataLoss naming the first item that is complete and does not match.
// Finish() returns DataLoss if some item was not complete (the bytes ended
// early). Items may come in any order; overlapping items (which
// ValidateManifest rejects) give wrong answers. Copies what it needs from
// `items`. Not thread-safe.
class ItemCrcStream {
 public:
  explicit ItemCrcStream(std::span<const ManifestItem> items);
  absl::Status Update(std::span<const std::byte> piece);
  absl::Status Finish() const;
  // Bytes fed so far.
  uint64_t position() const { return pos_; }

 private:
  struct Entry {
    uint64_t offset;
    uint64_t length;
    uint32_t crc32c;
    std::string name;
  };
  std::vector<Entry> sorted_;  // by offset
  size_t next_ = 0;            // first item not yet complete
  uint32_t crc_ = 0;           // crc of sorted_[next_]'s bytes seen so far
  uint64_t pos_ = 0;
};

}  // namespace ckpt
