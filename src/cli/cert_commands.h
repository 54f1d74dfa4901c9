// `ckptctl certs ...`: the cluster's CA and certificates (common/pki.h,
// docs/cli.md "Certificates", docs/security.md). Local files only: these
// commands never connect anywhere and need neither a running meta nor TLS
// settings.
//
//   certs create-ca --dir DIR [--days N]
//   certs create-meta --ca-dir DIR --host H [--host H ...] --out PREFIX [--days N]
//   certs create-node --ca-dir DIR --node-id ID --host H [--host H ...] --out PREFIX [--days N]
//   certs create-client --ca-dir DIR --role admin|operator|trainer --name NAME
//                       [--jobs PATTERN[,PATTERN...]] --out PREFIX [--days N]
//   certs show FILE.pem
//
// Exit codes: 0 ok (the files written, or the certificate, on stdout); 2 a
// usage error, with the reason on stderr: a bad argument, an output file that
// exists (nothing is overwritten), no CA in --ca-dir, a CA key others can
// read; 1 any other failure (a write error).
//
// Thread safety: used from main() only.
#pragma once

#include <memory>

namespace CLI {
class App;
}  // namespace CLI

namespace ckpt::cli {

class CertCommands {
 public:
  // Adds the `certs` command and its subcommands to `app` (which must outlive
  // this object); their options are stored here.
  explicit CertCommands(CLI::App* app);
  ~CertCommands();
  CertCommands(const CertCommands&) = delete;
  CertCommands& operator=(const CertCommands&) = delete;

  // True once `app` parsed a `certs` command.
  bool chosen() const;

  // Runs the parsed command; returns the exit code. `json`: one JSON document
  // on stdout (docs/cli.md).
  int Run(bool json) const;

 private:
  struct Options;
  std::unique_ptr<Options> o_;
};

}  // namespace ckpt::cli
