// gRPC credentials and bearer tokens; see grpc_security.h.
#include "common/grpc_security.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <grpcpp/security/tls_certificate_provider.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/secret_file.h"
#include "common/status_macros.h"

namespace ckpt {
namespace {

constexpr absl::string_view kBearer = "Bearer ";

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " file \"", path, "\" (", flag, ") cannot be read"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  std::string pem = text.str();
  if (pem.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " file \"", path, "\" (", flag, ") is not PEM (no -----BEGIN line)"));
  }
  return pem;
}

// A private key's PEM text, from a file only its owner (this process's user
// or root) may change and no other user may read (common/secret_file.h; a
// Kubernetes Secret's link is followed): a key others can read is as good as
// published, and the daemon says so at start instead of using it.
absl::StatusOr<std::string> ReadKeyPem(const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(std::string pem, ReadSecretFile(path, "key file (--tls-key)", /*follow_symlink=*/true));
  if (pem.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("key file \"", path, "\" (--tls-key) is not PEM (no -----BEGIN line)"));
  }
  return pem;
}

// The TLS files parsed and matched with OpenSSL, so that a daemon or ckptctl
// refuses them at start, naming the flag and the problem, instead of gRPC's
// "Invalid private key" at bind time or a handshake that fails later.
struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using X509Ptr = std::unique_ptr<X509, X509Free>;

std::string AsnTimeText(const ASN1_TIME* t) {
  std::unique_ptr<BIO, BioFree> bio(BIO_new(BIO_s_mem()));
  if (bio == nullptr || ASN1_TIME_print(bio.get(), t) != 1) return "?";
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

// The certificates in `pem`, in order (empty if none parses).
std::vector<X509Ptr> ParseCerts(const std::string& pem) {
  std::vector<X509Ptr> out;
  std::unique_ptr<BIO, BioFree> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  while (bio != nullptr) {
    X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr);
    if (x == nullptr) break;
    out.emplace_back(x);
  }
  ERR_clear_error();
  return out;
}

// What a PEM file that is not what its flag wants holds instead.
std::string PemHolds(const std::string& pem) {
  if (pem.find("PRIVATE KEY-----") != std::string::npos) return "it holds a private key, not a certificate";
  if (pem.find("-----BEGIN CERTIFICATE REQUEST") != std::string::npos) return "it holds a certificate request";
  return "no certificate in it parses";
}

absl::Status CheckValidity(X509* cert, const std::string& path, const char* flag, const char* what) {
  if (X509_cmp_current_time(X509_get0_notAfter(cert)) < 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " \"", path, "\" (", flag, ") expired on ",
                                                   AsnTimeText(X509_get0_notAfter(cert)),
                                                   ": issue a new one (`ckptctl certs`)"));
  }
  if (X509_cmp_current_time(X509_get0_notBefore(cert)) > 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " \"", path, "\" (", flag, ") is not valid before ",
                                                   AsnTimeText(X509_get0_notBefore(cert)),
                                                   " (is this host's clock right?)"));
  }
  return absl::OkStatus();
}

