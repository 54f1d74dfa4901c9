"""Where ckpt.Client() finds what it is not given: the launcher's environment.

    cfg = ckpt.environment.client_config()          # every value from the environment
    cfg = ckpt.environment.client_config(job="gpt") # an argument given wins
    cfg.job, cfg.rank, cfg.world_size, cfg.meta, cfg.agent_socket
    cfg.sources   # {"job": "$TORCHELASTIC_RUN_ID", "rank": "torch.distributed", ...}

Each value is taken from the first place that has it (docs/python.md "Using ckpt
from torchrun / Slurm / Kubernetes"):

    job           job=   $CKPT_JOB   $TORCHELASTIC_RUN_ID (torchrun)   $SLURM_JOB_ID (Slurm)
    rank          rank=        torch.distributed (initialised)   $RANK   $SLURM_PROCID
    world_size    world_size=  torch.distributed (initialised)   $WORLD_SIZE   $SLURM_NTASKS
    meta          meta=  $CKPT_META
    agent_socket  agent_socket=  $CKPT_AGENT_SOCKET  /run/ckpt/agent.sock (if it exists)

TLS files are read from the environment by the client library itself
($CKPT_TLS_CA, $CKPT_TLS_CERT, $CKPT_TLS_KEY, $CKPT_TLS_CRL_DIR; docs/python.md "TLS").
A value found nowhere is an error (ckpt.InvalidArgumentError) naming, for every
missing value, each place looked at. torchrun's run id "none" (its default
without --rdzv_id) does not name a job and counts as unset.
"""
import os
import sys
from dataclasses import dataclass, field

DEFAULT_AGENT_SOCKET = "/run/ckpt/agent.sock"
DOCS = 'docs/python.md "Using ckpt from torchrun / Slurm / Kubernetes"'

# Environment variables looked at, in order, after the argument (and torch.distributed
# for rank and world size): (variable, launcher) pairs.
JOB_VARS = (("CKPT_JOB", None), ("TORCHELASTIC_RUN_ID", "torchrun"), ("SLURM_JOB_ID", "Slurm"))
RANK_VARS = (("RANK", "torchrun"), ("SLURM_PROCID", "Slurm"))
WORLD_SIZE_VARS = (("WORLD_SIZE", "torchrun"), ("SLURM_NTASKS", "Slurm"))
META_VARS = (("CKPT_META", None),)
AGENT_SOCKET_VARS = (("CKPT_AGENT_SOCKET", None),)


@dataclass
class ClientConfig:
    """The values a Client connects with, and where each came from (`sources`:
    "job=" for an argument, "$VAR" for a variable, "torch.distributed", or the
    default socket's path)."""
    job: str
    rank: int
    world_size: int
    meta: str
    agent_socket: str
    sources: dict = field(default_factory=dict)

    def describe(self):
        """One line: `job gpt ($CKPT_JOB), rank 2 (torch.distributed), ...`."""
        return ", ".join(f"{k} {getattr(self, k)} ({self.sources[k]})"
                         for k in ("job", "rank", "world_size", "meta", "agent_socket"))


def _dist_state():
    """(rank, world_size, why-not) from torch.distributed: the values if it is
    initialised, else (None, None, the reason). torch is not imported here: a
    process that initialised torch.distributed has imported it already."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None, None, "torch.distributed is not imported"
    try:
        if not dist.is_available() or not dist.is_initialized():
            return None, None, "torch.distributed is not initialised"
        return dist.get_rank(), dist.get_world_size(), None
    except Exception as e:  # pragma: no cover - a broken torch build
        return None, None, f"torch.distributed failed: {e}"


def _var(environ, name, launcher):
    label = f"${name}" + (f" ({launcher})" if launcher else "")
    value = environ.get(name)
    if value is None or value.strip() == "":
        return None, f"{label} is not set"
    if name == "TORCHELASTIC_RUN_ID" and value == "none":
        return None, f'{label} is "none" (torchrun without --rdzv_id: no run name)'
    return value.strip(), None


def client_config(job=None, rank=None, world_size=None, meta=None, agent_socket=None, environ=None,
                  torch_distributed=True):
    """The ClientConfig for these arguments (None: not given), the rest from
    `environ` (default os.environ) and, for rank and world size, from
    torch.distributed when it is initialised (torch_distributed=False: not
    looked at). Raises ckpt.InvalidArgumentError naming every place looked at
    for each value found nowhere, and a variable that is not a number where one
    is needed."""
    from . import InvalidArgumentError

    env = os.environ if environ is None else environ
    values, sources, missing, bad = {}, {}, {}, []

    def resolve(name, given, variables, integer=False, dist_value=None, dist_why=None):
        looked = []
        if given is not None:
            values[name], sources[name] = given, f"{name}="
            return
        looked.append(f"no {name}= argument")
        if dist_why is not None or dist_value is not None:
            if dist_value is not None:
                values[name], sources[name] = dist_value, "torch.distributed"
                return
            looked.append(dist_why)
        for var, launcher in variables:
            value, why = _var(env, var, launcher)
            if value is None:
                looked.append(why)
                continue
            if integer:
                try:
                    value = int(value)
                    if value < 0:
                        raise ValueError
                except ValueError:
                    bad.append(f"  {name}: ${var} is {env.get(var)!r}, not an integer >= 0")
                    return
            values[name], sources[name] = value, f"${var}"
            return
        missing[name] = looked

    d_rank, d_world, d_why = (None, None, "torch.distributed is not looked at") if not torch_distributed \
        else _dist_state()
    resolve("job", job, JOB_VARS)
    resolve("rank", rank, RANK_VARS, integer=True, dist_value=d_rank, dist_why=d_why)
    resolve("world_size", world_size, WORLD_SIZE_VARS, integer=True, dist_value=d_world, dist_why=d_why)
    resolve("meta", meta, META_VARS)
    if agent_socket is not None:
        values["agent_socket"], sources["agent_socket"] = str(agent_socket), "agent_socket="
    else:
        value, why = _var(env, "CKPT_AGENT_SOCKET", None)
        if value is not None:
            values["agent_socket"], sources["agent_socket"] = value, "$CKPT_AGENT_SOCKET"
        elif os.path.exists(DEFAULT_AGENT_SOCKET):
            values["agent_socket"], sources["agent_socket"] = DEFAULT_AGENT_SOCKET, "default"
        else:
            missing["agent_socket"] = ["no agent_socket= argument", why,
                                       f"{DEFAULT_AGENT_SOCKET} (the default) does not exist"]
    if missing or bad:
        lines = []
        if missing:
            lines.append(f"ckpt.Client: no {', '.join(missing)} given, and none found in the environment:")
            lines += [f"  {name}: " + "; ".join(looked) for name, looked in missing.items()]
        if bad:
            lines.append("ckpt.Client: unusable values in the environment:")
            lines += bad
        lines.append(f"Pass them to ckpt.Client(...) or set the variables ({DOCS}).")
        raise InvalidArgumentError("\n".join(lines))
    return ClientConfig(sources=sources, **values)
