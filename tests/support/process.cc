#include "support/process.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/clock.h"
#include "common/file_system.h"
#include "common/status_macros.h"

#ifndef CKPT_BINARY_DIR
#error "CKPT_BINARY_DIR must be defined (see tests/support/CMakeLists.txt)"
#endif

extern char** environ;

namespace ckpt::testing {
namespace {

// Owns a file descriptor; closes it on destruction.
class ScopedFd {
 public:
  explicit ScopedFd(int fd = -1) : fd_(fd) {}
  ~ScopedFd() { Reset(); }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;

  int get() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }
  void Reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

absl::Time MonotonicNow() { return RealClock()->MonotonicNow(); }

// Milliseconds for poll(): `d` rounded up, clamped to [0, INT_MAX].
int PollTimeoutMs(absl::Duration d) {
  if (d <= absl::ZeroDuration()) return 0;
  const int64_t ms = absl::ToInt64Microseconds(d + absl::Microseconds(999)) / 1000;
  return static_cast<int>(std::min<int64_t>(ms, INT_MAX));
}

// ---------------------------------------------------------------------------
// Spawning

// What the child reports through the exec-error pipe when a step before
// execve() (or execve() itself) fails.
struct ChildFailure {
  int stage;  // index into kStageNames
  int error_number;
};

enum ChildStage { kStageSetpgid, kStageDup, kStageChdir, kStageExec };
constexpr const char* kStageNames[] = {"setpgid", "dup2", "chdir", "execve"};

// Opens `path` for the child's output: created if missing, appended to.
absl::StatusOr<int> OpenOutputFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return PosixErrorToStatus(errno, "open", path);
  return fd;
}

// The child's environment: the test process's, with `extra` added or
// replacing variables of the same name.
std::vector<std::string> BuildEnvironment(
    const std::vector<std::pair<std::string, std::string>>& extra) {
  absl::flat_hash_set<std::string> replaced;
  for (const auto& [key, value] : extra) replaced.insert(key);
  std::vector<std::string> env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const absl::string_view var(*entry);
    const absl::string_view key = var.substr(0, var.find('='));
    if (!replaced.contains(key)) env.emplace_back(var);
  }
  // Later entries of `extra` win: emit each name once, at its last entry.
  absl::flat_hash_set<std::string> emitted;
  std::vector<std::string> added;
  for (auto it = extra.rbegin(); it != extra.rend(); ++it) {
    if (emitted.insert(it->first).second) added.push_back(absl::StrCat(it->first, "=", it->second));
  }
  env.insert(env.end(), added.rbegin(), added.rend());
  return env;
}

std::vector<char*> CStringArray(std::vector<std::string>& strings) {
  std::vector<char*> array;
  array.reserve(strings.size() + 1);
  for (std::string& s : strings) array.push_back(s.data());
  array.push_back(nullptr);
  return array;
}

// Everything the child needs, prepared before fork(): between fork() and
// execve() the child of a multi-threaded process may only make
// async-signal-safe calls (no allocation, no locks).
struct ChildPlan {
  char* const* argv;
  char* const* envp;
  const char* working_dir;  // nullptr: stay
  int stdin_fd;
  int stdout_fd;  // -1: inherit
  int stderr_fd;  // -1: inherit
  int report_fd;  // write end of the exec-error pipe (O_CLOEXEC)
  pid_t parent_pid;
};

[[noreturn]] void ChildFail(const ChildPlan& plan, ChildStage stage) {
  const ChildFailure failure{stage, errno};
  ssize_t n;
  do {
    n = ::write(plan.report_fd, &failure, sizeof(failure));
  } while (n < 0 && errno == EINTR);
  ::_exit(127);
}

// Moves `fd` to a number >= 3 (so that the dup2 calls onto 0, 1 and 2 cannot
// clobber one another's sources). Only matters if the test closed its stdio.
int LiftAbove2(int fd) { return (fd >= 0 && fd < 3) ? ::fcntl(fd, F_DUPFD_CLOEXEC, 3) : fd; }

bool DupTo(int fd, int target) {
  if (fd < 0) return true;
  return ::dup2(fd, target) == target;  // the copy does not inherit O_CLOEXEC
}

