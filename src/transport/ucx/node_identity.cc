#include "transport/ucx/node_identity.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/endian.h"
#include "common/log.h"
#include "common/pki.h"
#include "common/secret_file.h"
#include "common/status_macros.h"

namespace ckpt::transport {

namespace {

template <typename T, void (*F)(T*)>
struct Deleter {
  void operator()(T* p) const { F(p); }
};
using PkeyPtr = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using PkeyCtxPtr = std::unique_ptr<EVP_PKEY_CTX, Deleter<EVP_PKEY_CTX, EVP_PKEY_CTX_free>>;
using MdCtxPtr = std::unique_ptr<EVP_MD_CTX, Deleter<EVP_MD_CTX, EVP_MD_CTX_free>>;
using X509Ptr = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using StorePtr = std::unique_ptr<X509_STORE, Deleter<X509_STORE, X509_STORE_free>>;
using StoreCtxPtr = std::unique_ptr<X509_STORE_CTX, Deleter<X509_STORE_CTX, X509_STORE_CTX_free>>;
using CrlPtr = std::unique_ptr<X509_CRL, Deleter<X509_CRL, X509_CRL_free>>;
using BioPtr = std::unique_ptr<BIO, Deleter<BIO, BIO_free_all>>;

constexpr std::string_view kTranscriptLabel = "ckpt data plane identity v1";

// The reasons OpenSSL queued, emptying the queue.
std::string OpensslReasons() {
  std::string reasons;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    absl::StrAppend(&reasons, reasons.empty() ? "" : "; ", buf);
  }
  return reasons;
}

BioPtr MemBio(std::string_view bytes) {
  return BioPtr(BIO_new_mem_buf(bytes.data(), static_cast<int>(bytes.size())));
}

X509Ptr CertFromDer(std::string_view der) {
  const auto* p = reinterpret_cast<const unsigned char*>(der.data());
  X509Ptr cert(d2i_X509(nullptr, &p, static_cast<long>(der.size())));
  if (cert && p != reinterpret_cast<const unsigned char*>(der.data()) + der.size()) cert.reset();
  if (!cert) ERR_clear_error();
  return cert;
}

void AppendField(std::string& out, std::string_view field) {
  AppendLe(out, field.size(), 2);
  out.append(field);
}

absl::StatusOr<std::string> ReadWhole(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(what, " \"", path, "\" cannot be read"));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

// ---------------------------------------------------------------------------
// NodeCredentials

struct NodeCredentials::Ossl {
  StorePtr store;
  PkeyPtr key;
};

NodeCredentials::NodeCredentials() : ossl_(std::make_unique<Ossl>()) {}
NodeCredentials::~NodeCredentials() = default;

absl::StatusOr<std::shared_ptr<const NodeCredentials>> NodeCredentials::FromPem(std::string_view ca_pem,
                                                                                std::string_view cert_pem,
                                                                                std::string_view key_pem,
                                                                                std::string_view crl_pems) {
  std::shared_ptr<NodeCredentials> c(new NodeCredentials());
  c->ossl_->store.reset(X509_STORE_new());
  if (!c->ossl_->store) return absl::InternalError(absl::StrCat("X509_STORE_new: ", OpensslReasons()));
  int cas = 0;
  {
    BioPtr bio = MemBio(ca_pem);
    while (X509Ptr ca{PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)}) {
      if (X509_STORE_add_cert(c->ossl_->store.get(), ca.get()) != 1) {
        return absl::InvalidArgumentError(absl::StrCat("the CA bundle: ", OpensslReasons()));
      }
      ++cas;
    }
    ERR_clear_error();
  }
  if (cas == 0) return absl::InvalidArgumentError("the CA bundle holds no PEM certificate");
  int crls = 0;
  if (!crl_pems.empty()) {
    BioPtr bio = MemBio(crl_pems);
    while (CrlPtr crl{PEM_read_bio_X509_CRL(bio.get(), nullptr, nullptr, nullptr)}) {
      if (X509_STORE_add_crl(c->ossl_->store.get(), crl.get()) != 1) {
        return absl::InvalidArgumentError(absl::StrCat("a CRL: ", OpensslReasons()));
      }
      ++crls;
    }
    ERR_clear_error();
  }
  // With CRLs, a certificate one revokes is refused; a CA without a CRL in
  // them is then refused too (OpenSSL cannot tell "none" from "lost"), which
  // is why only CRLs of our own CA are expected there.
  if (crls > 0) X509_STORE_set_flags(c->ossl_->store.get(), X509_V_FLAG_CRL_CHECK);

