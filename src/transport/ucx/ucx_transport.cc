#include "transport/ucx/ucx_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/endian.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "transport/ucx/handshake.h"
#include "transport/ucx/message_auth.h"
#include "transport/ucx/node_identity.h"

namespace ckpt::transport {
namespace {

// Active message ids. Every message starts with the receiver's PeerId for
// the connection (8 bytes, little-endian, random), which tells the receiver
// which connection it belongs to; it is accepted only on the UCX endpoint
// that connection's handshake completed on (Peer::bound_ep).
constexpr unsigned kAmId = 0;        // [receiver id][u16 type][application header] + payload
constexpr unsigned kHelloAmId = 1;   // connecting -> accepting side: [receiver id][its nonce][proof]
constexpr unsigned kReadyAmId = 2;   // accepting -> connecting side: [receiver id][its nonce][proof]
// (the proof, ucx_wire::kProofBytes, only with UcxOptions::auth_key)
constexpr size_t kIdBytes = 8;
constexpr size_t kTypeBytes = sizeof(uint16_t);
constexpr size_t kDataPrefixBytes = kIdBytes + kTypeBytes;
// On a keyed connection (message_auth.h): [receiver id][u16 type][u8 flags]
// [u64 seq][application header][payload tag][header tag] + payload.
constexpr size_t kSealedPrefixBytes = kDataPrefixBytes + 1 + 8;
constexpr size_t kSealedSuffixBytes = 2 * ucx_wire::kTagBytes;
constexpr uint8_t kEncryptedFlag = 0x01;  // the payload is AES-256-GCM ciphertext
// Encryption buffers kept for reuse (first touch of fresh memory is slow).
constexpr size_t kMaxPooledScratchBytes = size_t{256} << 20;
constexpr size_t kHelloBytes = 2 * kIdBytes;
constexpr int kMaxAcceptsPerRound = 64;
constexpr size_t kReadChunk = 4096;
constexpr char kNoKeyYet[] =
    "this agent has no data-plane key yet (it gets it from ckpt-meta when it registers); "
    "the connection is refused until then";

std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

std::string ErrnoText(int err) { return std::strerror(err); }


// "host:port" -> IPv4 sockaddr. Port 0 is allowed (listen picks one).
absl::Status ParseAddress(const std::string& address, bool passive, sockaddr_in* out) {
  const size_t colon = address.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("UCX data-plane address must be \"host:port\", got \"", address, "\""));
  }
  const std::string host = address.substr(0, colon);
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve \"", host, "\": ", gai_strerror(rc)));
  }
  std::memcpy(out, res->ai_addr, sizeof(sockaddr_in));
  freeaddrinfo(res);
  out->sin_port = htons(static_cast<uint16_t>(port));
  return absl::OkStatus();
}

std::string SockaddrText(const sockaddr_in& a) {
  char ip[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &a.sin_addr, ip, sizeof(ip));
  return absl::StrCat(ip, ":", ntohs(a.sin_port));
}

bool IsLoopback(const sockaddr_in& a) { return (ntohl(a.sin_addr.s_addr) >> 24) == 127; }

// The name of the interface that carries 127.0.0.1 ("lo"), or "" if none.
std::string LoopbackInterface() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string name;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET && (i->ifa_flags & IFF_LOOPBACK)) {
      name = i->ifa_name;
      break;
    }
  }
  freeifaddrs(list);
  return name;
}

// The liveness channel must notice a peer that vanished without closing
// (power loss, partition) even though nothing is ever sent on it.
void SetKeepalive(int fd) {
  const int on = 1, idle_s = 10, interval_s = 2, probes = 3;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
}

void CloseFd(int* fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

class UcxImpl;

struct ConnectWait {
  absl::Notification done;
  absl::Status status;  // written before done.Notify()
  PeerId id = 0;
};

enum class PeerState {
  kTcpHandshake,  // greeting records being swapped on the TCP connection (handshake.h)
  kUcxHello,      // endpoint(s) created; waiting for the other side's UCX message
  kConnected,     // usable both ways; the handler may know its id
};

// UCX workers (and their contexts) that Stop could not destroy (Shutdown):
// left to the process's exit, reachable from here.
void KeepUntilExit(ucp_context_h context, ucp_worker_h worker) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* kept = new std::vector<std::pair<ucp_context_h, ucp_worker_h>>();
  absl::MutexLock lock(&mu);
  kept->emplace_back(context, worker);
}

// The UCX endpoint to one remote worker, shared by every connection (Peer)
// with that worker, outbound and inbound alike, and closed when the last of
// them goes. One endpoint per worker pair matters: UCX pairs the endpoints two
// workers create to each other by a per-pair sequence number, not by which
// connection they were made for, so with an endpoint per connection the
// other side's endpoint for connection X could be paired with ours for
// connection Y, and closing Y would silently break X. Lives in remotes_ until
// Stop (the raw pointer is the endpoint's error-callback argument).
struct Remote {
  UcxImpl* owner = nullptr;
  std::string worker_address;
  ucp_ep_h ep = nullptr;  // null once closed
  int refs = 0;           // connections (Peers) using it that have not failed
};

// What a sender needs to seal messages of one keyed connection
// (message_auth.h). Shared between the progress thread, which makes it when
// the connection is connected and drops it when it fails, and the threads
// that call Send, which seal their messages themselves (the payload's tag,
// or its encryption, costs a pass over the bytes: better there than on the
// one thread that drives UCX).
struct SendCrypto {
  uint64_t receiver_id = 0;  // the other side's id for the connection
  std::string mac_key;
  std::string aes_key;
  std::atomic<uint64_t> seq{0};  // the last sequence number taken
  std::string peer_identity;     // what the other side proved ("": no identities)
};

// One connection, outbound (Connect) or inbound (accepted on the data port).
// A peer that ever had a Remote lives in peers_ until Stop (sends in flight
// point to it); one that failed before it had one is dropped at once.
struct Peer {
  PeerId id = 0;
  std::string address;  // outbound: "host:port"; inbound: "inbound from ip:port"
  bool inbound = false;
  PeerState state = PeerState::kTcpHandshake;
  int fd = -1;                  // TCP: handshake, then liveness channel
  bool tcp_connecting = false;  // outbound: connect() still in progress
  std::string out;              // bytes still to write on fd
  size_t out_offset = 0;
  ucx_wire::GreetingReader reader;  // kTcpHandshake: the other side's next greeting record
  uint64_t nonce = 0;               // ours: the other side echoes it
  uint64_t remote_id = 0;           // the other side's PeerId: prefixes every message we send
  uint64_t remote_nonce = 0;
  std::string remote_worker;  // inbound: the connecting side's address, until its hello
  absl::Time deadline = absl::InfiniteFuture();  // inbound: handshake must finish by then
  Remote* remote = nullptr;  // set once the UCX endpoint exists; holds a ref until failed
  // Our UCX endpoint that the other side's hello (inbound) or ready
  // (outbound) arrived on, as UCX reports it (reply_ep): every later
  // message for this connection must arrive on it too.
  ucp_ep_h bound_ep = nullptr;
  bool failed = false;
  absl::Status fail_status;              // what sends still in flight complete with
  std::shared_ptr<ConnectWait> connect;  // set while Connect() waits
  bool silent = false;                   // Start's self-check: never reported to the handler
  bool handshaking = false;              // inbound, counted in inbound_handshakes_
  // The cluster key as it was when this connection's handshake started
  // (UcxTransport::SetAuthKey does not change it); "": no authentication.
  std::string key;
  // With node identities (UcxOptions::identity): ours as they were when the
  // handshake started, the exchange while it runs, and what it proved.
  std::shared_ptr<const NodeCredentials> creds;
  std::unique_ptr<IdentityExchange> exchange;
  std::string peer_identity;    // "ckpt://node/<id>", once its signature checked
  std::string identity_secret;  // the X25519 secret, mixed into the message keys
  // With a key, from the moment it is connected: the keys its messages are
  // checked with (message_auth.h) and the sequence numbers taken so far.
  // (The sending side's are in UcxImpl::send_crypto_.)
  std::string recv_mac_key;
  std::unique_ptr<ucx_wire::PayloadSealer> recv_sealer;
  ucx_wire::ReplayWindow received;
};

// An accepted TCP connection whose greeting has not arrived yet. Not a Peer:
// garbage connections come and go without leaving anything behind.
struct Pending {
  int fd = -1;
  std::string from;
  std::string key;  // the cluster key when it was accepted ("": none)
  std::shared_ptr<const NodeCredentials> creds;  // ours then, with identities
  ucx_wire::GreetingReader reader;
  absl::Time deadline;
};

struct SendOp {
  ~SendOp();  // hands `scratch` back to the owner's pool
  UcxImpl* owner = nullptr;
  Peer* peer = nullptr;
  bool sealed = false;            // a keyed connection's message, sealed by Send
  std::string am_header;          // must outlive the send (UCX 1.13)
  std::vector<ucp_dt_iov_t> iov;  // ditto
  std::vector<std::byte> scratch;  // the encrypted (or tampered) payload, if any
  SendDone done;
};

struct RecvOp {
  UcxImpl* owner = nullptr;
  Inbound msg;
  std::vector<ucp_dt_iov_t> iov;
  // A keyed connection's message: its payload is checked (or decrypted) on
  // arrival, before OnReceived.
  bool sealed = false;
  bool encrypted = false;
  uint64_t seq = 0;
  std::string payload_tag;
};

// The buffer of a hello or ready message (must outlive the send).
struct ControlOp {
  std::string header;
};

