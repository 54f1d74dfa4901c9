// UCX transport throughput: SendChunked of 1 GiB between two transports in
// one process over 127.0.0.1, against a raw TCP socket baseline measured in
// the same run (counter "vs_tcp" = UCX GB/s / raw TCP GB/s).
//
// Buffers are allocated and touched once (this VM hands freed memory back to
// its host, so fresh pages run at ~0.4 GB/s); the first transfer of each
// benchmark is reported apart ("first_GBps") from steady state ("GBps").
// BM_NodeIdentityExchange: the CPU a connection's node-identity handshake
// adds (both sides).
#include <arpa/inet.h>
#include <benchmark/benchmark.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/clock.h"
#include "common/pki.h"
#include "transport/bulk.h"
#include "transport/ucx/node_identity.h"
#include "transport/ucx/ucx_transport.h"

namespace ckpt::transport {
namespace {

constexpr uint64_t kTotal = 1ull << 30;

std::vector<std::byte>& Source() {
  static auto* v = [] {
    auto* b = new std::vector<std::byte>(kTotal);
    for (size_t i = 0; i < b->size(); i += 4096) (*b)[i] = static_cast<std::byte>(i >> 12);
    return b;
  }();
  return *v;
}
std::vector<std::byte>& Dest() {
  static auto* v = new std::vector<std::byte>(kTotal, std::byte{1});
  return *v;
}

double g_tcp_gbps = 0;

// --- raw TCP baseline: one connection, 1 MiB writes and reads ---

double TcpOnce() {
  const int ls = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  listen(ls, 1);
  getsockname(ls, reinterpret_cast<sockaddr*>(&a), &len);
  std::thread reader([ls] {
    const int s = accept(ls, nullptr, nullptr);
    std::byte* d = Dest().data();
    uint64_t got = 0;
    while (got < kTotal) {
      const ssize_t n = read(s, d + got, std::min<uint64_t>(1 << 20, kTotal - got));
      if (n <= 0) break;
      got += n;
    }
    close(s);
  });
  const int c = socket(AF_INET, SOCK_STREAM, 0);
  connect(c, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  const absl::Time start = absl::Now();
  const std::byte* src = Source().data();
  uint64_t sent = 0;
  while (sent < kTotal) {
    const ssize_t n = write(c, src + sent, std::min<uint64_t>(1 << 20, kTotal - sent));
    if (n <= 0) break;
    sent += n;
  }
  close(c);
  reader.join();
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  close(ls);
  return kTotal / secs / 1e9;
}

void BM_RawTcp1GiB(benchmark::State& state) {
  Source();
  Dest();
  const double first = TcpOnce();
  double sum = 0;
  int n = 0;
  for (auto _ : state) {
    const double gbps = TcpOnce();
    state.SetIterationTime(kTotal / gbps / 1e9);
    sum += gbps;
    ++n;
  }
  g_tcp_gbps = sum / n;
  state.SetBytesProcessed(state.iterations() * kTotal);
  state.counters["GBps"] = g_tcp_gbps;
  state.counters["first_GBps"] = first;
}
BENCHMARK(BM_RawTcp1GiB)->Iterations(4)->UseManualTime()->Unit(benchmark::kMillisecond);

// --- UCX transport ---

class ChunkSink : public Handler {
 public:
  absl::StatusOr<MutablePieces> Allocate(const Inbound& msg) override {
    uint64_t offset = 0;
    if (!absl::SimpleAtoi(msg.header, &offset)) return absl::InvalidArgumentError("header");
    return MutablePieces{std::span<std::byte>(Dest()).subspan(offset, msg.payload_bytes)};
  }
  void OnReceived(const Inbound& msg, const absl::Status& s) override {
    absl::MutexLock lock(&mu_);
    if (s.ok()) received_ += msg.payload_bytes;
  }
  void OnPeerFailed(PeerId, const absl::Status&) override {}
  void WaitFor(uint64_t bytes) {
    absl::MutexLock lock(&mu_);
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return received_ >= bytes; };
    mu_.AwaitWithTimeout(absl::Condition(&cond), absl::Seconds(60));
  }

 private:
  absl::Mutex mu_;
  uint64_t received_ ABSL_GUARDED_BY(mu_) = 0;
};

void RunUcx(benchmark::State& state, const UcxOptions& options) {
  ChunkSink sink, unused;
  auto a = NewUcxTransport(options);
  auto b = NewUcxTransport(options);
  if (!a->Start("127.0.0.1:0", &unused).ok() || !b->Start("127.0.0.1:0", &sink).ok()) {
    state.SkipWithError("UCX start failed");
    return;
  }
  auto peer = a->Connect(b->address(), 10000);
  if (!peer.ok()) {
    state.SkipWithError("UCX connect failed");
    return;
  }
  (void)a->RegisterMemory(Source().data(), kTotal);
  (void)b->RegisterMemory(Dest().data(), kTotal);
  BulkOptions opt;
  opt.chunk_bytes = state.range(0) << 20;
  opt.max_in_flight = 4;
  const PeerId p = *peer;
  uint64_t expected = 0;
  auto once = [&]() -> double {
    const absl::Time start = absl::Now();
    auto st = SendChunked(*a, std::span<const PeerId>(&p, 1), 1,
                          ConstPieces{std::span<const std::byte>(Source())}, opt,
                          [](const ChunkInfo& c) { return absl::StrCat(c.offset); }, RealClock());
    expected += kTotal;
    sink.WaitFor(expected);  // received, not just handed over
    if (!st[0].ok()) state.SkipWithError(st[0].ToString().c_str());
    return kTotal / absl::ToDoubleSeconds(absl::Now() - start) / 1e9;
  };
  const double first = once();
  double sum = 0;
  int n = 0;
  for (auto _ : state) {
    const double gbps = once();
    state.SetIterationTime(kTotal / gbps / 1e9);
    sum += gbps;
    ++n;
  }
  state.SetBytesProcessed(state.iterations() * kTotal);
  state.counters["GBps"] = sum / n;
  state.counters["first_GBps"] = first;
  if (g_tcp_gbps > 0) state.counters["vs_tcp"] = sum / n / g_tcp_gbps;
  a->Stop();
  b->Stop();
}

// Default UCX_TLS: in one process UCX picks shared memory after the
// sockaddr wire-up.
void BM_UcxSendChunked1GiB(benchmark::State& state) {
  UcxOptions opt;
  opt.self_check_timeout_ms = 0;  // less socket churn between the two workers
  RunUcx(state, opt);
}
BENCHMARK(BM_UcxSendChunked1GiB)->Arg(8)->Arg(16)->Iterations(4)->UseManualTime()->Unit(benchmark::kMillisecond);

// An idle connected pair: the process's CPU time per second of idling
// ("cpu_ms_per_s"; the progress threads sleep on their fds, so about 0) and
// the progress rounds per second ("slept_per_s", "woken_per_s"). Moved here
// from ucx_transport_test, which counts rounds instead of timing (issue 41).
void BM_UcxIdlePairCpu(benchmark::State& state) {
  ChunkSink sink, unused;
  UcxOptions opt;
  opt.self_check_timeout_ms = 0;
  auto a = NewUcxTransport(opt);
  auto b = NewUcxTransport(opt);
  if (!a->Start("127.0.0.1:0", &unused).ok() || !b->Start("127.0.0.1:0", &sink).ok()) {
    state.SkipWithError("UCX start failed");
    return;
  }
  auto peer = a->Connect(b->address(), 10000);
  if (!peer.ok()) {
    state.SkipWithError("UCX connect failed");
    return;
  }
  a->Send(*peer, 1, "0", {}, [](const absl::Status&) {});
  auto cpu_seconds = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
  };
  double cpu = 0, secs = 0;
  uint64_t slept = 0, woken = 0;
  for (auto _ : state) {
    const UcxTransport::ProgressRounds r0 = a->TEST_progress_rounds();
    const double c0 = cpu_seconds();
    const absl::Time start = absl::Now();
    absl::SleepFor(absl::Seconds(1));
    const double s = absl::ToDoubleSeconds(absl::Now() - start);
    cpu += cpu_seconds() - c0;
    secs += s;
    const UcxTransport::ProgressRounds r1 = a->TEST_progress_rounds();
    slept += r1.slept - r0.slept;
    woken += r1.woken - r0.woken;
    state.SetIterationTime(s);
  }
  state.counters["cpu_ms_per_s"] = cpu * 1e3 / secs;
  state.counters["slept_per_s"] = slept / secs;
  state.counters["woken_per_s"] = woken / secs;
  a->Stop();
  b->Stop();
}
BENCHMARK(BM_UcxIdlePairCpu)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);

