#!/usr/bin/python3
"""dedup_bench.py: what storing data-parallel replicas once saves (issue 38).

A dp=4 job (4 ranks, one per node; tensor parallelism 1) whose every rank holds the same
model and AdamW state (--mib of parameters: about 3x that with the optimizer), saved with
ckpt.torch.save_sharded twice, without and with dedup. Starts a real ckpt-meta and four
ckpt-agents from $CKPT_BUILD_DIR (default ./build); replicate:2, flushed every version.
Reports per version, from the agents' metrics: bytes copied into the memory tiers
(ckpt_agent_staged_bytes_total), sent to peers (ckpt_agent_peer_sent_bytes_total) and
flushed (ckpt_agent_flush_bytes_total), and each rank's save blocking time (the call,
median of --versions); then every rank restores the last version with
ckpt.torch.load_sharded and is compared with the state saved, bit for bit.

  PYTHONPATH=build/python CKPT_BUILD_DIR=build /usr/bin/python3 bench/dedup_bench.py [--mib 64]
"""
import argparse
import time

import torch

import ckpt
import ckpt.torch as ct
from bench_daemons import running  # bench/ (this script's directory)

DP = 4


def build(mib, seed=1):
    torch.manual_seed(seed)
    d = 512
    layers = max(1, (mib << 20) // 4 // (d * d))
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model, opt, step):
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randn(8, 512, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def run(d, job, dedup, a):
    clients = [ckpt.Client(job=job, rank=r, world_size=DP, meta=d.meta, agent_socket=str(d.sockets[r]),
                           protection="replicate:2", flush_every=1) for r in range(DP)]
    ranks = [build(a.mib) for _ in range(DP)]  # identical replicas, as data parallelism keeps them
    layouts = [ct.Layout(dp=(r, DP)) for r in range(DP)]
    m0 = {k: d.metric(k) for k in ("ckpt_agent_staged_bytes_total", "ckpt_agent_peer_sent_bytes_total")}
    flushed0 = d.metric("ckpt_agent_flush_bytes_total")
    blocked = [[] for _ in range(DP)]
    for v in range(1, a.versions + 1):
        for m, opt in ranks:
            train(m, opt, v)
        handles = []
        for r, (c, (m, opt), lay) in enumerate(zip(clients, ranks, layouts)):
            t = time.perf_counter()
            handles.append(ct.save_sharded(c, v, m, opt, lay, dedup=dedup))
            blocked[r].append(time.perf_counter() - t)
        for h in handles:
            h.wait("persisted", timeout=600)
    out = {k: (d.metric(k) - m0[k]) / a.versions for k in m0}
    out["flushed"] = (d.metric("ckpt_agent_flush_bytes_total") - flushed0) / a.versions
    out["blocked"] = [sorted(b)[len(b) // 2] for b in blocked]
    # Every rank restores the last version into a fresh model, equal to what it saved.
    for r, (c, lay) in enumerate(zip(clients, layouts)):
        m, opt = build(a.mib, seed=99)
        train(m, opt, 0)  # an optimizer with state of its own, to be replaced
        ct.load_sharded(c, a.versions, m, opt, lay)
        want_m, want_o = ranks[r]
        for (k, x), y in zip(want_m.state_dict().items(), m.state_dict().values()):
            if not torch.equal(x, y):
                raise SystemExit(f"dedup_bench.py: rank {r} {k} differs after the restore")
        for i, st in want_o.state_dict()["state"].items():
            for k, x in st.items():
                if not torch.equal(x, opt.state_dict()["state"][i][k]):
                    raise SystemExit(f"dedup_bench.py: rank {r} optimizer state {i}/{k} differs")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="parameter bytes (MiB)")
    ap.add_argument("--versions", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    tier = f"{a.mib * 3 * 2 * 3 + 256}MiB"
    mib = float(1 << 20)
    with running(tier, "dedup", agents=DP, durable=True) as d:
        rows = {dedup: run(d, f"dedup-{int(dedup)}", dedup, a) for dedup in (False, True)}
    print(f"dedup_bench.py: dp={DP}, {a.mib} MiB of parameters + AdamW state per rank, replicate:2, "
          f"flush_every=1, {a.versions} versions; every rank restored bit for bit\n")
    print(f"{'dedup':<6} {'copied MiB/v':>13} {'sent MiB/v':>11} {'flushed MiB/v':>14} "
          f"{'save blocking ms per rank (median)':>36}")
    for dedup, r in rows.items():
        blocking = " ".join(f"{b * 1e3:.0f}" for b in r["blocked"])
        print(f"{str(dedup):<6} {r['ckpt_agent_staged_bytes_total'] / mib:>13.1f} "
              f"{r['ckpt_agent_peer_sent_bytes_total'] / mib:>11.1f} {r['flushed'] / mib:>14.1f} {blocking:>36}")
    off, on = rows[False], rows[True]
    print(f"\nwith dedup: copied {on['ckpt_agent_staged_bytes_total'] / off['ckpt_agent_staged_bytes_total']:.2f}x, "
          f"sent {on['ckpt_agent_peer_sent_bytes_total'] / off['ckpt_agent_peer_sent_bytes_total']:.2f}x, "
          f"flushed {on['flushed'] / off['flushed']:.2f}x of without")


if __name__ == "__main__":
    main()
