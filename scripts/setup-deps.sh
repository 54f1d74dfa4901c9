#!/usr/bin/env bash
# Installs every Debian 12 package ckpt needs to build, test and benchmark.
# Idempotent: prints nothing and touches nothing when all packages are present;
# runs `apt-get update` only when something is missing.
#
# The package list lives in scripts/packages.txt (one name per line, '#' comments),
# so deploy/docker/Dockerfile and this script install exactly the same set.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
list="${here}/packages.txt"

mapfile -t packages < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "${list}" | grep -v '^$')

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "${p}" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("${p}")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

echo "setup-deps: installing ${#missing[@]} missing package(s): ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup-deps: done"
