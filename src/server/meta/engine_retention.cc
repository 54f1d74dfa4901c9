// Engine, retention: which versions leave memory and the durable tier
// (the job's RetentionPolicy), and evicting a version's holdings.
#include <set>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/meta/core_state.h"

namespace ckpt::meta {

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

}  // namespace ckpt::meta
