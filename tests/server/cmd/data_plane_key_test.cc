// The cluster's data-plane key file in meta's data directory: made once, all
// or nothing, 0600; read back only if it is a regular file of meta's user
// that nobody else may read.
#include "server/cmd/data_plane_key.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "support/temp_dir.h"

namespace ckpt::daemon {
namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(DataPlaneKey, MadeOnceAndReadBack) {
  absl::StatusOr<testing::TempDir> tmp = testing::TempDir::Create();
  ASSERT_TRUE(tmp.ok()) << tmp.status();
  const std::string path = tmp->path() + "/" + kDataPlaneKeyFile;
  absl::StatusOr<std::string> key = LoadOrCreateDataPlaneKey(path);
  ASSERT_TRUE(key.ok()) << key.status();
  EXPECT_EQ(key->size(), kDataPlaneKeyBytes);
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  const std::string text = Slurp(path);
  EXPECT_EQ(text.size(), 2 * kDataPlaneKeyBytes + 1);
  EXPECT_EQ(text.back(), '\n');
  // A restarted meta reads the same key.
  absl::StatusOr<std::string> again = LoadOrCreateDataPlaneKey(path);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *key);
  // Another cluster's meta makes another.
  absl::StatusOr<std::string> other = LoadOrCreateDataPlaneKey(tmp->path() + "/other.key");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_NE(*other, *key);
  // Nothing but the key is left behind (no temporary file).
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(tmp->path())) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 2);
}

TEST(DataPlaneKey, MetasStartingAtOnceAgreeOnOneKey) {
  absl::StatusOr<testing::TempDir> tmp = testing::TempDir::Create();
  ASSERT_TRUE(tmp.ok()) << tmp.status();
  const std::string path = tmp->path() + "/" + kDataPlaneKeyFile;
  std::vector<absl::StatusOr<std::string>> keys(8, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (auto& k : keys) threads.emplace_back([&k, &path] { k = LoadOrCreateDataPlaneKey(path); });
  for (auto& t : threads) t.join();
  for (const auto& k : keys) {
    ASSERT_TRUE(k.ok()) << k.status();
    EXPECT_EQ(*k, *keys[0]);
  }
}

TEST(DataPlaneKey, ALinkAWideModeAnotherOwnerOrDamageIsRefused) {
  absl::StatusOr<testing::TempDir> tmp = testing::TempDir::Create();
  ASSERT_TRUE(tmp.ok()) << tmp.status();
  const std::string path = tmp->path() + "/" + kDataPlaneKeyFile;
  ASSERT_TRUE(LoadOrCreateDataPlaneKey(path).ok());

  // A symlink to a key someone else controls.
  const std::string link = tmp->path() + "/link.key";
  ASSERT_EQ(::symlink(path.c_str(), link.c_str()), 0);
  absl::StatusOr<std::string> k = LoadOrCreateDataPlaneKey(link);
  ASSERT_FALSE(k.ok());
  EXPECT_EQ(k.status().code(), absl::StatusCode::kFailedPrecondition) << k.status();
  EXPECT_TRUE(absl::StrContains(k.status().message(), "symbolic link")) << k.status();

  // Readable by the group: it may have leaked.
  ASSERT_EQ(::chmod(path.c_str(), 0640), 0);
  k = LoadOrCreateDataPlaneKey(path);
  ASSERT_FALSE(k.ok());
  EXPECT_EQ(k.status().code(), absl::StatusCode::kFailedPrecondition) << k.status();
  EXPECT_TRUE(absl::StrContains(k.status().message(), "0640")) << k.status();
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);

  // Another user's file (only root can make one here).
  if (::geteuid() == 0) {
    ASSERT_EQ(::chown(path.c_str(), 4242, 4242), 0);
    k = LoadOrCreateDataPlaneKey(path);
    ASSERT_FALSE(k.ok());
    EXPECT_EQ(k.status().code(), absl::StatusCode::kFailedPrecondition) << k.status();
    EXPECT_TRUE(absl::StrContains(k.status().message(), "uid 4242")) << k.status();
    ASSERT_EQ(::chown(path.c_str(), 0, 0), 0);
  }

  // A damaged file is not replaced silently (agents hold the old key).
  {
    std::ofstream(path, std::ios::trunc) << "0123";
  }
  k = LoadOrCreateDataPlaneKey(path);
  ASSERT_FALSE(k.ok());
  EXPECT_EQ(k.status().code(), absl::StatusCode::kDataLoss) << k.status();

  // A directory in its place.
  const std::string dir = tmp->path() + "/dir.key";
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  k = LoadOrCreateDataPlaneKey(dir);
  ASSERT_FALSE(k.ok());
  EXPECT_EQ(k.status().code(), absl::StatusCode::kFailedPrecondition) << k.status();
}

}  // namespace
}  // namespace ckpt::daemon
