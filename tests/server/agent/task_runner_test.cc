// TaskRunner: deferred tasks and the wait between steps. A task that asks to
// be called again (waiting for the verifier, for parity) runs again as soon as
// the runner is poked, and no later than its retry delay; a wake that comes
// while a step runs is never lost. Time is a FakeClock; the waits run on a
// helper thread only where a wait is what is tested.
#include "server/agent/task_runner.h"

#include <atomic>
#include <thread>

#include <gtest/gtest.h>

#include "common/metrics.h"
#include "fake_meta.h"

namespace ckpt::agent {
namespace {

AgentTask Task(const std::string& id, TaskKind kind) {
  AgentTask t;
  t.id = id;
  t.kind = kind;
  t.kind_name = "test";
  t.job_id = "job";
  t.step = 1;
  return t;
}

class TaskRunnerTest : public ::testing::Test {
 protected:
  TaskRunnerTest()
      : agent_metrics_(metrics_),
        session_(&meta_, &clock_, &agent_metrics_, SessionOptions(), &delegate_) {}

  static MetaSession::Options SessionOptions() {
    MetaSession::Options o;
    o.node_id = "n0";
    return o;
  }

  std::unique_ptr<TaskRunner> Runner(std::function<absl::Status(QueuedTask&, bool*)> step) {
    TaskRunner::Hooks hooks;
    hooks.step = std::move(step);
    return std::make_unique<TaskRunner>(&clock_, &session_, TaskRunner::Options{}, std::move(hooks));
  }

