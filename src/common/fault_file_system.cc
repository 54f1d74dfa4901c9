// FaultFileSystem: decides under one mutex whether each write or sync fails,
// then forwards the survivors to the base without holding it.
#include "common/fault_file_system.h"

#include <algorithm>
#include <cerrno>
#include <string>
#include <utility>

#include "common/status_macros.h"

namespace ckpt {
namespace {

uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  return a > std::numeric_limits<uint64_t>::max() - b ? std::numeric_limits<uint64_t>::max()
                                                      : a + b;
}

absl::Status InjectedFault(absl::StatusCode code, std::string_view operation,
                           const std::string& path, int64_t count) {
  return absl::Status(code, std::string(operation) + " '" + path + "': injected fault (" +
                                std::string(operation) + " #" + std::to_string(count) + ")");
}

}  // namespace

// Space accounting of one file, shared by its entry in files_ and its handles.
// Fields are guarded by the owning FaultFileSystem's mu_.
struct FaultFileSystem::Usage {
  uint64_t size = 0;       // file size as written through this decorator
  uint64_t allocated = 0;  // preallocated size
  uint64_t Counted() const { return std::max(size, allocated); }
};

class FaultFileSystem::FaultWritableFile : public WritableFile {
 public:
  FaultWritableFile(FaultFileSystem* fs, std::unique_ptr<WritableFile> base, std::string path,
                    std::shared_ptr<Usage> usage)
      : fs_(fs), base_(std::move(base)), path_(std::move(path)), usage_(std::move(usage)) {}

  absl::Status Append(std::span<const std::byte> data) override {
    {
      absl::MutexLock lock(&fs_->mu_);
      CKPT_RETURN_IF_ERROR(fs_->CountWriteLocked(path_));
      Usage grown = *usage_;
      grown.size = SaturatingAdd(grown.size, data.size());
      CKPT_RETURN_IF_ERROR(fs_->ResizeLocked(*usage_, grown, "write", path_));
    }
    return base_->Append(data);
  }

  absl::Status PositionedWrite(uint64_t offset, std::span<const std::byte> data) override {
    {
      absl::MutexLock lock(&fs_->mu_);
      CKPT_RETURN_IF_ERROR(fs_->CountWriteLocked(path_));
      Usage grown = *usage_;
      grown.size = std::max(grown.size, SaturatingAdd(offset, data.size()));
      CKPT_RETURN_IF_ERROR(fs_->ResizeLocked(*usage_, grown, "write", path_));
    }
    return base_->PositionedWrite(offset, data);
  }

  absl::Status Preallocate(uint64_t size_bytes) override {
    {
      absl::MutexLock lock(&fs_->mu_);
      Usage grown = *usage_;
      grown.allocated = std::max(grown.allocated, size_bytes);
      CKPT_RETURN_IF_ERROR(fs_->ResizeLocked(*usage_, grown, "preallocate", path_));
    }
    return base_->Preallocate(size_bytes);
  }

  absl::Status Sync() override {
    {
      absl::MutexLock lock(&fs_->mu_);
      CKPT_RETURN_IF_ERROR(fs_->CountSyncLocked(path_));
    }
    return base_->Sync();
  }

  absl::Status Close() override { return base_->Close(); }
  uint64_t Size() const override { return base_->Size(); }

 private:
  FaultFileSystem* const fs_;
  const std::unique_ptr<WritableFile> base_;
  const std::string path_;
  const std::shared_ptr<Usage> usage_;
};

FaultFileSystem::FaultFileSystem(FileSystem* base) : base_(base) {}

void FaultFileSystem::FailNthWrite(int64_t n, absl::StatusCode code) {
  absl::MutexLock lock(&mu_);
  fail_write_at_ = n > 0 ? writes_issued_ + n : 0;
  fail_write_code_ = code;
}

void FaultFileSystem::FailNthSync(int64_t n, absl::StatusCode code) {
  absl::MutexLock lock(&mu_);
  fail_sync_at_ = n > 0 ? syncs_issued_ + n : 0;
  fail_sync_code_ = code;
}

