// libFuzzer target: the data port's handshake (transport/ucx/handshake.h),
// fed in pieces whose sizes come from the input, as a socket delivers them,
// to a reader expecting one of the record kinds a handshake uses (chosen by
// the input too). A reader never consumes more than it wanted, a record it
// accepts has exactly the expected flags and fields (a proof of kProofBytes
// with kProof, an address of 1..kMaxWorkerAddressBytes with kAddress, an
// identity block of 1..kMaxIdentityBytes with kIdentity, and none of them
// otherwise) and encodes back to the bytes it read. An identity block it
// accepts is then decoded (node_identity.h): a block that decodes encodes
// back to the same bytes.
#include <algorithm>
#include <cstddef>
#include <iterator>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "transport/ucx/handshake.h"
#include "transport/ucx/node_identity.h"

namespace w = ckpt::transport::ucx_wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t piece = 1 + data[0] % 64;
  const uint8_t expected = w::kRecordKinds[data[1] % std::size(w::kRecordKinds)];
  std::string_view in(reinterpret_cast<const char*>(data) + 2, size - 2);
  w::GreetingReader r(expected);
  std::string taken;
  while (!in.empty() && !r.done()) {
    const size_t n = std::min({piece, in.size(), r.wanted()});
    auto used = r.Feed(in.substr(0, n));
    if (!used.ok()) return 0;
    if (*used > n) std::abort();
    taken.append(in.substr(0, *used));
    in.remove_prefix(*used);
    if (*used == 0) break;
  }
  if (r.done()) {
    const w::Greeting& g = r.greeting();
    if (g.flags != expected || g.peer_id == 0) std::abort();
    if (g.proof.size() != ((expected & w::kProof) != 0 ? w::kProofBytes : 0)) std::abort();
    const bool has_address = (expected & w::kAddress) != 0;
    if (has_address != !g.worker_address.empty() || g.worker_address.size() > w::kMaxWorkerAddressBytes) std::abort();
    const bool has_identity = (expected & w::kIdentity) != 0;
    if (has_identity != !g.identity.empty() || g.identity.size() > w::kMaxIdentityBytes) std::abort();
    auto bytes = w::EncodeGreeting(g);
    if (!bytes.ok() || *bytes != taken) std::abort();
    if (has_identity) {
      auto block = ckpt::transport::DecodeIdentityBlock(g.identity);
      if (block.ok() && ckpt::transport::EncodeIdentityBlock(*block) != g.identity) std::abort();
      if (block.ok() && !block->public_key.empty() && block->public_key.size() != ckpt::transport::kX25519Bytes) {
        std::abort();
      }
    }
  }
  return 0;
}
