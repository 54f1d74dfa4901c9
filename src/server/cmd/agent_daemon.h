// The node agent daemon's entry point, shared by ckpt-agent (agent_main.cc)
// and ckpt-dpu-agent (src/dpu_agent/), which differ only in what this names:
// flags, configuration, wiring and signals are the same code.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/agent/puller.h"

namespace ckpt::daemon {

struct AgentFlavor {
  const char* program = "ckpt-agent";  // logs, --help, errors
  std::string description;             // --help text; "" for ckpt-agent's
  // A DPU agent: --host-node is required, the node registers with meta as
  // role DPU serving that host.
  bool dpu = false;
  // Pull-mode ingest (AgentOptions::puller), built once logging is set up;
  // null: push mode.
  std::function<absl::StatusOr<std::unique_ptr<agent::Puller>>()> make_puller;
};

// Parses flags and configuration, runs the agent until SIGTERM/SIGINT.
// Returns the process exit code (0 clean, 1 runtime failure, 2 usage).
int RunAgentDaemon(int argc, char** argv, const AgentFlavor& flavor);

}  // namespace ckpt::daemon
