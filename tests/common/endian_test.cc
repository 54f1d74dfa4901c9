#include "common/endian.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace ckpt {
namespace {

TEST(Endian, StoresLeastSignificantByteFirst) {
  unsigned char b[8] = {};
  StoreLe32(b, 0x04030201u);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(b), 4), std::string("\x01\x02\x03\x04", 4));
  StoreLe64(b, 0x0807060504030201ull);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(b), 8), std::string("\x01\x02\x03\x04\x05\x06\x07\x08", 8));
  EXPECT_EQ(LoadLe32(b), 0x04030201u);
  EXPECT_EQ(LoadLe64(b), 0x0807060504030201ull);
  // Any width: a 2-byte type field, a 3-byte value.
  EXPECT_EQ(LoadLe(b, 2), 0x0201u);
  EXPECT_EQ(LoadLe(b, 0), 0u);
  unsigned char c[3] = {};
  StoreLe(c, 0xAABBCCDDull, 3);  // the low 3 bytes only
  EXPECT_EQ(LoadLe(c, 3), 0xBBCCDDu);
}

TEST(Endian, RoundTripsExtremesAtAnyAlignment) {
  for (uint64_t v : {uint64_t{0}, uint64_t{1}, uint64_t{0x80}, uint64_t{0xFF}, uint64_t{0x8000000000000000},
                     UINT64_MAX, uint64_t{0x0123456789ABCDEF}}) {
    for (size_t off = 0; off < 8; ++off) {
      char buf[24] = {};
      StoreLe64(buf + off, v);
      EXPECT_EQ(LoadLe64(buf + off), v);
      StoreLe32(buf + off, static_cast<uint32_t>(v));
      EXPECT_EQ(LoadLe32(buf + off), static_cast<uint32_t>(v));
    }
  }
}

TEST(Endian, AppendGrowsTheString) {
  std::string s = "x";
  AppendLe32(s, 7);
  AppendLe64(s, UINT64_MAX);
  AppendLe(s, 0x0102, 2);
  ASSERT_EQ(s.size(), 1u + 4 + 8 + 2);
  EXPECT_EQ(LoadLe32(s.data() + 1), 7u);
  EXPECT_EQ(LoadLe64(s.data() + 5), UINT64_MAX);
  EXPECT_EQ(LoadLe(s.data() + 13, 2), 0x0102u);
}

TEST(LeWriter, ReaderReadsBackWhatItWrote) {
  LeWriter w(64);
  w.U8(0xFE);
  w.U32(0xDEADBEEF);
  w.U64(uint64_t{1} << 63);
  w.Str("hello");
  w.Str("");
  w.Raw("raw");
  const std::string enc = w.Take();
  EXPECT_EQ(enc.size(), 1u + 4 + 8 + (4 + 5) + 4 + 3);
  LeReader r(enc);
  EXPECT_EQ(r.U8(), 0xFE);
  EXPECT_EQ(r.U32(), 0xDEADBEEFu);
  EXPECT_EQ(r.U64(), uint64_t{1} << 63);
  EXPECT_EQ(r.Str(), "hello");
  EXPECT_EQ(r.Str(), "");
  EXPECT_FALSE(r.AtEnd());
  EXPECT_EQ(r.left(), 3u);
  EXPECT_EQ(r.Raw(3), "raw");
  EXPECT_TRUE(r.AtEnd());
  EXPECT_TRUE(r.ok());
}

TEST(LeWriter, OutCanBePatchedInPlace) {
  LeWriter w;
  w.U32(0);  // a count, patched at the end
  w.U64(9);
  StoreLe32(w.out().data(), 1);
  LeReader r(w.out());
  EXPECT_EQ(r.U32(), 1u);
  EXPECT_EQ(r.U64(), 9u);
}

TEST(LeReader, ReadPastTheEndFailsAndStaysFailed) {
  const std::string enc("\x01\x02\x03", 3);
  LeReader r(enc);
  EXPECT_EQ(r.U32(), 0u);  // 3 bytes left: refused, nothing consumed
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.U8(), 0u);  // even a read that would fit fails once bad
  EXPECT_EQ(r.Raw(0), "");
  EXPECT_FALSE(r.ok());

  LeReader empty("");
  EXPECT_TRUE(empty.AtEnd());
  EXPECT_EQ(empty.U64(), 0u);
  EXPECT_FALSE(empty.ok());
}

TEST(LeReader, StrLongerThanTheInputFails) {
  std::string enc;
  AppendLe32(enc, 100);  // claims 100 bytes
  enc += "short";
  LeReader r(enc);
  EXPECT_EQ(r.Str(), "");
  EXPECT_FALSE(r.ok());
  // A huge length does not wrap the bounds check.
  std::string huge;
  AppendLe32(huge, UINT32_MAX);
  LeReader h(huge);
  EXPECT_EQ(h.Str(), "");
  EXPECT_FALSE(h.ok());
}

}  // namespace
}  // namespace ckpt
