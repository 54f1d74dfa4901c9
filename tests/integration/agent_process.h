// A real ckpt-agent process for integration tests and benchmarks: free
// 127.0.0.1 ports, its own run dir, memory dir and durable root under a test
// directory; restartable on the same dirs (its memory tier survives); killed
// by PID. It serves mutual TLS with the test CA's certificate for its node id
// (support/pki.h), as shipped; stub() calls it as an admin.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "ckpt/v1/agent.grpc.pb.h"
#include "support/ports.h"
#include "support/process.h"
#include "support/test_tls.h"

namespace ckpt::testing {

struct AgentProcessOptions {
  std::string binary = "ckpt-agent";  // or ckpt-dpu-agent
  std::string node_id = "node-1";
  std::string meta_address;
  std::string dir;           // run/, mem/ and logs go below it
  std::string durable_root;  // empty: none
  std::string memory = "64MiB";
  std::string memory_dir;    // empty: <dir>/mem
  std::vector<std::string> extra_args;
  // The host a ckpt-dpu-agent's certificate names (ckpt://host/<id>); unset:
  // its --host-node from extra_args, as `ckptctl certs create-node
  // --host-node` makes it. (Set otherwise only to test the refusal.)
  std::optional<std::string> cert_host_node;
  // --insecure instead of the node's certificate: only for a benchmark that
  // measures what security costs (bench/protection_bench --security);
  // loopback only, with a MetaProcess started insecure.
  bool insecure = false;
};

class AgentProcess {
 public:
  static absl::StatusOr<std::unique_ptr<AgentProcess>> Start(const AgentProcessOptions& options) {
    auto p = std::unique_ptr<AgentProcess>(new AgentProcess());
    p->options_ = options;
    // A port can still be taken between PickFreePorts and the agent's bind (ports.h):
    // then the agent exits saying so, and it is started again on new ports.
    for (int attempt = 1;; ++attempt) {
      auto ports = PickFreePorts(3);
      if (!ports.ok()) return ports.status();
      p->port_ = (*ports)[0];
      p->data_port_ = (*ports)[1];
      p->metrics_port_ = (*ports)[2];
      absl::Status s = p->Restart();
      if (s.ok()) return p;
      if (attempt == 3 || !StartLostAPort(s)) return s;
    }
  }

  // (Re)starts on the same ports and directories, and waits until the agent
  // is registered with meta (AgentStatus.registered) or 30 s pass.
  absl::Status Restart(bool wait_registered = true) {
    SubprocessOptions o;
    o.argv = {BinaryPath(options_.binary),
              "--node-id", options_.node_id,
              "--meta", options_.meta_address,
              "--listen", absl::StrCat("127.0.0.1:", port_),
              "--data-listen", absl::StrCat("127.0.0.1:", data_port_),
              "--metrics-listen", absl::StrCat("127.0.0.1:", metrics_port_),
              "--run-dir", run_dir(),
              "--memory-dir", memory_dir(),
              "--memory", options_.memory};
    if (!options_.durable_root.empty()) {
      o.argv.push_back("--durable-root");
      o.argv.push_back(options_.durable_root);
    }
    if (options_.insecure) {
      o.argv.push_back("--insecure");
    } else {
      std::string host_node;  // a DPU's certificate names its host
      for (size_t i = 0; i + 1 < options_.extra_args.size(); ++i) {
        if (options_.extra_args[i] == "--host-node") host_node = options_.extra_args[i + 1];
      }
      if (options_.cert_host_node) host_node = *options_.cert_host_node;
      const TlsFilePaths tls = host_node.empty() ? TestPki::Shared().Node(options_.node_id)
                                                 : TestPki::Shared().Dpu(options_.node_id, host_node);
      for (const std::string& a : {std::string("--tls-ca"), tls.ca, std::string("--tls-cert"), tls.cert,
                                   std::string("--tls-key"), tls.key}) {
        o.argv.push_back(a);
      }
    }
    for (const std::string& a : options_.extra_args) o.argv.push_back(a);
    o.name = options_.binary + "-" + options_.node_id;
    o.log_dir = options_.dir;
    auto proc = Subprocess::Start(o);
    if (!proc.ok()) return proc.status();
    proc_ = std::move(*proc);
    if (absl::Status s = WaitForTcpPort("127.0.0.1", port_, absl::Seconds(60), proc_.get()); !s.ok()) return s;
    channel_ = options_.insecure ? PlainTestChannel(absl::StrCat("127.0.0.1:", port_))
                                 : TestChannel(absl::StrCat("127.0.0.1:", port_), AdminTls());
    stub_ = ckpt::v1::AgentService::NewStub(channel_);
    if (!wait_registered) return absl::OkStatus();
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      ckpt::v1::AgentStatusResponse st;
      grpc::ClientContext ctx;
      if (stub_->AgentStatus(&ctx, {}, &st).ok() && st.registered()) return absl::OkStatus();
      // WaitForTcpPort may have reached another process's listener on a port
      // taken since PickFreePorts while this agent was still shutting down
      // ("cannot listen"): said as an exit "before" registering, so that
      // Start picks new ports (StartLostAPort).
      if (!proc_->IsRunning()) {
        return absl::UnavailableError(absl::StrCat("agent exited before it registered with meta:\n",
                                                   proc_->LogTail()));
      }
      absl::SleepFor(absl::Milliseconds(20));  // bounded poll for process start-up
    }
    return absl::DeadlineExceededError("agent did not register with meta within 30 s:\n" + proc_->LogTail());
  }

  Subprocess* proc() { return proc_.get(); }
  ckpt::v1::AgentService::Stub* stub() { return stub_.get(); }
  std::string run_dir() const { return options_.dir + "/run"; }
  std::string socket_path() const { return run_dir() + "/agent.sock"; }
  std::string memory_dir() const { return options_.memory_dir.empty() ? options_.dir + "/mem" : options_.memory_dir; }
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  int data_port() const { return data_port_; }
  const AgentProcessOptions& options() const { return options_; }
  // A sample without labels from the agent's /metrics (-1 if absent or the
  // agent does not answer).
  double Metric(const std::string& name) const {
    int code = 0;
    absl::StatusOr<std::string> body = HttpGet("127.0.0.1", metrics_port_, "/metrics", &code);
    if (!body.ok()) return -1;
    for (absl::string_view line : absl::StrSplit(*body, '\n')) {
      if (absl::StartsWith(line, name + " ")) {
        double v = 0;
        if (absl::SimpleAtod(line.substr(name.size() + 1), &v)) return v;
      }
    }
    return -1;
  }

 private:
  AgentProcess() = default;
  AgentProcessOptions options_;
  int port_ = 0, data_port_ = 0, metrics_port_ = 0;
  std::unique_ptr<Subprocess> proc_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<ckpt::v1::AgentService::Stub> stub_;
};

}  // namespace ckpt::testing
