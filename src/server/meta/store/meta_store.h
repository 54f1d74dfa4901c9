// MetaStore: the metadata service's durable, ordered key-value store.
//
// ckpt-meta keeps every piece of cluster state (nodes, jobs, versions, shards,
// tasks) as keys in one MetaStore. Every state change is one WriteBatch: an
// ordered list of puts and deletes that becomes durable atomically (all of it
// or none of it survives a crash).
//
// Writes are split in two so that many concurrent state changes share one
// fsync (group commit):
//   uint64_t seq = store->Submit(std::move(batch));  // queues; returns at once
//   ... apply the change in memory, answer other requests ...
//   CKPT_RETURN_IF_ERROR(store->AwaitDurable(seq));  // blocks until fsynced
// Commit(batch) does both. Batches become durable in Submit order: once
// AwaitDurable(seq) returns OK, every batch with a smaller sequence number is
// durable too, and a crash never keeps a batch while losing an earlier one.
//
// Reads (Get, Scan) see every batch whose Submit() returned before the read
// started, durable or not ("read your writes"). ckpt-meta serialises its own
// state changes and keeps its state in memory; it reads the store at start-up
// to load that state.
//
// Errors are sticky. Once a write fails (disk error, disk full), AwaitDurable
// of the failed batches and of every batch submitted after them returns the
// original error, later Submits are refused (AwaitDurable returns
// Unavailable naming the original error), and reads return Unavailable too:
// the in-memory state of the daemon has diverged from the disk, so it must
// restart and reload. Unavailable, not FailedPrecondition: the caller did
// nothing wrong and should retry once meta is back (docs/protocol.md's table:
// an agent drops a report refused with FAILED_PRECONDITION).
//
// Implementations: OpenRocksDbMetaStore() (rocksdb_meta_store.h), the real one;
// NewMemMetaStore() (mem_meta_store.h), an in-memory twin for unit tests.
//
// Keys and values are arbitrary byte strings (NUL bytes included). Keys are
// ordered bytewise (memcmp, shorter first on a common prefix), as std::string
// compares them.
//
// Thread safety: every MetaStore method may be called from any thread
// concurrently. No call may be in progress when the store is destroyed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt::meta {

// An ordered set of puts and deletes applied atomically. Later operations on a
// key override earlier ones in the same batch (Put "a"=1, Delete "a", Put
// "a"=2 leaves "a"=2). A plain value type: copyable, movable, not thread-safe.
class WriteBatch {
 public:
  enum class OpType { kPut, kDelete };
  struct Op {
    OpType type;
    std::string key;
    std::string value;  // empty for kDelete
  };

  // Bytes charged per operation on top of its key and value when byte_size()
  // accounts for memory (the Op itself and the store's bookkeeping).
  static constexpr size_t kOpOverheadBytes = 32;

  // Appends a put of `key` = `value`.
  void Put(std::string key, std::string value);
  // Appends a delete of `key`. Deleting an absent key is not an error.
  void Delete(std::string key);
  // Removes every operation.
  void Clear();

  bool empty() const { return ops_.empty(); }
  // Number of operations.
  size_t size() const { return ops_.size(); }
  // The operations, in the order they were added.
  const std::vector<Op>& ops() const { return ops_; }
  // Sum over operations of key size + value size + kOpOverheadBytes: what
  // the batch costs while it waits in a store's queue.
  size_t byte_size() const { return byte_size_; }

 private:
  std::vector<Op> ops_;
  size_t byte_size_ = 0;
};

// Counters for metrics, monotonic since the store was opened (except
// queued_bytes, a gauge).
struct StoreStats {
  // Batches made durable (empty batches included).
  uint64_t batches_written = 0;
  // Syncs of the log done (RocksDB: WAL syncs RocksDB reports having done,
  // one per write group; none if writes are not synced). batches_written /
  // fsyncs is the group-commit factor.
  uint64_t fsyncs = 0;
  // Payload bytes handed to the storage engine.
  uint64_t bytes_written = 0;
  // Submit() and WaitForRoom() calls that had to wait for queue space
  // (backpressure).
  uint64_t submit_waits = 0;
  // byte_size() of the batches submitted but not yet durable.
  uint64_t queued_bytes = 0;
};

