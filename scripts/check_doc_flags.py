#!/usr/bin/env python3
"""The docs and the binaries' flags agree (issue 40).

Usage: check_doc_flags.py SOURCE_DIR BIN_DIR
       check_doc_flags.py --selftest

Every flag a daemon's `--help` prints is documented where an operator looks
for it, and every flag the docs give one of ckpt's binaries exists:

1. Documented:
   - ckpt-meta: in docs/operations.md, section "### ckpt-meta";
   - ckpt-agent: in docs/operations.md, section "### ckpt-agent";
   - ckpt-dpu-agent: its flags that ckpt-agent lacks, in docs/dpu.md;
   - ckpt-dpu-proxy: in docs/dpu.md;
   - ckptctl: its global flags and every subcommand's (certs' too), in
     docs/cli.md.
2. Existing:
   - a flag in the first column of those two operations.md tables is the
     section's binary's;
   - a command line in README.md or docs/*.md, in a code block or an inline
     code span, that runs one of these binaries (`ckpt-agent ...`,
     `build/bin/ckptctl versions ...`, lines continued with `\\`) names only
     that binary's flags (ckptctl: its global flags and its subcommand's).

A binary that was not built (ckpt-dpu-agent without UCX) is left out.
Exit 0 when all agree, 1 listing every disagreement.
"""
import os
import re
import subprocess
import sys

DAEMONS = ["ckpt-meta", "ckpt-agent", "ckpt-dpu-agent", "ckpt-dpu-proxy"]
ALWAYS = {"--help"}

FLAG_LINE = re.compile(r"^\s+(?:-\w,)?(--[a-z0-9][a-z0-9-]*)")
SUBCOMMAND_LINE = re.compile(r"^\s+([a-z][a-z0-9-]*)(?:\s{2,}|$)")
FLAG = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)")


def help_text(binary, *args):
    p = subprocess.run([binary, *args, "--help"], capture_output=True, text=True, timeout=60)
    return p.stdout + p.stderr


def parse_help(text):
    """(flags, subcommands) of one CLI11 --help page."""
    flags, subs, section = set(), [], None
    for line in text.splitlines():
        if re.match(r"^[A-Z][A-Za-z ]*:\s*$", line):
            section = line.strip().rstrip(":")
            continue
        if section == "Options" or section is None:
            m = FLAG_LINE.match(line)
            if m:
                flags.add(m.group(1))
        elif section == "Subcommands":
            m = SUBCOMMAND_LINE.match(line)
            if m:
                subs.append(m.group(1))
        else:  # positionals and the like
            m = FLAG_LINE.match(line)
            if m:
                flags.add(m.group(1))
    return flags, subs


class Ckptctl:
    def __init__(self, binary):
        self.global_flags, subs = parse_help(help_text(binary))
        self.sub_flags = {}  # "restore" -> flags; "certs create-node" -> flags
        for sub in subs:
            flags, nested = parse_help(help_text(binary, sub))
            self.sub_flags[sub] = flags
            for n in nested:
                self.sub_flags[f"{sub} {n}"] = parse_help(help_text(binary, sub, n))[0] | flags

    def all_flags(self):
        out = set(self.global_flags)
        for f in self.sub_flags.values():
            out |= f
        return out

    def allowed(self, words):
        """Flags a `ckptctl WORDS...` command line may use."""
        subs = [w for w in words if not w.startswith("-")]
        for i, w in enumerate(subs):
            if w in self.sub_flags:
                if i + 1 < len(subs) and f"{w} {subs[i + 1]}" in self.sub_flags:
                    return self.global_flags | self.sub_flags[f"{w} {subs[i + 1]}"]
                return self.global_flags | self.sub_flags[w]
        return self.all_flags()


