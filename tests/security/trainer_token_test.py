#!/usr/bin/python3
"""Trainer identities (ckpt-meta --trainer-tokens-file, docs/security.md), through
the real daemons, ckptctl and the Python client (label integration).

ckpt-meta with an admin token, an agent token and two trainer identities
(token A: jobs "team-a-*"; token B: job "team-b"), two ckpt-agents, all with
mutual TLS as shipped (certificates made with `ckptctl certs`). The tokens are
checked on top of the certificates: here the trainers present a trainer
certificate for every job and ckptctl an admin one, so that the tokens decide
at meta. Checked:
  - trainer A (CKPT_TOKEN_FILE) creates its job, saves, waits and loads;
  - trainer A on team-b, and a trainer without a token, are refused at
    Connect (PERMISSION_DENIED naming the jobs it may use / UNAUTHENTICATED),
    and create nothing;
  - ckptctl with token A reads its job and is refused on team-b's; listings
    show it only its jobs; with the admin token it sees both; without a token
    it is refused;
  - the agents (agent token) keep working for both jobs, and two of them
    replicate over a data plane that authenticates with the agent token;
  - the agent's TCP endpoint decides by certificate (ckptctl sends it no
    token: tokens go to meta only): an admin certificate restores, reads
    holdings and verifies; a trainer certificate reads its jobs' shards only,
    not a node's holdings; an operator's reads holdings but no shards; the
    trainers' local socket is unchanged; ckptctl save passes its --token-file
    to the client;
  - bad set-ups are usage errors (exit 2): trainer tokens without the admin
    and agent tokens, a world-readable file, a bad line.
Run: CKPT_BUILD_DIR=build /usr/bin/python3 tests/security/trainer_token_test.py
"""
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("CKPT_BUILD_DIR", ROOT / "build")).resolve()
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(BUILD / "python"))
from checks import check, finish  # noqa: E402
from localnet import ClusterTls, free_ports, kill_daemons, start_daemon, tls_env, tls_flags, wait_tcp  # noqa: E402



def secret(path, text, mode=0o600):
    path.write_text(text)
    path.chmod(mode)
    return path


