// Options of libckpt (ckpt/client.h): ClientOptions (Client::Connect) and
// LoadOptions (Client::Load). Plain values, copied by the calls that take
// them.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ckpt/types.h"

namespace ckpt {

struct ClientOptions;

// Values given to ClientOptions::FromEnvironment; a value left unset is taken
// from the environment (an explicit value always wins).
struct ClientEnvironmentGiven {
  std::optional<std::string> job;           // ClientOptions::job_id
  std::optional<uint32_t> rank;             // ClientOptions::rank
  std::optional<uint32_t> world_size;       // ClientOptions::world_size
  std::optional<std::string> meta;          // ClientOptions::meta_address
  std::optional<std::string> agent_socket;  // ClientOptions::agent_socket
};

// Where ClientOptions::FromEnvironment reads: a variable's value (nullopt:
// unset) and whether a path exists (for the default agent socket). Process()
// is the real one (getenv, stat); FromMap() a fixed set, for tests.
struct EnvironmentSource {
  std::function<std::optional<std::string>(const std::string& name)> variable;
  std::function<bool(const std::string& path)> path_exists;

  static EnvironmentSource Process();
  static EnvironmentSource FromMap(std::map<std::string, std::string> variables,
                                   std::vector<std::string> existing_paths = {});
};

struct ClientOptions {
  // ---- From the launcher's environment (torchrun, Slurm, Kubernetes) ----
  // Options with job_id, rank, world_size, meta_address and agent_socket
  // filled, each from the first place that has it (the same rules as
  // Python's ckpt.Client(); docs/python.md "Using ckpt from torchrun / Slurm
  // / Kubernetes"):
  //   job           given.job         $CKPT_JOB  $TORCHELASTIC_RUN_ID  $SLURM_JOB_ID
  //   rank          given.rank        $RANK  $SLURM_PROCID
  //   world_size    given.world_size  $WORLD_SIZE  $SLURM_NTASKS
  //   meta          given.meta        $CKPT_META
  //   agent_socket  given.agent_socket  $CKPT_AGENT_SOCKET  /run/ckpt/agent.sock (if it exists)
  // A variable set to blanks counts as unset, and so does torchrun's run id
  // "none" (its default without --rdzv_id). Every other option keeps its
  // default; TLS files and the token are read from $CKPT_TLS_* and
  // $CKPT_TOKEN_FILE / $CKPT_TOKEN by Client::Connect itself.
  // kInvalidArgument naming, for each value found nowhere, every place looked
  // at; a rank or world size that is not an integer >= 0 (in 32 bits); and a
  // rank not below the world size. `sources`, when not null, gets where each
  // value came from ("given", "$RANK", "default").
  static absl::StatusOr<ClientOptions> FromEnvironment(
      const ClientEnvironmentGiven& given = {},
      std::map<std::string, std::string>* sources = nullptr);
  // The same, reading `env` instead of the process's environment.
  static absl::StatusOr<ClientOptions> FromEnvironment(
      const ClientEnvironmentGiven& given, const EnvironmentSource& env,
      std::map<std::string, std::string>* sources = nullptr);

  // ckpt-meta's gRPC address, "host:port" (any gRPC target string works),
  // or the addresses of meta's replicas, "10.0.0.1:7400,10.0.0.2:7400,..."
  // (IP literals): calls go to the replica that leads, and follow a takeover.
  // Required.
  std::string meta_address;
  // TLS to ckpt-meta (docs/security.md): PEM files of the CA that signed
  // meta's certificate, and of this client's certificate and key (meta with
  // mutual TLS requires them). Empty: $CKPT_TLS_CA, $CKPT_TLS_CERT,
  // $CKPT_TLS_KEY; all empty: plaintext. (The agent is reached over its
  // local socket, guarded by the socket's mode.)
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // A trainer token for this job (ckpt-meta --trainer-tokens-file;
  // docs/security.md), sent to meta on every call: the file holding it (mode
  // 0600 or 0640). Empty: $CKPT_TOKEN_FILE, else $CKPT_TOKEN; none: no token.
  std::string token_file;
  // Path of the node agent's unix socket (its <run-dir>/agent.sock). A value
  // starting with "unix:" is used as a gRPC target as is.
  std::string agent_socket = "/run/ckpt/agent.sock";
  // Job id, [a-z0-9][a-z0-9._-]{0,62} without "..". Required.
  std::string job_id;
  // This process's rank, 0 <= rank < world_size.
  uint32_t rank = 0;
  // Number of ranks of the job (1..1,048,576). Compared with the stored job.
  uint32_t world_size = 0;
  // The job may have another world size than the stored one: a relaunch on
  // more or fewer ranks, which restores by resharding (LoadSlice, or
  // LoadOptions::rank; docs/python.md "Another layout"). Rank 0 changes the
  // stored size (each version keeps the size it was saved with; versions
  // still OPEN at the old size are aborted); the other ranks wait for it.
  // Off: a different size is kFailedPrecondition at Connect.
  bool resize_world = false;
  // Identifies this training run (one launch of all ranks; a restarted
  // launch should use a new one). A version begun by another run is aborted
  // and replaced when this run saves the same step, so shards of two runs
  // never mix. Empty: no run tracking.
  std::string run_id;

