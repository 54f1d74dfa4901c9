#!/usr/bin/python3
"""reshard_bench.py: a state saved by 4 ranks loaded into 3 (issue 38), against a load of
the same bytes saved by the same 3 ranks, from memory and from the durable tier.

Starts a real ckpt-meta and four ckpt-agents (memory tiers on /dev/shm, one durable root)
from $CKPT_BUILD_DIR (default ./build). The state is --tensors (8) float32 tensors of [rows, 1024],
--gib in all, split by rows over the ranks (ckpt.GlobalSlice). One job, flushed every
version, protection none (each shard in its node's memory and on disk):

  step 1  saved by 4 ranks (one per node), then the job is resized to 3 ranks
  step 2  saved by those 3 ranks (the same-layout baseline)

Each of the 3 ranks (a thread each: load_slices releases the GIL; rank i on node i) loads
its rows of every tensor with Client.load_slices, from step 1 (resharding: its rows lie in
two of the old ranks' shards) and from step 2 (its own shard), every byte checked. Then
steps 3 and 4 are saved, which evicts steps 1 and 2 from memory (it keeps 2), and both
loads run again from the durable tier. Reported per mode: the bytes each rank read against
the bytes it needs (from memory: the shards on its own node, mapped and verified whole, plus
what its agent received from peers, which send only the byte ranges a slice needs; from
the durable tier: the shards it opened, each read and verified whole), the bytes the agents
received from peers, and the slowest rank's time, resharding against same-layout; and
memcpy of a rank's part for scale. Every byte loaded is compared.

  PYTHONPATH=build/python CKPT_BUILD_DIR=build /usr/bin/python3 bench/reshard_bench.py [--gib 1]
"""
import argparse
import threading
import time

import numpy as np

import ckpt
from bench_daemons import memcpy_seconds, running  # bench/ (this script's directory)

COLS = 1024
TENSORS = 8  # --tensors


def rows_of(i, k, n):
    base, extra = divmod(n, k)
    return i * base + min(i, extra), base + (1 if i < extra else 0)


def value(t, offset, rows):
    """Rows [offset, offset + rows) of tensor t: a pattern every element of which differs."""
    r = np.arange(offset, offset + rows, dtype=np.float32)[:, None]
    return (r * COLS + np.arange(COLS, dtype=np.float32)[None, :] + t * 1e6).astype(np.float32)


def client(d, job, rank, world, **kw):
    return ckpt.Client(job=job, rank=rank, world_size=world, meta=d.meta, agent_socket=str(d.sockets[rank]),
                       flush_every=1, protection="none", **kw)


def save(clients, step, world, total_rows):
    handles = []
    for r, c in enumerate(clients):
        o, n = rows_of(r, world, total_rows)
        state = {f"t{t}": ckpt.GlobalSlice(value(t, o, n), f"t{t}", [total_rows, COLS], [o, 0])
                 for t in range(TENSORS)}
        handles.append(c.save(step, state))
    for h in handles:
        h.wait("persisted", timeout=1200)


def load(clients, step, total_rows):
    """(seconds of the slowest rank, [{old rank: shard bytes} of the shards each rank's slices
    overlap]); checks every byte."""
    world = len(clients)
    index = clients[0].global_tensors(step)
    sizes = {}
    for name, (_, _, pieces) in index.items():
        for r, _, _, lengths in pieces:
            sizes[r] = sizes.get(r, 0) + lengths[0] * lengths[1] * 4
    times, opened, errors = [0.0] * world, [{} for _ in range(world)], []

    def one(r):
        o, n = rows_of(r, world, total_rows)
        outs = [np.empty((n, COLS), np.float32) for _ in range(TENSORS)]
        t0 = time.perf_counter()
        try:
            clients[r].load_slices(step, [(f"t{t}", [o, 0], [n, COLS], outs[t]) for t in range(TENSORS)])
        except ckpt.Error as e:
            errors.append(e)
            return
        times[r] = time.perf_counter() - t0
        for t in range(TENSORS):
            if not np.array_equal(outs[t], value(t, o, n)):
                errors.append(f"rank {r} tensor {t} differs")
        src = {p for name in index for p, _, off, ln in index[name][2] if off[0] < o + n and o < off[0] + ln[0]}
        opened[r] = {p: sizes[p] for p in src}

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"reshard_bench.py: {errors[0]}")
    return max(times), opened


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size (GiB)")
    ap.add_argument("--tensors", type=int, default=8, help="global tensors the state is made of (1: one of --gib)")
    a = ap.parse_args()
    global TENSORS
    TENSORS = a.tensors
    total_rows = int(a.gib * (1 << 30)) // (TENSORS * COLS * 4)
    state = total_rows * COLS * 4 * TENSORS
    tier = f"{int(state * 1.6 / (1 << 20)) + 256}MiB"
    job = "reshard-bench"
    with running(tier, "reshard", agents=4, durable=True) as d:
        four = [client(d, job, r, 4) for r in range(4)]
        save(four, 1, 4, total_rows)
        del four
        three = [client(d, job, r, 3, resize_world=True) for r in range(3)]
        save(three, 2, 3, total_rows)
        rows = []
        for source in ("memory", "durable"):
            if source == "durable":
                # Two newer versions (memory keeps 2) evict steps 1 and 2 from memory.
                save(three, 3, 3, total_rows)
                save(three, 4, 3, total_rows)
            for step, what in ((1, "4 -> 3 ranks"), (2, "same layout")):
                before = [d.metric("ckpt_agent_peer_received_bytes_total", agent=a) for a in range(4)]
                seconds, opened = load(three, step, total_rows)
                got = [d.metric("ckpt_agent_peer_received_bytes_total", agent=a) - before[a] for a in range(4)]
                if source == "memory":
                    # Rank r's node holds old rank r's shard (step 1) and its own (step 2).
                    read = [o.get(r, 0) + got[r] for r, o in enumerate(opened)]
                else:
                    read = [sum(o.values()) for o in opened]
                rows.append((source, what, seconds, read, sum(got)))
    need = [rows_of(r, 3, total_rows)[1] * COLS * 4 * TENSORS for r in range(3)]
    copy_s = memcpy_seconds(need[0])
    gib = float(1 << 30)
    print(f"reshard_bench.py: {state / gib:.2f} GiB state ({TENSORS} x [{total_rows}, {COLS}] f32) saved by 4 "
          f"ranks, loaded by 3 (each needs {need[0] / gib:.3f} GiB); memcpy of that {copy_s * 1e3:.0f} ms\n")
    print(f"{'source':<8} {'load':<13} {'slowest rank s':>15} {'read/needed per rank':>22} "
          f"{'peer GiB':>9} {'time / same layout':>19}")
    base = {r[0]: r[2] for r in rows if r[1] == "same layout"}
    for source, what, seconds, opened, received in rows:
        ratio = " ".join(f"{o / n:.2f}" for o, n in zip(opened, need))
        print(f"{source:<8} {what:<13} {seconds:>15.3f} {ratio:>22} {received / gib:>9.2f} "
              f"{seconds / base[source]:>19.2f}")


if __name__ == "__main__":
    main()
