#include "common/metrics.h"

#include <civetweb.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace ckpt {

void Counter::Increment(double v) {
  if (v >= 0) impl_->Increment(v);
}
double Counter::Value() const { return impl_->Value(); }
void Gauge::Set(double v) { impl_->Set(v); }
void Gauge::Increment(double v) { impl_->Increment(v); }
void Gauge::Decrement(double v) { impl_->Decrement(v); }
double Gauge::Value() const { return impl_->Value(); }
void Histogram::Observe(double v) { impl_->Observe(v); }

struct MetricsRegistry::Impl {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::mutex mu;
  // Wrappers are kept here so references handed out stay valid.
  std::map<void*, std::unique_ptr<Counter>> counters;
  std::map<void*, std::unique_ptr<Gauge>> gauges;
  std::map<void*, std::unique_ptr<Histogram>> histograms;
};

MetricsRegistry::MetricsRegistry() : impl_(std::make_unique<Impl>()) {}
MetricsRegistry::~MetricsRegistry() = default;

namespace {
[[noreturn]] void DieOnMisuse(const std::string& name, const std::exception& e) {
  std::fprintf(stderr, "ckpt: invalid metric '%s': %s\n", name.c_str(), e.what());
  std::abort();
}

template <typename Wrapper, typename Raw>
Wrapper& Wrap(std::map<void*, std::unique_ptr<Wrapper>>& map, Raw* raw) {
  auto& slot = map[raw];
  if (!slot) slot = std::make_unique<Wrapper>(raw);
  return *slot;
}
}  // namespace

Counter& MetricsRegistry::AddCounter(const std::string& name, const std::string& help,
                                     const MetricLabels& labels) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  try {
    auto& family = prometheus::BuildCounter().Name(name).Help(help).Register(*impl_->registry);
    return Wrap(impl_->counters, &family.Add(labels));
  } catch (const std::exception& e) {
    DieOnMisuse(name, e);
  }
}

Gauge& MetricsRegistry::AddGauge(const std::string& name, const std::string& help,
                                 const MetricLabels& labels) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  try {
    auto& family = prometheus::BuildGauge().Name(name).Help(help).Register(*impl_->registry);
    return Wrap(impl_->gauges, &family.Add(labels));
  } catch (const std::exception& e) {
    DieOnMisuse(name, e);
  }
}

Histogram& MetricsRegistry::AddHistogram(const std::string& name, const std::string& help,
                                         const std::vector<double>& bucket_bounds,
                                         const MetricLabels& labels) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  try {
    auto& family = prometheus::BuildHistogram().Name(name).Help(help).Register(*impl_->registry);
    return Wrap(impl_->histograms, &family.Add(labels, bucket_bounds));
  } catch (const std::exception& e) {
    DieOnMisuse(name, e);
  }
}

std::string MetricsRegistry::SerializeText() const {
  prometheus::TextSerializer serializer;
  return serializer.Serialize(impl_->registry->Collect());
}

// ---------------------------------------------------------------------------

struct MetricsServer::Impl {
  mg_context* ctx = nullptr;
  MetricsRegistry* registry = nullptr;
  std::mutex mu;
  MetricsServer::ReadinessCheck ready;
};

namespace {

int Reply(mg_connection* conn, int code, const char* status, const std::string& content_type,
          const std::string& body) {
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
            "Connection: close\r\n\r\n",
            code, status, content_type.c_str(), body.size());
  mg_write(conn, body.data(), body.size());
  return code;
}

bool IsGet(mg_connection* conn) {
  const mg_request_info* info = mg_get_request_info(conn);
  return info != nullptr && info->request_method != nullptr &&
         (std::string(info->request_method) == "GET" || std::string(info->request_method) == "HEAD");
}

int HandleMetrics(mg_connection* conn, void* data) {
  auto* impl = static_cast<MetricsServer::Impl*>(data);
  if (!IsGet(conn)) return Reply(conn, 405, "Method Not Allowed", "text/plain", "use GET\n");
  return Reply(conn, 200, "OK", "text/plain; version=0.0.4; charset=utf-8",
               impl->registry->SerializeText());
}

int HandleHealth(mg_connection* conn, void*) {
  return Reply(conn, 200, "OK", "text/plain", "ok\n");
}

int HandleReady(mg_connection* conn, void* data) {
  auto* impl = static_cast<MetricsServer::Impl*>(data);
  MetricsServer::ReadinessCheck ready;
  {
    std::lock_guard<std::mutex> lock(impl->mu);
    ready = impl->ready;
  }
  std::string reason;
  if (!ready || ready(&reason)) return Reply(conn, 200, "OK", "text/plain", "ready\n");
  return Reply(conn, 503, "Service Unavailable", "text/plain", absl::StrCat("not ready: ", reason, "\n"));
}

}  // namespace

MetricsServer::MetricsServer() : impl_(std::make_unique<Impl>()) {}

MetricsServer::~MetricsServer() {
  if (impl_->ctx != nullptr) mg_stop(impl_->ctx);
}

void MetricsServer::SetReadinessCheck(ReadinessCheck ready) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->ready = std::move(ready);
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& listen,
                                                                    MetricsRegistry* registry,
                                                                    ReadinessCheck ready) {
  const size_t colon = listen.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(absl::string_view(listen).substr(colon + 1), &port) || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics listen address '", listen, "' is invalid: expected HOST:PORT, e.g. 127.0.0.1:9400"));
  }
  static std::once_flag init_once;
  std::call_once(init_once, [] { mg_init_library(0); });

  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->impl_->registry = registry;
  server->impl_->ready = std::move(ready);
  const std::string ports = listen;  // civetweb accepts "host:port"
  const char* options[] = {"listening_ports", ports.c_str(), "num_threads", "2",
                           "request_timeout_ms", "10000", nullptr};
  mg_callbacks callbacks{};
  server->impl_->ctx = mg_start(&callbacks, nullptr, options);
  if (server->impl_->ctx == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", listen, ": address in use or not local"));
  }
  mg_set_request_handler(server->impl_->ctx, "/metrics$", HandleMetrics, server->impl_.get());
  mg_set_request_handler(server->impl_->ctx, "/healthz$", HandleHealth, server->impl_.get());
  mg_set_request_handler(server->impl_->ctx, "/readyz$", HandleReady, server->impl_.get());
  mg_server_port bound[4];
  const int n = mg_get_server_ports(server->impl_->ctx, 4, bound);
  if (n < 1) {
    return absl::InternalError(absl::StrCat("metrics server on ", listen, " reports no port"));
  }
  server->port_ = bound[0].port;
  log::Info("metrics on http://{}:{}/metrics", listen.substr(0, colon), server->port_);
  return server;
}

}  // namespace ckpt
