// Restore path: Locate at meta -> OpenShard at the local agent -> views of the
// mapped regions (LoadedShard) or checked copies into caller buffers
// (LoadInto) -> CloseShard.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "ckpt/client.h"
#include "client/client_core.h"
#include "common/crc32c.h"
#include "common/log.h"
#include "common/manifest.h"
#include "common/manifest_proto.h"
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

// An open shard at the agent, with its regions mapped. Closes the handle (in
// the background) when destroyed unless Close() was called.
struct OpenedShard {
  std::shared_ptr<ClientCore> core;
  std::string handle_id;
  std::string session_id;           // the session the handle was opened on ("" for none)
  v1::ShardInfo shard;              // key, size, crc, digest (items left out)
  std::vector<ManifestItem> items;  // the manifest, in offset order, validated (Load moves it out)
  // Instead of `items`: the packed manifest as the agent sent it, when the
  // caller asked for it (FinishOpen's keep_packed) and it is the committed
  // one without references (checked: every item inside the shard).
  std::string packed;
  ServedFrom served_from = ServedFrom::kUnknown;
  bool verified = false;
  std::vector<std::shared_ptr<client::MappedFile>> files;
  // A DPU agent's restore: the shard was written into this staging buffer.
  std::shared_ptr<client::PullStaging::Buffer> staging;
  std::vector<client::ShardRegion> regions;

  OpenedShard() = default;
  OpenedShard(const OpenedShard&) = delete;
  OpenedShard& operator=(const OpenedShard&) = delete;
  ~OpenedShard() { CloseInBackground(); }

  // Set by Close: the views are gone. (A delivered shard's handle closes at
  // once, while its views stay.)
  bool closed = false;

  // Closes the handle without waiting for the agent's answer.
  void CloseInBackground() {
    if (closed) return;
    closed = true;
    regions.clear();  // unmapped before the agent may reuse the bytes
    files.clear();
    staging.reset();
    if (!handle_id.empty()) client::CloseShardInBackground(*core, std::exchange(handle_id, ""), session_id);
  }

  absl::Status Close() {
    if (closed) return absl::OkStatus();
    closed = true;
    regions.clear();
    files.clear();
    staging.reset();
    if (handle_id.empty()) return absl::OkStatus();
    v1::CloseShardRequest req;
    req.set_handle_id(std::exchange(handle_id, ""));
    req.set_session_id(session_id);
    return core->agent->CloseShard(req, core->options.rpc_timeout);
  }
};

namespace {

absl::StatusOr<v1::LocateResponse> Locate(const ClientCore& core, uint64_t step, uint32_t rank, bool omit_items) {
  CKPT_RETURN_IF_ERROR(ValidateStep(step));
  v1::LocateRequest req;
  req.set_job_id(core.options.job_id);
  req.set_step(step);
  req.set_rank(rank);
  req.set_near_node_id(core.node_id);
  req.set_omit_items(omit_items);
  v1::LocateResponse resp;
  CKPT_RETURN_IF_ERROR(client::CallMetaRetrying(
      core, [&](absl::Duration timeout) { return core.meta->Locate(req, &resp, timeout); }));
  return resp;
}

// OK iff every item of the shard's own (references aside) lies inside a
// shard of `size` bytes.
absl::Status ItemsInside(const std::vector<ManifestItem>& items, uint64_t size) {
  for (const ManifestItem& it : items) {
    if (it.ref_step) continue;  // checked against its base (OpenBases)
    if (it.offset_bytes > size || it.length_bytes > size - it.offset_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("item ", QuoteForMessage(it.name), " [", it.offset_bytes,
                                                     ", +", it.length_bytes, ") lies outside the shard of ",
                                                     size, " bytes"));
    }
  }
  return absl::OkStatus();
}

// Sends OpenShard to the local agent: with Locate's answer (`located`), or,
// without it (null), for the agent's own copy alone. The handle is held by
// the returned OpenedShard (closed when it goes); `resp` keeps the rest of
// the answer for FinishOpen.
absl::StatusOr<std::unique_ptr<OpenedShard>> SendOpen(const std::shared_ptr<ClientCore>& core, uint64_t step,
                                                      uint32_t rank, const v1::LocateResponse* located,
                                                      bool skip_verify, v1::OpenShardResponse* resp) {
  v1::OpenShardRequest req;
  if (located != nullptr) {
    *req.mutable_key() = located->shard().key();
    *req.mutable_sources() = located->sources();
    *req.mutable_expected() = located->shard();
  } else {
    req.mutable_key()->set_job_id(core->options.job_id);
    req.mutable_key()->set_step(step);
    req.mutable_key()->set_rank(rank);
  }
  req.set_skip_verify(skip_verify);
  req.set_client_pid(static_cast<uint32_t>(::getpid()));
  req.set_packed_manifest(true);
  // The handle (and the views on it) lives until Close or the session's end.
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<client::AgentSession> session, client::OpenSession(*core));
  req.set_session_id(session == nullptr ? std::string() : session->id());
  bool answered = false;
  if (located == nullptr && session != nullptr && session->serves_requests()) {
    // The local copy alone, on the session's connection: no gRPC round trip
    // (docs/agent.md "Client sessions"). gRPC when the session is broken or
    // the agent does not verify this copy there (one over 64 MiB:
    // Unavailable; an agent older than this client verifies none on the
    // session: InvalidArgument).
    absl::StatusOr<std::string> reply =
        session->Request("OPEN", req.SerializeAsString(), core->options.load_timeout);
    if (reply.ok()) {
      if (!resp->ParseFromString(*reply)) return absl::InternalError("OpenShard (session): unparsable answer");
      answered = true;
    } else if (!absl::IsUnavailable(reply.status()) &&
               !(!skip_verify && absl::IsInvalidArgument(reply.status()))) {
      return Annotate(reply.status(), "OpenShard (session)");
    }
  }
  if (!answered) {
    CKPT_RETURN_IF_ERROR(core->agent->OpenShard(req, resp, core->options.load_timeout));
  }
  auto opened = std::make_unique<OpenedShard>();
  opened->core = core;
  opened->handle_id = resp->handle_id();  // closed by ~OpenedShard on any error from here
  opened->session_id = req.session_id();
  return opened;
}

