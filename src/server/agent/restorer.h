// Restorer: opens a shard for a local client, from the local memory tier or,
// when this node has no good copy, from the sources meta's Locate listed, in
// order: a peer's replica (read over the data plane), a decode from the
// owner's EC stripes, the durable tier. docs/agent.md "Restore path".
//
// Only what meta placed is read (docs/security.md): the caller names the
// sources it wants tried, but before reading any of them the restorer asks
// meta itself (MetaLink::Locate, once per open) and uses meta's version of
// each named source that meta lists for that job/step/rank (its holder
// endpoint, its EC layout, its durable path) and meta's record of the shard
// (size, crc32c, items) to check the bytes. A named source meta does not
// list is refused (PermissionDenied) without being touched; the caller's
// `expected` never decides what is read or what the bytes are checked
// against. Errors returned to the caller state nothing about bytes it could
// not read (no size or crc32c of a file or a peer's copy): those details go
// to the agent's log.
//
// A restored shard is built in a fresh Reservation, checked against the
// expected crc32c (every chunk of a peer read is checked as it lands, and the
// whole at the end), recorded and reported as a RESTORED copy, and then opened
// like a local one. A failed source costs only its Reservation (freed once
// no transfer can still write into it) and is listed with its error.
//
// Hedging. With an executor for the attempts (Deps::races), a peer's replica
// that has sent nothing for `hedge_after` (before its first byte, or in the
// middle of the read: a stopped or overloaded holder) does not hold the
// restore up to the peer timeout: the next source is read beside it (and a
// new connection to such a holder is given up after `hedge_after` while
// another source is left), and the
// first to deliver a verified shard serves the open. The others are
// cancelled (a peer read at once; a decode or durable read runs to its end
// and its bytes are dropped, as its handle if it opened one). Decodes hedge
// their own stripe reads (reconstructor.h); a decode or durable read is not
// raced. Without an executor (or when it is full) sources are read one
// after another.
//
// Thread safety: every method may be called from any thread (gRPC handlers);
// they block on peers and files.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/file_system.h"
#include "server/agent/agent_metrics.h"
#include "common/executor.h"
#include "server/agent/holdings.h"
#include "server/agent/leases.h"
#include "server/agent/meta_session.h"
#include "server/agent/peer_client.h"
#include "server/agent/reconstructor.h"

namespace ckpt::agent {

// What a committed shard looks like to callers.
struct ShardView {
  std::shared_ptr<const ShardRecord> record;  // the held record, shared (never null)
  std::vector<Region> regions;
};

struct OpenResult {
  std::string handle_id;
  // With OpenRequest::ranges served from a peer (ranges_only): a record of
  // the ranges alone (size_bytes their total, crc32c theirs, no items) and
  // the regions of their bytes, back to back in the order asked.
  ShardView shard;
  bool ranges_only = false;
  bool verified = false;
  int64_t expires_in_ms = 0;
  // A local copy of a version meta said is restorable (Agent::Open only).
  bool version_staged = false;
};

// (ShardSource, a restore source: meta_link.h.)
const char* SourceKindName(ShardSource::Kind kind);

// Bytes [offset, offset + length) of a shard.
struct ByteRange {
  uint64_t offset = 0;
  uint64_t length = 0;
};
// At most this many ranges in one open.
inline constexpr size_t kMaxOpenRanges = 4096;

struct OpenRequest {
  ShardId id;
  bool skip_verify = false;
  ClientRef client;
  int64_t ttl_ms = 0;
  // Not 0: a local copy larger than this is not verified here (the caller,
  // a client session's single request thread, must not stall on GiBs):
  // Unavailable, and the client asks over gRPC.
  uint64_t verify_at_most_bytes = 0;
  // What the caller believes the shard is (from its own Locate). Only a
  // local copy is checked against it (DataLoss if it differs); a restore
  // from a source is checked against meta's record, never this.
  std::optional<ShardRecord> expected;
  // The sources the caller wants tried, in order; each must be one meta's
  // Locate lists for `id` (else it is refused and listed as failed).
  std::vector<ShardSource> sources;
  // Not empty: the caller needs only these bytes of the shard (a slice of a
  // global tensor). A peer's replica then sends only them (its holder
  // checks its whole copy against the shard's crc32c first, once: the bytes
  // sent are the saved ones) into a fresh reservation that only the handle
  // keeps (no copy is recorded here); the local copy, a decode and the
  // durable tier serve the whole shard as without ranges. So does a peer
  // once the ranges read of the shard here (this open's included) would
  // pass half its size: the node's ranks that need overlapping parts (data-
  // parallel ranks needing the same slice) then share one RESTORED copy
  // instead of each pulling its parts, and no node pulls more than about
  // 1.5 times the shard. Each range must be non-empty and inside meta's
  // record of the shard, the ranges in increasing order and apart (so they
  // never add up to more than the shard), at most kMaxOpenRanges of them
  // (InvalidArgument).
  std::vector<ByteRange> ranges;
};

struct SourceAttempt {
  size_t index = 0;  // into OpenRequest::sources
  absl::Status status;
};

struct OpenOutcome {
  OpenResult result;
  std::optional<size_t> served_by;  // index into sources; nullopt: the local copy
  std::vector<SourceAttempt> failed;
};

class Restorer {
 public:
  struct Deps {
    HoldingTable* holdings;
    LeaseTable* leases;
    PeerClient* peers;  // null without a data plane
    Reconstructor* reconstructor;
    Executor* stripes;
    Arena* arena;
    MetaSession* session;
    // Asked where a shard lives before any source but the local copy is
    // read (Locate). Not owned; thread-safe.
    MetaLink* meta;
    std::string node_id;  // this node's, as near_node_id of Locate
    FileSystem* durable_fs;
    std::string durable_root;
    Clock* clock;
    AgentMetrics* metrics;
    int64_t default_handle_ttl_ms = 600000;
    std::function<std::string(uint64_t bytes)> budget_message;
    // Where the sources of one open are read concurrently (see Hedging);
    // null: one after another. Not owned; stopped by the owner before the
    // Restorer is destroyed (after the PeerClient, which ends its reads).
    Executor* races = nullptr;
    absl::Duration hedge_after = absl::Seconds(1);
  };
  explicit Restorer(Deps deps);

