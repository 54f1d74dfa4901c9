// Agent: the node agent's single-node life (DESIGN.md §5-§7).
//
// Owns the memory tier (Arena), the staging leases local trainers write into,
// the committed holdings and their records, the restore handles, and the
// background work: telling meta what was staged, checking every committed
// byte's crc32c before anything leaves the node, and running the tasks meta
// hands out (flush to the durable tier, commit a version's directory, evict,
// drop, delete). The gRPC services (src/server/rpc/agent_service.*) translate
// requests into these calls; ckpt-agent's main wires it all.
//
// Work happens in three loops, each a method that does one round and returns
// (so unit tests drive them deterministically with a FakeClock and a fake
// MetaLink, no threads), and that Start() runs on named threads:
//   ControlOnce  register / re-register, inventory, heartbeat, send queued
//                reports, expire leases and handles;
//   VerifyOnce   check the crcs of newly committed shards;
//   TasksOnce    run the highest-priority runnable task (retrying flush
//                failures with backoff, never blocking the loop on a sleep).
//
// Thread safety: every public method may be called from any thread.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/file_system.h"
#include "common/manifest.h"
#include "common/metrics.h"
#include "server/agent/arena.h"
#include "server/agent/meta_link.h"
#include "server/agent/peer_wire.h"
#include "transport/bulk.h"
#include "transport/transport.h"

namespace ckpt::agent {

struct AgentOptions {
  std::string node_id;
  std::string grpc_address;  // advertised to meta
  std::string data_address;  // advertised to meta
  std::string failure_domain;
  std::string memory_dir;
  uint64_t memory_bytes = 0;
  bool populate = true;       // pre-fault the pool (tests may skip)
  std::string durable_root;   // empty: no durable tier on this node
  int64_t default_lease_ttl_ms = 60000;
  int64_t default_handle_ttl_ms = 600000;
  int64_t flush_retry_initial_ms = 500;
  int64_t flush_retry_max_ms = 30000;
  int flush_max_tries = 8;     // per task attempt, then report the error
  uint64_t item_alignment_bytes = 64;
  // The peer data plane (replicas, EC stripes, remote restore). Not owned;
  // the agent calls Start on it with its own handler. nullptr: no data plane
  // (protection tasks fail with Unavailable, remote sources are skipped).
  transport::Transport* transport = nullptr;
  std::string data_listen_address;  // what the transport listens on
  transport::BulkOptions bulk;
  // How long a peer may take to acknowledge or answer one step of a transfer.
  int64_t peer_timeout_ms = 30000;
};

// A region of the pool file a client maps.
struct Region {
  std::string path;
  uint64_t file_offset = 0;
  uint64_t length = 0;
  uint64_t shard_offset = 0;
};

struct LeaseRequest {
  std::string job_id;
  uint64_t step = 0;
  uint32_t rank = 0;
  uint64_t size_bytes = 0;
  std::string run_id;
  uint32_t client_pid = 0;
  int64_t ttl_ms = 0;
};

struct LeaseGrant {
  std::string lease_id;
  std::vector<Region> regions;
  int64_t expires_in_ms = 0;
  uint64_t item_alignment_bytes = 0;
};

// What a committed shard looks like to callers.
struct ShardView {
  ShardRecord record;
  std::vector<Region> regions;
};

struct OpenResult {
  std::string handle_id;
  ShardView shard;
  bool verified = false;
  int64_t expires_in_ms = 0;
};

struct HoldingInfo {
  ShardId id;
  std::optional<SegmentId> segment;  // set for an EC segment holding
  int segment_kind = 0;
  int role = 1;
  int state = 2;  // ckpt.v1.CopyState
  uint64_t size_bytes = 0;
  uint32_t crc32c = 0;
  uint64_t manifest_digest = 0;
  int64_t stored_unix_ms = 0;
  std::string durable_path;
  bool verified = false;
};

struct FlushResult {
  uint32_t rank = 0;
  std::string durable_path;
  absl::Status status;
};

struct VerifyFinding {
  HoldingInfo holding;
  bool ok = true;
  uint32_t actual_crc32c = 0;
  std::string bad_item;
  std::string message;
};

struct AgentStatusSnapshot {
  std::string node_id;
  uint64_t incarnation = 0;
  bool registered = false;
  bool meta_reachable = false;
  int64_t last_heartbeat_unix_ms = 0;
  int64_t lease_remaining_ms = 0;
  int node_state = 0;
  int64_t uptime_ms = 0;
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t free_bytes = 0;
  uint64_t leased_bytes = 0;
  uint32_t open_leases = 0;
  uint32_t open_handles = 0;
  std::vector<HoldingInfo> holdings;
  uint32_t flush_pending_shards = 0;
  uint64_t flush_lag_bytes = 0;
  int64_t flush_lag_ms = 0;
  uint64_t flush_errors_total = 0;
  std::string last_flush_error;
  int64_t last_flush_error_unix_ms = 0;
  std::vector<RunningTask> running_tasks;
  std::string memory_dir;
  std::string durable_root;
  std::string pool_path;
  uint64_t pool_bytes = 0;
};

class Agent {
 public:
  // Opens the memory tier (re-adopting what a previous agent left) and sets
  // up metrics. `meta`, `clock`, `durable_fs` and `metrics` must outlive the
  // agent. Errors: the arena's (ResourceExhausted if the tmpfs is too small).
  static absl::StatusOr<std::unique_ptr<Agent>> Create(const AgentOptions& options, MetaLink* meta,
                                                       Clock* clock, FileSystem* durable_fs,
                                                       MetricsRegistry* metrics);
  ~Agent();  // calls Stop()

