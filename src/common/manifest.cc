#include "common/manifest.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "common/endian.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt {
namespace {

struct DTypeInfo {
  const char* name;
  uint32_t size;
};

// Indexed by ckpt.v1.DType number.
constexpr DTypeInfo kDTypes[] = {
    {"unknown", 0}, {"f32", 4},  {"f16", 2},  {"bf16", 2}, {"f64", 8},   {"i8", 1},
    {"i16", 2},     {"i32", 4},  {"i64", 8},  {"u8", 1},   {"u16", 2},   {"u32", 4},
    {"u64", 8},     {"bool", 1}, {"bytes", 0}, {"c64", 8}, {"c128", 16}, {"f8_e4m3fn", 1},
    {"f8_e5m2", 1},
};
static_assert(sizeof(kDTypes) / sizeof(kDTypes[0]) == kMaxDType + 1);

constexpr std::string_view kManifestTag = "ckpt-manifest-v1";
// With references (docs/protocol.md "Manifest digest"): the v1 body, then
// u32 ref_count and per reference u64 ref_step + the item as in v1.
constexpr std::string_view kManifestTagV2 = "ckpt-manifest-v2";
static_assert(kManifestTag.size() == kManifestTagV2.size());
constexpr size_t kCountAt = 16;  // where the u32 item count sits

// Reads the encoding front to back; any read past the end makes it not ok()
// and returns zeros (the caller checks ok() at points where it matters).
using Reader = LeReader;

bool SortedByOffsetAlready(std::span<const ManifestItem> items) {
  for (size_t i = 1; i < items.size(); ++i) {
    if (CanonicalItemLess(items[i], items[i - 1])) return false;
  }
  return true;
}

// Pointers to `items` in canonical order (stable).
std::vector<const ManifestItem*> OffsetOrder(std::span<const ManifestItem> items) {
  std::vector<const ManifestItem*> order;
  order.reserve(items.size());
  for (const ManifestItem& it : items) order.push_back(&it);
  if (!SortedByOffsetAlready(items)) {
    std::stable_sort(order.begin(), order.end(),
                     [](const ManifestItem* a, const ManifestItem* b) { return CanonicalItemLess(*a, *b); });
  }
  return order;
}

// Appends one item in the v1 item encoding (one resize, then fixed-width
// stores: a shard may have tens of thousands of items).
void AppendItem(std::string& out, std::optional<uint64_t> ref_step, std::string_view name, int dtype,
                std::span<const uint64_t> shape, uint64_t offset_bytes, uint64_t length_bytes, uint32_t crc32c,
                const std::map<std::string, std::string>& attributes) {
  size_t n = (ref_step ? 8 : 0) + 4 + name.size() + 4 + 4 + 8 * shape.size() + 8 + 8 + 4 + 4;
  for (const auto& [k, v] : attributes) n += 8 + k.size() + v.size();
  const size_t at = out.size();
  out.resize(at + n);
  char* p = out.data() + at;
  const auto u32 = [&p](uint32_t v) {
    StoreLe32(p, v);
    p += 4;
  };
  const auto u64 = [&p](uint64_t v) {
    StoreLe64(p, v);
    p += 8;
  };
  const auto str = [&](std::string_view s) {
    u32(static_cast<uint32_t>(s.size()));
    if (!s.empty()) std::memcpy(p, s.data(), s.size());
    p += s.size();
  };
  if (ref_step) u64(*ref_step);
  str(name);
  u32(static_cast<uint32_t>(dtype));
  u32(static_cast<uint32_t>(shape.size()));
  for (uint64_t d : shape) u64(d);
  u64(offset_bytes);
  u64(length_bytes);
  u32(crc32c);
  u32(static_cast<uint32_t>(attributes.size()));
  for (const auto& [k, v] : attributes) {  // std::map: bytewise key order
    str(k);
    str(v);
  }
}

}  // namespace

bool CanonicalItemLess(const ManifestItem& a, const ManifestItem& b) {
  if (a.ref_step.has_value() != b.ref_step.has_value()) return !a.ref_step.has_value();
  if (a.ref_step && *a.ref_step != *b.ref_step) return *a.ref_step < *b.ref_step;
  return a.offset_bytes < b.offset_bytes;
}

std::vector<uint64_t> RefSteps(std::span<const ManifestItem> items) {
  std::vector<uint64_t> steps;
  for (const ManifestItem& it : items) {
    if (it.ref_step && (steps.empty() || steps.back() != *it.ref_step)) steps.push_back(*it.ref_step);
  }
  std::sort(steps.begin(), steps.end());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  return steps;
}

