// Client::GlobalTensors and Client::LoadSlices: a version read in another
// layout than it was saved in (docs/python.md "Another layout").
//
// The index comes from meta's record of the version (GetVersion with every
// shard's items): global tensor -> the pieces ranks saved. A slice is
// assembled from the pieces that overlap it; replicas of the same piece are
// read once, from the best rank (this one, one with a copy on this node,
// else the lowest). The shards needed are opened as any load opens
// them (Load with LoadOptions::rank: local copy, peer, EC decode, durable
// tier), verified, and only then copied from.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/client.h"
#include "ckpt/v1/meta.pb.h"
#include "client/client_core.h"
#include "common/global_tensor.h"
#include "common/manifest.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt {
namespace {

// Where an item of a global tensor's piece is in its shard.
struct ItemPlace {
  uint64_t offset_bytes = 0;
  uint64_t length_bytes = 0;
  bool ref = false;  // a reference: its bytes are in an older version's shard
};

// What the client knows of a version's global tensors.
struct Index {
  std::map<std::string, GlobalTensor> tensors;
  std::set<uint32_t> here;  // ranks with a VALID copy on this client's node (any role)
  std::map<std::pair<uint32_t, std::string>, ItemPlace> items;  // (rank, item name) -> place
};

absl::StatusOr<Index> ReadIndex(const client::ClientCore& core, uint64_t step) {
  v1::GetVersionRequest req;
  req.set_job_id(core.options.job_id);
  req.set_step(step);
  req.set_include_items(true);
  v1::GetVersionResponse resp;
  CKPT_RETURN_IF_ERROR(client::CallMetaRetrying(
      core, [&](absl::Duration timeout) { return core.meta->GetVersion(req, &resp, timeout); }));
  Index index;
  for (const v1::ShardDetail& detail : resp.version().shards()) {
    const v1::ShardInfo& shard = detail.info();
    const uint32_t rank = shard.key().rank();
    for (const v1::ShardCopy& copy : detail.copies()) {
      if (copy.node_id() == core.node_id && copy.state() == v1::COPY_STATE_VALID) index.here.insert(rank);
    }
    for (const v1::Item& item : shard.items()) {
      if (item.attributes().empty()) continue;
      const std::map<std::string, std::string> attributes(item.attributes().begin(), item.attributes().end());
      const std::vector<uint64_t> shape(item.shape().begin(), item.shape().end());
      absl::StatusOr<std::optional<GlobalPlace>> place =
          ParseGlobalPlace(item.name(), static_cast<int>(item.dtype()), shape, attributes);
      if (!place.ok()) return Annotate(place.status(), absl::StrCat("rank ", rank, " of step ", step));
      if (!place->has_value()) continue;
      GlobalPlace& p = **place;
      auto [it, added] = index.tensors.try_emplace(p.name);
      GlobalTensor& t = it->second;
      if (added) {
        t.name = p.name;
        t.dtype = static_cast<DType>(item.dtype());
        t.shape = p.shape;
      } else if (t.dtype != static_cast<DType>(item.dtype()) || t.shape != p.shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            "global tensor ", QuoteForMessage(p.name), " of step ", step, ": rank ", rank, "'s item ",
            QuoteForMessage(item.name()), " says dtype ", DTypeName(static_cast<int>(item.dtype())), " shape [",
            absl::StrJoin(p.shape, ","), "], rank ", t.pieces.front().rank, "'s dtype ",
            DTypeName(static_cast<int>(t.dtype)), " shape [", absl::StrJoin(t.shape, ","), "]"));
      }
      t.pieces.push_back(GlobalPiece{rank, item.name(), std::move(p.offsets), shape});
      index.items[{rank, item.name()}] = ItemPlace{item.offset_bytes(), item.length_bytes(), item.has_ref_step()};
    }
  }
  return index;
}

// One piece chosen to fill part of a slice.
struct Use {
  const GlobalPiece* piece;
  Box part;  // the overlap, in global coordinates
};

