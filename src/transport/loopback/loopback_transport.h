// LoopbackTransport: an in-process Transport for unit tests.
//
// Transports started on "loop:<name>" in one process find each other through
// a process-wide registry. Each has one delivery thread that runs its
// handler's callbacks and its send completions, like a real progress thread,
// so callers see the same asynchrony as with UCX. Payloads are copied from
// the sender's pieces straight into the receiver's pieces. Stop() makes every
// connected peer see OnPeerFailed, as a dead process would.
#pragma once

#include <memory>
#include <string>

#include "transport/transport.h"

namespace ckpt::transport {

std::unique_ptr<Transport> NewLoopbackTransport();

}  // namespace ckpt::transport
