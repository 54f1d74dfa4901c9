#include "common/clock.h"

#include <chrono>

namespace ckpt {
namespace {

class RealClockImpl final : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }

  absl::Time MonotonicNow() override {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch())
                        .count();
    return absl::UnixEpoch() + absl::Nanoseconds(ns);
  }

  void SleepFor(absl::Duration d) override {
    if (d > absl::ZeroDuration()) absl::SleepFor(d);
  }

  bool AwaitWithTimeout(absl::Mutex* mu, const absl::Condition& cond,
                        absl::Duration timeout) override {
    return mu->AwaitWithTimeout(cond, timeout);
  }
};

}  // namespace

Clock* RealClock() {
  static Clock* const clock = new RealClockImpl();
  return clock;
}

FakeClock::FakeClock() : FakeClock(absl::FromUnixSeconds(1767225600)) {}

FakeClock::FakeClock(absl::Time start) : now_(start), elapsed_(absl::ZeroDuration()) {}

absl::Time FakeClock::Now() {
  absl::MutexLock lock(&mu_);
  return now_;
}

absl::Time FakeClock::MonotonicNow() {
  absl::MutexLock lock(&mu_);
  return absl::UnixEpoch() + elapsed_;
}

void FakeClock::SleepFor(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  if (d <= absl::ZeroDuration()) return;
  const absl::Duration deadline = elapsed_ + d;
  ++waiters_;
  auto reached = [this, deadline]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return elapsed_ >= deadline;
  };
  mu_.Await(absl::Condition(&reached));
  --waiters_;
}

bool FakeClock::AwaitWithTimeout(absl::Mutex* mu, const absl::Condition& cond,
                                 absl::Duration timeout) {
  if (cond.Eval()) return true;
  absl::Duration deadline;
  {
    absl::MutexLock lock(&mu_);
    deadline = elapsed_ + timeout;
    ++waiters_;
  }
  bool ok = false;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (elapsed_ >= deadline) break;
    }
    // Wait on the caller's mutex for its condition, waking up periodically
    // (real time) to notice fake-time advances. The caller's code runs with
    // `mu` held as it would with a real clock.
    ok = mu->AwaitWithTimeout(cond, absl::Milliseconds(1));
    if (ok) break;
  }
  absl::MutexLock lock(&mu_);
  --waiters_;
  return ok;
}

void FakeClock::Advance(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  if (d < absl::ZeroDuration()) d = absl::ZeroDuration();
  now_ += d;
  elapsed_ += d;
  ++generation_;
}

int FakeClock::NumWaiters() {
  absl::MutexLock lock(&mu_);
  return waiters_;
}

void FakeClock::BlockUntilWaiters(int n) {
  absl::MutexLock lock(&mu_);
  auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return waiters_ >= n; };
  mu_.Await(absl::Condition(&enough));
}

}  // namespace ckpt