def section(text, heading):
    """The body of a markdown section, up to the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    try:
        start = lines.index(heading)
    except ValueError:
        return None
    body = []
    for line in lines[start + 1:]:
        m = re.match(r"^(#+) ", line)
        if m and len(m.group(1)) <= level:
            break
        body.append(line)
    return "\n".join(body)


def strip_code_fences_outside(text):
    """The text with code blocks and inline code spans: (line number, snippet) pairs."""
    out, in_block, pending = [], False, None
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            pending = None
            continue
        if in_block:
            if pending is not None:
                pending[1] += " " + line
                if not line.rstrip().endswith("\\"):
                    out.append(tuple(pending))
                    pending = None
                continue
            if line.rstrip().endswith("\\"):
                pending = [no, line]
            else:
                out.append((no, line))
        else:
            for span in re.findall(r"`([^`]+)`", line):
                out.append((no, span))
    return out


COMMAND = re.compile(r"(?:^|[\s/;|&(\"'$]|\})(ckpt-meta|ckpt-agent|ckpt-dpu-agent|ckpt-dpu-proxy|ckptctl)(?=\s|$)")


def commands(snippet):
    """(binary, words) of each command line in a snippet."""
    found = list(COMMAND.finditer(snippet))
    for i, m in enumerate(found):
        end = found[i + 1].start(1) if i + 1 < len(found) else len(snippet)
        rest = snippet[m.end(1):end]
        rest = re.split(r"[|;&#]|\$\(|\)|>", rest)[0]  # the command ends at a pipe, a comment, ...
        words = [w for w in rest.replace("\\", " ").split()]
        yield m.group(1), words


SELFTEST_HELP = {
    "ckpt-meta": "Usage: ckpt-meta [OPTIONS]\n\nOptions:\n  -h,--help   Print\n  --listen A  gRPC\n  --lease-ms MS=5000\n",
    "ckpt-agent": "Usage: ckpt-agent [OPTIONS]\n\nOptions:\n  -h,--help   Print\n  --node-id ID\n  --memory-dir DIR\n",
    "ckptctl": "Usage: ckptctl [OPTIONS] SUBCOMMAND\n\nOptions:\n  -h,--help  Print\n  --meta HOST:PORT\n\n"
               "Subcommands:\n  restore  Restore\n  flush    Flush\n",
    "ckptctl restore": "Usage: ckptctl restore JOB STEP\n\nPositionals:\n  JOB TEXT\n\nOptions:\n  -h,--help\n  --out DIR\n",
    "ckptctl flush": "Usage: ckptctl flush JOB STEP\n\nOptions:\n  -h,--help\n  --wait   Then wait\n",
}

SELFTEST_DOCS = {
    "README.md": "Run `ckpt-meta --listen 127.0.0.1:7400`.\n",
    "docs/operations.md": "# Ops\n\n### ckpt-meta\n\n| flag | meaning |\n|---|---|\n| `--listen` | gRPC |\n"
                          "| `--heartbeat-ms` | gone |\n\n### ckpt-agent\n\n| `--node-id` | id |\n\n"
                          "```\nckpt-agent --node-id n1 \\\n  --memory-dir-not-tmpfs\n"
                          "ckptctl --meta m restore j 1 --out d --wait | tail\n```\n",
    "docs/dpu.md": "nothing\n",
    "docs/cli.md": "`--meta`, `--out`\n",
}

SELFTEST_EXPECTED = [
    "ckpt-meta --lease-ms: not in docs/operations.md \"### ckpt-meta\"",
    "docs/operations.md \"### ckpt-meta\": --heartbeat-ms is not a ckpt-meta flag",
    "ckpt-agent --memory-dir: not in docs/operations.md \"### ckpt-agent\"",
    "ckptctl flush --wait: not in docs/cli.md",
    "docs/operations.md:15: `ckpt-agent` has no flag --memory-dir-not-tmpfs",
    "docs/operations.md:17: `ckptctl` has no flag --wait",
]


def selftest():
    """Made-up binaries and docs: exactly the planted disagreements are reported."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        bindir = os.path.join(tmp, "bin")
        os.makedirs(bindir)
        os.makedirs(os.path.join(tmp, "src", "docs"))
        for name in ("ckpt-meta", "ckpt-agent", "ckptctl"):
            path = os.path.join(bindir, name)
            with open(path, "w") as f:
                f.write("#!/bin/sh\ncase \"$*\" in\n")
                for key, text in SELFTEST_HELP.items():
                    if key.split(" ")[0] != name:
                        continue
                    args = " ".join(key.split(" ")[1:] + ["--help"])
                    f.write(f"  \"{args}\") cat <<'X'\n{text}X\n  ;;\n")
                f.write("esac\n")
            os.chmod(path, 0o755)
        for rel, text in SELFTEST_DOCS.items():
            with open(os.path.join(tmp, "src", rel), "w") as f:
                f.write(text)
        got = check(os.path.join(tmp, "src"), bindir)
    if sorted(got) != sorted(SELFTEST_EXPECTED):
        print("selftest FAILED\n  got:\n    " + "\n    ".join(got) + "\n  expected:\n    " +
              "\n    ".join(SELFTEST_EXPECTED))
        return 1
    print(f"selftest: the {len(got)} planted disagreements and nothing else")
    return 0


