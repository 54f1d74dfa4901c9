// PullStaging in a build without UCX (CKPT_WITH_UCX=OFF).
#include "client/pull_staging.h"

namespace ckpt::client {

absl::StatusOr<std::shared_ptr<PullStaging>> PullStaging::Create() {
  return absl::UnimplementedError(
      "the agent is a DPU agent (pull-mode ingest), and this ckpt client was built without UCX");
}

}  // namespace ckpt::client