  // Starts the background threads (ckpt-agent-ctl, -vfy, -task, -watch).
  void Start();
  // Stops accepting background work, wakes and joins the threads. Idempotent.
  void Stop();

  // ---- save path ----
  // See AgentService.AcquireStagingLease. Blocks on meta only for the first
  // lease of a (job, step, run) on this node.
  absl::StatusOr<LeaseGrant> AcquireLease(const LeaseRequest& request);
  // See AgentService.CommitShard: validates, records, queues the STAGED report
  // and the background verification; never waits for meta. ALREADY_EXISTS
  // (with `*committed` filled) for a lease committed before.
  absl::StatusOr<ShardRecord> Commit(const std::string& lease_id, uint64_t size_bytes,
                                     std::vector<ManifestItem> items);
  absl::Status AbortLease(const std::string& lease_id);

  // ---- restore path ----
  // Opens a local VALID copy for reading. Unless skip_verify, checks every
  // item's crc first (DataLoss and the copy is quarantined on mismatch).
  // NotFound if not held here.
  absl::StatusOr<OpenResult> OpenShard(const ShardId& id, bool skip_verify, uint32_t client_pid,
                                       int64_t ttl_ms);
  // Materialises a shard from the durable tier (`durable_path` relative to
  // the root) as a RESTORED copy in the memory tier, checks it against
  // `expected` (size, crc32c; items are validated), records and reports it,
  // then opens it like OpenShard. If a VALID copy is already held, just opens
  // it. Errors: Unavailable (no durable root, I/O error), NotFound (file
  // missing), DataLoss (size or crc differs), ResourceExhausted (no room).
  absl::StatusOr<OpenResult> RestoreFromDurable(const ShardRecord& expected, const std::string& durable_path,
                                                uint32_t client_pid, int64_t ttl_ms);
  // Materialises a shard from a peer's VALID copy over the data plane as a
  // RESTORED copy (crc-checked chunk by chunk and as a whole), reports it and
  // opens it. Errors: Unavailable (no data plane, peer unreachable or died),
  // DataLoss (the peer's bytes do not match), ResourceExhausted, NotFound.
  absl::StatusOr<OpenResult> RestoreFromPeer(const ShardRecord& expected, const PeerEndpoint& holder,
                                             uint32_t client_pid, int64_t ttl_ms);
  // Rebuilds a shard from its owner's EC stripes: reads the owner's data
  // segments where they survive and decodes the rest from any k segments of
  // each stripe, then proceeds as RestoreFromPeer. DataLoss when fewer than k
  // segments of a stripe can be read correctly.
  absl::StatusOr<OpenResult> RestoreByDecode(const ShardRecord& expected, const EcDecodeSource& source,
                                             uint32_t client_pid, int64_t ttl_ms);
  absl::Status CloseShard(const std::string& handle_id);
  // Calls fn(data, len) over the shard bytes [offset, offset+length) while the
  // holding is pinned. NotFound / OutOfRange.
  absl::Status ReadShard(const ShardId& id, uint64_t offset, uint64_t length,
                         const std::function<absl::Status(const std::byte*, uint64_t)>& fn,
                         ShardRecord* record);

