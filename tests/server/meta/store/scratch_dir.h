// A scratch directory for the RocksDB store tests (tests/support/temp_dir.h, deleted with
// the test) and paths of files or directories inside it, not created (RocksDB makes them).
#pragma once

#include <string>
#include <string_view>

#include "support/temp_dir.h"

namespace ckpt::meta {

class ScratchDir {
 public:
  ScratchDir() : dir_(*ckpt::testing::TempDir::Create()) {}
  const std::string& path() const { return dir_.path(); }
  std::string Sub(std::string_view name) const { return dir_.path() + "/" + std::string(name); }

 private:
  ckpt::testing::TempDir dir_;
};

}  // namespace ckpt::meta
