// ckpt-meta --replica-of: one of N meta replicas sharing a log on etcd
// (docs/meta.md "Replicas"; the store and the log applier are
// server/meta/etcd/replicated_store.h).
//
// A replica starts as a follower: it applies the log to its own RocksDB store
// and campaigns in the election; it does not serve the MetaService (its port
// stays closed, so clients given every replica's address connect to the
// leader). Once elected it applies the rest of the log, and ckpt-meta opens
// its MetaCore on the replicated store and serves. A leader that loses its
// etcd lease (cut from etcd, paused past the lease) cannot write any more
// (fenced) and exits, for its supervisor to start it again as a follower.
//
// Thread safety: Lead() from one thread; the accessors from any.
#pragma once

#include <grpcpp/security/credentials.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/meta/store/meta_store.h"

namespace ckpt::daemon {

class StopRequest;

struct ReplicaSettings {
  std::vector<std::string> endpoints;  // etcd members, host:port
  std::string root;                    // the cluster's prefix in etcd, e.g. /ckpt/c1
  absl::Duration lease = absl::Seconds(5);
  std::string name;                    // shown as the leader (our listen address)
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // null: plaintext (loopback etcd only)
};

// Parses "etcd://HOST:PORT[,HOST:PORT...]/PREFIX" (PREFIX: one or more
// '/'-separated names of [A-Za-z0-9._-]). InvalidArgument naming what is wrong.
absl::StatusOr<ReplicaSettings> ParseReplicaOf(const std::string& url);

// Whether this binary was built with the etcd client (etcd's protos from
// golang-etcd-server-dev); without it --replica-of is refused.
bool ReplicasSupported();

// The cluster's data-plane key (data_plane_key.h) kept in the replicated
// store, so that every leader hands out the same: read, or made and
// committed (through the log) if absent. Errors: the store's.
absl::StatusOr<std::string> LoadOrCreateReplicatedDataPlaneKey(meta::MetaStore* store);

class MetaReplica {
 public:
  // Connects to etcd, opens a session (lease) and starts following the log
  // into `local`; while no member answers it keeps trying them for 30 s.
  // Errors: etcd's (UNAVAILABLE or DEADLINE_EXCEEDED when none answered).
  static absl::StatusOr<std::unique_ptr<MetaReplica>> Start(const ReplicaSettings& settings, meta::MetaStore* local);
  // Resigns (the next replica leads at once) and closes the session.
  virtual ~MetaReplica() = default;

  // Blocks until this replica leads and has applied the whole log: then OK,
  // and store() is where MetaCore opens. CANCELLED when `stop` was requested;
  // FAILED_PRECONDITION when the session was lost or the log cannot be
  // applied (damaged, local store failed).
  virtual absl::Status Lead(StopRequest* stop) = 0;
  // The replicated store (after Lead returned OK).
  virtual meta::MetaStore* store() = 0;
  // Blocks until the session is lost (leadership with it) or `timeout`;
  // returns why it was lost, or OK.
  virtual absl::Status WaitLost(absl::Duration timeout) = 0;

  // This replica's name and applied index, published in etcd under
  // <root>/replicas/ with its lease (gone a lease after it dies). Call every
  // second; errors are logged once, not returned.
  virtual void Publish() = 0;
  struct View {
    std::string name;
    bool leader = false;
    uint64_t applied_index = 0;
  };
  // Every replica as last published, the leader flagged. Errors: etcd's.
  virtual absl::StatusOr<std::vector<View>> Replicas() = 0;

  // For /readyz and /metrics: "leader", or "follower (leader: NAME)".
  virtual std::string Role() = 0;
  virtual bool leading() = 0;
  virtual uint64_t applied_index() = 0;
  // Counters of the leader's log appends (zero on a follower).
  virtual uint64_t entries_appended() = 0;
  virtual uint64_t groups_appended() = 0;
  virtual double append_seconds() = 0;
};

}  // namespace ckpt::daemon
