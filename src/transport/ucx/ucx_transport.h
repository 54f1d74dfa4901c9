// UcxTransport: the Transport over UCX active messages (transport.h).
//
// One ucp_context, one ucp_worker (UCS_THREAD_MODE_SINGLE) and one progress
// thread that alone touches UCX and the transport's sockets. The thread
// sleeps in poll() on the worker's event fd, an eventfd that other threads
// write after queueing a command (Send, Connect, Disconnect, RegisterMemory,
// Stop), the data port and the handshake / liveness sockets, so an idle
// transport costs no CPU.
//
// Connecting (docs/protocol.md §8b): UCX never listens for ckpt. The data
// port (Start's listen address, what address() returns and peers Connect
// to) is a plain TCP socket of our own that speaks only the handshake of
// handshake.h: the two sides swap greeting records (PeerIds, nonces and
// their UCX worker addresses; with a key, each proves it before it names its
// worker address); the connecting side then opens a UCX endpoint to the accepting worker's
// address and sends a hello active message; the accepting side, on that
// hello, opens its endpoint back (UCX pairs the two when it can) and answers
// ready, which completes Connect. Bytes that are not a Greeting are refused
// at the first wrong byte (logged at most once a second) and never reach
// UCX, and a connection that does not finish the handshake within
// UcxOptions::handshake_timeout_ms is closed. This replaces UCX's sockaddr
// connection manager, whose TCP listener aborts the process on malformed
// input (UCX 1.13, tcp_sockcm_ep.c:825).
//
// The TCP connection stays open, idle, as the pair's liveness channel: a
// side that fails or disconnects the peer closes it, and a process that dies
// has it closed by the kernel, so the other side learns at once (TCP
// keepalive covers a vanished host); UCX's own error handling (mode PEER)
// reports endpoint failures too. Either way the handler gets OnPeerFailed
// once, for inbound connections as well.
//
// Still exposed: UCX's TCP transport (uct tcp) listens on an ephemeral port
// per network device UCX uses, for worker-to-worker connections. It drops
// connections that do not start with UCX's 8-byte magic number, so garbage
// cannot hurt it, but a client that speaks UCX's own protocol can still make
// UCX 1.13 abort (e.g. tcp_ep.c:1404). When the listen address is a loopback
// address and UCX_NET_DEVICES is not set, UCX is limited to the loopback
// interface; otherwise set UCX_NET_DEVICES to the data network's devices.
//
// Wire format of a message: one active message (id 0) whose AM header is
// [uint64 receiver's PeerId][uint16 type][application header], little-endian,
// and whose data is the payload (an IOV when the sender has several pieces).
// Connection ids are random 64-bit numbers (never 0), so nobody can guess
// another connection's. The receiver maps the id to the connection, and
// accepts the message only if it came on the UCX endpoint that the
// connection's handshake completed on (every message is sent with
// UCP_AM_SEND_FLAG_REPLY, so UCX tells the receiver its endpoint back to the
// sender): a message naming a connection on any other endpoint is dropped
// and logged (at most once a second). Payloads larger than UcxOptions::rndv_threshold_bytes are
// forced to rendezvous, so the receiver pulls them straight into the pieces
// that Handler::Allocate returned; smaller ones arrive eagerly and are copied
// once. RMA (ucp_put/get) is never used: UCX emulates it in software over TCP.
//
// Endpoints: one UCX endpoint per remote worker, shared by every connection
// with it (both directions) and closed with the last one. UCX pairs the
// endpoints two workers open to each other by a per-pair sequence number,
// not by connection, so an endpoint per connection let closing one
// connection silently break another. A failed peer gets
// Handler::OnPeerFailed(Unavailable) and its sends in flight complete with
// Unavailable; after Disconnect or Stop they complete with Cancelled. Those
// completions come when UCX is done with the memory: an endpoint is closed
// by flushing it (only one UCX reported broken is force-closed), because
// UCX 1.13's TCP transport, torn down with a message half written, writes
// its goodbye into the middle of that message and the peer, still alive,
// crashes (tcp_ep.c:939 and heap corruption). A flush towards a peer that is
// gone ends when UCX notices (socket error or its keepalive); Stop waits for
// closes, sends and receives while they move (stop_timeout_ms without
// progress, stop_limit_ms in all). What is still unfinished then
// (a peer that is stopped or hung takes nothing) UCX 1.13 cannot end: it
// aborts when such a worker is destroyed, and a forced TCP close writes into
// the middle of a half-sent message. So Stop ends those sends itself
// (Cancelled, or the peer's failure), gives those receives no OnReceived
// (their pieces are never written again) and leaves the worker, never
// progressed again, to the process's exit, which closes its sockets.
//
// Known UCX 1.13 limitation: with two workers (two UcxTransports) in one
// process, socket churn can hit an abort in UCX's async layer (async.c:643,
// socket fds reused across workers). One transport per process, as the
// agents run, is not affected; in-process tests keep churn low.
//
// Endpoints use UCX's peer-failure error mode. With it, UCX 1.13 carries
// rendezvous payloads over TCP as active-message fragments (TCP cannot
// invalidate memory, which UCX requires of RMA lanes then), so the TCP
// receive segment defaults to 512 KiB here instead of UCX's 64 KiB
// (UCX_TCP_RX_SEG_SIZE overrides). RDMA devices that support invalidation
// keep zero-copy rendezvous.
//
// UCX_* environment variables (UCX_TLS, UCX_NET_DEVICES, ...) pass through;
// UcxOptions::config overrides them for this transport only.
//
// On a connection made with a key (UcxOptions::auth_key, SetAuthKey) every
// message is authenticated, and with encrypt_payloads its payload encrypted
// (message_auth.h): [receiver id][u16 type][u8 flags][u64 seq][application
// header][payload tag][header tag]. Send seals the message on its caller's
// thread (a pass over the payload: about 5 GB/s for the tag, 2.5 GB/s to
// encrypt, here), the receiver checks the header before Handler::Allocate
// and the payload before OnReceived, on the progress thread. A message that
// fails a check closes its connection (OnPeerFailed, PermissionDenied; a
// payload that fails is reported to OnReceived as DataLoss first).
//
// Thread safety: as transport.h. Connect and RegisterMemory block on the
// progress thread and so must not be called from a Handler callback. Stop()
// from a callback only asks the thread to end (it cannot join itself); the
// destructor, run on another thread, joins it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/transport.h"

