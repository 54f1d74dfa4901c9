#include "ec/codec.h"

#include <isa-l/erasure_code.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ckpt::ec {
namespace {

constexpr int kMaxFragments = Codec::kMaxData + Codec::kMaxParity;

// ISA-L takes int lengths: longer ranges go through in pieces.
constexpr size_t kMaxCall = size_t{1} << 30;

bool Overlaps(const uint8_t* a, size_t a_len, const uint8_t* b, size_t b_len) {
  if (a_len == 0 || b_len == 0) return false;
  return a < b + b_len && b < a + a_len;
}

// out[j][x] = sum_i coef[j][i] * in[i][x] for x < out_len[j], where in[i][x] is
// zero past in_len[i]. Splits the range at every length so that each ISA-L
// call sees only buffers that cover it; buffers never get copied or padded.
void ApplyMatrix(const uint8_t* coef, int nin, int nout, uint8_t* const* in,
                 const size_t* in_len, uint8_t* const* out, const size_t* out_len) {
  size_t bounds[2 * kMaxFragments + 1];
  int nb = 0;
  size_t end = 0;
  for (int j = 0; j < nout; ++j) end = std::max(end, out_len[j]);
  bounds[nb++] = 0;
  for (int i = 0; i < nin; ++i) bounds[nb++] = std::min(in_len[i], end);
  for (int j = 0; j < nout; ++j) bounds[nb++] = out_len[j];
  std::sort(bounds, bounds + nb);
  nb = static_cast<int>(std::unique(bounds, bounds + nb) - bounds);

  uint8_t sub[kMaxFragments * kMaxFragments];
  uint8_t tables[32 * Codec::kMaxData * kMaxFragments];
  uint8_t* src[kMaxFragments];
  uint8_t* dst[kMaxFragments];
  for (int r = 0; r + 1 < nb; ++r) {
    const size_t a = bounds[r], len = bounds[r + 1] - a;
    int ins[kMaxFragments], outs[kMaxFragments];
    int ni = 0, no = 0;
    for (int i = 0; i < nin; ++i)
      if (in_len[i] > a) ins[ni++] = i;
    for (int j = 0; j < nout; ++j)
      if (out_len[j] > a) outs[no++] = j;
    if (no == 0) continue;
    if (ni == 0) {
      for (int j = 0; j < no; ++j) std::memset(out[outs[j]] + a, 0, len);
      continue;
    }
    for (int j = 0; j < no; ++j) {
      for (int i = 0; i < ni; ++i) sub[j * ni + i] = coef[outs[j] * nin + ins[i]];
      dst[j] = out[outs[j]] + a;
    }
    for (int i = 0; i < ni; ++i) src[i] = in[ins[i]] + a;
    ec_init_tables(ni, no, sub, tables);
    for (size_t off = 0; off < len; off += kMaxCall) {
      const size_t piece = std::min(kMaxCall, len - off);
      uint8_t* s[kMaxFragments];
      uint8_t* d[kMaxFragments];
      for (int i = 0; i < ni; ++i) s[i] = src[i] + off;
      for (int j = 0; j < no; ++j) d[j] = dst[j] + off;
      ec_encode_data(static_cast<int>(piece), ni, no, tables, s, d);
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Codec>> Codec::Create(int k, int m, size_t decode_cache_entries) {
  if (k < 1 || k > kMaxData) {
    return absl::InvalidArgumentError(
        absl::StrCat("erasure code: data fragment count k=", k, " is out of range 1..", kMaxData));
  }
  if (m < 1 || m > kMaxParity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "erasure code: parity fragment count m=", m, " is out of range 1..", kMaxParity));
  }
  return std::unique_ptr<Codec>(new Codec(k, m, std::max<size_t>(1, decode_cache_entries)));
}

Codec::Codec(int k, int m, size_t cache_entries)
    : k_(k), m_(m), cache_entries_(cache_entries), generator_((k + m) * k),
      encode_tables_(32 * k * m) {
  gf_gen_cauchy1_matrix(generator_.data(), k + m, k);
  ec_init_tables(k, m, generator_.data() + k * k, encode_tables_.data());
}

absl::Status Codec::CheckParity(std::span<const MutableBuffer> parity, size_t* stripe_size) const {
  if (static_cast<int>(parity.size()) != m_) {
    return absl::InvalidArgumentError(
        absl::StrCat("erasure code: got ", parity.size(), " parity buffers, RS(", k_, ",", m_,
                     ") needs ", m_));
  }
  const size_t len = parity[0].size();
  for (int j = 0; j < m_; ++j) {
    if (parity[j].size() != len) {
      return absl::InvalidArgumentError(
          absl::StrCat("erasure code: parity buffers differ in length (parity 0 has ", len,
                       " bytes, parity ", j, " has ", parity[j].size(), ")"));
    }
    if (len > 0 && parity[j].data() == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("erasure code: parity ", j, " is null"));
    }
    for (int i = 0; i < j; ++i) {
      if (Overlaps(parity[i].data(), len, parity[j].data(), len)) {
        return absl::InvalidArgumentError(
            absl::StrCat("erasure code: parity ", i, " and parity ", j, " overlap"));
      }
    }
  }
  *stripe_size = len;
  return absl::OkStatus();
}

absl::Status Codec::Encode(std::span<const ConstBuffer> data,
                           std::span<const MutableBuffer> parity) const {
  if (static_cast<int>(data.size()) != k_) {
    return absl::InvalidArgumentError(absl::StrCat("erasure code: got ", data.size(),
                                                   " data buffers, RS(", k_, ",", m_, ") needs ", k_));
  }
  size_t stripe = 0;
  if (absl::Status s = CheckParity(parity, &stripe); !s.ok()) return s;
  bool equal = true;
  for (int i = 0; i < k_; ++i) {
    if (data[i].size() > stripe) {
      return absl::InvalidArgumentError(
          absl::StrCat("erasure code: data ", i, " has ", data[i].size(),
                       " bytes, more than the parity length ", stripe));
    }
    if (data[i].size() > 0 && data[i].data() == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("erasure code: data ", i, " is null"));
    }
    for (int j = 0; j < m_; ++j) {
      if (Overlaps(data[i].data(), data[i].size(), parity[j].data(), stripe)) {
        return absl::InvalidArgumentError(
            absl::StrCat("erasure code: data ", i, " overlaps parity ", j));
      }
    }
    equal = equal && data[i].size() == stripe;
  }
  if (stripe == 0) return absl::OkStatus();

