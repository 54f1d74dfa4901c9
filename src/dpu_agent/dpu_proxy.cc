// The host-side socket proxy to a DPU agent; see dpu_proxy.h.
#include "dpu_agent/dpu_proxy.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/names.h"
#include "common/pki.h"
#include "common/unix_socket.h"

#ifndef SO_PEERGROUPS
#define SO_PEERGROUPS 59  // Linux 4.13; older headers lack the name
#endif

namespace ckpt::dpu {
namespace {

constexpr size_t kBufferBytes = 64 << 10;  // per direction and connection

std::string OpensslErrors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    absl::StrAppend(&out, out.empty() ? "" : "; ", buf);
  }
  return out.empty() ? "no detail from OpenSSL" : out;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// "host:port", "[v6]:port" -> host (no brackets), port.
absl::Status SplitAddress(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  uint32_t p = 0;
  if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(address.substr(colon + 1), &p) || p == 0 ||
      p > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dpu-address \"", address, "\" is not HOST:PORT (the DPU agent's --listen)"));
  }
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  *port = address.substr(colon + 1);
  return absl::OkStatus();
}

bool IsIpLiteral(const std::string& host) {
  in6_addr a6;
  in_addr a4;
  return ::inet_pton(AF_INET, host.c_str(), &a4) == 1 || ::inet_pton(AF_INET6, host.c_str(), &a6) == 1;
}

// Waits until `fd` is ready for `events`, the deadline passes (0) or stop_fd
// becomes readable (-1). 1 when ready.
int WaitFor(int fd, short events, int stop_fd, absl::Time deadline) {
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return 0;
    pollfd p[2] = {{fd, events, 0}, {stop_fd, POLLIN, 0}};
    const int n = ::poll(p, 2, static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 60000)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return 0;
    if (p[1].revents != 0) return -1;
    if (p[0].revents != 0) return 1;
  }
}

// A TCP connection to host:port within the deadline (non-blocking, with
// TCP_NODELAY: gRPC's frames are small and latency-bound).
absl::StatusOr<int> ConnectTcp(const std::string& host, const std::string& port, int stop_fd, absl::Time deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve \"", host, "\": ", ::gai_strerror(rc)));
  }
  std::string last = "no address";
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last = std::strerror(errno);
      continue;
    }
    int err = 0;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        const int w = WaitFor(fd, POLLOUT, stop_fd, deadline);
        socklen_t len = sizeof(err);
        if (w <= 0) {
          err = w == 0 ? ETIMEDOUT : ECANCELED;
        } else if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
          err = errno;
        }
      }
    }
    if (err == 0) {
      ::freeaddrinfo(found);
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      return fd;
    }
    last = std::strerror(err);
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return absl::UnavailableError(absl::StrCat("cannot connect to ", host, ":", port, ": ", last));
}

// The ckpt identity of a PEM certificate file.
absl::StatusOr<pki::Identity> IdentityOfFile(const std::string& path) {
  return pki::IdentityOfCertificate(ReadFile(path));
}

struct Stamp {  // the CA, certificate and key files, and the CRL directory
  ino_t ino[4] = {};
  int64_t mtime_ns[4] = {};
  off_t size[4] = {};
  bool operator==(const Stamp& o) const {
    return std::equal(std::begin(ino), std::end(ino), std::begin(o.ino)) &&
           std::equal(std::begin(mtime_ns), std::end(mtime_ns), std::begin(o.mtime_ns)) &&
           std::equal(std::begin(size), std::end(size), std::begin(o.size));
  }
};

}  // namespace

// ---------------------------------------------------------------------------
// The client TLS context: CA, certificate chain and key, ALPN h2. Rebuilt
// for the next connection when one of the files changed (a renewed
// certificate needs no restart); a broken replacement is logged and the last
// good context kept.
class DpuProxy::TlsContext {
 public:
  TlsContext(std::string ca, std::string cert, std::string key, std::string crl_dir)
      : ca_(std::move(ca)), cert_(std::move(cert)), key_(std::move(key)), crl_dir_(std::move(crl_dir)) {}
  ~TlsContext() {
    if (ctx_ != nullptr) SSL_CTX_free(ctx_);
  }

