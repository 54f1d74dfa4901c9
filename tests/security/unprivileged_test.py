#!/usr/bin/python3
"""The daemons as production runs them: not root (issue 41 item 2; docs/operations.md "systemd").

deploy/systemd runs ckpt-meta and ckpt-agent as `User=ckpt` (meta with no capability, agents with
CAP_IPC_LOCK alone and LimitMEMLOCK=infinity) and the Kubernetes manifests as non-root; every
other test runs them as root, which passes checks a real deployment may fail (files owned by
someone else, modes, capabilities). Here ckpt-meta and two ckpt-agents run as uid/gid 65534
(nobody/nogroup) through setpriv, with exactly those capabilities, and trainers as uid 4343 in
group 65534 (the agent's socket group), with mutual TLS as shipped. Checked:
  - each daemon runs as 65534 with the capabilities of its unit, and nothing more;
  - the memory tier, its pool and the data directory belong to 65534 with the modes
    docs/security.md promises;
  - a trainer saves with replicas, the version reaches PROTECTED, and loads back byte-identical;
  - an agent SIGKILLed and restarted as 65534 re-adopts its memory tier (its owner check passes
    for its own user) and serves the version again, and a trainer outside the socket group is
    refused by the socket's mode;
  - session_test's one case that needs a non-root user (a socket group the user is not in is a
    clear start error) runs, as 65534, when the unit tests are built.
Needs root (to become other users) and setpriv (util-linux); exits 77 (skipped) otherwise.
Run: CKPT_BUILD_DIR=build /usr/bin/python3 tests/security/unprivileged_test.py
"""
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("CKPT_BUILD_DIR", ROOT / "build")).resolve()
sys.path.insert(0, str(ROOT / "tests" / "support"))
from checks import check, eventually, finish  # noqa: E402
from localnet import ClusterTls, free_ports, kill_daemons, tls_env, wait_tcp  # noqa: E402

DAEMON = 65534    # nobody / nogroup: the daemons' user and group
TRAINER = 4343    # a trainer's user, in group DAEMON (the agent's socket group)
STRANGER = 4344   # a user outside it
CAP_IPC_LOCK = 14

# A trainer: saves step N of a 2-rank job as rank R (replicated), or loads it; prints "OK" or the error.
TRAINER_CODE = r"""
import sys
import numpy as np
import ckpt
meta, sock, job, rank, what = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
try:
    cl = ckpt.Client(job=job, rank=rank, world_size=2, meta=meta, agent_socket=sock, protection="replicate:2",
                     connect_timeout=10)
    data = np.arange(1 << 18, dtype=np.float32) + rank
    if what == "save":
        cl.save(1, {"w": data}).wait("protected", timeout=60)
        print("OK")
    else:
        back = cl.load(1)
        print("OK" if np.array_equal(back["w"], data) else "WRONG BYTES")
except ckpt.Error as e:
    print(f"{type(e).__name__}: {e}")
"""


def own(path, uid, mode):
    os.chown(path, uid, uid)
    os.chmod(path, mode)


def copy_for(files, uid, directory):
    """Copies a certificate's CKPT_TLS_* files into `directory` owned by uid (the key 0600)."""
    directory.mkdir(mode=0o755)
    env = {}
    for var, path in tls_env(files).items():
        copy = directory / pathlib.Path(path).name
        shutil.copyfile(path, copy)
        own(copy, uid, 0o600 if var == "CKPT_TLS_KEY" else 0o644)
        env[var] = str(copy)
    return env


def tls_args(env):
    return ["--tls-ca", env["CKPT_TLS_CA"], "--tls-cert", env["CKPT_TLS_CERT"], "--tls-key", env["CKPT_TLS_KEY"]]


def unlimited_memlock():
    # LimitMEMLOCK=infinity, where this process may raise it (CAP_SYS_RESOURCE; a container may
    # not have it). CAP_IPC_LOCK lets the agent lock memory beyond the limit anyway.
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except (ValueError, OSError):
        pass


