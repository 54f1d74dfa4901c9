// Save path: SaveBuilder (Add, Commit) -> AcquireStagingLease, copy + crc into
// the mapped lease regions, CommitShard (by default on the client's committer,
// after Commit returned); AbortLease on any failure.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/client.h"
#include "client/client_core.h"
#include "client/lazy_save.h"
#include "common/crc32c.h"
#include "common/log.h"
#include "common/manifest.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt {

// Limits of ckpt.v1.Item.attributes (common.proto).
constexpr size_t kMaxAttributes = 16;
constexpr size_t kMaxAttributeBytes = 256;

struct SaveBuilder::Item {
  std::string_view name;  // in names_ (stable)
  std::span<const std::byte> bytes;
  DType dtype;
  absl::InlinedVector<uint64_t, 4> shape;
  std::map<std::string, std::string> attributes;
  ItemChange change;
};

// The names added so far: their bytes in blocks that never move (no
// allocation per name), and a set of views of them for the duplicate check.
struct SaveBuilder::Names {
  static constexpr size_t kBlockBytes = 64 << 10;
  std::vector<std::unique_ptr<char[]>> blocks;
  size_t used = 0;      // bytes of the last block taken
  size_t capacity = 0;  // of the last block
  absl::flat_hash_set<std::string_view> set;

  // A copy of `name` that lives as long as this.
  std::string_view Keep(std::string_view name) {
    if (capacity - used < name.size()) {
      capacity = std::max(kBlockBytes, name.size());
      blocks.push_back(std::make_unique_for_overwrite<char[]>(capacity));
      used = 0;
    }
    char* at = blocks.back().get() + used;
    std::memcpy(at, name.data(), name.size());
    used += name.size();
    return {at, name.size()};
  }
};

size_t SaveBuilder::item_count() const { return items_.size(); }

SaveBuilder Client::BeginSave(uint64_t step) { return SaveBuilder(core_, step); }

absl::Status SaveBuilder::Add(std::string_view name, std::span<const std::byte> bytes, DType dtype,
                              absl::Span<const uint64_t> shape,
                              std::map<std::string, std::string> attributes, ItemChange change) {
  if (spent_ || core_ == nullptr) {
    return absl::FailedPreconditionError("SaveBuilder::Add after Commit");
  }
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
  // One hash of the name: the set takes a copy only if it is new.
  const size_t before = names_->set.size();
  auto it = names_->set.lazy_emplace(name, [&](const auto& ctor) { ctor(names_->Keep(name)); });
  if (names_->set.size() == before) {
    return absl::InvalidArgumentError(
        absl::StrCat("item ", QuoteForMessage(name), " was already added to this save"));
  }
  items_.push_back(Item{*it, bytes, dtype, {shape.begin(), shape.end()}, std::move(attributes), change});
  if (change != ItemChange::kChanged) incremental_ = true;
  return absl::OkStatus();
}

