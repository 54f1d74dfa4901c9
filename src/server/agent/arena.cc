#include "server/agent/arena.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "common/endian.h"
#include "common/lock_check.h"
#include "common/log.h"
#include "common/names.h"
#include "common/prefault.h"
#include "common/status_macros.h"

namespace ckpt::agent {
namespace {

// Rounds up to whole pages; values within a page of 2^64 saturate to the
// largest page multiple (callers compare against the capacity first).
uint64_t RoundUp(uint64_t v) {
  if (v > UINT64_MAX - (kArenaPageBytes - 1)) return UINT64_MAX / kArenaPageBytes * kArenaPageBytes;
  return (v + kArenaPageBytes - 1) / kArenaPageBytes * kArenaPageBytes;
}

absl::Status Errno(const std::string& what, int err) {
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOSPC || err == ENOMEM || err == EDQUOT) return absl::ResourceExhaustedError(msg);
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  return absl::UnavailableError(msg);
}


absl::StatusOr<uint64_t> ParseHex(const nlohmann::json& j, const char* key) {
  if (!j.contains(key) || !j[key].is_string()) {
    return absl::InvalidArgumentError(absl::StrCat("record: missing string field \"", key, "\""));
  }
  const std::string s = j[key].get<std::string>();
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 16);
  if (errno != 0 || end == s.c_str() || *end != '\0') {
    return absl::InvalidArgumentError(absl::StrCat("record: field \"", key, "\" is not hex"));
  }
  return static_cast<uint64_t>(v);
}

}  // namespace

const char* CopyRoleName(CopyRole role) {
  switch (role) {
    case CopyRole::kPrimary: return "primary";
    case CopyRole::kReplica: return "replica";
    case CopyRole::kRestored: return "restored";
  }
  return "unknown";
}

void SetItems(ShardRecord& r, std::vector<ManifestItem> items) {
  r.packed = EncodeManifest(items);
  r.manifest_digest = ManifestDigestOfEncoding(r.packed);
  r.items = std::move(items);
}

std::string PackedManifest(const ShardRecord& r) {
  return r.packed.empty() ? EncodeManifest(r.items) : r.packed;
}

std::string ShardIdString(const ShardId& id) {
  return absl::StrCat(id.job_id, "/", id.step, "/", id.rank);
}

std::string SegmentIdString(const SegmentId& id) {
  return absl::StrCat(id.job_id, "/", id.step, "/g", id.group, ".s", id.stripe, ".p", id.position);
}

namespace {

// Record format 2 (docs/agent.md "Records"): little-endian fixed-width
// integers and u32-length-prefixed strings in field order, the manifest in its
// canonical encoding, and a CRC-32C of everything before it.
constexpr std::string_view kRecordTag = "ckpt-record-v2\n";

// Format 1: the JSON records of earlier versions (still re-adopted).
absl::StatusOr<ShardRecord> DecodeJsonRecord(std::string_view json) {
  try {
    const nlohmann::json j = nlohmann::json::parse(json);
    if (j.value("format", 0) != 1) return absl::InvalidArgumentError("record: unknown format");
    ShardRecord r;
    r.id.job_id = j.at("job").get<std::string>();
    CKPT_RETURN_IF_ERROR(ValidateJobId(r.id.job_id));
    r.id.step = j.at("step").get<uint64_t>();
    r.id.rank = j.at("rank").get<uint32_t>();
    const int role = j.at("role").get<int>();
    if (role < 1 || role > 3) return absl::InvalidArgumentError(absl::StrCat("record: unknown role ", role));
    r.role = static_cast<CopyRole>(role);
    r.size_bytes = j.at("size").get<uint64_t>();
    r.crc32c = j.at("crc32c").get<uint32_t>();
    CKPT_ASSIGN_OR_RETURN(r.manifest_digest, ParseHex(j, "digest"));
    r.run_id = j.value("run_id", "");
    r.staged_unix_ms = j.value("staged_ms", int64_t{0});
    r.durable_path = j.value("durable_path", "");
    r.seq = j.value("seq", uint64_t{0});
    if (j.contains("segment")) {
      const auto& g = j.at("segment");
      r.segment = SegmentId{r.id.job_id, r.id.step, g.at(0).get<uint32_t>(), g.at(1).get<uint32_t>(),
                            g.at(2).get<uint32_t>()};
      const int kind = g.at(3).get<int>();
      if (kind != 1 && kind != 2) return absl::InvalidArgumentError(absl::StrCat("record: unknown segment kind ", kind));
      r.segment_kind = static_cast<SegmentKind>(kind);
    }
    for (const auto& e : j.at("extents")) {
      r.extents.push_back(Extent{e.at(0).get<uint64_t>(), e.at(1).get<uint64_t>()});
    }
    for (const auto& ji : j.at("items")) {
      ManifestItem it;
      it.name = ji.at("name").get<std::string>();
      it.dtype = ji.at("dtype").get<int>();
      it.shape = ji.at("shape").get<std::vector<uint64_t>>();
      it.offset_bytes = ji.at("offset").get<uint64_t>();
      it.length_bytes = ji.at("length").get<uint64_t>();
      it.crc32c = ji.at("crc32c").get<uint32_t>();
      if (ji.contains("attributes")) {
        it.attributes = ji.at("attributes").get<std::map<std::string, std::string>>();
      }
      r.items.push_back(std::move(it));
    }
    return r;
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("record: ", e.what()));
  }
}


}  // namespace

