// What a process listens on, and throwing garbage at it: for tests that
// check a daemon survives whatever connects to any of its sockets.
//
//   CKPT_ASSIGN_OR_RETURN(std::vector<ListeningSocket> s, ListeningSockets(agent->pid()));
//   for (const ListeningSocket& l : s)
//     CKPT_ASSIGN_OR_RETURN(GarbageResult r, SendGarbage(l, bytes, absl::Seconds(5)));
//
// ListeningSockets reads /proc/<pid>/fd and /proc/<pid>/net/{tcp,tcp6,unix}
// (the process's own network namespace), so it sees every socket the process
// holds, including ones its libraries opened (UCX's TCP transport, its
// shared-memory wake-up sockets), not just the ports a test configured.
//
// SendGarbage only ever sends to loopback: a TCP socket bound to a wildcard or
// loopback address is reached on 127.0.0.1 (or ::1); one bound to any other
// address is refused with FailedPrecondition (tests must not send traffic off
// the host, and the caller should restrict the daemon to loopback instead).
//
// Thread safety: the functions may be called from any thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ckpt::testing {

struct ListeningSocket {
  enum class Kind { kTcp, kUnixStream, kUnixSeqpacket, kUnixDatagram };
  Kind kind = Kind::kTcp;
  // kTcp: the bound address, IPv4 dotted or IPv6 without brackets (an
  // IPv4-mapped IPv6 address is given as IPv4); unix: the path, or
  // "@name" for an abstract socket.
  std::string address;
  int port = 0;  // kTcp only
  bool ipv6 = false;

  // "tcp 127.0.0.1:7402", "unix-stream /run/ckpt/agent.sock",
  // "unix-seqpacket /run/ckpt/session.sock", "unix-dgram @1a2b3".
  std::string ToString() const;
};

// Every listening TCP socket (state LISTEN) and every bound unix socket
// (listening stream and seqpacket sockets, bound datagram sockets) that
// process `pid` holds. Errors: NotFound if the process is gone; PermissionDenied or other
// read errors as a Status.
absl::StatusOr<std::vector<ListeningSocket>> ListeningSockets(pid_t pid);

struct GarbageResult {
  uint64_t bytes_sent = 0;      // the peer may close before taking them all
  bool closed_by_peer = false;  // the peer closed (or reset) the connection
  uint64_t bytes_received = 0;  // anything the peer answered
};

// Connects to `target` (loopback only, see above), writes `bytes` (stopping
// quietly when the peer closes or resets the connection), then waits up to
// `wait_for_close` for the peer to close, reading and counting what it
// answers. A datagram socket gets `bytes` in datagrams of at most 64 KiB
// and `closed_by_peer` stays false; a seqpacket socket gets it in records of
// at most 64 KiB. Errors: Unavailable if the connection is
// refused; FailedPrecondition for a non-loopback address; other socket
// errors as a Status. Blocks at most about `wait_for_close` plus the writes.
absl::StatusOr<GarbageResult> SendGarbage(const ListeningSocket& target, std::string_view bytes,
                                          absl::Duration wait_for_close);

// `n` bytes from a std::mt19937_64 seeded with `seed`.
std::string SeededRandomBytes(size_t n, uint64_t seed);

struct NamedBytes {
  std::string name;  // e.g. "zeros 64KiB"
  std::string bytes;
};

// What garbage tests send: 16 B, 4 KiB, 64 KiB and 1 MiB of zeros and of
// seeded random bytes, and a partial HTTP/2 client preface.
std::vector<NamedBytes> GarbagePayloads(uint64_t seed);

}  // namespace ckpt::testing
