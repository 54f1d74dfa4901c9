#!/usr/bin/env bash
# Quickstart: a small GPT trained by 4 ranks (examples/train_gpt.py, torch.distributed over
# gloo, CPU) checkpointing through ckpt, with a node failure in the middle.
#
# Installs what is missing, builds, makes the cluster's certificates with `ckptctl certs` (a CA
# in the temp dir; meta's, one per node, an admin's for the script's ckptctl and a trainer's for
# the two jobs), starts ckpt-meta and 4 ckpt-agents ("nodes" node-0..3 on 127.0.0.1, state in a
# temp dir, memory tiers under /dev/shm) with mutual TLS, as shipped, rank r talking to node-r.
#   1. reference: an uninterrupted run (job qs-ref-*) records the loss curve;
#   2. the same run (job qs-run-*, replicate 2 on a ring by default) where the victim rank SIGKILLs itself
#      right after its step-CRASH_AT save is PROTECTED, and the script kill -9s that rank's
#      agent; the other ranks fail on the broken all-reduce;
#   3. all 4 ranks restart with --resume: the victim rank connects to a surviving agent that
#      holds no copy of its shard, so its state must come from a peer replica (or, with
#      QS_PROTECTION=ec:K+M, be decoded from erasure-coded segments on the peers).
# Then prints the per-save blocking time, where each rank's restore came from, and whether the
# loss curve (and final model+optimizer state) equals the uninterrupted run. Stops everything it
# started (by PID).
#
#   scripts/quickstart.sh [--no-build]     # exit 0 iff the curves match and the victim rank
#                                          # restored from a peer (replica / ec_decode)
#
# Environment: CKPT_BUILD_DIR (default build), CKPT_SKIP_BUILD=1 (same as --no-build),
# CKPT_JOBS (build parallelism, default 2), QS_STEPS (default 40), QS_EVERY (save every N
# steps, default 5), QS_CRASH_AT (default 20), QS_VICTIM (rank, default 2), QS_PROTECTION
# (replicate:COPIES:ring|group or ec:K+M, default replicate:2:ring), QS_EXAMPLE (gpt, the
# default: examples/train_gpt.py; moe: examples/train_moe.py, a mixture of experts whose
# saves are sparse, 2 of 8 experts per version, and whose resume rebuilds the dense state by
# replaying the experts' logged steps), CKPT_KEEP=1 keeps the temp dir.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'; }

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${CKPT_BUILD_DIR:-${root}/build}"
skip_build="${CKPT_SKIP_BUILD:-0}"
for arg in "$@"; do
  case "${arg}" in
    --no-build) skip_build=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "quickstart.sh: unknown argument '${arg}' (try --help)" >&2; exit 2 ;;
  esac
done

int_env() {  # name default min
  local v="${!1:-$2}"
  if ! [[ "${v}" =~ ^[0-9]+$ ]] || [ "${v}" -lt "$3" ]; then
    echo "quickstart.sh: $1 must be an integer >= $3, got '${v}'" >&2; exit 2
  fi
  echo "${v}"
}
steps="$(int_env QS_STEPS 40 2)"
every="$(int_env QS_EVERY 5 1)"
crash_at="$(int_env QS_CRASH_AT 20 1)"
victim="$(int_env QS_VICTIM 2 0)"
world=4
if [ $((crash_at % every)) -ne 0 ] || [ "${crash_at}" -ge "${steps}" ]; then
  echo "quickstart.sh: QS_CRASH_AT (${crash_at}) must be a multiple of QS_EVERY (${every}) and less than QS_STEPS (${steps})" >&2
  exit 2
fi
if [ "${victim}" -ge "${world}" ]; then
  echo "quickstart.sh: QS_VICTIM must be a rank in [0, ${world}), got ${victim}" >&2; exit 2
fi
protection="${QS_PROTECTION:-replicate:2:ring}"
if [[ "${protection}" =~ ^replicate:([2-9]):(ring|group)$ ]]; then
  create_flags=(--replicate "${BASH_REMATCH[1]}" --placement "${BASH_REMATCH[2]}")
  expect_source=replica
