// TestPki: certificates for tests that run daemons with mutual TLS. One CA per
// test process, in a temp dir removed at exit; certificates issued on first
// use and cached by identity.
//
//   const TlsFilePaths meta = TestPki::Shared().Meta();
//   const TlsFilePaths node = TestPki::Shared().Node("node-1");
//   const TlsFilePaths admin = TestPki::Shared().Client(pki::Role::kAdmin, "admin");
//   // --tls-ca meta.ca --tls-cert meta.cert --tls-key meta.key
//
// Meta and node certificates name the hosts 127.0.0.1, ::1 and localhost.
// Uses common/pki.h directly (not ckptctl). A failure to make the CA or a
// certificate aborts the test process with the reason (a test cannot run
// without its certificates, and returning errors would burden every caller).
//
// Thread safety: every method is safe to call from any thread; Shared() is
// created once.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/pki.h"
#include "support/temp_dir.h"

namespace ckpt::testing {

struct TlsFilePaths {
  std::string ca;    // the CA's certificate (--tls-ca)
  std::string cert;  // the holder's certificate chain (--tls-cert)
  std::string key;   // its key (--tls-key)
};

class TestPki {
 public:
  // The process's PKI: its CA is made on the first call (in a mkdtemp
  // directory under $TMPDIR, deleted at exit unless CKPT_KEEP_TEST_DIRS=1).
  static TestPki& Shared();

  // A certificate for ckpt-meta / node `node_id`'s agent / a client of `role`
  // named `name` (trainers: `jobs`, at least one). The same identity gives the
  // same files every time.
  TlsFilePaths Meta();
  TlsFilePaths Node(const std::string& node_id);
  // A DPU's node certificate: node `node_id` serving host `host_node`
  // (ckpt://host/<host_node>, as `ckptctl certs create-node --host-node`).
  TlsFilePaths Dpu(const std::string& node_id, const std::string& host_node);
  TlsFilePaths Client(pki::Role role, const std::string& name, const std::vector<std::string>& jobs = {});

  // Any identity (hosts 127.0.0.1, ::1, localhost for meta and nodes).
  TlsFilePaths For(const pki::Identity& identity);

  // The CA's directory (ca.pem, ca.key), for tests that issue certificates of
  // their own (pki::IssueCertificate) or make a second CA beside it.
  const std::string& ca_dir() const { return ca_dir_; }
  // The directory everything lives in.
  const std::string& root() const { return root_; }

 private:
  explicit TestPki(TempDir dir);

  TempDir dir_;  // removed when the process exits
  const std::string root_;
  const std::string ca_dir_;
  absl::Mutex mu_;
  std::map<std::string, TlsFilePaths> issued_ ABSL_GUARDED_BY(mu_);  // by the identity's URIs
  int next_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt::testing
