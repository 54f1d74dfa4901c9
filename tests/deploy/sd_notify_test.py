#!/usr/bin/python3
"""Type=notify readiness without systemd: runs ckpt-meta and ckpt-agent with
NOTIFY_SOCKET pointing at a datagram socket of this test, and checks that each
sends READY=1 once it serves and STOPPING=1 on SIGTERM, then exits 0. Both
run as shipped, with mutual TLS (a CA of the test's own, made with CKPTCTL
certs through tests/support/localnet.py ClusterTls).

usage: sd_notify_test.py CKPT_META CKPT_AGENT [CKPTCTL]  (default: ckptctl beside CKPT_META)
Exits 77 (ctest SKIP_RETURN_CODE) if the binaries are not linked with libsystemd.
"""
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "support"))
from localnet import ClusterTls  # noqa: E402


def messages(sock, want, deadline):
    got = []
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            data = sock.recv(4096).decode()
        except socket.timeout:
            break
        got.append(data)
        if want in data.split("\n"):
            return got
    raise AssertionError(f"no {want} within the deadline; got {got!r}")


def run(name, argv, tmp):
    path = os.path.join(tmp, name + ".notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    env = dict(os.environ, NOTIFY_SOCKET=path)
    env = {k: v for k, v in env.items() if not k.startswith("CKPT_")}
    env["NOTIFY_SOCKET"] = path
    log = open(os.path.join(tmp, name + ".log"), "w+")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        got = messages(sock, "READY=1", time.monotonic() + 60)
        if not any("STATUS=serving" in g for g in got):
            raise AssertionError(f"{name}: READY=1 without STATUS=serving...: {got!r}")
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited {proc.returncode} after READY=1")
        proc.send_signal(signal.SIGTERM)
        messages(sock, "STOPPING=1", time.monotonic() + 30)
        rc = proc.wait(timeout=60)
        if rc != 0:
            raise AssertionError(f"{name} exited {rc} after SIGTERM")
        print(f"{name}: READY=1 then STOPPING=1, exit 0")
    except Exception:
        log.seek(0)
        print(log.read())
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()


def main():
    meta, agent = sys.argv[1:3]
    ckptctl = sys.argv[3] if len(sys.argv) > 3 else os.path.join(os.path.dirname(meta), "ckptctl")
    for b in (meta, agent):
        ldd = subprocess.run(["ldd", b], capture_output=True, text=True).stdout
        if "libsystemd" not in ldd:
            print(f"SKIP: {b} is built without libsystemd (sd_notify is a no-op)")
            return 77
    tmp = tempfile.mkdtemp(prefix="ckpt-sdnotify-")
    shm = tempfile.mkdtemp(prefix="ckpt-sdnotify-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        tls = ClusterTls(pathlib.Path(tmp) / "pki", pathlib.Path(ckptctl).parent)
        run("ckpt-meta", [meta, "--data-dir", os.path.join(tmp, "meta"), "--listen", "127.0.0.1:0",
                          "--metrics-listen", "127.0.0.1:0", *tls.meta_flags()], tmp)
        # The agent is ready without a reachable meta (registration is background).
        run("ckpt-agent", [agent, "--node-id", "sdnotify-test", "--meta", "127.0.0.1:1",
                           "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0",
                           "--metrics-listen", "127.0.0.1:0", "--run-dir", os.path.join(tmp, "run"),
                           "--memory", "16MiB", "--memory-dir", os.path.join(shm, "mem"),
                           *tls.node_flags("sdnotify-test")], tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