elif [[ "${protection}" =~ ^ec:([1-9][0-9]*)\+([1-9][0-9]*)$ ]]; then
  create_flags=(--ec "${BASH_REMATCH[1]}+${BASH_REMATCH[2]}")
  expect_source=ec_decode
else
  echo "quickstart.sh: QS_PROTECTION must be replicate:COPIES:ring|group (COPIES 2..9) or ec:K+M, got '${protection}'" >&2
  exit 2
fi
case "${skip_build}" in 0|1) ;; *) echo "quickstart.sh: CKPT_SKIP_BUILD must be 0 or 1, got '${skip_build}'" >&2; exit 2 ;; esac
example="${QS_EXAMPLE:-gpt}"
case "${example}" in
  gpt|moe) ;;
  *) echo "quickstart.sh: QS_EXAMPLE must be gpt or moe, got '${example}'" >&2; exit 2 ;;
esac

py=/usr/bin/python3
[ -x "${py}" ] || { echo "quickstart.sh: ${py} not found (run scripts/setup-deps.sh)" >&2; exit 2; }
t_start=$(date +%s.%N)

if [ "${skip_build}" = 0 ]; then
  "${root}/scripts/setup-deps.sh"
  echo "== build (${build})"
  cmake -S "${root}" -B "${build}" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCKPT_KEEP_ASSERTS=ON >/dev/null
  cmake --build "${build}" -j "${CKPT_JOBS:-2}" --target ckpt-meta ckpt-agent ckptctl python_module
fi
for f in bin/ckpt-meta bin/ckpt-agent bin/ckptctl python/ckpt/__init__.py; do
  [ -e "${build}/${f}" ] || { echo "quickstart.sh: ${build}/${f} missing: build first (or drop --no-build)" >&2; exit 2; }
done
ls "${build}"/python/ckpt/_ckpt*.so >/dev/null 2>&1 \
  || { echo "quickstart.sh: the Python module is not built in ${build}/python/ckpt (target python_module)" >&2; exit 2; }
"${py}" -c 'import torch' 2>/dev/null || { echo "quickstart.sh: ${py} cannot import torch (apt install python3-torch)" >&2; exit 2; }

work="$(mktemp -d "${TMPDIR:-/tmp}/ckpt-quickstart.XXXXXX")"
shm="/dev/shm/ckpt-quickstart-$$"
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -9 "${p}" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "${p}" 2>/dev/null || true; done
  rm -rf "${shm}"
  if [ "${CKPT_KEEP:-0}" = 1 ]; then echo "kept ${work}"; else rm -rf "${work}"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

export PYTHONPATH="${build}/python${PYTHONPATH:+:${PYTHONPATH}}"
# ckptctl as an admin (its own certificate; CKPT_TLS_* of the environment are not used).
ctl() { "${build}/bin/ckptctl" --meta "${meta}" --timeout 10 --tls-ca "${pki}/ca/ca.pem" \
          --tls-cert "${pki}/admin.pem" --tls-key "${pki}/admin.key" "$@"; }
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
free_port() {  # below the ephemeral range, so no outgoing connection takes it first
  "${py}" "${root}/tests/support/localnet.py"
}
wait_port() {  # port pid
  local _
  for _ in $(seq 1 300); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    kill -0 "$2" 2>/dev/null || { echo "process $2 died; logs in ${work}" >&2; return 1; }
    sleep 0.1
  done
  echo "timeout waiting for 127.0.0.1:$1" >&2; return 1
}
# Polls `ckptctl --json ARGS` until the Python expression COND (over `d`, the parsed JSON) holds.
wait_json() {  # timeout_s description cond args...
  local timeout="$1" what="$2" cond="$3"; shift 3
  local deadline=$(( $(date +%s) + timeout ))
  while :; do
    if ctl --json "$@" 2>/dev/null | "${py}" -c "import json,sys; d=json.load(sys.stdin); sys.exit(0 if (${cond}) else 1)" 2>/dev/null; then
      return 0
    fi
    if [ "$(date +%s)" -ge "${deadline}" ]; then echo "timeout (${timeout} s) waiting for ${what}" >&2; return 1; fi
    sleep 0.2
  done
}

