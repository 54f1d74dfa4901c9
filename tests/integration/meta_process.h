// A real ckpt-meta process for integration tests and benchmarks: started on a
// free 127.0.0.1 port with its own data dir, restartable on the same dir,
// killed by PID.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "ckpt/v1/meta.grpc.pb.h"
#include "support/ports.h"
#include "support/process.h"

namespace ckpt::testing {

class MetaProcess {
 public:
  // Starts ckpt-meta with data in `data_dir` and logs in `log_dir`.
  static absl::StatusOr<std::unique_ptr<MetaProcess>> Start(const std::string& data_dir,
                                                            const std::string& log_dir,
                                                            int lease_ms = 5000) {
    auto p = std::unique_ptr<MetaProcess>(new MetaProcess());
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
    o.name = "ckpt-meta";
    o.log_dir = log_dir_;
    auto proc = Subprocess::Start(o);
    if (!proc.ok()) return proc.status();
    proc_ = std::move(*proc);
    if (absl::Status s = WaitForTcpPort("127.0.0.1", port_, absl::Seconds(30), proc_.get());
        !s.ok()) {
      return s;
    }
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_),
                                   grpc::InsecureChannelCredentials());
    stub_ = ckpt::v1::MetaService::NewStub(channel_);
    return absl::OkStatus();
  }

  Subprocess* proc() { return proc_.get(); }
  ckpt::v1::MetaService::Stub* stub() { return stub_.get(); }
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  MetaProcess() = default;
  int port_ = 0, metrics_port_ = 0, lease_ms_ = 5000;
  std::string data_dir_, log_dir_;
  std::unique_ptr<Subprocess> proc_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<ckpt::v1::MetaService::Stub> stub_;
};

}  // namespace ckpt::testing
