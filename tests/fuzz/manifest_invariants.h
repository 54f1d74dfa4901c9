// The invariants every manifest ValidateManifest accepts must hold
// (docs/format.md, docs/security.md "Manifests"), checked here on their own,
// in 128-bit arithmetic that cannot wrap, so that a fuzz target catches a
// validator that lets a wrapped size through (issue 34 finding 5):
//   - each item's length is its dtype's element size x the product of its
//     shape, exactly (DTYPE_BYTES: any length);
//   - each of the shard's own items lies inside the shard;
//   - no two non-empty own items overlap.
// Aborts (a libFuzzer crash, the input kept) when one does not hold.
// Header-only, for the fuzz targets alone.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

#include "common/manifest.h"

namespace ckpt::fuzz {

[[noreturn]] inline void Broken(const char* rule, const ManifestItem& item) {
  std::fprintf(stderr, "manifest invariant broken: %s (item \"%s\", dtype %d, %zu dims, offset %llu, length %llu)\n",
               rule, item.name.c_str(), item.dtype, item.shape.size(),
               static_cast<unsigned long long>(item.offset_bytes), static_cast<unsigned long long>(item.length_bytes));
  std::abort();
}

// Element size x product of `shape`, or nothing if it exceeds 2^64 - 1. No
// step wraps: each starts at most 2^64 - 1 and multiplies by less than 2^64.
inline bool ExactBytes(uint32_t elem, std::span<const uint64_t> shape, uint64_t* out) {
  using U128 = unsigned __int128;
  if (std::find(shape.begin(), shape.end(), uint64_t{0}) != shape.end()) {
    *out = 0;
    return true;
  }
  U128 bytes = elem;
  for (uint64_t d : shape) {
    bytes *= d;
    if (bytes > UINT64_MAX) return false;
  }
  *out = static_cast<uint64_t>(bytes);
  return true;
}

inline void AssertManifestInvariants(std::span<const ManifestItem> items, uint64_t shard_size_bytes) {
  using U128 = unsigned __int128;
  std::vector<const ManifestItem*> own;
  for (const ManifestItem& item : items) {
    if (item.dtype < 1 || item.dtype > kMaxDType) Broken("unknown dtype", item);
    if (item.dtype != kDTypeBytes) {
      const uint32_t elem = DTypeElementSize(item.dtype);
      uint64_t need = 0;
      if (elem == 0) Broken("fixed-size dtype without an element size", item);
      if (!ExactBytes(elem, item.shape, &need)) Broken("shape x dtype exceeds 2^64 bytes", item);
      if (need != item.length_bytes) Broken("length != shape x dtype", item);
      // The validator's own helper agrees.
      absl::StatusOr<uint64_t> helper = ItemByteLength(item.dtype, item.shape);
      if (!helper.ok() || *helper != need) Broken("ItemByteLength disagrees", item);
    }
    if (item.ref_step) continue;  // its bytes are in another shard
    if (static_cast<U128>(item.offset_bytes) + item.length_bytes > shard_size_bytes) {
      Broken("item outside the shard", item);
    }
    if (item.length_bytes > 0) own.push_back(&item);
  }
  std::sort(own.begin(), own.end(),
            [](const ManifestItem* a, const ManifestItem* b) { return a->offset_bytes < b->offset_bytes; });
  for (size_t i = 1; i < own.size(); ++i) {
    if (static_cast<U128>(own[i - 1]->offset_bytes) + own[i - 1]->length_bytes > own[i]->offset_bytes) {
      Broken("items overlap", *own[i]);
    }
  }
}

}  // namespace ckpt::fuzz
