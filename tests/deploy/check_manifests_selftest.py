#!/usr/bin/python3
"""Proves that check_manifests.py fails on insecure deploy files, not only
that it passes on the shipped ones: copies what it reads (deploy/, docs/,
examples/, scripts/packages.txt, src/) to a temporary tree, checks that the copy passes,
then applies one insecure change at a time and checks that the run fails
with the expected message. Each change is one an operator could make by
hand (turn TLS off, drop a key, share one agent certificate, hand the CA key
to a daemon, ...). Overlays are rendered by kubectl where it exists, else by
check_manifests.py's own strategic merge: every change is tried either way.

usage: check_manifests_selftest.py SOURCE_DIR CKPT_META CKPT_AGENT [CKPT_DPU_AGENT]
Exit 0 when the shipped files pass and every change is caught; 1 otherwise.
"""
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# (name, file under the tree, old text, new text, expected in the output).
# `old` must occur exactly once.
MUTATIONS = [
    ("meta replicas without etcd's client key", "deploy/k8s/overlays/meta-replicas/config-replicas.yaml",
     "    etcd_key: /etc/ckpt-etcd-tls/tls.key\n", "",
     "starts without etcd_key"),
    ("meta replicas on plaintext etcd", "deploy/k8s/overlays/meta-replicas/config-replicas.yaml",
     "    replica_lease_ms: 5000\n", "    replica_lease_ms: 5000\n    etcd_plaintext: true\n",
     "reach etcd in plaintext"),
    ("meta config insecure: true", "deploy/k8s/base/configmap.yaml",
     "    log_level: info\n    log_json: true\n  agent.yaml: |",
     "    log_level: info\n    log_json: true\n    insecure: true\n  agent.yaml: |",
     "is started insecure"),
    ("agent env CKPT_INSECURE", "deploy/k8s/base/agent.yaml",
     "            - name: CKPT_TLS_RELOAD_SECONDS\n",
     "            - name: CKPT_INSECURE\n              value: \"true\"\n            - name: CKPT_TLS_RELOAD_SECONDS\n",
     "CKPT_INSECURE"),
    ("meta --insecure flag", "deploy/k8s/base/meta.yaml",
     'args: ["--config", "/etc/ckpt/meta.yaml"]',
     'args: ["--config", "/etc/ckpt/meta.yaml", "--insecure"]',
     "is started insecure"),
    ("meta without tls_key", "deploy/k8s/base/configmap.yaml",
     "    tls_key: /etc/ckpt-tls/tls.key\n", "",
     "ckpt-meta starts without tls_key"),
    ("one certificate for every agent", "deploy/k8s/base/agent.yaml",
     "value: /etc/ckpt-tls/$(CKPT_NODE_ID).pem", "value: /etc/ckpt-tls/node.pem",
     "every agent would present the same certificate"),
    ("meta key readable by others", "deploy/k8s/base/meta.yaml",
     "            secretName: ckpt-meta-tls\n            defaultMode: 0440",
     "            secretName: ckpt-meta-tls\n            defaultMode: 0444",
     "readable by others"),
    ("agent TLS file in no volume", "deploy/k8s/base/agent.yaml",
     "value: /etc/ckpt-tls/ca.pem", "value: /srv/ca.pem",
     "tls_ca /srv/ca.pem is in no mounted volume"),
    ("token file through a Secret symlink", "deploy/k8s/base/configmap.yaml",
     "    lease_ttl_ms: 60000\n", "    lease_ttl_ms: 60000\n    token_file: /etc/ckpt-tls/agent.token\n",
     "O_NOFOLLOW"),
    ("undocumented node Secret", "deploy/k8s/README.md",
     'kubectl -n ckpt create secret generic ckpt-node-tls "${args[@]}"', "",
     "nothing makes Secret ckpt-node-tls"),
    ("systemd agent without its key", "deploy/systemd/ckpt-agent.env",
     "CKPT_TLS_KEY=/etc/ckpt/tls/node.key\n", "#CKPT_TLS_KEY=/etc/ckpt/tls/node.key\n",
     "ckpt-agent starts without tls_key"),
    ("systemd meta certificate in /tmp", "deploy/systemd/ckpt-meta.env",
     "CKPT_TLS_CERT=/etc/ckpt/tls/meta.pem", "CKPT_TLS_CERT=/tmp/meta.pem",
     "tls_cert /tmp/meta.pem is not under /etc/ckpt/"),
    ("systemd dpu ExecStart --insecure", "deploy/systemd/ckpt-dpu-agent.service",
     "ExecStart=/usr/local/bin/ckpt-dpu-agent\n", "ExecStart=/usr/local/bin/ckpt-dpu-agent --insecure\n",
     "--insecure"),
    ("systemd meta may rewrite its certificates", "deploy/systemd/ckpt-meta.service",
     "ReadWritePaths=/var/lib/ckpt-meta", "ReadWritePaths=/var/lib/ckpt-meta /etc/ckpt",
     "could rewrite its own certificates"),
    ("image starts meta without TLS", "deploy/docker/Dockerfile",
     'CMD ["/usr/local/bin/ckpt-meta", "--help"]', 'CMD ["/usr/local/bin/ckpt-meta", "--listen", "0.0.0.0:7400"]',
     "listen 0.0.0.0:7400 is beyond loopback without TLS"),
    ("trainer without its key", "deploy/k8s/examples/trainer.yaml",
     "        - name: CKPT_TLS_KEY\n          value: /etc/ckpt-tls/tls.key\n", "",
     "sets no CKPT_TLS_KEY"),
    ("trainer cannot read its key", "deploy/k8s/examples/trainer.yaml",
     "    fsGroup: 1000\n", "",
     "cannot read its key"),
    ("the CA key in the agent's container", "deploy/k8s/overlays/cert-manager/agent-node-cert.yaml",
     "      initContainers:\n",
     "      containers:\n        - name: ckpt-agent\n          volumeMounts:\n"
     "            - name: ckpt-ca\n              mountPath: /ca\n      initContainers:\n",
     "which holds the CA key"),
    ("meta's Certificate without ckpt://meta", "deploy/k8s/overlays/cert-manager/meta-certificate.yaml",
     "    - ckpt://meta\n", "    - ckpt://node/meta\n",
     "has no URI ckpt://meta"),
    ("node certificate not for this node", "deploy/k8s/overlays/cert-manager/agent-node-cert.yaml",
     '--node-id "${NODE_NAME}"', "--node-id node-1",
     "does not take --node-id from spec.nodeName"),
    ("PyTorchJob trainer without its key", "deploy/k8s/examples/pytorchjob.yaml",
     "                - name: CKPT_TLS_KEY\n                  value: /etc/ckpt-tls/tls.key\n", "",
     "sets no CKPT_TLS_KEY"),
    ("Job example runs a script that is not in examples/", "deploy/k8s/examples/job.yaml",
     "/usr/local/share/ckpt/examples/train_torchrun.py", "/usr/local/share/ckpt/examples/train_torchrn.py",
     "want /usr/local/share/ckpt/examples/train_torchrun.py"),
    ("Job example's CKPT_JOB from a label the Job controller does not set", "deploy/k8s/examples/job.yaml",
     "fieldPath: metadata.labels['job-name']", "fieldPath: metadata.labels['jobname']",
     "CKPT_JOB from label jobname"),
    ("memory tier in the emptyDir's 0777 mount point", "deploy/k8s/base/configmap.yaml",
     "    memory_dir: /ckpt/memory/tier\n", "    memory_dir: /ckpt/memory\n",
     "is a volume's mount point"),
]


