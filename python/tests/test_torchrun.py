"""examples/train_torchrun.py under real torchrun (python3 -m torch.distributed.run, 4 workers,
--max_restarts 3, gloo on the CPU) against a real TLS cluster (meta and two agents: the job is
replicate:2): one worker SIGKILLed mid-run, torchrun restarts the group, every rank resumes
from the newest PROTECTED version and the final state equals an uninterrupted run's.

Prints where each rank restored from and the time from the kill to training going on.
Run by ctest python_torchrun_test (CKPT_TORCHRUN_TEST=1); skipped in python_client_test."""
import json
import os
import pathlib
import re
import signal
import sys
import time
import uuid

import pytest

import ckpt
from conftest import BUILD_DIR, free_ports
from launched import Launched, example_runner, final_states, leftover_processes

pytestmark = pytest.mark.skipif(os.environ.get("CKPT_TORCHRUN_TEST") != "1",
                                reason="runs torchrun for ~1 min: ctest python_torchrun_test (CKPT_TORCHRUN_TEST=1)")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_torchrun.py"
WORLD, STEPS, EVERY, KILL_AFTER = 4, 200, 5, 80
# Runs the example unchanged, with the Checkpointer's log lines on stdout.
WRAPPER = example_runner(EXAMPLE)
RESUMED = re.compile(r"^\[default(\d)\]:ckpt: rank (\d)/4 of job (\S+) resumed from step (\d+) "
                     r"\((\w+) version, served from (\w+) through (\S+)\) in ([\d.]+) s")
STEP = re.compile(r"^\[default(\d)\]:step (\d+) loss")
STARTED = re.compile(r"^\[default(\d)\]:worker started")


class Torchrun(Launched):
    """One `torchrun` (its own session), its output read line by line with arrival times."""
    name = "torchrun"

    def __init__(self, tmp, cluster, job):
        self.dir = tmp / job
        self.dir.mkdir()
        wrapper = self.dir / "run_example.py"
        wrapper.write_text(WRAPPER)
        port, = free_ports(1)
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CKPT_JOB", "SLURM_JOB_ID", "SLURM_PROCID",
                            "SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")}
        # Only where the cluster is: the job is torchrun's run id (--rdzv_id), rank and world
        # size come from torch.distributed.
        env.update(CKPT_META=cluster.meta, CKPT_AGENT_SOCKET=str(cluster.socket),
                   PYTHONPATH=os.environ.get("PYTHONPATH") or str(BUILD_DIR / "python"),
                   OMP_NUM_THREADS="1")
        super().__init__(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(WORLD),
             "--max_restarts", "3", "--monitor_interval", "0.5", "--rdzv_backend", "c10d",
             "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", job, "--redirects", "1", "--tee", "1",
             "--log_dir", str(self.dir / "logs"), str(wrapper)],
            env, self.dir)

    def workers(self):
        """{local rank: pid} of the workers running now (children of torchrun)."""
        out = {}
        for task in pathlib.Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for pid in map(int, children):
                try:
                    env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                for kv in env:
                    if kv.startswith(b"LOCAL_RANK="):
                        out[int(kv.split(b"=", 1)[1])] = pid
        return out

    def children(self):
        return self.workers()


def same(a, b, path=""):
    import numpy as np
    import torch
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}/{i}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), path
    else:
        assert a == b, path


def versions(cluster, job):
    """{step: the version's JSON (ckptctl --json versions), "state" upper case}."""
    r = cluster.ctl("--json", "versions", job)
    assert r.returncode == 0, r.stderr
    out = {}
    for v in json.loads(r.stdout)["versions"]:
        v["state"] = v["state"].upper()
        out[int(v["step"])] = v
    return out


def is_protected(v):
    return v["state"] in ("PROTECTED", "PERSISTED")


@pytest.fixture(scope="module")
def uninterrupted(cluster2, tmp_path_factory):
    """The uninterrupted run (its job id, its time): what the runs with faults must end equal to."""
    pytest.importorskip("torch")
    job = f"torchrun-whole-{uuid.uuid4().hex[:8]}"
    whole = Torchrun(tmp_path_factory.mktemp("whole"), cluster2, job)
    try:
        t0 = time.monotonic()
        whole.finish(timeout=120)
        return job, time.monotonic() - t0
    finally:
        whole.stop()


