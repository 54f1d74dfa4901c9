// Tests of the test-support library: child processes (/bin/sh -c scripts),
// free ports, TCP/HTTP probes against sockets the test opens, and TempDir.
//
// No sleeps: a test that needs a child to reach a point (a trap installed, a
// background job started) has the child write a line to a FIFO and blocks on
// reading it. Every child is owned by a Subprocess that kills and reaps it.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>

#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "common/file_system.h"
#include "support/ports.h"
#include "support/process.h"
#include "support/temp_dir.h"

namespace ckpt::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

::testing::AssertionResult IsOk(const absl::Status& status) {
  if (status.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << status;
}
template <typename T>
::testing::AssertionResult IsOk(const absl::StatusOr<T>& result) {
  return IsOk(result.status());
}

// Generous bound for things that happen at once unless something is broken;
// never reached by a passing test.
constexpr absl::Duration kLong = absl::Seconds(30);

SubprocessOptions Shell(const std::string& script) {
  SubprocessOptions options;
  options.argv = {"/bin/sh", "-c", script};
  return options;
}

bool PathExists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

bool ProcessGone(pid_t pid) { return ::kill(pid, 0) == -1 && errno == ESRCH; }

// Sets (or, with nullopt, unsets) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value.has_value()) {
      ::setenv(name, value->c_str(), 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_.has_value()) {
      ::setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// The read end of a FIFO a child writes one line to. Opened (non-blocking)
// before the child starts, so the child's open for writing never blocks.
class Fifo {
 public:
  static absl::StatusOr<std::unique_ptr<Fifo>> Create(const std::string& path) {
    if (::mkfifo(path.c_str(), 0600) != 0) return PosixErrorToStatus(errno, "mkfifo", path);
    const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return PosixErrorToStatus(errno, "open", path);
    return std::unique_ptr<Fifo>(new Fifo(path, fd));
  }
  ~Fifo() { ::close(fd_); }

  const std::string& path() const { return path_; }

  // Blocks until a whole line has arrived (returned without the newline).
  // Linux reports no hang-up on a FIFO no writer has opened yet, so poll()
  // waits for the child.
  absl::StatusOr<std::string> ReadLine() {
    std::string line;
    while (line.find('\n') == std::string::npos) {
      pollfd pfd{fd_, POLLIN, 0};
      const int rc = ::poll(&pfd, 1, static_cast<int>(absl::ToInt64Milliseconds(kLong)));
      if (rc == 0) return absl::DeadlineExceededError("nothing written to " + path_);
      if (rc < 0) return PosixErrorToStatus(errno, "poll", path_);
      char buf[256];
      const ssize_t n = ::read(fd_, buf, sizeof(buf));
      if (n < 0 && errno == EAGAIN) continue;
      if (n < 0) return PosixErrorToStatus(errno, "read", path_);
      if (n == 0) return absl::UnavailableError("writer closed " + path_ + " after '" + line + "'");
      line.append(buf, static_cast<size_t>(n));
    }
    return line.substr(0, line.find('\n'));
  }

 private:
  Fifo(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_;
};

// Blocks until the process behind `pidfd` (not necessarily our child) has
// exited; fails after kLong.
::testing::AssertionResult ExitsSoon(int pidfd) {
  pollfd pfd{pidfd, POLLIN, 0};
  const int rc = ::poll(&pfd, 1, static_cast<int>(absl::ToInt64Milliseconds(kLong)));
  if (rc == 1) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "process still running (poll returned " << rc << ")";
}

int PidfdOpen(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

// ---------------------------------------------------------------------------
// ExitStatus, BinaryPath

TEST(ExitStatus, DecodesExitCodesAndSignals) {
  const ExitStatus exited(3 << 8);
  EXPECT_TRUE(exited.exited());
  EXPECT_EQ(exited.exit_code(), 3);
  EXPECT_FALSE(exited.signaled());
  EXPECT_EQ(exited.term_signal(), 0);
  EXPECT_FALSE(exited.success());
  EXPECT_EQ(exited.ToString(), "exited with code 3");

  const ExitStatus killed(SIGKILL);
  EXPECT_FALSE(killed.exited());
  EXPECT_EQ(killed.exit_code(), -1);
  EXPECT_TRUE(killed.signaled());
  EXPECT_EQ(killed.term_signal(), SIGKILL);
  EXPECT_THAT(killed.ToString(), StartsWith("killed by signal 9"));

  EXPECT_TRUE(ExitStatus(0).success());
}

TEST(BinaryPath, PointsIntoTheBuildTree) {
  EXPECT_EQ(BinaryPath("ckptctl"), std::string(CKPT_BINARY_DIR) + "/bin/ckptctl");
}

// ---------------------------------------------------------------------------
// Subprocess

TEST(Subprocess, ReportsExitCode) {
  absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(Shell("exit 7"));
  ASSERT_TRUE(IsOk(proc));
  EXPECT_GT((*proc)->pid(), 0);
  EXPECT_EQ((*proc)->name(), "sh");
  absl::StatusOr<ExitStatus> status = (*proc)->Wait();
  ASSERT_TRUE(IsOk(status));
  EXPECT_TRUE(status->exited());
  EXPECT_EQ(status->exit_code(), 7);
  // Reaped: the status is remembered, the process is gone.
  EXPECT_FALSE((*proc)->IsRunning());
  absl::StatusOr<ExitStatus> again = (*proc)->WaitFor(absl::ZeroDuration());
  ASSERT_TRUE(IsOk(again));
  EXPECT_EQ(again->exit_code(), 7);
  EXPECT_TRUE(ProcessGone((*proc)->pid()));
}

TEST(Subprocess, KillSendsSigkillToThePid) {
  absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(Shell("exec sleep 100"));
  ASSERT_TRUE(IsOk(proc));
  EXPECT_TRUE((*proc)->IsRunning());
  ASSERT_TRUE(IsOk((*proc)->Kill()));
  absl::StatusOr<ExitStatus> status = (*proc)->Wait();
  ASSERT_TRUE(IsOk(status));
  EXPECT_TRUE(WIFSIGNALED(status->wait_status()));
  EXPECT_EQ(WTERMSIG(status->wait_status()), SIGKILL);
  EXPECT_EQ(status->term_signal(), SIGKILL);
  EXPECT_FALSE((*proc)->IsRunning());
  // Once reaped, the PID is no longer ours to signal.
  EXPECT_TRUE(absl::IsFailedPrecondition((*proc)->Kill()));
}

TEST(Subprocess, KillSendsTheGivenSignal) {
  absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(Shell("exec sleep 100"));
  ASSERT_TRUE(IsOk(proc));
  ASSERT_TRUE(IsOk((*proc)->Kill(SIGTERM)));
  absl::StatusOr<ExitStatus> status = (*proc)->Wait();
  ASSERT_TRUE(IsOk(status));
  EXPECT_EQ(status->term_signal(), SIGTERM);
}

TEST(Subprocess, WaitInOneThreadKillFromAnother) {
  absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(Shell("exec sleep 100"));
  ASSERT_TRUE(IsOk(proc));
  Subprocess* p = proc->get();
  absl::StatusOr<ExitStatus> waited = absl::UnknownError("not waited");
  std::thread waiter([p, &waited] { waited = p->Wait(); });
  EXPECT_TRUE(IsOk(p->Kill()));
  waiter.join();
  ASSERT_TRUE(IsOk(waited));
  EXPECT_EQ(waited->term_signal(), SIGKILL);
}

TEST(Subprocess, TerminateReturnsTheExitStatusOfAGracefulStop) {
  absl::StatusOr<TempDir> tmp = TempDir::Create();
  ASSERT_TRUE(IsOk(tmp));
  absl::StatusOr<std::unique_ptr<Fifo>> ready = Fifo::Create(tmp->path() + "/ready");
  ASSERT_TRUE(IsOk(ready));
  // The background sleep stays in the shell's process group; reaping the
  // shell must take it down too.
  absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(
      Shell("trap 'exit 3' TERM; sleep 100 & echo $! > " + (*ready)->path() + "; wait"));
  ASSERT_TRUE(IsOk(proc));
  absl::StatusOr<std::string> line = (*ready)->ReadLine();  // the trap is installed now
  ASSERT_TRUE(IsOk(line));
  int background_pid = 0;
  ASSERT_TRUE(absl::SimpleAtoi(*line, &background_pid)) << *line;
  const int background = PidfdOpen(background_pid);
  ASSERT_GE(background, 0) << std::strerror(errno);

  absl::StatusOr<ExitStatus> status = (*proc)->Terminate(kLong);
  ASSERT_TRUE(IsOk(status));
  EXPECT_TRUE(status->exited()) << *status;
  EXPECT_EQ(status->exit_code(), 3);
  EXPECT_TRUE(ExitsSoon(background));
  ::close(background);
  // Terminating again just reports the same end.
  absl::StatusOr<ExitStatus> again = (*proc)->Terminate(kLong);
  ASSERT_TRUE(IsOk(again));
  EXPECT_EQ(again->exit_code(), 3);
}

TEST(Subprocess, TerminateEscalatesToSigkillAfterTheGracePeriod) {
  absl::StatusOr<TempDir> tmp = TempDir::Create();
  ASSERT_TRUE(IsOk(tmp));
  absl::StatusOr<std::unique_ptr<Fifo>> ready = Fifo::Create(tmp->path() + "/ready");
  ASSERT_TRUE(IsOk(ready));
  // An ignored signal stays ignored across exec: sleep ignores SIGTERM.
  absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(
      Shell("trap '' TERM; echo ready > " + (*ready)->path() + "; exec sleep 100"));
  ASSERT_TRUE(IsOk(proc));
  ASSERT_TRUE(IsOk((*ready)->ReadLine()));
  absl::StatusOr<ExitStatus> status = (*proc)->Terminate(absl::Milliseconds(50));
  ASSERT_TRUE(IsOk(status));
  EXPECT_EQ(status->term_signal(), SIGKILL) << *status;
}

TEST(Subprocess, WaitForTimesOutAndTheDestructorKillsTheChild) {
  absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(Shell("exec sleep 100"));
  ASSERT_TRUE(IsOk(proc));
  const pid_t pid = (*proc)->pid();
  absl::StatusOr<ExitStatus> status = (*proc)->WaitFor(absl::Milliseconds(20));
  EXPECT_TRUE(absl::IsDeadlineExceeded(status.status())) << status.status();
  EXPECT_TRUE((*proc)->IsRunning());
  EXPECT_EQ(::kill(pid, 0), 0);
  proc->reset();
  EXPECT_TRUE(ProcessGone(pid));
}

TEST(Subprocess, DestructorKillsTheWholeProcessGroup) {
  absl::StatusOr<TempDir> tmp = TempDir::Create();
  ASSERT_TRUE(IsOk(tmp));
  absl::StatusOr<std::unique_ptr<Fifo>> ready = Fifo::Create(tmp->path() + "/ready");
  ASSERT_TRUE(IsOk(ready));
  absl::StatusOr<std::unique_ptr<Subprocess>> proc =
      Subprocess::Start(Shell("sleep 100 & echo $! > " + (*ready)->path() + "; wait"));
  ASSERT_TRUE(IsOk(proc));
  absl::StatusOr<std::string> line = (*ready)->ReadLine();
  ASSERT_TRUE(IsOk(line));
  int background_pid = 0;
  ASSERT_TRUE(absl::SimpleAtoi(*line, &background_pid)) << *line;
  const int background = PidfdOpen(background_pid);
  ASSERT_GE(background, 0) << std::strerror(errno);
  const pid_t pid = (*proc)->pid();
  proc->reset();
  EXPECT_TRUE(ProcessGone(pid));
  EXPECT_TRUE(ExitsSoon(background));
  ::close(background);
}

TEST(Subprocess, ChildDiesWithTheTestProcess) {
  // An intermediate process plays the test: it starts a child, reports the
  // child's PID, waits for the go-ahead (EOF on `go`) and dies without any
  // cleanup.
  int report[2], go[2];
  ASSERT_EQ(::pipe2(report, O_CLOEXEC), 0);
  ASSERT_EQ(::pipe2(go, O_CLOEXEC), 0);
  const pid_t intermediate = ::fork();
  ASSERT_GE(intermediate, 0);
  if (intermediate == 0) {
    ::close(report[0]);
    ::close(go[1]);
    absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(Shell("exec sleep 100"));
    const pid_t child = proc.ok() ? (*proc)->pid() : -1;
    if (::write(report[1], &child, sizeof(child)) != sizeof(child)) ::_exit(1);
    char c;
    if (::read(go[0], &c, 1) < 0) ::_exit(1);
    ::_exit(0);  // no destructors: only PR_SET_PDEATHSIG can clean up
  }
  ::close(report[1]);
  ::close(go[0]);
  // Whatever happens below, let the intermediate go and reap it.
  struct Reaper {
    int go_fd;
    pid_t pid;
    int wait_status = -1;
    void Reap() {
      if (go_fd < 0) return;
      ::close(std::exchange(go_fd, -1));
      while (::waitpid(pid, &wait_status, 0) < 0 && errno == EINTR) {
      }
    }
    ~Reaper() { Reap(); }
  } reaper{go[1], intermediate};

  pid_t child = -1;
  ASSERT_EQ(::read(report[0], &child, sizeof(child)), static_cast<ssize_t>(sizeof(child)));
  ::close(report[0]);
  ASSERT_GT(child, 0);
  const int child_fd = PidfdOpen(child);  // alive: the intermediate has not died yet
  ASSERT_GE(child_fd, 0) << std::strerror(errno);
  reaper.Reap();
  EXPECT_TRUE(WIFEXITED(reaper.wait_status) && WEXITSTATUS(reaper.wait_status) == 0);
  EXPECT_TRUE(ExitsSoon(child_fd));
  ::close(child_fd);
}

TEST(Subprocess, PassesExtraEnvironmentOnTopOfTheInheritedOne) {
  ScopedEnv inherited("CKPT_SUPPORT_INHERITED", "yes");
  ScopedEnv overridden("CKPT_SUPPORT_OVERRIDE", "parent");
  SubprocessOptions options = Shell(
      "printf '%s|%s|%s|%s' \"$CKPT_SUPPORT_A\" \"$CKPT_SUPPORT_B\" "
      "\"$CKPT_SUPPORT_INHERITED\" \"$CKPT_SUPPORT_OVERRIDE\"");
  options.env = {{"CKPT_SUPPORT_A", "alpha"},
                 {"CKPT_SUPPORT_B", "one"},
                 {"CKPT_SUPPORT_OVERRIDE", "child"},
                 {"CKPT_SUPPORT_B", "two"}};
  absl::StatusOr<RunResult> result = RunToCompletion(options, kLong);
  ASSERT_TRUE(IsOk(result));
  EXPECT_TRUE(result->status.success()) << result->status << ": " << result->stderr_text;
  EXPECT_EQ(result->stdout_text, "alpha|two|yes|child");
}

TEST(Subprocess, CapturesOutputInTheLogFileAcrossRestarts) {
  absl::StatusOr<TempDir> tmp = TempDir::Create();
  ASSERT_TRUE(IsOk(tmp));
  SubprocessOptions options = Shell("echo out-1; echo err-1 >&2");
  options.name = "echoer";
  options.log_dir = tmp->path();
  absl::StatusOr<std::unique_ptr<Subprocess>> first = Subprocess::Start(options);
  ASSERT_TRUE(IsOk(first));
  ASSERT_TRUE(IsOk((*first)->Wait()));
  EXPECT_EQ((*first)->log_path(), tmp->path() + "/echoer.log");
  absl::StatusOr<std::string> log = (*first)->ReadLog();
  ASSERT_TRUE(IsOk(log));
  EXPECT_EQ(*log, "out-1\nerr-1\n");

  // A restart with the same options appends to the same log.
  SubprocessOptions restart = (*first)->options();
  restart.argv = {"/bin/sh", "-c", "echo out-2"};
  absl::StatusOr<std::unique_ptr<Subprocess>> second = Subprocess::Start(restart);
  ASSERT_TRUE(IsOk(second));
  ASSERT_TRUE(IsOk((*second)->Wait()));
  log = (*second)->ReadLog();
  ASSERT_TRUE(IsOk(log));
  EXPECT_EQ(*log, "out-1\nerr-1\nout-2\n");
  EXPECT_EQ((*second)->LogTail(7), "...\nout-2\n");
}

TEST(Subprocess, ReadLogWithoutCaptureIsFailedPrecondition) {
  absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(Shell("exit 0"));
  ASSERT_TRUE(IsOk(proc));
  ASSERT_TRUE(IsOk((*proc)->Wait()));
  EXPECT_EQ((*proc)->log_path(), "");
  EXPECT_TRUE(absl::IsFailedPrecondition((*proc)->ReadLog().status()));
}

TEST(Subprocess, StartsInTheWorkingDirWithOnlyStdioOpen) {
  absl::StatusOr<TempDir> tmp = TempDir::Create();
  ASSERT_TRUE(IsOk(tmp));
  absl::StatusOr<std::string> work = tmp->Sub("work");
  ASSERT_TRUE(IsOk(work));
  // A descriptor the test leaked (no O_CLOEXEC) must not reach the child.
  const int leaked = ::open("/dev/null", O_RDONLY);
  ASSERT_GE(leaked, 3);
  SubprocessOptions options =
      Shell(absl::StrCat("pwd -P; readlink /proc/$$/fd/0; "
                         "if [ -e /proc/$$/fd/", leaked, " ]; then echo leaked; else echo closed; fi"));
  options.working_dir = *work;
  absl::StatusOr<RunResult> result = RunToCompletion(options, kLong);
  ::close(leaked);
  ASSERT_TRUE(IsOk(result));
  char* real = ::realpath(work->c_str(), nullptr);
  ASSERT_NE(real, nullptr);
  EXPECT_EQ(result->stdout_text, absl::StrCat(real, "\n/dev/null\nclosed\n"));
  std::free(real);
}

TEST(Subprocess, StartReportsWhyTheChildCouldNotStart) {
  absl::StatusOr<TempDir> tmp = TempDir::Create();
  ASSERT_TRUE(IsOk(tmp));

  SubprocessOptions missing;
  missing.argv = {tmp->path() + "/no-such-binary"};
  absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(missing);
  EXPECT_TRUE(absl::IsNotFound(proc.status())) << proc.status();
  EXPECT_THAT(proc.status().message(), HasSubstr("no-such-binary"));

  const std::string not_executable = tmp->path() + "/data.txt";
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(PosixFileSystem(), not_executable, "x")));
  SubprocessOptions denied;
  denied.argv = {not_executable};
  proc = Subprocess::Start(denied);
  EXPECT_TRUE(absl::IsPermissionDenied(proc.status())) << proc.status();

  SubprocessOptions bad_dir = Shell("exit 0");
  bad_dir.working_dir = tmp->path() + "/no-such-dir";
  proc = Subprocess::Start(bad_dir);
  EXPECT_TRUE(absl::IsNotFound(proc.status())) << proc.status();
  EXPECT_THAT(proc.status().message(), HasSubstr("chdir"));

  SubprocessOptions bad_log = Shell("exit 0");
  bad_log.log_dir = tmp->path() + "/no-such-dir";
  proc = Subprocess::Start(bad_log);
  EXPECT_TRUE(absl::IsNotFound(proc.status())) << proc.status();

  EXPECT_TRUE(absl::IsInvalidArgument(Subprocess::Start(SubprocessOptions()).status()));
  SubprocessOptions bad_name = Shell("exit 0");
  bad_name.name = "a/b";
  EXPECT_TRUE(absl::IsInvalidArgument(Subprocess::Start(bad_name).status()));
}

TEST(RunToCompletion, CapturesStdoutAndStderrSeparately) {
  absl::StatusOr<RunResult> result =
      RunToCompletion(Shell("echo to-out; echo to-err >&2; echo more-out; exit 4"), kLong);
  ASSERT_TRUE(IsOk(result));
  EXPECT_EQ(result->status.exit_code(), 4);
  EXPECT_EQ(result->stdout_text, "to-out\nmore-out\n");
  EXPECT_EQ(result->stderr_text, "to-err\n");
}

TEST(RunToCompletion, ReportsThePeakResidentSetSize) {
  // dd reads into one buffer of bs bytes: 64 MiB resident at its peak.
  absl::StatusOr<RunResult> big = RunToCompletion(
      Shell("exec dd if=/dev/zero of=/dev/null bs=64M count=1 status=none"), kLong);
  ASSERT_TRUE(IsOk(big));
  ASSERT_TRUE(big->status.success()) << big->stderr_text;
  EXPECT_GE(big->max_rss_bytes, uint64_t{64} << 20);
  absl::StatusOr<RunResult> small = RunToCompletion(Shell("exec true"), kLong);
  ASSERT_TRUE(IsOk(small));
  EXPECT_GT(small->max_rss_bytes, 0u);
  EXPECT_LT(small->max_rss_bytes, uint64_t{16} << 20);
}

TEST(RunToCompletion, KillsACommandThatRunsTooLong) {
  absl::StatusOr<RunResult> result =
      RunToCompletion(Shell("exec sleep 100"), absl::Milliseconds(50));
  EXPECT_TRUE(absl::IsDeadlineExceeded(result.status())) << result.status();
  EXPECT_THAT(result.status().message(), HasSubstr("did not finish"));
}

// ---------------------------------------------------------------------------
// Ports

// Binds a listening socket to 127.0.0.1:port (0: any); returns the fd or -1.
int Listen(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 8) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

int LocalPort(int fd) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return -1;
  return ntohs(addr.sin_port);
}

TEST(PickFreePorts, GivesDistinctBindablePortsNeverTwice) {
  // Below the ephemeral range, where no outgoing connection can take them.
  int ephemeral_start = 0, ephemeral_end = 0;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_start >> ephemeral_end;
  absl::StatusOr<std::vector<int>> first = PickFreePorts(16);
  ASSERT_TRUE(IsOk(first));
  ASSERT_EQ(first->size(), 16u);
  std::set<int> seen;
  for (int port : *first) {
    EXPECT_GE(port, 10000);
    if (ephemeral_start > 11000) {
      EXPECT_LT(port, ephemeral_start);
    }
    EXPECT_TRUE(seen.insert(port).second) << "port " << port << " handed out twice";
    const int fd = Listen(port);
    EXPECT_GE(fd, 0) << "port " << port << ": " << std::strerror(errno);
    if (fd >= 0) ::close(fd);
  }
  absl::StatusOr<std::vector<int>> second = PickFreePorts(16);
  ASSERT_TRUE(IsOk(second));
  for (int port : *second) EXPECT_TRUE(seen.insert(port).second) << "port " << port;
  absl::StatusOr<int> one = PickFreePort();
  ASSERT_TRUE(IsOk(one));
  EXPECT_TRUE(seen.insert(*one).second) << "port " << *one;

  absl::StatusOr<std::vector<int>> none = PickFreePorts(0);
  ASSERT_TRUE(IsOk(none));
  EXPECT_TRUE(none->empty());
  EXPECT_TRUE(absl::IsInvalidArgument(PickFreePorts(-1).status()));
}

// ---------------------------------------------------------------------------
// WaitForTcpPort

TEST(WaitForTcpPort, SucceedsOnceSomethingListens) {
  const int listener = Listen(0);
  ASSERT_GE(listener, 0);
  const int port = LocalPort(listener);
  absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(Shell("exec sleep 100"));
  ASSERT_TRUE(IsOk(proc));
  EXPECT_TRUE(IsOk(WaitForTcpPort("127.0.0.1", port, kLong)));
  EXPECT_TRUE(IsOk(WaitForTcpPort("localhost", port, kLong, proc->get())));
  ::close(listener);
}

TEST(WaitForTcpPort, FailsWithTheLogTailWhenTheProcessExitsFirst) {
  absl::StatusOr<TempDir> tmp = TempDir::Create();
  ASSERT_TRUE(IsOk(tmp));
  absl::StatusOr<int> port = PickFreePort();  // nothing listens on it
  ASSERT_TRUE(IsOk(port));
  SubprocessOptions options = Shell("echo 'fatal: cannot bind the port' >&2; exit 2");
  options.name = "daemon";
  options.log_dir = tmp->path();
  absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(options);
  ASSERT_TRUE(IsOk(proc));
  const absl::Status status = WaitForTcpPort("127.0.0.1", *port, kLong, proc->get());
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("daemon"));
  EXPECT_THAT(status.message(), HasSubstr("exited with code 2"));
  EXPECT_THAT(status.message(), HasSubstr("fatal: cannot bind the port"));
}

