// Restore path: Locate at meta -> OpenShard at the local agent -> views of the
// mapped regions (LoadedShard) or checked copies into caller buffers
// (LoadInto) -> CloseShard.
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "ckpt/client.h"
#include "client/client_core.h"
#include "common/crc32c.h"
#include "common/log.h"
#include "common/manifest.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt {

using client::ClientCore;
using client::FromGrpc;
namespace v1 = ::ckpt::v1;

namespace client {
namespace {

ServedFrom FromProto(v1::SourceKind kind) {
  switch (kind) {
    case v1::SOURCE_KIND_LOCAL:
      return ServedFrom::kLocal;
    case v1::SOURCE_KIND_REPLICA:
      return ServedFrom::kReplica;
    case v1::SOURCE_KIND_EC_DECODE:
      return ServedFrom::kEcDecode;
    case v1::SOURCE_KIND_DURABLE:
      return ServedFrom::kDurable;
    default:
      return ServedFrom::kUnknown;
  }
}

}  // namespace

// An open shard at the agent, with its regions mapped. Closes the handle when
// destroyed unless Close() was called.
struct OpenedShard {
  std::shared_ptr<ClientCore> core;
  std::string handle_id;
  v1::ShardInfo shard;  // size, crc, items (from OpenShard, or Locate's)
  ServedFrom served_from = ServedFrom::kUnknown;
  bool verified = false;
  std::vector<std::shared_ptr<client::MappedFile>> files;
  std::vector<client::ShardRegion> regions;

  OpenedShard() = default;
  OpenedShard(const OpenedShard&) = delete;
  OpenedShard& operator=(const OpenedShard&) = delete;
  ~OpenedShard() {
    if (absl::Status s = Close(); !s.ok()) {
      log::Warn("closing shard handle: {}", s.ToString());
    }
  }

  absl::Status Close() {
    if (handle_id.empty()) return absl::OkStatus();
    v1::CloseShardRequest req;
    req.set_handle_id(std::exchange(handle_id, ""));
    regions.clear();
    files.clear();
    v1::CloseShardResponse resp;
    auto ctx = client::ContextWithTimeout(core->options.rpc_timeout);
    return FromGrpc(core->agent->CloseShard(ctx.get(), req, &resp), "CloseShard");
  }
};

namespace {

absl::StatusOr<v1::LocateResponse> Locate(const ClientCore& core, uint64_t step) {
  CKPT_RETURN_IF_ERROR(ValidateStep(step));
  v1::LocateRequest req;
  req.set_job_id(core.options.job_id);
  req.set_step(step);
  req.set_rank(core.options.rank);
  req.set_near_node_id(core.node_id);
  v1::LocateResponse resp;
  auto ctx = client::ContextWithTimeout(core.options.rpc_timeout);
  CKPT_RETURN_IF_ERROR(FromGrpc(core.meta->Locate(ctx.get(), req, &resp), "Locate"));
  return resp;
}

std::vector<ManifestItem> ToManifest(const v1::ShardInfo& shard) {
  std::vector<ManifestItem> items;
  items.reserve(shard.items_size());
  for (const v1::Item& it : shard.items()) {
    ManifestItem m;
    m.name = it.name();
    m.dtype = it.dtype();
    m.shape.assign(it.shape().begin(), it.shape().end());
    m.offset_bytes = it.offset_bytes();
    m.length_bytes = it.length_bytes();
    m.crc32c = it.crc32c();
    m.attributes.insert(it.attributes().begin(), it.attributes().end());
    items.push_back(std::move(m));
  }
  return items;
}

// OpenShard with Locate's answer, then maps the regions read-only. The
// manifest is checked (items inside the shard, no overlaps) before any view
// is built on it.
absl::StatusOr<std::unique_ptr<OpenedShard>> Open(const std::shared_ptr<ClientCore>& core,
                                                  const v1::LocateResponse& located,
                                                  bool skip_verify) {
  v1::OpenShardRequest req;
  *req.mutable_key() = located.shard().key();
  *req.mutable_sources() = located.sources();
  *req.mutable_expected() = located.shard();
  req.set_skip_verify(skip_verify);
  req.set_client_pid(static_cast<uint32_t>(::getpid()));
  // The handle (and the views on it) lives until Close or the session's end.
  CKPT_ASSIGN_OR_RETURN(std::string session, client::SessionId(*core));
  req.set_session_id(session);
  v1::OpenShardResponse resp;
  auto ctx = client::ContextWithTimeout(core->options.load_timeout);
  CKPT_RETURN_IF_ERROR(FromGrpc(core->agent->OpenShard(ctx.get(), req, &resp), "OpenShard"));

  auto opened = std::make_unique<OpenedShard>();
  opened->core = core;
  opened->handle_id = resp.handle_id();  // closed by ~OpenedShard on any error below
  opened->shard = resp.has_shard() ? resp.shard() : located.shard();
  if (opened->shard.items_size() == 0) *opened->shard.mutable_items() = located.shard().items();
  if (!opened->shard.has_key()) *opened->shard.mutable_key() = located.shard().key();
  opened->served_from = FromProto(resp.served_from().kind());
  opened->verified = resp.verified();
  for (const auto& f : resp.failed_sources()) {
    log::Info("restore of {}/{} rank {}: source {} failed: {}", core->options.job_id,
              located.shard().key().step(), core->options.rank,
              ServedFromName(FromProto(f.source().kind())), f.status().message());
  }

  const std::vector<ManifestItem> manifest = ToManifest(opened->shard);
  if (absl::Status s = ValidateManifest(manifest, opened->shard.size_bytes()); !s.ok()) {
    return absl::InternalError(absl::StrCat("OpenShard returned a bad manifest: ", s.message()));
  }
  absl::StatusOr<std::vector<client::ShardRegion>> regions =
      client::MapRegions(*core, resp.regions(), opened->shard.size_bytes(),
                         client::MappedFile::Access::kReadOnly, &opened->files);
  if (!regions.ok()) {
    return Annotate(regions.status(), absl::StrCat("regions of shard handle ", resp.handle_id()));
  }
  opened->regions = *std::move(regions);
  return opened;
}

std::string ItemMismatch(const v1::Item& item, uint32_t actual) {
  return absl::StrCat("item ", QuoteForMessage(item.name()), " fails its checksum: crc32c ",
                      absl::Hex(actual, absl::kZeroPad8), ", manifest says ",
                      absl::Hex(item.crc32c(), absl::kZeroPad8));
}

}  // namespace
}  // namespace client

