// Node identities on the data plane (transport/ucx/node_identity.h): the
// exchange between two nodes of the test CA, and everything it must refuse.
#include "transport/ucx/node_identity.h"

#include <openssl/bio.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "common/pki.h"
#include "support/pki.h"
#include "support/temp_dir.h"

namespace ckpt::transport {
namespace {

using ckpt::testing::TestPki;
using ckpt::testing::TlsFilePaths;

std::string ReadTestFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::shared_ptr<const NodeCredentials> Creds(const TlsFilePaths& f) {
  absl::StatusOr<std::shared_ptr<const NodeCredentials>> c =
      NodeCredentials::FromPem(ReadTestFile(f.ca), ReadTestFile(f.cert), ReadTestFile(f.key));
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : nullptr;
}

std::string DerOf(const std::string& pem_path) {
  const std::string pem = ReadTestFile(pem_path);
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  X509* cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);
  BIO_free(bio);
  unsigned char* der = nullptr;
  const int n = i2d_X509(cert, &der);
  std::string out(reinterpret_cast<const char*>(der), static_cast<size_t>(n));
  OPENSSL_free(der);
  X509_free(cert);
  return out;
}

constexpr uint64_t kAId = 11, kANonce = 12, kCId = 21, kCNonce = 22;

// The whole exchange; returns the two sides' secrets.
struct Exchanged {
  std::unique_ptr<IdentityExchange> connector, acceptor;
  std::string connector_secret, acceptor_secret;
};

Exchanged RunExchange(std::shared_ptr<const NodeCredentials> c, std::shared_ptr<const NodeCredentials> a) {
  Exchanged x;
  x.connector = *IdentityExchange::Start(c, /*acceptor=*/false);
  x.acceptor = *IdentityExchange::Start(a, /*acceptor=*/true);
  // Record 1: the connector's offer.
  absl::StatusOr<IdentityBlock> r1 = DecodeIdentityBlock(EncodeIdentityBlock(x.connector->Offer()));
  EXPECT_TRUE(r1.ok()) << r1.status();
  EXPECT_TRUE(x.acceptor->TakeOffer(*r1).ok());
  // Record 2: the acceptor's offer and signature.
  IdentityBlock r2 = x.acceptor->Offer();
  r2.signature = *x.acceptor->Sign('a', kAId, kANonce, kCId, kCNonce);
  EXPECT_TRUE(x.connector->TakeOffer(r2).ok());
  absl::Status s = x.connector->CheckSignature('a', kAId, kANonce, kCId, kCNonce, r2.signature);
  EXPECT_TRUE(s.ok()) << s;
  // Record 3: the connector's signature.
  const std::string r3 = *x.connector->Sign('c', kAId, kANonce, kCId, kCNonce);
  s = x.acceptor->CheckSignature('c', kAId, kANonce, kCId, kCNonce, r3);
  EXPECT_TRUE(s.ok()) << s;
  x.connector_secret = *x.connector->SharedSecret();
  x.acceptor_secret = *x.acceptor->SharedSecret();
  return x;
}

TEST(NodeIdentity, TwoNodesProveWhoTheyAreAndAgreeOnAFreshSecret) {
  auto n1 = Creds(TestPki::Shared().Node("n1"));
  auto n2 = Creds(TestPki::Shared().Node("n2"));
  ASSERT_NE(n1, nullptr);
  ASSERT_NE(n2, nullptr);
  EXPECT_EQ(n1->identity(), "ckpt://node/n1");
  Exchanged x = RunExchange(n1, n2);
  EXPECT_EQ(x.acceptor->peer_identity(), "ckpt://node/n1");
  EXPECT_EQ(x.connector->peer_identity(), "ckpt://node/n2");
  EXPECT_EQ(x.connector_secret.size(), kX25519Bytes);
  EXPECT_EQ(x.connector_secret, x.acceptor_secret);
  // Every connection has a secret of its own.
  Exchanged y = RunExchange(n1, n2);
  EXPECT_NE(x.connector_secret, y.connector_secret);
}

TEST(NodeIdentity, ASignatureIsWorthNothingOnAnotherConnectionOrInAnotherRole) {
  auto n1 = Creds(TestPki::Shared().Node("n1"));
  auto n2 = Creds(TestPki::Shared().Node("n2"));
  Exchanged x = RunExchange(n1, n2);
  const std::string sig_c = *x.connector->Sign('c', kAId, kANonce, kCId, kCNonce);
  // Another nonce: another connection.
  EXPECT_EQ(x.acceptor->CheckSignature('c', kAId, kANonce + 1, kCId, kCNonce, sig_c).code(),
            absl::StatusCode::kPermissionDenied);
  // Reflected: the connector's signature offered as the acceptor's.
  EXPECT_EQ(x.connector->CheckSignature('a', kAId, kANonce, kCId, kCNonce, sig_c).code(),
            absl::StatusCode::kPermissionDenied);
  // Garbage and nothing.
  EXPECT_FALSE(x.acceptor->CheckSignature('c', kAId, kANonce, kCId, kCNonce, "junk").ok());
  EXPECT_FALSE(x.acceptor->CheckSignature('c', kAId, kANonce, kCId, kCNonce, "").ok());
}

// n3 (a member) relays n1's signature, made for a connection between n1 and
// n3, into its connection with n2, claiming to be n1 with n1's certificate:
// the signature covers n3's certificate and key, not n2's, so n2 refuses.
TEST(NodeIdentity, ARelayedSignatureIsRefused) {
  auto n1 = Creds(TestPki::Shared().Node("n1"));
  auto n2 = Creds(TestPki::Shared().Node("n2"));
  auto n3 = Creds(TestPki::Shared().Node("n3"));
  // n1 connects to n3 (honestly).
  auto n1_side = *IdentityExchange::Start(n1, false);
  auto n3_side = *IdentityExchange::Start(n3, true);
  ASSERT_TRUE(n3_side->TakeOffer(n1_side->Offer()).ok());
  IdentityBlock from_n3 = n3_side->Offer();
  ASSERT_TRUE(n1_side->TakeOffer(from_n3).ok());
  const std::string n1_sig = *n1_side->Sign('c', kAId, kANonce, kCId, kCNonce);
  // n3 plays n1 towards n2 with n1's offer and the same ids and nonces.
  auto n2_side = *IdentityExchange::Start(n2, true);
  ASSERT_TRUE(n2_side->TakeOffer(n1_side->Offer()).ok());
  EXPECT_EQ(n2_side->peer_identity(), "ckpt://node/n1");
  absl::Status s = n2_side->CheckSignature('c', kAId, kANonce, kCId, kCNonce, n1_sig);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
}

TEST(NodeIdentity, CertificatesOfAnotherCaOrOfAnotherRoleAreRefused) {
  auto n1 = Creds(TestPki::Shared().Node("n1"));
  // Another CA's node certificate.
  absl::StatusOr<ckpt::testing::TempDir> made = ckpt::testing::TempDir::Create();
  ASSERT_TRUE(made.ok()) << made.status();
  const ckpt::testing::TempDir& dir = *made;
  ASSERT_TRUE(pki::CreateCa(dir.path() + "/ca").ok());
  pki::CertOptions o;
  o.identity = pki::Identity(pki::Role::kNode, "n2");
  o.hosts = {"127.0.0.1"};
  ASSERT_TRUE(pki::IssueCertificate(dir.path() + "/ca", o, dir.path() + "/n2").ok());
  absl::StatusOr<std::string> other = n1->CheckPeerCertificate(DerOf(dir.path() + "/n2.pem"));
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(other.status().message(), "not one this cluster's CA issued")) << other.status();
  // The rogue's own credentials load (its CA is its own) but n1 refuses its offer.
  absl::StatusOr<std::shared_ptr<const NodeCredentials>> rogue = NodeCredentials::FromPem(
      ReadTestFile(dir.path() + "/ca/ca.pem"), ReadTestFile(dir.path() + "/n2.pem"),
      ReadTestFile(dir.path() + "/n2.key"));
  ASSERT_TRUE(rogue.ok()) << rogue.status();
  auto x = *IdentityExchange::Start(n1, true);
  auto r = *IdentityExchange::Start(*rogue, false);
  EXPECT_EQ(x->TakeOffer(r->Offer()).code(), absl::StatusCode::kPermissionDenied);

