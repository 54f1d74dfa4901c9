// Conversions between the ckpt.v1 MetaService messages (proto/ckpt/v1/
// common.proto, meta.proto) and the metadata service's domain types
// (server/meta/model.h, meta_core.h, policy.h, planner.h).
//
// This is the only place where protobuf types and domain types meet: the
// MetaCore never sees a protobuf message, and the service (meta_service.h)
// only strings these calls together.
//
// Validation split. Functions named *FromProto check what is purely
// syntactic, and fail with InvalidArgument whose message names the proto
// field by its path in the request (e.g. "reports[2].copy.role is
// COPY_ROLE_UNSPECIFIED; set one of COPY_ROLE_PRIMARY, COPY_ROLE_REPLICA,
// COPY_ROLE_RESTORED"):
//   - enum values that are UNSPECIFIED or unknown to this server;
//   - a oneof with no member set, and required sub-messages that are missing
//     (JobSpec.protection, ShardReport's report, StagedReport.shard, keys);
//   - unsigned wire integers that do not fit the domain's int fields.
// Everything semantic (id syntax, ranges such as world size or copies, states,
// incarnations) is left to MetaCore, which answers with its own messages.
//
// Enum values of model.h equal the proto enum numbers (checked by
// static_assert in meta_convert.cc), so domain -> proto is a cast and
// proto -> domain a checked cast.
//
// Domain -> proto functions (ToProto and friends) write into a message the
// caller owns; they append to repeated fields and set scalars, so pass a fresh
// message. Those that need a stripe layout (StripeLayout::Create) return
// Internal if the domain value is inconsistent (a core bug), naming the group.
//
// Thread safety: pure functions; safe to call concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ckpt/v1/common.pb.h"
#include "ckpt/v1/meta.pb.h"
#include "server/rpc/status_convert.h"
#include "server/meta/meta_core.h"
#include "server/meta/model.h"
#include "server/meta/planner.h"
#include "server/meta/policy.h"

