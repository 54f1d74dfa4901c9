"""Fixtures: a real ckpt-meta and ckpt-agent from $CKPT_BUILD_DIR/bin on free
127.0.0.1 ports with temporary directories, shared by the session and killed
by PID at the end. They run as shipped: mutual TLS with ckpt identities (one CA
for the session, `ckptctl certs`; meta's certificate ckpt://meta, each agent's
ckpt://node/<id>). This process's trainers (ckpt.Client and the examples the
tests run) present a trainer certificate for every job (CKPT_TLS_* in the
environment); Cluster.ctl runs ckptctl with an admin certificate."""
import ctypes
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

import pytest

import ckpt
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "support"))
from localnet import TLS_VARS, ClusterTls, free_ports, wait_tcp  # noqa: E402

BUILD_DIR = pathlib.Path(os.environ.get("CKPT_BUILD_DIR", pathlib.Path(__file__).resolve().parents[2] / "build"))
# The `cluster` agent's memory tier (every test's versions share it).
CLUSTER_MEMORY_MIB = 256


def _die_with_parent():
    # A pytest run killed (timeout, SIGKILL) takes its daemons with it: no
    # orphans holding ports and memory after the session.
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Cluster:
    def __init__(self, root, tls, agents=1, memory=f"{CLUSTER_MEMORY_MIB}MiB", binary="ckpt-agent"):
        self.root = root
        self.tls = tls
        self.procs = []
        ports = free_ports(2 + 3 * agents)  # all at once: separate calls may repeat a port
        meta_port, meta_metrics = ports[0], ports[1]
        self.meta = f"127.0.0.1:{meta_port}"
        self.durable_root = root / "durable"
        for d in ("meta", "durable"):
            (root / d).mkdir()
        meta = self._start("ckpt-meta", [
            "--listen", self.meta, "--metrics-listen", f"127.0.0.1:{meta_metrics}",
            "--data-dir", str(root / "meta"), *tls.meta_flags()])
        wait_tcp(meta_port, meta, 30)
        # Agent i: node-<i+1>, its run dir run<i> (run for the first) and socket.
        self.sockets = []
        self.metrics_ports = []
        self.agents = []  # (name, args, binary, process) of agent i: restart_agent() starts it again
        for i in range(agents):
            suffix = "" if i == 0 else str(i)
            run_dir, mem = root / f"run{suffix}", root / f"mem{suffix}"
            run_dir.mkdir()
            mem.mkdir(mode=0o700)  # the agent refuses a memory dir others may write
            port, data_port, metrics_port = ports[2 + 3 * i: 5 + 3 * i]
            agent = self._start(f"ckpt-agent{suffix}", [
                "--node-id", f"node-{i + 1}", "--meta", self.meta,
                "--listen", f"127.0.0.1:{port}", "--data-listen", f"127.0.0.1:{data_port}",
                "--metrics-listen", f"127.0.0.1:{metrics_port}", "--run-dir", str(run_dir),
                "--memory", memory, "--memory-dir", str(mem),
                "--durable-root", str(self.durable_root),
                *(["--host-node", f"host-{i + 1}"] if binary == "ckpt-dpu-agent" else []),
                *tls.node_flags(f"node-{i + 1}", f"host-{i + 1}" if binary == "ckpt-dpu-agent" else None)],
                binary=binary)
            self.agents.append((f"ckpt-agent{suffix}", agent.args[1:], binary, agent))
            wait_tcp(port, agent, 60)
            self.sockets.append(run_dir / "agent.sock")
            self.metrics_ports.append(metrics_port)
        self.run_dir = root / "run"
        self.socket = self.sockets[0]
        deadline = time.monotonic() + 30
        while not all(s.exists() for s in self.sockets):
            if time.monotonic() > deadline:
                raise RuntimeError("agent socket did not appear:\n" + self.logs())
            time.sleep(0.05)
        # Ready once a save goes through (the agent is registered with meta).
        while True:
            try:
                c = self.client("ready-probe", connect_timeout=5)
                c.save(int(time.time() * 1000), {"x": b"1"}).wait("staged", timeout=10)
                break
            except ckpt.Error:
                if time.monotonic() > deadline:
                    raise RuntimeError("agent never accepted a save:\n" + self.logs())
                time.sleep(0.1)
        # And every agent ALIVE at meta (tests placing replicas need them all; a
        # slow machine or a sanitizer build can register the second one late).
        deadline = time.monotonic() + 60
        while True:
            r = self.ctl("--json", "nodes")
            if r.returncode == 0:
                nodes = json.loads(r.stdout).get("nodes", [])
                if sum(1 for n in nodes if n.get("state") == "alive") >= agents:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"not all {agents} agents ALIVE at meta:\n{r.stdout}{r.stderr}\n" + self.logs())
            time.sleep(0.1)

    def kill_agent(self, i):
        """SIGKILLs agent i (by PID) and reaps it."""
        p = self.agents[i][3]
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)

    def restart_agent(self, i):
        """Starts agent i again with its arguments (as a supervisor would), its log appended to;
        returns once its gRPC port listens."""
        name, args, binary, _ = self.agents[i]
        p = self._start(name, args, binary=binary, append=True)
        self.agents[i] = (name, args, binary, p)
        port = int(args[args.index("--listen") + 1].rsplit(":", 1)[1])
        wait_tcp(port, p, 60)
        return p

    def _start(self, name, args, binary=None, append=False):
        log = open(self.root / f"{name}.log", "ab" if append else "wb")
        p = subprocess.Popen([str(BUILD_DIR / "bin" / (binary or name))] + args, stdout=log,
                             stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        log.close()
        self.procs.append(p)
        return p

    def metric(self, agent, name):
        """The value of metric `name` on agent `agent`'s /metrics (0 if absent)."""
        import urllib.request
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{self.metrics_ports[agent]}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return 0.0

    def logs(self):
        out = []
        for f in sorted(self.root.glob("*.log")):
            out.append(f"== {f.name}\n" + f.read_text(errors="replace")[-4000:])
        return "\n".join(out)

    def client(self, job, rank=0, world_size=1, agent=0, **kw):
        return ckpt.Client(job=job, rank=rank, world_size=world_size, meta=self.meta,
                           agent_socket=str(self.sockets[agent]), **kw)

    def ctl(self, *args):
        """Runs ckptctl against this cluster's meta, as an admin; returns the CompletedProcess."""
        return subprocess.run([str(BUILD_DIR / "bin" / "ckptctl"), "--meta", self.meta] + list(args),
                              capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, **self.tls.admin_env()))

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


