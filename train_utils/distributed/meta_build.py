"""A task's model built without memory (on PyTorch's meta device), then, once
FSDP has sharded it, each rank's shards materialised and given the initial
weights the model would have had if built whole on the CPU.

Building on the meta device runs the model's own construction code (its
``__init__``, its initialisation) with tensors that have shapes and no data.
``build_on_meta`` records, in order, the calls that write a tensor's values
(``nn.init.normal_``, ``Tensor.uniform_``, ``fill_``, ``copy_``, ``torch.ones``,
``torch.tril``, ...). ``materialize_shards`` replays them on the CPU from the
global random state the build started from: each recorded call runs on a
full-size CPU tensor, so it draws exactly the random numbers the eager build
draws, in the same order; after the last call that writes a parameter or
buffer, this rank's shard of it (its slice of dim 0, as FSDP2's ``Shard(0)``
places it) is copied into the sharded parameter and the CPU tensor is freed.
A value that a later call overwrites whole without reading it (a
constructor's default init, redrawn by the model's own) is freed at once.
The extra memory at any moment is the tensors whose values are still to be
read: for ``gpt.GPT``, one parameter at most (its largest). The
weights come out bitwise those of the eager build: the same at every world
size, and DDP's (which builds the model whole on every rank).

What cannot be replayed this way is refused with one line (``ConfigError``):
construction code that reads a tensor's values in Python (``.item()``,
``.tolist()``, a condition on a value: a meta tensor has none) or that puts a
tensor on another device itself. The torch function mode that records is
torch's public ``torch.overrides.TorchFunctionMode``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from common import ConfigError

# Calls that write every element of their target (when the target covers its whole storage) without reading
# it: the value before them is dead. Tensor methods and torch.nn.init functions of these names both.
_PURE_WRITES = frozenset({
    "normal_", "uniform_", "zero_", "fill_", "copy_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
    "bernoulli_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_", "xavier_normal_",
    "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "orthogonal_", "sparse_"})
# In-place calls that change a tensor's metadata, not its values: nothing to replay (each recorded call keeps
# the sizes and strides its tensors had).
_METADATA_ONLY = frozenset({
    "requires_grad_", "share_memory_", "retain_grad", "squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_",
    "swapaxes_", "as_strided_", "detach_", "rename_", "__set__"})
_IN_PLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})
# Calls that make a tensor with no defined values: nothing to compute, the replay's tensor is made when used.
_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


@dataclasses.dataclass(frozen=True)
class _View:
    """A meta tensor as a recorded call saw it: its storage (``key``) and how it looked into it."""

    key: int
    size: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype


@dataclasses.dataclass
class _Call:
    """One recorded call: ``func(*args, **kwargs)``, its meta tensors as ``_View``s. ``writes``: the
    storage it writes in place (None: it makes new tensors, ``outputs``: (index among its flattened
    outputs, view) of each new storage); ``pure``: it overwrites ``writes`` whole without reading it;
    ``reads``: the storages whose values it reads; ``allocation``: it only allocates ``outputs``."""

    func: Callable
    args: tuple
    kwargs: dict
    writes: Optional[int]
    pure: bool
    reads: frozenset
    outputs: tuple = ()
    allocation: bool = False

    def touches(self) -> set:
        return set(self.reads) | ({self.writes} if self.writes is not None else set()) | \
            {view.key for _, view in self.outputs}


@dataclasses.dataclass
class InitRecord:
    """What ``build_on_meta`` recorded of a model's construction, for
    ``materialize_shards``: the calls that wrote tensor values, in order;
    the CPU's global random state when the build began (a torch ByteTensor,
    ``torch.random.get_rng_state``); the element count and dtype of each
    storage (by key); and, by fully-qualified name, the view of every
    parameter and buffer of the built model (tied ones under each name)."""

    calls: list
    rng_state: torch.Tensor
    storages: dict
    final: dict
    replay_peak_bytes: int = 0  # set by materialize_shards: the most bytes its CPU tensors held at once


def _key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage (views of one storage share it)."""
    return tensor.untyped_storage()._cdata


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