namespace ckpt::rpc {

// Server defaults the protocol documents.
inline constexpr uint32_t kDefaultPageSize = 1000;
inline constexpr uint32_t kMaxPageSize = 1000;
inline constexpr uint32_t kDefaultMaxProblems = 100;
inline constexpr uint64_t kDefaultSurvivalSamples = 1'000'000;
inline constexpr uint64_t kDefaultSurvivalSeed = 1;
// SURVIVAL_METHOD_UNSPECIFIED: exact when there are at most this many failure
// sets (meta.proto), else the planner's structured exact method, else Monte Carlo.
inline constexpr uint64_t kAutoExactLimit = 1'000'000;

// ---------------------------------------------------------------------------
// Status
// ---------------------------------------------------------------------------

// ToGrpcStatus, FromGrpcStatus, ToProto(Status), StatusFromProto: status_convert.h.

// ---------------------------------------------------------------------------
// Enums. *FromProto take the raw number (proto3 enums may carry numbers this
// build does not know) and reject 0 (UNSPECIFIED) and unknown numbers with
// InvalidArgument naming `field` and listing the accepted names.
// ---------------------------------------------------------------------------

absl::StatusOr<meta::VersionState> VersionStateFromProto(int value, const std::string& field);
absl::StatusOr<meta::Level> LevelFromProto(int value, const std::string& field);
absl::StatusOr<meta::NodeState> NodeStateFromProto(int value, const std::string& field);
absl::StatusOr<meta::NodeRole> NodeRoleFromProto(int value, const std::string& field);
absl::StatusOr<meta::CopyRole> CopyRoleFromProto(int value, const std::string& field);
absl::StatusOr<meta::CopyState> CopyStateFromProto(int value, const std::string& field);
absl::StatusOr<meta::SegmentKind> SegmentKindFromProto(int value, const std::string& field);
absl::StatusOr<meta::ProtectionPolicy::Placement> PlacementFromProto(int value,
                                                                     const std::string& field);
// Item dtype: any DType number except DTYPE_UNSPECIFIED (kept as an int).
absl::StatusOr<int> DTypeFromProto(int value, const std::string& field);

v1::VersionState ToProto(meta::VersionState state);
v1::DurabilityLevel ToProto(meta::Level level);
v1::NodeState ToProto(meta::NodeState state);
v1::NodeRole ToProto(meta::NodeRole role);
v1::CopyRole ToProto(meta::CopyRole role);
v1::CopyState ToProto(meta::CopyState state);
v1::SegmentKind ToProto(meta::SegmentKind kind);
v1::SourceKind ToProto(meta::SourceKind kind);
v1::ReplicaPlacement ToProto(meta::ProtectionPolicy::Placement placement);
v1::TaskDisposition ToProto(meta::TaskDisposition disposition);
v1::InventoryAction ToProto(meta::InventoryDecision::Action action);
v1::ProblemKind ToProto(meta::Problem::Kind kind);

// ---------------------------------------------------------------------------
// Policies and jobs
// ---------------------------------------------------------------------------

// InvalidArgument naming `field` if no kind is set (".none", ".replicate" or
// ".ec" required), if replicate.placement is unspecified, or if a count does
// not fit an int. Ranges (copies 2..8, k, m) are ProtectionPolicy::Validate's.
absl::StatusOr<meta::ProtectionPolicy> PolicyFromProto(const v1::ProtectionPolicy& policy,
                                                       const std::string& field);
void ToProto(const meta::ProtectionPolicy& policy, v1::ProtectionPolicy* out);

// What a CreateJob spec states (meta::JobRequest). `field` is the path of the
// spec ("spec"). Stated: the protection when `protection` is set (its kind is
// then required); the flush or retention policy when its message is set with
// a non-zero field (all zero means unstated, as clients before field presence
// sent it); the world size when non-zero; labels always.
absl::StatusOr<meta::JobRequest> JobRequestFromProto(const v1::JobSpec& spec,
                                                     const std::string& field);
void ToProto(const meta::JobSpec& spec, v1::JobSpec* out);
// Job counts per state omit states with no version.
void ToProto(const meta::JobView& view, v1::JobInfo* out);

// ---------------------------------------------------------------------------
// Nodes
// ---------------------------------------------------------------------------

void ToProto(const meta::Endpoint& endpoint, v1::NodeEndpoint* out);
// NodeInfo.pending_tasks stays 0: meta::Node does not carry it.
void ToProto(const meta::Node& node, v1::NodeInfo* out);

absl::StatusOr<meta::RegisterRequest> RegisterFromProto(const v1::RegisterNodeRequest& req);
void ToProto(const meta::RegisterResult& result, v1::RegisterNodeResponse* out);
meta::HeartbeatRequest HeartbeatFromProto(const v1::HeartbeatRequest& req);

// ---------------------------------------------------------------------------
// Shards, items, segments, holdings
// ---------------------------------------------------------------------------

absl::StatusOr<meta::Item> ItemFromProto(const v1::Item& item, const std::string& field);
void ToProto(const meta::Item& item, v1::Item* out);

// ShardInfo of (job_id, step, shard); items only if include_items.
void ShardInfoToProto(const std::string& job_id, uint64_t step, const meta::Shard& shard,
                      bool include_items, v1::ShardInfo* out);

// The domain key (group, stripe, position; the caller takes job_id and step
// from the proto key). Indices that do not fit an int are InvalidArgument
// naming field + ".group_index" etc.
absl::StatusOr<meta::SegmentKey> SegmentKeyFromProto(const v1::SegmentKey& key,
                                                     const std::string& field);
void SegmentKeyToProto(const std::string& job_id, uint64_t step, const meta::SegmentKey& key,
                       v1::SegmentKey* out);
void SegmentToProto(const std::string& job_id, uint64_t step, const meta::Segment& segment,
                    v1::SegmentInfo* out);

// One ReportShards entry. `field` is its path ("reports[3]").
absl::StatusOr<meta::ShardReport> ShardReportFromProto(const v1::ShardReport& report,
                                                       const std::string& field);

// An inventory entry: `what` must be set; shards need a role, segments a
// kind; every entry needs a state.
absl::StatusOr<meta::Holding> HoldingFromProto(const v1::InventoryEntry& entry,
                                               const std::string& field);
void ToProto(const meta::Holding& holding, v1::InventoryEntry* out);
void ToProto(const meta::InventoryResult& result, v1::ReportInventoryResponse* out);

// ---------------------------------------------------------------------------
// Plans, layouts, versions
// ---------------------------------------------------------------------------

// The group with its members, k, m and explicit stripes computed with
// StripeLayout::Create(members.size(), k, m). Internal if that fails.
absl::Status EcGroupToProto(const meta::EcGroup& group, v1::EcGroupLayout* out);
void ToProto(const meta::NodeBlob& blob, v1::NodeBlob* out);

// The plan of a version or a job. Replica sets: one per plan node that has
// protectors, in plan order; group_index is the plan position under ring
// placement and the group number (groups are the connected sets of nodes that
// protect each other, numbered in plan order) under group placement.
absl::Status PlanToProto(const std::string& job_id, const meta::VersionPlan& plan,
                         int64_t created_ms, v1::PlacementPlan* out);

// Summary: no shards, EC layout or segments. shards_staged and total_bytes
// come from version.shards (whatever the core put there).
void VersionSummaryToProto(const meta::Version& version, v1::VersionInfo* out);
// Summary plus per-shard detail (items if include_items), EC layout (ec policy
// only) and segments.
absl::Status VersionDetailToProto(const meta::Version& version, bool include_items,
                                  v1::VersionInfo* out);

void ToProto(const meta::SurvivalEstimate& estimate, v1::SurvivalEstimate* out);
// The survival options of a GetPlacement request: method UNSPECIFIED -> auto
// (enumeration up to kAutoExactLimit failure sets, then the structured exact
// computation, then Monte Carlo); EXACT -> the structured exact computation
// (fails with InvalidArgument if too much work); MONTE_CARLO -> Monte Carlo.
// seed 0 -> kDefaultSurvivalSeed, samples 0 -> kDefaultSurvivalSamples.
absl::StatusOr<meta::SurvivalOptions> SurvivalOptionsFromProto(const v1::GetPlacementRequest& req);
absl::Status ToProto(const meta::PlacementView& view, v1::GetPlacementResponse* out);

// ---------------------------------------------------------------------------
// Restore sources
// ---------------------------------------------------------------------------

void SourceToProto(const std::string& job_id, uint64_t step, const meta::Source& source,
                   v1::ShardSource* out);
void ToProto(const std::string& job_id, uint64_t step, const meta::LocateResult& result,
             v1::LocateResponse* out, bool include_items = true);

// ---------------------------------------------------------------------------
// Tasks
// ---------------------------------------------------------------------------

// The wire form of a task, resolved with its bundle (version, endpoints,
// sources). Nodes without an endpoint in the bundle are sent with their id
// only. Internal if the bundle lacks what the kind needs (no version for a
// version task, an EC group index or segment the version does not have).
absl::Status TaskToProto(const meta::TaskBundle& bundle, v1::Task* out);

// ---------------------------------------------------------------------------
// Cluster
// ---------------------------------------------------------------------------

void ToProto(const meta::Problem& problem, v1::Problem* out);
// Counts per state omit zero counts; versions_by_state omits DELETED.
void ToProto(const meta::ClusterStatusView& view, v1::ClusterStatusResponse* out);

}  // namespace ckpt::rpc