// Runs in the forked child. Async-signal-safe calls only.
[[noreturn]] void RunChild(const ChildPlan& plan) {
  // Own process group, so the test can kill the daemon and anything it
  // started (and a terminal's ^C does not reach it twice).
  if (::setpgid(0, 0) != 0) ChildFail(plan, kStageSetpgid);

  // Die with the test. If the parent died before prctl took effect, no signal
  // will ever come: exit now.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != plan.parent_pid) ::_exit(127);

  // Signal dispositions set to SIG_IGN and the signal mask survive execve;
  // a daemon must start with defaults whatever the test runner set.
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof(dfl));
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig != SIGKILL && sig != SIGSTOP) ::sigaction(sig, &dfl, nullptr);
  }
  sigset_t empty;
  sigemptyset(&empty);
  ::sigprocmask(SIG_SETMASK, &empty, nullptr);

  const int in = LiftAbove2(plan.stdin_fd);
  const int out = LiftAbove2(plan.stdout_fd);
  const int err = LiftAbove2(plan.stderr_fd);
  if ((plan.stdin_fd >= 0 && in < 0) || (plan.stdout_fd >= 0 && out < 0) ||
      (plan.stderr_fd >= 0 && err < 0) || !DupTo(in, 0) || !DupTo(out, 1) || !DupTo(err, 2)) {
    ChildFail(plan, kStageDup);
  }
  // Every other descriptor closes at exec (the report pipe only then, so that
  // an exec failure can still be reported). Needs Linux 5.11; on older
  // kernels only the descriptors opened with O_CLOEXEC close.
  ::syscall(SYS_close_range, 3U, ~0U, 4U /* CLOSE_RANGE_CLOEXEC */);

  if (plan.working_dir != nullptr && ::chdir(plan.working_dir) != 0) {
    ChildFail(plan, kStageChdir);
  }
  ::execve(plan.argv[0], plan.argv, plan.envp);
  ChildFail(plan, kStageExec);
}

// ---------------------------------------------------------------------------
// Sockets

// One address of a resolved host:port, owned (unlike getaddrinfo's list).
struct TcpAddress {
  int family;
  int socktype;
  int protocol;
  sockaddr_storage addr;
  socklen_t addr_len;
};

absl::StatusOr<std::vector<TcpAddress>> ResolveTcp(const std::string& host, int port) {
  if (port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("bad TCP port ", port));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* list = nullptr;
  const std::string service = absl::StrCat(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &list);
  if (rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resolve '", host, "': ", rc == EAI_SYSTEM ? std::strerror(errno) : ::gai_strerror(rc)));
  }
  std::vector<TcpAddress> result;
  for (const addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
    TcpAddress address{};
    address.family = ai->ai_family;
    address.socktype = ai->ai_socktype;
    address.protocol = ai->ai_protocol;
    address.addr_len = std::min<socklen_t>(ai->ai_addrlen, sizeof(address.addr));
    std::memcpy(&address.addr, ai->ai_addr, address.addr_len);
    result.push_back(address);
  }
  ::freeaddrinfo(list);
  return result;
}

// Connects a non-blocking socket to `ai`, waiting at most until `deadline`.
// Returns the connected socket, or -1 with *error set to the errno (ETIMEDOUT
// at the deadline).
int ConnectBefore(const TcpAddress& ai, absl::Time deadline, int* error) {
  ScopedFd fd(::socket(ai.family, ai.socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai.protocol));
  if (fd.get() < 0) {
    *error = errno;
    return -1;
  }
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&ai.addr), ai.addr_len) != 0) {
    if (errno != EINPROGRESS) {
      *error = errno;
      return -1;
    }
    pollfd pfd{fd.get(), POLLOUT, 0};
    int rc;
    do {
      rc = ::poll(&pfd, 1, PollTimeoutMs(deadline - MonotonicNow()));
    } while (rc < 0 && errno == EINTR);
    if (rc == 0) {
      *error = ETIMEDOUT;
      return -1;
    }
    int so_error = 0;
    socklen_t len = sizeof(so_error);
    if (rc < 0 || ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &so_error, &len) != 0) {
      *error = errno;
      return -1;
    }
    if (so_error != 0) {
      *error = so_error;
      return -1;
    }
  }
  return fd.Release();
}

