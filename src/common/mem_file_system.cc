// MemFileSystem: a tree of reference-counted nodes under one mutex, each
// carrying its live state and its last synced state (see the header for the
// durability model). Errors are built with PosixErrorToStatus from the errno
// Linux would report, so they match PosixFileSystem's code and message.
#include "common/mem_file_system.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/lock_check.h"

namespace ckpt {
namespace mem_fs_internal {

// A file or a directory. All fields except is_dir are guarded by the owning
// MemFileSystem's mu_.
struct Node {
  explicit Node(bool directory) : is_dir(directory) {}

  const bool is_dir;
  // Files only.
  std::string data;         // live content
  std::string synced_data;  // content as of the last Sync()
  // Directories only. Sorted, so ListDir needs no sort.
  std::map<std::string, std::shared_ptr<Node>> children;         // live entries
  std::map<std::string, std::shared_ptr<Node>> synced_children;  // as of the last SyncDir()
};

}  // namespace mem_fs_internal

namespace {

using mem_fs_internal::Node;

// Largest file MemFileSystem will hold; larger requests fail like EFBIG
// instead of throwing from std::string.
constexpr uint64_t kMaxMemFileBytes = uint64_t{1} << 40;

bool FitsInMemFile(uint64_t offset, uint64_t size) {
  return offset <= kMaxMemFileBytes && size <= kMaxMemFileBytes - offset;
}

// A path split into its components; empty for the root.
using Components = std::vector<std::string>;

absl::StatusOr<Components> SplitPath(const std::string& path, std::string_view operation,
                                     std::string_view shown) {
  if (path.empty() || path.front() != '/') {
    return absl::InvalidArgumentError(std::string(operation) + " '" + std::string(shown) +
                                      "': MemFileSystem needs absolute paths");
  }
  Components components;
  size_t start = 1;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    std::string component = path.substr(start, end - start);
    if (component == "..") {
      return absl::InvalidArgumentError(std::string(operation) + " '" + std::string(shown) +
                                        "': MemFileSystem does not resolve '..'");
    }
    if (!component.empty() && component != ".") components.push_back(std::move(component));
    start = end + 1;
  }
  return components;
}

// Where a path leads: its parent directory (null for the root), its last
// component, and the node there (null if nothing is).
struct Resolved {
  Components components;
  std::shared_ptr<Node> parent;
  std::string name;
  std::shared_ptr<Node> node;
};

// Resolves `path` from `root`: every component but the last must be an existing
// directory (else ENOENT / ENOTDIR, as the kernel reports them). Errors read
// "<operation> '<shown>': ...".
absl::StatusOr<Resolved> Resolve(const std::shared_ptr<Node>& root, const std::string& path,
                                 std::string_view operation, std::string_view shown) {
  absl::StatusOr<Components> components = SplitPath(path, operation, shown);
  if (!components.ok()) return components.status();
  Resolved r;
  r.components = *std::move(components);
  if (r.components.empty()) {
    r.node = root;
    return r;
  }
  std::shared_ptr<Node> dir = root;
  for (size_t i = 0; i + 1 < r.components.size(); ++i) {
    auto it = dir->children.find(r.components[i]);
    if (it == dir->children.end()) return PosixErrorToStatus(ENOENT, operation, shown);
    if (!it->second->is_dir) return PosixErrorToStatus(ENOTDIR, operation, shown);
    dir = it->second;
  }
  r.parent = dir;
  r.name = r.components.back();
  auto it = dir->children.find(r.name);
  if (it != dir->children.end()) r.node = it->second;
  return r;
}

// As Resolve, but nothing at `path` is ENOENT.
absl::StatusOr<std::shared_ptr<Node>> Lookup(const std::shared_ptr<Node>& root,
                                             const std::string& path,
                                             std::string_view operation) {
  absl::StatusOr<Resolved> r = Resolve(root, path, operation, path);
  if (!r.ok()) return r.status();
  if (r->node == nullptr) return PosixErrorToStatus(ENOENT, operation, path);
  return std::move(r->node);
}

absl::Status HandleError(std::string_view operation, const std::string& path, bool closed) {
  return absl::FailedPreconditionError(
      std::string(operation) + " '" + path + "': " +
      (closed ? "file already closed" : "handle invalidated by DropUnsyncedData (simulated crash)"));
}

}  // namespace

class MemFileSystem::MemWritableFile : public WritableFile {
 public:
  MemWritableFile(MemFileSystem* fs, std::shared_ptr<Node> node, std::string path,
                  uint64_t generation)
      : fs_(fs), node_(std::move(node)), path_(std::move(path)), generation_(generation) {}