  // Builds the first context; errors name the flag.
  absl::Status Init() {
    absl::StatusOr<SSL_CTX*> ctx = Build();
    if (!ctx.ok()) return ctx.status();
    absl::MutexLock lock(&mu_);
    ctx_ = *ctx;
    stamp_ = StampFiles();
    return absl::OkStatus();
  }

  // A new SSL object of the current context (nullptr on OpenSSL failure).
  SSL* NewSsl(const std::string& host_node) {
    const Stamp now = StampFiles();  // stat() without the lock
    {
      absl::MutexLock lock(&mu_);
      if (now == stamp_) return SSL_new(ctx_);
    }
    absl::StatusOr<SSL_CTX*> fresh = Build();  // reads the files without the lock
    if (fresh.ok()) {
      absl::StatusOr<pki::Identity> id = IdentityOfFile(cert_);
      if (!id.ok() || id->role != pki::Role::kNode || id->name != host_node || !id->host_node.empty()) {
        SSL_CTX_free(*fresh);
        fresh = absl::InvalidArgumentError(
            absl::StrCat("--tls-cert \"", cert_, "\" is no longer ckpt://node/", host_node, "'s certificate"));
      }
    }
    absl::MutexLock lock(&mu_);
    if (fresh.ok()) {
      log::Info("ckpt-dpu-proxy: TLS files changed; new connections use them");
      SSL_CTX_free(ctx_);
      ctx_ = *fresh;
    } else {
      log::Warn("ckpt-dpu-proxy: TLS files changed but cannot be used ({}); keeping the previous ones",
                std::string(fresh.status().message()));
    }
    stamp_ = now;
    return SSL_new(ctx_);
  }

 private:
  Stamp StampFiles() const {
    Stamp s;
    const std::string* files[4] = {&ca_, &cert_, &key_, &crl_dir_};
    for (int i = 0; i < 4; ++i) {
      if (files[i]->empty()) continue;
      struct stat st {};
      if (::stat(files[i]->c_str(), &st) == 0) {
        s.ino[i] = st.st_ino;
        s.mtime_ns[i] = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
        s.size[i] = st.st_size;
      }
    }
    return s;
  }

  absl::StatusOr<SSL_CTX*> Build() const {
    ERR_clear_error();
    SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
    if (ctx == nullptr) return absl::InternalError(absl::StrCat("SSL_CTX_new: ", OpensslErrors()));
    auto fail = [ctx](std::string what) {
      SSL_CTX_free(ctx);
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", OpensslErrors()));
    };
    if (SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION) != 1) return fail("TLS 1.2");
    if (SSL_CTX_load_verify_locations(ctx, ca_.c_str(), nullptr) != 1) {
      return fail(absl::StrCat("--tls-ca \"", ca_, "\" is not a PEM CA certificate"));
    }
    if (SSL_CTX_use_certificate_chain_file(ctx, cert_.c_str()) != 1) {
      return fail(absl::StrCat("--tls-cert \"", cert_, "\" is not a PEM certificate"));
    }
    EVP_PKEY* key = nullptr;
    if (BIO* bio = BIO_new_file(key_.c_str(), "r")) {
      key = PEM_read_bio_PrivateKey(bio, nullptr, nullptr, nullptr);
      BIO_free(bio);
    }
    if (key == nullptr) return fail(absl::StrCat("--tls-key \"", key_, "\" is not a PEM private key"));
    const bool used = SSL_CTX_use_PrivateKey(ctx, key) == 1;  // fails on a key of another certificate
    EVP_PKEY_free(key);
    if (!used || SSL_CTX_check_private_key(ctx) != 1) {
      return fail(absl::StrCat("--tls-key \"", key_, "\" does not belong to --tls-cert \"", cert_, "\""));
    }
    if (!crl_dir_.empty()) {
      // Every PEM CRL in the directory; with any, a certificate one revokes is
      // refused (and, as OpenSSL cannot tell a CA without a list from one
      // whose list is lost, so is every certificate of a CA without one).
      X509_STORE* store = SSL_CTX_get_cert_store(ctx);
      int crls = 0;
      std::error_code ec;
      for (const auto& entry : std::filesystem::directory_iterator(crl_dir_, ec)) {
        if (!entry.is_regular_file(ec)) continue;
        BIO* bio = BIO_new_file(entry.path().c_str(), "r");
        if (bio == nullptr) continue;
        while (X509_CRL* crl = PEM_read_bio_X509_CRL(bio, nullptr, nullptr, nullptr)) {
          if (X509_STORE_add_crl(store, crl) == 1) ++crls;
          X509_CRL_free(crl);
        }
        BIO_free(bio);
        ERR_clear_error();
      }
      if (ec) return fail(absl::StrCat("--tls-crl-dir \"", crl_dir_, "\" cannot be read (", ec.message(), ")"));
      if (crls > 0) X509_STORE_set_flags(store, X509_V_FLAG_CRL_CHECK);
    }
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);  // the DPU's certificate must chain to the CA
    static const unsigned char kAlpn[] = {2, 'h', '2'};  // HTTP/2, as gRPC requires
    if (SSL_CTX_set_alpn_protos(ctx, kAlpn, sizeof(kAlpn)) != 0) return fail("ALPN");
    SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    return ctx;
  }

  const std::string ca_, cert_, key_, crl_dir_;
  absl::Mutex mu_;
  SSL_CTX* ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
  Stamp stamp_ ABSL_GUARDED_BY(mu_);
};

