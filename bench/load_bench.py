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

The tensors of each load are dropped before the next (so the allocator is as
warm for one as for the other). Prints each mode's median, min and max, and
the medians as ratios to torch.load and to memcpy. Each c.load result is
checked equal to the saved state once.

  PYTHONPATH=build/python CKPT_BUILD_DIR=build /usr/bin/python3 bench/load_bench.py \\
      [--d-model 640] [--layers 12] [--vocab 50257] [--runs 7]
"""
import argparse
import gc
import io
import statistics
import time

import numpy as np
import torch

from bench_daemons import memcpy_seconds, running  # bench/ (this script's directory)

MiB = 1 << 20


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=640)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--runs", type=int, default=7)
    a = ap.parse_args()

    state = gpt2_like(a.d_model, a.layers, a.vocab)
    total = nbytes(state)
    tensors = sum(len(p) for p in state.values())
    buf = io.BytesIO()
    torch.save(state, buf)
    blob = buf.getvalue()
    targets = {f"{p}/{k}": t for p, part in state.items() for k, t in part.items()}

    times = {m: [] for m in ("c.load", "torch.load", "load_into", "memcpy")}
    with running(f"{(3 * total + (512 * MiB)) // MiB}MiB", "load") as d:
        c = d.client("load-bench")
        c.save(1, state)
        c.wait(1, "staged")
        back = c.load(1)
        if not same(state, back):
            raise SystemExit("load_bench.py: c.load returned other values than were saved")
        del back
        for _ in range(a.runs):
            gc.collect()
            t = time.perf_counter()
            got = c.load(1)
            times["c.load"].append(time.perf_counter() - t)
            del got
            gc.collect()
            t = time.perf_counter()
            got = torch.load(io.BytesIO(blob))
            times["torch.load"].append(time.perf_counter() - t)
            del got
            gc.collect()
            t = time.perf_counter()
            c.load_into(1, targets)
            times["load_into"].append(time.perf_counter() - t)
            times["memcpy"].append(memcpy_seconds(total) if not times["memcpy"] else times["memcpy"][0])

    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"load_bench.py: {tensors} tensors, {total / MiB:.0f} MiB (GPT-2 shapes, d_model {a.d_model}, "
          f"{a.layers} layers, vocab {a.vocab}), {a.runs} runs each, torch {torch.__version__}, "
          f"numpy {np.__version__}")
    print(f"{'mode':<12} {'median s':>9} {'min s':>7} {'max s':>7} {'GB/s':>6} {'/ torch.load':>12} {'/ memcpy':>9}")
    for m, v in times.items():
        print(f"{m:<12} {med[m]:9.3f} {min(v):7.3f} {max(v):7.3f} {total / med[m] / 1e9:6.2f} "
              f"{med[m] / med['torch.load']:11.2f}x {med[m] / med['memcpy']:8.2f}x")


if __name__ == "__main__":
    main()