// Tries every address of host:port once; returns a connected socket or -1
// with *error set from the last attempt.
int ConnectAny(const std::vector<TcpAddress>& addrs, absl::Time deadline, int* error) {
  *error = EHOSTUNREACH;
  for (const TcpAddress& ai : addrs) {
    const int fd = ConnectBefore(ai, deadline, error);
    if (fd >= 0) return fd;
  }
  return -1;
}

std::string HostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                             : absl::StrCat(host, ":", port);
}

// ---------------------------------------------------------------------------
// HTTP

constexpr size_t kMaxHttpResponseBytes = size_t{64} << 20;

enum class Parse { kIncomplete, kComplete, kMalformed };

// Decodes a chunked body starting at `data`; kComplete once the last
// (zero-size) chunk has been seen. Trailers are ignored.
Parse DecodeChunked(absl::string_view data, std::string* body) {
  body->clear();
  while (true) {
    const size_t line_end = data.find("\r\n");
    if (line_end == absl::string_view::npos) return Parse::kIncomplete;
    absl::string_view size_text = data.substr(0, line_end);
    size_text = size_text.substr(0, size_text.find(';'));  // chunk extensions
    size_text = absl::StripAsciiWhitespace(size_text);
    uint64_t size = 0;
    if (size_text.empty() || size_text.size() > 15 ||
        !absl::SimpleHexAtoi(size_text, &size)) {
      return Parse::kMalformed;
    }
    data.remove_prefix(line_end + 2);
    if (size == 0) return Parse::kComplete;
    if (data.size() < size + 2) return Parse::kIncomplete;
    if (data.substr(size, 2) != "\r\n") return Parse::kMalformed;
    body->append(data.data(), size);
    data.remove_prefix(size + 2);
  }
}

// Parses the response received so far. `eof`: the server closed the
// connection, so a body without length ends here.
Parse ParseHttpResponse(const std::string& raw, bool eof, int* code, std::string* body) {
  const size_t header_end = raw.find("\r\n\r\n");
  if (header_end == std::string::npos) return eof ? Parse::kMalformed : Parse::kIncomplete;
  std::vector<absl::string_view> lines =
      absl::StrSplit(absl::string_view(raw).substr(0, header_end), "\r\n");
  // Status line: HTTP/1.x SSS reason
  const std::vector<absl::string_view> status_line =
      absl::StrSplit(lines[0], absl::MaxSplits(' ', 2));
  if (status_line.size() < 2 || !absl::StartsWith(status_line[0], "HTTP/1.") ||
      !absl::SimpleAtoi(status_line[1], code) || *code < 100 || *code > 999) {
    return Parse::kMalformed;
  }
  std::optional<uint64_t> content_length;
  bool chunked = false;
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t colon = lines[i].find(':');
    if (colon == absl::string_view::npos) return Parse::kMalformed;
    const absl::string_view key = absl::StripAsciiWhitespace(lines[i].substr(0, colon));
    const absl::string_view value = absl::StripAsciiWhitespace(lines[i].substr(colon + 1));
    if (absl::EqualsIgnoreCase(key, "Content-Length")) {
      uint64_t length = 0;
      if (!absl::SimpleAtoi(value, &length)) return Parse::kMalformed;
      content_length = length;
    } else if (absl::EqualsIgnoreCase(key, "Transfer-Encoding")) {
      chunked = absl::StrContains(absl::AsciiStrToLower(value), "chunked");
    }
  }
  const absl::string_view rest = absl::string_view(raw).substr(header_end + 4);
  if (*code / 100 == 1 || *code == 204 || *code == 304) {
    body->clear();
    return Parse::kComplete;
  }
  if (chunked) {
    const Parse parsed = DecodeChunked(rest, body);
    return (parsed == Parse::kIncomplete && eof) ? Parse::kMalformed : parsed;
  }
  if (content_length.has_value()) {
    if (rest.size() < *content_length) return eof ? Parse::kMalformed : Parse::kIncomplete;
    body->assign(rest.data(), *content_length);
    return Parse::kComplete;
  }
  if (!eof) return Parse::kIncomplete;
  body->assign(rest.data(), rest.size());
  return Parse::kComplete;
}