// ---------------------------------------------------------------------------

DpuProxy::DpuProxy(DpuProxyOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<DpuProxy>> DpuProxy::Start(DpuProxyOptions options) {
  if (options.socket_path.empty()) return absl::InvalidArgumentError("--socket is required");
  if (options.socket_path.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("--socket \"", options.socket_path,
                                                   "\" is too long for a unix socket (max ",
                                                   sizeof(sockaddr_un::sun_path) - 1, " bytes)"));
  }
  if (options.max_connections == 0) return absl::InvalidArgumentError("--max-connections must be at least 1");
  if (options.tls_ca.empty() || options.tls_cert.empty() || options.tls_key.empty()) {
    return absl::InvalidArgumentError(
        "--tls-ca, --tls-cert and --tls-key are required: the DPU agent serves mutual TLS only; give the host's "
        "node certificate (`ckptctl certs create-node --node-id <host>`)");
  }
  if (!options.dpu_node.empty()) {
    if (absl::Status s = ValidateNodeId(options.dpu_node); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--dpu-node: ", s.message()));
    }
  }
  std::unique_ptr<DpuProxy> p(new DpuProxy(std::move(options)));
  const DpuProxyOptions& o = p->options_;
  if (absl::Status s = SplitAddress(o.dpu_address, &p->dpu_host_, &p->dpu_port_); !s.ok()) return s;

  // Our certificate: the host's node certificate (the DPU agent takes
  // trainer calls from its --host-node's certificate alone).
  absl::StatusOr<pki::Identity> own = IdentityOfFile(o.tls_cert);
  if (!own.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-cert \"", o.tls_cert, "\" carries no ckpt identity (",
                                                   own.status().message(),
                                                   "): give the host's node certificate (`ckptctl certs "
                                                   "create-node --node-id <host> --host ...`)"));
  }
  if (own->role != pki::Role::kNode || !own->host_node.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-cert \"", o.tls_cert, "\" is ckpt://", std::string(pki::RoleName(own->role)),
        own->name.empty() ? "" : "/", own->name,
        own->host_node.empty() ? "" : absl::StrCat(" (a DPU's, serving ", own->host_node, ")"),
        ": the proxy presents the host's node certificate (ckpt://node/<host>, the DPU agent's --host-node)"));
  }
  if (!o.dpu_node.empty() && o.dpu_node == own->name) {
    return absl::InvalidArgumentError("--dpu-node names the host itself: give the DPU's node id");
  }
  p->host_node_ = own->name;
  if (o.metrics != nullptr) {
    MetricsRegistry& m = *o.metrics;
    p->meters_.accepted = &m.AddCounter("ckpt_dpu_proxy_connections_total",
                                        "Trainer connections taken and carried to the DPU agent (attempted)");
    p->meters_.refused_peer = &m.AddCounter("ckpt_dpu_proxy_refused_total",
                                            "Trainer connections closed unserved, by reason",
                                            {{"reason", "socket_group"}});
    p->meters_.refused_full = &m.AddCounter("ckpt_dpu_proxy_refused_total",
                                            "Trainer connections closed unserved, by reason",
                                            {{"reason", "max_connections"}});
    p->meters_.upstream_failed = &m.AddCounter(
        "ckpt_dpu_proxy_upstream_failed_total",
        "Connections not forwarded: the DPU agent unreachable, or its handshake or certificate refused");
    p->meters_.active = &m.AddGauge("ckpt_dpu_proxy_connections_active", "Trainer connections open now");
  }
  p->tls_ = std::make_unique<TlsContext>(o.tls_ca, o.tls_cert, o.tls_key, o.tls_crl_dir);
  if (absl::Status s = p->tls_->Init(); !s.ok()) return s;

  // OpenSSL writes to sockets with write(): a DPU that hung up must be an
  // EPIPE, not a SIGPIPE that ends the process.
  ::signal(SIGPIPE, SIG_IGN);

  // The socket: its directory, a stale socket replaced, a live one refused.
  const std::string& path = o.socket_path;
  const std::string dir = std::filesystem::path(path).parent_path().string();
  if (!dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return absl::UnavailableError(absl::StrCat("create the socket's directory \"", dir, "\": ", ec.message()));
  }
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("--socket \"", path, "\" exists and is not a socket: remove it or choose another path"));
    }
    const int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.c_str(), path.size());
    const bool live = probe >= 0 && ::connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (probe >= 0) ::close(probe);
    if (live) {
      return absl::FailedPreconditionError(absl::StrCat(
          "another process is serving \"", path, "\" (an agent or another proxy); stop it or choose another --socket"));
    }
    ::unlink(path.c_str());
  }
  p->listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (p->listen_fd_ < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  if (absl::Status s = RestrictSocketBeforeBind(p->listen_fd_); !s.ok()) return s;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  // bind() creates the file exclusively (EADDRINUSE if anything appeared
  // there since).
  if (::bind(p->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(absl::StrCat("bind \"", path, "\": ", std::strerror(errno)));
  }
  if (absl::Status s = OpenSocketToGroup(path, o.socket_gid); !s.ok()) {
    ::unlink(path.c_str());
    return s;
  }
  if (::listen(p->listen_fd_, 128) != 0) {
    ::unlink(path.c_str());
    return absl::UnavailableError(absl::StrCat("listen \"", path, "\": ", std::strerror(errno)));
  }
  p->stop_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  p->reap_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (p->stop_fd_ < 0 || p->reap_fd_ < 0) {
    ::unlink(path.c_str());
    return absl::UnavailableError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  p->acceptor_ = std::thread([raw = p.get()] { raw->AcceptLoop(); });
  log::Info("ckpt-dpu-proxy: unix:{} -> {} (TLS as ckpt://node/{}, expecting {} serving host {}, at most {} "
            "connections)",
            path, o.dpu_address, p->host_node_, o.dpu_node.empty() ? "any DPU node" : "ckpt://node/" + o.dpu_node,
            p->host_node_, o.max_connections);
  return p;
}

DpuProxy::~DpuProxy() {
  Stop();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (stop_fd_ >= 0) ::close(stop_fd_);
  if (reap_fd_ >= 0) ::close(reap_fd_);
}

void DpuProxy::Stop() {
  if (stopped_.exchange(true)) return;
  if (stop_fd_ >= 0) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(stop_fd_, &one, sizeof(one));
  }
  if (acceptor_.joinable()) acceptor_.join();  // joins every connection thread
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
    ::unlink(options_.socket_path.c_str());
  }
}

