// `ckptctl certs ...`; see cert_commands.h.
#include "cli/cert_commands.h"

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/file_system.h"
#include "common/pki.h"

namespace ckpt::cli {
namespace {

using Json = nlohmann::ordered_json;

constexpr char kProgram[] = "ckptctl";
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// Set-up mistakes the user fixes by changing the command or the files named
// are usage errors (2); anything else (a failed write) is a failure (1).
int Fail(const absl::Status& s) {
  std::fprintf(stderr, "%s: certs: %s\n", kProgram, std::string(s.message()).c_str());
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kPermissionDenied:
      return kExitUsage;
    default:
      return kExitFailure;
  }
}

Json IdentityJson(const pki::Identity& id) {
  Json j{{"role", std::string(pki::RoleName(id.role))}, {"name", id.name}, {"jobs", id.jobs}};
  if (!id.host_node.empty()) j["host_node"] = id.host_node;
  return j;
}

std::string IdentityText(const pki::Identity& id) {
  std::string s(pki::RoleName(id.role));
  if (!id.name.empty()) absl::StrAppend(&s, " ", id.name);
  if (!id.jobs.empty()) absl::StrAppend(&s, " (jobs ", absl::StrJoin(id.jobs, ", "), ")");
  if (!id.host_node.empty()) absl::StrAppend(&s, " (a DPU serving host ", id.host_node, ")");
  return s;
}

std::string TimeText(int64_t unix_s) {
  return absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::FromUnixSeconds(unix_s), absl::UTCTimeZone());
}

int Written(bool json, const std::string& what, const std::string& cert, const std::string& key,
            const pki::Identity* id) {
  if (json) {
    Json j{{"cert", cert}, {"key", key}};
    if (id != nullptr) j["identity"] = IdentityJson(*id);
    std::cout << j.dump(2) << "\n";
    return kExitOk;
  }
  std::cout << "wrote " << what << ":\n  " << cert << "  (certificate" << (id != nullptr ? " chain" : "")
            << ", mode 0644)\n  " << key << "  (private key, mode 0600: keep it secret)\n";
  if (id != nullptr) std::cout << "identity: " << IdentityText(*id) << "\n";
  return kExitOk;
}

}  // namespace

struct CertCommands::Options {
  CLI::App* certs = nullptr;
  CLI::App* create_ca = nullptr;
  CLI::App* create_meta = nullptr;
  CLI::App* create_node = nullptr;
  CLI::App* create_client = nullptr;
  CLI::App* show = nullptr;
  CLI::App* revoke = nullptr;
  std::string dir;
  std::string crl_dir;
  int days_crl = 30;
  std::vector<std::string> files;
  std::string ca_dir;
  std::string out;
  int days_ca = pki::CaOptions().days;
  int days = pki::CertOptions().days;
  std::vector<std::string> hosts;
  std::string node_id;
  std::string host_node;
  std::string role;
  std::string name;
  std::vector<std::string> jobs;
  std::string file;
};

