// Connection state shared by a Client and the handles it creates (SaveHandle,
// LoadedShard): the options, the links to meta and the local agent, the
// agent's node id and the cache of memory-tier mappings. Internal to
// src/client; the public API is ckpt/client.h.
//
// Thread safety: every member is either const after Connect, guarded by a
// mutex, or thread-safe itself (the links, MappingCache, atomics, the
// committer).
#pragma once

#include <grpcpp/grpcpp.h>

#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "ckpt/client.h"
#include "ckpt/v1/agent.pb.h"
#include "ckpt/v1/meta.pb.h"
#include "client/agent_link.h"
#include "client/mapped_file.h"
#include "client/meta_link.h"
#include "client/pull_staging.h"
#include "client/region_io.h"
#include "client/session.h"
#include "common/executor.h"

namespace ckpt::client {

namespace v1 = ::ckpt::v1;

struct LazyState;   // lazy_save.h
struct EarlyLease;  // save_state.h

// XXH3-64 of a save's items, by name.
using ItemHashes = absl::flat_hash_map<std::string, uint64_t>;

// The last save of a client that committed (or the version it loaded, if
// newer): the base of its next incremental save (ItemChange,
// SaveBuilder::CarryRest).
struct SavedBase {
  uint64_t step = 0;
  // The commit as sent: its packed manifest lists the items, references
  // included (decoded only by a save that needs it).
  std::shared_ptr<const v1::CommitShardRequest> commit;
  // XXH3-64 of items by name, where known (items hashed by ItemChange::
  // kDetect, and references that inherited one); null if none.
  std::shared_ptr<const ItemHashes> hashes;
};

// The outcome of a CommitShard sent after SaveBuilder::Commit returned:
// written once by the committer, then `done` is notified.
struct CommitResult {
  absl::Status status;
  absl::Notification done;
  // Blocks until the agent answered (or `deadline`: kDeadlineExceeded).
  absl::Status Wait(absl::Time deadline) const {
    if (!done.WaitForNotificationWithDeadline(deadline)) {
      return absl::DeadlineExceededError("the agent has not answered the commit yet");
    }
    return status;
  }
};

// How long after this client committed a step a version meta does not know
// yet, or not yet STAGED, is waited for: the agent begins it at meta and
// reports the shard in the background.
inline constexpr absl::Duration kBeginGrace = absl::Seconds(10);

struct ClientCore {
  // The process that created this client. After fork() the child has none of
  // its threads (the executors below), and its gRPC channels and agent
  // session belong to the parent: the child's calls are refused
  // (CheckProcess) and the child never destroys it (NewClientCore).
  const pid_t creator_pid = ::getpid();
  // FailedPrecondition in a process other than the creator.
  absl::Status CheckProcess() const {
    const pid_t here = ::getpid();
    if (here == creator_pid) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "this ckpt client was created in process ", creator_pid, " and cannot be used in process ", here,
        " (after fork()): connect a new client in this process"));
  }
  ClientOptions options;
  // Meta's gRPC service (NewGrpcMetaLink; a fake in unit tests). Retry loops
  // wait between attempts with MetaLink::AwaitRetry (client.cc Backoff).
  std::unique_ptr<MetaLink> meta;
  // The local agent's gRPC service (NewGrpcAgentLink; a fake in unit tests).
  std::unique_ptr<AgentLink> agent;
  std::string node_id;          // the local agent's, for Locate
  MappingCache mappings;
  // Populates a pool mapping in the background once this client saved into
  // it (MappingCache maps pools unpopulated, so Connect costs no time per GiB).
  PoolWarmer warmer;
  // Item alignment the agent recommended in its last lease (64 until then).
  std::atomic<uint64_t> item_alignment{64};
  // Items in the last save: the next SaveBuilder reserves room for as many
  // (a trainer saves the same structure every time).
  std::atomic<size_t> last_save_items{0};
  // The shard size of the last save that copied every item into a lease of
  // the local agent's (0 after any other): the next SaveBuilder asks for a
  // lease of that size at once (save.cc, EarlyLease).
  std::atomic<uint64_t> last_full_save_bytes{0};
  // The lease asked for ahead of the next save (ClientOptions::lease_ahead),
  // for step `ahead_step`; and the steps of the last saves that copied every
  // item, to guess that step.
  absl::Mutex ahead_mu;
  std::shared_ptr<EarlyLease> ahead ABSL_GUARDED_BY(ahead_mu);
  uint64_t ahead_step ABSL_GUARDED_BY(ahead_mu) = 0;
  std::array<std::optional<uint64_t>, 2> full_steps ABSL_GUARDED_BY(ahead_mu);  // older, newer
  // SaveBuilders begun (SaveBuilder::begun_seq_ of the newest).
  uint64_t saves_begun ABSL_GUARDED_BY(ahead_mu) = 0;
  // The item array of the last LoadedShard destroyed, emptied with its
  // capacity kept: the next Load fills it rather than a new array, whose
  // pages fault in one by one (about 1.4 MB for 10,000 items).
  absl::Mutex spare_items_mu;
  std::vector<LoadedItem> spare_items ABSL_GUARDED_BY(spare_items_mu);
  // Incremental saves: the base (see SavedBase; unset until a save
  // committed or a load).
  absl::Mutex base_mu;
  std::optional<SavedBase> base ABSL_GUARDED_BY(base_mu);
  // When this client last committed each step: WaitVersion on such a step
  // rides out the agent's background BeginVersion (see SaveHandle::Wait).
  absl::Mutex committed_mu;
  std::map<uint64_t, absl::Time> committed_at ABSL_GUARDED_BY(committed_mu);
  // kBeginGrace after this client committed `step`; the infinite past if it
  // did not (recently).
  absl::Time GraceEnd(uint64_t step) {
    absl::MutexLock lock(&committed_mu);
    auto it = committed_at.find(step);
    return it == committed_at.end() ? absl::InfinitePast() : it->second + kBeginGrace;
  }
  // What the recent saves blocked the trainer, by step (at most 16 steps).
  absl::Mutex cost_mu;
  std::map<uint64_t, absl::Duration> save_costs ABSL_GUARDED_BY(cost_mu);
  // Adds `blocked` to the cost of `step`'s save.
  void AddSaveCost(uint64_t step, absl::Duration blocked) {
    absl::MutexLock lock(&cost_mu);
    save_costs[step] += blocked;
    while (save_costs.size() > 16) save_costs.erase(save_costs.begin());
  }
  // The session with the local agent (client/session.h); null before Connect
  // and with an older agent that has no session socket.
  absl::Mutex session_mu;
  std::shared_ptr<AgentSession> session ABSL_GUARDED_BY(session_mu);
  bool sessions_supported ABSL_GUARDED_BY(session_mu) = true;

  // Pull-mode ingest (a DPU agent, docs/dpu.md): the client's own staging
  // memory, started on the first lease that asks for it (StagingBuffer).
  absl::Mutex staging_mu;
  std::shared_ptr<PullStaging> staging ABSL_GUARDED_BY(staging_mu);

  // The newest commit sent in the background (null: none yet). Commits run
  // in order, so once it is done all earlier ones are.
  absl::Mutex commit_mu;
  std::shared_ptr<CommitResult> last_commit ABSL_GUARDED_BY(commit_mu);
  // Waits until every commit sent so far was answered (their outcomes go to
  // their SaveHandles), so what this client saved is visible to its own
  // loads and waits.
  // False if `deadline` passed first.
  bool WaitCommits(absl::Time deadline = absl::InfiniteFuture()) {
    std::shared_ptr<CommitResult> last;
    {
      absl::MutexLock lock(&commit_mu);
      last = last_commit;
    }
    return last == nullptr || last->done.WaitForNotificationWithDeadline(deadline);
  }
  // Lazy saves of this client still copying or committing (SaveBuilder::
  // CommitLazy registers each; gone ones are pruned there).
  absl::Mutex lazy_mu;
  std::vector<std::weak_ptr<LazyState>> lazy_saves ABSL_GUARDED_BY(lazy_mu);
  // WaitCommits, after every lazy save of this client has committed or
  // failed: a load or wait of the step a lazy save is still copying must
  // not answer "no version" (lazy_save.cc). False if `deadline` passed first.
  bool WaitSaves(absl::Time deadline = absl::InfiniteFuture());
  // The lazy saves of this client not finished (nor gone) yet.
  std::vector<std::weak_ptr<LazyState>> RunningLazySaves();
  // Runs calls whose answer the caller does not wait for at once: CloseShard
  // of dropped shards (CloseShardInBackground) and a load's Locate while the
  // agent opens the local copy. Its functions hold a plain reference to this
  // ClientCore: destroyed before the members above, it finishes them first.
  Executor calls{"ckpt-calls", 2, 64};
  // Runs the CommitShard calls of saves after Commit returned (one thread,
  // in order). Declared last so it is destroyed first: its destructor sends
  // what is queued while the stubs above still exist.
  Executor committer{"ckpt-commit", 1, 64};
};

