"""TestPki: certificates for Python tests, made by the real `ckptctl certs` binary as an operator
would (docs/cli.md "Certificates"); the Python twin of tests/support/pki.h.

    pki = TestPki(tmpdir, BUILD / "bin" / "ckptctl")
    meta = pki.meta()                  # .ca .cert .key: paths (str)
    node = pki.node("node-1")
    admin = pki.client("admin", "ops")
    trainer = pki.client("trainer", "t", jobs=["job-a", "exp-*"])
    env = {**os.environ, **pki.env("trainer", "t", jobs=["job-a"])}   # CKPT_TLS_CA/CERT/KEY

One CA in <tmpdir>/ca (made by the constructor); each identity is issued once, on first use, and
the same files are returned afterwards. Meta and node certificates name 127.0.0.1, ::1 and
localhost. A ckptctl failure raises RuntimeError with its message. Thread-safe (one lock around
issuing). The issuing itself is localnet.ClusterTls's (which the cluster fixtures use); TestPki
takes the ckptctl path instead of the bin dir and adds env() and the lock.
"""
import pathlib
import threading

from localnet import ClusterTls, TlsFiles, tls_env, tls_flags  # noqa: F401 (re-exported)

ROLES = ("meta", "node", "admin", "operator", "trainer")


class TestPki(ClusterTls):
    __test__ = False  # not a pytest test class

    def __init__(self, tmpdir, ckptctl_path):
        self._lock = threading.Lock()
        ckptctl = pathlib.Path(ckptctl_path)
        self._ckptctl_path = str(ckptctl)
        super().__init__(tmpdir, ckptctl.parent)
        self.ckptctl = str(ckptctl)  # the binary given, whatever its name

    def _certs(self, *args):
        self.ckptctl = self._ckptctl_path
        return super()._certs(*args)

    def _issue(self, key, command, *args):
        with self._lock:
            return super()._issue(key, command, *args)

    def files(self, role, name=None, jobs=None):
        """The files of any identity: role "meta" (no name), "node" (name: the node id), or a
        client role "admin", "operator", "trainer" (jobs: its job patterns, required)."""
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
        if role == "meta":
            return self.meta()
        if not name:
            raise ValueError(f"a {role} certificate needs a name")
        if role == "node":
            return self.node(name)
        return self.client(role, name, jobs)

    def env(self, role, name=None, jobs=None):
        """CKPT_TLS_CA, CKPT_TLS_CERT, CKPT_TLS_KEY for that identity (what ckptctl and the client
        library read), as a dict to merge into a child's environment."""
        return tls_env(self.files(role, name, jobs))

    def flags(self, role, name=None, jobs=None):
        """--tls-ca/--tls-cert/--tls-key for that identity (a daemon's or ckptctl's flags)."""
        return tls_flags(self.files(role, name, jobs))