class Cluster:
    def __init__(self, work):
        self.work = work
        self.admin = secret(work / "admin.token", "admin-" + os.urandom(12).hex() + "\n")
        self.agent_token = secret(work / "agent.token", "agent-" + os.urandom(12).hex() + "\n")
        self.token_a = "trainer-a-" + os.urandom(12).hex()
        self.token_b = "trainer-b-" + os.urandom(12).hex()
        self.file_a = secret(work / "a.token", self.token_a + "\n")
        self.file_b = secret(work / "b.token", self.token_b + "\n")
        self.unknown = secret(work / "unknown.token", "unknown-" + os.urandom(12).hex() + "\n")
        self.trainers = secret(work / "trainers", f"# team A may use every job whose id starts team-a-\n"
                                                  f"{self.token_a} team-a-*\n{self.token_b}\tteam-b\n")
        self.procs = []
        self.tls = ClusterTls(work / "pki", BUILD / "bin", trainer_name="token-test")
        (mp, mm, ap, dp, am, ap1, dp1, am1) = free_ports(8)
        self.meta = f"127.0.0.1:{mp}"
        self.shm = pathlib.Path(f"/dev/shm/ckpt-trainer-token-test-{os.getpid()}")
        self.run_dir = work / "run"
        self.run_dir.mkdir()
        m = self.start("ckpt-meta", ["--listen", self.meta, "--metrics-listen", f"127.0.0.1:{mm}",
                                     "--data-dir", str(work / "meta"), "--admin-token-file", str(self.admin),
                                     "--agent-token-file", str(self.agent_token),
                                     "--trainer-tokens-file", str(self.trainers)] + self.tls.meta_flags())
        wait_tcp(mp, m, 30)
        # Two agents: their data planes authenticate with the agent token.
        for node, (port, data_port, metrics_port) in (("n0", (ap, dp, am)), ("n1", (ap1, dp1, am1))):
            run_dir = self.run_dir if node == "n0" else work / f"run-{node}"
            run_dir.mkdir(exist_ok=True)
            a = self.start("ckpt-agent", ["--node-id", node, "--meta", self.meta, "--listen", f"127.0.0.1:{port}",
                                          "--data-listen", f"127.0.0.1:{data_port}",
                                          "--metrics-listen", f"127.0.0.1:{metrics_port}",
                                          "--run-dir", str(run_dir), "--memory", "16MiB",
                                          "--memory-dir", f"{self.shm}-{node}", "--token-file",
                                          str(self.agent_token), "--admin-token-file", str(self.admin)] +
                           self.tls.node_flags(node))
            wait_tcp(port, a, 60)

    def start(self, name, args):
        p = start_daemon(BUILD / "bin", self.work, name, args)
        self.procs.append(p)
        return p

    def ctl(self, *args, token_file=None, cert=None):
        """ckptctl with `cert` (a certificate of self.tls; default: an admin's) and the token in token_file."""
        argv = [str(BUILD / "bin" / "ckptctl"), "--meta", self.meta, "--timeout", "5"]
        argv += tls_flags(cert if cert is not None else self.tls.admin())
        if token_file is not None:
            argv += ["--token-file", str(token_file)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
        return subprocess.run(argv + list(args), capture_output=True, text=True, timeout=60, env=env)

    def stop(self):
        kill_daemons(self.procs, self.shm.name)


def client(c, job, token_file, **kw):
    import ckpt
    if token_file is None:
        os.environ.pop("CKPT_TOKEN_FILE", None)
    else:
        os.environ["CKPT_TOKEN_FILE"] = str(token_file)
    try:
        kw.setdefault("protection", "none")
        return ckpt.Client(job=job, rank=0, world_size=1, meta=c.meta, agent_socket=str(c.run_dir / "agent.sock"),
                           **kw)
    finally:
        os.environ.pop("CKPT_TOKEN_FILE", None)


def wait_alive(c, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = c.ctl("--json", "nodes", token_file=c.admin)
        if r.returncode == 0 and r.stdout.count('"alive"') == 2:
            return True
        time.sleep(0.2)
    return False


def trainers(c):
    import ckpt
    import numpy as np
    data = np.arange(1 << 14, dtype=np.float32)
    cl = client(c, "team-a-1", c.file_a)
    cl.save(1, {"w": data}).wait("protected", timeout=30)
    check(np.array_equal(cl.load(1)["w"], data), "trainer A saves, waits and loads its own job with its token")

    for label, job, token, want in (("A's token on team-b", "team-b", c.file_a, "PERMISSION_DENIED"),
                                    ("no token", "team-a-2", None, "UNAUTHENTICATED"),
                                    ("an unknown token", "team-a-2", c.unknown, "PERMISSION_DENIED")):
        try:
            client(c, job, token, connect_timeout=3)
            check(False, f"a trainer with {label} is refused")
        except ckpt.Error as e:
            names = {"PERMISSION_DENIED": "PermissionDeniedError", "UNAUTHENTICATED": "UnauthenticatedError"}
            check(type(e).__name__ == names[want],
                  f"a trainer with {label} is refused ({type(e).__name__})", str(e))
            if label.startswith("A's"):
                check("team-a-*" in str(e), "the refusal names the jobs the token may use", str(e))
    jobs = c.ctl("--json", "jobs", token_file=c.admin).stdout
    check('"team-b"' not in jobs and '"team-a-2"' not in jobs, "refused trainers created no job", jobs)

    # A replicated job: n0 pushes the copy to n1 over the authenticated data plane.
    cr = client(c, "team-a-rep", c.file_a, protection="replicate:2")
    cr.save(2, {"w": data + 2}).wait("protected", timeout=60)
    logs = "".join((c.work / n).read_text(errors="replace") for n in ("ckpt-agent.log",))
    check("refused" not in logs, "agents with the same token replicate to PROTECTED (nothing refused)", logs[-600:])

    # Trainer B gets its own job; the agent serves both.
    cb = client(c, "team-b", c.file_b)
    cb.save(5, {"w": data + 1}).wait("protected", timeout=30)
    check(np.array_equal(cb.load(5)["w"], data + 1), "trainer B saves and loads its job beside A's")


def ctl_reads(c):
    r = c.ctl("--json", "versions", "team-a-1", token_file=c.file_a)
    check(r.returncode == 0 and '"step"' in r.stdout, "ckptctl with token A lists its job's versions", r.stderr)
    r = c.ctl("--json", "versions", "team-b", token_file=c.file_a)
    check(r.returncode == 1 and "PERMISSION_DENIED" in r.stderr and "team-b" in r.stderr,
          "ckptctl with token A is refused team-b's versions", r.stderr)
    r = c.ctl("restore", "team-b", "5", "--out", str(c.work / "stolen"), token_file=c.file_a)
    check(r.returncode != 0 and not (c.work / "stolen" / "rank-00000.bin").exists(),
          "ckptctl with token A cannot restore team-b's shards", r.stderr)
    r = c.ctl("--json", "jobs", token_file=c.file_a)
    check(r.returncode == 0 and '"team-a-1"' in r.stdout and '"team-b"' not in r.stdout,
          "a listing with token A shows only A's jobs", r.stdout + r.stderr)
    r = c.ctl("--json", "jobs", token_file=c.admin)
    check(r.returncode == 0 and '"team-a-1"' in r.stdout and '"team-b"' in r.stdout,
          "a listing with the admin token shows every job", r.stdout + r.stderr)
    r = c.ctl("--json", "jobs")
    check(r.returncode == 1 and "UNAUTHENTICATED" in r.stderr, "a listing without a token is refused", r.stderr)
    r = c.ctl("create-job", "team-b-2", "--world-size", "1", token_file=c.file_b)
    check(r.returncode == 1 and "PERMISSION_DENIED" in r.stderr, "token B cannot create a job it is not given",
          r.stderr)
    r = c.ctl("delete", "team-a-1", "1", token_file=c.file_a)
    check(r.returncode == 1 and "PERMISSION_DENIED" in r.stderr, "a trainer token is not the admin token",
          r.stderr)
    r = c.ctl("--json", "versions", "team-a-1", token_file=c.admin)
    check('"step"' in r.stdout, "refused calls deleted nothing", r.stdout + r.stderr)


def agent_endpoint(c):
    """The agent's TCP endpoint decides by the caller's certificate; ckptctl sends it no token
    (the agent's --admin-token-file no longer matters with TLS)."""
    trainer_a = c.tls.client("trainer", "team-a", ["team-a-*"])
    operator = c.tls.client("operator", "ops")
    out = c.work / "restored"
    r = c.ctl("restore", "team-a-1", "1", "--out", str(out), token_file=c.admin)
    check(r.returncode == 0 and (out / "rank-00000.bin").stat().st_size == 4 << 14,
          "ckptctl restore with an admin certificate reads from the agent", r.stderr)
    r = c.ctl("restore", "team-a-1", "1", "--out", str(c.work / "by-a"), token_file=c.file_a, cert=trainer_a)
    check(r.returncode == 0 and (c.work / "by-a" / "rank-00000.bin").stat().st_size == 4 << 14,
          "a trainer certificate of team-a-* (and token A) restores its job from the agent", r.stderr)
    r = c.ctl("restore", "team-a-1", "1", "--out", str(c.work / "by-ops"), token_file=c.admin, cert=operator)
    check(r.returncode != 0 and "PERMISSION_DENIED" in r.stderr and not (c.work / "by-ops" / "rank-00000.bin").exists(),
          "an operator certificate restores no shard (even with the admin token)", r.stderr)
    for args in (("holdings", "n0"), ("verify", "team-a-1", "1")):
        r = c.ctl(*args, token_file=c.admin)
        check(r.returncode == 0, f"ckptctl {args[0]} with an admin certificate works", r.stderr)
    r = c.ctl("holdings", "n0", token_file=c.admin, cert=operator)
    check(r.returncode == 0, "an operator certificate reads a node's holdings", r.stderr)
    r = c.ctl("holdings", "n0", token_file=c.file_a, cert=trainer_a)
    check(r.returncode == 1 and "PERMISSION_DENIED" in r.stderr and "GetInventory" in r.stderr,
          "the agent refuses a node's holdings to a trainer certificate", r.stderr)
    src = c.work / "blob.bin"
    src.write_bytes(os.urandom(5000))
    argv = [str(BUILD / "bin" / "ckptctl"), "--meta", c.meta, "--timeout", "10", "--token-file", str(c.file_a),
            "save", "team-a-cli", "3", str(src), "--rank", "0", "--world-size", "1",
            "--agent-socket", str(c.run_dir / "agent.sock")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update(tls_env(trainer_a))
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    check(r.returncode == 0, "ckptctl save with a trainer token (--token-file) saves into its job", r.stderr)
    argv[argv.index("team-a-cli")] = "team-b"
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    check(r.returncode == 1 and "PERMISSION_DENIED" in r.stderr, "ckptctl save with token A into team-b is refused",
          r.stderr)


def usage_error(argv, what, expect):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    check(r.returncode == 2 and expect in r.stderr, what, f"exit {r.returncode}: {r.stderr.strip()[-300:]}")


def bad_setups(c):
    meta = [str(BUILD / "bin" / "ckpt-meta"), "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
            "--data-dir", str(c.work / "meta-bad")] + c.tls.meta_flags()
    usage_error(meta + ["--trainer-tokens-file", str(c.trainers)],
                "trainer tokens without the admin and agent tokens are a usage error", "admin_token_file")
    tokens = ["--admin-token-file", str(c.admin), "--agent-token-file", str(c.agent_token)]
    loose = secret(c.work / "loose", f"{c.token_a} team-a\n", 0o644)
    usage_error(meta + tokens + ["--trainer-tokens-file", str(loose)],
                "a world-readable trainer tokens file is a usage error", "readable by every user")
    bad = secret(c.work / "bad", f"{c.token_a} team-a\nshort team-b\n")
    usage_error(meta + tokens + ["--trainer-tokens-file", str(bad)],
                "a bad line is a usage error naming the line", "line 2: the token is shorter")


def main():
    try:
        import ckpt  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        print(f"SKIP: cannot import ckpt from {BUILD / 'python'}: {e}")
        return 77
    work = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-trainer-token-"))
    c = None
    try:
        c = Cluster(work)
        # This process's trainers: a trainer certificate for every job (the tokens decide).
        os.environ.update(c.tls.trainer_env())
        check(wait_alive(c), "the agents register with their agent token", (work / "ckpt-agent.log").read_text()[-800:])
        trainers(c)
        ctl_reads(c)
        agent_endpoint(c)
        bad_setups(c)
    finally:
        if c is not None:
            c.stop()
    return finish(work)


if __name__ == "__main__":
    sys.exit(main())