def start_as_daemon_user(work, name, argv, ipc_lock):
    """argv as uid/gid DAEMON with no supplementary group, keeping CAP_IPC_LOCK (ambient) and an
    unlimited RLIMIT_MEMLOCK if ipc_lock (ckpt-agent.service), no capability otherwise
    (ckpt-meta.service). setpriv execs the daemon, so the pid is the daemon's."""
    caps = ["--inh-caps=-all,+ipc_lock", "--ambient-caps=+ipc_lock", "--bounding-set=-all,+ipc_lock"] if ipc_lock \
        else ["--inh-caps=-all", "--bounding-set=-all"]
    cmd = ["setpriv", f"--reuid={DAEMON}", f"--regid={DAEMON}", "--clear-groups"] + caps + ["--"] + argv
    with open(work / f"{name}.log", "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=unlimited_memlock if ipc_lock else None)


def proc_status(pid):
    fields = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()
    return fields


def trainers(meta, socks, env, what, uid=TRAINER, groups=(DAEMON,)):
    """Rank r through socks[r], all ranks at once (a version is PROTECTED once every rank's shard
    is); each one's output."""
    ps = [subprocess.Popen([sys.executable, "-c", TRAINER_CODE, meta, sock, "unpriv", str(rank), what],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, user=uid, group=uid,
                           extra_groups=list(groups),
                           env=dict(os.environ, PYTHONPATH=str(BUILD / "python"), PYTHONDONTWRITEBYTECODE="1", **env))
          for rank, sock in enumerate(socks)]
    return [p.communicate(timeout=180)[0].strip() for p in ps]


def let_sanitizers_write():
    """Sanitized daemons running as DAEMON must be able to write their reports where the sanitized
    CI run collects them (a root-owned directory): open it to them for this run."""
    for var in ("ASAN_OPTIONS", "UBSAN_OPTIONS"):
        for part in os.environ.get(var, "").split(":"):
            if part.startswith("log_path="):
                directory = pathlib.Path(part[len("log_path="):]).parent
                if directory.is_dir():
                    directory.chmod(0o1777)


def main():
    if os.geteuid() != 0:
        print("SKIP: needs root to run the daemons and trainers as other users")
        return 77
    if shutil.which("setpriv") is None:
        print("SKIP: no setpriv (util-linux)")
        return 77
    if not (BUILD / "python" / "ckpt").is_dir():
        print(f"SKIP: no Python module in {BUILD / 'python'}")
        return 77
    let_sanitizers_write()
    work = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-unpriv-"))
    work.chmod(0o755)
    shm = f"ckpt-unpriv-{os.getpid()}"
    procs = {}
    try:
        mp, mm, *agent_ports = free_ports(2 + 3 * 2)
        meta = f"127.0.0.1:{mp}"
        tls = ClusterTls(work / "pki", BUILD / "bin")
        meta_tls = copy_for(tls.meta(), DAEMON, work / "meta-tls")
        trainer_tls = copy_for(tls.client("trainer", "unpriv", ["*"]), TRAINER, work / "trainer-tls")
        stranger_tls = copy_for(tls.client("trainer", "stranger", ["*"]), STRANGER, work / "stranger-tls")
        (work / "meta").mkdir()
        own(work / "meta", DAEMON, 0o700)
        procs["meta"] = start_as_daemon_user(
            work, "ckpt-meta", [str(BUILD / "bin" / "ckpt-meta"), "--listen", meta, "--metrics-listen",
                                f"127.0.0.1:{mm}", "--data-dir", str(work / "meta"), "--lease-ms", "3000"]
            + tls_args(meta_tls), ipc_lock=False)
        wait_tcp(mp, procs["meta"], 60)

        agent_argv = {}
        for i, node in enumerate(("n1", "n2")):
            gp, dp, am = agent_ports[3 * i: 3 * i + 3]
            node_tls = copy_for(tls.node(node), DAEMON, work / f"{node}-tls")
            run = work / node / "run"
            run.mkdir(parents=True)
            own(work / node, DAEMON, 0o755)
            own(run, DAEMON, 0o750)
            agent_argv[node] = ([str(BUILD / "bin" / "ckpt-agent"), "--node-id", node, "--meta", meta, "--listen",
                                 f"127.0.0.1:{gp}", "--data-listen", f"127.0.0.1:{dp}", "--metrics-listen",
                                 f"127.0.0.1:{am}", "--run-dir", str(run), "--memory", "64MiB", "--memory-dir",
                                 f"/dev/shm/{shm}-{node}"] + tls_args(node_tls), gp)
            procs[node] = start_as_daemon_user(work, f"ckpt-agent-{node}", agent_argv[node][0], ipc_lock=True)
        for node in ("n1", "n2"):
            wait_tcp(agent_argv[node][1], procs[node], 60)
            check(eventually(lambda n=node: (work / n / "run" / "session.sock").exists(), timeout=30),
                  f"{node} serves its sockets")

        # Who they run as, and with what.
        for name, p in procs.items():
            st = proc_status(p.pid)
            want_caps = 1 << CAP_IPC_LOCK if name != "meta" else 0
            check(st["Uid"] == [str(DAEMON)] * 4 and st["Gid"] == [str(DAEMON)] * 4,
                  f"{name} runs as uid/gid {DAEMON} (real, effective, saved, fs)", f"{st['Uid']} {st['Gid']}")
            check(int(st["CapEff"][0], 16) == want_caps and int(st["CapBnd"][0], 16) == want_caps,
                  f"{name} has {'CAP_IPC_LOCK alone' if want_caps else 'no capability'}",
                  f"CapEff {st['CapEff']} CapBnd {st['CapBnd']}")
        for node in ("n1", "n2"):
            tier = pathlib.Path(f"/dev/shm/{shm}-{node}")
            pool = tier / "pool.bin"
            check(tier.stat().st_uid == DAEMON and (tier.stat().st_mode & 0o777) == 0o700,
                  f"{node}'s memory tier is the daemon user's, mode 0700", oct(tier.stat().st_mode))
            check(pool.stat().st_uid == DAEMON and (pool.stat().st_mode & 0o777) == 0o600,
                  f"{node}'s pool is the daemon user's, mode 0600", oct(pool.stat().st_mode))
            sock = work / node / "run" / "agent.sock"
            check(sock.stat().st_gid == DAEMON and (sock.stat().st_mode & 0o777) == 0o660,
                  f"{node}'s agent.sock is group {DAEMON}, mode 0660", oct(sock.stat().st_mode))
        key = work / "meta" / "data-plane.key"
        check(key.stat().st_uid == DAEMON and (key.stat().st_mode & 0o777) == 0o600,
              "meta's data-plane key is the daemon user's, mode 0600")

        socks = [str(work / node / "run" / "agent.sock") for node in ("n1", "n2")]
        out = trainers(meta, socks, trainer_tls, "save")
        check(out == ["OK", "OK"], f"trainers (uid {TRAINER}, group {DAEMON}) save ranks 0 and 1 through n1 and n2, "
                                   "replicated, to PROTECTED", out)
        out = trainers(meta, socks, trainer_tls, "load")
        check(out == ["OK", "OK"], "and load them back byte-identical", out)
        out = trainers(meta, socks[:1], stranger_tls, "load", uid=STRANGER, groups=())[0]
        check("PermissionDenied" in out or "Permission denied" in out,
              f"a trainer outside group {DAEMON} cannot use the agent (socket mode)", out)

        # A restart as the daemon user re-adopts the memory tier it owns.
        procs["n1"].send_signal(signal.SIGKILL)
        procs["n1"].wait()
        procs["n1"] = start_as_daemon_user(work, "ckpt-agent-n1", agent_argv["n1"][0], ipc_lock=True)
        wait_tcp(agent_argv["n1"][1], procs["n1"], 60)
        check(eventually(lambda: (work / "n1" / "run" / "session.sock").exists(), timeout=30),
              "n1, SIGKILLed and restarted as the daemon user, serves again")
        out = trainers(meta, socks, trainer_tls, "load")
        check(out == ["OK", "OK"], "both ranks load byte-identical, rank 0 through the restarted n1", out)
        log = (work / "ckpt-agent-n1.log").read_text(errors="replace").split("ckpt-agent starting")[-1]
        check("memory tier: re-adopted" in log and ", 0 lost" in log,
              "the restarted agent re-adopted its own tier, nothing lost", log[-800:])
        for name, p in procs.items():
            check(p.poll() is None, f"{name} is still running")

        # The unit test that needs a non-root user, as one.
        session_test = BUILD / "tests" / "session_test"
        if session_test.exists():
            r = subprocess.run(["setpriv", f"--reuid={DAEMON}", f"--regid={DAEMON}", "--clear-groups", "--",
                                str(session_test),
                                "--gtest_filter=SocketGroup.StartFailsClearlyWhenTheSocketCannotBeGivenToTheGroup"],
                               capture_output=True, text=True, timeout=120, cwd="/tmp",
                               env=dict(os.environ, TMPDIR="/tmp"))
            check(r.returncode == 0 and "[  PASSED  ] 1 test" in r.stdout and "SKIPPED" not in r.stdout,
                  f"session_test's non-root case runs and passes as uid {DAEMON}", r.stdout[-800:] + r.stderr[-400:])
        else:
            print(f"note: {session_test} not built (unit tests off in this build): its non-root case not run")
    finally:
        kill_daemons(list(procs.values()), shm_prefix=shm)
    return finish(work)


if __name__ == "__main__":
    sys.exit(main())
