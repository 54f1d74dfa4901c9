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

namespace ckpt {

namespace client {
struct ClientCore;  // connection state shared by a Client and its handles
struct LazyState;   // a lazy save in progress (LazySave)
struct EarlyLease;  // a staging lease asked for when a save began
struct CommitResult;  // a commit sent in the background (SaveHandle)
struct ShardRegion;   // a mapped part of a shard (LoadedShard)
struct SaveState;     // a SaveBuilder's items and lease (client/save_state.h)
}  // namespace client

// Element type of an item. The numbers are those of ckpt.v1.DType
// (proto/ckpt/v1/common.proto). Items are dense and row-major (C order).
// For every type except kBytes, an item's length in bytes must equal the
// product of its shape's dimensions (1 for an empty shape: a scalar) times the
// element size.
enum class DType : int {
  kF32 = 1,        // 4 bytes
  kF16 = 2,        // 2 bytes
  kBF16 = 3,       // 2 bytes
  kF64 = 4,        // 8 bytes
  kI8 = 5,         // 1 byte
  kI16 = 6,        // 2 bytes
  kI32 = 7,        // 4 bytes
  kI64 = 8,        // 8 bytes
  kU8 = 9,         // 1 byte
  kU16 = 10,       // 2 bytes
  kU32 = 11,       // 4 bytes
  kU64 = 12,       // 8 bytes
  kBool = 13,      // 1 byte
  kBytes = 14,     // opaque bytes, any length; shape ignored (empty or {length})
  kC64 = 15,       // 8 bytes (two f32)
  kC128 = 16,      // 16 bytes (two f64)
  kF8E4M3FN = 17,  // 1 byte
  kF8E5M2 = 18,    // 1 byte
};

// Bytes per element of `dtype` (1, 2, 4, 8 or 16); 0 for kBytes and for
// numbers that are not a DType.
uint32_t DTypeSize(DType dtype);

// A durability level a version can reach (ckpt.v1.DurabilityLevel):
//   kStaged:    every rank's shard is in some agent's memory tier (survives
//               trainer crashes);
//   kProtected: the job's protection policy is complete (survives the
//               configured number of node losses);
//   kPersisted: in the durable tier with a commit marker.
// A version at a higher level also satisfies the lower ones.
enum class Level { kStaged = 1, kProtected = 2, kPersisted = 3 };

// Where a load was served from (ckpt.v1.SourceKind).
enum class ServedFrom {
  kUnknown = 0,   // the agent did not say
  kLocal = 1,     // this node's memory tier (zero copy)
  kReplica = 2,   // a peer's full copy, fetched over the data plane
  kEcDecode = 3,  // rebuilt from erasure-coded stripes
  kDurable = 4,   // the durable tier
};

// "local", "replica", "ec_decode", "durable" or "unknown".
const char* ServedFromName(ServedFrom served_from);

// How a job's shards are protected against node loss (docs/architecture.md "Protection"), if the
// trainer states one (ClientOptions::protection): rank 0 creates the job with
// it, and meta compares it when the job already exists.
struct Protection {
  enum class Kind { kNone, kReplicate, kErasureCode };
  enum class Placement { kRing, kGroup };

  // Local memory only: survives a trainer crash, not a node loss.
  static Protection None() { return Protection{}; }
  // `copies` in-memory copies (2..8) counting the primary.
  static Protection Replicate(uint32_t copies, Placement placement = Placement::kRing) {
    Protection p;
    p.kind = Kind::kReplicate;
    p.copies = copies;
    p.placement = placement;
    return p;
  }
  // Reed-Solomon stripes of k data (1..32) and m parity (1..8) segments.
  static Protection ErasureCode(uint32_t data_k, uint32_t parity_m) {
    Protection p;
    p.kind = Kind::kErasureCode;
    p.data_k = data_k;
    p.parity_m = parity_m;
    return p;
  }

