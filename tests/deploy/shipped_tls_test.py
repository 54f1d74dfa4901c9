#!/usr/bin/python3
"""The shipped deploy files' TLS set-up, run for real on 127.0.0.1: the
certificates are made with the exact commands the files document, put where
the files say, and the daemons are started with the files' own settings
(addresses, ports and directories moved into a temporary directory and onto
loopback); each agent must then register with meta over mutual TLS, which
needs its certificate to name its node id (the agent checks its own at start,
meta checks it at RegisterNode).

- systemd: the `ckptctl certs` lines of deploy/systemd/ckpt-meta.env and
  ckpt-agent.env and the `install` lines of the units' headers; meta and agent
  started with the env files' CKPT_* settings.
- Kubernetes, base: the shell blocks of deploy/k8s/README.md ("The cluster
  CA", "Base", "cert-manager") run by bash with a stand-in `kubectl` that keeps
  each Secret as a directory of its keys; meta started with the ConfigMap's
  meta.yaml and the Secret ckpt-meta-tls where the StatefulSet mounts it; an
  agent with agent.yaml and the DaemonSet's CKPT_* environment (node id = the
  node name), the Secret ckpt-node-tls where the DaemonSet mounts it.
- Kubernetes, overlays/cert-manager: the init container's script run by sh
  (twice: an init container may run again) with the Secret ckpt-ca mounted as
  its volume mounts say; then an agent with the files it wrote.
- The trainer example's certificate (deploy/k8s/examples/trainer.yaml's
  commands): ckptctl with it lists the jobs through meta.

usage: shipped_tls_test.py SOURCE_DIR CKPT_META CKPT_AGENT CKPTCTL
"""
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "support"))
from checks import check, eventually, failures, finish  # noqa: E402
from localnet import free_ports  # noqa: E402

# A stand-in for kubectl: `create secret generic NAME --from-file=KEY=FILE...`
# and `create secret tls NAME --cert=F --key=F` copy the files to
# $SECRETS/NAME/KEY; `get nodes` prints $NODES; anything else does nothing.
KUBECTL = r'''#!/usr/bin/python3
import os, shutil, sys
a = [x for x in sys.argv[1:]]
while a[:1] == ["-n"] or (a and a[0].startswith("--namespace")):
    a = a[2:] if a[0] == "-n" else a[1:]
if a[:2] == ["get", "nodes"]:
    print(os.environ["NODES"]); sys.exit(0)
if a[:2] == ["create", "secret"]:
    kind, name, rest = a[2], a[3], a[4:]
    d = os.path.join(os.environ["SECRETS"], name)
    os.makedirs(d)
    for r in rest:
        if r.startswith("--from-file="):
            key, _, f = r[len("--from-file="):].partition("=")
            shutil.copy(f, os.path.join(d, key))
        elif r.startswith("--cert="):
            shutil.copy(r[len("--cert="):], os.path.join(d, "tls.crt"))
        elif r.startswith("--key="):
            shutil.copy(r[len("--key="):], os.path.join(d, "tls.key"))
        elif r.startswith("--"):
            sys.exit("kubectl stand-in: unknown option " + r)
sys.exit(0)
'''
# ckptctl: `certs ...` runs the real one; calls to a cluster (the README's
# last lines, against a port-forward) do nothing here.
CKPTCTL = '''#!/bin/sh
if [ "$1" = certs ]; then exec "$REAL_CKPTCTL" "$@"; fi
exit 0
'''


def env_settings(path):
    """CKPT_* variables set (not commented out) in an EnvironmentFile."""
    out = {}
    for line in open(path):
        m = re.match(r"\s*(CKPT_[A-Z0-9_]+)=(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def comment_commands(path, start):
    """Commands shown in a file's comments that start with `start`."""
    cmds = []
    for line in open(path):
        line = line.strip().lstrip("#").strip()
        if line.startswith(start):
            cmds.append(line.split("  #")[0].strip())
    return cmds


def markdown_block(path, heading):
    """The first ``` block after `heading` in a Markdown file."""
    text = open(path).read()
    at = text.index(heading)
    m = re.search(r"```\n(.*?)```", text[at:], re.S)
    return m.group(1)


def run(argv, **kw):
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)
    if out.returncode != 0:
        raise RuntimeError(f"{argv} exited {out.returncode}: {out.stdout}{out.stderr}")
    return out.stdout


