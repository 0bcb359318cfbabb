"""How fp32 work runs on a GPU and how reproducible a GPU run is: TF32 tensor
cores for fp32 matrix products unless --no_tf32, bitwise-repeatable kernels
under --deterministic; and the precision whose peak the MFU divides by.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from common import ConfigError
from ..config import RunConfig

# cuBLAS's deterministic workspace settings (NVIDIA's cuBLAS documentation,
# "Results reproducibility"; PyTorch's "Reproducibility" notes): one 4096 KiB
# buffer x 8, or 16 KiB x 8 (less memory, slower). Any other value lets cuBLAS
# pick a split of the reduction per stream, which varies from run to run.
CUBLAS_WORKSPACE_VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def tf32_capable(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU with TF32 tensor cores: compute
    capability 8.0 (Ampere) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def set_fp32_precision(device: torch.device, no_tf32: bool) -> None:
    """How fp32 matrix products and convolutions run on a CUDA ``device``:
    on TF32 tensor cores (``torch.set_float32_matmul_precision("high")``,
    PyTorch's recommended setting for training, and cuDNN's TF32
    convolutions, its default), or with ``no_tf32`` (--no_tf32) in full fp32
    ("highest", ``torch.backends.cudnn.allow_tf32 = False``) for work that
    needs fp32's 23-bit mantissa, at about 1/7 of an H100's TF32 rate
    (``logs.throughput.GPU_PEAKS``). TF32 keeps fp32's range and rounds the
    products' inputs to a 10-bit mantissa; sums stay fp32 (NVIDIA, "TensorFloat-32
    in the A100 GPU", 2020). Affects fp32 work only: under --amp the
    autocast regions' matmuls are bf16/fp16 anyway; evaluation, which runs
    without autocast, follows this setting.

    Nothing on a CPU: there "high" would also let oneDNN round fp32 matmuls
    on CPUs that can (``torch.backends.mkldnn.matmul.fp32_precision``), and
    the kit's CPU figures are full fp32."""
    if device.type != "cuda":
        return
    torch.set_float32_matmul_precision("highest" if no_tf32 else "high")
    torch.backends.cudnn.allow_tf32 = not no_tf32


def fp32_matmul_precision(device: torch.device) -> str:
    """How fp32 matrix products run on ``device`` now: "tf32" on a CUDA GPU
    with TF32 tensor cores (``tf32_capable``) where torch's float32 matmul
    precision allows it (``set_fp32_precision``), else "fp32"."""
    if tf32_capable(device) and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"


def compute_precision(device: torch.device, dtype: Optional[torch.dtype]) -> str:
    """The precision of the training's matrix products on ``device``:
    "bf16" or "fp16" under --amp (``dtype``: ``RunConfig.compute_dtype``),
    else ``fp32_matmul_precision``. MFU divides by this precision's peak
    (``logs.throughput_figures``), and the epoch record names it."""
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    return fp32_matmul_precision(device)


def set_deterministic(deterministic: bool, compile: bool = False) -> None:
    """--deterministic (``deterministic``; ``compile``: --compile): kernels that give bitwise the same results at every
    run, so that a GPU run stopped (SIGTERM) and resumed ends bitwise equal
    to one that never stopped, at the same world size. Sets
    ``torch.use_deterministic_algorithms(True)`` (an op without a
    deterministic kernel then raises instead of running one), cuDNN's
    deterministic algorithms without benchmarking (``cudnn.deterministic``,
    ``cudnn.benchmark = False``), cuBLAS's fixed workspace
    (CUBLAS_WORKSPACE_CONFIG ``:4096:8``, set here unless the environment
    holds one of ``CUBLAS_DETERMINISTIC``; read when cuBLAS starts, at the
    first matrix product), and under
    --compile inductor's deterministic mode (no on-device benchmarking that
    could pick other kernels in the resumed process). PyTorch's notes:
    "Reproducibility". Costs some speed on a GPU. Call it before the process
    group exists: NCCL's group reads the deterministic mode when it is made,
    and then leaves out NVLink SHARP reductions (``NCCL_ALGO=^NVLS`` unless
    NCCL_ALGO is set), whose order is not fixed.

    On a CPU the kit's runs are bitwise repeatable without it (tested): the
    flag sets the same torch switches there, and the start-up line says so.
    Raises ConfigError (one line) where it cannot hold: CUBLAS_WORKSPACE_CONFIG
    set to another value, or --compile on a torch whose inductor has no
    deterministic mode. Does nothing without the flag."""
    if not deterministic:
        return
    workspace = os.environ.get(CUBLAS_WORKSPACE_VARIABLE)
    if workspace is not None and workspace not in CUBLAS_DETERMINISTIC:
        raise ConfigError(f"--deterministic: {CUBLAS_WORKSPACE_VARIABLE}={workspace} lets cuBLAS reduce in "
                          f"an order that varies between runs; unset it or set it to "
                          f"{' or '.join(CUBLAS_DETERMINISTIC)}")
    if compile:
        import torch._inductor.config as inductor_config

        if not hasattr(inductor_config, "deterministic"):
            raise ConfigError(f"--deterministic --compile: torch {torch.__version__}'s inductor has no "
                              f"deterministic mode, so a resumed run may compile other kernels; "
                              f"leave out --compile, or use a newer torch")
        inductor_config.deterministic = True
    if workspace is None:  # read by cuBLAS only: nothing on a CPU
        os.environ[CUBLAS_WORKSPACE_VARIABLE] = CUBLAS_DETERMINISTIC[0]
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def numerics_description(device: torch.device, config: RunConfig) -> str:
    """The start-up line's part on numerics ('' when there is nothing to say):
    on CUDA how fp32 matmuls run (`` | fp32 matmuls on TF32``, ``... in full
    fp32 (--no_tf32)``, or on a GPU before Ampere ``... in full fp32 (no TF32
    before Ampere)``); then `` | deterministic`` under --deterministic (on a
    CPU: "the CPU runs are bitwise repeatable without it")."""
    parts = []
    if device.type == "cuda":
        if fp32_matmul_precision(device) == "tf32":
            parts.append("fp32 matmuls on TF32 (--no_tf32: full fp32)")
        elif not tf32_capable(device):
            parts.append("fp32 matmuls in full fp32 (no TF32 before Ampere)")
        else:
            parts.append("fp32 matmuls in full fp32 (--no_tf32)")
    if config.deterministic:
        parts.append("deterministic" if device.type != "cpu" else
                     "deterministic (CPU runs are bitwise repeatable without it too)")
    return "".join(f" | {part}" for part in parts)
