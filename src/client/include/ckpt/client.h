// libckpt: the trainer-side client of ckpt.
//
// A trainer process (one rank of a job) hands its state to the ckpt-agent on
// its own node and goes back to training in the time of one memory copy:
//
//   ckpt::ClientOptions options;
//   options.meta_address = "meta.cluster:7400";
//   options.job_id = "gpt-7b";
//   options.rank = rank;
//   options.world_size = world_size;
//   absl::StatusOr<ckpt::Client> client = ckpt::Client::Connect(options);
//
//   ckpt::SaveBuilder save = client->BeginSave(step);
//   CKPT_RETURN_IF_ERROR(save.Add("model/w", AsBytes(w), ckpt::DType::kBF16, {4096, 4096}));
//   CKPT_ASSIGN_OR_RETURN(ckpt::SaveHandle handle, save.Commit());  // copy + crc only
//   ...train...
//   CKPT_RETURN_IF_ERROR(handle.Wait(ckpt::Level::kProtected, absl::Now() + absl::Minutes(5)));
//
//   // after a restart:
//   CKPT_ASSIGN_OR_RETURN(uint64_t step, client->Latest(ckpt::Level::kProtected));
//   CKPT_ASSIGN_OR_RETURN(ckpt::LoadedShard shard, client->Load(step));
//   CKPT_ASSIGN_OR_RETURN(std::span<const std::byte> w, shard.View("model/w"));
//
// How it works (docs/protocol.md §4 Save, §5 Restore): control calls go over
// gRPC, to ckpt-meta (jobs, versions, latest, wait, locate) and to the node's
// agent on its unix socket (staging leases, commit, open/close). Bulk bytes
// never cross a socket: the agent's memory tier is a set of files on a tmpfs
// ("pool files") that the client maps with mmap(MAP_SHARED) once at Connect;
// a save copies each item straight into the leased part of those files,
// computing its CRC-32C in the same pass, and a load hands out views of them.
//
// Errors: every call returns absl::Status / absl::StatusOr. Errors of a remote
// call keep the server's gRPC code one to one (UNAVAILABLE -> kUnavailable,
// ...) and its message, prefixed with the call's name ("CommitShard: ...").
// Meanings follow docs/protocol.md "Errors": kUnavailable = meta or agent down
// (retry), kDeadlineExceeded, kInvalidArgument = bad input, kNotFound,
// kAlreadyExists, kFailedPrecondition, kResourceExhausted = the agent's memory
// tier is full, kDataLoss = a checksum mismatch (never wrong bytes).
//
// Thread safety: a Client is thread-safe: Latest, WaitVersion, Load, LoadInto
// and BeginSave may be called from any number of threads at once. A
// SaveBuilder is used by one thread at a time (it is a plain value being
// filled in); several SaveBuilders of different steps may commit concurrently.
// A SaveHandle is thread-safe (Wait from any thread). A LoadedShard's const
// methods and View() may be called from several threads at once; Close() and
// the destructor must not race with them.
//
// Moves: a moved-from Client, SaveBuilder or LoadedShard may only be
// destroyed or assigned to.
//
// fork(): a client belongs to the process that connected it. In a forked
// child its saves, loads and waits fail with kFailedPrecondition (connect a
// new client there), and dropping it there frees nothing (its threads,
// channels and agent session are the parent's).
//
// Lifetimes: SaveHandle and LoadedShard share the connection state with the
// Client that made them, so either may outlive it (the gRPC channels and the
// mappings stay alive until the last of them is destroyed).
//
// Headers: this one holds the classes; the value types are in ckpt/types.h
// and the options in ckpt/options.h (both included here, so including
// ckpt/client.h alone is enough). Errors are absl::Status.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "ckpt/options.h"
#include "ckpt/types.h"

