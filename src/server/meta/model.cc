#include "server/meta/model.h"

#include <algorithm>

namespace ckpt::meta {

const char* VersionStateName(VersionState s) {
  switch (s) {
    case VersionState::kOpen: return "OPEN";
    case VersionState::kStaged: return "STAGED";
    case VersionState::kProtected: return "PROTECTED";
    case VersionState::kPersisted: return "PERSISTED";
    case VersionState::kDegraded: return "DEGRADED";
    case VersionState::kAborted: return "ABORTED";
    case VersionState::kDeleted: return "DELETED";
  }
  return "UNKNOWN";
}

const char* NodeStateName(NodeState s) {
  switch (s) {
    case NodeState::kAlive: return "ALIVE";
    case NodeState::kSuspect: return "SUSPECT";
    case NodeState::kDead: return "DEAD";
    case NodeState::kDraining: return "DRAINING";
    case NodeState::kLeft: return "LEFT";
  }
  return "UNKNOWN";
}

const char* LevelName(Level l) {
  switch (l) {
    case Level::kStaged: return "STAGED";
    case Level::kProtected: return "PROTECTED";
    case Level::kPersisted: return "PERSISTED";
  }
  return "UNKNOWN";
}

const char* CopyStateName(CopyState s) {
  switch (s) {
    case CopyState::kPending: return "PENDING";
    case CopyState::kValid: return "VALID";
    case CopyState::kCorrupt: return "CORRUPT";
    case CopyState::kLost: return "LOST";
    case CopyState::kEvicted: return "EVICTED";
  }
  return "UNKNOWN";
}

const char* TaskKindName(TaskKind k) {
  switch (k) {
    case TaskKind::kReplicate: return "replicate";
    case TaskKind::kEcEncode: return "ec-encode";
    case TaskKind::kRebuildSegments: return "rebuild-segments";
    case TaskKind::kFlush: return "flush";
    case TaskKind::kCommitDurable: return "commit-durable";
    case TaskKind::kEvict: return "evict";
    case TaskKind::kDrop: return "drop";
    case TaskKind::kDeleteDurable: return "delete-durable";
  }
  return "unknown";
}

const char* TaskStateName(TaskState s) {
  switch (s) {
    case TaskState::kPending: return "pending";
    case TaskState::kRunning: return "running";
    case TaskState::kRetryWait: return "retry-wait";
    case TaskState::kDone: return "done";
    case TaskState::kFailed: return "failed";
    case TaskState::kCancelled: return "cancelled";
  }
  return "unknown";
}

bool SatisfiesLevel(VersionState s, Level l) {
  switch (l) {
    case Level::kStaged:
      return s == VersionState::kStaged || s == VersionState::kProtected ||
             s == VersionState::kPersisted || s == VersionState::kDegraded;
    case Level::kProtected:
      return s == VersionState::kProtected || s == VersionState::kPersisted;
    case Level::kPersisted:
      return s == VersionState::kPersisted;
  }
  return false;
}

std::vector<uint64_t> RefStepsOf(const std::vector<Item>& items) {
  std::vector<uint64_t> steps;
  for (const Item& it : items) {
    if (it.ref_step >= 0) steps.push_back(static_cast<uint64_t>(it.ref_step));
  }
  std::sort(steps.begin(), steps.end());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  return steps;
}

uint64_t Version::TotalBytes() const {
  uint64_t total = 0;
  for (const auto& [rank, shard] : shards) total += shard.size_bytes;
  return total;
}

std::string PlacementDomain(const std::map<std::string, Node>& nodes, const std::string& id, const Node& node) {
  // The host a DPU agent serves, or the node itself.
  const std::string& host = node.role == NodeRole::kDpu && !node.host_node_id.empty() ? node.host_node_id : id;
  if (host != id) {
    auto h = nodes.find(host);
    if (h != nodes.end() && !h->second.failure_domain.empty()) return h->second.failure_domain;
    return node.failure_domain.empty() ? "host:" + host : node.failure_domain;
  }
  if (!node.failure_domain.empty()) return node.failure_domain;
  // An unlabelled host that a DPU agent serves shares that DPU's domain.
  for (const auto& [other_id, other] : nodes) {
    if (other.role == NodeRole::kDpu && other.host_node_id == id) {
      return other.failure_domain.empty() ? "host:" + id : other.failure_domain;
    }
  }
  return "";
}

}  // namespace ckpt::meta
