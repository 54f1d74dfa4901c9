#include "fake_agent_link.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/manifest.h"
#include "common/manifest_proto.h"

namespace ckpt::testing {

namespace {
constexpr uint64_t kPage = 4096;
}  // namespace

FakeAgentLink::FakeAgentLink(Options options) : options_(std::move(options)) {
  fd_ = ::memfd_create("ckpt-fake-pool", MFD_CLOEXEC);
  if (fd_ < 0 || ::ftruncate(fd_, static_cast<off_t>(options_.pool_bytes)) != 0) std::abort();
  pool_path_ = absl::StrCat("/proc/self/fd/", fd_);
}

FakeAgentLink::~FakeAgentLink() {
  if (fd_ >= 0) ::close(fd_);
}

void FakeAgentLink::FailNext(Call call, absl::Status status) {
  absl::MutexLock lock(&mu_);
  failures_[call].push_back(std::move(status));
}

void FakeAgentLink::LoseNextCommitAnswer(absl::Status status) {
  absl::MutexLock lock(&mu_);
  lost_answers_.push_back(std::move(status));
}

void FakeAgentLink::MisreportNextCommitCrc() {
  absl::MutexLock lock(&mu_);
  ++misreport_crc_;
}

std::vector<FakeAgentLink::Lease> FakeAgentLink::leases() const {
  absl::MutexLock lock(&mu_);
  return leases_;
}

size_t FakeAgentLink::open_leases() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const Lease& l : leases_) n += !l.aborted && !l.committed;
  return n;
}

std::vector<v1::CommitShardRequest> FakeAgentLink::commits() const {
  absl::MutexLock lock(&mu_);
  return commits_;
}

std::vector<std::string> FakeAgentLink::aborts() const {
  absl::MutexLock lock(&mu_);
  return aborts_;
}

std::vector<v1::AcquireStagingLeaseRequest> FakeAgentLink::lease_requests() const {
  absl::MutexLock lock(&mu_);
  return lease_requests_;
}

absl::Status FakeAgentLink::TakeFailure(Call call) {
  auto it = failures_.find(call);
  if (it == failures_.end() || it->second.empty()) return absl::OkStatus();
  absl::Status s = std::move(it->second.front());
  it->second.pop_front();
  return s;
}

absl::Status FakeAgentLink::AgentStatus(v1::AgentStatusResponse* resp, absl::Duration) {
  resp->set_node_id(options_.node_id);
  resp->add_pool_files(pool_path_);
  resp->add_pool_file_bytes(options_.pool_bytes);
  return absl::OkStatus();
}

absl::Status FakeAgentLink::AcquireStagingLease(const v1::AcquireStagingLeaseRequest& req,
                                                v1::AcquireStagingLeaseResponse* resp, absl::Duration) {
  absl::MutexLock lock(&mu_);
  lease_requests_.push_back(req);
  if (absl::Status s = TakeFailure(Call::kAcquireStagingLease); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("AcquireStagingLease: ", s.message()));
  }
  if (options_.bases_gone && req.base_steps_size() > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "AcquireStagingLease: base version ", req.job_id(), "/", req.base_steps(0), " is not held by this agent"));
  }
  const uint64_t size = req.size_bytes();
  const uint64_t rounded = (size + kPage - 1) / kPage * kPage;
  if (!options_.pull && next_offset_ + rounded > options_.pool_bytes) {
    return absl::ResourceExhaustedError("AcquireStagingLease: the fake pool is full");
  }
  // A new lease of the same (step, rank) replaces the open one.
  for (Lease& l : leases_) {
    if (l.step == req.step() && !l.committed) l.aborted = true;
  }
  Lease lease;
  lease.id = absl::StrCat("lease-", ++next_id_);
  lease.step = req.step();
  lease.size_bytes = size;
  lease.pool_offset = next_offset_;
  lease.base_steps.assign(req.base_steps().begin(), req.base_steps().end());
  resp->set_lease_id(lease.id);
  resp->set_item_alignment_bytes(options_.item_alignment);
  if (options_.pull) {
    resp->set_pull(true);
    resp->set_pull_token(options_.pull_token);
  } else if (size > 0) {
    v1::MemoryRegion* r = resp->add_regions();
    r->set_path(pool_path_);
    r->set_file_offset_bytes(next_offset_);
    r->set_shard_offset_bytes(0);
    r->set_length_bytes(options_.short_regions && size > kPage ? size - kPage : size);
    next_offset_ += rounded;
  }
  leases_.push_back(std::move(lease));
  return absl::OkStatus();
}

absl::Status FakeAgentLink::AbortLease(const v1::AbortLeaseRequest& req, absl::Duration) {
  absl::MutexLock lock(&mu_);
  aborts_.push_back(req.lease_id());
  if (absl::Status s = TakeFailure(Call::kAbortLease); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("AbortLease: ", s.message()));
  }
  for (Lease& l : leases_) {
    if (l.id != req.lease_id()) continue;
    if (l.committed) return absl::FailedPreconditionError("AbortLease: the lease is committed");
    l.aborted = true;
  }
  return absl::OkStatus();
}

