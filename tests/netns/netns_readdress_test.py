#!/usr/bin/python3
"""A host that comes back with a new address (issue 36; tests/netns/netns.py): ckpt-meta and
three ckpt-agents, each host a network namespace on one bridge, a replicated job
(replicate:2:ring, 3 ranks, rank r on n(r+1)).

  1. step 1 saved and PROTECTED;
  2. host n2 goes down (its agent and trainer SIGKILLed) and comes back at another address on
     the subnet (the address moves; the operator issues the node a certificate for it); its
     agent restarts at once on the same memory tier. It registers with the incarnation it read
     from the tier, which only the agent holding that tier can know, so meta takes the node id
     over from the new address at once (never DEAD, not refused; docs/meta.md "Registration").
     Measured: restart -> meta lists n2 ALIVE at the new address, and step 1 PROTECTED with
     n2's primary re-adopted from its memory tier;
  3. peers reach it: step 2 is saved by every rank (n2's trainer restarted) and becomes
     PROTECTED, which needs n1's replica of rank 0 pushed to n2's new address (checked with
     ckptctl inspect); then rank 1 (whose step-2 copies are on n2 and n3) restores step 2 on n1
     with n1 <-> n3 cut (nftables), so that only n2, at its new address, can serve it.
Checks that no acknowledged (PROTECTED) version is lost or returned wrong. Prints the times
(`time ...` lines and a JSON line at the end).

Needs root (network namespaces), iproute2, nftables, the daemons, ckptctl and the Python module;
exits 77 (skipped) otherwise. Run: CKPT_BUILD_DIR=build /usr/bin/python3 tests/netns/netns_readdress_test.py
"""
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import netns  # noqa: E402
from netns import Checks, log, wait_for  # noqa: E402

WORLD = 3
JOB = "addr"
MOVED = "n2"
PROT = "replicate:2:ring"


def size(step, rank):
    return (1 << 20) + 1000 * rank + step


