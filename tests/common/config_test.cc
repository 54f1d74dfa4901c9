#include "common/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace ckpt {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

std::string Message(const absl::Status& s) { return std::string(s.message()); }

// A fresh directory under the test temp dir, removed with its files at the end.
class ConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir();
    if (tmpl.empty() || tmpl.back() != '/') tmpl += '/';
    tmpl += "config_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    for (const std::string& f : files_) ::unlink(f.c_str());
    ::rmdir(dir_.c_str());
  }

  // Writes `text` to dir_/name and returns the path.
  std::string WriteFile(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    out.close();
    EXPECT_TRUE(out.good()) << path;
    files_.push_back(path);
    return path;
  }

  absl::StatusOr<Config> LoadYaml(const std::string& text) {
    ConfigSources sources;
    sources.file_path = WriteFile("ckpt.yaml", text);
    return Config::Load(sources);
  }

  std::string dir_;
  std::vector<std::string> files_;
};

// ---- ParseBytes.

TEST(ParseBytes, AcceptsPlainAndSuffixedSizes) {
  const std::vector<std::pair<std::string, uint64_t>> cases = {
      {"0", 0},
      {"4096", 4096},
      {"4096B", 4096},
      {"1b", 1},
      {"4GiB", uint64_t{4} << 30},
      {"512MiB", uint64_t{512} << 20},
      {"1G", 1000000000},
      {"1GB", 1000000000},
      {"100KB", 100000},
      {"100kb", 100000},
      {"100kB", 100000},
      {"1k", 1000},
      {"1Ki", 1024},
      {"1KIB", 1024},
      {"1kib", 1024},
      {"3M", 3000000},
      {"3Mi", 3 << 20},
      {"2TB", 2000000000000},
      {"2TiB", uint64_t{2} << 40},
      {"1PiB", uint64_t{1} << 50},
      {"1P", 1000000000000000},
      {"1EiB", uint64_t{1} << 60},
      {"15EiB", uint64_t{15} << 60},
      {"18EB", 18000000000000000000u},
      {"1.5 GiB", uint64_t{3} << 29},
      {"1.50GiB", uint64_t{3} << 29},
      {"0.5KiB", 512},
      {"2.25KiB", 2304},
      {"1.000", 1},
      {"  8 KiB \t", 8192},
      {"007", 7},
      {"18446744073709551615", std::numeric_limits<uint64_t>::max()},
      {"18446744073709551615B", std::numeric_limits<uint64_t>::max()},
  };
  for (const auto& [text, expected] : cases) {
    absl::StatusOr<uint64_t> v = ParseBytes(text);
    ASSERT_TRUE(v.ok()) << text << ": " << v.status();
    EXPECT_EQ(*v, expected) << text;
  }
}

TEST(ParseBytes, RejectsGarbageNegativesAndOverflow) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "empty"},
      {"   ", "empty"},
      {"-1", "must not be negative"},
      {"-1GiB", "must not be negative"},
      {"+1", "expected a number of bytes"},
      {"abc", "expected a number of bytes"},
      {"GiB", "expected a number of bytes"},
      {".5G", "expected a number of bytes"},
      {"1.", "expected digits after '.'"},
      {"4XB", "unknown unit \"XB\""},
      {"4GiBs", "unknown unit \"GiBs\""},
      {"4 GiB extra", "unknown unit \"GiB extra\""},
      {"1e9", "unknown unit \"e9\""},
      {"0x10", "unknown unit \"x10\""},
      {"1,024", "unknown unit \",024\""},
      {"0.3KiB", "not a whole number of bytes"},
      {"0.1", "not a whole number of bytes"},
      {"1.0000000000000000001GiB", "too many decimal places"},
      {"18446744073709551616", "too large"},
      {"16EiB", "too large"},
      {"17179869184GiB", "too large"},
      {"99999999999999999999999999", "too large"},
  };
  for (const auto& [text, why] : cases) {
    absl::StatusOr<uint64_t> v = ParseBytes(text);
    ASSERT_FALSE(v.ok()) << text << " parsed as " << *v;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(Message(v.status()), HasSubstr(absl::StrCat("invalid byte size \"", text, "\"")));
    EXPECT_THAT(Message(v.status()), HasSubstr(why)) << text;
  }
}

TEST(ParseBytes, UnknownUnitListsAllowedUnits) {
  const std::string msg = Message(ParseBytes("4XB").status());
  EXPECT_THAT(msg, HasSubstr("KiB"));
  EXPECT_THAT(msg, HasSubstr("powers of 1000"));
  EXPECT_THAT(msg, HasSubstr("powers of 1024"));
}

// ---- FormatBytes.

