// FakeMeta: an in-memory MetaLink for agent unit tests. Records every report,
// inventory and task result; `up = false` makes every call Unavailable.
// Thread-safe (one mutex).
#pragma once

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/lock_check.h"
#include "common/durable_format.h"
#include "common/manifest.h"
#include "common/names.h"
#include "server/agent/meta_link.h"
#include "server/agent/meta_session.h"

namespace ckpt::agent {

// A MetaSession delegate that holds nothing and ignores every task, drop and
// refusal: for tests of a component that needs a session but not its callbacks.
class NoDelegate : public MetaSession::Delegate {
 public:
  std::vector<InventoryItem> InventoryItems() override { return {}; }
  LoadReport Load() override { return {}; }
  void OnTasks(std::vector<AgentTask>, std::vector<std::string>) override {}
  void OnDrop(const std::vector<ShardId>&, const std::vector<SegmentId>&) override {}
  void OnVersionRefused(const std::string&, uint64_t, const std::string&, const absl::Status&) override {}
  void OnCopyRefused(const HoldingReport&, const absl::Status&) override {}
};

class FakeMeta : public MetaLink {
 public:
  absl::StatusOr<RegistrationReply> Register(const NodeRegistration& node) override {
    AssertNoCheckedLock("an RPC to meta");
    absl::MutexLock lock(&mu);
    if (!up) return absl::UnavailableError("meta down");
    registrations++;
    return RegistrationReply{++incarnation, 5000, 1000, 7, data_plane_key};
  }
  absl::StatusOr<HeartbeatReply> Heartbeat(const std::string&, uint64_t inc, const LoadReport& load) override {
    AssertNoCheckedLock("an RPC to meta");
    absl::MutexLock lock(&mu);
    if (!up) return absl::UnavailableError("meta down");
    if (inc != incarnation) return absl::FailedPreconditionError("stale incarnation");
    last_load = load;
    HeartbeatReply r;
    r.tasks = std::move(pending_tasks);
    pending_tasks.clear();
    r.cancelled_task_ids = std::move(pending_cancels);
    pending_cancels.clear();
    r.membership_generation = membership_generation;
    if (membership_generation != 0 && load.membership_generation != membership_generation) r.members = members;
    ++heartbeats;
    return r;
  }
  absl::StatusOr<InventoryReply> ReportInventory(const std::string&, uint64_t,
                                                 const std::vector<InventoryItem>& items) override {
    AssertNoCheckedLock("an RPC to meta");
    absl::MutexLock lock(&mu);
    if (!up) return absl::UnavailableError("meta down");
    inventories.push_back(items);
    return InventoryReply{};
  }
  absl::StatusOr<uint32_t> JobWorldSize(const std::string& job) override {
    AssertNoCheckedLock("an RPC to meta");
    absl::MutexLock lock(&mu);
    if (!up) return absl::UnavailableError("meta down");
    auto it = world.find(job);
    if (it == world.end()) return absl::NotFoundError(absl::StrCat("job ", job, " not found"));
    return it->second;
  }
  absl::StatusOr<uint32_t> BeginVersion(const std::string& job, uint64_t step, const std::string&,
                                        const std::string&) override {
    AssertNoCheckedLock("an RPC to meta");
    absl::MutexLock lock(&mu);
    if (!up) return absl::UnavailableError("meta down");
    if (!begin_errors.empty()) {
      absl::Status e = begin_errors.front();
      begin_errors.pop_front();
      return e;
    }
    auto it = world.find(job);
    if (it == world.end()) return absl::NotFoundError(absl::StrCat("job ", job, " not found"));
    if (refuse_step.count(step) != 0) return absl::InvalidArgumentError("step lower than the newest");
    begins++;
    return it->second;
  }
  absl::StatusOr<ReportReply> ReportShards(const std::string&, uint64_t,
                                           const std::vector<HoldingReport>& reports) override {
    AssertNoCheckedLock("an RPC to meta");
    absl::MutexLock lock(&mu);
    if (!up) return absl::UnavailableError("meta down");
    ReportReply r;
    for (const HoldingReport& h : reports) {
      this->reports.push_back(h);
      if (h.kind == HoldingReport::Kind::kStaged) {
        if (auto gone = std::find_if(h.record->items.begin(), h.record->items.end(),
                                     [&](const ManifestItem& it) { return it.ref_step && gone_bases.count(*it.ref_step); });
            gone != h.record->items.end()) {
          r.results.push_back(MissingBaseError(h.record->id.rank, h.record->id.job_id, h.record->id.step,
                                               *gone->ref_step, "is no longer in memory"));
          continue;
        }
        const bool seen = staged.count(h.record->id) != 0;
        staged[h.record->id] = *h.record;
        r.results.push_back(seen ? absl::AlreadyExistsError("replay") : absl::OkStatus());
        if (!seen && flush_on_stage) {
          AgentTask t;
          t.id = absl::StrCat("t-", ++task_counter);
          t.kind = TaskKind::kFlush;
          t.kind_name = "flush";
          t.priority = 100;
          t.job_id = h.record->id.job_id;
          t.step = h.record->id.step;
          t.durable_dir = absl::StrCat(t.job_id, "/", t.step);
          t.flush.push_back(FlushOrder{h.record->id.rank,
                                       absl::StrCat(t.durable_dir, "/", RankFileName(h.record->id.rank)),
                                       h.record->size_bytes, h.record->crc32c});
          r.tasks.push_back(t);
          flushes.push_back(t);
        }
      } else {
        r.results.push_back(absl::OkStatus());
      }
    }
    return r;
  }
  absl::Status ReportTaskResult(const std::string&, uint64_t, const std::string& task_id, uint32_t,
                                const absl::Status& result, uint64_t, int64_t) override {
    AssertNoCheckedLock("an RPC to meta");
    absl::MutexLock lock(&mu);
    if (!up) return absl::UnavailableError("meta down");
    results.emplace_back(task_id, result);
    return absl::OkStatus();
  }
  absl::StatusOr<EvictFacts> GetEvictFacts(const std::string& job, uint64_t step) override {
    AssertNoCheckedLock("an RPC to meta");
    absl::MutexLock lock(&mu);
    if (!up) return absl::UnavailableError("meta down");
    EvictFacts f;
    f.version_state = version_state[step];
    f.newest_protected_step = newest_protected;
    return f;
  }
  absl::StatusOr<DurableManifest> GetVersionManifest(const std::string& job, uint64_t step) override {
    AssertNoCheckedLock("an RPC to meta");
    absl::MutexLock lock(&mu);
    DurableManifest m;
    m.job_id = job;
    m.step = step;
    m.world_size = world[job];
    for (const auto& [id, rec] : staged) {
      if (id.job_id != job || id.step != step) continue;
      DurableShard s;
      s.rank = id.rank;
      s.file = RankFileName(id.rank);
      s.size_bytes = rec.size_bytes;
      s.crc32c = rec.crc32c;
      s.manifest_digest = rec.manifest_digest;
      s.items = rec.items;
      m.shards.push_back(s);
    }
    return m;
  }

