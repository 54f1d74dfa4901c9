// The real daemons (ckpt-meta, ckpt-agent, ckpt-dpu-agent) and ckptctl with
// TLS files that cannot work (issue 40, item 1): each refuses at start with
// exit 2 and a message naming the flag and the problem (not a key, a key of
// another certificate, no clientAuth/serverAuth, expired, --tls-ca not a CA),
// before anything is bound or created (meta's --data-dir, the agent's run
// dir and memory dir stay absent).
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "support/pki.h"
#include "support/ports.h"
#include "support/process.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using testing::RunResult;
using testing::TempDir;
using testing::TestPki;
using testing::TlsFilePaths;

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

EVP_PKEY* ReadKey(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return nullptr;
  EVP_PKEY* k = PEM_read_PrivateKey(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  return k;
}

X509* ReadCert(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return nullptr;
  X509* x = PEM_read_X509(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  return x;
}

struct CertSpec {
  std::string uri;               // subjectAltName URI ("" for none)
  std::string eku;               // extendedKeyUsage value ("" for none)
  bool ca = false;               // basicConstraints CA:TRUE
  long not_before_s = -3600;     // from now
  long not_after_s = 86400;      // from now
  bool self_signed = false;      // else signed by the shared test CA
};

// Writes PREFIX.pem and PREFIX.key: a certificate OpenSSL makes as `spec`
// says (what `ckptctl certs` refuses to make: wrong uses, expired).
TlsFilePaths MakeCert(const std::string& prefix, const CertSpec& spec) {
  TestPki& pki = TestPki::Shared();
  EVP_PKEY* key = EVP_EC_gen("P-256");
  X509* cert = X509_new();
  X509_set_version(cert, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert), 4242);
  X509_gmtime_adj(X509_getm_notBefore(cert), spec.not_before_s);
  X509_gmtime_adj(X509_getm_notAfter(cert), spec.not_after_s);
  X509_set_pubkey(cert, key);
  X509_NAME* name = X509_get_subject_name(cert);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("test"), -1, -1, 0);
  X509* ca = spec.self_signed ? nullptr : ReadCert(pki.ca_dir() + "/ca.pem");
  EVP_PKEY* ca_key = spec.self_signed ? nullptr : ReadKey(pki.ca_dir() + "/ca.key");
  X509_set_issuer_name(cert, ca != nullptr ? X509_get_subject_name(ca) : name);
  X509V3_CTX ctx;
  X509V3_set_ctx(&ctx, ca != nullptr ? ca : cert, cert, nullptr, nullptr, 0);
  auto add = [&](int nid, const std::string& value) {
    X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
    EXPECT_NE(ext, nullptr) << value;
    if (ext != nullptr) X509_add_ext(cert, ext, -1);
    X509_EXTENSION_free(ext);
  };
  add(NID_basic_constraints, spec.ca ? "critical,CA:TRUE" : "critical,CA:FALSE");
  if (!spec.uri.empty()) add(NID_subject_alt_name, "URI:" + spec.uri + ",IP:127.0.0.1");
  if (!spec.eku.empty()) add(NID_ext_key_usage, spec.eku);
  X509_sign(cert, ca_key != nullptr ? ca_key : key, EVP_sha256());
  TlsFilePaths out{pki.ca_dir() + "/ca.pem", prefix + ".pem", prefix + ".key"};
  FILE* f = std::fopen(out.cert.c_str(), "w");
  PEM_write_X509(f, cert);
  std::fclose(f);
  f = std::fopen(out.key.c_str(), "w");
  PEM_write_PrivateKey(f, key, nullptr, nullptr, 0, nullptr, nullptr);
  std::fclose(f);
  ::chmod(out.key.c_str(), 0600);
  X509_free(cert);
  X509_free(ca);
  EVP_PKEY_free(key);
  EVP_PKEY_free(ca_key);
  return out;
}

class TlsStartupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TempDir> t = TempDir::Create();
    ASSERT_TRUE(t.ok()) << t.status();
    tmp_ = std::make_unique<TempDir>(*std::move(t));
  }
  std::string P(const std::string& name) const { return tmp_->path() + "/" + name; }

  RunResult Run(std::vector<std::string> argv) {
    testing::SubprocessOptions o;
    o.argv = std::move(argv);
    o.env = {{"CKPT_META", ""}, {"CKPT_TLS_CA", ""}, {"CKPT_TLS_CERT", ""}, {"CKPT_TLS_KEY", ""}};
    absl::StatusOr<RunResult> r = testing::RunToCompletion(o, absl::Seconds(60));
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return RunResult{testing::ExitStatus(-1), "", ""};
    return *std::move(r);
  }

  // ckpt-meta with `tls`: must exit 2 saying `want`, its data dir never made.
  void MetaRefuses(const TlsFilePaths& tls, const std::string& want) {
    const std::string data = P("meta-data");
    RunResult r = Run({testing::BinaryPath("ckpt-meta"), "--listen", "127.0.0.1:0", "--data-dir", data, "--tls-ca",
                       tls.ca, "--tls-cert", tls.cert, "--tls-key", tls.key});
    EXPECT_TRUE(r.status.exited() && r.status.exit_code() == 2) << r.status << "\n" << r.stderr_text;
    EXPECT_THAT(r.stderr_text, HasSubstr(want));
    EXPECT_THAT(r.stderr_text, ::testing::Not(HasSubstr("cannot listen")));
    EXPECT_FALSE(Exists(data)) << "ckpt-meta created its data dir before refusing its TLS files";
  }

  // ckpt-agent (or ckpt-dpu-agent) with `tls`, node n1: exit 2 saying `want`,
  // no run dir or memory dir made.
  void AgentRefuses(const std::string& binary, const TlsFilePaths& tls, const std::string& want) {
    if (!Exists(testing::BinaryPath(binary))) {
      ADD_FAILURE() << binary << " is not built";
      return;
    }
    const std::string run = P("run"), mem = P("mem");
    std::vector<std::string> argv = {testing::BinaryPath(binary), "--node-id", "n1", "--meta", "127.0.0.1:1",
                                     "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0", "--run-dir", run,
                                     "--memory-dir", mem, "--memory", "64MiB", "--tls-ca", tls.ca,
                                     "--tls-cert", tls.cert, "--tls-key", tls.key};
    if (binary == "ckpt-dpu-agent") {
      argv.push_back("--host-node");
      argv.push_back("h1");
    }
    RunResult r = Run(argv);
    EXPECT_TRUE(r.status.exited() && r.status.exit_code() == 2) << binary << " " << r.status << "\n" << r.stderr_text;
    EXPECT_THAT(r.stderr_text, HasSubstr(want)) << binary;
    EXPECT_FALSE(Exists(run)) << binary;
    EXPECT_FALSE(Exists(mem)) << binary;
  }

  std::unique_ptr<TempDir> tmp_;
};

TEST_F(TlsStartupTest, MetaRefusesAKeyThatIsNotAKeyOrNotTheCertificatesCreatingNothing) {
  const TlsFilePaths meta = TestPki::Shared().Meta();
  // The CA's certificate given as the key (issue 40's example).
  MetaRefuses({meta.ca, meta.cert, meta.ca},
              absl::StrCat("--tls-key \"", meta.ca, "\" is not a private key: it holds a certificate"));
  // A key of another certificate.
  const TlsFilePaths other = TestPki::Shared().Node("n-other");
  MetaRefuses({meta.ca, meta.cert, other.key},
              absl::StrCat("--tls-key \"", other.key, "\" does not match the certificate --tls-cert \"", meta.cert,
                           "\""));
}

TEST_F(TlsStartupTest, MetaRefusesACaFileThatIsNotACaAndExpiredCertificates) {
  const TlsFilePaths meta = TestPki::Shared().Meta();
  MetaRefuses({meta.cert, meta.cert, meta.key}, absl::StrCat("--tls-ca \"", meta.cert, "\" is not a CA certificate"));
  const TlsFilePaths expired = MakeCert(P("expired"), {.uri = "ckpt://meta",
                                                       .eku = "serverAuth,clientAuth",
                                                       .not_before_s = -2 * 86400,
                                                       .not_after_s = -86400});
  MetaRefuses(expired, absl::StrCat("certificate \"", expired.cert, "\" (--tls-cert) expired on "));
  const TlsFilePaths old_ca = MakeCert(P("old-ca"), {.uri = "", .eku = "", .ca = true, .not_before_s = -2 * 86400, .not_after_s = -86400,
                                                     .self_signed = true});
  MetaRefuses({old_ca.cert, meta.cert, meta.key},
              absl::StrCat("CA certificate \"", old_ca.cert, "\" (--tls-ca) expired on "));
}

TEST_F(TlsStartupTest, MetaRefusesACertificateWithoutServerAuth) {
  const TlsFilePaths client = MakeCert(P("client-only"), {.uri = "ckpt://meta", .eku = "clientAuth"});
  MetaRefuses(client, absl::StrCat("--tls-cert \"", client.cert, "\" lacks serverAuth"));
}

TEST_F(TlsStartupTest, AgentsRefuseACertificateWithoutClientAuthOrAKeyThatDoesNotMatch) {
  // Serves, but cannot call meta: refused at start, not "cannot register
  // with meta: UNAVAILABLE ... Socket closed".
  const TlsFilePaths server_only = MakeCert(P("server-only"), {.uri = "ckpt://node/n1", .eku = "serverAuth"});
  AgentRefuses("ckpt-agent", server_only, absl::StrCat("--tls-cert \"", server_only.cert, "\" lacks clientAuth"));
  const TlsFilePaths n1 = TestPki::Shared().Node("n1");
  const TlsFilePaths other = TestPki::Shared().Node("n-other");
  AgentRefuses("ckpt-agent", {n1.ca, n1.cert, other.key},
               absl::StrCat("--tls-key \"", other.key, "\" does not match the certificate"));
  const TlsFilePaths dpu = TestPki::Shared().Dpu("n1", "h1");
  AgentRefuses("ckpt-dpu-agent", {dpu.ca, dpu.cert, dpu.ca},
               absl::StrCat("--tls-key \"", dpu.ca, "\" is not a private key"));
  const TlsFilePaths dpu_server_only =
      MakeCert(P("dpu-server-only"), {.uri = "ckpt://node/n1", .eku = "serverAuth"});
  AgentRefuses("ckpt-dpu-agent", dpu_server_only, "lacks clientAuth");
}

