"""torch helpers: save and restore a model and its optimizer in place.

    ckpt.torch.save(client, step, model=model, optimizer=opt, extra={"epoch": 3})
    ...
    extra = ckpt.torch.load(client, client.latest("protected"), model=model, optimizer=opt)

The state saved is {"model": model.state_dict(), "optimizer":
optimizer.state_dict(), "extra": extra} (entries left out when None). load()
copies the tensors back into the live model and optimizer (load_state_dict),
so a resumed run continues bit-identically, and returns `extra`.
"""


def save(client, step, model=None, optimizer=None, extra=None):
    """Saves model/optimizer state dicts and `extra` at `step`; returns the SaveHandle."""
    state = {}
    if model is not None:
        state["model"] = model.state_dict()
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if extra is not None:
        state["extra"] = extra
    return client.save(step, state)


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
