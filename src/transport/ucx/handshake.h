// The data-port handshake of the UCX transport (docs/protocol.md §8b).
//
// A UcxTransport never exposes a UCX listener. Its data port (the address
// peers get from meta) is a plain TCP socket owned by ckpt, on which two
// transports swap one Greeting each: the connecting side first, the
// accepting side in reply. A Greeting carries the sender's PeerId for the
// connection, a random nonce and the sender's UCX worker address; each side
// then opens a UCX endpoint to the other's worker address, and the TCP
// connection stays open as the pair's liveness channel (either side closing
// it, or its process dying, fails the connection on the other side).
//
// Wire format of a Greeting (little-endian, 28 bytes + the address):
//
//   offset  size  field
//        0     8  magic "CKPTDP01" (the last two characters are the version)
//        8     8  sender's PeerId for this connection (never 0)
//       16     8  nonce: echoed by the other side in its first UCX message
//       24     4  length L of the worker address, 1..kMaxWorkerAddressBytes
//       28     L  the sender's UCX worker address (opaque bytes)
//
// Nothing else is ever sent on the TCP connection: a byte after the Greeting
// is a protocol violation. GreetingReader checks each byte as it arrives, so
// garbage (a port scanner, an HTTP/2 preface, zeros) is refused at the first
// byte that cannot start a Greeting and never reaches UCX.
//
// This header has no UCX dependency; it is pure and unit-tested.
// Thread safety: GreetingReader is not thread-safe (one per connection);
// EncodeGreeting is a pure function.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt::transport::ucx_wire {

inline constexpr std::string_view kGreetingMagic = "CKPTDP01";
inline constexpr size_t kGreetingFixedBytes = 28;
// UCX 1.13 worker addresses are a few hundred bytes (one entry per
// transport and device); anything near this bound is not one.
inline constexpr size_t kMaxWorkerAddressBytes = 16 << 10;

struct Greeting {
  uint64_t peer_id = 0;
  uint64_t nonce = 0;
  std::string worker_address;
};

// The bytes of `g`. InvalidArgument if peer_id is 0 or the worker address is
// empty or longer than kMaxWorkerAddressBytes.
absl::StatusOr<std::string> EncodeGreeting(const Greeting& g);

// Reads one Greeting from a byte stream that may arrive in pieces.
class GreetingReader {
 public:
  // How many more bytes the Greeting needs (0 once done()). A caller that
  // reads at most this many bytes from the socket never consumes anything
  // past the Greeting.
  size_t wanted() const;

  // Consumes up to wanted() bytes of `data` and returns how many it took.
  // InvalidArgument, saying what was wrong, at the first byte that cannot be
  // part of a Greeting (wrong magic, PeerId 0, a length of 0 or above
  // kMaxWorkerAddressBytes); the reader then stays failed and consumes
  // nothing more.
  absl::StatusOr<size_t> Feed(std::string_view data);

  bool done() const { return done_; }
  // The Greeting, valid once done().
  const Greeting& greeting() const { return greeting_; }
  // Bytes consumed so far (for messages).
  size_t consumed() const { return consumed_; }

 private:
  std::string fixed_;  // the first kGreetingFixedBytes bytes
  size_t address_bytes_ = 0;
  size_t consumed_ = 0;
  bool done_ = false;
  absl::Status error_;
  Greeting greeting_;
};

// Authentication (UcxOptions::auth_key, docs/protocol.md "Authentication"):
// with a cluster key, the UCX hello and ready messages each carry a proof
// that the sender holds it: HMAC-SHA256 over a role byte ('h' hello, 'r'
// ready) and both sides' PeerIds and nonces (the accepting side's first), all
// little-endian u64. The nonces are fresh per connection, so a proof cannot
// be replayed on another one.
inline constexpr size_t kProofBytes = 32;
std::string HandshakeProof(std::string_view key, char role, uint64_t acceptor_id, uint64_t acceptor_nonce,
                           uint64_t connector_id, uint64_t connector_nonce);
// Equal, in time that does not depend on where they differ.
bool SameProof(std::string_view a, std::string_view b);
// 8 bytes from the kernel's random source (getrandom): handshake nonces and,
// with a key, connection ids a third party cannot guess.
uint64_t RandomU64();

}  // namespace ckpt::transport::ucx_wire
