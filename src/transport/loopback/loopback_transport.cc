#include "transport/loopback/loopback_transport.h"

#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "transport/bulk.h"

namespace ckpt::transport {
namespace {

class Loopback;

struct Registry {
  absl::Mutex mu;
  std::map<std::string, std::shared_ptr<Loopback>> by_name ABSL_GUARDED_BY(mu);
};
Registry& GlobalRegistry() {
  static auto* r = new Registry;
  return *r;
}

class Loopback : public std::enable_shared_from_this<Loopback> {
 public:
  // Runs `fn` on this transport's delivery thread. False if stopped.
  bool Post(std::function<void()> fn) {
    absl::MutexLock lock(&mu_);
    if (stopped_) return false;
    queue_.push_back(std::move(fn));
    return true;
  }

  absl::Status Start(const std::string& address, Handler* handler) {
    if (address.rfind("loop:", 0) != 0 || address.size() == 5) {
      return absl::InvalidArgumentError(
          absl::StrCat("loopback address must be \"loop:<name>\", got \"", address, "\""));
    }
    {
      absl::MutexLock lock(&GlobalRegistry().mu);
      auto [it, added] = GlobalRegistry().by_name.emplace(address, shared_from_this());
      if (!added) return absl::UnavailableError(absl::StrCat(address, " is already in use"));
    }
    address_ = address;
    handler_ = handler;
    thread_ = std::thread([this] { Run(); });
    return absl::OkStatus();
  }

  const std::string& address() const { return address_; }

  absl::StatusOr<PeerId> Connect(const std::string& address) {
    std::shared_ptr<Loopback> remote;
    {
      absl::MutexLock lock(&GlobalRegistry().mu);
      auto it = GlobalRegistry().by_name.find(address);
      if (it != GlobalRegistry().by_name.end()) remote = it->second;
    }
    if (remote == nullptr) return absl::UnavailableError(absl::StrCat("no transport listens on ", address));
    // Each connection is a pair of ids, one per side, that know each other:
    // closing one connection never touches another between the same two.
    PeerId id = 0;
    {
      absl::MutexLock lock(&mu_);
      id = next_peer_++;
      peers_[id] = Peer{remote, 0, /*failed=*/true};  // usable once accepted
    }
    const PeerId remote_side = remote->Accept(shared_from_this(), id);
    absl::MutexLock lock(&mu_);
    if (remote_side == 0) {
      peers_.erase(id);
      return absl::UnavailableError(absl::StrCat(address, " is shutting down"));
    }
    peers_[id] = Peer{remote, remote_side, false};
    return id;
  }

  // The remote side of a new connection: registers `from`'s connection
  // `from_id` as a peer.
  PeerId Accept(const std::shared_ptr<Loopback>& from, PeerId from_id) {
    absl::MutexLock lock(&mu_);
    if (stopped_) return 0;
    const PeerId id = next_peer_++;
    peers_[id] = Peer{from, from_id, false};
    return id;
  }

  void Send(PeerId peer, uint16_t type, std::string header, ConstPieces payload, SendDone done) {
    if (header.size() > kMaxHeaderBytes) {
      Complete(std::move(done), absl::InvalidArgumentError(absl::StrCat(
                                    "header of ", header.size(), " bytes exceeds ", kMaxHeaderBytes)));
      return;
    }
    std::shared_ptr<Loopback> remote;
    PeerId remote_id = 0;
    {
      absl::MutexLock lock(&mu_);
      auto it = peers_.find(peer);
      if (it != peers_.end() && !it->second.failed) {
        remote = it->second.remote.lock();
        remote_id = it->second.remote_id;
      }
    }
    if (remote == nullptr || remote_id == 0) {
      Complete(std::move(done), absl::UnavailableError(absl::StrCat("peer ", peer, " is not connected")));
      return;
    }
    auto self = shared_from_this();
    Inbound msg{remote_id, type, std::move(header), TotalBytes(payload)};
    const bool posted = remote->Post([remote, self, msg, payload, done]() mutable {
      absl::Status st;
      if (msg.payload_bytes > 0) {
        auto dest = remote->handler_->Allocate(msg);
        if (!dest.ok()) {
          st = dest.status();
        } else if (TotalBytes(*dest) != msg.payload_bytes) {
          st = absl::InternalError("Allocate returned the wrong number of bytes");
        } else {
          uint64_t off = 0;
          for (auto& d : *dest) {
            uint64_t done_here = 0;
            for (const auto& piece : SlicePieces(payload, off, d.size())) {
              std::memcpy(d.data() + done_here, piece.data(), piece.size());
              done_here += piece.size();
            }
            off += d.size();
          }
        }
      }
      remote->handler_->OnReceived(msg, st);
      // The sender learns the payload may be reused (always OK: it was read).
      self->Complete(std::move(done), absl::OkStatus());
    });
    if (!posted) Complete(std::move(done), absl::UnavailableError("peer stopped"));
  }

