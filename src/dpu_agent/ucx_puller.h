// UcxPuller: ckpt-dpu-agent's pull-mode ingest (agent::Puller) over UCX
// one-sided gets (ucp_get_nbx): RDMA READs of the trainer's registered host
// memory on a BlueField; here, with no DPU, shared-memory RMA (the client's
// staging memory is allocated by UCX on its posix/sysv md, so the get is a
// copy out of the mapped segment and the client's CPU takes no part).
//
// Own UCX context and worker, used only by its thread ckpt-dpu-pull: Pull()
// queues a job and waits; the thread creates (and caches) an endpoint per
// client worker address with error mode NONE (shared-memory transports have
// no peer-failure handling; a client's liveness is its session and commit
// deadline), unpacks the rkey, issues one get per destination extent and
// progresses until they end. A job past its timeout is answered Unavailable
// but stays until its gets end, holding its destination reservation alive.
// Restores go the other way (Push): after the same header check, one-sided
// puts (RDMA WRITE) of the shard into the client's staging memory and an
// endpoint flush, so the bytes are in place when the client is answered.
// No lock is held while UCX copies or waits.
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "server/agent/puller.h"

namespace ckpt::dpu {

class UcxPuller : public agent::Puller {
 public:
  struct Options {
    // Endpoints (one per client worker) kept open; the least recently used
    // is closed beyond it.
    size_t max_endpoints = 64;
    // Unpacked remote keys kept for reuse (a client saves into the same
    // staging buffer again: no new mapping, no page faults on the next
    // pull); one unused for `key_idle` is released, which unmaps the
    // client's memory here.
    size_t max_keys = 16;
    absl::Duration key_idle = absl::Seconds(60);
  };
  static absl::StatusOr<std::unique_ptr<UcxPuller>> Create(Options options);
  // Answers queued jobs Unavailable, lets gets in flight end (up to 10 s),
  // closes the endpoints and joins the thread.
  ~UcxPuller() override;

  absl::Status Pull(const agent::PullSource& source, const std::string& token, agent::ReservationPtr dst,
                    uint64_t size, absl::Duration timeout) override;
  absl::Status Push(const agent::PullSource& target, const std::string& token, agent::ReservationPtr src,
                    uint64_t size, absl::Duration timeout) override;

 private:
  // An unpacked remote key (the client's memory mapped here, for shared
  // memory), used by one job or more at a time.
  struct Key {
    ucp_ep_h ep = nullptr;
    std::string packed;
    ucp_rkey_h rkey = nullptr;
    int in_use = 0;
    bool dead = false;  // its endpoint was dropped: released once unused
    absl::Time last_used;
  };
  struct Job {
    bool put = false;  // Push: `dst` is the source of puts into the client's memory
    agent::PullSource source;
    std::string token;
    agent::ReservationPtr dst;
    uint64_t size = 0;
    absl::Time deadline;
    // Thread-only while running.
    ucp_ep_h ep = nullptr;
    Key* key = nullptr;  // in use while the gets run
    std::vector<void*> requests;
    // The header is read first (into `header`); the shard once it checked.
    bool header_checked = false;
    bool flushed = false;  // Push: the endpoint flushed after the puts
    char header[agent::kPullHeaderBytes] = {};
    absl::Status status;  // the first error of its gets
    bool answered = false;
    // Set once, by the thread; then `done` is notified.
    absl::Status result;
    absl::Notification done;
  };
  explicit UcxPuller(Options options) : options_(options) {}
  absl::Status Run(bool put, const agent::PullSource& source, const std::string& token, agent::ReservationPtr bytes,
                   uint64_t size, absl::Duration timeout);
  absl::Status Init();
  void Loop();
  // Starts a job (its header's get); false if it already ended (answered).
  bool Start(Job& job);
  // Issues a get of [remote, remote + n) into `local` (or, for a Push once
  // its header checked, a put of `local` there); the first error goes to
  // job.status.
  void Transfer(Job& job, void* local, uint64_t n, uint64_t remote);
  // After the puts: flushes the endpoint (remote completion).
  void Flush(Job& job);
  // After the header arrived: checks the token, starts the shard's gets
  // (or puts).
  void StartBody(Job& job);
  // True once every get of `job` ended (its requests freed, rkey destroyed).
  bool Reap(Job& job);
  void Answer(Job& job, absl::Status status);
  absl::StatusOr<ucp_ep_h> Endpoint(const std::string& worker_address);
  // Closes `ep` and releases its unused keys (a key in use is released when
  // its job ends).
  void DropEndpoint(ucp_ep_h ep);
  // The unpacked key of `rkey` on `ep` (cached), marked in use.
  absl::StatusOr<Key*> UseKey(ucp_ep_h ep, const std::string& rkey);
  void ReleaseKey(Key* key, bool failed);
  // Releases unused keys beyond max_keys or idle for key_idle.
  void TrimKeys(absl::Time now);

  const Options options_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string own_address_;  // this worker's: the header clients' must match
  std::thread thread_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::shared_ptr<Job>> queue_ ABSL_GUARDED_BY(mu_);

  // The thread's own.
  std::list<Key> keys_;  // most recently used first
  std::vector<std::shared_ptr<Job>> active_;
  std::list<std::pair<std::string, ucp_ep_h>> endpoints_;  // most recently used first
};

}  // namespace ckpt::dpu
