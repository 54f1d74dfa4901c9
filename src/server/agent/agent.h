// Agent: the node agent (docs/architecture.md "ckpt-agent"), wired from components that each
// own their state and lock (docs/agent.md "Components"):
//
//   Arena          the memory tier; Reservations own pool space
//   HoldingTable   copies and segments held, pins, quarantine, verify queue
//   LeaseTable     staging leases and open client handles
//   MetaSession    registration, heartbeats, inventory, the ordered outbox
//   TaskRunner     meta's tasks, priorities, retries
//   Flusher        the durable tier
//   DataPlane      transport, connections, routing of peer messages
//   PeerServer     pushes received here, reads served from here
//   PeerClient     pushes sent and reads made from here
//   ParityBuilder  EC parity folded here
//   Reconstructor  stripe ranges read or decoded from peers (hedged)
//   Protector      replicate / EC encode / rebuild tasks
//   Restorer       opening shards: local, replica, decode, durable
//   Verifier       background crc checks, quarantine, Verify, eviction checks
//   Ingest         the save path: leases taken, commits validated, pulls,
//                  references checked, refused shards stored self-contained
//
// The Agent itself only wires them, translates calls (and meta's callbacks,
// MetaSession::Delegate; meta's tasks, by kind) to them, and runs the loops
// (control, verify, tasks, task stream) on named threads that Stop() joins.
// It keeps no state but its components and the loops' stop flag.
// Lock order: no component calls another while holding its own lock (hooks
// and callbacks run after it is released); the arena's lock is the only one
// taken under another (a Reservation freed when a pin or an entry goes).
// The rpc layer (src/server/rpc/agent_service.*) translates gRPC to these
// calls; ckpt-agent's main wires it all.
//
// Thread safety: every public method may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/file_system.h"
#include "common/manifest.h"
#include "common/metrics.h"
#include "server/agent/agent_metrics.h"
#include "server/agent/arena.h"
#include "server/agent/data_plane.h"
#include "common/executor.h"
#include "server/agent/flusher.h"
#include "server/agent/holdings.h"
#include "server/agent/ingest.h"
#include "server/agent/leases.h"
#include "server/agent/meta_link.h"
#include "server/agent/meta_session.h"
#include "server/agent/parity_builder.h"
#include "server/agent/peer_client.h"
#include "server/agent/peer_server.h"
#include "server/agent/protection.h"
#include "server/agent/puller.h"
#include "server/agent/reconstructor.h"
#include "server/agent/restorer.h"
#include "server/agent/session_server.h"
#include "server/agent/task_runner.h"
#include "server/agent/verifier.h"
#include "transport/bulk.h"
#include "transport/transport.h"

