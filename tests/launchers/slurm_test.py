#!/usr/bin/python3
"""examples/train_torchrun.py under real Slurm (issue 39): a one-node cluster from Debian's
packages (munged, slurmctld, slurmd, srun), configured entirely in a temporary directory and
stopped by PID at the end, and a TLS ckpt cluster (meta and two agents, the job replicate:2).

In one allocation (salloc --no-shell, so SLURM_JOB_ID is the same for every step, as a
requeued job keeps it), `srun -n 4 examples/slurm/torch_env.sh python3 train_torchrun.py`
trains; one task is SIGKILLed mid-run, srun --kill-on-bad-exit ends the step, and the step is
run again: every rank resumes from the newest PROTECTED version and the final state equals an
uninterrupted run's (examples/slurm/train.sbatch as shipped, through `sbatch --wait`: another job). Prints
where each rank restored from and the time from the kill to training going on.

Then a real requeue: train.sbatch through sbatch, `scontrol requeue` after step 80 (as Slurm does
to a --requeue job whose node failed; AuthInfo cred_expire=10 shortens Slurm's wait before the
job starts again). The job comes back with the same SLURM_JOB_ID (Restarts=1), every rank trains
on from the step after the newest PROTECTED version, and it ends COMPLETED in the uninterrupted
run's final state.

Exit 0 passed, 1 failed, 77 skipped (Slurm or munge missing, not root, a daemon did not
start). CKPT_BUILD_DIR: the build directory (bin/, python/)."""
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

SRC = pathlib.Path(__file__).resolve().parents[2]
BUILD_DIR = pathlib.Path(os.environ.get("CKPT_BUILD_DIR", SRC / "build"))
sys.path.insert(0, str(BUILD_DIR / "python"))
sys.path.insert(0, str(SRC / "tests" / "support"))
sys.path.insert(0, str(SRC / "python" / "tests"))
from launched import Launched, example_runner, leftover_processes  # noqa: E402  (tests/support)

EXAMPLE = SRC / "examples" / "train_torchrun.py"
TORCH_ENV = SRC / "examples" / "slurm" / "torch_env.sh"
WORLD, STEPS, EVERY, KILL_AFTER = 4, 200, 5, 80
SKIP = 77
# A requeued job starts again once its step credentials expire (AuthInfo cred_expire, 120 s by
# default): 10 s here, so that the test's `scontrol requeue` comes back soon.
CRED_EXPIRE_S = 10
# Runs the example unchanged, with the Checkpointer's log lines on stdout.
RUN_EXAMPLE = example_runner(EXAMPLE)
# srun --label: "<task>: <line>".
RESUMED = re.compile(r"^\s*(\d+): ckpt: rank (\d)/4 of job (\S+) resumed from step (\d+) "
                     r"\((\w+) version, served from (\w+) through (\S+)\) in ([\d.]+) s")
STEP = re.compile(r"^\s*(\d+): step (\d+) loss")
STARTED = re.compile(r"^\s*(\d+): worker started")


class Skip(Exception):
    pass


def log(msg):
    print(msg, flush=True)


def free_ports(n):
    from localnet import free_ports as fp
    return fp(n)