  uint8_t* src[kMaxData];
  uint8_t* dst[kMaxParity];
  for (int i = 0; i < k_; ++i) src[i] = const_cast<uint8_t*>(data[i].data());
  for (int j = 0; j < m_; ++j) dst[j] = parity[j].data();
  if (equal) {
    // Common case: one pass with the precomputed tables.
    for (size_t off = 0; off < stripe; off += kMaxCall) {
      const size_t n = std::min(kMaxCall, stripe - off);
      uint8_t* s[kMaxData];
      uint8_t* d[kMaxParity];
      for (int i = 0; i < k_; ++i) s[i] = src[i] + off;
      for (int j = 0; j < m_; ++j) d[j] = dst[j] + off;
      ec_encode_data(static_cast<int>(n), k_, m_, const_cast<uint8_t*>(encode_tables_.data()), s, d);
    }
    return absl::OkStatus();
  }
  size_t in_len[kMaxData], out_len[kMaxParity];
  for (int i = 0; i < k_; ++i) in_len[i] = data[i].size();
  for (int j = 0; j < m_; ++j) out_len[j] = stripe;
  ApplyMatrix(generator_.data() + k_ * k_, k_, m_, src, in_len, dst, out_len);
  return absl::OkStatus();
}

absl::Status Codec::EncodeUpdate(int data_index, ConstBuffer data,
                                 std::span<const MutableBuffer> parity) const {
  if (data_index < 0 || data_index >= k_) {
    return absl::InvalidArgumentError(absl::StrCat("erasure code: data index ", data_index,
                                                   " is out of range 0..", k_ - 1));
  }
  size_t stripe = 0;
  if (absl::Status s = CheckParity(parity, &stripe); !s.ok()) return s;
  if (data.size() > stripe) {
    return absl::InvalidArgumentError(absl::StrCat("erasure code: data ", data_index, " has ",
                                                   data.size(), " bytes, more than the parity length ",
                                                   stripe));
  }
  if (data.size() > 0 && data.data() == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("erasure code: data ", data_index, " is null"));
  }
  for (int j = 0; j < m_; ++j) {
    if (Overlaps(data.data(), data.size(), parity[j].data(), stripe)) {
      return absl::InvalidArgumentError(
          absl::StrCat("erasure code: data ", data_index, " overlaps parity ", j));
    }
  }
  uint8_t* dst[kMaxParity];
  for (size_t off = 0; off < data.size(); off += kMaxCall) {
    const size_t n = std::min(kMaxCall, data.size() - off);
    for (int j = 0; j < m_; ++j) dst[j] = parity[j].data() + off;
    ec_encode_data_update(static_cast<int>(n), k_, m_, data_index,
                          const_cast<uint8_t*>(encode_tables_.data()),
                          const_cast<uint8_t*>(data.data()) + off, dst);
  }
  return absl::OkStatus();
}