// Keeps the tail of `text` (at most `max_bytes`), cut at a line boundary.
std::string Tail(const std::string& text, size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  size_t start = text.size() - max_bytes;
  const size_t newline = text.find('\n', start);
  if (newline != std::string::npos && newline + 1 < text.size()) start = newline + 1;
  return absl::StrCat("...\n", text.substr(start));
}

}  // namespace

// ---------------------------------------------------------------------------
// ExitStatus

bool ExitStatus::exited() const { return WIFEXITED(wait_status_); }
int ExitStatus::exit_code() const { return exited() ? WEXITSTATUS(wait_status_) : -1; }
bool ExitStatus::signaled() const { return WIFSIGNALED(wait_status_); }
int ExitStatus::term_signal() const { return signaled() ? WTERMSIG(wait_status_) : 0; }

std::string ExitStatus::ToString() const {
  if (exited()) return absl::StrCat("exited with code ", exit_code());
  if (signaled()) {
    const char* description = ::strsignal(term_signal());
    return absl::StrCat("killed by signal ", term_signal(), " (",
                        description != nullptr ? description : "?", ")",
                        WCOREDUMP(wait_status_) ? ", core dumped" : "");
  }
  return absl::StrCat("wait status 0x", absl::Hex(wait_status_));
}

std::ostream& operator<<(std::ostream& os, const ExitStatus& status) {
  return os << status.ToString();
}

// ---------------------------------------------------------------------------
// Subprocess

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(SubprocessOptions options) {
  if (options.argv.empty() || options.argv[0].empty()) {
    return absl::InvalidArgumentError("Subprocess::Start: empty argv");
  }
  if (options.name.empty()) {
    const std::string& binary = options.argv[0];
    options.name = binary.substr(binary.find_last_of('/') + 1);  // npos + 1 == 0
  }
  if (options.name.empty() || options.name.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("Subprocess::Start: bad name '", options.name, "'"));
  }
  for (const auto& [key, value] : options.env) {
    if (key.empty() || key.find('=') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("Subprocess::Start: bad environment variable name '", key, "'"));
    }
  }

  // Output files, opened here so that errors come back as a Status.
  const std::string log_file =
      options.log_dir.empty() ? "" : absl::StrCat(options.log_dir, "/", options.name, ".log");
  const std::string out_path = !options.stdout_path.empty() ? options.stdout_path : log_file;
  const std::string err_path = !options.stderr_path.empty() ? options.stderr_path : log_file;
  ScopedFd stdin_fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (stdin_fd.get() < 0) return PosixErrorToStatus(errno, "open", "/dev/null");
  ScopedFd out_fd, err_fd;
  if (!out_path.empty()) {
    CKPT_ASSIGN_OR_RETURN(int fd, OpenOutputFile(out_path));
    out_fd.Reset(fd);
  }
  if (!err_path.empty()) {
    if (err_path == out_path) {
      const int fd = ::fcntl(out_fd.get(), F_DUPFD_CLOEXEC, 3);
      if (fd < 0) return PosixErrorToStatus(errno, "dup", err_path);
      err_fd.Reset(fd);
    } else {
      CKPT_ASSIGN_OR_RETURN(int fd, OpenOutputFile(err_path));
      err_fd.Reset(fd);
    }
  }

  std::vector<std::string> argv_strings = options.argv;
  std::vector<char*> argv = CStringArray(argv_strings);
  std::vector<std::string> env_strings = BuildEnvironment(options.env);
  std::vector<char*> envp = CStringArray(env_strings);

  int report_pipe[2];
  if (::pipe2(report_pipe, O_CLOEXEC) != 0) return PosixErrorToStatus(errno, "pipe2", "");
  ScopedFd report_read(report_pipe[0]);
  ScopedFd report_write(report_pipe[1]);

  const ChildPlan plan{
      .argv = argv.data(),
      .envp = envp.data(),
      .working_dir = options.working_dir.empty() ? nullptr : options.working_dir.c_str(),
      .stdin_fd = stdin_fd.get(),
      .stdout_fd = out_fd.get(),
      .stderr_fd = err_fd.get(),
      .report_fd = report_write.get(),
      .parent_pid = ::getpid(),
  };
  const pid_t pid = ::fork();
  if (pid < 0) return PosixErrorToStatus(errno, "fork", options.argv[0]);
  if (pid == 0) RunChild(plan);

  // Parent. The read end sees EOF once the child has exec'd (the write end is
  // O_CLOEXEC), or a ChildFailure if it could not.
  report_write.Reset();
  ChildFailure failure{};
  ssize_t n;
  do {
    n = ::read(report_read.get(), &failure, sizeof(failure));
  } while (n < 0 && errno == EINTR);
  if (n != 0) {
    const int read_error = errno;
    int wait_status;
    while (::waitpid(pid, &wait_status, 0) < 0 && errno == EINTR) {
    }
    if (n != static_cast<ssize_t>(sizeof(failure))) {
      return PosixErrorToStatus(n < 0 ? read_error : EIO, "read exec report", options.argv[0]);
    }
    const char* stage = (failure.stage >= 0 && failure.stage <= kStageExec)
                            ? kStageNames[failure.stage]
                            : "start";
    const std::string& subject =
        failure.stage == kStageChdir ? options.working_dir : options.argv[0];
    return PosixErrorToStatus(failure.error_number, absl::StrCat("start ", options.name, ": ", stage),
                              subject);
  }

  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  return std::unique_ptr<Subprocess>(
      new Subprocess(std::move(options), out_path, err_path, pid, pidfd));
}

