// ClientOptions::FromEnvironment: job, rank, world size, meta and agent
// socket from the launcher's environment, by the rules of Python's
// ckpt.environment.client_config (python/ckpt/environment.py) and with its
// words, so that both languages explain a missing value the same way.
#include <sys/stat.h>

#include <cstdlib>
#include <iterator>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/options.h"

namespace ckpt {
namespace {

constexpr char kDefaultAgentSocket[] = "/run/ckpt/agent.sock";
constexpr char kDocs[] = "docs/python.md \"Using ckpt from torchrun / Slurm / Kubernetes\"";
constexpr char kWho[] = "ClientOptions::FromEnvironment";

struct Var {
  const char* name;
  const char* launcher;  // nullptr: ckpt's own
};
constexpr Var kJobVars[] = {{"CKPT_JOB", nullptr}, {"TORCHELASTIC_RUN_ID", "torchrun"}, {"SLURM_JOB_ID", "Slurm"}};
constexpr Var kRankVars[] = {{"RANK", "torchrun"}, {"SLURM_PROCID", "Slurm"}};
constexpr Var kWorldSizeVars[] = {{"WORLD_SIZE", "torchrun"}, {"SLURM_NTASKS", "Slurm"}};
constexpr Var kMetaVars[] = {{"CKPT_META", nullptr}};
constexpr Var kAgentSocketVars[] = {{"CKPT_AGENT_SOCKET", nullptr}};

// The variable's value with blanks trimmed, or nullopt and why it does not count.
std::optional<std::string> Lookup(const EnvironmentSource& env, const Var& v, std::string* why) {
  std::string label = absl::StrCat("$", v.name, v.launcher ? absl::StrCat(" (", v.launcher, ")") : "");
  std::optional<std::string> raw = env.variable ? env.variable(v.name) : std::nullopt;
  std::string value = raw ? std::string(absl::StripAsciiWhitespace(*raw)) : std::string();
  if (value.empty()) {
    *why = absl::StrCat(label, " is not set");
    return std::nullopt;
  }
  if (std::string(v.name) == "TORCHELASTIC_RUN_ID" && value == "none") {
    *why = absl::StrCat(label, " is \"none\" (torchrun without --rdzv_id: no run name)");
    return std::nullopt;
  }
  return value;
}

bool AllDigits(const std::string& s) {
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return !s.empty();
}

std::optional<uint32_t> ParseCount(const std::string& s) {
  if (!AllDigits(s) || s.size() > 10) return std::nullopt;
  uint64_t v = 0;
  for (char c : s) v = v * 10 + static_cast<uint64_t>(c - '0');
  if (v > UINT32_MAX) return std::nullopt;
  return static_cast<uint32_t>(v);
}

class Resolver {
 public:
  explicit Resolver(const EnvironmentSource& env) : env_(env) {}

  // A string value: given, else the first variable set.
  std::optional<std::string> String(const std::string& name, const std::optional<std::string>& given,
                                    const Var* vars, size_t n, std::vector<std::string>* looked_out = nullptr) {
    if (given) {
      sources_[name] = "given";
      return *given;
    }
    std::vector<std::string> looked = {absl::StrCat("no given.", name)};
    for (size_t i = 0; i < n; ++i) {
      std::string why;
      if (auto v = Lookup(env_, vars[i], &why)) {
        sources_[name] = absl::StrCat("$", vars[i].name);
        return v;
      }
      looked.push_back(why);
    }
    if (looked_out) {
      *looked_out = std::move(looked);
    } else {
      missing_.emplace_back(name, std::move(looked));
    }
    return std::nullopt;
  }

  // A count (rank, world size): given, else the first variable set, which
  // must be an integer >= 0 that fits 32 bits.
  std::optional<uint32_t> Count(const std::string& name, const std::optional<uint32_t>& given, const Var* vars,
                                size_t n) {
    if (given) {
      sources_[name] = "given";
      return *given;
    }
    std::vector<std::string> looked = {absl::StrCat("no given.", name)};
    for (size_t i = 0; i < n; ++i) {
      std::string why;
      std::optional<std::string> v = Lookup(env_, vars[i], &why);
      if (!v) {
        looked.push_back(why);
        continue;
      }
      std::optional<uint32_t> parsed = ParseCount(*v);
      if (!parsed) {
        bad_.push_back(absl::StrCat("  ", name, ": $", vars[i].name, " is '", env_.variable(vars[i].name).value_or(""),
                                    AllDigits(*v) ? "', larger than 4294967295" : "', not an integer >= 0"));
        return std::nullopt;
      }
      sources_[name] = absl::StrCat("$", vars[i].name);
      return parsed;
    }
    missing_.emplace_back(name, std::move(looked));
    return std::nullopt;
  }