TEST(FormatBytes, UsesIecUnitsAndTwoDecimals) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1), "1 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1024), "1 KiB");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(1280), "1.25 KiB");
  EXPECT_EQ(FormatBytes(uint64_t{4} << 30), "4 GiB");
  EXPECT_EQ(FormatBytes(uint64_t{3} << 29), "1.5 GiB");
  EXPECT_EQ(FormatBytes(uint64_t{1} << 40), "1 TiB");
  EXPECT_EQ(FormatBytes(uint64_t{1} << 60), "1 EiB");
  EXPECT_EQ(FormatBytes(std::numeric_limits<uint64_t>::max()), "16 EiB");
  EXPECT_EQ(FormatBytes(1000000000), "953.67 MiB");
  EXPECT_EQ(FormatBytes((uint64_t{1} << 20) + 10), "1 MiB");  // rounds down
  EXPECT_EQ(FormatBytes((uint64_t{1} << 30) - 1), "1 GiB");   // not "1024 MiB"
  EXPECT_EQ(FormatBytes((uint64_t{1} << 20) * 1023 + 1), "1023 MiB");
}

TEST(FormatBytes, ExactValuesParseBack) {
  for (uint64_t v : {uint64_t{0}, uint64_t{512}, uint64_t{1536}, uint64_t{4} << 30,
                     uint64_t{3} << 29, uint64_t{1} << 60, uint64_t{1280}}) {
    absl::StatusOr<uint64_t> back = ParseBytes(FormatBytes(v));
    ASSERT_TRUE(back.ok()) << FormatBytes(v) << ": " << back.status();
    EXPECT_EQ(*back, v) << FormatBytes(v);
  }
}

// ---- ParseDuration.

TEST(ParseDuration, AcceptsUnitsAndPlainMilliseconds) {
  const std::vector<std::pair<std::string, absl::Duration>> cases = {
      {"5s", absl::Seconds(5)},
      {"500ms", absl::Milliseconds(500)},
      {"2m", absl::Minutes(2)},
      {"1h", absl::Hours(1)},
      {"250us", absl::Microseconds(250)},
      {"10ns", absl::Nanoseconds(10)},
      {"1.5s", absl::Milliseconds(1500)},
      {"1h30m", absl::Minutes(90)},
      {"0s", absl::ZeroDuration()},
      {"+5s", absl::Seconds(5)},
      {" 5s\t", absl::Seconds(5)},
      {"0", absl::ZeroDuration()},
      {"1500", absl::Milliseconds(1500)},
      {"007", absl::Milliseconds(7)},
      {"9223372036854775807", absl::Milliseconds(std::numeric_limits<int64_t>::max())},
  };
  for (const auto& [text, expected] : cases) {
    absl::StatusOr<absl::Duration> d = ParseDuration(text);
    ASSERT_TRUE(d.ok()) << text << ": " << d.status();
    EXPECT_EQ(*d, expected) << text;
  }
}

TEST(ParseDuration, RejectsNegativeInfiniteAndGarbage) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "empty"},
      {"  ", "empty"},
      {"-5s", "must not be negative"},
      {"-1", "must not be negative"},
      {"inf", "expected a plain integer number of milliseconds"},
      {"+inf", "expected a plain integer"},
      {"5x", "expected a plain integer"},
      {"5S", "expected a plain integer"},  // units are case-sensitive
      {"1d", "expected a plain integer"},
      {"s", "expected a plain integer"},
      {"5 s", "expected a plain integer"},
      {"1.5", "expected a plain integer"},  // plain numbers must be integers
      {"abc", "expected a plain integer"},
      {"9223372036854775808", "too large"},
      {"9223372036854775807h", "too large"},
  };
  for (const auto& [text, why] : cases) {
    absl::StatusOr<absl::Duration> d = ParseDuration(text);
    ASSERT_FALSE(d.ok()) << text << " parsed as " << *d;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(Message(d.status()), HasSubstr(absl::StrCat("invalid duration \"", text, "\"")));
    EXPECT_THAT(Message(d.status()), HasSubstr(why)) << text;
  }
}

// ---- Key names and their env / flag spellings.

TEST(ConfigKeys, ValidKeys) {
  for (const char* key : {"lease_ms", "memory_dir", "metrics.listen", "a", "a1.b2.c3", "x9_y"}) {
    EXPECT_TRUE(ValidateConfigKey(key).ok()) << key << ": " << ValidateConfigKey(key);
  }
}

TEST(ConfigKeys, InvalidKeys) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "it is empty"},
      {".a", "empty segment"},
      {"a.", "empty segment"},
      {"a..b", "empty segment"},
      {"_a", "starts or ends with '_'"},
      {"a_", "starts or ends with '_'"},
      {"a._b", "starts or ends with '_'"},
      {"a__b", "contains \"__\""},
      {"Lease_ms", "did you mean \"lease_ms\"?"},
      {"memory-dir", "did you mean \"memory_dir\"?"},
      {"a b", "character \" \" is not allowed"},
      {"a/b", "character \"/\" is not allowed"},
  };
  for (const auto& [key, why] : cases) {
    const absl::Status s = ValidateConfigKey(key);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << key;
    EXPECT_THAT(Message(s), HasSubstr(why)) << key;
  }
}