namespace {

using client::ClientCore;
using client::FromGrpc;
namespace v1 = ::ckpt::v1;

// Releases a lease after a failure. Returns true if the agent says the lease
// is committed (a commit whose response was lost took effect).
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

// `session_id`: the session the lease was taken on ("" for none): the agent
// lets only that session release it.
bool AbortLease(ClientCore& core, const std::string& lease_id, const std::string& session_id) {
  v1::AbortLeaseRequest req;
  req.set_lease_id(lease_id);
  req.set_session_id(session_id);
  v1::AbortLeaseResponse resp;
  auto ctx = client::ContextWithTimeout(core.options.rpc_timeout);
  absl::Status s = FromGrpc(core.agent->AbortLease(ctx.get(), req, &resp), "AbortLease");
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
                        uint32_t shard_crc, uint64_t step,
                        std::shared_ptr<const client::ItemHashes> hashes) {
  const v1::CommitShardRequest& commit = *request;
  const std::string& lease_id = commit.lease_id();
  const auto committed = [&] {
    absl::MutexLock lock(&core.base_mu);
    core.base = client::SavedBase{step, request, std::move(hashes)};
    return absl::OkStatus();
  };
  v1::CommitShardResponse resp;
  auto ctx = client::ContextWithTimeout(core.options.rpc_timeout);
  absl::Status s = FromGrpc(core.agent->CommitShard(ctx.get(), commit, &resp), "CommitShard");
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
  std::shared_ptr<const client::ItemHashes> hashes;

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
  std::optional<client::SavedBase> saved;
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

}  // namespace

namespace client {

// A staging lease asked for on the session when a save began, of the size of
// the client's previous full save; `answer` is set, then `done` notified.
struct EarlyLease {
  uint64_t size_bytes = 0;
  uint64_t alignment = 0;  // the item alignment the size was laid out with
  absl::StatusOr<v1::AcquireStagingLeaseResponse> answer = absl::UnknownError("not answered");
  // The session that holds the lease: once it is closed (the agent stopped
  // or restarted since), the lease is gone and its regions may be another's.
  std::shared_ptr<AgentSession> session;
  absl::Notification done;
};

namespace {

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
    : core_(std::move(core)), step_(step), names_(std::make_unique<Names>()) {
  const size_t expect = core_->last_save_items.load(std::memory_order_relaxed);
  items_.reserve(expect);
  names_->set.reserve(expect);
  const uint64_t size = core_->last_full_save_bytes.load(std::memory_order_relaxed);
  // The lease asked for ahead of this save, if it guessed this step.
  std::shared_ptr<client::EarlyLease> ahead;
  {
    absl::MutexLock lock(&core_->ahead_mu);
    begun_seq_ = ++core_->saves_begun;
    if (core_->ahead != nullptr && core_->ahead_step == step) ahead = std::move(core_->ahead);
  }
  if (size == 0 || !ValidateStep(step).ok() || !core_->CheckProcess().ok()) {
    if (ahead != nullptr) client::ReleaseInBackground(*core_, std::move(ahead));
    return;
  }
  if (ahead != nullptr) {
    early_ = std::move(ahead);
    return;
  }
  auto early = std::make_shared<client::EarlyLease>();
  early->size_bytes = size;
  early->alignment = core_->item_alignment.load();
  client::ClientCore& c = *core_;
  const bool sent = c.calls.TrySubmit([&c, step, early] {
    client::AskEarly(c, step, *early, /*begin_at_commit=*/false);
    early->done.Notify();
  });
  if (sent) early_ = std::move(early);
}
SaveBuilder::SaveBuilder(SaveBuilder&&) noexcept = default;
SaveBuilder& SaveBuilder::operator=(SaveBuilder&& other) noexcept {
  if (this != &other) {
    ReleaseEarlyLease();
    core_ = std::move(other.core_);
    step_ = other.step_;
    spent_ = other.spent_;
    carry_rest_ = other.carry_rest_;
    incremental_ = other.incremental_;
    items_ = std::move(other.items_);
    names_ = std::move(other.names_);
    early_ = std::move(other.early_);
    begun_seq_ = other.begun_seq_;
  }
  return *this;
}
SaveBuilder::~SaveBuilder() { ReleaseEarlyLease(); }

// A lease asked for at BeginSave and not committed into: released in the
// background once answered (on the caller's thread if the executor is full).
void SaveBuilder::ReleaseEarlyLease() {
  std::shared_ptr<client::EarlyLease> early = std::move(early_);
  if (early == nullptr || core_ == nullptr) return;
  client::ReleaseInBackground(*core_, std::move(early));
}

absl::StatusOr<SaveHandle> SaveBuilder::Commit() {
  if (spent_ || core_ == nullptr) {
    return absl::FailedPreconditionError("SaveBuilder::Commit called twice");
  }
  CKPT_RETURN_IF_ERROR(core_->CheckProcess());
  spent_ = true;
  const absl::Time start = absl::Now();
  std::shared_ptr<ClientCore> core = core_;  // CommitItems may leave the builder empty
  const uint64_t step = step_;
  absl::StatusOr<SaveHandle> h = CommitItems(nullptr, core->options.commit_in_background);
  if (h.ok()) core->AddSaveCost(step, absl::Now() - start);
  return h;
}

absl::StatusOr<SaveHandle> SaveBuilder::CommitItems(client::LazyState* progress, bool background) {
  ClientCore& core = *core_;
  const ClientOptions& o = core.options;
  CKPT_RETURN_IF_ERROR(ValidateStep(step_));
  // This client's lazy saves begun before this one: their commits go first.
  const std::vector<std::weak_ptr<client::LazyState>> earlier =
      progress != nullptr ? progress->before : core.RunningLazySaves();

  // Incremental saves: which items refer to the base's bytes instead of
  // being copied (docs/protocol.md "Incremental saves").
  std::unique_ptr<DecodedBase> base;
  std::vector<std::optional<RefTo>> ref(items_.size());
  std::vector<std::optional<uint64_t>> hash(items_.size());
  std::vector<const ManifestItem*> carried;  // base items this partial save does not state
  if (incremental_ || carry_rest_) {
    base = BaseFor(core, step_, carry_rest_);
    if (carry_rest_ && base == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "a partial save (CarryRest) of step ", step_, " needs a base: an earlier save of this client that "
          "committed; save in full"));
    }
    for (size_t i = 0; i < items_.size(); ++i) {
      const Item& it = items_[i];
      if (it.change == ItemChange::kDetect) hash[i] = ContentHash(it.bytes);
      const ManifestItem* b = base == nullptr ? nullptr : base->Find(it.name);
      // (An empty item costs nothing to copy; a container marker must stay
      // among the shard's own items, ahead of its elements.)
      if (b == nullptr || b->length_bytes != it.bytes.size() || it.bytes.empty()) continue;
      if (it.change == ItemChange::kUnchanged) {
        ref[i] = base->Location(*b);
        hash[i] = base->Hash(it.name);
      } else if (it.change == ItemChange::kDetect && base->Hash(it.name) == hash[i]) {
        ref[i] = base->Location(*b);
      }
    }
    if (carry_rest_) {
      for (const ManifestItem& b : base->items) {
        if (names_->set.find(b.name) == names_->set.end()) carried.push_back(&b);
      }
    }
  }

