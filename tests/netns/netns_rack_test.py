#!/usr/bin/python3
"""A rack cut from the other half (issue 36; tests/netns/netns.py): six hosts, ckpt-meta, n1
and n2 on the near side, n3, n4 and n5 on the far side (a top-of-rack switch that drops one
rack). Two jobs of 5 ranks (rank r on n(r+1)): "rep" replicate:2:ring and "ec" ec:2+1, and a
job "near" of 2 ranks on n1 and n2 (replicate:2:ring) that lives on the near side only.

  1. steps 1 and 2 of every job saved and PROTECTED;
  2. the halves cut apart (nftables, both ways: every near host from every far host);
     docs/meta.md "Partitions" says what each side may still do; checked:
       far side (no meta): every far rank restores step 2 from its local copy, byte-identical;
         it saves step 3 and the commit returns (the agent's); latest() fails within the
         client's deadline;
       meta: declares n3, n4, n5 SUSPECT, then DEAD within the lease + 3 s (measured);
       near side: the shards with a copy on the near side are re-protected there (2 VALID
         copies on n1 and n2, measured), as far as 2 nodes can hold (shards whose copies are
         all far wait: lost-copy grace, 30 s, longer than the cut); no near memory tier holds
         more than its share; the near ranks save step 3; job "near" saves step 3 and it
         becomes PROTECTED during the cut (the near side keeps working);
  3. heal after CUT_SECONDS: n3..n5 rejoin (measured: ALIVE), every version (steps 1..3 of
     every job) converges to PROTECTED (measured), and restores byte-identical on every rank,
     and across the former cut (rank 2 of each job from n1, rank 0 from n4);
  4. three more saves (keep_in_memory 3) evict steps 1..3: every memory tier then holds
     exactly what meta lists for steps 4..6, 2 copies a replicated shard, one a segment.
Checks that no acknowledged (PROTECTED) version is lost or returned wrong. Prints the detection
and convergence times (`time ...` lines and a JSON line at the end).

Needs root (network namespaces), iproute2, nftables, the daemons, ckptctl and the Python module;
exits 77 (skipped) otherwise. Run: CKPT_BUILD_DIR=build /usr/bin/python3 tests/netns/netns_rack_test.py
"""
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import netns  # noqa: E402
from netns import Checks, log, wait_for  # noqa: E402

WORLD = 5
NEAR = ["meta", "n1", "n2"]
FAR = ["n3", "n4", "n5"]
JOBS = {"rep": ("replicate:2:ring", ["--replicate", 2, "--placement", "ring"], WORLD),
        "ec": ("ec:2+1", ["--ec", "2+1"], WORLD),
        "near": ("replicate:2:ring", ["--replicate", 2, "--placement", "ring"], 2)}
CUT_SECONDS = 12  # after DEAD; under the lost-copy grace (30 s) so far-only shards are waited for
SIZES = [(512 << 10) + 1, 4097, (1 << 20) + 333, 300001, 777777]


def size(job, step, rank):
    return SIZES[(rank + step + len(job)) % len(SIZES)]


