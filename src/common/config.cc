#include "common/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/names.h"

extern char** environ;

namespace ckpt {
namespace {

using uint128 = unsigned __int128;

constexpr std::string_view kEnvPrefix = "CKPT_";
constexpr size_t kMaxConfigFileBytes = 16 << 20;

absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }
std::string_view SV(absl::string_view s) { return std::string_view(s.data(), s.size()); }

bool IsAsciiSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool IsDigit(char c) { return c >= '0' && c <= '9'; }
char ToLower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }
char ToUpper(char c) { return (c >= 'a' && c <= 'z') ? static_cast<char>(c - 'a' + 'A') : c; }

std::string_view Trim(std::string_view s) {
  while (!s.empty() && IsAsciiSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsAsciiSpace(s.back())) s.remove_suffix(1);
  return s;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = ToLower(c);
  return out;
}

bool AllDigits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), IsDigit);
}

// Decimal digits to an unsigned value; nullopt if it exceeds `max`.
std::optional<uint128> DigitsToValue(std::string_view digits, uint128 max) {
  uint128 value = 0;
  for (char c : digits) {
    value = value * 10 + static_cast<unsigned>(c - '0');
    if (value > max) return std::nullopt;
  }
  return value;
}

// ---- Parsers. Each returns the value, or sets *why to the reason (without
// the value itself, which the caller quotes).

std::optional<int64_t> ParseInt64Impl(std::string_view text, std::string* why) {
  std::string_view s = Trim(text);
  bool negative = false;
  if (!s.empty() && (s.front() == '-' || s.front() == '+')) {
    negative = s.front() == '-';
    s.remove_prefix(1);
  }
  if (!AllDigits(s)) {
    *why = "expected a signed 64-bit decimal integer";
    return std::nullopt;
  }
  const uint128 limit = negative ? uint128{1} << 63 : (uint128{1} << 63) - 1;
  std::optional<uint128> v = DigitsToValue(s, limit);
  if (!v) {
    *why = "out of range for a signed 64-bit integer";
    return std::nullopt;
  }
  if (negative) return static_cast<int64_t>(-static_cast<__int128>(*v));
  return static_cast<int64_t>(*v);
}

std::optional<uint64_t> ParseUint64Impl(std::string_view text, std::string* why) {
  std::string_view s = Trim(text);
  if (!s.empty() && s.front() == '-') {
    *why = "must not be negative";
    return std::nullopt;
  }
  if (!s.empty() && s.front() == '+') s.remove_prefix(1);
  if (!AllDigits(s)) {
    *why = "expected an unsigned 64-bit decimal integer";
    return std::nullopt;
  }
  std::optional<uint128> v = DigitsToValue(s, std::numeric_limits<uint64_t>::max());
  if (!v) {
    *why = "out of range for an unsigned 64-bit integer (max 18446744073709551615)";
    return std::nullopt;
  }
  return static_cast<uint64_t>(*v);
}

std::optional<bool> ParseBoolImpl(std::string_view text, std::string* why) {
  const std::string s = Lower(Trim(text));
  if (s == "true" || s == "1" || s == "yes" || s == "on") return true;
  if (s == "false" || s == "0" || s == "no" || s == "off") return false;
  *why = "expected true/false, yes/no, on/off or 1/0";
  return std::nullopt;
}

std::optional<uint64_t> ByteUnitMultiplier(std::string_view unit) {
  struct Unit {
    std::string_view si;  // K
    uint64_t power;       // 1 for K, 2 for M, ...
  };
  static constexpr Unit kUnits[] = {{"k", 1}, {"m", 2}, {"g", 3}, {"t", 4}, {"p", 5}, {"e", 6}};
  const std::string u = Lower(unit);
  if (u.empty() || u == "b") return 1;
  for (const Unit& entry : kUnits) {
    uint64_t si = 1, iec = 1;
    for (uint64_t i = 0; i < entry.power; ++i) {
      si *= 1000;
      iec *= 1024;
    }
    const std::string p(entry.si);
    if (u == p || u == p + "b") return si;
    if (u == p + "i" || u == p + "ib") return iec;
  }
  return std::nullopt;
}

