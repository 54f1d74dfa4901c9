// MetaCore's state machine: deriving version states from holdings, planning
// protection, recovery and flush tasks, retention, node loss, inventory
// reconciliation, time-driven work (Tick) and the cluster status.
#include <algorithm>
#include <iterator>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "ec/layout.h"
#include "server/meta/core_state.h"
#include "server/meta/transitions.h"

namespace ckpt::meta {

namespace {
constexpr int32_t kPriorityRecovery = 300;
constexpr int32_t kPriorityProtection = 200;
constexpr int32_t kPriorityFlush = 100;

bool Usable(CopyState s) { return s == CopyState::kValid; }

const EcGroup* GroupOfNode(const Version& v, const std::string& node_id, int* member) {
  for (const EcGroup& g : v.plan.groups) {
    for (size_t j = 0; j < g.members.size(); ++j) {
      if (g.members[j] == node_id) {
        *member = static_cast<int>(j);
        return &g;
      }
    }
  }
  return nullptr;
}

const NodeBlob* BlobOf(const Version& v, const std::string& node_id) {
  for (const NodeBlob& b : v.blobs)
    if (b.node_id == node_id) return &b;
  return nullptr;
}
}  // namespace

absl::Status Engine::SetState(Version& v, VersionState to, const std::string& reason) {
  if (v.state == to) return absl::OkStatus();
  const VersionState from = v.state;
  if (absl::Status st = Transition(&v.state, to); !st.ok()) {
    log::Error("version {}/{}: {}", v.job_id, v.step, std::string(st.message()));
    return st;
  }
  if (from == VersionState::kOpen) s_.open_progress.erase({v.job_id, v.step});
  const int64_t now = NowMs();
  switch (to) {
    case VersionState::kStaged:
      if (v.staged_ms == 0) v.staged_ms = now;
      break;
    case VersionState::kProtected:
      if (v.protected_ms == 0) v.protected_ms = now;
      break;
    case VersionState::kPersisted:
      if (v.persisted_ms == 0) v.persisted_ms = now;
      break;
    case VersionState::kAborted:
    case VersionState::kDeleted:
      v.ended_ms = now;
      v.abort_reason = reason;
      break;
    default:
      break;
  }
  txn_.Header(v);
  log::Info("version {}/{}: {} -> {}{}{}", v.job_id, v.step, VersionStateName(from),
            VersionStateName(to), reason.empty() ? "" : ": ", reason);
  const bool was_staged = SatisfiesLevel(from, Level::kStaged) && !v.evicted;
  const bool is_staged = SatisfiesLevel(to, Level::kStaged) && !v.evicted;
  if (was_staged != is_staged) NoticeStaged(v, is_staged);
  if (to == VersionState::kPersisted) {
    // Incremental versions waiting for this one's files commit now.
    for (uint64_t step : Dependents(v.job_id, v.step)) {
      Version& d = s_.versions[v.job_id][step];
      if (d.flush_planned) PlanFlush(d);
    }
    return absl::OkStatus();
  }
  // (Versions that refer to its items stay: their own bytes may be referred
  // to in turn. They no longer load whole, and Latest skips them: RefsAvailable.)
  return absl::OkStatus();
}

std::string StagedRanksText(const Version& v) {
  std::string text = absl::StrCat(v.shards.size(), " of ", v.world_size, " shards staged");
  if (v.shards.size() >= v.world_size) return text;
  constexpr int kNamed = 8;
  std::vector<std::string> missing;
  uint32_t more = 0;
  for (uint32_t r = 0; r < v.world_size; ++r) {
    if (v.shards.count(r)) continue;
    if (missing.size() < kNamed) {
      missing.push_back(absl::StrCat(r));
    } else {
      ++more;
    }
  }
  absl::StrAppend(&text, " (rank", missing.size() + more > 1 ? "s " : " ",
                  absl::StrJoin(missing, ", "),
                  more > 0 ? absl::StrCat(" and ", more, " more") : "", " missing)");
  return text;
}

void Engine::AbortOpenVersion(Version& v, const std::string& reason) {
  CancelVersionTasks(v);
  // Shards a newer version refers to (an incremental save whose base was this
  // version, on ranks that did save it) stay until nothing refers to them
  // (ApplyRetention); the version itself is never offered.
  if (Dependents(v.job_id, v.step).empty()) EvictVersion(v);
  SetState(v, VersionState::kAborted, reason).IgnoreError();  // a refusal is logged by SetState
}

void Engine::AbortOpenVersionsBelow(const Version& staged) {
  if (IsTerminal(staged.state) || staged.state == VersionState::kOpen) return;
  auto j = s_.versions.find(staged.job_id);
  if (j == s_.versions.end()) return;
  for (auto it = j->second.begin(); it != j->second.end() && it->first < staged.step; ++it) {
    Version& old = it->second;
    if (old.state != VersionState::kOpen) continue;
    AbortOpenVersion(old, absl::StrCat("superseded: step ", staged.step,
                                       " was staged first, while this version had ",
                                       StagedRanksText(old)));
  }
}

bool Engine::ShardReadable(const Version& v, const Shard& shard) const {
  return !Sources(v, shard, "").empty();
}

void Engine::Recompute(Version& v) {
  if (IsTerminal(v.state) || v.state == VersionState::kOpen) {
    if (v.state == VersionState::kOpen) {
      // A staged shard that lost every copy before the version completed.
      for (const auto& [rank, sh] : v.shards) {
        bool any = false;
        for (const Copy& c : sh.copies) any = any || (Usable(c.state) && IsUsable(c.node_id));
        if (!any) {
          if (AwaitLostCopies(v, rank)) return;
          CancelVersionTasks(v);
          EvictVersion(v);  // the ranks that survive can never be restored: free them
          SetState(v, VersionState::kAborted,
                   absl::StrCat("rank ", rank, " was lost on node ", sh.primary_node_id,
                                " before every rank was staged"))
              .IgnoreError();  // a refusal is logged by SetState
          return;
        }
      }
      s_.awaiting_return.erase({v.job_id, v.step});
      PlanRecovery(v);
    }
    return;
  }
  if (v.state == VersionState::kPersisted) {
    PlanFlush(v);
    return;
  }
  // Readability.
  for (const auto& [rank, sh] : v.shards) {
    if (!ShardReadable(v, sh)) {
      if (AwaitLostCopies(v, rank)) return;
      CancelVersionTasks(v);
      EvictVersion(v);  // the other ranks' copies can never be restored: free them
      SetState(v, VersionState::kAborted,
               absl::StrCat("data lost: rank ", rank, " has no readable copy left"))
          .IgnoreError();  // a refusal is logged by SetState
      ++s_.counters.reports_rejected_total;  // visible in metrics as a failure
      return;
    }
  }
  s_.awaiting_return.erase({v.job_id, v.step});
  // Protection completeness.
  bool complete = true;
  bool lost_something = false;
  const ProtectionPolicy& policy = v.plan.policy;
  for (const auto& [rank, sh] : v.shards) {
    int protective = 0;
    for (const Copy& c : sh.copies) {
      if (c.state == CopyState::kLost || c.state == CopyState::kCorrupt) lost_something = true;
      if (Usable(c.state) && c.role != CopyRole::kRestored && CountsForProtection(c.node_id)) {
        ++protective;
      }
    }
    if (policy.kind == ProtectionPolicy::Kind::kReplicate) {
      if (protective < policy.copies) complete = false;
    } else if (policy.kind == ProtectionPolicy::Kind::kNone) {
      if (protective < 1) complete = false;
    }
  }
  if (policy.kind == ProtectionPolicy::Kind::kErasureCode) {
    if (v.segments.empty()) complete = false;
    std::set<std::pair<int, int>> stripes;
    for (const Segment& seg : v.segments) {
      if (seg.state == CopyState::kLost || seg.state == CopyState::kCorrupt) lost_something = true;
      if (!Usable(seg.state) || !CountsForProtection(seg.holder_node_id)) complete = false;
      stripes.insert({seg.key.group, seg.key.stripe});
    }
    // Every segment in place is not enough: a stripe whose rebuilt segments
    // share a node would not survive m losses.
    for (const EcGroup& g : v.plan.groups) {
      for (const auto& [group, stripe] : stripes) {
        if (complete && group == g.index && !StripeTolerates(v, g, stripe)) complete = false;
      }
    }
  }
  if (complete) {
    if (v.state != VersionState::kProtected) {
      SetState(v, VersionState::kProtected).IgnoreError();  // a refusal is logged by SetState
      if (auto job = s_.jobs.find(v.job_id); job != s_.jobs.end()) ApplyRetention(job->second);
    }
  } else if (v.state == VersionState::kProtected ||
             (v.state == VersionState::kStaged && lost_something)) {
    SetState(v, VersionState::kDegraded, "redundancy lost; re-protecting").IgnoreError();  // logged if refused
  }
  if (!complete) PlanRecovery(v);
  PlanFlush(v);
}

bool Engine::AwaitLostCopies(const Version& v, uint32_t rank) {
  const std::pair<std::string, uint64_t> key{v.job_id, v.step};
  if (options_.lost_copy_grace <= absl::ZeroDuration()) return false;
  const int64_t grace_ms = absl::ToInt64Milliseconds(options_.lost_copy_grace);
  int64_t deadline = 0;
  std::string node_id;
  auto consider = [&](CopyState state, const std::string& holder, int64_t lost_ms) {
    if (state != CopyState::kLost) return;
    auto n = s_.nodes.find(holder);
    if (n == s_.nodes.end()) return;
    // Its inventory, once received, said whether the copy is still there.
    if (n->second.state != NodeState::kDead && n->second.inventory_received) return;
    if (lost_ms + grace_ms > deadline) {
      deadline = lost_ms + grace_ms;
      node_id = holder;
    }
  };
  for (const auto& [r, sh] : v.shards)
    for (const Copy& c : sh.copies) consider(c.state, c.node_id, c.updated_ms);
  for (const Segment& seg : v.segments) consider(seg.state, seg.holder_node_id, seg.updated_ms);
  if (deadline <= NowMs()) {
    s_.awaiting_return.erase(key);
    return false;
  }
  auto [it, first] = s_.awaiting_return.insert({key, deadline});
  if (first) {
    log::Warn("version {}/{}: rank {} has no readable copy left; waiting {} ms for node {} "
              "(it held the copies) to come back with its memory tier before declaring the "
              "data lost",
              v.job_id, v.step, rank, deadline - NowMs(), node_id);
  }
  it->second = deadline;
  return true;
}

bool Engine::StripeTolerates(const Version& v, const EcGroup& group, int stripe) const {
  std::map<std::string, int> held;
  int total = 0;
  for (const Segment& seg : v.segments) {
    if (seg.key.group != group.index || seg.key.stripe != stripe) continue;
    if (!Usable(seg.state)) continue;
    ++total;
    if (seg.length_bytes == 0) continue;  // nothing to lose
    if (!CountsForProtection(seg.holder_node_id)) {
      --total;
      continue;
    }
    ++held[seg.holder_node_id];
  }
  std::vector<int> counts;
  for (const auto& [node, n] : held) counts.push_back(n);
  std::sort(counts.rbegin(), counts.rend());
  int survive = total;
  for (size_t i = 0; i < counts.size() && static_cast<int>(i) < group.parity_m; ++i) {
    survive -= counts[i];
  }
  return survive >= group.data_k;
}

void Engine::StartErasureCoding(Version& v) {
  v.blobs.clear();
  v.segments.clear();
  std::map<std::string, NodeBlob> blobs;
  for (const EcGroup& g : v.plan.groups)
    for (const auto& m : g.members) blobs[m].node_id = m;
  for (const auto& [rank, sh] : v.shards) {
    NodeBlob& b = blobs[sh.primary_node_id];
    b.node_id = sh.primary_node_id;
    b.parts.push_back(BlobPart{rank, b.size_bytes, sh.size_bytes});
    b.size_bytes += sh.size_bytes;
  }
  const int64_t now = NowMs();
  for (const EcGroup& g : v.plan.groups) {
    auto layout = StripeLayout::Create(static_cast<int>(g.members.size()), g.data_k, g.parity_m);
    if (!layout.ok()) {
      log::Error("version {}/{}: EC layout for group {}: {}", v.job_id, v.step, g.index,
                 layout.status().ToString());
      continue;
    }
    const uint32_t k = static_cast<uint32_t>(g.data_k);
    for (const auto& m : g.members) {
      NodeBlob& b = blobs[m];
      b.segment_bytes = ec::BlobLayout{b.size_bytes, k}.SegmentBytes();
    }
    auto seg_len = [&](const std::string& owner, int t) -> uint64_t {
      return ec::BlobLayout{blobs[owner].size_bytes, k}.SegmentLength(static_cast<uint32_t>(t));
    };
    for (size_t s = 0; s < layout->stripes().size(); ++s) {
      const EcStripe& stripe = layout->stripes()[s];
      uint64_t stripe_len = 0;
      for (size_t d = 0; d < stripe.data.size(); ++d) {
        const std::string& owner = g.members[stripe.data[d].member];
        Segment seg;
        seg.key = SegmentKey{g.index, static_cast<int>(s), static_cast<int>(d)};
        seg.kind = SegmentKind::kData;
        seg.owner_node_id = owner;
        seg.blob_segment = stripe.data[d].segment;
        seg.length_bytes = seg_len(owner, seg.blob_segment);
        seg.holder_node_id = owner;
        seg.state = seg.length_bytes == 0 ? CopyState::kValid : CopyState::kPending;
        seg.updated_ms = now;
        stripe_len = std::max(stripe_len, seg.length_bytes);
        v.segments.push_back(seg);
      }
      for (size_t p = 0; p < stripe.parity_members.size(); ++p) {
        Segment seg;
        seg.key = SegmentKey{g.index, static_cast<int>(s), static_cast<int>(k + p)};
        seg.kind = SegmentKind::kParity;
        seg.length_bytes = stripe_len;
        seg.holder_node_id = g.members[stripe.parity_members[p]];
        seg.state = stripe_len == 0 ? CopyState::kValid : CopyState::kPending;
        seg.updated_ms = now;
        v.segments.push_back(seg);
      }
    }
    for (const auto& m : g.members) {
      Task& t = NewTask(m, TaskKind::kEcEncode, v.job_id, v.step, kPriorityProtection);
      t.group = g.index;
      txn_.Task(t);
    }
  }
  for (auto& [id, b] : blobs) v.blobs.push_back(std::move(b));
  txn_.Segments(v);
}

namespace {
// Nodes in preference order to receive a new copy of `sh`.
std::vector<std::string> ReplicaCandidates(Engine& e, const Version& v, const Shard& sh,
                                           const std::set<std::string>& exclude) {
  const auto& s = e.state();
  std::vector<std::string> out;
  std::set<std::string> domains;
  for (const Copy& c : sh.copies) {
    auto n = s.nodes.find(c.node_id);
    if (n != s.nodes.end() && Usable(c.state)) domains.insert(PlacementDomain(s.nodes, n->first, n->second));
  }
  auto push = [&](const std::string& id) {
    if (exclude.count(id) || !e.CountsForProtection(id)) return;
    if (std::find(out.begin(), out.end(), id) == out.end()) out.push_back(id);
  };
  // The plan's protectors of the primary first (the planned placement).
  auto p = v.plan.protectors.find(sh.primary_node_id);
  if (p != v.plan.protectors.end())
    for (const auto& id : p->second) push(id);
  // Then nodes in a failure domain no copy is in, then any.
  for (const auto& [id, n] : s.nodes)
    if (!domains.count(PlacementDomain(s.nodes, id, n))) push(id);
  for (const auto& [id, n] : s.nodes) push(id);
  return out;
}
}  // namespace

void Engine::PlanRecovery(Version& v) {
  if (IsTerminal(v.state) || v.evicted) return;
  const ProtectionPolicy& policy = v.plan.policy;
  if (policy.kind == ProtectionPolicy::Kind::kReplicate) {
    // Targets already planned by active replicate tasks, per rank.
    std::map<uint32_t, std::set<std::string>> pending;
    for (Task* t : ActiveTasks(v.job_id, v.step, TaskKind::kReplicate)) {
      for (uint32_t r : t->ranks)
        for (const auto& target : t->targets) pending[r].insert(target);
    }
    // (source, targets) -> ranks
    std::map<std::pair<std::string, std::vector<std::string>>, std::vector<uint32_t>> plan;
    for (auto& [rank, sh] : v.shards) {
      std::set<std::string> holders;
      int protective = 0;
      // The source: a holder on a node that is not SUSPECT if there is one,
      // the primary first.
      std::string source;
      int source_rank = INT32_MAX;
      for (const Copy& c : sh.copies) {
        if (c.state == CopyState::kValid || c.state == CopyState::kPending) holders.insert(c.node_id);
        if (Usable(c.state) && IsUsable(c.node_id)) {
          const int rank = (IsSuspect(c.node_id) ? 2 : 0) + (c.role == CopyRole::kPrimary ? 0 : 1);
          if (rank < source_rank) {
            source = c.node_id;
            source_rank = rank;
          }
          if (c.role != CopyRole::kRestored && CountsForProtection(c.node_id)) ++protective;
        }
      }
      if (source.empty()) continue;  // unreadable: Recompute aborts
      for (const auto& t : pending[rank]) {
        if (CountsForProtection(t)) holders.insert(t);
      }
      int need = policy.copies - protective - static_cast<int>(pending[rank].size());
      if (need <= 0) continue;
      std::vector<std::string> targets;
      for (const auto& id : ReplicaCandidates(*this, v, sh, holders)) {
        if (static_cast<int>(targets.size()) >= need) break;
        targets.push_back(id);
      }
      if (targets.empty()) continue;  // waits for a node to join
      plan[{source, targets}].push_back(rank);
    }
    for (auto& [key, ranks] : plan) {
      const bool recovery = v.state == VersionState::kDegraded;
      Task& t = NewTask(key.first, TaskKind::kReplicate, v.job_id, v.step,
                        recovery ? kPriorityRecovery : kPriorityProtection);
      t.ranks = ranks;
      t.targets = key.second;
      txn_.Task(t);
    }
  } else if (policy.kind == ProtectionPolicy::Kind::kErasureCode && !v.segments.empty()) {
    std::set<SegmentKey> pending;
    std::map<SegmentKey, std::string> pending_target;  // where a running rebuild puts it
    for (Task* t : ActiveTasks(v.job_id, v.step, TaskKind::kRebuildSegments)) {
      if (!IsUsable(t->node_id)) continue;
      for (const SegmentKey& k : t->segments) {
        pending.insert(k);
        pending_target[k] = t->node_id;
      }
    }
    // EC encoding still running: its segments are not lost.
    const bool encoding = !ActiveTasks(v.job_id, v.step, TaskKind::kEcEncode).empty();
    std::map<std::string, std::vector<SegmentKey>> rebuilds;
    for (const Segment& seg : v.segments) {
      const bool lost = seg.state == CopyState::kLost || seg.state == CopyState::kCorrupt ||
                        (seg.state == CopyState::kValid && !CountsForProtection(seg.holder_node_id)) ||
                        (seg.state == CopyState::kPending && !encoding);
      if (!lost || pending.count(seg.key)) continue;
      // Survivors of the stripe.
      int valid = 0;
      std::map<std::string, int> held;  // node -> segments of this stripe it holds
      int k = 0;
      const EcGroup* group = nullptr;
      for (const EcGroup& g : v.plan.groups)
        if (g.index == seg.key.group) group = &g;
      if (group == nullptr) continue;
      k = group->data_k;
      for (const Segment& o : v.segments) {
        if (o.key.group != seg.key.group || o.key.stripe != seg.key.stripe) continue;
        if (Usable(o.state) && IsUsable(o.holder_node_id)) {
          ++valid;
          ++held[o.holder_node_id];
        }
      }
      if (valid < k) continue;  // not recoverable from memory; Recompute decides
      // Segments of this stripe already being rebuilt count where they will
      // land, so a second loss never piles a stripe onto one node.
      for (const auto& [pk, node] : pending_target) {
        if (pk.group == seg.key.group && pk.stripe == seg.key.stripe) ++held[node];
      }
      // Target: an alive node holding no segment of the stripe, outside the
      // group first; else the one holding fewest.
      std::string target;
      int best = INT32_MAX;
      std::set<std::string> members(group->members.begin(), group->members.end());
      for (int pass = 0; pass < 2 && target.empty(); ++pass) {
        for (const auto& [id, n] : s_.nodes) {
          if (!CountsForProtection(id)) continue;
          if (pass == 0 && members.count(id)) continue;
          const int h = held.count(id) ? held[id] : 0;
          if (h < best) {
            best = h;
            target = id;
          }
        }
        if (pass == 0 && best > 0) {
          target.clear();
          best = INT32_MAX;
        }
      }
      if (target.empty()) continue;
      rebuilds[target].push_back(seg.key);
      ++held[target];
    }
    // A stripe whose segments doubled up on one node (a rebuild had nowhere
    // else to go) does not survive m losses: once a node holding none of it
    // counts for protection, one doubled segment moves there. ApplySegment
    // drops the old copy when the new one reports VALID.
    std::set<std::pair<int, int>> seen;
    for (const Segment& seg : v.segments) {
      if (encoding) break;
      if (!seen.insert({seg.key.group, seg.key.stripe}).second) continue;
      const EcGroup* group = nullptr;
      for (const EcGroup& g : v.plan.groups)
        if (g.index == seg.key.group) group = &g;
      if (group == nullptr || StripeTolerates(v, *group, seg.key.stripe)) continue;
      bool busy = false;  // a rebuild of this stripe is under way or planned
      std::map<std::string, std::vector<const Segment*>> held;
      for (const Segment& o : v.segments) {
        if (o.key.group != seg.key.group || o.key.stripe != seg.key.stripe) continue;
        if (pending.count(o.key)) busy = true;
        for (const auto& [node, keys] : rebuilds)
          busy = busy || std::find(keys.begin(), keys.end(), o.key) != keys.end();
        if (Usable(o.state) && o.length_bytes > 0 && CountsForProtection(o.holder_node_id)) {
          held[o.holder_node_id].push_back(&o);
        }
      }
      if (busy) continue;
      const Segment* move = nullptr;
      for (const auto& [node, segs] : held) {
        if (segs.size() < 2) continue;
        // A parity or rebuilt segment, not the owner's own data.
        for (const Segment* o : segs)
          if (move == nullptr || o->holder_node_id != o->owner_node_id) move = o;
        break;
      }
      if (move == nullptr) continue;
      // The node holding none of the stripe with the fewest rebuilds planned.
      auto planned = [&](const std::string& id) {
        auto it = rebuilds.find(id);
        return it == rebuilds.end() ? size_t{0} : it->second.size();
      };
      std::string target;
      for (const auto& [id, n] : s_.nodes) {
        if (!CountsForProtection(id) || held.count(id)) continue;
        if (target.empty() || planned(target) > planned(id)) target = id;
      }
      if (target.empty()) continue;
      log::Info("version {}/{}: stripe {}/{} has segments doubled up on node {}; moving {} to {}",
                v.job_id, v.step, seg.key.group, seg.key.stripe, move->holder_node_id,
                move->key.position, target);
      rebuilds[target].push_back(move->key);
    }
    for (auto& [node, keys] : rebuilds) {
      Task& t = NewTask(node, TaskKind::kRebuildSegments, v.job_id, v.step, kPriorityRecovery);
      t.segments = keys;
      txn_.Task(t);
    }
  }
}

void Engine::RestartEncodesBuiltOn(const std::string& node_id) {
  for (auto& [job_id, by_step] : s_.versions) {
    for (auto& [step, v] : by_step) {
      if (IsTerminal(v.state) || v.plan.policy.kind != ProtectionPolicy::Kind::kErasureCode) continue;
      std::set<int> groups;  // groups with a parity still being built on the node
      for (const Segment& seg : v.segments) {
        if (seg.holder_node_id == node_id && seg.kind == SegmentKind::kParity &&
            seg.state == CopyState::kPending) {
          groups.insert(seg.key.group);
        }
      }
      if (groups.empty()) continue;
      std::set<std::pair<std::string, int>> running;  // (node, group) with an encode task
      for (Task* t : ActiveTasks(v.job_id, v.step, TaskKind::kEcEncode)) running.insert({t->node_id, t->group});
      for (const EcGroup& g : v.plan.groups) {
        if (!groups.count(g.index)) continue;
        for (const std::string& m : g.members) {
          if (running.count({m, g.index}) || !IsUsable(m)) continue;
          Task& t = NewTask(m, TaskKind::kEcEncode, v.job_id, v.step, kPriorityProtection);
          t.group = g.index;
          txn_.Task(t);
        }
        log::Info("version {}/{}: node {} restarted while building parity of group {}; its members "
                  "encode again", v.job_id, v.step, node_id, g.index);
      }
    }
  }
}

std::vector<Version*> Engine::ResumeStalledEncodes(const std::string& node_id) {
  std::vector<Version*> changed;
  const int64_t now = NowMs();
  for (auto& [job_id, by_step] : s_.versions) {
    for (auto& [step, v] : by_step) {
      if (IsTerminal(v.state) || v.evicted || v.segments.empty() ||
          v.plan.policy.kind != ProtectionPolicy::Kind::kErasureCode) {
        continue;
      }
      // Per group: members with an encode task running, and whether one
      // failed for good.
      std::set<std::pair<std::string, int>> running;
      std::set<int> failed;
      auto ids = s_.tasks_by_version.find({v.job_id, v.step});
      if (ids != s_.tasks_by_version.end()) {
        for (const std::string& id : ids->second) {
          auto t = s_.tasks.find(id);
          if (t == s_.tasks.end() || t->second.kind != TaskKind::kEcEncode) continue;
          if (Active(t->second)) running.insert({t->second.node_id, t->second.group});
          if (t->second.state == TaskState::kFailed) failed.insert(t->second.group);
        }
      }
      bool any = false;
      for (const EcGroup& g : v.plan.groups) {
        const std::set<std::string> members(g.members.begin(), g.members.end());
        if (!failed.count(g.index) || !members.count(node_id)) continue;
        bool never_built = false;
        for (const Segment& seg : v.segments) {
          never_built = never_built || (seg.key.group == g.index && seg.kind == SegmentKind::kData &&
                                        seg.state == CopyState::kPending && seg.length_bytes > 0);
        }
        if (!never_built) continue;
        bool ready = true;
        for (const std::string& m : g.members) ready = ready && IsUsable(m);
        for (const auto& [rank, sh] : v.shards) {
          if (!members.count(sh.primary_node_id)) continue;
          bool held = false;
          for (const Copy& c : sh.copies) held = held || (c.node_id == sh.primary_node_id && Usable(c.state));
          ready = ready && held;
        }
        if (!ready) continue;
        // What the group's members hold and is not VALID is built anew.
        for (Segment& seg : v.segments) {
          if (seg.key.group != g.index || seg.state == CopyState::kValid || seg.length_bytes == 0 ||
              !members.count(seg.holder_node_id)) {
            continue;
          }
          seg.state = CopyState::kPending;
          seg.updated_ms = now;
          seg.detail = "encoding again";
        }
        for (const std::string& m : g.members) {
          if (running.count({m, g.index})) continue;
          Task& t = NewTask(m, TaskKind::kEcEncode, v.job_id, v.step, kPriorityProtection);
          t.group = g.index;
          txn_.Task(t);
        }
        log::Info("version {}/{}: group {} was never encoded (its encodes failed for good while a member "
                  "was away); its {} members are all back and encode again", v.job_id, v.step, g.index,
                  g.members.size());
        any = true;
      }
      if (any) {
        txn_.Segments(v);
        changed.push_back(&v);
      }
    }
  }
  return changed;
}

void Engine::PlanFlush(Version& v) {
  if (!v.flush_planned || IsTerminal(v.state) || v.state == VersionState::kPersisted) return;
  std::set<uint32_t> covered;
  for (Task* t : ActiveTasks(v.job_id, v.step, TaskKind::kFlush)) {
    if (!IsUsable(t->node_id)) {
      CancelTask(*t);
      continue;
    }
    covered.insert(t->ranks.begin(), t->ranks.end());
  }
  std::map<std::string, std::vector<uint32_t>> by_node;
  bool all_written = v.shards.size() == v.world_size;
  for (const auto& [rank, sh] : v.shards) {
    if (sh.durable_written) continue;
    all_written = false;
    if (covered.count(rank)) continue;
    std::string node;
    for (const Copy& c : sh.copies) {
      if (!Usable(c.state) || !IsUsable(c.node_id)) continue;
      if (node.empty() || c.node_id == sh.primary_node_id) node = c.node_id;
    }
    if (node.empty()) {
      // No full copy: any usable node reads through the EC sources.
      if (Sources(v, sh, "").empty()) continue;
      node = AnyUsableNode();
    }
    if (!node.empty()) by_node[node].push_back(rank);
  }
  for (auto& [node, ranks] : by_node) {
    Task& t = NewTask(node, TaskKind::kFlush, v.job_id, v.step, kPriorityFlush);
    t.ranks = ranks;
    txn_.Task(t);
  }
  // The commit goes out again if its task was cancelled (its node died
  // before running it): issued once only, the version stayed unflushed and,
  // planned for flush, was never evicted from memory either.
  bool committing = false;
  for (Task* t : ActiveTasks(v.job_id, v.step, TaskKind::kCommitDurable)) {
    if (!IsUsable(t->node_id)) {
      CancelTask(*t);
      continue;
    }
    committing = true;
  }
  // An incremental version commits after the versions it refers to (its
  // manifest names their files); their PERSISTED state plans it again.
  if (all_written && !committing && RefsPersisted(v)) {
    std::string node;
    auto r0 = v.shards.find(0);
    if (r0 != v.shards.end() && IsUsable(r0->second.primary_node_id)) {
      node = r0->second.primary_node_id;
    }
    if (node.empty()) node = AnyUsableNode();
    if (!node.empty()) {
      Task& t = NewTask(node, TaskKind::kCommitDurable, v.job_id, v.step, kPriorityFlush);
      txn_.Task(t);
      v.commit_issued = true;
      txn_.Header(v);
    }
  }
}

void Engine::StartFlush(Version& v) {
  if (v.flush_planned || IsTerminal(v.state) || v.state == VersionState::kPersisted || v.evicted) return;
  v.flush_planned = true;
  v.durable_dir = absl::StrCat(v.job_id, "/", v.step);
  for (auto& [rank, sh] : v.shards) {
    sh.durable_path = absl::StrCat(v.durable_dir, "/", RankFileName(rank));
    txn_.ShardRecord(v, rank);
  }
  txn_.Header(v);
  PlanFlush(v);
}

bool Engine::RefsPersisted(Version& v) {
  auto by_step = s_.versions.find(v.job_id);
  if (by_step == s_.versions.end()) return true;
  bool ready = true;
  for (const auto& [rank, sh] : v.shards) {
    for (uint64_t base : sh.ref_steps) {
      auto b = by_step->second.find(base);
      // Gone (ended, or evicted before it was flushed): never will be. The
      // version commits anyway; its own bytes are whole, and what the
      // versions referring to it need of it is its own items.
      if (b == by_step->second.end() || IsTerminal(b->second.state) ||
          (b->second.evicted && b->second.state != VersionState::kPersisted)) {
        continue;
      }
      if (b->second.state != VersionState::kPersisted) {
        StartFlush(b->second);
        ready = false;
      }
    }
  }
  return ready;
}

bool Engine::RefsAvailable(const Version& v) const {
  auto by_step = s_.versions.find(v.job_id);
  for (const auto& [rank, sh] : v.shards) {
    for (uint64_t base : sh.ref_steps) {
      if (by_step == s_.versions.end()) return false;
      auto b = by_step->second.find(base);
      // (An aborted version whose shards are kept for the versions referring
      // to it still serves them.)
      if (b == by_step->second.end() || (b->second.evicted && b->second.state != VersionState::kPersisted)) {
        return false;
      }
    }
  }
  return true;
}

std::vector<uint64_t> Engine::Dependents(const std::string& job_id, uint64_t step) const {
  std::vector<uint64_t> out;
  auto by_step = s_.versions.find(job_id);
  if (by_step == s_.versions.end()) return out;
  for (auto it = by_step->second.upper_bound(step); it != by_step->second.end(); ++it) {
    const Version& v = it->second;
    // (An evicted PERSISTED version still refers to the files of its bases.)
    if (IsTerminal(v.state) || (v.evicted && v.state != VersionState::kPersisted)) continue;
    for (const auto& [rank, sh] : v.shards) {
      if (std::binary_search(sh.ref_steps.begin(), sh.ref_steps.end(), step)) {
        out.push_back(v.step);
        break;
      }
    }
  }
  return out;
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

void Engine::EvictVersion(Version& v) {
  if (v.evicted) return;
  if (SatisfiesLevel(v.state, Level::kStaged)) NoticeStaged(v, false);
  v.evicted = true;
  txn_.Header(v);
  std::set<std::string> holders;
  for (auto& [rank, sh] : v.shards) {
    for (Copy& c : sh.copies) {
      if (c.state == CopyState::kValid || c.state == CopyState::kPending ||
          c.state == CopyState::kCorrupt) {
        holders.insert(c.node_id);
      }
    }
  }
  for (const Segment& seg : v.segments) {
    if (seg.state != CopyState::kEvicted && seg.state != CopyState::kLost) {
      holders.insert(seg.holder_node_id);
    }
  }
  for (const auto& node : holders) {
    if (!IsUsable(node)) continue;
    Task& t = NewTask(node, TaskKind::kEvict, v.job_id, v.step, 0);
    txn_.Task(t);
  }
}

void Engine::ApplyRetention(Job& job) {
  auto& by_step = s_.versions[job.spec.job_id];
  const uint32_t keep_mem = job.spec.retention.EffectiveKeepInMemory();
  uint32_t kept = 0;
  // Versions that a version kept for its own sake refers to (incremental
  // saves): they stay while it does, whatever the window says. Newest first,
  // so every version that refers to one is decided before it. A version kept
  // only for the versions referring to it does not keep what it refers to:
  // the references of those point to the versions holding the bytes, never
  // further, so the chain stops there (that version alone may no longer load
  // whole; Latest never offers it).
  std::set<uint64_t> referenced;
  auto refers = [&referenced](const Version& kept_version) {
    for (const auto& [rank, sh] : kept_version.shards) referenced.insert(sh.ref_steps.begin(), sh.ref_steps.end());
  };
  for (auto it = by_step.rbegin(); it != by_step.rend(); ++it) {
    Version& v = it->second;
    if (v.evicted) continue;
    if (IsTerminal(v.state)) {  // aborted, kept only for the versions referring to it
      if (referenced.count(v.step) == 0) EvictVersion(v);
      continue;
    }
    std::string evict_reason;  // empty: it stays for its own sake
    if (!SatisfiesLevel(v.state, Level::kProtected)) {
      // A version that never reached PROTECTED (or lost it and cannot be
      // re-protected) while keep_in_memory newer ones did: no restore picks
      // it any more, and keeping it would hold its memory for good.
      const bool superseded = kept >= keep_mem && (v.state == VersionState::kStaged ||
                                                   v.state == VersionState::kDegraded);
      // (One chosen for flush stays: once PERSISTED the rule below evicts it.)
      if (superseded && !v.flush_planned) {
        evict_reason = absl::StrCat("superseded: ", keep_mem, " newer version(s) PROTECTED (keep_in_memory=",
                                    keep_mem, ") while this one was ", VersionStateName(v.state));
      }
    } else if (kept < keep_mem) {
      ++kept;
    } else if (!v.flush_planned || v.state == VersionState::kPersisted) {
      // Beyond the memory window (one still being flushed stays until it is
      // PERSISTED).
      evict_reason = absl::StrCat("evicted by retention (keep_in_memory=", keep_mem, ")");
    }
    if (evict_reason.empty()) {
      refers(v);
      continue;
    }
    if (referenced.count(v.step) != 0 && !IsTerminal(v.state)) continue;  // kept for others
    CancelVersionTasks(v);
    EvictVersion(v);
    if (v.state != VersionState::kPersisted) {
      SetState(v, VersionState::kDeleted, evict_reason).IgnoreError();  // a refusal is logged by SetState
    }
  }
  const uint32_t keep_durable = job.spec.retention.keep_durable;
  if (keep_durable == 0) return;
  uint32_t durable = 0;
  // Files of versions that a version kept on disk refers to stay too (as
  // in memory, not further).
  std::set<uint64_t> referenced_on_disk;
  for (auto it = by_step.rbegin(); it != by_step.rend(); ++it) {
    Version& v = it->second;
    if (v.state != VersionState::kPersisted) continue;
    if (durable < keep_durable) {
      ++durable;
      for (const auto& [rank, sh] : v.shards) referenced_on_disk.insert(sh.ref_steps.begin(), sh.ref_steps.end());
      continue;
    }
    if (referenced_on_disk.count(v.step) != 0) continue;
    if (!v.evicted) continue;  // memory first
    if (!DeleteDurable(v)) continue;
    SetState(v, VersionState::kDeleted,
             absl::StrCat("removed from the durable tier by retention (keep_durable=",
                          keep_durable, ")"))
        .IgnoreError();  // a refusal is logged by SetState
  }
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

std::vector<Source> Engine::Sources(const Version& v, const Shard& shard,
                                    const std::string& near_node_id) const {
  std::vector<Source> out;
  std::string near_domain;
  if (auto n = s_.nodes.find(near_node_id); n != s_.nodes.end()) {
    near_domain = PlacementDomain(s_.nodes, n->first, n->second);
  }
  // Holders on DEAD or LEFT nodes are never sources (IsUsable); replicas on
  // SUSPECT nodes (missing heartbeats: a stopped or overloaded agent would
  // hold a reader for the whole peer timeout) come after every other source.
  std::vector<Source> replicas, suspect;
  for (const Copy& c : shard.copies) {
    if (!Usable(c.state) || !IsUsable(c.node_id)) continue;
    Source src;
    src.kind = c.node_id == near_node_id ? SourceKind::kLocal : SourceKind::kReplica;
    src.holder = EndpointOf(c.node_id);
    src.role = c.role;
    if (src.kind == SourceKind::kLocal) {
      out.push_back(src);
    } else if (IsSuspect(c.node_id)) {
      suspect.push_back(src);
    } else {
      replicas.push_back(src);
    }
  }
  auto rank_of = [&](const Source& s) {
    int r = s.role == CopyRole::kPrimary ? 0 : 2;
    auto n = s_.nodes.find(s.holder.node_id);
    if (!near_domain.empty() && n != s_.nodes.end() &&
        PlacementDomain(s_.nodes, n->first, n->second) == near_domain) {
      r -= 1;
    }
    return r;
  };
  auto by_rank = [&](const Source& a, const Source& b) { return rank_of(a) < rank_of(b); };
  std::stable_sort(replicas.begin(), replicas.end(), by_rank);
  std::stable_sort(suspect.begin(), suspect.end(), by_rank);
  out.insert(out.end(), replicas.begin(), replicas.end());

  // EC decode from the owner's stripes.
  int member = -1;
  const EcGroup* g = GroupOfNode(v, shard.primary_node_id, &member);
  const NodeBlob* blob = BlobOf(v, shard.primary_node_id);
  if (g != nullptr && blob != nullptr && !v.segments.empty() && blob->segment_bytes > 0) {
    uint64_t offset = 0;
    bool found = false;
    for (const BlobPart& p : blob->parts) {
      if (p.rank == shard.rank) {
        offset = p.blob_offset_bytes;
        found = true;
      }
    }
    auto layout = StripeLayout::Create(static_cast<int>(g->members.size()), g->data_k,
                                       g->parity_m);
    if (found && layout.ok()) {
      EcDecodeSource ec;
      ec.group_index = static_cast<uint32_t>(g->index);
      ec.data_k = static_cast<uint32_t>(g->data_k);
      ec.parity_m = static_cast<uint32_t>(g->parity_m);
      ec.owner_node_id = shard.primary_node_id;
      ec.blob_offset_bytes = offset;
      ec.segment_bytes = blob->segment_bytes;
      bool ok = true;
      const uint64_t first = offset / blob->segment_bytes;
      const uint64_t last =
          shard.size_bytes == 0 ? first : (offset + shard.size_bytes - 1) / blob->segment_bytes;
      for (uint64_t t = first; t <= last && ok; ++t) {
        const StripeSlot slot = layout->SegmentOf(member, static_cast<int>(t));
        EcStripeSource ss;
        ss.stripe_index = static_cast<uint32_t>(slot.stripe);
        ss.blob_segment_index = static_cast<uint32_t>(t);
        ss.position = static_cast<uint32_t>(slot.position);
        bool wanted_valid = false;
        for (const Segment& seg : v.segments) {
          if (seg.key.group != g->index || seg.key.stripe != slot.stripe) continue;
          if (seg.kind == SegmentKind::kParity) {
            ss.stripe_length_bytes = seg.length_bytes;
          }
        }
        ss.segments = StripeLocations(v, g->index, slot.stripe, nullptr);
        for (const SegmentLocation& loc : ss.segments) {
          if (loc.key.position == slot.position) wanted_valid = true;
        }
        if (!wanted_valid && static_cast<int>(ss.segments.size()) < g->data_k) ok = false;
        ec.stripes.push_back(std::move(ss));
      }
      if (ok) {
        Source src;
        src.kind = SourceKind::kEcDecode;
        src.ec = std::move(ec);
        out.push_back(std::move(src));
      }
    }
  }
  if (v.state == VersionState::kPersisted && !shard.durable_path.empty()) {
    Source src;
    src.kind = SourceKind::kDurable;
    src.durable_path = shard.durable_path;
    out.push_back(src);
  }
  out.insert(out.end(), suspect.begin(), suspect.end());
  return out;
}

std::vector<SegmentLocation> Engine::StripeLocations(const Version& v, int group, int stripe,
                                                     const SegmentKey* exclude) const {
  std::vector<const Segment*> segs;
  for (const Segment& seg : v.segments) {
    if (seg.key.group != group || seg.key.stripe != stripe) continue;
    if (exclude != nullptr && seg.key == *exclude) continue;
    if (!Usable(seg.state) || !IsUsable(seg.holder_node_id)) continue;
    segs.push_back(&seg);
  }
  // Position order (data before parity), SUSPECT holders last.
  std::stable_sort(segs.begin(), segs.end(), [&](const Segment* a, const Segment* b) {
    const bool sa = IsSuspect(a->holder_node_id), sb = IsSuspect(b->holder_node_id);
    if (sa != sb) return sb;
    return a->key.position < b->key.position;
  });
  std::vector<SegmentLocation> out;
  out.reserve(segs.size());
  for (const Segment* seg : segs) {
    out.push_back(SegmentLocation{seg->key, seg->kind, seg->length_bytes, seg->crc32c,
                                  EndpointOf(seg->holder_node_id)});
  }
  return out;
}

// ---------------------------------------------------------------------------
// MetaCore: inventory, Tick, status

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

absl::Status MetaCore::Tick() {
  return Write([&](Engine& e) -> absl::Status {
    Txn& txn = e.txn();
    const absl::Time mono = e.Mono();
    const int64_t now = e.NowMs();
    // Leases.
    std::vector<std::string> dead;
    for (auto& [id, n] : state_->nodes) {
      if (!e.IsUsable(id)) continue;
      if (mono >= n.lease_deadline) {
        dead.push_back(id);
      } else if (n.state == NodeState::kAlive &&
                 mono >= n.lease_deadline - options_.lease + 2 * options_.heartbeat_interval) {
        e.SetNodeState(n, NodeState::kSuspect).IgnoreError();  // transient: not persisted
      }
    }
    for (const std::string& id : dead) {
      Node& n = state_->nodes[id];
      e.SetNodeState(n, NodeState::kDead).IgnoreError();  // a refusal is logged by SetNodeState
      n.state_since_ms = now;
      ++n.failures;
      txn.Node(n);
      ++state_->counters.nodes_declared_dead_total;
      ++state_->membership_generation;
      log::Warn("node {} declared DEAD: lease expired (last heartbeat {} ms ago)", id,
                now - n.last_heartbeat_ms);
      e.NodeLost(id, "node died (lease expired)");
    }
    // Draining nodes that nothing depends on any more leave.
    for (auto& [id, n] : state_->nodes) {
      if (n.state != NodeState::kDraining) continue;
      bool needed = false;
      for (auto& [job_id, by_step] : state_->versions) {
        for (auto& [step, v] : by_step) {
          if (IsTerminal(v.state) || v.evicted) continue;
          if (v.state != VersionState::kProtected && v.state != VersionState::kPersisted) {
            for (const auto& [r, sh] : v.shards)
              for (const Copy& c : sh.copies)
                needed = needed || (c.node_id == id && c.state == CopyState::kValid);
            for (const Segment& seg : v.segments)
              needed = needed || (seg.holder_node_id == id && seg.state == CopyState::kValid);
          }
        }
      }
      if (!needed) {
        e.SetNodeState(n, NodeState::kLeft).IgnoreError();  // a refusal is logged by SetNodeState
        n.state_since_ms = now;
        txn.Node(n);
        ++state_->membership_generation;
        log::Info("node {} drained: now LEFT", id);
      }
    }
    // Tasks: retries and time-outs.
    for (auto& [id, t] : state_->tasks) {
      if (t.state == TaskState::kRetryWait && now >= t.retry_at_ms) {
        ++t.attempt;
        e.SetTaskState(t, TaskState::kPending).IgnoreError();  // a refusal is logged by SetTaskState
        t.last_progress = mono;
        txn.Task(t);
        ++state_->task_generation;
      } else if ((t.state == TaskState::kPending || t.state == TaskState::kRunning) &&
                 mono - t.last_progress >= absl::Milliseconds(t.timeout_ms)) {
        if (t.attempt >= static_cast<uint32_t>(Task::kMaxAttempts)) {
          e.SetTaskState(t, TaskState::kFailed).IgnoreError();  // logged if refused
          t.last_error = "timed out";
          ++state_->counters.tasks_failed_total;
        } else {
          ++t.attempt;
          e.SetTaskState(t, TaskState::kPending).IgnoreError();  // logged if refused
          t.last_progress = mono;
          ++state_->task_generation;
        }
        txn.Task(t);
      }
    }
    // Versions kept for a node that might bring its copies back: its grace
    // is over (AwaitLostCopies aborts them now, unless a later loss extends
    // the wait).
    std::vector<std::pair<std::string, uint64_t>> due;
    for (const auto& [key, deadline] : state_->awaiting_return) {
      if (now >= deadline) due.push_back(key);
    }
    for (const auto& [job_id, step] : due) {
      state_->awaiting_return.erase({job_id, step});
      auto v = e.FindVersion(job_id, step);
      if (v.ok()) e.Recompute(**v);
    }
    // OPEN versions that stopped progressing (a rank died while saving, and
    // no newer version was staged to supersede them) end, so they hold no
    // memory and no trainer waits on them for ever.
    if (options_.open_version_timeout > absl::ZeroDuration()) {
      std::vector<std::pair<std::string, uint64_t>> stalled;
      for (const auto& [key, since] : state_->open_progress) {
        if (mono - since >= options_.open_version_timeout) stalled.push_back(key);
      }
      for (const auto& [job_id, step] : stalled) {
        auto v = e.FindVersion(job_id, step);
        if (!v.ok() || (*v)->state != VersionState::kOpen) {
          state_->open_progress.erase({job_id, step});
          continue;
        }
        e.AbortOpenVersion(**v, absl::StrCat("no progress for ",
                                             absl::FormatDuration(options_.open_version_timeout),
                                             " with ", StagedRanksText(**v),
                                             " (did a rank die while saving?)"));
      }
    }
    // Jobs being deleted whose clean-up finished disappear.
    std::vector<std::string> gone;
    for (auto& [job_id, job] : state_->jobs) {
      if (!job.deleting) continue;
      bool busy = false;
      for (auto& [step, v] : state_->versions[job_id]) {
        busy = busy || !ActiveTasksEmpty(e, v);
      }
      if (!busy) gone.push_back(job_id);
    }
    for (const std::string& job_id : gone) {
      for (auto& [step, v] : state_->versions[job_id]) {
        txn.Delete(records::VersionKey(job_id, step));
        txn.Delete(records::SegmentsKey(job_id, step));
        for (const auto& [rank, sh] : v.shards) txn.Delete(records::ShardKey(job_id, step, rank));
      }
      state_->versions.erase(job_id);
      state_->jobs.erase(job_id);
      state_->last_plan_nodes.erase(job_id);
      txn.DeleteJob(job_id);
      log::Info("job {} removed", job_id);
    }
    return absl::OkStatus();
  });
}

bool MetaCore::ActiveTasksEmpty(Engine& e, const Version& v) {
  for (TaskKind k : {TaskKind::kEvict, TaskKind::kDeleteDurable}) {
    if (!e.ActiveTasks(v.job_id, v.step, k).empty()) return false;
  }
  return true;
}

void MetaCore::FailureStatsLocked(const std::string& job_id, ClusterStatusView* out) const {
  const int64_t now = clock_->NowUnixMillis();
  uint32_t alive = 0;
  for (const auto& [id, n] : state_->nodes) {
    const int64_t since = n.first_seen_ms != 0 ? n.first_seen_ms : n.registered_ms;
    const int64_t until = n.state == NodeState::kLeft ? n.state_since_ms : now;
    out->observed_node_ms += std::max<int64_t>(0, until - since);
    out->failures += n.failures;
    if (NodeIsUsable(n.state)) ++alive;
  }
  out->mtbf_is_lower_bound = out->failures == 0;
  out->node_mtbf_ms = out->observed_node_ms / static_cast<int64_t>(std::max<uint64_t>(out->failures, 1));
  if (job_id.empty()) return;
  std::set<std::string> nodes;  // holding the newest version's shards
  if (auto it = state_->versions.find(job_id); it != state_->versions.end()) {
    for (auto v = it->second.rbegin(); v != it->second.rend() && nodes.empty(); ++v) {
      for (const auto& [rank, shard] : v->second.shards) nodes.insert(shard.primary_node_id);
    }
  }
  out->job_nodes = nodes.empty() ? alive : static_cast<uint32_t>(nodes.size());
  out->job_mtbf_ms = out->node_mtbf_ms / std::max<uint32_t>(out->job_nodes, 1);
}

absl::StatusOr<ClusterStatusView> MetaCore::ClusterStatus(bool include_nodes, uint32_t max_problems,
                                                         const std::string& job_id) const {
  return Read([&](Engine& e) -> absl::StatusOr<ClusterStatusView> {
    return ClusterStatusLocked(include_nodes, max_problems, job_id);
  });
}

ClusterStatusView MetaCore::ClusterStatusLocked(bool include_nodes, uint32_t max_problems,
                                                const std::string& job_id) const {
  ClusterStatusView out;
  out.meta_instance_id = instance_id_;
  out.meta_start_ms = start_ms_;
  out.meta_version = options_.version;
  FailureStatsLocked(job_id, &out);
  std::vector<Problem> problems;
  std::map<std::string, uint32_t> pending;
  for (const auto& [id, t] : state_->tasks) {
    if (Engine::Active(t)) ++pending[t.node_id];
  }
  for (const auto& [id, n] : state_->nodes) {
    ++out.nodes_by_state[n.state];
    if (include_nodes) {
      out.nodes.push_back(n);
      out.nodes.back().pending_tasks = pending[id];
    }
    if (NodeIsUsable(n.state)) {
      out.memory_capacity_bytes += n.memory_capacity_bytes;
      out.memory_used_bytes += n.memory_used_bytes;
      out.memory_free_bytes += n.memory_free_bytes;
      out.flush_lag_bytes += n.flush_lag_bytes;
      out.flush_lag_ms = std::max(out.flush_lag_ms, n.flush_lag_ms);
      if (n.memory_capacity_bytes > 0 && n.memory_free_bytes * 10 < n.memory_capacity_bytes) {
        problems.push_back({Problem::Kind::kMemoryLow, false,
                            absl::StrCat("node ", id, " memory tier is ",
                                         100 - n.memory_free_bytes * 100 /
                                                   n.memory_capacity_bytes,
                                         "% full"),
                            id, "", std::nullopt, n.last_heartbeat_ms});
      }
      if (n.flush_errors_total > 0) {
        problems.push_back({Problem::Kind::kFlushFailing, false,
                            absl::StrCat("node ", id, " had ", n.flush_errors_total,
                                         " durable-tier write errors"),
                            id, "", std::nullopt, n.last_heartbeat_ms});
      }
    }
    if (n.state == NodeState::kDead) {
      problems.push_back({Problem::Kind::kNodeDead, true,
                          absl::StrCat("node ", id, " is dead (lease expired)"), id, "",
                          std::nullopt, n.state_since_ms});
    } else if (n.state == NodeState::kSuspect) {
      problems.push_back({Problem::Kind::kNodeSuspect, false,
                          absl::StrCat("node ", id, " is missing heartbeats"), id, "",
                          std::nullopt, n.last_heartbeat_ms});
    }
  }
  for (const auto& [node, list] : state_->unknown) {
    for (const auto& u : list) {
      problems.push_back({Problem::Kind::kUnknownData, false,
                          absl::StrCat("node ", node, " holds data of unknown ", u.holding.job_id,
                                       "/", u.holding.step),
                          node, u.holding.job_id, u.holding.step, u.since_ms});
    }
  }
  out.jobs = static_cast<uint32_t>(state_->jobs.size());
  Txn unused;
  Engine e(*state_, clock_, options_, unused);
  for (const auto& [job_id, job] : state_->jobs) {
    if (job.spec.protection.kind != ProtectionPolicy::Kind::kNone &&
        !PlanPlacement(e.AliveNodes(), job.spec.protection).ok()) {
      problems.push_back({Problem::Kind::kPlacementImpossible, true,
                          absl::StrCat("job ", job_id, ": not enough alive nodes for ",
                                       job.spec.protection.ToString()),
                          "", job_id, std::nullopt, clock_->NowUnixMillis()});
    }
  }
  for (const auto& [job_id, by_step] : state_->versions) {
    for (const auto& [step, v] : by_step) {
      if (v.state != VersionState::kDeleted) ++out.versions_by_state[v.state];
      if (v.state == VersionState::kDegraded) {
        problems.push_back({Problem::Kind::kVersionDegraded, false,
                            absl::StrCat("version ", job_id, "/", step,
                                         " lost redundancy and is being re-protected"),
                            "", job_id, step, v.protected_ms});
      } else if (v.state == VersionState::kAborted &&
                 v.abort_reason.find("lost") != std::string::npos) {
        problems.push_back({Problem::Kind::kVersionLost, true,
                            absl::StrCat("version ", job_id, "/", step, ": ", v.abort_reason), "",
                            job_id, step, v.ended_ms});
      }
      if (IsTerminal(v.state)) continue;
      for (const auto& [rank, sh] : v.shards) {
        for (const Copy& c : sh.copies) {
          if (c.state == CopyState::kCorrupt) {
            problems.push_back({Problem::Kind::kCorruptCopy, true,
                                absl::StrCat("copy of ", job_id, "/", step, " rank ", rank,
                                             " on node ", c.node_id, " is corrupt: ", c.detail),
                                c.node_id, job_id, step, c.updated_ms});
          }
        }
      }
    }
  }
  for (const auto& [id, t] : state_->tasks) {
    switch (t.state) {
      case TaskState::kPending: ++out.tasks_pending; break;
      case TaskState::kRunning: ++out.tasks_running; break;
      case TaskState::kRetryWait: ++out.tasks_retrying; break;
      default: break;
    }
    if ((t.state == TaskState::kFailed && t.created_ms > 0) ||
        (e.Active(t) && t.attempt >= 3)) {
      if (t.state == TaskState::kFailed && t.kind == TaskKind::kDrop) continue;
      problems.push_back({Problem::Kind::kTaskFailing, t.state == TaskState::kFailed,
                          absl::StrCat("task ", id, " (", TaskKindName(t.kind), " ", t.job_id,
                                       "/", t.step, ") on node ", t.node_id, " ",
                                       TaskStateName(t.state), " after ", t.attempt,
                                       " attempts: ", t.last_error),
                          t.node_id, t.job_id, t.step, t.created_ms});
    }
  }
  std::stable_sort(problems.begin(), problems.end(), [](const Problem& a, const Problem& b) {
    if (a.error != b.error) return a.error;
    return a.since_ms < b.since_ms;
  });
  out.problems_total = static_cast<uint32_t>(problems.size());
  const uint32_t limit = max_problems == 0 ? 100 : max_problems;
  if (problems.size() > limit) problems.resize(limit);
  out.problems = std::move(problems);
  return out;
}

}  // namespace ckpt::meta