absl::Status Codec::EncodeUpdateRow(int data_index, int parity_index, ConstBuffer data,
                                    MutableBuffer parity_row) const {
  if (data_index < 0 || data_index >= k_ || parity_index < 0 || parity_index >= m_) {
    return absl::InvalidArgumentError(absl::StrCat("erasure code: data index ", data_index,
                                                   " or parity index ", parity_index,
                                                   " is out of range"));
  }
  if (data.size() > parity_row.size()) {
    return absl::InvalidArgumentError(absl::StrCat("erasure code: ", data.size(),
                                                   " data bytes, more than the parity's ",
                                                   parity_row.size()));
  }
  if ((data.size() > 0 && (data.data() == nullptr || parity_row.data() == nullptr)) ||
      Overlaps(data.data(), data.size(), parity_row.data(), parity_row.size())) {
    return absl::InvalidArgumentError("erasure code: null or overlapping buffers");
  }
  const uint8_t* tables = encode_tables_.data() + static_cast<size_t>(32) * k_ * parity_index;
  for (size_t off = 0; off < data.size(); off += kMaxCall) {
    const size_t n = std::min(kMaxCall, data.size() - off);
    uint8_t* dst = parity_row.data() + off;
    ec_encode_data_update(static_cast<int>(n), k_, 1, data_index, const_cast<uint8_t*>(tables),
                          const_cast<uint8_t*>(data.data()) + off, &dst);
  }
  return absl::OkStatus();
}

absl::Status Codec::ReplaceUpdate(int data_index, ConstBuffer old_data, ConstBuffer new_data,
                                  std::span<const MutableBuffer> parity) const {
  // Validate both before touching the parity, so a bad call changes nothing.
  size_t stripe = 0;
  if (absl::Status s = CheckParity(parity, &stripe); !s.ok()) return s;
  if (old_data.size() > stripe || new_data.size() > stripe) {
    return absl::InvalidArgumentError(absl::StrCat(
        "erasure code: replacing data ", data_index, ": old (", old_data.size(), " bytes) and new (",
        new_data.size(), " bytes) must both fit the parity length ", stripe));
  }
  if (absl::Status s = EncodeUpdate(data_index, ConstBuffer(), parity); !s.ok()) return s;
  for (const ConstBuffer& b : {old_data, new_data}) {
    if (b.size() > 0 && b.data() == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("erasure code: data ", data_index, " is null"));
    }
    for (int j = 0; j < m_; ++j) {
      if (Overlaps(b.data(), b.size(), parity[j].data(), stripe)) {
        return absl::InvalidArgumentError(
            absl::StrCat("erasure code: data ", data_index, " overlaps parity ", j));
      }
    }
  }
  // XOR is its own inverse: removing old and adding new are the same fold.
  if (absl::Status s = EncodeUpdate(data_index, old_data, parity); !s.ok()) return s;
  return EncodeUpdate(data_index, new_data, parity);
}

void Codec::ZeroParity(std::span<const MutableBuffer> parity) {
  for (const MutableBuffer& p : parity) {
    if (!p.empty()) std::memset(p.data(), 0, p.size());
  }
}

absl::StatusOr<std::shared_ptr<const Codec::DecodePlan>> Codec::GetDecodePlan(
    const std::vector<int>& survivors, const std::vector<int>& missing) const {
  PatternKey key{0, 0};
  for (int s : survivors) key.first |= uint64_t{1} << s;
  for (int x : missing) key.second |= uint64_t{1} << x;
  {
    absl::MutexLock lock(&cache_mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.lru_pos);
      return it->second.plan;
    }
  }

  // Invert the rows of the generator that belong to the survivors.
  const int k = k_;
  std::vector<uint8_t> b(k * k), inv(k * k);
  for (int r = 0; r < k; ++r) {
    std::memcpy(&b[r * k], &generator_[survivors[r] * k], k);
  }
  if (gf_invert_matrix(b.data(), inv.data(), k) != 0) {
    // Cannot happen for a Cauchy matrix; report rather than decode garbage.
    return absl::InternalError(absl::StrCat("erasure code: survivor matrix for fragments {",
                                            absl::StrJoin(survivors, ","), "} is singular"));
  }
  auto plan = std::make_shared<DecodePlan>();
  const int nmiss = static_cast<int>(missing.size());
  plan->matrix.resize(nmiss * k);
  for (int r = 0; r < nmiss; ++r) {
    uint8_t* row = &plan->matrix[r * k];
    const int idx = missing[r];
    if (idx < k) {
      std::memcpy(row, &inv[idx * k], k);  // data: its row of the inverse
    } else {
      // parity: its generator row applied to the recovered data
      for (int c = 0; c < k; ++c) {
        uint8_t acc = 0;
        for (int j = 0; j < k; ++j) acc ^= gf_mul(generator_[idx * k + j], inv[j * k + c]);
        row[c] = acc;
      }
    }
  }
  plan->tables.resize(32 * k * nmiss);
  ec_init_tables(k, nmiss, plan->matrix.data(), plan->tables.data());

  absl::MutexLock lock(&cache_mu_);
  auto [it, inserted] = cache_.try_emplace(key);
  if (inserted) {
    lru_.push_front(key);
    it->second = CacheEntry{std::move(plan), lru_.begin()};
    while (cache_.size() > cache_entries_) {
      cache_.erase(lru_.back());
      lru_.pop_back();
    }
  }
  return it->second.plan;
}

