// OpenSSL's libcrypto behind common/crypto.h.
#include "common/crypto.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ckpt {
namespace {

// getrandom(2) in a loop (it may return fewer bytes, or EINTR).
bool KernelRandom(unsigned char* out, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::getrandom(out + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    got += static_cast<size_t>(r);
  }
  return true;
}

}  // namespace

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  if (n == 0) return out;
  auto* p = reinterpret_cast<unsigned char*>(out.data());
  if (n <= static_cast<size_t>(INT32_MAX) && RAND_bytes(p, static_cast<int>(n)) == 1) return out;
  if (KernelRandom(p, n)) return out;
  std::fprintf(stderr, "ckpt: no randomness: RAND_bytes and getrandom(2) both failed (%s)\n", std::strerror(errno));
  std::abort();
}

std::string RandomId(std::string_view prefix) {
  static constexpr char kHex[] = "0123456789abcdef";
  const std::string bytes = RandomBytes(kRandomIdBits / 8);
  std::string id(prefix);
  id.reserve(prefix.size() + 2 * bytes.size());
  for (unsigned char c : bytes) {
    id.push_back(kHex[c >> 4]);
    id.push_back(kHex[c & 0xf]);
  }
  return id;
}

std::string HmacSha256(std::string_view key, std::string_view message) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  // An empty key is still a key to HMAC (OpenSSL wants a non-null pointer).
  static const unsigned char kNone = 0;
  const void* k = key.empty() ? static_cast<const void*>(&kNone) : key.data();
  if (HMAC(EVP_sha256(), k, static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
           message.size(), out, &len) == nullptr ||
      len != kHmacSha256Bytes) {
    std::fprintf(stderr, "ckpt: HMAC-SHA256 failed in libcrypto\n");
    std::abort();
  }
  return std::string(reinterpret_cast<const char*>(out), len);
}

bool ConstantTimeEqual(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  return a.empty() || CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace ckpt
