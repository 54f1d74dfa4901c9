#include "client/fake_agent.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/file_system.h"
#include "common/manifest.h"
#include "common/manifest_proto.h"
#include "support/test_tls.h"

namespace ckpt::testing {

namespace v1 = ::ckpt::v1;
using grpc::Status;
using grpc::StatusCode;

namespace {

constexpr uint64_t kPage = 4096;

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

std::unique_ptr<grpc::ClientContext> MetaContext() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  return ctx;
}

Status ToGrpc(const absl::Status& s) {
  return Status(static_cast<StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<FakeAgent>> FakeAgent::Start(Options options) {
  std::unique_ptr<FakeAgent> agent(new FakeAgent(std::move(options)));
  const Options& o = agent->options_;
  const std::string pool = agent->pool_path();
  int fd = ::open(pool.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return PosixErrorToStatus(errno, "open", pool);
  if (::ftruncate(fd, static_cast<off_t>(o.pool_bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    return PosixErrorToStatus(err, "ftruncate", pool);
  }
  void* p = ::mmap(nullptr, o.pool_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) return PosixErrorToStatus(err, "mmap", pool);
  agent->pool_ = static_cast<std::byte*>(p);

  if (!o.meta_address.empty()) {
    // As its node: meta serves mutual TLS and takes a node's calls only from
    // that node's certificate (support/test_tls.h).
    agent->meta_ = v1::MetaService::NewStub(testing::TestChannel(o.meta_address, testing::TestPki::Shared().Node(o.node_id)));
    v1::RegisterNodeRequest req;
    req.set_node_id(o.node_id);
    req.set_grpc_address("127.0.0.1:1");
    req.set_data_address("127.0.0.1:2");
    req.set_role(v1::NODE_ROLE_HOST);
    req.set_memory_capacity_bytes(o.pool_bytes);
    v1::RegisterNodeResponse resp;
    Status st = agent->meta_->RegisterNode(MetaContext().get(), req, &resp);
    if (!st.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                          absl::StrCat("RegisterNode: ", st.error_message()));
    }
    agent->incarnation_ = resp.incarnation();
    v1::ReportInventoryRequest inv;
    inv.set_node_id(o.node_id);
    inv.set_incarnation(agent->incarnation_);
    v1::ReportInventoryResponse inv_resp;
    st = agent->meta_->ReportInventory(MetaContext().get(), inv, &inv_resp);
    if (!st.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                          absl::StrCat("ReportInventory: ", st.error_message()));
    }
  }

  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + agent->socket_path(), grpc::InsecureServerCredentials());
  builder.RegisterService(agent.get());
  agent->server_ = builder.BuildAndStart();
  if (agent->server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot listen on unix:", agent->socket_path()));
  }
  return agent;
}

FakeAgent::~FakeAgent() {
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    server_->Wait();
  }
  if (pool_ != nullptr) ::munmap(pool_, options_.pool_bytes);
}

void FakeAgent::FailNextCommit(grpc::Status status, bool apply_first) {
  absl::MutexLock lock(&mu_);
  fail_next_commit_ = std::make_pair(std::move(status), apply_first);
}

std::byte* FakeAgent::ByteAt(const std::vector<v1::MemoryRegion>& regions,
                             uint64_t offset) const {
  for (const v1::MemoryRegion& r : regions) {
    if (offset >= r.shard_offset_bytes() && offset < r.shard_offset_bytes() + r.length_bytes()) {
      return pool_ + r.file_offset_bytes() + (offset - r.shard_offset_bytes());
    }
  }
  return nullptr;
}

uint32_t FakeAgent::CrcOf(const std::vector<v1::MemoryRegion>& regions, uint64_t offset,
                          uint64_t n) const {
  uint32_t crc = 0;
  for (const v1::MemoryRegion& r : regions) {
    const uint64_t lo = std::max(offset, r.shard_offset_bytes());
    const uint64_t hi = std::min(offset + n, r.shard_offset_bytes() + r.length_bytes());
    if (lo >= hi) continue;
    crc = Crc32cExtend(crc, pool_ + r.file_offset_bytes() + (lo - r.shard_offset_bytes()),
                       hi - lo);
  }
  return crc;
}

bool FakeAgent::Corrupt(const std::string& job, uint64_t step, uint32_t rank,
                        uint64_t shard_offset) {
  absl::MutexLock lock(&mu_);
  auto it = shards_.find(Key{job, step, rank});
  if (it == shards_.end()) return false;
  std::byte* b = ByteAt(it->second.regions, shard_offset);
  if (b == nullptr) return false;
  *b = ~*b;
  return true;
}

int FakeAgent::leases_granted() const {
  absl::MutexLock lock(&mu_);
  return leases_granted_;
}
int FakeAgent::open_leases() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [id, l] : leases_) n += l.state == LeaseState::kOpen;
  return n;
}
int FakeAgent::aborts() const {
  absl::MutexLock lock(&mu_);
  return aborts_;
}
int FakeAgent::commits() const {
  absl::MutexLock lock(&mu_);
  return commits_;
}
int FakeAgent::crc_mismatches() const {
  absl::MutexLock lock(&mu_);
  return crc_mismatches_;
}
int FakeAgent::open_handles() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(handles_.size());
}
int FakeAgent::WaitOpenHandles(int want) const {
  absl::MutexLock lock(&mu_);
  auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return static_cast<int>(handles_.size()) == want; };
  mu_.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(30));
  return static_cast<int>(handles_.size());
}
int FakeAgent::local_opens() const {
  absl::MutexLock lock(&mu_);
  return local_opens_;
}
int FakeAgent::located_opens() const {
  absl::MutexLock lock(&mu_);
  return located_opens_;
}
std::optional<v1::ShardInfo> FakeAgent::Committed(const std::string& job, uint64_t step,
                                                  uint32_t rank) const {
  absl::MutexLock lock(&mu_);
  auto it = shards_.find(Key{job, step, rank});
  if (it == shards_.end()) return std::nullopt;
  return it->second.info;
}

