#!/usr/bin/python3
"""A small mixture-of-experts model trained on CPU by N ranks (gloo) with sparse checkpoints.

One process per rank, data parallel (every rank holds the whole model; gradients
are all-reduced). Every --every steps each rank saves through ckpt:

  - the dense parts (embeddings, router, norm, head) and their optimizer state;
  - a rotating subset of the experts (--experts-per-save of --experts; expert e is
    saved every experts/experts-per-save saves), each with its own optimizer;
  - the upstream log of every step since the previous save: for every expert,
    the inputs it got and the gradient that came back into its outputs
    (MoEtion's upstream logging);
  - the data generator's state.

The first save is full; the others are partial saves (ckpt Client.save(...,
partial=True)): the experts not stated are carried over from the previous
version as references, so a version costs the dense parts, a few experts and
the log. c.item_steps(step) says how old each expert's snapshot is.

Resume (--resume) rebuilds a consistent dense state from the sparse snapshots
(sparse-to-dense conversion): it loads the newest version V that every rank
has PROTECTED (the dense parts are at V, each expert e at its snapshot step
s_e <= V) and brings every expert forward by replaying the steps s_e+1..V for
it alone: the expert's forward on the logged inputs, backward with the logged
output gradient, the same all-reduce and the same optimizer step. The state
after that is bit-identical to the uninterrupted run's at V, so the loss curve
continues exactly. Training is deterministic (fixed seeds, one thread, no
dropout, gloo sums in a fixed order).

    train_moe.py --meta 127.0.0.1:7400 --agent-socket /run/ckpt/agent.sock --job moe \\
        --rank R --world-size 4 --dist-port 29500 --steps 30 --log loss-R.jsonl
    ... --crash-at 12    # SIGKILL itself right after the step-12 save is protected
    ... --resume         # sparse-to-dense restore of the newest protected version, then go on
    ... --full           # every save states every expert (the comparison: full checkpoints)

stdout: one JSON object per line ("event": "save" | "resume" | "done"); a save
line has the shard's bytes and the experts it stated; "resume" the snapshot
step of every expert and the replayed expert-steps.
--log: JSON lines {"step": S, "loss": L} (L exact: Python float repr).
Exit status: 0 finished, 2 bad arguments, 1 any other error.
"""
import argparse
import datetime
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ckpt
from example_common import batch, crash, emit, positive, run  # examples/ (this script's directory)


class MoE(nn.Module):
    """Token + position embeddings, one top-1 mixture-of-experts layer (residual), norm, head."""

    def __init__(self, vocab, seq, d, n_experts):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                      for _ in range(n_experts)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def dense_parameters(self):
        return [p for n, p in self.named_parameters() if not n.startswith("experts.")]

    def forward(self, idx, log=None):
        """Logits; with `log` (a dict), log[e] = [inputs, output gradient (after backward)]."""
        b, t = idx.shape
        h = (self.tok(idx) + self.pos(torch.arange(t))).reshape(b * t, -1)
        gate = F.softmax(self.router(h), dim=-1)
        top = gate.argmax(dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            sel = (top == e).nonzero(as_tuple=True)[0]
            x = h.index_select(0, sel)
            y = expert(x)
            if log is not None:
                log[e] = [x.detach().clone(), None]
                y.register_hook(lambda g, e=e: log[e].__setitem__(1, g.detach().clone()))
            out = out.index_add(0, sel, y * gate.index_select(0, sel)[:, e:e + 1])
        return self.head(self.ln(h + out)).reshape(b, t, -1)






def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--meta", required=True, help="ckpt-meta address, e.g. 127.0.0.1:7400")
    p.add_argument("--agent-socket", required=True, help="this node's ckpt-agent unix socket")
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=positive("--world-size"), required=True)
    p.add_argument("--dist-port", type=int, required=True, help="torch.distributed rendezvous port on 127.0.0.1")
    p.add_argument("--steps", type=positive("--steps"), default=30)
    p.add_argument("--every", type=positive("--every"), default=1, help="save every N steps")
    p.add_argument("--experts", type=positive("--experts"), default=8)
    p.add_argument("--experts-per-save", type=positive("--experts-per-save"), default=2)
    p.add_argument("--full", action="store_true", help="every save states every expert")
    p.add_argument("--d-model", type=positive("--d-model"), default=64)
    p.add_argument("--batch", type=positive("--batch"), default=8)
    p.add_argument("--crash-at", type=positive("--crash-at"), default=None,
                   help="SIGKILL this process right after the save of this step is protected")
    p.add_argument("--resume", action="store_true", help="sparse-to-dense restore of the newest protected version")
    p.add_argument("--log", default=None, help="loss curve, JSON lines {step, loss}")
    p.add_argument("--protection", default="replicate:2:ring",
                   help='job protection: "none", "replicate:COPIES[:ring|group]" or "ec:K+M"')
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--flush-every", type=int, default=0, help="flush every Nth version to the durable tier (0: no)")
    p.add_argument("--protect-timeout", type=float, default=60.0, help="seconds to wait for 'protected'")
    a = p.parse_args(argv)
    if not 0 <= a.rank < a.world_size:
        p.error(f"--rank must be in [0, {a.world_size}), got {a.rank}")
    if not 0 < a.dist_port < 65536:
        p.error(f"--dist-port must be a TCP port (1..65535), got {a.dist_port}")
    if a.experts % a.experts_per_save != 0:
        p.error(f"--experts-per-save ({a.experts_per_save}) must divide --experts ({a.experts})")
    if a.crash_at is not None and (a.crash_at % a.every != 0 or a.crash_at > a.steps):
        p.error(f"--crash-at {a.crash_at} must be a saved step: a multiple of --every {a.every} "
                f"and at most --steps {a.steps}")
    if not os.path.exists(a.agent_socket):
        p.error(f"--agent-socket {a.agent_socket}: no such file (is ckpt-agent running?)")
    return a