TEST(ConfigKeys, EnvAndFlagSpellingsRoundTrip) {
  EXPECT_EQ(EnvVarForKey("lease_ms"), "CKPT_LEASE_MS");
  EXPECT_EQ(EnvVarForKey("memory_dir"), "CKPT_MEMORY_DIR");
  EXPECT_EQ(EnvVarForKey("metrics.listen"), "CKPT_METRICS__LISTEN");
  EXPECT_EQ(EnvVarForKey("a.b_c.d"), "CKPT_A__B_C__D");
  EXPECT_EQ(FlagForKey("memory_dir"), "--memory-dir");
  EXPECT_EQ(FlagForKey("metrics.listen"), "--metrics.listen");
  for (const char* key : {"lease_ms", "memory_dir", "metrics.listen", "a.b_c.d", "x1"}) {
    EXPECT_EQ(*KeyForEnvVar(EnvVarForKey(key)), key);
    EXPECT_EQ(*KeyForFlag(FlagForKey(key)), key);
  }
}

TEST(ConfigKeys, KeyForFlagAcceptsDashVariants) {
  EXPECT_EQ(*KeyForFlag("--memory-dir"), "memory_dir");
  EXPECT_EQ(*KeyForFlag("-memory-dir"), "memory_dir");
  EXPECT_EQ(*KeyForFlag("memory-dir"), "memory_dir");
  EXPECT_EQ(*KeyForFlag("memory_dir"), "memory_dir");
  EXPECT_EQ(*KeyForFlag("--metrics.listen"), "metrics.listen");
  for (const char* bad : {"--", "---x", "--Memory-dir", "--a..b", "--a--b", "--x-", "--a b"}) {
    absl::StatusOr<std::string> key = KeyForFlag(bad);
    ASSERT_FALSE(key.ok()) << bad << " -> " << *key;
    EXPECT_THAT(Message(key.status()), HasSubstr(absl::StrCat("flag \"", bad, "\"")));
  }
}

TEST(ConfigKeys, KeyForEnvVarRejectsMalformedNames) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"LEASE_MS", "lacks the CKPT_ prefix"},
      {"CKPT_", "nothing follows CKPT_"},
      {"CKPT_lease_ms", "character \"l\" is not allowed"},
      {"CKPT_A-B", "character \"-\" is not allowed"},
      {"CKPT_A___B", "starts or ends with '_'"},
      {"CKPT_A_", "starts or ends with '_'"},
      {"CKPT__A", "it maps to key \"_a\", which is invalid: a segment starts or ends"},
      {"CKPT_A__", "it maps to key \"a.\", which is invalid: it has an empty segment"},
      {"CKPT_A____B", "it maps to key \"a..b\", which is invalid: it has an empty segment"},
  };
  for (const auto& [name, why] : cases) {
    absl::StatusOr<std::string> key = KeyForEnvVar(name);
    ASSERT_FALSE(key.ok()) << name << " -> " << *key;
    EXPECT_EQ(key.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Message(key.status()),
                HasSubstr(absl::StrCat("environment variable \"", name, "\"")));
    EXPECT_THAT(Message(key.status()), HasSubstr(why)) << name;
  }
}

// ---- Environment capture.

TEST(Environment, FromEnvp) {
  const char* envp[] = {"A=1", "CKPT_X=a=b", "EMPTY=", "NOEQUALS", "A=2", nullptr};
  const std::map<std::string, std::string> env = EnvironmentFromEnvp(envp);
  EXPECT_EQ(env,
            (std::map<std::string, std::string>{{"A", "1"}, {"CKPT_X", "a=b"}, {"EMPTY", ""}}));
  EXPECT_THAT(EnvironmentFromEnvp(nullptr), IsEmpty());
}

TEST(Environment, CaptureMatchesEnviron) {
  EXPECT_EQ(CaptureEnvironment(), EnvironmentFromEnvp(environ));
}

// ---- Load: layering.

TEST_F(ConfigFileTest, LaterSourcesWin) {
  ConfigSources sources;
  sources.file_path = WriteFile("ckpt.yaml",
                                "from_file: f\n"
                                "file_env: f\n"
                                "file_flag: f\n"
                                "all: f\n");
  sources.env = {{"CKPT_FILE_ENV", "e"}, {"CKPT_ALL", "e"}, {"CKPT_ENV_ONLY", "e"},
                 {"PATH", "/usr/bin"},   {"HOME", "/root"}, {"ckpt_lower", "ignored"}};
  sources.flags = {{"--file-flag", "g"}, {"--all", "g"}, {"flag-only", "g"}};
  absl::StatusOr<Config> config = Config::Load(sources);
  ASSERT_TRUE(config.ok()) << config.status();

  EXPECT_EQ(*config->GetString("from_file"), "f");
  EXPECT_EQ(*config->GetString("file_env"), "e");
  EXPECT_EQ(*config->GetString("file_flag"), "g");
  EXPECT_EQ(*config->GetString("all"), "g");
  EXPECT_EQ(*config->GetString("env_only"), "e");
  EXPECT_EQ(*config->GetString("flag_only"), "g");
  EXPECT_EQ(config->values().size(), 6u);  // PATH, HOME, ckpt_lower ignored

  EXPECT_EQ(config->Find("from_file")->source, ConfigSource::kFile);
  EXPECT_EQ(config->Find("from_file")->origin, absl::StrCat("file ", sources.file_path, ":1:12"));
  EXPECT_EQ(config->Find("file_env")->source, ConfigSource::kEnv);
  EXPECT_EQ(config->Find("file_env")->origin, "env CKPT_FILE_ENV");
  EXPECT_EQ(config->Find("all")->source, ConfigSource::kFlag);
  EXPECT_EQ(config->Find("all")->origin, "flag --all");
  EXPECT_EQ(config->Find("flag_only")->origin, "flag --flag-only");
}

