// The real ckptctl binary's `certs` commands (docs/cli.md "Certificates"):
// create-ca, create-meta, create-node, create-client and show, each with its
// files, modes and identity; the refusals (exit 2, a message naming what is
// wrong, nothing overwritten). Run with no meta anywhere and TLS settings in
// the environment that point nowhere: the commands must not read them nor
// connect.
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "common/pki.h"
#include "support/process.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;
using testing::RunResult;
using testing::TempDir;
using Json = nlohmann::json;

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

unsigned Mode(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return 0;
  return st.st_mode & 07777;
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

class CkptctlCertsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TempDir> t = TempDir::Create();
    ASSERT_TRUE(t.ok()) << t.status();
    tmp_ = std::make_unique<TempDir>(*std::move(t));
    ca_ = P("ca");
  }

  std::string P(const std::string& name) const { return tmp_->path() + "/" + name; }

  RunResult Ctl(std::vector<std::string> args) {
    testing::SubprocessOptions o;
    o.argv = {testing::BinaryPath("ckptctl")};
    for (std::string& a : args) o.argv.push_back(std::move(a));
    // Nothing listens at CKPT_META and the TLS files do not exist: a command
    // that read them or tried to connect would fail.
    o.env = {{"CKPT_META", "127.0.0.1:1"},
             {"CKPT_TLS_CA", P("no-such-ca.pem")},
             {"CKPT_TLS_CERT", P("no-such.pem")},
             {"CKPT_TLS_KEY", P("no-such.key")},
             {"CKPT_TOKEN_FILE", P("no-such-token")}};
    absl::StatusOr<RunResult> r = testing::RunToCompletion(o, absl::Seconds(60));
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return RunResult{testing::ExitStatus(-1), "", ""};
    return *std::move(r);
  }

  // Runs a command that must succeed.
  std::string Ok(std::vector<std::string> args) {
    RunResult r = Ctl(args);
    EXPECT_TRUE(r.status.success()) << r.status << "\n" << r.stderr_text;
    return r.stdout_text;
  }

  // Runs a command that must be a usage error; returns its stderr.
  std::string Usage(std::vector<std::string> args) {
    RunResult r = Ctl(args);
    EXPECT_TRUE(r.status.exited() && r.status.exit_code() == 2)
        << r.status << "\n" << r.stdout_text << r.stderr_text;
    return r.stderr_text;
  }

  Json Show(const std::string& file) {
    RunResult r = Ctl({"--json", "certs", "show", file});
    EXPECT_TRUE(r.status.success()) << r.stderr_text;
    return Json::parse(r.stdout_text, nullptr, /*allow_exceptions=*/false);
  }

  std::unique_ptr<TempDir> tmp_;
  std::string ca_;
};

TEST_F(CkptctlCertsTest, CreateCaWritesBothFilesAndRefusesToOverwrite) {
  std::string out = Ok({"certs", "create-ca", "--dir", ca_, "--days", "100"});
  EXPECT_THAT(out, HasSubstr(ca_ + "/ca.pem"));
  EXPECT_THAT(out, HasSubstr(ca_ + "/ca.key"));
  EXPECT_EQ(Mode(ca_), 0700u);
  EXPECT_EQ(Mode(ca_ + "/ca.pem"), 0644u);
  EXPECT_EQ(Mode(ca_ + "/ca.key"), 0600u);
  Json ca = Show(ca_ + "/ca.pem");
  EXPECT_EQ(ca["is_ca"], true);
  EXPECT_TRUE(ca["identity"].is_null());
  EXPECT_NEAR(ca["not_after_unix_s"].get<double>() - ca["not_before_unix_s"].get<double>(), 100.0 * 86400 + 3600, 2);

  const std::string pem = Slurp(ca_ + "/ca.pem"), key = Slurp(ca_ + "/ca.key");
  std::string err = Usage({"certs", "create-ca", "--dir", ca_});
  EXPECT_THAT(err, HasSubstr(ca_ + "/ca.pem"));
  EXPECT_THAT(err, HasSubstr("already exists; nothing was overwritten"));
  EXPECT_EQ(Slurp(ca_ + "/ca.pem"), pem);
  EXPECT_EQ(Slurp(ca_ + "/ca.key"), key);

  EXPECT_THAT(Usage({"certs", "create-ca", "--dir", P("x"), "--days", "0"}), HasSubstr("--days"));
  EXPECT_THAT(Usage({"certs", "create-ca"}), HasSubstr("--dir is required"));
  EXPECT_FALSE(Exists(P("x")));
}