class Trainer:
    def __init__(self, a):
        self.a = a
        torch.manual_seed(a.seed)  # same initial weights on every rank
        self.vocab, self.seq = 256, 16
        self.model = MoE(self.vocab, self.seq, a.d_model, a.experts)
        self.dense_opt = torch.optim.Adam(self.model.dense_parameters(), lr=3e-3)
        self.expert_opts = [torch.optim.Adam(e.parameters(), lr=3e-3) for e in self.model.experts]
        self.data_gen = torch.Generator().manual_seed(a.seed + 7 * a.rank)
        self.logs = {}  # upstream logs since the last save: step -> {e: [inputs, output gradient]}

    def all_reduce_grads(self, params):
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(self.a.world_size)

    def step(self, step):
        x, y = batch(self.data_gen, self.a.batch, self.seq, self.vocab)
        log = self.logs[step] = {}
        logits = self.model(x, log=log)
        loss = F.cross_entropy(logits.reshape(-1, self.vocab), y.reshape(-1))
        self.model.zero_grad(set_to_none=True)
        loss.backward()
        self.all_reduce_grads(self.model.parameters())
        self.dense_opt.step()
        for opt in self.expert_opts:
            opt.step()
        return loss.item()

    def dense_state(self):
        sd = self.model.state_dict()
        return {"model": {k: v for k, v in sd.items() if not k.startswith("experts.")},
                "opt": self.dense_opt.state_dict()}

    def expert_state(self, e):
        return {"model": self.model.experts[e].state_dict(), "opt": self.expert_opts[e].state_dict()}

    def subset(self, save_index):
        """Experts stated by the save_index-th save (0-based): all for the first and with --full."""
        n, k = self.a.experts, self.a.experts_per_save
        if save_index == 0 or self.a.full:
            return list(range(n))
        first = ((save_index - 1) * k) % n
        return [(first + i) % n for i in range(k)]

    def save(self, client, step, save_index):
        experts = self.subset(save_index)
        # (An expert no token reached gets an empty gradient.)
        log = {str(j): {str(e): {"x": x, "g": torch.zeros_like(x) if g is None else g}
                        for e, (x, g) in entries.items()} for j, entries in self.logs.items()}
        state = {"dense": self.dense_state(),
                 "experts": {str(e): self.expert_state(e) for e in experts},
                 "log": log,
                 "extra": {"step": step, "rank": self.a.rank, "save_index": save_index,
                           "data_rng": self.data_gen.get_state()}}
        h = client.save(step, state, partial=len(experts) < self.a.experts)
        self.logs = {}
        return h, experts

    def restore(self, client, step):
        """Sparse to dense: the dense parts at `step`, each expert at its snapshot step,
        brought forward to `step` by replaying its logged steps. Returns (served_from,
        save_index, {expert: snapshot step}, expert-steps replayed)."""
        served_from, state = client.load_with_source(step)
        extra = state["extra"]
        if extra["step"] != step or extra["rank"] != self.a.rank:
            raise RuntimeError(f"checkpoint of step {step} holds step {extra['step']} rank {extra['rank']}")
        dense = state["dense"]
        self.model.load_state_dict({**dense["model"], **{
            f"experts.{e}.{k}": v for e, st in state["experts"].items() for k, v in st["model"].items()}})
        self.dense_opt.load_state_dict(dense["opt"])
        for e, st in state["experts"].items():
            self.expert_opts[int(e)].load_state_dict(st["opt"])
        self.data_gen.set_state(extra["data_rng"])
        steps = client.item_steps(step)
        snap = {e: steps[f"experts/{e}/model/0.weight"] for e in range(self.a.experts)}
        logs = {}  # saved step -> that version's upstream logs (of the steps since the save before)
        replayed = 0
        every = self.a.every
        for e in range(self.a.experts):  # the same order on every rank: the all-reduces match
            for j in range(snap[e] + 1, step + 1):
                saved = -(-j // every) * every  # the save that logged step j
                if saved not in logs:
                    logs[saved] = client.load(saved)["log"]
                entry = logs[saved][str(j)][str(e)]
                expert = self.model.experts[e]
                expert.zero_grad(set_to_none=True)
                expert(torch.as_tensor(entry["x"])).backward(torch.as_tensor(entry["g"]))
                self.all_reduce_grads(expert.parameters())
                self.expert_opts[e].step()
                replayed += 1
        return served_from, extra["save_index"], snap, replayed

    def digest(self):
        h = hashlib.sha256()
        for name, t in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(t.contiguous().numpy().tobytes())
        for opt in [self.dense_opt] + self.expert_opts:
            for pid, st in sorted(opt.state_dict()["state"].items()):
                for k, v in sorted(st.items()):
                    h.update(f"{pid}/{k}".encode())
                    h.update(v.contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
        return h.hexdigest()


def main(argv):
    a = parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tr = Trainer(a)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.dist_port}", rank=a.rank,
                            world_size=a.world_size, timeout=datetime.timedelta(seconds=60))
    # A resume reads the versions of the last experts/experts_per_save saves
    # (the experts' snapshots and the logs of every step since): each holds the
    # newest snapshot of some expert, which the newest version refers to, so
    # meta keeps them whatever the job's keep_in_memory.
    t_connect = time.perf_counter()
    client = ckpt.Client(job=a.job, rank=a.rank, world_size=a.world_size, meta=a.meta,
                         agent_socket=a.agent_socket, protection=a.protection, flush_every=a.flush_every)
    connect_ms = round((time.perf_counter() - t_connect) * 1e3, 3)
    step, save_index = 0, 0
    if a.resume:
        t_latest = time.perf_counter()
        latest = client.latest("protected")
        latest_ms = round((time.perf_counter() - t_latest) * 1e3, 3)
        agreed = torch.tensor([-1 if latest is None else latest], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # every rank restores the same step
        if agreed.item() >= 0:
            step = int(agreed.item())
            t0 = time.perf_counter()
            served_from, last_index, snap, replayed = tr.restore(client, step)
            save_index = last_index + 1
            emit(event="resume", rank=a.rank, step=step, node=client.node_id, served_from=served_from,
                 snapshot_steps=snap, replayed_expert_steps=replayed,
                 connect_ms=connect_ms, latest_ms=latest_ms, load_ms=round((time.perf_counter() - t0) * 1e3, 3))
        else:
            emit(event="resume", rank=a.rank, step=None, note="no protected version")
    log = open(a.log, "a") if a.log else None
    while step < a.steps:
        step += 1
        loss = tr.step(step)
        if log:
            log.write(json.dumps({"step": step, "loss": loss}) + "\n")
            log.flush()
        if step % a.every == 0:
            t0 = time.perf_counter()
            h, experts = tr.save(client, step, save_index)
            blocking = time.perf_counter() - t0
            save_index += 1
            h.wait("protected", timeout=a.protect_timeout)
            emit(event="save", rank=a.rank, step=step, bytes=h.size_bytes, experts=experts,
                 blocking_ms=round(blocking * 1e3, 3), protected_ms=round((time.perf_counter() - t0) * 1e3, 3))
            if a.crash_at == step:
                crash(a.rank, step, log)
    if log:
        log.close()
    emit(event="done", rank=a.rank, step=step, final_sha256=tr.digest())
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:], "train_moe.py"))
