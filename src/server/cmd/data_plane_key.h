// The cluster's data-plane key: a random 256-bit secret that ckpt-meta keeps
// in its data directory and hands to every agent that registers over TLS
// (RegisterNodeResponse.data_plane_key). Agents prove it to each other in the
// UCX data plane's handshake (src/transport/ucx/handshake.h), so only nodes
// meta admitted can connect to an agent's data port (docs/protocol.md §8b,
// "Authentication").
//
// On disk: <data-dir>/data-plane.key, 64 lower-case hex digits and a newline,
// mode 0600, owned by meta's user. It is made once, all or nothing: written
// to a temporary file created with O_EXCL | O_NOFOLLOW, synced, then linked
// to its name (link(2) never replaces an existing file, so two metas started
// on one directory at once end up with the same key). It is read back with
// O_NOFOLLOW and checked on the opened descriptor (fstat): a regular file,
// owned by this process's effective uid, no permission for group or others.
// It lives and dies with the metadata store beside it: a meta that loses its
// data directory makes a new key, and the agents, which it no longer knows,
// register again and get it.
//
// Thread safety: the functions touch only the file system; call them from
// one thread at start-up.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt::daemon {

inline constexpr char kDataPlaneKeyFile[] = "data-plane.key";
inline constexpr size_t kDataPlaneKeyBytes = 32;

// The key (kDataPlaneKeyBytes raw bytes) in the file at `path`, which is
// created with a new random key if it does not exist. Errors name the path
// and what to do: FailedPrecondition if the file is a symlink or not a
// regular file, is owned by another user, or is open to group or others
// (mode wider than 0600); DataLoss if it does not hold 64 hex digits (a
// damaged file: remove it, and restart the agents after meta so that they
// get the new key); Unavailable if it cannot be created or read (the errno
// text). Blocks on the file system.
absl::StatusOr<std::string> LoadOrCreateDataPlaneKey(const std::string& path);

}  // namespace ckpt::daemon
