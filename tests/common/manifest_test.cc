#include "common/manifest.h"

#include <gtest/gtest.h>

#include <random>
#include <span>
#include <vector>

#include "common/crc32c.h"

namespace ckpt {
namespace {

ManifestItem F32(std::string name, uint64_t offset, uint64_t elements) {
  ManifestItem item;
  item.name = std::move(name);
  item.dtype = 1;  // DTYPE_F32
  item.shape = {elements};
  item.offset_bytes = offset;
  item.length_bytes = elements * 4;
  return item;
}

TEST(Manifest, AcceptsWellFormedItemsWithPadding) {
  std::vector<ManifestItem> items = {F32("b", 128, 8), F32("a", 0, 16)};
  EXPECT_TRUE(ValidateManifest(items, 4096).ok());
}

TEST(Manifest, RejectsOverlap) {
  std::vector<ManifestItem> items = {F32("a", 0, 16), F32("b", 60, 1)};
  absl::Status s = ValidateManifest(items, 4096);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("overlap"), std::string::npos) << s;
}

TEST(Manifest, RejectsItemOutsideShard) {
  std::vector<ManifestItem> items = {F32("a", 4000, 100)};
  absl::Status s = ValidateManifest(items, 4096);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("outside"), std::string::npos) << s;
  // Offsets near 2^64 must not wrap around.
  items = {F32("a", UINT64_MAX - 3, 1)};
  EXPECT_FALSE(ValidateManifest(items, 4096).ok());
}

TEST(Manifest, RejectsDuplicateAndBadNames) {
  std::vector<ManifestItem> items = {F32("a", 0, 1), F32("a", 64, 1)};
  EXPECT_NE(ValidateManifest(items, 4096).message().find("twice"), std::string::npos);
  items = {F32("", 0, 1)};
  EXPECT_FALSE(ValidateManifest(items, 4096).ok());
  items = {F32("bad\nname", 0, 1)};
  EXPECT_FALSE(ValidateManifest(items, 4096).ok());
}

TEST(Manifest, RejectsLengthInconsistentWithShape) {
  ManifestItem item = F32("a", 0, 10);
  item.length_bytes = 41;
  std::vector<ManifestItem> items = {item};
  EXPECT_NE(ValidateManifest(items, 4096).message().find("needs 40 bytes"), std::string::npos);
  item.dtype = kDTypeBytes;  // opaque bytes: any length
  items = {item};
  EXPECT_TRUE(ValidateManifest(items, 4096).ok());
  item.dtype = 99;
  items = {item};
  EXPECT_NE(ValidateManifest(items, 4096).message().find("dtype"), std::string::npos);
}

TEST(Manifest, RejectsAnOverlapWithAnEmptyItemBetween) {
  // "e" (empty) sorts between "a" and "b", which overlap: the empty item must
  // not hide that.
  ManifestItem e = F32("e", 50, 0);
  e.shape = {0};
  std::vector<ManifestItem> items = {F32("a", 0, 25), e, F32("b", 60, 4)};
  absl::Status s = ValidateManifest(items, 4096);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("overlap"), std::string::npos) << s;
  EXPECT_NE(s.message().find("\"a\""), std::string::npos) << s;
  // Empty items may sit anywhere, even inside another item.
  items = {F32("a", 0, 25), e, F32("b", 100, 4)};
  EXPECT_TRUE(ValidateManifest(items, 4096).ok());
}

constexpr uint64_t k2To61 = uint64_t{1} << 61;
constexpr uint64_t k2To63 = uint64_t{1} << 63;

// Issue 34 finding 5: c128 [2^63, 2^61] is 2^128 bytes, which wrapped to 0
// (the length the item claimed), so CommitShard accepted it.
TEST(Manifest, RejectsAShapeWhoseSizeWrapsAround) {
  ManifestItem huge;
  huge.name = "huge";
  huge.dtype = 16;  // c128
  huge.shape = {k2To63, k2To61};
  huge.offset_bytes = 0;
  huge.length_bytes = 0;
  std::vector<ManifestItem> items = {F32("a", 0, 16), huge};
  absl::Status s = ValidateManifest(items, 4096);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const char* want : {"\"huge\"", "is 0 bytes", "c128", "[9223372036854775808, 2305843009213693952]",
                           "more than 2^64"}) {
    EXPECT_NE(s.message().find(want), std::string::npos) << want << " in " << s;
  }
  // f32 [2^63, 2^63] = 2^128 bytes too; as a reference (bytes elsewhere) it
  // is refused the same way.
  huge.dtype = 1;
  huge.shape = {k2To63, k2To63};
  items = {huge};
  EXPECT_EQ(ValidateManifest(items, 4096).code(), absl::StatusCode::kInvalidArgument);
  huge.ref_step = 1;
  items = {huge};
  EXPECT_EQ(ValidateManifest(items, 4096, 2).code(), absl::StatusCode::kInvalidArgument);
  // Exactly 2^64 (u8 [2^32, 2^32]) is one more than 64 bits hold.
  huge.ref_step.reset();
  huge.dtype = 9;
  huge.shape = {uint64_t{1} << 32, uint64_t{1} << 32};
  items = {huge};
  EXPECT_NE(ValidateManifest(items, 4096).message().find("more than 2^64"), std::string::npos);
}

