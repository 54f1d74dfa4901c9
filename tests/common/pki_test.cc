// The cluster's certificates (common/pki.h): files created exclusively with
// their modes, identities round-tripped through certificates for every role,
// bad names and URIs refused, the CA key's owner and mode checked, and the
// files working with gRPC's mutual TLS (a server reads the caller's identity
// from "peer_uri") and with `openssl verify`.
#include "common/pki.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "ckpt/v1/agent.grpc.pb.h"
#include "support/temp_dir.h"

namespace ckpt::pki {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;
using ckpt::testing::TempDir;

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

unsigned Mode(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return 0;
  return st.st_mode & 07777;
}

class PkiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TempDir> t = TempDir::Create();
    ASSERT_TRUE(t.ok()) << t.status();
    tmp_ = std::make_unique<TempDir>(*std::move(t));
    ca_ = tmp_->path() + "/ca";
    ASSERT_TRUE(CreateCa(ca_).ok());
  }

  std::string Path(const std::string& name) const { return tmp_->path() + "/" + name; }

  absl::Status Issue(const Identity& id, std::vector<std::string> hosts, const std::string& prefix) {
    CertOptions o;
    o.identity = id;
    o.hosts = std::move(hosts);
    return IssueCertificate(ca_, o, Path(prefix));
  }

  std::unique_ptr<TempDir> tmp_;
  std::string ca_;
};

TEST_F(PkiTest, CreateCaWritesCaCertificateAndKeyWithTheirModes) {
  EXPECT_EQ(Mode(ca_), 0700u);
  EXPECT_EQ(Mode(CaCertPath(ca_)), 0644u);
  EXPECT_EQ(Mode(CaKeyPath(ca_)), 0600u);
  absl::StatusOr<CertificateInfo> info = DescribeCertificate(Slurp(CaCertPath(ca_)));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->is_ca);
  EXPECT_EQ(info->subject, "CN=ckpt cluster CA");
  EXPECT_EQ(info->issuer, info->subject);
  EXPECT_EQ(info->chain_length, 1u);
  EXPECT_EQ(info->serial_hex.size(), 32u);  // 128 bits
  EXPECT_NEAR(static_cast<double>(info->not_after_unix_s - info->not_before_unix_s), 3650.0 * 86400 + 3600, 2);
  EXPECT_FALSE(info->identity.ok());  // a CA names nobody
  EXPECT_THAT(Slurp(CaKeyPath(ca_)), HasSubstr("-----BEGIN PRIVATE KEY-----"));
}

TEST_F(PkiTest, CreateCaModesDoNotDependOnTheUmask) {
  const mode_t old = ::umask(0077);
  const absl::Status s = CreateCa(Path("ca2"));
  ::umask(old);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Mode(CaCertPath(Path("ca2"))), 0644u);
  EXPECT_EQ(Mode(CaKeyPath(Path("ca2"))), 0600u);
}

TEST_F(PkiTest, CreateCaTwiceIsAlreadyExistsAndChangesNothing) {
  const std::string cert = Slurp(CaCertPath(ca_)), key = Slurp(CaKeyPath(ca_));
  absl::Status s = CreateCa(ca_);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_THAT(s.message(), HasSubstr(CaCertPath(ca_)));
  EXPECT_THAT(s.message(), HasSubstr("nothing was overwritten"));
  EXPECT_EQ(Slurp(CaCertPath(ca_)), cert);
  EXPECT_EQ(Slurp(CaKeyPath(ca_)), key);
}