  // ---- Job spec, used by rank 0 to create the job (create-or-open) ----
  // Unset (the default): a job that exists keeps its stored protection (an
  // operator's `ckptctl create-job --replicate 2`, say), and a job rank 0
  // creates gets the server's default (docs/meta.md: replicate{2, ring} when
  // the cluster has at least two alive nodes, none on a single node). Set:
  // the job is created with it, and an existing job must have it
  // (kFailedPrecondition naming both otherwise).
  std::optional<Protection> protection;
  // Flush every Nth version / every N seconds to the durable tier (0: rule
  // off). Left at 0 both, the stored flush policy is not compared.
  uint32_t flush_every_n_versions = 0;
  uint32_t flush_every_seconds = 0;
  // Versions kept in memory / in the durable tier; 0 = server default. Left
  // at 0 both, the stored retention is not compared.
  uint32_t keep_in_memory = 0;
  uint32_t keep_durable = 0;
  // Free-form labels stored with the job when rank 0 creates it (not compared).
  std::map<std::string, std::string> labels;

  // ---- Timing ----
  // How long Connect keeps trying: meta or the agent unreachable, or (ranks
  // other than 0) the job not yet created by rank 0.
  absl::Duration connect_timeout = absl::Seconds(30);
  // Deadline of each short control call (lease, commit, latest, locate, ...).
  absl::Duration rpc_timeout = absl::Seconds(60);
  // Deadline of OpenShard, which blocks while the agent fetches a shard that
  // is not local (from a peer, by EC decode, or from disk).
  absl::Duration load_timeout = absl::Minutes(10);

  // ---- Save ----
  // True (the default): SaveBuilder::Commit returns once the bytes are
  // copied, and the commit (the manifest, one local call whose cost grows
  // with the number of items) goes to the agent in the background; its
  // outcome is SaveHandle::Committed (and the start of SaveHandle::Wait).
  // This client's own Load, LoadInto, WaitVersion and Latest wait for its
  // commits first. False: Commit waits for the agent's answer.
  bool commit_in_background = true;
  // True (the default): once a save that copied every item committed, and
  // the last two such saves were at steps P < S, the client asks its agent
  // for the staging lease of step S + (S - P) at once (the same size), so
  // that a trainer saving at a fixed interval finds its next lease granted
  // when it begins that save (docs/agent.md "Save path"). The agent begins
  // such a version at meta only when a shard is committed into it; a save at
  // another step releases it and asks as before. It holds pool memory of one
  // shard between saves.
  bool lease_ahead = true;
  // Incremental saves (ItemChange, SaveBuilder::CarryRest): a save whose
  // step reaches a multiple of N that its base's step had not (N, 2N, ...,
  // the same steps on every rank) is made in full: a reference points to
  // the version that holds the bytes, which stays in memory (whole) while
  // referred to, so this bounds how many old versions are kept. 0: never
  // forced. Partial saves (CarryRest) are never forced full.
  uint32_t full_save_every = 10;
};

// How Client::Load opens a shard.
struct LoadOptions {
  // True: every item's crc32c is checked before Load returns: by the client
  // (one pass over the shard against its crc32c, item by item only if that
  // fails; on a second thread while it lists the items, for a shard of 1 MiB
  // or more), and on a mismatch once more by the agent, which quarantines a copy
  // that fails and serves the next source (docs/protocol.md "Restore").
  // False: nothing is checked, and the caller reads items only through
  // LoadedShard::CopyItem, which checks each one while copying; on kDataLoss,
  // load again with verify = true. Saves one pass over the shard when every
  // item is copied anyway.
  bool verify = true;
  // The rank whose shard to load (0 <= rank < the version's world size):
  // unset, this client's own. Another rank's shard (a job relaunched with
  // another world size restoring by resharding: ClientOptions::resize_world)
  // is read from the same sources, in the same order, as one's own: a copy
  // the local agent holds, a peer's, EC decode, the durable tier. It never
  // becomes this client's base for incremental saves.
  std::optional<uint32_t> rank = std::nullopt;
};

}  // namespace ckpt