def body():
    t = Checks("netns_rack_test")
    t_start = time.monotonic()
    net = netns.Net("rack")
    c = netns.Cluster(net, WORLD, label="rack")
    seed = 3
    for job, (_, flags, world) in JOBS.items():
        c.create_job(job, world, flags, keep=3)
    ranks = {job: [c.rank(job, r, world, f"n{r + 1}", prot, seed, rpc_timeout=3.0) for r in range(world)]
             for job, (prot, _, world) in JOBS.items()}
    acked = {job: [] for job in JOBS}

    def save(job, step, rs=None):
        ok = True
        for r in rs if rs is not None else ranks[job]:
            a = r.call(op="save", step=step, size=size(job, step, r.rank))
            ok = t.check(a["ok"], f"{job} step {step} rank {r.rank} saved on {r.node} ({a.get('ms')} ms)",
                         a.get("error")) and ok
        return ok

    def wait_protected(job, step, timeout=30, reader=0):
        a = ranks[job][reader].call(op="wait", step=step, level="protected", timeout=timeout)
        if t.check(a["ok"], f"{job} step {step} PROTECTED", a.get("error")):
            acked[job].append(step)
            return True
        return False

    def restore(r, job, step, what, rank=None):
        rank = r.rank if rank is None else rank
        a = r.call(op="load", step=step)
        want = netns.payload_sha(seed, job, step, rank, size(job, step, rank))
        return t.check(a["ok"] and a["sha256"] == want and a["tag_ok"],
                       f"{what}: {job} step {step} rank {rank} restored byte-identical on {r.node} "
                       f"({a.get('served_from')}, {a.get('ms')} ms)", str(a))

    # 1. before the cut
    for step in (1, 2):
        for job in JOBS:
            if save(job, step):
                wait_protected(job, step)

    # 2. the cut
    watch = netns.StateWatch(c, period=0.1)
    net.partition(NEAR, FAR)
    t_cut = watch.mark()
    log(f"rack cut: {' '.join(NEAR)} | {' '.join(FAR)} (both ways)")
    t.check(not net.reachable("n3", "meta", 7400) and not net.reachable("n1", "n4", 7401) and
            net.reachable("n3", "n5", 7401) and net.reachable("n1", "n2", 7401),
            "each side reaches its own half only")
    # far side: local restores, local saves
    for job in ("rep", "ec"):
        for r in ranks[job][2:]:
            a = r.call(op="load", step=2)
            t.check(a["ok"] and a["served_from"] == "local" and
                    a["sha256"] == netns.payload_sha(seed, job, 2, r.rank, size(job, 2, r.rank)),
                    f"far side: {job} rank {r.rank} restores step 2 from its local copy on {r.node} "
                    f"({a.get('ms')} ms)", str(a))
    saved3 = {job: save(job, 3) for job in ("rep", "ec")}
    tl = time.monotonic()
    a = ranks["rep"][3].call(op="latest", timeout=30)
    t.check(not a["ok"] and time.monotonic() - tl < 10,
            f"far side: latest() on n4 fails cleanly within the client's deadline (3 s): {a.get('error')}", str(a))
    # meta: detection
    dead = {}
    for n in FAR:
        dead[n] = watch.wait(n, "dead", 30)
        t.check(dead[n] is not None, f"meta declares {n} DEAD", str(c.node_states()))
    susp = [watch.seen(n, "suspect") for n in FAR]
    if all(s is not None for s in susp):
        t.time(f"detection: cut -> far nodes SUSPECT (last; heartbeat {c.heartbeat_ms} ms)", max(susp))
    if all(d is not None for d in dead.values()):
        last = max(dead.values())
        t.time(f"detection: cut -> far nodes DEAD (last; lease {c.lease_ms} ms)", last)
        t.check(last <= c.lease_ms / 1000 + 3, f"DEAD within the lease + 3 s ({last:.1f} s)")
    t.check(all(s == "alive" for n, s in c.node_states().items() if n in NEAR), "n1, n2 stay ALIVE",
            str(c.node_states()))
    # near side: re-protection within its capacity (2 nodes)
    near_nodes = {"n1", "n2"}

    def near_reprotected():
        for step in (1, 2):
            cp = c.copies("rep", step)
            if not cp:
                return False
            for rank, holders in cp.items():
                had_near = any(n in near_nodes for n in holders)
                valid_near = sum(1 for n, (_, s) in holders.items() if s == "valid" and n in near_nodes)
                if had_near and valid_near < 2:
                    return False
        return True

    t_dead = time.monotonic()
    ok, dt = wait_for(near_reprotected, 20, period=0.2)
    if t.check(ok, "near side: every rep shard with a copy on n1/n2 has 2 VALID copies there (steps 1, 2)",
               str({s: c.copies("rep", s) for s in (1, 2)})):
        t.time("recovery: DEAD -> near-side re-protection of rep steps 1, 2", dt)
    vs = {job: c.versions(job) for job in ("rep", "ec")}
    log("versions during the cut: " + "; ".join(
        f"{job} {s}: {v['state']}" for job in vs for s, v in sorted(vs[job].items())))
    for job in ("rep", "ec"):
        for step in (1, 2):
            st = vs[job].get(step, {}).get("state")
            t.check(st in ("protected", "degraded", "staged"),
                    f"{job} step {step} not lost during the cut (shards far-only wait the grace): {st}")
        st = vs[job].get(3, {}).get("state")
        t.check(st in (None, "open"), f"{job} step 3 waits for the far ranks (OPEN or not begun, not lost): {st}")
    # near side keeps working: a job placed on n1, n2 only
    if save("near", 3):
        wait_protected("near", 3, timeout=20)
    # memory: near tiers hold no more than rep/ec/near copies for steps 1..3
    for n in sorted(near_nodes):
        h = c.holdings(n) or []
        held = sum(x["size_bytes"] for x in h)
        t.check(held < 64 << 20, f"near side: {n}'s memory tier within its 64 MiB ({held / 2**20:.1f} MiB, "
                                 f"{len(h)} items)")
    left = CUT_SECONDS - (time.monotonic() - t_dead)
    if left > 0:
        time.sleep(left)  # the cut lasts: a bounded wait on real daemons

    # 3. heal
    net.heal()
    t_heal = watch.mark()
    log(f"healed after {t_heal - t_cut:.1f} s")
    alive = {n: watch.wait(n, "alive", 30) for n in FAR}
    if t.check(all(v is not None for v in alive.values()), "n3, n4, n5 rejoin (ALIVE)", str(c.node_states())):
        t.time("recovery: heal -> far nodes ALIVE (last)", max(alive.values()))
    watch.stop()
    for job in ("rep", "ec"):
        if saved3[job]:
            wait_protected(job, 3, timeout=30)

    def converged():
        for job in JOBS:
            vs = c.versions(job)
            for step in (1, 2, 3):
                if vs.get(step, {}).get("state") != "protected":
                    converged.last = f"{job} {step}: {vs.get(step, {}).get('state')}"
                    return False
        return True

    converged.last = ""
    ok, dt = wait_for(converged, 30, period=0.2)
    if t.check(ok, "every version of every job (steps 1..3) PROTECTED after the heal", converged.last):
        t.time("convergence: heal -> every version PROTECTED", time.monotonic() - t_heal)
    for job in JOBS:
        for step in acked[job]:
            for r in ranks[job]:
                restore(r, job, step, "healed")
    # across the former cut: rank 2 (far data) read on n1, rank 0 (near data) read on n4
    for job in ("rep", "ec"):
        prot = JOBS[job][0]
        for rank, node in ((2, "n1"), (0, "n4")):
            x = c.rank(job, rank, WORLD, node, prot, seed, rpc_timeout=10.0)
            for step in acked[job]:
                restore(x, job, step, f"healed, from {node}")
            x.close()
    surplus = []
    for step in acked["rep"]:
        for rank, holders in (c.copies("rep", step) or {}).items():
            valid = sorted(n for n, (_, s) in holders.items() if s == "valid")
            if len(valid) > 2:
                surplus.append((step, rank, valid))
    t.count("rep shards with more than 2 VALID copies after the heal (held until retention)", len(surplus))

    # 4. retention
    for step in (4, 5, 6):
        for job in JOBS:
            if save(job, step):
                wait_protected(job, step)

    def clean():
        want = {}
        for job, (_, _, world) in JOBS.items():
            for step in (4, 5, 6):
                cp = c.copies(job, step) or {}
                for rank, holders in cp.items():
                    for n, (_, s) in holders.items():
                        if s == "valid":
                            want.setdefault(n, set()).add((job, step, f"rank {rank}"))
        counts = {}
        for i in range(1, WORLD + 1):
            n = f"n{i}"
            h = c.holdings(n)
            if h is None:
                clean.last = f"{n}: no answer"
                return False
            got = {(x["job"], x["step"], x["what"]) for x in h}
            old = sorted(g for g in got if g[1] not in (4, 5, 6))
            if old:
                clean.last = f"{n} still holds {old[:6]}"
                return False
            shards = {g for g in got if g[2].startswith("rank ")}
            if shards != want.get(n, set()):
                clean.last = f"{n} holds {sorted(shards)}, meta lists {sorted(want.get(n, set()))}"
                return False
            for g in got:
                counts[g] = counts.get(g, 0) + 1
        for (job, step, what), k in counts.items():
            expect = 2 if job in ("rep", "near") else 1
            if k != expect:
                clean.last = f"{job} {step} {what}: {k} copies (want {expect})"
                return False
        return True

    clean.last = ""
    ok, dt = wait_for(clean, 30, period=0.5)
    if t.check(ok, "after retention every memory tier holds exactly steps 4..6 (2 copies a rep shard, "
                   "1 an EC segment or primary)", clean.last):
        t.time("retention: step 6 PROTECTED -> memory tiers clean", dt)
    for job in JOBS:
        for r in ranks[job]:
            restore(r, job, 6, "after retention")
    t.time("whole test", time.monotonic() - t_start)
    return t.finish(c)


if __name__ == "__main__":
    netns.main_guard(body)
