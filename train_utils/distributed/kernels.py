"""Does this torch build run this GPU: its CUDA arch list against the GPU's
compute capability, or a ROCm build's gfx names against the GPU's; and, where
not, which build to install.
"""

from __future__ import annotations

import os
import re

import torch

from common import ConfigError


# PyTorch's CUDA wheel lines (download.pytorch.org/whl/<line>) and the
# compute capabilities their kernels are built for, oldest line first:
# torch.cuda.get_arch_list() of torch 2.8's cu128 and torch 2.14's cu130
# wheels; cu126 as PyTorch's wheel build script (.ci/manywheel/build_cuda.sh)
# sets it, the same in 2.8 and 2.11 (pytorch/pytorch#182250). cu128 dropped
# sm_70 from torch 2.11 on: a V100 is sent to cu126, which has it in every release.
CUDA_WHEELS = (("cu126", "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90"),
               ("cu128", "sm_70 sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"),
               ("cu130", "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"))


def runs_on(capability: int, arches: list) -> bool:
    """Whether a build with kernels for ``arches`` (``torch.cuda.get_arch_list()``'s
    ``sm_XY``/``compute_XY`` names) runs a GPU of ``capability`` (10 x major +
    minor): a cubin of the same major and no newer minor (cubins run on later
    minors of their major), or PTX no newer (JIT-compiled)."""
    text = " ".join(arches)
    cubins = [int(n) for n in re.findall(r"\bsm_(\d+)\b", text)]
    ptx = [int(n) for n in re.findall(r"\bcompute_(\d+)\b", text)]
    return (any(c // 10 == capability // 10 and c <= capability for c in cubins)
            or any(p <= capability for p in ptx))


def build_advice(capability: int) -> str:
    """What to install for a GPU of ``capability`` (10 x major + minor) that
    the installed build has no kernels for: the oldest of ``CUDA_WHEELS`` that
    runs it (a GPU older than the build: a CUDA 12.6 wheel; a newer one: the
    first line that knows it), else a build of one's own."""
    for line, arches in CUDA_WHEELS:
        if runs_on(capability, arches.split()):
            return (f"install a build for it: pip install torch torchvision --index-url "
                    f"https://download.pytorch.org/whl/{line}")
    return (f"none of PyTorch's CUDA wheels ({', '.join(line for line, _ in CUDA_WHEELS)}) has kernels "
            f"for it; build torch with TORCH_CUDA_ARCH_LIST={capability // 10}.{capability % 10}, "
            f"or look for a newer wheel at https://pytorch.org/get-started/locally/")


def check_gpu_has_kernels(device: torch.device) -> torch.device:
    """Return ``device`` (a CUDA or ROCm device) when this torch build has
    kernels for it; raise ConfigError naming what to install otherwise.

    CUDA: ``runs_on`` the GPU's compute capability and
    ``torch.cuda.get_arch_list()``. E.g. a V100 (sm_70) under a CUDA 13 wheel
    (sm_75 and newer), where every kernel would fail with "no kernel image is
    available": refused, naming the cu126 wheel (``build_advice``). ROCm
    (``torch.version.hip`` set; the list holds gfx names): the GPU's gfx name
    (``gcnArchName``, e.g. ``gfx90a:sramecc+:xnack-``) without its feature
    flags must be in the list; where HSA_OVERRIDE_GFX_VERSION makes the GPU run
    another gfx's kernels, or torch gives no name, it passes. An empty list
    (unknown) passes."""
    arches = torch.cuda.get_arch_list()
    if not arches:
        return device
    if getattr(torch.version, "hip", None):
        gfx = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "").split(":")[0]
        if not gfx or gfx in arches or "HSA_OVERRIDE_GFX_VERSION" in os.environ:
            return device
        raise ConfigError(
            f"{torch.cuda.get_device_name(device)} ({device}) is a {gfx}, but torch {torch.__version__} "
            f"(ROCm {torch.version.hip}) has kernels only for {' '.join(arches)}; install a ROCm build "
            f"with kernels for {gfx} (https://pytorch.org/get-started/locally/)")
    major, minor = torch.cuda.get_device_capability(device)
    capability = major * 10 + minor
    if runs_on(capability, arches):
        return device
    raise ConfigError(
        f"{torch.cuda.get_device_name(device)} ({device}) has compute capability {major}.{minor} "
        f"(sm_{capability}), but torch {torch.__version__} has kernels only for {' '.join(arches)}; "
        f"{build_advice(capability)}")
