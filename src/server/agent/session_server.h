// SessionServer: the unix socket `<run-dir>/session.sock` a local client
// keeps open for as long as it runs (docs/agent.md "Client sessions").
//
// On connect the agent hands the client the memory tier's pool file itself
// (its descriptor, with SCM_RIGHTS), so a trainer needs nothing of the
// agent's file system but the socket directory: its own mount, PID and IPC
// namespaces (a container without hostPID or the agent's volumes) work. The
// connection is also the client's liveness: the leases and handles of a
// session live while it is open (no ttl, no pid look-ups, which mean nothing
// across PID namespaces); when it closes (the client exited, crashed or was
// killed) they are released after a grace period, during which the client may
// reconnect and resume the session.
//
// Protocol (SOCK_SEQPACKET, one message per line of text):
//   client -> agent   "HELLO <v>" or "HELLO <v> <session-id>" (resume), v 1 or 2
//   agent -> client   "OK <session-id> <n>[ open]\n" then n lines
//                     "<pool path>\t<bytes>\t<st_dev>\t<st_ino>\n", with the n
//                     pool descriptors attached (SCM_RIGHTS), or "ERR <why>"
// after which a version-1 client sends nothing; the agent only watches for
// hang-up. " open" (to a version-2 hello, when a request handler is set)
// says the client may send requests on the connection, one at a time:
//   client -> agent   "<KIND>\n" + a serialized request (one message, at
//                     most kMaxRequestBytes): KIND "OPEN", an OpenShardRequest;
//                     "LEASE", an AcquireStagingLeaseRequest
//   agent -> client   "OK <bytes>\n", then the serialized response (the
//                     RPC's) in messages of at most kReplyChunkBytes; or
//                     "ERR <absl status code> <message>\n"
// docs/agent.md "Client sessions". A reply the client does not take within
// Options::reply_timeout closes the connection.
//
// Threads: ckpt-agent-sess (accepts, greets, reads) and, with a request
// handler, ckpt-agent-sreq (runs the handler and sends replies, so a slow
// one never holds up the others' greetings and hang-ups); both owned and
// joined by Stop(). The lock guards the session table and the request queue;
// socket I/O and the handler run without it.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace ckpt::agent {

struct PoolFile {
  std::string path;  // the name regions use for it
  int fd = -1;       // borrowed: must outlive the server
  uint64_t bytes = 0;
};

class SessionServer {
 public:
  static constexpr size_t kMaxRequestBytes = 64 << 10;
  static constexpr size_t kReplyChunkBytes = 64 << 10;
  // Answers one request ("OPEN" or "LEASE") of a session: the reply's
  // payload, or an error (sent as "ERR").
  using RequestHandler = std::function<absl::StatusOr<std::string>(
      const std::string& session_id, std::string_view kind, std::string_view request)>;
  struct Options {
    std::string socket_path;
    absl::Duration grace = absl::Seconds(10);
    size_t max_sessions = 4096;
    // >= 0: the socket file is given to this group (chown; Start fails if
    // the agent may not) and every connecting process is checked by its
    // kernel-reported credentials (SO_PEERCRED, SO_PEERGROUPS): root, the
    // agent's own user, and processes whose effective or supplementary
    // groups include it are served; others get "ERR" naming their uid and
    // gid, and a warning is logged. -1: the socket's mode (0660) alone.
    int64_t allowed_gid = -1;
    // A reply the client does not take within this closes its connection.
    absl::Duration reply_timeout = absl::Seconds(5);
  };
  // Listens on `options.socket_path` (mode 0660, replacing a stale socket).
  // `on_ended(session_id)` runs on the session thread once a closed
  // session's grace has passed (without the server's lock).
  static absl::StatusOr<std::unique_ptr<SessionServer>> Start(Options options, std::vector<PoolFile> pools,
                                                              Clock* clock,
                                                              std::function<void(const std::string&)> on_ended);
  ~SessionServer();  // Stop()
  // Closes the socket and every session (without calling on_ended), joins.
  void Stop();

  // Serves the requests of version-2 sessions greeted from now on with
  // `handler`; null stops serving them and waits for a call in progress.
  void SetRequestHandler(RequestHandler handler);

  // True while the session's connection is open or within its grace.
  bool Alive(const std::string& session_id) const;
  // Known and open (not closing).
  bool Open(const std::string& session_id) const;
  size_t open_sessions() const;
  const std::string& socket_path() const { return options_.socket_path; }

 private:
  SessionServer(Options options, std::vector<PoolFile> pools, Clock* clock,
                std::function<void(const std::string&)> on_ended);
  void Loop();
  void Accept();
  // Reads the client's hello and answers it; false if the connection is done.
  bool Greet(int fd);
  // Empty if the peer on `fd` may have a session (Options::allowed_gid),
  // else why not.
  std::string RefusePeer(int fd) const;
  void Hangup(int fd);
  void ExpireClosed();
  // A greeted connection sent something: a request of a version-2 session
  // is queued for the request thread; anything else is ignored.
  void Read(int fd);
  void ServeRequests();

  struct Request {
    int fd = -1;  // a dup of the connection, closed once answered
    std::string session_id;
    std::string kind;  // "OPEN", "LEASE"
    std::string body;  // after "<kind>\n"; empty with `error` set
    absl::Status error;
  };

  const Options options_;
  const std::vector<PoolFile> pools_;
  Clock* const clock_;
  const std::function<void(const std::string&)> on_ended_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: Stop wakes the loop
  std::thread thread_;
  std::thread request_thread_;

  struct Session {
    int fd = -1;           // -1 once the connection closed
    absl::Time closed_at;  // when it closed
  };
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::string> by_fd_ ABSL_GUARDED_BY(mu_);  // greeted connections
  std::vector<int> pending_ ABSL_GUARDED_BY(mu_);          // connected, hello not yet read
  std::set<int> v2_ ABSL_GUARDED_BY(mu_);                  // greeted with "HELLO 2" and told " open"
  RequestHandler handler_ ABSL_GUARDED_BY(mu_);
  int handler_calls_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<Request> requests_ ABSL_GUARDED_BY(mu_);
  std::string read_buf_;  // the session thread's
};

}  // namespace ckpt::agent
