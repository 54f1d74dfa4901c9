"""The Python client against real ckpt-meta and ckpt-agent processes."""
import collections
import os
import pathlib
import signal
import socket
import threading
import time

import numpy as np
import pytest
import torch

import ckpt

from conftest import BUILD_DIR, CLUSTER_MEMORY_MIB, free_ports

NUMPY_DTYPES = [np.float32, np.float16, np.float64, np.int8, np.int16, np.int32, np.int64,
                np.uint8, np.uint16, np.uint32, np.uint64, np.bool_, np.complex64, np.complex128]
TORCH_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16,
                torch.int32, torch.int64, torch.uint8, torch.bool]


def assert_same(a, b, path="state"):
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert np.array_equal(a, b), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a == b, path
    else:
        assert a == b, path


def test_round_trip_every_type_and_dtype(cluster, job):
    rng = np.random.default_rng(1)
    state = {
        "numpy": {np.dtype(d).name: (rng.random((3, 5)) * 100).astype(d) for d in NUMPY_DTYPES},
        "torch": {str(d): (torch.rand(4, 3) * 100).to(d) for d in TORCH_DTYPES},
        "scalars": {"int": -12345678901234, "float": 0.1, "str": "héllo / wörld", "bytes": b"\x00\xff",
                    "true": True, "false": False, "none": None, "empty": b"", "np_scalar": np.float32(2.5)},
        "zero_d": torch.tensor(7.0), "empty_t": torch.zeros(0, 4), "empty_np": np.zeros((2, 0)),
        "containers": {"list": [1, "a", [2.0, None]], "tuple": (1, (2, 3)), "empty_list": [],
                       "empty_dict": {}, "int_keys": {0: "zero", 7: {"x": 1}}},
        "odd/key": 1, "#hash": 2, "pct%2F": 3,
        "noncontig": np.arange(20, dtype=np.int32).reshape(4, 5)[:, 1:3],
    }
    c = cluster.client(job)
    h = c.save(10, state)
    assert h.step == 10 and h.size_bytes > 0
    h.wait("staged", timeout=30)
    back = c.load(10)
    expected = dict(state)
    expected["noncontig"] = np.ascontiguousarray(state["noncontig"])
    assert_same(expected, back)


def test_leases_and_opens_go_over_the_session(cluster, job):
    """A client's staging leases (all but the job's first on the node, which
    asks meta) and the opens of its local copies go on its session
    connection, not gRPC (docs/agent.md "Client sessions")."""
    c = cluster.client(job)
    before = cluster.metric(0, "ckpt_agent_session_requests_total")
    state = {"w": np.arange(1000, dtype=np.float32)}
    for step in (1, 2, 3):
        c.save(step, state).wait("staged", timeout=60)
        assert np.array_equal(c.load(step)["w"], state["w"])
    # 2 leases (the first asks meta, over gRPC) and 3 opens, at least.
    assert cluster.metric(0, "ckpt_agent_session_requests_total") - before >= 5


def test_bad_session_requests_get_clear_errors_and_lose_nothing(cluster, job):
    """Garbage, empty requests, an unknown kind and an oversized request on a
    version-2 session of the real agent: each answered `ERR 3 <why>`; the
    agent, the connection and the client's state live on."""
    c = cluster.client(job)
    state = {"w": np.arange(10, dtype=np.float32)}
    c.save(1, state).wait("staged", timeout=60)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(str(cluster.socket.parent / "session.sock"))
    s.send(b"HELLO 2")
    assert s.recvmsg(4096, 1024)[0].split(b"\n")[0].endswith(b" open")
    for request, why in ((b"OPEN\n\xff\xfe garbage", b"not an OpenShardRequest"),
                         (b"LEASE\n\xff\xfe garbage", b"not an AcquireStagingLeaseRequest"),
                         (b"OPEN\n", b"job id"),
                         (b"LEASE\n", b"job id"),
                         (b"NOPE\nx", b"unknown session request"),
                         (b"OPEN\n" + b"x" * 70000, b"at most 65536 bytes")):
        s.send(request)
        reply = s.recv(1 << 16)
        assert reply.startswith(b"ERR 3 ") and why in reply, (request[:12], reply)
    s.close()
    assert np.array_equal(c.load(1)["w"], state["w"])


def test_nested_names_are_paths(cluster, job):
    c = cluster.client(job)
    c.save(1, {"model": {"layer.0": {"weight": np.ones(3, np.float32)}}}).wait("staged", timeout=30)
    _, items = c.load_items(1)
    names = [i[0] for i in items]
    assert "model/layer.0/weight" in names
    weight = [i for i in items if i[0] == "model/layer.0/weight"][0]
    assert weight[1] == ckpt.DType.F32 and weight[2] == [3]


def test_large_tensor(cluster, job):
    c = cluster.client(job, keep_in_memory=1)
    t = torch.randn(8 * 1024 * 1024)  # 32 MiB
    c.save(5, {"big": t}).wait("staged", timeout=60)
    assert torch.equal(c.load(5)["big"], t)


