// What file system the agent's memory tier lives on (issue 40): the tier is
// meant to be memory (tmpfs, hugetlbfs, ramfs); on a disk file system
// (ext4, xfs, ...) every save goes through the page cache to disk and a
// reboot keeps stale tiers. ckpt-agent warns loudly at start and reports it
// (AgentStatus memory_dir_fs, the ckpt_agent_memory_dir_in_memory gauge).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace ckpt::daemon {

struct FsKind {
  std::string name;        // "tmpfs", "hugetlbfs", "ext4", ... or "0x1234abcd"
  bool in_memory = false;  // tmpfs, hugetlbfs or ramfs
};

// The kind of a statfs f_type.
FsKind DescribeFsType(uint64_t f_type);

// statfs of `path`, or of its nearest existing ancestor when it does not
// exist yet (the agent creates its memory dir): what it will live on.
absl::StatusOr<FsKind> FsKindOf(const std::string& path);

// The loud start-up warning for a memory dir on `kind` (empty when it is in
// memory).
std::string MemoryDirWarning(const std::string& memory_dir, const FsKind& kind);

}  // namespace ckpt::daemon
