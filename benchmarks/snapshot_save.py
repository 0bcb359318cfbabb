"""Section 7, snapshot_save: how fast a snapshot reaches the disk, and the
largest model whose snapshot fits in what Slurm's KillWait leaves.

Measures ``train_utils.snapshots.file.atomic_save`` (torch.save to a temporary file, fsync,
rename) of 64 MiB to 1 GiB of fp32 tensors in ``--save_dir`` (point it at your
snapshots' storage; default a temporary folder), median of 3 per size.

Reading the table: seconds and MiB/s per size; the line under it takes the
slowest size's rate and gives the parameters whose snapshot (weights +
optimizer state) is written within 25 s (docs/slurm.md).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import torch

from train_utils.snapshots.file import atomic_save
from benchmarks.harness import table

def section_snapshot_save(save_dir: str = None, sizes_mib=(64, 256, 1024), reps: int = 3) -> dict:
    """How fast a snapshot reaches the disk: ``train_utils.snapshots.file.atomic_save`` (torch.save
    to a temporary file, fsync, rename) of fp32 tensors of each size, in
    ``save_dir`` (the storage snapshots go to; default a temporary folder),
    median of ``reps``. And what that rate means for a stop: the largest model
    whose snapshot (weights + optimizer state, 4 bytes each per parameter and
    state) is written within 25 s, which is what is left of Slurm's default
    KillWait (30 s) after ~5 s for the step under way and the one after it
    (docs/slurm.md)."""
    folder = tempfile.mkdtemp(dir=save_dir, prefix="save-bench-")
    rows, rates = [], []
    try:
        for mib in sizes_mib:
            state = {"weights": torch.ones(mib * 2**20 // 4)}  # fp32: 4 bytes each
            path = os.path.join(folder, "snapshot.pt")
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                atomic_save(state, path)
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            rates.append(mib / seconds)
            rows.append([f"{mib} MiB", f"{seconds:.2f}", f"{mib / seconds:.0f}"])
            os.remove(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rate = min(rates)  # MiB/s: the slowest of the sizes, the safe figure
    budget_s = 25.0
    fits = {name: rate * 2**20 * budget_s / per_param / 1e6
            for name, per_param in (("SGD with momentum", 8), ("AdamW", 12))}
    note = (f"Within {budget_s:.0f} s at {rate:.0f} MiB/s: " +
            "; ".join(f"{name}: {millions:,.0f} M parameters" for name, millions in fits.items()))
    return {"rate_mib_per_s": rate, "fits_millions_of_parameters": fits,
            "table": table("7. snapshot save rate (atomic_save: write, fsync, rename; "
                           f"{save_dir or 'a temporary folder'})",
                           ["snapshot", "s", "MiB/s"], rows) + "\n\n" + note}