uint32_t DTypeElementSize(int dtype) {
  if (dtype < 0 || dtype > kMaxDType) return 0;
  return kDTypes[dtype].size;
}

const char* DTypeName(int dtype) {
  if (dtype < 1 || dtype > kMaxDType) return "unknown";
  return kDTypes[dtype].name;
}

absl::StatusOr<int> DTypeFromName(const std::string& name) {
  for (int d = 1; d <= kMaxDType; ++d) {
    if (name == kDTypes[d].name) return d;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype \"", name, "\""));
}

namespace {

// "[d0, d1, ...]", at most 8 dimensions (a packed manifest may carry
// thousands): the rest as "... (N dims)".
std::string ShapeString(std::span<const uint64_t> shape) {
  constexpr size_t kShown = 8;
  std::string out = "[";
  for (size_t i = 0; i < shape.size() && i < kShown; ++i) absl::StrAppend(&out, i ? ", " : "", shape[i]);
  if (shape.size() > kShown) absl::StrAppend(&out, ", ... (", shape.size(), " dims)");
  out += "]";
  return out;
}

}  // namespace

absl::StatusOr<uint64_t> ItemByteLength(int dtype, std::span<const uint64_t> shape) {
  const uint32_t elem = DTypeElementSize(dtype);
  if (elem == 0) {
    return absl::InvalidArgumentError(absl::StrCat("dtype ", DTypeName(dtype), " (", dtype,
                                                   ") has no fixed element size"));
  }
  // Exact: a zero dimension makes the product 0 even when the others
  // overflow on their own.
  if (std::find(shape.begin(), shape.end(), uint64_t{0}) != shape.end()) return uint64_t{0};
  uint64_t bytes = elem;
  for (uint64_t d : shape) {
    if (__builtin_mul_overflow(bytes, d, &bytes)) {
      return absl::InvalidArgumentError(absl::StrCat("dtype ", DTypeName(dtype), " with shape ",
                                                     ShapeString(shape), " needs more than 2^64 bytes"));
    }
  }
  return bytes;
}

absl::Status CheckItemLength(std::string_view name, int dtype, std::span<const uint64_t> shape,
                             uint64_t length_bytes) {
  if (dtype < 1 || dtype > kMaxDType) {
    return absl::InvalidArgumentError(absl::StrCat("item ", QuoteForMessage(name), " has unknown dtype ", dtype));
  }
  if (dtype == kDTypeBytes) return absl::OkStatus();  // opaque: its length is free
  absl::StatusOr<uint64_t> need = ItemByteLength(dtype, shape);
  if (need.ok() && *need == length_bytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "item ", QuoteForMessage(name), " is ", length_bytes, " bytes but dtype ", DTypeName(dtype),
      " with shape ", ShapeString(shape), " needs ", need.ok() ? absl::StrCat(*need) : "more than 2^64",
      " bytes"));
}

absl::Status CheckItemInShard(std::string_view name, uint64_t offset_bytes, uint64_t length_bytes,
                              uint64_t shard_size_bytes) {
  if (offset_bytes <= shard_size_bytes && length_bytes <= shard_size_bytes - offset_bytes) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("item ", QuoteForMessage(name), " [", offset_bytes, ", +",
                                                 length_bytes, ") lies outside the shard of ", shard_size_bytes,
                                                 " bytes"));
}

std::vector<ManifestItem> SortedByOffset(std::span<const ManifestItem> items) {
  std::vector<ManifestItem> sorted(items.begin(), items.end());
  if (SortedByOffsetAlready(items)) return sorted;  // the usual case: a client's layout
  std::stable_sort(sorted.begin(), sorted.end(), CanonicalItemLess);
  return sorted;
}

void SortByOffset(std::vector<ManifestItem>& items) {
  if (SortedByOffsetAlready(items)) return;
  std::stable_sort(items.begin(), items.end(), CanonicalItemLess);
}

absl::Status ValidateManifest(std::span<const ManifestItem> items, uint64_t shard_size_bytes,
                              std::optional<uint64_t> step) {
  std::vector<ItemView> views;
  views.reserve(items.size());
  for (const ManifestItem& it : items) {
    views.push_back(ItemView{it.name, it.dtype, it.shape, it.offset_bytes, it.length_bytes, it.ref_step});
  }
  return ValidateItems(views, shard_size_bytes, step);
}