  void Disconnect(PeerId peer) {
    std::shared_ptr<Loopback> remote;
    PeerId remote_id = 0;
    {
      absl::MutexLock lock(&mu_);
      auto it = peers_.find(peer);
      if (it == peers_.end() || it->second.failed) return;
      it->second.failed = true;
      remote = it->second.remote.lock();
      remote_id = it->second.remote_id;
    }
    Post([this, peer] { handler_->OnPeerFailed(peer, absl::CancelledError("disconnected")); });
    if (remote) remote->ConnectionClosed(remote_id);
  }

  // The other end closed connection `id` (only that one).
  void ConnectionClosed(PeerId id) {
    {
      absl::MutexLock lock(&mu_);
      auto it = peers_.find(id);
      if (it == peers_.end() || it->second.failed) return;
      it->second.failed = true;
    }
    Post([this, id] { handler_->OnPeerFailed(id, absl::UnavailableError("peer closed the connection")); });
  }

  // The process at the other end of some connections died or disconnected.
  void RemoteGone(const Loopback* other) {
    std::vector<PeerId> gone;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [id, p] : peers_) {
        if (!p.failed && p.remote.lock().get() == other) {
          p.failed = true;
          gone.push_back(id);
        }
      }
    }
    for (PeerId id : gone) {
      Post([this, id] { handler_->OnPeerFailed(id, absl::UnavailableError("peer stopped")); });
    }
  }

  void Stop() {
    std::vector<std::shared_ptr<Loopback>> remotes;
    {
      absl::MutexLock lock(&mu_);
      if (stopped_) return;
      for (auto& [id, p] : peers_)
        if (auto r = p.remote.lock()) remotes.push_back(r);
    }
    {
      absl::MutexLock lock(&GlobalRegistry().mu);
      GlobalRegistry().by_name.erase(address_);
    }
    for (auto& r : remotes) r->RemoteGone(this);
    {
      absl::MutexLock lock(&mu_);
      stopped_ = true;
    }
    if (thread_.joinable()) thread_.join();
    absl::MutexLock lock(&mu_);
    peers_.clear();
  }

 private:
  struct Peer {
    std::weak_ptr<Loopback> remote;
    PeerId remote_id = 0;  // this connection's id at the other end
    bool failed = false;
  };

  void Complete(SendDone done, absl::Status s) {
    if (!Post([done, s] { done(s); })) done(absl::CancelledError("transport stopped"));
  }

  void Run() {
    for (;;) {
      std::deque<std::function<void()>> batch;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](Loopback* l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(l->mu_) { return l->stopped_ || !l->queue_.empty(); },
            this));
        if (queue_.empty() && stopped_) return;
        batch.swap(queue_);
      }
      for (auto& fn : batch) fn();
    }
  }

  std::string address_;
  Handler* handler_ = nullptr;
  std::thread thread_;
  absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  PeerId next_peer_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<PeerId, Peer> peers_ ABSL_GUARDED_BY(mu_);
};

class LoopbackTransport : public Transport {
 public:
  LoopbackTransport() : impl_(std::make_shared<Loopback>()) {}
  ~LoopbackTransport() override { Stop(); }
  absl::Status Start(const std::string& listen_address, Handler* handler) override {
    return impl_->Start(listen_address, handler);
  }
  std::string address() const override { return impl_->address(); }
  absl::StatusOr<PeerId> Connect(const std::string& address, int64_t timeout_ms) override {
    return impl_->Connect(address);
  }
  void Send(PeerId peer, uint16_t type, std::string header, ConstPieces payload, SendDone done) override {
    impl_->Send(peer, type, std::move(header), std::move(payload), std::move(done));
  }
  void Disconnect(PeerId peer) override { impl_->Disconnect(peer); }
  absl::Status RegisterMemory(void*, size_t) override { return absl::OkStatus(); }
  void Stop() override { impl_->Stop(); }

 private:
  std::shared_ptr<Loopback> impl_;
};

}  // namespace

std::unique_ptr<Transport> NewLoopbackTransport() { return std::make_unique<LoopbackTransport>(); }

}  // namespace ckpt::transport
