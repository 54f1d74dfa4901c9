"""The Python client against ckpt-dpu-agents (docs/dpu.md): the same API, with
the agent advertising pull-mode ingest; the client stages each shard in memory
UCX registered and the agent reads it one-sided. Saves at message-boundary
sizes, torch state, incremental saves, replicas between DPU agents, restores."""
import numpy as np
import torch

import ckpt
import ckpt.torch as ct


def test_saves_pulled_by_a_dpu_agent_protect_and_load_byte_exact(dpu_cluster, job):
    c = dpu_cluster.client(job, protection="replicate:2")
    pulled0 = dpu_cluster.metric(0, "ckpt_agent_pulled_bytes_total")
    rng = np.random.default_rng(14)
    for step, n in ((1, (4 << 20) - 1), (2, 4 << 20), (3, (4 << 20) + 1)):
        state = {"a": rng.integers(0, 256, n, dtype=np.uint8), "b": rng.standard_normal(1000).astype(np.float32),
                 "meta": {"step": step, "name": "x" * step}}
        c.save(step, state).wait("protected", timeout=120)
        back = c.load(step)
        assert np.array_equal(back["a"], state["a"]) and np.array_equal(back["b"], state["b"])
        assert back["meta"] == state["meta"]
    assert dpu_cluster.metric(0, "ckpt_agent_pulled_bytes_total") - pulled0 >= 3 * (4 << 20) - 1
    assert dpu_cluster.metric(0, "ckpt_agent_pull_errors_total") == 0
    # The replica lives on the other DPU agent: a client of that one loads it.
    other = dpu_cluster.client(job, agent=1)
    back = other.load(3)
    assert np.array_equal(back["a"], state["a"])


def test_torch_and_incremental_saves_through_a_dpu_agent(dpu_cluster, job):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(2048, 256), torch.nn.Linear(256, 64))
    model[0].weight.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    c = dpu_cluster.client(job)
    ct.save(c, 1, model, opt, incremental=True).wait("staged", timeout=60)
    model[1].weight.data.add_(1.0)
    h = ct.save(c, 2, model, opt, incremental=True)
    h.wait("staged", timeout=60)
    assert h.size_bytes < 2048 * 256 * 4  # the frozen embedding is referred to, not copied
    fresh = torch.nn.Sequential(torch.nn.Embedding(2048, 256), torch.nn.Linear(256, 64))
    ct.load(c, 2, fresh)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)


def test_thousands_of_items_through_a_dpu_agent(dpu_cluster, job):
    """5,000 tensors of about 1 KiB (sizes vary, so items straddle no fixed
    grid), three versions, each pulled by the DPU agent and delivered back
    into client memory: every item byte-exact, every byte counted."""
    c = dpu_cluster.client(job, protection="replicate:2")
    g = torch.Generator().manual_seed(5000)
    pulled0 = dpu_cluster.metric(0, "ckpt_agent_pulled_bytes_total")
    delivered0 = dpu_cluster.metric(0, "ckpt_agent_delivered_bytes_total")
    total = 0
    for step in (1, 2, 3):
        sd = {f"layers.{i // 8}.block.{i % 8}.w": torch.randn(256 + (i * 7 + step) % 8, generator=g)
              for i in range(5000)}
        total += sum(t.numel() * 4 for t in sd.values())
        c.save(step, {"model": sd}).wait("protected", timeout=120)
        back = c.load(step)["model"]
        assert back.keys() == sd.keys()
        wrong = [k for k, t in sd.items() if not torch.equal(back[k], t)]
        assert not wrong, f"{len(wrong)} items differ, e.g. {wrong[:3]}"
    assert dpu_cluster.metric(0, "ckpt_agent_pulled_bytes_total") - pulled0 >= total
    assert dpu_cluster.metric(0, "ckpt_agent_delivered_bytes_total") - delivered0 >= total
    assert dpu_cluster.metric(0, "ckpt_agent_pull_errors_total") == 0
