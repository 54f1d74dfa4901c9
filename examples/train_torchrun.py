"""torchrun --nproc_per_node 4 --max_restarts 3 --redirects 1 --tee 1 examples/train_torchrun.py
Data-parallel training that resumes where it was after torchrun restarts the workers; job, rank, world size,
meta and agent come from the environment (docs/python.md "Using ckpt from torchrun / Slurm / Kubernetes")."""
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler
import ckpt.torch

dist.init_process_group("gloo")
torch.manual_seed(0)  # the same data and initial weights on every rank
X, Y, steps, batch = torch.randn(2048, 32), torch.randn(2048, 1), 200, 16
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
sampler = DistributedSampler(range(len(X)), seed=0)  # this rank's share, shuffled per epoch
ck = ckpt.torch.Checkpointer(model, opt, every=5)
step = ck.resume()  # 0, or the step restored (model, optimizer, RNG states and ck.extra)
pos = ck.extra.setdefault("data", {"epoch": 0, "batch": 0})  # the data position, saved with each version
while step < steps:
    sampler.set_epoch(pos["epoch"])
    order = list(sampler)
    while pos["batch"] < len(order) // batch and step < steps:
        idx = order[pos["batch"] * batch:(pos["batch"] + 1) * batch]
        loss = torch.nn.functional.mse_loss(model(X[idx]), Y[idx])
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # gradients averaged in a fixed order: a deterministic sum
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        step, pos["batch"] = step + 1, pos["batch"] + 1
        ck.step(step)  # saves every 5 steps (lazily: the copy overlaps the next step)
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    if pos["batch"] == len(order) // batch:
        pos["epoch"], pos["batch"] = pos["epoch"] + 1, 0
ck.close()  # waits until the last save is PROTECTED
