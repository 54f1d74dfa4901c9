"""ckpt.Client()'s configuration from the environment (ckpt.environment): precedence
and the error for a missing value. Pure Python: no daemon (one in-process gloo group
of size 1 for the torch.distributed case)."""
import datetime
import os

import pytest

import ckpt
from ckpt import environment

from conftest import free_ports


@pytest.fixture
def no_default_socket(monkeypatch, tmp_path):
    """The default agent socket points at a path that does not exist."""
    monkeypatch.setattr(environment, "DEFAULT_AGENT_SOCKET", str(tmp_path / "none" / "agent.sock"))
    return environment.DEFAULT_AGENT_SOCKET


@pytest.fixture
def default_socket(monkeypatch, tmp_path):
    """The default agent socket exists (a plain file stands in for it)."""
    path = tmp_path / "agent.sock"
    path.write_text("")
    monkeypatch.setattr(environment, "DEFAULT_AGENT_SOCKET", str(path))
    return str(path)


TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "TORCHELASTIC_RUN_ID": "0d1c-run",
            "CKPT_META": "meta.example:7400", "CKPT_AGENT_SOCKET": "/var/run/ckpt/a.sock"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "4242", "CKPT_META": "10.0.0.1:7400"}


def test_torchrun_variables(no_default_socket):
    cfg = environment.client_config(environ=TORCHRUN, torch_distributed=False)
    assert (cfg.job, cfg.rank, cfg.world_size, cfg.meta, cfg.agent_socket) == \
        ("0d1c-run", 3, 4, "meta.example:7400", "/var/run/ckpt/a.sock")
    assert cfg.sources == {"job": "$TORCHELASTIC_RUN_ID", "rank": "$RANK", "world_size": "$WORLD_SIZE",
                           "meta": "$CKPT_META", "agent_socket": "$CKPT_AGENT_SOCKET"}


def test_slurm_variables_and_the_default_socket(default_socket):
    cfg = environment.client_config(environ=SLURM, torch_distributed=False)
    assert (cfg.job, cfg.rank, cfg.world_size, cfg.meta, cfg.agent_socket) == \
        ("4242", 5, 8, "10.0.0.1:7400", default_socket)
    assert cfg.sources["agent_socket"] == "default"
    assert cfg.sources["rank"] == "$SLURM_PROCID" and cfg.sources["job"] == "$SLURM_JOB_ID"


def test_ckpt_job_wins_over_launcher_ids_and_torchrun_over_slurm(default_socket):
    env = dict(SLURM, **TORCHRUN, CKPT_JOB="gpt-7b")
    cfg = environment.client_config(environ=env, torch_distributed=False)
    assert (cfg.job, cfg.rank, cfg.world_size) == ("gpt-7b", 3, 4)
    assert cfg.sources["job"] == "$CKPT_JOB"
    # torchrun's run id over Slurm's job id (torchrun started by srun).
    env.pop("CKPT_JOB")
    assert environment.client_config(environ=env, torch_distributed=False).job == "0d1c-run"


def test_explicit_arguments_win(default_socket):
    cfg = environment.client_config(job="mine", rank=0, world_size=1, meta="127.0.0.1:1",
                                    agent_socket="/tmp/x.sock", environ=dict(TORCHRUN, CKPT_JOB="env-job"),
                                    torch_distributed=False)
    assert (cfg.job, cfg.rank, cfg.world_size, cfg.meta, cfg.agent_socket) == \
        ("mine", 0, 1, "127.0.0.1:1", "/tmp/x.sock")
    assert set(cfg.sources.values()) == {"job=", "rank=", "world_size=", "meta=", "agent_socket="}
    # Mixed: the arguments given win one by one, the rest still comes from the environment.
    cfg = environment.client_config(rank=1, environ=TORCHRUN, torch_distributed=False)
    assert (cfg.rank, cfg.world_size, cfg.sources["rank"]) == (1, 4, "rank=")


