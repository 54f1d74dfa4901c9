// Caller authorization by certificate identity; see authorize.h.
#include "server/rpc/authorize.h"

#include <grpc/grpc_security_constants.h>

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ckpt::rpc {
namespace {

grpc::Status Denied(const char* rpc, const std::string& what) {
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, absl::StrCat(rpc, ": ", what));
}

bool TrainerMayUse(const pki::Identity& id, const std::string& job_id) {
  for (const std::string& p : id.jobs) {
    if (JobPatternMatches(p, job_id)) return true;
  }
  return false;
}


}  // namespace

absl::StatusOr<std::optional<pki::Identity>> CallerIdentity(const grpc::ServerContextBase& ctx) {
  std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return std::optional<pki::Identity>();
  std::vector<std::string> uris;
  for (const grpc::string_ref& v : auth->FindPropertyValues(GRPC_PEER_URI_PROPERTY_NAME)) {
    uris.emplace_back(v.data(), v.size());
  }
  absl::StatusOr<pki::Identity> id = pki::IdentityFromUris(uris);
  if (!id.ok()) return id.status();
  return std::optional<pki::Identity>(*std::move(id));
}

std::string IdentityText(const pki::Identity& id) {
  std::string out = absl::StrCat("ckpt://", std::string(pki::RoleName(id.role)));
  if (!id.name.empty()) absl::StrAppend(&out, "/", id.name);
  if (!id.jobs.empty()) absl::StrAppend(&out, " (jobs ", absl::StrJoin(id.jobs, ","), ")");
  if (!id.host_node.empty()) absl::StrAppend(&out, " (a DPU of host ", id.host_node, ")");
  return out;
}

Authorizer::Authorizer(bool require_identity, CallerTokens tokens, std::string host_node)
    : require_identity_(require_identity), tokens_(std::move(tokens)), host_node_(std::move(host_node)) {}

absl::StatusOr<std::optional<pki::Identity>> Authorizer::Required(const grpc::ServerContextBase& ctx,
                                                                  const char* rpc) const {
  if (!require_identity_) return std::optional<pki::Identity>();
  absl::StatusOr<std::optional<pki::Identity>> id = CallerIdentity(ctx);
  if (!id.ok()) {
    return absl::UnauthenticatedError(absl::StrCat(
        rpc, ": the caller's certificate carries no usable ckpt identity (", id.status().message(),
        "); issue one with `ckptctl certs create-node|create-client` (docs/security.md)"));
  }
  if (!id->has_value()) {
    return absl::UnauthenticatedError(
        absl::StrCat(rpc, ": the caller presented no certificate (mutual TLS is required)"));
  }
  return id;
}

namespace {
grpc::Status ToGrpc(const absl::Status& s) {
  return grpc::Status(s.code() == absl::StatusCode::kUnauthenticated ? grpc::StatusCode::UNAUTHENTICATED
                                                                      : grpc::StatusCode::PERMISSION_DENIED,
                      std::string(s.message()));
}
}  // namespace

grpc::Status Authorizer::AgentCall(const grpc::ServerContextBase& ctx, const std::string& node_id,
                                   const char* rpc) const {
  absl::StatusOr<std::optional<pki::Identity>> id = Required(ctx, rpc);
  if (!id.ok()) return ToGrpc(id.status());
  if (id->has_value()) {
    const pki::Identity& who = **id;
    if (who.role != pki::Role::kNode) {
      return Denied(rpc, absl::StrCat("an agent call needs a node certificate; the caller is ", IdentityText(who)));
    }
    if (!node_id.empty() && node_id != who.name) {
      return Denied(rpc, absl::StrCat("the request is for node \"", node_id, "\" but the caller's certificate is ",
                                      IdentityText(who), ": a node may act only as itself"));
    }
  }
  return CheckAgentToken(ctx, tokens_.agent, tokens_.admin, rpc);
}