// The pieces of `t` that fill `want` (PlanSlice), preferring this rank's,
// then one with a copy on this node (primary, replica or restored).
absl::StatusOr<std::vector<Use>> Plan(const GlobalTensor& t, const Box& want, const Index& index,
                                      const client::ClientCore& core) {
  std::vector<SlicePiece> pieces;
  pieces.reserve(t.pieces.size());
  for (size_t i = 0; i < t.pieces.size(); ++i) {
    pieces.push_back(SlicePiece{t.pieces[i].rank, Box{t.pieces[i].offsets, t.pieces[i].lengths}, i});
  }
  auto preference = [&](uint32_t rank) {
    if (rank == core.options.rank) return 0;
    return index.here.count(rank) > 0 ? 1 : 2;
  };
  CKPT_ASSIGN_OR_RETURN(std::vector<SliceUse> planned, PlanSlice(t.name, pieces, want, preference));
  std::vector<Use> uses;
  for (SliceUse& u : planned) uses.push_back(Use{&t.pieces[u.id], std::move(u.part)});
  return uses;
}

}  // namespace

absl::StatusOr<std::map<std::string, GlobalTensor>> Client::GlobalTensors(uint64_t step) const {
  CKPT_RETURN_IF_ERROR(core_->CheckProcess());
  CKPT_ASSIGN_OR_RETURN(Index index, ReadIndex(*core_, step));
  return std::move(index.tensors);
}

