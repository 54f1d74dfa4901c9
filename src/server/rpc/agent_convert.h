// ckpt.v1 messages <-> the agent's domain types (server/agent). Pure
// functions, thread-safe. *FromProto validate and return InvalidArgument
// naming the field.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ckpt/v1/agent.pb.h"
#include "ckpt/v1/common.pb.h"
#include "common/durable_format.h"
#include "common/manifest.h"
#include "server/agent/agent.h"
#include "server/agent/arena.h"

namespace ckpt::rpc {

void ShardIdToProto(const agent::ShardId& id, v1::ShardKey* out);
absl::StatusOr<agent::ShardId> ShardIdFromProto(const v1::ShardKey& key, const std::string& field);

// common/manifest_proto.h ManifestItemToProto and ManifestItemFromProto.
void ItemToProto(const ManifestItem& item, v1::Item* out);
ManifestItem ItemFromProto(const v1::Item& item);

// ShardInfo of a record; primary_node_id = node_id.
void RecordToShardInfo(const agent::ShardRecord& rec, const std::string& node_id, bool with_items,
                       v1::ShardInfo* out);
void RegionToProto(const agent::Region& region, v1::MemoryRegion* out);
void HoldingToProto(const agent::HoldingInfo& h, v1::InventoryEntry* out);

// Data-plane addressing and EC layouts (tasks and restore sources).
agent::PeerEndpoint EndpointFromProto(const v1::NodeEndpoint& e);
agent::SegmentId SegmentIdFromProto(const v1::SegmentKey& k);
void SegmentIdToProto(const agent::SegmentId& id, v1::SegmentKey* out);
agent::SegmentKind SegmentKindFromProto(v1::SegmentKind kind);
agent::SegmentLocation SegmentLocationFromProto(const v1::SegmentLocation& l);
agent::EcGroupLayout EcGroupFromProto(const v1::EcGroupLayout& g);
agent::NodeBlob NodeBlobFromProto(const v1::NodeBlob& b);
agent::EcDecodeSource EcDecodeSourceFromProto(const v1::EcDecodeSource& s);
// A restore source; InvalidArgument for an unknown kind.
absl::StatusOr<agent::ShardSource> ShardSourceFromProto(const v1::ShardSource& s);

// The durable manifest of a version returned by GetVersion(include_items).
// FailedPrecondition if some rank has no staged shard.
absl::StatusOr<DurableManifest> ManifestFromVersion(const v1::VersionInfo& version);

}  // namespace ckpt::rpc
