// Restorer: opens a shard for a local client, from the local memory tier or,
// when this node has no good copy, from the sources meta's Locate listed, in
// order: a peer's replica (read over the data plane), a decode from the
// owner's EC stripes, the durable tier. docs/agent.md "Restore path".
//
// A restored shard is built in a fresh Reservation, checked against the
// expected crc32c (every chunk of a peer read is checked as it lands, and the
// whole at the end), recorded and reported as a RESTORED copy, and then opened
// like a local one. A failed source costs only its Reservation (freed once
// no transfer can still write into it) and is listed with its error.
//
// Thread safety: every method may be called from any thread (gRPC handlers);
// they block on peers and files.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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
  ShardView shard;
  bool verified = false;
  int64_t expires_in_ms = 0;
  // A local copy of a version meta said is restorable (Agent::Open only).
  bool version_staged = false;
};

// Where a shard may be restored from (ckpt.v1.ShardSource).
struct ShardSource {
  enum class Kind { kLocal, kReplica, kEcDecode, kDurable };
  Kind kind = Kind::kLocal;
  PeerEndpoint holder;        // kReplica
  EcDecodeSource ec;          // kEcDecode
  std::string durable_path;   // kDurable, relative to the durable root
};
const char* SourceKindName(ShardSource::Kind kind);

struct OpenRequest {
  ShardId id;
  bool skip_verify = false;
  ClientRef client;
  int64_t ttl_ms = 0;
  // Not 0: a local copy larger than this is not verified here (the caller,
  // a client session's single request thread, must not stall on GiBs):
  // Unavailable, and the client asks over gRPC.
  uint64_t verify_at_most_bytes = 0;
  // The shard's size, crc and items from Locate; required with sources.
  std::optional<ShardRecord> expected;
  std::vector<ShardSource> sources;
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
    FileSystem* durable_fs;
    std::string durable_root;
    Clock* clock;
    AgentMetrics* metrics;
    int64_t default_handle_ttl_ms = 600000;
    std::function<std::string(uint64_t bytes)> budget_message;
  };
  explicit Restorer(Deps deps);

  // A local VALID copy, opened (pinned) for the client; unless skip_verify,
  // every item's crc is checked first (DataLoss and quarantine on a
  // mismatch). NotFound if not held here.
  absl::StatusOr<OpenResult> OpenLocal(const ShardId& id, bool skip_verify, const ClientRef& client, int64_t ttl_ms,
                                       uint64_t verify_at_most_bytes = 0);
  // The local copy, else each source in order. With sources, DataLoss listing
  // every failed source when none worked; InvalidArgument when `expected` is
  // missing; DataLoss when the copy found differs from `expected`.
  absl::StatusOr<OpenOutcome> Open(const OpenRequest& req);

  // One source each (also used by tests). If a VALID copy is already held
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
  absl::StatusOr<ReservationPtr> ReserveFor(const ShardRecord& expected);
  // Keeps verified restored bytes as a RESTORED copy (reported to meta) and
  // opens it.
  absl::StatusOr<OpenResult> Adopt(const ShardRecord& expected, ReservationPtr bytes, const std::string& durable_path,
                                   const std::string& source, const ClientRef& client, int64_t ttl_ms);

  const Deps d_;
};

}  // namespace ckpt::agent
