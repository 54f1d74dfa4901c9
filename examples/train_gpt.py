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
    ... --tp 2 [--zero]  # tensor parallel over 2 ranks (Megatron's split: attention heads
                         # and the MLP's hidden units), data parallel over world/2, with
                         # --zero the AdamW state partitioned over the data-parallel ranks
                         # (ZeRO-1); saved with ckpt.torch.save_sharded, so --resume
                         # restores into whatever --tp / --zero / --world-size the new run
                         # has (ckpt.torch.load_sharded)
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


# --- Tensor parallelism (--tp, --zero): Megatron's split on gloo ---------------------------

class _ToTP(torch.autograd.Function):
    """Into a tensor-parallel region: identity forward, all-reduce of the gradient backward."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _FromTP(torch.autograd.Function):
    """Out of a tensor-parallel region: all-reduce of the partial sums forward, identity backward."""
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class TPBlock(nn.Module):
    """A transformer block whose attention heads and MLP hidden units are split over `tp`
    ranks: q, k, v and fc1 column-parallel, o and fc2 row-parallel (their biases, added after
    the reduction, replicated), layer norms replicated."""

    def __init__(self, d_model, n_heads, tp, dropout, group):
        super().__init__()
        self.group, self.tp, self.heads, self.dh = group, tp, n_heads // tp, d_model // n_heads
        local = self.heads * self.dh
        self.ln1 = nn.LayerNorm(d_model)
        self.q, self.k, self.v = nn.Linear(d_model, local), nn.Linear(d_model, local), nn.Linear(d_model, local)
        self.o = nn.Linear(local, d_model, bias=False)
        self.o_bias = nn.Parameter(torch.zeros(d_model))
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model // tp)
        self.fc2 = nn.Linear(4 * d_model // tp, d_model, bias=False)
        self.fc2_bias = nn.Parameter(torch.zeros(d_model))
        self.drop = nn.Dropout(dropout)

    def into(self, x):
        return _ToTP.apply(x, self.group) if self.tp > 1 else x

    def out(self, x):
        return _FromTP.apply(x, self.group) if self.tp > 1 else x

    def forward(self, x, mask):
        b, t, _ = x.shape
        h = self.into(self.ln1(x))
        q, k, v = (f(h).view(b, t, self.heads, self.dh).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.dh) + mask, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, self.heads * self.dh)
        x = x + self.drop(self.out(self.o(y)) + self.o_bias)
        h = self.into(self.ln2(x))
        return x + self.drop(self.out(self.fc2(F.gelu(self.fc1(h)))) + self.fc2_bias)


class TPGPT(GPT):
    """GPT with TPBlocks; embeddings, final norm and head replicated. The same parameter
    names at every --tp, so a checkpoint of one split restores into another."""

    def __init__(self, vocab, seq, d_model, n_layers, n_heads, dropout, tp=1, group=None):
        super().__init__(vocab, seq, d_model, 0, n_heads, dropout)
        self.blocks = nn.ModuleList([TPBlock(d_model, n_heads, tp, dropout, group) for _ in range(n_layers)])


def tp_split(n_layers):
    """ckpt.torch.Layout's split: the dimension each tensor-parallel parameter is cut along."""
    split = {}
    for i in range(n_layers):
        for name in ("q", "k", "v", "fc1"):
            split[f"blocks.{i}.{name}.weight"] = 0
            split[f"blocks.{i}.{name}.bias"] = 0
        split[f"blocks.{i}.o.weight"] = 1
        split[f"blocks.{i}.fc2.weight"] = 1
    return split


def tp_model(a, vocab, seq, layout, group):
    """This rank's part of the model: the whole model initialised from --seed (the same at
    every split), then cut as `layout` says."""
    torch.manual_seed(a.seed)
    whole = TPGPT(vocab, seq, a.d_model, a.layers, 4, 0.1)
    model = TPGPT(vocab, seq, a.d_model, a.layers, 4, 0.1, tp=layout.tp_size, group=group)
    with torch.no_grad():
        mine = dict(model.named_parameters())
        for name, p in whole.named_parameters():
            offsets, lengths = layout.box(name, list(p.shape))
            mine[name].copy_(p[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))])
    return model


class ZeroAdamW:
    """ZeRO-1 on gloo: AdamW over this data-parallel rank's part of the flat parameters
    (Layout.zero_range); after its step the parts are gathered back into every rank's
    parameters."""

    def __init__(self, model, layout, group, **kw):
        self.model, self.group, self.dp = model, group, layout.dp_size
        self.start, self.stop = layout.zero_range(model)
        total = sum(p.numel() for p in model.parameters())
        self.sizes = [(total // self.dp) + (1 if r < total % self.dp else 0) for r in range(self.dp)]
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])[self.start:self.stop].clone()
        self.flat = nn.Parameter(flat)
        self.opt = torch.optim.AdamW([self.flat], **kw)

    def step(self, grads):
        self.flat.grad = grads[self.start:self.stop].clone()
        self.opt.step()
        width = max(self.sizes)
        parts = [torch.empty(width) for _ in range(self.dp)]
        mine = torch.zeros(width)
        mine[:self.stop - self.start] = self.flat.detach()
        dist.all_gather(parts, mine, group=self.group)
        full = torch.cat([part[:n] for part, n in zip(parts, self.sizes)])
        with torch.no_grad():
            at = 0
            for p in self.model.parameters():
                p.copy_(full[at:at + p.numel()].view(p.shape))
                at += p.numel()


