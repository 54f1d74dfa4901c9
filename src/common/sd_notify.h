// systemd readiness notification (sd_notify(3)) for the daemons' Type=notify
// units (deploy/systemd/). Each call is a no-op when the process was not
// started by systemd with NOTIFY_SOCKET set, and when ckpt was built without
// libsystemd (CKPT_HAVE_LIBSYSTEMD undefined): callers need not check.
//
// Thread safety: safe from any thread.
#pragma once

#include <string>

namespace ckpt::sd {

// Whether this build can notify systemd at all (built with libsystemd).
bool Supported();

// READY=1 with a STATUS= line: the daemon is serving.
void NotifyReady(const std::string& status);

// STOPPING=1 with a STATUS= line: the daemon began a clean shutdown.
void NotifyStopping(const std::string& status);

}  // namespace ckpt::sd