absl::Status ValidateItems(std::span<const ItemView> items, uint64_t shard_size_bytes,
                           std::optional<uint64_t> step) {
  absl::flat_hash_set<std::string_view> names;
  names.reserve(items.size());
  bool in_offset_order = true;  // the shard's own items, as a client lays them out
  const ItemView* prev_own = nullptr;
  for (const ItemView& item : items) {
    if (absl::Status s = ValidateItemName(item.name); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("manifest: ", s.message()));
    }
    if (!names.insert(item.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest: item ", QuoteForMessage(item.name), " appears twice"));
    }
    if (item.dtype < 1 || item.dtype > kMaxDType) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest: item ", QuoteForMessage(item.name), " has unknown dtype ", item.dtype));
    }
    if (item.ref_step) {
      if (step && *item.ref_step >= *step) {
        return absl::InvalidArgumentError(absl::StrCat("manifest: item ", QuoteForMessage(item.name),
                                                       " refers to version ", *item.ref_step,
                                                       ", which is not older than this one (", *step, ")"));
      }
    } else {
      if (absl::Status s = CheckItemInShard(item.name, item.offset_bytes, item.length_bytes, shard_size_bytes);
          !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("manifest: ", s.message()));
      }
      if (prev_own != nullptr && item.offset_bytes < prev_own->offset_bytes) in_offset_order = false;
      prev_own = &item;
    }
    if (absl::Status s = CheckItemLength(item.name, item.dtype, item.shape, item.length_bytes); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("manifest: ", s.message()));
    }
  }
  // In offset order every non-empty item must start at or after the end of
  // the previous non-empty one (empty items may sit anywhere, even inside
  // another item, and must not hide an overlap of their neighbours). The
  // end of `last` cannot wrap: it passed CheckItemInShard above. References
  // have no bytes here.
  const ItemView* last = nullptr;  // the previous non-empty item
  auto check = [&last](const ItemView* cur) -> absl::Status {
    if (cur->length_bytes == 0 || cur->ref_step) return absl::OkStatus();
    if (last != nullptr && cur->offset_bytes < last->offset_bytes + last->length_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "manifest: items ", QuoteForMessage(last->name), " [", last->offset_bytes, ", +",
          last->length_bytes, ") and ", QuoteForMessage(cur->name), " [", cur->offset_bytes, ", +",
          cur->length_bytes, ") overlap"));
    }
    last = cur;
    return absl::OkStatus();
  };
  if (in_offset_order) {  // the usual case: no index to build
    for (const ItemView& cur : items) CKPT_RETURN_IF_ERROR(check(&cur));
  } else {
    std::vector<const ItemView*> order;
    order.reserve(items.size());
    for (const ItemView& it : items)
      if (!it.ref_step) order.push_back(&it);
    std::stable_sort(order.begin(), order.end(),
                     [](const ItemView* a, const ItemView* b) { return a->offset_bytes < b->offset_bytes; });
    for (const ItemView* cur : order) CKPT_RETURN_IF_ERROR(check(cur));
  }
  return absl::OkStatus();
}

ItemCrcStream::ItemCrcStream(std::span<const ManifestItem> items) {
  sorted_.reserve(items.size());
  for (const ManifestItem& it : items) {
    if (it.ref_step) continue;  // its bytes are in another shard
    sorted_.push_back(Entry{it.offset_bytes, it.length_bytes, it.crc32c, it.name});
  }
  std::stable_sort(sorted_.begin(), sorted_.end(),
                   [](const Entry& a, const Entry& b) { return a.offset < b.offset; });
}

absl::Status ItemCrcStream::Update(std::span<const std::byte> piece) {
  const uint64_t begin = pos_;
  const uint64_t end = pos_ + piece.size();
  pos_ = end;
  while (next_ < sorted_.size()) {
    const Entry& e = sorted_[next_];
    const uint64_t item_end = e.offset + e.length;
    // An item that starts at `end` has none of its bytes in this piece (an
    // empty one there is complete, though).
    if (e.offset > end || (e.offset == end && e.length > 0)) break;
    const uint64_t lo = std::max(e.offset, begin);
    const uint64_t hi = std::min(item_end, end);
    if (hi > lo) crc_ = Crc32cExtend(crc_, piece.data() + (lo - begin), hi - lo);
    if (item_end > end) break;  // continues in the next piece
    if (crc_ != e.crc32c) {
      return absl::DataLossError(absl::StrFormat("item %s: crc32c %08x != manifest %08x",
                                                 QuoteForMessage(e.name), crc_, e.crc32c));
    }
    crc_ = 0;
    ++next_;
  }
  return absl::OkStatus();
}