  // ---- inventory and commands ----
  std::vector<HoldingInfo> Inventory(const std::string& job_id, std::optional<uint64_t> step) const;
  // Writes this node's shards of a version now (see AgentService.Flush).
  absl::StatusOr<std::vector<FlushResult>> FlushNow(const std::string& job_id, uint64_t step,
                                                    const std::vector<uint32_t>& ranks);
  // Node-local eviction (AgentService.Evict): frees this node's holdings of a
  // version if meta's facts allow it: the version is PERSISTED, ABORTED or
  // DELETED, and it is not the job's newest version at PROTECTED level or
  // better. Reports each freed copy EVICTED. With dry_run, only checks and
  // lists. Errors: NotFound (nothing held here, or meta does not know the
  // version), FailedPrecondition (retention forbids it: the message says
  // why), Unavailable (meta unreachable: nothing is freed).
  absl::StatusOr<std::vector<HoldingInfo>> Evict(const std::string& job_id, uint64_t step, bool dry_run);
  absl::StatusOr<std::vector<VerifyFinding>> Verify(const std::string& job_id, uint64_t step,
                                                    bool dry_run, uint64_t* bytes_checked);
  AgentStatusSnapshot Status() const;

  // ---- loops (public for deterministic tests) ----
  void ControlOnce();
  // Returns true if it verified something.
  bool VerifyOnce();
  // Returns true if it ran a task (or a flush try).
  bool TasksOnce();
  // Queues tasks as if meta had sent them (the rpc layer's WatchTasks, tests).
  void EnqueueTasks(std::vector<AgentTask> tasks);

  const Arena& arena() const { return *arena_; }
  // The data plane address peers reach this agent on ("" without one).
  std::string data_address() const;

 private:
  class PeerHandler;
  friend class PeerHandler;
  struct Lease {
    std::string id;
    ShardId shard;
    uint64_t size_bytes = 0;
    std::vector<Extent> extents;
    std::string run_id;
    uint32_t client_pid = 0;
    absl::Time expires;
  };
  struct Holding {
    ShardRecord rec;
    bool corrupt = false;
    std::string corrupt_detail;  // why it was quarantined
    bool verified = false;
    bool staged_reported = false;
    int pins = 0;            // open handles and readers
    bool evict_pending = false;
    absl::Time committed_at;
  };
  struct Handle {
    std::string id;
    ShardId shard;
    uint32_t client_pid = 0;
    absl::Time expires;
  };
  // One message for meta, sent in order by the control loop: a report, or a
  // task result (which must follow the reports its task produced).
  struct Outbound {
    enum class Kind { kReport, kResult, kBegin };
    Kind kind = Kind::kReport;
    std::string run_id;  // kBegin (report.id names the version)
    HoldingReport report;
    std::string task_id;
    uint32_t attempt = 0;
    absl::Status result;
    uint64_t bytes = 0;
    int64_t duration_ms = 0;
  };
  struct QueuedTask {
    AgentTask task;
    absl::Time not_before;
    int tries = 0;
    size_t next_shard = 0;  // flush: shards before it are done
    uint64_t bytes_done = 0;
    absl::Time started;
    bool sends_done = false;  // ec_encode: this node's data segments are delivered
    absl::Time deadline = absl::InfiniteFuture();  // ec_encode: give up waiting for parity
  };
  // A segment held in the memory tier: parity, or a data segment rebuilt here.
  struct SegHolding {
    ShardRecord rec;  // rec.segment is set; size_bytes = unpadded length
    bool corrupt = false;
    int pins = 0;
    bool evict_pending = false;
  };
  // A data segment this node's blob provides (not a separate holding).
  struct OwnedSegment {
    uint64_t length_bytes = 0;
    uint32_t crc32c = 0;
    uint32_t data_k = 0;
    uint32_t blob_segment_index = 0;
  };
  // Sender side of a push.
  struct OutPut {
    transport::PeerId peer = 0;
    bool acked = false;
    absl::Status ack;
    bool done = false;
    absl::Status result;
  };
  // Receiver side of a push.
  struct InPut {
    PutBegin begin;
    std::string meta;  // kPutBegin payload (a shard record)
    ShardRecord rec;   // replica: the record being filled
    std::vector<Extent> extents;
    uint64_t received = 0;
    std::map<uint64_t, std::pair<uint32_t, uint64_t>> chunks;  // offset -> (crc, length)
    bool finishing = false;
  };
  // Parity being folded together on this node.
  struct ParityBuild {
    ShardRecord rec;  // segment record; extents hold the parity
    uint32_t data_k = 0;
    uint32_t parity_m = 0;
    uint64_t expect_mask = 0;
    std::map<uint32_t, uint64_t> folded;  // data position -> bytes folded
    std::set<uint32_t> receiving;         // data positions being pushed
    std::set<uint32_t> complete;          // data positions wholly folded
    bool needs_zeroing = false;           // set at creation, cleared once zeroed
    bool finished = false;
    absl::Status error;
  };
  // Requester side of a read.
  struct PendingRead {
    transport::PeerId peer = 0;
    transport::MutablePieces dest;
    uint64_t expected = 0;
    uint64_t received = 0;
    std::map<uint64_t, std::pair<uint32_t, uint64_t>> chunks;
    bool ended = false;
    absl::Status status;
    uint32_t end_crc = 0;
  };