Status FakeAgent::AgentStatus(grpc::ServerContext*, const v1::AgentStatusRequest*,
                              v1::AgentStatusResponse* resp) {
  resp->set_node_id(options_.node_id);
  resp->set_incarnation(incarnation_);
  resp->set_role(v1::NODE_ROLE_HOST);
  resp->set_registered(meta_ != nullptr);
  resp->set_memory_dir(options_.dir);
  resp->set_memory_capacity_bytes(options_.pool_bytes);
  if (options_.list_pool_files) {
    resp->add_pool_files(pool_path());
    resp->add_pool_file_bytes(options_.pool_bytes);
  }
  return Status::OK;
}

void FakeAgent::HoldLeases(bool hold) {
  absl::MutexLock lock(&hold_mu_);
  hold_leases_ = hold;
}

void FakeAgent::HoldCommits(bool hold) {
  absl::MutexLock lock(&hold_mu_);
  hold_commits_ = hold;
}

Status FakeAgent::AcquireStagingLease(grpc::ServerContext*,
                                      const v1::AcquireStagingLeaseRequest* req,
                                      v1::AcquireStagingLeaseResponse* resp) {
  {
    absl::MutexLock hold(&hold_mu_);
    hold_mu_.AwaitWithTimeout(absl::Condition(+[](bool* held) { return !*held; }, &hold_leases_),
                              absl::Seconds(60));
  }
  if (req->size_bytes() == 0) return Status(StatusCode::INVALID_ARGUMENT, "size_bytes is 0");
  if (req->job_id().empty()) return Status(StatusCode::INVALID_ARGUMENT, "job_id is empty");
  absl::MutexLock lock(&mu_);
  const Key key{req->job_id(), req->step(), req->rank()};
  if (shards_.count(key) != 0) {
    return Status(StatusCode::ALREADY_EXISTS,
                  absl::StrCat("rank ", req->rank(), " of ", req->job_id(), "/", req->step(),
                               " is already committed here"));
  }
  if (meta_ != nullptr && !begun_[{req->job_id(), req->step()}]) {
    v1::BeginVersionRequest begin;
    begin.set_job_id(req->job_id());
    begin.set_step(req->step());
    begin.set_run_id(req->run_id());
    begin.set_node_id(options_.node_id);
    v1::BeginVersionResponse begun;
    Status st = meta_->BeginVersion(MetaContext().get(), begin, &begun);
    if (!st.ok()) return st;
    begun_[{req->job_id(), req->step()}] = true;
  }
  // A new lease for the same shard aborts the open one.
  for (auto& [id, l] : leases_) {
    if (l.key == key && l.state == LeaseState::kOpen) l.state = LeaseState::kAborted;
  }
  const uint64_t size = req->size_bytes();
  const bool split = options_.split_at != 0 && size > options_.split_at;
  const uint64_t need = AlignUp(size, kPage) + (split ? options_.hole_bytes + kPage : 0);
  if (next_free_ + need > options_.pool_bytes) {
    return Status(StatusCode::RESOURCE_EXHAUSTED,
                  absl::StrCat("lease of ", size, " bytes does not fit: ",
                               options_.pool_bytes - next_free_, " bytes free"));
  }
  Lease lease;
  lease.key = key;
  lease.size = size;
  lease.run_id = req->run_id();
  v1::MemoryRegion first;
  first.set_path(pool_path());
  first.set_file_offset_bytes(next_free_);
  first.set_shard_offset_bytes(0);
  first.set_length_bytes(split ? options_.split_at : size);
  lease.regions.push_back(first);
  if (split) {
    v1::MemoryRegion second;
    second.set_path(pool_path());
    second.set_file_offset_bytes(next_free_ + options_.split_at + options_.hole_bytes);
    second.set_shard_offset_bytes(options_.split_at);
    second.set_length_bytes(size - options_.split_at);
    lease.regions.push_back(second);
  }
  next_free_ += need;
  // Leftovers of earlier tests' bytes must not look like zero padding.
  for (const auto& r : lease.regions) {
    std::memset(pool_ + r.file_offset_bytes(), 0xA5, r.length_bytes());
  }
  const std::string id = absl::StrCat("lease-", next_id_++);
  resp->set_lease_id(id);
  for (const auto& r : lease.regions) *resp->add_regions() = r;
  resp->set_expires_in_ms(60000);
  resp->set_item_alignment_bytes(options_.item_alignment);
  leases_[id] = std::move(lease);
  ++leases_granted_;
  return Status::OK;
}

