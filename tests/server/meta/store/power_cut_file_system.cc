#include "power_cut_file_system.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace ckpt::meta {
namespace {

namespace fs = std::filesystem;
using rocksdb::IODebugContext;
using rocksdb::IOOptions;
using rocksdb::IOStatus;
using rocksdb::Slice;

std::string Normal(const std::string& path) {
  std::string s = fs::path(path).lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

std::string Parent(const std::string& path) { return Normal(fs::path(path).parent_path()); }

// A file open for writing: forwards to the real file and tells the file
// system what was written and synced.
class File final : public rocksdb::FSWritableFileOwnerWrapper {
 public:
  File(std::unique_ptr<rocksdb::FSWritableFile> target, PowerCutFileSystem* fs, std::string fname,
       std::shared_ptr<PowerCutFileSystem::Inode> inode)
      : FSWritableFileOwnerWrapper(std::move(target)),
        fs_(fs),
        fname_(std::move(fname)),
        inode_(std::move(inode)),
        pos_(inode_->size) {}

  IOStatus Append(const Slice& data, const IOOptions& options, IODebugContext* dbg) override {
    IOStatus s = fs_->CheckPower("append");
    if (s.ok()) s = target()->Append(data, options, dbg);
    if (s.ok()) Grew(data.size());
    return s;
  }
  IOStatus Append(const Slice& data, const IOOptions& options,
                  const rocksdb::DataVerificationInfo& info, IODebugContext* dbg) override {
    IOStatus s = fs_->CheckPower("append");
    if (s.ok()) s = target()->Append(data, options, info, dbg);
    if (s.ok()) Grew(data.size());
    return s;
  }
  IOStatus PositionedAppend(const Slice& data, uint64_t offset, const IOOptions& options,
                            IODebugContext* dbg) override {
    IOStatus s = fs_->CheckPower("positioned append");
    if (s.ok()) s = target()->PositionedAppend(data, offset, options, dbg);
    if (s.ok()) fs_->Appended(inode_.get(), offset + data.size());
    return s;
  }
  IOStatus PositionedAppend(const Slice& data, uint64_t offset, const IOOptions& options,
                            const rocksdb::DataVerificationInfo& info,
                            IODebugContext* dbg) override {
    IOStatus s = fs_->CheckPower("positioned append");
    if (s.ok()) s = target()->PositionedAppend(data, offset, options, info, dbg);
    if (s.ok()) fs_->Appended(inode_.get(), offset + data.size());
    return s;
  }
  IOStatus Truncate(uint64_t size, const IOOptions& options, IODebugContext* dbg) override {
    IOStatus s = fs_->CheckPower("truncate");
    if (s.ok()) s = target()->Truncate(size, options, dbg);
    if (s.ok()) {
      pos_ = size;
      fs_->Truncated(inode_.get(), size);
    }
    return s;
  }
  IOStatus Sync(const IOOptions& options, IODebugContext* dbg) override {
    IOStatus s = fs_->BeforeSync(fname_);
    if (s.ok()) s = target()->Sync(options, dbg);
    if (s.ok()) fs_->Synced(inode_.get(), fname_);
    return s;
  }
  IOStatus Fsync(const IOOptions& options, IODebugContext* dbg) override {
    IOStatus s = fs_->BeforeSync(fname_);
    if (s.ok()) s = target()->Fsync(options, dbg);
    if (s.ok()) fs_->Synced(inode_.get(), fname_);
    return s;
  }
  // sync_file_range: starts writeback, promises nothing (no metadata, no
  // disk cache flush), so nothing becomes durable.
  IOStatus RangeSync(uint64_t offset, uint64_t nbytes, const IOOptions& options,
                     IODebugContext* dbg) override {
    IOStatus s = fs_->CheckPower("range sync");
    if (s.ok()) s = target()->RangeSync(offset, nbytes, options, dbg);
    return s;
  }
  IOStatus Allocate(uint64_t offset, uint64_t len, const IOOptions& options,
                    IODebugContext* dbg) override {
    IOStatus s = fs_->CheckPower("allocate");
    if (s.ok()) s = target()->Allocate(offset, len, options, dbg);
    return s;
  }
  // Close releases the descriptor (also with the power off, so the database
  // can be reopened after the cut) and makes nothing durable.

 private:
  void Grew(uint64_t n) {
    pos_ += n;
    fs_->Appended(inode_.get(), pos_);
  }

  PowerCutFileSystem* const fs_;
  const std::string fname_;
  const std::shared_ptr<PowerCutFileSystem::Inode> inode_;
  uint64_t pos_;  // where the next Append goes
};

class Directory final : public rocksdb::FSDirectoryWrapper {
 public:
  Directory(std::unique_ptr<rocksdb::FSDirectory> target, PowerCutFileSystem* fs, std::string name)
      : FSDirectoryWrapper(std::move(target)), fs_(fs), name_(std::move(name)) {}

  IOStatus Fsync(const IOOptions& options, IODebugContext* dbg) override {
    IOStatus s = fs_->CheckPower("directory fsync");
    if (s.ok()) s = FSDirectoryWrapper::Fsync(options, dbg);
    if (s.ok()) fs_->DirSynced(name_);
    return s;
  }
  IOStatus FsyncWithDirOptions(const IOOptions& options, IODebugContext* dbg,
                               const rocksdb::DirFsyncOptions& dir_options) override {
    IOStatus s = fs_->CheckPower("directory fsync");
    if (s.ok()) s = FSDirectoryWrapper::FsyncWithDirOptions(options, dbg, dir_options);
    if (s.ok()) fs_->DirSynced(name_);
    return s;
  }

 private:
  PowerCutFileSystem* const fs_;
  const std::string name_;
};

}  // namespace

PowerCutFileSystem::PowerCutFileSystem(const std::shared_ptr<rocksdb::FileSystem>& base)
    : FileSystemWrapper(base) {}

void PowerCutFileSystem::PowerOff() {
  absl::MutexLock lock(&mu_);
  powered_ = false;
}

void PowerCutFileSystem::PowerOffAtSync(uint64_t n, std::string suffix) {
  absl::MutexLock lock(&mu_);
  off_at_sync_ = n;
  off_at_sync_suffix_ = std::move(suffix);
}

bool PowerCutFileSystem::powered() const {
  absl::MutexLock lock(&mu_);
  return powered_;
}

uint64_t PowerCutFileSystem::syncs(const std::string& suffix) const {
  absl::MutexLock lock(&mu_);
  uint64_t n = 0;
  for (const auto& [path, count] : syncs_) {
    if (absl::EndsWith(path, suffix)) n += count;
  }
  return n;
}

IOStatus PowerCutFileSystem::CheckPower(const char* what) const {
  absl::MutexLock lock(&mu_);
  if (powered_) return IOStatus::OK();
  return IOStatus::IOError(absl::StrCat("power cut (", what, ")"));
}

IOStatus PowerCutFileSystem::BeforeSync(const std::string& fname) {
  absl::MutexLock lock(&mu_);
  if (powered_ && off_at_sync_ > 0 && absl::EndsWith(fname, off_at_sync_suffix_) &&
      --off_at_sync_ == 0) {
    powered_ = false;
  }
  if (powered_) return IOStatus::OK();
  return IOStatus::IOError(absl::StrCat("power cut (sync of ", fname, ")"));
}

void PowerCutFileSystem::Appended(Inode* inode, uint64_t end) {
  absl::MutexLock lock(&mu_);
  if (end > inode->size) inode->size = end;
}

void PowerCutFileSystem::Truncated(Inode* inode, uint64_t size) {
  absl::MutexLock lock(&mu_);
  inode->size = size;
  if (inode->synced > size) inode->synced = size;
}

void PowerCutFileSystem::Synced(Inode* inode, const std::string& fname) {
  absl::MutexLock lock(&mu_);
  inode->synced = inode->size;
  ++syncs_[Normal(fname)];
}

void PowerCutFileSystem::DirSynced(const std::string& dir) {
  const std::string d = Normal(dir);
  absl::MutexLock lock(&mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = it->second;
    if (!e.durable && Parent(it->first) == d) {
      e.durable = true;
      e.prior.reset();
      if (e.inode == nullptr) {
        it = entries_.erase(it);
        continue;
      }
    }
    ++it;
  }
}

PowerCutFileSystem::Entry& PowerCutFileSystem::EntryFor(const std::string& path) {
  auto [it, inserted] = entries_.try_emplace(path);
  if (inserted) {
    std::error_code ec;
    const uintmax_t size = fs::file_size(path, ec);
    if (!ec) it->second.inode = std::make_shared<Inode>(Inode{size, size});
  }
  return it->second;
}

void PowerCutFileSystem::Changing(const std::string& path) {
  Entry& e = EntryFor(path);
  if (!e.durable) return;  // already changed: its prior stays
  e.durable = false;
  e.prior.reset();
  if (e.inode != nullptr) {
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    bytes.resize(std::min<uint64_t>(bytes.size(), e.inode->synced));
    e.prior = std::move(bytes);
  }
}

IOStatus PowerCutFileSystem::OpenWritable(const std::string& fname,
                                          const rocksdb::FileOptions& options, bool truncate,
                                          std::unique_ptr<rocksdb::FSWritableFile>* result,
                                          IODebugContext* dbg) {
  IOStatus s = CheckPower(truncate ? "create" : "reopen");
  if (!s.ok()) return s;
  const std::string path = Normal(fname);
  std::shared_ptr<Inode> inode;
  {
    absl::MutexLock lock(&mu_);
    Entry& e = EntryFor(path);
    const bool existed = e.inode != nullptr;
    if (!existed) Changing(path);  // a new name in the directory
    std::unique_ptr<rocksdb::FSWritableFile> file;
    s = truncate ? target()->NewWritableFile(fname, options, &file, dbg)
                 : target()->ReopenWritableFile(fname, options, &file, dbg);
    if (!s.ok()) return s;
    if (!existed || truncate) e.inode = std::make_shared<Inode>();
    inode = e.inode;
    *result = std::make_unique<File>(std::move(file), this, path, inode);
  }
  return s;
}

IOStatus PowerCutFileSystem::NewWritableFile(const std::string& fname,
                                             const rocksdb::FileOptions& options,
                                             std::unique_ptr<rocksdb::FSWritableFile>* result,
                                             IODebugContext* dbg) {
  return OpenWritable(fname, options, /*truncate=*/true, result, dbg);
}

IOStatus PowerCutFileSystem::ReopenWritableFile(const std::string& fname,
                                                const rocksdb::FileOptions& options,
                                                std::unique_ptr<rocksdb::FSWritableFile>* result,
                                                IODebugContext* dbg) {
  return OpenWritable(fname, options, /*truncate=*/false, result, dbg);
}

IOStatus PowerCutFileSystem::ReuseWritableFile(const std::string&, const std::string&,
                                               const rocksdb::FileOptions&,
                                               std::unique_ptr<rocksdb::FSWritableFile>*,
                                               IODebugContext*) {
  return IOStatus::NotSupported("PowerCutFileSystem: ReuseWritableFile (WAL recycling)");
}

IOStatus PowerCutFileSystem::NewDirectory(const std::string& name, const IOOptions& options,
                                          std::unique_ptr<rocksdb::FSDirectory>* result,
                                          IODebugContext* dbg) {
  std::unique_ptr<rocksdb::FSDirectory> dir;
  IOStatus s = target()->NewDirectory(name, options, &dir, dbg);
  if (s.ok()) *result = std::make_unique<Directory>(std::move(dir), this, name);
  return s;
}

IOStatus PowerCutFileSystem::DeleteFile(const std::string& fname, const IOOptions& options,
                                        IODebugContext* dbg) {
  IOStatus s = CheckPower("delete");
  if (!s.ok()) return s;
  const std::string path = Normal(fname);
  absl::MutexLock lock(&mu_);
  Changing(path);
  s = target()->DeleteFile(fname, options, dbg);
  if (s.ok()) entries_[path].inode = nullptr;
  return s;
}

IOStatus PowerCutFileSystem::RenameFile(const std::string& src, const std::string& target_name,
                                        const IOOptions& options, IODebugContext* dbg) {
  IOStatus s = CheckPower("rename");
  if (!s.ok()) return s;
  const std::string from = Normal(src), to = Normal(target_name);
  absl::MutexLock lock(&mu_);
  Changing(from);
  Changing(to);
  s = target()->RenameFile(src, target_name, options, dbg);
  if (s.ok() && from != to) {
    entries_[to].inode = std::move(entries_[from].inode);
    entries_[from].inode = nullptr;
  }
  return s;
}

IOStatus PowerCutFileSystem::LinkFile(const std::string& src, const std::string& target_name,
                                      const IOOptions& options, IODebugContext* dbg) {
  IOStatus s = CheckPower("link");
  if (!s.ok()) return s;
  const std::string from = Normal(src), to = Normal(target_name);
  absl::MutexLock lock(&mu_);
  EntryFor(from);
  Changing(to);
  s = target()->LinkFile(src, target_name, options, dbg);
  if (s.ok()) entries_[to].inode = entries_[from].inode;
  return s;
}

IOStatus PowerCutFileSystem::Truncate(const std::string& fname, size_t size,
                                      const IOOptions& options, IODebugContext* dbg) {
  IOStatus s = CheckPower("truncate");
  if (!s.ok()) return s;
  const std::string path = Normal(fname);
  absl::MutexLock lock(&mu_);
  Entry& e = EntryFor(path);
  s = target()->Truncate(fname, size, options, dbg);
  if (s.ok() && e.inode != nullptr) {
    e.inode->size = size;
    if (e.inode->synced > size) e.inode->synced = size;
  }
  return s;
}

IOStatus PowerCutFileSystem::CreateDir(const std::string& dirname, const IOOptions& options,
                                       IODebugContext* dbg) {
  IOStatus s = CheckPower("mkdir");
  return s.ok() ? target()->CreateDir(dirname, options, dbg) : s;
}

IOStatus PowerCutFileSystem::CreateDirIfMissing(const std::string& dirname,
                                                const IOOptions& options, IODebugContext* dbg) {
  IOStatus s = CheckPower("mkdir");
  return s.ok() ? target()->CreateDirIfMissing(dirname, options, dbg) : s;
}

IOStatus PowerCutFileSystem::DeleteDir(const std::string& dirname, const IOOptions& options,
                                       IODebugContext* dbg) {
  IOStatus s = CheckPower("rmdir");
  return s.ok() ? target()->DeleteDir(dirname, options, dbg) : s;
}

absl::Status PowerCutFileSystem::Cut() {
  absl::MutexLock lock(&mu_);
  for (const auto& [path, e] : entries_) {
    std::error_code ec;
    if (!e.durable) {
      // Undo the directory change: the name holds what it held when the
      // directory was last synced.
      fs::remove(path, ec);
      if (ec) return absl::InternalError(absl::StrCat("power cut: removing ", path, ": ", ec.message()));
      if (e.prior.has_value()) {
        std::ofstream out(path, std::ios::binary | std::ios::trunc);
        out.write(e.prior->data(), static_cast<std::streamsize>(e.prior->size()));
        out.close();
        if (!out) return absl::InternalError(absl::StrCat("power cut: restoring ", path));
      }
      continue;
    }
    if (e.inode == nullptr) continue;
    const uintmax_t size = fs::file_size(path, ec);
    if (ec == std::errc::no_such_file_or_directory) continue;  // removed behind our back
    if (ec) return absl::InternalError(absl::StrCat("power cut: size of ", path, ": ", ec.message()));
    if (size > e.inode->synced) {
      fs::resize_file(path, e.inode->synced, ec);
      if (ec) return absl::InternalError(absl::StrCat("power cut: truncating ", path, ": ", ec.message()));
    }
  }
  entries_.clear();
  powered_ = true;
  off_at_sync_ = 0;
  return absl::OkStatus();
}

}  // namespace ckpt::meta
