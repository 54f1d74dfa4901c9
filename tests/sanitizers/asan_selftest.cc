// Checks the ASan/UBSan set-up itself (built only when CKPT_SANITIZE contains address;
// `scripts/test.sh --sanitize` runs it with the unit tests): a finding must fail the
// process, leak checks must stay on for our programs even under a parent that turns them
// off for itself (the Python tests' ASAN_OPTIONS, cmake/CkptSanitizers.cmake), and clean
// code must report nothing.
//
// Each scenario runs in a child process (this binary re-executed with
// --gtest_filter=AsanChild.DISABLED_Main and CKPT_ASAN_SELFTEST=<scenario>), with its
// reports on its stderr (log_path=stderr), so the deliberate findings here do not land in
// scripts/test.sh's report directory.
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "support/process.h"

#ifndef CKPT_SANITIZER_OPTIONS_DIR
#error "CKPT_SANITIZER_OPTIONS_DIR must be defined (see tests/CMakeLists.txt)"
#endif

namespace ckpt::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kScenarioEnv[] = "CKPT_ASAN_SELFTEST";

// Keeps the optimizer from proving the bad accesses away.
void* volatile g_sink;

__attribute__((noinline)) void Clean() {
  std::vector<int> v(100, 1);
  g_sink = v.data();
}

__attribute__((noinline)) void UseAfterFree() {
  char* p = new char[64];
  g_sink = p;
  delete[] p;
  char* volatile dangling = static_cast<char*>(g_sink);
  dangling[3] = 1;
}

__attribute__((noinline)) void Leak() {
  g_sink = std::malloc(1234);
  g_sink = nullptr;
}

__attribute__((noinline)) int SignedOverflow(int x) { return x + 1; }

TEST(AsanChild, DISABLED_Main) {
  const char* scenario = std::getenv(kScenarioEnv);
  if (scenario == nullptr) GTEST_SKIP() << "only run as a child of AsanSelfTest";
  const std::string s = scenario;
  if (s == "clean") {
    Clean();
  } else if (s == "use-after-free") {
    UseAfterFree();
  } else if (s == "leak") {
    Leak();
  } else if (s == "signed-overflow") {
    volatile int max = INT_MAX;
    g_sink = reinterpret_cast<void*>(static_cast<intptr_t>(SignedOverflow(max)));
  } else {
    _exit(4);
  }
}

// This binary's path. Not "/proc/self/exe": the sanitizers take the program's name (%b in
// their options) from argv[0].
std::string SelfPath() {
  char path[4096];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return "/proc/self/exe";
  return std::string(path, static_cast<size_t>(n));
}

// Runs one scenario in a child with ASAN_OPTIONS/UBSAN_OPTIONS replaced (the compiled-in
// defaults stay); its output and exit status.
RunResult RunScenario(const std::string& scenario, const std::string& asan_options) {
  SubprocessOptions o;
  o.argv = {SelfPath(), "--gtest_filter=AsanChild.DISABLED_Main",
            "--gtest_also_run_disabled_tests"};
  o.env = {{kScenarioEnv, scenario},
           {"ASAN_OPTIONS", asan_options},
           {"UBSAN_OPTIONS", "log_path=stderr"}};
  o.name = "asan-selftest-" + scenario;
  absl::StatusOr<RunResult> r = RunToCompletion(o, absl::Minutes(5));
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : RunResult{ExitStatus(0xff00), "", r.status().ToString()};
}

RunResult RunScenario(const std::string& scenario) {
  return RunScenario(scenario, "log_path=stderr");
}

TEST(AsanSelfTest, CleanCodeReportsNothing) {
  const RunResult r = RunScenario("clean");
  EXPECT_TRUE(r.status.success()) << r.status << "\n" << r.stderr_text;
  EXPECT_THAT(r.stderr_text, Not(HasSubstr("Sanitizer"))) << r.stderr_text;
}

TEST(AsanSelfTest, UseAfterFreeFailsTheProcess) {
  const RunResult r = RunScenario("use-after-free");
  EXPECT_FALSE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("heap-use-after-free"));
}

TEST(AsanSelfTest, LeakFailsTheProcessAtExit) {
  const RunResult r = RunScenario("leak");
  EXPECT_FALSE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("detected memory leaks"));
  EXPECT_THAT(r.stderr_text, HasSubstr("Leak"));
}

// What a daemon started by the Python tests inherits: leak checks off for the interpreter,
// back on for our programs through <build>/sanitizer/<program>.asan-options.
TEST(AsanSelfTest, LeakChecksStayOnUnderAParentThatTurnsThemOff) {
  const RunResult r = RunScenario(
      "leak", absl::StrCat("log_path=stderr:detect_leaks=0:include_if_exists=",
                           CKPT_SANITIZER_OPTIONS_DIR, "/%b.asan-options"));
  EXPECT_FALSE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("detected memory leaks"));
}

TEST(AsanSelfTest, UndefinedBehaviourHalts) {
#ifndef CKPT_SANITIZE_UNDEFINED_SELFTEST
  GTEST_SKIP() << "built without -fsanitize=undefined";
#endif
  const RunResult r = RunScenario("signed-overflow");
  EXPECT_FALSE(r.status.success()) << r.stderr_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("runtime error: signed integer overflow"));
}

}  // namespace
}  // namespace ckpt::testing
