// The one translation between the proto's items (ckpt.v1.Item) and the
// manifest's ManifestItem (src/common/manifest.h), for everyone who has both:
// the client (loads), the agent's rpc layer (src/server/rpc/agent_convert.h)
// and the tests' fake agents. A library of its own (ckpt::manifest_proto) so
// that ckpt::common stays free of protobuf (docs/architecture.md "Layers").
//
// Pure functions, thread-safe. They copy every field, a reference to an
// earlier step included, and do not validate: callers check the result with
// ValidateManifest (or against the shard's size).
#pragma once

#include <vector>

#include "ckpt/v1/common.pb.h"
#include "common/manifest.h"

namespace ckpt {

ManifestItem ManifestItemFromProto(const v1::Item& item);
void ManifestItemToProto(const ManifestItem& item, v1::Item* out);

// Each of `items` in turn, sorted by offset as EncodeManifest wants them
// (SortedByOffset).
std::vector<ManifestItem> SortedManifestFromProto(const google::protobuf::RepeatedPtrField<v1::Item>& items);

}  // namespace ckpt
