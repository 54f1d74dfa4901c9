// ParityBuilder: EC parity segments being folded together on this node.
//
// A parity holder receives the k data segments of a stripe from their owners
// and folds each chunk into the parity as it arrives (ISA-L's incremental
// update; docs/erasure-coding.md). A build owns its parity's pool space (a
// Reservation) until the parity is complete, checksummed, recorded and handed
// to the HoldingTable as a segment holding.
//
// A build ends in exactly one of these ways, and frees its space in all but
// the first: complete (stored); failed (a push broke off mid-fold, which
// spoils the parity); dropped (the version was evicted or its task cancelled;
// an evicted version's late pushes are refused); expired (no push made progress for `expire_after`). Folds run without the
// lock, on a reference to the space, so a build dropped while a fold is in
// progress frees its space only when that fold is done.
//
// Threads: BeginPush and Fold run on the transport's thread; PushComplete on
// the PeerServer's finish executor; the rest on task and control threads.
// The lock is never held across a fold, a crc or a record write.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/agent/agent_metrics.h"
#include "server/agent/arena.h"
#include "server/agent/holdings.h"
#include "server/agent/peer_wire.h"

namespace ckpt::agent {

class ParityBuilder {
 public:
  ParityBuilder(Arena* arena, HoldingTable* holdings, Clock* clock, AgentMetrics* metrics,
                absl::Duration expire_after);

  // A push of data segment `b.data_position` into parity `b.parity_position`
  // of a stripe begins: reserves and zeroes the parity on the first push.
  // Errors: InvalidArgument (geometry differs from the build's),
  // AlreadyExists (this segment was folded already, or the parity is held),
  // Aborted (this segment is being received from another push),
  // ResourceExhausted (no room), or the error that spoiled the build.
  absl::Status BeginPush(const PutBegin& b);
  // Folds bytes [offset, offset + data.size()) of the data segment into the
  // parity. FailedPrecondition if the build is gone or spoiled.
  absl::Status Fold(const PutBegin& b, uint64_t offset, std::span<const std::byte> data);
  // A push broke off: the parity is spoiled if anything of it was folded;
  // otherwise the segment may be pushed again.
  void PushFailed(const PutBegin& b, const absl::Status& why);
  // Every byte of the push was folded and checked. When every expected data
  // segment is in, the parity is checksummed, recorded and stored (reported
  // VALID). Errors: the build's, or the record write's.
  absl::Status PushComplete(const PutBegin& b);

  // For the local EC task waiting on its parity: the error that ended a
  // failed build of `id` (and the build is forgotten), or OK.
  absl::Status TakeFailure(const SegmentId& id);
  // Drops every build of a version (its ec_encode task was cancelled; meta
  // may plan it again, so later pushes start new builds).
  void DropVersion(const std::string& job, uint64_t step);
  // Drops every build of a version that left this node's memory (retention
  // or delete) and, for `expire_after`, refuses pushes of it: a data
  // segment's push still on its way would otherwise start a build nobody
  // completes, holding a stripe of memory until it expired.
  void EvictVersion(const std::string& job, uint64_t step);
  // Drops builds with no progress for `expire_after`. Returns how many.
  int Expire();
  size_t size() const;

 private:
  struct Build {
    uint32_t data_k = 0;
    uint32_t parity_m = 0;
    uint64_t stripe_bytes = 0;
    uint64_t expect_mask = 0;
    ReservationPtr bytes;
    std::set<uint32_t> receiving;         // data positions being pushed
    std::set<uint32_t> complete;          // data positions wholly folded
    std::map<uint32_t, uint64_t> folded;  // data position -> bytes folded
    bool finishing = false;
    absl::Status error;
    absl::Time last_activity;
  };
  static SegmentId KeyOf(const PutBegin& b);
  void DropLocked(std::map<SegmentId, Build>::iterator it, const char* why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Arena* const arena_;
  HoldingTable* const holdings_;
  Clock* const clock_;
  AgentMetrics* const metrics_;
  const absl::Duration expire_after_;

  mutable absl::Mutex mu_;
  std::map<SegmentId, Build> builds_ ABSL_GUARDED_BY(mu_);
  // Builds that failed, kept until the local task takes the error (bounded).
  std::map<SegmentId, absl::Status> failures_ ABSL_GUARDED_BY(mu_);
  // Versions evicted here, with when (bounded; forgotten after expire_after).
  std::map<std::pair<std::string, uint64_t>, absl::Time> evicted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::agent