using client::ItemMismatch;
using client::Locate;
using client::Open;
using client::OpenedShard;

// ---- LoadedShard --------------------------------------------------------------

struct LoadedShard::Impl {
  std::unique_ptr<OpenedShard> opened;
  std::vector<LoadedItem> items;
  absl::flat_hash_map<std::string, size_t> index;  // name -> items[i]
  absl::Mutex mu;
  // Items copied out of non-adjacent regions, by index.
  absl::flat_hash_map<size_t, std::unique_ptr<std::byte[]>> copies ABSL_GUARDED_BY(mu);
};

LoadedShard::LoadedShard(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LoadedShard::LoadedShard(LoadedShard&&) noexcept = default;
LoadedShard& LoadedShard::operator=(LoadedShard&& other) noexcept {
  if (this != &other) {
    if (impl_ != nullptr) (void)Close();  // errors logged by the handle
    impl_ = std::move(other.impl_);
  }
  return *this;
}
LoadedShard::~LoadedShard() {
  if (impl_ != nullptr) {
    if (absl::Status s = Close(); !s.ok()) log::Warn("LoadedShard: {}", s.ToString());
  }
}

uint64_t LoadedShard::step() const { return impl_->opened->shard.key().step(); }
uint32_t LoadedShard::rank() const { return impl_->opened->shard.key().rank(); }
uint64_t LoadedShard::size_bytes() const { return impl_->opened->shard.size_bytes(); }
uint32_t LoadedShard::crc32c() const { return impl_->opened->shard.crc32c(); }
ServedFrom LoadedShard::served_from() const { return impl_->opened->served_from; }
bool LoadedShard::verified() const { return impl_->opened->verified; }
const std::vector<LoadedItem>& LoadedShard::items() const { return impl_->items; }

const LoadedItem* LoadedShard::Find(const std::string& name) const {
  auto it = impl_->index.find(name);
  return it == impl_->index.end() ? nullptr : &impl_->items[it->second];
}

absl::StatusOr<std::span<const std::byte>> LoadedShard::View(const std::string& name) {
  if (impl_ == nullptr || impl_->opened->handle_id.empty()) {
    return absl::FailedPreconditionError("LoadedShard is closed");
  }
  auto found = impl_->index.find(name);
  if (found == impl_->index.end()) {
    return absl::NotFoundError(absl::StrCat("no item ", QuoteForMessage(name), " in ",
                                            impl_->opened->core->options.job_id, "/", step(),
                                            " rank ", rank()));
  }
  const size_t i = found->second;
  const LoadedItem& item = impl_->items[i];
  const auto& regions = impl_->opened->regions;
  if (const std::byte* p = client::ContiguousRange(regions, item.offset_bytes, item.length_bytes);
      p != nullptr) {
    return std::span<const std::byte>(p, item.length_bytes);
  }
  absl::MutexLock lock(&impl_->mu);
  auto& copy = impl_->copies[i];
  if (copy == nullptr) {
    auto buf = std::make_unique_for_overwrite<std::byte[]>(item.length_bytes);
    const uint32_t crc = client::CopyFromShard(
        regions, item.offset_bytes, std::span<std::byte>(buf.get(), item.length_bytes));
    if (crc != item.crc32c) {
      impl_->copies.erase(i);
      return absl::DataLossError(
          ItemMismatch(impl_->opened->shard.items(static_cast<int>(i)), crc));
    }
    copy = std::move(buf);
  }
  return std::span<const std::byte>(copy.get(), item.length_bytes);
}

absl::Status LoadedShard::Close() {
  if (impl_ == nullptr) return absl::OkStatus();
  absl::Status s = impl_->opened->Close();
  absl::MutexLock lock(&impl_->mu);
  impl_->copies.clear();
  return s;
}

// ---- Client::Load / LoadInto --------------------------------------------------

absl::StatusOr<LoadedShard> Client::Load(uint64_t step) const {
  CKPT_ASSIGN_OR_RETURN(v1::LocateResponse located, Locate(*core_, step));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<OpenedShard> opened,
                        Open(core_, located, /*skip_verify=*/false));
  auto impl = std::make_unique<LoadedShard::Impl>();
  const v1::ShardInfo& shard = opened->shard;
  impl->items.reserve(shard.items_size());
  for (const v1::Item& it : shard.items()) {
    LoadedItem item;
    item.name = it.name();
    item.dtype = static_cast<DType>(it.dtype());
    item.shape.assign(it.shape().begin(), it.shape().end());
    item.offset_bytes = it.offset_bytes();
    item.length_bytes = it.length_bytes();
    item.crc32c = it.crc32c();
    item.attributes.insert(it.attributes().begin(), it.attributes().end());
    impl->index.emplace(item.name, impl->items.size());
    impl->items.push_back(std::move(item));
  }
  impl->opened = std::move(opened);
  return LoadedShard(std::move(impl));
}

