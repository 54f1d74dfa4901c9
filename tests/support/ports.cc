#include "support/ports.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/file_system.h"

namespace ckpt::testing {
namespace {

// Attempts per PickFreePort() before giving up: the kernel picks bind(0) ports
// at random from the ephemeral range (about 28k ports), so a repeat of a port
// this process already holds is rare and 100 repeats in a row mean the range
// is used up.
constexpr int kMaxAttempts = 100;

struct Registry {
  absl::Mutex mu;
  absl::flat_hash_set<int> handed_out ABSL_GUARDED_BY(mu);
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed
  return *registry;
}

// Binds a fresh socket to 127.0.0.1:0 and returns the port the kernel chose.
absl::StatusOr<int> ProbePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return PosixErrorToStatus(errno, "socket", "127.0.0.1:0");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd);
    return PosixErrorToStatus(err, "bind", "127.0.0.1:0");
  }
  ::close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

}  // namespace

absl::StatusOr<int> PickFreePort() {
  Registry& registry = GetRegistry();
  for (int attempt = 0; attempt < kMaxAttempts; ++attempt) {
    absl::StatusOr<int> port = ProbePort();
    if (!port.ok()) return port.status();
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

}  // namespace ckpt::testing