TEST(ConfigLoad, EnvAndFlagsWithoutFile) {
  ConfigSources sources;
  sources.env = {{"CKPT_METRICS__LISTEN", "0.0.0.0:9401"}, {"CKPT_LEASE_MS", "5000"}};
  sources.flags = {{"memory_dir", "/dev/shm/ckpt"}, {"--metrics.path", "/metrics"}};
  absl::StatusOr<Config> config = Config::Load(sources);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(*config->GetString("metrics.listen"), "0.0.0.0:9401");
  EXPECT_EQ(*config->GetInt64("lease_ms"), 5000);
  EXPECT_EQ(*config->GetString("memory_dir"), "/dev/shm/ckpt");
  EXPECT_EQ(*config->GetString("metrics.path"), "/metrics");
  EXPECT_EQ(config->Find("metrics.path")->origin, "flag --metrics.path");
}

TEST(ConfigLoad, EmptySourcesGiveEmptyConfig) {
  absl::StatusOr<Config> config = Config::Load(ConfigSources{});
  ASSERT_TRUE(config.ok());
  EXPECT_THAT(config->values(), IsEmpty());
  EXPECT_FALSE(config->Has("x"));
  EXPECT_EQ(config->Find("x"), nullptr);
}

TEST(ConfigLoad, EmptyEnvValueIsAValue) {
  ConfigSources sources;
  sources.env = {{"CKPT_MEMORY_DIR", ""}};
  absl::StatusOr<Config> config = Config::Load(sources);
  ASSERT_TRUE(config.ok());
  EXPECT_TRUE(config->Has("memory_dir"));
  EXPECT_EQ(config->GetStringOr("memory_dir", "default"), "");
}

TEST(ConfigLoad, RejectsMalformedCkptEnvVar) {
  ConfigSources sources;
  sources.env = {{"CKPT_lease_ms", "1"}};
  absl::StatusOr<Config> config = Config::Load(sources);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(config.status()), HasSubstr("environment variable \"CKPT_lease_ms\""));
}

TEST(ConfigLoad, RejectsMalformedFlag) {
  ConfigSources sources;
  sources.flags = {{"--Memory-Dir", "x"}};
  absl::StatusOr<Config> config = Config::Load(sources);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(config.status()), HasSubstr("flag \"--Memory-Dir\""));
  EXPECT_THAT(Message(config.status()), HasSubstr("did you mean \"memory_dir\"?"));
}

TEST(ConfigLoad, RejectsTwoFlagSpellingsOfOneKey) {
  ConfigSources sources;
  sources.flags = {{"--memory-dir", "a"}, {"memory_dir", "b"}};
  absl::StatusOr<Config> config = Config::Load(sources);
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(Message(config.status()), HasSubstr("both set config key \"memory_dir\""));
}

// ---- Load: the YAML file.

TEST_F(ConfigFileTest, FlattensNestedMappings) {
  absl::StatusOr<Config> config = LoadYaml(
      "lease_ms: 5000\n"
      "metrics:\n"
      "  listen: 0.0.0.0:9401\n"
      "  labels:\n"
      "    zone: us-east-1\n"
      "agent.arena_size: 4GiB\n"
      "empty_map: {}\n");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(*config->GetString("lease_ms"), "5000");
  EXPECT_EQ(*config->GetString("metrics.listen"), "0.0.0.0:9401");
  EXPECT_EQ(*config->GetString("metrics.labels.zone"), "us-east-1");
  EXPECT_EQ(*config->GetBytes("agent.arena_size"), uint64_t{4} << 30);
  EXPECT_FALSE(config->Has("empty_map"));
  EXPECT_FALSE(config->Has("metrics"));
  EXPECT_EQ(config->values().size(), 4u);
  EXPECT_EQ(config->Find("metrics.labels.zone")->origin,
            absl::StrCat("file ", dir_, "/ckpt.yaml:5:11"));
}

