"""The start-up line: what runs where (device, backend, world size, the
device mesh, CPU threads, the precision), the global batch size, and the
notes that go before it (unusable GPUs, an old torch, a torchrun whose
restarted nodes cannot rejoin); the placement line after it: which ranks
run on which host and device; and the task line: what trains on what.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..distributed import OLDEST_TORCH, rejoin_note, torch_version, unusable_gpu_reason
from ..loop import numerics_description


def describe_task(dataset: str, task) -> str:
    """The task line: the task (--dataset), its model's class and parameters,
    the samples of each split, and what a language model reads
    (``Task.corpus``). E.g. ``task shakespeare_char | model GPT, 10,816,512
    parameters | samples train 1,003,838, val 111,522 | corpus Tiny
    Shakespeare, 1,003,854 tokens to train and 111,540 held out, vocabulary
    65 (its characters)``. Parameters are counted once each (a tied weight
    once) and whole under FSDP (a sharded parameter's ``numel`` is the
    global one); a sample is one item of the task's dataset (a language
    model's window of ``tokens_per_sample`` tokens)."""
    parameters = sum(p.numel() for p in task.model.parameters())
    # fully_shard makes the model an instance of a class of its own (FSDPGPT for a GPT): name the task's
    model_class = next(cls for cls in type(task.model).__mro__ if not cls.__module__.startswith("torch.distributed."))
    splits = [("train", task.train_set), ("val", task.val_set), ("test", task.test_set)]
    samples = ", ".join(f"{name} {len(data):,}" for name, data in splits if data is not None)
    line = f"task {dataset} | model {model_class.__name__}, {parameters:,} parameters | samples {samples}"
    return line + (f" | corpus {task.corpus}" if task.corpus else "")


def describe_run(device: torch.device, config: RunConfig) -> str:
    """The start-up line: what runs where, and the global batch size.

    E.g. ``device cpu | backend gloo | world_size 2 | global batch size 64 =
    batch_size 32 x grad_accum_steps 1 x world_size 2 | cpu threads 1 per
    process``: under --strategy hsdp then the device mesh (``| HSDP mesh
    replicate 2 x shard 4``); on a CPU, the intra-op threads each process computes with
    (``share_cpu_cores``; OMP_NUM_THREADS sets them); then ``| amp bf16`` or
    ``| amp fp16 with a loss scaler`` under --amp; on CUDA how fp32 matmuls
    run (``| fp32 matmuls on TF32 (--no_tf32: full fp32)``), and ``|
    deterministic`` under --deterministic (``numerics_description``). Preceded by a ``note:``
    line when GPUs are present but unusable (``unusable_gpu_reason``), one
    when torch is older than ``OLDEST_TORCH``, and one for a multi-node
    torchrun with restarts that shares its rendezvous store with the
    workers (``rejoin_note``), and one when torchrun started these workers
    again after a failure (``restart_note``).
    """
    world_size, backend = dist.get_world_size(), dist.get_backend()
    name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    line = (f"device {device}{name} | backend {backend} | world_size {world_size} | global batch "
            f"size {config.batch_size * config.grad_accum_steps * world_size} = batch_size "
            f"{config.batch_size} x grad_accum_steps {config.grad_accum_steps} x world_size {world_size}")
    if config.strategy == "hsdp":  # the 2-D device mesh (distributed.fsdp.hsdp_mesh): replicas x ranks per shard group
        line += f" | HSDP mesh replicate {world_size // config.shard_size} x shard {config.shard_size}"
    if device.type == "cpu":
        line += f" | cpu threads {torch.get_num_threads()} per process"

    if config.compute_dtype is not None:  # what plain --amp chose on this job's devices
        line += " | amp bf16" if config.compute_dtype == torch.bfloat16 else " | amp fp16 with a loss scaler"
    line += numerics_description(device, config)
    reason = unusable_gpu_reason() if device.type == "cpu" else None
    if reason:
        line = (f"note: this machine has NVIDIA GPUs, but torch cannot use them ({reason}); "
                f"training on the CPU. Install the torch build that matches your driver\n" + line)
    for note in (rejoin_note(), restart_note()):
        if note:
            line = note + "\n" + line
    if torch_version() < OLDEST_TORCH:
        line = (f"note: torch {torch.__version__} is untested here (oldest tested: torch "
                f"{'.'.join(map(str, OLDEST_TORCH))}); older ones can hang at exit, see docs/install.md\n" + line)
    return line


def gather_placement(local_rank: int, device: torch.device) -> list:
    """Collective (one ``all_gather_object``): where every rank runs, a list
    indexed by rank of ``(rank, local_rank, host, device)``, ``host`` the
    rank's ``socket.gethostname()`` and ``device`` its torch device as a
    string (``"cuda:3"``, ``"cpu"``). Every rank gets the whole list."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (dist.get_rank(), local_rank, socket.gethostname(), str(device)))
    return everyone


def number_ranges(numbers) -> str:
    """``numbers`` (ints) in their order, each run of consecutive ascending
    ones as ``first-last``: ``[0, 1, 2, 3, 8, 10, 11]`` gives ``0-3,8,10-11``."""
    runs: list = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)


def _devices(devices: list) -> str:
    """Devices as strings (``"cuda:0"``, ``"cpu"``), one per rank, in one
    short text: each type once, with the indices of its devices as ranges
    in the ranks' order (``cuda:0-3``; ``cpu``)."""
    by_type: dict = {}
    for device in devices:
        kind, _, index = device.partition(":")
        by_type.setdefault(kind, [])
        if index:
            by_type[kind].append(int(index))
    return ",".join(f"{kind}:{number_ranges(indices)}" if indices else kind for kind, indices in by_type.items())


def describe_placement(placement: list) -> str:
    """The placement line, one per run whatever the world size: where the
    ranks of ``placement`` (``gather_placement``'s list) run, grouped by
    host in the order of each host's first rank, each host's ranks and, in
    the same order, their local ranks and devices as ranges
    (``number_ranges``). E.g. ``placement: host a: ranks 0-3 (local_rank
    0-3, cuda:0-3) | host b: ranks 4-7 (local_rank 0-3, cuda:0-3)``; one
    rank on a host: ``host a: rank 0 (local_rank 0, cpu)``."""
    hosts: dict = {}
    for rank, local_rank, host, device in sorted(placement):
        hosts.setdefault(host, []).append((rank, local_rank, device))
    parts = []
    for host, ranks in hosts.items():
        numbers = number_ranges(rank for rank, _, _ in ranks)
        parts.append(f"host {host}: rank{'s' if len(ranks) > 1 else ''} {numbers} (local_rank "
                     f"{number_ranges(local for _, local, _ in ranks)}, {_devices([d for _, _, d in ranks])})")
    return "placement: " + " | ".join(parts)


def restart_note(env=None) -> str:
    """The note for workers torchrun started again after one failed
    (TORCHELASTIC_RESTART_COUNT above 0, of TORCHELASTIC_MAX_RESTARTS:
    --max-restarts), e.g. ``note: torchrun started these workers again
    (restart 1 of at most 3, --max-restarts) after a worker failed; the run
    goes on from its last snapshot``; '' for a first start or another
    launcher. ``env``: the environment (None: ``os.environ``)."""
    env = os.environ if env is None else env
    count = int(env.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if count <= 0:
        return ""
    most = env.get("TORCHELASTIC_MAX_RESTARTS")
    of = f" of at most {most}" if most else ""
    return (f"note: torchrun started these workers again (restart {count}{of}, --max-restarts) after a worker "
            f"failed; the run goes on from its last snapshot")
