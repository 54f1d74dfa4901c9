#include "client/pull_staging.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"

namespace ckpt::client {
namespace {

constexpr uint64_t kRound = uint64_t{2} << 20;  // buffer sizes: whole 2 MiB
constexpr size_t kMaxFree = 2;                   // free buffers kept for reuse

absl::Status UcxError(const std::string& what, ucs_status_t st) {
  return absl::UnavailableError(absl::StrCat("pull-mode staging: ", what, ": ", ucs_status_string(st)));
}

class UcxStaging;

// The UCX context and worker, shared by the staging and every buffer (a
// buffer outliving the client keeps them).
struct Ucx {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::string worker_address;
  int stop_fd = -1;
  std::thread progress;
  ~Ucx() {
    if (stop_fd >= 0) {
      const uint64_t one = 1;
      [[maybe_unused]] ssize_t n = ::write(stop_fd, &one, sizeof(one));
    }
    if (progress.joinable()) progress.join();
    if (stop_fd >= 0) ::close(stop_fd);
    if (worker != nullptr) ucp_worker_destroy(worker);
    if (context != nullptr) ucp_cleanup(context);
  }
  // ckpt-pull-prog: serves the worker's events, sleeping while it has none.
  void Progress() {
    int efd = -1;
    const bool wakeup = ucp_worker_get_efd(worker, &efd) == UCS_OK;
    while (true) {
      while (ucp_worker_progress(worker) != 0) {
      }
      if (wakeup && ucp_worker_arm(worker) == UCS_ERR_BUSY) continue;
      pollfd fds[2] = {{stop_fd, POLLIN, 0}, {efd, POLLIN, 0}};
      // Without an event fd, look every 10 ms (still next to no CPU).
      const int n = ::poll(fds, wakeup ? 2 : 1, wakeup ? 1000 : 10);
      if (n > 0 && fds[0].revents != 0) return;
    }
  }
};

class UcxBuffer : public PullStaging::Buffer {
 public:
  UcxBuffer(std::shared_ptr<Ucx> ucx, ucp_mem_h memh, std::byte* data, uint64_t length, std::string rkey)
      : ucx_(std::move(ucx)), memh_(memh) {
    data_ = data;
    length_ = length;
    rkey_ = std::move(rkey);
    worker_address_ = ucx_->worker_address;
  }
  ~UcxBuffer() override { ucp_mem_unmap(ucx_->context, memh_); }

 private:
  std::shared_ptr<Ucx> ucx_;
  ucp_mem_h memh_;
};

class UcxStaging : public PullStaging, public std::enable_shared_from_this<UcxStaging> {
 public:
  explicit UcxStaging(std::shared_ptr<Ucx> ucx) : ucx_(std::move(ucx)) {}

  absl::StatusOr<std::shared_ptr<Buffer>> Acquire(uint64_t size) override {
    std::unique_ptr<UcxBuffer> buffer;
    {
      absl::MutexLock lock(&mu_);
      // The smallest free buffer that fits.
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if ((*it)->length() >= size && (best == free_.end() || (*it)->length() < (*best)->length())) best = it;
      }
      if (best != free_.end()) {
        buffer = std::move(*best);
        free_.erase(best);
      }
    }
    if (buffer == nullptr) {
      absl::StatusOr<std::unique_ptr<UcxBuffer>> made = Allocate((std::max<uint64_t>(size, 1) + kRound - 1) / kRound * kRound);
      if (!made.ok()) return made.status();
      buffer = *std::move(made);
    }
    // Back to the free list (or freed) when the last user lets go.
    std::weak_ptr<UcxStaging> owner = weak_from_this();
    return std::shared_ptr<Buffer>(buffer.release(), [owner](Buffer* b) {
      std::unique_ptr<UcxBuffer> own(static_cast<UcxBuffer*>(b));
      if (std::shared_ptr<UcxStaging> s = owner.lock()) s->Release(std::move(own));
    });
  }

 private:
  absl::StatusOr<std::unique_ptr<UcxBuffer>> Allocate(uint64_t length) {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = nullptr;
    mp.length = length;
    // Memory UCX allocates is what a peer can read with no help from this
    // process (probe: bench/probes/ucx_rma_probe.cc).
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    ucp_mem_h memh = nullptr;
    ucs_status_t st = ucp_mem_map(ucx_->context, &mp, &memh);
    if (st != UCS_OK) {
      return absl::ResourceExhaustedError(
          absl::StrCat("pull-mode staging: cannot allocate ", length, " bytes of registered memory: ",
                       ucs_status_string(st)));
    }
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    st = ucp_mem_query(memh, &attr);
    void* packed = nullptr;
    size_t packed_len = 0;
    if (st == UCS_OK) st = ucp_rkey_pack(ucx_->context, memh, &packed, &packed_len);
    if (st != UCS_OK) {
      ucp_mem_unmap(ucx_->context, memh);
      return UcxError("ucp_rkey_pack", st);
    }
    std::string rkey(static_cast<const char*>(packed), packed_len);
    ucp_rkey_buffer_release(packed);
    return std::make_unique<UcxBuffer>(ucx_, memh, static_cast<std::byte*>(attr.address),
                                       std::min<uint64_t>(attr.length, length), std::move(rkey));
  }

  void Release(std::unique_ptr<UcxBuffer> buffer) {
    std::unique_ptr<UcxBuffer> drop;
    absl::MutexLock lock(&mu_);
    free_.push_back(std::move(buffer));
    if (free_.size() > kMaxFree) {
      // Keep the largest ones: they fit the next saves.
      auto smallest = std::min_element(free_.begin(), free_.end(),
                                       [](const auto& a, const auto& b) { return a->length() < b->length(); });
      drop = std::move(*smallest);
      free_.erase(smallest);
    }
    // `drop` is unmapped after the lock is released (declared first).
  }

  const std::shared_ptr<Ucx> ucx_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<UcxBuffer>> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::shared_ptr<PullStaging>> PullStaging::Create() {
  auto ucx = std::make_shared<Ucx>();
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return UcxError("ucp_config_read", st);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  st = ucp_init(&params, config, &ucx->context);
  if (st != UCS_OK) {  // some transports have no wake-up support: poll instead
    params.features = UCP_FEATURE_RMA;
    st = ucp_init(&params, config, &ucx->context);
  }
  ucp_config_release(config);
  if (st != UCS_OK) return UcxError("ucp_init", st);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only ckpt-pull-prog touches it after this
  st = ucp_worker_create(ucx->context, &wp, &ucx->worker);
  if (st != UCS_OK) return UcxError("ucp_worker_create", st);
  ucp_address_t* address = nullptr;
  size_t address_len = 0;
  st = ucp_worker_get_address(ucx->worker, &address, &address_len);
  if (st != UCS_OK) return UcxError("ucp_worker_get_address", st);
  ucx->worker_address.assign(reinterpret_cast<const char*>(address), address_len);
  ucp_worker_release_address(ucx->worker, address);
  ucx->stop_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (ucx->stop_fd < 0) return absl::UnavailableError("pull-mode staging: eventfd failed");
  ucx->progress = std::thread([raw = ucx.get()] {
    pthread_setname_np(pthread_self(), "ckpt-pull-prog");
    raw->Progress();
  });
  return std::shared_ptr<PullStaging>(std::make_shared<UcxStaging>(std::move(ucx)));
}

}  // namespace ckpt::client