TEST_F(CkptctlCertsTest, CreateMetaNodeAndClientsWithTheirIdentities) {
  Ok({"certs", "create-ca", "--dir", ca_});
  std::string out = Ok({"certs", "create-meta", "--ca-dir", ca_, "--host", "127.0.0.1", "--host", "::1,localhost",
                        "--host", "meta.example.com", "--out", P("certs/meta")});
  EXPECT_THAT(out, HasSubstr(P("certs/meta.pem")));
  EXPECT_THAT(out, HasSubstr(P("certs/meta.key")));
  EXPECT_THAT(out, HasSubstr("identity: meta"));
  out = Ok({"certs", "create-node", "--ca-dir", ca_, "--node-id", "gpu-07", "--host", "10.1.2.7", "--out",
            P("certs/gpu-07"), "--days", "30"});
  EXPECT_THAT(out, HasSubstr("identity: node gpu-07"));
  Ok({"certs", "create-client", "--ca-dir", ca_, "--role", "admin", "--name", "alice", "--out", P("certs/alice")});
  Ok({"certs", "create-client", "--ca-dir", ca_, "--role", "operator", "--name", "oncall", "--out",
      P("certs/oncall")});
  out = Ok({"certs", "create-client", "--ca-dir", ca_, "--role", "trainer", "--name", "team-a", "--jobs",
            "gpt-7b,team-a-*", "--out", P("certs/team-a")});
  EXPECT_THAT(out, HasSubstr("identity: trainer team-a (jobs gpt-7b, team-a-*)"));

  for (const char* name : {"meta", "gpu-07", "alice", "oncall", "team-a"}) {
    EXPECT_EQ(Mode(P(std::string("certs/") + name + ".pem")), 0644u) << name;
    EXPECT_EQ(Mode(P(std::string("certs/") + name + ".key")), 0600u) << name;
  }
  Json meta = Show(P("certs/meta.pem"));
  EXPECT_EQ(meta["identity"]["role"], "meta");
  EXPECT_THAT(meta["uris"].get<std::vector<std::string>>(), ElementsAre("ckpt://meta"));
  EXPECT_THAT(meta["ip"].get<std::vector<std::string>>(), UnorderedElementsAre("127.0.0.1", "::1"));
  EXPECT_THAT(meta["dns"].get<std::vector<std::string>>(), UnorderedElementsAre("localhost", "meta.example.com"));
  EXPECT_THAT(meta["extended_key_usage"].get<std::vector<std::string>>(), ElementsAre("serverAuth", "clientAuth"));
  EXPECT_EQ(meta["chain_length"], 2);
  EXPECT_EQ(meta["issuer"], "CN=ckpt cluster CA");
  EXPECT_EQ(meta["valid_now"], true);

  Json node = Show(P("certs/gpu-07.pem"));
  EXPECT_EQ(node["identity"]["role"], "node");
  EXPECT_EQ(node["identity"]["name"], "gpu-07");
  EXPECT_THAT(node["ip"].get<std::vector<std::string>>(), ElementsAre("10.1.2.7"));
  EXPECT_NEAR(node["not_after_unix_s"].get<double>() - node["not_before_unix_s"].get<double>(), 30.0 * 86400 + 3600, 2);

  Json alice = Show(P("certs/alice.pem"));
  EXPECT_EQ(alice["identity"]["role"], "admin");
  EXPECT_EQ(alice["identity"]["name"], "alice");
  EXPECT_THAT(alice["extended_key_usage"].get<std::vector<std::string>>(), ElementsAre("clientAuth"));
  EXPECT_EQ(Show(P("certs/oncall.pem"))["identity"]["role"], "operator");
  Json trainer = Show(P("certs/team-a.pem"));
  EXPECT_EQ(trainer["identity"]["role"], "trainer");
  EXPECT_THAT(trainer["identity"]["jobs"].get<std::vector<std::string>>(), ElementsAre("gpt-7b", "team-a-*"));

  // The human form says the same.
  out = Ok({"certs", "show", P("certs/team-a.pem")});
  EXPECT_THAT(out, HasSubstr("identity:  trainer team-a (jobs gpt-7b, team-a-*)"));
  EXPECT_THAT(out, HasSubstr("issuer:    CN=ckpt cluster CA"));
  EXPECT_THAT(out, HasSubstr("uri:       ckpt://trainer/team-a, ckpt://job/gpt-7b, ckpt://job/team-a-*"));
  EXPECT_THAT(out, HasSubstr("days left"));
  out = Ok({"certs", "show", ca_ + "/ca.pem"});
  EXPECT_THAT(out, HasSubstr("identity:  none (a CA certificate)"));

  // The library reads the same identity (what servers do with peer_uri).
  absl::StatusOr<pki::Identity> id = pki::IdentityOfCertificate(Slurp(P("certs/gpu-07.pem")));
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, (pki::Identity{pki::Role::kNode, "gpu-07", {}}));
}

