#include "common/manifest.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "common/names.h"

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

class Encoder {
 public:
  void U32(uint32_t v) {
    unsigned char b[4];
    for (int i = 0; i < 4; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
    out_.append(reinterpret_cast<const char*>(b), 4);
  }
  void U64(uint64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
    out_.append(reinterpret_cast<const char*>(b), 8);
  }
  void Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  void Raw(const char* s, size_t n) { out_.append(s, n); }
  const std::string& out() const { return out_; }

 private:
  std::string out_;
};

}  // namespace

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

std::vector<ManifestItem> SortedByOffset(std::span<const ManifestItem> items) {
  std::vector<ManifestItem> sorted(items.begin(), items.end());
  std::stable_sort(sorted.begin(), sorted.end(), [](const ManifestItem& a, const ManifestItem& b) {
    return a.offset_bytes < b.offset_bytes;
  });
  return sorted;
}

absl::Status ValidateManifest(std::span<const ManifestItem> items, uint64_t shard_size_bytes) {
  absl::flat_hash_set<std::string> names;
  for (const ManifestItem& item : items) {
    if (absl::Status s = ValidateItemName(item.name); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("manifest: ", s.message()));
    }
    const std::string quoted = QuoteForMessage(item.name);
    if (!names.insert(item.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("manifest: item ", quoted, " appears twice"));
    }
    if (item.dtype < 1 || item.dtype > kMaxDType) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest: item ", quoted, " has unknown dtype ", item.dtype));
    }
    if (item.offset_bytes > shard_size_bytes ||
        item.length_bytes > shard_size_bytes - item.offset_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "manifest: item ", quoted, " [", item.offset_bytes, ", +", item.length_bytes,
          ") lies outside the shard of ", shard_size_bytes, " bytes"));
    }
    const uint32_t elem = DTypeElementSize(item.dtype);
    if (elem != 0) {
      unsigned __int128 elements = 1;
      for (uint64_t d : item.shape) {
        elements *= d;
        if (elements > (static_cast<unsigned __int128>(1) << 64)) break;
      }
      const unsigned __int128 expect = elements * elem;
      if (expect != item.length_bytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            "manifest: item ", quoted, " is ", item.length_bytes, " bytes but dtype ",
            DTypeName(item.dtype), " with its shape needs ",
            expect > UINT64_MAX ? std::string("more than 2^64") : absl::StrCat(static_cast<uint64_t>(expect)),
            " bytes"));
      }
    }
  }
  const std::vector<ManifestItem> sorted = SortedByOffset(items);
  for (size_t i = 1; i < sorted.size(); ++i) {
    const ManifestItem& prev = sorted[i - 1];
    const ManifestItem& cur = sorted[i];
    if (cur.length_bytes == 0 || prev.length_bytes == 0) continue;
    if (cur.offset_bytes < prev.offset_bytes + prev.length_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "manifest: items ", QuoteForMessage(prev.name), " [", prev.offset_bytes, ", +",
          prev.length_bytes, ") and ", QuoteForMessage(cur.name), " [", cur.offset_bytes, ", +",
          cur.length_bytes, ") overlap"));
    }
  }
  return absl::OkStatus();
}

ItemCrcStream::ItemCrcStream(std::span<const ManifestItem> items) {
  sorted_.reserve(items.size());
  for (const ManifestItem& it : items) {
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

uint64_t ManifestDigest(std::span<const ManifestItem> items) {
  Encoder e;
  e.Raw("ckpt-manifest-v1", 16);
  e.U32(static_cast<uint32_t>(items.size()));
  for (const ManifestItem& item : SortedByOffset(items)) {
    e.Str(item.name);
    e.U32(static_cast<uint32_t>(item.dtype));
    e.U32(static_cast<uint32_t>(item.shape.size()));
    for (uint64_t d : item.shape) e.U64(d);
    e.U64(item.offset_bytes);
    e.U64(item.length_bytes);
    e.U32(item.crc32c);
    e.U32(static_cast<uint32_t>(item.attributes.size()));
    for (const auto& [k, v] : item.attributes) {  // std::map: bytewise key order
      e.Str(k);
      e.Str(v);
    }
  }
  return XXH3_64bits(e.out().data(), e.out().size());
}

}  // namespace ckpt
