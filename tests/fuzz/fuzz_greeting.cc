// libFuzzer target: the data port's handshake (transport/ucx/handshake.h),
// fed in pieces whose sizes come from the input, as a socket delivers them.
// A reader never consumes more than it wanted, and a greeting it accepts
// encodes back to the bytes it read.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "transport/ucx/handshake.h"

namespace w = ckpt::transport::ucx_wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t piece = 1 + data[0] % 64;
  std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  w::GreetingReader r;
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
    auto bytes = w::EncodeGreeting(r.greeting());
    if (!bytes.ok() || *bytes != taken) std::abort();
  }
  return 0;
}
