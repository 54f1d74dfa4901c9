// A test helper: does a string look like one of ckpt's random ids?
#pragma once

#include <cstddef>
#include <string>

namespace ckpt::testing {

// `id` is `prefix` then 32 lower-case hex digits (a 128-bit random id). (No
// std::regex: GCC 12 warns inside it under -fsanitize=address, and -Werror.)
inline bool IsHexId(const std::string& id, const std::string& prefix) {
  if (id.size() != prefix.size() + 32 || id.compare(0, prefix.size(), prefix) != 0) return false;
  for (size_t i = prefix.size(); i < id.size(); ++i) {
    const char c = id[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace ckpt::testing