def train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        y = torch.randn(8, 2, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def train_wide(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    n = model.in_features
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.randn(8, n, generator=g)), torch.randn(8, n, generator=g)).backward()
        opt.step()


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=0.01),
], ids=["sgd_momentum", "adam"])
def test_torch_model_and_optimizer_resume_bit_identical(cluster, job, make_opt):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = make_opt(model.parameters())
    train(model, opt, 3, seed=1)
    c = cluster.client(job)
    ckpt.torch.save(c, 3, model=model, optimizer=opt, extra={"epoch": 1, "note": "x"}).wait("protected", timeout=30)
    train(model, opt, 4, seed=2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(123)
    model2 = torch.nn.Linear(4, 2)
    opt2 = make_opt(model2.parameters())
    c2 = cluster.client(job)
    step = c2.latest("protected")
    assert step == 3
    extra = ckpt.torch.load(c2, step, model=model2, optimizer=opt2)
    assert extra == {"epoch": 1, "note": "x"}
    train(model2, opt2, 4, seed=2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_wait_levels_and_latest(cluster, job):
    c = cluster.client(job)
    assert c.latest("staged") is None
    h = c.save(7, {"a": b"x"})
    h.committed(timeout=30)  # save returned before the agent's answer; this waits for it
    h.committed(timeout=0)  # answered: returns at once
    h.wait("staged", timeout=30)
    h.wait("protected", timeout=30)
    c.wait(7, "staged", timeout=30)
    assert c.latest("staged") == 7
    assert c.latest("protected") == 7
    assert c.latest("persisted") is None
    with pytest.raises(ckpt.DeadlineExceededError):
        h.wait("persisted", timeout=0.2)  # no flush policy: never persisted
    with pytest.raises(ckpt.InvalidArgumentError):
        h.wait("sometime", timeout=1)
    src, state = c.load_with_source(7)
    assert src == "local" and state == {"a": b"x"}


def test_errors_are_exceptions(cluster, job):
    c = cluster.client(job)
    c.save(3, {"a": b"x"}).wait("staged", timeout=30)
    with pytest.raises(ckpt.NotFoundError) as e:
        c.load(999)
    assert isinstance(e.value, ckpt.Error) and str(e.value)
    with pytest.raises(ckpt.InvalidArgumentError):
        cluster.client("Bad Job!")
    with pytest.raises(ckpt.InvalidArgumentError):
        c.save(4, {"a": object()})
    with pytest.raises(ckpt.InvalidArgumentError):
        c.save(4, [1, 2])
    with pytest.raises(ckpt.InvalidArgumentError):
        cluster.client(job, rank=3, world_size=2)


def test_no_daemon_is_a_clear_error(tmp_path):
    (port,) = free_ports(1)
    start = time.monotonic()
    with pytest.raises(ckpt.Error) as e:
        ckpt.Client(job="nobody", rank=0, world_size=1, meta=f"127.0.0.1:{port}",
                    agent_socket=str(tmp_path / "agent.sock"), connect_timeout=0.5)
    assert isinstance(e.value, (ckpt.DeadlineExceededError, ckpt.UnavailableError))
    assert str(e.value)
    assert time.monotonic() - start < 15


def test_read_durable_of_a_flushed_version(cluster, job):
    c = cluster.client(job, flush_every=1)
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
             "n": np.arange(4, dtype=np.int64), "meta": {"step": 20, "name": "run"}, "raw": b"abc"}
    c.save(20, state).wait("persisted", timeout=120)
    assert c.latest("persisted") == 20
    flat = ckpt.read_durable(cluster.durable_root / job / "20")
    assert list(flat.keys()) == [0]
    r0 = flat[0]
    assert np.array_equal(r0["w"], state["w"].numpy())
    assert np.array_equal(r0["b"], state["b"].view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(r0["n"], state["n"])
    assert r0["meta/step"] == 20 and r0["meta/name"] == "run" and r0["raw"] == b"abc"
    assert "meta" not in r0
    assert_same(state, ckpt.read_durable(cluster.durable_root / job / "20", structured=True)[0])
    with pytest.raises(ckpt.NotFoundError):
        ckpt.read_durable(cluster.durable_root / job / "21")


def test_save_and_load_release_the_gil(cluster, job):
    """With the switch interval at 1000 s, the interpreter never takes the GIL from a thread
    that runs Python code: another thread runs only while this one releases it. So a thread
    that counts (yielding the GIL after each count) counts during a call iff the call
    released the GIL. The controls count nothing: a pure-Python computation, and a C call that
    keeps the GIL (numpy's tobytes, a memcpy as long as the save's copy)."""
    import sys
    import threading
    c = cluster.client(job, keep_in_memory=1)
    big = np.ones(8 * 1024 * 1024, np.float32)  # 32 MiB (the tier is shared): the copy takes milliseconds
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0)  # lets the GIL go: the main thread takes it back at once

    def counted(fn):
        before = ticks[0]
        result = fn()
        return ticks[0] - before, result

    interval = sys.getswitchinterval()
    t = threading.Thread(target=spin)
    t.start()
    try:
        sys.setswitchinterval(1000)
        time.sleep(0.01)  # the spinner is running and waiting for the GIL
        control, _ = counted(lambda: sum(i * i for i in range(300000)))
        held, _ = counted(lambda: big.tobytes())  # a C call that keeps the GIL (memcpy)
        # The spinner needs a free core as well as the GIL: on a loaded machine (CI runs two
        # tests at once, the copy takes both cores) one call's GIL-free window can pass
        # unseen, so each call gets up to 5 tries. A call that kept the GIL counts 0 in all.
        saved = loaded = 0
        for step in range(1, 6):
            n, h = counted(lambda: c.save(step, {"x": big}))
            h.wait("protected", timeout=60)
            saved += n
            if saved > 0:
                break
        for _ in range(5):
            n, state = counted(lambda: c.load(step))
            loaded += n
            if loaded > 0:
                break
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        t.join()
    assert (control, held) == (0, 0), (control, held)  # the method sees a GIL held throughout
    assert saved > 0 and loaded > 0, (saved, loaded)
    assert state["x"].nbytes == big.nbytes


def test_memory_full_and_repeated_step_are_errors(cluster, job):
    c = cluster.client(job)
    too_big = np.zeros((CLUSTER_MEMORY_MIB + 40) << 20, np.uint8)  # more than the whole tier
    with pytest.raises(ckpt.ResourceExhaustedError) as e:
        c.save(1, {"x": too_big})
    assert "memory tier" in str(e.value)
    c.save(2, {"x": b"a"}).wait("staged", timeout=30)
    with pytest.raises(ckpt.AlreadyExistsError):
        c.save(2, {"x": b"a"})


def test_load_into_restores_in_place(cluster, job):
    c = cluster.client(job)
    w = torch.randn(64, 32)
    b = torch.randn(32).to(torch.bfloat16)
    n = np.arange(10, dtype=np.int32)
    c.save(1, {"model": {"w": w, "b": b}, "n": n, "other": b"skip"}).wait("staged", timeout=30)
    w2, b2, n2 = torch.zeros_like(w), torch.zeros_like(b), np.zeros_like(n)
    w2_ptr = w2.data_ptr()
    c.load_into(1, {"model/w": w2, "model/b": b2, "n": n2})
    assert torch.equal(w2, w) and torch.equal(b2, b) and np.array_equal(n2, n)
    assert w2.data_ptr() == w2_ptr
    with pytest.raises(ckpt.NotFoundError):
        c.load_into(1, {"model/missing": torch.zeros(1)})
    with pytest.raises(ckpt.InvalidArgumentError):
        c.load_into(1, {"model/w": torch.zeros(3)})
    with pytest.raises(ckpt.InvalidArgumentError):
        c.load_into(1, {"n": np.zeros(20, np.int32)[::2]})


def test_two_ranks_in_one_version(cluster, job):
    c0 = cluster.client(job, rank=0, world_size=2, flush_every=1)
    c1 = cluster.client(job, rank=1, world_size=2, flush_every=1)
    h0 = c0.save(4, {"rank": 0, "x": np.full(5, 0, np.float64)})
    h1 = c1.save(4, {"rank": 1, "x": np.full(7, 1, np.float64)})
    h0.wait("persisted", timeout=120)
    h1.wait("persisted", timeout=120)
    assert c1.latest("protected") == 4
    assert c0.load(4)["rank"] == 0 and c1.load(4)["rank"] == 1
    flat = ckpt.read_durable(cluster.durable_root / job / "4")
    assert sorted(flat) == [0, 1]
    assert flat[1]["rank"] == 1 and flat[1]["x"].shape == (7,)


def test_corrupted_memory_tier_byte_is_data_loss(cluster, job):
    c = cluster.client(job)
    w = np.random.default_rng(7).random(5000).astype(np.float32)
    c.save(1, {"w": w}).wait("staged", timeout=30)
    # Flip one byte of the item inside the agent's pool files.
    needle = w.tobytes()
    flipped = False
    for f in sorted((cluster.root / "mem").rglob("*")):
        if not f.is_file():
            continue
        data = f.read_bytes()
        at = data.find(needle)
        if at >= 0:
            with open(f, "r+b") as out:
                out.seek(at + 1234)
                out.write(bytes([data[at + 1234] ^ 0x10]))
            flipped = True
            break
    assert flipped, "the saved bytes were not found in the memory tier"
    # Either the load finds the bad item, or the agent's background verifier
    # got there first and meta already aborted the version as data lost.
    for load in (lambda: c.load(1), lambda: c.load_into(1, {"w": np.zeros_like(w)})):
        with pytest.raises(ckpt.Error) as e:
            load()
        assert isinstance(e.value, ckpt.DataLossError) or "data lost" in str(e.value), repr(e.value)


def test_protection_spec(cluster, job):
    for bad in ("replicate", "replicate:x", "replicate:2:star", "ec:4", "ec:4+x", "mirror:2"):
        with pytest.raises(ckpt.InvalidArgumentError, match="protection"):
            cluster.client(job + "-bad", protection=bad)
    c = cluster.client(job, protection="none")
    c.save(1, {"a": b"x"}).wait("protected", timeout=30)
    with pytest.raises(ckpt.FailedPreconditionError, match=r"protection \(stored none, asked replicate\{2, ring\}\)"):
        cluster.client(job, protection="replicate:2:ring")  # the job exists with "none"
    cluster.client(job)  # protection=None: whatever the job has


def test_no_stated_protection_opens_a_job_created_with_replicate_or_ec(cluster2, job):
    for flags, name in ((["--replicate", "2"], job + "-rep"), (["--ec", "1+1"], job + "-ec")):
        r = cluster2.ctl("create-job", name, "--world-size", "2", *flags)
        assert r.returncode == 0, r.stderr
        ranks = [cluster2.client(name, rank=rank, world_size=2, agent=rank) for rank in range(2)]
        handles = [c.save(7, {"w": np.arange(4096, dtype=np.float32) + rank})
                   for rank, c in enumerate(ranks)]
        for h in handles:
            h.wait("protected", timeout=60)
        assert ranks[1].load(7)["w"][0] == 1.0
        with pytest.raises(ckpt.FailedPreconditionError, match="protection"):
            cluster2.client(name, world_size=2, protection="none")
    # No protection stated by anyone: the server's default, replicate:2 on two nodes.
    fresh = cluster2.client(job + "-dflt")
    fresh.save(1, {"a": b"x"}).wait("protected", timeout=60)
    jobs = cluster2.ctl("--json", "jobs")
    assert f'"{job}-dflt"' in jobs.stdout
    assert '"replicate:2:ring"' in jobs.stdout


def test_steps_outside_0_to_max_step_are_invalid(cluster, job):
    assert ckpt.MAX_STEP == 2**53 - 1
    c = cluster.client(job)
    for bad in (ckpt.MAX_STEP + 1, 2**64 - 1, -1):
        with pytest.raises(ckpt.InvalidArgumentError, match="out of range"):
            c.save(bad, {"a": b"x"})
        with pytest.raises(ckpt.InvalidArgumentError, match="out of range"):
            c.wait(bad, "staged", timeout=1)
        with pytest.raises(ckpt.InvalidArgumentError, match="out of range"):
            c.load(bad)
    # The job keeps working.
    c.save(20, {"a": b"x"}).wait("protected", timeout=30)
    assert c.latest("protected") == 20


def flat_items(state):
    """What ckpt._flatten (the Python walk) makes of `state`: (name, dtype, shape, attributes, bytes)."""
    out = []
    ckpt._flatten("", state, out)
    return [(e[0], e[2], list(e[3]), e[4], bytes(memoryview(e[1]).cast("B"))) for e in out]


def test_fast_walk_writes_what_flatten_writes(cluster, job):
    # Every kind of leaf, including those the C++ walk hands back to Python:
    # non-contiguous, conjugated and negated tensors, numpy scalars, memoryviews.
    rng = np.random.default_rng(3)
    c64 = torch.complex(torch.randn(3), torch.randn(3))
    od = collections.OrderedDict([("z", 1), ("a", 2), ("m", 3)])
    od.move_to_end("z")
    state = {
        "torch": {str(d): (torch.rand(2, 3) * 100).to(d) for d in TORCH_DTYPES},
        "param": torch.nn.Parameter(torch.randn(4)),
        "grad": torch.randn(3, requires_grad=True) * 2,
        "t_noncontig": torch.arange(12.0).reshape(3, 4).t(),
        "t_conj": c64.conj(),
        "t_neg": c64.conj().imag,
        "t_empty": torch.zeros(0, 3),
        "np": rng.random((2, 2)),
        "np_noncontig": np.arange(20, dtype=np.int32).reshape(4, 5)[:, ::2],
        "np_scalar": np.float64(1.25),
        "np_int": np.int64(-3),
        "bytes": b"\x00\x01", "bytearray": bytearray(b"ab"), "memoryview": memoryview(b"mv"),
        "none": None, "true": True, "int": 2**70, "float": float("nan"), "str": "ü/%#",
        "list": [1, [2, (3, {})]], "tuple": (), "#odd": {"%2F": {7: "int key", -1: "neg"}},
        "ordered": od,
    }
    c = cluster.client(job)
    c.save(1, state).wait("staged", timeout=30)
    _, items = c.load_items(1)
    got = [(i[0], i[1], list(i[2]), i[3], i[4].tobytes()) for i in items]
    want = flat_items(state)
    assert [g[0] for g in got] == [w[0] for w in want]
    for g, w in zip(got, want):
        assert g == w, g[0]
    back = c.load(1)
    assert torch.equal(back["t_conj"], c64.conj().resolve_conj())
    assert torch.equal(back["t_neg"], c64.conj().imag.resolve_neg())
    assert torch.equal(back["t_noncontig"], state["t_noncontig"].contiguous())
    assert back["np_scalar"] == np.float64(1.25) and isinstance(back["np_scalar"], np.float64)
    assert back["memoryview"] == b"mv" and back["bytearray"] == bytearray(b"ab")
    assert back["int"] == 2**70 and np.isnan(back["float"]) and back["str"] == "ü/%#"
    assert back["list"] == [1, [2, (3, {})]] and back["tuple"] == ()
    assert back["#odd"] == {"%2F": {7: "int key", -1: "neg"}}
    assert list(back["ordered"]) == ["a", "m", "z"] and dict(back["ordered"]) == dict(od)
    assert torch.equal(back["param"], state["param"].detach())


def test_many_tensors_round_trip_in_order(cluster, job):
    n = 10000
    g = torch.Generator().manual_seed(5)
    sd = collections.OrderedDict(
        (f"layers.{i // 10}.p{i % 10}", torch.randn(16, generator=g).to(torch.bfloat16 if i % 7 == 0 else torch.float32))
        for i in range(n))
    c = cluster.client(job, keep_in_memory=1)
    c.save(2, {"model": sd, "step": 2}).wait("staged", timeout=60)
    back = c.load(2)
    assert list(back["model"].keys()) == list(sd.keys())
    for k, v in sd.items():
        assert back["model"][k].dtype == v.dtype and torch.equal(back["model"][k], v), k
    live = {f"model/{k}": torch.zeros_like(v) for k, v in sd.items()}
    c.load_into(2, live)
    assert all(torch.equal(live[f"model/{k}"], v) for k, v in sd.items())


def test_load_right_after_save_needs_no_wait(cluster, job):
    # The agent reports the commit to meta in the background; a one-rank
    # client's load of the step it just saved waits for that instead of
    # failing with "version is OPEN".
    c = cluster.client(job)
    for step in range(1, 6):
        w = torch.full((256,), float(step))
        c.save(step, {"w": w})
        assert torch.equal(c.load(step)["w"], w)
        back = torch.zeros(256)
        c.load_into(step, {"w": back})
        assert torch.equal(back, w)


def test_a_forked_child_gets_a_clear_error_and_exits(cluster, job):
    # A client belongs to the process that connected it: in a fork()ed child
    # its calls raise FailedPreconditionError naming fork() (before, they
    # hung: the child has none of the client's threads), and dropping it
    # there does not hang. The parent's client keeps working.
    import gc
    import signal
    c = cluster.client(job)
    c.save(1, {"w": torch.ones(16)})
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.close(r)
        msg = b"ok"
        try:
            for what, call in (("save", lambda: c.save(2, {"w": torch.ones(16)})), ("load", lambda: c.load(1)),
                               ("latest", lambda: c.latest())):
                try:
                    call()
                    msg = what.encode() + b" was not refused"
                except ckpt.FailedPreconditionError as e:
                    if "fork()" not in str(e):
                        msg = str(e).encode()
            del c
            gc.collect()
        except BaseException as e:  # noqa: B902 (reported to the parent)
            msg = repr(e).encode()
        os.write(w, msg)
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.01)
    out = os.read(r, 4096)
    os.close(r)
    assert out == b"ok"
    assert torch.equal(c.load(1)["w"], torch.ones(16))


