#include "server/meta/meta_core.h"

#include <pthread.h>

#include <algorithm>
#include <random>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/manifest.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "server/meta/core_state.h"
#include "server/meta/transitions.h"

namespace ckpt::meta {

// ---------------------------------------------------------------------------
// Txn

uint64_t Txn::Submit(MetaStore* store,
                     const std::map<std::string, std::map<uint64_t, Version>>& versions) {
  auto find = [&](const std::pair<std::string, uint64_t>& k) -> const Version* {
    auto j = versions.find(k.first);
    if (j == versions.end()) return nullptr;
    auto v = j->second.find(k.second);
    return v == j->second.end() ? nullptr : &v->second;
  };
  for (const auto& k : headers_) {
    if (const Version* v = find(k)) {
      batch_.Put(records::VersionKey(k.first, k.second), records::EncodeVersionHeader(*v));
    }
  }
  for (const auto& [k, rank] : shards_) {
    const Version* v = find(k);
    if (v == nullptr) continue;
    auto it = v->shards.find(rank);
    if (it != v->shards.end()) {
      batch_.Put(records::ShardKey(k.first, k.second, rank), records::EncodeShard(it->second));
    }
  }
  for (const auto& k : segments_) {
    if (const Version* v = find(k)) {
      batch_.Put(records::SegmentsKey(k.first, k.second), records::EncodeSegments(*v));
    }
  }
  if (batch_.empty()) return 0;
  // The caller waited for room before taking its lock (MetaCore::Apply).
  return store->SubmitNoWait(std::move(batch_));
}

// ---------------------------------------------------------------------------
// Engine: lookups, plans, tasks

absl::StatusOr<Job*> Engine::FindJob(const std::string& job_id) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job_id));
  auto it = s_.jobs.find(job_id);
  if (it == s_.jobs.end()) {
    return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" does not exist"));
  }
  return &it->second;
}

absl::StatusOr<Version*> Engine::FindVersion(const std::string& job_id, uint64_t step) {
  CKPT_RETURN_IF_ERROR(ValidateStep(step));
  CKPT_RETURN_IF_ERROR(FindJob(job_id).status());
  auto& by_step = s_.versions[job_id];
  auto it = by_step.find(step);
  if (it == by_step.end()) {
    std::string why;
    if (const Version* newer = NewestReadableAbove(job_id, step)) {
      // The usual reason a trainer waits for a step that never appears: its
      // agent's BeginVersion was refused.
      why = absl::StrCat("; a save of step ", step,
                         " is refused because the job's newest version is step ", newer->step,
                         " (", VersionStateName(newer->state),
                         ") and steps must increase (delete the newer versions to rewind)");
    }
    return absl::NotFoundError(
        absl::StrCat("job \"", job_id, "\" has no version at step ", step, why));
  }
  return &it->second;
}

const Version* Engine::NewestReadableAbove(const std::string& job_id, uint64_t step) const {
  auto j = s_.versions.find(job_id);
  if (j == s_.versions.end()) return nullptr;
  for (auto r = j->second.rbegin(); r != j->second.rend() && r->first > step; ++r) {
    const Version& v = r->second;
    if (!IsTerminal(v.state) && v.state != VersionState::kOpen) return &v;
  }
  return nullptr;
}

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

absl::Status Engine::SetTaskState(Task& t, TaskState to) {
  absl::Status st = Transition(&t.state, to);
  if (!st.ok()) log::Error("task {} ({} {}/{}): {}", t.id, TaskKindName(t.kind), t.job_id, t.step, std::string(st.message()));
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

bool Engine::DeleteDurable(const Version& v) {
  const std::string node = AnyUsableNode();
  if (node.empty()) return false;
  Task& t = NewTask(node, TaskKind::kDeleteDurable, v.job_id, v.step, 0);
  txn_.Task(t);
  return true;
}

std::vector<PlannerNode> Engine::AliveNodes() const {
  std::vector<PlannerNode> out;
  for (const auto& [id, n] : s_.nodes) {
    if (NodeCountsForProtection(n.state)) {
      out.push_back({id, PlacementDomain(s_.nodes, id, n)});
    }
  }
  return out;
}

absl::StatusOr<VersionPlan> PlanToVersionPlan(const PlacementPlan& plan) {
  VersionPlan vp;
  vp.policy = plan.policy();
  for (const auto& n : plan.nodes()) vp.nodes.push_back(n.id);
  if (plan.policy().kind == ProtectionPolicy::Kind::kReplicate) {
    for (int i = 0; i < plan.size(); ++i) {
      std::vector<std::string> targets;
      for (int p : plan.Protectors(i)) targets.push_back(vp.nodes[p]);
      vp.protectors[vp.nodes[i]] = std::move(targets);
    }
  } else if (plan.policy().kind == ProtectionPolicy::Kind::kErasureCode) {
    for (const PlacementGroup& g : plan.groups()) {
      EcGroup eg;
      eg.index = g.index;
      eg.data_k = plan.policy().data_k;
      eg.parity_m = plan.policy().parity_m;
      for (int j = 0; j < g.size; ++j) eg.members.push_back(vp.nodes[g.first + j]);
      vp.groups.push_back(std::move(eg));
    }
  }
  return vp;
}

absl::StatusOr<VersionPlan> Engine::CurrentPlan(Job& job) {
  const std::vector<PlannerNode> alive = AliveNodes();
  CKPT_ASSIGN_OR_RETURN(PlacementPlan plan, PlanPlacement(alive, job.spec.protection));
  CKPT_ASSIGN_OR_RETURN(VersionPlan vp, PlanToVersionPlan(plan));
  auto& last = s_.last_plan_nodes[job.spec.job_id];
  if (last != vp.nodes || job.plan_epoch == 0) {
    last = vp.nodes;
    ++job.plan_epoch;
    txn_.Job(job);
  }
  vp.epoch = job.plan_epoch;
  return vp;
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

// ---------------------------------------------------------------------------
// MetaCore

Version Summary(const Version& v) {
  Version copy = v;
  for (auto& [rank, sh] : copy.shards) {
    sh.items.clear();
    sh.copies.clear();
  }
  copy.segments.clear();
  copy.blobs.clear();
  return copy;
}

namespace {
uint64_t RandomInstanceId() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ 1;
}

absl::Status ValidateWorldSize(uint32_t world_size) {
  if (world_size == 0 || world_size > JobSpec::kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "world size ", world_size, " is invalid: it must be 1..", JobSpec::kMaxWorldSize,
        " (the number of ranks that save a shard per version)"));
  }
  return absl::OkStatus();
}

