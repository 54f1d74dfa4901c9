#include "server/meta/records.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ckpt::meta {

// JSON mappings, found by ADL from nlohmann. Enums are stored as numbers
// (equal to the ckpt.v1 enum numbers). Transient members (lease deadlines,
// progress times, inventory flags) are deliberately not listed.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(ProtectionPolicy, kind, copies, placement, data_k,
                                                parity_m)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(FlushPolicy, every_n_versions, every_seconds)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(RetentionPolicy, keep_in_memory, keep_durable)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(JobSpec, job_id, world_size, protection, flush,
                                                retention, labels)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Job, spec, created_ms, plan_epoch, deleting,
                                                delete_durable_files, versions_since_flush,
                                                last_flush_begin_ms, any_flushed)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Node, id, grpc_address, data_address, role,
                                                failure_domain, agent_version, incarnation, state,
                                                memory_capacity_bytes, memory_used_bytes,
                                                memory_free_bytes, memory_leased_bytes,
                                                flush_lag_bytes, flush_lag_ms, flush_errors_total,
                                                registered_ms, last_heartbeat_ms, lease_expiry_ms,
                                                state_since_ms, first_seen_ms, failures, drained,
                                                host_node_id, stopping)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Item, name, dtype, shape, offset_bytes,
                                                length_bytes, crc32c, attributes, ref_step)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Copy, node_id, role, state, updated_ms, detail)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Shard, rank, size_bytes, crc32c, manifest_digest,
                                                items, primary_node_id, staged_ms, copies,
                                                durable_path, durable_written, durable_written_ms)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(BlobPart, rank, blob_offset_bytes, size_bytes)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(NodeBlob, node_id, parts, size_bytes,
                                                segment_bytes)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(EcGroup, index, members, data_k, parity_m)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(SegmentKey, group, stripe, position)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Segment, key, kind, owner_node_id, blob_segment,
                                                length_bytes, crc32c, crc_known, holder_node_id,
                                                state, updated_ms, detail)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(VersionPlan, policy, epoch, nodes, protectors,
                                                groups)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Holding, is_segment, job_id, step, rank, segment,
                                                role, kind, size_bytes, crc32c, manifest_digest,
                                                state, stored_ms, durable_path)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Task, id, node_id, attempt, kind, state, priority,
                                                created_ms, timeout_ms, job_id, step, ranks,
                                                targets, group, segments, drop, reason,
                                                retry_at_ms, last_error, bytes_done, bytes_total)

