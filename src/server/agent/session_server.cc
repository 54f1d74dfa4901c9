#include "server/agent/session_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/crypto.h"
#include "common/lock_check.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "common/unix_socket.h"

#ifndef SO_PEERGROUPS
#define SO_PEERGROUPS 59  // Linux 4.13; older headers lack the name
#endif

namespace ckpt::agent {
namespace {

constexpr size_t kMaxMessage = 512;
constexpr absl::Duration kHelloTimeout = absl::Seconds(5);

// 128 random bits, hex (the client names its session with it: it must not
// be guessable).
std::string NewSessionId() { return RandomId(""); }

// A session id as logs show it: too short to resume or name the session.
std::string ForLog(const std::string& id) { return id.size() <= 8 ? id : id.substr(0, 8) + "..."; }

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

bool ValidSessionId(const std::string& id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace

SessionServer::SessionServer(Options options, std::vector<PoolFile> pools, Clock* clock,
                             std::function<void(const std::string&)> on_ended)
    : options_(std::move(options)), pools_(std::move(pools)), clock_(clock), on_ended_(std::move(on_ended)) {}

absl::StatusOr<std::unique_ptr<SessionServer>> SessionServer::Start(Options options, std::vector<PoolFile> pools,
                                                                    Clock* clock,
                                                                    std::function<void(const std::string&)> on_ended) {
  sockaddr_un addr{};
  if (options.socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("session socket path '", options.socket_path, "' is too long"));
  }
  std::unique_ptr<SessionServer> s(new SessionServer(std::move(options), std::move(pools), clock, std::move(on_ended)));
  s->listen_fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (s->listen_fd_ < 0) return Errno("session socket");
  // Created owner-only, opened to the group before anyone can connect
  // (listen comes last): common/unix_socket.h.
  CKPT_RETURN_IF_ERROR(RestrictSocketBeforeBind(s->listen_fd_));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, s->options_.socket_path.c_str(), s->options_.socket_path.size());
  ::unlink(s->options_.socket_path.c_str());  // a stale socket of an earlier agent
  if (::bind(s->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return Errno(absl::StrCat("bind '", s->options_.socket_path, "'"));
  }
  CKPT_RETURN_IF_ERROR(OpenSocketToGroup(s->options_.socket_path, s->options_.allowed_gid));
  if (::listen(s->listen_fd_, 128) != 0) return Errno("listen on the session socket");
  s->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (s->wake_fd_ < 0) return Errno("eventfd");
  s->thread_ = std::thread([raw = s.get()] {
    pthread_setname_np(pthread_self(), "ckpt-agent-sess");
    raw->Loop();
  });
  s->request_thread_ = std::thread([raw = s.get()] {
    pthread_setname_np(pthread_self(), "ckpt-agent-sreq");
    raw->ServeRequests();
  });
  return s;
}

SessionServer::~SessionServer() {
  Stop();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void SessionServer::Stop() {
  {
    CheckedLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  if (request_thread_.joinable()) request_thread_.join();
  CheckedLock lock(&mu_);
  for (const auto& [fd, id] : by_fd_) ::close(fd);
  for (int fd : pending_) ::close(fd);
  for (const Request& r : requests_) ::close(r.fd);
  by_fd_.clear();
  pending_.clear();
  v2_.clear();
  requests_.clear();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
    ::unlink(options_.socket_path.c_str());
  }
}

void SessionServer::SetRequestHandler(RequestHandler handler) {
  CheckedLock lock(&mu_);
  handler_ = std::move(handler);
  if (handler_ == nullptr) {
    mu_.Await(absl::Condition(
        +[](int* calls) { return *calls == 0; }, &handler_calls_));
  }
}

bool SessionServer::Alive(const std::string& session_id) const {
  CheckedLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return false;
  return it->second.fd >= 0 || clock_->MonotonicNow() - it->second.closed_at < options_.grace;
}

bool SessionServer::Open(const std::string& session_id) const {
  CheckedLock lock(&mu_);
  auto it = sessions_.find(session_id);
  return it != sessions_.end() && it->second.fd >= 0;
}

size_t SessionServer::open_sessions() const {
  CheckedLock lock(&mu_);
  return by_fd_.size();
}

void SessionServer::Loop() {
  std::map<int, absl::Time> pending_since;
  while (true) {
    std::vector<pollfd> fds;
    fds.push_back(pollfd{wake_fd_, POLLIN, 0});
    fds.push_back(pollfd{listen_fd_, POLLIN, 0});
    {
      CheckedLock lock(&mu_);
      if (stopping_) return;
      for (int fd : pending_) fds.push_back(pollfd{fd, POLLIN, 0});
      for (const auto& [fd, id] : by_fd_) fds.push_back(pollfd{fd, POLLIN | POLLRDHUP, 0});
    }
    const int n = ::poll(fds.data(), fds.size(), 200);
    if (n < 0 && errno != EINTR) {
      log::Error("session socket: poll failed: {}", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;  // Stop
    if (fds[1].revents & POLLIN) Accept();
    const absl::Time now = clock_->MonotonicNow();
    for (size_t i = 2; i < fds.size(); ++i) {
      const int fd = fds[i].fd;
      bool greeted;
      {
        CheckedLock lock(&mu_);
        greeted = by_fd_.count(fd) != 0;
      }
      if (!greeted) {
        if (!pending_since.count(fd)) pending_since[fd] = now;
        if (fds[i].revents == 0 && now - pending_since[fd] < kHelloTimeout) continue;
        pending_since.erase(fd);
        {
          CheckedLock lock(&mu_);
          std::erase(pending_, fd);
        }
        if (fds[i].revents == 0 || !Greet(fd)) ::close(fd);
        continue;
      }
      if (fds[i].revents & POLLIN) {
        Read(fd);  // (a request sent just before the hang-up is still read)
      } else if (fds[i].revents & (POLLHUP | POLLERR | POLLRDHUP)) {
        Hangup(fd);
      }
    }
    ExpireClosed();
  }
}

void SessionServer::Read(int fd) {
  read_buf_.resize(kMaxRequestBytes + 1);
  const ssize_t got = ::recv(fd, read_buf_.data(), read_buf_.size(), MSG_DONTWAIT | MSG_TRUNC);
  if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
    Hangup(fd);
    return;
  }
  if (got < 0) return;
  Request r;
  {
    CheckedLock lock(&mu_);
    auto id = by_fd_.find(fd);
    // Anything else a greeted client sends is ignored (version 1: it sends
    // nothing after the hello).
    if (id == by_fd_.end() || !v2_.count(fd) || handler_ == nullptr) return;
    const std::string_view m(read_buf_.data(), std::min(static_cast<size_t>(got), read_buf_.size()));
    const size_t nl = m.find('\n');
    const std::string_view kind = nl == std::string_view::npos ? std::string_view() : m.substr(0, nl);
    if (static_cast<size_t>(got) > kMaxRequestBytes) {
      r.error = absl::InvalidArgumentError(
          absl::StrCat("a session request is at most ", kMaxRequestBytes, " bytes; this one has ", got));
    } else if (kind != "OPEN" && kind != "LEASE") {
      r.error = absl::InvalidArgumentError(
          "unknown session request: expected \"OPEN\\n\" or \"LEASE\\n\" and the serialized request");
    } else {
      r.kind = std::string(kind);
      r.body = std::string(m.substr(nl + 1));
    }
    if (requests_.size() >= 4 * options_.max_sessions) return;  // a flood: the client times out
    r.fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);  // answered on its own descriptor: a hang-up may close `fd` first
    if (r.fd < 0) return;
    r.session_id = id->second;
    requests_.push_back(std::move(r));
  }
}

namespace {

// Sends one message within `deadline` (the socket is non-blocking).
bool SendMessage(int fd, std::string_view m, absl::Time deadline) {
  while (true) {
    if (::send(fd, m.data(), m.size(), MSG_NOSIGNAL | MSG_DONTWAIT) == static_cast<ssize_t>(m.size())) return true;
    if (errno != EAGAIN && errno != EINTR) return false;
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) return false;
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, static_cast<int>(left)) < 0 && errno != EINTR) return false;
  }
}

}  // namespace

