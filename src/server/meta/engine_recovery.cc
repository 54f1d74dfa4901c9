// Engine, recovery: protecting a version as its policy says (replicas, EC
// layout and encodes) and restoring that protection after losses
// (replicate and rebuild tasks, encodes started again).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "ec/layout.h"
#include "server/meta/core_state.h"

namespace ckpt::meta {

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

void Engine::TakeInShardsOutsideTheGroups(Version& v) {
  std::vector<uint32_t> outside;
  for (const auto& [rank, sh] : v.shards)
    if (!InStripes(v, sh)) outside.push_back(rank);
  if (outside.empty()) return;
  auto job = s_.jobs.find(v.job_id);
  if (job == s_.jobs.end()) return;
  absl::StatusOr<VersionPlan> plan = CurrentPlan(job->second);
  std::string why;
  if (!plan.ok()) {
    why = plan.status().ToString();
  } else if (plan->policy.kind != v.plan.policy.kind || plan->policy.data_k != v.plan.policy.data_k ||
             plan->policy.parity_m != v.plan.policy.parity_m) {
    why = "the job's protection changed since the version began";
  } else {
    VersionPlan old = std::move(v.plan);
    v.plan = *std::move(plan);
    std::vector<uint32_t> still;
    for (uint32_t rank : outside)
      if (!InStripes(v, v.shards.at(rank))) still.push_back(rank);
    if (still.empty()) {
      log::Info("version {}/{}: rank(s) {} were staged on nodes the plan of its begin left out; the "
                "EC groups are planned again over the {} nodes that count now",
                v.job_id, v.step, absl::StrJoin(outside, ","), v.plan.nodes.size());
      txn_.Header(v);
      return;
    }
    v.plan = std::move(old);
    why = absl::StrCat("rank(s) ", absl::StrJoin(still, ","), " are on nodes that do not count for protection");
  }
  log::Warn("version {}/{}: rank(s) {} are on nodes outside every EC group ({}); they are protected by "
            "{} whole copies each instead of stripes", v.job_id, v.step, absl::StrJoin(outside, ","), why,
            ReplicasOutsideStripes(v));
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

bool Engine::InStripes(const Version& v, const Shard& sh) const {
  for (const EcGroup& g : v.plan.groups)
    if (std::find(g.members.begin(), g.members.end(), sh.primary_node_id) != g.members.end()) return true;
  return false;
}

int Engine::ReplicasOutsideStripes(const Version& v) { return 1 + v.plan.policy.parity_m; }

void Engine::PlanRecovery(Version& v) {
  if (IsTerminal(v.state) || v.evicted) return;
  const ProtectionPolicy& policy = v.plan.policy;
  if (policy.kind == ProtectionPolicy::Kind::kReplicate) {
    PlanReplicas(v, policy.copies, [](const Shard&) { return true; });
  } else if (policy.kind == ProtectionPolicy::Kind::kErasureCode && !v.segments.empty()) {
    // A shard on a node outside every group (the version was planned while
    // its node was away, and a re-plan could not take it in) is in no
    // stripe: as many whole copies as a stripe survives losses protect it.
    PlanReplicas(v, ReplicasOutsideStripes(v), [&](const Shard& sh) { return !InStripes(v, sh); });
    PlanRebuilds(v);
  }
}

void Engine::PlanReplicas(Version& v, int copies, const std::function<bool(const Shard&)>& wanted) {
  // Targets already planned by active replicate tasks, per rank.
  std::map<uint32_t, std::set<std::string>> pending;
  for (Task* t : ActiveTasks(v.job_id, v.step, TaskKind::kReplicate)) {
    for (uint32_t r : t->ranks)
      for (const auto& target : t->targets) pending[r].insert(target);
  }
  // (source, targets) -> ranks
  std::map<std::pair<std::string, std::vector<std::string>>, std::vector<uint32_t>> plan;
  for (auto& [rank, sh] : v.shards) {
    if (!wanted(sh)) continue;
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
    int need = copies - protective - static_cast<int>(pending[rank].size());
    if (need <= 0) continue;
    // Not to a target the source failed to push to for good, for a while
    // (ProtectionTaskFailed); the version waits for the retry if nothing
    // else can take the copy.
    std::set<std::string> exclude = holders;
    for (const auto& [node, n] : s_.nodes)
      if (PushHeldOff(source, node)) exclude.insert(node);
    std::vector<std::string> targets;
    for (const auto& id : ReplicaCandidates(*this, v, sh, exclude)) {
      if (static_cast<int>(targets.size()) >= need) break;
      targets.push_back(id);
    }
    if (static_cast<int>(targets.size()) < need) {
      for (auto& [key, held] : s_.held_off_pushes)
        if (key.first == source && NowMs() < held.until_ms) held.versions.insert({v.job_id, v.step});
    }
    if (targets.empty()) continue;  // waits for a node to join, or the retry
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
}

void Engine::ReleaseSurplusReplicas(Version& v) {
  const ProtectionPolicy& policy = v.plan.policy;
  if (policy.kind != ProtectionPolicy::Kind::kReplicate || v.evicted ||
      (v.state != VersionState::kProtected && v.state != VersionState::kPersisted)) {
    return;
  }
  // Not while copies are pushed or flushed (a flush may read the replica).
  if (!ActiveTasks(v.job_id, v.step, TaskKind::kReplicate).empty() ||
      !ActiveTasks(v.job_id, v.step, TaskKind::kFlush).empty()) {
    return;
  }
  for (auto& [rank, sh] : v.shards) {
    std::vector<const Copy*> counted;
    bool suspect = false;
    for (const Copy& c : sh.copies) {
      if (c.state != CopyState::kValid || c.role == CopyRole::kRestored || !CountsForProtection(c.node_id)) continue;
      suspect = suspect || IsSuspect(c.node_id);
      counted.push_back(&c);
    }
    if (suspect || static_cast<int>(counted.size()) <= policy.copies) continue;
    // Kept: the primary, then one replica at a time, best placed first.
    std::set<std::string> keep, domains;
    auto domain_of = [&](const std::string& id) {
      auto n = s_.nodes.find(id);
      return n == s_.nodes.end() ? id : PlacementDomain(s_.nodes, id, n->second);
    };
    for (const Copy* c : counted) {
      if (c->role == CopyRole::kPrimary && keep.empty()) {
        keep.insert(c->node_id);
        domains.insert(domain_of(c->node_id));
      }
    }
    std::vector<std::string> planned;
    if (auto it = v.plan.protectors.find(sh.primary_node_id); it != v.plan.protectors.end()) planned = it->second;
    while (static_cast<int>(keep.size()) < policy.copies) {
      const Copy* best = nullptr;
      auto score = [&](const Copy* c) {
        const bool new_domain = domains.count(domain_of(c->node_id)) == 0;
        const bool in_plan = std::find(planned.begin(), planned.end(), c->node_id) != planned.end();
        return std::make_tuple(new_domain, in_plan, -c->updated_ms);
      };
      for (const Copy* c : counted) {
        if (keep.count(c->node_id) != 0) continue;
        if (best == nullptr || score(c) > score(best) ||
            (score(c) == score(best) && c->node_id < best->node_id)) {
          best = c;
        }
      }
      if (best == nullptr) break;
      keep.insert(best->node_id);
      domains.insert(domain_of(best->node_id));
    }
    std::vector<std::string> released;
    for (const Copy* c : counted) {
      if (keep.count(c->node_id) != 0 || c->role != CopyRole::kReplica) continue;
      Holding h;
      h.job_id = v.job_id;
      h.step = v.step;
      h.rank = rank;
      h.role = CopyRole::kReplica;
      h.size_bytes = sh.size_bytes;
      h.crc32c = sh.crc32c;
      h.manifest_digest = sh.manifest_digest;
      Task& t = NewTask(c->node_id, TaskKind::kDrop, "", 0, 0);
      t.drop = {h};
      t.reason = absl::StrCat("surplus copy: rank ", rank, " of ", v.job_id, "/", v.step, " has ", counted.size(),
                              " copies, the policy keeps ", policy.copies);
      txn_.Task(t);
      released.push_back(c->node_id);
    }
    if (released.empty()) continue;
    std::erase_if(sh.copies, [&](const Copy& c) {
      return c.role == CopyRole::kReplica && c.state == CopyState::kValid &&
             std::find(released.begin(), released.end(), c.node_id) != released.end();
    });
    txn_.ShardRecord(v, rank);
    log::Info("version {}/{} rank {}: released the surplus copies on {} ({} copies counted, policy {}; kept {})",
              v.job_id, v.step, rank, absl::StrJoin(released, ", "), counted.size(), policy.copies,
              absl::StrJoin(keep, ", "));
  }
}

void Engine::PlanRebuilds(Version& v) {
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

void Engine::ProtectionTaskFailed(const Task& t) {
  if (t.kind != TaskKind::kReplicate && t.kind != TaskKind::kEcEncode) return;
  const int64_t until = NowMs() + absl::ToInt64Milliseconds(options_.push_retry_backoff);
  std::vector<std::string> targets = t.targets;
  if (t.kind == TaskKind::kEcEncode) targets = {""};
  for (const std::string& target : targets) {
    auto& held = s_.held_off_pushes[{t.node_id, target}];
    held.until_ms = until;
    held.versions.insert({t.job_id, t.step});
    held.error = t.last_error;
  }
  log::Warn("task {} ({} {}/{}) failed for good: no push from node {} to {} for {}; the copy goes "
            "to another node if one can take it, else that target is tried again then",
            t.id, TaskKindName(t.kind), t.job_id, t.step, t.node_id,
            t.kind == TaskKind::kEcEncode ? std::string("its group") : absl::StrJoin(t.targets, ","),
            absl::FormatDuration(options_.push_retry_backoff));
  auto v = FindVersion(t.job_id, t.step);
  if (v.ok()) Recompute(**v);
}

bool Engine::PushHeldOff(const std::string& source, const std::string& target) const {
  auto it = s_.held_off_pushes.find({source, target});
  return it != s_.held_off_pushes.end() && clock_->NowUnixMillis() < it->second.until_ms;
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

bool Engine::HasUnbuiltStripe(const Version& v, const EcGroup& g) const {
  std::map<int, int> readable;  // stripe -> usable segments on usable nodes
  std::set<int> unpushed;       // stripes with a data segment not VALID
  for (const Segment& seg : v.segments) {
    if (seg.key.group != g.index) continue;
    if (Usable(seg.state) && IsUsable(seg.holder_node_id)) ++readable[seg.key.stripe];
    if (seg.kind == SegmentKind::kData && seg.state != CopyState::kValid && seg.length_bytes > 0) {
      unpushed.insert(seg.key.stripe);
    }
  }
  for (int stripe : unpushed)
    if (readable[stripe] < g.data_k) return true;
  return false;
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
        // A stripe never built: a data segment of it not VALID (never
        // pushed, or LOST with a member that died mid-encode and came back
        // with its shard) and too few readable segments to rebuild it from.
        if (!HasUnbuiltStripe(v, g)) continue;
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

}  // namespace ckpt::meta
