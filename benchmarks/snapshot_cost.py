"""Section 9, snapshot_cost: snapshots that do not stop training.

Measures, at world size 2 (gloo on a CPU; on CUDA one process per GPU, at most
2; ``--snapshot_device cpu|cuda``), a 12.6 M-parameter MLP with SGD momentum
(about 100 MB of training state) saved by the kit's Checkpointer, as
train.py saves it: DDP as one file from rank 0, FSDP as DCP shards from every
rank, each synchronous and asynchronous (train.py's default: the copy to CPU
memory here, the write in a background thread). Interleaved blocks of training: without snapshots,
and with one every interval (at least 3 s and 3 writes long, so that a write
ends before the next is due). Snapshots go to $SNAPSHOT_BENCH_DIR (default a
temporary folder).

Reading the table: "blocking s" is the median seconds one snapshot holds the
training loop (the slowest rank's); "cost at interval" the throughput lost
with a snapshot every interval against none, in wall time of rank 0 and in CPU
time of all ranks (on a busy machine the CPU figure is the one to read); "1/min"
that cost scaled to one snapshot a minute (the target: <= 2%).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import train_utils
from train_utils import Checkpointer
from benchmarks.harness import (CPU, Position, ddp, interleaved, process_group, synchronize, table, timed,
                                train_step)
from support.runs import free_port

# An MLP of 12.6 M parameters: with SGD momentum about 100 MB of training
# state (weights 50 MB + momentum 50 MB), the size the target is set for.
SNAPSHOT_WIDTH, SNAPSHOT_LAYERS, SNAPSHOT_BATCH = 2048, 3, 64


def _snapshot_model(device: torch.device, strategy: str) -> tuple:
    """The section's model (DDP-wrapped, or sharded as train.py --strategy fsdp
    does), its SGD optimizer with momentum, and one training step of it."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(SNAPSHOT_WIDTH, SNAPSHOT_WIDTH), torch.nn.ReLU())
              for _ in range(SNAPSHOT_LAYERS)]
    model = torch.nn.Sequential(*layers).to(device)
    model = ddp(model, device) if strategy == "ddp" else train_utils.shard_model(model, device, dtype=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x = torch.randn(SNAPSHOT_BATCH, SNAPSHOT_WIDTH, device=device)
    return model, optimizer, train_step(model, optimizer, F.mse_loss, x, torch.zeros_like(x))


def _snapshot_saver(model, optimizer, strategy: str, asynchronous: bool, folder: str):
    """save(n): the n-th snapshot of ``model`` and ``optimizer`` into ``folder``,
    by the kit's own ``Checkpointer`` (rank 0 a file for DDP; every rank its
    shards, then rank 0 the meta file, for FSDP), as train.py saves; each
    write waits for the one before. Returns the saver and the Checkpointer
    (``wait``: the write in flight done)."""
    name = f"{strategy}-{'async' if asynchronous else 'sync'}" + (".pt" if strategy == "ddp" else "")
    plain = model.module if strategy == "ddp" else model  # DDP's wrapper is not saved
    position = Position()
    checkpointer = Checkpointer(os.path.join(folder, name), strategy == "fsdp", plain, optimizer, {},
                                {"position": position}, asynchronous=asynchronous)

    def save(_index: int) -> None:
        position.steps_run += 1
        checkpointer.save()

    return save, checkpointer


def _snapshot_block(step, save, checkpointer, steps: int, every: int, device: torch.device) -> dict:
    """``steps`` training steps, a snapshot before every ``every``-th (none when
    0), the last write waited for: wall seconds, CPU seconds of this process
    (its threads together: the background writer's too), and the seconds each
    snapshot held the training thread (the call, and the wait for the one
    before)."""
    blocked = []
    synchronize(device)
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for index in range(steps):
        if every and index % every == 0:
            began = time.perf_counter()
            synchronize(device)  # the state as of the step before
            save(index // every)
            blocked.append(time.perf_counter() - began)
        step()
    began = time.perf_counter()
    checkpointer.wait()
    if blocked:
        blocked[-1] += time.perf_counter() - began
    synchronize(device)
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu, "blocked": blocked}


def _snapshot_cost_worker(rank: int, world_size: int, port: int, device_type: str, reps: int,
                          snapshots: int, out: str):
    """A spawned rank of ``world_size`` (mp.spawn's target), on ``device_type``:
    for DDP and FSDP, a step's seconds, the snapshot interval (in steps, the
    same on every rank) and ``reps`` interleaved blocks of ``snapshots``
    intervals without snapshots, with synchronous and with asynchronous ones
    (``_snapshot_block``). Rank 0 saves its results to ``out``, every other
    rank to ``out.<rank>``."""
    device = torch.device(device_type, rank) if device_type == "cuda" else CPU
    # The Checkpointer's line per snapshot ("... | snapshot saved at ...") would bury the table.
    with process_group(rank, world_size, port, device), open(os.devnull, "w") as quiet, \
            contextlib.redirect_stdout(quiet):
        folder = os.path.join(os.path.dirname(out), "saves")  # one for every rank, as --snapshot_path is
        results = []
        for strategy in ("ddp", "fsdp"):
            os.makedirs(folder, exist_ok=True)
            dist.barrier()
            model, optimizer, step = _snapshot_model(device, strategy)
            savers = {mode: _snapshot_saver(model, optimizer, strategy, mode == "async", folder)
                      for mode in ("sync", "async")}
            step_s = timed(step, 3, device, barrier=True)  # warm-up, then a step's time
            step_s = timed(step, 5, device, barrier=True)
            write = _snapshot_block(step, *savers["sync"], 1, 1, device)["seconds"]  # one synchronous save
            # The interval between snapshots: long enough for a write to end before the next is due.
            every = torch.tensor(max(5, round(max(3.0, 3 * write) / step_s)), device=device)
            dist.all_reduce(every, op=dist.ReduceOp.MAX)  # rank 0's write is the DDP save: all agree on it
            every = int(every)
            steps = every * snapshots
            blocks = {"none": functools.partial(_snapshot_block, step, *savers["sync"], steps, 0, device),
                      **{mode: functools.partial(_snapshot_block, step, *savers[mode], steps, every, device)
                         for mode in ("sync", "async")}}
            times = interleaved(blocks, reps)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            results.append({"strategy": strategy, "step_s": step_s, "every_steps": every, "steps": steps,
                            "times": times})
        if rank == 0:
            torch.save(results, out)
        else:  # rank 0 keeps its own blocking figures; the slowest rank's hold everyone
            torch.save(results, out + f".{rank}")


def _snapshot_row(result: dict, others: list, state_mib: float) -> dict:
    """One strategy's figures, from every rank's blocks: blocking seconds per
    snapshot (median over snapshots of the slowest rank's); the throughput
    cost with a snapshot every interval (median block time over none's, wall
    time of rank 0 and CPU time of all ranks together: on a busy machine the
    CPU time counts none of the other processes' time), and that cost scaled
    to one snapshot a minute (times the interval in seconds, over 60)."""
    row = {"strategy": result["strategy"], "step_s": result["step_s"], "every_steps": result["every_steps"],
           "state_mib": state_mib}
    every_rank = [result] + others

    def median_of(mode: str, key: str) -> float:
        return sum(statistics.median(block[key] for block in r["times"][mode])
                   for r in (every_rank if key == "cpu_seconds" else [result]))

    base = median_of("none", "seconds")
    row["interval_s"] = base / result["steps"] * result["every_steps"]
    for mode in ("sync", "async"):
        per_rank = [r["times"][mode] for r in every_rank]
        blocked = [max(values) for values in zip(*(sum((b["blocked"] for b in blocks), []) for blocks in per_rank))]
        cost, cpu_cost = (median_of(mode, key) / median_of("none", key) - 1 for key in ("seconds", "cpu_seconds"))
        row.update({f"{mode}_blocked_s": statistics.median(blocked), f"{mode}_cost": cost,
                    f"{mode}_cpu_cost": cpu_cost, f"{mode}_cost_per_minute": cost * row["interval_s"] / 60,
                    f"{mode}_cpu_cost_per_minute": cpu_cost * row["interval_s"] / 60})
    return row


def section_snapshot_cost(device_type: str = None, reps: int = 3, snapshots: int = 3) -> dict:
    """Blocking seconds per snapshot, synchronous vs asynchronous (train.py's
    default), DDP file and FSDP shards, of about 100 MB of training state at
    world size 2 (on CUDA: one process per GPU, at most 2); and the training
    throughput with a snapshot every interval (at least 3 s and 3 writes long,
    so that a write ends before the next is due) against none, ``reps``
    interleaved blocks of ``snapshots`` intervals each. The cost of one
    snapshot a minute: the extra seconds per snapshot over 60 s."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    world_size = 2 if device_type == "cpu" else min(2, torch.cuda.device_count())
    out = os.path.join(tempfile.mkdtemp(dir=os.environ.get("SNAPSHOT_BENCH_DIR")), "snapshot_cost.pt")
    try:
        mp.spawn(_snapshot_cost_worker, args=(world_size, free_port(), device_type, reps, snapshots, out),
                 nprocs=world_size)
        results = torch.load(out)
        others = [torch.load(out + f".{rank}") for rank in range(1, world_size)]
    finally:
        shutil.rmtree(os.path.dirname(out), ignore_errors=True)
    params = SNAPSHOT_LAYERS * (SNAPSHOT_WIDTH + 1) * SNAPSHOT_WIDTH
    rows = [_snapshot_row(result, [other[i] for other in others], params * 8 / 2**20)
            for i, result in enumerate(results)]
    text = table(f"9. Snapshot cost: {params / 1e6:.1f} M-parameter MLP, SGD momentum (training state "
                 f"{params * 8 / 1e6:.0f} MB), world size {world_size}, {device_type}; blocking: seconds a "
                 f"snapshot holds the training loop (median); cost: throughput lost with a snapshot every "
                 f"interval, and at one a minute (target <= 2%)",
                 ["strategy", "step s", "interval s", "sync blocking s", "async blocking s",
                  "sync cost at interval (wall; CPU)", "async cost at interval (wall; CPU)",
                  "sync cost, 1/min (wall; CPU)", "async cost, 1/min (wall; CPU)"],
                 [[r["strategy"], r["step_s"], r["interval_s"], r["sync_blocked_s"], r["async_blocked_s"]]
                  + [f"{r[mode + '_cost' + scale]:.1%}; {r[mode + '_cpu_cost' + scale]:.1%}"
                     for scale in ("", "_per_minute") for mode in ("sync", "async")] for r in rows])
    return {"results": rows, "world_size": world_size, "device": device_type, "table": text}