def test_loads_items_written_with_the_old_torch_dtype_attribute(cluster, job):
    # Earlier versions wrote py.torch_dtype on torch items; it is ignored.
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    c = cluster.client(job)
    c._c.save_items(3, [("w", t.numpy().reshape(-1).view(np.uint8), ckpt.DType.I32, [2, 3],
                         {"py.type": "torch", "py.torch_dtype": "int32"})]).wait("staged", timeout=30)
    back = c.load(3)
    assert back["w"].dtype == torch.int32 and torch.equal(back["w"], t)


def test_load_of_items_that_do_not_form_a_state_is_data_loss(cluster, job):
    # Written by hand (or by another client): a list element far past the
    # list's items, and an item whose parent container does not exist.
    c = cluster.client(job)
    c._c.save_items(4, [("l", b"", ckpt.DType.BYTES, [], {"py.type": "list"}),
                        ("l/7", b"x", ckpt.DType.BYTES, [], {"py.type": "bytes"})]).wait("staged", timeout=30)
    with pytest.raises(ckpt.DataLossError, match="index"):
        c.load(4)
    c._c.save_items(5, [("x/y", b"1", ckpt.DType.BYTES, [], {"py.type": "int"})]).wait("staged", timeout=30)
    with pytest.raises(ckpt.DataLossError, match="no parent"):
        c.load(5)
    # The raw items are still readable.
    assert [i[0] for i in c.load_items(5)[1]] == ["x/y"]


