// Chunked, pipelined bulk sends over a Transport.
//
// SendChunked cuts a payload (gathered from pieces, e.g. a shard's arena
// extents) into chunks of BulkOptions::chunk_bytes and sends every chunk to
// every peer of a fan-out (one source buffer, several replicas), keeping at
// most max_in_flight chunks outstanding per peer, so the sender never needs a
// second copy of the blob and a slow peer only slows itself. An optional
// per-peer byte rate keeps checkpoint traffic from starving training traffic.
//
// Thread safety: SendChunked may be called from several threads at once (for
// different transfers). It blocks its caller until every chunk has completed
// or failed; it must not be called from a Handler callback.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/clock.h"
#include "transport/transport.h"

namespace ckpt::transport {

struct BulkOptions {
  uint64_t chunk_bytes = 8ull << 20;   // 4-16 MiB is the sweet spot here
  int max_in_flight = 4;               // chunks per peer not yet completed
  uint64_t max_bytes_per_second = 0;   // per peer; 0 = unlimited
};

// Describes one chunk to the header callback.
struct ChunkInfo {
  uint64_t index = 0;
  uint64_t offset = 0;   // within the whole payload
  uint64_t length = 0;
  bool last = false;
  const ConstPieces* pieces = nullptr;  // the chunk's bytes
};

// Returns the application header of one chunk (the same for every peer).
using ChunkHeader = std::function<std::string(const ChunkInfo& chunk)>;
// Returns the header of one chunk for the peer at `peer_index` of the fan-out
// (e.g. when each receiver knows the transfer by its own id).
using PeerChunkHeader = std::function<std::string(const ChunkInfo& chunk, size_t peer_index)>;

// Slices [offset, offset+length) out of a gather list.
ConstPieces SlicePieces(const ConstPieces& pieces, uint64_t offset, uint64_t length);
MutablePieces SlicePieces(const MutablePieces& pieces, uint64_t offset, uint64_t length);

// Sends `source` to every peer in `peers`. Returns one status per peer, in
// order: OK if every chunk was handed to it, else the first failure (its
// remaining chunks are not sent; the other peers carry on). An empty source
// is sent as one empty chunk. `clock` paces the rate limit (FakeClock in tests).
std::vector<absl::Status> SendChunked(Transport& transport, std::span<const PeerId> peers,
                                      uint16_t type, const ConstPieces& source,
                                      const BulkOptions& options, const ChunkHeader& header_for,
                                      Clock* clock);
// As above, with a header per (chunk, peer).
std::vector<absl::Status> SendChunked(Transport& transport, std::span<const PeerId> peers,
                                      uint16_t type, const ConstPieces& source,
                                      const BulkOptions& options, const PeerChunkHeader& header_for,
                                      Clock* clock);

}  // namespace ckpt::transport
