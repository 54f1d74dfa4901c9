"""Another layout (issue 38): a model saved by 4 ranks at (tp=2, dp=2) with each piece stored
once, one node killed, and the job relaunched at (tp=2, dp=1) on 2 ranks, (tp=1, dp=3) and
(tp=3, dp=1) on 3: every global parameter and AdamW tensor gathered after the restore equals,
bit for bit, the one gathered before the save, and a further training step equals that of a
run that was never interrupted. And the errors of a slice load: nothing half-written."""
import gc

import numpy as np
import pytest
import torch

import ckpt
import ckpt.torch
from ckpt.torch import Layout, load_sharded, save_sharded
from conftest import _running

# The global model: name -> shape, and how tensor parallelism splits it.
GLOBAL = {"fc1.weight": [10, 6], "fc1.bias": [10], "fc2.weight": [5, 10], "fc2.bias": [5], "norm.weight": [6]}
SPLIT = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}  # column-, then row-parallel; the rest replicated
STEP = 10


def init(name):
    return np.random.default_rng(sorted(GLOBAL).index(name)).standard_normal(GLOBAL[name]).astype(np.float32)


def grad(name, step):
    rng = np.random.default_rng(1000 * step + sorted(GLOBAL).index(name))
    return rng.standard_normal(GLOBAL[name]).astype(np.float32)


def part(a, offsets, lengths):
    return a[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]


def layout(rank, tp, dp):
    return Layout(tp=(rank % tp, tp), dp=(rank // tp, dp), split=SPLIT, shapes=GLOBAL)


def build(lay, values=init):
    """This rank's module (its slices of the global tensors) and AdamW."""
    m = torch.nn.Module()
    for name, shape in GLOBAL.items():
        mod, attr = name.split(".")
        if not hasattr(m, mod):
            m.add_module(mod, torch.nn.Module())
        offsets, lengths = lay.box(name, shape)
        data = part(values(name), offsets, lengths).copy() if values else np.zeros(lengths, np.float32)
        getattr(m, mod).register_parameter(attr, torch.nn.Parameter(torch.from_numpy(data)))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def train(m, opt, lay, step):
    """One step with the global gradient of `step` (AdamW is elementwise: every layout
    computes the same global result)."""
    for name, p in m.named_parameters():
        p.grad = torch.from_numpy(part(grad(name, step), *lay.box(name, GLOBAL[name])).copy())
    opt.step()


def gather(ranks):
    """{global name: array} assembled from every rank's (layout, model, optimizer)."""
    out = {}
    for lay, m, opt in ranks:
        state = opt.state_dict()["state"]
        for i, (name, p) in enumerate(m.named_parameters()):
            pieces = {f"model/{name}": p.detach().numpy()}
            for key, v in state.get(i, {}).items():
                pieces[f"optimizer/{name}/{key}"] = v.numpy()
            for gname, local in pieces.items():
                shape = GLOBAL[name] if local.shape == p.shape else list(local.shape)
                offsets, lengths = lay.box(name, GLOBAL[name]) if local.shape == p.shape else ([0] * len(shape), shape)
                whole = out.setdefault(gname, np.full(shape, np.nan, local.dtype))
                whole[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))] = local
    return out


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k  # bit for bit


@pytest.fixture(scope="module")
def cluster4(tmp_path_factory, tls):
    """Meta and four agents (one of them is killed by the test)."""
    yield from _running(tmp_path_factory, tls, "ckpt4", agents=4, memory="64MiB")


def zero_build(lay, values=init):
    """This rank's module and, ZeRO-style, an AdamW over one flat parameter: its part
    (Layout.zero_range) of the module's parameters, flattened and concatenated."""
    m, _ = build(lay, values)
    start, stop = lay.zero_range(m)
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])[start:stop].clone()
    return m, torch.optim.AdamW([torch.nn.Parameter(flat)], lr=1e-2, weight_decay=0.1)