namespace ckpt {

// Internals the classes below hold by pointer (src/client/*.h).
namespace client {
struct ClientCore;    // connection state shared by a Client and its handles (client_core.h)
struct LazyState;     // a lazy save in progress (LazySave; lazy_save.h)
struct CommitResult;  // a commit sent in the background (SaveHandle; client_core.h)
struct ShardRegion;   // a mapped part of a shard (LoadedShard; region_io.h)
struct SaveState;     // a SaveBuilder's items and lease (save_state.h)
}  // namespace client

class Client;
class SaveBuilder;
namespace client {
Client MakeClient(std::shared_ptr<ClientCore> core);  // client_core.h
}  // namespace client

// What a committed save returns: the version's step and this rank's shard,
// and a way to wait for the version to reach a durability level.
// Copyable and movable; thread-safe.
class SaveHandle {
 public:
  uint64_t step() const { return step_; }
  // Size of this rank's shard in bytes (items and the padding between them).
  uint64_t size_bytes() const { return size_bytes_; }
  // CRC-32C of the shard's size_bytes bytes, padding included.
  uint32_t crc32c() const { return crc32c_; }

  // Blocks until the whole version (every rank's shard, not only this one)
  // reaches `level`, or until `deadline`. A deadline in the past checks once.
  // Waits in long polls to ckpt-meta and rides out meta restarts
  // (kUnavailable is retried until the deadline). Errors: kDeadlineExceeded
  // (the message says the version's state), kNotFound (version unknown or
  // deleted), kDataLoss (version aborted because data was lost),
  // kFailedPrecondition (version aborted for another reason: the message
  // says why). The agent begins a new step at meta in the background, so for
  // the first 10 s after the commit a version meta does not know yet is
  // waited for rather than reported kNotFound.
  // Before anything else it waits for the commit (Committed) and returns
  // its error if it failed.
  absl::Status Wait(Level level, absl::Time deadline = absl::InfiniteFuture()) const;

  // Blocks until the agent has answered this shard's commit and returns the
  // outcome. SaveBuilder::Commit returns once the bytes are copied and sends
  // the commit (the manifest) to the agent in the background: OK here means
  // the agent holds the shard, which then survives this process's death.
  // Errors are those the commit used to return from Commit (see there:
  // kDataLoss, kUnavailable, kFailedPrecondition, ...); nothing is committed
  // then. kDeadlineExceeded at `deadline` (the commit is still in flight).
  // Returns at once for a commit that was not sent in the background
  // (ClientOptions::commit_in_background off, or a LazySave's handle).
  absl::Status Committed(absl::Time deadline = absl::InfiniteFuture()) const;

 private:
  friend class SaveBuilder;
  friend class LazySave;
  SaveHandle(std::shared_ptr<client::ClientCore> core, uint64_t step, uint64_t size_bytes,
             uint32_t crc32c, absl::Time committed_at, std::shared_ptr<client::CommitResult> commit = nullptr)
      : core_(std::move(core)), commit_(std::move(commit)), step_(step), size_bytes_(size_bytes),
        crc32c_(crc32c), committed_at_(committed_at) {}

