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
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
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

std::string NewSessionId() {
  std::random_device rd;
  return absl::StrFormat("%08x%08x%08x%08x", rd(), rd(), rd(), rd());
}

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
  CheckedLock lock(&mu_);
  for (const auto& [fd, id] : by_fd_) ::close(fd);
  for (int fd : pending_) ::close(fd);
  by_fd_.clear();
  pending_.clear();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
    ::unlink(options_.socket_path.c_str());
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
      if (fds[i].revents & (POLLHUP | POLLERR | POLLRDHUP)) {
        Hangup(fd);
      } else if (fds[i].revents & POLLIN) {
        char buf[kMaxMessage];
        const ssize_t got = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) Hangup(fd);
        // Anything a greeted client sends is ignored.
      }
    }
    ExpireClosed();
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
  if (options_.allowed_gid < 0) return "";
  const auto allowed = static_cast<gid_t>(options_.allowed_gid);
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return absl::StrCat("cannot read the peer's credentials: ", std::strerror(errno));
  }
  if (cred.uid == 0 || cred.uid == ::geteuid() || cred.gid == allowed) return "";
  // The supplementary groups the process had when it connected.
  std::vector<gid_t> groups(64);
  socklen_t glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
  int rc = ::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen);
  if (rc != 0 && errno == ERANGE) {
    groups.resize(glen / sizeof(gid_t));
    rc = ::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen);
  }
  if (rc == 0) {
    groups.resize(glen / sizeof(gid_t));
    if (std::find(groups.begin(), groups.end(), allowed) != groups.end()) return "";
  }
  return absl::StrCat("uid ", cred.uid, " gid ", cred.gid, " (pid ", cred.pid,
                      ") is not in the agent's socket group ", allowed, " (ckpt-agent --socket-group)");
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
  if (words.size() < 2 || words.size() > 3 || words[0] != "HELLO" || words[1] != "1") {
    return refuse("expected \"HELLO 1 [session-id]\"");
  }
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
  }
  std::string reply = absl::StrCat("OK ", id, " ", pools_.size(), "\n");
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
    return false;
  }
  log::Debug("client session {} opened", id);
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
      log::Info("client session {} closed; its leases and handles go in {}", it->second,
                absl::FormatDuration(options_.grace));
    }
    by_fd_.erase(it);
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