def body():
    t = Checks("netns_readdress_test")
    net = netns.Net("readdress")
    c = netns.Cluster(net, WORLD, label="readdress", peer_timeout_ms=2000)
    seed = 3
    c.create_job(JOB, WORLD, ["--replicate", 2, "--placement", "ring"], keep=3)
    ranks = {r: c.rank(JOB, r, WORLD, f"n{r + 1}", PROT, seed) for r in range(WORLD)}
    acked = []

    def save_all(step):
        for r in ranks.values():
            a = r.call(op="save", step=step, size=size(step, r.rank))
            t.check(a["ok"], f"step {step} rank {r.rank} saved on {r.node}", a.get("error"))
        a = ranks[0].call(op="wait", step=step, level="protected", timeout=30)
        if t.check(a["ok"], f"step {step} PROTECTED", a.get("error")):
            acked.append(step)
            return True
        return False

    def load(r, step, what):
        a = r.call(op="load", step=step, timeout=60)
        want = netns.payload_sha(seed, JOB, step, r.rank, size(step, r.rank))
        t.check(a["ok"] and a["sha256"] == want and a["tag_ok"],
                f"{what}: step {step} rank {r.rank} restored byte-identical on {r.node} "
                f"({a.get('served_from')}, {a.get('ms')} ms)", str(a))
        return a

    save_all(1)

    # 2. n2 goes down and comes back elsewhere
    old = net.host(MOVED).address
    ranks[1].kill()
    c.kill_agent(MOVED)
    new = net.move(MOVED)
    log(f"{MOVED}'s agent killed; its address moved {old} -> {new}")
    watch = netns.StateWatch(c, period=0.1)
    t0 = watch.mark()
    c.start_agent(MOVED)  # a certificate for the new address, the same memory tier

    def at_new_address():
        n = c.nodes().get(MOVED, {})
        return n.get("state") == "alive" and n.get("address", "").startswith(new + ":") and \
            n.get("data_address", "").startswith(new + ":")

    ok, _ = wait_for(at_new_address, 30, period=0.1)
    dt = time.monotonic() - t0
    watch.stop()
    n = c.nodes().get(MOVED, {})
    if t.check(ok, f"meta lists {MOVED} ALIVE at its new address ({n.get('address')}, data {n.get('data_address')})",
               str(n)):
        t.time(f"recovery: restart at the new address -> {MOVED} ALIVE there", dt)
    # The restarted agent holds n2's memory tier (one agent per tier: its lock) and registers
    # with the incarnation it read there, so meta takes n2 over from the new address at once
    # (docs/meta.md "Registration"): no refusal, never DEAD, nothing re-protected. Before
    # that, meta refused the new address until the old lease ran out, declared n2 DEAD
    # meanwhile and re-protected its copies.
    refused = "is held by a live node" in (c.work / f"{MOVED}.log").read_text(errors="replace")
    t.check(not refused, f"{MOVED}'s registration from the new address was not refused")
    t.check(watch.seen(MOVED, "dead") is None, f"{MOVED} was never declared DEAD while it moved")
    t.check(dt <= c.lease_ms / 1000 + 3, f"{MOVED} registered at its new address within the old lease + 3 s "
            f"({dt:.1f} s)")
    ok, dt = wait_for(lambda: c.versions(JOB).get(1, {}).get("state") == "protected" and
                      (c.copies(JOB, 1) or {}).get(1, {}).get(MOVED) == ("primary", "valid"), 30)
    if t.check(ok, f"step 1 PROTECTED, rank 1's primary on {MOVED} re-adopted", str(c.copies(JOB, 1))):
        t.time(f"recovery: restart -> step 1 PROTECTED with {MOVED}'s primary", time.monotonic() - t0)

    # 3. peers reach it at the new address
    ranks[1] = c.rank(JOB, 1, WORLD, MOVED, PROT, seed)
    t2 = time.monotonic()
    if save_all(2):
        t.time("step 2 saved and PROTECTED after the move", time.monotonic() - t2)
        cp = c.copies(JOB, 2) or {}
        t.check(cp.get(0, {}).get(MOVED) == ("replica", "valid"),
                f"n1 pushed rank 0's replica of step 2 to {MOVED} at {new}", str(cp))
        t.check(cp.get(1, {}).get("n3") == ("replica", "valid"),
                f"{MOVED} pushed rank 1's replica of step 2 to n3 from {new}", str(cp))
    ranks[1].close()
    # Rank 1's step-2 copies are on n2 and n3 (ring): with n1 <-> n3 cut, a restore on n1 can
    # only be served by n2 at its new address.
    cp = (c.copies(JOB, 2) or {}).get(1, {})
    valid = sorted(n for n, (_, st) in cp.items() if st == "valid")
    t.check(valid == [MOVED, "n3"], f"step 2 rank 1 is held by {MOVED} and n3 only", str(cp))
    net.cut("n1", "n3", both=True)
    log(f"cut n1 <-> n3: rank 1's step-2 shard can reach n1 only from {MOVED} at {new}")
    mover = c.rank(JOB, 1, WORLD, "n1", PROT, seed)
    t3 = time.monotonic()
    if 2 in acked:
        a = load(mover, 2, f"from {MOVED}'s new address")
        t.check(a.get("served_from") == "replica", "step 2 rank 1 came from a peer replica",
                str(a.get("served_from")))
        t.time(f"restore of rank 1 on n1 from {MOVED} at its new address (n3 cut)", time.monotonic() - t3)
    net.heal()
    vs = c.versions(JOB)
    for step in acked:
        t.check(vs.get(step, {}).get("state") == "protected", f"step {step} still PROTECTED", str(vs.get(step)))
    for r in (ranks[0], ranks[2]):
        for step in acked:
            load(r, step, "own agent")
    return t.finish(c)


if __name__ == "__main__":
    netns.main_guard(body)
