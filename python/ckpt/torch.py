"""torch helpers: save and restore a model and its optimizer in place.

    ckpt.torch.save(client, step, model=model, optimizer=opt, extra={"epoch": 3})
    ...
    extra = ckpt.torch.load(client, client.latest("protected"), model=model, optimizer=opt)

The state saved is {"model": model.state_dict(), "optimizer":
optimizer.state_dict(), "extra": extra} (entries left out when None). load()
copies the tensors back into the live model and optimizer (load_state_dict),
so a resumed run continues bit-identically, and returns `extra`.

lazy=True saves in the background (Client.save(..., lazy=True)): the copy
overlaps the next forward and backward passes, which do not change the
parameters or the optimizer state, and the optimizer's step() waits for the
copy before it changes them (save() wraps optimizer.step once). A model with
persistent buffers (BatchNorm's running statistics, which the forward pass
updates) also waits before its forward pass, for its buffers only: a lazy
save puts them first in the model's state dict (load_state_dict does not
mind the order), so the copy of the parameters and the optimizer state goes
on during the forward and backward passes.

incremental=True (fine-tuning): frozen parameters (requires_grad False) are
declared unchanged and every other entry is hashed, so what did not change
since this client's previous save is stored as a reference to it instead of
being copied, sent and kept again (Client.save's unchanged= and
detect_unchanged=; docs/python.md "Incremental saves").

Checkpointer (below) is one object for a training loop: resume(), step(s), close().
"""
import collections
import logging
import sys
import time


def save(client, step, model=None, optimizer=None, extra=None, lazy=False, incremental=False):
    """Saves model/optimizer state dicts and `extra` at `step`.

    Returns the SaveHandle, or with lazy=True a ckpt.LazySave (see the module doc).
    """
    state = {}
    points = []
    unchanged = []
    if model is not None:
        state["model"] = model.state_dict()
        if incremental:
            unchanged = _frozen_items(model, state["model"])
        if lazy:
            state["model"], last_buffer = _buffers_first(model, state["model"])
            if last_buffer is not None:
                points.append(_buffers_point(last_buffer))
                _wait_before_forward(client, model, points[-1])
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if extra is not None:
        state["extra"] = extra
    changes = {"unchanged": unchanged, "detect_unchanged": bool(incremental)}
    if not lazy:
        return client.save(step, state, **changes)
    if optimizer is not None:
        _wait_before_step(client, optimizer)
    return client.save(step, state, lazy=True, wait_points=points, **changes)


def _frozen_items(model, sd):
    """Item names of the state dict's entries that are frozen parameters (requires_grad
    False), known by their memory (a tied parameter counts if frozen)."""
    from . import _encode_key
    frozen = {p.data_ptr() for p in model.parameters() if not p.requires_grad and p.numel() > 0}
    trained = {p.data_ptr() for p in model.parameters() if p.requires_grad and p.numel() > 0}
    frozen -= trained
    return ["model/" + _encode_key(k) for k, v in sd.items()
            if hasattr(v, "data_ptr") and v.numel() > 0 and v.data_ptr() in frozen]


def _first_guard(obj, client):
    """True the first time `client` guards `obj` (a model or optimizer); records it."""
    guarded = getattr(obj, "_ckpt_guarded", None)
    if guarded is None:
        guarded = obj._ckpt_guarded = []
    if any(c is client for c in guarded):
        return False
    guarded.append(client)
    return True


def _wait_before_step(client, optimizer):
    """Wraps optimizer.step (once per client) to wait for the client's lazy copy first."""
    if not _first_guard(optimizer, client):
        return
    inner = optimizer.step

    def step(*args, **kwargs):
        client.wait_copied()
        return inner(*args, **kwargs)

    optimizer.step = step


