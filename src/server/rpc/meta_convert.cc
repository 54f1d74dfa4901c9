#include "server/rpc/meta_convert.h"

#include <google/protobuf/generated_enum_reflection.h>

#include <algorithm>
#include <climits>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/names.h"

namespace ckpt::rpc {

// ---------------------------------------------------------------------------
// The domain enums mirror the proto numbers; these asserts are what makes the
// casts below correct.
#define CKPT_SAME_NUMBER(domain, proto) \
  static_assert(static_cast<int>(domain) == static_cast<int>(proto), #domain " != " #proto)

CKPT_SAME_NUMBER(meta::VersionState::kOpen, v1::VERSION_STATE_OPEN);
CKPT_SAME_NUMBER(meta::VersionState::kStaged, v1::VERSION_STATE_STAGED);
CKPT_SAME_NUMBER(meta::VersionState::kProtected, v1::VERSION_STATE_PROTECTED);
CKPT_SAME_NUMBER(meta::VersionState::kPersisted, v1::VERSION_STATE_PERSISTED);
CKPT_SAME_NUMBER(meta::VersionState::kDegraded, v1::VERSION_STATE_DEGRADED);
CKPT_SAME_NUMBER(meta::VersionState::kAborted, v1::VERSION_STATE_ABORTED);
CKPT_SAME_NUMBER(meta::VersionState::kDeleted, v1::VERSION_STATE_DELETED);
CKPT_SAME_NUMBER(meta::Level::kStaged, v1::DURABILITY_LEVEL_STAGED);
CKPT_SAME_NUMBER(meta::Level::kProtected, v1::DURABILITY_LEVEL_PROTECTED);
CKPT_SAME_NUMBER(meta::Level::kPersisted, v1::DURABILITY_LEVEL_PERSISTED);
CKPT_SAME_NUMBER(meta::NodeState::kAlive, v1::NODE_STATE_ALIVE);
CKPT_SAME_NUMBER(meta::NodeState::kSuspect, v1::NODE_STATE_SUSPECT);
CKPT_SAME_NUMBER(meta::NodeState::kDead, v1::NODE_STATE_DEAD);
CKPT_SAME_NUMBER(meta::NodeState::kDraining, v1::NODE_STATE_DRAINING);
CKPT_SAME_NUMBER(meta::NodeState::kLeft, v1::NODE_STATE_LEFT);
CKPT_SAME_NUMBER(meta::NodeRole::kHost, v1::NODE_ROLE_HOST);
CKPT_SAME_NUMBER(meta::NodeRole::kDpu, v1::NODE_ROLE_DPU);
CKPT_SAME_NUMBER(meta::CopyRole::kPrimary, v1::COPY_ROLE_PRIMARY);
CKPT_SAME_NUMBER(meta::CopyRole::kReplica, v1::COPY_ROLE_REPLICA);
CKPT_SAME_NUMBER(meta::CopyRole::kRestored, v1::COPY_ROLE_RESTORED);
CKPT_SAME_NUMBER(meta::CopyState::kPending, v1::COPY_STATE_PENDING);
CKPT_SAME_NUMBER(meta::CopyState::kValid, v1::COPY_STATE_VALID);
CKPT_SAME_NUMBER(meta::CopyState::kCorrupt, v1::COPY_STATE_CORRUPT);
CKPT_SAME_NUMBER(meta::CopyState::kLost, v1::COPY_STATE_LOST);
CKPT_SAME_NUMBER(meta::CopyState::kEvicted, v1::COPY_STATE_EVICTED);
CKPT_SAME_NUMBER(meta::SegmentKind::kData, v1::SEGMENT_KIND_DATA);
CKPT_SAME_NUMBER(meta::SegmentKind::kParity, v1::SEGMENT_KIND_PARITY);
CKPT_SAME_NUMBER(meta::SourceKind::kLocal, v1::SOURCE_KIND_LOCAL);
CKPT_SAME_NUMBER(meta::SourceKind::kReplica, v1::SOURCE_KIND_REPLICA);
CKPT_SAME_NUMBER(meta::SourceKind::kEcDecode, v1::SOURCE_KIND_EC_DECODE);
CKPT_SAME_NUMBER(meta::SourceKind::kDurable, v1::SOURCE_KIND_DURABLE);
CKPT_SAME_NUMBER(meta::TaskDisposition::kCompleted, v1::TASK_DISPOSITION_COMPLETED);
CKPT_SAME_NUMBER(meta::TaskDisposition::kDuplicate, v1::TASK_DISPOSITION_DUPLICATE);
CKPT_SAME_NUMBER(meta::TaskDisposition::kCancelled, v1::TASK_DISPOSITION_CANCELLED);
CKPT_SAME_NUMBER(meta::TaskDisposition::kRetry, v1::TASK_DISPOSITION_RETRY);
CKPT_SAME_NUMBER(meta::TaskDisposition::kFailed, v1::TASK_DISPOSITION_FAILED);
CKPT_SAME_NUMBER(meta::InventoryDecision::Action::kAdopted, v1::INVENTORY_ACTION_ADOPTED);
CKPT_SAME_NUMBER(meta::InventoryDecision::Action::kDrop, v1::INVENTORY_ACTION_DROP);
CKPT_SAME_NUMBER(meta::InventoryDecision::Action::kUnknown, v1::INVENTORY_ACTION_UNKNOWN);
CKPT_SAME_NUMBER(meta::Problem::Kind::kNodeDead, v1::PROBLEM_KIND_NODE_DEAD);
CKPT_SAME_NUMBER(meta::Problem::Kind::kNodeSuspect, v1::PROBLEM_KIND_NODE_SUSPECT);
CKPT_SAME_NUMBER(meta::Problem::Kind::kVersionDegraded, v1::PROBLEM_KIND_VERSION_DEGRADED);
CKPT_SAME_NUMBER(meta::Problem::Kind::kVersionLost, v1::PROBLEM_KIND_VERSION_LOST);
CKPT_SAME_NUMBER(meta::Problem::Kind::kCorruptCopy, v1::PROBLEM_KIND_CORRUPT_COPY);
CKPT_SAME_NUMBER(meta::Problem::Kind::kFlushFailing, v1::PROBLEM_KIND_FLUSH_FAILING);
CKPT_SAME_NUMBER(meta::Problem::Kind::kFlushLagging, v1::PROBLEM_KIND_FLUSH_LAGGING);
CKPT_SAME_NUMBER(meta::Problem::Kind::kUnknownData, v1::PROBLEM_KIND_UNKNOWN_DATA);
CKPT_SAME_NUMBER(meta::Problem::Kind::kMemoryLow, v1::PROBLEM_KIND_MEMORY_LOW);
CKPT_SAME_NUMBER(meta::Problem::Kind::kTaskFailing, v1::PROBLEM_KIND_TASK_FAILING);
CKPT_SAME_NUMBER(meta::Problem::Kind::kPlacementImpossible,
                 v1::PROBLEM_KIND_PLACEMENT_IMPOSSIBLE);
#undef CKPT_SAME_NUMBER

static_assert(static_cast<int>(absl::StatusCode::kUnauthenticated) ==
              static_cast<int>(grpc::StatusCode::UNAUTHENTICATED));
static_assert(static_cast<int>(absl::StatusCode::kDataLoss) ==
              static_cast<int>(grpc::StatusCode::DATA_LOSS));

namespace {


// InvalidArgument for an enum number that is 0 or unknown; lists the names of
// the accepted values (1..max_known).
template <typename ProtoEnum>
absl::Status BadEnum(int value, int max_known, const std::string& field) {
  const google::protobuf::EnumDescriptor* desc = google::protobuf::GetEnumDescriptor<ProtoEnum>();
  std::string shown;
  if (const google::protobuf::EnumValueDescriptor* v = desc->FindValueByNumber(value);
      v != nullptr && value <= max_known) {
    shown = v->name();
  } else {
    shown = absl::StrCat(value, " (not a ", desc->name(), " this server knows)");
  }
  std::vector<std::string> allowed;
  for (int i = 0; i < desc->value_count(); ++i) {
    const int number = desc->value(i)->number();
    if (number >= 1 && number <= max_known) allowed.push_back(desc->value(i)->name());
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " is ", shown, "; set one of ", absl::StrJoin(allowed, ", ")));
}

// Values 1..max_known are the domain enum's (see the static_asserts above).
template <typename DomainEnum, typename ProtoEnum>
absl::StatusOr<DomainEnum> CheckedEnum(int value, DomainEnum max_known, const std::string& field) {
  const int max = static_cast<int>(max_known);
  if (value < 1 || value > max) return BadEnum<ProtoEnum>(value, max, field);
  return static_cast<DomainEnum>(value);
}

absl::StatusOr<int> ToInt(uint64_t value, const std::string& field) {
  if (value > static_cast<uint64_t>(INT_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is ", value, "; it must be at most ", INT_MAX));
  }
  return static_cast<int>(value);
}

absl::Status Missing(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, " is required: ", what));
}

int64_t Ms(absl::Duration d) { return absl::ToInt64Milliseconds(d); }

// The node's endpoint from the bundle, or just its id when the core did not
// resolve one (the agent then fails to reach it and reports UNAVAILABLE).
void EndpointFor(const meta::TaskBundle& bundle, const std::string& node_id,
                 v1::NodeEndpoint* out) {
  auto it = bundle.endpoints.find(node_id);
  if (it != bundle.endpoints.end()) {
    ToProto(it->second, out);
  } else {
    out->set_node_id(node_id);
  }
}

const meta::EcGroup* FindGroup(const meta::Version& v, int index) {
  for (const meta::EcGroup& g : v.plan.groups) {
    if (g.index == index) return &g;
  }
  return nullptr;
}

absl::Status TaskError(const meta::Task& task, const std::string& what) {
  return absl::InternalError(absl::StrCat("task ", task.id, " (", meta::TaskKindName(task.kind),
                                          " of ", task.job_id, "/", task.step, ") ", what));
}

void CopyToProto(const meta::Copy& copy, v1::ShardCopy* out) {
  out->set_node_id(copy.node_id);
  out->set_role(ToProto(copy.role));
  out->set_state(ToProto(copy.state));
  out->set_updated_unix_ms(copy.updated_ms);
  out->set_detail(copy.detail);
}

// Replica group numbers under group placement: the connected sets of the
// "protects" relation, numbered by first appearance in plan order.
std::map<std::string, int> ReplicaGroups(const meta::VersionPlan& plan) {
  std::map<std::string, int> index;  // node -> union-find slot
  std::vector<std::string> names;
  auto slot = [&](const std::string& id) {
    auto [it, inserted] = index.emplace(id, static_cast<int>(names.size()));
    if (inserted) names.push_back(id);
    return it->second;
  };
  for (const std::string& id : plan.nodes) slot(id);
  for (const auto& [src, targets] : plan.protectors) {
    slot(src);
    for (const std::string& t : targets) slot(t);
  }
  std::vector<int> parent(names.size());
  for (size_t i = 0; i < parent.size(); ++i) parent[i] = static_cast<int>(i);
  auto find = [&](int x) {
    while (parent[x] != x) x = parent[x] = parent[parent[x]];
    return x;
  };
  for (const auto& [src, targets] : plan.protectors) {
    for (const std::string& t : targets) {
      const int a = find(index[src]);
      const int b = find(index[t]);
      if (a != b) parent[std::max(a, b)] = std::min(a, b);
    }
  }
  // Number the components in slot order (plan order first).
  std::map<int, int> component_number;
  std::map<std::string, int> out;
  for (size_t i = 0; i < names.size(); ++i) {
    const int root = find(static_cast<int>(i));
    auto [it, inserted] =
        component_number.emplace(root, static_cast<int>(component_number.size()));
    out[names[i]] = it->second;
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------
// Status

// ---------------------------------------------------------------------------
// Enums

absl::StatusOr<meta::VersionState> VersionStateFromProto(int value, const std::string& field) {
  return CheckedEnum<meta::VersionState, v1::VersionState>(value, meta::VersionState::kDeleted,
                                                           field);
}
absl::StatusOr<meta::Level> LevelFromProto(int value, const std::string& field) {
  return CheckedEnum<meta::Level, v1::DurabilityLevel>(value, meta::Level::kPersisted, field);
}
absl::StatusOr<meta::NodeState> NodeStateFromProto(int value, const std::string& field) {
  return CheckedEnum<meta::NodeState, v1::NodeState>(value, meta::NodeState::kLeft, field);
}
absl::StatusOr<meta::NodeRole> NodeRoleFromProto(int value, const std::string& field) {
  return CheckedEnum<meta::NodeRole, v1::NodeRole>(value, meta::NodeRole::kDpu, field);
}
absl::StatusOr<meta::CopyRole> CopyRoleFromProto(int value, const std::string& field) {
  return CheckedEnum<meta::CopyRole, v1::CopyRole>(value, meta::CopyRole::kRestored, field);
}
absl::StatusOr<meta::CopyState> CopyStateFromProto(int value, const std::string& field) {
  return CheckedEnum<meta::CopyState, v1::CopyState>(value, meta::CopyState::kEvicted, field);
}
absl::StatusOr<meta::SegmentKind> SegmentKindFromProto(int value, const std::string& field) {
  return CheckedEnum<meta::SegmentKind, v1::SegmentKind>(value, meta::SegmentKind::kParity,
                                                         field);
}
absl::StatusOr<meta::ProtectionPolicy::Placement> PlacementFromProto(int value,
                                                                     const std::string& field) {
  switch (value) {
    case v1::REPLICA_PLACEMENT_RING:
      return meta::ProtectionPolicy::Placement::kRing;
    case v1::REPLICA_PLACEMENT_GROUP:
      return meta::ProtectionPolicy::Placement::kGroup;
    default:
      return BadEnum<v1::ReplicaPlacement>(value, v1::REPLICA_PLACEMENT_GROUP, field);
  }
}
absl::StatusOr<int> DTypeFromProto(int value, const std::string& field) {
  if (value == 0 || !v1::DType_IsValid(value)) {
    return BadEnum<v1::DType>(value, v1::DType_MAX, field);
  }
  return value;
}

v1::VersionState ToProto(meta::VersionState state) { return static_cast<v1::VersionState>(state); }
v1::DurabilityLevel ToProto(meta::Level level) { return static_cast<v1::DurabilityLevel>(level); }
v1::NodeState ToProto(meta::NodeState state) { return static_cast<v1::NodeState>(state); }
v1::NodeRole ToProto(meta::NodeRole role) { return static_cast<v1::NodeRole>(role); }
v1::CopyRole ToProto(meta::CopyRole role) { return static_cast<v1::CopyRole>(role); }
v1::CopyState ToProto(meta::CopyState state) { return static_cast<v1::CopyState>(state); }
v1::SegmentKind ToProto(meta::SegmentKind kind) { return static_cast<v1::SegmentKind>(kind); }
v1::SourceKind ToProto(meta::SourceKind kind) { return static_cast<v1::SourceKind>(kind); }
v1::ReplicaPlacement ToProto(meta::ProtectionPolicy::Placement placement) {
  return placement == meta::ProtectionPolicy::Placement::kGroup ? v1::REPLICA_PLACEMENT_GROUP
                                                                : v1::REPLICA_PLACEMENT_RING;
}
v1::TaskDisposition ToProto(meta::TaskDisposition disposition) {
  return static_cast<v1::TaskDisposition>(disposition);
}
v1::InventoryAction ToProto(meta::InventoryDecision::Action action) {
  return static_cast<v1::InventoryAction>(action);
}
v1::ProblemKind ToProto(meta::Problem::Kind kind) { return static_cast<v1::ProblemKind>(kind); }

// ---------------------------------------------------------------------------
// Policies and jobs

absl::StatusOr<meta::ProtectionPolicy> PolicyFromProto(const v1::ProtectionPolicy& policy,
                                                       const std::string& field) {
  switch (policy.kind_case()) {
    case v1::ProtectionPolicy::kNone:
      return meta::ProtectionPolicy::None();
    case v1::ProtectionPolicy::kReplicate: {
      const v1::ReplicatePolicy& r = policy.replicate();
      absl::StatusOr<int> copies = ToInt(r.copies(), field + ".replicate.copies");
      if (!copies.ok()) return copies.status();
      absl::StatusOr<meta::ProtectionPolicy::Placement> placement =
          PlacementFromProto(r.placement(), field + ".replicate.placement");
      if (!placement.ok()) return placement.status();
      return meta::ProtectionPolicy::Replicate(*copies, *placement);
    }
    case v1::ProtectionPolicy::kEc: {
      const v1::ErasureCodePolicy& e = policy.ec();
      absl::StatusOr<int> k = ToInt(e.data_k(), field + ".ec.data_k");
      if (!k.ok()) return k.status();
      absl::StatusOr<int> m = ToInt(e.parity_m(), field + ".ec.parity_m");
      if (!m.ok()) return m.status();
      return meta::ProtectionPolicy::ErasureCode(*k, *m);
    }
    case v1::ProtectionPolicy::KIND_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " has no kind: set exactly one of ", field, ".none, ", field,
                   ".replicate {copies, placement} or ", field, ".ec {data_k, parity_m}"));
}

void ToProto(const meta::ProtectionPolicy& policy, v1::ProtectionPolicy* out) {
  switch (policy.kind) {
    case meta::ProtectionPolicy::Kind::kNone:
      out->mutable_none();
      return;
    case meta::ProtectionPolicy::Kind::kReplicate: {
      v1::ReplicatePolicy* r = out->mutable_replicate();
      r->set_copies(static_cast<uint32_t>(std::max(policy.copies, 0)));
      r->set_placement(ToProto(policy.placement));
      return;
    }
    case meta::ProtectionPolicy::Kind::kErasureCode: {
      v1::ErasureCodePolicy* e = out->mutable_ec();
      e->set_data_k(static_cast<uint32_t>(std::max(policy.data_k, 0)));
      e->set_parity_m(static_cast<uint32_t>(std::max(policy.parity_m, 0)));
      return;
    }
  }
}

absl::StatusOr<meta::JobRequest> JobRequestFromProto(const v1::JobSpec& spec,
                                                     const std::string& field) {
  meta::JobRequest out;
  out.job_id = spec.job_id();
  out.world_size = spec.world_size();
  if (spec.has_protection()) {
    absl::StatusOr<meta::ProtectionPolicy> policy =
        PolicyFromProto(spec.protection(), field + ".protection");
    if (!policy.ok()) return policy.status();
    out.protection = *policy;
  }
  if (spec.flush().every_n_versions() != 0 || spec.flush().every_seconds() != 0) {
    out.flush = meta::FlushPolicy{spec.flush().every_n_versions(), spec.flush().every_seconds()};
  }
  if (spec.retention().keep_in_memory() != 0 || spec.retention().keep_durable() != 0) {
    meta::RetentionPolicy r;
    r.keep_in_memory = spec.retention().keep_in_memory();
    r.keep_durable = spec.retention().keep_durable();
    out.retention = r;
  }
  for (const auto& [k, v] : spec.labels()) out.labels.emplace(k, v);
  return out;
}

void ToProto(const meta::JobSpec& spec, v1::JobSpec* out) {
  out->set_job_id(spec.job_id);
  out->set_world_size(spec.world_size);
  ToProto(spec.protection, out->mutable_protection());
  out->mutable_flush()->set_every_n_versions(spec.flush.every_n_versions);
  out->mutable_flush()->set_every_seconds(spec.flush.every_seconds);
  out->mutable_retention()->set_keep_in_memory(spec.retention.EffectiveKeepInMemory());
  out->mutable_retention()->set_keep_durable(spec.retention.keep_durable);
  for (const auto& [k, v] : spec.labels) (*out->mutable_labels())[k] = v;
}

void ToProto(const meta::JobView& view, v1::JobInfo* out) {
  ToProto(view.job.spec, out->mutable_spec());
  out->set_created_unix_ms(view.job.created_ms);
  out->set_plan_epoch(view.job.plan_epoch);
  if (view.latest_staged) out->set_latest_staged_step(*view.latest_staged);
  if (view.latest_protected) out->set_latest_protected_step(*view.latest_protected);
  if (view.latest_persisted) out->set_latest_persisted_step(*view.latest_persisted);
  for (const auto& [state, count] : view.version_counts) {
    if (count == 0) continue;
    v1::VersionStateCount* c = out->add_version_counts();
    c->set_state(ToProto(state));
    c->set_count(count);
  }
  out->set_memory_bytes(view.memory_bytes);
  out->set_durable_bytes(view.durable_bytes);
  out->set_deleting(view.job.deleting);
}

// ---------------------------------------------------------------------------
// Nodes

void ToProto(const meta::Endpoint& endpoint, v1::NodeEndpoint* out) {
  out->set_node_id(endpoint.node_id);
  out->set_incarnation(endpoint.incarnation);
  out->set_grpc_address(endpoint.grpc_address);
  out->set_data_address(endpoint.data_address);
  out->set_state(ToProto(endpoint.state));
}

void ToProto(const meta::Node& node, v1::NodeInfo* out) {
  v1::NodeEndpoint* e = out->mutable_endpoint();
  e->set_node_id(node.id);
  e->set_incarnation(node.incarnation);
  e->set_grpc_address(node.grpc_address);
  e->set_data_address(node.data_address);
  e->set_state(ToProto(node.state));
  out->set_role(ToProto(node.role));
  out->set_state(ToProto(node.state));
  out->set_failure_domain(node.failure_domain);
  out->set_memory_capacity_bytes(node.memory_capacity_bytes);
  out->set_memory_used_bytes(node.memory_used_bytes);
  out->set_memory_free_bytes(node.memory_free_bytes);
  out->set_flush_lag_bytes(node.flush_lag_bytes);
  out->set_flush_lag_ms(node.flush_lag_ms);
  out->set_registered_unix_ms(node.registered_ms);
  out->set_last_heartbeat_unix_ms(node.last_heartbeat_ms);
  out->set_lease_expiry_unix_ms(node.lease_expiry_ms);
  out->set_agent_version(node.agent_version);
  out->set_pending_tasks(node.pending_tasks);
  out->set_first_seen_unix_ms(node.first_seen_ms);
  out->set_failures(node.failures);
  out->set_drained(node.drained);
  out->set_host_node_id(node.host_node_id);
}

absl::StatusOr<meta::RegisterRequest> RegisterFromProto(const v1::RegisterNodeRequest& req) {
  meta::RegisterRequest out;
  out.node_id = req.node_id();
  out.grpc_address = req.grpc_address();
  out.data_address = req.data_address();
  absl::StatusOr<meta::NodeRole> role = NodeRoleFromProto(req.role(), "role");
  if (!role.ok()) return role.status();
  out.role = *role;
  out.memory_capacity_bytes = req.memory_capacity_bytes();
  out.failure_domain = req.failure_domain();
  out.agent_version = req.agent_version();
  out.previous_incarnation = req.previous_incarnation();
  out.host_node_id = req.host_node_id();
  if (out.role == meta::NodeRole::kDpu) {
    if (absl::Status s = ValidateHostNodeId(out.node_id, out.host_node_id, "host_node_id"); !s.ok()) return s;
  } else if (!out.host_node_id.empty()) {
    return absl::InvalidArgumentError("host_node_id is only for a DPU agent (role NODE_ROLE_DPU)");
  }
  return out;
}

void ToProto(const meta::RegisterResult& result, v1::RegisterNodeResponse* out) {
  out->set_incarnation(result.incarnation);
  out->set_lease_ms(Ms(result.lease));
  out->set_heartbeat_interval_ms(Ms(result.heartbeat_interval));
  out->set_meta_instance_id(result.meta_instance_id);
  out->set_data_plane_key(result.data_plane_key);
}

meta::HeartbeatRequest HeartbeatFromProto(const v1::HeartbeatRequest& req) {
  meta::HeartbeatRequest out;
  out.node_id = req.node_id();
  out.incarnation = req.incarnation();
  out.memory_capacity_bytes = req.memory_capacity_bytes();
  out.memory_used_bytes = req.memory_used_bytes();
  out.memory_free_bytes = req.memory_free_bytes();
  out.memory_leased_bytes = req.memory_leased_bytes();
  out.flush_lag_bytes = req.flush_lag_bytes();
  out.flush_lag_ms = req.flush_lag_ms();
  out.flush_errors_total = req.flush_errors_total();
  out.membership_generation = req.membership_generation();
  out.stopping = req.stopping();
  out.running_tasks.reserve(req.running_tasks_size());
  for (const v1::TaskProgress& p : req.running_tasks()) {
    meta::TaskProgress t;
    t.task_id = p.task_id();
    t.attempt = p.attempt();
    t.bytes_done = p.bytes_done();
    t.bytes_total = p.bytes_total();
    out.running_tasks.push_back(std::move(t));
  }
  return out;
}

// ---------------------------------------------------------------------------
// Shards, items, segments, holdings

absl::StatusOr<meta::Item> ItemFromProto(const v1::Item& item, const std::string& field) {
  meta::Item out;
  out.name = item.name();
  absl::StatusOr<int> dtype = DTypeFromProto(item.dtype(), field + ".dtype");
  if (!dtype.ok()) return dtype.status();
  out.dtype = *dtype;
  out.shape.assign(item.shape().begin(), item.shape().end());
  out.offset_bytes = item.offset_bytes();
  out.length_bytes = item.length_bytes();
  out.crc32c = item.crc32c();
  for (const auto& [k, v] : item.attributes()) out.attributes.emplace(k, v);
  if (item.has_ref_step()) {
    if (item.ref_step() > static_cast<uint64_t>(INT64_MAX)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".ref_step ", item.ref_step(), " is out of range"));
    }
    out.ref_step = static_cast<int64_t>(item.ref_step());
  }
  return out;
}

