#include "transport/fault/fault_transport.h"

#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace ckpt::transport {

namespace {
enum class Kind { kFail, kStall, kCorrupt };
struct Rule {
  Kind kind;
  int n;
  std::optional<uint16_t> type;
  uint64_t offset = 0;
};
struct HeldReceive {
  Inbound msg;
  MutablePieces app_pieces;                      // where the application wants it
  std::shared_ptr<std::vector<std::byte>> data;  // where it waits meanwhile
  bool received = false;                         // the inner transport finished it
  absl::Status status;
};
struct HeldSend {
  PeerId peer;
  uint16_t type;
  std::string header;
  ConstPieces payload;
  SendDone done;
};
}  // namespace

struct FaultTransport::State : public Handler {
  explicit State(Transport* inner) : inner(inner) {
    thread = std::thread([this] { RunCompletions(); });
  }

  // Handler wrapper: blackholes dropped peers, stalls chosen receives.
  absl::StatusOr<MutablePieces> Allocate(const Inbound& msg) override {
    if (IsDropped(msg.from)) return absl::UnavailableError("peer dropped by fault plan");
    absl::StatusOr<MutablePieces> pieces = app->Allocate(msg);
    if (!pieces.ok()) return pieces;
    absl::MutexLock lock(&mu);
    const int total = ++receives;
    const int of_type = ++receives_per_type[msg.type];
    for (auto it = receive_rules.begin(); it != receive_rules.end(); ++it) {
      const int count = it->type.has_value() ? (*it->type == msg.type ? of_type : -1) : total;
      if (count != it->n) continue;
      receive_rules.erase(it);
      auto buf = std::make_shared<std::vector<std::byte>>(msg.payload_bytes);
      held_receives.push_back(HeldReceive{msg, *pieces, buf, false, absl::OkStatus()});
      return MutablePieces{std::span<std::byte>(buf->data(), buf->size())};
    }
    return pieces;
  }
  void OnReceived(const Inbound& msg, const absl::Status& status) override {
    if (IsDropped(msg.from)) return;
    {
      absl::MutexLock lock(&mu);
      for (HeldReceive& h : held_receives) {
        if (!h.received && h.msg.from == msg.from && h.msg.type == msg.type && h.msg.header == msg.header) {
          h.received = true;  // landed in our buffer; the application sees it on release
          h.status = status;
          return;
        }
      }
    }
    app->OnReceived(msg, status);
  }
  void OnPeerFailed(PeerId peer, const absl::Status& why) override { app->OnPeerFailed(peer, why); }

  bool IsDropped(PeerId p) {
    absl::MutexLock lock(&mu);
    return dropped.contains(p);
  }

  // Runs `fn` on the completion thread (inline once stopped: nobody else will).
  void Complete(SendDone done, absl::Status s) {
    {
      absl::MutexLock lock(&mu);
      if (!stopped) {
        completions.push_back([done = std::move(done), s] { done(s); });
        return;
      }
    }
    done(s);
  }

  void RunCompletions() {
    for (;;) {
      std::deque<std::function<void()>> batch;
      {
        absl::MutexLock lock(&mu);
        mu.Await(absl::Condition(
            +[](State* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
              return s->stopped || !s->completions.empty();
            },
            this));
        if (completions.empty() && stopped) return;
        batch.swap(completions);
      }
      for (auto& fn : batch) fn();
    }
  }

  Transport* inner;
  Handler* app = nullptr;
  std::thread thread;
  mutable absl::Mutex mu;
  bool stopped ABSL_GUARDED_BY(mu) = false;
  std::deque<std::function<void()>> completions ABSL_GUARDED_BY(mu);
  std::vector<Rule> rules ABSL_GUARDED_BY(mu);
  int total ABSL_GUARDED_BY(mu) = 0;
  std::map<uint16_t, int> per_type ABSL_GUARDED_BY(mu);
  std::set<PeerId> dropped ABSL_GUARDED_BY(mu);
  std::vector<HeldSend> held ABSL_GUARDED_BY(mu);
  std::vector<Rule> receive_rules ABSL_GUARDED_BY(mu);
  int receives ABSL_GUARDED_BY(mu) = 0;
  std::map<uint16_t, int> receives_per_type ABSL_GUARDED_BY(mu);
  std::vector<HeldReceive> held_receives ABSL_GUARDED_BY(mu);
};

FaultTransport::FaultTransport(Transport* inner)
    : inner_(inner), state_(std::make_unique<State>(inner)) {}

FaultTransport::FaultTransport(std::unique_ptr<Transport> inner)
    : owned_(std::move(inner)), inner_(owned_.get()), state_(std::make_unique<State>(inner_)) {}

FaultTransport::~FaultTransport() { Stop(); }

void FaultTransport::FailNthSend(int n, std::optional<uint16_t> type) {
  absl::MutexLock lock(&state_->mu);
  state_->rules.push_back(Rule{Kind::kFail, n, type});
}
void FaultTransport::StallNthSend(int n, std::optional<uint16_t> type) {
  absl::MutexLock lock(&state_->mu);
  state_->rules.push_back(Rule{Kind::kStall, n, type});
}
void FaultTransport::CorruptNthSend(int n, uint64_t offset, std::optional<uint16_t> type) {
  absl::MutexLock lock(&state_->mu);
  state_->rules.push_back(Rule{Kind::kCorrupt, n, type, offset});
}

