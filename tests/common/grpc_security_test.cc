// Trainer identities (ckpt-meta --trainer-tokens-file): the file's format and
// the job patterns. The RPC checks run through the daemons in
// tests/security/trainer_token_test.py.
#include "common/grpc_security.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace ckpt {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(TrainerTokens, ParsesLinesSkipsCommentsAndBlankLines) {
  absl::StatusOr<std::vector<TrainerToken>> t = ParseTrainerTokens(
      "# job A's trainers\n"
      "\n"
      "  tok-aaaaaaaaaaaaaaaa   job-a,exp-*  \n"
      "tok-bbbbbbbbbbbbbbbb\t*\n",
      "f");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[0].token, "tok-aaaaaaaaaaaaaaaa");
  EXPECT_THAT((*t)[0].jobs, ElementsAre("job-a", "exp-*"));
  EXPECT_THAT((*t)[1].jobs, ElementsAre("*"));
}

TEST(TrainerTokens, RefusesBadLinesNamingTheLine) {
  const std::pair<const char*, const char*> cases[] = {
      {"tok-aaaaaaaaaaaaaaaa\n", "has 1 fields"},
      {"short job-a\n", "shorter than 16"},
      {"tok-aaaaaaaaaaaaaaaa Job-A\n", "not a job id"},
      {"tok-aaaaaaaaaaaaaaaa job-a,,job-b\n", "\"\" is not a job id"},
      {"tok-aaaaaaaaaaaaaaaa ../x\n", "not a job id"},
      {"tok-aaaaaaaaaaaaaaaa a*b\n", "not a job id"},
      {"tok-aaaaaaaaaaaaaaaa job-a\ntok-aaaaaaaaaaaaaaaa job-b\n", "line 2: the token is on an earlier line"},
      {"tok-aaaaaaaaaaaaaaaa job-a extra\n", "has 3 fields"},
  };
  for (const auto& [text, want] : cases) {
    absl::StatusOr<std::vector<TrainerToken>> t = ParseTrainerTokens(text, "/etc/ckpt/trainers");
    ASSERT_FALSE(t.ok()) << text;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(), HasSubstr(want)) << text;
    EXPECT_THAT(t.status().message(), HasSubstr("\"/etc/ckpt/trainers\" line ")) << text;
  }
}

TEST(TrainerTokens, PatternsMatchIdsPrefixesOrEverything) {
  EXPECT_TRUE(JobPatternMatches("job-a", "job-a"));
  EXPECT_FALSE(JobPatternMatches("job-a", "job-ab"));
  EXPECT_FALSE(JobPatternMatches("job-a", "job-"));
  EXPECT_TRUE(JobPatternMatches("exp-*", "exp-"));
  EXPECT_TRUE(JobPatternMatches("exp-*", "exp-7"));
  EXPECT_FALSE(JobPatternMatches("exp-*", "ex"));
  EXPECT_FALSE(JobPatternMatches("exp-*", "other"));
  EXPECT_TRUE(JobPatternMatches("*", "anything"));
}

}  // namespace
}  // namespace ckpt