// The id of the client's open session with the local agent, reopening it
// (and re-mapping the pool if it changed) when the agent hung up, e.g. after
// a restart. "" with an agent that has no session socket. Errors: those of
// AgentSession::Open and of mapping the pool.
absl::StatusOr<std::string> SessionId(ClientCore& core);
// The open session itself (as SessionId); null with an agent that has no
// session socket.
absl::StatusOr<std::shared_ptr<AgentSession>> OpenSession(ClientCore& core);

// A staging buffer of at least `size` bytes for a pull-mode lease, starting
// UCX in this process the first time. Errors: PullStaging's.
absl::StatusOr<std::shared_ptr<PullStaging::Buffer>> StagingBuffer(ClientCore& core, uint64_t size);

// Sends CloseShard(handle_id) to the local agent on `core.calls`, without
// waiting for its answer (a failure is logged; the handle then ends with the
// session); on the caller's thread if that executor is full. The ClientCore's
// destruction waits for the answer. `session_id`: the session the handle was
// opened on ("" for none; the agent lets only that session close it).
void CloseShardInBackground(ClientCore& core, std::string handle_id, std::string session_id);

// gRPC status -> absl::Status with the same code and the server's message,
// prefixed with `call` ("CommitShard: ...").
absl::Status FromGrpc(const grpc::Status& status, const char* call);

