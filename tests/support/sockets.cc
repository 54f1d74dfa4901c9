#include "support/sockets.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/file_system.h"

namespace ckpt::testing {
namespace {

// Inodes of the sockets among /proc/<pid>/fd.
absl::StatusOr<std::set<uint64_t>> SocketInodes(pid_t pid) {
  const std::string dir = absl::StrCat("/proc/", pid, "/fd");
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) return PosixErrorToStatus(ec.value(), "list", dir);
  std::set<uint64_t> inodes;
  for (const auto& entry : it) {
    std::error_code lec;
    const std::string target = std::filesystem::read_symlink(entry.path(), lec).string();
    if (lec) continue;  // closed meanwhile
    constexpr std::string_view kPrefix = "socket:[";
    if (target.rfind(kPrefix, 0) != 0 || target.back() != ']') continue;
    uint64_t inode = 0;
    if (absl::SimpleAtoi(target.substr(kPrefix.size(), target.size() - kPrefix.size() - 1), &inode)) {
      inodes.insert(inode);
    }
  }
  return inodes;
}

absl::StatusOr<std::vector<std::string>> ReadLines(const std::string& path) {
  std::ifstream in(path);
  if (!in) return PosixErrorToStatus(errno, "open", path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

uint32_t HexU32(std::string_view s) {
  uint32_t v = 0;
  for (char c : s) v = v * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(c)) ? c - '0'
                                                                                                    : (c | 0x20) - 'a' + 10);
  return v;
}

// "0100007F:1CF2" (IPv4) or 32 hex digits ":" port (IPv6), as the kernel
// prints them: each 32-bit word in host byte order.
void ParseProcAddress(std::string_view field, bool v6, ListeningSocket* out) {
  const size_t colon = field.find(':');
  const std::string_view hex = field.substr(0, colon);
  out->port = static_cast<int>(HexU32(field.substr(colon + 1)));
  char text[INET6_ADDRSTRLEN] = {};
  if (!v6) {
    in_addr a{};
    a.s_addr = HexU32(hex);  // already in network order when stored as-is
    inet_ntop(AF_INET, &a, text, sizeof(text));
    out->address = text;
    out->ipv6 = false;
    return;
  }
  in6_addr a{};
  for (int w = 0; w < 4; ++w) {
    const uint32_t word = HexU32(hex.substr(8 * w, 8));
    std::memcpy(&a.s6_addr[4 * w], &word, 4);
  }
  if (IN6_IS_ADDR_V4MAPPED(&a)) {
    in_addr v4{};
    std::memcpy(&v4.s_addr, &a.s6_addr[12], 4);
    inet_ntop(AF_INET, &v4, text, sizeof(text));
    out->address = text;
    out->ipv6 = false;
    return;
  }
  inet_ntop(AF_INET6, &a, text, sizeof(text));
  out->address = text;
  out->ipv6 = true;
}

absl::Status AddTcp(pid_t pid, bool v6, const std::set<uint64_t>& inodes, std::vector<ListeningSocket>* out) {
  absl::StatusOr<std::vector<std::string>> lines = ReadLines(absl::StrCat("/proc/", pid, "/net/", v6 ? "tcp6" : "tcp"));
  if (!lines.ok()) return lines.status();
  for (size_t i = 1; i < lines->size(); ++i) {
    std::vector<std::string> f = absl::StrSplit((*lines)[i], ' ', absl::SkipEmpty());
    if (f.size() < 10 || f[3] != "0A") continue;  // 0A: LISTEN
    uint64_t inode = 0;
    if (!absl::SimpleAtoi(f[9], &inode) || !inodes.count(inode)) continue;
    ListeningSocket s;
    s.kind = ListeningSocket::Kind::kTcp;
    ParseProcAddress(f[1], v6, &s);
    out->push_back(s);
  }
  return absl::OkStatus();
}

absl::Status AddUnix(pid_t pid, const std::set<uint64_t>& inodes, std::vector<ListeningSocket>* out) {
  absl::StatusOr<std::vector<std::string>> lines = ReadLines(absl::StrCat("/proc/", pid, "/net/unix"));
  if (!lines.ok()) return lines.status();
  // Num RefCount Protocol Flags Type St Inode [Path]
  for (size_t i = 1; i < lines->size(); ++i) {
    std::vector<std::string> f = absl::StrSplit((*lines)[i], ' ', absl::SkipEmpty());
    if (f.size() < 8) continue;  // unbound: no path
    uint64_t inode = 0;
    if (!absl::SimpleAtoi(f[6], &inode) || !inodes.count(inode)) continue;
    const uint32_t flags = HexU32(f[3]);
    const uint32_t type = HexU32(f[4]);
    ListeningSocket s;
    s.address = f[7];
    if (type == SOCK_STREAM && (flags & 0x10000)) {  // __SO_ACCEPTCON: listening
      s.kind = ListeningSocket::Kind::kUnixStream;
    } else if (type == SOCK_SEQPACKET && (flags & 0x10000)) {
      s.kind = ListeningSocket::Kind::kUnixSeqpacket;
    } else if (type == SOCK_DGRAM) {
      s.kind = ListeningSocket::Kind::kUnixDatagram;
    } else {
      continue;  // an accepted or connecting stream socket
    }
    out->push_back(s);
  }
  return absl::OkStatus();
}

// A socket connected (stream) or addressed (datagram) to `target`.
absl::StatusOr<int> Open(const ListeningSocket& target, sockaddr_storage* addr, socklen_t* len) {
  std::memset(addr, 0, sizeof(*addr));
  int family = AF_INET, type = SOCK_STREAM;
  if (target.kind == ListeningSocket::Kind::kTcp) {
    if (!target.ipv6) {
      auto* a = reinterpret_cast<sockaddr_in*>(addr);
      a->sin_family = AF_INET;
      a->sin_port = htons(static_cast<uint16_t>(target.port));
      if (target.address == "0.0.0.0") {
        a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      } else if (inet_pton(AF_INET, target.address.c_str(), &a->sin_addr) != 1 ||
                 (ntohl(a->sin_addr.s_addr) >> 24) != 127) {
        return absl::FailedPreconditionError(absl::StrCat(target.ToString(), " is not on loopback"));
      }
      *len = sizeof(sockaddr_in);
    } else {
      family = AF_INET6;
      auto* a = reinterpret_cast<sockaddr_in6*>(addr);
      a->sin6_family = AF_INET6;
      a->sin6_port = htons(static_cast<uint16_t>(target.port));
      if (target.address == "::") {
        a->sin6_addr = in6addr_loopback;
      } else if (inet_pton(AF_INET6, target.address.c_str(), &a->sin6_addr) != 1 ||
                 !IN6_IS_ADDR_LOOPBACK(&a->sin6_addr)) {
        return absl::FailedPreconditionError(absl::StrCat(target.ToString(), " is not on loopback"));
      }
      *len = sizeof(sockaddr_in6);
    }
  } else {
    family = AF_UNIX;
    type = target.kind == ListeningSocket::Kind::kUnixStream      ? SOCK_STREAM
           : target.kind == ListeningSocket::Kind::kUnixSeqpacket ? SOCK_SEQPACKET
                                                                  : SOCK_DGRAM;
    auto* a = reinterpret_cast<sockaddr_un*>(addr);
    a->sun_family = AF_UNIX;
    std::string path = target.address;
    if (!path.empty() && path[0] == '@') path[0] = '\0';  // abstract
    if (path.size() >= sizeof(a->sun_path)) return absl::InvalidArgumentError("unix path too long");
    std::memcpy(a->sun_path, path.data(), path.size());
    *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + (path[0] == '\0' ? 0 : 1));
  }
  const int fd = socket(family, type | SOCK_CLOEXEC, 0);
  if (fd < 0) return PosixErrorToStatus(errno, "socket", target.ToString());
  if (type != SOCK_DGRAM && connect(fd, reinterpret_cast<sockaddr*>(addr), *len) != 0) {
    const int err = errno;
    close(fd);
    if (err == ECONNREFUSED) return absl::UnavailableError(absl::StrCat("connect to ", target.ToString(), " refused"));
    return PosixErrorToStatus(err, "connect", target.ToString());
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  return fd;
}

}  // namespace

