"""FSDP2: a model sharded over every rank (FSDP) or within each node's ranks
and replicated across nodes (HSDP), the backend check, the state each rank
holds. Which modules become FSDP units is the task contract's rule,
``common.fsdp_units``, which the FSDP rung uses too.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

import common
from common import ConfigError
from ..output import print_line
from .devices import peak_memory_mib, torch_version
from .timeouts import follow_run_timeout

# The first torch whose gloo averages in reduce_scatter(ReduceOp.AVG); older ones sum.
GLOO_AVG_REDUCE_SCATTER = (2, 10)


class _Sharded:
    """Whether this process sharded a model (``shard_model``). Per process on
    purpose, as the process group it concerns is: ``model_sharded`` is read
    at the process's end (``ending.end_process``), after train.py's objects
    are gone."""

    model = False


_SHARDED = _Sharded()


def check_fsdp_backend() -> None:
    """FSDP2 averages gradients with reduce_scatter(ReduceOp.AVG), which gloo
    before torch 2.10 sums (measured by tests/test_train_utils.py): on the CPU
    the gradients would come out world_size times too large. Refused there."""
    if dist.get_backend() == "gloo" and torch_version() < GLOO_AVG_REDUCE_SCATTER:
        raise ConfigError(f"FSDP on the CPU (gloo) needs torch 2.10 or newer: torch {torch.__version__}'s "
                          f"gloo sums where FSDP averages gradients; pip install 'torch>=2.10', or train on GPUs")


def shard_model(model: torch.nn.Module, device: torch.device, dtype: Optional[torch.dtype],
                shard_size: int = 0) -> torch.nn.Module:
    """Shard ``model`` (already on ``device``, or on the meta device:
    ``meta_build.build_on_meta``, then ``materialize_shards`` gives it this
    rank's shards) in place with FSDP2; return it.

    Each of ``common.fsdp_units`` becomes one FSDP unit, then the root takes the
    parameters left; a unit's are all-gathered just before its forward and backward.
    ``shard_size`` 0: over every rank (FSDP). Else HSDP (--strategy hsdp): a 2-D
    device mesh of world_size / shard_size replicas x ``shard_size`` ranks, each
    unit sharded within its replica's ranks (all-gathers and reduce-scatters
    among them) and replicated across replicas (gradients all-reduced among the
    ranks holding the same shard): ``hsdp_mesh``.
    ``dtype`` (--amp's bf16 or fp16): gathered and used in it, reduced and kept in fp32, the
    root's output left in it (the loss casts it: ``loop.training_loss``);
    BatchNorm stays fp32, each a unit of its own (bf16 BatchNorm fails on a CPU).
    Under --compile the units are compiled before this (torchtitan's order:
    ``loop.compile_blocks``, train.py's ``build_model``), so FSDP's hooks run
    between compiled blocks."""
    # FSDP and DCP are imported where --strategy fsdp uses them (here and the sharded
    # snapshots): with DTensor and sympy they cost every DDP process 0.5 s of start-up.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    contiguous_parameters(model)  # fully_shard refuses channels-last weights
    # A mesh of this device type: fully_shard's default, the accelerator's, fails gloo.
    mesh = hsdp_mesh(device, shard_size) if shard_size else init_device_mesh(device.type, (dist.get_world_size(),))
    if dtype:
        norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        for norm in norms:
            fully_shard(norm, mesh=mesh, mp_policy=MixedPrecisionPolicy(torch.float32, output_dtype=dtype))
    for block in common.fsdp_units(model):
        if not isinstance(block, FSDPModule):  # not a BatchNorm sharded above
            fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(dtype, torch.float32))
    # The root's output stays in the compute dtype: the loss casts it (loop.fp32), inside its
    # compiled graph under --compile, not as a separate copy of the whole (B x T, vocab) logits.
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(dtype, torch.float32))
    _SHARDED.model = True
    return model


def model_sharded() -> bool:
    """Whether this process sharded a model with ``shard_model``: its DTensors
    keep the process group alive past ``destroy_process_group`` (torch 2.15),
    and gloo's threads can then abort the interpreter's teardown, so the
    process ends without it (``ending.end_process``)."""
    return _SHARDED.model


def hsdp_mesh(device: torch.device, shard_size: int):
    """HSDP's 2-D ``DeviceMesh`` of ``device``'s type: (world_size / shard_size
    replicas, ``shard_size`` ranks), dimensions named "replicate" and "shard"
    (the FSDP2 docs' and torchtitan's names). Consecutive ranks form a replica:
    torchrun and srun number a node's ranks consecutively, so with a node's
    ranks as ``shard_size`` (the default) a parameter's shards stay within a
    node and only the gradients' all-reduce crosses nodes."""
    from torch.distributed.device_mesh import init_device_mesh

    replicas = dist.get_world_size() // shard_size
    mesh = init_device_mesh(device.type, (replicas, shard_size), mesh_dim_names=("replicate", "shard"))
    # Each dimension's groups are new ones with torch's default time-out: they follow the run's, so
    # that a rank stuck while the others wait in one is named within --pg_timeout_s.
    follow_run_timeout(mesh.get_group("replicate"), mesh.get_group("shard"))
    return mesh


def contiguous_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """Make every parameter of ``model`` contiguous in place (same Parameter
    objects, same values, row-major strides); return ``model``.

    For ``fully_shard``, which raises NotImplementedError on a parameter with
    other strides: a channels-last ResNet's conv weights (vision_tasks makes
    ResNets channels-last where CUDA is available). The inputs stay
    channels-last, so cuDNN still picks its channels-last kernels; call it
    before building the optimizer.
    """
    for param in model.parameters():
        if not param.is_contiguous():
            param.data = param.data.contiguous()
    return model


def _local_and_full_bytes(tensor: torch.Tensor) -> tuple[int, int]:
    """(bytes this rank stores, bytes of the whole tensor) of a DTensor (FSDP's
    sharded parameters, gradients, optimizer state) or a plain tensor (both the same)."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size(), tensor.numel() * tensor.element_size()


def local_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The bytes of training state this rank holds (no collective): its
    local shards of the parameters, of their gradients (``.grad``; None
    counts 0) and of every tensor of the optimizer's state (SGD: one
    momentum buffer per parameter; AdamW: two moments and a 0-dim step;
    created at the first step), each shard's numel x element size (meta
    and fake tensors count as real ones). Returns {"params", "grads",
    "optimizer", "total", "rank", "ddp_total"} in bytes, "ddp_total" the
    same tensors at full size, which every DDP rank holds."""
    local = {"params": 0, "grads": 0, "optimizer": 0}
    full = 0
    for param in model.parameters():
        for kind, tensor in (("params", param), ("grads", param.grad)):
            if tensor is not None:
                mine, whole = _local_and_full_bytes(tensor)
                local[kind] += mine
                full += whole
    for state in optimizer.state.values():
        for tensor in state.values():
            if isinstance(tensor, torch.Tensor):
                mine, whole = _local_and_full_bytes(tensor)
                local["optimizer"] += mine
                full += whole
    local.update(total=sum(local.values()), rank=dist.get_rank(), ddp_total=full)
    return local


def training_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Collective: the bytes of training state a rank holds, and what DDP would hold.

    Each rank's ``local_state_bytes`` (parameters, gradients, optimizer state,
    its local shards; call it after the first optimizer step), gathered.
    Returns the rank holding the most (shards of a dimension that does not
    divide by the world size are uneven): {"params", "grads", "optimizer",
    "total", "rank"} in bytes, plus "ddp_total", the bytes of the same
    tensors at full size, which every DDP rank holds (DDP's gradient
    buckets, a second copy of the gradients by default, not included).
    """
    local = local_state_bytes(model, optimizer)
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, local)
    return max(ranks, key=lambda entry: entry["total"])


def binary_size(n_bytes: float) -> str:
    """Bytes in binary units: 512 B, 16.5 KiB, 4.62 MiB, 1.20 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.{1 if unit == 'KiB' else 2}f} {unit}"
    return f"{n_bytes:.0f} B"