class _Recorder(TorchFunctionMode):
    """A torch function mode that records, of every outermost torch call
    touching a meta tensor, those that write tensor values (``_Call``).
    The calls nested in a recorded one (``nn.init.kaiming_uniform_``'s
    ``uniform_``) run below the mode: the outer call is replayed whole."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []
        self.storages: dict = {}  # key -> (its untyped storage, kept alive so no key is reused; dtype)

    def _view(self, value: Any) -> Any:
        if not _is_meta(value):
            return value
        key = _key(value)
        if key not in self.storages:
            self.storages[key] = (value.untyped_storage(), value.dtype)
        return _View(key, tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        known = set(self.storages)
        # The views as the call sees them, before an in-place call changes them.
        view_args, view_kwargs = tree_map(self._view, args), tree_map(self._view, kwargs)
        out = func(*args, **kwargs)
        in_place = (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_DUNDERS
        if name in _METADATA_ONLY:
            return out
        # The tensor written in place: out=, else an in-place call's first (nn.init's pass it as tensor=).
        target, view = kwargs.get("out"), view_kwargs.get("out")
        if not _is_meta(target) and in_place:
            target, view = (args[0], view_args[0]) if args else (kwargs.get("tensor"), view_kwargs.get("tensor"))
        read = {value.key for value in tree_flatten((view_args, view_kwargs))[0] if isinstance(value, _View)}
        if _is_meta(target):
            whole = (target.is_contiguous() and view.offset == 0
                     and target.numel() * target.element_size() == target.untyped_storage().nbytes())
            pure = name in _PURE_WRITES and whole
            if pure:
                read.discard(view.key)
            self.calls.append(_Call(func, view_args, view_kwargs, view.key, pure, frozenset(read)))
            return out
        outputs = tuple((index, self._view(value)) for index, value in enumerate(tree_flatten(out)[0])
                        if _is_meta(value) and _key(value) not in known)
        if outputs:  # new tensors (not views of the call's inputs): their values are made here
            self.calls.append(_Call(func, view_args, view_kwargs, None, False, frozenset(read), outputs,
                                    allocation=name in _ALLOCATIONS))
        return out


def build_on_meta(factory: Callable[[], nn.Module]) -> tuple[nn.Module, InitRecord]:
    """The model ``factory()`` makes (a task's ``common.Task.model_factory``),
    built on the meta device: every parameter and buffer has its shape and
    dtype and no memory, so any size builds on any machine in about the
    time its Python takes. Returns (the model, the ``InitRecord`` of its
    construction, which ``materialize_shards`` replays once the model is
    sharded). The global random state is left as it was (nothing is drawn).

    For a model's sizes alone (parameter counts, a dry run), use the model
    and drop the record. Raises ConfigError (one line) when the factory
    cannot run on the meta device (it reads a tensor's values, or puts a
    tensor on a device of its own choosing)."""
    rng_state = torch.random.get_rng_state()
    recorder = _Recorder()
    try:
        with torch.device("meta"), recorder:
            model = factory()
    except (NotImplementedError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"the task's model factory cannot build the model on the meta device "
                          f"({type(exc).__name__}: {first}); build it without reading tensor values "
                          f"(.item(), .tolist()), or give the Task a built model (docs/custom-task.md)") from None
    final = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        if not _is_meta(tensor):
            raise ConfigError(f"the task's model factory put {name} on {tensor.device}, not the meta device: "
                              f"make its tensors without a device argument (the kit places them), or give "
                              f"the Task a built model (docs/custom-task.md)")
        final[name] = recorder._view(tensor)
    storages = {key: (storage.nbytes(), dtype) for key, (storage, dtype) in recorder.storages.items()}
    return model, InitRecord(recorder.calls, rng_state, storages, final)


def _this_ranks_slice(full: torch.Tensor, sharded: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` (a whole parameter, on the CPU) that ``sharded``
    holds on this rank: for a DTensor, its ``Shard(d)`` placements applied as
    DTensor applies them (``torch.chunk`` along d, the mesh dimension's
    local rank taking its chunk, none left for ranks past the last chunk),
    ``Replicate`` keeping all; a plain tensor holds all of it."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(sharded, DTensor):
        return full
    part = full
    for mesh_dim, placement in enumerate(sharded.placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(part, sharded.device_mesh.size(mesh_dim), dim=placement.dim)
            index = sharded.device_mesh.get_local_rank(mesh_dim)
            part = chunks[index] if index < len(chunks) else part.narrow(placement.dim, 0, 0)
    local = sharded.to_local()
    if part.shape != local.shape:
        raise RuntimeError(f"this rank's shard of a {tuple(full.shape)} parameter is {tuple(local.shape)}, "
                           f"not the {tuple(part.shape)} its placements {sharded.placements} give")
    return part


@torch.no_grad()
def materialize_shards(model: nn.Module, record: InitRecord, device: torch.device) -> nn.Module:
    """Give ``model`` (from ``build_on_meta``, sharded since or not) memory on
    ``device`` (``Module.to_empty``: each rank allocates only its shards) and
    the initial values of its construction: the recorded calls replayed on
    the CPU from ``record.rng_state`` (the global CPU random state then ends
    where the eager build leaves it), each parameter's and buffer's last
    value copied, this rank's slice of it only (``_this_ranks_slice``), as
    soon as it is final. Peak extra memory: the CPU tensors still to be read
    (for a GPT: its largest parameter). Returns ``model``. Raises
    RuntimeError when a parameter's shard is not where FSDP2's placements
    put it, or when a parameter or buffer was given no value by any
    recorded call."""
    model.to_empty(device=device)
    tensors = {**dict(model.named_parameters(remove_duplicate=False)),
               **dict(model.named_buffers(remove_duplicate=False))}
    targets: dict = {}  # storage key -> the model's tensors holding it (name, the view of it when built)
    for name, view in record.final.items():
        targets.setdefault(view.key, []).append((name, view))
    calls = record.calls
    next_touch: list = [None] * len(calls)  # per call: {key: the index of the next call touching it}
    upcoming: dict = {}
    for index in range(len(calls) - 1, -1, -1):
        next_touch[index] = {key: upcoming.get(key) for key in calls[index].touches()}
        for key in calls[index].touches():
            upcoming[key] = index
    untouched = sorted(name for key, entries in targets.items() if key not in upcoming for name, _ in entries)
    if untouched:
        raise RuntimeError(f"no recorded call gave {', '.join(untouched)} a value: not built on the meta device")
    temps: dict = {}  # key -> a 1-D CPU tensor over the storage's bytes, in its dtype

    def storage(key: int) -> torch.Tensor:
        if key not in temps:
            nbytes, dtype = record.storages[key]
            temps[key] = torch.empty(nbytes // dtype.itemsize, dtype=dtype)
            record.replay_peak_bytes = max(record.replay_peak_bytes,
                                           sum(temp.untyped_storage().nbytes() for temp in temps.values()))
        return temps[key]

    def real(value: Any) -> Any:
        if isinstance(value, _View):
            base = storage(value.key)
            base = base if base.dtype == value.dtype else base.view(value.dtype)
            return torch.as_strided(base, value.size, value.stride, value.offset)
        if isinstance(value, torch.device) and value.type == "meta":
            return torch.device("cpu")
        return value

    torch.random.set_rng_state(record.rng_state)
    record.replay_peak_bytes = 0
    for index, call in enumerate(calls):
        if call.pure:
            temps.pop(call.writes, None)  # its old value is dead: a fresh tensor to write
        if not call.allocation:
            out = call.func(*tree_map(real, call.args), **tree_map(real, call.kwargs))
            flat_out = tree_flatten(out)[0]
            for position, view in call.outputs:  # the new tensors' storages, as 1-D tensors of their dtype
                made = flat_out[position]
                whole = made.untyped_storage()
                temps[view.key] = torch.empty(0, dtype=made.dtype).set_(
                    whole, 0, (whole.nbytes() // made.element_size(),), (1,))
            record.replay_peak_bytes = max(record.replay_peak_bytes,
                                           sum(temp.untyped_storage().nbytes() for temp in temps.values()))
        for key, following in next_touch[index].items():
            if following is None:  # its last value: into this rank's shard of each tensor holding it
                for name, view in targets.get(key, ()):
                    sharded = tensors[name]
                    part = _this_ranks_slice(real(view), sharded)
                    local = sharded.to_local() if hasattr(sharded, "to_local") else sharded
                    local.copy_(part)
                temps.pop(key, None)
            elif calls[following].pure and calls[following].writes == key:
                temps.pop(key, None)  # overwritten whole before anything reads it
    return model