void ToProto(const meta::Item& item, v1::Item* out) {
  out->set_name(item.name);
  out->set_dtype(static_cast<v1::DType>(item.dtype));
  for (uint64_t d : item.shape) out->add_shape(d);
  out->set_offset_bytes(item.offset_bytes);
  out->set_length_bytes(item.length_bytes);
  out->set_crc32c(item.crc32c);
  for (const auto& [k, v] : item.attributes) (*out->mutable_attributes())[k] = v;
  if (item.ref_step >= 0) out->set_ref_step(static_cast<uint64_t>(item.ref_step));
}

void ShardInfoToProto(const std::string& job_id, uint64_t step, const meta::Shard& shard,
                      bool include_items, v1::ShardInfo* out) {
  v1::ShardKey* key = out->mutable_key();
  key->set_job_id(job_id);
  key->set_step(step);
  key->set_rank(shard.rank);
  out->set_size_bytes(shard.size_bytes);
  out->set_crc32c(shard.crc32c);
  out->set_manifest_digest(shard.manifest_digest);
  if (include_items) {
    out->mutable_items()->Reserve(static_cast<int>(shard.items.size()));
    for (const meta::Item& item : shard.items) ToProto(item, out->add_items());
  }
  out->set_primary_node_id(shard.primary_node_id);
  out->set_staged_unix_ms(shard.staged_ms);
}

