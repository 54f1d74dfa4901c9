// Trainer identities (ckpt-meta --trainer-tokens-file): the file's format and
// the job patterns. The RPC checks run through the daemons in
// tests/security/trainer_token_test.py. Token files and tokens: at least 128
// bits, files checked on the opened descriptor (issue 34 finding 8). And the
// channel arguments of callers that fail over between meta replicas.
#include "common/grpc_security.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/secret_file.h"
#include "support/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(TrainerTokens, ParsesLinesSkipsCommentsAndBlankLines) {
  absl::StatusOr<std::vector<TrainerToken>> t = ParseTrainerTokens(
      "# job A's trainers\n"
      "\n"
      "  tok-aaaaaaaaaaaaaaaaaaaa   job-a,exp-*  \n"
      "tok-bbbbbbbbbbbbbbbbbbbb\t*\n",
      "f");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[0].token, "tok-aaaaaaaaaaaaaaaaaaaa");
  EXPECT_THAT((*t)[0].jobs, ElementsAre("job-a", "exp-*"));
  EXPECT_THAT((*t)[1].jobs, ElementsAre("*"));
}

TEST(TrainerTokens, RefusesBadLinesNamingTheLine) {
  const std::pair<const char*, const char*> cases[] = {
      {"tok-aaaaaaaaaaaaaaaaaaaa\n", "has 1 fields"},
      {"short job-a\n", "shorter than 22"},
      {"tok-aaaaaaaaaaaaaaaaa job-a\n", "shorter than 22 characters (128 bits): make one with"},
      {"tok-aaaaaaaaaaaaaaaaaaaa Job-A\n", "not a job id"},
      {"tok-aaaaaaaaaaaaaaaaaaaa job-a,,job-b\n", "\"\" is not a job id"},
      {"tok-aaaaaaaaaaaaaaaaaaaa ../x\n", "not a job id"},
      {"tok-aaaaaaaaaaaaaaaaaaaa a*b\n", "not a job id"},
      {"tok-aaaaaaaaaaaaaaaaaaaa job-a\ntok-aaaaaaaaaaaaaaaaaaaa job-b\n", "line 2: the token is on an earlier line"},
      {"tok-aaaaaaaaaaaaaaaaaaaa job-a extra\n", "has 3 fields"},
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

// A file in a temp dir holding `text`, with `mode`.
std::string WriteFile(const ckpt::testing::TempDir& dir, const std::string& name, const std::string& text,
                      mode_t mode) {
  const std::string path = dir.path() + "/" + name;
  std::ofstream(path) << text;
  EXPECT_EQ(::chmod(path.c_str(), mode), 0);
  return path;
}

const std::string kGoodToken = "c2VjcmV0LXRva2VuLW9mLTMyLWJ5dGVzISEhISEhIQ==";  // 44 characters

TEST(TokenFiles, ATokenOfAtLeast22CharactersIsRead) {
  auto dir = ckpt::testing::TempDir::Create();
  ASSERT_TRUE(dir.ok());
  absl::StatusOr<std::string> t = ReadTokenFile(WriteFile(*dir, "t", "  " + kGoodToken + "\n", 0600));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, kGoodToken);
  EXPECT_TRUE(ReadTokenFile(WriteFile(*dir, "22", std::string(22, 'k'), 0640)).ok());
  EXPECT_TRUE(ReadTokenFile(WriteFile(*dir, "ro", kGoodToken, 0400)).ok());
}

TEST(TokenFiles, ATokenShorterThan128BitsIsRefusedSayingHowToMakeOne) {
  auto dir = ckpt::testing::TempDir::Create();
  ASSERT_TRUE(dir.ok());
  for (const std::string& token : {std::string("x"), std::string(21, 'k')}) {
    const std::string path = WriteFile(*dir, "short", token + "\n", 0600);
    absl::StatusOr<std::string> t = ReadTokenFile(path);
    ASSERT_FALSE(t.ok()) << token;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(), HasSubstr(path));
    EXPECT_THAT(t.status().message(), HasSubstr("at least 22"));
    EXPECT_THAT(t.status().message(), HasSubstr("head -c 32 /dev/urandom | base64"));
    EXPECT_THAT(t.status().message(), ::testing::Not(HasSubstr(std::string(" ") + token + " ")));
  }
}

TEST(TokenFiles, AModeWiderThan0640IsRefused) {
  auto dir = ckpt::testing::TempDir::Create();
  ASSERT_TRUE(dir.ok());
  for (mode_t mode : {0644, 0660, 0604, 0700, 0620}) {
    const std::string path = WriteFile(*dir, "wide", kGoodToken, mode);
    absl::StatusOr<std::string> t = ReadTokenFile(path);
    ASSERT_FALSE(t.ok()) << std::oct << mode;
    EXPECT_THAT(t.status().message(), HasSubstr("no wider than 0640")) << std::oct << mode;
    EXPECT_THAT(t.status().message(), HasSubstr("chmod 0600")) << std::oct << mode;
  }
  EXPECT_THAT(ReadTokenFile(WriteFile(*dir, "world", kGoodToken, 0644)).status().message(),
              HasSubstr("readable by every user"));
  // The trainer tokens file too.
  const std::string trainers = WriteFile(*dir, "trainers", kGoodToken + " job-a\n", 0660);
  EXPECT_THAT(ReadTrainerTokensFile(trainers).status().message(), HasSubstr("no wider than 0640"));
  ASSERT_EQ(::chmod(trainers.c_str(), 0640), 0);
  EXPECT_TRUE(ReadTrainerTokensFile(trainers).ok());
}

