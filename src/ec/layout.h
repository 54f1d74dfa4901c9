// Where the bytes of an EC group go: how a node's blob is cut into segments
// (BlobLayout) and which segments form which stripe on which members
// (StripeLayout). The one home of these rules: meta plans and records segments
// with them, the agents cut, push and rebuild segments with them.
//
// A group of n members protects each member's BLOB (its primaries of a
// version, in rank order) with RS(k, m):
//
//   blob of member j:  | seg 0 | seg 1 | ... | seg k-1 |     each ceil(size/k)
//                                                            bytes; trailing
//                                                            ones short or empty
//   stripe s (of n):   parity on members s..s+m-1 (mod n), data on the next k
//                      members (mod n) in member order; member j's segment t
//                      is the data of the t-th stripe (by index) j is a data
//                      member of. The stripe length is its longest data
//                      segment; every parity segment has that length, shorter
//                      data segments count as zero-padded (ec::Codec).
//
// Thread safety: plain values and immutable objects; any number of threads may
// use them concurrently. Nothing here blocks or does I/O.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt::ec {

// The shapes RS(k, m) supports (ec::Codec, the proto's EC policy).
inline constexpr int kMinDataK = 1;
inline constexpr int kMaxDataK = 32;
inline constexpr int kMinParityM = 1;
inline constexpr int kMaxParityM = 8;
// The largest group a StripeLayout is made for (plans use at most 2*(k+m)-1).
inline constexpr int kMaxGroupSize = 65536;

// OK when kMinDataK <= data_k <= kMaxDataK and kMinParityM <= parity_m <=
// kMaxParityM; InvalidArgument naming the bad one ("ec: data k is 0; it must
// be 1..32") otherwise.
absl::Status ValidateShape(int64_t data_k, int64_t parity_m);

// How a node's blob of `blob_bytes` is cut into the `data_k` data segments of
// EC: every segment but the last is SegmentBytes() = ceil(blob_bytes / data_k)
// bytes; trailing segments may be short or empty (a blob smaller than data_k
// bytes, or one of 0 bytes). data_k == 0 (no valid shape) yields empty
// segments. Never overflows, whatever the inputs.
struct BlobLayout {
  uint64_t blob_bytes = 0;
  uint32_t data_k = 1;

  // ceil(blob_bytes / data_k); 0 when data_k == 0.
  constexpr uint64_t SegmentBytes() const {
    return data_k == 0 ? 0 : blob_bytes / data_k + (blob_bytes % data_k != 0 ? 1 : 0);
  }
  // Where segment `index` starts in the blob; blob_bytes when it is empty
  // (index >= data_k, or past the end of a short blob).
  constexpr uint64_t SegmentStart(uint32_t index) const {
    if (index >= data_k) return blob_bytes;
    const uint64_t seg = SegmentBytes();
    // seg * index < seg * data_k < blob_bytes + data_k: no wrap.
    return seg * index < blob_bytes ? seg * index : blob_bytes;
  }
  // How many bytes segment `index` has: SegmentBytes() for all but the
  // trailing ones, fewer (maybe 0) at the end, 0 for index >= data_k.
  constexpr uint64_t SegmentLength(uint32_t index) const {
    const uint64_t start = SegmentStart(index);
    if (start >= blob_bytes) return 0;
    const uint64_t seg = SegmentBytes();
    return seg < blob_bytes - start ? seg : blob_bytes - start;
  }
};

// Data position d of a stripe: segment `segment` (0..k-1) of the blob of group
// member `member`.
struct DataSlot {
  int member = 0;
  int segment = 0;
  friend bool operator==(const DataSlot&, const DataSlot&) = default;
};

// One stripe of an EC group: k data segments and m parity segments, each on a
// different member. In ec::Codec's fragment numbering, data position d is
// fragment d and parity position p is fragment k+p.
struct EcStripe {
  // m entries: parity position p is held by member parity_members[p].
  std::vector<int> parity_members;
  // k entries in ascending member order.
  std::vector<DataSlot> data;
  friend bool operator==(const EcStripe&, const EcStripe&) = default;
};

// Where one segment sits: stripe `stripe`, position `position` (a data
// position 0..k-1 for SegmentOf, a parity position 0..m-1 for ParityOf).
struct StripeSlot {
  int stripe = 0;
  int position = 0;
  friend bool operator==(const StripeSlot&, const StripeSlot&) = default;
};

// The rotated-parity layout of one EC group of `group_size` members (see the
// file comment): group_size stripes; stripe s covers members s..s+k+m-1 (mod
// group_size), parity on the first m of them, data on the other k in member
// order. Member j's blob is cut into k segments (BlobLayout); its segment t
// goes into the t-th stripe (by stripe index) in which j is a data member.
// Agents use SegmentOf to know where to send each segment and ParityOf to know
// which parity they hold; restore uses stripes() to decode.
class StripeLayout {
 public:
  // InvalidArgument unless ValidateShape(k, m) holds and
  // k+m <= group_size <= kMaxGroupSize.
  static absl::StatusOr<StripeLayout> Create(int group_size, int data_k, int parity_m);

  int group_size() const { return group_size_; }
  int data_k() const { return k_; }
  int parity_m() const { return m_; }
  // group_size() stripes, by stripe index.
  const std::vector<EcStripe>& stripes() const { return stripes_; }
  // Where segment `segment` (0..k-1) of member `member`'s blob lives (a data
  // slot). Arguments must be in range (checked by assert).
  StripeSlot SegmentOf(int member, int segment) const;
  // The m parity slots member `member` holds, by ascending stripe.
  std::span<const StripeSlot> ParityOf(int member) const;

  friend bool operator==(const StripeLayout&, const StripeLayout&) = default;

 private:
  StripeLayout() = default;

  int group_size_ = 0;
  int k_ = 0;
  int m_ = 0;
  std::vector<EcStripe> stripes_;
  std::vector<StripeSlot> segment_of_;  // [member * k + segment]
  std::vector<StripeSlot> parity_of_;   // [member * m + i]
};

}  // namespace ckpt::ec