Subprocess::Subprocess(SubprocessOptions options, std::string stdout_file,
                       std::string stderr_file, pid_t pid, int pidfd)
    : options_(std::move(options)),
      stdout_file_(std::move(stdout_file)),
      stderr_file_(std::move(stderr_file)),
      pid_(pid),
      pidfd_(pidfd) {}

Subprocess::~Subprocess() {
  {
    absl::MutexLock lock(&mu_);
    if (!exit_status_.has_value()) {
      // Unreaped, so the PID and the group ID are still ours.
      ::kill(-pid_, SIGKILL);
      ::kill(pid_, SIGKILL);  // in case the child moved to another group
      absl::StatusOr<ExitStatus> reaped = ReapLocked();
      if (!reaped.ok()) {
        std::fprintf(stderr, "[ckpt] ~Subprocess %s (pid %d): %s\n", options_.name.c_str(),
                     static_cast<int>(pid_), reaped.status().ToString().c_str());
      }
    }
  }
  if (pidfd_ >= 0) ::close(pidfd_);
}

absl::StatusOr<bool> Subprocess::HasExitedLocked() {
  siginfo_t info;
  while (true) {
    std::memset(&info, 0, sizeof(info));
    if (::waitid(P_PID, pid_, &info, WEXITED | WNOHANG | WNOWAIT) == 0) break;
    if (errno != EINTR) {
      return PosixErrorToStatus(errno, absl::StrCat("waitid ", options_.name),
                                absl::StrCat("pid ", pid_));
    }
  }
  return info.si_pid != 0;
}

absl::StatusOr<ExitStatus> Subprocess::ReapLocked() {
  // While the exited child is unreaped its PID, and so its process group ID,
  // cannot be reused: it is safe to kill what is left of the group.
  ::kill(-pid_, SIGKILL);
  int wait_status = 0;
  struct rusage usage {};
  while (::wait4(pid_, &wait_status, 0, &usage) < 0) {
    if (errno != EINTR) {
      return absl::InternalError(absl::StrCat("waitpid ", options_.name, " (pid ", pid_,
                                              "): ", std::strerror(errno)));
    }
  }
  max_rss_bytes_ = static_cast<uint64_t>(usage.ru_maxrss) * 1024;  // Linux: KiB
  exit_status_.emplace(wait_status);
  return *exit_status_;
}

