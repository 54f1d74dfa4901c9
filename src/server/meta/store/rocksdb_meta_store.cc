#include "server/meta/store/rocksdb_meta_store.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "rocksdb/db.h"
#include "rocksdb/env.h"
#include "rocksdb/options.h"
#include "rocksdb/slice.h"
#include "rocksdb/statistics.h"
#include "rocksdb/status.h"
#include "rocksdb/write_batch.h"

namespace ckpt::meta {
namespace {

namespace fs = std::filesystem;

// Column family holding the store's own keys, apart from the service's.
constexpr char kInternalCf[] = "ckpt_internal";
constexpr char kFormatKey[] = "format_version";
// pthread names are limited to 15 characters.
constexpr char kWriterThreadName[] = "ckpt-meta-wal";

rocksdb::Slice ToSlice(std::string_view s) { return rocksdb::Slice(s.data(), s.size()); }
std::string_view ToView(const rocksdb::Slice& s) { return std::string_view(s.data(), s.size()); }

// Translates a RocksDB status into the store's codes (rocksdb_meta_store.h),
// with `what` and the store's directory in the message.
absl::Status FromRocks(const rocksdb::Status& s, absl::string_view what, const std::string& dir) {
  if (s.ok()) return absl::OkStatus();
  const std::string message = absl::StrCat(what, " '", dir, "': ", s.ToString());
  if (s.IsNoSpace()) return absl::ResourceExhaustedError(message);
  if (s.IsCorruption()) return absl::DataLossError(message);
  if (s.IsInvalidArgument() || s.IsNotSupported()) return absl::InvalidArgumentError(message);
  if (s.IsIOError()) {
    // RocksDB's LOCK file is held: "While lock file: <dir>/LOCK: Resource
    // temporarily unavailable" (another process) or "lock hold by current
    // process" (another store object in this one).
    if (absl::StrContains(message, "While lock file") ||
        absl::StrContains(message, "lock hold by current process")) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, " '", dir, "': the store is already open in another process or store object (",
          s.ToString(), ")"));
    }
    if (absl::StrContains(message, "Permission denied")) return absl::PermissionDeniedError(message);
    return absl::UnavailableError(message);
  }
  if (s.IsBusy() || s.IsTryAgain() || s.IsTimedOut()) return absl::UnavailableError(message);
  return absl::InternalError(message);
}

absl::Status FromException(const std::exception& e, absl::string_view what,
                           const std::string& dir) {
  return absl::InternalError(absl::StrCat(what, " '", dir, "': exception: ", e.what()));
}

// What a store's RocksDB needs besides the database: the Env its I/O goes
// through (set only when a test passes its own file system) and the
// statistics whose WAL_FILE_SYNCED ticker stats().fsyncs reports. Must
// outlive the database.
struct Engine {
  std::unique_ptr<rocksdb::Env> env;  // null: rocksdb::Env::Default()
  std::shared_ptr<rocksdb::Statistics> statistics;
};

// Options for a small metadata database on a 2-core machine: two background
// threads, default WAL (synced by every write), a bounded WAL total so the
// rarely written internal column family does not pin old WAL files, and a
// few small info logs.
rocksdb::Options StoreOptions(const Engine& engine) {
  rocksdb::Options options;
  if (engine.env != nullptr) options.env = engine.env.get();
  options.statistics = engine.statistics;
  options.IncreaseParallelism(2);
  options.create_if_missing = true;
  options.create_missing_column_families = true;
  options.max_total_wal_size = 128 << 20;
  options.keep_log_file_num = 4;
  options.max_log_file_size = 8 << 20;
  return options;
}

class RocksDbMetaStore final : public MetaStore {
 public:
  // Takes ownership of `engine`, `db` and both column family handles.
  RocksDbMetaStore(std::string dir, RocksDbOptions opts, Engine engine, rocksdb::DB* db,
                   rocksdb::ColumnFamilyHandle* data_cf, rocksdb::ColumnFamilyHandle* internal_cf)
      : dir_(std::move(dir)),
        opts_(std::move(opts)),
        engine_(std::move(engine)),
        db_(db),
        data_cf_(data_cf),
        internal_cf_(internal_cf) {}

