#include "server/rpc/agent_convert.h"

#include "absl/strings/str_cat.h"
#include "common/manifest_proto.h"
#include "common/names.h"

namespace ckpt::rpc {

// ---------------------------------------------------------------------------
// The agent's enums (agent/types.h) and the manifest's dtype numbers
// (common/manifest.h) mirror the proto numbers; these asserts are what makes
// the casts here, in meta_link_grpc.cc and in agent_service.cc correct.
#define CKPT_SAME_NUMBER(domain, proto) \
  static_assert(static_cast<int>(domain) == static_cast<int>(proto), #domain " != " #proto)

CKPT_SAME_NUMBER(agent::CopyRole::kPrimary, v1::COPY_ROLE_PRIMARY);
CKPT_SAME_NUMBER(agent::CopyRole::kReplica, v1::COPY_ROLE_REPLICA);
CKPT_SAME_NUMBER(agent::CopyRole::kRestored, v1::COPY_ROLE_RESTORED);
CKPT_SAME_NUMBER(agent::CopyState::kValid, v1::COPY_STATE_VALID);
CKPT_SAME_NUMBER(agent::CopyState::kCorrupt, v1::COPY_STATE_CORRUPT);
CKPT_SAME_NUMBER(agent::CopyState::kEvicted, v1::COPY_STATE_EVICTED);
CKPT_SAME_NUMBER(agent::SegmentKind::kData, v1::SEGMENT_KIND_DATA);
CKPT_SAME_NUMBER(agent::SegmentKind::kParity, v1::SEGMENT_KIND_PARITY);
CKPT_SAME_NUMBER(agent::VersionState::kPersisted, v1::VERSION_STATE_PERSISTED);
CKPT_SAME_NUMBER(agent::VersionState::kAborted, v1::VERSION_STATE_ABORTED);
CKPT_SAME_NUMBER(agent::VersionState::kDeleted, v1::VERSION_STATE_DELETED);
CKPT_SAME_NUMBER(agent::NodeState::kUnknown, v1::NODE_STATE_UNSPECIFIED);
CKPT_SAME_NUMBER(agent::NodeState::kAlive, v1::NODE_STATE_ALIVE);
CKPT_SAME_NUMBER(agent::NodeState::kSuspect, v1::NODE_STATE_SUSPECT);
CKPT_SAME_NUMBER(agent::NodeState::kDead, v1::NODE_STATE_DEAD);
CKPT_SAME_NUMBER(agent::NodeState::kDraining, v1::NODE_STATE_DRAINING);
CKPT_SAME_NUMBER(agent::NodeState::kLeft, v1::NODE_STATE_LEFT);
CKPT_SAME_NUMBER(kDTypeBytes, v1::DTYPE_BYTES);
CKPT_SAME_NUMBER(kMaxDType, v1::DType_MAX);
#undef CKPT_SAME_NUMBER

void ShardIdToProto(const agent::ShardId& id, v1::ShardKey* out) {
  out->set_job_id(id.job_id);
  out->set_step(id.step);
  out->set_rank(id.rank);
}

absl::StatusOr<agent::ShardId> ShardIdFromProto(const v1::ShardKey& key, const std::string& field) {
  if (absl::Status s = ValidateJobId(key.job_id()); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".job_id: ", s.message()));
  }
  if (absl::Status s = ValidateStep(key.step()); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".step: ", s.message()));
  }
  return agent::ShardId{key.job_id(), key.step(), key.rank()};
}

void ItemToProto(const ManifestItem& item, v1::Item* out) { ManifestItemToProto(item, out); }

ManifestItem ItemFromProto(const v1::Item& item) { return ManifestItemFromProto(item); }

void RecordToShardInfo(const agent::ShardRecord& rec, const std::string& node_id, bool with_items,
                       v1::ShardInfo* out) {
  ShardIdToProto(rec.id, out->mutable_key());
  out->set_size_bytes(rec.size_bytes);
  out->set_crc32c(rec.crc32c);
  out->set_manifest_digest(rec.manifest_digest);
  out->set_primary_node_id(node_id);
  out->set_staged_unix_ms(rec.staged_unix_ms);
  if (with_items) {
    for (const ManifestItem& item : rec.items) ItemToProto(item, out->add_items());
  }
}

void RegionToProto(const agent::Region& region, v1::MemoryRegion* out) {
  out->set_path(region.path);
  out->set_file_offset_bytes(region.file_offset);
  out->set_length_bytes(region.length);
  out->set_shard_offset_bytes(region.shard_offset);
}

void HoldingToProto(const agent::HoldingInfo& h, v1::InventoryEntry* out) {
  if (h.segment) {
    SegmentIdToProto(*h.segment, out->mutable_segment());
    out->set_segment_kind(static_cast<v1::SegmentKind>(h.segment_kind));
  } else {
    ShardIdToProto(h.id, out->mutable_shard());
    out->set_role(static_cast<v1::CopyRole>(h.role));
  }
  out->set_size_bytes(h.size_bytes);
  out->set_crc32c(h.crc32c);
  out->set_manifest_digest(h.manifest_digest);
  out->set_state(static_cast<v1::CopyState>(h.state));
  out->set_stored_unix_ms(h.stored_unix_ms);
  out->set_durable_path(h.durable_path);
}

