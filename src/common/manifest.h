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
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt {

// One named item of a shard. dtype is the ckpt.v1.DType enum number.
//
// An item of an incremental save may be a *reference* (ref_step set): its
// bytes are not in this shard but in the same rank's shard of version
// ref_step (an earlier one), at [offset_bytes, offset_bytes + length_bytes)
// there, with that crc32c; the item's name, dtype, shape and attributes are
// this shard's own. A reference always names the version that holds the
// bytes (never another reference), so a load follows at most one hop.
struct ManifestItem {
  std::string name;
  int dtype = 0;
  std::vector<uint64_t> shape;
  uint64_t offset_bytes = 0;
  uint64_t length_bytes = 0;
  uint32_t crc32c = 0;
  std::map<std::string, std::string> attributes;
  std::optional<uint64_t> ref_step;  // set: the bytes live in version ref_step's shard

  bool is_ref() const { return ref_step.has_value(); }
  bool operator==(const ManifestItem&) const = default;
};

// Canonical item order: the shard's own items by ascending offset_bytes,
// then references by ascending (ref_step, offset_bytes); equal keys keep
// their order. Manifests are stored, encoded and hashed in this order.
bool CanonicalItemLess(const ManifestItem& a, const ManifestItem& b);

// The distinct ref_steps of `items`, ascending (empty for a self-contained
// shard).
std::vector<uint64_t> RefSteps(std::span<const ManifestItem> items);

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

// --- The size rules of an item (their one home) ---
// Every place that relates an item's shape, dtype, offset and length (the
// agent's CommitShard, meta's staged reports, the client's SaveBuilder, the
// durable reader and writer, the Python module) goes through these, so no
// caller multiplies or adds sizes of its own and none can wrap around 2^64.

// Bytes an item of `dtype` with `shape` takes: DTypeElementSize(dtype) x the
// product of the dimensions, exactly (an empty shape is a scalar, one
// element; a zero dimension makes it 0 whatever the others are).
// InvalidArgument if the dtype has no fixed element size (DTYPE_BYTES, whose
// length is free, or a number that is not a dtype) or if the result does not
// fit in 64 bits (the message gives the dtype and shape). Pure.
absl::StatusOr<uint64_t> ItemByteLength(int dtype, std::span<const uint64_t> shape);

// The length rule: OK if `length_bytes` == ItemByteLength(dtype, shape), or
// if dtype is DTYPE_BYTES (opaque: any length, any shape). InvalidArgument
// naming the item, its length, dtype and shape and the length they need
// ("more than 2^64" when they overflow) otherwise, or for an unknown dtype.
absl::Status CheckItemLength(std::string_view name, int dtype, std::span<const uint64_t> shape,
                             uint64_t length_bytes);

// The placement rule: [offset_bytes, offset_bytes + length_bytes) lies inside
// a shard of `shard_size_bytes` bytes (decided without computing a sum that
// could wrap). InvalidArgument naming the item and the three numbers
// otherwise. Once it holds, offset_bytes + length_bytes cannot overflow.
absl::Status CheckItemInShard(std::string_view name, uint64_t offset_bytes, uint64_t length_bytes,
                              uint64_t shard_size_bytes);

// Checks a manifest against a shard of `shard_size_bytes` bytes: every name
// valid (ValidateItemName) and unique, dtype known (1..kMaxDType), every item
// inside the shard (CheckItemInShard), no two non-empty items overlapping,
// and length consistent with the dtype and shape (CheckItemLength: length ==
// element size x product of dims, exactly, except for DTYPE_BYTES whose
// length is free; an empty shape is a scalar). Returns
// InvalidArgument naming the first offending item and the rule it broke.
// Linear in the number of items when they come in canonical order.
// References (ref_step set) are checked for name, dtype and length only
// (their bytes are in another shard, which the holder of that shard checks);
// with `step` given, every ref_step must be below it.
absl::Status ValidateManifest(std::span<const ManifestItem> items, uint64_t shard_size_bytes,
                              std::optional<uint64_t> step = std::nullopt);

// What ValidateManifest looks at in an item, as views into the caller's
// own item type (meta keeps items of its own: meta::Item). Valid while the
// item is.
struct ItemView {
  std::string_view name;
  int dtype = 0;
  std::span<const uint64_t> shape;
  uint64_t offset_bytes = 0;
  uint64_t length_bytes = 0;
  std::optional<uint64_t> ref_step;
};

// ValidateManifest's rules over views: the one place they live (the agent
// checks a committed manifest with ValidateManifest, meta a STAGED report's
// items with this; both refuse the same items with the same words).
absl::Status ValidateItems(std::span<const ItemView> items, uint64_t shard_size_bytes,
                           std::optional<uint64_t> step = std::nullopt);

// XXH3-64 (seed 0) of the canonical manifest encoding (docs/protocol.md
// "Manifest digest"): items in canonical order, attributes in key order.
// The order of `items` does not matter. A manifest without references
// encodes as "ckpt-manifest-v1" (digests of full shards never changed), one
// with references as "ckpt-manifest-v2".
uint64_t ManifestDigest(std::span<const ManifestItem> items);

// XXH3-64 (seed 0) of an item's bytes: what an incremental save compares
// to tell an unchanged item (docs/protocol.md "Incremental saves").
uint64_t ContentHash(std::span<const std::byte> bytes);

// The canonical encoding itself ("packed manifest"): items in canonical
// order (equal keys keep their order in `items`). Pure.
std::string EncodeManifest(std::span<const ManifestItem> items);

// XXH3-64 of an encoding: ManifestDigest(items) ==
// ManifestDigestOfEncoding(EncodeManifest(items)).
uint64_t ManifestDigestOfEncoding(std::string_view encoded);

// Decodes a packed manifest (v1 or v2). InvalidArgument if it is truncated,
// has bytes left over, does not start with an encoding's tag, declares more
// items, dimensions or attributes than its bytes can hold, lists items out of
// canonical order, or is a v2 without references (then it is not canonical
// and its digest would be wrong). It does not check the items themselves:
// use ValidateManifest.
absl::StatusOr<std::vector<ManifestItem>> DecodeManifest(std::string_view encoded);

// One item of a packed manifest as its bytes hold it: views into the
// encoding, valid while it is (no allocation). Shape and attributes are read
// on demand.
struct PackedItem {
  std::optional<uint64_t> ref_step;
  std::string_view name;
  int dtype = 0;
  uint32_t dims = 0;
  uint64_t offset_bytes = 0;
  uint64_t length_bytes = 0;
  uint32_t crc32c = 0;
  uint32_t attribute_count = 0;
  const char* shape_at = nullptr;       // dims little-endian u64s
  const char* attributes_at = nullptr;  // attribute_count (key, value) strings

  uint64_t Dim(uint32_t i) const;
  std::vector<uint64_t> Shape() const;
  std::map<std::string, std::string> Attributes() const;
};

// Reads a packed manifest item by item, calling `fn` for each in encoding
// (canonical) order, with the checks of DecodeManifest; stops at the first
// error. `fn` returning an error stops the walk with that error.
absl::Status ForEachPackedItem(std::string_view encoded, absl::FunctionRef<absl::Status(const PackedItem&)> fn);

// The number of the shard's own items a packed manifest declares (its
// references aside), for reserving; 0 when it is too short to say.
size_t PackedItemCount(std::string_view encoded);

// True if a packed manifest holds references (a v2 encoding).
bool PackedHasRefs(std::string_view encoded);

// Builds a packed manifest item by item, for writers that know their items in
// offset order (a client laying out a shard) and need no ManifestItem for
// each. Add() the shard's own items in ascending offset order and AddRef()
// references in ascending (ref_step, offset) order (the two may interleave);
// Finish() returns the encoding (equal to EncodeManifest of the same items)
// and resets the encoder. Not thread-safe.
class ManifestEncoder {
 public:
  // `reserve_bytes`: expected size of the encoding (a hint).
  explicit ManifestEncoder(size_t reserve_bytes = 0);
  void Add(std::string_view name, int dtype, std::span<const uint64_t> shape, uint64_t offset_bytes,
           uint64_t length_bytes, uint32_t crc32c, const std::map<std::string, std::string>& attributes);
  void AddRef(uint64_t ref_step, std::string_view name, int dtype, std::span<const uint64_t> shape,
              uint64_t offset_bytes, uint64_t length_bytes, uint32_t crc32c,
              const std::map<std::string, std::string>& attributes);
  void Add(const ManifestItem& item) {
    if (item.ref_step) {
      AddRef(*item.ref_step, item.name, item.dtype, item.shape, item.offset_bytes, item.length_bytes, item.crc32c,
             item.attributes);
    } else {
      Add(item.name, item.dtype, item.shape, item.offset_bytes, item.length_bytes, item.crc32c, item.attributes);
    }
  }
  size_t count() const { return count_ + ref_count_; }
  std::string Finish();

 private:
  std::string out_;
  std::string refs_;  // the reference section (v2), appended by Finish
  uint32_t count_ = 0;
  uint32_t ref_count_ = 0;
};

// Meta's refusal of a staged shard whose references name a version meta no
// longer holds (aborted and evicted meanwhile): FailedPrecondition carrying
// kMissingBaseMarker. The agent answers it by compacting the shard into a
// self-contained copy from the base bytes it pinned at commit
// (server/agent/ingest.h, Ingest::CompactRefused).
inline constexpr char kMissingBaseMarker[] = "refers to items of version";
absl::Status MissingBaseError(uint32_t rank, const std::string& job_id, uint64_t step, uint64_t base,
                              const std::string& why);
bool IsMissingBaseRefusal(const absl::Status& s);

// Returns `items` in canonical order (CanonicalItemLess: the shard's own
// items by offset, the order shards are laid out in, then references).
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
// ValidateManifest rejects) give wrong answers; references (whose bytes are
// in another shard) are skipped. Copies what it needs from `items`. Not
// thread-safe.
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
