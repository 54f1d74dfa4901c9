// TLS and token flags shared by the daemons (docs/security.md): --tls-ca,
// --tls-cert, --tls-key (config keys tls_ca, tls_cert, tls_key; environment
// CKPT_TLS_CA, CKPT_TLS_CERT, CKPT_TLS_KEY through the layered config).
#pragma once

#include <CLI/CLI.hpp>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/grpc_security.h"
#include "common/log.h"
#include "common/pki.h"

namespace ckpt::daemon {

struct TlsFlags {
  std::string ca, cert, key, reload, crl_dir;
  bool insecure = false;
  CLI::Option* insecure_opt = nullptr;  // servers only
  CLI::Option* ca_opt = nullptr;
  CLI::Option* cert_opt = nullptr;
  CLI::Option* key_opt = nullptr;
  CLI::Option* reload_opt = nullptr;  // servers only
  CLI::Option* crl_opt = nullptr;     // servers only
};

// Default of tls_reload_seconds: 0, read the files once at start (the path
// every TLS test runs under the sanitizers); set it (e.g. 60) so certificates
// renewed on disk (cert-manager, Vault agent) apply without a restart.
inline constexpr uint32_t kDefaultTlsReloadSeconds = 0;

inline void AddTlsFlags(CLI::App& app, TlsFlags* f, bool server) {
  const std::string who = server ? "callers'" : "server's";
  f->ca_opt = app.add_option("--tls-ca", f->ca,
                             "PEM file of the CA that signs the " + who +
                                 " certificates. With --tls-cert and --tls-key: gRPC over TLS" +
                                 (server ? ", callers must present a certificate this CA signed "
                                           "(mutual TLS)."
                                         : "."))
                  ->type_name("FILE");
  f->cert_opt = app.add_option("--tls-cert", f->cert, "PEM file of this daemon's certificate (chain).")
                    ->type_name("FILE");
  f->key_opt = app.add_option("--tls-key", f->key, "PEM file of its private key.")->type_name("FILE");
  if (server) {
    f->reload_opt = app.add_option("--tls-reload-seconds", f->reload,
                                   "Re-read the three TLS files this often; new connections (served, and an "
                                   "agent's to meta) use what they hold (0: read once at start).")
                        ->type_name("S")
                        ->default_str(std::to_string(kDefaultTlsReloadSeconds));
    f->insecure_opt = app.add_flag("--insecure", f->insecure,
                                   "Serve plaintext gRPC with no caller authentication (no TLS). Only for a "
                                   "test cluster on one machine: refused unless every listen address is "
                                   "loopback. Without it the daemon refuses to start without --tls-ca, "
                                   "--tls-cert and --tls-key (make them with `ckptctl certs`).");
    f->crl_opt = app.add_option("--tls-crl-dir", f->crl_dir,
                                "Directory of CRLs (PEM, hashed with `openssl rehash DIR`); callers whose "
                                "certificate one revokes are refused, and an agent refuses such a meta. "
                                "Read at each handshake.")
                     ->type_name("DIR");
  }
}

inline void SetTlsFlags(const TlsFlags& f, std::map<std::string, std::string>* flags) {
  if (f.ca_opt->count() > 0) (*flags)["--tls-ca"] = f.ca;
  if (f.cert_opt->count() > 0) (*flags)["--tls-cert"] = f.cert;
  if (f.key_opt->count() > 0) (*flags)["--tls-key"] = f.key;
  if (f.reload_opt != nullptr && f.reload_opt->count() > 0) (*flags)["--tls-reload-seconds"] = f.reload;
  if (f.crl_opt != nullptr && f.crl_opt->count() > 0) (*flags)["--tls-crl-dir"] = f.crl_dir;
  if (f.insecure_opt != nullptr && f.insecure_opt->count() > 0) (*flags)["--insecure"] = f.insecure ? "true" : "false";
}

// How a daemon's TCP listeners are secured: mutual TLS (the default and the
// only choice beyond loopback) or, with --insecure (config key `insecure`),
// plaintext with no caller authentication on loopback addresses only.
// `listens` are (flag, host:port) of the daemon's TCP listeners that serve
// ckpt's protocols (gRPC, the data plane; not the read-only metrics page). InvalidArgument, a usage error that names the
// fix, when the daemon would serve plaintext without --insecure, or
// --insecure on a non-loopback address, or --insecure beside TLS files.
inline absl::StatusOr<bool> InsecureSetting(const Config& config, const TlsFiles& tls,
                                            const std::vector<std::pair<std::string, std::string>>& listens) {
  absl::StatusOr<bool> insecure = config.GetBoolOr("insecure", false);
  if (!insecure.ok()) return insecure.status();
  if (*insecure && tls.enabled()) {
    return absl::InvalidArgumentError(
        "--insecure and --tls-ca/--tls-cert/--tls-key exclude each other: drop --insecure to serve mutual TLS");
  }
  if (!*insecure && !tls.enabled()) {
    return absl::InvalidArgumentError(
        "refusing to serve without mutual TLS: give --tls-ca, --tls-cert and --tls-key (make a CA and this "
        "daemon's certificate with `ckptctl certs create-ca` and `ckptctl certs create-meta|create-node`; "
        "docs/security.md), or --insecure for a test cluster on loopback addresses only");
  }
  if (*insecure) {
    for (const auto& [flag, address] : listens) {
      if (!address.empty() && !IsLoopbackListen(address)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--insecure is for loopback addresses only and ", flag, " is ", address,
            ": any host that reaches it could call every RPC; serve mutual TLS (--tls-ca, --tls-cert, --tls-key)"));
      }
    }
  }
  return *insecure;
}