absl::Status Client::LoadSlices(uint64_t step, std::span<const SliceRequest> slices) const {
  CKPT_RETURN_IF_ERROR(core_->CheckProcess());
  core_->WaitSaves();
  CKPT_ASSIGN_OR_RETURN(Index index, ReadIndex(*core_, step));
  // Every slice checked and planned before any shard is opened.
  std::vector<std::vector<Use>> plans;
  std::vector<Box> wants;
  std::set<uint32_t> ranks;
  for (const SliceRequest& s : slices) {
    auto it = index.tensors.find(s.name);
    if (it == index.tensors.end()) {
      return absl::NotFoundError(absl::StrCat("step ", step, " of job ", core_->options.job_id,
                                              " has no global tensor ", QuoteForMessage(s.name)));
    }
    const GlobalTensor& t = it->second;
    const std::string what = absl::StrCat("slice of global tensor ", QuoteForMessage(s.name), " [",
                                          absl::StrJoin(t.shape, ","), "]");
    if (s.offsets.size() != t.shape.size() || s.lengths.size() != t.shape.size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.offsets.size(), " offsets and ",
                                                     s.lengths.size(), " lengths for ", t.shape.size(),
                                                     " dimensions"));
    }
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (s.offsets[d] > t.shape[d] || s.lengths[d] > t.shape[d] - s.offsets[d]) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", s.offsets[d], " + length ",
                                                       s.lengths[d], " lies outside dimension ", d));
      }
    }
    Box want{s.offsets, s.lengths};
    const uint64_t bytes = want.Elements() * DTypeElementSize(static_cast<int>(t.dtype));
    if (s.dst.size() != bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": the destination holds ", s.dst.size(), " bytes, the slice ", bytes));
    }
    CKPT_ASSIGN_OR_RETURN(std::vector<Use> uses, Plan(t, want, index, *core_));
    for (const Use& u : uses) ranks.insert(u.piece->rank);
    plans.push_back(std::move(uses));
    wants.push_back(std::move(want));
  }
  // The byte ranges each piece's part needs. A shard no copy of which is on
  // this node is read as those ranges alone (OpenShardRanges: only they
  // cross the network) unless one of its pieces is a reference; the others
  // (and any the agent serves whole: a decode, the durable tier) are loaded
  // whole, their items verified.
  std::map<uint32_t, std::vector<client::ByteSpan>> wanted;  // rank -> ranges, merged
  std::set<uint32_t> whole;
  for (size_t i = 0; i < plans.size(); ++i) {
    const uint32_t element = DTypeElementSize(static_cast<int>(index.tensors.at(slices[i].name).dtype));
    for (const Use& u : plans[i]) {
      const uint32_t rank = u.piece->rank;
      const ItemPlace& place = index.items.at({rank, u.piece->item});
      if (place.ref || rank == core_->options.rank || index.here.count(rank) != 0) whole.insert(rank);
      const auto [first, end] = ElementSpan(Box{u.piece->offsets, u.piece->lengths}, u.part);
      wanted[rank].push_back(client::ByteSpan{place.offset_bytes + first * element, (end - first) * element});
    }
  }
  for (auto& [rank, spans] : wanted) {
    std::sort(spans.begin(), spans.end(), [](const client::ByteSpan& a, const client::ByteSpan& b) { return a.offset < b.offset; });
    std::vector<client::ByteSpan> merged;
    for (const client::ByteSpan& r : spans) {
      if (!merged.empty() && r.offset <= merged.back().offset + merged.back().length) {
        merged.back().length = std::max(merged.back().length, r.offset + r.length - merged.back().offset);
      } else {
        merged.push_back(r);
      }
    }
    spans = std::move(merged);
  }
  // The shards, opened in parallel (a few at a time).
  struct Opened {
    absl::StatusOr<LoadedShard> shard = absl::UnknownError("not opened");
    std::optional<client::ShardRanges> ranges;  // set: only wanted[rank] was read
  };
  constexpr size_t kParallel = 4;
  std::map<uint32_t, Opened> shards;
  for (uint32_t r : ranks) shards.emplace(r, Opened{});
  std::vector<std::map<uint32_t, Opened>::iterator> order;
  for (auto it = shards.begin(); it != shards.end(); ++it) order.push_back(it);
  for (size_t first = 0; first < order.size(); first += kParallel) {
    std::vector<std::thread> threads;
    for (size_t i = first; i < std::min(order.size(), first + kParallel); ++i) {
      threads.emplace_back([this, step, &wanted, &whole, it = order[i]] {
        Opened& o = it->second;
        if (whole.count(it->first) == 0) {
          absl::StatusOr<std::optional<client::ShardRanges>> r =
              client::OpenShardRanges(core_, step, it->first, wanted.at(it->first));
          if (!r.ok()) {
            o.shard = r.status();
            return;
          }
          if (r->has_value()) {
            o.ranges = **std::move(r);
            o.shard = absl::UnknownError("read as ranges");
            return;
          }
        }
        o.shard = Load(step, LoadOptions{.verify = true, .rank = it->first});
      });
    }
    for (std::thread& t : threads) t.join();
  }
  for (auto& [rank, o] : shards) {
    if (!o.ranges && !o.shard.ok()) {
      return Annotate(o.shard.status(), absl::StrCat("rank ", rank, "'s shard of step ", step));
    }
  }
  // Every piece's bytes (views; an item straddling regions is copied and
  // checked here), before anything is written: (bytes, the row-major index
  // of the piece's element they begin with).
  std::vector<std::vector<std::pair<std::span<const std::byte>, uint64_t>>> sources(plans.size());
  for (size_t i = 0; i < plans.size(); ++i) {
    const uint32_t element = DTypeElementSize(static_cast<int>(index.tensors.at(slices[i].name).dtype));
    for (const Use& u : plans[i]) {
      Opened& o = shards.at(u.piece->rank);
      if (!o.ranges) {
        CKPT_ASSIGN_OR_RETURN(std::span<const std::byte> bytes, o.shard->View(u.piece->item));
        sources[i].emplace_back(bytes, 0);
        continue;
      }
      const ItemPlace& place = index.items.at({u.piece->rank, u.piece->item});
      const auto [first, end] = ElementSpan(Box{u.piece->offsets, u.piece->lengths}, u.part);
      const uint64_t at = place.offset_bytes + first * element;
      const std::vector<client::ByteSpan>& spans = wanted.at(u.piece->rank);
      size_t k = 0;
      while (k + 1 < spans.size() && spans[k + 1].offset <= at) ++k;  // the merged range holding it
      sources[i].emplace_back(o.ranges->bytes[k].subspan(at - spans[k].offset, (end - first) * element), first);
    }
  }
  for (size_t i = 0; i < plans.size(); ++i) {
    const uint32_t element = DTypeElementSize(static_cast<int>(index.tensors.at(slices[i].name).dtype));
    for (size_t j = 0; j < plans[i].size(); ++j) {
      const Use& u = plans[i][j];
      CopyBox(sources[i][j].first, Box{u.piece->offsets, u.piece->lengths}, slices[i].dst, wants[i], u.part, element,
              sources[i][j].second);
    }
  }
  for (auto& [rank, o] : shards) {
    if (o.shard.ok()) o.shard->CloseInBackground();
  }
  return absl::OkStatus();
}

}  // namespace ckpt
