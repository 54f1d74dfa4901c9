#!/bin/bash
# Runs `systemd-analyze verify` on deploy/systemd/*.service with ExecStart
# pointing at this build's binaries and EnvironmentFile at a temporary copy
# (verify requires executables that exist). Any warning about the units fails
# the test. Exits 77 (ctest SKIP_RETURN_CODE) when systemd-analyze is missing.
#
# usage: verify_systemd_units.sh SOURCE_DIR CKPT_META CKPT_AGENT [CKPT_DPU_AGENT] [CKPT_DPU_PROXY]
# (the optional ones known by their file names)
set -euo pipefail
src="$1"
declare -A bin=([ckpt-meta]="$2" [ckpt-agent]="$3")
daemons=(ckpt-meta ckpt-agent)
for extra in "${@:4}"; do
  name="$(basename "${extra}")"
  bin[${name}]="${extra}"
  daemons+=("${name}")
done

if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "SKIP: systemd-analyze not found"
  exit 77
fi

tmp="$(mktemp -d)"
trap 'rm -rf "${tmp}"' EXIT
units=()
for d in "${daemons[@]}"; do
  [[ -x "${bin[$d]}" ]] || { echo "FAIL: ${bin[$d]} is not executable"; exit 1; }
  grep -q "^ExecStart=/usr/local/bin/${d}\$" "${src}/deploy/systemd/${d}.service" \
    || { echo "FAIL: ${d}.service: ExecStart is not /usr/local/bin/${d}"; exit 1; }
  cp "${src}/deploy/systemd/${d}.env" "${tmp}/${d}.env"
  sed -e "s#^ExecStart=/usr/local/bin/${d}#ExecStart=${bin[$d]}#" \
      -e "s#^EnvironmentFile=-/etc/ckpt/#EnvironmentFile=-${tmp}/#" \
      "${src}/deploy/systemd/${d}.service" > "${tmp}/${d}.service"
  units+=("${tmp}/${d}.service")
done

set +e
out="$(systemd-analyze verify --man=no "${units[@]}" 2>&1)"
rc=$?
set -e
# Warnings about the host (other units, the machine) are not ours.
ours="$(grep -F "${tmp}" <<<"${out}" || true)"
ours+="$(grep -E '^ckpt-(meta|agent|dpu-agent|dpu-proxy)\.service:' <<<"${out}" || true)"
if [[ ${rc} -ne 0 || -n "${ours}" ]]; then
  echo "FAIL: systemd-analyze verify (exit ${rc}):"
  echo "${out}"
  exit 1
fi
if [[ -n "${out}" ]]; then
  echo "note: output not about our units:"
  echo "${out}"
fi
echo "systemd units verified: ${units[*]##*/}"
