"""ckpt-meta and ckpt-agents (one by default) for the Python benchmarks
(bench/*.py), from $CKPT_BUILD_DIR/bin (default build/), on free 127.0.0.1
ports, the memory tiers on /dev/shm; stop() kills them by PID and removes the
tiers. running() is the same as a context manager with its own temporary
directory. The daemons run as shipped, with mutual TLS (a CA of their own in
<root>/pki, `ckptctl certs`); this process's trainers (Daemons.client and the
examples a benchmark runs with its environment) present a trainer certificate
for every job through CKPT_TLS_*, set while the daemons run."""
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
from localnet import TLS_VARS, ClusterTls, free_ports, start_daemon, wait_tcp  # noqa: E402

BUILD_DIR = pathlib.Path(os.environ.get("CKPT_BUILD_DIR", "build")).resolve()


def memcpy_seconds(nbytes):
    """The best of three numpy copies of `nbytes` bytes on this machine: the scale benches report against."""
    import numpy as np
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return best


def _scrape(port, name):
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


class Daemons:
    """ckpt-meta and `agents` ckpt-agents (node-1, node-2, ...) on free 127.0.0.1 ports;
    stop() kills them by PID. durable=True gives them a durable root (<root>/durable).
    binary="ckpt-dpu-agent" runs DPU agents instead (node-N serving host-N: pull-mode ingest).
    meta_replicas=N (> 0): N ckpt-meta replicas on an etcd of their own (/usr/bin/etcd) instead of
    one meta; self.meta is then every replica's address ("A,B,C"), self.metas the processes and
    self.meta_ports / self.meta_metrics_ports theirs; leader() says which one leads.
    Sets CKPT_TLS_* of this process to a trainer certificate of the daemons' CA until stop()."""

    def __init__(self, root, memory, name="bench", agent_args=(), agents=1, durable=False, binary="ckpt-agent",
                 meta_replicas=0, replica_lease_ms=2000):
        self.root = root
        self.procs = []
        self.meta_replicas = meta_replicas
        self.replica_lease_ms = replica_lease_ms
        self.shm = pathlib.Path(f"/dev/shm/ckpt-{name}-{os.getpid()}")
        self.tls = ClusterTls(root / "pki", BUILD_DIR / "bin", trainer_name="bench")
        self._saved_env = {k: os.environ.get(k) for k in TLS_VARS}
        os.environ.update(self.tls.trainer_env())
        try:
            self._start_all(memory, name, agent_args, agents, durable, binary)
        except BaseException:
            self.stop()  # what started, and the environment as it was
            raise

    def _start_etcd(self):
        client, peer = free_ports(2)
        self.etcd_endpoint = f"127.0.0.1:{client}"
        self.etcd = start_daemon(pathlib.Path("/usr/bin"), self.root, "etcd", [
            "--data-dir", str(self.root / "etcd"), "--listen-client-urls", f"http://{self.etcd_endpoint}",
            "--advertise-client-urls", f"http://{self.etcd_endpoint}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}", "--initial-cluster", f"default=http://127.0.0.1:{peer}",
            "--heartbeat-interval", "50", "--election-timeout", "500"])
        self.procs.append(self.etcd)
        wait_tcp(client, self.etcd, 30)

    def start_meta_replica(self, i):
        """(Re)starts meta replica i (0-based) on its ports and data dir; returns the process."""
        p = self._start(f"ckpt-meta{i}", [
            "--listen", f"127.0.0.1:{self.meta_ports[i]}", "--metrics-listen",
            f"127.0.0.1:{self.meta_metrics_ports[i]}", "--data-dir", str(self.root / f"meta{i}"),
            "--replica-of", f"etcd://{self.etcd_endpoint}/ckpt/bench", "--replica-lease-ms",
            str(self.replica_lease_ms), "--etcd-plaintext", *self.tls.meta_flags()], binary="ckpt-meta")
        self.metas[i] = p
        return p

    def leader(self):
        """Index of the meta replica whose /readyz is 200, or None."""
        import urllib.error
        import urllib.request
        for i, port in enumerate(self.meta_metrics_ports):
            if self.metas[i].poll() is not None:
                continue
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1).status == 200:
                    return i
            except (urllib.error.URLError, OSError):
                pass
        return None

    def _start_meta(self):
        root = self.root
        if self.meta_replicas == 0:
            meta_port, meta_metrics = free_ports(2)
            self.meta = f"127.0.0.1:{meta_port}"
            self.meta_metrics_port = meta_metrics
            (root / "meta").mkdir()
            meta = self._start("ckpt-meta", ["--listen", self.meta, "--metrics-listen", f"127.0.0.1:{meta_metrics}",
                                             "--data-dir", str(root / "meta"), *self.tls.meta_flags()])
            wait_tcp(meta_port, meta, 30)
            return
        self._start_etcd()
        ports = free_ports(2 * self.meta_replicas)
        self.meta_ports, self.meta_metrics_ports = ports[::2], ports[1::2]
        self.metas = [None] * self.meta_replicas
        for i in range(self.meta_replicas):
            self.start_meta_replica(i)
        self.meta = ",".join(f"127.0.0.1:{p}" for p in self.meta_ports)
        deadline = time.monotonic() + 30
        while self.leader() is None:
            if time.monotonic() > deadline:
                raise RuntimeError("no meta replica became leader in 30 s")
            time.sleep(0.05)
        self.meta_metrics_port = self.meta_metrics_ports[self.leader()]

    def _start_all(self, memory, name, agent_args, agents, durable, binary):
        root = self.root
        self._start_meta()
        ports = [0, 0] + free_ports(3 * agents)
        self.sockets, self.metrics_ports, self.agents = [], [], []
        for i in range(agents):
            suffix = "" if i == 0 else str(i)
            port, data_port, metrics_port = ports[2 + 3 * i: 5 + 3 * i]
            (root / f"run{suffix}").mkdir()
            extra = ["--durable-root", str(root / "durable")] if durable else []
            if binary == "ckpt-dpu-agent":
                extra += ["--host-node", f"host-{i + 1}"]
            agent = self._start(f"ckpt-agent{suffix}", [
                "--node-id", f"node-{i + 1}", "--meta", self.meta, "--listen", f"127.0.0.1:{port}",
                "--data-listen", f"127.0.0.1:{data_port}", "--metrics-listen", f"127.0.0.1:{metrics_port}",
                "--run-dir", str(root / f"run{suffix}"), "--memory", memory,
                "--memory-dir", str(self.shm / f"node-{i + 1}"), "--log-level", "warn",
                *self.tls.node_flags(f"node-{i + 1}", f"host-{i + 1}" if binary == "ckpt-dpu-agent" else None),
                *extra, *agent_args],
                binary=binary)
            wait_tcp(port, agent, 60)
            self.agents.append(agent)
            self.sockets.append(root / f"run{suffix}" / "agent.sock")
            self.metrics_ports.append(metrics_port)
        self.socket = self.sockets[0]
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

    def _start(self, name, args, binary=None):
        p = start_daemon(BUILD_DIR / "bin", self.root, name, args, binary=binary)
        self.procs.append(p)
        return p

    def metric(self, name, agent=None):
        """The value of Prometheus metric `name` (no labels) on one agent, or summed over all."""
        return sum(_scrape(port, name) for i, port in enumerate(self.metrics_ports) if agent is None or i == agent)

    def meta_metric(self, name):
        """The value of meta's metric `name`, labels included as exposed (e.g. 'ckpt_meta_nodes{state="dead"}')."""
        return _scrape(self.meta_metrics_port, name)

    def client(self, job, **kw):
        return ckpt.Client(job=job, rank=0, world_size=1, meta=self.meta, agent_socket=str(self.socket), **kw)

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=30)
        shutil.rmtree(self.shm, ignore_errors=True)
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ucx_perftest_mbps(test, size, iters=10, window=None):
    """MB/s (ucx_perftest's MB: MiB) of `ucx_perftest -t TEST` (ucp_get, tag_bw,
    ...) of `size` bytes on 127.0.0.1 with this process's UCX_* environment, or
    None without ucx_perftest."""
    import re
    import socket
    import subprocess
    exe = shutil.which("ucx_perftest")
    if exe is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    server = subprocess.Popen([exe, "-p", port], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)  # the server's listener (a benchmark, not a test)
        extra = [] if window is None else ["-w", str(window)]
        out = subprocess.run([exe, "127.0.0.1", "-p", port, "-t", test, "-s", str(size), "-n", str(iters), *extra],
                             capture_output=True, text=True, timeout=120).stdout
        m = re.search(r"Final:\s+\d+\s+\S+\s+\S+\s+\S+\s+(\S+)", out)
        return float(m.group(1)) if m else None
    finally:
        server.kill()
        server.wait()


@contextlib.contextmanager
def running(memory, name, agent_args=(), agents=1, durable=False, binary="ckpt-agent", meta_replicas=0,
            replica_lease_ms=2000):
    """Daemons(...) in a fresh temporary directory; stopped and removed on exit."""
    root = pathlib.Path(tempfile.mkdtemp(prefix=f"ckpt-{name}-"))
    d = None
    try:
        d = Daemons(root, memory, name, agent_args=agent_args, agents=agents, durable=durable, binary=binary,
                    meta_replicas=meta_replicas, replica_lease_ms=replica_lease_ms)
        yield d
    finally:
        if d is not None:
            d.stop()
        shutil.rmtree(root, ignore_errors=True)