namespace ckpt::agent {

struct AgentOptions {
  std::string node_id;
  std::string grpc_address;  // advertised to meta
  std::string data_address;  // advertised to meta ("": the transport's address)
  // Replaces a wildcard host (0.0.0.0, [::]) in the transport's address when
  // data_address is "" (a port picked at start on all interfaces).
  std::string advertise_host;
  std::string failure_domain;
  // The memory tier (arena.h): its directory must be the agent's own (it is
  // created 0700; docs/agent.md "Memory tier").
  std::string memory_dir;
  // What memory_dir lives on ("tmpfs", "ext4", ...; "" not known) and
  // whether that is memory (ckpt-agent finds out with statfs: cmd/memory_fs.h).
  // Reported in Status() and the ckpt_agent_memory_dir_in_memory gauge.
  std::string memory_dir_fs;
  bool memory_dir_in_memory = true;
  uint64_t memory_bytes = 0;
  // Reads and writes the tier's records and incarnation file. Not owned;
  // nullptr: PosixFileSystem(). It must see the real memory_dir (the pool is
  // mapped from there): PosixFileSystem or a decorator over it.
  FileSystem* memory_fs = nullptr;
  bool populate = true;       // pre-fault the pool (tests may skip)
  std::string durable_root;   // empty: no durable tier on this node
  int64_t default_lease_ttl_ms = 60000;
  int64_t default_handle_ttl_ms = 600000;
  int64_t flush_retry_initial_ms = 500;
  int64_t flush_retry_max_ms = 30000;
  int flush_max_tries = 8;     // per task attempt, then report the error
  uint64_t item_alignment_bytes = 64;
  // The peer data plane (replicas, EC stripes, remote restore). Not owned;
  // the agent starts and stops it. nullptr: no data plane (protection tasks
  // fail with Unavailable, remote sources are skipped).
  transport::Transport* transport = nullptr;
  std::string data_listen_address;  // what the transport listens on
  // Gets the data-plane key meta returns at each registration (empty from an
  // --insecure meta): the daemon gives it to its UCX transport
  // (MetaSession::Options::on_data_plane_key). Unset: ignored.
  std::function<void(const std::string& key)> on_data_plane_key;
  transport::BulkOptions bulk;
  // How long a peer may stay silent during one step of a transfer.
  int64_t peer_timeout_ms = 30000;
  // Serve pushes and reads only to nodes meta lists as members with the
  // incarnation they state (membership.h). ckpt-agent turns it on; off here
  // for unit tests whose fake meta sends no membership.
  bool check_peer_membership = false;
  // Serve pushes and reads only over connections that proved, with a node
  // certificate, to be the node the message names, and connect only to the
  // node meta lists at an address (DataPlane's require_identity). ckpt-agent
  // turns it on with TLS (its transport then proves and checks node
  // certificates: transport::UcxOptions::identity).
  bool check_peer_identity = false;
  // How long a parity build may go without progress before it is dropped
  // (its memory freed, its task told). 0: max(4 x peer timeout, 30 s), which
  // outlasts meta's task retry backoff, so a build waiting for a peer whose
  // encode task is being retried keeps what it folded.
  int64_t parity_expire_ms = 0;
  // How long a stripe read waits on a silent holder before also reading
  // other survivors, and a restore on a silent replica holder before also
  // reading the next source (0: min(1 s, peer timeout / 4)).
  int64_t hedge_ms = 0;
  // The client session socket (session_server.h): "" for none. Clients of
  // a session hold leases and handles for as long as their connection lives,
  // plus `session_grace_ms` after it closes.
  std::string session_socket;
  int64_t session_grace_ms = 10000;
  // >= 0: the session socket belongs to this group and only its members
  // (and root and the agent's user) get sessions (SessionServer::Options).
  int64_t socket_gid = -1;
  int serve_threads = 2;   // serving peers' reads
  int finish_threads = 2;  // storing finished pushes
  int stripe_threads = 4;  // stripes pushed / restored concurrently
  // Pull-mode ingest (ckpt-dpu-agent, docs/dpu.md): leases hand out no
  // regions; each commit names the client's staging memory and the agent
  // reads it through this. Not owned; must outlive the agent. nullptr: push
  // mode (clients write into the pool).
  Puller* puller = nullptr;
  // A DPU agent: the host it serves (registered with meta as role DPU).
  std::string host_node_id;
};

struct AgentStatusSnapshot {
  std::string node_id;
  uint64_t incarnation = 0;
  bool registered = false;
  bool meta_reachable = false;
  int64_t last_heartbeat_unix_ms = 0;
  int64_t lease_remaining_ms = 0;
  NodeState node_state = NodeState::kUnknown;
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
  std::string memory_dir_fs;  // AgentOptions::memory_dir_fs
  bool memory_dir_in_memory = true;
  std::string durable_root;
  std::string pool_path;
  uint64_t pool_bytes = 0;
};

class Agent : private MetaSession::Delegate {
 public:
  // Opens the memory tier (re-adopting what a previous agent left) and
  // starts the data plane. `meta`, `clock`, `durable_fs` and `metrics` must
  // outlive the agent. Errors: the arena's (ResourceExhausted if the tmpfs is
  // too small), the transport's.
  static absl::StatusOr<std::unique_ptr<Agent>> Create(const AgentOptions& options, MetaLink* meta,
                                                       Clock* clock, FileSystem* durable_fs,
                                                       MetricsRegistry* metrics);
  ~Agent() override;  // calls Stop()

  // Starts the loops (ckpt-agent-ctl, -vfy, -task, -wtch).
  void Start();
  // Refuses new work, wakes every wait, stops the data plane, drains the
  // executors and joins every thread. Idempotent.
  void Stop();
  // A clean shutdown (SIGTERM) is under way: meta is told, so the node's
  // lease running out is not a failure in its MTBF (MetaSession::
  // AnnounceStop). Call before Stop(); a crash never calls it.
  void AnnounceStop() {
    if (session_) session_->AnnounceStop();
  }

