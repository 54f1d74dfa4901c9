// MetaCore, nodes: registration, heartbeats, task delivery and results,
// drain / undrain / remove, and inventory reconciliation.
#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "server/meta/core_state.h"
#include "server/meta/transitions.h"

namespace ckpt::meta {

absl::StatusOr<RegisterResult> MetaCore::RegisterNode(const RegisterRequest& req) {
  CKPT_RETURN_IF_ERROR(ValidateNodeId(req.node_id));
  if (req.grpc_address.empty() || req.data_address.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node \"", req.node_id, "\": grpc_address and data_address are required (host:port)"));
  }
  return Write([&](Engine& e) -> absl::StatusOr<RegisterResult> {
    RegisterResult result;
    Txn& txn = e.txn();
    const absl::Time mono = e.Mono();
    auto it = state_->nodes.find(req.node_id);
    uint64_t incarnation = 1;
    bool was_dead = false;
    bool restarted = false;  // a new incarnation while the old one's lease ran
    if (it != state_->nodes.end()) {
      Node& old = it->second;
      const bool live = e.IsUsable(req.node_id) && old.lease_deadline > mono;
      // Another address while the lease runs: two agents with one id, unless
      // the new one read the live incarnation from the node's memory tier,
      // which only one agent can hold at a time (Arena's lock): the old
      // process is gone and the node came back at a new address (a new pod
      // IP or DHCP lease on the same tier). That is taken over at once.
      const bool same_tier = req.previous_incarnation != 0 && req.previous_incarnation == old.incarnation;
      if (live && !same_tier &&
          (old.grpc_address != req.grpc_address || old.data_address != req.data_address)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "node id \"", req.node_id, "\" is held by a live node at ", old.grpc_address,
            " (data ", old.data_address, ") whose lease expires in ",
            absl::FormatDuration(old.lease_deadline - mono),
            "; use another node id or stop that agent (an agent restarted on the node's memory tier "
            "takes it over at once)"));
      }
      incarnation = old.incarnation + 1;
      was_dead = !NodeIsUsable(old.state);  // DEAD or LEFT
      // A new incarnation while the old one's lease still ran: the agent
      // crashed (or was killed) and came back before meta noticed; unless
      // it said it was stopping (a clean restart) or was drained.
      if (live && !old.stopping && !old.drained) ++old.failures;
      restarted = live;
    }
    Node& n = state_->nodes[req.node_id];
    if (n.first_seen_ms == 0) n.first_seen_ms = n.registered_ms != 0 ? n.registered_ms : e.NowMs();
    // A drained node stays drained (DRAINING, LEFT again once nothing
    // depends on it) until `ckptctl undrain`; a restarted agent does not
    // bring it back.
    const bool draining = n.drained || (!was_dead && n.state == NodeState::kDraining);
    n.id = req.node_id;
    n.grpc_address = req.grpc_address;
    n.data_address = req.data_address;
    n.role = req.role;
    n.host_node_id = req.host_node_id;
    n.memory_capacity_bytes = req.memory_capacity_bytes;
    n.memory_free_bytes = req.memory_capacity_bytes;
    n.failure_domain = req.failure_domain;
    n.agent_version = req.agent_version;
    n.incarnation = incarnation;
    n.stopping = false;
    if (n.state != NodeState::kAlive) n.state_since_ms = e.NowMs();
    CKPT_RETURN_IF_ERROR(e.SetNodeState(n, draining ? NodeState::kDraining : NodeState::kAlive));
    n.registered_ms = e.NowMs();
    n.last_heartbeat_ms = n.registered_ms;
    n.lease_deadline = mono + options_.lease;
    n.lease_expiry_ms = n.registered_ms + absl::ToInt64Milliseconds(options_.lease);
    n.inventory_received = false;
    txn.Node(n);
    // Tasks of the previous incarnation are delivered again to the new one.
    for (auto& [id, t] : state_->tasks) {
      if (t.node_id == req.node_id && t.state == TaskState::kRunning) {
        e.SetTaskState(t, TaskState::kPending).IgnoreError();  // legal: RUNNING -> PENDING
        t.last_progress = mono;
      }
    }
    // The parities the old process was building died with it: the group's
    // other members push their data segments again (their encodes had
    // finished, so nothing else would: the restarted node waited for them
    // until its encode failed for good; seen in the 30-minute chaos soak).
    if (restarted) e.RestartEncodesBuiltOn(req.node_id);
    ++state_->task_generation;
    // A new node may be what degraded versions were waiting for.
    e.ReplanAll();
    log::Info("node {} registered: incarnation {}, grpc {}, data {}, domain '{}', {} bytes",
              n.id, n.incarnation, n.grpc_address, n.data_address, n.failure_domain,
              n.memory_capacity_bytes);
    ++state_->membership_generation;
    result.incarnation = incarnation;
    result.lease = options_.lease;
    result.heartbeat_interval = options_.heartbeat_interval;
    result.meta_instance_id = instance_id_;
    result.data_plane_key = options_.data_plane_key;
    return result;
  });
}

