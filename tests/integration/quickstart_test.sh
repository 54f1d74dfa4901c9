#!/usr/bin/env bash
# Runs scripts/quickstart.sh in a small configuration against a prebuilt build dir
# (no cmake from inside ctest) and checks: exit 0, the "matches: yes" and peer-replica lines,
# that it ran secure (certificates made with ckptctl certs, meta with mutual TLS), and that it
# left nothing behind (its temp dir, its /dev/shm memory tiers, its processes).
#
#   tests/integration/quickstart_test.sh SOURCE_DIR BUILD_DIR [PROTECTION [EXAMPLE]]
# PROTECTION: replicate:2:ring (default; the orphaned rank must restore from "replica") or
# ec:K+M (it must restore by "ec_decode"). EXAMPLE: gpt (default) or moe (QS_EXAMPLE; then
# the sparse-to-dense line must be there too).
# Exit 77 (ctest: skipped) when /usr/bin/python3 has no torch.
set -euo pipefail

if [ "$#" -lt 2 ] || [ "$#" -gt 4 ]; then
  echo "usage: $0 SOURCE_DIR BUILD_DIR [PROTECTION [EXAMPLE]]" >&2; exit 2
fi
src="$1"; build="$2"; protection="${3:-replicate:2:ring}"; example="${4:-gpt}"
case "${protection}" in
  replicate:*) source=replica ;;
  ec:*) source=ec_decode ;;
  *) echo "PROTECTION must be replicate:... or ec:..., got '${protection}'" >&2; exit 2 ;;
esac
[ -x "${src}/scripts/quickstart.sh" ] || { echo "no ${src}/scripts/quickstart.sh" >&2; exit 2; }
[ -x "${build}/bin/ckpt-agent" ] || { echo "no ${build}/bin/ckpt-agent: build first" >&2; exit 2; }
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "SKIP: /usr/bin/python3 cannot import torch"; exit 77
fi

tmp="$(mktemp -d "${TMPDIR:-/tmp}/ckpt-quickstart-test.XXXXXX")"
trap 'rm -rf "${tmp}"' EXIT
out="${tmp}/out.txt"

rc=0
TMPDIR="${tmp}" QS_EXAMPLE="${example}" QS_PROTECTION="${protection}" CKPT_BUILD_DIR="${build}" CKPT_SKIP_BUILD=1 QS_STEPS=20 QS_EVERY=5 QS_CRASH_AT=10 \
  "${src}/scripts/quickstart.sh" >"${out}" 2>&1 &
qs=$!
wait "${qs}" || rc=$?
cat "${out}"

fail() { echo "quickstart_test: FAIL: $*" >&2; exit 1; }
[ "${rc}" -eq 0 ] || fail "quickstart.sh exited ${rc}"
grep -q "^== certificates (ckptctl certs)" "${out}" || fail "quickstart.sh made no certificates"
grep -Eq "^== ckpt-meta on 127\.0\.0\.1:[0-9]+ with mutual TLS" "${out}" || fail "ckpt-meta did not run with mutual TLS"
! grep -q -- "--insecure" "${src}/scripts/quickstart.sh" || fail "scripts/quickstart.sh uses --insecure"
grep -qx "loss curve matches uninterrupted run: yes" "${out}" || fail "no 'loss curve matches uninterrupted run: yes' line"
grep -Eq "^rank [0-9] \(dead agent\) restored from .*: yes$" "${out}" || fail "the dead agent's rank did not restore from its peers"
if [ "${example}" = moe ]; then
  grep -Eq "^rank [0-9]: experts' snapshot steps at step 10: .*; [1-9][0-9]* expert-steps replayed" "${out}" \
    || fail "no sparse-to-dense line (experts' snapshot steps, expert-steps replayed)"
  grep -Eq "^sparse saves: " "${out}" || fail "no sparse saves line"
fi
grep -Eq "^rank [0-9]: restored step 10 through node-[0-9] from ${source} .*its agent was killed" "${out}" \
  || fail "no '${source}' restore line for the rank whose agent was killed"
# Clean-up: no temp dir left in our TMPDIR, no memory tier left under /dev/shm, no children.
left="$(find "${tmp}" -mindepth 1 -maxdepth 1 ! -name out.txt)"
[ -z "${left}" ] || fail "quickstart.sh left ${left}"
[ ! -e "/dev/shm/ckpt-quickstart-${qs}" ] || fail "quickstart.sh left /dev/shm/ckpt-quickstart-${qs}"
# Every daemon and rank it started had a path under ${tmp} on its command line.
/usr/bin/python3 - "${src}/tests/support" "${tmp}" <<'PY' || fail "processes started by quickstart.sh are still running"
import sys
sys.path.insert(0, sys.argv[1])
from launched import leftover_processes
left = leftover_processes(sys.argv[2], but=("quickstart_test.sh",))
print("\n".join(left), file=sys.stderr)
sys.exit(1 if left else 0)
PY
echo "quickstart_test: OK"
