// Validation of names that come from users or peers: job ids, node ids, item
// (tensor) names, and the path components built from them.
//
// Job ids and node ids become directory names under the agent's memory and
// flush roots, so their alphabet is restricted and ".." is forbidden: a valid
// id can never escape the directory it is joined under. Item names live only
// inside shard manifests (never in paths), so they may be any printable
// UTF-8. JoinUnderRoot() is the one place that turns names into paths; code
// that builds paths from untrusted strings goes through it.
//
// Every validator returns OkStatus() or InvalidArgument whose message quotes
// the offending value (escaped, and shortened if very long), says which rule
// it broke and what is allowed, e.g.
//   job id "../etc" is invalid: it contains ".."; job ids must match
//   [a-z0-9][a-z0-9._-]{0,62} and must not contain ".."
//
// Thread safety: all functions are pure and safe to call concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt {

// Longest job id / node id, in bytes (the DNS label limit).
inline constexpr size_t kMaxJobIdLength = 63;
inline constexpr size_t kMaxNodeIdLength = 63;
// Longest item name, in bytes of UTF-8.
inline constexpr size_t kMaxItemNameLength = 1024;
// Longest single path component accepted by JoinUnderRoot() (Linux NAME_MAX).
inline constexpr size_t kMaxPathComponentLength = 255;

// Highest step a version may have: 2^53 - 1, so every step is exact as a
// JSON number and a Python float (training steps never come near it). Steps
// are 0..kMaxStep.
inline constexpr uint64_t kMaxStep = (uint64_t{1} << 53) - 1;

// Most ranks a job may have (meta's CreateJob, ckptctl's reshard): 2^20.
inline constexpr uint32_t kMaxWorldSize = uint32_t{1} << 20;

// OK iff step <= kMaxStep; otherwise InvalidArgument naming the step and the
// limit. Every entry point that takes a step from a user or a peer calls it
// (meta's version RPCs, the agent's staging lease, the clients, ckptctl), so a
// typo such as 2^64-1 is refused before it opens a version.
absl::Status ValidateStep(uint64_t step);

// OK iff `job_id` matches [a-z0-9][a-z0-9._-]{0,62} and does not contain "..".
// Lower case only, so ids cannot collide on case-insensitive file systems or
// object stores.
absl::Status ValidateJobId(std::string_view job_id);

// OK iff `node_id` matches [A-Za-z0-9][A-Za-z0-9._-]{0,62} and does not
// contain "..". Node ids are host names in practice, hence upper case is
// allowed; ids differing only in case are different nodes.
absl::Status ValidateNodeId(std::string_view node_id);

// The host a DPU agent `node_id` serves (docs/dpu.md): a valid node id other
// than its own. InvalidArgument starting with `what` (the flag or field)
// otherwise.
absl::Status ValidateHostNodeId(std::string_view node_id, std::string_view host, std::string_view what);

// OK iff `name` is 1..1024 bytes of well-formed UTF-8 (no overlong forms, no
// surrogates) without control characters (U+0000..U+001F, U+007F,
// U+0080..U+009F). Anything else printable is allowed, including '/', spaces
// and "..": item names are never used as paths. Well-formed UTF-8 is required
// because manifests carry names in protobuf `string` fields.
absl::Status ValidateItemName(std::string_view name);

// OK iff `component` is usable as one path component: non-empty, not "." or
// "..", at most 255 bytes, and containing no '/' and no NUL.
absl::Status ValidatePathComponent(std::string_view component);

// Returns root/c1/c2/... after validating every component with
// ValidatePathComponent(). `root` is trusted (it comes from configuration)
// and is used as given, except that trailing '/' are dropped ("/" stays "/");
// it must be non-empty and contain no NUL. With no components, returns the
// normalized root. Fails with InvalidArgument naming the first bad component
// and its position. Does not touch the file system.
absl::StatusOr<std::string> JoinUnderRoot(std::string_view root,
                                          std::initializer_list<std::string_view> components);
absl::StatusOr<std::string> JoinUnderRoot(std::string_view root,
                                          std::span<const std::string> components);

// File name of a rank's data inside a job directory: "rank-00000.bin",
// zero-padded to at least 5 digits ("rank-123456.bin" above 99999).
std::string RankFileName(uint32_t rank);

// `value` in double quotes for error messages: '"' and '\' are escaped,
// \n \r \t spelled as such, other control characters and bytes that are not
// part of well-formed UTF-8 as \xNN; printable UTF-8 is kept as is. Values
// longer than 128 bytes are cut (at a character boundary) and followed by
// `... (N bytes)`.
std::string QuoteForMessage(std::string_view value);

}  // namespace ckpt
