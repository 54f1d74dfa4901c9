#!/usr/bin/python3
"""Agent <-> meta partition while the agents still reach each other (issue 36;
tests/netns/netns.py): ckpt-meta and four ckpt-agents, each host a network namespace on one
bridge, a replicated job (replicate:2:ring, 4 ranks, rank r on n(r+1)).

  1. steps 1 and 2 saved and PROTECTED;
  2. nftables cut host n1 from the meta host, both ways (n1 still reaches n2..n4, and they it);
     while it lasts:
       - n1's trainer restores step 2 from its local copy (byte-identical) and saves step 3
         (the commit is the agent's; meta cannot hear of it yet), and so do the other ranks;
       - a call that needs meta (latest) from n1 fails cleanly within the client's deadline;
       - meta declares n1 SUSPECT, then DEAD (measured from the cut), and re-protects steps 1
         and 2 on n2..n4 (measured; every shard back to 2 VALID copies off n1);
  3. heal: n1 rejoins (measured: ALIVE again), step 3 (which waited for n1's shard) becomes
     PROTECTED (measured), steps 1..3 restore byte-identical on every rank; copies beyond the
     policy (n1's, re-adopted when it rejoined, on top of those re-protection made) are
     released: every shard back to 2 VALID copies, every memory tier holding exactly what meta
     lists for steps 1..3 (measured), and those restore byte-identical again;
  4. three more saves (keep_in_memory 3) evict steps 1..3: every node's memory tier then holds
     exactly the copies meta lists for steps 4..6, 2 a shard (the partition left nothing
     behind), and those restore byte-identical.
Checks that no acknowledged (PROTECTED) version is lost or returned wrong. Prints the detection
and recovery times (`time ...` lines and a JSON line at the end).

Needs root (network namespaces), iproute2, nftables, the daemons, ckptctl and the Python module;
exits 77 (skipped) otherwise. Run: CKPT_BUILD_DIR=build /usr/bin/python3 tests/netns/netns_partition_test.py
"""
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import netns  # noqa: E402
from netns import Checks, log, wait_for  # noqa: E402

WORLD = 4
JOB = "part"
COPIES = 2
CUT = "n1"
SIZE = (1 << 20) + 4097


def size(step, rank):
    return SIZE + 4096 * rank + step


