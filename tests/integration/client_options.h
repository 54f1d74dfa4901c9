// ClientOptions for a rank of `job` talking to a test cluster's meta and agent.
#pragma once

#include <string>

#include "ckpt/client.h"
#include "integration/agent_process.h"
#include "integration/meta_process.h"

namespace ckpt::testing {

inline ClientOptions ClientOptionsFor(const MetaProcess& meta, const AgentProcess& agent, const std::string& job,
                                      uint32_t rank, uint32_t world) {
  ClientOptions o;
  o.meta_address = meta.address();
  o.agent_socket = agent.socket_path();
  o.job_id = job;
  o.rank = rank;
  o.world_size = world;
  o.connect_timeout = absl::Seconds(20);
  return o;
}

}  // namespace ckpt::testing