// A pull-mode agent's restore (docs/dpu.md): the agent writes the shard into
// staging memory of ours behind a header holding the handle's token; the
// views then point into that buffer, and the handle is closed at once (the
// bytes are ours).
absl::Status Deliver(ClientCore& core, const std::string& token, OpenedShard& opened) {
  const uint64_t size = opened.shard.size_bytes();
  if (token.size() > client::kPullHeaderBytes) return absl::InternalError("the agent's deliver token is too long");
  CKPT_ASSIGN_OR_RETURN(opened.staging, client::StagingBuffer(core, client::kPullHeaderBytes + size));
  std::memset(opened.staging->data(), 0, client::kPullHeaderBytes);
  std::memcpy(opened.staging->data(), token.data(), token.size());
  v1::DeliverShardRequest req;
  req.set_handle_id(opened.handle_id);
  req.set_session_id(opened.session_id);
  v1::PullSource* target = req.mutable_target();
  target->set_worker_address(opened.staging->worker_address());
  target->set_rkey(opened.staging->rkey());
  target->set_address(reinterpret_cast<uint64_t>(opened.staging->data()));
  target->set_length_bytes(opened.staging->length());
  CKPT_RETURN_IF_ERROR(core.agent->DeliverShard(req, core.options.load_timeout));
  opened.regions = {client::ShardRegion{opened.staging->data() + client::kPullHeaderBytes, size, 0}};
  client::CloseShardInBackground(core, std::exchange(opened.handle_id, ""), opened.session_id);
  return absl::OkStatus();
}

// Fills `opened` from the agent's answer and Locate's (null: the local copy
// opened before meta answered, which UseLocal then checks against the
// version): the manifest comes packed from the agent (checked against its
// digest and the version's) and is validated (items inside the shard, no
// overlaps) before any view is built on it; then the regions are mapped
// read-only.
absl::Status FinishOpen(ClientCore& core, const v1::LocateResponse* located, v1::OpenShardResponse& resp,
                        OpenedShard& opened, bool keep_packed) {
  static const v1::LocateResponse kNone;
  const v1::LocateResponse& want = located != nullptr ? *located : kNone;
  if (located == nullptr && !resp.has_shard()) return absl::InternalError("OpenShard returned no shard");
  opened.shard = resp.has_shard() ? std::move(*resp.mutable_shard()) : want.shard();
  if (!opened.shard.has_key()) *opened.shard.mutable_key() = want.shard().key();
  opened.served_from = FromProto(resp.served_from().kind());
  opened.verified = resp.verified();
  for (const auto& f : resp.failed_sources()) {
    log::Info("restore of {}/{} rank {}: source {} failed: {}", core.options.job_id,
              opened.shard.key().step(), opened.shard.key().rank(),
              ServedFromName(FromProto(f.source().kind())), f.status().message());
  }
  const uint64_t digest = opened.shard.manifest_digest();
  // A packed manifest that hashes to the version's digest is the very one the
  // agent validated at commit: only what the views rely on (every item inside
  // the shard) is checked again. Anything else is validated in full. (The
  // local copy opened before meta answered is used only if its digest is the
  // version's: UseLocal.)
  const bool committed = !resp.manifest().empty() && digest != 0 &&
                         (located == nullptr || digest == located->shard().manifest_digest());
  if (!resp.manifest().empty() && ManifestDigestOfEncoding(resp.manifest()) != digest) {
    return absl::DataLossError(absl::StrCat("OpenShard returned a manifest that does not match its digest ",
                                            absl::Hex(digest, absl::kZeroPad16)));
  }
  if (keep_packed && committed && !PackedHasRefs(resp.manifest())) {
    const uint64_t size = opened.shard.size_bytes();
    absl::Status inside = ForEachPackedItem(resp.manifest(), [size](const PackedItem& it) {
      if (it.offset_bytes > size || it.length_bytes > size - it.offset_bytes) {
        return absl::InvalidArgumentError(absl::StrCat("item ", QuoteForMessage(it.name), " [", it.offset_bytes,
                                                       ", +", it.length_bytes, ") lies outside the shard of ",
                                                       size, " bytes"));
      }
      return absl::OkStatus();
    });
    if (!inside.ok()) return absl::InternalError(absl::StrCat("OpenShard returned a bad manifest: ", inside.message()));
    opened.packed = std::move(*resp.mutable_manifest());
  } else if (!resp.manifest().empty()) {
    absl::StatusOr<std::vector<ManifestItem>> items = DecodeManifest(resp.manifest());
    if (!items.ok()) {
      return absl::InternalError(absl::StrCat("OpenShard returned a bad manifest: ", items.status().message()));
    }
    opened.items = *std::move(items);
  } else {
    // An agent that does not pack manifests: items in the shard info.
    opened.items =
        SortedManifestFromProto(opened.shard.items_size() > 0 ? opened.shard.items() : want.shard().items());
    opened.shard.clear_items();
  }
  if (want.shard().manifest_digest() != 0 && digest != 0 && digest != want.shard().manifest_digest()) {
    return absl::DataLossError(absl::StrCat(
        "the manifest of the ", ServedFromName(opened.served_from), " copy (digest ",
        absl::Hex(digest, absl::kZeroPad16), ") differs from the version's (",
        absl::Hex(want.shard().manifest_digest(), absl::kZeroPad16), ")"));
  }
  const absl::Status valid = !opened.packed.empty() ? absl::OkStatus()
                             : committed           ? ItemsInside(opened.items, opened.shard.size_bytes())
                                                   : ValidateManifest(opened.items, opened.shard.size_bytes());
  if (!valid.ok()) {
    return absl::InternalError(absl::StrCat("OpenShard returned a bad manifest: ", valid.message()));
  }
  if (resp.deliver()) return Deliver(core, resp.deliver_token(), opened);
  absl::StatusOr<std::vector<client::ShardRegion>> regions =
      client::MapRegions(core, resp.regions(), opened.shard.size_bytes(),
                         client::MappedFile::Access::kReadOnly, &opened.files);
  if (!regions.ok()) {
    return Annotate(regions.status(), absl::StrCat("regions of shard handle ", resp.handle_id()));
  }
  opened.regions = *std::move(regions);
  return absl::OkStatus();
}

