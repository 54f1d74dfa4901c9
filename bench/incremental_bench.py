#!/usr/bin/python3
"""incremental_bench.py: what a version costs when most of the state never changes
(fine-tuning), full saves against incremental ones (issue 15).

A torch model whose parameters are 95% frozen (an embedding table with
requires_grad False) plus trainable layers with Adam, trained between saves.
Starts a real ckpt-meta and two ckpt-agents (memory tiers on /dev/shm, one
durable root) from $CKPT_BUILD_DIR (default ./build); the job replicates to the
second node (replicate:2) and flushes every version (flush_every=1). Saves
--versions versions with ckpt.torch.save in each mode:

  full          every item copied (ckpt.torch.save(...))
  incremental   ckpt.torch.save(..., incremental=True): frozen parameters declared
                unchanged, everything else hashed; full_save_every as given

and reports per version (over the versions after the first, which is full in
both modes; the median is a typical incremental version, the mean includes the
full saves full_save_every forces): bytes copied into the memory tier (the shard's size), bytes sent
to peers (ckpt_agent_peer_sent_bytes_total), bytes flushed
(ckpt_agent_flush_bytes_total, counted once the versions are PERSISTED or passed
on), the median blocking time of the save call, and memcpy of the whole state
on this machine in the same run for scale. Every version of both modes is
loaded back and compared with the state saved.

  PYTHONPATH=build/python CKPT_BUILD_DIR=build /usr/bin/python3 bench/incremental_bench.py \\
      [--mib 256] [--versions 10] [--full-save-every 10]
"""
import argparse
import sys
import time

import numpy as np
import torch

import ckpt
import ckpt.torch as ct
from bench_daemons import memcpy_seconds, running  # bench/ (this script's directory)


def build(mib, seed):
    """(model, optimizer): 95% of the parameter bytes in a frozen embedding."""
    torch.manual_seed(seed)
    d = 256
    total = (mib << 20) // 4
    vocab = int(total * 0.95) // d
    hidden = int(total * 0.05) // (2 * d)  # two d x hidden layers: 5% of the bytes
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, d), torch.nn.Linear(d, hidden),
                                torch.nn.Linear(hidden, d))
    model[0].weight.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, opt


def train(model, opt, step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, model[0].num_embeddings, (64,), generator=g)
    loss = model(ids).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def snapshot(model, opt):
    return {k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()["state"]


def run_mode(d, mode, a, job):
    model, opt = build(a.mib, 1)
    c = d.client(job, protection="replicate:2", flush_every=1, keep_in_memory=2,
                 full_save_every=a.full_save_every)
    sent0, flushed0 = d.metric("ckpt_agent_peer_sent_bytes_total"), d.metric("ckpt_agent_flush_bytes_total")
    rows, want = [], {}
    for v in range(1, a.versions + 1):
        train(model, opt, v)
        sent = d.metric("ckpt_agent_peer_sent_bytes_total")
        t = time.perf_counter()
        h = ct.save(c, v, model=model, optimizer=opt, incremental=(mode == "incremental"))
        blocked = time.perf_counter() - t
        h.wait("protected", timeout=600)
        want[v] = {k: x.clone() for k, x in model.state_dict().items()}
        rows.append({"copied": h.size_bytes, "blocked": blocked,
                     "sent": d.metric("ckpt_agent_peer_sent_bytes_total") - sent})
    # Flushes run in the background: wait until nothing is waiting to be flushed.
    deadline = time.monotonic() + 600
    quiet = 0
    while time.monotonic() < deadline and quiet < 10:
        quiet = quiet + 1 if d.metric("ckpt_agent_flush_lag_bytes") == 0 else 0
        time.sleep(0.1)
    flushed_total = d.metric("ckpt_agent_flush_bytes_total") - flushed0
    sent_total = d.metric("ckpt_agent_peer_sent_bytes_total") - sent0
    # Every version still in memory loads back equal to what was saved.
    checked = 0
    for v in range(1, a.versions + 1):
        try:
            back = c.load(v)
        except (ckpt.NotFoundError, ckpt.FailedPreconditionError):
            continue  # evicted by retention
        for k, t in want[v].items():
            got = torch.from_numpy(np.asarray(back["model"][k])) if not torch.is_tensor(back["model"][k]) \
                else back["model"][k]
            if not torch.equal(got, t):
                raise SystemExit(f"incremental_bench.py: {mode} version {v} item {k} differs")
        checked += 1
    state_bytes = rows[0]["copied"]
    return rows, flushed_total, sent_total, checked, state_bytes, c.item_steps(a.versions)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="model parameter bytes (MiB)")
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--full-save-every", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(1)
    tier = f"{(a.mib * 6 + 512)}MiB"
    with running(tier, "incremental", agents=2, durable=True) as d:
        results = {mode: run_mode(d, mode, a, f"inc-bench-{mode}") for mode in ("full", "incremental")}
    state = results["full"][4]
    copy_s = memcpy_seconds(state)
    print(f"incremental_bench.py: {a.mib} MiB of parameters (95% frozen) + Adam state: {state / (1 << 20):.1f} MiB "
          f"per full version; {a.versions} versions, replicate:2, flush_every=1, full_save_every="
          f"{a.full_save_every}; memcpy of the state {copy_s * 1e3:.1f} ms\n")
    print(f"{'mode':<12} {'copied MiB/v median':>20} {'mean':>7} {'sent MiB/v':>11} {'flushed MiB/v':>14} "
          f"{'blocking ms':>12} {'blocking/memcpy':>16} {'loaded ok':>10}")
    mib = float(1 << 20)
    for mode, (rows, flushed, sent, checked, _, steps) in results.items():
        later = rows[1:] or rows
        blocking = sorted(r["blocked"] for r in later)[len(later) // 2]
        copied = sorted(r["copied"] for r in later)
        print(f"{mode:<12} {copied[len(copied) // 2] / mib:>20.2f} {sum(copied) / len(copied) / mib:>7.2f} "
              f"{sum(r['sent'] for r in later) / len(later) / mib:>11.2f} {flushed / len(rows) / mib:>14.2f} "
              f"{blocking * 1e3:>12.1f} {blocking / copy_s:>16.2f} {checked:>10}")
    print("\nitem steps of the last incremental version:",
          {k: v for k, v in sorted(results["incremental"][5].items()) if k.startswith("model/")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