  absl::Mutex mu;
  bool up = true;
  bool flush_on_stage = false;
  uint64_t incarnation = 0;
  // The membership heartbeats answer with (0: none, as before the feature).
  uint64_t membership_generation = 0;
  std::vector<Member> members;
  int heartbeats = 0;
  int registrations = 0;
  std::string data_plane_key;  // what registrations answer with
  int begins = 0;
  int task_counter = 0;
  std::map<std::string, uint32_t> world;
  std::set<uint64_t> refuse_step;
  std::set<uint64_t> gone_bases;  // STAGED reports referring to these are refused (MissingBaseError)
  std::deque<absl::Status> begin_errors;  // answered to the next BeginVersion calls, in order
  std::map<uint64_t, int> version_state;  // ckpt.v1.VersionState by step
  std::optional<uint64_t> newest_protected;
  std::map<ShardId, ShardRecord> staged;
  std::vector<HoldingReport> reports;
  std::vector<std::vector<InventoryItem>> inventories;
  std::vector<std::pair<std::string, absl::Status>> results;
  std::vector<AgentTask> pending_tasks;
  std::vector<AgentTask> flushes;  // flush tasks handed out
  std::vector<std::string> pending_cancels;  // cancelled with the next heartbeat
  LoadReport last_load;
};

}  // namespace ckpt::agent