std::string ListeningSocket::ToString() const {
  switch (kind) {
    case Kind::kTcp:
      return ipv6 ? absl::StrCat("tcp [", address, "]:", port) : absl::StrCat("tcp ", address, ":", port);
    case Kind::kUnixStream:
      return absl::StrCat("unix-stream ", address);
    case Kind::kUnixSeqpacket:
      return absl::StrCat("unix-seqpacket ", address);
    case Kind::kUnixDatagram:
      return absl::StrCat("unix-dgram ", address);
  }
  return "?";
}

absl::StatusOr<std::vector<ListeningSocket>> ListeningSockets(pid_t pid) {
  absl::StatusOr<std::set<uint64_t>> inodes = SocketInodes(pid);
  if (!inodes.ok()) return inodes.status();
  std::vector<ListeningSocket> out;
  for (bool v6 : {false, true}) {
    if (absl::Status s = AddTcp(pid, v6, *inodes, &out); !s.ok()) return s;
  }
  if (absl::Status s = AddUnix(pid, *inodes, &out); !s.ok()) return s;
  return out;
}

absl::StatusOr<GarbageResult> SendGarbage(const ListeningSocket& target, std::string_view bytes,
                                          absl::Duration wait_for_close) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  absl::StatusOr<int> opened = Open(target, &addr, &len);
  if (!opened.ok()) return opened.status();
  const int fd = *opened;
  GarbageResult result;
  const absl::Time deadline = absl::Now() + wait_for_close;
  if (target.kind == ListeningSocket::Kind::kUnixDatagram) {
    for (size_t off = 0; off < bytes.size();) {
      const size_t n = std::min<size_t>(bytes.size() - off, 64 << 10);
      const ssize_t w = sendto(fd, bytes.data() + off, n, MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&addr), len);
      if (w < 0) break;  // the receiver's queue is full (or it is gone): enough
      result.bytes_sent += w;
      off += w;
    }
    close(fd);
    return result;
  }
  char buf[16384];
  size_t off = 0;
  bool writing = !bytes.empty();
  while (absl::Now() < deadline) {
    pollfd p{fd, static_cast<short>(POLLIN | (writing ? POLLOUT : 0)), 0};
    const int wait_ms = static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - absl::Now())));
    if (poll(&p, 1, wait_ms) <= 0) continue;
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t r = recv(fd, buf, sizeof(buf), 0);
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
        result.closed_by_peer = true;
        break;
      }
      if (r > 0) result.bytes_received += r;
    }
    if (writing && (p.revents & POLLOUT)) {
      // Records of a seqpacket socket must fit the socket buffer.
      const size_t n = target.kind == ListeningSocket::Kind::kUnixSeqpacket
                           ? std::min<size_t>(bytes.size() - off, 64 << 10)
                           : bytes.size() - off;
      const ssize_t w = send(fd, bytes.data() + off, n, MSG_NOSIGNAL);
      if (w < 0 && errno != EAGAIN && errno != EINTR) {
        // EPIPE / ECONNRESET: the peer closed on us mid-write.
        result.closed_by_peer = true;
        break;
      }
      if (w > 0) {
        off += w;
        result.bytes_sent += w;
        writing = off < bytes.size();
      }
    }
  }
  close(fd);
  return result;
}

std::string SeededRandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

std::vector<NamedBytes> GarbagePayloads(uint64_t seed) {
  std::vector<NamedBytes> out;
  for (size_t n : {size_t{16}, size_t{4} << 10, size_t{64} << 10, size_t{1} << 20}) {
    const std::string size = n >= (1 << 20) ? absl::StrCat(n >> 20, "MiB") : n >= 1024 ? absl::StrCat(n >> 10, "KiB")
                                                                                        : absl::StrCat(n, "B");
    out.push_back({"zeros " + size, std::string(n, '\0')});
    out.push_back({"random " + size, SeededRandomBytes(n, seed + n)});
  }
  // The first 18 of the preface's 24 bytes: a gRPC-style server waits for more.
  out.push_back({"partial HTTP/2 preface", std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").substr(0, 18)});
  return out;
}

}  // namespace ckpt::testing