// OpenShard with Locate's answer, finished.
absl::StatusOr<std::unique_ptr<OpenedShard>> Open(const std::shared_ptr<ClientCore>& core,
                                                  const v1::LocateResponse& located, bool skip_verify,
                                                  bool keep_packed) {
  v1::OpenShardResponse resp;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<OpenedShard> opened,
                        SendOpen(core, located.shard().key().step(), located.shard().key().rank(), &located,
                                 skip_verify, &resp));
  CKPT_RETURN_IF_ERROR(FinishOpen(*core, &located, resp, *opened, keep_packed));
  return opened;
}

// A call handed to `core.calls` that the caller runs itself if no thread of
// that executor has taken it when the caller wants its result (a full or busy
// executor never makes it wait, and calls that wait for each other on the
// executor never deadlock). Get() returns the result. What the call holds
// (its captures, its result) is let go on the caller's thread, never on the
// executor's (a ClientCore must not end on its own executor): the
// destructor waits for a call a thread took, and a call no thread took never
// runs.
template <typename T>
class Claimed {
 public:
  Claimed(Executor& executor, std::function<T()> fn) : state_(std::make_shared<State>()) {
    state_->fn = std::move(fn);
    executor.TrySubmit([state = state_] { state->RunIfUnclaimed(); });
  }
  Claimed(const Claimed&) = delete;
  Claimed& operator=(const Claimed&) = delete;
  ~Claimed() {
    if (state_->claimed.exchange(true)) state_->done.WaitForNotification();
    state_->fn = nullptr;
    state_->result = T();
  }

  T& Get() {
    if (!state_->RunIfUnclaimed()) state_->done.WaitForNotification();
    return state_->result;
  }

 private:
  struct State {
    std::atomic<bool> claimed{false};
    std::function<T()> fn;
    T result;
    absl::Notification done;
    bool RunIfUnclaimed() {
      if (claimed.exchange(true)) return false;
      result = fn();
      done.Notify();
      return true;
    }
  };
  std::shared_ptr<State> state_;  // shared with the executor's copy of the call
};

// Locate at meta, sent on `core.calls`: Wait() returns its answer.
class PendingLocate {
 public:
  PendingLocate(ClientCore& core, uint64_t step, uint32_t rank, bool omit_items)
      : call_(core.calls, [&core, step, rank, omit_items] { return Locate(core, step, rank, omit_items); }) {}

  absl::StatusOr<v1::LocateResponse> Wait() { return std::move(call_.Get()); }

 private:
  Claimed<absl::StatusOr<v1::LocateResponse>> call_;
};

using Bases = std::map<uint64_t, std::unique_ptr<OpenedShard>>;

// The mapped regions that hold `item`'s bytes: the shard's own or its base's.
const std::vector<ShardRegion>& RegionsFor(const OpenedShard& main, const Bases& bases,
                                           std::optional<uint64_t> ref_step) {
  if (!ref_step) return main.regions;
  return bases.at(*ref_step)->regions;
}

std::string ItemMismatch(const std::string& name, uint32_t expected, uint32_t actual) {
  return absl::StrCat("item ", QuoteForMessage(name), " fails its checksum: crc32c ",
                      absl::Hex(actual, absl::kZeroPad8), ", manifest says ",
                      absl::Hex(expected, absl::kZeroPad8));
}

// The first item of `main` (decoded: items, perhaps references to bases)
// whose bytes fail their crc32c, as ItemMismatch says it; "" when all match.
// (A packed manifest is checked by LoadListing.)
std::string FirstMismatch(const OpenedShard& main, const Bases& bases) {
  for (const ManifestItem& it : main.items) {
    const uint32_t crc = ShardRangeCrc(RegionsFor(main, bases, it.ref_step), it.offset_bytes, it.length_bytes);
    if (crc != it.crc32c) return ItemMismatch(it.name, it.crc32c, crc);
  }
  return "";
}

// Load's listing of a shard whose manifest came packed (no references): its
// LoadedItems, built on the caller's thread, and beside them (on a thread of
// its own for a big shard: 1 MiB or more to check, or 1,024 items or more;
// after them otherwise) the check of the items' bytes and the name index
// (views into the packed manifest). It may start on the local copy before
// meta answered (OpenBestNow), to be abandoned when that copy is not used.
// The shard must not change or go before Wait() or Abandon() returned (the
// destructor waits).
class LoadListing {
 public:
  using Index = absl::flat_hash_map<std::string_view, size_t>;
  LoadListing() = default;
  LoadListing(const LoadListing&) = delete;
  LoadListing& operator=(const LoadListing&) = delete;
  ~LoadListing() { Abandon(); }

  // `check`: the crc32c of every item's bytes (else only the index).
  void Start(const OpenedShard& main, bool check) {
    Abandon();
    main_ = &main;
    const bool big = (check && main.shard.size_bytes() >= kBesideBytes) ||
                     PackedItemCount(main.packed) >= kBesideItems;
    if (big) thread_ = std::thread([this, &main, check] { Run(main, check); });
    {
      absl::MutexLock lock(&main.core->spare_items_mu);
      items_.swap(main.core->spare_items);
    }
    items_.reserve(PackedItemCount(main.packed));
    const uint64_t step = main.shard.key().step();
    listed_ = ForEachPackedItem(main.packed, [&](const PackedItem& it) {
      LoadedItem& item = items_.emplace_back();
      item.name = it.name;
      item.dtype = static_cast<DType>(it.dtype);
      item.shape = it.Shape();
      item.offset_bytes = it.offset_bytes;
      item.length_bytes = it.length_bytes;
      item.crc32c = it.crc32c;
      if (it.attribute_count > 0) item.attributes = it.Attributes();
      item.step = step;
      return absl::OkStatus();
    });
    if (!big) Run(main, check);
  }
  // True if started on `main` and not abandoned.
  bool StartedOn(const OpenedShard& main) const { return main_ == &main; }
  // Waits for the work beside; then listed() says whether the items could
  // be listed (the manifest reads), mismatch() names the first item that
  // fails its crc32c, as ItemMismatch says it ("" if all match or
  // unchecked), and the items and index may be taken.
  void Wait() {
    if (thread_.joinable()) thread_.join();
  }
  // Waits and forgets everything.
  void Abandon() {
    Wait();
    main_ = nullptr;
    mismatch_.clear();
    index_.clear();
    items_.clear();
    listed_ = absl::OkStatus();
  }
  const absl::Status& listed() const { return listed_; }
  const std::string& mismatch() const { return mismatch_; }
  std::vector<LoadedItem> TakeItems() { return std::move(items_); }
  Index TakeIndex() { return std::move(index_); }

