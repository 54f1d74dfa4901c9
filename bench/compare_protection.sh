#!/usr/bin/env bash
# Alternates protection_bench of two builds, so both see the same machine
# state (docs/benchmarks.md, "Protection"):
#   bench/compare_protection.sh OLD_BUILD NEW_BUILD [ROUNDS] [protection_bench args...]
# e.g. bench/compare_protection.sh /tmp/old/build build 2 --size 512MiB --policies group,ring --tls tcp
# Prints each run's "last commit -> PROTECTED" lines under a header naming
# the round, the build and the load average.
set -euo pipefail
old=${1:?usage: compare_protection.sh OLD_BUILD NEW_BUILD [ROUNDS] [args...]}
new=${2:?usage: compare_protection.sh OLD_BUILD NEW_BUILD [ROUNDS] [args...]}
rounds=${3:-2}
shift $(( $# < 3 ? $# : 3 ))
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--size 512MiB --policies group,ring --tls tcp)
for b in "$old" "$new"; do
  [ -x "$b/bench/protection_bench" ] || { echo "no $b/bench/protection_bench (build it first)" >&2; exit 2; }
done
for ((round = 1; round <= rounds; round++)); do
  for which in new old; do
    if [ "$which" = old ]; then b=$old; else b=$new; fi
    echo "== round $round $which ($b) $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    "$b/bench/protection_bench" "${args[@]}" | grep -E "baseline|last commit"
  done
done
