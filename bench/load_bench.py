#!/usr/bin/python3
"""load_bench.py: what a restore costs a trainer in Python, against torch.load of
the same bytes from memory (issue 42's "c.load vs torch.load" row).

Starts a real ckpt-meta and ckpt-agent (memory tier on /dev/shm, as shipped:
mutual TLS) from $CKPT_BUILD_DIR (default: ./build), saves a GPT-2-like state
once (a model of --layers blocks of width --d-model with a --vocab embedding,
and AdamW's two moments of every parameter: 148 x 3 tensors by default, about
1 GiB), then times, --runs times each, alternating:

  c.load        client.load(step): fresh tensors, every byte crc-checked
  torch.load    torch.load(io.BytesIO(b)) of the same state torch.save'd to
                bytes b in this process (no file, no page cache: the
                fastest torch.load can be)
  load_into     client.load_into(step, targets) into the live tensors
  memcpy        one numpy copy of as many bytes (this machine's limit)

The tensors of each load are dropped before the next. Both loads allocate
their tensors with glibc's malloc, so in one process what they cost depends
mostly on whether malloc hands back memory this process has touched before
(no page faults) or fresh pages (a fault per 4 KiB page, each zeroed by the
kernel), and that depends on glibc's heap state (its dynamic trim and mmap
thresholds), which changes from run to run. --allocator fixes it
(GLIBC_TUNABLES; the script re-runs itself):

  warm      (default) freed memory is kept (trim threshold 1 TiB, tensors up
            to 32 MiB from the heap): a trainer that held its state before
  default   glibc's own thresholds (results vary between runs)

With --fresh, each load instead runs in a new process that does just that
load, as a trainer's resume after a restart does (c.load through a client
made before the timing; torch.load of bytes read from a file before the
timing), --runs processes of each kind, alternating: every byte lands in
memory the process never touched, with glibc's own thresholds.

Prints each mode's median, min and max, the medians as ratios to torch.load
and to memcpy, and the page faults each took. Each c.load result is checked
equal to the saved state once.

  PYTHONPATH=build/python CKPT_BUILD_DIR=build /usr/bin/python3 bench/load_bench.py \\
      [--fresh | --allocator warm|default] [--d-model 640] [--layers 12] [--vocab 50257] [--runs 7]
"""
import argparse
import gc
import io
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from bench_daemons import memcpy_seconds, running  # bench/ (this script's directory)

MiB = 1 << 20
TUNABLES = {
    "warm": "glibc.malloc.trim_threshold=1099511627776:glibc.malloc.mmap_threshold=33554432",
    "default": "",
}


def gpt2_like(d, layers, vocab, ctx=1024):
    """A GPT-2 shaped state: {"model": {...}, "exp_avg": {...}, "exp_avg_sq": {...}}."""
    g = torch.Generator().manual_seed(1)
    shapes = {"wte.weight": (vocab, d), "wpe.weight": (ctx, d)}
    for i in range(layers):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
            p + "attn.c_attn.weight": (d, 3 * d), p + "attn.c_attn.bias": (3 * d,),
            p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
            p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
            p + "mlp.c_fc.weight": (d, 4 * d), p + "mlp.c_fc.bias": (4 * d,),
            p + "mlp.c_proj.weight": (4 * d, d), p + "mlp.c_proj.bias": (d,),
        })
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    return {part: {k: torch.randn(s, generator=g) for k, s in shapes.items()}
            for part in ("model", "exp_avg", "exp_avg_sq")}


def nbytes(state):
    return sum(t.numel() * t.element_size() for part in state.values() for t in part.values())


def same(a, b):
    return all(torch.equal(a[p][k], b[p][k]) for p in a for k in a[p])