namespace ckpt::transport {

class NodeCredentials;  // node_identity.h

struct UcxOptions {
  // Payloads above this many bytes use rendezvous (zero-copy into the
  // receiver's pieces); at or below it, eager copies.
  uint64_t rndv_threshold_bytes = 64 << 10;
  // How long Stop() waits for endpoint closes, sends and receives in flight
  // while UCX makes no progress on any of them (the wait goes on while they
  // move), before giving up on them (see "Endpoints" above).
  int64_t stop_timeout_ms = 2000;
  // Stop()'s wait in all, however they move; 0: ten times stop_timeout_ms.
  int64_t stop_limit_ms = 0;
  // Start() connects the transport to itself through its own data port to
  // prove the handshake and UCX work (a bad UCX_TLS otherwise only shows as
  // failed Connects). 0 skips the check.
  int64_t self_check_timeout_ms = 5000;
  // An accepted data-port connection must complete the handshake (greeting
  // and UCX hello) within this time, or it is closed.
  int64_t handshake_timeout_ms = 10000;
  // Accepted connections that have not finished the handshake yet, at most;
  // more are closed at once (a flood of idle or half-done connections cannot
  // pile up; real peers finish in milliseconds).
  int max_pending_handshakes = 64;
  // UCX configuration overrides, e.g. {"TLS", "tcp"} (names without "UCX_").
  std::vector<std::pair<std::string, std::string>> config;
  // The cluster's data-plane key at start (UcxTransport::SetAuthKey sets or
  // replaces it later). With a key, a connection is made only with a peer
  // that proves it holds the same key (HMAC-SHA256 proofs in the greeting
  // records, before either side names its UCX worker address, and in the UCX
  // hello and ready: handshake.h), so a process that does not hold it can
  // neither connect nor learn where the worker listens. A peer with another
  // key is refused with a warning on the side that checked its proof: a
  // Connect to it fails PermissionDenied (the accepting side proves its key
  // first). A peer that has no key when we have one, or the other way round,
  // is closed at its first record: a Connect to it fails Unavailable. Each
  // connection keeps the key its
  // handshake started with. Agents get the key from ckpt-meta when it serves
  // TLS; with an --insecure meta it is the agent token (--token-file).
  // Empty (and require_auth false): no authentication (loopback clusters,
  // tests).
  std::string auth_key;
  // No key, no connection: while no key is known (auth_key empty and no
  // SetAuthKey yet), Connect fails at once with Unavailable and connections
  // to the data port are closed as soon as they are accepted (nothing is
  // answered), instead of running unauthenticated. An agent whose meta
  // serves TLS starts with this and no key, and gets the key when it
  // registers; peers retry refused connects as they retry any.
  bool require_auth = false;
  // With a key: send every payload encrypted (AES-256-GCM, the connection's
  // own key) instead of only authenticated (docs/protocol.md §8b,
  // "Messages"). A receiver takes either. Costs a copy of each payload on
  // the sending side (into reused buffers). Without a key: ignored.
  bool encrypt_payloads = false;
  // Node identities (node_identity.h): the credentials this node proves
  // with, asked for at the start of every handshake (so a renewed
  // certificate applies to new connections). Set, every connection also
  // proves both nodes' certificates (issued by the same CA, each naming
  // ckpt://node/<id>) and mixes an X25519 secret into its message keys;
  // a peer without a node certificate of that CA is refused, and
  // PeerIdentity() says which node each connection's peer is. Identities
  // need the cluster key: while none is known, connections are refused as
  // with require_auth. Unset: no identities. Called on the progress thread:
  // it must not block (NodeCredentialsFiles::Current reads no file).
  std::function<std::shared_ptr<const NodeCredentials>()> identity;
};

// What TEST_SendTampered does to a message.
enum class TestTamper {
  kNone,
  kHeaderTag,  // flips a bit of the header tag (keyed connections)
  kPayload,    // flips a payload byte after its tag was computed (sent from a copy)
  kReplay,     // reuses the previous message's sequence number (keyed connections)
};

// The UCX transport's own controls, beyond Transport.
class UcxTransport : public Transport {
 public:
  // Sets the cluster key (see UcxOptions::auth_key): handshakes that start
  // from now on prove and check `key`; connections already made, or being
  // made, keep the key they started with. An empty key turns authentication
  // off again unless require_auth is set (then new connections are refused
  // until a key is set). May be called from any thread, before or after
  // Start(); never blocks on the progress thread.
  virtual void SetAuthKey(std::string key) = 0;