std::optional<uint64_t> ParseBytesImpl(std::string_view text, std::string* why) {
  std::string_view s = Trim(text);
  if (s.empty()) {
    *why = "empty; expected a number of bytes such as 4096, 512MiB or 4GiB";
    return std::nullopt;
  }
  if (s.front() == '-') {
    *why = "must not be negative";
    return std::nullopt;
  }
  size_t i = 0;
  while (i < s.size() && IsDigit(s[i])) ++i;
  const std::string_view int_digits = s.substr(0, i);
  std::string_view frac_digits;
  if (i < s.size() && s[i] == '.') {
    const size_t start = ++i;
    while (i < s.size() && IsDigit(s[i])) ++i;
    frac_digits = s.substr(start, i - start);
    if (frac_digits.empty()) {
      *why = "expected digits after '.'";
      return std::nullopt;
    }
  }
  if (int_digits.empty()) {
    *why = "expected a number of bytes such as 4096, 512MiB or 4GiB";
    return std::nullopt;
  }
  while (i < s.size() && s[i] == ' ') ++i;
  const std::string_view unit = s.substr(i);
  const std::optional<uint64_t> multiplier = ByteUnitMultiplier(unit);
  if (!multiplier) {
    *why = absl::StrCat(
        "unknown unit ", QuoteForMessage(unit),
        "; use B, K/KB, M/MB, G/GB, T/TB, P/PB, E/EB (powers of 1000) or Ki/KiB, Mi/MiB, "
        "Gi/GiB, Ti/TiB, Pi/PiB, Ei/EiB (powers of 1024), case-insensitive");
    return std::nullopt;
  }
  const uint128 max = std::numeric_limits<uint64_t>::max();
  const std::string too_large = "too large: at most 18446744073709551615 bytes (16 EiB)";
  std::optional<uint128> whole = DigitsToValue(int_digits, max);
  if (!whole) {
    *why = too_large;
    return std::nullopt;
  }
  uint128 value = *whole * *multiplier;  // < 2^64 * 2^60: no overflow
  while (frac_digits.size() > 1 && frac_digits.back() == '0') frac_digits.remove_suffix(1);
  if (frac_digits.size() > 18) {
    *why = "not a whole number of bytes (too many decimal places)";
    return std::nullopt;
  }
  if (!frac_digits.empty()) {
    uint128 denominator = 1;
    for (size_t k = 0; k < frac_digits.size(); ++k) denominator *= 10;
    const uint128 numerator = *DigitsToValue(frac_digits, denominator) * *multiplier;
    if (numerator % denominator != 0) {
      *why = "not a whole number of bytes";
      return std::nullopt;
    }
    value += numerator / denominator;
  }
  if (value > max) {
    *why = too_large;
    return std::nullopt;
  }
  return static_cast<uint64_t>(value);
}

std::optional<absl::Duration> ParseDurationImpl(std::string_view text, std::string* why) {
  constexpr std::string_view kExpected =
      "expected a plain integer number of milliseconds or numbers with units ns, us, ms, s, "
      "m, h (e.g. 500ms, 5s, 1.5s, 2m, 1h30m)";
  const std::string_view s = Trim(text);
  if (s.empty()) {
    *why = absl::StrCat("empty; ", AV(kExpected));
    return std::nullopt;
  }
  if (s.front() == '-') {
    *why = "must not be negative";
    return std::nullopt;
  }
  if (AllDigits(s)) {
    std::optional<uint128> ms = DigitsToValue(s, std::numeric_limits<int64_t>::max());
    if (!ms) {
      *why = "too large";
      return std::nullopt;
    }
    return absl::Milliseconds(static_cast<int64_t>(*ms));
  }
  absl::Duration d;
  if (s == "inf" || s == "+inf" || !absl::ParseDuration(AV(s), &d)) {
    *why = std::string(kExpected);
    return std::nullopt;
  }
  if (d < absl::ZeroDuration()) {
    *why = "must not be negative";
    return std::nullopt;
  }
  if (d == absl::InfiniteDuration()) {
    *why = "too large";
    return std::nullopt;
  }
  return d;
}

