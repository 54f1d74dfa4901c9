// libFuzzer target: the packed manifest a client sends with CommitShard
// (DecodeManifest), then ValidateManifest on what decodes, and the round trip
// EncodeManifest -> DecodeManifest, which must give the same items. Whatever
// ValidateManifest accepts must hold the manifest invariants
// (manifest_invariants.h: shape x dtype = length exactly, own items inside
// the shard, no overlap), checked in arithmetic that cannot wrap.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/manifest.h"
#include "manifest_invariants.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  auto items = ckpt::DecodeManifest(in);
  if (!items.ok()) return 0;
  // The largest shard, and one small enough that placement matters.
  for (uint64_t shard_size : {uint64_t{UINT64_MAX}, uint64_t{1} << 16}) {
    if (ckpt::ValidateManifest(*items, shard_size).ok()) ckpt::fuzz::AssertManifestInvariants(*items, shard_size);
  }
  auto again = ckpt::DecodeManifest(ckpt::EncodeManifest(*items));
  if (!again.ok() || *again != *items) std::abort();
  return 0;
}