// Checks what the request states; whether a job can be created from it is
// checked when it is (a world size is then required).
absl::Status ValidateRequest(const JobRequest& req) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(req.job_id));
  if (req.world_size != 0) CKPT_RETURN_IF_ERROR(ValidateWorldSize(req.world_size));
  if (req.protection.has_value()) CKPT_RETURN_IF_ERROR(req.protection->Validate());
  if (req.labels.size() > 32) {
    return absl::InvalidArgumentError("a job may carry at most 32 labels");
  }
  for (const auto& [k, v] : req.labels) {
    if (k.empty() || k.size() > 256 || v.size() > 256) {
      return absl::InvalidArgumentError(
          "label keys must be 1..256 bytes and values at most 256 bytes");
    }
  }
  return absl::OkStatus();
}

// Policies equal in the fields their kind uses.
bool SamePolicy(const ProtectionPolicy& a, const ProtectionPolicy& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case ProtectionPolicy::Kind::kReplicate:
      return a.copies == b.copies && a.placement == b.placement;
    case ProtectionPolicy::Kind::kErasureCode:
      return a.data_k == b.data_k && a.parity_m == b.parity_m;
    case ProtectionPolicy::Kind::kNone:
      break;
  }
  return true;
}

std::string FlushString(const FlushPolicy& f) {
  if (f.every_n_versions == 0 && f.every_seconds == 0) return "never";
  std::vector<std::string> rules;
  if (f.every_n_versions != 0) {
    rules.push_back(absl::StrCat("every ", f.every_n_versions, " versions"));
  }
  if (f.every_seconds != 0) rules.push_back(absl::StrCat("every ", f.every_seconds, " s"));
  return absl::StrJoin(rules, " or ");
}

std::string RetentionString(const RetentionPolicy& r) {
  return absl::StrCat("keep_in_memory ", r.EffectiveKeepInMemory(), ", keep_durable ",
                      r.keep_durable == 0 ? std::string("all") : absl::StrCat(r.keep_durable));
}

// The stated parts of `asked` that differ from `stored`, each with both
// values; empty when the job can be opened.
std::string DiffSpecs(const JobSpec& stored, const JobRequest& asked) {
  std::vector<std::string> diffs;
  if (asked.world_size != 0 && stored.world_size != asked.world_size)
    diffs.push_back(absl::StrCat("world_size (stored ", stored.world_size, ", asked ",
                                 asked.world_size, ")"));
  if (asked.protection.has_value() && !SamePolicy(stored.protection, *asked.protection))
    diffs.push_back(absl::StrCat("protection (stored ", stored.protection.ToString(), ", asked ",
                                 asked.protection->ToString(), ")"));
  if (asked.flush.has_value() &&
      (stored.flush.every_n_versions != asked.flush->every_n_versions ||
       stored.flush.every_seconds != asked.flush->every_seconds))
    diffs.push_back(absl::StrCat("flush (stored ", FlushString(stored.flush), ", asked ",
                                 FlushString(*asked.flush), ")"));
  if (asked.retention.has_value() &&
      (stored.retention.EffectiveKeepInMemory() != asked.retention->EffectiveKeepInMemory() ||
       stored.retention.keep_durable != asked.retention->keep_durable))
    diffs.push_back(absl::StrCat("retention (stored ", RetentionString(stored.retention),
                                 ", asked ", RetentionString(*asked.retention), ")"));
  return absl::StrJoin(diffs, ", ");
}
}  // namespace

MetaCore::MetaCore(MetaStore* store, Clock* clock, MetaOptions options)
    : store_(store),
      clock_(clock),
      options_(std::move(options)),
      instance_id_(RandomInstanceId()),
      start_ms_(clock->NowUnixMillis()),
      state_(std::make_unique<State>()) {}

MetaCore::~MetaCore() { Stop(); }

void MetaCore::Stop() {
  {
    absl::MutexLock lock(&durable_mu_);
    durable_stopping_ = true;
  }
  if (durable_thread_.joinable()) durable_thread_.join();
}

void MetaCore::WhenDurable(uint64_t seq, std::function<void(absl::Status)> done) {
  if (seq == 0) {
    done(absl::OkStatus());
    return;
  }
  {
    absl::MutexLock lock(&durable_mu_);
    if (!durable_stopping_) {
      durable_queue_.emplace_back(seq, std::move(done));
      return;
    }
  }
  done(store_->AwaitDurable(seq));  // after Stop(): nobody else would call it
}

uint64_t MetaCore::SubmitLocked(Txn& txn) {
  const uint64_t seq = txn.Submit(store_, state_->versions);
  if (seq != 0) state_->last_seq = seq;
  return state_->last_seq;
}

uint64_t MetaCore::VisibleSeqLocked() const { return state_->last_seq; }

void MetaCore::DurableLoop() {
  // Linux limits thread names to 15 bytes.
  pthread_setname_np(pthread_self(), "ckpt-meta-dur");
  std::deque<std::pair<uint64_t, std::function<void(absl::Status)>>> batch;
  for (;;) {
    {
      absl::MutexLock lock(&durable_mu_);
      durable_mu_.Await(absl::Condition(
          +[](MetaCore* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->durable_mu_) {
            return c->durable_stopping_ || !c->durable_queue_.empty();
          },
          this));
      if (durable_queue_.empty()) return;  // stopping, and everything completed
      batch.swap(durable_queue_);
    }
    // Durability is ordered: after the first wait, later sequences of the
    // same group commit return at once.
    for (auto& [seq, done] : batch) done(store_->AwaitDurable(seq));
    batch.clear();
  }
}

