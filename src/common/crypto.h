// Secrets the daemons make and check: random ids and keys from a CSPRNG,
// HMAC-SHA256, and a comparison that takes the same time wherever two
// secrets differ. The one adapter of OpenSSL's libcrypto in ckpt::common
// (the data plane's handshake has its own, in src/transport/ucx).
//
// Random ids name things a caller must not be able to guess: a staging
// lease, a shard handle, a client session (docs/security.md "Ids and
// tokens"). Each is 128 bits from OpenSSL's RAND_bytes (seeded by the
// kernel's getrandom), hex-encoded.
//
// Thread safety: every function may be called from any thread.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace ckpt {

// Bits of randomness in a RandomId.
inline constexpr size_t kRandomIdBits = 128;

// `n` bytes from the CSPRNG. Never fails: a process whose kernel cannot give
// it randomness (RAND_bytes and getrandom(2) both fail) aborts with a message
// rather than hand out a guessable secret.
std::string RandomBytes(size_t n);

// `prefix` followed by 32 lower-case hex digits (kRandomIdBits bits of
// RandomBytes), e.g. RandomId("l-") = "l-3f09...". Unique in practice: two
// ids collide with probability 2^-128.
std::string RandomId(std::string_view prefix);

// HMAC-SHA256 of `message` under `key`: 32 bytes.
inline constexpr size_t kHmacSha256Bytes = 32;
std::string HmacSha256(std::string_view key, std::string_view message);

// True iff a and b are the same bytes. The time taken depends on the
// lengths only, not on where the bytes differ (CRYPTO_memcmp): for tokens and
// MACs an attacker could otherwise find byte by byte.
bool ConstantTimeEqual(std::string_view a, std::string_view b);

}  // namespace ckpt
