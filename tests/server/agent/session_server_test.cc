// SessionServer on its own (no Agent): its socket, the pool descriptors it
// hands over, and the life of a session on the FakeClock: alive while its
// connection is open and for the grace after, resumed within the grace,
// ended (on_ended, once) after it, never ended by Stop; a resume of a session
// in use refused with the reason; a client that never greets dropped after
// the hello timeout; a full table refusing connections without hurting the
// sessions it has. session_test.cc covers the requests of version-2 sessions,
// the socket group, and the sessions through the Agent.
//
// The server's thread polls its sockets every 200 ms of real time and reads
// the FakeClock; a test waits for what that thread decides with bounded
// polls (Eventually), never by sleeping a fixed time.
#include "server/agent/session_server.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/session.h"
#include "common/clock.h"
#include "support/eventually.h"
#include "support/temp_dir.h"

namespace ckpt::agent {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using ckpt::client::AgentSession;
using ckpt::testing::TempDir;
using ckpt::testing::Eventually;

constexpr absl::Duration kGrace = absl::Seconds(10);

class SessionServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<TempDir>(*TempDir::Create());
    pool_fd_ = ::memfd_create("ckpt-session-server-test", MFD_CLOEXEC);
    ASSERT_GE(pool_fd_, 0);
    ASSERT_EQ(::ftruncate(pool_fd_, 1 << 20), 0);
  }
  void TearDown() override {
    server_.reset();
    if (pool_fd_ >= 0) ::close(pool_fd_);
  }

  void Start(size_t max_sessions = 4096) {
    SessionServer::Options o;
    o.socket_path = dir_->path() + "/session.sock";
    o.grace = kGrace;
    o.max_sessions = max_sessions;
    absl::StatusOr<std::unique_ptr<SessionServer>> s =
        SessionServer::Start(o, {PoolFile{"/dev/shm/ckpt-test/pool.bin", pool_fd_, 1 << 20}}, &clock_,
                             [this](const std::string& id) {
                               absl::MutexLock lock(&mu_);
                               ended_.push_back(id);
                             });
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }
  std::unique_ptr<AgentSession> Connect(const std::string& resume = "") {
    absl::StatusOr<std::unique_ptr<AgentSession>> s =
        AgentSession::Open(server_->socket_path(), resume, absl::Seconds(10));
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }
  // A raw connection to the socket (closed by the caller).
  int RawConnect() {
    const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, server_->socket_path().c_str(), sizeof(addr.sun_path) - 1);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
    return fd;
  }
  // Sends `m` on `fd` and returns the answer ("" if the server closed).
  static std::string Exchange(int fd, const std::string& m) {
    ::send(fd, m.data(), m.size(), MSG_NOSIGNAL);
    return Receive(fd);
  }
  static std::string Receive(int fd) {
    char buf[1024];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  }
  std::vector<std::string> Ended() {
    absl::MutexLock lock(&mu_);
    return ended_;
  }

  std::unique_ptr<TempDir> dir_;
  int pool_fd_ = -1;
  FakeClock clock_;
  std::unique_ptr<SessionServer> server_;
  absl::Mutex mu_;
  std::vector<std::string> ended_ ABSL_GUARDED_BY(mu_);
};

