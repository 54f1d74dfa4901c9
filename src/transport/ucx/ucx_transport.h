// UcxTransport: the Transport over UCX active messages (transport.h).
//
// One ucp_context, one ucp_worker (UCS_THREAD_MODE_SINGLE) and one progress
// thread that alone touches UCX. The thread sleeps on the worker's event fd
// and on an eventfd that other threads write after queueing a command (Send,
// Connect, Disconnect, RegisterMemory, Stop), so an idle transport costs no CPU.
//
// Wire format of a message: one active message (id 0) whose AM header is
// [uint16 type, little-endian][application header] and whose data is the
// payload (an IOV when the sender has several pieces). Payloads larger than
// UcxOptions::rndv_threshold_bytes are forced to rendezvous, so the receiver
// pulls them straight into the pieces that Handler::Allocate returned; smaller
// ones arrive eagerly and are copied once. Every send carries
// UCP_AM_SEND_FLAG_REPLY so the receiver learns the endpoint it came on and
// maps it to the PeerId of that connection (inbound connections get PeerIds
// when they are accepted, so Send(msg.from, ...) replies on them).
// RMA (ucp_put/get) is never used: UCX emulates it in software over TCP.
//
// Connecting: ucp_ep_create on the peer's sockaddr with error handling mode
// PEER. Connect returns once the server, on accepting, has sent a one-off
// hello (AM id 1) back over the new endpoint: nothing is queued on the
// client's endpoint before that, because UCX 1.13 aborts (wireup_ep.c:494)
// when a request is pending on an endpoint whose connection is refused.
// A failed peer (error callback) gets Handler::OnPeerFailed(Unavailable) and
// its sends in flight complete with Unavailable; Disconnect and Stop
// force-close endpoints and their sends complete with Cancelled.
//
// Known UCX 1.13 limitation: with two workers (two UcxTransports) in one
// process, socket churn can hit an abort in UCX's async layer (async.c:643,
// socket fds reused across workers). One transport per process, as the
// agents run, is not affected; in-process tests keep churn low.
//
// UCX_* environment variables (UCX_TLS, UCX_NET_DEVICES, ...) pass through;
// UcxOptions::config overrides them for this transport only.
//
// Thread safety: as transport.h. Connect and RegisterMemory block on the
// progress thread and so must not be called from a Handler callback. Stop()
// from a callback only asks the thread to end (it cannot join itself); the
// destructor, run on another thread, joins it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/transport.h"

namespace ckpt::transport {

struct UcxOptions {
  // Payloads above this many bytes use rendezvous (zero-copy into the
  // receiver's pieces); at or below it, eager copies.
  uint64_t rndv_threshold_bytes = 64 << 10;
  // How long Stop() lets UCX close endpoints before giving up on them.
  int64_t stop_timeout_ms = 2000;
  // Start() connects to a private listener on 127.0.0.1 to prove UCX has a
  // transport that can carry messages (a bad UCX_TLS otherwise only shows as
  // Connect timeouts). 0 skips the check.
  int64_t self_check_timeout_ms = 5000;
  // UCX configuration overrides, e.g. {"TLS", "tcp"} (names without "UCX_").
  std::vector<std::pair<std::string, std::string>> config;
};

// A new, not yet started, UCX transport. Start() fails with Unavailable and
// UCX's reason if UCX cannot initialise, find a usable transport (the
// self-check), or listen; InvalidArgument for a bad address or UCX option.
// RegisterMemory blocks until the progress thread has mapped the range with
// ucp_mem_map (mappings live until Stop); a failure is logged and returned
// as Unavailable, and callers may treat it as non-fatal: sends work without
// it. Over TCP/shared memory mapping registers nothing and is cheap.
std::unique_ptr<Transport> NewUcxTransport(const UcxOptions& options = {});

}  // namespace ckpt::transport
