// Node identities on the data plane (docs/protocol.md §8b, "Identities";
// docs/security.md): each side of a data-plane connection proves which node
// it is with the node certificate ckpt-meta's cluster CA issued it
// (`ckptctl certs create-node`: URI subjectAltName ckpt://node/<id>), not
// only that it holds the cluster's data-plane key, which every admitted node
// holds alike.
//
// NodeCredentials is what one agent proves with and checks against: its
// certificate and private key, the CA its peers' certificates must chain to,
// and the certificate revocation lists it honours. IdentityExchange is one
// connection's exchange (a SIGMA-style authenticated key agreement): each
// side offers its certificate and a fresh X25519 public key, signs the
// transcript (both ids and nonces, both certificates and both public keys,
// and its role) with its certificate's key, and checks the other's
// signature; both then mix the X25519 shared secret into the connection's
// message keys (message_auth.h). So
//   - a process that holds the cluster key but no node certificate of this
//     CA cannot connect, and one that holds another node's certificate
//     connects as that node, never as the one it claims in a message;
//   - a signature made for one connection is worth nothing on another (it
//     covers both nonces and both public keys), and one side's signature
//     cannot be relayed into a connection with a third node (it covers the
//     certificate of the side it was made for);
//   - even a member with the cluster key sitting between two nodes cannot
//     read or forge their messages: it does not know the X25519 secret.
//
// The identity block (a record flag of handshake.h, kIdentity) holds three
// fields, each a u16 little-endian length and its bytes: the sender's
// certificate (DER, the leaf only: the CA is known to both), its X25519
// public key (32 bytes), its signature (DER ECDSA, or whatever its key's
// algorithm makes). Empty fields are allowed where handshake.h says so.
//
// This header has no UCX dependency; it is pure and unit-tested.
// Thread safety: NodeCredentials is immutable once made and may be shared by
// any number of threads; NodeCredentialsFiles may be called from any thread;
// IdentityExchange is not thread-safe (one per connection, used by the
// transport's progress thread).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ckpt::transport {

class NodeCredentials {
 public:
  ~NodeCredentials();
  NodeCredentials(const NodeCredentials&) = delete;
  NodeCredentials& operator=(const NodeCredentials&) = delete;

  // From PEM text: `ca_pem` the CA bundle peers must chain to, `cert_pem` this
  // node's certificate (a chain: the first is the leaf), `key_pem` its key;
  // `crl_pems` certificate revocation lists (PEM, any number; empty: none).
  // InvalidArgument saying which when a part does not parse, the key does not
  // match the certificate, or the certificate names no ckpt://node/ identity.
  // Whether it chains to the CA is its peers' check (a node given another
  // CA's certificate by mistake runs, refused by its peers, until its files
  // are replaced).
  static absl::StatusOr<std::shared_ptr<const NodeCredentials>> FromPem(std::string_view ca_pem,
                                                                         std::string_view cert_pem,
                                                                         std::string_view key_pem,
                                                                         std::string_view crl_pems = {});

  // "ckpt://node/<id>": the identity this node proves.
  const std::string& identity() const { return identity_; }
  // The leaf certificate, DER.
  const std::string& certificate_der() const { return certificate_der_; }

  // The signature of `message` with this node's key (SHA-256). Internal if
  // OpenSSL fails.
  absl::StatusOr<std::string> Sign(std::string_view message) const;

  // Checks a peer's certificate (DER): it chains to the CA, is valid now, is
  // not revoked by a CRL given, and names a ckpt://node/ identity; returns
  // that identity ("ckpt://node/<id>"). PermissionDenied saying why
  // otherwise (the message is fit for the log of the side that refused).
  absl::StatusOr<std::string> CheckPeerCertificate(std::string_view der) const;

  // True iff `signature` is the signature of `message` by the key of the
  // certificate `der` (which the caller has checked).
  static bool CheckSignature(std::string_view der, std::string_view message, std::string_view signature);

 private:
  NodeCredentials();
  struct Ossl;
  std::unique_ptr<Ossl> ossl_;
  std::string identity_;
  std::string certificate_der_;
};

// A node's credentials read from its TLS files (the agent's --tls-ca,
// --tls-cert, --tls-key and --tls-crl-dir), re-read every `reload_seconds`
// by a thread of its own (0: read once), so a renewed certificate or a new
// CRL applies to new connections without a restart, as it does on the
// agent's gRPC side. Current() never touches a file: it is called on the
// transport's progress thread. A re-read that fails (a half-written file, a
// key that does not match) is logged and the credentials read before stay
// in use. The key file must be one only its owner may read
// (common/secret_file.h; a link is followed).
//
// Thread safety: every method from any thread; the destructor stops and
// joins the re-reading thread.
class NodeCredentialsFiles {
 public:
  struct Files {
    std::string ca_file;
    std::string cert_file;
    std::string key_file;
    std::string crl_dir;  // every regular file in it that holds a PEM CRL
    uint32_t reload_seconds = 0;
  };

