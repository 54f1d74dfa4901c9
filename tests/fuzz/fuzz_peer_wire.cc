// libFuzzer target: the data plane's message headers from a peer
// (server/agent/peer_wire.h). The first byte picks the decoder; each decoded
// message must encode and decode to itself.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "server/agent/peer_wire.h"

namespace w = ckpt::agent;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
      if (auto m = w::DecodePutBegin(in); m.ok()) {
        auto again = w::DecodePutBegin(w::EncodePutBegin(*m));
        if (!again.ok() || again->xfer != m->xfer || again->job_id != m->job_id ||
            again->total_bytes != m->total_bytes || again->sender_node_id != m->sender_node_id ||
            again->sender_incarnation != m->sender_incarnation) {
          std::abort();
        }
      }
      break;
    case 1:
      if (auto m = w::DecodeChunk(in); m.ok()) {
        auto again = w::DecodeChunk(w::EncodeChunk(*m));
        if (!again.ok() || again->offset != m->offset) std::abort();
      }
      break;
    case 2:
      if (auto m = w::DecodeResult(in); m.ok()) {
        auto again = w::DecodeResult(w::EncodeResult(*m));
        if (!again.ok() || again->status.code() != m->status.code()) std::abort();
      }
      break;
    default:
      if (auto m = w::DecodeReadReq(in); m.ok()) {
        auto again = w::DecodeReadReq(w::EncodeReadReq(*m));
        if (!again.ok() || again->job_id != m->job_id || again->length != m->length ||
            again->sender_node_id != m->sender_node_id || again->sender_incarnation != m->sender_incarnation) {
          std::abort();
        }
      }
      break;
  }
  return 0;
}
