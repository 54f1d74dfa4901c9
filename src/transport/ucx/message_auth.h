// Per-message authentication (and optional encryption) of the UCX data plane
// (docs/protocol.md §8b, "Messages"), for connections made with a cluster
// key (handshake.h).
//
// When a keyed handshake completes, both sides derive this connection's
// keys from the cluster key and both sides' ids and nonces (HKDF-SHA256):
// for each direction, a MAC key for the message headers and an AES-256 key
// for the payloads. The nonces are fresh per connection, so every
// connection has keys of its own, and a message recorded on one connection
// is worth nothing on another.
//
// Every message carries a sequence number (1, 2, ... per direction) and two
// 16-byte tags:
//   - the payload tag: AES-256-GCM under the direction's AES key with the IV
//     [u64 seq][u32 0]. Authenticate-only payloads are the GCM additional
//     data (a GMAC, the payload sent as it is); with encryption the payload
//     is the GCM plaintext and travels as ciphertext.
//   - the header tag: HMAC-SHA256, truncated to 16 bytes, under the
//     direction's MAC key, over [u64 payload length] and the header with
//     everything before the tag (receiver id, type, flags, seq, application
//     header, payload tag). It is checked before the payload is taken, so an
//     unauthenticated header never makes the receiver allocate anything.
// The receiver accepts each sequence number once (ReplayWindow), so a
// message cannot be replayed within its connection either.
//
// This header has no UCX dependency; it is pure and unit-tested.
// Thread safety: DeriveConnectionKeys and HeaderTag are pure functions;
// PayloadSealer and ReplayWindow are not thread-safe (one per direction of
// a connection, used by the transport's progress thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ckpt::transport::ucx_wire {

inline constexpr size_t kTagBytes = 16;

// The keys of one direction of a connection.
struct DirectionKeys {
  std::string mac_key;  // 32 bytes: header tags
  std::string aes_key;  // 32 bytes: payload tags / encryption
};

struct ConnectionKeys {
  DirectionKeys to_acceptor;   // what the connecting side sends
  DirectionKeys to_connector;  // what the accepting side sends
};

// HKDF-SHA256: extract with the salt "ckpt data plane v1" + the four ids and
// nonces (u64 little-endian, the accepting side's first), expand with a label
// per key ("mac a>c", "mac c>a", "aes a>c", "aes c>a").
ConnectionKeys DeriveConnectionKeys(std::string_view cluster_key, uint64_t acceptor_id, uint64_t acceptor_nonce,
                                    uint64_t connector_id, uint64_t connector_nonce);

// The header tag (kTagBytes) of a header whose bytes before the tag are
// `header` and whose payload has `payload_bytes` bytes.
std::string HeaderTag(std::string_view mac_key, std::string_view header, uint64_t payload_bytes);

// AES-256-GCM over payloads, under one direction's AES key.
class PayloadSealer {
 public:
  explicit PayloadSealer(std::string_view aes_key);
  ~PayloadSealer();
  PayloadSealer(const PayloadSealer&) = delete;
  PayloadSealer& operator=(const PayloadSealer&) = delete;

  // The tag of authenticate-only payload `pieces` for message `seq`.
  std::string Tag(uint64_t seq, const std::vector<std::span<const std::byte>>& pieces);
  // Encrypts `pieces` into `out` (exactly their total size) and returns the
  // tag.
  std::string Encrypt(uint64_t seq, const std::vector<std::span<const std::byte>>& pieces, std::span<std::byte> out);
  // True iff `tag` is the tag of authenticate-only `pieces` for `seq`.
  bool Check(uint64_t seq, const std::vector<std::span<const std::byte>>& pieces, std::string_view tag);
  // Decrypts `src` (the ciphertext, their total size) into `pieces` and
  // checks `tag`; `src` may be the pieces themselves (in place: pass
  // nullptr). False if the tag does not match (the pieces then hold bytes
  // that must not be used).
  bool Decrypt(uint64_t seq, const std::byte* src, const std::vector<std::span<std::byte>>& pieces,
               std::string_view tag);

 private:
  struct Ctx;
  std::unique_ptr<Ctx> ctx_;
};

// Sequence numbers of one direction already accepted: the highest one and
// the 64 below it. A number seen before, 0, or more than 63 below the
// highest is refused (UCX delivers a connection's messages in order, so a
// legitimate one is never that late).
class ReplayWindow {
 public:
  bool Accept(uint64_t seq);

 private:
  uint64_t top_ = 0;
  uint64_t seen_ = 0;  // bit i: top_ - i accepted
};

}  // namespace ckpt::transport::ucx_wire