TEST_F(PkiTest, CreateCaWithOnlyTheKeyPresentLeavesNoCertificateBehind) {
  const std::string dir = Path("half");
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  { std::ofstream(CaKeyPath(dir)) << "mine"; }
  absl::Status s = CreateCa(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_THAT(s.message(), HasSubstr(CaKeyPath(dir)));
  EXPECT_FALSE(Exists(CaCertPath(dir)));  // claimed first, removed again
  EXPECT_EQ(Slurp(CaKeyPath(dir)), "mine");
}

TEST_F(PkiTest, CreateCaNeverFollowsASymlink) {
  const std::string dir = Path("link");
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  const std::string target = Path("victim");
  { std::ofstream(target) << "victim"; }
  ASSERT_EQ(::symlink(target.c_str(), CaKeyPath(dir).c_str()), 0);
  absl::Status s = CreateCa(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_EQ(Slurp(target), "victim");
  EXPECT_FALSE(Exists(CaCertPath(dir)));
}

TEST_F(PkiTest, CreateCaRefusesBadOptions) {
  EXPECT_EQ(CreateCa(Path("a"), CaOptions{0, "x"}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateCa(Path("a"), CaOptions{10, ""}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateCa(Path("a"), CaOptions{10, std::string(65, 'x')}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(Exists(Path("a")));
}

struct RoleCase {
  Identity id;
  std::vector<std::string> hosts;
  bool server;
};

TEST_F(PkiTest, EveryRoleRoundTripsThroughItsCertificate) {
  const std::vector<RoleCase> cases = {
      {{Role::kMeta, "", {}}, {"127.0.0.1", "::1", "localhost", "meta.example.com"}, true},
      {{Role::kNode, "gpu-node-07.rack2", {}}, {"10.0.0.7"}, true},
      {{Role::kNode, "dpu-07", {}, "gpu-node-07"}, {"192.168.100.2"}, true},  // a DPU serving its host
      {{Role::kAdmin, "alice", {}}, {}, false},
      {{Role::kOperator, "oncall_2", {}}, {}, false},
      {{Role::kTrainer, "team-a", {"gpt-7b", "team-a-*"}}, {}, false},
      {{Role::kTrainer, "all", {"*"}}, {"trainer-host"}, false},
  };
  int n = 0;
  for (const RoleCase& c : cases) {
    const std::string prefix = absl::StrCat("out/cert", n++);
    ASSERT_TRUE(Issue(c.id, c.hosts, prefix).ok()) << RoleName(c.id.role);
    const std::string pem = Slurp(CertPath(Path(prefix)));
    EXPECT_EQ(Mode(CertPath(Path(prefix))), 0644u);
    EXPECT_EQ(Mode(KeyPath(Path(prefix))), 0600u);
    absl::StatusOr<Identity> got = IdentityOfCertificate(pem);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, c.id);
    absl::StatusOr<CertificateInfo> info = DescribeCertificate(pem);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_FALSE(info->is_ca);
    EXPECT_EQ(info->chain_length, 2u);  // the leaf, then the CA
    EXPECT_EQ(info->issuer, "CN=ckpt cluster CA");
    EXPECT_EQ(info->uris, IdentityUris(c.id));
    EXPECT_EQ(info->subject, "CN=" + IdentityUris(c.id).front());
    if (c.server) {
      EXPECT_THAT(info->extended_key_usages, ElementsAre("serverAuth", "clientAuth"));
    } else {
      EXPECT_THAT(info->extended_key_usages, ElementsAre("clientAuth"));
    }
    std::vector<std::string> hosts = info->dns_names;
    hosts.insert(hosts.end(), info->ip_addresses.begin(), info->ip_addresses.end());
    EXPECT_THAT(hosts, ::testing::UnorderedElementsAreArray(c.hosts));
    EXPECT_NEAR(static_cast<double>(info->not_after_unix_s - info->not_before_unix_s), 365.0 * 86400 + 3600, 2);
  }
  EXPECT_EQ(Mode(Path("out")), 0700u);  // made by IssueCertificate
}

TEST_F(PkiTest, LongNamesFitTheCommonNameLimit) {
  const Identity id{Role::kOperator, std::string(63, 'o'), {}};
  ASSERT_TRUE(Issue(id, {}, "long").ok());
  absl::StatusOr<Identity> got = IdentityOfCertificate(Slurp(CertPath(Path("long"))));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, id);
}

TEST_F(PkiTest, LeafNeverOutlivesItsCa) {
  ASSERT_TRUE(CreateCa(Path("short-ca"), CaOptions{10, "short"}).ok());
  CertOptions o;
  o.identity = {Role::kAdmin, "a", {}};
  o.days = 365;
  ASSERT_TRUE(IssueCertificate(Path("short-ca"), o, Path("a")).ok());
  absl::StatusOr<CertificateInfo> ca = DescribeCertificate(Slurp(CaCertPath(Path("short-ca"))));
  absl::StatusOr<CertificateInfo> leaf = DescribeCertificate(Slurp(CertPath(Path("a"))));
  ASSERT_TRUE(ca.ok() && leaf.ok());
  EXPECT_EQ(leaf->not_after_unix_s, ca->not_after_unix_s);
}

TEST_F(PkiTest, IssueTwiceIsAlreadyExistsAndChangesNothing) {
  const Identity id{Role::kAdmin, "alice", {}};
  ASSERT_TRUE(Issue(id, {}, "alice").ok());
  const std::string cert = Slurp(CertPath(Path("alice"))), key = Slurp(KeyPath(Path("alice")));
  absl::Status s = Issue(id, {}, "alice");
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_THAT(s.message(), HasSubstr(CertPath(Path("alice"))));
  EXPECT_EQ(Slurp(CertPath(Path("alice"))), cert);
  EXPECT_EQ(Slurp(KeyPath(Path("alice"))), key);

  // Only the key there: refused too, and no certificate left behind.
  { std::ofstream(KeyPath(Path("bob"))) << "keep"; }
  s = Issue({Role::kAdmin, "bob", {}}, {}, "bob");
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_THAT(s.message(), HasSubstr(KeyPath(Path("bob"))));
  EXPECT_FALSE(Exists(CertPath(Path("bob"))));
  EXPECT_EQ(Slurp(KeyPath(Path("bob"))), "keep");
}

TEST_F(PkiTest, IssueRefusesBadIdentitiesAndHostsWritingNothing) {
  const std::vector<std::pair<RoleCase, std::string>> cases = {
      {{{Role::kMeta, "", {}}, {}, true}, "needs at least one host"},
      {{{Role::kNode, "n1", {}}, {}, true}, "needs at least one host"},
      {{{Role::kMeta, "m", {}}, {"h"}, true}, "has no name"},
      {{{Role::kNode, "../x", {}}, {"h"}, true}, "node id"},
      {{{Role::kNode, "", {}}, {"h"}, true}, "node id"},
      {{{Role::kAdmin, "a b", {}}, {}, false}, "[A-Za-z0-9._-]{1,63}"},
      {{{Role::kAdmin, "", {}}, {}, false}, "empty"},
      {{{Role::kAdmin, "..", {}}, {}, false}, "dot segment"},
      {{{Role::kAdmin, "a/b", {}}, {}, false}, "outside that set"},
      {{{Role::kOperator, std::string(64, 'o'), {}}, {}, false}, "64 bytes"},
      {{{Role::kOperator, "op", {"job-a"}}, {}, false}, "trainers only"},
      {{{Role::kTrainer, "t", {}}, {}, false}, "no job pattern"},
      {{{Role::kTrainer, "t", {"Job-A"}}, {}, false}, "job pattern \"Job-A\""},
      {{{Role::kTrainer, "t", {"a*b"}}, {}, false}, "job pattern"},
      {{{Role::kTrainer, "t", {"**"}}, {}, false}, "job pattern"},
      {{{Role::kTrainer, "t", {"a", "a"}}, {}, false}, "twice"},
      {{{Role::kNode, "d1", {}, "d1"}, {"h"}, true}, "not its host's"},
      {{{Role::kTrainer, "t", {"a"}, "h1"}, {}, false}, "DPU's node certificate only"},
      {{{Role::kMeta, "", {}}, {"bad host"}, true}, "neither an IP address nor a DNS name"},
      {{{Role::kMeta, "", {}}, {"-x.example"}, true}, "neither"},
      {{{Role::kMeta, "", {}}, {"1.2.3.400"}, true}, "neither"},
      {{{Role::kMeta, "", {}}, {"h", "h"}, true}, "twice"},
      {{{Role::kMeta, "", {}}, {"::1", "0:0::1"}, true}, "twice"},
  };
  for (const auto& [c, want] : cases) {
    absl::Status s = Issue(c.id, c.hosts, "bad");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << want << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(want));
    EXPECT_FALSE(Exists(CertPath(Path("bad"))));
    EXPECT_FALSE(Exists(KeyPath(Path("bad"))));
  }
  CertOptions o;
  o.identity = {Role::kAdmin, "a", {}};
  o.days = 0;
  EXPECT_EQ(IssueCertificate(ca_, o, Path("bad")).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(PkiTest, IssueWithoutCaIsNotFoundNamingTheFile) {
  absl::Status s = IssueCertificate(Path("nowhere"), CertOptions{{Role::kAdmin, "a", {}}, {}, 1}, Path("a"));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr(Path("nowhere") + "/ca.pem"));
  EXPECT_THAT(s.message(), HasSubstr("ckptctl certs create-ca"));
  EXPECT_FALSE(Exists(CertPath(Path("a"))));
}

TEST_F(PkiTest, IssueRefusesACaKeyReadableByOthers) {
  ASSERT_EQ(::chmod(CaKeyPath(ca_).c_str(), 0640), 0);
  absl::Status s = Issue({Role::kAdmin, "a", {}}, {}, "a");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("mode 0640"));
  EXPECT_THAT(s.message(), HasSubstr("chmod 600 " + CaKeyPath(ca_)));
  EXPECT_FALSE(Exists(CertPath(Path("a"))));
  ASSERT_EQ(::chmod(CaKeyPath(ca_).c_str(), 0400), 0);  // narrower is fine
  EXPECT_TRUE(Issue({Role::kAdmin, "a", {}}, {}, "a").ok());
}

TEST_F(PkiTest, IssueRefusesACaKeyThatIsASymlink) {
  const std::string real = Path("real.key");
  std::filesystem::rename(CaKeyPath(ca_), real);
  ASSERT_EQ(::symlink(real.c_str(), CaKeyPath(ca_).c_str()), 0);
  absl::Status s = Issue({Role::kAdmin, "a", {}}, {}, "a");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("symbolic link"));
}

TEST_F(PkiTest, IssueRefusesACaKeyOwnedBySomeoneElse) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give the key away";
  ASSERT_EQ(::chown(CaKeyPath(ca_).c_str(), 65534, 65534), 0);
  absl::Status s = Issue({Role::kAdmin, "a", {}}, {}, "a");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("owned by uid 65534"));
  EXPECT_FALSE(Exists(CertPath(Path("a"))));
}

