#!/usr/bin/python3
"""Three ckpt-meta replicas on a three-member etcd, each pair on a host of its own, and the
faults a control plane meets on real networks (issues 37 and 36; tests/netns/netns.py).

Hosts m1..m3 each run an etcd member and a ckpt-meta replica (--replica-of, mutual TLS to etcd
with a CA of etcd's own, and between etcd's members); agents n1..n3 and their trainers know the
three meta addresses; ckptctl runs on a host "admin". A replicated job (replicate:2:ring, 3 ranks,
rank r on n(r+1)).

  1. steps 1 and 2 saved and PROTECTED;
  2. the leader's host is cut from the other two replica hosts, both ways (its etcd member is
     in the minority; it still reaches the agents, and they it): the old leader loses its lease
     and exits with status 1 (as it must: it can no longer append), a replica on the majority
     side leads (measured from the cut), step 3, saved right after the cut, becomes PROTECTED
     (measured);
  3. heal, the old leader started again (as systemd's Restart=on-failure would): it follows and
     catches up with the leader's log index (measured);
  4. one follower's etcd member killed (kill -9): the quorum holds, step 4 becomes PROTECTED and
     the leader stays; the member restarted;
  5. quorum lost (two etcd members killed): whoever led steps down (exit 1) within its lease,
     nobody leads; trainers still save step 5 into their agents and restore step 4 from their
     local copies, and a call that needs meta fails cleanly; the members restarted (and the
     replicas that exited): a leader again (measured from the restart), step 5 PROTECTED;
  6. steps 1..5 restore byte-identical on every rank.

Checks that no acknowledged (PROTECTED) version is lost or returned wrong. Prints the times
(`time ...` lines and a JSON line at the end).

Needs root (network namespaces), iproute2, nftables, /usr/bin/etcd, the daemons, ckptctl and
the Python module; exits 77 (skipped) otherwise.
Run: CKPT_BUILD_DIR=build /usr/bin/python3 tests/netns/netns_meta_replica_test.py
"""
import os
import pathlib
import signal
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import netns  # noqa: E402
from netns import Checks, log, wait_for  # noqa: E402

WORLD = 3
JOB = "metarep"
COPIES = 2
LEASE_MS = 5000  # --replica-lease-ms (its default): how long a leader cut from etcd's quorum lasts
SIZE = (1 << 20) + 4097


def size(step, rank):
    return SIZE + 4096 * rank + step


