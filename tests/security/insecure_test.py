#!/usr/bin/python3
"""Secure by default (issue 34; docs/security.md; label integration): the daemons
refuse to serve without mutual TLS unless told --insecure, --insecure is for
loopback only, and with the shipped defaults a stranger cannot use meta.

The one test that starts daemons with --insecure (every other test and script
runs them with TLS). Through the real binaries:
  - ckpt-meta, ckpt-agent and ckpt-dpu-agent without --tls-* and without
    --insecure exit 2 naming --tls-ca/--tls-cert/--tls-key and --insecure;
  - --insecure with a non-loopback --listen (0.0.0.0), or an agent's
    --data-listen, exits 2 naming the flag and the address; --insecure beside
    TLS files exits 2;
  - a daemon's certificate must be its own: meta refuses a node's
    certificate, an agent one of another node id (exit 2);
  - --insecure on 127.0.0.1 starts, warns in the log, and serves plaintext
    (an agent registers, ckptctl reads the nodes).
Then a cluster as shipped (TLS, certificates made with `ckptctl certs`):
  - a plaintext caller and a caller with an admin certificate of another CA
    are refused (on meta and on the agent's port);
  - an operator certificate reads, but cannot DeleteVersion, CreateJob or
    restore shards;
  - a trainer certificate for job A saves and loads A, and cannot read job B
    (versions, restore, a client of B);
  - finding 4 ("a holder of the agent token registered a node id at its own
    address; ckptctl holdings then sent the admin token to that address"):
    an agent holding node n1's certificate that registers as n2 is refused
    by meta (its certificate is swapped under it, so that it passes its own
    start-up check) and never becomes n2; and ckptctl holdings of n1, whose
    listed address is then served by another node's agent, refuses that
    agent before it sends anything.
Run: CKPT_BUILD_DIR=build /usr/bin/python3 tests/security/insecure_test.py
"""
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("CKPT_BUILD_DIR", ROOT / "build")).resolve()
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(BUILD / "python"))
from checks import check, eventually, finish  # noqa: E402
from localnet import ClusterTls, free_ports, kill_daemons, start_daemon, tls_env, tls_flags, wait_tcp  # noqa: E402

BIN = BUILD / "bin"


def clean_env(extra=None):
    """This process's environment without CKPT_* (no TLS files, tokens or meta address inherited)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update(extra or {})
    return env


def exits_2(argv, what, expect):
    """Runs a daemon that must refuse to start: exit 2, and stderr saying every string of expect."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=clean_env())
    except subprocess.TimeoutExpired:
        check(False, what, "still running after 60 s")
        return
    missing = [e for e in expect if e not in r.stderr]
    check(r.returncode == 2 and not missing, what, f"exit {r.returncode}, missing {missing}: {r.stderr.strip()[-500:]}")


class Daemons:
    def __init__(self, work):
        self.work = work
        self.procs = []
        self.shm = f"ckpt-insecure-test-{os.getpid()}"
        self.runs = 0

    def meta_args(self, port, metrics, extra=()):
        self.runs += 1
        return ["--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics}",
                "--data-dir", str(self.work / f"meta{self.runs}"), *extra]

    def agent_args(self, node, meta, ports, extra=(), binary="ckpt-agent"):
        port, data_port, metrics = ports
        self.runs += 1
        host = ["--host-node", f"host-{node}"] if binary == "ckpt-dpu-agent" else []
        return ["--node-id", node, "--meta", meta, "--listen", f"127.0.0.1:{port}",
                "--data-listen", f"127.0.0.1:{data_port}", "--metrics-listen", f"127.0.0.1:{metrics}",
                "--run-dir", str(self.work / f"run{self.runs}"), "--memory", "16MiB",
                "--memory-dir", f"/dev/shm/{self.shm}-{self.runs}", *host, *extra]

    def start(self, name, args, binary=None):
        p = start_daemon(BIN, self.work, name, args, binary=binary)
        self.procs.append(p)
        return p

    def kill(self, p):
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()

    def stop(self):
        kill_daemons(self.procs, self.shm)


def ctl(meta, *args, cert=None, timeout=5):
    argv = [str(BIN / "ckptctl"), "--meta", meta, "--timeout", str(timeout)]
    argv += tls_flags(cert) if cert is not None else []
    return subprocess.run(argv + list(args), capture_output=True, text=True, timeout=60, env=clean_env())