absl::StatusOr<DurableManifest> ManifestFromVersion(const v1::VersionInfo& version) {
  DurableManifest m;
  m.job_id = version.job_id();
  m.step = version.step();
  m.world_size = version.world_size();
  m.created_unix_ms = version.created_unix_ms();
  std::vector<bool> seen(version.world_size(), false);
  for (const v1::ShardDetail& d : version.shards()) {
    const v1::ShardInfo& info = d.info();
    const uint32_t rank = info.key().rank();
    if (rank >= version.world_size() || seen[rank]) {
      return absl::FailedPreconditionError(absl::StrCat("version ", version.job_id(), " step ", version.step(),
                                                        ": bad or repeated rank ", rank));
    }
    seen[rank] = true;
    DurableShard s;
    s.rank = rank;
    s.file = RankFileName(rank);
    s.size_bytes = info.size_bytes();
    s.crc32c = info.crc32c();
    s.manifest_digest = info.manifest_digest();
    for (const v1::Item& item : info.items()) s.items.push_back(ItemFromProto(item));
    m.shards.push_back(std::move(s));
  }
  for (uint32_t r = 0; r < version.world_size(); ++r) {
    if (!seen[r]) {
      return absl::FailedPreconditionError(absl::StrCat("version ", version.job_id(), " step ", version.step(),
                                                        ": rank ", r, " is not staged"));
    }
  }
  std::sort(m.shards.begin(), m.shards.end(),
            [](const DurableShard& a, const DurableShard& b) { return a.rank < b.rank; });
  return m;
}

agent::PeerEndpoint EndpointFromProto(const v1::NodeEndpoint& e) {
  return agent::PeerEndpoint{e.node_id(), e.incarnation(), e.data_address(), e.state() == v1::NODE_STATE_SUSPECT};
}

agent::SegmentId SegmentIdFromProto(const v1::SegmentKey& k) {
  return agent::SegmentId{k.job_id(), k.step(), k.group_index(), k.stripe_index(), k.position()};
}

void SegmentIdToProto(const agent::SegmentId& id, v1::SegmentKey* out) {
  out->set_job_id(id.job_id);
  out->set_step(id.step);
  out->set_group_index(id.group);
  out->set_stripe_index(id.stripe);
  out->set_position(id.position);
}

agent::SegmentKind SegmentKindFromProto(v1::SegmentKind kind) {
  return kind == v1::SEGMENT_KIND_PARITY ? agent::SegmentKind::kParity : agent::SegmentKind::kData;
}

agent::SegmentLocation SegmentLocationFromProto(const v1::SegmentLocation& l) {
  agent::SegmentLocation out;
  out.key = SegmentIdFromProto(l.key());
  out.kind = SegmentKindFromProto(l.kind());
  out.length_bytes = l.length_bytes();
  out.crc32c = l.crc32c();
  out.holder = EndpointFromProto(l.holder());
  return out;
}

agent::EcGroupLayout EcGroupFromProto(const v1::EcGroupLayout& g) {
  agent::EcGroupLayout out;
  out.group_index = g.group_index();
  out.node_ids.assign(g.node_ids().begin(), g.node_ids().end());
  out.data_k = g.data_k();
  out.parity_m = g.parity_m();
  for (const v1::EcStripeLayout& s : g.stripes()) {
    agent::EcStripeLayout st;
    st.stripe_index = s.stripe_index();
    st.data_node_ids.assign(s.data_node_ids().begin(), s.data_node_ids().end());
    st.data_segment_indices.assign(s.data_segment_indices().begin(), s.data_segment_indices().end());
    st.parity_node_ids.assign(s.parity_node_ids().begin(), s.parity_node_ids().end());
    out.stripes.push_back(std::move(st));
  }
  return out;
}

agent::NodeBlob NodeBlobFromProto(const v1::NodeBlob& b) {
  agent::NodeBlob out;
  out.node_id = b.node_id();
  out.size_bytes = b.size_bytes();
  out.segment_bytes = b.segment_bytes();
  for (const v1::BlobPart& p : b.parts())
    out.parts.push_back(agent::BlobPart{p.rank(), p.blob_offset_bytes(), p.size_bytes()});
  return out;
}

agent::EcDecodeSource EcDecodeSourceFromProto(const v1::EcDecodeSource& s) {
  agent::EcDecodeSource out;
  out.group_index = s.group_index();
  out.data_k = s.data_k();
  out.parity_m = s.parity_m();
  out.owner_node_id = s.owner_node_id();
  out.blob_offset_bytes = s.blob_offset_bytes();
  out.segment_bytes = s.segment_bytes();
  for (const v1::EcStripeSource& st : s.stripes()) {
    agent::EcStripeSource o;
    o.stripe_index = st.stripe_index();
    o.blob_segment_index = st.blob_segment_index();
    o.position = st.position();
    o.stripe_length_bytes = st.stripe_length_bytes();
    for (const v1::SegmentLocation& l : st.segments()) o.segments.push_back(SegmentLocationFromProto(l));
    out.stripes.push_back(std::move(o));
  }
  return out;
}

absl::StatusOr<agent::ShardSource> ShardSourceFromProto(const v1::ShardSource& s) {
  agent::ShardSource out;
  switch (s.kind()) {
    case v1::SOURCE_KIND_LOCAL:
      out.kind = agent::ShardSource::Kind::kLocal;
      break;
    case v1::SOURCE_KIND_REPLICA:
      out.kind = agent::ShardSource::Kind::kReplica;
      out.holder = EndpointFromProto(s.holder());
      break;
    case v1::SOURCE_KIND_EC_DECODE:
      out.kind = agent::ShardSource::Kind::kEcDecode;
      out.ec = EcDecodeSourceFromProto(s.ec());
      break;
    case v1::SOURCE_KIND_DURABLE:
      out.kind = agent::ShardSource::Kind::kDurable;
      out.durable_path = s.durable_path();
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown source kind ", static_cast<int>(s.kind())));
  }
  return out;
}

}  // namespace ckpt::rpc