  X509Ptr leaf;
  {
    BioPtr bio = MemBio(cert_pem);
    leaf.reset(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  }
  if (!leaf) {
    ERR_clear_error();
    return absl::InvalidArgumentError("the certificate file holds no PEM certificate");
  }
  {
    BioPtr bio = MemBio(key_pem);
    c->ossl_->key.reset(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  }
  if (!c->ossl_->key) {
    ERR_clear_error();
    return absl::InvalidArgumentError("the key file holds no PEM private key");
  }
  if (X509_check_private_key(leaf.get(), c->ossl_->key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError("the private key does not match the certificate");
  }
  unsigned char* der = nullptr;
  const int n = i2d_X509(leaf.get(), &der);
  if (n <= 0) return absl::InternalError(absl::StrCat("encoding the certificate: ", OpensslReasons()));
  c->certificate_der_.assign(reinterpret_cast<const char*>(der), static_cast<size_t>(n));
  OPENSSL_free(der);
  if (c->certificate_der_.size() > kMaxCertificateBytes) {
    return absl::InvalidArgumentError(absl::StrCat("the certificate is ", c->certificate_der_.size(),
                                                   " bytes; the data plane carries at most ", kMaxCertificateBytes));
  }
  // Its identity, not whether it chains to the CA: a node given a
  // certificate of another CA by mistake keeps running (its peers refuse it)
  // and is fixed by replacing the files, which are re-read, as on its gRPC
  // side.
  absl::StatusOr<pki::Identity> own = pki::IdentityOfCertificateDer(c->certificate_der_);
  if (!own.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("this node's certificate names no ckpt identity: ", own.status().message()));
  }
  if (own->role != pki::Role::kNode) {
    return absl::InvalidArgumentError(absl::StrCat("this node's certificate is ", pki::IdentityUris(*own).front(),
                                                   ", not a node's (ckpt://node/<id>)"));
  }
  c->identity_ = pki::NodeUri(own->name);
  return std::shared_ptr<const NodeCredentials>(std::move(c));
}

absl::StatusOr<std::string> NodeCredentials::Sign(std::string_view message) const {
  MdCtxPtr ctx(EVP_MD_CTX_new());
  size_t len = 0;
  if (!ctx || EVP_DigestSignInit(ctx.get(), nullptr, EVP_sha256(), nullptr, ossl_->key.get()) != 1 ||
      EVP_DigestSign(ctx.get(), nullptr, &len, reinterpret_cast<const unsigned char*>(message.data()),
                     message.size()) != 1) {
    return absl::InternalError(absl::StrCat("signing: ", OpensslReasons()));
  }
  std::string sig(len, '\0');
  if (EVP_DigestSign(ctx.get(), reinterpret_cast<unsigned char*>(sig.data()), &len,
                     reinterpret_cast<const unsigned char*>(message.data()), message.size()) != 1) {
    return absl::InternalError(absl::StrCat("signing: ", OpensslReasons()));
  }
  sig.resize(len);
  return sig;
}

absl::StatusOr<std::string> NodeCredentials::CheckPeerCertificate(std::string_view der) const {
  X509Ptr cert = CertFromDer(der);
  if (!cert) return absl::PermissionDeniedError("its certificate is not a DER certificate");
  StoreCtxPtr ctx(X509_STORE_CTX_new());
  if (!ctx || X509_STORE_CTX_init(ctx.get(), ossl_->store.get(), cert.get(), nullptr) != 1) {
    return absl::InternalError(absl::StrCat("X509_STORE_CTX_init: ", OpensslReasons()));
  }
  if (X509_verify_cert(ctx.get()) != 1) {
    const int err = X509_STORE_CTX_get_error(ctx.get());
    ERR_clear_error();
    return absl::PermissionDeniedError(absl::StrCat("its certificate is not one this cluster's CA issued and still "
                                                    "vouches for: ",
                                                    X509_verify_cert_error_string(err)));
  }
  absl::StatusOr<pki::Identity> id = pki::IdentityOfCertificateDer(der);
  if (!id.ok()) {
    return absl::PermissionDeniedError(absl::StrCat("its certificate names no ckpt identity: ", id.status().message()));
  }
  if (id->role != pki::Role::kNode) {
    return absl::PermissionDeniedError(absl::StrCat("its certificate is ", pki::IdentityUris(*id).front(),
                                                    ", not a node's (ckpt://node/<id>): only agents speak on the "
                                                    "data plane"));
  }
  return pki::NodeUri(id->name);
}

bool NodeCredentials::CheckSignature(std::string_view der, std::string_view message, std::string_view signature) {
  X509Ptr cert = CertFromDer(der);
  if (!cert) return false;
  EVP_PKEY* key = X509_get0_pubkey(cert.get());
  MdCtxPtr ctx(EVP_MD_CTX_new());
  const bool ok = key != nullptr && ctx &&
                  EVP_DigestVerifyInit(ctx.get(), nullptr, EVP_sha256(), nullptr, key) == 1 &&
                  EVP_DigestVerify(ctx.get(), reinterpret_cast<const unsigned char*>(signature.data()),
                                   signature.size(), reinterpret_cast<const unsigned char*>(message.data()),
                                   message.size()) == 1;
  ERR_clear_error();
  return ok;
}

// ---------------------------------------------------------------------------
// NodeCredentialsFiles

absl::StatusOr<std::shared_ptr<const NodeCredentials>> NodeCredentialsFiles::Read(const Files& files) {
  CKPT_ASSIGN_OR_RETURN(std::string ca, ReadWhole(files.ca_file, "--tls-ca"));
  CKPT_ASSIGN_OR_RETURN(std::string cert, ReadWhole(files.cert_file, "--tls-cert"));
  CKPT_ASSIGN_OR_RETURN(std::string key, ReadSecretFile(files.key_file, "--tls-key", /*follow_symlink=*/true));
  std::string crls;
  if (!files.crl_dir.empty()) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(files.crl_dir, ec)) {
      if (!entry.is_regular_file(ec)) continue;
      absl::StatusOr<std::string> text = ReadWhole(entry.path().string(), "a CRL");
      if (text.ok() && text->find("-----BEGIN X509 CRL-----") != std::string::npos) crls += *text;
    }
    if (ec) {
      return absl::InvalidArgumentError(absl::StrCat("--tls-crl-dir \"", files.crl_dir, "\": ", ec.message()));
    }
  }
  absl::StatusOr<std::shared_ptr<const NodeCredentials>> c = NodeCredentials::FromPem(ca, cert, key, crls);
  if (!c.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("data-plane identity from ", files.cert_file, ": ",
                                                   c.status().message()));
  }
  return c;
}

