// The cluster's certificates: a CA made by ckpt, and certificates that carry
// who their holder is (docs/security.md "Identities"; `ckptctl certs`).
//
// A certificate names one identity in URI subjectAltNames:
//   ckpt://meta                    the metadata service
//   ckpt://node/<node id>          a node's agent (ValidateNodeId)
//   ckpt://admin/<name>            an administrator (every RPC)
//   ckpt://operator/<name>         an operator (read-only)
//   ckpt://trainer/<name>          a trainer, plus one ckpt://job/<pattern> per
//                                  job pattern it may use (at least one)
// and, on a DPU's node certificate only, the host it serves:
//   ckpt://host/<host node id>     beside ckpt://node/<id>: meta admits the
//                                  node as a DPU of that host only
//                                  (RegisterNode's host_node_id), and a
//                                  host's socket proxy talks only to a DPU
//                                  that serves it (docs/dpu.md)
// Servers read them from gRPC's "peer_uri" auth property (IdentityFromUris);
// the subject CN repeats the role URI for people reading the certificate and
// is never used to decide anything.
//
// Keys are EC P-256, certificates are signed with ECDSA-SHA256 and work with
// gRPC's TLS as server and client certificates (mutual TLS). Files are created
// exclusively: nothing is ever overwritten, and a failed call leaves no file
// behind. Keys are written unencrypted (mode 0600): guard the CA key
// (<ca_dir>/ca.key) as the key to the whole cluster.
//
// Thread safety: every function is safe to call concurrently (two calls
// writing the same file: one wins, the other gets AlreadyExists). They block
// on file I/O.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt::pki {

enum class Role { kMeta, kNode, kAdmin, kOperator, kTrainer };

// "meta", "node", "admin", "operator", "trainer".
std::string_view RoleName(Role role);

// The inverse of RoleName; InvalidArgument naming the value and the roles
// otherwise.
absl::StatusOr<Role> ParseRole(std::string_view name);

struct Identity {
  // Identity{role, name}, Identity{role, name, jobs}, Identity{kNode, id, {},
  // host}: a constructor rather than an aggregate, so that host_node may be
  // left out of the braces.
  Identity() = default;
  Identity(Role r, std::string n, std::vector<std::string> j = {}, std::string h = {})
      : role(r), name(std::move(n)), jobs(std::move(j)), host_node(std::move(h)) {}

  Role role = Role::kTrainer;
  // kNode: the node id (ValidateNodeId). kMeta: empty. kAdmin, kOperator,
  // kTrainer: a label matching [A-Za-z0-9._-]{1,63}, other than "." and "..".
  std::string name;
  // kTrainer only (at least one): job patterns as grpc_security.h's
  // JobPatternMatches reads them: a job id ("gpt-7b"), a job id's prefix and
  // '*' ("team-a-*"), or "*" (every job). No pattern twice.
  std::vector<std::string> jobs;
  // kNode only, optional: the host node a DPU node serves (ckpt://host/<id>;
  // ValidateHostNodeId: a node id, not the node's own). Empty for every
  // other certificate.
  std::string host_node;

  friend bool operator==(const Identity&, const Identity&) = default;
};

// OK if `identity` follows the rules above; InvalidArgument saying which one
// it breaks otherwise.
absl::Status ValidateIdentity(const Identity& identity);

// OK if `pattern` is a job pattern (see Identity::jobs).
absl::Status ValidateJobPattern(std::string_view pattern);

// "ckpt://node/n1" etc.: the role URI, then (trainers) one ckpt://job/<pattern>
// per job, in order, or (a DPU node) ckpt://host/<host_node>. Does not
// validate (call ValidateIdentity first).
std::vector<std::string> IdentityUris(const Identity& identity);

// The identity in a peer's URI subjectAltNames (gRPC's "peer_uri" auth
// property values, in any order). URIs of other schemes are ignored; every
// ckpt:// URI must be one of the forms above. InvalidArgument when there is no
// role URI or more than one, a malformed ckpt:// URI, a bad name or job
// pattern, a job pattern twice, job URIs on a non-trainer, or a trainer
// without jobs; a host URI on anything but a node, two host URIs, or a host
// that is the node itself.
absl::StatusOr<Identity> IdentityFromUris(const std::vector<std::string>& uris);

// The identity in a PEM certificate (the first certificate of a chain): its
// URI subjectAltNames through IdentityFromUris. InvalidArgument if `pem` holds
// no certificate or the certificate no valid identity.
absl::StatusOr<Identity> IdentityOfCertificate(std::string_view pem);
// The same for one certificate in DER (the data plane's handshake carries
// them so: transport/ucx/node_identity.h).
absl::StatusOr<Identity> IdentityOfCertificateDer(std::string_view der);

// "ckpt://node/<id>": the role URI of node `node_id`'s certificate.
inline std::string NodeUri(std::string_view node_id) { return std::string("ckpt://node/").append(node_id); }

// What `ckptctl certs show` prints about a certificate.
struct CertificateInfo {
  std::string subject;  // one line, RFC 2253 ("CN=ckpt://meta")
  std::string issuer;
  std::string serial_hex;  // lower-case hex
  int64_t not_before_unix_s = 0;
  int64_t not_after_unix_s = 0;
  bool is_ca = false;                     // basicConstraints CA:TRUE
  std::vector<std::string> uris;          // URI subjectAltNames, in order
  std::vector<std::string> dns_names;     // DNS subjectAltNames
  std::vector<std::string> ip_addresses;  // IP subjectAltNames ("127.0.0.1", "::1")
  std::vector<std::string> extended_key_usages;  // "serverAuth", "clientAuth", ...
  size_t chain_length = 0;                // certificates in the PEM text
  // IdentityOfCertificate's answer (a CA certificate has none).
  absl::StatusOr<Identity> identity = absl::InvalidArgumentError("not read");
};

