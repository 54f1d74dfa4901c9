#include "client/session.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace ckpt::client {
namespace {
constexpr size_t kMaxReply = 64 << 10;
constexpr size_t kMaxReplyChunk = 64 << 10;  // SessionServer::kReplyChunkBytes
constexpr size_t kMaxPools = 64;
}  // namespace

std::string AgentSession::SocketFor(const std::string& agent_socket) {
  const size_t slash = agent_socket.rfind('/');
  return (slash == std::string::npos ? std::string(".") : agent_socket.substr(0, slash)) + "/session.sock";
}

absl::StatusOr<std::unique_ptr<AgentSession>> AgentSession::Open(const std::string& socket_path,
                                                                 const std::string& resume_id,
                                                                 absl::Duration timeout) {
  const std::string tail = resume_id.empty() ? "" : absl::StrCat(" ", resume_id);
  absl::StatusOr<std::unique_ptr<AgentSession>> s = Greet(socket_path, "HELLO 2" + tail, timeout);
  // An agent older than version 2 refuses it: a session without requests.
  if (absl::IsFailedPrecondition(s.status()) && absl::StrContains(s.status().message(), "expected \"HELLO 1")) {
    s = Greet(socket_path, "HELLO 1" + tail, timeout);
  }
  return s;
}

absl::StatusOr<std::unique_ptr<AgentSession>> AgentSession::Greet(const std::string& socket_path,
                                                                  const std::string& hello,
                                                                  absl::Duration timeout) {
  sockaddr_un addr{};
  if (socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("session socket path '", socket_path, "' is too long"));
  }
  std::unique_ptr<AgentSession> s(new AgentSession());
  s->fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s->fd_ < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, socket_path.c_str(), socket_path.size());
  if (::connect(s->fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    const std::string why = absl::StrCat("session socket '", socket_path, "': ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(why);
    return absl::UnavailableError(why);
  }
  if (::send(s->fd_, hello.data(), hello.size(), MSG_NOSIGNAL) < 0) {
    return absl::UnavailableError(absl::StrCat("session socket: ", std::strerror(errno)));
  }
  pollfd p{s->fd_, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) <= 0) {
    return absl::UnavailableError(absl::StrCat("the agent did not answer on '", socket_path, "' within ",
                                               absl::FormatDuration(timeout)));
  }
  std::string reply(kMaxReply, '\0');
  iovec iov{reply.data(), reply.size()};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * kMaxPools));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  const ssize_t got = ::recvmsg(s->fd_, &msg, MSG_CMSG_CLOEXEC);
  if (got <= 0) return absl::UnavailableError("the agent closed the session socket without answering");
  reply.resize(static_cast<size_t>(got));
  std::vector<int> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds.push_back(fd);
    }
  }
  auto close_fds = [&] {
    for (int fd : fds) ::close(fd);
  };
  std::vector<std::string> lines = absl::StrSplit(reply, '\n', absl::SkipEmpty());
  if (lines.empty() || absl::StartsWith(lines[0], "ERR ")) {
    close_fds();
    return absl::FailedPreconditionError(absl::StrCat(
        "the agent refused the session: ", lines.empty() ? std::string("empty reply") : lines[0].substr(4)));
  }
  std::vector<std::string> head = absl::StrSplit(lines[0], ' ');
  size_t count = 0;
  if (head.size() < 3 || head.size() > 4 || head[0] != "OK" || !absl::SimpleAtoi(head[2], &count) ||
      count != fds.size() || lines.size() != count + 1 || (head.size() == 4 && head[3] != "open")) {
    close_fds();
    return absl::InternalError(absl::StrCat("malformed session reply from the agent: \"", lines[0], "\""));
  }
  s->id_ = head[1];
  s->serves_requests_ = head.size() == 4;
  for (size_t i = 0; i < count; ++i) {
    std::vector<std::string> f = absl::StrSplit(lines[i + 1], '\t');
    uint64_t bytes = 0;
    if (f.size() != 4 || !absl::SimpleAtoi(f[1], &bytes)) {
      close_fds();
      return absl::InternalError("malformed pool line in the session reply");
    }
    s->pools_.push_back(Pool{f[0], fds[i], bytes});
  }
  return s;
}

