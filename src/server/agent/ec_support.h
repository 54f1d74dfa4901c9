// Small EC helpers shared by the agent's components: a process-wide cache of
// ISA-L codecs per (k, m) (building one computes matrices and tables).
//
// Thread safety: CodecFor may be called from any thread; the codecs it
// returns live until the process exits and are safe to share.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "ec/codec.h"

namespace ckpt::agent {

// The codec for RS(k, m). InvalidArgument for an unsupported geometry.
absl::StatusOr<const ec::Codec*> CodecFor(uint32_t k, uint32_t m);

}  // namespace ckpt::agent