// Reads the first certificate of `pem`. InvalidArgument if there is none.
absl::StatusOr<CertificateInfo> DescribeCertificate(std::string_view pem);

struct CaOptions {
  int days = 3650;
  std::string name = "ckpt cluster CA";  // the CA's subject CN (1..64 bytes)
};

// Creates <dir>/ca.pem (mode 0644) and <dir>/ca.key (0600): an EC P-256 key
// and a self-signed certificate valid for `days` days (from an hour ago, for
// clocks slightly behind), basicConstraints critical CA:TRUE pathlen:0,
// keyUsage critical keyCertSign,cRLSign, subjectKeyIdentifier. Creates `dir`
// (and missing parents, mode 0700) if missing. Both files are created
// exclusively (O_EXCL|O_NOFOLLOW) before anything is written; on any failure
// neither is left behind.
// Errors: AlreadyExists naming the file if either exists (nothing
// overwritten); InvalidArgument for days outside 1..36500 or a bad name; the
// failing system call's error otherwise.
absl::Status CreateCa(const std::string& dir, const CaOptions& options = {});

struct CertOptions {
  Identity identity;
  // Where the holder is reached: DNS names or IP literals (v4 or v6), put in
  // subjectAltName; required for kMeta and kNode (gRPC callers check the
  // server's name against them), may be empty for client roles. No host
  // twice.
  std::vector<std::string> hosts;
  int days = 365;
};

// Issues a certificate for `options.identity` signed by <ca_dir>/ca.{pem,key}
// and writes <out_prefix>.pem (the certificate, then the CA's: a chain; 0644)
// and <out_prefix>.key (0600), both created exclusively as CreateCa does
// (missing parent directories are created, mode 0700). The key is EC P-256;
// the serial 128 random bits; subject CN the role URI (cut to 64 bytes);
// subjectAltName the identity's URIs and the hosts; keyUsage critical
// digitalSignature,keyAgreement; extendedKeyUsage serverAuth,clientAuth for
// kMeta and kNode, clientAuth for the others; basicConstraints critical
// CA:FALSE; subject and authority key identifiers. Valid from an hour ago for
// `days` days, but never beyond the CA's own end.
// The CA key is opened with O_NOFOLLOW and checked with fstat on the open
// descriptor: a regular file owned by the caller's effective uid, mode no
// wider than 0600.
// Errors: InvalidArgument for a bad identity, host or days (1..36500), or a
// meta/node certificate without hosts; NotFound naming the file if the CA is
// missing; FailedPrecondition saying what to fix if the CA key's owner or
// mode is wrong, it is a symbolic link, it does not match ca.pem, or ca.pem
// is not a CA certificate (or has expired); AlreadyExists naming the file if
// either output exists (nothing overwritten).
absl::Status IssueCertificate(const std::string& ca_dir, const CertOptions& options,
                              const std::string& out_prefix);

// What RevokeCertificates wrote.
struct CrlInfo {
  std::string path;                              // <crl_dir>/<hash>.r0
  std::vector<std::string> revoked_serials_hex;  // every serial the list revokes, lower-case hex
  size_t newly_revoked = 0;                      // of them, added by this call
  int64_t next_update_unix_s = 0;                // the list is valid until then
};

// Revokes certificates of the CA in `ca_dir` (`ckptctl certs revoke`): writes
// the CA's certificate revocation list, listing the serial numbers of
// `cert_files` (PEM certificates this CA issued; the first of each file) and
// of every certificate the CA's list there already revokes, signed with the
// CA key, to <crl_dir>/<hash>.r0, <hash> being the CA subject's OpenSSL hash
// (the name `openssl rehash` gives it). That is what --tls-crl-dir reads:
// gRPC (meta, agents, clients), the data plane (transport/ucx/node_identity.h)
// and ckpt-dpu-proxy. The list is valid for `days` days: run it again (with
// no certificate, to renew it) before then, because a peer that checks CRLs
// refuses every certificate of a CA whose list has expired. `crl_dir` is
// created (mode 0755) if missing; the file is replaced atomically
// (WriteStringToFileAtomically). The CA is checked as IssueCertificate does.
// Errors: InvalidArgument for days outside 1..36500, a file that holds no
// certificate, or a certificate another CA issued; NotFound naming a missing
// certificate or CA file; FailedPrecondition for the CA's problems (as
// IssueCertificate) or a file at the CRL's path that this CA did not sign;
// the failing system call's error otherwise. Nothing is written on an error.
absl::StatusOr<CrlInfo> RevokeCertificates(const std::string& ca_dir, const std::vector<std::string>& cert_files,
                                           const std::string& crl_dir, int days = 30);

// "<ca_dir>/ca.pem", "<ca_dir>/ca.key"; "<prefix>.pem", "<prefix>.key".
std::string CaCertPath(const std::string& ca_dir);
std::string CaKeyPath(const std::string& ca_dir);
std::string CertPath(const std::string& out_prefix);
std::string KeyPath(const std::string& out_prefix);

}  // namespace ckpt::pki