def main():
    if sys.argv[1:] == ["--selftest"]:
        return selftest()
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    src, bindir = sys.argv[1], sys.argv[2]
    problems = check(src, bindir)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} disagreement(s) between the docs and the binaries' --help")
        return 1
    print("docs and --help agree")
    return 0


def check(src, bindir):
    problems = []
    flags = {}
    for d in DAEMONS:
        path = os.path.join(bindir, d)
        if os.path.exists(path):
            flags[d] = parse_help(help_text(path))[0]
    ctl_path = os.path.join(bindir, "ckptctl")
    ctl = Ckptctl(ctl_path) if os.path.exists(ctl_path) else None

    def read(rel):
        with open(os.path.join(src, rel), encoding="utf-8") as f:
            return f.read()

    ops = read("docs/operations.md")
    dpu = read("docs/dpu.md")
    cli = read("docs/cli.md")

    # 1. Every flag documented.
    for d, heading in (("ckpt-meta", "### ckpt-meta"), ("ckpt-agent", "### ckpt-agent")):
        if d not in flags:
            continue
        body = section(ops, heading)
        if body is None:
            problems.append(f"docs/operations.md: no section \"{heading}\"")
            continue
        named = set(FLAG.findall(body))
        for f in sorted(flags[d] - ALWAYS - named):
            problems.append(f"{d} {f}: not in docs/operations.md \"{heading}\"")
        # 2a. The table names only the binary's flags.
        for line in body.splitlines():
            if line.startswith("|"):
                first = line.split("|")[1]
                for f in FLAG.findall(first):
                    if f not in flags[d]:
                        problems.append(f"docs/operations.md \"{heading}\": {f} is not a {d} flag")
    if "ckpt-dpu-agent" in flags:
        own = flags["ckpt-dpu-agent"] - flags.get("ckpt-agent", set())
        for f in sorted(own - set(FLAG.findall(dpu))):
            problems.append(f"ckpt-dpu-agent {f}: not in docs/dpu.md")
    if "ckpt-dpu-proxy" in flags:
        for f in sorted(flags["ckpt-dpu-proxy"] - ALWAYS - set(FLAG.findall(dpu))):
            problems.append(f"ckpt-dpu-proxy {f}: not in docs/dpu.md")
    if ctl is not None:
        named = set(FLAG.findall(cli))
        for f in sorted(ctl.global_flags - ALWAYS - named):
            problems.append(f"ckptctl {f}: not in docs/cli.md")
        for sub, sf in sorted(ctl.sub_flags.items()):
            for f in sorted(sf - ALWAYS - named):
                problems.append(f"ckptctl {sub} {f}: not in docs/cli.md")

    # 2b. Command lines in the docs name flags their binary has.
    docs = ["README.md"] + sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(src, "docs"))
                                  if n.endswith(".md"))
    for rel in docs:
        for no, snippet in strip_code_fences_outside(read(rel)):
            for binary, words in commands(snippet):
                if binary == "ckptctl":
                    if ctl is None:
                        continue
                    allowed = ctl.allowed(words)
                elif binary in flags:
                    allowed = flags[binary]
                else:
                    continue
                for w in words:
                    m = re.match(r"^(--[a-z0-9][a-z0-9-]*)(=.*)?$", w)
                    if m and m.group(1) not in allowed | ALWAYS:
                        problems.append(f"{rel}:{no}: `{binary}` has no flag {m.group(1)}")

    return problems


if __name__ == "__main__":
    sys.exit(main())