TEST_F(ConfigFileTest, KeepsScalarsAsWritten) {
  absl::StatusOr<Config> config = LoadYaml(
      "quoted: \"a: b # not a comment\"\n"
      "single: 'x'\n"
      "flag: yes\n"
      "number: 007\n"
      "null_tilde: ~\n"
      "null_empty:\n"
      "spaces: '  padded  '\n"
      "multi: |\n"
      "  line1\n"
      "  line2\n");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(*config->GetString("quoted"), "a: b # not a comment");
  EXPECT_EQ(*config->GetString("single"), "x");
  EXPECT_EQ(*config->GetBool("flag"), true);
  EXPECT_EQ(*config->GetString("number"), "007");
  EXPECT_EQ(*config->GetInt64("number"), 7);
  EXPECT_EQ(*config->GetString("null_tilde"), "");
  EXPECT_EQ(*config->GetString("null_empty"), "");
  EXPECT_EQ(*config->GetString("spaces"), "  padded  ");
  EXPECT_EQ(*config->GetString("multi"), "line1\nline2\n");
}

TEST_F(ConfigFileTest, SequencesBecomeCommaJoinedLists) {
  absl::StatusOr<Config> config = LoadYaml(
      "meta_addrs: [meta-0:7400, meta-1:7400]\n"
      "tiers:\n"
      "  - dram\n"
      "  - ssd\n"
      "none: []\n");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(*config->GetString("meta_addrs"), "meta-0:7400,meta-1:7400");
  EXPECT_THAT(*config->GetList("meta_addrs"), ElementsAre("meta-0:7400", "meta-1:7400"));
  EXPECT_THAT(*config->GetList("tiers"), ElementsAre("dram", "ssd"));
  EXPECT_THAT(*config->GetList("none"), IsEmpty());
}

TEST_F(ConfigFileTest, EmptyAndCommentOnlyFilesAreEmptyConfigs) {
  for (const char* text : {"", "# nothing here\n", "---\n", "~\n"}) {
    absl::StatusOr<Config> config = LoadYaml(text);
    ASSERT_TRUE(config.ok()) << "\"" << text << "\": " << config.status();
    EXPECT_THAT(config->values(), IsEmpty());
  }
}

TEST_F(ConfigFileTest, MissingFileIsNotFound) {
  ConfigSources sources;
  sources.file_path = dir_ + "/does-not-exist.yaml";
  absl::StatusOr<Config> config = Config::Load(sources);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(config.status()), HasSubstr(sources.file_path));
}

TEST_F(ConfigFileTest, DirectoryIsInvalidArgument) {
  ConfigSources sources;
  sources.file_path = dir_;
  absl::StatusOr<Config> config = Config::Load(sources);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(config.status()), HasSubstr("is a directory"));
}

TEST_F(ConfigFileTest, SyntaxErrorNamesFileLineAndColumn) {
  absl::StatusOr<Config> config = LoadYaml(
      "a: 1\n"
      "b: [1, 2\n");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(config.status()),
              HasSubstr(absl::StrCat("config file ", dir_, "/ckpt.yaml:3:1: invalid YAML")));

  config = LoadYaml("a: 1\n  b: 2\n");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(Message(config.status()), HasSubstr("/ckpt.yaml:2:4: invalid YAML"));
}

TEST_F(ConfigFileTest, RejectsStructuresItCannotFlatten) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"- a\n- b\n", "ckpt.yaml:1:1: the top level must be a mapping"},
      {"just a scalar\n", "the top level must be a mapping"},
      {"a: 1\na: 2\n", "ckpt.yaml:2:4: key \"a\" is defined more than once (also at"},
      {"m:\n  x: 1\nm.x: 2\n", "key \"m.x\" is defined more than once"},
      {"list:\n  - {a: 1}\n", "ckpt.yaml:2:5: key \"list\": sequence elements must be scalars"},
      {"list: [[1]]\n", "sequence elements must be scalars"},
      {"list: [1, ~]\n", "sequence elements must be scalars"},
      {"list: ['a,b']\n", "sequence element \"a,b\" contains ','"},
      {"Lease_ms: 1\n", "ckpt.yaml:1:1: config key \"Lease_ms\" is invalid"},
      {"memory-dir: /x\n", "did you mean \"memory_dir\"?"},
      {"m:\n  Bad: 1\n", "ckpt.yaml:2:3: config key \"Bad\" is invalid"},
      {"? [a]\n: 1\n", "mapping keys must be plain scalars"},
      {"a: 1\n---\nb: 2\n", "holds more than one YAML document"},
      // yaml-cpp 0.7's LoadAll never returned on these (an endless stream of
      // empty documents; found by tests/fuzz/fuzz_config).
      {",\n", "a stray ','"},
      {" ,a: b\n", "a stray ','"},
      {"# comment\n,x\n", "a stray ','"},
      {",gent:\n\x1f mliseouryt\xff\xff\xff\xff\xff\xff" "5\n", "more than one YAML document"},
  };
  for (const auto& [text, expected] : cases) {
    absl::StatusOr<Config> config = LoadYaml(text);
    ASSERT_FALSE(config.ok()) << text;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(Message(config.status()), HasSubstr(expected)) << text;
  }
}

// ---- Typed getters.

