#!/usr/bin/python3
"""moe_bench.py: what a version of the mixture-of-experts example costs, sparse saves
(a rotating subset of the experts per version) against full ones (issue 15).

Starts a real ckpt-meta and 4 ckpt-agents (memory tiers on /dev/shm, one durable
root) from $CKPT_BUILD_DIR (default ./build) and runs examples/train_moe.py with 4
ranks (gloo), one rank per node, replicate:2 and a flush of every version, twice
with the same seed: sparse (--experts-per-save of --experts per version; the first
save full) and full (--full). Reports per version and rank (the saves after the
first): bytes copied (the shard), bytes sent to peers and flushed (agents'
counters over the run, per version and rank), and the median blocking time of the
save call. Both runs must end in the same final state.

  PYTHONPATH=build/python CKPT_BUILD_DIR=build /usr/bin/python3 bench/moe_bench.py \\
      [--steps 40] [--every 2] [--experts 16] [--experts-per-save 2] [--d-model 128]
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from bench_daemons import BUILD_DIR, free_ports, running  # bench/ (this script's directory)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run(d, mode, a, job):
    (port,) = free_ports(1)
    env = dict(os.environ, PYTHONPATH=str(BUILD_DIR / "python"))
    procs = []
    sent0, flushed0 = d.metric("ckpt_agent_peer_sent_bytes_total"), d.metric("ckpt_agent_flush_bytes_total")
    for r in range(4):
        args = [sys.executable, str(ROOT / "examples" / "train_moe.py"), "--meta", d.meta,
                "--agent-socket", str(d.sockets[r]), "--job", job, "--rank", str(r), "--world-size", "4",
                "--dist-port", str(port), "--steps", str(a.steps), "--every", str(a.every),
                "--experts", str(a.experts), "--experts-per-save", str(a.experts_per_save),
                "--d-model", str(a.d_model), "--protection", "replicate:2:ring", "--flush-every", "1"]
        if mode == "full":
            args.append("--full")
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"moe_bench.py: {mode} run failed ({p.returncode}):\n{err[-3000:]}")
    events = [json.loads(line) for out, _ in outs for line in out.splitlines() if line.startswith("{")]
    deadline = time.monotonic() + 300
    quiet = 0
    while time.monotonic() < deadline and quiet < 10:  # flushes run in the background
        quiet = quiet + 1 if d.metric("ckpt_agent_flush_lag_bytes") == 0 else 0
        time.sleep(0.1)
    sent = d.metric("ckpt_agent_peer_sent_bytes_total") - sent0
    flushed = d.metric("ckpt_agent_flush_bytes_total") - flushed0
    return events, sent, flushed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--experts-per-save", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    a = ap.parse_args()
    with running("1GiB", "moe", agents=4, durable=True) as d:
        results = {mode: run(d, mode, a, f"moe-bench-{mode}") for mode in ("sparse", "full")}
    versions = a.steps // a.every
    print(f"moe_bench.py: train_moe.py, 4 ranks, {a.experts} experts (d_model {a.d_model}), "
          f"{a.experts_per_save} per sparse version, {a.steps} steps, a save every {a.every} "
          f"({versions} versions), replicate:2, flush_every=1\n")
    print(f"{'mode':<7} {'copied KiB/v/rank':>18} {'sent KiB/v/rank':>16} {'flushed KiB/v/rank':>19} "
          f"{'blocking ms':>12}")
    digests = {}
    for mode, (events, sent, flushed) in results.items():
        saves = [e for e in events if e["event"] == "save" and e["step"] > a.every]
        per = versions * 4
        print(f"{mode:<7} {statistics.mean(e['bytes'] for e in saves) / 1024:>18.0f} {sent / per / 1024:>16.0f} "
              f"{flushed / per / 1024:>19.0f} {statistics.median(e['blocking_ms'] for e in saves):>12.2f}")
        digests[mode] = sorted(e["final_sha256"] for e in events if e["event"] == "done")
    same = digests["sparse"] == digests["full"]
    print(f"\nfinal state {'identical in both runs' if same else 'DIFFERS'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
