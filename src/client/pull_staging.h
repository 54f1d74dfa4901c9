// PullStaging: the client's side of pull-mode ingest (docs/dpu.md). A DPU
// agent cannot hand the trainer its memory, so the trainer copies each shard
// into staging memory of its own, allocated and registered by UCX
// (UCP_MEM_MAP_ALLOCATE: on a BlueField the NIC's registration, here a
// posix/sysv shared-memory segment), and commits naming it: the agent reads
// it with one-sided gets while the commit is in flight. Created on the first
// lease that says `pull`, so a client of a host agent never starts UCX.
//
// Buffers are reused: a released buffer goes back to a small free list (the
// next save of the same size touches no new pages). A buffer must stay
// alive until the agent answered the commit that names it (SendCommit holds
// it). A thread (ckpt-pull-prog) progresses the worker only when UCX has
// events for it (wire-up of transports that need it; one-sided reads over
// RDMA or shared memory need none): it sleeps on the worker's event fd.
//
// Thread safety: Acquire may be called from any thread; a Buffer's bytes
// belong to whoever holds it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace ckpt::client {

// The staging header before a shard: the lease's pull token, then zeros
// (AgentService PullSource.address).
inline constexpr uint64_t kPullHeaderBytes = 64;

class PullStaging {
 public:
  // One staging buffer: `length` bytes at `data`, registered with UCX.
  class Buffer {
   public:
    virtual ~Buffer() = default;
    std::byte* data() const { return data_; }
    uint64_t length() const { return length_; }
    // The packed remote key and this client's worker address, for the
    // commit's PullSource.
    const std::string& rkey() const { return rkey_; }
    const std::string& worker_address() const { return worker_address_; }

   protected:
    std::byte* data_ = nullptr;
    uint64_t length_ = 0;
    std::string rkey_;
    std::string worker_address_;
  };

  // Starts UCX (context, worker, progress thread). Unavailable if it cannot.
  static absl::StatusOr<std::shared_ptr<PullStaging>> Create();
  virtual ~PullStaging() = default;
  // A buffer of at least `size` bytes; released (to the free list) when the
  // last reference goes. ResourceExhausted if UCX cannot allocate it.
  virtual absl::StatusOr<std::shared_ptr<Buffer>> Acquire(uint64_t size) = 0;
};

}  // namespace ckpt::client
