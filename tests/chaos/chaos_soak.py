#!/usr/bin/env python3
"""Chaos soak for a whole ckpt cluster (issue 12, "A chaos soak").

Starts ckpt-meta and N ckpt-agents (4..6) on 127.0.0.1 (free ports, state in a
temp dir, memory tiers under /dev/shm, UCX data plane over TCP, short peer
timeouts and meta lease; mutual TLS as shipped, with a CA of the soak's own made
by `ckptctl certs`: the soak's clients present a trainer certificate, its
ckptctl calls an admin one), then, for --duration seconds, loops:

  1. clients (the Python `ckpt` module, one per rank) save a version of every
     rank of every job (replicate ring, replicate group, EC with m = 2, and a
     replicated job flushed to the durable tier), seeded random sizes including
     awkward ones (0 and 1 byte, 4 KiB +- 1, 4 MiB +- 1, 8/12/16 MiB +- 1, a few
     tens of MiB), and wait until meta says PROTECTED;
  2. injects one fault chosen at random (seeded): kill -9 of an agent (restarted
     on the same dirs and ports at once, after meta declares it dead, or after
     re-protection), kill -9 of meta (restarted; optionally while a save is being
     protected), SIGSTOP of an agent for longer than the peer timeout (shorter or
     longer than the meta lease) with restores running while it is stopped,
     kill -9 of two agents (only tolerated by the m = 2 EC job), a full durable
     disk (a small tmpfs filled with a filler file);
  3. restores every rank of the newest PROTECTED version of every job, during
     the fault where it makes sense and again after healing, through the client
     (from the rank's own agent, or another one) and through `ckptctl restore`,
     and compares every byte with what was saved; reads the newest PERSISTED
     version from the durable tier with ckpt.read_durable;
  4. heals: every daemon back, every node ALIVE, every PROTECTED version back to
     PROTECTED, flush caught up; audits meta's view of every version it saw
     PROTECTED.
Every --mem-every faults (and at the end) it runs a memory checkpoint: as many
healthy saves of fixed sizes as the jobs keep in memory, so that retention
evicts every older version (and everything faults left behind), waits until the
cluster is quiet and compares each agent's ckpt_agent_memory_used_bytes (less the
leases clients asked for ahead of their next save) and
ckpt_agent_holdings with the first checkpoint (same plan, same sizes: same
bytes).

Failures (any makes the exit status 1): wrong bytes returned by a restore; a
version seen PROTECTED that is lost (aborted, forgotten, or a restore of it fails
after healing) while at most copies-1 (replicate) or m (EC) agents were down
since it was saved; a PROTECTED version whose state moved back (rollback); a
restore that fails while within tolerance; daemon crashes (unexpected exit,
sanitizer or assertion reports in a log; a non-zero exit or a hang on SIGTERM at
the end); memory growth across retention cycles; saves that fail or never reach
PROTECTED on a healthy cluster; versions not re-protected after healing.

docs/testing.md has the details (rules, memory tolerance, output, self-checks).

  /usr/bin/python3 tests/chaos/chaos_soak.py --duration 180 --seed 1 --nodes 4
  /usr/bin/python3 tests/chaos/chaos_soak.py --duration 1800 --seed 7 --nodes 6 --keep

Prints a summary table and a JSON summary (also in <logs>/summary.json); on any
failure the logs are kept and the command to reproduce is printed. Exit 0 pass,
1 failure, 2 usage error, 77 skipped (binaries or the Python module not built),
130 interrupted. Every process it starts runs in its own process group with
PR_SET_PDEATHSIG(SIGKILL) (via setpriv) and is killed by PID on exit, Ctrl-C or
failure.

The full-disk fault needs a small tmpfs: the soak re-executes itself in a
private mount namespace (`unshare --mount`, or `--user --map-root-user --mount`
when not root) and mounts one there; where neither works it skips that fault
and says so.
"""

import argparse
import collections
import concurrent.futures
import json
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "support"))
from localnet import ClusterTls, free_ports  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
ROOT = pathlib.Path(__file__).resolve().parents[2]
NS_ENV = "CKPT_CHAOS_IN_NAMESPACE"

# Log lines that mean a daemon died badly even if its exit status is hidden.
CRASH_PATTERNS = [
    re.compile(p) for p in (
        r"ERROR: AddressSanitizer", r"ERROR: LeakSanitizer", r"WARNING: ThreadSanitizer",
        r"UndefinedBehaviorSanitizer", r":\d+:\d+: runtime error: ", r"Assertion `.*' failed",
        r"terminate called", r"\*\*\* (stack smashing|buffer overflow) detected",
        r"double free or corruption", r"free\(\): invalid", r"malloc\(\): ", r"Segmentation fault",
        r"pure virtual method called")
]


# Failure kinds the summary always lists (wrong_bytes counts bytes, the others events).
# Fault kinds and their weights after the first rounds (which run each kind once, in a
# seeded order, so every run, CI's 3 minutes included, has all of them).
FAULT_WEIGHTS = {"kill_agent": 3, "kill_meta": 2, "stop_agent": 3, "kill_two_agents": 1, "disk_full": 1}

MAIN_FAILURES = ["lost_protected", "rollback", "daemon_crash", "memory_growth", "restore_failed",
                 "save_failed_healthy", "not_reprotected"]
FAILURE_TITLES = {
    "wrong_bytes": "wrong bytes returned",
    "lost_protected": "PROTECTED versions lost",
    "rollback": "PROTECTED state rolled back",
    "daemon_crash": "daemon crashes",
    "memory_growth": "memory growth after retention",
    "restore_failed": "restores failed (in tolerance)",
    "save_failed_healthy": "healthy saves failed",
    "not_reprotected": "not re-protected in time",
}


def now():
    return time.monotonic()


def parse_size(text):
    m = re.fullmatch(r"(\d+)\s*(B|KiB|MiB|GiB)?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 640MiB)")
    return int(m.group(1)) * {None: 1, "B": 1, "KiB": KiB, "MiB": MiB, "GiB": 1 << 30}[m.group(2)]


def fmt_bytes(n):
    for unit, f in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= f:
            return f"{n / f:.1f} {unit}"
    return f"{n} B"


def http_get(port, path, timeout=2.0):
    """(status, body) of GET http://127.0.0.1:port/path; (None, error) if unreachable."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, urllib.error.URLError) as e:
        return None, str(e)


def parse_metrics(text):
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m:
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return out


# ---------------------------------------------------------------------------
# Processes


class Daemon:
    """One daemon process, restartable on the same argv (ports, dirs). Started only
    from the main thread (PR_SET_PDEATHSIG is tied to the thread that forks)."""

    def __init__(self, name, argv, log_path, env, prefix):
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = env
        self.prefix = prefix
        self.proc = None
        self.starts = 0
        self.lock = threading.Lock()
        self.expect_exit = False   # set before we signal it to die
        self.stopped = False       # SIGSTOPped by us
        self.exited = False        # reaped (by the monitor or by us)
        self.log_offset = 0        # where the current run's log starts

    def start(self):
        assert threading.current_thread() is threading.main_thread()
        with open(self.log_path, "ab") as f:
            self.log_offset = f.tell()
            f.write(f"=== chaos: start #{self.starts + 1} of {self.name} at {time.strftime('%H:%M:%S')}\n"
                    .encode())
        log = open(self.log_path, "ab")
        try:
            proc = subprocess.Popen(self.prefix + self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        finally:
            log.close()
        with self.lock:
            self.proc = proc
            self.starts += 1
            self.expect_exit = False
            self.stopped = False
            self.exited = False

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    def running(self):
        with self.lock:
            return self.proc is not None and not self.exited

    def send(self, sig, expect_exit):
        """Signals the process by PID while it is unreaped. Returns False if it had
        already exited (then the caller learns it crashed)."""
        with self.lock:
            if self.proc is None or self.exited or self.proc.poll() is not None:
                return False
            if expect_exit:
                self.expect_exit = True
            self.proc.send_signal(sig)
            if sig == signal.SIGSTOP:
                self.stopped = True
            elif sig == signal.SIGCONT:
                self.stopped = False
            return True

    def wait(self, timeout):
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        return rc

    def log_tail(self, n=40, whole_run=True):
        try:
            with open(self.log_path, "rb") as f:
                if whole_run:
                    f.seek(self.log_offset)
                data = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(data.splitlines()[-n:])

    def log_since(self, offset=0):
        """The log from byte `offset` on ("" if it cannot be read)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stepped_down(self, offset=0):
        """True if the log says this meta replica lost the leadership (its designed exit)."""
        return "lost the leadership" in self.log_since(offset)

    def crash_lines(self, offset=0):
        return [l for l in self.log_since(offset).splitlines() if any(p.search(l) for p in CRASH_PATTERNS)]


# ---------------------------------------------------------------------------
# Jobs and versions


class Job:
    def __init__(self, name, idx, world, protection, ctl_flags, tolerance, flush=False, large=True,
                 width=0):
        self.name = name
        # Nodes the protection needs to survive `tolerance` losses (an EC stripe's
        # k+m): with fewer up, meta keeps the version DEGRADED, not PROTECTED.
        self.width = width
        self.idx = idx
        self.world = world
        self.protection = protection   # Python client spelling
        self.ctl_flags = ctl_flags     # ckptctl create-job flags
        self.tolerance = tolerance     # agents that may be down at once without loss
        self.flush = flush
        self.large = large
        self.keep = 2
        self.next_step = 1
        self.records = collections.OrderedDict()  # step -> Version


class Version:
    """One step of one job as the soak saved it. status: saving, pending (every rank
    committed, not yet seen PROTECTED), protected, abandoned (a rank's save failed or
    it was aborted before it was protected; deleted by the soak), retired (evicted
    by retention), lost, exempt_lost (lost with more agents down than tolerated)."""

    def __init__(self, job, step, sizes, via, kind):
        self.job = job
        self.step = step
        self.sizes = sizes
        self.via = via
        self.kind = kind
        self.t_start = now()
        self.committed = set()
        self.errors = {}
        self.status = "saving"
        self.protected_at = None
        self.rolled_back = False
        self.detail = ""

    @property
    def key(self):
        return f"{self.job.name}/{self.step}"

    def total_bytes(self):
        return sum(self.sizes)


def payload(seed, job, step, rank, size):
    import numpy as np
    if size == 0:
        return np.zeros(0, np.uint8)
    rng = np.random.Generator(np.random.PCG64([seed, job.idx, step, rank]))
    return np.frombuffer(rng.bytes(size), dtype=np.uint8)


def tag(job, step, rank):
    return f"{job.name}/{step}/rank-{rank}".encode()


def frozen(seed, job, rank):
    """An item every save of (job, rank) has, unchanged (a frozen parameter): most saves
    declare it so (issue 15), and it is stored as a reference to the previous save's."""
    import numpy as np
    size = (1 << 20) + 1 + 4096 * rank
    rng = np.random.Generator(np.random.PCG64([seed, job.idx, 1 << 40, rank]))
    return np.frombuffer(rng.bytes(size), dtype=np.uint8)


# ---------------------------------------------------------------------------
# The soak


class Failure(Exception):
    pass


