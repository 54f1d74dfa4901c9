#!/usr/bin/env bash
# Prints the sanitizer reports in a directory (one file per process: the tests and
# the daemons they started) and exits 1 if there are any, 0 if there are none.
# Used by scripts/test.sh --sanitize and scripts/tsan.sh.
#
#   scripts/sanitizer-reports.sh DIR KIND     # KIND names them in the output ("TSan")
set -euo pipefail
dir="$1"
kind="${2:-sanitizer}"
mapfile -t found < <(find "${dir}" -type f | sort)
if [ "${#found[@]}" -eq 0 ]; then
  echo "== no ${kind} reports"
  exit 0
fi
echo "== ${#found[@]} ${kind} report file(s) in ${dir} (one per process; SUMMARY lines):"
for f in "${found[@]}"; do
  echo "---- ${f}"
  grep -h '^SUMMARY' "${f}" | sort | uniq -c || true
done
echo "== the first report in full (at most 200 lines): ${found[0]}"
head -n 200 "${found[0]}"
exit 1