void FaultFileSystem::FailAllWrites(bool fail) {
  absl::MutexLock lock(&mu_);
  fail_all_writes_ = fail;
}

void FaultFileSystem::FailAllSyncs(bool fail) {
  absl::MutexLock lock(&mu_);
  fail_all_syncs_ = fail;
}

void FaultFileSystem::SetCapacityBytes(uint64_t capacity_bytes) {
  absl::MutexLock lock(&mu_);
  capacity_bytes_ = capacity_bytes;
}

void FaultFileSystem::Reset() {
  absl::MutexLock lock(&mu_);
  writes_issued_ = 0;
  syncs_issued_ = 0;
  fail_write_at_ = 0;
  fail_sync_at_ = 0;
  fail_all_writes_ = false;
  fail_all_syncs_ = false;
  capacity_bytes_ = kUnlimitedCapacity;
}

int64_t FaultFileSystem::WritesIssued() const {
  absl::MutexLock lock(&mu_);
  return writes_issued_;
}

int64_t FaultFileSystem::SyncsIssued() const {
  absl::MutexLock lock(&mu_);
  return syncs_issued_;
}

uint64_t FaultFileSystem::UsedBytes() const {
  absl::MutexLock lock(&mu_);
  return UsedBytesLocked();
}

absl::Status FaultFileSystem::CountWriteLocked(const std::string& path) {
  const int64_t count = ++writes_issued_;
  if (fail_all_writes_) return InjectedFault(absl::StatusCode::kUnavailable, "write", path, count);
  if (count == fail_write_at_) {
    fail_write_at_ = 0;
    return InjectedFault(fail_write_code_, "write", path, count);
  }
  return absl::OkStatus();
}

absl::Status FaultFileSystem::CountSyncLocked(const std::string& path) {
  const int64_t count = ++syncs_issued_;
  if (fail_all_syncs_) return InjectedFault(absl::StatusCode::kUnavailable, "sync", path, count);
  if (count == fail_sync_at_) {
    fail_sync_at_ = 0;
    return InjectedFault(fail_sync_code_, "sync", path, count);
  }
  return absl::OkStatus();
}

absl::Status FaultFileSystem::ResizeLocked(Usage& usage, const Usage& resized,
                                           std::string_view operation, const std::string& path) {
  const uint64_t before = usage.Counted();
  const uint64_t after = resized.Counted();
  if (after > before && capacity_bytes_ != kUnlimitedCapacity) {
    const uint64_t used = UsedBytesLocked();
    if (SaturatingAdd(used, after - before) > capacity_bytes_) {
      return PosixErrorToStatus(ENOSPC, operation, path);
    }
  }
  usage = resized;
  return absl::OkStatus();
}

uint64_t FaultFileSystem::UsedBytesLocked() const {
  uint64_t used = 0;
  for (const auto& [path, usage] : files_) used = SaturatingAdd(used, usage->Counted());
  return used;
}

absl::StatusOr<std::unique_ptr<WritableFile>> FaultFileSystem::NewWritableFile(
    const std::string& path, OpenMode mode) {
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, base_->NewWritableFile(path, mode));
  return Track(std::move(file), path, mode);
}

absl::StatusOr<std::unique_ptr<WritableFile>> FaultFileSystem::NewPrivateWritableFile(
    const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, base_->NewPrivateWritableFile(path));
  return Track(std::move(file), path, OpenMode::kCreateNew);
}

absl::StatusOr<std::unique_ptr<ReadableFile>> FaultFileSystem::NewPrivateReadableFile(
    const std::string& path) {
  return base_->NewPrivateReadableFile(path);
}

std::unique_ptr<WritableFile> FaultFileSystem::Track(std::unique_ptr<WritableFile> file,
                                                     const std::string& path, OpenMode mode) {
  std::shared_ptr<Usage> usage;
  {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<Usage>& entry = files_[path];
    if (entry == nullptr) entry = std::make_shared<Usage>();
    usage = entry;
    // The file as opened: truncation also drops preallocated space.
    usage->size = file->Size();
    if (mode != OpenMode::kAppend) usage->allocated = 0;
  }
  return std::make_unique<FaultWritableFile>(this, std::move(file), path, std::move(usage));
}