TEST_F(PkiTest, IssueRefusesAKeyOfAnotherCa) {
  ASSERT_TRUE(CreateCa(Path("other")).ok());
  std::filesystem::copy_file(CaKeyPath(Path("other")), CaKeyPath(ca_),
                             std::filesystem::copy_options::overwrite_existing);
  absl::Status s = Issue({Role::kAdmin, "a", {}}, {}, "a");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("does not belong"));
}

TEST(IdentityUris, FormsForEveryRole) {
  EXPECT_THAT(IdentityUris({Role::kMeta, "", {}}), ElementsAre("ckpt://meta"));
  EXPECT_THAT(IdentityUris({Role::kNode, "n1", {}}), ElementsAre("ckpt://node/n1"));
  EXPECT_THAT(IdentityUris({Role::kAdmin, "a", {}}), ElementsAre("ckpt://admin/a"));
  EXPECT_THAT(IdentityUris({Role::kOperator, "o", {}}), ElementsAre("ckpt://operator/o"));
  EXPECT_THAT(IdentityUris({Role::kTrainer, "t", {"j", "k-*"}}),
              ElementsAre("ckpt://trainer/t", "ckpt://job/j", "ckpt://job/k-*"));
  for (Role r : {Role::kMeta, Role::kNode, Role::kAdmin, Role::kOperator, Role::kTrainer}) {
    absl::StatusOr<Role> back = ParseRole(RoleName(r));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, r);
  }
  EXPECT_EQ(ParseRole("agent").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(IdentityFromUris, AnyOrderOtherSchemesIgnored) {
  absl::StatusOr<Identity> id =
      IdentityFromUris({"spiffe://example.org/x", "ckpt://job/b-*", "ckpt://trainer/t", "ckpt://job/a"});
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->role, Role::kTrainer);
  EXPECT_EQ(id->name, "t");
  EXPECT_THAT(id->jobs, ElementsAre("b-*", "a"));
  id = IdentityFromUris({"https://x", "ckpt://meta"});
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, (Identity{Role::kMeta, "", {}}));
}

