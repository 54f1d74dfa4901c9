// Engine, placement: the plan over the nodes that count for protection,
// and where a shard can be read from (Sources, StripeLocations).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/meta/core_state.h"

namespace ckpt::meta {

std::vector<PlannerNode> Engine::AliveNodes() const {
  std::vector<PlannerNode> out;
  for (const auto& [id, n] : s_.nodes) {
    if (NodeCountsForProtection(n.state)) {
      out.push_back({id, PlacementDomain(s_.nodes, id, n)});
    }
  }
  return out;
}

absl::StatusOr<VersionPlan> PlanToVersionPlan(const PlacementPlan& plan) {
  VersionPlan vp;
  vp.policy = plan.policy();
  for (const auto& n : plan.nodes()) vp.nodes.push_back(n.id);
  if (plan.policy().kind == ProtectionPolicy::Kind::kReplicate) {
    for (int i = 0; i < plan.size(); ++i) {
      std::vector<std::string> targets;
      for (int p : plan.Protectors(i)) targets.push_back(vp.nodes[p]);
      vp.protectors[vp.nodes[i]] = std::move(targets);
    }
  } else if (plan.policy().kind == ProtectionPolicy::Kind::kErasureCode) {
    for (const PlacementGroup& g : plan.groups()) {
      EcGroup eg;
      eg.index = g.index;
      eg.data_k = plan.policy().data_k;
      eg.parity_m = plan.policy().parity_m;
      for (int j = 0; j < g.size; ++j) eg.members.push_back(vp.nodes[g.first + j]);
      vp.groups.push_back(std::move(eg));
    }
  }
  return vp;
}

absl::StatusOr<VersionPlan> Engine::CurrentPlan(Job& job) {
  const std::vector<PlannerNode> alive = AliveNodes();
  CKPT_ASSIGN_OR_RETURN(PlacementPlan plan, PlanPlacement(alive, job.spec.protection));
  CKPT_ASSIGN_OR_RETURN(VersionPlan vp, PlanToVersionPlan(plan));
  auto& last = s_.last_plan_nodes[job.spec.job_id];
  if (last != vp.nodes || job.plan_epoch == 0) {
    last = vp.nodes;
    ++job.plan_epoch;
    txn_.Job(job);
  }
  vp.epoch = job.plan_epoch;
  return vp;
}

namespace {

const EcGroup* GroupOfNode(const Version& v, const std::string& node_id, int* member) {
  for (const EcGroup& g : v.plan.groups) {
    for (size_t j = 0; j < g.members.size(); ++j) {
      if (g.members[j] == node_id) {
        *member = static_cast<int>(j);
        return &g;
      }
    }
  }
  return nullptr;
}

const NodeBlob* BlobOf(const Version& v, const std::string& node_id) {
  for (const NodeBlob& b : v.blobs)
    if (b.node_id == node_id) return &b;
  return nullptr;
}

}  // namespace

std::vector<Source> Engine::Sources(const Version& v, const Shard& shard,
                                    const std::string& near_node_id) const {
  std::vector<Source> out;
  std::string near_domain;
  if (auto n = s_.nodes.find(near_node_id); n != s_.nodes.end()) {
    near_domain = PlacementDomain(s_.nodes, n->first, n->second);
  }
  // Holders on DEAD or LEFT nodes are never sources (IsUsable); replicas on
  // SUSPECT nodes (missing heartbeats: a stopped or overloaded agent would
  // hold a reader for the whole peer timeout) come after every other source.
  std::vector<Source> replicas, suspect;
  for (const Copy& c : shard.copies) {
    if (!Usable(c.state) || !IsUsable(c.node_id)) continue;
    Source src;
    src.kind = c.node_id == near_node_id ? SourceKind::kLocal : SourceKind::kReplica;
    src.holder = EndpointOf(c.node_id);
    src.role = c.role;
    if (src.kind == SourceKind::kLocal) {
      out.push_back(src);
    } else if (IsSuspect(c.node_id)) {
      suspect.push_back(src);
    } else {
      replicas.push_back(src);
    }
  }
  auto rank_of = [&](const Source& s) {
    int r = s.role == CopyRole::kPrimary ? 0 : 2;
    auto n = s_.nodes.find(s.holder.node_id);
    if (!near_domain.empty() && n != s_.nodes.end() &&
        PlacementDomain(s_.nodes, n->first, n->second) == near_domain) {
      r -= 1;
    }
    return r;
  };
  auto by_rank = [&](const Source& a, const Source& b) { return rank_of(a) < rank_of(b); };
  std::stable_sort(replicas.begin(), replicas.end(), by_rank);
  std::stable_sort(suspect.begin(), suspect.end(), by_rank);
  out.insert(out.end(), replicas.begin(), replicas.end());

  // EC decode from the owner's stripes.
  int member = -1;
  const EcGroup* g = GroupOfNode(v, shard.primary_node_id, &member);
  const NodeBlob* blob = BlobOf(v, shard.primary_node_id);
  if (g != nullptr && blob != nullptr && !v.segments.empty() && blob->segment_bytes > 0) {
    uint64_t offset = 0;
    bool found = false;
    for (const BlobPart& p : blob->parts) {
      if (p.rank == shard.rank) {
        offset = p.blob_offset_bytes;
        found = true;
      }
    }
    auto layout = StripeLayout::Create(static_cast<int>(g->members.size()), g->data_k,
                                       g->parity_m);
    if (found && layout.ok()) {
      EcDecodeSource ec;
      ec.group_index = static_cast<uint32_t>(g->index);
      ec.data_k = static_cast<uint32_t>(g->data_k);
      ec.parity_m = static_cast<uint32_t>(g->parity_m);
      ec.owner_node_id = shard.primary_node_id;
      ec.blob_offset_bytes = offset;
      ec.segment_bytes = blob->segment_bytes;
      bool ok = true;
      const uint64_t first = offset / blob->segment_bytes;
      const uint64_t last =
          shard.size_bytes == 0 ? first : (offset + shard.size_bytes - 1) / blob->segment_bytes;
      for (uint64_t t = first; t <= last && ok; ++t) {
        const StripeSlot slot = layout->SegmentOf(member, static_cast<int>(t));
        EcStripeSource ss;
        ss.stripe_index = static_cast<uint32_t>(slot.stripe);
        ss.blob_segment_index = static_cast<uint32_t>(t);
        ss.position = static_cast<uint32_t>(slot.position);
        bool wanted_valid = false;
        for (const Segment& seg : v.segments) {
          if (seg.key.group != g->index || seg.key.stripe != slot.stripe) continue;
          if (seg.kind == SegmentKind::kParity) {
            ss.stripe_length_bytes = seg.length_bytes;
          }
        }
        ss.segments = StripeLocations(v, g->index, slot.stripe, nullptr);
        for (const SegmentLocation& loc : ss.segments) {
          if (loc.key.position == slot.position) wanted_valid = true;
        }
        if (!wanted_valid && static_cast<int>(ss.segments.size()) < g->data_k) ok = false;
        ec.stripes.push_back(std::move(ss));
      }
      if (ok) {
        Source src;
        src.kind = SourceKind::kEcDecode;
        src.ec = std::move(ec);
        out.push_back(std::move(src));
      }
    }
  }
  if (v.state == VersionState::kPersisted && !shard.durable_path.empty()) {
    Source src;
    src.kind = SourceKind::kDurable;
    src.durable_path = shard.durable_path;
    out.push_back(src);
  }
  out.insert(out.end(), suspect.begin(), suspect.end());
  return out;
}

std::vector<SegmentLocation> Engine::StripeLocations(const Version& v, int group, int stripe,
                                                     const SegmentKey* exclude) const {
  std::vector<const Segment*> segs;
  for (const Segment& seg : v.segments) {
    if (seg.key.group != group || seg.key.stripe != stripe) continue;
    if (exclude != nullptr && seg.key == *exclude) continue;
    if (!Usable(seg.state) || !IsUsable(seg.holder_node_id)) continue;
    segs.push_back(&seg);
  }
  // Position order (data before parity), SUSPECT holders last.
  std::stable_sort(segs.begin(), segs.end(), [&](const Segment* a, const Segment* b) {
    const bool sa = IsSuspect(a->holder_node_id), sb = IsSuspect(b->holder_node_id);
    if (sa != sb) return sb;
    return a->key.position < b->key.position;
  });
  std::vector<SegmentLocation> out;
  out.reserve(segs.size());
  for (const Segment* seg : segs) {
    out.push_back(SegmentLocation{seg->key, seg->kind, seg->length_bytes, seg->crc32c,
                                  EndpointOf(seg->holder_node_id)});
  }
  return out;
}

}  // namespace ckpt::meta
