// Save path: SaveBuilder (Add, Commit) -> AcquireStagingLease, copy + crc into
// the mapped lease regions, CommitShard (by default on the client's committer,
// after Commit returned); AbortLease on any failure. The steps of a commit
// are listed in client/save_state.h.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/client.h"
#include "client/client_core.h"
#include "client/lazy_save.h"
#include "client/save_state.h"
#include "common/crc32c.h"
#include "common/log.h"
#include "common/global_tensor.h"
#include "common/manifest.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt {

// Limits of ckpt.v1.Item.attributes (common.proto).
constexpr size_t kMaxAttributes = 16;
constexpr size_t kMaxAttributeBytes = 256;

size_t SaveBuilder::item_count() const { return state_ == nullptr ? 0 : state_->items.size(); }

void SaveBuilder::CarryRest() {
  if (state_ != nullptr) state_->carry_rest = true;
}

SaveBuilder Client::BeginSave(uint64_t step) { return SaveBuilder(core_, step); }

absl::Status SaveBuilder::Add(std::string_view name, std::span<const std::byte> bytes, DType dtype,
                              absl::Span<const uint64_t> shape,
                              std::map<std::string, std::string> attributes, ItemChange change) {
  if (state_ == nullptr || state_->spent || state_->core == nullptr) {
    return absl::FailedPreconditionError("SaveBuilder::Add after Commit");
  }
  client::SaveState& s = *state_;
  CKPT_RETURN_IF_ERROR(ValidateItemName(name));
  const int d = static_cast<int>(dtype);
  if (d < 1 || d > kMaxDType) {
    return absl::InvalidArgumentError(
        absl::StrCat("item ", QuoteForMessage(name), ": unknown dtype ", d));
  }
  // Length == element size x product of the shape, exactly (common/manifest.h;
  // free for DTYPE_BYTES): the rule the agent applies at CommitShard.
  CKPT_RETURN_IF_ERROR(CheckItemLength(name, d, std::span<const uint64_t>(shape.data(), shape.size()), bytes.size()));
  if (attributes.size() > kMaxAttributes) {
    return absl::InvalidArgumentError(absl::StrCat("item ", QuoteForMessage(name), " has ",
                                                   attributes.size(),
                                                   " attributes; at most 16 are allowed"));
  }
  for (const auto& [k, v] : attributes) {
    if (k.size() > kMaxAttributeBytes || v.size() > kMaxAttributeBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("item ", QuoteForMessage(name), ": attribute ", QuoteForMessage(k),
                       " has a key or value longer than 256 bytes"));
    }
  }
  if (!attributes.empty()) {  // a slice of a global tensor says so well (common/global_tensor.h)
    CKPT_RETURN_IF_ERROR(
        ParseGlobalPlace(name, d, std::span<const uint64_t>(shape.data(), shape.size()), attributes).status());
  }
  // One hash of the name: the set takes a copy only if it is new.
  const size_t before = s.names->set.size();
  auto it = s.names->set.lazy_emplace(name, [&](const auto& ctor) { ctor(s.names->Keep(name)); });
  if (s.names->set.size() == before) {
    return absl::InvalidArgumentError(
        absl::StrCat("item ", QuoteForMessage(name), " was already added to this save"));
  }
  s.items.push_back(client::SaveItem{*it, bytes, dtype, {shape.begin(), shape.end()}, std::move(attributes), change});
  if (change != ItemChange::kChanged) s.incremental = true;
  return absl::OkStatus();
}

