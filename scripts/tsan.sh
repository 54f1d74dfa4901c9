#!/usr/bin/env bash
# Builds a ThreadSanitizer tree (build-tsan/) and runs the agent, transport and meta tests
# and the integration tests that start agents under it. Clean means: every test passes
# and no process (test or daemon) reported anything.
#
#   scripts/tsan.sh                      # the default set of test programs (below)
#   scripts/tsan.sh --list               # print that set
#   scripts/tsan.sh 'agent|peer'         # only programs whose name matches this regex
#   scripts/tsan.sh peer_test -- --gtest_filter='PeerTest.*'   # extra arguments for them
#   CKPT_BUILD_DIR=... CKPT_JOBS=N scripts/tsan.sh
#
# Each selected test program runs once, as a whole (all its tests in one process), with a
# time limit of CKPT_TSAN_TIMEOUT seconds (default 1800); its output goes to
# <build>/tsan-logs/<program>.log. Every report of every process (the tests and the
# daemons they start) is written to <build>/tsan-reports/ and printed at the end.
# docs/building.md explains the set-up (Abseil annotations, protobuf, UCX memory hooks)
# and the suppressions in tests/sanitizers/tsan.supp.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${CKPT_BUILD_DIR:-${root}/build-tsan}"
jobs="${CKPT_JOBS:-2}"
timeout_s="${CKPT_TSAN_TIMEOUT:-1800}"

# The programs this run covers: the TSan set-up's own check, then every test program
# declared (ckpt_cc_test(NAME ...)) in these directories, read from their CMakeLists.txt so
# that tests added with the agent's rewrite are picked up: the agent, transport and meta
# tests, the client library (its committer thread), the daemons' entry points, and the tests
# that start real daemons.
test_dirs=(tests/server/agent tests/transport tests/server/meta tests/server/meta/store tests/server/meta/etcd tests/client
           tests/server/cmd tests/integration tests/cli)
default_programs=(tsan_selftest)
for d in "${test_dirs[@]}"; do
  [ -f "${root}/${d}/CMakeLists.txt" ] || continue
  while read -r name; do default_programs+=("${name}"); done < <(
    grep -oE 'ckpt_cc_test\(NAME [A-Za-z0-9_]+' "${root}/${d}/CMakeLists.txt" | awk '{print $2}')
done

regex=""
extra=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --) shift; extra=("$@"); break ;;
    --list) printf '%s\n' "${default_programs[@]}"; exit 0 ;;
    -h|--help) sed -n '2,18p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) echo "usage: $0 [PROGRAM_REGEX] [-- GTEST_ARGS...]" >&2; exit 2 ;;
    *) [ -z "${regex}" ] || { echo "usage: $0 [PROGRAM_REGEX] [-- GTEST_ARGS...]" >&2; exit 2; }
       regex="$1"; shift ;;
  esac
done

programs=()
for p in "${default_programs[@]}"; do
  if [ -z "${regex}" ] || [[ "${p}" =~ ${regex} ]]; then programs+=("${p}"); fi
done
[ "${#programs[@]}" -gt 0 ] || { echo "tsan.sh: no test program matches '${regex}'" >&2; exit 2; }

echo "== configure (${build})"
cmake -S "${root}" -B "${build}" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DCKPT_KEEP_ASSERTS=ON \
  -DCKPT_BUILD_TESTS=ON \
  -DCKPT_BUILD_BENCHMARKS=OFF \
  -DCKPT_WERROR=ON \
  -DCKPT_SANITIZE=thread >/dev/null

echo "== build ${programs[*]} (-j${jobs})"
start=$(date +%s)
cmake --build "${build}" -j "${jobs}" --target "${programs[@]}"
echo "== build took $(( $(date +%s) - start )) s"

logs="${build}/tsan-logs"
reports="${build}/tsan-reports"
rm -rf "${logs}" "${reports}"
mkdir -p "${logs}" "${reports}"
# UCX's memory hooks (malloc/mmap interposition) crash under TSan; nothing here needs them.
export UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_EVENTS=no
# Reports go to <reports>/tsan.<program>.<pid>, also from daemons a test kills.
export TSAN_OPTIONS="${TSAN_OPTIONS:+${TSAN_OPTIONS}:}log_path=${reports}/tsan:log_exe_name=1"

failed=()
start=$(date +%s)
for p in "${programs[@]}"; do
  t0=$(date +%s)
  rc=0
  (cd "${build}" && timeout -k 10 "${timeout_s}" "${build}/tests/${p}" "${extra[@]}") \
    >"${logs}/${p}.log" 2>&1 || rc=$?
  summary="$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "${logs}/${p}.log" | tr '\n' ' ' || true)"
  echo "   ${p}: exit ${rc} in $(( $(date +%s) - t0 )) s ${summary}"
  [ "${rc}" -eq 0 ] || failed+=("${p}")
done
echo "== tests took $(( $(date +%s) - start )) s"

rc=0
if [ "${#failed[@]}" -gt 0 ]; then
  echo "== failed: ${failed[*]} (logs in ${logs})"
  for p in "${failed[@]}"; do
    echo "---- ${logs}/${p}.log (failures)"
    grep -E '^\[  FAILED  \]|Failure$|error:' "${logs}/${p}.log" | head -40 || true
  done
  rc=1
fi
"${root}/scripts/sanitizer-reports.sh" "${reports}" TSan || rc=1
exit "${rc}"
