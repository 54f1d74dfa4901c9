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

// Staging memory starts with a header: the lease's pull token (32 bytes:
// HMAC-SHA256 of the lease id under a key of the agent's, Ingest::PullToken)
// then zeros; the shard follows at `address + kPullHeaderBytes`. The agent
// reads the header first and compares in constant time: memory that does not
// hold the token is not the committing client's own staging (AgentService
// PullSource). A restore's deliver token works the same way.
inline constexpr uint64_t kPullHeaderBytes = 64;
inline constexpr size_t kPullTokenBytes = 32;
static_assert(kPullTokenBytes <= kPullHeaderBytes);

// The client's staging memory (AgentService PullSource).
struct PullSource {
  std::string worker_address;  // the client's UCX worker address
  std::string rkey;            // packed remote key of the staging memory
  uint64_t address = 0;        // the header's first byte in the client's address space
  uint64_t length = 0;         // bytes registered from `address` on (header and shard)
};

class Puller {
 public:
  virtual ~Puller() = default;
  // Reads the header at `source.address`, checks it starts with `token`,
  // then reads `size` bytes at `source.address + kPullHeaderBytes` into
  // `dst` bytes [0, size). Returns once no read can write `dst` any more,
  // except after `timeout`: then it answers Unavailable and keeps `dst` (a
  // shared reservation) alive until the reads still in flight end. Errors:
  // InvalidArgument (the source is shorter than header and shard, or
  // malformed), PermissionDenied (the header does not hold the token),
  // Unavailable (the client cannot be reached or its memory read: it exited,
  // or its registration is gone).
  virtual absl::Status Pull(const PullSource& source, const std::string& token, ReservationPtr dst,
                            uint64_t size, absl::Duration timeout) = 0;
  // The other way (a restore): checks the header at `target.address` holds
  // `token`, then writes `src` bytes [0, size) to `target.address +
  // kPullHeaderBytes` with one-sided puts and returns once they are
  // complete at the target. Same errors and timeout behaviour as Pull (`src`
  // stays alive while puts are in flight).
  virtual absl::Status Push(const PullSource& target, const std::string& token, ReservationPtr src,
                            uint64_t size, absl::Duration timeout) = 0;
};

}  // namespace ckpt::agent
