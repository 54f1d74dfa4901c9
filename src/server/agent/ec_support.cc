#include "server/agent/ec_support.h"

#include <map>
#include <memory>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "common/lock_check.h"
#include "common/status_macros.h"

namespace ckpt::agent {

absl::StatusOr<const ec::Codec*> CodecFor(uint32_t k, uint32_t m) {
  static absl::Mutex mu;
  static auto* codecs = new std::map<std::pair<uint32_t, uint32_t>, std::unique_ptr<ec::Codec>>();
  CheckedLock lock(&mu);
  auto& c = (*codecs)[{k, m}];
  if (c == nullptr) {
    CKPT_ASSIGN_OR_RETURN(c, ec::Codec::Create(static_cast<int>(k), static_cast<int>(m)));
  }
  return c.get();
}

}  // namespace ckpt::agent