absl::StatusOr<std::unique_ptr<MetaCore>> MetaCore::Open(MetaStore* store, Clock* clock,
                                                         MetaOptions options) {
  std::unique_ptr<MetaCore> core(new MetaCore(store, clock, std::move(options)));
  absl::MutexLock lock(&core->mu_);
  State& s = *core->state_;
  absl::Status err;
  auto scan = [&](std::string_view prefix, auto fn) -> absl::Status {
    absl::Status st = store->Scan(prefix, [&](std::string_view k, std::string_view v) {
      err = fn(k, v);
      return err.ok();
    });
    return st.ok() ? err : st;
  };
  const absl::Time mono = clock->MonotonicNow();
  CKPT_RETURN_IF_ERROR(scan(records::kNodePrefix, [&](std::string_view k, std::string_view v) {
    CKPT_ASSIGN_OR_RETURN(Node n, records::DecodeNode(k, v));
    n.lease_deadline = mono + core->options_.lease;
    n.inventory_received = false;
    s.nodes[n.id] = std::move(n);
    return absl::OkStatus();
  }));
  CKPT_RETURN_IF_ERROR(scan(records::kJobPrefix, [&](std::string_view k, std::string_view v) {
    CKPT_ASSIGN_OR_RETURN(Job j, records::DecodeJob(k, v));
    s.jobs[j.spec.job_id] = std::move(j);
    return absl::OkStatus();
  }));
  CKPT_RETURN_IF_ERROR(
      scan(records::kAllVersionsPrefix, [&](std::string_view k, std::string_view v) {
        CKPT_ASSIGN_OR_RETURN(Version ver, records::DecodeVersionHeader(k, v));
        s.versions[ver.job_id][ver.step] = std::move(ver);
        return absl::OkStatus();
      }));
  auto version_of = [&](const std::string& job, uint64_t step) -> Version* {
    auto j = s.versions.find(job);
    if (j == s.versions.end()) return nullptr;
    auto it = j->second.find(step);
    return it == j->second.end() ? nullptr : &it->second;
  };
  CKPT_RETURN_IF_ERROR(
      scan(records::kAllShardsPrefix, [&](std::string_view k, std::string_view v) {
        // s/<job>/<step>/<rank>
        const std::string key(k);
        const size_t a = key.find('/', 2), b = key.rfind('/');
        Version* ver = version_of(key.substr(2, a - 2), std::stoull(key.substr(a + 1, b - a - 1)));
        if (ver == nullptr) return absl::OkStatus();  // orphan of a removed version
        CKPT_ASSIGN_OR_RETURN(Shard sh, records::DecodeShard(k, v));
        ver->shards[sh.rank] = std::move(sh);
        return absl::OkStatus();
      }));
  CKPT_RETURN_IF_ERROR(
      scan(records::kAllSegmentsPrefix, [&](std::string_view k, std::string_view v) {
        const std::string key(k);
        const size_t a = key.rfind('/');
        Version* ver = version_of(key.substr(2, a - 2), std::stoull(key.substr(a + 1)));
        if (ver == nullptr) return absl::OkStatus();
        return records::DecodeSegments(k, v, ver);
      }));
  CKPT_RETURN_IF_ERROR(scan(records::kTaskPrefix, [&](std::string_view k, std::string_view v) {
    CKPT_ASSIGN_OR_RETURN(Task t, records::DecodeTask(k, v));
    t.last_progress = mono;
    if (t.state == TaskState::kRunning) {
      CKPT_RETURN_IF_ERROR(Transition(&t.state, TaskState::kPending));  // re-deliver
    }
    s.tasks_by_version[{t.job_id, t.step}].insert(t.id);
    s.tasks[t.id] = std::move(t);
    return absl::OkStatus();
  }));
  for (const auto& [job_id, by_step] : s.versions) {
    for (const auto& [step, v] : by_step) {
      if (v.state == VersionState::kOpen) s.open_progress[{job_id, step}] = mono;
      // A version kept for a dead node's copies before the restart: Tick
      // decides once their grace is over, even if nothing else touches it.
      if (IsTerminal(v.state)) continue;
      int64_t lost_ms = 0;
      for (const auto& [rank, sh] : v.shards)
        for (const Copy& c : sh.copies)
          if (c.state == CopyState::kLost) lost_ms = std::max(lost_ms, c.updated_ms);
      for (const Segment& seg : v.segments)
        if (seg.state == CopyState::kLost) lost_ms = std::max(lost_ms, seg.updated_ms);
      if (lost_ms != 0) {
        s.awaiting_return[{job_id, step}] =
            lost_ms + absl::ToInt64Milliseconds(core->options_.lost_copy_grace);
      }
    }
  }
  auto next = store->Get(records::kNextTaskIdKey);
  if (next.ok()) {
    s.next_task_id = std::stoull(*next);
  } else if (!absl::IsNotFound(next.status())) {
    return next.status();
  }
  log::Info("meta state loaded: {} nodes, {} jobs, {} tasks", s.nodes.size(), s.jobs.size(),
            s.tasks.size());
  s.membership_generation = core->instance_id_ | 1;
  MetaCore* const c = core.get();
  core->durable_thread_ = std::thread([c] { c->DurableLoop(); });
  return core;
}

// ---- Nodes ------------------------------------------------------------------

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
      if (live && (old.grpc_address != req.grpc_address || old.data_address != req.data_address)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "node id \"", req.node_id, "\" is held by a live node at ", old.grpc_address,
            " (data ", old.data_address, ") whose lease expires in ",
            absl::FormatDuration(old.lease_deadline - mono),
            "; use another node id or stop that agent"));
      }
      incarnation = old.incarnation + 1;
      was_dead = !NodeIsUsable(old.state);  // DEAD or LEFT
      // A new incarnation while the old one's lease still ran: the agent
      // crashed (or was killed) and came back before meta noticed.
      if (live) ++old.failures;
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

// ---- Jobs -------------------------------------------------------------------

namespace {
JobView MakeJobView(const Job& job, const std::map<uint64_t, Version>* versions) {
  JobView view;
  view.job = job;
  if (versions == nullptr) return view;
  for (const auto& [step, v] : *versions) {
    ++view.version_counts[v.state];
    if (SatisfiesLevel(v.state, Level::kStaged)) view.latest_staged = step;
    if (SatisfiesLevel(v.state, Level::kProtected)) view.latest_protected = step;
    if (SatisfiesLevel(v.state, Level::kPersisted)) view.latest_persisted = step;
    for (const auto& [rank, sh] : v.shards) {
      for (const Copy& c : sh.copies) {
        if (c.state == CopyState::kValid) view.memory_bytes += sh.size_bytes;
      }
      if (sh.durable_written) view.durable_bytes += sh.size_bytes;
    }
    for (const Segment& seg : v.segments) {
      if (seg.state == CopyState::kValid && seg.kind == SegmentKind::kParity) {
        view.memory_bytes += seg.length_bytes;
      }
    }
  }
  return view;
}
}  // namespace

JobRequest JobRequest::Stating(const JobSpec& spec) {
  JobRequest r;
  r.job_id = spec.job_id;
  r.world_size = spec.world_size;
  r.protection = spec.protection;
  if (spec.flush.every_n_versions != 0 || spec.flush.every_seconds != 0) r.flush = spec.flush;
  if (spec.retention.keep_in_memory != 0 || spec.retention.keep_durable != 0) {
    r.retention = spec.retention;
  }
  r.labels = spec.labels;
  return r;
}

ProtectionPolicy AutoProtection(size_t alive_nodes) {
  return alive_nodes >= 2 ? ProtectionPolicy::Replicate(2, ProtectionPolicy::Placement::kRing)
                          : ProtectionPolicy::None();
}

absl::StatusOr<std::pair<JobView, bool>> MetaCore::CreateJob(const JobSpec& spec,
                                                            bool open_if_exists) {
  return CreateJob(JobRequest::Stating(spec), open_if_exists);
}

