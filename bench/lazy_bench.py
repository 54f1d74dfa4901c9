#!/usr/bin/python3
"""lazy_bench.py: what checkpointing every iteration costs a training loop,
eager saves against lazy ones (issue 16), for a CPU state of --state-bytes.

Starts a real ckpt-meta and ckpt-agent (memory tier on /dev/shm) from
$CKPT_BUILD_DIR (default: ./build). The state is --tensors f32 tensors
(1 GiB in all by default). One iteration of the stand-in training loop is

  forward + backward   compute that does not touch the state: --compute-threads
                       torch threads multiplying small matrices, sized to take
                       --iteration-x times the measured copy time of the state
  optimizer step       every state tensor changed in place (t.add_(1)), as an
                       optimizer changes the parameters and its own state

and is timed in three modes, --iterations each (after one warm-up):

  none    no checkpoint
  eager   client.save(step, state) before the forward pass (blocks for the copy)
  lazy    client.save(step, state, lazy=True) before the forward pass; the
          optimizer step waits (client.wait_copied()) for the copy first

With --buffers N, the state also holds N small "buffer" tensors (as
BatchNorm's running statistics) that the forward pass changes (add_(1) before
the compute), after the parameters in the state's order as in a state dict,
and two modes run instead of lazy (which would change them under the copy):

  lazy-fwd   the forward pass waits for the whole copy first (client.wait_copied(),
             what ckpt.torch did before wait points)
  lazy-pt    the buffers are put first and the forward pass waits for their copy
             only (wait_points, client.wait_copied(through=...), what ckpt.torch does)

The copy time is the median blocking time of eager saves of the state,
measured first in the same run (a clone's time is printed too). Overhead = (median
iteration of the mode - median iteration with none) / median with none. After
the lazy runs, the newest lazy version is loaded back and compared with the
values the state had when it was saved (the pre-step values).

  PYTHONPATH=build/python CKPT_BUILD_DIR=build /usr/bin/python3 bench/lazy_bench.py \\
      [--state-bytes 1GiB] [--tensors 64] [--iteration-x 5] [--iterations 8] [--compute-threads 1] \\
      [--buffers 8] \\
      [--agent-arg=--peer-timeout-ms=60000 ...]

--compute-threads 1 (the default) leaves the second core of this 2-core machine
to the copy, as a GPU trainer's host CPU is mostly idle during a step; with 2,
the copy competes with the compute for both cores.
"""
import argparse
import statistics
import sys
import time

import torch

from bench_daemons import running  # bench/ (this script's directory)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def parse_bytes(text):
    for suffix, f in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB), ("B", 1)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * f)
    return int(text)


def median_s(fn, n=3):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Compute:
    """Matrix products on small operands (cache-resident: no memory traffic) for ~`seconds`."""

    def __init__(self, seconds):
        self.a = torch.randn(256, 256)
        self.b = torch.randn(256, 256)
        one = median_s(lambda: self._run(20), 5) / 20
        self.reps = max(1, int(seconds / one))

    def _run(self, reps):
        x = self.a
        for _ in range(reps):
            x = torch.mm(x, self.b).tanh_()
        return x

    def __call__(self):
        self._run(self.reps)


def buffers_first(state):
    """The state with the model's buffers first, and the wait point of the last one."""
    model = state["model"]
    bufs = [k for k in model if k.startswith("buffers.")]
    return {"model": {**{k: model[k] for k in bufs}, **{k: v for k, v in model.items() if k not in bufs}}}, \
        f"model/{bufs[-1]}"


