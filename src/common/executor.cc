#include "common/executor.h"

#include <pthread.h>

#include <atomic>
#include <memory>

#include "common/lock_check.h"

namespace ckpt {

Executor::Executor(std::string name, int threads, size_t max_queued)
    : name_(std::move(name)), max_queued_(max_queued) {
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] {
      // Linux thread names are at most 15 characters.
      pthread_setname_np(pthread_self(), name_.substr(0, 15).c_str());
      Loop();
    });
  }
}

Executor::~Executor() { Stop(); }

bool Executor::TrySubmit(std::function<void()> fn) {
  CheckedLock lock(&mu_);
  if (stopping_ || queue_.size() >= max_queued_ || threads_.empty()) return false;
  queue_.push_back(std::move(fn));
  return true;
}

void Executor::RunAll(std::vector<std::function<void()>> fns) {
  if (fns.empty()) return;
  struct Group {
    absl::Mutex mu;
    size_t left ABSL_GUARDED_BY(mu) = 0;
  };
  auto group = std::make_shared<Group>();
  std::vector<std::function<void()>> inline_fns;
  // The first function always runs here: the caller is not idle meanwhile.
  inline_fns.push_back(std::move(fns[0]));
  for (size_t i = 1; i < fns.size(); ++i) {
    {
      CheckedLock lock(&group->mu);
      group->left++;
    }
    auto wrapped = [group, fn = std::move(fns[i])] {
      fn();
      CheckedLock lock(&group->mu);
      group->left--;
    };
    // Refused (full or stopping): it runs here, and counts itself down as it
    // would on the pool (counting it down here too wrapped `left` below zero
    // and the wait below never ended).
    if (!TrySubmit(wrapped)) inline_fns.push_back(std::move(wrapped));
  }
  for (auto& fn : inline_fns) fn();
  CheckedLock lock(&group->mu);
  group->mu.Await(absl::Condition(
      +[](size_t* left) { return *left == 0; }, &group->left));
}

void Executor::Loop() {
  for (;;) {
    std::function<void()> fn;
    {
      CheckedLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping and drained
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    fn();
  }
}

void Executor::Stop() {
  absl::MutexLock join(&join_mu_);  // a gate held across the join by design (not a CheckedLock)
  {
    CheckedLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

size_t Executor::queued() const {
  CheckedLock lock(&mu_);
  return queue_.size();
}

}  // namespace ckpt