absl::StatusOr<std::pair<JobView, bool>> MetaCore::CreateJob(const JobRequest& req,
                                                            bool open_if_exists) {
  CKPT_RETURN_IF_ERROR(ValidateRequest(req));
  return Write([&](Engine& e) -> absl::StatusOr<std::pair<JobView, bool>> {
    Txn& txn = e.txn();
    auto it = state_->jobs.find(req.job_id);
    if (it != state_->jobs.end()) {
      if (!open_if_exists) {
        return absl::AlreadyExistsError(absl::StrCat("job \"", req.job_id, "\" already exists"));
      }
      if (it->second.deleting) {
        return absl::FailedPreconditionError(
            absl::StrCat("job \"", req.job_id, "\" is being deleted; use another id"));
      }
      const std::string diff = DiffSpecs(it->second.spec, req);
      if (!diff.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "job \"", req.job_id, "\" exists with a different spec: ", diff,
            "; leave out what you do not mean to change (it is then taken from the stored job), "
            "or create a job with another id"));
      }
      auto vs = state_->versions.find(req.job_id);
      return std::make_pair(
          MakeJobView(it->second, vs == state_->versions.end() ? nullptr : &vs->second), false);
    }
    if (req.world_size == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job \"", req.job_id, "\" does not exist; creating it needs a world size (1..",
          JobSpec::kMaxWorldSize, ")"));
    }
    const std::vector<PlannerNode> alive = e.AliveNodes();
    const bool defaulted = !req.protection.has_value();
    Job job;
    job.spec.job_id = req.job_id;
    job.spec.world_size = req.world_size;
    job.spec.protection = req.protection.value_or(
        options_.default_protection.value_or(AutoProtection(alive.size())));
    job.spec.flush = req.flush.value_or(FlushPolicy{});
    job.spec.retention = req.retention.value_or(RetentionPolicy{});
    job.spec.labels = req.labels;
    job.created_ms = e.NowMs();
    // The policy must be plannable over the nodes that are alive now.
    if (job.spec.protection.kind != ProtectionPolicy::Kind::kNone) {
      auto plan = PlanPlacement(alive, job.spec.protection);
      if (!plan.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "job \"", req.job_id, "\": ", defaulted ? "the server's default " : "",
            "protection policy ", job.spec.protection.ToString(), " cannot be placed: ",
            plan.status().message()));
      }
    }
    // Planned before the job enters the state, so a failure leaves nothing.
    CKPT_RETURN_IF_ERROR(e.CurrentPlan(job).status());
    Job& stored = state_->jobs[req.job_id] = std::move(job);
    txn.Job(stored);
    log::Info("job {} created: world size {}, protection {}{}", req.job_id, req.world_size,
              stored.spec.protection.ToString(), defaulted ? " (server default)" : "");
    JobView view = MakeJobView(stored, nullptr);
    return std::make_pair(std::move(view), true);
  });
}

absl::StatusOr<JobView> MetaCore::GetJob(const std::string& job_id) const {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job_id));
  return Read([&](Engine& e) -> absl::StatusOr<JobView> {
    auto it = state_->jobs.find(job_id);
    if (it == state_->jobs.end()) {
      return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" does not exist"));
    }
    auto vs = state_->versions.find(job_id);
    return MakeJobView(it->second, vs == state_->versions.end() ? nullptr : &vs->second);
  });
}

absl::StatusOr<std::vector<JobView>> MetaCore::ListJobs(const std::string& after,
                                                        uint32_t limit) const {
  return Read([&](Engine& e) -> absl::StatusOr<std::vector<JobView>> {
    std::vector<JobView> out;
    for (auto it = state_->jobs.upper_bound(after); it != state_->jobs.end(); ++it) {
      if (limit != 0 && out.size() >= limit) break;
      auto vs = state_->versions.find(it->first);
      out.push_back(
          MakeJobView(it->second, vs == state_->versions.end() ? nullptr : &vs->second));
    }
    return out;
  });
}

absl::StatusOr<JobView> MetaCore::DeleteJob(const std::string& job_id, bool delete_durable_files) {
  return Write([&](Engine& e) -> absl::StatusOr<JobView> {
    Txn& txn = e.txn();
    CKPT_ASSIGN_OR_RETURN(Job * job, e.FindJob(job_id));
    if (!job->deleting) {
      job->deleting = true;
      job->delete_durable_files = delete_durable_files;
      txn.Job(*job);
      for (auto& [step, v] : state_->versions[job_id]) {
        if (v.state == VersionState::kDeleted) continue;
        e.CancelVersionTasks(v);
        e.EvictVersion(v);
        if (delete_durable_files && !v.durable_dir.empty()) {
          e.DeleteDurable(v);
        }
        if (v.state != VersionState::kAborted) {
          CKPT_RETURN_IF_ERROR(e.SetState(v, VersionState::kDeleted, "job deleted"));
        }
      }
      log::Info("job {} deleted (durable files {})", job_id,
                delete_durable_files ? "deleted" : "kept");
    }
    auto vs = state_->versions.find(job_id);
    JobView view = MakeJobView(*job, vs == state_->versions.end() ? nullptr : &vs->second);
    return view;
  });
}

absl::StatusOr<PlacementView> MetaCore::GetPlacement(
    const std::string& job_id, const std::vector<int>& failures,
    const std::optional<ProtectionPolicy>& override, SurvivalOptions survival) const {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job_id));
  // The plan is over the alive nodes and the job as they are durably; the
  // survival estimates are computed after, without the lock.
  PlacementView view;
  CKPT_ASSIGN_OR_RETURN(PlacementPlan plan, Read([&](Engine& e) -> absl::StatusOr<PlacementPlan> {
    auto it = state_->jobs.find(job_id);
    if (it == state_->jobs.end()) {
      return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" does not exist"));
    }
    const ProtectionPolicy policy = override.has_value() ? *override : it->second.spec.protection;
    CKPT_RETURN_IF_ERROR(policy.Validate());
    view.plan.epoch = override.has_value() ? 0 : it->second.plan_epoch;
    view.job_id = job_id;
    view.created_ms = clock_->NowUnixMillis();
    return PlanPlacement(e.AliveNodes(), policy);
  }));
  CKPT_ASSIGN_OR_RETURN(VersionPlan vp, PlanToVersionPlan(plan));
  vp.epoch = view.plan.epoch;
  view.plan = std::move(vp);
  for (int f : failures) {
    CKPT_ASSIGN_OR_RETURN(SurvivalEstimate est, SurvivalProbability(plan, f, survival));
    view.survival.push_back(est);
  }
  return view;
}

// ---- Versions ---------------------------------------------------------------