  Kind kind = Kind::kNone;
  uint32_t copies = 0;                    // kReplicate
  Placement placement = Placement::kRing; // kReplicate
  uint32_t data_k = 0;                    // kErasureCode
  uint32_t parity_m = 0;                  // kErasureCode
};

struct ClientOptions {
  // ckpt-meta's gRPC address, "host:port" (any gRPC target string works).
  // Required.
  std::string meta_address;
  // TLS to ckpt-meta (docs/security.md): PEM files of the CA that signed
  // meta's certificate, and of this client's certificate and key (meta with
  // mutual TLS requires them). Empty: $CKPT_TLS_CA, $CKPT_TLS_CERT,
  // $CKPT_TLS_KEY; all empty: plaintext. (The agent is reached over its
  // local socket, guarded by the socket's mode.)
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // A trainer token for this job (ckpt-meta --trainer-tokens-file;
  // docs/security.md), sent to meta on every call: the file holding it (mode
  // 0600 or 0640). Empty: $CKPT_TOKEN_FILE, else $CKPT_TOKEN; none: no token.
  std::string token_file;
  // Path of the node agent's unix socket (its <run-dir>/agent.sock). A value
  // starting with "unix:" is used as a gRPC target as is.
  std::string agent_socket = "/run/ckpt/agent.sock";
  // Job id, [a-z0-9][a-z0-9._-]{0,62} without "..". Required.
  std::string job_id;
  // This process's rank, 0 <= rank < world_size.
  uint32_t rank = 0;
  // Number of ranks of the job (1..1,048,576). Compared with the stored job.
  uint32_t world_size = 0;
  // Identifies this training run (one launch of all ranks; a restarted
  // launch should use a new one). A version begun by another run is aborted
  // and replaced when this run saves the same step, so shards of two runs
  // never mix. Empty: no run tracking.
  std::string run_id;

  // ---- Job spec, used by rank 0 to create the job (create-or-open) ----
  // Unset (the default): a job that exists keeps its stored protection (an
  // operator's `ckptctl create-job --replicate 2`, say), and a job rank 0
  // creates gets the server's default (docs/meta.md: replicate{2, ring} when
  // the cluster has at least two alive nodes, none on a single node). Set:
  // the job is created with it, and an existing job must have it
  // (kFailedPrecondition naming both otherwise).
  std::optional<Protection> protection;
  // Flush every Nth version / every N seconds to the durable tier (0: rule
  // off). Left at 0 both, the stored flush policy is not compared.
  uint32_t flush_every_n_versions = 0;
  uint32_t flush_every_seconds = 0;
  // Versions kept in memory / in the durable tier; 0 = server default. Left
  // at 0 both, the stored retention is not compared.
  uint32_t keep_in_memory = 0;
  uint32_t keep_durable = 0;
  // Free-form labels stored with the job when rank 0 creates it (not compared).
  std::map<std::string, std::string> labels;

  // ---- Timing ----
  // How long Connect keeps trying: meta or the agent unreachable, or (ranks
  // other than 0) the job not yet created by rank 0.
  absl::Duration connect_timeout = absl::Seconds(30);
  // Deadline of each short control call (lease, commit, latest, locate, ...).
  absl::Duration rpc_timeout = absl::Seconds(60);
  // Deadline of OpenShard, which blocks while the agent fetches a shard that
  // is not local (from a peer, by EC decode, or from disk).
  absl::Duration load_timeout = absl::Minutes(10);