 private:
  static constexpr uint64_t kBesideBytes = 1 << 20;
  static constexpr size_t kBesideItems = 1024;

  void Run(const OpenedShard& main, bool check) {
    // The check is one pass over the whole shard (its items and the zeroed
    // padding between them) against the shard's crc32c, at memory speed; item
    // by item (a crc per item of a few KiB costs about twice as much) only when
    // that fails, to name the first item that fails its own.
    const bool per_item =
        check && ShardRangeCrc(main.regions, 0, main.shard.size_bytes()) != main.shard.crc32c();
    index_.reserve(PackedItemCount(main.packed));
    size_t i = 0;
    (void)ForEachPackedItem(main.packed, [&](const PackedItem& it) {
      index_.emplace(it.name, i++);
      if (!per_item || !mismatch_.empty()) return absl::OkStatus();
      const uint32_t crc = ShardRangeCrc(main.regions, it.offset_bytes, it.length_bytes);
      if (crc != it.crc32c) mismatch_ = ItemMismatch(std::string(it.name), it.crc32c, crc);
      return absl::OkStatus();
    });
    if (per_item && mismatch_.empty()) {
      log::Warn("{}/{} rank {}: the shard fails its crc32c {} but every item matches its own (the padding "
                "between items changed)", main.shard.key().job_id(), main.shard.key().step(),
                main.shard.key().rank(), absl::StrCat(absl::Hex(main.shard.crc32c(), absl::kZeroPad8)));
    }
  }

  const OpenedShard* main_ = nullptr;
  std::thread thread_;
  std::string mismatch_;
  Index index_;
  std::vector<LoadedItem> items_;
  absl::Status listed_;
};

// The local agent's copy, opened and finished (FinishOpen without Locate's
// answer) while meta answered where the shard lives: used if meta names
// that copy first and it is the version's (size, crc32c, manifest digest).
// Null (handle closed) otherwise.
std::unique_ptr<OpenedShard> UseLocal(const std::shared_ptr<ClientCore>& core, const v1::LocateResponse& located,
                                      absl::StatusOr<std::unique_ptr<OpenedShard>>& local,
                                      const absl::Status& finished) {
  if (!local.ok()) return nullptr;
  std::unique_ptr<OpenedShard> opened = *std::move(local);
  const v1::ShardInfo& want = located.shard();
  const v1::ShardInfo& have = opened->shard;
  const bool named_first = located.sources_size() > 0 && located.sources(0).kind() == v1::SOURCE_KIND_LOCAL;
  if (!named_first) return nullptr;
  if (!finished.ok()) {
    log::Info("{}/{} rank {}: the local copy cannot be used ({}); trying every source", core->options.job_id,
              want.key().step(), want.key().rank(), std::string(finished.message()));
    return nullptr;
  }
  if (have.size_bytes() != want.size_bytes() || have.crc32c() != want.crc32c() || want.manifest_digest() == 0 ||
      have.manifest_digest() != want.manifest_digest()) {
    log::Info("{}/{} rank {}: the local copy differs from the version's (size, crc32c or manifest); "
              "trying every source", core->options.job_id, want.key().step(), want.key().rank());
    return nullptr;
  }
  return opened;
}

// Opens this rank's shard of `step`. The local agent opens its own copy
// first, if it has one, with the manifest from the agent alone (on the
// session's connection when the agent takes requests there). If meta told
// that agent the version is restorable from memory (version_staged), that
// copy is used without asking meta. Otherwise meta is asked where the shard
// lives (without the manifest), and the manifest is decoded and checked and
// the regions mapped before meta's answer is waited for: the local copy
// serves in about one round trip to meta. Without a local copy, or if it
// cannot be used (missing, corrupt, not the version's), every source goes to
// the agent, which checks them with meta and fetches the shard from the next
// one.
absl::StatusOr<std::unique_ptr<OpenedShard>> OpenBestNow(const std::shared_ptr<ClientCore>& core, uint64_t step,
                                                         uint32_t rank, bool skip_verify, bool keep_packed,
                                                         LoadListing* listing, bool check) {
  CKPT_RETURN_IF_ERROR(ValidateStep(step));
  v1::LocateResponse located;
  {
    v1::OpenShardResponse resp;
    absl::StatusOr<std::unique_ptr<OpenedShard>> local = SendOpen(core, step, rank, nullptr, skip_verify, &resp);
    const bool staged = local.ok() && resp.version_staged();
    std::optional<PendingLocate> locate;
    if (!staged) locate.emplace(*core, step, rank, /*omit_items=*/true);
    absl::Status finished = local.status();
    if (local.ok()) finished = FinishOpen(*core, nullptr, resp, **local, keep_packed);
    // The caller's listing of the items starts on the local copy while meta
    // answers; abandoned (waited for) if that copy is not used.
    if (listing != nullptr && finished.ok() && !(*local)->packed.empty()) {
      listing->Start(**local, check && !(*local)->verified);
    }
    absl::Cleanup not_used = [&] {
      if (listing != nullptr) listing->Abandon();
    };
    if (staged && finished.ok()) {
      std::move(not_used).Cancel();
      return *std::move(local);
    }
    if (!locate) locate.emplace(*core, step, rank, /*omit_items=*/true);
    CKPT_ASSIGN_OR_RETURN(located, locate->Wait());  // a version meta does not serve: its error
    if (std::unique_ptr<OpenedShard> opened = UseLocal(core, located, local, finished); opened != nullptr) {
      std::move(not_used).Cancel();
      return opened;
    }
    if (!local.ok() && !absl::IsNotFound(local.status()) && !absl::IsDataLoss(local.status()) &&
        located.sources_size() > 0 && located.sources(0).kind() == v1::SOURCE_KIND_LOCAL) {
      return local.status();  // the agent itself fails (unavailable, session gone, ...)
    }
  }
  // The agent asks meta for the shard's record (items included) itself
  // before it reads any source (docs/protocol.md "Restore"): Locate's answer
  // without the items is enough. An agent older than that wants the items
  // from us.
  absl::StatusOr<std::unique_ptr<OpenedShard>> opened = Open(core, located, skip_verify, keep_packed);
  if (absl::IsNotFound(opened.status())) {
    // A source meta named went away before the agent read it (meta aborted
    // the version as data lost, or moved the copy, and the holder dropped
    // it): meta's answer now says which.
    CKPT_ASSIGN_OR_RETURN(located, Locate(*core, step, rank, /*omit_items=*/true));
    opened = Open(core, located, skip_verify, keep_packed);
  }
  if (opened.ok() || !absl::IsInvalidArgument(opened.status()) ||
      !absl::StrContains(opened.status().message(), "expected.items")) {
    return opened;
  }
  CKPT_ASSIGN_OR_RETURN(located, Locate(*core, step, rank, /*omit_items=*/false));
  return Open(core, located, skip_verify, keep_packed);
}

