// HeldMetaStore: a MetaStore for tests whose fsync can be held back.
//
// Every batch is applied at Submit() (reads see it at once, as with RocksDB's
// "read your writes"), but becomes durable only when the test says so: while
// Hold() is in effect, AwaitDurable(seq) blocks until Release() makes `seq`
// durable, or returns Unavailable once Crash() says the process died before
// the fsync. DurableImage() is what a restarted process would load: a fresh
// in-memory store holding only the batches made durable. So a test can show
// what a caller is told while a change is in memory but not on disk, and what
// survives a crash at that moment.
//
// on_block (optional) is called, without the store's lock, each time a
// caller is about to block in AwaitDurable: a test waits for it instead of
// sleeping.
//
// Fill() makes the write queue look full until Drain(): WaitForRoom() and
// Submit() block (after calling Fill's on_wait), SubmitNoWait() does not.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/meta/store/mem_meta_store.h"
#include "server/meta/store/meta_store.h"

namespace ckpt::meta {

class HeldMetaStore final : public MetaStore {
 public:
  explicit HeldMetaStore(std::function<void(uint64_t seq)> on_block = nullptr)
      : on_block_(std::move(on_block)) {}

  absl::StatusOr<std::string> Get(std::string_view key) override { return data_->Get(key); }
  absl::Status Scan(std::string_view prefix,
                    const std::function<bool(std::string_view, std::string_view)>& fn) override {
    return data_->Scan(prefix, fn);
  }

  uint64_t Submit(WriteBatch batch) override {
    WaitForRoom();
    return SubmitNoWait(std::move(batch));
  }

  void WaitForRoom() override {
    std::function<void()> on_wait;
    {
      absl::MutexLock lock(&mu_);
      if (!full_) return;
      on_wait = on_room_wait_;
    }
    if (on_wait) on_wait();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(+[](bool* full) { return !*full; }, &full_));
  }

  uint64_t SubmitNoWait(WriteBatch batch) override {
    absl::MutexLock lock(&mu_);
    log_.push_back(batch);
    const uint64_t seq = data_->Submit(std::move(batch));
    if (!held_ && !crashed_) durable_ = seq;
    return seq;
  }

  absl::Status AwaitDurable(uint64_t seq) override {
    {
      absl::MutexLock lock(&mu_);
      if (seq > log_.size()) {
        return absl::InvalidArgumentError(absl::StrCat("AwaitDurable(", seq, "): no such batch"));
      }
      if (seq <= durable_) return absl::OkStatus();
      if (crashed_) return Crashed(seq);
    }
    if (on_block_) on_block_(seq);
    absl::MutexLock lock(&mu_);
    auto settled = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return durable_ >= seq || crashed_; };
    mu_.Await(absl::Condition(&settled));
    if (durable_ >= seq) return absl::OkStatus();
    return Crashed(seq);
  }

  StoreStats stats() override { return data_->stats(); }

  // From now on the write queue is full until Drain(): WaitForRoom() and
  // Submit() call `on_wait` (if any, without the store's lock), then block.
  void Fill(std::function<void()> on_wait = nullptr) {
    absl::MutexLock lock(&mu_);
    full_ = true;
    on_room_wait_ = std::move(on_wait);
  }
  // Ends Fill(): the writers waiting for room go on.
  void Drain() {
    absl::MutexLock lock(&mu_);
    full_ = false;
  }

  // From now on batches stay un-synced until Release().
  void Hold() {
    absl::MutexLock lock(&mu_);
    held_ = true;
  }
  // Makes every batch submitted so far durable and stops holding.
  void Release() {
    absl::MutexLock lock(&mu_);
    held_ = false;
    if (!crashed_) durable_ = log_.size();
  }
  // The process "dies" before the held batches reach the disk: they are
  // never made durable, and their waiters get Unavailable.
  void Crash() {
    absl::MutexLock lock(&mu_);
    crashed_ = true;
  }
  // What a restarted process would find on disk.
  std::unique_ptr<MetaStore> DurableImage() {
    std::unique_ptr<MetaStore> image = NewMemMetaStore();
    absl::MutexLock lock(&mu_);
    for (uint64_t i = 0; i < durable_; ++i) {
      const uint64_t seq = image->Submit(log_[i]);
      if (!image->AwaitDurable(seq).ok()) return nullptr;
    }
    return image;
  }

 private:
  absl::Status Crashed(uint64_t seq) const {
    return absl::UnavailableError(
        absl::StrCat("batch ", seq, " was lost: the process crashed before its fsync"));
  }

  const std::function<void(uint64_t)> on_block_;
  const std::unique_ptr<MetaStore> data_ = NewMemMetaStore();
  absl::Mutex mu_;
  std::vector<WriteBatch> log_ ABSL_GUARDED_BY(mu_);
  uint64_t durable_ ABSL_GUARDED_BY(mu_) = 0;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  bool crashed_ ABSL_GUARDED_BY(mu_) = false;
  bool full_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> on_room_wait_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::meta
