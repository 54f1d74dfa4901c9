// TestPki; see pki.h.
#include "support/pki.h"

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ckpt::testing {
namespace {

[[noreturn]] void Die(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "TestPki: %s: %s\n", what.c_str(), s.ToString().c_str());
  std::abort();
}

TempDir MakeRoot() {
  absl::StatusOr<TempDir> dir = TempDir::Create();
  if (!dir.ok()) Die("cannot make a temp dir", dir.status());
  return *std::move(dir);
}

}  // namespace

TestPki& TestPki::Shared() {
  // Destroyed at exit, which removes the directory.
  static TestPki pki(MakeRoot());
  return pki;
}

TestPki::TestPki(TempDir dir)
    : dir_(std::move(dir)), root_(dir_.path()), ca_dir_(root_ + "/ca") {
  pki::CaOptions o;
  o.days = 30;
  o.name = "ckpt test CA";
  if (absl::Status s = pki::CreateCa(ca_dir_, o); !s.ok()) Die("cannot make the test CA", s);
}

TlsFilePaths TestPki::Meta() { return For({pki::Role::kMeta, "", {}}); }

TlsFilePaths TestPki::Node(const std::string& node_id) { return For({pki::Role::kNode, node_id, {}}); }

TlsFilePaths TestPki::Dpu(const std::string& node_id, const std::string& host_node) {
  return For({pki::Role::kNode, node_id, {}, host_node});
}

TlsFilePaths TestPki::Client(pki::Role role, const std::string& name, const std::vector<std::string>& jobs) {
  return For({role, name, jobs});
}

TlsFilePaths TestPki::For(const pki::Identity& identity) {
  const std::string key = absl::StrJoin(pki::IdentityUris(identity), " ");
  int n = 0;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = issued_.find(key); it != issued_.end()) return it->second;
    n = next_++;
  }
  // Issued without the lock (file I/O); two threads asking for the same new
  // identity both issue, and the first to publish is what everyone gets.
  const std::string prefix =
      absl::StrCat(root_, "/", std::string(pki::RoleName(identity.role)), identity.name.empty() ? "" : "-", identity.name, "-", n);
  pki::CertOptions o;
  o.identity = identity;
  if (identity.role == pki::Role::kMeta || identity.role == pki::Role::kNode) {
    o.hosts = {"127.0.0.1", "::1", "localhost"};
  }
  o.days = 30;
  if (absl::Status s = pki::IssueCertificate(ca_dir_, o, prefix); !s.ok()) {
    Die(absl::StrCat("cannot issue a certificate for ", key), s);
  }
  TlsFilePaths paths{pki::CaCertPath(ca_dir_), pki::CertPath(prefix), pki::KeyPath(prefix)};
  absl::MutexLock lock(&mu_);
  return issued_.emplace(key, std::move(paths)).first->second;
}

}  // namespace ckpt::testing