class UcxImpl : public UcxTransport {
 public:
  explicit UcxImpl(const UcxOptions& options)
      : options_(options),
        event_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)),
        auth_key_(options.auth_key) {}
  ~UcxImpl() override {
    Stop();
    if (thread_.joinable()) thread_.join();  // Stop() was called from a callback
    if (event_fd_ >= 0) close(event_fd_);
  }

  absl::Status Start(const std::string& listen_address, Handler* handler) override {
    {
      absl::MutexLock lock(&mu_);
      if (started_ || stop_requested_) {
        return absl::FailedPreconditionError("UCX transport already started or stopped");
      }
    }
    sockaddr_in addr{};
    if (absl::Status s = ParseAddress(listen_address, true, &addr); !s.ok()) return s;
    if (event_fd_ < 0) return absl::UnavailableError("eventfd failed");
    handler_ = handler;
    // UCX ties a worker's async context to the thread that creates it, so the
    // progress thread creates, drives and destroys every UCX object.
    auto init = std::make_shared<ConnectWait>();
    thread_ = std::thread([this, init, addr, listen_address] {
      thread_id_ = std::this_thread::get_id();
      init->status = InitUcx(addr, listen_address);
      const bool ok = init->status.ok();
      if (ok) {
        absl::MutexLock lock(&mu_);
        started_ = true;
      }
      init->done.Notify();
      if (ok) Run();
      DestroyUcx();
    });
    init->done.WaitForNotification();
    if (!init->status.ok()) {
      thread_.join();
      log::Error("UCX transport cannot start on {}: {}", listen_address, init->status.ToString());
      return init->status;
    }
    return absl::OkStatus();
  }

  std::string address() const override { return address_; }

  absl::StatusOr<PeerId> Connect(const std::string& address, int64_t timeout_ms) override {
    sockaddr_in addr{};
    if (absl::Status s = ParseAddress(address, false, &addr); !s.ok()) return s;
    auto wait = std::make_shared<ConnectWait>();
    const bool posted = Post([this, wait, addr, address] { StartConnect(wait, addr, address); });
    if (!posted) return absl::UnavailableError(absl::StrCat("connect to ", address, ": transport stopped"));
    if (!wait->done.WaitForNotificationWithTimeout(absl::Milliseconds(timeout_ms))) {
      // Give up on the half-open connection; its late completion is ignored.
      Post([this, wait] { AbandonConnect(wait); });
      return absl::UnavailableError(
          absl::StrCat("connect to ", address, " timed out after ", timeout_ms, " ms"));
    }
    if (!wait->status.ok()) return wait->status;
    return wait->id;
  }

  void Send(PeerId peer, uint16_t type, std::string header, ConstPieces payload,
            SendDone done) override {
    SendNaming(peer, 0, TestTamper::kNone, type, std::move(header), std::move(payload), std::move(done));
  }

  ProgressRounds TEST_progress_rounds() const override {
    return {slept_rounds_.load(std::memory_order_relaxed), woken_rounds_.load(std::memory_order_relaxed)};
  }

  void TEST_SendTampered(PeerId via, uint64_t receiver_id, TestTamper tamper, uint16_t type, std::string header,
                         ConstPieces payload, SendDone done) override {
    SendNaming(via, receiver_id, tamper, type, std::move(header), std::move(payload), std::move(done));
  }

  void SetAuthKey(std::string key) override {
    bool changed = false;
    {
      absl::MutexLock lock(&mu_);
      changed = key != auth_key_;
      auth_key_ = std::move(key);
    }
    if (changed) log::Info("data plane: cluster key {}; new connections use it", CurrentKey().empty() ? "cleared" : "set");
  }

 private:
  // Send, except that a non-zero `receiver_id` replaces the id of the
  // connection at the other side in the message, and `tamper`
  // (TEST_SendTampered).
  void SendNaming(PeerId peer, uint64_t receiver_id, TestTamper tamper, uint16_t type, std::string header,
                  ConstPieces payload, SendDone done) {
    auto op = std::make_unique<SendOp>();
    op->owner = this;
    // The receiver's id (bytes 0-7) is filled in on the progress thread.
    op->am_header.assign(kDataPrefixBytes, '\0');
    op->am_header[kIdBytes] = static_cast<char>(type & 0xff);
    op->am_header[kIdBytes + 1] = static_cast<char>(type >> 8);
    op->am_header += header;
    for (const auto& p : payload) {
      if (!p.empty()) op->iov.push_back(ucp_dt_iov_t{const_cast<std::byte*>(p.data()), p.size()});
    }
    op->done = std::move(done);
    const size_t header_size = header.size();
    if (header_size <= kMaxHeaderBytes) {
      std::shared_ptr<SendCrypto> crypto;
      {
        absl::MutexLock lock(&crypto_mu_);
        auto it = send_crypto_.find(peer);
        if (it != send_crypto_.end()) crypto = it->second;
      }
      if (crypto != nullptr) Seal(*crypto, receiver_id, op.get(), tamper);
    }
    if (!op->sealed && tamper == TestTamper::kPayload) {
      std::vector<std::span<const std::byte>> pieces;
      for (const ucp_dt_iov_t& v : op->iov) pieces.emplace_back(static_cast<const std::byte*>(v.buffer), v.length);
      const uint64_t bytes = TotalBytes(pieces);
      if (bytes > 0) SendFromCopy(op.get(), bytes, &pieces, bytes / 2);
    }
    SendOp* raw = op.release();
    if (!Post([this, raw, peer, header_size, receiver_id, tamper] {
          StartSend(raw, peer, header_size, receiver_id, tamper);
        })) {
      std::unique_ptr<SendOp> owned(raw);
      owned->done(absl::CancelledError("UCX transport stopped"));
    }
  }

 public:
  void Disconnect(PeerId peer) override {
    Post([this, peer] {
      auto it = peers_.find(peer);
      if (it == peers_.end() || it->second->failed) return;
      Peer* p = it->second.get();
      FailPeer(p, absl::CancelledError(absl::StrCat("peer ", peer, " disconnected")));
      if (p->connect != nullptr) {
        FinishConnect(p, absl::CancelledError("disconnected while connecting"));
      } else {
        handler_->OnPeerFailed(peer, absl::CancelledError("disconnected"));
      }
    });
  }

  absl::Status RegisterMemory(void* base, size_t length) override {
    if (std::this_thread::get_id() == thread_id_) return MapMemory(base, length);
    auto wait = std::make_shared<ConnectWait>();
    if (!Post([this, wait, base, length] {
          wait->status = MapMemory(base, length);
          wait->done.Notify();
        })) {
      return absl::FailedPreconditionError("UCX transport is not running");
    }
    wait->done.WaitForNotification();
    return wait->status;
  }

  void Stop() override {
    {
      absl::MutexLock lock(&mu_);
      if (stop_requested_) return;
      stop_requested_ = true;
    }
    Wake();
    // From a Handler callback the thread cannot join itself: it stops once
    // the callback returns, and the destructor (elsewhere) joins it.
    if (std::this_thread::get_id() == thread_id_) return;
    if (thread_.joinable()) thread_.join();
  }

 private:
  // --- setup and teardown (progress thread, before Run and after it) ---

  absl::Status InitUcx(const sockaddr_in& addr, const std::string& listen_address) {
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return absl::UnavailableError(absl::StrCat("UCX config: ", UcsError(st)));
    bool net_devices_set = std::getenv("UCX_NET_DEVICES") != nullptr;
    bool tcp_rx_seg_set = std::getenv("UCX_TCP_RX_SEG_SIZE") != nullptr;
    for (const auto& [name, value] : options_.config) {
      st = ucp_config_modify(config, name.c_str(), value.c_str());
      if (st != UCS_OK) {
        ucp_config_release(config);
        return absl::InvalidArgumentError(
            absl::StrCat("UCX option ", name, "=", value, ": ", UcsError(st)));
      }
      if (name == "NET_DEVICES") net_devices_set = true;
      if (name == "TCP_RX_SEG_SIZE" || name == "RX_SEG_SIZE") tcp_rx_seg_set = true;
    }
    // With peer-failure handling UCX 1.13 moves rendezvous payloads over TCP
    // as active-message fragments of at most the receive segment (it uses
    // RMA lanes only where memory can be invalidated, which TCP cannot):
    // 512 KiB fragments instead of 64 KiB cost about 20% less CPU and bring
    // the throughput back to that of the old connection-manager endpoints.
    // (UCT takes the field name without the "TCP_" prefix; only tcp has it.)
    if (!tcp_rx_seg_set) (void)ucp_config_modify(config, "RX_SEG_SIZE", "512k");
    // A data plane asked to listen on loopback serves this host only: UCX's
    // TCP transport then listens on the loopback interface alone instead of
    // on every interface of the machine.
    if (IsLoopback(addr) && !net_devices_set) {
      const std::string lo = LoopbackInterface();
      if (!lo.empty() && ucp_config_modify(config, "NET_DEVICES", lo.c_str()) == UCS_OK) {
        log::Debug("UCX data plane on loopback: UCX_NET_DEVICES={}", lo);
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (st != UCS_OK) {
      context_ = nullptr;
      return absl::UnavailableError(absl::StrCat(
          "UCX cannot initialise (check UCX_TLS / UCX_NET_DEVICES): ", UcsError(st)));
    }
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches it
    st = ucp_worker_create(context_, &wp, &worker_);
    if (st != UCS_OK) {
      worker_ = nullptr;
      return absl::UnavailableError(absl::StrCat(
          "UCX cannot create a worker (no usable transport? check UCX_TLS): ", UcsError(st)));
    }
    st = ucp_worker_get_efd(worker_, &worker_fd_);
    if (st != UCS_OK) {
      return absl::UnavailableError(absl::StrCat("UCX worker has no event fd: ", UcsError(st)));
    }
    for (const auto& [id, cb] : {std::pair{kAmId, &UcxImpl::OnAm},
                                 std::pair{kHelloAmId, &UcxImpl::OnHello},
                                 std::pair{kReadyAmId, &UcxImpl::OnReady}}) {
      ucp_am_handler_param_t ap{};
      ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
      ap.id = id;
      ap.cb = cb;
      ap.arg = this;
      ap.flags = UCP_AM_FLAG_WHOLE_MSG;
      st = ucp_worker_set_am_recv_handler(worker_, &ap);
      if (st != UCS_OK) {
        return absl::UnavailableError(absl::StrCat("UCX active messages unavailable: ", UcsError(st)));
      }
    }
    ucp_address_t* worker_address = nullptr;
    size_t worker_address_length = 0;
    st = ucp_worker_get_address(worker_, &worker_address, &worker_address_length);
    if (st != UCS_OK) {
      return absl::UnavailableError(absl::StrCat("UCX worker has no address: ", UcsError(st)));
    }
    worker_address_.assign(reinterpret_cast<const char*>(worker_address), worker_address_length);
    ucp_worker_release_address(worker_, worker_address);
    if (worker_address_.empty() || worker_address_.size() > ucx_wire::kMaxWorkerAddressBytes) {
      return absl::UnavailableError(absl::StrCat("UCX worker address of ", worker_address_.size(),
                                                 " bytes does not fit the data-plane handshake (max ",
                                                 ucx_wire::kMaxWorkerAddressBytes, ")"));
    }
    if (absl::Status s = Listen(addr, listen_address); !s.ok()) return s;
    if (options_.self_check_timeout_ms > 0) {
      if (absl::Status s = SelfCheck(addr); !s.ok()) return s;
    }
    log::Debug("UCX data plane on {}: worker address of {} bytes", address_, worker_address_.size());
    return absl::OkStatus();
  }

  // The data port: a plain TCP socket that only ever speaks the handshake.
  absl::Status Listen(const sockaddr_in& addr, const std::string& listen_address) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (listen_fd_ < 0) return absl::UnavailableError(absl::StrCat("data-plane socket: ", ErrnoText(errno)));
    // A restarted agent listens again at once, while its old connections sit
    // in TIME_WAIT.
    const int on = 1;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    if (bind(listen_fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 ||
        listen(listen_fd_, 128) != 0) {
      const int err = errno;
      CloseFd(&listen_fd_);
      return absl::UnavailableError(absl::StrCat("cannot listen on ", listen_address, ": ", ErrnoText(err)));
    }
    sockaddr_in bound{};
    socklen_t len = sizeof(bound);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
    address_ = SockaddrText(bound);
    return absl::OkStatus();
  }

  // UCX picks transports per connection, so a bad UCX_TLS (e.g. "cma" alone)
  // only shows when connecting. Connecting to ourselves through the data
  // port at start-up turns that into a clear Start error instead of every
  // later Connect failing. (With UCX's "self" transport enabled, the UCX
  // part of this loop never leaves the worker.)
  absl::Status SelfCheck(const sockaddr_in& requested) {
    sockaddr_in addr{};
    socklen_t len = sizeof(addr);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    if (requested.sin_addr.s_addr == htonl(INADDR_ANY)) addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    probing_ = true;
    // The self-check connects to itself: with no key known yet (require_auth,
    // the key comes later from meta) it proves a throwaway one.
    probe_key_ = CurrentKey();
    if (probe_key_.empty() && KeyRequired()) probe_key_ = RandomKey();
    auto wait = std::make_shared<ConnectWait>();
    StartConnect(wait, addr, "self-check");
    const absl::Time deadline = absl::Now() + absl::Milliseconds(options_.self_check_timeout_ms);
    while (!wait->done.HasBeenNotified() && absl::Now() < deadline) PumpOnce(10);
    absl::Status result = wait->done.HasBeenNotified() ? wait->status
                                                       : absl::DeadlineExceededError("timed out");
    for (auto& [id, peer] : peers_) {
      peer->connect = nullptr;
      if (!peer->failed) FailPeer(peer.get(), absl::CancelledError("self-check done"));
    }
    for (auto& r : remotes_) CloseRemote(r.get(), /*force=*/false);
    for (Pending& p : pending_) CloseFd(&p.fd);
    pending_.clear();
    const absl::Time close_deadline = absl::Now() + absl::Milliseconds(options_.stop_timeout_ms);
    while (closing_ > 0 && absl::Now() < close_deadline) ProgressOrWait();
    peers_.clear();
    remote_by_address_.clear();
    remotes_.clear();
    deferred_accepts_.clear();
    probing_ = false;
    probe_key_.clear();
    if (!result.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "UCX found no transport that can carry messages (check UCX_TLS; e.g. cma needs "
          "posix or sysv too): self-check connection failed: ", result.ToString()));
    }
    return absl::OkStatus();
  }

  // One round of UCX progress, or a short sleep on the worker's fd if idle
  // (shutdown only: sockets are closed by then).
  // True if UCX did something (e.g. moved a fragment of a send).
  bool ProgressOrWait() {
    if (ucp_worker_progress(worker_) != 0) return true;
    if (ucp_worker_arm(worker_) != UCS_OK) return true;  // events are pending
    pollfd fd{worker_fd_, POLLIN, 0};
    poll(&fd, 1, 10);
    return false;
  }

  void DestroyUcx() {
    CloseFd(&listen_fd_);
    for (Pending& p : pending_) CloseFd(&p.fd);
    pending_.clear();
    for (auto& [id, peer] : peers_) CloseFd(&peer->fd);
    if (abandon_worker_) {
      // Shutdown could not finish UCX's operations: the worker (and with it
      // the context) is left to the process's exit and never progressed
      // again. Its sockets close at the exit; peers see the liveness
      // sockets above close now. Kept reachable, so leak checkers do not
      // report what the worker still holds.
      KeepUntilExit(context_, worker_);
      worker_ = nullptr;
      context_ = nullptr;
      return;
    }
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    worker_ = nullptr;
    if (context_ != nullptr) ucp_cleanup(context_);
    context_ = nullptr;
  }

  // --- command queue ---

  bool Post(std::function<void()> fn) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_requested_ || !started_) return false;
      queue_.push_back(std::move(fn));
    }
    Wake();
    return true;
  }

  void Wake() {
    if (event_fd_ < 0) return;
    const uint64_t one = 1;
    // A full counter (EAGAIN) still wakes the thread: nothing to handle.
    [[maybe_unused]] ssize_t n = write(event_fd_, &one, sizeof(one));
  }

  // --- progress thread ---

  void Run() {
    for (;;) {
      std::deque<std::function<void()>> batch;
      bool stop = false;
      {
        absl::MutexLock lock(&mu_);
        batch.swap(queue_);
        stop = stop_requested_;
      }
      for (auto& fn : batch) fn();
      if (stop) break;
      // The timeout only bounds how long UCX's own timers (keepalive) may
      // wait; all real work wakes one of the fds.
      round_slept_ = false;
      PumpOnce(1000);
      (round_slept_ ? slept_rounds_ : woken_rounds_).fetch_add(1, std::memory_order_relaxed);
    }
    Shutdown();
  }

  // UCX progress, then (if nothing is pending) one wait on the worker's fd,
  // the command eventfd, the data port and every handshake / liveness
  // socket, and the work they brought.
  void PumpOnce(int max_wait_ms) {
    RunDeferred();
    while (ucp_worker_progress(worker_) != 0) {
    }
    RunDeferred();
    SweepPeers();
    {
      absl::MutexLock lock(&mu_);
      if (!queue_.empty() || stop_requested_) return;
    }
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) return;  // events arrived meanwhile
    PollSockets(max_wait_ms);
  }

  void PollSockets(int max_wait_ms) {
    const absl::Time now = absl::Now();
    absl::Time next = now + absl::Milliseconds(max_wait_ms);
    std::vector<pollfd> fds;
    // What each entry of fds beyond the first three is.
    std::vector<std::list<Pending>::iterator> pending_at;
    std::vector<PeerId> peer_at;
    fds.push_back({worker_fd_, POLLIN, 0});
    fds.push_back({event_fd_, POLLIN, 0});
    const bool accepting = listen_fd_ >= 0 && now >= accept_paused_until_;
    fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});
    if (listen_fd_ >= 0 && !accepting) next = std::min(next, accept_paused_until_);
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
      fds.push_back({it->fd, POLLIN, 0});
      pending_at.push_back(it);
      next = std::min(next, it->deadline);
    }
    for (auto& [id, p] : peers_) {
      if (p->fd < 0) continue;
      short events = POLLIN;
      if (p->tcp_connecting || p->out_offset < p->out.size()) events |= POLLOUT;
      fds.push_back({p->fd, events, 0});
      peer_at.push_back(id);
      next = std::min(next, p->deadline);
    }
    const int timeout_ms =
        static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(next - now) + 1, 0, max_wait_ms));
    const int ready = poll(fds.data(), fds.size(), timeout_ms);
    round_slept_ = ready == 0 && timeout_ms >= 100;
    if (fds[1].revents & POLLIN) {
      uint64_t count = 0;
      [[maybe_unused]] ssize_t n = read(event_fd_, &count, sizeof(count));
    }
    if (ready > 0) {
      if (fds[2].revents != 0) AcceptConnections();
      for (size_t i = 0; i < pending_at.size(); ++i) {
        if (fds[3 + i].revents != 0) ReadPending(pending_at[i]);
      }
      for (size_t i = 0; i < peer_at.size(); ++i) {
        const pollfd& f = fds[3 + pending_at.size() + i];
        if (f.revents == 0) continue;
        auto it = peers_.find(peer_at[i]);
        if (it == peers_.end() || it->second->failed || it->second->fd != f.fd) continue;
        Peer* p = it->second.get();
        if (f.revents & (POLLOUT | POLLERR | POLLHUP)) WritePeer(p);
        if (!p->failed && (f.revents & (POLLIN | POLLERR | POLLHUP))) ReadPeer(p);
      }
    }
    ExpireHandshakes();
  }

  // --- the data port: accepting and reading greetings ---

  void AcceptConnections() {
    for (int i = 0; i < kMaxAcceptsPerRound; ++i) {
      sockaddr_in from{};
      socklen_t len = sizeof(from);
      const int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) return;
        // Out of descriptors (EMFILE/ENFILE) or memory: the connection stays
        // queued and the socket readable, so stop polling it for a moment
        // instead of spinning.
        log::Warn("data plane: accept on {} failed: {}; pausing accepts for 100 ms", address_, ErrnoText(errno));
        accept_paused_until_ = absl::Now() + absl::Milliseconds(100);
        return;
      }
      const std::string who = SockaddrText(from);
      std::string key = HandshakeKey();
      if (key.empty() && KeyRequired()) {
        // Nothing is answered, not even our greeting: the peer retries.
        close(fd);
        NoteRefused(who, absl::UnavailableError(kNoKeyYet));
        continue;
      }
      if (pending_.size() + inbound_handshakes_ >= static_cast<size_t>(std::max(1, options_.max_pending_handshakes))) {
        close(fd);
        NoteRefused(who, absl::ResourceExhaustedError(absl::StrCat(
                             options_.max_pending_handshakes, " handshakes already in progress")));
        continue;
      }
      Pending p;
      p.fd = fd;
      p.from = who;
      // With a key, the first record must say so and carry no address (and,
      // with identities, carry the connecting node's certificate).
      if (!key.empty()) p.creds = HandshakeCredentials();
      p.reader = ucx_wire::GreetingReader(key.empty() ? ucx_wire::kAddress : ucx_wire::kKeyed | IdentityFlag(p.creds));
      p.key = std::move(key);
      p.deadline = absl::Now() + absl::Milliseconds(options_.handshake_timeout_ms);
      pending_.push_back(std::move(p));
    }
  }

  void ReadPending(std::list<Pending>::iterator it) {
    Pending& p = *it;
    char buf[kReadChunk];
    for (;;) {
      const size_t want = std::min(p.reader.wanted(), sizeof(buf));
      const ssize_t n = recv(p.fd, buf, want, 0);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        DropPending(it, absl::UnavailableError(absl::StrCat("read failed: ", ErrnoText(errno))), false);
        return;
      }
      if (n == 0) {
        // Closed before saying anything useful (a port probe, or a peer
        // that gave up): nothing to report beyond debug.
        DropPending(it, absl::UnavailableError(absl::StrCat("closed after ", p.reader.consumed(),
                                                            " bytes of the greeting")),
                    p.reader.consumed() > 0);
        return;
      }
      absl::StatusOr<size_t> fed = p.reader.Feed(std::string_view(buf, n));
      if (!fed.ok()) {
        DropPending(it, fed.status(), true);
        return;
      }
      if (p.reader.done()) {
        AcceptGreeting(it);
        return;
      }
    }
  }

  void DropPending(std::list<Pending>::iterator it, const absl::Status& why, bool warn) {
    CloseFd(&it->fd);
    if (warn) {
      NoteRefused(it->from, why);
    } else {
      log::Debug("data plane: connection from {} dropped: {}", it->from, std::string(why.message()));
    }
    pending_.erase(it);
  }

  // A message that named connection `p` but came on another UCX endpoint
  // than the one its handshake completed on: dropped, logged at most once a
  // second.
  void NoteForeign(const Peer& p) {
    ++foreign_;
    const absl::Time now = absl::Now();
    if (now - last_foreign_log_ < absl::Seconds(1)) return;
    log::Warn("data plane: dropped a message naming connection {} ({}) that came on another UCX endpoint than "
              "the one its handshake completed on ({} dropped in all)",
              p.id, p.address, foreign_);
    last_foreign_log_ = now;
  }

  // Garbage on the data port is logged, but at most once a second.
  void NoteRefused(const std::string& from, const absl::Status& why) {
    ++refused_;
    const absl::Time now = absl::Now();
    if (now - last_refusal_log_ < absl::Seconds(1)) return;
    log::Warn("data plane: refused a connection from {}: {} ({} refused in all)", from, std::string(why.message()),
              refused_);
    last_refusal_log_ = now;
  }

  // A well-formed first record: the connection becomes an inbound Peer.
  // Without a key it answers with our worker address and waits for the UCX
  // hello; with one, it answers with our proof and waits for the connecting
  // side's proof and address (OnRecord).
  void AcceptGreeting(std::list<Pending>::iterator it) {
    const ucx_wire::Greeting& g = it->reader.greeting();
    auto owned = std::make_unique<Peer>();
    Peer* p = owned.get();
    p->id = NewPeerId();
    p->address = absl::StrCat("inbound from ", it->from);
    p->inbound = true;
    p->silent = probing_;
    p->fd = it->fd;
    p->deadline = it->deadline;
    p->nonce = ucx_wire::RandomU64();
    p->remote_id = g.peer_id;
    p->remote_nonce = g.nonce;
    p->key = std::move(it->key);
    p->creds = std::move(it->creds);
    p->handshaking = true;
    ++inbound_handshakes_;
    const std::string their_identity = g.identity;
    if (p->key.empty()) {
      p->remote_worker = g.worker_address;
      p->out = Record(*p, ucx_wire::kAddress);
      p->state = PeerState::kUcxHello;
    } else {
      p->reader = ucx_wire::GreetingReader(ucx_wire::kKeyed | ucx_wire::kProof | ucx_wire::kAddress |
                                           IdentityFlag(p->creds));
      p->state = PeerState::kTcpHandshake;
    }
    it->fd = -1;
    pending_.erase(it);
    SetKeepalive(p->fd);
    peers_[p->id] = std::move(owned);
    if (!p->key.empty()) {
      // Our proof (and, with identities, our certificate, key and signature,
      // once the connecting node's certificate is known good).
      std::string block;
      if (p->creds != nullptr) {
        absl::StatusOr<std::string> mine = AcceptorIdentity(p, their_identity);
        if (!mine.ok()) {
          Refuse(p, std::string(mine.status().message()));
          return;
        }
        block = *std::move(mine);
      }
      p->out = Record(*p, ucx_wire::kKeyed | ucx_wire::kProof | IdentityFlag(p->creds), block);
    }
    WritePeer(p);
  }

  // With identities, inbound: checks the connecting node's offer (record 1)
  // and returns our identity block for record 2 (certificate, key and our
  // signature 'a').
  absl::StatusOr<std::string> AcceptorIdentity(Peer* p, const std::string& their_block) {
    CKPT_ASSIGN_OR_RETURN(p->exchange, IdentityExchange::Start(p->creds, /*acceptor=*/true));
    CKPT_ASSIGN_OR_RETURN(IdentityBlock theirs, DecodeIdentityBlock(their_block));
    CKPT_RETURN_IF_ERROR(p->exchange->TakeOffer(theirs));
    IdentityBlock mine = p->exchange->Offer();
    CKPT_ASSIGN_OR_RETURN(mine.signature, p->exchange->Sign('a', p->id, p->nonce, p->remote_id, p->remote_nonce));
    return EncodeIdentityBlock(mine);
  }

  // With identities, the other side's signature arrived (record 2 on the
  // connecting side, 3 on the accepting side): checks it (and, connecting,
  // the accepting node's certificate first), keeps what it proved and the
  // shared secret, and returns our signature block for record 3 (connecting
  // side; empty on the accepting side).
  absl::StatusOr<std::string> FinishIdentity(Peer* p, const std::string& their_block) {
    CKPT_ASSIGN_OR_RETURN(IdentityBlock theirs, DecodeIdentityBlock(their_block));
    if (!p->inbound) CKPT_RETURN_IF_ERROR(p->exchange->TakeOffer(theirs));
    const uint64_t a_id = p->inbound ? p->id : p->remote_id;
    const uint64_t a_nonce = p->inbound ? p->nonce : p->remote_nonce;
    const uint64_t c_id = p->inbound ? p->remote_id : p->id;
    const uint64_t c_nonce = p->inbound ? p->remote_nonce : p->nonce;
    CKPT_RETURN_IF_ERROR(
        p->exchange->CheckSignature(p->inbound ? 'c' : 'a', a_id, a_nonce, c_id, c_nonce, theirs.signature));
    CKPT_ASSIGN_OR_RETURN(p->identity_secret, p->exchange->SharedSecret());
    p->peer_identity = p->exchange->peer_identity();
    std::string reply;
    if (!p->inbound) {
      IdentityBlock mine;
      CKPT_ASSIGN_OR_RETURN(mine.signature, p->exchange->Sign('c', a_id, a_nonce, c_id, c_nonce));
      reply = EncodeIdentityBlock(mine);
    }
    p->exchange.reset();
    return reply;
  }

  void ExpireHandshakes() {
    const absl::Time now = absl::Now();
    for (auto it = pending_.begin(); it != pending_.end();) {
      auto next = std::next(it);
      if (now >= it->deadline) {
        DropPending(it, absl::DeadlineExceededError(absl::StrCat(
                            "no greeting within ", options_.handshake_timeout_ms, " ms")),
                    true);
      }
      it = next;
    }
    for (auto& [id, p] : peers_) {
      if (!p->failed && p->inbound && p->state != PeerState::kConnected && now >= p->deadline) {
        log::Warn("data plane: connection {} did not finish its handshake within {} ms", p->address,
                  options_.handshake_timeout_ms);
        PeerDown(p.get(), absl::DeadlineExceededError("handshake timed out"));
      }
    }
  }

  // --- handshake and liveness sockets of peers ---

  void WritePeer(Peer* p) {
    if (p->tcp_connecting) {
      int err = 0;
      socklen_t len = sizeof(err);
      if (getsockopt(p->fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      if (err == EINPROGRESS) return;
      if (err != 0) {
        PeerDown(p, absl::UnavailableError(ErrnoText(err)));
        return;
      }
      p->tcp_connecting = false;
    }
    while (p->out_offset < p->out.size()) {
      const ssize_t n = send(p->fd, p->out.data() + p->out_offset, p->out.size() - p->out_offset, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        PeerDown(p, absl::UnavailableError(absl::StrCat("handshake write failed: ", ErrnoText(errno))));
        return;
      }
      p->out_offset += n;
    }
    p->out.clear();
    p->out.shrink_to_fit();
    p->out_offset = 0;
  }

  void ReadPeer(Peer* p) {
    char buf[kReadChunk];
    for (;;) {
      const bool greeting = p->state == PeerState::kTcpHandshake && !p->reader.done();
      const size_t want = greeting ? std::min(p->reader.wanted(), sizeof(buf)) : sizeof(buf);
      const ssize_t n = recv(p->fd, buf, want, 0);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        PeerDown(p, absl::UnavailableError(absl::StrCat("data-plane connection failed: ", ErrnoText(errno))));
        return;
      }
      if (n == 0) {
        PeerDown(p, absl::UnavailableError(greeting ? "connection closed during the handshake"
                                                    : "the peer closed the data-plane connection"));
        return;
      }
      if (!greeting) {
        // Nothing is ever sent after the greetings.
        PeerDown(p, absl::UnavailableError(absl::StrCat("protocol violation: ", n,
                                                        " unexpected bytes after the handshake")));
        return;
      }
      absl::StatusOr<size_t> fed = p->reader.Feed(std::string_view(buf, n));
      if (!fed.ok()) {
        PeerDown(p, fed.status());
        return;
      }
      if (p->reader.done()) {
        OnRecord(p);
        return;
      }
    }
  }

  // Our greeting record with `flags` for connection `p` (the proof and our
  // worker address as the flags say).
  std::string Record(const Peer& p, uint8_t flags, std::string identity_block = {}) const {
    ucx_wire::Greeting g;
    g.flags = flags;
    g.peer_id = p.id;
    g.nonce = p.nonce;
    if ((flags & ucx_wire::kProof) != 0) g.proof = Proof(p, p.inbound ? 'a' : 'c');
    if ((flags & ucx_wire::kAddress) != 0) g.worker_address = worker_address_;
    g.identity = std::move(identity_block);
    return *ucx_wire::EncodeGreeting(g);  // our own fields: always encodable (address checked at Start)
  }

  // A refusal by this side during the handshake: said once, then the
  // connection fails (the other side sees it close).
  void Refuse(Peer* p, const std::string& why) {
    log::Warn("data plane: refused {}: {}", p->address, why);
    PeerDown(p, absl::PermissionDeniedError(why));
  }

  // The other side's next greeting record arrived on `p` (handshake.h).
  void OnRecord(Peer* p) {
    const ucx_wire::Greeting g = p->reader.greeting();
    const bool first = !p->inbound && g.flags != (ucx_wire::kKeyed | ucx_wire::kAddress);
    if (first) {
      p->remote_id = g.peer_id;
      p->remote_nonce = g.nonce;
    } else if (g.peer_id != p->remote_id || g.nonce != p->remote_nonce) {
      Refuse(p, "its greeting records name two different connections");
      return;
    }
    if ((g.flags & ucx_wire::kProof) != 0 && !ucx_wire::SameProof(g.proof, Proof(*p, p->inbound ? 'c' : 'a'))) {
      Refuse(p, "its greeting does not prove this cluster's data-plane key (another ckpt-meta's key, or another "
                "--token-file than this agent's)");
      return;
    }
    std::string our_signature;
    if ((g.flags & ucx_wire::kIdentity) != 0) {
      absl::StatusOr<std::string> done = FinishIdentity(p, g.identity);
      if (!done.ok()) {
        Refuse(p, std::string(done.status().message()));
        return;
      }
      our_signature = *std::move(done);
    }
    if (p->inbound) {
      // The connecting side proved the key: now it gets our address.
      p->remote_worker = g.worker_address;
      p->out += Record(*p, ucx_wire::kKeyed | ucx_wire::kAddress);
      p->state = PeerState::kUcxHello;
      WritePeer(p);
      return;
    }
    if (g.flags == (ucx_wire::kKeyed | ucx_wire::kProof | IdentityFlag(p->creds))) {
      // The accepting side proved the key (and which node it is): our proof
      // (and signature) and address, then its address.
      p->reader = ucx_wire::GreetingReader(ucx_wire::kKeyed | ucx_wire::kAddress);
      p->out += Record(*p, ucx_wire::kKeyed | ucx_wire::kProof | ucx_wire::kAddress | IdentityFlag(p->creds),
                       std::move(our_signature));
      WritePeer(p);
      return;
    }
    OnGreetingReply(p, g.worker_address);
  }

  void StartConnect(const std::shared_ptr<ConnectWait>& wait, sockaddr_in addr, const std::string& address) {
    std::string key = HandshakeKey();
    if (key.empty() && KeyRequired()) {
      wait->status = absl::UnavailableError(absl::StrCat("connect to ", address, ": ", kNoKeyYet));
      wait->done.Notify();
      return;
    }
    auto owned = std::make_unique<Peer>();
    Peer* p = owned.get();
    p->id = NewPeerId();
    p->address = address;
    p->connect = wait;
    p->silent = probing_;
    p->nonce = ucx_wire::RandomU64();
    p->key = std::move(key);
    if (!p->key.empty()) p->creds = HandshakeCredentials();
    peers_[p->id] = std::move(owned);
    if (p->creds != nullptr) {
      absl::StatusOr<std::unique_ptr<IdentityExchange>> x = IdentityExchange::Start(p->creds, /*acceptor=*/false);
      if (!x.ok()) {
        PeerDown(p, x.status());
        return;
      }
      p->exchange = *std::move(x);
    }
    p->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (p->fd < 0) {
      PeerDown(p, absl::UnavailableError(absl::StrCat("socket: ", ErrnoText(errno))));
      return;
    }
    SetKeepalive(p->fd);
    if (p->key.empty()) {
      p->out = Record(*p, ucx_wire::kAddress);
      p->reader = ucx_wire::GreetingReader(ucx_wire::kAddress);
    } else {
      // No address before the other side proves the key (and which node it is).
      p->out = Record(*p, ucx_wire::kKeyed | IdentityFlag(p->creds),
                      p->exchange != nullptr ? EncodeIdentityBlock(p->exchange->Offer()) : std::string());
      p->reader = ucx_wire::GreetingReader(ucx_wire::kKeyed | ucx_wire::kProof | IdentityFlag(p->creds));
    }
    if (connect(p->fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
      if (errno != EINPROGRESS) {
        PeerDown(p, absl::UnavailableError(ErrnoText(errno)));
        return;
      }
      p->tcp_connecting = true;
      return;  // PollSockets waits for it to become writable
    }
    WritePeer(p);
  }

  // Outbound: the accepting side's worker address arrived (after its proof,
  // with a key). Open our endpoint to its worker and say hello over UCX;
  // Connect completes on its ready message.
  void OnGreetingReply(Peer* p, const std::string& worker_address) {
    if (absl::Status s = AttachRemote(p, worker_address); !s.ok()) {
      PeerDown(p, s);
      return;
    }
    p->state = PeerState::kUcxHello;
    SendControl(p, kHelloAmId);
  }

  // Inbound: the connecting side's hello arrived over UCX, so its worker
  // reaches ours. Open our endpoint to it (matched by UCX with the one the
  // hello came on, when UCX can) and answer ready.
  void AcceptPeer(PeerId id) {
    auto it = peers_.find(id);
    if (it == peers_.end() || it->second->failed || it->second->state != PeerState::kUcxHello) return;
    Peer* p = it->second.get();
    const std::string remote = std::move(p->remote_worker);
    p->remote_worker.clear();
    if (absl::Status s = AttachRemote(p, remote); !s.ok()) {
      log::Warn("data plane: cannot open an endpoint back to {}: {}", p->address, std::string(s.message()));
      PeerDown(p, s);
      return;
    }
    p->state = PeerState::kConnected;
    p->deadline = absl::InfiniteFuture();
    EndHandshake(p);
    SetMessageKeys(p);  // before the ready: the connecting side may send at once
    SendControl(p, kReadyAmId);
  }

  // Gives `p` the endpoint to the worker at `worker_address`: the one already
  // open to it, or a new one.
  absl::Status AttachRemote(Peer* p, const std::string& worker_address) {
    Remote* r = nullptr;
    auto it = remote_by_address_.find(worker_address);
    if (it != remote_by_address_.end()) {
      r = it->second;
    } else {
      auto owned = std::make_unique<Remote>();
      owned->owner = this;
      owned->worker_address = worker_address;
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                      UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = &UcxImpl::OnEpError;
      ep.err_handler.arg = owned.get();
      ep.address = reinterpret_cast<const ucp_address_t*>(worker_address.data());
      ucp_ep_h handle = nullptr;
      const ucs_status_t st = ucp_ep_create(worker_, &ep, &handle);
      if (st != UCS_OK) {
        return absl::UnavailableError(absl::StrCat("UCX cannot reach the peer's worker: ", UcsError(st)));
      }
      owned->ep = handle;
      r = owned.get();
      remote_by_address_[worker_address] = r;
      remotes_.push_back(std::move(owned));
    }
    ++r->refs;
    p->remote = r;
    return absl::OkStatus();
  }

  void EndHandshake(Peer* p) {
    if (!p->handshaking) return;
    p->handshaking = false;
    --inbound_handshakes_;
  }

  // `p` no longer uses its endpoint; the last user closes it.
  void DetachRemote(Peer* p) {
    Remote* r = p->remote;
    if (r == nullptr || --r->refs > 0) return;
    CloseRemote(r, /*force=*/false);
  }

  // Closes the endpoint. A broken one (UCX reported an error) is
  // force-closed: UCX completes its sends in flight with an error. Any other
  // is flushed first, its sends in flight complete (OnSendDone reports
  // their peer's status) and then it closes: UCX 1.13's TCP transport, torn
  // down with a message half written, writes its goodbye into the middle of
  // that message and the peer, still alive, crashes parsing it. A flush on a
  // peer that is gone ends when UCX notices (socket error, or keepalive).
  void CloseRemote(Remote* r, bool force) {
    if (r->ep == nullptr) return;
    auto it = remote_by_address_.find(r->worker_address);
    if (it != remote_by_address_.end() && it->second == r) remote_by_address_.erase(it);
    ucp_ep_h ep = r->ep;
    r->ep = nullptr;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    rp.cb.send = &UcxImpl::OnClosed;
    rp.user_data = this;
    void* req = ucp_ep_close_nbx(ep, &rp);
    if (UCS_PTR_IS_PTR(req)) ++closing_;
  }

  // With a key: the proof of `role` for connection `p` (handshake.h): 'a'
  // and 'c' in the greeting records of the accepting and the connecting
  // side, 'h' in the UCX hello, 'r' in the ready message.
  static std::string Proof(const Peer& p, char role) {
    return p.inbound ? ucx_wire::HandshakeProof(p.key, role, p.id, p.nonce, p.remote_id, p.remote_nonce)
                     : ucx_wire::HandshakeProof(p.key, role, p.remote_id, p.remote_nonce, p.id, p.nonce);
  }

  static size_t ControlBytes(const Peer& p) { return kHelloBytes + (p.key.empty() ? 0 : ucx_wire::kProofBytes); }

  // Checks a hello or ready that names `p` (its id and our nonce matched):
  // OK, or why the sender is refused.
  absl::Status CheckControl(const Peer& p, unsigned am_id, const void* header, size_t header_length) const {
    const char* what = am_id == kHelloAmId ? "hello" : "ready message";
    if (header_length != ControlBytes(p)) {
      return absl::PermissionDeniedError(absl::StrCat(
          "its ", what, " is ", header_length, " bytes, not ", ControlBytes(p), ": ",
          p.key.empty() ? "it authenticates with a cluster key and this agent has none"
                        : "it does not authenticate (no cluster key)",
          "; every agent needs the same data-plane key (from a TLS ckpt-meta, or the same --token-file)"));
    }
    if (!p.key.empty() &&
        !ucx_wire::SameProof(std::string_view(static_cast<const char*>(header) + kHelloBytes, ucx_wire::kProofBytes),
                             Proof(p, am_id == kHelloAmId ? 'h' : 'r'))) {
      return absl::PermissionDeniedError(absl::StrCat(
          "its ", what, " does not prove this cluster's key (another ckpt-meta's key, or another --token-file than "
          "this agent's)"));
    }
    return absl::OkStatus();
  }

  // The key a handshake starting now uses.
  std::string HandshakeKey() { return probing_ ? probe_key_ : CurrentKey(); }

  // No connection without a key: require_auth, or node identities (they
  // ride on keyed handshakes only).
  bool KeyRequired() const { return options_.require_auth || options_.identity != nullptr; }

  // The node credentials a handshake starting now proves (null: no
  // identities). Reads no file (UcxOptions::identity).
  // Start's self-check proves none: it checks that UCX carries messages, and
  // a node whose certificate does not chain to its own CA (a mistake its
  // peers refuse, fixed by replacing the files) must still start.
  std::shared_ptr<const NodeCredentials> HandshakeCredentials() const {
    return options_.identity != nullptr && !probing_ ? options_.identity() : nullptr;
  }
  static uint8_t IdentityFlag(const std::shared_ptr<const NodeCredentials>& creds) {
    return creds != nullptr ? ucx_wire::kIdentity : 0;
  }

  std::string PeerIdentity(PeerId peer) const override {
    absl::MutexLock lock(&crypto_mu_);
    auto it = send_crypto_.find(peer);
    return it == send_crypto_.end() ? std::string() : it->second->peer_identity;
  }

  std::string CurrentKey() {
    absl::MutexLock lock(&mu_);
    return auth_key_;
  }

  static std::string RandomKey() {
    std::string key;
    for (int i = 0; i < 4; ++i) {
      const uint64_t v = ucx_wire::RandomU64();
      key.append(reinterpret_cast<const char*>(&v), sizeof(v));
    }
    return key;
  }

  // A connection id: random, so that nobody can guess the id of another
  // connection (each message names its connection by the id).
  PeerId NewPeerId() {
    for (;;) {
      const PeerId id = ucx_wire::RandomU64();
      if (id != 0 && !peers_.contains(id)) return id;
    }
  }

  void SendControl(Peer* p, unsigned am_id) {
    auto op = std::make_unique<ControlOp>();
    op->header.assign(kHelloBytes, '\0');
    StoreLe64(op->header.data(), p->remote_id);
    StoreLe64(op->header.data() + 8, p->remote_nonce);
    if (!p->key.empty()) op->header += Proof(*p, am_id == kHelloAmId ? 'h' : 'r');
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.cb.send = &UcxImpl::OnControlSent;
    rp.user_data = op.get();
    rp.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY;
    void* req = ucp_am_send_nbx(p->remote->ep, am_id, op->header.data(), op->header.size(), nullptr, 0, &rp);
    if (UCS_PTR_IS_PTR(req)) {
      op.release();  // OnControlSent owns it now
    } else if (UCS_PTR_IS_ERR(req)) {
      PeerDown(p, absl::UnavailableError(
                      absl::StrCat("UCX handshake message failed: ", UcsError(UCS_PTR_STATUS(req)))));
    }
  }

  void RunDeferred() {
    while (!deferred_accepts_.empty()) {
      const PeerId id = deferred_accepts_.front();
      deferred_accepts_.pop_front();
      AcceptPeer(id);
    }
  }

  // Peers that failed before they had an endpoint hold nothing UCX may call
  // back into: drop them (a flood of half-done handshakes leaves nothing).
  void SweepPeers() {
    std::erase_if(peers_, [](const auto& entry) {
      const Peer& p = *entry.second;
      return p.failed && p.remote == nullptr && p.connect == nullptr;
    });
  }

  void Shutdown() {
    stopping_ = true;
    CloseFd(&listen_fd_);
    for (Pending& p : pending_) CloseFd(&p.fd);
    pending_.clear();
    for (auto& [id, peer] : peers_) {
      if (!peer->failed) FailPeer(peer.get(), absl::CancelledError("UCX transport stopped"));
      if (peer->connect) FinishConnect(peer.get(), absl::UnavailableError("UCX transport stopped"));
    }
    for (auto& r : remotes_) CloseRemote(r.get(), /*force=*/false);
    // Waits while UCX makes progress (a close, send or receive finishing, or
    // UCX moving anything at all), and gives up after stop_timeout_ms
    // without any, or after stop_limit_ms in all: on a loaded machine,
    // sends of many MiB each still moving finish one after another, and
    // destroying the worker before they do makes UCX 1.13 abort
    // (ucp_ep.c:437, proto_reqs not empty).
    const absl::Duration idle_limit = absl::Milliseconds(options_.stop_timeout_ms);
    const absl::Time hard_deadline =
        absl::Now() + (options_.stop_limit_ms > 0 ? absl::Milliseconds(options_.stop_limit_ms) : 10 * idle_limit);
    absl::Time idle_deadline = absl::Now() + idle_limit;
    auto unfinished = [&] { return closing_ + sends_in_flight_ + recvs_in_flight_; };
    for (int64_t left = unfinished(); left > 0;) {
      const absl::Time now = absl::Now();
      if (now >= idle_deadline || now >= hard_deadline) break;
      const bool moved = ProgressOrWait();
      const int64_t after = unfinished();
      if (moved || after < left) idle_deadline = absl::Now() + idle_limit;
      left = after;
    }
    if (closing_ > 0 || sends_in_flight_ > 0 || recvs_in_flight_ > 0) {
      // A peer that takes nothing (stopped, hung, or a network that lost
      // it) keeps them from finishing. UCX 1.13 cannot end them: destroying
      // the worker aborts the process (ucp_ep.c:437, proto_reqs not empty),
      // and force-closing a TCP endpoint with a message half written writes
      // its goodbye into the middle of that message (and blocks while the
      // stopped peer's socket is full). So the worker is left in place,
      // never progressed again: nothing in it reads or writes our memory
      // after this, the sends end here (with the peer's status or
      // Cancelled), and receives that had not finished get no OnReceived
      // (their pieces are simply never written again).
      log::Warn("UCX transport stopped with {} endpoint closes, {} sends, {} receives unfinished after "
                "waiting (no progress for {} ms, or the whole limit); its UCX worker is left to the process's exit",
                closing_, sends_in_flight_, recvs_in_flight_, options_.stop_timeout_ms);
      abandon_worker_ = true;
      for (auto& [request, op] : inflight_sends_) {
        std::unique_ptr<SendOp> owned(op);
        owned->done(owned->peer->failed ? owned->peer->fail_status
                                        : absl::CancelledError("UCX transport stopped"));
      }
      inflight_sends_.clear();
      sends_in_flight_ = 0;
      for (auto& [request, op] : inflight_recvs_) delete op;  // UCX never calls back now
      inflight_recvs_.clear();
      recvs_in_flight_ = 0;
    }
    for (ucp_mem_h memh : memhs_) ucp_mem_unmap(context_, memh);
    memhs_.clear();
    peers_.clear();
    remote_by_address_.clear();
    remotes_.clear();
  }

  // Marks `p` failed, closes its liveness socket (so the other side learns
  // at once) and lets go of its endpoint (closed if no other connection to
  // that worker uses it). Its sends still in flight complete with `why`.
  void FailPeer(Peer* p, absl::Status why) {
    p->failed = true;
    if (!p->key.empty()) {
      absl::MutexLock lock(&crypto_mu_);
      send_crypto_.erase(p->id);  // Sends to it are sealed no more (and fail)
    }
    EndHandshake(p);
    p->fail_status = std::move(why);
    CloseFd(&p->fd);
    p->out.clear();
    p->remote_worker.clear();
    DetachRemote(p);
  }

  // A connection failed (UCX error, liveness socket closed, handshake
  // error): fail it, and tell whoever knows of it.
  void PeerDown(Peer* p, const absl::Status& why) {
    if (p->failed) return;
    const bool was_connected = p->state == PeerState::kConnected;
    const absl::Status status = absl::Status(
        why.code(), absl::StrCat("peer ", p->id, " (", p->address, ") failed: ", why.message()));
    FailPeer(p, status);
    if (p->connect != nullptr) {
      FinishConnect(p, absl::Status(why.code() == absl::StatusCode::kInvalidArgument
                                        ? absl::StatusCode::kUnavailable
                                        : why.code(),
                                    absl::StrCat("connect to ", p->address, ": ", why.message())));
      return;
    }
    if (was_connected && !stopping_ && !p->silent) handler_->OnPeerFailed(p->id, status);
  }

  void FinishConnect(Peer* p, absl::Status status) {
    if (p->connect == nullptr) return;
    p->connect->status = std::move(status);
    p->connect->id = p->id;
    p->connect->done.Notify();
    p->connect = nullptr;
  }

  void AbandonConnect(const std::shared_ptr<ConnectWait>& wait) {
    for (auto& [id, p] : peers_) {
      if (p->connect == wait) {
        p->connect = nullptr;  // the waiter is gone; no OnPeerFailed either
        if (!p->failed) FailPeer(p.get(), absl::UnavailableError("connect timed out"));
        return;
      }
    }
    // Connected meanwhile: the caller was told it timed out, so drop it.
    if (wait->done.HasBeenNotified() && wait->status.ok()) {
      auto it = peers_.find(wait->id);
      if (it != peers_.end() && !it->second->failed) {
        FailPeer(it->second.get(), absl::UnavailableError("connect timed out"));
      }
    }
  }

  void StartSend(SendOp* raw, PeerId peer_id, size_t header_size, uint64_t receiver_id, TestTamper tamper) {
    std::unique_ptr<SendOp> op(raw);
    if (header_size > kMaxHeaderBytes) {
      op->done(absl::InvalidArgumentError(
          absl::StrCat("header of ", header_size, " bytes exceeds ", kMaxHeaderBytes)));
      return;
    }
    auto it = peers_.find(peer_id);
    if (it == peers_.end() || it->second->failed || it->second->remote == nullptr ||
        it->second->remote->ep == nullptr || it->second->state != PeerState::kConnected) {
      op->done(absl::UnavailableError(absl::StrCat("peer ", peer_id, " is not connected")));
      return;
    }
    Peer* p = it->second.get();
    op->peer = p;
    if (op->sealed != !p->key.empty()) {
      // A keyed connection's message that Send could not seal (the
      // connection failed meanwhile), or a sealed one for a keyless
      // connection (cannot happen): never put on the wire.
      op->done(absl::UnavailableError(absl::StrCat("peer ", peer_id, " is not connected")));
      return;
    }
    if (!op->sealed) StoreLe64(op->am_header.data(), receiver_id != 0 ? receiver_id : p->remote_id);
    uint64_t payload = 0;
    for (const auto& v : op->iov) payload += v.length;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                      UCP_OP_ATTR_FIELD_FLAGS;
    rp.cb.send = &UcxImpl::OnSendDone;
    rp.user_data = op.get();
    rp.flags = UCP_AM_SEND_FLAG_REPLY;  // the receiver checks the endpoint it arrives on
    if (payload > options_.rndv_threshold_bytes) rp.flags |= UCP_AM_SEND_FLAG_RNDV;
    const void* buffer = nullptr;
    size_t count = 0;
    if (op->iov.size() == 1) {
      buffer = op->iov[0].buffer;
      count = op->iov[0].length;
    } else if (op->iov.size() > 1) {
      rp.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
      rp.datatype = ucp_dt_make_iov();
      buffer = op->iov.data();
      count = op->iov.size();
    }
    void* req = ucp_am_send_nbx(p->remote->ep, kAmId, op->am_header.data(), op->am_header.size(), buffer,
                                count, &rp);
    if (req == nullptr) {
      op->done(absl::OkStatus());
    } else if (UCS_PTR_IS_ERR(req)) {
      op->done(absl::UnavailableError(
          absl::StrCat("send to peer ", peer_id, ": ", UcsError(UCS_PTR_STATUS(req)))));
    } else {
      ++sends_in_flight_;
      inflight_sends_[req] = op.release();  // OnSendDone owns it now
    }
  }

  // A keyed connection is connected: derive its message keys
  // (message_auth.h), ours to send with and the other side's.
  void SetMessageKeys(Peer* p) {
    if (p->key.empty()) return;
    // With identities, the X25519 secret too: a member that holds the
    // cluster key but sits between two nodes cannot derive their keys.
    const std::string secret = p->key + p->identity_secret;
    const ucx_wire::ConnectionKeys k =
        p->inbound ? ucx_wire::DeriveConnectionKeys(secret, p->id, p->nonce, p->remote_id, p->remote_nonce)
                   : ucx_wire::DeriveConnectionKeys(secret, p->remote_id, p->remote_nonce, p->id, p->nonce);
    const ucx_wire::DirectionKeys& send = p->inbound ? k.to_connector : k.to_acceptor;
    const ucx_wire::DirectionKeys& recv = p->inbound ? k.to_acceptor : k.to_connector;
    p->recv_mac_key = recv.mac_key;
    p->recv_sealer = std::make_unique<ucx_wire::PayloadSealer>(recv.aes_key);
    auto crypto = std::make_shared<SendCrypto>();
    crypto->receiver_id = p->remote_id;
    crypto->mac_key = send.mac_key;
    crypto->aes_key = send.aes_key;
    crypto->peer_identity = p->peer_identity;
    absl::MutexLock lock(&crypto_mu_);
    send_crypto_[p->id] = std::move(crypto);
  }

  // The message of `op` on a keyed connection, sealed on the caller's
  // thread with `crypto`: receiver id, sequence number, payload tag (or
  // encrypted payload, sent from a buffer of the pool) and header tag
  // (message_auth.h). A non-zero `receiver_id` replaces the connection's
  // (TEST_SendTampered).
  void Seal(SendCrypto& crypto, uint64_t receiver_id, SendOp* op, TestTamper tamper) {
    const uint64_t seq = tamper == TestTamper::kReplay ? crypto.seq.load() : ++crypto.seq;
    uint64_t payload = 0;
    for (const auto& v : op->iov) payload += v.length;
    uint8_t flags = 0;
    std::string payload_tag(ucx_wire::kTagBytes, '\0');
    if (payload > 0) {
      std::vector<std::span<const std::byte>> pieces;
      pieces.reserve(op->iov.size());
      for (const ucp_dt_iov_t& v : op->iov) pieces.emplace_back(static_cast<const std::byte*>(v.buffer), v.length);
      // One sealer per message: EVP contexts are not shared between threads,
      // and setting one up costs far less than a pass over a payload.
      ucx_wire::PayloadSealer sealer(crypto.aes_key);
      if (options_.encrypt_payloads) {
        flags |= kEncryptedFlag;
        SendFromCopy(op, payload, nullptr, 0);
        payload_tag = sealer.Encrypt(seq, pieces, std::span<std::byte>(op->scratch.data(), payload));
        if (tamper == TestTamper::kPayload) op->scratch[payload / 2] ^= std::byte{1};
      } else {
        payload_tag = sealer.Tag(seq, pieces);
        if (tamper == TestTamper::kPayload) SendFromCopy(op, payload, &pieces, payload / 2);
      }
    }
    std::string h;
    h.reserve(op->am_header.size() + kSealedPrefixBytes - kDataPrefixBytes + kSealedSuffixBytes);
    h.append(op->am_header, 0, kDataPrefixBytes);
    StoreLe64(h.data(), receiver_id != 0 ? receiver_id : crypto.receiver_id);
    h.push_back(static_cast<char>(flags));
    h.append(8, '\0');
    StoreLe64(h.data() + kDataPrefixBytes + 1, seq);
    h.append(op->am_header, kDataPrefixBytes);
    h += payload_tag;
    std::string tag = ucx_wire::HeaderTag(crypto.mac_key, h, payload);
    if (tamper == TestTamper::kHeaderTag) tag[0] ^= 1;
    h += tag;
    op->am_header = std::move(h);
    op->sealed = true;
  }

  // `op` sends its payload from a buffer of the pool instead of the
  // caller's pieces: the caller's bytes copied there when `copy_of` is given
  // (one byte, at `flip`, spoiled: TestTamper::kPayload), else left for the
  // caller to fill (encryption).
  void SendFromCopy(SendOp* op, uint64_t payload, const std::vector<std::span<const std::byte>>* copy_of,
                    uint64_t flip) {
    op->scratch = TakeScratch(payload);
    if (copy_of != nullptr) {
      std::byte* at = op->scratch.data();
      for (const auto& piece : *copy_of) at = std::copy(piece.begin(), piece.end(), at);
      op->scratch[flip] ^= std::byte{1};
    }
    op->iov.assign(1, ucp_dt_iov_t{op->scratch.data(), payload});
  }

  // A buffer of at least `n` bytes: one from the pool if one is big enough.
  std::vector<std::byte> TakeScratch(uint64_t n) {
    absl::MutexLock lock(&scratch_mu_);
    for (auto it = scratch_pool_.begin(); it != scratch_pool_.end(); ++it) {
      if (it->size() >= n) {
        std::vector<std::byte> buf = std::move(*it);
        scratch_pool_bytes_ -= buf.size();
        scratch_pool_.erase(it);
        return buf;
      }
    }
    return std::vector<std::byte>(n);
  }

 public:
  // A send's buffer, back to the pool (or freed if the pool is full).
  void RecycleScratch(std::vector<std::byte> buf) {
    absl::MutexLock lock(&scratch_mu_);
    if (buf.empty() || scratch_pool_bytes_ + buf.size() > kMaxPooledScratchBytes) return;
    scratch_pool_bytes_ += buf.size();
    scratch_pool_.push_back(std::move(buf));
  }

 private:
  absl::Status MapMemory(void* base, size_t length) {
    if (context_ == nullptr) return absl::FailedPreconditionError("UCX transport is not running");
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = base;
    mp.length = length;
    ucp_mem_h memh = nullptr;
    const ucs_status_t st = ucp_mem_map(context_, &mp, &memh);
    if (st != UCS_OK) {
      log::Warn("UCX cannot register {} bytes at {}: {}; sends from it will copy", length, base,
                UcsError(st));
      return absl::UnavailableError(absl::StrCat("ucp_mem_map: ", UcsError(st)));
    }
    memhs_.push_back(memh);
    return absl::OkStatus();
  }

  // The peer a message names, if it is a live connection in `state`.
  Peer* FindPeer(const void* header, size_t header_length, size_t want_length, PeerState state) {
    if (header_length < want_length) return nullptr;
    auto it = peers_.find(LoadLe64(header));
    if (it == peers_.end() || it->second->failed || it->second->state != state) return nullptr;
    return it->second.get();
  }

  // --- UCX callbacks (progress thread, inside ucp_worker_progress) ---

  // The endpoint to a worker broke: every connection over it fails.
  static void OnEpError(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* r = static_cast<Remote*>(arg);
    UcxImpl* self = r->owner;
    if (r->ep == nullptr) return;  // we closed it ourselves
    self->CloseRemote(r, /*force=*/true);
    const absl::Status why = absl::UnavailableError(UcsError(status));
    for (auto& [id, p] : self->peers_) {
      if (p->remote == r && !p->failed) self->PeerDown(p.get(), why);
    }
  }

  // The endpoint a message came on (UCP_AM_SEND_FLAG_REPLY, which every
  // sender sets), or null if UCX did not say.
  static ucp_ep_h ArrivedOn(const ucp_am_recv_param_t* param) {
    return (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  }

  // Binds `p` to the endpoint its hello or ready came on.
  static absl::Status Bind(Peer* p, const ucp_am_recv_param_t* param) {
    p->bound_ep = ArrivedOn(param);
    if (p->bound_ep == nullptr) {
      return absl::PermissionDeniedError("its handshake message does not say which UCX endpoint it came on");
    }
    return absl::OkStatus();
  }

  // Inbound side: the connecting side's endpoint works.
  static ucs_status_t OnHello(void* arg, const void* header, size_t header_length, void*, size_t,
                              const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxImpl*>(arg);
    Peer* p = self->FindPeer(header, header_length, kHelloBytes, PeerState::kUcxHello);
    if (p == nullptr || !p->inbound || LoadLe64(static_cast<const char*>(header) + kIdBytes) != p->nonce) {
      log::Debug("data plane: dropped a hello that matches no handshake");
      return UCS_OK;
    }
    absl::Status s = self->CheckControl(*p, kHelloAmId, header, header_length);
    if (s.ok()) s = Bind(p, param);
    if (!s.ok()) {
      log::Warn("data plane: refused {}: {}", p->address, std::string(s.message()));
      self->PeerDown(p, s);
      return UCS_OK;
    }
    // Endpoints are not created inside a UCX callback.
    self->deferred_accepts_.push_back(p->id);
    return UCS_OK;
  }

  // Outbound side: the accepting side has its endpoint; Connect is complete.
  static ucs_status_t OnReady(void* arg, const void* header, size_t header_length, void*, size_t,
                              const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxImpl*>(arg);
    Peer* p = self->FindPeer(header, header_length, kHelloBytes, PeerState::kUcxHello);
    if (p == nullptr || p->inbound || LoadLe64(static_cast<const char*>(header) + kIdBytes) != p->nonce) {
      log::Debug("data plane: dropped a ready message that matches no handshake");
      return UCS_OK;
    }
    absl::Status s = self->CheckControl(*p, kReadyAmId, header, header_length);
    if (s.ok()) s = Bind(p, param);
    if (!s.ok()) {
      log::Warn("data plane: refused {}: {}", p->address, std::string(s.message()));
      self->PeerDown(p, s);
      return UCS_OK;
    }
    p->state = PeerState::kConnected;
    self->SetMessageKeys(p);
    self->FinishConnect(p, absl::OkStatus());
    return UCS_OK;
  }

  static void OnControlSent(void* request, ucs_status_t, void* user_data) {
    delete static_cast<ControlOp*>(user_data);
    ucp_request_free(request);
  }

  static void OnClosed(void* request, ucs_status_t, void* user_data) {
    --static_cast<UcxImpl*>(user_data)->closing_;
    ucp_request_free(request);
  }

  static void OnSendDone(void* request, ucs_status_t status, void* user_data) {
    std::unique_ptr<SendOp> op(static_cast<SendOp*>(user_data));
    --op->owner->sends_in_flight_;
    op->owner->inflight_sends_.erase(request);
    ucp_request_free(request);
    // The endpoint may outlive a disconnected peer (other connections to the
    // same worker use it): its sends still end with the peer's status.
    if (op->peer->failed) {
      op->done(op->peer->fail_status);
    } else if (status == UCS_OK) {
      op->done(absl::OkStatus());
    } else {
      op->done(absl::UnavailableError(
          absl::StrCat("send to peer ", op->peer->id, ": ", UcsError(status))));
    }
  }

  static void OnRecvDone(void* request, ucs_status_t status, size_t, void* user_data) {
    std::unique_ptr<RecvOp> op(static_cast<RecvOp*>(user_data));
    --op->owner->recvs_in_flight_;
    op->owner->inflight_recvs_.erase(request);
    ucp_request_free(request);
    op->owner->FinishRecv(*op, status == UCS_OK ? absl::OkStatus()
                                                 : absl::UnavailableError(absl::StrCat(
                                                       "payload from peer ", op->msg.from, " lost: ", UcsError(status))));
  }

  // A rendezvous payload is in its pieces: checked (or decrypted) if its
  // connection is keyed, then handed to the handler.
  void FinishRecv(RecvOp& op, absl::Status status) {
    Peer* refused_by = nullptr;
    if (status.ok() && op.sealed) {
      auto it = peers_.find(op.msg.from);
      Peer* p = it != peers_.end() ? it->second.get() : nullptr;
      MutablePieces pieces;
      for (const ucp_dt_iov_t& v : op.iov) pieces.emplace_back(static_cast<std::byte*>(v.buffer), v.length);
      if (p == nullptr || p->recv_sealer == nullptr || !OpenPayload(p, op, nullptr, pieces)) {
        status = PayloadRefused(op.msg.from);
        refused_by = p;
      }
    }
    handler_->OnReceived(op.msg, status);
    if (refused_by != nullptr && !refused_by->failed) {
      AuthFailed(refused_by, absl::PermissionDeniedError(status.message()));
    }
  }

  // Checks (or decrypts) payload `pieces` of keyed message `op` from `p`:
  // from `src` (eager: the bytes UCX holds; copied or decrypted into the
  // pieces) or in place (src null). False if it fails authentication.
  static bool OpenPayload(Peer* p, const RecvOp& op, const void* src, const MutablePieces& pieces) {
    if (op.encrypted) return p->recv_sealer->Decrypt(op.seq, static_cast<const std::byte*>(src), pieces, op.payload_tag);
    std::vector<std::span<const std::byte>> view;
    if (src != nullptr) {
      view.emplace_back(static_cast<const std::byte*>(src), TotalBytes(pieces));
    } else {
      for (const auto& piece : pieces) view.emplace_back(piece.data(), piece.size());
    }
    if (!p->recv_sealer->Check(op.seq, view, op.payload_tag)) return false;
    if (src != nullptr) CopyInto(src, pieces);
    return true;
  }

  static void CopyInto(const void* data, const MutablePieces& pieces) {
    const auto* src = static_cast<const std::byte*>(data);
    for (const auto& piece : pieces) {
      std::memcpy(piece.data(), src, piece.size());
      src += piece.size();
    }
  }

  static absl::Status PayloadRefused(PeerId from) {
    return absl::DataLossError(absl::StrCat("payload from peer ", from,
                                            " fails authentication (forged, or corrupted in transit); the "
                                            "connection is closed"));
  }

  // A keyed message's header (message_auth.h): checks its tag and sequence
  // number and fills `msg`'s header and `op`'s seal fields; PermissionDenied
  // saying why it is refused.
  static absl::Status Unseal(Peer* p, const void* header, size_t header_length, size_t payload_length, Inbound* msg,
                             RecvOp* op) {
    if (header_length < kSealedPrefixBytes + kSealedSuffixBytes) {
      return absl::PermissionDeniedError(
          absl::StrCat("a message of ", header_length, " header bytes, too short to be authenticated"));
    }
    const std::string_view all(static_cast<const char*>(header), header_length);
    const std::string_view tag = all.substr(header_length - ucx_wire::kTagBytes);
    if (!ucx_wire::SameProof(
            ucx_wire::HeaderTag(p->recv_mac_key, all.substr(0, header_length - ucx_wire::kTagBytes), payload_length),
            tag)) {
      return absl::PermissionDeniedError("a message whose header fails authentication (forged, or corrupted)");
    }
    const auto flags = static_cast<uint8_t>(all[kDataPrefixBytes]);
    if ((flags & ~kEncryptedFlag) != 0) {
      return absl::PermissionDeniedError(absl::StrCat("a message with unknown flags 0x", absl::Hex(flags)));
    }
    op->seq = LoadLe64(all.data() + kDataPrefixBytes + 1);
    if (!p->received.Accept(op->seq)) {
      return absl::PermissionDeniedError(
          absl::StrCat("a replayed message (sequence number ", op->seq, " was taken before, or is too old)"));
    }
    op->sealed = true;
    op->encrypted = (flags & kEncryptedFlag) != 0;
    op->payload_tag.assign(all.substr(header_length - kSealedSuffixBytes, ucx_wire::kTagBytes));
    msg->header.assign(all.data() + kSealedPrefixBytes, header_length - kSealedPrefixBytes - kSealedSuffixBytes);
    return absl::OkStatus();
  }

  // A message on keyed connection `p` failed authentication: the
  // connection is closed (its peer, or someone on the path, cannot be
  // trusted with it any more).
  void AuthFailed(Peer* p, const absl::Status& why) {
    log::Warn("data plane: closing connection {} ({}): {}", p->id, p->address, std::string(why.message()));
    PeerDown(p, why);
  }

  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxImpl*>(arg);
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (self->stopping_) return UCS_OK;  // dropped: the sender is cancelled or told OK
    if (header_length < kDataPrefixBytes) {
      log::Warn("UCX transport dropped a malformed message ({} header bytes)", header_length);
      return UCS_OK;
    }
    Peer* p = self->FindPeer(header, header_length, kDataPrefixBytes, PeerState::kConnected);
    if (p == nullptr) {
      log::Debug("UCX transport dropped a message for connection {}, which is not open",
                 LoadLe64(header));
      return UCS_OK;
    }
    if (ArrivedOn(param) != p->bound_ep) {
      // Someone else's endpoint naming this connection: not its peer.
      self->NoteForeign(*p);
      return UCS_OK;
    }
    const auto* h = static_cast<const unsigned char*>(header);
    Inbound msg;
    msg.from = p->id;
    msg.type = static_cast<uint16_t>(LoadLe(h + kIdBytes, kTypeBytes));
    RecvOp seal;  // a keyed connection's sequence number and payload tag
    if (p->recv_sealer != nullptr) {
      if (absl::Status s = Unseal(p, header, header_length, length, &msg, &seal); !s.ok()) {
        self->AuthFailed(p, s);
        return UCS_OK;  // dropped unread (a rendezvous payload is never fetched)
      }
    } else {
      msg.header.assign(reinterpret_cast<const char*>(h) + kDataPrefixBytes, header_length - kDataPrefixBytes);
    }
    msg.payload_bytes = length;
    Handler* handler = self->handler_;
    if (length == 0) {
      handler->OnReceived(msg, absl::OkStatus());
      return UCS_OK;
    }
    absl::StatusOr<MutablePieces> dest = handler->Allocate(msg);
    if (!dest.ok()) {
      handler->OnReceived(msg, dest.status());
      return UCS_OK;  // the payload is dropped; the sender's send still completes
    }
    if (TotalBytes(*dest) != length) {
      handler->OnReceived(msg, absl::InternalError(absl::StrCat(
                                   "Allocate returned ", TotalBytes(*dest), " bytes for a ",
                                   length, "-byte payload")));
      return UCS_OK;
    }
    if (!rndv) {
      // Eager: the bytes are here already; one copy (or decryption) into
      // the pieces.
      if (!seal.sealed) {
        CopyInto(data, *dest);
      } else if (!OpenPayload(p, seal, data, *dest)) {
        const absl::Status refused = PayloadRefused(p->id);
        handler->OnReceived(msg, refused);
        self->AuthFailed(p, absl::PermissionDeniedError(refused.message()));
        return UCS_OK;
      }
      handler->OnReceived(msg, absl::OkStatus());
      return UCS_OK;
    }
    auto op = std::make_unique<RecvOp>(std::move(seal));
    op->owner = self;
    op->msg = std::move(msg);
    for (auto& piece : *dest) {
      if (!piece.empty()) op->iov.push_back(ucp_dt_iov_t{piece.data(), piece.size()});
    }
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &UcxImpl::OnRecvDone;
    rp.user_data = op.get();
    void* buffer = op->iov[0].buffer;
    size_t count = op->iov[0].length;
    if (op->iov.size() > 1) {
      rp.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
      rp.datatype = ucp_dt_make_iov();
      buffer = op->iov.data();
      count = op->iov.size();
    }
    void* req = ucp_am_recv_data_nbx(self->worker_, data, buffer, count, &rp);
    if (req == nullptr) {
      self->FinishRecv(*op, absl::OkStatus());
    } else if (UCS_PTR_IS_ERR(req)) {
      handler->OnReceived(op->msg, absl::UnavailableError(absl::StrCat(
                                       "payload from peer ", op->msg.from, ": ",
                                       UcsError(UCS_PTR_STATUS(req)))));
    } else {
      ++self->recvs_in_flight_;
      self->inflight_recvs_[req] = op.release();  // OnRecvDone owns it now
    }
    return UCS_INPROGRESS;  // the descriptor is consumed by ucp_am_recv_data_nbx
  }

  const UcxOptions options_;
  Handler* handler_ = nullptr;
  std::string address_;
  const int event_fd_;  // wakes the progress thread; lives as long as the object
  std::thread thread_;
  std::thread::id thread_id_;

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int worker_fd_ = -1;
  std::string worker_address_;  // ours, as sent in greetings

  absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_requested_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  std::string auth_key_ ABSL_GUARDED_BY(mu_);  // what new handshakes use

  // Progress thread only.
  int listen_fd_ = -1;   // the data port
  absl::Time accept_paused_until_ = absl::InfinitePast();
  std::list<Pending> pending_;
  size_t inbound_handshakes_ = 0;  // inbound peers between their greeting and the UCX hello
  uint64_t refused_ = 0;
  absl::Time last_refusal_log_ = absl::InfinitePast();
  bool stopping_ = false;
  bool probing_ = false;  // SelfCheck running: new peers are silent
  bool round_slept_ = false;  // the current round's wait expired with nothing ready (progress thread)
  std::atomic<uint64_t> slept_rounds_{0}, woken_rounds_{0};  // TEST_progress_rounds
  std::string probe_key_;  // the self-check's key (a throwaway one if none is known yet)
  uint64_t foreign_ = 0;  // messages dropped because they came on another endpoint
  absl::Time last_foreign_log_ = absl::InfinitePast();
  std::map<PeerId, std::unique_ptr<Peer>> peers_;
  std::vector<std::unique_ptr<Remote>> remotes_;        // every endpoint ever opened
  std::map<std::string, Remote*> remote_by_address_;   // the open one per worker address
  std::deque<PeerId> deferred_accepts_;  // hellos received inside ucp_worker_progress
  std::vector<ucp_mem_h> memhs_;
  int closing_ = 0;
  int sends_in_flight_ = 0;
  int recvs_in_flight_ = 0;
  // Those sends and receives by UCX request (progress thread only): what
  // Shutdown ends itself when a peer does not let them finish.
  absl::flat_hash_map<void*, SendOp*> inflight_sends_;
  absl::flat_hash_map<void*, RecvOp*> inflight_recvs_;
  // Keyed connections' sealing keys, by our id for the connection (Send
  // seals on its caller's thread).
  mutable absl::Mutex crypto_mu_;
  absl::flat_hash_map<PeerId, std::shared_ptr<SendCrypto>> send_crypto_ ABSL_GUARDED_BY(crypto_mu_);
  absl::Mutex scratch_mu_;
  std::vector<std::vector<std::byte>> scratch_pool_ ABSL_GUARDED_BY(scratch_mu_);  // encryption buffers to reuse
  size_t scratch_pool_bytes_ ABSL_GUARDED_BY(scratch_mu_) = 0;
  bool abandon_worker_ = false;  // Shutdown could not finish: never destroy the worker
};

SendOp::~SendOp() {
  if (owner != nullptr && !scratch.empty()) owner->RecycleScratch(std::move(scratch));
}

}  // namespace

std::unique_ptr<UcxTransport> NewUcxTransport(const UcxOptions& options) {
  return std::make_unique<UcxImpl>(options);
}

}  // namespace ckpt::transport