namespace client {
namespace {

// A staging lease request of this client's for `step` (the size and base
// steps to be set), held by the session `session_id` ("" for none).
v1::AcquireStagingLeaseRequest LeaseRequest(const ClientCore& core, uint64_t step, const std::string& session_id) {
  const ClientOptions& o = core.options;
  v1::AcquireStagingLeaseRequest req;
  req.set_job_id(o.job_id);
  req.set_step(step);
  req.set_rank(o.rank);
  req.set_run_id(o.run_id);
  req.set_client_pid(static_cast<uint32_t>(::getpid()));
  req.set_session_id(session_id);
  return req;
}

// Releases a lease after a failure. Returns true if the agent says the lease
// is committed (a commit whose response was lost took effect).
// `session_id`: the session the lease was taken on ("" for none): the agent
// lets only that session release it.
bool AbortLease(ClientCore& core, const std::string& lease_id, const std::string& session_id) {
  v1::AbortLeaseRequest req;
  req.set_lease_id(lease_id);
  req.set_session_id(session_id);
  absl::Status s = core.agent->AbortLease(req, core.options.rpc_timeout);
  if (absl::IsFailedPrecondition(s)) return true;
  if (!s.ok()) {
    // The agent expires the lease on its own (ttl, or our pid gone).
    log::Warn("could not release staging lease {}: {}", lease_id, s.ToString());
  }
  return false;
}

// Sends a filled lease's commit and checks the answer; on success the
// commit becomes the client's base (SavedBase) with `hashes`. Runs on the
// caller's thread or on the client's committer (after Commit returned).
absl::Status SendCommit(ClientCore& core, const std::shared_ptr<const v1::CommitShardRequest>& request,
                        uint32_t shard_crc, uint64_t step, std::shared_ptr<const ItemHashes> hashes) {
  const v1::CommitShardRequest& commit = *request;
  const std::string& lease_id = commit.lease_id();
  const auto committed = [&] {
    absl::MutexLock lock(&core.base_mu);
    core.base = SavedBase{step, request, std::move(hashes)};
    return absl::OkStatus();
  };
  v1::CommitShardResponse resp;
  absl::Status s = core.agent->CommitShard(commit, &resp, core.options.rpc_timeout);
  if (absl::IsAlreadyExists(s)) {
    log::Debug("commit of lease {} was a replay", lease_id);
    return committed();
  }
  if (!s.ok()) {
    if (!AbortLease(core, lease_id, commit.session_id())) return s;
    // The response was lost but the commit took effect: same lease, same
    // manifest, so it is ours.
    log::Info("commit of lease {} failed ({}) but the agent holds it committed", lease_id, s.ToString());
    return committed();
  }
  if (resp.has_shard() && resp.shard().crc32c() != shard_crc) {
    // The agent combined our item crcs with the padding it found: a
    // difference means the padding changed under us or a bug.
    return absl::DataLossError(absl::StrCat(
        "CommitShard: the agent computed shard crc32c ", absl::Hex(resp.shard().crc32c()),
        ", the client ", absl::Hex(shard_crc), " for ", core.options.job_id, "/", step, " rank ",
        core.options.rank));
  }
  return committed();
}

// Where a reference's bytes are: the version that holds them, their offset,
// length and crc there.
struct RefTo {
  uint64_t step = 0;
  uint64_t offset_bytes = 0;
  uint64_t length_bytes = 0;
  uint32_t crc32c = 0;
};

// The base of an incremental save, decoded: its items by name, each with
// where its bytes live and its hash if known.
struct DecodedBase {
  uint64_t step = 0;
  std::vector<ManifestItem> items;
  absl::flat_hash_map<std::string_view, size_t> by_name;  // into items
  std::shared_ptr<const ItemHashes> hashes;

  const ManifestItem* Find(std::string_view name) const {
    auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : &items[it->second];
  }
  RefTo Location(const ManifestItem& it) const {
    return RefTo{it.ref_step.value_or(step), it.offset_bytes, it.length_bytes, it.crc32c};
  }
  std::optional<uint64_t> Hash(std::string_view name) const {
    if (hashes == nullptr) return std::nullopt;
    auto h = hashes->find(absl::string_view(name.data(), name.size()));
    return h == hashes->end() ? std::nullopt : std::optional<uint64_t>(h->second);
  }
};

// The client's base for an incremental save of `step`, decoded, after the
// commits sent so far were answered (the newest one that succeeded is the
// base). Null when there is none, when it is not older than `step`, or when
// this save is to be made in full: a multiple of
// ClientOptions::full_save_every lies in (base step, step], so every rank
// saves the same steps in full and their references point to the same
// versions (`partial` saves never are).
std::unique_ptr<DecodedBase> BaseFor(ClientCore& core, uint64_t step, bool partial) {
  core.WaitCommits();
  std::optional<SavedBase> saved;
  {
    absl::MutexLock lock(&core.base_mu);
    saved = core.base;
  }
  if (!saved || saved->step >= step) return nullptr;
  const uint64_t every = core.options.full_save_every;
  if (!partial && every > 0 && step / every != saved->step / every) return nullptr;
  absl::StatusOr<std::vector<ManifestItem>> items = DecodeManifest(saved->commit->manifest());
  if (!items.ok()) {
    log::Warn("the previous save's manifest does not decode ({}): saving in full", items.status().ToString());
    return nullptr;
  }
  auto base = std::make_unique<DecodedBase>();
  base->step = saved->step;
  base->items = *std::move(items);
  base->hashes = std::move(saved->hashes);
  base->by_name.reserve(base->items.size());
  for (size_t i = 0; i < base->items.size(); ++i) base->by_name.emplace(base->items[i].name, i);
  return base;
}

// What a commit copies and what it refers to (PlanReferences), and where the
// copied items go in the shard (LayOutShard).
struct SavePlan {
  std::unique_ptr<DecodedBase> base;           // null: a full save
  std::vector<std::optional<RefTo>> ref;       // per item: set if it refers to the base's bytes
  std::vector<std::optional<uint64_t>> hash;   // per item: its XXH3-64, where known
  std::vector<const ManifestItem*> carried;    // base items this partial save does not state
  std::vector<uint64_t> lengths;               // of the items copied, in order
  std::vector<uint64_t> base_steps;            // versions the references point into (sorted, unique)
  Layout layout;