  std::vector<uint64_t> lengths;
  std::vector<uint64_t> base_steps;
  const auto plan = [&] {
    lengths.clear();
    base_steps.clear();
    for (size_t i = 0; i < items_.size(); ++i) {
      if (ref[i]) {
        base_steps.push_back(ref[i]->step);
      } else {
        lengths.push_back(items_[i].bytes.size());
      }
    }
    for (const ManifestItem* c : carried) {
      if (c->length_bytes > 0) base_steps.push_back(base->Location(*c).step);
    }
    std::sort(base_steps.begin(), base_steps.end());
    base_steps.erase(std::unique(base_steps.begin(), base_steps.end()), base_steps.end());
  };
  plan();
  CKPT_ASSIGN_OR_RETURN(client::Layout layout,
                        client::LayOut(lengths, core.item_alignment.load()));

  // The lease lives as long as this client's session with the agent.
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<client::AgentSession> session, client::OpenSession(core));
  v1::AcquireStagingLeaseRequest lease_req =
      LeaseRequest(core, step_, session == nullptr ? std::string() : session->id());
  v1::AcquireStagingLeaseResponse lease;
  // The lease asked for at BeginSave, if its session is still open and the
  // shard fits it (laid out with the same alignment, no references, and at
  // least half of it used); released otherwise, before the lease below
  // replaces it (one whose session closed went with it).
  bool early_used = false;
  // The session the lease in use was taken on: its commit or abort names it.
  std::string lease_session = lease_req.session_id();
  if (std::shared_ptr<client::EarlyLease> early = std::move(early_); early != nullptr) {
    early->done.WaitForNotification();
    if (early->answer.ok() && early->session->Closed()) {
      log::Info("{}/{} rank {}: the session of the lease asked for at BeginSave closed; asking again", o.job_id,
                step_, o.rank);
    } else if (early->answer.ok()) {
      const v1::AcquireStagingLeaseResponse& e = *early->answer;
      const uint64_t align = e.item_alignment_bytes();
      if (base_steps.empty() && !e.pull() && layout.size <= early->size_bytes &&
          layout.size >= early->size_bytes / 2 && early->alignment == core.item_alignment.load() &&
          (align == 0 || align == early->alignment)) {
        lease = *std::move(early->answer);
        lease_session = early->session->id();
        early_used = true;
      } else {
        AbortLease(core, e.lease_id(), early->session->id());
      }
    }
  }
  // At most twice: once more if the agent asks for a coarser alignment than
  // we laid out with (then the shard may not fit the first lease).
  std::string replaced_lease;  // a first lease the second one replaces
  for (int attempt = 0; !early_used; ++attempt) {
    lease_req.set_size_bytes(layout.size);
    *lease_req.mutable_base_steps() = {base_steps.begin(), base_steps.end()};
    v1::AcquireStagingLeaseResponse resp;
    absl::Status s = absl::UnavailableError("not asked on the session");
    if (session != nullptr && session->serves_requests()) {
      // On the session's connection (no gRPC round trip); the agent says
      // Unavailable when it would have to ask meta, and gRPC asks then.
      absl::StatusOr<std::string> reply = session->Request("LEASE", lease_req.SerializeAsString(), o.rpc_timeout);
      s = reply.status();
      if (reply.ok() && !resp.ParseFromString(*reply)) s = absl::InternalError("lease (session): unparsable answer");
      if (!s.ok() && !absl::IsUnavailable(s)) s = Annotate(s, "AcquireStagingLease (session)");
    }
    if (absl::IsUnavailable(s)) {
      auto ctx = client::ContextWithTimeout(o.rpc_timeout);
      s = FromGrpc(core.agent->AcquireStagingLease(ctx.get(), lease_req, &resp), "AcquireStagingLease");
    }
    if (!s.ok() && absl::IsFailedPrecondition(s) && !base_steps.empty() && carried.empty() &&
        absl::StrContains(s.message(), "base version")) {
      // The agent no longer holds the base (evicted, restarted, another
      // node): this save copies everything.
      log::Info("{}/{} rank {}: {}; saving in full", o.job_id, step_, o.rank, std::string(s.message()));
      std::fill(ref.begin(), ref.end(), std::nullopt);
      plan();
      absl::StatusOr<client::Layout> full = client::LayOut(lengths, core.item_alignment.load());
      if (!full.ok()) s = full.status();
      if (full.ok()) {
        layout = *std::move(full);
        --attempt;
        continue;
      }
    }
    if (!s.ok()) {
      if (!replaced_lease.empty()) AbortLease(core, replaced_lease, lease_session);
      return s;
    }
    lease = std::move(resp);
    const uint64_t align = lease.item_alignment_bytes();
    if (align == 0 || align == core.item_alignment.load() || attempt > 0 ||
        (align & (align - 1)) != 0) {
      break;
    }
    core.item_alignment.store(align);
    absl::StatusOr<client::Layout> relaid = client::LayOut(lengths, align);
    if (!relaid.ok()) {
      AbortLease(core, lease.lease_id(), lease_session);
      return relaid.status();
    }
    layout = *std::move(relaid);
    // Fits the lease: commit a smaller size. Larger: the next lease for this
    // (job, step, rank) replaces (aborts) the open one.
    if (layout.size <= lease_req.size_bytes()) break;
    replaced_lease = lease.lease_id();
  }
  const std::string lease_id = lease.lease_id();