def zero_train(ranks, step):
    """One ZeRO step of every rank: each steps its part of the flat vector with its part of
    the global gradient, then each tensor-parallel group gathers the parts (all-gather)
    into every member's parameters."""
    for lay, m, opt in ranks:
        start, stop = lay.zero_range(m)
        g = torch.cat([torch.from_numpy(part(grad(n, step), *lay.box(n, GLOBAL[n])).copy()).reshape(-1)
                       for n, _ in m.named_parameters()])
        opt.param_groups[0]["params"][0].grad = g[start:stop].clone()
        opt.step()
    for tp_rank in {lay.tp_rank for lay, _, _ in ranks}:
        group = sorted((r for r in ranks if r[0].tp_rank == tp_rank), key=lambda r: r[0].dp_rank)
        full = torch.cat([opt.param_groups[0]["params"][0].detach() for _, _, opt in group])
        for _, m, _ in group:
            at = 0
            for p in m.parameters():
                p.data.copy_(full[at:at + p.numel()].view(p.shape))
                at += p.numel()


def zero_gather(ranks):
    """gather() of ranks whose optimizer state is ZeRO's flat part."""
    out = {}
    for lay, m, opt in ranks:
        start, stop = lay.zero_range(m)
        state = opt.state_dict()["state"].get(0, {})
        at = 0
        for name, p in m.named_parameters():
            n = p.numel()
            pieces = {f"model/{name}": p.detach().numpy()}
            for key, v in state.items():
                if v.dim() == 0:
                    out[f"optimizer/{name}/{key}"] = v.numpy().copy()  # a scalar: every rank's is the same
                    continue
                local = np.full(n, np.nan, np.float32)
                lo, hi = max(start, at), min(stop, at + n)
                if lo < hi:
                    local[lo - at:hi - at] = v.numpy()[lo - start:hi - start]
                pieces[f"optimizer/{name}/{key}"] = local.reshape(p.shape)
            at += n
            offsets, lengths = lay.box(name, GLOBAL[name])
            for gname, local in pieces.items():
                whole = out.setdefault(gname, np.full(GLOBAL[name], np.nan, np.float32))
                region = whole[tuple(slice(o, o + k) for o, k in zip(offsets, lengths))]
                known = ~np.isnan(local)
                region[known] = local[known]
    return out


def test_flat_boxes_cover_exactly_the_range_in_order():
    from ckpt.torch import _flat_boxes
    rng = np.random.default_rng(5)
    for shape in ([], [7], [3, 4], [2, 3, 5], [4, 1, 3, 2], [3, 0, 2], [1, 1, 6]):
        n = int(np.prod(shape)) if shape else 1
        for lo in range(n + 1):
            for hi in sorted({lo, n, *rng.integers(lo, n + 1, 3).tolist()}):
                seen = []
                for offsets, lengths in _flat_boxes(shape, lo, hi):
                    idx = np.arange(n).reshape(shape) if shape else np.arange(1).reshape(())
                    seen += idx[tuple(slice(o, o + k) for o, k in zip(offsets, lengths))].reshape(-1).tolist()
                assert seen == list(range(lo, hi)), (shape, lo, hi, _flat_boxes(shape, lo, hi))


