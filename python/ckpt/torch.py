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
"""


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