DpuProxy::Stats DpuProxy::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

std::string DpuProxy::RefusePeer(int fd) const {
  return PeerOutsideGroup(fd, options_.socket_gid,
                          absl::StrCat("the socket group ", options_.socket_gid, " (ckpt-dpu-proxy --socket-group)"));
}

void DpuProxy::ReapFinished() {
  std::vector<std::thread> done;
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t id : finished_) {
      auto it = connections_.find(id);
      if (it == connections_.end()) continue;
      done.push_back(std::move(it->second));
      connections_.erase(it);
    }
    finished_.clear();
  }
  for (std::thread& t : done) t.join();  // each has returned or is returning
}

void DpuProxy::AcceptLoop() {
  pthread_setname_np(pthread_self(), "ckpt-proxy-acc");
  uint64_t next_id = 0;
  for (;;) {
    pollfd p[3] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}, {reap_fd_, POLLIN, 0}};
    const int n = ::poll(p, 3, -1);
    if (n < 0 && errno != EINTR) {
      log::Error("ckpt-dpu-proxy: poll: {}", std::strerror(errno));
      break;
    }
    if (n <= 0) continue;
    if (p[1].revents != 0) break;
    if (p[2].revents != 0) {
      uint64_t count = 0;
      [[maybe_unused]] ssize_t r = ::read(reap_fd_, &count, sizeof(count));
      ReapFinished();
    }
    if (p[0].revents == 0) continue;
    for (;;) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) break;  // EAGAIN: all taken
      if (const std::string why = RefusePeer(fd); !why.empty()) {
        log::Warn("ckpt-dpu-proxy: refused a connection on {}: {}", options_.socket_path, why);
        ::close(fd);
        absl::MutexLock lock(&mu_);
        ++stats_.refused_peer;
        if (meters_.refused_peer != nullptr) meters_.refused_peer->Increment();
        continue;
      }
      absl::MutexLock lock(&mu_);
      if (stats_.active >= options_.max_connections) {
        ++stats_.refused_full;
        if (meters_.refused_full != nullptr) meters_.refused_full->Increment();
        if (stats_.refused_full == 1 || stats_.refused_full % 100 == 0) {
          log::Warn("ckpt-dpu-proxy: {} connections open (--max-connections): closed a new one ({} so far)",
                    options_.max_connections, stats_.refused_full);
        }
        ::close(fd);
        continue;
      }
      ++stats_.accepted;
      ++stats_.active;
      if (meters_.accepted != nullptr) {
        meters_.accepted->Increment();
        meters_.active->Increment();
      }
      const uint64_t id = next_id++;
      connections_.emplace(id, std::thread([this, fd, id] { Serve(fd, id); }));
    }
  }
  // Stopping: every connection thread sees stop_fd_ and returns.
  std::map<uint64_t, std::thread> all;
  {
    absl::MutexLock lock(&mu_);
    all.swap(connections_);
  }
  for (auto& [id, t] : all) t.join();
  absl::MutexLock lock(&mu_);
  finished_.clear();
}

