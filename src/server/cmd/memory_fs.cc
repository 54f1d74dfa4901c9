#include "server/cmd/memory_fs.h"

#include <sys/statfs.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ckpt::daemon {

namespace {

// statfs(2) f_type magic numbers (not every libc names them all).
constexpr uint64_t kTmpfs = 0x01021994;
constexpr uint64_t kHugetlbfs = 0x958458f6;
constexpr uint64_t kRamfs = 0x858458f6;

}  // namespace

FsKind DescribeFsType(uint64_t f_type) {
  switch (f_type) {
    case kTmpfs: return {"tmpfs", true};
    case kHugetlbfs: return {"hugetlbfs", true};
    case kRamfs: return {"ramfs", true};
    case 0xEF53: return {"ext4", false};  // ext2/3/4 share it
    case 0x58465342: return {"xfs", false};
    case 0x9123683E: return {"btrfs", false};
    case 0x794c7630: return {"overlayfs", false};
    case 0x6969: return {"nfs", false};
    case 0x2fc12fc1: return {"zfs", false};
    case 0x01021997: return {"9p", false};
    case 0x65735546: return {"fuse", false};
    case 0x9fa0: return {"proc", false};
    default: return {absl::StrFormat("0x%x", f_type), false};
  }
}

absl::StatusOr<FsKind> FsKindOf(const std::string& path) {
  std::filesystem::path p = std::filesystem::absolute(path).lexically_normal();
  while (true) {
    struct statfs sfs {};
    if (::statfs(p.c_str(), &sfs) == 0) return DescribeFsType(static_cast<uint64_t>(sfs.f_type));
    if (errno != ENOENT || !p.has_relative_path()) {
      return absl::UnavailableError(absl::StrCat("statfs '", p.string(), "': ", std::strerror(errno)));
    }
    p = p.parent_path();
  }
}

std::string MemoryDirWarning(const std::string& memory_dir, const FsKind& kind) {
  if (kind.in_memory) return "";
  return absl::StrCat(
      "memory dir ", memory_dir, " is on ", kind.name,
      ", not on tmpfs or hugetlbfs: the memory tier is then a disk file (saves go through the page "
      "cache to disk, restores may read from disk, and its files survive a reboot). Use a directory "
      "under /dev/shm (the default, /dev/shm/ckpt-<node-id>) or another tmpfs/hugetlbfs mount for "
      "--memory-dir; AgentStatus memory_dir_fs and the ckpt_agent_memory_dir_in_memory gauge show "
      "it (docs/operations.md)");
}

}  // namespace ckpt::daemon