def refusals(d, tls):
    """Daemons that must not start."""
    meta = [str(BIN / "ckpt-meta")]
    tls_hint = ["--tls-ca", "--tls-cert", "--tls-key", "--insecure", "ckptctl certs"]
    exits_2(meta + d.meta_args(*free_ports(2)), "ckpt-meta without TLS and without --insecure exits 2", tls_hint)
    for binary in ("ckpt-agent", "ckpt-dpu-agent"):
        exits_2([str(BIN / binary)] + d.agent_args("n1", "127.0.0.1:1", free_ports(3), binary=binary),
                f"{binary} without TLS and without --insecure exits 2", tls_hint)

    # --insecure beyond loopback.
    p, m = free_ports(2)
    exits_2(meta + ["--listen", f"0.0.0.0:{p}", "--metrics-listen", f"127.0.0.1:{m}", "--data-dir",
                    str(d.work / "meta-any"), "--insecure"],
            "ckpt-meta --insecure --listen 0.0.0.0:P exits 2", ["--insecure", "--listen", f"0.0.0.0:{p}"])
    for binary in ("ckpt-agent", "ckpt-dpu-agent"):
        ports = free_ports(3)
        args = d.agent_args("n1", "127.0.0.1:1", ports, ["--insecure"], binary=binary)
        args[args.index("--listen") + 1] = f"0.0.0.0:{ports[0]}"
        exits_2([str(BIN / binary)] + args, f"{binary} --insecure --listen 0.0.0.0:P exits 2",
                ["--insecure", "--listen", f"0.0.0.0:{ports[0]}"])
        ports = free_ports(3)
        args = d.agent_args("n1", "127.0.0.1:1", ports, ["--insecure"], binary=binary)
        args[args.index("--data-listen") + 1] = f"0.0.0.0:{ports[1]}"
        exits_2([str(BIN / binary)] + args, f"{binary} --insecure --data-listen 0.0.0.0:P exits 2",
                ["--insecure", "--data-listen", f"0.0.0.0:{ports[1]}"])

    # --insecure beside TLS files.
    exits_2(meta + d.meta_args(*free_ports(2), ["--insecure"] + tls.meta_flags()),
            "ckpt-meta --insecure with TLS files exits 2", ["--insecure", "--tls-ca"])
    exits_2([str(BIN / "ckpt-agent")] + d.agent_args("n1", "127.0.0.1:1", free_ports(3),
                                                     ["--insecure"] + tls.node_flags("n1")),
            "ckpt-agent --insecure with TLS files exits 2", ["--insecure", "--tls-ca"])

    # A daemon's certificate must name the daemon.
    exits_2(meta + d.meta_args(*free_ports(2), tls.node_flags("n1")),
            "ckpt-meta refuses a node's certificate", ["ckpt://node/n1", "ckpt://meta", "create-meta"])
    exits_2([str(BIN / "ckpt-agent")] + d.agent_args("n2", "127.0.0.1:1", free_ports(3), tls.node_flags("n1")),
            "ckpt-agent --node-id n2 refuses node n1's certificate", ["ckpt://node/n1", "ckpt://node/n2"])
    exits_2([str(BIN / "ckpt-agent")] + d.agent_args("n1", "127.0.0.1:1", free_ports(3), tls.meta_flags()),
            "ckpt-agent refuses meta's certificate", ["ckpt://meta", "ckpt://node/n1"])


def insecure_loopback(d):
    """--insecure on 127.0.0.1: starts, warns, serves plaintext."""
    mp, mm = free_ports(2)
    meta = f"127.0.0.1:{mp}"
    m = d.start("ckpt-meta-insecure", d.meta_args(mp, mm, ["--insecure"]), binary="ckpt-meta")
    wait_tcp(mp, m, 30)
    ports = free_ports(3)
    a = d.start("ckpt-agent-insecure", d.agent_args("plain", meta, ports, ["--insecure"]), binary="ckpt-agent")
    wait_tcp(ports[0], a, 60)
    log = d.work / "ckpt-meta-insecure.log"
    check("--insecure" in log.read_text(errors="replace") and "plaintext" in log.read_text(errors="replace"),
          "ckpt-meta --insecure on 127.0.0.1 starts and warns", log.read_text(errors="replace")[-500:])
    log = d.work / "ckpt-agent-insecure.log"
    check("--insecure" in log.read_text(errors="replace") and "plaintext" in log.read_text(errors="replace"),
          "ckpt-agent --insecure on 127.0.0.1 starts and warns", log.read_text(errors="replace")[-500:])
    check(eventually(lambda: '"plain"' in ctl(meta, "--json", "nodes").stdout),
          "with --insecure the agent registers and ckptctl reads meta in plaintext",
          ctl(meta, "--json", "nodes").stderr)
    d.kill(a)
    d.kill(m)


def alive(meta, admin, node):
    r = ctl(meta, "--json", "nodes", cert=admin)
    import json
    try:
        return any(n["id"] == node and n["state"].lower() == "alive" for n in json.loads(r.stdout)["nodes"])
    except (ValueError, KeyError):
        return False