absl::StatusOr<HeartbeatResult> MetaCore::Heartbeat(const HeartbeatRequest& req) {
  uint64_t seq = 0;
  CKPT_ASSIGN_OR_RETURN(HeartbeatResult result, SubmitHeartbeat(req, &seq));
  CKPT_RETURN_IF_ERROR(store_->AwaitDurable(seq));
  return result;
}

absl::StatusOr<HeartbeatResult> MetaCore::SubmitHeartbeat(const HeartbeatRequest& req,
                                                          uint64_t* durable_seq) {
  *durable_seq = 0;
  uint64_t seq = 0;
  absl::StatusOr<HeartbeatResult> answer = Apply([&](Engine& e) -> absl::StatusOr<HeartbeatResult> {
    HeartbeatResult result;
    // A LEFT node's agent may keep heartbeating: it stays LEFT (drained)
    // instead of registering again every interval.
    CKPT_ASSIGN_OR_RETURN(Node * n, e.CheckNode(req.node_id, req.incarnation, /*allow_left=*/true));
    const absl::Time mono = e.Mono();
    n->lease_deadline = mono + options_.lease;
    n->last_heartbeat_ms = e.NowMs();
    n->lease_expiry_ms = n->last_heartbeat_ms + absl::ToInt64Milliseconds(options_.lease);
    n->memory_capacity_bytes = req.memory_capacity_bytes;
    n->memory_used_bytes = req.memory_used_bytes;
    n->memory_free_bytes = req.memory_free_bytes;
    n->memory_leased_bytes = req.memory_leased_bytes;
    n->flush_lag_bytes = req.flush_lag_bytes;
    n->flush_lag_ms = req.flush_lag_ms;
    n->flush_errors_total = req.flush_errors_total;
    if (n->stopping != req.stopping) {
      // Persisted: the lease may run out after a meta restart too.
      n->stopping = req.stopping;
      e.txn().Node(*n);
      if (n->stopping) {
        log::Info("node {} is stopping (clean shutdown): its lease running out is not a failure", n->id);
      }
    }
    if (n->state == NodeState::kSuspect) {
      CKPT_RETURN_IF_ERROR(e.SetNodeState(*n, NodeState::kAlive));  // transient state: not persisted
    }
    for (const TaskProgress& p : req.running_tasks) {
      auto t = state_->tasks.find(p.task_id);
      if (t == state_->tasks.end() || t->second.node_id != req.node_id) continue;
      if (t->second.state == TaskState::kPending) {
        CKPT_RETURN_IF_ERROR(e.SetTaskState(t->second, TaskState::kRunning));
      }
      t->second.last_progress = mono;
      t->second.bytes_done = p.bytes_done;
      t->second.bytes_total = p.bytes_total;
    }
    result.node_state = n->state;
    result.inventory_required = !n->inventory_received;
    result.membership_generation = state_->membership_generation;
    if (req.membership_generation != state_->membership_generation) {
      std::vector<Member>& members = result.members.emplace();
      for (const auto& [id, node] : state_->nodes) {
        if (!e.IsUsable(id)) continue;  // DEAD or LEFT
        members.push_back(Member{id, node.incarnation});
      }
    }
    for (auto& [id, t] : state_->tasks) {
      if (t.node_id != req.node_id) continue;
      if (t.state == TaskState::kPending) result.tasks.push_back(e.Bundle(t));
      if (t.state == TaskState::kCancelled && !t.cancel_notified) {
        t.cancel_notified = true;
        result.cancelled_task_ids.push_back(id);
      }
    }
    result.lease = options_.lease;
    result.heartbeat_interval = options_.heartbeat_interval;
    result.meta_instance_id = instance_id_;
    return result;
  }, &seq);
  if (answer.ok()) *durable_seq = seq;  // an error is answered at once
  return answer;
}

