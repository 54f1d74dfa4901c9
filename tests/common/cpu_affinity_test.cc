// CPU lists (ckpt-agent --cpus) and confining a process to them.
#include "common/cpu_affinity.h"

#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <thread>

namespace ckpt {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(CpuList, ParsesNumbersAndRangesAsTasksetDoes) {
  EXPECT_THAT(*ParseCpuList("0"), ElementsAre(0));
  EXPECT_THAT(*ParseCpuList("2-3,6"), ElementsAre(2, 3, 6));
  EXPECT_THAT(*ParseCpuList(" 6,2-3,3 "), ElementsAre(2, 3, 6));  // sorted, no repeats
  EXPECT_THAT(*ParseCpuList("5-5"), ElementsAre(5));
  EXPECT_THAT(*ParseCpuList("1023"), ElementsAre(1023));
  EXPECT_EQ(FormatCpuList({0, 1, 2, 3, 6, 8, 9}), "0-3,6,8-9");
  EXPECT_EQ(FormatCpuList({4}), "4");
  EXPECT_EQ(FormatCpuList({}), "");
  for (const std::string text : {"0-3,6,8-9", "1", "0,2,4"}) EXPECT_EQ(FormatCpuList(*ParseCpuList(text)), text);
}

TEST(CpuList, BadListsNameWhatIsWrong) {
  EXPECT_THAT(ParseCpuList("").status().message(), HasSubstr("empty"));
  EXPECT_THAT(ParseCpuList("1,,2").status().message(), HasSubstr("\"\" is not a CPU number"));
  EXPECT_THAT(ParseCpuList("a").status().message(), HasSubstr("\"a\" is not a CPU number"));
  EXPECT_THAT(ParseCpuList("-1").status().message(), HasSubstr("is not a CPU number"));
  EXPECT_THAT(ParseCpuList("+1").status().message(), HasSubstr("\"+1\" is not a CPU number"));
  EXPECT_THAT(ParseCpuList("3-1").status().message(), HasSubstr("range 3-1 ends below its start"));
  EXPECT_THAT(ParseCpuList("1024").status().message(), HasSubstr("CPU 1024 is above the largest supported, 1023"));
  EXPECT_THAT(ParseCpuList("0-99999999999").status().message(), HasSubstr("is not a CPU number"));
  EXPECT_EQ(ParseCpuList("1-2-3").status().code(), absl::StatusCode::kInvalidArgument);
}

// Cpus_allowed_list of thread `tid` of this process.
std::string AllowedListOf(pid_t tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Cpus_allowed_list:", 0) == 0) return line.substr(line.find_first_not_of(" \t", 18));
  }
  return "?";
}

// In a child (the test process keeps its CPUs): a thread started before and
// one started after are both confined; a CPU the process may not use is
// refused and changes nothing.
TEST(ConfineToCpus, MovesEveryThreadAndRefusesCpusItMayNotUse) {
  const std::vector<int> allowed = AllowedCpus();
  ASSERT_FALSE(allowed.empty());
  const int target = allowed.back();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = 0;
    pid_t before_tid = 0;
    std::atomic<bool> go{false};
    std::thread before([&] {
      before_tid = static_cast<pid_t>(::gettid());
      while (!go.load()) std::this_thread::yield();
    });
    while (before_tid == 0) std::this_thread::yield();
    absl::Status refused = ConfineToCpus({kMaxCpu});
    if (refused.ok() || refused.message().find("is not one this process may run on (it may use " +
                                               FormatCpuList(allowed) + ")") == std::string::npos) {
      code |= 1;
    }
    if (AllowedListOf(::gettid()) != FormatCpuList(allowed)) code |= 2;  // unchanged
    if (!ConfineToCpus({target}).ok()) code |= 4;
    const std::string want = std::to_string(target);
    if (AllowedListOf(::gettid()) != want) code |= 8;
    if (AllowedListOf(before_tid) != want) code |= 16;
    std::string after_list;
    std::thread after([&] { after_list = AllowedListOf(static_cast<pid_t>(::gettid())); });
    after.join();
    if (after_list != want) code |= 32;
    go = true;
    before.join();
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "bits: 1 refusal, 2 unchanged after it, 4 confine, 8 main thread, "
                                       "16 thread started before, 32 thread started after";
  EXPECT_EQ(AllowedCpus(), allowed);  // this process untouched
}

}  // namespace
}  // namespace ckpt
