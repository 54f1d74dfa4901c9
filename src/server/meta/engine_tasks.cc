// Engine, tasks: creating, finding and cancelling the tasks meta hands to
// agents, and the bundle each is delivered in.
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/meta/core_state.h"
#include "server/meta/transitions.h"

namespace ckpt::meta {

absl::Status Engine::SetTaskState(Task& t, TaskState to) {
  absl::Status st = Transition(&t.state, to);
  if (!st.ok()) log::Error("task {} ({} {}/{}): {}", t.id, TaskKindName(t.kind), t.job_id, t.step, std::string(st.message()));
  return st;
}

Task& Engine::NewTask(const std::string& node_id, TaskKind kind, const std::string& job_id,
                      uint64_t step, int32_t priority) {
  Task t;
  t.id = absl::StrFormat("t-%012u", s_.next_task_id++);
  t.node_id = node_id;
  t.kind = kind;
  t.job_id = job_id;
  t.step = step;
  t.priority = priority;
  t.created_ms = NowMs();
  t.timeout_ms = absl::ToInt64Milliseconds(options_.task_timeout);
  t.last_progress = Mono();
  txn_.Raw(std::string(records::kNextTaskIdKey), std::to_string(s_.next_task_id));
  s_.tasks_by_version[{job_id, step}].insert(t.id);
  s_.created_tasks.push_back(t.id);
  ++s_.task_generation;
  ++s_.counters.tasks_created_total;
  Task& stored = s_.tasks[t.id] = std::move(t);
  return stored;  // caller fills the payload, then txn_.Task(stored)
}

std::vector<Task*> Engine::ActiveTasks(const std::string& job_id, uint64_t step, TaskKind kind) {
  std::vector<Task*> out;
  auto it = s_.tasks_by_version.find({job_id, step});
  if (it == s_.tasks_by_version.end()) return out;
  for (const std::string& id : it->second) {
    auto t = s_.tasks.find(id);
    if (t != s_.tasks.end() && t->second.kind == kind && Active(t->second)) {
      out.push_back(&t->second);
    }
  }
  return out;
}

void Engine::CancelTask(Task& t) {
  if (!Active(t)) return;
  SetTaskState(t, TaskState::kCancelled).IgnoreError();  // legal from every active state
  txn_.Task(t);
  ++s_.task_generation;
}

void Engine::CancelVersionTasks(const Version& v) {
  auto it = s_.tasks_by_version.find({v.job_id, v.step});
  if (it == s_.tasks_by_version.end()) return;
  for (const std::string& id : it->second) {
    auto t = s_.tasks.find(id);
    if (t == s_.tasks.end()) continue;
    // Clean-up work for the version keeps running.
    if (t->second.kind == TaskKind::kEvict || t->second.kind == TaskKind::kDeleteDurable ||
        t->second.kind == TaskKind::kDrop) {
      continue;
    }
    CancelTask(t->second);
  }
}

bool Engine::DeleteDurable(const Version& v) {
  const std::string node = AnyUsableNode();
  if (node.empty()) return false;
  Task& t = NewTask(node, TaskKind::kDeleteDurable, v.job_id, v.step, 0);
  txn_.Task(t);
  return true;
}

TaskBundle Engine::Bundle(const Task& t) {
  TaskBundle b;
  b.task = t;
  auto add = [&](const std::string& id) {
    if (!id.empty()) b.endpoints[id] = EndpointOf(id);
  };
  add(t.node_id);
  for (const auto& id : t.targets) add(id);
  auto jv = s_.versions.find(t.job_id);
  if (jv != s_.versions.end()) {
    auto vit = jv->second.find(t.step);
    if (vit != jv->second.end()) {
      Version& v = vit->second;
      // The bundle carries the version without items. Copying it whole and
      // then dropping the items cost an allocation per item of every rank
      // for each task handed out, so the item vectors are moved aside (O(1))
      // while the rest is copied, and moved back. Nothing here can fail
      // except allocation, which ends the process.
      Version copy;
      {
        std::map<uint32_t, Shard> shards = std::exchange(v.shards, {});
        copy = v;
        v.shards = std::move(shards);
      }
      for (auto& [rank, shard] : v.shards) {
        std::vector<Item> items = std::exchange(shard.items, {});
        copy.shards.emplace_hint(copy.shards.end(), rank, shard);
        shard.items = std::move(items);
      }
      for (const EcGroup& g : v.plan.groups)
        for (const auto& m : g.members) add(m);
      for (const Segment& seg : v.segments) add(seg.holder_node_id);
      for (const auto& [rank, shard] : v.shards)
        for (const Copy& c : shard.copies) add(c.node_id);
      if (t.kind == TaskKind::kFlush) {
        for (uint32_t rank : t.ranks) {
          auto sh = v.shards.find(rank);
          if (sh == v.shards.end()) continue;
          b.sources[rank] = Sources(v, sh->second, t.node_id);
        }
      }
      if (t.kind == TaskKind::kRebuildSegments) {
        for (const SegmentKey& key : t.segments) {
          b.segment_sources[key] = StripeLocations(v, key.group, key.stripe, &key);
        }
      }
      b.version = std::move(copy);
    }
  }
  return b;
}

}  // namespace ckpt::meta
