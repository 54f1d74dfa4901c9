// Free TCP ports on 127.0.0.1 for tests that run real daemons.
//
//   CKPT_ASSIGN_OR_RETURN(std::vector<int> ports, PickFreePorts(3));
//   // meta on ports[0], agents on ports[1] and ports[2]
//
// A port is found by binding a socket to 127.0.0.1:0, reading the port the
// kernel chose and closing the socket. A process-wide registry makes sure one
// test process never hands out the same port twice, even if the daemon that
// used it has exited (so a restarted daemon keeps its port and a new one never
// takes it).
//
// Inherent race: between the probe socket's close and the daemon's bind,
// another process on the machine may take the port (the kernel hands out ports
// for bind(port 0) from the ephemeral range, which outgoing connections use
// too). The window is short and the kernel picks such ports at random from a
// range of about 28k, so this is rare; a test that sees EADDRINUSE from a
// daemon it just started may pick new ports and retry. Daemons that can report
// the port they bound (listen on port 0) avoid the race entirely.
//
// Thread safety: all functions may be called from any thread.
#pragma once

#include <vector>

#include "absl/status/statusor.h"

namespace ckpt::testing {

// Returns a TCP port that was free on 127.0.0.1 at the time of the call and
// that no earlier call in this process returned. Does not block beyond a few
// system calls. Errors: the socket/bind/getsockname failure as a Status
// (e.g. ResourceExhausted for EMFILE), or ResourceExhausted if the kernel kept
// returning ports this process already handed out.
absl::StatusOr<int> PickFreePort();

// Returns `n` distinct ports, each as PickFreePort() (so also distinct from
// every port handed out before). n == 0 gives an empty vector; n < 0 is
// InvalidArgument. On error no port of this call is returned, but those
// already drawn stay reserved.
absl::StatusOr<std::vector<int>> PickFreePorts(int n);

}  // namespace ckpt::testing