// OpenBestNow, and, in a job of one rank, once more when meta does not serve
// a step this client committed within kBeginGrace yet (Locate: NOT_FOUND, not
// begun; or FAILED_PRECONDITION, still OPEN) after waiting for it to be
// STAGED: the agent begins the version and reports the shard in the
// background, so a load right after a save would fail otherwise. With several
// ranks the version also waits for the others: their loads say so at once
// (wait for the version first, e.g. SaveHandle::Wait).
// `listing`, if not null, may be started on the shard returned (with its
// crc32c check if `check`), or is left unstarted.
absl::StatusOr<std::unique_ptr<OpenedShard>> OpenBest(const std::shared_ptr<ClientCore>& core, uint64_t step,
                                                      uint32_t rank, bool skip_verify, bool keep_packed = false,
                                                      LoadListing* listing = nullptr, bool check = false) {
  absl::StatusOr<std::unique_ptr<OpenedShard>> opened =
      OpenBestNow(core, step, rank, skip_verify, keep_packed, listing, check);
  const absl::Status& s = opened.status();
  if (opened.ok() || core->options.world_size != 1 || rank != core->options.rank ||
      !(absl::IsNotFound(s) || absl::IsFailedPrecondition(s)) || !absl::StartsWith(s.message(), "Locate: ")) {
    return opened;
  }
  const absl::Time grace_end = core->GraceEnd(step);
  if (absl::Now() >= grace_end) return opened;
  if (!WaitForVersion(*core, step, Level::kStaged, grace_end, grace_end).ok()) return opened;
  return OpenBestNow(core, step, rank, skip_verify, keep_packed, listing, check);
}

// The versions an incremental shard's references point to, opened (this
// rank's shards, through OpenBest: the local copy or any source), by step.
// Every reference must name one of its base's own items (same offset,
// length and crc32c): the agent verified those, so views of them are safe.
absl::StatusOr<Bases> OpenBases(const std::shared_ptr<ClientCore>& core, const OpenedShard& main,
                                bool skip_verify) {
  Bases bases;
  const std::vector<uint64_t> steps = RefSteps(main.items);
  if (steps.empty()) return bases;
  const uint64_t step = main.shard.key().step();
  for (uint64_t base : steps) {
    absl::StatusOr<std::unique_ptr<OpenedShard>> opened = OpenBest(core, base, main.shard.key().rank(), skip_verify);
    if (!opened.ok()) {
      return Annotate(opened.status(), absl::StrCat("version ", base, ", whose items version ", step,
                                                    " refers to (incremental save)"));
    }
    bases.emplace(base, *std::move(opened));
  }
  std::map<uint64_t, std::map<uint64_t, const ManifestItem*>> own;  // base -> offset -> item
  for (const auto& [base, opened] : bases) {
    auto& by_offset = own[base];
    for (const ManifestItem& it : opened->items) {
      // (Empty items may share an offset with the next one: never referred to.)
      if (!it.ref_step && it.length_bytes > 0) by_offset.emplace(it.offset_bytes, &it);
    }
  }
  for (const ManifestItem& it : main.items) {
    if (!it.ref_step || it.length_bytes == 0) continue;
    const auto& by_offset = own[*it.ref_step];
    auto found = by_offset.find(it.offset_bytes);
    if (found == by_offset.end() || found->second->length_bytes != it.length_bytes ||
        found->second->crc32c != it.crc32c) {
      return absl::DataLossError(absl::StrCat("item ", QuoteForMessage(it.name), " of version ", step,
                                              " refers to [", it.offset_bytes, ", +", it.length_bytes,
                                              ") of version ", *it.ref_step, ", which holds no such item"));
    }
  }
  return bases;
}

// A loaded version becomes the client's base for incremental saves
// (SavedBase) when it has none or an older one: a restarted trainer goes on
// saving incrementally against the version it restored. (The shard and the
// versions it refers to were just opened through the local agent, which
// keeps copies of them: the next save's lease finds them there.)
void AdoptAsBase(ClientCore& core, uint64_t step, const OpenedShard& opened) {
  {
    absl::MutexLock lock(&core.base_mu);
    if (core.base && core.base->step >= step) return;
  }
  auto commit = std::make_shared<v1::CommitShardRequest>();
  commit->set_manifest(opened.packed.empty() ? EncodeManifest(opened.items) : opened.packed);
  absl::MutexLock lock(&core.base_mu);
  if (core.base && core.base->step >= step) return;
  core.base = SavedBase{step, std::move(commit), nullptr};
}

}  // namespace
}  // namespace client

