// TestPki (support/pki.h): one CA per process, certificates cached by
// identity, the right identities in them, safe from several threads.
#include "support/pki.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace ckpt::testing {
namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(TestPki, IssuesOnceByIdentityWithTheIdentityInside) {
  TestPki& p = TestPki::Shared();
  EXPECT_EQ(&p, &TestPki::Shared());
  const TlsFilePaths meta = p.Meta();
  EXPECT_EQ(meta.ca, p.ca_dir() + "/ca.pem");
  EXPECT_EQ(p.Meta().cert, meta.cert);
  const TlsFilePaths n1 = p.Node("n1");
  EXPECT_NE(n1.cert, meta.cert);
  EXPECT_EQ(p.Node("n1").key, n1.key);
  EXPECT_NE(p.Node("n2").cert, n1.cert);
  const TlsFilePaths t = p.Client(pki::Role::kTrainer, "t", {"job-a"});
  EXPECT_NE(p.Client(pki::Role::kTrainer, "t", {"job-b"}).cert, t.cert);  // other jobs: another identity

  absl::StatusOr<pki::Identity> id = pki::IdentityOfCertificate(Slurp(n1.cert));
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, (pki::Identity{pki::Role::kNode, "n1", {}}));
  id = pki::IdentityOfCertificate(Slurp(t.cert));
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, (pki::Identity{pki::Role::kTrainer, "t", {"job-a"}}));
  absl::StatusOr<pki::CertificateInfo> info = pki::DescribeCertificate(Slurp(meta.cert));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_THAT(info->ip_addresses, ::testing::ElementsAre("127.0.0.1", "::1"));
  EXPECT_THAT(info->dns_names, ::testing::ElementsAre("localhost"));
  struct stat st;
  ASSERT_EQ(::stat(n1.key.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST(TestPki, ThreadsAskingForTheSameIdentityGetTheSameFiles) {
  std::vector<std::thread> threads;
  std::vector<TlsFilePaths> got(4);
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&got, i] { got[i] = TestPki::Shared().Client(pki::Role::kAdmin, "racer"); });
  }
  for (std::thread& t : threads) t.join();
  for (const TlsFilePaths& g : got) EXPECT_EQ(g.cert, got[0].cert);
  EXPECT_EQ(TestPki::Shared().Client(pki::Role::kAdmin, "racer").cert, got[0].cert);
}

}  // namespace
}  // namespace ckpt::testing
