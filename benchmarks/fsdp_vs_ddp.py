"""Section 6, fsdp_vs_ddp: FSDP against DDP at world size 2.

Measures, in 2 spawned processes (gloo on a CPU, nccl on GPUs), the MNIST CNN
and ResNet-18 wrapped as train.py --strategy ddp (DistributedDataParallel)
and --strategy fsdp (``train_utils.shard_model``) wrap them, on the same batch: the
median time of a training step over interleaved blocks, the training state
per rank (parameters + gradients + SGD momentum,
``train_utils.distributed.fsdp.training_state_bytes``), and on CUDA each one's peak GPU memory.

Reading the table: "FSDP / DDP time" above 1 is what FSDP's all-gathers and
reduce-scatters cost in step time; "DDP / FSDP state" is the memory it saves
per rank (about 2 at world size 2).
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import train_utils
from train_utils.distributed.devices import peak_memory_mib
from train_utils.distributed.fsdp import training_state_bytes
from benchmarks.harness import backend_for, build_model, ddp, interleaved, process_group, table, timed, train_step
from support.runs import free_port

FSDP_CASES = [("mnist cnn", "mnist", "cnn", (32, 1, 28, 28)),
              ("cifar10 resnet18", "cifar10", "resnet18", (16, 3, 32, 32))]


def _fsdp_vs_ddp_case(dataset: str, model_name: str, shape: tuple, device: torch.device, rank: int,
                      steps: int, reps: int) -> dict:
    """One model's median step time and training state per rank, DDP and FSDP;
    on CUDA also each one's peak GPU memory (collectives: every rank calls this)."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(shape, generator=g).to(device)
    y = torch.randint(0, 10, (shape[0],), generator=g).to(device)
    step, state = {}, {}
    for kind in ("DDP", "FSDP"):
        torch.manual_seed(0)
        model = build_model(dataset, model_name).to(device)
        model = ddp(model, device) if kind == "DDP" else train_utils.shard_model(model, device, dtype=None)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        step[kind] = train_step(model, opt, F.cross_entropy, x, y)
        step[kind]()  # gradients and momentum buffers exist from here on
        state[kind] = training_state_bytes(model, opt)

    def block(kind: str) -> float:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = timed(step[kind], steps, device, barrier=True)
        state[kind].update(peak_memory_mib(device))  # {} on a CPU
        return seconds

    times = interleaved({kind: functools.partial(block, kind) for kind in step}, reps)
    return {**{f"{kind}_step_ms": statistics.median(t) * 1e3 for kind, t in times.items()},
            **{f"{kind}_state_bytes": state[kind]["total"] for kind in state},
            **{f"{kind}_peak_gpu_memory_mib": state[kind].get("peak_gpu_memory_mib") for kind in state}}


def _fsdp_vs_ddp_worker(rank: int, world_size: int, port: int, steps: int, reps: int, out: str):
    """A spawned rank of ``world_size`` (mp.spawn's target): ``_fsdp_vs_ddp_case``
    for each of ``FSDP_CASES``; rank 0 saves the results to ``out``."""
    device = train_utils.device_for(rank)
    with process_group(rank, world_size, port, device):
        results = [{"case": label, "batch_per_rank": shape[0],
                    **_fsdp_vs_ddp_case(dataset, model_name, shape, device, rank, steps, reps)}
                   for label, dataset, model_name, shape in FSDP_CASES]
        if rank == 0:
            torch.save(results, out)


def section_fsdp(steps: int = 10, reps: int = 5) -> dict:
    """Section 6: FSDP against DDP in 2 spawned processes
    (``_fsdp_vs_ddp_worker``): median step time over ``reps`` interleaved
    blocks of ``steps`` steps, training state per rank, peak GPU memory on CUDA."""
    out = os.path.join(tempfile.mkdtemp(), "fsdp.pt")
    mp.spawn(_fsdp_vs_ddp_worker, args=(2, free_port(), steps, reps, out), nprocs=2)
    results = torch.load(out)
    backend = backend_for()
    cuda = torch.cuda.is_available()
    rows = [[r["case"], r["batch_per_rank"], r["DDP_step_ms"], r["FSDP_step_ms"],
             r["FSDP_step_ms"] / r["DDP_step_ms"], r["DDP_state_bytes"] / 2**20,
             r["FSDP_state_bytes"] / 2**20, r["DDP_state_bytes"] / r["FSDP_state_bytes"]]
            + ([r["DDP_peak_gpu_memory_mib"], r["FSDP_peak_gpu_memory_mib"]] if cuda else [])
            for r in results]
    text = table(f"6. FSDP (train_utils.shard_model) vs DDP, world size 2, {backend}: median "
                 f"step time over {reps} blocks of {steps} steps; training state per rank "
                 f"(params + grads + SGD momentum, the largest rank)",
                 ["model", "batch per rank", "DDP step ms", "FSDP step ms", "FSDP / DDP time",
                  "DDP state MiB", "FSDP state MiB", "DDP / FSDP state"]
                 + (["DDP peak GPU MiB", "FSDP peak GPU MiB"] if cuda else []), rows)
    return {"results": results, "backend": backend, "table": text}