Status FakeAgent::ApplyCommit(Lease& lease, const v1::CommitShardRequest& req,
                              v1::ShardInfo* out) {
  const uint64_t size = req.size_bytes() == 0 ? lease.size : req.size_bytes();
  if (size > lease.size) {
    return Status(StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("size ", size, " is larger than the lease (", lease.size, ")"));
  }
  std::vector<ManifestItem> manifest;
  if (!req.manifest().empty()) {  // packed, as the client sends it
    if (req.items_size() != 0) return Status(StatusCode::INVALID_ARGUMENT, "both items and manifest");
    absl::StatusOr<std::vector<ManifestItem>> decoded = DecodeManifest(req.manifest());
    if (!decoded.ok()) return ToGrpc(decoded.status());
    manifest = *std::move(decoded);
  }
  for (const v1::Item& it : req.items()) manifest.push_back(ManifestItemFromProto(it));
  if (absl::Status s = ValidateManifest(manifest, size); !s.ok()) return ToGrpc(s);
  // Check the client: every item's crc from the file, and zero padding.
  const std::vector<ManifestItem> sorted = SortedByOffset(manifest);
  uint64_t pos = 0;
  uint32_t shard_crc = 0;
  for (const ManifestItem& m : sorted) {
    for (uint64_t b = pos; b < m.offset_bytes; ++b) {
      if (*ByteAt(lease.regions, b) != std::byte{0}) {
        ++crc_mismatches_;
        return Status(StatusCode::INVALID_ARGUMENT,
                      absl::StrCat("padding byte ", b, " is not zero"));
      }
    }
    const uint32_t actual = CrcOf(lease.regions, m.offset_bytes, m.length_bytes);
    if (actual != m.crc32c) {
      ++crc_mismatches_;
      return Status(StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("item ", m.name, ": client crc ", m.crc32c, ", file has ",
                                 actual));
    }
    pos = m.offset_bytes + m.length_bytes;
  }
  for (uint64_t b = pos; b < size; ++b) {
    if (*ByteAt(lease.regions, b) != std::byte{0}) {
      ++crc_mismatches_;
      return Status(StatusCode::INVALID_ARGUMENT, absl::StrCat("tail byte ", b, " is not zero"));
    }
  }
  shard_crc = CrcOf(lease.regions, 0, size);

  Shard shard;
  v1::ShardInfo& info = shard.info;
  info.mutable_key()->set_job_id(std::get<0>(lease.key));
  info.mutable_key()->set_step(std::get<1>(lease.key));
  info.mutable_key()->set_rank(std::get<2>(lease.key));
  info.set_size_bytes(size);
  info.set_crc32c(shard_crc);
  info.set_manifest_digest(ManifestDigest(manifest));
  info.set_primary_node_id(options_.node_id);
  info.set_staged_unix_ms(absl::ToUnixMillis(absl::Now()));
  for (const ManifestItem& m : sorted) {
    ManifestItemToProto(m, info.add_items());
  }
  shard.manifest = EncodeManifest(sorted);
  // Regions trimmed to the committed size.
  uint64_t left = size;
  for (v1::MemoryRegion r : lease.regions) {
    if (left == 0) break;
    r.set_length_bytes(std::min<uint64_t>(r.length_bytes(), left));
    left -= r.length_bytes();
    shard.regions.push_back(r);
  }

  v1::ReportShardsRequest report;
  if (meta_ != nullptr) {
    report.set_node_id(options_.node_id);
    report.set_incarnation(incarnation_);
    v1::StagedReport* staged = report.add_reports()->mutable_staged();
    *staged->mutable_shard() = info;
    staged->set_run_id(lease.run_id);
    if (options_.report_at_next_close) deferred_reports_.push_back(std::exchange(report, {}));
  }
  if (report.reports_size() > 0) {
    v1::ReportShardsResponse reported;
    Status st = meta_->ReportShards(MetaContext().get(), report, &reported);
    if (!st.ok()) return st;
    if (reported.results_size() != 1 ||
        (reported.results(0).code() != 0 && reported.results(0).code() != 6)) {
      return Status(StatusCode::INTERNAL,
                    absl::StrCat("meta rejected the staged report: ",
                                 reported.results_size() == 0 ? std::string("no result")
                                                              : reported.results(0).message()));
    }
  }
  lease.state = LeaseState::kCommitted;
  *out = info;
  out->clear_items();
  shards_[lease.key] = std::move(shard);
  ++commits_;
  return Status::OK;
}

