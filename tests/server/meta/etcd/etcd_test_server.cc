#include "server/meta/etcd/etcd_test_server.h"

#include <unistd.h>

#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/meta/etcd/etcd_client.h"
#include "support/ports.h"

namespace ckpt::testing {

std::string EtcdTestServer::BinaryPath() {
  const char* env = std::getenv("CKPT_ETCD_BINARY");
  return env != nullptr && env[0] != '\0' ? std::string(env) : std::string("/usr/bin/etcd");
}

bool EtcdTestServer::Available() { return access(BinaryPath().c_str(), X_OK) == 0; }

std::string EtcdTestServer::MissingReason() {
  return absl::StrCat(BinaryPath(), " is not there: install Debian's etcd-server (scripts/setup-deps.sh) ",
                      "or point CKPT_ETCD_BINARY at an etcd 3.4+");
}

absl::StatusOr<std::unique_ptr<EtcdTestServer>> EtcdTestServer::StartInTempDir(std::unique_ptr<TempDir>* dir) {
  absl::StatusOr<TempDir> tmp = TempDir::Create();
  if (!tmp.ok()) return tmp.status();
  *dir = std::make_unique<TempDir>(std::move(*tmp));
  return Start((*dir)->path());
}

absl::StatusOr<std::unique_ptr<EtcdTestServer>> EtcdTestServer::Start(const std::string& dir) {
  absl::Status last;
  for (int attempt = 0; attempt < 3; ++attempt) {
    absl::StatusOr<std::vector<int>> ports = PickFreePorts(2);
    if (!ports.ok()) return ports.status();
    const std::string client = absl::StrCat("http://127.0.0.1:", (*ports)[0]);
    const std::string peer = absl::StrCat("http://127.0.0.1:", (*ports)[1]);
    SubprocessOptions options;
    options.argv = {BinaryPath(),
                    "--name=t1",
                    absl::StrCat("--data-dir=", dir, "/etcd-data"),
                    absl::StrCat("--listen-client-urls=", client),
                    absl::StrCat("--advertise-client-urls=", client),
                    absl::StrCat("--listen-peer-urls=", peer),
                    absl::StrCat("--initial-advertise-peer-urls=", peer),
                    absl::StrCat("--initial-cluster=t1=", peer),
                    "--initial-cluster-state=new",
                    "--heartbeat-interval=50",
                    "--election-timeout=500",
                    "--logger=zap",
                    "--log-outputs=stderr",
                    "--log-level=warn"};
    options.name = "etcd";
    options.log_dir = dir;
    absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(options);
    if (!proc.ok()) return proc.status();
    absl::Status up = WaitForTcpPort("127.0.0.1", (*ports)[0], absl::Seconds(20), proc->get());
    if (!up.ok()) {
      last = up;
      if (StartLostAPort(up)) continue;
      return up;
    }
    const std::string endpoint = absl::StrCat("127.0.0.1:", (*ports)[0]);
    meta::EtcdOptions client_options;
    client_options.endpoints = {endpoint};
    client_options.call_timeout = absl::Seconds(2);
    absl::StatusOr<std::unique_ptr<meta::EtcdClient>> etcd = meta::EtcdClient::Create(client_options);
    if (!etcd.ok()) return etcd.status();
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    absl::Status served;
    do {
      served = (*etcd)->Put("/ckpt-test/ready", "1").status();
      if (served.ok()) return std::unique_ptr<EtcdTestServer>(new EtcdTestServer(std::move(*proc), endpoint));
      if (!(*proc)->IsRunning()) break;
      absl::SleepFor(absl::Milliseconds(50));
    } while (absl::Now() < deadline);
    return absl::DeadlineExceededError(absl::StrCat("etcd on ", endpoint, " did not serve a Put: ",
                                                    served.ToString(), "\n", (*proc)->LogTail()));
  }
  return last;
}

absl::Status EtcdTestServer::Kill() {
  absl::Status s = process_->Kill(SIGKILL);
  if (!s.ok()) return s;
  return process_->Wait().status();
}

}  // namespace ckpt::testing
