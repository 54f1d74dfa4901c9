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
constexpr size_t kMaxPools = 64;
}  // namespace

std::string AgentSession::SocketFor(const std::string& agent_socket) {
  const size_t slash = agent_socket.rfind('/');
  return (slash == std::string::npos ? std::string(".") : agent_socket.substr(0, slash)) + "/session.sock";
}

absl::StatusOr<std::unique_ptr<AgentSession>> AgentSession::Open(const std::string& socket_path,
                                                                 const std::string& resume_id,
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
  const std::string hello = resume_id.empty() ? "HELLO 1" : absl::StrCat("HELLO 1 ", resume_id);
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
  if (head.size() != 3 || head[0] != "OK" || !absl::SimpleAtoi(head[2], &count) || count != fds.size() ||
      lines.size() != count + 1) {
    close_fds();
    return absl::InternalError(absl::StrCat("malformed session reply from the agent: \"", lines[0], "\""));
  }
  s->id_ = head[1];
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

AgentSession::~AgentSession() {
  for (const Pool& p : pools_) ::close(p.fd);
  if (fd_ >= 0) ::close(fd_);
}

bool AgentSession::Closed() const {
  pollfd p{fd_, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLHUP | POLLERR | POLLRDHUP | POLLIN)) != 0;
}

}  // namespace ckpt::client