def groups(tp, dp):
    """This rank's (tensor-parallel group, data-parallel group); every rank makes every group,
    in the same order (torch.distributed.new_group's rule)."""
    rank = dist.get_rank()
    tp_group = dp_group = None
    for d in range(dp):
        g = dist.new_group([d * tp + t for t in range(tp)])
        if rank // tp == d:
            tp_group = g
    for t in range(tp):
        g = dist.new_group([d * tp + t for d in range(dp)])
        if rank % tp == t:
            dp_group = g
    return tp_group, dp_group






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
    p.add_argument("--tp", type=positive("--tp"), default=None,
                   help="tensor-parallel ranks (a divisor of --world-size and of the 4 heads); "
                        "sharded saves (ckpt.torch.save_sharded), resumable into any other split")
    p.add_argument("--zero", action="store_true",
                   help="ZeRO-1: the AdamW state partitioned over the data-parallel ranks (sharded saves)")
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
    if a.zero and a.tp is None:
        a.tp = 1
    if a.tp is not None and (a.world_size % a.tp != 0 or 4 % a.tp != 0):
        p.error(f"--tp {a.tp} must divide --world-size {a.world_size} and the 4 attention heads")
    if a.tp is not None and (a.lazy or a.every == "auto"):
        p.error("--tp and --zero go with a fixed --every and without --lazy")
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


def reseed(a, step, dp_rank, data_gen):
    """Sharded runs: the dropout and data RNGs start each save interval from (seed, step,
    data-parallel rank), so a run resumed at a saved step, in any split with the same
    data-parallel ranks, draws what an uninterrupted one draws (RNG states are a rank's own
    and are not in a sharded checkpoint)."""
    torch.manual_seed(a.seed + 1000 + dp_rank + 7919 * step)
    data_gen.manual_seed(a.seed + 7 * dp_rank + 104729 * step)


def main_sharded(a):
    """--tp / --zero: Megatron-style tensor parallelism over --tp ranks, data parallelism over
    the rest, AdamW whole (or ZeRO-1 with --zero); saves with save_sharded, resumes with
    load_sharded into this run's split."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    vocab, seq = 256, 32
    tp, dp = a.tp, a.world_size // a.tp
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.dist_port}", rank=a.rank,
                            world_size=a.world_size, timeout=datetime.timedelta(seconds=60))
    tp_group, dp_group = groups(tp, dp)
    layout = ckpt.torch.Layout(tp=(a.rank % tp, tp), dp=(a.rank // tp, dp), split=tp_split(a.layers), zero=a.zero)
    model = tp_model(a, vocab, seq, layout, tp_group)
    if a.zero:
        zero = ZeroAdamW(model, layout, dp_group, lr=3e-3, weight_decay=0.01)
        opt = zero.opt
    else:
        zero, opt = None, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    data_gen = torch.Generator()
    client = ckpt.Client(job=a.job, rank=a.rank, world_size=a.world_size, meta=a.meta,
                         agent_socket=a.agent_socket, protection=a.protection, resize_world=True)
    step = 0
    if a.resume:
        latest = client.latest("protected")
        agreed = torch.tensor([-1 if latest is None else latest], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # every rank restores the same step
        if agreed.item() >= 0:
            step = int(agreed.item())
            t0 = time.perf_counter()
            extra = ckpt.torch.load_sharded(client, step, model, opt, layout)
            if extra["step"] != step:
                raise RuntimeError(f"checkpoint of step {step} holds step {extra['step']}")
            emit(event="resume", rank=a.rank, step=step, saved_layout=extra["layout"],
                 layout={"tp": tp, "dp": dp, "zero": a.zero}, load_ms=round((time.perf_counter() - t0) * 1e3, 3))
        else:
            emit(event="resume", rank=a.rank, step=None, note="no protected version")
    reseed(a, step, layout.dp_rank, data_gen)
    log = open(a.log, "a") if a.log else None
    model.train()
    params = list(model.parameters())
    while step < a.steps:
        step += 1
        x, y = batch(data_gen, a.batch, seq, vocab)
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        for p in params:
            p.grad = None
        loss.backward()
        grads = torch.cat([p.grad.reshape(-1) for p in params])
        if dp > 1:
            dist.all_reduce(grads, group=dp_group)
            grads.div_(dp)
        if zero is not None:
            zero.step(grads)
        else:
            at = 0
            for p in params:
                p.grad.copy_(grads[at:at + p.numel()].view(p.shape))
                at += p.numel()
            opt.step()
        lv = loss.item()
        if not math.isfinite(lv):
            raise RuntimeError(f"loss is {lv} at step {step}")
        if log:
            log.write(json.dumps({"step": step, "loss": lv}) + "\n")
            log.flush()
        if step % a.every == 0:
            extra = {"step": step, "layout": {"tp": tp, "dp": dp, "zero": a.zero}}
            t0 = time.perf_counter()
            h = ckpt.torch.save_sharded(client, step, model, opt, layout, extra=extra)
            h.wait("protected", timeout=a.protect_timeout)
            emit(event="save", rank=a.rank, step=step, bytes=h.size_bytes,
                 protected_ms=round((time.perf_counter() - t0) * 1e3, 3))
            reseed(a, step, layout.dp_rank, data_gen)
            if a.crash_at == step:
                crash(a.rank, step, log)
    if log:
        log.close()
    emit(event="done", rank=a.rank, step=step, final_sha256=state_digest(model, opt))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv):
    a = parse_args(argv)
    if a.tp is not None:
        return main_sharded(a)
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
