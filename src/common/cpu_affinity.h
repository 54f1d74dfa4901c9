// Confining a daemon to some of the machine's CPUs (ckpt-agent --cpus), so
// that the trainers on the node keep theirs: the agent's threads (transport,
// folding, flush, gRPC) then compete with each other, not with the training
// step or the save's copy.
//
// A CPU list is what Linux writes in /proc/<pid>/status Cpus_allowed_list
// and taskset -c takes: comma-separated CPU numbers and ranges, "2-3,6".
//
// Thread safety: ParseCpuList and FormatCpuList are pure; ConfineToCpus
// changes the whole process and is meant for start-up, before the daemon's
// own threads (it also moves those already running: every thread of
// /proc/self/task).
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt {

// The largest CPU number a list may name (glibc's cpu_set_t: 1,024 CPUs).
inline constexpr int kMaxCpu = 1023;

// The CPUs of `text`, ascending, without repeats. InvalidArgument naming
// the part that is wrong: empty text or part, not a number, a range whose
// end is below its start, a CPU above kMaxCpu.
absl::StatusOr<std::vector<int>> ParseCpuList(const std::string& text);

// "0-3,6" for {0, 1, 2, 3, 6}; "" for none.
std::string FormatCpuList(const std::vector<int>& cpus);

// The CPUs this process may run on now (sched_getaffinity).
std::vector<int> AllowedCpus();

// OK if every CPU of `cpus` is one this process may run on now; else
// InvalidArgument "CPU N is not one <who> may run on (it may use 0-3)".
absl::Status CheckCpusAllowed(const std::vector<int>& cpus, const std::string& who = "this process");

// Moves every thread of this process onto `cpus` (and so every thread it
// starts later). InvalidArgument if a CPU is not one this process may run
// on (the message lists those it may: a container's cpuset, taskset, the
// machine's count); the system's error if the kernel refuses. Nothing is
// changed when a CPU is refused.
absl::Status ConfineToCpus(const std::vector<int>& cpus);

// Sets every thread's affinity to `cpus` without ConfineToCpus's check
// against the current set, so that a process can also widen its set again
// within what its cpuset allows (a benchmark that pins its trainers for a
// while). The kernel's error if it refuses.
absl::Status SetAffinityOfEveryThread(const std::vector<int>& cpus);

}  // namespace ckpt
