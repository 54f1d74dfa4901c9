// libFuzzer target: manifest.json of a durable-tier version
// (ParseDurableManifest, what restores and `ckptctl restore --from-dir`
// trust), and the round trip through EncodeDurableManifest.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/durable_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  auto m = ckpt::ParseDurableManifest(in);
  if (!m.ok()) return 0;
  auto text = ckpt::EncodeDurableManifest(*m);
  if (!text.ok()) std::abort();  // what parses must encode
  auto again = ckpt::ParseDurableManifest(*text);
  if (!again.ok() || *again != *m) std::abort();
  return 0;
}