absl::Status CheckTlsContents(const TlsFiles& files, bool server, bool client, const std::string& ca_pem,
                              const std::string& cert_pem, const std::string& key_pem) {
  std::vector<X509Ptr> cas = ParseCerts(ca_pem);
  if (cas.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-ca \"", files.ca_file, "\" is not a CA certificate: ", PemHolds(ca_pem)));
  }
  // The first certificate of the bundle must be a CA: a leaf given as
  // --tls-ca (the daemon's own certificate, say) verifies nobody.
  if (X509_check_ca(cas.front().get()) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-ca \"", files.ca_file,
        "\" is not a CA certificate (it is a leaf certificate, not one that signs others): give the cluster "
        "CA's ca.pem (`ckptctl certs create-ca`)"));
  }
  CKPT_RETURN_IF_ERROR(CheckValidity(cas.front().get(), files.ca_file, "--tls-ca", "CA certificate"));
  if (cert_pem.empty()) return absl::OkStatus();
  std::vector<X509Ptr> chain = ParseCerts(cert_pem);
  if (chain.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert \"", files.cert_file, "\" is not a certificate: ", PemHolds(cert_pem)));
  }
  X509* cert = chain.front().get();
  CKPT_RETURN_IF_ERROR(CheckValidity(cert, files.cert_file, "--tls-cert", "certificate"));
  std::unique_ptr<EVP_PKEY, PkeyFree> key;
  {
    std::unique_ptr<BIO, BioFree> bio(BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size())));
    if (bio != nullptr) key.reset(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
    ERR_clear_error();
  }
  if (key == nullptr) {
    const bool is_cert = key_pem.find("-----BEGIN CERTIFICATE") != std::string::npos;
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-key \"", files.key_file, "\" is not a private key",
        is_cert ? ": it holds a certificate (the key is the .key file beside the certificate)"
                : " (not PEM, or encrypted with a passphrase: ckpt reads unencrypted keys)"));
  }
  if (X509_check_private_key(cert, key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("--tls-key \"", files.key_file,
                                                   "\" does not match the certificate --tls-cert \"", files.cert_file,
                                                   "\": give the key made with that certificate (PREFIX.key beside "
                                                   "PREFIX.pem)"));
  }
  // No extendedKeyUsage at all allows every use.
  if ((X509_get_extension_flags(cert) & EXFLAG_XKUSAGE) != 0) {
    const uint32_t xku = X509_get_extended_key_usage(cert);
    if (server && (xku & XKU_SSL_SERVER) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls-cert \"", files.cert_file,
          "\" lacks serverAuth in its extended key usage: callers refuse it as a server's certificate; issue a "
          "daemon certificate (`ckptctl certs create-meta|create-node`)"));
    }
    if (client && (xku & XKU_SSL_CLIENT) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls-cert \"", files.cert_file,
          "\" lacks clientAuth in its extended key usage: servers refuse it from a caller; issue one with "
          "clientAuth (`ckptctl certs create-node|create-client`)"));
    }
  }
  return absl::OkStatus();
}

// A CRL directory gRPC can use: it exists and holds at least one file named
// as `openssl rehash` names CRLs (8 hex digits, ".r", a number).
absl::Status CheckCrlDir(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-crl-dir \"", dir, "\" is not a directory"));
  }
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const size_t dot = name.find(".r");
    if (dot == 8 && name.size() > 10 &&
        std::all_of(name.begin(), name.begin() + 8, [](char ch) { return absl::ascii_isxdigit(ch); }) &&
        std::all_of(name.begin() + 10, name.end(), [](char ch) { return absl::ascii_isdigit(ch); })) {
      return absl::OkStatus();
    }
  }
  if (ec) return absl::InvalidArgumentError(absl::StrCat("--tls-crl-dir \"", dir, "\" cannot be read: ", ec.message()));
  return absl::InvalidArgumentError(absl::StrCat("--tls-crl-dir \"", dir,
                                                 "\" holds no hashed CRL (<hash>.r0): put the CRLs (PEM) there "
                                                 "and run `openssl rehash ",
                                                 dir, "`"));
}

// Accepts a server only if its certificate carries `want` among its URI
// subjectAltNames (gRPC checked the chain against the CA before). Runs
// during the handshake, so nothing of a call reaches a server that fails it.
class PeerUriVerifier final : public grpc::experimental::ExternalCertificateVerifier {
 public:
  explicit PeerUriVerifier(std::string want) : want_(std::move(want)) {}

  bool Verify(grpc::experimental::TlsCustomVerificationCheckRequest* request, std::function<void(grpc::Status)>,
              grpc::Status* sync_status) override {
    std::vector<std::string> uris;
    for (const grpc::string_ref& uri : request->uri_names()) {
      if (absl::string_view(uri.data(), uri.size()) == want_) {
        *sync_status = grpc::Status::OK;
        return true;
      }
      uris.emplace_back(uri.data(), uri.size());
    }
    *sync_status = grpc::Status(
        grpc::StatusCode::UNAUTHENTICATED,
        absl::StrCat("the server's certificate is not ", want_, " (it names ",
                     uris.empty() ? std::string("no ckpt identity") : absl::StrJoin(uris, ", "), ")"));
    return true;  // answered synchronously
  }
  void Cancel(grpc::experimental::TlsCustomVerificationCheckRequest*) override {}

