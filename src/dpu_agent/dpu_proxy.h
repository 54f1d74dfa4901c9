// DpuProxy: the host side of a DPU agent's control path (docs/dpu.md
// "Control path: a host-side socket proxy"), run by ckpt-dpu-proxy.
//
// Trainers on the host talk gRPC in plaintext HTTP/2 to <run-dir>/agent.sock,
// as they would to a host agent. The proxy accepts each connection there and
// opens one TCP connection to the DPU agent's gRPC port (--listen on the
// DPU), which serves mutual TLS only: it speaks TLS 1.2+ with ALPN "h2" (what
// gRPC requires), presents the host's node certificate (ckpt://node/<host>)
// and checks the DPU's: signed by the CA, a node certificate that names this
// host (ckpt://host/<host>, `ckptctl certs create-node --host-node`) and, if
// given, the DPU's node id. Then it copies bytes both ways until either side
// closes. The DPU agent takes trainer calls from that host certificate only
// (server/rpc/authorize.h); the socket's group decides which local processes
// may make them, as agent.sock does for a host agent.
//
//   trainer ──h2c── agent.sock ──[DpuProxy]──TLS(h2, node cert)── DPU :7401
//
// The proxy does not parse HTTP/2; it carries one trainer connection on one
// TLS connection, so gRPC's flow control, keepalives and deadlines work end
// to end. A refused or failed upstream closes the trainer's connection (the
// client sees UNAVAILABLE and retries); the reason is logged.
//
// Threads: one accept thread (ckpt-proxy-acc) and one per connection
// (ckpt-proxy-io), each pumping both directions with poll() on non-blocking
// sockets (one thread per TLS object: OpenSSL's SSL is not safe for a reader
// and a writer at once). No lock is held across I/O. Connections are bounded
// (max_connections; beyond it a new one is closed at once and logged).
//
// Start ignores SIGPIPE process-wide (OpenSSL writes to the socket with
// write(); a peer gone must be an error, not a signal).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics.h"

namespace ckpt::dpu {

struct DpuProxyOptions {
  // The unix socket trainers connect to (the host's <run-dir>/agent.sock).
  // Created exclusively: a stale socket nobody serves is replaced, a live one
  // or anything that is not a socket is an error. Mode 0660 (created 0600
  // and then opened to the group: common/unix_socket.h). Its directory is
  // created (0755) if missing.
  std::string socket_path;
  // >= 0: the socket's group, and only processes of that group (effective,
  // or supplementary as SO_PEERGROUPS reports), root and the proxy's own
  // user are served (SO_PEERCRED); others are closed and logged. -1: the
  // socket's mode alone (the proxy's group).
  int socket_gid = -1;
  // host:port of the DPU agent's gRPC port ([v6]:port for IPv6).
  std::string dpu_address;
  // The DPU's node id; "" accepts any node certificate that names this host.
  std::string dpu_node;
  // PEM files: the CA, the host's node certificate chain and its key.
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  // Certificate revocation lists (PEM files in this directory, e.g. from
  // `ckptctl certs revoke`): a DPU whose certificate one revokes is refused.
  // "": none.
  std::string tls_crl_dir;
  size_t max_connections = 256;
  // Where the counters below are registered (ckpt_dpu_proxy_*, docs/dpu.md,
  // "Control path"); must outlive the proxy. nullptr: none (stats() only).
  MetricsRegistry* metrics = nullptr;
  // TCP connect plus TLS handshake with the DPU, per connection.
  absl::Duration connect_timeout = absl::Seconds(10);
};

class DpuProxy {
 public:
  struct Stats {
    uint64_t accepted = 0;          // trainer connections served (upstream attempted)
    uint64_t refused_full = 0;      // closed: max_connections reached
    uint64_t refused_peer = 0;      // closed: not in the socket group
    uint64_t upstream_failed = 0;   // the DPU unreachable, the handshake or its certificate refused
    uint64_t active = 0;            // connections open now
  };

  // Checks the options and TLS files (the certificate must be a host's node
  // certificate, ckpt://node/<id> naming no host of its own), creates the
  // socket and starts serving. InvalidArgument for bad options or files
  // (naming the flag), FailedPrecondition for a socket path in use,
  // Unavailable for system call failures.
  static absl::StatusOr<std::unique_ptr<DpuProxy>> Start(DpuProxyOptions options);

  ~DpuProxy();
  DpuProxy(const DpuProxy&) = delete;
  DpuProxy& operator=(const DpuProxy&) = delete;

  // Stops accepting, closes every connection (both sides), joins the threads
  // and removes the socket file. Idempotent.
  void Stop();

  // The host node id of the proxy's certificate.
  const std::string& host_node() const { return host_node_; }
  Stats stats() const;

 private:
  class TlsContext;
  explicit DpuProxy(DpuProxyOptions options);

  void AcceptLoop();
  void Serve(int client_fd, uint64_t id);
  // Why a connecting process may not use the socket ("" if it may).
  std::string RefusePeer(int fd) const;
  void ReapFinished();

  const DpuProxyOptions options_;
  std::string host_node_;
  std::string dpu_host_, dpu_port_;
  std::unique_ptr<TlsContext> tls_;
  int listen_fd_ = -1;
  int stop_fd_ = -1;  // eventfd: readable once Stop() began (never drained)
  int reap_fd_ = -1;  // eventfd: a connection thread finished
  std::thread acceptor_;
  std::atomic<bool> stopped_{false};

  mutable absl::Mutex mu_;
  std::map<uint64_t, std::thread> connections_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> finished_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
  // The same counts for Prometheus (null without options_.metrics).
  struct Meters {
    Counter* accepted = nullptr;
    Counter* refused_peer = nullptr;
    Counter* refused_full = nullptr;
    Counter* upstream_failed = nullptr;
    Gauge* active = nullptr;
  };
  Meters meters_;
};

}  // namespace ckpt::dpu
