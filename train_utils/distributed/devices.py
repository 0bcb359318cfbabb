"""This process's device and CPU threads, the flight recorder's settings,
why GPUs go unused, the peak GPU memory, and the installed torch's version.
"""

from __future__ import annotations

import glob
import os
import re
import warnings
from types import MappingProxyType
from typing import Optional

import torch
import torch.distributed as dist

from common import ConfigError
from .kernels import check_gpu_has_kernels


def started_by_srun() -> bool:
    """True in a task that srun started itself (one task per GPU, no torchrun):
    SLURM_STEP_ID is set and TORCHELASTIC_RUN_ID, which torchrun gives its
    workers (also when torchrun itself runs under srun), is not."""
    return "SLURM_STEP_ID" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ


def other_accelerator() -> Optional[torch.device]:
    """The accelerator ``torch.accelerator`` finds when it is not CUDA (XPU,
    MPS, ...), as a device type without index; None where there is none or
    the installed torch has no ``torch.accelerator``."""
    accelerator = getattr(torch, "accelerator", None)
    found = accelerator.current_accelerator() if accelerator else None  # what torch was built for
    if found is None or found.type == "cuda" or not accelerator.is_available():  # CUDA: cuda_available
        return None
    return torch.device(found.type)


def backend_for(device: torch.device) -> str:
    """The process group backend for ``device``: torch's default for its type
    (``dist.get_default_backend_for_device``: nccl for CUDA, xccl for XPU,
    gloo for the CPU) where the installed torch has it, else nccl or gloo."""
    if hasattr(dist, "get_default_backend_for_device"):
        return dist.get_default_backend_for_device(device)
    return "nccl" if device.type == "cuda" else "gloo"