  // Tests only: rounds of the progress thread so far. `slept`: rounds that
  // ended in a wait on the fds of 100 ms or more that expired with nothing
  // ready; `woken`: every other round (work, a ready fd, a short wait or
  // none). An idle transport adds only slept rounds (about one a second); a
  // spinning progress thread only woken ones.
  struct ProgressRounds {
    uint64_t slept = 0;
    uint64_t woken = 0;
  };
  virtual ProgressRounds TEST_progress_rounds() const = 0;

  // Tests only: Send over connection `via`, except that a non-zero
  // `receiver_id` replaces the id of the connection at the other side in
  // the message (a peer slipping a message into another connection) and
  // `tamper` spoils the message the way it says. Completes like Send.
  virtual void TEST_SendTampered(PeerId via, uint64_t receiver_id, TestTamper tamper, uint16_t type,
                                 std::string header, ConstPieces payload, SendDone done) = 0;
};

// A new, not yet started, UCX transport. Start() fails with Unavailable and
// the reason if UCX cannot initialise, find a usable transport (the
// self-check), or the data port cannot listen (e.g. in use); InvalidArgument
// for a bad address or UCX option. Connect() fails with Unavailable naming
// the address when the data port refuses or does not answer the handshake,
// or UCX cannot reach the peer's worker.
// RegisterMemory blocks until the progress thread has mapped the range with
// ucp_mem_map (mappings live until Stop); a failure is logged and returned
// as Unavailable, and callers may treat it as non-fatal: sends work without
// it. Over TCP/shared memory mapping registers nothing and is cheap.
std::unique_ptr<UcxTransport> NewUcxTransport(const UcxOptions& options = {});

}  // namespace ckpt::transport
