// Unix sockets that are never open to more than their owner and group.
//
// bind() creates the socket file with the process umask: with a permissive
// one (0, as some container runtimes set) anyone may connect until a chmod
// afterwards. The file is therefore created owner-only (0600) and only then
// opened to its group (0660, optionally another group).
//
//   int fd = socket(AF_UNIX, ...);
//   RestrictSocketBeforeBind(fd);              // our own bind()
//   bind(fd, path); OpenSocketToGroup(path, gid); listen(fd);
//
//   { OwnerOnlyUmask m; server = builder.BuildAndStart(); }   // a library's bind()
//   OpenSocketToGroup(path, gid);
#pragma once

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt {

// Sets the socket inode's mode so that the file bind() creates for `fd` has
// at most 0600, whatever the umask. Errors: fchmod's errno.
absl::Status RestrictSocketBeforeBind(int fd);

// While alive, the process umask is 0177, so files (and sockets) created on
// any thread get at most 0600. Process-wide: hold it only around the call
// that binds, at start-up; a file another thread creates meanwhile is
// owner-only, which fails safe.
class OwnerOnlyUmask {
 public:
  OwnerOnlyUmask();
  ~OwnerOnlyUmask();
  OwnerOnlyUmask(const OwnerOnlyUmask&) = delete;
  OwnerOnlyUmask& operator=(const OwnerOnlyUmask&) = delete;

 private:
  mode_t old_;
};

// Gives the socket file at `path` mode 0660 and, when `gid` >= 0, group
// `gid`. Errors: PermissionDenied naming the group (chown needs root or
// membership of `gid`; the file then keeps the owner's group), or the chmod
// failure.
absl::Status OpenSocketToGroup(const std::string& path, int gid);

// The group id a daemon's --socket-group names: a number (0 .. 2^31-1) or a
// group name looked up in the group database (getgrnam_r). Blocks on that
// lookup (NSS may ask a directory service). Errors: InvalidArgument naming
// the flag ("--socket-group: no group named \"x\""), for an unknown or empty
// name, or an id out of that range.
absl::StatusOr<int> SocketGroupId(const std::string& group);

// Why the process connected on unix socket `fd` may not use it, or "" when it
// may: with `gid` < 0 anyone may; otherwise root, our own uid, and processes
// whose primary or supplementary groups (as they were at connect time,
// SO_PEERCRED and SO_PEERGROUPS) include `gid`. The reason names the peer's
// uid, gid and pid and the group, followed by `where` (e.g. the flag that
// sets the group).
std::string PeerOutsideGroup(int fd, int gid, const std::string& where);

// Connects once to the agent's gRPC unix socket at `path` (what ckptctl and
// the client library use) and says in words what to do when that cannot
// work: FailedPrecondition for ENOENT/ENOTDIR (no agent there), EPROTOTYPE
// (the session socket, not agent.sock) and ECONNREFUSED (nobody accepts),
// PermissionDenied for EACCES/EPERM (the socket's group). `how` names where
// the path is set ("--agent-socket or CKPT_AGENT_SOCKET"). OK when it
// accepts, and for errors that say nothing (EAGAIN: a full backlog).
// *may_heal, when given: the error can go away by waiting (ENOENT: an agent
// starting creates the socket; ECONNREFUSED: one restarting binds it again).
absl::Status ProbeAgentSocket(const std::string& path, const std::string& how, bool* may_heal = nullptr);

}  // namespace ckpt