TEST(WaitForTcpPort, TimesOutWhenNothingListens) {
  absl::StatusOr<int> port = PickFreePort();
  ASSERT_TRUE(IsOk(port));
  const absl::Status status = WaitForTcpPort("127.0.0.1", *port, absl::Milliseconds(30));
  EXPECT_TRUE(absl::IsDeadlineExceeded(status)) << status;
  EXPECT_TRUE(absl::IsInvalidArgument(WaitForTcpPort("127.0.0.1", 0, kLong)));
}

// ---------------------------------------------------------------------------
// HttpGet

// Accepts one connection on 127.0.0.1, reads the request head, sends
// `response` (nothing if empty: then it waits for the client to hang up) and
// closes.
class OneShotHttpServer {
 public:
  explicit OneShotHttpServer(std::string response) : response_(std::move(response)) {
    listener_ = Listen(0);
    port_ = listener_ >= 0 ? LocalPort(listener_) : -1;
    if (listener_ >= 0) thread_ = std::thread([this] { Serve(); });
  }
  ~OneShotHttpServer() {
    if (thread_.joinable()) thread_.join();
    if (listener_ >= 0) ::close(listener_);
  }

  int port() const { return port_; }
  // The request as received; call after the client is done.
  const std::string& request() {
    if (thread_.joinable()) thread_.join();
    return request_;
  }