// A server's TLS settings (tls_ca, tls_cert, tls_key, tls_reload_seconds).
inline absl::StatusOr<TlsFiles> TlsSettings(const Config& config) {
  TlsFiles t;
  t.ca_file = config.GetStringOr("tls_ca", "");
  t.cert_file = config.GetStringOr("tls_cert", "");
  t.key_file = config.GetStringOr("tls_key", "");
  absl::StatusOr<uint64_t> reload = config.GetUint64Or("tls_reload_seconds", kDefaultTlsReloadSeconds);
  if (!reload.ok()) return reload.status();
  if (*reload > 86400) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls_reload_seconds is ", *reload, "; at most 86400 (a day), or 0 to read the files once"));
  }
  t.reload_seconds = static_cast<uint32_t>(*reload);
  t.crl_dir = config.GetStringOr("tls_crl_dir", "");
  if (!t.crl_dir.empty() && !t.enabled()) {
    return absl::InvalidArgumentError("--tls-crl-dir needs TLS (--tls-ca, --tls-cert, --tls-key)");
  }
  return t;
}

// The token in the file config key `key` names ("" if the key is unset).
inline absl::StatusOr<std::string> TokenSetting(const Config& config, const std::string& key) {
  const std::string file = config.GetStringOr(key, "");
  if (file.empty()) return std::string();
  absl::StatusOr<std::string> token = ReadTokenFile(file);
  if (!token.ok()) return absl::InvalidArgumentError(absl::StrCat(key, ": ", token.status().message()));
  return token;
}

// A daemon's own certificate (tls.cert_file) must carry `want`'s identity
// (a node's id, or meta's): InvalidArgument saying which identity it carries
// and how to issue the right one otherwise.
inline absl::Status CheckOwnIdentity(const TlsFiles& tls, const pki::Identity& want) {
  std::string pem;
  {
    std::ifstream in(tls.cert_file, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    pem = text.str();
  }
  absl::StatusOr<pki::Identity> got = pki::IdentityOfCertificate(pem);
  const std::string wanted = want.role == pki::Role::kNode ? absl::StrCat("ckpt://node/", want.name) : "ckpt://meta";
  const std::string issue = want.role == pki::Role::kNode
                                ? absl::StrCat("ckptctl certs create-node --node-id ", want.name, " --host ...")
                                : std::string("ckptctl certs create-meta --host ...");
  if (!got.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-cert \"", tls.cert_file, "\" carries no ckpt identity (",
                                                   got.status().message(), "); this daemon needs one naming ", wanted,
                                                   ": `", issue, "` (docs/security.md)"));
  }
  if (got->role != want.role || got->name != want.name) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-cert \"", tls.cert_file, "\" is ckpt://",
                                                   std::string(pki::RoleName(got->role)), got->name.empty() ? "" : "/", got->name,
                                                   " but this daemon is ", wanted, ": `", issue, "`"));
  }
  // A DPU agent's certificate names the host it serves, and only a DPU
  // agent's does (meta checks RegisterNode the same way).
  if (want.role == pki::Role::kNode && got->host_node != want.host_node) {
    if (want.host_node.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls-cert \"", tls.cert_file, "\" is a DPU's certificate (serving host ", got->host_node,
          "): run ckpt-dpu-agent --host-node ", got->host_node, ", or give this agent a certificate made without "
          "--host-node"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-cert \"", tls.cert_file, "\" ",
        got->host_node.empty() ? std::string("names no host")
                               : absl::StrCat("names host \"", got->host_node, "\" (ckpt://host/", got->host_node, ")"),
        " but --host-node is \"", want.host_node, "\": meta admits a DPU only as the host's its certificate names: `",
        issue, " --host-node ", want.host_node, "`"));
  }
  return absl::OkStatus();
}

}  // namespace ckpt::daemon
