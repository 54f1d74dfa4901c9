// MetaSession on its own: meta is a FakeMeta whose answers a test can script
// (errors queued per call, inventory answers), the Delegate records what it
// is told and in which order, time is a FakeClock and every control round is
// run by the test (ControlOnce), so the order of messages, the backoffs and
// the re-registration after fencing are checked exactly.
#include "server/agent/meta_session.h"

#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/mem_file_system.h"
#include "fake_meta.h"
#include "memory_tier.h"

namespace ckpt::agent {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// FakeMeta plus: errors queued per call kind, the inventory answer, a log of
// calls in order ("begin job/5", "report staged job/5/0", "result t-1",
// "inventory", "heartbeat"), the last registration.
class ScriptedMeta : public FakeMeta {
 public:
  absl::StatusOr<RegistrationReply> Register(const NodeRegistration& node) override {
    {
      absl::MutexLock lock(&mu);
      last_registration = node;
      if (absl::Status e = Pop(register_errors); !e.ok()) return e;
    }
    return FakeMeta::Register(node);
  }
  absl::StatusOr<HeartbeatReply> Heartbeat(const std::string& node, uint64_t inc, const LoadReport& load) override {
    {
      absl::MutexLock lock(&mu);
      calls.push_back("heartbeat");
    }
    absl::StatusOr<HeartbeatReply> r = FakeMeta::Heartbeat(node, inc, load);
    absl::MutexLock lock(&mu);
    if (r.ok() && require_inventory) {
      r->inventory_required = true;
      require_inventory = false;
    }
    if (r.ok()) r->node_state = node_state;
    return r;
  }
  absl::StatusOr<InventoryReply> ReportInventory(const std::string& node, uint64_t inc,
                                                 const std::vector<InventoryItem>& items) override {
    {
      absl::MutexLock lock(&mu);
      calls.push_back("inventory");
      if (absl::Status e = Pop(inventory_errors); !e.ok()) return e;
    }
    absl::StatusOr<InventoryReply> base = FakeMeta::ReportInventory(node, inc, items);
    if (!base.ok()) return base.status();
    absl::MutexLock lock(&mu);
    return inventory_reply;
  }
  absl::StatusOr<uint32_t> BeginVersion(const std::string& job, uint64_t step, const std::string& run,
                                        const std::string& node) override {
    {
      absl::MutexLock lock(&mu);
      calls.push_back(absl::StrCat("begin ", job, "/", step));
    }
    return FakeMeta::BeginVersion(job, step, run, node);
  }
  absl::StatusOr<ReportReply> ReportShards(const std::string& node, uint64_t inc,
                                           const std::vector<HoldingReport>& reports) override {
    {
      absl::MutexLock lock(&mu);
      report_calls++;
      for (const HoldingReport& h : reports) {
        calls.push_back(h.kind == HoldingReport::Kind::kStaged ? absl::StrCat("report staged ", ShardIdString(h.record->id))
                                                               : absl::StrCat("report ", ShardIdString(h.id)));
      }
      if (absl::Status e = Pop(report_errors); !e.ok()) return e;
    }
    absl::StatusOr<ReportReply> base = FakeMeta::ReportShards(node, inc, reports);
    if (!base.ok()) return base.status();
    ReportReply r = *std::move(base);
    absl::MutexLock lock(&mu);
    for (size_t i = 0; i < r.results.size() && !report_results.empty(); ++i) {
      r.results[i] = report_results.front();
      report_results.pop_front();
    }
    return r;
  }
  absl::Status ReportTaskResult(const std::string& node, uint64_t inc, const std::string& task_id, uint32_t attempt,
                                const absl::Status& result, uint64_t bytes, int64_t ms) override {
    {
      absl::MutexLock lock(&mu);
      calls.push_back(absl::StrCat("result ", task_id));
      if (absl::Status e = Pop(result_errors); !e.ok()) return e;
    }
    return FakeMeta::ReportTaskResult(node, inc, task_id, attempt, result, bytes, ms);
  }

  std::vector<std::string> Calls() {
    absl::MutexLock lock(&mu);
    return calls;
  }
  void ClearCalls() {
    absl::MutexLock lock(&mu);
    calls.clear();
  }