absl::StatusOr<std::string> AgentSession::Request(std::string_view kind, const std::string& request,
                                                  absl::Duration timeout) const {
  if (!serves_requests_) return absl::FailedPreconditionError("this agent takes no requests on its sessions");
  absl::MutexLock lock(&call_mu_);
  if (broken_) return absl::UnavailableError("the session broke off; open a new one");
  const absl::Time deadline = absl::Now() + timeout;
  auto fail = [this](const std::string& why) {
    // The stream may be out of step: this connection is done. The agent
    // sees it close, and the client resumes the session on a new one.
    broken_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    return absl::UnavailableError(absl::StrCat("session request: ", why));
  };
  std::string m(kind);
  m += '\n';
  m += request;
  if (::send(fd_, m.data(), m.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(m.size())) {
    return fail(std::strerror(errno));
  }
  // Receives one message of at most `max` bytes into `out`.
  auto receive = [&](std::string* out, size_t max) -> absl::Status {
    while (true) {
      const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (left <= 0) return absl::DeadlineExceededError("no answer in time");
      pollfd p{fd_, POLLIN, 0};
      const int n = ::poll(&p, 1, static_cast<int>(left));
      if (n < 0 && errno != EINTR) return absl::UnavailableError(std::strerror(errno));
      if (n <= 0) continue;
      out->resize(max + 1);
      const ssize_t got = ::recv(fd_, out->data(), out->size(), MSG_DONTWAIT | MSG_TRUNC);
      if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (got <= 0) return absl::UnavailableError("the agent closed the session");
      if (static_cast<size_t>(got) > max) return absl::InternalError("a reply message is too long");
      out->resize(static_cast<size_t>(got));
      return absl::OkStatus();
    }
  };
  std::string head;
  if (absl::Status s = receive(&head, 512); !s.ok()) return fail(std::string(s.message()));
  if (!head.empty() && head.back() == '\n') head.pop_back();
  if (absl::StartsWith(head, "ERR ")) {
    // "ERR <code> <message>": the agent's answer, the session is fine.
    std::vector<std::string> w = absl::StrSplit(head.substr(4), absl::MaxSplits(' ', 1));
    int code = 0;
    if (w.size() != 2 || !absl::SimpleAtoi(w[0], &code) || code <= 0 || code > 16) {
      return fail(absl::StrCat("malformed refusal \"", head, "\""));
    }
    return absl::Status(static_cast<absl::StatusCode>(code), w[1]);
  }
  size_t size = 0;
  if (!absl::StartsWith(head, "OK ") || !absl::SimpleAtoi(head.substr(3), &size) || size > (size_t{1} << 32)) {
    return fail(absl::StrCat("malformed reply \"", head, "\""));
  }
  std::string body;
  body.reserve(size);
  std::string chunk;
  while (body.size() < size) {
    if (absl::Status s = receive(&chunk, kMaxReplyChunk); !s.ok()) return fail(std::string(s.message()));
    if (chunk.size() > size - body.size()) return fail("a reply is longer than it said");
    body += chunk;
  }
  return body;
}

AgentSession::~AgentSession() {
  for (const Pool& p : pools_) ::close(p.fd);
  if (fd_ >= 0) ::close(fd_);
}

bool AgentSession::Closed() const {
  if (broken_) return true;
  // A request under way owns what arrives (and the session is open).
  if (!call_mu_.TryLock()) return false;
  pollfd p{fd_, POLLIN | POLLRDHUP, 0};
  const bool closed = ::poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR | POLLRDHUP | POLLIN)) != 0;
  call_mu_.Unlock();
  return closed;
}

}  // namespace ckpt::client
