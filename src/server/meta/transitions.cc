#include "server/meta/transitions.h"

#include <cstdint>
#include <initializer_list>

#include "absl/strings/str_cat.h"

namespace ckpt::meta {
namespace {

// One row of a table: a state and the states that may follow it.
template <typename State>
struct Row {
  State from;
  std::initializer_list<State> to;
};

// The tables (see transitions.h for why each move exists).
const Row<NodeState> kNodeTable[] = {
    {NodeState::kAlive, {NodeState::kSuspect, NodeState::kDead, NodeState::kDraining}},
    {NodeState::kSuspect, {NodeState::kAlive, NodeState::kDead, NodeState::kDraining}},
    {NodeState::kDead, {NodeState::kAlive, NodeState::kDraining}},
    {NodeState::kDraining, {NodeState::kAlive, NodeState::kDead, NodeState::kLeft}},
    {NodeState::kLeft, {NodeState::kAlive, NodeState::kDraining}},
};

const Row<TaskState> kTaskTable[] = {
    {TaskState::kPending,
     {TaskState::kRunning, TaskState::kRetryWait, TaskState::kDone, TaskState::kFailed,
      TaskState::kCancelled}},
    {TaskState::kRunning,
     {TaskState::kPending, TaskState::kRetryWait, TaskState::kDone, TaskState::kFailed,
      TaskState::kCancelled}},
    {TaskState::kRetryWait,
     {TaskState::kPending, TaskState::kDone, TaskState::kFailed, TaskState::kCancelled}},
    {TaskState::kDone, {}},
    {TaskState::kFailed, {}},
    {TaskState::kCancelled, {}},
};

const Row<VersionState> kVersionTable[] = {
    {VersionState::kOpen,
     {VersionState::kStaged, VersionState::kPersisted, VersionState::kAborted,
      VersionState::kDeleted}},
    {VersionState::kStaged,
     {VersionState::kProtected, VersionState::kPersisted, VersionState::kDegraded,
      VersionState::kAborted, VersionState::kDeleted}},
    {VersionState::kProtected,
     {VersionState::kPersisted, VersionState::kDegraded, VersionState::kAborted,
      VersionState::kDeleted}},
    {VersionState::kPersisted, {VersionState::kDeleted}},
    {VersionState::kDegraded,
     {VersionState::kProtected, VersionState::kPersisted, VersionState::kAborted,
      VersionState::kDeleted}},
    {VersionState::kAborted, {VersionState::kDeleted}},
    {VersionState::kDeleted, {}},
};

template <typename State, size_t N>
bool Allowed(const Row<State> (&table)[N], State from, State to) {
  if (from == to) return true;
  for (const Row<State>& row : table) {
    if (row.from != from) continue;
    for (State s : row.to) {
      if (s == to) return true;
    }
    return false;
  }
  return false;
}

template <typename State, size_t N>
absl::Status Check(const Row<State> (&table)[N], const char* kind, const char* (*name)(State),
                   State from, State to) {
  if (Allowed(table, from, to)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("illegal ", kind, " transition ", name(from),
                                                    " -> ", name(to),
                                                    " (not in the table of server/meta/transitions.h)"));
}

template <typename State, size_t N>
void Render(const Row<State> (&table)[N], const char* title, const char* (*name)(State),
            std::string* out) {
  absl::StrAppend(out, "### ", title, "\n| from | to |\n|---|---|\n");
  for (const Row<State>& row : table) {
    if (row.to.size() == 0) {
      absl::StrAppend(out, "| ", name(row.from), " | (final) |\n");
      continue;
    }
    for (State s : row.to) absl::StrAppend(out, "| ", name(row.from), " | ", name(s), " |\n");
  }
}

}  // namespace

absl::Status CheckTransition(NodeState from, NodeState to) {
  return Check(kNodeTable, "node", NodeStateName, from, to);
}

absl::Status CheckTransition(TaskState from, TaskState to) {
  return Check(kTaskTable, "task", TaskStateName, from, to);
}

absl::Status CheckTransition(VersionState from, VersionState to) {
  return Check(kVersionTable, "version", VersionStateName, from, to);
}

std::string TransitionTables() {
  std::string out;
  Render(kNodeTable, "Nodes", NodeStateName, &out);
  out += "\n";
  Render(kTaskTable, "Tasks", TaskStateName, &out);
  out += "\n";
  Render(kVersionTable, "Versions", VersionStateName, &out);
  return out;
}

}  // namespace ckpt::meta