TEST(IdentityFromUris, ADpuNodeNamesTheHostItServes) {
  EXPECT_THAT(IdentityUris({Role::kNode, "dpu-7", {}, "node-7"}),
              ElementsAre("ckpt://node/dpu-7", "ckpt://host/node-7"));
  absl::StatusOr<Identity> id = IdentityFromUris({"ckpt://host/node-7", "ckpt://node/dpu-7"});
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, (Identity{Role::kNode, "dpu-7", {}, "node-7"}));
  EXPECT_NE(*id, (Identity{Role::kNode, "dpu-7", {}}));
  EXPECT_TRUE(ValidateIdentity({Role::kNode, "dpu-7", {}, "node-7"}).ok());
  EXPECT_THAT(ValidateIdentity({Role::kAdmin, "a", {}, "node-7"}).message(), HasSubstr("DPU's node certificate only"));
  EXPECT_THAT(ValidateIdentity({Role::kNode, "n1", {}, "n1"}).message(), HasSubstr("not its host's"));
  EXPECT_THAT(ValidateIdentity({Role::kNode, "n1", {}, "../x"}).message(), HasSubstr("node id"));
}

TEST(IdentityFromUris, Refusals) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{}, "no ckpt identity"},
      {{"spiffe://x/y"}, "no ckpt identity"},
      {{"ckpt://job/a"}, "no ckpt identity"},
      {{"ckpt://admin/a", "ckpt://node/n1"}, "two identities"},
      {{"ckpt://admin/a", "ckpt://admin/a"}, "two identities"},
      {{"ckpt://agent/n1"}, "not a ckpt identity"},
      {{"ckpt://meta/x"}, "nothing after it"},
      {{"ckpt://admin"}, "names its holder"},
      {{"ckpt://admin/"}, "empty"},
      {{"ckpt://admin/a/b"}, "outside that set"},
      {{"ckpt://node/../etc"}, "node id"},
      {{"ckpt://admin/a", "ckpt://job/x"}, "trainers only"},
      {{"ckpt://trainer/t"}, "no job pattern"},
      {{"ckpt://trainer/t", "ckpt://job"}, "names a pattern"},
      {{"ckpt://trainer/t", "ckpt://job/X"}, "job pattern"},
      {{"ckpt://trainer/t", "ckpt://job/a", "ckpt://job/a"}, "twice"},
      {{"CKPT://admin/a"}, "write the scheme as ckpt://"},
      {{"ckpt://host/h1"}, "no ckpt identity"},
      {{"ckpt://trainer/t", "ckpt://job/a", "ckpt://host/h1"}, "DPU's node certificate only"},
      {{"ckpt://admin/a", "ckpt://host/h1"}, "DPU's node certificate only"},
      {{"ckpt://node/d1", "ckpt://host/h1", "ckpt://host/h2"}, "two hosts"},
      {{"ckpt://node/d1", "ckpt://host"}, "names the host node"},
      {{"ckpt://node/d1", "ckpt://host/"}, "empty"},
      {{"ckpt://node/d1", "ckpt://host/d1"}, "not its host's"},
      {{"ckpt://node/d1", "ckpt://host/a/b"}, "node id"},
  };
  for (const auto& [uris, want] : cases) {
    absl::StatusOr<Identity> id = IdentityFromUris(uris);
    ASSERT_FALSE(id.ok()) << want;
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(id.status().message(), HasSubstr(want));
  }
}

