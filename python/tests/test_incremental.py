"""Incremental and partial saves through the Python client against real daemons
(docs/python.md "Incremental saves"): unchanged items become references to the
previous save's bytes, partial saves carry the rest over, loads give the dense
state with each item's step, and retention keeps what is referred to."""
import json

import numpy as np
import pytest

import ckpt


def _state(seed, frozen):
    rng = np.random.default_rng(seed)
    return {"frozen": frozen, "w": rng.standard_normal(4096).astype(np.float32),
            "moment": np.full(1024, 3.0, np.float32), "step": seed}


def test_incremental_saves_reference_unchanged_items_and_load_the_dense_state(cluster, job, tmp_path):
    c = cluster.client(job, keep_in_memory=1)
    frozen = np.random.default_rng(0).integers(0, 255, (4 << 20) + 1, dtype=np.uint8)  # 4 MiB + 1
    s1 = _state(1, frozen)
    full = c.save(1, s1, detect_unchanged=True)  # no base: all copied, and hashed
    full.wait("protected", timeout=60)
    assert full.size_bytes > frozen.nbytes
    # Step 2: "frozen" vouched for, "moment" found unchanged by its hash, "w" and
    # "step" changed: the shard holds those two alone.
    s2 = _state(2, frozen)
    inc = c.save(2, s2, unchanged=["frozen"], detect_unchanged=True)
    inc.wait("protected", timeout=60)
    assert inc.size_bytes < 4096 * 4 + 4096, inc.size_bytes
    assert c.item_steps(2) == {"frozen": 1, "moment": 1, "w": 2, "step": 2}
    back = c.load(2)
    assert np.array_equal(back["frozen"], frozen) and np.array_equal(back["w"], s2["w"])
    assert np.array_equal(back["moment"], s2["moment"]) and back["step"] == 2
    # The copy-into path follows references too (and checks their crcs).
    into = {"frozen": np.zeros_like(frozen), "moment": np.zeros(1024, np.float32)}
    c.load_into(2, into)
    assert np.array_equal(into["frozen"], frozen) and np.array_equal(into["moment"], s2["moment"])
    # A partial save states "w" only; the rest is carried, each item keeping
    # the step it was copied at (one hop: "moment" still refers to step 1).
    s3w = np.arange(4096, dtype=np.float32)
    c.save(3, {"w": s3w}, partial=True).wait("protected", timeout=60)
    assert c.item_steps(3) == {"frozen": 1, "moment": 1, "w": 3, "step": 2}
    back = c.load(3)
    assert np.array_equal(back["w"], s3w) and np.array_equal(back["frozen"], frozen) and back["step"] == 2
    # keep_in_memory=1, yet step 1 (referred to) stays; step 2 (referred to by
    # step 3 for "step") too.
    assert np.array_equal(c.load(1)["frozen"], frozen)
    assert c.load(2)["step"] == 2
    # ckptctl restore from memory lays version 3 out self-contained (format 1).
    out = tmp_path / "from-memory"
    r = cluster.ctl("restore", job, "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "version 1 from" in r.stdout, r.stdout
    assert json.loads((out / "manifest.json").read_text())["format_version"] == 1
    got = ckpt.read_durable(out, structured=True)[0]
    assert np.array_equal(got["frozen"], frozen) and np.array_equal(got["w"], s3w) and got["step"] == 2
    assert np.array_equal(got["moment"], s2["moment"])
    assert not list(out.glob("*.ref-*"))  # its temporary files are gone
    # Meta refuses to delete a version others refer to, unless forced.
    r = cluster.ctl("delete", job, "1")
    assert r.returncode != 0 and "refer to" in r.stderr, r.stderr


def test_detection_copies_what_changed_and_a_new_client_saves_in_full(cluster, job):
    c = cluster.client(job)
    a = np.ones(100000, np.float32)
    c.save(1, {"a": a, "b": np.zeros(10, np.int64)}).wait("staged", timeout=60)
    # Without hashes from step 1 (it was not saved with detection) detection
    # copies; step 2 records hashes, step 3 can use them.
    c.save(2, {"a": a, "b": np.zeros(10, np.int64)}, detect_unchanged=True).wait("staged", timeout=60)
    assert c.item_steps(2) == {"a": 2, "b": 2}
    b3 = np.arange(10, dtype=np.int64)
    c.save(3, {"a": a, "b": b3}, detect_unchanged=True).wait("staged", timeout=60)
    assert c.item_steps(3) == {"a": 2, "b": 3}
    # Same name, other length: copied, never referenced.
    c.save(4, {"a": a[:10], "b": b3}, unchanged=["a"], detect_unchanged=True).wait("staged", timeout=60)
    assert c.item_steps(4) == {"a": 4, "b": 3}
    assert np.array_equal(c.load(4)["a"], a[:10])
    # A new client (a restarted trainer) has no base: its first save is full
    # even when it vouches for items, and a partial one is refused.
    d = cluster.client(job)
    with pytest.raises(ckpt.FailedPreconditionError, match="needs a base"):
        d.save(5, {"a": a}, partial=True)
    d.save(5, {"a": a, "b": b3}, unchanged=["a", "b"]).wait("staged", timeout=60)
    assert d.item_steps(5) == {"a": 5, "b": 5}


def test_incremental_save_errors(cluster, job):
    c = cluster.client(job)
    state = {"a": np.ones(8)}
    with pytest.raises(ckpt.InvalidArgumentError, match='unchanged item "nope" is not an item'):
        c.save(1, state, unchanged=["nope"])
    with pytest.raises(ckpt.InvalidArgumentError, match="not one str"):
        c.save(1, state, unchanged="a")
    with pytest.raises(ckpt.InvalidArgumentError, match="unchanged must be item names"):
        c.save(1, state, unchanged=[1])
    c.save(1, state).wait("staged", timeout=60)  # the refused step is free
    lazy = c.save(2, {"a": np.ones(8), "b": 2}, lazy=True, unchanged=["a"])
    lazy.wait("staged", timeout=60)
    assert c.item_steps(2) == {"a": 1, "b": 2}


def test_full_save_every_bounds_the_chain(cluster, job):
    c = cluster.client(job, keep_in_memory=1, full_save_every=3)
    frozen = np.ones(1 << 20, np.uint8)
    steps = {}
    for step in range(1, 8):
        c.save(step, {"frozen": frozen, "x": step}, unchanged=["frozen"]).wait("protected", timeout=60)
        steps[step] = c.item_steps(step)["frozen"]
    # Full at 1 (no base), then at every multiple of 3 (the same steps on every rank).
    assert steps == {1: 1, 2: 1, 3: 3, 4: 3, 5: 3, 6: 6, 7: 6}
    # Versions nothing refers to any more go by retention (keep_in_memory=1).
    for gone in (1, 3, 4):
        with pytest.raises((ckpt.NotFoundError, ckpt.FailedPreconditionError)):
            c.load(gone)


def test_torch_incremental_save_of_a_model_with_frozen_parameters(cluster, job):
    torch = pytest.importorskip("torch")
    import ckpt.torch as ct
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(2000, 64), torch.nn.Linear(64, 8))
    model[0].weight.requires_grad_(False)  # frozen embedding: ~95% of the bytes
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    c = cluster.client(job)

    def train():
        loss = model(torch.arange(16)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    train()
    first = ct.save(c, 1, model=model, optimizer=opt, incremental=True)
    first.wait("staged", timeout=60)
    train()
    second = ct.save(c, 2, model=model, optimizer=opt, incremental=True)
    second.wait("staged", timeout=60)
    assert second.size_bytes * 10 < first.size_bytes, (second.size_bytes, first.size_bytes)
    steps = c.item_steps(2)
    assert steps["model/0.weight"] == 1 and steps["model/1.weight"] == 2
    want = {k: v.clone() for k, v in model.state_dict().items()}
    train()  # moves away from step 2
    fresh = torch.nn.Sequential(torch.nn.Embedding(2000, 64), torch.nn.Linear(64, 8))
    ct.load(c, 2, model=fresh)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_partial_saves_of_nested_containers_load_whole(cluster, job):
    # A MoE trainer's layout: dense parts every time, a rotating subset of experts.
    c = cluster.client(job, keep_in_memory=4)
    experts = {str(e): {"w": np.full(256, e, np.float32), "opt": [np.zeros(4), {"lr": 0.1}]} for e in range(4)}
    c.save(1, {"dense": np.ones(8), "experts": experts, "meta": ("a", 1)}).wait("staged", timeout=60)
    for step, e in ((2, "1"), (3, "2")):
        experts[e] = {"w": np.full(256, 10 * step, np.float32), "opt": [np.ones(4) * step, {"lr": 0.1}]}
        c.save(step, {"dense": np.ones(8) * step, "experts": {e: experts[e]}}, partial=True).wait("staged", timeout=60)
    back = c.load(3)
    assert sorted(back) == ["dense", "experts", "meta"] and back["meta"] == ("a", 1)
    assert np.array_equal(back["dense"], np.ones(8) * 3)
    assert sorted(back["experts"]) == ["0", "1", "2", "3"]
    for e, want in experts.items():
        assert np.array_equal(back["experts"][e]["w"], want["w"]), e
        assert np.array_equal(back["experts"][e]["opt"][0], want["opt"][0]) and back["experts"][e]["opt"][1] == {"lr": 0.1}
    steps = c.item_steps(3)
    assert steps["experts/0/w"] == 1 and steps["experts/1/w"] == 2 and steps["experts/2/w"] == 3
    assert steps["dense"] == 3 and steps["meta/1"] == 1


def test_incremental_versions_flush_with_references_and_restore_offline(cluster, job, tmp_path):
    c = cluster.client(job, flush_every=1, keep_in_memory=1)
    frozen = np.random.default_rng(3).integers(0, 255, (1 << 20) + 3, dtype=np.uint8)
    states = {}
    c.save(1, {"frozen": frozen, "w": np.ones(100), "meta": {"k": 1}}).wait("persisted", timeout=120)
    states[1] = {"frozen": frozen, "w": np.ones(100), "meta": {"k": 1}}
    c.save(2, {"frozen": frozen, "w": np.full(100, 2.0), "meta": {"k": 1}},
           unchanged=["frozen"]).wait("persisted", timeout=120)
    states[2] = {"frozen": frozen, "w": np.full(100, 2.0), "meta": {"k": 1}}
    c.save(3, {"w": np.full(100, 3.0)}, partial=True).wait("persisted", timeout=120)
    states[3] = {"frozen": frozen, "w": np.full(100, 3.0), "meta": {"k": 1}}
    vdir = cluster.durable_root / job / "3"
    manifest = json.loads((vdir / "manifest.json").read_text())
    assert manifest["format_version"] == 2
    refs = {i["name"]: i.get("ref_step") for i in manifest["shards"][0]["items"]}
    assert refs["frozen"] == 1 and refs["w"] is None and refs["meta/k"] == 2, refs
    # Only the new item was flushed for version 3.
    assert (vdir / "rank-00000.bin").stat().st_size < 1024
    # Offline, with no daemon: every version reads back whole.
    for step, want in states.items():
        got = ckpt.read_durable(cluster.durable_root / job / str(step), structured=True)[0]
        assert np.array_equal(got["frozen"], frozen) and np.array_equal(got["w"], want["w"]), step
        assert got["meta"] == {"k": 1}, step
    # ckptctl restore --from-dir writes a self-contained (format 1) copy.
    out = tmp_path / "restored"
    r = cluster.ctl("restore", "--from-dir", str(vdir), "--out", str(out))
    assert r.returncode == 0, r.stderr
    restored = json.loads((out / "manifest.json").read_text())
    assert restored["format_version"] == 1
    items = {i["name"]: i for i in restored["shards"][0]["items"]}
    assert all("ref_step" not in i for i in items.values())
    data = (out / "rank-00000.bin").read_bytes()
    f = items["frozen"]
    assert data[f["offset_bytes"]:f["offset_bytes"] + f["length_bytes"]] == frozen.tobytes()
    # Out of memory (keep_in_memory=1), version 2 loads from the durable tier,
    # its reference to version 1 too.
    c.save(4, {"frozen": frozen, "w": np.zeros(100), "meta": {"k": 1}}).wait("persisted", timeout=120)
    back = c.load(2)
    assert np.array_equal(back["frozen"], frozen) and np.array_equal(back["w"], np.full(100, 2.0))
    # Version 1's files stay while 2 and 3 refer to them; deleting 1 needs force.
    r = cluster.ctl("delete", job, "1")
    assert r.returncode != 0 and "refer to" in r.stderr, r.stderr
