#!/usr/bin/python3
"""The checker of a Jepsen-style history (tests/chaos/netns_soak.py writes one; issue 36).

A history is a JSON-lines file, one record an event, in the order they were written:

  {"type": "setup", "jobs": {JOB: {"tolerance": T, "keep": K, "world": W}}}
      T: how many holders of a version may be lost at once (copies-1 for replicate, m for EC)
  {"type": "op", "process": P, "op": OP, "args": {...}, "t_call": S, "t_ans": S, "ok": bool,
   "answer": {...}}
      OP one of save (args job, step, rank, sha256: what is saved), wait (args job, step,
      level), load (args job, step, rank; answer sha256 of the payload read), latest (args
      job, level; answer step or null); t_call/t_ans: seconds (one monotonic clock)
  {"type": "fault", "phase": "start" | "end", "id": N, "kind": KIND, "nodes": [...],
   "lost": bool, "t": S}
      lost: the fault destroys the nodes' memory tiers (kill -9 and the tier wiped). A lost
      node stays lost until the next successful heal (re-protection done).
  {"type": "heal", "ok": bool, "t": S}
      ok: every node ALIVE and every acknowledged version re-protected

Invariants (each violation is reported with the records that show it):

  bytes      every successful load returns the bytes saved for (job, step, rank)
             (the sha256 of a successful save of it);
  durable    every acknowledged version (a successful wait at level protected) is restorable:
             a load of it fails only if more than T holders may have been lost at once since
             it was acknowledged (counted as the nodes lost at once, an upper bound of its
             holders lost), or a fault is active at the load's call (then it is not required),
             or K newer saves of the job had been begun before the load (retention may have
             evicted it);
  staged     no version is restorable that was never acknowledged as STAGED (a successful
             wait at level staged, protected or persisted of it, anywhere in the history);
  monotonic  latest() never goes back: for each job and level, a latest() called after another
             one answered returns a step at least as new (null counts as older than any step).

  /usr/bin/python3 tests/chaos/history_check.py HISTORY.jsonl   # exit 1 on a violation
"""
import json
import sys

LEVELS_STAGED = ("staged", "protected", "persisted")