  // An admin's certificate of the right CA: not a node.
  const TlsFilePaths admin = TestPki::Shared().Client(pki::Role::kAdmin, "ops");
  absl::StatusOr<std::string> not_node = n1->CheckPeerCertificate(DerOf(admin.cert));
  ASSERT_FALSE(not_node.ok());
  EXPECT_EQ(not_node.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(not_node.status().message(), "ckpt://admin/ops")) << not_node.status();
  // Nor may a node prove itself with one.
  absl::StatusOr<std::shared_ptr<const NodeCredentials>> as_admin = NodeCredentials::FromPem(
      ReadTestFile(admin.ca), ReadTestFile(admin.cert), ReadTestFile(admin.key));
  EXPECT_EQ(as_admin.status().code(), absl::StatusCode::kInvalidArgument);
  // Not a certificate at all.
  EXPECT_EQ(n1->CheckPeerCertificate("\x30\x03junk").status().code(), absl::StatusCode::kPermissionDenied);
}

// --tls-crl-dir: a node whose certificate the CA revoked is refused on the
// data plane; the CA's other nodes are not.
TEST(NodeIdentity, ARevokedCertificateIsRefused) {
  const TlsFilePaths n1 = TestPki::Shared().Node("n1");
  const TlsFilePaths n2 = TestPki::Shared().Node("n2");
  const TlsFilePaths n3 = TestPki::Shared().Node("n3");
  absl::StatusOr<ckpt::testing::TempDir> dir = ckpt::testing::TempDir::Create();
  ASSERT_TRUE(dir.ok()) << dir.status();
  // The list as `ckptctl certs revoke` writes it, and a file that is no list.
  absl::StatusOr<pki::CrlInfo> crl = pki::RevokeCertificates(TestPki::Shared().ca_dir(), {n2.cert}, dir->path());
  ASSERT_TRUE(crl.ok()) << crl.status();
  EXPECT_EQ(crl->newly_revoked, 1u);
  std::ofstream(dir->path() + "/README") << "not a CRL";
  absl::StatusOr<std::shared_ptr<NodeCredentialsFiles>> f =
      NodeCredentialsFiles::Open({n1.ca, n1.cert, n1.key, dir->path(), 0});
  ASSERT_TRUE(f.ok()) << f.status();
  std::shared_ptr<const NodeCredentials> c = (*f)->Current();
  absl::StatusOr<std::string> got = c->CheckPeerCertificate(DerOf(n2.cert));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(got.status().message(), "revoked")) << got.status();
  got = c->CheckPeerCertificate(DerOf(n3.cert));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "ckpt://node/n3");
  // Without the CRL the same certificate is accepted (it is otherwise valid).
  EXPECT_TRUE(Creds(n1)->CheckPeerCertificate(DerOf(n2.cert)).ok());
}