 private:
  void Serve() {
    const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    char buf[4096];
    while (request_.find("\r\n\r\n") == std::string::npos) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) break;
      request_.append(buf, static_cast<size_t>(n));
    }
    if (response_.empty()) {
      while (::recv(fd, buf, sizeof(buf), 0) > 0) {
      }
    } else {
      size_t sent = 0;
      while (sent < response_.size()) {
        const ssize_t n =
            ::send(fd, response_.data() + sent, response_.size() - sent, MSG_NOSIGNAL);
        if (n <= 0) break;
        sent += static_cast<size_t>(n);
      }
    }
    ::close(fd);
  }

  std::string response_;
  int listener_ = -1;
  int port_ = -1;
  std::string request_;
  std::thread thread_;
};

TEST(HttpGet, ReturnsTheBodyAndStatusCode) {
  OneShotHttpServer server(
      "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello");
  ASSERT_GT(server.port(), 0);
  int code = 0;
  absl::StatusOr<std::string> body = HttpGet("127.0.0.1", server.port(), "/metrics", &code);
  ASSERT_TRUE(IsOk(body));
  EXPECT_EQ(code, 200);
  EXPECT_EQ(*body, "hello");
  EXPECT_THAT(server.request(), StartsWith("GET /metrics HTTP/1.1\r\n"));
  EXPECT_THAT(server.request(), HasSubstr(absl::StrCat("Host: 127.0.0.1:", server.port())));
  EXPECT_THAT(server.request(), HasSubstr("Connection: close\r\n"));
}

