// Free TCP ports on 127.0.0.1 for tests that run real daemons.
//
//   CKPT_ASSIGN_OR_RETURN(std::vector<int> ports, PickFreePorts(3));
//   // meta on ports[0], agents on ports[1] and ports[2]
//
// A port is drawn at random from below the kernel's ephemeral range
// (10000 up to ip_local_port_range's start; bind(0) when there is no room
// there) and checked by binding a socket to it and closing it. A process-wide
// registry makes sure one test process never hands out the same port twice,
// even if the daemon that used it has exited (so a restarted daemon keeps its
// port and a new one never takes it).
//
// Why below the ephemeral range: the kernel gives ports from that range to
// every outgoing connection on the machine, so a port found free there could
// be taken by some connect() before the daemon binds it (seen in CI: an
// agent's metrics port). Ports below it are taken only by an explicit bind, so
// the remaining race is another test process drawing the same port between
// the probe and the daemon's bind (about 1 in 20k per draw, per concurrent
// draw). Daemons that can report the port they bound (listen on port 0) avoid
// the race entirely.
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

// True if `start_error` (a daemon's failed start, with its log tail, as
// WaitForTcpPort reports it) says the daemon could not bind a port it was
// given, i.e. the port was taken after it was picked and a start on new ports
// may succeed.
bool StartLostAPort(const absl::Status& start_error);

}  // namespace ckpt::testing