// A config with one key per source, for error-message tests.
class ConfigGetterTest : public ConfigFileTest {
 protected:
  void SetUp() override {
    ConfigFileTest::SetUp();
    ConfigSources sources;
    sources.file_path = file_ = WriteFile("agent.yaml",
                                          "from_file: zzz\n"
                                          "good_int: -42\n"
                                          "arena: 4GiB\n");
    sources.env = {{"CKPT_FROM_ENV", "zzz"}, {"CKPT_TIMEOUT", "1500"}};
    sources.flags = {{"--from-flag", "zzz"}, {"--verbose", "Yes"}};
    absl::StatusOr<Config> config = Config::Load(sources);
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = *std::move(config);
  }

  std::string file_;
  Config config_;
};

TEST_F(ConfigGetterTest, GoodValues) {
  EXPECT_EQ(*config_.GetInt64("good_int"), -42);
  EXPECT_EQ(*config_.GetBytes("arena"), uint64_t{4} << 30);
  EXPECT_EQ(*config_.GetDuration("timeout"), absl::Milliseconds(1500));
  EXPECT_EQ(*config_.GetUint64("timeout"), 1500u);
  EXPECT_EQ(*config_.GetBool("verbose"), true);
}

TEST_F(ConfigGetterTest, ErrorsNameKeyAndSource) {
  const std::string file_origin = absl::StrCat("(from file ", file_, ":1:12)");
  for (const auto& status :
       {config_.GetInt64("from_file").status(), config_.GetUint64("from_file").status(),
        config_.GetBool("from_file").status(), config_.GetBytes("from_file").status(),
        config_.GetDuration("from_file").status(), config_.GetInt64Or("from_file", 1).status()}) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Message(status), HasSubstr(absl::StrCat("config key \"from_file\" ", file_origin,
                                                        " has invalid value \"zzz\": ")));
  }
  EXPECT_EQ(Message(config_.GetInt64("from_env").status()),
            "config key \"from_env\" (from env CKPT_FROM_ENV) has invalid value \"zzz\": "
            "expected a signed 64-bit decimal integer");
  EXPECT_EQ(Message(config_.GetBool("from_flag").status()),
            "config key \"from_flag\" (from flag --from-flag) has invalid value \"zzz\": "
            "expected true/false, yes/no, on/off or 1/0");
  EXPECT_THAT(Message(config_.GetBytes("from_env").status()),
              HasSubstr("(from env CKPT_FROM_ENV) has invalid value \"zzz\": expected a number"));
  EXPECT_THAT(Message(config_.GetDuration("from_flag").status()),
              HasSubstr("(from flag --from-flag) has invalid value \"zzz\": expected a plain"));
}

TEST_F(ConfigGetterTest, MissingKeyIsNotFoundWithHints) {
  for (const auto& status :
       {config_.GetString("lease_ms").status(), config_.GetInt64("lease_ms").status(),
        config_.GetUint64("lease_ms").status(), config_.GetBool("lease_ms").status(),
        config_.GetBytes("lease_ms").status(), config_.GetDuration("lease_ms").status(),
        config_.GetList("lease_ms").status()}) {
    EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(Message(status),
              "config key \"lease_ms\" is not set (set it in the config file, as "
              "CKPT_LEASE_MS or with --lease-ms)");
  }
}

TEST_F(ConfigGetterTest, OrFormsReturnDefaultOnlyWhenUnset) {
  EXPECT_EQ(config_.GetStringOr("missing", "dflt"), "dflt");
  EXPECT_EQ(config_.GetStringOr("from_file", "dflt"), "zzz");
  EXPECT_EQ(*config_.GetInt64Or("missing", -7), -7);
  EXPECT_EQ(*config_.GetInt64Or("good_int", -7), -42);
  EXPECT_EQ(*config_.GetUint64Or("missing", 7), 7u);
  EXPECT_EQ(*config_.GetBoolOr("missing", true), true);
  EXPECT_EQ(*config_.GetBoolOr("verbose", false), true);
  EXPECT_EQ(*config_.GetBytesOr("missing", 123), 123u);
  EXPECT_EQ(*config_.GetBytesOr("arena", 123), uint64_t{4} << 30);
  EXPECT_EQ(*config_.GetDurationOr("missing", absl::Seconds(3)), absl::Seconds(3));
  EXPECT_EQ(*config_.GetDurationOr("timeout", absl::Seconds(3)), absl::Milliseconds(1500));
  EXPECT_THAT(*config_.GetListOr("missing", {"a"}), ElementsAre("a"));
  // Present but malformed is an error, not the default.
  EXPECT_FALSE(config_.GetUint64Or("from_file", 1).ok());
  EXPECT_FALSE(config_.GetBoolOr("from_file", true).ok());
  EXPECT_FALSE(config_.GetBytesOr("from_file", 1).ok());
  EXPECT_FALSE(config_.GetDurationOr("from_file", absl::Seconds(1)).ok());
}

