// The replicated log of a ckpt-meta replica set (docs/meta.md "Replicas"):
// where it lives in etcd and how its entries are encoded.
//
// Under a cluster's root in etcd (e.g. "/ckpt/c1"):
//   <root>/leader/<lease hex>     the election's keys (etcd_election.h)
//   <root>/log/<index, 20 digits> one log entry each, index 1, 2, 3, ...
//
// The leader turns every group of store batches it commits into one or more
// entries, appended in index order. An entry is at most kMaxEntryBytes (etcd
// refuses requests over 1.5 MiB by default); a group that does not fit is cut
// into several, flagged first / last, and applies only once its last entry is
// there. A group whose last entry never came (its leader died between two
// appends) was never acknowledged: the next group's first entry drops it.
//
// Entry: "CKL1" | flags (1 byte: 1 first, 2 last) | crc32c of the payload
// (4 bytes, little-endian) | payload: a piece of the group's encoding
//   op count (4 bytes) | per op: type (1 byte: 0 put, 1 delete) |
//   key length (4 bytes) | key | value length (4 bytes) | value.
//
// Snapshots, so that the log can be trimmed: the leader writes its whole
// store as of log index I (the puts of one group, encoded as entries) under
//   <root>/snap/<I, 20 digits>/<part, 6 digits>
// then points <root>/snapshot ("I PARTS") at it, and only then deletes the
// log entries up to I and older snapshots. A replica whose next entry is no
// longer in the log loads the snapshot instead (replacing its whole store in
// one batch) and goes on from I + 1.
//
// Each replica's own store records how far it has applied the log in key
// kAppliedKey (the index of the last entry of the last group applied,
// 20 digits), written in the same batch as the group, so a crash never
// applies a group twice or skips one.
//
// Thread safety: pure functions; an EntryAssembler is used by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/meta/store/meta_store.h"

namespace ckpt::meta::replica {

inline constexpr size_t kMaxEntryBytes = 1 << 20;
// Keys of a replica's own store that are not meta's records (MetaCore reads
// only the record prefixes of records.h).
inline constexpr char kAppliedKey[] = "~replica/applied";

std::string LeaderPrefix(std::string_view root);
std::string LogPrefix(std::string_view root);
std::string LogKey(std::string_view root, uint64_t index);
std::string SnapshotHeadKey(std::string_view root);
std::string SnapshotPrefix(std::string_view root);
std::string SnapshotPartKey(std::string_view root, uint64_t index, uint32_t part);

struct SnapshotHead {
  uint64_t index = 0;  // the log index the snapshot is the state after
  uint32_t parts = 0;
};
std::string EncodeSnapshotHead(const SnapshotHead& head);
// DataLoss if `value` is not "INDEX PARTS".
absl::StatusOr<SnapshotHead> DecodeSnapshotHead(std::string_view value);

// The index of a key under LogPrefix(root); InvalidArgument for other keys.
absl::StatusOr<uint64_t> LogIndexOf(std::string_view root, std::string_view key);

// The entries of `group`, in order (at least one, each at most kMaxEntryBytes).
std::vector<std::string> EncodeEntries(const WriteBatch& group);

// Puts entries back together into groups.
class EntryAssembler {
 public:
  // The group completed by `entry`, or nullopt while more entries are due.
  // DataLoss for an entry that is not one (magic, crc32c, truncated
  // encoding): the log is damaged, and applying past it would diverge.
  absl::StatusOr<std::optional<WriteBatch>> Add(std::string_view entry);

 private:
  std::string pending_;
  bool open_ = false;
};

// The index recorded under kAppliedKey in `local` (0 if none). DataLoss if
// it is not a number.
absl::StatusOr<uint64_t> ReadAppliedIndex(MetaStore* local);
std::string EncodeIndex(uint64_t index);

}  // namespace ckpt::meta::replica
