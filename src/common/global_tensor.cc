#include "common/global_tensor.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/manifest.h"
#include "common/names.h"

namespace ckpt {
namespace {

// "", or decimal numbers separated by commas, each at most 2^64-1.
std::optional<std::vector<uint64_t>> ParseList(std::string_view text) {
  std::vector<uint64_t> out;
  if (text.empty()) return out;
  for (absl::string_view part : absl::StrSplit(absl::string_view(text.data(), text.size()), ',')) {
    if (part.empty() || part.size() > 20) return std::nullopt;
    uint64_t v = 0;
    for (char c : part) {
      if (c < '0' || c > '9') return std::nullopt;
      const uint64_t d = static_cast<uint64_t>(c - '0');
      if (v > (UINT64_MAX - d) / 10) return std::nullopt;
      v = v * 10 + d;
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace

std::map<std::string, std::string> GlobalAttributes(std::string_view item_name, std::string_view global_name,
                                                    std::span<const uint64_t> global_shape,
                                                    std::span<const uint64_t> offsets) {
  std::map<std::string, std::string> out;
  out[kGlobalShapeKey] = absl::StrJoin(global_shape, ",");
  out[kGlobalOffsetKey] = absl::StrJoin(offsets, ",");
  if (global_name != item_name) out[kGlobalNameKey] = std::string(global_name);  // NOLINT
  return out;
}

absl::StatusOr<std::optional<GlobalPlace>> ParseGlobalPlace(std::string_view item_name, int dtype,
                                                             std::span<const uint64_t> shape,
                                                             const std::map<std::string, std::string>& attributes) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("item ", QuoteForMessage(item_name), ": its global tensor attributes ", why));
  };
  auto shape_it = attributes.find(kGlobalShapeKey);
  auto offset_it = attributes.find(kGlobalOffsetKey);
  auto name_it = attributes.find(kGlobalNameKey);
  if (shape_it == attributes.end()) {
    if (offset_it != attributes.end() || name_it != attributes.end()) {
      return bad(absl::StrCat("name an offset or a global name but no ", kGlobalShapeKey));
    }
    return std::optional<GlobalPlace>();
  }
  GlobalPlace place;
  place.name = name_it == attributes.end() ? std::string(item_name) : name_it->second;
  if (absl::Status s = ValidateItemName(place.name); !s.ok()) {
    return bad(absl::StrCat("give a bad global name: ", s.message()));
  }
  std::optional<std::vector<uint64_t>> global_shape = ParseList(shape_it->second);
  if (!global_shape) {
    return bad(absl::StrCat("give ", kGlobalShapeKey, " \"", shape_it->second,
                            "\": not decimal numbers separated by commas"));
  }
  std::optional<std::vector<uint64_t>> offsets =
      offset_it == attributes.end() ? std::vector<uint64_t>(shape.size(), 0) : ParseList(offset_it->second);
  if (!offsets) {
    return bad(absl::StrCat("give ", kGlobalOffsetKey, " \"", offset_it->second,
                            "\": not decimal numbers separated by commas"));
  }
  if (global_shape->size() != shape.size() || offsets->size() != shape.size()) {
    return bad(absl::StrCat("have ", global_shape->size(), " and ", offsets->size(), " dimensions, the item ",
                            shape.size()));
  }
  if (DTypeElementSize(dtype) == 0) {
    return bad(absl::StrCat("are on an item of dtype ", DTypeName(dtype), ", which has no element size"));
  }
  // The global tensor itself must have a size (no product beyond 2^64 bytes).
  if (absl::StatusOr<uint64_t> len = ItemByteLength(dtype, *global_shape); !len.ok()) {
    return bad(absl::StrCat("give a global shape with no size: ", len.status().message()));
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    if ((*offsets)[d] > (*global_shape)[d] || shape[d] > (*global_shape)[d] - (*offsets)[d]) {
      return bad(absl::StrCat("put the slice outside the global tensor on dimension ", d, ": offset ",
                              (*offsets)[d], " + length ", shape[d], " > ", (*global_shape)[d]));
    }
  }
  place.shape = *std::move(global_shape);
  place.offsets = *std::move(offsets);
  return std::optional<GlobalPlace>(std::move(place));
}

uint64_t Box::Elements() const {
  uint64_t n = 1;
  for (uint64_t l : lengths) n *= l;
  return n;
}

std::optional<Box> Intersect(const Box& a, const Box& b) {
  Box out;
  const size_t dims = a.offsets.size();
  out.offsets.resize(dims);
  out.lengths.resize(dims);
  for (size_t d = 0; d < dims; ++d) {
    const uint64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const uint64_t hi = std::min(a.offsets[d] + a.lengths[d], b.offsets[d] + b.lengths[d]);
    if (hi <= lo) return std::nullopt;
    out.offsets[d] = lo;
    out.lengths[d] = hi - lo;
  }
  return out;
}

std::pair<uint64_t, uint64_t> ElementSpan(const Box& box, const Box& part) {
  uint64_t first = 0, last = 0;
  for (size_t d = 0; d < box.lengths.size(); ++d) {
    first = first * box.lengths[d] + (part.offsets[d] - box.offsets[d]);
    last = last * box.lengths[d] + (part.offsets[d] + part.lengths[d] - 1 - box.offsets[d]);
  }
  return {first, last + 1};
}

void CopyBox(std::span<const std::byte> src, const Box& src_box, std::span<std::byte> dst, const Box& dst_box,
             const Box& part, uint32_t element_bytes, uint64_t src_first) {
  const size_t dims = part.offsets.size();
  if (dims == 0) {
    std::memcpy(dst.data(), src.data(), element_bytes);
    return;
  }
  // The innermost dimensions the part covers whole in both boxes merge into
  // one run with the dimension before them.
  size_t first = dims - 1;  // runs span dimensions first..dims-1
  while (first > 0 && part.lengths[first] == src_box.lengths[first] &&
         part.lengths[first] == dst_box.lengths[first]) {
    --first;
  }
  uint64_t run = element_bytes;
  for (size_t d = first; d < dims; ++d) run *= part.lengths[d];
  // Row-major strides in elements.
  std::vector<uint64_t> src_stride(dims, 1), dst_stride(dims, 1);
  for (size_t d = dims - 1; d > 0; --d) {
    src_stride[d - 1] = src_stride[d] * src_box.lengths[d];
    dst_stride[d - 1] = dst_stride[d] * dst_box.lengths[d];
  }
  std::vector<uint64_t> index(first, 0);  // over dimensions 0..first-1 of part
  while (true) {
    uint64_t s = 0, t = 0;
    for (size_t d = 0; d < dims; ++d) {
      const uint64_t at = part.offsets[d] + (d < first ? index[d] : 0);
      s += (at - src_box.offsets[d]) * src_stride[d];
      t += (at - dst_box.offsets[d]) * dst_stride[d];
    }
    std::memcpy(dst.data() + t * element_bytes, src.data() + (s - src_first) * element_bytes, run);
    size_t d = first;
    while (d > 0) {
      --d;
      if (++index[d] < part.lengths[d]) break;
      index[d] = 0;
      if (d == 0) return;
    }
    if (first == 0) return;
  }
}

absl::StatusOr<std::vector<SliceUse>> PlanSlice(std::string_view name, std::span<const SlicePiece> pieces,
                                                const Box& want, const std::function<int(uint32_t)>& preference) {
  std::map<std::pair<std::vector<uint64_t>, std::vector<uint64_t>>, const SlicePiece*> best;
  for (const SlicePiece& p : pieces) {
    auto [it, added] = best.try_emplace({p.box.offsets, p.box.lengths}, &p);
    if (!added) {
      const SlicePiece* q = it->second;
      if (std::make_pair(preference(p.rank), p.rank) < std::make_pair(preference(q->rank), q->rank)) it->second = &p;
    }
  }
  std::vector<SliceUse> uses;
  std::vector<uint32_t> ranks;
  uint64_t covered = 0;
  for (const auto& [box, piece] : best) {
    std::optional<Box> part = Intersect(piece->box, want);
    if (!part) continue;
    for (size_t i = 0; i < uses.size(); ++i) {
      if (Intersect(uses[i].part, *part)) {
        return absl::InvalidArgumentError(absl::StrCat("global tensor ", QuoteForMessage(name), ": pieces of ranks ",
                                                       ranks[i], " and ", piece->rank,
                                                       " overlap without holding the same slice"));
      }
    }
    covered += part->Elements();
    uses.push_back(SliceUse{piece->id, *std::move(part)});
    ranks.push_back(piece->rank);
  }
  if (covered != want.Elements()) {
    return absl::DataLossError(absl::StrCat("global tensor ", QuoteForMessage(name), ": ", want.Elements() - covered,
                                            " of the ", want.Elements(),
                                            " elements asked for are in no rank's shard"));
  }
  return uses;
}

}  // namespace ckpt