// Builds a config holding key "k" = value (from the environment).
Config WithValue(const std::string& value) {
  ConfigSources sources;
  sources.env = {{"CKPT_K", value}};
  absl::StatusOr<Config> config = Config::Load(sources);
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *std::move(config) : Config();
}

TEST(ConfigGetInt64, AcceptsAndRejects) {
  const std::vector<std::pair<std::string, int64_t>> good = {
      {"0", 0},
      {"42", 42},
      {" 42 ", 42},
      {"+7", 7},
      {"-7", -7},
      {"-0", 0},
      {"9223372036854775807", std::numeric_limits<int64_t>::max()},
      {"-9223372036854775808", std::numeric_limits<int64_t>::min()},
  };
  for (const auto& [text, expected] : good) {
    absl::StatusOr<int64_t> v = WithValue(text).GetInt64("k");
    ASSERT_TRUE(v.ok()) << text << ": " << v.status();
    EXPECT_EQ(*v, expected);
  }
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "expected a signed 64-bit decimal integer"},
      {"4.2", "expected a signed"},
      {"0x10", "expected a signed"},
      {"1e3", "expected a signed"},
      {"1_000", "expected a signed"},
      {"- 1", "expected a signed"},
      {"--1", "expected a signed"},
      {"9223372036854775808", "out of range"},
      {"-9223372036854775809", "out of range"},
      {"99999999999999999999999", "out of range"},
  };
  for (const auto& [text, why] : bad) {
    absl::StatusOr<int64_t> v = WithValue(text).GetInt64("k");
    ASSERT_FALSE(v.ok()) << text;
    EXPECT_THAT(Message(v.status()), HasSubstr(why)) << text;
  }
}