# ---- lazy saves (issue 16) ----

class RecordingClient:
    """A ckpt.Client that counts the waits for the lazy copy made through it."""

    def __init__(self, client):
        self.client = client
        self.waits = 0
        self.throughs = []  # the wait point of each wait (None: the whole copy)

    def save(self, *args, **kwargs):
        return self.client.save(*args, **kwargs)

    def wait_copied(self, timeout=None, through=None):
        self.waits += 1
        self.throughs.append(through)
        return self.client.wait_copied(timeout, through=through)


def test_lazy_torch_save_restores_the_values_from_before_the_optimizer_step(cluster, job):
    # 2 x 4 MiB (weights and momentum): the copy takes a while, and the very
    # next optimizer step would change them under it without the wait.
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_wide(model, opt, 2, seed=1)
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    expected_momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    c = cluster.client(job)
    lazy = ckpt.torch.save(c, 2, model=model, optimizer=opt, lazy=True)
    assert isinstance(lazy, ckpt.LazySave)
    opt.step()  # at once (the gradients of the last step are still there): it waits for the copy
    assert lazy.copied
    train_wide(model, opt, 1, seed=2)
    assert not torch.equal(model.weight, expected_model["weight"])
    lazy.wait("protected", timeout=60)

    model2 = torch.nn.Linear(1024, 1024, bias=False)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    ckpt.torch.load(c, 2, model=model2, optimizer=opt2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected_model[k]), k
    assert torch.equal(opt2.state_dict()["state"][0]["momentum_buffer"], expected_momentum)
    # The wrapper is installed once per client, however often it saves.
    ckpt.torch.save(c, 3, model=model, optimizer=opt, lazy=True).wait("staged", timeout=60)
    assert len(opt._ckpt_guarded) == 1