absl::StatusOr<std::vector<TaskBundle>> MetaCore::PendingTasks(const std::string& node_id,
                                                              uint64_t incarnation, bool all,
                                                              std::vector<VersionNotice>* notices) {
  return Write([&](Engine& e) -> absl::StatusOr<std::vector<TaskBundle>> {
    CKPT_RETURN_IF_ERROR(e.CheckNode(node_id, incarnation).status());
    if (notices != nullptr) {
      if (auto q = state_->version_notices.find(node_id); q != state_->version_notices.end()) {
        notices->assign(std::make_move_iterator(q->second.begin()), std::make_move_iterator(q->second.end()));
        state_->version_notices.erase(q);
      }
    }
    std::vector<TaskBundle> out;
    for (auto& [id, t] : state_->tasks) {
      if (t.node_id != node_id) continue;
      if (t.state == TaskState::kPending || (all && t.state == TaskState::kRunning)) {
        out.push_back(e.Bundle(t));
      }
    }
    return out;
  });
}

uint64_t MetaCore::WaitForTaskChange(uint64_t seen_generation, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return state_->task_generation != seen_generation;
  };
  clock_->AwaitWithTimeout(&mu_, absl::Condition(&changed), timeout);
  return state_->task_generation;
}

absl::StatusOr<TaskDisposition> MetaCore::ReportTaskResult(const std::string& node_id,
                                                           uint64_t incarnation,
                                                           const std::string& task_id,
                                                           uint32_t attempt,
                                                           const absl::Status& outcome) {
  return Write([&](Engine& e) -> absl::StatusOr<TaskDisposition> {
    TaskDisposition disposition = TaskDisposition::kCompleted;
    Txn& txn = e.txn();
    CKPT_RETURN_IF_ERROR(e.CheckNode(node_id, incarnation).status());
    auto it = state_->tasks.find(task_id);
    if (it == state_->tasks.end()) {
      return absl::NotFoundError(absl::StrCat("task \"", task_id, "\" does not exist"));
    }
    Task& t = it->second;
    if (t.node_id != node_id) {
      return absl::FailedPreconditionError(absl::StrCat(
          "task \"", task_id, "\" is assigned to node \"", t.node_id, "\", not \"", node_id, "\""));
    }
    if (t.state == TaskState::kDone || t.state == TaskState::kFailed) {
      return TaskDisposition::kDuplicate;
    }
    if (t.state == TaskState::kCancelled) return TaskDisposition::kCancelled;
    if (attempt < t.attempt && !outcome.ok()) return TaskDisposition::kDuplicate;
    if (outcome.ok()) {
      CKPT_RETURN_IF_ERROR(e.SetTaskState(t, TaskState::kDone));
      txn.Task(t);
      auto v = e.FindVersion(t.job_id, t.step);
      if (v.ok()) {
        Version& ver = **v;
        switch (t.kind) {
          case TaskKind::kCommitDurable:
            if (!IsTerminal(ver.state)) {
              for (auto& [rank, sh] : ver.shards) {
                if (!sh.durable_written) {
                  sh.durable_written = true;  // committed marker covers every rank file
                  txn.ShardRecord(ver, rank);
                }
              }
              CKPT_RETURN_IF_ERROR(e.SetState(ver, VersionState::kPersisted));
              e.ApplyRetention(*e.FindJob(t.job_id).value());
            }
            break;
          case TaskKind::kEvict:
            for (auto& [rank, sh] : ver.shards) {
              for (Copy& c : sh.copies) {
                if (c.node_id == node_id && c.state != CopyState::kEvicted) {
                  c.state = CopyState::kEvicted;
                  c.updated_ms = e.NowMs();
                  txn.ShardRecord(ver, rank);
                }
              }
            }
            for (Segment& seg : ver.segments) {
              if (seg.holder_node_id == node_id && seg.state != CopyState::kEvicted) {
                seg.state = CopyState::kEvicted;
                txn.Segments(ver);
              }
            }
            break;
          case TaskKind::kDeleteDurable:
            for (auto& [rank, sh] : ver.shards) {
              if (sh.durable_written) {
                sh.durable_written = false;
                txn.ShardRecord(ver, rank);
              }
            }
            break;
          default:
            e.Recompute(ver);
            break;
        }
      }
      disposition = TaskDisposition::kCompleted;
    } else {
      t.last_error = outcome.ToString();
      if (t.attempt >= static_cast<uint32_t>(Task::kMaxAttempts)) {
        CKPT_RETURN_IF_ERROR(e.SetTaskState(t, TaskState::kFailed));
        ++state_->counters.tasks_failed_total;
        disposition = TaskDisposition::kFailed;
        log::Warn("task {} ({}) on node {} failed for good after {} attempts: {}", t.id,
                  TaskKindName(t.kind), node_id, t.attempt, t.last_error);
        e.ProtectionTaskFailed(t);
      } else {
        CKPT_RETURN_IF_ERROR(e.SetTaskState(t, TaskState::kRetryWait));
        t.retry_at_ms = e.NowMs() + absl::ToInt64Milliseconds(options_.task_retry_backoff) *
                                        (int64_t{1} << std::min<uint32_t>(t.attempt - 1, 10));
        disposition = TaskDisposition::kRetry;
      }
      txn.Task(t);
    }
    return disposition;
  });
}