def body():
    t = Checks("netns_partition_test")
    net = netns.Net("partition")
    c = netns.Cluster(net, WORLD, label="partition")
    seed = 2
    c.create_job(JOB, WORLD, ["--replicate", COPIES, "--placement", "ring"], keep=3)
    ranks = [c.rank(JOB, r, WORLD, f"n{r + 1}", f"replicate:{COPIES}:ring", seed, rpc_timeout=3.0)
             for r in range(WORLD)]
    d = netns.JobDriver(t, ranks, seed, JOB, size)
    acked, save_all, wait_protected, restore_all = d.acked, d.save_all, d.wait_protected, d.restore_all

    for step in (1, 2):
        save_all(step)
        wait_protected(step)

    # 2. the partition
    watch = netns.StateWatch(c, period=0.1)
    net.partition(["meta"], [CUT])
    t0 = watch.mark()
    log(f"cut {CUT} from the meta host, both ways (nftables); {CUT} still reaches n2..n{WORLD}")
    t.check(not net.reachable(CUT, "meta", 7400) and net.reachable(CUT, "n2", 7401) and net.reachable("n2", CUT, 7401),
            f"{CUT} cannot reach meta but reaches its peers (and they it)")
    a = ranks[0].call(op="load", step=2)
    t.check(a["ok"] and a["served_from"] == "local" and
            a["sha256"] == netns.payload_sha(seed, JOB, 2, 0, size(2, 0)),
            f"partitioned: {CUT}'s trainer restores step 2 from its local copy ({a.get('ms')} ms)", str(a))
    saved3 = save_all(3)
    tl = time.monotonic()
    a = ranks[0].call(op="latest", timeout=30)
    t.check(not a["ok"] and time.monotonic() - tl < 10,
            f"partitioned: latest() on {CUT} fails cleanly within the client's deadline (3 s): {a.get('error')}",
            str(a))
    dead = watch.wait(CUT, "dead", 30)
    t.check(dead is not None, f"meta declares {CUT} DEAD", str(c.node_states()))
    suspect = watch.seen(CUT, "suspect")
    t.check(suspect is not None and (dead is None or suspect <= dead), f"{CUT} was SUSPECT before DEAD")
    if suspect is not None:
        t.time(f"detection: cut -> {CUT} SUSPECT (heartbeat {c.heartbeat_ms} ms, 2 missed)", suspect)
    if dead is not None:
        t.time(f"detection: cut -> {CUT} DEAD (lease {c.lease_ms} ms)", dead)
        t.check(dead <= c.lease_ms / 1000 + 3, f"DEAD within the lease + 3 s ({dead:.1f} s)")
    t_dead = time.monotonic()

    def reprotected():
        for step in (1, 2):
            cp = c.copies(JOB, step)
            if not cp or c.versions(JOB).get(step, {}).get("state") != "protected":
                return False
            for rank, holders in cp.items():
                if sum(1 for n, (_, s) in holders.items() if s == "valid" and n != CUT) < COPIES:
                    return False
        return True

    ok, dt = wait_for(reprotected, 30, period=0.2)
    if t.check(ok, f"steps 1 and 2 re-protected on n2..n{WORLD} ({COPIES} VALID copies a shard off {CUT})",
               str({s: c.copies(JOB, s) for s in (1, 2)})):
        t.time(f"recovery: {CUT} DEAD -> steps 1, 2 re-protected", dt)
        t.time(f"recovery: cut -> steps 1, 2 re-protected", time.monotonic() - t0)
    st3 = c.versions(JOB).get(3, {}).get("state")
    t.check(st3 == "open", f"step 3 waits for {CUT}'s shard while it is cut off (OPEN, not lost): {st3}")
    a = ranks[0].call(op="load", step=1)
    t.check(a["ok"] and a["served_from"] == "local", f"after DEAD, {CUT}'s trainer still restores step 1 locally",
            str(a))

    # 3. heal
    net.heal()
    t1 = watch.mark()
    log(f"healed after {t1 - t0:.1f} s")
    alive = watch.wait(CUT, "alive", 30)
    if t.check(alive is not None, f"{CUT} rejoins (ALIVE)", str(c.node_states())):
        t.time(f"recovery: heal -> {CUT} ALIVE", alive)
    watch.stop()
    if saved3:
        a = ranks[1].call(op="wait", step=3, level="protected", timeout=30)
        if t.check(a["ok"], "step 3 (saved during the partition) PROTECTED after the heal", a.get("error")):
            acked.append(3)
            t.time("recovery: heal -> step 3 PROTECTED", time.monotonic() - t1)
    vs = c.versions(JOB)
    for step in acked:
        t.check(vs.get(step, {}).get("state") == "protected", f"step {step} PROTECTED after the heal",
                str(vs.get(step)))
    restore_all(acked, "healed")
    def tiers_hold_what_meta_lists(steps):
        """Every node's memory tier holds exactly the VALID copies meta lists for `steps` (and
        nothing else of the job), COPIES a shard."""
        steps = tuple(steps)
        want = {}
        for step in steps:
            for rank, holders in (c.copies(JOB, step) or {}).items():
                for n, (_, s) in holders.items():
                    if s == "valid":
                        want.setdefault(n, set()).add((step, rank))
        for i in range(1, WORLD + 1):
            h = c.holdings(f"n{i}", JOB)
            if h is None:
                tiers_hold_what_meta_lists.last = f"n{i}'s holdings unknown"
                return False
            got = {(x["step"], int(x["what"].split()[1])) for x in h}
            if got != want.get(f"n{i}", set()):
                tiers_hold_what_meta_lists.last = (f"n{i} holds {sorted(got)}, meta lists "
                                                   f"{sorted(want.get(f'n{i}', set()))}")
                return False
        return all(len([1 for n in want if (s, r) in want[n]]) == COPIES for s in steps for r in range(WORLD))

    tiers_hold_what_meta_lists.last = ""

    # Copies beyond the policy: n1's primaries come back with it (re-adopted from its memory
    # tier) on top of the replicas re-protection made, and a replica pushed to n1 while meta
    # was declaring it dead can be adopted too. Meta releases the surplus once a version is
    # PROTECTED again (docs/meta.md "Failures and recovery"): every shard back to COPIES VALID
    # copies, and the memory tiers hold exactly what meta lists (the agents freed the rest).
    # Before, the surplus stayed until retention evicted the version.
    def surplus():
        out = []
        for step in acked:
            for rank, holders in (c.copies(JOB, step) or {}).items():
                valid = sorted(n for n, (_, s) in holders.items() if s == "valid")
                if len(valid) > COPIES:
                    out.append((step, rank, valid))
        return out

    first = surplus()
    log(f"shards with more than {COPIES} VALID copies right after the heal: {len(first)} "
        f"({'; '.join(f'{s}/{r}: {v}' for s, r, v in first) or 'none'})")
    t.count("surplus copies seen right after the heal", len(first))
    t2 = time.monotonic()
    ok, _ = wait_for(lambda: not surplus(), 30, period=0.5)
    if t.check(ok, f"no shard keeps more than {COPIES} VALID copies after the heal (the surplus released)",
               str(surplus())) and first:
        t.time("surplus seen after the heal -> released", time.monotonic() - t2)
    ok, _ = wait_for(lambda: tiers_hold_what_meta_lists(acked), 30, period=0.5)
    t.check(ok, f"after the heal every memory tier holds exactly meta's copies of steps {acked}",
            tiers_hold_what_meta_lists.last)
    restore_all(acked, "after the surplus was released")

    # 4. retention clears what the partition left
    for step in (4, 5, 6):
        if save_all(step):
            wait_protected(step)
    vs = c.versions(JOB)
    t.check(all(vs.get(s, {}).get("state") == "protected" for s in (4, 5, 6)), "steps 4..6 PROTECTED",
            str({s: vs.get(s, {}).get("state") for s in (4, 5, 6)}))

    ok, dt = wait_for(lambda: tiers_hold_what_meta_lists((4, 5, 6)), 30, period=0.5)
    if t.check(ok, f"after retention every memory tier holds exactly meta's copies of steps 4..6 ({COPIES} a shard)",
               tiers_hold_what_meta_lists.last):
        t.time("retention: step 6 PROTECTED -> memory tiers clean", dt)
    restore_all((4, 5, 6), "after retention")
    return t.finish(c)


if __name__ == "__main__":
    netns.main_guard(body)