// ---- Keys.

absl::Status InvalidKey(std::string_view key, std::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(
      "config key ", QuoteForMessage(key), " is invalid: ", AV(why),
      "; keys are '.'-separated segments of lower-case letters and digits with single '_' "
      "between words (e.g. \"lease_ms\", \"metrics.listen\")"));
}

// Why `key` is not a valid config key, or "" if it is.
std::string KeyProblem(std::string_view key) {
  if (key.empty()) return "it is empty";
  size_t segment_start = 0;
  for (size_t i = 0; i <= key.size(); ++i) {
    if (i < key.size() && key[i] != '.') continue;
    const std::string_view segment = key.substr(segment_start, i - segment_start);
    if (segment.empty()) return "it has an empty segment";
    if (segment.front() == '_' || segment.back() == '_') {
      return "a segment starts or ends with '_'";
    }
    if (segment.find("__") != std::string_view::npos) return "it contains \"__\"";
    for (char c : segment) {
      if ((c >= 'a' && c <= 'z') || IsDigit(c) || c == '_') continue;
      std::string why =
          absl::StrCat("character ", QuoteForMessage(std::string_view(&c, 1)), " is not allowed");
      if ((c >= 'A' && c <= 'Z') || c == '-') {
        std::string suggestion(key);
        for (char& ch : suggestion) ch = ch == '-' ? '_' : ToLower(ch);
        absl::StrAppend(&why, " (did you mean ", QuoteForMessage(suggestion), "?)");
      }
      return why;
    }
    segment_start = i + 1;
  }
  return "";
}

// Optimal-string-alignment edit distance (adjacent transpositions cost 1).
size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// How `key` is spelled in `source`.
std::string SpellKeyFor(std::string_view key, ConfigSource source) {
  switch (source) {
    case ConfigSource::kEnv:
      return EnvVarForKey(key);
    case ConfigSource::kFlag:
      return FlagForKey(key);
    case ConfigSource::kFile:
      break;
  }
  return QuoteForMessage(key);
}

// ---- YAML adapter. yaml-cpp throws; every call into it stays inside
// LoadYamlFile's try block.

absl::StatusOr<std::string> ReadConfigFile(const std::string& path) {
  const std::string quoted = QuoteForMessage(path);
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    const std::string msg =
        absl::StrCat("cannot open config file ", quoted, ": ", std::strerror(err));
    if (err == ENOENT || err == ENOTDIR) {
      return absl::NotFoundError(absl::StrCat("config file ", quoted, " not found"));
    }
    if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
    return absl::InternalError(msg);
  }
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot stat config file ", quoted, ": ", std::strerror(errno)));
  }
  if (S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("config file ", quoted, " is a directory"));
  }
  std::string text;
  char buf[8192];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(
          absl::StrCat("cannot read config file ", quoted, ": ", std::strerror(errno)));
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > kMaxConfigFileBytes) {
      return absl::InvalidArgumentError(absl::StrCat("config file ", quoted, " is larger than ",
                                                     FormatBytes(kMaxConfigFileBytes)));
    }
  }
  return text;
}

class YamlFlattener {
 public:
  YamlFlattener(const std::string& path, Config::ValueMap* out) : path_(path), out_(out) {}

  // "path:line:column" (1-based) for a yaml-cpp mark; just the path when the
  // mark is unknown.
  std::string Where(const YAML::Mark& mark) const {
    if (mark.line < 0 || mark.column < 0) return path_;
    return absl::StrCat(path_, ":", mark.line + 1, ":", mark.column + 1);
  }

