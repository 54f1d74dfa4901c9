// Pieces every ckpt daemon's main() shares: listen-address validation, a
// stop request, a periodic named thread, and a signal thread that turns the
// first SIGTERM/SIGINT into a stop request (a second one exits at once).
//
// Thread safety: StopRequest is safe from any thread; PeriodicThread and
// SignalThread are owned by main() and stopped (joined) there.
#pragma once

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/log.h"

namespace ckpt::daemon {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// "host:port" with a non-empty host (name, IPv4, or [IPv6]) and a decimal
// port 0..65535 (0: any free port).
absl::Status ValidateHostPort(const std::string& key, const std::string& value);

// Meta's address: one "host:port", or the replicas' addresses as a list of
// IP literals "10.0.0.1:7400,10.0.0.2:7400" (GrpcTargetOf in
// common/grpc_security.h; a DNS name with several addresses goes alone).
absl::Status ValidateMetaAddresses(const std::string& key, const std::string& value);

// Sets up logging for `program`, then blocks SIGTERM and SIGINT in this thread
// (call it before any thread exists, so every thread inherits the mask and
// only SignalThread's sigwait() receives them). Returns the exit code to use
// if it failed (kExitUsage for logging, kExitFailure for signals) after
// printing why, or kExitOk with `signals` filled.
int InitLoggingAndSignals(const char* program, const log::Options& log_options, sigset_t* signals);

// The daemon's layered configuration: `config_file` (may be empty), then the
// CKPT_* environment variables that spell a config key, then `flags` (only
// those the user set). Unknown keys are errors where the user wrote them for
// this daemon (its file and its command line); other CKPT_* variables belong
// to other ckpt tools and are ignored.
absl::StatusOr<Config> LoadDaemonConfig(const std::string& config_file,
                                        const std::map<std::string, std::string>& flags,
                                        const std::set<std::string>& known_keys);

inline std::string HostOf(const std::string& address) { return address.substr(0, address.rfind(':')); }

// The address peers should dial for a listen address: a wildcard host
// (0.0.0.0, [::], *) is replaced by `advertise_host` if given, else by this
// machine's first non-loopback IPv4 address that is up; other addresses are
// returned as they are. FailedPrecondition if a wildcard cannot be resolved.
absl::StatusOr<std::string> AdvertisedAddress(const std::string& listen, const std::string& advertise_host);

inline void NameThisThread(const char* name) {
  // Linux limits thread names to 15 bytes; ours fit.
  pthread_setname_np(pthread_self(), name);
}

// Why and how the process stops. The first reason is kept; a failure exit
// code wins over a clean one.
class StopRequest {
 public:
  void Request(int exit_code, std::string reason) {
    absl::MutexLock lock(&mu_);
    exit_code_ = std::max(exit_code_, exit_code);
    if (!requested_) reason_ = std::move(reason);
    requested_ = true;
  }
  bool requested() {
    absl::MutexLock lock(&mu_);
    return requested_;
  }
  // Blocks until Request() was called.
  void Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&requested_));
  }
  int exit_code() {
    absl::MutexLock lock(&mu_);
    return exit_code_;
  }
  std::string reason() {
    absl::MutexLock lock(&mu_);
    return reason_;
  }

 private:
  absl::Mutex mu_;
  bool requested_ ABSL_GUARDED_BY(mu_) = false;
  int exit_code_ ABSL_GUARDED_BY(mu_) = kExitOk;
  std::string reason_ ABSL_GUARDED_BY(mu_);
};

// A named thread that runs `fn` now and then every `interval` until Stop().
class PeriodicThread {
 public:
  PeriodicThread(const char* name, absl::Duration interval, std::function<void()> fn)
      : name_(name), interval_(interval), fn_(std::move(fn)) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~PeriodicThread() { Stop(); }
  PeriodicThread(const PeriodicThread&) = delete;
  PeriodicThread& operator=(const PeriodicThread&) = delete;

  // Asks the loop to end, waits for a run in progress, joins. Idempotent.
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Loop() {
    NameThisThread(name_);
    for (;;) {
      fn_();
      absl::MutexLock lock(&mu_);
      RealClock()->AwaitWithTimeout(&mu_, absl::Condition(&stop_), interval_);
      if (stop_) return;
    }
  }

  const char* const name_;
  const absl::Duration interval_;
  const std::function<void()> fn_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Waits for SIGTERM/SIGINT (which every thread blocks) and turns the first
// into a stop request; a second one exits at once. Stop() wakes and joins it.
class SignalThread {
 public:
  SignalThread(const char* program, const char* thread_name, const sigset_t& signals, StopRequest* stop)
      : program_(program), thread_name_(thread_name), signals_(signals), stop_(stop) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~SignalThread() { Stop(); }
  SignalThread(const SignalThread&) = delete;
  SignalThread& operator=(const SignalThread&) = delete;

  void Stop() {
    if (!thread_.joinable()) return;
    quit_.store(true);
    // A thread-directed SIGTERM, consumed by its sigwait(): wakes it up.
    pthread_kill(thread_.native_handle(), SIGTERM);
    thread_.join();
  }

 private:
  void Loop() {
    NameThisThread(thread_name_);
    bool stopping = false;
    for (;;) {
      int sig = 0;
      if (sigwait(&signals_, &sig) != 0) continue;
      if (quit_.load()) return;
      if (stopping) {
        log::Error("{}: second SIG{} during shutdown; exiting at once", program_, sigabbrev_np(sig));
        log::Flush();
        std::_Exit(kExitFailure);
      }
      stopping = true;
      log::Info("{}: received SIG{}; shutting down (send it again to exit at once)", program_,
                sigabbrev_np(sig));
      stop_->Request(kExitOk, absl::StrCat("SIG", sigabbrev_np(sig)));
    }
  }

  const char* const program_;
  const char* const thread_name_;
  const sigset_t signals_;
  StopRequest* const stop_;
  std::atomic<bool> quit_{false};
  std::thread thread_;
};

}  // namespace ckpt::daemon
