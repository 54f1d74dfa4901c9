// Logging for every ckpt binary: one process-wide logger over spdlog, writing
// either human text lines or JSON lines (one object per line, for log shippers).
//
//   ckpt::log::Init({.level = ckpt::log::Level::kInfo, .json = true});
//   ckpt::log::Info("registered node {} incarnation {}", node_id, incarnation);
//
// JSON lines carry: "ts" (RFC 3339 UTC, microseconds), "level" (trace, debug,
// info, warn, error), "logger" (Options::name), "thread" (OS thread id), "msg".
//
// Thread safety: every function may be called from any thread. Init() may be
// called again to reconfigure; messages logged before the first Init() go to
// stderr as text at level info. spdlog stays an implementation detail of log.cc.
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt::log {

enum class Level { kTrace = 0, kDebug, kInfo, kWarn, kError, kOff };

struct Options {
  Level level = Level::kInfo;
  // JSON lines instead of text.
  bool json = false;
  // Append to this file; empty means stderr.
  std::string file;
  // The "logger" field: the binary's name, e.g. "ckpt-meta".
  std::string name = "ckpt";
};

// (Re)configures the process logger. Fails with InvalidArgument/Internal (and
// leaves the previous configuration in place) if the file cannot be opened.
absl::Status Init(const Options& options);

// Parses "trace", "debug", "info", "warn"/"warning", "error", "off"
// (case-insensitive). InvalidArgument lists the accepted values otherwise.
absl::StatusOr<Level> ParseLevel(std::string_view name);

// Whether a message at `level` would be written.
bool Enabled(Level level);

// Writes one message (already formatted). Never fails; a logger that cannot
// write drops the line.
void Write(Level level, std::string_view message);

// Flushes buffered lines (also done automatically for warn and above).
void Flush();

template <typename... Args>
void Log(Level level, fmt::format_string<Args...> format, Args&&... args) {
  if (Enabled(level)) Write(level, fmt::format(format, std::forward<Args>(args)...));
}
template <typename... Args>
void Trace(fmt::format_string<Args...> f, Args&&... a) { Log(Level::kTrace, f, std::forward<Args>(a)...); }
template <typename... Args>
void Debug(fmt::format_string<Args...> f, Args&&... a) { Log(Level::kDebug, f, std::forward<Args>(a)...); }
template <typename... Args>
void Info(fmt::format_string<Args...> f, Args&&... a) { Log(Level::kInfo, f, std::forward<Args>(a)...); }
template <typename... Args>
void Warn(fmt::format_string<Args...> f, Args&&... a) { Log(Level::kWarn, f, std::forward<Args>(a)...); }
template <typename... Args>
void Error(fmt::format_string<Args...> f, Args&&... a) { Log(Level::kError, f, std::forward<Args>(a)...); }

}  // namespace ckpt::log
