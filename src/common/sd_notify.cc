#include "common/sd_notify.h"

#include <string>

#if defined(CKPT_HAVE_LIBSYSTEMD)
#include <systemd/sd-daemon.h>
#endif

namespace ckpt::sd {
namespace {

void Send([[maybe_unused]] const std::string& state, [[maybe_unused]] const std::string& status) {
#if defined(CKPT_HAVE_LIBSYSTEMD)
  std::string message = state;
  if (!status.empty()) {
    // STATUS is one line.
    std::string line = status;
    for (char& c : line) {
      if (c == '\n') c = ' ';
    }
    message += "\nSTATUS=" + line;
  }
  // unset_environment=0: children (none today) may notify too. A negative
  // result (no socket, send failed) is not an error for the daemon.
  (void)sd_notify(0, message.c_str());
#endif
}

}  // namespace

bool Supported() {
#if defined(CKPT_HAVE_LIBSYSTEMD)
  return true;
#else
  return false;
#endif
}

void NotifyReady(const std::string& status) { Send("READY=1", status); }

void NotifyStopping(const std::string& status) { Send("STOPPING=1", status); }

}  // namespace ckpt::sd
