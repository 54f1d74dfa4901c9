#!/usr/bin/env bash
# Sets up, builds and runs every test that needs no special hardware.
#
#   scripts/test.sh              # deps (apt), configure build/, build, ctest -L 'unit|integration|fault'
#   scripts/test.sh --sanitize   # the same under ASan+UBSan in build-asan/ (no benchmarks)
#   CKPT_BUILD_DIR=... CKPT_CMAKE_ARGS="..." CKPT_JOBS=N scripts/test.sh [--sanitize]
#
# Release build with asserts kept, -j2 (this machine has 2 cores), ccache when
# present. Exits non-zero on any failure. `.ci/run` calls this script twice:
# plain, then with --sanitize.
#
# --sanitize: CKPT_SANITIZE=address,undefined. Every process of ours (tests, the daemons
# they start, the Python interpreter with the module preloaded) writes its sanitizer report
# to <build>/sanitizer-reports/ as well as failing; the script prints those reports and
# fails if there are any, so a finding in a daemon that a test killed is not lost.
# docs/building.md has the details and the suppressions.
set -euo pipefail

sanitize=0
for arg in "$@"; do
  case "${arg}" in
    --sanitize) sanitize=1 ;;
    -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "usage: $0 [--sanitize]" >&2; exit 2 ;;
  esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${CKPT_JOBS:-2}"
extra_args=()
if [ "${sanitize}" -eq 1 ]; then
  build="${CKPT_BUILD_DIR:-${root}/build-asan}"
  extra_args+=(-DCKPT_SANITIZE=address,undefined -DCKPT_BUILD_BENCHMARKS=OFF)
else
  build="${CKPT_BUILD_DIR:-${root}/build}"
  extra_args+=(-DCKPT_BUILD_BENCHMARKS=ON)
fi

"${root}/scripts/setup-deps.sh"

echo "== configure (${build})"
# shellcheck disable=SC2086
cmake -S "${root}" -B "${build}" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DCKPT_KEEP_ASSERTS=ON \
  -DCKPT_BUILD_TESTS=ON \
  -DCKPT_WERROR=ON \
  "${extra_args[@]}" \
  ${CKPT_CMAKE_ARGS:-} >/dev/null

echo "== build (-j${jobs})"
start=$(date +%s)
cmake --build "${build}" -j "${jobs}"
echo "== build took $(( $(date +%s) - start )) s"

reports=""
if [ "${sanitize}" -eq 1 ]; then
  reports="${build}/sanitizer-reports"
  rm -rf "${reports}"
  mkdir -p "${reports}"
  # log_path: each process writes <reports>/<tool>.<program>.<pid> (and nothing to stderr).
  export ASAN_OPTIONS="${ASAN_OPTIONS:+${ASAN_OPTIONS}:}log_path=${reports}/asan:log_exe_name=1"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:+${UBSAN_OPTIONS}:}log_path=${reports}/ubsan:log_exe_name=1"
fi

echo "== test"
start=$(date +%s)
rc=0
# Labels: unit, integration, fault run here; hw needs RDMA/GPU hardware.
# Label nosan: checks that reach no code of ours worth sanitizing (file and
# manifest checks), and end-to-end stories whose native code the sanitized tests
# already run (two of the three quickstarts, torchrun, all but one netns test, the
# netns soak); the sanitizer pass leaves them to the plain one (docs/testing.md).
exclude=()
if [ "${sanitize}" -eq 1 ]; then exclude=(-LE nosan); fi
ctest --test-dir "${build}" -L 'unit|integration|fault' "${exclude[@]}" --output-on-failure \
  -j "${jobs}" --timeout 600 || rc=$?
echo "== tests took $(( $(date +%s) - start )) s"

if [ -n "${reports}" ]; then
  "${root}/scripts/sanitizer-reports.sh" "${reports}" sanitizer || rc=1
fi
exit "${rc}"
