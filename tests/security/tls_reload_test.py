#!/usr/bin/python3
"""Certificates renewed on disk apply without a restart (ckpt-meta
--tls-reload-seconds; docs/security.md "Rotating"; label integration).

ckpt-meta serves mutual TLS from files in a directory; the test swaps them
for a certificate, key and CA bundle of another CA (each file replaced by a
rename, as cert-manager or a Vault agent does). The certificates carry ckpt
identities (scripts/make-test-ca.sh: meta's ckpt://meta, the agent's
ckpt://node/renewed, the callers' ckpt://admin/...), as the daemons require.
Checked:
  - before: a caller of the first CA is served, one of the second refused;
  - after the swap (within 30 s at a 1 s reload period): the second CA's
    caller is served, the first's refused, and meta never restarted;
  - a broken certificate file does not take meta down (new handshakes fail
    while it is there: gRPC's watcher takes it), and once fixed it serves;
  - a caller's own certificate renews too: an agent (--tls-reload-seconds 1)
    whose certificate meta does not trust cannot register; once its files
    are swapped for ones meta trusts it registers, with no restart.
Run: CKPT_BUILD_DIR=build /usr/bin/python3 tests/security/tls_reload_test.py
"""
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("CKPT_BUILD_DIR", ROOT / "build")).resolve()
sys.path.insert(0, str(ROOT / "tests" / "support"))
from checks import check, eventually, finish  # noqa: E402
from localnet import free_ports, start_daemon, wait_tcp  # noqa: E402



def replace(src, dst):
    """Puts a copy of src at dst by a rename (never a half-written dst)."""
    tmp = dst.with_name(dst.name + ".new")
    shutil.copyfile(src, tmp)
    tmp.chmod(0o600)
    os.replace(tmp, dst)


def main():
    if shutil.which("openssl") is None:
        print("SKIP: no openssl command")
        return 77
    work = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-tls-reload-"))
    meta = None
    agent = None
    shm = pathlib.Path(f"/dev/shm/ckpt-tls-reload-{os.getpid()}")
    try:
        for ca in ("ca1", "ca2"):
            subprocess.run([str(ROOT / "scripts" / "make-test-ca.sh"), str(work / ca)], check=True,
                           stdout=subprocess.DEVNULL, env=dict(os.environ, TEST_CA_NODES="renewed"))
        live = work / "live"
        live.mkdir()
        for name in ("ca.pem", "meta.pem", "meta.key"):
            replace(work / "ca1" / name, live / name)
        port, metrics = free_ports(2)
        address = f"127.0.0.1:{port}"
        meta = start_daemon(BUILD / "bin", work, "ckpt-meta",
                            ["--listen", address, "--metrics-listen", f"127.0.0.1:{metrics}", "--data-dir",
                             str(work / "meta"), "--tls-ca", str(live / "ca.pem"), "--tls-cert",
                             str(live / "meta.pem"), "--tls-key", str(live / "meta.key"),
                             "--tls-reload-seconds", "1"])
        wait_tcp(port, meta, 30)

        def status_args(ca, *args):
            d = work / ca
            return subprocess.run([str(BUILD / "bin" / "ckptctl"), "--meta", address, "--timeout", "3", "--tls-ca",
                                   str(d / "ca.pem"), "--tls-cert", str(d / "admin.pem"), "--tls-key",
                                   str(d / "admin.key")] + list(args), capture_output=True, text=True, timeout=60)

        def status(ca):
            return status_args(ca, "status")

        def refused_by_tls(r):
            """The call failed in the TLS handshake, for the certificate (not meta down, not a timeout)."""
            return (r.returncode != 0 and "UNAVAILABLE" in r.stderr and "Tls handshake failed" in r.stderr and
                    "certificate verify failed" in r.stderr)

        check(status("ca1").returncode == 0, "before the swap, a caller of the first CA is served")
        r = status("ca2")
        check(refused_by_tls(r), "before the swap, a caller of the second CA is refused (certificate verify failed)",
              r.stderr[-600:])

        for name in ("ca.pem", "meta.pem", "meta.key"):
            replace(work / "ca2" / name, live / name)
        check(eventually(lambda: status("ca2").returncode == 0),
              "after the swap, a caller of the second CA is served (no restart)")
        r = status("ca1")
        check(refused_by_tls(r), "after the swap, a caller of the first CA is refused (certificate verify failed)",
              r.stderr[-600:])
        check(meta.poll() is None, "meta kept running through the swap")

        # A broken certificate (gRPC's watcher takes it: new handshakes fail,
        # docs/security.md) does not take meta down; the fixed file is taken.
        (live / "meta.pem.new").write_text("-----BEGIN CERTIFICATE-----\nnot a certificate\n")
        os.replace(live / "meta.pem.new", live / "meta.pem")
        # gRPC's watcher has read the bad file when it logs (to meta's log)
        # that the new certificate cannot be used.
        meta_log = work / "ckpt-meta.log"
        check(eventually(lambda: "Update handshaker factory failed" in meta_log.read_text(errors="replace"),
                         timeout=30),
              "meta's certificate watcher read the broken file", meta_log.read_text(errors="replace")[-600:])
        check(meta.poll() is None, "a broken certificate file does not take meta down")
        replace(work / "ca2" / "meta.pem", live / "meta.pem")
        check(eventually(lambda: status("ca2").returncode == 0) and meta.poll() is None,
              "once the file is fixed, meta serves again (no restart)")

        # The agent's certificate towards meta (meta now trusts ca2 only): first one of ca1.
        mine = work / "agent-live"
        mine.mkdir()
        replace(work / "ca2" / "ca.pem", mine / "ca.pem")
        for name in ("node-renewed.pem", "node-renewed.key"):
            replace(work / "ca1" / name, mine / name)
        ap, dp, am = free_ports(3)
        agent = start_daemon(BUILD / "bin", work, "ckpt-agent",
                             ["--node-id", "renewed", "--meta", address, "--listen", f"127.0.0.1:{ap}",
                              "--data-listen", f"127.0.0.1:{dp}", "--metrics-listen", f"127.0.0.1:{am}",
                              "--run-dir", str(work / "agent-run"), "--memory", "16MiB", "--memory-dir", str(shm),
                              "--tls-ca", str(mine / "ca.pem"), "--tls-cert", str(mine / "node-renewed.pem"),
                              "--tls-key", str(mine / "node-renewed.key"), "--tls-reload-seconds", "1"])
        wait_tcp(ap, agent, 60)
        log = work / "ckpt-agent.log"
        check(eventually(lambda: "cannot register with meta" in log.read_text(errors="replace")),
              "an agent whose certificate meta does not trust cannot register", log.read_text()[-600:])

        def member():
            r = status_args("ca2", "--json", "nodes")
            return r.returncode == 0 and '"renewed"' in r.stdout
        check(not member(), "the refused agent is not a member")
        for name in ("node-renewed.pem", "node-renewed.key"):
            replace(work / "ca2" / name, mine / name)
        check(eventually(member), "after its files are swapped, the agent registers (no restart)",
              log.read_text()[-600:])
        check(agent.poll() is None, "the agent kept running through the swap")
    finally:
        for p in (meta, agent):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        shutil.rmtree(shm, ignore_errors=True)
    return finish(work)


if __name__ == "__main__":
    sys.exit(main())
