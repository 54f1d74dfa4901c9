// DpuProxy (src/dpu_agent/dpu_proxy.h) in one process: a gRPC server with
// mutual TLS standing in for a DPU agent, the proxy in front of it, and a
// plaintext gRPC client on the proxy's unix socket. The calls and their bytes
// must arrive whole, both ways, with the host's identity at the server; a
// server whose certificate is not a DPU of this host (or not --dpu-node) is
// refused before anything is forwarded. The end-to-end run through the real
// binaries is tests/integration/dpu_proxy_test.cc.
#include "dpu_agent/dpu_proxy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <grpc/grpc_security_constants.h>
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/v1/agent.grpc.pb.h"
#include "common/crc32c.h"
#include "common/pki.h"
#include "support/ports.h"
#include "support/temp_dir.h"
#include "support/test_tls.h"

namespace ckpt::dpu {
namespace {

using ::testing::HasSubstr;
using testing::TestPki;
using testing::TlsFilePaths;

// Deterministic bytes.
std::string Bytes(size_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (char& c : s) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
  return s;
}

// A stand-in DPU agent: AgentStatus names the caller's certificate URIs;
// CommitShard answers the size and crc32c of the manifest bytes it got;
// ReadShard streams `length_bytes` of Bytes(.., 7) in 1 MiB messages.
class FakeDpuAgent final : public v1::AgentService::Service {
 public:
  grpc::Status AgentStatus(grpc::ServerContext* ctx, const v1::AgentStatusRequest*,
                           v1::AgentStatusResponse* resp) override {
    std::vector<std::string> uris;
    for (const grpc::string_ref& v : ctx->auth_context()->FindPropertyValues(GRPC_PEER_URI_PROPERTY_NAME)) {
      uris.emplace_back(v.data(), v.size());
    }
    resp->set_node_id(absl::StrJoin(uris, " "));
    return grpc::Status::OK;
  }
  grpc::Status CommitShard(grpc::ServerContext*, const v1::CommitShardRequest* req,
                           v1::CommitShardResponse* resp) override {
    resp->mutable_shard()->set_size_bytes(req->manifest().size());
    resp->mutable_shard()->set_crc32c(Crc32c(req->manifest().data(), req->manifest().size()));
    return grpc::Status::OK;
  }
  grpc::Status ReadShard(grpc::ServerContext*, const v1::ReadShardRequest* req,
                         grpc::ServerWriter<v1::ReadShardResponse>* out) override {
    const std::string all = Bytes(req->length_bytes(), 7);
    for (size_t off = 0; off < all.size(); off += 1 << 20) {
      v1::ReadShardResponse r;
      r.set_offset_bytes(off);
      r.set_data(all.substr(off, 1 << 20));
      if (!out->Write(r)) return grpc::Status(grpc::StatusCode::CANCELLED, "client gone");
    }
    return grpc::Status::OK;
  }
};

class DpuProxyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<testing::TempDir> t = testing::TempDir::Create();
    ASSERT_TRUE(t.ok()) << t.status();
    dir_ = std::make_unique<testing::TempDir>(*std::move(t));
    host_ = TestPki::Shared().Node("host-1");
  }
  void TearDown() override {
    if (proxy_) proxy_->Stop();
    if (server_) server_->Shutdown();
  }

  // The stand-in DPU agent serving mutual TLS as `as`.
  void StartServer(const TlsFilePaths& as) {
    grpc::SslServerCredentialsOptions o(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    o.pem_root_certs = testing::ReadTestFile(as.ca);
    o.pem_key_cert_pairs.push_back({testing::ReadTestFile(as.key), testing::ReadTestFile(as.cert)});
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::SslServerCredentials(o), &port_);
    b.RegisterService(&service_);
    b.SetMaxReceiveMessageSize(-1);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }

  DpuProxyOptions Options() {
    DpuProxyOptions o;
    o.socket_path = dir_->path() + "/run/agent.sock";
    o.dpu_address = absl::StrCat("127.0.0.1:", port_);
    o.tls_ca = host_.ca;
    o.tls_cert = host_.cert;
    o.tls_key = host_.key;
    o.connect_timeout = absl::Seconds(20);
    return o;
  }

  void StartProxy(DpuProxyOptions o) {
    absl::StatusOr<std::unique_ptr<DpuProxy>> p = DpuProxy::Start(std::move(o));
    ASSERT_TRUE(p.ok()) << p.status();
    proxy_ = *std::move(p);
  }

  // A plaintext client on the proxy's socket, as trainers are.
  std::unique_ptr<v1::AgentService::Stub> Client() {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
    return v1::AgentService::NewStub(grpc::CreateCustomChannel(
        "unix:" + Options().socket_path, grpc::InsecureChannelCredentials(), args));
  }