TEST(Manifest, ItemByteLengthIsExact) {
  EXPECT_EQ(ItemByteLength(1, std::vector<uint64_t>{2, 3}).value(), 24u);
  EXPECT_EQ(ItemByteLength(16, std::vector<uint64_t>{}).value(), 16u);  // a scalar
  EXPECT_EQ(ItemByteLength(9, std::vector<uint64_t>{UINT64_MAX}).value(), UINT64_MAX);
  const uint64_t k2To62 = k2To61 << 1;
  EXPECT_EQ(ItemByteLength(2, std::vector<uint64_t>{k2To62 - 1, 2}).value(), 4 * (k2To62 - 1));  // 2^64 - 4
  // A zero dimension makes the product 0, even after others that overflow.
  EXPECT_EQ(ItemByteLength(16, std::vector<uint64_t>{k2To63, k2To63, 0}).value(), 0u);
  for (const auto& [dtype, shape] : std::vector<std::pair<int, std::vector<uint64_t>>>{
           {16, {k2To63, k2To61}}, {2, {k2To63}}, {9, {uint64_t{1} << 32, uint64_t{1} << 32}},
           {4, {uint64_t{1} << 61}}, {1, {3, 5, k2To61, 7}}}) {
    absl::StatusOr<uint64_t> n = ItemByteLength(dtype, shape);
    EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument) << DTypeName(dtype);
    EXPECT_NE(n.status().message().find("more than 2^64"), std::string::npos) << n.status();
  }
  // No fixed element size: opaque bytes and numbers that are not a dtype.
  EXPECT_FALSE(ItemByteLength(kDTypeBytes, std::vector<uint64_t>{8}).ok());
  EXPECT_FALSE(ItemByteLength(0, std::vector<uint64_t>{8}).ok());
  EXPECT_FALSE(ItemByteLength(99, std::vector<uint64_t>{8}).ok());
}

TEST(Manifest, OpaqueBytesKeepAnyLengthAndShape) {
  // DTYPE_BYTES has no element size: its length is free, whatever its shape
  // says (the Python module stores pickles and containers this way).
  ManifestItem b;
  b.name = "pickle";
  b.dtype = kDTypeBytes;
  b.shape = {k2To63, k2To61};
  b.offset_bytes = 0;
  b.length_bytes = 100;
  std::vector<ManifestItem> items = {b};
  EXPECT_TRUE(ValidateManifest(items, 100).ok());
  EXPECT_TRUE(CheckItemLength("pickle", kDTypeBytes, b.shape, 7).ok());
  // A zero-length item with a zero dimension: fine for any dtype.
  ManifestItem z = F32("z", 100, 0);
  z.shape = {0, k2To63, k2To63};
  items = {b, z};
  EXPECT_TRUE(ValidateManifest(items, 100).ok());
}

