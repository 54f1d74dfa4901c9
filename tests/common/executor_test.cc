// Executor: bounded queue, order, Stop drains what was queued, RunAll never
// deadlocks. Deterministic: work is held at gates (no sleeps).
#include "common/executor.h"

#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace ckpt {
namespace {

// Keeps the executor's (one) thread busy until `release` is notified;
// returns once it is.
void Occupy(Executor& ex, absl::Notification& release, std::function<void()> after = [] {}) {
  auto started = std::make_shared<absl::Notification>();  // outlives a late Notify
  ASSERT_TRUE(ex.TrySubmit([started, &release, after = std::move(after)] {
    started->Notify();
    release.WaitForNotification();
    after();
  }));
  started->WaitForNotification();
}

TEST(ExecutorTest, RunsInOrderOnOneThreadAndRefusesPastItsQueue) {
  Executor ex("test-exec", 1, 2);
  absl::Notification release;
  Occupy(ex, release);
  absl::Mutex mu;
  std::vector<int> order;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(ex.TrySubmit([&, i] {
      absl::MutexLock lock(&mu);
      order.push_back(i);
    }));
  }
  EXPECT_EQ(ex.queued(), 2u);
  EXPECT_FALSE(ex.TrySubmit([] {}));  // full: refused, not kept
  release.Notify();
  ex.Stop();
  EXPECT_EQ(order, (std::vector<int>{0, 1}));
}

TEST(ExecutorTest, StopRunsWhatIsQueuedThenRefuses) {
  std::atomic<int> ran{0};
  absl::Notification release;
  Executor ex("test-exec", 1, 8);
  Occupy(ex, release, [&] { ran++; });
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(ex.TrySubmit([&] { ran++; }));
  release.Notify();
  ex.Stop();  // waits for the running and the five queued
  EXPECT_EQ(ran.load(), 6);
  EXPECT_FALSE(ex.TrySubmit([&] { ran++; }));
  ex.Stop();  // idempotent
  EXPECT_EQ(ran.load(), 6);
}

TEST(ExecutorTest, RunAllRunsEverythingEvenWithAFullQueue) {
  Executor ex("test-exec", 1, 1);
  absl::Notification release;
  Occupy(ex, release);
  ASSERT_TRUE(ex.TrySubmit([] {}));  // the queue is full now
  std::atomic<int> ran{0};
  std::vector<std::function<void()>> fns;
  for (int i = 0; i < 4; ++i) fns.push_back([&] { ran++; });
  ex.RunAll(std::move(fns));  // nothing fits: all run here
  EXPECT_EQ(ran.load(), 4);
  release.Notify();
  ex.Stop();  // before `release` goes: the occupied thread still returns from its wait
}

TEST(ExecutorTest, RunAllAfterStopRunsEverythingHere) {
  Executor ex("test-exec", 2, 8);
  ex.Stop();
  std::atomic<int> ran{0};
  std::vector<std::function<void()>> fns;
  for (int i = 0; i < 5; ++i) fns.push_back([&] { ran++; });
  ex.RunAll(std::move(fns));
  EXPECT_EQ(ran.load(), 5);
}

}  // namespace
}  // namespace ckpt
