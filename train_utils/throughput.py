"""What language-model training is measured in: tokens per second, the FLOP/s
achieved (of the FLOPs per token the model gives) and, on a GPU of known
peak, the model FLOPs utilization (MFU).
"""

from __future__ import annotations

import os
import re
from types import MappingProxyType
from typing import Optional

import torch
import torch.distributed as dist


# Dense peak FLOP/s per GPU from the vendors' data sheets (no sparsity):
# (bf16/fp16 tensor core, tf32 tensor core). Used for MFU and by the benchmark's section 5
# (benchmarks/gpu.py).
GPU_PEAKS = MappingProxyType({
    "H100 80GB HBM3": (989e12, 495e12), "H100 SXM": (989e12, 495e12), "H200": (989e12, 495e12),
    "H100 PCIe": (756e12, 378e12), "H100 NVL": (835e12, 418e12), "H200 NVL": (835e12, 418e12),
    "A100": (312e12, 156e12), "L4": (121e12, 60e12), "A10": (125e12, 62.5e12)})


def gpu_peak(name: str) -> Optional[tuple[float, float]]:
    """The data-sheet peaks (bf16, tf32) in FLOP/s of the GPU called ``name``
    (``torch.cuda.get_device_name``), matched as whole words, longest key
    first: "L4" is not "L40S", "A10" not "A100", "H200 NVL" not "H200". None
    (unknown) for a GPU not in ``GPU_PEAKS`` and for a MIG slice, which has a
    fraction of the GPU's units: named "... MIG 1g.10gb", or
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
    nanoGPT's formula); None for any other model, which then gets no FLOP/s
    or MFU figures. Called on the model before DDP wraps it, or on FSDP's
    sharded model (the same class, the full sizes)."""
    count = getattr(model, "flops_per_token", None)
    return count() if callable(count) else None


def throughput_figures(samples_per_s: float, tokens_per_sample: Optional[int],
                       flops_per_token: Optional[int], device: torch.device,
                       amp_dtype: Optional[torch.dtype]) -> dict:
    """The epoch record's LM figures, from its global ``samples_per_s``:
    {"tokens_per_s": global training tokens per second} for a task whose
    samples hold ``tokens_per_sample`` tokens each (``common.Task``; None: {}),
    plus "flops_per_s" (achieved model FLOP/s, all ranks together:
    tokens_per_s x ``flops_per_token``) when the model's FLOPs per token are
    known, plus on a CUDA GPU listed in ``GPU_PEAKS`` "mfu": flops_per_s over
    the peak of all ranks' GPUs (world size x one GPU's peak: the bf16 peak
    under ``amp_dtype`` bf16/fp16, the tf32 one without), a fraction of 1
    (Chowdhery et al. 2022, appendix B). Assumes one GPU per rank of the same
    kind as this rank's."""
    if not tokens_per_sample:
        return {}
    figures = {"tokens_per_s": samples_per_s * tokens_per_sample}
    if not flops_per_token:
        return figures
    figures["flops_per_s"] = figures["tokens_per_s"] * flops_per_token
    peaks = gpu_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if peaks:
        world_size = dist.get_world_size()
        peak = peaks[0] if amp_dtype in (torch.bfloat16, torch.float16) else peaks[1]
        figures["mfu"] = figures["flops_per_s"] / (peak * world_size)
    return figures