  std::shared_ptr<client::ClientCore> core_;
  std::shared_ptr<const client::CommitResult> commit_;  // null: committed before Commit returned
  uint64_t step_;
  uint64_t size_bytes_;
  uint32_t crc32c_;
  absl::Time committed_at_;
};

// A save running in the background (SaveBuilder::CommitLazy): the staging
// lease, the copy of the items (in Add order, each with its CRC-32C) and the
// commit happen on a thread of their own while the trainer goes on. The
// caller keeps every item's bytes alive and unchanged until that item is
// copied: WaitCopied() (all of them) or WaitItemCopied(i) (the first i+1 in
// Add order), e.g. right before the optimizer step that changes them.
// Integrity is that of Commit: what was copied is what is checksummed and
// committed.
//
// Copyable (copies share the save) and thread-safe. The last copy to go
// waits, in its destructor, until the save has finished (copied and
// committed or failed): the items' memory can never be read after the
// handles are gone, and no thread outlives them. A training loop should
// therefore keep a save's LazySave until the next one (as the Python client
// does): dropping it right after WaitCopied() waits for the agent's answer
// to the commit, which an eager save never makes the trainer wait for.
class LazySave {
 public:
  LazySave() = default;  // empty: every wait returns kFailedPrecondition
  uint64_t step() const { return step_; }
  // Number of items of the save.
  size_t item_count() const;
  // Items copied so far (Add order). Does not block.
  size_t copied_items() const;
  // Blocks until every item is copied (then the caller may change them) or
  // the save failed before that. Returns the save's error if it failed
  // before or while copying (nothing is committed then), kDeadlineExceeded
  // at `deadline`.
  absl::Status WaitCopied(absl::Time deadline = absl::InfiniteFuture()) const;
  // Blocks until items 0..index (Add order) are copied; as WaitCopied.
  // kInvalidArgument for an index past the last item.
  absl::Status WaitItemCopied(size_t index, absl::Time deadline = absl::InfiniteFuture()) const;
  // Blocks until the save is committed and returns its SaveHandle, or the
  // error Commit would have returned; kDeadlineExceeded at `deadline`.
  absl::StatusOr<SaveHandle> Wait(absl::Time deadline = absl::InfiniteFuture()) const;

 private:
  friend class SaveBuilder;
  LazySave(std::shared_ptr<client::LazyState> state, uint64_t step) : state_(std::move(state)), step_(step) {}
  std::shared_ptr<client::LazyState> state_;
  uint64_t step_ = 0;
};

// Collects the items of one save (one rank's shard of one step) and commits
// them. Obtained from Client::BeginSave, which, after a save of this client
// that copied every item, asks the agent in the background for a staging
// lease of that save's size (released if this save does not commit into it). Movable, not copyable; not
// thread-safe (one thread fills and commits it).
class SaveBuilder {
 public:
  SaveBuilder(SaveBuilder&&) noexcept;
  SaveBuilder& operator=(SaveBuilder&&) noexcept;
  SaveBuilder(const SaveBuilder&) = delete;
  SaveBuilder& operator=(const SaveBuilder&) = delete;
  ~SaveBuilder();

  // Adds an item. Records the pointer only: nothing is copied until Commit,
  // so the caller must keep `bytes` alive and unchanged until Commit returns.
  // The name, shape and attributes are copied (the name and a shape of up to
  // 4 dimensions into the builder's own blocks: no allocation per item; the
  // caller needs none either: a string literal or any string, a vector or a
  // braced list). Does not block; constant time (a shard may have tens of
  // thousands of items). Errors (kInvalidArgument, the builder is unchanged): a
  // bad name (1..1024 bytes of printable UTF-8), a name already added, an
  // unknown dtype, a length that does not match dtype and shape (see DType),
  // more than 16 attributes or an attribute key or value over 256 bytes;
  // kFailedPrecondition after Commit was called.
  // `change`: see ItemChange (incremental saves).
  absl::Status Add(std::string_view name, std::span<const std::byte> bytes, DType dtype,
                   absl::Span<const uint64_t> shape,
                   std::map<std::string, std::string> attributes = {},
                   ItemChange change = ItemChange::kChanged);

  // A partial save: every item of the base (see ItemChange) that this save
  // does not Add is carried over as a reference, with its name, dtype,
  // shape, attributes and step; a load of this version gives them all
  // (LoadedItem::step says where each was taken). Commit fails with
  // kFailedPrecondition when there is no base (this client's first save, or
  // the agent no longer holds it): save in full then.
  void CarryRest();

  // Number of items added so far.
  size_t item_count() const;

