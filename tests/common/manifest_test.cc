#include "common/manifest.h"

#include <gtest/gtest.h>

#include <vector>

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

}  // namespace
}  // namespace ckpt