  absl::Status Append(std::span<const std::byte> data) override {
    AssertNoCheckedLock("file I/O");
    absl::MutexLock lock(&fs_->mu_);
    if (absl::Status s = Check("append to"); !s.ok()) return s;
    return WriteLocked(node_->data.size(), data);
  }

  absl::Status PositionedWrite(uint64_t offset, std::span<const std::byte> data) override {
    AssertNoCheckedLock("file I/O");
    absl::MutexLock lock(&fs_->mu_);
    if (absl::Status s = Check("write to"); !s.ok()) return s;
    return WriteLocked(offset, data);
  }

  absl::Status Preallocate(uint64_t size_bytes) override {
    AssertNoCheckedLock("file I/O");
    absl::MutexLock lock(&fs_->mu_);
    if (absl::Status s = Check("preallocate"); !s.ok()) return s;
    if (!FitsInMemFile(0, size_bytes)) return PosixErrorToStatus(EFBIG, "preallocate", path_);
    return absl::OkStatus();  // memory has nothing to reserve
  }

  absl::Status Sync() override {
    AssertNoCheckedLock("file I/O");
    absl::MutexLock lock(&fs_->mu_);
    if (absl::Status s = Check("sync"); !s.ok()) return s;
    node_->synced_data = node_->data;
    return absl::OkStatus();
  }

  absl::Status Close() override {
    AssertNoCheckedLock("file I/O");
    absl::MutexLock lock(&fs_->mu_);
    closed_ = true;
    return absl::OkStatus();
  }

  uint64_t Size() const override {
    absl::MutexLock lock(&fs_->mu_);
    return node_->data.size();
  }

 private:
  absl::Status Check(std::string_view operation) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(fs_->mu_) {
    if (closed_ || generation_ != fs_->generation_) return HandleError(operation, path_, closed_);
    return absl::OkStatus();
  }

  absl::Status WriteLocked(uint64_t offset, std::span<const std::byte> data)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(fs_->mu_) {
    if (!FitsInMemFile(offset, data.size())) return PosixErrorToStatus(EFBIG, "write", path_);
    std::string& content = node_->data;
    const uint64_t end = offset + data.size();
    if (end > content.size()) content.resize(static_cast<size_t>(end), '\0');
    if (!data.empty()) std::memcpy(content.data() + offset, data.data(), data.size());
    return absl::OkStatus();
  }

  MemFileSystem* const fs_;
  const std::shared_ptr<Node> node_;
  const std::string path_;  // as opened, for messages
  const uint64_t generation_;
  bool closed_ ABSL_GUARDED_BY(fs_->mu_) = false;
};

class MemFileSystem::MemReadableFile : public ReadableFile {
 public:
  MemReadableFile(MemFileSystem* fs, std::shared_ptr<Node> node, std::string path,
                  uint64_t generation, uint64_t size)
      : fs_(fs), node_(std::move(node)), path_(std::move(path)), generation_(generation),
        size_(size) {}

  absl::StatusOr<size_t> PositionedRead(uint64_t offset, std::span<std::byte> out) override {
    AssertNoCheckedLock("file I/O");
    absl::MutexLock lock(&fs_->mu_);
    if (generation_ != fs_->generation_) return HandleError("read", path_, /*closed=*/false);
    const std::string& content = node_->data;
    if (offset >= content.size()) return size_t{0};
    const size_t n = std::min<uint64_t>(out.size(), content.size() - offset);
    std::memcpy(out.data(), content.data() + offset, n);
    return n;
  }

  uint64_t Size() const override { return size_; }

 private:
  MemFileSystem* const fs_;
  const std::shared_ptr<Node> node_;
  const std::string path_;
  const uint64_t generation_;
  const uint64_t size_;
};

MemFileSystem::MemFileSystem() : root_(std::make_shared<Node>(/*directory=*/true)) {
  all_dirs_.push_back(root_);
}

MemFileSystem::~MemFileSystem() {
  // Synced entry sets can form cycles of shared_ptrs (see the header); clear
  // every directory so that all nodes are freed.
  absl::MutexLock lock(&mu_);
  for (const std::weak_ptr<Node>& weak : all_dirs_) {
    if (std::shared_ptr<Node> dir = weak.lock()) {
      dir->children.clear();
      dir->synced_children.clear();
    }
  }
}

