#include "transport/ucx/message_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>

#include "common/endian.h"

namespace ckpt::transport::ucx_wire {
namespace {

std::string Hmac(std::string_view key, std::string_view msg) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(msg.data()),
       msg.size(), out, &len);
  return std::string(reinterpret_cast<const char*>(out), len);
}

// OpenSSL's update functions take an int length.
constexpr size_t kMaxUpdate = size_t{1} << 30;

[[noreturn]] void CryptoFailed(const char* what) {
  // AES-GCM with a valid key and IV cannot fail short of a broken library:
  // carrying on could send unauthenticated or unencrypted bytes.
  std::fprintf(stderr, "ckpt data plane: OpenSSL %s failed\n", what);
  std::abort();
}

}  // namespace

ConnectionKeys DeriveConnectionKeys(std::string_view cluster_key, uint64_t acceptor_id, uint64_t acceptor_nonce,
                                    uint64_t connector_id, uint64_t connector_nonce) {
  std::string salt = "ckpt data plane v1";
  for (uint64_t v : {acceptor_id, acceptor_nonce, connector_id, connector_nonce}) AppendLe64(salt, v);
  const std::string prk = Hmac(salt, cluster_key);
  auto expand = [&](std::string_view label) { return Hmac(prk, std::string(label) + '\x01'); };
  ConnectionKeys k;
  k.to_acceptor.mac_key = expand("mac c>a");
  k.to_acceptor.aes_key = expand("aes c>a");
  k.to_connector.mac_key = expand("mac a>c");
  k.to_connector.aes_key = expand("aes a>c");
  return k;
}

std::string HeaderTag(std::string_view mac_key, std::string_view header, uint64_t payload_bytes) {
  std::string msg;
  msg.reserve(8 + header.size());
  AppendLe64(msg, payload_bytes);
  msg.append(header);
  return Hmac(mac_key, msg).substr(0, kTagBytes);
}

struct PayloadSealer::Ctx {
  EVP_CIPHER_CTX* enc = nullptr;
  EVP_CIPHER_CTX* dec = nullptr;
  ~Ctx() {
    EVP_CIPHER_CTX_free(enc);
    EVP_CIPHER_CTX_free(dec);
  }
};

namespace {

void Iv(uint64_t seq, unsigned char iv[12]) {
  StoreLe64(iv, seq);
  iv[8] = iv[9] = iv[10] = iv[11] = 0;
}

// Feeds `n` bytes at `in` as additional data (out == nullptr) or as
// plaintext/ciphertext into `out`, in pieces OpenSSL's int lengths take.
void Update(EVP_CIPHER_CTX* c, bool encrypt, unsigned char* out, const unsigned char* in, size_t n) {
  while (n > 0) {
    const size_t step = std::min(n, kMaxUpdate);
    int len = 0;
    const int ok = encrypt ? EVP_EncryptUpdate(c, out, &len, in, static_cast<int>(step))
                           : EVP_DecryptUpdate(c, out, &len, in, static_cast<int>(step));
    if (ok != 1) CryptoFailed("GCM update");
    if (out != nullptr) out += step;
    in += step;
    n -= step;
  }
}

}  // namespace

PayloadSealer::PayloadSealer(std::string_view aes_key) : ctx_(std::make_unique<Ctx>()) {
  ctx_->enc = EVP_CIPHER_CTX_new();
  ctx_->dec = EVP_CIPHER_CTX_new();
  if (ctx_->enc == nullptr || ctx_->dec == nullptr || aes_key.size() != 32) CryptoFailed("GCM context");
  const auto* key = reinterpret_cast<const unsigned char*>(aes_key.data());
  if (EVP_EncryptInit_ex(ctx_->enc, EVP_aes_256_gcm(), nullptr, key, nullptr) != 1 ||
      EVP_DecryptInit_ex(ctx_->dec, EVP_aes_256_gcm(), nullptr, key, nullptr) != 1) {
    CryptoFailed("GCM key setup");
  }
}