  // Reads the files once and, with reload_seconds, starts the re-reading
  // thread: InvalidArgument naming the file and the problem
  // (NodeCredentials::FromPem's errors, a file that cannot be read, a key
  // file others may read or change).
  static absl::StatusOr<std::shared_ptr<NodeCredentialsFiles>> Open(const Files& files);
  ~NodeCredentialsFiles();
  NodeCredentialsFiles(const NodeCredentialsFiles&) = delete;
  NodeCredentialsFiles& operator=(const NodeCredentialsFiles&) = delete;

  // The credentials to use for a connection starting now (no I/O).
  std::shared_ptr<const NodeCredentials> Current();

  // Reads the files again now (no lock held while reading) and, if they are
  // good, makes them current; otherwise returns Read's error and keeps the
  // credentials read before. What the re-reading thread does each period.
  absl::Status Refresh();

  // Reads the files (no lock held): what Open and Refresh do.
  static absl::StatusOr<std::shared_ptr<const NodeCredentials>> Read(const Files& files);

 private:
  explicit NodeCredentialsFiles(Files files) : files_(std::move(files)) {}
  void RereadLoop();

  const Files files_;
  absl::Mutex mu_;
  std::shared_ptr<const NodeCredentials> current_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread rereader_;  // with reload_seconds; started by Open, joined by the destructor
};

// The fields of one side's identity block (see above).
struct IdentityBlock {
  std::string certificate;  // DER
  std::string public_key;   // X25519, 32 bytes
  std::string signature;
};
inline constexpr size_t kX25519Bytes = 32;
// A certificate of ckpt's (EC P-256) is about 600 bytes; the identity block
// that carries one is at most ucx_wire::kMaxIdentityBytes (handshake.h).
inline constexpr size_t kMaxCertificateBytes = 8 << 10;

std::string EncodeIdentityBlock(const IdentityBlock& b);
// InvalidArgument when the bytes are not three length-prefixed fields that
// end exactly at the end, or the public key is neither empty nor 32 bytes.
absl::StatusOr<IdentityBlock> DecodeIdentityBlock(std::string_view bytes);

// One side of one connection's identity exchange (see above). The flow,
// with handshake.h's records:
//   connector: Offer()                  -> record 1 (certificate, key)
//   acceptor:  TakeOffer(record 1)      -> checks the certificate
//              Offer() + Sign('a')      -> record 2
//   connector: TakeOffer(record 2), CheckSignature('a', record 2)
//              Sign('c')                -> record 3 (signature only)
//   acceptor:  CheckSignature('c', record 3)
//   both:      SharedSecret()           -> mixed into the message keys
class IdentityExchange {
 public:
  // A fresh X25519 key pair for one connection. Internal if OpenSSL cannot
  // make one.
  static absl::StatusOr<std::unique_ptr<IdentityExchange>> Start(std::shared_ptr<const NodeCredentials> own,
                                                                 bool acceptor);
  ~IdentityExchange();

  // Our certificate and public key.
  IdentityBlock Offer() const;
  // The other side's certificate and public key (its signature, if any, is
  // checked by CheckSignature). PermissionDenied when its certificate is not
  // one of this cluster's nodes (NodeCredentials::CheckPeerCertificate);
  // InvalidArgument for a missing certificate or a public key that is not
  // 32 bytes.
  absl::Status TakeOffer(const IdentityBlock& theirs);
  // The identity the other side's certificate names (after TakeOffer).
  const std::string& peer_identity() const { return peer_identity_; }

  // Our signature for `role` ('a' accepting side, 'c' connecting side) over
  // the transcript of this connection: the ids and nonces as handshake.h's
  // proofs take them, and both offers. Only after TakeOffer.
  absl::StatusOr<std::string> Sign(char role, uint64_t acceptor_id, uint64_t acceptor_nonce, uint64_t connector_id,
                                   uint64_t connector_nonce) const;
  // OK iff `signature` is the other side's signature for `role` over this
  // connection's transcript; PermissionDenied otherwise.
  absl::Status CheckSignature(char role, uint64_t acceptor_id, uint64_t acceptor_nonce, uint64_t connector_id,
                              uint64_t connector_nonce, std::string_view signature) const;

  // The X25519 shared secret (32 bytes), after TakeOffer. Internal if the
  // agreement fails (e.g. a low-order public key).
  absl::StatusOr<std::string> SharedSecret() const;

 private:
  IdentityExchange() = default;
  std::string Transcript(char role, uint64_t acceptor_id, uint64_t acceptor_nonce, uint64_t connector_id,
                         uint64_t connector_nonce) const;

  struct Ossl;
  std::unique_ptr<Ossl> ossl_;
  std::shared_ptr<const NodeCredentials> own_;
  bool acceptor_ = false;
  std::string public_key_;
  IdentityBlock theirs_;
  std::string peer_identity_;
};

}  // namespace ckpt::transport
