// common/crypto.h: random ids and HMAC-SHA256 (RFC 4231 vectors).
#include "common/crypto.h"

#include <set>

#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "support/hex_id.h"

namespace ckpt {
namespace {

TEST(RandomId, IsThePrefixAnd32HexDigitsNeverRepeated) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    const std::string id = RandomId("x-");
    ASSERT_TRUE(ckpt::testing::IsHexId(id, "x-")) << id;
    EXPECT_TRUE(seen.insert(id).second) << id;
  }
  EXPECT_EQ(RandomId("").size(), 32u);
}

TEST(RandomBytes, GivesTheLengthAskedAndDifferentBytes) {
  EXPECT_EQ(RandomBytes(0).size(), 0u);
  EXPECT_EQ(RandomBytes(32).size(), 32u);
  EXPECT_NE(RandomBytes(32), RandomBytes(32));
}

TEST(HmacSha256, MatchesRfc4231) {
  // Test case 2: key "Jefe".
  EXPECT_EQ(absl::BytesToHexString(HmacSha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // Test case 1: 20 bytes of 0x0b.
  EXPECT_EQ(absl::BytesToHexString(HmacSha256(std::string(20, '\x0b'), "Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
}

TEST(ConstantTimeEqual, ComparesBytesAndLengths) {
  EXPECT_TRUE(ConstantTimeEqual("", ""));
  EXPECT_TRUE(ConstantTimeEqual("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEqual("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEqual("abc", "ab"));
  EXPECT_FALSE(ConstantTimeEqual(std::string("a\0b", 3), std::string("a\0c", 3)));
}

}  // namespace
}  // namespace ckpt
