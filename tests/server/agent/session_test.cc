// Client sessions (issue 13 #4, #5): the agent hands the pool's descriptor
// over its session socket, and a session's leases and handles live exactly as
// long as its connection (plus the grace period), with no ttl and no pid
// look-up. The agent side (SessionServer, Agent) against the client side
// (client::AgentSession); time is a FakeClock, waits on the server's thread
// are bounded.
#include <grp.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "client/session.h"
#include "common/crc32c.h"
#include "common/mem_file_system.h"
#include "fake_meta.h"
#include "server/agent/agent.h"
#include "server/agent/session_server.h"
#include "support/eventually.h"
#include "support/temp_dir.h"

namespace ckpt::agent {
namespace {

using ::testing::HasSubstr;
using ckpt::client::AgentSession;
using ckpt::testing::TempDir;
using ckpt::testing::Eventually;

// Sends raw bytes to a SOCK_SEQPACKET socket and returns the reply ("" if
// the server just closed).
std::string Raw(const std::string& path, const std::string& bytes) {
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  char buf[1024];
  const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
  ::close(fd);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<TempDir>(*TempDir::Create());
    meta_.world["job"] = 1;
    AgentOptions o;
    o.node_id = "node-1";
    o.memory_dir = dir_->path() + "/mem";
    o.memory_bytes = 4 << 20;
    o.populate = false;
    o.session_socket = dir_->path() + "/session.sock";
    o.session_grace_ms = 5000;
    o.default_lease_ttl_ms = 1000;
    o.default_handle_ttl_ms = 1000;
    absl::StatusOr<std::unique_ptr<Agent>> a = Agent::Create(o, &meta_, &clock_, &fs_, &metrics_);
    ASSERT_TRUE(a.ok()) << a.status();
    agent_ = *std::move(a);
    agent_->ControlOnce();
  }

