// A one-node cluster for integration tests: a real ckpt-meta and one
// ckpt-agent (durable root included) in a fresh temp dir, as a GoogleTest
// fixture base. Subclasses pick the agent's memory budget.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "integration/agent_process.h"
#include "integration/meta_process.h"
#include "support/temp_dir.h"

namespace ckpt::testing {

class NodeClusterTest : public ::testing::Test {
 protected:
  explicit NodeClusterTest(std::string memory) : memory_(std::move(memory)) {}

  void SetUp() override {
    absl::StatusOr<TempDir> dir = TempDir::Create();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::make_unique<TempDir>(*std::move(dir));
    absl::StatusOr<std::unique_ptr<MetaProcess>> meta = MetaProcess::Start(*dir_->Sub("meta"), dir_->path());
    ASSERT_TRUE(meta.ok()) << meta.status();
    meta_ = *std::move(meta);
    AgentProcessOptions o;
    o.meta_address = meta_->address();
    o.dir = *dir_->Sub("agent");
    o.durable_root = *dir_->Sub("durable");
    o.memory = memory_;
    absl::StatusOr<std::unique_ptr<AgentProcess>> agent = AgentProcess::Start(o);
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = *std::move(agent);
  }

  // Stops `proc` (if it is still running) with SIGTERM and expects it to exit 0 within
  // 60 s. In a sanitizer build this is also when the daemon checks for leaks: a leak or
  // any other finding fails the exit.
  static void ExpectCleanStop(Subprocess& proc) {
    if (!proc.IsRunning()) {
      ADD_FAILURE() << proc.name() << " is not running:\n" << proc.LogTail(16384);
      return;
    }
    absl::StatusOr<ExitStatus> exit = proc.Terminate(absl::Seconds(60));
    ASSERT_TRUE(exit.ok()) << exit.status();
    EXPECT_TRUE(exit->success()) << proc.name() << " " << *exit << " after SIGTERM:\n"
                                 << proc.LogTail(16384);
  }

  const std::string memory_;
  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<MetaProcess> meta_;
  std::unique_ptr<AgentProcess> agent_;
};

}  // namespace ckpt::testing
