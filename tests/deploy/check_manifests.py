#!/usr/bin/python3
"""Static checks of deploy/: Kubernetes manifests, systemd EnvironmentFiles,
the Dockerfile, the Grafana dashboard and docs/operations.md, against the
daemons' real flags (their --help) and the metric names in src/. Every
kustomization is also rendered (`kubectl kustomize`, offline, where kubectl
exists; otherwise by this script's own strategic merge of the patches) and
the rendered objects are checked the same way.

Secure by default (docs/security.md): no shipped configuration may run a
daemon insecure. Nothing under deploy/ says --insecure, CKPT_INSECURE or
`insecure: true`; every start of ckpt-meta, ckpt-agent and ckpt-dpu-agent (a
Kubernetes container, a systemd EnvironmentFile + ExecStart, the image's
CMD) has tls_ca, tls_cert and tls_key (flags, config-file keys or CKPT_TLS_*),
each a file something provides (a Secret, cert-manager's csi-driver, an
emptyDir an init container fills with `ckptctl certs`, /etc/ckpt on a host);
an agent's certificate is its node's own; no daemon's container mounts the
CA key; a listen address beyond loopback only with TLS; key and token files
in Secrets with modes the daemons accept.

usage: check_manifests.py SOURCE_DIR CKPT_META CKPT_AGENT
Exit 0 when every check passes; prints every failure and exits 1 otherwise.
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import yaml

failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL: " + msg)


def help_of(binary):
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        fail(f"{binary} --help exited {out.returncode}")
    return out.stdout + out.stderr


def flags_of(help_text):
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", help_text))


def default_port(help_text, flag):
    # CLI11 prints "--listen HOST:PORT=127.0.0.1:7400" (or "... [127.0.0.1:7400]").
    m = re.search(re.escape(flag) + r"\s+[A-Z:]+(?:=|\s+\[)\S*?:(\d+)\]?(?:\s|$)", help_text)
    if not m:
        fail(f"no default for {flag} in --help")
        return None
    return int(m.group(1))


def key_to_flag(key):
    return "--" + key.replace("_", "-")


def env_to_flag(name):
    return "--" + name[len("CKPT_"):].lower().replace("_", "-")


def load_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def main():
    if len(sys.argv) not in (4, 5, 6):
        print(__doc__)
        return 2
    src, meta_bin, agent_bin = sys.argv[1:4]
    daemons = {"ckpt-meta": help_of(meta_bin), "ckpt-agent": help_of(agent_bin)}
    extra = {os.path.basename(b): b for b in sys.argv[4:]}  # ckpt-dpu-agent (UCX builds), ckpt-dpu-proxy
    dpu_help = help_of(extra["ckpt-dpu-agent"]) if "ckpt-dpu-agent" in extra else None
    flags = {d: flags_of(h) for d, h in daemons.items()}
    for d in daemons:
        if "--config" not in flags[d] or "--listen" not in flags[d]:
            fail(f"{d} --help does not list --config/--listen: cannot check")
    ports = {
        "ckpt-meta": {"grpc": default_port(daemons["ckpt-meta"], "--listen"),
                      "metrics": default_port(daemons["ckpt-meta"], "--metrics-listen")},
        "ckpt-agent": {"grpc": default_port(daemons["ckpt-agent"], "--listen"),
                       "data": default_port(daemons["ckpt-agent"], "--data-listen"),
                       "metrics": default_port(daemons["ckpt-agent"], "--metrics-listen")},
    }
    # The defaults of docs/architecture.md "Interfaces".
    expected = {"ckpt-meta": {"grpc": 7400, "metrics": 9400},
                "ckpt-agent": {"grpc": 7401, "data": 7402, "metrics": 9401}}
    if ports != expected:
        fail(f"daemon default ports {ports} differ from docs/architecture.md {expected}")

    check_k8s(src, flags, ports)
    if dpu_help is not None:  # ckpt-dpu-agent: the agent's flags and --host-node
        flags["ckpt-dpu-agent"] = flags_of(dpu_help)
        if "--host-node" not in flags["ckpt-dpu-agent"]:
            fail("ckpt-dpu-agent --help does not list --host-node")
    if "ckpt-dpu-proxy" in extra:  # the host side of a DPU's control path: TLS client, unix socket
        flags["ckpt-dpu-proxy"] = flags_of(help_of(extra["ckpt-dpu-proxy"]))
        for want in ("--dpu-address", "--socket", "--tls-cert"):
            if want not in flags["ckpt-dpu-proxy"]:
                fail(f"ckpt-dpu-proxy --help does not list {want}")
    check_systemd_env(src, flags)
    check_dockerfile(src, ports)
    check_no_insecure_text(src)
    check_metrics(src)
    check_trainer_example(src)
    if failures:
        print(f"{len(failures)} failure(s)")
        return 1
    print("deploy manifests OK")
    return 0


def daemon_of(container):
    cmd = " ".join(container.get("command", []) + container.get("args", []))
    for d in ("ckpt-meta", "ckpt-agent", "ckpt-dpu-agent"):
        if re.search(r"(^|/|\s)" + re.escape(d) + r"(\s|$)", cmd):
            return d
    return None


def check_config_file(where, daemon, text, flags, ports):
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        fail(f"{where}: not YAML: {e}")
        return
    if not isinstance(cfg, dict):
        fail(f"{where}: not a mapping")
        return
    for key, value in cfg.items():
        if key_to_flag(key) not in flags[daemon]:
            fail(f"{where}: key '{key}' is not a {daemon} flag")
        if key in ("listen", "data_listen", "metrics_listen"):
            port = int(str(value).rsplit(":", 1)[1])
            name = {"listen": "grpc", "data_listen": "data", "metrics_listen": "metrics"}[key]
            if port != ports[daemon][name]:
                fail(f"{where}: {key} port {port} != default {ports[daemon][name]}")
    return cfg


def check_k8s(src, flags, ports):
    root = os.path.join(src, "deploy", "k8s")
    kustomizations = []
    for dirpath, _, files in os.walk(root):
        for name in sorted(files):
            if name.endswith((".yaml", ".yml")):
                path = os.path.join(dirpath, name)
                try:
                    docs = load_docs(path)
                except yaml.YAMLError as e:
                    fail(f"{path}: not YAML: {e}")
                    continue
                if name == "kustomization.yaml":
                    kustomizations.append((dirpath, docs[0]))
    for dirpath, k in kustomizations:
        for r in k.get("resources", []) + [p["path"] for p in k.get("patches", []) if "path" in p]:
            if not os.path.exists(os.path.join(dirpath, r)):
                fail(f"{dirpath}/kustomization.yaml: resource {r} does not exist")

    documented = documented_secrets(root)
    base = os.path.join(root, "base")
    k = load_docs(os.path.join(base, "kustomization.yaml"))[0]
    objects = []
    for r in k["resources"]:
        objects += load_docs(os.path.join(base, r))
    check_objects("base", objects, flags, ports, documented)

    # Rendered kustomizations (patches applied): with kubectl (offline), else
    # with the strategic merge below, which covers what deploy/k8s uses.
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        print("note: kubectl not found; overlays rendered by this script's own strategic merge")
    for dirpath, _ in kustomizations:
        if kubectl is None:
            try:
                rendered = render_kustomization(dirpath)
            except (OSError, KeyError, ValueError, yaml.YAMLError) as e:
                fail(f"{dirpath}: cannot render: {e}")
                continue
        else:
            out = subprocess.run([kubectl, "kustomize", dirpath], capture_output=True, text=True, timeout=120)
            if out.returncode != 0:
                fail(f"kubectl kustomize {dirpath}: {out.stderr.strip()}")
                continue
            rendered = [d for d in yaml.safe_load_all(out.stdout) if d is not None]
        check_objects(os.path.relpath(dirpath, root) + " (rendered)", rendered, flags, ports, documented)
        print(f"rendered {os.path.relpath(dirpath, root)}: {len(rendered)} objects")


# Strategic-merge keys of the lists deploy/k8s patches (Kubernetes' own:
# containers, volumes and env by name, volumeMounts by mountPath, ports by
# containerPort); any other list is replaced.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath", "ports": "containerPort"}


def strategic_merge(base, patch, field=None):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v, k) if k in base else v
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        out = [dict(x) for x in base]
        for item in patch:
            at = next((i for i, x in enumerate(out) if x.get(key) == item.get(key)), None)
            if item.get("$patch") == "delete":
                if at is not None:
                    del out[at]
            elif at is None:
                out.append(item)
            else:
                out[at] = strategic_merge(out[at], item)
        return out
    return patch


def render_kustomization(dirpath):
    """kubectl kustomize without kubectl, for what deploy/k8s uses: resources
    (files and directories) and patches (strategic merge by kind and name)."""
    k = load_docs(os.path.join(dirpath, "kustomization.yaml"))[0]
    objects = []
    for r in k.get("resources", []):
        path = os.path.join(dirpath, r)
        objects += render_kustomization(path) if os.path.isdir(path) else load_docs(path)
    for p in k.get("patches", []):
        for patch in load_docs(os.path.join(dirpath, p["path"])):
            at = next(i for i, o in enumerate(objects)
                      if o["kind"] == patch["kind"] and o["metadata"]["name"] == patch["metadata"]["name"])
            objects[at] = strategic_merge(objects[at], patch)
    return objects


def check_objects(where, objects, flags, ports, documented):
    configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    workloads = [o for o in objects if o["kind"] in ("StatefulSet", "DaemonSet", "Deployment")]
    seen = set()
    for w in workloads:
        wname = f"{where}: {w['kind']}/{w['metadata']['name']}"
        spec = w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in w["spec"].get("volumeClaimTemplates", [])}
        labels = w["spec"]["template"]["metadata"]["labels"]
        if w["spec"]["selector"]["matchLabels"].items() - labels.items():
            fail(f"{wname}: selector does not match the pod labels")
        for v in volumes.values():
            if "configMap" in v and v["configMap"]["name"] not in configmaps:
                fail(f"{wname}: volume {v['name']} references missing ConfigMap {v['configMap']['name']}")
        for c in spec["containers"]:
            daemon = daemon_of(c)
            if daemon is None:
                fail(f"{wname}: container {c['name']} runs no ckpt daemon")
                continue
            seen.add(daemon)
            cname = f"{wname}/{c['name']}"
            mounts = {}
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes and m["name"] not in claims:
                    fail(f"{cname}: volumeMount {m['name']} has no volume")
                mounts[m["mountPath"]] = m["name"]
            args = c.get("command", [])[1:] + c.get("args", [])
            for a in args:
                if a.startswith("--"):
                    flag = a.split("=", 1)[0]
                    if flag not in flags[daemon]:
                        fail(f"{cname}: argument {flag} is not a {daemon} flag")
            cfg = {}
            for i, a in enumerate(args):
                if a.split("=", 1)[0] == "--config":
                    path = a.split("=", 1)[1] if "=" in a else args[i + 1]
                    cfg = check_config_path(cname, daemon, path, mounts, volumes, configmaps, flags, ports) or {}
            check_secure_container(cname, daemon, spec, c, cfg, objects, documented)
            for e in c.get("env", []):
                if e["name"].startswith("CKPT_") and env_to_flag(e["name"]) not in flags[daemon]:
                    fail(f"{cname}: env {e['name']} is not a {daemon} key")
            cports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            if cports != ports[daemon]:
                fail(f"{cname}: container ports {cports} != daemon defaults {ports[daemon]}")
            # Meta replicas (replica_of): a follower never leads, and a rolling update waits for
            # each pod to be Ready: Ready is "runs" (/healthz) there, "serves" (/readyz) otherwise.
            ready_path = "/healthz" if daemon == "ckpt-meta" and cfg.get("replica_of") else "/readyz"
            for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", ready_path),
                                ("startupProbe", None)):
                p = c.get(probe)
                if p is None:
                    if probe != "startupProbe":
                        fail(f"{cname}: no {probe}")
                    continue
                got = p.get("httpGet", {}).get("path")
                if got not in ("/healthz", "/readyz") or (path and got != path):
                    fail(f"{cname}: {probe} path {got}, want {path or '/healthz or /readyz'}")
                port = p.get("httpGet", {}).get("port")
                if port not in ("metrics", ports[daemon]["metrics"]):
                    fail(f"{cname}: {probe} port {port} is not the metrics port")
        if "ckpt-agent" in [daemon_of(c) for c in spec["containers"]]:
            check_agent_pod(wname, spec, configmaps)
        check_ca_key_kept_out(wname, spec, objects)
    if seen != {"ckpt-meta", "ckpt-agent"}:
        fail(f"{where} runs {sorted(seen)}, want ckpt-meta and ckpt-agent")

    # Services and monitors point at named container ports that exist.
    pod_ports = {}
    for w in workloads:
        t = w["spec"]["template"]
        for c in t["spec"]["containers"]:
            for p in c.get("ports", []):
                pod_ports.setdefault(p["name"], []).append(t["metadata"]["labels"])
    for o in objects:
        if o["kind"] == "Service":
            for p in o["spec"]["ports"]:
                tp = p.get("targetPort", p["port"])
                if isinstance(tp, str) and not any(
                        o["spec"]["selector"].items() <= lab.items() for lab in pod_ports.get(tp, [])):
                    fail(f"Service/{o['metadata']['name']}: targetPort {tp} matches no pod port")
        if o["kind"] in ("ServiceMonitor", "PodMonitor"):
            eps = o["spec"].get("endpoints", []) + o["spec"].get("podMetricsEndpoints", [])
            for ep in eps:
                if ep.get("port") != "metrics" or ep.get("path", "/metrics") != "/metrics":
                    fail(f"{o['kind']}/{o['metadata']['name']}: must scrape port metrics at /metrics")


def check_config_path(cname, daemon, path, mounts, volumes, configmaps, flags, ports):
    d, f = os.path.split(path)
    vol = volumes.get(mounts.get(d))
    if vol is None or "configMap" not in vol:
        fail(f"{cname}: --config {path} is not in a mounted ConfigMap")
        return
    cm = configmaps.get(vol["configMap"]["name"])
    if cm is None or f not in cm.get("data", {}):
        fail(f"{cname}: ConfigMap {vol['configMap']['name']} has no key {f}")
        return
    return check_config_file(f"ConfigMap {cm['metadata']['name']}/{f}", daemon, cm["data"][f], flags, ports)


# ---------------------------------------------------------------------------
# Secure by default (issue 34, docs/security.md): no shipped configuration may
# start a daemon without mutual TLS, or with TLS turned off.

AGENTS = ("ckpt-agent", "ckpt-dpu-agent")
TLS_KEYS = ("tls_ca", "tls_cert", "tls_key")
TOKEN_KEYS = ("token_file", "admin_token_file", "agent_token_file", "trainer_tokens_file")
TRUE_WORDS = {"", "true", "yes", "on", "1", "y"}
NODE = "<node>"  # a path's node-name variable, after normalize()
# What would turn TLS off, in any file under deploy/ (comments included: a
# commented-out line is one edit away from running).
INSECURE_PATTERNS = [
    (re.compile(r"--insecure\b"), "--insecure"),
    (re.compile(r"\bCKPT_INSECURE\b"), "CKPT_INSECURE"),
    (re.compile(r"(?i)(^|[\s{,#-])\"?insecure\"?\s*[:=]\s*[\"']?(true|yes|on|1|y)\b"), "insecure: true"),
]


def is_loopback(address):
    # As the daemons decide it (common/grpc_security.cc IsLoopbackListen).
    a = str(address)
    if a.startswith("unix:"):
        return True
    host = a.rsplit(":", 1)[0] if ":" in a else a
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host in ("localhost", "::1") or host.startswith("127.")


def parse_args(args):
    """Config keys set by daemon flags: `--key v`, `--key=v`, or a bare
    `--flag` (true)."""
    out = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            name, eq, value = a[2:].partition("=")
            if not eq:
                if i + 1 < len(args) and not args[i + 1].startswith("--"):
                    value = args[i + 1]
                    i += 1
                else:
                    value = "true"
            out[name.replace("-", "_")] = value
        i += 1
    return out


def check_secure_settings(where, daemon, settings):
    """`settings`: the config keys of one daemon start (file < CKPT_* env <
    flags, already layered). Fails when that start would serve without mutual
    TLS: the daemon would refuse to start, or run open."""
    insecure = settings.get("insecure")
    if insecure is not None and str(insecure).strip().lower() in TRUE_WORDS:
        fail(f"{where}: {daemon} is started insecure (insecure = {insecure!r}): shipped configurations "
             "serve mutual TLS only")
    if daemon == "ckpt-meta" and str(settings.get("replica_of", "")).strip():
        plaintext = settings.get("etcd_plaintext")
        if plaintext is not None and str(plaintext).strip().lower() in TRUE_WORDS:
            fail(f"{where}: ckpt-meta replicas reach etcd in plaintext (etcd_plaintext = {plaintext!r}): whoever "
                 "writes etcd's log writes meta's state; give etcd_ca, etcd_cert and etcd_key")
        no_etcd_tls = [k for k in ("etcd_ca", "etcd_cert", "etcd_key") if not str(settings.get(k, "")).strip()]
        if no_etcd_tls:
            fail(f"{where}: ckpt-meta with replica_of starts without {', '.join(no_etcd_tls)}: it refuses to "
                 "reach etcd without TLS and a client certificate (docs/meta.md \"Replicas on etcd\")")
    missing = [k for k in TLS_KEYS if not str(settings.get(k, "")).strip()]
    if missing:
        fail(f"{where}: {daemon} starts without {', '.join(missing)}: it refuses to serve without mutual TLS "
             "(secure by default); give it the CA, its certificate and key (`ckptctl certs`, docs/security.md)")
        for key in ("listen", "data_listen"):
            address = settings.get(key)
            if address and not is_loopback(address):
                fail(f"{where}: {daemon} {key} {address} is beyond loopback without TLS")
    return not missing


def documented_secrets(root):
    """Secrets whose making deploy/k8s documents: a README or a YAML comment
    that shows `ckptctl certs ...` and `kubectl ... create secret generic|tls
    NAME`."""
    names = set()
    for dirpath, _, files in os.walk(root):
        for f in files:
            if not f.endswith((".md", ".yaml", ".yml")):
                continue
            with open(os.path.join(dirpath, f), errors="replace") as fh:
                text = fh.read()
            if f.endswith((".yaml", ".yml")):  # comments only
                text = "\n".join(l.split("#", 1)[1] for l in text.splitlines() if "#" in l)
            if "ckptctl certs create-" not in text:
                continue
            # A command line (not prose that names the command).
            names |= set(re.findall(r"(?m)^\s*kubectl\b[^\n]*\bcreate secret (?:generic|tls) ([a-z0-9][a-z0-9.-]*)",
                                    text))
    return names


def node_vars(container):
    return {e["name"] for e in container.get("env", [])
            if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName"}


def normalize(text, variables):
    # $(VAR) (Kubernetes), ${VAR} and $VAR (a shell) of the node name -> NODE.
    for v in variables:
        text = text.replace(f"$({v})", NODE).replace("${" + v + "}", NODE)
        text = re.sub(r"\$" + re.escape(v) + r"\b", NODE, text)
    return text


def mount_of(container, path):
    best = None
    for m in container.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best["mountPath"].rstrip("/")):
                best = m
    if best is None:
        return None, None
    mp = best["mountPath"].rstrip("/")
    rel = best.get("subPath", "") if path == mp else path[len(mp) + 1:]
    if path != mp and best.get("subPath"):
        rel = best["subPath"].rstrip("/") + "/" + rel
    return best, rel


def secret_mode(volume, rel):
    sec = volume["secret"]
    mode = sec.get("defaultMode", 0o644)  # Kubernetes' default
    for item in sec.get("items", []) or []:
        if item["path"] == rel:
            mode = item.get("mode", mode)
    return mode


def container_settings(cname, container, cfg):
    settings = {k: str(v) for k, v in (cfg or {}).items()}
    if container.get("envFrom"):
        fail(f"{cname}: envFrom hides its CKPT_* settings from this check; list them under env")
    for e in container.get("env", []):
        if e["name"].startswith("CKPT_"):
            value = str(e["value"]) if "value" in e else "<valueFrom>"
            settings[e["name"][len("CKPT_"):].lower()] = value
    settings.update(parse_args(container.get("command", [])[1:] + container.get("args", [])))
    return settings


def check_secure_container(cname, daemon, spec, container, cfg, objects, documented):
    settings = container_settings(cname, container, cfg)
    check_secure_settings(cname, daemon, settings)
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    variables = node_vars(container)
    for key in TLS_KEYS + TOKEN_KEYS:
        if not settings.get(key):
            continue
        path = normalize(settings[key], variables)
        where = f"{cname}: {key} {path}"
        m, rel = mount_of(container, path)
        if m is None:
            fail(f"{where} is in no mounted volume")
            continue
        vol = volumes.get(m["name"])
        if vol is None:
            continue  # reported as a mount without a volume
        secret_file = key == "tls_key" or key in TOKEN_KEYS
        if "secret" in vol:
            name = vol["secret"]["secretName"]
            plain = rel.replace("..data/", "")
            items = vol["secret"].get("items")
            if items and plain not in [i["path"] for i in items]:
                fail(f"{where}: Secret volume {m['name']} projects no {plain}")
            mode = secret_mode(vol, plain)
            if secret_file and mode & 0o037:
                fail(f"{where}: Secret {name} is mounted with mode {oct(mode)}: a key or token must not be "
                     "readable by others (defaultMode 0400, or 0440 with fsGroup)")
            if key in TOKEN_KEYS and not (m.get("subPath") or "/..data/" in path):
                fail(f"{where}: token files are opened with O_NOFOLLOW and a Secret volume's entries are "
                     "symlinks: mount the key with subPath, or name DIR/..data/NAME")
            if not m.get("readOnly"):
                fail(f"{where}: volumeMount {m['name']} is not readOnly")
            check_secret_source(where, name, plain, daemon, objects, documented)
            if daemon in AGENTS and key in ("tls_cert", "tls_key") and NODE not in plain:
                fail(f"{where}: every agent would present the same certificate, but each needs its node's own "
                     "(ckpt://node/<node name>): name the file after $(CKPT_NODE_ID)")
        elif "csi" in vol:
            attrs = vol["csi"].get("volumeAttributes", {})
            if vol["csi"].get("driver") != "csi.cert-manager.io":
                fail(f"{where}: CSI volume {m['name']} is not cert-manager's csi.cert-manager.io")
            elif daemon in AGENTS:
                fail(f"{where}: csi-driver cannot put the node name in a certificate (it expands only POD_NAME, "
                     "POD_NAMESPACE, POD_UID, SERVICE_ACCOUNT_NAME); an agent needs ckpt://node/<node name>")
            elif "ckpt://meta" not in attrs.get("csi.cert-manager.io/uri-sans", ""):
                fail(f"{where}: CSI volume {m['name']} does not ask for URI ckpt://meta")
        elif "emptyDir" in vol:
            check_init_fills(where, spec, m, rel, daemon)
        else:
            fail(f"{where}: volume {m['name']} is not a Secret, a csi.cert-manager.io volume or an emptyDir an "
                 "init container fills with `ckptctl certs`")


def check_secret_source(where, name, rel, daemon, objects, documented):
    certs = [o for o in objects if o.get("kind") == "Certificate"
             and o.get("spec", {}).get("secretName") == name]
    if not certs:
        if name not in documented:
            fail(f"{where}: nothing makes Secret {name}: no cert-manager Certificate writes it, and no README "
                 f"or comment under deploy/k8s shows the `ckptctl certs` and `kubectl create secret ... {name}` "
                 "commands")
        return
    cert = certs[0]["spec"]
    cname = f"Certificate/{certs[0]['metadata']['name']}"
    if daemon in AGENTS:
        fail(f"{where}: {cname} is one certificate for every agent; each needs ckpt://node/<its node name>")
    elif "ckpt://meta" not in cert.get("uris", []):
        fail(f"{where}: {cname} has no URI ckpt://meta (what every caller checks)")
    for usage in ("server auth", "client auth"):
        if usage not in cert.get("usages", []):
            fail(f"{where}: {cname} usages lack '{usage}'")
    if rel not in ("ca.crt", "tls.crt", "tls.key"):
        fail(f"{where}: {cname} writes ca.crt, tls.crt and tls.key, not {rel}")


def check_init_fills(where, spec, mount, rel, daemon):
    """An emptyDir TLS file must be written by an init container that mounts
    the same volume and runs `ckptctl certs create-node` (agents: with
    --node-id the node name) or `create-meta`."""
    want = "create-node" if daemon in AGENTS else "create-meta"
    for ic in spec.get("initContainers", []):
        im = next((x for x in ic.get("volumeMounts", []) if x["name"] == mount["name"]), None)
        text = normalize(" ".join(ic.get("command", []) + ic.get("args", [])), node_vars(ic))
        if im is None or f"ckptctl certs {want}" not in text:
            continue
        text = text.replace('"', " ").replace("'", " ")
        base = im["mountPath"].rstrip("/") + "/"
        made = set()
        out = re.search(r"--out[=\s]+(\S+)", text)
        if out and out.group(1).startswith(base):
            made |= {out.group(1)[len(base):] + ".pem", out.group(1)[len(base):] + ".key"}
        made |= {t[len(base):].rstrip(";") for t in text.split() if t.startswith(base)}
        if daemon in AGENTS and not re.search(r"--node-id[=\s]+" + re.escape(NODE) + r"(\s|$)", text):
            fail(f"{where}: init container {ic['name']} does not take --node-id from spec.nodeName")
        if rel not in made:
            fail(f"{where}: init container {ic['name']} does not write {rel} (it writes {sorted(made)})")
        return
    fail(f"{where}: emptyDir {mount['name']} is filled by no init container running `ckptctl certs {want}`")


def check_ca_key_kept_out(wname, spec, objects):
    """No daemon's container mounts the CA key: the Secret an Issuer signs
    with, one an init container reads as --ca-dir, or any file named ca.key."""
    issuer_secrets = {o["spec"]["ca"]["secretName"] for o in objects
                      if o.get("kind") in ("Issuer", "ClusterIssuer") and "ca" in o.get("spec", {})}
    ca_volumes = set()
    for v in spec.get("volumes", []):
        sec = v.get("secret")
        if sec and (sec.get("secretName") in issuer_secrets or
                    any(i["path"].endswith("ca.key") for i in sec.get("items", []) or [])):
            ca_volumes.add(v["name"])
    for ic in spec.get("initContainers", []):
        text = " ".join(ic.get("command", []) + ic.get("args", [])).replace('"', " ")
        for d in re.findall(r"--ca-dir[=\s]+(\S+)", text):
            d = d.rstrip("/")
            for m in ic.get("volumeMounts", []):
                mp = m["mountPath"].rstrip("/")
                if mp == d or mp.startswith(d + "/"):
                    ca_volumes.add(m["name"])
    for c in spec["containers"]:
        for m in c.get("volumeMounts", []):
            if m["name"] in ca_volumes or m.get("subPath", "").endswith("ca.key"):
                fail(f"{wname}/{c['name']}: mounts volume {m['name']}, which holds the CA key: a daemon must "
                     "never hold it (it signs every identity; keep it to an init container)")


def check_no_insecure_text(src):
    root = os.path.join(src, "deploy")
    for dirpath, _, files in os.walk(root):
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            with open(path, errors="replace") as f:
                for n, line in enumerate(f, 1):
                    for pattern, what in INSECURE_PATTERNS:
                        if pattern.search(line):
                            fail(f"{path}:{n}: {what}: no shipped configuration may turn TLS off "
                                 f"({line.strip()[:80]})")


def parse_bytes(q):
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGTPE]?)(i?)B?\s*", str(q))
    if not m:
        return None
    mult = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}[m.group(2)]
    return float(m.group(1)) * ((1024 if m.group(3) else 1000) ** mult)


def check_agent_pod(wname, spec, configmaps):
    # The memory tier is a directory inside an emptyDir on tmpfs, at least memory big. Not the
    # emptyDir's mount point itself: kubelet makes that mode 0777, and the agent refuses a
    # memory directory other users may write (it makes its own, 0700; docs/agent.md).
    c = next(c for c in spec["containers"] if daemon_of(c) == "ckpt-agent")
    cfg = {}
    for cm in configmaps.values():
        if "agent.yaml" in cm.get("data", {}):
            cfg = yaml.safe_load(cm["data"]["agent.yaml"])
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mem_dir = str(cfg.get("memory_dir", ""))
    mem_mount = next((p for p in mounts if mem_dir.startswith(p.rstrip("/") + "/")), None)
    mem_vol = volumes.get(mounts[mem_mount]) if mem_mount else None
    if mem_dir in mounts:
        fail(f"{wname}: memory_dir {mem_dir} is a volume's mount point (an emptyDir is mode 0777, which "
             f"the agent refuses): name a directory inside it, e.g. {mem_dir.rstrip('/')}/tier")
    elif mem_vol is None or mem_vol.get("emptyDir", {}).get("medium") != "Memory":
        fail(f"{wname}: memory_dir {mem_dir} is not inside an emptyDir with medium Memory")
    else:
        size = parse_bytes(mem_vol["emptyDir"].get("sizeLimit", ""))
        want = parse_bytes(cfg.get("memory", "4GiB"))
        limit = parse_bytes(c.get("resources", {}).get("limits", {}).get("memory", ""))
        if size is None or size < want:
            fail(f"{wname}: memory-tier emptyDir sizeLimit is smaller than memory {cfg.get('memory')}")
        if limit is None or limit < want:
            fail(f"{wname}: container memory limit is smaller than the memory tier")
    run = volumes.get(mounts.get(cfg.get("run_dir", "/run/ckpt")))
    if run is None or run.get("hostPath", {}).get("path") != "/run/ckpt":
        fail(f"{wname}: run_dir is not the host's /run/ckpt (trainer pods mount it)")
    if cfg.get("durable_root") and cfg["durable_root"] not in mounts:
        fail(f"{wname}: durable_root {cfg['durable_root']} is not a mount")
    envs = {e["name"]: e for e in c.get("env", [])}
    node = envs.get("CKPT_NODE_ID", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    if node != "spec.nodeName":
        fail(f"{wname}: CKPT_NODE_ID does not come from spec.nodeName")


# The trainer examples of deploy/k8s/examples: file, (apiVersion, kind) of
# its one object, and whether it is a launcher example (job, meta and agent
# from CKPT_* variables, examples/train_torchrun.py under torchrun).
TRAINER_EXAMPLES = (
    ("trainer.yaml", ("v1", "Pod"), False),
    ("job.yaml", ("batch/v1", "Job"), True),
    ("pytorchjob.yaml", ("kubeflow.org/v1", "PyTorchJob"), True),
)


def pod_specs(obj):
    """(where, pod spec) of every pod a Pod, Job or PyTorchJob makes."""
    kind = obj.get("kind")
    if kind == "Pod":
        return [("Pod", obj.get("spec"))]
    if kind == "Job":
        return [("Job template", obj.get("spec", {}).get("template", {}).get("spec"))]
    if kind == "PyTorchJob":
        replicas = obj.get("spec", {}).get("pytorchReplicaSpecs") or {}
        return [(f"{role} template", r.get("template", {}).get("spec")) for role, r in replicas.items()]
    return []


def check_trainer_example(src):
    for name, (api, kind), launcher in TRAINER_EXAMPLES:
        path = os.path.join(src, "deploy", "k8s", "examples", name)
        if not os.path.exists(path):
            fail(f"{path}: missing (a trainer example)")
            continue
        try:
            objs = load_docs(path)
        except yaml.YAMLError:
            continue  # check_k8s said so
        if [(d.get("apiVersion"), d.get("kind")) for d in objs] != [(api, kind)]:
            fail(f"{path}: want one {kind} ({api}), found {[(d.get('apiVersion'), d.get('kind')) for d in objs]}")
            continue
        specs = pod_specs(objs[0])
        if not specs or any(not isinstance(spec, dict) or not spec.get("containers") for _, spec in specs):
            fail(f"{path}: a pod template without containers")
            continue
        for where, spec in specs:
            check_trainer_pod(src, f"{path} ({where})" if kind != "Pod" else path, spec)
            if launcher:
                check_launcher_pod(src, f"{path} ({where})", objs[0], spec)
    check_examples_listed(src)


def check_launcher_pod(src, path, obj, spec):
    # Job, meta and agent from the environment (docs/python.md "Using ckpt
    # from torchrun / Slurm / Kubernetes"): the script under torchrun, CKPT_JOB
    # stable across pod restarts (a value, or a label of the pod), CKPT_META
    # at meta's Service.
    if obj["kind"] == "PyTorchJob":
        ep = obj["spec"].get("elasticPolicy") or {}
        if ep.get("rdzvBackend") != "c10d" or not ep.get("maxRestarts"):
            fail(f"{path}: elasticPolicy wants rdzvBackend c10d and maxRestarts (torchrun restarts the group)")
        if [c["name"] for c in spec["containers"]][:1] != ["pytorch"]:
            fail(f"{path}: the training operator wants the container named pytorch")
    for c in spec["containers"]:
        where = f"{path}: container {c['name']}"
        cmd = c.get("command", []) + c.get("args", [])
        if not cmd or cmd[0] != "torchrun" or not any(a.startswith("--max_restarts=") for a in cmd):
            fail(f"{where}: want torchrun with --max_restarts=N, found {cmd}")
        scripts = [a for a in cmd if a.endswith(".py")]
        if scripts != ["/usr/local/share/ckpt/examples/train_torchrun.py"] or not os.path.exists(
                os.path.join(src, "examples", "train_torchrun.py")):
            fail(f"{where}: want /usr/local/share/ckpt/examples/train_torchrun.py (examples/), found {scripts}")
        envs = {e["name"]: e for e in c.get("env", [])}
        job = envs.get("CKPT_JOB", {})
        path_ref = job.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        m = re.fullmatch(r"metadata\.labels\['([a-z0-9./-]+)'\]", path_ref)
        if not (job.get("value") or m):
            fail(f"{where}: CKPT_JOB is neither a value nor a label of the pod (downward API): {job}")
        elif m and m.group(1) not in ("job-name", "training.kubeflow.org/job-name"):
            fail(f"{where}: CKPT_JOB from label {m.group(1)}, which its controller does not set")
        meta = str(envs.get("CKPT_META", {}).get("value", ""))
        if not re.fullmatch(r"ckpt-meta\.ckpt\.svc(\.cluster\.local)?:7400", meta):
            fail(f"{where}: CKPT_META {meta!r} is not meta's Service ckpt-meta.ckpt.svc:7400")
        sock = envs.get("CKPT_AGENT_SOCKET", {}).get("value")
        if sock is not None and sock != "/run/ckpt/agent.sock":
            fail(f"{where}: CKPT_AGENT_SOCKET {sock}, not /run/ckpt/agent.sock")
        for e in envs.values():
            if e["name"].startswith("CKPT_") and e["name"] not in CLIENT_VARIABLES:
                fail(f"{where}: {e['name']} is not a variable the client reads")


# What the client libraries read (python/ckpt/environment.py, ckpt/options.h).
CLIENT_VARIABLES = ("CKPT_JOB", "CKPT_META", "CKPT_AGENT_SOCKET", "CKPT_TLS_CA", "CKPT_TLS_CERT", "CKPT_TLS_KEY",
                    "CKPT_TLS_CRL_DIR", "CKPT_TOKEN_FILE", "CKPT_TOKEN")


def check_examples_listed(src):
    # Every manifest of deploy/k8s/examples is one this script checks.
    d = os.path.join(src, "deploy", "k8s", "examples")
    known = {n for n, _, _ in TRAINER_EXAMPLES}
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if name.endswith((".yaml", ".yml")) and name not in known:
            fail(f"{d}/{name}: not checked (add it to TRAINER_EXAMPLES in tests/deploy/check_manifests.py)")


def check_trainer_pod(src, path, spec):
    # A trainer pod needs the host's /run/ckpt and nothing else of the agent:
    # the pool comes over session.sock as a descriptor (docs/operations.md).
    for host_ns in ("hostPID", "hostIPC", "hostNetwork"):
        if spec.get(host_ns):
            fail(f"{path}: the trainer must not need {host_ns}")
    if 65532 not in spec.get("securityContext", {}).get("supplementalGroups", []):
        fail(f"{path}: supplementalGroups lacks the agent's group 65532 (the sockets are 0660)")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    host_paths = [v["hostPath"]["path"] for v in volumes.values() if "hostPath" in v]
    if host_paths != ["/run/ckpt"]:
        fail(f"{path}: host paths {host_paths}, want only /run/ckpt")
    for v in volumes.values():
        if v.get("emptyDir", {}).get("medium") == "Memory" or "persistentVolumeClaim" in v:
            fail(f"{path}: volume {v['name']} looks like the agent's memory or durable tier")
    for c in spec["containers"]:
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        run = volumes.get(mounts.get("/run/ckpt"), {})
        if run.get("hostPath", {}).get("path") != "/run/ckpt":
            fail(f"{path}: container {c['name']} does not mount the host's /run/ckpt at /run/ckpt")
        for m in mounts:
            if m.startswith("/dev/shm") or m.startswith("/ckpt"):
                fail(f"{path}: container {c['name']} mounts {m}, which the agent's pod owns")
        socket_args = [a for a in c.get("args", []) if a.startswith("--agent-socket")]
        if socket_args and not socket_args[0].endswith("/run/ckpt/agent.sock"):
            fail(f"{path}: container {c['name']} points at {socket_args[0]}, not /run/ckpt/agent.sock")
    # Meta serves mutual TLS only: the trainer shows a certificate for its
    # jobs, from a Secret it alone can read (the client reads CKPT_TLS_*).
    documented = documented_secrets(os.path.join(src, "deploy", "k8s"))
    sc = spec.get("securityContext", {})
    for c in spec["containers"]:
        envs = {e["name"]: e.get("value") for e in c.get("env", [])}
        for var in ("CKPT_TLS_CA", "CKPT_TLS_CERT", "CKPT_TLS_KEY"):
            where = f"{path}: container {c['name']}"
            if not envs.get(var):
                fail(f"{where} sets no {var}: meta serves only callers with a certificate (a trainer's, for its jobs)")
                continue
            m, rel = mount_of(c, envs[var])
            vol = volumes.get(m["name"]) if m else None
            if vol is None or "secret" not in vol:
                fail(f"{where}: {var} {envs[var]} is not in a mounted Secret")
                continue
            if not m.get("readOnly"):
                fail(f"{where}: volumeMount {m['name']} is not readOnly")
            if vol["secret"]["secretName"] not in documented:
                fail(f"{where}: nothing shows how to make Secret {vol['secret']['secretName']} (`ckptctl certs "
                     "create-client` and `kubectl create secret`)")
            if var == "CKPT_TLS_KEY":
                mode = secret_mode(vol, rel)
                if mode & 0o037:
                    fail(f"{where}: its key is mounted with mode {oct(mode)}, readable by others (0400 or 0440)")
                if not (sc.get("runAsUser") == 0 or (mode & 0o040 and sc.get("fsGroup") is not None)):
                    fail(f"{where}: uid {sc.get('runAsUser')} cannot read its key (Secret files are root's: "
                         "mode 0440 with an fsGroup)")


def check_systemd_env(src, flags):
    for daemon in [d for d in ("ckpt-meta", "ckpt-agent", "ckpt-dpu-agent", "ckpt-dpu-proxy") if d in flags]:
        path = os.path.join(src, "deploy", "systemd", daemon + ".env")
        unit = os.path.join(src, "deploy", "systemd", daemon + ".service")
        for p in (path, unit):
            if not os.path.exists(p):
                fail(f"{p} is missing")
                return
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip().lstrip("#").strip()
                m = re.match(r"(CKPT_[A-Z0-9_]+)=", line)
                if m and env_to_flag(m.group(1)) not in flags[daemon]:
                    fail(f"{path}:{n}: {m.group(1)} is not a {daemon} key")
        with open(unit) as f:
            text = f.read()
        check_secure_systemd(path, unit, daemon, text)
        for want in ("Type=notify", "Restart=on-failure", "NoNewPrivileges=yes",
                     "ProtectSystem=strict", "PrivateTmp=yes", "ReadWritePaths=",
                     f"ExecStart=/usr/local/bin/{daemon}", f"EnvironmentFile=-/etc/ckpt/{daemon}.env"):
            if want not in text:
                fail(f"{unit}: no {want}")
        if daemon in ("ckpt-agent", "ckpt-dpu-agent"):
            for want in ("LimitMEMLOCK=infinity", "RuntimeDirectory=ckpt", "RemoveIPC=no"):
                if want not in text:
                    fail(f"{unit}: no {want}")


def check_secure_systemd(env_path, unit, daemon, unit_text):
    settings = {}
    with open(env_path) as f:
        for line in f:
            m = re.match(r"\s*(CKPT_[A-Z0-9_]+)=(.*)$", line)  # set, not commented out
            if m:
                settings[m.group(1)[len("CKPT_"):].lower()] = m.group(2).strip().strip('"')
    for line in re.findall(r"^ExecStart=(.*)$", unit_text, re.M):
        settings.update(parse_args(shlex.split(line)[1:]))
    if check_secure_settings(f"{env_path} with {os.path.basename(unit)}", daemon, settings):
        for key in TLS_KEYS + TOKEN_KEYS:
            value = settings.get(key)
            if value and not value.startswith("/etc/ckpt/"):
                fail(f"{env_path}: {key} {value} is not under /etc/ckpt/ (root's, and read-only to the daemon "
                     "under ProtectSystem=strict)")
    for rw in " ".join(re.findall(r"^ReadWritePaths=(.*)$", unit_text, re.M)).split():
        rw = rw.lstrip("-+").rstrip("/")
        if rw in ("", "/etc") or rw.startswith("/etc/ckpt"):
            fail(f"{unit}: ReadWritePaths={rw}: the daemon could rewrite its own certificates")


def packages(src):
    with open(os.path.join(src, "scripts", "packages.txt")) as f:
        return [l.split("#")[0].strip() for l in f if l.split("#")[0].strip()]


def check_dockerfile(src, ports):
    path = os.path.join(src, "deploy", "docker", "Dockerfile")
    with open(path) as f:
        lines = [l for l in f.read().splitlines() if not l.lstrip().startswith("#")]
    text = "\n".join(lines)
    if not re.search(r"^COPY\s+scripts/packages\.txt\s", text, re.M):
        fail(f"{path}: does not COPY scripts/packages.txt")
    if not re.search(r"packages\.txt[^\n]*(\n[^\n]*)?\bxargs apt-get install", text):
        fail(f"{path}: does not install from packages.txt with xargs apt-get install")
    if not re.search(r"^FROM\s+\S*debian:12", text, re.M) and "debian:12" not in text:
        fail(f"{path}: not based on Debian 12")
    if len(re.findall(r"^FROM\s", text, re.M)) < 2:
        fail(f"{path}: not a multi-stage build")
    # No package list by hand: at most these few runtime extras appear literally.
    allowed = {"ibverbs-providers", "ca-certificates"}
    words = set(re.findall(r"[a-z0-9][a-z0-9.+-]+", text))
    literal = sorted((set(packages(src)) & words) - allowed - {"cmake", "git"})
    if literal:
        fail(f"{path}: names packages by hand ({', '.join(literal)}); install scripts/packages.txt")
    exposed = {int(p) for p in re.findall(r"^EXPOSE\s+(.*)$", text, re.M)[0].split()} if "EXPOSE" in text else set()
    want = {p for d in ports.values() for p in d.values() if p}
    if exposed != want:
        fail(f"{path}: EXPOSE {sorted(exposed)} != {sorted(want)}")
    for p in ("python3-yaml", "libsystemd-dev"):
        if p not in packages(src):
            fail(f"scripts/packages.txt lacks {p}")
    # The image's default command: a daemon it starts must serve mutual TLS.
    env = {}
    for body in re.findall(r"^ENV\s+(.*)$", text, re.M):
        pairs = re.findall(r"(\w+)=(\"[^\"]*\"|\S+)", body) or [tuple((body.split(None, 1) + [""])[:2])]
        for k, v in pairs:
            env[k] = v.strip('"')
    cmd = []
    for instr in ("ENTRYPOINT", "CMD"):
        found = re.findall(r"^" + instr + r"\s+(.*)$", text, re.M)
        if found:
            try:
                words = json.loads(found[-1])
            except ValueError:
                words = shlex.split(found[-1])
            cmd += words
    daemon = next((d for d in ("ckpt-meta", "ckpt-agent", "ckpt-dpu-agent")
                   if cmd and os.path.basename(cmd[0]) == d), None)
    if daemon and not {"--help", "-h", "--version"} & set(cmd):
        settings = {k[len("CKPT_"):].lower(): v for k, v in env.items() if k.startswith("CKPT_")}
        settings.update(parse_args(cmd[1:]))
        check_secure_settings(f"{path}: ENTRYPOINT/CMD {cmd}", daemon, settings)


def source_metrics(src):
    names = set()
    for dirpath, _, files in os.walk(os.path.join(src, "src")):
        for name in files:
            if name.endswith((".cc", ".h")):
                with open(os.path.join(dirpath, name), errors="replace") as f:
                    names |= set(re.findall(r'"(ckpt_(?:agent|meta)_[a-z0-9_]+)"', f.read()))
    return names


def base_metric(name, known):
    if name in known:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in known:
            return name[: -len(suffix)]
    return None


def check_metrics(src):
    known = source_metrics(src)
    if len(known) < 10:
        fail(f"found only {len(known)} metric names in src/: the grep is broken")
        return
    path = os.path.join(src, "deploy", "grafana", "ckpt-dashboard.json")
    try:
        with open(path) as f:
            dash = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{path}: {e}")
        return
    exprs = []

    def walk(o):
        if isinstance(o, dict):
            for k, v in o.items():
                if k == "expr" and isinstance(v, str):
                    exprs.append(v)
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(dash)
    if not exprs:
        fail(f"{path}: no panel queries")
    used = set()
    for e in exprs:
        for m in re.findall(r"ckpt_(?:agent|meta)_[a-z0-9_]+", e):
            b = base_metric(m, known)
            if b is None:
                fail(f"{path}: metric {m} does not exist in src/")
            used.add(b)
    doc = os.path.join(src, "docs", "operations.md")
    with open(doc) as f:
        text = f.read()
    for m in set(re.findall(r"ckpt_(?:agent|meta)_[a-z0-9_]+", text)):
        if base_metric(m, known) is None:
            fail(f"{doc}: metric {m} does not exist in src/")
    for m in sorted(known):
        if m not in text:
            fail(f"{doc}: metric {m} is not documented")


if __name__ == "__main__":
    sys.exit(main())