  RocksDbMetaStore(const RocksDbMetaStore&) = delete;
  RocksDbMetaStore& operator=(const RocksDbMetaStore&) = delete;

  // Drains the queue, joins the writer, closes the database.
  ~RocksDbMetaStore() override {
    if (writer_.joinable()) {
      {
        absl::MutexLock lock(&mu_);
        stopping_ = true;
        work_cv_.Signal();
      }
      writer_.join();
    }
    try {
      for (rocksdb::ColumnFamilyHandle* cf : {data_cf_, internal_cf_}) {
        absl::Status s =
            FromRocks(db_->DestroyColumnFamilyHandle(cf), "closing column family of meta store", dir_);
        if (!s.ok()) log::Error("{}", s.ToString());
      }
      absl::Status s = FromRocks(db_->Close(), "closing meta store", dir_);
      if (!s.ok()) log::Error("{}", s.ToString());
      delete db_;
    } catch (const std::exception& e) {
      log::Error("{}", FromException(e, "closing meta store", dir_).ToString());
    }
  }

  // Checks the format key, writing it into an empty store (a new one, or one
  // whose creation was interrupted before the key was written). `created` is
  // set when the key was written.
  absl::Status CheckFormat(bool* created) {
    *created = false;
    std::string version;
    rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), internal_cf_, kFormatKey, &version);
    if (s.ok()) {
      if (version == kMetaStoreFormatVersion) return absl::OkStatus();
      return absl::FailedPreconditionError(absl::StrCat(
          "meta store '", dir_, "' has format version \"", version, "\"; this build reads version \"",
          kMetaStoreFormatVersion, "\" (use a matching ckpt-meta or a new --data-dir)"));
    }
    if (!s.IsNotFound()) return FromRocks(s, "reading format version of meta store", dir_);
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), data_cf_));
    it->SeekToFirst();
    CKPT_RETURN_IF_ERROR(FromRocks(it->status(), "reading meta store", dir_));
    if (it->Valid()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "meta store '", dir_, "' holds keys but no format version: not a ckpt meta store"));
    }
    const std::string new_version = opts_.test_create_format_version.empty()
                                         ? std::string(kMetaStoreFormatVersion)
                                         : opts_.test_create_format_version;
    rocksdb::WriteBatch batch;
    CKPT_RETURN_IF_ERROR(FromRocks(batch.Put(internal_cf_, kFormatKey, new_version),
                                   "creating meta store", dir_));
    rocksdb::WriteOptions wo;
    wo.sync = true;
    CKPT_RETURN_IF_ERROR(FromRocks(db_->Write(wo, &batch), "creating meta store", dir_));
    // Flush the internal family at once so its one entry does not keep this
    // WAL file alive.
    CKPT_RETURN_IF_ERROR(
        FromRocks(db_->Flush(rocksdb::FlushOptions(), internal_cf_), "creating meta store", dir_));
    *created = true;
    return absl::OkStatus();
  }

  // Starts the writer thread. Throws std::system_error if it cannot.
  void Start() {
    // stats().fsyncs counts the WAL syncs from here on (not the format key's).
    fsyncs_at_start_ = WalSyncs();
    writer_ = std::thread([this] { WriterLoop(); });
  }

  absl::StatusOr<std::string> Get(std::string_view key) override {
    {
      absl::MutexLock lock(&mu_);
      if (!write_error_.ok()) return internal::RefusedAfterWriteError(write_error_);
      auto it = overlay_.find(key);
      if (it != overlay_.end()) {
        if (!it->second.value.has_value()) return internal::KeyNotFound(key);
        return *it->second.value;
      }
    }
    // Not pending: RocksDB already holds every submitted change to `key` (the
    // writer drops overlay entries only after writing them).
    std::string value;
    rocksdb::Status s;
    try {
      s = db_->Get(rocksdb::ReadOptions(), data_cf_, ToSlice(key), &value);
    } catch (const std::exception& e) {
      return FromException(e, "reading meta store", dir_);
    }
    if (s.IsNotFound()) return internal::KeyNotFound(key);
    CKPT_RETURN_IF_ERROR(FromRocks(s, "reading meta store", dir_));
    return value;
  }

  absl::Status Scan(std::string_view prefix,
                    const std::function<bool(std::string_view, std::string_view)>& fn) override {
    try {
      return ScanImpl(prefix, fn);
    } catch (const std::exception& e) {
      return FromException(e, "scanning meta store", dir_);
    }
  }

  uint64_t Submit(WriteBatch batch) override { return SubmitImpl(std::move(batch), /*wait=*/true); }

  uint64_t SubmitNoWait(WriteBatch batch) override {
    return SubmitImpl(std::move(batch), /*wait=*/false);
  }

  void WaitForRoom() override {
    absl::MutexLock lock(&mu_);
    if (write_error_.ok() && pending_bytes_ >= opts_.max_queued_bytes) {
      ++stats_.submit_waits;
      while (write_error_.ok() && pending_bytes_ >= opts_.max_queued_bytes) room_cv_.Wait(&mu_);
    }
  }

  uint64_t SubmitImpl(WriteBatch batch, bool wait) {
    const size_t bytes = batch.byte_size();
    // The batch's overlay entries (its last change of each key), allocated
    // before taking the lock and spliced into overlay_ under it.
    Overlay changes;
    for (const WriteBatch::Op& op : batch.ops()) {
      OverlayEntry& entry = changes[op.key];
      if (op.type == WriteBatch::OpType::kPut) {
        entry.value = op.value;
      } else {
        entry.value.reset();
      }
    }
    absl::MutexLock lock(&mu_);
    if (wait && write_error_.ok() && !HasRoom(bytes)) {
      ++stats_.submit_waits;
      while (write_error_.ok() && !HasRoom(bytes)) room_cv_.Wait(&mu_);
    }
    const uint64_t seq = last_seq_.load(std::memory_order_relaxed) + 1;
    last_seq_.store(seq, std::memory_order_release);
    if (!write_error_.ok()) return seq;  // refused; AwaitDurable reports it
    for (auto& [key, entry] : changes) entry.seq = seq;
    overlay_.merge(changes);  // moves the nodes of keys not pending yet
    for (auto& [key, entry] : changes) overlay_.find(key)->second = std::move(entry);
    pending_bytes_ += bytes;
    const bool was_empty = queue_.empty();
    queue_.push_back(Pending{seq, std::move(batch)});
    if (was_empty) work_cv_.Signal();
    return seq;
  }

  absl::Status AwaitDurable(uint64_t seq) override {
    const uint64_t last = last_seq_.load(std::memory_order_acquire);
    if (seq > last) {
      return absl::InvalidArgumentError(absl::StrCat(
          "AwaitDurable(", seq, "): no such batch (last submitted is ", last, ")"));
    }
    // Lock-free wait on the completion counter: the writer wakes every waiter
    // of a group with one futex call, and they return without queueing on mu_.
    for (;;) {
      const uint32_t completions = completions_.load(std::memory_order_acquire);
      if (durable_seq_.load(std::memory_order_acquire) >= seq) return absl::OkStatus();
      if (failed_.load(std::memory_order_acquire)) break;
      completions_.wait(completions, std::memory_order_acquire);
    }
    absl::MutexLock lock(&mu_);
    // Durability may have been published just before the failure.
    if (seq < failed_from_seq_) return absl::OkStatus();
    if (seq < refused_from_seq_) return write_error_;
    return internal::RefusedAfterWriteError(write_error_);
  }

  StoreStats stats() override {
    StoreStats stats;
    {
      absl::MutexLock lock(&mu_);
      stats = stats_;
      stats.queued_bytes = pending_bytes_;
    }
    stats.fsyncs = WalSyncs() - fsyncs_at_start_;
    return stats;
  }

 private:
  struct Pending {
    uint64_t seq;
    WriteBatch batch;
  };
  // The newest submitted-but-not-written change of a key.
  struct OverlayEntry {
    std::optional<std::string> value;  // nullopt: deleted
    uint64_t seq = 0;                  // the batch that made it
  };
  using Overlay = std::map<std::string, OverlayEntry, std::less<>>;

  // WAL syncs RocksDB has done since it opened (its WAL_FILE_SYNCED ticker:
  // one per write with sync=true that succeeded, plus explicit WAL syncs), so
  // a write without sync is not counted as one.
  uint64_t WalSyncs() const {
    return engine_.statistics->getTickerCount(rocksdb::WAL_FILE_SYNCED);
  }

  bool HasRoom(size_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return pending_bytes_ == 0 || pending_bytes_ + bytes <= opts_.max_queued_bytes;
  }

  absl::Status ScanImpl(std::string_view prefix,
                        const std::function<bool(std::string_view, std::string_view)>& fn) {
    // One consistent view: the pending changes and a RocksDB iterator (an
    // implicit snapshot) taken under one lock. Changes the writer has written
    // but not yet dropped from the overlay appear in both; the overlay wins,
    // and holds the same or a newer value.
    std::vector<std::pair<std::string, std::optional<std::string>>> pending;
    std::unique_ptr<rocksdb::Iterator> it;
    {
      absl::MutexLock lock(&mu_);
      if (!write_error_.ok()) return internal::RefusedAfterWriteError(write_error_);
      for (auto p = overlay_.lower_bound(prefix);
           p != overlay_.end() && internal::HasPrefix(p->first, prefix); ++p) {
        pending.emplace_back(p->first, p->second.value);
      }
      it.reset(db_->NewIterator(rocksdb::ReadOptions(), data_cf_));
    }
    const rocksdb::Slice prefix_slice = ToSlice(prefix);
    it->Seek(prefix_slice);
    size_t i = 0;
    for (;;) {
      const bool db_valid = it->Valid() && it->key().starts_with(prefix_slice);
      if (!it->Valid()) CKPT_RETURN_IF_ERROR(FromRocks(it->status(), "scanning meta store", dir_));
      const bool pending_valid = i < pending.size();
      if (!db_valid && !pending_valid) break;
      int cmp = !db_valid ? 1 : !pending_valid ? -1 : it->key().compare(ToSlice(pending[i].first));
      if (cmp < 0) {
        if (!fn(ToView(it->key()), ToView(it->value()))) return absl::OkStatus();
        it->Next();
        continue;
      }
      if (cmp == 0) it->Next();  // the pending change supersedes the stored value
      const auto& [key, value] = pending[i++];
      if (value.has_value() && !fn(key, *value)) return absl::OkStatus();
    }
    return absl::OkStatus();
  }

  // Merges `group` into one RocksDB batch and writes it with sync (unless a
  // test turned sync off). Sets `*wrote` if a write happened, `*payload_bytes`
  // to its size.
  absl::Status WriteGroup(const std::deque<Pending>& group, bool* wrote, uint64_t* payload_bytes) {
    *wrote = false;
    *payload_bytes = 0;
    try {
      rocksdb::WriteBatch merged;
      for (const Pending& p : group) {
        for (const WriteBatch::Op& op : p.batch.ops()) {
          rocksdb::Status s = op.type == WriteBatch::OpType::kPut
                                  ? merged.Put(data_cf_, op.key, op.value)
                                  : merged.Delete(data_cf_, op.key);
          CKPT_RETURN_IF_ERROR(FromRocks(s, "building write for meta store", dir_));
        }
      }
      if (merged.Count() == 0) return absl::OkStatus();  // only empty batches
      if (opts_.test_write_hook) {
        CKPT_RETURN_IF_ERROR(Annotate(opts_.test_write_hook(),
                                      absl::StrCat("writing meta store '", dir_, "'")));
      }
      rocksdb::WriteOptions wo;
      wo.sync = opts_.test_sync_writes;
      *wrote = true;
      *payload_bytes = merged.GetDataSize();
      return FromRocks(db_->Write(wo, &merged), "writing meta store", dir_);
    } catch (const std::exception& e) {
      return FromException(e, "writing meta store", dir_);
    }
  }

  void WriterLoop() {
    pthread_setname_np(pthread_self(), kWriterThreadName);
    for (;;) {
      std::deque<Pending> group;
      {
        absl::MutexLock lock(&mu_);
        while (queue_.empty() && !stopping_) work_cv_.Wait(&mu_);
        if (queue_.empty()) return;  // stopping, and everything is written
        group.swap(queue_);          // every batch queued so far
      }
      bool wrote = false;
      uint64_t payload_bytes = 0;
      const absl::Status status = WriteGroup(group, &wrote, &payload_bytes);
      if (!status.ok()) {
        log::Error("meta store write of batches {}..{} failed; refusing further writes: {}",
                   group.front().seq, last_seq_.load(), status.ToString());
      }
      Publish(group, status, wrote, payload_bytes);
      // Wake every AwaitDurable at once (they need no lock to return).
      completions_.fetch_add(1, std::memory_order_release);
      completions_.notify_all();
    }
  }

  // Records the outcome of writing `group`.
  void Publish(const std::deque<Pending>& group, const absl::Status& status, bool wrote,
               uint64_t payload_bytes) {
    absl::MutexLock lock(&mu_);
    if (status.ok()) {
      const uint64_t durable = group.back().seq;
      durable_seq_.store(durable, std::memory_order_release);
      for (const Pending& p : group) {
        pending_bytes_ -= p.batch.byte_size();
        // Drop the overlay entries RocksDB now holds (unless a later pending
        // batch changed the key again).
        for (const WriteBatch::Op& op : p.batch.ops()) {
          auto it = overlay_.find(op.key);
          if (it != overlay_.end() && it->second.seq <= durable) overlay_.erase(it);
        }
      }
      stats_.batches_written += group.size();
      if (wrote) stats_.bytes_written += payload_bytes;
    } else {
      // Sticky: this group and every batch queued behind it fail with
      // `status`; later Submits are refused. The daemon must restart.
      write_error_ = status;
      failed_from_seq_ = group.front().seq;
      refused_from_seq_ = last_seq_.load(std::memory_order_relaxed) + 1;
      failed_.store(true, std::memory_order_release);
      queue_.clear();
      overlay_.clear();
      pending_bytes_ = 0;
    }
    room_cv_.SignalAll();
  }

  const std::string dir_;
  const RocksDbOptions opts_;
  const Engine engine_;  // outlives db_ (deleted by the destructor's body)
  rocksdb::DB* const db_;                         // owned
  rocksdb::ColumnFamilyHandle* const data_cf_;      // owned; the service's keys
  rocksdb::ColumnFamilyHandle* const internal_cf_;  // owned; the format key

  absl::Mutex mu_;
  // Signalled when the queue becomes non-empty or stopping_ is set.
  absl::CondVar work_cv_;
  // Signalled after each group: pending_bytes_ went down.
  absl::CondVar room_cv_;
  // Submitted batches the writer has not taken yet, in seq order.
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  // Pending changes per key, for reads; see OverlayEntry.
  Overlay overlay_ ABSL_GUARDED_BY(mu_);
  // The last seq handed out. Written under mu_; read without it by AwaitDurable.
  std::atomic<uint64_t> last_seq_{0};
  // Every seq <= this is durable. Written by the writer under mu_.
  std::atomic<uint64_t> durable_seq_{0};
  // Set (under mu_, with write_error_) once a write has failed.
  std::atomic<bool> failed_{false};
  // Incremented, and waited on by AwaitDurable, after each group's outcome is
  // published in durable_seq_ / failed_.
  std::atomic<uint32_t> completions_{0};
  // byte_size() of batches submitted and not yet durable (queued or being written).
  size_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The first write error (OK: none), the first batch it failed, and the first
  // batch submitted after it was known (refused rather than failed).
  absl::Status write_error_ ABSL_GUARDED_BY(mu_);
  uint64_t failed_from_seq_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t refused_from_seq_ ABSL_GUARDED_BY(mu_) = 0;
  StoreStats stats_ ABSL_GUARDED_BY(mu_);  // all but fsyncs and queued_bytes
  // WalSyncs() when the writer started; set before it starts.
  uint64_t fsyncs_at_start_ = 0;

  // The group-commit writer; started by Start(), joined by the destructor.
  std::thread writer_;
};