absl::Status FakeAgentLink::CommitShard(const v1::CommitShardRequest& req, v1::CommitShardResponse* resp,
                                        absl::Duration) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = TakeFailure(Call::kCommitShard); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("CommitShard: ", s.message()));
  }
  Lease* lease = nullptr;
  for (Lease& l : leases_) {
    if (l.id == req.lease_id()) lease = &l;
  }
  if (lease == nullptr) return absl::FailedPreconditionError("CommitShard: unknown lease");
  if (lease->committed) return absl::AlreadyExistsError("CommitShard: the lease is committed");
  if (lease->aborted) return absl::FailedPreconditionError("CommitShard: the lease was released");
  if (req.size_bytes() > lease->size_bytes) return absl::InvalidArgumentError("CommitShard: larger than the lease");
  uint32_t crc = 0;
  if (!options_.pull) {
    std::string bytes(req.size_bytes(), '\0');
    if (::pread(fd_, bytes.data(), bytes.size(), static_cast<off_t>(lease->pool_offset)) !=
        static_cast<ssize_t>(bytes.size())) {
      return absl::InternalError("CommitShard: cannot read the fake pool");
    }
    crc = Crc32c(bytes.data(), bytes.size());
  }
  lease->committed = true;
  commits_.push_back(req);
  lease->shard.mutable_key()->set_step(lease->step);
  lease->shard.set_size_bytes(req.size_bytes());
  lease->shard.set_crc32c(crc);
  lease->manifest = req.items_size() > 0 ? EncodeManifest(SortedManifestFromProto(req.items())) : req.manifest();
  lease->shard.set_manifest_digest(ManifestDigestOfEncoding(lease->manifest));
  v1::ShardInfo* shard = resp->mutable_shard();
  shard->mutable_key()->set_step(lease->step);
  shard->set_size_bytes(req.size_bytes());
  shard->set_crc32c(misreport_crc_ > 0 ? crc ^ 1 : crc);
  if (misreport_crc_ > 0) --misreport_crc_;
  if (!lost_answers_.empty()) {
    absl::Status lost = std::move(lost_answers_.front());
    lost_answers_.pop_front();
    return absl::Status(lost.code(), absl::StrCat("CommitShard: ", lost.message()));
  }
  return absl::OkStatus();
}

v1::ShardInfo FakeAgentLink::committed_shard(uint64_t step) const {
  absl::MutexLock lock(&mu_);
  for (auto it = leases_.rbegin(); it != leases_.rend(); ++it) {
    if (it->committed && it->step == step) return it->shard;
  }
  return v1::ShardInfo();
}

size_t FakeAgentLink::open_handles() const {
  absl::MutexLock lock(&mu_);
  return handles_.size();
}

absl::Status FakeAgentLink::OpenShard(const v1::OpenShardRequest& req, v1::OpenShardResponse* resp,
                                      absl::Duration) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = TakeFailure(Call::kOpenShard); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("OpenShard: ", s.message()));
  }
  const v1::ShardKey& key = req.key();
  const Lease* lease = nullptr;
  for (auto it = leases_.rbegin(); it != leases_.rend() && lease == nullptr; ++it) {
    if (it->committed && it->step == key.step()) lease = &*it;
  }
  if (lease == nullptr) {
    return absl::NotFoundError(absl::StrCat("OpenShard: ", key.job_id(), "/", key.step(), " rank ", key.rank(),
                                            " is not held by this agent"));
  }
  const std::string id = absl::StrCat("handle-", ++next_id_);
  handles_[id] = key.step();
  resp->set_handle_id(id);
  *resp->mutable_shard() = lease->shard;
  *resp->mutable_shard()->mutable_key() = key;
  resp->set_manifest(lease->manifest);
  if (!options_.pull && lease->shard.size_bytes() > 0) {
    v1::MemoryRegion* r = resp->add_regions();
    r->set_path(pool_path_);
    r->set_file_offset_bytes(lease->pool_offset);
    r->set_shard_offset_bytes(0);
    r->set_length_bytes(lease->shard.size_bytes());
  }
  resp->mutable_served_from()->set_kind(v1::SOURCE_KIND_LOCAL);
  resp->set_verified(!req.skip_verify());
  resp->set_version_staged(options_.version_staged);
  return absl::OkStatus();
}

absl::Status FakeAgentLink::CloseShard(const v1::CloseShardRequest& req, absl::Duration) {
  absl::MutexLock lock(&mu_);
  if (handles_.erase(req.handle_id()) == 0) {
    return absl::NotFoundError(absl::StrCat("CloseShard: no open handle ", req.handle_id()));
  }
  return absl::OkStatus();
}
absl::Status FakeAgentLink::DeliverShard(const v1::DeliverShardRequest&, absl::Duration) {
  return absl::UnimplementedError("DeliverShard: not in the fake");
}
absl::Status FakeAgentLink::PauseProtection(const v1::PauseProtectionRequest&, v1::PauseProtectionResponse*,
                                            absl::Duration) {
  return absl::UnimplementedError("PauseProtection: not in the fake");
}

}  // namespace ckpt::testing