// Returns at `until`, or earlier once `channel` is READY, spending the time
// in the channel's connectivity watch (client.cc Backoff says why).
void AwaitChannel(grpc::Channel* channel, absl::Time until);

// A client context whose deadline is `timeout` from now.
std::unique_ptr<grpc::ClientContext> ContextWithTimeout(absl::Duration timeout);

// One unary call of a generated stub's `method` (e.g.
// &v1::AgentService::Stub::CommitShard) with a deadline `timeout` from now:
// the one place the client's links (agent_link_grpc.cc, meta_link_grpc.cc)
// make a call. Blocks until the answer or the deadline. Returns FromGrpc of
// the call's status, named `call` ("CommitShard: ...").
template <typename Stub, typename Request, typename Response>
absl::Status CallUnary(Stub& stub, grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                       const Request& req, Response* resp, absl::Duration timeout, const char* call) {
  const std::unique_ptr<grpc::ClientContext> ctx = ContextWithTimeout(timeout);
  return FromGrpc((stub.*method)(ctx.get(), req, resp), call);
}

// The same for a call whose answer carries nothing the caller needs.
template <typename Stub, typename Request, typename Response>
absl::Status CallUnary(Stub& stub, grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                       const Request& req, absl::Duration timeout, const char* call) {
  Response resp;
  return CallUnary(stub, method, req, &resp, timeout, call);
}

// Runs a read-only call to meta (`call` sends it through core.meta with the
// timeout it is given) and, while it fails UNAVAILABLE, sends it again after
// a backoff spent in MetaLink::AwaitRetry, for up to rpc_timeout in all:
// right after meta restarts, the channel's first call fails before it
// reconnects. Returns the last answer (the link's status: "Locate: ...").
absl::Status CallMetaRetrying(const ClientCore& core, const std::function<absl::Status(absl::Duration)>& call);

