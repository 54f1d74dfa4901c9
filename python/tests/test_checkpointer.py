"""ckpt.torch.Checkpointer against real daemons: resume, the save interval, RNG states and
extra restored, a resumed run equal to an uninterrupted one, PROTECTED first."""
import gc
import random

import numpy as np
import pytest
import torch

import ckpt
import ckpt.torch
from ckpt.torch import Checkpointer, _parse_every


def make(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model, opt):
    """One step drawing from torch's, numpy's and Python's global generators."""
    x = torch.randn(4, 8) + float(np.random.rand())
    y = torch.full((4, 1), random.random())
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def seed_all(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


class Run:
    """What a finished run leaves: its Checkpointer's record (not the Checkpointer: its
    client is gone, as a process that exits), model and optimizer."""

    def __init__(self, ck, model, opt):
        self.saved_steps, self.restored, self.extra = ck.saved_steps, ck.restored, ck.extra
        self.model, self.opt = model, opt


def run(cluster, job, until, every=3, **kw):
    """A 'process': a model, a Checkpointer on a new client, resume, train to `until`, close.
    The client is dropped at the end (a rank's client holds the lease of its next save)."""
    model, opt = make()
    seed_all(1)  # what a restarted process does first; resume() puts the saved states back
    ck = Checkpointer(model, opt, every=every, client=cluster.client(job), **kw)
    step = ck.resume()
    ck.extra.setdefault("seen", [])
    while step < until:
        train_step(model, opt)
        step += 1
        ck.extra["seen"].append(step)
        ck.step(step)
    ck.close()
    out = Run(ck, model, opt)
    drop(ck)
    return out


def drop(ck):
    """Drops a Checkpointer and its client (and the optimizer's and model's hooks on it)."""
    for obj in (ck.optimizer, ck.model):
        if obj is not None and hasattr(obj, "_ckpt_guarded"):
            obj._ckpt_guarded.clear()
    ck.client = None
    gc.collect()


def params(model):
    return [p.detach().clone() for p in model.state_dict().values()]


def test_parse_every():
    assert _parse_every("auto") == ("auto", None)
    assert _parse_every(100) == ("steps", 100)
    assert _parse_every("30s") == ("seconds", 30.0)
    assert _parse_every("5m") == ("seconds", 300.0)
    assert _parse_every("1h") == ("seconds", 3600.0)
    import datetime
    assert _parse_every(datetime.timedelta(minutes=2)) == ("seconds", 120.0)
    for bad in (0, -1, "100", 2.5, True, "fast", "0s"):
        with pytest.raises(ckpt.InvalidArgumentError):
            _parse_every(bad)


def test_fresh_job_resumes_at_zero_then_saves_every_n(cluster, job):
    ck = run(cluster, job, until=10, every=3)
    assert ck.restored["step"] == 0 and ck.restored["level"] is None
    assert ck.saved_steps == [3, 6, 9]
    assert cluster.client(job).latest("protected") == 9


def test_resume_restores_model_optimizer_rng_and_extra(cluster, job):
    ck = run(cluster, job, until=9, every=3)
    model, opt = ck.model, ck.opt
    # What the run would draw next, from each generator.
    expected_draws = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    seen = list(ck.extra["seen"])
    model2, opt2 = make(seed=99)  # other weights
    seed_all(5)
    extra = {"stale": 1}
    ck2 = Checkpointer(model2, opt2, every=3, client=cluster.client(job), extra=extra)
    assert ck2.resume() == 9
    assert ck2.extra is extra and extra == {"seen": seen}  # restored in place
    for a, b in zip(params(model), params(model2)):
        assert torch.equal(a, b)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert torch.equal(torch.rand(3), expected_draws[0])
    assert np.array_equal(np.random.rand(3), expected_draws[1])
    assert [random.random() for _ in range(3)] == expected_draws[2]
    r = ck2.restored
    assert (r["step"], r["level"], r["served_from"], r["skipped"]) == (9, "protected", "local", [])


@pytest.mark.parametrize("lazy,incremental", [(True, False), (False, False), (True, True)])
def test_interrupted_run_equals_uninterrupted(cluster, job, lazy, incremental):
    whole = run(cluster, job + "-whole", until=14, every=4, lazy=lazy, incremental=incremental)
    # Dies after step 10 (last save 8), restarts, resumes at 8, goes on to 14.
    first = run(cluster, job, until=10, every=4, lazy=lazy, incremental=incremental)
    assert first.saved_steps == [4, 8]
    second = run(cluster, job, until=14, every=4, lazy=lazy, incremental=incremental)
    assert second.restored["step"] == 8 and second.saved_steps == [12]
    assert second.extra["seen"] == list(range(1, 15))
    for a, b in zip(params(whole.model), params(second.model)):
        assert torch.equal(a, b)


def test_auto_saves_at_the_first_step_then_at_the_young_daly_interval(cluster, job):
    model, opt = make()
    ck = Checkpointer(model, opt, every="auto", client=cluster.client(job))
    assert ck.resume() == 0
    train_step(model, opt)
    assert ck.step(1) is not None  # the first save measures the cost
    assert ck.interval["steps"] >= 1 and ck.interval["why"]
    nxt = 1 + ck.interval["steps"]
    for s in range(2, nxt + 1):
        train_step(model, opt)
        h = ck.step(s)
        assert (h is not None) == (s == nxt)
    ck.close()


def test_duration_converts_to_steps(cluster, job):
    model, opt = make()
    ck = Checkpointer(model, opt, every="1h", client=cluster.client(job))
    ck.resume()
    train_step(model, opt)
    ck.step(1)
    assert ck.saved_steps == [1]
    assert ck.interval["steps"] > 1000 and "every 3600 s" in ck.interval["why"]
    ck.close()


def test_auto_with_ranks_and_no_torch_distributed_is_refused(cluster, job):
    model, opt = make()
    ck = Checkpointer(model, opt, every="auto", client=cluster.client(job, rank=0, world_size=2))
    with pytest.raises(ckpt.FailedPreconditionError, match="needs torch.distributed initialised"):
        ck.step(1)
    assert ck.saved_steps == []


def test_protected_first_and_no_save_over_a_newer_staged_version(cluster2, job):
    """A version STAGED but not yet PROTECTED (protection paused) newer than the newest
    protected one: resume takes the protected one after settle_timeout, and does not save
    again at steps up to the staged one (meta refuses steps below its newest staged)."""
    c = cluster2.client(job, protection="replicate:2:ring")
    model, opt = make()
    ck = Checkpointer(model, opt, every=2, lazy=False, client=c)
    ck.resume()
    for s in (1, 2):
        train_step(model, opt)
        ck.step(s)
    ck.close()  # step 2 PROTECTED
    expected = params(model)
    with c.protection_paused(max_seconds=20):
        for s in (3, 4):
            train_step(model, opt)
            ck.step(s)
        ck._last.wait("staged", timeout=30)
        assert c.latest("staged") == 4 and c.latest("protected") == 2
        drop(ck)  # the rank's process dies
        model2, opt2 = make(seed=7)
        ck2 = Checkpointer(model2, opt2, every=2, lazy=False, settle_timeout=0.5,
                           client=cluster2.client(job, agent=1))
        assert ck2.resume() == 2
    assert ck2.restored["level"] == "protected"
    for a, b in zip(expected, params(model2)):
        assert torch.equal(a, b)
    for s in (3, 4, 5, 6):
        train_step(model2, opt2)
        assert (ck2.step(s) is not None) == (s == 6), s
    ck2.close()
    assert ck2.saved_steps == [6]


def test_settle_timeout_lets_the_newer_version_get_protected(cluster2, job):
    c = cluster2.client(job, protection="replicate:2:ring")
    model, opt = make()
    ck = Checkpointer(model, opt, every=1, lazy=False, client=c)
    ck.resume()
    train_step(model, opt)
    ck.step(1)
    ck._last.wait("staged", timeout=30)
    drop(ck)
    ck2 = Checkpointer(*make(seed=3), every=1, settle_timeout=30, client=cluster2.client(job, agent=1))
    assert ck2.resume() == 1 and ck2.restored["level"] == "protected"


WORKER = r"""
import json, sys
import torch, torch.distributed as dist
import ckpt.torch
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ck = ckpt.torch.Checkpointer(model, opt, every=3)  # everything from the environment
step = ck.resume()
while step < 10:
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    step += 1
    ck.step(step)
ck.close()
print(json.dumps({"rank": ck.rank, "saved": ck.saved_steps, "skipped": ck.skipped_steps,
                  "sources": ck.client.config.sources}))
"""


def test_ranks_skip_a_step_a_dead_run_began(cluster, job, tmp_path):
    """Rank 0 of a run that died saved step 6, rank 1 never did: the version is OPEN. The
    next run (2 processes, torch.distributed, configured from the environment only) does
    not save step 6 (rank 0's shard is held; AlreadyExistsError) but step 7, on both ranks."""
    import json
    import os
    import subprocess
    import sys
    from conftest import BUILD_DIR, free_ports
    dead = cluster.client(job, rank=0, world_size=2)
    dead.save(6, {"x": np.ones(4)}).committed(timeout=30)
    del dead
    gc.collect()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port, = free_ports(1)
    env = dict(os.environ, CKPT_JOB=job, CKPT_META=cluster.meta, CKPT_AGENT_SOCKET=str(cluster.socket),
               WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=os.environ.get("PYTHONPATH") or str(BUILD_DIR / "python"))
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, o in enumerate(out):
        assert o["rank"] == r
        assert (o["saved"], o["skipped"]) == ([3, 7, 9], [6]), o
        assert o["sources"] == {"job": "$CKPT_JOB", "rank": "torch.distributed", "world_size": "torch.distributed",
                                "meta": "$CKPT_META", "agent_socket": "$CKPT_AGENT_SOCKET"}
    c = cluster.client(job, rank=1, world_size=2)
    assert c.latest("protected") == 9
    with pytest.raises(ckpt.FailedPreconditionError, match="aborted"):
        c.wait(6, "staged", timeout=0)
