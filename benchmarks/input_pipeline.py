"""Section 2, input_pipeline: the fast input path against torchvision's
per-sample transforms.

Measures training images/s through the DataLoader and the task's device
transform on CIFAR-10-shaped files in the real on-disk format (built by
support/data.py): the fast path (uint8 batches, crop + flip + normalize
on the device, 0 workers) against torchvision's per-sample transforms with 2
and 0 DataLoader workers; one epoch per repetition, interleaved.

Reading the table: images/s of each path, best epoch and median epoch, and
each over torchvision with 2 workers (the target: fast >= 5x). The line under
it is the fast path's one-off decode of the files into uint8 tensors, in
seconds.
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import common
import train_utils
from benchmarks.harness import interleaved, table
from support.data import build_cifar10_root
from support.trainer import load_task

def _pipeline_images_per_s(task, num_workers: int, batch_size: int, epochs: int) -> float:
    """Training images/s through the DataLoader (1-replica DistributedSampler,
    as the DDP scripts use) and the task's device transform, ``epochs`` full
    epochs (DataLoader workers start anew each epoch, as in the scripts)."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(task.train_set, num_replicas=1, rank=0, seed=0)
    loader = DataLoader(task.train_set, batch_size=batch_size, sampler=sampler, drop_last=True,
                        num_workers=num_workers, collate_fn=common.collate,
                        pin_memory=torch.cuda.is_available())
    device = train_utils.device_for(0)
    images = 0
    start = time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for source, targets in loader:
            source = task.train_transform(source.to(device, non_blocking=True))
            targets = targets.to(device, non_blocking=True)
            images += len(source)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return images / (time.perf_counter() - start)


def section_input(n_train: int = 10000, batch_size: int = 256, reps: int = 5) -> dict:
    """Section 2: images/s of the fast path and of torchvision's per-sample
    path (2 and 0 workers) on CIFAR-10-shaped files of ``n_train`` training
    images (a tenth held out for validation by the task), batch ``batch_size``,
    ``reps`` interleaved epochs per path after one warm-up epoch each; and the
    seconds the fast path takes to decode the files."""
    import torchvision.datasets.cifar as cifar

    cifar.check_integrity = lambda path, md5=None: os.path.isfile(path)  # our files, not the official
    root = build_cifar10_root(Path(tempfile.mkdtemp()) / "cifar", per_batch=n_train // 5, n_test=100)
    start = time.perf_counter()
    fast = load_task("cifar10", root, "fast")
    decode_s = time.perf_counter() - start
    slow = load_task("cifar10", root, "torchvision")
    torch.manual_seed(0)
    paths = {"fast (uint8 batches, device augmentation), 0 workers": (fast, 0),
             "torchvision per-sample, 2 workers": (slow, 2),
             "torchvision per-sample, 0 workers": (slow, 0)}
    for task, workers in paths.values():  # warm-up: allocator, caches, worker start-up code
        _pipeline_images_per_s(task, workers, batch_size, epochs=1)
    runs = interleaved({name: functools.partial(_pipeline_images_per_s, task, workers, batch_size, epochs=1)
                        for name, (task, workers) in paths.items()}, reps)  # one epoch each
    best = {name: max(v) for name, v in runs.items()}
    med = {name: statistics.median(v) for name, v in runs.items()}
    fast_name, slow_name = list(runs)[:2]
    rows = [[name, best[name], best[name] / best[slow_name], med[name], med[name] / med[slow_name]]
            for name in runs]
    text = table(f"2. Input pipeline, CIFAR-10-shaped, {len(fast.train_set):,} training images, "
                 f"batch {batch_size}, crop(pad 4) + flip + normalize, {reps} interleaved epochs "
                 f"per path (target fast / torchvision 2 workers >= 5x)",
                 ["path", "images/s (best epoch)", "vs torchvision 2 workers", "images/s (median)",
                  "vs torchvision 2 workers (median)"], rows)
    text += f"\n\nfast path one-off decode into uint8 tensors: {decode_s:.2f} s"
    return {"images_per_s_best": best, "images_per_s_median": med, "runs": runs,
            "ratio_fast_vs_torchvision_2_workers": best[fast_name] / best[slow_name],
            "ratio_fast_vs_torchvision_2_workers_median": med[fast_name] / med[slow_name],
            "fast_decode_seconds": decode_s, "train_images": len(fast.train_set),
            "batch_size": batch_size, "table": text}