  grpc::Status Status(v1::AgentService::Stub* stub, v1::AgentStatusResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return stub->AgentStatus(&ctx, {}, resp);
  }

  std::unique_ptr<testing::TempDir> dir_;
  TlsFilePaths host_;
  FakeDpuAgent service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::unique_ptr<DpuProxy> proxy_;
};

TEST_F(DpuProxyTest, CarriesCallsBothWaysAsTheHostsNode) {
  StartServer(TestPki::Shared().Dpu("dpu-1", "host-1"));
  StartProxy(Options());
  EXPECT_EQ(proxy_->host_node(), "host-1");
  struct stat st {};
  ASSERT_EQ(::stat(Options().socket_path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);

  auto stub = Client();
  v1::AgentStatusResponse status;
  grpc::Status s = Status(stub.get(), &status);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(status.node_id(), "ckpt://node/host-1");  // the DPU saw the host's certificate

  // 24 MiB + 3 up (one message), 40 MiB + 1 down (a stream of 1 MiB messages).
  v1::CommitShardRequest commit;
  commit.set_manifest(Bytes((24u << 20) + 3, 3));
  v1::CommitShardResponse committed;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    s = stub->CommitShard(&ctx, commit, &committed);
  }
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(committed.shard().size_bytes(), commit.manifest().size());
  EXPECT_EQ(committed.shard().crc32c(), Crc32c(commit.manifest().data(), commit.manifest().size()));
  v1::ReadShardRequest read;
  read.set_length_bytes((40u << 20) + 1);
  std::string got;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto reader = stub->ReadShard(&ctx, read);
    v1::ReadShardResponse r;
    while (reader->Read(&r)) {
      EXPECT_EQ(r.offset_bytes(), got.size());
      got += r.data();
    }
    s = reader->Finish();
  }
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(got == Bytes(read.length_bytes(), 7)) << "stream differs (" << got.size() << " bytes)";

  // A second client is a second connection; both served.
  auto stub2 = Client();
  ASSERT_TRUE(Status(stub2.get(), &status).ok());
  EXPECT_EQ(proxy_->stats().upstream_failed, 0u);
  EXPECT_GE(proxy_->stats().accepted, 2u);
  EXPECT_GE(proxy_->stats().active, 2u);

  // Stop closes every connection and removes the socket.
  proxy_->Stop();
  EXPECT_EQ(proxy_->stats().active, 0u);
  EXPECT_NE(::access(Options().socket_path.c_str(), F_OK), 0);
  EXPECT_FALSE(Status(stub.get(), &status).ok());
}

TEST_F(DpuProxyTest, ADpuNamedByDpuNodeIsTheOnlyOneTaken) {
  StartServer(TestPki::Shared().Dpu("dpu-1", "host-1"));
  DpuProxyOptions o = Options();
  o.dpu_node = "dpu-1";
  StartProxy(o);
  v1::AgentStatusResponse status;
  ASSERT_TRUE(Status(Client().get(), &status).ok());
  proxy_->Stop();
  proxy_.reset();
  o.dpu_node = "dpu-2";
  StartProxy(o);
  grpc::Status s = Status(Client().get(), &status);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_GE(proxy_->stats().upstream_failed, 1u);
}

TEST_F(DpuProxyTest, AServerThatIsNotADpuOfThisHostGetsNothing) {
  // Another host's DPU, and a node naming no host: each refused after the
  // handshake, before one byte of the trainer's is sent.
  for (const TlsFilePaths& as : {TestPki::Shared().Dpu("dpu-9", "host-9"), TestPki::Shared().Node("dpu-3")}) {
    StartServer(as);
    StartProxy(Options());
    v1::AgentStatusResponse status;
    grpc::Status s = Status(Client().get(), &status);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
    EXPECT_GE(proxy_->stats().upstream_failed, 1u);
    proxy_->Stop();
    proxy_.reset();
    server_->Shutdown();
    server_.reset();
  }
}

// --tls-crl-dir: a DPU agent whose certificate the CA revoked (`ckptctl
// certs revoke`) gets nothing; without the list the same DPU is served.
TEST_F(DpuProxyTest, ADpuWhoseCertificateIsRevokedGetsNothing) {
  const TlsFilePaths dpu = TestPki::Shared().Dpu("dpu-revoked", "host-1");
  StartServer(dpu);
  DpuProxyOptions o = Options();
  StartProxy(o);
  v1::AgentStatusResponse status;
  grpc::Status s = Status(Client().get(), &status);
  ASSERT_TRUE(s.ok()) << s.error_message();
  proxy_->Stop();
  proxy_.reset();
  absl::StatusOr<pki::CrlInfo> crl =
      pki::RevokeCertificates(TestPki::Shared().ca_dir(), {dpu.cert}, dir_->path() + "/crl");
  ASSERT_TRUE(crl.ok()) << crl.status();
  o.tls_crl_dir = dir_->path() + "/crl";
  StartProxy(o);
  s = Status(Client().get(), &status);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_GE(proxy_->stats().upstream_failed, 1u);
}

