"""ckpt: the Python client of the ckpt checkpoint store.

    import ckpt
    c = ckpt.Client(job="gpt", rank=r, world_size=w, meta="127.0.0.1:7400",
                    agent_socket="/run/ckpt/agent.sock")
    h = c.save(step, {"model": model.state_dict(), "step": step})  # blocks for the copy only
    h.wait("protected", timeout=60)                                 # or "staged" / "persisted"
    step = c.latest("protected")                                    # int or None
    state = c.load(step)                                            # the same structure back

    c = ckpt.Client()   # under torchrun / Slurm / Kubernetes: job, rank, world size, meta and
                        # agent socket from the environment (ckpt.environment)
    ck = ckpt.torch.Checkpointer(model, optimizer, every="auto")   # a training loop's resume/save

A state is a dict, nested to any depth, of torch.Tensor, numpy.ndarray (and
numpy scalars), bytes, int, float, bool, str and None, and of lists, tuples
and dicts (str or int keys) of those. It is flattened into one ckpt item per
leaf, named by its path ("model/layer.0/weight"); the item's attributes record
the Python type so load() rebuilds the same structure (tensors as torch
tensors when saved as torch, else numpy arrays). Arrays and tensors are saved
from their own memory without an extra copy when they are C-contiguous and
on the CPU (others are made contiguous / moved to the CPU first).

Errors are raised as subclasses of ckpt.Error named after the status code
(ckpt.NotFoundError, ckpt.InvalidArgumentError, ckpt.UnavailableError, ...)
with the server's message.

Thread safety: a Client and its SaveHandles may be used from several threads;
save() releases the GIL while it copies.

Lazy saves: c.save(step, state, lazy=True) returns at once and copies in the
background; the state's arrays and tensors must not change until the copy is
done: c.wait_copied() (ckpt.torch does it before the optimizer step).
"""

from urllib.parse import unquote as _unquote

import numpy as _np

from . import _ckpt
from ._ckpt import SaveHandle  # noqa: F401  (h.step, h.size_bytes, h.crc32c, h.wait(level, timeout), h.committed(timeout))

Error = _ckpt.Error
CancelledError = _ckpt.CancelledError
UnknownError = _ckpt.UnknownError
InvalidArgumentError = _ckpt.InvalidArgumentError
DeadlineExceededError = _ckpt.DeadlineExceededError
NotFoundError = _ckpt.NotFoundError
AlreadyExistsError = _ckpt.AlreadyExistsError
PermissionDeniedError = _ckpt.PermissionDeniedError
ResourceExhaustedError = _ckpt.ResourceExhaustedError
FailedPreconditionError = _ckpt.FailedPreconditionError
AbortedError = _ckpt.AbortedError
OutOfRangeError = _ckpt.OutOfRangeError
UnimplementedError = _ckpt.UnimplementedError
InternalError = _ckpt.InternalError
UnavailableError = _ckpt.UnavailableError
DataLossError = _ckpt.DataLossError
UnauthenticatedError = _ckpt.UnauthenticatedError

__all__ = ["Client", "SaveHandle", "LazySave", "DType", "GlobalSlice", "DurableVersion", "read_durable", "Error",
           "MAX_STEP",
           "environment"] + [
    n for n in dir(_ckpt) if n.endswith("Error")]

# The largest step ckpt accepts (2**53 - 1: exact as a float and in JSON).
MAX_STEP = 2**53 - 1


def _step(step):
    """`step` as an int in 0..MAX_STEP, else ckpt.InvalidArgumentError."""
    value = int(step)
    if not 0 <= value <= MAX_STEP:
        raise InvalidArgumentError(
            f"step {value} is out of range: steps must be 0..{MAX_STEP} (2^53-1)")
    return value


class DType:
    """Element types of items (ckpt.v1.DType numbers)."""
    F32 = 1
    F16 = 2
    BF16 = 3
    F64 = 4
    I8 = 5
    I16 = 6
    I32 = 7
    I64 = 8
    U8 = 9
    U16 = 10
    U32 = 11
    U64 = 12
    BOOL = 13
    BYTES = 14
    C64 = 15
    C128 = 16