def http_status(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


class Daemons:
    def __init__(self, work, shm):
        self.work, self.shm, self.procs = work, shm, []

    def start(self, name, argv, env):
        """Starts argv with os.environ less CKPT_* plus env; output in WORK/name.log."""
        log = open(self.work / f"{name}.log", "w")
        clean = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
        p = subprocess.Popen(argv, env=dict(clean, **env), stdout=log, stderr=subprocess.STDOUT)
        p.log_path = self.work / f"{name}.log"
        self.procs.append((name, p))
        return p

    def ready(self, what, proc, metrics_port, timeout=60):
        """Checks that proc's /readyz answers 200 within timeout s (an agent: registered)."""
        ok = eventually(lambda: proc.poll() is not None or http_status(metrics_port, "/readyz") == 200,
                        timeout=timeout, period=0.2)
        ok = ok and proc.poll() is None
        check(ok, f"{what} is ready (/readyz 200)", proc.log_path.read_text()[-3000:] if not ok else "")
        return ok

    def stop(self):
        for _, p in self.procs:
            if p.poll() is None:
                p.terminate()
        for _, p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


def remap_etc(value, root):
    return value.replace("/etc/ckpt/", str(root) + "/etc/ckpt/") if value.startswith("/etc/ckpt/") else value


def systemd(src, bins, work, daemons, shm):
    sd = src / "deploy" / "systemd"
    top = work / "systemd"
    top.mkdir()
    # The certificates, as the env files' comments make them.
    cmds = comment_commands(sd / "ckpt-meta.env", "ckptctl certs") + \
        comment_commands(sd / "ckpt-agent.env", "ckptctl certs")
    check(len(cmds) == 3, "the systemd env files show create-ca, create-meta and create-node", str(cmds))
    for c in cmds:
        c = c.replace("<this host's name>", "localhost").replace("<its name>", "localhost")
        c = c.replace("<its IP>", "127.0.0.1")
        run([bins["ckptctl"]] + shlex.split(c)[1:], cwd=top)
    # Installed as the units' headers say, on a meta host and on node-1.
    for daemon, host in (("ckpt-meta", "meta-host"), ("ckpt-agent", "node-1")):
        root = top / host
        for c in comment_commands(sd / f"{daemon}.service", "install"):
            if "/etc/ckpt/tls" not in c:
                continue
            argv = shlex.split(c.replace("/etc/ckpt/", f"{root}/etc/ckpt/"))
            if "-o" in argv:  # as root here, with no ckpt user: the owner is ours
                i = argv.index("-o")
                del argv[i:i + 2]
            if "-g" in argv:
                i = argv.index("-g")
                del argv[i:i + 2]
            run(argv, cwd=top)
    meta_grpc, meta_metrics, a_grpc, a_data, a_metrics = free_ports(5)
    meta_env = env_settings(sd / "ckpt-meta.env")
    meta_env = {k: remap_etc(v, top / "meta-host") for k, v in meta_env.items()}
    meta_env.update(CKPT_LISTEN=f"127.0.0.1:{meta_grpc}", CKPT_METRICS_LISTEN=f"127.0.0.1:{meta_metrics}",
                    CKPT_DATA_DIR=str(top / "meta-data"))
    check(all(meta_env.get(v) for v in ("CKPT_TLS_CA", "CKPT_TLS_CERT", "CKPT_TLS_KEY")),
          "ckpt-meta.env names the three TLS files")
    meta = daemons.start("systemd-meta", [bins["meta"]], meta_env)
    if not daemons.ready("systemd: ckpt-meta with ckpt-meta.env", meta, meta_metrics):
        return
    agent_env = env_settings(sd / "ckpt-agent.env")
    agent_env = {k: remap_etc(v, top / "node-1") for k, v in agent_env.items()}
    agent_env.update(CKPT_NODE_ID="node-1", CKPT_META=f"127.0.0.1:{meta_grpc}",
                     CKPT_LISTEN=f"127.0.0.1:{a_grpc}", CKPT_DATA_LISTEN=f"127.0.0.1:{a_data}",
                     CKPT_METRICS_LISTEN=f"127.0.0.1:{a_metrics}", CKPT_RUN_DIR=str(top / "run"),
                     CKPT_MEMORY="64MiB", CKPT_MEMORY_DIR=str(shm / "systemd-node-1"),
                     CKPT_DURABLE_ROOT=str(top / "durable"))
    agent = daemons.start("systemd-agent", [bins["agent"]], agent_env)
    daemons.ready("systemd: ckpt-agent with ckpt-agent.env registers with meta (ckpt://node/node-1)", agent,
                  a_metrics)


def k8s_docs(src, bins, top):
    """Runs deploy/k8s/README.md's blocks with the stand-ins; returns the Secrets' directory."""
    readme = src / "deploy" / "k8s" / "README.md"
    check(readme.exists(), "deploy/k8s/README.md shows how to make the certificates")
    if not readme.exists():
        return None
    stubs = top / "bin"
    stubs.mkdir()
    (stubs / "kubectl").write_text(KUBECTL)
    (stubs / "ckptctl").write_text(CKPTCTL)
    for f in stubs.iterdir():
        f.chmod(0o755)
    secrets = top / "secrets"
    secrets.mkdir()
    script = "set -e\n" + "\n".join(markdown_block(readme, h) for h in (
        "## The cluster CA", "## Base (", "## cert-manager ("))
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", REAL_CKPTCTL=bins["ckptctl"],
               SECRETS=str(secrets), NODES="k8s-node-1", USER="deploy-test")
    out = subprocess.run(["bash", "-c", script], cwd=top, env=env, capture_output=True, text=True, timeout=300)
    check(out.returncode == 0, "deploy/k8s/README.md's commands run", out.stdout + out.stderr)
    # The trainer example's commands (its header comment).
    trainer = src / "deploy" / "k8s" / "examples" / "trainer.yaml"
    lines = [l.strip().lstrip("#").strip() for l in open(trainer) if l.strip().startswith("#")]
    cmds, cur = [], ""
    for l in lines:
        cur += (" " if cur else "") + l.rstrip("\\").strip()
        if not l.endswith("\\"):
            if cur.startswith(("ckptctl certs", "kubectl")) and "apply" not in cur:
                cmds.append(cur.replace("<your-namespace>", "default"))
            cur = ""
    out = subprocess.run(["bash", "-c", "set -e\n" + "\n".join(cmds)], cwd=top, env=env, capture_output=True,
                         text=True, timeout=120)
    check(out.returncode == 0 and len(cmds) == 2, "examples/trainer.yaml's commands run",
          f"{cmds}\n{out.stdout}{out.stderr}")
    return secrets