 private:
  const std::string want_;
};

const char* EnvOr(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

}  // namespace

void TlsFilesFromEnvironment(TlsFiles* files) {
  if (files->ca_file.empty()) files->ca_file = EnvOr("CKPT_TLS_CA");
  if (files->cert_file.empty()) files->cert_file = EnvOr("CKPT_TLS_CERT");
  if (files->key_file.empty()) files->key_file = EnvOr("CKPT_TLS_KEY");
  if (files->crl_dir.empty()) files->crl_dir = EnvOr("CKPT_TLS_CRL_DIR");
}

absl::Status CheckTlsFiles(const TlsFiles& files, bool server, bool also_client) {
  if (!files.enabled()) return absl::OkStatus();
  if (server && (files.ca_file.empty() || files.cert_file.empty() || files.key_file.empty())) {
    return absl::InvalidArgumentError(
        "TLS needs all of --tls-ca, --tls-cert and --tls-key on a server (mutual TLS: the CA "
        "checks the callers' certificates)");
  }
  if (files.ca_file.empty()) {
    return absl::InvalidArgumentError("TLS needs --tls-ca (the CA that signed the server's certificate)");
  }
  if (files.cert_file.empty() != files.key_file.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  CKPT_ASSIGN_OR_RETURN(std::string ca_pem, ReadPem(files.ca_file, "CA", "--tls-ca"));
  std::string cert_pem, key_pem;
  if (!files.cert_file.empty()) {
    CKPT_ASSIGN_OR_RETURN(cert_pem, ReadPem(files.cert_file, "certificate", "--tls-cert"));
    CKPT_ASSIGN_OR_RETURN(key_pem, ReadPem(files.key_file, "key", "--tls-key"));
  }
  CKPT_RETURN_IF_ERROR(CheckTlsContents(files, server, also_client || !server, ca_pem, cert_pem, key_pem));
  // Who may read the key, once it is known to be the certificate's key (a
  // certificate given as the key is named as such first).
  if (!files.key_file.empty()) CKPT_RETURN_IF_ERROR(ReadKeyPem(files.key_file).status());
  if (!files.crl_dir.empty()) CKPT_RETURN_IF_ERROR(CheckCrlDir(files.crl_dir));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsFiles& files) {
  if (!files.enabled()) return grpc::InsecureServerCredentials();
  if (files.ca_file.empty() || files.cert_file.empty() || files.key_file.empty()) {
    return absl::InvalidArgumentError(
        "TLS needs all of --tls-ca, --tls-cert and --tls-key on a server (mutual TLS: the CA "
        "checks the callers' certificates)");
  }
  if (files.reload_seconds > 0 || !files.crl_dir.empty()) {
    // The same checks at start (a bad file is the daemon's usage error), then
    // gRPC's TLS credentials: a file watcher keeps them current (reload), and
    // they take the CRL directory.
    CKPT_RETURN_IF_ERROR(CheckTlsFiles(files, /*server=*/true));
    std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider;
    if (files.reload_seconds > 0) {
      provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
          files.key_file, files.cert_file, files.ca_file, files.reload_seconds);
    } else {
      CKPT_ASSIGN_OR_RETURN(std::string ca, ReadPem(files.ca_file, "CA", "--tls-ca"));
      grpc::experimental::IdentityKeyCertPair pair;
      CKPT_ASSIGN_OR_RETURN(pair.certificate_chain, ReadPem(files.cert_file, "certificate", "--tls-cert"));
      CKPT_ASSIGN_OR_RETURN(pair.private_key, ReadKeyPem(files.key_file));
      provider = std::make_shared<grpc::experimental::StaticDataCertificateProvider>(
          ca, std::vector<grpc::experimental::IdentityKeyCertPair>{std::move(pair)});
    }
    grpc::experimental::TlsServerCredentialsOptions opts(provider);
    opts.watch_root_certs();
    opts.watch_identity_key_cert_pairs();
    opts.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    if (!files.crl_dir.empty()) opts.set_crl_directory(files.crl_dir);
    return grpc::experimental::TlsServerCredentials(opts);
  }
  grpc::SslServerCredentialsOptions opts(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  CKPT_ASSIGN_OR_RETURN(opts.pem_root_certs, ReadPem(files.ca_file, "CA", "--tls-ca"));
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  CKPT_ASSIGN_OR_RETURN(pair.cert_chain, ReadPem(files.cert_file, "certificate", "--tls-cert"));
  CKPT_ASSIGN_OR_RETURN(pair.private_key, ReadKeyPem(files.key_file));
  opts.pem_key_cert_pairs.push_back(std::move(pair));
  return grpc::SslServerCredentials(opts);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(const TlsFiles& files) {
  if (!files.enabled()) return grpc::InsecureChannelCredentials();
  if (files.ca_file.empty()) {
    return absl::InvalidArgumentError("TLS needs --tls-ca (the CA that signed the server's certificate)");
  }
  if (files.cert_file.empty() != files.key_file.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  const bool identity = !files.cert_file.empty();
  if (files.reload_seconds > 0 || !files.crl_dir.empty() || !files.expect_peer_uri.empty()) {
    // As ServerCredentials: checked once here (a bad file is a usage error),
    // then gRPC's TLS credentials keep the caller's certificate and CA current
    // (reload) and check the server's certificate against the CRLs.
    CKPT_RETURN_IF_ERROR(CheckTlsFiles(files, /*server=*/false));
    std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider;
    if (files.reload_seconds > 0) {
      provider = identity ? std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                                files.key_file, files.cert_file, files.ca_file, files.reload_seconds)
                          : std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                                files.ca_file, files.reload_seconds);
    } else {
      CKPT_ASSIGN_OR_RETURN(std::string ca, ReadPem(files.ca_file, "CA", "--tls-ca"));
      std::vector<grpc::experimental::IdentityKeyCertPair> pairs;
      if (identity) {
        grpc::experimental::IdentityKeyCertPair pair;
        CKPT_ASSIGN_OR_RETURN(pair.certificate_chain, ReadPem(files.cert_file, "certificate", "--tls-cert"));
        CKPT_ASSIGN_OR_RETURN(pair.private_key, ReadKeyPem(files.key_file));
        pairs.push_back(std::move(pair));
      }
      provider = std::make_shared<grpc::experimental::StaticDataCertificateProvider>(ca, std::move(pairs));
    }
    grpc::experimental::TlsChannelCredentialsOptions opts;
    opts.set_certificate_provider(provider);
    opts.watch_root_certs();
    if (identity) opts.watch_identity_key_cert_pairs();
    opts.set_verify_server_certs(true);
    if (files.expect_peer_uri.empty()) {
      // The server's name checked against its certificate, as SslCredentials does.
      opts.set_certificate_verifier(std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
    } else {
      // The server's identity (after the chain was checked against the CA).
      opts.set_certificate_verifier(
          grpc::experimental::ExternalCertificateVerifier::Create<PeerUriVerifier>(files.expect_peer_uri));
      opts.set_check_call_host(false);
    }
    if (!files.crl_dir.empty()) opts.set_crl_directory(files.crl_dir);
    return grpc::experimental::TlsCredentials(opts);
  }
  grpc::SslCredentialsOptions opts;
  CKPT_ASSIGN_OR_RETURN(opts.pem_root_certs, ReadPem(files.ca_file, "CA", "--tls-ca"));
  if (identity) {
    CKPT_ASSIGN_OR_RETURN(opts.pem_cert_chain, ReadPem(files.cert_file, "certificate", "--tls-cert"));
    CKPT_ASSIGN_OR_RETURN(opts.pem_private_key, ReadKeyPem(files.key_file));
  }
  return grpc::SslCredentials(opts);
}

namespace {

// The text of a file that holds secrets (`what`: "token file", ...):
// common/secret_file.h checks its owner and mode on the opened descriptor.
absl::StatusOr<std::string> ReadPrivateText(const std::string& path, const char* what) {
  return ReadSecretFile(path, what);
}

bool HeaderSafe(absl::string_view token) {
  for (char c : token) {
    if (c < 0x21 || c > 0x7e) return false;
  }
  return true;
}

// Job ids are [a-z0-9][a-z0-9._-]*; a pattern may end in '*'.
bool ValidJobPattern(absl::string_view p) {
  if (p == "*") return true;
  absl::ConsumeSuffix(&p, "*");
  const absl::string_view id = p;
  if (id.empty() || id.size() > 63) return false;
  for (size_t i = 0; i < id.size(); ++i) {
    const char c = id[i];
    const bool alnum = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
    if (!alnum && (i == 0 || (c != '.' && c != '_' && c != '-'))) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(std::string text, ReadPrivateText(path, "token file"));
  std::string token(absl::StripAsciiWhitespace(text));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("token file \"", path, "\" is empty: ", kMakeTokenHint));
  }
  if (!HeaderSafe(token)) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file \"", path, "\" holds a character that cannot go in a header"));
  }
  CKPT_RETURN_IF_ERROR(CheckTokenStrength(token, absl::StrCat("token file \"", path, "\"")));
  return token;
}