void SessionServer::ServeRequests() {
  while (true) {
    Request r;
    RequestHandler handler;
    {
      CheckedLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(
                               +[](SessionServer* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
                                 return s->stopping_ || !s->requests_.empty();
                               },
                               this),
                           absl::Seconds(1));
      if (stopping_) return;
      if (requests_.empty()) continue;
      r = std::move(requests_.front());
      requests_.pop_front();
      handler = handler_;
      if (handler != nullptr) ++handler_calls_;
    }
    absl::StatusOr<std::string> answer = absl::UnavailableError("the agent no longer serves session requests");
    if (!r.error.ok()) {
      answer = r.error;
    } else if (handler != nullptr) {
      answer = handler(r.session_id, r.kind, r.body);
    }
    if (handler != nullptr) {
      CheckedLock lock(&mu_);
      --handler_calls_;
    }
    const absl::Time deadline = absl::Now() + options_.reply_timeout;
    bool sent;
    if (answer.ok()) {
      sent = SendMessage(r.fd, absl::StrCat("OK ", answer->size(), "\n"), deadline);
      for (size_t at = 0; sent && at < answer->size(); at += kReplyChunkBytes) {
        sent = SendMessage(r.fd, std::string_view(*answer).substr(at, kReplyChunkBytes), deadline);
      }
    } else {
      std::string why(answer.status().message());
      std::replace(why.begin(), why.end(), '\n', ' ');
      sent = SendMessage(r.fd, absl::StrCat("ERR ", static_cast<int>(answer.status().code()), " ", why, "\n"),
                         deadline);
    }
    if (!sent) {
      // Half a reply would leave the stream out of step: the connection
      // ends (the session's grace begins; the client opens a new one).
      log::Warn("session {}: the client did not take its reply within {}; closing the connection", ForLog(r.session_id),
                absl::FormatDuration(options_.reply_timeout));
      ::shutdown(r.fd, SHUT_RDWR);
    }
    ::close(r.fd);
  }
}

