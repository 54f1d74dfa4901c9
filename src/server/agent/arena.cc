#include "server/agent/arena.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "common/log.h"
#include "common/names.h"
#include "common/prefault.h"
#include "common/status_macros.h"

namespace ckpt::agent {
namespace {

uint64_t RoundUp(uint64_t v) { return (v + kArenaPageBytes - 1) / kArenaPageBytes * kArenaPageBytes; }

absl::Status Errno(const std::string& what, int err) {
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOSPC || err == ENOMEM || err == EDQUOT) return absl::ResourceExhaustedError(msg);
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  return absl::UnavailableError(msg);
}

std::string Hex(uint64_t v) { return absl::StrFormat("0x%016x", v); }

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

std::string ShardIdString(const ShardId& id) {
  return absl::StrCat(id.job_id, "/", id.step, "/", id.rank);
}

std::string SegmentIdString(const SegmentId& id) {
  return absl::StrCat(id.job_id, "/", id.step, "/g", id.group, ".s", id.stripe, ".p", id.position);
}

std::string EncodeShardRecord(const ShardRecord& r) {
  nlohmann::json j;
  j["format"] = 1;
  j["job"] = r.id.job_id;
  j["step"] = r.id.step;
  j["rank"] = r.id.rank;
  j["role"] = r.role;
  j["size"] = r.size_bytes;
  j["crc32c"] = r.crc32c;
  j["digest"] = Hex(r.manifest_digest);
  j["run_id"] = r.run_id;
  j["staged_ms"] = r.staged_unix_ms;
  j["durable_path"] = r.durable_path;
  if (r.segment) {
    j["segment"] = {r.segment->group, r.segment->stripe, r.segment->position, r.segment_kind};
  }
  nlohmann::json ext = nlohmann::json::array();
  for (const Extent& e : r.extents) ext.push_back({e.offset, e.length});
  j["extents"] = std::move(ext);
  nlohmann::json items = nlohmann::json::array();
  for (const ManifestItem& it : r.items) {
    nlohmann::json ji;
    ji["name"] = it.name;
    ji["dtype"] = it.dtype;
    ji["shape"] = it.shape;
    ji["offset"] = it.offset_bytes;
    ji["length"] = it.length_bytes;
    ji["crc32c"] = it.crc32c;
    if (!it.attributes.empty()) ji["attributes"] = it.attributes;
    items.push_back(std::move(ji));
  }
  j["items"] = std::move(items);
  return j.dump();
}

absl::StatusOr<ShardRecord> DecodeShardRecord(std::string_view json) {
  try {
    const nlohmann::json j = nlohmann::json::parse(json);
    if (j.value("format", 0) != 1) return absl::InvalidArgumentError("record: unknown format");
    ShardRecord r;
    r.id.job_id = j.at("job").get<std::string>();
    CKPT_RETURN_IF_ERROR(ValidateJobId(r.id.job_id));
    r.id.step = j.at("step").get<uint64_t>();
    r.id.rank = j.at("rank").get<uint32_t>();
    r.role = j.at("role").get<int>();
    r.size_bytes = j.at("size").get<uint64_t>();
    r.crc32c = j.at("crc32c").get<uint32_t>();
    CKPT_ASSIGN_OR_RETURN(r.manifest_digest, ParseHex(j, "digest"));
    r.run_id = j.value("run_id", "");
    r.staged_unix_ms = j.value("staged_ms", int64_t{0});
    r.durable_path = j.value("durable_path", "");
    if (j.contains("segment")) {
      const auto& g = j.at("segment");
      r.segment = SegmentId{r.id.job_id, r.id.step, g.at(0).get<uint32_t>(), g.at(1).get<uint32_t>(),
                            g.at(2).get<uint32_t>()};
      r.segment_kind = g.at(3).get<int>();
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

absl::StatusOr<std::unique_ptr<Arena>> Arena::Open(const Options& options) {
  if (options.capacity_bytes == 0) {
    return absl::InvalidArgumentError("memory capacity must be larger than 0");
  }
  std::unique_ptr<Arena> arena(new Arena());
  CKPT_RETURN_IF_ERROR(arena->Init(options));
  arena->Adopt();
  return arena;
}

absl::Status Arena::Init(const Options& options) {
  dir_ = options.dir;
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  pool_path_ = dir_ + "/pool.bin";
  records_dir_ = dir_ + "/records";
  capacity_ = RoundUp(options.capacity_bytes);
  std::error_code ec;
  std::filesystem::create_directories(records_dir_, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("create memory directory '", records_dir_, "': ", ec.message()));
  }
  // Clients in the agent's group map the pool read-write.
  fd_ = ::open(pool_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0660);
  if (fd_ < 0) return Errno(absl::StrCat("open '", pool_path_, "'"), errno);
  ::fchmod(fd_, 0660);
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
  absl::MutexLock lock(&mu_);
  free_[0] = capacity_;
  free_total_ = capacity_;
  return absl::OkStatus();
}

Arena::~Arena() {
  if (base_ != nullptr) ::munmap(base_, capacity_);
  if (fd_ >= 0) ::close(fd_);
}

void Arena::Adopt() {
  DIR* d = ::opendir(records_dir_.c_str());
  if (d == nullptr) return;
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const std::string path = records_dir_ + "/" + name;
    auto lose = [&](ShardId id, std::string reason) {
      log::Warn("memory tier: dropping holding {} ({}): {}", ShardIdString(id), name, reason);
      lost_.push_back(LostHolding{std::move(id), name, std::move(reason)});
      ::unlink(path.c_str());
    };
    if (name.size() < 4 || name.substr(name.size() - 4) != ".rec") {
      ::unlink(path.c_str());  // a temp file of an interrupted record write
      continue;
    }
    std::string text;
    {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        lose({}, absl::StrCat("cannot open record: ", std::strerror(errno)));
        continue;
      }
      char buf[65536];
      ssize_t n;
      while ((n = ::read(fd, buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(n));
      ::close(fd);
    }
    absl::StatusOr<ShardRecord> rec = DecodeShardRecord(text);
    if (!rec.ok()) {
      lose({}, std::string(rec.status().message()));
      continue;
    }
    // The extents must lie inside the pool, be free, and cover the size.
    uint64_t covered = 0;
    bool fits = true;
    {
      absl::MutexLock lock(&mu_);
      for (const Extent& e : rec->extents) {
        covered += e.length;
        auto it = free_.upper_bound(e.offset);
        if (e.length == 0 || e.offset % kArenaPageBytes != 0 || e.offset + e.length > capacity_ ||
            it == free_.begin() || std::prev(it)->first + std::prev(it)->second < e.offset + e.length) {
          fits = false;
        }
      }
    }
    if (!fits || covered < rec->size_bytes) {
      lose(rec->id, "record's extents lie outside the pool or overlap another holding");
      continue;
    }
    const uint32_t crc = Checksum(rec->extents, rec->size_bytes);
    if (crc != rec->crc32c) {
      lose(rec->id, absl::StrFormat("crc32c 0x%08x != recorded 0x%08x", crc, rec->crc32c));
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      for (const Extent& e : rec->extents) ReserveLocked(e);
    }
    adopted_.push_back(*std::move(rec));
  }
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

absl::StatusOr<std::vector<Extent>> Arena::Allocate(uint64_t size_bytes) {
  const uint64_t want = RoundUp(std::max<uint64_t>(size_bytes, 1));
  absl::MutexLock lock(&mu_);
  if (want > free_total_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("needs ", want, " bytes, ", free_total_, " free"));
  }
  // First fit in one extent.
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second >= want) {
      Extent e{it->first, want};
      ReserveLocked(e);
      return std::vector<Extent>{e};
    }
  }
  // Otherwise gather the largest holes first (fewest extents).
  std::vector<std::pair<uint64_t, uint64_t>> holes(free_.begin(), free_.end());
  std::sort(holes.begin(), holes.end(), [](auto& a, auto& b) { return a.second > b.second; });
  std::vector<Extent> out;
  uint64_t left = want;
  for (const auto& [off, len] : holes) {
    if (left == 0) break;
    const uint64_t take = std::min(len, left);
    out.push_back(Extent{off, take});
    left -= take;
  }
  std::sort(out.begin(), out.end(), [](const Extent& a, const Extent& b) { return a.offset < b.offset; });
  for (const Extent& e : out) ReserveLocked(e);
  return out;
}

void Arena::Free(std::span<const Extent> extents) {
  absl::MutexLock lock(&mu_);
  for (const Extent& e : extents) {
    if (e.length == 0) continue;
    uint64_t off = e.offset;
    uint64_t len = e.length;
    auto next = free_.lower_bound(off);
    assert(next == free_.end() || next->first >= off + len);
    if (next != free_.end() && next->first == off + len) {
      len += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      assert(prev->first + prev->second <= off);
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

std::vector<Extent> Arena::Trim(std::vector<Extent> extents, uint64_t size_bytes) {
  uint64_t keep = RoundUp(std::max<uint64_t>(size_bytes, 1));
  std::vector<Extent> out;
  std::vector<Extent> tail;
  for (const Extent& e : extents) {
    if (keep >= e.length) {
      out.push_back(e);
      keep -= e.length;
    } else if (keep > 0) {
      out.push_back(Extent{e.offset, keep});
      tail.push_back(Extent{e.offset + keep, e.length - keep});
      keep = 0;
    } else {
      tail.push_back(e);
    }
  }
  Free(tail);
  return out;
}

uint32_t Arena::Checksum(std::span<const Extent> extents, uint64_t size) const {
  uint32_t crc = 0;
  ForEachPiece(extents, size, [&](const std::byte* p, uint64_t n) { crc = Crc32cExtend(crc, p, n); });
  return crc;
}

uint64_t Arena::free_bytes() const {
  absl::MutexLock lock(&mu_);
  return free_total_;
}

uint64_t Arena::largest_free_extent() const {
  absl::MutexLock lock(&mu_);
  uint64_t best = 0;
  for (const auto& [off, len] : free_) best = std::max(best, len);
  return best;
}

std::string Arena::RecordPath(const ShardId& id) const {
  return absl::StrCat(records_dir_, "/", id.job_id, ".", id.step, ".", id.rank, ".rec");
}

std::string Arena::SegmentRecordPath(const SegmentId& id) const {
  return absl::StrCat(records_dir_, "/", id.job_id, ".", id.step, ".g", id.group, ".s", id.stripe, ".p",
                      id.position, ".seg.rec");
}

absl::Status Arena::RemoveSegmentRecord(const SegmentId& id) {
  const std::string path = SegmentRecordPath(id);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return Errno(absl::StrCat("remove '", path, "'"), errno);
  }
  return absl::OkStatus();
}

absl::Status Arena::WriteRecord(const ShardRecord& record) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(record.id.job_id));
  static std::atomic<uint64_t> counter{0};
  const std::string path = record.segment ? SegmentRecordPath(*record.segment) : RecordPath(record.id);
  const std::string tmp = absl::StrCat(path, ".tmp-", ::getpid(), "-", counter.fetch_add(1));
  const std::string text = EncodeShardRecord(record);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640);
  if (fd < 0) return Errno(absl::StrCat("create '", tmp, "'"), errno);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return Errno(absl::StrCat("write '", tmp, "'"), err);
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);  // tmpfs: no fsync needed, the tier does not survive a reboot anyway
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Errno(absl::StrCat("rename '", tmp, "'"), err);
  }
  return absl::OkStatus();
}

absl::Status Arena::RemoveRecord(const ShardId& id) {
  const std::string path = RecordPath(id);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return Errno(absl::StrCat("remove '", path, "'"), errno);
  }
  return absl::OkStatus();
}

}  // namespace ckpt::agent
