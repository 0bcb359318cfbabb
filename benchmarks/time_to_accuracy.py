"""Section 4, time_to_accuracy: wall seconds from launch to 95% validation
accuracy on real MNIST, fast input path against torchvision's per-sample one.

Measures train.py under torchrun, 2 processes, reading its epoch lines as
they come and stopping the run at the first epoch whose validation accuracy
reaches the target; the two input paths alternate, ``reps`` runs each.

Reading the table: the median wall seconds from launch (start-up, imports and
decoding included), the epoch each run reached the target in, and each run's
seconds; "not reached" if no run did within 5 epochs.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import REPO, table
from support.runs import EPOCH_LINE, TORCHRUN, script_env

def _time_to_accuracy(mnist: Path, input_path: str, target: float, max_epochs: int) -> dict:
    """One train.py run on 2 processes with ``--input_path input_path``, stopped
    at the first epoch whose validation accuracy reaches ``target``: wall
    seconds from launch to that epoch's line (None if not within ``max_epochs``),
    the epoch, its accuracy, and the epochs' training seconds summed."""
    cwd = Path(tempfile.mkdtemp())
    cmd = TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "train.py",
                      "--dataset", "mnist", "--data_dir", mnist, "--total_epochs", str(max_epochs),
                      "--input_path", input_path]
    start = time.perf_counter()
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                            env=script_env())
    result = {"input_path": input_path, "seconds": None, "epoch": None, "train_seconds": 0.0}
    for line in proc.stdout:
        m = EPOCH_LINE.match(line)
        if not m:
            continue
        result["train_seconds"] += float(m["epoch_s"])
        if m["val_acc"] is not None and float(m["val_acc"]) >= target:
            result.update(seconds=time.perf_counter() - start, epoch=int(m["epoch"]),
                          val_acc=float(m["val_acc"]))
            os.killpg(proc.pid, signal.SIGTERM)  # reached: the rest of the run is not needed
            break
    proc.wait()
    return result


def section_time_to_accuracy(mnist: Path, target: float = 0.95, reps: int = 2) -> dict:
    """Section 4: ``reps`` runs of each input path (fast, torchvision),
    alternating, each timed to ``target`` validation accuracy
    (``_time_to_accuracy``); the median of the runs that reached it."""
    runs = []
    for rep in range(reps):
        for input_path in (("fast", "torchvision") if rep % 2 == 0 else ("torchvision", "fast")):
            runs.append(_time_to_accuracy(mnist, input_path, target, max_epochs=5))
    rows = []
    summary = {}
    for input_path in ("fast", "torchvision"):
        mine = [r for r in runs if r["input_path"] == input_path]
        reached = [r for r in mine if r["seconds"] is not None]
        seconds = statistics.median(r["seconds"] for r in reached) if reached else None
        summary[input_path] = seconds
        rows.append([input_path, seconds if seconds is not None else "not reached",
                     ", ".join(str(r["epoch"]) for r in mine),
                     ", ".join(f"{r['seconds']:.1f}" if r["seconds"] else "-" for r in mine)])
    text = table(f"4. Time to {target:.0%} validation accuracy, real MNIST (7,200 training digits, "
                 f"800 validation), train.py, 2 processes, batch 32 each, "
                 f"{'GPU' if torch.cuda.is_available() else 'CPU'}",
                 ["input path", "median wall s from launch", "epoch reached (per run)",
                  "wall s (per run)"], rows)
    return {"runs": runs, "median_seconds": summary, "target": target, "table": text}
