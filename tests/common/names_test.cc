#include "common/names.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;

std::string Message(const absl::Status& s) { return std::string(s.message()); }

// ---- Job ids.

TEST(ValidateJobId, AcceptsTypicalIds) {
  for (const char* id :
       {"a", "0", "llama-70b", "run.2024-06-01", "job_7", "a.b", "x-", "x.", "x_", "9lives"}) {
    EXPECT_TRUE(ValidateJobId(id).ok()) << id << ": " << ValidateJobId(id);
  }
}

TEST(ValidateJobId, Accepts63CharsRejects64) {
  const std::string max(kMaxJobIdLength, 'a');
  EXPECT_EQ(max.size(), 63u);
  EXPECT_TRUE(ValidateJobId(max).ok());
  const absl::Status s = ValidateJobId(max + "a");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(s), HasSubstr("64 bytes long, at most 63"));
}

TEST(ValidateJobId, RejectsEmpty) {
  const absl::Status s = ValidateJobId("");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(s), HasSubstr("job id \"\" is invalid: it is empty"));
}

TEST(ValidateJobId, RejectsPathEscapes) {
  for (const char* id : {"..", "../etc", "a/../b", "a..b", "a..", "x/..", "..."}) {
    const absl::Status s = ValidateJobId(id);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << id;
    EXPECT_THAT(Message(s), HasSubstr("contains \"..\"")) << id;
  }
  for (const char* id : {"a/b", "/abs", "a\\b"}) {
    EXPECT_EQ(ValidateJobId(id).code(), absl::StatusCode::kInvalidArgument) << id;
  }
}

TEST(ValidateJobId, MessageQuotesValueAndStatesRule) {
  EXPECT_EQ(Message(ValidateJobId("../etc")),
            "job id \"../etc\" is invalid: it contains \"..\"; job ids must match "
            "[a-z0-9][a-z0-9._-]{0,62} and must not contain \"..\"");
  EXPECT_THAT(Message(ValidateJobId("a/b")),
              HasSubstr("job id \"a/b\" is invalid: character '/' at offset 1 is not allowed"));
}

TEST(ValidateJobId, RejectsUpperCase) {
  EXPECT_THAT(Message(ValidateJobId("Llama")), HasSubstr("starts with 'L'"));
  EXPECT_THAT(Message(ValidateJobId("llaMa")), HasSubstr("character 'M' at offset 3"));
}

TEST(ValidateJobId, RejectsBadLeadingCharacter) {
  for (const char* id : {".hidden", "-flag", "_x", ".", "-"}) {
    const absl::Status s = ValidateJobId(id);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << id;
    EXPECT_THAT(Message(s), HasSubstr("starts with")) << id;
    EXPECT_THAT(Message(s), HasSubstr("[a-z0-9]")) << id;
  }
}

TEST(ValidateJobId, RejectsOtherCharacters) {
  for (const char* id : {"a b", "a:b", "a@b", "a+b", "a~", "caf\xc3\xa9"}) {
    EXPECT_EQ(ValidateJobId(id).code(), absl::StatusCode::kInvalidArgument) << id;
  }
}

TEST(ValidateJobId, EscapesControlCharactersInMessage) {
  const std::string id("a\nb\x01\0c", 6);
  const std::string msg = Message(ValidateJobId(id));
  EXPECT_THAT(msg, HasSubstr("job id \"a\\nb\\x01\\x00c\""));
  EXPECT_THAT(msg, HasSubstr("character '\\n' at offset 1"));
  EXPECT_EQ(msg.find('\n'), std::string::npos);
  EXPECT_EQ(msg.find('\0'), std::string::npos);
}

// ---- Node ids.

TEST(ValidateNodeId, AcceptsHostNames) {
  for (const char* id :
       {"gpu-node-17", "GPU-Node-17", "node17.cluster.local", "10.0.0.7", "host_a"}) {
    EXPECT_TRUE(ValidateNodeId(id).ok()) << id << ": " << ValidateNodeId(id);
  }
  EXPECT_TRUE(ValidateNodeId(std::string(kMaxNodeIdLength, 'N')).ok());
}

TEST(ValidateNodeId, RejectsSameClassesAsJobIds) {
  for (const char* id : {"", "..", "../x", "a..b", "a/b", ".a", "-a", "_a", "a b", "a:7401"}) {
    const absl::Status s = ValidateNodeId(id);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << id;
    EXPECT_THAT(Message(s), HasSubstr("node id \"")) << id;
    EXPECT_THAT(Message(s), HasSubstr("[A-Za-z0-9][A-Za-z0-9._-]{0,62}")) << id;
  }
  EXPECT_THAT(Message(ValidateNodeId(std::string(64, 'n'))), HasSubstr("64 bytes long"));
}

// ---- Item names.