// In a forked child: a started transport receiving into Dest(); its address
// and a newline are written to `fd` ("\n" alone if it did not start).
std::unique_ptr<Transport> StartChild(const UcxOptions& options, Handler* sink, int fd) {
  auto b = NewUcxTransport(options);
  std::string address;
  if (b->Start("127.0.0.1:0", sink).ok()) address = b->address();
  (void)b->RegisterMemory(Dest().data(), kTotal);
  address.push_back('\n');
  [[maybe_unused]] ssize_t w = write(fd, address.data(), address.size());
  return b;
}

// Receiver in a forked child: the realistic two-process shape, and the only
// way to run UCX_TLS=tcp here, because with two tcp workers in one process
// UCX 1.13 aborts (async.c:643 `handler->async == async`, socket fds reused
// across workers' async contexts).
void RunUcxForked(benchmark::State& state, const UcxOptions& options) {
  Source();
  Dest();
  int addr_pipe[2], stop_pipe[2];
  if (pipe(addr_pipe) != 0 || pipe(stop_pipe) != 0) {
    state.SkipWithError("pipe failed");
    return;
  }
  const pid_t child = fork();
  if (child == 0) {
    ChunkSink sink;
    auto b = StartChild(options, &sink, addr_pipe[1]);
    char c;
    [[maybe_unused]] ssize_t r = read(stop_pipe[0], &c, 1);
    b->Stop();
    _exit(0);
  }
  char buf[128] = {};
  ssize_t got = 0;
  while (got < static_cast<ssize_t>(sizeof(buf)) - 1) {
    const ssize_t n = read(addr_pipe[0], buf + got, 1);
    if (n <= 0 || buf[got] == '\n') break;
    got += n;
  }
  const std::string address(buf, got);
  auto finish = [&] {
    [[maybe_unused]] ssize_t w = write(stop_pipe[1], "x", 1);
    waitpid(child, nullptr, 0);
    for (int fd : {addr_pipe[0], addr_pipe[1], stop_pipe[0], stop_pipe[1]}) close(fd);
  };
  ChunkSink unused;
  auto a = NewUcxTransport(options);
  absl::StatusOr<PeerId> peer = absl::UnavailableError("not started");
  if (a->Start("127.0.0.1:0", &unused).ok()) peer = a->Connect(address, 10000);
  if (address.empty() || !peer.ok()) {
    state.SkipWithError("UCX start/connect failed");
    a->Stop();
    finish();
    return;
  }
  (void)a->RegisterMemory(Source().data(), kTotal);
  BulkOptions opt;
  opt.chunk_bytes = state.range(0) << 20;
  opt.max_in_flight = 4;
  const PeerId p = *peer;
  // A send completes once the child pulled its bytes (rendezvous).
  auto once = [&]() -> double {
    const absl::Time start = absl::Now();
    auto st = SendChunked(*a, std::span<const PeerId>(&p, 1), 1,
                          ConstPieces{std::span<const std::byte>(Source())}, opt,
                          [](const ChunkInfo& c) { return absl::StrCat(c.offset); }, RealClock());
    if (!st[0].ok()) state.SkipWithError(st[0].ToString().c_str());
    return kTotal / absl::ToDoubleSeconds(absl::Now() - start) / 1e9;
  };
  const double first = once();
  double sum = 0;
  int n = 0;
  for (auto _ : state) {
    const double gbps = once();
    state.SetIterationTime(kTotal / gbps / 1e9);
    sum += gbps;
    ++n;
  }
  state.SetBytesProcessed(state.iterations() * kTotal);
  state.counters["GBps"] = sum / n;
  state.counters["first_GBps"] = first;
  if (g_tcp_gbps > 0) state.counters["vs_tcp"] = sum / n / g_tcp_gbps;
  a->Stop();
  finish();
}

