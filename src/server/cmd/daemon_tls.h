// TLS and token flags shared by the daemons (docs/security.md): --tls-ca,
// --tls-cert, --tls-key (config keys tls_ca, tls_cert, tls_key; environment
// CKPT_TLS_CA, CKPT_TLS_CERT, CKPT_TLS_KEY through the layered config).
#pragma once

#include <CLI/CLI.hpp>

#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/grpc_security.h"
#include "common/log.h"

namespace ckpt::daemon {

struct TlsFlags {
  std::string ca, cert, key, reload, crl_dir;
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

// A daemon reachable beyond loopback without TLS (or without an admin token)
// lets anyone who reaches the port read and delete checkpoints: say so.
// `unguarded` says what a caller may do without the admin token.
inline void WarnIfOpen(const char* program, const std::string& listen, const TlsFiles& tls, bool admin_token,
                       const char* unguarded) {
  if (IsLoopbackListen(listen)) return;
  if (!tls.enabled()) {
    log::Warn("{}: listening on {} without TLS: any host that reaches it can call every RPC "
              "(--tls-ca/--tls-cert/--tls-key; docs/security.md)", program, listen);
  }
  if (!admin_token) {
    log::Warn("{}: no admin token: any caller may {} (--admin-token-file; docs/security.md)", program, unguarded);
  }
}

}  // namespace ckpt::daemon