Status FakeAgent::CommitShard(grpc::ServerContext*, const v1::CommitShardRequest* req,
                              v1::CommitShardResponse* resp) {
  {
    absl::MutexLock hold(&hold_mu_);
    hold_mu_.AwaitWithTimeout(absl::Condition(+[](bool* held) { return !*held; }, &hold_commits_),
                              absl::Seconds(60));
  }
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(req->lease_id());
  if (it == leases_.end() || it->second.state == LeaseState::kAborted) {
    return Status(StatusCode::FAILED_PRECONDITION,
                  absl::StrCat("lease ", req->lease_id(), " is unknown or aborted"));
  }
  Lease& lease = it->second;
  if (lease.state == LeaseState::kCommitted) {
    return Status(StatusCode::ALREADY_EXISTS,
                  absl::StrCat("lease ", req->lease_id(), " is already committed"));
  }
  if (fail_next_commit_.has_value()) {
    auto [status, apply_first] = *std::exchange(fail_next_commit_, std::nullopt);
    if (apply_first) {
      v1::ShardInfo ignored;
      if (Status st = ApplyCommit(lease, *req, &ignored); !st.ok()) return st;
    }
    return status;
  }
  return ApplyCommit(lease, *req, resp->mutable_shard());
}

Status FakeAgent::AbortLease(grpc::ServerContext*, const v1::AbortLeaseRequest* req,
                             v1::AbortLeaseResponse*) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(req->lease_id());
  if (it == leases_.end() || it->second.state == LeaseState::kAborted) return Status::OK;
  if (it->second.state == LeaseState::kCommitted) {
    return Status(StatusCode::FAILED_PRECONDITION,
                  absl::StrCat("lease ", req->lease_id(), " is committed"));
  }
  it->second.state = LeaseState::kAborted;
  ++aborts_;
  return Status::OK;
}