  // Recounts `lengths` and `base_steps` from `ref` and `carried`.
  void Count(const std::vector<SaveItem>& items) {
    lengths.clear();
    base_steps.clear();
    for (size_t i = 0; i < items.size(); ++i) {
      if (ref[i]) {
        base_steps.push_back(ref[i]->step);
      } else {
        lengths.push_back(items[i].bytes.size());
      }
    }
    for (const ManifestItem* c : carried) {
      if (c->length_bytes > 0) base_steps.push_back(base->Location(*c).step);
    }
    std::sort(base_steps.begin(), base_steps.end());
    base_steps.erase(std::unique(base_steps.begin(), base_steps.end()), base_steps.end());
  }
};

// Step 1. Incremental saves: which items refer to the base's bytes instead of
// being copied (docs/protocol.md "Incremental saves"). FailedPrecondition for
// a partial save without a base.
absl::StatusOr<SavePlan> PlanReferences(ClientCore& core, const SaveState& s) {
  SavePlan plan;
  plan.ref.resize(s.items.size());
  plan.hash.resize(s.items.size());
  if (s.incremental || s.carry_rest) {
    plan.base = BaseFor(core, s.step, s.carry_rest);
    const DecodedBase* base = plan.base.get();
    if (s.carry_rest && base == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "a partial save (CarryRest) of step ", s.step, " needs a base: an earlier save of this client that "
          "committed; save in full"));
    }
    for (size_t i = 0; i < s.items.size(); ++i) {
      const SaveItem& it = s.items[i];
      if (it.change == ItemChange::kDetect) plan.hash[i] = ContentHash(it.bytes);
      const ManifestItem* b = base == nullptr ? nullptr : base->Find(it.name);
      // (An empty item costs nothing to copy; a container marker must stay
      // among the shard's own items, ahead of its elements.)
      if (b == nullptr || b->length_bytes != it.bytes.size() || it.bytes.empty()) continue;
      if (it.change == ItemChange::kUnchanged) {
        plan.ref[i] = base->Location(*b);
        plan.hash[i] = base->Hash(it.name);
      } else if (it.change == ItemChange::kDetect && base->Hash(it.name) == plan.hash[i]) {
        plan.ref[i] = base->Location(*b);
      }
    }
    if (s.carry_rest) {
      for (const ManifestItem& b : base->items) {
        if (s.names->set.find(b.name) == s.names->set.end()) plan.carried.push_back(&b);
      }
    }
  }
  return plan;
}

// Step 2. The copied items' offsets at `alignment` and the shard's size.
absl::Status LayOutShard(const SaveState& s, uint64_t alignment, SavePlan& plan) {
  plan.Count(s.items);
  CKPT_ASSIGN_OR_RETURN(plan.layout, LayOut(plan.lengths, alignment));
  return absl::OkStatus();
}

// The lease a save copies into: the agent's grant and the session it was
// taken on ("" for none), which its commit or abort names.
struct HeldLease {
  v1::AcquireStagingLeaseResponse grant;
  std::string session_id;
};

// Step 3. The lease asked for at BeginSave (`early`), if its session is still
// open and the shard fits it (laid out with the same alignment, no
// references, and at least half of it used); released otherwise, before the
// lease AcquireLease takes replaces it (one whose session closed went with
// it). Waits for its answer.
std::optional<HeldLease> TakeEarlyLease(ClientCore& core, const SaveState& s, std::shared_ptr<EarlyLease> early,
                                        const SavePlan& plan) {
  if (early == nullptr) return std::nullopt;
  const ClientOptions& o = core.options;
  early->done.WaitForNotification();
  if (early->answer.ok() && early->session->Closed()) {
    log::Info("{}/{} rank {}: the session of the lease asked for at BeginSave closed; asking again", o.job_id,
              s.step, o.rank);
  } else if (early->answer.ok()) {
    const v1::AcquireStagingLeaseResponse& e = *early->answer;
    const uint64_t align = e.item_alignment_bytes();
    if (plan.base_steps.empty() && !e.pull() && plan.layout.size <= early->size_bytes &&
        plan.layout.size >= early->size_bytes / 2 && early->alignment == core.item_alignment.load() &&
        (align == 0 || align == early->alignment)) {
      return HeldLease{*std::move(early->answer), early->session->id()};
    }
    AbortLease(core, e.lease_id(), early->session->id());
  }
  return std::nullopt;
}

// One AcquireStagingLease: on the session's connection (no gRPC round trip)
// when it serves requests, else (or when the agent says Unavailable there:
// it would have to ask meta) over gRPC.
absl::StatusOr<v1::AcquireStagingLeaseResponse> AskForLease(ClientCore& core, AgentSession* session,
                                                            const v1::AcquireStagingLeaseRequest& req) {
  const ClientOptions& o = core.options;
  v1::AcquireStagingLeaseResponse resp;
  absl::Status s = absl::UnavailableError("not asked on the session");
  if (session != nullptr && session->serves_requests()) {
    absl::StatusOr<std::string> reply = session->Request("LEASE", req.SerializeAsString(), o.rpc_timeout);
    s = reply.status();
    if (reply.ok() && !resp.ParseFromString(*reply)) s = absl::InternalError("lease (session): unparsable answer");
    if (!s.ok() && !absl::IsUnavailable(s)) s = Annotate(s, "AcquireStagingLease (session)");
  }
  if (absl::IsUnavailable(s)) s = core.agent->AcquireStagingLease(req, &resp, o.rpc_timeout);
  if (!s.ok()) return s;
  return resp;
}

