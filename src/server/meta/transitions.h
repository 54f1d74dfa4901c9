// The state machines of meta: which state may follow which, for nodes, tasks
// and versions, and the one function through which each state changes.
//
// Every change of a Node::state, Task::state or Version::state goes through
// Transition() (MetaCore's Engine wraps it: Engine::SetNodeState,
// SetTaskState, SetState), which checks the table below and refuses a move
// the table does not list. A refusal is a bug in meta, never a caller's
// mistake: the state is left as it was and the error (FailedPrecondition)
// names both states. Setting a state to itself is always allowed and changes
// nothing.
//
// The tables were derived from what MetaCore did before they existed (every
// assignment it made is listed), so they describe the service as it is. A new
// transition is added here first, with the reason.
//
//   Nodes (NodeState)
//   | from     | to                     | by
//   |----------|------------------------|------------------------------------------------
//   | ALIVE    | SUSPECT                | Tick: two heartbeat intervals missed (not persisted)
//   | ALIVE    | DEAD                   | Tick: lease expired
//   | ALIVE    | DRAINING               | DrainNode; RegisterNode of a drained node
//   | SUSPECT  | ALIVE                  | Heartbeat, RegisterNode
//   | SUSPECT  | DEAD                   | Tick: lease expired
//   | SUSPECT  | DRAINING               | DrainNode; RegisterNode of a drained node
//   | DEAD     | ALIVE                  | RegisterNode (new incarnation)
//   | DEAD     | DRAINING               | RegisterNode of a drained node
//   | DRAINING | ALIVE                  | UndrainNode
//   | DRAINING | DEAD                   | Tick: lease expired
//   | DRAINING | LEFT                   | Tick: nothing depends on the node any more
//   | LEFT     | ALIVE                  | UndrainNode (agent still running), RegisterNode
//   | LEFT     | DRAINING               | RegisterNode of a drained node
//   (RemoveNode forgets a DEAD or LEFT node; a node first registers as ALIVE.)
//
//   Tasks (TaskState)
//   | from       | to         | by
//   |------------|------------|----------------------------------------------------------
//   | pending    | running    | Heartbeat lists it among the agent's running tasks
//   | pending    | done       | ReportTaskResult OK
//   | pending    | failed     | ReportTaskResult error at the last attempt; Tick time-out at it
//   | pending    | retry-wait | ReportTaskResult error before the last attempt
//   | pending    | cancelled  | CancelTask (version ended, node lost, ...)
//   | running    | pending    | RegisterNode (re-delivered to the new incarnation); Open; Tick time-out
//   | running    | done       | ReportTaskResult OK
//   | running    | failed     | as from pending
//   | running    | retry-wait | as from pending
//   | running    | cancelled  | CancelTask
//   | retry-wait | pending    | Tick: retry_at_ms reached (next attempt)
//   | retry-wait | done       | ReportTaskResult OK (a late success)
//   | retry-wait | failed     | ReportTaskResult error at the last attempt
//   | retry-wait | cancelled  | CancelTask
//   done, failed and cancelled are final. (A task is created pending.)
//
//   Versions (VersionState)
//   | from      | to        | by
//   |-----------|-----------|-----------------------------------------------------------
//   | OPEN      | STAGED    | ReportShards: the last rank staged
//   | OPEN      | PERSISTED | ReportTaskResult of a commit (guarded by "not ABORTED or DELETED" only)
//   | OPEN      | ABORTED   | superseded (BeginVersion of another run, a newer step staged), no progress, a rank lost
//   | OPEN      | DELETED   | DeleteJob, DeleteVersion
//   | STAGED    | PROTECTED | Recompute: every shard protected as the policy says
//   | STAGED    | DEGRADED  | Recompute: a copy lost before protection completed
//   | STAGED    | PERSISTED | ReportTaskResult of the commit
//   | STAGED    | ABORTED   | Recompute: a rank has no readable copy left
//   | STAGED    | DELETED   | retention (superseded), DeleteJob, DeleteVersion
//   | PROTECTED | DEGRADED  | Recompute: redundancy lost
//   | PROTECTED | PERSISTED | ReportTaskResult of the commit
//   | PROTECTED | ABORTED   | Recompute: data lost
//   | PROTECTED | DELETED   | retention (keep_in_memory), DeleteJob, DeleteVersion
//   | DEGRADED  | PROTECTED | Recompute: re-protected
//   | DEGRADED  | PERSISTED | ReportTaskResult of the commit
//   | DEGRADED  | ABORTED   | Recompute: data lost
//   | DEGRADED  | DELETED   | retention (superseded), DeleteJob, DeleteVersion
//   | PERSISTED | DELETED   | retention (keep_durable), DeleteJob, DeleteVersion
//   | ABORTED   | DELETED   | DeleteVersion
//   DELETED is final. (A version is begun OPEN; BeginVersion replaces an ABORTED
//   or DELETED version of the same step by a new OPEN one: a new version, not a
//   transition.)
//
// TransitionTables() renders the same tables from the data (transitions_test
// prints them and checks every row above).
//
// Thread safety: pure functions of their arguments.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "server/meta/model.h"

namespace ckpt::meta {

// OK when the table lets `to` follow `from`, or `to` == `from`; otherwise
// FailedPrecondition "illegal <kind> transition <FROM> -> <TO>".
absl::Status CheckTransition(NodeState from, NodeState to);
absl::Status CheckTransition(TaskState from, TaskState to);
absl::Status CheckTransition(VersionState from, VersionState to);

// The one function that changes a state: sets *state to `to` when
// CheckTransition allows it, else leaves *state unchanged and returns the
// error.
template <typename State>
absl::Status Transition(State* state, State to) {
  absl::Status st = CheckTransition(*state, to);
  if (st.ok()) *state = to;
  return st;
}

// The three tables as Markdown ("| from | to |" rows, one per legal move,
// in enum order), under a heading per kind.
std::string TransitionTables();

}  // namespace ckpt::meta
