#include "server/agent/peer_wire.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace ckpt::agent {

absl::Status WireReader::Finish(std::string_view what) const {
  if (!ok()) return absl::InvalidArgumentError(absl::StrCat("truncated ", std::string(what), " header"));
  return absl::OkStatus();
}

std::string EncodePutBegin(const PutBegin& m) {
  WireWriter w;
  w.U64(m.xfer);
  w.U8(static_cast<uint8_t>(m.kind));
  w.U64(m.target_incarnation);
  w.Str(m.task_id);
  w.Str(m.job_id);
  w.U64(m.step);
  w.U32(m.rank);
  w.U64(m.total_bytes);
  w.U32(m.crc32c);
  w.U32(m.group);
  w.U32(m.stripe);
  w.U32(m.data_position);
  w.U32(m.parity_position);
  w.U32(m.data_k);
  w.U32(m.parity_m);
  w.U64(m.stripe_bytes);
  w.U64(m.expect_mask);
  w.Str(m.sender_node_id);
  w.U64(m.sender_incarnation);
  return w.Take();
}

absl::StatusOr<PutBegin> DecodePutBegin(std::string_view h) {
  WireReader r(h);
  PutBegin m;
  m.xfer = r.U64();
  const uint8_t kind = r.U8();
  m.target_incarnation = r.U64();
  m.task_id = r.Str();
  m.job_id = r.Str();
  m.step = r.U64();
  m.rank = r.U32();
  m.total_bytes = r.U64();
  m.crc32c = r.U32();
  m.group = r.U32();
  m.stripe = r.U32();
  m.data_position = r.U32();
  m.parity_position = r.U32();
  m.data_k = r.U32();
  m.parity_m = r.U32();
  m.stripe_bytes = r.U64();
  m.expect_mask = r.U64();
  if (!r.AtEnd()) {
    m.sender_node_id = r.Str();
    m.sender_incarnation = r.U64();
  }
  if (absl::Status s = r.Finish("put"); !s.ok()) return s;
  if (kind < 1 || kind > 3) return absl::InvalidArgumentError(absl::StrCat("unknown put kind ", kind));
  m.kind = static_cast<PutKind>(kind);
  return m;
}

std::string EncodeChunk(const Chunk& m) {
  WireWriter w;
  w.U64(m.id);
  w.U64(m.offset);
  w.U32(m.crc32c);
  return w.Take();
}

absl::StatusOr<Chunk> DecodeChunk(std::string_view h) {
  WireReader r(h);
  Chunk m;
  m.id = r.U64();
  m.offset = r.U64();
  m.crc32c = r.U32();
  if (absl::Status s = r.Finish("chunk"); !s.ok()) return s;
  return m;
}

std::string EncodeResult(const Result& m) {
  WireWriter w;
  w.U64(m.id);
  w.U32(static_cast<uint32_t>(m.status.code()));
  const std::string msg(m.status.message().substr(0, 2048));
  w.Str(msg);
  w.U32(m.crc32c);
  w.U64(m.bytes);
  return w.Take();
}

absl::StatusOr<Result> DecodeResult(std::string_view h) {
  WireReader r(h);
  Result m;
  m.id = r.U64();
  const uint32_t code = r.U32();
  const std::string msg = r.Str();
  m.crc32c = r.U32();
  m.bytes = r.U64();
  if (absl::Status s = r.Finish("result"); !s.ok()) return s;
  if (code > 16) return absl::InvalidArgumentError(absl::StrCat("unknown status code ", code));
  m.status = absl::Status(static_cast<absl::StatusCode>(code), msg);
  return m;
}

std::string EncodeReadReq(const ReadReq& m) {
  WireWriter w;
  w.U64(m.id);
  w.U64(m.target_incarnation);
  w.U8(static_cast<uint8_t>(m.what));
  w.Str(m.job_id);
  w.U64(m.step);
  w.U32(m.rank);
  w.U32(m.group);
  w.U32(m.stripe);
  w.U32(m.position);
  w.U32(m.data_k);
  w.U32(m.blob_segment_index);
  w.U64(m.offset);
  w.U64(m.length);
  w.Str(m.sender_node_id);
  w.U64(m.sender_incarnation);
  return w.Take();
}

absl::StatusOr<ReadReq> DecodeReadReq(std::string_view h) {
  WireReader r(h);
  ReadReq m;
  m.id = r.U64();
  m.target_incarnation = r.U64();
  const uint8_t what = r.U8();
  m.job_id = r.Str();
  m.step = r.U64();
  m.rank = r.U32();
  m.group = r.U32();
  m.stripe = r.U32();
  m.position = r.U32();
  m.data_k = r.U32();
  m.blob_segment_index = r.U32();
  m.offset = r.U64();
  m.length = r.U64();
  if (!r.AtEnd()) {
    m.sender_node_id = r.Str();
    m.sender_incarnation = r.U64();
  }
  if (absl::Status s = r.Finish("read request"); !s.ok()) return s;
  if (what < 1 || what > 2) return absl::InvalidArgumentError(absl::StrCat("unknown read kind ", what));
  m.what = static_cast<ReadWhat>(what);
  return m;
}

}  // namespace ckpt::agent
