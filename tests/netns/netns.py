#!/usr/bin/python3
"""Many hosts, not one loopback (issue 36): a ckpt cluster whose daemons each run in a network
namespace of their own, joined by veth pairs to a bridge, with faults on the links.

Two layers, both usable from ctest tests (tests/netns/*_test.py), a soak or a shell:

  Net: a private network. A "switch" namespace holds the bridge (br0); each host is a
  namespace with one veth (eth0) plugged into the bridge and an address on 10.213.0.0/24.
  Nothing is added to the root namespace: no interface, no route, no rule; traffic stays in
  the namespaces the Net made. Faults, per host pair (a "link") or per host:
    loss(a, b, pct)              a -> b packets dropped at random (nftables numgen), one way
    cut(a, b, both=True)         a -> b (and b -> a) dropped (nftables)
    partition(A, B)              every host of A cut from every host of B, both ways
    rate(a, rate, b=None)        a's egress (to b only, with b) limited (tc tbf; htb+u32 per link)
    delay(a, ms, jitter, b=None) netem latency; raises NetemUnavailable where the kernel has no
                                 sch_netem (check Net.netem_reason() first; this machine's
                                 kernel has none, so latency tests skip there)
    heal(host=None)              every rule and qdisc gone (of one host, or all)
    move(host, new_address)      the host's address changes (its daemons must be restarted)
  spawn(host, argv) runs a process inside a host's namespace (ip netns exec), with
  PR_SET_PDEATHSIG(SIGKILL) so that it dies with the harness.

  Cluster: ckpt-meta on host "meta" and ckpt-agent nK on host nK, mutual TLS as shipped (a CA
  of its own made with `ckptctl certs`; every certificate names the address its holder is
  reached at), UCX over TCP on eth0 (the veth, never loopback), trainers (tests/netns/rank.py,
  the Python client, one process per rank) in the namespace of their agent, ckptctl with an
  admin certificate run on the meta host.

Naming and clean-up: every namespace is ckpt-t<pid>-<k>-<name> (pid: the harness's process),
memory tiers /dev/shm/ckpt-t<pid>-<k>/, work dirs $TMPDIR/ckpt-netns-<pid>-*. At start,
sweep_stale() removes namespaces, memory tiers and work dirs of that family whose pid is no
longer running (a harness that was SIGKILLed): it kills what still runs inside such a
namespace (`ip netns pids`), then deletes it. On exit (atexit) and on SIGTERM, SIGINT and SIGHUP
the harness kills its processes by PID and deletes its namespaces; the daemons also die with
it by PR_SET_PDEATHSIG. A work dir is kept (and left alone by later sweeps) when a test
failed: it holds the logs.

  /usr/bin/python3 tests/netns/netns.py probe    # can namespaces be made here? netem?
  /usr/bin/python3 tests/netns/netns.py sweep    # remove what dead harnesses left
  /usr/bin/python3 tests/netns/netns.py demo     # 6 hosts, every fault once, traffic measured

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN in the root namespace), iproute2 (`ip`, `tc`) and
nftables (`nft`); docs/testing.md "Network namespaces".
"""
import atexit
import ctypes
import hashlib
import json
import os
import pathlib
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
from localnet import ClusterTls, tls_env, tls_flags  # noqa: E402

SKIP = 77            # ctest's SKIP_RETURN_CODE for these tests
FAMILY = "ckpt-t"    # prefix of everything the harness names
SUBNET = "10.213.0"  # /24 inside the harness's own namespaces only
NFT_TABLE = "ckpt_netns"
PY = "/usr/bin/python3"  # the interpreter with numpy and torch (scripts/setup-deps.sh)

_nets = []           # live Nets, torn down at exit
_handlers_installed = False
_teardown_lock = threading.Lock()


class Unavailable(Exception):
    """Namespaces (or a tool the harness needs) are not usable here: the test skips."""


class NetemUnavailable(Unavailable):
    pass


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _run(argv, check=True, timeout=30, input=None):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {(r.stderr or r.stdout).strip()}")
    return r


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent():
    # Runs in the child between fork and exec: the child (ip netns exec execs the daemon in
    # place, keeping this setting) gets SIGKILL when the harness dies, however it dies.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def list_namespaces():
    r = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def kill_namespace(ns):
    """SIGKILLs every process inside namespace ns (ours by name) and deletes it."""
    r = _run(["ip", "netns", "pids", ns], check=False)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run(["ip", "netns", "delete", ns], check=False)


def sweep_stale():
    """Removes namespaces, memory tiers and work dirs named by harnesses that no longer run
    (ckpt-t<pid>-...). Returns what it removed."""
    removed = []
    pat = re.compile(rf"^{FAMILY}(\d+)-")
    for ns in list_namespaces():
        m = pat.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            kill_namespace(ns)
            removed.append(f"namespace {ns}")
    for d in pathlib.Path("/dev/shm").glob(f"{FAMILY}*"):
        m = pat.match(d.name + "-")
        if m and not _pid_alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    tmp = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
    for d in tmp.glob("ckpt-netns-*"):
        m = re.match(r"^ckpt-netns-(\d+)-", d.name)
        if m and not _pid_alive(int(m.group(1))) and not (d / "KEEP").exists():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