TEST(TokenFiles, ASymlinkIsRefusedNotFollowed) {
  auto dir = ckpt::testing::TempDir::Create();
  ASSERT_TRUE(dir.ok());
  const std::string target = WriteFile(*dir, "real", kGoodToken, 0600);
  const std::string link = dir->path() + "/link";
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  absl::StatusOr<std::string> t = ReadTokenFile(link);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("symbolic link"));
  // A directory on the way may be a link (a Kubernetes Secret's ..data).
  const std::string sub = dir->path() + "/sub";
  ASSERT_EQ(::mkdir(sub.c_str(), 0700), 0);
  WriteFile(*dir, "sub/token", kGoodToken, 0600);
  ASSERT_EQ(::symlink(sub.c_str(), (dir->path() + "/..data").c_str()), 0);
  EXPECT_TRUE(ReadTokenFile(dir->path() + "/..data/token").ok());
}

TEST(TokenFiles, NotARegularFileIsRefused) {
  auto dir = ckpt::testing::TempDir::Create();
  ASSERT_TRUE(dir.ok());
  const std::string fifo = dir->path() + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THAT(ReadTokenFile(fifo).status().message(), HasSubstr("not a regular file"));
  EXPECT_THAT(ReadTokenFile(dir->path()).status().message(), HasSubstr("not a regular file"));
}

TEST(TokenFiles, AFileOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another user";
  auto dir = ckpt::testing::TempDir::Create();
  ASSERT_TRUE(dir.ok());
  const std::string path = WriteFile(*dir, "theirs", kGoodToken, 0600);
  ASSERT_EQ(::chown(path.c_str(), 65534, 65534), 0);
  absl::StatusOr<std::string> t = ReadTokenFile(path);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("owned by uid 65534"));
  EXPECT_THAT(t.status().message(), HasSubstr("or to root"));
}

TEST(TokenFromEnvironment, AShortCkptTokenIsRefused) {
  ::unsetenv("CKPT_TOKEN_FILE");
  ::setenv("CKPT_TOKEN", "not-the-admin", 1);
  absl::StatusOr<std::string> t = TokenFromEnvironment("");
  EXPECT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("CKPT_TOKEN holds a token of 13 characters"));
  EXPECT_THAT(t.status().message(), ::testing::Not(HasSubstr("not-the-admin")));
  ::setenv("CKPT_TOKEN", kGoodToken.c_str(), 1);
  t = TokenFromEnvironment("");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, kGoodToken);
  ::unsetenv("CKPT_TOKEN");
  t = TokenFromEnvironment("");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*t, "");
}

// The connect timeout of a channel, and how often the arguments give it.
std::pair<int, int> MinReconnect(const grpc::ChannelArguments& args) {
  grpc_channel_args c = args.c_channel_args();
  int value = -1;
  int count = 0;
  for (size_t i = 0; i < c.num_args; ++i) {
    if (std::string(c.args[i].key) == GRPC_ARG_MIN_RECONNECT_BACKOFF_MS) {
      value = c.args[i].value.integer;
      ++count;
    }
  }
  return {value, count};
}

// A channel to a list of meta replicas gets a connect timeout of 5 s, given
// once: given twice (20 s, then 5 s) gRPC 1.51 used the first, and a paused
// replica first in the list cost 20 s per TLS handshake that never ended.
TEST(ChannelArgs, AListGetsOneShortConnectTimeoutAndOneAddressTheDefault) {
  grpc::ChannelArguments list;
  SetReconnectArgs(&list, "127.0.0.1:7400,127.0.0.1:7401");
  SetFailoverArgs("127.0.0.1:7400,127.0.0.1:7401", &list);
  EXPECT_EQ(MinReconnect(list), std::make_pair(5000, 1));

  grpc::ChannelArguments one;
  SetReconnectArgs(&one, "127.0.0.1:7400");
  SetFailoverArgs("127.0.0.1:7400", &one);
  EXPECT_EQ(MinReconnect(one), std::make_pair(20000, 1));

  grpc::ChannelArguments local;  // a unix socket (no address given)
  SetReconnectArgs(&local);
  EXPECT_EQ(MinReconnect(local), std::make_pair(20000, 1));
}

// The TLS server name a channel to a list sends: the first address's host
// (an IP literal is then sent as no server name), not the whole list, which
// every replica logged as "No match found for server name".
std::string TargetNameOverride(const grpc::ChannelArguments& args) {
  grpc_channel_args c = args.c_channel_args();
  for (size_t i = 0; i < c.num_args; ++i) {
    if (std::string(c.args[i].key) == GRPC_SSL_TARGET_NAME_OVERRIDE_ARG) return c.args[i].value.string;
  }
  return "";
}

TEST(ChannelArgs, AListNamesItsFirstHostAsTheTlsServerName) {
  for (const auto& [addresses, want] : std::vector<std::pair<std::string, std::string>>{
           {"127.0.0.1:7400,127.0.0.2:7400", "127.0.0.1"},
           {"[::1]:7400,[::1]:7401", "::1"},
           {"meta-a.example:7400,meta-b.example:7400", "meta-a.example"},
           {"127.0.0.1:7400", ""}}) {
    grpc::ChannelArguments args;
    SetFailoverArgs(addresses, &args);
    EXPECT_EQ(TargetNameOverride(args), want) << addresses;
  }
}

}  // namespace
}  // namespace ckpt