TEST(NodeIdentity, BadCredentialFilesAreClearErrors) {
  const TlsFilePaths n1 = TestPki::Shared().Node("n1");
  const TlsFilePaths n2 = TestPki::Shared().Node("n2");
  // n1's certificate with n2's key.
  absl::StatusOr<std::shared_ptr<const NodeCredentials>> c =
      NodeCredentials::FromPem(ReadTestFile(n1.ca), ReadTestFile(n1.cert), ReadTestFile(n2.key));
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(absl::StrContains(c.status().message(), "does not match")) << c.status();
  c = NodeCredentials::FromPem("", ReadTestFile(n1.cert), ReadTestFile(n1.key));
  EXPECT_TRUE(absl::StrContains(c.status().message(), "CA bundle")) << c.status();
  c = NodeCredentials::FromPem(ReadTestFile(n1.ca), "nothing", ReadTestFile(n1.key));
  EXPECT_TRUE(absl::StrContains(c.status().message(), "no PEM certificate")) << c.status();
  c = NodeCredentials::FromPem(ReadTestFile(n1.ca), ReadTestFile(n1.cert), "nothing");
  EXPECT_TRUE(absl::StrContains(c.status().message(), "no PEM private key")) << c.status();
  absl::StatusOr<std::shared_ptr<NodeCredentialsFiles>> f =
      NodeCredentialsFiles::Open({n1.ca, n1.cert, "/nonexistent/key.pem", "", 0});
  ASSERT_FALSE(f.ok());
  EXPECT_TRUE(absl::StrContains(f.status().message(), "/nonexistent/key.pem")) << f.status();
  f = NodeCredentialsFiles::Open({n1.ca, n1.cert, n1.key, "", 0});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->Current()->identity(), "ckpt://node/n1");
}

// Copies `from` to `to` with `mode` (the test PKI's files are shared).
void CopyFile(const std::string& from, const std::string& to, mode_t mode) {
  std::ofstream(to, std::ios::binary | std::ios::trunc) << ReadTestFile(from);
  ASSERT_EQ(::chmod(to.c_str(), mode), 0) << to;
}