def assert_same_final_state(cluster, expected_job, job, world=WORLD, steps=STEPS):
    """Every rank's state at the last step of `job` equals `expected_job`'s (the torch RNG state
    included)."""
    expected = final_states(cluster, expected_job, world, steps)
    got = final_states(cluster, job, world, steps)
    for r in range(world):
        # numpy's and Python's generators are not seeded by the example (nor used): their
        # states differ from run to run whatever ckpt does.
        for state in (expected[r], got[r]):
            for unseeded in ("numpy", "python"):
                state["extra"]["rng"].pop(unseeded)
        same(expected[r], got[r], f"rank {r}")


def assert_newest_protected(step, at_kill, at_resume):
    """The version the ranks restored (`step`) was the newest PROTECTED one when they asked.
    That moment lies between the two samples of the first run's versions: right after the
    fault (`at_kill`) and once every rank had resumed (`at_resume`); protection goes on
    meanwhile, so a version may turn PROTECTED after the ranks asked. So: PROTECTED when they
    had resumed, no older than the newest PROTECTED at the fault, and no version newer than it
    was PROTECTED at the fault."""
    newest_at_kill = max((s for s, v in at_kill.items() if is_protected(v)), default=0)
    newest_at_resume = max((s for s, v in at_resume.items() if is_protected(v)), default=0)
    assert step in at_resume and is_protected(at_resume[step]), (step, at_resume.get(step))
    assert newest_at_kill <= step <= newest_at_resume, \
        f"restored step {step}; newest PROTECTED at the fault {newest_at_kill}, when resumed {newest_at_resume}"


def await_resumed(run, since, timeout):
    """After a fault at line `since` of `run`: when torchrun started the workers again, and
    {rank: how it resumed} once every rank printed its Checkpointer's "resumed" line."""
    t_started, _, _ = run.wait_for(STARTED, timeout=timeout, since=since)
    resumed = {}
    i = since
    while len(resumed) < WORLD:
        t, m, i = run.wait_for(RESUMED, timeout=timeout, since=i)
        resumed[int(m.group(2))] = dict(t=t, step=int(m.group(4)), level=m.group(5), served_from=m.group(6),
                                        node=m.group(7), load_s=float(m.group(8)), line=i)
        i += 1
    return t_started, resumed


def test_torchrun_worker_killed_resumes_from_protected(cluster2, uninterrupted, tmp_path):
    whole_job, whole_s = uninterrupted
    tag = uuid.uuid4().hex[:8]
    runs = []
    try:
        # The run with a worker killed after step 100.
        job = f"torchrun-{tag}"
        run = Torchrun(tmp_path, cluster2, job)
        runs.append(run)
        run.wait_for(lambda l: (m := STEP.match(l)) and int(m.group(2)) >= KILL_AFTER and m, timeout=90)
        victims = run.workers()
        assert len(victims) == WORLD, victims
        os.kill(victims[2], signal.SIGKILL)
        t_kill = time.monotonic()
        mark = len(run.lines)
        at_kill = versions(cluster2, job)
        last_before = max((int(m.group(2)) for _, line in run.lines[:mark] if (m := STEP.match(line))), default=0)
        t_started, resumed = await_resumed(run, mark, timeout=60)
        resume_ms = time.time() * 1e3
        at_resume = versions(cluster2, job)
        going_on = {}
        for r, info in resumed.items():
            t, _, _ = run.wait_for(lambda l, r=r: (m := STEP.match(l)) and int(m.group(1)) == r and m,
                                   timeout=60, since=info["line"])
            going_on[r] = t - t_kill
        run.finish(timeout=120)
        after = versions(cluster2, job)
        (tmp_path / "torchrun.out").write_text("\n".join(f"{t - t_kill:+8.3f} {line}" for t, line in run.lines))
    finally:
        for r in runs:
            r.stop()
    left = leftover_processes(str(tmp_path))
    assert not left, f"processes of the test still running: {left}"
    skipped = [line for _, line in run.lines if "not saved" in line]
    if skipped:
        print("steps the restarted run did not save (the first run had begun them):\n" + "\n".join(skipped))

    steps = {info["step"] for info in resumed.values()}
    print(f"\nuninterrupted run: {STEPS} steps x {WORLD} ranks in {whole_s:.1f} s")
    # The first run's versions as they were when the group came back (the restarted run makes
    # new ones only after its ranks resumed: they train in lockstep).
    first = {s: v for s, v in at_resume.items() if v["created_unix_ms"] <= resume_ms}
    print(f"worker of local rank 2 SIGKILLed after step {last_before} was printed; the first run's "
          f"versions when the group came back: " + ", ".join(f"{s} {v['state']}" for s, v in sorted(first.items())))
    for r in sorted(resumed):
        info = resumed[r]
        print(f"rank {r} restored step {info['step']} ({info['level']}) from {info['served_from']} through "
              f"{info['node']} in {info['load_s']:.3f} s; training went on {going_on[r]:.2f} s after the kill")
    t_resumed = max(info["t"] for info in resumed.values())
    print(f"kill -> training going on (all ranks): {max(going_on.values()):.2f} s: torchrun restarted the "
          f"workers {t_started - t_kill:.2f} s after the kill; they resumed (python and torch imported, "
          f"torch.distributed and ckpt connected, state loaded) {t_resumed - t_started:.2f} s later; the "
          f"first step took {max(going_on.values()) - (t_resumed - t_kill):.2f} s")
    assert len(steps) == 1, resumed  # every rank the same version
    step = steps.pop()
    assert step > 0 and step % EVERY == 0 and step <= last_before + EVERY
    assert all(info["level"] == "protected" for info in resumed.values())
    assert_newest_protected(step, at_kill, first)
    assert is_protected(after[STEPS])
    assert_same_final_state(cluster2, whole_job, job)
    print(f"final state (step {STEPS}, every rank: model, optimizer, torch RNG state, data position) "
          "equals the uninterrupted run: yes")