def test_zero_sharded_optimizer_state_restores_into_other_layouts_and_back(cluster4, job):
    """ZeRO-1/2: each data-parallel rank holds and saves only its part of the flat optimizer
    state; restored bit for bit at another (tp, dp) with ZeRO and without, and a plain
    save restores into a ZeRO layout; training goes on equal to an uninterrupted run."""
    ref_lay = Layout(split=SPLIT, shapes=GLOBAL)
    ref = build(ref_lay)
    for s in (1, 2):
        train(*ref, ref_lay, s)
    expected = gather([(ref_lay, *ref)])

    def zlayout(rank, tp, dp, zero=True):
        return Layout(tp=(rank % tp, tp), dp=(rank // tp, dp), split=SPLIT, shapes=GLOBAL, zero=zero)

    clients = [cluster4.client(job, rank=r, world_size=4, agent=r, protection="replicate:2") for r in range(4)]
    ranks = [(zlayout(r, 2, 2), *zero_build(zlayout(r, 2, 2))) for r in range(4)]
    for s in (1, 2):
        zero_train(ranks, s)
    assert_same(zero_gather(ranks), expected)  # ZeRO training is the whole model's
    for h in [save_sharded(c, STEP, m, opt, lay, extra={"epoch": 3}) for c, (lay, m, opt) in zip(clients, ranks)]:
        h.wait("protected", timeout=60)
    # Each element of an optimizer tensor is stored once, by the rank whose part holds it.
    index = clients[0].global_tensors(STEP)
    for name, shape in GLOBAL.items():
        for key in ("exp_avg", "exp_avg_sq"):
            pieces = index[f"optimizer/{name}/{key}"][2]
            assert sum(int(np.prod(p[3])) for p in pieces) == int(np.prod(shape)), (name, key, pieces)
    print(f"\nfc1.weight's exp_avg as saved by 4 ZeRO ranks: {index['optimizer/fc1.weight/exp_avg'][2]}")

    for tp, dp, zero in ((1, 3, True), (2, 1, False), (3, 1, True)):
        world = tp * dp
        new = []
        for r in range(world):
            c = cluster4.client(job, rank=r, world_size=world, agent=r, resize_world=True)
            lay = zlayout(r, tp, dp, zero)
            m, opt = (zero_build if zero else build)(lay, values=None)
            assert load_sharded(c, STEP, m, opt, lay) == {"epoch": 3}
            new.append((lay, m, opt))
        assert_same((zero_gather if zero else gather)(new), expected)
        # Training goes on: the next step equals the uninterrupted run's.
        if zero:
            zero_train(new, 3)
        else:
            for lay, m, opt in new:
                train(m, opt, lay, 3)
        again = build(ref_lay)
        for s in (1, 2, 3):
            train(*again, ref_lay, s)
        assert_same((zero_gather if zero else gather)(new), gather([(ref_lay, *again)]))

    # A plain save (tp=2, dp=1) restores into a ZeRO layout (tp=1, dp=2).
    plain = []
    for r in range(2):
        lay = zlayout(r, 2, 1, zero=False)
        m, opt = build(lay)
        for s in (1, 2):
            train(m, opt, lay, s)
        plain.append((lay, m, opt))
    clients = [cluster4.client(job, rank=r, world_size=2, agent=r, resize_world=True) for r in range(2)]
    for h in [save_sharded(c, STEP + 1, m, opt, lay) for c, (lay, m, opt) in zip(clients, plain)]:
        h.wait("staged", timeout=60)
    new = []
    for r in range(2):
        lay = zlayout(r, 1, 2)
        m, opt = zero_build(lay, values=None)
        load_sharded(clients[r], STEP + 1, m, opt, lay)
        new.append((lay, m, opt))
    assert_same(zero_gather(new), expected)
    # A ZeRO layout whose optimizer is not over its flat part is refused, naming both.
    lay = zlayout(0, 1, 2)
    m, opt = build(lay)
    with pytest.raises(ckpt.InvalidArgumentError, match="one flat parameter of 66 elements"):
        save_sharded(clients[0], STEP + 2, m, opt, lay)
    del clients, new, plain, ranks
    gc.collect()


def test_saved_at_tp2_dp2_restores_into_other_layouts_after_a_node_is_lost(cluster4, job):
    # An uninterrupted run on the whole model: what every layout must match.
    ref_lay = Layout(split=SPLIT, shapes=GLOBAL)
    ref = build(ref_lay)
    for s in (1, 2):
        train(*ref, ref_lay, s)
    expected = gather([(ref_lay, *ref)])

    # Four ranks at (tp=2, dp=2), one per node, each piece stored once.
    ranks = []
    clients = []
    for r in range(4):
        clients.append(cluster4.client(job, rank=r, world_size=4, agent=r, protection="replicate:2"))
        lay = layout(r, 2, 2)
        m, opt = build(lay)
        for s in (1, 2):
            train(m, opt, lay, s)
        ranks.append((lay, m, opt))
    before = gather(ranks)
    assert_same(before, expected)  # the split training is the whole model's
    handles = [save_sharded(c, STEP, m, opt, lay, extra={"epoch": 3}) for c, (lay, m, opt) in zip(clients, ranks)]
    for h in handles:
        h.wait("protected", timeout=60)

    # Stored once: a tensor-parallel piece by one of its two data-parallel holders, a
    # replicated tensor by one rank of four; the work spread over every rank.
    index = clients[0].global_tensors(STEP)
    for gname, (dtype, shape, pieces) in index.items():
        name = gname.split("/")[1] if "/" in gname else gname
        assert len(pieces) == (2 if name in SPLIT and gname != f"optimizer/{name}/step" else 1), (gname, pieces)
    stored = {r: 0 for r in range(4)}
    for gname, (dtype, shape, pieces) in index.items():
        for r, item, offsets, lengths in pieces:
            stored[r] += int(np.prod(lengths)) * (1 if gname in ("optimizer/param_groups", "extra") else 4)
    total = sum(int(np.prod(a.shape)) * 4 for a in expected.values())
    assert sum(stored.values()) == total + sum(int(np.prod(index[g][1])) for g in ("optimizer/param_groups", "extra"))
    assert all(stored[r] > 0 for r in range(4)), stored  # rank 3's pieces are on the node killed below
    without = sum(int(np.prod(a.shape)) * 4 * (2 if n.split("/")[1] in SPLIT and not n.endswith("/step") else 4)
                  for n, a in expected.items())
    print(f"\nbytes stored per rank with dedup: {stored}; {sum(stored.values())} in all, "
          f"{without} without (each data-parallel rank its own copy)")

    # The node of rank 3 dies; the job goes on at other sizes.
    cluster4.procs[4].kill()
    cluster4.procs[4].wait(timeout=30)
    del clients, handles
    gc.collect()

    for tp, dp in ((2, 1), (1, 3), (3, 1)):
        world = tp * dp
        new = []
        for r in range(world):
            c = cluster4.client(job, rank=r, world_size=world, agent=r, resize_world=True)
            lay = layout(r, tp, dp)
            m, opt = build(lay, values=None)
            assert load_sharded(c, STEP, m, opt, lay) == {"epoch": 3}
            new.append((c, lay, m, opt))
        assert_same(gather([(lay, m, opt) for _, lay, m, opt in new]), before)
        # Training goes on: the next step equals the uninterrupted run's.
        for _, lay, m, opt in new:
            train(m, opt, lay, 3)
        again = build(ref_lay)
        for s in (1, 2, 3):
            train(*again, ref_lay, s)
        assert_same(gather([(lay, m, opt) for _, lay, m, opt in new]), gather([(ref_lay, *again)]))
        del new
        gc.collect()


def test_a_slice_of_another_nodes_shard_reads_only_its_bytes(cluster2, job):
    """A shard held only on another node is not pulled whole: its holder sends just the byte
    ranges the slice needs (its whole copy checked against the shard's crc32c first), and
    the loading node keeps no copy of it."""
    w = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)  # 256 KiB, rows split in two
    pad = np.arange(1 << 20, dtype=np.uint8)  # rank 0's shard is mostly other bytes
    c0 = cluster2.client(job, rank=0, world_size=2, agent=0, protection="none")
    c1 = cluster2.client(job, rank=1, world_size=2, agent=1, protection="none")
    h0 = c0.save(1, {"w": ckpt.GlobalSlice(w[:32], "w", [64, 1024], [0, 0]), "pad": pad})
    h1 = c1.save(1, {"w": ckpt.GlobalSlice(w[32:], "w", [64, 1024], [32, 0])})
    h0.wait("protected", timeout=60)
    h1.wait("protected", timeout=60)
    sent = cluster2.metric(0, "ckpt_agent_peer_sent_bytes_total")
    held = cluster2.metric(1, "ckpt_agent_holdings")
    out = np.zeros((3, 1000), np.float32)
    c1.load_slices(1, [("w", [10, 5], [3, 1000], out)])
    assert out.tobytes() == w[10:13, 5:1005].tobytes()
    # Rows 10..12, from the first element wanted to the last: 2 rows and 1000 elements.
    assert cluster2.metric(0, "ckpt_agent_peer_sent_bytes_total") - sent == (2 * 1024 + 1000) * 4
    # Across both shards: rank 0's part (rows 30..31) from node 0, rank 1's from its own copy.
    out = np.zeros((6, 1024), np.float32)
    sent = cluster2.metric(0, "ckpt_agent_peer_sent_bytes_total")
    c1.load_slices(1, [("w", [30, 0], [6, 1024], out)])
    assert out.tobytes() == w[30:36].tobytes()
    assert cluster2.metric(0, "ckpt_agent_peer_sent_bytes_total") - sent == 2 * 1024 * 4
    # Node 1 kept no copy of rank 0's shard (a whole-shard restore would have).
    assert cluster2.metric(1, "ckpt_agent_holdings") == held
    del c0, c1


def test_slice_errors_leave_the_target_untouched(cluster, job):
    c = cluster.client(job)
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    half = np.arange(5, dtype=np.float32)
    c.save(1, {"w": ckpt.GlobalSlice(w, "w", [3, 4]),
               "h": ckpt.GlobalSlice(half, "half", [10], [5])}).wait("staged", timeout=30)
    index = c.global_tensors(1)
    assert index["w"][1] == [3, 4] and index["half"][2] == [(0, "h", [5], [5])]

    # Odd slices read right.
    out = np.zeros((2, 3), np.float32)
    c.load_slices(1, [("w", [1, 1], [2, 3], out)])
    assert out.tobytes() == w[1:3, 1:4].tobytes()
    got = torch.zeros(3)
    c.load_slices(1, [("half", [6], [3], got)])
    assert got.numpy().tobytes() == half[1:4].tobytes()

    def untouched(target, slices, error, words):
        target[...] = -7
        with pytest.raises(error) as e:
            c.load_slices(1, slices)
        assert words in str(e.value), str(e.value)
        assert (target == -7).all()

    t = np.zeros((2, 3), np.float32)
    ok = ("w", [0, 0], [2, 3], t)
    untouched(t, [ok, ("nope", [0], [1], np.zeros(1, np.float32))], ckpt.NotFoundError, "no global tensor")
    untouched(t, [ok, ("w", [2, 0], [2, 4], np.zeros((2, 4), np.float32))], ckpt.InvalidArgumentError, "outside")
    untouched(t, [ok, ("w", [0, 0], [1, 4], np.zeros(3, np.float32))], ckpt.InvalidArgumentError, "destination")
    untouched(t, [ok, ("w", [0], [1], np.zeros(1, np.float32))], ckpt.InvalidArgumentError, "dimensions")
    untouched(t, [ok, ("half", [3], [4], np.zeros(4, np.float32))], ckpt.DataLossError, "in no rank's shard")

    # A slice outside its global tensor is refused at save.
    with pytest.raises(ckpt.InvalidArgumentError, match="outside the global tensor"):
        c.save(2, {"bad": ckpt.GlobalSlice(w, "w", [3, 4], [1, 0])})
    with pytest.raises(ckpt.InvalidArgumentError, match="must hold a tensor"):
        c.save(2, {"bad": ckpt.GlobalSlice(b"xyz", "x", [3])})
    lay = layout(0, 1, 1)
    m, opt = build(lay)
    with pytest.raises(ckpt.InvalidArgumentError, match="extra must be JSON-able"):
        save_sharded(c, 2, m, opt, lay, extra={"x": object()})


def test_a_job_opened_with_another_world_size_is_refused_unless_resized(cluster, job):
    c = cluster.client(job, world_size=2)
    with pytest.raises(ckpt.FailedPreconditionError, match="world_size"):
        cluster.client(job, world_size=1)
    resized = cluster.client(job, world_size=1, resize_world=True)
    resized.save(1, {"x": np.ones(3, np.float32)}).wait("staged", timeout=30)
    del c


def test_offline_reshard_from_the_durable_tier_reads_only_what_overlaps(cluster, job):
    # Two ranks at tp=2 (both on the one agent), flushed; then resharded with no daemon.
    ranks = []
    clients = [cluster.client(job, rank=r, world_size=2, flush_every=1) for r in range(2)]
    for r, c in enumerate(clients):
        lay = layout(r, 2, 1)
        m, opt = build(lay)
        train(m, opt, lay, 1)
        ranks.append((lay, m, opt))
    handles = [save_sharded(c, STEP, m, opt, lay) for c, (lay, m, opt) in zip(clients, ranks)]
    for h in handles:
        h.wait("persisted", timeout=60)
    before = gather(ranks)
    path = cluster.durable_root / job / str(STEP)
    for tp in (1, 3):
        assert_same(gather(load_dir(path, tp)), before)
    # Only the items a slice overlaps are read: rows 0..4 of fc1.weight are rank 0's.
    v = ckpt.DurableVersion(path)
    out = np.zeros((5, 6), np.float32)
    v.load_slices(STEP, [("model/fc1.weight", [0, 0], [5, 6], out)])
    assert out.tobytes() == before["model/fc1.weight"][:5].tobytes()
    assert v.bytes_read == 5 * 6 * 4
    with pytest.raises(ckpt.InvalidArgumentError, match="not 9"):
        v.load_slices(9, [])
    # ckptctl writes the version resharded for 3 ranks: a version directory of its own,
    # whose rank r file holds exactly rank r's part (and reshards again).
    out_dir = cluster.root / f"{job}-tp3"
    splits = [f"{kind}{name}{key}={dim}" for name, dim in SPLIT.items()
              for kind, key in (("model/", ""), ("optimizer/", "/exp_avg"), ("optimizer/", "/exp_avg_sq"))]
    r = cluster.ctl("restore", "--from-dir", str(path), "--out", str(out_dir), "--world-size", "3",
                    *[a for sp in splits for a in ("--split", sp)])
    assert r.returncode == 0, r.stderr
    assert "from 2 to 3 ranks" in r.stdout and "items of no global tensor left out" in r.stdout, r.stdout
    assert_same(gather(load_dir(out_dir, 3)), before)
    pieces = ckpt.DurableVersion(out_dir).global_tensors()["model/fc1.weight"][2]
    assert [(p[0], p[2], p[3]) for p in pieces] == [(0, [0, 0], [4, 6]), (1, [4, 0], [3, 6]), (2, [7, 0], [3, 6])]
    bad = cluster.ctl("restore", "--from-dir", str(path), "--out", str(out_dir), "--world-size", "3",
                      "--split", "model/nope=0")
    assert bad.returncode == 2 and "no global tensor" in bad.stderr, bad.stderr
    bad = cluster.ctl("restore", "--from-dir", str(path), "--out", str(out_dir), "--world-size", "3",
                      "--split", "model/fc1.bias=1")
    assert bad.returncode == 2 and "dimensions" in bad.stderr, bad.stderr
    # A world size beyond a job's limit would write millions of rank files.
    for world in ("0", str((1 << 20) + 1)):
        bad = cluster.ctl("restore", "--from-dir", str(path), "--out", str(cluster.root / f"{job}-huge"),
                          "--world-size", world)
        assert bad.returncode == 2 and "1..1048576" in bad.stderr, bad.stderr
        assert not (cluster.root / f"{job}-huge").exists()
    # A corrupt byte is DATA_LOSS, and nothing is written.
    index = v.global_tensors()
    rank, item, _, _ = index["model/fc1.weight"][2][0]
    offset = next(o for name, _, _, _, o in _items_with_offsets(path, rank) if name == item)
    f = path / f"rank-{rank:05d}.bin"
    data = bytearray(f.read_bytes())
    data[offset] ^= 0x40
    f.write_bytes(bytes(data))
    out[...] = -7
    with pytest.raises(ckpt.DataLossError, match="fails its checksum"):
        ckpt.DurableVersion(path).load_slices(None, [("model/fc1.weight", [0, 0], [5, 6], out)])
    assert (out == -7).all()


def test_ckptctl_reshards_a_version_from_memory(cluster, job):
    """`ckptctl restore JOB STEP --out DIR --world-size W --split ...`: a version still only in
    the agents' memory (never flushed) written as a version directory of W ranks."""
    import json
    ranks = []
    clients = [cluster.client(job, rank=r, world_size=2) for r in range(2)]
    for r, c in enumerate(clients):
        lay = layout(r, 2, 1)
        m, opt = build(lay)
        train(m, opt, lay, 1)
        ranks.append((lay, m, opt))
    for h in [save_sharded(c, STEP, m, opt, lay) for c, (lay, m, opt) in zip(clients, ranks)]:
        h.wait("staged", timeout=60)
    before = gather(ranks)
    out_dir = cluster.root / f"{job}-mem-tp3"
    splits = [f"{kind}{name}{key}={dim}" for name, dim in SPLIT.items()
              for kind, key in (("model/", ""), ("optimizer/", "/exp_avg"), ("optimizer/", "/exp_avg_sq"))]
    r = cluster.ctl("--json", "restore", job, str(STEP), "--out", str(out_dir), "--world-size", "3",
                    *[a for sp in splits for a in ("--split", sp)])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # one document: the resharded version's
    assert doc["world_size"] == 3 and doc["from_world_size"] == 2 and doc["committed"], doc
    assert [p.name for p in out_dir.iterdir() if p.name.startswith(".")] == []  # the staging copy is gone
    assert_same(gather(load_dir(out_dir, 3)), before)
    bad = cluster.ctl("restore", job, str(STEP), "--out", str(out_dir), "--world-size", "3", "--rank", "1")
    assert bad.returncode == 2 and "--rank does not go with it" in bad.stderr, bad.stderr
    bad = cluster.ctl("restore", job, "999", "--out", str(cluster.root / f"{job}-none"), "--world-size", "3")
    assert bad.returncode != 0 and not any((cluster.root / f"{job}-none").glob(".reshard-source-*")), bad.stderr


def load_dir(path, tp):
    """Each of `tp` tensor-parallel ranks' (layout, model, optimizer) loaded from the version
    directory at `path`."""
    ranks = []
    for rank in range(tp):
        lay = layout(rank, tp, 1)
        m, opt = build(lay, values=None)
        load_sharded(ckpt.DurableVersion(path), None, m, opt, lay)
        ranks.append((lay, m, opt))
    return ranks


def _items_with_offsets(path, rank):
    import json
    doc = json.loads((path / "manifest.json").read_text())
    return [(it["name"], it["dtype"], it["shape"], it["length_bytes"], it["offset_bytes"])
            for it in doc["shards"][rank]["items"]]


def test_a_checkpointer_with_a_layout_resumes_on_another_world_size(cluster, job):
    from ckpt.torch import Checkpointer
    # Two ranks at tp=2 train and save at step 2 (lazily); the job comes back as one rank.
    cks = []
    for r in range(2):
        lay = layout(r, 2, 1)
        m, opt = build(lay)
        ck = Checkpointer(m, opt, every=2, layout=lay, extra={"epoch": 1},
                          client=cluster.client(job, rank=r, world_size=2, resize_world=True))
        assert ck.resume() == 0
        cks.append((ck, lay, m, opt))
    for s in (1, 2):
        for ck, lay, m, opt in cks:
            train(m, opt, lay, s)
            ck.step(s)
    for ck, *_ in cks:
        ck.close()
    before = gather([(lay, m, opt) for _, lay, m, opt in cks])
    del cks
    gc.collect()

    lay = layout(0, 1, 1)
    m, opt = build(lay, values=None)
    ck = Checkpointer(m, opt, every=2, layout=lay, client=cluster.client(job, world_size=1, resize_world=True))
    assert ck.resume() == 2
    assert ck.extra == {"epoch": 1}
    assert_same(gather([(lay, m, opt)]), before)
    # And goes on saving at the new size.
    train(m, opt, lay, 3)
    ck.step(3)
    train(m, opt, lay, 4)
    assert ck.step(4) is not None
    ck.close()
