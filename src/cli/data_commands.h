// ckptctl commands that move or check checkpoint bytes while the cluster runs:
// `save` (a file as one rank's shard, through the local agent and the C++
// client), `restore` (every rank from the best live source, each chunk and
// item crc-checked), `verify` (every holder re-reads and checks its copies).
//
// Each returns the process exit code (0 ok, 1 failure with the reason on
// stderr) and prints a table, or one JSON document with `json`.
#pragma once

#include <grpcpp/security/credentials.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "cli/progress.h"
#include "common/grpc_security.h"

namespace ckpt::cli {

struct DataOptions {
  std::string meta;          // host:port of ckpt-meta
  std::string agent_socket;  // the local agent's socket (save)
  double timeout_s = 30;
  bool json = false;
  // For ckpt-meta and the agents' gRPC endpoints (plaintext or TLS).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // Sent with every call, to meta and to the agents (--token-file).
  std::string token;
  // What `save` hands its ckpt::Client: the TLS files and the token file
  // (empty: the client reads CKPT_TLS_* and CKPT_TOKEN_FILE / CKPT_TOKEN).
  TlsFiles tls;
  std::string token_file;
  // Progress of save and restore on stderr (--progress, --quiet).
  ProgressMode progress;
  // Set by a restore while it runs: counts the bytes written.
  Progress* meter = nullptr;
};

// With --json: errors go to stderr as {"error": {"code", "message"}}.
void SetJsonErrors(bool on);

// Stores `file` as rank `rank`'s shard of (job, step): one item named after
// the file, dtype bytes. world_size 0: the job must exist (its size is used).
int SaveFile(const DataOptions& o, const std::string& job, uint64_t step, uint32_t rank,
             uint32_t world_size, const std::string& file);

// Writes each rank's shard of (job, step) (or only `rank`) to
// `out_dir/rank-NNNNN.bin`, read from the best live copy (the agents that
// hold it, over gRPC ReadShard), checking every chunk's and item's crc32c and
// trying the next source on a mismatch. Shards of any size are streamed to
// their file chunk by chunk (bounded memory); a rank file appears complete
// and checked, or not at all. A full restore also writes
// manifest.json and COMMITTED, so `out_dir` is a durable-tier version
// directory (`restore --from-dir` and the Python reader load it).
// Before writing, temporary files of earlier restores into `out_dir` whose
// process is gone are removed (SweepStaleRestoreTempFiles) and counted in
// the output; a full restore first removes a COMMITTED marker already there
// (the directory is being rewritten), so a restore interrupted part-way never
// leaves it looking committed. Call StartInterruptWatcher first (Ctrl-C).
int RestoreOnline(const DataOptions& o, const std::string& job, uint64_t step,
                  std::optional<uint32_t> rank, const std::string& out_dir);

// Copies the committed durable version at `from_dir` to `out_dir`, verifying
// every item's and file's crc32c, and commits it there (manifest.json, then
// COMMITTED: WriteDurableManifest), so `out_dir` is itself a loadable version
// directory (ReadDurableManifest, ckpt.read_durable). A self-contained shard
// is streamed chunk by chunk; an incremental one (format 2) is laid out in
// memory as a self-contained one (format 1). Stale temporary files and an
// old COMMITTED marker as for RestoreOnline.
int RestoreFromDir(const DataOptions& o, const std::string& from_dir, const std::string& out_dir);

// RestoreFromDir into another world size (docs/python.md "Another layout"):
// `out_dir` becomes a committed version of `world_size` ranks whose rank r
// holds, of every global tensor of the version at `from_dir` (items with
// ckpt.global_* attributes), the part tensor_split gives rank r along the
// dimension `splits` names for it (the first ones one longer when it does
// not divide), or the whole tensor when `splits` names none. Items keep
// their global attributes (the result reshards again) and are named by the
// global name; items of no global tensor (a rank's own state) are left out,
// and counted. Reads only the items that overlap each part, each whole and
// crc-checked (ReadDurableSlices); one new rank in memory at a time. Exit 2
// for a split naming no global tensor or a dimension it does not have.
int RestoreResharded(const DataOptions& o, const std::string& from_dir, const std::string& out_dir,
                     uint32_t world_size, const std::map<std::string, uint32_t>& splits);

// A version in memory (the agents holding it) into another world size:
// RestoreOnline of every rank into a hidden directory in `out_dir`
// (".reshard-source-<pid>": the old layout, every checksum verified), then
// RestoreResharded from it into `out_dir`, then the hidden directory is
// removed (also on failure). With --json only RestoreResharded's result is
// printed. Needs the disk space of the version twice while it runs.
int RestoreOnlineResharded(const DataOptions& o, const std::string& job, uint64_t step, const std::string& out_dir,
                           uint32_t world_size, const std::map<std::string, uint32_t>& splits);

// Asks every node holding copies of (job, step) to re-read and check them
// (AgentService.Verify); prints each finding. Exit 1 if any copy is bad or a
// holder cannot be asked.
int VerifyVersion(const DataOptions& o, const std::string& job, uint64_t step);

// Lists what node `node` holds in its memory tier (AgentService.GetInventory on
// the address meta has for it), optionally only `job`'s: one row per shard
// copy or EC segment with its role or kind, size, state and when it was stored.
int NodeHoldings(const DataOptions& o, const std::string& node, const std::string& job);

}  // namespace ckpt::cli