absl::Status ItemCrcStream::Finish() const {
  if (next_ == sorted_.size()) return absl::OkStatus();
  const Entry& e = sorted_[next_];
  return absl::DataLossError(absl::StrCat("the shard's bytes ended at ", pos_, " before item ",
                                          QuoteForMessage(e.name), " [", e.offset, ", +", e.length,
                                          ") was complete"));
}

ManifestEncoder::ManifestEncoder(size_t reserve_bytes) {
  out_.reserve(std::max<size_t>(reserve_bytes, kCountAt + 4));
  out_.append(kManifestTag);
  AppendLe32(out_, 0);  // the count, patched by Finish()
}

void ManifestEncoder::Add(std::string_view name, int dtype, std::span<const uint64_t> shape,
                          uint64_t offset_bytes, uint64_t length_bytes, uint32_t crc32c,
                          const std::map<std::string, std::string>& attributes) {
  AppendItem(out_, std::nullopt, name, dtype, shape, offset_bytes, length_bytes, crc32c, attributes);
  ++count_;
}

void ManifestEncoder::AddRef(uint64_t ref_step, std::string_view name, int dtype, std::span<const uint64_t> shape,
                             uint64_t offset_bytes, uint64_t length_bytes, uint32_t crc32c,
                             const std::map<std::string, std::string>& attributes) {
  AppendItem(refs_, ref_step, name, dtype, shape, offset_bytes, length_bytes, crc32c, attributes);
  ++ref_count_;
}

std::string ManifestEncoder::Finish() {
  StoreLe32(out_.data() + kCountAt, count_);
  if (ref_count_ > 0) {
    out_.replace(0, kManifestTagV2.size(), kManifestTagV2);
    AppendLe32(out_, ref_count_);
    out_.append(refs_);
  }
  std::string done = std::move(out_);
  out_.clear();
  out_.append(kManifestTag);
  AppendLe32(out_, 0);
  refs_.clear();
  count_ = 0;
  ref_count_ = 0;
  return done;
}

std::string EncodeManifest(std::span<const ManifestItem> items) {
  size_t bytes = kCountAt + 4;
  for (const ManifestItem& it : items) {
    bytes += 48 + it.name.size() + 8 * it.shape.size();
    for (const auto& [k, v] : it.attributes) bytes += 8 + k.size() + v.size();
  }
  ManifestEncoder e(bytes);
  for (const ManifestItem* it : OffsetOrder(items)) e.Add(*it);
  return e.Finish();
}