absl::StatusOr<std::unique_ptr<ReadableFile>> FaultFileSystem::NewReadableFile(
    const std::string& path) {
  return base_->NewReadableFile(path);
}

absl::StatusOr<FileStat> FaultFileSystem::Stat(const std::string& path) {
  return base_->Stat(path);
}

absl::StatusOr<std::vector<std::string>> FaultFileSystem::ListDir(const std::string& path) {
  return base_->ListDir(path);
}

absl::Status FaultFileSystem::CreateDir(const std::string& path) { return base_->CreateDir(path); }

absl::Status FaultFileSystem::CreateDirs(const std::string& path) {
  return base_->CreateDirs(path);
}

absl::Status FaultFileSystem::DeleteFile(const std::string& path) {
  CKPT_RETURN_IF_ERROR(base_->DeleteFile(path));
  absl::MutexLock lock(&mu_);
  files_.erase(path);
  return absl::OkStatus();
}

absl::Status FaultFileSystem::DeleteDir(const std::string& path) {
  return base_->DeleteDir(path);
}

absl::Status FaultFileSystem::Rename(const std::string& src, const std::string& dst) {
  CKPT_RETURN_IF_ERROR(base_->Rename(src, dst));
  absl::MutexLock lock(&mu_);
  if (src == dst) return absl::OkStatus();
  // Whatever was at dst is gone; what was at or under src is now at or under dst.
  const std::string src_dir = src + "/";
  const std::string dst_dir = dst + "/";
  std::erase_if(files_, [&](const auto& entry) {
    return entry.first == dst || entry.first.starts_with(dst_dir);
  });
  std::vector<std::pair<std::string, std::shared_ptr<Usage>>> moved;
  for (auto it = files_.begin(); it != files_.end();) {
    if (it->first == src) {
      moved.emplace_back(dst, std::move(it->second));
    } else if (it->first.starts_with(src_dir)) {
      moved.emplace_back(dst + it->first.substr(src.size()), std::move(it->second));
    } else {
      ++it;
      continue;
    }
    it = files_.erase(it);
  }
  for (auto& [path, usage] : moved) files_[path] = std::move(usage);
  return absl::OkStatus();
}

absl::Status FaultFileSystem::SyncDir(const std::string& path) {
  {
    absl::MutexLock lock(&mu_);
    CKPT_RETURN_IF_ERROR(CountSyncLocked(path));
  }
  return base_->SyncDir(path);
}

absl::Status FaultFileSystem::Truncate(const std::string& path, uint64_t size_bytes) {
  std::shared_ptr<Usage> usage;
  Usage resized;
  {
    absl::MutexLock lock(&mu_);
    auto it = files_.find(path);
    if (it != files_.end()) {
      usage = it->second;
      resized = *usage;
      // Shrinking frees the blocks past the new end, preallocated ones too.
      if (size_bytes < resized.size) resized.allocated = std::min(resized.allocated, size_bytes);
      resized.size = size_bytes;
      // Check the space now; account it only once the base has truncated.
      if (resized.Counted() > usage->Counted()) {
        Usage probe = *usage;
        CKPT_RETURN_IF_ERROR(ResizeLocked(probe, resized, "truncate", path));
      }
    }
  }
  CKPT_RETURN_IF_ERROR(base_->Truncate(path, size_bytes));
  if (usage != nullptr) {
    absl::MutexLock lock(&mu_);
    *usage = resized;
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> FaultFileSystem::FreeSpaceBytes(const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(uint64_t free_bytes, base_->FreeSpaceBytes(path));
  absl::MutexLock lock(&mu_);
  if (capacity_bytes_ == kUnlimitedCapacity) return free_bytes;
  const uint64_t used = UsedBytesLocked();
  return std::min(free_bytes, capacity_bytes_ > used ? capacity_bytes_ - used : 0);
}

}  // namespace ckpt