absl::StatusOr<std::vector<TrainerToken>> ParseTrainerTokens(absl::string_view text, const std::string& path) {
  std::vector<TrainerToken> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("trainer tokens file \"", path, "\" line ", line_no, ": ", why,
                                                     " (a line is TOKEN JOB[,JOB...]; a job is an id, a prefix "
                                                     "ending in '*', or '*')"));
    };
    std::vector<absl::string_view> fields = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() != 2) return bad(absl::StrCat("has ", fields.size(), " fields, not 2"));
    TrainerToken t;
    t.token = std::string(fields[0]);
    if (t.token.size() < kMinTokenChars) {
      return bad(absl::StrCat("the token is shorter than ", kMinTokenChars, " characters (128 bits): ", kMakeTokenHint));
    }
    if (!HeaderSafe(t.token)) return bad("the token holds a character that cannot go in a header");
    for (absl::string_view job : absl::StrSplit(fields[1], ',')) {
      if (!ValidJobPattern(job)) return bad(absl::StrCat("\"", job, "\" is not a job id or pattern"));
      t.jobs.emplace_back(job);
    }
    for (const TrainerToken& other : out) {
      if (other.token == t.token) return bad("the token is on an earlier line too");
    }
    out.push_back(std::move(t));
  }
  return out;
}

