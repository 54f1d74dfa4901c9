#!/usr/bin/python3
"""The memory tier is the agent's own: a directory, pool, record or
incarnation file that someone else planted stops the agent at start (issue 34
finding 2; docs/agent.md "Memory tier", docs/security.md; label integration).

Each case prepares a memory directory, starts ckpt-agent (and, for the pool,
ckpt-dpu-agent) on it, and checks that it exits non-zero before it serves
anything (no TCP listener, no socket in its run dir), with a message naming
the path, its owner uid and mode, and saying to remove it, and that the
planted file is left as it was (the agent neither resized nor wrote it):
  - pool.bin of uid 65534 (nobody), mode 0666, in a directory of the agent's;
  - pool.bin the agent's own but mode 0666 (someone may have it open);
  - pool.bin a symbolic link to a file elsewhere (the target is untouched);
  - pool.bin with a second hard link;
  - the memory directory of uid 65534; the agent's own but world-writable
    (0777) or group-writable (0770); a symbolic link to a directory;
  - a record (records/*.rec) of uid 65534; the records directory of uid 65534;
  - the incarnation file of uid 65534.
Then the tier as the agent makes it: started on a fresh directory next to
ckpt-meta, the directory and records/ are 0700, pool.bin and the
incarnation file 0600, all owned by the agent's uid; a directory of its own
left at 0755 (by an earlier version) is narrowed to 0700; killed with
SIGKILL and started again, it re-adopts its tier (its own files pass).
Needs root (to give files to uid 65534); exits 77 (skipped) otherwise.
Run: CKPT_BUILD_DIR=build /usr/bin/python3 tests/security/memory_tier_test.py
"""
import os
import pathlib
import signal
import socket
import stat
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("CKPT_BUILD_DIR", ROOT / "build")).resolve()
sys.path.insert(0, str(ROOT / "tests" / "support"))
from checks import check, eventually, finish  # noqa: E402
from localnet import ClusterTls, free_ports, kill_daemons, start_daemon, wait_tcp  # noqa: E402

