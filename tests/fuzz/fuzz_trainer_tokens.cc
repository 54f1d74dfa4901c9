// libFuzzer target: ckpt-meta's trainer tokens file (ParseTrainerTokens,
// docs/security.md "Trainer identities"). What parses must write back to the
// same identities, and every pattern it accepts must be one
// JobPatternMatches can use.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/grpc_security.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<std::vector<ckpt::TrainerToken>> parsed = ckpt::ParseTrainerTokens(text, "fuzz");
  if (!parsed.ok()) return 0;
  std::string again;
  for (const ckpt::TrainerToken& t : *parsed) {
    again += t.token + " ";
    for (size_t i = 0; i < t.jobs.size(); ++i) {
      again += (i ? "," : "") + t.jobs[i];
      (void)ckpt::JobPatternMatches(t.jobs[i], "job-0");
      if (!ckpt::JobPatternMatches(t.jobs[i], t.jobs[i].back() == '*' ? t.jobs[i].substr(0, t.jobs[i].size() - 1)
                                                                       : t.jobs[i])) {
        std::abort();  // a pattern must match the id it names (or its own prefix)
      }
    }
    again += "\n";
  }
  absl::StatusOr<std::vector<ckpt::TrainerToken>> reparsed = ckpt::ParseTrainerTokens(again, "fuzz");
  if (!reparsed.ok() || reparsed->size() != parsed->size()) std::abort();
  for (size_t i = 0; i < parsed->size(); ++i) {
    if ((*reparsed)[i].token != (*parsed)[i].token || (*reparsed)[i].jobs != (*parsed)[i].jobs) std::abort();
  }
  return 0;
}
