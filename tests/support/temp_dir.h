// TempDir: a uniquely named scratch directory that a test owns and that is
// deleted with everything in it when the TempDir is destroyed.
//
//   absl::StatusOr<TempDir> tmp = TempDir::Create();
//   ASSERT_TRUE(tmp.ok()) << tmp.status();
//   absl::StatusOr<std::string> meta_dir = tmp->Sub("meta");   // <tmp>/meta
//
// The directory is made with mkdtemp() under $TMPDIR (or /tmp if unset or
// empty), named "ckpt-test-XXXXXX", mode 0700.
//
// Keeping the files of a failed run: with CKPT_KEEP_TEST_DIRS=1 in the
// environment (read when the TempDir is destroyed), nothing is deleted and
// the path is printed to stderr instead, so that logs and data dirs can be
// inspected.
//
// Thread safety: a TempDir is thread-compatible (const methods may be called
// concurrently; Sub() of distinct names may be too, since it only creates
// directories).
#pragma once

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt::testing {

class TempDir {
 public:
  // Creates a new, empty directory. Errors: the mkdtemp failure as a Status
  // (e.g. NotFound if $TMPDIR does not exist, PermissionDenied).
  static absl::StatusOr<TempDir> Create();

  // Movable (the moved-from TempDir owns nothing and deletes nothing), not
  // copyable.
  TempDir(TempDir&& other) noexcept;
  TempDir& operator=(TempDir&& other) noexcept;
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // Deletes the directory and everything below it (unless CKPT_KEEP_TEST_DIRS=1,
  // see above). Symbolic links are removed, never followed; directories a test
  // made read-only are made writable first so that they can be emptied.
  // Failures are printed to stderr (a destructor cannot return them). Blocks
  // for the deletion.
  ~TempDir();

  // Absolute path of the directory, without a trailing slash. Empty for a
  // moved-from TempDir.
  const std::string& path() const { return path_; }

  // Creates the directory <path()>/<name> (and any missing directories on the
  // way, so "agent-1/flush" works) and returns its path. Succeeds if it
  // already exists as a directory, so a test can call it again when it
  // restarts a daemon on the same data dir. Errors: InvalidArgument if `name`
  // is empty, absolute or has an empty, "." or ".." component;
  // FailedPrecondition if a component exists and is not a directory; other
  // mkdir failures as a Status.
  absl::StatusOr<std::string> Sub(const std::string& name) const;

  // Deletes the directory now, as the destructor would (including the
  // CKPT_KEEP_TEST_DIRS check), and returns what went wrong, if anything.
  // Afterwards path() is empty and the destructor does nothing.
  absl::Status Remove();

 private:
  explicit TempDir(std::string path) : path_(std::move(path)) {}

  std::string path_;
};

}  // namespace ckpt::testing
