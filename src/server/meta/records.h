// Persistent records of the metadata service: key layout and encoding.
//
// Keys (all ASCII, ordered so that prefix scans return natural order):
//   n/<node_id>                           Node
//   j/<job_id>                            Job
//   v/<job_id>/<step:020>                 Version header (no shards, no segments)
//   s/<job_id>/<step:020>/<rank:010>      Shard (items, copies, durable)
//   g/<job_id>/<step:020>                 EC layout and segments of a version
//   t/<task_id>                           Task
//   c/next_task_id                        counter
// Values are JSON documents (nlohmann_json), one object per record, with a
// field per struct member; unknown fields are ignored when reading, missing
// ones take their defaults, so records can grow by addition.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "server/meta/model.h"

namespace ckpt::meta::records {

std::string NodeKey(std::string_view node_id);
std::string JobKey(std::string_view job_id);
std::string VersionKey(std::string_view job_id, uint64_t step);
std::string VersionPrefix(std::string_view job_id);  // "v/<job>/"
std::string ShardKey(std::string_view job_id, uint64_t step, uint32_t rank);
std::string ShardPrefix(std::string_view job_id, uint64_t step);
std::string SegmentsKey(std::string_view job_id, uint64_t step);
std::string TaskKey(std::string_view task_id);
inline constexpr std::string_view kNodePrefix = "n/";
inline constexpr std::string_view kJobPrefix = "j/";
inline constexpr std::string_view kAllVersionsPrefix = "v/";
inline constexpr std::string_view kAllShardsPrefix = "s/";
inline constexpr std::string_view kAllSegmentsPrefix = "g/";
inline constexpr std::string_view kTaskPrefix = "t/";
inline constexpr std::string_view kNextTaskIdKey = "c/next_task_id";

std::string EncodeNode(const Node& n);
std::string EncodeJob(const Job& j);
// The version header: everything but shards, blobs and segments.
std::string EncodeVersionHeader(const Version& v);
std::string EncodeShard(const Shard& s);
// EC layout and segments of a version.
std::string EncodeSegments(const Version& v);
std::string EncodeTask(const Task& t);

// Decoders return Internal naming `key` for a malformed record.
absl::StatusOr<Node> DecodeNode(std::string_view key, std::string_view value);
absl::StatusOr<Job> DecodeJob(std::string_view key, std::string_view value);
absl::StatusOr<Version> DecodeVersionHeader(std::string_view key, std::string_view value);
absl::StatusOr<Shard> DecodeShard(std::string_view key, std::string_view value);
// Fills v->blobs and v->segments.
absl::Status DecodeSegments(std::string_view key, std::string_view value, Version* v);
absl::StatusOr<Task> DecodeTask(std::string_view key, std::string_view value);

}  // namespace ckpt::meta::records
