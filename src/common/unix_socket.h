// Publishing a unix socket with its final mode and group.
//
// bind() creates the socket file with the process umask and group; a chmod or
// chown afterwards leaves a window in which the file exists with the wrong
// ones (a client or a test that looks then sees it). Binding to a staging name
// in the same directory, fixing mode and group there and renaming it into
// place means the final path only ever exists as 0660 and in its group.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace ckpt {

// A short name next to `path` to bind first: "<dir>/.<first letter><pid>", so
// it fits in sun_path whenever `path` does (its file name has >= 9 bytes).
std::string StagingSocketPath(const std::string& path);

// Gives the socket file at `staged` mode 0660 and group `gid` (when >= 0) and
// renames it to `path`. On failure removes `staged` and says why (chown fails
// unless the process is root or a member of `gid`).
absl::Status PublishSocket(const std::string& staged, const std::string& path, int gid);

}  // namespace ckpt