// Step 4. A staging lease for the shard `plan` lays out, on `session` (null:
// none). Asks at most twice: once more if the agent asks for a coarser
// alignment than the shard was laid out with and the shard, laid out again,
// no longer fits (the second lease replaces the first). A save whose base
// the agent no longer holds (evicted, restarted, another node) is planned
// again in full. On error no lease is held.
absl::StatusOr<HeldLease> AcquireLease(ClientCore& core, const SaveState& s, AgentSession* session,
                                       SavePlan& plan) {
  const ClientOptions& o = core.options;
  v1::AcquireStagingLeaseRequest req =
      LeaseRequest(core, s.step, session == nullptr ? std::string() : session->id());
  std::string replaced_lease;  // a first lease the second one replaces
  v1::AcquireStagingLeaseResponse lease;
  for (int attempt = 0;; ++attempt) {
    req.set_size_bytes(plan.layout.size);
    *req.mutable_base_steps() = {plan.base_steps.begin(), plan.base_steps.end()};
    absl::StatusOr<v1::AcquireStagingLeaseResponse> resp = AskForLease(core, session, req);
    absl::Status st = resp.status();
    if (!st.ok() && absl::IsFailedPrecondition(st) && !plan.base_steps.empty() && plan.carried.empty() &&
        absl::StrContains(st.message(), "base version")) {
      log::Info("{}/{} rank {}: {}; saving in full", o.job_id, s.step, o.rank, std::string(st.message()));
      std::fill(plan.ref.begin(), plan.ref.end(), std::nullopt);
      st = LayOutShard(s, core.item_alignment.load(), plan);
      if (st.ok()) {
        --attempt;
        continue;
      }
    }
    if (!st.ok()) {
      if (!replaced_lease.empty()) AbortLease(core, replaced_lease, req.session_id());
      return st;
    }
    lease = *std::move(resp);
    const uint64_t align = lease.item_alignment_bytes();
    if (align == 0 || align == core.item_alignment.load() || attempt > 0 || (align & (align - 1)) != 0) {
      break;
    }
    core.item_alignment.store(align);
    absl::StatusOr<Layout> relaid = LayOut(plan.lengths, align);
    if (!relaid.ok()) {
      AbortLease(core, lease.lease_id(), req.session_id());
      return relaid.status();
    }
    plan.layout = *std::move(relaid);
    // Fits the lease: commit a smaller size. Larger: the next lease for this
    // (job, step, rank) replaces (aborts) the open one.
    if (plan.layout.size <= req.size_bytes()) break;
    replaced_lease = lease.lease_id();
  }
  return HeldLease{std::move(lease), req.session_id()};
}

// A lease made ready for the copy: its regions in this process.
struct StagedLease {
  std::vector<ShardRegion> regions;
  // The mappings of the regions, held while the items are copied.
  std::vector<std::shared_ptr<MappedFile>> keep;
  // A pull-mode agent (a DPU's) reads the shard out of staging memory of
  // ours during the commit, which holds the buffer until it is answered.
  std::shared_ptr<PullStaging::Buffer> staging;
};

// Step 5. The lease's regions, mapped read-write; for a pull-mode lease a
// staging buffer of ours, starting with the lease's token (which proves to
// the agent that the memory is ours for this lease), then the shard. Errors
// name the lease; the caller still holds it.
absl::StatusOr<StagedLease> StageLease(ClientCore& core, const HeldLease& held, uint64_t size) {
  const v1::AcquireStagingLeaseResponse& lease = held.grant;
  StagedLease staged;
  absl::StatusOr<std::vector<ShardRegion>> regions;
  if (lease.pull()) {
    absl::StatusOr<std::shared_ptr<PullStaging::Buffer>> buffer = StagingBuffer(core, kPullHeaderBytes + size);
    if (buffer.ok() && lease.pull_token().size() > kPullHeaderBytes) {
      buffer = absl::InternalError("the agent's pull token is longer than the staging header");
    }
    if (buffer.ok()) {
      staged.staging = *std::move(buffer);
      std::memset(staged.staging->data(), 0, kPullHeaderBytes);
      std::memcpy(staged.staging->data(), lease.pull_token().data(), lease.pull_token().size());
      regions = std::vector<ShardRegion>{ShardRegion{staged.staging->data() + kPullHeaderBytes, size, 0}};
    } else {
      regions = buffer.status();
    }
  } else {
    regions = MapRegions(core, lease.regions(), size, MappedFile::Access::kReadWrite, &staged.keep);
  }
  if (!regions.ok()) return Annotate(regions.status(), absl::StrCat("staging lease ", lease.lease_id()));
  staged.regions = *std::move(regions);
  return staged;
}

// What CopyItems made of the shard.
struct CopiedShard {
  uint32_t crc = 0;      // of the whole shard, padding included
  bool any_ref = false;  // some item (or carried item with bytes) is a reference
};

