#!/usr/bin/python3
"""A small GPT trained on CPU by N ranks (torch.distributed, gloo) that checkpoints through ckpt.

One process per rank. Every --every steps each rank saves its model, optimizer,
step and RNG states through its node's ckpt-agent (ckpt.Client.save), and waits
until the version is PROTECTED (replicated / erasure-coded across nodes) before
the next save. Training is bit-deterministic (fixed seeds, deterministic
algorithms, one thread, gloo all-reduce of gradients in a fixed order), so a
run that crashes and resumes must produce exactly the losses of a run that
never crashed.

    train_gpt.py --meta 127.0.0.1:7400 --agent-socket /run/ckpt/agent.sock --job gpt \\
        --rank R --world-size 4 --dist-port 29500 --steps 40 --every 5 --log loss-R.jsonl
    ... --crash-at 20    # SIGKILL itself right after the step-20 save is protected
    ... --resume         # restore the newest protected version in place and continue
    ... --lazy           # lazy saves (ckpt.torch.save(..., lazy=True)): the copy overlaps
                         # the next step's forward and backward, the optimizer step waits
                         # for it; no wait for PROTECTED in the loop (only at --crash-at
                         # and at the end)
    ... --d-model 512 --layers 8   # a bigger model (state about 16 x d_model^2 x layers bytes)
    ... --every auto     # save at step 1, then every Young/Daly interval
                         # (Client.recommended_interval from the measured save cost
                         # and step time and meta's MTBF; the ranks agree on the
                         # smallest); each choice is printed ("event": "interval")

stdout: one JSON object per line ("event": "save" | "interval" | "resume" | "done";
"done" has the median time of a training step without its save and of a whole
iteration with it, in ms).
--log: JSON lines {"step": S, "loss": L} (L exact: Python float repr).
Exit status: 0 finished, 2 bad arguments, 1 any other error.
"""
import argparse
import datetime
import hashlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ckpt
import ckpt.torch
from example_common import batch, crash, emit, positive, run  # examples/ (this script's directory)


class Block(nn.Module):
    def __init__(self, d_model, n_heads, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x, mask):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, seq, d_model, n_layers, n_heads, dropout):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(d_model, n_heads, dropout) for _ in range(n_layers)])
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1),
                             persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t)))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))






def every_arg(text):
    return "auto" if text == "auto" else positive("--every")(text)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--meta", required=True, help="ckpt-meta address, e.g. 127.0.0.1:7400")
    p.add_argument("--agent-socket", required=True, help="this node's ckpt-agent unix socket")
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=positive("--world-size"), required=True)
    p.add_argument("--dist-port", type=int, required=True, help="torch.distributed rendezvous port on 127.0.0.1")
    p.add_argument("--steps", type=positive("--steps"), default=40)
    p.add_argument("--every", type=every_arg, default=5,
                   help='save every N steps, or "auto" (the Young/Daly interval, re-chosen after each save)')
    p.add_argument("--crash-at", type=positive("--crash-at"), default=None,
                   help="SIGKILL this process right after the save of this step is protected")
    p.add_argument("--resume", action="store_true", help="restore the newest protected version first")
    p.add_argument("--log", default=None, help="loss curve, JSON lines {step, loss}")
    p.add_argument("--protection", default="replicate:2:ring",
                   help='job protection: "none", "replicate:COPIES[:ring|group]" or "ec:K+M"')
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch", type=positive("--batch"), default=8)
    p.add_argument("--protect-timeout", type=float, default=60.0, help="seconds to wait for 'protected'")
    p.add_argument("--lazy", action="store_true", help="lazy saves: the copy overlaps the next step")
    p.add_argument("--d-model", type=positive("--d-model"), default=64, help="model width (a multiple of 4)")
    p.add_argument("--layers", type=positive("--layers"), default=2)
    a = p.parse_args(argv)
    if not 0 <= a.rank < a.world_size:
        p.error(f"--rank must be in [0, {a.world_size}), got {a.rank}")
    if not 0 < a.dist_port < 65536:
        p.error(f"--dist-port must be a TCP port (1..65535), got {a.dist_port}")
    if a.crash_at is not None and a.every == "auto":
        p.error("--crash-at needs a fixed --every (with auto the saved steps are not known in advance)")
    if a.crash_at is not None and (a.crash_at % a.every != 0 or a.crash_at > a.steps):
        p.error(f"--crash-at {a.crash_at} must be a saved step: a multiple of --every {a.every} "
                f"and at most --steps {a.steps}")
    if a.d_model % 4 != 0:
        p.error(f"--d-model must be a multiple of 4 (4 attention heads), got {a.d_model}")
    if not os.path.exists(a.agent_socket):
        p.error(f"--agent-socket {a.agent_socket}: no such file (is ckpt-agent running?)")
    return a




