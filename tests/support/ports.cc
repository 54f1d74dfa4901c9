#include "support/ports.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <random>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/file_system.h"

namespace ckpt::testing {
namespace {

// Attempts per PickFreePort() before giving up.
constexpr int kMaxAttempts = 200;

// Ports are drawn from [kLowestPort, the ephemeral range's start): the kernel
// never gives those to outgoing connections (or to bind(0)), so a port found
// free stays free unless another test process draws the same one (about 1 in
// 20k per draw).
constexpr int kLowestPort = 10000;

struct Registry {
  absl::Mutex mu;
  absl::flat_hash_set<int> handed_out ABSL_GUARDED_BY(mu);
  std::mt19937_64 rng ABSL_GUARDED_BY(mu);
};

Registry& GetRegistry() {
  static Registry* registry = [] {
    auto* r = new Registry();  // never destroyed
    timespec now{};
    ::clock_gettime(CLOCK_MONOTONIC, &now);
    // Not a test's randomness: only which ports, different per process so that
    // concurrent test processes draw different ones.
    r->rng.seed(static_cast<uint64_t>(::getpid()) * 1000003u ^ static_cast<uint64_t>(now.tv_nsec));
    return r;
  }();
  return *registry;
}

// The first port of the kernel's ephemeral range (32768 if unreadable).
int EphemeralStart() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0, high = 0;
  if (in >> low >> high && low > 0) return low;
  return 32768;
}

// Binds a fresh socket to 127.0.0.1:`port` (0: the kernel chooses) and
// returns the port bound, -1 if that port is taken (EADDRINUSE, EACCES), or
// another error.
absl::StatusOr<int> ProbePort(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return PosixErrorToStatus(errno, "socket", "127.0.0.1:0");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd);
    if (port != 0 && (err == EADDRINUSE || err == EACCES)) return -1;
    return PosixErrorToStatus(err, "bind", absl::StrCat("127.0.0.1:", port));
  }
  ::close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

}  // namespace

absl::StatusOr<int> PickFreePort() {
  Registry& registry = GetRegistry();
  static const int ephemeral_start = EphemeralStart();
  const bool below = ephemeral_start > kLowestPort + 1000;
  for (int attempt = 0; attempt < kMaxAttempts; ++attempt) {
    int candidate = 0;  // the kernel's choice when there is no room below its range
    if (below) {
      absl::MutexLock lock(&registry.mu);
      candidate = std::uniform_int_distribution<int>(kLowestPort, ephemeral_start - 1)(registry.rng);
      if (registry.handed_out.contains(candidate)) continue;
    }
    absl::StatusOr<int> port = ProbePort(candidate);
    if (!port.ok()) return port.status();
    if (*port < 0) continue;  // taken: draw again
    absl::MutexLock lock(&registry.mu);
    if (registry.handed_out.insert(*port).second) return *port;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("no free port on 127.0.0.1 that this process has not handed out yet (",
                   kMaxAttempts, " attempts)"));
}

absl::StatusOr<std::vector<int>> PickFreePorts(int n) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("PickFreePorts: n = ", n));
  std::vector<int> ports;
  ports.reserve(n);
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<int> port = PickFreePort();
    if (!port.ok()) return port.status();
    ports.push_back(*port);
  }
  return ports;
}

bool StartLostAPort(const absl::Status& start_error) {
  const std::string m(start_error.message());
  // It exited before its port accepted connections, or someone else's
  // listener answered on it ("and yet": the port was taken by a listener).
  const bool exited = m.find("before") != std::string::npos || m.find("and yet") != std::string::npos;
  return exited && (m.find("in use") != std::string::npos || m.find("cannot listen") != std::string::npos);
}

}  // namespace ckpt::testing