  std::unique_ptr<AgentSession> Connect(const std::string& resume = "") {
    absl::StatusOr<std::unique_ptr<AgentSession>> s =
        AgentSession::Open(agent_->session_socket(), resume, absl::Seconds(10));
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  std::unique_ptr<TempDir> dir_;
  FakeMeta meta_;
  FakeClock clock_;
  MemFileSystem fs_;
  MetricsRegistry metrics_;
  std::unique_ptr<Agent> agent_;
};

TEST_F(SessionTest, TheSessionHandsOverThePoolDescriptor) {
  std::unique_ptr<AgentSession> s = Connect();
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->id().size(), 32u);
  ASSERT_EQ(s->pools().size(), 1u);
  const AgentSession::Pool& pool = s->pools()[0];
  EXPECT_EQ(pool.path, agent_->arena().pool_path());
  EXPECT_EQ(pool.bytes, 4u << 20);
  // The descriptor is the pool itself: a write through it shows in the
  // agent's mapping, without opening any path.
  void* p = ::mmap(nullptr, pool.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, pool.fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  static_cast<char*>(p)[12345] = 'x';
  EXPECT_EQ(static_cast<char>(agent_->arena().Data(12345)[0]), 'x');
  ::munmap(p, pool.bytes);
}

TEST_F(SessionTest, ASessionsLeaseOutlivesAnyTtlAndGoesWithTheSessionAfterTheGrace) {
  std::unique_ptr<AgentSession> s = Connect();
  ASSERT_NE(s, nullptr);
  const uint64_t free0 = agent_->arena().free_bytes();
  absl::StatusOr<LeaseGrant> g =
      agent_->AcquireLease(LeaseRequest{"job", 1, 0, 8192, "run", /*pid of another namespace*/ 999999, 0, s->id(), {}});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->expires_in_ms, 0);  // lives with the session
  // Far past any ttl, while the session is open: still there (a pid that
  // does not exist here means nothing).
  clock_.Advance(absl::Hours(1));
  agent_->ControlOnce();
  EXPECT_EQ(agent_->Status().open_leases, 1u);
  // The client goes away: within the grace period the lease stays...
  const std::string id = s->id();
  s.reset();
  ASSERT_TRUE(Eventually([&] { return !agent_->SessionOpen(id); }));  // the agent saw the hang-up
  EXPECT_EQ(agent_->Status().open_leases, 1u);
  clock_.Advance(absl::Seconds(4));
  agent_->ControlOnce();
  EXPECT_EQ(agent_->Status().open_leases, 1u);
  // ...then it is released and its memory is free again.
  clock_.Advance(absl::Seconds(2));
  EXPECT_TRUE(Eventually([&] {
    agent_->ControlOnce();
    return agent_->Status().open_leases == 0;
  }));
  EXPECT_EQ(agent_->arena().free_bytes(), free0);
  // Without a session the ttl applies as before.
  absl::StatusOr<LeaseGrant> t = agent_->AcquireLease(LeaseRequest{"job", 1, 0, 8192, "run", 0, 0, "", {}});
  ASSERT_TRUE(t.ok());
  clock_.Advance(absl::Seconds(2));
  agent_->ControlOnce();
  EXPECT_EQ(agent_->Status().open_leases, 0u);
}

TEST_F(SessionTest, HandlesLiveWithTheSessionAndAResumedSessionKeepsThem) {
  std::unique_ptr<AgentSession> s = Connect();
  ASSERT_NE(s, nullptr);
  const std::string id = s->id();
  absl::StatusOr<LeaseGrant> g = agent_->AcquireLease(LeaseRequest{"job", 2, 0, 100, "run", 0, 0, id, {}});
  ASSERT_TRUE(g.ok()) << g.status();
  const std::string bytes(100, 'z');
  std::memcpy(agent_->arena().Data(g->regions[0].file_offset), bytes.data(), bytes.size());
  ManifestItem it;
  it.name = "w";
  it.dtype = kDTypeBytes;
  it.length_bytes = 100;
  it.crc32c = Crc32c(bytes);
  // The lease is the session's: committed naming it (without: refused).
  EXPECT_EQ(agent_->Commit(g->lease_id, 100, {it}).status().code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(agent_->Commit(g->lease_id, 100, {it}, nullptr, id).ok());
  OpenRequest open;
  open.id = ShardId{"job", 2, 0};
  open.client = ClientRef{0, id};
  absl::StatusOr<OpenOutcome> h = agent_->Open(open);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->result.expires_in_ms, 0);
  clock_.Advance(absl::Hours(2));  // far past the 1 s handle ttl
  agent_->ControlOnce();
  EXPECT_EQ(agent_->Status().open_handles, 1u);
  // The connection drops and comes back within the grace: same session, the
  // handle is still there.
  s.reset();
  ASSERT_TRUE(Eventually([&] { return !agent_->SessionOpen(id); }));  // the agent saw the hang-up
  std::unique_ptr<AgentSession> again = Connect(id);
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(again->id(), id);
  clock_.Advance(absl::Seconds(30));
  agent_->ControlOnce();
  EXPECT_EQ(agent_->Status().open_handles, 1u);
  // A session nobody opened is refused with a clear error.
  absl::StatusOr<LeaseGrant> bad = agent_->AcquireLease(LeaseRequest{"job", 3, 0, 100, "run", 0, 0, "feedbeef", {}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(bad.status().message(), HasSubstr("reconnect"));
}

TEST_F(SessionTest, GarbageOnTheSessionSocketIsRefusedAndTheAgentLivesOn) {
  const std::string path = agent_->session_socket();
  EXPECT_THAT(Raw(path, std::string(16, '\0')), HasSubstr("ERR"));
  EXPECT_THAT(Raw(path, "HELLO 3"), HasSubstr("ERR"));
  EXPECT_THAT(Raw(path, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), HasSubstr("ERR"));
  std::string big(1 << 16, 'A');
  EXPECT_THAT(Raw(path, big), HasSubstr("ERR"));
  EXPECT_THAT(Raw(path, "HELLO 1 ../../etc/passwd"), HasSubstr("OK"));  // not a session id: a new session
  // Still serving.
  std::unique_ptr<AgentSession> s = Connect();
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->pools().size(), 1u);
}

// Version-2 sessions carry requests (the client's local opens) on their
// connection: answered in order, replies of any size in chunks, the
// handler's errors as "ERR <code>", garbage and oversized requests refused
// with the session kept; version-1 sessions and a server without a handler
// do not offer them.
class SessionRequestTest : public ::testing::Test {
 protected:
  void Start(absl::Duration reply_timeout = absl::Seconds(5)) {
    dir_ = std::make_unique<TempDir>(*TempDir::Create());
    SessionServer::Options o;
    o.socket_path = dir_->path() + "/session.sock";
    o.reply_timeout = reply_timeout;
    absl::StatusOr<std::unique_ptr<SessionServer>> s =
        SessionServer::Start(o, {}, &clock_, [](const std::string&) {});
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }
  // Echoes "echo:<session>:<request>"; "big N" answers N bytes; "fail" is refused.
  void Serve() {
    server_->SetRequestHandler([](const std::string& session, std::string_view kind,
                                  std::string_view req) -> absl::StatusOr<std::string> {
      if (kind != "OPEN") return absl::InvalidArgumentError(absl::StrCat("kind ", std::string(kind)));
      if (req == "fail") return absl::NotFoundError("no such shard\non two lines");
      if (req.substr(0, 4) == "big ") {
        std::string out(std::stoul(std::string(req.substr(4))), '\0');
        for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(i * 131 + 7);
        return out;
      }
      return absl::StrCat("echo:", session, ":", std::string(req));
    });
  }
  std::unique_ptr<AgentSession> Connect() {
    absl::StatusOr<std::unique_ptr<AgentSession>> s = AgentSession::Open(server_->socket_path(), "", absl::Seconds(5));
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }
  // A raw connection greeted with `hello`; its first reply in *reply.
  int RawSession(const std::string& hello, std::string* reply) {
    const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, server_->socket_path().c_str(), sizeof(addr.sun_path) - 1);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    *reply = Exchange(fd, hello);
    return fd;
  }
  static std::string Exchange(int fd, const std::string& m) {
    ::send(fd, m.data(), m.size(), MSG_NOSIGNAL);
    char buf[1024];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  }

  std::unique_ptr<TempDir> dir_;
  FakeClock clock_;
  std::unique_ptr<SessionServer> server_;
};

TEST_F(SessionRequestTest, RequestsAreAnsweredInOrderOfAnySizeAndBadOnesRefusedWithTheSessionKept) {
  Start();
  Serve();
  std::unique_ptr<AgentSession> s = Connect();
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(s->serves_requests());
  EXPECT_EQ(*s->Request("OPEN", "hello", absl::Seconds(5)), absl::StrCat("echo:", s->id(), ":hello"));
  // Replies larger than one message, at and around the chunk size.
  for (size_t n : {size_t{0}, SessionServer::kReplyChunkBytes - 1, SessionServer::kReplyChunkBytes,
                   SessionServer::kReplyChunkBytes + 1, size_t{5} << 20}) {
    absl::StatusOr<std::string> big = s->Request("OPEN", absl::StrCat("big ", n), absl::Seconds(30));
    ASSERT_TRUE(big.ok()) << n << ": " << big.status();
    ASSERT_EQ(big->size(), n);
    for (size_t i = 0; i < n; i += 4099) ASSERT_EQ((*big)[i], static_cast<char>(i * 131 + 7)) << i;
  }
  absl::StatusOr<std::string> refused = s->Request("OPEN", "fail", absl::Seconds(5));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(refused.status().message(), HasSubstr("no such shard"));
  EXPECT_FALSE(s->Closed());
  EXPECT_EQ(*s->Request("OPEN", "again", absl::Seconds(5)), absl::StrCat("echo:", s->id(), ":again"));
  // Garbage and oversized requests on a raw version-2 connection.
  std::string hello;
  const int fd = RawSession("HELLO 2", &hello);
  EXPECT_THAT(hello, HasSubstr(" open\n"));
  EXPECT_THAT(Exchange(fd, std::string(16, '\0')), HasSubstr("ERR 3 unknown session request"));
  EXPECT_THAT(Exchange(fd, "OPENX\nabc"), HasSubstr("ERR 3 unknown session request"));
  EXPECT_THAT(Exchange(fd, "LEASE\nabc"), HasSubstr("ERR 3 kind LEASE"));  // the handler's refusal
  EXPECT_THAT(Exchange(fd, "OPEN\n" + std::string(SessionServer::kMaxRequestBytes, 'x')),
              HasSubstr("ERR 3 a session request is at most"));
  EXPECT_THAT(Exchange(fd, "OPEN\nraw"), HasSubstr("OK "));
  ::close(fd);
  // Version 1 is not offered requests.
  const int v1 = RawSession("HELLO 1", &hello);
  EXPECT_THAT(hello, ::testing::Not(HasSubstr("open")));
  ::close(v1);
  EXPECT_EQ(*s->Request("OPEN", "still", absl::Seconds(5)), absl::StrCat("echo:", s->id(), ":still"));
  // Without a handler (or once it is cleared) a version-2 hello gets a
  // session without requests.
  server_->SetRequestHandler(nullptr);
  std::unique_ptr<AgentSession> plain = Connect();
  ASSERT_NE(plain, nullptr);
  EXPECT_FALSE(plain->serves_requests());
  EXPECT_EQ(plain->Request("OPEN", "x", absl::Seconds(1)).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(SessionRequestTest, AClientThatDoesNotTakeItsReplyLosesItsConnectionNotTheOthers) {
  Start(absl::Milliseconds(300));
  Serve();
  std::string hello;
  const int fd = RawSession("HELLO 2", &hello);
  ASSERT_THAT(hello, HasSubstr("OK "));
  const std::string id = hello.substr(3, hello.find(' ', 3) - 3);
  const std::string req = "OPEN\nbig " + std::to_string(size_t{16} << 20);
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  // Never read: the server gives up on the reply and ends the connection.
  ASSERT_TRUE(Eventually([&] { return !server_->Open(id); }));
  std::unique_ptr<AgentSession> other = Connect();
  ASSERT_NE(other, nullptr);
  EXPECT_EQ(*other->Request("OPEN", "fine", absl::Seconds(5)), absl::StrCat("echo:", other->id(), ":fine"));
  ::close(fd);
}

// An agent from before session requests refuses "HELLO 2" (it took only
// "HELLO 1"): the client greets it again with version 1 and asks nothing on
// that session (gRPC for everything). The old agent is a stand-in thread.
TEST(SessionFallbackTest, AnOlderAgentIsGreetedAgainWithVersion1) {
  absl::StatusOr<TempDir> dir = TempDir::Create();
  ASSERT_TRUE(dir.ok());
  const std::string path = dir->path() + "/session.sock";
  const int l = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(l, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(l, 4), 0);
  std::vector<std::string> hellos;
  std::vector<int> kept;
  std::thread old([&] {
    for (int i = 0; i < 2; ++i) {
      pollfd p{l, POLLIN, 0};
      if (::poll(&p, 1, 10000) <= 0) return;  // bounded: the client connects twice
      const int c = ::accept(l, nullptr, nullptr);
      char buf[512];
      const ssize_t n = ::recv(c, buf, sizeof(buf), 0);
      hellos.emplace_back(buf, static_cast<size_t>(std::max<ssize_t>(n, 0)));
      const bool v1 = hellos.back().rfind("HELLO 1", 0) == 0;
      const std::string reply = v1 ? "OK 0123abcd 0\n" : "ERR expected \"HELLO 1 [session-id]\"\n";
      ::send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
      if (v1) {
        kept.push_back(c);
      } else {
        ::close(c);
      }
    }
  });
  absl::StatusOr<std::unique_ptr<AgentSession>> s = AgentSession::Open(path, "", absl::Seconds(5));
  old.join();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->id(), "0123abcd");
  EXPECT_FALSE((*s)->serves_requests());
  EXPECT_EQ((*s)->Request("OPEN", "x", absl::Seconds(1)).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(hellos, ::testing::ElementsAre("HELLO 2", "HELLO 1"));
  for (int c : kept) ::close(c);
  ::close(l);
}

// --socket-group (issue 17): the session server asks the kernel who is
// connecting (SO_PEERCRED, SO_PEERGROUPS) and serves only the group's
// members, root and its own user. Each client is a forked child that drops to
// uid 4343 with the given groups; the socket is made 0666 so that the check,
// not the file mode, is what refuses. Needs root (to change uid): skipped
// otherwise.
class SocketGroupTest : public ::testing::Test {
 protected:
  static constexpr gid_t kGroup = 4242;
  static constexpr uid_t kUser = 4343;

  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to connect as other users";
    dir_ = std::make_unique<TempDir>(*TempDir::Create());
    ::chmod(dir_->path().c_str(), 0755);
    SessionServer::Options o;
    o.socket_path = dir_->path() + "/session.sock";
    o.allowed_gid = kGroup;
    absl::StatusOr<std::unique_ptr<SessionServer>> s =
        SessionServer::Start(o, {}, &clock_, [](const std::string&) {});
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    ::chmod(server_->socket_path().c_str(), 0666);
  }

  // The agent's answer to "HELLO 1" from a process with these credentials.
  std::string HelloAs(gid_t gid, std::vector<gid_t> groups) {
    int out[2];
    EXPECT_EQ(::pipe(out), 0);
    const std::string path = server_->socket_path();
    const pid_t child = ::fork();
    if (child == 0) {
      ::close(out[0]);
      char reply[512] = "child could not drop to the test user";
      ssize_t n = static_cast<ssize_t>(std::strlen(reply));
      if (::setgroups(groups.size(), groups.data()) == 0 && ::setgid(gid) == 0 && ::setuid(kUser) == 0) {
        const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
        n = 0;
        if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
            ::send(fd, "HELLO 1", 7, MSG_NOSIGNAL) == 7) {
          n = ::recv(fd, reply, sizeof(reply), 0);
        }
      }
      if (n > 0) [[maybe_unused]] ssize_t w = ::write(out[1], reply, static_cast<size_t>(n));
      ::_exit(0);
    }
    ::close(out[1]);
    std::string got;
    char buf[512];
    ssize_t n;
    while ((n = ::read(out[0], buf, sizeof(buf))) > 0) got.append(buf, static_cast<size_t>(n));
    ::close(out[0]);
    ::waitpid(child, nullptr, 0);
    return got;
  }

  std::unique_ptr<TempDir> dir_;
  FakeClock clock_;
  std::unique_ptr<SessionServer> server_;
};

TEST_F(SocketGroupTest, TheSocketBelongsToTheGroup) {
  struct stat st {};
  ASSERT_EQ(::stat(server_->socket_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_gid, kGroup);
}

TEST_F(SocketGroupTest, MembersByPrimaryOrSupplementaryGroupGetASession) {
  EXPECT_THAT(HelloAs(kGroup, {}), ::testing::StartsWith("OK "));
  EXPECT_THAT(HelloAs(kUser, {kUser, kGroup}), ::testing::StartsWith("OK "));
  // Root (this process) too.
  EXPECT_THAT(Raw(server_->socket_path(), "HELLO 1"), ::testing::StartsWith("OK "));
}

TEST_F(SocketGroupTest, OthersAreRefusedWithTheirCredentialsNamed) {
  const std::string reply = HelloAs(kUser, {kUser, 4444});
  EXPECT_THAT(reply, ::testing::StartsWith("ERR "));
  EXPECT_THAT(reply, HasSubstr("uid 4343 gid 4343"));
  EXPECT_THAT(reply, HasSubstr("not in the agent's socket group 4242"));
  EXPECT_EQ(server_->open_sessions(), 0u);
  // The server goes on serving members.
  EXPECT_THAT(HelloAs(kGroup, {}), ::testing::StartsWith("OK "));
}

TEST(SocketGroup, StartFailsClearlyWhenTheSocketCannotBeGivenToTheGroup) {
  if (::geteuid() == 0) GTEST_SKIP() << "root may chown to any group";
  TempDir dir = *TempDir::Create();
  SessionServer::Options o;
  o.socket_path = dir.path() + "/session.sock";
  o.allowed_gid = 4242;  // not a group of this user
  FakeClock clock;
  absl::StatusOr<std::unique_ptr<SessionServer>> s = SessionServer::Start(o, {}, &clock, [](const std::string&) {});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.status().message(), HasSubstr("group 4242"));
}

}  // namespace
}  // namespace ckpt::agent
