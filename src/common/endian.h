// Little-endian fixed-width integers, the byte order of every ckpt wire and
// disk format (the manifest encoding, agent records, peer headers, the UCX
// handshake and message headers): loads and stores on raw bytes, and a
// writer / reader of u8, u32, u64 and u32-length-prefixed strings in field
// order.
//
// Byte by byte, so independent of the host's order and alignment; compilers
// turn each loop into one load or store on little-endian hosts.
//
// Thread safety: the free functions are pure. LeWriter and LeReader are plain
// values owned by one thread at a time. Nothing here blocks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

namespace ckpt {

// Stores the low `bytes` (0..8) bytes of `v` at `p`, least significant first.
inline void StoreLe(void* p, uint64_t v, int bytes) {
  auto* out = static_cast<unsigned char*>(p);
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<unsigned char>(v >> (8 * i));
}
inline void StoreLe32(void* p, uint32_t v) { StoreLe(p, v, 4); }
inline void StoreLe64(void* p, uint64_t v) { StoreLe(p, v, 8); }

// Reads `bytes` (0..8) bytes at `p` as a little-endian unsigned number.
inline uint64_t LoadLe(const void* p, int bytes) {
  const auto* in = static_cast<const unsigned char*>(p);
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{in[i]} << (8 * i);
  return v;
}
inline uint32_t LoadLe32(const void* p) { return static_cast<uint32_t>(LoadLe(p, 4)); }
inline uint64_t LoadLe64(const void* p) { return LoadLe(p, 8); }

// Appends the low `bytes` (0..8) bytes of `v` to `out`, least significant first.
inline void AppendLe(std::string& out, uint64_t v, int bytes) {
  const size_t at = out.size();
  out.resize(at + static_cast<size_t>(bytes));
  StoreLe(out.data() + at, v, bytes);
}
inline void AppendLe32(std::string& out, uint32_t v) { AppendLe(out, v, 4); }
inline void AppendLe64(std::string& out, uint64_t v) { AppendLe(out, v, 8); }

// Builds an encoding front to back.
class LeWriter {
 public:
  LeWriter() = default;
  // Reserves `reserve` bytes up front (an encoding whose size is known).
  explicit LeWriter(size_t reserve) { out_.reserve(reserve); }

  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U32(uint32_t v) { AppendLe32(out_, v); }
  void U64(uint64_t v) { AppendLe64(out_, v); }
  // u32 length, then the bytes. `s` must be shorter than 4 GiB.
  void Str(std::string_view s) {
    U32(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  // The bytes alone (a length the format knows otherwise).
  void Raw(std::string_view s) { out_.append(s); }

  // The encoding so far (may be appended to or patched in place).
  std::string& out() { return out_; }
  // Moves the encoding out; the writer is then empty.
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

// Reads an encoding front to back. A read past the end marks the reader bad
// and returns 0 or an empty string, as does every read after it; the caller
// checks ok() where it matters (after a header, before trusting a count). The
// string views point into the input, which must outlive them.
class LeReader {
 public:
  explicit LeReader(std::string_view in) : in_(in) {}

  // Every read so far was in bounds.
  bool ok() const { return ok_; }
  // Bytes not read yet.
  size_t left() const { return in_.size() - pos_; }
  // Nothing left to read.
  bool AtEnd() const { return pos_ >= in_.size(); }

  uint8_t U8() { return Need(1) ? static_cast<uint8_t>(in_[pos_++]) : 0; }
  uint32_t U32() {
    if (!Need(4)) return 0;
    const uint32_t v = LoadLe32(in_.data() + pos_);
    pos_ += 4;
    return v;
  }
  uint64_t U64() {
    if (!Need(8)) return 0;
    const uint64_t v = LoadLe64(in_.data() + pos_);
    pos_ += 8;
    return v;
  }
  // A u32 length, then that many bytes.
  std::string_view Str() {
    const uint32_t n = U32();
    return Raw(n);
  }
  // The next `n` bytes.
  std::string_view Raw(size_t n) {
    if (!Need(n)) return {};
    std::string_view s = in_.substr(pos_, n);
    pos_ += n;
    return s;
  }

 private:
  bool Need(size_t n) {
    if (!ok_ || n > left()) {
      ok_ = false;
      return false;
    }
    return true;
  }

  std::string_view in_;
  size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace ckpt