def k8s(src, bins, work, daemons, shm):
    top = work / "k8s"
    top.mkdir()
    failed_before = len(failures)
    secrets = k8s_docs(src, bins, top)
    if secrets is None:
        return
    for name, keys in (("ckpt-meta-tls", ("ca.crt", "tls.crt", "tls.key")),
                       ("ckpt-node-tls", ("ca.pem", "k8s-node-1.pem", "k8s-node-1.key")),
                       ("ckpt-ca", ("tls.crt", "tls.key")),
                       ("ckpt-trainer-example-tls", ("ca.crt", "tls.crt", "tls.key"))):
        have = sorted(p.name for p in (secrets / name).iterdir()) if (secrets / name).is_dir() else []
        check(set(keys) <= set(have), f"Secret {name} holds {', '.join(keys)}", f"holds {have}")
    if len(failures) > failed_before:
        return
    base = src / "deploy" / "k8s" / "base"
    cm = next(d for d in yaml.safe_load_all(open(base / "configmap.yaml")) if d)
    sts = next(d for d in yaml.safe_load_all(open(base / "meta.yaml")) if d and d["kind"] == "StatefulSet")
    ds = next(d for d in yaml.safe_load_all(open(base / "agent.yaml")) if d)

    def mounts_of(pod_spec, container):
        """mountPath -> local directory of the Secret (or emptyDir) behind it."""
        vols = {v["name"]: v for v in pod_spec.get("volumes", [])}
        out = {}
        for m in container.get("volumeMounts", []):
            v = vols.get(m["name"], {})
            if "secret" in v:
                out[m["mountPath"]] = str(secrets / v["secret"]["secretName"])
        return out

    def remap(value, mounts):
        for mp, local in mounts.items():
            if value.startswith(mp + "/"):
                return local + value[len(mp):]
        return value

    # ckpt-meta: meta.yaml of the ConfigMap, the Secret where the StatefulSet mounts it.
    meta_c = sts["spec"]["template"]["spec"]["containers"][0]
    mounts = mounts_of(sts["spec"]["template"]["spec"], meta_c)
    cfg = yaml.safe_load(cm["data"]["meta.yaml"])
    meta_grpc, meta_metrics = free_ports(2)
    cfg = {k: (remap(v, mounts) if isinstance(v, str) else v) for k, v in cfg.items()}
    cfg.update(listen=f"127.0.0.1:{meta_grpc}", metrics_listen=f"127.0.0.1:{meta_metrics}",
               data_dir=str(top / "meta-data"))
    (top / "meta.yaml").write_text(yaml.safe_dump(cfg))
    meta = daemons.start("k8s-meta", [bins["meta"], "--config", str(top / "meta.yaml")], {})
    if not daemons.ready("k8s: ckpt-meta with the ConfigMap and Secret ckpt-meta-tls", meta, meta_metrics):
        return

    ds_spec = ds["spec"]["template"]["spec"]
    agent_c = ds_spec["containers"][0]

    def start_agent(node, tls_dirs, label):
        grpc, data, metrics = free_ports(3)
        cfg = yaml.safe_load(cm["data"]["agent.yaml"])
        cfg.update(meta=f"127.0.0.1:{meta_grpc}", metrics_listen=f"127.0.0.1:{metrics}",
                   run_dir=str(top / f"run-{node}"), memory="64MiB", memory_dir=str(shm / node),
                   durable_root=str(top / "durable"))
        (top / f"agent-{node}.yaml").write_text(yaml.safe_dump(cfg))
        env = {}
        field = {"spec.nodeName": node, "status.podIP": "127.0.0.1"}
        for e in agent_c["env"]:
            if "valueFrom" in e:
                value = field[e["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                value = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
            env[e["name"]] = remap(value, tls_dirs)
        env.update(CKPT_LISTEN=f"127.0.0.1:{grpc}", CKPT_DATA_LISTEN=f"127.0.0.1:{data}")
        check(env.get("CKPT_NODE_ID") == node, f"{label}: CKPT_NODE_ID is the node name")
        p = daemons.start(f"k8s-agent-{node}", [bins["agent"], "--config", str(top / f"agent-{node}.yaml")], env)
        daemons.ready(f"{label}: ckpt-agent on {node} registers with meta (ckpt://node/{node})", p, metrics)

    start_agent("k8s-node-1", mounts_of(ds_spec, agent_c), "k8s base (Secret ckpt-node-tls)")

    # overlays/cert-manager: the init container mints k8s-node-2's certificate.
    patch = next(d for d in yaml.safe_load_all(open(src / "deploy" / "k8s" / "overlays" / "cert-manager" /
                                                   "agent-node-cert.yaml")) if d)
    pspec = patch["spec"]["template"]["spec"]
    init = pspec["initContainers"][0]
    vols = {v["name"]: v for v in pspec["volumes"]}
    emptydir = top / "node-2-tls"
    emptydir.mkdir()
    local = {}
    for m in init["volumeMounts"]:
        v = vols[m["name"]]
        if "emptyDir" in v:
            local[m["mountPath"]] = str(emptydir)
        elif "secret" in v:  # subPath of an item: a regular file, the item's mode
            item = next(i for i in v["secret"]["items"] if i["path"] == m["subPath"])
            dst = top / "node-2-ca" / os.path.basename(m["mountPath"])
            dst.parent.mkdir(exist_ok=True)
            shutil.copy(secrets / v["secret"]["secretName"] / item["key"], dst)
            dst.chmod(item.get("mode", v["secret"].get("defaultMode", 0o644)))
            local[os.path.dirname(m["mountPath"])] = str(dst.parent)
    script = init["command"][-1].replace("/usr/local/bin/ckptctl", bins["ckptctl"])
    for mp in sorted(local, key=len, reverse=True):
        script = re.sub(re.escape(mp) + r"(?=[/\s\"']|$)", local[mp], script)
    env = dict(os.environ, NODE_NAME="k8s-node-2", POD_IP="127.0.0.1")
    for attempt in ("runs", "runs again (idempotent)"):
        out = subprocess.run(init["command"][:-1] + [script], env=env, capture_output=True, text=True, timeout=60)
        check(out.returncode == 0, f"cert-manager overlay: the init container's script {attempt}",
              script + "\n" + out.stdout + out.stderr)
    agent_mounts = {m["mountPath"]: str(emptydir) for m in agent_c["volumeMounts"] if m["name"] == "tls"}
    start_agent("k8s-node-2", agent_mounts, "k8s cert-manager overlay (init container)")

    # The nodes meta lists, with the README's admin certificate; the trainer
    # example's certificate reaches meta too.
    admin = {"CKPT_TLS_CA": str(top / "ckpt-ca" / "ca.pem"), "CKPT_TLS_CERT": str(top / "admin.pem"),
             "CKPT_TLS_KEY": str(top / "admin.key")}
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    out = subprocess.run([bins["ckptctl"], "--meta", f"127.0.0.1:{meta_grpc}", "nodes"], env=dict(clean, **admin),
                         capture_output=True, text=True, timeout=60)
    check(out.returncode == 0 and "k8s-node-1" in out.stdout and "k8s-node-2" in out.stdout,
          "ckptctl (README's admin certificate) lists both nodes", out.stdout + out.stderr)
    t = secrets / "ckpt-trainer-example-tls"
    trainer = {"CKPT_TLS_CA": str(t / "ca.crt"), "CKPT_TLS_CERT": str(t / "tls.crt"),
               "CKPT_TLS_KEY": str(t / "tls.key")}
    out = subprocess.run([bins["ckptctl"], "--meta", f"127.0.0.1:{meta_grpc}", "jobs"], env=dict(clean, **trainer),
                         capture_output=True, text=True, timeout=60)
    check(out.returncode == 0, "the trainer example's certificate is served by meta (ckptctl jobs)",
          out.stdout + out.stderr)


def main():
    if len(sys.argv) != 5:
        print(__doc__)
        return 2
    src = pathlib.Path(sys.argv[1]).resolve()
    bins = {"meta": sys.argv[2], "agent": sys.argv[3], "ckptctl": sys.argv[4]}
    probe = subprocess.run([bins["ckptctl"], "certs", "--help"], capture_output=True, text=True)
    if probe.returncode != 0 or "create-node" not in probe.stdout:
        print(f"FAIL: {bins['ckptctl']} has no `certs` subcommand:\n{probe.stdout}{probe.stderr}")
        return 1
    work = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-shipped-tls-"))
    shm = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-shipped-tls-",
                                        dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    daemons = Daemons(work, shm)
    try:
        systemd(src, bins, work, daemons, shm)
        daemons.stop()
        k8s(src, bins, work, daemons, shm)
    finally:
        daemons.stop()
        shutil.rmtree(shm, ignore_errors=True)
    return finish(work)


if __name__ == "__main__":
    sys.exit(main())
