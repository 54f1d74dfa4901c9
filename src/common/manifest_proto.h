// The client's one translation of the proto's items (v1::Item, as the agent's
// OpenShard and Locate answer them) into the manifest's ManifestItem
// (src/common/manifest.h). The servers have their own in the rpc layer
// (src/server/rpc/agent_convert.h ItemFromProto): client and servers share
// only common and proto (docs/architecture.md "Layers").
//
// Pure functions, thread-safe. They copy and do not validate: callers check
// the result with ValidateManifest (or against the shard's size).
#pragma once

#include <vector>

#include "ckpt/v1/common.pb.h"
#include "common/manifest.h"

namespace ckpt::client {

// Every field of `item`, its reference to an earlier step included.
ManifestItem ManifestItemFromProto(const v1::Item& item);

// Each of `items` in turn, sorted by offset as EncodeManifest wants them
// (SortedByOffset).
std::vector<ManifestItem> SortedManifestFromProto(const google::protobuf::RepeatedPtrField<v1::Item>& items);

}  // namespace ckpt::client