def probe():
    """None if this process can build a Net here, else the reason (for a skip)."""
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces"
    for tool in ("ip", "tc", "nft"):
        if shutil.which(tool) is None:
            pkg = "nftables" if tool == "nft" else "iproute2"
            return f"no `{tool}` command (apt-get install {pkg}; scripts/setup-deps.sh)"
    ns = f"{FAMILY}{os.getpid()}-probe"
    r = _run(["ip", "netns", "add", ns], check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace here: {r.stderr.strip()}"
    try:
        r = _run(["ip", "-n", ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1"], check=False)
        if r.returncode != 0:
            return f"cannot create a veth pair in a namespace: {r.stderr.strip()}"
        r = _run(["ip", "netns", "exec", ns, "nft", "add", "table", "inet", NFT_TABLE], check=False)
        if r.returncode != 0:
            return f"nftables does not work in a namespace here: {r.stderr.strip()}"
    finally:
        _run(["ip", "netns", "delete", ns], check=False)
    return None


def _netem_probe():
    ns = f"{FAMILY}{os.getpid()}-netem"
    _run(["ip", "netns", "add", ns], check=False)
    try:
        r = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                 check=False)
        if r.returncode == 0:
            return None
        return (f"tc netem is not available in this kernel ({os.uname().release}: "
                f"`tc qdisc add ... netem` says '{r.stderr.strip()}'): no latency or jitter emulation")
    finally:
        _run(["ip", "netns", "delete", ns], check=False)


_netem_reason = "unprobed"


def netem_reason():
    """None if tc netem works here (latency, jitter), else why not. Probed once."""
    global _netem_reason
    if _netem_reason == "unprobed":
        _netem_reason = _netem_probe()
    return _netem_reason


def _teardown_all():
    with _teardown_lock:
        for net in list(_nets):
            net.teardown()


def _on_signal(sig, _frame):
    _teardown_all()
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)


def _install_handlers():
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_teardown_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, _on_signal)


class Host:
    def __init__(self, net, name, ns, index, address):
        self.net, self.name, self.ns, self.index, self.address = net, name, ns, index, address

    def __repr__(self):
        return f"{self.name}({self.address})"

    def exec(self, argv, check=True, timeout=30, input=None):
        """Runs argv inside the host's namespace and waits for it (a CompletedProcess)."""
        return _run(["ip", "netns", "exec", self.ns] + list(argv), check=check, timeout=timeout, input=input)


