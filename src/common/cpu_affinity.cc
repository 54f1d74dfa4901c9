#include "common/cpu_affinity.h"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace ckpt {
namespace {

absl::StatusOr<int> ParseCpu(absl::string_view text, absl::string_view list) {
  int cpu = -1;
  if (text.empty() || !absl::SimpleAtoi(text, &cpu) || cpu < 0 || text.find_first_not_of("0123456789") != text.npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("CPU list \"", list, "\": \"", text, "\" is not a CPU number (e.g. 2-3,6)"));
  }
  if (cpu > kMaxCpu) {
    return absl::InvalidArgumentError(
        absl::StrCat("CPU list \"", list, "\": CPU ", cpu, " is above the largest supported, ", kMaxCpu));
  }
  return cpu;
}

}  // namespace

absl::StatusOr<std::vector<int>> ParseCpuList(const std::string& text) {
  const absl::string_view list = absl::StripAsciiWhitespace(text);
  if (list.empty()) return absl::InvalidArgumentError("the CPU list is empty: name CPUs, e.g. 2-3,6");
  std::set<int> cpus;
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    const size_t dash = part.find('-');
    if (dash == absl::string_view::npos) {
      absl::StatusOr<int> cpu = ParseCpu(part, list);
      if (!cpu.ok()) return cpu.status();
      cpus.insert(*cpu);
      continue;
    }
    absl::StatusOr<int> first = ParseCpu(part.substr(0, dash), list);
    if (!first.ok()) return first.status();
    absl::StatusOr<int> last = ParseCpu(part.substr(dash + 1), list);
    if (!last.ok()) return last.status();
    if (*last < *first) {
      return absl::InvalidArgumentError(
          absl::StrCat("CPU list \"", list, "\": range ", part, " ends below its start"));
    }
    for (int c = *first; c <= *last; ++c) cpus.insert(c);
  }
  return std::vector<int>(cpus.begin(), cpus.end());
}

std::string FormatCpuList(const std::vector<int>& cpus) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(cpus[i]) : absl::StrCat(cpus[i], "-", cpus[j]));
    i = j + 1;
  }
  return absl::StrJoin(parts, ",");
}

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) return out;
  for (int c = 0; c <= kMaxCpu; ++c) {
    if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  return out;
}

absl::Status CheckCpusAllowed(const std::vector<int>& cpus, const std::string& who) {
  const std::vector<int> allowed = AllowedCpus();
  for (int c : cpus) {
    if (!std::binary_search(allowed.begin(), allowed.end(), c)) {
      return absl::InvalidArgumentError(
          absl::StrCat("CPU ", c, " is not one ", who, " may run on (it may use ", FormatCpuList(allowed), ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ConfineToCpus(const std::vector<int>& cpus) {
  if (cpus.empty()) return absl::InvalidArgumentError("no CPU to run on: name at least one");
  if (absl::Status s = CheckCpusAllowed(cpus); !s.ok()) return s;
  return SetAffinityOfEveryThread(cpus);
}

absl::Status SetAffinityOfEveryThread(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    if (c < 0 || c > kMaxCpu) return absl::InvalidArgumentError(absl::StrCat("CPU ", c, " is out of range"));
    CPU_SET(c, &set);
  }
  // Every thread there is now; those started later inherit the mask.
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) {
    if (::sched_setaffinity(0, sizeof(set), &set) != 0) {
      return absl::InternalError(absl::StrCat("sched_setaffinity: ", std::strerror(errno)));
    }
    return absl::OkStatus();
  }
  absl::Status status;
  while (const dirent* e = ::readdir(dir)) {
    int tid = 0;
    if (!absl::SimpleAtoi(e->d_name, &tid) || tid <= 0) continue;
    // A thread that ended meanwhile (ESRCH) has nothing to move.
    if (::sched_setaffinity(tid, sizeof(set), &set) != 0 && errno != ESRCH && status.ok()) {
      status = absl::InternalError(absl::StrCat("sched_setaffinity(thread ", tid, "): ", std::strerror(errno)));
    }
  }
  ::closedir(dir);
  return status;
}

}  // namespace ckpt