TEST_F(CkptctlCertsTest, CreateNodeWithHostNodeMakesADpuCertificate) {
  Ok({"certs", "create-ca", "--dir", ca_});
  std::string out = Ok({"certs", "create-node", "--ca-dir", ca_, "--node-id", "dpu-07", "--host-node", "gpu-07",
                        "--host", "192.168.100.2", "--out", P("dpu-07")});
  EXPECT_THAT(out, HasSubstr("identity: node dpu-07 (a DPU serving host gpu-07)"));
  Json j = Show(P("dpu-07.pem"));
  EXPECT_EQ(j["identity"]["role"], "node");
  EXPECT_EQ(j["identity"]["name"], "dpu-07");
  EXPECT_EQ(j["identity"]["host_node"], "gpu-07");
  EXPECT_THAT(j["uris"].get<std::vector<std::string>>(), ElementsAre("ckpt://node/dpu-07", "ckpt://host/gpu-07"));
  absl::StatusOr<pki::Identity> id = pki::IdentityOfCertificate(Slurp(P("dpu-07.pem")));
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, (pki::Identity{pki::Role::kNode, "dpu-07", {}, "gpu-07"}));
}

TEST_F(CkptctlCertsTest, RefusalsAreUsageErrorsThatWriteNothing) {
  Ok({"certs", "create-ca", "--dir", ca_});
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"certs", "create-meta", "--ca-dir", ca_, "--out", P("o")}, "--host is required"},
      {{"certs", "create-meta", "--ca-dir", ca_, "--host", "bad_host", "--out", P("o")}, "neither an IP address"},
      {{"certs", "create-meta", "--ca-dir", ca_, "--host", "h", "--host", "h", "--out", P("o")}, "twice"},
      {{"certs", "create-node", "--ca-dir", ca_, "--node-id", "../x", "--host", "h", "--out", P("o")},
       "node id \"../x\" is invalid"},
      {{"certs", "create-node", "--ca-dir", ca_, "--host", "h", "--out", P("o")}, "--node-id is required"},
      {{"certs", "create-node", "--ca-dir", ca_, "--node-id", "d1", "--host-node", "d1", "--host", "h", "--out",
        P("o")},
       "not its host's"},
      {{"certs", "create-node", "--ca-dir", ca_, "--node-id", "d1", "--host-node", "a/b", "--host", "h", "--out",
        P("o")},
       "host node"},
      {{"certs", "create-client", "--ca-dir", ca_, "--role", "trainer", "--name", "t", "--out", P("o")},
       "needs --jobs"},
      {{"certs", "create-client", "--ca-dir", ca_, "--role", "admin", "--name", "a", "--jobs", "j", "--out", P("o")},
       "--jobs is for trainers only"},
      {{"certs", "create-client", "--ca-dir", ca_, "--role", "trainer", "--name", "t", "--jobs", "Bad", "--out",
        P("o")},
       "job pattern \"Bad\""},
      {{"certs", "create-client", "--ca-dir", ca_, "--role", "node", "--name", "n", "--out", P("o")}, "--role"},
      {{"certs", "create-client", "--ca-dir", ca_, "--role", "admin", "--name", "a b", "--out", P("o")},
       "admin name \"a b\" is invalid"},
      {{"certs", "create-client", "--ca-dir", P("nowhere"), "--role", "admin", "--name", "a", "--out", P("o")},
       P("nowhere") + "/ca.pem\" does not exist"},
      {{"certs", "create-client", "--ca-dir", ca_, "--role", "admin", "--name", "a", "--out", P("o"), "--days",
        "-1"},
       "--days"},
      {{"certs", "show", P("no-such.pem")}, "no-such.pem"},
      {{"certs", "show", ca_ + "/ca.key"}, "not a PEM certificate"},
      {{"certs"}, "subcommand"},
  };
  for (const auto& [args, want] : cases) {
    EXPECT_THAT(Usage(args), HasSubstr(want)) << args[1] << " " << want;
    EXPECT_FALSE(Exists(P("o.pem")));
    EXPECT_FALSE(Exists(P("o.key")));
  }
}