  Agent(const AgentOptions& options, MetaLink* meta, Clock* clock, FileSystem* durable_fs,
        MetricsRegistry* metrics);
  absl::Status Init();

  std::vector<Region> RegionsFor(const std::vector<Extent>& extents, uint64_t size) const;
  std::string BudgetMessageLocked(uint64_t want) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeHoldingLocked(const ShardId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The holding if it is VALID and not being evicted; NotFound / DataLoss
  // (quarantined) otherwise.
  absl::StatusOr<Holding*> ValidHoldingLocked(const ShardId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops a pin; frees the holding if it was evicted while pinned.
  void UnpinLocked(const ShardId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void QuarantineLocked(Holding& h, const std::string& detail) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t LeasedBytesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  HoldingInfo InfoLocked(const Holding& h) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void QueueReportLocked(HoldingReport report) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EnqueueTasksLocked(std::vector<AgentTask> tasks) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checks every item crc and the shard crc of a holding's bytes. OK, or
  // DataLoss naming the item.
  absl::Status CheckBytes(const ShardRecord& rec, uint32_t* actual_crc, std::string* bad_item) const;
  uint32_t RangeCrc(const std::vector<Extent>& extents, uint64_t offset, uint64_t length) const;

  void Register();
  void SendReports();
  // Sends a queued BeginVersion; false if it must be retried later.
  bool SendBegin(const Outbound& begin);
  void Heartbeat();
  void SendInventory();
  absl::Status RunTaskStep(QueuedTask& qt, bool* finished);
  absl::Status FlushOne(const std::string& task_id, const FlushOrder& order, const std::string& job,
                        uint64_t step, uint64_t* bytes);
  void RecordFlushError(const absl::Status& s);
  void RecordFlushErrorLocked(const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateGauges();
  void Loop(const char* name, absl::Duration idle, bool (Agent::*once)());
  bool ControlRound();
  void WatchLoop();

  // ---- data plane (peer.cc) ----
  absl::Status StartDataPlane();
  absl::StatusOr<transport::PeerId> PeerFor(const PeerEndpoint& ep);
  void SendMessage(transport::PeerId peer, uint16_t type, std::string header, transport::ConstPieces payload = {});
  absl::StatusOr<transport::MutablePieces> OnAllocate(const transport::Inbound& msg);
  void OnMessage(const transport::Inbound& msg, const absl::Status& status);
  void OnPeerFailed(transport::PeerId peer, const absl::Status& why);
  void HandlePutBegin(const transport::Inbound& msg, const absl::Status& status);
  void HandlePutChunk(const transport::Inbound& msg, const absl::Status& status);
  void FinishPut(transport::PeerId from, uint64_t xfer);
  void ServeRead(transport::PeerId from, ReadReq req);
  // Pushes `source` to each target as `begin` describes (ack, chunks, done).
  // One status per target.
  // `customize` adjusts the begin message per target (e.g. its parity position).
  std::vector<absl::Status> Push(const std::vector<PeerEndpoint>& targets, PutBegin begin,
                                 const std::string& meta, const transport::ConstPieces& source,
                                 const std::function<void(size_t, PutBegin&)>& customize = nullptr);
  // Reads [req.offset, +req.length) of a peer's shard or segment into `dest`
  // (exactly req.length bytes), checking every chunk's crc. Returns the crc
  // of the bytes read.
  absl::StatusOr<uint32_t> ReadFromPeer(const PeerEndpoint& ep, ReadReq req, transport::MutablePieces dest);
  // ReadFromPeer in two halves, so several reads can be in flight.
  absl::StatusOr<uint64_t> StartRead(const PeerEndpoint& ep, ReadReq req, transport::MutablePieces dest);
  absl::StatusOr<uint32_t> FinishRead(uint64_t id, const std::string& node_id);
  // Pieces of a version's blob on this node (its primaries in rank order),
  // pinning them; the caller unpins with UnpinBlobLocked.
  absl::StatusOr<transport::ConstPieces> BlobPiecesLocked(const std::string& job, uint64_t step,
                                                          std::vector<ShardId>* pinned, uint64_t* size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnpinAllLocked(const std::vector<ShardId>& ids) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  transport::ConstPieces PiecesOf(const std::vector<Extent>& extents, uint64_t offset, uint64_t length) const;
  transport::MutablePieces MutablePiecesOf(const std::vector<Extent>& extents, uint64_t offset,
                                           uint64_t length) const;
  // Stores a restored copy's bytes (already in `extents`, crc-checked) as a
  // RESTORED holding, records and reports it. Frees the extents on error.
  absl::Status AdoptRestoredLocked(const ShardRecord& expected, std::vector<Extent> extents,
                                   const std::string& durable_path, const std::string& source)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Room in the memory tier for a shard being restored (its manifest checked).
  absl::StatusOr<std::vector<Extent>> ReserveForRestore(const ShardRecord& expected);
  // Keeps the fetched bytes as a RESTORED copy and opens it, or frees them
  // and returns why the fetch failed.
  absl::StatusOr<OpenResult> FinishPeerRestore(const ShardRecord& expected, std::vector<Extent> extents,
                                               const absl::Status& fetched, const std::string& source,
                                               uint32_t client_pid, int64_t ttl_ms);
  absl::Status StoreSegmentLocked(ShardRecord rec, const std::string& task_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeSegmentLocked(const SegmentId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ParityBuild* ParityBuildLocked(const PutBegin& b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishParityLocked(const SegmentId& id, ParityBuild& pb) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RunReplicate(QueuedTask& qt, bool* finished);
  absl::Status RunEcEncode(QueuedTask& qt, bool* finished);
  absl::Status RunRebuild(QueuedTask& qt);
  static ReadReq SegmentReadReq(const SegmentLocation& loc, uint32_t data_k, uint32_t blob_segment_index,
                                uint64_t offset, uint64_t length);
  // Rebuilds bytes [offset, offset + size of out) of fragment `position` of
  // a stripe into `out`, reading only that range of k readable sources (in
  // parallel). DataLoss, listing why, when fewer than k can be read.
  absl::Status DecodeRange(const std::vector<SegmentLocation>& sources, uint32_t data_k, uint32_t parity_m,
                           uint64_t stripe_bytes, uint32_t position, uint64_t offset,
                           const transport::MutablePieces& out);
  void QueueSegmentReportLocked(const SegmentId& id, int kind, int state, uint64_t length, uint32_t crc,
                                const std::string& task_id, const std::string& detail)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PostWork(std::function<void()> fn);
  void WorkLoop();

  const AgentOptions options_;
  MetaLink* const meta_;
  Clock* const clock_;
  FileSystem* const durable_fs_;
  std::unique_ptr<Arena> arena_;
  const absl::Time started_;

  // Metrics (owned by the registry).
  Counter* m_staged_bytes_;
  Counter* m_staged_shards_;
  Counter* m_flush_bytes_;
  Counter* m_flush_shards_;
  Counter* m_flush_errors_;
  Counter* m_corrupt_;
  Counter* m_lease_rejected_;
  Counter* m_meta_errors_;
  Counter* m_peer_sent_bytes_;
  Counter* m_peer_received_bytes_;
  Counter* m_replicas_stored_;
  Counter* m_parity_stored_;
  Counter* m_segments_rebuilt_;
  Counter* m_peer_restores_;
  Counter* m_peer_errors_;
  Gauge* m_used_;
  Gauge* m_free_;
  Gauge* m_leased_;
  Gauge* m_capacity_;
  Gauge* m_flush_lag_bytes_;
  Gauge* m_flush_lag_seconds_;
  Gauge* m_holdings_;
  Gauge* m_registered_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t wake_ ABSL_GUARDED_BY(mu_) = 0;  // bumped to wake the loops
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, Lease> leases_ ABSL_GUARDED_BY(mu_);
  std::map<ShardId, std::string> lease_of_shard_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, ShardId> committed_leases_ ABSL_GUARDED_BY(mu_);
  std::map<ShardId, Holding> holdings_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Handle> handles_ ABSL_GUARDED_BY(mu_);
  // (job, step, run_id) -> world size, for versions begun at meta.
  std::map<std::tuple<std::string, uint64_t, std::string>, uint32_t> begun_ ABSL_GUARDED_BY(mu_);
  // World size of jobs this agent has begun versions of: a new step of a
  // known job is begun at meta in the background, off the trainer's path.
  std::map<std::string, uint32_t> job_world_ ABSL_GUARDED_BY(mu_);
  std::deque<ShardId> verify_queue_ ABSL_GUARDED_BY(mu_);
  std::deque<Outbound> outbox_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, QueuedTask> tasks_ ABSL_GUARDED_BY(mu_);  // by task id
  std::set<std::string> finished_tasks_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> running_now_ ABSL_GUARDED_BY(mu_);
  std::map<ShardId, absl::Time> flush_waiting_ ABSL_GUARDED_BY(mu_);  // wanted, not yet durable

  // Meta session (control thread writes; others read under mu_).
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  bool inventory_due_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t incarnation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t previous_incarnation_ ABSL_GUARDED_BY(mu_) = 0;
  bool meta_reachable_ ABSL_GUARDED_BY(mu_) = false;
  int node_state_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t heartbeat_ms_ ABSL_GUARDED_BY(mu_) = 1000;
  int64_t lease_ms_ ABSL_GUARDED_BY(mu_) = 5000;
  absl::Time next_heartbeat_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time next_register_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time lease_valid_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t last_heartbeat_unix_ms_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t flush_errors_total_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_flush_error_ ABSL_GUARDED_BY(mu_);
  int64_t last_flush_error_unix_ms_ ABSL_GUARDED_BY(mu_) = 0;

  std::vector<std::thread> threads_;

  // Data plane state (under mu_). Transport callbacks never block on mu_ for
  // long and nothing calls into the transport while holding mu_.
  std::unique_ptr<transport::Handler> peer_handler_;
  bool data_plane_started_ = false;
  std::map<std::string, transport::PeerId> peer_by_address_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::pair<absl::Time, absl::Status>> failed_connects_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, OutPut> out_puts_ ABSL_GUARDED_BY(mu_);  // by xfer id
  std::map<std::pair<transport::PeerId, uint64_t>, InPut> in_puts_ ABSL_GUARDED_BY(mu_);
  std::map<SegmentId, ParityBuild> parity_builds_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, PendingRead> reads_ ABSL_GUARDED_BY(mu_);  // by request id
  std::map<SegmentId, SegHolding> segments_ ABSL_GUARDED_BY(mu_);
  std::map<SegmentId, OwnedSegment> owned_segments_ ABSL_GUARDED_BY(mu_);
  // Scratch chunk buffers for EC data arriving at a parity holder (reused).
  std::vector<std::vector<std::byte>> scratch_free_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<transport::PeerId, std::pair<uint64_t, uint64_t>>, std::vector<std::byte>> scratch_used_
      ABSL_GUARDED_BY(mu_);
  std::deque<std::function<void()>> work_ ABSL_GUARDED_BY(mu_);
  uint64_t next_xfer_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace ckpt::agent
