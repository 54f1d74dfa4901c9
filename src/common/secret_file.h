// Files that hold secrets (admin, agent and trainer tokens, TLS private
// keys), and the smallest token ckpt accepts (docs/security.md "Ids and
// tokens").
//
// A secret file is opened with O_NOFOLLOW | O_CLOEXEC and checked on the
// opened descriptor (fstat), never by path: what is checked is what is read,
// even if someone swaps the file in between. It must be a regular file (not
// a symlink, a fifo or a device), owned by the reading process's effective
// uid or by root, and its mode no wider than 0640 (owner read/write, group
// read). A Kubernetes Secret volume's entries are symlinks into "..data/":
// name "DIR/..data/NAME" (the last component is then the file itself), or
// mount the key with subPath, with defaultMode 0440 or 0400.
//
// Thread safety: the functions are pure (they read the file system).
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt {

// The fewest characters a token may have: base64 of 16 bytes (128 bits).
inline constexpr size_t kMinTokenChars = 22;
// How to make a good one, for error messages.
inline constexpr char kMakeTokenHint[] = "make one with `head -c 32 /dev/urandom | base64`";

// The whole text of secret file `path`; `what` names it in errors ("token
// file", "trainer tokens file"). InvalidArgument naming the path and what is
// wrong: cannot be opened (missing, unreadable, or a symlink), not a regular
// file, owned by another user than this process's euid and root (the message
// names both uids), mode wider than 0640 ("readable by every user" when
// others may read it; the message gives the chmod), larger than 1 MiB.
//
// `follow_symlink`: a symbolic link is followed and the file it names is
// checked (private keys, which Kubernetes mounts as links into "..data/"
// and tools such as cert-manager replace by swapping the link); tokens keep
// refusing links.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path, const std::string& what,
                                           bool follow_symlink = false);

// OK if `token` has at least kMinTokenChars characters; otherwise
// InvalidArgument "<where> holds a token of N characters; at least 22 (128
// bits) are needed: make one with ...". The token itself is never in the
// message.
absl::Status CheckTokenStrength(const std::string& token, const std::string& where);

}  // namespace ckpt