TEST(IdentityOfCertificate, NotACertificateIsInvalidArgument) {
  EXPECT_EQ(IdentityOfCertificate("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(IdentityOfCertificate("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DescribeCertificate("hello").status().code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------
// With OpenSSL's command and with gRPC.

int RunCommand(const std::string& cmd) {
  const int rc = std::system((cmd + " >/dev/null 2>&1").c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

TEST_F(PkiTest, OpensslVerifiesTheChainAndThePurposes) {
  if (RunCommand("command -v openssl") != 0) GTEST_SKIP() << "no openssl command";
  ASSERT_TRUE(Issue({Role::kMeta, "", {}}, {"127.0.0.1"}, "meta").ok());
  ASSERT_TRUE(Issue({Role::kAdmin, "alice", {}}, {}, "alice").ok());
  const std::string ca = CaCertPath(ca_);
  EXPECT_EQ(RunCommand("openssl verify -CAfile " + ca + " -purpose sslserver " + CertPath(Path("meta"))), 0);
  EXPECT_EQ(RunCommand("openssl verify -CAfile " + ca + " -purpose sslclient " + CertPath(Path("meta"))), 0);
  EXPECT_EQ(RunCommand("openssl verify -CAfile " + ca + " -purpose sslclient " + CertPath(Path("alice"))), 0);
  // A client certificate is no server certificate.
  EXPECT_NE(RunCommand("openssl verify -CAfile " + ca + " -purpose sslserver " + CertPath(Path("alice"))), 0);
  // Nor does another CA vouch for it.
  ASSERT_TRUE(CreateCa(Path("other")).ok());
  EXPECT_NE(RunCommand("openssl verify -CAfile " + CaCertPath(Path("other")) + " " + CertPath(Path("alice"))), 0);
  // The key matches the certificate.
  EXPECT_EQ(RunCommand("test \"$(openssl x509 -in " + CertPath(Path("alice")) +
                       " -noout -pubkey)\" = \"$(openssl pkey -in " + KeyPath(Path("alice")) + " -pubout)\""),
            0);
}

// Answers AgentStatus with the caller's identity (from its certificate) as
// the node id, or the reason there is none.
class WhoAmI final : public v1::AgentService::Service {
 public:
  grpc::Status AgentStatus(grpc::ServerContext* ctx, const v1::AgentStatusRequest*,
                           v1::AgentStatusResponse* response) override {
    std::vector<std::string> uris;
    for (const grpc::string_ref& v : ctx->auth_context()->FindPropertyValues("peer_uri")) {
      uris.emplace_back(v.data(), v.size());
    }
    absl::StatusOr<Identity> id = IdentityFromUris(uris);
    if (!id.ok()) return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, std::string(id.status().message()));
    std::string who = absl::StrCat(std::string(RoleName(id->role)), ":", id->name);
    for (const std::string& j : id->jobs) absl::StrAppend(&who, ":", j);
    response->set_node_id(who);
    return grpc::Status::OK;
  }
};

class PkiGrpcTest : public PkiTest {
 protected:
  // A server on 127.0.0.1 with `prefix`'s certificate, requiring and
  // verifying client certificates against the CA in `ca_dir`.
  void StartServer(const std::string& prefix) {
    grpc::SslServerCredentialsOptions o(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    o.pem_root_certs = Slurp(CaCertPath(ca_));
    o.pem_key_cert_pairs.push_back({Slurp(KeyPath(Path(prefix))), Slurp(CertPath(Path(prefix)))});
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::SslServerCredentials(o), &port_);
    b.RegisterService(&service_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }

  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  // Calls AgentStatus with `prefix`'s certificate, trusting `ca_dir`'s CA.
  grpc::Status Call(const std::string& ca_dir, const std::string& prefix, std::string* who) {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = Slurp(CaCertPath(ca_dir));
    o.pem_private_key = Slurp(KeyPath(Path(prefix)));
    o.pem_cert_chain = Slurp(CertPath(Path(prefix)));
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_), grpc::SslCredentials(o));
    auto stub = v1::AgentService::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::AgentStatusResponse r;
    grpc::Status s = stub->AgentStatus(&ctx, v1::AgentStatusRequest(), &r);
    *who = r.node_id();
    return s;
  }

  WhoAmI service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(PkiGrpcTest, MutualTlsServerSeesTheCallersIdentity) {
  ASSERT_TRUE(Issue({Role::kMeta, "", {}}, {"127.0.0.1", "::1", "localhost"}, "meta").ok());
  ASSERT_TRUE(Issue({Role::kAdmin, "alice", {}}, {}, "alice").ok());
  ASSERT_TRUE(Issue({Role::kNode, "n1", {}}, {"127.0.0.1"}, "n1").ok());
  ASSERT_TRUE(Issue({Role::kTrainer, "t", {"job-a", "exp-*"}}, {}, "t").ok());
  StartServer("meta");
  std::string who;
  grpc::Status s = Call(ca_, "alice", &who);
  ASSERT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
  EXPECT_EQ(who, "admin:alice");
  // A node's certificate serves as a client certificate too (agents call meta).
  s = Call(ca_, "n1", &who);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(who, "node:n1");
  s = Call(ca_, "t", &who);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(who, "trainer:t:job-a:exp-*");
}

TEST_F(PkiGrpcTest, NodeCertificateServesAndCallsOnAgentsPort) {
  ASSERT_TRUE(Issue({Role::kNode, "n1", {}}, {"127.0.0.1"}, "n1").ok());
  ASSERT_TRUE(Issue({Role::kNode, "n2", {}}, {"127.0.0.1"}, "n2").ok());
  StartServer("n1");
  std::string who;
  grpc::Status s = Call(ca_, "n2", &who);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(who, "node:n2");
}

TEST_F(PkiGrpcTest, CallerFromAnotherCaOrWithAServerNamedElsewhereIsRefused) {
  ASSERT_TRUE(Issue({Role::kMeta, "", {}}, {"127.0.0.1"}, "meta").ok());
  ASSERT_TRUE(CreateCa(Path("rogue-ca")).ok());
  CertOptions o;
  o.identity = {Role::kAdmin, "mallory", {}};
  ASSERT_TRUE(IssueCertificate(Path("rogue-ca"), o, Path("mallory")).ok());
  StartServer("meta");
  std::string who;
  // The rogue client trusts our CA (to reach the server) but its own
  // certificate is from another: the handshake fails.
  {
    grpc::SslCredentialsOptions c;
    c.pem_root_certs = Slurp(CaCertPath(ca_));
    c.pem_private_key = Slurp(KeyPath(Path("mallory")));
    c.pem_cert_chain = Slurp(CertPath(Path("mallory")));
    auto stub = v1::AgentService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_), grpc::SslCredentials(c)));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::AgentStatusResponse r;
    grpc::Status s = stub->AgentStatus(&ctx, v1::AgentStatusRequest(), &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
  // A server certificate for other hosts only: the caller refuses it.
  server_->Shutdown();
  server_.reset();
  ASSERT_TRUE(Issue({Role::kMeta, "", {}}, {"elsewhere.invalid"}, "meta-elsewhere").ok());
  ASSERT_TRUE(Issue({Role::kAdmin, "alice", {}}, {}, "alice").ok());
  StartServer("meta-elsewhere");
  grpc::Status s = Call(ca_, "alice", &who);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
}

}  // namespace
}  // namespace ckpt::pki