TEST(HttpGet, DecodesChunkedBodies) {
  OneShotHttpServer server(
      "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
      "5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n");
  ASSERT_GT(server.port(), 0);
  int code = 0;
  absl::StatusOr<std::string> body = HttpGet("127.0.0.1", server.port(), "/healthz", &code);
  ASSERT_TRUE(IsOk(body));
  EXPECT_EQ(code, 200);
  EXPECT_EQ(*body, "hello, world");
}

TEST(HttpGet, ErrorStatusCodesAreNotErrors) {
  OneShotHttpServer server("HTTP/1.0 503 Service Unavailable\r\n\r\nnot ready\n");
  ASSERT_GT(server.port(), 0);
  int code = 0;
  absl::StatusOr<std::string> body = HttpGet("127.0.0.1", server.port(), "/readyz", &code);
  ASSERT_TRUE(IsOk(body));
  EXPECT_EQ(code, 503);
  EXPECT_EQ(*body, "not ready\n");
}

TEST(HttpGet, TruncatedResponseIsUnavailable) {
  OneShotHttpServer server("HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort");
  ASSERT_GT(server.port(), 0);
  absl::StatusOr<std::string> body = HttpGet("127.0.0.1", server.port(), "/metrics", nullptr);
  EXPECT_TRUE(absl::IsUnavailable(body.status())) << body.status();
}