NOBODY = 65534


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def listening(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


class Env:
    def __init__(self, work):
        self.work = work
        self.meta = "127.0.0.1:1"  # no meta needed to refuse a tier
        self.tls = ClusterTls(work / "pki", BUILD / "bin")  # the daemons' default: mutual TLS
        self.runs = 0

    def args(self, binary, memory_dir, ports):
        ap, dp, mp = ports
        self.runs += 1
        node_id = "d0" if binary == "ckpt-dpu-agent" else "n0"
        node = ["--node-id", node_id] + (["--host-node", "n0"] if binary == "ckpt-dpu-agent" else [])
        return node + ["--meta", self.meta, "--listen", f"127.0.0.1:{ap}", "--data-listen", f"127.0.0.1:{dp}",
                       "--metrics-listen", f"127.0.0.1:{mp}", "--run-dir", str(self.work / f"run{self.runs}"),
                       "--memory", "16MiB", "--memory-dir", str(memory_dir)] + self.tls.node_flags(
                           node_id, "n0" if binary == "ckpt-dpu-agent" else None)

    def refused(self, what, memory_dir, expect, binary="ckpt-agent"):
        """Starts `binary` on memory_dir and checks it stops at start, saying every string of
        `expect`, and serves nothing."""
        ports = free_ports(3)
        args = self.args(binary, memory_dir, ports)
        run_dir = pathlib.Path(args[args.index("--run-dir") + 1])
        log = self.work / f"{binary}-{self.runs}.log"
        with open(log, "w") as f:
            p = subprocess.Popen([str(BUILD / "bin" / binary)] + args, stdout=f, stderr=subprocess.STDOUT)
        # It refuses before it listens; an agent that listens took the tier.
        eventually(lambda: p.poll() is not None or listening(ports[0]), timeout=60, period=0.1)
        if p.poll() is None:
            served = listening(ports[0])
            p.send_signal(signal.SIGKILL)
            p.wait()
            check(False, f"{binary} refuses {what}",
                  f"still running (serving on its port: {served}): {log.read_text()[-600:]}")
            return log.read_text()
        out = log.read_text()
        missing = [e for e in expect if e not in out]
        check(p.returncode != 0 and not missing, f"{binary} refuses {what}, naming it",
              f"exit {p.returncode}, missing {missing}: {out[-900:]}")
        sockets = [s.name for s in run_dir.glob("*.sock")] if run_dir.exists() else []
        check(not sockets and not listening(ports[0]), f"{binary} served nothing ({what})", f"sockets {sockets}")
        return out


def fresh(work, name, dir_mode=0o700):
    d = work / name
    d.mkdir()
    d.chmod(dir_mode)
    return d


def plant(path, owner=None, file_mode=0o666, data=b""):
    path.write_bytes(data)
    path.chmod(file_mode)
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def main():
    if os.geteuid() != 0:
        print("SKIP: needs root to give files to uid 65534")
        return 77
    for b in ("ckpt-agent", "ckpt-dpu-agent", "ckpt-meta", "ckptctl"):
        if not (BUILD / "bin" / b).exists():
            print(f"SKIP: no {b} in {BUILD / 'bin'}")
            return 77
    work = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-memtier-"))
    work.chmod(0o755)
    env = Env(work)
    procs = []
    shm = f"ckpt-memtier-test-{os.getpid()}"
    try:
        # --- pool.bin of another user, 0666: the finding -------------------------------------
        for binary in ("ckpt-agent", "ckpt-dpu-agent"):
            d = fresh(work, f"foreign-pool-{binary}")
            pool = plant(d / "pool.bin", owner=NOBODY)
            env.refused("a pool.bin of uid 65534 (mode 0666)", d,
                        [str(pool), "uid 65534", "0666", "remove"], binary)
            st = os.lstat(pool)
            check(st.st_size == 0 and st.st_uid == NOBODY and mode(pool) == 0o666,
                  f"{binary} left the planted pool as it was", f"size {st.st_size} uid {st.st_uid}")

        # The agent's own pool, but open to everyone: someone may hold it open.
        d = fresh(work, "wide-pool")
        pool = plant(d / "pool.bin", file_mode=0o666)
        env.refused("a pool.bin of its own with mode 0666", d, [str(pool), "0666", "remove"])
        check(os.lstat(pool).st_size == 0, "the too-wide pool was not resized")

        # A symlink to a file elsewhere: never followed, the target untouched.
        d = fresh(work, "symlink-pool")
        target = plant(work / "precious.bin", file_mode=0o600, data=b"precious bytes")
        (d / "pool.bin").symlink_to(target)
        env.refused("a pool.bin that is a symbolic link", d, [str(d / "pool.bin"), "symbolic link", "remove"])
        check(target.read_bytes() == b"precious bytes", "the symlink's target is untouched")

        # A second name for the pool, made while it was reachable.
        d = fresh(work, "linked-pool")
        pool = plant(d / "pool.bin", file_mode=0o600)
        os.link(pool, work / "other-name.bin")
        env.refused("a pool.bin with two hard links", d, [str(pool), "links", "remove"])

        # --- the memory directory --------------------------------------------------------------
        d = fresh(work, "foreign-dir", 0o755)
        os.chown(d, NOBODY, NOBODY)
        env.refused("a memory directory of uid 65534", d, [str(d), "uid 65534", "remove"])
        check(not (d / "pool.bin").exists(), "nothing was created in the foreign directory")

        d = fresh(work, "world-writable-dir", 0o777)
        env.refused("a world-writable memory directory (0777)", d, [str(d), "0777", "remove"])
        check(not (d / "pool.bin").exists(), "nothing was created in the world-writable directory")

        d = fresh(work, "group-writable-dir", 0o770)
        env.refused("a group-writable memory directory (0770)", d, [str(d), "0770", "remove"])

        real = fresh(work, "real-dir")
        link = work / "linked-dir"
        link.symlink_to(real)
        env.refused("a memory directory that is a symbolic link", link, [str(link), "symbolic link", "remove"])
        check(not (real / "pool.bin").exists(), "nothing was created behind the symlinked directory")

        # --- records and the incarnation file -----------------------------------------------------
        d = fresh(work, "foreign-record")
        (d / "records").mkdir(mode=0o700)
        rec = plant(d / "records" / "j.1.0.0000000000000001.rec", owner=NOBODY, file_mode=0o600, data=b"x")
        env.refused("a record of uid 65534", d, [str(rec), "uid 65534", "remove"])
        check(rec.exists(), "the foreign record is left for the operator")

        d = fresh(work, "foreign-records-dir")
        (d / "records").mkdir(mode=0o700)
        os.chown(d / "records", NOBODY, NOBODY)
        env.refused("a records directory of uid 65534", d, [str(d / "records"), "uid 65534", "remove"])

        d = fresh(work, "foreign-incarnation")
        inc = plant(d / "incarnation", owner=NOBODY, file_mode=0o644, data=b"7\n")
        env.refused("an incarnation file of uid 65534", d, [str(inc), "uid 65534", "remove"])

        # --- the tier as the agent makes it, and a restart that re-adopts it ------------------------
        mp, mm = free_ports(2)
        env.meta = f"127.0.0.1:{mp}"
        m = start_daemon(BUILD / "bin", work, "ckpt-meta",
                         ["--listen", env.meta, "--metrics-listen", f"127.0.0.1:{mm}", "--data-dir",
                          str(work / "meta")] + env.tls.meta_flags())
        procs.append(m)
        wait_tcp(mp, m, 30)
        for name, pre in (("fresh", None), ("legacy-0755", 0o755)):
            d = pathlib.Path(f"/dev/shm/{shm}-{name}")
            if pre is not None:
                d.mkdir(mode=pre)
                d.chmod(pre)
            ports = free_ports(3)
            args = env.args("ckpt-agent", d, ports)
            a = start_daemon(BUILD / "bin", work, f"ckpt-agent-{name}", args, binary="ckpt-agent")
            procs.append(a)
            wait_tcp(ports[0], a, 60)
            check(eventually(lambda: (d / "incarnation").exists(), timeout=30),
                  f"{name}: the agent registers and remembers its incarnation")
            modes = {p: (mode(d / p), os.lstat(d / p).st_uid) for p in (".", "records", "pool.bin", "incarnation")}
            want = {".": (0o700, 0), "records": (0o700, 0), "pool.bin": (0o600, 0), "incarnation": (0o600, 0)}
            check(modes == want, f"{name}: directory and records/ 0700, pool.bin and incarnation 0600, the agent's own",
                  str({p: (oct(m_), u) for p, (m_, u) in modes.items()}))
            leftovers = [p.name for p in d.iterdir() if ".tmp-" in p.name]
            check(not leftovers, f"{name}: no temporary files left", str(leftovers))
            a.send_signal(signal.SIGKILL)
            a.wait()
            a = start_daemon(BUILD / "bin", work, f"ckpt-agent-{name}", args, binary="ckpt-agent")
            procs.append(a)
            try:
                wait_tcp(ports[0], a, 60)
                ok = True
            except RuntimeError as e:
                ok = str(e)
            check(ok is True, f"{name}: after SIGKILL the agent starts again on its own tier", str(ok))
            log = work / f"ckpt-agent-{name}.log"
            check(eventually(lambda: log.read_text().count("registered with meta") >= 2, timeout=30),
                  f"{name}: it registers again", log.read_text()[-500:])
            a.send_signal(signal.SIGKILL)
            a.wait()
    finally:
        kill_daemons(procs, shm)
    return finish(work)


if __name__ == "__main__":
    sys.exit(main())