absl::StatusOr<std::vector<TrainerToken>> ReadTrainerTokensFile(const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(std::string text, ReadPrivateText(path, "trainer tokens file"));
  CKPT_ASSIGN_OR_RETURN(std::vector<TrainerToken> tokens, ParseTrainerTokens(text, path));
  if (tokens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("trainer tokens file \"", path, "\" names no token"));
  }
  return tokens;
}

bool JobPatternMatches(const std::string& pattern, const std::string& job) {
  absl::string_view p = pattern;
  if (absl::ConsumeSuffix(&p, "*")) return absl::StartsWith(job, p);
  return p == job;
}

absl::StatusOr<std::string> TokenFromEnvironment(const std::string& token_file) {
  if (!token_file.empty()) return ReadTokenFile(token_file);
  if (const char* f = std::getenv("CKPT_TOKEN_FILE"); f != nullptr && *f != '\0') return ReadTokenFile(f);
  std::string token = EnvOr("CKPT_TOKEN");
  if (!token.empty()) {
    CKPT_RETURN_IF_ERROR(CheckTokenStrength(token, "CKPT_TOKEN"));
    if (!HeaderSafe(token)) return absl::InvalidArgumentError("CKPT_TOKEN holds a character that cannot go in a header");
  }
  return token;
}

