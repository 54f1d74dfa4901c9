// Layered configuration shared by every ckpt daemon (docs/architecture.md "Interfaces").
//
// A Config is a flat map from dotted keys ("lease_ms", "metrics.listen") to
// string values, each remembering where it came from. Config::Load() layers
// three sources, later ones winning key by key:
//
//   1. a YAML file (optional),
//   2. environment variables named CKPT_*,
//   3. command-line flags that were explicitly set.
//
// Keys. A key is one or more segments joined by '.'; each segment is lower-case
// ASCII letters and digits, optionally separated by single '_':
// [a-z0-9]+(_[a-z0-9]+)*. Examples: "lease_ms", "memory_dir", "metrics.listen".
//
// YAML file. The top level must be a mapping (an empty file is an empty
// config). Nested mappings flatten to dotted keys:
//     metrics:
//       listen: 0.0.0.0:9401      ->  metrics.listen = "0.0.0.0:9401"
// A mapping key may itself be dotted ("metrics.listen: x" is the same key).
// Scalars are kept as written (without quotes). A null value ("key:", "~")
// sets the key to the empty string. A sequence of scalars becomes one
// comma-joined value ("[a, b]" -> "a,b", read back with GetList()); a sequence
// holding a mapping or sequence, or a scalar containing ',', is an error, as is
// a key defined twice. Only the first document of the file is accepted.
//
// Environment. CKPT_<NAME>, NAME upper-case: '_' stays '_', and "__" stands for
// '.':  lease_ms <-> CKPT_LEASE_MS,  memory_dir <-> CKPT_MEMORY_DIR,
// metrics.listen <-> CKPT_METRICS__LISTEN. Variables without the CKPT_ prefix
// are ignored; every CKPT_ variable is taken as configuration, and one whose
// name does not map to a valid key fails Load(). An empty value is a value.
//
// Flags. The names of explicitly-set flags, with or without leading dashes;
// '-' stands for '_', and '.' stays: --memory-dir <-> memory_dir,
// --metrics.listen <-> metrics.listen. (The daemon's flag parser decides which
// flags exist; Load() only needs the ones the user actually set, so that flag
// defaults do not override the file and the environment.)
//
// Values. Typed getters parse on access and fail with InvalidArgument naming the
// key and its origin, e.g.
//   config key "lease_ms" (from env CKPT_LEASE_MS) has invalid value "5x":
//   expected a signed 64-bit integer
// A missing key is NotFound from Get*(), and the default from Get*Or(); a key
// that is present but malformed is an error from both.
//
// Thread safety: a Config is immutable after Load(); const methods may be
// called concurrently. Load() blocks on reading the file.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ckpt {

// Where a value came from.
enum class ConfigSource { kFile, kEnv, kFlag };

// "file", "env" or "flag".
std::string_view ConfigSourceName(ConfigSource source);

// One configured value and its origin.
struct ConfigValue {
  std::string value;
  ConfigSource source = ConfigSource::kFile;
  // For messages: "file /etc/ckpt/agent.yaml:3:11" (1-based line:column),
  // "env CKPT_LEASE_MS" or "flag --lease-ms".
  std::string origin;
};

// Inputs of Config::Load(). Plain data, so tests need no real file, process
// environment or command line beyond what they put here.
struct ConfigSources {
  // YAML file to read; empty means no file.
  std::string file_path;
  // Environment variables, name -> value; only CKPT_* names are used. Fill it
  // with CaptureEnvironment() in daemons.
  std::map<std::string, std::string> env;
  // Explicitly-set flags, flag name ("--memory-dir", "memory-dir" or
  // "memory_dir") -> value as given on the command line.
  std::map<std::string, std::string> flags;
};

// A copy of the process environment (every variable, not just CKPT_*).
// Reads `environ`; not safe against concurrent setenv()/putenv().
std::map<std::string, std::string> CaptureEnvironment();

// The variables of a NULL-terminated "NAME=value" array such as main()'s envp.
// Entries without '=' are skipped; on duplicate names the first one wins (as
// getenv() does). `envp` may be null.
std::map<std::string, std::string> EnvironmentFromEnvp(const char* const* envp);

// OK iff `key` is a valid config key (see the syntax above); else
// InvalidArgument saying why.
absl::Status ValidateConfigKey(std::string_view key);

// "lease_ms" -> "CKPT_LEASE_MS", "metrics.listen" -> "CKPT_METRICS__LISTEN".
// `key` must be valid.
std::string EnvVarForKey(std::string_view key);
// "lease_ms" -> "--lease-ms", "metrics.listen" -> "--metrics.listen".
// `key` must be valid.
std::string FlagForKey(std::string_view key);

// Inverse of EnvVarForKey(). InvalidArgument if `name` lacks the CKPT_ prefix
// or does not map to a valid key (lower case, "___", trailing '_', ...).
absl::StatusOr<std::string> KeyForEnvVar(std::string_view name);
// Inverse of FlagForKey(); accepts zero, one or two leading dashes and both
// '-' and '_' between words. InvalidArgument if the result is not a valid key.
absl::StatusOr<std::string> KeyForFlag(std::string_view flag);