def die_with_parent():
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Slurm:
    """munged, slurmctld and slurmd in `root`, in the foreground, stopped by PID."""

    def __init__(self, root):
        self.root = root
        self.procs = []
        self.env = None

    def start(self):
        if os.geteuid() != 0:
            raise Skip("not root (slurmd runs tasks as their user and needs root)")
        self.bin = {}
        for tool in ("munged", "slurmctld", "slurmd", "srun", "salloc", "sbatch", "scontrol", "sinfo", "scancel"):
            self.bin[tool] = shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin:/usr/bin")
            if not self.bin[tool]:
                raise Skip(f"{tool} not installed (Debian: apt-get install munge slurmctld slurmd slurm-client; "
                           "scripts/packages.txt)")
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir(mode=0o700)
        (r / "munge").mkdir(mode=0o755)  # munged: its socket's directory must be searchable by all
        os.chmod(r / "munge", 0o755)
        key = r / "munge" / "munge.key"
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400), "wb") as f:
            f.write(os.urandom(1024))
        self.munge_socket = r / "munge" / "munge.socket"
        munge = r / "munge"
        self._start("munged", [self.bin["munged"], "--foreground", "--key-file", str(key),
                               "--socket", str(self.munge_socket), "--pid-file", str(munge / "munged.pid"),
                               "--log-file", str(r / "log" / "munged.log"), "--seed-file", str(munge / "munged.seed"),
                               "--num-threads", "2"])
        self._wait(lambda: self.munge_socket.exists(), 20, "munged did not create its socket")
        ctld_port, slurmd_port = free_ports(2)
        cpus = WORLD
        conf = r / "slurm.conf"
        conf.write_text(f"""# one-node cluster of tests/launchers/slurm_test.py
ClusterName=ckpttest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / "slurmd.pid"}
SlurmctldLogFile={r / "log" / "slurmctld.log"}
SlurmdLogFile={r / "log" / "slurmd.log"}
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
KillOnBadExit=1
MaxTasksPerNode={cpus}
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")
        # The clients (srun, salloc, sinfo, ...) and the tasks find slurm.conf through SLURM_CONF.
        self.env = dict(os.environ, SLURM_CONF=str(conf))
        self.env["PATH"] = f"{os.path.dirname(self.bin['srun'])}:{self.env.get('PATH', '/usr/bin:/bin')}"
        for k in [k for k in self.env if k.startswith(("SLURM_", "SALLOC_", "SRUN_", "SBATCH_"))]:
            if k != "SLURM_CONF":
                del self.env[k]
        self._start("slurmctld", [self.bin["slurmctld"], "-D", "-f", str(conf)])
        self._start("slurmd", [self.bin["slurmd"], "-D", "-N", "localhost", "-f", str(conf)])

        def idle():
            p = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True,
                               timeout=30)
            return p.returncode == 0 and p.stdout.strip() in ("idle", "idle~", "mixed", "allocated")
        self._wait(idle, 60, "the node did not become idle")

    def _start(self, name, argv):
        out = open(self.root / "log" / f"{name}.out", "wb")
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                             env=self.env or os.environ)
        out.close()
        p.name = name
        self.procs.append(p)
        return p

    def _wait(self, ok, timeout, what):
        deadline = time.monotonic() + timeout
        while not ok():
            for p in self.procs:
                if p.poll() is not None:
                    raise Skip(f"{p.name} exited {p.returncode} at start:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise Skip(f"{what} in {timeout} s:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self):
        out = []
        for f in sorted((self.root / "log").glob("*")):
            out.append(f"== {f.name}\n" + f.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def run(self, *argv, timeout=60):
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)

    def allocate(self, name):
        """A job with WORLD CPUs and no shell (salloc --no-shell); its id."""
        p = self.run("salloc", "--no-shell", "-n", str(WORLD), "-J", name, "--immediate=60", timeout=90)
        m = re.search(r"Granted job allocation (\d+)", p.stdout + p.stderr)
        if not m:
            raise AssertionError(f"salloc failed ({p.returncode}): {p.stdout}{p.stderr}\n{self.logs()}")
        return m.group(1)

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=15)


class Step(Launched):
    """One `srun -n 4 torch_env.sh python3 run_example.py` in allocation `jobid`, its output
    read line by line with arrival times."""
    name = "srun"

    def __init__(self, slurm, jobid, cluster, workdir):
        self.dir = workdir
        self.jobid = jobid
        runner = workdir.parent / "run_example.py"
        runner.write_text(RUN_EXAMPLE)
        port, = free_ports(1)
        env = {k: v for k, v in slurm.env.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CKPT_JOB", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                            "MASTER_PORT")}
        # Only where the cluster is: the job is SLURM_JOB_ID, rank and world size come from
        # torch.distributed (whose variables examples/slurm/torch_env.sh derives from Slurm's).
        env.update(CKPT_META=cluster.meta, CKPT_AGENT_SOCKET=str(cluster.socket), MASTER_PORT=str(port),
                   PYTHONPATH=str(BUILD_DIR / "python"), OMP_NUM_THREADS="1", CKPT_SLURM_TEST=str(workdir))
        super().__init__(
            ["srun", f"--jobid={jobid}", "-n", str(WORLD), "--label", "--kill-on-bad-exit=1", "--wait=30",
             str(TORCH_ENV), sys.executable, str(runner)],
            env, workdir)

    def tasks(self):
        """{SLURM_PROCID: pid} of this step's python processes (started by slurmstepd)."""
        out = {}
        marker = f"CKPT_SLURM_TEST={self.dir}".encode()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if marker not in env or b"run_example.py" not in cmd or cmd.startswith(b"srun"):
                continue
            for kv in env:
                if kv.startswith(b"SLURM_PROCID="):
                    out[int(kv.split(b"=", 1)[1])] = int(pid)
        return out

    def children(self):
        return self.tasks()


def job_state(slurm, job):
    """(JobState, Restarts) of `job` as `scontrol show job` prints them."""
    out = slurm.run("scontrol", "show", "job", "-o", job).stdout
    state = re.search(r"\bJobState=(\S+)", out)
    restarts = re.search(r"\bRestarts=(\d+)", out)
    return (state.group(1) if state else "?", int(restarts.group(1)) if restarts else -1)


def requeued(slurm, cluster, env, tmp, whole_job, jobs):
    """examples/slurm/train.sbatch as shipped, through sbatch, requeued by `scontrol requeue`
    after step 80 (what Slurm does to a --requeue job whose node failed): the job is killed, starts
    again with the same SLURM_JOB_ID (the ckpt job), every rank goes on from the step after the
    newest PROTECTED version, and the job ends COMPLETED with the uninterrupted run's final
    state."""
    import test_torchrun as tt
    d = tmp / "requeue"
    d.mkdir()
    p = subprocess.run([slurm.bin["sbatch"], "--parsable", f"--output={d / '%j.out'}", f"--chdir={SRC}",
                        str(SRC / "examples" / "slurm" / "train.sbatch")],
                       env=env, capture_output=True, text=True, timeout=60)
    job = p.stdout.strip().split(";")[0]
    assert p.returncode == 0 and job.isdigit(), f"sbatch train.sbatch: {p.stdout}{p.stderr}"
    jobs.append(job)
    out = d / f"{job}.out"

    def lines():
        return out.read_text(errors="replace").splitlines() if out.exists() else []

    def poll(ok, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            time.sleep(0.2)  # bounded poll of real processes
        raise AssertionError(f"{what} within {timeout} s:\n" + "\n".join(lines()[-30:]) + "\n" + slurm.logs())

    poll(lambda: any((m := STEP.match(l)) and int(m.group(2)) >= KILL_AFTER for l in lines()), 150,
         f"job {job} reached no step {KILL_AFTER}")
    mark = len(lines())
    last_before = max((int(m.group(2)) for l in lines()[:mark] if (m := STEP.match(l))), default=0)
    r = slurm.run("scontrol", "requeue", job)
    assert r.returncode == 0, f"scontrol requeue {job}: {r.stdout}{r.stderr}"
    t_requeue = time.monotonic()
    requeue_ms = time.time() * 1e3
    poll(lambda: job_state(slurm, job)[1] >= 1, 30, f"job {job} shows no restart")
    at_requeue = tt.versions(cluster, job)

    # The batch script runs the example as it ships, which prints its steps but not the
    # Checkpointer's log: a rank's first step after the restart (the script's "restart 1" line)
    # says where it resumed (the step after the one it restored).
    def restarted():
        """{rank: its first step in the restarted run} (ranks seen so far)."""
        all_lines = lines()
        marker = next((i for i, l in enumerate(all_lines) if "starting (restart 1)" in l), None)
        first = {}
        for line in all_lines[marker + 1:] if marker is not None else []:
            if (m := STEP.match(line)) and int(m.group(1)) not in first:
                first[int(m.group(1))] = int(m.group(2))
        return first

    def first_steps_of_the_restart():
        first = restarted()
        return first if len(first) == WORLD else None

    # Every version seen PROTECTED from the requeue until every rank trained again: the restarted
    # run saves on at once, and retention may drop the version it resumed from before a single
    # look after the restart sees it (CI saw 85 gone so).
    protected_seen = {s for s, v in at_requeue.items() if tt.is_protected(v)}

    def trained_again():
        protected_seen.update(s for s, v in tt.versions(cluster, job).items() if tt.is_protected(v))
        return first_steps_of_the_restart() is not None or job_state(slurm, job)[0] == "COMPLETED"

    poll(trained_again, 240, f"the requeued job {job} did not train again on every rank")
    t_resumed = time.monotonic()
    poll(lambda: job_state(slurm, job)[0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 240,
         f"the requeued job {job} did not end")
    state, restarts = job_state(slurm, job)
    after = tt.versions(cluster, job)
    first = restarted()
    before = {s: v for s, v in at_requeue.items() if v["created_unix_ms"] <= requeue_ms}
    newest = max((s for s, v in before.items() if tt.is_protected(v)), default=0)
    log(f"job {job} (sbatch train.sbatch) requeued by `scontrol requeue` after step {last_before} was printed; "
        f"its versions then: " + ", ".join(f"{s} {v['state']}" for s, v in sorted(before.items()) if s >= 70))
    log(f"after the restart (Restarts={restarts}; newest PROTECTED at the requeue: {newest}) each rank's "
        "first step: "
        + ", ".join(f"rank {r_} step {n}" for r_, n in sorted(first.items()))
        + f"; {t_resumed - t_requeue:.1f} s from the requeue to every rank training again (Slurm's cred_expire "
        f"{CRED_EXPIRE_S} s and its scheduling included); the job ended {state}")
    assert state == "COMPLETED" and restarts == 1, (state, restarts, lines()[-20:])
    assert len(first) == WORLD and len(set(first.values())) == 1, first  # every rank the same version
    step = first[0] - 1
    # The version it went on from: one the killed run saved, PROTECTED, and no older than the
    # newest that was PROTECTED when the job was requeued (the agents go on protecting what was
    # staged meanwhile, and the killed run saves until Slurm's signal reaches it, so the restarted
    # one may resume from a newer version; test_torchrun checks the exact choice).
    assert step > 0 and step % EVERY == 0 and step >= newest, (first, newest)
    assert step in protected_seen, (step, sorted(protected_seen)[-5:])
    assert tt.is_protected(after[STEPS]), after[STEPS]
    tt.assert_same_final_state(cluster, whole_job, job, WORLD, STEPS)
    log("the requeued job's final state equals the uninterrupted run: yes")


def main(tmp):
    slurm = Slurm(tmp / "slurm")
    (tmp / "slurm").mkdir()
    cluster = None
    steps = []
    jobs = []
    try:
        t0 = time.monotonic()
        slurm.start()
        log(f"slurm: munged, slurmctld, slurmd up in {time.monotonic() - t0:.1f} s "
            f"({slurm.run('sinfo', '-V').stdout.strip()}; node localhost idle)")
        try:
            import torch  # noqa: F401
        except ImportError:
            raise Skip("python3-torch not installed")
        try:
            import ckpt  # noqa: F401
        except ImportError as e:
            raise Skip(f"the ckpt Python module is not built in {BUILD_DIR / 'python'} ({e})")
        import conftest
        from localnet import ClusterTls
        tls = ClusterTls(tmp / "pki", BUILD_DIR / "bin", trainer_jobs=("*",), trainer_name="slurm-test")
        os.environ.update(tls.trainer_env())
        slurm.env.update(tls.trainer_env())
        (tmp / "ckpt").mkdir()
        cluster = conftest.Cluster.__new__(conftest.Cluster)
        cluster.procs = []
        cluster.__init__(tmp / "ckpt", tls, agents=2, memory="64MiB")
        import test_torchrun as tt

        # The uninterrupted run: examples/slurm/train.sbatch as shipped (its own job: another
        # SLURM_JOB_ID, another ckpt job; MASTER_PORT from torch_env.sh).
        (tmp / "whole").mkdir()
        env = {k: v for k, v in slurm.env.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CKPT_JOB", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                            "MASTER_PORT")}
        env.update(CKPT_META=cluster.meta, CKPT_AGENT_SOCKET=str(cluster.socket),
                   PYTHONPATH=str(BUILD_DIR / "python"),
                   PATH=f"{os.path.dirname(sys.executable)}:{env['PATH']}")  # the python3 with torch
        t0 = time.monotonic()
        p = subprocess.run([slurm.bin["sbatch"], "--wait", "--parsable", f"--output={tmp / 'whole' / '%j.out'}",
                            f"--chdir={SRC}", str(SRC / "examples" / "slurm" / "train.sbatch")],
                           env=env, capture_output=True, text=True, timeout=200)
        whole_s = time.monotonic() - t0
        whole_job = p.stdout.strip().split(";")[0]
        out = "\n".join(f.read_text(errors="replace")[-3000:] for f in (tmp / "whole").glob("*.out"))
        assert p.returncode == 0 and whole_job.isdigit(), \
            f"sbatch --wait train.sbatch: exit {p.returncode}: {p.stdout}{p.stderr}\n{out}\n{slurm.logs()}"
        assert f"3: step {STEPS} loss" in out, out
        jobs.append(whole_job)

        job = slurm.allocate("ckpt-train")
        jobs.append(job)
        (tmp / "first").mkdir()
        first = Step(slurm, job, cluster, tmp / "first")
        steps.append(first)
        first.wait_for(lambda l: (m := STEP.match(l)) and int(m.group(2)) >= KILL_AFTER and m, timeout=120)
        victims = first.tasks()
        assert len(victims) == WORLD, victims
        os.kill(victims[2], signal.SIGKILL)
        t_kill = time.monotonic()
        mark = len(first.lines)
        rc = first.finish(timeout=60, want_ok=False)
        t_failed = time.monotonic()
        assert rc != 0, f"srun exited 0 after a task was killed:\n{first.tail()}"
        last_before = max((int(m.group(2)) for _, line in first.lines[:mark] if (m := STEP.match(line))), default=0)
        at_fail_ms = time.time() * 1e3

        # The step again, in the same job (as --requeue or the batch script's retry would).
        (tmp / "again").mkdir()
        again = Step(slurm, job, cluster, tmp / "again")
        steps.append(again)
        t_started, _, _ = again.wait_for(STARTED, timeout=60)
        resumed = {}
        i = 0
        while len(resumed) < WORLD:
            t, m, i = again.wait_for(RESUMED, timeout=90, since=i)
            resumed[int(m.group(2))] = dict(t=t, step=int(m.group(4)), level=m.group(5), served_from=m.group(6),
                                            node=m.group(7), load_s=float(m.group(8)), line=i, job=m.group(3))
            i += 1
        at_resume = tt.versions(cluster, job)
        going_on = {}
        for r, info in resumed.items():
            t, _, _ = again.wait_for(lambda l, r=r: (m := STEP.match(l)) and int(m.group(1)) == r and m,
                                     timeout=60, since=info["line"])
            going_on[r] = t - t_kill
        again.finish(timeout=150)
        after = tt.versions(cluster, job)
        (tmp / "srun.out").write_text("\n".join(f"{t - t_kill:+8.3f} {line}" for t, line in first.lines + again.lines))

        log(f"uninterrupted run (sbatch --wait examples/slurm/train.sbatch, job {whole_job}): {STEPS} steps x "
            f"{WORLD} ranks in {whole_s:.1f} s")
        before = {s: v for s, v in at_resume.items() if v["created_unix_ms"] <= at_fail_ms}
        newest = max((s for s, v in before.items() if tt.is_protected(v)), default=0)
        log(f"job {job}: task 2 SIGKILLed after step {last_before} was printed; srun ended the step "
            f"(exit {rc}) {t_failed - t_kill:.2f} s later; the first step's versions: "
            + ", ".join(f"{s} {v['state']}" for s, v in sorted(before.items())))
        for r in sorted(resumed):
            info = resumed[r]
            log(f"rank {r} (job {info['job']}) restored step {info['step']} ({info['level']}) from "
                f"{info['served_from']} through {info['node']} in {info['load_s']:.3f} s; training went on "
                f"{going_on[r]:.2f} s after the kill")
        t_resumed = max(info["t"] for info in resumed.values())
        log(f"kill -> training going on (all ranks): {max(going_on.values()):.2f} s: srun ended the step "
            f"{t_failed - t_kill:.2f} s after the kill, the new step's tasks started {t_started - t_failed:.2f} s "
            f"later, resumed {t_resumed - t_started:.2f} s after that")
        assert {info["job"] for info in resumed.values()} == {job}, resumed
        restored = {info["step"] for info in resumed.values()}
        assert len(restored) == 1, resumed
        step = restored.pop()
        assert step > 0 and step % EVERY == 0 and step <= last_before + EVERY, (step, last_before)
        assert all(info["level"] == "protected" for info in resumed.values()), resumed
        assert step == newest, f"restored step {step}, newest PROTECTED version of the first step {newest}"
        assert tt.is_protected(after[STEPS]), after[STEPS]
        tt.assert_same_final_state(cluster, whole_job, job, WORLD, STEPS)
        log(f"final state (step {STEPS}, every rank: model, optimizer, torch RNG state, data position) "
            "equals the uninterrupted run: yes")

        # The allocation's CPUs back (the requeued job needs all of them).
        slurm.run("scancel", job, timeout=20)
        requeued(slurm, cluster, env, tmp, whole_job, jobs)
    finally:
        for s in steps:
            s.stop()
        for j in jobs:
            try:
                slurm.run("scancel", j, timeout=20)
            except Exception:
                pass
        slurm.stop()
        if cluster is not None:
            cluster.stop()
    left = leftover_processes(tmp)
    assert not left, f"processes of the test still running: {left}"


if __name__ == "__main__":
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-slurm-"))
    os.chmod(tmp, 0o755)
    try:
        main(tmp)
        rc = 0
        log("PASSED")
    except Skip as e:
        log(f"SKIPPED: {e}")
        rc = SKIP
    except BaseException:
        traceback.print_exc()
        rc = 1
        keep = os.environ.get("CKPT_SLURM_KEEP")
        log(f"FAILED (logs in {tmp})" if keep else "FAILED")
    if rc != 1 or not os.environ.get("CKPT_SLURM_KEEP"):
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(rc)
