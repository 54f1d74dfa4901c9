// Reconstructor: rebuilds byte ranges of an EC stripe's fragments from
// peers, for restores by decode and for rebuilding lost segments.
//
// A range is rebuilt slice by slice into small reused buffers: the wanted
// fragment itself is read when a holder has it, otherwise any k other
// fragments are read in parallel and decoded (ISA-L). A holder that answers
// nothing within `hedge_after` is hedged: more survivors are read at once and
// whichever set completes first wins, so a stopped or overloaded holder costs
// about `hedge_after`, not the peer timeout; such holders are tried last for a
// while. Buffers a read was abandoned on are never reused (a late payload may
// still land in them): they are replaced.
//
// Thread safety: Rebuild may be called from several threads at once (one
// call per range); it blocks on peer reads.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/agent/agent_metrics.h"
#include "server/agent/meta_link.h"
#include "server/agent/peer_client.h"

namespace ckpt::agent {

class Reconstructor {
 public:
  struct Options {
    uint64_t slice_bytes = 4 << 20;
    absl::Duration hedge_after = absl::Seconds(1);
    absl::Duration remember_slow = absl::Seconds(10);
  };
  Reconstructor(PeerClient* peers, Clock* clock, AgentMetrics* metrics, Options options);

  // Writes bytes [offset, offset + size of `out`) of fragment `position` of a
  // stripe of `stripe_bytes` (k data + m parity fragments) into `out`,
  // reading from `sources` (segments of the stripe; the wanted one may be
  // among them; `blob_segment_index` says which of its owner's blob
  // segments it is, so the owner can serve it even if it restarted).
  // DataLoss listing why when fewer than k fragments can be read.
  absl::Status Rebuild(const std::vector<SegmentLocation>& sources, uint32_t data_k, uint32_t parity_m,
                       uint64_t stripe_bytes, uint32_t position, uint32_t blob_segment_index, uint64_t offset,
                       const transport::MutablePieces& out);

  // The read request for `len` bytes at `offset` of a segment location.
  static ReadReq SegmentReadReq(const SegmentLocation& loc, uint32_t data_k, uint32_t blob_segment_index,
                                uint64_t offset, uint64_t length);

 private:
  bool IsSlow(const std::string& node_id);
  void MarkSlow(const std::string& node_id);

  PeerClient* const peers_;
  Clock* const clock_;
  AgentMetrics* const metrics_;
  const Options options_;

  absl::Mutex mu_;
  std::map<std::string, absl::Time> slow_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::agent
