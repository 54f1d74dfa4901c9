#include "common/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace ckpt::log {
namespace {

spdlog::level::level_enum ToSpd(Level level) {
  switch (level) {
    case Level::kTrace: return spdlog::level::trace;
    case Level::kDebug: return spdlog::level::debug;
    case Level::kInfo: return spdlog::level::info;
    case Level::kWarn: return spdlog::level::warn;
    case Level::kError: return spdlog::level::err;
    case Level::kOff: return spdlog::level::off;
  }
  return spdlog::level::info;
}

const char* LevelName(spdlog::level::level_enum level) {
  switch (level) {
    case spdlog::level::trace: return "trace";
    case spdlog::level::debug: return "debug";
    case spdlog::level::info: return "info";
    case spdlog::level::warn: return "warn";
    case spdlog::level::err: return "error";
    case spdlog::level::critical: return "critical";
    default: return "off";
  }
}

void AppendJsonString(std::string_view s, spdlog::memory_buf_t& out) {
  out.push_back('"');
  for (const char c : s) {
    switch (c) {
      case '"': out.append(std::string_view("\\\"")); break;
      case '\\': out.append(std::string_view("\\\\")); break;
      case '\n': out.append(std::string_view("\\n")); break;
      case '\r': out.append(std::string_view("\\r")); break;
      case '\t': out.append(std::string_view("\\t")); break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          fmt::format_to(std::back_inserter(out), "\\u{:04x}", static_cast<unsigned>(c));
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
}

// Formats each record as one JSON object per line.
class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    using namespace std::chrono;
    const auto us = duration_cast<microseconds>(msg.time.time_since_epoch()).count();
    const time_t secs = static_cast<time_t>(us / 1000000);
    std::tm tm{};
    gmtime_r(&secs, &tm);
    fmt::format_to(std::back_inserter(dest),
                   "{{\"ts\":\"{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z\",\"level\":\"{}\",\"logger\":",
                   tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                   tm.tm_sec, us % 1000000, LevelName(msg.level));
    AppendJsonString(std::string_view(msg.logger_name.data(), msg.logger_name.size()), dest);
    fmt::format_to(std::back_inserter(dest), ",\"thread\":{},\"msg\":", msg.thread_id);
    AppendJsonString(std::string_view(msg.payload.data(), msg.payload.size()), dest);
    dest.append(std::string_view("}\n"));
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

std::mutex g_mu;  // serializes Init()
std::atomic<int> g_level{static_cast<int>(Level::kInfo)};

std::shared_ptr<spdlog::logger>& Logger() {
  static auto* logger = new std::shared_ptr<spdlog::logger>(
      std::make_shared<spdlog::logger>("ckpt", std::make_shared<spdlog::sinks::stderr_sink_mt>()));
  return *logger;
}

std::shared_ptr<spdlog::logger> CurrentLogger() {
  std::lock_guard<std::mutex> lock(g_mu);
  return Logger();
}

}  // namespace

absl::Status Init(const Options& options) {
  if (!options.file.empty()) {
    // spdlog would create missing parent directories; a typo in a path should
    // be an error instead.
    const size_t slash = options.file.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : options.file.substr(0, slash + 1);
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return absl::InvalidArgumentError(absl::StrCat("cannot open log file '", options.file,
                                                     "': directory '", dir, "' does not exist"));
    }
  }
  spdlog::sink_ptr sink;
  try {
    if (options.file.empty()) {
      sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
    } else {
      sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(options.file, /*truncate=*/false);
    }
  } catch (const spdlog::spdlog_ex& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot open log file '", options.file, "': ", e.what()));
  }
  auto logger = std::make_shared<spdlog::logger>(options.name, std::move(sink));
  if (options.json) {
    logger->set_formatter(std::make_unique<JsonFormatter>());
  } else {
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%fZ %L %n[%t] %v", spdlog::pattern_time_type::utc);
  }
  logger->set_level(ToSpd(options.level));
  logger->flush_on(spdlog::level::warn);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    Logger() = std::move(logger);
    g_level = static_cast<int>(options.level);
  }
  return absl::OkStatus();
}

absl::StatusOr<Level> ParseLevel(std::string_view name) {
  const std::string n = absl::AsciiStrToLower(absl::string_view(name.data(), name.size()));
  if (n == "trace") return Level::kTrace;
  if (n == "debug") return Level::kDebug;
  if (n == "info") return Level::kInfo;
  if (n == "warn" || n == "warning") return Level::kWarn;
  if (n == "error") return Level::kError;
  if (n == "off") return Level::kOff;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown log level '", n, "': use one of trace, debug, info, warn, error, off"));
}

bool Enabled(Level level) {
  return level != Level::kOff && static_cast<int>(level) >= g_level.load(std::memory_order_relaxed);
}

void Write(Level level, std::string_view message) {
  try {
    CurrentLogger()->log(ToSpd(level), spdlog::string_view_t(message.data(), message.size()));
  } catch (...) {
    // A logger that cannot write drops the line; logging must never throw.
  }
}

void Flush() {
  try {
    CurrentLogger()->flush();
  } catch (...) {
  }
}

}  // namespace ckpt::log