  // ---- save path (see Ingest) ----
  // Ingest::AcquireLease and Ingest::Commit. A lease is committed, aborted,
  // closed or delivered only for the holder (client session) that took it
  // (LeaseTable: PermissionDenied otherwise).
  absl::StatusOr<LeaseGrant> AcquireLease(const LeaseRequest& request) { return ingest_->AcquireLease(request); }
  absl::StatusOr<std::shared_ptr<const ShardRecord>> Commit(const std::string& lease_id, uint64_t size_bytes,
                                                            std::vector<ManifestItem> items,
                                                            const PullSource* pull = nullptr,
                                                            const std::string& session_id = "") {
    return ingest_->Commit(lease_id, size_bytes, std::move(items), pull, session_id);
  }
  absl::Status AbortLease(const std::string& lease_id, const std::string& session_id = "");

  // ---- restore path (see Restorer) ----
  absl::StatusOr<OpenResult> OpenShard(const ShardId& id, bool skip_verify, uint32_t client_pid, int64_t ttl_ms) {
    return restorer_->OpenLocal(id, skip_verify, ClientOf(client_pid), ttl_ms);
  }
  // Restorer::Open: a named source is read only if meta's Locate lists it
  // for the shard (the caller-facing path: AgentService.OpenShard).
  absl::StatusOr<OpenOutcome> Open(const OpenRequest& request);
  // One source each, trusted as given (no meta check): for tests and
  // in-process callers that took the source from meta themselves.
  absl::StatusOr<OpenResult> RestoreFromDurable(const ShardRecord& expected, const std::string& durable_path,
                                                uint32_t client_pid, int64_t ttl_ms) {
    return restorer_->FromDurable(expected, durable_path, ClientOf(client_pid), ttl_ms);
  }
  absl::StatusOr<OpenResult> RestoreFromPeer(const ShardRecord& expected, const PeerEndpoint& holder,
                                             uint32_t client_pid, int64_t ttl_ms) {
    return restorer_->FromPeer(expected, holder, ClientOf(client_pid), ttl_ms);
  }
  absl::StatusOr<OpenResult> RestoreByDecode(const ShardRecord& expected, const EcDecodeSource& source,
                                             uint32_t client_pid, int64_t ttl_ms) {
    return restorer_->ByDecode(expected, source, ClientOf(client_pid), ttl_ms);
  }
  absl::Status CloseShard(const std::string& handle_id, const std::string& session_id = "");
  // Pull mode (a DPU agent): restores are not mapped by the client but
  // written into its staging memory. True when this agent works so (its
  // OpenShard answers carry DeliverToken(handle) instead of regions).
  bool delivers() const { return options_.puller != nullptr; }
  // The token a client puts at the head of the staging memory a restore of
  // handle `handle_id` is delivered into (Ingest::DeliverToken).
  std::string DeliverToken(const std::string& handle_id) const { return ingest_->DeliverToken(handle_id); }
  // Writes the shard of open handle `handle_id` into the client's `target`
  // (whose header must hold DeliverToken(handle_id)) with one-sided puts,
  // for a call of session `session_id` ("": none). NotFound (handle not
  // open), PermissionDenied (another holder's handle), FailedPrecondition
  // (not a pull-mode agent), and Puller::Push's errors.
  absl::Status Deliver(const std::string& handle_id, const PullSource& target, const std::string& session_id = "");
  // Calls fn(data, len) over the shard bytes [offset, offset+length) (length
  // 0: to the end) while the copy is pinned. NotFound / OutOfRange.
  absl::Status ReadShard(const ShardId& id, uint64_t offset, uint64_t length,
                         const std::function<absl::Status(const std::byte*, uint64_t)>& fn,
                         ShardRecord* record);

  // ---- inventory and commands ----
  std::vector<HoldingInfo> Inventory(const std::string& job_id, std::optional<uint64_t> step) const {
    return holdings_->Infos(job_id, step);
  }
  absl::StatusOr<std::vector<FlushResult>> FlushNow(const std::string& job_id, uint64_t step,
                                                    const std::vector<uint32_t>& ranks) {
    return flusher_->FlushNow(job_id, step, ranks);
  }
  // Verifier::Evict and Verifier::Verify.
  absl::StatusOr<std::vector<HoldingInfo>> Evict(const std::string& job_id, uint64_t step, bool dry_run) {
    return verifier_->Evict(job_id, step, dry_run);
  }
  absl::StatusOr<std::vector<VerifyFinding>> Verify(const std::string& job_id, uint64_t step, bool dry_run,
                                                    uint64_t* bytes_checked) {
    return verifier_->Verify(job_id, step, dry_run, bytes_checked);
  }
  AgentStatusSnapshot Status() const;
  // This node's id (what Status().node_id says, without gathering the rest).
  const std::string& node_id() const { return options_.node_id; }
  // AgentService.PauseProtection: see Protector::Pause. InvalidArgument for
  // a negative duration or one over 60 s.
  absl::StatusOr<absl::Duration> PauseProtection(absl::Duration d);