CertCommands::CertCommands(CLI::App* app) : o_(std::make_unique<Options>()) {
  Options& o = *o_;
  o.certs = app->add_subcommand(
      "certs",
      "Make the cluster's CA and certificates, or show one (local files only: connects nowhere; "
      "docs/security.md).");
  o.certs->require_subcommand(1);

  auto days = [](CLI::App* cmd, int* value, const char* what) {
    cmd->add_option("--days", *value, what)->check(CLI::Range(1, 36500))->capture_default_str();
  };
  auto hosts = [&o](CLI::App* cmd) {
    cmd->add_option("--host", o.hosts,
                    "A DNS name or IP address the holder is reached at (repeat, or separate with commas; "
                    "callers check it)")
        ->required()
        ->expected(1)
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
        ->delimiter(',')
        ->type_name("HOST");
  };
  auto ca_dir = [&o](CLI::App* cmd) {
    cmd->add_option("--ca-dir", o.ca_dir, "Directory holding ca.pem and ca.key (from create-ca)")
        ->required()
        ->type_name("DIR");
  };
  auto out = [&o](CLI::App* cmd) {
    cmd->add_option("--out", o.out, "Write PREFIX.pem (the certificate and the CA's) and PREFIX.key")
        ->required()
        ->type_name("PREFIX");
  };

  o.create_ca = o.certs->add_subcommand(
      "create-ca", "Make the cluster CA: DIR/ca.pem (give to every daemon and client) and DIR/ca.key (keep safe).");
  o.create_ca->add_option("--dir", o.dir, "Directory for ca.pem and ca.key (created, mode 0700, if missing)")
      ->required()
      ->type_name("DIR");
  days(o.create_ca, &o.days_ca, "Days the CA is valid");

  o.create_meta = o.certs->add_subcommand("create-meta", "A certificate for ckpt-meta (server and client).");
  ca_dir(o.create_meta);
  hosts(o.create_meta);
  out(o.create_meta);
  days(o.create_meta, &o.days, "Days the certificate is valid");

  o.create_node = o.certs->add_subcommand(
      "create-node", "A certificate for one node's agent, naming its node id (server and client).");
  ca_dir(o.create_node);
  o.create_node->add_option("--node-id", o.node_id, "The node id the agent runs with (--node-id)")
      ->required()
      ->type_name("ID");
  o.create_node
      ->add_option("--host-node", o.host_node,
                   "A DPU's certificate: the host node it serves (ckpt-dpu-agent --host-node). Meta admits the DPU "
                   "only as that host's, and that host's ckpt-dpu-proxy talks only to it (docs/dpu.md)")
      ->type_name("ID");
  hosts(o.create_node);
  out(o.create_node);
  days(o.create_node, &o.days, "Days the certificate is valid");

  o.create_client = o.certs->add_subcommand(
      "create-client", "A client certificate: admin (everything), operator (read-only) or trainer (its jobs).");
  ca_dir(o.create_client);
  o.create_client->add_option("--role", o.role, "admin, operator or trainer")
      ->required()
      ->check(CLI::IsMember({"admin", "operator", "trainer"}))
      ->type_name("ROLE");
  o.create_client->add_option("--name", o.name, "Who holds it: [A-Za-z0-9._-]{1,63}")->required()->type_name("NAME");
  o.create_client
      ->add_option("--jobs", o.jobs,
                   "Trainers only (required for them): the jobs it may use, as job ids, prefixes ending in '*', "
                   "or '*' for every job")
      ->delimiter(',')
      ->type_name("PATTERN[,PATTERN...]");
  out(o.create_client);
  days(o.create_client, &o.days, "Days the certificate is valid");

  o.show = o.certs->add_subcommand(
      "show", "Print a certificate's identity (role, name, jobs), names, usage, validity and issuer.");
  o.show->add_option("FILE", o.file, "PEM certificate (the first of a chain)")->required()->type_name("FILE.pem");

  o.revoke = o.certs->add_subcommand(
      "revoke",
      "Revoke certificates: (re)write the CA's revocation list in --crl-dir, the directory every daemon and client "
      "reads with --tls-crl-dir. Certificates it revoked before stay revoked; with no FILE it only renews the list.");
  ca_dir(o.revoke);
  o.revoke->add_option("--crl-dir", o.crl_dir, "Directory for the list (<hash>.r0; created, mode 0755, if missing)")
      ->required()
      ->type_name("DIR");
  days(o.revoke, &o.days_crl, "Days the list is valid (renew it before then: peers refuse every certificate of a "
                              "CA whose list has expired)");
  o.revoke->add_option("FILE", o.files, "PEM certificates to revoke (the first of each chain)")->type_name("FILE.pem");
}

CertCommands::~CertCommands() = default;

bool CertCommands::chosen() const { return o_->certs->parsed(); }

