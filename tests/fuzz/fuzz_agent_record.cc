// libFuzzer target: an agent's holding record (<memory-dir>/records/*), which
// a restarted agent re-adopts (DecodeShardRecord), and the round trip. A
// record whose items ValidateManifest accepts holds the manifest invariants
// (manifest_invariants.h).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/manifest.h"
#include "manifest_invariants.h"
#include "server/agent/arena.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  auto rec = ckpt::agent::DecodeShardRecord(in);
  if (!rec.ok()) return 0;
  if (ckpt::ValidateManifest(rec->items, rec->size_bytes).ok()) {
    ckpt::fuzz::AssertManifestInvariants(rec->items, rec->size_bytes);
  }
  auto again = ckpt::agent::DecodeShardRecord(ckpt::agent::EncodeShardRecord(*rec));
  if (!again.ok() || again->items != rec->items || again->extents.size() != rec->extents.size() ||
      again->size_bytes != rec->size_bytes || again->crc32c != rec->crc32c) {
    std::abort();
  }
  return 0;
}