void BM_UcxTwoProcSendChunked1GiB(benchmark::State& state) { RunUcxForked(state, UcxOptions{}); }
BENCHMARK(BM_UcxTwoProcSendChunked1GiB)->Arg(8)->Iterations(4)->UseManualTime()->Unit(benchmark::kMillisecond);

void BM_UcxTwoProcTcpSendChunked1GiB(benchmark::State& state) {
  UcxOptions opt;
  opt.config = {{"TLS", "tcp"}};
  RunUcxForked(state, opt);
}
BENCHMARK(BM_UcxTwoProcTcpSendChunked1GiB)->Arg(8)->Arg(16)->Iterations(4)->UseManualTime()->Unit(benchmark::kMillisecond);

// Data-plane authentication (docs/protocol.md §8b, "Messages"), in one run:
// the two-process UCX_TLS=tcp transfer without a key (nothing
// authenticated), with a key (every message authenticated: a GMAC of each
// payload on both sides, an HMAC of each header) and with a key and
// encrypt_payloads (AES-256-GCM: the sender encrypts into reused buffers,
// the receiver decrypts in place). Args: chunk MiB, mode (0 off, 1 mac,
// 2 encrypt). The sender's time ends when the child has pulled the last
// chunk; with 4 chunks in flight the receiver's checks hold up the pulls
// that follow them, so they are counted too (all but the last chunk's).
void BM_UcxTwoProcTcpAuth1GiB(benchmark::State& state) {
  UcxOptions opt;
  opt.config = {{"TLS", "tcp"}};
  const int64_t mode = state.range(1);
  if (mode >= 1) opt.auth_key = std::string(32, 'k');
  opt.encrypt_payloads = mode == 2;
  state.SetLabel(mode == 0 ? "off" : mode == 1 ? "mac" : "encrypt");
  RunUcxForked(state, opt);
}
BENCHMARK(BM_UcxTwoProcTcpAuth1GiB)
    ->Args({8, 0})
    ->Args({8, 1})
    ->Args({8, 2})
    ->Iterations(4)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// Both ways on one pair (what replicate{2, group} does: partners push to