// Test seam shared by both implementations: called before each write (one
// write group for RocksDB, one batch for the in-memory store); a non-OK result
// is treated exactly like a failed write. Called on the store's writing thread
// without the store's locks held; it may block (to hold the writer still).
using WriteHook = std::function<absl::Status()>;

class MetaStore {
 public:
  virtual ~MetaStore() = default;

  // Point read of the value of `key` in the state after every batch submitted
  // so far (durable or not). NotFound if the key is absent; Unavailable
  // after a write error; Unavailable/Internal for an I/O error reading. Blocks
  // on disk reads only (never on the writer).
  virtual absl::StatusOr<std::string> Get(std::string_view key) = 0;

  // Calls fn(key, value) for every key starting with `prefix` (empty: every
  // key), in key order, until fn returns false, over one consistent view of
  // the state after every batch submitted before the call. The views passed
  // to fn are valid only during that call. fn may call any method of this
  // store; what it submits is not seen by the scan in progress. Returns OK
  // also when fn stopped the scan; errors as for Get. Blocks on disk reads
  // only.
  virtual absl::Status Scan(
      std::string_view prefix,
      const std::function<bool(std::string_view key, std::string_view value)>& fn) = 0;

  // Queues `batch` and returns its sequence number (1, 2, 3, ... in Submit
  // order; the order batches become durable in). Never fails: a failure is
  // reported by AwaitDurable. Never blocks on I/O, with one exception that
  // bounds memory: if the batches submitted but not yet durable already hold
  // the store's queue limit in byte_size() (RocksDbOptions::max_queued_bytes),
  // Submit waits until the writer has made room (backpressure from a slow
  // disk). A batch larger than the whole limit is admitted once the queue is
  // empty. Empty batches are allowed and cost no I/O.
  virtual uint64_t Submit(WriteBatch batch) = 0;

  // Backpressure for a caller that decides its batches under a lock of its
  // own (MetaCore decides under its mutex, so that batches reach the store in
  // the order they were decided). Waiting for room in Submit under that lock
  // would stall every other user of the lock, readers included, for as long
  // as the disk is slow; instead (as LevelDB's MakeRoomForWrite lets go of
  // its mutex), the caller waits here before taking its lock and submits
  // with SubmitNoWait under it.
  //
  // WaitForRoom blocks until the batches submitted but not yet durable hold
  // less than the store's queue limit in byte_size(), or a write has failed
  // (the next AwaitDurable reports it). Returns at once for a store with no
  // limit. Takes no lock of the caller's; may be called from any thread.
  virtual void WaitForRoom() {}
  // Submit without the wait for room: `batch` is admitted even when the queue
  // is at its limit, which it may then exceed by about one batch per thread
  // that passed WaitForRoom at the same time. Never blocks on I/O or on the
  // writer. Otherwise as Submit.
  virtual uint64_t SubmitNoWait(WriteBatch batch) { return Submit(std::move(batch)); }

  // Blocks until every batch with sequence number <= `seq` is durable (on
  // disk, fsynced) and returns OK. seq 0 returns OK at once. If the write of
  // one of those batches failed, returns that first write error (same code and
  // message, naming the store's path) for the batches submitted before the
  // failure was known, and Unavailable naming it for batches submitted
  // after. InvalidArgument if `seq` was never returned by Submit.
  virtual absl::Status AwaitDurable(uint64_t seq) = 0;

  // Submit + AwaitDurable: blocks until `batch` is durable.
  absl::Status Commit(WriteBatch batch) { return AwaitDurable(Submit(std::move(batch))); }

  // A snapshot of the counters. Never blocks on I/O.
  virtual StoreStats stats() = 0;
};

// Shared helpers for the implementations (not part of the service's API).
namespace internal {

// The status returned for writes and reads refused because `original` failed
// earlier: Unavailable with `original`'s code and message quoted.
absl::Status RefusedAfterWriteError(const absl::Status& original);

// NotFound naming `key` (C-escaped: keys may be binary).
absl::Status KeyNotFound(std::string_view key);

// Whether `key` starts with `prefix`.
inline bool HasPrefix(std::string_view key, std::string_view prefix) {
  return key.substr(0, prefix.size()) == prefix;
}

}  // namespace internal
}  // namespace ckpt::meta