TEST_F(CkptctlCertsTest, ExistingOutputIsNamedAndLeftAlone) {
  Ok({"certs", "create-ca", "--dir", ca_});
  Ok({"certs", "create-client", "--ca-dir", ca_, "--role", "admin", "--name", "a", "--out", P("a")});
  const std::string pem = Slurp(P("a.pem")), key = Slurp(P("a.key"));
  std::string err =
      Usage({"certs", "create-client", "--ca-dir", ca_, "--role", "admin", "--name", "b", "--out", P("a")});
  EXPECT_THAT(err, HasSubstr(P("a.pem") + "\" already exists; nothing was overwritten"));
  EXPECT_EQ(Slurp(P("a.pem")), pem);
  EXPECT_EQ(Slurp(P("a.key")), key);
  // Only the key there: the certificate is not left behind either.
  { std::ofstream(P("n.key")) << "someone's key"; }
  err = Usage({"certs", "create-node", "--ca-dir", ca_, "--node-id", "n", "--host", "h", "--out", P("n")});
  EXPECT_THAT(err, HasSubstr(P("n.key") + "\" already exists"));
  EXPECT_FALSE(Exists(P("n.pem")));
  EXPECT_EQ(Slurp(P("n.key")), "someone's key");
}

TEST_F(CkptctlCertsTest, CaKeyReadableByOthersIsRefusedSayingWhatToDo) {
  Ok({"certs", "create-ca", "--dir", ca_});
  ASSERT_EQ(::chmod((ca_ + "/ca.key").c_str(), 0644), 0);
  std::string err =
      Usage({"certs", "create-client", "--ca-dir", ca_, "--role", "admin", "--name", "a", "--out", P("a")});
  EXPECT_THAT(err, HasSubstr("chmod 600 " + ca_ + "/ca.key"));
  EXPECT_FALSE(Exists(P("a.pem")));
}