  // ---- Save ----
  // True (the default): SaveBuilder::Commit returns once the bytes are
  // copied, and the commit (the manifest, one local call whose cost grows
  // with the number of items) goes to the agent in the background; its
  // outcome is SaveHandle::Committed (and the start of SaveHandle::Wait).
  // This client's own Load, LoadInto, WaitVersion and Latest wait for its
  // commits first. False: Commit waits for the agent's answer.
  bool commit_in_background = true;
  // True (the default): once a save that copied every item committed, and
  // the last two such saves were at steps P < S, the client asks its agent
  // for the staging lease of step S + (S - P) at once (the same size), so
  // that a trainer saving at a fixed interval finds its next lease granted
  // when it begins that save (docs/agent.md "Save path"). The agent begins
  // such a version at meta only when a shard is committed into it; a save at
  // another step releases it and asks as before. It holds pool memory of one
  // shard between saves.
  bool lease_ahead = true;
  // Incremental saves (ItemChange, SaveBuilder::CarryRest): a save whose
  // step reaches a multiple of N that its base's step had not (N, 2N, ...,
  // the same steps on every rank) is made in full: a reference points to
  // the version that holds the bytes, which stays in memory (whole) while
  // referred to, so this bounds how many old versions are kept. 0: never
  // forced. Partial saves (CarryRest) are never forced full.
  uint32_t full_save_every = 10;
};

// How often to checkpoint (Client::RecommendedInterval): the Young/Daly
// interval sqrt(2 x C x M) for a checkpoint cost C (what this client's saves
// blocked the trainer, measured) and the job's mean time between failures M
// (from meta's history of node failures).
struct IntervalAdvice {
  uint64_t steps = 1;                  // the interval in training steps (at least 1)
  absl::Duration interval;             // sqrt(2 x C x M)
  absl::Duration checkpoint_cost;      // C: median blocking time of the recent saves
  absl::Duration mtbf;                 // M: the job's MTBF
  bool mtbf_is_lower_bound = false;    // meta has seen no failure: M is the time observed
  uint64_t failures_seen = 0;          // node failures meta has seen (all nodes)
  absl::Duration observed_node_time;   // node time meta has watched (all nodes)
  uint32_t job_nodes = 0;              // nodes the job runs on
  std::string explanation;             // the numbers in one sentence
};

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

// How an item of a save relates to the same-named item of the client's
// previous save (its "base": the last save of this Client that committed, or
// the version it last loaded if that is newer, so that a restarted trainer
// goes on from the version it restored; docs/protocol.md "Incremental saves"). An item that is the base's is
// stored as a reference to the base's bytes: nothing is copied, sent to
// peers or kept twice. Loads follow references transparently.
enum class ItemChange {
  kChanged,    // copy it (the default)
  kUnchanged,  // the caller vouches it is equal to the base's item (frozen
               // parameters): referenced without reading it, if the base has
               // an item of that name and length; copied otherwise
  kDetect,     // hash it (XXH3-64, a read-only pass) and reference the base's
               // item when that was hashed too and is equal; copied otherwise
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

// One item of a loaded shard, as recorded in its manifest.
struct LoadedItem {
  std::string name;
  DType dtype = DType::kBytes;
  std::vector<uint64_t> shape;
  // Position of the item inside the shard of version `step` (this rank's).
  uint64_t offset_bytes = 0;
  uint64_t length_bytes = 0;
  // CRC-32C of the item's bytes, computed by the writer.
  uint32_t crc32c = 0;
  std::map<std::string, std::string> attributes;
  // The version whose save copied these bytes: the loaded version's own
  // step, or an older one for an item an incremental save carried over
  // (a reference: unchanged, or not stated by a partial save).
  uint64_t step = 0;
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

// How Client::Load opens a shard.
struct LoadOptions {
  // True: every item's crc32c is checked before Load returns: by the client
  // (one pass over the shard against its crc32c, item by item only if that
  // fails; on a second thread while it lists the items, for a shard of 1 MiB
  // or more), and on a mismatch once more by the agent, which quarantines a copy
  // that fails and serves the next source (docs/protocol.md "Restore").
  // False: nothing is checked, and the caller reads items only through
  // LoadedShard::CopyItem, which checks each one while copying; on kDataLoss,
  // load again with verify = true. Saves one pass over the shard when every
  // item is copied anyway.
  bool verify = true;
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

 private:
  friend Client client::MakeClient(std::shared_ptr<client::ClientCore> core);
  explicit Client(std::shared_ptr<client::ClientCore> core);
  std::shared_ptr<client::ClientCore> core_;
};

}  // namespace ckpt
