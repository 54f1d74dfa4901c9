#!/usr/bin/env bash
# Sets up, builds and runs every test that needs no special hardware.
#
#   scripts/test.sh              # both halves below, as CI does (.ci/run)
#   scripts/test.sh --e2e        # plain half: build/ without the GoogleTest binaries (daemons,
#                                #   ckptctl, Python module, examples, benchmarks), then the
#                                #   end-to-end script tests (label nosan)
#   scripts/test.sh --sanitize   # sanitized half: everything under ASan+UBSan in build-asan/
#                                #   (no benchmarks), every test but the nosan ones
#   scripts/test.sh --plain      # every test in one plain build/ (no sanitizers; quick local run)
#   CKPT_BUILD_DIR=... CKPT_CMAKE_ARGS="..." CKPT_JOBS=N scripts/test.sh [--e2e|--sanitize|--plain]
#
# Each test runs once: what reaches our native code runs under the sanitizers, and the
# end-to-end stories whose native code those tests already run (quickstarts, torchrun, netns,
# the netns soak) and the file checks run on the Release build users get (docs/testing.md).
# Release build with asserts kept, -j2 (this machine has 2 cores), ccache when present.
# Exits non-zero on any failure. deps (apt) first in every mode.
#
# Sanitized half: CKPT_SANITIZE=address,undefined. Every process of ours (tests, the daemons
# they start, the Python interpreter with the module preloaded) writes its sanitizer report
# to <build>/sanitizer-reports/ as well as failing; the script prints those reports and
# fails if there are any, so a finding in a daemon that a test killed is not lost.
# docs/building.md has the details and the suppressions.
set -euo pipefail

mode=both
for arg in "$@"; do
  case "${arg}" in
    --e2e) mode=e2e ;;
    --sanitize) mode=sanitize ;;
    --plain) mode=plain ;;
    -h|--help) sed -n '2,24p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "usage: $0 [--e2e|--sanitize|--plain]" >&2; exit 2 ;;
  esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${CKPT_JOBS:-2}"

# What failed, printed again at the very end: CI shows a run's last lines, and the sanitized
# half's thousand lines would otherwise hide a failure of the e2e half.
summary="$(mktemp)"
trap 'rm -f "${summary}"' EXIT

# failed_excerpts HALF LOG: each failed test's name and the last 40 lines of its output
# (ctest --output-on-failure prints a test's output after its result line).
failed_excerpts() {
  awk -v half="$1" '
    function flush() { if (name != "") { print "== " half ": FAILED " name; for (i = (n > 40 ? n - 39 : 1); i <= n; i++) print "   | " buf[i]; } name = ""; n = 0 }
    /^ *[0-9]+\/[0-9]+ Test +#[0-9]+:/ { flush(); if ($0 ~ /\*\*\*(Failed|Timeout|Exception|Not Run)/ && $0 !~ /Disabled/) name = $0; next }
    /^ *Start +[0-9]+:/ || /^[0-9]+% tests passed/ { flush(); next }
    name != "" { buf[++n] = $0 }
    END { flush() }' "$2"
}

# run_half e2e|sanitize|plain: configure, build and test one build directory.
run_half() {
  local half="$1" build extra_args=() labels=() reports="" rc=0 start
  case "${half}" in
    sanitize)
      build="${CKPT_BUILD_DIR:-${root}/build-asan}"
      extra_args+=(-DCKPT_SANITIZE=address,undefined -DCKPT_BUILD_BENCHMARKS=OFF -DCKPT_BUILD_GTESTS=ON)
      labels+=(-LE nosan) ;;
    e2e)
      build="${CKPT_BUILD_DIR:-${root}/build}"
      extra_args+=(-DCKPT_SANITIZE= -DCKPT_BUILD_BENCHMARKS=ON -DCKPT_BUILD_GTESTS=OFF)
      labels+=(-L nosan) ;;
    plain)
      build="${CKPT_BUILD_DIR:-${root}/build}"
      extra_args+=(-DCKPT_SANITIZE= -DCKPT_BUILD_BENCHMARKS=ON -DCKPT_BUILD_GTESTS=ON) ;;
  esac

  echo "== ${half}: configure (${build})"
  # shellcheck disable=SC2086
  cmake -S "${root}" -B "${build}" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DCKPT_KEEP_ASSERTS=ON \
    -DCKPT_BUILD_TESTS=ON \
    -DCKPT_WERROR=ON \
    "${extra_args[@]}" \
    ${CKPT_CMAKE_ARGS:-} >/dev/null

  echo "== ${half}: build (-j${jobs})"
  start=$(date +%s)
  cmake --build "${build}" -j "${jobs}"
  echo "== ${half}: build took $(( $(date +%s) - start )) s"

  if [ "${half}" = sanitize ]; then
    reports="${build}/sanitizer-reports"
    rm -rf "${reports}"
    mkdir -p "${reports}"
    # log_path: each process writes <reports>/<tool>.<program>.<pid> (and nothing to stderr).
    export ASAN_OPTIONS="${ASAN_OPTIONS:+${ASAN_OPTIONS}:}log_path=${reports}/asan:log_exe_name=1"
    export UBSAN_OPTIONS="${UBSAN_OPTIONS:+${UBSAN_OPTIONS}:}log_path=${reports}/ubsan:log_exe_name=1"
  fi

  echo "== ${half}: test"
  start=$(date +%s)
  # Labels: unit, integration, fault run here; hw needs RDMA/GPU hardware. Label nosan:
  # checks that reach no code of ours worth sanitizing (file and manifest checks), and
  # end-to-end stories whose native code the sanitized tests already run (two of the three
  # quickstarts, torchrun, all but one netns test, the netns soak).
  {
    local ctest_rc=0
    ctest --test-dir "${build}" -L 'unit|integration|fault' "${labels[@]}" --output-on-failure \
      -j "${jobs}" --timeout 600 2>&1 || ctest_rc=$?
    echo "${ctest_rc}" >"${build}/ctest.rc"
  } | tee "${build}/ctest.log"
  rc="$(cat "${build}/ctest.rc")"
  echo "== ${half}: tests took $(( $(date +%s) - start )) s"
  [ "${rc}" = 0 ] || failed_excerpts "${half}" "${build}/ctest.log" >>"${summary}"

  if [ -n "${reports}" ]; then
    "${root}/scripts/sanitizer-reports.sh" "${reports}" sanitizer || rc=1
    unset ASAN_OPTIONS UBSAN_OPTIONS
  fi
  return "${rc}"
}

"${root}/scripts/setup-deps.sh"

rc=0
case "${mode}" in
  both)
    if [ -n "${CKPT_BUILD_DIR:-}" ]; then
      echo "CKPT_BUILD_DIR names one build directory: give --e2e, --sanitize or --plain" >&2
      exit 2
    fi
    run_half e2e || rc=$?
    run_half sanitize || rc=$? ;;
  *) run_half "${mode}" || rc=$? ;;
esac
if [ -s "${summary}" ]; then
  echo "== what failed (repeated from above)"
  cat "${summary}"
fi
exit "${rc}"
