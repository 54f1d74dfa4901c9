#!/usr/bin/env bash
# The main job, for real, on this machine: installs what is missing, builds,
# makes the cluster's certificates with `ckptctl certs` (a CA in the temp dir;
# meta's, one per node, an admin's for ckptctl, a trainer's for job "demo"),
# starts ckpt-meta and two ckpt-agents on 127.0.0.1 with mutual TLS, as shipped
# (state in a temp dir, memory tiers on /dev/shm), and runs 4 trainer ranks
# (ckpt-train-demo, 2 per node)
# that checkpoint every 2 steps and flush every 2nd version to a durable tier.
# Midway every rank crashes (SIGKILL right after a commit) and one agent is
# killed with SIGKILL and restarted (it re-adopts its memory tier); the ranks
# resume from the newest protected version, finish, and check that their final
# state equals an uninterrupted run. Then everything started here is stopped.
#
#   scripts/local-cluster.sh            # exit 0 iff every rank resumed correctly
#
# Environment: CKPT_BUILD_DIR (default build), CKPT_DEMO_MIB (state per rank,
# default 64), CKPT_KEEP=1 to keep the temp dir, CKPT_SKIP_BUILD=1 to use the
# build dir as it is (no setup-deps.sh, no cmake).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${CKPT_BUILD_DIR:-${root}/build}"
mib="${CKPT_DEMO_MIB:-64}"

if [ "${CKPT_SKIP_BUILD:-0}" != 1 ]; then
  "${root}/scripts/setup-deps.sh"
  echo "== build"
  cmake -S "${root}" -B "${build}" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCKPT_KEEP_ASSERTS=ON >/dev/null
  cmake --build "${build}" -j "${CKPT_JOBS:-2}" --target ckpt-meta ckpt-agent ckpt-train-demo ckptctl
fi
for f in ckpt-meta ckpt-agent ckpt-train-demo ckptctl; do
  [ -x "${build}/bin/${f}" ] || { echo "local-cluster.sh: ${build}/bin/${f} missing: build first" >&2; exit 2; }
done

work="$(mktemp -d "${TMPDIR:-/tmp}/ckpt-demo.XXXXXX")"
shm="/dev/shm/ckpt-demo-$$"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "${p}" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "${shm}"
  if [ "${CKPT_KEEP:-0}" != 1 ]; then rm -rf "${work}"; else echo "kept ${work}"; fi
}
trap cleanup EXIT