absl::StatusOr<std::pair<Version, bool>> MetaCore::BeginVersion(const std::string& job_id,
                                                                uint64_t step,
                                                                const std::string& run_id) {
  CKPT_RETURN_IF_ERROR(ValidateStep(step));
  return Write([&](Engine& e) -> absl::StatusOr<std::pair<Version, bool>> {
    Txn& txn = e.txn();
    CKPT_ASSIGN_OR_RETURN(Job * job, e.FindJob(job_id));
    if (job->deleting) {
      return absl::FailedPreconditionError(
          absl::StrCat("job \"", job_id, "\" is being deleted"));
    }
    auto& by_step = state_->versions[job_id];
    auto it = by_step.find(step);
    bool superseded = false;
    if (it != by_step.end()) {
      Version& v = it->second;
      superseded = v.state == VersionState::kOpen && !run_id.empty() && !v.run_id.empty() &&
                   v.run_id != run_id;
      if (!superseded && !IsTerminal(v.state)) {
        return std::make_pair(Summary(v), false);
      }
      // An OPEN step of another run, or an ABORTED or DELETED step, is begun
      // afresh below.
    }
    // Everything that can refuse the version comes before any change.
    if (const Version* newer = e.NewestReadableAbove(job_id, step)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", step, " is lower than job \"", job_id, "\"'s newest version ", newer->step,
          " (", VersionStateName(newer->state),
          "); steps must increase: delete the newer versions to rewind (ckptctl delete ", job_id,
          " ", newer->step, ")"));
    }
    absl::StatusOr<VersionPlan> planned = e.CurrentPlan(*job);
    if (absl::IsFailedPrecondition(planned.status())) {
      // Too few nodes alive for the policy: a node that is restarting or
      // was stopped for a moment comes back. Retryable, so the agent keeps
      // the committed shards and begins again (they would be dropped for good
      // on a refusal).
      return absl::UnavailableError(absl::StrCat("cannot begin ", job_id, "/", step, " now: ",
                                                 planned.status().message(), "; retry when nodes return"));
    }
    CKPT_RETURN_IF_ERROR(planned.status());
    VersionPlan plan = *std::move(planned);
    if (superseded) {
      Version& v = it->second;
      e.CancelVersionTasks(v);
      e.EvictVersion(v);
      CKPT_RETURN_IF_ERROR(e.SetState(v, VersionState::kAborted, absl::StrCat("superseded by run ", run_id)));
    }
    if (it != by_step.end()) {
      // Replace the terminal version's records.
      for (const auto& [rank, sh] : it->second.shards) {
        txn.Delete(records::ShardKey(job_id, step, rank));
      }
      txn.Delete(records::SegmentsKey(job_id, step));
      by_step.erase(it);
    }
    Version v;
    v.job_id = job_id;
    v.step = step;
    v.state = VersionState::kOpen;
    v.world_size = job->spec.world_size;
    v.plan = std::move(plan);
    v.run_id = run_id;
    v.created_ms = e.NowMs();
    // Flush policy.
    const FlushPolicy& fp = job->spec.flush;
    bool flush = false;
    if (fp.every_n_versions > 0 &&
        (!job->any_flushed || job->versions_since_flush + 1 >= fp.every_n_versions)) {
      flush = true;
    }
    if (fp.every_seconds > 0 &&
        (!job->any_flushed ||
         v.created_ms - job->last_flush_begin_ms >= int64_t{fp.every_seconds} * 1000)) {
      flush = true;
    }
    if (flush) {
      v.flush_planned = true;
      v.durable_dir = absl::StrCat(job_id, "/", step);
      job->any_flushed = true;
      job->versions_since_flush = 0;
      job->last_flush_begin_ms = v.created_ms;
    } else {
      ++job->versions_since_flush;
    }
    txn.Job(*job);
    Version& stored = by_step[step] = std::move(v);
    txn.Header(stored);
    state_->open_progress[{job_id, step}] = e.Mono();
    ++state_->counters.versions_begun_total;
    Version result = stored;
    return std::make_pair(std::move(result), true);
  });
}

namespace {
absl::Status ValidateManifest(const Shard& shard, uint64_t step) {
  std::vector<const Item*> items;
  std::unordered_set<std::string_view> names;
  names.reserve(shard.items.size());
  for (const Item& it : shard.items) {
    CKPT_RETURN_IF_ERROR(ValidateItemName(it.name));
    if (!names.insert(it.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("item name \"", it.name, "\" appears twice"));
    }
    // The size rules of common/manifest.h, as the agent applied them: length
    // == dtype x shape exactly (no product may wrap), own items inside the
    // shard.
    if (it.ref_step >= 0) {
      // A reference: its bytes are in an older version's shard (checked
      // against that version in ApplyStaged).
      CKPT_RETURN_IF_ERROR(CheckItemLength(it.name, it.dtype, it.shape, it.length_bytes));
      if (static_cast<uint64_t>(it.ref_step) >= step) {
        return absl::InvalidArgumentError(absl::StrCat("item \"", it.name, "\" refers to version ", it.ref_step,
                                                       ", which is not older than this one (", step, ")"));
      }
      continue;
    }
    CKPT_RETURN_IF_ERROR(CheckItemInShard(it.name, it.offset_bytes, it.length_bytes, shard.size_bytes));
    CKPT_RETURN_IF_ERROR(CheckItemLength(it.name, it.dtype, it.shape, it.length_bytes));
    items.push_back(&it);
  }
  std::sort(items.begin(), items.end(),
            [](const Item* a, const Item* b) { return a->offset_bytes < b->offset_bytes; });
  // In offset order each non-empty item starts at or after the end of the
  // previous non-empty one. Empty items overlap nothing and may sit anywhere
  // (std::sort may place one after a non-empty item at the same offset), but
  // must not hide an overlap of their neighbours, as in common/manifest.cc.
  // No end wraps: CheckItemInShard held for each.
  const Item* last = nullptr;  // the previous non-empty item
  for (const Item* cur : items) {
    if (cur->length_bytes == 0) continue;
    if (last != nullptr && last->offset_bytes + last->length_bytes > cur->offset_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("items \"", last->name, "\" [", last->offset_bytes, ", +",
                                                     last->length_bytes, ") and \"", cur->name, "\" [",
                                                     cur->offset_bytes, ", +", cur->length_bytes, ") overlap"));
    }
    last = cur;
  }
  return absl::OkStatus();
}

// Every version `shard` refers to must still hold this rank's bytes in
// memory: not ended (aborted, deleted), not evicted, the rank staged.
absl::Status CheckRefs(Engine& e, const Version& v, const Shard& shard) {
  for (uint64_t base : shard.ref_steps) {
    absl::StatusOr<Version*> b = e.FindVersion(v.job_id, base);
    const char* why = nullptr;
    if (!b.ok()) {
      why = "is unknown";
    } else if ((*b)->evicted) {
      why = "is no longer in memory";
    } else if ((*b)->shards.count(shard.rank) == 0) {
      why = "has no shard of this rank";
    }
    if (why != nullptr) {
      return MissingBaseError(shard.rank, v.job_id, v.step, base, why);
    }
  }
  return absl::OkStatus();
}

// Takes the shard out of `r` (it is not used after).
absl::StatusOr<Shard*> StagedShard(Version* v, uint32_t rank) {
  auto it = v->shards.find(rank);
  if (it == v->shards.end()) {
    return absl::NotFoundError(
        absl::StrCat("rank ", rank, " of ", v->job_id, "/", v->step, " is not staged"));
  }
  return &it->second;
}