TEST(ConfigGetUint64, AcceptsAndRejects) {
  EXPECT_EQ(*WithValue("18446744073709551615").GetUint64("k"),
            std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(*WithValue("+3").GetUint64("k"), 3u);
  EXPECT_THAT(Message(WithValue("18446744073709551616").GetUint64("k").status()),
              HasSubstr("out of range"));
  EXPECT_THAT(Message(WithValue("-1").GetUint64("k").status()), HasSubstr("must not be negative"));
  EXPECT_THAT(Message(WithValue("1GiB").GetUint64("k").status()),
              HasSubstr("expected an unsigned"));
}

TEST(ConfigGetBool, AcceptsAndRejects) {
  for (const char* t : {"true", "TRUE", "True", "1", "yes", "YES", "on", " true "}) {
    EXPECT_EQ(*WithValue(t).GetBool("k"), true) << t;
  }
  for (const char* f : {"false", "FALSE", "0", "no", "No", "off"}) {
    EXPECT_EQ(*WithValue(f).GetBool("k"), false) << f;
  }
  for (const char* bad : {"", "2", "y", "n", "t", "enabled", "truee", "-1"}) {
    absl::StatusOr<bool> v = WithValue(bad).GetBool("k");
    ASSERT_FALSE(v.ok()) << bad;
    EXPECT_THAT(Message(v.status()), HasSubstr("expected true/false, yes/no, on/off or 1/0"));
  }
}

TEST(ConfigGetList, SplitsAndTrims) {
  EXPECT_THAT(*WithValue("a,b,c").GetList("k"), ElementsAre("a", "b", "c"));
  EXPECT_THAT(*WithValue(" a , b ").GetList("k"), ElementsAre("a", "b"));
  EXPECT_THAT(*WithValue("one").GetList("k"), ElementsAre("one"));
  EXPECT_THAT(*WithValue("").GetList("k"), IsEmpty());
  EXPECT_THAT(*WithValue("  ").GetList("k"), IsEmpty());
  for (const char* bad : {"a,,b", "a,", ",a", " , "}) {
    absl::StatusOr<std::vector<std::string>> v = WithValue(bad).GetList("k");
    ASSERT_FALSE(v.ok()) << bad;
    EXPECT_THAT(Message(v.status()), HasSubstr("empty list element"));
  }
}

TEST(ConfigGetBytesAndDuration, UseTheSharedParsers) {
  EXPECT_EQ(*WithValue("512MiB").GetBytes("k"), uint64_t{512} << 20);
  EXPECT_EQ(*WithValue("1G").GetBytes("k"), 1000000000u);
  EXPECT_THAT(Message(WithValue("-1G").GetBytes("k").status()),
              HasSubstr("(from env CKPT_K) has invalid value \"-1G\": must not be negative"));
  EXPECT_EQ(*WithValue("2m").GetDuration("k"), absl::Minutes(2));
  EXPECT_EQ(*WithValue("250").GetDuration("k"), absl::Milliseconds(250));
  EXPECT_THAT(Message(WithValue("-2m").GetDuration("k").status()),
              HasSubstr("has invalid value \"-2m\": must not be negative"));
}

TEST(ConfigGetters, EmptyConfig) {
  const Config config;
  EXPECT_EQ(config.GetString("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*config.GetInt64Or("a", 5), 5);
  EXPECT_THAT(config.DebugString(), IsEmpty());
  EXPECT_TRUE(config.CheckKnownKeys({}).ok());
}

// ---- CheckKnownKeys.

const std::set<std::string> kKnown = {"lease_ms", "memory_dir", "metrics.listen", "node_id"};

TEST(CheckKnownKeys, AcceptsKnownKeys) {
  ConfigSources sources;
  sources.env = {{"CKPT_LEASE_MS", "1"}, {"OTHER_VAR", "x"}};
  sources.flags = {{"--metrics.listen", ":9401"}};
  absl::StatusOr<Config> config = Config::Load(sources);
  ASSERT_TRUE(config.ok());
  EXPECT_TRUE(config->CheckKnownKeys(kKnown).ok());
}

TEST_F(ConfigFileTest, UnknownFileKeySuggestsKey) {
  absl::StatusOr<Config> config = LoadYaml("lease_mss: 5\n");
  ASSERT_TRUE(config.ok());
  const absl::Status s = config->CheckKnownKeys(kKnown);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(s), absl::StrCat("unknown config key \"lease_mss\" (from file ", dir_,
                                     "/ckpt.yaml:1:12); did you mean \"lease_ms\"?"));
}

TEST(CheckKnownKeys, UnknownEnvKeySuggestsVariable) {
  ConfigSources sources;
  sources.env = {{"CKPT_MEMORY_DRI", "/x"}};
  absl::StatusOr<Config> config = Config::Load(sources);
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(Message(config->CheckKnownKeys(kKnown)),
            "unknown config key \"memory_dri\" (from env CKPT_MEMORY_DRI); did you mean "
            "CKPT_MEMORY_DIR?");
}

TEST(CheckKnownKeys, UnknownFlagSuggestsFlag) {
  ConfigSources sources;
  sources.flags = {{"--metrics.lisen", ":1"}};
  absl::StatusOr<Config> config = Config::Load(sources);
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(Message(config->CheckKnownKeys(kKnown)),
            "unknown config key \"metrics.lisen\" (from flag --metrics.lisen); did you mean "
            "--metrics.listen?");
}

TEST(CheckKnownKeys, NoSuggestionWhenNothingIsClose) {
  ConfigSources sources;
  sources.env = {{"CKPT_COMPLETELY_DIFFERENT", "1"}};
  absl::StatusOr<Config> config = Config::Load(sources);
  ASSERT_TRUE(config.ok());
  const std::string msg = Message(config->CheckKnownKeys(kKnown));
  EXPECT_EQ(msg,
            "unknown config key \"completely_different\" (from env CKPT_COMPLETELY_DIFFERENT)");
  EXPECT_THAT(msg, Not(HasSubstr("did you mean")));
}

TEST(CheckKnownKeys, ListsEveryUnknownKey) {
  ConfigSources sources;
  sources.env = {{"CKPT_NODE_DI", "n"}, {"CKPT_LEASE_MS", "1"}};
  sources.flags = {{"--zzz", "1"}};
  absl::StatusOr<Config> config = Config::Load(sources);
  ASSERT_TRUE(config.ok());
  const std::string msg = Message(config->CheckKnownKeys(kKnown));
  EXPECT_THAT(msg, HasSubstr("2 unknown config keys: "));
  EXPECT_THAT(msg, HasSubstr("\"node_di\" (from env CKPT_NODE_DI); did you mean CKPT_NODE_ID?"));
  EXPECT_THAT(msg, HasSubstr("\"zzz\" (from flag --zzz)"));
  EXPECT_THAT(msg, Not(HasSubstr("lease_ms")));
}

// ---- DebugString.

TEST(ConfigDebugString, ListsValuesWithOriginsAndRedactsSecrets) {
  ConfigSources sources;
  sources.env = {
      {"CKPT_LEASE_MS", "5000"}, {"CKPT_S3__SECRET_KEY", "hunter2"}, {"CKPT_AUTH_TOKEN", "abc"}};
  absl::StatusOr<Config> config = Config::Load(sources);
  ASSERT_TRUE(config.ok());
  const std::string dump = config->DebugString();
  EXPECT_THAT(dump, HasSubstr("lease_ms = \"5000\"  (env CKPT_LEASE_MS)\n"));
  EXPECT_THAT(dump, HasSubstr("s3.secret_key = <redacted>  (env CKPT_S3__SECRET_KEY)\n"));
  EXPECT_THAT(dump, HasSubstr("auth_token = <redacted>"));
  EXPECT_THAT(dump, Not(HasSubstr("hunter2")));
  EXPECT_THAT(dump, Not(HasSubstr("abc")));
}

TEST(ConfigSourceName, Names) {
  EXPECT_EQ(ConfigSourceName(ConfigSource::kFile), "file");
  EXPECT_EQ(ConfigSourceName(ConfigSource::kEnv), "env");
  EXPECT_EQ(ConfigSourceName(ConfigSource::kFlag), "flag");
}

}  // namespace
}  // namespace ckpt