absl::StatusOr<meta::SegmentKey> SegmentKeyFromProto(const v1::SegmentKey& key,
                                                     const std::string& field) {
  meta::SegmentKey out;
  absl::StatusOr<int> group = ToInt(key.group_index(), field + ".group_index");
  if (!group.ok()) return group.status();
  absl::StatusOr<int> stripe = ToInt(key.stripe_index(), field + ".stripe_index");
  if (!stripe.ok()) return stripe.status();
  absl::StatusOr<int> position = ToInt(key.position(), field + ".position");
  if (!position.ok()) return position.status();
  out.group = *group;
  out.stripe = *stripe;
  out.position = *position;
  return out;
}

void SegmentKeyToProto(const std::string& job_id, uint64_t step, const meta::SegmentKey& key,
                       v1::SegmentKey* out) {
  out->set_job_id(job_id);
  out->set_step(step);
  out->set_group_index(static_cast<uint32_t>(key.group));
  out->set_stripe_index(static_cast<uint32_t>(key.stripe));
  out->set_position(static_cast<uint32_t>(key.position));
}

void SegmentToProto(const std::string& job_id, uint64_t step, const meta::Segment& segment,
                    v1::SegmentInfo* out) {
  SegmentKeyToProto(job_id, step, segment.key, out->mutable_key());
  out->set_kind(ToProto(segment.kind));
  out->set_owner_node_id(segment.owner_node_id);
  out->set_blob_segment_index(static_cast<uint32_t>(segment.blob_segment));
  out->set_length_bytes(segment.length_bytes);
  out->set_crc32c(segment.crc32c);
  out->set_holder_node_id(segment.holder_node_id);
  out->set_state(ToProto(segment.state));
  out->set_updated_unix_ms(segment.updated_ms);
  out->set_detail(segment.detail);
}

