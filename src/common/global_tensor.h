// Global tensors: where an item sits in a tensor of the whole model.
//
// A rank's item may be a slice of a global tensor (tensor-parallel rows or
// columns, a ZeRO partition, a replica of a data-parallel parameter): three
// attributes say which (docs/format.md "Global tensors"):
//
//   ckpt.global_shape   the global tensor's shape, decimal, comma-separated
//                       ("4096,1024"; "" for a scalar)
//   ckpt.global_offset  where the item starts on each dimension ("2048,0")
//   ckpt.global_name    the global tensor's name, when it is not the item's
//                       own (optional)
//
// The item's own shape gives the slice's lengths: offset + shape lies inside
// the global shape on every dimension. A replicated tensor saved whole by
// several ranks is one global tensor whose pieces all cover it. Items
// without ckpt.global_shape belong to no global tensor (a rank's own state).
// Only elements of a fixed size (not DTYPE_BYTES) can be sliced.
//
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <utility>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt {

inline constexpr char kGlobalShapeKey[] = "ckpt.global_shape";
inline constexpr char kGlobalOffsetKey[] = "ckpt.global_offset";
inline constexpr char kGlobalNameKey[] = "ckpt.global_name";

// An item's place in its global tensor.
struct GlobalPlace {
  std::string name;                // the global tensor's
  std::vector<uint64_t> shape;     // the global tensor's
  std::vector<uint64_t> offsets;   // of the item's slice, one per dimension
};

// The attributes that say an item of `item_name` is at `offsets` of global
// tensor `global_name` of `global_shape` (ckpt.global_name only when the
// names differ). Merge them into the item's own attributes. (Declared for
// trainers in ckpt/types.h too.)
std::map<std::string, std::string> GlobalAttributes(std::string_view item_name, std::string_view global_name,
                                                    std::span<const uint64_t> global_shape,
                                                    std::span<const uint64_t> offsets);

// The place the attributes of an item (`item_name`, `dtype`, `shape`) give,
// nullopt if it has no ckpt.global_shape. InvalidArgument naming the item if
// they are malformed (not decimal lists, a global name without a shape, a
// count of dimensions other than the item's, a slice outside the global
// shape, a dtype without a fixed element size).
absl::StatusOr<std::optional<GlobalPlace>> ParseGlobalPlace(std::string_view item_name, int dtype,
                                                             std::span<const uint64_t> shape,
                                                             const std::map<std::string, std::string>& attributes);

// An n-dimensional box: offsets and lengths per dimension.
struct Box {
  std::vector<uint64_t> offsets;
  std::vector<uint64_t> lengths;
  uint64_t Elements() const;  // product of lengths (1 for a scalar)
};

// The intersection of two boxes of the same rank (dimension count); nullopt
// if it is empty.
std::optional<Box> Intersect(const Box& a, const Box& b);

// Copies the elements of `part` (a box inside both `src_box` and `dst_box`)
// from `src`, laid out row-major as `src_box`, into `dst`, laid out row-major
// as `dst_box`, `element_bytes` per element: contiguous runs of the last
// dimension are copied at once. The caller guarantees the sizes
// (src.size() == src_box.Elements() x element_bytes, the same for dst).
// `src_first`: src holds src_box's elements from row-major index src_first
// on (the part of an item read alone), and the part's elements lie there.
void CopyBox(std::span<const std::byte> src, const Box& src_box, std::span<std::byte> dst, const Box& dst_box,
             const Box& part, uint32_t element_bytes, uint64_t src_first = 0);

// The row-major element indexes, within `box`, of the first and one past the
// last element of `part` (a non-empty box inside it): every element of the
// part lies in [first, end).
std::pair<uint64_t, uint64_t> ElementSpan(const Box& box, const Box& part);

// One stored piece of a global tensor, for PlanSlice: the rank whose shard
// holds it, the slice it holds, and the caller's number for it.
struct SlicePiece {
  uint32_t rank = 0;
  Box box;
  size_t id = 0;
};
// A piece chosen to fill part of a slice: its id and the overlap, in global
// coordinates.
struct SliceUse {
  size_t id = 0;
  Box part;
};

// The pieces of global tensor `name` that fill `want`: of each set of
// replicas (equal boxes) the one with the lowest (preference(rank), rank).
// DataLoss if they leave part of `want` uncovered; InvalidArgument if two
// pieces overlap without being equal (a layout no save makes). `want` and
// every box have the tensor's dimension count.
absl::StatusOr<std::vector<SliceUse>> PlanSlice(std::string_view name, std::span<const SlicePiece> pieces,
                                                const Box& want, const std::function<int(uint32_t)>& preference);

}  // namespace ckpt