void AddToken(grpc::ClientContext* ctx, const std::string& token) {
  if (!token.empty()) ctx->AddMetadata("authorization", absl::StrCat(kBearer, token));
}

namespace {

// Adds the token to every call of a channel.
class TokenInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(const std::string* header) : header_(header) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization", *header_);
    }
    methods->Proceed();
  }

 private:
  const std::string* header_;  // owned by the factory, which the channel keeps
};

class TokenInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(const std::string& token) : header_(absl::StrCat(kBearer, token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new TokenInterceptor(&header_);
  }

 private:
  const std::string header_;
};

}  // namespace

void SetReconnectArgs(grpc::ChannelArguments* args, const std::string& addresses) {
  args->SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args->SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // The minimum connect timeout; a list's is SetFailoverArgs' (the argument
  // given twice, gRPC 1.51 used the first: 20 s per paused replica).
  if (GrpcTargetOf(addresses) == addresses) args->SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 20000);
  args->SetMaxReceiveMessageSize(-1);
  args->SetMaxSendMessageSize(-1);
}

std::string GrpcTargetOf(const std::string& addresses) {
  if (addresses.find(',') == std::string::npos || addresses.find(':') == std::string::npos ||
      absl::StartsWith(addresses, "ipv4:") || absl::StartsWith(addresses, "ipv6:")) {
    return addresses;
  }
  return absl::StrCat(addresses.front() == '[' ? "ipv6:" : "ipv4:", addresses);
}

void SetFailoverArgs(const std::string& addresses, grpc::ChannelArguments* args) {
  if (GrpcTargetOf(addresses) == addresses) return;  // one address: nothing to fail over to
  // The channel's authority is the whole list, which gRPC would send as the
  // TLS server name (SNI): every replica then logged "No match found for
  // server name: 10.0.0.1:7400,10.0.0.2:7400". Name the first address's host
  // instead (an IP literal is sent as no server name at all). Callers of a
  // list check meta by its identity (TlsFiles::expect_peer_uri), not by name.
  std::string first = addresses.substr(0, addresses.find(','));
  if (!first.empty() && first.front() == '[') {
    first = first.substr(1, first.find(']') == std::string::npos ? std::string::npos : first.find(']') - 1);
  } else if (const size_t colon = first.rfind(':'); colon != std::string::npos) {
    first.resize(colon);
  }
  if (!first.empty()) args->SetSslTargetNameOverride(first);
  args->SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 2000);
  args->SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 3000);
  args->SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args->SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args->SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 5000);  // the connect attempt's timeout
}

void SetFailoverServerArgs(grpc::ServerBuilder* builder) {
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
}

std::shared_ptr<grpc::Channel> ChannelWithToken(const std::string& addresses,
                                                std::shared_ptr<grpc::ChannelCredentials> credentials,
                                                const grpc::ChannelArguments& given, const std::string& token) {
  const std::string target = GrpcTargetOf(addresses);
  grpc::ChannelArguments args = given;
  SetFailoverArgs(addresses, &args);
  if (token.empty()) return grpc::CreateCustomChannel(target, credentials, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<TokenInterceptorFactory>(token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, credentials, args, std::move(interceptors));
}

namespace {

// The bearer token of a call, if it sent one.
std::optional<absl::string_view> SentToken(const grpc::ServerContextBase& ctx) {
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return std::nullopt;
  const absl::string_view value(it->second.data(), it->second.size());
  return absl::StartsWith(value, kBearer) ? value.substr(kBearer.size()) : absl::string_view();
}

// Equal, without stopping at the first differing byte.
bool SameToken(absl::string_view got, const std::string& want) {
  unsigned diff = got.size() == want.size() ? 0u : 1u;
  for (size_t i = 0; i < want.size(); ++i) {
    diff |= static_cast<unsigned char>(i < got.size() ? got[i] : 0) ^ static_cast<unsigned char>(want[i]);
  }
  return diff == 0;
}

}  // namespace

grpc::Status CheckAdminToken(const grpc::ServerContextBase& ctx, const std::string& admin_token,
                             const char* rpc) {
  if (admin_token.empty()) return grpc::Status::OK;
  const std::optional<absl::string_view> got = SentToken(ctx);
  if (!got) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        absl::StrCat(rpc, " is an admin call: send the admin token (ckptctl --token-file, "
                                          "or CKPT_TOKEN_FILE)"));
  }
  if (!SameToken(*got, admin_token)) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat(rpc, " is an admin call and the token sent is not the admin token"));
  }
  return grpc::Status::OK;
}