TEST(Manifest, PlacementIsCheckedWithoutWrapping) {
  EXPECT_TRUE(CheckItemInShard("a", 0, 4096, 4096).ok());
  EXPECT_TRUE(CheckItemInShard("a", 4096, 0, 4096).ok());
  EXPECT_TRUE(CheckItemInShard("a", UINT64_MAX, 0, UINT64_MAX).ok());
  // offset + length = 2^64 + 1 would wrap to 1, inside any shard.
  absl::Status s = CheckItemInShard("w", UINT64_MAX, 2, UINT64_MAX);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  for (const char* want : {"\"w\"", "18446744073709551615", "+2", "outside the shard of 18446744073709551615"}) {
    EXPECT_NE(s.message().find(want), std::string::npos) << want << " in " << s;
  }
  EXPECT_FALSE(CheckItemInShard("w", 2, UINT64_MAX, UINT64_MAX).ok());
  EXPECT_FALSE(CheckItemInShard("w", 4097, 0, 4096).ok());
  // In a manifest: a range whose end would wrap is outside; one that ends
  // exactly at 2^64 - 1 still overlaps what follows it.
  ManifestItem big;
  big.name = "big";
  big.dtype = kDTypeBytes;
  big.offset_bytes = 16;
  big.length_bytes = UINT64_MAX - 8;
  std::vector<ManifestItem> items = {F32("a", 0, 4), big};
  EXPECT_NE(ValidateManifest(items, UINT64_MAX).message().find("outside"), std::string::npos);
  big.length_bytes = UINT64_MAX - 16;
  items = {F32("a", 0, 4), big, F32("c", 100, 1)};
  EXPECT_NE(ValidateManifest(items, UINT64_MAX).message().find("overlap"), std::string::npos);
}

ManifestItem Rich(std::string name, uint64_t offset) {
  ManifestItem it = F32(std::move(name), offset, 6);
  it.shape = {2, 3};
  it.crc32c = 0xdeadbeef;
  it.attributes = {{"py.type", "torch"}, {"a", ""}};
  return it;
}

TEST(Manifest, EncodingIsTheDocumentedCanonicalLayout) {
  // docs/protocol.md "Manifest digest", built by hand for one item.
  ManifestItem it = F32("w", 64, 2);
  it.crc32c = 0x01020304;
  it.attributes = {{"k", "v"}};
  std::string want = "ckpt-manifest-v1";
  auto u32 = [&](uint32_t v) { for (int i = 0; i < 4; ++i) want.push_back(static_cast<char>(v >> (8 * i))); };
  auto u64 = [&](uint64_t v) { for (int i = 0; i < 8; ++i) want.push_back(static_cast<char>(v >> (8 * i))); };
  u32(1);
  u32(1), want += "w";
  u32(1);           // dtype f32
  u32(1), u64(2);   // shape [2]
  u64(64), u64(8);  // offset, length
  u32(0x01020304);
  u32(1);
  u32(1), want += "k", u32(1), want += "v";
  std::vector<ManifestItem> items = {it};
  EXPECT_EQ(EncodeManifest(items), want);
  EXPECT_EQ(ManifestDigest(items), ManifestDigestOfEncoding(want));
}

TEST(Manifest, EncodeDecodeRoundTripInOffsetOrder) {
  std::vector<ManifestItem> items = {Rich("z", 128), Rich("héllo/wörld", 0), F32("m", 64, 0)};
  items[2].shape = {};
  items[2].length_bytes = 4;
  const std::string enc = EncodeManifest(items);
  absl::StatusOr<std::vector<ManifestItem>> back = DecodeManifest(enc);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, SortedByOffset(items));
  EXPECT_EQ(ManifestDigest(*back), ManifestDigest(items));
  // The incremental encoder gives the same bytes, and can be reused.
  ManifestEncoder e;
  for (const ManifestItem& it : SortedByOffset(items)) e.Add(it);
  EXPECT_EQ(e.count(), 3u);
  EXPECT_EQ(e.Finish(), enc);
  EXPECT_EQ(e.count(), 0u);
  EXPECT_EQ(e.Finish(), EncodeManifest({}));
  // The smallest items: a one-byte name, no dimensions, no attributes.
  std::vector<ManifestItem> tiny(3);
  for (size_t i = 0; i < tiny.size(); ++i) {
    tiny[i].name = std::string(1, static_cast<char>('a' + i));
    tiny[i].dtype = kDTypeBytes;
    tiny[i].offset_bytes = i;
    tiny[i].length_bytes = 1;
  }
  back = DecodeManifest(EncodeManifest(tiny));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, tiny);
  absl::StatusOr<std::vector<ManifestItem>> none = DecodeManifest(EncodeManifest({}));
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