absl::StatusOr<meta::ShardReport> ShardReportFromProto(const v1::ShardReport& report,
                                                       const std::string& field) {
  meta::ShardReport out;
  switch (report.report_case()) {
    case v1::ShardReport::kStaged: {
      const v1::StagedReport& r = report.staged();
      const std::string f = field + ".staged";
      if (!r.has_shard()) return Missing(f + ".shard", "the staged shard's key, size and crc32c");
      const v1::ShardInfo& shard = r.shard();
      if (!shard.has_key()) return Missing(f + ".shard.key", "job_id, step and rank");
      out.kind = meta::ShardReport::Kind::kStaged;
      meta::StagedReport& s = out.staged;
      s.job_id = shard.key().job_id();
      s.step = shard.key().step();
      s.shard.rank = shard.key().rank();
      s.shard.size_bytes = shard.size_bytes();
      s.shard.crc32c = shard.crc32c();
      s.shard.manifest_digest = shard.manifest_digest();
      s.shard.items.reserve(shard.items_size());
      for (int i = 0; i < shard.items_size(); ++i) {
        absl::StatusOr<meta::Item> item =
            ItemFromProto(shard.items(i), absl::StrCat(f, ".shard.items[", i, "]"));
        if (!item.ok()) return item.status();
        s.shard.items.push_back(*std::move(item));
      }
      s.shard.primary_node_id = shard.primary_node_id();
      s.shard.staged_ms = shard.staged_unix_ms();
      s.run_id = r.run_id();
      return out;
    }
    case v1::ShardReport::kCopy: {
      const v1::CopyReport& r = report.copy();
      const std::string f = field + ".copy";
      if (!r.has_key()) return Missing(f + ".key", "job_id, step and rank");
      out.kind = meta::ShardReport::Kind::kCopy;
      meta::CopyReport& c = out.copy;
      c.job_id = r.key().job_id();
      c.step = r.key().step();
      c.rank = r.key().rank();
      absl::StatusOr<meta::CopyRole> role = CopyRoleFromProto(r.role(), f + ".role");
      if (!role.ok()) return role.status();
      c.role = *role;
      absl::StatusOr<meta::CopyState> state = CopyStateFromProto(r.state(), f + ".state");
      if (!state.ok()) return state.status();
      c.state = *state;
      c.size_bytes = r.size_bytes();
      c.crc32c = r.crc32c();
      c.task_id = r.task_id();
      c.detail = r.detail();
      return out;
    }
    case v1::ShardReport::kSegment: {
      const v1::SegmentReport& r = report.segment();
      const std::string f = field + ".segment";
      if (!r.has_key()) {
        return Missing(f + ".key", "job_id, step, group_index, stripe_index and position");
      }
      out.kind = meta::ShardReport::Kind::kSegment;
      meta::SegmentReport& s = out.segment;
      s.job_id = r.key().job_id();
      s.step = r.key().step();
      absl::StatusOr<meta::SegmentKey> key = SegmentKeyFromProto(r.key(), f + ".key");
      if (!key.ok()) return key.status();
      s.key = *key;
      absl::StatusOr<meta::SegmentKind> kind = SegmentKindFromProto(r.kind(), f + ".kind");
      if (!kind.ok()) return kind.status();
      s.kind = *kind;
      absl::StatusOr<meta::CopyState> state = CopyStateFromProto(r.state(), f + ".state");
      if (!state.ok()) return state.status();
      s.state = *state;
      s.length_bytes = r.length_bytes();
      s.crc32c = r.crc32c();
      s.task_id = r.task_id();
      s.detail = r.detail();
      return out;
    }
    case v1::ShardReport::kPersisted: {
      const v1::PersistedReport& r = report.persisted();
      const std::string f = field + ".persisted";
      if (!r.has_key()) return Missing(f + ".key", "job_id, step and rank");
      out.kind = meta::ShardReport::Kind::kPersisted;
      meta::PersistedReport& p = out.persisted;
      p.job_id = r.key().job_id();
      p.step = r.key().step();
      p.rank = r.key().rank();
      p.durable_path = r.durable_path();
      p.size_bytes = r.size_bytes();
      p.crc32c = r.crc32c();
      p.task_id = r.task_id();
      return out;
    }
    case v1::ShardReport::REPORT_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " has no report: set exactly one of staged, copy, segment or persisted"));
}