def test_torchrun_agent_killed_resumes_from_protected(cluster2, uninterrupted, tmp_path):
    """The node's agent, not a worker, is SIGKILLed mid-run (the 4 workers all use it) and
    restarted a second later, as its systemd unit (Restart=always, RestartSec=1) would. The
    workers' next save fails, torchrun restarts the group, the restarted agent re-adopts its
    memory tier, and every rank resumes from the newest PROTECTED version; the run ends equal
    to the uninterrupted one."""
    whole_job, _ = uninterrupted
    job = f"torchrun-agent-{uuid.uuid4().hex[:8]}"
    run = Torchrun(tmp_path, cluster2, job)
    try:
        run.wait_for(lambda l: (m := STEP.match(l)) and int(m.group(2)) >= KILL_AFTER and m, timeout=90)
        cluster2.kill_agent(0)
        t_kill = time.monotonic()
        kill_ms = time.time() * 1e3
        mark = len(run.lines)
        at_kill = versions(cluster2, job)
        last_before = max((int(m.group(2)) for _, line in run.lines[:mark] if (m := STEP.match(line))), default=0)
        time.sleep(1)  # the unit's RestartSec, on a real process: not a synchronisation
        cluster2.restart_agent(0)
        t_back = time.monotonic()
        t_started, resumed = await_resumed(run, mark, timeout=90)
        at_resume = versions(cluster2, job)
        run.finish(timeout=180)
        after = versions(cluster2, job)
        (tmp_path / "torchrun.out").write_text("\n".join(f"{t - t_kill:+8.3f} {line}" for t, line in run.lines))
    finally:
        run.stop()
    left = leftover_processes(str(tmp_path))
    assert not left, f"processes of the test still running: {left}"
    log = (cluster2.root / "ckpt-agent.log").read_text(errors="replace").split("ckpt-agent starting")[-1]
    print(f"\nagent of node-1 SIGKILLed after step {last_before} was printed, back {t_back - t_kill:.2f} s later; "
          f"torchrun restarted the workers {t_started - t_kill:.2f} s after the kill")
    for r in sorted(resumed):
        info = resumed[r]
        print(f"rank {r} restored step {info['step']} ({info['level']}) from {info['served_from']} through "
              f"{info['node']} in {info['load_s']:.3f} s, {info['t'] - t_kill:.2f} s after the kill")
    # The versions the first run had begun when the agent died, as they were when the group
    # came back.
    first = {s: v for s, v in at_resume.items() if v["created_unix_ms"] <= kill_ms}
    print("the first run's versions from step 70 when the group came back: " +
          ", ".join(f"{s} {v['state']}" for s, v in sorted(first.items()) if s >= 70))
    steps = {info["step"] for info in resumed.values()}
    assert len(steps) == 1, resumed  # every rank the same version
    step = steps.pop()
    assert 0 < step <= last_before + EVERY and step % EVERY == 0, resumed
    assert_newest_protected(step, at_kill, first)
    assert all(info["level"] == "protected" for info in resumed.values()), resumed
    assert "memory tier: re-adopted" in log, log[-2000:]
    assert is_protected(after[STEPS])
    assert_same_final_state(cluster2, whole_job, job)
    print(f"final state (step {STEPS}) equals the uninterrupted run: yes")
