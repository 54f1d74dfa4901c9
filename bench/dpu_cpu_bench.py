#!/usr/bin/python3
"""dpu_cpu_bench.py: host CPU to save and protect S bytes, push mode (ckpt-agent)
against pull mode (ckpt-dpu-agent), in the same run (issue 14).

Each mode starts a real ckpt-meta and two agents from $CKPT_BUILD_DIR (default
./build): two ckpt-agents (push: the trainer writes into the agent's memory
tier, the agent checks crcs and sends the replica, the other host's agent
receives it), or two ckpt-dpu-agents (pull: the trainer writes into its own
UCX-registered staging memory, the DPU agent reads it with one-sided gets,
checks crcs and protects from DPU to DPU). The job replicates to the second
node (replicate:2). One rank saves a state of --mib MiB (4 items, sizes around
4 MiB boundaries) --versions times, each waited to PROTECTED, after a warm-up
save. Measured per version:

  client copy      the client's CPU time (getrusage, all its threads) during
                   the blocking save call: its copy into staging / the pool
  client other     the client's CPU from the return of save() to PROTECTED
                   (commit, waiting; the staging progress thread in pull mode)
  host agents      CPU of the ckpt-agent processes (/proc/PID/stat), both
                   nodes: host CPU in push mode
  DPU agents       CPU of the ckpt-dpu-agent processes: on a BlueField this
                   is the DPU's Arm cores, not the host's

Host CPU beyond the client's own copy = client other + host agents. The goal is
pull <= 5% of push. Each version is then restored (c.load): zero-copy views of
the agent's pool in push mode, the DPU agent writing the shard into the client's
staging memory with one-sided puts in pull mode; wall time and CPU reported. Also: the pull's bandwidth (ckpt_agent_pulled_bytes_total /
ckpt_agent_pull_seconds_total) next to `ucx_perftest -t ucp_get` of the same
size on this machine, and memcpy of the state, all in this run. Every version is
loaded back and compared.

  PYTHONPATH=build/python CKPT_BUILD_DIR=build /usr/bin/python3 bench/dpu_cpu_bench.py \\
      [--mib 512] [--versions 3]
"""
import argparse
import os
import resource
import sys
import time

import numpy as np

from bench_daemons import running, ucx_perftest_mbps  # bench/ (this script's directory)

TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid):
    """utime + stime of a process in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def self_cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def make_state(mib, seed):
    rng = np.random.default_rng(seed)
    total = mib << 20
    sizes = [(4 << 20) + 1, (4 << 20) - 1, total // 2]
    sizes.append(max(1, total - sum(sizes)))
    return {f"t{i}": rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(sizes)}


def run_mode(binary, mib, versions):
    memory = f"{3 * mib + 256}MiB"
    rows = []
    with running(memory, f"dpu-{binary}", agents=2, binary=binary) as d:
        c = d.client(f"cpu-{binary}", protection="replicate:2")
        pids = [p.pid for p in d.agents]
        state = make_state(mib, 0)
        c.save(1, state).wait("protected", timeout=300)  # warm-up: staging memory, pages, connections
        pulled0 = d.metric("ckpt_agent_pulled_bytes_total")
        pull_s0 = d.metric("ckpt_agent_pull_seconds_total")
        for v in range(versions):
            step = 2 + v
            state = make_state(mib, step)
            a0 = [proc_cpu(p) for p in pids]
            c0 = self_cpu()
            t0 = time.perf_counter()
            h = c.save(step, state)
            blocked = time.perf_counter() - t0
            c1 = self_cpu()
            h.wait("protected", timeout=300)
            c2 = self_cpu()
            a1 = [proc_cpu(p) for p in pids]
            # The restore: zero-copy views of the agent's pool (push), or the
            # DPU agent writing the shard into the client's staging (pull).
            l0 = self_cpu()
            la0 = [proc_cpu(p) for p in pids]
            t1 = time.perf_counter()
            loaded = c.load(step)
            load_s = time.perf_counter() - t1
            l1 = self_cpu()
            la1 = [proc_cpu(p) for p in pids]
            rows.append({"copy": c1 - c0, "other": c2 - c1, "agents": sum(a1) - sum(a0), "blocked": blocked,
                         "load": load_s, "load_client": l1 - l0, "load_agents": sum(la1) - sum(la0)})
            for k, want in state.items():
                got = np.asarray(loaded[k])
                if got.shape != want.shape or not np.array_equal(got, want):
                    sys.exit(f"{binary}: version {step} item {k} came back different")
            del loaded
        pulled = d.metric("ckpt_agent_pulled_bytes_total") - pulled0
        pull_s = d.metric("ckpt_agent_pull_seconds_total") - pull_s0
        del c
    return rows, (pulled / pull_s if pull_s > 0 else 0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--versions", type=int, default=3)
    args = ap.parse_args()
    state = make_state(args.mib, 0)
    nbytes = sum(a.nbytes for a in state.values())
    dst = np.zeros(nbytes, dtype=np.uint8)  # touched: the timed copy takes no page faults
    memcpy = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        off = 0
        for a in state.values():
            dst[off:off + a.nbytes] = a
            off += a.nbytes
        memcpy = min(memcpy, time.perf_counter() - t0)
    del dst, state
    results = {}
    for mode, binary in (("push", "ckpt-agent"), ("pull", "ckpt-dpu-agent")):
        results[mode] = run_mode(binary, args.mib, args.versions)
    perf = ucx_perftest_mbps("ucp_get", min(nbytes, 256 << 20))

    def med(rows, key):
        return float(np.median([r[key] for r in rows]))

    print(f"state {nbytes / 2**20:.1f} MiB in 4 items, {args.versions} versions per mode, medians; "
          f"memcpy of the state {memcpy * 1e3:.1f} ms")
    print(f"{'mode':6} {'blocked ms':>10} {'client copy':>12} {'client other':>13} {'host agents':>12} "
          f"{'DPU agents':>11} {'host CPU beyond copy':>21}")
    beyond = {}
    for mode in ("push", "pull"):
        rows = results[mode][0]
        host_agents = med(rows, "agents") if mode == "push" else 0.0
        dpu_agents = med(rows, "agents") if mode == "pull" else 0.0
        beyond[mode] = med(rows, "other") + host_agents
        print(f"{mode:6} {med(rows, 'blocked') * 1e3:10.1f} {med(rows, 'copy') * 1e3:9.1f} ms "
              f"{med(rows, 'other') * 1e3:10.1f} ms {host_agents * 1e3:9.1f} ms {dpu_agents * 1e3:8.1f} ms "
              f"{beyond[mode] * 1e3:18.1f} ms")
    print(f"{'load':6} {'wall ms':>10} {'client CPU':>12} {'agents CPU':>13}   (restore of the same version)")
    for mode in ("push", "pull"):
        rows = results[mode][0]
        print(f"{mode:6} {med(rows, 'load') * 1e3:10.1f} {med(rows, 'load_client') * 1e3:9.1f} ms "
              f"{med(rows, 'load_agents') * 1e3:10.1f} ms")
    ratio = beyond["pull"] / beyond["push"] if beyond["push"] > 0 else float("nan")
    print(f"pull / push host CPU beyond the client's copy: {ratio * 100:.1f}% (goal <= 5%)")
    pull_bw = results["pull"][1] / 1e6
    print(f"pull bandwidth {pull_bw:.0f} MB/s; ucx_perftest ucp_get "
          f"{'n/a' if perf is None else f'{perf:.0f} MB/s'} (same machine, same run)")


if __name__ == "__main__":
    main()
