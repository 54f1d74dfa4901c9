#include "common/status_macros.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

namespace ckpt {
namespace {

int calls = 0;

absl::Status Fail() {
  ++calls;
  return absl::NotFoundError("no such thing");
}
absl::Status Succeed() {
  ++calls;
  return absl::OkStatus();
}
absl::StatusOr<std::unique_ptr<int>> MakeInt(bool ok) {
  ++calls;
  if (!ok) return absl::DataLossError("crc mismatch");
  return std::make_unique<int>(7);
}

absl::Status UseReturnIfError(bool fail) {
  CKPT_RETURN_IF_ERROR(fail ? Fail() : Succeed());
  return absl::InternalError("reached the end");
}

absl::StatusOr<int> UseAssign(bool ok) {
  CKPT_ASSIGN_OR_RETURN(auto p, MakeInt(ok));  // move-only value
  int existing = 0;
  CKPT_ASSIGN_OR_RETURN(existing, absl::StatusOr<int>(*p + 1));
  return existing;
}

absl::Status UseContext() {
  CKPT_RETURN_IF_ERROR_CTX(MakeInt(false), "loading shard 3");
  return absl::OkStatus();
}

TEST(StatusMacros, ReturnIfErrorPassesErrorOnAndEvaluatesOnce) {
  calls = 0;
  const absl::Status s = UseReturnIfError(true);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "no such thing");
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(UseReturnIfError(false).code(), absl::StatusCode::kInternal);
}

TEST(StatusMacros, AssignOrReturnMovesValueOrReturnsError) {
  calls = 0;
  auto ok = UseAssign(true);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 8);
  auto bad = UseAssign(false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(calls, 2);
}

TEST(StatusMacros, ContextPrefixesMessageAndKeepsCode) {
  const absl::Status s = UseContext();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "loading shard 3: crc mismatch");
  EXPECT_TRUE(Annotate(absl::OkStatus(), "x").ok());
}

}  // namespace
}  // namespace ckpt
