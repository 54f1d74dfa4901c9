#!/usr/bin/python3
"""tests/support/pki.py (TestPki): certificates made by the real `ckptctl certs`, each identity
issued once, the identity inside each (read back with `ckptctl certs show --json`), env() and
flags(), safe from several threads, ckptctl's refusals raised as RuntimeError.
Run: CKPT_BUILD_DIR=build /usr/bin/python3 tests/support/pki_py_test.py
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("CKPT_BUILD_DIR", ROOT / "build")).resolve()
sys.path.insert(0, str(ROOT / "tests" / "support"))
from checks import check, finish  # noqa: E402
from pki import TestPki  # noqa: E402


def show(ckptctl, cert):
    r = subprocess.run([ckptctl, "--json", "certs", "show", cert], capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr}


def main():
    ckptctl = str(BUILD / "bin" / "ckptctl")
    if not os.access(ckptctl, os.X_OK):
        print(f"no {ckptctl}: build it first")
        return 77
    work = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-pki-py-"))
    pki = TestPki(work, ckptctl)
    check((work / "ca" / "ca.pem").is_file() and (work / "ca" / "ca.key").stat().st_mode & 0o777 == 0o600,
          "the constructor makes the CA (ca.key mode 0600)")

    meta = pki.meta()
    check(pki.meta().cert == meta.cert, "the same identity gives the same files")
    check(meta.ca == str(work / "ca" / "ca.pem"), "ca is the CA's certificate")
    m = show(ckptctl, meta.cert)
    check(m.get("identity", {}).get("role") == "meta" and sorted(m.get("ip", [])) == ["127.0.0.1", "::1"]
          and m.get("dns") == ["localhost"], "meta: ckpt://meta for 127.0.0.1, ::1, localhost", m)
    n = show(ckptctl, pki.node("node-1").cert)
    check(n.get("identity") == {"role": "node", "name": "node-1", "jobs": []}, "node: ckpt://node/node-1", n)
    check(pki.node("node-2").cert != pki.node("node-1").cert, "another node, other files")
    for role in ("admin", "operator"):
        c = show(ckptctl, pki.client(role, "x").cert)
        check(c.get("identity") == {"role": role, "name": "x", "jobs": []}
              and c.get("extended_key_usage") == ["clientAuth"], f"{role}: a client certificate", c)
    t = pki.client("trainer", "t", jobs=["job-a", "exp-*"])
    c = show(ckptctl, t.cert)
    check(c.get("identity") == {"role": "trainer", "name": "t", "jobs": ["job-a", "exp-*"]},
          "trainer: its job patterns", c)
    check(os.stat(t.key).st_mode & 0o777 == 0o600, "keys are mode 0600")

    env = pki.env("trainer", "t", jobs=["job-a", "exp-*"])
    check(env == {"CKPT_TLS_CA": t.ca, "CKPT_TLS_CERT": t.cert, "CKPT_TLS_KEY": t.key},
          "env() gives CKPT_TLS_CA/CERT/KEY of the same files", env)
    check(pki.env("meta")["CKPT_TLS_CERT"] == meta.cert, "env('meta')")
    check(pki.env("node", "node-1")["CKPT_TLS_CERT"] == pki.node("node-1").cert, "env('node', id)")
    check(pki.flags("admin", "x") == ["--tls-ca", meta.ca, "--tls-cert", pki.client("admin", "x").cert,
                                      "--tls-key", pki.client("admin", "x").key], "flags()")

    got = []
    threads = [threading.Thread(target=lambda: got.append(pki.client("admin", "racer").cert)) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    check(len(got) == 4 and len(set(got)) == 1, "threads asking for one identity get one set of files", got)

    try:
        pki.node("../x")
        check(False, "a bad node id raises RuntimeError")
    except RuntimeError as e:
        check("node id" in str(e) and "exit 2" in str(e), "a bad node id raises RuntimeError with ckptctl's message",
              str(e))
    try:
        pki.env("trainer", "t2")
        check(False, "a trainer without jobs raises RuntimeError")
    except RuntimeError as e:
        check("--jobs" in str(e), "a trainer without jobs raises RuntimeError", str(e))
    return finish(work)


if __name__ == "__main__":
    sys.exit(main())
