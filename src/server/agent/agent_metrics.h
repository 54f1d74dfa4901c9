// AgentMetrics: every Prometheus metric the node agent exports, created once
// and shared (by pointer) with the components that count. docs/agent.md and
// docs/operations.md list them.
//
// Thread safety: handles may be used from any thread (see common/metrics.h).
#pragma once

#include "common/metrics.h"

namespace ckpt::agent {

struct AgentMetrics {
  explicit AgentMetrics(MetricsRegistry& m);

  Counter* staged_bytes;
  Counter* staged_shards;
  Counter* flush_bytes;
  Counter* flush_shards;
  Counter* flush_errors;
  Counter* corrupt;
  Counter* lease_rejected;
  Counter* meta_errors;
  Counter* peer_sent_bytes;
  Counter* peer_received_bytes;
  Counter* replicas_stored;
  Counter* parity_stored;
  Counter* segments_rebuilt;
  Counter* peer_restores;
  Counter* peer_errors;
  Counter* peer_timeouts;
  Counter* hedged_reads;
  Counter* hedged_restores;
  Counter* peer_refused;
  Gauge* protection_paused;            // 1 while a trainer's pause is in force
  Counter* protection_paused_seconds;  // time protection was held back
  Counter* parity_builds_dropped;
  Counter* pushes_expired;
  Counter* leases_expired;
  Counter* shards_compacted;
  Counter* pulled_bytes;   // pull-mode ingest (ckpt-dpu-agent)
  Counter* pull_seconds;
  Counter* pull_errors;
  Counter* delivered_bytes;  // restores written into clients' staging memory
  Counter* session_requests;  // leases and opens asked on session connections
  Gauge* used;
  Gauge* free;
  Gauge* leased;
  Gauge* leased_ahead;
  Gauge* capacity;
  Gauge* flush_lag_bytes;
  Gauge* flush_lag_seconds;
  Gauge* holdings;
  Gauge* registered;
  Gauge* reservations;
  Gauge* parity_builds;
  Gauge* pushes_receiving;
  Gauge* open_leases;
  Gauge* restorable_versions;
  Gauge* open_handles;
  // 1 when the memory dir is on tmpfs/hugetlbfs/ramfs (or not known), 0 on
  // a disk file system (AgentOptions::memory_dir_fs).
  Gauge* memory_dir_in_memory;
};

}  // namespace ckpt::agent
