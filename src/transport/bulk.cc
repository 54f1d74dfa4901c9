#include "transport/bulk.h"

#include <algorithm>
#include <memory>

#include "absl/synchronization/mutex.h"
#include "common/lock_check.h"

namespace ckpt::transport {

uint64_t TotalBytes(const ConstPieces& pieces) {
  uint64_t n = 0;
  for (const auto& p : pieces) n += p.size();
  return n;
}

uint64_t TotalBytes(const MutablePieces& pieces) {
  uint64_t n = 0;
  for (const auto& p : pieces) n += p.size();
  return n;
}

namespace {
template <typename Pieces>
Pieces Slice(const Pieces& pieces, uint64_t offset, uint64_t length) {
  Pieces out;
  uint64_t pos = 0;
  for (const auto& p : pieces) {
    if (length == 0) break;
    const uint64_t end = pos + p.size();
    if (end > offset) {
      const uint64_t start = offset > pos ? offset - pos : 0;
      const uint64_t n = std::min<uint64_t>(p.size() - start, length);
      out.push_back(p.subspan(start, n));
      offset += n;
      length -= n;
    }
    pos = end;
  }
  return out;
}
}  // namespace

ConstPieces SlicePieces(const ConstPieces& pieces, uint64_t offset, uint64_t length) {
  return Slice(pieces, offset, length);
}

MutablePieces SlicePieces(const MutablePieces& pieces, uint64_t offset, uint64_t length) {
  return Slice(pieces, offset, length);
}

namespace {
struct PeerState {
  PeerId id = 0;
  int in_flight = 0;
  absl::Status status;
  absl::Time next_allowed = absl::InfinitePast();  // rate limit
};

struct Shared {
  absl::Mutex mu;
  std::vector<PeerState> peers ABSL_GUARDED_BY(mu);
};
}  // namespace

std::vector<absl::Status> SendChunked(Transport& transport, std::span<const PeerId> peers,
                                      uint16_t type, const ConstPieces& source,
                                      const BulkOptions& options, const ChunkHeader& header_for,
                                      Clock* clock) {
  // One header per chunk, computed once and reused for every peer.
  uint64_t cached_index = UINT64_MAX;
  std::string cached;
  return SendChunked(
      transport, peers, type, source, options,
      [&](const ChunkInfo& c, size_t) {
        if (c.index != cached_index) {
          cached = header_for(c);
          cached_index = c.index;
        }
        return cached;
      },
      clock);
}

std::vector<absl::Status> SendChunked(Transport& transport, std::span<const PeerId> peers,
                                      uint16_t type, const ConstPieces& source,
                                      const BulkOptions& options, const PeerChunkHeader& header_for,
                                      Clock* clock) {
  AssertNoCheckedLock("a chunked send (waits on the network)");
  const uint64_t total = TotalBytes(source);
  const uint64_t chunk = std::max<uint64_t>(options.chunk_bytes, 1);
  const int window = std::max(options.max_in_flight, 1);
  auto shared = std::make_shared<Shared>();
  {
    absl::MutexLock lock(&shared->mu);
    for (PeerId p : peers) {
      PeerState ps;
      ps.id = p;
      shared->peers.push_back(std::move(ps));
    }
  }
  const uint64_t chunks = total == 0 ? 1 : (total + chunk - 1) / chunk;
  // Chunk-major order: each chunk goes to every peer before the next one, so
  // the source bytes are read while hot in cache on a fan-out.
  for (uint64_t c = 0; c < chunks; ++c) {
    ChunkInfo info;
    info.index = c;
    info.offset = c * chunk;
    info.length = std::min(chunk, total - info.offset);
    info.last = c + 1 == chunks;
    ConstPieces pieces = SlicePieces(source, info.offset, info.length);
    info.pieces = &pieces;
    for (size_t i = 0; i < peers.size(); ++i) {
      absl::Time not_before;
      {
        absl::MutexLock lock(&shared->mu);
        PeerState& ps = shared->peers[i];
        // Wait for a window slot (or the peer's failure).
        auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(shared->mu) {
          return !shared->peers[i].status.ok() || shared->peers[i].in_flight < window;
        };
        shared->mu.Await(absl::Condition(&ready));
        if (!ps.status.ok()) continue;
        ++ps.in_flight;
        not_before = ps.next_allowed;
        if (options.max_bytes_per_second > 0) {
          const absl::Time now = clock->MonotonicNow();
          const absl::Time start = std::max(now, ps.next_allowed);
          ps.next_allowed =
              start + absl::Seconds(static_cast<double>(info.length) /
                                    static_cast<double>(options.max_bytes_per_second));
        }
      }
      if (options.max_bytes_per_second > 0) {
        const absl::Time now = clock->MonotonicNow();
        if (not_before > now) clock->SleepFor(not_before - now);
      }
      transport.Send(peers[i], type, header_for(info, i), pieces, [shared, i](const absl::Status& s) {
        absl::MutexLock lock(&shared->mu);
        PeerState& ps = shared->peers[i];
        --ps.in_flight;
        if (!s.ok() && ps.status.ok()) ps.status = s;
      });
    }
  }
  absl::MutexLock lock(&shared->mu);
  auto drained = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(shared->mu) {
    for (const PeerState& ps : shared->peers)
      if (ps.in_flight > 0) return false;
    return true;
  };
  shared->mu.Await(absl::Condition(&drained));
  std::vector<absl::Status> out;
  for (const PeerState& ps : shared->peers) out.push_back(ps.status);
  return out;
}

}  // namespace ckpt::transport
