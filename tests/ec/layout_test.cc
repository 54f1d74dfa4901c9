#include "ec/layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ec/codec.h"

namespace ckpt::ec {
namespace {

constexpr uint64_t kMax64 = std::numeric_limits<uint64_t>::max();
constexpr uint32_t kMax32 = std::numeric_limits<uint32_t>::max();

// The segments of `l` tile the blob: each starts where the previous one
// ended, none is longer than SegmentBytes(), only trailing ones are short,
// and together they are the whole blob.
void ExpectTiles(const BlobLayout& l) {
  SCOPED_TRACE(testing::Message() << "blob " << l.blob_bytes << " k " << l.data_k);
  uint64_t pos = 0;
  bool short_seen = false;
  for (uint32_t i = 0; i < l.data_k; ++i) {
    const uint64_t len = l.SegmentLength(i);
    if (len > 0) {
      EXPECT_EQ(l.SegmentStart(i), pos) << "segment " << i;
    }
    EXPECT_LE(len, l.SegmentBytes());
    if (short_seen) {
      EXPECT_EQ(len, 0u) << "segment " << i << " follows a short one";
    }
    if (len < l.SegmentBytes()) short_seen = true;
    pos += len;
  }
  EXPECT_EQ(pos, l.blob_bytes);
  EXPECT_EQ(l.SegmentLength(l.data_k), 0u);
}

TEST(BlobLayout, CutsIntoCeilSizedSegmentsWithShortTail) {
  const BlobLayout l{10, 4};  // 3 + 3 + 3 + 1
  EXPECT_EQ(l.SegmentBytes(), 3u);
  EXPECT_EQ(l.SegmentStart(0), 0u);
  EXPECT_EQ(l.SegmentStart(3), 9u);
  EXPECT_EQ(l.SegmentLength(0), 3u);
  EXPECT_EQ(l.SegmentLength(2), 3u);
  EXPECT_EQ(l.SegmentLength(3), 1u);
  const BlobLayout even{12, 4};
  for (uint32_t i = 0; i < 4; ++i) EXPECT_EQ(even.SegmentLength(i), 3u);
  ExpectTiles(l);
  ExpectTiles(even);
}

TEST(BlobLayout, ZeroLengthBlobHasOnlyEmptySegments) {
  const BlobLayout l{0, 4};
  EXPECT_EQ(l.SegmentBytes(), 0u);
  for (uint32_t i = 0; i < 5; ++i) {
    EXPECT_EQ(l.SegmentLength(i), 0u);
    EXPECT_EQ(l.SegmentStart(i), 0u);
  }
}

TEST(BlobLayout, BlobSmallerThanKLeavesTrailingSegmentsEmpty) {
  // 2 bytes over k = 4: segments of 1, 1, 0, 0 (meta records the empty ones
  // VALID without any bytes; the agents skip them).
  const BlobLayout l{2, 4};
  EXPECT_EQ(l.SegmentBytes(), 1u);
  EXPECT_EQ(l.SegmentLength(0), 1u);
  EXPECT_EQ(l.SegmentLength(1), 1u);
  EXPECT_EQ(l.SegmentLength(2), 0u);
  EXPECT_EQ(l.SegmentLength(3), 0u);
  // An empty segment starts at the end of the blob, never past it.
  EXPECT_EQ(l.SegmentStart(3), 2u);
  // 5 bytes over k = 4: ceil is 2, so 2 + 2 + 1 + 0.
  const BlobLayout five{5, 4};
  EXPECT_EQ(five.SegmentLength(2), 1u);
  EXPECT_EQ(five.SegmentLength(3), 0u);
  ExpectTiles(l);
  ExpectTiles(five);
}

TEST(BlobLayout, KOfZeroOrIndexOutOfRangeIsEmpty) {
  const BlobLayout none{100, 0};
  EXPECT_EQ(none.SegmentBytes(), 0u);
  EXPECT_EQ(none.SegmentLength(0), 0u);
  const BlobLayout l{100, 4};
  EXPECT_EQ(l.SegmentLength(4), 0u);
  EXPECT_EQ(l.SegmentLength(kMax32), 0u);
  EXPECT_EQ(l.SegmentStart(kMax32), 100u);
}

TEST(BlobLayout, NeverWrapsOnHugeBlobsOrIndices) {
  // ceil(size / k) as (size + k - 1) / k would wrap here.
  for (uint32_t k = 1; k <= static_cast<uint32_t>(kMaxDataK); ++k) {
    const BlobLayout l{kMax64, k};
    EXPECT_EQ(l.SegmentBytes(), kMax64 / k + (kMax64 % k != 0 ? 1 : 0)) << k;
    ExpectTiles(l);
    EXPECT_EQ(l.SegmentLength(kMax32), 0u);
  }
  // A large segment size times a large index (as a bad peer request could
  // name) does not wrap back into the blob.
  const BlobLayout big{uint64_t{1} << 40, 2};
  EXPECT_EQ(big.SegmentLength(uint32_t{1} << 31), 0u);
}

TEST(BlobLayout, SameAsTheFormulaItReplaces) {
  // agent/types.h and meta's StartErasureCoding both had: seg = (size + k - 1) / k,
  // start = seg * t, length = start >= size ? 0 : min(seg, size - start).
  std::mt19937_64 rng(35);
  for (int i = 0; i < 20000; ++i) {
    const uint64_t size = i < 1000 ? static_cast<uint64_t>(i) : rng() >> (rng() % 64);
    const uint32_t k = 1 + static_cast<uint32_t>(rng() % kMaxDataK);
    const BlobLayout l{size, k};
    const uint64_t seg = (size + k - 1) / k;
    ASSERT_EQ(l.SegmentBytes(), seg) << size << " " << k;
    for (uint32_t t = 0; t < k; ++t) {
      const uint64_t start = seg * t;
      const uint64_t want = start >= size ? 0 : std::min(seg, size - start);
      ASSERT_EQ(l.SegmentLength(t), want) << size << " " << k << " " << t;
      if (want > 0) {
        ASSERT_EQ(l.SegmentStart(t), start);
      }
    }
  }
}

TEST(ValidateShape, AcceptsTheCodecsShapesOnly) {
  EXPECT_TRUE(ValidateShape(1, 1).ok());
  EXPECT_TRUE(ValidateShape(kMaxDataK, kMaxParityM).ok());
  EXPECT_TRUE(ValidateShape(4, 2).ok());
  for (auto [k, m] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 1}, {-1, 1}, {kMaxDataK + 1, 1}, {4, 0}, {4, -2}, {4, kMaxParityM + 1}, {int64_t{1} << 40, 1}}) {
    const absl::Status s = ValidateShape(k, m);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k << "+" << m;
  }
  EXPECT_EQ(ValidateShape(0, 2).message(), "ec: data k is 0; it must be 1..32");
  EXPECT_EQ(ValidateShape(4, 9).message(), "ec: parity m is 9; it must be 1..8");
  // Every valid shape makes a codec.
  EXPECT_TRUE(Codec::Create(kMaxDataK, kMaxParityM).ok());
}