_NUMPY_TO_DTYPE = {
    _np.dtype(_np.float32): DType.F32,
    _np.dtype(_np.float16): DType.F16,
    _np.dtype(_np.float64): DType.F64,
    _np.dtype(_np.int8): DType.I8,
    _np.dtype(_np.int16): DType.I16,
    _np.dtype(_np.int32): DType.I32,
    _np.dtype(_np.int64): DType.I64,
    _np.dtype(_np.uint8): DType.U8,
    _np.dtype(_np.uint16): DType.U16,
    _np.dtype(_np.uint32): DType.U32,
    _np.dtype(_np.uint64): DType.U64,
    _np.dtype(_np.bool_): DType.BOOL,
    _np.dtype(_np.complex64): DType.C64,
    _np.dtype(_np.complex128): DType.C128,
}
# bf16 has no numpy type: its bits travel as uint16.
_DTYPE_TO_NUMPY = {v: k for k, v in _NUMPY_TO_DTYPE.items()}
_DTYPE_TO_NUMPY[DType.BF16] = _np.dtype(_np.uint16)

# Attribute holding the Python type of an item: how load() rebuilds it.
_TYPE_KEY = "py.type"
# Older versions also wrote "py.torch_dtype" (the torch dtype's name) on torch
# items; the item's dtype says the same, so it is no longer written nor read.
_CONTAINERS = ("dict", "list", "tuple")


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is optional
        return None
    return torch


def _is_torch_tensor(value):
    torch = _torch() if type(value).__module__.startswith("torch") else None
    return torch is not None and isinstance(value, torch.Tensor)


def _encode_key(key):
    """One path segment for a dict key: str keys escaped, int keys as '#<n>'."""
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise InvalidArgumentError(f"dict keys must be str or int, not {type(key).__name__}: {key!r}")
    if isinstance(key, int):
        return f"#{key}"
    if key == "":
        raise InvalidArgumentError("dict keys must not be empty strings")
    seg = key.replace("%", "%25").replace("/", "%2F")
    if seg.startswith("#"):
        seg = "%23" + seg[1:]
    return seg


def _decode_key(seg):
    if seg.startswith("#"):
        return int(seg[1:])
    return _unquote(seg)


def _tensor_item(value):
    """(buffer, dtype number, shape, attributes) of a torch tensor, sharing its memory when possible."""
    torch = _torch()
    t = value.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # Lazily conjugated or negated views: their memory holds the other values.
    t = t.resolve_conj().resolve_neg().contiguous()
    attrs = {_TYPE_KEY: "torch"}
    shape = list(t.shape)
    if t.dtype == torch.bfloat16:
        arr = t.view(torch.int16).numpy()
        code = DType.BF16
    else:
        arr = t.numpy()
        code = _NUMPY_TO_DTYPE.get(arr.dtype)
        if code is None:
            raise InvalidArgumentError(f"unsupported torch dtype {t.dtype}")
    return arr.reshape(-1).view(_np.uint8) if arr.size else b"", code, shape, attrs, arr


class GlobalSlice:
    """A tensor (torch or numpy) saved as the slice at `offsets` of the global
    tensor `name` of `shape` (docs/python.md "Another layout"): put it in a
    state where the tensor would go. Its item carries the ckpt.global_*
    attributes (docs/format.md "Global tensors"), so any rank of any later
    world size can load any slice of the global tensor (Client.load_slices).
    A load of the rank's own state gives back the plain tensor. offsets None:
    the whole tensor (a replica: shape must then be the tensor's own)."""

    def __init__(self, tensor, name, shape, offsets=None):
        self.tensor = tensor
        self.name = str(name)
        self.shape = [int(d) for d in shape]
        self.offsets = [0] * len(self.shape) if offsets is None else [int(o) for o in offsets]

    def attributes(self):
        out = {"ckpt.global_shape": ",".join(map(str, self.shape)),
               "ckpt.global_offset": ",".join(map(str, self.offsets))}
        return out


