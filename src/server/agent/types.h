// Domain types shared by the agent's components: what a shard, an EC segment
// and a holding's record are, the roles and states a copy can have (and, from
// ec/layout.h, the rule that cuts a node's blob into EC segments).
//
// Plain values, no behaviour beyond formatting; safe to copy between threads.
#pragma once

#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/manifest.h"
#include "ec/layout.h"

namespace ckpt::agent {

inline constexpr uint64_t kArenaPageBytes = 4096;

// A byte range of the pool file. offset and length are multiples of
// kArenaPageBytes except that the last extent of an allocation may be used
// only partly (the allocation's size says how much).
struct Extent {
  uint64_t offset = 0;
  uint64_t length = 0;
  bool operator==(const Extent&) const = default;
};

// Identifies a shard: one rank's bytes of one version.
struct ShardId {
  std::string job_id;
  uint64_t step = 0;
  uint32_t rank = 0;
  auto operator<=>(const ShardId&) const = default;
};
std::string ShardIdString(const ShardId& id);  // "job/step/rank" for messages

// One EC segment of a version (ckpt.v1.SegmentKey): position `position` of
// stripe `stripe` of group `group`; positions k.. are parity.
struct SegmentId {
  std::string job_id;
  uint64_t step = 0;
  uint32_t group = 0;
  uint32_t stripe = 0;
  uint32_t position = 0;
  auto operator<=>(const SegmentId&) const = default;
};
std::string SegmentIdString(const SegmentId& id);  // "job/step/g0.s1.p2"

// ckpt.v1.CopyRole: why this node holds a copy.
enum class CopyRole : int {
  kPrimary = 1,   // committed here by a local trainer
  kReplica = 2,   // pushed here by a peer
  kRestored = 3,  // rebuilt here for a restore (peer, decode or durable tier)
};
// ckpt.v1.CopyState, the values an agent reports.
enum class CopyState : int {
  kValid = 2,
  kCorrupt = 3,
  kEvicted = 5,
};
// ckpt.v1.SegmentKind.
enum class SegmentKind : int {
  kData = 1,
  kParity = 2,
};
// ckpt.v1.VersionState numbers the agent looks at.
enum class VersionState : int {
  kPersisted = 4,
  kAborted = 6,
  kDeleted = 7,
};
// ckpt.v1.NodeState (meta::NodeState's numbers): what meta says of this node.
// kUnknown until meta first answers.
enum class NodeState : int {
  kUnknown = 0,
  kAlive = 1,
  kSuspect = 2,
  kDead = 3,
  kDraining = 4,
  kLeft = 5,
};
// The numbers of these enums are the proto's: static_asserts in
// server/rpc/agent_convert.cc keep them so, and the rpc layer casts.

const char* CopyRoleName(CopyRole role);

struct ShardRecord;
// Sets `r`'s items (in canonical order), their packed encoding and digest.
void SetItems(ShardRecord& r, std::vector<ManifestItem> items);
// The packed manifest of `r`'s items (its cached encoding when set).
std::string PackedManifest(const ShardRecord& r);

// What the agent keeps about a holding, persisted in its record file.
struct ShardRecord {
  ShardId id;
  CopyRole role = CopyRole::kPrimary;
  uint64_t size_bytes = 0;
  uint32_t crc32c = 0;
  uint64_t manifest_digest = 0;
  std::vector<ManifestItem> items;
  // EncodeManifest(items), kept by SetItems so that every open of a shard of
  // thousands of items does not encode them again; empty when the record was
  // built otherwise (PackedManifest encodes then). Whoever assigns `items`
  // directly must clear it.
  std::string packed;
  std::vector<Extent> extents;  // cover size_bytes, in shard order
  std::string run_id;
  int64_t staged_unix_ms = 0;
  // Relative durable path once this node wrote the shard to the durable tier.
  std::string durable_path;
  // Set for an EC segment holding (parity, or a data segment rebuilt on this
  // node) instead of a shard copy: id.rank is then 0 and items are empty.
  std::optional<SegmentId> segment;
  SegmentKind segment_kind = SegmentKind::kData;
  // Orders two records of the same holding (a newer one supersedes an older
  // one left behind by a crash between writing the new and removing the old).
  uint64_t seq = 0;
  // The record's file name in <memory-dir>/records (set when written or
  // adopted; not part of the record's contents).
  std::string file;
};

// How a node's blob (its primaries of a version, in rank order) is cut into
// the k data segments of EC: the rule lives in ec/layout.h.
using ec::BlobLayout;

}  // namespace ckpt::agent
