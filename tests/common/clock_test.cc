#include "common/clock.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

namespace ckpt {
namespace {

TEST(FakeClock, StartsAtFixedTimeAndMovesOnlyWhenAdvanced) {
  FakeClock clock;
  const absl::Time t0 = clock.Now();
  EXPECT_EQ(t0, absl::FromUnixSeconds(1767225600));
  EXPECT_EQ(clock.Now(), t0);
  clock.Advance(absl::Seconds(5));
  EXPECT_EQ(clock.Now() - t0, absl::Seconds(5));
  EXPECT_EQ(clock.NowUnixMillis(), absl::ToUnixMillis(t0) + 5000);
}

TEST(FakeClock, MonotonicMovesWithNowAndNeverBack) {
  FakeClock clock;
  const absl::Time m0 = clock.MonotonicNow();
  clock.Advance(absl::Milliseconds(250));
  clock.Advance(absl::Seconds(-10));  // ignored
  EXPECT_EQ(clock.MonotonicNow() - m0, absl::Milliseconds(250));
}

TEST(FakeClock, SleepForWakesOnlyWhenTimePasses) {
  FakeClock clock;
  std::atomic<bool> woke{false};
  std::thread sleeper([&] {
    clock.SleepFor(absl::Seconds(10));
    woke = true;
  });
  clock.BlockUntilWaiters(1);
  clock.Advance(absl::Seconds(9));
  EXPECT_FALSE(woke.load());
  EXPECT_EQ(clock.NumWaiters(), 1);
  clock.Advance(absl::Seconds(1));
  sleeper.join();
  EXPECT_TRUE(woke.load());
  EXPECT_EQ(clock.NumWaiters(), 0);
}

TEST(FakeClock, SleepForZeroReturnsAtOnce) {
  FakeClock clock;
  clock.SleepFor(absl::ZeroDuration());
  clock.SleepFor(absl::Seconds(-1));
  EXPECT_EQ(clock.NumWaiters(), 0);
}

TEST(FakeClock, AwaitWithTimeoutReturnsTrueWhenConditionHolds) {
  FakeClock clock;
  absl::Mutex mu;
  bool flag = false;
  std::atomic<bool> result{false};
  std::thread waiter([&] {
    absl::MutexLock lock(&mu);
    result = clock.AwaitWithTimeout(&mu, absl::Condition(&flag), absl::Hours(1));
  });
  clock.BlockUntilWaiters(1);
  {
    absl::MutexLock lock(&mu);
    flag = true;
  }
  waiter.join();
  EXPECT_TRUE(result.load());
}

TEST(FakeClock, AwaitWithTimeoutTimesOutOnFakeTime) {
  FakeClock clock;
  absl::Mutex mu;
  bool flag = false;
  std::atomic<int> result{-1};
  std::thread waiter([&] {
    absl::MutexLock lock(&mu);
    result = clock.AwaitWithTimeout(&mu, absl::Condition(&flag), absl::Seconds(5)) ? 1 : 0;
  });
  clock.BlockUntilWaiters(1);
  clock.Advance(absl::Seconds(4));
  EXPECT_EQ(result.load(), -1);
  clock.Advance(absl::Seconds(1));
  waiter.join();
  EXPECT_EQ(result.load(), 0);
}

TEST(FakeClock, AwaitWithZeroTimeoutChecksOnce) {
  FakeClock clock;
  absl::Mutex mu;
  bool flag = false;
  absl::MutexLock lock(&mu);
  EXPECT_FALSE(clock.AwaitWithTimeout(&mu, absl::Condition(&flag), absl::ZeroDuration()));
  flag = true;
  EXPECT_TRUE(clock.AwaitWithTimeout(&mu, absl::Condition(&flag), absl::ZeroDuration()));
  EXPECT_EQ(clock.NumWaiters(), 0);
}

TEST(RealClock, MonotonicDoesNotGoBackwards) {
  Clock* clock = RealClock();
  const absl::Time a = clock->MonotonicNow();
  const absl::Time b = clock->MonotonicNow();
  EXPECT_LE(a, b);
  EXPECT_GT(clock->Now(), absl::FromUnixSeconds(1600000000));
}

}  // namespace
}  // namespace ckpt