// each other at once) against the same bytes one way: 512 MiB from the
// parent to a forked child while the child sends 512 MiB back, UCX_TLS=tcp.
// "GBps" counts both directions (1 GiB per run). Arg: chunk MiB.
void BM_UcxTwoProcTcpBothWays1GiB(benchmark::State& state) {
  UcxOptions options;
  options.config = {{"TLS", "tcp"}};
  options.self_check_timeout_ms = 0;
  Source();
  Dest();
  constexpr uint64_t kHalf = kTotal / 2;
  BulkOptions opt;
  opt.chunk_bytes = state.range(0) << 20;
  opt.max_in_flight = 4;
  auto header = [](const ChunkInfo& c) { return absl::StrCat(c.offset); };
  int addr_pipe[2], back_pipe[2], go_pipe[2], done_pipe[2];
  if (pipe(addr_pipe) != 0 || pipe(back_pipe) != 0 || pipe(go_pipe) != 0 || pipe(done_pipe) != 0) {
    state.SkipWithError("pipe failed");
    return;
  }
  auto read_line = [](int fd) {
    std::string s;
    char c;
    while (read(fd, &c, 1) == 1 && c != '\n') s.push_back(c);
    return s;
  };
  const pid_t child = fork();
  if (child == 0) {
    ChunkSink sink;
    auto b = StartChild(options, &sink, addr_pipe[1]);
    (void)b->RegisterMemory(Source().data(), kTotal);
    [[maybe_unused]] ssize_t w = 0;
    absl::StatusOr<PeerId> peer = b->Connect(read_line(back_pipe[0]), 10000);
    char c;
    while (read(go_pipe[0], &c, 1) == 1 && c == 'g') {
      std::vector<absl::Status> st;
      if (peer.ok()) {
        const PeerId p = *peer;
        st = SendChunked(*b, std::span<const PeerId>(&p, 1), 1,
                         ConstPieces{std::span<const std::byte>(Source()).subspan(kHalf, kHalf)}, opt, header,
                         RealClock());
      }
      const char r = peer.ok() && st[0].ok() ? 'k' : 'f';
      w = write(done_pipe[1], &r, 1);
    }
    b->Stop();
    _exit(0);
  }
  const std::string address = read_line(addr_pipe[0]);
  ChunkSink sink;
  auto a = NewUcxTransport(options);
  absl::StatusOr<PeerId> peer = absl::UnavailableError("not started");
  if (a->Start("127.0.0.1:0", &sink).ok()) peer = a->Connect(address, 10000);
  const std::string mine = a->address() + "\n";
  [[maybe_unused]] ssize_t w = write(back_pipe[1], mine.data(), mine.size());
  (void)a->RegisterMemory(Source().data(), kTotal);
  (void)a->RegisterMemory(Dest().data(), kTotal);
  uint64_t expected = 0;
  bool failed = !peer.ok();
  auto once = [&]() -> double {
    const absl::Time start = absl::Now();
    w = write(go_pipe[1], "g", 1);
    const PeerId p = *peer;
    auto st = SendChunked(*a, std::span<const PeerId>(&p, 1), 1,
                          ConstPieces{std::span<const std::byte>(Source()).subspan(0, kHalf)}, opt, header,
                          RealClock());
    char r = 'f';
    [[maybe_unused]] ssize_t n = read(done_pipe[0], &r, 1);
    expected += kHalf;
    sink.WaitFor(expected);
    if (!st[0].ok() || r != 'k') failed = true;
    return kTotal / absl::ToDoubleSeconds(absl::Now() - start) / 1e9;
  };
  double first = 0, sum = 0;
  int n = 0;
  if (!failed) first = once();
  for (auto _ : state) {
    if (failed) break;
    const double gbps = once();
    state.SetIterationTime(kTotal / gbps / 1e9);
    sum += gbps;
    ++n;
  }
  if (failed) state.SkipWithError("UCX start, connect or a send failed");
  w = write(go_pipe[1], "x", 1);
  waitpid(child, nullptr, 0);
  a->Stop();
  for (int* fds : {addr_pipe, back_pipe, go_pipe, done_pipe}) {
    close(fds[0]);
    close(fds[1]);
  }
  if (n == 0) return;
  state.SetBytesProcessed(state.iterations() * kTotal);
  state.counters["GBps"] = sum / n;
  state.counters["first_GBps"] = first;
  if (g_tcp_gbps > 0) state.counters["vs_tcp"] = sum / n / g_tcp_gbps;
}
BENCHMARK(BM_UcxTwoProcTcpBothWays1GiB)->Arg(8)->Iterations(4)->UseManualTime()->Unit(benchmark::kMillisecond);


