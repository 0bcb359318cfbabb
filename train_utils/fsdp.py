"""The kit's FSDP helpers: activation checkpointing of a transformer's blocks,
the backend check, the state each rank holds, and the exit. Which modules
become FSDP units is the task contract's rule, ``common.fsdp_units``, which
the FSDP rung uses too.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.distributed as dist

from common import ConfigError
from .devices import torch_version
from .output import print_line
from .speed import peak_memory_mib

# The first torch whose gloo averages in reduce_scatter(ReduceOp.AVG); older ones sum.
GLOO_AVG_REDUCE_SCATTER = (2, 10)


def check_fsdp_backend() -> None:
    """FSDP2 averages gradients with reduce_scatter(ReduceOp.AVG), which gloo
    before torch 2.10 sums (measured by tests/test_train_utils.py): on the CPU
    the gradients would come out world_size times too large. Refused there."""
    if dist.get_backend() == "gloo" and torch_version() < GLOO_AVG_REDUCE_SCATTER:
        raise ConfigError(f"FSDP on the CPU (gloo) needs torch 2.10 or newer: torch {torch.__version__}'s "
                          f"gloo sums where FSDP averages gradients; pip install 'torch>=2.10', or train on GPUs")


def checkpoint_activations(model: torch.nn.Module) -> torch.nn.Module:
    """--activation_checkpointing: make each transformer block of ``model`` (its
    ``blocks`` ModuleList) keep only its input in the forward pass and recompute
    its activations in the backward pass (``torch.utils.checkpoint``,
    non-reentrant, the RNG state kept: the same dropout masks, so the same
    losses and gradients). Less memory per block (its input instead of every
    activation inside it), about one more forward pass of time. In place,
    before DDP or ``fully_shard`` wrap it: parameters and state_dict keys
    stay as they are, so snapshots load with or without it. Returns ``model``.
    Raises ConfigError for a model without transformer blocks."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        raise ConfigError(f"--activation_checkpointing recomputes each transformer block of the model "
                          f"(a `blocks` ModuleList, as --dataset shakespeare_char's gpt has); "
                          f"{type(model).__name__} has none: leave the flag out")
    for block in blocks:
        block.forward = functools.partial(_recomputed, block.forward)  # the block's own forward, bound
    return model


def _recomputed(forward, *args, **kwargs):
    """``forward(*args, **kwargs)`` under ``torch.utils.checkpoint``: its
    activations are recomputed in the backward pass instead of kept."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


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


def training_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Collective: the bytes of training state a rank holds, and what DDP would hold.

    Counts parameters, their gradients (``.grad``; None counts 0) and every
    tensor of the optimizer's state (SGD: one momentum buffer per parameter;
    created at the first step, so call this after one), each as this rank's
    local shard. Returns the rank holding the most (shards of a dimension that
    does not divide by the world size are uneven): {"params", "grads",
    "optimizer", "total", "rank"} in bytes, plus "ddp_total", the bytes of
    the same tensors at full size, which every DDP rank holds (DDP's gradient
    buckets, a second copy of the gradients by default, not included).
    """
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
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, local)
    return max(ranks, key=lambda entry: entry["total"])


def _size(n_bytes: float) -> str:
    """Bytes in binary units: 512 B, 16.5 KiB, 4.62 MiB, 1.20 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.{1 if unit == 'KiB' else 2}f} {unit}"
    return f"{n_bytes:.0f} B"


def print_sharded_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         device: torch.device) -> None:
    """Collective: rank 0 prints the state each rank holds, once gradients and
    optimizer state exist (after the first optimizer step), e.g.
    ``state per rank: 8.6 KiB = params 2.9 KiB + grads 2.9 KiB + optimizer 2.9 KiB (8844
    bytes, rank 0 of 2); DDP would hold 16.5 KiB (16908 bytes), 1.91x``, from
    ``training_state_bytes``; on CUDA followed by ``| peak GPU memory 123.4 MiB``
    (``torch.cuda.max_memory_allocated``, the maximum over ranks, this epoch so far)."""
    state = training_state_bytes(model, optimizer)
    world_size = dist.get_world_size()
    line = (f"state per rank: {_size(state['total'])} = params {_size(state['params'])} + grads "
            f"{_size(state['grads'])} + optimizer {_size(state['optimizer'])} ({state['total']} "
            f"bytes, rank {state['rank']} of {world_size}); DDP would hold "
            f"{_size(state['ddp_total'])} ({state['ddp_total']} bytes), "
            f"{state['ddp_total'] / state['total']:.2f}x")
    peak = peak_memory_mib(device)
    if peak:
        line += f" | peak GPU memory {peak['peak_gpu_memory_mib']:.1f} MiB"
    if dist.get_rank() == 0:
        print_line(line)


def exit_skipping_teardown(status: int = 0) -> None:
    """Flush stdout and stderr, then end the process with ``status`` at once
    (``os._exit``), skipping the interpreter's teardown: for the end of an
    FSDP run (0, or --check_resume's verdict), after ``destroy_process_group``, since once DTensors
    exist the process group outlives it and gloo's threads can abort the
    teardown (docs/fsdp.md). Everything the scripts write is closed and
    fsynced before this point (train.py finishes the W&B run before: wandb's
    own exit hook does not run after ``os._exit``).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
