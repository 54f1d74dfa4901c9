#include "common/metrics.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>

namespace ckpt {
namespace {

// Minimal HTTP GET against 127.0.0.1:port; returns the whole response.
std::string HttpGet(int port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "connect failed";
  }
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  (void)!::write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
  ::close(fd);
  return out;
}

TEST(MetricsRegistry, CountersGaugesHistogramsSerialize) {
  MetricsRegistry registry;
  Counter& c = registry.AddCounter("ckpt_test_bytes_total", "Bytes", {{"job", "gpt"}});
  c.Increment(10);
  c.Increment(-5);  // ignored
  EXPECT_EQ(&registry.AddCounter("ckpt_test_bytes_total", "Bytes", {{"job", "gpt"}}), &c);
  Gauge& g = registry.AddGauge("ckpt_test_free_bytes", "Free");
  g.Set(100);
  g.Decrement(30);
  Histogram& h = registry.AddHistogram("ckpt_test_latency_seconds", "Latency", {0.1, 1.0});
  h.Observe(0.05);
  h.Observe(5);
  EXPECT_EQ(c.Value(), 10);
  EXPECT_EQ(g.Value(), 70);
  const std::string text = registry.SerializeText();
  EXPECT_NE(text.find("ckpt_test_bytes_total{job=\"gpt\"} 10"), std::string::npos) << text;
  EXPECT_NE(text.find("ckpt_test_free_bytes 70"), std::string::npos) << text;
  EXPECT_NE(text.find("ckpt_test_latency_seconds_count 2"), std::string::npos) << text;
  EXPECT_NE(text.find("# HELP ckpt_test_free_bytes Free"), std::string::npos);
}

TEST(MetricsServer, ServesMetricsHealthAndReadiness) {
  MetricsRegistry registry;
  registry.AddCounter("ckpt_test_requests_total", "Requests").Increment(3);
  std::atomic<bool> ready{false};
  auto server = MetricsServer::Start("127.0.0.1:0", &registry, [&](std::string* reason) {
    if (!ready) *reason = "not registered with meta";
    return ready.load();
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);

  const std::string metrics = HttpGet(port, "/metrics");
  EXPECT_NE(metrics.find("200 OK"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("ckpt_test_requests_total 3"), std::string::npos) << metrics;

  EXPECT_NE(HttpGet(port, "/healthz").find("200 OK"), std::string::npos);
  const std::string not_ready = HttpGet(port, "/readyz");
  EXPECT_NE(not_ready.find("503"), std::string::npos) << not_ready;
  EXPECT_NE(not_ready.find("not registered with meta"), std::string::npos);
  ready = true;
  EXPECT_NE(HttpGet(port, "/readyz").find("200 OK"), std::string::npos);
  EXPECT_NE(HttpGet(port, "/nope").find("404"), std::string::npos);

  // A second server cannot take the same port.
  auto clash = MetricsServer::Start("127.0.0.1:" + std::to_string(port), &registry);
  EXPECT_EQ(clash.status().code(), absl::StatusCode::kUnavailable);
}

TEST(MetricsServer, RejectsMalformedAddress) {
  MetricsRegistry registry;
  for (const char* bad : {"", "9400", ":9400", "127.0.0.1:", "127.0.0.1:99999", "host:port"}) {
    auto s = MetricsServer::Start(bad, &registry);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace ckpt
