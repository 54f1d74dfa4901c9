"""ckpt-meta and one ckpt-agent for the Python benchmarks (bench/*.py), from
$CKPT_BUILD_DIR/bin (default build/), on free 127.0.0.1 ports, the memory tier
on /dev/shm; stop() kills them by PID and removes the tier. running() is the
same as a context manager with its own temporary directory."""
import contextlib
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import time

import ckpt

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "support"))
from localnet import free_ports, start_daemon, wait_tcp  # noqa: E402

BUILD_DIR = pathlib.Path(os.environ.get("CKPT_BUILD_DIR", "build")).resolve()


class Daemons:
    """ckpt-meta and one ckpt-agent on free 127.0.0.1 ports; stop() kills them by PID."""

    def __init__(self, root, memory, name="bench", agent_args=()):
        self.root = root
        self.procs = []
        meta_port, meta_metrics, port, data_port, metrics_port = free_ports(5)
        self.meta = f"127.0.0.1:{meta_port}"
        self.socket = root / "run" / "agent.sock"
        self.shm = pathlib.Path(f"/dev/shm/ckpt-{name}-{os.getpid()}")
        for d in ("meta", "run"):
            (root / d).mkdir()
        meta = self._start("ckpt-meta", ["--listen", self.meta, "--metrics-listen", f"127.0.0.1:{meta_metrics}",
                                         "--data-dir", str(root / "meta")])
        wait_tcp(meta_port, meta, 30)
        agent = self._start("ckpt-agent", [
            "--node-id", "node-1", "--meta", self.meta, "--listen", f"127.0.0.1:{port}",
            "--data-listen", f"127.0.0.1:{data_port}", "--metrics-listen", f"127.0.0.1:{metrics_port}",
            "--run-dir", str(root / "run"), "--memory", memory, "--memory-dir", str(self.shm),
            "--log-level", "warn", *agent_args])
        wait_tcp(port, agent, 60)
        deadline = time.monotonic() + 30
        while True:  # registered with meta once a save goes through
            try:
                c = self.client("ready-probe", connect_timeout=5)
                c.save(1, {"x": b"1"}).wait("staged", timeout=10)
                return
            except ckpt.Error:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def _start(self, name, args):
        p = start_daemon(BUILD_DIR / "bin", self.root, name, args)
        self.procs.append(p)
        return p

    def client(self, job, **kw):
        return ckpt.Client(job=job, rank=0, world_size=1, meta=self.meta, agent_socket=str(self.socket), **kw)

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=30)
        shutil.rmtree(self.shm, ignore_errors=True)


@contextlib.contextmanager
def running(memory, name, agent_args=()):
    """Daemons(...) in a fresh temporary directory; stopped and removed on exit."""
    root = pathlib.Path(tempfile.mkdtemp(prefix=f"ckpt-{name}-"))
    d = None
    try:
        d = Daemons(root, memory, name, agent_args=agent_args)
        yield d
    finally:
        if d is not None:
            d.stop()
        shutil.rmtree(root, ignore_errors=True)