absl::StatusOr<meta::Holding> HoldingFromProto(const v1::InventoryEntry& entry,
                                               const std::string& field) {
  meta::Holding out;
  switch (entry.what_case()) {
    case v1::InventoryEntry::kShard: {
      out.is_segment = false;
      out.job_id = entry.shard().job_id();
      out.step = entry.shard().step();
      out.rank = entry.shard().rank();
      absl::StatusOr<meta::CopyRole> role = CopyRoleFromProto(entry.role(), field + ".role");
      if (!role.ok()) return role.status();
      out.role = *role;
      break;
    }
    case v1::InventoryEntry::kSegment: {
      out.is_segment = true;
      out.job_id = entry.segment().job_id();
      out.step = entry.segment().step();
      absl::StatusOr<meta::SegmentKey> key = SegmentKeyFromProto(entry.segment(), field + ".segment");
      if (!key.ok()) return key.status();
      out.segment = *key;
      absl::StatusOr<meta::SegmentKind> kind =
          SegmentKindFromProto(entry.segment_kind(), field + ".segment_kind");
      if (!kind.ok()) return kind.status();
      out.kind = *kind;
      break;
    }
    case v1::InventoryEntry::WHAT_NOT_SET:
      return absl::InvalidArgumentError(
          absl::StrCat(field, " holds nothing: set exactly one of shard or segment"));
  }
  out.size_bytes = entry.size_bytes();
  out.crc32c = entry.crc32c();
  out.manifest_digest = entry.manifest_digest();
  absl::StatusOr<meta::CopyState> state = CopyStateFromProto(entry.state(), field + ".state");
  if (!state.ok()) return state.status();
  out.state = *state;
  out.stored_ms = entry.stored_unix_ms();
  out.durable_path = entry.durable_path();
  return out;
}

void ToProto(const meta::Holding& holding, v1::InventoryEntry* out) {
  if (holding.is_segment) {
    SegmentKeyToProto(holding.job_id, holding.step, holding.segment, out->mutable_segment());
    out->set_segment_kind(ToProto(holding.kind));
  } else {
    v1::ShardKey* key = out->mutable_shard();
    key->set_job_id(holding.job_id);
    key->set_step(holding.step);
    key->set_rank(holding.rank);
    out->set_role(ToProto(holding.role));
  }
  out->set_size_bytes(holding.size_bytes);
  out->set_crc32c(holding.crc32c);
  out->set_manifest_digest(holding.manifest_digest);
  out->set_state(ToProto(holding.state));
  out->set_stored_unix_ms(holding.stored_ms);
  out->set_durable_path(holding.durable_path);
}