TEST_F(DpuProxyTest, NothingListeningIsUnavailableAndTheProxyLivesOn) {
  absl::StatusOr<std::vector<int>> ports = testing::PickFreePorts(1);
  ASSERT_TRUE(ports.ok());
  port_ = (*ports)[0];  // nobody there
  StartProxy(Options());
  v1::AgentStatusResponse status;
  EXPECT_EQ(Status(Client().get(), &status).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_GE(proxy_->stats().upstream_failed, 1u);
}

TEST_F(DpuProxyTest, ConnectionsAreBounded) {
  StartServer(TestPki::Shared().Dpu("dpu-1", "host-1"));
  DpuProxyOptions o = Options();
  o.max_connections = 1;
  StartProxy(o);
  auto first = Client();
  v1::AgentStatusResponse status;
  ASSERT_TRUE(Status(first.get(), &status).ok());
  // A raw second connection is closed at once (read returns 0).
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = o.socket_path;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  char c;
  EXPECT_EQ(::read(fd, &c, 1), 0);
  ::close(fd);
  EXPECT_EQ(proxy_->stats().refused_full, 1u);
  ASSERT_TRUE(Status(first.get(), &status).ok());  // the first one is untouched
}

TEST_F(DpuProxyTest, RefusesBadSetUpsNamingWhatToFix) {
  StartServer(TestPki::Shared().Dpu("dpu-1", "host-1"));
  struct Case {
    std::function<void(DpuProxyOptions&)> edit;
    std::string want;
  };
  const TlsFilePaths dpu = TestPki::Shared().Dpu("dpu-1", "host-1");
  const TlsFilePaths admin = testing::AdminTls();
  const std::vector<Case> cases = {
      {[](DpuProxyOptions& o) { o.tls_cert = ""; }, "--tls-ca, --tls-cert and --tls-key are required"},
      {[&](DpuProxyOptions& o) { o.tls_cert = dpu.cert, o.tls_key = dpu.key; }, "a DPU's, serving host-1"},
      {[&](DpuProxyOptions& o) { o.tls_cert = admin.cert, o.tls_key = admin.key; }, "is ckpt://admin/test-admin"},
      {[&](DpuProxyOptions& o) { o.tls_key = dpu.key; }, "does not belong to --tls-cert"},
      {[](DpuProxyOptions& o) { o.dpu_address = "nowhere"; }, "--dpu-address \"nowhere\" is not HOST:PORT"},
      {[](DpuProxyOptions& o) { o.dpu_node = "host-1"; }, "--dpu-node names the host itself"},
      {[](DpuProxyOptions& o) { o.dpu_node = "../x"; }, "--dpu-node"},
      {[](DpuProxyOptions& o) { o.max_connections = 0; }, "--max-connections"},
  };
  for (const Case& c : cases) {
    DpuProxyOptions o = Options();
    c.edit(o);
    absl::StatusOr<std::unique_ptr<DpuProxy>> p = DpuProxy::Start(o);
    ASSERT_FALSE(p.ok()) << c.want;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
    EXPECT_THAT(p.status().message(), HasSubstr(c.want));
  }
}

TEST_F(DpuProxyTest, TheSocketIsCreatedExclusively) {
  StartServer(TestPki::Shared().Dpu("dpu-1", "host-1"));
  StartProxy(Options());
  // A live socket: another proxy refuses it.
  absl::StatusOr<std::unique_ptr<DpuProxy>> second = DpuProxy::Start(Options());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(), HasSubstr("another process is serving"));
  proxy_->Stop();
  proxy_.reset();
  // A file that is not a socket is left alone.
  const std::string path = Options().socket_path;
  { std::ofstream(path) << "not a socket"; }
  second = DpuProxy::Start(Options());
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(second.status().message(), HasSubstr("is not a socket"));
  ::unlink(path.c_str());
  // A stale socket (nobody listening) is replaced.
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(fd);
  StartProxy(Options());
  v1::AgentStatusResponse status;
  EXPECT_TRUE(Status(Client().get(), &status).ok());
}

}  // namespace
}  // namespace ckpt::dpu