  // Copy. Nothing below may return without releasing the lease.
  std::vector<std::shared_ptr<client::MappedFile>> keep;
  // A pull-mode agent (a DPU's) reads the shard out of staging memory of
  // ours during the commit, which holds the buffer until it is answered.
  std::shared_ptr<client::PullStaging::Buffer> staging;
  absl::StatusOr<std::vector<client::ShardRegion>> regions;
  if (lease.pull()) {
    // The header (the lease's token, which proves to the agent that the
    // memory is ours for this lease), then the shard.
    absl::StatusOr<std::shared_ptr<client::PullStaging::Buffer>> buffer =
        client::StagingBuffer(core, client::kPullHeaderBytes + layout.size);
    if (buffer.ok() && lease.pull_token().size() > client::kPullHeaderBytes) {
      buffer = absl::InternalError("the agent's pull token is longer than the staging header");
    }
    if (buffer.ok()) {
      staging = *std::move(buffer);
      std::memset(staging->data(), 0, client::kPullHeaderBytes);
      std::memcpy(staging->data(), lease.pull_token().data(), lease.pull_token().size());
      regions = std::vector<client::ShardRegion>{
          client::ShardRegion{staging->data() + client::kPullHeaderBytes, layout.size, 0}};
    } else {
      regions = buffer.status();
    }
  } else {
    regions = client::MapRegions(core, lease.regions(), layout.size, client::MappedFile::Access::kReadWrite, &keep);
  }
  if (!regions.ok()) {
    AbortLease(core, lease_id, lease_session);
    return Annotate(regions.status(), absl::StrCat("staging lease ", lease_id));
  }
  v1::CommitShardRequest commit;
  commit.set_lease_id(lease_id);
  commit.set_session_id(lease_session);
  commit.set_size_bytes(layout.size);
  // The manifest goes packed (docs/protocol.md "Manifest digest"): one
  // string for the whole shard instead of a message per item.
  size_t manifest_bytes = 32;
  for (const Item& it : items_) {
    manifest_bytes += 48 + it.name.size() + 8 * it.shape.size();
    for (const auto& [k, v] : it.attributes) manifest_bytes += 8 + k.size() + v.size();
  }
  ManifestEncoder manifest(manifest_bytes);
  // Carried empty items (container markers) are the shard's own, first, so
  // that a container comes before the elements this save states.
  for (const ManifestItem* c : carried) {
    if (c->length_bytes == 0) manifest.Add(c->name, c->dtype, c->shape, 0, 0, c->crc32c, c->attributes);
  }
  uint32_t shard_crc = 0;
  uint64_t pos = 0;      // end of the bytes accounted for in shard_crc
  size_t copied = 0;     // items copied so far (index into layout.offsets)
  // Many items of a save the trainer waits for are copied ahead, on several
  // threads (a lazy save copies beside the training step: one, in order).
  std::vector<client::CopiedItem> ahead;
  if (progress == nullptr) {
    std::vector<client::ItemCopy> copies;
    copies.reserve(layout.offsets.size());
    for (size_t i = 0; i < items_.size(); ++i) {
      if (!ref[i]) copies.push_back(client::ItemCopy{items_[i].bytes, layout.offsets[copies.size()]});
    }
    ahead = client::CopyItemsToShard(*regions, copies);
  }
  bool any_ref = std::any_of(carried.begin(), carried.end(), [](const ManifestItem* c) { return c->length_bytes > 0; });
  for (size_t i = 0; i < items_.size(); ++i) {
    const Item& it = items_[i];
    if (ref[i]) {
      any_ref = true;
      if (progress != nullptr) progress->MarkCopied(i + 1);
      continue;
    }
    const size_t slot = copied++;
    const uint64_t off = layout.offsets[slot];
    if (off > pos) {
      const uint32_t gap_crc = ahead.empty() ? client::ZeroShard(*regions, pos, off - pos) : ahead[slot].gap_crc;
      shard_crc = Crc32cCombine(shard_crc, gap_crc, off - pos);
    }
    // A lazy save (progress set) copies beside the training step: one thread.
    const uint32_t crc =
        !ahead.empty() ? ahead[slot].crc
                       : client::CopyToShard(*regions, off, it.bytes, 0,
                                             progress != nullptr ? client::CopyThreads::kOne : client::CopyThreads::kAll);
    shard_crc = Crc32cCombine(shard_crc, crc, it.bytes.size());
    pos = off + it.bytes.size();

    manifest.Add(it.name, static_cast<int>(it.dtype), it.shape, off, it.bytes.size(), crc, it.attributes);
    if (progress != nullptr) progress->MarkCopied(i + 1);  // the caller may change item i now
  }
  if (progress != nullptr && items_.empty()) progress->MarkCopied(0);
  if (layout.size > pos) {
    shard_crc = Crc32cCombine(shard_crc, client::ZeroShard(*regions, pos, layout.size - pos),
                              layout.size - pos);
  }
  keep.clear();  // the agent owns the bytes now; the cache keeps its mappings
  // The references, in canonical order ((ref_step, offset)), and the hashes
  // the next save compares against.
  std::shared_ptr<client::ItemHashes> hashes;
  if (any_ref || std::any_of(hash.begin(), hash.end(), [](const auto& h) { return h.has_value(); })) {
    struct Ref {
      RefTo to;
      std::string_view name;
      int dtype;
      std::span<const uint64_t> shape;
      const std::map<std::string, std::string>* attributes;
    };
    std::vector<Ref> refs;
    hashes = std::make_shared<client::ItemHashes>();
    hashes->reserve(items_.size() + carried.size());
    for (size_t i = 0; i < items_.size(); ++i) {
      const Item& it = items_[i];
      if (hash[i]) hashes->emplace(std::string(it.name), *hash[i]);
      if (ref[i]) refs.push_back(Ref{*ref[i], it.name, static_cast<int>(it.dtype), it.shape, &it.attributes});
    }
    for (const ManifestItem* c : carried) {
      if (c->length_bytes == 0) continue;  // added above
      refs.push_back(Ref{base->Location(*c), c->name, c->dtype, c->shape, &c->attributes});
      if (std::optional<uint64_t> h = base->Hash(c->name)) hashes->emplace(c->name, *h);
    }
    std::stable_sort(refs.begin(), refs.end(), [](const Ref& a, const Ref& b) {
      return a.to.step != b.to.step ? a.to.step < b.to.step : a.to.offset_bytes < b.to.offset_bytes;
    });
    for (const Ref& r : refs) {
      manifest.AddRef(r.to.step, r.name, r.dtype, r.shape, r.to.offset_bytes, r.to.length_bytes, r.to.crc32c,
                      *r.attributes);
    }
    if (hashes->empty()) hashes.reset();
  }
  commit.set_manifest(manifest.Finish());
  if (staging != nullptr) {
    v1::PullSource* from = commit.mutable_pull_source();
    from->set_worker_address(staging->worker_address());
    from->set_rkey(staging->rkey());
    from->set_address(reinterpret_cast<uint64_t>(staging->data()));
    from->set_length_bytes(staging->length());
  }