TEST(HttpGet, SilentServerIsDeadlineExceeded) {
  OneShotHttpServer server("");  // reads the request, never answers
  ASSERT_GT(server.port(), 0);
  absl::StatusOr<std::string> body =
      HttpGet("127.0.0.1", server.port(), "/metrics", nullptr, absl::Milliseconds(50));
  EXPECT_TRUE(absl::IsDeadlineExceeded(body.status())) << body.status();
}

TEST(HttpGet, RefusedConnectionIsUnavailable) {
  absl::StatusOr<int> port = PickFreePort();
  ASSERT_TRUE(IsOk(port));
  absl::StatusOr<std::string> body = HttpGet("127.0.0.1", *port, "/metrics", nullptr);
  EXPECT_TRUE(absl::IsUnavailable(body.status())) << body.status();
  EXPECT_TRUE(absl::IsInvalidArgument(HttpGet("127.0.0.1", *port, "metrics", nullptr).status()));
}

// ---------------------------------------------------------------------------
// TempDir

TEST(TempDir, CreatesAUniqueDirectory) {
  absl::StatusOr<TempDir> a = TempDir::Create();
  absl::StatusOr<TempDir> b = TempDir::Create();
  ASSERT_TRUE(IsOk(a));
  ASSERT_TRUE(IsOk(b));
  EXPECT_NE(a->path(), b->path());
  EXPECT_THAT(a->path(), StartsWith("/"));
  EXPECT_THAT(a->path(), HasSubstr("/ckpt-test-"));
  struct stat st;
  ASSERT_EQ(::stat(a->path().c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0700u);
}

TEST(TempDir, HonoursTmpdir) {
  absl::StatusOr<TempDir> outer = TempDir::Create();
  ASSERT_TRUE(IsOk(outer));
  ScopedEnv tmpdir("TMPDIR", outer->path() + "/");
  absl::StatusOr<TempDir> inner = TempDir::Create();
  ASSERT_TRUE(IsOk(inner));
  EXPECT_THAT(inner->path(), StartsWith(outer->path() + "/ckpt-test-"));
}

TEST(TempDir, SubCreatesDirectoriesInside) {
  absl::StatusOr<TempDir> tmp = TempDir::Create();
  ASSERT_TRUE(IsOk(tmp));
  absl::StatusOr<std::string> meta = tmp->Sub("meta");
  ASSERT_TRUE(IsOk(meta));
  EXPECT_EQ(*meta, tmp->path() + "/meta");
  EXPECT_TRUE(PathExists(*meta));
  // Again (a restart on the same data dir): same path, still OK.
  absl::StatusOr<std::string> again = tmp->Sub("meta");
  ASSERT_TRUE(IsOk(again));
  EXPECT_EQ(*again, *meta);
  absl::StatusOr<std::string> nested = tmp->Sub("agent-1/flush/job");
  ASSERT_TRUE(IsOk(nested));
  EXPECT_EQ(*nested, tmp->path() + "/agent-1/flush/job");
  EXPECT_TRUE(PathExists(*nested));

  for (const char* bad : {"", "/abs", "..", "../x", "a/../b", "a//b", ".", "a/"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(tmp->Sub(bad).status())) << "'" << bad << "'";
  }
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(PosixFileSystem(), tmp->path() + "/file", "x")));
  EXPECT_TRUE(absl::IsFailedPrecondition(tmp->Sub("file").status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(tmp->Sub("file/below").status()));
}

