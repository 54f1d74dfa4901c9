// Reed-Solomon erasure coding over GF(2^8), built on ISA-L.
//
// A stripe is k data fragments and m parity fragments (RS(k, m)), coded with a
// Cauchy generator matrix (gf_gen_cauchy1_matrix), in which every square
// submatrix is invertible: ANY k of the k+m fragments rebuild all the others.
//
//     fragment index:   0 .. k-1            k .. k+m-1
//                       data D0..D(k-1)     parity P0..P(m-1)
//
//     Pj[x] = sum_i  C[j][i] * Di[x]        (sums are XOR, products in GF(2^8))
//
// Fragment lengths. The stripe length L is the parity length. A data fragment
// may be shorter than L: it is treated as zero-padded to L, without copying
// (segments of unequal node blobs, docs/architecture.md "Protection"). Every parity fragment has
// length exactly L. No alignment is required of lengths or addresses; buffers
// written by a call must not overlap any other buffer of that call.
//
// Incremental encoding. Because parity is linear in each data fragment, a
// parity holder can start from zeroed parity and fold each data fragment in
// as it arrives, in any order (EncodeUpdate); and a changed data fragment is
// folded in as (old xor new) (DeltaUpdate / ReplaceUpdate). The result is
// byte-identical to a full Encode.
//
// Errors: InvalidArgument for bad k/m, counts, lengths, null or overlapping
// buffers, always before any ISA-L call and before any output byte is written;
// DataLoss when fewer than k fragments survive.
//
// Thread safety: a Codec is immutable after Create() except for its decode
// table cache, which is internally locked: any number of threads may call any
// method of one Codec concurrently (on disjoint output buffers). No method
// blocks on I/O or allocates in proportion to the data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace ckpt::ec {

using ConstBuffer = std::span<const uint8_t>;
using MutableBuffer = std::span<uint8_t>;

// One fragment of a stripe as Decode() sees it.
struct Fragment {
  // Present: the surviving bytes, read-only for Decode. Missing: where the
  // rebuilt bytes go.
  uint8_t* data = nullptr;
  // Present data fragment: its length (<= stripe length; the rest is zero).
  // Present parity fragment: must equal the stripe length.
  // Missing fragment: how many bytes to rebuild (<= stripe length), i.e. the
  // prefix of the zero-padded fragment the caller wants (0 rebuilds nothing).
  size_t size = 0;
  bool present = false;
};

class Codec {
 public:
  static constexpr int kMaxData = 32;
  static constexpr int kMaxParity = 8;
  static constexpr size_t kDefaultDecodeCacheEntries = 64;

  // Creates an RS(k, m) codec, 1 <= k <= 32, 1 <= m <= 8. Decode tables for up
  // to `decode_cache_entries` distinct erasure patterns are kept (LRU).
  // InvalidArgument for anything else.
  static absl::StatusOr<std::unique_ptr<Codec>> Create(
      int k, int m, size_t decode_cache_entries = kDefaultDecodeCacheEntries);

  int data_count() const { return k_; }
  int parity_count() const { return m_; }

  // Computes all m parity fragments from the k data fragments. `data` has k
  // entries (any may be shorter than the stripe, or empty); `parity` has m
  // entries of equal length L >= every data length, fully overwritten.
  absl::Status Encode(std::span<const ConstBuffer> data,
                      std::span<const MutableBuffer> parity) const;

  // Folds data fragment `data_index` (0 <= data_index < k) into `parity` (m
  // equal-length buffers, L >= data.size()): parity ^= C[.][data_index] * data.
  // Starting from zeroed parity (ZeroParity) and folding every fragment once,
  // in any order, yields Encode()'s result. Folding the same fragment twice
  // cancels it out (XOR), which is how a stale contribution is removed.
  absl::Status EncodeUpdate(int data_index, ConstBuffer data,
                            std::span<const MutableBuffer> parity) const;

  // As EncodeUpdate for ONE parity row: parity_row ^= C[parity_index][data_index]
  // * data, over data.size() bytes (<= parity_row.size()). The buffers may be
  // any aligned sub-range [x, x+n) of the fragment and of the parity (the fold
  // is bytewise), which lets a parity holder fold chunks as they arrive and
  // parity that lives in several memory pieces. 0 <= parity_index < m.
  absl::Status EncodeUpdateRow(int data_index, int parity_index, ConstBuffer data,
                               MutableBuffer parity_row) const;

  // Folds a change of data fragment `data_index` into existing parity, given
  // delta = old xor new (zero-padded to the longer of the two). Same cost and
  // contract as EncodeUpdate.
  absl::Status DeltaUpdate(int data_index, ConstBuffer delta,
                           std::span<const MutableBuffer> parity) const {
    return EncodeUpdate(data_index, delta, parity);
  }

  // As DeltaUpdate, from the old and new contents of the fragment (either may
  // be shorter; both <= L). Reads each once; needs no temporary buffer.
  absl::Status ReplaceUpdate(int data_index, ConstBuffer old_data, ConstBuffer new_data,
                             std::span<const MutableBuffer> parity) const;

  // Zeroes the parity buffers before the first EncodeUpdate.
  static void ZeroParity(std::span<const MutableBuffer> parity);

  // Rebuilds every missing fragment from the present ones. `fragments` has k+m
  // entries, data first, then parity; `stripe_size` is L. Uses the first k
  // present fragments (data preferred, since index order puts data first).
  // DataLoss, naming the lost fragments, when fewer than k are present.
  absl::Status Decode(std::span<const Fragment> fragments, size_t stripe_size) const;

  // Number of erasure patterns whose decode tables are cached (for tests).
  size_t cached_decode_patterns() const;

 private:
  // Coefficients rebuilding the missing fragments from the chosen survivors,
  // plus ISA-L's expanded tables for them.
  struct DecodePlan {
    std::vector<uint8_t> matrix;  // missing x k
    std::vector<uint8_t> tables;  // 32 * k * missing
  };
  using PatternKey = std::pair<uint64_t, uint64_t>;  // (survivors, missing) bit sets

  Codec(int k, int m, size_t cache_entries);

  absl::StatusOr<std::shared_ptr<const DecodePlan>> GetDecodePlan(
      const std::vector<int>& survivors, const std::vector<int>& missing) const;
  absl::Status CheckParity(std::span<const MutableBuffer> parity, size_t* stripe_size) const;

  const int k_;
  const int m_;
  const size_t cache_entries_;
  std::vector<uint8_t> generator_;      // (k+m) x k, identity on top
  std::vector<uint8_t> encode_tables_;  // 32 * k * m, for the parity rows

  mutable absl::Mutex cache_mu_;
  mutable std::list<PatternKey> lru_ ABSL_GUARDED_BY(cache_mu_);  // front = newest
  struct CacheEntry {
    std::shared_ptr<const DecodePlan> plan;
    std::list<PatternKey>::iterator lru_pos;
  };
  struct KeyHash {
    size_t operator()(const PatternKey& k) const {
      return std::hash<uint64_t>()(k.first * 0x9E3779B97F4A7C15ull ^ k.second);
    }
  };
  mutable absl::flat_hash_map<PatternKey, CacheEntry, KeyHash> cache_ ABSL_GUARDED_BY(cache_mu_);
};

}  // namespace ckpt::ec