TEST(ValidateItemName, AcceptsPrintableUtf8) {
  for (const char* name : {"model.layers.0.attn.q_proj.weight", "a", "../../etc/passwd",
                           "with space", "optimizer/state/step", "caf\xc3\xa9",
                           "\xe6\xa8\xa1\xe5\x9e\x8b", "emoji \xf0\x9f\x98\x80", "\"quoted\""}) {
    EXPECT_TRUE(ValidateItemName(name).ok()) << name << ": " << ValidateItemName(name);
  }
  EXPECT_TRUE(ValidateItemName(std::string(kMaxItemNameLength, 'x')).ok());
}

TEST(ValidateItemName, RejectsEmptyAndTooLong) {
  EXPECT_THAT(Message(ValidateItemName("")), HasSubstr("item name \"\" is invalid: it is empty"));
  const absl::Status s = ValidateItemName(std::string(kMaxItemNameLength + 1, 'x'));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(s), HasSubstr("1025 bytes long, at most 1024"));
  // The long value is shortened in the message.
  EXPECT_THAT(Message(s), HasSubstr("\"... (1025 bytes)"));
  EXPECT_LT(Message(s).size(), 400u);
}

TEST(ValidateItemName, RejectsControlCharacters) {
  struct Case {
    std::string name;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {std::string("a\0b", 3), "control character U+0000 at offset 1"},
      {"tab\there", "control character U+0009 at offset 3"},
      {"new\nline", "control character U+000A at offset 3"},
      {"del\x7f", "control character U+007F at offset 3"},
      {"c1\xc2\x85", "control character U+0085 at offset 2"},
  };
  for (const Case& c : cases) {
    const absl::Status s = ValidateItemName(c.name);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Message(s), HasSubstr(c.expected));
    EXPECT_THAT(Message(s), HasSubstr("well-formed UTF-8 without control characters"));
  }
}

TEST(ValidateItemName, RejectsMalformedUtf8) {
  for (const char* name : {"\xff", "a\x80", "\xc3", "\xc0\xaf" /* overlong '/' */,
                           "\xe0\x80\xaf" /* overlong */, "\xed\xa0\x80" /* surrogate */,
                           "\xf4\x90\x80\x80" /* > U+10FFFF */, "\xf0\x9f\x98" /* cut */}) {
    const absl::Status s = ValidateItemName(name);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Message(s), HasSubstr("is not well-formed UTF-8"));
  }
}

// ---- QuoteForMessage.

TEST(QuoteForMessage, EscapesWhatIsNotPrintable) {
  EXPECT_EQ(QuoteForMessage("plain"), "\"plain\"");
  EXPECT_EQ(QuoteForMessage(""), "\"\"");
  EXPECT_EQ(QuoteForMessage("a\"b\\c"), "\"a\\\"b\\\\c\"");
  EXPECT_EQ(QuoteForMessage("\t\r\n"), "\"\\t\\r\\n\"");
  EXPECT_EQ(QuoteForMessage(std::string("\0\x1b\x7f", 3)), "\"\\x00\\x1b\\x7f\"");
  EXPECT_EQ(QuoteForMessage("caf\xc3\xa9"), "\"caf\xc3\xa9\"");  // UTF-8 kept
  EXPECT_EQ(QuoteForMessage("\xc2\x85"), "\"\\xc2\\x85\"");      // C1 control
  EXPECT_EQ(QuoteForMessage("\xff"
                            "a"),
            "\"\\xffa\"");  // stray byte
}

TEST(QuoteForMessage, ShortensLongValuesAtCharacterBoundary) {
  const std::string x128(128, 'x');
  EXPECT_EQ(QuoteForMessage(x128), absl::StrCat("\"", x128, "\""));
  EXPECT_EQ(QuoteForMessage(std::string(200, 'x')), absl::StrCat("\"", x128, "\"... (200 bytes)"));
  // 127 ASCII bytes then a 2-byte character that would cross the limit.
  const std::string value = std::string(127, 'x') + "\xc3\xa9" + "tail";
  EXPECT_EQ(QuoteForMessage(value), absl::StrCat("\"", std::string(127, 'x'), "\"... (133 bytes)"));
}

// ---- Path components and JoinUnderRoot.

TEST(ValidatePathComponent, AcceptsAndRejects) {
  for (const char* ok : {"a", "...", ".hidden", "a b", "rank-00000.bin", "-"}) {
    EXPECT_TRUE(ValidatePathComponent(ok).ok()) << ok;
  }
  EXPECT_TRUE(ValidatePathComponent(std::string(255, 'c')).ok());
  struct Case {
    std::string component;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"", "it is empty"},
      {".", "is a relative reference"},
      {"..", "is a relative reference"},
      {"a/b", "contains '/' at offset 1"},
      {"/", "contains '/' at offset 0"},
      {std::string("a\0b", 3), "contains NUL at offset 1"},
      {std::string(256, 'c'), "256 bytes long"},
  };
  for (const Case& c : cases) {
    const absl::Status s = ValidatePathComponent(c.component);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.component;
    EXPECT_THAT(Message(s), HasSubstr(c.expected));
    EXPECT_THAT(Message(s), HasSubstr("no '/' or NUL"));
  }
}

