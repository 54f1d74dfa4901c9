// ckptctl's long-running work, as an operator sees it: a progress line for
// save and restore (bytes, rate, ETA on stderr), and what a Ctrl-C during a
// restore leaves behind (nothing of ours: its temporary files are removed and
// it says so; stale ones of earlier, killed restores are swept at the next).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/time/time.h"

namespace ckpt::cli {

// Whether, and how, a command prints progress on stderr.
struct ProgressMode {
  bool on = false;   // print at all
  bool tty = false;  // redraw one line with '\r' (else a line per update)
};

// On when stderr is a terminal, unless --quiet or --json; `force`
// (--progress) turns it on anywhere (one line per update, for tests and logs).
ProgressMode ChooseProgressMode(bool force, bool quiet, bool json);

// A byte counter printing "LABEL: 12.0 MiB / 1.0 GiB (1%), 310.2 MiB/s, ETA
// 3s" on stderr: on a terminal redrawn at most 10 times a second; otherwise
// (forced) the first update, then at most one line a second. Finish() prints
// "LABEL: 1.0 GiB in 3.3s (310.2 MiB/s)". Does nothing when mode.on is false.
// One thread at a time.
class Progress {
 public:
  Progress(std::string label, uint64_t total_bytes, ProgressMode mode);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void AddTotal(uint64_t bytes) { total_ += bytes; }
  void Add(uint64_t bytes);
  // Takes back bytes counted for a read that failed (another source is tried).
  void Rewind(uint64_t bytes) { done_ = bytes > done_ ? 0 : done_ - bytes; }
  // A line (not bytes) about what happens now, e.g. "copying into the agent".
  void Note(std::string_view what);
  // Text appended to every later byte line (", 2/3 holders, 5 shards").
  void SetDetail(std::string detail) { detail_ = std::move(detail); }
  // A line that stays (e.g. a state change "w/1: staged -> protected after
  // 0.4s"): on a terminal it replaces the unfinished line, which the next
  // update draws again below it.
  void Line(std::string_view text);
  // Erases an unfinished line on a terminal before something goes to stdout
  // (the next update draws it again).
  void Clear();
  void Finish();

 private:
  void Print(bool final);

  const std::string label_;
  std::string detail_;
  uint64_t total_;
  const ProgressMode mode_;
  uint64_t done_ = 0;
  const absl::Time start_;
  absl::Time last_print_ = absl::InfinitePast();
  bool printed_ = false;
  bool finished_ = false;
};

// A temporary file ckptctl restore makes in its output directory, and the
// process that made it: ".rank-00000.bin.tmp-<pid>-<n>" (RankFileWriter),
// ".rank-00000.bin.ref-<step>.tmp-<pid>" (a referred version's shard, for an
// incremental one) and that file's own ". .tmp-<pid>-<n>" writer file. Any
// other name (the rank files, manifest.json, files not ours): nullopt.
std::optional<pid_t> RestoreTempFileOwner(std::string_view name);

// Removes the files in `dir` that RestoreTempFileOwner says were made by a
// process that no longer runs (never another name, never a live process's).
// Returns how many it removed (0 also when `dir` does not exist).
int SweepStaleRestoreTempFiles(const std::string& dir);

// Ctrl-C for a restore: blocks SIGINT and SIGTERM in this thread (call before
// any other thread starts: they inherit the mask) and starts a thread that
// waits for them. On one, it removes this process's temporary files in the
// output directories passed to WatchRestoreDir (RestoreTempFileOwner ==
// getpid(); a manifest.json or COMMITTED temporary while the manifest is being
// written), prints "ckptctl: CANCELLED: interrupted by SIGINT: removed N
// temporary file(s) ..." on stderr (a JSON error object with `json`) and
// exits 128 + the signal's number (130 for SIGINT, 143 for SIGTERM) at once.
void StartInterruptWatcher(bool json);
void WatchRestoreDir(const std::string& dir);
// Brackets the write of manifest.json and COMMITTED in a watched directory.
void SetWritingManifest(bool on);

// Test hook (the environment variable CKPTCTL_TEST_PAUSE_AFTER_FIRST_CHUNK
// set to 1): after the first chunk of a restore is written, says "ckptctl:
// test hook: paused after the first chunk" on stderr and waits there for a
// signal, so a test interrupts a restore mid-way deterministically.
void MaybePauseAfterFirstChunk();

// "--timeout" of `wait` and `flush --wait`: "30s", "5m", "1h30m", "500ms";
// a plain number is seconds ("90", "2.5").
std::optional<absl::Duration> ParseWaitTimeout(const std::string& text);

}  // namespace ckpt::cli
