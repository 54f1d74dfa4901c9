#!/usr/bin/python3
"""Static checks of deploy/: Kubernetes manifests, systemd EnvironmentFiles,
the Dockerfile, the Grafana dashboard and docs/operations.md, against the
daemons' real flags (their --help) and the metric names in src/. Where
kubectl exists, every kustomization is also rendered (`kubectl kustomize`,
offline) and the rendered objects are checked the same way.

usage: check_manifests.py SOURCE_DIR CKPT_META CKPT_AGENT
Exit 0 when every check passes; prints every failure and exits 1 otherwise.
"""
import json
import os
import re
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
    if len(sys.argv) not in (4, 5):
        print(__doc__)
        return 2
    src, meta_bin, agent_bin = sys.argv[1:4]
    daemons = {"ckpt-meta": help_of(meta_bin), "ckpt-agent": help_of(agent_bin)}
    dpu_help = help_of(sys.argv[4]) if len(sys.argv) == 5 else None
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
    # DESIGN.md §9 defaults.
    expected = {"ckpt-meta": {"grpc": 7400, "metrics": 9400},
                "ckpt-agent": {"grpc": 7401, "data": 7402, "metrics": 9401}}
    if ports != expected:
        fail(f"daemon default ports {ports} differ from DESIGN.md {expected}")

    check_k8s(src, flags, ports)
    if dpu_help is not None:  # ckpt-dpu-agent: the agent's flags and --host-node
        flags["ckpt-dpu-agent"] = flags_of(dpu_help)
        if "--host-node" not in flags["ckpt-dpu-agent"]:
            fail("ckpt-dpu-agent --help does not list --host-node")
    check_systemd_env(src, flags)
    check_dockerfile(src, ports)
    check_metrics(src)
    check_trainer_example(src)
    if failures:
        print(f"{len(failures)} failure(s)")
        return 1
    print("deploy manifests OK")
    return 0


def daemon_of(container):
    cmd = " ".join(container.get("command", []) + container.get("args", []))
    for d in ("ckpt-meta", "ckpt-agent"):
        if d in cmd:
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

    base = os.path.join(root, "base")
    k = load_docs(os.path.join(base, "kustomization.yaml"))[0]
    objects = []
    for r in k["resources"]:
        objects += load_docs(os.path.join(base, r))
    check_objects("base", objects, flags, ports)

    # Rendered kustomizations (patches applied), where kubectl can render offline.
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        print("note: kubectl not found; rendered overlays not checked")
        return
    for dirpath, _ in kustomizations:
        out = subprocess.run([kubectl, "kustomize", dirpath], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            fail(f"kubectl kustomize {dirpath}: {out.stderr.strip()}")
            continue
        rendered = [d for d in yaml.safe_load_all(out.stdout) if d is not None]
        check_objects(os.path.relpath(dirpath, root) + " (rendered)", rendered, flags, ports)
        print(f"rendered {os.path.relpath(dirpath, root)}: {len(rendered)} objects")


def check_objects(where, objects, flags, ports):
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
            for i, a in enumerate(args):
                if a.split("=", 1)[0] == "--config":
                    path = a.split("=", 1)[1] if "=" in a else args[i + 1]
                    check_config_path(cname, daemon, path, mounts, volumes, configmaps, flags, ports)
            for e in c.get("env", []):
                if e["name"].startswith("CKPT_") and env_to_flag(e["name"]) not in flags[daemon]:
                    fail(f"{cname}: env {e['name']} is not a {daemon} key")
            cports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            if cports != ports[daemon]:
                fail(f"{cname}: container ports {cports} != daemon defaults {ports[daemon]}")
            for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"),
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
    check_config_file(f"ConfigMap {cm['metadata']['name']}/{f}", daemon, cm["data"][f], flags, ports)


def parse_bytes(q):
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGTPE]?)(i?)B?\s*", str(q))
    if not m:
        return None
    mult = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}[m.group(2)]
    return float(m.group(1)) * ((1024 if m.group(3) else 1000) ** mult)


def check_agent_pod(wname, spec, configmaps):
    # The memory tier is an emptyDir on tmpfs at memory_dir, at least memory big.
    c = next(c for c in spec["containers"] if daemon_of(c) == "ckpt-agent")
    cfg = {}
    for cm in configmaps.values():
        if "agent.yaml" in cm.get("data", {}):
            cfg = yaml.safe_load(cm["data"]["agent.yaml"])
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mem_vol = volumes.get(mounts.get(cfg.get("memory_dir")))
    if mem_vol is None or mem_vol.get("emptyDir", {}).get("medium") != "Memory":
        fail(f"{wname}: memory_dir {cfg.get('memory_dir')} is not an emptyDir with medium Memory")
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


def check_trainer_example(src):
    # A trainer pod needs the host's /run/ckpt and nothing else of the agent:
    # the pool comes over session.sock as a descriptor (docs/operations.md).
    path = os.path.join(src, "deploy", "k8s", "examples", "trainer.yaml")
    if not os.path.exists(path):
        fail(f"{path}: missing (the trainer pod example)")
        return
    pods = [d for d in load_docs(path) if d.get("kind") == "Pod"]
    if len(pods) != 1:
        fail(f"{path}: want one Pod")
        return
    spec = pods[0]["spec"]
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


def check_systemd_env(src, flags):
    for daemon in [d for d in ("ckpt-meta", "ckpt-agent", "ckpt-dpu-agent") if d in flags]:
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
        for want in ("Type=notify", "Restart=on-failure", "NoNewPrivileges=yes",
                     "ProtectSystem=strict", "PrivateTmp=yes", "ReadWritePaths=",
                     f"ExecStart=/usr/local/bin/{daemon}", f"EnvironmentFile=-/etc/ckpt/{daemon}.env"):
            if want not in text:
                fail(f"{unit}: no {want}")
        if daemon in ("ckpt-agent", "ckpt-dpu-agent"):
            for want in ("LimitMEMLOCK=infinity", "RuntimeDirectory=ckpt", "RemoveIPC=no"):
                if want not in text:
                    fail(f"{unit}: no {want}")


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
