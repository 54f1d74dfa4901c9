#!/usr/bin/python3
"""item_bench.py: the per-item cost of ckpt's Python client against torch's
clone() of the same state, measured in the same run.

Starts a real ckpt-meta and ckpt-agent (memory tier on /dev/shm) from
$CKPT_BUILD_DIR (default: ./build), then for every (item count, item size)
pair builds a model-like state, {"model": {name: tensor}} with that many f32
tensors, and measures each --runs times:

  clone          {k: v.clone() for k, v in sd.items()}, the baseline
  save blocking  Client.save(step, state): walk, lease, copy + crc into the
                 agent's pool (the commit goes in the background; "until
                 committed" is the time until the agent answered it)
  load           Client.load(step): the same structure back, fresh tensors
  load_into      Client.load_into(step, live tensors), in place

and, first, the fixed cost of one request and answer after the same gap: on
a bare unix socket to another process (the floor) and through gRPC to meta.

Each measurement follows a pause (--gap-ms, a stand-in training step) in
which the daemons' background work runs. Prints the first run apart and the
median of the others, each as a ratio to the clone's median of the same case.

  PYTHONPATH=build/python CKPT_BUILD_DIR=build /usr/bin/python3 bench/item_bench.py \\
      [--items 1000,10000] [--item-bytes 1024,4096] [--runs 7] [--gap-ms 300]
"""
import argparse
import os
import socket
import statistics
import sys
import time

import torch

from bench_daemons import running  # bench/ (this script's directory)


def run_case(d, job, n, item_bytes, runs, gap):
    elems = item_bytes // 4
    g = torch.Generator().manual_seed(42)
    sd = {f"layers.{i // 8}.block.{i % 8}.weight": torch.randn(elems, generator=g) for i in range(n)}
    state = {"model": sd}
    live = {f"model/{k}": torch.zeros(elems) for k in sd}
    c = d.client(job, keep_in_memory=2)
    rows = {"clone": [], "save blocking": [], "  until committed": [], "load": [],
            "load_into (live tensors)": []}
    for r in range(runs):
        step = r + 1
        time.sleep(gap)
        t0 = time.perf_counter()
        copy = {k: v.clone() for k, v in sd.items()}
        rows["clone"].append(time.perf_counter() - t0)
        del copy
        time.sleep(gap)
        t0 = time.perf_counter()
        h = c.save(step, state)
        rows["save blocking"].append(time.perf_counter() - t0)
        h.committed(timeout=60)  # a trainer does not wait for this; shown for comparison
        rows["  until committed"].append(time.perf_counter() - t0)
        h.wait("staged", timeout=60)
        time.sleep(gap)
        t0 = time.perf_counter()
        back = c.load(step)
        rows["load"].append(time.perf_counter() - t0)
        time.sleep(gap)
        t0 = time.perf_counter()
        c.load_into(step, live)
        rows["load_into (live tensors)"].append(time.perf_counter() - t0)
        last = f"layers.{(n - 1) // 8}.block.{(n - 1) % 8}.weight"
        if not (torch.equal(back["model"][last], sd[last]) and torch.equal(live[f"model/{last}"], sd[last])):
            raise SystemExit("item_bench.py: loaded bytes differ")
        del back
    base = statistics.median(rows["clone"][1:])
    for what, t in rows.items():
        med = statistics.median(t[1:])
        print(f"{n:<7} {item_bytes:<6} {what:<34} {t[0] * 1e3:10.2f} {med * 1e3:10.2f} {med / base:7.2f}x")
    print()


def round_trips(d, runs, gap):
    """The fixed cost every save and load pays: one request and answer after
    the same idle gap, on a bare unix socket to another process (the
    machine's floor) and through gRPC to ckpt-meta (Client.latest)."""
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        a.close()
        while True:
            m = b.recv(64)
            if not m:
                os._exit(0)
            b.send(m)
    b.close()
    c = d.client("round-trips")
    c.save(1, {"x": b"x"}).wait("staged", timeout=60)
    raw, grpc = [], []
    for _ in range(runs):
        time.sleep(gap)
        t0 = time.perf_counter()
        a.send(b"x")
        a.recv(64)
        raw.append(time.perf_counter() - t0)
        time.sleep(gap)
        t0 = time.perf_counter()
        c.latest("staged")
        grpc.append(time.perf_counter() - t0)
    a.close()
    os.waitpid(pid, 0)
    for what, t in (("unix socket round trip (floor)", raw), ("gRPC round trip to meta", grpc)):
        print(f"{'-':<7} {'-':<6} {what:<34} {t[0] * 1e3:10.2f} {statistics.median(t[1:]) * 1e3:10.2f}")
    print()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", default="1000,10000")
    ap.add_argument("--item-bytes", default="1024,4096")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--gap-ms", type=int, default=300)
    a = ap.parse_args()
    counts = [int(x) for x in a.items.split(",")]
    sizes = [int(x) for x in a.item_bytes.split(",")]
    runs = max(3, a.runs)
    memory = f"{(4 * max(counts) * max(sizes) + (64 << 20)) >> 20}MiB"
    with running(memory, "item-bench-py") as d:
        print(f"item_bench.py: {runs} runs per case; first run apart, then the median of the rest; "
              f"ratios to the clone median of the same case (torch {torch.__version__}, "
              f"{torch.get_num_threads()} intra-op thread(s))\n")
        print(f"{'items':<7} {'bytes':<6} {'measure':<34} {'first ms':>10} {'median ms':>10} {'ratio':>8}")
        round_trips(d, runs, a.gap_ms / 1000)
        job = 0
        for n in counts:
            for b in sizes:
                run_case(d, f"items-py-{job}", n, b, runs, a.gap_ms / 1000)
                job += 1


if __name__ == "__main__":
    sys.exit(main())