def _buffers_first(model, sd):
    """(sd with the entries that are not parameters first, the last of those or None).

    The forward pass changes those (persistent buffers) and nothing else of the state.
    A parameter is known by its memory, so a tied one (saved under two names) is one."""
    params = {p.data_ptr() for p in model.parameters() if p.numel() > 0}

    def is_param(v):
        return hasattr(v, "data_ptr") and v.numel() > 0 and v.data_ptr() in params

    buffers = [k for k, v in sd.items() if not is_param(v)]
    if not buffers:
        return sd, None
    out = type(sd)()
    for k in buffers:
        out[k] = sd[k]
    for k, v in sd.items():
        if is_param(v):
            out[k] = v
    metadata = getattr(sd, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata
    return out, buffers[-1]


def _buffers_point(last_buffer):
    """The item name of the model's last buffer in a ckpt.torch state."""
    from . import _encode_key
    return "model/" + _encode_key(last_buffer)


def _wait_before_forward(client, model, point):
    """Registers (once per client) a forward pre-hook that waits for the copy of the
    model's items up to `point` (its buffers, put first). A save without that wait
    point (the model's buffers changed since) makes it wait for the whole copy."""
    if _first_guard(model, client):
        model.register_forward_pre_hook(lambda module, inputs: client.wait_copied(through=point))


def load(client, step, model=None, optimizer=None, strict=True):
    """Restores `model` and `optimizer` in place from `step`; returns the saved `extra` (or None).

    Raises ckpt.NotFoundError if the step (or, for a model/optimizer given,
    its part of the state) is missing.
    """
    from . import NotFoundError

    state = client.load(step)
    if model is not None:
        if "model" not in state:
            raise NotFoundError(f"step {step} holds no model state")
        model.load_state_dict(state["model"], strict=strict)
    if optimizer is not None:
        if "optimizer" not in state:
            raise NotFoundError(f"step {step} holds no optimizer state")
        optimizer.load_state_dict(state["optimizer"])
    return state.get("extra")


# ---------------------------------------------------------------------------
# Checkpointer: one object for a training loop.

_log = logging.getLogger("ckpt")


def _parse_every(every):
    """("steps", N) | ("seconds", T) | ("auto", None) of Checkpointer's `every`."""
    import datetime
    import re
    from . import InvalidArgumentError
    if isinstance(every, str) and every.strip() == "auto":
        return "auto", None
    if isinstance(every, bool):
        raise InvalidArgumentError(f"every must be 'auto', a number of steps or a duration, not {every!r}")
    if isinstance(every, int):
        if every < 1:
            raise InvalidArgumentError(f"every={every}: a number of steps must be >= 1")
        return "steps", every
    if isinstance(every, datetime.timedelta):
        seconds = every.total_seconds()
    elif isinstance(every, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h)\s*", every)
        if m is None:
            raise InvalidArgumentError(
                f"every={every!r}: write 'auto', a number of steps (every=100) or a duration "
                "('30s', '5m', '1h', a datetime.timedelta)")
        seconds = float(m.group(1)) * {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}[m.group(2)]
    else:
        raise InvalidArgumentError(
            f"every={every!r}: write 'auto', a number of steps (an int) or a duration ('30s', a timedelta)")
    if seconds <= 0:
        raise InvalidArgumentError(f"every={every!r}: a duration must be > 0")
    return "seconds", seconds


def _rng_states():
    """The RNG states a resumed run needs to go on bit-identically: torch's (and CUDA's
    when it is in use), numpy's global generator and Python's `random`."""
    import random
    import numpy as np
    import torch
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out["numpy"] = {"kind": str(kind), "keys": np.array(keys), "pos": int(pos), "has_gauss": int(has_gauss),
                    "cached_gaussian": float(cached)}
    version, internal, gauss_next = random.getstate()
    out["python"] = {"version": int(version), "state": np.array(internal, dtype=np.uint64),
                     "gauss_next": gauss_next}
    return out


def _restore_rng(rng):
    import random
    import numpy as np
    import torch
    if not rng:
        return
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(rng["cuda"]))
    if "numpy" in rng:
        n = rng["numpy"]
        np.random.set_state((n["kind"], n["keys"], n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if "python" in rng:
        p = rng["python"]
        random.setstate((p["version"], tuple(int(x) for x in p["state"]), p["gauss_next"]))


def _distributed():
    """torch.distributed if it is initialised, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


class Checkpointer:
    """Checkpoints a training loop through ckpt: resume, save at an interval, wait at the end.

        ck = ckpt.torch.Checkpointer(model, optimizer, every="auto")   # client from the environment
        step = ck.resume()                # 0, or the step of the version restored
        while step < steps:
            ...train one step...
            step += 1
            ck.step(step)                 # saves when the interval says so
        ck.close()                        # waits until the last save is PROTECTED

    A step is the number of training steps done: ck.step(s) after the s-th
    optimizer step saves the state after it, and resume() returns that s, so
    the loop goes on with step s+1. A step at which a run of the job that died
    had begun a version (some of its ranks saved it) is not saved again: the
    next step is (ck.skipped_steps); steps up to the newest version found by
    resume() are not saved either (meta refuses steps that do not increase).
    Neither needs a rank to know more than the others: they agree through
    torch.distributed (with several ranks and no torch.distributed, the first
    check is not made, and a save at such a step raises
    ckpt.AlreadyExistsError).

    model, optimizer: saved and restored in place (state_dict / load_state_dict);
    either may be None. every: "auto" (save at the first step, then every
    Young/Daly interval sqrt(2 x C x M) steps, C the measured save cost, M the
    job's MTBF from meta: Client.recommended_interval, re-chosen after each
    save), an int N (every step that is a multiple of N), or a duration
    ("30s", "5m", "1h", a datetime.timedelta: at the first step, then every
    that many seconds of training converted to steps from the measured step
    time, re-chosen after each save). With "auto" or a duration the ranks
    agree on the steps (the smallest interval) through torch.distributed,
    which must then be initialised when world_size > 1. lazy=True (default):
    the copy overlaps the next forward and backward passes and the optimizer's
    step() waits for it (ckpt.torch.save(lazy=True)). incremental=True: frozen
    parameters and unchanged entries are stored as references
    (ckpt.torch.save(incremental=True)).

    client: a ckpt.Client; default ckpt.Client(**client_args), which takes the
    job, rank, world size, meta and agent socket from the environment
    (torchrun, Slurm, CKPT_*; docs/python.md "Using ckpt from torchrun / Slurm
    / Kubernetes"). extra: a dict saved with every version and restored in
    place by resume() (ck.extra), e.g. a data loader's position; values as in
    a ckpt state. The RNG states (torch, CUDA when in use, numpy's global
    generator, Python's random) are saved and restored too.

    layout: a ckpt.torch.Layout: saves with save_sharded (each piece once; restorable into
    any layout and world size) and resumes with load_sharded into this run's layout, so a
    job relaunched on fewer or more ranks, or with another tensor-parallel split, resumes
    with no glue code (the client is made with resize_world=True). extra must then be
    JSON-able; the RNG states are not saved (they are a rank's own).
    """

    def __init__(self, model, optimizer=None, every="auto", lazy=True, incremental=False, *, client=None,
                 extra=None, level="protected", settle_timeout=10.0, close_timeout=600.0, layout=None,
                 **client_args):
        from . import Client, InvalidArgumentError
        if level not in ("staged", "protected", "persisted"):
            raise InvalidArgumentError(f"level must be staged, protected or persisted, not {level!r}")
        if layout is not None:
            if incremental:
                raise InvalidArgumentError("incremental saves do not go with a layout (save_sharded)")
            if model is None:
                raise InvalidArgumentError("a layout needs the model")
            client_args.setdefault("resize_world", True)  # a relaunch may have another world size
        self.layout = layout
        self.mode, self.every = _parse_every(every)
        self.model = model
        self.optimizer = optimizer
        self.lazy = bool(lazy)
        self.incremental = bool(incremental)
        self.client = client if client is not None else Client(**client_args)
        self.rank = self.client.rank
        self.world_size = self.client.world_size
        self.extra = {} if extra is None else extra
        self.level = level
        self.settle_timeout = float(settle_timeout)
        self.close_timeout = float(close_timeout)
        self.restored = None       # what resume() found: step, level, served_from, node, seconds, ...
        self.interval = None       # the interval chosen (auto / duration): steps and why
        self.saved_steps = []      # the steps this Checkpointer saved
        self.skipped_steps = []    # steps not saved: a run of the job that died began a version there
        self._floor = -1           # steps <= the newest version found at resume are not saved again
        self._next = None          # the next step to save at
        self._last = None          # the newest save (SaveHandle or LazySave)
        self._tick = time.monotonic()
        self._step_times = collections.deque(maxlen=50)  # seconds of training between step() calls

    # -- ranks agreeing --------------------------------------------------------------------------

    def _agree(self, values, op):
        """`values` (ints) reduced over the ranks with op "min"/"max" when torch.distributed is
        initialised (and world_size > 1); as they are otherwise."""
        dist = _distributed() if self.world_size > 1 else None
        if dist is None:
            return list(values)
        import torch
        t = torch.tensor(list(values), dtype=torch.int64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
        return [int(x) for x in t.cpu()]

    # -- resume ----------------------------------------------------------------------------------

    def resume(self):
        """Restores the newest restorable version into the model and optimizer (in place), the RNG
        states and ck.extra; returns its step, or 0 if the job has no version.

        PROTECTED first: the newest version at PROTECTED or better (a newer STAGED one is given
        settle_timeout seconds to get there), then the newest STAGED one if the protected one
        cannot be loaded. The ranks agree on the step (through torch.distributed when it is
        initialised). Versions the job has but none loadable: the last error is raised (with
        every attempt in its message), since the job's steps cannot start again from 0.
        ck.restored says what was restored from where.
        """
        from . import DataLossError, Error, NotFoundError
        t0 = time.monotonic()
        c = self.client

        def latest(level):
            v = c.latest(level)
            return -1 if v is None else int(v)

        protected, staged = latest("protected"), latest("staged")
        protected, staged_min = self._agree([protected, staged], "min")
        (staged_max,) = self._agree([staged], "max")
        if staged_min > protected:
            # A newer version still being protected (the run died just after saving it).
            try:
                c.wait(staged_min, "protected", timeout=self.settle_timeout)
            except Error:
                pass
            (protected,) = self._agree([latest("protected")], "min")
        self._floor = max(staged_max, protected)
        candidates = [("protected", protected)] if protected >= 0 else []
        if staged_min >= 0 and staged_min != protected:
            candidates.append(("staged", staged_min))
        tried, error = [], None
        for level, step in candidates:
            state, failure = None, None
            try:
                if self.layout is not None:
                    # Into this run's layout, whatever layout and world size saved it.
                    served_from = "slices"
                    extra = load_sharded(c, step, self.model, self.optimizer, self.layout) or {}
                    state = {"model": None, "optimizer": None}
                else:
                    served_from, state = c.load_with_source(step)
                    extra = state.get("extra") or {}
                if extra.get("step") != step:
                    raise NotFoundError(f"step {step} was not saved by a Checkpointer (no extra/step)")
                for part, obj in (("model", self.model), ("optimizer", self.optimizer)):
                    if obj is not None and part not in state:
                        raise NotFoundError(f"step {step} holds no {part} state")
            except Error as e:
                failure = f"step {step} ({level}): {type(e).__name__}: {e}"
                error = e
            (ok,) = self._agree([0 if failure else 1], "min")
            if not ok:
                tried.append(failure or f"step {step} ({level}): another rank could not load it")
                continue
            if self.layout is None and self.model is not None:
                self.model.load_state_dict(state["model"])
            if self.layout is None and self.optimizer is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            _restore_rng(extra.get("rng"))
            user = extra.get("user") or {}
            self.extra.clear()
            self.extra.update(user)
            seconds = time.monotonic() - t0
            self.restored = {"step": step, "level": level, "served_from": served_from, "node": c.node_id,
                             "seconds": seconds, "rank": self.rank, "job": c.job, "skipped": tried}
            _log.info("ckpt: rank %d/%d of job %s resumed from step %d (%s version, served from %s "
                      "through %s) in %.3f s%s", self.rank, self.world_size, c.job, step, level, served_from,
                      c.node_id, seconds, f"; skipped: {'; '.join(tried)}" if tried else "")
            self._tick = time.monotonic()
            return step
        if tried:
            raise (type(error) if error is not None else DataLossError)(
                "no version of job {} could be restored: {}".format(c.job, "; ".join(tried)))
        self.restored = {"step": 0, "level": None, "served_from": None, "node": c.node_id,
                         "seconds": time.monotonic() - t0, "rank": self.rank, "job": c.job, "skipped": []}
        _log.info("ckpt: rank %d/%d of job %s: no version to resume from, starting at step 0",
                  self.rank, self.world_size, c.job)
        self._tick = time.monotonic()
        return 0

    # -- saving ----------------------------------------------------------------------------------

    def _median_step_time(self):
        times = sorted(self._step_times)
        return times[len(times) // 2] if times else 0.0

    def _choose_interval(self, step):
        """Steps to the next save after a save at `step` ("auto" and durations); the ranks agree."""
        step_time = max(self._median_step_time(), 1e-6)
        if self.mode == "auto":
            advice = self.client.recommended_interval(step_time)
            mine, why = int(advice["steps"]), advice["explanation"]
        else:
            mine = max(1, int(round(self.every / step_time)))
            why = f"every {self.every:g} s at a median step time of {step_time * 1e3:.1f} ms: {mine} steps"
        (steps,) = self._agree([mine], "min")
        self.interval = {"steps": steps, "mine": mine, "why": why, "at_step": step}
        _log.info("ckpt: rank %d: next save in %d steps (%s)", self.rank, steps, why)
        return steps

    def _check_agreement(self):
        from . import FailedPreconditionError
        if self.mode != "steps" and self.world_size > 1 and _distributed() is None:
            raise FailedPreconditionError(
                f"every={'auto' if self.mode == 'auto' else repr(f'{self.every:g}s')} with {self.world_size} "
                "ranks needs torch.distributed initialised (the ranks agree on the steps to save at): "
                "initialise it before the first step(), or give every=N steps")

    def _taken(self, step):
        """True if the job has a version at `step` already (OPEN or ABORTED: begun by a run
        that died), on any rank (the ranks agree, so that all or none save it). Looked at
        only when the ranks can agree (one rank, or torch.distributed initialised)."""
        from . import Error, NotFoundError
        if self.world_size > 1 and _distributed() is None:
            return False
        last = self._last
        if last is not None:
            # The client's waits first wait for its own last save's commit (long done by
            # now, in the background): then the look at meta takes no time.
            last.result(self.close_timeout) if hasattr(last, "result") else last.committed(self.close_timeout)
        try:
            self.client.wait(step, "staged", timeout=0)
            taken = 1  # STAGED or better: not after a resume (steps above the floor only)
        except NotFoundError:
            taken = 0
        except Error:
            taken = 1  # OPEN (DeadlineExceededError), ABORTED (FailedPreconditionError), meta away
        (taken,) = self._agree([taken], "max")
        return bool(taken)

    def step(self, step):
        """Call after each training step with the number of steps done; saves when the interval
        says so. Returns the save (SaveHandle, or LazySave with lazy=True) or None."""
        now = time.monotonic()
        self._step_times.append(now - self._tick)
        step = int(step)
        handle = None
        if step > self._floor:
            if self._next is None:
                self._check_agreement()
                self._next = -(-step // self.every) * self.every if self.mode == "steps" else step
            if step >= self._next and self._taken(step):
                # A run of this job that died began a version at this step: its shards
                # cannot be saved again (the agent holds them), and a version mixing two
                # runs would not be one state. The next step is saved instead.
                self.skipped_steps.append(step)
                _log.info("ckpt: rank %d: step %d not saved: a previous run of job %s began a version "
                          "there; saving at step %d", self.rank, step, self.client.job, step + 1)
                self._next = step + 1
            elif step >= self._next:
                handle = self.save(step)
                self._next = (step // self.every + 1) * self.every if self.mode == "steps" \
                    else step + self._choose_interval(step)
        self._tick = time.monotonic()
        return handle

    def save(self, step):
        """Saves now, at `step` (whatever the interval): model, optimizer, RNG states, ck.extra."""
        if self.layout is not None:
            # Sharded: stored once per piece, restorable into any layout. The RNG states are
            # a rank's own, and a rank of another layout has no counterpart: not saved.
            handle = save_sharded(self.client, int(step), self.model, self.optimizer, self.layout,
                                  extra={"step": int(step), "user": self.extra}, lazy=self.lazy)
            self._last = handle
            self.saved_steps.append(int(step))
            return handle
        extra = {"step": int(step), "rng": _rng_states(), "user": self.extra}
        handle = save(self.client, int(step), model=self.model, optimizer=self.optimizer, extra=extra,
                      lazy=self.lazy, incremental=self.incremental)
        self._last = handle
        self.saved_steps.append(int(step))
        return handle

    def close(self, timeout=None):
        """Waits for the newest save to be committed and to reach `level` (PROTECTED by default);
        raises its error. timeout: seconds (default close_timeout)."""
        handle, self._last = self._last, None
        if handle is not None:
            handle.wait(self.level, self.close_timeout if timeout is None else float(timeout))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *rest):
        if exc_type is None:
            self.close()
        return False


# ---------------------------------------------------------------------------
# Another layout: a model split over tensor-parallel ranks and replicated over
# data-parallel ones, saved once per piece and restored into any other split
# (docs/python.md "Another layout").

def _chunk(n, i, k):
    """(offset, length) of part i of k of a dimension of n (the first n % k parts one longer,
    as torch.tensor_split)."""
    base, extra = divmod(n, k)
    return i * base + min(i, extra), base + (1 if i < extra else 0)


class Layout:
    """Where this rank's parameters sit in the whole model.

    tp=(tp_rank, tp_size), dp=(dp_rank, dp_size): the rank is dp_rank * tp_size + tp_rank
    (Megatron's order). split={name: dim}: the parameter (or buffer) is split along `dim`
    over the tensor-parallel ranks (a ColumnParallelLinear's weight and bias: 0; a
    RowParallelLinear's weight: 1), in torch.tensor_split's parts (the first ones one longer
    when the size does not divide); a name not in `split` is replicated. shapes={name:
    global shape}: needed only when a split does not divide evenly (otherwise the local
    shape times tp_size). Every data-parallel rank holds the same tensors: save_sharded
    stores each piece once (dedup).

    zero=True: the optimizer's state is partitioned over the data-parallel ranks as ZeRO
    stages 1 and 2 do: the optimizer steps one flat 1-D parameter, this rank's part
    (zero_range) of the concatenation of the model's trainable parameters (this rank's
    tensor-parallel pieces, in named_parameters order, each flattened row-major). Its
    state is saved as slices of the same per-parameter global tensors a layout without
    zero saves, so either kind of layout restores the other's."""

    def __init__(self, tp=(0, 1), dp=(0, 1), split=None, shapes=None, zero=False):
        self.tp_rank, self.tp_size = (int(v) for v in tp)
        self.dp_rank, self.dp_size = (int(v) for v in dp)
        from . import InvalidArgumentError
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.dp_rank < self.dp_size):
            raise InvalidArgumentError(f"bad layout: tp={tp} dp={dp} (rank, size) with 0 <= rank < size")
        self.split = dict(split or {})
        self.shapes = {k: [int(d) for d in v] for k, v in (shapes or {}).items()}
        self.zero = bool(zero)

    @property
    def rank(self):
        return self.dp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self):
        return self.tp_size * self.dp_size

    def global_shape(self, name, local_shape):
        if name in self.shapes:
            return list(self.shapes[name])
        shape = list(local_shape)
        dim = self.split.get(name)
        if dim is not None:
            shape[dim] *= self.tp_size
        return shape

    def box(self, name, global_shape, tp_rank=None):
        """(offsets, lengths) of tensor-parallel rank tp_rank's (default: this rank's) piece."""
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        offsets, lengths = [0] * len(global_shape), list(global_shape)
        dim = self.split.get(name)
        if dim is not None:
            offsets[dim], lengths[dim] = _chunk(global_shape[dim], tp_rank, self.tp_size)
        return offsets, lengths

    def zero_range(self, model):
        """(start, stop): the elements of the flat vector of `model`'s trainable parameters
        (named_parameters order, each flattened row-major) whose optimizer state this
        data-parallel rank holds with zero=True: part dp_rank of dp_size, the first parts
        one longer when the total does not divide (as torch.tensor_split)."""
        total = sum(p.numel() for _, p in _flat_params(model))
        start, length = _chunk(total, self.dp_rank, self.dp_size)
        return start, start + length


def _flat_params(model):
    """[(name, parameter)]: the trainable parameters in the order a ZeRO layout flattens
    them (named_parameters, tied ones once)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _flat_boxes(shape, lo, hi):
    """Elements [lo, hi) of a tensor of `shape` in row-major order as boxes [(offsets,
    lengths)], in that order: each box's elements are the next ones of the range."""
    if lo >= hi:
        return []
    if not shape:
        return [([], [])]
    inner = 1
    for d in shape[1:]:
        inner *= d
    rest = list(shape[1:])
    out = []
    head = -(-lo // inner)  # the first whole row
    if lo % inner:
        row = lo // inner
        stop = min(hi, (row + 1) * inner)
        out += [([row] + o, [1] + n) for o, n in _flat_boxes(rest, lo - row * inner, stop - row * inner)]
        if stop == hi:
            return out
    tail = hi // inner  # rows [head, tail) are whole
    if tail > head:
        out.append(([head] + [0] * len(rest), [tail - head] + rest))
    if hi % inner:
        out += [([tail] + o, [1] + n) for o, n in _flat_boxes(rest, 0, hi - tail * inner)]
    return out


def _zero_parts(model, layout, start, stop):
    """The parameters' parts in the flat range [start, stop): [(name, parameter, flat
    offset in the range, local offsets, lengths)], in order, boxes of the parameter's
    local (tensor-parallel) tensor."""
    out, at = [], 0
    for name, p in _flat_params(model):
        n = p.numel()
        lo, hi = max(start, at), min(stop, at + n)
        for offsets, lengths in _flat_boxes(list(p.shape), lo - at, hi - at):
            out.append((name, p, lo - start, offsets, lengths))
            size = 1
            for d in lengths:
                size *= d
            lo += size
        at += n
    return out


def _zero_flat(optimizer, layout, model):
    """The optimizer's one flat parameter, checked against `layout`'s zero_range."""
    from . import InvalidArgumentError
    params = [p for g in optimizer.param_groups for p in g["params"]]
    start, stop = layout.zero_range(model)
    if len(params) != 1 or params[0].dim() != 1 or params[0].numel() != stop - start:
        shapes = [list(p.shape) for p in params]
        raise InvalidArgumentError(
            f"a zero layout needs an optimizer over one flat parameter of {stop - start} elements "
            f"(elements [{start}, {stop}) of the model's {sum(p.numel() for _, p in _flat_params(model))}); "
            f"this optimizer has parameters of shapes {shapes}")
    return params[0], start, stop


def _json_array(value, what):
    import json
    import numpy as np
    from . import InvalidArgumentError
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{what} must be JSON-able for a sharded save: {e}") from None
    return np.frombuffer(text.encode(), dtype=np.uint8).copy()


def _sharded_tensors(model, optimizer, layout):
    """[(global name, layout key, local tensor)]: the model's parameters and persistent
    buffers, then the optimizer's per-parameter state; layout key None: replicated."""
    out = []
    names = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in names:
            continue  # a tied parameter is saved once
        names[id(t)] = name
        out.append((f"model/{name}", name, t.detach()))
    if optimizer is not None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = optimizer.state_dict()["state"]
        for i, p in enumerate(params):
            for key, v in sorted(state.get(i, {}).items()):
                if not _is_tensor(v):
                    continue
                same = tuple(v.shape) == tuple(p.shape)
                out.append((f"optimizer/{names[id(p)]}/{key}", names[id(p)] if same else None, v.detach()))
    return out


def _is_tensor(v):
    import torch
    return isinstance(v, torch.Tensor)


def _owners(pieces, layout):
    """{(global name, tp piece): rank}: which rank of those holding a piece saves it, the
    bytes spread evenly (largest first, to the least loaded holder; ties to the lowest
    rank). Every rank computes the same answer from the same pieces."""
    load = [0] * layout.world_size
    owners = {}
    for nbytes, name, piece in sorted(pieces, key=lambda x: (-x[0], x[1], -1 if x[2] is None else x[2])):
        if piece is None:
            holders = range(layout.world_size)
        else:
            holders = [dp * layout.tp_size + piece for dp in range(layout.dp_size)]
        best = min(holders, key=lambda r: (load[r], r))
        load[best] += nbytes
        owners[(name, piece)] = best
    return owners


def _zero_state(model, optimizer, layout, pieces, places):
    """A zero layout's optimizer state: [(global name, tensor, global shape, offsets)] of
    the boxes of the per-parameter tensors this rank's flat state holds (its own: no other
    rank holds them; of a parameter tensor-parallel ranks replicate, tensor-parallel rank
    0's), and the scalars (AdamW's step) added to `pieces` and `places` as replicated
    tensors of every parameter, saved once like any replica."""
    _, start, stop = _zero_flat(optimizer, layout, model)
    state = optimizer.state_dict()["state"].get(0, {})
    own = []
    for key, v in sorted(state.items()):
        if not _is_tensor(v):
            continue
        v = v.detach()
        if tuple(v.shape) != (stop - start,):
            for name, _ in _flat_params(model):
                gname = f"optimizer/{name}/{key}"
                pieces.append((v.element_size() * v.numel(), gname, None))
                places.append((gname, None, v, list(v.shape), [0] * v.dim()))
            continue
        for name, p, at, offsets, lengths in _zero_parts(model, layout, start, stop):
            if name not in layout.split and layout.tp_rank != 0:
                continue
            gshape = layout.global_shape(name, p.shape)
            base, _ = layout.box(name, gshape)
            n = 1
            for d in lengths:
                n *= d
            own.append((f"optimizer/{name}/{key}", v[at:at + n].view(lengths), gshape,
                        [b + o for b, o in zip(base, offsets)]))
    return own


def save_sharded(client, step, model, optimizer=None, layout=None, extra=None, dedup=True, lazy=False):
    """Saves this rank's part of a model split as `layout` says (a ckpt.torch.Layout), every
    parameter, buffer and optimizer tensor as a slice of its global tensor, so that
    load_sharded can restore it into another layout and world size. With dedup (the
    default) a piece several data-parallel ranks hold is saved by one of them, the work
    spread evenly; the others refer to it through the version's index. `extra` (JSON-able)
    and the optimizer's param_groups are stored once. Returns what Client.save returns."""
    from . import GlobalSlice
    layout = layout or Layout()
    tensors = _sharded_tensors(model, None if layout.zero else optimizer, layout)
    pieces, places = [], []
    for gname, key, t in tensors:
        gshape = layout.global_shape(key, t.shape) if key is not None else list(t.shape)
        offsets, lengths = layout.box(key, gshape) if key is not None else ([0] * len(gshape), list(gshape))
        if lengths != list(t.shape):
            from . import InvalidArgumentError
            raise InvalidArgumentError(f"{gname}: local shape {list(t.shape)} is not this rank's part "
                                       f"{lengths} of {gshape} (give Layout(shapes=...))")
        piece = layout.tp_rank if key is not None and key in layout.split else None
        # Every rank's pieces, not only this one's: all ranks compute the same owners.
        for i in (range(layout.tp_size) if piece is not None else [None]):
            n = t.element_size()
            for d in (layout.box(key, gshape, i)[1] if i is not None else gshape):
                n *= d
            pieces.append((n, gname, i))
        places.append((gname, piece, t, gshape, offsets))
    own = _zero_state(model, optimizer, layout, pieces, places) if layout.zero and optimizer is not None else []
    replicated = {"optimizer/param_groups": None, "extra": None}
    if optimizer is not None:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
        replicated["optimizer/param_groups"] = _json_array(groups, "the optimizer's param_groups")
    if extra is not None:
        replicated["extra"] = _json_array(extra, "extra")
    for gname, arr in replicated.items():
        if arr is not None:
            pieces.append((arr.nbytes, gname, None))
    owners = _owners(pieces, layout) if dedup else None
    state = {"layout": {"tp": [layout.tp_rank, layout.tp_size], "dp": [layout.dp_rank, layout.dp_size]},
             "model": {}, "optimizer": {}, "global": {}}
    for gname, piece, t, gshape, offsets in places:
        if owners is not None and owners[(gname, piece)] != layout.rank:
            continue
        kind, _, rest = gname.partition("/")
        state[kind][rest] = GlobalSlice(t, gname, gshape, offsets)
    for j, (gname, t, gshape, offsets) in enumerate(own):
        state["optimizer"][f"{gname.partition('/')[2]}/{j}"] = GlobalSlice(t, gname, gshape, offsets)
    for gname, arr in replicated.items():
        if arr is not None and (owners is None or owners[(gname, None)] == layout.rank):
            state["global"][gname] = GlobalSlice(arr, gname, [arr.size])
    if lazy:
        # The copy runs during the next forward and backward passes: the optimizer's step
        # waits for it, and so does a forward pass that updates persistent buffers.
        if optimizer is not None:
            _wait_before_step(client, optimizer)
        if any(True for _ in model.buffers()):
            _wait_before_forward(client, model, None)
        return client.save(step, state, lazy=True)
    return client.save(step, state)


def _empty(dtype, shape):
    """A new CPU tensor of ckpt dtype `dtype`."""
    import numpy as np
    import torch
    from . import DType, _DTYPE_TO_NUMPY
    arr = np.empty(shape, _DTYPE_TO_NUMPY[dtype])
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if dtype == DType.BF16 else t


def _zero_slices(model, optimizer, layout, index, by_param, slices):
    """A zero layout's optimizer state, to be filled by `slices` (appended to): {0: {key:
    tensor}}, each elementwise tensor the flat vector of this rank's part, made of boxes of
    the per-parameter global tensors; the scalars from the first parameter's."""
    from . import NotFoundError
    _, start, stop = _zero_flat(optimizer, layout, model)
    flat = _flat_params(model)
    if not flat:
        return {}
    first = flat[0][0]
    state = {}
    for key, gname in by_param.get(first, []):
        dtype, gshape, _ = index[gname]
        if gshape != index[f"model/{first}"][1]:
            t = _empty(dtype, list(gshape))
            slices.append((gname, [0] * len(gshape), list(gshape), t))
            state[key] = t
            continue
        t = _empty(dtype, [stop - start])
        for name, p, at, offsets, lengths in _zero_parts(model, layout, start, stop):
            part = f"optimizer/{name}/{key}"
            if part not in index:
                raise NotFoundError(f"the version holds no global tensor {part!r}")
            base, _ = layout.box(name, index[f"model/{name}"][1])
            n = 1
            for d in lengths:
                n *= d
            slices.append((part, [b + o for b, o in zip(base, offsets)], lengths, t[at:at + n].view(lengths)))
        state[key] = t
    return {0: state} if state else {}


def load_sharded(client, step, model, optimizer=None, layout=None):
    """Restores `model` (and `optimizer`) in place from `step` saved by save_sharded, in
    `layout` (a ckpt.torch.Layout), whatever layout and world size saved it: each
    parameter, buffer and optimizer tensor gets this rank's slice of its global tensor,
    read from whichever ranks' shards hold it (Client.load_slices: local copy, peers, EC
    decode, durable tier; every byte checked). Returns the saved `extra` (or None).
    Raises ckpt.NotFoundError for a tensor the version does not hold."""
    import json
    import torch
    from . import NotFoundError, InvalidArgumentError
    layout = layout or Layout()
    index = client.global_tensors(step)

    def need(gname):
        if gname not in index:
            raise NotFoundError(f"step {step} holds no global tensor {gname!r}")
        return index[gname]

    slices, after = [], []
    names = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in names:
            continue
        names[id(t)] = name
        _, gshape, _ = need(f"model/{name}")
        offsets, lengths = layout.box(name, gshape)
        if lengths != list(t.shape):
            raise InvalidArgumentError(f"model/{name}: this rank's part of {gshape} is {lengths}, "
                                       f"the model's tensor {list(t.shape)}")
        target = t.detach()
        if not target.is_contiguous() or target.device.type != "cpu":
            staging = torch.empty(lengths, dtype=t.dtype)
            after.append((target, staging))
            target = staging
        slices.append((f"model/{name}", offsets, lengths, target))
    state = {}
    if optimizer is not None:
        by_param = {}  # parameter name -> [(state key, global name)]
        for gname in index:
            kind, _, rest = gname.partition("/")
            pname, _, key = rest.rpartition("/")
            if kind == "optimizer" and pname:
                by_param.setdefault(pname, []).append((key, gname))
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if layout.zero:
            state = _zero_slices(model, optimizer, layout, index, by_param, slices)
            params = []
        for i, p in enumerate(params):
            for key, gname in by_param.get(names[id(p)], []):
                dtype, gshape, _ = index[gname]
                if gshape == index[f"model/{names[id(p)]}"][1]:
                    offsets, lengths = layout.box(names[id(p)], gshape)
                else:
                    offsets, lengths = [0] * len(gshape), list(gshape)
                t = _empty(dtype, lengths)
                state.setdefault(i, {})[key] = t
                slices.append((gname, offsets, lengths, t))
    blobs = {}
    for gname in ("optimizer/param_groups", "extra"):
        if gname in index:
            dtype, gshape, _ = index[gname]
            blobs[gname] = _empty(dtype, gshape)
            slices.append((gname, [0], list(gshape), blobs[gname]))
    client.load_slices(step, slices)
    for target, staging in after:
        target.copy_(staging)
    if optimizer is not None and layout.zero:
        # The flat parameter the optimizer steps is this rank's part of the parameters.
        flat, start, stop = _zero_flat(optimizer, layout, model)
        with torch.no_grad():
            for _, p, at, offsets, lengths in _zero_parts(model, layout, start, stop):
                n = 1
                for d in lengths:
                    n *= d
                box = p.detach()[tuple(slice(o, o + k) for o, k in zip(offsets, lengths))]
                flat[at:at + n].copy_(box.reshape(-1))
    if optimizer is not None:
        current = optimizer.state_dict()["param_groups"]
        if "optimizer/param_groups" in blobs:
            groups = json.loads(blobs["optimizer/param_groups"].numpy().tobytes())
            for g, c in zip(groups, current):
                g["params"] = c["params"]
        else:
            groups = current
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    if "extra" in blobs:
        return json.loads(blobs["extra"].numpy().tobytes())
    return None