std::string EncodeShardRecord(const ShardRecord& r) {
  const std::string manifest = PackedManifest(r);
  LeWriter w(manifest.size() + 256 + r.id.job_id.size() + r.run_id.size() + r.durable_path.size() +
                 16 * r.extents.size());
  w.Raw(kRecordTag);
  w.Str(r.id.job_id);
  w.U64(r.id.step);
  w.U32(r.id.rank);
  w.U32(static_cast<uint32_t>(r.role));
  w.U64(r.size_bytes);
  w.U32(r.crc32c);
  w.U64(r.manifest_digest);
  w.Str(r.run_id);
  w.U64(static_cast<uint64_t>(r.staged_unix_ms));
  w.Str(r.durable_path);
  w.U64(r.seq);
  w.U8(r.segment ? 1 : 0);
  if (r.segment) {
    w.U32(r.segment->group);
    w.U32(r.segment->stripe);
    w.U32(r.segment->position);
    w.U32(static_cast<uint32_t>(r.segment_kind));
  }
  w.U32(static_cast<uint32_t>(r.extents.size()));
  for (const Extent& e : r.extents) {
    w.U64(e.offset);
    w.U64(e.length);
  }
  w.Str(manifest);
  w.U32(Crc32c(w.out()));
  return std::move(w.out());
}