PayloadSealer::~PayloadSealer() = default;

std::string PayloadSealer::Tag(uint64_t seq, const std::vector<std::span<const std::byte>>& pieces) {
  unsigned char iv[12];
  Iv(seq, iv);
  EVP_CIPHER_CTX* c = ctx_->enc;
  if (EVP_EncryptInit_ex(c, nullptr, nullptr, nullptr, iv) != 1) CryptoFailed("GCM IV");
  for (const auto& p : pieces) Update(c, true, nullptr, reinterpret_cast<const unsigned char*>(p.data()), p.size());
  int len = 0;
  unsigned char tag[kTagBytes];
  if (EVP_EncryptFinal_ex(c, tag, &len) != 1 || EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_GET_TAG, kTagBytes, tag) != 1) {
    CryptoFailed("GCM tag");
  }
  return std::string(reinterpret_cast<const char*>(tag), kTagBytes);
}

std::string PayloadSealer::Encrypt(uint64_t seq, const std::vector<std::span<const std::byte>>& pieces,
                                   std::span<std::byte> out) {
  unsigned char iv[12];
  Iv(seq, iv);
  EVP_CIPHER_CTX* c = ctx_->enc;
  if (EVP_EncryptInit_ex(c, nullptr, nullptr, nullptr, iv) != 1) CryptoFailed("GCM IV");
  auto* dst = reinterpret_cast<unsigned char*>(out.data());
  for (const auto& p : pieces) {
    Update(c, true, dst, reinterpret_cast<const unsigned char*>(p.data()), p.size());
    dst += p.size();
  }
  int len = 0;
  unsigned char tag[kTagBytes];
  if (EVP_EncryptFinal_ex(c, tag, &len) != 1 || EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_GET_TAG, kTagBytes, tag) != 1) {
    CryptoFailed("GCM tag");
  }
  return std::string(reinterpret_cast<const char*>(tag), kTagBytes);
}

bool PayloadSealer::Check(uint64_t seq, const std::vector<std::span<const std::byte>>& pieces, std::string_view tag) {
  if (tag.size() != kTagBytes) return false;
  const std::string want = Tag(seq, pieces);
  return CRYPTO_memcmp(want.data(), tag.data(), kTagBytes) == 0;
}

bool PayloadSealer::Decrypt(uint64_t seq, const std::byte* src, const std::vector<std::span<std::byte>>& pieces,
                            std::string_view tag) {
  if (tag.size() != kTagBytes) return false;
  unsigned char iv[12];
  Iv(seq, iv);
  EVP_CIPHER_CTX* c = ctx_->dec;
  if (EVP_DecryptInit_ex(c, nullptr, nullptr, nullptr, iv) != 1) CryptoFailed("GCM IV");
  const auto* in = reinterpret_cast<const unsigned char*>(src);
  for (const auto& p : pieces) {
    auto* dst = reinterpret_cast<unsigned char*>(p.data());
    Update(c, false, dst, in != nullptr ? in : dst, p.size());
    if (in != nullptr) in += p.size();
  }
  unsigned char want[kTagBytes];
  std::copy(tag.begin(), tag.end(), reinterpret_cast<char*>(want));
  if (EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_SET_TAG, kTagBytes, want) != 1) CryptoFailed("GCM tag");
  int len = 0;
  unsigned char none[16];
  return EVP_DecryptFinal_ex(c, none, &len) == 1;
}

bool ReplayWindow::Accept(uint64_t seq) {
  if (seq == 0) return false;
  if (seq > top_) {
    const uint64_t shift = seq - top_;
    seen_ = shift >= 64 ? 0 : seen_ << shift;
    seen_ |= 1;
    top_ = seq;
    return true;
  }
  const uint64_t back = top_ - seq;
  if (back >= 64 || (seen_ & (uint64_t{1} << back)) != 0) return false;
  seen_ |= uint64_t{1} << back;
  return true;
}

}  // namespace ckpt::transport::ucx_wire
