#!/bin/bash
# scripts/fuzz.sh [--seconds N] [--build-dir DIR] [TARGET...]: builds the
# libFuzzer targets (tests/fuzz, clang, ASan+UBSan) in build-fuzz/ and runs
# each for N seconds (default 30) over a copy of its seed corpus
# (tests/fuzz/corpus/TARGET). Prints each target's executions, coverage and
# corpus; exits 1 if any target crashed, leaked or timed out (the input is
# kept as build-fuzz/fuzz/artifacts/TARGET/crash-*: add it to the seed corpus
# as a regression input once fixed).
#   scripts/fuzz.sh                          # all of them, 30 s each
#   scripts/fuzz.sh --seconds 600 fuzz_manifest
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "${here}")"
seconds=30
build="${root}/build-fuzz"
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --build-dir) build="$2"; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) targets+=("$1"); shift ;;
  esac
done
all=(fuzz_manifest fuzz_durable_manifest fuzz_durable_version fuzz_agent_record fuzz_peer_wire fuzz_greeting fuzz_config fuzz_trainer_tokens)
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")
"${root}/scripts/setup-deps.sh"  # clang and libclang-rt-14-dev among them
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ not found (apt-get install clang libclang-rt-14-dev)" >&2; exit 2; }

t0=$(date +%s)
CC=clang CXX=clang++ cmake -S "${root}" -B "${build}" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCKPT_FUZZ=ON -DCKPT_BUILD_TESTS=OFF -DCKPT_BUILD_BENCHMARKS=OFF -DCKPT_WERROR=OFF >/dev/null
cmake --build "${build}" -j2 --target "${targets[@]}" >/dev/null
echo "== fuzz targets built in $(( $(date +%s) - t0 )) s"

status=0
for t in "${targets[@]}"; do
  work="${build}/fuzz/work/${t}"
  art="${build}/fuzz/artifacts/${t}"
  rm -rf "${work}"
  mkdir -p "${work}" "${art}"
  cp "${root}/tests/fuzz/corpus/${t}/"* "${work}/" 2>/dev/null || true
  log="${build}/fuzz/${t}.log"
  # -rss_limit_mb: ASan's own overhead plus our largest legitimate input;
  # -max_len: a manifest of a few hundred items, a config file, a header.
  if ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
      "${build}/fuzz/${t}" -max_total_time="${seconds}" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="${art}/" "${work}" >"${log}" 2>&1; then
    result=clean
  else
    result="FAILED (see ${log}; input in ${art})"
    status=1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "${log}" | grep -o '[0-9]*$' || echo '?')
  cov=$(grep -o 'cov: [0-9]*' "${log}" | tail -1 | grep -o '[0-9]*' || echo '?')
  ft=$(grep -o 'ft: [0-9]*' "${log}" | tail -1 | grep -o '[0-9]*' || echo '?')
  corp=$(ls "${work}" | wc -l)
  printf '%-24s %10s executions in %ss, coverage %s edges (%s features), corpus %s inputs: %s\n' \
    "${t}" "${runs}" "${seconds}" "${cov}" "${ft}" "${corp}" "${result}"
done
exit ${status}