namespace {

// One trainer connection and its TLS connection to the DPU agent.
class Pump {
 public:
  Pump(int client_fd, int stop_fd) : client_(client_fd), stop_(stop_fd) {}
  ~Pump() {
    if (ssl_ != nullptr) SSL_free(ssl_);
    if (tcp_ >= 0) ::close(tcp_);
    ::close(client_);
  }

  // TCP connect, TLS handshake, the DPU's certificate and ALPN checked.
  absl::Status Connect(SSL* ssl, const std::string& host, const std::string& port, const std::string& host_node,
                       const std::string& dpu_node, absl::Duration timeout) {
    ssl_ = ssl;
    if (ssl_ == nullptr) return absl::InternalError(absl::StrCat("SSL_new: ", OpensslErrors()));
    const absl::Time deadline = absl::Now() + timeout;
    absl::StatusOr<int> fd = ConnectTcp(host, port, stop_, deadline);
    if (!fd.ok()) return fd.status();
    tcp_ = *fd;
    if (SSL_set_fd(ssl_, tcp_) != 1) return absl::InternalError(absl::StrCat("SSL_set_fd: ", OpensslErrors()));
    if (!IsIpLiteral(host)) SSL_set_tlsext_host_name(ssl_, host.c_str());
    for (;;) {
      ERR_clear_error();
      const int r = SSL_connect(ssl_);
      if (r == 1) break;
      const int e = SSL_get_error(ssl_, r);
      short want = 0;
      if (e == SSL_ERROR_WANT_READ) want = POLLIN;
      if (e == SSL_ERROR_WANT_WRITE) want = POLLOUT;
      if (want == 0) {
        const long v = SSL_get_verify_result(ssl_);
        return absl::UnavailableError(absl::StrCat(
            "TLS handshake with ", host, ":", port, " failed: ",
            v != X509_V_OK ? absl::StrCat("the DPU's certificate: ", X509_verify_cert_error_string(v))
                           : OpensslErrors()));
      }
      const int w = WaitFor(tcp_, want, stop_, deadline);
      if (w == 0) {
        return absl::DeadlineExceededError(absl::StrCat("TLS handshake with ", host, ":", port, " timed out"));
      }
      if (w < 0) return absl::CancelledError("stopping");
    }
    const unsigned char* alpn = nullptr;
    unsigned int alpn_len = 0;
    SSL_get0_alpn_selected(ssl_, &alpn, &alpn_len);
    if (alpn_len != 2 || std::memcmp(alpn, "h2", 2) != 0) {
      return absl::UnavailableError(
          absl::StrCat(host, ":", port, " did not agree to HTTP/2 (ALPN h2): is it a DPU agent's gRPC port?"));
    }
    X509* peer = SSL_get1_peer_certificate(ssl_);
    if (peer == nullptr) return absl::UnavailableError("the DPU presented no certificate");
    std::string pem;
    if (BIO* bio = BIO_new(BIO_s_mem())) {
      if (PEM_write_bio_X509(bio, peer) == 1) {
        char* data = nullptr;
        const long n = BIO_get_mem_data(bio, &data);
        if (n > 0) pem.assign(data, static_cast<size_t>(n));
      }
      BIO_free(bio);
    }
    X509_free(peer);
    absl::StatusOr<pki::Identity> id = pki::IdentityOfCertificate(pem);
    if (!id.ok()) {
      return absl::PermissionDeniedError(
          absl::StrCat("the DPU's certificate carries no ckpt identity: ", id.status().message()));
    }
    const std::string who = absl::StrCat("ckpt://", std::string(pki::RoleName(id->role)),
                                         id->name.empty() ? "" : "/", id->name);
    if (id->role != pki::Role::kNode || id->host_node != host_node) {
      return absl::PermissionDeniedError(absl::StrCat(
          host, ":", port, " is ", who,
          id->host_node.empty() ? std::string(", which names no host")
                                : absl::StrCat(", serving host ", id->host_node),
          ": a DPU agent of this host has a node certificate naming ckpt://host/", host_node,
          " (ckptctl certs create-node --host-node ", host_node, ")"));
    }
    if (!dpu_node.empty() && id->name != dpu_node) {
      return absl::PermissionDeniedError(
          absl::StrCat(host, ":", port, " is ", who, ", not ckpt://node/", dpu_node, " (--dpu-node)"));
    }
    dpu_ = id->name;
    return absl::OkStatus();
  }

