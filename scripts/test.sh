#!/usr/bin/env bash
# Sets up, builds and runs every test that needs no special hardware.
#
#   scripts/test.sh            # deps (apt), configure, build, ctest -L 'unit|integration|fault'
#   CKPT_BUILD_DIR=build-asan CKPT_CMAKE_ARGS="-DCKPT_SANITIZE=address" scripts/test.sh
#
# Release build with asserts kept, -j2 (this machine has 2 cores), ccache when
# present. Exits non-zero on any failure. `.ci/run` calls exactly this script.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${CKPT_BUILD_DIR:-${root}/build}"
jobs="${CKPT_JOBS:-2}"

"${root}/scripts/setup-deps.sh"

echo "== configure (${build})"
# shellcheck disable=SC2086
cmake -S "${root}" -B "${build}" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DCKPT_KEEP_ASSERTS=ON \
  -DCKPT_BUILD_TESTS=ON \
  -DCKPT_BUILD_BENCHMARKS=ON \
  -DCKPT_WERROR=ON \
  ${CKPT_CMAKE_ARGS:-} >/dev/null

echo "== build (-j${jobs})"
start=$(date +%s)
cmake --build "${build}" -j "${jobs}"
echo "== build took $(( $(date +%s) - start )) s"

echo "== test"
# Labels: unit, integration, fault run here; hw needs RDMA/GPU hardware.
ctest --test-dir "${build}" -L 'unit|integration|fault' --output-on-failure \
  -j "${jobs}" --timeout 600