  void Missing(const std::string& name, std::vector<std::string> looked) {
    missing_.emplace_back(name, std::move(looked));
  }
  void Bad(std::string line) { bad_.push_back(std::move(line)); }
  void Source(const std::string& name, std::string from) { sources_[name] = std::move(from); }
  const std::map<std::string, std::string>& sources() const { return sources_; }

  absl::Status Result() const {
    if (missing_.empty() && bad_.empty()) return absl::OkStatus();
    std::vector<std::string> lines;
    if (!missing_.empty()) {
      std::vector<std::string> names;
      for (const auto& [name, looked] : missing_) names.push_back(name);
      lines.push_back(
          absl::StrCat(kWho, ": no ", absl::StrJoin(names, ", "), " given, and none found in the environment:"));
      for (const auto& [name, looked] : missing_) {
        lines.push_back(absl::StrCat("  ", name, ": ", absl::StrJoin(looked, "; ")));
      }
    }
    if (!bad_.empty()) {
      lines.push_back(absl::StrCat(kWho, ": unusable values in the environment:"));
      lines.insert(lines.end(), bad_.begin(), bad_.end());
    }
    lines.push_back(absl::StrCat("Pass them in ClientEnvironmentGiven or set the variables (", kDocs, ")."));
    return absl::InvalidArgumentError(absl::StrJoin(lines, "\n"));
  }

 private:
  const EnvironmentSource& env_;
  std::vector<std::pair<std::string, std::vector<std::string>>> missing_;
  std::vector<std::string> bad_;
  std::map<std::string, std::string> sources_;
};

}  // namespace

EnvironmentSource EnvironmentSource::Process() {
  EnvironmentSource env;
  env.variable = [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
  env.path_exists = [](const std::string& path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0;
  };
  return env;
}

EnvironmentSource EnvironmentSource::FromMap(std::map<std::string, std::string> variables,
                                             std::vector<std::string> existing_paths) {
  EnvironmentSource env;
  env.variable = [vars = std::move(variables)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
  env.path_exists = [paths = std::move(existing_paths)](const std::string& path) {
    for (const auto& p : paths) {
      if (p == path) return true;
    }
    return false;
  };
  return env;
}

absl::StatusOr<ClientOptions> ClientOptions::FromEnvironment(const ClientEnvironmentGiven& given,
                                                             std::map<std::string, std::string>* sources) {
  return FromEnvironment(given, EnvironmentSource::Process(), sources);
}

absl::StatusOr<ClientOptions> ClientOptions::FromEnvironment(const ClientEnvironmentGiven& given,
                                                             const EnvironmentSource& env,
                                                             std::map<std::string, std::string>* sources) {
  Resolver r(env);
  std::optional<std::string> job = r.String("job", given.job, kJobVars, std::size(kJobVars));
  std::optional<uint32_t> rank = r.Count("rank", given.rank, kRankVars, std::size(kRankVars));
  std::optional<uint32_t> world = r.Count("world_size", given.world_size, kWorldSizeVars, std::size(kWorldSizeVars));
  std::optional<std::string> meta = r.String("meta", given.meta, kMetaVars, std::size(kMetaVars));
  std::vector<std::string> socket_looked;
  std::optional<std::string> socket =
      r.String("agent_socket", given.agent_socket, kAgentSocketVars, std::size(kAgentSocketVars), &socket_looked);
  if (!socket) {
    if (env.path_exists && env.path_exists(kDefaultAgentSocket)) {
      socket = kDefaultAgentSocket;
      r.Source("agent_socket", "default");
    } else {
      socket_looked.push_back(absl::StrCat(kDefaultAgentSocket, " (the default) does not exist"));
      r.Missing("agent_socket", std::move(socket_looked));
    }
  }
  // Both given: Client::Connect says so (this is about the environment).
  if (rank && world && *rank >= *world && !(given.rank && given.world_size)) {
    const auto& src = r.sources();
    r.Bad(absl::StrCat("  rank: ", *rank, " (", src.at("rank"), ") is not below world_size ", *world, " (",
                       src.at("world_size"), ")"));
  }
  if (absl::Status s = r.Result(); !s.ok()) return s;
  if (sources != nullptr) *sources = r.sources();
  ClientOptions o;
  o.job_id = *job;
  o.rank = *rank;
  o.world_size = *world;
  o.meta_address = *meta;
  o.agent_socket = *socket;
  return o;
}

}  // namespace ckpt