  // Copies every item into the agent's memory tier and commits the shard.
  // Lays the items out in Add order at offsets aligned to the agent's
  // recommended alignment (64 bytes by default), acquires a staging lease of
  // that size, copies each item with its CRC-32C computed in the same pass,
  // zeroes the padding, and commits the manifest (packed: docs/protocol.md
  // "Manifest digest"). Blocks for the lease (one local RPC) and the copy:
  // this is the only part of a save the trainer waits for. The commit goes
  // to the agent in the background (ClientOptions::commit_in_background,
  // the default): SaveHandle::Committed says when the agent holds the shard
  // (from then on it survives this process's death) and reports the
  // commit's errors; SaveHandle::Wait waits for it and then for redundancy.
  // With commit_in_background off, Commit waits for the commit too and
  // returns its errors itself. A replayed commit the agent already holds
  // (kAlreadyExists from CommitShard, or a commit whose response was lost)
  // is a success. Any other failure releases the lease (AbortLease):
  // nothing is committed (kDataLoss below excepted).
  // Errors of Commit: kResourceExhausted (does not fit in the agent's memory
  // tier: the message says what holds it), kAlreadyExists (this rank's shard
  // of the step is already committed on this node: a previous save of the
  // same step), kInvalidArgument (bad item or rank, or a step above 2^53-1,
  // the largest step ckpt accepts: see kMaxStep in docs/protocol.md),
  // kNotFound (job unknown to meta, on the job's first save on this node),
  // kUnavailable (agent down; meta is needed only for the job's first save
  // on the node), kInternal (the agent handed out regions that do not cover
  // the lease), errors of mmap as in PosixErrorToStatus, kFailedPrecondition
  // if called twice. Errors of the commit (Committed, or Commit with
  // commit_in_background off): kUnavailable / kDeadlineExceeded (the agent
  // did not answer), kFailedPrecondition (the lease expired or was replaced),
  // kDataLoss if the shard crc the agent reports differs from the one
  // computed here (the shard is committed, but something else wrote into the
  // lease while it was being filled). Can be called once; the builder is
  // spent afterwards, whatever the outcome. The agent begins the version at
  // meta in the background: a version meta refuses (e.g. a step lower than
  // the job's newest) is dropped by the agent, and SaveHandle::Wait reports
  // it (kNotFound after its grace period, naming the newer version that
  // refused it).
  absl::StatusOr<SaveHandle> Commit();

  // Commit in the background: returns at once (after the checks that need
  // no I/O) with a LazySave; the lease, copy and commit run on their own
  // thread, with the errors Commit would return reported by the LazySave's
  // waits. The items' bytes must stay alive and unchanged until they are
  // copied (LazySave::WaitCopied / WaitItemCopied). The builder is spent
  // afterwards. Errors here: kFailedPrecondition if already spent,
  // kInvalidArgument for a step above 2^53-1.
  absl::StatusOr<LazySave> CommitLazy();

 private:
  friend class Client;
  friend struct client::LazyState;
  // The work of Commit. `progress`, if not null, hears of every item copied.
  // `background`: send the commit on the client's committer and return
  // without its answer.
  absl::StatusOr<SaveHandle> CommitItems(client::LazyState* progress, bool background);
  SaveBuilder(std::shared_ptr<client::ClientCore> core, uint64_t step);
  // A lease asked for at BeginSave and not committed into: released.
  void ReleaseEarlyLease();

  std::unique_ptr<client::SaveState> state_;  // null once moved from
};

// This rank's shard of one version, opened for zero-copy reading in the
// agent's memory tier. Returned by Client::Load. Views stay valid (and the
// agent keeps the bytes unmodified) until Close() or destruction.
// Movable, not copyable. May outlive the Client that loaded it.
class LoadedShard {
 public:
  LoadedShard(LoadedShard&&) noexcept;
  LoadedShard& operator=(LoadedShard&&) noexcept;
  LoadedShard(const LoadedShard&) = delete;
  LoadedShard& operator=(const LoadedShard&) = delete;
  // Releases the shard if it is open, as CloseInBackground (does not wait
  // for the agent).
  ~LoadedShard();