grpc::Status CheckAgentToken(const grpc::ServerContextBase& ctx, const std::string& agent_token,
                             const std::string& admin_token, const char* rpc) {
  if (agent_token.empty()) return grpc::Status::OK;
  const std::optional<absl::string_view> got = SentToken(ctx);
  if (!got) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        absl::StrCat(rpc, " is an agent call: send the agent token (ckpt-agent --token-file)"));
  }
  if (!SameToken(*got, agent_token) && (admin_token.empty() || !SameToken(*got, admin_token))) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat(rpc, " is an agent call and the token sent is not the agent token"));
  }
  return grpc::Status::OK;
}

namespace {

// The trainer identity whose token `got` is, if any (every entry compared:
// the time taken does not say which one matched).
const TrainerToken* FindTrainer(absl::string_view got, const std::vector<TrainerToken>& trainers) {
  const TrainerToken* found = nullptr;
  for (const TrainerToken& t : trainers) {
    if (SameToken(got, t.token)) found = &t;
  }
  return found;
}

bool IsAdminOrAgent(absl::string_view got, const CallerTokens& tokens) {
  return (!tokens.admin.empty() && SameToken(got, tokens.admin)) ||
         (!tokens.agent.empty() && SameToken(got, tokens.agent));
}

}  // namespace

grpc::Status CheckJobCaller(const grpc::ServerContextBase& ctx, const CallerTokens& tokens, const std::string& job_id,
                            const char* rpc) {
  if (tokens.trainers.empty()) return grpc::Status::OK;
  const std::string job = job_id.empty() ? std::string() : absl::StrCat(" of job \"", job_id, "\"");
  const std::optional<absl::string_view> got = SentToken(ctx);
  if (!got) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        absl::StrCat(rpc, job, " needs a token: a trainer token for the job (ClientOptions::token_file, "
                                               "CKPT_TOKEN_FILE) or the admin token (ckptctl --token-file)"));
  }
  if (IsAdminOrAgent(*got, tokens)) return grpc::Status::OK;
  const TrainerToken* trainer = FindTrainer(*got, tokens.trainers);
  if (trainer == nullptr) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat(rpc, job, ": the token sent is not one ckpt-meta knows"));
  }
  if (job_id.empty()) return grpc::Status::OK;
  for (const std::string& p : trainer->jobs) {
    if (JobPatternMatches(p, job_id)) return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      absl::StrCat(rpc, job, ": the token sent may use only jobs ",
                                   absl::StrJoin(trainer->jobs, ",")));
}

std::optional<std::vector<std::string>> VisibleJobs(const grpc::ServerContextBase& ctx, const CallerTokens& tokens) {
  if (tokens.trainers.empty()) return std::nullopt;
  const std::optional<absl::string_view> got = SentToken(ctx);
  if (!got) return std::vector<std::string>();
  if (IsAdminOrAgent(*got, tokens)) return std::nullopt;
  const TrainerToken* trainer = FindTrainer(*got, tokens.trainers);
  return trainer == nullptr ? std::vector<std::string>() : trainer->jobs;
}

bool IsLoopbackListen(const std::string& listen) {
  if (absl::StartsWith(listen, "unix:")) return true;
  std::string host = listen;
  if (auto colon = listen.rfind(':'); colon != std::string::npos) host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

}  // namespace ckpt