  absl::Status Error(const YAML::Mark& mark, std::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("config file ", Where(mark), ": ", AV(what)));
  }

  absl::Status FlattenRoot(const YAML::Node& root) {
    switch (root.Type()) {
      case YAML::NodeType::Null:
      case YAML::NodeType::Undefined:
        return absl::OkStatus();
      case YAML::NodeType::Map:
        return FlattenMap(root, "");
      default:
        return Error(root.Mark(), "the top level must be a mapping of keys to values");
    }
  }

 private:
  absl::Status FlattenMap(const YAML::Node& map, const std::string& prefix) {
    for (const auto& kv : map) {
      const YAML::Node& k = kv.first;
      const YAML::Node& v = kv.second;
      if (!k.IsScalar()) return Error(k.Mark(), "mapping keys must be plain scalars");
      const std::string segment = k.Scalar();
      if (absl::Status s = ValidateConfigKey(segment); !s.ok()) {
        return Error(k.Mark(), SV(s.message()));
      }
      const std::string key = prefix.empty() ? segment : absl::StrCat(prefix, ".", segment);
      switch (v.Type()) {
        case YAML::NodeType::Map:
          if (absl::Status s = FlattenMap(v, key); !s.ok()) return s;
          break;
        case YAML::NodeType::Null:
          if (absl::Status s = Add(key, "", k.Mark()); !s.ok()) return s;
          break;
        case YAML::NodeType::Scalar:
          if (absl::Status s = Add(key, v.Scalar(), v.Mark()); !s.ok()) return s;
          break;
        case YAML::NodeType::Sequence: {
          std::vector<std::string> items;
          for (const YAML::Node& item : v) {
            if (!item.IsScalar()) {
              return Error(item.Mark(), absl::StrCat("key ", QuoteForMessage(key),
                                                     ": sequence elements must be scalars"));
            }
            if (item.Scalar().find(',') != std::string::npos) {
              return Error(item.Mark(),
                           absl::StrCat("key ", QuoteForMessage(key), ": sequence element ",
                                        QuoteForMessage(item.Scalar()),
                                        " contains ',', which separates list elements"));
            }
            items.push_back(item.Scalar());
          }
          if (absl::Status s = Add(key, absl::StrJoin(items, ","), v.Mark()); !s.ok()) return s;
          break;
        }
        default:
          return Error(v.Mark(), absl::StrCat("key ", QuoteForMessage(key),
                                              " has a value of unsupported type"));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Add(const std::string& key, std::string value, const YAML::Mark& mark) {
    const std::string origin = absl::StrCat("file ", Where(mark));
    auto [it, inserted] =
        out_->try_emplace(key, ConfigValue{std::move(value), ConfigSource::kFile, origin});
    if (!inserted) {
      return Error(
          mark, absl::StrCat("key ", QuoteForMessage(key), " is defined more than once (also at ",
                             it->second.origin.substr(5), ")"));
    }
    return absl::OkStatus();
  }

  const std::string& path_;
  Config::ValueMap* out_;
};

// Counts a stream's documents without building them.
class DocumentCounter : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

absl::Status LoadYamlFile(const std::string& path, Config::ValueMap* out) {
  auto text = ReadConfigFile(path);
  if (!text.ok()) return text.status();
  YamlFlattener flattener(path, out);
  try {
    // Count the documents first, stopping at the second: yaml-cpp 0.7's
    // LoadAll never ends on a stream whose first token is ',' (an empty
    // document that consumes nothing, forever: found by tests/fuzz/fuzz_config).
    std::istringstream stream(*text);
    YAML::Parser parser(stream);
    DocumentCounter counter;
    size_t docs = 0;
    while (docs < 2 && parser.HandleNextDocument(counter)) ++docs;
    if (docs == 0) return absl::OkStatus();
    if (docs > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config file ", QuoteForMessage(path),
          " holds more than one YAML document (or a stray ',' or other token outside any mapping); "
          "only one mapping of keys to values is allowed"));
    }
    return flattener.FlattenRoot(YAML::Load(*text));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("config file ", flattener.Where(e.mark), ": invalid YAML: ", e.msg));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("config file ", QuoteForMessage(path), ": cannot parse YAML: ", e.what()));
  }
}

}  // namespace

std::string_view ConfigSourceName(ConfigSource source) {
  switch (source) {
    case ConfigSource::kFile:
      return "file";
    case ConfigSource::kEnv:
      return "env";
    case ConfigSource::kFlag:
      return "flag";
  }
  return "unknown";
}

