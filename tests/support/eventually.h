// Eventually: for a test waiting on a state another thread reaches with
// nothing to wait on (a server's own poll loop, a transport's thread): polls
// `cond` every millisecond until it holds or `limit` of real time passes.
// A bound, not a timing: the test's clock stays its FakeClock, and a test
// that needs the limit has failed. Prefer a condition wait where there is one.
#pragma once

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ckpt::testing {

template <typename Cond>
bool Eventually(Cond cond, absl::Duration limit = absl::Seconds(30)) {
  const absl::Time deadline = absl::Now() + limit;
  while (!cond()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

}  // namespace ckpt::testing
