#include "ec/codec.h"

#include <gtest/gtest.h>
#include <isa-l/erasure_code.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

namespace ckpt::ec {
namespace {

using Bytes = std::vector<uint8_t>;

Bytes RandomBytes(size_t n, std::mt19937_64& rng) {
  Bytes b(n);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

struct Stripe {
  std::vector<Bytes> data;    // k, possibly unequal lengths
  std::vector<Bytes> parity;  // m, each `len`
  size_t len = 0;
};

Stripe MakeStripe(int k, int m, const std::vector<size_t>& lens, std::mt19937_64& rng) {
  Stripe s;
  for (int i = 0; i < k; ++i) s.data.push_back(RandomBytes(lens[i], rng));
  s.len = *std::max_element(lens.begin(), lens.end());
  s.parity.assign(m, Bytes(s.len, 0xAB));
  return s;
}

std::vector<ConstBuffer> Views(const std::vector<Bytes>& v) {
  return std::vector<ConstBuffer>(v.begin(), v.end());
}
std::vector<MutableBuffer> MutViews(std::vector<Bytes>& v) {
  std::vector<MutableBuffer> out;
  for (auto& b : v) out.emplace_back(b);
  return out;
}

// Parity as ISA-L's reference (base, non-SIMD) code computes it on zero-padded copies.
std::vector<Bytes> ReferenceParity(int k, int m, const Stripe& s) {
  std::vector<uint8_t> gen((k + m) * k), tables(32 * k * m);
  gf_gen_cauchy1_matrix(gen.data(), k + m, k);
  ec_init_tables(k, m, gen.data() + k * k, tables.data());
  std::vector<Bytes> padded;
  std::vector<uint8_t*> src;
  for (const auto& d : s.data) {
    padded.push_back(d);
    padded.back().resize(s.len, 0);
  }
  for (auto& p : padded) src.push_back(p.data());
  std::vector<Bytes> out(m, Bytes(s.len));
  std::vector<uint8_t*> dst;
  for (auto& o : out) dst.push_back(o.data());
  if (s.len > 0) ec_encode_data_base(static_cast<int>(s.len), k, m, tables.data(), src.data(), dst.data());
  return out;
}

// Erases `lost` fragments, decodes, and checks every rebuilt byte.
void CheckDecode(const Codec& codec, const Stripe& s, const std::vector<int>& lost) {
  const int k = codec.data_count(), m = codec.parity_count();
  std::vector<Bytes> work;
  for (const auto& d : s.data) work.push_back(d);
  for (const auto& p : s.parity) work.push_back(p);
  std::vector<Fragment> frags(k + m);
  for (int i = 0; i < k + m; ++i) {
    frags[i] = Fragment{work[i].data(), work[i].size(), true};
  }
  for (int x : lost) {
    std::fill(work[x].begin(), work[x].end(), 0x5C);  // garbage where the rebuild goes
    frags[x].present = false;
  }
  ASSERT_TRUE(codec.Decode(frags, s.len).ok());
  for (int x : lost) {
    const Bytes& want = x < k ? s.data[x] : s.parity[x - k];
    ASSERT_EQ(work[x], want) << "fragment " << x << " of RS(" << k << "," << m << ")";
  }
}

void ForEachSubset(int n, int max_size, const std::function<void(const std::vector<int>&)>& fn) {
  for (uint32_t mask = 1; mask < (1u << n); ++mask) {
    if (__builtin_popcount(mask) > max_size) continue;
    std::vector<int> subset;
    for (int i = 0; i < n; ++i)
      if (mask & (1u << i)) subset.push_back(i);
    fn(subset);
  }
}

TEST(Codec, EncodeMatchesIsalReference) {
  std::mt19937_64 rng(1);
  for (auto [k, m] : {std::pair{4, 2}, {8, 3}, {1, 1}, {32, 8}}) {
    auto codec = Codec::Create(k, m);
    ASSERT_TRUE(codec.ok());
    Stripe s = MakeStripe(k, m, std::vector<size_t>(k, 1000), rng);
    auto parity = MutViews(s.parity);
    ASSERT_TRUE((*codec)->Encode(Views(s.data), parity).ok());
    EXPECT_EQ(s.parity, ReferenceParity(k, m, s)) << k << "," << m;
  }
}

TEST(Codec, DecodesEveryErasurePatternUpToM) {
  std::mt19937_64 rng(2);
  int patterns = 0;
  for (int k = 1; k <= 8; ++k) {
    for (int m = 1; m <= 3; ++m) {
      auto codec = Codec::Create(k, m);
      ASSERT_TRUE(codec.ok());
      // Equal lengths (fast path), odd lengths (not a multiple of 32 or 64).
      for (size_t len : {size_t{4096}, size_t{333}}) {
        Stripe s = MakeStripe(k, m, std::vector<size_t>(k, len), rng);
        auto parity = MutViews(s.parity);
        ASSERT_TRUE((*codec)->Encode(Views(s.data), parity).ok());
        ForEachSubset(k + m, m, [&](const std::vector<int>& lost) {
          CheckDecode(**codec, s, lost);
          ++patterns;
        });
      }
    }
  }
  EXPECT_GT(patterns, 1000);
}

TEST(Codec, UnequalLengthsAreZeroPaddedWithoutCopies) {
  std::mt19937_64 rng(3);
  for (int k = 1; k <= 8; ++k) {
    for (int m = 1; m <= 3; ++m) {
      auto codec = Codec::Create(k, m);
      std::vector<size_t> lens(k);
      for (auto& l : lens) l = rng() % 700;  // includes 0 and odd sizes
      lens[rng() % k] = 701;
      Stripe s = MakeStripe(k, m, lens, rng);
      auto parity = MutViews(s.parity);
      ASSERT_TRUE((*codec)->Encode(Views(s.data), parity).ok());
      ASSERT_EQ(s.parity, ReferenceParity(k, m, s));
      ForEachSubset(k + m, m, [&](const std::vector<int>& lost) { CheckDecode(**codec, s, lost); });
    }
  }
}

TEST(Codec, RandomLargerCodesWithPrintedSeed) {
  // Deterministic by default; CKPT_TEST_SEED=N explores other cases.
  const char* env = std::getenv("CKPT_TEST_SEED");
  const uint64_t seed = env != nullptr ? std::strtoull(env, nullptr, 10) : 20261122;
  std::printf("RandomLargerCodesWithPrintedSeed: seed=%llu (set CKPT_TEST_SEED to change)\n",
              static_cast<unsigned long long>(seed));
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 40; ++trial) {
    const int k = 1 + static_cast<int>(rng() % Codec::kMaxData);
    const int m = 1 + static_cast<int>(rng() % Codec::kMaxParity);
    auto codec = Codec::Create(k, m);
    ASSERT_TRUE(codec.ok());
    std::vector<size_t> lens(k);
    const bool equal = rng() % 2;
    const size_t base = 1 + rng() % 3000;
    for (auto& l : lens) l = equal ? base : rng() % (base + 1);
    Stripe s = MakeStripe(k, m, lens, rng);
    auto parity = MutViews(s.parity);
    ASSERT_TRUE((*codec)->Encode(Views(s.data), parity).ok());
    std::vector<int> idx(k + m);
    std::iota(idx.begin(), idx.end(), 0);
    std::shuffle(idx.begin(), idx.end(), rng);
    const int nlost = static_cast<int>(rng() % (m + 1));
    CheckDecode(**codec, s, std::vector<int>(idx.begin(), idx.begin() + nlost));
  }
}

TEST(Codec, UpdateInAnyOrderEqualsFullEncode) {
  std::mt19937_64 rng(4);
  for (auto [k, m] : {std::pair{4, 2}, {8, 2}, {8, 3}, {3, 1}}) {
    auto codec = Codec::Create(k, m);
    std::vector<size_t> lens(k, 1031);
    lens[0] = 17;  // a short segment
    Stripe s = MakeStripe(k, m, lens, rng);
    auto full = MutViews(s.parity);
    ASSERT_TRUE((*codec)->Encode(Views(s.data), full).ok());
    for (int trial = 0; trial < 5; ++trial) {
      std::vector<Bytes> inc(m, Bytes(s.len, 0xEE));
      auto views = MutViews(inc);
      Codec::ZeroParity(views);
      std::vector<int> order(k);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      for (int i : order) ASSERT_TRUE((*codec)->EncodeUpdate(i, s.data[i], views).ok());
      EXPECT_EQ(inc, s.parity) << "RS(" << k << "," << m << ") trial " << trial;
    }
  }
}

// A parity holder folds one row, chunk by chunk, into parity split in pieces.
TEST(Codec, RowUpdateInChunksEqualsFullEncode) {
  std::mt19937_64 rng(6);
  for (auto [k, m] : {std::pair{4, 2}, {3, 1}, {8, 3}}) {
    auto codec = Codec::Create(k, m);
    std::vector<size_t> lens(k, 5000);
    lens[1] = 333;
    Stripe s = MakeStripe(k, m, lens, rng);
    auto full = MutViews(s.parity);
    ASSERT_TRUE((*codec)->Encode(Views(s.data), full).ok());
    for (int row = 0; row < m; ++row) {
      Bytes parity(s.len, 0);
      for (int i = k - 1; i >= 0; --i) {
        for (size_t off = 0; off < s.data[i].size(); off += 777) {
          const size_t n = std::min<size_t>(777, s.data[i].size() - off);
          ASSERT_TRUE((*codec)
                          ->EncodeUpdateRow(i, row, ConstBuffer(s.data[i].data() + off, n),
                                            MutableBuffer(parity.data() + off, n))
                          .ok());
        }
      }
      EXPECT_EQ(parity, s.parity[row]) << "RS(" << k << "," << m << ") row " << row;
    }
    Bytes small(4);
    EXPECT_EQ((*codec)->EncodeUpdateRow(0, m, ConstBuffer(small.data(), 4), MutableBuffer(small)).code(),
              absl::StatusCode::kInvalidArgument);
    Bytes big(8);
    EXPECT_EQ((*codec)->EncodeUpdateRow(0, 0, ConstBuffer(big), MutableBuffer(small)).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(Codec, DeltaAndReplaceUpdateEqualReencode) {
  std::mt19937_64 rng(5);
  const int k = 6, m = 3;
  auto codec = Codec::Create(k, m);
  Stripe s = MakeStripe(k, m, std::vector<size_t>(k, 5000), rng);
  auto parity = MutViews(s.parity);
  ASSERT_TRUE((*codec)->Encode(Views(s.data), parity).ok());

  // Change data 2 in place; fold the delta.
  Bytes new2 = RandomBytes(5000, rng);
  Bytes delta(5000);
  for (size_t i = 0; i < delta.size(); ++i) delta[i] = s.data[2][i] ^ new2[i];
  ASSERT_TRUE((*codec)->DeltaUpdate(2, delta, parity).ok());
  s.data[2] = new2;
  std::vector<Bytes> expect(m, Bytes(5000));
  auto ev = MutViews(expect);
  ASSERT_TRUE((*codec)->Encode(Views(s.data), ev).ok());
  EXPECT_EQ(s.parity, expect);

  // Replace data 5 with a shorter one.
  Bytes new5 = RandomBytes(1234, rng);
  ASSERT_TRUE((*codec)->ReplaceUpdate(5, s.data[5], new5, parity).ok());
  s.data[5] = new5;
  ASSERT_TRUE((*codec)->Encode(Views(s.data), ev).ok());
  EXPECT_EQ(s.parity, expect);
  CheckDecode(**codec, s, {0, 5, 7});
}

TEST(Codec, ZeroLengthStripeIsANoOp) {
  auto codec = Codec::Create(4, 2);
  std::vector<Bytes> data(4), parity(2);
  auto pv = MutViews(parity);
  EXPECT_TRUE((*codec)->Encode(Views(data), pv).ok());
  EXPECT_TRUE((*codec)->EncodeUpdate(1, ConstBuffer(), pv).ok());
  std::vector<Fragment> frags(6);
  for (int i = 0; i < 4; ++i) frags[i].present = true;
  EXPECT_TRUE((*codec)->Decode(frags, 0).ok());
}

TEST(Codec, RejectsBadParameters) {
  for (auto [k, m] : {std::pair{0, 1}, {33, 1}, {1, 0}, {4, 9}, {-1, 2}}) {
    auto c = Codec::Create(k, m);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << k << "," << m;
  }
  EXPECT_NE(Codec::Create(33, 1).status().message().find("k=33"), absl::string_view::npos);
}

TEST(Codec, RejectsMisuseBeforeWritingAnything) {
  std::mt19937_64 rng(6);
  auto codec = Codec::Create(4, 2);
  Stripe s = MakeStripe(4, 2, std::vector<size_t>(4, 128), rng);
  const std::vector<Bytes> before = s.parity;
  auto pv = MutViews(s.parity);
  auto code = [](const absl::Status& st) { return st.code(); };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;

  // Wrong counts.
  const std::vector<ConstBuffer> all = Views(s.data);
  EXPECT_EQ(code((*codec)->Encode(std::span<const ConstBuffer>(all).first(3), pv)), kInvalid);
  EXPECT_EQ(code((*codec)->Encode(Views(s.data), std::span<const MutableBuffer>(pv).first(1))), kInvalid);
  // Data longer than parity.
  std::vector<Bytes> long_data = s.data;
  long_data[1].resize(129);
  EXPECT_EQ(code((*codec)->Encode(Views(long_data), pv)), kInvalid);
  // Parity of unequal length.
  std::vector<Bytes> uneven = {Bytes(128), Bytes(127)};
  EXPECT_EQ(code((*codec)->Encode(Views(s.data), MutViews(uneven))), kInvalid);
  // Null data with a length.
  std::vector<ConstBuffer> nulls = Views(s.data);
  nulls[2] = ConstBuffer(static_cast<const uint8_t*>(nullptr), 128);
  EXPECT_EQ(code((*codec)->Encode(nulls, pv)), kInvalid);
  // Output overlapping input.
  std::vector<ConstBuffer> alias = Views(s.data);
  alias[0] = ConstBuffer(s.parity[1].data(), 128);
  EXPECT_EQ(code((*codec)->Encode(alias, pv)), kInvalid);
  // Overlapping parity buffers.
  Bytes big(200);
  std::vector<MutableBuffer> overlapping = {MutableBuffer(big.data(), 128), MutableBuffer(big.data() + 64, 128)};
  EXPECT_EQ(code((*codec)->Encode(Views(s.data), overlapping)), kInvalid);
  // Bad update index, data too long.
  EXPECT_EQ(code((*codec)->EncodeUpdate(4, s.data[0], pv)), kInvalid);
  EXPECT_EQ(code((*codec)->EncodeUpdate(-1, s.data[0], pv)), kInvalid);
  EXPECT_EQ(code((*codec)->EncodeUpdate(0, long_data[1], pv)), kInvalid);
  EXPECT_EQ(code((*codec)->ReplaceUpdate(0, s.data[0], long_data[1], pv)), kInvalid);
  EXPECT_EQ(s.parity, before) << "a rejected call wrote parity";

  // Decode: wrong count, parity of wrong size, output longer than stripe.
  std::vector<Fragment> frags(6);
  for (int i = 0; i < 4; ++i) frags[i] = {s.data[i].data(), 128, true};
  for (int j = 0; j < 2; ++j) frags[4 + j] = {s.parity[j].data(), 128, true};
  EXPECT_EQ(code((*codec)->Decode(std::span<const Fragment>(frags).first(5), 128)), kInvalid);
  auto bad = frags;
  bad[4].size = 100;
  EXPECT_EQ(code((*codec)->Decode(bad, 128)), kInvalid);
  bad = frags;
  bad[0].present = false;
  bad[0].size = 129;
  EXPECT_EQ(code((*codec)->Decode(bad, 128)), kInvalid);
}

TEST(Codec, MoreThanMLossesIsDataLoss) {
  std::mt19937_64 rng(7);
  auto codec = Codec::Create(4, 2);
  Stripe s = MakeStripe(4, 2, std::vector<size_t>(4, 64), rng);
  std::vector<Fragment> frags(6);
  for (int i = 0; i < 4; ++i) frags[i] = {s.data[i].data(), 64, true};
  for (int j = 0; j < 2; ++j) frags[4 + j] = {s.parity[j].data(), 64, true};
  frags[0].present = frags[2].present = frags[5].present = false;
  const absl::Status st = (*codec)->Decode(frags, 64);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("indices 0,2,5"), absl::string_view::npos) << st.message();
  EXPECT_NE(st.message().find("at most 2"), absl::string_view::npos) << st.message();
}

TEST(Codec, DecodeTableCacheIsBoundedLru) {
  std::mt19937_64 rng(8);
  auto codec = Codec::Create(6, 3, /*decode_cache_entries=*/4);
  Stripe s = MakeStripe(6, 3, std::vector<size_t>(6, 256), rng);
  auto pv = MutViews(s.parity);
  ASSERT_TRUE((*codec)->Encode(Views(s.data), pv).ok());
  for (int a = 0; a < 9; ++a) {
    CheckDecode(**codec, s, {a});
    EXPECT_LE((*codec)->cached_decode_patterns(), 4u);
  }
  EXPECT_EQ((*codec)->cached_decode_patterns(), 4u);
}

TEST(Codec, ConcurrentUseOfOneCodec) {
  auto codec = Codec::Create(8, 3, /*decode_cache_entries=*/8);
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      for (int iter = 0; iter < 50; ++iter) {
        Stripe s = MakeStripe(8, 3, std::vector<size_t>(8, 512 + t), rng);
        auto pv = MutViews(s.parity);
        if (!(*codec)->Encode(Views(s.data), pv).ok()) ++failures[t];
        std::vector<int> lost = {static_cast<int>(rng() % 11)};
        int second = static_cast<int>(rng() % 11);
        if (second != lost[0]) lost.push_back(second);
        std::vector<Bytes> work;
        for (const auto& d : s.data) work.push_back(d);
        for (const auto& p : s.parity) work.push_back(p);
        std::vector<Fragment> frags(11);
        for (int i = 0; i < 11; ++i) frags[i] = {work[i].data(), work[i].size(), true};
        for (int x : lost) {
          std::fill(work[x].begin(), work[x].end(), 0);
          frags[x].present = false;
        }
        if (!(*codec)->Decode(frags, s.len).ok()) ++failures[t];
        for (int x : lost) {
          if (work[x] != (x < 8 ? s.data[x] : s.parity[x - 8])) ++failures[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures, std::vector<int>(4, 0));
}

}  // namespace
}  // namespace ckpt::ec
