"""Helpers for Python programs that start ckpt daemons on 127.0.0.1: free ports
and waiting for a daemon to listen. Shared by python/tests/conftest.py,
bench/item_bench.py and tests/chaos/chaos_soak.py (each puts this directory on
sys.path)."""
import pathlib
import shutil
import signal
import socket
import subprocess
import time


def free_ports(n):
    """n distinct TCP ports that were free on 127.0.0.1 a moment ago."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


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


def start_daemon(bin_dir, log_dir, name, args):
    """Starts bin_dir/name with args, stdout and stderr appended to log_dir/name.log."""
    with open(log_dir / f"{name}.log", "ab") as log:
        return subprocess.Popen([str(bin_dir / name)] + list(args), stdout=log, stderr=subprocess.STDOUT)


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