void FaultTransport::DropPeer(PeerId peer) {
  {
    absl::MutexLock lock(&state_->mu);
    state_->dropped.insert(peer);
  }
  inner_->Disconnect(peer);
}

void FaultTransport::Release() {
  std::vector<HeldSend> held;
  {
    absl::MutexLock lock(&state_->mu);
    held.swap(state_->held);
  }
  for (HeldSend& h : held) {
    inner_->Send(h.peer, h.type, std::move(h.header), std::move(h.payload), std::move(h.done));
  }
}

void FaultTransport::StallNthReceive(int n, std::optional<uint16_t> type) {
  absl::MutexLock lock(&state_->mu);
  state_->receive_rules.push_back(Rule{Kind::kStall, n, type});
}

void FaultTransport::ReleaseReceives() {
  std::vector<HeldReceive> held;
  {
    absl::MutexLock lock(&state_->mu);
    held.swap(state_->held_receives);
  }
  for (HeldReceive& h : held) {
    uint64_t done = 0;
    for (const auto& p : h.app_pieces) {
      std::memcpy(p.data(), h.data->data() + done, p.size());
      done += p.size();
    }
    state_->app->OnReceived(h.msg, h.received ? h.status : absl::OkStatus());
  }
}

int FaultTransport::stalled_receives() const {
  absl::MutexLock lock(&state_->mu);
  return static_cast<int>(state_->held_receives.size());
}

int FaultTransport::sends() const {
  absl::MutexLock lock(&state_->mu);
  return state_->total;
}
int FaultTransport::sends(uint16_t type) const {
  absl::MutexLock lock(&state_->mu);
  auto it = state_->per_type.find(type);
  return it == state_->per_type.end() ? 0 : it->second;
}
int FaultTransport::stalled() const {
  absl::MutexLock lock(&state_->mu);
  return static_cast<int>(state_->held.size());
}

absl::Status FaultTransport::Start(const std::string& listen_address, Handler* handler) {
  state_->app = handler;
  return inner_->Start(listen_address, state_.get());
}

std::string FaultTransport::address() const { return inner_->address(); }

absl::StatusOr<PeerId> FaultTransport::Connect(const std::string& address, int64_t timeout_ms) {
  return inner_->Connect(address, timeout_ms);
}

void FaultTransport::Send(PeerId peer, uint16_t type, std::string header, ConstPieces payload,
                          SendDone done) {
  std::optional<Rule> fired;
  absl::Status fail;
  {
    absl::MutexLock lock(&state_->mu);
    const int total = ++state_->total;
    const int of_type = ++state_->per_type[type];
    if (state_->dropped.contains(peer)) {
      fail = absl::UnavailableError(absl::StrCat("peer ", peer, " dropped by fault plan"));
    }
    for (auto it = state_->rules.begin(); it != state_->rules.end(); ++it) {
      const int count = it->type.has_value() ? (*it->type == type ? of_type : -1) : total;
      if (fail.ok() && count == it->n) {
        fired = *it;
        state_->rules.erase(it);
        break;
      }
    }
    if (fired && fired->kind == Kind::kFail) {
      fail = absl::UnavailableError(absl::StrCat("send ", total, " failed by fault plan"));
    }
    if (fired && fired->kind == Kind::kStall) {
      state_->held.push_back(
          HeldSend{peer, type, std::move(header), std::move(payload), std::move(done)});
      return;
    }
  }
  if (!fail.ok()) {
    state_->Complete(std::move(done), std::move(fail));  // takes mu itself
    return;
  }
  if (fired && fired->kind == Kind::kCorrupt && TotalBytes(payload) > 0) {
    // A private copy, so the caller's memory (maybe a replica's source) stays intact.
    auto copy = std::make_shared<std::vector<std::byte>>();
    copy->reserve(TotalBytes(payload));
    for (const auto& p : payload) copy->insert(copy->end(), p.begin(), p.end());
    (*copy)[fired->offset % copy->size()] ^= std::byte{0xff};
    ConstPieces pieces{std::span<const std::byte>(*copy)};
    inner_->Send(peer, type, std::move(header), std::move(pieces),
                 [copy, done = std::move(done)](const absl::Status& s) { done(s); });
    return;
  }
  inner_->Send(peer, type, std::move(header), std::move(payload), std::move(done));
}

void FaultTransport::Disconnect(PeerId peer) { inner_->Disconnect(peer); }

absl::Status FaultTransport::RegisterMemory(void* base, size_t length) {
  return inner_->RegisterMemory(base, length);
}

std::string FaultTransport::PeerIdentity(PeerId peer) const { return inner_->PeerIdentity(peer); }

void FaultTransport::Stop() {
  inner_->Stop();
  std::vector<HeldSend> held;
  {
    absl::MutexLock lock(&state_->mu);
    if (state_->stopped) return;
    state_->stopped = true;
    held.swap(state_->held);
  }
  state_->thread.join();
  for (HeldSend& h : held) h.done(absl::CancelledError("transport stopped"));
}

}  // namespace ckpt::transport
