// gRPC credentials for tests that talk to real daemons, which serve mutual TLS
// by default: every caller presents a certificate of the test CA
// (support/pki.h) that carries its ckpt identity.
//
//   auto meta = v1::MetaService::NewStub(TestChannel(address, AdminTls()));
//   auto as_node = v1::MetaService::NewStub(TestChannel(address, TestPki::Shared().Node("n1")));
//
// ExportClientTlsEnvironment() puts an admin certificate in CKPT_TLS_CA,
// CKPT_TLS_CERT and CKPT_TLS_KEY, so that what a test starts or links and
// reads them (ckptctl, ckpt-train-demo, the C++ client library) calls with it.
// Daemons started by MetaProcess and AgentProcess get their own certificates
// by flag (flags win over the environment).
//
// Thread safety: ExportClientTlsEnvironment() calls setenv: call it before
// the test starts threads (MetaProcess::Start does).
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "support/pki.h"

namespace ckpt::testing {

inline std::string ReadTestFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The test process's admin certificate (role admin, name "test-admin").
inline TlsFilePaths AdminTls() { return TestPki::Shared().Client(pki::Role::kAdmin, "test-admin"); }

// TLS credentials presenting `as`, checking the server against the test CA
// and its host name (the daemons' certificates name 127.0.0.1 and localhost).
inline std::shared_ptr<grpc::ChannelCredentials> TestCredentials(const TlsFilePaths& as) {
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = ReadTestFile(as.ca);
  o.pem_cert_chain = ReadTestFile(as.cert);
  o.pem_private_key = ReadTestFile(as.key);
  return grpc::SslCredentials(o);
}

// A channel to `target` ("127.0.0.1:PORT") as `as`.
inline std::shared_ptr<grpc::Channel> TestChannel(const std::string& target, const TlsFilePaths& as) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  return grpc::CreateCustomChannel(target, TestCredentials(as), args);
}

// A plaintext channel: only for a daemon a benchmark started with --insecure
// to measure what security costs (loopback only).
inline std::shared_ptr<grpc::Channel> PlainTestChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

// CKPT_TLS_CA / CKPT_TLS_CERT / CKPT_TLS_KEY = the admin certificate, unless
// the test set them already.
inline void ExportClientTlsEnvironment() {
  if (std::getenv("CKPT_TLS_CERT") != nullptr) return;
  const TlsFilePaths admin = AdminTls();
  ::setenv("CKPT_TLS_CA", admin.ca.c_str(), 1);
  ::setenv("CKPT_TLS_CERT", admin.cert.c_str(), 1);
  ::setenv("CKPT_TLS_KEY", admin.key.c_str(), 1);
}

}  // namespace ckpt::testing
