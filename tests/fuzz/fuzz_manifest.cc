// libFuzzer target: the packed manifest a client sends with CommitShard
// (DecodeManifest), then ValidateManifest on what decodes, and the round trip
// EncodeManifest -> DecodeManifest, which must give the same items.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  auto items = ckpt::DecodeManifest(in);
  if (!items.ok()) return 0;
  (void)ckpt::ValidateManifest(*items, UINT64_MAX).ok();
  auto again = ckpt::DecodeManifest(ckpt::EncodeManifest(*items));
  if (!again.ok() || *again != *items) std::abort();
  return 0;
}