class Net:
    """A bridge and one namespace per host (add_host); faults; teardown. See the module doc."""

    _count = 0

    def __init__(self, label="net"):
        reason = probe()
        if reason:
            raise Unavailable(reason)
        for what in sweep_stale():
            log(f"swept stale {what}")
        Net._count += 1
        self.tag = f"{FAMILY}{os.getpid()}-{Net._count}"
        self.label = label
        self.hosts = {}
        self.procs = []
        self.faults = []
        self.clusters = []
        self.torn_down = False
        self._next_rule_id = 0
        self.sw = f"{self.tag}-sw"
        _install_handlers()
        _nets.append(self)
        _run(["ip", "netns", "add", self.sw])
        _run(["ip", "-n", self.sw, "link", "set", "lo", "up"])
        _run(["ip", "-n", self.sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.sw, "link", "set", "br0", "up"])

    # ---- hosts
    def add_host(self, name):
        index = len(self.hosts)
        ns = f"{self.tag}-{name}"
        address = f"{SUBNET}.{10 + index}"
        port = f"p{index}"  # the bridge port, in the switch namespace (names there are ours alone)
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", self.sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _run(["ip", "-n", self.sw, "link", "set", port, "master", "br0", "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        host = Host(self, name, ns, index, address)
        # The fault rules' table: an input and an output chain, empty until a fault.
        host.exec(["nft", "-f", "-"], input=(
            f"table inet {NFT_TABLE} {{\n"
            "  chain in { type filter hook input priority 0; policy accept; }\n"
            "  chain out { type filter hook output priority 0; policy accept; }\n"
            "}\n"))
        self.hosts[name] = host
        return host

    def host(self, h):
        return h if isinstance(h, Host) else self.hosts[h]

    # ---- processes
    def spawn(self, host, argv, log_path, env=None):
        """Starts argv in host's namespace, stdout and stderr appended to log_path. The Popen's
        pid is the program's (ip netns exec execs it in place)."""
        host = self.host(host)
        with open(log_path, "ab") as f:
            f.write(f"=== {time.strftime('%H:%M:%S')} start in {host}: {' '.join(map(str, argv))}\n".encode())
            f.flush()
            p = subprocess.Popen(["ip", "netns", "exec", host.ns] + [str(a) for a in argv], stdin=subprocess.DEVNULL,
                                 stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
        self.procs.append(p)
        return p

    def spawn_piped(self, host, argv, stderr_path, env=None):
        """Starts argv in host's namespace with stdin and stdout as pipes (text, line-buffered)."""
        host = self.host(host)
        err = open(stderr_path, "ab")
        try:
            p = subprocess.Popen(["ip", "netns", "exec", host.ns] + [str(a) for a in argv], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=err, env=env, text=True, bufsize=1,
                                 preexec_fn=_die_with_parent)
        finally:
            err.close()
        self.procs.append(p)
        return p

    # ---- faults (nftables rules in the hosts' own namespaces; tc on their eth0)
    def _rule(self, host, chain, expr, what):
        self._next_rule_id += 1
        comment = f"f{self._next_rule_id}"
        host.exec(["nft", "add", "rule", "inet", NFT_TABLE, chain, *expr.split(), "comment", f'"{comment}"'])
        self.faults.append((host.name, what))

    def cut(self, a, b, both=True):
        """Drops every packet a sends to b (and, with both, b sends to a)."""
        a, b = self.host(a), self.host(b)
        self._rule(a, "out", f"ip daddr {b.address} drop", f"cut {a.name} -> {b.name}")
        if both:
            self._rule(b, "out", f"ip daddr {a.address} drop", f"cut {b.name} -> {a.name}")

    def loss(self, a, b, pct, both=False):
        """Drops pct % of the packets a sends to b, at random (and b to a, with both)."""
        a, b = self.host(a), self.host(b)
        if not 0 < pct <= 100:
            raise ValueError(f"loss must be in (0, 100], got {pct}")
        pairs = [(a, b), (b, a)] if both else [(a, b)]
        for x, y in pairs:
            self._rule(x, "out", f"ip daddr {y.address} numgen random mod 100 < {int(pct)} drop",
                       f"loss {pct}% {x.name} -> {y.name}")

    def partition(self, side_a, side_b):
        """Every host of side_a cut from every host of side_b, both ways."""
        for a in side_a:
            for b in side_b:
                self.cut(a, b, both=True)

    def rate(self, a, rate, b=None):
        """Limits what a sends (to b only, with b) to `rate` (tc units: "8mbit", "100kbit")."""
        a = self.host(a)
        if b is None:
            a.exec(["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "32kb",
                    "latency", "400ms"])
            self.faults.append((a.name, f"rate {rate} {a.name} -> *"))
            return
        b = self.host(b)
        r = a.exec(["tc", "qdisc", "show", "dev", "eth0"])
        if "htb 1:" not in r.stdout:
            a.exec(["tc", "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1"])
            a.exec(["tc", "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit"])
        cls = f"1:{10 + b.index}"
        a.exec(["tc", "class", "replace", "dev", "eth0", "parent", "1:", "classid", cls, "htb", "rate", rate,
                "ceil", rate])
        a.exec(["tc", "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                "match", "ip", "dst", f"{b.address}/32", "flowid", cls])
        self.faults.append((a.name, f"rate {rate} {a.name} -> {b.name}"))

    def delay(self, a, ms, jitter_ms=0, b=None):
        """netem latency on what a sends (b: not supported per link yet). NetemUnavailable
        where the kernel has no sch_netem."""
        reason = netem_reason()
        if reason:
            raise NetemUnavailable(reason)
        if b is not None:
            raise NotImplementedError("per-link latency (needs a classful qdisc with a netem leaf)")
        a = self.host(a)
        argv = ["tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{ms}ms"]
        if jitter_ms:
            argv += [f"{jitter_ms}ms"]
        a.exec(argv)
        self.faults.append((a.name, f"delay {ms}ms+-{jitter_ms} {a.name} -> *"))

    def heal(self, host=None):
        """Removes every fault (of one host, or of all)."""
        hosts = [self.host(host)] if host is not None else list(self.hosts.values())
        for h in hosts:
            h.exec(["nft", "flush", "chain", "inet", NFT_TABLE, "in"])
            h.exec(["nft", "flush", "chain", "inet", NFT_TABLE, "out"])
            h.exec(["tc", "qdisc", "del", "dev", "eth0", "root"], check=False)  # none: fine
        names = {h.name for h in hosts}
        self.faults = [f for f in self.faults if f[0] not in names]

    def move(self, host, address=None):
        """Gives host a new address (default: SUBNET.(100 + index)); its rules are healed
        first (they name addresses). Returns the new address."""
        host = self.host(host)
        address = address or f"{SUBNET}.{100 + host.index}"
        for h in self.hosts.values():
            if any(host.address in line for line in h.exec(["nft", "list", "chain", "inet", NFT_TABLE, "out"])
                   .stdout.splitlines()):
                raise RuntimeError(f"{h.name} has rules naming {host.name}'s address: heal() first")
        _run(["ip", "-n", host.ns, "addr", "del", f"{host.address}/24", "dev", "eth0"])
        _run(["ip", "-n", host.ns, "addr", "add", f"{address}/24", "dev", "eth0"])
        host.address = address
        return address

    def reachable(self, a, b, port=7, timeout=1.0):
        """True if a TCP connect from a to b:port gets an answer (accepted or refused)."""
        a, b = self.host(a), self.host(b)
        code = ("import socket,sys\n"
                "s=socket.socket(); s.settimeout(float(sys.argv[3]))\n"
                "try:\n s.connect((sys.argv[1], int(sys.argv[2]))); print('open')\n"
                "except ConnectionRefusedError: print('refused')\n"
                "except OSError as e: print('none', e)\n")
        r = a.exec([PY, "-c", code, b.address, str(port), str(timeout)], check=False, timeout=timeout + 10)
        return r.stdout.startswith(("open", "refused"))

    # ---- teardown
    def kill_procs(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def teardown(self):
        if self.torn_down:
            return
        self.torn_down = True
        for c in list(self.clusters):
            if not c.stopped:
                c.stop(keep=True)  # an exception or a signal ended the test: its logs stay
        self.kill_procs()
        for h in list(self.hosts.values()):
            kill_namespace(h.ns)
        kill_namespace(self.sw)
        shutil.rmtree(f"/dev/shm/{self.tag}", ignore_errors=True)
        if self in _nets:
            _nets.remove(self)


# ---------------------------------------------------------------------------
# Payloads the trainers save and the tests check (deterministic by seed/job/step/rank).

def payload(seed, job, step, rank, size):
    import numpy as np
    if size == 0:
        return np.zeros(0, np.uint8)
    jid = int(hashlib.sha256(job.encode()).hexdigest()[:8], 16)
    rng = np.random.Generator(np.random.PCG64([seed, jid, step, rank]))
    return np.frombuffer(rng.bytes(size), dtype=np.uint8)


def payload_sha(seed, job, step, rank, size):
    return hashlib.sha256(payload(seed, job, step, rank, size).tobytes()).hexdigest()


# ---------------------------------------------------------------------------
# The cluster


class NetTls(ClusterTls):
    """ClusterTls whose meta and node certificates name the addresses they are reached at."""

    def meta_at(self, address):
        return self._issue(("meta", address), "create-meta", "--host", f"{address},127.0.0.1")

    def node_at(self, node_id, address):
        return self._issue(("node", node_id, address), "create-node", "--node-id", node_id, "--host",
                           f"{address},127.0.0.1")


class Rank:
    """One trainer process (tests/netns/rank.py) in its agent's namespace, driven by JSON lines."""

    def __init__(self, cluster, job, rank, world, node, protection, seed, rpc_timeout=10.0):
        self.cluster, self.job, self.rank, self.world, self.node = cluster, job, rank, world, node
        c = cluster
        host = c.net.host(node)
        argv = [PY, ROOT / "tests" / "netns" / "rank.py", "--meta", c.meta_addr, "--socket",
                c.socket(node), "--job", job, "--rank", rank, "--world-size", world, "--protection", protection,
                "--seed", seed, "--rpc-timeout", rpc_timeout]
        env = dict(c.env, PYTHONPATH=str(c.build / "python"), PYTHONDONTWRITEBYTECODE="1",
                   **tls_env(c.tls.client("trainer", "netns", ["*"])))
        if "LD_PRELOAD" in os.environ:
            env["LD_PRELOAD"] = os.environ["LD_PRELOAD"]
        self.proc = c.net.spawn_piped(host, argv, c.work / f"rank-{job}-{rank}-{node}.err", env=env)
        self.buf = ""

    def call(self, timeout=60, **req):
        """Sends one request, returns the answer (a dict; ok False with error on failure)."""
        err = self.send(**req)
        return err if err else self.recv(req["op"], timeout)

    def send(self, **req):
        """Sends one request without waiting (recv() reads the answer): None, or an answer
        saying why it could not be sent."""
        if self.proc.poll() is not None:
            return {"ok": False, "error": f"rank process exited with {self.proc.returncode}"}
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            return {"ok": False, "error": f"rank process: {e}"}
        return None

    def recv(self, op, timeout=60):
        """The answer to the request send() sent; after timeout s the rank is killed."""
        req = {"op": op}
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while "\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                return {"ok": False, "error": f"no answer to {req['op']} within {timeout} s (rank killed)"}
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536).decode()
                if not chunk:
                    return {"ok": False, "error": f"rank process exited ({self.proc.wait()})"}
                self.buf += chunk
        line, self.buf = self.buf.split("\n", 1)
        return json.loads(line)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


class JobDriver:
    """One job's ranks driven together, each result checked with `checks` (Checks): save a step
    on every rank, wait for it to be PROTECTED (steps seen so are kept in .acked, in order), and
    restore steps on every rank against the payloads. size(step, rank) gives each payload's
    size; `waiter` is the index of the rank that waits."""

    def __init__(self, checks, ranks, seed, job, size, waiter=1):
        self.t, self.ranks, self.seed, self.job, self.size, self.waiter = checks, ranks, seed, job, size, waiter
        self.acked = []

    def save_all(self, step):
        ok = True
        for r in self.ranks:
            a = r.call(op="save", step=step, size=self.size(step, r.rank))
            ok = self.t.check(a["ok"], f"step {step} rank {r.rank} saved on {r.node}", a.get("error")) and ok
        return ok

    def wait_protected(self, step, timeout=30, unknown_for=0):
        """Seconds until step was PROTECTED, None if it was not. unknown_for: how long to keep
        asking while meta does not know the step (one committed while no meta could begin it:
        its agents begin it once one answers, retrying every second)."""
        t0 = time.monotonic()
        while True:
            a = self.ranks[self.waiter].call(op="wait", step=step, level="protected", timeout=timeout)
            if a["ok"] or "no version at step" not in a.get("error", "") or time.monotonic() - t0 > unknown_for:
                break
            time.sleep(0.5)  # bounded poll of real daemons
        if self.t.check(a["ok"], f"step {step} PROTECTED", a.get("error")):
            self.acked.append(step)
            return time.monotonic() - t0
        return None

    def restore_all(self, steps, what):
        for step in steps:
            for r in self.ranks:
                a = r.call(op="load", step=step)
                want = payload_sha(self.seed, self.job, step, r.rank, self.size(step, r.rank))
                self.t.check(a["ok"] and a["sha256"] == want and a["tag_ok"],
                             f"{what}: step {step} rank {r.rank} restored byte-identical on {r.node} "
                             f"({a.get('served_from')})", str(a))


class Cluster:
    """ckpt-meta on host "meta" and agents n1..nN on hosts of the same names (module doc)."""

    def __init__(self, net, agents, build=None, lease_ms=5000, heartbeat_ms=1000, peer_timeout_ms=3000,
                 memory="64MiB", label="cluster", extra_meta=(), extra_agent=(), meta_replicas=0):
        self.net = net
        self.build = pathlib.Path(build or os.environ.get("CKPT_BUILD_DIR", ROOT / "build")).resolve()
        self.bin = self.build / "bin"
        missing = [b for b in ("ckpt-meta", "ckpt-agent", "ckptctl") if not (self.bin / b).exists()]
        if missing:
            raise Unavailable(f"{', '.join(missing)} not built in {self.bin}")
        if not list((self.build / "python" / "ckpt").glob("_ckpt*.so")):
            raise Unavailable(f"the Python module is not built in {self.build}/python (target python_module)")
        self.work = pathlib.Path(tempfile.mkdtemp(prefix=f"ckpt-netns-{os.getpid()}-{label}-",
                                                  dir=os.environ.get("TMPDIR", "/tmp")))
        self.shm = pathlib.Path(f"/dev/shm/{net.tag}")
        self.ranks = []
        self.stopped = False
        net.clusters.append(self)
        self.shm.mkdir(mode=0o700)
        self.lease_ms, self.heartbeat_ms, self.peer_timeout_ms = lease_ms, heartbeat_ms, peer_timeout_ms
        self.memory = memory
        self.extra_agent = list(extra_agent)
        # The daemons' environment: no proxies; no LD_PRELOAD (ASan builds preload the runtime
        # for the Python trainers only; the daemons carry their own, as in tests/chaos).
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("LD_PRELOAD", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                                 "grpc_proxy", "all_proxy", "ALL_PROXY")}
        # The data plane over TCP on the veth: no shared memory between "hosts".
        self.env.update(UCX_TLS="tcp", UCX_NET_DEVICES="eth0")
        self.tls = NetTls(self.work / "pki", self.bin)
        self.admin_env = dict(self.env, **self.tls.admin_env())
        self.meta_replicas = meta_replicas
        self.meta_hosts = [net.add_host(f"m{i}") for i in range(1, meta_replicas + 1)]
        # One meta on host "meta"; with replicas, ckptctl runs on a host of its own ("admin").
        self.meta_host = net.add_host("admin" if meta_replicas else "meta")
        self.agent_hosts = [net.add_host(f"n{i}") for i in range(1, agents + 1)]
        self.meta_addr = (",".join(f"{h.address}:7400" for h in self.meta_hosts) if meta_replicas
                          else f"{self.meta_host.address}:7400")
        self.meta_proc = None
        self.meta_procs = {}  # replica host name -> Popen (meta_replicas)
        self.etcd_procs = {}  # replica host name -> Popen of the etcd member beside it
        self.extra_meta = list(extra_meta)
        self.agents = {}  # node -> Popen
        log(f"{label}: {len(net.hosts)} hosts on the bridge: " +
            ", ".join(f"{h.name}={h.address}" for h in net.hosts.values()) + f"; logs in {self.work}")
        if meta_replicas:
            # etcd's members have a CA of their own (as an operator would keep them): meta shows
            # them a certificate of that CA, and they show meta theirs.
            self.etcd_tls = NetTls(self.work / "etcd-pki", self.bin)
            for h in self.meta_hosts:
                self.start_etcd(h.name)
            for h in self.meta_hosts:
                self.wait_listening(h, 2379, self.etcd_procs[h.name], f"etcd {h.name}")
            for h in self.meta_hosts:
                self.start_replica(h.name)
            if self.wait_leader(60) is None:
                raise RuntimeError(f"no meta replica leads after 60 s (logs in {self.work})")
        else:
            self.start_meta(extra_meta)
        for h in self.agent_hosts:
            self.start_agent(h.name)
        self.wait_alive([h.name for h in self.agent_hosts], 60)

    def socket(self, node):
        return self.work / node / "run" / "agent.sock"

    def start_meta(self, extra=()):
        self.meta_proc = self.net.spawn(self.meta_host, [
            self.bin / "ckpt-meta", "--listen", self.meta_addr, "--metrics-listen", "127.0.0.1:9400",
            "--data-dir", self.work / "meta", "--lease-ms", self.lease_ms, "--heartbeat-ms", self.heartbeat_ms,
            *tls_flags(self.tls.meta_at(self.meta_host.address)), *extra], self.work / "meta.log", env=self.env)
        self.wait_listening(self.meta_host, 7400, self.meta_proc, "ckpt-meta")

    # ---- meta replicas (meta_replicas > 0): on hosts m1..mN, each beside an etcd member
    def start_etcd(self, name):
        """Starts (or restarts, on its data dir) the etcd member on replica host `name`: mutual
        TLS to clients and to its peers, with the etcd CA's certificates."""
        host = self.net.host(name)
        files = self.etcd_tls.meta_at(host.address)
        peers = ",".join(f"{h.name}=https://{h.address}:2380" for h in self.meta_hosts)
        a = host.address
        p = self.net.spawn(host, [
            "/usr/bin/etcd", "--name", name, "--data-dir", self.work / f"etcd-{name}",
            "--listen-client-urls", f"https://{a}:2379", "--advertise-client-urls", f"https://{a}:2379",
            "--listen-peer-urls", f"https://{a}:2380", "--initial-advertise-peer-urls", f"https://{a}:2380",
            "--initial-cluster", peers, "--initial-cluster-token", self.net.tag, "--initial-cluster-state", "new",
            "--cert-file", files.cert, "--key-file", files.key, "--trusted-ca-file", files.ca,
            "--client-cert-auth", "--peer-cert-file", files.cert, "--peer-key-file", files.key,
            "--peer-trusted-ca-file", files.ca, "--peer-client-cert-auth",
            # --pre-vote: a member that was cut off does not depose etcd's leader when it comes
            # back (etcd 3.4 has it off by default; docs/operations.md says to turn it on).
            "--pre-vote", "--heartbeat-interval", "100", "--election-timeout", "1000"],
            self.work / f"etcd-{name}.log", env=self.env)
        self.etcd_procs[name] = p
        return p

    def start_replica(self, name):
        """Starts (or restarts) ckpt-meta on replica host `name`, a replica of the etcd members'
        log; only the leader opens --listen."""
        host = self.net.host(name)
        endpoints = ",".join(f"{h.address}:2379" for h in self.meta_hosts)
        etcd = self.etcd_tls.meta_at(host.address)
        p = self.net.spawn(host, [
            self.bin / "ckpt-meta", "--listen", f"{host.address}:7400", "--metrics-listen", "127.0.0.1:9400",
            "--data-dir", self.work / f"meta-{name}", "--lease-ms", self.lease_ms,
            "--heartbeat-ms", self.heartbeat_ms, "--replica-of", f"etcd://{endpoints}/ckpt/{self.net.tag}",
            "--etcd-ca", etcd.ca, "--etcd-cert", etcd.cert, "--etcd-key", etcd.key,
            *tls_flags(self.tls.meta_at(host.address)), *self.extra_meta], self.work / f"meta-{name}.log",
            env=self.env)
        self.meta_procs[name] = p
        return p

    def replicas(self):
        """ckptctl status's replicas: {host name: (leader, applied_index)}, {} if meta cannot be
        asked."""
        d = self.ctl("status", check=False, timeout=5)
        by_address = {h.address: h.name for h in self.meta_hosts}
        out = {}
        for r in (d or {}).get("meta_replicas", []):
            out[by_address.get(r["address"].rsplit(":", 1)[0], r["address"])] = (r["leader"], r["applied_index"])
        return out

    def leader(self):
        """The replica host whose meta leads (as meta's status says), or None."""
        return next((n for n, (lead, _) in self.replicas().items() if lead), None)

    def wait_leader(self, timeout, other_than=None):
        """Waits for a leader (other than `other_than`): its host name, None on timeout."""
        found = []

        def led():
            n = self.leader()
            if n is not None and n != other_than:
                found.append(n)
                return True
            return False
        ok, _ = wait_for(led, timeout, period=0.2)
        return found[-1] if ok else None

    def start_agent(self, node):
        host = self.net.host(node)
        (self.work / node / "run").mkdir(parents=True, exist_ok=True)
        mem = self.shm / node
        if not mem.exists():
            mem.mkdir(mode=0o700)
        a = host.address
        p = self.net.spawn(host, [
            self.bin / "ckpt-agent", "--node-id", node, "--meta", self.meta_addr, "--listen", f"{a}:7401",
            "--data-listen", f"{a}:7402", "--metrics-listen", "127.0.0.1:9401",
            "--run-dir", self.work / node / "run", "--memory", self.memory, "--memory-dir", mem,
            "--peer-timeout-ms", self.peer_timeout_ms, "--rpc-timeout-ms", "3000", "--data-chunk", "1MiB",
            *tls_flags(self.tls.node_at(node, a)), *self.extra_agent], self.work / f"{node}.log", env=self.env)
        self.agents[node] = p
        self.wait_listening(host, 7401, p, f"ckpt-agent {node}")
        return p

    def kill_agent(self, node, sig=signal.SIGKILL):
        p = self.agents[node]
        if p.poll() is None:
            p.send_signal(sig)
            p.wait(timeout=30)

    def wait_listening(self, host, port, proc, what, timeout=30):
        deadline = time.monotonic() + timeout
        code = ("import socket,sys\ns=socket.socket(); s.settimeout(0.5)\n"
                "sys.exit(0 if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 1)\n")
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode} during start-up (logs in {self.work})")
            if host.exec([PY, "-c", code, host.address, str(port)], check=False).returncode == 0:
                return
            time.sleep(0.1)  # bounded poll of a real daemon's start-up
        raise RuntimeError(f"{what} not listening on {host.address}:{port} after {timeout} s")

    # ---- ckptctl, on the meta host, as an admin
    def ctl(self, *args, timeout=10, check=True):
        argv = ["ip", "netns", "exec", self.meta_host.ns, str(self.bin / "ckptctl"), "--meta", self.meta_addr,
                "--json", "--timeout", str(timeout), *[str(a) for a in args]]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 30, env=self.admin_env)
        self.last_ctl_error = r.stderr.strip()
        if r.returncode != 0:
            if check:
                raise RuntimeError(f"ckptctl {' '.join(map(str, args))}: exit {r.returncode}: {r.stderr.strip()}")
            return None
        return json.loads(r.stdout) if r.stdout.strip() else {}

    def nodes(self):
        d = self.ctl("nodes", check=False)
        return {n["id"]: n for n in d["nodes"]} if d else {}

    def node_states(self):
        return {k: v["state"].lower() for k, v in self.nodes().items()}

    def versions(self, job):
        d = self.ctl("versions", job, check=False)
        return {v["step"]: v for v in d["versions"]} if d else {}

    def holdings(self, node, job=None):
        """What node's agent holds in its memory tier: [{job, step, what, role, size_bytes, state}],
        None if it cannot be asked."""
        d = self.ctl("holdings", node, *(["--job", job] if job else []), check=False)
        return d["holdings"] if d else None

    def copies(self, job, step):
        """{rank: {node: (role, state)}} of one version (ckptctl inspect), None if unknown."""
        d = self.ctl("inspect", job, step, check=False)
        if not d:
            return None
        return {s["rank"]: {c["node_id"]: (c["role"], c["state"]) for c in s["copies"]} for s in d["shards"]}

    def wait_alive(self, nodes, timeout):
        ok, _ = wait_for(lambda: all(self.node_states().get(n) == "alive" for n in nodes), timeout)
        if not ok:
            raise RuntimeError(f"nodes {nodes} not all ALIVE after {timeout} s: {self.node_states()}")

    def create_job(self, job, world, protection_flags, keep=3):
        self.ctl("create-job", job, "--world-size", world, *protection_flags, "--keep-in-memory", keep)

    def rank(self, job, rank, world, node, protection, seed=1, rpc_timeout=10.0):
        r = Rank(self, job, rank, world, node, protection, seed, rpc_timeout)
        self.ranks.append(r)
        return r

    def crash_lines(self):
        """Lines of the daemons' logs that mean a crash (sanitizers, asserts, signals)."""
        pat = re.compile(r"AddressSanitizer|LeakSanitizer|runtime error: |Assertion `|terminate called|"
                         r"Segmentation fault|double free")
        out = []
        for f in self.work.glob("*.log"):
            out += [f"{f.name}: {line}" for line in f.read_text(errors="replace").splitlines() if pat.search(line)]
        return out

    def stop(self, keep=False):
        if self.stopped:
            return
        self.stopped = True
        for r in self.ranks:
            r.kill()
        self.net.kill_procs()
        shutil.rmtree(self.shm, ignore_errors=True)
        if keep:
            (self.work / "KEEP").touch()
            log(f"logs kept in {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)


class StateWatch:
    """Polls meta's node states (ckptctl nodes, every `period` s) in a thread and remembers when
    each node was first seen in each state after mark(): detection times without blocking the
    test's own calls."""

    def __init__(self, cluster, period=0.2):
        self.c, self.period = cluster, period
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.first = {}       # (node, state) -> seconds after mark()
        self.current = {}
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self._run, name="state-watch", daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop_ev.is_set():
            states = self.c.node_states()
            now = time.monotonic()
            with self.lock:
                if states:
                    self.current = states
                for node, st in states.items():
                    self.first.setdefault((node, st), now - self.t0)
            self.stop_ev.wait(self.period)

    def mark(self):
        """Forgets what was seen; times count from now."""
        with self.lock:
            self.t0 = time.monotonic()
            self.first = {}
        return self.t0

    def seen(self, node, state):
        with self.lock:
            return self.first.get((node, state))

    def wait(self, node, state, timeout):
        """Seconds from mark() until node was first seen in state; None after timeout s."""
        ok, _ = wait_for(lambda: self.seen(node, state) is not None, timeout, period=0.05)
        return self.seen(node, state) if ok else None

    def stop(self):
        self.stop_ev.set()
        self.thread.join(timeout=30)


def wait_for(fn, timeout, period=0.2):
    """(True, seconds) once fn() is true, polled every period s; (False, timeout) otherwise."""
    t0 = time.monotonic()
    while True:
        if fn():
            return True, time.monotonic() - t0
        if time.monotonic() - t0 >= timeout:
            return False, timeout
        time.sleep(period)  # bounded poll of real daemons


# ---------------------------------------------------------------------------
# Test plumbing shared by tests/netns/*_test.py


class Checks:
    def __init__(self, name):
        self.name = name
        self.failures = []
        self.bugs = []
        self.timings = {}

    def check(self, cond, what, detail=""):
        print(("ok   " if cond else "FAIL ") + what + ("" if cond else f"\n     {detail}"), flush=True)
        if not cond:
            self.failures.append(what)
        return cond

    def known_bug(self, cond, what, detail, note):
        """A check that fails because of a product bug written down in `note` (docs/testing.md
        "Known failures"): printed as BUG and counted apart (the test still fails)."""
        if cond:
            print("ok   " + what, flush=True)
            return True
        print(f"BUG  {what}\n     {detail}\n     known: {note}", flush=True)
        self.bugs.append(what)
        return False

    def time(self, key, seconds):
        self.timings[key] = round(seconds, 2)
        print(f"time {key}: {seconds:.2f} s", flush=True)

    def count(self, key, n):
        self.timings[key] = n
        print(f"count {key}: {n}", flush=True)

    def finish(self, cluster=None):
        if cluster is not None:
            crashes = cluster.crash_lines()
            self.check(not crashes, "no daemon crashed", "\n     ".join(crashes[:10]))
        bad = self.failures + self.bugs
        print(f"{self.name}: timings " + json.dumps(self.timings), flush=True)
        print(f"{self.name}: {len(self.failures)} failure(s), {len(self.bugs)} known bug(s)", flush=True)
        if cluster is not None:
            cluster.stop(keep=bool(bad))
        return 1 if bad else 0


def main_guard(fn):
    """Runs a test body fn() -> exit status; Unavailable becomes a skip (exit 77)."""
    try:
        sys.exit(fn())
    except Unavailable as e:
        print(f"SKIP: {e}", flush=True)
        sys.exit(SKIP)


def _demo():
    net = Net("demo")
    hosts = [net.add_host(n) for n in ("meta", "n1", "n2", "n3", "n4", "n5")]
    log("hosts: " + ", ".join(map(repr, hosts)))
    print("n1 -> n2 reachable:", net.reachable("n1", "n2"))
    net.cut("n1", "n2", both=False)
    print("cut n1 -> n2: n1 -> n2", net.reachable("n1", "n2"), "n2 -> n1", net.reachable("n2", "n1"))
    net.heal()
    net.partition(["meta"], ["n1", "n2"])
    print("partition meta | n1 n2: meta -> n1", net.reachable("meta", "n1"), "n1 -> n2", net.reachable("n1", "n2"))
    net.heal()
    print("healed: meta -> n1", net.reachable("meta", "n1"))
    print("netem:", netem_reason() or "available")
    net.teardown()


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "probe"
    if cmd == "probe":
        reason = probe()
        print(f"namespaces: {reason or 'available'}")
        print(f"netem: {netem_reason() or 'available'}" if not reason else "")
        sys.exit(0 if not reason else SKIP)
    if cmd == "sweep":
        for what in sweep_stale():
            print(f"removed {what}")
        sys.exit(0)
    if cmd == "demo":
        _demo()
        sys.exit(0)
    print(f"usage: {sys.argv[0]} probe|sweep|demo", file=sys.stderr)
    sys.exit(2)