def test_torchrun_default_run_id_none_is_not_a_job(no_default_socket):
    env = dict(TORCHRUN, TORCHELASTIC_RUN_ID="none")
    with pytest.raises(ckpt.InvalidArgumentError) as e:
        environment.client_config(environ=env, torch_distributed=False)
    assert '$TORCHELASTIC_RUN_ID (torchrun) is "none" (torchrun without --rdzv_id' in str(e.value)
    assert environment.client_config(environ=dict(env, SLURM_JOB_ID="7"), torch_distributed=False).job == "7"


def test_missing_everything_names_every_place_looked(no_default_socket):
    with pytest.raises(ckpt.InvalidArgumentError) as e:
        environment.client_config(environ={}, torch_distributed=False)
    msg = str(e.value)
    print(msg)
    assert msg.splitlines() == [
        "ckpt.Client: no job, rank, world_size, meta, agent_socket given, and none found in the environment:",
        "  job: no job= argument; $CKPT_JOB is not set; $TORCHELASTIC_RUN_ID (torchrun) is not set; "
        "$SLURM_JOB_ID (Slurm) is not set",
        "  rank: no rank= argument; torch.distributed is not looked at; $RANK (torchrun) is not set; "
        "$SLURM_PROCID (Slurm) is not set",
        "  world_size: no world_size= argument; torch.distributed is not looked at; $WORLD_SIZE (torchrun) "
        "is not set; $SLURM_NTASKS (Slurm) is not set",
        "  meta: no meta= argument; $CKPT_META is not set",
        f"  agent_socket: no agent_socket= argument; $CKPT_AGENT_SOCKET is not set; {no_default_socket} "
        "(the default) does not exist",
        'Pass them to ckpt.Client(...) or set the variables (docs/python.md "Using ckpt from torchrun / '
        'Slurm / Kubernetes").',
    ]


def test_only_the_missing_values_are_named(default_socket):
    env = {k: v for k, v in TORCHRUN.items() if k != "CKPT_META"}
    with pytest.raises(ckpt.InvalidArgumentError) as e:
        environment.client_config(environ=env, torch_distributed=False)
    msg = str(e.value)
    assert msg.startswith("ckpt.Client: no meta given, and none found in the environment:\n"
                          "  meta: no meta= argument; $CKPT_META is not set\n")
    assert "rank" not in msg and "job:" not in msg


def test_a_variable_that_is_not_a_number(default_socket):
    env = dict(TORCHRUN, RANK="three", WORLD_SIZE="-1")
    with pytest.raises(ckpt.InvalidArgumentError) as e:
        environment.client_config(environ=env, torch_distributed=False)
    assert "  rank: $RANK is 'three', not an integer >= 0" in str(e.value)
    assert "  world_size: $WORLD_SIZE is '-1', not an integer >= 0" in str(e.value)


def test_client_without_arguments_fails_before_connecting(no_default_socket, monkeypatch):
    for var in ("CKPT_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "RANK", "WORLD_SIZE", "SLURM_PROCID",
                "SLURM_NTASKS", "CKPT_META", "CKPT_AGENT_SOCKET"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ckpt.InvalidArgumentError, match="no job, rank, world_size, meta, agent_socket given"):
        ckpt.Client(connect_timeout=0.1)


def test_client_says_where_a_bad_value_came_from(monkeypatch, tmp_path):
    """A job id the server-side rules refuse names the variable it came from."""
    monkeypatch.setenv("CKPT_JOB", "Not/A/Job")
    with pytest.raises(ckpt.InvalidArgumentError) as e:
        ckpt.Client(rank=0, world_size=1, meta="127.0.0.1:1", agent_socket=str(tmp_path / "a.sock"),
                    connect_timeout=0.1)
    assert "job id" in str(e.value) and "job Not/A/Job ($CKPT_JOB)" in str(e.value)


def test_torch_distributed_wins_over_variables(default_socket):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    port, = free_ports(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        cfg = environment.client_config(environ=dict(TORCHRUN, CKPT_JOB="j"))
        assert (cfg.rank, cfg.world_size) == (0, 1)
        assert cfg.sources["rank"] == cfg.sources["world_size"] == "torch.distributed"
        assert environment.client_config(rank=2, world_size=3, environ=TORCHRUN).rank == 2
    finally:
        dist.destroy_process_group()
    del torch
    cfg = environment.client_config(environ=TORCHRUN)
    assert cfg.sources["rank"] == "$RANK"