std::map<std::string, std::string> EnvironmentFromEnvp(const char* const* envp) {
  std::map<std::string, std::string> env;
  if (envp == nullptr) return env;
  for (; *envp != nullptr; ++envp) {
    const std::string_view entry(*envp);
    const size_t eq = entry.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(entry.substr(0, eq)), std::string(entry.substr(eq + 1)));
  }
  return env;
}

std::map<std::string, std::string> CaptureEnvironment() { return EnvironmentFromEnvp(environ); }

absl::Status ValidateConfigKey(std::string_view key) {
  const std::string problem = KeyProblem(key);
  return problem.empty() ? absl::OkStatus() : InvalidKey(key, problem);
}

std::string EnvVarForKey(std::string_view key) {
  std::string name(kEnvPrefix);
  for (char c : key) {
    if (c == '.') {
      name += "__";
    } else {
      name += ToUpper(c);
    }
  }
  return name;
}

std::string FlagForKey(std::string_view key) {
  std::string flag = "--";
  for (char c : key) flag += c == '_' ? '-' : c;
  return flag;
}

absl::StatusOr<std::string> KeyForEnvVar(std::string_view name) {
  const auto fail = [&](std::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "environment variable ", QuoteForMessage(name), " does not name a config key: ", AV(why),
        "; config variables are CKPT_ followed by upper-case letters and digits, "
        "'_' between words and \"__\" for '.' (e.g. CKPT_LEASE_MS, "
        "CKPT_METRICS__LISTEN)"));
  };
  if (name.substr(0, kEnvPrefix.size()) != kEnvPrefix) return fail("it lacks the CKPT_ prefix");
  const std::string_view rest = name.substr(kEnvPrefix.size());
  if (rest.empty()) return fail("nothing follows CKPT_");
  for (char c : rest) {
    if (!((c >= 'A' && c <= 'Z') || IsDigit(c) || c == '_')) {
      return fail(
          absl::StrCat("character ", QuoteForMessage(std::string_view(&c, 1)), " is not allowed"));
    }
  }
  std::string key;
  for (size_t i = 0; i < rest.size(); ++i) {
    if (rest[i] == '_' && i + 1 < rest.size() && rest[i + 1] == '_') {
      key += '.';
      ++i;
    } else {
      key += ToLower(rest[i]);
    }
  }
  if (const std::string problem = KeyProblem(key); !problem.empty()) {
    return fail(
        absl::StrCat("it maps to key ", QuoteForMessage(key), ", which is invalid: ", problem));
  }
  return key;
}

absl::StatusOr<std::string> KeyForFlag(std::string_view flag) {
  std::string_view name = flag;
  for (int i = 0; i < 2 && !name.empty() && name.front() == '-'; ++i) name.remove_prefix(1);
  std::string key(name);
  for (char& c : key) {
    if (c == '-') c = '_';
  }
  if (absl::Status s = ValidateConfigKey(key); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("flag ", QuoteForMessage(flag), " does not name a config key: ", s.message()));
  }
  return key;
}

absl::StatusOr<uint64_t> ParseBytes(std::string_view text) {
  std::string why;
  std::optional<uint64_t> v = ParseBytesImpl(text, &why);
  if (!v) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid byte size ", QuoteForMessage(text), ": ", why));
  }
  return *v;
}

absl::StatusOr<absl::Duration> ParseDuration(std::string_view text) {
  std::string why;
  std::optional<absl::Duration> v = ParseDurationImpl(text, &why);
  if (!v) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid duration ", QuoteForMessage(text), ": ", why));
  }
  return *v;
}

std::string FormatBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  constexpr int kLast = 6;
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  int u = 0;
  while (u < kLast && bytes >= (uint64_t{1} << (10 * (u + 1)))) ++u;
  auto hundredths = [&](int unit) {
    const uint128 size = uint128{1} << (10 * unit);
    return static_cast<uint64_t>((uint128{bytes} * 100 + size / 2) / size);
  };
  uint64_t h = hundredths(u);
  if (h >= 1024 * 100 && u < kLast) h = hundredths(++u);  // 1023.999 MiB -> 1 GiB
  const uint64_t whole = h / 100, frac = h % 100;
  if (frac == 0) return absl::StrCat(whole, " ", kUnits[u]);
  if (frac % 10 == 0) return absl::StrCat(whole, ".", frac / 10, " ", kUnits[u]);
  return absl::StrFormat("%d.%02d %s", whole, frac, kUnits[u]);
}