class Soak:
    def __init__(self, args):
        self.args = args
        self.seed = args.seed
        # Separate streams: fault choices (main thread), sizes, restore routes.
        self.rng = random.Random(f"faults-{args.seed}")
        self.rng_sizes = random.Random(f"sizes-{args.seed}")
        self.rng_routes = random.Random(f"routes-{args.seed}")
        self.rng_lock = threading.Lock()
        self.counts_lock = threading.Lock()
        self.n = args.nodes
        self.build = pathlib.Path(args.build_dir).resolve()
        self.bin = self.build / "bin"
        self.t0 = now()
        self.work = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-chaos-", dir=os.environ.get("TMPDIR", "/tmp")))
        self.shm = pathlib.Path(f"/dev/shm/ckpt-chaos-{os.getpid()}")
        self.durable = self.work / "durable"
        self.durable_mounted = False
        self.disk_full_reason = ""
        self.filler = None
        self.log_file = open(self.work / "soak.log", "a")
        self.log_lock = threading.Lock()
        self.tls = threading.local()
        self.certs = None  # ClusterTls, made by start_cluster
        self.failures = []
        self.counts = collections.Counter()
        self.faults = collections.Counter()
        self.faults_excluded = {}  # kind -> why it does not run (run() fills it)
        self.served_from = collections.Counter()
        self.restore_ms = {"during_fault": [], "healthy": []}
        self.down = []            # [node, start, end or None]
        self.down_lock = threading.Lock()
        self.meta = None          # the meta (with --meta-replicas: the one that led last we looked)
        self.metas = []           # every meta replica (one without --meta-replicas)
        self.etcd = None
        self.agents = []
        self.clients = {}
        self.clients_lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="soak")
        self.baseline = None
        self.baseline_holdings = None
        self.last_extras = {}
        self.mem_reported = {}    # node -> (used, holdings) already reported as growth
        self.stuck_reported = set()  # "job/step" of PROTECTED versions reported not re-protected
        self.mem_checks = []
        self.mem_series_path = self.work / "memory.csv"
        self.stop_monitor = threading.Event()
        self.monitor_thread = None
        self.crashes = []
        self.stepdowns = []  # meta replicas that lost their etcd lease and exited (by design)
        self.disk_full_active = False
        self.ckptctl_restores = 0
        self.durable_reads = 0
        self.interrupted = False
        self.large_left = 0
        self.sabotaged = False

    # ---- logging and failures
    def log(self, msg, echo=True):
        line = f"[{now() - self.t0:7.1f}s] {msg}"
        with self.log_lock:
            self.log_file.write(line + "\n")
            self.log_file.flush()
            if echo:
                print(line, flush=True)

    def inc(self, key, n=1):
        with self.counts_lock:
            self.counts[key] += n

    def fail(self, kind, detail):
        self.failures.append({"kind": kind, "t_s": round(now() - self.t0, 1), "detail": detail})
        self.log(f"FAIL [{kind}] {detail}")

    # ---- down-time bookkeeping (for "within tolerance")
    def mark_down(self, node):
        with self.down_lock:
            self.down.append([node, now(), None])

    def mark_up(self, node):
        with self.down_lock:
            for d in self.down:
                if d[0] == node and d[2] is None:
                    d[2] = now()

    def down_nodes(self):
        with self.down_lock:
            return {d[0] for d in self.down if d[2] is None}

    def max_down_since(self, t_from):
        """Most agents down at the same time between t_from and now (intervals that
        merely touch count as overlapping: errs towards calling a loss exempt)."""
        t_to = now()
        events = []
        with self.down_lock:
            for node, s, e in self.down:
                e = t_to if e is None else e
                if e < t_from or s > t_to:
                    continue
                events.append((max(s, t_from), 0, 1))
                events.append((e, 1, -1))
        events.sort()
        cur = best = 0
        for _, _, d in events:
            cur += d
            best = max(best, cur)
        return best

    # ---- environment
    def daemon_env(self):
        env = {k: v for k, v in os.environ.items()
               if k not in ("LD_PRELOAD", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                            "grpc_proxy", "all_proxy", "ALL_PROXY")}
        env["no_proxy"] = env["NO_PROXY"] = "127.0.0.1,localhost"
        if self.args.ucx_tls:
            env["UCX_TLS"] = self.args.ucx_tls
        return env

    def ctl_env(self):
        """ckptctl's environment: the daemons', with an admin certificate (CKPT_TLS_*)."""
        return dict(self.daemon_env(), **(self.certs.admin_env() if self.certs else {}))

    def setup_durable(self):
        self.durable.mkdir()
        size = self.args.durable_size
        if os.environ.get(NS_ENV) != "1":
            self.disk_full_reason = "not in a private mount namespace (unshare unavailable)"
            return
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "ckpt-chaos-durable",
                            str(self.durable)], capture_output=True, text=True)
        if r.returncode != 0:
            self.disk_full_reason = f"cannot mount a tmpfs: {r.stderr.strip()}"
            return
        self.durable_mounted = True

    # ---- cluster
    def remove_stale_tiers(self):
        """Memory tiers left by soaks that were SIGKILLed (their dir names carry the
        soak's PID; only dirs whose PID is gone are removed)."""
        for d in pathlib.Path("/dev/shm").glob("ckpt-chaos-*"):
            pid = d.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not pathlib.Path(f"/proc/{pid}").exists():
                shutil.rmtree(d, ignore_errors=True)
                self.log(f"removed the stale memory tiers {d}", echo=False)

    def start_cluster(self):
        self.remove_stale_tiers()
        self.shm.mkdir(parents=True)
        self.setup_durable()
        prefix = []
        if shutil.which("setpriv"):
            prefix = ["setpriv", "--pdeathsig", "KILL", "--"]
        env = self.daemon_env()
        a = self.args
        # The cluster's certificates (the daemons serve mutual TLS, as shipped); this
        # process's clients present a trainer certificate for every job.
        self.certs = ClusterTls(self.work / "pki", self.bin, trainer_name="chaos")
        os.environ.update(self.certs.trainer_env())
        self.certs.admin_env()  # issued now: ckptctl runs on several threads
        # Every port at once: ports picked in separate calls may repeat (a port
        # handed to one agent is free until that agent binds it).
        ports = free_ports(2 + 3 * self.n)
        self.start_metas(ports[0], ports[1], env, prefix)
        for i in range(self.n):
            node = f"n{i}"
            port, data_port, metrics = ports[2 + 3 * i: 5 + 3 * i]
            (self.work / node / "run").mkdir(parents=True)
            (self.shm / node).mkdir(mode=0o700)  # the agent refuses a memory dir others may write
            # The last --dpu nodes run ckpt-dpu-agent (pull-mode ingest, docs/dpu.md),
            # each serving a host of its own.
            dpu = i >= self.n - a.dpu
            binary = "ckpt-dpu-agent" if dpu else "ckpt-agent"
            d = Daemon(node, [str(self.bin / binary), "--node-id", node, "--meta", self.meta_addr,
                              "--listen", f"127.0.0.1:{port}", "--data-listen", f"127.0.0.1:{data_port}",
                              "--metrics-listen", f"127.0.0.1:{metrics}",
                              "--run-dir", str(self.work / node / "run"),
                              "--memory", str(a.agent_memory), "--memory-dir", str(self.shm / node),
                              "--durable-root", str(self.durable), "--peer-timeout-ms", str(a.peer_timeout_ms),
                              "--data-chunk", "1MiB", "--rpc-timeout-ms", "5000",
                              *(["--host-node", f"host-{node}"] if dpu else []),
                              *self.certs.node_flags(node, f"host-{node}" if dpu else None)],
                       self.work / f"{node}.log", env, prefix)
            d.port, d.metrics_port, d.index = port, metrics, i
            d.socket = self.work / node / "run" / "agent.sock"
            self.agents.append(d)
            d.start()
        for d in self.agents:
            self.wait_agent_ready(d, 90)
        self.wait_nodes_alive(60)
        self.monitor_thread = threading.Thread(target=self.monitor, name="monitor", daemon=True)
        self.monitor_thread.start()

    def start_metas(self, meta_port, meta_metrics, env, prefix):
        """One ckpt-meta, or --meta-replicas replicas on an etcd of their own (--replica-of):
        then self.meta_addr lists them all and self.meta is the leader."""
        a = self.args
        common = ["--lease-ms", str(a.lease_ms), "--heartbeat-ms", str(a.heartbeat_ms), *self.certs.meta_flags()]
        if a.meta_replicas == 0:
            self.meta_addr = f"127.0.0.1:{meta_port}"
            self.meta_port = meta_port
            self.meta = Daemon("meta", [str(self.bin / "ckpt-meta"), "--listen", self.meta_addr,
                                        "--metrics-listen", f"127.0.0.1:{meta_metrics}",
                                        "--data-dir", str(self.work / "meta"), *common],
                               self.work / "meta.log", env, prefix)
            self.meta.metrics_port = meta_metrics
            self.metas = [self.meta]
            self.meta.start()
            self.wait_port(meta_port, self.meta, 30)
            return
        client, peer, *replica_ports = free_ports(2 + 2 * a.meta_replicas)
        endpoint = f"127.0.0.1:{client}"
        self.etcd = Daemon("etcd", ["/usr/bin/etcd", "--data-dir", str(self.work / "etcd"),
                                    "--listen-client-urls", f"http://{endpoint}", "--advertise-client-urls",
                                    f"http://{endpoint}", "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                                    "--initial-cluster", f"default=http://127.0.0.1:{peer}",
                                    "--heartbeat-interval", "50", "--election-timeout", "500"],
                           self.work / "etcd.log", env, prefix)
        self.etcd.start()
        self.wait_port(client, self.etcd, 30)
        addrs = []
        for i in range(a.meta_replicas):
            port, metrics = replica_ports[2 * i], replica_ports[2 * i + 1]
            addrs.append(f"127.0.0.1:{port}")
            d = Daemon(f"meta{i}", [str(self.bin / "ckpt-meta"), "--listen", addrs[-1],
                                    "--metrics-listen", f"127.0.0.1:{metrics}",
                                    "--data-dir", str(self.work / f"meta{i}"),
                                    "--replica-of", f"etcd://{endpoint}/ckpt/chaos",
                                    "--etcd-plaintext", *common],
                       self.work / f"meta{i}.log", env, prefix)
            d.metrics_port, d.port = metrics, port
            self.metas.append(d)
            d.start()
        self.meta_addr = ",".join(addrs)
        self.meta = self.wait_meta_leader(30)
        if self.meta is None:
            raise RuntimeError("no meta replica became leader in 30 s")

    def meta_leader(self):
        """The meta replica whose /readyz says ready, or None."""
        for d in self.metas:
            if d.running() and http_get(d.metrics_port, "/readyz", 1.0)[0] == 200:
                return d
        return None

    def wait_meta_leader(self, timeout):
        deadline = now() + timeout
        while now() < deadline:
            d = self.meta_leader()
            if d is not None:
                return d
            time.sleep(0.05)
        return None

    def wait_port(self, port, daemon, timeout):
        deadline = now() + timeout
        while now() < deadline:
            if not daemon.running() or daemon.proc.poll() is not None:
                raise Failure(f"{daemon.name} exited during start-up:\n{daemon.log_tail()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise Failure(f"{daemon.name}: port {port} not listening after {timeout} s:\n{daemon.log_tail()}")

    def wait_agent_ready(self, d, timeout):
        """Until /readyz says the agent is registered with meta."""
        self.wait_port(d.port, d, timeout)
        deadline = now() + timeout
        while now() < deadline:
            st, body = http_get(d.metrics_port, "/readyz")
            if st == 200:
                return True
            if not d.running():
                return False
            time.sleep(0.1)
        return False

    def ctl(self, *args, timeout=30, check=True):
        """Runs ckptctl --json ARGS; returns the parsed document or None on failure."""
        cmd = [str(self.bin / "ckptctl"), "--meta", self.meta_addr, "--json", "--timeout", str(timeout)] + \
            [str(a) for a in args]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30,
                               env=self.ctl_env())
        except subprocess.TimeoutExpired:
            self.log(f"ckptctl {' '.join(map(str, args))}: timed out", echo=False)
            self.tls.ctl_error = "ckptctl timed out"
            return None
        if r.returncode != 0:
            if check:
                self.log(f"ckptctl {' '.join(map(str, args))}: exit {r.returncode}: {r.stderr.strip()[:300]}",
                         echo=False)
            self.tls.ctl_error = r.stderr.strip()
            return None
        try:
            return json.loads(r.stdout)
        except ValueError:
            return None

    def ctl_error(self):
        """stderr of this thread's last failed ckptctl call."""
        return getattr(self.tls, "ctl_error", "")

    def node_states(self):
        d = self.ctl("nodes", timeout=5, check=False)
        if d is None:
            return None
        return {n["id"]: n["state"].lower() for n in d["nodes"]}

    def wait_nodes_alive(self, timeout):
        deadline = now() + timeout
        states = None
        while now() < deadline:
            states = self.node_states()
            if states and all(states.get(d.name) == "alive" for d in self.agents):
                return True
            time.sleep(0.25)
        self.log(f"nodes not all alive after {timeout} s: {states}")
        return False

    def wait_node_state(self, node, want, timeout):
        deadline = now() + timeout
        while now() < deadline:
            states = self.node_states()
            if states and states.get(node) == want:
                return True
            time.sleep(0.2)
        return False

    # ---- the monitor thread: exits and memory
    def monitor(self):
        with open(self.mem_series_path, "w") as series:
            series.write("t_s,node,memory_used_bytes,holdings,flush_errors_total,peer_errors_total\n")
            last_sample = 0.0
            while not self.stop_monitor.is_set():
                for d in self.metas + ([self.etcd] if self.etcd else []) + self.agents:
                    self.check_exit(d)
                if now() - last_sample >= 1.0:
                    last_sample = now()
                    for d in self.agents:
                        if d.stopped or not d.running():
                            continue
                        m = self.agent_metrics(d, timeout=1.0)
                        if m:
                            cols = [int(m.get(k, -1)) for k in (
                                "ckpt_agent_memory_used_bytes", "ckpt_agent_holdings",
                                "ckpt_agent_flush_errors_total", "ckpt_agent_peer_errors_total")]
                            series.write(f"{now() - self.t0:.1f},{d.name}," + ",".join(map(str, cols)) + "\n")
                    series.flush()
                self.stop_monitor.wait(0.2)

    def check_exit(self, d):
        """Reaps an exited daemon; an exit we did not cause is a crash."""
        with d.lock:
            if d.proc is None or d.exited:
                return
            rc = d.proc.poll()
            if rc is None:
                return
            d.exited = True
            expected = d.expect_exit
            offset = d.log_offset
        bad = d.crash_lines(offset)
        if not expected and not bad and rc == 1 and d in self.metas and d.stepped_down(offset):
            # A leader that lost its etcd lease exits by design, for its supervisor to start
            # it again as a follower (docs/meta.md "Replicas"): counted, not a crash; the
            # next heal restarts it, and the checks still hold every version to its level.
            self.stepdowns.append({"daemon": d.name, "pid": d.proc.pid, "log": str(d.log_path)})
            self.log(f"meta replica {d.name} (pid {d.proc.pid}) stepped down: it lost its etcd lease and "
                     "exited, as designed; restarted at the next heal")
            return
        if not expected or bad:
            how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
            self.crashes.append({"daemon": d.name, "pid": d.proc.pid, "how": how, "expected_exit": expected,
                                 "log": str(d.log_path), "lines": bad[:10]})
            self.fail("daemon_crash", f"{d.name} (pid {d.proc.pid}) {how}"
                      f"{' after our signal, with crash reports' if expected else ' unexpectedly'}; "
                      f"log {d.log_path}:\n" + "\n".join(bad[:10] or d.log_tail(25).splitlines()))
            if not expected and d not in self.metas and d is not self.etcd:
                self.mark_down(d.name)

    def agent_metrics(self, d, timeout=2.0):
        st, body = http_get(d.metrics_port, "/metrics", timeout)
        if st != 200:
            return None
        return parse_metrics(body)

    # ---- fault primitives (main thread)
    def kill_agent(self, d):
        if not d.send(signal.SIGKILL, expect_exit=True):
            self.check_exit(d)
            return
        d.wait(30)
        self.check_exit(d)
        self.mark_down(d.name)
        self.forget_clients(d.name)

    def restart_agent(self, d):
        self.check_exit(d)
        if d.running():
            return True
        d.start()
        self.forget_clients(d.name)
        ok = self.wait_agent_ready(d, 90)
        self.mark_up(d.name)
        if not ok:
            self.fail("restart_failed", f"{d.name} not registered 90 s after restart; log {d.log_path}:\n"
                      f"{d.log_tail(20)}")
        return ok

    def stop_agent(self, d):
        if d.send(signal.SIGSTOP, expect_exit=False):
            self.mark_down(d.name)

    def cont_agent(self, d):
        if d.send(signal.SIGCONT, expect_exit=False):
            self.mark_up(d.name)

    def kill_meta(self):
        """kill -9 of meta; with replicas, of the one leading."""
        if self.etcd is not None:
            self.meta = self.meta_leader() or self.meta
        if self.meta.send(signal.SIGKILL, expect_exit=True):
            self.meta.wait(30)
        self.check_exit(self.meta)

    def restart_meta(self):
        """Starts every meta that is down; with replicas, then waits until one leads."""
        for d in self.metas:
            self.check_exit(d)
            if d.running():
                continue
            d.start()
            if self.etcd is None:
                self.wait_port(self.meta_port, d, 60)
        if self.etcd is not None:
            leader = self.wait_meta_leader(60)
            if leader is None:
                self.fail("restart_failed", "no meta replica leads 60 s after a restart")
            else:
                self.meta = leader

    def revive_all(self):
        """Brings back every daemon that is down, whatever the reason."""
        if not all(d.running() for d in self.metas):
            self.restart_meta()
        for d in self.agents:
            if d.stopped:
                self.cont_agent(d)
            if not d.running():
                self.restart_agent(d)

    # ---- clients
    def client(self, job, rank, node):
        import ckpt
        d = self.agents[node]
        key = (job.name, rank, node, d.starts)
        with self.clients_lock:
            c = self.clients.get(key)
        if c is not None:
            return c
        c = ckpt.Client(job=job.name, rank=rank, world_size=job.world, meta=self.meta_addr,
                        agent_socket=str(d.socket), protection=job.protection,
                        connect_timeout=15.0, rpc_timeout=20.0, load_timeout=self.args.load_timeout)
        with self.clients_lock:
            self.clients[key] = c
        return c

    def forget_clients(self, node_name):
        with self.clients_lock:
            for k in [k for k in self.clients if f"n{k[2]}" == node_name]:
                del self.clients[k]

    def route(self, rank, down):
        """The node a rank's trainer uses: its home node (rank mod N), else the next up one."""
        home = rank % self.n
        for i in range(self.n):
            node = (home + i) % self.n
            if f"n{node}" not in down:
                return node
        raise Failure("no agent is up")

    # ---- jobs
    def make_jobs(self):
        n = self.n
        grp_copies = 3 if n >= 6 else 2
        k = n - 2
        self.jobs = [
            Job("ring", 0, n, "replicate:2:ring", ["--replicate", 2, "--placement", "ring"], 1),
            Job("grp", 1, n, f"replicate:{grp_copies}:group",
                ["--replicate", grp_copies, "--placement", "group"], grp_copies - 1),
            Job("ec", 2, 2 * n, f"ec:{k}+2", ["--ec", f"{k}+2"], 2, width=k + 2),
            Job("flush", 3, n, "replicate:2:ring", ["--replicate", 2, "--placement", "ring",
                                                    "--flush-every", 1, "--keep-durable", 2], 1,
                flush=True, large=False),
        ]
        for j in self.jobs:
            d = self.ctl("create-job", j.name, "--world-size", j.world, *j.ctl_flags, "--keep-in-memory", j.keep)
            if d is None:
                raise Failure(f"create-job {j.name} failed: {self.ctl_error()}")
        # Checkpoint sizes: fixed per (job, rank), awkward ones included, one large.
        self.fixed_sizes = {}
        rng = self.rng_sizes
        big = (rng.choice([j for j in self.jobs if j.large]).name, rng.randrange(self.n))
        for j in self.jobs:
            self.fixed_sizes[j.name] = [
                rng.randint(20 * MiB, 36 * MiB) if (j.name, r) == big else
                rng.choice([0, 1, 4095, 4097, 4 * MiB - 1, 4 * MiB + 1, 3 * MiB + 12345, 777777,
                            8 * MiB + 1, 12 * MiB - 1])
                for r in range(j.world)]
        self.log("jobs: " + ", ".join(f"{j.name} ({j.protection}, {j.world} ranks, tolerates {j.tolerance} "
                                      f"down{', flushed' if j.flush else ''})" for j in self.jobs))

    def draw_size(self, job):
        rng = self.rng_sizes
        r = rng.random()
        if r < 0.2:
            return rng.choice([0, 1, 7, 4095, 4096, 4097, rng.randint(2, 64 * KiB)])
        if r < 0.45:
            return 4 * MiB + rng.choice([-1, 0, 1])
        if r < 0.8:
            return rng.randint(64 * KiB, 6 * MiB)
        if r < 0.92 or not job.large or self.large_left <= 0:
            # Around the client's parallel-copy threshold and multiples of its
            # 64 KiB parts (8 MiB + 1 once lost its last byte).
            return rng.choice([8, 12, 16]) * MiB + rng.choice([-1, 0, 1, 64 * KiB + 1])
        self.large_left -= 1
        return rng.randint(20 * MiB, 36 * MiB)

    # ---- saving
    def save_round(self, kind, wait_timeout=None):
        """Saves one version of every job (all ranks) and waits for PROTECTED.
        kind: healthy | checkpoint | fault. Returns the versions."""
        wait_timeout = wait_timeout or self.args.protect_timeout
        down = self.down_nodes()
        self.large_left = 1
        versions = []
        for job in self.jobs:
            step = job.next_step
            job.next_step += 1
            sizes = list(self.fixed_sizes[job.name]) if kind == "checkpoint" else \
                [self.draw_size(job) for _ in range(job.world)]
            v = Version(job, step, sizes, [self.route(r, down) for r in range(job.world)], kind)
            job.records[step] = v
            versions.append(v)
        futs = [(v, r, self.pool.submit(self.save_rank, v, r)) for v in versions for r in range(v.job.world)]
        for v, r, f in futs:
            err = f.result()
            if err is None:
                v.committed.add(r)
            else:
                v.errors[r] = err
        waits = []
        for v in versions:
            if len(v.committed) == v.job.world:
                v.status = "pending"
                waits.append((v, self.pool.submit(self.wait_protected, v, wait_timeout)))
            else:
                v.status = "abandoned"
                v.detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(v.errors.items()))
        for v, f in waits:
            f.result()
        self.inc("versions_saved", len(versions))
        self.inc("shards_committed", sum(len(v.committed) for v in versions))
        self.inc("bytes_saved", sum(v.sizes[r] for v in versions for r in v.committed))
        healthy = kind in ("healthy", "checkpoint") and not self.disk_full_active
        for v in versions:
            if v.status == "protected":
                continue
            why = v.detail or f"not PROTECTED within {wait_timeout} s"
            what = f"{v.key} ({kind} save): {v.status}: {why}"
            if healthy or (kind == "fault" and self.disk_full_active):
                self.fail("save_failed_healthy", what)
            else:
                self.inc("fault_saves_not_protected", 1)
                self.log(f"  {what}", echo=False)
        prot = sum(v.status == "protected" for v in versions)
        self.log(f"  saved {kind} round: {prot}/{len(versions)} versions PROTECTED "
                 f"({fmt_bytes(sum(v.total_bytes() for v in versions))}; steps "
                 f"{', '.join(v.key for v in versions)})")
        return versions

    def save_rank(self, v, rank):
        """Saves one rank's shard; None if committed, else the error. UNAVAILABLE
        means "retry" (docs/protocol.md): retried twice, as a trainer would; an
        ALREADY_EXISTS answer to a retry means the first attempt committed.
        Every other shard goes through a lazy save (issue 16) waited for as a
        training loop does: through a wait point, then the whole copy, then the
        commit. Every save but those of checkpoint rounds declares the
        "frozen" item unchanged (incremental saves, issue 15): it refers to the
        bytes of the client's previous save (where that save's own copy is) when
        the client has one the agent still holds. Checkpoint rounds copy it:
        the versions referred to are then the checkpoint versions, whose sizes
        are fixed, so memory comes back to the same level after retention."""
        import ckpt
        state = {"payload": payload(self.seed, v.job, v.step, rank, v.sizes[rank]),
                 "tag": tag(v.job, v.step, rank), "frozen": frozen(self.seed, v.job, rank)}
        lazy = (v.step + rank) % 2 == 1
        unchanged = ["frozen"] if not self.args.full_only and v.kind != "checkpoint" else []
        for attempt in range(3):
            try:
                c = self.client(v.job, rank, v.via[rank])
                if lazy:
                    ls = c.save(v.step, state, lazy=True, wait_points=["payload"], unchanged=unchanged)
                    c.wait_copied(through="payload")
                    c.wait_copied()
                    ls.result(timeout=self.args.protect_timeout)
                    self.inc("lazy_saves_committed")
                else:
                    # save() returns once the bytes are copied; the commit
                    # goes to the agent in the background, and only its answer
                    # says the shard is the agent's (a kill -9 of the agent in
                    # between loses it: the trainer saves again).
                    h = c.save(v.step, state, unchanged=unchanged)
                    h.committed(timeout=self.args.protect_timeout)
                if unchanged:
                    self.inc("incremental_saves_committed")
                return None
            except ckpt.AlreadyExistsError as e:
                if attempt > 0:
                    return None
                return f"{type(e).__name__}: {e}"
            except ckpt.UnavailableError as e:
                if attempt == 2:
                    return f"{type(e).__name__}: {e}"
                self.inc("retries_unavailable")
                time.sleep(0.5)
            except ckpt.Error as e:
                return f"{type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - reported as the rank's error
                return f"{type(e).__name__}: {e}"

    def wait_protected(self, v, timeout):
        import ckpt
        deadline = now() + timeout
        c = None
        while True:
            left = deadline - now()
            if left <= 0:
                v.detail = v.detail or f"not PROTECTED within {timeout} s"
                return
            try:
                if c is None:
                    c = self.client(v.job, 0, v.via[0])
                c.wait(v.step, "protected", timeout=min(left, 10.0))
                v.status = "protected"
                v.protected_at = now()
                self.inc("versions_protected", 1)
                return
            except (ckpt.DataLossError, ckpt.FailedPreconditionError) as e:
                v.status = "abandoned"   # aborted before it was protected: never promised
                v.detail = f"aborted before PROTECTED: {e}"
                return
            except ckpt.Error as e:
                v.detail = f"{type(e).__name__}: {e}"
                time.sleep(0.3)

    # ---- meta's view
    def versions_of(self, job):
        d = self.ctl("versions", job.name, timeout=10, check=False)
        if d is None:
            return None
        return {v["step"]: v for v in d["versions"]}

    def meta_version(self, job, step, mv):
        """meta's record of one version: from the listing `mv`, else (DELETED
        versions are not listed) from `ckptctl inspect`; None if meta does not
        know it (or cannot be asked)."""
        if step in mv:
            return mv[step]
        d = self.ctl("inspect", job.name, step, timeout=10, check=False)
        if d is None:
            err = self.ctl_error()
            return {"state": "missing", "abort_reason": err} if "NOT_FOUND" in err else None
        return d

    def retired_legitimately(self, job, step, mv):
        """True if retention may have evicted `step`: at least keep newer versions
        reached PROTECTED (and were not lost since)."""
        newer = [x for s, x in mv.items()
                 if s > step and (x["state"].lower() in ("protected", "persisted", "degraded") or
                                  x.get("protected_unix_ms", 0) > 0 or x.get("persisted_unix_ms", 0) > 0)]
        return len(newer) >= job.keep

    def audit(self, phase):
        """Checks meta's view of every version the soak saw PROTECTED."""
        for job in self.jobs:
            mv = self.versions_of(job)
            if mv is None:
                self.log(f"  audit ({phase}): cannot list {job.name}'s versions", echo=False)
                continue
            for v in list(job.records.values()):
                if v.status == "pending":
                    st = mv.get(v.step, {}).get("state", "").lower()
                    if st in ("protected", "persisted"):
                        v.status = "protected"
                        v.protected_at = now()
                        self.inc("versions_protected", 1)
                    continue
                if v.status != "protected":
                    continue
                m = self.meta_version(job, v.step, mv)
                if m is None:
                    continue   # meta unreachable: next audit
                st = m["state"].lower()
                if st in ("protected", "persisted", "degraded"):
                    continue
                if st == "deleted" and self.retired_legitimately(job, v.step, mv):
                    v.status = "retired"
                    self.inc("versions_retired", 1)
                    continue
                if st in ("open", "staged"):
                    if not v.rolled_back:
                        v.rolled_back = True
                        self.fail("rollback", f"{v.key} was PROTECTED and is now {st.upper()} at meta ({phase})")
                    continue
                reason = m.get("abort_reason", "") or ("meta does not know the version" if st == "missing" else "")
                self.lose(v, f"meta says {st.upper()}: {reason} ({phase})")

    def lose(self, v, why):
        down = self.max_down_since(v.t_start)
        if down > v.job.tolerance:
            v.status = "exempt_lost"
            self.inc("exempt_lost", 1)
            self.log(f"  {v.key} lost with {down} agents down (tolerates {v.job.tolerance}): {why}")
        else:
            v.status = "lost"
            self.fail("lost_protected", f"{v.key} (PROTECTED, {v.job.protection}) lost with at most {down} "
                      f"agent(s) down: {why}")

    # ---- restores
    def newest_protected(self, job):
        best = None
        for v in job.records.values():
            if v.status == "protected" and (best is None or v.step > best.step):
                best = v
        return best

    def check(self, label, during_fault):
        """Restores every rank of the newest PROTECTED version of every job and
        compares bytes; some through ckptctl; the newest PERSISTED one from disk."""
        down = self.down_nodes()
        up = [i for i in range(self.n) if f"n{i}" not in down]
        work = []
        for job in self.jobs:
            v = self.newest_protected(job)
            if v is None:
                continue
            with self.rng_lock:
                for r in range(job.world):
                    home = r % self.n
                    via = home if home in up and self.rng_routes.random() < 0.6 else self.rng_routes.choice(up)
                    work.append((v, r, via))
                use_ctl = self.rng_routes.random() < self.args.ctl_share
            if use_ctl:
                work.append((v, None, None))
        t = now()
        futs = [self.pool.submit(self.restore_one, v, r, via, during_fault) for v, r, via in work]
        results = [f.result() for f in futs]
        ok = sum(1 for x in results if x)
        self.log(f"  check ({label}): {ok}/{len(results)} restores byte-identical in {now() - t:.1f} s"
                 f"{' (agents down: ' + ', '.join(sorted(down)) + ')' if down else ''}")
        if not during_fault:
            self.check_durable()

    def restore_one(self, v, rank, via, during_fault):
        """One restore: a rank through the client (rank is not None) or the whole
        version through ckptctl. Returns True if every byte matched."""
        import ckpt
        if rank is None:
            return self.restore_ctl(v, during_fault)
        t = now()
        connect_ms = 0.0  # a new client's Connect, part of the restore's time
        for attempt in range(3):
            try:
                tc = now()
                c = self.client(v.job, rank, via)
                connect_ms += (now() - tc) * 1000
                served, items = c.load_items(v.step)
                break
            except ckpt.UnavailableError as e:
                # "Retry" by contract (e.g. the first call on a channel to a
                # restarted meta fails with a broken pipe).
                if attempt == 2:
                    self.restore_error(v, rank, via, f"{type(e).__name__}: {e} (3 tries)", during_fault)
                    return False
                self.inc("retries_unavailable")
                time.sleep(0.5)
            except ckpt.Error as e:
                self.restore_error(v, rank, via, f"{type(e).__name__}: {e}", during_fault)
                return False
        ms = (now() - t) * 1000
        self.restore_ms["during_fault" if during_fault else "healthy"].append(ms)
        if ms > 5000:  # the tail that summaries report as "max": which restore, from where
            self.log(f"  slow restore: {v.key} rank {rank} via n{via}: {ms:.0f} ms (connect {connect_ms:.0f} ms),"
                     f" served from {served} ({attempt + 1} tries){' during the fault' if during_fault else ''}")
        self.served_from[served] += 1
        self.inc("restores_client", 1)
        got = {name: data for name, _, _, _, data in items}
        return self.compare(v, rank, got.get("payload"), got.get("tag"),
                            f"client load via n{via} ({served}, {ms:.0f} ms)", got.get("frozen"))

    def restore_ctl(self, v, during_fault):
        import ckpt
        out = self.work / "restore" / f"{v.job.name}-{v.step}-{self.ckptctl_restores}"
        self.ckptctl_restores += 1
        out.parent.mkdir(exist_ok=True)
        for attempt in range(3):
            d = self.ctl("restore", v.job.name, v.step, "--out", out, timeout=self.args.load_timeout)
            if d is not None or "UNAVAILABLE" not in self.ctl_error() or attempt == 2:
                break
            self.inc("retries_unavailable")
            shutil.rmtree(out, ignore_errors=True)
            time.sleep(0.5)
        if d is None:
            self.restore_error(v, None, None, f"ckptctl restore: {self.ctl_error()}",
                               during_fault)
            shutil.rmtree(out, ignore_errors=True)
            return False
        try:
            ranks = ckpt.read_durable(out)
        except ckpt.Error as e:
            self.fail("restore_failed", f"{v.key}: ckptctl restore wrote a directory read_durable refuses: {e}")
            return False
        finally:
            shutil.rmtree(out, ignore_errors=True)
        self.inc("restores_ckptctl", 1)
        ok = True
        for r in range(v.job.world):
            items = ranks.get(r, {})
            ok &= self.compare(v, r, items.get("payload"), items.get("tag"), "ckptctl restore", items.get("frozen"))
        return ok

    def compare(self, v, rank, got_payload, got_tag, how, got_frozen):
        import numpy as np
        want = payload(self.seed, v.job, v.step, rank, v.sizes[rank])
        if got_payload is None:
            wrong = len(want)
            detail = "item 'payload' missing"
        else:
            got = np.asarray(got_payload).reshape(-1).view(np.uint8)
            n = min(len(got), len(want))
            wrong = int(np.count_nonzero(got[:n] != want[:n])) + abs(len(got) - len(want))
            detail = f"{len(got)} bytes, expected {len(want)}"
            self.inc("bytes_compared", n)
        if got_tag is None or bytes(got_tag) != tag(v.job, v.step, rank):
            wrong += max(1, len(tag(v.job, v.step, rank)))
            detail += f"; tag {got_tag!r}"
        want_frozen = frozen(self.seed, v.job, rank)
        if got_frozen is None:
            wrong += len(want_frozen)
            detail += "; item 'frozen' missing"
        else:
            got = np.asarray(got_frozen).reshape(-1).view(np.uint8)
            n = min(len(got), len(want_frozen))
            bad = int(np.count_nonzero(got[:n] != want_frozen[:n])) + abs(len(got) - len(want_frozen))
            self.inc("bytes_compared", n)
            if bad:
                wrong += bad
                detail += f"; 'frozen': {bad} wrong bytes"
        if wrong:
            self.inc("wrong_bytes", wrong)
            self.fail("wrong_bytes", f"{v.key} rank {rank} via {how}: {wrong} wrong bytes ({detail})")
            return False
        return True

    def restore_error(self, v, rank, via, err, during_fault):
        what = f"{v.key} rank {rank} via n{via}" if rank is not None else f"{v.key} (ckptctl restore)"
        mv = self.versions_of(v.job)
        m = self.meta_version(v.job, v.step, mv) if mv is not None else None
        st = m["state"].lower() if m else "unknown"
        if mv is not None and st == "deleted" and self.retired_legitimately(v.job, v.step, mv):
            self.inc("restores_skipped_retired", 1)
            return
        down = self.max_down_since(v.t_start)
        if down > v.job.tolerance:
            self.inc("restore_errors_exempt", 1)
            self.log(f"  restore of {what} failed with {down} agents down (tolerated): {err}", echo=False)
            return
        self.inc("restore_errors", 1)
        self.fail("restore_failed", f"{what} {'during the fault' if during_fault else 'after healing'} "
                  f"(meta: {st.upper()}, at most {down} agent(s) down since it was saved): {err}")

    def check_durable(self):
        import ckpt
        job = next((j for j in self.jobs if j.flush), None)
        if job is None:
            return
        mv = self.versions_of(job)
        if not mv:
            return
        persisted = [s for s, m in mv.items() if m["state"].lower() == "persisted" and s in job.records]
        if not persisted:
            return
        v = job.records[max(persisted)]
        path = self.durable / job.name / str(v.step)
        try:
            ranks = ckpt.read_durable(path)
        except ckpt.Error as e:
            self.fail("durable_unreadable", f"{v.key} is PERSISTED but read_durable({path}) fails: {e}")
            return
        self.durable_reads += 1
        for r in range(job.world):
            items = ranks.get(r, {})
            self.compare(v, r, items.get("payload"), items.get("tag"), "durable tier", items.get("frozen"))

    # ---- healing
    def heal(self, label):
        """All daemons back, all nodes ALIVE, PROTECTED versions PROTECTED again,
        abandoned versions deleted, flush caught up."""
        t = now()
        self.revive_all()
        if not self.wait_nodes_alive(90):
            self.fail("heal_timeout", f"after {label}: not every node ALIVE 90 s after revival: {self.node_states()}")
        for d in self.agents:
            if not self.wait_agent_ready(d, 30):
                self.fail("heal_timeout", f"after {label}: {d.name} not ready (registered) 30 s after revival")
        # Versions: protected ones back to PROTECTED, pending ones settle.
        deadline = now() + self.args.heal_timeout
        stuck = {}
        while True:
            stuck = {}
            for job in self.jobs:
                mv = self.versions_of(job)
                if mv is None:
                    stuck[job.name] = "meta unreachable"
                    continue
                for v in job.records.values():
                    if v.status not in ("protected", "pending"):
                        continue
                    m = self.meta_version(job, v.step, mv)
                    st = m["state"].lower() if m else "unknown"
                    if v.status == "pending":
                        if st in ("protected", "persisted"):
                            v.status = "protected"
                            v.protected_at = now()
                            self.inc("versions_protected", 1)
                        elif st in ("aborted", "deleted", "missing"):
                            # Aborted before it was protected, or never begun
                            # (meta refuses a version it cannot place, e.g. EC
                            # with too few alive nodes): never promised.
                            v.status = "abandoned"
                            v.detail = f"{st} before it was PROTECTED: {m.get('abort_reason', '') if m else ''}"
                        else:
                            stuck[v.key] = st
                    elif st not in ("protected", "persisted"):
                        # One already reported stuck is not waited for again
                        # (the audit still watches it for loss).
                        if st == "degraded" and v.key not in self.stuck_reported:
                            stuck[v.key] = st
                        # other states: the audit below decides (lost, retired, rollback)
            if not stuck or now() > deadline:
                break
            time.sleep(0.5)
        if stuck:
            self.stuck_reported.update(stuck)
            diag = self.dump_diagnostics(label, stuck)
            self.fail("not_reprotected", f"after {label}: {self.args.heal_timeout} s after healing, "
                      f"still not PROTECTED: {stuck} (meta's records: {diag})")
            # Versions never seen PROTECTED that are stuck: give up on them (and
            # delete them below) so that later memory checkpoints measure leaks,
            # not these versions' holdings.
            for job in self.jobs:
                for v in job.records.values():
                    if v.status == "pending" and v.key in stuck:
                        v.status = "abandoned"
                        v.detail = f"stuck {stuck[v.key]} after healing"
        self.audit(f"after {label}")
        # Abandoned versions (a rank never saved, or aborted before protection)
        # and lost ones: the trainer gave up on them; an operator deletes them
        # (meta keeps an ABORTED version's surviving copies until then), except
        # one that newer versions still refer to (incremental saves): meta
        # refuses that without --force, and retention frees it once they go.
        for job in self.jobs:
            for v in job.records.values():
                if v.status in ("abandoned", "lost", "exempt_lost") and not getattr(v, "deleted", False):
                    if self.ctl("delete", v.job.name, v.step, timeout=20, check=False) is not None:
                        v.deleted = True
                        self.inc("abandoned_versions_deleted", 1)
                    else:
                        err = self.ctl_error()
                        if "NOT_FOUND" in err:
                            v.deleted = True
                        elif "refer to (incremental saves)" not in err:
                            self.log(f"  delete {v.key} failed: {err}", echo=False)
        if self.durable_mounted:
            self.wait_flush_caught_up(label)
        self.log(f"  healed in {now() - t:.1f} s")

    def dump_diagnostics(self, label, keys):
        """Writes meta's status and its record of each version `keys` names
        ("job/step") to a file for the report; returns the file's path."""
        self.diag_count = getattr(self, "diag_count", 0) + 1
        path = self.work / f"diagnostics-{self.diag_count}.json"
        out = {"label": label, "t_s": round(now() - self.t0, 1), "status": self.cluster_status(), "versions": {}}
        for key in keys:
            job, _, step = key.partition("/")
            if step.isdigit():
                out["versions"][key] = self.ctl("inspect", job, step, timeout=10, check=False)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        return str(path)

    def dump_holdings(self, label):
        """Writes what every agent holds (ckptctl holdings) and meta's status to a
        diagnostics file; returns its path."""
        self.diag_count = getattr(self, "diag_count", 0) + 1
        path = self.work / f"diagnostics-{self.diag_count}.json"
        out = {"label": label, "t_s": round(now() - self.t0, 1), "status": self.cluster_status(),
               "holdings": {d.name: self.ctl("holdings", d.name, timeout=10, check=False) for d in self.agents}}
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        return str(path)

    def cluster_status(self):
        return self.ctl("status", timeout=10, check=False)

    def wait_flush_caught_up(self, label):
        deadline = now() + self.args.heal_timeout
        st = None
        while now() < deadline:
            st = self.cluster_status()
            if st is not None and st.get("flush_lag_bytes", 0) == 0:
                return True
            time.sleep(0.5)
        self.fail("flush_stuck", f"after {label}: flush lag still {st and st.get('flush_lag_bytes')} bytes "
                  f"{self.args.heal_timeout} s after the cluster healed")
        return False

    # ---- memory
    def memory_checkpoint(self, label):
        """Keep-in-memory many healthy saves of the fixed sizes: retention then
        evicts everything older; once quiet, each agent must hold what it held at
        the first checkpoint."""
        keep = max(j.keep for j in self.jobs)
        for _ in range(keep):
            vs = self.save_round("checkpoint")
            if any(v.status != "protected" for v in vs):
                self.log(f"memory checkpoint ({label}) skipped: a checkpoint save failed")
                return
        sample = self.quiet_sample(60)
        if sample is None:
            self.fail("not_quiet", f"memory checkpoint ({label}): the cluster did not become quiet in 60 s "
                      f"(tasks or flushes running, memory changing)")
            return
        self.mem_checks.append({"label": label, "t_s": round(now() - self.t0, 1), "nodes": sample})
        if self.baseline is None:
            self.baseline = sample
            self.baseline_holdings = self.holdings_by_node()
            self.log("memory baseline: " + ", ".join(f"{n} {fmt_bytes(u)} in {h} holdings"
                                                    for n, (u, h) in sorted(sample.items())))
            return
        tol = self.args.memory_tolerance
        grew, new = [], False
        for node, (used, holdings) in sorted(sample.items()):
            b_used, b_hold = self.baseline[node]
            if used > b_used + tol or holdings > b_hold:
                grew.append(f"{node}: {fmt_bytes(used)} in {holdings} holdings vs baseline "
                            f"{fmt_bytes(b_used)} in {b_hold} (+{used - b_used} bytes)")
                # A failure once per growth: the same excess at the next
                # checkpoint is the same leak, not a new one.
                r_used, r_hold = self.mem_reported.get(node, (b_used + tol, b_hold))
                new = new or used > r_used or holdings > r_hold
                self.mem_reported[node] = (max(used, r_used), max(holdings, r_hold))
        self.log(f"memory checkpoint ({label}): " + ", ".join(
            f"{n} {used - self.baseline[n][0]:+d} B/{h - self.baseline[n][1]:+d} holdings"
            for n, (used, h) in sorted(sample.items())))
        if grew and new:
            path = self.dump_holdings(label)
            self.fail("memory_growth", f"after retention ({label}): " + "; ".join(grew) +
                      f" (each agent's holdings and meta's status: {path}); " + self.explain_growth(grew))
        elif grew:
            self.log("  memory still above baseline, no more than at the last failing checkpoint")

    def holdings_by_node(self):
        """{node: [holding, ...]} from each agent (ckptctl holdings); None for an agent that did not answer."""
        out = {}
        for d in self.agents:
            h = self.ctl("holdings", d.name, timeout=10, check=False)
            out[d.name] = None if h is None else h.get("holdings", [])
        return out

    def explain_growth(self, grew):
        """What a failing memory checkpoint's grown agents hold beyond the baseline: their client
        handles, leases, reservations, incoming pushes and parity builds, and the holdings (job,
        rank, role; steps aside, since checkpoint saves repeat the same shards) gained and lost.
        Reservations beyond holdings plus parity segments are memory nothing lists."""
        def key(h):
            return (h.get("job"), h.get("what"), h.get("role"))
        now_h = self.holdings_by_node()
        parts = []
        for node in sorted({g.split(":")[0] for g in grew}):
            x = self.last_extras.get(node, {})
            text = f"{node}: " + ", ".join(f"{k} {v}" for k, v in sorted(x.items()))
            base, cur = (self.baseline_holdings or {}).get(node), now_h.get(node)
            if base is not None and cur is not None:
                b, c = collections.Counter(map(key, base)), collections.Counter(map(key, cur))
                extra = [h for h in cur if (c - b)[key(h)] > 0]
                missing = list((b - c).elements())
                text += "; holdings gained: " + (", ".join(
                    f"{h.get('job')}/{h.get('step')} {h.get('what')} {h.get('role')} {h.get('size_bytes')} B"
                    for h in extra[:8]) or "none")
                text += "; lost: " + (", ".join(f"{j} {w} {r}" for j, w, r in missing[:8]) or "none")
            parts.append(text)
        return " | ".join(parts)

    def quiet_sample(self, timeout):
        """(used, holdings) per agent once meta has no task left, no flush lag, and
        the agents' numbers held still for 3 consecutive samples."""
        deadline = now() + timeout
        last, same = None, 0
        while now() < deadline:
            time.sleep(1.0)
            st = self.cluster_status()
            if st is None or st.get("tasks_pending", 1) or st.get("tasks_running", 1) or \
                    st.get("tasks_retrying", 1) or st.get("flush_lag_bytes", 1):
                last, same = None, 0
                continue
            sample, extras = {}, {}
            for d in self.agents:
                m = self.agent_metrics(d)
                if m is None:
                    break
                # Leases the live clients asked for ahead of their next save
                # (ClientOptions::lease_ahead) are theirs, not growth.
                ahead = int(float(m.get("ckpt_agent_memory_leased_ahead_bytes", 0)))
                sample[d.name] = (int(m["ckpt_agent_memory_used_bytes"]) - ahead, int(m["ckpt_agent_holdings"]))
                extras[d.name] = {k[len("ckpt_agent_"):]: int(float(m[k])) for k in (
                    "ckpt_agent_open_handles", "ckpt_agent_open_leases", "ckpt_agent_memory_reservations",
                    "ckpt_agent_memory_leased_bytes", "ckpt_agent_memory_leased_ahead_bytes",
                    "ckpt_agent_pushes_receiving", "ckpt_agent_parity_builds") if k in m}
            if len(sample) != self.n:
                continue
            same = same + 1 if sample == last else 0
            last = sample
            if same >= 2:
                self.last_extras = extras
                return sample
        return None

    # ---- faults
    def up_agents(self):
        down = self.down_nodes()
        return [d for d in self.agents if d.name not in down and d.running()]

    def start_background_round(self):
        box = {}

        def run():
            try:
                box["versions"] = self.save_round("fault", wait_timeout=self.args.fault_protect_timeout)
            except Exception as e:  # noqa: BLE001 - surfaced by join_round
                box["error"] = e

        t = threading.Thread(target=run, name="fault-round", daemon=True)
        t.start()
        return t, box

    def join_round(self, handle):
        if handle is None:
            return
        t, box = handle
        t.join()
        if "error" in box:
            raise box["error"]

    def fault_kill_agent(self):
        d = self.rng.choice(self.up_agents())
        variant = self.rng.choice(["quick", "dead", "reprotected"])
        during = self.rng.random() < 0.4
        self.log(f"FAULT kill -9 agent {d.name} (pid {d.pid}), restart {variant}"
                 f"{', while a save round is in flight' if during else ''}")
        bg = self.start_background_round() if during else None
        if bg:
            time.sleep(self.rng.uniform(0.05, 0.6))
        self.kill_agent(d)
        if variant == "quick":
            time.sleep(self.rng.uniform(0.0, 1.0))
        else:
            if not self.wait_node_state(d.name, "dead", self.args.lease_ms / 1000 + 20):
                self.fail("not_declared_dead", f"meta did not declare killed {d.name} DEAD within "
                          f"{self.args.lease_ms / 1000 + 20:.0f} s")
            self.join_round(bg)
            bg = None
            self.check(f"{d.name} killed", during_fault=True)
            if variant == "reprotected":
                self.wait_reprotected_while_down(d.name)
                self.save_round("fault", wait_timeout=self.args.fault_protect_timeout)
                self.check(f"{d.name} killed, after re-protection", during_fault=True)
        self.restart_agent(d)
        self.join_round(bg)
        return d.name

    def wait_reprotected_while_down(self, node):
        """With one agent down, every version within tolerance gets PROTECTED again
        on the survivors (re-protection). A failure here is reported like a heal."""
        deadline = now() + self.args.heal_timeout
        pending = {}
        while now() < deadline:
            pending = {}
            up = len(self.up_agents())
            for job in self.jobs:
                if job.width > up:
                    continue  # cannot be placed to survive its tolerance until the node is back
                mv = self.versions_of(job)
                v = self.newest_protected(job)
                if v is None or mv is None:
                    continue
                st = mv.get(v.step, {}).get("state", "missing").lower()
                if st not in ("protected", "persisted"):
                    pending[v.key] = st
            if not pending:
                return
            time.sleep(0.5)
        self.fail("not_reprotected", f"with {node} down: still not re-protected after "
                  f"{self.args.heal_timeout} s: {pending}")

    def fault_kill_two(self):
        a, b = self.rng.sample(self.up_agents(), 2)
        self.log(f"FAULT kill -9 agents {a.name} and {b.name} at once (only jobs tolerating 2 are held to it)")
        self.kill_agent(a)
        self.kill_agent(b)
        for d in (a, b):
            if not self.wait_node_state(d.name, "dead", self.args.lease_ms / 1000 + 20):
                self.fail("not_declared_dead", f"meta did not declare killed {d.name} DEAD")
        self.check(f"{a.name} and {b.name} killed", during_fault=True)
        self.audit(f"{a.name} and {b.name} down")
        self.restart_agent(a)
        self.restart_agent(b)
        return f"{a.name}+{b.name}"

    def fault_kill_meta(self):
        during = self.rng.random() < 0.6
        down_s = self.rng.uniform(0.2, 3.0)
        if self.etcd is not None:
            self.meta = self.meta_leader() or self.meta
        self.log(f"FAULT kill -9 {self.meta.name} (pid {self.meta.pid}), restart after {down_s:.1f} s"
                 f"{', while a save round is being protected' if during else ''}")
        bg = self.start_background_round() if during else None
        if bg:
            time.sleep(self.rng.uniform(0.05, 0.8))
        self.kill_meta()
        time.sleep(down_s)
        self.restart_meta()
        self.join_round(bg)
        return "meta"

    def fault_stop_agent(self):
        d = self.rng.choice(self.up_agents())
        lease = self.args.lease_ms / 1000
        peer = self.args.peer_timeout_ms / 1000
        long = self.rng.random() < 0.5 or lease - peer < 1.0
        dur = lease + self.rng.uniform(1.0, 4.0) if long else peer + self.rng.uniform(0.5, lease - peer - 0.3)
        during = self.rng.random() < 0.4
        self.log(f"FAULT SIGSTOP agent {d.name} (pid {d.pid}) for {dur:.1f} s "
                 f"({'longer' if long else 'shorter'} than the meta lease, longer than the peer timeout), "
                 f"restores while it is stopped{', and a save round' if during else ''}")
        self.stop_agent(d)
        t_end = now() + dur
        time.sleep(0.3)
        box = {}

        def restores():
            try:
                self.check(f"{d.name} stopped", during_fault=True)
            except Exception as e:  # noqa: BLE001 - re-raised below
                box["error"] = e

        checker = threading.Thread(target=restores, name="stopped-check", daemon=True)
        checker.start()
        bg = self.start_background_round() if during else None
        time.sleep(max(0.0, t_end - now()))
        self.cont_agent(d)
        checker.join()
        self.join_round(bg)
        if "error" in box:
            raise box["error"]
        return d.name

    def fault_disk_full(self):
        self.log(f"FAULT durable disk full ({fmt_bytes(self.args.durable_size)} tmpfs filled with a filler file)")
        errors_before = self.flush_errors()
        self.fill_disk()
        self.disk_full_active = True
        try:
            self.save_round("fault")
            deadline = now() + 15
            while now() < deadline and self.flush_errors() <= errors_before:
                time.sleep(0.5)
            seen = self.flush_errors() - errors_before
            self.log(f"  durable writes failed {seen} time(s) while the disk was full")
            if seen == 0:
                self.inc("disk_full_without_flush_errors", 1)
            self.check("durable disk full", during_fault=True)
        finally:
            self.unfill_disk()
            self.disk_full_active = False
        return "durable"

    def flush_errors(self):
        total = 0
        for d in self.up_agents():
            m = self.agent_metrics(d) or {}
            total += int(m.get("ckpt_agent_flush_errors_total", 0))
        return total

    def fill_disk(self):
        self.filler = self.durable / "filler.bin"
        with open(self.filler, "wb", buffering=0) as f:
            for chunk in (b"\0" * MiB, b"\0" * 4096, b"\0"):
                try:
                    while f.write(chunk):
                        pass
                except OSError:
                    pass
        st = os.statvfs(self.durable)
        self.log(f"  durable tier: {st.f_bavail * st.f_frsize} bytes free", echo=False)

    def unfill_disk(self):
        if self.filler is not None:
            try:
                self.filler.unlink()
            except OSError:
                pass
            self.filler = None

    def sabotage(self):
        """Deliberate damage to show the soak catches each failure kind (--sabotage)."""
        kind = self.args.sabotage
        self.sabotaged = True
        self.log(f"SABOTAGE {kind} (self-check of the soak; this run must fail)")
        if kind == "crash":
            d = self.rng.choice(self.up_agents())
            d.send(signal.SIGSEGV, expect_exit=False)
            time.sleep(1.0)
        elif kind == "lose":
            job = self.jobs[0]
            v = self.newest_protected(job)
            self.ctl("delete", job.name, v.step, "--force")
            self.audit("after sabotage")
        elif kind == "wrong-bytes":
            job = self.jobs[1]
            v = self.newest_protected(job)
            v.sizes[0] += 1    # the soak now expects one more byte than was saved
            self.check("after sabotage", during_fault=False)
        elif kind == "leak":
            # One rank of a two-rank job nobody saves again: its version stays OPEN
            # (until meta's open-version timeout, 10 min), so memory stays above
            # baseline. (A rank of one of the soak's own jobs would not do: the
            # job's next version supersedes and evicts it.)
            path = self.work / "leak.bin"
            path.write_bytes(os.urandom(4 * MiB))
            d = self.agents[0]
            r = subprocess.run([str(self.bin / "ckptctl"), "--meta", self.meta_addr, "save", "leak", "1", str(path),
                                "--rank", "0", "--world-size", "2", "--agent-socket", str(d.socket)],
                               capture_output=True, text=True, timeout=60, env=self.ctl_env())
            self.log(f"  leak: ckptctl save exit {r.returncode} {r.stderr.strip()[:200]}")

    # ---- main loop
    def run(self):
        a = self.args
        self.log(f"chaos soak: seed {self.seed}, {self.n} agents, {a.duration:.0f} s, logs in {self.work}")
        self.start_cluster()
        self.log(f"cluster up: meta {self.meta_addr} (pid {self.meta.pid}), agents " +
                 ", ".join(f"{d.name} (pid {d.pid})" for d in self.agents) +
                 f"; durable tier {'tmpfs ' + fmt_bytes(a.durable_size) if self.durable_mounted else 'a plain dir'}"
                 f"{'' if self.durable_mounted else ' (full-disk fault cannot run: ' + self.disk_full_reason + ')'}")
        self.make_jobs()
        self.memory_checkpoint("baseline")
        self.check("initial", during_fault=False)
        # Every kind runs unless excluded with a reason (--exclude, --faults); one that cannot
        # run here fails the soak rather than vanish from it.
        cannot = {}
        if not any(j.tolerance >= 2 for j in self.jobs):
            cannot["kill_two_agents"] = "no job tolerates two lost holders"
        if not self.durable_mounted:
            cannot["disk_full"] = self.disk_full_reason
        self.faults_excluded = dict(a.exclude)
        if a.faults:
            for k in FAULT_WEIGHTS:
                if k not in a.faults:
                    self.faults_excluded.setdefault(k, "not in --faults")
        for k, why in cannot.items():
            if k not in self.faults_excluded:
                raise Failure(f"fault kind {k} cannot run here ({why}): exclude it with --exclude {k}:REASON "
                              f"to run without it")
        kinds = [(k, w) for k, w in FAULT_WEIGHTS.items() if k not in self.faults_excluded]
        if not kinds:
            raise Failure("every fault kind is excluded: " +
                          ", ".join(f"{k} ({why})" for k, why in self.faults_excluded.items()))
        pending = [k for k, _ in kinds]
        self.rng.shuffle(pending)
        order = {"kill_agent": self.fault_kill_agent, "kill_meta": self.fault_kill_meta,
                 "stop_agent": self.fault_stop_agent, "kill_two_agents": self.fault_kill_two,
                 "disk_full": self.fault_disk_full}
        end = self.t0 + a.duration
        i = 0
        last_mem = 0
        while now() < end or pending:
            i += 1
            if a.sabotage and i == 2 and not self.sabotaged:
                self.sabotage()
            if pending:  # each kind once first: the run outlasts --duration until all have run
                kind = pending.pop(0)
            else:
                kind = self.rng.choices([k for k, _ in kinds], weights=[w for _, w in kinds])[0]
            self.faults[kind] += 1
            target = order[kind]()
            self.heal(f"{kind} ({target})")
            self.check(f"after {kind} ({target})", during_fault=False)
            if i % a.mem_every == 0:
                self.memory_checkpoint(f"after fault {i}")
                last_mem = i
            else:
                self.save_round("healthy")
        if a.sabotage and not self.sabotaged:
            self.sabotage()
            self.heal("sabotage")
        if last_mem != i or a.sabotage:
            self.memory_checkpoint("final")
        self.check("final", during_fault=False)
        self.audit("final")
        for k, _ in kinds:
            if self.faults[k] == 0:
                self.fail("fault_kind_not_run", f"fault kind {k} never ran")

    # ---- shutdown and cleanup
    def shutdown(self, graceful):
        """SIGTERM (graceful: must exit 0 within 30 s) or SIGKILL every daemon, by PID."""
        self.stop_monitor.set()
        if self.monitor_thread is not None:
            self.monitor_thread.join(timeout=10)
        daemons = [d for d in self.agents] + self.metas
        for d in daemons:
            if d.stopped:
                d.send(signal.SIGCONT, expect_exit=False)
        for d in daemons:
            if not d.running():
                continue
            if graceful:
                with d.lock:
                    offset = d.log_offset
                d.send(signal.SIGTERM, expect_exit=True)
                rc = d.wait(30)
                if rc is None:
                    self.fail("shutdown_hang", f"{d.name} (pid {d.pid}) still running 30 s after SIGTERM; "
                              f"log {d.log_path}")
                    d.send(signal.SIGKILL, expect_exit=True)
                    d.wait(30)
                elif rc != 0:
                    self.fail("unclean_shutdown", f"{d.name} (pid {d.pid}) exited {rc} on SIGTERM; log "
                              f"{d.log_path}:\n{d.log_tail(15)}")
                bad = d.crash_lines(offset)
                if bad:
                    self.fail("daemon_crash", f"{d.name}: crash reports in its log {d.log_path}:\n" +
                              "\n".join(bad[:10]))
                with d.lock:
                    d.exited = True
            else:
                d.send(signal.SIGKILL, expect_exit=True)
                d.wait(30)
                with d.lock:
                    d.exited = True
        # etcd is the test's, not ours to judge: killed after the metas that use it.
        if self.etcd is not None and self.etcd.running():
            self.etcd.send(signal.SIGKILL, expect_exit=True)
            self.etcd.wait(30)
            with self.etcd.lock:
                self.etcd.exited = True
        # Whole-log scan: reports from runs that ended in our kill -9 too.
        for d in daemons:
            for line in d.crash_lines(0):
                if not any(line in c.get("lines", []) for c in self.crashes) and \
                        not any(line in f["detail"] for f in self.failures):
                    self.fail("daemon_crash", f"{d.name}: crash report in {d.log_path}: {line}")

    def cleanup(self, keep_logs):
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.unfill_disk()
        if self.durable_mounted:
            subprocess.run(["umount", "-l", str(self.durable)], capture_output=True)
        shutil.rmtree(self.shm, ignore_errors=True)
        if not keep_logs:
            shutil.rmtree(self.work, ignore_errors=True)

    # ---- summary
    def compacted_shards(self):
        """Incremental shards an agent stored self-contained because meta had
        discarded a version they refer to (the agents' logs say so)."""
        n = 0
        for f in self.work.glob("*.log"):
            if f.name in ("meta.log", "soak.log"):
                continue
            with open(f, errors="replace") as fh:
                n += sum(1 for line in fh if "stored it self-contained" in line)
        return n

    def dpu_counters(self):
        """What the ckpt-dpu-agents (--dpu) pulled from clients and delivered to
        them, from their counters at the end (a restarted agent's start at 0:
        a lower bound)."""
        out = {"agents": self.args.dpu, "pulled_bytes": 0, "delivered_bytes": 0, "pull_errors": 0}
        for d in self.agents[self.n - self.args.dpu:]:
            m = self.agent_metrics(d) or {}
            out["pulled_bytes"] += int(m.get("ckpt_agent_pulled_bytes_total", 0))
            out["delivered_bytes"] += int(m.get("ckpt_agent_delivered_bytes_total", 0))
            out["pull_errors"] += int(m.get("ckpt_agent_pull_errors_total", 0))
        return out

    def summary(self, elapsed):
        kinds = collections.Counter(f["kind"] for f in self.failures)
        ms_f = sorted(self.restore_ms["during_fault"])
        ms_h = sorted(self.restore_ms["healthy"])
        pct = lambda xs, q: round(xs[min(len(xs) - 1, int(q * len(xs)))], 1) if xs else None  # noqa: E731
        statuses = collections.Counter(v.status for j in self.jobs for v in j.records.values()) \
            if hasattr(self, "jobs") else {}
        mem = {}
        if self.baseline:
            last = self.mem_checks[-1]["nodes"]
            mem = {n: {"baseline_used_bytes": self.baseline[n][0], "last_used_bytes": last[n][0],
                       "baseline_holdings": self.baseline[n][1], "last_holdings": last[n][1]}
                   for n in sorted(self.baseline)}
        return {
            "seed": self.seed, "nodes": self.n, "duration_s": self.args.duration, "elapsed_s": round(elapsed, 1),
            "logs": str(self.work),
            "jobs": {j.name: {"protection": j.protection, "world_size": j.world, "tolerates_down": j.tolerance,
                              "flushed": j.flush} for j in getattr(self, "jobs", [])},
            "faults": {k: self.faults[k] for k in FAULT_WEIGHTS if k not in self.faults_excluded},
            "faults_excluded": dict(self.faults_excluded),
            "restores": {"client": self.counts["restores_client"], "ckptctl": self.counts["restores_ckptctl"],
                         "durable_reads": self.durable_reads, "served_from": dict(self.served_from),
                         "bytes_compared": self.counts["bytes_compared"],
                         "ms_during_fault_p50": pct(ms_f, 0.5), "ms_during_fault_max": ms_f[-1] if ms_f else None,
                         "ms_healthy_p50": pct(ms_h, 0.5), "ms_healthy_max": ms_h[-1] if ms_h else None,
                         "errors_exempt": self.counts["restore_errors_exempt"],
                         "retries_after_unavailable": self.counts["retries_unavailable"],
                         "skipped_retired": self.counts["restores_skipped_retired"]},
            "versions": {"saved": self.counts["versions_saved"], "protected": self.counts["versions_protected"],
                         "bytes_saved": self.counts["bytes_saved"], "by_status": dict(statuses),
                         "lazy_shards_committed": self.counts["lazy_saves_committed"],
                         "incremental_shards_committed": self.counts["incremental_saves_committed"],
                         "compacted_shards": self.compacted_shards(),
                         "fault_saves_not_protected": self.counts["fault_saves_not_protected"],
                         "abandoned_deleted": self.counts["abandoned_versions_deleted"],
                         "exempt_lost": self.counts["exempt_lost"]},
            "dpu": getattr(self, "dpu_final", {}),
            "memory": {"tolerance_bytes": self.args.memory_tolerance, "checkpoints": len(self.mem_checks),
                       "nodes": mem, "series": str(self.mem_series_path)},
            "failures_by_kind": dict(
                {k: kinds[k] for k in MAIN_FAILURES}, wrong_bytes=self.counts["wrong_bytes"],
                other={k: c for k, c in kinds.items() if k not in MAIN_FAILURES and k != "wrong_bytes"}),
            "failures": self.failures[:200],
            "crashes": self.crashes,
            "meta_stepdowns": len(self.stepdowns),
            "passed": not self.failures and not self.interrupted,
        }

    def print_summary(self, s):
        print("\n== chaos soak summary")
        print(f"seed {s['seed']}, {s['nodes']} agents, {s['duration_s']:.0f} s asked, {s['elapsed_s']} s run")
        print("faults by kind:")
        for k in FAULT_WEIGHTS:
            if k in s["faults_excluded"]:
                print(f"  {k:32} excluded: {s['faults_excluded'][k]}")
            else:
                print(f"  {k:32} {s['faults'].get(k, 0)}")
        r = s["restores"]
        print(f"{'restores (client / ckptctl / disk)':34} {r['client']} / {r['ckptctl']} / {r['durable_reads']}"
              f"  served from {dict(sorted(r['served_from'].items()))}")
        print(f"{'bytes compared':34} {r['bytes_compared']} ({fmt_bytes(r['bytes_compared'])})")
        if s["dpu"]:
            p = s["dpu"]
            print(f"{'DPU agents: pulled / delivered':34} {p['agents']} agents: {fmt_bytes(p['pulled_bytes'])} / "
                  f"{fmt_bytes(p['delivered_bytes'])}, {p['pull_errors']} pull errors (live counters)")
        print(f"{'restore ms healthy p50 / max':34} {r['ms_healthy_p50']} / "
              f"{r['ms_healthy_max'] and round(r['ms_healthy_max'])}")
        print(f"{'restore ms during faults p50 / max':34} {r['ms_during_fault_p50']} / "
              f"{r['ms_during_fault_max'] and round(r['ms_during_fault_max'])}")
        v = s["versions"]
        print(f"{'versions saved / PROTECTED':34} {v['saved']} / {v['protected']} ({fmt_bytes(v['bytes_saved'])}); "
              f"by status {dict(sorted(v['by_status'].items()))}")
        print(f"{'incremental / lazy shards':34} {v['incremental_shards_committed']} / "
              f"{v['lazy_shards_committed']}; {v['compacted_shards']} stored self-contained (base discarded)")
        print(f"{'fault-time saves not PROTECTED':34} {v['fault_saves_not_protected']} (not failures)")
        print(f"{'lost beyond tolerance (exempt)':34} {v['exempt_lost']}")
        print(f"{'meta replicas stepped down':34} {s.get('meta_stepdowns', 0)} (lease lost: exited by design)")
        m = s["memory"]
        for node, x in m["nodes"].items():
            print(f"{'memory ' + node + ' baseline -> last':34} {x['baseline_used_bytes']} -> "
                  f"{x['last_used_bytes']} B, "
                  f"{x['baseline_holdings']} -> {x['last_holdings']} holdings")
        print("failures:")
        fk = s["failures_by_kind"]
        for k in ["wrong_bytes"] + MAIN_FAILURES:
            print(f"  {FAILURE_TITLES[k]:32} {fk[k]}")
        for k, c in sorted(fk["other"].items()):
            print(f"  {k:32} {c}")
        print("SUMMARY_JSON " + json.dumps({k: s[k] for k in s if k not in ("failures", "crashes")}, sort_keys=True))