def device_for(local_rank: int) -> torch.device:
    """This process's device: ``cuda:local_rank`` where CUDA works, else another
    accelerator ``torch.accelerator`` finds (``xpu:local_rank``; on a Mac the
    CPU, since MPS has no process group backend), else the CPU.

    Under srun (``started_by_srun``) a task that sees exactly one GPU takes
    ``cuda:0``: Slurm bound that GPU to it (``--gpus-per-task=1``); a task that
    sees all of the node's GPUs takes ``cuda:local_rank`` (SLURM_LOCALID).
    Raises ConfigError when CUDA works but ``local_rank`` has no GPU of its
    own on this node (more processes than visible GPUs), worded in the flags
    of the launcher that started it.
    """
    if not cuda_available():
        other = other_accelerator()
        if other is None:
            return torch.device("cpu")
        if other.type == "mps":  # one device, no collective backend: the processes use the CPU
            return torch.device("cpu")
        if local_rank >= torch.accelerator.device_count():
            raise ConfigError(f"local rank {local_rank} needs {other.type} device {local_rank}, but this "
                              f"node shows only {torch.accelerator.device_count()}; start at most that "
                              f"many processes per node")
        return torch.device(other.type, local_rank)
    visible = torch.cuda.device_count()
    srun = started_by_srun()
    if srun and visible == 1:
        return check_gpu_has_kernels(torch.device("cuda", 0))
    if local_rank >= visible:
        shown = (f"local rank {local_rank} needs GPU {local_rank}, but this node shows only {visible} "
                 f"GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        if srun:
            raise ConfigError(f"srun task {shown.replace('local rank', 'with SLURM_LOCALID', 1)}; "
                              f"start at most {visible} tasks per node (srun --ntasks-per-node="
                              f"{visible}), or give each task a GPU of its own (srun --gpus-per-task=1)")
        raise ConfigError(f"{shown}; start at most {visible} processes per node (--nproc_per_node={visible})")
    return check_gpu_has_kernels(torch.device("cuda", local_rank))


# torch's flight recorder: each rank's last 2,000 collectives (gloo's and NCCL's),
# which the time-out report reads (hang_report.recent_collectives); under NCCL a
# time-out also dumps them to files (torch's names, documented in docs/runs.md).
# How NCCL's watchdog handles a time-out (TORCH_NCCL_ASYNC_ERROR_HANDLING) is
# left to torch's default. Each name with the older names torch still reads for
# it (deprecated: torch warns, and prefers the current name where both are set).
FLIGHT_RECORDER = MappingProxyType({"TORCH_FR_BUFFER_SIZE": ("2000", ("TORCH_NCCL_TRACE_BUFFER_SIZE",))})
NCCL_DIAGNOSTICS = MappingProxyType({"TORCH_NCCL_DUMP_ON_TIMEOUT": ("1", ())})
# Where the dumps go: a path prefix, torch appends the rank. torch 2.8 to 2.14
# read TORCH_FR_DUMP_TEMP_FILE first, then the deprecated TORCH_NCCL_DEBUG_INFO_TEMP_FILE.
NCCL_DUMP_VARIABLE, NCCL_DUMP_VARIABLE_DEPRECATED = "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


def nccl_trace_prefix(folder: str) -> str:
    """Where the flight recorder's NCCL dumps go (``NCCL_DUMP_VARIABLE``, a path
    prefix; torch appends the rank): in ``folder`` (the snapshot's, where the
    time-out report's stack files go too: ``hang_report.stack_folder``),
    ``nccl_trace_<job id>_rank_`` in a Slurm job (SLURM_JOB_ID), else
    ``nccl_trace_rank_``. Not torch's default, ``comm_lib_trace_rank_`` in
    ``$XDG_CACHE_HOME/torch`` or ``~/.cache/torch``: a name without the job, so
    each job's dumps replace the last one's, in the home folder of whichever
    node each rank ran on."""
    job = os.environ.get("SLURM_JOB_ID")
    return os.path.join(os.path.abspath(folder), f"nccl_trace_{job + '_' if job else ''}rank_")


def enable_flight_recorder(folder: str, nccl: bool) -> None:
    """Set ``FLIGHT_RECORDER`` and, for ``nccl``, ``NCCL_DIAGNOSTICS`` and
    ``NCCL_DUMP_VARIABLE`` (``nccl_trace_prefix(folder)``), each where the
    environment sets neither the variable nor a deprecated name of it (a
    user's TORCH_NCCL_TRACE_BUFFER_SIZE=0 stays in force): before
    ``init_process_group``, which reads them."""
    wanted = {name: value for name, (value, _) in FLIGHT_RECORDER.items()}
    older = {name: aliases for name, (_, aliases) in FLIGHT_RECORDER.items()}
    if nccl:
        wanted |= {name: value for name, (value, _) in NCCL_DIAGNOSTICS.items()}
        older |= {name: aliases for name, (_, aliases) in NCCL_DIAGNOSTICS.items()}
        wanted[NCCL_DUMP_VARIABLE] = nccl_trace_prefix(folder)
        older[NCCL_DUMP_VARIABLE] = (NCCL_DUMP_VARIABLE_DEPRECATED,)
    for name, value in wanted.items():
        if not any(alias in os.environ for alias in (name, *older[name])):
            os.environ[name] = value


# torch's warnings from its first torch.cuda.is_available() call, which torch gives
# only once per process: kept for unusable_gpu_reason's note. Module-level on
# purpose: what it mirrors (torch's warn-once) is per process too.
_CUDA_WARNINGS: list = []


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, keeping the first line of each warning it
    gives (torch's reason, e.g. a driver too old; torch warns once per process,
    so a later call could no longer tell) for ``unusable_gpu_reason``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    for caught_warning in caught:
        line = (str(caught_warning.message).strip().splitlines() or [""])[0]
        if line and line not in _CUDA_WARNINGS:
            _CUDA_WARNINGS.append(line)
    return available


def gpus_hidden_on_purpose() -> bool:
    """True where the environment hides the GPUs: CUDA_VISIBLE_DEVICES empty,
    -1 or Slurm's NoDevFiles, or a Slurm job with no GPU allocated (no
    SLURM_JOB_GPUS, SLURM_STEP_GPUS or SLURM_GPUS_ON_NODE) on a GPU node."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "NoDevFiles"):
        return True
    allocated = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE")
    return "SLURM_JOB_ID" in os.environ and not any(os.environ.get(name) for name in allocated)


def unusable_gpu_reason() -> Optional[str]:
    """Why this machine's NVIDIA GPUs go unused, or None.

    Where GPU device files exist (/dev/nvidia0, ...) but this torch build cannot
    use them (a CPU-only build, or a driver older than the build needs), the
    scripts would silently train on the CPU; this returns torch's own reason
    (its warnings, kept by ``cuda_available`` from the first call). None as
    well where the GPUs are hidden on purpose (``gpus_hidden_on_purpose``).
    """
    if not glob.glob("/dev/nvidia[0-9]*") or gpus_hidden_on_purpose() or cuda_available():
        return None
    reasons = list(_CUDA_WARNINGS)
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} is a CPU-only build")
    return "; ".join(reasons) or "torch.cuda.is_available() is False"


# The oldest torch the scripts are tested on (requirements-oldest.txt); see docs/install.md.
OLDEST_TORCH = (2, 8)


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch, e.g. (2, 8) for "2.8.0+cu128"."""
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    return int(major), int(minor)


def rejoin_note() -> str:
    """The note for a torchrun job of several nodes with restarts
    (TORCHELASTIC_MAX_RESTARTS > 0, GROUP_WORLD_SIZE > 1) whose agents share
    their rendezvous store with the workers (TORCHELASTIC_USE_AGENT_STORE):
    the store's address is not renewed when the nodes change, so a node that
    joins after a loss waits in the rendezvous until its time-out; '' for any
    other start. docs/fault-tolerance.md: elastic torchrun."""
    env = os.environ
    if (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
            and int(env.get("GROUP_WORLD_SIZE", "1")) > 1):
        return ("note: torchrun shares its rendezvous store with the workers, so a node that joins after "
                "a loss waits until the rendezvous times out; start every node's torchrun with "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (slurm/multi_node.sh does; docs/fault-tolerance.md)")
    return ""


def usable_cpus() -> int:
    """CPU cores this process may run on: its affinity mask (what Slurm, a
    cgroup cpuset or taskset grant), not the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def share_cpu_cores(device: torch.device, world_size: int) -> None:
    """On a CPU ``device``, give each of ``world_size`` processes its share of
    the usable cores' intra-op threads (unless OMP_NUM_THREADS says
    otherwise), instead of each process using all of them. Nothing on a GPU."""
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, usable_cpus() // world_size))


def peak_memory_mib(device: torch.device) -> dict:
    """{"peak_gpu_memory_mib": MiB} on CUDA, {} on a CPU.

    The most memory tensors held on ``device`` since the last
    ``torch.cuda.reset_peak_memory_stats`` (``torch.cuda.max_memory_allocated``,
    MiB = 2**20 bytes), the maximum over all ranks under a process group: a
    collective on CUDA, so every rank must call it.
    """
    if device.type != "cuda":
        return {}
    peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**20, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"peak_gpu_memory_mib": peak.item()}
