#!/usr/bin/python3
"""Lossy and slow links under the data plane (issue 36; tests/netns/netns.py): ckpt-meta and four
ckpt-agents, each host a network namespace on one bridge, a replicated job (replicate:2:ring)
and an erasure-coded one (ec:2+1), 4 ranks each (rank r on n(r+1)), 8 MiB shards, peer timeout 2 s.

  1. step 1 with healthy links: the time until PROTECTED (both jobs);
  2. step 2 with 10% loss one way on every link out of n1 (nftables numgen) while its replica
     and EC pushes run; step 3 with 5% loss both ways on every link (meta's too): each must
     become PROTECTED; the times are printed;
  3. under 5% loss, rank 0 restores step 3 on n3 (no copy of it there: from a peer),
     byte-identical;
  4. a link cut in the middle of a restore: n1's and n2's uplinks are slowed to 24 Mbit/s (tc),
     rank 0's replicated step 1 (on n1 and n2) is restored on n4; once one of them is sending,
     its link to n4 is cut both ways: the restore must finish from the other holder, byte for
     byte, or fail with a clear error within the peer timeout; the time is printed.
Restores every acknowledged version at the end, byte for byte. No latency: tc netem is absent
from this machine's kernel (docs/testing.md "Network namespaces"); with it, a 200 ms RTT step
would run here (netns.Net.delay).

Needs root (network namespaces), iproute2, nftables, the daemons, ckptctl and the Python module;
exits 77 (skipped) otherwise. Run: CKPT_BUILD_DIR=build /usr/bin/python3 tests/netns/netns_loss_test.py
"""
import pathlib
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import netns  # noqa: E402
from netns import Checks, log, wait_for  # noqa: E402

WORLD = 4
JOBS = {"rep": ("replicate:2:ring", ["--replicate", 2, "--placement", "ring"]),
        "ec": ("ec:2+1", ["--ec", "2+1"])}
SIZE = 8 << 20


def size(job, step, rank):
    return SIZE + 4096 * rank + 7 * step + (job == "ec")


def tx(host):
    return int(host.exec(["cat", "/sys/class/net/eth0/statistics/tx_bytes"]).stdout)


def body():
    t = Checks("netns_loss_test")
    net = netns.Net("loss")
    c = netns.Cluster(net, WORLD, label="loss", peer_timeout_ms=2000, memory="256MiB")
    seed = 4
    hosts = ["meta"] + [f"n{i}" for i in range(1, WORLD + 1)]
    for job, (_, flags) in JOBS.items():
        c.create_job(job, WORLD, flags, keep=4)
    ranks = {job: [c.rank(job, r, WORLD, f"n{r + 1}", prot, seed) for r in range(WORLD)]
             for job, (prot, _) in JOBS.items()}
    acked = {job: [] for job in JOBS}

    def save_step(step, what):
        for job in JOBS:
            t0 = time.monotonic()
            ok = True
            for r in ranks[job]:
                a = r.call(op="save", step=step, size=size(job, step, r.rank))
                ok = t.check(a["ok"], f"{what}: {job} step {step} rank {r.rank} saved", a.get("error")) and ok
            a = ranks[job][0].call(op="wait", step=step, level="protected", timeout=45)
            if t.check(ok and a["ok"], f"{what}: {job} step {step} PROTECTED", a.get("error")):
                acked[job].append(step)
                t.time(f"{what}: {job} 4 x 8 MiB saved -> PROTECTED", time.monotonic() - t0)

    def load(job, rank, step, node, what):
        home = node == f"n{rank + 1}"
        r = ranks[job][rank] if home else c.rank(job, rank, WORLD, node, JOBS[job][0], seed)
        a = r.call(op="load", step=step, timeout=60)
        if not home:
            r.close()
        want = netns.payload_sha(seed, job, step, rank, size(job, step, rank))
        good = a["ok"] and a["sha256"] == want and a["tag_ok"]
        t.check(good, f"{what}: {job} step {step} rank {rank} restored on {node} byte-identical "
                      f"({a.get('served_from')}, {a.get('ms')} ms)", str(a))
        return a

    save_step(1, "healthy")
    for h in hosts[2:] + ["meta"]:
        net.loss("n1", h, 10)
    save_step(2, "10% loss n1 -> *")
    net.heal()
    for i, a in enumerate(hosts):
        for b in hosts[i + 1:]:
            net.loss(a, b, 5, both=True)
    save_step(3, "5% loss everywhere")
    for job in JOBS:
        if 3 in acked[job]:
            a = load(job, 0, 3, "n3", "5% loss everywhere")
            t.check(a.get("served_from") not in (None, "local"), f"{job}: from a peer ({a.get('served_from')})")
    net.heal()

    # 4. a link cut mid-restore
    holders = sorted(n for n, (_, s) in (c.copies("rep", 1) or {}).get(0, {}).items() if s == "valid")
    t.check(holders == ["n1", "n2"], "rep step 1 rank 0 is held by n1 and n2", str(holders))
    for h in holders:
        net.rate(h, "24mbit")
    before = {h: tx(net.host(h)) for h in holders}
    result = {}
    restorer = threading.Thread(target=lambda: result.update(a=load("rep", 0, 1, "n4", "cut mid-restore")))
    t0 = time.monotonic()
    restorer.start()
    serving = None
    ok, _ = wait_for(lambda: any(tx(net.host(h)) - before[h] > (1 << 20) for h in holders), 20, period=0.05)
    if ok:
        serving = max(holders, key=lambda h: tx(net.host(h)) - before[h])
        net.cut(serving, "n4", both=True)
        log(f"restore on n4 under way from {serving} after {time.monotonic() - t0:.2f} s: cut {serving} <-> n4")
    t.check(serving is not None, "the restore started sending from a holder")
    restorer.join(timeout=90)
    dt = time.monotonic() - t0
    a = result.get("a", {})
    if a.get("ok"):
        t.time("cut mid-restore: restore finished from the other holder", dt)
    else:
        t.check("error" in a and dt < 2 + 30, f"cut mid-restore: the restore failed clearly ({a.get('error')})")
    net.heal()

    for job in JOBS:
        for step in acked[job]:
            for r in range(WORLD):
                load(job, r, step, f"n{r + 1}", "healed")
    return t.finish(c)


if __name__ == "__main__":
    netns.main_guard(body)
