// dpu_staging_helper OUT TOKEN_HEX SIZE: a stand-in trainer for dpu_agent_test.
// Registers staging memory with UCX as the client library does
// (client/pull_staging.h), fills it with the lease's token (hex) and SIZE
// bytes of 'x', writes the PullSource naming it (serialized) to OUT (through
// a temporary file and a rename), then waits to be killed. A separate
// process rather than a fork of the test: the test has threads, and so does
// the staging (ThreadSanitizer refuses threads started after such a fork).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/escaping.h"
#include "ckpt/v1/agent.pb.h"
#include "client/pull_staging.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: dpu_staging_helper OUT TOKEN_HEX SIZE\n");
    return 2;
  }
  const std::string out = argv[1];
  const std::string token = absl::HexStringToBytes(argv[2]);
  const uint64_t size = std::strtoull(argv[3], nullptr, 10);
  absl::StatusOr<std::shared_ptr<ckpt::client::PullStaging>> staging = ckpt::client::PullStaging::Create();
  if (!staging.ok()) {
    std::fprintf(stderr, "%s\n", staging.status().ToString().c_str());
    return 3;
  }
  absl::StatusOr<std::shared_ptr<ckpt::client::PullStaging::Buffer>> buf =
      (*staging)->Acquire(ckpt::client::kPullHeaderBytes + size);
  if (!buf.ok()) {
    std::fprintf(stderr, "%s\n", buf.status().ToString().c_str());
    return 4;
  }
  std::byte* p = (*buf)->data();
  std::memset(p, 0, ckpt::client::kPullHeaderBytes);
  std::memcpy(p, token.data(), token.size());
  std::memset(p + ckpt::client::kPullHeaderBytes, 'x', size);
  ckpt::v1::PullSource src;
  src.set_worker_address((*buf)->worker_address());
  src.set_rkey((*buf)->rkey());
  src.set_address(reinterpret_cast<uint64_t>(p));
  src.set_length_bytes((*buf)->length());
  {
    std::ofstream f(out + ".tmp", std::ios::binary);
    f << src.SerializeAsString();
    if (!f.good()) return 5;
  }
  if (std::rename((out + ".tmp").c_str(), out.c_str()) != 0) return 6;
  while (true) ::pause();
}
