#include "server/cmd/daemon.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace ckpt::daemon {

absl::StatusOr<std::string> AdvertisedAddress(const std::string& listen, const std::string& advertise_host) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("no port in \"", listen, "\""));
  const std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  if (host != "0.0.0.0" && host != "[::]" && host != "*" && host != "::") return listen;
  if (!advertise_host.empty()) return absl::StrCat(advertise_host, ":", port);
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("cannot list interfaces to advertise ", listen,
                                                      "; pass --advertise-host"));
  }
  std::string found;
  for (ifaddrs* i = ifs; i != nullptr && found.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    if ((i->ifa_flags & IFF_UP) == 0 || (i->ifa_flags & IFF_LOOPBACK) != 0) continue;
    char buf[INET_ADDRSTRLEN] = {};
    if (::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof(buf)) != nullptr) {
      found = buf;
    }
  }
  ::freeifaddrs(ifs);
  if (found.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "listening on ", listen, " but this machine has no non-loopback IPv4 address to advertise to peers; "
        "pass --advertise-host"));
  }
  return absl::StrCat(found, ":", port);
}

absl::Status ValidateMetaAddresses(const std::string& key, const std::string& value) {
  if (value.find(',') == std::string::npos) return ValidateHostPort(key, value);
  for (const std::string& one : std::vector<std::string>(absl::StrSplit(value, ','))) {
    CKPT_RETURN_IF_ERROR(ValidateHostPort(key, one));
    std::string host = one.substr(0, one.rfind(':'));
    if (host.front() == '[') host = host.substr(1, host.size() - 2);
    unsigned char buf[sizeof(in6_addr)];
    if (inet_pton(AF_INET, host.c_str(), buf) != 1 && inet_pton(AF_INET6, host.c_str(), buf) != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          key, " \"", value, "\": a list of addresses must be IP literals (", host,
          " is not); give a DNS name that resolves to every replica alone instead"));
    }
  }
  return absl::OkStatus();
}

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
