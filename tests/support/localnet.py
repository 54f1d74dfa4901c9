"""Helpers for Python programs that start ckpt daemons on 127.0.0.1: free ports,
waiting for a daemon to listen, and the certificates the daemons and their callers
run with (ClusterTls: mutual TLS with ckpt identities, the daemons' default).
Shared by python/tests/conftest.py, bench/bench_daemons.py, tests/security/*.py
and tests/chaos/chaos_soak.py (each puts this directory on sys.path)."""
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import time


_handed_out = set()
_rng = random.Random(os.getpid() ^ time.monotonic_ns())  # which ports only, per process


def _ephemeral_start():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n):
    """n distinct TCP ports that were free on 127.0.0.1 a moment ago, never handed out before by
    this process. Drawn from below the kernel's ephemeral range (as tests/support/ports.h does),
    where no outgoing connection can take them before the daemon binds them."""
    start = _ephemeral_start()
    ports = []
    for _ in range(200 * max(n, 1)):
        if len(ports) == n:
            break
        port = _rng.randrange(10000, start) if start > 11000 else 0
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            ports.append(port)
    if len(ports) != n:
        raise RuntimeError(f"no {n} free ports on 127.0.0.1")
    return ports


def wait_tcp(port, proc, timeout):
    """Returns once 127.0.0.1:port accepts; raises if proc exits or timeout s pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)  # bounded poll for process start-up
    raise RuntimeError(f"port {port} not listening after {timeout} s")


def start_daemon(bin_dir, log_dir, name, args, binary=None):
    """Starts bin_dir/binary (default: name) with args, stdout and stderr appended to
    log_dir/name.log."""
    with open(log_dir / f"{name}.log", "ab") as log:
        return subprocess.Popen([str(bin_dir / (binary or name))] + list(args), stdout=log, stderr=subprocess.STDOUT)


def kill_daemons(procs, shm_prefix=None):
    """SIGKILLs every process of procs still running (by PID) and reaps it; then removes the
    /dev/shm directories whose names start with shm_prefix (their memory tiers)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()
    if shm_prefix:
        for d in pathlib.Path("/dev/shm").glob(shm_prefix + "*"):
            shutil.rmtree(d, ignore_errors=True)


TLS_VARS = ("CKPT_TLS_CA", "CKPT_TLS_CERT", "CKPT_TLS_KEY")


class TlsFiles:
    """A certificate made by `ckptctl certs`: the CA's certificate, the holder's chain, its key."""

    def __init__(self, ca, cert, key):
        self.ca, self.cert, self.key = str(ca), str(cert), str(key)


def tls_flags(files):
    """--tls-ca/--tls-cert/--tls-key of `files` (TlsFiles), for a daemon or ckptctl."""
    return ["--tls-ca", files.ca, "--tls-cert", files.cert, "--tls-key", files.key]


def tls_env(files):
    """CKPT_TLS_CA/CERT/KEY of `files` (TlsFiles): what trainers (the client library) and ckptctl
    read from their environment."""
    return dict(zip(TLS_VARS, (files.ca, files.cert, files.key)))


class ClusterTls:
    """The certificates of a test cluster, as the daemons run by default (mutual TLS; every
    caller shows a certificate of the cluster's CA with a ckpt identity; docs/security.md),
    made with `ckptctl certs` from bin_dir as an operator would: one CA in `directory`, meta's
    certificate, one per node id (hosts 127.0.0.1, ::1, localhost), clients by role, an admin
    (for ckptctl) and a trainer for `trainer_jobs` (job patterns; "*": every job). Each is
    issued once, on first use; a failure raises RuntimeError with ckptctl's message. Not
    thread-safe: make the certificates before threads use them."""

    def __init__(self, directory, bin_dir, trainer_jobs=("*",), trainer_name="tests"):
        self.dir = pathlib.Path(directory)
        self.ckptctl = str(pathlib.Path(bin_dir) / "ckptctl")
        self.ca_dir = self.dir / "ca"
        self.trainer_jobs = list(trainer_jobs)
        self.trainer_name = trainer_name
        self._issued = {}
        self._certs("create-ca", "--dir", str(self.ca_dir))

    def _certs(self, *args):
        r = subprocess.run([self.ckptctl, "certs", *args], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"ckptctl certs {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")

    def _issue(self, key, command, *args):
        if key not in self._issued:
            out = self.dir / f"{len(self._issued)}-{key[0]}"
            self._certs(command, "--ca-dir", str(self.ca_dir), *args, "--out", str(out))
            self._issued[key] = TlsFiles(self.ca_dir / "ca.pem", f"{out}.pem", f"{out}.key")
        return self._issued[key]

    def meta(self):
        """ckpt-meta's certificate (ckpt://meta)."""
        return self._issue(("meta",), "create-meta", "--host", "127.0.0.1,::1,localhost")

    def node(self, node_id, host_node=None):
        """The certificate of node_id's agent (ckpt://node/<node_id>); a DPU's (ckpt-dpu-agent) also
        names the host it serves (host_node: ckpt://host/<host_node>, its --host-node)."""
        host = ["--host-node", host_node] if host_node else []
        return self._issue(("node", node_id, host_node), "create-node", "--node-id", node_id, *host,
                           "--host", "127.0.0.1,::1,localhost")

    def client(self, role, name, jobs=None):
        """A client certificate: role admin, operator or trainer (jobs: its job patterns)."""
        jobs = list(jobs or ())
        return self._issue(("client", role, name, tuple(jobs)), "create-client", "--role", role, "--name", name,
                           *(["--jobs", ",".join(jobs)] if jobs else []))

    def meta_flags(self):
        """ckpt-meta's --tls-* flags."""
        return tls_flags(self.meta())

    def node_flags(self, node_id, host_node=None):
        """The --tls-* flags of node_id's agent (a DPU agent: serving host_node)."""
        return tls_flags(self.node(node_id, host_node))

    def admin(self):
        return self.client("admin", "tests-admin")

    def admin_env(self):
        """CKPT_TLS_* of an admin certificate (ckptctl: every command)."""
        return tls_env(self.admin())

    def admin_flags(self):
        return tls_flags(self.admin())

    def trainer_env(self):
        """CKPT_TLS_* of a trainer certificate for trainer_jobs (the client library)."""
        return tls_env(self.client("trainer", self.trainer_name, self.trainer_jobs))


if __name__ == "__main__":
    # `python3 tests/support/localnet.py [N]` prints N (default 1) free ports, one per line, for
    # shell scripts (scripts/quickstart.sh, scripts/local-cluster.sh).
    import sys

    print("\n".join(str(p) for p in free_ports(int(sys.argv[1]) if len(sys.argv) > 1 else 1)))