  FakeClock clock_;
  MetricsRegistry metrics_;
  AgentMetrics agent_metrics_;
  FakeMeta meta_;
  NoDelegate delegate_;
  MetaSession session_;
};

TEST_F(TaskRunnerTest, ADeferredTaskRunsAgainWhenPoked) {
  std::atomic<bool> ready{false};
  int steps = 0;
  auto runner = Runner([&](QueuedTask&, bool* finished) {
    ++steps;
    *finished = ready.load();
    return absl::OkStatus();
  });
  runner->Enqueue({Task("t1", TaskKind::kReplicate)});
  EXPECT_FALSE(runner->RunOnce());  // deferred: waits for the "verifier"
  EXPECT_EQ(steps, 1);
  EXPECT_FALSE(runner->RunOnce());  // not due yet: the step does not run
  EXPECT_EQ(steps, 1);
  ready = true;
  runner->Poke();  // what it waited for happened: due at once, no clock moved
  EXPECT_TRUE(runner->RunOnce());
  EXPECT_EQ(steps, 2);
  EXPECT_TRUE(runner->Running().empty());
}

TEST_F(TaskRunnerTest, AWaitEndsWhenTheEarliestDeferredTaskIsDue) {
  int steps = 0;
  auto runner = Runner([&](QueuedTask&, bool* finished) {
    *finished = ++steps > 1;
    return absl::OkStatus();
  });
  runner->Enqueue({Task("t1", TaskKind::kReplicate)});
  runner->AwaitWork(absl::Seconds(10));  // consumes the Enqueue's wake: returns at once
  EXPECT_FALSE(runner->RunOnce());
  // The wait must end at the task's retry time (20 ms), not at the 10 s
  // timeout: advancing 20 ms is enough to release it.
  std::thread waiter([&] { runner->AwaitWork(absl::Seconds(10)); });
  clock_.BlockUntilWaiters(1);
  clock_.Advance(absl::Milliseconds(20));
  waiter.join();
  EXPECT_TRUE(runner->RunOnce());
  EXPECT_EQ(steps, 2);
}

TEST_F(TaskRunnerTest, AWakeDuringAStepIsNotLost) {
  std::unique_ptr<TaskRunner> runner;
  runner = Runner([&](QueuedTask& qt, bool*) {
    // A new task arrives while this one runs (between RunOnce and AwaitWork).
    if (qt.task.id == "t1") runner->Enqueue({Task("t2", TaskKind::kEvict)});
    return absl::OkStatus();
  });
  runner->Enqueue({Task("t1", TaskKind::kEvict)});
  runner->AwaitWork(absl::Seconds(10));
  EXPECT_TRUE(runner->RunOnce());
  // t2's wake came after the last wait: this wait returns without the clock
  // moving (it would block for 10 s of fake time otherwise and the test hang).
  runner->AwaitWork(absl::Seconds(10));
  EXPECT_TRUE(runner->RunOnce());
  EXPECT_FALSE(runner->RunOnce());
}

TEST_F(TaskRunnerTest, APokeDoesNotCutAFlushBackoffShort) {
  int steps = 0;
  auto runner = Runner([&](QueuedTask&, bool*) {
    ++steps;
    return absl::UnavailableError("durable store down");
  });
  runner->Enqueue({Task("f1", TaskKind::kFlush)});
  EXPECT_TRUE(runner->RunOnce());  // failed, retried after a backoff
  runner->Poke();
  EXPECT_FALSE(runner->RunOnce());
  EXPECT_EQ(steps, 1);
  clock_.Advance(absl::Milliseconds(500));
  EXPECT_TRUE(runner->RunOnce());
  EXPECT_EQ(steps, 2);
}

// Issue 35: the hooks run without the runner's lock (the lock order of
// agent.h), so a hook may call into other components and back into the
// runner. AssertNoCheckedLock aborts the test if a hook runs under it.
TEST_F(TaskRunnerTest, HooksRunWithoutTheRunnersLock) {
  std::unique_ptr<TaskRunner> runner;
  std::vector<std::string> seen;
  TaskRunner::Hooks hooks;
  hooks.step = [](QueuedTask& qt, bool*) {
    return qt.task.id == "f1" ? absl::UnavailableError("durable store down") : absl::OkStatus();
  };
  hooks.on_queued = [&](const AgentTask& t) {
    AssertNoCheckedLock("on_queued");
    seen.push_back("queued " + t.id);
  };
  hooks.on_cancelled = [&](const AgentTask& t) {
    AssertNoCheckedLock("on_cancelled");
    seen.push_back("cancelled " + t.id);
    runner->Poke();
  };
  hooks.on_flush_error = [&](const absl::Status&) {
    AssertNoCheckedLock("on_flush_error");
    seen.push_back("flush error");
  };
  hooks.on_ended = [&](const AgentTask& t, const absl::Status& s) {
    AssertNoCheckedLock("on_ended");
    seen.push_back("ended " + t.id + (s.ok() ? " ok" : " failed"));
    // Back into the runner: the ended task is no longer listed.
    for (const RunningTask& r : runner->Running()) EXPECT_NE(r.task_id, t.id);
  };
  TaskRunner::Options options;
  options.flush_max_tries = 1;  // the first failure is final
  runner = std::make_unique<TaskRunner>(&clock_, &session_, options, std::move(hooks));
  runner->Enqueue({Task("t1", TaskKind::kEvict), Task("f1", TaskKind::kFlush), Task("t2", TaskKind::kEvict)});
  runner->Cancel({"t2"});
  EXPECT_TRUE(runner->RunOnce());
  EXPECT_TRUE(runner->RunOnce());
  EXPECT_FALSE(runner->RunOnce());
  EXPECT_EQ(seen, (std::vector<std::string>{"queued t1", "queued f1", "queued t2", "cancelled t2", "flush error",
                                            "ended f1 failed", "ended t1 ok"}));
  // Both results reach meta (t2's never: meta cancelled it).
  session_.ControlOnce();
  absl::MutexLock lock(&meta_.mu);
  ASSERT_EQ(meta_.results.size(), 2u);
  EXPECT_EQ(meta_.results[0].first, "f1");
  EXPECT_EQ(meta_.results[0].second.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(meta_.results[1].first, "t1");
  EXPECT_TRUE(meta_.results[1].second.ok());
}

}  // namespace
}  // namespace ckpt::agent