  std::deque<absl::Status> register_errors, inventory_errors, report_errors, result_errors;
  std::deque<absl::Status> report_results;  // replace the per-report results, in order
  InventoryReply inventory_reply;
  bool require_inventory = false;
  NodeState node_state = NodeState::kAlive;
  int report_calls = 0;
  NodeRegistration last_registration;
  std::vector<std::string> calls;

 private:
  static absl::Status Pop(std::deque<absl::Status>& q) {
    if (q.empty()) return absl::OkStatus();
    absl::Status e = q.front();
    q.pop_front();
    return e;
  }
};

class RecordingDelegate : public MetaSession::Delegate {
 public:
  std::vector<InventoryItem> InventoryItems() override {
    absl::MutexLock lock(&mu_);
    return items;
  }
  LoadReport Load() override {
    LoadReport l;
    l.memory_capacity_bytes = 1234;
    return l;
  }
  void OnTasks(std::vector<AgentTask> tasks, std::vector<std::string> cancelled) override {
    absl::MutexLock lock(&mu_);
    for (const AgentTask& t : tasks) log.push_back("task " + t.id);
    for (const std::string& c : cancelled) log.push_back("cancel " + c);
  }
  void OnDrop(const std::vector<ShardId>& shards, const std::vector<SegmentId>& segments) override {
    absl::MutexLock lock(&mu_);
    for (const ShardId& s : shards) log.push_back("drop " + ShardIdString(s));
    for (const SegmentId& s : segments) log.push_back("drop " + SegmentIdString(s));
  }
  void OnVersionRefused(const std::string& job, uint64_t step, const std::string& run,
                        const absl::Status& why) override {
    absl::MutexLock lock(&mu_);
    log.push_back(absl::StrCat("refused ", job, "/", step, " ", run, " ", absl::StatusCodeToString(why.code())));
  }
  void OnCopyRefused(const HoldingReport& report, const absl::Status& why) override {
    absl::MutexLock lock(&mu_);
    log.push_back(absl::StrCat("copy refused ", ShardIdString(report.id), " ", absl::StatusCodeToString(why.code())));
  }
  std::vector<std::string> Log() {
    absl::MutexLock lock(&mu_);
    return log;
  }

  std::vector<InventoryItem> items;
  std::vector<std::string> log;

 private:
  absl::Mutex mu_;
};

HoldingReport Staged(const ShardId& id) {
  HoldingReport r;
  r.kind = HoldingReport::Kind::kStaged;
  r.record = std::make_shared<const ShardRecord>(RecordOf(id, SeededBytes(64, id.rank)));
  return r;
}

HoldingReport CopyReport(const ShardId& id, CopyState state) {
  HoldingReport r;
  r.kind = HoldingReport::Kind::kCopyState;
  r.id = id;
  r.copy_role = CopyRole::kReplica;
  r.copy_state = state;
  return r;
}

// Collects the statuses `on_done` callbacks are called with.
struct Answers {
  MetaSession::Done Collect() {
    return [this](const absl::Status& s) {
      absl::MutexLock lock(&mu);
      got.push_back(s.code());
    };
  }
  std::vector<absl::StatusCode> Got() {
    absl::MutexLock lock(&mu);
    return got;
  }
  absl::Mutex mu;
  std::vector<absl::StatusCode> got;
};

class MetaSessionTest : public ::testing::Test {
 protected:
  MetaSessionTest() : agent_metrics_(metrics_) {
    meta_.world["job"] = 2;
    EXPECT_TRUE(fs_.CreateDirs("/mem").ok());
    MakeSession();
  }
  ~MetaSessionTest() override {
    if (session_) session_->Stop();
  }

  void MakeSession(uint64_t previous_incarnation = 0) {
    MetaSession::Options o;
    o.node_id = "n0";
    o.grpc_address = "localhost:1";
    o.data_address = [] { return std::string("loop:n0"); };
    o.memory_capacity_bytes = 1 << 20;
    o.memory_dir = "/mem";
    o.fs = &fs_;
    o.previous_incarnation = previous_incarnation;
    o.on_data_plane_key = [this](const std::string& key) {
      absl::MutexLock lock(&keys_mu_);
      keys_.push_back(key);
    };
    session_ = std::make_unique<MetaSession>(&meta_, &clock_, &agent_metrics_, o, &delegate_);
  }
  // Registers and applies the (empty) inventory.
  void Connect() {
    session_->ControlOnce();
    ASSERT_TRUE(session_->Status().registered);
    meta_.ClearCalls();
  }

