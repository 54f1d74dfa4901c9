// A real single-member etcd for tests: /usr/bin/etcd (Debian's etcd-server,
// scripts/packages.txt) on free 127.0.0.1 ports with its data in a directory
// the test owns. Killed by its PID when destroyed (and by the kernel if the
// test process dies: tests/support/process.h).
//
//   if (!EtcdTestServer::Available()) GTEST_SKIP() << EtcdTestServer::MissingReason();
//   CKPT_ASSIGN_OR_RETURN(auto etcd, EtcdTestServer::Start(tmp.path()));
//   options.endpoints = {etcd->endpoint()};
//
// Heartbeat 50 ms and election timeout 500 ms (etcd's defaults are 100 ms and
// 1 s): the member elects itself sooner, and etcd's minimum lease TTL
// (1.5 election timeouts) is 1 s instead of 2 s.
//
// Thread safety: as Subprocess (tests/support/process.h).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "support/process.h"
#include "support/temp_dir.h"

namespace ckpt::testing {

class EtcdTestServer {
 public:
  // The etcd binary: $CKPT_ETCD_BINARY if set, else /usr/bin/etcd.
  static std::string BinaryPath();
  // Whether BinaryPath() is an executable file.
  static bool Available();
  // Why tests skip when it is not: names the binary and the package.
  static std::string MissingReason();

  // Starts etcd with its data dir and log under `dir` (<dir>/etcd-data,
  // <dir>/etcd.log) and returns once a Put through its client port succeeds.
  // Retries on other ports if one was taken between picking and binding.
  // Errors: the start's or the wait's (with the log tail); DeadlineExceeded
  // if etcd does not serve within 20 s.
  static absl::StatusOr<std::unique_ptr<EtcdTestServer>> Start(const std::string& dir);

  // "127.0.0.1:<client port>".
  const std::string& endpoint() const { return endpoint_; }
  pid_t pid() const { return process_->pid(); }
  Subprocess* process() { return process_.get(); }

  // kill -9 by PID, and reap it.
  absl::Status Kill();

  // For a test's SetUp: a new TempDir (into *dir) and an etcd in it.
  static absl::StatusOr<std::unique_ptr<EtcdTestServer>> StartInTempDir(std::unique_ptr<TempDir>* dir);

 private:
  EtcdTestServer(std::unique_ptr<Subprocess> process, std::string endpoint)
      : process_(std::move(process)), endpoint_(std::move(endpoint)) {}

  std::unique_ptr<Subprocess> process_;
  std::string endpoint_;
};

}  // namespace ckpt::testing