absl::StatusOr<std::unique_ptr<WritableFile>> MemFileSystem::NewWritableFile(
    const std::string& path, OpenMode mode) {
  AssertNoCheckedLock("file I/O");
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Resolved> r = Resolve(root_, path, "open", path);
  if (!r.ok()) return r.status();
  std::shared_ptr<Node> node = r->node;
  if (node != nullptr) {
    if (node->is_dir) return PosixErrorToStatus(EISDIR, "open", path);
    if (mode == OpenMode::kCreateNew) return PosixErrorToStatus(EEXIST, "open", path);
    if (mode == OpenMode::kTruncate) node->data.clear();
  } else {
    node = std::make_shared<Node>(/*directory=*/false);
    r->parent->children[r->name] = node;
  }
  return std::make_unique<MemWritableFile>(this, std::move(node), path, generation_);
}

absl::StatusOr<std::unique_ptr<ReadableFile>> MemFileSystem::NewReadableFile(
    const std::string& path) {
  AssertNoCheckedLock("file I/O");
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::shared_ptr<Node>> node = Lookup(root_, path, "open");
  if (!node.ok()) return node.status();
  if ((*node)->is_dir) return PosixErrorToStatus(EISDIR, "open", path);
  const uint64_t size = (*node)->data.size();
  return std::make_unique<MemReadableFile>(this, *std::move(node), path, generation_, size);
}

absl::StatusOr<std::unique_ptr<WritableFile>> MemFileSystem::NewPrivateWritableFile(
    const std::string& path) {
  return NewWritableFile(path, OpenMode::kCreateNew);
}

absl::StatusOr<std::unique_ptr<ReadableFile>> MemFileSystem::NewPrivateReadableFile(
    const std::string& path) {
  return NewReadableFile(path);
}

absl::StatusOr<FileStat> MemFileSystem::Stat(const std::string& path) {
  AssertNoCheckedLock("file I/O");
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::shared_ptr<Node>> node = Lookup(root_, path, "stat");
  if (!node.ok()) return node.status();
  FileStat stat;
  stat.is_directory = (*node)->is_dir;
  stat.size_bytes = (*node)->is_dir ? 0 : (*node)->data.size();
  return stat;
}

absl::StatusOr<std::vector<std::string>> MemFileSystem::ListDir(const std::string& path) {
  AssertNoCheckedLock("file I/O");
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::shared_ptr<Node>> node = Lookup(root_, path, "opendir");
  if (!node.ok()) return node.status();
  if (!(*node)->is_dir) return PosixErrorToStatus(ENOTDIR, "opendir", path);
  std::vector<std::string> names;
  names.reserve((*node)->children.size());
  for (const auto& [name, child] : (*node)->children) names.push_back(name);
  return names;
}

absl::Status MemFileSystem::CreateDir(const std::string& path) {
  AssertNoCheckedLock("file I/O");
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Resolved> r = Resolve(root_, path, "mkdir", path);
  if (!r.ok()) return r.status();
  if (r->node != nullptr) return PosixErrorToStatus(EEXIST, "mkdir", path);
  auto dir = std::make_shared<Node>(/*directory=*/true);
  r->parent->children[r->name] = dir;
  all_dirs_.push_back(dir);
  return absl::OkStatus();
}

absl::Status MemFileSystem::CreateDirs(const std::string& path) {
  AssertNoCheckedLock("file I/O");
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Components> components = SplitPath(path, "mkdir", path);
  if (!components.ok()) return components.status();
  std::shared_ptr<Node> dir = root_;
  for (const std::string& name : *components) {
    std::shared_ptr<Node>& child = dir->children[name];
    if (child == nullptr) {
      child = std::make_shared<Node>(/*directory=*/true);
      all_dirs_.push_back(child);
    } else if (!child->is_dir) {
      return PosixErrorToStatus(ENOTDIR, "mkdir", path);
    }
    dir = child;
  }
  return absl::OkStatus();
}

absl::Status MemFileSystem::DeleteFile(const std::string& path) {
  AssertNoCheckedLock("file I/O");
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Resolved> r = Resolve(root_, path, "unlink", path);
  if (!r.ok()) return r.status();
  if (r->node == nullptr) return PosixErrorToStatus(ENOENT, "unlink", path);
  if (r->node->is_dir) return PosixErrorToStatus(EISDIR, "unlink", path);
  r->parent->children.erase(r->name);
  return absl::OkStatus();
}