// Step 6a. Copies the items that are not references into `regions` at the
// layout's offsets, with their crcs, zeroes the padding, and adds the copied
// items (and the carried empty ones, first) to `manifest`. `progress`, if
// not null (a lazy save), hears of every item copied, and the copy runs on
// one thread in order; otherwise many items are copied ahead on several
// threads. Cannot fail.
CopiedShard CopyItems(const SaveState& s, const SavePlan& plan, std::span<const ShardRegion> regions,
                      LazyState* progress, ManifestEncoder& manifest) {
  const Layout& layout = plan.layout;
  // Carried empty items (container markers) are the shard's own, first, so
  // that a container comes before the elements this save states.
  for (const ManifestItem* c : plan.carried) {
    if (c->length_bytes == 0) manifest.Add(c->name, c->dtype, c->shape, 0, 0, c->crc32c, c->attributes);
  }
  CopiedShard out;
  uint64_t pos = 0;   // end of the bytes accounted for in out.crc
  size_t copied = 0;  // items copied so far (index into layout.offsets)
  std::vector<CopiedItem> ahead;
  if (progress == nullptr) {
    std::vector<ItemCopy> copies;
    copies.reserve(layout.offsets.size());
    for (size_t i = 0; i < s.items.size(); ++i) {
      if (!plan.ref[i]) copies.push_back(ItemCopy{s.items[i].bytes, layout.offsets[copies.size()]});
    }
    ahead = CopyItemsToShard(regions, copies);
  }
  out.any_ref =
      std::any_of(plan.carried.begin(), plan.carried.end(), [](const ManifestItem* c) { return c->length_bytes > 0; });
  for (size_t i = 0; i < s.items.size(); ++i) {
    const SaveItem& it = s.items[i];
    if (plan.ref[i]) {
      out.any_ref = true;
      if (progress != nullptr) progress->MarkCopied(i + 1);
      continue;
    }
    const size_t slot = copied++;
    const uint64_t off = layout.offsets[slot];
    if (off > pos) {
      const uint32_t gap_crc = ahead.empty() ? ZeroShard(regions, pos, off - pos) : ahead[slot].gap_crc;
      out.crc = Crc32cCombine(out.crc, gap_crc, off - pos);
    }
    // A lazy save (progress set) copies beside the training step: one thread.
    const uint32_t crc =
        !ahead.empty() ? ahead[slot].crc
                       : CopyToShard(regions, off, it.bytes, 0,
                                     progress != nullptr ? CopyThreads::kOne : CopyThreads::kAll);
    out.crc = Crc32cCombine(out.crc, crc, it.bytes.size());
    pos = off + it.bytes.size();

    manifest.Add(it.name, static_cast<int>(it.dtype), it.shape, off, it.bytes.size(), crc, it.attributes);
    if (progress != nullptr) progress->MarkCopied(i + 1);  // the caller may change item i now
  }
  if (progress != nullptr && s.items.empty()) progress->MarkCopied(0);
  if (layout.size > pos) {
    out.crc = Crc32cCombine(out.crc, ZeroShard(regions, pos, layout.size - pos), layout.size - pos);
  }
  return out;
}

// Step 6b. Adds the references to `manifest`, in canonical order
// ((ref_step, offset)), and returns the hashes the next save compares
// against (null if none).
std::shared_ptr<ItemHashes> AddReferences(const SaveState& s, const SavePlan& plan, bool any_ref,
                                          ManifestEncoder& manifest) {
  if (!any_ref && std::none_of(plan.hash.begin(), plan.hash.end(), [](const auto& h) { return h.has_value(); })) {
    return nullptr;
  }
  struct Ref {
    RefTo to;
    std::string_view name;
    int dtype;
    std::span<const uint64_t> shape;
    const std::map<std::string, std::string>* attributes;
  };
  std::vector<Ref> refs;
  auto hashes = std::make_shared<ItemHashes>();
  hashes->reserve(s.items.size() + plan.carried.size());
  for (size_t i = 0; i < s.items.size(); ++i) {
    const SaveItem& it = s.items[i];
    if (plan.hash[i]) hashes->emplace(std::string(it.name), *plan.hash[i]);
    if (plan.ref[i]) refs.push_back(Ref{*plan.ref[i], it.name, static_cast<int>(it.dtype), it.shape, &it.attributes});
  }
  for (const ManifestItem* c : plan.carried) {
    if (c->length_bytes == 0) continue;  // added by CopyItems
    refs.push_back(Ref{plan.base->Location(*c), c->name, c->dtype, c->shape, &c->attributes});
    if (std::optional<uint64_t> h = plan.base->Hash(c->name)) hashes->emplace(c->name, *h);
  }
  std::stable_sort(refs.begin(), refs.end(), [](const Ref& a, const Ref& b) {
    return a.to.step != b.to.step ? a.to.step < b.to.step : a.to.offset_bytes < b.to.offset_bytes;
  });
  for (const Ref& r : refs) {
    manifest.AddRef(r.to.step, r.name, r.dtype, r.shape, r.to.offset_bytes, r.to.length_bytes, r.to.crc32c,
                    *r.attributes);
  }
  if (hashes->empty()) hashes.reset();
  return hashes;
}