namespace {
struct VersionHeader {
  std::string job_id;
  uint64_t step = 0;
  VersionState state = VersionState::kOpen;
  uint32_t world_size = 0;
  VersionPlan plan;
  bool flush_planned = false;
  std::string durable_dir;
  std::string run_id;
  int64_t created_ms = 0, staged_ms = 0, protected_ms = 0, persisted_ms = 0, ended_ms = 0;
  std::string abort_reason;
  bool commit_issued = false;
  bool evicted = false;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(VersionHeader, job_id, step, state, world_size,
                                                plan, flush_planned, durable_dir, run_id,
                                                created_ms, staged_ms, protected_ms, persisted_ms,
                                                ended_ms, abort_reason, commit_issued, evicted)
struct SegmentsRecord {
  std::vector<NodeBlob> blobs;
  std::vector<Segment> segments;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(SegmentsRecord, blobs, segments)

// A hand-rolled JSON writer for the per-shard record, written once per
// report: building an nlohmann DOM for it (a map node per field) cost more
// than the rest of the report. The output is JSON that the nlohmann mapping
// above reads back to the same Shard (field order aside).
void AppendJsonString(std::string* out, const std::string& s) {
  for (const char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) {
      // Non-ASCII: let nlohmann check the UTF-8 and escape it as before.
      out->append(nlohmann::json(s).dump());
      return;
    }
  }
  out->push_back('"');
  for (const char c : s) {
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\b': out->append("\\b"); break;
      case '\f': out->append("\\f"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(out, "\\u%04x", static_cast<unsigned>(c));
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

// Appends `"name":`, preceded by a comma unless it opens the object.
void AppendKey(std::string* out, const char* name) {
  if (out->back() != '{') out->push_back(',');
  out->push_back('"');
  out->append(name);
  out->append("\":");
}

template <typename Int>
void AppendField(std::string* out, const char* name, Int value) {
  AppendKey(out, name);
  absl::StrAppend(out, value);
}

void AppendField(std::string* out, const char* name, bool value) {
  AppendKey(out, name);
  out->append(value ? "true" : "false");
}

void AppendField(std::string* out, const char* name, const std::string& value) {
  AppendKey(out, name);
  AppendJsonString(out, value);
}

void AppendItem(std::string* out, const Item& item) {
  out->push_back('{');
  AppendField(out, "name", item.name);
  AppendField(out, "dtype", item.dtype);
  AppendKey(out, "shape");
  out->push_back('[');
  for (size_t i = 0; i < item.shape.size(); ++i) {
    if (i > 0) out->push_back(',');
    absl::StrAppend(out, item.shape[i]);
  }
  out->push_back(']');
  AppendField(out, "offset_bytes", item.offset_bytes);
  AppendField(out, "length_bytes", item.length_bytes);
  AppendField(out, "crc32c", item.crc32c);
  AppendKey(out, "attributes");
  out->push_back('{');
  bool first = true;
  for (const auto& [k, v] : item.attributes) {
    if (!first) out->push_back(',');
    first = false;
    AppendJsonString(out, k);
    out->push_back(':');
    AppendJsonString(out, v);
  }
  out->push_back('}');
  if (item.ref_step >= 0) AppendField(out, "ref_step", item.ref_step);
  out->push_back('}');
}

void AppendCopy(std::string* out, const Copy& copy) {
  out->push_back('{');
  AppendField(out, "node_id", copy.node_id);
  AppendField(out, "role", static_cast<int>(copy.role));
  AppendField(out, "state", static_cast<int>(copy.state));
  AppendField(out, "updated_ms", copy.updated_ms);
  AppendField(out, "detail", copy.detail);
  out->push_back('}');
}

template <typename T>
absl::StatusOr<T> Parse(std::string_view key, std::string_view value) {
  try {
    return nlohmann::json::parse(value).get<T>();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("metadata record '", std::string(key),
                                            "' is malformed: ", e.what()));
  }
}
}  // namespace

namespace records {

std::string NodeKey(std::string_view id) { return absl::StrCat("n/", std::string(id)); }
std::string JobKey(std::string_view id) { return absl::StrCat("j/", std::string(id)); }
std::string VersionPrefix(std::string_view job) { return absl::StrCat("v/", std::string(job), "/"); }
std::string VersionKey(std::string_view job, uint64_t step) {
  return absl::StrFormat("v/%s/%020u", std::string(job), step);
}
std::string ShardPrefix(std::string_view job, uint64_t step) {
  return absl::StrFormat("s/%s/%020u/", std::string(job), step);
}
std::string ShardKey(std::string_view job, uint64_t step, uint32_t rank) {
  return absl::StrFormat("s/%s/%020u/%010u", std::string(job), step, rank);
}
std::string SegmentsKey(std::string_view job, uint64_t step) {
  return absl::StrFormat("g/%s/%020u", std::string(job), step);
}
std::string TaskKey(std::string_view id) { return absl::StrCat("t/", std::string(id)); }

std::string EncodeNode(const Node& n) { return nlohmann::json(n).dump(); }
std::string EncodeJob(const Job& j) { return nlohmann::json(j).dump(); }
std::string EncodeShard(const Shard& s) {
  std::string out;
  out.reserve(256 + 128 * (s.items.size() + s.copies.size()));
  out.push_back('{');
  AppendField(&out, "rank", s.rank);
  AppendField(&out, "size_bytes", s.size_bytes);
  AppendField(&out, "crc32c", s.crc32c);
  AppendField(&out, "manifest_digest", s.manifest_digest);
  AppendKey(&out, "items");
  out.push_back('[');
  for (size_t i = 0; i < s.items.size(); ++i) {
    if (i > 0) out.push_back(',');
    AppendItem(&out, s.items[i]);
  }
  out.push_back(']');
  AppendField(&out, "primary_node_id", s.primary_node_id);
  AppendField(&out, "staged_ms", s.staged_ms);
  AppendKey(&out, "copies");
  out.push_back('[');
  for (size_t i = 0; i < s.copies.size(); ++i) {
    if (i > 0) out.push_back(',');
    AppendCopy(&out, s.copies[i]);
  }
  out.push_back(']');
  AppendField(&out, "durable_path", s.durable_path);
  AppendField(&out, "durable_written", s.durable_written);
  AppendField(&out, "durable_written_ms", s.durable_written_ms);
  out.push_back('}');
  return out;
}
std::string EncodeTask(const Task& t) { return nlohmann::json(t).dump(); }

std::string EncodeVersionHeader(const Version& v) {
  VersionHeader h{v.job_id,       v.step,         v.state,      v.world_size,   v.plan,
                  v.flush_planned, v.durable_dir, v.run_id,     v.created_ms,   v.staged_ms,
                  v.protected_ms, v.persisted_ms, v.ended_ms,   v.abort_reason, v.commit_issued,
                  v.evicted};
  return nlohmann::json(h).dump();
}

std::string EncodeSegments(const Version& v) {
  return nlohmann::json(SegmentsRecord{v.blobs, v.segments}).dump();
}

absl::StatusOr<Node> DecodeNode(std::string_view key, std::string_view value) {
  return Parse<Node>(key, value);
}
absl::StatusOr<Job> DecodeJob(std::string_view key, std::string_view value) {
  return Parse<Job>(key, value);
}
absl::StatusOr<Shard> DecodeShard(std::string_view key, std::string_view value) {
  absl::StatusOr<Shard> shard = Parse<Shard>(key, value);
  if (shard.ok()) shard->ref_steps = RefStepsOf(shard->items);
  return shard;
}
absl::StatusOr<Task> DecodeTask(std::string_view key, std::string_view value) {
  return Parse<Task>(key, value);
}

absl::StatusOr<Version> DecodeVersionHeader(std::string_view key, std::string_view value) {
  auto h = Parse<VersionHeader>(key, value);
  if (!h.ok()) return h.status();
  Version v;
  v.job_id = h->job_id;
  v.step = h->step;
  v.state = h->state;
  v.world_size = h->world_size;
  v.plan = h->plan;
  v.flush_planned = h->flush_planned;
  v.durable_dir = h->durable_dir;
  v.run_id = h->run_id;
  v.created_ms = h->created_ms;
  v.staged_ms = h->staged_ms;
  v.protected_ms = h->protected_ms;
  v.persisted_ms = h->persisted_ms;
  v.ended_ms = h->ended_ms;
  v.abort_reason = h->abort_reason;
  v.commit_issued = h->commit_issued;
  v.evicted = h->evicted;
  return v;
}

absl::Status DecodeSegments(std::string_view key, std::string_view value, Version* v) {
  auto r = Parse<SegmentsRecord>(key, value);
  if (!r.ok()) return r.status();
  v->blobs = std::move(r->blobs);
  v->segments = std::move(r->segments);
  return absl::OkStatus();
}

}  // namespace records
}  // namespace ckpt::meta
