// libFuzzer target: manifest.json of a durable-tier version
// (ParseDurableManifest, what restores and `ckptctl restore --from-dir`
// trust): every shard of what parses holds the manifest invariants
// (manifest_invariants.h), and the round trip through EncodeDurableManifest
// gives the same manifest.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/durable_format.h"
#include "manifest_invariants.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  auto m = ckpt::ParseDurableManifest(in);
  if (!m.ok()) return 0;
  for (const ckpt::DurableShard& shard : m->shards) {
    ckpt::fuzz::AssertManifestInvariants(shard.items, shard.size_bytes);
  }
  auto text = ckpt::EncodeDurableManifest(*m);
  if (!text.ok()) std::abort();  // what parses must encode
  auto again = ckpt::ParseDurableManifest(*text);
  if (!again.ok() || *again != *m) std::abort();
  return 0;
}