// Maps each MemoryRegion into this process (through core.mappings, with the
// given access) and returns them as ShardRegions, checked to cover [0, size).
// `keep` receives the mappings used, so the caller can hold them alive while
// it touches the regions; they also pin the regions against the pool warmer
// (core.warmer) until the last of them goes. Read-write regions (a save's)
// also queue their pool for warming.
absl::StatusOr<std::vector<ShardRegion>> MapRegions(
    ClientCore& core, const google::protobuf::RepeatedPtrField<v1::MemoryRegion>& regions,
    uint64_t size, MappedFile::Access access, std::vector<std::shared_ptr<MappedFile>>* keep);

// Bytes [offset, offset + length) of a shard.
struct ByteSpan {
  uint64_t offset = 0;
  uint64_t length = 0;
};
// Some bytes of a shard, read alone (OpenShardRanges): bytes[i] holds
// ranges[i]. Valid while this object lives (it keeps the agent's handle and
// the mappings, or copies of ranges whose bytes straddle regions).
struct ShardRanges {
  std::vector<std::span<const std::byte>> bytes;
  std::shared_ptr<void> keep;
  std::vector<std::vector<std::byte>> copies;
};
// Reads only `ranges` (in increasing offset order, not overlapping) of rank
// `rank`'s shard of `step` when another node's replica serves it (Locate,
// then OpenShard with byte ranges: the holder sends only them, checked
// against its whole copy's crc32c first; this side checks their crc32c).
// nullopt when the whole shard is the cheaper or only way (a copy on this
// node, an EC decode, the durable tier, a pull-mode agent): the caller
// loads it whole. Errors as Load's.
absl::StatusOr<std::optional<ShardRanges>> OpenShardRanges(const std::shared_ptr<ClientCore>& core, uint64_t step,
                                                           uint32_t rank, std::span<const ByteSpan> ranges);

// Joins the job at meta (core.meta), retried while meta is unreachable
// until `deadline`: rank 0 creates it or opens it if it exists with the same
// spec (CreateJob, open_if_exists); other ranks wait for rank 0 to have
// created it and check its world size (GetJob). Client::Connect's first step.
absl::Status JoinJob(ClientCore& core, absl::Time deadline);

// Where ClientOptions::agent_socket is set, for messages.
inline constexpr char kAgentSocketHow[] = "ClientOptions::agent_socket (Python: agent_socket=) or CKPT_AGENT_SOCKET";

// The file system path of an agent_socket target ("unix:" stripped); "" for
// another kind of gRPC target, which is not probed.
std::string AgentSocketPath(const std::string& agent_socket);

// Asks the agent (core.agent) for its node id and pool files, retried while
// it is unreachable until `deadline`, and maps the pool (over the session,
// else by path). Client::Connect's last step.
absl::Status ConnectAgent(ClientCore& core, absl::Time deadline);

// A Client over `core` (connected: Client::Connect, or a test's core).
Client MakeClient(std::shared_ptr<ClientCore> core);

// Level -> ckpt.v1.DurabilityLevel.
v1::DurabilityLevel ToProto(Level level);

// WaitVersion loop shared by Client::WaitVersion and SaveHandle::Wait.
// NotFound before `not_found_until` is retried (a version the agent has not
// begun at meta yet).
absl::Status WaitForVersion(const ClientCore& core, uint64_t step, Level level,
                            absl::Time deadline, absl::Time not_found_until = absl::InfinitePast());

// A new ClientCore that only its creating process destroys: a fork()ed
// child that drops the last reference leaks it (its threads do not exist
// there; joining them would hang, and closing its session could disturb the
// parent's).
// Before it goes, the lease it asked for ahead of a next save is released
// (DropLeaseAhead), so that a trainer that exits frees that memory at once.
void DropLeaseAhead(ClientCore& core);
inline std::shared_ptr<ClientCore> NewClientCore() {
  return std::shared_ptr<ClientCore>(new ClientCore(), [](ClientCore* core) {
    if (::getpid() != core->creator_pid) return;
    DropLeaseAhead(*core);
    delete core;
  });
}

}  // namespace ckpt::client
