"""The epoch line, and the same figures as JSON lines (--metrics_path),
TensorBoard scalars (--tensorboard_dir) and a W&B run (--wandb_project).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from .output import print_line
from .wandb_run import log_to_wandb

# This run, as its metrics records name it: an id (start time and process id),
# and where it resumed from (set by log_resume; None for a fresh start).
RUN = {"run": f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}",
       "resumed_from": None,
       "last_epoch": 0,  # the last epoch it logged (TensorBoard's step for the test figures)
       "started_at": time.time()}  # Unix seconds: the start record's time (this process's start)
_started: set = set()  # the --metrics_path files this process has written its start record to
_writers: dict = {}  # tensorboard_dir -> SummaryWriter of this process


def tensorboard_missing() -> str:
    """'' when tensorboard can be imported, else the one-line error for --tensorboard_dir."""
    try:
        import torch.utils.tensorboard  # noqa: F401  (needs the tensorboard package)
    except ImportError as exc:
        return (f"--tensorboard_dir needs the tensorboard package ({exc}); "
                f"pip install tensorboard, or leave the flag out")
    return ""


def _tensorboard(record: dict, log_dir: str) -> None:
    """Write ``record``'s figures as TensorBoard scalars, step = epoch.

    The writer is made at this process's first record, with ``purge_step`` =
    that record's epoch: TensorBoard then hides points an earlier run wrote
    at that epoch or later (a run killed after its last snapshot, resumed
    from there), so a resumed run continues its curves with no duplicated or
    missing points, and a fresh run in the same folder replaces them.
    """
    from torch.utils.tensorboard import SummaryWriter

    step = record["epoch"] if "epoch" in record else RUN["last_epoch"]  # test: at the end
    if "epoch" in record:
        RUN["last_epoch"] = record["epoch"]
    if log_dir not in _writers:
        _writers[log_dir] = SummaryWriter(log_dir, purge_step=step)
    writer = _writers[log_dir]
    names = {"train_loss": "loss/train", "val_loss": "loss/val", "val_accuracy": "accuracy/val",
             "test_loss": "loss/test", "test_accuracy": "accuracy/test", "lr": "lr",
             "skipped_steps": "loss_scaler/skipped_steps",
             "samples_per_s": "speed/samples_per_s", "epoch_seconds": "speed/epoch_seconds",
             "peak_gpu_memory_mib": "memory/peak_gpu_mib"}
    for key, tag in names.items():
        if record.get(key) is not None:
            writer.add_scalar(tag, record[key], step)
    writer.flush()


def log_metrics(record: dict, args: argparse.Namespace) -> None:
    """Print one fixed-format line; append ``record`` as JSON to
    --metrics_path, write it to TensorBoard under --tensorboard_dir and to
    the W&B run of --wandb_project (``start_wandb_run``; ``log_to_wandb``).

    Epoch records print as
      ``epoch 3/10 | train_loss 0.012345 | val_loss 0.012345 | val_acc 0.9512 |
      samples/s 12345.6 | epoch_s 0.52 | lr 0.05 | skipped_steps 0 |
      peak_mem_mib 1234.5``  (val_acc only for classification, skipped_steps
      only under fp16, peak_mem_mib only on CUDA); the final test record as
    ``test | loss 0.012345 | acc 0.9600``.
    Units: samples/s is global training samples per second over the training
    part of the epoch; epoch_s is that part's wall-clock seconds; lr the
    learning rate of the epoch's last optimizer step; skipped_steps
    the optimizer steps the fp16 loss scaler skipped (inf/nan gradients); peak_mem_mib
    the epoch's peak GPU memory held by tensors, MiB, the maximum over ranks.
    Each JSON line also carries ``run`` (this run's id), ``time`` (Unix
    seconds) and ``resumed_from`` (the snapshot position a resumed run
    started at, else null); a run's first line is ``{"event": "start", ...,
    "config": {the flags}}`` whose ``time`` is when the process started. A
    resumed run repeats the epochs after its snapshot: for a curve keep the
    last record of each epoch.
    """
    if "epoch" in record:
        parts = [f"epoch {record['epoch']}/{record['total_epochs']}",
                 f"train_loss {record['train_loss']:.6f}", f"val_loss {record['val_loss']:.6f}"]
        if record.get("val_accuracy") is not None:
            parts.append(f"val_acc {record['val_accuracy']:.4f}")
        parts += [f"samples/s {record['samples_per_s']:.1f}", f"epoch_s {record['epoch_seconds']:.2f}"]
        if record.get("lr") is not None:
            parts.append(f"lr {record['lr']:.6g}")
        if record.get("skipped_steps") is not None:
            parts.append(f"skipped_steps {record['skipped_steps']}")
        if record.get("peak_gpu_memory_mib") is not None:
            parts.append(f"peak_mem_mib {record['peak_gpu_memory_mib']:.1f}")
    else:
        parts = ["test", f"loss {record['test_loss']:.6f}"]
        if record.get("test_accuracy") is not None:
            parts.append(f"acc {record['test_accuracy']:.4f}")
    print_line(" | ".join(parts))
    if args.metrics_path:
        stamp = {"run": RUN["run"], "time": time.time(), "resumed_from": RUN["resumed_from"]}
        with open(args.metrics_path, "a") as f:
            if args.metrics_path not in _started:  # each run opens with its settings
                f.write(json.dumps({"event": "start", **stamp, "time": RUN["started_at"],
                                    "config": vars(args)}) + "\n")
                _started.add(args.metrics_path)
            f.write(json.dumps({**record, **stamp}) + "\n")
    if getattr(args, "tensorboard_dir", None):
        _tensorboard(record, args.tensorboard_dir)
    log_to_wandb(record)  # a no-op unless start_wandb_run started one here


def log_resume(path: str, position: str, note: str = "") -> None:
    """Print ``resuming from snapshot PATH POSITION[NOTE]`` (e.g. "after epoch
    2", "in epoch 3 after step 40"; the FSDP rung's resharding ``note``), and
    stamp every later metrics record of this run with ``resumed_from`` =
    ``position``. Called by the rank that logs metrics (rank 0)."""
    RUN["resumed_from"] = position
    print_line(f"resuming from snapshot {path} {position}{note}")
