#include "transport/ucx/ucx_transport.h"

#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <thread>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log.h"

namespace ckpt::transport {
namespace {

constexpr unsigned kAmId = 0;
constexpr unsigned kHelloAmId = 1;  // server -> client once accepted; empty
constexpr size_t kTypeBytes = sizeof(uint16_t);

std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

// "host:port" -> sockaddr. Port 0 is allowed (listen picks one).
absl::Status ParseAddress(const std::string& address, bool passive, sockaddr_storage* out,
                          socklen_t* out_len) {
  const size_t colon = address.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("UCX address must be \"host:port\", got \"", address, "\""));
  }
  const std::string host = address.substr(0, colon);
  addrinfo hints{};
  hints.ai_family = AF_INET;  // UCX's tcp sockcm handles IPv4 best
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve \"", host, "\": ", gai_strerror(rc)));
  }
  std::memcpy(out, res->ai_addr, res->ai_addrlen);
  *out_len = res->ai_addrlen;
  freeaddrinfo(res);
  reinterpret_cast<sockaddr_in*>(out)->sin_port = htons(static_cast<uint16_t>(port));
  return absl::OkStatus();
}

class UcxTransport;

struct ConnectWait {
  absl::Notification done;
  absl::Status status;  // written before done.Notify()
  PeerId id = 0;
};

// One connection. Lives in peers_ until Stop (ids are never reused, and the
// raw pointer is the ep's error-callback argument).
struct Peer {
  UcxTransport* owner = nullptr;
  PeerId id = 0;
  std::string address;  // for messages; "inbound" for accepted connections
  ucp_ep_h ep = nullptr;
  bool failed = false;
  absl::Status fail_status;  // what sends still in flight complete with
  std::shared_ptr<ConnectWait> connect;  // set while Connect() waits
  bool silent = false;  // Start's self-check: never reported to the handler
};

struct SendOp {
  UcxTransport* owner = nullptr;
  Peer* peer = nullptr;
  std::string am_header;            // must outlive the send (UCX 1.13)
  std::vector<ucp_dt_iov_t> iov;    // ditto
  SendDone done;
};

struct RecvOp {
  UcxTransport* owner = nullptr;
  Inbound msg;
  std::vector<ucp_dt_iov_t> iov;
};

