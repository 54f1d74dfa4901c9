// Who may call what on ckpt-meta's and the agents' TCP ports: the caller's
// certificate identity (docs/security.md "Identities").
//
// A daemon that serves mutual TLS (the default; --insecure is for loopback
// test clusters only) knows each caller by the ckpt identity its certificate
// carries (common/pki.h: ckpt://node/<id>, ckpt://admin/<name>,
// ckpt://operator/<name>, ckpt://trainer/<name> with ckpt://job/<pattern>s).
// The rules, in one place:
//
//   meta, agent RPCs (RegisterNode, Heartbeat, WatchTasks, ReportTaskResult,
//     ReportInventory, ReportShards, BeginVersion): a node, acting only as
//     itself (the request's node id must be the certificate's).
//   meta, admin RPCs (DeleteVersion, DeleteJob, UpdateJob, DrainNode, UndrainNode,
//     RemoveNode): an admin.
//   meta, job RPCs: an admin; a node or an operator for reads only (agents
//     look jobs up for their trainers); a trainer for the jobs its
//     certificate names.
//   meta, cluster-wide reads (ListJobs, ListNodes, ClusterStatus): any
//     identity; ListJobs shows a trainer only its jobs.
//   agent TCP port: an admin; an operator for what returns no shard bytes
//     and changes nothing (status, inventory, verify); a trainer for reads
//     of its jobs (OpenShard, ReadShard, CloseShard, DeliverShard, verify).
//     A DPU agent also takes the trainers' calls (saves, restores, status;
//     any job, never flush, evict or pause) from one node: its host
//     (--host-node), whose ckpt-dpu-proxy carries the host's agent.sock to
//     it (docs/dpu.md); no other node calls an agent's port. The local unix
//     sockets are guarded by their mode and group (the kernel), not here.
//   meta, RegisterNode of a DPU: the host it claims to serve (host_node_id)
//     must be the one its certificate names (ckpt://host/<id>), and a host
//     agent's certificate names none.
//
// The tokens (common/grpc_security.h: admin, agent, trainer tokens) are
// checked as before on top of the identity when configured. Without TLS
// (--insecure, loopback only) there is no identity and only the tokens
// count.
//
// A refusal is UNAUTHENTICATED when the caller shows no ckpt identity (a
// certificate of the CA without one), PERMISSION_DENIED when its identity
// may not make the call; the message names the RPC, the identity and what it
// would need. Nothing runs on a refusal.
//
// Thread safety: the functions are pure; Authorizer is immutable after
// construction and may be shared by every handler thread.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "common/grpc_security.h"
#include "common/pki.h"

namespace ckpt::rpc {

// The ckpt identity of a call's certificate: nullopt when the call carries no
// TLS peer (plaintext, the unix socket); InvalidArgument when the certificate
// carries no ckpt identity or a malformed one.
absl::StatusOr<std::optional<pki::Identity>> CallerIdentity(const grpc::ServerContextBase& ctx);

// "ckpt://node/n1" etc., for messages.
std::string IdentityText(const pki::Identity& id);

enum class Access {
  kRead,       // looks at jobs, versions, holdings, checks (no shard bytes)
  kReadBytes,  // returns a shard's bytes (OpenShard, ReadShard)
  kWrite,      // creates or changes (a job, a flush, a lease, an eviction)
  kOwnHandle,  // acts on a handle the caller opened (CloseShard, DeliverShard): its id is unguessable
  kSave,       // saves into the agent's memory: a lease, its commit or abort (AcquireStagingLease,
               // CommitShard, AbortLease)
};

// The agent port's rule for a TCP caller known by `who` (the file comment).
// `host_node`: the node whose certificate may make trainer calls (a DPU
// agent's --host-node); "" for a host agent.
grpc::Status AgentPortDecision(const pki::Identity& who, const std::string& host_node, const std::string& job_id,
                               Access access, const char* rpc);

// Meta, RegisterNode by `who` (a node): the host it claims to serve
// (`host_node_id`, "" for a host agent) must be the one its certificate
// names (pki::Identity::host_node).
grpc::Status HostClaimDecision(const pki::Identity& who, const std::string& host_node_id, const char* rpc);

class Authorizer {
 public:
  // `require_identity`: the daemon serves mutual TLS, so every TCP caller
  // must carry a ckpt identity. `tokens`: checked on top, as configured.
  // `host_node`: on a DPU agent's port, its --host-node (AgentPortDecision).
  Authorizer(bool require_identity, CallerTokens tokens, std::string host_node = "");

  bool require_identity() const { return require_identity_; }

  // Meta: an RPC only agents make, by node `node_id` ("" when the request
  // names none).
  grpc::Status AgentCall(const grpc::ServerContextBase& ctx, const std::string& node_id, const char* rpc) const;
  // Meta, RegisterNode (after AgentCall): HostClaimDecision on the caller's
  // identity; OK without TLS (no identity).
  grpc::Status HostClaim(const grpc::ServerContextBase& ctx, const std::string& host_node_id, const char* rpc) const;
  // Meta: an admin RPC.
  grpc::Status AdminCall(const grpc::ServerContextBase& ctx, const char* rpc) const;
  // Meta: a job RPC (`job_id` set) or a cluster-wide read (`job_id` empty).
  grpc::Status JobCall(const grpc::ServerContextBase& ctx, const std::string& job_id, Access access,
                       const char* rpc) const;
  // The job patterns a caller may see in a listing: nullopt for every job.
  std::optional<std::vector<std::string>> VisibleJobs(const grpc::ServerContextBase& ctx) const;

  // An agent's TCP port: calls from the local unix socket pass; TCP callers
  // as the file comment says. `job_id` is the job a read touches ("" for
  // node-wide calls: inventory, status, evict, flush, pause).
  grpc::Status AgentPortCall(const grpc::ServerContextBase& ctx, const std::string& job_id, Access access,
                             const char* rpc) const;

 private:
  // The identity of a TCP caller when one is required; an error Status when
  // the call must be refused for the lack of one. nullopt when no identity
  // is required (insecure).
  absl::StatusOr<std::optional<pki::Identity>> Required(const grpc::ServerContextBase& ctx, const char* rpc) const;

  const bool require_identity_;
  const CallerTokens tokens_;
  const std::string host_node_;
};

}  // namespace ckpt::rpc
