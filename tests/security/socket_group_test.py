#!/usr/bin/python3
"""The agent's local sockets and --socket-group, through the real daemons and
the Python client run as other users (docs/security.md; label integration).

ckpt-meta and one ckpt-agent with --socket-group 4242 (a gid no user here
has), with mutual TLS as shipped (certificates made with `ckptctl certs`; the
trainers present a trainer certificate, their copy owned by uid 4343). Checked:
  - agent.sock and session.sock belong to group 4242, mode 0660;
  - a trainer running as uid 4343 in group 4242 saves and loads;
  - a trainer as uid 4343 outside the group cannot reach the sockets (the
    kernel, by their mode) and its save never starts;
  - with the sockets opened to everyone by mistake (chmod 0666), the agent
    still refuses that trainer's session, naming its uid and gid (the
    kernel-reported credentials, SO_PEERCRED/SO_PEERGROUPS), and nothing of
    its state reaches the memory tier;
  - an unknown group is a usage error (exit 2) that names it.
Needs root (to run trainers as other users) and the Python module; exits 77
(skipped) otherwise.
Run: CKPT_BUILD_DIR=build /usr/bin/python3 tests/security/socket_group_test.py
"""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("CKPT_BUILD_DIR", ROOT / "build")).resolve()
sys.path.insert(0, str(ROOT / "tests" / "support"))
from checks import check, eventually, finish  # noqa: E402
from localnet import ClusterTls, free_ports, kill_daemons, start_daemon, tls_env, wait_tcp  # noqa: E402

GROUP = 4242
USER = 4343

# A trainer: saves step 1 of a job and loads it back; prints "OK" or the error.
TRAINER = r"""
import sys
import numpy as np
import ckpt
meta, sock, job = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    cl = ckpt.Client(job=job, rank=0, world_size=1, meta=meta, agent_socket=sock, protection="none",
                     connect_timeout=5)
    data = np.arange(1 << 16, dtype=np.float32)
    cl.save(1, {"w": data}).wait("protected", timeout=30)
    back = cl.load(1)
    print("OK" if np.array_equal(back["w"], data) else "WRONG BYTES")
except ckpt.Error as e:
    print(f"{type(e).__name__}: {e}")
"""


def trainer(meta, sock, gid, groups=()):
    trainer.runs += 1
    r = subprocess.run([sys.executable, "-c", TRAINER, meta, sock, f"sg{trainer.runs}"], capture_output=True, text=True, timeout=120,
                       user=USER, group=gid, extra_groups=list(groups),
                       env=dict(os.environ, PYTHONPATH=str(BUILD / "python"), PYTHONDONTWRITEBYTECODE="1",
                                **trainer.tls))
    return (r.stdout + r.stderr).strip()


trainer.runs = 0
trainer.tls = {}  # CKPT_TLS_* of the trainers' certificate (files of uid USER)


def trainer_certificate(tls, work):
    """A copy of a trainer certificate (every job) that uid USER may read: CKPT_TLS_* for it."""
    d = work / "trainer-tls"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    env = {}
    for var, path in tls_env(tls.client("trainer", "sockgroup", ["*"])).items():
        copy = d / pathlib.Path(path).name
        shutil.copyfile(path, copy)
        os.chown(copy, USER, USER)
        copy.chmod(0o600 if var == "CKPT_TLS_KEY" else 0o644)
        env[var] = str(copy)
    return env


def main():
    if os.geteuid() != 0:
        print("SKIP: needs root to run trainers as other users")
        return 77
    if not (BUILD / "python" / "ckpt").is_dir():
        print(f"SKIP: no Python module in {BUILD / 'python'}")
        return 77
    work = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-sockgroup-"))
    work.chmod(0o755)
    procs = []
    shm = f"ckpt-sockgroup-test-{os.getpid()}"
    try:
        (mp, mm, ap, dp, am) = free_ports(5)
        meta = f"127.0.0.1:{mp}"
        tls = ClusterTls(work / "pki", BUILD / "bin")
        trainer.tls = trainer_certificate(tls, work)
        run = work / "run"
        run.mkdir(mode=0o755)
        run.chmod(0o755)
        agent_bin = str(BUILD / "bin" / "ckpt-agent")
        base = ["--node-id", "n0", "--meta", meta, "--listen", f"127.0.0.1:{ap}", "--data-listen",
                f"127.0.0.1:{dp}", "--metrics-listen", f"127.0.0.1:{am}", "--run-dir", str(run), "--memory", "16MiB",
                "--memory-dir", f"/dev/shm/{shm}"] + tls.node_flags("n0")

        r = subprocess.run([agent_bin] + base + ["--socket-group", "no-such-group-ckpt"], capture_output=True,
                           text=True, timeout=60)
        check(r.returncode == 2 and "no group named \"no-such-group-ckpt\"" in r.stderr,
              "an unknown --socket-group is a usage error naming it", f"exit {r.returncode}: {r.stderr[-300:]}")

        m = start_daemon(BUILD / "bin", work, "ckpt-meta",
                         ["--listen", meta, "--metrics-listen", f"127.0.0.1:{mm}", "--data-dir", str(work / "meta")] +
                         tls.meta_flags())
        procs.append(m)
        wait_tcp(mp, m, 30)
        a = start_daemon(BUILD / "bin", work, "ckpt-agent", base + ["--socket-group", str(GROUP)])
        procs.append(a)
        wait_tcp(ap, a, 60)
        sock = run / "agent.sock"
        # The agent logs "ckpt-agent listening on" once both sockets have
        # their mode and group (they are created owner-only first); its data
        # plane's "data plane listening on" comes earlier.
        check(eventually(lambda: (run / "session.sock").exists() and sock.exists() and
                         "ckpt-agent listening on" in (work / "ckpt-agent.log").read_text(), timeout=30),
              "the agent serves its sockets")
        for s in (sock, run / "session.sock"):
            st = s.stat()
            check(st.st_gid == GROUP and (st.st_mode & 0o777) == 0o660,
                  f"{s.name} belongs to group {GROUP}, mode 0660", f"gid {st.st_gid} mode {oct(st.st_mode)}")

        out = trainer(meta, str(sock), GROUP)
        check(out.endswith("OK"), f"a trainer as uid {USER} in group {GROUP} saves and loads", out[-500:])
        out = trainer(meta, str(sock), USER, [USER, GROUP])
        check(out.endswith("OK"), "a trainer with the group as a supplementary group saves and loads", out[-500:])

        out = trainer(meta, str(sock), USER)
        check(out.startswith("PermissionDeniedError: permission denied on ") and str(sock) in out and
              "socket is mode 0660" in out,
              "a trainer outside the group cannot use the agent (socket mode): PermissionDenied naming the socket",
              out[-500:])

        for s in (sock, run / "session.sock"):
            s.chmod(0o666)
        out = trainer(meta, str(sock), USER)
        check("not in the agent's socket group 4242" in out and f"uid {USER} gid {USER}" in out,
              "with the sockets opened by mistake the agent still refuses the session, naming uid and gid",
              out[-500:])
        log = (work / "ckpt-agent.log").read_text()
        check("session socket: refused a client" in log, "the agent logs the refusal", log[-500:])
        check(a.poll() is None, "the agent is still running")
        out = trainer(meta, str(sock), GROUP)
        check(out.endswith("OK"), "members still save after a refusal", out[-500:])
    finally:
        kill_daemons(procs, shm)
    return finish(work)


if __name__ == "__main__":
    sys.exit(main())
