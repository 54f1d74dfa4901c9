// A real ckpt-meta process for integration tests and benchmarks: started on a
// free 127.0.0.1 port with its own data dir, restartable on the same dir,
// killed by PID. It serves mutual TLS with the test CA's meta certificate, as
// shipped (support/pki.h); stub() calls it as an admin, NodeStub(id) as node
// id's agent. Start() exports an admin certificate to CKPT_TLS_* for what the
// test runs (support/test_tls.h).
#pragma once

#include <grpcpp/grpcpp.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "ckpt/v1/meta.grpc.pb.h"
#include "support/ports.h"
#include "support/process.h"
#include "support/test_tls.h"

namespace ckpt::testing {

class MetaProcess {
 public:
  // Starts ckpt-meta with data in `data_dir` and logs in `log_dir`.
  // `insecure`: --insecure instead of meta's certificate, only for a
  // benchmark that measures what security costs (the caller then clears
  // CKPT_TLS_* for its clients); the tests run meta as shipped.
  // `extra_args` go on ckpt-meta's command line (e.g. --replica-of).
  static absl::StatusOr<std::unique_ptr<MetaProcess>> Start(const std::string& data_dir,
                                                            const std::string& log_dir,
                                                            int lease_ms = 5000, bool insecure = false,
                                                            std::vector<std::string> extra_args = {}) {
    if (!insecure) ExportClientTlsEnvironment();
    auto p = std::unique_ptr<MetaProcess>(new MetaProcess());
    p->extra_args_ = std::move(extra_args);
    p->insecure_ = insecure;
    p->data_dir_ = data_dir;
    p->log_dir_ = log_dir;
    p->lease_ms_ = lease_ms;
    for (int attempt = 1;; ++attempt) {  // new ports if one was taken (as AgentProcess::Start)
      auto ports = PickFreePorts(2);
      if (!ports.ok()) return ports.status();
      p->port_ = (*ports)[0];
      p->metrics_port_ = (*ports)[1];
      absl::Status s = p->Restart();
      if (s.ok()) return p;
      if (attempt == 3 || !StartLostAPort(s)) return s;
    }
  }

  // (Re)starts the process on the same ports and data dir.
  absl::Status Restart() {
    SubprocessOptions o;
    o.argv = {BinaryPath("ckpt-meta"),
              "--listen",
              absl::StrCat("127.0.0.1:", port_),
              "--metrics-listen",
              absl::StrCat("127.0.0.1:", metrics_port_),
              "--data-dir",
              data_dir_,
              "--lease-ms",
              std::to_string(lease_ms_)};
    o.argv.insert(o.argv.end(), extra_args_.begin(), extra_args_.end());
    if (insecure_) {
      o.argv.push_back("--insecure");
    } else {
      const TlsFilePaths tls = TestPki::Shared().Meta();
      for (const std::string& a : {std::string("--tls-ca"), tls.ca, std::string("--tls-cert"), tls.cert,
                                   std::string("--tls-key"), tls.key}) {
        o.argv.push_back(a);
      }
    }
    o.name = "ckpt-meta";
    o.log_dir = log_dir_;
    auto proc = Subprocess::Start(o);
    if (!proc.ok()) return proc.status();
    proc_ = std::move(*proc);
    if (absl::Status s = WaitForTcpPort("127.0.0.1", port_, absl::Seconds(30), proc_.get());
        !s.ok()) {
      return s;
    }
    channel_ = insecure_ ? PlainTestChannel(address()) : TestChannel(address(), AdminTls());
    stub_ = ckpt::v1::MetaService::NewStub(channel_);
    node_stubs_.clear();
    return absl::OkStatus();
  }

  Subprocess* proc() { return proc_.get(); }
  // As an admin.
  ckpt::v1::MetaService::Stub* stub() { return stub_.get(); }
  // As node `node_id`'s agent (meta takes a node's calls only from its own
  // certificate). Valid until the next Restart.
  ckpt::v1::MetaService::Stub* NodeStub(const std::string& node_id) {
    auto& stub = node_stubs_[node_id];
    if (stub == nullptr) {
      stub = ckpt::v1::MetaService::NewStub(insecure_ ? PlainTestChannel(address())
                                                      : TestChannel(address(), TestPki::Shared().Node(node_id)));
    }
    return stub.get();
  }
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  MetaProcess() = default;
  int port_ = 0, metrics_port_ = 0, lease_ms_ = 5000;
  bool insecure_ = false;
  std::string data_dir_, log_dir_;
  std::vector<std::string> extra_args_;
  std::unique_ptr<Subprocess> proc_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<ckpt::v1::MetaService::Stub> stub_;
  std::map<std::string, std::unique_ptr<ckpt::v1::MetaService::Stub>> node_stubs_;
};

}  // namespace ckpt::testing