TEST(NodeIdentity, AKeyFileOthersMayReadIsRefused) {
  const TlsFilePaths n1 = TestPki::Shared().Node("n1");
  absl::StatusOr<ckpt::testing::TempDir> dir = ckpt::testing::TempDir::Create();
  ASSERT_TRUE(dir.ok()) << dir.status();
  const std::string key = dir->path() + "/node.key";
  CopyFile(n1.key, key, 0644);
  absl::StatusOr<std::shared_ptr<NodeCredentialsFiles>> f = NodeCredentialsFiles::Open({n1.ca, n1.cert, key, "", 0});
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(f.status().message(), "readable by every user")) << f.status();
  EXPECT_TRUE(absl::StrContains(f.status().message(), "chmod 0600 " + key)) << f.status();
  // Through a link (as a Kubernetes Secret volume mounts it), the file it
  // names is what is checked.
  const std::string link = dir->path() + "/tls.key";
  ASSERT_EQ(::symlink(key.c_str(), link.c_str()), 0);
  f = NodeCredentialsFiles::Open({n1.ca, n1.cert, link, "", 0});
  ASSERT_FALSE(f.ok());
  EXPECT_TRUE(absl::StrContains(f.status().message(), "readable by every user")) << f.status();
  ASSERT_EQ(::chmod(key.c_str(), 0600), 0);
  f = NodeCredentialsFiles::Open({n1.ca, n1.cert, link, "", 0});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->Current()->identity(), "ckpt://node/n1");
  // Owned by another user (not root): refused even at 0600.
  if (::geteuid() == 0) {
    ASSERT_EQ(::chown(key.c_str(), 65534, 65534), 0);
    f = NodeCredentialsFiles::Open({n1.ca, n1.cert, key, "", 0});
    ASSERT_FALSE(f.ok());
    EXPECT_TRUE(absl::StrContains(f.status().message(), "owned by uid 65534")) << f.status();
  }
}

TEST(NodeIdentity, ARefreshTakesRenewedFilesAndKeepsTheOldOnesWhenTheNewAreBad) {
  const TlsFilePaths n1 = TestPki::Shared().Node("n1");
  const TlsFilePaths n2 = TestPki::Shared().Node("n2");
  absl::StatusOr<ckpt::testing::TempDir> dir = ckpt::testing::TempDir::Create();
  ASSERT_TRUE(dir.ok()) << dir.status();
  const std::string cert = dir->path() + "/node.pem", key = dir->path() + "/node.key";
  CopyFile(n1.cert, cert, 0644);
  CopyFile(n1.key, key, 0600);
  // reload_seconds 0: no thread, so only Refresh re-reads (deterministic).
  absl::StatusOr<std::shared_ptr<NodeCredentialsFiles>> f = NodeCredentialsFiles::Open({n1.ca, cert, key, "", 0});
  ASSERT_TRUE(f.ok()) << f.status();
  const std::shared_ptr<const NodeCredentials> before = (*f)->Current();
  EXPECT_EQ(before->identity(), "ckpt://node/n1");
  // Half-renewed: n2's certificate with n1's key. Refused, n1's stay.
  CopyFile(n2.cert, cert, 0644);
  absl::Status s = (*f)->Refresh();
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.message(), "does not match")) << s;
  EXPECT_EQ((*f)->Current(), before);
  // Renewed: now n2's (a connection already started keeps what it took).
  CopyFile(n2.key, key, 0600);
  s = (*f)->Refresh();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ((*f)->Current()->identity(), "ckpt://node/n2");
  EXPECT_EQ(before->identity(), "ckpt://node/n1");
  // A key made readable by others at renewal is refused as at start.
  ASSERT_EQ(::chmod(key.c_str(), 0644), 0);
  s = (*f)->Refresh();
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.message(), "readable by every user")) << s;
  EXPECT_EQ((*f)->Current()->identity(), "ckpt://node/n2");
}

TEST(NodeIdentity, TheRereadingThreadStopsWithItsOwner) {
  const TlsFilePaths n1 = TestPki::Shared().Node("n1");
  // A period far longer than the test: the destructor must not wait it out.
  absl::StatusOr<std::shared_ptr<NodeCredentialsFiles>> f =
      NodeCredentialsFiles::Open({n1.ca, n1.cert, n1.key, "", 3600});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->Current()->identity(), "ckpt://node/n1");
  f = absl::InternalError("released");  // joins the thread; a hang fails by ctest's timeout
}

TEST(NodeIdentity, MalformedIdentityBlocksAreRefused) {
  const IdentityBlock b{"cert", std::string(kX25519Bytes, 'k'), "sig"};
  const std::string bytes = EncodeIdentityBlock(b);
  absl::StatusOr<IdentityBlock> back = DecodeIdentityBlock(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->certificate, "cert");
  EXPECT_EQ(back->signature, "sig");
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(DecodeIdentityBlock(bytes.substr(0, n)).ok()) << "cut at " << n;
  }
  EXPECT_FALSE(DecodeIdentityBlock(bytes + "x").ok());
  EXPECT_FALSE(DecodeIdentityBlock(EncodeIdentityBlock({"cert", "short-key", ""})).ok());
  // An offer without a certificate or key.
  auto n1 = Creds(TestPki::Shared().Node("n1"));
  auto x = *IdentityExchange::Start(n1, true);
  EXPECT_EQ(x->TakeOffer({"", std::string(kX25519Bytes, 'k'), ""}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(x->TakeOffer({n1->certificate_der(), "", ""}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ckpt::transport
