#!/usr/bin/python3
"""The netns harness itself (tests/netns/netns.py), no ckpt daemon involved: every fault does
what it says, measured with UDP and TCP traffic between the namespaces, and the harness leaves
nothing behind however it ends.

  - a one-way cut drops a -> b only (UDP counted both ways); loss 30% drops about 30%;
    a rate limit caps a -> b (TCP throughput) and not a -> c; a partition cuts across only;
    heal restores everything; move gives a host a new address (the old one answers no more);
  - latency (tc netem): measured when the kernel has sch_netem, else skipped with the reason;
  - sweep: a namespace and a memory-tier dir named by a harness that is gone (with a process
    still running inside the namespace) are removed by the next harness;
  - a harness killed by SIGTERM tears its namespaces down itself; one killed by SIGKILL takes
    its processes with it (PR_SET_PDEATHSIG) and the next sweep removes its namespaces.

Needs root, iproute2 and nftables; exits 77 (skipped) otherwise.
Run: /usr/bin/python3 tests/netns/netns_harness_test.py
"""
import os
import pathlib
import signal
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import netns  # noqa: E402
from netns import PY, Checks  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent

# Counts UDP datagrams on port 9000 until a line comes on stdin (the sender is done and what it
# sent had time to arrive), then prints the count. Not a fixed window: on a loaded machine the
# sender's start alone can outlast one, and datagrams it sent would go uncounted.
SINK = r"""
import select, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 9000))
try:  # room for every datagram even if this process is not scheduled meanwhile (root: FORCE)
    s.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 8 << 20)
except OSError:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
print("ready", flush=True)
n = 0
while True:
    ready, _, _ = select.select([s, sys.stdin], [], [])
    if s in ready:
        s.recv(2048); n += 1
    elif sys.stdin in ready:
        break
while True:  # what is already queued counts too
    ready, _, _ = select.select([s], [], [], 0)
    if not ready:
        break
    s.recv(2048); n += 1
print(n, flush=True)
"""
# Sends argv[2] UDP datagrams to argv[1]:9000.
SEND = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[2])):
    try:
        s.sendto(b"x" * 200, (sys.argv[1], 9000))
    except OSError:
        pass
    if i % 50 == 49:
        time.sleep(0.002)
