#!/usr/bin/python3
"""The quickstart's story on six hosts (issue 36; tests/netns/netns.py): ckpt-meta and five
ckpt-agents, each in a network namespace of its own on a bridge, mutual TLS with certificates
naming the namespaces' addresses, the data plane (UCX over TCP) on the veths; five trainers,
rank r in the namespace of agent n(r+1).

  1. every rank saves steps 1..3 of a replicated job (replicate:2:ring) and of an erasure-coded
     one (ec:2+2: stripes of 4 segments on 4 of the 5 hosts, so that the survivors of one loss
     can still place a stripe on distinct hosts; with ec:3+2 on 5 hosts a loss leaves the
     versions DEGRADED by design, docs/meta.md "Failures and recovery"); each version is
     waited for until PROTECTED; the bytes the saves sent over the veths are counted
     (/sys/class/net/eth0/statistics/tx_bytes in each host);
  2. host n3 fails: its agent is killed (SIGKILL) and so is its trainer; measured: how long meta
     takes to declare n3 DEAD, and until every acknowledged version is PROTECTED again;
  3. rank 2 (n3's) resumes on a host that holds no copy of its replicated shard and restores
     every acknowledged step of both jobs: its replicated shard must come from a peer replica,
     its EC shard from a decode of the peers' segments, byte for byte; every other rank restores
     every step through its own agent.
Checks that no acknowledged (PROTECTED) version is lost or returned wrong. Prints the detection
and recovery times (`time ...` lines, and a JSON line at the end).

Needs root (network namespaces), iproute2, nftables, the daemons, ckptctl and the Python module;
exits 77 (skipped) otherwise. Run: CKPT_BUILD_DIR=build /usr/bin/python3 tests/netns/netns_quickstart_test.py
"""
import pathlib
import signal
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import netns  # noqa: E402
from netns import Checks, log, wait_for  # noqa: E402

WORLD = 5
STEPS = (1, 2, 3)
VICTIM = "n3"          # rank 2's host
VICTIM_RANK = 2
JOBS = {"rep": ("replicate:2:ring", ["--replicate", 2, "--placement", "ring"], "replica"),
        "ec": ("ec:2+2", ["--ec", "2+2"], "ec_decode")}
SIZES = [(1 << 20) + 1, 4097, 3 << 20, (2 << 20) + 12345, 777777]


def size(job, step, rank):
    return SIZES[(rank + step + (job == "ec")) % len(SIZES)]


def tx_bytes(host):
    r = host.exec(["cat", "/sys/class/net/eth0/statistics/tx_bytes"])
    return int(r.stdout.strip())