  const std::string& dpu() const { return dpu_; }

  // Copies both ways until either side closes (what it sent is passed on
  // first), an error, or stop. Returns why it ended, for the log.
  std::string Run() {
    std::vector<char> up(kBufferBytes), down(kBufferBytes);
    size_t up_len = 0, up_off = 0, down_len = 0, down_off = 0;
    bool client_eof = false, tls_eof = false;
    for (;;) {
      bool progress = false;
      bool tls_wants_read = false, tls_wants_write = false, client_wants_write = false;
      // trainer -> buffer
      if (!client_eof && up_len == 0) {
        const ssize_t n = ::read(client_, up.data(), up.size());
        if (n > 0) {
          up_len = static_cast<size_t>(n);
          up_off = 0;
          progress = true;
        } else if (n == 0) {
          client_eof = true;
          progress = true;
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          return absl::StrCat("trainer side: ", std::strerror(errno));
        }
      }
      // buffer -> DPU
      if (up_len > 0) {
        ERR_clear_error();
        const int r = SSL_write(ssl_, up.data() + up_off, static_cast<int>(up_len));
        if (r > 0) {
          up_off += static_cast<size_t>(r);
          up_len -= static_cast<size_t>(r);
          progress = true;
        } else {
          const int e = SSL_get_error(ssl_, r);
          if (e == SSL_ERROR_WANT_READ) {
            tls_wants_read = true;
          } else if (e == SSL_ERROR_WANT_WRITE) {
            tls_wants_write = true;
          } else {
            return absl::StrCat("DPU side (write): ", TlsError(e));
          }
        }
      }
      // DPU -> buffer
      if (!tls_eof && down_len == 0) {
        ERR_clear_error();
        const int r = SSL_read(ssl_, down.data(), static_cast<int>(down.size()));
        if (r > 0) {
          down_len = static_cast<size_t>(r);
          down_off = 0;
          progress = true;
        } else {
          const int e = SSL_get_error(ssl_, r);
          if (e == SSL_ERROR_WANT_READ) {
            tls_wants_read = true;
          } else if (e == SSL_ERROR_WANT_WRITE) {
            tls_wants_write = true;
          } else if (e == SSL_ERROR_ZERO_RETURN || (e == SSL_ERROR_SYSCALL && ERR_peek_error() == 0)) {
            tls_eof = true;  // close_notify, or the connection closed
            progress = true;
          } else {
            return absl::StrCat("DPU side (read): ", TlsError(e));
          }
        }
      }
      // buffer -> trainer
      if (down_len > 0) {
        const ssize_t n = ::send(client_, down.data() + down_off, down_len, MSG_NOSIGNAL);
        if (n > 0) {
          down_off += static_cast<size_t>(n);
          down_len -= static_cast<size_t>(n);
          progress = true;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
          client_wants_write = true;
        } else {
          return absl::StrCat("trainer side: ", std::strerror(errno));
        }
      }
      if (client_eof && up_len == 0) {
        SSL_shutdown(ssl_);  // close_notify, best effort
        return "the trainer closed its connection";
      }
      if (tls_eof && down_len == 0) return "the DPU agent closed the connection";
      if (progress) continue;
      pollfd p[3] = {{client_, 0, 0}, {tcp_, 0, 0}, {stop_, POLLIN, 0}};
      if (!client_eof && up_len == 0) p[0].events |= POLLIN;
      if (client_wants_write) p[0].events |= POLLOUT;
      if (tls_wants_read) p[1].events |= POLLIN;
      if (tls_wants_write) p[1].events |= POLLOUT;
      // A side not waited on is left out: its POLLHUP would wake the loop
      // with nothing to do (the next read or write on it says what happened).
      if (p[0].events == 0) p[0].fd = -1;
      if (p[1].events == 0) p[1].fd = -1;
      const int n = ::poll(p, 3, -1);
      if (n < 0 && errno != EINTR) return absl::StrCat("poll: ", std::strerror(errno));
      if (p[2].revents != 0) return "the proxy is stopping";
    }
  }