TEST(TempDir, RemovesEverythingButFollowsNoLinks) {
  ScopedEnv keep("CKPT_KEEP_TEST_DIRS", std::nullopt);
  absl::StatusOr<TempDir> outside = TempDir::Create();
  ASSERT_TRUE(IsOk(outside));
  const std::string precious = outside->path() + "/precious";
  ASSERT_TRUE(IsOk(WriteStringToFileAtomically(PosixFileSystem(), precious, "keep me")));

  std::string path;
  {
    absl::StatusOr<TempDir> tmp = TempDir::Create();
    ASSERT_TRUE(IsOk(tmp));
    path = tmp->path();
    absl::StatusOr<std::string> deep = tmp->Sub("a/b/c");
    ASSERT_TRUE(IsOk(deep));
    ASSERT_TRUE(IsOk(WriteStringToFileAtomically(PosixFileSystem(), *deep + "/f", "data")));
    absl::StatusOr<std::string> locked = tmp->Sub("locked");
    ASSERT_TRUE(IsOk(locked));
    ASSERT_TRUE(IsOk(WriteStringToFileAtomically(PosixFileSystem(), *locked + "/f", "data")));
    ASSERT_EQ(::chmod(locked->c_str(), 0500), 0);  // as a fault test might leave it
    ASSERT_EQ(::symlink(outside->path().c_str(), (path + "/link-to-dir").c_str()), 0);
    ASSERT_EQ(::symlink(precious.c_str(), (path + "/link-to-file").c_str()), 0);
  }
  EXPECT_FALSE(PathExists(path));
  EXPECT_TRUE(PathExists(precious));
}

