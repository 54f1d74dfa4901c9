// The RocksDB MetaStore: ckpt-meta's durable state, with group commit.
//
// Group commit. Submit() appends the batch to an in-memory queue and returns
// its sequence number. One writer thread ("ckpt-meta-wal", owned by the store,
// joined by its destructor) repeatedly takes *every* batch queued so far,
// merges them in Submit order into one rocksdb::WriteBatch, writes it with
// WriteOptions::sync = true (one WAL append + one fdatasync), and then wakes
// every AwaitDurable() waiting on those batches. While one group is being
// synced the next one accumulates, so N concurrent committers share one fsync
// and throughput grows with concurrency instead of being capped by the disk's
// sync rate. Merging never weakens atomicity: a whole group is one RocksDB
// write, which RocksDB recovers all-or-nothing, so each batch in it is atomic
// and batches reach disk in Submit order.
//
// Reads see batches still in the queue: Submit also records each operation in
// an overlay (key -> newest pending value or deletion) that Get and Scan
// consult before RocksDB; the writer drops overlay entries once RocksDB holds
// them.
//
// Backpressure. The batches submitted but not yet durable may hold at most
// RocksDbOptions::max_queued_bytes of WriteBatch::byte_size(); a Submit that
// would go beyond it waits until the writer makes room (a batch bigger than the
// whole limit waits for an empty queue and then goes alone). So a slow disk
// slows submitters down instead of growing memory without bound. Memory held
// is about twice the limit (queue plus overlay). WaitForRoom() waits the same
// way without submitting, for callers that then SubmitNoWait() under a lock
// of their own (meta_store.h); their batches may exceed the limit by about
// one batch per such thread.
//
// On disk: an ordinary RocksDB database in `dir`. User keys live in the
// default column family; column family "ckpt_internal" holds the format key
// "format_version" = "1", written when the store is created and checked on
// every open. Acknowledged batches (AwaitDurable returned OK) survive kill -9
// and power loss (WAL synced before the acknowledgement): proven by
// tests/server/meta/store/rocksdb_meta_store_powercut_test.cc, which drops
// everything RocksDB wrote but did not sync (a simulated power cut) and finds
// every acknowledged change after reopening.
//
// Shutdown: the destructor stops the writer after it has written everything
// already queued, joins it and closes the database (errors are logged).
//
// Thread safety: as for MetaStore (meta_store.h).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/meta/store/meta_store.h"

namespace rocksdb {
class FileSystem;
}  // namespace rocksdb

namespace ckpt::meta {

struct RocksDbOptions {
  // Bound on the byte_size() of batches submitted but not yet durable; Submit
  // waits beyond it (see "Backpressure" above). Must be > 0.
  size_t max_queued_bytes = 64 << 20;

  // Test seam: called on the writer thread before each group's write; an
  // error fails the group exactly as a RocksDB write error would.
  WriteHook test_write_hook;

  // Test seam: the format version written into a store this call creates
  // (empty: kMetaStoreFormatVersion), to test the check on the next open.
  std::string test_create_format_version;

  // Test seam: the file system RocksDB does all its I/O through (null: the
  // real one), e.g. a power-cut simulation that drops unsynced writes.
  std::shared_ptr<rocksdb::FileSystem> test_file_system;

  // Test seam: false writes each group without sync (WriteOptions::sync =
  // false), so acknowledged batches are NOT durable; only for proving that
  // the power-cut test detects the loss. Never false in production.
  bool test_sync_writes = true;
};

// The on-disk format this build reads and writes.
inline constexpr char kMetaStoreFormatVersion[] = "1";

// Opens the store in directory `dir`, creating the directory (and parents) and
// an empty store if missing, and starts its writer thread. Blocks for the
// duration of RocksDB's recovery (WAL replay).
// Errors, each naming `dir` and, where there is one, RocksDB's message:
//   InvalidArgument     bad options, or `dir` is not a directory
//   FailedPrecondition  another process (or another store in this process)
//                       has the store open (RocksDB LOCK); the directory holds
//                       a different format version; or it holds a RocksDB
//                       database that is not a ckpt meta store
//   PermissionDenied    the directory or its files may not be accessed
//   ResourceExhausted   disk full
//   DataLoss            RocksDB found corruption
//   Unavailable         other I/O errors (retrying may help)
//   Internal            anything else
absl::StatusOr<std::unique_ptr<MetaStore>> OpenRocksDbMetaStore(
    const std::string& dir, const RocksDbOptions& opts = {});

}  // namespace ckpt::meta