absl::StatusOr<ShardRecord> DecodeShardRecord(std::string_view bytes) {
  if (!bytes.empty() && bytes.front() == '{') return DecodeJsonRecord(bytes);
  if (bytes.substr(0, kRecordTag.size()) != kRecordTag) {
    return absl::InvalidArgumentError("record: unknown format");
  }
  if (bytes.size() < kRecordTag.size() + 4) return absl::InvalidArgumentError("record: truncated");
  const std::string_view body = bytes.substr(0, bytes.size() - 4);
  LeReader crc_reader(bytes.substr(body.size()));
  if (crc_reader.U32() != Crc32c(body)) {
    return absl::InvalidArgumentError("record: its crc32c does not match (torn or corrupt)");
  }
  LeReader in(body.substr(kRecordTag.size()));
  ShardRecord r;
  r.id.job_id = std::string(in.Str());
  r.id.step = in.U64();
  r.id.rank = in.U32();
  const uint32_t role = in.U32();
  r.size_bytes = in.U64();
  r.crc32c = in.U32();
  r.manifest_digest = in.U64();
  r.run_id = std::string(in.Str());
  r.staged_unix_ms = static_cast<int64_t>(in.U64());
  r.durable_path = std::string(in.Str());
  r.seq = in.U64();
  uint32_t segment_kind = 1;
  if (in.U8() != 0) {
    SegmentId seg{r.id.job_id, r.id.step, 0, 0, 0};
    seg.group = in.U32();
    seg.stripe = in.U32();
    seg.position = in.U32();
    r.segment = seg;
    segment_kind = in.U32();
  }
  const uint32_t extents = in.U32();
  if (!in.ok() || extents > in.left() / 16) return absl::InvalidArgumentError("record: truncated");
  r.extents.reserve(extents);
  for (uint32_t i = 0; i < extents; ++i) {
    const uint64_t off = in.U64();
    r.extents.push_back(Extent{off, in.U64()});
  }
  const std::string_view manifest = in.Str();
  if (!in.ok() || in.left() != 0) return absl::InvalidArgumentError("record: truncated or with trailing bytes");
  CKPT_RETURN_IF_ERROR(ValidateJobId(r.id.job_id));
  if (role < 1 || role > 3) return absl::InvalidArgumentError(absl::StrCat("record: unknown role ", role));
  r.role = static_cast<CopyRole>(role);
  if (segment_kind != 1 && segment_kind != 2) {
    return absl::InvalidArgumentError(absl::StrCat("record: unknown segment kind ", segment_kind));
  }
  r.segment_kind = static_cast<SegmentKind>(segment_kind);
  absl::StatusOr<std::vector<ManifestItem>> items = DecodeManifest(manifest);
  if (!items.ok()) return absl::InvalidArgumentError(absl::StrCat("record: ", items.status().message()));
  r.items = *std::move(items);
  r.packed = std::string(manifest);
  return r;
}

// ---------------------------------------------------------------------------
// Reservation

Reservation::Reservation(Arena* arena, std::vector<Extent> extents)
    : arena_(arena), extents_(std::move(extents)) {
  for (const Extent& e : extents_) reserved_ += e.length;
  arena_->live_.fetch_add(1);
}

Reservation::~Reservation() {
  arena_->Free(extents_);
  arena_->live_.fetch_sub(1);
}

transport::ConstPieces Reservation::Pieces(uint64_t offset, uint64_t length) const {
  transport::ConstPieces out;
  uint64_t pos = 0;  // reservation offset of the current extent
  for (const Extent& e : extents_) {
    if (length == 0) break;
    const uint64_t end = pos + e.length;
    if (offset < end) {
      const uint64_t in = offset - pos;
      const uint64_t n = std::min(length, e.length - in);
      out.emplace_back(arena_->Data(e.offset + in), n);
      offset += n;
      length -= n;
    }
    pos = end;
  }
  return out;
}

transport::MutablePieces Reservation::MutablePieces(uint64_t offset, uint64_t length) const {
  transport::MutablePieces out;
  for (const auto& p : Pieces(offset, length)) out.emplace_back(const_cast<std::byte*>(p.data()), p.size());
  return out;
}

uint32_t Reservation::Crc(uint64_t offset, uint64_t length) const {
  return Crc32cOfPieces(Pieces(offset, length));
}

void Reservation::CopyOut(uint64_t offset, std::span<std::byte> out) const {
  uint64_t done = 0;
  for (const auto& p : Pieces(offset, out.size())) {
    std::memcpy(out.data() + done, p.data(), p.size());
    done += p.size();
  }
}

void Reservation::CopyIn(uint64_t offset, std::span<const std::byte> in) const {
  uint64_t done = 0;
  for (const auto& p : MutablePieces(offset, in.size())) {
    std::memcpy(p.data(), in.data() + done, p.size());
    done += p.size();
  }
}

void Reservation::Zero(uint64_t offset, uint64_t length) const {
  for (const auto& p : MutablePieces(offset, length)) std::memset(p.data(), 0, p.size());
}

std::vector<Extent> Reservation::TrimmedExtents(uint64_t size_bytes) const {
  uint64_t keep = RoundUp(std::max<uint64_t>(size_bytes, 1));
  std::vector<Extent> out;
  for (const Extent& e : extents_) {
    if (keep == 0) break;
    out.push_back(Extent{e.offset, std::min(keep, e.length)});
    keep -= out.back().length;
  }
  return out;
}

