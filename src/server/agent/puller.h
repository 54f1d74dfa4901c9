// Puller: pull-mode ingest (docs/dpu.md). A DPU agent does not hand trainers
// its memory: a client writes each shard into staging memory of its own that
// UCX registered, and commits naming it (PullSource); the agent reads the
// bytes with one-sided gets into the lease's space before it records the
// shard. The agent only sees this interface; ckpt-dpu-agent's UCX
// implementation lives in src/dpu_agent/ (the lower layer never includes it).
//
// Thread safety: Pull may be called from any thread, concurrently.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/agent/arena.h"

namespace ckpt::agent {

// The client's staging memory (AgentService PullSource).
struct PullSource {
  std::string worker_address;  // the client's UCX worker address
  std::string rkey;            // packed remote key of the staging memory
  uint64_t address = 0;        // the shard's first byte in the client's address space
  uint64_t length = 0;         // bytes registered from `address` on
};

class Puller {
 public:
  virtual ~Puller() = default;
  // Reads `size` bytes at `source.address` into `dst` bytes [0, size).
  // Returns once no read can write `dst` any more, except after `timeout`:
  // then it answers Unavailable and keeps `dst` (a shared reservation) alive
  // until the reads still in flight end. Errors: InvalidArgument (the source
  // is shorter than `size`, or malformed), Unavailable (the client cannot be
  // reached or its memory read: it exited, or its registration is gone).
  virtual absl::Status Pull(const PullSource& source, ReservationPtr dst, uint64_t size,
                            absl::Duration timeout) = 0;
};

}  // namespace ckpt::agent