TEST(JoinUnderRoot, JoinsValidComponents) {
  EXPECT_EQ(*JoinUnderRoot("/var/lib/ckpt", {"job-1", "node-a", "rank-00003.bin"}),
            "/var/lib/ckpt/job-1/node-a/rank-00003.bin");
  EXPECT_EQ(*JoinUnderRoot("/var/lib/ckpt/", {"job-1"}), "/var/lib/ckpt/job-1");
  EXPECT_EQ(*JoinUnderRoot("/var/lib/ckpt///", {"job-1"}), "/var/lib/ckpt/job-1");
  EXPECT_EQ(*JoinUnderRoot("/", {"job-1"}), "/job-1");
  EXPECT_EQ(*JoinUnderRoot("///", {"job-1"}), "/job-1");
  EXPECT_EQ(*JoinUnderRoot("relative", {"x"}), "relative/x");
  EXPECT_EQ(*JoinUnderRoot("/root", {}), "/root");
  EXPECT_EQ(*JoinUnderRoot("/root/", {}), "/root");
}

TEST(JoinUnderRoot, AcceptsStringSpan) {
  const std::vector<std::string> parts = {"a", "b", "c"};
  EXPECT_EQ(*JoinUnderRoot("/r", parts), "/r/a/b/c");
}

TEST(JoinUnderRoot, RejectsUnsafeComponents) {
  struct Case {
    std::vector<std::string> components;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"job", ".."}, "component 1 of 2: path component \"..\" is invalid"},
      {{"..", "etc"}, "component 0 of 2: path component \"..\" is invalid"},
      {{"."}, "component 0 of 1: path component \".\" is invalid"},
      {{"a/b"}, "path component \"a/b\" is invalid: it contains '/'"},
      {{"../etc"}, "path component \"../etc\" is invalid: it contains '/'"},
      {{"/etc"}, "contains '/' at offset 0"},
      {{"ok", ""}, "component 1 of 2: path component \"\" is invalid: it is empty"},
      {{std::string("a\0", 2)}, "path component \"a\\x00\" is invalid: it contains NUL"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::string> path = JoinUnderRoot("/data", c.components);
    ASSERT_FALSE(path.ok()) << *path;
    EXPECT_EQ(path.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Message(path.status()), HasSubstr("cannot join under \"/data\""));
    EXPECT_THAT(Message(path.status()), HasSubstr(c.expected));
  }
}

TEST(JoinUnderRoot, RejectsBadRoot) {
  EXPECT_EQ(JoinUnderRoot("", {"a"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(JoinUnderRoot(std::string("/a\0b", 4), {"a"}).status()),
              HasSubstr("contains NUL"));
}

TEST(JoinUnderRoot, ValidatedIdsAlwaysJoin) {
  // Anything ValidateJobId/ValidateNodeId accept is a safe component.
  for (const char* id : {"a", "a.b", "x-", "0", "z_9"}) {
    ASSERT_TRUE(ValidateJobId(id).ok());
    EXPECT_TRUE(JoinUnderRoot("/r", {id}).ok()) << id;
  }
}

// ---- RankFileName.

TEST(RankFileName, PadsToFiveDigits) {
  EXPECT_EQ(RankFileName(0), "rank-00000.bin");
  EXPECT_EQ(RankFileName(7), "rank-00007.bin");
  EXPECT_EQ(RankFileName(12345), "rank-12345.bin");
  EXPECT_EQ(RankFileName(99999), "rank-99999.bin");
  EXPECT_EQ(RankFileName(100000), "rank-100000.bin");
  EXPECT_EQ(RankFileName(4294967295u), "rank-4294967295.bin");
  EXPECT_TRUE(ValidatePathComponent(RankFileName(4294967295u)).ok());
}

}  // namespace
}  // namespace ckpt

namespace ckpt {
namespace {

TEST(ValidateStep, AcceptsZeroToTwoPow53MinusOne) {
  EXPECT_TRUE(ValidateStep(0).ok());
  EXPECT_TRUE(ValidateStep(1).ok());
  EXPECT_TRUE(ValidateStep(kMaxStep).ok());
  EXPECT_EQ(kMaxStep, 9007199254740991u);
}

TEST(ValidateStep, RejectsLargerStepsNamingTheLimit) {
  for (uint64_t step : {kMaxStep + 1, uint64_t{1} << 62, ~uint64_t{0}}) {
    const absl::Status s = ValidateStep(step);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << step;
    EXPECT_NE(s.message().find(std::to_string(step)), std::string::npos) << s;
    EXPECT_NE(s.message().find("9007199254740991"), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace ckpt