// Parses a byte count: a non-negative decimal number, optionally with a
// fraction, optionally followed by spaces and a case-insensitive unit:
//   B (or none) = 1
//   K, KB, M, MB, G, GB, T, TB, P, PB, E, EB = powers of 1000 (SI, as in
//     Kubernetes: "1G" is 10^9 bytes)
//   Ki, KiB, Mi, MiB, Gi, GiB, Ti, TiB, Pi, PiB, Ei, EiB = powers of 1024 (IEC)
// Examples: "4096", "4GiB", "512MiB", "1G", "100KB", "1.5 GiB".
// Leading/trailing ASCII whitespace is ignored. InvalidArgument on empty input,
// a sign, garbage, an unknown unit, a fraction that is not a whole number of
// bytes ("0.3KiB"), or a value above 2^64-1.
absl::StatusOr<uint64_t> ParseBytes(std::string_view text);

// Parses a non-negative duration: either a plain integer, meaning
// milliseconds ("500" = 500ms), or one or more decimal numbers with units as
// absl::ParseDuration() takes them: ns, us, ms, s, m, h (case-sensitive),
// e.g. "500ms", "5s", "2m", "1h", "1.5s", "1h30m". Leading/trailing ASCII
// whitespace is ignored. InvalidArgument on empty input, negative values,
// "inf", unknown units, garbage, or values too large to represent.
absl::StatusOr<absl::Duration> ParseDuration(std::string_view text);

// Human-readable size with IEC units and at most two decimals, trailing zeros
// dropped: 0 -> "0 B", 512 -> "512 B", 1536 -> "1.5 KiB", 4 << 30 -> "4 GiB".
// Rounded, so only exact values parse back to the same number.
std::string FormatBytes(uint64_t bytes);

// Layered, immutable configuration. Copyable and movable.
class Config {
 public:
  using ValueMap = std::map<std::string, ConfigValue, std::less<>>;

  // An empty config: every Get*() is NotFound, every Get*Or() the default.
  Config() = default;

  // Reads the file (if any), then the CKPT_* environment, then the flags,
  // later sources overriding earlier ones key by key. Does not check keys
  // against a schema; call CheckKnownKeys() for that.
  // Errors: NotFound if the file does not exist (message names the path);
  // PermissionDenied if it cannot be opened for that reason; InvalidArgument
  // for YAML syntax errors (with path, line and column), structures the
  // format does not allow (see above), invalid keys, and env/flag names that
  // do not map to a valid key; Internal for other read errors.
  static absl::StatusOr<Config> Load(const ConfigSources& sources);

  // True if `key` is set (to any value, including empty).
  bool Has(std::string_view key) const;

  // The value and origin of `key`, or nullptr if it is not set. The pointer
  // lives as long as this Config.
  const ConfigValue* Find(std::string_view key) const;

  // Every key, sorted.
  const ValueMap& values() const { return values_; }

  // The raw string value. NotFound if unset.
  absl::StatusOr<std::string> GetString(std::string_view key) const;
  std::string GetStringOr(std::string_view key, std::string_view default_value) const;

  // The value split at ',' with ASCII whitespace trimmed from each element;
  // an empty value is an empty list. Empty elements ("a,,b") are an error.
  absl::StatusOr<std::vector<std::string>> GetList(std::string_view key) const;
  absl::StatusOr<std::vector<std::string>> GetListOr(
      std::string_view key, const std::vector<std::string>& default_value) const;

  // Decimal integer with optional sign (GetUint64: no '-'); surrounding ASCII
  // whitespace ignored. InvalidArgument on garbage or out of range.
  absl::StatusOr<int64_t> GetInt64(std::string_view key) const;
  absl::StatusOr<int64_t> GetInt64Or(std::string_view key, int64_t default_value) const;
  absl::StatusOr<uint64_t> GetUint64(std::string_view key) const;
  absl::StatusOr<uint64_t> GetUint64Or(std::string_view key, uint64_t default_value) const;

  // true/false, 1/0, yes/no, on/off, case-insensitive.
  absl::StatusOr<bool> GetBool(std::string_view key) const;
  absl::StatusOr<bool> GetBoolOr(std::string_view key, bool default_value) const;

  // As ParseBytes().
  absl::StatusOr<uint64_t> GetBytes(std::string_view key) const;
  absl::StatusOr<uint64_t> GetBytesOr(std::string_view key, uint64_t default_value) const;

  // As ParseDuration(): a plain integer is milliseconds.
  absl::StatusOr<absl::Duration> GetDuration(std::string_view key) const;
  absl::StatusOr<absl::Duration> GetDurationOr(std::string_view key,
                                               absl::Duration default_value) const;

  // OK iff every key is in `known`. Otherwise InvalidArgument listing each
  // unknown key with its origin and, when a known key is close (edit
  // distance), a suggestion spelled for that origin:
  //   unknown config key "lease_mss" (from env CKPT_LEASE_MSS); did you mean
  //   CKPT_LEASE_MS?
  absl::Status CheckKnownKeys(const std::set<std::string>& known) const;

  // One "key = value  (origin)" line per key, for start-up logs. Values of keys
  // whose last segment contains "password", "secret" or "token" are replaced
  // by "<redacted>".
  std::string DebugString() const;

 private:
  // The entry for `key`, or NotFound naming the key and where it can be set.
  absl::StatusOr<const ConfigValue*> Require(std::string_view key) const;

  ValueMap values_;
};

}  // namespace ckpt