  // ---- loops (public for deterministic tests) ----
  void ControlOnce();
  // Verifier::VerifyOnce: true if it verified something.
  bool VerifyOnce() { return verifier_->VerifyOnce(); }
  // Returns true if it ran a task step that finished or failed.
  bool TasksOnce() { return runner_->RunOnce(); }
  // Queues tasks as if meta had sent them (the rpc layer's WatchTasks, tests).
  void EnqueueTasks(std::vector<AgentTask> tasks) { runner_->Enqueue(std::move(tasks)); }

  const Arena& arena() const { return *arena_; }
  // The data plane address peers reach this agent on ("" without one).
  std::string data_address() const { return plane_->address(); }
  // Components, for tests that look inside.
  PeerClient* peer_client_for_test() { return peer_client_.get(); }
  ParityBuilder* parity_for_test() { return parity_.get(); }
  PeerServer* peer_server_for_test() { return peer_server_.get(); }
  // Whether a client session is open (connected) here.
  bool SessionOpen(const std::string& session_id) const { return sessions_ && sessions_->Open(session_id); }
  // The session socket's path ("" without one).
  std::string session_socket() const { return sessions_ ? sessions_->socket_path() : std::string(); }
  // Lets local clients send requests on their session connections
  // (SessionServer::SetRequestHandler; the daemon gives the RPC service's
  // local open). No-op without a session socket.
  void SetSessionRequestHandler(SessionServer::RequestHandler handler) {
    if (!sessions_) return;
    if (handler == nullptr) {
      sessions_->SetRequestHandler(nullptr);
      return;
    }
    sessions_->SetRequestHandler([this, h = std::move(handler)](const std::string& session, std::string_view kind,
                                                                std::string_view request) {
      metrics_.session_requests->Increment();
      return h(session, kind, request);
    });
  }

 private:
  Agent(const AgentOptions& options, MetaLink* meta, Clock* clock, FileSystem* durable_fs, MetricsRegistry* metrics);
  absl::Status Init();
  ClientRef ClientOf(uint32_t pid) const { return ClientRef{pid, ""}; }
  absl::Status RunStep(QueuedTask& qt, bool* finished);
  void UpdateGauges();

  // MetaSession::Delegate
  std::vector<InventoryItem> InventoryItems() override { return holdings_->InventoryItems(); }
  LoadReport Load() override;
  void OnTasks(std::vector<AgentTask> tasks, std::vector<std::string> cancelled) override;
  void OnDrop(const std::vector<ShardId>& shards, const std::vector<SegmentId>& segments) override;
  void OnVersionRefused(const std::string& job, uint64_t step, const std::string& run_id,
                        const absl::Status& why) override;
  void OnCopyRefused(const HoldingReport& report, const absl::Status& why) override;

  const AgentOptions options_;
  MetaLink* const meta_;
  Clock* const clock_;
  FileSystem* const durable_fs_;
  const absl::Time started_;
  AgentMetrics metrics_;

  // Components, in dependency order (destroyed in reverse: nothing outlives
  // what it points to; the arena goes last, after every Reservation).
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<PeerMembership> membership_;  // check_peer_membership
  std::unique_ptr<MetaSession> session_;
  std::unique_ptr<HoldingTable> holdings_;
  std::unique_ptr<LeaseTable> leases_;
  std::unique_ptr<SessionServer> sessions_;
  std::unique_ptr<Flusher> flusher_;
  std::unique_ptr<TaskRunner> runner_;
  std::unique_ptr<Executor> stripes_;
  std::unique_ptr<Executor> restore_races_;
  std::unique_ptr<DataPlane> plane_;
  std::unique_ptr<ParityBuilder> parity_;
  std::unique_ptr<PeerClient> peer_client_;
  std::unique_ptr<PeerServer> peer_server_;
  std::unique_ptr<Reconstructor> reconstructor_;
  std::unique_ptr<Protector> protector_;
  std::unique_ptr<Restorer> restorer_;
  std::unique_ptr<Verifier> verifier_;
  std::unique_ptr<Ingest> ingest_;

  mutable absl::Mutex loop_mu_;
  bool stopping_ ABSL_GUARDED_BY(loop_mu_) = false;
  std::vector<std::thread> threads_;
  absl::Mutex stop_mu_;  // serialises Stop()
};

}  // namespace ckpt::agent
