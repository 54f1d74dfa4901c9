// libFuzzer target: the data port's handshake (transport/ucx/handshake.h),
// fed in pieces whose sizes come from the input, as a socket delivers them,
// to a reader expecting one of the record kinds a handshake uses (chosen by
// the input too). A reader never consumes more than it wanted, a record it
// accepts has exactly the expected flags and fields (a proof of kProofBytes
// with kProof, an address of 1..kMaxWorkerAddressBytes with kAddress, and
// neither otherwise) and encodes back to the bytes it read.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "transport/ucx/handshake.h"

namespace w = ckpt::transport::ucx_wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  static constexpr uint8_t kKinds[] = {w::kAddress, w::kKeyed, w::kKeyed | w::kProof,
                                       w::kKeyed | w::kProof | w::kAddress, w::kKeyed | w::kAddress};
  const size_t piece = 1 + data[0] % 64;
  const uint8_t expected = kKinds[data[1] % 5];
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
    auto bytes = w::EncodeGreeting(g);
    if (!bytes.ok() || *bytes != taken) std::abort();
  }
  return 0;
}