"""
# TCP: a server on port 9001 that reads everything; the client sends argv[2] bytes and prints
# the seconds it took (the server acks the end).
TCP_SERVER = r"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 9001)); s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    n = int(c.recv(16).decode().strip())
    got = 0
    while got < n:
        b = c.recv(1 << 16)
        if not b:
            break
        got += len(b)
    c.sendall(b"k"); c.close()
"""
TCP_CLIENT = r"""
import socket, sys, time
n = int(sys.argv[2]); c = socket.create_connection((sys.argv[1], 9001), timeout=float(sys.argv[3]))
t = time.monotonic(); c.sendall(f"{n:<16}".encode()); c.sendall(b"x" * n); c.recv(1)
print(time.monotonic() - t)
"""
# A harness that builds a Net with two hosts, starts `sleep` in one, prints its namespace tag,
# and waits to be killed.
CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import netns
net = netns.Net("child")
net.add_host("a"); net.add_host("b")
p = net.spawn("a", ["sleep", "600"], "/dev/null")
print(net.tag, p.pid, flush=True)
time.sleep(600)
"""


def udp(net, src, dst, n=400):
    sink = net.spawn_piped(dst, [PY, "-c", SINK], "/dev/null")
    assert sink.stdout.readline().strip() == "ready"
    net.host(src).exec([PY, "-c", SEND, net.host(dst).address, str(n)])
    time.sleep(0.3)  # the last datagrams cross the veth pair and the bridge (real network)
    sink.stdin.write("done\n")
    sink.stdin.flush()
    out = sink.stdout.readline().strip()
    sink.wait()
    return int(out)


def tcp_seconds(net, src, dst, nbytes):
    r = net.host(src).exec([PY, "-c", TCP_CLIENT, net.host(dst).address, str(nbytes), "20"], check=False, timeout=60)
    return float(r.stdout.strip()) if r.returncode == 0 else None


def namespaces_of(tag):
    return [ns for ns in netns.list_namespaces() if ns.startswith(tag + "-")]


def body():
    t = Checks("netns_harness_test")
    # Sweep: a stale namespace (with a process inside) and memory dir of a harness that is gone.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.FAMILY}{dead.pid}-1"
    subprocess.run(["ip", "netns", "add", f"{stale}-x"], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", f"{stale}-x", "sleep", "600"])
    pathlib.Path(f"/dev/shm/{stale}").mkdir(exist_ok=True)
    net = netns.Net("harness")
    t.check(not namespaces_of(stale) and not pathlib.Path(f"/dev/shm/{stale}").exists(),
            "a new harness sweeps the namespaces and memory dirs of a harness that is gone")
    try:
        sleeper.wait(timeout=10)
        t.check(sleeper.returncode == -signal.SIGKILL, "the process left inside the stale namespace is killed")
    except subprocess.TimeoutExpired:
        sleeper.kill()
        t.check(False, "the process left inside the stale namespace is killed")

    a, b, c = net.add_host("a"), net.add_host("b"), net.add_host("c")
    net.spawn(b, [PY, "-c", TCP_SERVER], "/dev/null")
    net.spawn(c, [PY, "-c", TCP_SERVER], "/dev/null")
    time.sleep(0.3)  # the servers bind

    n = udp(net, "a", "b")
    t.check(n == 400, f"healthy: a -> b UDP 400/400 ({n})")
    net.cut("a", "b", both=False)
    ab, ba = udp(net, "a", "b"), udp(net, "b", "a")
    t.check(ab == 0 and ba == 400, f"one-way cut a -> b: a -> b {ab}/400, b -> a {ba}/400")
    net.heal()
    net.loss("a", "b", 30)
    ab, ba = udp(net, "a", "b", 1000), udp(net, "b", "a", 1000)
    t.check(550 <= ab <= 850 and ba == 1000, f"loss 30% a -> b: {ab}/1000 delivered a -> b, {ba}/1000 b -> a")
    net.heal()
    nbytes = 2 << 20
    base = tcp_seconds(net, "a", "b", nbytes)
    net.rate("a", "8mbit", "b")
    lim_b, lim_c = tcp_seconds(net, "a", "b", nbytes), tcp_seconds(net, "a", "c", nbytes)
    mbit = lambda s: nbytes * 8 / s / 1e6 if s else 0  # noqa: E731
    t.check(lim_b is not None and 5 <= mbit(lim_b) <= 10 and lim_c is not None and mbit(lim_c) > 50,
            f"rate 8mbit a -> b: a -> b {mbit(lim_b):.1f} Mbit/s, a -> c {mbit(lim_c):.0f} Mbit/s "
            f"(unlimited {mbit(base):.0f})")
    net.heal()
    net.rate("a", "16mbit")
    lim_b, lim_c = tcp_seconds(net, "a", "b", nbytes), tcp_seconds(net, "a", "c", nbytes)
    t.check(10 <= mbit(lim_b) <= 20 and 10 <= mbit(lim_c) <= 20,
            f"rate 16mbit on a's uplink (tbf): a -> b {mbit(lim_b):.1f}, a -> c {mbit(lim_c):.1f} Mbit/s")
    net.heal()
    net.partition(["a"], ["b", "c"])
    t.check(udp(net, "a", "b") == 0 and udp(net, "c", "a") == 0 and udp(net, "b", "c") == 400,
            "partition {a} | {b, c}: nothing crosses, b <-> c unaffected")
    net.heal()
    t.check(udp(net, "a", "b") == 400 and udp(net, "c", "a") == 400, "heal: a <-> b, a <-> c again")
    old = b.address
    new = net.move("b")
    t.check(net.reachable("a", "b", 9001) and b.address == new, f"move b {old} -> {new}: a reaches b at {new}")
    r = a.exec([PY, "-c", TCP_CLIENT, old, "10", "2"], check=False, timeout=60)
    t.check(r.returncode != 0, f"nothing answers at b's old address {old}")

    reason = netns.netem_reason()
    if reason:
        print(f"skip latency: {reason}")
    else:
        net.delay("a", 100)
        s = tcp_seconds(net, "a", "c", 10)
        t.check(s is not None and s >= 0.2, f"netem 100 ms on a's uplink: a small TCP exchange a -> c took {s:.3f} s")
        net.heal()
    net.teardown()
    t.check(not namespaces_of(net.tag), "teardown deletes every namespace of the harness")

    # Harnesses that die: SIGTERM (handlers tear down), SIGKILL (pdeathsig, then the next sweep).
    for sig in (signal.SIGTERM, signal.SIGKILL):
        child = subprocess.Popen([PY, "-c", CHILD, str(HERE)], stdout=subprocess.PIPE, text=True)
        tag, pid = child.stdout.readline().split()
        t.check(len(namespaces_of(tag)) == 3, f"child harness {tag}: switch + 2 hosts")
        child.send_signal(sig)
        child.wait(timeout=30)
        ok, _ = netns.wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10, period=0.05)
        t.check(ok, f"{sig.name}: the process it started in a namespace died with it")
        if sig == signal.SIGTERM:
            t.check(not namespaces_of(tag), "SIGTERM: the harness deleted its namespaces")
        else:
            # (Left behind: 3, unless another harness, a netns test running beside this one,
            # started meanwhile and its sweep took some or all of them already.)
            left = len(namespaces_of(tag))
            netns.sweep_stale()
            t.check(left <= 3 and not namespaces_of(tag),
                    f"SIGKILL: {left} namespaces left behind, none after the next sweep")
    return t.finish()


if __name__ == "__main__":
    netns.main_guard(body)
