// common/global_tensor: the ckpt.global_* attributes, boxes and the strided
// copy a resharding load assembles slices with.
#include "common/global_tensor.h"

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "absl/strings/match.h"
#include "common/manifest.h"

namespace ckpt {
namespace {

constexpr int kF32 = 1;

TEST(GlobalTensor, AttributesRoundTrip) {
  const std::vector<uint64_t> shape = {3, 4};
  auto attrs = GlobalAttributes("model/w", "model/w", std::vector<uint64_t>{10, 4}, std::vector<uint64_t>{7, 0});
  EXPECT_EQ(attrs.size(), 2u);  // no name when it is the item's
  auto place = ParseGlobalPlace("model/w", kF32, shape, attrs);
  ASSERT_TRUE(place.ok()) << place.status();
  ASSERT_TRUE(place->has_value());
  EXPECT_EQ((*place)->name, "model/w");
  EXPECT_EQ((*place)->shape, (std::vector<uint64_t>{10, 4}));
  EXPECT_EQ((*place)->offsets, (std::vector<uint64_t>{7, 0}));
  attrs = GlobalAttributes("optimizer/w%2Fexp_avg", "optimizer/w/exp_avg", std::vector<uint64_t>{10, 4},
                           std::vector<uint64_t>{0, 0});
  place = ParseGlobalPlace("optimizer/w%2Fexp_avg", kF32, shape, attrs);
  ASSERT_TRUE(place.ok() && place->has_value());
  EXPECT_EQ((*place)->name, "optimizer/w/exp_avg");
  // A scalar: empty lists.
  attrs = GlobalAttributes("step", "step", {}, {});
  place = ParseGlobalPlace("step", kF32, {}, attrs);
  ASSERT_TRUE(place.ok() && place->has_value()) << place.status();
  EXPECT_TRUE((*place)->shape.empty());
  // No attributes: no global tensor.
  place = ParseGlobalPlace("x", kF32, shape, {{"py.type", "torch"}});
  ASSERT_TRUE(place.ok());
  EXPECT_FALSE(place->has_value());
}

TEST(GlobalTensor, MalformedAttributesAreRefusedNamingTheItem) {
  const std::vector<uint64_t> shape = {3, 4};
  const std::vector<std::map<std::string, std::string>> bad = {
      {{kGlobalShapeKey, "10,x"}},
      {{kGlobalShapeKey, "10,4"}, {kGlobalOffsetKey, "8,0"}},    // 8 + 3 > 10
      {{kGlobalShapeKey, "10,4"}, {kGlobalOffsetKey, "0,0,0"}},  // three dimensions
      {{kGlobalShapeKey, "10"}},                                 // one
      {{kGlobalOffsetKey, "0,0"}},                               // no shape
      {{kGlobalShapeKey, "10,4"}, {kGlobalOffsetKey, "18446744073709551615,0"}},
      {{kGlobalShapeKey, "99999999999999999999,4"}},             // over 2^64
      {{kGlobalShapeKey, "4611686018427387904,4"}},              // no byte size
      {{kGlobalShapeKey, ",4"}},
      {{kGlobalShapeKey, "10,4"}, {kGlobalNameKey, ""}},
  };
  for (const auto& attrs : bad) {
    auto place = ParseGlobalPlace("model/w", kF32, shape, attrs);
    EXPECT_EQ(place.status().code(), absl::StatusCode::kInvalidArgument) << attrs.begin()->second;
    EXPECT_TRUE(absl::StrContains(place.status().message(), "model/w")) << place.status();
  }
  auto bytes = ParseGlobalPlace("blob", kDTypeBytes, std::vector<uint64_t>{4}, {{kGlobalShapeKey, "4"}});
  EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GlobalTensor, IntersectAndElements) {
  Box a{{0, 2}, {5, 4}}, b{{3, 0}, {4, 3}};
  auto i = Intersect(a, b);
  ASSERT_TRUE(i.has_value());
  EXPECT_EQ(i->offsets, (std::vector<uint64_t>{3, 2}));
  EXPECT_EQ(i->lengths, (std::vector<uint64_t>{2, 1}));
  EXPECT_EQ(i->Elements(), 2u);
  EXPECT_FALSE(Intersect(Box{{0}, {3}}, Box{{3}, {2}}).has_value());  // touching, not overlapping
  EXPECT_EQ(Box{}.Elements(), 1u);                                      // a scalar
}

// Every way of cutting a 3-d tensor into two pieces along each dimension and
// reading it back into boxes at other places gives the same elements as
// indexing the whole tensor.
TEST(GlobalTensor, CopyBoxMatchesElementwiseIndexing) {
  const std::vector<uint64_t> g = {5, 7, 3};
  std::vector<float> whole(5 * 7 * 3);
  std::iota(whole.begin(), whole.end(), 1.0f);
  auto at = [&](uint64_t i, uint64_t j, uint64_t k) { return whole[(i * 7 + j) * 3 + k]; };
  auto extract = [&](const Box& b) {
    std::vector<float> out;
    for (uint64_t i = 0; i < b.lengths[0]; ++i)
      for (uint64_t j = 0; j < b.lengths[1]; ++j)
        for (uint64_t k = 0; k < b.lengths[2]; ++k)
          out.push_back(at(b.offsets[0] + i, b.offsets[1] + j, b.offsets[2] + k));
    return out;
  };
  const std::vector<Box> sources = {Box{{0, 0, 0}, {5, 7, 3}}, Box{{1, 2, 0}, {3, 5, 3}}, Box{{0, 3, 1}, {5, 4, 2}}};
  const std::vector<Box> targets = {Box{{2, 1, 0}, {3, 6, 3}}, Box{{0, 0, 0}, {5, 7, 3}}, Box{{4, 0, 2}, {1, 7, 1}}};
  for (const Box& s : sources) {
    const std::vector<float> src = extract(s);
    for (const Box& t : targets) {
      auto part = Intersect(s, t);
      if (!part) continue;
      std::vector<float> dst(t.Elements(), -1.0f);
      CopyBox(std::as_bytes(std::span<const float>(src)), s, std::as_writable_bytes(std::span<float>(dst)), t, *part,
              sizeof(float));
      const std::vector<float> expected_part = extract(*part);
      // The part's elements landed where t says; nothing else was touched.
      size_t n = 0, touched = 0;
      for (uint64_t i = 0; i < t.lengths[0]; ++i)
        for (uint64_t j = 0; j < t.lengths[1]; ++j)
          for (uint64_t k = 0; k < t.lengths[2]; ++k) {
            const uint64_t gi = t.offsets[0] + i, gj = t.offsets[1] + j, gk = t.offsets[2] + k;
            const bool inside = gi >= part->offsets[0] && gi < part->offsets[0] + part->lengths[0] &&
                                gj >= part->offsets[1] && gj < part->offsets[1] + part->lengths[1] &&
                                gk >= part->offsets[2] && gk < part->offsets[2] + part->lengths[2];
            const float v = dst[n++];
            if (inside) {
              EXPECT_EQ(v, at(gi, gj, gk));
              ++touched;
            } else {
              EXPECT_EQ(v, -1.0f);
            }
          }
      EXPECT_EQ(touched, expected_part.size());
    }
  }
}

TEST(GlobalTensor, CopyBoxOfAScalar) {
  const double x = 2.5;
  double y = 0;
  CopyBox(std::as_bytes(std::span<const double>(&x, 1)), Box{}, std::as_writable_bytes(std::span<double>(&y, 1)),
          Box{}, Box{}, sizeof(double));
  EXPECT_EQ(y, 2.5);
}

}  // namespace
}  // namespace ckpt