grpc::Status HostClaimDecision(const pki::Identity& who, const std::string& host_node_id, const char* rpc) {
  if (who.host_node == host_node_id) return grpc::Status::OK;
  if (host_node_id.empty()) {
    return Denied(rpc, absl::StrCat("the caller's certificate ", IdentityText(who), " is a DPU's, serving host \"",
                                    who.host_node, "\": register as ckpt-dpu-agent --host-node ", who.host_node));
  }
  const std::string issue = absl::StrCat("`ckptctl certs create-node --node-id ", who.name, " --host-node ",
                                         host_node_id, " --host ...`");
  if (who.host_node.empty()) {
    return Denied(rpc, absl::StrCat("the request claims to serve host \"", host_node_id,
                                    "\" but the caller's certificate ", IdentityText(who),
                                    " names no host (no ckpt://host/ URI): a DPU's certificate must name the host it "
                                    "serves; issue it with ",
                                    issue));
  }
  return Denied(rpc, absl::StrCat("the request claims to serve host \"", host_node_id,
                                  "\" but the caller's certificate ", IdentityText(who), " names host \"",
                                  who.host_node, "\": a DPU serves only the host its certificate names (", issue, ")"));
}

grpc::Status Authorizer::HostClaim(const grpc::ServerContextBase& ctx, const std::string& host_node_id,
                                   const char* rpc) const {
  absl::StatusOr<std::optional<pki::Identity>> id = Required(ctx, rpc);
  if (!id.ok()) return ToGrpc(id.status());
  if (!id->has_value()) return grpc::Status::OK;  // --insecure: no identities
  return HostClaimDecision(**id, host_node_id, rpc);
}

grpc::Status Authorizer::AdminCall(const grpc::ServerContextBase& ctx, const char* rpc) const {
  absl::StatusOr<std::optional<pki::Identity>> id = Required(ctx, rpc);
  if (!id.ok()) return ToGrpc(id.status());
  if (id->has_value() && (*id)->role != pki::Role::kAdmin) {
    return Denied(rpc, absl::StrCat("an admin call needs an admin certificate (ckptctl certs create-client --role "
                                    "admin); the caller is ",
                                    IdentityText(**id)));
  }
  return CheckAdminToken(ctx, tokens_.admin, rpc);
}

grpc::Status Authorizer::JobCall(const grpc::ServerContextBase& ctx, const std::string& job_id, Access access,
                                 const char* rpc) const {
  absl::StatusOr<std::optional<pki::Identity>> id = Required(ctx, rpc);
  if (!id.ok()) return ToGrpc(id.status());
  if (id->has_value()) {
    const pki::Identity& who = **id;
    switch (who.role) {
      case pki::Role::kAdmin:
        break;
      case pki::Role::kNode:
        // Agents read jobs for their trainers (GetJob, Locate); they never
        // create jobs or ask for flushes.
        if (access != Access::kRead) {
          return Denied(rpc, absl::StrCat("it changes job \"", job_id, "\" and ", IdentityText(who),
                                          " is a node: agents read jobs, trainers and admins change them"));
        }
        break;
      case pki::Role::kOperator:
        if (access != Access::kRead) {
          return Denied(rpc, absl::StrCat("it changes job \"", job_id, "\" and ", IdentityText(who),
                                          " is an operator (read-only)"));
        }
        break;
      case pki::Role::kTrainer:
        if (!job_id.empty() && !TrainerMayUse(who, job_id)) {
          return Denied(rpc, absl::StrCat("job \"", job_id, "\" is not one ", IdentityText(who), " may use"));
        }
        break;
      case pki::Role::kMeta:
        return Denied(rpc, absl::StrCat(IdentityText(who), " is a meta certificate, not a caller's"));
    }
  }
  return CheckJobCaller(ctx, tokens_, job_id, rpc);
}