def _flatten(prefix, value, out):
    """Appends (name, buffer, dtype, shape, attributes) items for `value` at path `prefix`."""
    if isinstance(value, dict):
        if prefix:
            out.append((prefix, b"", DType.BYTES, [], {_TYPE_KEY: "dict"}))
        for k, v in value.items():
            seg = _encode_key(k)
            _flatten(f"{prefix}/{seg}" if prefix else seg, v, out)
        return
    if not prefix:
        raise InvalidArgumentError(f"a state must be a dict, not {type(value).__name__}")
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        out.append((prefix, b"", DType.BYTES, [], {_TYPE_KEY: kind}))
        for i, v in enumerate(value):
            _flatten(f"{prefix}/{i}", v, out)
        return
    if isinstance(value, GlobalSlice):
        start = len(out)
        _flatten(prefix, value.tensor, out)
        if len(out) != start + 1 or out[start][2] == DType.BYTES:
            raise InvalidArgumentError(f"GlobalSlice at {prefix!r} must hold a tensor or an array")
        attrs = dict(out[start][4])
        attrs.update(value.attributes())
        if value.name != prefix:
            attrs["ckpt.global_name"] = value.name
        out[start] = out[start][:4] + (attrs,) + out[start][5:]
        return
    if _is_torch_tensor(value):
        buf, code, shape, attrs, keep = _tensor_item(value)
        out.append((prefix, buf, code, shape, attrs, keep))
        return
    if isinstance(value, (_np.ndarray, _np.generic)):
        is_scalar = isinstance(value, _np.generic)
        arr = _np.asarray(value)
        if not arr.flags.c_contiguous:
            arr = _np.ascontiguousarray(arr)  # ndim >= 1, so only for arrays
        code = _NUMPY_TO_DTYPE.get(arr.dtype)
        if code is None:
            raise InvalidArgumentError(f"unsupported numpy dtype {arr.dtype} at {prefix!r}")
        attrs = {_TYPE_KEY: "numpy_scalar" if is_scalar else "numpy"}
        buf = arr.reshape(-1).view(_np.uint8) if arr.size else b""
        out.append((prefix, buf, code, list(arr.shape), attrs, arr))
        return
    if isinstance(value, (bytes, bytearray, memoryview)):
        kind = {bytes: "bytes", bytearray: "bytearray"}.get(type(value), "bytes")
        out.append((prefix, value, DType.BYTES, [], {_TYPE_KEY: kind}))
        return
    if value is None:
        out.append((prefix, b"", DType.BYTES, [], {_TYPE_KEY: "none"}))
        return
    if isinstance(value, bool):
        out.append((prefix, b"1" if value else b"0", DType.BYTES, [], {_TYPE_KEY: "bool"}))
        return
    if isinstance(value, int):
        out.append((prefix, str(value).encode(), DType.BYTES, [], {_TYPE_KEY: "int"}))
        return
    if isinstance(value, float):
        out.append((prefix, repr(value).encode(), DType.BYTES, [], {_TYPE_KEY: "float"}))
        return
    if isinstance(value, str):
        out.append((prefix, value.encode("utf-8"), DType.BYTES, [], {_TYPE_KEY: "str"}))
        return
    raise InvalidArgumentError(f"cannot save a {type(value).__name__} at {prefix!r}")


def _array_of(dtype, shape, data):
    """The item's bytes (a fresh uint8 array) as a numpy array of its dtype and shape."""
    if dtype == DType.BYTES:
        return data
    np_dtype = _DTYPE_TO_NUMPY.get(dtype)
    if np_dtype is None:
        raise DataLossError(f"item of unknown dtype {dtype}")
    return data.view(np_dtype).reshape(shape)


