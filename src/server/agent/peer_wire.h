// The agents' data-plane protocol: message types and header encodings.
//
// Every message travels over transport::Transport as (type, header, payload).
// Headers are encoded with WireWriter (little-endian fixed-width integers and
// length-prefixed strings, in field order) and decoded with WireReader, which
// fails with InvalidArgument on a short or malformed header instead of reading
// past it. docs/protocol.md "Data plane" describes the flows:
//
//   push (replicas, EC data segments to parity holders)
//     A -> B  kPutBegin  {PutBegin}       payload: shard record (replica)
//     B -> A  kPutAck    {Result}         space reserved, or why not
//     A -> B  kPutChunk  {PutChunk} *     payload: chunk bytes (crc in header)
//     B -> A  kPutDone   {Result}         stored, verified, reported to meta
//     A -> B  kPutAbort  {Result}         the sender gave up (timeout, error):
//                                         B frees what it reserved
//   read (restores, decode, rebuild)
//     A -> B  kReadReq   {ReadReq}
//     B -> A  kReadChunk {ReadChunk} *    payload: chunk bytes
//     B -> A  kReadEnd   {Result}         after the last chunk, or the error
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/endian.h"

namespace ckpt::agent {

enum PeerMessage : uint16_t {
  kPutBegin = 1,
  kPutAck = 2,
  kPutChunk = 3,
  kPutDone = 4,
  kReadReq = 5,
  kReadChunk = 6,
  kReadEnd = 7,
  kPutAbort = 8,
};

using WireWriter = LeWriter;

// LeReader that copies strings out (a decoded header outlives the message
// buffer) and names the truncated header.
class WireReader : public LeReader {
 public:
  using LeReader::LeReader;
  std::string Str() { return std::string(LeReader::Str()); }
  // OK if every read was in bounds; InvalidArgument naming `what` otherwise.
  absl::Status Finish(std::string_view what) const;
  // AtEnd(): nothing left to read (fields added at the end of a header are
  // optional: a peer of an earlier version does not send them).
};

// What a push carries.
enum class PutKind : uint8_t {
  kReplica = 1,     // a full shard copy, stored as a REPLICA holding
  kEcData = 2,      // a data segment, folded into the receiver's parity
  kSegment = 3,     // a finished segment copy (rebuild onto another node)
};

struct PutBegin {
  uint64_t xfer = 0;
  PutKind kind = PutKind::kReplica;
  uint64_t target_incarnation = 0;  // 0: any
  std::string task_id;
  std::string job_id;
  uint64_t step = 0;
  uint32_t rank = 0;        // replica
  uint64_t total_bytes = 0;
  uint32_t crc32c = 0;      // of the whole payload
  // kEcData: the stripe and the receiver's parity position.
  uint32_t group = 0;
  uint32_t stripe = 0;
  uint32_t data_position = 0;
  uint32_t parity_position = 0;  // k..k+m-1
  uint32_t data_k = 0;
  uint32_t parity_m = 0;
  uint64_t stripe_bytes = 0;
  uint64_t expect_mask = 0;  // data positions with a non-empty segment
  // Who sends (checked against meta's membership, membership.h); empty from
  // a peer of an earlier version.
  std::string sender_node_id;
  uint64_t sender_incarnation = 0;
};
std::string EncodePutBegin(const PutBegin& m);
absl::StatusOr<PutBegin> DecodePutBegin(std::string_view h);

struct Chunk {
  uint64_t id = 0;      // xfer (put) or request id (read)
  uint64_t offset = 0;  // within the transfer
  uint32_t crc32c = 0;  // of this chunk's payload
};
std::string EncodeChunk(const Chunk& m);
absl::StatusOr<Chunk> DecodeChunk(std::string_view h);

struct Result {
  uint64_t id = 0;
  absl::Status status;
  uint32_t crc32c = 0;  // kReadEnd: of the bytes sent
  uint64_t bytes = 0;   // kReadEnd: how many
};
std::string EncodeResult(const Result& m);
absl::StatusOr<Result> DecodeResult(std::string_view h);

enum class ReadWhat : uint8_t {
  kShard = 1,        // a VALID full copy (any role)
  kSegment = 2,      // an EC segment: a parity or rebuilt holding, or a data
                     // segment cut from the owner's blob
};

struct ReadReq {
  uint64_t id = 0;
  uint64_t target_incarnation = 0;
  ReadWhat what = ReadWhat::kShard;
  std::string job_id;
  uint64_t step = 0;
  uint32_t rank = 0;
  uint32_t group = 0;
  uint32_t stripe = 0;
  uint32_t position = 0;
  uint32_t data_k = 0;             // kSegment data: to cut the owner's blob
  uint32_t blob_segment_index = 0;
  uint64_t offset = 0;
  uint64_t length = 0;             // bytes wanted from offset
  std::string sender_node_id;      // as in PutBegin
  uint64_t sender_incarnation = 0;
};
std::string EncodeReadReq(const ReadReq& m);
absl::StatusOr<ReadReq> DecodeReadReq(std::string_view h);

}  // namespace ckpt::agent