free_port() {  # below the ephemeral range, so no outgoing connection takes it first
  python3 "${root}/tests/support/localnet.py"
}
wait_port() {  # host port pid
  for _ in $(seq 1 300); do
    if (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; then return 0; fi
    kill -0 "$3" 2>/dev/null || { echo "process $3 died; see ${work}"; return 1; }
    sleep 0.1
  done
  echo "timeout waiting for $1:$2"; return 1
}

# The cluster's certificates (docs/security.md): the CA, meta's (ckpt://meta), one
# per node (ckpt://node/<id>), an admin's for ckptctl, a trainer's for job "demo".
pki="${work}/pki"
certs() { "${build}/bin/ckptctl" certs "$@" >/dev/null; }
certs create-ca --dir "${pki}/ca"
certs create-meta --ca-dir "${pki}/ca" --host 127.0.0.1 --out "${pki}/meta"
for node in node-a node-b; do
  certs create-node --ca-dir "${pki}/ca" --node-id "${node}" --host 127.0.0.1 --out "${pki}/${node}"
done
certs create-client --ca-dir "${pki}/ca" --role admin --name local-cluster --out "${pki}/admin"
certs create-client --ca-dir "${pki}/ca" --role trainer --name demo-trainer --jobs demo --out "${pki}/trainer"
tls() {  # NAME: the --tls-* flags of the certificate ${pki}/NAME.{pem,key}
  echo "--tls-ca ${pki}/ca/ca.pem --tls-cert ${pki}/$1.pem --tls-key ${pki}/$1.key"
}
echo "== certificates (ckptctl certs) in ${pki}: CA, meta, node-a, node-b, admin, trainer of job demo"
# ckptctl as an admin.
ctl() { "${build}/bin/ckptctl" --meta "${meta}" --timeout 10 $(tls admin) "$@"; }

meta_port="$(free_port)"
meta="127.0.0.1:${meta_port}"
echo "== ckpt-meta on ${meta} with mutual TLS (state in ${work})"
"${build}/bin/ckpt-meta" --listen "${meta}" --metrics-listen "127.0.0.1:$(free_port)" \
  --data-dir "${work}/meta" $(tls meta) >"${work}/meta.log" 2>&1 &
pids+=($!)
wait_port 127.0.0.1 "${meta_port}" "${pids[-1]}"

declare -A agent_pid agent_port agent_args
start_agent() {  # node
  local node="$1"
  "${build}/bin/ckpt-agent" ${agent_args[${node}]} >>"${work}/${node}.log" 2>&1 &
  agent_pid[${node}]=$!
  pids+=($!)
  wait_port 127.0.0.1 "${agent_port[${node}]}" "${agent_pid[${node}]}"
}
# Each node holds 4 shards per version (its 2 ranks' and, replicate:2, the
# other node's 2): 4 x mib. Retention keeps 2 PROTECTED versions while the
# next one is saved and replicated, so a tier needs 3 versions (12 x mib);
# 14 leaves room for a version that a crash left half saved. (10 deadlocked:
# the new version could not be replicated, so the old ones were never freed.)
for node in node-a node-b; do
  agent_port[${node}]="$(free_port)"
  agent_args[${node}]="--node-id ${node} --meta ${meta} --listen 127.0.0.1:${agent_port[${node}]}
    --data-listen 127.0.0.1:$(free_port) --metrics-listen 127.0.0.1:$(free_port)
    --run-dir ${work}/${node}/run --memory $((mib * 14))MiB --memory-dir ${shm}/${node}
    --durable-root ${work}/durable $(tls "${node}")"
  echo "== ckpt-agent ${node} (memory tier ${shm}/${node}, $((mib * 14)) MiB)"
  start_agent "${node}"
done

run_ranks() {  # extra args...
  local rpids=()
  for rank in 0 1 2 3; do
    local node=node-a
    [ "${rank}" -ge 2 ] && node=node-b
    CKPT_TLS_CA="${pki}/ca/ca.pem" CKPT_TLS_CERT="${pki}/trainer.pem" CKPT_TLS_KEY="${pki}/trainer.key" \
    "${build}/bin/ckpt-train-demo" --meta "${meta}" --agent-socket "${work}/${node}/run/agent.sock" \
      --job demo --rank "${rank}" --world-size 4 --steps 12 --every 2 --mib "${mib}" --flush-every 2 "$@" \
      >"${work}/rank-${rank}.out" 2>&1 &
    rpids+=($!)
    pids+=($!)
  done
  local rc=0
  for p in "${rpids[@]}"; do wait "${p}" || rc=$?; done
  cat "${work}"/rank-*.out
  return "${rc}"
}

echo "== 4 ranks train, checkpointing every 2 steps; every rank crashes after saving step 6"
run_ranks --crash-at 6 || true
echo "== kill -9 ckpt-agent node-b and restart it: its memory tier survives"
kill -9 "${agent_pid[node-b]}"
wait "${agent_pid[node-b]}" 2>/dev/null || true
start_agent node-b
grep -h "re-adopted" "${work}/node-b.log" | tail -1 || true
# Each demo rank resumes from the newest PROTECTED version it sees (it has no
# collective to agree on one with the others, as a real trainer would): wait
# until step 6, which every rank committed, is PROTECTED, so they all see it.
echo "== waiting for step 6 to be PROTECTED (or PERSISTED)"
deadline=$(( $(date +%s) + 120 ))
until ctl --json versions demo 2>/dev/null | python3 -c \
    'import json,sys; d=json.load(sys.stdin); sys.exit(0 if any(v["step"]==6 and v["state"].lower() in ("protected", "persisted") for v in d["versions"]) else 1)'; do
  if [ "$(date +%s)" -ge "${deadline}" ]; then
    echo "step 6 is not PROTECTED after 120 s:" >&2
    ctl versions demo >&2 || true
    break
  fi
  sleep 0.2
done
echo "== the ranks restart and resume from the newest protected version"
if run_ranks --resume; then
  echo "== ckptctl versions demo"
  ctl versions demo
  echo "== ckptctl status"
  ctl status
  echo "OK: every rank resumed from ckpt and matches an uninterrupted run"
else
  echo "FAILED: see ${work} (CKPT_KEEP=1 keeps it)"
  exit 1
fi