# The cluster's certificates (docs/security.md): the CA, meta's (ckpt://meta), one per node
# (ckpt://node/<id>), an admin's for ckptctl, and a trainer's for the two jobs of this run.
ref_job="qs-ref-$$"
run_job="qs-run-$$"
pki="${work}/pki"
certs() { "${build}/bin/ckptctl" certs "$@" >/dev/null; }
certs create-ca --dir "${pki}/ca"
certs create-meta --ca-dir "${pki}/ca" --host 127.0.0.1 --out "${pki}/meta"
for n in $(seq 0 $((world - 1))); do
  certs create-node --ca-dir "${pki}/ca" --node-id "node-${n}" --host 127.0.0.1 --out "${pki}/node-${n}"
done
certs create-client --ca-dir "${pki}/ca" --role admin --name quickstart --out "${pki}/admin"
certs create-client --ca-dir "${pki}/ca" --role trainer --name quickstart-trainer \
  --jobs "${ref_job},${run_job}" --out "${pki}/trainer"
tls_flags() {  # NAME: sets tls to the --tls-* flags of the certificate ${pki}/NAME.{pem,key}
  tls=(--tls-ca "${pki}/ca/ca.pem" --tls-cert "${pki}/$1.pem" --tls-key "${pki}/$1.key")
}
echo "== certificates (ckptctl certs): CA, meta, node-0..$((world - 1)), admin, trainer of the 2 jobs in ${pki}"

# A port picked free can be taken by another program before the daemon binds it
# (tests running side by side): a daemon that dies before it listens is started
# again on other ports, up to 3 times.
start_meta() {
  local try
  for try in 1 2 3; do
    meta_port="$(free_port)"
    meta="127.0.0.1:${meta_port}"
    echo "== ckpt-meta on ${meta} with mutual TLS (state in ${work})"
    tls_flags meta
    "${build}/bin/ckpt-meta" --listen "${meta}" --metrics-listen "127.0.0.1:$(free_port)" \
      --data-dir "${work}/meta" "${tls[@]}" >>"${work}/meta.log" 2>&1 &
    pids+=($!)
    if wait_port "${meta_port}" "${pids[-1]}"; then return 0; fi
    kill -0 "${pids[-1]}" 2>/dev/null && return 1  # alive but not listening: a real failure
    echo "   ckpt-meta exited before listening (try ${try}); starting it on other ports" >&2
  done
  return 1
}
start_meta

declare -a agent_pid socket
for n in $(seq 0 $((world - 1))); do
  node="node-${n}"
  mkdir -p "${work}/${node}/run"  # the agent makes its memory dir ${shm}/${node} (0700)
  socket[n]="${work}/${node}/run/agent.sock"
  for try in 1 2 3; do
    port="$(free_port)"
    tls_flags "${node}"
    "${build}/bin/ckpt-agent" --node-id "${node}" --meta "${meta}" --listen "127.0.0.1:${port}" \
      --data-listen "127.0.0.1:$(free_port)" --metrics-listen "127.0.0.1:$(free_port)" \
      --run-dir "${work}/${node}/run" --memory 64MiB --memory-dir "${shm}/${node}" \
      --durable-root "${work}/durable" "${tls[@]}" >>"${work}/${node}.log" 2>&1 &
    agent_pid[n]=$!
    pids+=($!)
    if wait_port "${port}" "${agent_pid[n]}"; then break; fi
    if kill -0 "${agent_pid[n]}" 2>/dev/null || [ "${try}" -eq 3 ]; then exit 1; fi
    echo "   ckpt-agent ${node} exited before listening (try ${try}); starting it on other ports" >&2
  done
done
wait_json 30 "4 alive nodes" "sum(1 for n in d['nodes'] if n['state'].lower()=='alive')==${world}" nodes
for n in $(seq 0 $((world - 1))); do
  [ -S "${socket[n]}" ] || { echo "agent node-${n} has no socket ${socket[n]}" >&2; exit 1; }
