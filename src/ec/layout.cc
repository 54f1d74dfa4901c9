#include "ec/layout.h"

#include <algorithm>
#include <cassert>
#include <cstddef>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "ec/codec.h"

namespace ckpt::ec {

static_assert(kMaxDataK == Codec::kMaxData && kMaxParityM == Codec::kMaxParity,
              "the layout's shapes are the codec's");

absl::Status ValidateShape(int64_t data_k, int64_t parity_m) {
  if (data_k < kMinDataK || data_k > kMaxDataK) {
    return absl::InvalidArgumentError(
        absl::StrCat("ec: data k is ", data_k, "; it must be ", kMinDataK, "..", kMaxDataK));
  }
  if (parity_m < kMinParityM || parity_m > kMaxParityM) {
    return absl::InvalidArgumentError(
        absl::StrCat("ec: parity m is ", parity_m, "; it must be ", kMinParityM, "..", kMaxParityM));
  }
  return absl::OkStatus();
}

absl::StatusOr<StripeLayout> StripeLayout::Create(int group_size, int data_k, int parity_m) {
  CKPT_RETURN_IF_ERROR(ValidateShape(data_k, parity_m));
  const int w = data_k + parity_m;
  if (group_size < w || group_size > kMaxGroupSize) {
    return absl::InvalidArgumentError(absl::StrCat("ec group size is ", group_size, "; it must be ", w,
                                                   " (k+m)..", kMaxGroupSize));
  }
  StripeLayout layout;
  layout.group_size_ = group_size;
  layout.k_ = data_k;
  layout.m_ = parity_m;
  layout.stripes_.resize(group_size);
  layout.segment_of_.resize(static_cast<size_t>(group_size) * data_k);
  layout.parity_of_.resize(static_cast<size_t>(group_size) * parity_m);
  std::vector<int> next_segment(group_size, 0);
  std::vector<int> next_parity(group_size, 0);
  std::vector<int> data_members(data_k);
  for (int s = 0; s < group_size; ++s) {
    EcStripe& stripe = layout.stripes_[s];
    stripe.parity_members.reserve(parity_m);
    for (int p = 0; p < parity_m; ++p) {
      const int member = (s + p) % group_size;
      stripe.parity_members.push_back(member);
      layout.parity_of_[member * parity_m + next_parity[member]++] = StripeSlot{s, p};
    }
    for (int d = 0; d < data_k; ++d) data_members[d] = (s + parity_m + d) % group_size;
    std::sort(data_members.begin(), data_members.end());
    stripe.data.reserve(data_k);
    for (int d = 0; d < data_k; ++d) {
      const int member = data_members[d];
      const int segment = next_segment[member]++;
      stripe.data.push_back(DataSlot{member, segment});
      layout.segment_of_[member * data_k + segment] = StripeSlot{s, d};
    }
  }
  // Every member is a data member of exactly k windows and a parity member of
  // exactly m (each member lies in exactly k+m of the group_size windows).
  for (int j = 0; j < group_size; ++j) {
    assert(next_segment[j] == data_k && next_parity[j] == parity_m);
  }
  return layout;
}

StripeSlot StripeLayout::SegmentOf(int member, int segment) const {
  assert(member >= 0 && member < group_size_ && segment >= 0 && segment < k_);
  return segment_of_[static_cast<size_t>(member) * k_ + segment];
}

std::span<const StripeSlot> StripeLayout::ParityOf(int member) const {
  assert(member >= 0 && member < group_size_);
  return std::span<const StripeSlot>(parity_of_).subspan(static_cast<size_t>(member) * m_, m_);
}

}  // namespace ckpt::ec