TEST(Manifest, DecodeRejectsEveryMalformedEncoding) {
  const std::string enc = EncodeManifest(std::vector<ManifestItem>{Rich("a", 0), Rich("b", 64)});
  // Every truncation, and anything appended.
  for (size_t n = 0; n < enc.size(); ++n) {
    EXPECT_EQ(DecodeManifest(enc.substr(0, n)).status().code(), absl::StatusCode::kInvalidArgument) << n;
  }
  EXPECT_FALSE(DecodeManifest(enc + "x").ok());
  std::string tag = enc;
  tag[0] = 'K';
  EXPECT_FALSE(DecodeManifest(tag).ok());
  // A count far beyond the bytes: refused before allocating.
  std::string count = enc;
  count[16] = count[17] = count[18] = count[19] = '\xff';
  absl::Status s = DecodeManifest(count).status();
  EXPECT_NE(s.message().find("cannot hold"), std::string::npos) << s;
  // Out of offset order: not canonical.
  ManifestEncoder e;
  e.Add(Rich("b", 64));
  e.Add(Rich("a", 0));
  s = DecodeManifest(e.Finish()).status();
  EXPECT_NE(s.message().find("canonical order"), std::string::npos) << s;
  // Attribute keys out of order (or repeated).
  ManifestItem dup = Rich("a", 0);
  std::string bytes = EncodeManifest(std::vector<ManifestItem>{dup});
  const size_t at = bytes.find("py.type");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 7, "0000000");  // "0000000" < "a": the order breaks
  EXPECT_FALSE(DecodeManifest(bytes).ok());
}

TEST(Manifest, DigestIgnoresItemOrderButSeesEveryField) {
  std::vector<ManifestItem> a = {F32("x", 0, 4), F32("y", 64, 4)};
  std::vector<ManifestItem> b = {a[1], a[0]};
  EXPECT_EQ(ManifestDigest(a), ManifestDigest(b));
  std::vector<ManifestItem> c = a;
  c[1].crc32c = 1;
  EXPECT_NE(ManifestDigest(a), ManifestDigest(c));
  c = a;
  c[0].attributes["k"] = "v";
  EXPECT_NE(ManifestDigest(a), ManifestDigest(c));
  c = a;
  c[0].shape = {2, 2};
  EXPECT_NE(ManifestDigest(a), ManifestDigest(c));
}

ManifestItem Ref(std::string name, uint64_t ref_step, uint64_t offset) {
  ManifestItem it = Rich(std::move(name), offset);
  it.ref_step = ref_step;
  return it;
}

TEST(Manifest, ReferencesEncodeAsV2AfterTheShardsOwnItems) {
  // docs/protocol.md "Manifest digest": v1 body, u32 ref_count, then per
  // reference u64 ref_step and the item.
  std::vector<ManifestItem> items = {Ref("r2", 7, 0), F32("own", 64, 2), Ref("r1", 3, 4096), Ref("r0", 3, 0)};
  const std::string enc = EncodeManifest(items);
  ASSERT_EQ(enc.substr(0, 16), "ckpt-manifest-v2");
  std::vector<ManifestItem> own = {F32("own", 64, 2)};
  std::string v1 = EncodeManifest(own);
  std::string want = "ckpt-manifest-v2" + v1.substr(16);
  auto u32 = [&](uint32_t v) { for (int i = 0; i < 4; ++i) want.push_back(static_cast<char>(v >> (8 * i))); };
  u32(3);
  // The reference section, canonical: (ref_step, offset) ascending.
  for (const ManifestItem& r : {Ref("r0", 3, 0), Ref("r1", 3, 4096), Ref("r2", 7, 0)}) {
    for (int i = 0; i < 8; ++i) want.push_back(static_cast<char>(*r.ref_step >> (8 * i)));
    std::vector<ManifestItem> one = {r};
    one[0].ref_step.reset();
    want += EncodeManifest(one).substr(20);  // the item alone
  }
  EXPECT_EQ(enc, want);
  absl::StatusOr<std::vector<ManifestItem>> back = DecodeManifest(enc);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, SortedByOffset(items));
  EXPECT_EQ((*back)[0].name, "own");
  EXPECT_EQ(*(*back)[3].ref_step, 7u);
  EXPECT_EQ(RefSteps(items), (std::vector<uint64_t>{3, 7}));
  EXPECT_TRUE(RefSteps(own).empty());
  // The encoder takes own items and references interleaved.
  ManifestEncoder e;
  e.Add(Ref("r0", 3, 0));
  e.Add(F32("own", 64, 2));
  e.Add(Ref("r1", 3, 4096));
  e.Add(Ref("r2", 7, 0));
  EXPECT_EQ(e.count(), 4u);
  EXPECT_EQ(e.Finish(), enc);
  // ...and is back to v1 after Finish.
  e.Add(F32("own", 64, 2));
  EXPECT_EQ(e.Finish(), v1);
  // A reference is part of the digest: same item, other step or none.
  std::vector<ManifestItem> other = items;
  other[0].ref_step = 8;
  EXPECT_NE(ManifestDigest(other), ManifestDigest(items));
  other[0].ref_step.reset();
  EXPECT_NE(ManifestDigest(other), ManifestDigest(items));
  // Malformed v2: every truncation, a v2 with no references, refs out of order.
  for (size_t n = 0; n < enc.size(); ++n) EXPECT_FALSE(DecodeManifest(enc.substr(0, n)).ok()) << n;
  std::string empty_refs = "ckpt-manifest-v2" + v1.substr(16) + std::string(4, '\0');
  EXPECT_NE(DecodeManifest(empty_refs).status().message().find("not canonical"), std::string::npos);
  e.AddRef(7, "b", 1, std::vector<uint64_t>{1}, 0, 4, 0, {});
  e.AddRef(3, "a", 1, std::vector<uint64_t>{1}, 0, 4, 0, {});
  EXPECT_NE(DecodeManifest(e.Finish()).status().message().find("canonical order"), std::string::npos);
}