absl::StatusOr<ExitStatus> Subprocess::WaitUntil(std::optional<absl::Time> deadline) {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (exit_status_.has_value()) return *exit_status_;
      absl::StatusOr<bool> exited = HasExitedLocked();
      if (!exited.ok()) return absl::InternalError(exited.status().message());
      if (*exited) return ReapLocked();
    }
    // Wait for the exit outside the lock, so that Kill() and other waiters
    // are not blocked; only reaping (above, under the lock) changes state.
    std::optional<absl::Duration> remaining;
    if (deadline.has_value()) {
      remaining = *deadline - MonotonicNow();
      if (*remaining <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError(
            absl::StrCat(options_.name, " (pid ", pid_, ") is still running"));
      }
    }
    if (pidfd_ >= 0) {
      // Readable once the process has exited. Unlike waiting by PID, this
      // cannot mistake another process for ours if a concurrent Wait() of
      // this object reaps it meanwhile.
      pollfd pfd{pidfd_, POLLIN, 0};
      ::poll(&pfd, 1, remaining.has_value() ? PollTimeoutMs(*remaining) : -1);
    } else if (remaining.has_value()) {
      ::poll(nullptr, 0, PollTimeoutMs(std::min(*remaining, absl::Milliseconds(5))));
    } else {
      siginfo_t info;
      if (::waitid(P_PID, pid_, &info, WEXITED | WNOWAIT) != 0 && errno != EINTR) {
        // Another thread may have reaped it meanwhile: then its status is
        // recorded.
        absl::MutexLock lock(&mu_);
        if (exit_status_.has_value()) return *exit_status_;
        return absl::InternalError(absl::StrCat("waitid ", options_.name, " (pid ", pid_,
                                                "): ", std::strerror(errno)));
      }
    }
  }
}

absl::StatusOr<ExitStatus> Subprocess::Wait() { return WaitUntil(std::nullopt); }

absl::StatusOr<ExitStatus> Subprocess::WaitFor(absl::Duration timeout) {
  return WaitUntil(MonotonicNow() + timeout);
}

absl::Status Subprocess::Kill(int sig) {
  absl::MutexLock lock(&mu_);
  if (exit_status_.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "kill ", options_.name, " (pid ", pid_, "): already ", exit_status_->ToString()));
  }
  if (::kill(pid_, sig) != 0) {
    return PosixErrorToStatus(errno, absl::StrCat("kill -", sig, " ", options_.name),
                              absl::StrCat("pid ", pid_));
  }
  return absl::OkStatus();
}

absl::StatusOr<ExitStatus> Subprocess::Terminate(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (exit_status_.has_value()) return *exit_status_;
  }
  absl::Status sent = Kill(SIGTERM);
  if (!sent.ok() && !absl::IsFailedPrecondition(sent)) return sent;  // reaped meanwhile: fine
  absl::StatusOr<ExitStatus> status = WaitFor(grace);
  if (!absl::IsDeadlineExceeded(status.status())) return status;
  sent = Kill(SIGKILL);
  if (!sent.ok() && !absl::IsFailedPrecondition(sent)) return sent;
  return Wait();
}

bool Subprocess::IsRunning() {
  absl::MutexLock lock(&mu_);
  if (exit_status_.has_value()) return false;
  absl::StatusOr<bool> exited = HasExitedLocked();
  if (!exited.ok()) return false;  // not (or no longer) our child: nothing runs that we own
  if (!*exited) return true;
  ReapLocked().IgnoreError();  // failure means it is gone anyway; Wait() reports it
  return false;
}


uint64_t Subprocess::max_rss_bytes() const {
  absl::MutexLock lock(&mu_);
  return max_rss_bytes_;
}

const std::string& Subprocess::log_path() const {
  return !stdout_file_.empty() ? stdout_file_ : stderr_file_;
}

absl::StatusOr<std::string> Subprocess::ReadLog() const {
  if (stdout_file_.empty() && stderr_file_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the output of ", options_.name, " is not captured in a file"));
  }
  std::string log;
  if (!stdout_file_.empty()) {
    CKPT_ASSIGN_OR_RETURN(log, ReadFileToString(PosixFileSystem(), stdout_file_));
  }
  if (!stderr_file_.empty() && stderr_file_ != stdout_file_) {
    CKPT_ASSIGN_OR_RETURN(std::string err, ReadFileToString(PosixFileSystem(), stderr_file_));
    log += err;
  }
  return log;
}