def test_lazy_save_of_a_model_whose_forward_changes_buffers_waits_for_the_buffers_before_forward(cluster, job):
    # The BatchNorm statistics come after the 16 MiB weight in the model's
    # state dict; a lazy save puts them first, and the forward pass (a small
    # batch, which updates them at once) waits for their copy only.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 16384, bias=False), torch.nn.BatchNorm1d(16384))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    model(torch.randn(4, 256))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    c = cluster.client(job)
    rec = RecordingClient(c)
    lazy = ckpt.torch.save(rec, 1, model=model, optimizer=opt, lazy=True)
    point = "model/1.num_batches_tracked"
    # Items: the "model" marker, the 3 buffers, the weight and BatchNorm's 2 parameters, ...
    assert lazy.wait_points == {point: 3}
    assert rec.waits == 0
    out = model(torch.randn(4, 256) * 10)  # waits for the buffers' copy, then updates running_mean/var
    assert rec.throughs == [point]
    assert lazy._impl.copied_items >= 4
    assert not torch.equal(model[1].running_mean, expected["1.running_mean"])
    out.pow(2).mean().backward()
    opt.step()  # waits for the whole copy: the parameters change now
    assert rec.throughs == [point, None] and lazy.copied
    lazy.wait("staged", timeout=60)
    state = c.load(1)
    assert list(state["model"])[:3] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert sorted(state["model"]) == sorted(expected)
    for k, v in state["model"].items():
        assert torch.equal(v, expected[k]), k
    # ckpt.torch.load puts them back whatever their order.
    model2 = torch.nn.Sequential(torch.nn.Linear(256, 16384, bias=False), torch.nn.BatchNorm1d(16384))
    ckpt.torch.load(c, 1, model=model2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_lazy_torch_save_puts_buffers_first_and_tied_parameters_with_the_parameters():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.norm = torch.nn.BatchNorm1d(8)
            self.head = torch.nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight  # saved as emb.weight and head.weight
            self.register_buffer("empty", torch.zeros(0))

    model = Tied()
    sd = model.state_dict()
    out, last = ckpt.torch._buffers_first(model, sd)
    assert list(out) == ["empty", "norm.running_mean", "norm.running_var", "norm.num_batches_tracked",
                         "emb.weight", "norm.weight", "norm.bias", "head.weight"]
    assert last == "norm.num_batches_tracked" and out._metadata is sd._metadata
    plain = torch.nn.Linear(2, 2)
    assert ckpt.torch._buffers_first(plain, plain.state_dict())[1] is None


def test_lazy_save_wait_points(cluster, job):
    c = cluster.client(job)
    state = {"a": np.arange(1000, dtype=np.float32), "b": np.ones(4 << 20, np.uint8), "c": 7}
    with pytest.raises(ckpt.InvalidArgumentError, match="wait point \"nope\" is not an item"):
        c.save(1, state, lazy=True, wait_points=["nope"])
    with pytest.raises(ckpt.InvalidArgumentError, match="lazy"):
        c.save(1, state, wait_points=["a"])
    for bad, why in (("a", "not one str"), (5, "not int"), ([b"a"], "names \\(str\\), not bytes")):
        with pytest.raises(ckpt.InvalidArgumentError, match=why):
            c.save(1, state, lazy=True, wait_points=bad)
    lazy = c.save(1, state, lazy=True, wait_points=["a"])  # the step refused above is free
    assert lazy.wait_points == {"a": 0}
    with pytest.raises(ckpt.InvalidArgumentError, match="not a wait point"):
        lazy.wait_copied(through="b")
    c.wait_copied(through="a")
    assert lazy._impl.copied_items >= 1
    c.wait_copied(through="b")  # not a wait point of the save: the whole copy
    assert lazy.copied
    lazy.wait("staged", timeout=60)
    back = c.load(1)
    assert np.array_equal(back["a"], state["a"]) and np.array_equal(back["b"], state["b"]) and back["c"] == 7
    # Points anywhere: an escaped key, a list element, an item the Python walk makes
    # (a non-contiguous array is copied to a contiguous one first), a container.
    odd = {"x/y": np.ones(8), "l": [b"0", np.arange(12.0).reshape(3, 4).T], "m": {"k": 1}}
    names = ["x%2Fy", "l/0", "l/1", "m"]
    odd_lazy = c.save(2, odd, lazy=True, wait_points=names)
    assert sorted(odd_lazy.wait_points.values()) == [0, 2, 3, 4]  # x/y, (l), l/0, l/1, m
    for n in names:
        c.wait_copied(through=n)
    c.wait_copied()
    odd_lazy.wait("staged", timeout=60)
    assert np.array_equal(c.load(2)["l"][1], odd["l"][1])


def test_lazy_save_of_arrays_changed_after_wait_copied(cluster, job):
    c = cluster.client(job)
    a = np.arange(1_000_000, dtype=np.float32)
    b = np.ones((1000, 17), np.int64)
    lazy = c.save(7, {"a": a, "b": b, "n": 5, "s": "text"}, lazy=True)
    assert lazy.step == 7
    c.wait_copied()
    a[:] = -1
    b[:] = 0
    handle = lazy.result(timeout=60)
    assert handle.step == 7
    handle.wait("staged", timeout=30)
    state = c.load(7)
    assert np.array_equal(state["a"], np.arange(1_000_000, dtype=np.float32))
    assert np.array_equal(state["b"], np.ones((1000, 17), np.int64))
    assert state["n"] == 5 and state["s"] == "text"
    # A save that is not kept finishes anyway (the client holds it until copied).
    c.save(8, {"a": a}, lazy=True)
    c.save(9, {"a": a}).wait("staged", timeout=30)  # waits for step 8's copy first
    c.wait(8, "staged", timeout=30)
    assert c.latest("staged") == 9
    assert np.array_equal(c.load(8)["a"], a)


def test_lazy_wait_copied_does_not_wait_for_the_commit(cluster, job):
    """The training step waits for the copy only: with the agent stopped after it granted the
    lease (so the commit cannot be answered), wait_copied() still returns."""
    c = cluster.client(job, keep_in_memory=1)  # each try's version evicts the one before
    agent = cluster.procs[1]  # the cluster's first agent (conftest: meta, then the agents)
    state = {f"t{i}": np.full(256 * 1024, i, np.float32) for i in range(32)}  # 32 x 1 MiB
    resumed = threading.Event()
    for step in range(1, 11):
        c.save(step, state, lazy=True)  # not kept: as a training loop does
        started = time.monotonic()
        while c._lazy._impl.copied_items == 0:  # the lease is granted once copying starts
            if time.monotonic() - started > 60:
                c.wait_copied(timeout=1)  # raises the save's error, if it failed
                pytest.fail("the lazy save did not start copying within 60 s")
        agent.send_signal(signal.SIGSTOP)
        caught = c._lazy._impl.copied_items < c._lazy._impl.item_count
        watchdog = threading.Timer(30, lambda: (agent.send_signal(signal.SIGCONT), resumed.set()))
        watchdog.start()
        try:
            c.wait_copied()
            returned_while_stopped = not resumed.is_set()
        finally:
            watchdog.cancel()
            agent.send_signal(signal.SIGCONT)
        assert returned_while_stopped, "wait_copied waited for the commit (the agent was stopped)"
        c.wait(step, "staged", timeout=60)
        if caught:  # stopped mid-copy, so the commit was still to come: shown
            break
    else:
        pytest.skip("each copy ended before the agent could be stopped")
    assert np.array_equal(c.load(step)["t31"], state["t31"])


def test_a_wait_or_load_of_the_own_lazy_save_waits_for_its_commit(cluster, job):
    """Right after a lazy save (copy maybe still running, commit surely not at meta yet), this
    client's wait and load of that step see it: they wait for the save's commit first."""
    c = cluster.client(job)
    w = np.arange(1 << 20, dtype=np.float32)
    for step in range(1, 11, 2):
        c.save(step, {"w": w}, lazy=True)
        c.wait(step, "staged", timeout=30)
        c.save(step + 1, {"w": w}, lazy=True)
        assert np.array_equal(c.load(step + 1)["w"], w)


def test_lazy_save_lets_go_of_the_state_once_copied(cluster, job):
    """After wait_copied() the client holds nothing of the state (buffers, host copies), although
    it keeps the save itself until the next one (for its commit)."""
    c = cluster.client(job)
    b = bytearray(b"x" * 4096)
    c.save(1, {"b": b}, lazy=True)
    c.wait_copied()
    b.extend(b"more")  # BufferError while anything still holds a view of it
    c.wait(1, "staged", timeout=30)
    assert bytes(c.load(1)["b"]) == b"x" * 4096


def test_lazy_save_errors_are_raised_by_the_waits_once(cluster, job):
    c = cluster.client(job)
    too_big = np.zeros((CLUSTER_MEMORY_MIB + 40) << 20, np.uint8)  # more than the whole tier
    lazy = c.save(1, {"x": too_big}, lazy=True)  # returns: the lease is asked for in the background
    with pytest.raises(ckpt.ResourceExhaustedError):
        c.wait_copied()
    c.wait_copied()  # said once
    with pytest.raises(ckpt.ResourceExhaustedError):
        lazy.result()
    with pytest.raises(ckpt.ResourceExhaustedError):
        lazy.wait_copied()
    with pytest.raises(ckpt.InvalidArgumentError):
        c.save(ckpt.MAX_STEP + 1, {"x": b"1"}, lazy=True)
    # A wait through a wait point raises it too, once.
    c.save(3, {"x": too_big}, lazy=True, wait_points=["x"])
    with pytest.raises(ckpt.ResourceExhaustedError):
        c.wait_copied(through="x")
    c.wait_copied(through="x")
    c.save(2, {"x": b"ok"}, lazy=True).wait("staged", timeout=30)


def test_recommended_interval_is_young_daly(cluster, job):
    c = cluster.client(job)
    with pytest.raises(ckpt.FailedPreconditionError):
        c.recommended_interval(0.1)  # no save measured yet
    c.save(1, {"w": np.ones(1 << 20, np.float32)}).wait("staged", timeout=30)
    c.save(2, {"w": np.ones(1 << 20, np.float32)}, lazy=True).wait("staged", timeout=30)
    a = c.recommended_interval(0.01)
    assert a["checkpoint_cost_s"] > 0 and a["mtbf_s"] > 0 and a["job_nodes"] >= 1
    # Young's formula (checked against known values in the next test) of the
    # cost and MTBF the advice reports.
    young = ckpt._ckpt.young_daly_interval(a["checkpoint_cost_s"], a["mtbf_s"], 0.01)
    assert abs(a["interval_s"] - young["interval_s"]) < 1e-6
    assert a["steps"] == young["steps"]
    assert "Young/Daly" in a["explanation"]
    with pytest.raises(ckpt.InvalidArgumentError):
        c.recommended_interval(0)


def test_young_daly_interval_known_values():
    """sqrt(2 x C x M) against values worked out by hand, not from what the code returned."""
    yd = ckpt._ckpt.young_daly_interval
    a = yd(10, 3600, 1)  # C = 10 s, M = 1 h: sqrt(72000) = 268.3282 s
    assert abs(a["interval_s"] - 268.3282) < 1e-4 and a["steps"] == 268
    assert yd(10, 3600, 0.5)["steps"] == 537  # 536.66 steps of 0.5 s
    a = yd(8, 3600, 0.25)  # sqrt(57600) = 240 s exactly
    assert abs(a["interval_s"] - 240.0) < 1e-9 and a["steps"] == 960
    assert yd(8, 3600, 1000)["steps"] == 1  # a step longer than the interval: at least 1
    with pytest.raises(ValueError):
        yd(10, 3600, 0)


def test_example_trainer_every_auto_saves_at_the_intervals_it_prints(cluster, job):
    import json
    import os
    import subprocess
    import sys
    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(BUILD_DIR / "python"), env.get("PYTHONPATH", "")])
    port = free_ports(1)[0]
    r = subprocess.run([sys.executable, str(example), "--meta", cluster.meta, "--agent-socket", str(cluster.socket),
                        "--job", job, "--rank", "0", "--world-size", "1", "--dist-port", str(port),
                        "--steps", "12", "--every", "auto", "--protection", "none"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    saves = [e["step"] for e in events if e["event"] == "save"]
    intervals = [e for e in events if e["event"] == "interval"]
    assert saves[0] == 1 and len(intervals) == len(saves)
    for i, e in enumerate(intervals):
        assert e["steps"] >= 1 and e["next_save"] == e["step"] + e["steps"]
        assert "Young/Daly" in e["why"]
        if i + 1 < len(saves):
            assert saves[i + 1] == e["next_save"]
    assert events[-1]["event"] == "done"


def test_example_trainer_lazy_crash_and_resume_ends_where_an_uninterrupted_run_does(cluster, job):
    """train_gpt.py --lazy: the copies overlap the next steps, and a run that crashes right
    after a lazy save and resumes from it ends in the very state of a run without saves."""
    import json
    import os
    import subprocess
    import sys
    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(BUILD_DIR / "python"), env.get("PYTHONPATH", "")])

    def run(job_id, *extra):
        r = subprocess.run([sys.executable, str(example), "--meta", cluster.meta, "--agent-socket",
                            str(cluster.socket), "--job", job_id, "--rank", "0", "--world-size", "1",
                            "--dist-port", str(free_ports(1)[0]), "--steps", "8", "--protection", "none", *extra],
                           capture_output=True, text=True, timeout=300, env=env)
        return r, [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]

    r, plain = run(job + "-plain", "--every", "100")
    assert r.returncode == 0, r.stderr
    r, crashed = run(job, "--every", "2", "--lazy", "--crash-at", "4")
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert [e["step"] for e in crashed if e["event"] == "save"] == [2, 4]
    assert all(e["lazy"] for e in crashed if e["event"] == "save")
    r, resumed = run(job, "--every", "2", "--lazy", "--resume")
    assert r.returncode == 0, r.stderr
    assert [e["step"] for e in resumed if e["event"] == "resume"] == [4]
    assert [e["step"] for e in resumed if e["event"] == "save"] == [6, 8]
    assert resumed[-1]["event"] == "done" and plain[-1]["event"] == "done"
    assert resumed[-1]["final_sha256"] == plain[-1]["final_sha256"]


