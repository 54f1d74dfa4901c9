#!/usr/bin/env bash
# Alternates save_bench, protection_bench and meta_report_bench of two builds, so
# both see the same machine state (docs/benchmarks.md): the check that a change
# with "no behaviour change" (e.g. issue 35's restructuring) costs nothing.
#   bench/compare_builds.sh OLD_BUILD NEW_BUILD [ROUNDS]
# e.g. git worktree add /tmp/old <rev> && (cd /tmp/old && cmake -S . -B build ... &&
#      cmake --build build --target save_bench protection_bench meta_report_bench ckpt-meta ckpt-agent)
#      bench/compare_builds.sh /tmp/old/build build 2
# Each build must be a real build directory: its benches start the daemons of the
# build they were compiled in (<build>/bin), not of the other one.
# Prints the lines that matter of each run under a header naming the round, the
# build and the load average.
set -euo pipefail
old=${1:?usage: compare_builds.sh OLD_BUILD NEW_BUILD [ROUNDS]}
new=${2:?usage: compare_builds.sh OLD_BUILD NEW_BUILD [ROUNDS]}
rounds=${3:-2}
for b in "$old" "$new"; do
  for t in save_bench protection_bench meta_report_bench; do
    [ -x "$b/bench/$t" ] || { echo "no $b/bench/$t (build it first)" >&2; exit 2; }
  done
done
for ((round = 1; round <= rounds; round++)); do
  for which in old new; do
    if [ "$which" = old ]; then b=$old; else b=$new; fi
    echo "== round $round $which ($b) $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    "$b/bench/save_bench" --sizes 1GiB --steps 5 --flush-runs 1 2>&1 |
      grep -E "memcpy|steady|flush to|zero-copy|LoadInto live" || true
    "$b/bench/protection_bench" --size 256MiB --policies ring,ec --security mac 2>&1 |
      grep -E "baseline|save blocking, v[34]|protection bandwidth per node, v[34]" || true
    "$b/bench/meta_report_bench" 5 2>&1 | grep -E "burst|paced|GetVersion" || true
  done
done
