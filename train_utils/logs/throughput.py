"""What training is measured in beyond samples per second: tokens per second
(a language model), the model FLOP/s achieved (the model's FLOPs per sample,
its own formula or counted once at start) and, on a GPU of known peak, the
model FLOPs utilization (MFU) against the peak of the precision it computes in.
"""

from __future__ import annotations

import os
import re
from types import MappingProxyType
from typing import Optional

import torch
import torch.distributed as dist


# Dense peak FLOP/s per GPU from NVIDIA's data sheets (no sparsity): bf16 (fp16
# the same) and TF32 on the tensor cores, and plain fp32 on the CUDA cores.
# Sources: "NVIDIA H100 Tensor Core GPU" data sheet (SXM, PCIe, NVL columns;
# its tensor-core figures are with sparsity, halved here); "NVIDIA H200 Tensor
# Core GPU" (SXM, NVL); "NVIDIA A100 Tensor Core GPU" (fp32 19.5, TF32 156,
# bf16 312 TFLOP/s dense); "NVIDIA L4 Tensor Core GPU" (fp32 30.3); "NVIDIA
# A10 Tensor Core GPU" (fp32 31.2). Used for MFU (``throughput_figures``, by
# the precision the training computes in: ``loop.compute_precision``) and
# by the benchmark (benchmarks/gpu.py, gpu_costs.py).
_HOPPER_SXM = MappingProxyType({"bf16": 989e12, "fp16": 989e12, "tf32": 495e12, "fp32": 67e12})
_HOPPER_NVL = MappingProxyType({"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12})
GPU_PEAKS = MappingProxyType({
    "H100 80GB HBM3": _HOPPER_SXM, "H100 SXM": _HOPPER_SXM, "H200": _HOPPER_SXM,
    "H100 PCIe": MappingProxyType({"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    "H100 NVL": _HOPPER_NVL, "H200 NVL": _HOPPER_NVL,
    "A100": MappingProxyType({"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    "L4": MappingProxyType({"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    "A10": MappingProxyType({"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12})})
PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


def gpu_peak(name: str) -> Optional[MappingProxyType]:
    """The data-sheet dense peaks in FLOP/s of the GPU called ``name``
    (``torch.cuda.get_device_name``), one per precision of ``PRECISIONS``
    ({"bf16": ..., "fp16": ..., "tf32": ..., "fp32": ...}), matched as whole
    words, longest key first: "L4" is not "L40S", "A10" not "A100", "H200 NVL"
    not "H200". None (unknown) for a GPU not in ``GPU_PEAKS`` and for a MIG
    slice, which has a fraction of the GPU's units: named "... MIG 1g.10gb", or
    CUDA_VISIBLE_DEVICES names a MIG-<uuid>."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if re.search(r"\bMIG\b", name) or any(part.strip().startswith("MIG-") for part in visible.split(",")):
        return None
    for key in sorted(GPU_PEAKS, key=len, reverse=True):
        if re.search(rf"(?<![\w-]){re.escape(key)}(?!\w)", name):
            return GPU_PEAKS[key]
    return None


def model_flops_per_token(model: torch.nn.Module) -> Optional[int]:
    """The training FLOPs per token of ``model`` where the model gives them
    itself, by a ``flops_per_token()`` method (``gpt.GPT``'s: 6N + 12 L H Q T,
    nanoGPT's formula); None for any other model. Called on the model before
    DDP wraps it, or on FSDP's sharded model (the same class, the full sizes)."""
    count = getattr(model, "flops_per_token", None)
    return count() if callable(count) else None


def flops_per_sample(task, device: torch.device) -> Optional[float]:
    """The training FLOPs (forward and backward) of one sample of ``task``
    (a ``common.Task``, its model on ``device``), counted once at start: the
    model's own count where it has one (``model_flops_per_token`` x the
    task's ``tokens_per_sample``: the GPT's 6N + 12 L H Q T), else counted
    by ``torch.utils.flop_counter.FlopCounterMode`` over a forward, the loss
    and a backward of two training samples, per sample (``counted_flops_per_sample``).

    Call it on the plain model, before --activation_checkpointing and FSDP
    wrap it: these are the model's FLOPs, not the recomputation's, and the
    unsharded model needs no collective. None where the task has no training
    set or the count fails (a line says why): the epoch line then has no flop/s."""
    per_token = model_flops_per_token(task.model)
    if per_token and task.tokens_per_sample:
        return float(per_token * task.tokens_per_sample)
    if task.train_set is None or len(task.train_set) == 0:
        return None
    try:
        return counted_flops_per_sample(task, device)
    except Exception as exc:  # a model that cannot run two samples alone: no flop/s, the run goes on
        if dist.is_initialized() and dist.get_rank() == 0:
            from ..output import print_line

            first = (str(exc).strip().splitlines() or [""])[0][:200]
            print_line(f"note: the model's FLOPs per sample could not be counted ({type(exc).__name__}: "
                       f"{first}); the epoch line has no flop/s")
        return None


def counted_flops_per_sample(task, device: torch.device, samples: int = 2) -> float:
    """FLOPs per sample of ``task``'s model on its first ``samples`` training
    samples (fewer where the set has fewer), counted by
    ``torch.utils.flop_counter.FlopCounterMode``: the matrix products,
    convolutions and attention of a forward, the loss and the backward
    (2 FLOPs per multiply-add; elementwise work, norms and the optimizer are
    not counted, as in the GPT's 6N formula), divided by the samples.

    The model is left as it was: run in eval mode (BatchNorm's running
    statistics untouched, no dropout: neither changes the matmul FLOPs), the
    random states of the CPU and ``device`` restored (a random crop, a
    window's offset), and the gradients it makes removed. Tasks whose samples
    differ in size get the first samples' count."""
    from torch.utils.flop_counter import FlopCounterMode

    model, data = task.model, task.train_set
    count = min(samples, len(data))
    was_training = model.training
    had_grad = {id(p) for p in model.parameters() if p.grad is not None}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        source, targets = task.collate_fn([data[i] for i in range(count)])
        model.eval()
        try:
            with FlopCounterMode(display=False) as counter:
                output = model(task.eval_transform(source.to(device)))
                task.loss_fn(output, targets.to(device)).backward()
        finally:
            model.train(was_training)
            for parameter in model.parameters():
                if id(parameter) not in had_grad:
                    parameter.grad = None
    return counter.get_total_flops() / count


def throughput_figures(samples_per_s: float, tokens_per_sample: Optional[int],
                       flops_per_sample: Optional[float], device: torch.device,
                       precision: str) -> dict:
    """The epoch record's speed figures beyond samples/s, from its global
    ``samples_per_s``: "tokens_per_s" (global training tokens per second) for
    a task whose samples hold ``tokens_per_sample`` tokens each
    (``common.Task``; 0 or None: none); "flops_per_s" (achieved model FLOP/s,
    all ranks together: samples_per_s x ``flops_per_sample``, the model's
    training FLOPs per sample, ``flops_per_sample``) where those are known;
    and on a CUDA GPU listed in ``GPU_PEAKS`` "mfu": flops_per_s over the peak
    of all ranks' GPUs in ``precision`` (world size x one GPU's peak; the
    precision the matrix products run in, ``loop.compute_precision``:
    bf16/fp16 under --amp, tf32 or fp32 without), a fraction of 1 (Chowdhery
    et al. 2022, appendix B), with "mfu_precision" naming that precision.
    Assumes one GPU per rank of the same kind as this rank's."""
    figures = {}
    if tokens_per_sample:
        figures["tokens_per_s"] = samples_per_s * tokens_per_sample
    if not flops_per_sample:
        return figures
    figures["flops_per_s"] = samples_per_s * flops_per_sample
    peaks = gpu_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if peaks:
        figures["mfu"] = figures["flops_per_s"] / (peaks[precision] * dist.get_world_size())
        figures["mfu_precision"] = precision
    return figures