absl::Status MemFileSystem::DeleteDir(const std::string& path) {
  AssertNoCheckedLock("file I/O");
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Resolved> r = Resolve(root_, path, "rmdir", path);
  if (!r.ok()) return r.status();
  if (r->node == nullptr) return PosixErrorToStatus(ENOENT, "rmdir", path);
  if (r->parent == nullptr) return PosixErrorToStatus(EBUSY, "rmdir", path);  // the root
  if (!r->node->is_dir) return PosixErrorToStatus(ENOTDIR, "rmdir", path);
  if (!r->node->children.empty()) return PosixErrorToStatus(ENOTEMPTY, "rmdir", path);
  r->parent->children.erase(r->name);
  return absl::OkStatus();
}

absl::Status MemFileSystem::Rename(const std::string& src, const std::string& dst) {
  AssertNoCheckedLock("file I/O");
  absl::MutexLock lock(&mu_);
  const std::string shown = src + "' to '" + dst;
  absl::StatusOr<Resolved> from = Resolve(root_, src, "rename", shown);
  if (!from.ok()) return from.status();
  if (from->node == nullptr) return PosixErrorToStatus(ENOENT, "rename", shown);
  absl::StatusOr<Resolved> to = Resolve(root_, dst, "rename", shown);
  if (!to.ok()) return to.status();
  if (from->parent == nullptr || to->parent == nullptr) {
    return PosixErrorToStatus(EBUSY, "rename", shown);  // the root
  }
  if (to->node == from->node) return absl::OkStatus();  // same file: POSIX does nothing
  if (from->node->is_dir) {
    const Components& a = from->components;
    const Components& b = to->components;
    if (b.size() > a.size() && std::equal(a.begin(), a.end(), b.begin())) {
      return PosixErrorToStatus(EINVAL, "rename", shown);  // into its own subtree
    }
    if (to->node != nullptr && !to->node->is_dir) {
      return PosixErrorToStatus(ENOTDIR, "rename", shown);
    }
    if (to->node != nullptr && !to->node->children.empty()) {
      return PosixErrorToStatus(ENOTEMPTY, "rename", shown);
    }
  } else if (to->node != nullptr && to->node->is_dir) {
    return PosixErrorToStatus(EISDIR, "rename", shown);
  }
  to->parent->children[to->name] = from->node;
  from->parent->children.erase(from->name);
  return absl::OkStatus();
}

absl::Status MemFileSystem::SyncDir(const std::string& path) {
  AssertNoCheckedLock("file I/O");
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::shared_ptr<Node>> node = Lookup(root_, path, "open directory");
  if (!node.ok()) return node.status();
  if (!(*node)->is_dir) return PosixErrorToStatus(ENOTDIR, "open directory", path);
  (*node)->synced_children = (*node)->children;
  return absl::OkStatus();
}

absl::Status MemFileSystem::Truncate(const std::string& path, uint64_t size_bytes) {
  AssertNoCheckedLock("file I/O");
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::shared_ptr<Node>> node = Lookup(root_, path, "truncate");
  if (!node.ok()) return node.status();
  if ((*node)->is_dir) return PosixErrorToStatus(EISDIR, "truncate", path);
  if (!FitsInMemFile(0, size_bytes)) return PosixErrorToStatus(EFBIG, "truncate", path);
  (*node)->data.resize(static_cast<size_t>(size_bytes), '\0');
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> MemFileSystem::FreeSpaceBytes(const std::string& path) {
  AssertNoCheckedLock("file I/O");
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::shared_ptr<Node>> node = Lookup(root_, path, "statvfs");
  if (!node.ok()) return node.status();
  return kMemFreeSpaceBytes;
}

void MemFileSystem::DropUnsyncedData() {
  absl::MutexLock lock(&mu_);
  ++generation_;
  // Breadth-first from the root, in name order, so that the outcome is
  // deterministic when synced entry sets disagree (see the header).
  std::set<const Node*> seen = {root_.get()};
  std::deque<std::shared_ptr<Node>> queue = {root_};
  while (!queue.empty()) {
    std::shared_ptr<Node> dir = std::move(queue.front());
    queue.pop_front();
    dir->children = dir->synced_children;
    for (auto it = dir->children.begin(); it != dir->children.end();) {
      const std::shared_ptr<Node>& child = it->second;
      if (!child->is_dir) {
        child->data = child->synced_data;
      } else if (!seen.insert(child.get()).second) {
        it = dir->children.erase(it);  // a directory has only one name
        continue;
      } else {
        queue.push_back(child);
      }
      ++it;
    }
  }
  // Forget directories nothing refers to any more.
  std::erase_if(all_dirs_, [](const std::weak_ptr<Node>& weak) { return weak.expired(); });
}

}  // namespace ckpt