void ToProto(const meta::InventoryResult& result, v1::ReportInventoryResponse* out) {
  for (const meta::InventoryDecision& d : result.decisions) {
    v1::InventoryDecision* p = out->add_decisions();
    ToProto(d.holding, p->mutable_entry());
    p->set_action(ToProto(d.action));
    p->set_reason(d.reason);
  }
  out->set_kept(result.kept);
  for (const meta::Holding& h : result.missing) ToProto(h, out->add_missing());
}

// ---------------------------------------------------------------------------
// Plans, layouts, versions

absl::Status EcGroupToProto(const meta::EcGroup& group, v1::EcGroupLayout* out) {
  out->set_group_index(static_cast<uint32_t>(group.index));
  for (const std::string& id : group.members) out->add_node_ids(id);
  out->set_data_k(static_cast<uint32_t>(std::max(group.data_k, 0)));
  out->set_parity_m(static_cast<uint32_t>(std::max(group.parity_m, 0)));
  absl::StatusOr<meta::StripeLayout> layout = meta::StripeLayout::Create(
      static_cast<int>(group.members.size()), group.data_k, group.parity_m);
  if (!layout.ok()) {
    return absl::InternalError(absl::StrCat("EC group ", group.index, " (",
                                            group.members.size(), " members, k=", group.data_k,
                                            ", m=", group.parity_m,
                                            ") has no stripe layout: ", layout.status().message()));
  }
  const std::vector<meta::EcStripe>& stripes = layout->stripes();
  for (size_t s = 0; s < stripes.size(); ++s) {
    v1::EcStripeLayout* stripe = out->add_stripes();
    stripe->set_stripe_index(static_cast<uint32_t>(s));
    for (const meta::DataSlot& slot : stripes[s].data) {
      stripe->add_data_node_ids(group.members[static_cast<size_t>(slot.member)]);
      stripe->add_data_segment_indices(static_cast<uint32_t>(slot.segment));
    }
    for (int member : stripes[s].parity_members) {
      stripe->add_parity_node_ids(group.members[static_cast<size_t>(member)]);
    }
  }
  return absl::OkStatus();
}

void ToProto(const meta::NodeBlob& blob, v1::NodeBlob* out) {
  out->set_node_id(blob.node_id);
  for (const meta::BlobPart& part : blob.parts) {
    v1::BlobPart* p = out->add_parts();
    p->set_rank(part.rank);
    p->set_blob_offset_bytes(part.blob_offset_bytes);
    p->set_size_bytes(part.size_bytes);
  }
  out->set_size_bytes(blob.size_bytes);
  out->set_segment_bytes(blob.segment_bytes);
}

absl::Status PlanToProto(const std::string& job_id, const meta::VersionPlan& plan,
                         int64_t created_ms, v1::PlacementPlan* out) {
  out->set_job_id(job_id);
  out->set_plan_epoch(plan.epoch);
  ToProto(plan.policy, out->mutable_policy());
  for (const std::string& id : plan.nodes) out->add_node_ids(id);
  out->set_created_unix_ms(created_ms);

  if (plan.policy.kind == meta::ProtectionPolicy::Kind::kReplicate) {
    const bool group_placement =
        plan.policy.placement == meta::ProtectionPolicy::Placement::kGroup;
    std::map<std::string, int> groups;
    if (group_placement) groups = ReplicaGroups(plan);
    auto add_set = [&](const std::string& source, const std::vector<std::string>& targets,
                       int position) {
      v1::ReplicaSet* set = out->add_replica_sets();
      set->set_source_node_id(source);
      for (const std::string& t : targets) set->add_target_node_ids(t);
      set->set_group_index(static_cast<uint32_t>(group_placement ? groups[source] : position));
    };
    // Plan order first, then (defensively) any source the node list lacks.
    std::map<std::string, int> position;
    for (size_t i = 0; i < plan.nodes.size(); ++i) {
      position.emplace(plan.nodes[i], static_cast<int>(i));
      auto it = plan.protectors.find(plan.nodes[i]);
      if (it != plan.protectors.end()) add_set(it->first, it->second, static_cast<int>(i));
    }
    for (const auto& [source, targets] : plan.protectors) {
      if (position.count(source) == 0) {
        add_set(source, targets, static_cast<int>(plan.nodes.size()));
      }
    }
  }
  for (const meta::EcGroup& group : plan.groups) {
    absl::Status s = EcGroupToProto(group, out->add_ec_groups());
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

void VersionSummaryToProto(const meta::Version& version, v1::VersionInfo* out) {
  out->set_job_id(version.job_id);
  out->set_step(version.step);
  out->set_state(ToProto(version.state));
  out->set_world_size(version.world_size);
  out->set_shards_staged(static_cast<uint32_t>(version.shards.size()));
  out->set_total_bytes(version.TotalBytes());
  out->set_plan_epoch(version.plan.epoch);
  out->set_flush_planned(version.flush_planned);
  out->set_created_unix_ms(version.created_ms);
  out->set_staged_unix_ms(version.staged_ms);
  out->set_protected_unix_ms(version.protected_ms);
  out->set_persisted_unix_ms(version.persisted_ms);
  out->set_ended_unix_ms(version.ended_ms);
  out->set_abort_reason(version.abort_reason);
  out->set_durable_dir(version.durable_dir);
  out->set_run_id(version.run_id);
}

absl::Status VersionDetailToProto(const meta::Version& version, bool include_items,
                                  v1::VersionInfo* out) {
  VersionSummaryToProto(version, out);
  out->mutable_shards()->Reserve(static_cast<int>(version.shards.size()));
  for (const auto& [rank, shard] : version.shards) {
    v1::ShardDetail* detail = out->add_shards();
    ShardInfoToProto(version.job_id, version.step, shard, include_items, detail->mutable_info());
    for (const meta::Copy& copy : shard.copies) CopyToProto(copy, detail->add_copies());
    if (!shard.durable_path.empty()) {
      v1::DurableCopy* durable = detail->mutable_durable();
      durable->set_path(shard.durable_path);
      durable->set_written(shard.durable_written);
      durable->set_written_unix_ms(shard.durable_written_ms);
    }
  }
  if (version.plan.policy.kind == meta::ProtectionPolicy::Kind::kErasureCode) {
    v1::EcLayout* layout = out->mutable_ec_layout();
    for (const meta::EcGroup& group : version.plan.groups) {
      absl::Status s = EcGroupToProto(group, layout->add_groups());
      if (!s.ok()) {
        return absl::Status(s.code(), absl::StrCat("version ", version.job_id, "/", version.step,
                                                   ": ", s.message()));
      }
    }
    for (const meta::NodeBlob& blob : version.blobs) ToProto(blob, layout->add_blobs());
  }
  out->mutable_segments()->Reserve(static_cast<int>(version.segments.size()));
  for (const meta::Segment& segment : version.segments) {
    SegmentToProto(version.job_id, version.step, segment, out->add_segments());
  }
  return absl::OkStatus();
}

void ToProto(const meta::SurvivalEstimate& estimate, v1::SurvivalEstimate* out) {
  out->set_failures(static_cast<uint32_t>(std::max(estimate.failures, 0)));
  out->set_probability(estimate.probability);
  out->set_exact(estimate.exact);
  if (estimate.method == meta::SurvivalMethod::kMonteCarlo) {
    out->set_samples(estimate.evaluated);
    out->set_seed(estimate.seed);
  }
}

absl::StatusOr<meta::SurvivalOptions> SurvivalOptionsFromProto(
    const v1::GetPlacementRequest& req) {
  meta::SurvivalOptions out;
  switch (req.method()) {
    case v1::SURVIVAL_METHOD_UNSPECIFIED:
      out.method = meta::SurvivalMethod::kAuto;
      out.exact_limit = kAutoExactLimit;
      break;
    case v1::SURVIVAL_METHOD_EXACT:
      out.method = meta::SurvivalMethod::kStructured;
      break;
    case v1::SURVIVAL_METHOD_MONTE_CARLO:
      out.method = meta::SurvivalMethod::kMonteCarlo;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "method is ", static_cast<int>(req.method()),
          " (not a SurvivalMethod this server knows); set SURVIVAL_METHOD_UNSPECIFIED (server "
          "chooses), SURVIVAL_METHOD_EXACT or SURVIVAL_METHOD_MONTE_CARLO"));
  }
  out.seed = req.seed() == 0 ? kDefaultSurvivalSeed : req.seed();
  out.samples = req.samples() == 0 ? kDefaultSurvivalSamples : req.samples();
  return out;
}

