#!/usr/bin/python3
"""resume_bench.py: the time from a node's death to training going on (issue 42).

Real daemons from $CKPT_BUILD_DIR (bench_daemons.py: ckpt-meta and five
ckpt-agents on 127.0.0.1, mutual TLS, shipped defaults otherwise). Four ranks,
one per node (node-1..node-4), save one version of --mib MiB each (4 items of
random bytes) with the given protection and wait until it is PROTECTED. Then
node-2 is lost: its agent is killed (SIGKILL) and its memory tier removed, and
rank 1's trainer with it. Measured from the kill:

  detection   until meta counts a node DEAD (ckpt_meta_nodes{state="dead"},
              polled every 20 ms): the lease, as configured (shipped: 5 s)
  connect     a new trainer for rank 1 on the spare node-5 connects (started
              at once after the kill, as a launcher that restarts the rank
              without waiting for meta would)
  restore     its load of the version (locate + restore from a peer's replica
              or by EC decode + the client's crc checks), bytes compared
  others      ranks 0, 2, 3 load the version from their own nodes (each
              reported; they would run in parallel on their nodes)

plus the lost rank's restore next to --mib MiB at the bandwidth of
`ucx_perftest -t tag_bw` (256 MiB messages, UCX's own choice of transports, as
the agents') in the same run: goal <= 1.25x for a replica, <= 2.5x for a
decode. Each protection runs --runs times.

  PYTHONPATH=build/python CKPT_BUILD_DIR=build /usr/bin/python3 bench/resume_bench.py \\
      [--mib 1024] [--protection replicate:2 --protection ec:2+1] [--runs 1] [--fault kill|stop]
      [--perf /tmp/resume.perf]

--fault stop SIGSTOPs node-2's agent instead (continued at the end): meta still lists its copy
first, and the restore must read past the silent holder (hedged restores, docs/agent.md).
"""
import argparse
import os
import shutil
import signal
import subprocess
import threading
import time
import zlib

import numpy as np

import ckpt
from bench_daemons import running, ucx_perftest_mbps  # bench/ (this script's directory)

RANKS = 4
VICTIM = 1  # rank 1, on node-2 (agent index 1)
SPARE = 4   # node-5 (agent index 4)


def rank_state(rank, mib):
    rng = np.random.default_rng(1000 + rank)
    per = (mib << 20) // 4
    return {f"layer{i}": rng.integers(0, 256, per, dtype=np.uint8) for i in range(4)}


def crcs(state):
    return {k: zlib.crc32(np.ascontiguousarray(v)) for k, v in state.items()}


def timed_load(client, step, want):
    t = time.monotonic()
    served, state = client.load_with_source(step)
    took = time.monotonic() - t
    got = crcs(state)
    if got != want:
        raise SystemExit(f"wrong bytes restored: {got} != {want}")
    return served, took


def one_run(protection, mib, run, perf_out=None, fault="kill"):
    agent_mib = 3 * mib + 256
    with running(f"{agent_mib}MiB", f"resume{run}", agents=5) as d:
        job = f"resume-{protection.replace(':', '-').replace('+', '-')}"
        clients = [ckpt.Client(job=job, rank=r, world_size=RANKS, meta=d.meta, agent_socket=str(d.sockets[r]),
                               protection=protection) for r in range(RANKS)]
        want, handles = {}, []
        for r, c in enumerate(clients):
            state = rank_state(r, mib)
            want[r] = crcs(state)
            handles.append(c.save(1, state))
            del state
        for h in handles:
            h.wait("protected", timeout=600)

        victim = d.agents[VICTIM]
        t_kill = time.monotonic()
        if fault == "kill":
            victim.send_signal(signal.SIGKILL)
            victim.wait(timeout=30)
            shutil.rmtree(d.shm / f"node-{VICTIM + 1}", ignore_errors=True)  # the node's memory is gone with it
        else:  # stop: the node hangs (meta still counts it alive for a lease); its copy is listed first
            victim.send_signal(signal.SIGSTOP)
        clients[VICTIM] = None  # its trainer died with the node

        detected = {}

        def watch():
            while time.monotonic() - t_kill < 120:
                if d.meta_metric('ckpt_meta_nodes{state="dead"}') >= 1:
                    detected["at"] = time.monotonic() - t_kill
                    return
                time.sleep(0.02)  # a poll of a real daemon's metrics (a benchmark)

        watcher = threading.Thread(target=watch)
        watcher.start()
        perf = None
        if perf_out:  # the spare agent's profile during the lost rank's connect and restore
            perf = subprocess.Popen(["perf", "record", "-g", "-q", "-o", f"{perf_out}.{protection}.{run}",
                                     "-p", str(d.agents[SPARE].pid)], stdout=subprocess.DEVNULL)
            time.sleep(0.5)  # perf attaches (a benchmark, not a test)
        t = time.monotonic()
        c = ckpt.Client(job=job, rank=VICTIM, world_size=RANKS, meta=d.meta, agent_socket=str(d.sockets[SPARE]),
                        protection=protection)
        connect = time.monotonic() - t
        served, restore = timed_load(c, 1, want[VICTIM])
        if perf is not None:
            perf.send_signal(signal.SIGINT)
            perf.wait(timeout=60)
        others = {r: timed_load(clients[r], 1, want[r]) for r in range(RANKS) if r != VICTIM}
        watcher.join()
        if fault == "stop":
            victim.send_signal(signal.SIGCONT)
        return {"detection": detected.get("at"), "connect": connect, "restore": restore, "served": served,
                "others": others}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="state per rank (default 1024)")
    ap.add_argument("--protection", action="append", help="replicate:2, ec:2+1, ... (default both)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--fault", choices=["kill", "stop"], default="kill",
                    help="kill: node-2's agent SIGKILLed and its tier removed (default); stop: SIGSTOPped, so its "
                         "copy is listed first and the restore must hedge past it")
    ap.add_argument("--perf", metavar="PREFIX", help="perf record the spare agent during the restore into PREFIX.*")
    args = ap.parse_args()
    protections = args.protection or ["replicate:2", "ec:2+1"]
    tag = ucx_perftest_mbps("tag_bw", 256 << 20, iters=16, window=4)  # MiB/s
    wire = None if tag is None else args.mib / tag
    lost = "lost (agent SIGKILL, memory tier removed)" if args.fault == "kill" else "stopped (agent SIGSTOP)"
    print(f"{RANKS} ranks x {args.mib} MiB; node-2 {lost}; rank 1 resumes on node-5")
    print(f"ucx_perftest tag_bw 256 MiB: {'n/a' if tag is None else f'{tag:.0f} MiB/s'}"
          f" -> {args.mib} MiB in {'n/a' if wire is None else f'{wire * 1e3:.0f} ms'}")
    print(f"{'protection':12} {'run':>3} {'detect ms':>9} {'connect ms':>10} {'restore ms':>10} {'from':>10}"
          f" {'x wire':>6} {'others ms (local)':>24}")
    for protection in protections:
        for run in range(args.runs):
            r = one_run(protection, args.mib, run, args.perf, args.fault)
            others = " ".join(f"{o[1] * 1e3:.0f}" for o in r["others"].values())
            ratio = "n/a" if wire is None else f"{r['restore'] / wire:.2f}"
            detect = "n/a" if r["detection"] is None else f"{r['detection'] * 1e3:.0f}"
            print(f"{protection:12} {run:3} {detect:>9} {r['connect'] * 1e3:10.0f} {r['restore'] * 1e3:10.0f}"
                  f" {r['served']:>10} {ratio:>6} {others:>24}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("CKPT_LOG_LEVEL", "warn")
    main()