std::string Subprocess::LogTail(size_t max_bytes) const {
  absl::StatusOr<std::string> log = ReadLog();
  if (!log.ok()) return absl::StrCat("(no log: ", log.status().ToString(), ")");
  return Tail(*log, max_bytes);
}

// ---------------------------------------------------------------------------
// Free functions

absl::StatusOr<RunResult> RunToCompletion(SubprocessOptions options, absl::Duration timeout) {
  const char* tmpdir = std::getenv("TMPDIR");
  const std::string base = (tmpdir != nullptr && tmpdir[0] != '\0') ? tmpdir : "/tmp";
  std::string out_path = absl::StrCat(base, "/ckpt-run-XXXXXX");
  std::string err_path = out_path;
  ScopedFd out_fd(::mkostemp(out_path.data(), O_CLOEXEC));
  if (out_fd.get() < 0) return PosixErrorToStatus(errno, "mkstemp", out_path);
  ScopedFd err_fd(::mkostemp(err_path.data(), O_CLOEXEC));
  if (err_fd.get() < 0) {
    const int err = errno;
    ::unlink(out_path.c_str());
    return PosixErrorToStatus(err, "mkstemp", err_path);
  }
  // The child opens the files by name; the descriptors only keep them private
  // to this call until then.
  struct Unlinker {
    const std::string& a;
    const std::string& b;
    ~Unlinker() {
      ::unlink(a.c_str());
      ::unlink(b.c_str());
    }
  } unlinker{out_path, err_path};

  options.log_dir.clear();
  options.stdout_path = out_path;
  options.stderr_path = err_path;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<Subprocess> proc, Subprocess::Start(std::move(options)));
  absl::StatusOr<ExitStatus> status = proc->WaitFor(timeout);
  if (!status.ok()) {
    if (!absl::IsDeadlineExceeded(status.status())) return status.status();
    const std::string name = proc->name();
    const pid_t pid = proc->pid();
    proc.reset();  // kills it and its process group
    absl::StatusOr<std::string> out = ReadFileToString(PosixFileSystem(), out_path);
    absl::StatusOr<std::string> err = ReadFileToString(PosixFileSystem(), err_path);
    return absl::DeadlineExceededError(absl::StrCat(
        name, " (pid ", pid, ") did not finish within ", absl::FormatDuration(timeout),
        " and was killed; stdout so far:\n", out.ok() ? Tail(*out, 2048) : out.status().ToString(),
        "\nstderr so far:\n", err.ok() ? Tail(*err, 2048) : err.status().ToString()));
  }
  RunResult result{*status, "", "", proc->max_rss_bytes()};
  CKPT_ASSIGN_OR_RETURN(result.stdout_text, ReadFileToString(PosixFileSystem(), out_path));
  CKPT_ASSIGN_OR_RETURN(result.stderr_text, ReadFileToString(PosixFileSystem(), err_path));
  return result;
}

std::string BinaryPath(const std::string& name) {
  return absl::StrCat(CKPT_BINARY_DIR, "/bin/", name);
}

absl::Status WaitForTcpPort(const std::string& host, int port, absl::Duration timeout,
                            Subprocess* proc) {
  const absl::Time deadline = MonotonicNow() + timeout;
  CKPT_ASSIGN_OR_RETURN(std::vector<TcpAddress> addrs, ResolveTcp(host, port));
  const std::string where = HostPort(host, port);
  auto exited_error = [&](const char* what) {
    absl::StatusOr<ExitStatus> status = proc->Wait();  // reaped already: returns at once
    return absl::UnavailableError(absl::StrCat(
        proc->name(), " (pid ", proc->pid(), ") ",
        status.ok() ? status->ToString() : status.status().ToString(), " ", what, " ", where,
        " accepted connections; last lines of its log:\n", proc->LogTail()));
  };
  int last_error = 0;
  while (true) {
    const int fd = ConnectAny(addrs, std::min(deadline, MonotonicNow() + absl::Seconds(1)),
                              &last_error);
    if (fd >= 0) {
      ::close(fd);
      // A listener while the process is gone is someone else's.
      if (proc != nullptr && !proc->IsRunning()) return exited_error("and yet");
      return absl::OkStatus();
    }
    if (proc != nullptr && !proc->IsRunning()) return exited_error("before");
    const absl::Duration remaining = deadline - MonotonicNow();
    if (remaining <= absl::ZeroDuration()) {
      std::string message = absl::StrCat("nothing accepted connections on ", where, " within ",
                                         absl::FormatDuration(timeout), " (last error: ",
                                         std::strerror(last_error), ")");
      if (proc != nullptr) {
        absl::StrAppend(&message, "; last lines of the log of ", proc->name(), " (pid ",
                        proc->pid(), "):\n", proc->LogTail());
      }
      return absl::DeadlineExceededError(message);
    }
    RealClock()->SleepFor(std::min(remaining, absl::Milliseconds(10)));
  }
}