absl::StatusOr<std::shared_ptr<NodeCredentialsFiles>> NodeCredentialsFiles::Open(const Files& files) {
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<const NodeCredentials> first, Read(files));
  std::shared_ptr<NodeCredentialsFiles> out(new NodeCredentialsFiles(files));
  {
    absl::MutexLock lock(&out->mu_);
    out->current_ = std::move(first);
  }
  if (files.reload_seconds > 0) out->rereader_ = std::thread([f = out.get()] { f->RereadLoop(); });
  return out;
}

NodeCredentialsFiles::~NodeCredentialsFiles() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (rereader_.joinable()) rereader_.join();
}

std::shared_ptr<const NodeCredentials> NodeCredentialsFiles::Current() {
  absl::MutexLock lock(&mu_);
  return current_;
}

absl::Status NodeCredentialsFiles::Refresh() {
  absl::StatusOr<std::shared_ptr<const NodeCredentials>> fresh = Read(files_);
  if (!fresh.ok()) return fresh.status();
  absl::MutexLock lock(&mu_);
  if ((*fresh)->certificate_der() != current_->certificate_der()) {
    log::Info("data plane: new certificate {} read from {}; new connections use it", (*fresh)->identity(),
              files_.cert_file);
  }
  current_ = *std::move(fresh);
  return absl::OkStatus();
}

void NodeCredentialsFiles::RereadLoop() {
  std::string last_error;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Seconds(files_.reload_seconds))) return;
    }
    const absl::Status s = Refresh();
    if (!s.ok() && s.ToString() != last_error) {
      log::Warn("data plane: cannot re-read the TLS files ({}); the certificate read before stays in use",
                std::string(s.message()));
    }
    last_error = s.ok() ? std::string() : s.ToString();
  }
}

// ---------------------------------------------------------------------------
// Identity blocks

std::string EncodeIdentityBlock(const IdentityBlock& b) {
  std::string out;
  out.reserve(6 + b.certificate.size() + b.public_key.size() + b.signature.size());
  AppendField(out, b.certificate);
  AppendField(out, b.public_key);
  AppendField(out, b.signature);
  return out;
}

absl::StatusOr<IdentityBlock> DecodeIdentityBlock(std::string_view bytes) {
  IdentityBlock b;
  std::string* fields[] = {&b.certificate, &b.public_key, &b.signature};
  size_t at = 0;
  for (std::string* f : fields) {
    if (bytes.size() - at < 2) return absl::InvalidArgumentError("identity block cut short");
    const size_t n = LoadLe(bytes.data() + at, 2);
    at += 2;
    if (bytes.size() - at < n) return absl::InvalidArgumentError("identity block cut short");
    f->assign(bytes.data() + at, n);
    at += n;
  }
  if (at != bytes.size()) {
    return absl::InvalidArgumentError(absl::StrCat("identity block has ", bytes.size() - at, " bytes too many"));
  }
  if (!b.public_key.empty() && b.public_key.size() != kX25519Bytes) {
    return absl::InvalidArgumentError(absl::StrCat("identity block: a public key of ", b.public_key.size(),
                                                   " bytes (X25519 keys are ", kX25519Bytes, ")"));
  }
  return b;
}

// ---------------------------------------------------------------------------
// IdentityExchange