TEST(Manifest, PackedItemsReadInPlaceAgreeWithTheDecodedOnes) {
  std::vector<ManifestItem> items = {Rich("z", 128), Rich("héllo/wörld", 0), F32("m", 64, 3), Ref("r", 5, 4096)};
  items[2].shape = {1, 3};
  const std::string enc = EncodeManifest(items);
  absl::StatusOr<std::vector<ManifestItem>> decoded = DecodeManifest(enc);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(PackedHasRefs(enc));
  EXPECT_FALSE(PackedHasRefs(EncodeManifest(std::vector<ManifestItem>{F32("m", 0, 1)})));
  EXPECT_EQ(PackedItemCount(enc), 3u);  // the shard's own items
  EXPECT_EQ(PackedItemCount(enc.substr(0, 10)), 0u);
  std::vector<ManifestItem> read;
  ASSERT_TRUE(ForEachPackedItem(enc, [&](const PackedItem& p) {
                ManifestItem& it = read.emplace_back();
                it.ref_step = p.ref_step;
                it.name = std::string(p.name);
                it.dtype = p.dtype;
                it.shape = p.Shape();
                for (uint32_t d = 0; d < p.dims; ++d) EXPECT_EQ(p.Dim(d), it.shape[d]);
                it.offset_bytes = p.offset_bytes;
                it.length_bytes = p.length_bytes;
                it.crc32c = p.crc32c;
                it.attributes = p.Attributes();
                EXPECT_EQ(p.attribute_count, it.attributes.size());
                return absl::OkStatus();
              }).ok());
  EXPECT_EQ(read, *decoded);
  // The caller's error stops the walk and comes back as it is.
  int calls = 0;
  absl::Status s = ForEachPackedItem(enc, [&](const PackedItem&) {
    return ++calls == 2 ? absl::DataLossError("enough") : absl::OkStatus();
  });
  EXPECT_EQ(s, absl::DataLossError("enough"));
  EXPECT_EQ(calls, 2);
  // Malformed encodings are refused as DecodeManifest refuses them, before
  // the walk reaches the bytes that are wrong.
  for (size_t n = 0; n < enc.size(); ++n) {
    EXPECT_EQ(ForEachPackedItem(enc.substr(0, n), [](const PackedItem&) { return absl::OkStatus(); }).code(),
              absl::StatusCode::kInvalidArgument)
        << n;
  }
}

TEST(Manifest, ValidationChecksReferencesApartFromTheShardsBytes) {
  // A reference may lie beyond this shard (its bytes are elsewhere) and
  // overlap own items' offsets; names stay unique across both.
  std::vector<ManifestItem> items = {F32("own", 0, 16), Ref("r", 3, 1 << 20), Ref("s", 3, 0)};
  EXPECT_TRUE(ValidateManifest(items, 64).ok());
  EXPECT_TRUE(ValidateManifest(items, 64, 4).ok());
  absl::Status s = ValidateManifest(items, 64, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("not older"), std::string::npos) << s;
  items.push_back(Ref("own", 2, 0));
  EXPECT_NE(ValidateManifest(items, 64).message().find("twice"), std::string::npos);
  items.pop_back();
  items[1].length_bytes = 5;  // f32 [2, 3] needs 24
  EXPECT_NE(ValidateManifest(items, 64).message().find("needs 24"), std::string::npos);
  // The crc stream skips references.
  std::vector<std::byte> bytes(64, std::byte{1});
  items = {F32("own", 0, 16), Ref("r", 3, 0)};
  items[0].crc32c = Crc32c(bytes.data(), 64);
  ItemCrcStream check(items);
  EXPECT_TRUE(check.Update(bytes).ok());
  EXPECT_TRUE(check.Finish().ok());
}

