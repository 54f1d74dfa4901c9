#include "dpu_agent/ucx_puller.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/crypto.h"
#include "common/lock_check.h"
#include "common/log.h"

namespace ckpt::dpu {
namespace {

absl::Status UcxError(const std::string& what, ucs_status_t st) {
  return absl::UnavailableError(absl::StrCat(what, ": ", ucs_status_string(st)));
}

// The format version bits of a packed worker address's header byte.
constexpr uint8_t kAddressVersionMask = 0x0f;

// How long the destructor lets gets in flight end.
constexpr absl::Duration kStopGrace = absl::Seconds(10);

}  // namespace

absl::StatusOr<std::unique_ptr<UcxPuller>> UcxPuller::Create(Options options) {
  std::unique_ptr<UcxPuller> p(new UcxPuller(options));
  if (absl::Status s = p->Init(); !s.ok()) return s;
  p->thread_ = std::thread([raw = p.get()] {
    pthread_setname_np(pthread_self(), "ckpt-dpu-pull");
    raw->Loop();
  });
  return p;
}

absl::Status UcxPuller::Init() {
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return UcxError("ucp_config_read", st);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA;
  st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (st != UCS_OK) return UcxError("ucp_init", st);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only ckpt-dpu-pull touches it
  st = ucp_worker_create(context_, &wp, &worker_);
  if (st != UCS_OK) return UcxError("ucp_worker_create", st);
  ucp_address_t* address = nullptr;
  size_t address_len = 0;
  st = ucp_worker_get_address(worker_, &address, &address_len);
  if (st != UCS_OK || address_len == 0) return UcxError("ucp_worker_get_address", st);
  own_address_.assign(reinterpret_cast<const char*>(address), address_len);
  ucp_worker_release_address(worker_, address);
  return absl::OkStatus();
}

UcxPuller::~UcxPuller() {
  {
    CheckedLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

absl::Status UcxPuller::Pull(const agent::PullSource& source, const std::string& token, agent::ReservationPtr dst,
                             uint64_t size, absl::Duration timeout) {
  return Run(/*put=*/false, source, token, std::move(dst), size, timeout);
}

absl::Status UcxPuller::Push(const agent::PullSource& target, const std::string& token, agent::ReservationPtr src,
                             uint64_t size, absl::Duration timeout) {
  return Run(/*put=*/true, target, token, std::move(src), size, timeout);
}

absl::Status UcxPuller::Run(bool put, const agent::PullSource& source, const std::string& token,
                            agent::ReservationPtr dst, uint64_t size, absl::Duration timeout) {
  if (source.length < size + agent::kPullHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("pull_source registers ", source.length,
                                                   " bytes, fewer than the header's ", agent::kPullHeaderBytes,
                                                   " and the shard's ", size));
  }
  if (token.size() != agent::kPullTokenBytes) return absl::InternalError("pull token of the wrong size");
  if (dst == nullptr || dst->reserved_bytes() < size) {
    return absl::InternalError("the agent's side of a pull or push is smaller than the shard");
  }
  auto job = std::make_shared<Job>();
  job->put = put;
  job->source = source;
  job->token = token;
  job->dst = std::move(dst);
  job->size = size;
  job->deadline = absl::Now() + timeout;
  {
    CheckedLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the agent is shutting down");
    queue_.push_back(job);
  }
  job->done.WaitForNotification();  // the thread answers by the deadline
  return job->result;
}

void UcxPuller::Answer(Job& job, absl::Status status) {
  if (job.answered) return;
  job.answered = true;
  job.result = std::move(status);
  job.done.Notify();
}

absl::StatusOr<ucp_ep_h> UcxPuller::Endpoint(const std::string& worker_address) {
  for (auto it = endpoints_.begin(); it != endpoints_.end(); ++it) {
    if (it->first == worker_address) {
      endpoints_.splice(endpoints_.begin(), endpoints_, it);
      return it->second;
    }
  }
  // UCX 1.13 aborts the process (an assertion) on an address whose header
  // names another format version: such an address is refused here. (Random
  // bytes after a valid header are refused by UCX itself: tried.)
  if (worker_address.empty() || (static_cast<uint8_t>(worker_address[0]) & kAddressVersionMask) !=
                                    (static_cast<uint8_t>(own_address_[0]) & kAddressVersionMask)) {
    return absl::InvalidArgumentError("pull_source.worker_address is not a UCX worker address of this UCX version");
  }
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(worker_address.data());
  // One-sided reads of shared memory have no peer-failure handling in UCX
  // 1.13 (mode PEER finds no transport): a client's death is seen by its
  // session and by the commit's deadline instead.
  ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  ucp_ep_h h = nullptr;
  ucs_status_t st = ucp_ep_create(worker_, &ep, &h);
  if (st != UCS_OK) return UcxError("cannot reach the client's UCX worker", st);
  endpoints_.emplace_front(worker_address, h);
  while (endpoints_.size() > options_.max_endpoints) DropEndpoint(endpoints_.back().second);
  return h;
}

absl::StatusOr<UcxPuller::Key*> UcxPuller::UseKey(ucp_ep_h ep, const std::string& rkey) {
  for (auto it = keys_.begin(); it != keys_.end(); ++it) {
    if (it->ep == ep && !it->dead && it->packed == rkey) {
      keys_.splice(keys_.begin(), keys_, it);
      ++it->in_use;
      return &*it;
    }
  }
  ucp_rkey_h h = nullptr;
  ucs_status_t st = ucp_ep_rkey_unpack(ep, rkey.data(), &h);
  if (st != UCS_OK) return UcxError("cannot map the client's staging memory (did the client exit?)", st);
  keys_.push_front(Key{ep, rkey, h, 1, false, absl::Now()});
  return &keys_.front();
}

void UcxPuller::ReleaseKey(Key* key, bool failed) {
  --key->in_use;
  key->last_used = absl::Now();
  if (failed) key->dead = true;  // unpacked again next time
}

void UcxPuller::TrimKeys(absl::Time now) {
  size_t kept = 0;
  for (auto it = keys_.begin(); it != keys_.end();) {
    const bool drop = it->in_use == 0 && (it->dead || kept >= options_.max_keys || now - it->last_used >= options_.key_idle);
    if (!drop) {
      ++kept;
      ++it;
      continue;
    }
    ucp_rkey_destroy(it->rkey);  // unmaps the client's memory here
    it = keys_.erase(it);
  }
}

void UcxPuller::DropEndpoint(ucp_ep_h ep) {
  auto open = std::find_if(endpoints_.begin(), endpoints_.end(), [ep](const auto& e) { return e.second == ep; });
  if (open == endpoints_.end()) return;  // closed already
  endpoints_.erase(open);
  // Jobs on it see their requests end (cancelled if still in flight) and
  // must not close it again.
  for (const std::shared_ptr<Job>& job : active_) {
    if (job != nullptr && job->ep == ep) job->ep = nullptr;  // (null: moved while Loop compacts)
  }
  // Keys belong to their endpoint: release them first (those in use once
  // their jobs end; their gets fail with the endpoint).
  for (Key& k : keys_) {
    if (k.ep == ep) k.dead = true;
  }
  TrimKeys(absl::Now());
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &rp);
  if (UCS_PTR_IS_PTR(req)) {
    const absl::Time until = absl::Now() + absl::Seconds(1);
    while (ucp_request_check_status(req) == UCS_INPROGRESS && absl::Now() < until) ucp_worker_progress(worker_);
    ucp_request_free(req);
  }
}

bool UcxPuller::Start(Job& job) {
  absl::StatusOr<ucp_ep_h> ep = Endpoint(job.source.worker_address);
  if (!ep.ok()) {
    Answer(job, ep.status());
    return false;
  }
  job.ep = *ep;
  absl::StatusOr<Key*> key = UseKey(job.ep, job.source.rkey);
  if (!key.ok()) {
    // A client that exited: its segment can no longer be attached.
    DropEndpoint(job.ep);
    job.ep = nullptr;
    Answer(job, key.status());
    return false;
  }
  job.key = *key;
  Transfer(job, job.header, sizeof(job.header), job.source.address);  // the header: always read
  return true;
}

void UcxPuller::Transfer(Job& job, void* local, uint64_t n, uint64_t remote) {
  ucp_request_param_t rp{};
  ucs_status_ptr_t req = job.put && job.header_checked
                             ? ucp_put_nbx(job.ep, local, n, remote, job.key->rkey, &rp)
                             : ucp_get_nbx(job.ep, local, n, remote, job.key->rkey, &rp);
  if (UCS_PTR_IS_ERR(req)) {
    if (job.status.ok()) job.status = UcxError(job.put ? "ucp_put_nbx" : "ucp_get_nbx", UCS_PTR_STATUS(req));
  } else if (req != nullptr) {
    job.requests.push_back(req);
  }
}

void UcxPuller::StartBody(Job& job) {
  job.header_checked = true;
  // Compared in constant time: how long the check takes says nothing of
  // where a guess went wrong.
  if (!ConstantTimeEqual(std::string_view(job.header, agent::kPullTokenBytes), job.token)) {
    // Someone else's memory (or a client that reused the buffer for
    // another lease): nothing of it is read.
    job.status = absl::PermissionDeniedError(
        "the staging memory pull_source names does not start with this lease's pull token: it is not the "
        "committing client's staging memory for this lease");
    return;
  }
  uint64_t offset = agent::kPullHeaderBytes;
  for (std::span<std::byte> piece : job.dst->MutablePieces(0, job.size)) {
    Transfer(job, piece.data(), piece.size(), job.source.address + offset);
    offset += piece.size();
    if (!job.status.ok()) break;
  }
}

void UcxPuller::Flush(Job& job) {
  // Puts are complete locally when their requests end; the flush makes them
  // complete (visible) at the client before it is told so.
  job.flushed = true;
  ucp_request_param_t rp{};
  ucs_status_ptr_t req = ucp_ep_flush_nbx(job.ep, &rp);
  if (UCS_PTR_IS_ERR(req)) {
    if (job.status.ok()) job.status = UcxError("ucp_ep_flush_nbx", UCS_PTR_STATUS(req));
  } else if (req != nullptr) {
    job.requests.push_back(req);
  }
}

bool UcxPuller::Reap(Job& job) {
  size_t keep = 0;
  for (void* req : job.requests) {
    const ucs_status_t st = ucp_request_check_status(req);
    if (st == UCS_INPROGRESS) {
      job.requests[keep++] = req;
      continue;
    }
    if (st != UCS_OK && job.status.ok()) job.status = UcxError("one-sided read of the client's memory", st);
    ucp_request_free(req);
  }
  job.requests.resize(keep);
  if (keep != 0) return false;
  if (!job.header_checked && job.status.ok()) {
    StartBody(job);
    if (!job.requests.empty()) return false;
  }
  if (job.put && !job.flushed && job.status.ok()) {
    Flush(job);
    if (!job.requests.empty()) return false;
  }
  if (job.key != nullptr) ReleaseKey(job.key, !job.status.ok());
  job.key = nullptr;
  if (!job.status.ok() && job.ep != nullptr) DropEndpoint(job.ep);  // a new one next time
  return true;
}

void UcxPuller::Loop() {
  absl::Time stop_by = absl::InfiniteFuture();
  while (true) {
    std::deque<std::shared_ptr<Job>> fresh;
    bool stopping = false;
    {
      CheckedLock lock(&mu_);
      if (queue_.empty() && active_.empty() && !stopping_) {
        // Idle: nothing to progress (one-sided reads need no service).
        mu_.AwaitWithTimeout(absl::Condition(
                                 +[](UcxPuller* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
                                   return p->stopping_ || !p->queue_.empty();
                                 },
                                 this),
                             absl::Milliseconds(200));
      }
      fresh.swap(queue_);
      stopping = stopping_;
    }
    if (stopping && stop_by == absl::InfiniteFuture()) stop_by = absl::Now() + kStopGrace;
    for (std::shared_ptr<Job>& job : fresh) {
      if (stopping) {
        Answer(*job, absl::UnavailableError("the agent is shutting down"));
        continue;
      }
      if (Start(*job)) active_.push_back(std::move(job));
    }
    if (!active_.empty()) ucp_worker_progress(worker_);
    const absl::Time now = absl::Now();
    size_t keep = 0;
    for (std::shared_ptr<Job>& job : active_) {
      if (Reap(*job)) {
        Answer(*job, job->status);
        continue;  // drops the job: its destination is released
      }
      if (now >= job->deadline) {
        Answer(*job, absl::UnavailableError(absl::StrCat(
                         "the one-sided read of ", job->size, " bytes from the client did not finish in time")));
      }
      active_[keep++] = std::move(job);
    }
    active_.resize(keep);
    TrimKeys(now);
    if (stopping && (active_.empty() || absl::Now() >= stop_by)) break;
  }
  if (!active_.empty()) {
    // Gets that never ended: their destinations must outlive the worker
    // (destroyed after this), so they are leaked rather than freed.
    log::Error("pull-mode ingest stopping with {} reads still in flight; their memory is kept", active_.size());
    for (std::shared_ptr<Job>& job : active_) new std::shared_ptr<Job>(std::move(job));
    active_.clear();
  }
  while (!endpoints_.empty()) DropEndpoint(endpoints_.front().second);
  if (active_.empty()) {
    for (Key& k : keys_) k.in_use = 0;
    TrimKeys(absl::InfiniteFuture());
  }
}

}  // namespace ckpt::dpu
