// PeerClient: this node as the sender of pushes (replicas, EC data
// segments) and the reader of peers' copies and segments (restores, decodes,
// rebuilds).
//
// Timeouts. Every wait is bounded by --peer-timeout-ms *of no progress*: an
// acknowledgement that does not come, a read whose next chunk does not come.
// A push that times out tells the receiver to let go of what it reserved
// (kPutAbort). Every wait also ends at Stop().
//
// Memory. A read lands in memory the caller owns (`dest`) and keeps alive by
// handing the read a reference (`keep_alive`). A read that ends early (timeout,
// error, abandoned for a faster source) may still have payloads in flight
// that the transport will write into `dest` later; the PeerClient keeps the
// reference until every such payload has landed, so the caller may drop its
// own reference at once, but must not reuse `dest` for anything else.
//
// Threads: Push, StartRead, FinishRead, AwaitAny, Abandon, Cancel and
// LastChunk block or may be
// called from any thread except a transport callback; the PeerFlows methods
// run on the transport's thread and never block.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/agent/agent_metrics.h"
#include "server/agent/data_plane.h"
#include "server/agent/peer_wire.h"
#include "transport/bulk.h"

namespace ckpt::agent {

class PeerClient : public PeerFlows {
 public:
  struct Options {
    int64_t peer_timeout_ms = 30000;
    transport::BulkOptions bulk;
    // Who this node is, stated in every push and read (receivers check it
    // against meta's membership, membership.h).
    std::string node_id;
    std::function<uint64_t()> incarnation;
  };
  PeerClient(DataPlane* plane, Clock* clock, AgentMetrics* metrics, Options options);

  // Pushes `source` to each target as `begin` describes (begin, ack, chunks,
  // done); `customize` adjusts the begin message per target (e.g. its parity
  // position). One status per target: OK when the target stored it (or
  // already held it), its refusal, Unavailable when it cannot be reached or
  // died, DeadlineExceeded when it stopped answering. `meta` and `source`
  // must stay valid until Push returns.
  std::vector<absl::Status> Push(const std::vector<PeerEndpoint>& targets, PutBegin begin, const std::string& meta,
                                 const transport::ConstPieces& source,
                                 const std::function<void(size_t, PutBegin&)>& customize = nullptr);

  // Starts reading [req.offset, +req.length) of a peer's shard or segment into
  // `dest` (exactly req.length bytes). Returns the read's id. A new
  // connection to the peer is given `connect_timeout_ms` (0: the plane's;
  // DataPlane::PeerFor).
  absl::StatusOr<uint64_t> StartRead(const PeerEndpoint& ep, ReadReq req, transport::MutablePieces dest,
                                     std::shared_ptr<void> keep_alive, int64_t connect_timeout_ms = 0);
  // Waits for a read to end and forgets it. Returns the crc32c of the bytes
  // read (every chunk's and the whole's crc checked), or why it failed:
  // DeadlineExceeded (no progress within the peer timeout), DataLoss (bad
  // bytes), the holder's error, Unavailable (peer died), Cancelled (Stop).
  absl::StatusOr<uint32_t> FinishRead(uint64_t id);
  // Waits until one of `ids` has ended (successfully or not) or `until`
  // passes. Returns the id that ended, or 0.
  uint64_t AwaitAny(const std::vector<uint64_t>& ids, absl::Time until);
  // Forgets a read whose result is no longer wanted.
  void Abandon(uint64_t id);
  // Ends a read at once with `why` (its FinishRead returns it); payloads in
  // flight still land, as after any early end. No-op for an ended or
  // unknown read.
  void Cancel(uint64_t id, const absl::Status& why);
  // When a chunk of a read last landed (absl::InfinitePast() before the
  // first); nullopt for an ended or unknown read.
  std::optional<absl::Time> LastChunk(uint64_t id) const;
  // StartRead + FinishRead.
  absl::StatusOr<uint32_t> Read(const PeerEndpoint& ep, ReadReq req, transport::MutablePieces dest,
                                std::shared_ptr<void> keep_alive);

  // Ends every wait (Cancelled). Idempotent.
  void Stop();
  // Payloads still expected to land in memory of ended reads (for tests).
  size_t landings() const;

  // PeerFlows (transport thread)
  absl::StatusOr<transport::MutablePieces> Allocate(const transport::Inbound& msg) override;
  void OnReceived(const transport::Inbound& msg, const absl::Status& status) override;
  void OnPeerFailed(transport::PeerId peer, const absl::Status& why) override;

 private:
  struct OutPut {
    transport::PeerId peer = 0;
    bool acked = false;
    absl::Status ack;
    bool done = false;
    absl::Status result;
  };
  struct PendingRead {
    transport::PeerId peer = 0;
    std::string node_id;
    transport::MutablePieces dest;
    std::shared_ptr<void> keep_alive;
    uint64_t expected = 0;
    uint64_t received = 0;
    std::map<uint64_t, std::pair<uint32_t, uint64_t>> chunks;  // offset -> (crc, length)
    bool ended = false;
    absl::Status status;
    uint32_t end_crc = 0;
    absl::Time last_progress;
    absl::Time last_chunk = absl::InfinitePast();
  };
  // Ends reads among `ids` that made no progress for the peer timeout;
  // returns the earliest time another may stall.
  absl::Time ExpireStalledLocked(const std::vector<uint64_t>& ids) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool EndedLocked(uint64_t id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for `cond` up to the peer timeout from now (or Stop). False on timeout or stop.
  bool AwaitLocked(const std::function<bool()>& cond) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnAck(const transport::Inbound& msg, bool done);
  void OnReadChunk(const transport::Inbound& msg, const absl::Status& status);
  void OnReadEnd(const transport::Inbound& msg);

  DataPlane* const plane_;
  Clock* const clock_;
  AgentMetrics* const metrics_;
  const Options options_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, OutPut> out_puts_ ABSL_GUARDED_BY(mu_);  // by xfer id
  std::map<uint64_t, PendingRead> reads_ ABSL_GUARDED_BY(mu_);
  // Read payloads the transport is writing: (read id, offset) -> keep-alive
  // of the memory they land in.
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<void>> landings_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::agent