// A private key others may read is as good as published: every program
// that takes --tls-key refuses it at start, saying how to fix it.
TEST_F(TlsStartupTest, AKeyOthersMayReadOrChangeIsRefusedAtStart) {
  const TlsFilePaths meta = TestPki::Shared().Meta();
  const std::string wide = P("meta-wide.key");
  {
    std::ifstream in(meta.key, std::ios::binary);
    std::ofstream(wide, std::ios::binary) << in.rdbuf();
  }
  ASSERT_EQ(::chmod(wide.c_str(), 0644), 0);
  MetaRefuses({meta.ca, meta.cert, wide},
              absl::StrCat("key file (--tls-key) \"", wide, "\" has mode 0644 (readable by every user)"));
  ASSERT_EQ(::chmod(wide.c_str(), 0660), 0);
  MetaRefuses({meta.ca, meta.cert, wide}, absl::StrCat("no wider than 0640: chmod 0600 ", wide));
  const TlsFilePaths n1 = TestPki::Shared().Node("n1");
  const std::string node_wide = P("n1-wide.key");
  {
    std::ifstream in(n1.key, std::ios::binary);
    std::ofstream(node_wide, std::ios::binary) << in.rdbuf();
  }
  ASSERT_EQ(::chmod(node_wide.c_str(), 0604), 0);
  AgentRefuses("ckpt-agent", {n1.ca, n1.cert, node_wide}, "readable by every user");
  if (::geteuid() == 0) {
    ASSERT_EQ(::chmod(node_wide.c_str(), 0600), 0);
    ASSERT_EQ(::chown(node_wide.c_str(), 65534, 65534), 0);
    AgentRefuses("ckpt-agent", {n1.ca, n1.cert, node_wide}, "is owned by uid 65534");
  }
  const TlsFilePaths admin = TestPki::Shared().Client(pki::Role::kAdmin, "alice");
  const std::string admin_wide = P("admin-wide.key");
  {
    std::ifstream in(admin.key, std::ios::binary);
    std::ofstream(admin_wide, std::ios::binary) << in.rdbuf();
  }
  ASSERT_EQ(::chmod(admin_wide.c_str(), 0644), 0);
  RunResult r = Run({testing::BinaryPath("ckptctl"), "--meta", "127.0.0.1:1", "--timeout", "1", "--tls-ca", admin.ca,
                     "--tls-cert", admin.cert, "--tls-key", admin_wide, "nodes"});
  EXPECT_TRUE(r.status.exited() && r.status.exit_code() == 2) << r.status << "\n" << r.stderr_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("readable by every user"));
}

TEST_F(TlsStartupTest, CkptctlRefusesBadFilesAndSaysACertificateIsMissingWhenOnlyTheCaIsGiven) {
  const TlsFilePaths admin = TestPki::Shared().Client(pki::Role::kAdmin, "alice");
  // Nothing listens at 127.0.0.1:1: each refusal happens before any call.
  auto ctl = [&](std::vector<std::string> tls) {
    std::vector<std::string> argv = {testing::BinaryPath("ckptctl"), "--meta", "127.0.0.1:1", "--timeout", "1"};
    argv.insert(argv.end(), tls.begin(), tls.end());
    argv.push_back("nodes");
    return Run(argv);
  };
  RunResult r = ctl({"--tls-ca", admin.ca});
  EXPECT_TRUE(r.status.exited() && r.status.exit_code() == 2) << r.status << "\n" << r.stderr_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("--tls-ca is set but no client certificate is: give --tls-cert and --tls-key"));
  EXPECT_THAT(r.stderr_text, ::testing::Not(HasSubstr("is --tls-ca the CA")));

  r = ctl({"--tls-ca", admin.ca, "--tls-cert", admin.cert, "--tls-key", admin.ca});
  EXPECT_TRUE(r.status.exited() && r.status.exit_code() == 2) << r.status;
  EXPECT_THAT(r.stderr_text, HasSubstr(absl::StrCat("--tls-key \"", admin.ca, "\" is not a private key")));

  const TlsFilePaths server_only = MakeCert(P("ctl-server-only"), {.uri = "ckpt://admin/bob", .eku = "serverAuth"});
  r = ctl({"--tls-ca", server_only.ca, "--tls-cert", server_only.cert, "--tls-key", server_only.key});
  EXPECT_TRUE(r.status.exited() && r.status.exit_code() == 2) << r.status;
  EXPECT_THAT(r.stderr_text, HasSubstr("lacks clientAuth"));

  r = ctl({"--tls-ca", admin.cert, "--tls-cert", admin.cert, "--tls-key", admin.key});
  EXPECT_TRUE(r.status.exited() && r.status.exit_code() == 2) << r.status;
  EXPECT_THAT(r.stderr_text, HasSubstr("is not a CA certificate"));
}

}  // namespace
}  // namespace ckpt