def strangers(d, tls, other):
    """The shipped defaults: who may do what."""
    import ckpt
    import numpy as np
    admin = tls.client("admin", "test-admin")
    operator = tls.client("operator", "test-operator")
    trainer_a = tls.client("trainer", "team-a", ["job-a"])
    mp, mm = free_ports(2)
    meta = f"127.0.0.1:{mp}"

    # Finding 4, the claim: an agent started as n2 with n2's certificate, pointed at meta
    # before meta listens; its files are then swapped for node n1's (a holder of n1's key
    # claiming n2). Its own start-up check passed; meta must refuse the claim.
    live = d.work / "claim-tls"
    live.mkdir()

    def put(entry):
        for src, name in zip(tls_flags(entry)[1::2], ("ca.pem", "node.pem", "node.key")):
            tmp = live / (name + ".new")
            shutil.copyfile(src, tmp)
            tmp.chmod(0o600)
            os.replace(tmp, live / name)
    put(tls.node("n2"))
    claim_ports = free_ports(3)
    claim = d.start("ckpt-agent-claim", d.agent_args(
        "n2", meta, claim_ports, ["--tls-ca", str(live / "ca.pem"), "--tls-cert", str(live / "node.pem"),
                                  "--tls-key", str(live / "node.key"), "--tls-reload-seconds", "1"]),
        binary="ckpt-agent")
    wait_tcp(claim_ports[0], claim, 60)
    put(tls.node("n1"))
    time.sleep(3)  # three reload periods: the agent's channel to meta has read n1's files

    m = d.start("ckpt-meta", d.meta_args(mp, mm, tls.meta_flags()))
    wait_tcp(mp, m, 30)
    claim_log = d.work / "ckpt-agent-claim.log"
    refused = 'the request is for node "n2" but the caller\'s certificate is ckpt://node/n1'
    check(eventually(lambda: refused in claim_log.read_text(errors="replace"), timeout=60),
          "meta refuses RegisterNode as n2 from node n1's certificate (PERMISSION_DENIED, naming both)",
          claim_log.read_text(errors="replace")[-800:])
    r = ctl(meta, "--json", "nodes", cert=admin)
    check(r.returncode == 0 and '"n2"' not in r.stdout, "the claimed node id n2 is not a member", r.stdout + r.stderr)
    d.kill(claim)

    # The real n1.
    n1_ports = free_ports(3)
    n1_args = d.agent_args("n1", meta, n1_ports, tls.node_flags("n1"))
    n1_socket = pathlib.Path(n1_args[n1_args.index("--run-dir") + 1]) / "agent.sock"
    n1 = d.start("ckpt-agent-n1", n1_args, binary="ckpt-agent")
    wait_tcp(n1_ports[0], n1, 60)
    check(eventually(lambda: alive(meta, admin, "n1")), "node n1 registers with its own certificate",
          (d.work / "ckpt-agent-n1.log").read_text(errors="replace")[-500:])

    # Plaintext and another CA, on meta and on the agent's port.
    for where, address in (("meta", meta), ("the agent's port", f"127.0.0.1:{n1_ports[0]}")):
        r = ctl(address, "status")
        check(r.returncode == 1 and "UNAVAILABLE" in r.stderr, f"{where} refuses a plaintext caller", r.stderr)
    r = ctl(meta, "status", cert=other.client("admin", "stranger"))
    check(r.returncode == 1 and "UNAVAILABLE" in r.stderr,
          "meta refuses an admin certificate of another CA", r.stderr)
    check(ctl(meta, "status", cert=admin).returncode == 0, "meta serves an admin certificate of its CA")

    # A trainer of job A.
    def client(job, entry, **kw):
        saved = {k: os.environ.get(k) for k in tls_env(entry)}
        os.environ.update(tls_env(entry))
        try:
            return ckpt.Client(job=job, rank=0, world_size=1, meta=meta, agent_socket=str(n1_socket),
                               protection="none", **kw)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    data = np.arange(1 << 12, dtype=np.float32)
    ca = client("job-a", trainer_a)
    ca.save(1, {"w": data}).wait("protected", timeout=60)
    check(np.array_equal(ca.load(1)["w"], data), "a trainer certificate for job-a saves and loads job-a")
    cb = client("job-b", admin)
    cb.save(1, {"w": data + 1}).wait("protected", timeout=60)
    try:
        client("job-b", trainer_a, connect_timeout=5)
        check(False, "a trainer certificate for job-a cannot open job-b")
    except ckpt.Error as e:
        check(type(e).__name__ == "PermissionDeniedError" and "job-a" in str(e),
              f"a trainer certificate for job-a cannot open job-b ({type(e).__name__})", str(e))
    r = ctl(meta, "versions", "job-b", cert=trainer_a)
    check(r.returncode == 1 and "PERMISSION_DENIED" in r.stderr, "a trainer of job-a cannot list job-b's versions",
          r.stderr)
    r = ctl(meta, "restore", "job-b", "1", "--out", str(d.work / "stolen"), cert=trainer_a)
    check(r.returncode != 0 and not (d.work / "stolen" / "rank-00000.bin").exists(),
          "a trainer of job-a cannot restore job-b", r.stderr)
    r = ctl(meta, "--json", "jobs", cert=trainer_a)
    check(r.returncode == 0 and '"job-a"' in r.stdout and '"job-b"' not in r.stdout,
          "a trainer of job-a lists only job-a", r.stdout + r.stderr)

    # An operator: reads, changes nothing, reads no shard.
    r = ctl(meta, "--json", "versions", "job-b", cert=operator)
    check(r.returncode == 0 and '"step"' in r.stdout, "an operator certificate lists versions", r.stderr)
    r = ctl(meta, "holdings", "n1", cert=operator)
    check(r.returncode == 0, "an operator certificate reads a node's holdings", r.stderr)
    for args, what in ((("delete", "job-b", "1"), "DeleteVersion"),
                       (("create-job", "job-c", "--world-size", "1"), "CreateJob")):
        r = ctl(meta, *args, cert=operator)
        check(r.returncode == 1 and "PERMISSION_DENIED" in r.stderr, f"an operator certificate cannot {what}",
              r.stderr)
    r = ctl(meta, "restore", "job-b", "1", "--out", str(d.work / "by-operator"), cert=operator)
    check(r.returncode != 0 and "PERMISSION_DENIED" in r.stderr
          and not (d.work / "by-operator" / "rank-00000.bin").exists(),
          "an operator certificate restores no shard", r.stderr)
    # A node's certificate: agents read jobs for their trainers, never create or flush them.
    for args, what in ((("create-job", "job-c", "--world-size", "1"), "CreateJob"),
                       (("flush", "job-b", "1"), "FlushVersion")):
        r = ctl(meta, *args, cert=tls.node("n1"))
        check(r.returncode == 1 and "PERMISSION_DENIED" in r.stderr and "is a node" in r.stderr,
              f"a node certificate cannot {what}", r.stderr)
    r = ctl(meta, "--json", "versions", "job-b", cert=tls.node("n1"))
    check(r.returncode == 0 and '"step"' in r.stdout, "a node certificate reads a job's versions", r.stderr)
    r = ctl(meta, "--json", "versions", "job-b", cert=admin)
    check('"step": 1' in r.stdout or '"step":1' in r.stdout, "the refused calls deleted nothing", r.stdout)
    r = ctl(meta, "--json", "jobs", cert=admin)
    check('"job-c"' not in r.stdout, "the refused calls created no job", r.stdout)

    # Finding 4, the hand-off: n1's listed address comes to be served by another node's
    # agent (n1 gone, its port taken by node n3 with n3's own, valid certificate).
    r = ctl(meta, "holdings", "n1", cert=admin)
    check(r.returncode == 0, "ckptctl holdings reads n1 (its certificate is n1's)", r.stderr)
    d.kill(n1)
    data_port, metrics_port = free_ports(2)
    n3 = d.start("ckpt-agent-n3", d.agent_args("n3", meta, (n1_ports[0], data_port, metrics_port),
                                               tls.node_flags("n3")), binary="ckpt-agent")
    wait_tcp(n1_ports[0], n3, 60)
    r = ctl(meta, "holdings", "n1", cert=admin, timeout=10)
    check(r.returncode != 0 and "UNAVAILABLE" in r.stderr,
          "ckptctl holdings refuses the agent at n1's listed address whose certificate is n3's "
          "(in the handshake: nothing is sent to it)", r.stderr)
    print("     ckptctl said: " + r.stderr.strip().replace("\n", " | ")[-400:])
    d.kill(n3)
    d.kill(m)


def main():
    for b in ("ckpt-meta", "ckpt-agent", "ckpt-dpu-agent", "ckptctl"):
        if not (BIN / b).exists():
            print(f"SKIP: no {b} in {BIN}")
            return 77
    try:
        import ckpt  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        print(f"SKIP: cannot import ckpt from {BUILD / 'python'}: {e}")
        return 77
    work = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-insecure-"))
    d = Daemons(work)
    try:
        tls = ClusterTls(work / "pki", BIN)
        other = ClusterTls(work / "other-pki", BIN)  # another cluster's CA: a stranger's certificates
        refusals(d, tls)
        insecure_loopback(d)
        strangers(d, tls, other)
    finally:
        d.stop()
    return finish(work)


if __name__ == "__main__":
    sys.exit(main())