void SessionServer::Accept() {
  while (true) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    CheckedLock lock(&mu_);
    if (sessions_.size() + pending_.size() >= options_.max_sessions) {
      ::close(fd);  // refuse: the table is full
      continue;
    }
    pending_.push_back(fd);
  }
}

std::string SessionServer::RefusePeer(int fd) const {
  return PeerOutsideGroup(fd, options_.allowed_gid,
                          absl::StrCat("the agent's socket group ", options_.allowed_gid, " (ckpt-agent --socket-group)"));
}

bool SessionServer::Greet(int fd) {
  auto refuse = [fd](const std::string& why) {
    const std::string msg = absl::StrCat("ERR ", why, "\n");
    [[maybe_unused]] ssize_t n = ::send(fd, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    return false;
  };
  char buf[kMaxMessage];
  const ssize_t got = ::recv(fd, buf, sizeof(buf) - 1, MSG_DONTWAIT | MSG_TRUNC);
  if (got <= 0) return false;
  // After the hello is read: a socket closed with unread data resets the
  // connection, and the client would not see why.
  if (const std::string why = RefusePeer(fd); !why.empty()) {
    log::Warn("session socket: refused a client: {}", why);
    return refuse(why);
  }
  if (static_cast<size_t>(got) >= sizeof(buf)) return refuse("hello message too long");
  std::string hello(buf, static_cast<size_t>(got));
  while (!hello.empty() && (hello.back() == '\n' || hello.back() == '\r')) hello.pop_back();
  const std::vector<std::string> words = absl::StrSplit(hello, ' ');
  if (words.size() < 2 || words.size() > 3 || words[0] != "HELLO" || (words[1] != "1" && words[1] != "2")) {
    return refuse("expected \"HELLO 1 [session-id]\" or \"HELLO 2 [session-id]\"");
  }
  bool serves_requests = false;
  std::string id;
  {
    CheckedLock lock(&mu_);
    if (words.size() == 3 && ValidSessionId(words[2])) {
      auto it = sessions_.find(words[2]);
      if (it != sessions_.end() && it->second.fd >= 0) return refuse("session is in use by another connection");
      if (it != sessions_.end()) id = words[2];  // resumed within its grace
    }
    if (id.empty()) {
      do {
        id = NewSessionId();
      } while (sessions_.count(id) != 0);
    }
    sessions_[id] = Session{fd, absl::InfinitePast()};
    by_fd_[fd] = id;
    serves_requests = words[1] == "2" && handler_ != nullptr;
    if (serves_requests) v2_.insert(fd);
  }
  std::string reply = absl::StrCat("OK ", id, " ", pools_.size(), serves_requests ? " open" : "", "\n");
  std::vector<int> fds;
  for (const PoolFile& p : pools_) {
    struct stat st {};
    ::fstat(p.fd, &st);
    absl::StrAppend(&reply, p.path, "\t", p.bytes, "\t", static_cast<uint64_t>(st.st_dev), "\t",
                    static_cast<uint64_t>(st.st_ino), "\n");
    fds.push_back(p.fd);
  }
  iovec iov{reply.data(), reply.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  if (::sendmsg(fd, &msg, MSG_NOSIGNAL) < 0) {
    log::Warn("session socket: cannot answer a client: {}", std::strerror(errno));
    CheckedLock lock(&mu_);
    sessions_.erase(id);
    by_fd_.erase(fd);
    v2_.erase(fd);
    return false;
  }
  log::Debug("client session {} opened", ForLog(id));
  return true;
}

void SessionServer::Hangup(int fd) {
  {
    CheckedLock lock(&mu_);
    auto it = by_fd_.find(fd);
    if (it == by_fd_.end()) return;
    auto s = sessions_.find(it->second);
    if (s != sessions_.end()) {
      s->second.fd = -1;
      s->second.closed_at = clock_->MonotonicNow();
      log::Info("client session {} closed; its leases and handles go in {}", ForLog(it->second),
                absl::FormatDuration(options_.grace));
    }
    by_fd_.erase(it);
    v2_.erase(fd);
  }
  ::close(fd);
}

void SessionServer::ExpireClosed() {
  std::vector<std::string> ended;
  {
    CheckedLock lock(&mu_);
    const absl::Time now = clock_->MonotonicNow();
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      if (it->second.fd < 0 && now - it->second.closed_at >= options_.grace) {
        ended.push_back(it->first);
        it = sessions_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const std::string& id : ended) on_ended_(id);
}

}  // namespace ckpt::agent