def run_mode(mode, client, state, compute, iterations, first_step):
    params = [v for k, v in state["model"].items() if not k.startswith("buffers.")]
    buffers = [v for k, v in state["model"].items() if k.startswith("buffers.")]
    points = []
    if mode == "lazy-pt":
        state, point = buffers_first(state)
        points = [point]
    times = []
    step = first_step
    for i in range(iterations + 1):
        t0 = time.perf_counter()
        if mode == "eager":
            client.save(step, state)
        elif mode.startswith("lazy"):
            client.save(step, state, lazy=True, wait_points=points)
        if buffers:  # the forward pass changes the buffers first
            if mode == "lazy-fwd":
                client.wait_copied()
            elif mode == "lazy-pt":
                client.wait_copied(through=points[0])
            for t in buffers:
                t.add_(1.0)
        compute()
        if mode.startswith("lazy"):
            client.wait_copied()
        for t in params:
            t.add_(1.0)
        if i > 0:  # the first iteration is a warm-up
            times.append(time.perf_counter() - t0)
        step += 1
    client.wait_copied()
    return times, step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state-bytes", default="1GiB")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--iteration-x", type=float, default=5.0)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--compute-threads", type=int, default=1)
    ap.add_argument("--buffers", type=int, default=0,
                    help="small tensors the forward pass changes (adds the lazy-fwd and lazy-pt modes)")
    ap.add_argument("--agent-arg", action="append", default=[],
                    help="an extra ckpt-agent flag, e.g. --agent-arg=--log-level=info (repeatable)")
    a = ap.parse_args()
    total = parse_bytes(a.state_bytes)
    n = max(1, a.tensors)
    elems = total // 4 // n
    torch.set_num_threads(a.compute_threads)
    g = torch.Generator().manual_seed(7)
    # Small integers as f32: adding 1 and subtracting it again is exact.
    state = {"model": {f"layers.{i}.weight": torch.randint(-1000, 1000, (elems,), generator=g).float()
                       for i in range(n)}}
    for i in range(a.buffers):  # after the parameters, as in a state dict of a model that ends with BatchNorm
        state["model"][f"buffers.{i}"] = torch.randint(-1000, 1000, (4096,), generator=g).float()
    size = sum(t.numel() * 4 for t in state["model"].values())

    with running(f"{(3 * size + 256 * MiB) >> 20}MiB", "lazy-bench", agent_args=a.agent_arg) as d:
        c = d.client("lazy-bench", keep_in_memory=1)
        # A trainer saves into pages it wrote before (the client maps the pool
        # unpopulated and warms it after its first save, docs/agent.md): one
        # save into each of the pool's three slots first, so that the copy time
        # below is not a first touch of the pages (seconds per GiB on some VMs).
        step = 1
        for _ in range(4):
            c.save(step, state).wait("staged", timeout=300)
            step += 1
        # The copy time: an eager save's blocking time (copy + crc into the
        # agent's pool and the commit), median of three after a first one.
        saves = []
        for _ in range(4):
            t0 = time.perf_counter()
            c.save(step, state)
            saves.append(time.perf_counter() - t0)
            step += 1
        copy_s = statistics.median(saves[1:])
        clone_s = median_s(lambda: [t.clone() for t in state["model"].values()])
        compute = Compute(a.iteration_x * copy_s)
        compute_s = median_s(compute)
        if compute_s < a.iteration_x * copy_s:  # the short calibration ran fast: at least --iteration-x
            compute.reps = int(compute.reps * a.iteration_x * copy_s / compute_s * 1.03) + 1
            compute_s = median_s(compute)
        print(f"lazy_bench.py: state {size / GiB:.2f} GiB in {n} tensors; copy (eager save) {copy_s * 1e3:.0f} ms "
              f"(a clone: {clone_s * 1e3:.0f} ms); compute {compute_s * 1e3:.0f} ms ({compute_s / copy_s:.1f}x the "
              f"copy, {a.compute_threads} torch thread(s)); {a.iterations} iterations per mode after a warm-up\n")
        print(f"{'mode':<8} {'median iteration ms':>20} {'min ms':>8} {'max ms':>8} {'overhead':>9}")
        base = None
        results = {}
        # With buffers, a plain lazy loop would change them under the copy: the two ways to wait instead.
        for mode in ("none", "eager") + (("lazy-fwd", "lazy-pt") if a.buffers else ("lazy",)):
            times, step = run_mode(mode, c, state, compute, a.iterations, step)
            med = statistics.median(times)
            base = med if base is None else base
            results[mode] = med
            print(f"{mode:<8} {med * 1e3:>20.1f} {min(times) * 1e3:>8.1f} {max(times) * 1e3:>8.1f} "
                  f"{(med - base) / base * 100:>8.1f}%")
        # The newest lazy version holds the values from before its step.
        last = step - 1
        expected = {k: v - 1.0 for k, v in state["model"].items()}  # undo that step's add_
        c.wait(last, "staged", timeout=120)
        back = c.load(last)["model"]
        ok = all(torch.equal(back[k], expected[k]) for k in expected)
        print(f"\nstep {last} (lazy) restored {'byte-identical to the pre-step state' if ok else 'WRONG'}")
        lazy = "lazy-pt" if a.buffers else "lazy"
        print(f"lazy overhead ({lazy}) {(results[lazy] - base) / base * 100:.1f}% of the iteration "
              f"(goal <= 2% at >= 5x the copy time); eager {(results['eager'] - base) / base * 100:.1f}%")
        if a.buffers:
            print(f"with buffers changed by the forward pass: waiting for the whole copy "
                  f"{(results['lazy-fwd'] - base) / base * 100:.1f}%, for the buffers only "
                  f"{(results['lazy-pt'] - base) / base * 100:.1f}%")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
