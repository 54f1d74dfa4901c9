// Child processes for integration and fault tests: start the real daemons
// (ckpt-meta, ckpt-agent) and tools (ckptctl) on 127.0.0.1, wait for them,
// kill them at chosen points and restart them on the same data dir.
//
//   CKPT_ASSIGN_OR_RETURN(TempDir tmp, TempDir::Create());
//   CKPT_ASSIGN_OR_RETURN(int port, PickFreePort());
//   SubprocessOptions options;
//   options.argv = {BinaryPath("ckpt-meta"), absl::StrCat("--listen=127.0.0.1:", port)};
//   options.name = "meta";
//   options.log_dir = tmp.path();                      // output -> <tmp>/meta.log
//   CKPT_ASSIGN_OR_RETURN(std::unique_ptr<Subprocess> meta, Subprocess::Start(options));
//   CKPT_RETURN_IF_ERROR(WaitForTcpPort("127.0.0.1", port, absl::Seconds(10), meta.get()));
//   CKPT_RETURN_IF_ERROR(meta->Kill());                  // kill -9
//   CKPT_RETURN_IF_ERROR(meta->Wait());
//   CKPT_ASSIGN_OR_RETURN(meta, Subprocess::Start(meta->options()));  // restart
//
// Cleanup guarantees ("no test leaves a process behind"):
//   - Every process is signalled by its PID (or its own process group), never
//     by name, and only while it is still unreaped, so the PID cannot have
//     been reused by an unrelated process.
//   - The child runs in its own process group (pgid == pid). When it is
//     reaped (Wait, WaitFor, Terminate, IsRunning, or the destructor), every
//     process still left in that group (e.g. the background jobs of a shell)
//     is sent SIGKILL first.
//   - The destructor SIGKILLs a child that is still running, with its group,
//     and reaps it.
//   - The child gets PR_SET_PDEATHSIG(SIGKILL): if the test process dies (a
//     crash, an abort, a ctest timeout), the kernel kills the child. Linux
//     ties this to the *thread* that started the child, so start daemons from
//     a thread that outlives them (the test's main thread).
//
// The child starts with stdin on /dev/null, default signal dispositions, an
// empty signal mask, and no file descriptors other than 0, 1 and 2 (every
// other descriptor of the test process is closed at exec), so a socket the
// test holds never leaks into a daemon.
//
// Waits on real processes use pidfd_open + poll (falling back to polling
// waitpid every few milliseconds if the kernel lacks pidfd): these helpers are
// for tests that run real processes, not for unit tests of ckpt code.
//
// Naming: inside namespace ckpt, `testing::` now means ckpt::testing; spell
// GoogleTest's namespace ::testing.
//
// Thread safety: Subprocess is thread-safe; e.g. one thread may block in
// Wait() while another calls Kill(). Only the destructor must not race with
// other calls. The free functions may be called from any thread.
#pragma once

#include <sys/types.h>

#include <csignal>
#include <cstddef>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ckpt::testing {

// How a child process ended, decoded from a waitpid() status.
class ExitStatus {
 public:
  explicit ExitStatus(int wait_status) : wait_status_(wait_status) {}

  // The process called exit() / returned from main(); exit_code() is the code.
  bool exited() const;
  // The exit code (0-255) if exited(), else -1.
  int exit_code() const;
  // The process was terminated by a signal; term_signal() is the signal.
  bool signaled() const;
  // The terminating signal if signaled(), else 0.
  int term_signal() const;
  // exited() with code 0.
  bool success() const { return exited() && exit_code() == 0; }
  // The raw waitpid() status, for the W* macros.
  int wait_status() const { return wait_status_; }

  // "exited with code 3", "killed by signal 9 (Killed)".
  std::string ToString() const;

 private:
  int wait_status_;
};

std::ostream& operator<<(std::ostream& os, const ExitStatus& status);

struct SubprocessOptions {
  // argv[0] is the path of the binary (absolute, or relative to working_dir
  // if that is set, else to the test's working directory); no $PATH search.
  // The rest are its arguments. Must not be empty.
  std::vector<std::string> argv;

  // Variables added to the environment the child inherits from the test
  // process, replacing inherited ones of the same name (later entries win).
  std::vector<std::pair<std::string, std::string>> env;

  // Working directory of the child; empty: the test process's.
  std::string working_dir;

  // Names the process in messages and its log file. Empty: the last component
  // of argv[0]. Must not contain '/'.
  std::string name;

  // Where the child's stdout and stderr go. Each stream goes to the first of
  //   - stdout_path / stderr_path, if non-empty;
  //   - <log_dir>/<name>.log, if log_dir is non-empty (both streams share it);
  //   - the test process's own stdout / stderr.
  // Files are created (mode 0644) if missing and appended to, never truncated:
  // a daemon restarted with the same options continues its log, so a failing
  // test can print the whole history.
  std::string log_dir;
  std::string stdout_path;
  std::string stderr_path;
};

class Subprocess {
 public:
  // Starts the child and returns once it has exec'd argv[0]. Errors (the
  // child is then gone and reaped): InvalidArgument for empty argv or a bad
  // name; failures to open the output files, fork, chdir to working_dir or
  // exec as a Status from their errno, e.g. NotFound for a missing binary or
  // working_dir, PermissionDenied for a file that is not executable.
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(SubprocessOptions options);

  // SIGKILLs the child and its process group if it has not been reaped yet,
  // and reaps it. Blocks until the kernel has delivered the kill (normally
  // microseconds).
  ~Subprocess();

  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  // The child's PID (also its process group ID). Stays valid after the child
  // is reaped, but then names no process of ours.
  pid_t pid() const { return pid_; }
  const std::string& name() const { return options_.name; }
  // The options it was started with (name filled in): Start(options()) starts
  // it again, e.g. a daemon on the same data dir after a kill -9.
  const SubprocessOptions& options() const { return options_; }