// The packed manifest's expected size (a hint for its buffer).
size_t ManifestBytes(const SaveState& s) {
  size_t bytes = 32;
  for (const SaveItem& it : s.items) {
    bytes += 48 + it.name.size() + 8 * it.shape.size();
    for (const auto& [k, v] : it.attributes) bytes += 8 + k.size() + v.size();
  }
  return bytes;
}

// Step 6c. The CommitShard request of a filled lease. The manifest goes
// packed (docs/protocol.md "Manifest digest"): one string for the whole
// shard instead of a message per item.
v1::CommitShardRequest CommitRequest(const HeldLease& lease, const StagedLease& staged, uint64_t size,
                                     std::string manifest) {
  v1::CommitShardRequest commit;
  commit.set_lease_id(lease.grant.lease_id());
  commit.set_session_id(lease.session_id);
  commit.set_size_bytes(size);
  commit.set_manifest(std::move(manifest));
  if (staged.staging != nullptr) {
    v1::PullSource* from = commit.mutable_pull_source();
    from->set_worker_address(staged.staging->worker_address());
    from->set_rkey(staged.staging->rkey());
    from->set_address(reinterpret_cast<uint64_t>(staged.staging->data()));
    from->set_length_bytes(staged.staging->length());
  }
  return commit;
}

// Notes that this client committed `step` at `at` (ClientCore::GraceEnd).
void RememberCommitted(ClientCore& core, uint64_t step, absl::Time at) {
  absl::MutexLock lock(&core.committed_mu);
  core.committed_at[step] = at;
  // Only recent steps matter; keep the map small.
  while (core.committed_at.size() > 64) core.committed_at.erase(core.committed_at.begin());
}

// Asks for the lease on the client's session (only there: without one, or
// when the agent would have to ask meta, Commit asks as before).
void AskEarly(ClientCore& core, uint64_t step, EarlyLease& early, bool begin_at_commit) {
  absl::StatusOr<std::shared_ptr<AgentSession>> session = OpenSession(core);
  if (!session.ok() || *session == nullptr || !(*session)->serves_requests()) {
    early.answer = absl::UnavailableError("no session that serves requests");
    return;
  }
  early.session = *session;
  v1::AcquireStagingLeaseRequest req = LeaseRequest(core, step, (*session)->id());
  req.set_size_bytes(early.size_bytes);
  req.set_begin_at_commit(begin_at_commit);
  absl::StatusOr<std::string> reply =
      (*session)->Request("LEASE", req.SerializeAsString(), core.options.rpc_timeout);
  if (!reply.ok()) {
    early.answer = reply.status();
    return;
  }
  v1::AcquireStagingLeaseResponse resp;
  if (!resp.ParseFromString(*reply)) {
    early.answer = absl::InternalError("lease (session): unparsable answer");
    return;
  }
  early.answer = std::move(resp);
}

// A lease asked for and not committed into: released once answered, in the
// background (on the caller's thread if the executor is full).
void ReleaseInBackground(ClientCore& core, std::shared_ptr<EarlyLease> early) {
  // Not in a fork()ed child: the executor and the session are the parent's.
  if (!core.CheckProcess().ok()) return;
  auto release = [&core, early] {
    early->done.WaitForNotification();
    if (early->answer.ok() && !early->session->Closed()) {
      AbortLease(core, early->answer->lease_id(), early->session->id());
    }
  };
  if (!core.calls.TrySubmit(release)) release();
}

// After a save that copied every item committed at `step` (the builder
// `begun_seq`): with ClientOptions::lease_ahead, an earlier such save at
// P < step, and no builder begun since (it asked for its own lease, which a
// second one for the same step would replace), asks for the lease of
// step + (step - P) (the version begun at meta only by its commit). A lease
// asked for earlier for another step is released (one for a step at or below
// `step` can never be used: steps increase).
void LeaseAhead(ClientCore& core, uint64_t step, uint64_t begun_seq) {
  const uint64_t size = core.last_full_save_bytes.load(std::memory_order_relaxed);
  std::shared_ptr<EarlyLease> replaced;
  std::shared_ptr<EarlyLease> early;
  uint64_t next = 0;
  {
    absl::MutexLock lock(&core.ahead_mu);
    if (size == 0) {
      core.full_steps = {};
    } else if (core.full_steps[1] != step) {
      core.full_steps = {core.full_steps[1], step};
    }
    const std::optional<uint64_t> prev = core.full_steps[0];
    const bool guess = core.options.lease_ahead && size > 0 && core.saves_begun == begun_seq && prev &&
                       *prev < step && step - *prev <= kMaxStep - step;
    if (guess) next = step + (step - *prev);
    if (core.ahead != nullptr && core.ahead_step <= step) replaced = std::move(core.ahead);
    if (guess && ValidateStep(next).ok() && !(core.ahead != nullptr && core.ahead_step == next)) {
      if (replaced == nullptr) replaced = std::move(core.ahead);
      early = std::make_shared<EarlyLease>();
      early->size_bytes = size;
      early->alignment = core.item_alignment.load();
      core.ahead = early;
      core.ahead_step = next;
    }
  }
  if (replaced != nullptr) ReleaseInBackground(core, std::move(replaced));
  if (early == nullptr) return;
  const bool sent = core.calls.TrySubmit([&core, next, early] {
    AskEarly(core, next, *early, /*begin_at_commit=*/true);
    early->done.Notify();
  });
  if (!sent) {
    early->answer = absl::UnavailableError("the client's executor is full");
    early->done.Notify();
  }
}

