// PeerServer: this node as the receiver of peers' pushes (replicas, EC data
// segments folded into parity here) and as the holder that serves peers'
// reads of its copies and segments.
//
// Memory. A replica push lands in a Reservation the push owns until it is
// stored as a holding; EC data lands in reused scratch buffers and is folded
// into the ParityBuilder's parity. Every payload the transport is writing
// holds a reference to the memory it lands in, so a push dropped mid-transfer
// (sender gave up, sender died, no progress for the peer timeout) frees its
// space only after its last payload has landed.
//
// Threads: the PeerFlows methods run on the transport's thread and never
// block (crc and folds of one chunk run there, outside the lock). Admitting
// a push (parsing its record, reserving, zeroing a new parity) and storing a
// finished one (record write, report to meta, then the acknowledgement) run
// on the `finish` executor, serving reads on the `serve` executor: separate
// bounded pools, so slow readers never delay pushes and a full queue is
// answered "busy" instead of growing without bound.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/agent/agent_metrics.h"
#include "server/agent/data_plane.h"
#include "common/executor.h"
#include "server/agent/holdings.h"
#include "server/agent/membership.h"
#include "server/agent/meta_session.h"
#include "server/agent/parity_builder.h"
#include "server/agent/peer_wire.h"
#include "transport/bulk.h"

namespace ckpt::agent {

class PeerServer : public PeerFlows {
 public:
  struct Options {
    std::string node_id;
    int64_t peer_timeout_ms = 30000;
    transport::BulkOptions bulk;
    int serve_threads = 2;
    int finish_threads = 2;
    size_t max_queued = 1024;
  };
  struct Deps {
    DataPlane* plane;
    HoldingTable* holdings;
    ParityBuilder* parity;
    MetaSession* session;
    Arena* arena;
    Clock* clock;
    AgentMetrics* metrics;
    std::function<uint64_t()> incarnation;
    // Why `bytes` do not fit (for ResourceExhausted answers).
    std::function<std::string(uint64_t bytes)> budget_message;
    // When set, pushes and reads are served only to the nodes it admits
    // (meta's members with their current incarnation); a refusal is the
    // answer to the push or read. Null: anyone with the transport's key.
    PeerMembership* membership = nullptr;
  };
  PeerServer(Deps deps, Options options);
  ~PeerServer() override;

  // Drops incoming pushes that made no progress for the peer timeout (the
  // sender is told). Returns how many.
  int Expire();
  // Refuses new work and drains the executors. Call after the transport
  // stopped (so waits on it end). Idempotent.
  void Stop();
  size_t receiving() const;

  // PeerFlows (transport thread)
  absl::StatusOr<transport::MutablePieces> Allocate(const transport::Inbound& msg) override;
  void OnReceived(const transport::Inbound& msg, const absl::Status& status) override;
  void OnPeerFailed(transport::PeerId peer, const absl::Status& why) override;

 private:
  struct InPut {
    PutBegin begin;
    ShardRecord rec;       // replica: the record being filled
    ReservationPtr bytes;  // replica: where it lands
    uint64_t received = 0;
    std::map<uint64_t, std::pair<uint32_t, uint64_t>> chunks;  // offset -> (crc, length)
    bool finishing = false;
    absl::Time last_progress;
  };
  // A payload being written by the transport: what keeps its memory alive.
  struct Landing {
    ReservationPtr bytes;                          // replica chunk
    std::shared_ptr<std::vector<std::byte>> scratch;  // EC chunk, or a begin's record
  };
  using PushKey = std::pair<transport::PeerId, uint64_t>;  // (sender, xfer)

  void OnPutBegin(const transport::Inbound& msg, const absl::Status& status);
  void OnPutChunk(const transport::Inbound& msg, const absl::Status& status);
  void OnPutAbort(const transport::Inbound& msg);
  void OnReadReq(const transport::Inbound& msg);
  // OK if the sender on connection `from` may speak for `node_id` (its
  // proven identity, DataPlane::CheckSender) and the membership (when set)
  // admits it; counts and logs a refusal.
  absl::Status AdmitSender(transport::PeerId from, const std::string& node_id, uint64_t incarnation);
  // Validates a push from `from` and reserves for it; the InPut on success.
  absl::StatusOr<InPut> Check(transport::PeerId from, const PutBegin& b, const std::string& record);
  // On the finish executor: checks, registers and acknowledges a push.
  void Admit(const PushKey& key, const PutBegin& b, std::shared_ptr<std::vector<std::byte>> record,
             const absl::Status& status);
  // Drops a push (its landings keep their memory) and tells the parity.
  void DropPush(const PushKey& key, const absl::Status& why);
  void FinishPut(transport::PeerId from, uint64_t xfer);
  void ServeRead(transport::PeerId from, ReadReq req);
  std::shared_ptr<std::vector<std::byte>> TakeScratch(uint64_t size);
  void ReturnScratch(std::shared_ptr<std::vector<std::byte>> buf);

  const Deps d_;
  const Options options_;
  Executor finish_;
  Executor serve_;

  mutable absl::Mutex mu_;
  std::map<PushKey, InPut> in_puts_ ABSL_GUARDED_BY(mu_);
  std::set<PushKey> admitting_ ABSL_GUARDED_BY(mu_);  // begun, being admitted
  std::map<std::tuple<transport::PeerId, uint64_t, uint64_t>, Landing> landings_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<std::vector<std::byte>>> scratch_free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::agent