done
echo "== 4 ckpt-agents alive: node-0..node-3 (memory tiers under ${shm})"

for j in "${ref_job}" "${run_job}"; do
  ctl create-job "${j}" --world-size "${world}" "${create_flags[@]}" >/dev/null
done
echo "== jobs ${ref_job} and ${run_job}: ${world} ranks, protection ${protection}"

# run_ranks NAME JOB EXTRA_VICTIM_ARGS VICTIM_SOCKET [common args...]: starts 4 ranks, waits for all.
# Rank r uses node-r's socket, except the victim, which uses VICTIM_SOCKET. Returns nothing;
# exit codes land in ${work}/NAME-rank-R.rc.
run_ranks() {
  local name="$1" job="$2" victim_args="$3" victim_socket="$4"; shift 4
  local dport; dport="$(free_port)"
  local rpids=() r sock extra
  for r in $(seq 0 $((world - 1))); do
    sock="${socket[r]}"; extra=""
    if [ "${r}" -eq "${victim}" ]; then sock="${victim_socket}"; extra="${victim_args}"; fi
    # shellcheck disable=SC2086
    CKPT_TLS_CA="${pki}/ca/ca.pem" CKPT_TLS_CERT="${pki}/trainer.pem" CKPT_TLS_KEY="${pki}/trainer.key" \
    "${py}" "${root}/examples/train_${example}.py" --meta "${meta}" --agent-socket "${sock}" --job "${job}" \
      --rank "${r}" --world-size "${world}" --dist-port "${dport}" --steps "${steps}" --every "${every}" \
      --log "${work}/${name}-loss-${r}.jsonl" --protection "${protection}" ${extra} "$@" \
      >"${work}/${name}-rank-${r}.out" 2>"${work}/${name}-rank-${r}.err" &
    rpids+=($!)
    pids+=($!)
  done
  local deadline=$(( $(date +%s) + 120 )) rc
  # stderr of the loop goes to /dev/null: bash's "Killed" notice for the rank that SIGKILLs itself.
  for r in $(seq 0 $((world - 1))); do
    {
      while kill -0 "${rpids[r]}" && [ "$(date +%s)" -lt "${deadline}" ]; do sleep 0.1; done
      if kill -0 "${rpids[r]}"; then
        echo "   rank ${r} still running after 120 s: kill -9 ${rpids[r]}" >&3
        kill -9 "${rpids[r]}" || true
      fi
      rc=0; wait "${rpids[r]}" || rc=$?
    } 3>&2 2>/dev/null
    echo "${rc}" >"${work}/${name}-rank-${r}.rc"
  done
}
show_failure() {  # name
  local r
  for r in $(seq 0 $((world - 1))); do
    echo "-- $1 rank ${r} (exit $(cat "${work}/$1-rank-${r}.rc" 2>/dev/null || echo '?')):" >&2
    tail -5 "${work}/$1-rank-${r}.err" >&2 || true
  done
}
all_ok() {  # name
  local r
  for r in $(seq 0 $((world - 1))); do [ "$(cat "${work}/$1-rank-${r}.rc")" = 0 ] || return 1; done
}

echo "== 1. reference (examples/train_${example}.py): ${world} ranks, ${steps} steps, save every ${every}, no failure"
t0=$(date +%s.%N)
run_ranks ref "${ref_job}" "" "${socket[victim]}"
all_ok ref || { show_failure ref; echo "FAILED: the reference run failed (logs in ${work}, CKPT_KEEP=1 keeps them)"; exit 1; }
echo "   done in $(elapsed "${t0}") s"

echo "== 2. run with a failure: rank ${victim} SIGKILLs itself after its step-${crash_at} save is protected"
t0=$(date +%s.%N)
run_ranks crash "${run_job}" "--crash-at ${crash_at}" "${socket[victim]}"
vrc="$(cat "${work}/crash-rank-${victim}.rc")"
if [ "${vrc}" != 137 ] || ! grep -q '"event": "crash"' "${work}/crash-rank-${victim}.out"; then
  show_failure crash
  echo "FAILED: rank ${victim} did not crash as planned (exit ${vrc})"; exit 1