# One load in a process of its own (--fresh): prints "seconds faults".
FRESH_CHILD = r"""
import io, resource, sys, time
import torch
import ckpt
mode, meta, socket, path = sys.argv[1:5]
if mode == "c.load":
    c = ckpt.Client(job="load-bench", rank=0, world_size=1, meta=meta, agent_socket=socket)
    load = lambda: c.load(1)
else:
    data = open(path, "rb").read()
    load = lambda: torch.load(io.BytesIO(data))
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = time.perf_counter()
state = load()
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def fresh_loads(d, path, runs, times, faults):
    for _ in range(runs):
        for mode in ("c.load", "torch.load"):
            out = subprocess.run([sys.executable, "-c", FRESH_CHILD, mode, d.meta, str(d.socket), path],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"load_bench.py: the {mode} process failed:\n{out.stderr[-3000:]}")
            seconds, n = out.stdout.split()[-2:]
            times[mode].append(float(seconds))
            faults[mode].append(int(n))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=640)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--allocator", choices=sorted(TUNABLES), default="warm")
    ap.add_argument("--fresh", action="store_true", help="each load in a new process (a resume)")
    a = ap.parse_args()
    if a.fresh:
        a.allocator = "default"
    if os.environ.get("GLIBC_TUNABLES", "") != TUNABLES[a.allocator]:
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "GLIBC_TUNABLES": TUNABLES[a.allocator]})

    state = gpt2_like(a.d_model, a.layers, a.vocab)
    total = nbytes(state)
    tensors = sum(len(p) for p in state.values())
    buf = io.BytesIO()
    torch.save(state, buf)
    blob = buf.getvalue()
    targets = {f"{p}/{k}": t for p, part in state.items() for k, t in part.items()}

    modes = ("c.load", "torch.load") if a.fresh else ("c.load", "torch.load", "load_into")
    times = {m: [] for m in (*modes, "memcpy")}
    faults = {m: [] for m in times}

    def timed(mode, fn):
        gc.collect()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        out = fn()
        times[mode].append(time.perf_counter() - t)
        faults[mode].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        return out

    with running(f"{(3 * total + (512 * MiB)) // MiB}MiB", "load") as d:
        # Saved by one client, loaded by another, as a restarted trainer
        # would (a client that saves also warms the agent's pool in the
        # background for its next save, which would compete with the loads).
        saver = d.client("load-bench")
        saver.save(1, state)
        saver.wait(1, "staged")
        saver = None
        gc.collect()
        c = d.client("load-bench")
        back = c.load(1)
        if not same(state, back):
            raise SystemExit("load_bench.py: c.load returned other values than were saved")
        del back
        if a.fresh:
            c = None
            gc.collect()
            path = str(d.root / "state.pt")
            with open(path, "wb") as f:
                f.write(blob)
            fresh_loads(d, path, a.runs, times, faults)
        for _ in range(0 if a.fresh else a.runs):
            got = timed("c.load", lambda: c.load(1))
            del got
            got = timed("torch.load", lambda: torch.load(io.BytesIO(blob)))
            del got
            timed("load_into", lambda: c.load_into(1, targets))
        times["memcpy"].append(memcpy_seconds(total))
        faults["memcpy"].append(0)
        c = None  # its last shard closes before the daemons stop
        gc.collect()

    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"load_bench.py: {tensors} tensors, {total / MiB:.0f} MiB (GPT-2 shapes, d_model {a.d_model}, "
          f"{a.layers} layers, vocab {a.vocab}), {a.runs} runs each, "
          f"{'each load in a fresh process' if a.fresh else 'allocator ' + a.allocator}, "
          f"torch {torch.__version__}, numpy {np.__version__}")
    print(f"{'mode':<12} {'median s':>9} {'min s':>7} {'max s':>7} {'GB/s':>6} {'/ torch.load':>12} {'/ memcpy':>9} "
          f"{'page faults':>11}")
    for m, v in times.items():
        print(f"{m:<12} {med[m]:9.3f} {min(v):7.3f} {max(v):7.3f} {total / med[m] / 1e9:6.2f} "
              f"{med[m] / med['torch.load']:11.2f}x {med[m] / med['memcpy']:8.2f}x {statistics.median(faults[m]):11.0f}")


if __name__ == "__main__":
    main()
