#include "server/meta/store/mem_meta_store.h"

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"

namespace ckpt::meta {
namespace {

class MemMetaStore final : public MetaStore {
 public:
  explicit MemMetaStore(MemMetaStoreOptions options) : options_(std::move(options)) {}

  absl::StatusOr<std::string> Get(std::string_view key) override {
    absl::MutexLock lock(&mu_);
    if (!write_error_.ok()) return internal::RefusedAfterWriteError(write_error_);
    auto it = data_.find(key);
    if (it == data_.end()) return internal::KeyNotFound(key);
    return it->second;
  }

  absl::Status Scan(std::string_view prefix,
                    const std::function<bool(std::string_view, std::string_view)>& fn) override {
    // Copy the range so that fn runs without the lock (it may call back).
    std::vector<std::pair<std::string, std::string>> range;
    {
      absl::MutexLock lock(&mu_);
      if (!write_error_.ok()) return internal::RefusedAfterWriteError(write_error_);
      for (auto it = data_.lower_bound(prefix);
           it != data_.end() && internal::HasPrefix(it->first, prefix); ++it) {
        range.emplace_back(it->first, it->second);
      }
    }
    for (const auto& [key, value] : range) {
      if (!fn(key, value)) break;
    }
    return absl::OkStatus();
  }

  uint64_t Submit(WriteBatch batch) override {
    absl::Status hook_status;
    if (!batch.empty() && options_.test_write_hook) hook_status = options_.test_write_hook();
    absl::MutexLock lock(&mu_);
    const uint64_t seq = ++last_seq_;
    if (!write_error_.ok()) return seq;  // refused: AwaitDurable reports it
    if (!hook_status.ok()) {
      write_error_ = Annotate(hook_status, "in-memory meta store write");
      failed_from_seq_ = seq;
      refused_from_seq_ = seq + 1;
      data_.clear();  // reads are refused from now on; free the memory
      return seq;
    }
    for (const WriteBatch::Op& op : batch.ops()) {
      if (op.type == WriteBatch::OpType::kPut) {
        data_.insert_or_assign(op.key, op.value);
      } else {
        auto it = data_.find(op.key);
        if (it != data_.end()) data_.erase(it);
      }
      stats_.bytes_written += op.key.size() + op.value.size();
    }
    ++stats_.batches_written;
    if (!batch.empty()) ++stats_.fsyncs;
    return seq;
  }

  absl::Status AwaitDurable(uint64_t seq) override {
    absl::MutexLock lock(&mu_);
    if (seq > last_seq_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "AwaitDurable(", seq, "): no such batch (last submitted is ", last_seq_, ")"));
    }
    if (write_error_.ok() || seq < failed_from_seq_) return absl::OkStatus();
    if (seq < refused_from_seq_) return write_error_;
    return internal::RefusedAfterWriteError(write_error_);
  }

  StoreStats stats() override {
    absl::MutexLock lock(&mu_);
    return stats_;
  }

 private:
  const MemMetaStoreOptions options_;

  absl::Mutex mu_;
  std::map<std::string, std::string, std::less<>> data_ ABSL_GUARDED_BY(mu_);
  uint64_t last_seq_ ABSL_GUARDED_BY(mu_) = 0;
  // The first write error (OK: none), the batch it failed, and the first batch
  // submitted after it was known (refused rather than failed).
  absl::Status write_error_ ABSL_GUARDED_BY(mu_);
  uint64_t failed_from_seq_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t refused_from_seq_ ABSL_GUARDED_BY(mu_) = 0;
  StoreStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<MetaStore> NewMemMetaStore(MemMetaStoreOptions options) {
  return std::make_unique<MemMetaStore>(std::move(options));
}

}  // namespace ckpt::meta