fi
echo "   rank ${victim} died by SIGKILL (exit 137) after step ${crash_at} was protected; the other ranks exited" \
     "$(for r in $(seq 0 $((world - 1))); do [ "${r}" -eq "${victim}" ] || printf '%s ' "$(cat "${work}/crash-rank-${r}.rc")"; done)(broken all-reduce)"
wait_json 10 "step ${crash_at} protected" \
  "any(v['step']==${crash_at} and v['state'].lower()=='protected' for v in d['versions'])" versions "${run_job}"
echo "   kill -9 ckpt-agent node-${victim} (pid ${agent_pid[victim]})"
t_kill=$(date +%s.%N)
kill -9 "${agent_pid[victim]}"
wait "${agent_pid[victim]}" 2>/dev/null || true
echo "   waiting for meta to declare node-${victim} dead and re-protect step ${crash_at}"
wait_json 30 "node-${victim} dead" \
  "any(n['id']=='node-${victim}' and n['state'].lower()=='dead' for n in d['nodes'])" nodes
detect_s="$(elapsed "${t_kill}")"
echo "   meta declared node-${victim} dead ${detect_s} s after the kill (the lease; polled every 0.2 s)"
wait_json 60 "step ${crash_at} re-protected" \
  "any(v['step']==${crash_at} and v['state'].lower()=='protected' for v in d['versions'])" versions "${run_job}"
echo "   failure phase took $(elapsed "${t0}") s"

# A surviving node that holds no copy of the victim's shard: its restore must cross the network.
ctl --json inspect "${run_job}" "${crash_at}" >"${work}/inspect.json"
target="$("${py}" - "${work}/inspect.json" "${victim}" "${world}" "${protection}" <<'EOF'
import collections, json, sys
d = json.load(open(sys.argv[1])); victim = int(sys.argv[2]); world = int(sys.argv[3])
if sys.argv[4].startswith("ec:"):
    # An erasure-coded version lists its stripes' segments (ckptctl inspect).
    segments = d.get("segments") or []
    if not segments:
        sys.exit(f"FAILED: ckptctl inspect shows no EC segments for step {d['step']}")
    states = collections.Counter(s["state"].lower() for s in segments)
    nodes = {s["holder_node_id"] for s in segments}
    print(f"   step {d['step']}: {len(segments)} EC segments on {len(nodes)} nodes (" +
          ", ".join(f"{n} {st}" for st, n in sorted(states.items())) + ")", file=sys.stderr)
shard = next(s for s in d["shards"] if s["rank"] == victim)
holders = {c["node_id"] for c in shard["copies"] if c["state"].lower() == "valid"}
free = [n for n in range(world) if n != victim and f"node-{n}" not in holders]
print(free[0] if free else "")
held = ", ".join(sorted(holders)) or "no node as a whole copy (erasure-coded segments)"
print(f"   rank {victim}'s shard of step {d['step']} is held by {held}", file=sys.stderr)
EOF
)"
[ -n "${target}" ] || { echo "FAILED: every surviving node holds rank ${victim}'s shard; cannot show a peer restore"; exit 1; }
echo "   rank ${victim} will resume through node-${target} (holds no copy)"

echo "== 3. resume: ${world} ranks restart with --resume"
t0=$(date +%s.%N)
run_ranks resume "${run_job}" "" "${socket[target]}" --resume
all_ok resume || { show_failure resume; echo "FAILED: the resumed run failed (logs in ${work}, CKPT_KEEP=1 keeps them)"; exit 1; }
echo "   done in $(elapsed "${t0}") s"

echo "== summary"
set +e
"${py}" - "${work}" "${world}" "${victim}" "${crash_at}" "${expect_source}" <<'EOF'
import json, os, statistics, sys
work, world, victim, crash_at, expect = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]

def events(name, r):
    out = []
    for line in open(os.path.join(work, f"{name}-rank-{r}.out")):
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out

def losses(name, r):
    path = os.path.join(work, f"{name}-loss-{r}.jsonl")
    return [json.loads(l) for l in open(path)] if os.path.exists(path) else []