 private:
  static std::string TlsError(int e) {
    if (e == SSL_ERROR_SYSCALL) return absl::StrCat("connection error (", std::strerror(errno), ")");
    return OpensslErrors();
  }

  const int client_;
  const int stop_;
  int tcp_ = -1;
  SSL* ssl_ = nullptr;
  std::string dpu_;
};

}  // namespace

void DpuProxy::Serve(int client_fd, uint64_t id) {
  pthread_setname_np(pthread_self(), "ckpt-proxy-io");
  {
    Pump pump(client_fd, stop_fd_);
    absl::Status s = pump.Connect(tls_->NewSsl(host_node_), dpu_host_, dpu_port_, host_node_, options_.dpu_node,
                                  options_.connect_timeout);
    if (!s.ok()) {
      if (!absl::IsCancelled(s)) {
        log::Warn("ckpt-dpu-proxy: connection {}: not forwarded to {}: {}", id, options_.dpu_address,
                  std::string(s.message()));
      }
      absl::MutexLock lock(&mu_);
      ++stats_.upstream_failed;
      if (meters_.upstream_failed != nullptr) meters_.upstream_failed->Increment();
    } else {
      log::Debug("ckpt-dpu-proxy: connection {} forwarded to {} (ckpt://node/{})", id, options_.dpu_address,
                 pump.dpu());
      const std::string why = pump.Run();
      log::Debug("ckpt-dpu-proxy: connection {} closed: {}", id, why);
    }
  }  // both sockets closed here
  {
    absl::MutexLock lock(&mu_);
    finished_.push_back(id);
    --stats_.active;
    if (meters_.active != nullptr) meters_.active->Decrement();
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(reap_fd_, &one, sizeof(one));
}

}  // namespace ckpt::dpu
