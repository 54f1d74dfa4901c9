#include "server/meta/policy.h"

#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace ckpt::meta {

absl::StatusOr<ProtectionPolicy> ParseProtectionPolicy(std::string_view text_view) {
  // Debian's Abseil has its own string_view: work on a std::string.
  const std::string text(text_view);
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "protection \"", text, "\": ", why,
        " (expected none, replicate:COPIES[:ring|group] or ec:K+M, e.g. replicate:2 or ec:4+2)"));
  };
  if (text == "none") return ProtectionPolicy::None();
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  int a = 0, b = 0;
  ProtectionPolicy policy;
  if (parts[0] == "replicate") {
    if (parts.size() < 2 || parts.size() > 3) return bad("wrong number of ':' fields");
    if (!absl::SimpleAtoi(parts[1], &a)) return bad("COPIES is not a number");
    ProtectionPolicy::Placement placement = ProtectionPolicy::Placement::kRing;
    if (parts.size() == 3) {
      if (parts[2] == "group") {
        placement = ProtectionPolicy::Placement::kGroup;
      } else if (parts[2] != "ring") {
        return bad("placement must be ring or group");
      }
    }
    policy = ProtectionPolicy::Replicate(a, placement);
  } else if (parts[0] == "ec") {
    if (parts.size() != 2) return bad("wrong number of ':' fields");
    std::vector<std::string> km = absl::StrSplit(parts[1], '+');
    if (km.size() != 2 || !absl::SimpleAtoi(km[0], &a) || !absl::SimpleAtoi(km[1], &b)) {
      return bad("K+M must be two numbers");
    }
    policy = ProtectionPolicy::ErasureCode(a, b);
  } else {
    return bad("unknown kind");
  }
  if (absl::Status s = policy.Validate(); !s.ok()) return bad(std::string(s.message()));
  return policy;
}

}  // namespace ckpt::meta