int CertCommands::Run(bool json) const {
  const Options& o = *o_;
  if (o.create_ca->parsed()) {
    pki::CaOptions ca;
    ca.days = o.days_ca;
    if (absl::Status s = pki::CreateCa(o.dir, ca); !s.ok()) return Fail(s);
    if (json) {
      std::cout << Json{{"cert", pki::CaCertPath(o.dir)}, {"key", pki::CaKeyPath(o.dir)}}.dump(2) << "\n";
      return kExitOk;
    }
    std::cout << "wrote the cluster CA:\n  " << pki::CaCertPath(o.dir)
              << "  (CA certificate, mode 0644: every daemon and client gets it, --tls-ca)\n  "
              << pki::CaKeyPath(o.dir)
              << "  (CA key, mode 0600: signs certificates; keep it off the cluster's nodes)\n";
    return kExitOk;
  }
  if (o.show->parsed()) {
    absl::StatusOr<std::string> pem = ReadFileToString(PosixFileSystem(), o.file);
    if (!pem.ok()) return Fail(pem.status());
    absl::StatusOr<pki::CertificateInfo> info = pki::DescribeCertificate(*pem);
    if (!info.ok()) return Fail(absl::InvalidArgumentError(absl::StrCat("\"", o.file, "\": ", info.status().message())));
    const int64_t now = absl::ToUnixSeconds(absl::Now());
    if (json) {
      Json j{{"file", o.file},
             {"identity", info->identity.ok() ? IdentityJson(*info->identity) : Json(nullptr)},
             {"identity_error", info->identity.ok() ? "" : std::string(info->identity.status().message())},
             {"is_ca", info->is_ca},
             {"subject", info->subject},
             {"issuer", info->issuer},
             {"serial", info->serial_hex},
             {"not_before_unix_s", info->not_before_unix_s},
             {"not_after_unix_s", info->not_after_unix_s},
             {"valid_now", info->not_before_unix_s <= now && now < info->not_after_unix_s},
             {"uris", info->uris},
             {"dns", info->dns_names},
             {"ip", info->ip_addresses},
             {"extended_key_usage", info->extended_key_usages},
             {"chain_length", info->chain_length}};
      std::cout << j.dump(2) << "\n";
      return kExitOk;
    }
    std::string identity;
    if (info->identity.ok()) {
      identity = IdentityText(*info->identity);
    } else if (info->is_ca) {
      identity = "none (a CA certificate)";
    } else {
      identity = absl::StrCat("none: ", info->identity.status().message());
    }
    std::string validity = absl::StrCat(TimeText(info->not_before_unix_s), " to ", TimeText(info->not_after_unix_s));
    if (now < info->not_before_unix_s) {
      absl::StrAppend(&validity, " (not valid yet)");
    } else if (now >= info->not_after_unix_s) {
      absl::StrAppend(&validity, " (EXPIRED ", (now - info->not_after_unix_s) / 86400, " days ago)");
    } else {
      absl::StrAppend(&validity, " (", (info->not_after_unix_s - now) / 86400, " days left)");
    }
    const auto list = [](const std::vector<std::string>& v) { return v.empty() ? "-" : absl::StrJoin(v, ", "); };
    std::cout << "file:      " << o.file << " (" << info->chain_length
              << (info->chain_length == 1 ? " certificate" : " certificates") << ")\n"
              << "identity:  " << identity << "\n"
              << "subject:   " << info->subject << "\n"
              << "issuer:    " << info->issuer << "\n"
              << "serial:    " << info->serial_hex << "\n"
              << "valid:     " << validity << "\n"
              << "ca:        " << (info->is_ca ? "yes" : "no") << "\n"
              << "usage:     " << list(info->extended_key_usages) << "\n"
              << "uri:       " << list(info->uris) << "\n"
              << "dns:       " << list(info->dns_names) << "\n"
              << "ip:        " << list(info->ip_addresses) << "\n";
    return kExitOk;
  }

  if (o.revoke->parsed()) {
    absl::StatusOr<pki::CrlInfo> crl = pki::RevokeCertificates(o.ca_dir, o.files, o.crl_dir, o.days_crl);
    if (!crl.ok()) return Fail(crl.status());
    if (json) {
      std::cout << Json{{"crl", crl->path},
                        {"revoked_serials", crl->revoked_serials_hex},
                        {"newly_revoked", crl->newly_revoked},
                        {"next_update_unix_s", crl->next_update_unix_s}}
                       .dump(2)
                << "\n";
      return kExitOk;
    }
    std::cout << "wrote the CA's revocation list " << crl->path << " (mode 0644): " << crl->newly_revoked
              << " certificate(s) newly revoked, " << crl->revoked_serials_hex.size() << " in all\n"
              << "valid until " << TimeText(crl->next_update_unix_s)
              << ": renew it before then with `ckptctl certs revoke --ca-dir " << o.ca_dir << " --crl-dir "
              << o.crl_dir << "`\n"
              << "copy " << o.crl_dir << " to every node; daemons and clients read it with --tls-crl-dir\n";
    return kExitOk;
  }

  pki::CertOptions c;
  c.days = o.days;
  c.hosts = o.hosts;
  std::string what;
  if (o.create_meta->parsed()) {
    c.identity = {pki::Role::kMeta, "", {}};
    what = "ckpt-meta's certificate";
  } else if (o.create_node->parsed()) {
    c.identity = {pki::Role::kNode, o.node_id, {}, o.host_node};
    what = o.host_node.empty() ? absl::StrCat("node ", o.node_id, "'s certificate")
                               : absl::StrCat("DPU node ", o.node_id, "'s certificate (serving host ", o.host_node, ")");
  } else if (o.create_client->parsed()) {
    absl::StatusOr<pki::Role> role = pki::ParseRole(o.role);
    if (!role.ok()) return Fail(role.status());
    if (*role == pki::Role::kTrainer && o.jobs.empty()) {
      return Fail(absl::InvalidArgumentError("a trainer certificate needs --jobs (the jobs it may use; '*' for all)"));
    }
    if (*role != pki::Role::kTrainer && !o.jobs.empty()) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--jobs is for trainers only (an ", o.role == "admin" ? "admin" : "operator",
                       " certificate reaches every job)")));
    }
    c.identity = {*role, o.name, o.jobs};
    what = absl::StrCat(o.role, " ", o.name, "'s certificate");
  } else {
    return kExitUsage;
  }
  if (absl::Status s = pki::IssueCertificate(o.ca_dir, c, o.out); !s.ok()) return Fail(s);
  return Written(json, what, pki::CertPath(o.out), pki::KeyPath(o.out), &c.identity);
}

}  // namespace ckpt::cli
