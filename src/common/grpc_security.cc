// gRPC credentials and bearer tokens; see grpc_security.h.
#include "common/grpc_security.h"

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
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

const char* EnvOr(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

}  // namespace

void TlsFilesFromEnvironment(TlsFiles* files) {
  if (files->ca_file.empty()) files->ca_file = EnvOr("CKPT_TLS_CA");
  if (files->cert_file.empty()) files->cert_file = EnvOr("CKPT_TLS_CERT");
  if (files->key_file.empty()) files->key_file = EnvOr("CKPT_TLS_KEY");
}

absl::Status CheckTlsFiles(const TlsFiles& files, bool server) {
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
  CKPT_RETURN_IF_ERROR(ReadPem(files.ca_file, "CA", "--tls-ca").status());
  if (!files.cert_file.empty()) {
    CKPT_RETURN_IF_ERROR(ReadPem(files.cert_file, "certificate", "--tls-cert").status());
    CKPT_RETURN_IF_ERROR(ReadPem(files.key_file, "key", "--tls-key").status());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsFiles& files) {
  if (!files.enabled()) return grpc::InsecureServerCredentials();
  if (files.ca_file.empty() || files.cert_file.empty() || files.key_file.empty()) {
    return absl::InvalidArgumentError(
        "TLS needs all of --tls-ca, --tls-cert and --tls-key on a server (mutual TLS: the CA "
        "checks the callers' certificates)");
  }
  grpc::SslServerCredentialsOptions opts(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  CKPT_ASSIGN_OR_RETURN(opts.pem_root_certs, ReadPem(files.ca_file, "CA", "--tls-ca"));
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  CKPT_ASSIGN_OR_RETURN(pair.cert_chain, ReadPem(files.cert_file, "certificate", "--tls-cert"));
  CKPT_ASSIGN_OR_RETURN(pair.private_key, ReadPem(files.key_file, "key", "--tls-key"));
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
  grpc::SslCredentialsOptions opts;
  CKPT_ASSIGN_OR_RETURN(opts.pem_root_certs, ReadPem(files.ca_file, "CA", "--tls-ca"));
  if (!files.cert_file.empty()) {
    CKPT_ASSIGN_OR_RETURN(opts.pem_cert_chain, ReadPem(files.cert_file, "certificate", "--tls-cert"));
    CKPT_ASSIGN_OR_RETURN(opts.pem_private_key, ReadPem(files.key_file, "key", "--tls-key"));
  }
  return grpc::SslCredentials(opts);
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("token file \"", path, "\" cannot be read"));
  }
  if ((st.st_mode & 0007) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token file \"", path, "\" is readable by every user (mode ", absl::StrFormat("%04o", st.st_mode & 07777),
        "): chmod o-rwx it"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("token file \"", path, "\" cannot be read"));
  std::ostringstream text;
  text << in.rdbuf();
  std::string token(absl::StripAsciiWhitespace(text.str()));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("token file \"", path, "\" is empty"));
  for (char c : token) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrCat("token file \"", path, "\" holds a character that cannot go in a header"));
    }
  }
  return token;
}

absl::StatusOr<std::string> TokenFromEnvironment(const std::string& token_file) {
  if (!token_file.empty()) return ReadTokenFile(token_file);
  if (const char* f = std::getenv("CKPT_TOKEN_FILE"); f != nullptr && *f != '\0') return ReadTokenFile(f);
  return std::string(EnvOr("CKPT_TOKEN"));
}

void AddToken(grpc::ClientContext* ctx, const std::string& token) {
  if (!token.empty()) ctx->AddMetadata("authorization", absl::StrCat(kBearer, token));
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

bool IsLoopbackListen(const std::string& listen) {
  if (absl::StartsWith(listen, "unix:")) return true;
  std::string host = listen;
  if (auto colon = listen.rfind(':'); colon != std::string::npos) host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

}  // namespace ckpt
