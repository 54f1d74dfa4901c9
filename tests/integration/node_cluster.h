// Clusters for integration tests, as GoogleTest fixture bases, in a fresh
// temp dir: NodeClusterTest is a real ckpt-meta and one ckpt-agent (durable
// root included); NodesClusterTest is ckpt-meta and agents n0, n1, ...
// Subclasses pick the agents' memory budget (and arguments).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

#include "integration/agent_process.h"
#include "integration/meta_process.h"
#include "support/process.h"
#include "support/temp_dir.h"

namespace ckpt::testing {

// A fresh temp dir and a real ckpt-meta with its data in <dir>/meta.
inline void StartMetaInTempDir(std::unique_ptr<TempDir>* dir, std::unique_ptr<MetaProcess>* meta) {
  absl::StatusOr<TempDir> d = TempDir::Create();
  ASSERT_TRUE(d.ok()) << d.status();
  *dir = std::make_unique<TempDir>(*std::move(d));
  absl::StatusOr<std::unique_ptr<MetaProcess>> m = MetaProcess::Start(*(*dir)->Sub("meta"), (*dir)->path());
  ASSERT_TRUE(m.ok()) << m.status();
  *meta = *std::move(m);
}

class NodeClusterTest : public ::testing::Test {
 protected:
  explicit NodeClusterTest(std::string memory) : memory_(std::move(memory)) {}

  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(StartMetaInTempDir(&dir_, &meta_));
    AgentProcessOptions o;
    o.meta_address = meta_->address();
    o.dir = *dir_->Sub("agent");
    o.durable_root = *dir_->Sub("durable");
    o.memory = memory_;
    absl::StatusOr<std::unique_ptr<AgentProcess>> agent = AgentProcess::Start(o);
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = *std::move(agent);
  }

  // ckptctl's command line with --meta pointing at the test's meta, then `args`.
  std::vector<std::string> Argv(std::vector<std::string> args) const {
    std::vector<std::string> argv = {BinaryPath("ckptctl"), "--meta", meta_->address()};
    for (std::string& a : args) argv.push_back(std::move(a));
    return argv;
  }

  // Runs ckptctl (Argv) to completion within `timeout`.
  RunResult Ctl(std::vector<std::string> args, absl::Duration timeout = absl::Seconds(60)) {
    SubprocessOptions o;
    o.argv = Argv(std::move(args));
    absl::StatusOr<RunResult> r = RunToCompletion(o, timeout);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return RunResult{ExitStatus(-1), "", ""};
    return *std::move(r);
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

// ckpt-meta and `nodes` agents named n0, n1, ... (no durable root), each with
// `memory` and `extra_args`; Logs() is every daemon's log tail.
class NodesClusterTest : public ::testing::Test {
 protected:
  NodesClusterTest(int nodes, std::string memory, std::vector<std::string> extra_args = {})
      : nodes_(nodes), memory_(std::move(memory)), extra_args_(std::move(extra_args)) {}

  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(StartMetaInTempDir(&dir_, &meta_));
    for (int i = 0; i < nodes_; ++i) {
      AgentProcessOptions o;
      o.node_id = absl::StrCat("n", i);
      o.meta_address = meta_->address();
      o.dir = *dir_->Sub(o.node_id);
      o.memory = memory_;
      o.extra_args = extra_args_;
      absl::StatusOr<std::unique_ptr<AgentProcess>> a = AgentProcess::Start(o);
      ASSERT_TRUE(a.ok()) << a.status();
      agents_.push_back(*std::move(a));
    }
  }

  std::string Logs() {
    std::string out = "--- meta ---\n" + meta_->proc()->LogTail();
    for (size_t i = 0; i < agents_.size(); ++i) {
      absl::StrAppend(&out, "--- n", i, " ---\n", agents_[i]->proc()->LogTail());
    }
    return out;
  }

  const int nodes_;
  const std::string memory_;
  const std::vector<std::string> extra_args_;
  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<MetaProcess> meta_;
  std::vector<std::unique_ptr<AgentProcess>> agents_;
};

}  // namespace ckpt::testing
