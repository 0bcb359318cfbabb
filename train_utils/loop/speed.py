"""How the steps run: bf16 or fp16 autocast (--amp), torch.compile (--compile),
and a transformer's activations recomputed instead of kept
(--activation_checkpointing).
"""

from __future__ import annotations

import contextlib
import functools
import signal
import socket
from typing import Callable, Optional

import torch
import torch.distributed as dist

from common import ConfigError
from ..output import print_line
from .stop import STOP_SIGNALS


# Models for which bf16 autocast speeds up training on a CPU with native bf16
# instructions (AVX512-BF16/AMX); the figures are in docs/performance.md.
AMP_HELPS_ON_CPU = ("cnn",)


def _native_bf16(device: torch.device) -> bool:
    """Whether ``device`` runs bf16 natively: a CUDA GPU of compute capability
    8.0 (Ampere) or newer, or a CPU with AVX512-BF16/AMX."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_amp(amp: Optional[str], device: torch.device) -> Optional[str]:
    """--amp as the whole job runs it (the dtype it means:
    ``RunConfig.compute_dtype``): ``amp`` itself (None, "auto", "bf16" or
    "fp16"), except on CUDA, where "auto" becomes "bf16" when every rank's
    GPU has native bf16 (``_native_bf16``) and "fp16" (with a loss scaler)
    when any has not; elsewhere "auto" is bf16 (on a CPU without native bf16
    ``check_amp`` refuses it). Per rank, a job on a mixed partition (Ampere
    and older GPUs) would train some ranks in bf16 and others in fp16: DDP
    would average scaled with unscaled gradients, and under FSDP the loss
    scaler's inf check of the fp16 ranks would wait for partners that never
    come. On the mixed job rank 0 prints a ``note:`` line naming the GPUs
    without bf16.

    Collective on CUDA under a process group: every rank's answer is gathered
    (all_gather_object). Raises ConfigError on every rank for a forced
    ``--amp bf16`` where some GPU has no native bf16, naming them. Elsewhere
    (the CPU, XPU, MPS: one answer for every rank) returns ``amp`` at once.
    """
    if device.type != "cuda":
        return amp
    mine = {"bf16": _native_bf16(device), "gpu": torch.cuda.get_device_name(device),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
            "host": socket.gethostname()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    without = [rank for rank, info in enumerate(everyone) if not info["bf16"]]
    if amp not in ("auto", "bf16") or not without:
        return amp if amp != "auto" else "bf16"
    gpus = "; ".join(sorted({f"{info['gpu']} (compute capability {info['capability']}) on {info['host']}"
                             for info in everyone if not info["bf16"]}))
    ranks = (f"rank {without[0]} of {len(everyone)} runs on a GPU" if len(without) == 1
             else f"ranks {without} of {len(everyone)} run on GPUs")
    if amp == "bf16":
        raise ConfigError(f"--amp bf16: {ranks} without native bf16 ({gpus}), "
                          f"which needs compute capability 8.0 (Ampere) or newer; bf16 autocast would be "
                          f"emulated and slower there. Use --amp (fp16 with a loss scaler on every rank)")
    if len(without) < len(everyone) and dist.get_rank() == 0:
        print_line(f"note: --amp is fp16 with a loss scaler on every rank: {ranks} without native bf16 "
                   f"({gpus}), and every rank must train in the same dtype")
    return "fp16"


def check_amp(amp: Optional[str], device: torch.device, model: str) -> None:
    """Raise ConfigError for an --amp that would make training slower.

    On CUDA, plain --amp is bf16 autocast where the GPU has native bf16
    (Ampere or newer) and fp16 with a loss scaler before (T4, V100);
    ``--amp bf16`` forced on a GPU without native bf16 is refused (emulated,
    slower). On a CPU plain --amp only helps with native bf16 instructions,
    and only for some models (``AMP_HELPS_ON_CPU``, measured); elsewhere it
    would silently cost speed and precision, so it is refused in one line.
    A forced ``--amp bf16``/``--amp fp16`` runs on a CPU anyway (to try the
    path before a GPU job).
    """
    if amp is None or (device.type == "cpu" and amp != "auto"):
        return
    if device.type not in ("cpu", "cuda"):  # XPU, MPS: autocast as asked; untested here
        return
    if device.type == "cuda":
        if amp == "bf16" and not _native_bf16(device):
            major, minor = torch.cuda.get_device_capability(device)
            raise ConfigError(f"--amp bf16: {torch.cuda.get_device_name(device)} (compute capability "
                              f"{major}.{minor}) has no native bf16, which needs 8.0 (Ampere) or "
                              f"newer; bf16 autocast would be emulated and slower. Use --amp "
                              f"(fp16 with a loss scaler on this GPU)")
        return
    if model not in AMP_HELPS_ON_CPU:
        name = f"--model {model}" if model else "this task's model (measured: only --model cnn)"
        raise ConfigError(f"--amp on a CPU: bf16 autocast does not speed up {name} "
                          f"on a CPU (measured, see docs/performance.md); "
                          f"--amp is for GPUs (--amp bf16 or fp16 forces it). Run without --amp")
    if not _native_bf16(device):
        raise ConfigError("--amp on a CPU: this CPU has no native bf16 instructions "
                          "(AVX512-BF16 or AMX), so bf16 autocast would be slower; "
                          "--amp is for GPUs (--amp bf16 or fp16 forces it). Run without --amp")


def autocast(device: torch.device, dtype: Optional[torch.dtype]):
    """Autocast on ``device`` to ``dtype`` (--amp's: ``RunConfig.compute_dtype``;
    the forward pass and the loss; backward follows the forward's dtypes),
    or, for None (no --amp), a context that does nothing.

    Reusable, one ``with`` after another (not nested): make it once, not per step.
    """
    if dtype is None:
        return contextlib.nullcontext()  # cheaper than an autocast(enabled=False) per step
    return torch.autocast(device.type, dtype=dtype)


def compile_model(model: torch.nn.Module, enabled: bool) -> torch.nn.Module:
    """``torch.compile(model)`` when ``enabled``, else ``model`` itself.

    The compiled module shares ``model``'s parameters; the scripts call it for
    the training forward only, and keep saving ``model`` (or its DDP
    ``.module``), so saved state_dicts have no ``_orig_mod.`` prefix and load
    without compile. For DDP, pass the DDP-wrapped model: compiling after
    wrapping lets TorchDynamo's DDP optimizer split the graph at the gradient
    buckets, so all-reduce still overlaps with backward. (An FSDP model's
    blocks are compiled one by one instead, before sharding: ``compile_blocks``.)
    """
    if not enabled:
        return model
    with _compile_workers_spared():
        return torch.compile(model)


def fp32(output):
    """``output`` in fp32 where it is a floating tensor of another dtype (the
    bf16 or fp16 logits of autocast, or of FSDP's mixed precision), else as
    it is (an fp32 tensor is returned itself, not copied; a model's output
    that is no tensor passes unchanged)."""
    return output.float() if isinstance(output, torch.Tensor) and output.is_floating_point() else output


def training_loss(loss_fn: Callable[..., torch.Tensor], compiled: bool) -> Callable[..., torch.Tensor]:
    """The training step's loss: ``loss_fn(output, targets)`` with the output
    in fp32 (``fp32``), as autocast computes a cross-entropy or an MSE; with
    ``compiled`` (--compile), compiled as a graph of its own, as torchtitan
    compiles its loss: the cast, the log-softmax and the likelihood fuse
    into a pass or two over the logits, and their backward likewise, where
    eagerly each reads and writes the whole (B x T, vocab) tensor (at GPT-2's
    50,304 tokens, gigabytes a step). The model's graph is compiled apart
    (``compile_model``, ``compile_blocks``); evaluation calls ``loss_fn``
    itself, with its own reduction."""
    def loss(output, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(fp32(output), targets)

    if not compiled:
        return loss
    with _compile_workers_spared():
        return torch.compile(loss)


def compile_blocks(blocks: list) -> None:
    """Compile each module of ``blocks`` in place, before FSDP shards it
    (``distributed.shard_model``, --strategy fsdp --compile): its ``forward``
    becomes ``torch.compile(forward)``, so FSDP's hooks, which gather a
    block's parameters before its forward and free them after, run eagerly
    around the compiled forward, and the model's graph has no break at them.
    torchtitan's order (``apply_compile`` before ``apply_fsdp``: each
    transformer block compiled, then sharded); blocks of one class share
    one compiled graph. A whole FSDP model compiled at once breaks its graph at
    every unit's hooks instead (counted in tests/test_fsdp.py). Parameters and
    state_dict keys stay as they are: snapshots load with or without it. The
    root's own layers (embeddings, the last norm and output layer) run eagerly."""
    with _compile_workers_spared():
        for block in blocks:
            block.forward = torch.compile(block.forward)  # the block's own (or checkpointed) forward, bound


@contextlib.contextmanager
def _compile_workers_spared():
    """Around ``torch.compile``: inductor's compile workers start with the
    stop signals blocked, so that a stop meant for the rank does not kill
    them. torchrun signals a rank's whole process group, and Slurm every
    process of a job step: the workers would die of it ("SubprocPool unclean
    exit"). They inherit the mask; the rank's own mask is restored after.
    Some releases start the pool when torch.compile imports inductor, others
    on first use: it is started here, under the mask, either way. (Windows
    has no signal masks, nor Slurm: nothing is masked there.)"""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
        from torch._inductor.async_compile import AsyncCompile
        AsyncCompile.warm_pool()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


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