def test_example_trainer_tensor_parallel_zero_resumes_into_other_splits(cluster2, job, tmp_path):
    """train_gpt.py --tp 2 --zero on 4 ranks (tensor parallel 2 x data parallel 2, ZeRO-1
    AdamW state), sharded saves; the run is SIGKILLed after its step-10 save. Resumed in the
    same split it ends where an uninterrupted run does, bit for bit; resumed at tp=1 x dp=2
    with ZeRO (the same data-parallel ranks) its losses follow the uninterrupted run's (only
    the order of the tensor-parallel sums differs); resumed at tp=2 x dp=1 without ZeRO its
    first loss, on the restored weights and data-parallel rank 0's batch, is the
    uninterrupted run's."""
    import json
    import os
    import subprocess
    import sys
    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(BUILD_DIR / "python"), env.get("PYTHONPATH", "")])

    runs = iter(range(100))

    def run(job_id, world, *extra, steps=14):
        """[(exit status, events, stderr, {step: loss})] of each rank."""
        port = free_ports(1)[0]
        logs = tmp_path / f"run{next(runs)}"
        logs.mkdir()
        procs = [subprocess.Popen([sys.executable, str(example), "--meta", cluster2.meta,
                                   "--agent-socket", str(cluster2.sockets[r % 2]), "--job", job_id,
                                   "--rank", str(r), "--world-size", str(world), "--dist-port", str(port),
                                   "--steps", str(steps), "--every", "5", "--protection", "replicate:2",
                                   "--log", str(logs / f"loss-{r}.jsonl"), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for r in range(world)]
        out = []
        try:
            for p in procs:
                o, e = p.communicate(timeout=300)
                events = [json.loads(line) for line in o.splitlines() if line.startswith("{")]
                out.append((p.returncode, events, e))
            for r in range(world):
                path = logs / f"loss-{r}.jsonl"
                lines = path.read_text().splitlines() if path.exists() else []
                out[r] += ({d["step"]: d["loss"] for d in map(json.loads, lines)},)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return out

    whole = run(job + "-whole", 4, "--tp", "2", "--zero")
    for rc, events, err, _ in whole:
        assert rc == 0, err
    crashed = run(job, 4, "--tp", "2", "--zero", "--crash-at", "10")
    for rc, events, err, _ in crashed:
        assert rc == -signal.SIGKILL, err
        assert [e["step"] for e in events if e["event"] == "save"] == [5, 10]

    same = run(job, 4, "--tp", "2", "--zero", "--resume")
    for r, ((rc, events, err, loss), (_, ref, _, ref_loss)) in enumerate(zip(same, whole)):
        assert rc == 0, err
        assert [e["step"] for e in events if e["event"] == "resume"] == [10]
        assert events[-1]["final_sha256"] == ref[-1]["final_sha256"], f"rank {r}"
        assert {s: v for s, v in ref_loss.items() if s > 10} == loss, f"rank {r}"

    # tp=1 x dp=2 with ZeRO: rank r is data-parallel rank r, as ranks 2r and 2r+1 were.
    narrow = run(job, 2, "--tp", "1", "--zero", "--resume")
    for r, (rc, events, err, loss) in enumerate(narrow):
        assert rc == 0, err
        resumed = [e for e in events if e["event"] == "resume"]
        assert [e["step"] for e in resumed] == [10]
        assert resumed[0]["saved_layout"] == {"tp": 2, "dp": 2, "zero": True}
        ref = whole[2 * r][3]
        assert sorted(loss) == [11, 12, 13, 14]
        for s, v in loss.items():
            assert abs(v - ref[s]) <= 1e-4 * abs(ref[s]), (r, s, v, ref[s])
    print(f"\nresumed at tp=1 x dp=2: losses {narrow[0][3]}; uninterrupted at tp=2 x dp=2: "
          f"{ {s: v for s, v in whole[0][3].items() if s > 10} }")

    # tp=2 x dp=1 without ZeRO: both ranks draw data-parallel rank 0's batches.
    wide = run(job, 2, "--tp", "2", "--resume", steps=11)
    for rc, events, err, loss in wide:
        assert rc == 0, err
        assert [e["step"] for e in events if e["event"] == "resume"] == [10]
        assert abs(loss[11] - whole[0][3][11]) <= 1e-5 * abs(loss[11]), (loss[11], whole[0][3][11])


def test_pause_holds_protection_back_and_resume_finishes_it(cluster2, job):
    c = cluster2.client(job, protection="replicate:2")
    w = np.arange(1 << 20, dtype=np.float32)
    c.save(1, {"w": w}).wait("protected", timeout=60)
    sent = cluster2.metric(0, "ckpt_agent_peer_sent_bytes_total")
    paused_s = cluster2.metric(0, "ckpt_agent_protection_paused_seconds_total")
    assert c.pause_protection(30) > 25
    assert cluster2.metric(0, "ckpt_agent_protection_paused") == 1
    h = c.save(2, {"w": w + 1})
    h.wait("staged", timeout=30)
    with pytest.raises(ckpt.DeadlineExceededError):
        h.wait("protected", timeout=1.5)  # the replica push waits for the pause
    assert cluster2.metric(0, "ckpt_agent_peer_sent_bytes_total") == sent
    c.resume_protection()
    h.wait("protected", timeout=60)
    assert cluster2.metric(0, "ckpt_agent_peer_sent_bytes_total") >= sent + w.nbytes
    assert cluster2.metric(0, "ckpt_agent_protection_paused") == 0
    assert cluster2.metric(0, "ckpt_agent_protection_paused_seconds_total") >= paused_s + 1.5
    with c.protection_paused(5):
        assert cluster2.metric(0, "ckpt_agent_protection_paused") == 1
    assert cluster2.metric(0, "ckpt_agent_protection_paused") == 0
    with pytest.raises(ckpt.InvalidArgumentError):
        c.pause_protection(61)