void Reservation::Trim(uint64_t size_bytes) {
  std::vector<Extent> keep = TrimmedExtents(size_bytes);
  std::vector<Extent> tail;
  for (size_t i = 0; i < extents_.size(); ++i) {
    const Extent& e = extents_[i];
    if (i >= keep.size()) {
      tail.push_back(e);
    } else if (keep[i].length < e.length) {
      tail.push_back(Extent{e.offset + keep[i].length, e.length - keep[i].length});
    }
  }
  arena_->Free(tail);
  extents_ = std::move(keep);
  reserved_ = 0;
  for (const Extent& e : extents_) reserved_ += e.length;
}

// ---------------------------------------------------------------------------
// Arena

namespace {

constexpr mode_t kDirMode = 0700;
constexpr mode_t kPoolMode = 0600;
constexpr char kPoolName[] = "pool.bin";

// A refusal of the tier as found: what to remove, then start again.
absl::Status Refused(const absl::Status& why) {
  return absl::FailedPreconditionError(
      absl::StrCat("memory tier: ", why.message(), ", then start the agent again"));
}

// Closes a descriptor when it goes out of scope.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// Opens directory `name` of directory `at` (AT_FDCWD: `name` is a path),
// creating it with mode 0700 if it is missing. One that is already there
// must be the agent's own and writable by no one else (checked with lstat,
// then again on the opened descriptor); one that others may read is
// narrowed to 0700. `path` names it in messages.
absl::StatusOr<int> OpenTierDir(int at, const std::string& name, const std::string& path) {
  if (::mkdirat(at, name.c_str(), kDirMode) != 0 && errno != EEXIST) {
    return Errno(absl::StrCat("create memory directory '", path, "'"), errno);
  }
  struct stat st {};
  if (::fstatat(at, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return Errno(absl::StrCat("stat '", path, "'"), errno);
  }
  if (absl::Status s = CheckPrivateEntry(path, PrivateKind::kDirectory, st.st_mode, st.st_uid, st.st_nlink,
                                         kNoWriteByOthers);
      !s.ok()) {
    return Refused(s);
  }
  Fd fd(::openat(at, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.get() < 0) return Errno(absl::StrCat("open directory '", path, "'"), errno);
  if (::fstat(fd.get(), &st) != 0) return Errno(absl::StrCat("stat '", path, "'"), errno);
  if (absl::Status s = CheckPrivateEntry(path, PrivateKind::kDirectory, st.st_mode, st.st_uid, st.st_nlink,
                                         kNoWriteByOthers);
      !s.ok()) {
    return Refused(s);
  }
  // Also clears a set-group-id bit inherited from the parent.
  if ((st.st_mode & 07777) != kDirMode) {
    if (::fchmod(fd.get(), kDirMode) != 0) {
      return Errno(absl::StrFormat("narrow '%s' (mode %04o) to 0700", path, st.st_mode & 07777), errno);
    }
    log::Info("memory tier: '{}' narrowed from mode {:04o} to 0700", path, st.st_mode & 07777);
  }
  return fd.release();
}

// Opens (creating, mode 0600, if missing) the pool in directory `dir_fd`; a
// pool already there must be the agent's own, a regular file with one link,
// open to no one else.
absl::StatusOr<int> OpenPool(int dir_fd, const std::string& path) {
  int raw = ::openat(dir_fd, kPoolName, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, kPoolMode);
  if (raw < 0 && errno == EEXIST) {
    // Say what is there before opening it (a fifo would block the open).
    struct stat st {};
    if (::fstatat(dir_fd, kPoolName, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      return Errno(absl::StrCat("stat '", path, "'"), errno);
    }
    if (absl::Status s =
            CheckPrivateEntry(path, PrivateKind::kFile, st.st_mode, st.st_uid, st.st_nlink, kNoAccessByOthers);
        !s.ok()) {
      return Refused(s);
    }
    raw = ::openat(dir_fd, kPoolName, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
  }
  if (raw < 0) return Errno(absl::StrCat("open '", path, "'"), errno);
  Fd fd(raw);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return Errno(absl::StrCat("stat '", path, "'"), errno);
  if (absl::Status s =
          CheckPrivateEntry(path, PrivateKind::kFile, st.st_mode, st.st_uid, st.st_nlink, kNoAccessByOthers);
      !s.ok()) {
    return Refused(s);
  }
  // A umask may have made it narrower than 0600 (the agent reopens it
  // read-write after a restart).
  if ((st.st_mode & 07777) != kPoolMode && ::fchmod(fd.get(), kPoolMode) != 0) {
    return Errno(absl::StrFormat("set '%s' (mode %04o) to 0600", path, st.st_mode & 07777), errno);
  }
  return fd.release();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Arena>> Arena::Open(const Options& options) {
  if (options.capacity_bytes == 0) {
    return absl::InvalidArgumentError("memory capacity must be larger than 0");
  }
  if (options.capacity_bytes > (uint64_t{1} << 56)) {
    return absl::InvalidArgumentError(absl::StrCat("memory capacity of ", options.capacity_bytes,
                                                   " bytes is beyond what a pool can map"));
  }
  std::unique_ptr<Arena> arena(new Arena());
  CKPT_RETURN_IF_ERROR(arena->Init(options));
  CKPT_RETURN_IF_ERROR(arena->Adopt());
  return arena;
}

absl::Status Arena::Init(const Options& options) {
  fs_ = options.fs != nullptr ? options.fs : PosixFileSystem();
  dir_ = options.dir;
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  if (dir_.empty()) return absl::InvalidArgumentError("the memory directory must be named");
  pool_path_ = absl::StrCat(dir_, "/", kPoolName);
  records_dir_ = dir_ + "/records";
  capacity_ = RoundUp(options.capacity_bytes);
  // The parents are ordinary directories (e.g. /dev/shm); the memory
  // directory itself and everything in it are the agent's alone.
  if (const std::filesystem::path parent = std::filesystem::path(dir_).parent_path(); !parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    if (ec) {
      return absl::UnavailableError(absl::StrCat("create the parent of memory directory '", dir_, "': ", ec.message()));
    }
  }
  CKPT_ASSIGN_OR_RETURN(const int dir_fd, OpenTierDir(AT_FDCWD, dir_, dir_));
  const Fd dir(dir_fd);
  // One agent per tier: a directory descriptor of our own (never handed to
  // clients, closed on exec) carries the lock, released when we close it or die.
  dir_lock_fd_ = ::openat(dir.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_lock_fd_ < 0) return Errno(absl::StrCat("open directory '", dir_, "'"), errno);
  if (::flock(dir_lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "memory directory '", dir_, "' is in use by another process (a ckpt-agent serving this tier): ",
          "stop it first, or give each agent its own --memory-dir"));
    }
    return Errno(absl::StrCat("lock directory '", dir_, "'"), errno);
  }
  {
    CKPT_ASSIGN_OR_RETURN(const int records_fd, OpenTierDir(dir.get(), "records", records_dir_));
    ::close(records_fd);
  }
  // Clients get the pool as a descriptor over their session socket
  // (SCM_RIGHTS, session_server.h): no one else needs to open it by name.
  CKPT_ASSIGN_OR_RETURN(fd_, OpenPool(dir.get(), pool_path_));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return Errno(absl::StrCat("stat '", pool_path_, "'"), errno);
  if (static_cast<uint64_t>(st.st_size) != capacity_ &&
      ::ftruncate(fd_, static_cast<off_t>(capacity_)) != 0) {
    return Errno(absl::StrCat("resize '", pool_path_, "'"), errno);
  }
  if (options.populate) {
    // Allocate every page of the tmpfs file now (keeps existing contents).
    const int rc = ::posix_fallocate(fd_, 0, static_cast<off_t>(capacity_));
    if (rc != 0) {
      // Give back what the failed reservation took: a full tmpfs would
      // starve everything else on the node. Existing bytes (up to the old
      // size) are kept for a later start with a smaller budget.
      if (::ftruncate(fd_, st.st_size) != 0) {
        log::Warn("cannot shrink '{}' back after a failed reservation: {}", pool_path_, std::strerror(errno));
      }
      struct statfs sfs {};
      std::string avail = "unknown";
      if (::fstatfs(fd_, &sfs) == 0) {
        avail = absl::StrCat(static_cast<uint64_t>(sfs.f_bavail) * sfs.f_bsize);
      }
      return Errno(absl::StrCat("reserve ", capacity_, " bytes for '", pool_path_,
                                "' (the file system has ", avail,
                                " bytes available; lower --memory or grow the tmpfs)"),
                   rc);
    }
  }
  const int flags = MAP_SHARED | (options.populate ? MAP_POPULATE : 0);
  void* p = ::mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, flags, fd_, 0);
  if (p == MAP_FAILED) return Errno(absl::StrCat("map '", pool_path_, "'"), errno);
  base_ = static_cast<std::byte*>(p);
  // Verifying and flushing a shard must not pay the first-touch cost of a
  // fresh mapping either (contents are kept: re-adoption reads them next).
  if (options.populate) PrefaultForWrite(base_, capacity_, kArenaPageBytes);
  CheckedLock lock(&mu_);
  free_[0] = capacity_;
  free_total_ = capacity_;
  return absl::OkStatus();
}

Arena::~Arena() {
  adopted_.clear();  // reservations nobody took
  if (live_.load() != 0) {
    log::Error("memory tier closed with {} reservations still alive (a component outlived the arena)", live_.load());
  }
  if (base_ != nullptr) ::munmap(base_, capacity_);
  if (fd_ >= 0) ::close(fd_);
  if (dir_lock_fd_ >= 0) ::close(dir_lock_fd_);  // releases the tier's lock
}

namespace {

// What identifies a holding across its records: a shard copy or a segment.
std::string HoldingKey(const ShardRecord& r) {
  if (r.segment) return absl::StrCat("seg:", SegmentIdString(*r.segment));
  return absl::StrCat("shard:", ShardIdString(r.id));
}

}  // namespace

absl::Status Arena::Adopt() {
  absl::StatusOr<std::vector<std::string>> names = fs_->ListDir(records_dir_);
  if (!names.ok()) return names.status();
  auto remove = [&](const std::string& name) {
    if (absl::Status s = fs_->DeleteFile(records_dir_ + "/" + name); !s.ok() && !absl::IsNotFound(s)) {
      log::Warn("memory tier: cannot remove '{}/{}': {}", records_dir_, name, s.ToString());
    }
  };
  auto lose = [&](const std::string& name, ShardId id, std::string reason) {
    log::Warn("memory tier: dropping holding {} ({}): {}", ShardIdString(id), name, reason);
    lost_.push_back(LostHolding{std::move(id), name, std::move(reason)});
    remove(name);
  };
  // The newest record of each holding; older ones were superseded (a crash
  // between writing a new record and removing the old one).
  std::map<std::string, ShardRecord> newest;
  uint64_t max_seq = 0;
  for (const std::string& name : *names) {
    const std::string path = records_dir_ + "/" + name;
    if (name.size() < 4 || name.substr(name.size() - 4) != ".rec") {
      remove(name);  // a temp file of an interrupted record write
      continue;
    }
    absl::StatusOr<std::string> text = ReadPrivateFileToString(fs_, path);
    if (absl::IsFailedPrecondition(text.status()) || absl::IsPermissionDenied(text.status())) {
      // Not the agent's own (or a link, or not a file): someone else's
      // record must not decide what the pool holds. The operator removes it.
      lost_.clear();
      return Refused(text.status());
    }
    if (!text.ok()) {
      lose(name, {}, std::string(text.status().message()));
      continue;
    }
    absl::StatusOr<ShardRecord> rec = DecodeShardRecord(*text);
    if (!rec.ok()) {
      lose(name, {}, std::string(rec.status().message()));
      continue;
    }
    rec->file = name;
    max_seq = std::max(max_seq, rec->seq);
    auto [it, added] = newest.emplace(HoldingKey(*rec), *rec);
    if (added) continue;
    ShardRecord& kept = it->second;
    const bool newer = rec->seq > kept.seq || (rec->seq == kept.seq && rec->file > kept.file);
    const std::string old = newer ? kept.file : rec->file;
    if (newer) kept = *std::move(rec);
    log::Info("memory tier: record {} superseded by {}", old, kept.file);
    remove(old);
  }
  {
    CheckedLock lock(&mu_);
    last_seq_ = max_seq;
  }
  for (auto& [key, rec] : newest) {
    // The extents must lie inside the pool (no sum may wrap), be free, and
    // cover the size.
    uint64_t covered = 0;
    bool fits = true;
    {
      CheckedLock lock(&mu_);
      for (const Extent& e : rec.extents) {
        if (e.length == 0 || e.offset % kArenaPageBytes != 0 || e.length > capacity_ ||
            e.offset > capacity_ - e.length || covered > UINT64_MAX - e.length || !ExtentFreeLocked(e)) {
          fits = false;
          break;
        }
        covered += e.length;
      }
      // Two extents of one record must not overlap each other either.
      std::vector<Extent> sorted = rec.extents;
      std::sort(sorted.begin(), sorted.end(), [](const Extent& a, const Extent& b) { return a.offset < b.offset; });
      for (size_t i = 1; fits && i < sorted.size(); ++i) {
        if (sorted[i - 1].offset + sorted[i - 1].length > sorted[i].offset) fits = false;
      }
    }
    if (!fits || covered < rec.size_bytes) {
      lose(rec.file, rec.id, "record's extents lie outside the pool or overlap another holding");
      continue;
    }
    uint32_t crc = 0;
    uint64_t left = rec.size_bytes;
    for (const Extent& e : rec.extents) {
      if (left == 0) break;
      const uint64_t n = std::min(left, e.length);
      crc = Crc32cExtend(crc, Data(e.offset), n);
      left -= n;
    }
    if (crc != rec.crc32c) {
      lose(rec.file, rec.id, absl::StrFormat("crc32c 0x%08x != recorded 0x%08x", crc, rec.crc32c));
      continue;
    }
    {
      CheckedLock lock(&mu_);
      for (const Extent& e : rec.extents) ReserveLocked(e);
    }
    ReservationPtr bytes(new Reservation(this, rec.extents));
    adopted_.push_back(AdoptedHolding{std::move(rec), std::move(bytes)});
  }
  return absl::OkStatus();
}

std::vector<AdoptedHolding> Arena::TakeAdopted() { return std::move(adopted_); }

bool Arena::ExtentFreeLocked(const Extent& e) const {
  auto it = free_.upper_bound(e.offset);
  if (it == free_.begin()) return false;
  --it;
  return it->first <= e.offset && it->first + it->second >= e.offset + e.length;
}

void Arena::ReserveLocked(const Extent& e) {
  auto it = std::prev(free_.upper_bound(e.offset));
  const uint64_t hole_off = it->first;
  const uint64_t hole_len = it->second;
  free_.erase(it);
  if (e.offset > hole_off) free_[hole_off] = e.offset - hole_off;
  const uint64_t end = e.offset + e.length;
  if (hole_off + hole_len > end) free_[end] = hole_off + hole_len - end;
  free_total_ -= e.length;
}

absl::StatusOr<ReservationPtr> Arena::Reserve(uint64_t size_bytes) {
  if (size_bytes > capacity_) {
    return absl::ResourceExhaustedError(absl::StrCat("needs ", size_bytes, " bytes, the pool has ", capacity_));
  }
  const uint64_t want = RoundUp(std::max<uint64_t>(size_bytes, 1));
  std::vector<Extent> out;
  {
    CheckedLock lock(&mu_);
    if (want > free_total_) {
      return absl::ResourceExhaustedError(absl::StrCat("needs ", want, " bytes, ", free_total_, " free"));
    }
    // First fit in one extent.
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second >= want) {
        out.push_back(Extent{it->first, want});
        break;
      }
    }
    if (out.empty()) {
      // Otherwise gather the largest holes first (fewest extents).
      std::vector<std::pair<uint64_t, uint64_t>> holes(free_.begin(), free_.end());
      std::sort(holes.begin(), holes.end(), [](auto& a, auto& b) { return a.second > b.second; });
      uint64_t left = want;
      for (const auto& [off, len] : holes) {
        if (left == 0) break;
        const uint64_t take = std::min(len, left);
        out.push_back(Extent{off, take});
        left -= take;
      }
      std::sort(out.begin(), out.end(), [](const Extent& a, const Extent& b) { return a.offset < b.offset; });
    }
    for (const Extent& e : out) ReserveLocked(e);
  }
  return ReservationPtr(new Reservation(this, std::move(out)));
}

void Arena::Free(std::span<const Extent> extents) {
  CheckedLock lock(&mu_);
  for (const Extent& e : extents) {
    if (e.length == 0) continue;
    uint64_t off = e.offset;
    uint64_t len = e.length;
    auto next = free_.lower_bound(off);
    const bool inside = len <= capacity_ && off <= capacity_ - len;
    const bool overlaps_next = next != free_.end() && next->first < off + len;
    const bool overlaps_prev = next != free_.begin() && std::prev(next)->first + std::prev(next)->second > off;
    if (!inside || overlaps_next || overlaps_prev) {
      // Never corrupt the free list: a double free would hand the same pages
      // to two owners. Refuse, count, and say so loudly.
      bad_frees_.fetch_add(1);
      log::Error("memory tier: refused to free [{}, +{}): not allocated (double free?)", off, len);
      continue;
    }
    if (next != free_.end() && next->first == off + len) {
      len += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        off = prev->first;
        len += prev->second;
        free_.erase(prev);
      }
    }
    free_[off] = len;
    free_total_ += e.length;
  }
}