  core.last_save_items.store(items_.size(), std::memory_order_relaxed);
  core.last_full_save_bytes.store(base_steps.empty() && !lease.pull() ? layout.size : 0, std::memory_order_relaxed);
  // The builder's bookkeeping (a name, shape and attributes per item) is
  // freed by the committer, after Commit returned, when it sends in the
  // background; here otherwise.
  struct Spent {
    std::vector<Item> items;
    std::unique_ptr<Names> names;
  };
  auto spent = std::make_shared<Spent>(Spent{std::move(items_), std::move(names_)});
  items_.clear();
  names_ = std::make_unique<Names>();
  base.reset();  // `carried` pointed into it
  carried.clear();
  auto remember = [&core, step = step_](absl::Time at) {
    absl::MutexLock lock(&core.committed_mu);
    core.committed_at[step] = at;
    // Only recent steps matter; keep the map small.
    while (core.committed_at.size() > 64) core.committed_at.erase(core.committed_at.begin());
  };
  auto request = std::make_shared<const v1::CommitShardRequest>(std::move(commit));
  // On this thread, not the committer's: a lazy save may itself wait for
  // the commits queued before it (its base), never for this one.
  client::AwaitEarlierCommits(earlier);
  if (!background) {
    spent.reset();
    CKPT_RETURN_IF_ERROR(SendCommit(core, request, shard_crc, step_, std::move(hashes)));
    if (progress == nullptr) client::LeaseAhead(core, step_, begun_seq_);
    const absl::Time now = absl::Now();
    remember(now);
    return SaveHandle(core_, step_, layout.size, shard_crc, now);
  }
  // The trainer goes on; the committer sends the manifest. Its queue is
  // bounded: when it is full the commit is sent here (as without
  // background), so a stalled agent cannot pile up commits.
  const absl::Time now = absl::Now();
  remember(now);
  auto result = std::make_shared<client::CommitResult>();
  auto send = [&core, request, result, shard_crc, step = step_, hashes = std::move(hashes),
               staging = std::move(staging), spent = std::move(spent), lazy = progress != nullptr,
               begun_seq = begun_seq_]() mutable {
    result->status = SendCommit(core, request, shard_crc, step, std::move(hashes));
    if (result->status.ok() && !lazy) client::LeaseAhead(core, step, begun_seq);
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
  return SaveHandle(core_, step_, layout.size, shard_crc, now, std::move(result));
}

}  // namespace ckpt