absl::StatusOr<Node> MetaCore::ChangeNode(const std::string& node_id,
                                          absl::FunctionRef<absl::Status(Engine&, Txn&, Node&)> change) {
  return Write([&](Engine& e) -> absl::StatusOr<Node> {
    auto it = state_->nodes.find(node_id);
    if (it == state_->nodes.end()) {
      return absl::NotFoundError(absl::StrCat("node \"", node_id, "\" is not registered"));
    }
    CKPT_RETURN_IF_ERROR(change(e, e.txn(), it->second));
    ++state_->membership_generation;
    Node result = it->second;
    return result;
  });
}

absl::StatusOr<Node> MetaCore::DrainNode(const std::string& node_id) {
  return ChangeNode(node_id, [](Engine& e, Txn& txn, Node& n) {
    if (n.state == NodeState::kDead || n.state == NodeState::kLeft) {
      // Nothing to move now; the mark makes it DRAINING if its agent returns.
      if (!n.drained) {
        n.drained = true;
        txn.Node(n);
      }
    } else if (n.state != NodeState::kDraining || !n.drained) {
      if (n.state != NodeState::kDraining) n.state_since_ms = e.NowMs();
      CKPT_RETURN_IF_ERROR(e.SetNodeState(n, NodeState::kDraining));
      n.drained = true;
      txn.Node(n);
      e.ReplanAll();
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<Node> MetaCore::UndrainNode(const std::string& node_id) {
  return ChangeNode(node_id, [](Engine& e, Txn& txn, Node& n) {
    if (!n.drained && n.state != NodeState::kDraining && n.state != NodeState::kLeft) {
      return absl::FailedPreconditionError(absl::StrCat("node \"", n.id, "\" is ", NodeStateName(n.state),
                                                        ", not drained; nothing to undrain"));
    }
    n.drained = false;
    // DRAINING, or LEFT with its agent still heartbeating: ALIVE at once.
    // LEFT with no agent (or DEAD): ALIVE when its agent registers again.
    const bool running = n.state == NodeState::kDraining ||
                         (n.state == NodeState::kLeft && n.lease_deadline > e.Mono());
    if (running) {
      CKPT_RETURN_IF_ERROR(e.SetNodeState(n, NodeState::kAlive));
      n.state_since_ms = e.NowMs();
    }
    txn.Node(n);
    if (running) e.ReplanAll();
    log::Info("node {} undrained: now {}", n.id, NodeStateName(n.state));
    return absl::OkStatus();
  });
}

absl::Status MetaCore::RemoveNode(const std::string& node_id) {
  return Write([&](Engine& e) -> absl::Status {
    auto it = state_->nodes.find(node_id);
    if (it == state_->nodes.end()) {
      return absl::NotFoundError(absl::StrCat("node \"", node_id, "\" is not registered"));
    }
    if (NodeIsUsable(it->second.state)) {
      return absl::FailedPreconditionError(
          absl::StrCat("node \"", node_id, "\" is ", NodeStateName(it->second.state),
                       "; only DEAD or LEFT nodes can be removed (drain it first)"));
    }
    // Forgotten while its agent runs, the node would register again as a new,
    // ALIVE node at the agent's next heartbeat.
    const absl::Time mono = clock_->MonotonicNow();
    if (it->second.state == NodeState::kLeft && it->second.lease_deadline > mono) {
      return absl::FailedPreconditionError(absl::StrCat(
          "node \"", node_id, "\" is LEFT but its agent is still running (heartbeat ",
          absl::FormatDuration(absl::Milliseconds(clock_->NowUnixMillis() - it->second.last_heartbeat_ms)),
          " ago); stop the agent, then remove the node after its lease (", absl::FormatDuration(options_.lease),
          ")"));
    }
    Txn& txn = e.txn();
    txn.DeleteNode(node_id);
    state_->nodes.erase(it);
    state_->unknown.erase(node_id);
    state_->version_notices.erase(node_id);
    ++state_->membership_generation;
    return absl::OkStatus();
  });
}

absl::StatusOr<std::vector<Node>> MetaCore::ListNodes(const std::vector<NodeState>& states) const {
  return Read([&](Engine& e) -> absl::StatusOr<std::vector<Node>> {
    std::vector<Node> out;
    std::map<std::string, uint32_t> pending;
    for (const auto& [id, t] : state_->tasks) {
      if (Engine::Active(t)) ++pending[t.node_id];
    }
    for (const auto& [id, n] : state_->nodes) {
      if (states.empty() || std::find(states.begin(), states.end(), n.state) != states.end()) {
        out.push_back(n);
        out.back().pending_tasks = pending[id];
      }
    }
    return out;
  });
}

absl::StatusOr<InventoryResult> MetaCore::ReportInventory(const std::string& node_id,
                                                          uint64_t incarnation,
                                                          const std::vector<Holding>& holdings) {
  return Write([&](Engine& e) -> absl::StatusOr<InventoryResult> {
    InventoryResult result;
    Txn& txn = e.txn();
    CKPT_ASSIGN_OR_RETURN(Node * node, e.CheckNode(node_id, incarnation));
    const int64_t now = e.NowMs();
    std::set<std::pair<std::pair<std::string, uint64_t>, uint32_t>> seen_shards;
    std::set<std::pair<std::pair<std::string, uint64_t>, SegmentKey>> seen_segments;
    std::set<Version*> touched;
    auto& unknown = state_->unknown[node_id];
    unknown.clear();
    auto decide = [&](const Holding& h, InventoryDecision::Action a, std::string why) {
      result.decisions.push_back(InventoryDecision{h, a, std::move(why)});
    };
    for (const Holding& h : holdings) {
      if (!ValidateJobId(h.job_id).ok() || !state_->jobs.count(h.job_id)) {
        decide(h, InventoryDecision::Action::kUnknown, absl::StrCat("job \"", h.job_id, "\" is unknown"));
        unknown.push_back({h, now});
        continue;
      }
      auto vit = state_->versions[h.job_id].find(h.step);
      if (vit == state_->versions[h.job_id].end()) {
        decide(h, InventoryDecision::Action::kUnknown,
               absl::StrCat("version ", h.job_id, "/", h.step, " is unknown"));
        unknown.push_back({h, now});
        continue;
      }
      Version& v = vit->second;
      if (IsTerminal(v.state) || v.evicted) {
        decide(h, InventoryDecision::Action::kDrop,
               absl::StrCat("version ", h.step, " is ", VersionStateName(v.state),
                            v.evicted ? " (evicted)" : ""));
        continue;
      }
      if (!h.is_segment) {
        seen_shards.insert({{h.job_id, h.step}, h.rank});
        auto sit = v.shards.find(h.rank);
        if (sit == v.shards.end()) {
          decide(h, InventoryDecision::Action::kUnknown,
                 absl::StrCat("rank ", h.rank, " was never reported staged; re-report it"));
          unknown.push_back({h, now});
          continue;
        }
        Shard& sh = sit->second;
        const bool matches = h.size_bytes == sh.size_bytes && h.crc32c == sh.crc32c &&
                             (h.manifest_digest == 0 || h.manifest_digest == sh.manifest_digest);
        Copy* copy = nullptr;
        for (Copy& c : sh.copies)
          if (c.node_id == node_id) copy = &c;
        if (!matches || h.state == CopyState::kCorrupt) {
          if (copy != nullptr && copy->state != CopyState::kCorrupt) {
            copy->state = CopyState::kCorrupt;
            copy->updated_ms = now;
            copy->detail = matches ? "agent found a checksum mismatch" : "differs from the staged shard";
            txn.ShardRecord(v, h.rank);
            touched.insert(&v);
          }
          decide(h, InventoryDecision::Action::kDrop,
                 matches ? "corrupt" : "size, crc or digest differs from the staged shard");
          continue;
        }
        if (copy != nullptr && copy->state == CopyState::kValid) {
          ++result.kept;
          continue;
        }
        // Known-lost or unrecorded copy with the right contents: adopt it if
        // the shard can use it, else drop.
        int protective = 0;
        for (const Copy& c : sh.copies)
          if (c.state == CopyState::kValid && e.CountsForProtection(c.node_id)) ++protective;
        const bool wanted = copy != nullptr ? copy->role == CopyRole::kPrimary ||
                                                  protective < std::max(1, v.plan.policy.copies)
                                            : protective < std::max(1, v.plan.policy.copies);
        if (!wanted) {
          decide(h, InventoryDecision::Action::kDrop, "shard is fully protected elsewhere");
          continue;
        }
        if (copy == nullptr) {
          sh.copies.push_back(Copy{node_id, h.role == CopyRole::kPrimary ? CopyRole::kReplica : h.role,
                                   CopyState::kValid, now, "adopted from inventory"});
        } else {
          copy->state = CopyState::kValid;
          copy->updated_ms = now;
          copy->detail = "re-adopted from inventory";
        }
        txn.ShardRecord(v, h.rank);
        touched.insert(&v);
        decide(h, InventoryDecision::Action::kAdopted, "matches the staged shard");
      } else {
        seen_segments.insert({{h.job_id, h.step}, h.segment});
        Segment* seg = nullptr;
        for (Segment& s : v.segments)
          if (s.key == h.segment) seg = &s;
        if (seg == nullptr) {
          decide(h, InventoryDecision::Action::kDrop, "no such segment in the version's layout");
          continue;
        }
        if (seg->holder_node_id != node_id && seg->state == CopyState::kValid) {
          decide(h, InventoryDecision::Action::kDrop, "segment was rebuilt on another node");
          continue;
        }
        if (h.state == CopyState::kCorrupt ||
            ((seg->crc_known || seg->crc32c != 0) && h.crc32c != seg->crc32c) ||
            h.size_bytes != seg->length_bytes) {
          if (seg->holder_node_id == node_id && seg->state != CopyState::kCorrupt) {
            seg->state = CopyState::kCorrupt;
            seg->updated_ms = now;
            txn.Segments(v);
            touched.insert(&v);
          }
          decide(h, InventoryDecision::Action::kDrop, "segment is corrupt or does not match");
          continue;
        }
        if (h.state == CopyState::kPending) {
          ++result.kept;
          continue;
        }
        if (seg->holder_node_id == node_id && seg->state == CopyState::kValid) {
          ++result.kept;
          continue;
        }
        seg->holder_node_id = node_id;
        seg->state = CopyState::kValid;
        seg->crc32c = h.crc32c;
        seg->crc_known = true;
        seg->updated_ms = now;
        txn.Segments(v);
        touched.insert(&v);
        decide(h, InventoryDecision::Action::kAdopted, "matches the version's layout");
      }
    }
    // Holdings meta expected here that the agent lacks.
    for (auto& [job_id, by_step] : state_->versions) {
      for (auto& [step, v] : by_step) {
        if (IsTerminal(v.state) || v.evicted) continue;
        for (auto& [rank, sh] : v.shards) {
          for (Copy& c : sh.copies) {
            if (c.node_id != node_id) continue;
            if (seen_shards.count({{job_id, step}, rank})) continue;
            if (c.state == CopyState::kLost) touched.insert(&v);  // did not come back
            if (c.state != CopyState::kValid) continue;
            c.state = CopyState::kLost;
            c.updated_ms = now;
            c.detail = "missing from the node's inventory";
            txn.ShardRecord(v, rank);
            touched.insert(&v);
            Holding h;
            h.job_id = job_id;
            h.step = step;
            h.rank = rank;
            h.role = c.role;
            h.size_bytes = sh.size_bytes;
            h.crc32c = sh.crc32c;
            result.missing.push_back(h);
          }
        }
        for (Segment& seg : v.segments) {
          if (seg.holder_node_id != node_id || seg.length_bytes == 0) continue;
          if (seen_segments.count({{job_id, step}, seg.key})) continue;
          if (seg.state == CopyState::kLost) touched.insert(&v);  // did not come back
          if (seg.state != CopyState::kValid) continue;
          seg.state = CopyState::kLost;
          seg.updated_ms = now;
          seg.detail = "missing from the node's inventory";
          txn.Segments(v);
          touched.insert(&v);
          Holding h;
          h.is_segment = true;
          h.job_id = job_id;
          h.step = step;
          h.segment = seg.key;
          h.kind = seg.kind;
          h.size_bytes = seg.length_bytes;
          h.crc32c = seg.crc32c;
          result.missing.push_back(h);
        }
      }
    }
    // Received first: a copy lost with this node that its inventory lacks is
    // no longer awaited (AwaitLostCopies).
    node->inventory_received = true;
    for (Version* v : e.ResumeStalledEncodes(node_id)) touched.insert(v);
    for (Version* v : touched) e.Recompute(*v);
    // A restarted agent knows of no restorable version: what it holds of
    // them is told again (after the transitions above, which told it too).
    e.NoticeHeldVersions(node_id, holdings);
    // The drop decisions travel in the answer, which the agent applies before
    // it runs tasks (an agent that dies first asks again on restart). Never as
    // a drop task too: one delivered after a rebuild put a new copy of the
    // same segment here would drop the new copy.
    log::Info("inventory of node {}: {} entries, {} kept, {} decisions, {} missing", node_id,
              holdings.size(), result.kept, result.decisions.size(), result.missing.size());
    return result;
  });
}

}  // namespace ckpt::meta