def state_line(state: dict, world_size: int) -> str:
    """The memory line's text of ``state`` (``training_state_bytes``' or, for
    a plan, ``local_state_bytes``' dict) at ``world_size`` ranks: ``state per
    rank: TOTAL = params P + grads G + optimizer O (N bytes, rank R of W);
    DDP would hold D (M bytes), D/Nx``."""
    return (f"state per rank: {binary_size(state['total'])} = params {binary_size(state['params'])} + grads "
            f"{binary_size(state['grads'])} + optimizer {binary_size(state['optimizer'])} ({state['total']} "
            f"bytes, rank {state['rank']} of {world_size}); DDP would hold "
            f"{binary_size(state['ddp_total'])} ({state['ddp_total']} bytes), "
            f"{state['ddp_total'] / state['total']:.2f}x")


def print_sharded_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         device: torch.device) -> None:
    """Collective: rank 0 prints the state each rank holds, once gradients and
    optimizer state exist (after the first optimizer step), e.g.
    ``state per rank: 8.6 KiB = params 2.9 KiB + grads 2.9 KiB + optimizer 2.9 KiB (8844
    bytes, rank 0 of 2); DDP would hold 16.5 KiB (16908 bytes), 1.91x``, from
    ``training_state_bytes``; on CUDA followed by ``| peak GPU memory 123.4 MiB``
    (``torch.cuda.max_memory_allocated``, the maximum over ranks, this epoch so far)."""
    state = training_state_bytes(model, optimizer)
    line = state_line(state, dist.get_world_size())
    peak = peak_memory_mib(device)
    if peak:
        line += f" | peak GPU memory {peak['peak_gpu_memory_mib']:.1f} MiB"
    if dist.get_rank() == 0:
        print_line(line)
