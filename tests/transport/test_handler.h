// TestHandler: a recording Handler for transport tests.
//
// Allocate gives each payload a fresh buffer cut into `pieces` pieces (or
// defers to the `allocate` hook); OnReceived records the message, its status
// and, by default, the bytes. Waits are bounded so a broken transport fails
// a test instead of hanging it.
//
// Thread safety: callbacks run on the transport's thread; the accessors and
// waits may be called from any thread. Set the hooks before Start().
#pragma once

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace ckpt::transport {

class TestHandler : public Handler {
 public:
  struct Got {
    Inbound msg;
    absl::Status status;
    std::vector<std::byte> bytes;  // default allocation only
  };

  int pieces = 1;
  absl::Status allocate_error;  // non-OK: Allocate refuses with it
  std::function<absl::StatusOr<MutablePieces>(const Inbound&)> allocate;
  std::function<void(const Inbound&, const absl::Status&)> on_received;
  bool keep_bytes = true;

  absl::StatusOr<MutablePieces> Allocate(const Inbound& msg) override {
    {
      absl::MutexLock lock(&mu_);
      ++allocations_;
    }
    if (!allocate_error.ok()) return allocate_error;
    if (allocate) return allocate(msg);
    absl::MutexLock lock(&mu_);
    std::vector<std::byte>& buf = buffers_[msg.header];
    buf.assign(msg.payload_bytes, std::byte{0});
    MutablePieces out;
    const uint64_t step = msg.payload_bytes / pieces;
    uint64_t off = 0;
    for (int i = 0; i < pieces; ++i) {
      const uint64_t n = i + 1 == pieces ? msg.payload_bytes - off : step;
      out.push_back(std::span<std::byte>(buf.data() + off, n));
      off += n;
    }
    return out;
  }

  void OnReceived(const Inbound& msg, const absl::Status& status) override {
    if (on_received) on_received(msg, status);
    absl::MutexLock lock(&mu_);
    Got g{msg, status, {}};
    auto it = buffers_.find(msg.header);
    if (it != buffers_.end()) {
      if (keep_bytes) g.bytes = std::move(it->second);
      buffers_.erase(it);
    }
    got_.push_back(std::move(g));
  }

  void OnPeerFailed(PeerId peer, const absl::Status& why) override {
    absl::MutexLock lock(&mu_);
    failed_.emplace_back(peer, why);
  }

  bool WaitReceived(size_t n, absl::Duration timeout = absl::Seconds(30)) {
    absl::MutexLock lock(&mu_);
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return got_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&cond), timeout);
  }
  bool WaitPeerFailed(size_t n, absl::Duration timeout = absl::Seconds(30)) {
    absl::MutexLock lock(&mu_);
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return failed_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&cond), timeout);
  }
  std::vector<Got> received() {
    absl::MutexLock lock(&mu_);
    return got_;
  }
  std::vector<std::pair<PeerId, absl::Status>> failed() {
    absl::MutexLock lock(&mu_);
    return failed_;
  }
  int allocations() {
    absl::MutexLock lock(&mu_);
    return allocations_;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::vector<std::byte>> buffers_ ABSL_GUARDED_BY(mu_);
  std::vector<Got> got_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<PeerId, absl::Status>> failed_ ABSL_GUARDED_BY(mu_);
  int allocations_ ABSL_GUARDED_BY(mu_) = 0;
};

// Collects send completions; Wait is bounded.
class DoneLog {
 public:
  SendDone Callback() {
    return [this](const absl::Status& s) {
      absl::MutexLock lock(&mu_);
      statuses_.push_back(s);
    };
  }
  bool Wait(size_t n, absl::Duration timeout = absl::Seconds(30)) {
    absl::MutexLock lock(&mu_);
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return statuses_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&cond), timeout);
  }
  std::vector<absl::Status> statuses() {
    absl::MutexLock lock(&mu_);
    return statuses_;
  }

 private:
  absl::Mutex mu_;
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
};

inline std::vector<std::byte> Pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = static_cast<std::byte>(x >> 24);
  }
  return v;
}

}  // namespace ckpt::transport