absl::Status Codec::Decode(std::span<const Fragment> fragments, size_t stripe_size) const {
  const int n = k_ + m_;
  if (static_cast<int>(fragments.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("erasure code: got ", fragments.size(),
                                                   " fragments, RS(", k_, ",", m_, ") has ", n));
  }
  std::vector<int> present, missing;
  for (int i = 0; i < n; ++i) {
    const Fragment& f = fragments[i];
    const char* kind = i < k_ ? "data" : "parity";
    const int num = i < k_ ? i : i - k_;
    if (f.size > 0 && f.data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("erasure code: ", kind, " ", num, " is null"));
    }
    if (f.size > stripe_size) {
      return absl::InvalidArgumentError(absl::StrCat("erasure code: ", kind, " ", num, " has ",
                                                     f.size, " bytes, more than the stripe length ",
                                                     stripe_size));
    }
    if (f.present && i >= k_ && f.size != stripe_size) {
      return absl::InvalidArgumentError(absl::StrCat("erasure code: parity ", num, " has ", f.size,
                                                     " bytes, must equal the stripe length ",
                                                     stripe_size));
    }
    (f.present ? present : missing).push_back(i);
  }
  if (missing.empty()) return absl::OkStatus();
  if (static_cast<int>(present.size()) < k_) {
    return absl::DataLossError(absl::StrCat(
        "erasure code: ", missing.size(), " of ", n, " fragments lost (indices ",
        absl::StrJoin(missing, ","), "; 0..", k_ - 1, " data, ", k_, "..", n - 1,
        " parity), but RS(", k_, ",", m_, ") rebuilds at most ", m_));
  }
  for (int x : missing) {
    for (int i = 0; i < n; ++i) {
      if (i == x) continue;
      const Fragment& a = fragments[x];
      const Fragment& b = fragments[i];
      if (Overlaps(a.data, a.size, b.data, b.size)) {
        return absl::InvalidArgumentError(
            absl::StrCat("erasure code: output fragment ", x, " overlaps fragment ", i));
      }
    }
  }
  std::vector<int> survivors(present.begin(), present.begin() + k_);
  auto plan_or = GetDecodePlan(survivors, missing);
  if (!plan_or.ok()) return plan_or.status();
  const DecodePlan& plan = **plan_or;

  const int nmiss = static_cast<int>(missing.size());
  uint8_t* src[kMaxData];
  uint8_t* dst[kMaxFragments];
  size_t in_len[kMaxData], out_len[kMaxFragments];
  bool equal = true;
  for (int i = 0; i < k_; ++i) {
    src[i] = fragments[survivors[i]].data;
    in_len[i] = fragments[survivors[i]].size;
    equal = equal && in_len[i] == stripe_size;
  }
  for (int j = 0; j < nmiss; ++j) {
    dst[j] = fragments[missing[j]].data;
    out_len[j] = fragments[missing[j]].size;
    equal = equal && out_len[j] == stripe_size;
  }
  if (equal) {
    for (size_t off = 0; off < stripe_size; off += kMaxCall) {
      const size_t len = std::min(kMaxCall, stripe_size - off);
      uint8_t* s[kMaxData];
      uint8_t* d[kMaxFragments];
      for (int i = 0; i < k_; ++i) s[i] = src[i] + off;
      for (int j = 0; j < nmiss; ++j) d[j] = dst[j] + off;
      ec_encode_data(static_cast<int>(len), k_, nmiss, const_cast<uint8_t*>(plan.tables.data()), s,
                     d);
    }
    return absl::OkStatus();
  }
  ApplyMatrix(plan.matrix.data(), k_, nmiss, src, in_len, dst, out_len);
  return absl::OkStatus();
}

size_t Codec::cached_decode_patterns() const {
  absl::MutexLock lock(&cache_mu_);
  return cache_.size();
}

}  // namespace ckpt::ec