def _leaf(dtype, shape, attrs, data):
    kind = attrs.get(_TYPE_KEY)
    if kind == "torch":
        torch = _torch()
        if torch is None:
            raise FailedPreconditionError("this item was saved from torch, which is not installed")
        arr = _array_of(dtype, shape, data)
        if dtype == DType.BF16:
            return torch.from_numpy(arr.view(_np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)
    if kind == "numpy":
        return _array_of(dtype, shape, data)
    if kind == "numpy_scalar":
        return _array_of(dtype, shape, data)[()]
    raw = data.tobytes() if isinstance(data, _np.ndarray) else bytes(data)
    if kind == "bytes":
        return raw
    if kind == "bytearray":
        return bytearray(raw)
    if kind == "none":
        return None
    if kind == "bool":
        return raw == b"1"
    if kind == "int":
        return int(raw.decode())
    if kind == "float":
        return float(raw.decode())
    if kind == "str":
        return raw.decode("utf-8")
    if kind == "dict":
        return {}
    if kind == "list":
        return []
    if kind == "tuple":
        return ()
    # An item written by another client: a numpy array, or bytes.
    if dtype == DType.BYTES:
        return raw
    return _array_of(dtype, shape, data)


def _unflatten(items):
    """Rebuilds the nested state from (name, dtype, shape, attributes, uint8 array) in save order."""
    root = {}
    # Lists and tuples are built as dicts keyed by index and converted at the end.
    seqs = []
    nodes = {"": root}
    for name, dtype, shape, attrs, data in items:
        parent_path, _, seg = name.rpartition("/")
        parent = nodes.get(parent_path)
        if parent is None:
            raise DataLossError(f"item {name!r} has no parent container in the checkpoint")
        kind = attrs.get(_TYPE_KEY)
        key = _decode_key(seg) if not isinstance(parent, _Seq) else int(seg)
        if kind in _CONTAINERS:
            node = {} if kind == "dict" else _Seq(kind)
            if isinstance(node, _Seq):
                seqs.append((parent, key, node))
            nodes[name] = node
            parent[key] = node
        else:
            parent[key] = _leaf(dtype, shape, attrs, data)
    # Innermost first (appended after their parents), so children are converted before parents.
    for parent, key, node in reversed(seqs):
        parent[key] = node.build(lambda v: v.built if isinstance(v, _Seq) else v)
    return root


class _Seq(dict):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.built = None

    def build(self, resolve):
        values = [resolve(self[i]) for i in range(len(self))]
        self.built = values if self.kind == "list" else tuple(values)
        return self.built


def _load_into_buffer(name, target):
    """The writable uint8 view of a load_into target (tensor or array), or raises."""
    if _is_torch_tensor(target):
        torch = _torch()
        t = target.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            raise InvalidArgumentError(f"{name!r}: load_into needs a contiguous CPU tensor")
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        arr = t.numpy()
    else:
        arr = target
    if isinstance(arr, _np.ndarray):
        if not arr.flags.c_contiguous or not arr.flags.writeable:
            raise InvalidArgumentError(f"{name!r}: load_into needs a C-contiguous writable array")
        arr = arr.reshape(-1).view(_np.uint8) if arr.size else _np.zeros(0, _np.uint8)
    return arr


def _item_names(value, what):
    """save()'s list of item names `what` (wait_points, unchanged) as a list of
    str; None means none; InvalidArgumentError for anything else."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)):
        raise InvalidArgumentError(f"{what} must be a list of item names, not one {type(value).__name__}: "
                                   f"{value!r} (write [{value!r}])")
    try:
        names = list(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be a list of item names, not {type(value).__name__}")
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise InvalidArgumentError(f"{what} must be item names (str), not {type(bad[0]).__name__}: {bad[0]!r}")
    return names


class LazySave:
    """A save running in the background (Client.save(step, state, lazy=True)).

    The copy into the agent's memory tier (each item with its crc32c) and the
    commit run on a thread of their own. The arrays and tensors of the state
    must not change until wait_copied() returned (or the Client's
    wait_copied()). Errors of the save (those save() raises eagerly) are
    raised by the waits. Dropping the last reference waits for the save to
    finish (the GIL released meanwhile), so its memory is never read later.
    """

    def __init__(self, impl):
        self._impl = impl

    @property
    def step(self):
        return self._impl.step

    @property
    def copied(self):
        """True once every item is copied (does not block)."""
        return self._impl.copied_items == self._impl.item_count

    def wait_copied(self, timeout=None, through=None):
        """Blocks until every item is copied; raises the save's error if it failed before that.

        through="model/bn.running_mean" (a wait point given to save()): blocks only
        until the items up to that one, in the state's order, are copied; those may
        change then, the later ones may not yet. ckpt.InvalidArgumentError if it is
        not a wait point of this save.
        """
        t = None if timeout is None else float(timeout)
        if through is None:
            self._impl.wait_copied(t)
        else:
            self._impl.wait_copied_through(str(through), t)

    @property
    def wait_points(self):
        """The save's wait points: {item name: its index in the state's order}."""
        return dict(self._impl.points)

    def result(self, timeout=None):
        """Blocks until the save is committed; returns its SaveHandle or raises its error."""
        return self._impl.result(None if timeout is None else float(timeout))

    def wait(self, level="protected", timeout=None):
        """As SaveHandle.wait, after the commit (timeout counts both)."""
        import time
        start = time.monotonic()
        handle = self.result(timeout)
        left = None if timeout is None else max(0.0, float(timeout) - (time.monotonic() - start))
        handle.wait(level, left)


class _PausedProtection:
    def __init__(self, client, max_seconds):
        self._client = client
        self._max = float(max_seconds)

    def __enter__(self):
        self._client.pause_protection(self._max)
        return self

    def __exit__(self, *exc):
        self._client.resume_protection()
        return False


class Client:
    """A connection to ckpt-meta and the node's agent, for one rank of one job.

    job, rank, world_size, meta and agent_socket not given are taken from the
    environment: torch.distributed (rank, world size) when it is initialised,
    else the launcher's variables (torchrun: RANK, WORLD_SIZE,
    TORCHELASTIC_RUN_ID; Slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_ID) and
    CKPT_JOB, CKPT_META, CKPT_AGENT_SOCKET (default /run/ckpt/agent.sock);
    CKPT_JOB wins over a launcher's run id. ckpt.environment.client_config()
    has the table; a value found nowhere raises ckpt.InvalidArgumentError
    naming every place looked at. `client.config.sources` says where each
    value came from.

    Connecting makes sure the job exists (rank 0 creates it with this
    world_size, flush and retention policy; other ranks wait for it) and maps
    the agent's memory tier. Blocks up to connect_timeout seconds while meta or
    the agent is unreachable: then ckpt.DeadlineExceededError. A bad job id,
    rank or world size raises ckpt.InvalidArgumentError; a job that exists
    with another world size or protection ckpt.FailedPreconditionError.

    protection: None (the default) means "whatever the job has": a job that
    exists keeps its stored protection (e.g. one an operator created with
    `ckptctl create-job --replicate 2`), and a job rank 0 creates gets the
    server's default (replicate:2 on a cluster of two or more nodes, none on a
    single node; see docs/python.md). A string states it: "none" (local memory
    only), "replicate:COPIES[:ring|group]" (e.g. "replicate:2:ring") or
    "ec:K+M" (e.g. "ec:4+2"); rank 0 creates the job with it, and an existing
    job with another protection raises ckpt.FailedPreconditionError naming
    both. Anything else raises ckpt.InvalidArgumentError.

    Steps are integers 0..2**53-1 (ckpt.MAX_STEP); a larger one raises
    ckpt.InvalidArgumentError.

    full_save_every: with incremental saves (save(unchanged=..., detect_unchanged=...)),
    a save whose step reaches a multiple of N (N, 2N, ...: the same steps on
    every rank) is made in full (0: never), so that the versions referred to
    (kept in memory while they are) do not pile up.

    resize_world: the job may exist with another world size (a relaunch on more
    or fewer ranks): rank 0 changes it, the others wait for that; the versions
    saved before keep their size and are restored by resharding
    (load_slices, ckpt.torch.load_sharded). Without it a different world size
    raises ckpt.FailedPreconditionError.
    """

    def __init__(self, job=None, rank=None, world_size=None, meta=None, agent_socket=None, *,
                 flush_every=0, flush_every_seconds=0, keep_in_memory=0, keep_durable=0,
                 run_id="", connect_timeout=30.0, rpc_timeout=60.0, load_timeout=600.0,
                 protection=None, full_save_every=10, resize_world=False):
        cfg = environment.client_config(job=job, rank=rank, world_size=world_size, meta=meta,
                                        agent_socket=agent_socket)
        try:
            self._c = _ckpt.Client.connect(
                job=cfg.job, rank=cfg.rank, world_size=cfg.world_size, meta=cfg.meta,
                agent_socket=str(cfg.agent_socket),
                flush_every=flush_every, flush_every_seconds=flush_every_seconds,
                keep_in_memory=keep_in_memory, keep_durable=keep_durable, run_id=run_id,
                connect_timeout=float(connect_timeout), rpc_timeout=float(rpc_timeout),
                load_timeout=float(load_timeout),
                protection=None if protection is None else str(protection),
                full_save_every=int(full_save_every), resize_world=bool(resize_world))
        except InvalidArgumentError as e:
            if all(v.endswith("=") for v in cfg.sources.values()):
                raise
            # Say where the values came from: a job id from $TORCHELASTIC_RUN_ID, a rank
            # from $SLURM_PROCID are not what the caller wrote.
            raise InvalidArgumentError(f"{e} (from the environment: {cfg.describe()})") from None
        self.job = cfg.job
        self.rank = cfg.rank
        self.world_size = cfg.world_size
        self.config = cfg  # where each value came from (cfg.sources)
        self._lazy = None  # the newest lazy save whose copy may still run
        # The newest lazy save already copied, whose commit may still be on its way:
        # dropping the last reference to a LazySave waits for its save to finish, so the
        # client keeps it until the next one is copied (the training step never waits
        # for a commit, as with an eager save).
        self._finishing = None

    @property
    def node_id(self):
        return self._c.node_id

    def save(self, step, state, lazy=False, wait_points=(), *, unchanged=(), detect_unchanged=False,
             partial=False):
        """Saves `state` (a dict, see the module doc) as this rank's shard of `step`.

        Blocks only for the copy into the agent's memory tier (the GIL is
        released meanwhile); returns a SaveHandle to wait for a durability
        level. The commit (the manifest) reaches the agent in the background:
        h.committed(timeout) waits for it and raises its error, h.wait does
        that first, and this client's loads and waits see its own saves. The
        state must not be modified until save returns. Errors:
        ckpt.InvalidArgumentError (unsupported value, a step outside
        0..ckpt.MAX_STEP), ckpt.ResourceExhaustedError (the memory tier is full),
        ckpt.AlreadyExistsError (this rank already saved this step),
        ckpt.UnavailableError (agent or meta down).

        lazy=True: returns a LazySave at once (after walking the state; values
        that are not arrays or tensors are captured then) and copies in the
        background; the arrays and tensors must not change until
        wait_copied(). A save first waits for the copy of the previous lazy
        save (raising its error, once, if it failed). Items are copied in the
        state's order; wait_points (item names, such as "model/bn.running_mean")
        can be waited for on their own: wait_copied(through=name) returns once
        the items up to that one are copied (ckpt.torch puts a model's buffers
        first, so that its forward pass waits for those only).
        ckpt.InvalidArgumentError if a wait point is not an item of the state.

        Incremental saves (docs/python.md "Incremental saves"): an item equal
        to the same item of this client's previous save (its "base") is stored
        as a reference to the base's bytes: not copied, not sent to peers, no
        new memory. unchanged=[names] vouches for items (frozen parameters;
        they are not even read); detect_unchanged=True hashes every other item
        (XXH3, a read-only pass) and references those equal to the base's.
        partial=True saves only the items `state` has and carries the base's
        others over (a MoE trainer saving some experts per version);
        item_steps(step) tells the step each item was taken at. Items that do
        not match the base (or with no base) are simply copied, except that
        partial=True without a base raises ckpt.FailedPreconditionError.
        ckpt.InvalidArgumentError if an unchanged name is not an item.
        """
        if not isinstance(state, dict):
            raise InvalidArgumentError(f"a state must be a dict, not {type(state).__name__}")
        self.wait_copied()
        # The walk (_flatten's rules) runs in C++; leaves it does not cover
        # come back to _flatten.
        points = _item_names(wait_points, "wait_points")
        same = _item_names(unchanged, "unchanged")
        if lazy:
            self._lazy = LazySave(self._c.save_state_lazy(_step(step), state, points, same,
                                                          bool(detect_unchanged), bool(partial)))
            return self._lazy
        if points:
            raise InvalidArgumentError("wait_points are for lazy saves (lazy=True)")
        return self._c.save_state(_step(step), state, same, bool(detect_unchanged), bool(partial))

    def item_steps(self, step):
        """{item name: step} for this rank's items of `step`: the version whose
        save copied each item (older than `step` for items an incremental save
        referenced or a partial save carried over)."""
        step = _step(step)
        self._own_lazy_committed(step)
        return self._c.item_steps(step)

    def wait_copied(self, timeout=None, through=None):
        """Blocks until the newest lazy save has copied the state (at once if none runs).

        Raises that save's error (once) if it failed before copying everything.
        through=NAME: only until the items up to the wait point NAME are copied,
        if the newest lazy save has that wait point (else until all are).
        """
        lazy = self._lazy
        if lazy is None:
            return
        partial = through is not None and str(through) in lazy.wait_points
        try:
            lazy.wait_copied(timeout, through=through if partial else None)
        except DeadlineExceededError:
            if timeout is not None:
                raise  # our timeout: the copy is still running
            self._lazy = None
            raise
        except Error:
            self._lazy = None  # the save failed: said once
            raise
        if partial:
            return  # later items are still being copied
        self._finishing = lazy  # drops the one before, long finished
        self._lazy = None

    def _own_lazy_committed(self, step, timeout=None):
        """If this client's newest lazy save (running, or copied and committing) is of
        `step`, waits for its commit (raising its error): meta may not know the version
        before that, and this client's waits and loads see its own saves. Returns the
        seconds left of `timeout`."""
        for lazy in (self._lazy, self._finishing):
            if lazy is not None and lazy.step == step:
                import time
                start = time.monotonic()
                lazy.result(timeout)
                if timeout is not None:
                    return max(0.0, float(timeout) - (time.monotonic() - start))
                break
        return timeout

    def wait(self, step, level="protected", timeout=None):
        """Waits until version `step` (of any rank) reaches `level`; timeout in seconds (None: forever)."""
        step = _step(step)
        timeout = self._own_lazy_committed(step, timeout)
        self._c.wait(step, level, None if timeout is None else float(timeout))

    def recommended_interval(self, step_time):
        """How often to checkpoint, for a training step of `step_time` seconds.

        The Young/Daly interval sqrt(2 x C x M): C the median time this client's
        recent saves blocked training (eager: the save; lazy: the save call and
        the waits for its copy), M the job's mean time between failures from
        meta's history of node failures (with none seen yet, the node time meta
        has observed: a lower bound). Returns a dict: steps (>= 1), interval_s,
        checkpoint_cost_s, mtbf_s, mtbf_is_lower_bound, failures_seen,
        observed_node_s, job_nodes and explanation (one sentence with the
        numbers). Raises ckpt.FailedPreconditionError before the first save.
        """
        return self._c.recommended_interval(float(step_time))

    def pause_protection(self, seconds):
        """Holds this node's protection traffic back for `seconds` (at most 60; 0 resumes).

        No new push of replicas or EC segments to peers starts meanwhile (one
        already sending finishes). Returns how long the pause in force lasts.
        """
        return self._c.pause_protection(float(seconds))

    def resume_protection(self):
        """Ends a pause at once."""
        self._c.pause_protection(0.0)

    def protection_paused(self, max_seconds=10.0):
        """Context manager: protection traffic paused for the block (at most max_seconds).

            with client.protection_paused():
                dist.all_reduce(grads)
        """
        return _PausedProtection(self, max_seconds)

    def latest(self, level="protected"):
        """The newest step at `level` or better, or None if there is none."""
        return self._c.latest(level)

    def load(self, step):
        """This rank's state of `step`, in the structure it was saved in.

        Every item is copied out of the store into fresh arrays or tensors,
        its checksum checked while it is copied (a corrupt local copy makes
        the agent verify and fall back to another source).
        Errors: ckpt.NotFoundError (unknown step), ckpt.FailedPreconditionError
        (version not staged), ckpt.DataLossError (every copy is corrupt or lost).
        """
        step = _step(step)
        self._own_lazy_committed(step)
        return self._c.load_state(step)[1]

    def load_with_source(self, step):
        """Like load(), but returns (served_from, state): where the shard came from,
        "local", "replica", "ec_decode", "durable" or "unknown"."""
        step = _step(step)
        self._own_lazy_committed(step)
        served_from, state = self._c.load_state(step)
        return served_from, state

    def load_into(self, step, targets):
        """Copies items of `step` straight into existing arrays or tensors, in place.

        `targets` maps item names ("model/layer.0/weight") to C-contiguous,
        writable CPU numpy arrays or torch tensors whose byte size equals the
        item's (only sizes are checked: dtypes and shapes are the caller's
        business). Each item's checksum is checked as it is copied; other
        items of the shard are not read. The fastest restore: one copy, no
        allocation. Errors: those of load(); ckpt.NotFoundError (a name not in
        the shard), ckpt.InvalidArgumentError (a size differs),
        ckpt.DataLossError.
        """
        # Tensors and arrays are resolved in C++; anything else comes back to
        # _load_into_buffer.
        step = _step(step)
        self._own_lazy_committed(step)
        self._c.load_into_targets(step, targets)

    def load_items(self, step):
        """Raw items: (served_from, [(name, dtype, shape, attributes, uint8 array)])."""
        step = _step(step)
        self._own_lazy_committed(step)
        return self._c.load_items(step)

    def global_tensors(self, step):
        """The global tensors of `step` (items saved as ckpt.GlobalSlice), from meta's
        record of the version (no shard is read): {name: (dtype, shape, pieces)}, pieces
        a list of (rank, item name, offsets, lengths), replicas included."""
        step = _step(step)
        self._own_lazy_committed(step)
        return {name: (d, list(shape),
                       [(r, item, list(o), list(n)) for r, item, o, n in pieces])
                for name, (d, shape, pieces) in self._c.global_tensors(step).items()}

    def load_slices(self, step, slices):
        """Loads slices of global tensors of `step`, from whichever ranks' shards hold
        them (any world size: a job relaunched with resize_world=True), into targets:
        `slices` is a list of (name, offsets, lengths, target), target a contiguous
        CPU torch tensor or C-contiguous writable numpy array of exactly the slice's
        elements. Every byte is checked (crc32c); nothing is written before every
        slice is known to be covered and its shards are open. Raises
        ckpt.NotFoundError (no such tensor), ckpt.InvalidArgumentError (a slice
        outside the tensor, a target of another size), ckpt.DataLossError (part of
        a slice is in no shard)."""
        step = _step(step)
        self._own_lazy_committed(step)
        req = [(str(name), [int(o) for o in offsets], [int(n) for n in lengths], _load_into_buffer(name, target))
               for name, offsets, lengths, target in slices]
        self._c.load_slices(step, req)


class DurableVersion:
    """A committed durable-tier version directory (<root>/<job>/<step>) read with no daemon,
    with the global-tensor methods of a Client: global_tensors() and load_slices(), which
    read only the items that overlap each slice (each whole, its crc32c checked). So
    ckpt.torch.load_sharded(ckpt.DurableVersion(path), None, model, optimizer, layout)
    reshards a version offline. `bytes_read` counts what load_slices read."""

    def __init__(self, path):
        self.path = str(path)
        self.step, self._index = _ckpt.durable_global_tensors(self.path)
        self.bytes_read = 0

    def _check(self, step):
        if step is not None and int(step) != self.step:
            raise InvalidArgumentError(f"{self.path} holds step {self.step}, not {step}")

    def global_tensors(self, step=None):
        self._check(step)
        return {name: (d, list(shape), [(r, item, list(o), list(n)) for r, item, o, n in pieces])
                for name, (d, shape, pieces) in self._index.items()}

    def load_slices(self, step, slices):
        self._check(step)
        req = [(str(name), [int(o) for o in offsets], [int(n) for n in lengths], _load_into_buffer(name, target))
               for name, offsets, lengths, target in slices]
        self.bytes_read += _ckpt.read_durable_slices(self.path, req)


def read_durable(path, structured=False):
    """Reads a committed durable-tier version directory (<root>/<job>/<step>) with no daemon.

    Verifies the commit marker, manifest and every checksum. Returns
    {rank: {item_name: value}}: numpy arrays for tensor items (bf16 as uint16
    bit patterns, torch items as numpy too), bytes/int/float/str/bool/None for
    the scalar items; container markers are left out. With structured=True,
    returns {rank: state} rebuilt as Client.load() does. Errors:
    ckpt.NotFoundError (not committed), ckpt.DataLossError (corrupt).
    """
    _, _, _, ranks = _ckpt.read_durable(str(path))
    out = {}
    for rank, items in ranks.items():
        if structured:
            out[rank] = _unflatten(items)
            continue
        flat = {}
        for name, dtype, shape, attrs, data in items:
            kind = attrs.get(_TYPE_KEY)
            if kind in _CONTAINERS:
                continue
            if kind in ("torch", "numpy", "numpy_scalar") or (kind is None and dtype != DType.BYTES):
                flat[name] = _array_of(dtype, shape, data)
            else:
                flat[name] = _leaf(dtype, shape, attrs, data)
        out[rank] = flat
    return out


from . import environment  # noqa: E402  (ckpt.environment.client_config)
from . import torch as _torch_helpers  # noqa: E402,F401  (ckpt.torch)