TEST(Manifest, DigestOfEmptyManifestIsStable) {
  // XXH3-64 of "ckpt-manifest-v1" followed by u32 0: a fixed value readers in
  // other languages can check their encoder against.
  EXPECT_EQ(ManifestDigest({}), ManifestDigest(std::vector<ManifestItem>{}));
  EXPECT_NE(ManifestDigest({}), 0u);
}

TEST(Manifest, DTypeNamesRoundTrip) {
  for (int d = 1; d <= kMaxDType; ++d) {
    absl::StatusOr<int> back = DTypeFromName(DTypeName(d));
    ASSERT_TRUE(back.ok()) << d;
    EXPECT_EQ(*back, d);
  }
  EXPECT_EQ(DTypeElementSize(1), 4u);
  EXPECT_EQ(DTypeElementSize(16), 16u);
  EXPECT_FALSE(DTypeFromName("f128").ok());
}

// A shard of `size` seeded random bytes with items at the given (offset,
// length) ranges, their crcs filled in.
struct Shard {
  std::vector<std::byte> bytes;
  std::vector<ManifestItem> items;
};
Shard MakeShard(uint64_t size, const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
  Shard s;
  std::mt19937 rng(7);
  s.bytes.resize(size);
  for (std::byte& b : s.bytes) b = static_cast<std::byte>(rng());
  for (size_t i = 0; i < ranges.size(); ++i) {
    ManifestItem it;
    it.name = "item" + std::to_string(i);
    it.dtype = kDTypeBytes;
    it.offset_bytes = ranges[i].first;
    it.length_bytes = ranges[i].second;
    it.crc32c = Crc32c(s.bytes.data() + it.offset_bytes, it.length_bytes);
    s.items.push_back(std::move(it));
  }
  return s;
}

// Feeds `bytes` to `check` in pieces of `piece` bytes.
absl::Status Feed(ItemCrcStream& check, std::span<const std::byte> bytes, size_t piece) {
  for (size_t off = 0; off < bytes.size(); off += piece) {
    absl::Status s = check.Update(bytes.subspan(off, std::min(piece, bytes.size() - off)));
    if (!s.ok()) return s;
  }
  return check.Finish();
}

TEST(ItemCrcStream, AcceptsMatchingItemsWhateverThePieceSize) {
  // Items out of order, with padding, an empty item inside the gap and one
  // at the very end.
  Shard s = MakeShard(1000, {{500, 300}, {0, 100}, {128, 0}, {160, 333}, {1000, 0}});
  ASSERT_TRUE(ValidateManifest(s.items, 1000).ok());
  for (size_t piece : {1, 7, 64, 100, 333, 999, 1000, 4096}) {
    ItemCrcStream check(s.items);
    EXPECT_TRUE(Feed(check, s.bytes, piece).ok()) << "piece " << piece;
    EXPECT_EQ(check.position(), 1000u);
  }
}

TEST(ItemCrcStream, NamesTheCorruptItemAsSoonAsItIsComplete) {
  Shard s = MakeShard(1000, {{0, 100}, {160, 333}, {500, 300}});
  s.bytes[170] ^= std::byte{1};
  ItemCrcStream check(s.items);
  ASSERT_TRUE(check.Update(std::span(s.bytes).first(400)).ok());  // item1 not complete yet
  absl::Status st = check.Update(std::span(s.bytes).subspan(400, 100));
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("item1"), std::string::npos) << st;
}

TEST(ItemCrcStream, PaddingIsNotChecked) {
  Shard s = MakeShard(1000, {{0, 100}, {500, 300}});
  s.bytes[300] ^= std::byte{1};  // between the items
  ItemCrcStream check(s.items);
  EXPECT_TRUE(Feed(check, s.bytes, 64).ok());
}

TEST(ItemCrcStream, BytesEndingEarlyAreDataLoss) {
  Shard s = MakeShard(1000, {{0, 100}, {500, 300}});
  ItemCrcStream check(s.items);
  ASSERT_TRUE(check.Update(std::span(s.bytes).first(600)).ok());
  absl::Status st = check.Finish();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("item1"), std::string::npos) << st;
  ItemCrcStream none({});
  EXPECT_TRUE(none.Finish().ok());
}

}  // namespace
}  // namespace ckpt