TEST(StripeLayout, RejectsBadShapesAndSizes) {
  EXPECT_EQ(StripeLayout::Create(5, 4, 2).status().code(), absl::StatusCode::kInvalidArgument);  // < k+m
  EXPECT_EQ(StripeLayout::Create(40, 33, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StripeLayout::Create(40, 4, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StripeLayout::Create(40, 0, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StripeLayout::Create(kMaxGroupSize + 1, 4, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StripeLayout::Create(-1, 4, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(StripeLayout::Create(6, 4, 2).ok());
  EXPECT_TRUE(StripeLayout::Create(11, 4, 2).ok());
  EXPECT_TRUE(StripeLayout::Create(kMaxDataK + kMaxParityM, kMaxDataK, kMaxParityM).ok());
}

TEST(StripeLayout, EveryMemberHoldsKDataAndMParitySlots) {
  for (auto [n, k, m] : std::vector<std::tuple<int, int, int>>{{6, 4, 2}, {11, 4, 2}, {3, 2, 1}, {2, 1, 1},
                                                              {9, 3, 5}, {40, 32, 8}}) {
    SCOPED_TRACE(testing::Message() << n << " members, " << k << "+" << m);
    auto layout = StripeLayout::Create(n, k, m);
    ASSERT_TRUE(layout.ok()) << layout.status();
    ASSERT_EQ(layout->stripes().size(), static_cast<size_t>(n));
    std::set<std::pair<int, int>> segments;  // (member, segment) placed
    for (int s = 0; s < n; ++s) {
      const EcStripe& st = layout->stripes()[s];
      ASSERT_EQ(st.data.size(), static_cast<size_t>(k));
      ASSERT_EQ(st.parity_members.size(), static_cast<size_t>(m));
      std::set<int> members(st.parity_members.begin(), st.parity_members.end());
      for (size_t d = 0; d < st.data.size(); ++d) {
        members.insert(st.data[d].member);
        EXPECT_TRUE(segments.insert({st.data[d].member, st.data[d].segment}).second);
        EXPECT_EQ(layout->SegmentOf(st.data[d].member, st.data[d].segment), (StripeSlot{s, static_cast<int>(d)}));
      }
      EXPECT_EQ(members.size(), static_cast<size_t>(k + m)) << "stripe " << s << " reuses a member";
    }
    EXPECT_EQ(segments.size(), static_cast<size_t>(n) * k);
    for (int j = 0; j < n; ++j) {
      const auto parity = layout->ParityOf(j);
      ASSERT_EQ(parity.size(), static_cast<size_t>(m));
      for (const StripeSlot& slot : parity) {
        EXPECT_EQ(layout->stripes()[slot.stripe].parity_members[slot.position], j);
      }
    }
  }
}

// The rules together: members with blobs of unequal sizes (one empty) are cut
// by BlobLayout, placed by StripeLayout and coded by Codec with each stripe as
// long as its longest data segment; losing any m members loses no blob.
TEST(StripeLayout, UnequalBlobsSurviveAnyMLosses) {
  const int n = 5, k = 3, m = 2;
  auto layout = StripeLayout::Create(n, k, m);
  ASSERT_TRUE(layout.ok());
  auto codec = Codec::Create(k, m);
  ASSERT_TRUE(codec.ok());
  std::mt19937_64 rng(7);
  const std::vector<uint64_t> sizes = {1000, 0, 2, 999, 4097};
  std::vector<std::vector<uint8_t>> blobs(n);
  for (int j = 0; j < n; ++j) {
    blobs[j].resize(sizes[j]);
    for (auto& b : blobs[j]) b = static_cast<uint8_t>(rng());
  }
  auto segment = [&](int member, int t) {
    const BlobLayout l{sizes[member], static_cast<uint32_t>(k)};
    const uint8_t* base = blobs[member].data() + l.SegmentStart(t);
    return std::vector<uint8_t>(base, base + l.SegmentLength(t));
  };
  // parity[s][p]
  std::vector<std::vector<std::vector<uint8_t>>> parity(n);
  std::vector<uint64_t> stripe_len(n, 0);
  for (int s = 0; s < n; ++s) {
    const EcStripe& st = layout->stripes()[s];
    std::vector<std::vector<uint8_t>> data;
    for (const DataSlot& d : st.data) {
      data.push_back(segment(d.member, d.segment));
      stripe_len[s] = std::max<uint64_t>(stripe_len[s], data.back().size());
    }
    std::vector<ConstBuffer> in(data.begin(), data.end());
    parity[s].assign(m, std::vector<uint8_t>(stripe_len[s]));
    std::vector<MutableBuffer> out(parity[s].begin(), parity[s].end());
    ASSERT_TRUE((*codec)->Encode(in, out).ok());
  }
  for (int a = 0; a < n; ++a) {
    for (int b = a + 1; b < n; ++b) {
      SCOPED_TRACE(testing::Message() << "members " << a << " and " << b << " lost");
      for (int s = 0; s < n; ++s) {
        const EcStripe& st = layout->stripes()[s];
        std::vector<std::vector<uint8_t>> bufs(k + m);
        std::vector<Fragment> frags(k + m);
        for (int d = 0; d < k; ++d) {
          const DataSlot& slot = st.data[d];
          const bool lost = slot.member == a || slot.member == b;
          bufs[d] = lost ? std::vector<uint8_t>(stripe_len[s] + 1)
                         : segment(slot.member, slot.segment);
          const uint64_t want = BlobLayout{sizes[slot.member], static_cast<uint32_t>(k)}.SegmentLength(slot.segment);
          frags[d] = Fragment{bufs[d].data(), lost ? want : bufs[d].size(), !lost};
        }
        for (int p = 0; p < m; ++p) {
          const int member = st.parity_members[p];
          const bool lost = member == a || member == b;
          bufs[k + p] = lost ? std::vector<uint8_t>(stripe_len[s] + 1) : parity[s][p];
          frags[k + p] = Fragment{bufs[k + p].data(), lost ? 0 : stripe_len[s], !lost};
        }
        if (stripe_len[s] == 0) continue;  // nothing to code
        ASSERT_TRUE((*codec)->Decode(frags, stripe_len[s]).ok()) << "stripe " << s;
        for (int d = 0; d < k; ++d) {
          const DataSlot& slot = st.data[d];
          const std::vector<uint8_t> want = segment(slot.member, slot.segment);
          ASSERT_TRUE(std::equal(want.begin(), want.end(), bufs[d].begin())) << "stripe " << s << " data " << d;
        }
      }
    }
  }
}

}  // namespace
}  // namespace ckpt::ec