// ---- Config.

absl::StatusOr<Config> Config::Load(const ConfigSources& sources) {
  Config config;
  if (!sources.file_path.empty()) {
    if (absl::Status s = LoadYamlFile(sources.file_path, &config.values_); !s.ok()) return s;
  }
  for (const auto& [name, value] : sources.env) {
    if (std::string_view(name).substr(0, kEnvPrefix.size()) != kEnvPrefix) continue;
    absl::StatusOr<std::string> key = KeyForEnvVar(name);
    if (!key.ok()) return key.status();
    config.values_[*key] = ConfigValue{value, ConfigSource::kEnv, absl::StrCat("env ", name)};
  }
  std::map<std::string, std::string> flag_for_key;  // to catch two spellings of one key
  for (const auto& [flag, value] : sources.flags) {
    absl::StatusOr<std::string> key = KeyForFlag(flag);
    if (!key.ok()) return key.status();
    auto [it, inserted] = flag_for_key.try_emplace(*key, flag);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat("flags ", QuoteForMessage(it->second), " and ",
                                                     QuoteForMessage(flag), " both set config key ",
                                                     QuoteForMessage(*key)));
    }
    config.values_[*key] =
        ConfigValue{value, ConfigSource::kFlag, absl::StrCat("flag ", FlagForKey(*key))};
  }
  return config;
}

bool Config::Has(std::string_view key) const { return Find(key) != nullptr; }

const ConfigValue* Config::Find(std::string_view key) const {
  auto it = values_.find(key);
  return it == values_.end() ? nullptr : &it->second;
}

absl::StatusOr<const ConfigValue*> Config::Require(std::string_view key) const {
  if (const ConfigValue* v = Find(key)) return v;
  return absl::NotFoundError(absl::StrCat("config key ", QuoteForMessage(key),
                                          " is not set (set it in the config file, as ",
                                          EnvVarForKey(key), " or with ", FlagForKey(key), ")"));
}

namespace {

absl::Status BadValue(std::string_view key, const ConfigValue& v, std::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("config key ", QuoteForMessage(key), " (from ",
                                                 v.origin, ") has invalid value ",
                                                 QuoteForMessage(v.value), ": ", AV(why)));
}

// Looks `key` up in `config` and parses it with `parse`; `fallback` is returned
// when the key is unset, or NotFound if there is none.
template <typename T, typename Parse>
absl::StatusOr<T> GetTyped(const Config& config, std::string_view key, Parse parse,
                           std::optional<T> fallback) {
  const ConfigValue* v = config.Find(key);
  if (v == nullptr) {
    if (fallback) return *fallback;
    absl::StatusOr<std::string> missing = config.GetString(key);  // NotFound with the hints
    return missing.status();
  }
  std::string why;
  std::optional<T> parsed = parse(v->value, &why);
  if (!parsed) return BadValue(key, *v, why);
  return *parsed;
}

}  // namespace

absl::StatusOr<std::string> Config::GetString(std::string_view key) const {
  absl::StatusOr<const ConfigValue*> v = Require(key);
  if (!v.ok()) return v.status();
  return (*v)->value;
}

std::string Config::GetStringOr(std::string_view key, std::string_view default_value) const {
  const ConfigValue* v = Find(key);
  return v == nullptr ? std::string(default_value) : v->value;
}