def copy_tree(src, dst):
    for d in ("deploy", "docs", "src", "examples"):
        shutil.copytree(os.path.join(src, d), os.path.join(dst, d),
                        ignore=shutil.ignore_patterns("*.o", "*.a", "*.so"))
    os.makedirs(os.path.join(dst, "scripts"))
    shutil.copy(os.path.join(src, "scripts", "packages.txt"), os.path.join(dst, "scripts"))


def run_check(tree, binaries):
    out = subprocess.run(["/usr/bin/python3", os.path.join(HERE, "check_manifests.py"), tree] + binaries,
                         capture_output=True, text=True, timeout=300)
    return out.returncode, out.stdout + out.stderr


def main():
    if len(sys.argv) not in (4, 5, 6):
        print(__doc__)
        return 2
    src, binaries = sys.argv[1], sys.argv[2:]
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "tree")
        copy_tree(src, tree)
        rc, out = run_check(tree, binaries)
        if rc != 0:
            print(out)
            print("FAIL: the shipped files do not pass check_manifests.py")
            return 1
        caught = 0
        for name, rel, old, new, want in MUTATIONS:
            path = os.path.join(tree, rel)
            with open(path) as f:
                text = f.read()
            if text.count(old) != 1:
                problems.append(f"{name}: {rel} no longer holds the text to change (update this test)")
                continue
            with open(path, "w") as f:
                f.write(text.replace(old, new))
            try:
                rc, out = run_check(tree, binaries)
            finally:
                with open(path, "w") as f:
                    f.write(text)
            if rc != 1 or want not in out:
                problems.append(f"{name}: not caught (exit {rc}; wanted a failure saying {want!r}):\n{out}")
            else:
                caught += 1
                line = next(l for l in out.splitlines() if want in l)
                print(f"caught: {name}: {line[:160]}")
    for p in problems:
        print("FAIL: " + p)
    print(f"{caught} insecure changes caught, {len(problems)} missed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