std::optional<std::vector<std::string>> Authorizer::VisibleJobs(const grpc::ServerContextBase& ctx) const {
  std::optional<std::vector<std::string>> by_token = ckpt::VisibleJobs(ctx, tokens_);
  if (!require_identity_) return by_token;
  absl::StatusOr<std::optional<pki::Identity>> id = CallerIdentity(ctx);
  if (!id.ok() || !id->has_value()) return std::vector<std::string>();
  if ((*id)->role != pki::Role::kTrainer) return by_token;
  if (!by_token) return (*id)->jobs;
  // Both limit the caller: a job shows if a pattern of each matches it. Keep
  // the certificate's patterns that a token pattern covers exactly, which is
  // what a trainer with one token and one certificate for its jobs has.
  std::vector<std::string> both;
  for (const std::string& p : (*id)->jobs) {
    for (const std::string& t : *by_token) {
      if (t == "*" || t == p || (absl::EndsWith(t, "*") && absl::StartsWith(p, t.substr(0, t.size() - 1)))) {
        both.push_back(p);
        break;
      }
    }
  }
  return both;
}

grpc::Status AgentPortDecision(const pki::Identity& who, const std::string& host_node, const std::string& job_id,
                               Access access, const char* rpc) {
  switch (who.role) {
    case pki::Role::kAdmin:
      return grpc::Status::OK;
    case pki::Role::kOperator:
      if (access == Access::kRead) return grpc::Status::OK;
      return Denied(rpc, absl::StrCat(IdentityText(who),
                                      " is an operator: it may read an agent's status, inventory and checks, not "
                                      "shards, and change nothing (an admin certificate may)"));
    case pki::Role::kTrainer:
      if (access == Access::kOwnHandle) return grpc::Status::OK;
      if ((access == Access::kRead || access == Access::kReadBytes) && !job_id.empty() &&
          TrainerMayUse(who, job_id)) {
        return grpc::Status::OK;
      }
      return Denied(rpc, absl::StrCat(IdentityText(who), " may only read shards of its jobs on an agent's port",
                                      job_id.empty() ? std::string() : absl::StrCat(", not of job \"", job_id, "\"")));
    case pki::Role::kNode:
      // A DPU agent's host: its ckpt-dpu-proxy carries the host's agent.sock
      // here, so its calls are the trainers' of that host, whom the socket's
      // group admitted: saves and restores of any job, as on agent.sock.
      // Node-wide changes stay an admin's.
      if (!host_node.empty() && who.name == host_node && who.host_node.empty()) {
        if (access != Access::kWrite) return grpc::Status::OK;
        return Denied(rpc, absl::StrCat(IdentityText(who), " is this DPU agent's host: through its ckpt-dpu-proxy it "
                                                           "makes the trainers' calls (saves, restores, status), "
                                                           "not flush, evict or pause (an admin certificate may)"));
      }
      if (!host_node.empty()) {
        return Denied(rpc, absl::StrCat(IdentityText(who), " may not call this agent's port: of the nodes only "
                                                           "ckpt://node/",
                                        host_node,
                                        ", the host this DPU agent serves (--host-node), may, through its "
                                        "ckpt-dpu-proxy"));
      }
      break;
    case pki::Role::kMeta:
      break;
  }
  return Denied(rpc, absl::StrCat(IdentityText(who), " may not call an agent's port (tools use admin, operator or "
                                                     "trainer certificates)"));
}

grpc::Status Authorizer::AgentPortCall(const grpc::ServerContextBase& ctx, const std::string& job_id,
                                       Access access, const char* rpc) const {
  if (absl::StartsWith(ctx.peer(), "unix:")) return grpc::Status::OK;  // the kernel checked the socket's group
  if (!require_identity_) return CheckAdminToken(ctx, tokens_.admin, rpc);
  absl::StatusOr<std::optional<pki::Identity>> id = Required(ctx, rpc);
  if (!id.ok()) return ToGrpc(id.status());
  return AgentPortDecision(**id, host_node_, job_id, access, rpc);
}

}  // namespace ckpt::rpc