absl::Status ApplyStaged(Engine& e, const std::string& node_id, StagedReport& r) {
  CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(r.job_id, r.step));
  const Shard& in = r.shard;
  if (in.rank >= v->world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", in.rank, " is out of range: job \"",
                                                   r.job_id, "\" has world size ", v->world_size));
  }
  if (!in.primary_node_id.empty() && in.primary_node_id != node_id) {
    return absl::InvalidArgumentError(absl::StrCat("primary node \"", in.primary_node_id,
                                                   "\" is not the reporting node \"", node_id,
                                                   "\""));
  }
  CKPT_RETURN_IF_ERROR(ValidateManifest(in, r.step));
  auto existing = v->shards.find(in.rank);
  if (existing != v->shards.end()) {
    const Shard& have = existing->second;
    if (have.size_bytes == in.size_bytes && have.crc32c == in.crc32c &&
        have.manifest_digest == in.manifest_digest && have.primary_node_id == node_id) {
      return absl::AlreadyExistsError("shard already staged");
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", in.rank, " of ", r.job_id, "/", r.step, " is already staged on node \"",
        have.primary_node_id, "\" with different contents (crc ", absl::Hex(have.crc32c),
        " vs ", absl::Hex(in.crc32c), ")"));
  }
  if (v->state != VersionState::kOpen) {
    return absl::FailedPreconditionError(absl::StrCat(
        "version ", r.job_id, "/", r.step, " is ", VersionStateName(v->state),
        v->abort_reason.empty() ? "" : absl::StrCat(" (", v->abort_reason, ")"),
        "; it accepts no new shards"));
  }
  if (!r.run_id.empty() && !v->run_id.empty() && r.run_id != v->run_id) {
    return absl::FailedPreconditionError(absl::StrCat("shard's run \"", r.run_id,
                                                      "\" differs from the version's run \"",
                                                      v->run_id, "\""));
  }
  const uint32_t rank = in.rank;
  Shard sh = std::move(r.shard);
  sh.ref_steps = RefStepsOf(sh.items);
  CKPT_RETURN_IF_ERROR(CheckRefs(e, *v, sh));
  sh.primary_node_id = node_id;
  sh.copies.clear();
  sh.copies.push_back(Copy{node_id, CopyRole::kPrimary, CopyState::kValid, e.NowMs(), ""});
  sh.durable_written = false;
  if (v->flush_planned) sh.durable_path = absl::StrCat(v->durable_dir, "/", RankFileName(rank));
  v->shards[rank] = std::move(sh);
  e.txn().ShardRecord(*v, rank);

  // Replication starts per shard, as soon as it is committed.
  if (v->plan.policy.kind == ProtectionPolicy::Kind::kReplicate) {
    e.PlanRecovery(*v);
  }
  // An incremental version is flushed with references to the versions it
  // refers to, which are flushed too (their files must be committed first).
  if (v->flush_planned) {
    for (uint64_t base : v->shards[rank].ref_steps) {
      if (absl::StatusOr<Version*> b = e.FindVersion(v->job_id, base); b.ok()) e.StartFlush(**b);
    }
  }
  e.PlanFlush(*v);
  if (v->shards.size() == v->world_size) {
    v->staged_ms = e.NowMs();
    CKPT_RETURN_IF_ERROR(e.SetState(*v, VersionState::kStaged));
    if (v->plan.policy.kind == ProtectionPolicy::Kind::kErasureCode) e.StartErasureCoding(*v);
    e.Recompute(*v);
    // Older versions still OPEN can never be the newest restorable one now.
    e.AbortOpenVersionsBelow(*v);
  } else if (v->state == VersionState::kOpen) {
    e.state().open_progress[{v->job_id, v->step}] = e.Mono();
  }
  return absl::OkStatus();
}

absl::Status ApplyCopy(Engine& e, const std::string& node_id, const CopyReport& r) {
  CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(r.job_id, r.step));
  CKPT_ASSIGN_OR_RETURN(Shard * shard, StagedShard(v, r.rank));
  Shard& sh = *shard;
  if (IsTerminal(v->state) || v->evicted) {
    return absl::FailedPreconditionError(absl::StrCat("version ", r.job_id, "/", r.step, " is ",
                                                      VersionStateName(v->state),
                                                      v->evicted ? " and evicted" : "",
                                                      "; drop the copy"));
  }
  if (r.state == CopyState::kValid && (r.crc32c != sh.crc32c || r.size_bytes != sh.size_bytes)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "copy of rank ", r.rank, " on node \"", node_id, "\" (", r.size_bytes, " bytes, crc ",
        absl::Hex(r.crc32c), ") does not match the staged shard (", sh.size_bytes,
        " bytes, crc ", absl::Hex(sh.crc32c), "); drop it"));
  }
  Copy* copy = nullptr;
  for (Copy& c : sh.copies)
    if (c.node_id == node_id) copy = &c;
  if (copy != nullptr && copy->state == r.state && copy->role == r.role) {
    return absl::AlreadyExistsError("copy state unchanged");
  }
  if (copy == nullptr) {
    sh.copies.push_back(Copy{node_id, r.role, r.state, e.NowMs(), r.detail});
  } else {
    // A primary copy stays primary whatever role the report names.
    if (copy->role != CopyRole::kPrimary) copy->role = r.role;
    copy->state = r.state;
    copy->updated_ms = e.NowMs();
    copy->detail = r.detail;
  }
  e.txn().ShardRecord(*v, r.rank);
  e.Recompute(*v);
  return absl::OkStatus();
}

absl::Status ApplySegment(Engine& e, const std::string& node_id, const SegmentReport& r) {
  CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(r.job_id, r.step));
  Segment* seg = nullptr;
  for (Segment& s : v->segments)
    if (s.key == r.key) seg = &s;
  if (seg == nullptr) {
    return absl::NotFoundError(absl::StrCat("version ", r.job_id, "/", r.step,
                                            " has no segment group ", r.key.group, " stripe ",
                                            r.key.stripe, " position ", r.key.position));
  }
  if (IsTerminal(v->state) || v->evicted) {
    return absl::FailedPreconditionError(absl::StrCat("version ", r.job_id, "/", r.step, " is ",
                                                      VersionStateName(v->state),
                                                      "; drop the segment"));
  }
  if (r.state == CopyState::kValid) {
    if (r.length_bytes != seg->length_bytes) {
      return absl::FailedPreconditionError(absl::StrCat("segment length ", r.length_bytes,
                                                        " differs from the layout's ",
                                                        seg->length_bytes));
    }
    if (seg->state == CopyState::kValid && (seg->crc_known || seg->crc32c != 0) && seg->crc32c != r.crc32c &&
        seg->holder_node_id != node_id) {
      // A rebuilt copy must reproduce the known contents.
      return absl::FailedPreconditionError(absl::StrCat("segment crc ", absl::Hex(r.crc32c),
                                                        " differs from the known ",
                                                        absl::Hex(seg->crc32c)));
    }
    if (seg->state == CopyState::kValid && seg->holder_node_id == node_id &&
        seg->crc32c == r.crc32c) {
      return absl::AlreadyExistsError("segment state unchanged");
    }
    if (seg->state == CopyState::kValid && seg->holder_node_id != node_id &&
        seg->length_bytes > 0 && e.IsUsable(seg->holder_node_id)) {
      // Moved (a rebalance of a stripe doubled up on one node): the old
      // holder's copy would otherwise stay in its memory for good.
      Holding h;
      h.is_segment = true;
      h.job_id = r.job_id;
      h.step = r.step;
      h.segment = seg->key;
      h.kind = seg->kind;
      h.size_bytes = seg->length_bytes;
      h.crc32c = seg->crc32c;
      Task& t = e.NewTask(seg->holder_node_id, TaskKind::kDrop, "", 0, 0);
      t.drop = {h};
      t.reason = absl::StrCat("segment moved to node \"", node_id, "\"");
      e.txn().Task(t);
    }
    seg->holder_node_id = node_id;
    seg->crc32c = r.crc32c;
    seg->crc_known = true;
  } else {
    if (seg->holder_node_id != node_id) {
      return absl::FailedPreconditionError(absl::StrCat("node \"", node_id,
                                                        "\" does not hold this segment"));
    }
    if (seg->state == r.state) return absl::AlreadyExistsError("segment state unchanged");
  }
  seg->state = r.state;
  seg->updated_ms = e.NowMs();
  seg->detail = r.detail;
  e.txn().Segments(*v);
  e.Recompute(*v);
  return absl::OkStatus();
}