saves = [e for name in ("ref", "crash", "resume") for r in range(world) for e in events(name, r) if e["event"] == "save"]
blocking = [e["blocking_ms"] for e in saves]
protected = [e["protected_ms"] for e in saves]
print(f"saves: {len(saves)} ({saves[0]['bytes'] / 1024:.0f} KiB per rank each)")
print(f"per-save blocking time (ms): median {statistics.median(blocking):.3f}, max {max(blocking):.3f}")
print(f"save until protected (ms):   median {statistics.median(protected):.3f}, max {max(protected):.3f}")

ok = True
peer_ok = False
for r in range(world):
    res = [e for e in events("resume", r) if e["event"] == "resume"]
    if not res or res[0]["step"] is None:
        print(f"rank {r}: did not restore a checkpoint"); ok = False; continue
    e = res[0]
    tag = " (its agent was killed)" if r == victim else ""
    print(f"rank {r}: restored step {e['step']} through {e['node']} from {e['served_from']} in {e['load_ms']:.1f} ms"
          f" (connect {e.get('connect_ms', 0):.1f} ms, newest protected step {e.get('latest_ms', 0):.1f} ms){tag}")
    if e["step"] != crash_at:
        print(f"rank {r}: expected to restore step {crash_at}"); ok = False
    if r == victim:
        peer_ok = e["served_from"] == expect

curve_ok = state_ok = True
for r in range(world):
    ref = [(x["step"], x["loss"]) for x in losses("ref", r)]
    resumed_from = next(e["step"] for e in events("resume", r) if e["event"] == "resume")
    got = [(x["step"], x["loss"]) for x in losses("crash", r) if x["step"] <= resumed_from]
    got += [(x["step"], x["loss"]) for x in losses("resume", r)]
    if got != ref:
        diff = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        print(f"rank {r}: loss curve differs from step {diff + 1} ({len(got)} vs {len(ref)} points)")
        curve_ok = False
    fin = lambda name: next((e["final_sha256"] for e in events(name, r) if e["event"] == "done"), None)
    if fin("ref") is None or fin("ref") != fin("resume"):
        print(f"rank {r}: final model+optimizer state differs from the uninterrupted run")
        state_ok = False
moe = [e for r in range(world) for e in events("resume", r) if e["event"] == "resume" and "snapshot_steps" in e]
if moe:
    # Sparse saves: the first full, the others a subset of the experts.
    most = max(len(x.get("experts", [])) for x in saves)
    full = [e["bytes"] for e in saves if len(e.get("experts", [])) == most]
    part = [e["bytes"] for e in saves if len(e.get("experts", [])) < most]
    if part:
        print(f"sparse saves: {statistics.median(part) / 1024:.0f} KiB per rank (a subset of the experts) against "
              f"{statistics.median(full) / 1024:.0f} KiB for a full one")
    v = next(e for e in moe if e["rank"] == victim)
    print(f"rank {victim}: experts' snapshot steps at step {v['step']}: "
          + ", ".join(f"{k}:{s}" for k, s in sorted(v["snapshot_steps"].items(), key=lambda kv: int(kv[0])))
          + f"; {v['replayed_expert_steps']} expert-steps replayed from the logs")
ref0 = losses("ref", 0)
print(f"rank 0 loss: step 1 {ref0[0]['loss']:.4f} -> step {ref0[-1]['step']} {ref0[-1]['loss']:.4f}")
print(f"final model+optimizer state equal to the uninterrupted run: {'yes' if state_ok else 'no'}")
how = "a peer replica" if expect == "replica" else "EC decode from peers"
print(f"rank {victim} (dead agent) restored from {how}: {'yes' if peer_ok else 'no'}")
print(f"loss curve matches uninterrupted run: {'yes' if curve_ok else 'no'}")
sys.exit(0 if (ok and curve_ok and state_ok and peer_ok) else 1)
EOF
rc=$?
set -e
echo "total $(elapsed "${t_start}") s"
if [ "${rc}" -ne 0 ]; then echo "FAILED (logs in ${work}; CKPT_KEEP=1 keeps them)"; exit 1; fi
echo "OK"
