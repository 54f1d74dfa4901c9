// Engine, membership: which nodes are current and usable, what a node's
// loss does to the versions it held, and the notices nodes receive.
#include <algorithm>
#include <iterator>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/meta/core_state.h"
#include "server/meta/transitions.h"

namespace ckpt::meta {

absl::StatusOr<Node*> Engine::CheckNode(const std::string& node_id, uint64_t incarnation,
                                        bool allow_left) {
  auto it = s_.nodes.find(node_id);
  if (it == s_.nodes.end()) {
    return absl::NotFoundError(
        absl::StrCat("node \"", node_id, "\" is not registered; call RegisterNode"));
  }
  Node& n = it->second;
  if (incarnation != n.incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "node \"", node_id, "\" incarnation ", incarnation, " is stale (current is ",
        n.incarnation, "); re-register"));
  }
  if (n.state == NodeState::kDead || (n.state == NodeState::kLeft && !allow_left)) {
    return absl::FailedPreconditionError(absl::StrCat("node \"", node_id, "\" is ",
                                                      NodeStateName(n.state),
                                                      " (lease expired); re-register"));
  }
  return &n;
}

absl::Status Engine::SetNodeState(Node& n, NodeState to) {
  absl::Status st = Transition(&n.state, to);
  if (!st.ok()) log::Error("node {}: {}", n.id, std::string(st.message()));
  return st;
}

bool Engine::IsUsable(const std::string& node_id) const {
  auto it = s_.nodes.find(node_id);
  return it != s_.nodes.end() && NodeIsUsable(it->second.state);
}

bool Engine::CountsForProtection(const std::string& node_id) const {
  auto it = s_.nodes.find(node_id);
  return it != s_.nodes.end() && NodeCountsForProtection(it->second.state);
}

bool Engine::IsSuspect(const std::string& node_id) const {
  auto it = s_.nodes.find(node_id);
  return it != s_.nodes.end() && it->second.state == NodeState::kSuspect;
}

Endpoint Engine::EndpointOf(const std::string& node_id) const {
  Endpoint e;
  e.node_id = node_id;
  auto it = s_.nodes.find(node_id);
  if (it != s_.nodes.end()) {
    e.incarnation = it->second.incarnation;
    e.grpc_address = it->second.grpc_address;
    e.data_address = it->second.data_address;
    e.state = it->second.state;
  }
  return e;
}

std::string Engine::AnyUsableNode() const {
  for (const auto& [id, n] : s_.nodes) {
    if (IsUsable(id)) return id;
  }
  return "";
}

void Engine::NodeLost(const std::string& node_id, const std::string& reason) {
  const int64_t now = NowMs();
  // Its unfinished tasks go elsewhere (re-planned below), and so do pushes
  // other nodes were asked to make to it: it will never acknowledge them.
  std::set<std::pair<std::string, uint64_t>> retarget;
  for (auto& [id, t] : s_.tasks) {
    if (!Active(t)) continue;
    if (t.node_id == node_id) {
      CancelTask(t);
    } else if (t.kind == TaskKind::kReplicate &&
               std::find(t.targets.begin(), t.targets.end(), node_id) != t.targets.end()) {
      CancelTask(t);
      retarget.insert({t.job_id, t.step});
    }
  }
  for (auto& [job_id, by_step] : s_.versions) {
    for (auto& [step, v] : by_step) {
      if (IsTerminal(v.state)) continue;
      bool touched = retarget.count({job_id, step}) != 0;
      for (auto& [rank, sh] : v.shards) {
        for (Copy& c : sh.copies) {
          if (c.node_id == node_id && (c.state == CopyState::kValid || c.state == CopyState::kPending)) {
            c.state = CopyState::kLost;
            c.updated_ms = now;
            c.detail = reason;
            txn_.ShardRecord(v, rank);
            touched = true;
          }
        }
      }
      for (Segment& seg : v.segments) {
        if (seg.holder_node_id == node_id &&
            (seg.state == CopyState::kValid || seg.state == CopyState::kPending)) {
          seg.state = CopyState::kLost;
          seg.updated_ms = now;
          seg.detail = reason;
          txn_.Segments(v);
          touched = true;
        }
      }
      if (touched || v.flush_planned) Recompute(v);
    }
  }
}

void Engine::ReplanAll() {
  for (auto& [job_id, by_step] : s_.versions) {
    for (auto& [step, v] : by_step) {
      // PROTECTED too: a draining node's copies stop counting as protection.
      if (v.state == VersionState::kDegraded || v.state == VersionState::kStaged ||
          (v.state == VersionState::kProtected && !v.evicted) ||
          (v.state == VersionState::kPersisted && v.flush_planned)) {
        Recompute(v);
      }
    }
  }
}

void Engine::NoticeStaged(const Version& v, bool staged) {
  std::set<std::string> holders;
  for (const auto& [rank, sh] : v.shards) {
    for (const Copy& c : sh.copies) holders.insert(c.node_id);
  }
  for (const std::string& node : holders) {
    std::deque<VersionNotice>& queue = s_.version_notices[node];
    if (queue.size() >= kMaxVersionNotices) queue.pop_front();
    queue.push_back(VersionNotice{v.job_id, v.step, staged});
  }
  if (!holders.empty()) ++s_.task_generation;
}

void Engine::NoticeHeldVersions(const std::string& node_id, const std::vector<Holding>& holdings) {
  std::map<std::string, std::set<uint64_t>> held;  // job -> restorable steps with a valid copy here
  for (const Holding& h : holdings) {
    if (h.is_segment) continue;
    auto job = s_.versions.find(h.job_id);
    if (job == s_.versions.end()) continue;
    auto v = job->second.find(h.step);
    if (v == job->second.end() || v->second.evicted || !SatisfiesLevel(v->second.state, Level::kStaged)) continue;
    auto sh = v->second.shards.find(h.rank);
    if (sh == v->second.shards.end()) continue;
    const std::vector<Copy>& copies = sh->second.copies;
    if (std::any_of(copies.begin(), copies.end(),
                    [&](const Copy& c) { return c.node_id == node_id && c.state == CopyState::kValid; })) {
      held[h.job_id].insert(h.step);
    }
  }
  if (held.empty()) return;
  std::deque<VersionNotice>& queue = s_.version_notices[node_id];
  for (const auto& [job_id, steps] : held) {
    auto from = steps.begin();
    if (steps.size() > kMaxNoticedStepsPerJob) std::advance(from, steps.size() - kMaxNoticedStepsPerJob);
    for (auto step = from; step != steps.end(); ++step) {
      if (queue.size() >= kMaxVersionNotices) queue.pop_front();
      queue.push_back(VersionNotice{job_id, *step, true});
    }
  }
  ++s_.task_generation;
}

}  // namespace ckpt::meta