// The builder's bookkeeping (a name, shape and attributes per item), freed
// by the committer after Commit returned when it sends in the background.
struct SpentItems {
  std::vector<SaveItem> items;
  std::unique_ptr<SaveNames> names;
};

// Step 7 (background). Queues the commit on the client's committer and
// returns its result, answered later. The trainer goes on; the committer
// sends the manifest. Its queue is bounded: when it is full the commit is
// sent here (as without background), so a stalled agent cannot pile up
// commits. `staging` and `spent` are held until the agent answered.
std::shared_ptr<CommitResult> SendInBackground(ClientCore& core, std::shared_ptr<const v1::CommitShardRequest> request,
                                               uint32_t shard_crc, uint64_t step,
                                               std::shared_ptr<const ItemHashes> hashes,
                                               std::shared_ptr<PullStaging::Buffer> staging,
                                               std::shared_ptr<SpentItems> spent, bool lazy, uint64_t begun_seq) {
  auto result = std::make_shared<CommitResult>();
  auto send = [&core, request = std::move(request), result, shard_crc, step, hashes = std::move(hashes),
               staging = std::move(staging), spent = std::move(spent), lazy, begun_seq]() mutable {
    result->status = SendCommit(core, request, shard_crc, step, std::move(hashes));
    if (result->status.ok() && !lazy) LeaseAhead(core, step, begun_seq);
    spent.reset();
    staging.reset();  // the agent has read it (or the lease is gone)
    if (!result->status.ok()) {
      log::Warn("commit of {}/{} rank {} failed: {}", core.options.job_id, step, core.options.rank,
                result->status.ToString());
    }
    result->done.Notify();
  };
  {
    absl::MutexLock lock(&core.commit_mu);
    core.last_commit = result;
  }
  if (!core.committer.TrySubmit(send)) send();
  return result;
}

}  // namespace

void DropLeaseAhead(ClientCore& core) {
  std::shared_ptr<EarlyLease> ahead;
  {
    absl::MutexLock lock(&core.ahead_mu);
    ahead = std::move(core.ahead);
  }
  // Not waited for if still unanswered (the executor that asks may be the
  // one going): the session's end releases that lease then.
  if (ahead == nullptr || !ahead->done.HasBeenNotified()) return;
  if (ahead->answer.ok() && !ahead->session->Closed()) {
    AbortLease(core, ahead->answer->lease_id(), ahead->session->id());
  }
}

}  // namespace client

SaveBuilder::SaveBuilder(std::shared_ptr<client::ClientCore> core, uint64_t step)
    : state_(std::make_unique<client::SaveState>()) {
  client::SaveState& s = *state_;
  s.core = std::move(core);
  s.step = step;
  client::ClientCore& c = *s.core;
  const size_t expect = c.last_save_items.load(std::memory_order_relaxed);
  s.items.reserve(expect);
  s.names->set.reserve(expect);
  const uint64_t size = c.last_full_save_bytes.load(std::memory_order_relaxed);
  // A fork()ed child touches none of the client's mutexes: one may have been
  // held by a parent's thread at fork() and would stay locked here forever.
  // Its Commit is refused (CheckProcess).
  if (!c.CheckProcess().ok()) return;
  // The lease asked for ahead of this save, if it guessed this step.
  std::shared_ptr<client::EarlyLease> ahead;
  {
    absl::MutexLock lock(&c.ahead_mu);
    s.begun_seq = ++c.saves_begun;
    if (c.ahead != nullptr && c.ahead_step == step) ahead = std::move(c.ahead);
  }
  if (size == 0 || !ValidateStep(step).ok()) {
    if (ahead != nullptr) client::ReleaseInBackground(c, std::move(ahead));
    return;
  }
  if (ahead != nullptr) {
    s.early = std::move(ahead);
    return;
  }
  auto early = std::make_shared<client::EarlyLease>();
  early->size_bytes = size;
  early->alignment = c.item_alignment.load();
  const bool sent = c.calls.TrySubmit([&c, step, early] {
    client::AskEarly(c, step, *early, /*begin_at_commit=*/false);
    early->done.Notify();
  });
  if (sent) s.early = std::move(early);
}
SaveBuilder::SaveBuilder(SaveBuilder&&) noexcept = default;
SaveBuilder& SaveBuilder::operator=(SaveBuilder&& other) noexcept {
  if (this != &other) {
    ReleaseEarlyLease();
    state_ = std::move(other.state_);
  }
  return *this;
}
SaveBuilder::~SaveBuilder() { ReleaseEarlyLease(); }

