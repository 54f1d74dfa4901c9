// Metrics: a Prometheus registry with typed handles, and the HTTP endpoint every
// daemon serves (/metrics, plus /healthz and /readyz for orchestrators).
//
//   MetricsRegistry registry;
//   Counter& staged = registry.AddCounter("ckpt_agent_staged_bytes_total",
//                                         "Bytes committed by local clients");
//   staged.Increment(n);
//   CKPT_ASSIGN_OR_RETURN(auto server, MetricsServer::Start("127.0.0.1:9401", &registry));
//
// Names follow Prometheus conventions: ckpt_<component>_<what>_<unit>[_total].
// prometheus-cpp and civetweb stay inside metrics.cc.
//
// Thread safety: metric handles and the registry may be used from any thread.
// Handles returned by Add*() live as long as the registry.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace prometheus {
class Registry;
class Counter;
class Gauge;
class Histogram;
}  // namespace prometheus

namespace ckpt {

using MetricLabels = std::map<std::string, std::string>;

class Counter {
 public:
  explicit Counter(prometheus::Counter* impl) : impl_(impl) {}
  // Adds `v` (must be >= 0; negative values are ignored).
  void Increment(double v = 1.0);
  double Value() const;

 private:
  prometheus::Counter* impl_;
};

class Gauge {
 public:
  explicit Gauge(prometheus::Gauge* impl) : impl_(impl) {}
  void Set(double v);
  void Increment(double v = 1.0);
  void Decrement(double v = 1.0);
  double Value() const;

 private:
  prometheus::Gauge* impl_;
};

class Histogram {
 public:
  explicit Histogram(prometheus::Histogram* impl) : impl_(impl) {}
  void Observe(double v);

 private:
  prometheus::Histogram* impl_;
};

class MetricsRegistry {
 public:
  MetricsRegistry();
  ~MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Returns the metric with this name and labels, creating it (and its family,
  // with `help`) on first use. Calling again with the same name and labels
  // returns the same handle. Aborts on a name that is not a valid Prometheus
  // metric name or that is already used by a metric of another type: both are
  // programming errors, not runtime conditions.
  Counter& AddCounter(const std::string& name, const std::string& help,
                      const MetricLabels& labels = {});
  Gauge& AddGauge(const std::string& name, const std::string& help,
                  const MetricLabels& labels = {});
  // `bucket_bounds`: upper bounds, ascending (e.g. seconds: 0.001, 0.01, ...).
  Histogram& AddHistogram(const std::string& name, const std::string& help,
                          const std::vector<double>& bucket_bounds,
                          const MetricLabels& labels = {});

  // The current values in the Prometheus text exposition format (0.0.4).
  std::string SerializeText() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A small HTTP server: GET /metrics (the registry, text format), GET /healthz
// (200 "ok" while the process serves), GET /readyz (200 "ready" when the
// readiness callback returns true, else 503 with its reason). One per daemon.
class MetricsServer {
 public:
  // Returns true when ready; otherwise sets *reason.
  using ReadinessCheck = std::function<bool(std::string* reason)>;

  // Starts listening on `listen` ("host:port"; port 0 picks a free port, see
  // port()). Fails with InvalidArgument for a malformed address and
  // Unavailable when the port cannot be bound. `registry` must outlive the
  // server. Without `ready`, /readyz always answers ready.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& listen,
                                                              MetricsRegistry* registry,
                                                              ReadinessCheck ready = nullptr);
  // Stops serving; blocks until in-flight requests finish.
  ~MetricsServer();

  // The bound TCP port.
  int port() const { return port_; }

  // Replaces the readiness check (thread-safe).
  void SetReadinessCheck(ReadinessCheck ready);

  struct Impl;  // implementation detail (metrics.cc)

 private:
  MetricsServer();
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace ckpt