def exclusion(text):
    """--exclude KIND:REASON -> (kind, reason); the reason is required."""
    kind, _, reason = text.partition(":")
    if not kind.strip() or not reason.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: give KIND:REASON (why the kind does not run)")
    return kind.strip(), reason.strip()


def repro_args(argv, seed):
    """The arguments of this run with its seed made explicit (and --keep)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--seed":
            skip = True
            continue
        if a.startswith("--seed=") or a == "--keep":
            continue
        out.append(a)
    return out + ["--seed", str(seed), "--keep"]


def in_namespace_or_reexec():
    """Re-executes this program in a private mount namespace (for the full-disk
    tmpfs) when possible; returns if it stays in this process."""
    if os.environ.get(NS_ENV) is not None or not shutil.which("unshare"):
        return
    if os.geteuid() == 0:
        cmd = ["unshare", "--mount", "--propagation", "private"]
    else:
        cmd = ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]
    if subprocess.run(cmd + ["true"], capture_output=True).returncode != 0:
        os.environ[NS_ENV] = "0"
        return
    os.environ[NS_ENV] = "1"
    sys.stdout.flush()
    os.execvp(cmd[0], cmd + ["--", sys.executable, os.path.abspath(__file__)] + sys.argv[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=180, help="seconds of faults (default 180)")
    p.add_argument("--seed", type=int, default=None, help="seed of sizes and faults (default: from the clock)")
    p.add_argument("--full-only", action="store_true",
                   help="never declare the frozen item unchanged (no incremental saves)")
    p.add_argument("--nodes", type=int, default=4, help="agents, 4..6 (default 4)")
    p.add_argument("--dpu", type=int, default=0,
                   help="how many of the agents (the last ones) are ckpt-dpu-agents (default 0)")
    p.add_argument("--keep", action="store_true", help="keep the logs even when the run passes")
    p.add_argument("--build-dir", default=os.environ.get("CKPT_BUILD_DIR", str(ROOT / "build")))
    p.add_argument("--agent-memory", type=parse_size, default=640 * MiB, help="each agent's memory tier")
    p.add_argument("--durable-size", type=parse_size, default=192 * MiB, help="the durable tmpfs")
    p.add_argument("--ucx-tls", default="tcp", help="UCX_TLS of the agents ('' = UCX's choice)")
    p.add_argument("--meta-replicas", type=int, default=0,
                   help="run N ckpt-meta replicas on an etcd of their own (/usr/bin/etcd) instead of one meta; "
                        "kill_meta then kills the one leading (default 0: one meta)")
    p.add_argument("--lease-ms", type=int, default=4000)
    p.add_argument("--heartbeat-ms", type=int, default=1000)
    p.add_argument("--peer-timeout-ms", type=int, default=2000)
    p.add_argument("--protect-timeout", type=float, default=60,
                   help="seconds a save on a healthy cluster may take to be PROTECTED")
    p.add_argument("--fault-protect-timeout", type=float, default=30,
                   help="seconds a save made during a fault is waited for before healing (then heal waits)")
    p.add_argument("--heal-timeout", type=float, default=60,
                   help="seconds re-protection (and the flush catching up) may take after healing")
    p.add_argument("--load-timeout", type=float, default=120, help="seconds one restore may take")
    p.add_argument("--mem-every", type=int, default=3, help="memory checkpoint every N faults")
    p.add_argument("--memory-tolerance", type=parse_size, default=64 * KiB,
                   help="growth per agent allowed at a memory checkpoint (default 64KiB)")
    p.add_argument("--ctl-share", type=float, default=0.3, help="share of version checks also done by ckptctl restore")
    p.add_argument("--faults", type=lambda t: [x for x in t.split(",") if x],
                   help="only these fault kinds (comma list of kill_agent, kill_meta, stop_agent, "
                        "kill_two_agents, disk_full)")
    p.add_argument("--exclude", action="append", default=[], metavar="KIND:REASON", type=exclusion,
                   help="run without this fault kind, for the reason given (printed in the summary); a kind "
                        "that cannot run here (disk_full without a mount namespace) fails the soak otherwise")
    p.add_argument("--sabotage", choices=["crash", "lose", "wrong-bytes", "leak"],
                   help="damage on purpose to show the soak catches it (the run must fail)")
    args = p.parse_args()
    if not 4 <= args.nodes <= 6:
        p.error("--nodes must be 4..6")
    if not 0 <= args.dpu <= args.nodes:
        p.error("--dpu must be 0..--nodes")
    if args.duration <= 0 or args.mem_every < 1:
        p.error("--duration must be > 0 and --mem-every >= 1")
    if args.peer_timeout_ms >= args.lease_ms:
        p.error("--peer-timeout-ms must be below --lease-ms (stops between the two are one fault variant)")
    bad = (set(args.faults or []) | {k for k, _ in args.exclude}) - set(FAULT_WEIGHTS)
    if bad:
        p.error(f"unknown fault kind(s) {', '.join(sorted(bad))}")
    if args.seed is None:
        args.seed = int(time.time()) % 100000
    build = pathlib.Path(args.build_dir)
    missing = [str(build / f) for f in ("bin/ckpt-meta", "bin/ckpt-agent", "bin/ckptctl", "python/ckpt/__init__.py",
                                        *(["bin/ckpt-dpu-agent"] if args.dpu else []))
               if not (build / f).exists()]
    if args.meta_replicas and not os.access("/usr/bin/etcd", os.X_OK):
        print("chaos_soak: SKIP: --meta-replicas needs /usr/bin/etcd (Debian package etcd-server)", file=sys.stderr)
        return 77
    if missing:
        print(f"chaos_soak: SKIP: not built: {', '.join(missing)} (cmake --build {build} --target "
              "ckpt-meta ckpt-agent ckptctl python_module)", file=sys.stderr)
        return 77
    sys.path.insert(0, str(build / "python"))
    try:
        import ckpt  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        print(f"chaos_soak: SKIP: cannot import the ckpt module or numpy: {e}", file=sys.stderr)
        return 77
    in_namespace_or_reexec()

    soak = Soak(args)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    # Both, explicitly: a shell starts background jobs with SIGINT ignored, and
    # Python then would not turn it into KeyboardInterrupt.
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    graceful = False
    try:
        soak.run()
        graceful = True
    except KeyboardInterrupt:
        soak.interrupted = True
        soak.log("interrupted: stopping every process")
    except Failure as e:
        soak.fail("harness", str(e))
    except Exception:  # noqa: BLE001 - a bug in the soak is a failure too
        soak.fail("harness", traceback.format_exc())
    finally:
        try:  # read while the agents still run
            soak.dpu_final = soak.dpu_counters() if args.dpu else {}
        except Exception:  # noqa: BLE001 - a summary line, not a check
            soak.dpu_final = {}
        try:
            soak.shutdown(graceful)
        except BaseException:  # noqa: BLE001 - cleanup must go on
            traceback.print_exc()
        failed = bool(soak.failures) or soak.interrupted
        s = soak.summary(now() - soak.t0)
        with open(soak.work / "summary.json", "w") as f:
            json.dump(s, f, indent=1, sort_keys=True)
        soak.print_summary(s)
        soak.cleanup(keep_logs=args.keep or failed)
    cmd = "/usr/bin/python3 tests/chaos/chaos_soak.py " + " ".join(repro_args(sys.argv[1:], args.seed))
    if soak.interrupted:
        print(f"INTERRUPTED; logs kept in {soak.work}")
        code = 130
    elif failed:
        print(f"FAILED: {len(soak.failures)} failure(s). Reproduce: {cmd}\nlogs: {soak.work} "
              f"(meta.log, n*.log, soak.log, memory.csv, summary.json)")
        code = 1
    else:
        print(f"PASSED (seed {args.seed}){'; logs in ' + str(soak.work) if args.keep else ''}")
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # worker threads may still sit in a C++ call: do not wait for them


if __name__ == "__main__":
    sys.exit(main())
