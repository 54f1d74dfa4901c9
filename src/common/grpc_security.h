// gRPC credentials from a process's TLS files and bearer tokens
// (docs/security.md).
//
// TLS: a CA bundle, a certificate and its key, all PEM files. A server with
// all three serves TLS and requires every caller to present a certificate the
// CA signed (mutual TLS); a client with the CA verifies the server, and with
// a certificate and key also proves who it is. Nothing set: plaintext (the
// quickstart's loopback cluster), which daemons log as a warning when they
// listen beyond loopback.
//
// Tokens: a caller sends "authorization: Bearer TOKEN"; a server that has an
// admin token refuses the admin RPCs (deleting versions and jobs, draining and
// removing nodes) without it (UNAUTHENTICATED) or with another one
// (PERMISSION_DENIED), and changes nothing.
//
// Thread safety: the functions are pure; the credentials they return are
// gRPC's (thread-safe).
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ckpt {

struct TlsFiles {
  std::string ca_file;    // PEM: the CA that signs the peers' certificates
  std::string cert_file;  // PEM: this process's certificate (chain)
  std::string key_file;   // PEM: its private key
  // Re-read the three files every this many seconds (0: read once, at
  // start). A new certificate, key or CA bundle then applies to new
  // connections without a restart, on servers and on callers (an agent's
  // channel to meta); files that do not match (a key without its
  // certificate, half-written) are logged by gRPC and the previous ones stay
  // in use.
  uint32_t reload_seconds = 0;
  // A directory of certificate revocation lists, hashed as OpenSSL looks
  // them up (`openssl rehash DIR`: <hash>.r0, ...). On a server, a caller
  // whose certificate a CRL there revokes is refused; on a caller, a server
  // whose certificate is revoked is. A CA with no CRL there is not checked.
  // Read by gRPC at each handshake, so a new CRL applies at once.
  std::string crl_dir;
  // Callers only: the ckpt identity the server's certificate must carry, as
  // a URI subjectAltName ("ckpt://meta", "ckpt://node/<id>"; common/pki.h).
  // Set, the server is checked by that identity instead of by its host name
  // (its address may be any the cluster uses), before anything is sent.
  // Empty: the server's name is checked against its certificate.
  std::string expect_peer_uri;
  bool enabled() const { return !ca_file.empty() || !cert_file.empty() || !key_file.empty(); }
};

// Fills unset fields from CKPT_TLS_CA, CKPT_TLS_CERT, CKPT_TLS_KEY,
// CKPT_TLS_CRL_DIR.
void TlsFilesFromEnvironment(TlsFiles* files);

// Checks the files as ServerCredentials (server) or ChannelCredentials would,
// without touching gRPC (daemons check their flags before they block signals,
// and gRPC starts threads when first used), and parses them with OpenSSL:
// InvalidArgument naming the flag and the problem when --tls-ca is not a CA
// certificate (or has expired), --tls-cert is not a certificate, has expired
// or is not yet valid, --tls-key is not a private key or does not match the
// certificate, or is a file other users may read or change (the rules of
// common/secret_file.h, a link followed: owned by this process's user or
// root, mode no wider than 0640), or the certificate's extended key usage
// lacks serverAuth
// (server) or clientAuth (a caller: !server, or also_client for a daemon
// that also calls another, as an agent calls meta).
absl::Status CheckTlsFiles(const TlsFiles& files, bool server, bool also_client = false);

// Plaintext when !files.enabled(); otherwise TLS requiring and verifying
// client certificates. InvalidArgument naming the file when one is missing,
// unreadable or not PEM; a server needs all three.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsFiles& files);

// Plaintext when !files.enabled(); otherwise TLS verifying the server with
// the CA (required) and its name against the certificate (or, with
// expect_peer_uri, its identity: a server without it fails the handshake,
// UNAVAILABLE, and the log names the identity it carried), presenting the
// certificate and key if both are given; with reload_seconds, crl_dir or
// expect_peer_uri, gRPC's TLS credentials that re-read the files and check
// the CRLs.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(const TlsFiles& files);

// The token in `path` (surrounding whitespace removed). InvalidArgument when
// the file is not one common/secret_file.h ReadSecretFile accepts (opened
// without following a symlink; owner this process's euid or root; mode no
// wider than 0640; checked on the opened descriptor), is empty, or holds
// fewer than kMinTokenChars (22: 128 bits) characters (the message says how
// to make a good one).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// A token for outgoing calls: `token` if set, else the file CKPT_TOKEN_FILE
// names, else CKPT_TOKEN; empty if none. InvalidArgument for a token file
// ReadTokenFile refuses, or a CKPT_TOKEN shorter than 22 characters.
absl::StatusOr<std::string> TokenFromEnvironment(const std::string& token_file);

// Channel arguments for a daemon's or trainer's long-lived channel: after a
// peer restarts, reconnect within a second (gRPC's default backoff grows to
// 2 minutes), but give each connection attempt (TCP and the TLS handshake)
// gRPC's default 20 s. gRPC 1.51 takes an attempt's minimum time from
// GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, so setting that to 100 ms (as we did)
// capped an attempt at about a second, and TLS handshakes on a loaded node
// (ASan in CI beside other tests) never finished: "tcp handshaker shutdown".
// No limit on message sizes (manifests of big models run to megabytes).
// For a channel to a list of addresses (GrpcTargetOf) the connect timeout is
// left to SetFailoverArgs, which the caller must then also call.
void SetReconnectArgs(grpc::ChannelArguments* args, const std::string& addresses = "");

// The gRPC target for `addresses`: one "host:port" as it is; a list of IP
// literals "10.0.0.1:7400,10.0.0.2:7400" (or "[::1]:7400,[::1]:7401") as
// gRPC's ipv4:/ipv6: target, whose channel connects to the first address that
// accepts and moves on when it goes away. That is how callers follow meta's
// leader: only the leading replica listens. A DNS name resolving to several
// addresses works the same way, given alone.
std::string GrpcTargetOf(const std::string& addresses);

// For a channel to several addresses (GrpcTargetOf): keepalive pings every
// 2 s (a leader that stopped answering -- paused, or its machine cut off --
// is given up within about 5 s, and the channel moves on to the next address
// instead of waiting for TCP to notice), and a connect attempt's timeout of
// 5 s (an address that accepts but never completes the TLS handshake costs
// that, not gRPC's 20 s). Nothing for a single address.
void SetFailoverArgs(const std::string& addresses, grpc::ChannelArguments* args);
// What a server those channels call must allow: their pings every 2 s.
void SetFailoverServerArgs(grpc::ServerBuilder* builder);

// Adds "authorization: Bearer TOKEN" to a call (nothing if token is empty).
void AddToken(grpc::ClientContext* ctx, const std::string& token);

// A channel to `addresses` (GrpcTargetOf, with SetFailoverArgs) whose every
// call carries "authorization: Bearer TOKEN" (a plain channel when token is
// empty).
std::shared_ptr<grpc::Channel> ChannelWithToken(const std::string& addresses,
                                                std::shared_ptr<grpc::ChannelCredentials> credentials,
                                                const grpc::ChannelArguments& given, const std::string& token);

// OK if `ctx` carries `admin_token` (or no admin token is configured);
// UNAUTHENTICATED without a token, PERMISSION_DENIED with another one; the
// message names the RPC.
grpc::Status CheckAdminToken(const grpc::ServerContextBase& ctx, const std::string& admin_token,
                             const char* rpc);

// For the RPCs only agents make (RegisterNode, Heartbeat, ...): OK if no
// agent token is configured, or `ctx` carries it or the admin token.
grpc::Status CheckAgentToken(const grpc::ServerContextBase& ctx, const std::string& agent_token,
                             const std::string& admin_token, const char* rpc);

// A trainer identity (ckpt-meta --trainer-tokens-file): a token and the jobs
// it may use. A job pattern is a job id ("gpt-7b"), a prefix of one ending in
// '*' ("exp-*"), or "*" (every job).
struct TrainerToken {
  std::string token;
  std::vector<std::string> jobs;
};

// Parses a trainer tokens file: one identity per line, "TOKEN JOB[,JOB...]";
// blank lines and lines starting with '#' are skipped. InvalidArgument naming
// `path` and the line for a bad pattern, a token shorter than 22 characters
// (128 bits) or one used twice. (Read with ReadTrainerTokensFile: owner and
// mode checked as for a token file.)
absl::StatusOr<std::vector<TrainerToken>> ParseTrainerTokens(absl::string_view text, const std::string& path);
absl::StatusOr<std::vector<TrainerToken>> ReadTrainerTokensFile(const std::string& path);

// True if `job` is one of the jobs `pattern` names.
bool JobPatternMatches(const std::string& pattern, const std::string& job);

// Who meta lets in (docs/security.md "Identities"); empty: that check is off.
struct CallerTokens {
  std::string admin;
  std::string agent;
  std::vector<TrainerToken> trainers;
};

// For the job RPCs (CreateJob, GetVersion, Locate, WaitVersion, ...; `job_id`
// set) and the cluster-wide reads (ListJobs, ListNodes, ClusterStatus;
// `job_id` empty). OK when no trainer tokens are configured, or `ctx` carries
// the admin or agent token, or a trainer token whose jobs include `job_id`
// (any trainer token when `job_id` is empty). UNAUTHENTICATED without a
// token, PERMISSION_DENIED with an unknown one or one for other jobs; the
// message names the RPC and the job.
grpc::Status CheckJobCaller(const grpc::ServerContextBase& ctx, const CallerTokens& tokens, const std::string& job_id,
                            const char* rpc);

// The job patterns a caller may see in a listing: nullopt for every job (no
// trainer tokens configured, or the admin or agent token), else those of its
// trainer token (empty if it has none).
std::optional<std::vector<std::string>> VisibleJobs(const grpc::ServerContextBase& ctx, const CallerTokens& tokens);

// The URI a ckpt server's certificate carries: "ckpt://meta" for ckpt-meta,
// "ckpt://node/<id>" for the agent of node `id` (common/pki.h).
inline std::string MetaPeerUri() { return "ckpt://meta"; }
inline std::string NodePeerUri(const std::string& node_id) { return "ckpt://node/" + node_id; }

// True if `listen` ("host:port") is a loopback address (127.0.0.0/8, ::1,
// localhost) or a unix socket.
bool IsLoopbackListen(const std::string& listen);

}  // namespace ckpt
