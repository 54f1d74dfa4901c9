#!/usr/bin/python3
"""meta_takeover_bench.py: what killing meta's leader costs a training job (issue 37).

Real daemons from $CKPT_BUILD_DIR (bench_daemons.py, mutual TLS as shipped): three
ckpt-meta replicas (--replica-of an etcd of their own, --replica-lease-ms 2000
unless --lease-ms), two ckpt-agents and a 2-rank job (replicate:2) whose
trainers are given every replica's address and save a small version in a loop,
each waited to PROTECTED. --kills times: the leader is killed with SIGKILL
(or paused with SIGSTOP: --fault stop, continued once another leads), and
measured from then:

  elected    until another replica's /readyz answers 200 (polled every 10 ms)
  first ok   until the trainers' next save is PROTECTED through the new leader
             (what a job feels: its saves go on, they are not protected meanwhile)

then the old leader is started again (it rejoins as a follower) and the next
kill waits until it has caught up. At the end every version the trainers saw
PROTECTED is checked to be PROTECTED in the last leader's state (or
evicted by the job's retention, which needs its record): an acknowledged
change lost is a failure (exit 1).

  PYTHONPATH=build/python CKPT_BUILD_DIR=build /usr/bin/python3 bench/meta_takeover_bench.py \\
      [--kills 20] [--lease-ms 2000] [--fault kill|stop]
"""
import argparse
import signal
import statistics
import threading
import time

import numpy as np

import ckpt
from bench_daemons import running  # bench/ (this script's directory)


class Trainers:
    """Two ranks saving step after step; records when each version was seen PROTECTED."""

    def __init__(self, d, job):
        self.clients = [ckpt.Client(job=job, rank=r, world_size=2, meta=d.meta, agent_socket=str(d.sockets[r]),
                                    protection="replicate:2") for r in range(2)]
        self.protected = {}  # step -> monotonic time seen PROTECTED
        self.errors = 0
        self.stop = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        step = 0
        state = {"w": np.arange(1 << 16, dtype=np.float32)}
        while not self.stop:
            step += 1
            try:
                handles = [c.save(step, state) for c in self.clients]
                for h in handles:
                    h.wait("protected", timeout=60)
                with self.lock:
                    self.protected[step] = time.monotonic()
            except ckpt.Error:
                with self.lock:
                    self.errors += 1
            time.sleep(0.02)

    def first_protected_after(self, t, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                later = [v for v in self.protected.values() if v > t]
            if later:
                return min(later)
            time.sleep(0.01)
        raise SystemExit("no save reached PROTECTED after the takeover")


def wait_leader(d, other_than, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        i = d.leader()
        if i is not None and i != other_than:
            return i, time.monotonic()
        time.sleep(0.01)
    raise SystemExit("no replica took over")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--lease-ms", type=int, default=2000)
    ap.add_argument("--fault", choices=("kill", "stop"), default="kill")
    args = ap.parse_args()
    with running("256MiB", "takeover", agents=2, meta_replicas=3, replica_lease_ms=args.lease_ms) as d:
        t = Trainers(d, "takeover")
        t.first_protected_after(0)
        elected, first_ok = [], []
        for k in range(args.kills):
            old = d.leader()
            time.sleep(0.5)  # saves flowing through this leader
            t0 = time.monotonic()
            d.metas[old].send_signal(signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
            new, t1 = wait_leader(d, old)
            t2 = t.first_protected_after(t1 if args.fault == "stop" else t0)
            elected.append((t1 - t0) * 1000)
            first_ok.append((t2 - t0) * 1000)
            print(f"kill {k + 1}: replica {old} -> {new}: elected {elected[-1]:.0f} ms, "
                  f"first PROTECTED save {first_ok[-1]:.0f} ms", flush=True)
            if args.fault == "stop":
                d.metas[old].send_signal(signal.SIGCONT)  # wakes, finds its lease gone, exits
            d.metas[old].wait(timeout=60)
            d.start_meta_replica(old)
        t.stop = True
        t.thread.join(timeout=120)
        # Every version seen PROTECTED is PROTECTED in the last leader's state.
        with t.lock:
            seen = sorted(t.protected)
        c = t.clients[0]
        lost = []
        for s in seen:
            try:
                c.wait(s, "protected", timeout=10)
            except ckpt.Error as e:
                if "evicted by retention" not in str(e):  # a newer version replaced it: meta knows it
                    lost.append((s, str(e)))
        print(f"\n{args.kills} {args.fault}s of the leader, replica lease {args.lease_ms} ms, "
              f"{len(seen)} versions PROTECTED, {t.errors} saves failed meanwhile")
        for name, v in (("elected", elected), ("first PROTECTED save", first_ok)):
            print(f"{name:>22}: median {statistics.median(v):6.0f} ms, max {max(v):6.0f} ms")
        if lost:
            raise SystemExit(f"{len(lost)} acknowledged versions not PROTECTED any more: {lost[:3]}")
        print("every version seen PROTECTED is PROTECTED (or evicted by retention) after the takeovers")


if __name__ == "__main__":
    main()
