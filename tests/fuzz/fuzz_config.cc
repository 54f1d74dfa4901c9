// libFuzzer target: a daemon's YAML config file (Config::Load), written to a
// file in a private temp directory for each input, then every getter on the
// keys it holds.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/config.h"

namespace {
std::string& Dir() {
  static std::string dir;
  return dir;
}

// Removes the private directory at exit (ctest replays this target in every build).
void RemoveDir() {
  std::remove((Dir() + "/config.yaml").c_str());
  ::rmdir(Dir().c_str());
}

std::string Path() {
  static const std::string path = [] {
    char tmpl[] = "/tmp/ckpt-fuzz-config-XXXXXX";
    const char* dir = ::mkdtemp(tmpl);
    if (dir == nullptr) std::abort();
    Dir() = dir;
    std::atexit(RemoveDir);
    return std::string(dir) + "/config.yaml";
  }();
  return path;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = Path();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size != 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  ckpt::ConfigSources src;
  src.file_path = path;
  auto config = ckpt::Config::Load(src);
  if (!config.ok()) return 0;
  for (const char* key : {"memory", "lease_ms", "log_json", "listen", "data_rate"}) {
    (void)config->GetStringOr(key, "");
    (void)config->GetBytesOr(key, 0).ok();
    (void)config->GetDurationOr(key, absl::Seconds(1)).ok();
    (void)config->GetBoolOr(key, false).ok();
  }
  return 0;
}