// Whether `dir` holds a RocksDB database whose default column family has keys.
// Opened read-only: takes no lock and changes nothing.
absl::StatusOr<bool> HasUserKeys(const std::string& dir, const Engine& engine) {
  rocksdb::Options options;
  if (engine.env != nullptr) options.env = engine.env.get();
  rocksdb::DB* raw = nullptr;
  CKPT_RETURN_IF_ERROR(FromRocks(rocksdb::DB::OpenForReadOnly(options, dir, &raw),
                                 "opening meta store (read-only check)", dir));
  std::unique_ptr<rocksdb::DB> db(raw);
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
  it->SeekToFirst();
  CKPT_RETURN_IF_ERROR(FromRocks(it->status(), "reading meta store", dir));
  return it->Valid();
}

absl::StatusOr<std::unique_ptr<MetaStore>> OpenImpl(const std::string& dir,
                                                    const RocksDbOptions& opts) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir)) {
    std::string why = ec ? ec.message() : "not a directory";
    if (ec == std::errc::permission_denied) {
      return absl::PermissionDeniedError(absl::StrCat("creating meta store directory '", dir, "': ", why));
    }
    if (ec && ec != std::errc::file_exists && ec != std::errc::not_a_directory) {
      return absl::UnavailableError(absl::StrCat("creating meta store directory '", dir, "': ", why));
    }
    return absl::InvalidArgumentError(absl::StrCat("meta store path '", dir, "': ", why));
  }

  Engine engine;
  if (opts.test_file_system != nullptr) engine.env = rocksdb::NewCompositeEnv(opts.test_file_system);
  engine.statistics = rocksdb::CreateDBStatistics();
  engine.statistics->set_stats_level(rocksdb::StatsLevel::kExceptHistogramOrTimers);
  const rocksdb::Options options = StoreOptions(engine);
  if (fs::exists(fs::path(dir) / "CURRENT")) {
    // An existing database. Refuse one that is not ours before opening it
    // read-write (which would add our column family to it); a database with
    // no keys and no internal family is ours, its creation cut short.
    std::vector<std::string> families;
    CKPT_RETURN_IF_ERROR(FromRocks(rocksdb::DB::ListColumnFamilies(options, dir, &families),
                                   "opening meta store", dir));
    if (std::find(families.begin(), families.end(), kInternalCf) == families.end()) {
      bool foreign = families.size() != 1;  // we never make other families
      if (!foreign) {
        CKPT_ASSIGN_OR_RETURN(foreign, HasUserKeys(dir, engine));
      }
      if (foreign) {
        return absl::FailedPreconditionError(absl::StrCat(
            "'", dir, "' holds a RocksDB database that is not a ckpt meta store "
            "(no column family \"", kInternalCf, "\")"));
      }
    }
  }

  std::vector<rocksdb::ColumnFamilyDescriptor> descriptors = {
      {rocksdb::kDefaultColumnFamilyName, rocksdb::ColumnFamilyOptions(options)},
      {kInternalCf, rocksdb::ColumnFamilyOptions(options)},
  };
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* db = nullptr;
  CKPT_RETURN_IF_ERROR(FromRocks(rocksdb::DB::Open(rocksdb::DBOptions(options), dir, descriptors,
                                                   &handles, &db),
                                 "opening meta store", dir));
  auto store = std::make_unique<RocksDbMetaStore>(dir, opts, std::move(engine), db, handles[0],
                                                  handles[1]);
  bool created = false;
  CKPT_RETURN_IF_ERROR(store->CheckFormat(&created));
  store->Start();
  log::Info("{} meta store at '{}' (format version {})", created ? "created" : "opened", dir,
            kMetaStoreFormatVersion);
  return store;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetaStore>> OpenRocksDbMetaStore(const std::string& dir,
                                                               const RocksDbOptions& opts) {
  if (dir.empty()) return absl::InvalidArgumentError("meta store directory must not be empty");
  if (opts.max_queued_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("meta store '", dir, "': max_queued_bytes must be > 0"));
  }
  try {
    return OpenImpl(dir, opts);
  } catch (const std::exception& e) {
    return FromException(e, "opening meta store", dir);
  }
}

}  // namespace ckpt::meta