absl::Status Client::LoadInto(uint64_t step,
                              const std::map<std::string, std::span<std::byte>>& buffers) const {
  CKPT_ASSIGN_OR_RETURN(v1::LocateResponse located, Locate(*core_, step));
  const std::string what =
      absl::StrCat(core_->options.job_id, "/", step, " rank ", core_->options.rank);

  // Attempt 0 trusts the local copy and checks crcs while copying; attempt 1
  // (after a mismatch) has the agent verify, which quarantines a corrupt copy
  // and falls back to the other sources.
  std::string first_mismatch;
  for (int attempt = 0; attempt < 2; ++attempt) {
    absl::StatusOr<std::unique_ptr<OpenedShard>> opened =
        Open(core_, located, /*skip_verify=*/attempt == 0);
    if (!opened.ok()) {
      if (attempt == 0) return opened.status();
      return absl::Status(opened.status().code(),
                          absl::StrCat(first_mismatch, " in ", what,
                                       "; re-opening with verification failed: ",
                                       opened.status().message()));
    }
    const v1::ShardInfo& shard = (*opened)->shard;
    // Resolve and check every buffer before copying anything.
    std::vector<std::pair<const v1::Item*, std::span<std::byte>>> plan;
    plan.reserve(buffers.size());
    {
      absl::flat_hash_map<std::string_view, const v1::Item*> by_name;
      by_name.reserve(shard.items_size());
      for (const v1::Item& it : shard.items()) by_name.emplace(it.name(), &it);
      for (const auto& [name, buf] : buffers) {
        auto it = by_name.find(name);
        if (it == by_name.end()) {
          return absl::NotFoundError(
              absl::StrCat("no item ", QuoteForMessage(name), " in ", what));
        }
        if (buf.size() != it->second->length_bytes()) {
          return absl::InvalidArgumentError(
              absl::StrCat("buffer for item ", QuoteForMessage(name), " is ", buf.size(),
                           " bytes, the item is ", it->second->length_bytes()));
        }
        plan.emplace_back(it->second, buf);
      }
    }
    std::string mismatch;
    for (const auto& [item, buf] : plan) {
      const uint32_t crc = client::CopyFromShard((*opened)->regions, item->offset_bytes(), buf);
      if (crc != item->crc32c()) {
        mismatch = ItemMismatch(*item, crc);
        break;
      }
    }
    absl::Status closed = (*opened)->Close();
    if (mismatch.empty()) {
      if (!closed.ok()) log::Warn("{}: {}", what, closed.ToString());
      return absl::OkStatus();
    }
    if (attempt == 1) {
      return absl::DataLossError(absl::StrCat(mismatch, " in ", what, " (",
                                              ServedFromName((*opened)->served_from),
                                              " copy, after verification by the agent)"));
    }
    log::Warn("{}: {}; re-opening with verification", what, mismatch);
    first_mismatch = std::move(mismatch);
  }
  return absl::InternalError("unreachable");
}

}  // namespace ckpt
