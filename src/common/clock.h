// Clock: the one way ckpt code reads time or waits for it.
//
// Everything time-dependent (leases, heartbeats, flush schedules, retry backoff,
// deadlines) takes a Clock*, so unit tests drive time with FakeClock and never
// sleep or read the wall clock.
//
// Thread safety: all methods of both implementations may be called from any
// thread concurrently.
#pragma once

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ckpt {

class Clock {
 public:
  virtual ~Clock() = default;

  // Current time. For RealClock this is the wall clock (use it for timestamps
  // shown to people or stored); durations between two Now() calls may jump if
  // the system clock is stepped, so deadlines use MonotonicNow().
  virtual absl::Time Now() = 0;

  // A time that never goes backwards, from an arbitrary origin. Only
  // differences between two values are meaningful.
  virtual absl::Time MonotonicNow() = 0;

  // Blocks the calling thread until MonotonicNow() has advanced by `d`.
  // Returns at once for d <= 0.
  virtual void SleepFor(absl::Duration d) = 0;

  // Blocks until `cond` holds (evaluated under `mu`, which the caller holds)
  // or `timeout` has elapsed on this clock; returns whether `cond` holds.
  // Like absl::Mutex::AwaitWithTimeout, but on this clock's time.
  virtual bool AwaitWithTimeout(absl::Mutex* mu, const absl::Condition& cond,
                                absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;

  // Convenience: milliseconds since the Unix epoch of Now().
  int64_t NowUnixMillis() { return absl::ToUnixMillis(Now()); }
};

// The process-wide real clock (absl::Now / steady_clock). Never destroyed.
Clock* RealClock();

// A clock that moves only when told. Now() starts at `start` (default: a fixed
// date, 2026-01-01T00:00:00Z) and MonotonicNow() moves in step with it.
// Threads blocked in SleepFor / AwaitWithTimeout wake when Advance() moves
// time past their deadline (or, for AwaitWithTimeout, when their condition
// becomes true; conditions are re-evaluated on every mutex release as usual
// and on every Advance()).
class FakeClock : public Clock {
 public:
  FakeClock();
  explicit FakeClock(absl::Time start);

  absl::Time Now() override;
  absl::Time MonotonicNow() override;
  void SleepFor(absl::Duration d) override;
  bool AwaitWithTimeout(absl::Mutex* mu, const absl::Condition& cond,
                        absl::Duration timeout) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Moves time forward by `d` (>= 0) and wakes waiters whose deadline passed.
  void Advance(absl::Duration d);

  // Number of threads currently blocked in SleepFor / AwaitWithTimeout.
  int NumWaiters();

  // Blocks (on real time, without timeout) until at least `n` threads are
  // waiting on this clock. Lets a test advance time only once the code under
  // test is parked, with no sleeps and no races.
  void BlockUntilWaiters(int n);

 private:
  absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
  absl::Duration elapsed_ ABSL_GUARDED_BY(mu_);
  int waiters_ ABSL_GUARDED_BY(mu_) = 0;
  // Bumped on every Advance(), so waiters on other mutexes notice.
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt
