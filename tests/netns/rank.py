#!/usr/bin/python3
"""One trainer rank for the netns tests (tests/netns/netns.py starts it inside its agent's
namespace): the Python `ckpt` client, driven by one JSON request a line on stdin, one JSON
answer a line on stdout (ok: true/false, error: "Type: message" on failure, ms: how long it took).

  {"op": "save", "step": S, "size": N}          saves {"payload": N bytes (netns.payload), "tag"}
                                                 and waits for the commit
  {"op": "wait", "step": S, "level": "protected", "timeout": T}
  {"op": "load", "step": S}                      -> served_from, sha256 of the payload, tag ok
  {"op": "latest", "level": "protected"}         -> step (null if none)
  {"op": "exit"}

The client connects on the first request (meta may be unreachable at start: it is retried
within that request's connect_timeout).
"""
import argparse
import hashlib
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import netns  # noqa: E402  (payload only; no namespaces are made here)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--meta", required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--protection", default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rpc-timeout", type=float, default=10.0, help="the client's deadline per call (s)")
    a = p.parse_args()
    import ckpt
    client = None

    def get():
        nonlocal client
        if client is None:
            client = ckpt.Client(job=a.job, rank=a.rank, world_size=a.world_size, meta=a.meta,
                                 agent_socket=a.socket, protection=a.protection, connect_timeout=20.0,
                                 rpc_timeout=a.rpc_timeout, load_timeout=30.0)
        return client

    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "exit":
            break
        t0 = time.monotonic()
        out = {"ok": True}
        try:
            c = get()
            if op == "save":
                state = {"payload": netns.payload(a.seed, a.job, req["step"], a.rank, req["size"]),
                         "tag": f"{a.job}/{req['step']}/{a.rank}".encode()}
                c.save(req["step"], state).committed(timeout=req.get("timeout", 30))
                out["sha256"] = hashlib.sha256(state["payload"].tobytes()).hexdigest()
            elif op == "wait":
                c.wait(req["step"], req.get("level", "protected"), timeout=req.get("timeout", 30))
            elif op == "load":
                served, items = c.load_items(req["step"])
                got = {name: data for name, _, _, _, data in items}
                pay = got.get("payload")
                out["served_from"] = served
                out["sha256"] = hashlib.sha256(pay.tobytes()).hexdigest() if pay is not None else None
                out["size"] = int(pay.size) if pay is not None else None
                out["tag_ok"] = got.get("tag") is not None and bytes(got["tag"]) == \
                    f"{a.job}/{req['step']}/{a.rank}".encode()
            elif op == "latest":
                out["step"] = c.latest(req.get("level", "protected"))
            elif op == "node":
                out["node"] = c.node_id
            else:
                out = {"ok": False, "error": f"unknown op {op}"}
        except Exception as e:  # noqa: BLE001 - the answer carries it
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out["ms"] = round((time.monotonic() - t0) * 1000, 1)
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