using client::AdoptAsBase;
using client::Bases;
using client::ItemMismatch;
using client::OpenBases;
using client::OpenBest;
using client::OpenedShard;
using client::RegionsFor;

// ---- LoadedShard --------------------------------------------------------------

struct LoadedShard::Impl {
  std::unique_ptr<OpenedShard> opened;
  Bases bases;  // the versions references point to (incremental saves)
  std::vector<LoadedItem> items;
  // name -> items[i]; the views are into opened->packed, or into items'
  // names when the manifest was decoded.
  absl::flat_hash_map<std::string_view, size_t> index;
  absl::Mutex mu;
  // Items copied out of non-adjacent regions, by index.
  absl::flat_hash_map<size_t, std::unique_ptr<std::byte[]>> copies ABSL_GUARDED_BY(mu);
};

LoadedShard::LoadedShard(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LoadedShard::LoadedShard(LoadedShard&&) noexcept = default;
LoadedShard& LoadedShard::operator=(LoadedShard&& other) noexcept {
  if (this != &other) {
    CloseInBackground();
    impl_ = std::move(other.impl_);
  }
  return *this;
}
LoadedShard::~LoadedShard() {
  CloseInBackground();
  if (impl_ == nullptr) return;
  // The emptied item array goes to the next Load (ClientCore::spare_items).
  impl_->index.clear();
  impl_->items.clear();
  ClientCore& core = *impl_->opened->core;
  absl::MutexLock lock(&core.spare_items_mu);
  if (core.spare_items.capacity() < impl_->items.capacity()) core.spare_items.swap(impl_->items);
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

absl::Status LoadedShard::CopyItem(size_t index, std::span<std::byte> dst) const {
  if (impl_ == nullptr || impl_->opened->closed) {
    return absl::FailedPreconditionError("LoadedShard is closed");
  }
  if (index >= impl_->items.size()) {
    return absl::OutOfRangeError(absl::StrCat("item index ", index, " is out of range: the shard has ",
                                              impl_->items.size(), " items"));
  }
  const LoadedItem& item = impl_->items[index];
  if (dst.size() != item.length_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("buffer for item ", QuoteForMessage(item.name), " is ",
                                                   dst.size(), " bytes, the item is ", item.length_bytes));
  }
  const uint32_t crc = client::CopyFromShard(RegionsOf(item), item.offset_bytes, dst);
  if (crc != item.crc32c) return absl::DataLossError(ItemMismatch(item.name, item.crc32c, crc));
  return absl::OkStatus();
}

absl::Status LoadedShard::CopyItems(std::span<const size_t> index, std::span<const std::span<std::byte>> dst) const {
  if (impl_ == nullptr || impl_->opened->closed) {
    return absl::FailedPreconditionError("LoadedShard is closed");
  }
  if (index.size() != dst.size()) {
    return absl::InvalidArgumentError(absl::StrCat(index.size(), " item indexes for ", dst.size(), " buffers"));
  }
  std::vector<client::ItemRead> reads;
  reads.reserve(index.size());
  for (size_t k = 0; k < index.size(); ++k) {
    if (index[k] >= impl_->items.size()) {
      return absl::OutOfRangeError(absl::StrCat("item index ", index[k], " is out of range: the shard has ",
                                                impl_->items.size(), " items"));
    }
    const LoadedItem& item = impl_->items[index[k]];
    if (dst[k].size() != item.length_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("buffer for item ", QuoteForMessage(item.name), " is ",
                                                     dst[k].size(), " bytes, the item is ", item.length_bytes));
    }
    reads.push_back(client::ItemRead{RegionsOf(item), item.offset_bytes, dst[k]});
  }
  const std::vector<uint32_t> crcs = client::CopyItemsFromShard(reads);
  for (size_t k = 0; k < index.size(); ++k) {
    const LoadedItem& item = impl_->items[index[k]];
    if (crcs[k] != item.crc32c) return absl::DataLossError(ItemMismatch(item.name, item.crc32c, crcs[k]));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::span<const std::byte>> LoadedShard::View(const std::string& name) {
  if (impl_ == nullptr || impl_->opened->closed) {
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
  const auto& regions = RegionsOf(item);
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
      return absl::DataLossError(ItemMismatch(item.name, item.crc32c, crc));
    }
    copy = std::move(buf);
  }
  return std::span<const std::byte>(copy.get(), item.length_bytes);
}

const std::vector<client::ShardRegion>& LoadedShard::RegionsOf(const LoadedItem& item) const {
  return RegionsFor(*impl_->opened, impl_->bases, item.step == step() ? std::nullopt : std::optional(item.step));
}

absl::Status LoadedShard::Close() {
  if (impl_ == nullptr) return absl::OkStatus();
  absl::Status s = impl_->opened->Close();
  for (auto& [step, base] : impl_->bases) s.Update(base->Close());
  absl::MutexLock lock(&impl_->mu);
  impl_->copies.clear();
  return s;
}

void LoadedShard::CloseInBackground() {
  if (impl_ == nullptr) return;
  impl_->opened->CloseInBackground();
  for (auto& [step, base] : impl_->bases) base->CloseInBackground();
  absl::MutexLock lock(&impl_->mu);
  impl_->copies.clear();
}

// ---- Client::Load / LoadInto --------------------------------------------------

namespace client {
absl::Status LoadIntoOpened(const std::shared_ptr<ClientCore>& core, uint64_t step,
                            const std::map<std::string, std::span<std::byte>>& buffers,
                            absl::StatusOr<std::unique_ptr<OpenedShard>> first);
}  // namespace client

absl::StatusOr<LoadedShard> Client::Load(uint64_t step, const LoadOptions& options) const {
  CKPT_RETURN_IF_ERROR(core_->CheckProcess());
  core_->WaitSaves();  // this client's own saves first (lazy ones included)
  const uint32_t rank = options.rank.value_or(core_->options.rank);
  // With verification, attempt 0 opens the copy without the agent's check
  // and checks every item's crc32c here, on a second thread while the items
  // are listed (the agent's check was a pass over the shard before it
  // answered); attempt 1 (after a mismatch) has the agent verify, which
  // quarantines a corrupt copy and falls back to the other sources (as
  // LoadInto does).
  std::string first_mismatch;
  for (int attempt = 0; attempt < 2; ++attempt) {
    const bool agent_verifies = options.verify && attempt == 1;
    absl::StatusOr<std::unique_ptr<OpenedShard>> opened;
    // Reads the shard until waited for: declared after it, so it goes first.
    client::LoadListing listing;
    opened = OpenBest(core_, step, rank, /*skip_verify=*/!agent_verifies, /*keep_packed=*/true, &listing,
                      options.verify);
    if (!opened.ok()) {
      if (attempt == 0) return opened.status();
      return absl::Status(opened.status().code(), absl::StrCat(first_mismatch, "; re-opening with verification failed: ",
                                                               opened.status().message()));
    }
    auto impl = std::make_unique<LoadedShard::Impl>();
    CKPT_ASSIGN_OR_RETURN(impl->bases, OpenBases(core_, **opened, /*skip_verify=*/!agent_verifies));
    const OpenedShard& main = **opened;
    const bool check = options.verify && !main.verified;
    std::string mismatch;
    if (!main.packed.empty()) {
      // Straight from the agent's packed manifest (no references: checked),
      // listed while meta answered if this is the local copy.
      if (!listing.StartedOn(main)) listing.Start(main, check);
      listing.Wait();
      if (!listing.listed().ok()) {
        return absl::InternalError(absl::StrCat("the packed manifest: ", listing.listed().message()));  // read before
      }
      mismatch = listing.mismatch();
      impl->items = listing.TakeItems();
      impl->index = listing.TakeIndex();
    } else {
      if (check) mismatch = client::FirstMismatch(main, impl->bases);  // before the items move
      impl->items.reserve(main.items.size());
      for (ManifestItem& it : (*opened)->items) {
        LoadedItem item;
        item.name = std::move(it.name);
        item.dtype = static_cast<DType>(it.dtype);
        item.shape = std::move(it.shape);
        item.offset_bytes = it.offset_bytes;
        item.length_bytes = it.length_bytes;
        item.crc32c = it.crc32c;
        item.attributes = std::move(it.attributes);
        item.step = it.ref_step.value_or(step);
        impl->items.push_back(std::move(item));
      }
      (*opened)->items.clear();  // moved into impl->items
      impl->index.reserve(impl->items.size());
      for (size_t i = 0; i < impl->items.size(); ++i) impl->index.emplace(impl->items[i].name, i);
    }
    if (mismatch.empty()) {
      if (options.verify) (*opened)->verified = true;
      impl->opened = *std::move(opened);
      // Another rank's shard (a resharding restore) is never this rank's base.
      if (rank == core_->options.rank) AdoptAsBase(*core_, step, *impl->opened);
      return LoadedShard(std::move(impl));
    }
    const std::string what = absl::StrCat(core_->options.job_id, "/", step, " rank ", rank);
    if (attempt == 1) {
      return absl::DataLossError(absl::StrCat(mismatch, " in ", what, " (", ServedFromName((*opened)->served_from),
                                              " copy, after verification by the agent)"));
    }
    log::Warn("{}: {}; re-opening with verification", what, mismatch);
    first_mismatch = absl::StrCat(mismatch, " in ", what);
  }
  return absl::InternalError("unreachable");
}

absl::Status Client::LoadInto(uint64_t step,
                              const std::map<std::string, std::span<std::byte>>& buffers) const {
  CKPT_RETURN_IF_ERROR(core_->CheckProcess());
  core_->WaitSaves();  // this client's own saves first (lazy ones included)
  return client::LoadIntoOpened(core_, step, buffers,
                                OpenBest(core_, step, core_->options.rank, /*skip_verify=*/true, /*keep_packed=*/true));
}

absl::Status Client::LoadIntoWhileOpening(uint64_t step,
                                          const std::function<absl::StatusOr<Buffers>()>& buffers) const {
  CKPT_RETURN_IF_ERROR(core_->CheckProcess());
  core_->WaitSaves();
  // The open (Locate and the local agent's answer) on the client's call
  // thread while the caller works out its buffers here.
  client::Claimed<absl::StatusOr<std::unique_ptr<OpenedShard>>> opening(
      core_->calls, [core = core_, step] {
        return OpenBest(core, step, core->options.rank, /*skip_verify=*/true, /*keep_packed=*/true);
      });
  absl::StatusOr<Buffers> found = buffers();
  absl::StatusOr<std::unique_ptr<OpenedShard>> opened = std::move(opening.Get());
  if (!found.ok()) return found.status();
  return client::LoadIntoOpened(core_, step, *found, std::move(opened));
}

namespace client {

// LoadInto's work once its first open (`first`: without the agent's
// verification) answered.
absl::Status LoadIntoOpened(const std::shared_ptr<ClientCore>& core, uint64_t step,
                            const std::map<std::string, std::span<std::byte>>& buffers,
                            absl::StatusOr<std::unique_ptr<OpenedShard>> first) {
  const std::string what = absl::StrCat(core->options.job_id, "/", step, " rank ", core->options.rank);
  // Attempt 0 trusts the local copy and checks crcs while copying; attempt 1
  // (after a mismatch) has the agent verify, which quarantines a corrupt copy
  // and falls back to the other sources.
  std::string first_mismatch;
  for (int attempt = 0; attempt < 2; ++attempt) {
    absl::StatusOr<std::unique_ptr<OpenedShard>> opened =
        attempt == 0 ? std::move(first)
                     : OpenBest(core, step, core->options.rank, /*skip_verify=*/false, /*keep_packed=*/true);
    if (!opened.ok()) {
      if (attempt == 0) return opened.status();
      return absl::Status(opened.status().code(),
                          absl::StrCat(first_mismatch, " in ", what,
                                       "; re-opening with verification failed: ",
                                       opened.status().message()));
    }
    absl::StatusOr<Bases> bases = OpenBases(core, **opened, /*skip_verify=*/attempt == 0);
    if (!bases.ok()) return bases.status();
    // Where each item's bytes are, by name (views into the manifest).
    struct Where {
      std::string_view name;
      uint64_t offset_bytes;
      uint64_t length_bytes;
      uint32_t crc32c;
      std::optional<uint64_t> ref_step;
    };
    absl::flat_hash_map<std::string_view, Where> by_name;
    if (!(*opened)->packed.empty()) {
      by_name.reserve(PackedItemCount((*opened)->packed));
      const absl::Status s = ForEachPackedItem((*opened)->packed, [&](const PackedItem& it) {
        by_name.emplace(it.name, Where{it.name, it.offset_bytes, it.length_bytes, it.crc32c, it.ref_step});
        return absl::OkStatus();
      });
      if (!s.ok()) return absl::InternalError(absl::StrCat("the packed manifest: ", s.message()));  // read before
    } else {
      by_name.reserve((*opened)->items.size());
      for (const ManifestItem& it : (*opened)->items) {
        by_name.emplace(it.name, Where{it.name, it.offset_bytes, it.length_bytes, it.crc32c, it.ref_step});
      }
    }
    // Resolve and check every buffer before copying anything.
    std::vector<std::pair<const Where*, std::span<std::byte>>> plan;
    plan.reserve(buffers.size());
    for (const auto& [name, buf] : buffers) {
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        return absl::NotFoundError(absl::StrCat("no item ", QuoteForMessage(name), " in ", what));
      }
      if (buf.size() != it->second.length_bytes) {
        return absl::InvalidArgumentError(absl::StrCat("buffer for item ", QuoteForMessage(name), " is ",
                                                       buf.size(), " bytes, the item is ", it->second.length_bytes));
      }
      plan.emplace_back(&it->second, buf);
    }
    std::string mismatch;
    std::vector<client::ItemRead> reads;
    reads.reserve(plan.size());
    for (const auto& [item, buf] : plan) {
      reads.push_back(client::ItemRead{RegionsFor(**opened, *bases, item->ref_step), item->offset_bytes, buf});
    }
    const std::vector<uint32_t> crcs = client::CopyItemsFromShard(reads);
    for (size_t k = 0; k < plan.size(); ++k) {
      if (crcs[k] != plan[k].first->crc32c) {
        mismatch = ItemMismatch(std::string(plan[k].first->name), plan[k].first->crc32c, crcs[k]);
        break;
      }
    }
    (*opened)->CloseInBackground();
    for (auto& [base_step, base] : *bases) base->CloseInBackground();
    if (mismatch.empty()) {
      AdoptAsBase(*core, step, **opened);
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

absl::StatusOr<std::optional<ShardRanges>> OpenShardRanges(const std::shared_ptr<ClientCore>& core, uint64_t step,
                                                           uint32_t rank, std::span<const ByteSpan> ranges) {
  CKPT_ASSIGN_OR_RETURN(v1::LocateResponse located, Locate(*core, step, rank, /*omit_items=*/true));
  if (located.sources_size() == 0 || located.sources(0).kind() != v1::SOURCE_KIND_REPLICA) return std::nullopt;
  v1::OpenShardRequest req;
  *req.mutable_key() = located.shard().key();
  *req.mutable_sources() = located.sources();
  *req.mutable_expected() = located.shard();
  req.set_client_pid(static_cast<uint32_t>(::getpid()));
  req.set_packed_manifest(true);
  uint64_t total = 0;
  for (const ByteSpan& r : ranges) {
    v1::ByteRange* b = req.add_ranges();
    b->set_offset(r.offset);
    b->set_length(r.length);
    total += r.length;
  }
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<client::AgentSession> session, client::OpenSession(*core));
  req.set_session_id(session == nullptr ? std::string() : session->id());
  v1::OpenShardResponse resp;
  CKPT_RETURN_IF_ERROR(core->agent->OpenShard(req, &resp, core->options.load_timeout));
  auto opened = std::make_shared<OpenedShard>();
  opened->core = core;
  opened->handle_id = resp.handle_id();  // closed when `opened` goes
  opened->session_id = req.session_id();
  if (!resp.ranges_only() || resp.deliver()) return std::nullopt;
  if (resp.shard().size_bytes() != total) {
    return absl::InternalError(absl::StrCat("OpenShard returned ", resp.shard().size_bytes(), " bytes for ranges of ",
                                            total));
  }
  CKPT_ASSIGN_OR_RETURN(opened->regions, client::MapRegions(*core, resp.regions(), total,
                                                            client::MappedFile::Access::kReadOnly, &opened->files));
  ShardRanges out;
  uint64_t at = 0;
  uint32_t crc = 0;
  for (const ByteSpan& r : ranges) {
    if (const std::byte* p = client::ContiguousRange(opened->regions, at, r.length); p != nullptr) {
      out.bytes.emplace_back(p, r.length);
      crc = Crc32cCombine(crc, Crc32c(out.bytes.back()), r.length);
    } else {
      std::vector<std::byte>& copy = out.copies.emplace_back(r.length);
      crc = Crc32cCombine(crc, client::CopyFromShard(opened->regions, at, copy), r.length);
      out.bytes.emplace_back(copy.data(), copy.size());
    }
    at += r.length;
  }
  // The holder checked its copy against the shard's crc32c and the agent
  // every byte that landed; this checks what is mapped here.
  if (crc != resp.shard().crc32c()) {
    return absl::DataLossError(absl::StrFormat("byte ranges of rank %d's shard of step %d: crc32c 0x%08x, the agent "
                                               "read 0x%08x",
                                               rank, step, crc, resp.shard().crc32c()));
  }
  out.keep = std::move(opened);
  return out;
}

}  // namespace client

}  // namespace ckpt