@pytest.fixture(scope="session")
def tls(tmp_path_factory):
    """The session's certificates (one CA for every cluster: node-1's certificate serves
    node-1 of each). This process's trainers present a trainer certificate for every job
    (CKPT_TLS_*, put back as they were at the end)."""
    t = ClusterTls(tmp_path_factory.mktemp("pki"), BUILD_DIR / "bin", trainer_jobs=("*",), trainer_name="pytest")
    saved = {k: os.environ.get(k) for k in TLS_VARS}
    os.environ.update(t.trainer_env())
    try:
        yield t
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _running(tmp_path_factory, tls, name, **kw):
    """A Cluster in a fresh directory, stopped (every process it started,
    even if starting failed half way) when the session ends."""
    root = tmp_path_factory.mktemp(name)
    c = Cluster.__new__(Cluster)
    c.procs = []
    try:
        c.__init__(root, tls, **kw)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, tls):
    yield from _running(tmp_path_factory, tls, "ckpt")


@pytest.fixture(scope="session")
def cluster2(tmp_path_factory, tls):
    """Meta and two agents: enough nodes for replicate:2 and ec:1+1."""
    yield from _running(tmp_path_factory, tls, "ckpt2", agents=2, memory="64MiB")


@pytest.fixture(scope="session")
def dpu_cluster(tmp_path_factory, tls):
    """Meta and two ckpt-dpu-agents (pull-mode ingest; docs/dpu.md)."""
    yield from _running(tmp_path_factory, tls, "ckpt-dpu", agents=2, memory="64MiB", binary="ckpt-dpu-agent")


@pytest.fixture
def job():
    """A fresh job id per test."""
    return "py-" + uuid.uuid4().hex[:12]