absl::StatusOr<std::vector<std::string>> Config::GetList(std::string_view key) const {
  absl::StatusOr<const ConfigValue*> v = Require(key);
  if (!v.ok()) return v.status();
  std::vector<std::string> items;
  const std::string_view value = (*v)->value;
  if (Trim(value).empty()) return items;
  size_t start = 0;
  for (;;) {
    const size_t comma = value.find(',', start);
    const std::string_view item =
        Trim(value.substr(start, comma == std::string_view::npos ? value.npos : comma - start));
    if (item.empty()) {
      return BadValue(key, **v, absl::StrCat("empty list element at position ", items.size()));
    }
    items.emplace_back(item);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return items;
}

absl::StatusOr<std::vector<std::string>> Config::GetListOr(
    std::string_view key, const std::vector<std::string>& default_value) const {
  if (!Has(key)) return default_value;
  return GetList(key);
}

absl::StatusOr<int64_t> Config::GetInt64(std::string_view key) const {
  return GetTyped<int64_t>(*this, key, ParseInt64Impl, std::nullopt);
}
absl::StatusOr<int64_t> Config::GetInt64Or(std::string_view key, int64_t default_value) const {
  return GetTyped<int64_t>(*this, key, ParseInt64Impl, default_value);
}
absl::StatusOr<uint64_t> Config::GetUint64(std::string_view key) const {
  return GetTyped<uint64_t>(*this, key, ParseUint64Impl, std::nullopt);
}
absl::StatusOr<uint64_t> Config::GetUint64Or(std::string_view key, uint64_t default_value) const {
  return GetTyped<uint64_t>(*this, key, ParseUint64Impl, default_value);
}
absl::StatusOr<bool> Config::GetBool(std::string_view key) const {
  return GetTyped<bool>(*this, key, ParseBoolImpl, std::nullopt);
}
absl::StatusOr<bool> Config::GetBoolOr(std::string_view key, bool default_value) const {
  return GetTyped<bool>(*this, key, ParseBoolImpl, default_value);
}
absl::StatusOr<uint64_t> Config::GetBytes(std::string_view key) const {
  return GetTyped<uint64_t>(*this, key, ParseBytesImpl, std::nullopt);
}
absl::StatusOr<uint64_t> Config::GetBytesOr(std::string_view key, uint64_t default_value) const {
  return GetTyped<uint64_t>(*this, key, ParseBytesImpl, default_value);
}
absl::StatusOr<absl::Duration> Config::GetDuration(std::string_view key) const {
  return GetTyped<absl::Duration>(*this, key, ParseDurationImpl, std::nullopt);
}
absl::StatusOr<absl::Duration> Config::GetDurationOr(std::string_view key,
                                                     absl::Duration default_value) const {
  return GetTyped<absl::Duration>(*this, key, ParseDurationImpl, default_value);
}

absl::Status Config::CheckKnownKeys(const std::set<std::string>& known) const {
  std::vector<std::string> problems;
  for (const auto& [key, v] : values_) {
    if (known.count(key) != 0) continue;
    std::string problem =
        absl::StrCat("unknown config key ", QuoteForMessage(key), " (from ", v.origin, ")");
    // Close enough to be a typo: 1 edit for short keys, up to 3 for long ones.
    const size_t threshold = key.size() <= 4 ? 1 : key.size() <= 10 ? 2 : 3;
    const std::string* best = nullptr;
    size_t best_distance = threshold + 1;
    for (const std::string& candidate : known) {
      const size_t d = EditDistance(key, candidate);
      if (d < best_distance) {
        best_distance = d;
        best = &candidate;
      }
    }
    if (best != nullptr) {
      absl::StrAppend(&problem, "; did you mean ", SpellKeyFor(*best, v.source), "?");
    }
    problems.push_back(std::move(problem));
  }
  if (problems.empty()) return absl::OkStatus();
  if (problems.size() == 1) return absl::InvalidArgumentError(problems[0]);
  return absl::InvalidArgumentError(
      absl::StrCat(problems.size(), " unknown config keys: ", absl::StrJoin(problems, "; ")));
}

std::string Config::DebugString() const {
  std::string out;
  for (const auto& [key, v] : values_) {
    const size_t dot = key.rfind('.');
    const std::string_view last =
        dot == std::string::npos ? std::string_view(key) : std::string_view(key).substr(dot + 1);
    const bool secret = last.find("password") != std::string_view::npos ||
                        last.find("secret") != std::string_view::npos ||
                        last.find("token") != std::string_view::npos;
    absl::StrAppend(&out, key, " = ", secret ? "<redacted>" : QuoteForMessage(v.value), "  (",
                    v.origin, ")\n");
  }
  return out;
}

}  // namespace ckpt