  uint64_t step() const;
  uint32_t rank() const;
  uint64_t size_bytes() const;
  uint32_t crc32c() const;
  // Where the agent got the shard from.
  ServedFrom served_from() const;
  // True if every item's crc32c was checked before Load returned (by the
  // client or by the agent: LoadOptions::verify).
  bool verified() const;
  // The items in shard (offset) order.
  const std::vector<LoadedItem>& items() const;
  // The item named `name`, or nullptr.
  const LoadedItem* Find(const std::string& name) const;

  // Copies item `index` (of items()) into `dst`, which must be exactly its
  // length_bytes, and checks its CRC-32C while copying (one pass over the
  // bytes): the way to read a shard loaded with LoadOptions::verify = false.
  // Does not block on the agent; may be called from several threads at once
  // (for different destinations). Errors: kOutOfRange (no such index),
  // kInvalidArgument (dst has another size), kFailedPrecondition (closed),
  // kDataLoss (the bytes do not match the item's crc32c; dst then holds
  // them anyway).
  absl::Status CopyItem(size_t index, std::span<std::byte> dst) const;
  // CopyItem for many items at once: items()[index[k]] into dst[k], for
  // every k, on every copy thread (client/region_io.h CopyItemsFromShard:
  // a state of many tensors of a few MiB each loads on every core). Sizes
  // and indexes are checked before anything is copied. Errors: those of
  // CopyItem; kDataLoss names the first item (in `index` order) whose bytes
  // do not match, after every item was copied.
  absl::Status CopyItems(std::span<const size_t> index, std::span<const std::span<std::byte>> dst) const;

  // The item's bytes, read-only. Zero copy: a view into the agent's memory
  // tier, unless the item straddles two regions that are not adjacent in this
  // process's address space; then the bytes are copied once (on the first
  // View of the item) into a private buffer owned by this LoadedShard, with
  // their CRC-32C checked as they are copied. Valid until Close() or
  // destruction. Errors: kNotFound (no such item), kFailedPrecondition
  // (closed), kDataLoss (a copied item fails its checksum).
  absl::StatusOr<std::span<const std::byte>> View(const std::string& name);

  // Releases the agent's handle (CloseShard); views become invalid. Idempotent
  // (a closed shard returns OK). Blocks for one RPC. Errors: those of
  // CloseShard (the handle is forgotten anyway and expires at the agent).
  absl::Status Close();

  // Like Close(), but does not wait for the agent's answer: the CloseShard
  // call is sent and its failure, if any, logged (the handle then ends with
  // the client's session). Views become invalid at once; items() stay
  // readable. The Client's destruction waits for the answer.
  void CloseInBackground();

 private:
  friend class Client;
  struct Impl;
  explicit LoadedShard(std::unique_ptr<Impl> impl);
  // The mapped regions holding `item`'s bytes (this shard's or a base's).
  const std::vector<client::ShardRegion>& RegionsOf(const LoadedItem& item) const;
  std::unique_ptr<Impl> impl_;
};

// A connection to ckpt-meta and to the node's agent, for one rank of one job.
// Movable, not copyable; thread-safe (see the file comment).
class Client {
 public:
  // Connects and makes sure the job exists. Rank 0 creates the job, or opens
  // it if it exists with the same world size (and protection, flush and
  // retention, where set; unset ones take the stored values): it is safe to
  // call on every start. Other ranks wait
  // (polling with backoff) until the job exists. Then asks the agent for its
  // node id and pool files and maps every pool file whole, read-write, with
  // its page tables populated, so the first save pays no page faults.
  // Blocks up to options.connect_timeout while meta or the agent are
  // unreachable or the job does not exist yet.
  // Errors: kInvalidArgument (bad job id, world size 0, rank >= world size,
  // no meta address; or meta rejects the spec), kFailedPrecondition (the job
  // exists with another world size, or another protection, flush or
  // retention than one set here: the message names each with both values;
  // or is being deleted), kDeadlineExceeded (connect_timeout passed: the
  // message says what was missing), errors of mmap of a pool file as in
  // PosixErrorToStatus (e.g. kPermissionDenied).
  static absl::StatusOr<Client> Connect(const ClientOptions& options);