absl::Status ToProto(const meta::PlacementView& view, v1::GetPlacementResponse* out) {
  absl::Status s = PlanToProto(view.job_id, view.plan, view.created_ms, out->mutable_plan());
  if (!s.ok()) return s;
  for (const meta::SurvivalEstimate& e : view.survival) ToProto(e, out->add_survival());
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Restore sources

void SourceToProto(const std::string& job_id, uint64_t step, const meta::Source& source,
                   v1::ShardSource* out) {
  out->set_kind(ToProto(source.kind));
  switch (source.kind) {
    case meta::SourceKind::kLocal:
    case meta::SourceKind::kReplica:
      ToProto(source.holder, out->mutable_holder());
      out->set_role(ToProto(source.role));
      break;
    case meta::SourceKind::kEcDecode: {
      const meta::EcDecodeSource& ec = source.ec;
      v1::EcDecodeSource* e = out->mutable_ec();
      e->set_group_index(ec.group_index);
      e->set_data_k(ec.data_k);
      e->set_parity_m(ec.parity_m);
      e->set_owner_node_id(ec.owner_node_id);
      e->set_blob_offset_bytes(ec.blob_offset_bytes);
      e->set_segment_bytes(ec.segment_bytes);
      for (const meta::EcStripeSource& st : ec.stripes) {
        v1::EcStripeSource* p = e->add_stripes();
        p->set_stripe_index(st.stripe_index);
        p->set_blob_segment_index(st.blob_segment_index);
        p->set_position(st.position);
        p->set_stripe_length_bytes(st.stripe_length_bytes);
        for (const meta::SegmentLocation& loc : st.segments) {
          v1::SegmentLocation* l = p->add_segments();
          SegmentKeyToProto(job_id, step, loc.key, l->mutable_key());
          l->set_kind(ToProto(loc.kind));
          l->set_length_bytes(loc.length_bytes);
          l->set_crc32c(loc.crc32c);
          ToProto(loc.holder, l->mutable_holder());
        }
      }
      break;
    }
    case meta::SourceKind::kDurable:
      out->set_durable_path(source.durable_path);
      break;
  }
}

void ToProto(const std::string& job_id, uint64_t step, const meta::LocateResult& result,
             v1::LocateResponse* out, bool include_items) {
  ShardInfoToProto(job_id, step, result.shard, include_items, out->mutable_shard());
  for (const meta::Source& source : result.sources) {
    SourceToProto(job_id, step, source, out->add_sources());
  }
}

// ---------------------------------------------------------------------------
// Tasks

absl::Status TaskToProto(const meta::TaskBundle& bundle, v1::Task* out) {
  const meta::Task& task = bundle.task;
  out->set_task_id(task.id);
  out->set_attempt(task.attempt);
  out->set_created_unix_ms(task.created_ms);
  out->set_timeout_ms(task.timeout_ms);
  out->set_priority(task.priority);

  const meta::Version* version = bundle.version ? &*bundle.version : nullptr;
  auto need_version = [&]() -> absl::Status {
    if (version == nullptr) return TaskError(task, "has no version in its bundle");
    return absl::OkStatus();
  };

  switch (task.kind) {
    case meta::TaskKind::kReplicate: {
      v1::ReplicateTask* r = out->mutable_replicate();
      r->set_job_id(task.job_id);
      r->set_step(task.step);
      for (uint32_t rank : task.ranks) r->add_ranks(rank);
      for (const std::string& target : task.targets) EndpointFor(bundle, target, r->add_targets());
      return absl::OkStatus();
    }
    case meta::TaskKind::kEcEncode: {
      if (absl::Status s = need_version(); !s.ok()) return s;
      const meta::EcGroup* group = FindGroup(*version, task.group);
      if (group == nullptr) {
        return TaskError(task, absl::StrCat("names EC group ", task.group,
                                            " which the version's plan does not have"));
      }
      v1::EcEncodeTask* e = out->mutable_ec_encode();
      e->set_job_id(task.job_id);
      e->set_step(task.step);
      if (absl::Status s = EcGroupToProto(*group, e->mutable_group()); !s.ok()) {
        return TaskError(task, std::string(s.message()));
      }
      for (const std::string& member : group->members) {
        auto blob = std::find_if(version->blobs.begin(), version->blobs.end(),
                                 [&](const meta::NodeBlob& b) { return b.node_id == member; });
        if (blob != version->blobs.end()) {
          ToProto(*blob, e->add_blobs());
        } else {
          e->add_blobs()->set_node_id(member);  // no ranks: an empty blob
        }
        EndpointFor(bundle, member, e->add_members());
      }
      return absl::OkStatus();
    }
    case meta::TaskKind::kRebuildSegments: {
      if (absl::Status s = need_version(); !s.ok()) return s;
      v1::RebuildSegmentsTask* r = out->mutable_rebuild_segments();
      r->set_job_id(task.job_id);
      r->set_step(task.step);
      int k = version->plan.policy.data_k;
      int m = version->plan.policy.parity_m;
      if (!task.segments.empty()) {
        if (const meta::EcGroup* g = FindGroup(*version, task.segments.front().group)) {
          k = g->data_k;
          m = g->parity_m;
        }
      }
      r->set_data_k(static_cast<uint32_t>(std::max(k, 0)));
      r->set_parity_m(static_cast<uint32_t>(std::max(m, 0)));
      // Segments by (group, stripe), in position order (data before parity).
      std::map<std::pair<int, int>, std::vector<const meta::Segment*>> stripes;
      for (const meta::Segment& seg : version->segments) {
        stripes[{seg.key.group, seg.key.stripe}].push_back(&seg);
      }
      for (auto& [key, segs] : stripes) {
        std::sort(segs.begin(), segs.end(), [](const meta::Segment* a, const meta::Segment* b) {
          return a->key.position < b->key.position;
        });
      }
      for (const meta::SegmentKey& target : task.segments) {
        auto it = stripes.find({target.group, target.stripe});
        const meta::Segment* seg = nullptr;
        if (it != stripes.end()) {
          for (const meta::Segment* s : it->second) {
            if (s->key == target) seg = s;
          }
        }
        if (seg == nullptr) {
          return TaskError(task, absl::StrCat("names segment (group ", target.group, ", stripe ",
                                              target.stripe, ", position ", target.position,
                                              ") which the version does not have"));
        }
        v1::SegmentRebuild* sr = r->add_segments();
        SegmentKeyToProto(task.job_id, task.step, target, sr->mutable_target());
        sr->set_kind(ToProto(seg->kind));
        sr->set_length_bytes(seg->length_bytes);
        uint64_t stripe_length = 0;
        for (const meta::Segment* s : it->second) stripe_length = std::max(stripe_length, s->length_bytes);
        sr->set_stripe_length_bytes(stripe_length);
        if (seg->crc_known || seg->crc32c != 0) sr->set_expected_crc32c(seg->crc32c);
        // The core chose the sources (usable holders, SUSPECT ones last).
        auto sources = bundle.segment_sources.find(target);
        if (sources == bundle.segment_sources.end()) continue;
        for (const meta::SegmentLocation& src : sources->second) {
          v1::SegmentLocation* loc = sr->add_sources();
          SegmentKeyToProto(task.job_id, task.step, src.key, loc->mutable_key());
          loc->set_kind(ToProto(src.kind));
          loc->set_length_bytes(src.length_bytes);
          loc->set_crc32c(src.crc32c);
          ToProto(src.holder, loc->mutable_holder());
        }
      }
      return absl::OkStatus();
    }
    case meta::TaskKind::kFlush: {
      if (absl::Status s = need_version(); !s.ok()) return s;
      v1::FlushTask* f = out->mutable_flush();
      f->set_job_id(task.job_id);
      f->set_step(task.step);
      f->set_durable_dir(version->durable_dir);
      for (uint32_t rank : task.ranks) {
        auto shard = version->shards.find(rank);
        if (shard == version->shards.end()) {
          return TaskError(task, absl::StrCat("names rank ", rank, " which is not staged"));
        }
        v1::FlushShard* fs = f->add_shards();
        fs->set_rank(rank);
        fs->set_durable_path(shard->second.durable_path);
        fs->set_size_bytes(shard->second.size_bytes);
        fs->set_crc32c(shard->second.crc32c);
        auto sources = bundle.sources.find(rank);
        if (sources != bundle.sources.end()) {
          for (const meta::Source& src : sources->second) {
            SourceToProto(task.job_id, task.step, src, fs->add_sources());
          }
        }
      }
      return absl::OkStatus();
    }
    case meta::TaskKind::kCommitDurable: {
      if (absl::Status s = need_version(); !s.ok()) return s;
      v1::CommitDurableTask* c = out->mutable_commit_durable();
      c->set_job_id(task.job_id);
      c->set_step(task.step);
      c->set_durable_dir(version->durable_dir);
      c->set_world_size(version->world_size);
      return absl::OkStatus();
    }
    case meta::TaskKind::kEvict: {
      v1::EvictTask* e = out->mutable_evict();
      e->set_job_id(task.job_id);
      e->set_step(task.step);
      return absl::OkStatus();
    }
    case meta::TaskKind::kDrop: {
      v1::DropTask* d = out->mutable_drop();
      for (const meta::Holding& h : task.drop) ToProto(h, d->add_entries());
      d->set_reason(task.reason);
      return absl::OkStatus();
    }
    case meta::TaskKind::kDeleteDurable: {
      v1::DeleteDurableTask* d = out->mutable_delete_durable();
      d->set_job_id(task.job_id);
      d->set_step(task.step);
      // The version may be gone with its job; the durable layout is
      // <job>/<step> (docs/format.md "Layout"), so the directory is known without it.
      if (version != nullptr && !version->durable_dir.empty()) {
        d->set_durable_dir(version->durable_dir);
      } else {
        d->set_durable_dir(absl::StrCat(task.job_id, "/", task.step));
      }
      return absl::OkStatus();
    }
  }
  return TaskError(task, absl::StrCat("has unknown kind ", static_cast<int>(task.kind)));
}

// ---------------------------------------------------------------------------
// Cluster

void ToProto(const meta::Problem& problem, v1::Problem* out) {
  out->set_kind(ToProto(problem.kind));
  out->set_severity(problem.error ? v1::SEVERITY_ERROR : v1::SEVERITY_WARNING);
  out->set_message(problem.message);
  out->set_node_id(problem.node_id);
  out->set_job_id(problem.job_id);
  if (problem.step) out->set_step(*problem.step);
  out->set_since_unix_ms(problem.since_ms);
}

void ToProto(const meta::ClusterStatusView& view, v1::ClusterStatusResponse* out) {
  out->set_meta_instance_id(view.meta_instance_id);
  out->set_meta_start_unix_ms(view.meta_start_ms);
  out->set_meta_version(view.meta_version);
  for (const auto& [state, count] : view.nodes_by_state) {
    if (count == 0) continue;
    v1::NodeStateCount* c = out->add_nodes_by_state();
    c->set_state(ToProto(state));
    c->set_count(count);
  }
  for (const meta::Node& node : view.nodes) ToProto(node, out->add_nodes());
  out->set_jobs(view.jobs);
  for (const auto& [state, count] : view.versions_by_state) {
    if (count == 0 || state == meta::VersionState::kDeleted) continue;
    v1::VersionStateCount* c = out->add_versions_by_state();
    c->set_state(ToProto(state));
    c->set_count(count);
  }
  out->set_memory_capacity_bytes(view.memory_capacity_bytes);
  out->set_memory_used_bytes(view.memory_used_bytes);
  out->set_memory_free_bytes(view.memory_free_bytes);
  out->set_flush_lag_bytes(view.flush_lag_bytes);
  out->set_flush_lag_ms(view.flush_lag_ms);
  out->set_tasks_pending(view.tasks_pending);
  out->set_tasks_running(view.tasks_running);
  out->set_tasks_retrying(view.tasks_retrying);
  for (const meta::Problem& p : view.problems) ToProto(p, out->add_problems());
  out->set_problems_total(view.problems_total);
  v1::FailureStats* f = out->mutable_failure_stats();
  f->set_observed_node_ms(view.observed_node_ms);
  f->set_failures(view.failures);
  f->set_node_mtbf_ms(view.node_mtbf_ms);
  f->set_mtbf_is_lower_bound(view.mtbf_is_lower_bound);
  f->set_job_nodes(view.job_nodes);
  f->set_job_mtbf_ms(view.job_mtbf_ms);
}

}  // namespace ckpt::rpc