  FakeClock clock_;
  MetricsRegistry metrics_;
  AgentMetrics agent_metrics_;
  MemFileSystem fs_;
  ScriptedMeta meta_;
  RecordingDelegate delegate_;
  std::unique_ptr<MetaSession> session_;
  absl::Mutex keys_mu_;
  std::vector<std::string> keys_;
};

TEST(IsPermanentRefusal, OnlyMetasFinalAnswers) {
  EXPECT_TRUE(IsPermanentRefusal(absl::InvalidArgumentError("")));
  EXPECT_TRUE(IsPermanentRefusal(absl::FailedPreconditionError("")));
  EXPECT_TRUE(IsPermanentRefusal(absl::NotFoundError("")));
  EXPECT_TRUE(IsPermanentRefusal(absl::OutOfRangeError("")));
  for (const absl::Status& s : {absl::UnavailableError(""), absl::DeadlineExceededError(""), absl::InternalError(""),
                                absl::UnknownError(""), absl::CancelledError(""), absl::ResourceExhaustedError(""),
                                absl::AbortedError(""), absl::OkStatus()}) {
    EXPECT_FALSE(IsPermanentRefusal(s)) << s;
  }
}

TEST(IncarnationFile, RoundTripsAndReadsNothingAsZero) {
  MemFileSystem fs;
  ASSERT_TRUE(fs.CreateDirs("/mem").ok());
  EXPECT_EQ(IncarnationPath("/mem"), "/mem/incarnation");
  EXPECT_EQ(*ReadIncarnationFile(&fs, "/mem/incarnation"), 0u);
  ASSERT_TRUE(WriteIncarnationFile(&fs, "/mem/incarnation", 42).ok());
  EXPECT_EQ(*ReadFileToString(&fs, "/mem/incarnation"), "42\n");
  EXPECT_EQ(*ReadIncarnationFile(&fs, "/mem/incarnation"), 42u);
  ASSERT_TRUE(WriteIncarnationFile(&fs, "/mem/incarnation", 43).ok());
  EXPECT_EQ(*ReadIncarnationFile(&fs, "/mem/incarnation"), 43u);
  ASSERT_TRUE(WritePrivateFileAtomically(&fs, "/mem/incarnation", "not a number").ok());
  EXPECT_EQ(*ReadIncarnationFile(&fs, "/mem/incarnation"), 0u);
}

TEST_F(MetaSessionTest, RegistersRemembersTheIncarnationAndSendsTheInventory) {
  meta_.data_plane_key = "k1";
  MakeSession(/*previous_incarnation=*/7);
  EXPECT_FALSE(session_->Status().registered);
  session_->ControlOnce();
  {
    absl::MutexLock lock(&meta_.mu);
    EXPECT_EQ(meta_.registrations, 1);
    EXPECT_EQ(meta_.last_registration.node_id, "n0");
    EXPECT_EQ(meta_.last_registration.previous_incarnation, 7u);
    EXPECT_EQ(meta_.last_registration.data_address, "loop:n0");
    EXPECT_EQ(meta_.last_registration.memory_capacity_bytes, 1u << 20);
    EXPECT_EQ(meta_.inventories.size(), 1u);
  }
  EXPECT_EQ(*ReadFileToString(&fs_, "/mem/incarnation"), "1\n");
  {
    absl::MutexLock lock(&keys_mu_);
    EXPECT_THAT(keys_, ElementsAre("k1"));
  }
  MetaSession::Snapshot s = session_->Status();
  EXPECT_TRUE(s.registered);
  EXPECT_TRUE(s.meta_reachable);
  EXPECT_EQ(s.incarnation, 1u);
  EXPECT_EQ(session_->incarnation(), 1u);
  EXPECT_EQ(s.lease_remaining_ms, 5000);  // FakeMeta's lease
  EXPECT_EQ(s.last_heartbeat_unix_ms, clock_.NowUnixMillis());
  EXPECT_EQ(agent_metrics_.registered->Value(), 1.0);
  // No heartbeat in the registering round: it is due a heartbeat interval later.
  EXPECT_THAT(meta_.Calls(), ElementsAre("inventory"));
}

TEST_F(MetaSessionTest, AFailedRegistrationIsRetriedAfterASecond) {
  meta_.register_errors = {absl::UnavailableError("meta down")};
  session_->ControlOnce();
  EXPECT_FALSE(session_->Status().registered);
  EXPECT_FALSE(session_->Status().meta_reachable);
  EXPECT_EQ(agent_metrics_.meta_errors->Value(), 1.0);
  clock_.Advance(absl::Milliseconds(999));
  session_->ControlOnce();
  {
    absl::MutexLock lock(&meta_.mu);
    EXPECT_EQ(meta_.registrations, 0);
  }
  clock_.Advance(absl::Milliseconds(1));
  session_->ControlOnce();
  EXPECT_TRUE(session_->Status().registered);
}

TEST_F(MetaSessionTest, SendsBeginsReportsAndResultsInTheOrderQueued) {
  Connect();
  Answers answers;
  session_->Begin("job", 5, "run");
  session_->Report(Staged({"job", 5, 0}), answers.Collect());
  session_->Report(CopyReport({"job", 4, 1}, CopyState::kValid), answers.Collect());
  session_->Result("t-1", 1, absl::OkStatus(), 10, 20);
  session_->Report(Staged({"job", 5, 1}), answers.Collect());
  EXPECT_EQ(session_->Status().outbox, 5u);
  session_->ControlOnce();
  EXPECT_THAT(meta_.Calls(), ElementsAre("begin job/5", "report staged job/5/0", "report job/4/1", "result t-1",
                                         "report staged job/5/1"));
  EXPECT_EQ(session_->Status().outbox, 0u);
  EXPECT_THAT(answers.Got(), ElementsAre(absl::StatusCode::kOk, absl::StatusCode::kOk, absl::StatusCode::kOk));
  absl::MutexLock lock(&meta_.mu);
  ASSERT_EQ(meta_.results.size(), 1u);
  EXPECT_EQ(meta_.results[0].first, "t-1");
  EXPECT_EQ(meta_.begins, 1);
}

TEST_F(MetaSessionTest, AReplayedStagedReportAnswersAlreadyExists) {
  Connect();
  Answers answers;
  session_->Report(Staged({"job", 5, 0}), answers.Collect());
  session_->ControlOnce();
  session_->Report(Staged({"job", 5, 0}), answers.Collect());
  session_->ControlOnce();
  EXPECT_THAT(answers.Got(), ElementsAre(absl::StatusCode::kOk, absl::StatusCode::kAlreadyExists));
  EXPECT_TRUE(delegate_.Log().empty());  // AlreadyExists is no refusal
}

TEST_F(MetaSessionTest, ATransientErrorKeepsEverythingQueuedAndBacksOff) {
  Connect();
  Answers answers;
  meta_.report_errors = {absl::UnavailableError("meta restarting"), absl::DeadlineExceededError("slow")};
  session_->Report(Staged({"job", 5, 0}), answers.Collect());
  session_->ControlOnce();
  EXPECT_EQ(session_->Status().outbox, 1u);
  EXPECT_FALSE(session_->Status().meta_reachable);
  EXPECT_TRUE(answers.Got().empty());
  EXPECT_EQ(agent_metrics_.meta_errors->Value(), 1.0);
  // 200 ms, then 400 ms.
  clock_.Advance(absl::Milliseconds(199));
  session_->ControlOnce();
  EXPECT_EQ(meta_.report_calls, 1);
  clock_.Advance(absl::Milliseconds(1));
  session_->ControlOnce();
  EXPECT_EQ(meta_.report_calls, 2);
  EXPECT_EQ(session_->Status().outbox, 1u);
  clock_.Advance(absl::Milliseconds(399));
  session_->ControlOnce();
  EXPECT_EQ(meta_.report_calls, 2);
  clock_.Advance(absl::Milliseconds(1));
  session_->ControlOnce();
  EXPECT_EQ(meta_.report_calls, 3);
  EXPECT_EQ(session_->Status().outbox, 0u);
  EXPECT_TRUE(session_->Status().meta_reachable);
  EXPECT_THAT(answers.Got(), ElementsAre(absl::StatusCode::kOk));
  absl::MutexLock lock(&meta_.mu);
  EXPECT_EQ(meta_.staged.size(), 1u);
}

TEST_F(MetaSessionTest, WhileMetaIsUnreachableItTriesAtLeastEverySecond) {
  // A new leader among meta's replicas (or a restarted meta) hears from us
  // within a second of serving, however long it was away.
  Connect();
  Answers answers;
  meta_.report_errors = std::deque<absl::Status>(6, absl::UnavailableError("no leader yet"));
  session_->Report(Staged({"job", 5, 0}), answers.Collect());
  session_->ControlOnce();  // call 1 fails: 200 ms
  for (absl::Duration wait : {absl::Milliseconds(200), absl::Milliseconds(400), absl::Milliseconds(800),
                              absl::Seconds(1), absl::Seconds(1)}) {
    const int calls = meta_.report_calls;
    clock_.Advance(wait - absl::Milliseconds(1));
    session_->ControlOnce();
    EXPECT_EQ(meta_.report_calls, calls) << "retried before " << wait;
    clock_.Advance(absl::Milliseconds(1));
    session_->ControlOnce();
    EXPECT_EQ(meta_.report_calls, calls + 1) << "not retried after " << wait;
  }
  clock_.Advance(absl::Seconds(1));
  session_->ControlOnce();  // the 7th call goes through
  EXPECT_EQ(session_->Status().outbox, 0u);
  EXPECT_THAT(answers.Got(), ElementsAre(absl::StatusCode::kOk));
}

TEST_F(MetaSessionTest, AParkedVersionIsRetriedAtLeastEverySecond) {
  // A begin sent while meta's leader was away is parked like one meta cannot
  // begin yet; the new leader must get it within a second of serving.
  Connect();
  meta_.begin_errors = std::deque<absl::Status>(5, absl::UnavailableError("no leader yet"));
  session_->Begin("job", 9, "run-1");
  auto begins = [&] {
    const std::vector<std::string> calls = meta_.Calls();
    return std::count(calls.begin(), calls.end(), "begin job/9");
  };
  session_->ControlOnce();  // parked: 200 ms
  for (absl::Duration wait : {absl::Milliseconds(200), absl::Milliseconds(400), absl::Milliseconds(800),
                              absl::Seconds(1), absl::Seconds(1)}) {
    const auto calls = begins();
    clock_.Advance(wait - absl::Milliseconds(1));
    session_->ControlOnce();
    EXPECT_EQ(begins(), calls) << "retried before " << wait;
    clock_.Advance(absl::Milliseconds(1));
    session_->ControlOnce();
    EXPECT_EQ(begins(), calls + 1) << "not retried after " << wait;
  }
}

TEST_F(MetaSessionTest, AValidCopyMetaRefusesIsHandedBackToBeDropped) {
  Connect();
  Answers answers;
  meta_.report_results = {absl::FailedPreconditionError("version ended"), absl::FailedPreconditionError("no"),
                          absl::InvalidArgumentError("bad")};
  session_->Report(CopyReport({"job", 5, 0}, CopyState::kValid), answers.Collect());
  session_->Report(CopyReport({"job", 5, 1}, CopyState::kCorrupt), answers.Collect());  // not a VALID copy
  session_->Report(CopyReport({"job", 5, 2}, CopyState::kValid), answers.Collect());    // not a refusal of the copy
  session_->ControlOnce();
  EXPECT_THAT(delegate_.Log(), ElementsAre("copy refused job/5/0 FAILED_PRECONDITION"));
  EXPECT_THAT(answers.Got(), ElementsAre(absl::StatusCode::kFailedPrecondition, absl::StatusCode::kFailedPrecondition,
                                         absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(session_->Status().outbox, 0u);
}

TEST_F(MetaSessionTest, AVersionRefusedForGoodTakesItsStagedReportsWithIt) {
  Connect();
  Answers refused, other;
  meta_.refuse_step = {5};
  session_->Begin("job", 5, "run-a");
  session_->Report(Staged({"job", 5, 0}), refused.Collect());
  session_->Report(Staged({"job", 6, 0}), other.Collect());
  session_->ControlOnce();
  EXPECT_THAT(delegate_.Log(), ElementsAre("refused job/5 run-a INVALID_ARGUMENT"));
  EXPECT_THAT(refused.Got(), ElementsAre(absl::StatusCode::kCancelled));
  EXPECT_THAT(other.Got(), ElementsAre(absl::StatusCode::kOk));
  EXPECT_THAT(meta_.Calls(), ElementsAre("begin job/5", "report staged job/6/0"));
}

TEST_F(MetaSessionTest, AVersionMetaCannotBeginYetWaitsWithoutHoldingUpOthers) {
  Connect();
  Answers parked, other;
  meta_.begin_errors = {absl::UnavailableError("too few nodes"), absl::UnavailableError("still too few")};
  session_->Begin("job", 5, "run");
  session_->Report(Staged({"job", 5, 0}), parked.Collect());
  session_->Report(Staged({"job", 6, 0}), other.Collect());
  session_->ControlOnce();
  EXPECT_THAT(other.Got(), ElementsAre(absl::StatusCode::kOk));
  EXPECT_TRUE(parked.Got().empty());
  EXPECT_EQ(session_->Status().outbox, 2u);  // the Begin and its report, parked
  // A report of the parked version queued now waits with it.
  session_->Report(Staged({"job", 5, 1}), parked.Collect());
  session_->ControlOnce();
  EXPECT_EQ(session_->Status().outbox, 3u);
  clock_.Advance(absl::Milliseconds(200));
  session_->ControlOnce();  // retried, refused again: 400 ms now
  EXPECT_EQ(session_->Status().outbox, 3u);
  clock_.Advance(absl::Milliseconds(399));
  session_->ControlOnce();
  EXPECT_EQ(session_->Status().outbox, 3u);
  clock_.Advance(absl::Milliseconds(1));
  session_->ControlOnce();
  EXPECT_EQ(session_->Status().outbox, 0u);
  EXPECT_THAT(parked.Got(), ElementsAre(absl::StatusCode::kOk, absl::StatusCode::kOk));
  EXPECT_THAT(meta_.Calls(), ElementsAre("begin job/5", "report staged job/6/0", "begin job/5", "begin job/5",
                                         "report staged job/5/0", "report staged job/5/1"));
}

TEST_F(MetaSessionTest, ForgetVersionCancelsItsQueuedStagedReports) {
  Answers gone, kept;
  session_->Report(Staged({"job", 5, 0}), gone.Collect());
  session_->Report(CopyReport({"job", 5, 1}, CopyState::kValid), kept.Collect());
  session_->Report(Staged({"job", 6, 0}), kept.Collect());
  session_->ForgetVersion("job", 5);
  EXPECT_THAT(gone.Got(), ElementsAre(absl::StatusCode::kCancelled));
  EXPECT_EQ(session_->Status().outbox, 2u);
  Connect();
  EXPECT_THAT(kept.Got(), ElementsAre(absl::StatusCode::kOk, absl::StatusCode::kOk));
}

TEST_F(MetaSessionTest, FencedByMetaItRegistersAgainAndResendsWhatWasNotAnswered) {
  Connect();
  // Meta forgot this incarnation: the heartbeat is refused.
  {
    absl::MutexLock lock(&meta_.mu);
    meta_.incarnation = 10;
  }
  clock_.Advance(absl::Seconds(1));
  session_->ControlOnce();
  EXPECT_FALSE(session_->Status().registered);
  EXPECT_EQ(agent_metrics_.registered->Value(), 0.0);
  // A task result refused as stale waits for the new incarnation.
  meta_.result_errors = {absl::FailedPreconditionError("stale incarnation")};
  session_->Result("t-1", 1, absl::OkStatus(), 0, 0);
  meta_.ClearCalls();
  session_->ControlOnce();  // registers (incarnation 11); the result is refused: fenced again
  EXPECT_EQ(session_->incarnation(), 11u);
  EXPECT_EQ(meta_.last_registration.previous_incarnation, 1u);
  EXPECT_FALSE(session_->Status().registered);
  EXPECT_EQ(session_->Status().outbox, 1u);
  session_->ControlOnce();  // registers (12), sends the result, then the inventory
  EXPECT_EQ(session_->incarnation(), 12u);
  EXPECT_EQ(meta_.last_registration.previous_incarnation, 11u);
  EXPECT_EQ(*ReadFileToString(&fs_, "/mem/incarnation"), "12\n");
  EXPECT_THAT(meta_.Calls(), ElementsAre("result t-1", "result t-1", "inventory"));
  EXPECT_EQ(session_->Status().outbox, 0u);
  absl::MutexLock lock(&meta_.mu);
  ASSERT_EQ(meta_.results.size(), 1u);
  EXPECT_EQ(meta_.inventories.size(), 2u);
}

TEST_F(MetaSessionTest, TasksWaitUntilTheInventorysDropsAreDone) {
  {
    absl::MutexLock lock(&meta_.mu);
    meta_.flush_on_stage = true;  // a STAGED report is answered with a flush task
    meta_.inventory_reply.drop = {ShardId{"job", 5, 0}};
  }
  session_->Report(Staged({"job", 5, 0}));
  session_->ControlOnce();  // register, report (task deferred), inventory, then the task
  EXPECT_THAT(delegate_.Log(), ElementsAre("drop job/5/0", "task t-1"));
  // Once applied, tasks come at once.
  session_->Report(Staged({"job", 5, 1}));
  session_->ControlOnce();
  EXPECT_THAT(delegate_.Log(), ElementsAre("drop job/5/0", "task t-1", "task t-2"));
}

TEST_F(MetaSessionTest, HeartbeatsAtTheIntervalCarryTasksAndCancels) {
  Connect();
  {
    absl::MutexLock lock(&meta_.mu);
    AgentTask t;
    t.id = "t-9";
    meta_.pending_tasks = {t};
    meta_.pending_cancels = {"t-3"};
  }
  clock_.Advance(absl::Milliseconds(999));
  session_->ControlOnce();
  EXPECT_TRUE(meta_.Calls().empty());
  clock_.Advance(absl::Milliseconds(1));
  session_->ControlOnce();
  EXPECT_THAT(meta_.Calls(), ElementsAre("heartbeat"));
  EXPECT_THAT(delegate_.Log(), ElementsAre("task t-9", "cancel t-3"));
  {
    absl::MutexLock lock(&meta_.mu);
    EXPECT_EQ(meta_.last_load.memory_capacity_bytes, 1234u);
  }
  EXPECT_EQ(session_->Status().lease_remaining_ms, 5000);
  clock_.Advance(absl::Milliseconds(300));
  EXPECT_EQ(session_->Status().lease_remaining_ms, 4700);
  // HeartbeatSoon: the next round heartbeats at once.
  session_->HeartbeatSoon();
  session_->ControlOnce();
  EXPECT_THAT(meta_.Calls(), ElementsAre("heartbeat", "heartbeat"));
}

TEST_F(MetaSessionTest, AFailedHeartbeatMarksMetaUnreachableAndKeepsTheSession) {
  Connect();
  {
    absl::MutexLock lock(&meta_.mu);
    meta_.up = false;
  }
  clock_.Advance(absl::Seconds(1));
  session_->ControlOnce();
  MetaSession::Snapshot s = session_->Status();
  EXPECT_FALSE(s.meta_reachable);
  EXPECT_TRUE(s.registered);
  EXPECT_EQ(s.lease_remaining_ms, 4000);
  {
    absl::MutexLock lock(&meta_.mu);
    meta_.up = true;
  }
  clock_.Advance(absl::Seconds(1));
  session_->ControlOnce();
  EXPECT_TRUE(session_->Status().meta_reachable);
  EXPECT_EQ(session_->Status().lease_remaining_ms, 5000);
}

TEST_F(MetaSessionTest, MetaRestartedAsksForTheInventoryAgain) {
  Connect();
  meta_.require_inventory = true;
  meta_.node_state = NodeState::kDraining;
  clock_.Advance(absl::Seconds(1));
  session_->ControlOnce();
  EXPECT_EQ(session_->Status().node_state, NodeState::kDraining);
  EXPECT_FALSE(session_->Status().registered);  // until the inventory is in
  session_->ControlOnce();
  EXPECT_THAT(meta_.Calls(), ElementsAre("heartbeat", "inventory"));
  EXPECT_TRUE(session_->Status().registered);
}

TEST_F(MetaSessionTest, ReportsGoInBatchesOfAtMost512) {
  Connect();
  for (uint32_t i = 0; i < 600; ++i) session_->Report(CopyReport({"job", 5, i}, CopyState::kValid));
  session_->ControlOnce();
  EXPECT_EQ(meta_.report_calls, 2);
  EXPECT_EQ(session_->Status().outbox, 0u);
  absl::MutexLock lock(&meta_.mu);
  ASSERT_EQ(meta_.reports.size(), 600u);
  EXPECT_EQ(meta_.reports[599].id.rank, 599u);
}

TEST_F(MetaSessionTest, StopCancelsWhatIsQueuedAndRefusesMore) {
  Answers answers;
  session_->Report(Staged({"job", 5, 0}), answers.Collect());
  session_->Stop();
  EXPECT_THAT(answers.Got(), ElementsAre(absl::StatusCode::kCancelled));
  session_->Report(Staged({"job", 5, 1}), answers.Collect());
  EXPECT_THAT(answers.Got(), ElementsAre(absl::StatusCode::kCancelled, absl::StatusCode::kCancelled));
  session_->ControlOnce();
  absl::MutexLock lock(&meta_.mu);
  EXPECT_EQ(meta_.registrations, 0);
}

TEST_F(MetaSessionTest, AwaitWorkReturnsWhenSomethingIsQueuedOrTheTimeoutPasses) {
  session_->Report(Staged({"job", 5, 0}));
  session_->AwaitWork(absl::Hours(1));  // something is queued: at once
  std::thread waiter([&] { session_->AwaitWork(absl::Seconds(5)); });
  clock_.BlockUntilWaiters(1);
  clock_.Advance(absl::Seconds(5));
  waiter.join();
  std::thread woken([&] { session_->AwaitWork(absl::Hours(1)); });
  clock_.BlockUntilWaiters(1);
  session_->Result("t-1", 1, absl::OkStatus(), 0, 0);
  woken.join();
}

// Issue 40 point 9: a clean shutdown tells meta at once, and every heartbeat
// after it says so too (a regular round must not take it back).
TEST_F(MetaSessionTest, AnnounceStopHeartbeatsAtOnceWithStopping) {
  Connect();
  session_->ControlOnce();
  EXPECT_FALSE(meta_.last_load.stopping);
  meta_.ClearCalls();
  session_->AnnounceStop();
  EXPECT_THAT(meta_.Calls(), ElementsAre("heartbeat"));
  EXPECT_TRUE(meta_.last_load.stopping);
  clock_.Advance(absl::Seconds(2));
  session_->ControlOnce();
  EXPECT_TRUE(meta_.last_load.stopping);
  session_->AnnounceStop();  // once is enough
  EXPECT_EQ(meta_.Calls().size(), 2u);
}

TEST_F(MetaSessionTest, AnnounceStopDoesNotWaitForAnUnreachableMeta) {
  Connect();
  {
    absl::MutexLock lock(&meta_.mu);
    meta_.up = false;
  }
  clock_.Advance(absl::Seconds(2));
  session_->ControlOnce();  // the heartbeat fails: meta unreachable
  meta_.ClearCalls();
  session_->AnnounceStop();
  EXPECT_TRUE(meta_.Calls().empty());
}

TEST_F(MetaSessionTest, AnnounceStopBeforeRegisteringSendsNothing) {
  session_->AnnounceStop();
  EXPECT_TRUE(meta_.Calls().empty());
}

}  // namespace
}  // namespace ckpt::agent