  // A local VALID copy, opened (pinned) for the client; unless skip_verify,
  // every item's crc is checked first (DataLoss and quarantine on a
  // mismatch). NotFound if not held here.
  absl::StatusOr<OpenResult> OpenLocal(const ShardId& id, bool skip_verify, const ClientRef& client, int64_t ttl_ms,
                                       uint64_t verify_at_most_bytes = 0);
  // The local copy, else each source in order (asking meta first, see the
  // file comment; no meta call when the local copy serves). Errors: the local
  // copy's (NotFound, DataLoss) when no other source was named; Unavailable
  // when meta cannot be asked; PermissionDenied when meta lists no readable
  // copy of the shard or none of the named sources; DataLoss listing every
  // failed source when none worked; DataLoss when the local copy differs from
  // `expected`. Blocks on meta, peers and files.
  absl::StatusOr<OpenOutcome> Open(const OpenRequest& req);

  // One source each, trusted as given (the caller checked it with meta; also
  // used by tests). If a VALID copy is already held
  // (or quarantined) here, that decides. Errors: Unavailable (no data plane or
  // durable tier, peer unreachable or dead, I/O error), DataLoss (bytes do not
  // match), ResourceExhausted (no room), NotFound.
  absl::StatusOr<OpenResult> FromPeer(const ShardRecord& expected, const PeerEndpoint& holder,
                                      const ClientRef& client, int64_t ttl_ms);
  absl::StatusOr<OpenResult> ByDecode(const ShardRecord& expected, const EcDecodeSource& source,
                                      const ClientRef& client, int64_t ttl_ms);
  absl::StatusOr<OpenResult> FromDurable(const ShardRecord& expected, const std::string& durable_path,
                                         const ClientRef& client, int64_t ttl_ms);

 private:
  struct Attempt;
  struct Race;
  // Reads source `src` (one meta vouched for) for `race` on this thread and
  // records the outcome (restorer.cc).
  void RunAttempt(const std::shared_ptr<Race>& race, Attempt* attempt);
  absl::StatusOr<OpenResult> ReadSource(const ShardSource& src, const ShardRecord& expected, const ClientRef& client,
                                        int64_t ttl_ms, const std::shared_ptr<Race>& race, Attempt* attempt);
  absl::StatusOr<OpenResult> FromPeerFor(const ShardRecord& expected, const PeerEndpoint& holder,
                                         const ClientRef& client, int64_t ttl_ms, const std::shared_ptr<Race>& race,
                                         Attempt* attempt);
  // The race's ranges from `holder`, one read each, into one reservation
  // that the handle alone keeps (ranges_only).
  absl::StatusOr<OpenResult> RangesFromPeer(const PeerEndpoint& holder, const std::shared_ptr<Race>& race,
                                            Attempt* attempt);
  // Meta's Locate for `id`, with the caller-facing error when it fails
  // (meta's own message goes to the log).
  absl::StatusOr<LocatedShard> AskMeta(const ShardId& id, const std::vector<ShardSource>& named);
  absl::StatusOr<ReservationPtr> ReserveFor(const ShardRecord& expected);
  // Keeps verified restored bytes as a RESTORED copy (reported to meta) and
  // opens it.
  absl::StatusOr<OpenResult> Adopt(const ShardRecord& expected, ReservationPtr bytes, const std::string& durable_path,
                                   const std::string& source, const ClientRef& client, int64_t ttl_ms);

  const Deps d_;
  // Bytes read as ranges per shard (OpenRequest::ranges), until they pass
  // half of it; forgotten oldest first beyond kMaxRangedShards shards.
  static constexpr size_t kMaxRangedShards = 4096;
  absl::Mutex ranged_mu_;
  std::map<ShardId, uint64_t> ranged_bytes_ ABSL_GUARDED_BY(ranged_mu_);
  std::deque<ShardId> ranged_order_ ABSL_GUARDED_BY(ranged_mu_);
};

}  // namespace ckpt::agent