// certs revoke: the CA's list in --crl-dir under its OpenSSL hash name,
// verified by `openssl crl` against the CA and read by `openssl verify
// -crl_check` as revoking exactly the certificates given; a second run keeps
// them and adds more; a certificate of another CA is refused and nothing is
// written.
TEST_F(CkptctlCertsTest, RevokeWritesTheCasListAndKeepsWhatItRevokedBefore) {
  Ok({"certs", "create-ca", "--dir", ca_});
  for (const char* n : {"n1", "n2", "n3"}) {
    Ok({"certs", "create-node", "--ca-dir", ca_, "--node-id", n, "--host", "127.0.0.1", "--out", P(n)});
  }
  RunResult r = Ctl({"--json", "certs", "revoke", "--ca-dir", ca_, "--crl-dir", P("crl"), "--days", "7", P("n1.pem")});
  ASSERT_TRUE(r.status.success()) << r.stderr_text;
  Json j = Json::parse(r.stdout_text, nullptr, false);
  const std::string crl = j["crl"];
  EXPECT_THAT(crl, ::testing::MatchesRegex(".*/crl/[0-9a-f]{8}\\.r0"));
  EXPECT_EQ(j["newly_revoked"], 1);
  EXPECT_EQ(j["revoked_serials"], Json::array({Show(P("n1.pem"))["serial"]}));
  EXPECT_EQ(Mode(crl), 0644u);
  // openssl's own view: signed by the CA, and n1 revoked, n2 not.
  auto openssl = [&](const std::string& args) {
    return std::system(("openssl " + args + " >/dev/null 2>&1").c_str());
  };
  EXPECT_EQ(openssl("crl -in " + crl + " -CAfile " + ca_ + "/ca.pem -noout"), 0);
  const std::string verify = "verify -crl_check -CAfile " + ca_ + "/ca.pem -CRLfile " + crl + " ";
  EXPECT_NE(openssl(verify + P("n1.pem")), 0) << "n1 is not revoked";
  EXPECT_EQ(openssl(verify + P("n2.pem")), 0) << "n2 is revoked";

  // Again with n2: n1 stays revoked.
  std::string out = Ok({"certs", "revoke", "--ca-dir", ca_, "--crl-dir", P("crl"), P("n2.pem"), P("n1.pem")});
  EXPECT_THAT(out, HasSubstr("1 certificate(s) newly revoked, 2 in all"));
  EXPECT_NE(openssl(verify + P("n1.pem")), 0);
  EXPECT_NE(openssl(verify + P("n2.pem")), 0);
  EXPECT_EQ(openssl(verify + P("n3.pem")), 0);

  // Another CA's certificate, a missing file, bad days: refused, the list unchanged.
  const std::string before = Slurp(crl);
  Ok({"certs", "create-ca", "--dir", P("other-ca")});
  Ok({"certs", "create-node", "--ca-dir", P("other-ca"), "--node-id", "x", "--host", "127.0.0.1", "--out", P("x")});
  EXPECT_THAT(Usage({"certs", "revoke", "--ca-dir", ca_, "--crl-dir", P("crl"), P("x.pem")}),
              HasSubstr("was not issued by the CA"));
  EXPECT_THAT(Usage({"certs", "revoke", "--ca-dir", ca_, "--crl-dir", P("crl"), P("nope.pem")}),
              HasSubstr("does not exist"));
  EXPECT_THAT(Usage({"certs", "revoke", "--ca-dir", ca_, "--crl-dir", P("crl"), "--days", "0"}), HasSubstr("--days"));
  EXPECT_EQ(Slurp(crl), before);
  // A list at that name that this CA did not sign (the other CA has the same
  // subject, so the same name) is not replaced.
  Json other = Json::parse(
      Ctl({"--json", "certs", "revoke", "--ca-dir", P("other-ca"), "--crl-dir", P("other-crl"), P("x.pem")}).stdout_text,
      nullptr, false);
  ASSERT_TRUE(other.contains("crl")) << other.dump();
  const std::string foreign = Slurp(other["crl"].get<std::string>());
  std::ofstream(crl, std::ios::trunc) << foreign;
  EXPECT_THAT(Usage({"certs", "revoke", "--ca-dir", ca_, "--crl-dir", P("crl")}),
              HasSubstr("is not a CRL this CA signed"));
  EXPECT_EQ(Slurp(crl), foreign);
}

}  // namespace
}  // namespace ckpt
