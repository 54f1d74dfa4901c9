// ckpt-agent: the node agent daemon (agent_daemon.h), in push mode: trainers
// write their shards straight into its memory tier.
#include "absl/synchronization/mutex.h"
#include "server/cmd/agent_daemon.h"

int main(int argc, char** argv) {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return ckpt::daemon::RunAgentDaemon(argc, argv, ckpt::daemon::AgentFlavor{});
}
