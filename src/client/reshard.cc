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

// What the client knows of a version's global tensors.
struct Index {
  std::map<std::string, GlobalTensor> tensors;
  std::set<uint32_t> here;  // ranks with a VALID copy on this client's node (any role)
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
  // The shards, opened and verified in parallel (a few at a time).
  constexpr size_t kParallel = 4;
  std::map<uint32_t, absl::StatusOr<LoadedShard>> shards;
  for (uint32_t r : ranks) shards.emplace(r, absl::UnknownError("not opened"));
  std::vector<std::map<uint32_t, absl::StatusOr<LoadedShard>>::iterator> order;
  for (auto it = shards.begin(); it != shards.end(); ++it) order.push_back(it);
  for (size_t first = 0; first < order.size(); first += kParallel) {
    std::vector<std::thread> threads;
    for (size_t i = first; i < std::min(order.size(), first + kParallel); ++i) {
      threads.emplace_back([this, step, it = order[i]] {
        it->second = Load(step, LoadOptions{.verify = true, .rank = it->first});
      });
    }
    for (std::thread& t : threads) t.join();
  }
  for (auto& [rank, shard] : shards) {
    if (!shard.ok()) return Annotate(shard.status(), absl::StrCat("rank ", rank, "'s shard of step ", step));
  }
  // Every piece's bytes (views; an item straddling regions is copied and
  // checked here), before anything is written.
  std::vector<std::vector<std::span<const std::byte>>> sources(plans.size());
  for (size_t i = 0; i < plans.size(); ++i) {
    for (const Use& u : plans[i]) {
      LoadedShard& shard = *shards.at(u.piece->rank);
      CKPT_ASSIGN_OR_RETURN(std::span<const std::byte> bytes, shard.View(u.piece->item));
      sources[i].push_back(bytes);
    }
  }
  for (size_t i = 0; i < plans.size(); ++i) {
    const uint32_t element = DTypeElementSize(static_cast<int>(index.tensors.at(slices[i].name).dtype));
    for (size_t j = 0; j < plans[i].size(); ++j) {
      const Use& u = plans[i][j];
      CopyBox(sources[i][j], Box{u.piece->offsets, u.piece->lengths}, slices[i].dst, wants[i], u.part, element);
    }
  }
  for (auto& [rank, shard] : shards) shard->CloseInBackground();
  return absl::OkStatus();
}

}  // namespace ckpt
