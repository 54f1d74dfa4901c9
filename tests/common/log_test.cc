#include "common/log.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace ckpt::log {
namespace {

std::vector<std::string> ReadLines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string TempPath(const char* name) {
  std::string p = testing::TempDir() + "/" + name + std::to_string(::getpid());
  std::remove(p.c_str());
  return p;
}

TEST(Log, JsonLinesAreValidJsonWithEscapedMessage) {
  const std::string path = TempPath("log_json");
  ASSERT_TRUE(Init({.level = Level::kDebug, .json = true, .file = path, .name = "ckpt-test"}).ok());
  Info("saved \"{}\" step {}\nline two\t\x01", "gpt", 42);
  Debug("debug is on");
  Trace("trace is filtered");
  Flush();
  const auto lines = ReadLines(path);
  ASSERT_EQ(lines.size(), 2u);
  const auto j = nlohmann::json::parse(lines[0]);
  EXPECT_EQ(j["level"], "info");
  EXPECT_EQ(j["logger"], "ckpt-test");
  EXPECT_EQ(j["msg"], "saved \"gpt\" step 42\nline two\t\x01");
  const std::string ts = j["ts"];
  EXPECT_EQ(ts.size(), std::string("2026-11-22T07:29:07.123456Z").size()) << ts;
  EXPECT_EQ(ts.back(), 'Z');
  EXPECT_TRUE(j["thread"].is_number());
  EXPECT_EQ(nlohmann::json::parse(lines[1])["level"], "debug");
  std::remove(path.c_str());
}

TEST(Log, TextLinesCarryLevelAndMessage) {
  const std::string path = TempPath("log_text");
  ASSERT_TRUE(Init({.level = Level::kInfo, .json = false, .file = path, .name = "ckpt-x"}).ok());
  Warn("disk {} is full", "/data");
  Debug("not shown");
  Flush();
  const auto lines = ReadLines(path);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find(" W ckpt-x["), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("disk /data is full"), std::string::npos);
  std::remove(path.c_str());
}

TEST(Log, LevelFilteringAndParse) {
  Options warn_only;
  warn_only.level = Level::kWarn;
  ASSERT_TRUE(Init(warn_only).ok());
  EXPECT_FALSE(Enabled(Level::kInfo));
  EXPECT_TRUE(Enabled(Level::kError));
  EXPECT_FALSE(Enabled(Level::kOff));
  EXPECT_EQ(*ParseLevel("WARNING"), Level::kWarn);
  EXPECT_EQ(*ParseLevel("trace"), Level::kTrace);
  auto bad = ParseLevel("loud");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("trace, debug, info"), absl::string_view::npos);
}

TEST(Log, UnopenableFileIsAnErrorAndKeepsLogging) {
  const absl::Status s = Init({.level = Level::kInfo, .json = false, .file = "/nonexistent-dir/x/y.log"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("/nonexistent-dir/x/y.log"), absl::string_view::npos);
  Info("still works");  // must not crash
  EXPECT_FALSE(std::filesystem::exists("/nonexistent-dir"));
}

}  // namespace
}  // namespace ckpt::log