uint64_t ContentHash(std::span<const std::byte> bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

uint64_t ManifestDigestOfEncoding(std::string_view encoded) {
  return XXH3_64bits(encoded.data(), encoded.size());
}

uint64_t ManifestDigest(std::span<const ManifestItem> items) {
  return ManifestDigestOfEncoding(EncodeManifest(items));
}

namespace {

// Canonical order (CanonicalItemLess) on packed items.
bool PackedLess(const PackedItem& a, const PackedItem& b) {
  if (a.ref_step.has_value() != b.ref_step.has_value()) return !a.ref_step.has_value();
  if (a.ref_step && *a.ref_step != *b.ref_step) return *a.ref_step < *b.ref_step;
  return a.offset_bytes < b.offset_bytes;
}

}  // namespace

uint64_t PackedItem::Dim(uint32_t i) const { return LoadLe64(shape_at + 8 * static_cast<size_t>(i)); }

std::vector<uint64_t> PackedItem::Shape() const {
  std::vector<uint64_t> shape(dims);
  for (uint32_t i = 0; i < dims; ++i) shape[i] = Dim(i);
  return shape;
}

std::map<std::string, std::string> PackedItem::Attributes() const {
  std::map<std::string, std::string> out;
  const char* p = attributes_at;
  for (uint32_t a = 0; a < attribute_count; ++a) {
    const uint32_t kn = LoadLe32(p);
    std::string_view k(p + 4, kn);
    p += 4 + kn;
    const uint32_t vn = LoadLe32(p);
    std::string_view v(p + 4, vn);
    p += 4 + vn;
    out.emplace_hint(out.end(), k, v);
  }
  return out;
}

size_t PackedItemCount(std::string_view encoded) {
  if (encoded.size() < kCountAt + 4) return 0;
  return std::min<size_t>(LoadLe32(encoded.data() + kCountAt), encoded.size() / 36);
}

bool PackedHasRefs(std::string_view encoded) { return encoded.substr(0, kManifestTagV2.size()) == kManifestTagV2; }

absl::Status ForEachPackedItem(std::string_view encoded, absl::FunctionRef<absl::Status(const PackedItem&)> fn) {
  const auto bad = [](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("packed manifest: ", why));
  };
  Reader r(encoded);
  const std::string_view tag = r.Raw(kManifestTag.size());
  const bool v2 = tag == kManifestTagV2;
  if (tag != kManifestTag && !v2) return bad("it does not start with 'ckpt-manifest-v1' or 'ckpt-manifest-v2'");
  PackedItem prev;
  size_t index = 0;
  // Reads `count` items (references with `refs`), in canonical order.
  const auto read = [&](uint32_t count, bool refs) -> absl::Status {
    // An item takes at least 36 bytes (empty name, no dims, no attributes).
    if (!r.ok() || count > r.left() / (refs ? 44 : 36)) {
      return bad(absl::StrCat("it cannot hold the ", count, refs ? " references" : " items", " it declares"));
    }
    for (uint32_t n = 0; n < count; ++n, ++index) {
      PackedItem it;
      if (refs) it.ref_step = r.U64();
      it.name = r.Str();
      it.dtype = static_cast<int>(r.U32());
      it.dims = r.U32();
      if (!r.ok() || it.dims > r.left() / 8) return bad(absl::StrCat("item ", index, " is cut short"));
      it.shape_at = r.Raw(8 * static_cast<size_t>(it.dims)).data();
      it.offset_bytes = r.U64();
      it.length_bytes = r.U64();
      it.crc32c = r.U32();
      it.attribute_count = r.U32();
      if (!r.ok() || it.attribute_count > r.left() / 8) return bad(absl::StrCat("item ", index, " is cut short"));
      it.attributes_at = r.Raw(0).data();
      std::string_view prev_key;
      for (uint32_t a = 0; a < it.attribute_count; ++a) {
        const std::string_view k = r.Str();
        r.Str();
        if (a > 0 && !(prev_key < k)) {
          return bad(absl::StrCat("item ", index, ": attribute keys are not in ascending order"));
        }
        prev_key = k;
      }
      if (!r.ok()) return bad(absl::StrCat("item ", index, " is cut short"));
      if (index > 0 && PackedLess(it, prev)) {
        return bad(absl::StrCat("item ", index, " (", QuoteForMessage(it.name), ") is out of canonical order"));
      }
      CKPT_RETURN_IF_ERROR(fn(it));
      prev = it;
    }
    return absl::OkStatus();
  };
  CKPT_RETURN_IF_ERROR(read(r.U32(), false));
  if (v2) {
    const uint32_t refs = r.U32();
    if (r.ok() && refs == 0) return bad("a v2 manifest without references is not canonical (that is a v1)");
    CKPT_RETURN_IF_ERROR(read(refs, true));
  }
  if (r.left() != 0) return bad(absl::StrCat(r.left(), " bytes are left over after the last item"));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ManifestItem>> DecodeManifest(std::string_view encoded) {
  std::vector<ManifestItem> items;
  items.reserve(PackedItemCount(encoded));
  CKPT_RETURN_IF_ERROR(ForEachPackedItem(encoded, [&](const PackedItem& p) {
    ManifestItem& it = items.emplace_back();
    it.ref_step = p.ref_step;
    it.name = p.name;
    it.dtype = p.dtype;
    it.shape = p.Shape();
    it.offset_bytes = p.offset_bytes;
    it.length_bytes = p.length_bytes;
    it.crc32c = p.crc32c;
    if (p.attribute_count > 0) it.attributes = p.Attributes();
    return absl::OkStatus();
  }));
  return items;
}

absl::Status MissingBaseError(uint32_t rank, const std::string& job_id, uint64_t step, uint64_t base,
                              const std::string& why) {
  return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " of ", job_id, "/", step, " ",
                                                    kMissingBaseMarker, " ", base, ", which ", why,
                                                    "; save this version in full"));
}

bool IsMissingBaseRefusal(const absl::Status& s) {
  return absl::IsFailedPrecondition(s) && absl::StrContains(s.message(), kMissingBaseMarker);
}

}  // namespace ckpt
