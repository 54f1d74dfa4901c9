// ckpt-dpu-agent: the agent daemon in offload mode (docs/architecture.md "Processes", docs/dpu.md).
// The same daemon as ckpt-agent (server/cmd/agent_daemon.h: memory tier,
// peers, EC, flush, restore), with pull-mode ingest: trainers stage shards in
// memory of their own and the agent reads them with one-sided UCX gets.
#include "absl/synchronization/mutex.h"
#include "dpu_agent/ucx_puller.h"
#include "server/cmd/agent_daemon.h"

int main(int argc, char** argv) {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  ckpt::daemon::AgentFlavor flavor;
  flavor.program = "ckpt-dpu-agent";
  flavor.dpu = true;
  flavor.description =
      "ckpt-dpu-agent: the ckpt agent for a DPU (BlueField-class). Holds the checkpoint shards of the trainers "
      "on its host (--host-node) in its own memory tier (--memory-dir), reading them from the trainers' "
      "registered staging memory with one-sided UCX gets (RDMA READ on hardware: no host CPU on the data "
      "path), and protects, flushes and restores them like ckpt-agent, with which it mixes in one cluster.\n\n"
      "Trainers reach it on <run-dir>/agent.sock and session.sock (on a BlueField: through the host-side "
      "socket proxy, docs/dpu.md). Configuration is layered: a YAML file (--config), then CKPT_* "
      "environment variables, then flags. SIGTERM or SIGINT exits 0 after draining calls.";
  flavor.make_puller = []() -> absl::StatusOr<std::unique_ptr<ckpt::agent::Puller>> {
    absl::StatusOr<std::unique_ptr<ckpt::dpu::UcxPuller>> p = ckpt::dpu::UcxPuller::Create({});
    if (!p.ok()) return p.status();
    return std::unique_ptr<ckpt::agent::Puller>(std::move(*p));
  };
  return ckpt::daemon::RunAgentDaemon(argc, argv, flavor);
}