uint64_t Arena::free_bytes() const {
  CheckedLock lock(&mu_);
  return free_total_;
}

uint64_t Arena::largest_free_extent() const {
  CheckedLock lock(&mu_);
  uint64_t best = 0;
  for (const auto& [off, len] : free_) best = std::max(best, len);
  return best;
}

std::string Arena::RecordName(const ShardRecord& r, uint64_t seq) const {
  const std::string what = r.segment ? absl::StrCat("g", r.segment->group, ".s", r.segment->stripe, ".p",
                                                    r.segment->position, ".seg")
                                     : absl::StrCat(r.id.rank);
  return absl::StrCat(r.id.job_id, ".", r.id.step, ".", what, ".", absl::Hex(seq, absl::kZeroPad16), ".rec");
}

absl::Status Arena::WriteRecord(ShardRecord* record) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(record->id.job_id));
  uint64_t seq;
  {
    CheckedLock lock(&mu_);
    seq = ++last_seq_;
  }
  const std::string name = RecordName(*record, seq);
  // The record names its own sequence number; on failure `record` is left
  // as it was (its file is still the one on disk).
  const uint64_t old_seq = std::exchange(record->seq, seq);
  const std::string text = EncodeShardRecord(*record);
  // On a tmpfs the syncs cost next to nothing; they keep the protocol the
  // one every FileSystem (and its fault injection) knows.
  if (absl::Status s = WritePrivateFileAtomically(fs_, absl::StrCat(records_dir_, "/", name), text); !s.ok()) {
    record->seq = old_seq;
    return s;
  }
  record->file = name;
  return absl::OkStatus();
}

absl::Status Arena::RemoveRecord(const std::string& file) {
  if (file.empty()) return absl::OkStatus();
  if (file.find('/') != std::string::npos || file == "." || file == "..") {
    return absl::InvalidArgumentError(absl::StrCat("bad record file name '", file, "'"));
  }
  absl::Status s = fs_->DeleteFile(absl::StrCat(records_dir_, "/", file));
  return absl::IsNotFound(s) ? absl::OkStatus() : s;
}

}  // namespace ckpt::agent