def state_digest(model, opt):
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    for pid, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{pid}/{k}".encode())
            h.update(v.contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()


def median_ms(times):
    return sorted(times)[len(times) // 2] * 1e3 if times else 0.0


def main(argv):
    a = parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(a.seed)  # same initial weights on every rank
    vocab, seq, d_model = 256, 32, a.d_model
    model = GPT(vocab, seq, d_model, n_layers=a.layers, n_heads=4, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    torch.manual_seed(a.seed + 1000 + a.rank)  # dropout differs per rank
    data_gen = torch.Generator().manual_seed(a.seed + 7 * a.rank)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.dist_port}", rank=a.rank,
                            world_size=a.world_size, timeout=datetime.timedelta(seconds=60))
    t_connect = time.perf_counter()
    client = ckpt.Client(job=a.job, rank=a.rank, world_size=a.world_size, meta=a.meta,
                         agent_socket=a.agent_socket, protection=a.protection)
    connect_ms = round((time.perf_counter() - t_connect) * 1e3, 3)

    step = 0
    if a.resume:
        t_latest = time.perf_counter()
        latest = client.latest("protected")
        latest_ms = round((time.perf_counter() - t_latest) * 1e3, 3)
        mine = -1 if latest is None else latest
        agreed = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # every rank restores the same step
        if agreed.item() < 0:
            emit(event="resume", rank=a.rank, step=None, served_from=None, note="no protected version")
        else:
            step = int(agreed.item())
            t0 = time.perf_counter()
            served_from, state = client.load_with_source(step)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            extra = state["extra"]
            if extra["step"] != step or extra["rank"] != a.rank:
                raise RuntimeError(f"checkpoint of step {step} holds step {extra['step']} rank {extra['rank']}")
            torch.set_rng_state(extra["torch_rng"])
            data_gen.set_state(extra["data_rng"])
            emit(event="resume", rank=a.rank, step=step, served_from=served_from, node=client.node_id,
                 connect_ms=connect_ms, latest_ms=latest_ms, load_ms=round((time.perf_counter() - t0) * 1e3, 3))

    log = open(a.log, "a") if a.log else None
    model.train()
    auto = a.every == "auto"
    next_save = step + 1 if auto else (step // a.every + 1) * a.every
    step_times = []  # seconds per training step (saves excluded)
    iteration_times = []  # seconds per step with its save
    last_lazy = None
    while step < a.steps:
        step += 1
        t_step = time.perf_counter()
        x, y = batch(data_gen, a.batch, seq, vocab)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(a.world_size)
        opt.step()
        lv = loss.item()
        if not math.isfinite(lv):
            raise RuntimeError(f"loss is {lv} at step {step}")
        step_times.append(time.perf_counter() - t_step)
        if log:
            log.write(json.dumps({"step": step, "loss": lv}) + "\n")
            log.flush()
        if step == next_save:
            extra = {"step": step, "rank": a.rank, "torch_rng": torch.get_rng_state(),
                     "data_rng": data_gen.get_state()}
            t0 = time.perf_counter()
            h = ckpt.torch.save(client, step, model=model, optimizer=opt, extra=extra, lazy=a.lazy)
            t1 = time.perf_counter()
            if a.lazy:
                last_lazy = h
                if a.crash_at == step:
                    h.wait("protected", timeout=a.protect_timeout)
                emit(event="save", rank=a.rank, step=step, lazy=True, blocking_ms=round((t1 - t0) * 1e3, 3))
            else:
                h.wait("protected", timeout=a.protect_timeout)
                t2 = time.perf_counter()
                emit(event="save", rank=a.rank, step=step, bytes=h.size_bytes,
                     blocking_ms=round((t1 - t0) * 1e3, 3), protected_ms=round((t2 - t0) * 1e3, 3))
            if auto:
                recent = sorted(step_times[-20:])
                advice = client.recommended_interval(recent[len(recent) // 2])
                agreed = torch.tensor([advice["steps"]], dtype=torch.int64)
                dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # every rank saves the same steps
                next_save = step + int(agreed.item())
                emit(event="interval", rank=a.rank, step=step, steps=int(agreed.item()), mine=advice["steps"],
                     next_save=next_save, why=advice["explanation"])
            else:
                next_save = step + a.every
            if a.crash_at == step:
                crash(a.rank, step, log)
        iteration_times.append(time.perf_counter() - t_step)
    if last_lazy is not None:
        last_lazy.wait("protected", timeout=a.protect_timeout)
    if log:
        log.close()
    emit(event="done", rank=a.rank, step=step, final_sha256=state_digest(model, opt),
         median_step_ms=round(median_ms(step_times), 3), median_iteration_ms=round(median_ms(iteration_times), 3))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:], "train_gpt.py"))