TEST(TempDir, RemoveDeletesNowAndOnlyOnce) {
  ScopedEnv keep("CKPT_KEEP_TEST_DIRS", std::nullopt);
  absl::StatusOr<TempDir> tmp = TempDir::Create();
  ASSERT_TRUE(IsOk(tmp));
  const std::string path = tmp->path();
  EXPECT_TRUE(IsOk(tmp->Remove()));
  EXPECT_FALSE(PathExists(path));
  EXPECT_EQ(tmp->path(), "");
  EXPECT_TRUE(IsOk(tmp->Remove()));
  EXPECT_TRUE(absl::IsFailedPrecondition(tmp->Sub("x").status()));
}

TEST(TempDir, MovedFromDeletesNothing) {
  ScopedEnv keep("CKPT_KEEP_TEST_DIRS", std::nullopt);
  absl::StatusOr<TempDir> tmp = TempDir::Create();
  ASSERT_TRUE(IsOk(tmp));
  const std::string path = tmp->path();
  {
    TempDir owner = std::move(*tmp);
    EXPECT_EQ(owner.path(), path);
    EXPECT_EQ(tmp->path(), "");
    tmp = TempDir::Create();  // move-assign over the moved-from one
    ASSERT_TRUE(IsOk(tmp));
    EXPECT_TRUE(PathExists(path));
  }
  EXPECT_FALSE(PathExists(path));
  EXPECT_TRUE(PathExists(tmp->path()));
}

TEST(TempDir, KeepsTheDirectoryWhenAskedTo) {
  std::string path;
  {
    ScopedEnv keep("CKPT_KEEP_TEST_DIRS", "1");
    absl::StatusOr<TempDir> tmp = TempDir::Create();
    ASSERT_TRUE(IsOk(tmp));
    path = tmp->path();
    ASSERT_TRUE(IsOk(tmp->Sub("inside")));
  }
  EXPECT_TRUE(PathExists(path + "/inside"));
  EXPECT_TRUE(IsOk(DeleteRecursively(PosixFileSystem(), path)));
}

}  // namespace
}  // namespace ckpt::testing