def body():
    t = Checks("netns_quickstart_test")
    net = netns.Net("quickstart")
    c = netns.Cluster(net, WORLD, label="quickstart")
    seed = 1
    for job, (_, flags, _) in JOBS.items():
        c.create_job(job, WORLD, flags, keep=len(STEPS))
    ranks = {job: [c.rank(job, r, WORLD, f"n{r + 1}", prot, seed) for r in range(WORLD)]
             for job, (prot, _, _) in JOBS.items()}

    # 1. saves
    hosts = [c.net.host(f"n{i}") for i in range(1, WORLD + 1)]
    tx0 = {h.name: tx_bytes(h) for h in hosts}
    acked = {job: [] for job in JOBS}
    t_save = time.monotonic()
    for step in STEPS:
        for job in JOBS:
            for r in ranks[job]:
                a = r.call(op="save", step=step, size=size(job, step, r.rank))
                t.check(a["ok"], f"{job} step {step} rank {r.rank} saved on {r.node}", a.get("error"))
            a = ranks[job][0].call(op="wait", step=step, level="protected", timeout=30)
            if t.check(a["ok"], f"{job} step {step} PROTECTED", a.get("error")):
                acked[job].append(step)
    t.time("save 3 steps x 2 jobs x 5 ranks until PROTECTED", time.monotonic() - t_save)
    sent = {h.name: tx_bytes(h) - tx0[h.name] for h in hosts}
    saved = {h.name: sum(size(j, s, i) for j in JOBS for s in STEPS) for i, h in enumerate(hosts)}
    log("bytes sent on each host's veth during the saves: " +
        ", ".join(f"{n} {sent[n] / 2**20:.1f} MiB (saved {saved[n] / 2**20:.1f} MiB)" for n in sent))
    # Replication ships each rank's shard once; EC (k=2, m=2) ships segments worth at least
    # half of a node's blob: every host sends at least half of what it saved over its veth.
    t.check(all(sent[n] >= saved[n] // 2 for n in sent), "the data plane crossed the veths (not loopback)",
            f"sent {sent}, saved {saved}")

    # 2. n3 fails
    for job in JOBS:
        ranks[job][VICTIM_RANK].kill()
    watch = netns.StateWatch(c, period=0.1)
    c.kill_agent(VICTIM)
    t0 = watch.mark()
    log(f"killed {VICTIM}'s agent (SIGKILL) and its trainers")
    dead = watch.wait(VICTIM, "dead", 30)
    watch.stop()
    if t.check(dead is not None, f"meta declares {VICTIM} DEAD (lease {c.lease_ms} ms)", str(c.node_states())):
        t.time(f"detection: {VICTIM} killed -> DEAD", dead)

    def all_protected():
        for job in JOBS:
            vs = c.versions(job)
            if any(vs.get(s, {}).get("state") != "protected" for s in acked[job]):
                return False
        return True

    ok, dt2 = wait_for(all_protected, 30, period=0.2)
    states = {job: {s: v["state"] for s, v in c.versions(job).items()} for job in JOBS}
    if t.check(ok, "every acknowledged version PROTECTED again on the 4 survivors", str(states)):
        t.time(f"recovery: {VICTIM} killed -> every version re-protected", time.monotonic() - t0)
    for job in JOBS:
        for s in acked[job]:
            st = states[job].get(s)
            t.check(st in ("protected", "degraded"), f"{job} step {s} not lost ({st})")

    # 3. restores: rank 2 resumes on a survivor with no copy of its replicated shard (after
    # the re-protection, which put a second copy on one of them).
    holders = {s["rank"]: {x["node_id"] for x in s["copies"] if x["state"] == "valid"}
               for s in c.ctl("inspect", "rep", acked["rep"][-1])["shards"]}
    spare = next(f"n{i}" for i in range(1, WORLD + 1) if f"n{i}" != VICTIM and f"n{i}" not in holders[VICTIM_RANK])
    log(f"rank {VICTIM_RANK}'s replicated shard is held by {sorted(holders[VICTIM_RANK])}; it resumes on {spare}")
    t_restore = time.monotonic()
    for job, (prot, _, expect) in JOBS.items():
        moved = c.rank(job, VICTIM_RANK, WORLD, spare, prot, seed)
        for step in acked[job]:
            want = netns.payload_sha(seed, job, step, VICTIM_RANK, size(job, step, VICTIM_RANK))
            a = moved.call(op="load", step=step, timeout=60)
            good = a["ok"] and a["sha256"] == want and a["tag_ok"]
            t.check(good, f"{job} step {step} rank {VICTIM_RANK} restored on {spare} byte-identical "
                          f"({a.get('served_from')}, {a.get('ms')} ms)", str(a))
            if step == acked[job][-1]:
                t.check(a.get("served_from") == expect, f"{job}: rank {VICTIM_RANK}'s restore came from {expect}",
                        str(a.get("served_from")))
        for r in ranks[job]:
            if r.rank == VICTIM_RANK:
                continue
            for step in acked[job]:
                want = netns.payload_sha(seed, job, step, r.rank, size(job, step, r.rank))
                a = r.call(op="load", step=step, timeout=60)
                t.check(a["ok"] and a["sha256"] == want and a["tag_ok"],
                        f"{job} step {step} rank {r.rank} restored on {r.node} ({a.get('served_from')})", str(a))
    t.time("restore of every acknowledged shard (30 loads)", time.monotonic() - t_restore)
    return t.finish(c)


if __name__ == "__main__":
    netns.main_guard(body)
