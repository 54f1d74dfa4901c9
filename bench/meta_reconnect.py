#!/usr/bin/env python3
"""How long a client's calls keep failing after ckpt-meta restarts.

Starts ckpt-meta and one ckpt-agent on free 127.0.0.1 ports (mutual TLS, as
shipped: a CA of their own made with `ckptctl certs`), saves one
version, then per trial: kills meta (SIGKILL), makes --calls-while-down
WaitVersion calls while it is down, restarts it on the same port after 0.3 s
and times the first WaitVersion that succeeds once meta listens (--call load:
one load(), whose Locate is a single call, instead).

  PYTHONPATH=build/python CKPT_BUILD_DIR=build /usr/bin/python3 bench/meta_reconnect.py --trials 4
  PYTHONPATH=build/python CKPT_BUILD_DIR=build /usr/bin/python3 bench/meta_reconnect.py --trials 4 --call load

Measured 2026-11-26 (gRPC 1.51, 3 trials each): 9.3-20.3 s with 3 failed
calls while meta was down, when the client's retry loops slept between
fail-fast calls (nothing polled the channel's reconnect but gRPC's backup
poller, every 5 s: the chaos soak's kill_meta rounds then showed "0/4
versions PROTECTED" within 30 s); 0.23-0.30 s since they wait on the
channel's connectivity instead (client.cc Backoff); 0.01 s with no call
while meta was down.
"""
import argparse
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "support"))
from localnet import ClusterTls, free_ports, wait_tcp  # noqa: E402

import ckpt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--calls-while-down", type=int, default=3)
    ap.add_argument("--call", choices=["wait", "load"], default="wait",
                    help="the call timed after meta listens again: wait (WaitVersion, a retry loop) "
                         "or load (Locate, a one-shot read)")
    args = ap.parse_args()
    bin_dir = pathlib.Path(os.environ.get("CKPT_BUILD_DIR", "build")) / "bin"
    root = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-reconnect-"))
    meta_port, meta_metrics, agent_port, data_port, agent_metrics = free_ports(5)
    meta_addr = f"127.0.0.1:{meta_port}"
    for d in ("meta", "run", "mem"):
        (root / d).mkdir()
    tls = ClusterTls(root / "pki", bin_dir, trainer_jobs=("reconnect",), trainer_name="reconnect")
    os.environ.update(tls.trainer_env())  # the client below is a trainer of job "reconnect"

    def start_meta():
        p = subprocess.Popen([bin_dir / "ckpt-meta", "--listen", meta_addr,
                              "--metrics-listen", f"127.0.0.1:{meta_metrics}", "--data-dir", str(root / "meta"),
                              *tls.meta_flags()],
                             stdout=subprocess.DEVNULL, stderr=open(root / "meta.log", "a"))
        wait_tcp(meta_port, p, 30)
        return p

    meta = start_meta()
    agent = subprocess.Popen([bin_dir / "ckpt-agent", "--node-id", "n1", "--meta", meta_addr,
                              "--listen", f"127.0.0.1:{agent_port}", "--data-listen", f"127.0.0.1:{data_port}",
                              "--metrics-listen", f"127.0.0.1:{agent_metrics}", "--run-dir", str(root / "run"),
                              "--memory", "64MiB", "--memory-dir", str(root / "mem"), *tls.node_flags("n1")],
                             stdout=subprocess.DEVNULL, stderr=open(root / "agent.log", "a"))
    try:
        wait_tcp(agent_port, agent, 30)
        c = ckpt.Client("reconnect", 0, 1, meta_addr, agent_socket=str(root / "run" / "agent.sock"))
        c.save(1, {"x": b"abc"}).wait("staged", timeout=30)
        for trial in range(args.trials):
            meta.send_signal(signal.SIGKILL)
            meta.wait()
            for _ in range(args.calls_while_down):
                try:
                    c.wait(1, "staged", timeout=0.1)
                except ckpt.Error:
                    pass
            time.sleep(0.3)
            meta = start_meta()
            t0 = time.monotonic()
            if args.call == "wait":
                c.wait(1, "staged", timeout=120)
            else:
                # One call, no retry of ours: it succeeds, or the trial reports its error.
                try:
                    c.load(1)
                except ckpt.Error as e:
                    print(f"trial {trial}: load FAILED {time.monotonic() - t0:.2f} s after meta listened: {e}",
                          flush=True)
                    continue
            name = "WaitVersion" if args.call == "wait" else "load (Locate)"
            print(f"trial {trial}: first successful {name} {time.monotonic() - t0:.2f} s after meta "
                  f"listened ({args.calls_while_down} calls failed while it was down)", flush=True)
    finally:
        for p in (agent, meta):
            p.send_signal(signal.SIGKILL)
            p.wait()


if __name__ == "__main__":
    main()
