#!/usr/bin/python3
"""train_gpt_overhead.py: what checkpointing every step costs examples/train_gpt.py,
eager saves against lazy ones (issue 16), measured on the example trainer itself.

Starts a real ckpt-meta and ckpt-agent (memory tier on /dev/shm) from
$CKPT_BUILD_DIR (default: ./build) and runs train_gpt.py as one rank (gloo,
one torch thread, protection "none": one node) three times with the same
seed and model:

  none    --every larger than --steps: no checkpoint
  eager   --every 1: ckpt.torch.save after every step, then a wait for
          PROTECTED (at once with protection none: STAGED is enough)
  lazy    --every 1 --lazy: the copy overlaps the next step's forward and
          backward; the optimizer step waits for it

and reports train_gpt's own numbers from its "done" line: the median
iteration (a step with its save) and the median training step, overhead =
(iteration of the mode - iteration of none) / iteration of none, and the CPU
seconds ckpt-meta and ckpt-agent spent during the run (/proc). The state
size is printed from the first save. The three runs must end in the same
final state (train_gpt's sha256 of model and optimizer): saves change nothing.

  PYTHONPATH=build/python CKPT_BUILD_DIR=build /usr/bin/python3 bench/train_gpt_overhead.py \\
      [--d-model 512] [--layers 8] [--steps 30] [--batch 8]
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys

from bench_daemons import BUILD_DIR, free_ports, running  # bench/ (this script's directory)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cpu_seconds(pid):
    """User + system CPU seconds of a live process (/proc/PID/stat)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(d, mode, a, job):
    (port,) = free_ports(1)
    args = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--meta", d.meta, "--agent-socket", str(d.socket),
            "--job", job, "--rank", "0", "--world-size", "1", "--dist-port", str(port), "--steps", str(a.steps),
            "--every", str(a.steps + 1 if mode == "none" else 1), "--protection", "none",
            "--d-model", str(a.d_model), "--layers", str(a.layers), "--batch", str(a.batch)]
    if mode == "lazy":
        args.append("--lazy")
    env = dict(os.environ, PYTHONPATH=str(BUILD_DIR / "python"))
    daemons_before = sum(cpu_seconds(p.pid) for p in d.procs)
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=3600)
    daemons_s = sum(cpu_seconds(p.pid) for p in d.procs) - daemons_before
    if out.returncode != 0:
        raise SystemExit(f"train_gpt_overhead.py: {mode} run failed ({out.returncode}):\n{out.stderr[-4000:]}")
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    done = next(e for e in events if e["event"] == "done")
    saves = [e for e in events if e["event"] == "save"]
    return done, saves, daemons_s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    # AdamW: parameters + 2 moments, about 12 x d^2 x 4 bytes per layer.
    est = 3 * 4 * (12 * a.d_model * a.d_model * a.layers + 2 * 256 * a.d_model)
    # Two versions kept per job (the eager and the lazy job) and one being written.
    with running(f"{(6 * est + (256 << 20)) >> 20}MiB", "gpt-overhead") as d:
        results = {}
        for i, mode in enumerate(("none", "eager", "lazy")):
            results[mode] = run(d, mode, a, f"gpt-overhead-{i}")
        eager_saves = results["eager"][1]
        size = eager_saves[0]["bytes"] if eager_saves else 0
        base = results["none"][0]["median_iteration_ms"]
        print(f"train_gpt_overhead.py: train_gpt.py --d-model {a.d_model} --layers {a.layers} --batch {a.batch}, "
              f"{a.steps} steps, a save after every step; state {size / (1 << 20):.0f} MiB\n")
        print(f"{'mode':<6} {'median iteration ms':>20} {'median step ms':>15} {'save blocking ms':>17} "
              f"{'overhead':>9} {'daemons CPU s':>14}")
        for mode, (done, saves, daemons_s) in results.items():
            blocking = sorted(s["blocking_ms"] for s in saves)
            bl = f"{blocking[len(blocking) // 2]:.1f}" if blocking else "-"
            it = done["median_iteration_ms"]
            print(f"{mode:<6} {it:>20.1f} {done['median_step_ms']:>15.1f} {bl:>17} {(it - base) / base * 100:>8.1f}% "
                  f"{daemons_s:>14.2f}")
        digests = {mode: done["final_sha256"] for mode, (done, _, _) in results.items()}
        same = len(set(digests.values())) == 1
        print(f"\nfinal state {'identical in the three runs' if same else 'DIFFERS: ' + repr(digests)}")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