def load_history(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def check(records):
    """Returns (violations, stats): violations a list of strings, stats a dict of counts."""
    jobs = {}
    for r in records:
        if r.get("type") == "setup":
            jobs.update(r["jobs"])
    ops = [r for r in records if r.get("type") == "op"]
    v = []
    stats = {"ops": len(ops), "loads_checked_bytes": 0, "loads_ok_of_acked_no_fault": 0, "loads_failed_excused": 0,
             "loads_failed_required": 0,
             "acked_protected": 0, "acked_staged": 0, "latest_pairs": 0, "faults": {}}

    # Faults and heals as a timeline: at time t, which faults are active, and the most nodes
    # lost at once since time t0.
    timeline = sorted((r for r in records if r.get("type") in ("fault", "heal")),
                      key=lambda r: r["t"])
    for r in timeline:
        if r["type"] == "fault" and r["phase"] == "start":
            stats["faults"][r["kind"]] = stats["faults"].get(r["kind"], 0) + 1

    def active_at(t):
        act = {}
        for r in timeline:
            if r["t"] > t:
                break
            if r["type"] == "fault":
                if r["phase"] == "start":
                    act[r["id"]] = r
                else:
                    act.pop(r["id"], None)
        return act

    def max_lost_between(t0, t1):
        lost, worst = set(), 0
        for r in timeline:
            if r["t"] > t1:
                break
            if r["type"] == "heal" and r["ok"]:
                lost = set()
            elif r["type"] == "fault" and r["phase"] == "start" and r.get("lost"):
                lost |= set(r["nodes"])
            if r["t"] >= t0:
                worst = max(worst, len(lost))
        return max(worst, len(lost))

    # What was saved, acknowledged, begun.
    saved_sha = {}
    for o in ops:
        if o["op"] == "save" and "sha256" in o["args"]:
            a = o["args"]
            saved_sha.setdefault((a["job"], a["step"], a["rank"]), set()).add(a["sha256"])
    acked_p, acked_s = {}, set()
    for o in ops:
        if o["op"] == "wait" and o["ok"]:
            key = (o["args"]["job"], o["args"]["step"])
            lvl = o["args"].get("level", "protected")
            if lvl in LEVELS_STAGED:
                acked_s.add(key)
            if lvl in ("protected", "persisted"):
                acked_p[key] = min(acked_p.get(key, o["t_ans"]), o["t_ans"])
    stats["acked_protected"], stats["acked_staged"] = len(acked_p), len(acked_s)
    begun = {}  # job -> sorted [(t_call, step)] of saves begun
    for o in ops:
        if o["op"] == "save":
            begun.setdefault(o["args"]["job"], []).append((o["t_call"], o["args"]["step"]))

    for o in ops:
        if o["op"] != "load":
            continue
        a = o["args"]
        job, step, rank = a["job"], a["step"], a["rank"]
        where = f"load {job}/{step} rank {rank} by {o.get('process')} at {o['t_call']:.3f}"
        if o["ok"]:
            stats["loads_checked_bytes"] += 1
            want = saved_sha.get((job, step, rank))
            got = o["answer"].get("sha256")
            if not want:
                v.append(f"staged: {where} returned data of a rank never saved")
            elif got not in want:
                v.append(f"bytes: {where} returned sha256 {got}, saved {sorted(want)}")
            if (job, step) not in acked_s and (job, step) not in acked_p:
                v.append(f"staged: {where} succeeded but the version was never acknowledged as STAGED")
            continue
        if (job, step) not in acked_p or acked_p[(job, step)] > o["t_call"]:
            stats["loads_failed_excused"] += 1
            continue
        spec = jobs.get(job, {"tolerance": 0, "keep": 1})
        newer = {s for t, s in begun.get(job, []) if t < o["t_call"] and s > step}
        act = active_at(o["t_call"])
        lost = max_lost_between(acked_p[(job, step)], o["t_call"])
        if act or len(newer) >= spec["keep"] or lost > spec["tolerance"]:
            stats["loads_failed_excused"] += 1
            continue
        stats["loads_failed_required"] += 1
        v.append(f"durable: {where} failed ({o['answer'].get('error')}) though {job}/{step} was acknowledged "
                 f"PROTECTED at {acked_p[(job, step)]:.3f}, no fault active, {lost} node(s) lost at once since "
                 f"(tolerance {spec['tolerance']}), {len(newer)} newer save(s) begun (keep {spec['keep']})")
    # The loads of acknowledged versions that succeeded with no fault active (for the stats).
    for o in ops:
        if o["op"] == "load" and o["ok"]:
            a = o["args"]
            key = (a["job"], a["step"])
            if key in acked_p and acked_p[key] <= o["t_call"] and not active_at(o["t_call"]):
                stats["loads_ok_of_acked_no_fault"] += 1

    # latest() never goes back (per job and level): every latest() called after another one
    # answered returns at least its step.
    by = {}
    for o in ops:
        if o["op"] == "latest" and o["ok"]:
            by.setdefault((o["args"]["job"], o["args"].get("level", "protected")), []).append(o)
    for (job, lvl), ls in by.items():
        done = sorted(ls, key=lambda o: o["t_ans"])
        i, best = 0, None  # best: the answered latest() with the newest step so far
        for b in sorted(ls, key=lambda o: o["t_call"]):
            while i < len(done) and done[i]["t_ans"] < b["t_call"]:
                s = done[i]["answer"].get("step")
                if s is not None and (best is None or s > best["answer"]["step"]):
                    best = done[i]
                i += 1
            if best is None:
                continue
            stats["latest_pairs"] += 1
            sa, sb = best["answer"]["step"], b["answer"].get("step")
            if sb is None or sb < sa:
                v.append(f"monotonic: latest({job}, {lvl}) by {b.get('process')} called at {b['t_call']:.3f} "
                         f"returned {sb}, after one by {best.get('process')} answered {sa} at {best['t_ans']:.3f}")
    return v, stats


def main():
    if len(sys.argv) != 2:
        print(f"usage: {sys.argv[0]} HISTORY.jsonl", file=sys.stderr)
        return 2
    v, stats = check(load_history(sys.argv[1]))
    print(json.dumps(stats))
    for x in v:
        print("VIOLATION " + x)
    print(f"{len(v)} violation(s)")
    return 1 if v else 0


if __name__ == "__main__":
    sys.exit(main())
