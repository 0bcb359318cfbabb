"""Section 3, scaling: train.py's global samples/s with 1 and 2 processes, and
the share of a training step that is the gradient all-reduce.

Measures train.py on real MNIST under torchrun (gloo on a CPU, nccl on GPUs):
1 process with all cores, 1 process of 1 thread (the per-core baseline) and 2
processes of 1 thread each, from the last epoch's record in --metrics_path.
Then, in 2 spawned processes (``_allreduce_worker``), the median time of a DDP
step of the MNIST CNN with its all-reduce and under ``no_sync()`` without it,
and a bare all_reduce of the gradients' size.

Reading the table: "vs 1 process x 1 thread" is the speed-up over one core;
a process count beyond the GPU count is skipped. The line under it gives the
step's milliseconds with and without the all-reduce and the difference as a
share of the step.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import train_utils
from benchmarks.harness import (REPO, backend_for, build_model, ddp, interleaved, process_group, table, timed,
                                train_step)
from support.runs import TORCHRUN, free_port, script_env

def _allreduce_worker(rank: int, world_size: int, port: int, steps: int, reps: int, out: str):
    """A spawned rank of ``world_size`` (mp.spawn's target): the median seconds
    of a DDP step of the MNIST CNN with the gradient all-reduce and under
    ``no_sync()`` without it, ``reps`` interleaved blocks of ``steps`` steps,
    and of a bare all_reduce of all gradients as one tensor; rank 0 saves them
    to ``out`` (with the gradients' size in MB)."""
    device = train_utils.device_for(rank)
    with process_group(rank, world_size, port, device):
        torch.manual_seed(0)
        model = ddp(build_model("mnist", "cnn").to(device), device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        x = torch.randn(32, 1, 28, 28, device=device)
        y = torch.randint(0, 10, (32,), device=device)
        step = train_step(model, opt, F.cross_entropy, x, y)

        def step_without_allreduce():
            with model.no_sync():  # the same step without the gradient all-reduce
                step()

        for _ in range(3):
            step()
        times = interleaved({variant: functools.partial(timed, fn, steps, device, barrier=True)
                             for variant, fn in (("with", step), ("without", step_without_allreduce))},
                            reps)
        # The all-reduce alone: one flat tensor the size of all gradients.
        flat = torch.zeros(sum(p.numel() for p in model.parameters()), device=device)
        alone = timed(lambda: dist.all_reduce(flat), steps, device, barrier=True)
        if rank == 0:
            torch.save({"with": statistics.median(times["with"]),
                        "without": statistics.median(times["without"]),
                        "allreduce_alone": alone, "grad_mb": flat.numel() * 4 / 1e6}, out)


def _metrics_run(cmd: list, cwd: Path, **env: str) -> list[dict]:
    """Run ``cmd`` (a train.py launch writing --metrics_path m.jsonl) in ``cwd``
    with ``env`` added; its metrics records, the start record left out."""
    subprocess.run([str(c) for c in cmd], cwd=cwd, check=True, capture_output=True, text=True,
                   env=script_env(**env))
    records = [json.loads(line) for line in (cwd / "m.jsonl").read_text().splitlines()]
    return [record for record in records if "event" not in record]  # not the run's start record


def section_scaling(mnist: Path, epochs: int = 2) -> dict:
    """Section 3: global samples/s of train.py on the real MNIST in ``mnist``,
    from the last of ``epochs`` epochs, at 1 process (all threads, then 1
    thread) and 2 processes of 1 thread; then, where 2 processes can run, the
    all-reduce share of a 2-process step (``_allreduce_worker``)."""
    results = []
    cores = os.cpu_count() or 1
    # torchrun leaves OMP_NUM_THREADS alone for 1 process (it uses every core)
    # and sets 1 per process for several; 1 process x 1 thread is the per-core baseline.
    gpus = torch.cuda.device_count()
    for nproc, threads in ((1, None), (1, 1), (2, None)):
        if gpus and nproc > gpus:  # one process per GPU: a second would ask for cuda:1
            results.append({"processes": nproc, "threads_per_process": threads or 1,
                            "skipped": f"needs {nproc} GPUs, this machine has {gpus}"})
            continue
        cwd = Path(tempfile.mkdtemp())
        env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
        records = _metrics_run(TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}",
                                           REPO / "train.py", "--dataset", "mnist",
                                           "--data_dir", mnist, "--total_epochs", str(epochs),
                                           "--metrics_path", "m.jsonl"], cwd, **env)
        last = [r for r in records if "epoch" in r][-1]
        results.append({"processes": nproc, "threads_per_process": threads or (cores if nproc == 1 else 1),
                        "samples_per_s": last["samples_per_s"], "epoch_seconds": last["epoch_seconds"]})
    backend = backend_for()
    rows = [[r["processes"], r["threads_per_process"], backend, r.get("samples_per_s", r.get("skipped")),
             r["samples_per_s"] / results[1]["samples_per_s"] if "samples_per_s" in r else "-",
             r.get("epoch_seconds", "-")] for r in results]
    text = table(f"3. Scaling: train.py, real MNIST (7,200 training digits), batch 32 "
                 f"per process, epoch {epochs}",
                 ["processes", "threads each", "backend", "global samples/s",
                  "vs 1 process x 1 thread", "epoch s"], rows)
    if gpus == 1:
        text += "\n\nall-reduce share: skipped (needs 2 processes, one GPU each; this machine has 1)"
        return {"results": results, "backend": backend, "table": text}
    out = os.path.join(tempfile.mkdtemp(), "ar.pt")
    mp.spawn(_allreduce_worker, args=(2, free_port(), 20, 5, out), nprocs=2)
    ar = torch.load(out)
    share = 1 - ar["without"] / ar["with"]
    text += (f"\n\nall-reduce share of a 2-process step (CNN, batch 32, {ar['grad_mb']:.1f} MB of "
             f"gradients): step {ar['with'] * 1e3:.1f} ms with DDP's all-reduce, "
             f"{ar['without'] * 1e3:.1f} ms under no_sync() -> {share:.0%} of the step; "
             f"a bare all_reduce of that size takes {ar['allreduce_alone'] * 1e3:.1f} ms")
    return {"results": results, "allreduce": ar, "allreduce_share": share, "backend": backend,
            "table": text}