absl::StatusOr<std::string> HttpGet(const std::string& host, int port, const std::string& path,
                                    int* status_code, absl::Duration timeout) {
  if (path.empty() || path.front() != '/' ||
      path.find_first_of(" \r\n") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("HttpGet: bad path '", path, "'"));
  }
  const absl::Time deadline = MonotonicNow() + timeout;
  const std::string where = HostPort(host, port);
  const std::string url = absl::StrCat("http://", where, path);
  CKPT_ASSIGN_OR_RETURN(std::vector<TcpAddress> addrs, ResolveTcp(host, port));
  int error = 0;
  ScopedFd fd(ConnectAny(addrs, deadline, &error));
  if (fd.get() < 0) {
    const std::string message = absl::StrCat("GET ", url, ": connect: ", std::strerror(error));
    return error == ETIMEDOUT ? absl::DeadlineExceededError(message)
                              : absl::UnavailableError(message);
  }
  auto timed_out = [&](const char* stage) {
    return absl::DeadlineExceededError(absl::StrCat("GET ", url, ": no complete response within ",
                                                    absl::FormatDuration(timeout), " (", stage,
                                                    ")"));
  };
  // Waits until `events` are ready on the socket; false at the deadline.
  auto await = [&](short events) {
    pollfd pfd{fd.get(), events, 0};
    while (true) {
      const int rc = ::poll(&pfd, 1, PollTimeoutMs(deadline - MonotonicNow()));
      if (rc > 0) return true;
      if (rc == 0) return false;
      if (errno != EINTR) return true;  // let the next send/recv report the error
    }
  };

  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: ", where,
                   "\r\nAccept: */*\r\nConnection: close\r\nUser-Agent: ckpt-test\r\n\r\n");
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n =
        ::send(fd.get(), request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n >= 0) {
      sent += static_cast<size_t>(n);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!await(POLLOUT)) return timed_out("sending the request");
    } else if (errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("GET ", url, ": send: ", std::strerror(errno)));
    }
  }

  std::string raw;
  std::string body;
  int code = 0;
  char buf[16384];
  while (true) {
    const ssize_t n = ::recv(fd.get(), buf, sizeof(buf), 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!await(POLLIN)) return timed_out("reading the response");
        continue;
      }
      return absl::UnavailableError(absl::StrCat("GET ", url, ": recv: ", std::strerror(errno)));
    }
    raw.append(buf, static_cast<size_t>(n));
    if (raw.size() > kMaxHttpResponseBytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("GET ", url, ": response larger than ", kMaxHttpResponseBytes, " bytes"));
    }
    const bool eof = n == 0;
    const Parse parsed = ParseHttpResponse(raw, eof, &code, &body);
    if (parsed == Parse::kComplete) break;
    if (parsed == Parse::kMalformed) {
      // A response cut short by the server looks malformed only at EOF.
      const std::string message =
          absl::StrCat("GET ", url, ": ", eof ? "truncated or malformed" : "malformed",
                       " response: '", absl::CEscape(Tail(raw, 200)), "'");
      return eof ? absl::UnavailableError(message) : absl::InternalError(message);
    }
    if (eof) {
      return absl::UnavailableError(absl::StrCat("GET ", url, ": connection closed early"));
    }
  }
  if (status_code != nullptr) *status_code = code;
  return body;
}

}  // namespace ckpt::testing
