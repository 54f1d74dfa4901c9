// Meta replicas on etcd (issue 37; docs/meta.md "Replicas"): the leader's
// store, which orders every change through a log in etcd before it is
// acknowledged, and the followers' log applier.
//
// Every ckpt-meta replica keeps its own RocksDB store (the "local" store
// here). The leader's MetaCore writes through a ReplicatedMetaStore: its
// writer thread takes every batch queued so far as one group, appends the
// group's entries to <root>/log/ in etcd (meta_log.h), each in one etcd
// transaction fenced on the leader's election key (a deposed leader's append
// fails), then commits the group to the local store with the log index it
// reached; only then are the group's batches durable (AwaitDurable returns).
// So an acknowledged change is in etcd's Raft log (a majority of its members'
// disks) and in the leader's RocksDB. Followers run a LogFollower that applies
// the log to their own store as it grows; the replica that wins the next
// election applies what it has not (LogFollower::CatchUp) and then opens its
// MetaCore on that store, as a restarted meta does.
//
// Reads (Get, Scan) of a ReplicatedMetaStore see the local store: a batch is
// visible once it is durable, not at Submit (MetaCore reads its store only
// while it opens, so "read your writes" is not needed by its one user).
//
// Errors are sticky, as for every MetaStore: an append that fails for good
// (fence lost: FailedPrecondition "no longer the leader"; etcd unreachable for
// ReplicaOptions::append_timeout: its last error) or a local write error fails
// the group and everything after it. A leader whose store failed must stop
// serving: ckpt-meta exits, and its supervisor restarts it as a follower.
//
// Thread safety: as MetaStore. The local store, client and election must
// outlive the ReplicatedMetaStore; nothing else may write the log meanwhile.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/meta/etcd/etcd_client.h"
#include "server/meta/etcd/etcd_election.h"
#include "server/meta/etcd/meta_log.h"
#include "server/meta/store/meta_store.h"

namespace ckpt::meta {

struct ReplicaOptions {
  // As RocksDbOptions::max_queued_bytes.
  size_t max_queued_bytes = 64 << 20;
  // How long an append is retried while etcd answers UNAVAILABLE or times
  // out (a member down, an election among etcd's members) before the store
  // fails. Each retry goes to the next endpoint.
  absl::Duration append_timeout = absl::Seconds(10);
  // A snapshot of the store is written to etcd after this many log entries
  // since the last one, and the log before it is deleted and etcd's history
  // compacted (meta_log.h "Snapshots"); 0: never (the log grows without end).
  // A snapshot starts after the group that makes it due, unless the previous
  // one is still being written; then the next group starts it.
  uint64_t snapshot_every_entries = 10000;
};

// Counters of the replicated log, monotonic.
struct ReplicaStats {
  uint64_t entries_appended = 0;   // log entries appended to etcd
  uint64_t append_retries = 0;     // appends repeated after an etcd error
  double append_seconds = 0;       // total time in etcd appends (latency = seconds / groups)
  uint64_t groups = 0;             // groups replicated
  uint64_t last_index = 0;         // the log's last index we wrote or applied
  uint64_t snapshots = 0;          // snapshots written (log trimmed behind each)
  uint64_t snapshot_index = 0;     // the log index of the newest
};

class ReplicatedMetaStore : public MetaStore {
 public:
  // `local` holds every complete group of the log below `next_index`
  // (LogFollower::CatchUp returned it); `election` has won.
  ReplicatedMetaStore(MetaStore* local, EtcdClient* etcd, EtcdElection* election, std::string root,
                      uint64_t next_index, ReplicaOptions options = {});
  // Replicates what is queued (unless the store failed), then stops.
  ~ReplicatedMetaStore() override;

  absl::StatusOr<std::string> Get(std::string_view key) override;
  absl::Status Scan(std::string_view prefix,
                    const std::function<bool(std::string_view, std::string_view)>& fn) override;
  uint64_t Submit(WriteBatch batch) override;
  void WaitForRoom() override;
  uint64_t SubmitNoWait(WriteBatch batch) override;
  absl::Status AwaitDurable(uint64_t seq) override;
  StoreStats stats() override;
  ReplicaStats replica_stats();