Status FakeAgent::OpenShard(grpc::ServerContext*, const v1::OpenShardRequest* req,
                            v1::OpenShardResponse* resp) {
  absl::MutexLock lock(&mu_);
  const bool located = req->has_expected() || req->sources_size() > 0;
  ++(located ? located_opens_ : local_opens_);
  const Key key{req->key().job_id(), req->key().step(), req->key().rank()};
  auto it = shards_.find(key);
  if (it == shards_.end()) {
    return Status(StatusCode::NOT_FOUND, "shard not held here (the fake has no other sources)");
  }
  const Shard& shard = it->second;
  const uint32_t crc = shard.info.crc32c() ^ (options_.local_copy_differs ? 1u : 0u);
  if (req->has_expected() && req->expected().size_bytes() != 0 && req->expected().crc32c() != crc) {
    return Status(StatusCode::DATA_LOSS, "the local copy differs from the expected shard (size/crc32c)");
  }
  if (!req->skip_verify()) {
    for (const v1::Item& item : shard.info.items()) {
      const uint32_t actual = CrcOf(shard.regions, item.offset_bytes(), item.length_bytes());
      if (actual != item.crc32c()) {
        return Status(StatusCode::DATA_LOSS,
                      absl::StrCat("every source failed: local copy: item '", item.name(),
                                   "' crc mismatch"));
      }
    }
  }
  const std::string id = absl::StrCat("handle-", next_id_++);
  handles_[id] = key;
  resp->set_handle_id(id);
  *resp->mutable_shard() = shard.info;
  resp->mutable_shard()->set_crc32c(crc);
  if (req->packed_manifest() && options_.packs_manifests) {
    resp->mutable_shard()->clear_items();
    resp->set_manifest(shard.manifest);
    if (options_.tamper_manifest) (*resp->mutable_manifest())[resp->manifest().size() - 5] ^= 1;
  }
  for (const auto& r : shard.regions) *resp->add_regions() = r;
  resp->mutable_served_from()->set_kind(v1::SOURCE_KIND_LOCAL);
  resp->set_verified(!req->skip_verify());
  resp->set_expires_in_ms(600000);
  return Status::OK;
}

Status FakeAgent::CloseShard(grpc::ServerContext*, const v1::CloseShardRequest* req,
                             v1::CloseShardResponse*) {
  absl::MutexLock lock(&mu_);
  handles_.erase(req->handle_id());
  for (const v1::ReportShardsRequest& report : std::exchange(deferred_reports_, {})) {
    v1::ReportShardsResponse reported;
    if (Status st = meta_->ReportShards(MetaContext().get(), report, &reported); !st.ok()) return st;
  }
  return Status::OK;
}

}  // namespace ckpt::testing