absl::Status ApplyPersisted(Engine& e, const std::string& node_id, const PersistedReport& r) {
  CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(r.job_id, r.step));
  CKPT_ASSIGN_OR_RETURN(Shard * shard, StagedShard(v, r.rank));
  Shard& sh = *shard;
  if (IsTerminal(v->state)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "version ", r.job_id, "/", r.step, " is ", VersionStateName(v->state)));
  }
  if (!v->flush_planned) {
    return absl::FailedPreconditionError(absl::StrCat("version ", r.job_id, "/", r.step,
                                                      " is not planned for flush"));
  }
  if (r.durable_path != sh.durable_path) {
    return absl::InvalidArgumentError(absl::StrCat("durable path \"", r.durable_path,
                                                   "\" differs from the planned \"",
                                                   sh.durable_path, "\""));
  }
  if (r.crc32c != sh.crc32c || r.size_bytes != sh.size_bytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "durable file of rank ", r.rank, " (", r.size_bytes, " bytes, crc ",
        absl::Hex(r.crc32c), ") does not match the shard (", sh.size_bytes, " bytes, crc ",
        absl::Hex(sh.crc32c), ")"));
  }
  if (sh.durable_written) return absl::AlreadyExistsError("already persisted");
  sh.durable_written = true;
  sh.durable_written_ms = e.NowMs();
  e.txn().ShardRecord(*v, r.rank);
  e.PlanFlush(*v);
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<ReportResult> MetaCore::ReportShards(const std::string& node_id,
                                                    uint64_t incarnation,
                                                    const std::vector<ShardReport>& reports) {
  uint64_t seq = 0;
  CKPT_ASSIGN_OR_RETURN(ReportResult result,
                        SubmitReportShards(node_id, incarnation, std::vector(reports), &seq));
  CKPT_RETURN_IF_ERROR(store_->AwaitDurable(seq));
  return result;
}

absl::StatusOr<ReportResult> MetaCore::SubmitReportShards(const std::string& node_id,
                                                          uint64_t incarnation,
                                                          std::vector<ShardReport> reports,
                                                          uint64_t* durable_seq) {
  *durable_seq = 0;
  uint64_t seq = 0;
  absl::StatusOr<ReportResult> answer = Apply([&](Engine& e) -> absl::StatusOr<ReportResult> {
    CKPT_RETURN_IF_ERROR(e.CheckNode(node_id, incarnation).status());
    ReportResult result;
    result.results.reserve(reports.size());
    state_->created_tasks.clear();
    for (ShardReport& r : reports) {
      absl::Status st;
      switch (r.kind) {
        case ShardReport::Kind::kStaged: st = ApplyStaged(e, node_id, r.staged); break;
        case ShardReport::Kind::kCopy: st = ApplyCopy(e, node_id, r.copy); break;
        case ShardReport::Kind::kSegment: st = ApplySegment(e, node_id, r.segment); break;
        case ShardReport::Kind::kPersisted: st = ApplyPersisted(e, node_id, r.persisted); break;
      }
      ++state_->counters.reports_total;
      if (!st.ok() && !absl::IsAlreadyExists(st)) ++state_->counters.reports_rejected_total;
      result.results.push_back(st);
    }
    for (const std::string& id : state_->created_tasks) {
      auto t = state_->tasks.find(id);
      if (t != state_->tasks.end() && t->second.node_id == node_id &&
          t->second.state == TaskState::kPending) {
        result.tasks.push_back(e.Bundle(t->second));
      }
    }
    state_->created_tasks.clear();
    return result;
  }, &seq);
  if (answer.ok()) *durable_seq = seq;  // an error is answered at once
  return answer;
}

absl::StatusOr<Version> MetaCore::GetVersion(const std::string& job_id, uint64_t step,
                                             bool include_items) const {
  return Read([&](Engine& e) -> absl::StatusOr<Version> {
    CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(job_id, step));
    Version copy = *v;
    if (!include_items) {
      for (auto& [rank, sh] : copy.shards) sh.items.clear();
    }
    return copy;
  });
}

absl::StatusOr<std::vector<Version>> MetaCore::ListVersions(
    const std::string& job_id, const std::vector<VersionState>& states, bool newest_first,
    std::optional<uint64_t> after, uint32_t limit) const {
  return Read([&](Engine& e) -> absl::StatusOr<std::vector<Version>> {
    CKPT_RETURN_IF_ERROR(e.FindJob(job_id).status());
    std::vector<Version> out;
    auto add = [&](const Version& v) {
      const bool match = states.empty() ? v.state != VersionState::kDeleted
                                        : std::find(states.begin(), states.end(), v.state) !=
                                              states.end();
      if (!match) return;
      out.push_back(Summary(v));
    };
    const auto& by_step = state_->versions[job_id];
    if (newest_first) {
      for (auto it = by_step.rbegin(); it != by_step.rend(); ++it) {
        if (after.has_value() && it->first >= *after) continue;
        if (limit != 0 && out.size() >= limit) break;
        add(it->second);
      }
    } else {
      for (auto it = after.has_value() ? by_step.upper_bound(*after) : by_step.begin();
           it != by_step.end(); ++it) {
        if (limit != 0 && out.size() >= limit) break;
        add(it->second);
      }
    }
    return out;
  });
}

