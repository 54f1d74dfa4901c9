"""Helpers for Python programs that start ckpt daemons on 127.0.0.1: free ports
and waiting for a daemon to listen. Shared by python/tests/conftest.py,
bench/item_bench.py and tests/chaos/chaos_soak.py (each puts this directory on
sys.path)."""
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


if __name__ == "__main__":
    # `python3 tests/support/localnet.py [N]` prints N (default 1) free ports, one per line, for
    # shell scripts (scripts/quickstart.sh, scripts/local-cluster.sh).
    import sys

    print("\n".join(str(p) for p in free_ports(int(sys.argv[1]) if len(sys.argv) > 1 else 1)))
