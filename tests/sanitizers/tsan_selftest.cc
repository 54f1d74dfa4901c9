// Checks the TSan set-up itself (built only with CKPT_SANITIZE=thread; scripts/tsan.sh
// runs it first): the Abseil annotations (absl_tsan_annotations.cc) must make correctly
// synchronized code report nothing, and neither they nor tsan.supp may hide a real race or
// lock-order inversion in our code.
//
// Each scenario runs in a child process (this binary re-executed with
// --gtest_filter=TsanChild.DISABLED_Main and CKPT_TSAN_SELFTEST=<scenario>), because a
// report only shows in the process's output and exit code (66). The child's reports go to
// its stderr, not to scripts/tsan.sh's report directory, so the deliberate races here do
// not fail that run.
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "support/process.h"

namespace ckpt::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kScenarioEnv[] = "CKPT_TSAN_SELFTEST";
constexpr int kRounds = 1000;

// Opaque to the optimizer, so that the racy accesses stay plain loads and stores.
__attribute__((noinline)) void Bump(int* p) { *p = *p + 1; }

// Two threads increment a counter under an absl::Mutex.
void MutexCounter() {
  absl::Mutex mu;
  int counter = 0;
  auto work = [&] {
    for (int i = 0; i < kRounds; ++i) {
      absl::MutexLock lock(&mu);
      Bump(&counter);
    }
  };
  std::thread a(work), b(work);
  a.join();
  b.join();
  if (counter != 2 * kRounds) _exit(3);
}

// A consumer waits with Await (and AwaitWithTimeout, and a CondVar) for data a producer
// wrote under the lock, then reads it with the lock held and after releasing it.
void AwaitHandoff() {
  absl::Mutex mu;
  absl::CondVar cv;
  int stage = 0;       // guarded by mu
  int payload[3] = {};  // written under mu before stage advances
  std::thread producer([&] {
    for (int s = 1; s <= 3; ++s) {
      absl::MutexLock lock(&mu);
      Bump(&payload[s - 1]);
      stage = s;
      cv.Signal();
    }
  });
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(+[](int* st) { return *st >= 1; }, &stage));
    Bump(&payload[0]);
    mu.AwaitWithTimeout(absl::Condition(+[](int* st) { return *st >= 2; }, &stage),
                        absl::Seconds(60));
    while (stage < 3) cv.Wait(&mu);
  }
  producer.join();
  for (int& p : payload) Bump(&p);
}

// Plain data written before Notify is read after WaitForNotification / HasBeenNotified.
void NotificationHandoff() {
  int plain_a = 0, plain_b = 0;
  absl::Notification a_ready, b_ready;
  std::thread writer([&] {
    Bump(&plain_a);
    a_ready.Notify();
    Bump(&plain_b);
    b_ready.Notify();
  });
  a_ready.WaitForNotification();
  Bump(&plain_a);
  while (!b_ready.HasBeenNotified()) std::this_thread::yield();
  Bump(&plain_b);
  writer.join();
}

// Copies of one non-OK absl::Status (a shared, reference-counted rep) read and destroyed
// on several threads.
void SharedStatus() {
  std::vector<std::thread> threads;
  {
    const absl::Status shared = absl::InternalError("shared rep, freed by the last holder");
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([copy = shared] {
        if (copy.message().empty()) _exit(3);
      });
    }
  }
  for (std::thread& t : threads) t.join();
}

// The same counter without the lock: a real race TSan must report.
void UnsynchronizedCounter() {
  int counter = 0;
  std::atomic<bool> go{false};
  auto work = [&] {
    while (!go.load(std::memory_order_relaxed)) {
    }
    for (int i = 0; i < kRounds; ++i) Bump(&counter);
  };
  std::thread a(work), b(work);
  go.store(true, std::memory_order_relaxed);
  a.join();
  b.join();
}

// Two absl::Mutexes taken in both orders (by one thread: no deadlock, but an inversion).
// Abseil's own cycle detector (on in Debian's build) would abort first; this checks TSan's.
void LockOrderInversion() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::Mutex first, second;
  {
    absl::MutexLock a(&first);
    absl::MutexLock b(&second);
  }
  {
    absl::MutexLock b(&second);
    absl::MutexLock a(&first);
  }
}

TEST(TsanChild, DISABLED_Main) {
  const char* scenario = std::getenv(kScenarioEnv);
  if (scenario == nullptr) GTEST_SKIP() << "only run as a child of TsanSelfTest";
  const std::string s = scenario;
  if (s == "mutex") MutexCounter();
  else if (s == "await") AwaitHandoff();
  else if (s == "notification") NotificationHandoff();
  else if (s == "status") SharedStatus();
  else if (s == "race") UnsynchronizedCounter();
  else if (s == "inversion") LockOrderInversion();
  else _exit(4);
}

// This binary's path. Not "/proc/self/exe": the sanitizers take the program's name (%b in
// their options) from argv[0].
std::string SelfPath() {
  char path[4096];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return "/proc/self/exe";
  return std::string(path, static_cast<size_t>(n));
}

// Runs one scenario in a child; its output (TSan reports go to stderr) and exit status.
RunResult RunScenario(const std::string& scenario) {
  SubprocessOptions o;
  o.argv = {SelfPath(), "--gtest_filter=TsanChild.DISABLED_Main",
            "--gtest_also_run_disabled_tests"};
  // Replaces scripts/tsan.sh's log_path: the compiled-in defaults (suppressions) stay.
  o.env = {{kScenarioEnv, scenario}, {"TSAN_OPTIONS", "log_path=stderr"}};
  o.name = "tsan-selftest-" + scenario;
  absl::StatusOr<RunResult> r = RunToCompletion(o, absl::Minutes(5));
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : RunResult{ExitStatus(0xff00), "", r.status().ToString()};
}

class Clean : public ::testing::TestWithParam<const char*> {};

TEST_P(Clean, SynchronizedCodeReportsNothing) {
  const RunResult r = RunScenario(GetParam());
  EXPECT_TRUE(r.status.success()) << r.status << "\n" << r.stderr_text;
  EXPECT_THAT(r.stderr_text, Not(HasSubstr("ThreadSanitizer"))) << r.stderr_text;
}

INSTANTIATE_TEST_SUITE_P(TsanSelfTest, Clean,
                         ::testing::Values("mutex", "await", "notification", "status"));

TEST(TsanSelfTest, UnsynchronizedCounterIsReported) {
  const RunResult r = RunScenario("race");
  EXPECT_EQ(r.status.exit_code(), 66) << r.status << "\n" << r.stderr_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("WARNING: ThreadSanitizer: data race"));
  EXPECT_THAT(r.stderr_text, HasSubstr("UnsynchronizedCounter"));
}

TEST(TsanSelfTest, AbslMutexLockOrderInversionIsReported) {
  const RunResult r = RunScenario("inversion");
  EXPECT_EQ(r.status.exit_code(), 66) << r.status << "\n" << r.stderr_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("lock-order-inversion"));
}

}  // namespace
}  // namespace ckpt::testing
