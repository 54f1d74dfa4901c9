// The data-port handshake of the UCX transport (docs/protocol.md §8b).
//
// A UcxTransport never exposes a UCX listener. Its data port (the address
// peers get from meta) is a plain TCP socket owned by ckpt, on which two
// transports swap greeting records: the connecting side first, the accepting
// side in reply. A record carries the sender's PeerId for the connection, a
// random nonce, and, depending on its flags, a proof that the sender holds
// the cluster key and/or the sender's UCX worker address. Each side then
// opens a UCX endpoint to the other's worker address, and the TCP connection
// stays open as the pair's liveness channel (either side closing it, or its
// process dying, fails the connection on the other side).
//
// Wire format of a record (little-endian):
//
//   offset  size  field
//        0     8  magic "CKPTDP02" (the last two characters are the version)
//        8     1  flags: kKeyed 0x01, kProof 0x02, kAddress 0x04, kIdentity 0x08
//                 (no others)
//        9     8  sender's PeerId for this connection (never 0)
//       17     8  sender's nonce (fresh per connection)
//       25    32  with kProof: HandshakeProof (below)
//        .     2  with kIdentity: length I of the identity block, 1..kMaxIdentityBytes
//        .     I  with kIdentity: the identity block (node_identity.h)
//        .     4  with kAddress: length L of the worker address, 1..kMaxWorkerAddressBytes
//        .     L  with kAddress: the sender's UCX worker address (opaque bytes)
//
// Without a cluster key (an --insecure cluster without an agent token):
//   connecting -> accepting  {kAddress}        its worker address
//   accepting -> connecting  {kAddress}        its worker address
// With a key, neither side names its worker address to a side that has not
// proven the key, and each proof covers both sides' ids and nonces:
//   connecting -> accepting  {kKeyed}                     id, nonce
//   accepting -> connecting  {kKeyed|kProof}              proof 'a'
//   connecting -> accepting  {kKeyed|kProof|kAddress}     proof 'c', its address
//   accepting -> connecting  {kKeyed|kAddress}            its address
// With node identities as well (both sides hold a node certificate of the
// cluster's CA: node_identity.h), the first three records carry kIdentity:
//   connecting -> accepting  {kKeyed|kIdentity}           id, nonce, certificate, X25519 key
//   accepting -> connecting  {kKeyed|kProof|kIdentity}    proof 'a', certificate, key, signature
//   connecting -> accepting  {kKeyed|kProof|kIdentity|kAddress}  proof 'c', signature, address
//   accepting -> connecting  {kKeyed|kAddress}            its address
// so neither side names its worker address before the other has proven
// which node it is.
// The later records repeat the sender's id and nonce. A side reads exactly
// the record it expects next (GreetingReader's `expected_flags`), so a peer
// without a key, or with one when this side has none, is refused at the
// flags byte with a message that says which.
//
// Nothing else is ever sent on the TCP connection: a byte after the last
// record is a protocol violation. GreetingReader checks each byte as it
// arrives, so garbage (a port scanner, an HTTP/2 preface, zeros) is refused
// at the first byte that cannot start a record and never reaches UCX.
//
// This header has no UCX dependency; it is pure and unit-tested.
// Thread safety: GreetingReader is not thread-safe (one per record);
// EncodeGreeting is a pure function.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt::transport::ucx_wire {

inline constexpr std::string_view kGreetingMagic = "CKPTDP02";
// magic, flags, PeerId, nonce: what every record starts with.
inline constexpr size_t kGreetingFixedBytes = 25;
inline constexpr size_t kProofBytes = 32;
// UCX 1.13 worker addresses are a few hundred bytes (one entry per
// transport and device); anything near this bound is not one.
inline constexpr size_t kMaxWorkerAddressBytes = 16 << 10;
// An identity block holds a certificate (about 600 bytes for ckpt's EC P-256
// ones), a 32-byte key and a signature (about 72 bytes).
inline constexpr size_t kMaxIdentityBytes = 12 << 10;

// Record flags.
inline constexpr uint8_t kKeyed = 0x01;    // the sender authenticates with a cluster key
inline constexpr uint8_t kProof = 0x02;    // a proof follows the nonce
inline constexpr uint8_t kAddress = 0x04;  // a worker address ends the record
inline constexpr uint8_t kIdentity = 0x08; // an identity block follows the proof