absl::StatusOr<Version> MetaCore::Latest(const std::string& job_id, Level min_level) const {
  return Read([&](Engine& e) -> absl::StatusOr<Version> {
    CKPT_RETURN_IF_ERROR(e.FindJob(job_id).status());
    const auto& by_step = state_->versions[job_id];
    for (auto it = by_step.rbegin(); it != by_step.rend(); ++it) {
      // (An incremental version whose referred versions are gone does not
      // load whole: not a restore target.)
      if (SatisfiesLevel(it->second.state, min_level) && e.RefsAvailable(it->second)) {
        Version copy = it->second;
        for (auto& [rank, sh] : copy.shards) sh.items.clear();
        return copy;
      }
    }
    return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" has no version at level ",
                                            LevelName(min_level), " or better"));
  });
}

absl::StatusOr<LocateResult> MetaCore::Locate(const std::string& job_id, uint64_t step,
                                              uint32_t rank,
                                              const std::string& near_node_id) const {
  return Read([&](Engine& e) -> absl::StatusOr<LocateResult> {
    CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(job_id, step));
    if (rank >= v->world_size) {
      return absl::NotFoundError(absl::StrCat("rank ", rank, " is out of range: version ",
                                              job_id, "/", step, " has world size ",
                                              v->world_size));
    }
    // An aborted version's shards that newer versions refer to (incremental
    // saves) are still served, to those loads.
    const bool referred = v->state == VersionState::kAborted && !v->evicted && !e.Dependents(job_id, step).empty();
    if (!SatisfiesLevel(v->state, Level::kStaged) && !referred) {
      return absl::FailedPreconditionError(
          absl::StrCat("version ", job_id, "/", step, " is ", VersionStateName(v->state),
                       v->abort_reason.empty() ? "" : absl::StrCat(" (", v->abort_reason, ")"),
                       "; it cannot be restored"));
    }
    auto it = v->shards.find(rank);
    if (it == v->shards.end()) {
      return absl::NotFoundError(absl::StrCat("rank ", rank, " of ", job_id, "/", step,
                                              " is not staged"));
    }
    LocateResult result;
    result.shard = it->second;
    result.shard.copies.clear();
    result.sources = e.Sources(*v, it->second, near_node_id);
    if (result.sources.empty()) {
      return absl::DataLossError(absl::StrCat("rank ", rank, " of ", job_id, "/", step,
                                              " has no readable source left"));
    }
    return result;
  });
}

absl::StatusOr<Version> MetaCore::WaitVersion(const std::string& job_id, uint64_t step,
                                              Level level, absl::Duration timeout) {
  return Read([&](Engine& e) -> absl::StatusOr<Version> {
    CKPT_RETURN_IF_ERROR(e.FindVersion(job_id, step).status());
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      auto j = state_->versions.find(job_id);
      if (j == state_->versions.end()) return true;
      auto v = j->second.find(step);
      if (v == j->second.end()) return true;
      return SatisfiesLevel(v->second.state, level) || IsTerminal(v->second.state);
    };
    clock_->AwaitWithTimeout(&mu_, absl::Condition(&done), timeout);
    // The answer reflects the state now; it is returned once that is durable.
    auto v = e.FindVersion(job_id, step);
    if (!v.ok()) return v.status();
    const Version& ver = **v;
    if (SatisfiesLevel(ver.state, level)) {
      Version copy = ver;
      for (auto& [rank, sh] : copy.shards) sh.items.clear();
      return copy;
    }
    if (ver.state == VersionState::kDeleted) {
      return absl::NotFoundError(absl::StrCat("version ", job_id, "/", step, " was deleted",
                                              ver.abort_reason.empty() ? "" : absl::StrCat(
                                                  " (", ver.abort_reason, ")")));
    }
    if (ver.state == VersionState::kAborted) {
      const bool lost = ver.abort_reason.find("lost") != std::string::npos;
      const std::string msg = absl::StrCat("version ", job_id, "/", step,
                                           " was aborted: ", ver.abort_reason);
      return lost ? absl::DataLossError(msg) : absl::FailedPreconditionError(msg);
    }
    return absl::DeadlineExceededError(absl::StrCat(
        "version ", job_id, "/", step, " did not reach ", LevelName(level), " within ",
        absl::FormatDuration(timeout), "; it is ", VersionStateName(ver.state), " with ",
        StagedRanksText(ver)));
  });
}

absl::StatusOr<Version> MetaCore::FlushVersion(const std::string& job_id, uint64_t step) {
  return Write([&](Engine& e) -> absl::StatusOr<Version> {
    CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(job_id, step));
    if (IsTerminal(v->state)) {
      return absl::FailedPreconditionError(absl::StrCat("version ", job_id, "/", step, " is ",
                                                        VersionStateName(v->state)));
    }
    if (v->evicted && v->state != VersionState::kPersisted) {
      return absl::FailedPreconditionError(absl::StrCat("version ", job_id, "/", step,
                                                        " was evicted from memory"));
    }
    e.StartFlush(*v);
    Version result = *v;
    for (auto& [rank, sh] : result.shards) sh.items.clear();
    return result;
  });
}

absl::StatusOr<Version> MetaCore::DeleteVersion(const std::string& job_id, uint64_t step,
                                                bool force) {
  return Write([&](Engine& e) -> absl::StatusOr<Version> {
    CKPT_ASSIGN_OR_RETURN(Version * v, e.FindVersion(job_id, step));
    if (v->state != VersionState::kDeleted) {
      if (!force && SatisfiesLevel(v->state, Level::kProtected)) {
        const auto& by_step = state_->versions[job_id];
        for (auto it = by_step.rbegin(); it != by_step.rend(); ++it) {
          if (!SatisfiesLevel(it->second.state, Level::kProtected)) continue;
          if (it->first == step) {
            return absl::FailedPreconditionError(absl::StrCat(
                "version ", job_id, "/", step,
                " is the job's newest protected version; deleting it leaves nothing to "
                "restore from (use force to delete it anyway)"));
          }
          break;
        }
      }
      if (const std::vector<uint64_t> dependents = e.Dependents(job_id, step); !dependents.empty() && !force) {
        return absl::FailedPreconditionError(absl::StrCat(
            "version ", job_id, "/", step, " holds items that version(s) ", absl::StrJoin(dependents, ", "),
            " refer to (incremental saves); deleted, they would no longer load (use force to delete it anyway)"));
      }
      e.CancelVersionTasks(*v);
      e.EvictVersion(*v);
      bool durable = false;
      for (const auto& [rank, sh] : v->shards) durable = durable || sh.durable_written;
      if (durable || v->state == VersionState::kPersisted) {
        e.DeleteDurable(*v);
      }
      CKPT_RETURN_IF_ERROR(e.SetState(*v, VersionState::kDeleted, "deleted by operator"));
    }
    Version result = *v;
    for (auto& [rank, sh] : result.shards) sh.items.clear();
    return result;
  });
}

MetaCounters MetaCore::counters() const {
  absl::MutexLock lock(&mu_);
  return state_->counters;
}

}  // namespace ckpt::meta
