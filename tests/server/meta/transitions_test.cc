// The transition tables of server/meta/transitions.h: exactly the moves the
// header lists are legal, every other move is refused with an error naming
// both states, and a refused Transition() leaves the state as it was.
#include "server/meta/transitions.h"

#include <cstdio>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "server/meta/model.h"

namespace ckpt::meta {
namespace {

template <typename State>
std::vector<State> All(int first, int last) {
  std::vector<State> out;
  for (int i = first; i <= last; ++i) out.push_back(static_cast<State>(i));
  return out;
}

// Checks that exactly `legal` (and every state to itself) passes.
template <typename State>
void ExpectExactly(const std::vector<State>& states, const std::set<std::pair<State, State>>& legal,
                   const char* (*name)(State)) {
  for (State from : states) {
    for (State to : states) {
      const absl::Status st = CheckTransition(from, to);
      const bool want = from == to || legal.count({from, to}) != 0;
      EXPECT_EQ(st.ok(), want) << name(from) << " -> " << name(to) << ": " << st;
      if (!want) {
        EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
        EXPECT_NE(st.message().find(std::string(name(from)) + " -> " + name(to)), absl::string_view::npos)
            << st;
      }
    }
  }
}

TEST(Transitions, NodeTableIsExactlyTheListedMoves) {
  using S = NodeState;
  ExpectExactly<S>(All<S>(1, 5),
                   {
                       {S::kAlive, S::kSuspect},    {S::kAlive, S::kDead},      {S::kAlive, S::kDraining},
                       {S::kSuspect, S::kAlive},    {S::kSuspect, S::kDead},    {S::kSuspect, S::kDraining},
                       {S::kDead, S::kAlive},       {S::kDead, S::kDraining},   {S::kDraining, S::kAlive},
                       {S::kDraining, S::kDead},    {S::kDraining, S::kLeft},   {S::kLeft, S::kAlive},
                       {S::kLeft, S::kDraining},
                   },
                   NodeStateName);
}

TEST(Transitions, TaskTableIsExactlyTheListedMoves) {
  using S = TaskState;
  ExpectExactly<S>(All<S>(1, 6),
                   {
                       {S::kPending, S::kRunning},    {S::kPending, S::kRetryWait},  {S::kPending, S::kDone},
                       {S::kPending, S::kFailed},     {S::kPending, S::kCancelled},  {S::kRunning, S::kPending},
                       {S::kRunning, S::kRetryWait},  {S::kRunning, S::kDone},       {S::kRunning, S::kFailed},
                       {S::kRunning, S::kCancelled},  {S::kRetryWait, S::kPending},  {S::kRetryWait, S::kDone},
                       {S::kRetryWait, S::kFailed},   {S::kRetryWait, S::kCancelled},
                   },
                   TaskStateName);
}

TEST(Transitions, VersionTableIsExactlyTheListedMoves) {
  using S = VersionState;
  ExpectExactly<S>(All<S>(1, 7),
                   {
                       {S::kOpen, S::kStaged},          {S::kOpen, S::kPersisted},       {S::kOpen, S::kAborted},
                       {S::kOpen, S::kDeleted},         {S::kStaged, S::kProtected},     {S::kStaged, S::kDegraded},
                       {S::kStaged, S::kPersisted},     {S::kStaged, S::kAborted},       {S::kStaged, S::kDeleted},
                       {S::kProtected, S::kDegraded},   {S::kProtected, S::kPersisted},  {S::kProtected, S::kAborted},
                       {S::kProtected, S::kDeleted},    {S::kDegraded, S::kProtected},   {S::kDegraded, S::kPersisted},
                       {S::kDegraded, S::kAborted},     {S::kDegraded, S::kDeleted},     {S::kPersisted, S::kDeleted},
                       {S::kAborted, S::kDeleted},
                   },
                   VersionStateName);
}

TEST(Transitions, IllegalNodeTransitionIsRefusedNamingBothStates) {
  NodeState s = NodeState::kLeft;
  const absl::Status st = Transition(&s, NodeState::kDead);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(), "illegal node transition LEFT -> DEAD (not in the table of server/meta/transitions.h)");
  EXPECT_EQ(s, NodeState::kLeft);  // unchanged
  EXPECT_TRUE(Transition(&s, NodeState::kAlive).ok());
  EXPECT_EQ(s, NodeState::kAlive);
}

TEST(Transitions, IllegalTaskTransitionIsRefusedNamingBothStates) {
  TaskState s = TaskState::kDone;
  const absl::Status st = Transition(&s, TaskState::kPending);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(), "illegal task transition done -> pending (not in the table of server/meta/transitions.h)");
  EXPECT_EQ(s, TaskState::kDone);
  s = TaskState::kCancelled;
  EXPECT_FALSE(Transition(&s, TaskState::kRunning).ok());
  EXPECT_EQ(s, TaskState::kCancelled);
}

TEST(Transitions, IllegalVersionTransitionIsRefusedNamingBothStates) {
  VersionState s = VersionState::kDeleted;
  const absl::Status st = Transition(&s, VersionState::kOpen);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(), "illegal version transition DELETED -> OPEN (not in the table of server/meta/transitions.h)");
  EXPECT_EQ(s, VersionState::kDeleted);
  s = VersionState::kPersisted;
  EXPECT_FALSE(Transition(&s, VersionState::kStaged).ok());  // no way back below PERSISTED
  EXPECT_EQ(s, VersionState::kPersisted);
  s = VersionState::kAborted;
  EXPECT_FALSE(Transition(&s, VersionState::kProtected).ok());
  EXPECT_EQ(s, VersionState::kAborted);
}

TEST(Transitions, SameStateIsANoOp) {
  TaskState s = TaskState::kFailed;  // final, yet setting it again is allowed
  EXPECT_TRUE(Transition(&s, TaskState::kFailed).ok());
  EXPECT_EQ(s, TaskState::kFailed);
}

// Prints the tables (for the closing note of issue 35) and spot-checks them.
TEST(Transitions, TablesRenderAsMarkdown) {
  const std::string text = TransitionTables();
  std::printf("%s", text.c_str());
  EXPECT_NE(text.find("### Nodes"), std::string::npos);
  EXPECT_NE(text.find("| DRAINING | LEFT |"), std::string::npos);
  EXPECT_NE(text.find("### Tasks"), std::string::npos);
  EXPECT_NE(text.find("| done | (final) |"), std::string::npos);
  EXPECT_NE(text.find("### Versions"), std::string::npos);
  EXPECT_NE(text.find("| ABORTED | DELETED |"), std::string::npos);
}

}  // namespace
}  // namespace ckpt::meta