// A lease asked for at BeginSave and not committed into: released in the
// background once answered (on the caller's thread if the executor is full).
void SaveBuilder::ReleaseEarlyLease() {
  if (state_ == nullptr) return;
  std::shared_ptr<client::EarlyLease> early = std::move(state_->early);
  if (early == nullptr || state_->core == nullptr) return;
  client::ReleaseInBackground(*state_->core, std::move(early));
}

absl::StatusOr<SaveHandle> SaveBuilder::Commit() {
  if (state_ == nullptr || state_->spent || state_->core == nullptr) {
    return absl::FailedPreconditionError("SaveBuilder::Commit called twice");
  }
  CKPT_RETURN_IF_ERROR(state_->core->CheckProcess());
  state_->spent = true;
  const absl::Time start = absl::Now();
  std::shared_ptr<client::ClientCore> core = state_->core;
  const uint64_t step = state_->step;
  absl::StatusOr<SaveHandle> h = CommitItems(nullptr, core->options.commit_in_background);
  if (h.ok()) core->AddSaveCost(step, absl::Now() - start);
  return h;
}

absl::StatusOr<SaveHandle> SaveBuilder::CommitItems(client::LazyState* progress, bool background) {
  client::SaveState& s = *state_;
  client::ClientCore& core = *s.core;
  CKPT_RETURN_IF_ERROR(ValidateStep(s.step));
  // This client's lazy saves begun before this one: their commits go first.
  const std::vector<std::weak_ptr<client::LazyState>> earlier =
      progress != nullptr ? progress->before : core.RunningLazySaves();

  CKPT_ASSIGN_OR_RETURN(client::SavePlan plan, client::PlanReferences(core, s));
  CKPT_RETURN_IF_ERROR(client::LayOutShard(s, core.item_alignment.load(), plan));

  // The lease lives as long as this client's session with the agent.
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<client::AgentSession> session, client::OpenSession(core));
  std::optional<client::HeldLease> early = client::TakeEarlyLease(core, s, std::move(s.early), plan);
  absl::StatusOr<client::HeldLease> acquired =
      early.has_value() ? absl::StatusOr<client::HeldLease>(*std::move(early))
                        : client::AcquireLease(core, s, session.get(), plan);
  if (!acquired.ok()) return acquired.status();
  const client::HeldLease& lease = *acquired;
  // Every return from here until the commit is handed over releases the lease.
  absl::Cleanup release = [&core, &lease] {
    client::AbortLease(core, lease.grant.lease_id(), lease.session_id);
  };

  CKPT_ASSIGN_OR_RETURN(client::StagedLease staged, client::StageLease(core, lease, plan.layout.size));
  ManifestEncoder manifest(client::ManifestBytes(s));
  const client::CopiedShard copied = client::CopyItems(s, plan, staged.regions, progress, manifest);
  staged.keep.clear();  // the agent owns the bytes now; the cache keeps its mappings
  std::shared_ptr<client::ItemHashes> hashes = client::AddReferences(s, plan, copied.any_ref, manifest);
  auto request = std::make_shared<const v1::CommitShardRequest>(
      client::CommitRequest(lease, staged, plan.layout.size, manifest.Finish()));
  // From here the commit owns the lease: SendCommit releases it on failure.
  std::move(release).Cancel();

  const uint64_t size = plan.layout.size;
  core.last_save_items.store(s.items.size(), std::memory_order_relaxed);
  core.last_full_save_bytes.store(plan.base_steps.empty() && !lease.grant.pull() ? size : 0,
                                  std::memory_order_relaxed);
  // The builder's bookkeeping is freed by the committer, after Commit
  // returned, when it sends in the background; here otherwise.
  auto spent = std::make_shared<client::SpentItems>(client::SpentItems{std::move(s.items), std::move(s.names)});
  s.items.clear();
  s.names = std::make_unique<client::SaveNames>();
  plan = {};  // `carried` pointed into its base
  // On this thread, not the committer's: a lazy save may itself wait for
  // the commits queued before it (its base), never for this one.
  client::AwaitEarlierCommits(earlier);
  if (!background) {
    spent.reset();
    CKPT_RETURN_IF_ERROR(client::SendCommit(core, request, copied.crc, s.step, std::move(hashes)));
    if (progress == nullptr) client::LeaseAhead(core, s.step, s.begun_seq);
    const absl::Time now = absl::Now();
    client::RememberCommitted(core, s.step, now);
    return SaveHandle(s.core, s.step, size, copied.crc, now);
  }
  const absl::Time now = absl::Now();
  client::RememberCommitted(core, s.step, now);
  std::shared_ptr<client::CommitResult> result =
      client::SendInBackground(core, std::move(request), copied.crc, s.step, std::move(hashes),
                               std::move(staged.staging), std::move(spent), progress != nullptr, s.begun_seq);
  return SaveHandle(s.core, s.step, size, copied.crc, now, std::move(result));
}

}  // namespace ckpt
