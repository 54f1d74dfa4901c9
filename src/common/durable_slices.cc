#include "common/durable_slices.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/crc32c.h"
#include "common/manifest.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt {

absl::StatusOr<std::map<std::string, DurableGlobalTensor>> DurableGlobalTensors(const DurableManifest& manifest) {
  std::map<std::string, DurableGlobalTensor> out;
  for (const DurableShard& shard : manifest.shards) {
    for (size_t i = 0; i < shard.items.size(); ++i) {
      const ManifestItem& item = shard.items[i];
      if (item.attributes.empty()) continue;
      absl::StatusOr<std::optional<GlobalPlace>> place =
          ParseGlobalPlace(item.name, item.dtype, item.shape, item.attributes);
      if (!place.ok()) return Annotate(place.status(), absl::StrCat("rank ", shard.rank));
      if (!place->has_value()) continue;
      GlobalPlace& p = **place;
      auto [it, added] = out.try_emplace(p.name);
      DurableGlobalTensor& t = it->second;
      if (added) {
        t.name = p.name;
        t.dtype = item.dtype;
        t.shape = p.shape;
      } else if (t.dtype != item.dtype || t.shape != p.shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            "global tensor ", QuoteForMessage(p.name), ": rank ", shard.rank, "'s item ", QuoteForMessage(item.name),
            " says dtype ", DTypeName(item.dtype), " shape [", absl::StrJoin(p.shape, ","), "], rank ",
            t.pieces.front().rank, "'s dtype ", DTypeName(t.dtype), " shape [", absl::StrJoin(t.shape, ","), "]"));
      }
      t.pieces.push_back(DurablePiece{shard.rank, i, Box{std::move(p.offsets), item.shape}});
    }
  }
  return out;
}

namespace {

// Reads `item` of rank `rank` whole and checks its crc32c: from this
// version's rank file, or, for a reference, from the referred version's
// (which must hold it as its own item).
absl::StatusOr<std::vector<std::byte>> ReadItem(FileSystem* fs, const std::string& version_dir, uint32_t rank,
                                                const ManifestItem& item,
                                                std::map<uint64_t, DurableManifest>* bases) {
  std::string dir = version_dir;
  if (item.ref_step) {
    dir = DurableRefDir(version_dir, *item.ref_step);
    auto b = bases->find(*item.ref_step);
    if (b == bases->end()) {
      CKPT_ASSIGN_OR_RETURN(DurableManifest base, ReadDurableManifest(fs, dir));
      b = bases->emplace(*item.ref_step, std::move(base)).first;
    }
    if (rank >= b->second.shards.size() || !IsOwnItemOf(item, b->second.shards[rank].items)) {
      return absl::DataLossError(absl::StrCat("item ", QuoteForMessage(item.name), " of rank ", rank,
                                              " refers to version ", *item.ref_step, ", which holds no such item"));
    }
  }
  const std::string path = DurableRankFilePath(dir, rank);
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, fs->NewReadableFile(path));
  // Inside the file before it is allocated: a damaged manifest's claim is
  // DataLoss, not an allocation of its size.
  const bool inside = item.offset_bytes <= file->Size() && item.length_bytes <= file->Size() - item.offset_bytes;
  std::vector<std::byte> bytes(inside ? item.length_bytes : 0);
  CKPT_ASSIGN_OR_RETURN(size_t n, file->PositionedRead(item.offset_bytes, bytes));
  if (!inside || n != bytes.size()) {
    return absl::DataLossError(absl::StrCat(path, " ends before item ", QuoteForMessage(item.name), " [",
                                            item.offset_bytes, ", +", item.length_bytes, ")"));
  }
  const uint32_t crc = Crc32c(bytes);
  if (crc != item.crc32c) {
    return absl::DataLossError(absl::StrCat("item ", QuoteForMessage(item.name), " of ", path,
                                            " fails its checksum: crc32c ", absl::Hex(crc, absl::kZeroPad8),
                                            ", manifest says ", absl::Hex(item.crc32c, absl::kZeroPad8)));
  }
  return bytes;
}

}  // namespace

absl::StatusOr<uint64_t> ReadDurableSlices(FileSystem* fs, const std::string& version_dir,
                                           const DurableManifest& manifest,
                                           std::span<const DurableSliceRequest> slices) {
  CKPT_ASSIGN_OR_RETURN(auto tensors, DurableGlobalTensors(manifest));
  // Every slice checked and planned before anything is read.
  std::vector<std::vector<SliceUse>> plans;
  std::vector<const DurableGlobalTensor*> of;
  std::set<std::pair<uint32_t, size_t>> needed;  // (rank, item)
  for (const DurableSliceRequest& s : slices) {
    auto it = tensors.find(s.name);
    if (it == tensors.end()) {
      return absl::NotFoundError(absl::StrCat("version ", manifest.job_id, "/", manifest.step,
                                              " has no global tensor ", QuoteForMessage(s.name)));
    }
    const DurableGlobalTensor& t = it->second;
    const std::string what = absl::StrCat("slice of global tensor ", QuoteForMessage(s.name), " [",
                                          absl::StrJoin(t.shape, ","), "]");
    if (s.want.offsets.size() != t.shape.size() || s.want.lengths.size() != t.shape.size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.want.offsets.size(), " offsets and ",
                                                     s.want.lengths.size(), " lengths for ", t.shape.size(),
                                                     " dimensions"));
    }
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (s.want.offsets[d] > t.shape[d] || s.want.lengths[d] > t.shape[d] - s.want.offsets[d]) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", s.want.offsets[d], " + length ",
                                                       s.want.lengths[d], " lies outside dimension ", d));
      }
    }
    const uint64_t bytes = s.want.Elements() * DTypeElementSize(t.dtype);
    if (s.dst.size() != bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": the destination holds ", s.dst.size(), " bytes, the slice ", bytes));
    }
    std::vector<SlicePiece> pieces;
    for (size_t i = 0; i < t.pieces.size(); ++i) pieces.push_back(SlicePiece{t.pieces[i].rank, t.pieces[i].box, i});
    CKPT_ASSIGN_OR_RETURN(std::vector<SliceUse> uses,
                          PlanSlice(t.name, pieces, s.want, [](uint32_t) { return 0; }));
    for (const SliceUse& u : uses) needed.emplace(t.pieces[u.id].rank, t.pieces[u.id].item);
    plans.push_back(std::move(uses));
    of.push_back(&t);
  }
  std::map<std::pair<uint32_t, size_t>, std::vector<std::byte>> items;
  std::map<uint64_t, DurableManifest> bases;
  uint64_t read = 0;
  for (const auto& [rank, index] : needed) {
    const ManifestItem& item = manifest.shards[rank].items[index];
    CKPT_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, ReadItem(fs, version_dir, rank, item, &bases));
    read += bytes.size();
    items.emplace(std::make_pair(rank, index), std::move(bytes));
  }
  for (size_t i = 0; i < plans.size(); ++i) {
    const DurableGlobalTensor& t = *of[i];
    for (const SliceUse& u : plans[i]) {
      const DurablePiece& p = t.pieces[u.id];
      CopyBox(items.at({p.rank, p.item}), p.box, slices[i].dst, slices[i].want, u.part, DTypeElementSize(t.dtype));
    }
  }
  return read;
}

}  // namespace ckpt