class UcxTransport : public Transport {
 public:
  explicit UcxTransport(const UcxOptions& options)
      : options_(options), event_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  ~UcxTransport() override {
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
    sockaddr_storage addr{};
    socklen_t addr_len = 0;
    if (absl::Status s = ParseAddress(listen_address, true, &addr, &addr_len); !s.ok()) return s;
    if (event_fd_ < 0) return absl::UnavailableError("eventfd failed");
    handler_ = handler;
    // UCX ties a worker's async context to the thread that creates it, so the
    // progress thread creates, drives and destroys every UCX object.
    auto init = std::make_shared<ConnectWait>();
    thread_ = std::thread([this, init, addr, addr_len, listen_address] {
      thread_id_ = std::this_thread::get_id();
      init->status = InitUcx(addr, addr_len, listen_address);
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
    sockaddr_storage addr{};
    socklen_t addr_len = 0;
    if (absl::Status s = ParseAddress(address, false, &addr, &addr_len); !s.ok()) return s;
    auto wait = std::make_shared<ConnectWait>();
    const bool posted = Post([this, wait, addr, addr_len, address] {
      StartConnect(wait, addr, addr_len, address);
    });
    if (!posted) return absl::UnavailableError(absl::StrCat("connect to ", address, ": transport stopped"));
    if (!wait->done.WaitForNotificationWithTimeout(absl::Milliseconds(timeout_ms))) {
      // Give up on the half-open endpoint; its late completion is ignored.
      Post([this, wait] { AbandonConnect(wait); });
      return absl::UnavailableError(
          absl::StrCat("connect to ", address, " timed out after ", timeout_ms, " ms"));
    }
    if (!wait->status.ok()) return wait->status;
    return wait->id;
  }

  void Send(PeerId peer, uint16_t type, std::string header, ConstPieces payload,
            SendDone done) override {
    auto op = std::make_unique<SendOp>();
    op->owner = this;
    op->am_header.resize(kTypeBytes + header.size());
    op->am_header[0] = static_cast<char>(type & 0xff);
    op->am_header[1] = static_cast<char>(type >> 8);
    std::memcpy(op->am_header.data() + kTypeBytes, header.data(), header.size());
    for (const auto& p : payload) {
      if (!p.empty()) op->iov.push_back(ucp_dt_iov_t{const_cast<std::byte*>(p.data()), p.size()});
    }
    op->done = std::move(done);
    const size_t header_size = header.size();
    SendOp* raw = op.release();
    if (!Post([this, raw, peer, header_size] { StartSend(raw, peer, header_size); })) {
      std::unique_ptr<SendOp> owned(raw);
      owned->done(absl::CancelledError("UCX transport stopped"));
    }
  }

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
  // --- setup and teardown (caller's thread, progress thread not running) ---

  absl::Status InitUcx(const sockaddr_storage& addr, socklen_t addr_len,
                       const std::string& listen_address) {
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return absl::UnavailableError(absl::StrCat("UCX config: ", UcsError(st)));
    for (const auto& [name, value] : options_.config) {
      st = ucp_config_modify(config, name.c_str(), value.c_str());
      if (st != UCS_OK) {
        ucp_config_release(config);
        return absl::InvalidArgumentError(
            absl::StrCat("UCX option ", name, "=", value, ": ", UcsError(st)));
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
    ucp_am_handler_param_t ap{};
    ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    ap.id = kAmId;
    ap.cb = &UcxTransport::OnAm;
    ap.arg = this;
    ap.flags = UCP_AM_FLAG_WHOLE_MSG;
    st = ucp_worker_set_am_recv_handler(worker_, &ap);
    if (st != UCS_OK) {
      return absl::UnavailableError(
          absl::StrCat("UCX active messages unavailable: ", UcsError(st)));
    }
    ap.id = kHelloAmId;
    ap.cb = &UcxTransport::OnHello;
    st = ucp_worker_set_am_recv_handler(worker_, &ap);
    if (st != UCS_OK) {
      return absl::UnavailableError(
          absl::StrCat("UCX active messages unavailable: ", UcsError(st)));
    }
    if (options_.self_check_timeout_ms > 0) {
      if (absl::Status s = SelfCheck(); !s.ok()) return s;
    }
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    lp.sockaddr.addrlen = addr_len;
    lp.conn_handler.cb = &UcxTransport::OnConnRequest;
    lp.conn_handler.arg = this;
    st = ucp_listener_create(worker_, &lp, &listener_);
    if (st != UCS_OK) {
      listener_ = nullptr;
      return absl::UnavailableError(absl::StrCat("UCX cannot listen on ", listen_address, ": ",
                                                 UcsError(st),
                                                 " (no sockaddr-capable transport or port in use)"));
    }
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    st = ucp_listener_query(listener_, &la);
    if (st != UCS_OK) return absl::UnavailableError(absl::StrCat("UCX listener query: ", UcsError(st)));
    const auto* sin = reinterpret_cast<const sockaddr_in*>(&la.sockaddr);
    char ip[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &sin->sin_addr, ip, sizeof(ip));
    address_ = absl::StrCat(ip, ":", ntohs(sin->sin_port));
    return absl::OkStatus();
  }

  // UCX picks transports per connection, so a bad UCX_TLS (e.g. "cma" alone)
  // only shows when connecting. Connecting to a private listener on
  // 127.0.0.1 at start-up turns that into a clear Start error instead of
  // every later Connect timing out.
  absl::Status SelfCheck() {
    sockaddr_storage addr{};
    socklen_t addr_len = 0;
    if (absl::Status s = ParseAddress("127.0.0.1:0", true, &addr, &addr_len); !s.ok()) return s;
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    lp.sockaddr.addrlen = addr_len;
    lp.conn_handler.cb = &UcxTransport::OnConnRequest;
    lp.conn_handler.arg = this;
    ucs_status_t st = ucp_listener_create(worker_, &lp, &listener_);
    if (st != UCS_OK) {
      listener_ = nullptr;
      return absl::UnavailableError(absl::StrCat(
          "UCX cannot listen on 127.0.0.1 (no sockaddr-capable transport?): ", UcsError(st)));
    }
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    st = ucp_listener_query(listener_, &la);
    std::memcpy(&addr, &la.sockaddr, sizeof(sockaddr_in));
    probing_ = true;
    auto wait = std::make_shared<ConnectWait>();
    StartConnect(wait, addr, sizeof(sockaddr_in), "self-check");
    const absl::Time deadline = absl::Now() + absl::Milliseconds(options_.self_check_timeout_ms);
    while (!wait->done.HasBeenNotified() && absl::Now() < deadline) ProgressOrWait();
    absl::Status result = wait->done.HasBeenNotified() ? wait->status
                                                       : absl::DeadlineExceededError("timed out");
    for (auto& [id, peer] : peers_) {
      peer->connect = nullptr;
      if (!peer->failed) FailPeer(peer.get(), absl::CancelledError("self-check done"));
    }
    const absl::Time close_deadline = absl::Now() + absl::Milliseconds(options_.stop_timeout_ms);
    while (closing_ > 0 && absl::Now() < close_deadline) ProgressOrWait();
    peers_.clear();
    ep_to_peer_.clear();
    probing_ = false;
    ucp_listener_destroy(listener_);
    listener_ = nullptr;
    if (!result.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "UCX found no transport that can carry messages (check UCX_TLS; e.g. cma needs "
          "posix or sysv too): self-check connection failed: ", result.ToString()));
    }
    return absl::OkStatus();
  }

  // One round of progress, or a short sleep on the worker's fd if idle.
  void ProgressOrWait() {
    if (ucp_worker_progress(worker_) != 0) return;
    if (ucp_worker_arm(worker_) != UCS_OK) return;
    pollfd fd{worker_fd_, POLLIN, 0};
    poll(&fd, 1, 10);
  }

  void DestroyUcx() {
    if (listener_ != nullptr) ucp_listener_destroy(listener_);
    listener_ = nullptr;
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
      while (ucp_worker_progress(worker_) != 0) {
      }
      {
        absl::MutexLock lock(&mu_);
        if (!queue_.empty() || stop_requested_) continue;
      }
      const ucs_status_t st = ucp_worker_arm(worker_);
      if (st == UCS_ERR_BUSY) continue;  // events arrived meanwhile
      pollfd fds[2] = {{worker_fd_, POLLIN, 0}, {event_fd_, POLLIN, 0}};
      // The timeout only bounds how long UCX's own timers (keepalive) may
      // wait; all real work wakes one of the fds.
      poll(fds, 2, 1000);
      uint64_t count = 0;
      [[maybe_unused]] ssize_t n = read(event_fd_, &count, sizeof(count));
    }
    Shutdown();
  }

  void Shutdown() {
    stopping_ = true;
    for (auto& [id, peer] : peers_) {
      if (!peer->failed) FailPeer(peer.get(), absl::CancelledError("UCX transport stopped"));
      if (peer->connect) FinishConnect(peer.get(), absl::UnavailableError("UCX transport stopped"));
    }
    const absl::Time deadline = absl::Now() + absl::Milliseconds(options_.stop_timeout_ms);
    while ((closing_ > 0 || sends_in_flight_ > 0 || recvs_in_flight_ > 0) && absl::Now() < deadline) {
      ProgressOrWait();
    }
    if (closing_ > 0 || sends_in_flight_ > 0 || recvs_in_flight_ > 0) {
      log::Warn("UCX transport stopped with {} endpoint closes, {} sends, {} receives unfinished",
                closing_, sends_in_flight_, recvs_in_flight_);
    }
    for (ucp_mem_h memh : memhs_) ucp_mem_unmap(context_, memh);
    memhs_.clear();
    peers_.clear();
    ep_to_peer_.clear();
  }

  // Marks `p` failed and force-closes its endpoint: UCX completes its sends
  // in flight with an error, which OnSendDone reports as `why`.
  void FailPeer(Peer* p, absl::Status why) {
    p->failed = true;
    p->fail_status = std::move(why);
    if (p->ep == nullptr) return;
    ucp_ep_h ep = p->ep;
    p->ep = nullptr;
    ep_to_peer_.erase(ep);
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    rp.cb.send = &UcxTransport::OnClosed;
    rp.user_data = this;
    void* req = ucp_ep_close_nbx(ep, &rp);
    if (UCS_PTR_IS_PTR(req)) ++closing_;
  }

  PeerId AddPeer(ucp_ep_h ep, std::string address) {
    auto p = std::make_unique<Peer>();
    p->owner = this;
    p->id = next_peer_++;
    p->address = std::move(address);
    p->ep = ep;
    ep_to_peer_[ep] = p->id;
    const PeerId id = p->id;
    peers_[id] = std::move(p);
    return id;
  }

  ucp_ep_params_t EpParams(Peer* arg) {
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &UcxTransport::OnEpError;
    ep.err_handler.arg = arg;
    return ep;
  }

  void StartConnect(const std::shared_ptr<ConnectWait>& wait, sockaddr_storage addr,
                    socklen_t addr_len, const std::string& address) {
    // The Peer exists before the ep so the error callback has its argument.
    auto owned = std::make_unique<Peer>();
    Peer* p = owned.get();
    p->owner = this;
    p->id = next_peer_++;
    p->address = address;
    p->connect = wait;
    p->silent = probing_;
    ucp_ep_params_t ep = EpParams(p);
    ep.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    ep.sockaddr.addrlen = addr_len;
    ucp_ep_h handle = nullptr;
    const ucs_status_t st = ucp_ep_create(worker_, &ep, &handle);
    if (st != UCS_OK) {
      wait->status = absl::UnavailableError(absl::StrCat("connect to ", address, ": ", UcsError(st)));
      wait->done.Notify();
      return;
    }
    p->ep = handle;
    ep_to_peer_[handle] = p->id;
    peers_[p->id] = std::move(owned);
    // Connect returns once the server's hello arrives (OnHello), or fails
    // through the ep's error callback. Nothing may be pending on the client
    // ep meanwhile: UCX 1.13 aborts on an assertion (wireup_ep.c:494) when a
    // request (flush or send) is queued on an endpoint whose connection is
    // then refused.
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

  void StartSend(SendOp* raw, PeerId peer_id, size_t header_size) {
    std::unique_ptr<SendOp> op(raw);
    if (header_size > kMaxHeaderBytes) {
      op->done(absl::InvalidArgumentError(
          absl::StrCat("header of ", header_size, " bytes exceeds ", kMaxHeaderBytes)));
      return;
    }
    auto it = peers_.find(peer_id);
    if (it == peers_.end() || it->second->failed || it->second->ep == nullptr) {
      op->done(absl::UnavailableError(absl::StrCat("peer ", peer_id, " is not connected")));
      return;
    }
    Peer* p = it->second.get();
    op->peer = p;
    uint64_t payload = 0;
    for (const auto& v : op->iov) payload += v.length;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                      UCP_OP_ATTR_FIELD_FLAGS;
    rp.cb.send = &UcxTransport::OnSendDone;
    rp.user_data = op.get();
    // REPLY: the receiver learns which of its endpoints the message came on.
    rp.flags = UCP_AM_SEND_FLAG_REPLY;
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
    void* req = ucp_am_send_nbx(p->ep, kAmId, op->am_header.data(), op->am_header.size(), buffer,
                                count, &rp);
    if (req == nullptr) {
      op->done(absl::OkStatus());
    } else if (UCS_PTR_IS_ERR(req)) {
      op->done(absl::UnavailableError(
          absl::StrCat("send to peer ", peer_id, ": ", UcsError(UCS_PTR_STATUS(req)))));
    } else {
      ++sends_in_flight_;
      op.release();  // OnSendDone owns it now
    }
  }

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

  // --- UCX callbacks (progress thread, inside ucp_worker_progress) ---

  static void OnConnRequest(ucp_conn_request_h request, void* arg) {
    auto* self = static_cast<UcxTransport*>(arg);
    if (self->stopping_) {
      ucp_listener_reject(self->listener_, request);
      return;
    }
    auto owned = std::make_unique<Peer>();
    Peer* p = owned.get();
    p->owner = self;
    p->id = self->next_peer_++;
    p->address = "inbound";
    p->silent = self->probing_;
    ucp_ep_params_t ep = self->EpParams(p);
    ep.field_mask |= UCP_EP_PARAM_FIELD_CONN_REQUEST;
    ep.conn_request = request;
    ucp_ep_h handle = nullptr;
    const ucs_status_t st = ucp_ep_create(self->worker_, &ep, &handle);
    if (st != UCS_OK) {
      log::Warn("UCX cannot accept a connection: {}", UcsError(st));
      return;
    }
    p->ep = handle;
    self->ep_to_peer_[handle] = p->id;
    self->peers_[p->id] = std::move(owned);
    // Tells the client its Connect is complete (see StartConnect).
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_FLAGS;
    rp.cb.send = &UcxTransport::OnHelloSent;
    rp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    void* req = ucp_am_send_nbx(handle, kHelloAmId, nullptr, 0, nullptr, 0, &rp);
    if (UCS_PTR_IS_ERR(req)) {
      log::Warn("UCX cannot greet an inbound connection: {}", UcsError(UCS_PTR_STATUS(req)));
    }
  }

  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* p = static_cast<Peer*>(arg);
    UcxTransport* self = p->owner;
    if (p->failed) return;  // we closed it ourselves
    const absl::Status why = absl::UnavailableError(
        absl::StrCat("peer ", p->id, " (", p->address, ") failed: ", UcsError(status)));
    self->FailPeer(p, why);
    if (p->connect != nullptr) {
      self->FinishConnect(p, absl::UnavailableError(absl::StrCat("connect to ", p->address, ": ",
                                                                 UcsError(status))));
      return;
    }
    if (!self->stopping_ && !p->silent) self->handler_->OnPeerFailed(p->id, why);
  }

  // The server accepted our connection and its endpoint works both ways.
  static ucs_status_t OnHello(void* arg, const void*, size_t, void*, size_t,
                              const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxTransport*>(arg);
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
    auto it = self->ep_to_peer_.find(param->reply_ep);
    if (it == self->ep_to_peer_.end()) return UCS_OK;
    Peer* p = self->peers_[it->second].get();
    if (!p->failed) self->FinishConnect(p, absl::OkStatus());
    return UCS_OK;
  }

  static void OnHelloSent(void* request, ucs_status_t, void*) { ucp_request_free(request); }

  static void OnClosed(void* request, ucs_status_t, void* user_data) {
    --static_cast<UcxTransport*>(user_data)->closing_;
    ucp_request_free(request);
  }

  static void OnSendDone(void* request, ucs_status_t status, void* user_data) {
    std::unique_ptr<SendOp> op(static_cast<SendOp*>(user_data));
    --op->owner->sends_in_flight_;
    ucp_request_free(request);
    if (status == UCS_OK) {
      op->done(absl::OkStatus());
    } else if (op->peer->failed) {
      op->done(op->peer->fail_status);
    } else {
      op->done(absl::UnavailableError(
          absl::StrCat("send to peer ", op->peer->id, ": ", UcsError(status))));
    }
  }

  static void OnRecvDone(void* request, ucs_status_t status, size_t, void* user_data) {
    std::unique_ptr<RecvOp> op(static_cast<RecvOp*>(user_data));
    --op->owner->recvs_in_flight_;
    ucp_request_free(request);
    op->owner->handler_->OnReceived(
        op->msg, status == UCS_OK ? absl::OkStatus()
                                  : absl::UnavailableError(absl::StrCat(
                                        "payload from peer ", op->msg.from, " lost: ", UcsError(status))));
  }

  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxTransport*>(arg);
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (self->stopping_) return UCS_OK;  // dropped: the sender is cancelled or told OK
    if (header_length < kTypeBytes || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
      log::Warn("UCX transport dropped a malformed message ({} header bytes)", header_length);
      return UCS_OK;
    }
    auto ep_it = self->ep_to_peer_.find(param->reply_ep);
    if (ep_it == self->ep_to_peer_.end()) {
      log::Warn("UCX transport dropped a message from an unknown endpoint");
      return UCS_OK;
    }
    const auto* h = static_cast<const unsigned char*>(header);
    Inbound msg;
    msg.from = ep_it->second;
    msg.type = static_cast<uint16_t>(h[0] | (h[1] << 8));
    msg.header.assign(reinterpret_cast<const char*>(h) + kTypeBytes, header_length - kTypeBytes);
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
      // Eager: the bytes are here already; one copy into the pieces.
      const auto* src = static_cast<const std::byte*>(data);
      for (auto& piece : *dest) {
        std::memcpy(piece.data(), src, piece.size());
        src += piece.size();
      }
      handler->OnReceived(msg, absl::OkStatus());
      return UCS_OK;
    }
    auto op = std::make_unique<RecvOp>();
    op->owner = self;
    op->msg = std::move(msg);
    for (auto& piece : *dest) {
      if (!piece.empty()) op->iov.push_back(ucp_dt_iov_t{piece.data(), piece.size()});
    }
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &UcxTransport::OnRecvDone;
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
      handler->OnReceived(op->msg, absl::OkStatus());
    } else if (UCS_PTR_IS_ERR(req)) {
      handler->OnReceived(op->msg, absl::UnavailableError(absl::StrCat(
                                       "payload from peer ", op->msg.from, ": ",
                                       UcsError(UCS_PTR_STATUS(req)))));
    } else {
      ++self->recvs_in_flight_;
      op.release();  // OnRecvDone owns it now
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
  ucp_listener_h listener_ = nullptr;
  int worker_fd_ = -1;

  absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_requested_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);

  // Progress thread only.
  bool stopping_ = false;
  bool probing_ = false;  // SelfCheck running: new peers are silent
  PeerId next_peer_ = 1;
  std::map<PeerId, std::unique_ptr<Peer>> peers_;
  std::unordered_map<ucp_ep_h, PeerId> ep_to_peer_;
  std::vector<ucp_mem_h> memhs_;
  int closing_ = 0;
  int sends_in_flight_ = 0;
  int recvs_in_flight_ = 0;
};

}  // namespace

std::unique_ptr<Transport> NewUcxTransport(const UcxOptions& options) {
  return std::make_unique<UcxTransport>(options);
}

}  // namespace ckpt::transport
