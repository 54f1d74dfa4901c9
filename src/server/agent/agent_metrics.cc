#include "server/agent/agent_metrics.h"

namespace ckpt::agent {

AgentMetrics::AgentMetrics(MetricsRegistry& m)
    : staged_bytes(&m.AddCounter("ckpt_agent_staged_bytes_total", "Bytes of shards committed by local clients")),
      staged_shards(&m.AddCounter("ckpt_agent_staged_shards_total", "Shards committed by local clients")),
      flush_bytes(&m.AddCounter("ckpt_agent_flush_bytes_total", "Bytes written to the durable tier")),
      flush_shards(&m.AddCounter("ckpt_agent_flush_shards_total", "Rank files written to the durable tier")),
      flush_errors(&m.AddCounter("ckpt_agent_flush_errors_total", "Failed durable-tier writes (each retry counts)")),
      corrupt(&m.AddCounter("ckpt_agent_corrupt_copies_total", "Holdings whose bytes failed their crc32c")),
      lease_rejected(&m.AddCounter("ckpt_agent_lease_rejected_total", "Staging leases refused for lack of memory")),
      meta_errors(&m.AddCounter("ckpt_agent_meta_errors_total", "Failed calls to ckpt-meta")),
      peer_sent_bytes(
          &m.AddCounter("ckpt_agent_peer_sent_bytes_total", "Bytes sent to peers (pushes and reads served)")),
      peer_received_bytes(
          &m.AddCounter("ckpt_agent_peer_received_bytes_total", "Bytes received from peers (pushes and reads)")),
      replicas_stored(&m.AddCounter("ckpt_agent_replicas_stored_total", "Replica copies received and stored")),
      parity_stored(&m.AddCounter("ckpt_agent_parity_segments_total", "EC parity segments completed on this node")),
      segments_rebuilt(&m.AddCounter("ckpt_agent_segments_rebuilt_total", "EC segments rebuilt on this node")),
      peer_restores(
          &m.AddCounter("ckpt_agent_peer_restores_total", "Shards restored from a peer replica or by EC decode")),
      peer_errors(&m.AddCounter("ckpt_agent_peer_errors_total", "Failed pushes, reads and decodes")),
      peer_timeouts(&m.AddCounter("ckpt_agent_peer_timeouts_total",
                                  "Peer requests that got no answer within --peer-timeout-ms")),
      hedged_reads(&m.AddCounter("ckpt_agent_hedged_reads_total",
                                 "Extra segment reads started because a holder was slow")),
      hedged_restores(&m.AddCounter("ckpt_agent_hedged_restores_total",
                                    "Restore sources read beside a peer's copy that had sent nothing for a while")),
      peer_refused(&m.AddCounter("ckpt_agent_peer_refused_total",
                                 "Pushes and reads refused: the sender is not one of meta's members")),
      protection_paused(&m.AddGauge("ckpt_agent_protection_paused",
                                    "1 while a trainer has protection traffic paused (PauseProtection)")),
      protection_paused_seconds(&m.AddCounter("ckpt_agent_protection_paused_seconds_total",
                                              "Seconds protection traffic was paused by trainers")),
      parity_builds_dropped(&m.AddCounter("ckpt_agent_parity_builds_dropped_total",
                                          "Parity builds abandoned (failed, cancelled, evicted or expired)")),
      pushes_expired(&m.AddCounter("ckpt_agent_pushes_expired_total",
                                   "Incoming pushes dropped after no progress for the peer timeout")),
      leases_expired(&m.AddCounter("ckpt_agent_leases_expired_total",
                                   "Staging leases and handles released because their client went away")),
      shards_compacted(&m.AddCounter("ckpt_agent_shards_compacted_total",
                                     "Incremental shards stored self-contained because meta no longer held a version "
                                     "they refer to")),
      pulled_bytes(&m.AddCounter("ckpt_agent_pulled_bytes_total",
                                 "Shard bytes a DPU agent read from clients' staging memory (pull-mode ingest)")),
      pull_seconds(&m.AddCounter("ckpt_agent_pull_seconds_total", "Time spent pulling shards from clients")),
      pull_errors(&m.AddCounter("ckpt_agent_pull_errors_total",
                                "Pulls of commits and deliveries of restores that failed (client unreachable, "
                                "timeout, token or crc mismatch)")),
      delivered_bytes(&m.AddCounter("ckpt_agent_delivered_bytes_total",
                                    "Restored shard bytes a DPU agent wrote into clients' staging memory")),
      session_requests(&m.AddCounter("ckpt_agent_session_requests_total",
                                     "Staging leases and local opens clients asked for on their session connections "
                                     "(no gRPC call), answered or refused")),
      used(&m.AddGauge("ckpt_agent_memory_used_bytes", "Memory-tier bytes in use (holdings and leases)")),
      free(&m.AddGauge("ckpt_agent_memory_free_bytes", "Memory-tier bytes free")),
      leased(&m.AddGauge("ckpt_agent_memory_leased_bytes", "Memory-tier bytes reserved by open staging leases")),
      leased_ahead(&m.AddGauge("ckpt_agent_memory_leased_ahead_bytes",
                               "Of which leases clients asked for ahead of their next save (lease_ahead)")),
      capacity(&m.AddGauge("ckpt_agent_memory_capacity_bytes", "Memory-tier capacity")),
      flush_lag_bytes(&m.AddGauge("ckpt_agent_flush_lag_bytes", "Bytes chosen for flush and not yet durable")),
      flush_lag_seconds(
          &m.AddGauge("ckpt_agent_flush_lag_seconds", "Age of the oldest shard waiting to be flushed")),
      holdings(&m.AddGauge("ckpt_agent_holdings", "Committed shard copies held in memory")),
      registered(&m.AddGauge("ckpt_agent_registered", "1 while registered with ckpt-meta")),
      reservations(&m.AddGauge("ckpt_agent_memory_reservations",
                               "Live memory-tier reservations (holdings, leases, transfers in flight)")),
      parity_builds(&m.AddGauge("ckpt_agent_parity_builds", "EC parity segments being folded on this node")),
      pushes_receiving(&m.AddGauge("ckpt_agent_pushes_receiving", "Incoming pushes in progress")),
      open_leases(&m.AddGauge("ckpt_agent_open_leases", "Staging leases local clients hold (not yet committed)")),
      restorable_versions(&m.AddGauge("ckpt_agent_restorable_versions",
                                      "Versions meta said are restorable from memory, of which this node holds a "
                                      "copy: local loads of them do not ask meta")),
      open_handles(&m.AddGauge("ckpt_agent_open_handles",
                               "Restore handles local clients hold (each pins its copy's bytes)")),
      memory_dir_in_memory(&m.AddGauge("ckpt_agent_memory_dir_in_memory",
                                       "1 if the memory dir is on tmpfs or hugetlbfs, 0 if on a disk file system "
                                       "(the memory tier is then a disk file)")) {}

}  // namespace ckpt::agent