// --- node identities: what a connection's handshake adds (node_identity.h) ---

// Both sides of one connection's identity exchange, as the handshake runs
// it: a fresh X25519 key each, each certificate checked against the CA,
// one ECDSA signature made and checked by each side, the X25519 agreement.
// It is paid once per connection (agents keep one per peer), never per
// message. A CA and two node certificates are made in a temp dir first.
void BM_NodeIdentityExchange(benchmark::State& state) {
  char tmpl[] = "/tmp/ckpt-bench-pki-XXXXXX";
  const char* dir = mkdtemp(tmpl);
  if (dir == nullptr) {
    state.SkipWithError("mkdtemp failed");
    return;
  }
  const std::string root(dir);
  auto slurp = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
  };
  std::shared_ptr<const NodeCredentials> creds[2];
  bool ok = pki::CreateCa(root + "/ca").ok();
  for (int i = 0; ok && i < 2; ++i) {
    pki::CertOptions o;
    o.identity = pki::Identity(pki::Role::kNode, absl::StrCat("n", i));
    o.hosts = {"127.0.0.1"};
    const std::string prefix = absl::StrCat(root, "/n", i);
    ok = pki::IssueCertificate(root + "/ca", o, prefix).ok();
    if (!ok) break;
    absl::StatusOr<std::shared_ptr<const NodeCredentials>> c = NodeCredentials::FromPem(
        slurp(root + "/ca/ca.pem"), slurp(pki::CertPath(prefix)), slurp(pki::KeyPath(prefix)));
    ok = c.ok();
    if (ok) creds[i] = *c;
  }
  std::filesystem::remove_all(root);
  if (!ok) {
    state.SkipWithError("cannot make the test certificates");
    return;
  }
  for (auto _ : state) {
    auto c = *IdentityExchange::Start(creds[0], false);
    auto a = *IdentityExchange::Start(creds[1], true);
    bool good = a->TakeOffer(c->Offer()).ok();
    IdentityBlock r2 = a->Offer();
    r2.signature = *a->Sign('a', 1, 2, 3, 4);
    good = good && c->TakeOffer(r2).ok() && c->CheckSignature('a', 1, 2, 3, 4, r2.signature).ok();
    const std::string r3 = *c->Sign('c', 1, 2, 3, 4);
    good = good && a->CheckSignature('c', 1, 2, 3, 4, r3).ok();
    absl::StatusOr<std::string> s1 = c->SharedSecret(), s2 = a->SharedSecret();
    if (!good || !s1.ok() || !s2.ok() || *s1 != *s2) {
      state.SkipWithError("the exchange failed");
      return;
    }
    benchmark::DoNotOptimize(s1);
  }
}
BENCHMARK(BM_NodeIdentityExchange)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace ckpt::transport

BENCHMARK_MAIN();
