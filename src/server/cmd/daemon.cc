#include "server/cmd/daemon.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "absl/strings/numbers.h"

namespace ckpt::daemon {

absl::Status ValidateHostPort(const std::string& key, const std::string& value) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(
        key, " \"", value, "\" is not a listen address: ", why,
        "; use host:port, e.g. 127.0.0.1:7400, 0.0.0.0:7400 or [::1]:7400 (port 0 picks a free one)"));
  };
  const size_t colon = value.rfind(':');
  if (colon == std::string::npos) return bad("no ':port'");
  const std::string host = value.substr(0, colon);
  const std::string port = value.substr(colon + 1);
  if (host.empty()) return bad("the host is empty");
  if (host.front() == '[') {
    if (host.size() < 3 || host.back() != ']' ||
        host.find_first_of("[]", 1) != host.size() - 1) {
      return bad("an IPv6 host must be one bracketed address");
    }
  } else if (host.find_first_of(":[]/ ") != std::string::npos) {
    return bad("the host contains ':', '[', ']', '/' or a space (IPv6 addresses need brackets)");
  }
  uint32_t port_number = 0;
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      !absl::SimpleAtoi(port, &port_number) || port_number > 65535) {
    return bad("the port must be a number 0..65535");
  }
  return absl::OkStatus();
}

absl::StatusOr<Config> LoadDaemonConfig(const std::string& config_file,
                                        const std::map<std::string, std::string>& flags,
                                        const std::set<std::string>& known_keys) {
  std::map<std::string, std::string> env;
  for (const auto& [name, value] : CaptureEnvironment()) {
    if (name.rfind("CKPT_", 0) == 0 && KeyForEnvVar(name).ok()) env.emplace(name, value);
  }
  absl::StatusOr<Config> config = Config::Load({config_file, env, flags});
  if (!config.ok()) return config.status();
  absl::StatusOr<Config> own = Config::Load({config_file, {}, flags});
  if (!own.ok()) return own.status();
  if (absl::Status s = own->CheckKnownKeys(known_keys); !s.ok()) return s;
  return config;
}

int InitLoggingAndSignals(const char* program, const log::Options& log_options, sigset_t* signals) {
  if (absl::Status s = log::Init(log_options); !s.ok()) {
    std::fprintf(stderr, "%s: cannot set up logging: %s\n", program, std::string(s.message()).c_str());
    return kExitUsage;
  }
  sigemptyset(signals);
  sigaddset(signals, SIGTERM);
  sigaddset(signals, SIGINT);
  if (int err = pthread_sigmask(SIG_BLOCK, signals, nullptr); err != 0) {
    log::Error("{}: cannot block signals: {}", program, std::strerror(err));
    return kExitFailure;
  }
  return kExitOk;
}

}  // namespace ckpt::daemon