// Every record kind a handshake uses, in the order of the flows above: the
// one of a handshake without a key, the four of a keyed one, and the three
// that carry node identities (tests and fuzzers go through them all).
inline constexpr uint8_t kRecordKinds[] = {kAddress,
                                           kKeyed,
                                           kKeyed | kProof,
                                           kKeyed | kProof | kAddress,
                                           kKeyed | kAddress,
                                           kKeyed | kIdentity,
                                           kKeyed | kProof | kIdentity,
                                           kKeyed | kProof | kIdentity | kAddress};

struct Greeting {
  uint8_t flags = 0;
  uint64_t peer_id = 0;
  uint64_t nonce = 0;
  std::string proof;           // kProofBytes with kProof, else empty
  std::string worker_address;  // non-empty with kAddress, else empty
  std::string identity = {};   // non-empty with kIdentity, else empty
};

// The bytes of `g`. InvalidArgument if peer_id is 0, flags has a bit other
// than kKeyed, kProof and kAddress, the proof is not kProofBytes with kProof
// (or not empty without), the worker address is empty or longer than
// kMaxWorkerAddressBytes with kAddress (or not empty without), or the
// identity block is empty or longer than kMaxIdentityBytes with kIdentity
// (or not empty without).
absl::StatusOr<std::string> EncodeGreeting(const Greeting& g);

// Reads one record, with exactly `expected_flags`, from a byte stream that
// may arrive in pieces.
class GreetingReader {
 public:
  explicit GreetingReader(uint8_t expected_flags = kAddress) : expected_flags_(expected_flags) {}

  // How many more bytes the record needs (0 once done() or failed). A caller
  // that reads at most this many bytes from the socket never consumes
  // anything past the record.
  size_t wanted() const;

  // Consumes up to wanted() bytes of `data` and returns how many it took.
  // InvalidArgument, saying what was wrong, at the first byte that cannot be
  // part of the expected record (wrong magic; other flags, e.g. a peer
  // without a cluster key when one is expected; PeerId 0; an address length
  // of 0 or above kMaxWorkerAddressBytes, an identity length of 0 or above
  // kMaxIdentityBytes); the reader then stays failed and consumes nothing
  // more.
  absl::StatusOr<size_t> Feed(std::string_view data);

  bool done() const { return done_; }
  uint8_t expected_flags() const { return expected_flags_; }
  // The record, valid once done().
  const Greeting& greeting() const { return greeting_; }
  // Bytes consumed so far (for messages).
  size_t consumed() const { return consumed_; }

 private:
  // The parts of a record, in order; those its flags do not have are skipped.
  enum class Part { kHead, kIdentityLength, kIdentity, kAddressLength, kAddress, kDone };
  // The part after `part` that this record has.
  Part NextPart(Part part) const;
  // Bytes of the current part.
  size_t PartBytes() const;
  // The current part is complete in part_: take it and move on.
  absl::Status EndPart();

  uint8_t expected_flags_;
  Part part_ = Part::kHead;
  std::string part_bytes_;  // the current part, so far
  size_t identity_bytes_ = 0;
  size_t address_bytes_ = 0;
  size_t consumed_ = 0;
  bool done_ = false;
  absl::Status error_;
  Greeting greeting_;
};

// Authentication (UcxOptions::auth_key, docs/protocol.md "Authentication"):
// with a cluster key, each side proves it holds it twice, on the TCP
// connection before its worker address is given ('a' accepting side, 'c'
// connecting side) and in the UCX hello ('h') and ready ('r') that complete
// the connection: HMAC-SHA256 over the role byte and both sides' PeerIds and
// nonces (the accepting side's first), all little-endian u64. The nonces are
// fresh per connection, so a proof cannot be replayed on another one, and
// the roles differ, so one cannot be reflected either.
std::string HandshakeProof(std::string_view key, char role, uint64_t acceptor_id, uint64_t acceptor_nonce,
                           uint64_t connector_id, uint64_t connector_nonce);
// Equal, in time that does not depend on where they differ.
bool SameProof(std::string_view a, std::string_view b);
// 8 bytes from the kernel's random source (getrandom): handshake nonces and,
// with a key, connection ids a third party cannot guess.
uint64_t RandomU64();

}  // namespace ckpt::transport::ucx_wire