TEST_F(SessionServerTest, TheSocketIsOwnerAndGroupOnlyAndHandsOverThePoolItself) {
  Start();
  struct stat st {};
  ASSERT_EQ(::stat(server_->socket_path().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);

  std::unique_ptr<AgentSession> s = Connect();
  ASSERT_NE(s, nullptr);
  ASSERT_EQ(s->pools().size(), 1u);
  EXPECT_EQ(s->pools()[0].path, "/dev/shm/ckpt-test/pool.bin");
  EXPECT_EQ(s->pools()[0].bytes, uint64_t{1} << 20);
  // The descriptor received is the pool's own file, not a copy.
  struct stat mine {}, theirs {};
  ASSERT_EQ(::fstat(pool_fd_, &mine), 0);
  ASSERT_EQ(::fstat(s->pools()[0].fd, &theirs), 0);
  EXPECT_EQ(mine.st_ino, theirs.st_ino);
  EXPECT_EQ(mine.st_dev, theirs.st_dev);
  EXPECT_TRUE(server_->Open(s->id()));
  EXPECT_TRUE(Eventually([&] { return server_->open_sessions() == 1; }));
}

TEST_F(SessionServerTest, AClosedSessionLivesForItsGraceAndEndsOnceAfterIt) {
  Start();
  std::unique_ptr<AgentSession> s = Connect();
  ASSERT_NE(s, nullptr);
  const std::string id = s->id();
  s.reset();  // the client exits
  ASSERT_TRUE(Eventually([&] { return !server_->Open(id); }));
  EXPECT_TRUE(server_->Alive(id));
  clock_.Advance(kGrace - absl::Milliseconds(1));
  EXPECT_TRUE(server_->Alive(id));
  EXPECT_TRUE(Ended().empty());
  clock_.Advance(absl::Milliseconds(1));
  ASSERT_TRUE(Eventually([&] { return !Ended().empty(); }));
  EXPECT_EQ(Ended(), std::vector<std::string>{id});
  EXPECT_FALSE(server_->Alive(id));
  clock_.Advance(kGrace);
  EXPECT_TRUE(Eventually([&] { return server_->open_sessions() == 0; }));
  EXPECT_EQ(Ended().size(), 1u);  // once
}

TEST_F(SessionServerTest, ASessionResumedWithinItsGraceKeepsItsIdAndAfterItGetsANewOne) {
  Start();
  std::unique_ptr<AgentSession> s = Connect();
  ASSERT_NE(s, nullptr);
  const std::string id = s->id();
  s.reset();
  ASSERT_TRUE(Eventually([&] { return !server_->Open(id); }));
  clock_.Advance(kGrace / 2);
  std::unique_ptr<AgentSession> resumed = Connect(id);
  ASSERT_NE(resumed, nullptr);
  EXPECT_EQ(resumed->id(), id);
  EXPECT_TRUE(server_->Open(id));
  clock_.Advance(kGrace);  // open again: no grace runs
  EXPECT_TRUE(server_->Alive(id));
  EXPECT_TRUE(Ended().empty());

  resumed.reset();
  ASSERT_TRUE(Eventually([&] { return !server_->Open(id); }));
  clock_.Advance(kGrace);
  ASSERT_TRUE(Eventually([&] { return !Ended().empty(); }));
  std::unique_ptr<AgentSession> late = Connect(id);
  ASSERT_NE(late, nullptr);
  EXPECT_NE(late->id(), id);  // its leases and handles are gone: a new session
}

TEST_F(SessionServerTest, ResumingASessionInUseIsRefusedWithTheReason) {
  Start();
  std::unique_ptr<AgentSession> s = Connect();
  ASSERT_NE(s, nullptr);
  const int fd = RawConnect();
  EXPECT_EQ(Exchange(fd, absl::StrCat("HELLO 1 ", s->id())), "ERR session is in use by another connection\n");
  ::close(fd);
  EXPECT_TRUE(server_->Open(s->id()));  // the owner keeps it
}

TEST_F(SessionServerTest, ABadHelloIsRefusedWithWhatIsExpected) {
  Start();
  for (const std::string& bad :
       std::vector<std::string>{"HELLO", "HELLO 9", "HELLO 1 a b", "GET / HTTP/1.1", std::string(600, 'x')}) {
    const int fd = RawConnect();
    const std::string answer = Exchange(fd, bad);
    ::close(fd);
    EXPECT_THAT(answer, StartsWith("ERR ")) << bad.substr(0, 20);
    EXPECT_THAT(answer, bad.size() > 512 ? HasSubstr("hello message too long") : HasSubstr("expected \"HELLO 1"))
        << bad.substr(0, 20);
  }
  EXPECT_EQ(server_->open_sessions(), 0u);
}

TEST_F(SessionServerTest, AClientThatNeverGreetsIsDroppedAfterTheHelloTimeout) {
  Start();
  const int fd = RawConnect();
  // Let the server's thread see the connection, then let 5 s pass on its clock.
  ASSERT_TRUE(Eventually([&] {
    clock_.Advance(absl::Milliseconds(100));
    pollfd p{fd, POLLIN | POLLRDHUP, 0};
    return ::poll(&p, 1, 0) > 0;  // closed by the server
  }));
  EXPECT_EQ(Receive(fd), "");
  ::close(fd);
  EXPECT_EQ(server_->open_sessions(), 0u);
  std::unique_ptr<AgentSession> s = Connect();  // still serving
  EXPECT_NE(s, nullptr);
}

TEST_F(SessionServerTest, AFullTableRefusesNewConnectionsAndKeepsItsSessions) {
  Start(/*max_sessions=*/2);
  std::unique_ptr<AgentSession> one = Connect();
  std::unique_ptr<AgentSession> two = Connect();
  ASSERT_NE(one, nullptr);
  ASSERT_NE(two, nullptr);
  const int fd = RawConnect();  // the kernel accepts it; the server closes it
  EXPECT_EQ(Exchange(fd, "HELLO 1"), "");
  ::close(fd);
  EXPECT_TRUE(server_->Open(one->id()));
  EXPECT_TRUE(server_->Open(two->id()));
  // Room again once a closed session's grace is over.
  const std::string gone = one->id();
  one.reset();
  ASSERT_TRUE(Eventually([&] { return !server_->Open(gone); }));
  clock_.Advance(kGrace);
  ASSERT_TRUE(Eventually([&] { return !Ended().empty(); }));
  std::unique_ptr<AgentSession> three = Connect();
  EXPECT_NE(three, nullptr);
}

TEST_F(SessionServerTest, StopClosesEverySessionWithoutEndingThemAndRemovesTheSocket) {
  Start();
  std::unique_ptr<AgentSession> s = Connect();
  ASSERT_NE(s, nullptr);
  const std::string path = server_->socket_path();
  server_->Stop();
  EXPECT_TRUE(Eventually([&] { return s->Closed(); }));
  EXPECT_TRUE(Ended().empty());  // the leases outlive an agent stop (the next agent re-adopts them)
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
  server_->Stop();  // idempotent
}

TEST_F(SessionServerTest, StartReplacesAStaleSocketAndRefusesAPathTooLong) {
  // A stale socket file of an earlier agent at the path.
  const std::string path = dir_->path() + "/session.sock";
  const int stale = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(stale, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(stale);
  Start();
  EXPECT_NE(Connect(), nullptr);

  SessionServer::Options o;
  o.socket_path = dir_->path() + "/" + std::string(120, 'x');
  absl::StatusOr<std::unique_ptr<SessionServer>> s = SessionServer::Start(o, {}, &clock_, [](const std::string&) {});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("is too long"));
}

}  // namespace
}  // namespace ckpt::agent