  // Sends `sig` to the child's PID only (not its group). OK if the child has
  // exited but is not reaped yet (the signal then has no effect).
  // FailedPrecondition once it has been reaped. Does not wait.
  absl::Status Kill(int sig = SIGKILL);

  // Graceful stop: SIGTERM, then up to `grace` for the child to exit, then
  // SIGKILL; returns how it ended (term_signal() == SIGKILL if it ignored
  // SIGTERM). Returns the recorded status at once if it already ended.
  // Blocks for at most `grace` plus the kill. Errors as Wait().
  absl::StatusOr<ExitStatus> Terminate(absl::Duration grace);

  // Blocks until the child exits, reaps it and returns how it ended. Repeated
  // calls return the same status. Errors: Internal if waitpid fails (e.g. some
  // other code in the test process reaped the child, or SIGCHLD is ignored).
  absl::StatusOr<ExitStatus> Wait();

  // As Wait(), but gives up after `timeout`: DeadlineExceeded if the child is
  // still running then (it keeps running).
  absl::StatusOr<ExitStatus> WaitFor(absl::Duration timeout);

  // Whether the child has not exited yet. If it has, reaps it (Wait() then
  // returns its status at once). Also false if the child cannot be waited for
  // (see Wait(); Wait() then reports the error). Does not block.
  bool IsRunning();

  // Peak resident set size of the child (getrusage's ru_maxrss), in bytes,
  // once it has been reaped; 0 before. Counts the child itself, not its own
  // children.
  uint64_t max_rss_bytes() const;

  // Path of the file the child's stdout goes to, or of stderr's if stdout is
  // not captured; empty if neither is captured.
  const std::string& log_path() const;

  // The captured output: the contents of stdout's file, followed by stderr's
  // file if that is a different one. Includes what earlier processes appended
  // to the same files (e.g. before a restart). FailedPrecondition if neither
  // stream goes to a file; read errors as a Status.
  absl::StatusOr<std::string> ReadLog() const;

  // At most the last `max_bytes` of ReadLog(), starting at a line boundary and
  // prefixed with "...\n" if cut, or a note saying why there is no log. For
  // failure messages.
  std::string LogTail(size_t max_bytes = 4096) const;

 private:
  Subprocess(SubprocessOptions options, std::string stdout_file, std::string stderr_file,
             pid_t pid, int pidfd);

  // Whether the child has exited, without reaping it.
  absl::StatusOr<bool> HasExitedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // SIGKILLs what is left of the child's process group, reaps the (exited)
  // child and records its status.
  absl::StatusOr<ExitStatus> ReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Wait() (no deadline) and WaitFor().
  absl::StatusOr<ExitStatus> WaitUntil(std::optional<absl::Time> deadline);

  const SubprocessOptions options_;
  const std::string stdout_file_;  // empty: not captured
  const std::string stderr_file_;  // empty: not captured
  const pid_t pid_;
  const int pidfd_;  // -1 if pidfd_open is unavailable; closed by the destructor
  mutable absl::Mutex mu_;
  std::optional<ExitStatus> exit_status_ ABSL_GUARDED_BY(mu_);  // set once reaped
  uint64_t max_rss_bytes_ ABSL_GUARDED_BY(mu_) = 0;            // set once reaped
};

// What RunToCompletion() saw.
struct RunResult {
  ExitStatus status;
  std::string stdout_text;
  std::string stderr_text;
  // Peak resident set size of the process, in bytes (e.g. to check that a
  // tool streams rather than holding its data).
  uint64_t max_rss_bytes = 0;
};

// Runs a short command (e.g. ckptctl) to completion and returns how it ended
// with its stdout and stderr captured separately (through temporary files,
// deleted afterwards; options' log_dir, stdout_path and stderr_path are
// ignored). A non-zero exit is not an error: check result.status. Errors:
// those of Subprocess::Start(); DeadlineExceeded if it runs longer than
// `timeout` (it is then killed with its process group, and the message ends
// with the output so far); file errors as a Status. Blocks.
absl::StatusOr<RunResult> RunToCompletion(SubprocessOptions options, absl::Duration timeout);

// "<build dir>/bin/<name>", where ckpt_cc_binary() puts the project's
// executables, e.g. BinaryPath("ckpt-agent"). Does not check that it exists.
std::string BinaryPath(const std::string& name);

// Polls connect() to host:port (a name or a numeric IPv4/IPv6 address) every
// 10 ms until a connection succeeds, then closes it. Errors: DeadlineExceeded
// after `timeout`; if `proc` is given and exits first (or has exited when
// the port answers, which means someone else holds the port), Unavailable
// with its exit status and the tail of its log; InvalidArgument if `host`
// does not resolve. Blocks.
absl::Status WaitForTcpPort(const std::string& host, int port, absl::Duration timeout,
                            Subprocess* proc = nullptr);

// A minimal blocking HTTP/1.1 GET of `path` (must start with '/') from
// host:port with "Connection: close", for /metrics, /healthz and /readyz of
// daemons. Returns the body (de-chunked if the server used chunked encoding)
// and stores the status code in *status_code if non-null. Any well-formed
// response is a success, including 404 or 503: check the code. Errors:
// Unavailable if the connection is refused or reset or the response is cut
// short; DeadlineExceeded if the whole exchange takes longer than `timeout`;
// Internal for a malformed response; ResourceExhausted beyond 64 MiB;
// InvalidArgument for a bad path or host.
absl::StatusOr<std::string> HttpGet(const std::string& host, int port, const std::string& path,
                                    int* status_code,
                                    absl::Duration timeout = absl::Seconds(10));

}  // namespace ckpt::testing
