"""A launcher (torchrun, srun) run in a session of its own, its output read line by line with
arrival times: the torchrun test (python/tests/test_torchrun.py) and the Slurm test
(tests/launchers/slurm_test.py). A subclass names the processes the launcher started
(children()), which stop() kills with it, by PID."""
import os
import re
import signal
import subprocess
import threading
import time


class Launched:
    name = "launcher"  # in failure messages

    def __init__(self, argv, env, cwd):
        self.lines = []  # (monotonic time, line)
        self.cv = threading.Condition()
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self.cv:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self.cv.notify_all()
        with self.cv:
            self.cv.notify_all()

    def wait_for(self, pattern, timeout, since=0):
        """The first (time, match, index) of `pattern` (a regex or a predicate) in lines[since:],
        waiting up to timeout s; AssertionError with the output's tail otherwise."""
        deadline = time.monotonic() + timeout
        i = since
        with self.cv:
            while True:
                while i < len(self.lines):
                    m = pattern(self.lines[i][1]) if callable(pattern) else re.search(pattern, self.lines[i][1])
                    if m:
                        return self.lines[i][0], m, i
                    i += 1
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self.reader.is_alive()):
                    raise AssertionError(f"no line matching {pattern} in {timeout} s:\n" + self.tail())
                self.cv.wait(min(left, 1.0))

    def tail(self, n=60):
        return "\n".join(line for _, line in self.lines[-n:])

    def children(self):
        """{id: pid} of the processes the launcher started and that run now."""
        return {}

    def finish(self, timeout, want_ok=True):
        """The launcher's exit code (None if it did not end within timeout s); asserts 0 unless
        want_ok is False."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        self.reader.join(timeout=10)
        if want_ok:
            assert rc == 0, f"{self.name} exited {rc}:\n{self.tail()}"
        return rc

    def stop(self):
        """Kills the launcher's session (its process group, by id) and every child it started."""
        if self.proc.poll() is None:
            pids = list(self.children().values())
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait(timeout=30)


def leftover_processes(tmp, but=()):
    """Processes (but this one, and those whose command line holds a string of `but`) with `tmp`
    on their command line: what a test started there and did not stop."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if int(pid) != os.getpid() and str(tmp).encode() in cmd and not any(b.encode() in cmd for b in but):
            left.append(f"{pid}: {cmd.replace(bytes(1), b' ').decode(errors='replace')[:120]}")
    return left


def final_states(cluster, job, world, step):
    """{rank: the state each of `world` ranks saved at `step`}, loaded through the cluster."""
    out = {}
    for r in range(world):
        c = cluster.client(job, rank=r, world_size=world)
        out[r] = c.load(step)
        del c
    return out


def example_runner(example):
    """A Python script that runs `example` (a path) unchanged, with its arguments, after printing
    "worker started" and sending the Checkpointer's log lines (logger "ckpt") to stdout."""
    return f"""
import logging, runpy, sys
print("worker started", flush=True)
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(logging.Formatter("%(message)s"))
logging.getLogger("ckpt").addHandler(handler)
logging.getLogger("ckpt").setLevel(logging.INFO)
sys.argv = [{str(example)!r}] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