 private:
  void WriterLoop();
  // Appends `group` to the log and commits it locally.
  absl::Status Replicate(WriteBatch group);
  // One entry at next_index_, retried (idempotently) on etcd errors.
  absl::Status Append(const std::string& value);
  // `txn` fenced on our leadership, retried on etcd's transient errors for
  // append_timeout.
  absl::StatusOr<EtcdTxnResult> FencedRetried(const EtcdTxn& txn, const std::string& what);
  // After a group: starts a snapshot when one is due (writer thread).
  void MaybeSnapshot();
  // Writes the snapshot of log index `index`, points the head at it, trims
  // the log and older snapshots, compacts etcd (snapshot thread).
  absl::Status WriteSnapshot(uint64_t index, const std::vector<std::string>& parts);
  uint64_t Enqueue(WriteBatch batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool HasRoom() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  MetaStore* const local_;
  EtcdClient* const etcd_;
  EtcdElection* const election_;
  const std::string root_;
  const ReplicaOptions options_;
  uint64_t next_index_;  // writer thread only
  uint64_t last_snapshot_index_ = 0;  // writer thread only
  std::thread snapshotter_;           // started and joined by the writer thread (and the destructor)
  std::atomic<bool> snapshot_running_{false};

  absl::Mutex mu_;
  std::deque<std::pair<uint64_t, WriteBatch>> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t last_seq_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t done_seq_ ABSL_GUARDED_BY(mu_) = 0;         // every seq <= this is durable or failed
  uint64_t failed_through_ ABSL_GUARDED_BY(mu_) = 0;   // seqs <= this and > ok_seq_ failed with error_
  uint64_t ok_seq_ ABSL_GUARDED_BY(mu_) = 0;           // every seq <= this is durable
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  size_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  StoreStats stats_ ABSL_GUARDED_BY(mu_);
  ReplicaStats replica_ ABSL_GUARDED_BY(mu_);
  std::thread writer_;
};

// Applies <root>/log/ to a follower's local store: a thread (Start) that
// catches up with a paged read and then follows a watch, re-syncing after any
// break; CatchUp for the replica about to lead.
class LogFollower {
 public:
  // Reads how far `local` has applied the log. Errors: the store's.
  static absl::StatusOr<std::unique_ptr<LogFollower>> Create(MetaStore* local, EtcdClient* etcd, std::string root);
  ~LogFollower();  // Stop()

  // Starts the applying thread ("ckpt-meta-follow"). Errors are logged and
  // retried; a damaged log (DataLoss) or a failed store stops it (status()).
  void Start();
  void Stop();

  // Applies every complete group now in the log (call with the thread
  // stopped). Returns the index after the log's last entry: where the next
  // leader appends.
  absl::StatusOr<uint64_t> CatchUp();

  uint64_t applied_index() const;
  // OK, or why the thread stopped applying for good.
  absl::Status status() const;

 private:
  LogFollower(MetaStore* local, EtcdClient* etcd, std::string root, uint64_t applied);
  void Run();
  // Reads the log from next_ on to its end (at one revision); returns that
  // revision. *end_index: the index after the last entry seen.
  absl::StatusOr<int64_t> ReadToEnd(uint64_t* end_index);
  absl::Status Apply(uint64_t index, std::string_view entry);
  // Replaces the local store with the snapshot `head` names, if it is ahead
  // of what we applied (Aborted if it changed while read: read again).
  absl::Status LoadSnapshotIfAhead();
  bool WaitStopping(absl::Duration d);

  MetaStore* const local_;
  EtcdClient* const etcd_;
  const std::string root_;
  replica::EntryAssembler assembler_;  // applying thread (or CatchUp's caller) only
  uint64_t next_;                      // the index expected next; same

  mutable absl::Mutex mu_;
  uint64_t applied_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace ckpt::meta