def body():
    if not os.access("/usr/bin/etcd", os.X_OK):
        raise netns.Unavailable("/usr/bin/etcd is not installed (Debian package etcd-server)")
    t = Checks("netns_meta_replica_test")
    net = netns.Net("metarep")
    c = netns.Cluster(net, WORLD, label="metarep", meta_replicas=3)
    seed = 5
    c.create_job(JOB, WORLD, ["--replicate", COPIES, "--placement", "ring"], keep=6)
    ranks = [c.rank(JOB, r, WORLD, f"n{r + 1}", f"replicate:{COPIES}:ring", seed, rpc_timeout=3.0)
             for r in range(WORLD)]
    d = netns.JobDriver(t, ranks, seed, JOB, size)
    acked, save_all, restore_all = d.acked, d.save_all, d.restore_all

    def wait_protected(step):
        return d.wait_protected(step, timeout=60, unknown_for=30)

    def exited(name, timeout):
        """Waits for the meta on `name` to exit: (exit status or None, seconds)."""
        p = c.meta_procs[name]
        ok, dt = wait_for(lambda: p.poll() is not None, timeout, period=0.1)
        return (p.returncode if ok else None), dt

    def caught_up(name):
        reps = c.replicas()
        lead = [idx for (is_leader, idx) in reps.values() if is_leader]
        return bool(lead) and name in reps and not reps[name][0] and reps[name][1] >= lead[0]

    # 1. two versions under the first leader
    first = c.leader()
    log(f"replicas: {c.replicas()}; leader {first}")
    t.check(first is not None, "a replica leads", str(c.replicas()))
    for step in (1, 2):
        save_all(step)
        wait_protected(step)

    # 2. the leader's host cut from the other replica hosts (etcd minority)
    others = [h.name for h in c.meta_hosts if h.name != first]
    net.partition([first], others)
    t_cut = time.monotonic()
    log(f"cut {first} (leader) from {others}, both ways; it still reaches the agents")
    t.check(net.reachable(first, "n1", 7401) and not net.reachable(first, others[0], 2379),
            f"{first} reaches n1 but not {others[0]}'s etcd member")
    save_all(3)
    status, dt_exit = exited(first, 30)
    t.check(status == 1, f"the cut-off leader {first} exits with status 1 (lost its lease)", f"status {status}")
    if status is not None:
        t.time(f"cut -> the old leader {first} exits (replica lease {LEASE_MS} ms)", dt_exit)
    new = c.wait_leader(30, other_than=first)
    t.check(new in others, f"a replica on the majority side leads ({new})", str(c.replicas()))
    t.time("cut -> another replica leads", time.monotonic() - t_cut)
    if wait_protected(3) is not None:
        t.time("cut -> step 3 (saved after the cut) PROTECTED", time.monotonic() - t_cut)
    log_text = (c.work / f"meta-{first}.log").read_text(errors="replace")
    t.check("lost the leadership" in log_text, f"{first}'s log says it lost the leadership")

    # 3. heal; the old leader comes back as a follower and catches up
    net.heal()
    c.start_replica(first)
    ok, dt = wait_for(lambda: caught_up(first), 60, period=0.2)
    t.check(ok, f"{first} follows again and catches up with the leader's log", str(c.replicas()))
    if ok:
        t.time(f"restart -> {first} caught up", dt)
    t.check(c.leader() == new, f"the leader stays {new}", str(c.replicas()))

    # 4. one follower's etcd member killed: the quorum holds
    leader = c.leader() or new
    victim = next(h.name for h in c.meta_hosts if h.name != leader)
    c.etcd_procs[victim].send_signal(signal.SIGKILL)
    c.etcd_procs[victim].wait(timeout=30)
    log(f"killed etcd member on {victim} (kill -9); {leader} leads")
    save_all(4)
    dt4 = wait_protected(4)
    if dt4 is not None:
        t.time("one etcd member down: step 4 commit -> PROTECTED", dt4)
    t.check(c.leader() == leader and c.meta_procs[victim].poll() is None,
            f"one member down: {leader} still leads, {victim}'s meta still runs", str(c.replicas()))
    c.start_etcd(victim)
    c.wait_listening(c.net.host(victim), 2379, c.etcd_procs[victim], f"etcd {victim}")

    # 5. quorum lost: two members killed
    down = [h.name for h in c.meta_hosts if h.name != victim]
    for n in down:
        c.etcd_procs[n].send_signal(signal.SIGKILL)
    for n in down:
        c.etcd_procs[n].wait(timeout=30)
    t_loss = time.monotonic()
    log(f"killed etcd members on {down}: no quorum")
    status, dt_exit = exited(leader, 30)
    t.check(status == 1, f"without a quorum the leader {leader} steps down (exit 1)", f"status {status}")
    if status is not None:
        t.time("quorum lost -> the leader exits", dt_exit)
    t.check(c.leader() is None, "without a quorum nobody leads", str(c.replicas()))
    save_all(5)
    a = ranks[2].call(op="load", step=4)
    t.check(a["ok"] and a["served_from"] == "local" and
            a["sha256"] == netns.payload_sha(seed, JOB, 4, 2, size(4, 2)),
            f"no quorum: rank 2 restores step 4 from its local copy ({a.get('ms')} ms)", str(a))
    tl = time.monotonic()
    a = ranks[0].call(op="latest", timeout=30)
    t.check(not a["ok"] and time.monotonic() - tl < 15,
            f"no quorum: latest() fails cleanly within the client's deadline: {a.get('error')}", str(a))
    # the members back, and every replica that exited (systemd would restart them)
    t_back = time.monotonic()
    for n in down:
        c.start_etcd(n)
    for name, p in c.meta_procs.items():
        if p.poll() is not None:
            c.start_replica(name)
    back = c.wait_leader(60)
    t.check(back is not None, f"quorum back: a replica leads ({back})", str(c.replicas()))
    t.time("quorum back -> a replica leads", time.monotonic() - t_back)
    t.time("quorum lost for", t_back - t_loss)
    if wait_protected(5) is not None:
        t.time("quorum back -> step 5 (saved without one) PROTECTED", time.monotonic() - t_back)

    # 6. nothing acknowledged lost
    vs = c.versions(JOB)
    for step in acked:
        t.check(vs.get(step, {}).get("state") in ("protected", "persisted"),
                f"acknowledged step {step} is still PROTECTED at meta", str(vs.get(step)))
    restore_all(range(1, 6), "after the faults")
    t.count("acknowledged versions", len(acked))

    for r in ranks:
        r.close()
    return t.finish(c)


if __name__ == "__main__":
    netns.main_guard(body)