struct IdentityExchange::Ossl {
  PkeyPtr ephemeral;
};

IdentityExchange::~IdentityExchange() = default;

absl::StatusOr<std::unique_ptr<IdentityExchange>> IdentityExchange::Start(std::shared_ptr<const NodeCredentials> own,
                                                                         bool acceptor) {
  std::unique_ptr<IdentityExchange> x(new IdentityExchange());
  x->ossl_ = std::make_unique<Ossl>();
  x->own_ = std::move(own);
  x->acceptor_ = acceptor;
  x->ossl_->ephemeral.reset(EVP_PKEY_Q_keygen(nullptr, nullptr, "X25519"));
  std::string pub(kX25519Bytes, '\0');
  size_t len = pub.size();
  if (!x->ossl_->ephemeral ||
      EVP_PKEY_get_raw_public_key(x->ossl_->ephemeral.get(), reinterpret_cast<unsigned char*>(pub.data()), &len) !=
          1 ||
      len != kX25519Bytes) {
    return absl::InternalError(absl::StrCat("making an X25519 key: ", OpensslReasons()));
  }
  x->public_key_ = std::move(pub);
  return x;
}

IdentityBlock IdentityExchange::Offer() const { return IdentityBlock{own_->certificate_der(), public_key_, ""}; }

absl::Status IdentityExchange::TakeOffer(const IdentityBlock& theirs) {
  if (theirs.certificate.empty()) return absl::InvalidArgumentError("the identity block has no certificate");
  if (theirs.public_key.size() != kX25519Bytes) {
    return absl::InvalidArgumentError("the identity block has no X25519 public key");
  }
  CKPT_ASSIGN_OR_RETURN(peer_identity_, own_->CheckPeerCertificate(theirs.certificate));
  theirs_.certificate = theirs.certificate;
  theirs_.public_key = theirs.public_key;
  return absl::OkStatus();
}

std::string IdentityExchange::Transcript(char role, uint64_t acceptor_id, uint64_t acceptor_nonce,
                                         uint64_t connector_id, uint64_t connector_nonce) const {
  const IdentityBlock mine = Offer();
  const IdentityBlock& acceptor = acceptor_ ? mine : theirs_;
  const IdentityBlock& connector = acceptor_ ? theirs_ : mine;
  std::string t(kTranscriptLabel);
  t.push_back(role);
  for (uint64_t v : {acceptor_id, acceptor_nonce, connector_id, connector_nonce}) AppendLe64(t, v);
  for (const IdentityBlock* b : {&acceptor, &connector}) {
    AppendField(t, b->certificate);
    AppendField(t, b->public_key);
  }
  return t;
}

absl::StatusOr<std::string> IdentityExchange::Sign(char role, uint64_t acceptor_id, uint64_t acceptor_nonce,
                                                   uint64_t connector_id, uint64_t connector_nonce) const {
  if (theirs_.certificate.empty()) return absl::FailedPreconditionError("sign before the other side's offer");
  return own_->Sign(Transcript(role, acceptor_id, acceptor_nonce, connector_id, connector_nonce));
}

absl::Status IdentityExchange::CheckSignature(char role, uint64_t acceptor_id, uint64_t acceptor_nonce,
                                              uint64_t connector_id, uint64_t connector_nonce,
                                              std::string_view signature) const {
  if (theirs_.certificate.empty()) return absl::FailedPreconditionError("a signature before the offer");
  if (!NodeCredentials::CheckSignature(
          theirs_.certificate, Transcript(role, acceptor_id, acceptor_nonce, connector_id, connector_nonce),
          signature)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "its signature does not prove it holds the key of ", peer_identity_,
        "'s certificate for this connection (a replayed or relayed handshake, or a stolen certificate without "
        "its key)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> IdentityExchange::SharedSecret() const {
  if (theirs_.public_key.size() != kX25519Bytes) return absl::FailedPreconditionError("no public key from the peer");
  PkeyPtr peer(EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, nullptr,
                                           reinterpret_cast<const unsigned char*>(theirs_.public_key.data()),
                                           theirs_.public_key.size()));
  PkeyCtxPtr ctx(EVP_PKEY_CTX_new(ossl_->ephemeral.get(), nullptr));
  std::string secret(kX25519Bytes, '\0');
  size_t len = secret.size();
  if (!peer || !ctx || EVP_PKEY_derive_init(ctx.get()) != 1 || EVP_PKEY_derive_set_peer(ctx.get(), peer.get()) != 1 ||
      EVP_PKEY_derive(ctx.get(), reinterpret_cast<unsigned char*>(secret.data()), &len) != 1 || len != kX25519Bytes) {
    return absl::InternalError(absl::StrCat("X25519 agreement failed: ", OpensslReasons()));
  }
  return secret;
}

}  // namespace ckpt::transport
