#include "cli/progress.h"

#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/config.h"

namespace ckpt::cli {
namespace {

// A progress line drawn with '\r' and not yet ended: the interrupt message
// starts on a new line.
std::atomic<bool> g_line_open{false};

std::string Eta(double seconds) {
  if (seconds < 0 || seconds > 99 * 3600) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrCat(s / 60, "m", absl::StrFormat("%02d", s % 60), "s");
  return absl::StrCat(s / 3600, "h", absl::StrFormat("%02d", (s % 3600) / 60), "m");
}

std::string Rate(double bytes_per_second) {
  return absl::StrCat(FormatBytes(static_cast<uint64_t>(bytes_per_second)), "/s");
}

}  // namespace

ProgressMode ChooseProgressMode(bool force, bool quiet, bool json) {
  ProgressMode m;
  m.tty = ::isatty(STDERR_FILENO) == 1;
  m.on = force || (m.tty && !quiet && !json);
  return m;
}

Progress::Progress(std::string label, uint64_t total_bytes, ProgressMode mode)
    : label_(std::move(label)), total_(total_bytes), mode_(mode), start_(absl::Now()) {}

Progress::~Progress() {
  if (mode_.on && mode_.tty && g_line_open) {
    std::fputs("\n", stderr);  // an error follows on a line of its own
    g_line_open = false;
  }
}

void Progress::Add(uint64_t bytes) {
  done_ += bytes;
  if (!mode_.on || bytes == 0) return;
  const absl::Time now = absl::Now();
  const absl::Duration every = mode_.tty ? absl::Milliseconds(100) : absl::Seconds(1);
  if (printed_ && now - last_print_ < every) return;
  last_print_ = now;
  Print(false);
}

void Progress::Note(std::string_view what) {
  if (!mode_.on) return;
  if (mode_.tty) {
    std::fprintf(stderr, "\r\033[K%s: %.*s", label_.c_str(), static_cast<int>(what.size()), what.data());
    g_line_open = true;
  } else {
    std::fprintf(stderr, "%s: %.*s\n", label_.c_str(), static_cast<int>(what.size()), what.data());
  }
  std::fflush(stderr);
  printed_ = true;
}

void Progress::Line(std::string_view text) {
  if (!mode_.on) return;
  std::fprintf(stderr, "%s%.*s\n", mode_.tty && g_line_open ? "\r\033[K" : "", static_cast<int>(text.size()),
               text.data());
  std::fflush(stderr);
  g_line_open = false;
  last_print_ = absl::InfinitePast();
}

void Progress::Clear() {
  if (!mode_.on || !mode_.tty || !g_line_open) return;
  std::fputs("\r\033[K", stderr);
  std::fflush(stderr);
  g_line_open = false;
  last_print_ = absl::InfinitePast();
}

void Progress::Finish() {
  if (finished_) return;
  finished_ = true;
  if (mode_.on) Print(true);
}

void Progress::Print(bool final) {
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start_);
  const double rate = elapsed > 0 ? static_cast<double>(done_) / elapsed : 0;
  std::string line;
  if (final) {
    line = absl::StrCat(label_, ": ", FormatBytes(done_), " in ", absl::StrFormat("%.1fs", elapsed), " (",
                        Rate(rate), ")");
  } else {
    const uint64_t total = std::max(total_, done_);
    const int pct = total == 0 ? 100 : static_cast<int>(static_cast<double>(done_) * 100.0 / total);
    line = absl::StrCat(label_, ": ", FormatBytes(done_), " / ", FormatBytes(total), " (", pct, "%), ", Rate(rate),
                        ", ETA ", rate > 0 ? Eta(static_cast<double>(total - done_) / rate) : "?");
  }
  if (!detail_.empty()) absl::StrAppend(&line, ", ", detail_);
  if (mode_.tty) {
    std::fprintf(stderr, "\r\033[K%s%s", line.c_str(), final ? "\n" : "");
    g_line_open = !final;
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
  printed_ = true;
}

std::optional<pid_t> RestoreTempFileOwner(std::string_view name) {
  auto consume = [&](std::string_view prefix) {
    if (name.substr(0, prefix.size()) != prefix) return false;
    name.remove_prefix(prefix.size());
    return true;
  };
  // Digits, at least `min` of them; their value.
  auto digits = [&](size_t min) -> std::optional<uint64_t> {
    size_t n = 0;
    while (n < name.size() && std::isdigit(static_cast<unsigned char>(name[n])) != 0) ++n;
    if (n < min || n > 18) return std::nullopt;
    uint64_t v = 0;
    if (!absl::SimpleAtoi(std::string(name.substr(0, n)), &v)) return std::nullopt;
    name.remove_prefix(n);
    return v;
  };
  if (!consume(".")) return std::nullopt;
  const bool writer_of_ref = consume(".");  // "." + ".rank-...ref-S.tmp-P" + ".tmp-P-N"
  if (!consume("rank-") || !digits(5) || !consume(".bin")) return std::nullopt;
  const bool ref = consume(".ref-");
  if (ref && !digits(1)) return std::nullopt;
  if (writer_of_ref && !ref) return std::nullopt;
  if (!consume(".tmp-")) return std::nullopt;
  std::optional<uint64_t> pid = digits(1);
  if (!pid || *pid == 0 || *pid > static_cast<uint64_t>(INT32_MAX)) return std::nullopt;
  if (ref) {
    // The referred shard's file itself, or its writer's temporary file.
    if (writer_of_ref) {
      if (!consume(".tmp-") || !digits(1) || !consume("-") || !digits(1)) return std::nullopt;
    }
  } else if (!consume("-") || !digits(1)) {
    return std::nullopt;
  }
  if (!name.empty()) return std::nullopt;
  return static_cast<pid_t>(*pid);
}

namespace {

// The names in `dir` for which `pick` is true, removed; their paths.
template <typename Pick>
std::vector<std::string> RemoveIn(const std::string& dir, Pick pick) {
  std::vector<std::string> removed;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return removed;
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
  ::closedir(d);
  for (const std::string& name : names) {
    if (!pick(name)) continue;
    const std::string path = dir + "/" + name;
    if (::unlink(path.c_str()) == 0) removed.push_back(path);
  }
  return removed;
}

bool ProcessRuns(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

std::mutex g_dirs_mu;
std::vector<std::string> g_dirs;  // guarded by g_dirs_mu
std::atomic<bool> g_writing_manifest{false};
bool g_json = false;

[[noreturn]] void OnInterrupt(int sig) {
  const pid_t self = ::getpid();
  const bool manifest = g_writing_manifest.load();
  auto ours = [&](const std::string& name) {
    std::optional<pid_t> owner = RestoreTempFileOwner(name);
    if (owner && *owner == self) return true;
    return manifest && (name.rfind("manifest.json.tmp-", 0) == 0 || name.rfind("COMMITTED.tmp-", 0) == 0);
  };
  std::vector<std::string> removed;
  std::vector<std::string> dirs;
  {
    std::lock_guard<std::mutex> lock(g_dirs_mu);
    dirs = g_dirs;
  }
  // Twice: a file the restore opened while the first pass ran goes too.
  for (int pass = 0; pass < 2; ++pass) {
    for (const std::string& dir : dirs) {
      for (std::string& p : RemoveIn(dir, ours)) removed.push_back(std::move(p));
    }
  }
  std::string message = absl::StrCat("interrupted by ", sig == SIGINT ? "SIGINT" : "SIGTERM", ": ");
  if (removed.empty()) {
    absl::StrAppend(&message, "no temporary file was open");
  } else {
    absl::StrAppend(&message, "removed ", removed.size(), " temporary file(s) of this restore (",
                    absl::StrJoin(removed, ", "), ")");
  }
  for (const std::string& dir : dirs) {
    if (!std::filesystem::exists(dir + "/COMMITTED")) {
      absl::StrAppend(&message, "; ", dir,
                      " is not a committed version (no COMMITTED marker; rank files already written there are "
                      "complete and checked): run the restore again");
    }
  }
  std::fflush(stdout);
  if (g_line_open) std::fputs("\n", stderr);
  if (g_json) {
    std::fprintf(stderr, "%s\n",
                 nlohmann::ordered_json{{"error", {{"code", "CANCELLED"}, {"message", message}, {"removed", removed}}}}
                     .dump()
                     .c_str());
  } else {
    std::fprintf(stderr, "ckptctl: CANCELLED: %s\n", message.c_str());
  }
  std::fflush(stderr);
  ::_exit(128 + sig);
}

}  // namespace

int SweepStaleRestoreTempFiles(const std::string& dir) {
  const pid_t self = ::getpid();
  return static_cast<int>(RemoveIn(dir, [&](const std::string& name) {
                            std::optional<pid_t> owner = RestoreTempFileOwner(name);
                            return owner && *owner != self && !ProcessRuns(*owner);
                          }).size());
}

void StartInterruptWatcher(bool json) {
  g_json = json;
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    int sig = 0;
    while (sigwait(&set, &sig) != 0) {
    }
    OnInterrupt(sig);
  }).detach();
}

void WatchRestoreDir(const std::string& dir) {
  std::lock_guard<std::mutex> lock(g_dirs_mu);
  g_dirs.push_back(dir);
}

void SetWritingManifest(bool on) { g_writing_manifest = on; }

void MaybePauseAfterFirstChunk() {
  static bool done = false;
  if (done) return;
  done = true;
  const char* hook = std::getenv("CKPTCTL_TEST_PAUSE_AFTER_FIRST_CHUNK");
  if (hook == nullptr || std::string(hook) != "1") return;
  std::fputs("ckptctl: test hook: paused after the first chunk\n", stderr);
  std::fflush(stderr);
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));  // until a signal ends the process
}

std::optional<absl::Duration> ParseWaitTimeout(const std::string& text) {
  double seconds = 0;
  if (absl::SimpleAtod(text, &seconds)) {
    if (!(seconds >= 0) || seconds > 1e9) return std::nullopt;
    return absl::Seconds(seconds);
  }
  absl::StatusOr<absl::Duration> d = ParseDuration(text);
  if (!d.ok()) return std::nullopt;
  return *d;
}

}  // namespace ckpt::cli