  Client(Client&&) noexcept;
  Client& operator=(Client&&) noexcept;
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  // Drops this Client's share of the connection; mappings are unmapped once
  // no SaveHandle or LoadedShard uses them any more. Does not block.
  ~Client();

  const ClientOptions& options() const;
  // The agent's node id (as registered with meta).
  const std::string& node_id() const;

  // Starts a save of `step` (0..2^53-1) for this rank. Does not block, cannot
  // fail: the checks happen in Add and Commit.
  SaveBuilder BeginSave(uint64_t step);

  // As SaveHandle::Wait, for any step of the job (e.g. one saved by an
  // earlier process). The NotFound grace applies to steps this client
  // committed in the last 10 s.
  absl::Status WaitVersion(uint64_t step, Level level,
                           absl::Time deadline = absl::InfiniteFuture()) const;

  // The newest step of the job at `level` or better. One RPC to meta.
  // Errors: kNotFound (no version at that level, or the job is gone).
  absl::StatusOr<uint64_t> Latest(Level level) const;

  // The checkpoint interval in steps for a training step of `step_time`:
  // Young/Daly, sqrt(2 x C x M), C the median time this client's recent saves
  // blocked (an eager save's Commit; a lazy save's CommitLazy plus its waits
  // for the copy), M the job's MTBF from meta (ClusterStatus: node time
  // observed / failures seen, divided by the job's nodes; with no failure seen
  // the observed time, a lower bound, which errs toward checkpointing more
  // often). One RPC to meta. Errors: kInvalidArgument (step_time <= 0),
  // kFailedPrecondition (no save measured yet, or meta has observed no node
  // time), those of the RPC.
  absl::StatusOr<IntervalAdvice> RecommendedInterval(absl::Duration step_time) const;

  // Asks this node's agent to hold protection traffic (replica and EC pushes
  // to peers) back for `d` (at most 60 s; 0 resumes at once), e.g. around the
  // trainer's own collectives: no new push starts meanwhile, one already
  // sending finishes. Returns how long the pause in force lasts. Errors:
  // kInvalidArgument (d negative or over 60 s), kUnavailable (agent down).
  absl::StatusOr<absl::Duration> PauseProtection(absl::Duration d) const;

  // Opens this rank's shard of `step` for zero-copy reading: asks meta where
  // it lives (Locate, preferring this node) while the agent opens its own
  // copy, if any (OpenShard): a local copy that meta names first and that is
  // the version's (size, crc32c, manifest digest) is used in place;
  // otherwise the agent fetches it from the next source (peer replica, EC
  // decode, durable tier) into its memory tier first. The agent checks every
  // item's crc32c (unless options.verify is false). The manifest travels
  // packed, once (from the agent when the copy is local). Blocks for that (up
  // to options.load_timeout). This client's own commits are answered first;
  // in a job of one rank, a step it committed in the last 10 s that meta has
  // not staged yet (the agent reports in the background) is waited for.
  // Errors: kNotFound (job, version or this rank's shard unknown),
  // kFailedPrecondition (version not at the STAGED level: open, aborted,
  // deleted), kDataLoss (every source failed its checksum or is gone; the
  // message says why), kResourceExhausted (no room for a restored copy),
  // kInternal (the agent returned regions or a manifest that do not fit).
  absl::StatusOr<LoadedShard> Load(uint64_t step, const LoadOptions& options = {}) const;

