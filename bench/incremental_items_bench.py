#!/usr/bin/python3
"""incremental_items_bench.py: incremental saves of a state of thousands of items (issue 15).

Starts a real ckpt-meta and ckpt-agent (memory tier on /dev/shm) from
$CKPT_BUILD_DIR (default ./build) and saves {"model": N f32 tensors of about
4 KiB} three times through the Python client: a full save that hashes
(detect_unchanged=True), a detecting save after 10% of the items changed, and
a save declaring the other 90% unchanged after they changed again. Prints the
blocking time and the bytes copied of each, checks that the last version loads
back equal, and how many items were copied at which step. With --unhashed-base
the first save does not hash, so the detecting save has nothing to compare to
and copies (and hashes) everything. With --compare R, then R full saves and
R + 1 detecting saves (10% changed before each; the first detecting one is
left out: its base was not hashed), medians of the blocking time.

  PYTHONPATH=build/python CKPT_BUILD_DIR=build /usr/bin/python3 bench/incremental_items_bench.py [--items 5000]
"""
import argparse
import statistics
import sys
import time

import torch

from bench_daemons import running  # bench/ (this script's directory)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=5000)
    ap.add_argument("--unhashed-base", action="store_true")
    ap.add_argument("--compare", type=int, default=0, metavar="R")
    a = ap.parse_args()
    n = a.items
    with running(f"{max(256, n * 16 * 8 >> 10)}MiB", "inc-items") as d:
        g = torch.Generator().manual_seed(3)
        names = [f"layers.{i // 8}.block.{i % 8}.weight" for i in range(n)]
        sd = {k: torch.randn(1024 + (i % 3) - 1, generator=g) for i, k in enumerate(names)}
        c = d.client("inc-items", keep_in_memory=3)

        def save(step, **kw):
            t = time.perf_counter()
            h = c.save(step, {"model": sd}, **kw)
            ms = (time.perf_counter() - t) * 1e3
            h.wait("staged", timeout=60)
            return ms, h.size_bytes

        full = save(1, detect_unchanged=not a.unhashed_base)
        changed = set(names[::10])
        for k in changed:
            sd[k].add_(1.0)
        detect = save(2, detect_unchanged=True)
        for k in changed:
            sd[k].add_(1.0)
        declared = save(3, unchanged=[f"model/{k}" for k in names if k not in changed])
        back = c.load(3)["model"]
        if not all(torch.equal(back[k], v) for k, v in sd.items()):
            raise SystemExit("incremental_items_bench.py: version 3 loads back different")
        steps = c.item_steps(3)
        by_step = {s: sum(1 for x in steps.values() if x == s) for s in sorted(set(steps.values()))}
        print(f"{n} items, {len(changed)} changed per save; ms blocking (bytes copied): "
              f"full{' (hashing)' if not a.unhashed_base else ''} {full[0]:.1f} ({full[1]}), "
              f"detecting {detect[0]:.1f} ({detect[1]}), declared {declared[0]:.1f} ({declared[1]}); "
              f"version 3 loads equal; items by the step they were copied at: {by_step}")
        if a.compare > 0:
            c = d.client("inc-items-compare", keep_in_memory=2, full_save_every=1 << 30)
            times = {"full": [], "detecting": []}
            step = 0
            for mode in ("full", "detecting"):
                for r in range(a.compare + (mode == "detecting")):
                    step += 1
                    for k in names[step % 10::10]:
                        sd[k].add_(1.0)
                    time.sleep(0.2)  # a stand-in training step
                    ms, copied = save(step, detect_unchanged=True) if mode == "detecting" else save(step)
                    if mode == "full" or r > 0:
                        times[mode].append(ms)
            print(f"medians of {a.compare}: full save {statistics.median(times['full']):.1f} ms, "
                  f"detecting save {statistics.median(times['detecting']):.1f} ms (last copied {copied} bytes)")


if __name__ == "__main__":
    sys.exit(main())