  // Copies the named items of this rank's shard of `step` into the caller's
  // buffers: the fastest way to restore into live tensors. Opens the shard as
  // Load does but without the agent's verification pass, checks each item's
  // CRC-32C while copying it, and closes the shard. If an item's checksum
  // does not match, the shard is opened again with the agent verifying it
  // (which quarantines a corrupt local copy and tries the other sources) and
  // the copy is retried once; a second mismatch or the agent's kDataLoss is
  // returned as kDataLoss naming the item: wrong bytes are never returned
  // silently. Items of the shard not in `buffers` are skipped. Blocks.
  // Errors: those of Load; kNotFound (a name in `buffers` is not in the
  // shard), kInvalidArgument (a buffer's size differs from the item's
  // length), both reported before anything is copied; kDataLoss as above.
  // On error the buffers' contents are unspecified.
  absl::Status LoadInto(uint64_t step,
                        const std::map<std::string, std::span<std::byte>>& buffers) const;

  // Buffers by item name, for LoadInto.
  using Buffers = std::map<std::string, std::span<std::byte>>;
  // LoadInto with buffers the caller works out while the shard opens:
  // `buffers` runs on the caller's thread while the client asks meta and
  // the local agent for the shard on a thread of its own (for a caller whose
  // buffers take time to find, e.g. the Python client reading its tensors);
  // then as above. An error `buffers` returns is returned as it is, before
  // anything is copied.
  absl::Status LoadIntoWhileOpening(uint64_t step, const std::function<absl::StatusOr<Buffers>()>& buffers) const;

  // ---- Another layout: global tensors (docs/python.md "Another layout") ----
  // A version saved by W ranks restored into this job's W' ranks, or into
  // another split: items that say they are slices of global tensors
  // (GlobalAttributes, ckpt/types.h) are indexed by the version's metadata at meta, and any
  // slice of a global tensor is assembled from the shards that hold it.

  // The global tensors of `step`, by name, from meta's record of the version
  // (one call, every rank's manifest; no shard is read). Errors: kNotFound
  // (job or version), kInvalidArgument (an item's global attributes are
  // malformed, or two items disagree on a tensor's dtype or shape).
  absl::StatusOr<std::map<std::string, GlobalTensor>> GlobalTensors(uint64_t step) const;

  // Loads each slice of `slices` into its dst. Works out which ranks' shards
  // overlap each slice (a slice several ranks hold whole, a replica, is read
  // from one of them: this rank's, a shard with a copy on this node (its
  // primary, a replica or a restored copy), else the lowest rank), opens
  // those shards (Load with LoadOptions::rank, in parallel, every item's
  // crc32c checked: from the local agent, a peer's copy, EC decode or the
  // durable tier, as any load)
  // and copies the overlapping parts. Nothing is written into any dst before
  // every slice is known to be covered and every shard it needs is open and
  // verified. Blocks. Errors: those of GlobalTensors and Load; kNotFound (no
  // such global tensor), kInvalidArgument (offsets or lengths with another
  // count of dimensions, a slice outside the tensor, a dst of another size),
  // kDataLoss (part of a slice is in no shard of the version).
  absl::Status LoadSlices(uint64_t step, std::span<const SliceRequest> slices) const;

 private:
  friend Client client::MakeClient(std::shared_ptr<client::ClientCore> core);
  explicit Client(std::shared_ptr<client::ClientCore> core);
  std::shared_ptr<client::ClientCore> core_;
};

// Young's interval sqrt(2 x C x M) for a checkpoint cost C and an MTBF M,
// and that interval in steps of `step_time` (rounded to the nearest, at
// least 1): the arithmetic of Client::RecommendedInterval, which fills the
// other fields of IntervalAdvice. E.g. C = 10 s, M = 1 h: 268.3 s, 268 steps
// of 1 s. Requires step_time > 0 and C, M >= 0.
IntervalAdvice YoungDalyInterval(absl::Duration checkpoint_cost, absl::Duration mtbf, absl::Duration step_time);

}  // namespace ckpt
