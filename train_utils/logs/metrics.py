"""The epoch line (or, evaluating by steps, the evaluation's line), and the same figures as JSON lines (--metrics_path),
TensorBoard scalars (--tensorboard_dir) and a W&B run (--wandb_project),
all kept by one ``RunLog`` per training run.
"""

from __future__ import annotations

import json
import os
import time
from types import MappingProxyType
from typing import Optional

import torch.distributed as dist

from ..output import print_line
from .wandb_run import WandbRun

# TensorBoard's tag for each figure of a record.
TENSORBOARD_TAGS = MappingProxyType({"train_loss": "loss/train", "val_loss": "loss/val", "val_accuracy": "accuracy/val",
                    "test_loss": "loss/test", "test_accuracy": "accuracy/test", "lr": "lr",
                    "skipped_steps": "loss_scaler/skipped_steps",
                    "samples_per_s": "speed/samples_per_s", "tokens_per_s": "speed/tokens_per_s",
                    "flops_per_s": "speed/flops_per_s", "mfu": "speed/mfu", "epoch_seconds": "speed/epoch_seconds",
                    "best_val_loss": "loss/best_val", "interval_seconds": "speed/interval_seconds",
                    "peak_gpu_memory_mib": "memory/peak_gpu_mib"})


def tensorboard_missing() -> str:
    """'' when tensorboard can be imported, else the one-line error for --tensorboard_dir."""
    try:
        import torch.utils.tensorboard  # noqa: F401  (needs the tensorboard package)
    except ImportError as exc:
        return (f"--tensorboard_dir needs the tensorboard package ({exc}); "
                f"pip install tensorboard, or leave the flag out")
    return ""


# The epoch line after "epoch E/N", in order: (record key, label, format spec or "rate": ``rate``);
# a part whose key the record lacks, or holds as None, is left out.
EPOCH_LINE_PARTS = (("train_loss", "train_loss", ".6f"), ("val_loss", "val_loss", ".6f"),
                    ("val_accuracy", "val_acc", ".4f"), ("samples_per_s", "samples/s", "rate"),
                    ("tokens_per_s", "tokens/s", "rate"), ("flops_per_s", "flop/s", ".3g"), ("mfu", "mfu", ".4f"),
                    ("epoch_seconds", "epoch_s", ".2f"), ("lr", "lr", ".6g"), ("skipped_steps", "skipped_steps", ""),
                    ("peak_gpu_memory_mib", "peak_mem_mib", ".1f"))


def rate(value: float) -> str:
    """A speed (samples/s, tokens/s) as the lines print it: one decimal from
    1 up (12345.6), three significant digits below (0.00417: a GPT-2 step on
    a CPU takes minutes), never a rounded 0.0 for a run that trained."""
    return f"{value:.1f}" if value >= 1 or value == 0 else f"{value:.3g}"


def _formatted(value, spec: str) -> str:
    return rate(value) if spec == "rate" else f"{value:{spec}}"


# The evaluation's line under --eval_every_steps after "step S/T | epoch E/N", likewise.
STEP_LINE_PARTS = (("train_loss", "train_loss", ".6f"), ("val_loss", "val_loss", ".6f"),
                   ("val_accuracy", "val_acc", ".4f"), ("best_val_loss", "best_val_loss", ".6f"),
                   ("best_step", "best_step", ""), ("samples_per_s", "samples/s", "rate"),
                   ("tokens_per_s", "tokens/s", "rate"), ("flops_per_s", "flop/s", ".3g"), ("mfu", "mfu", ".4f"),
                   ("interval_seconds", "interval_s", ".2f"), ("lr", "lr", ".6g"),
                   ("skipped_steps", "skipped_steps", ""), ("peak_gpu_memory_mib", "peak_mem_mib", ".1f"))


def metrics_line(record: dict) -> str:
    """The one fixed-format line of a metrics record.

    Epoch records:
      ``epoch 3/10 | train_loss 0.012345 | val_loss 0.012345 | val_acc 0.9512 |
      samples/s 12345.6 | tokens/s 790118.4 | flop/s 2.91e+11 | mfu 0.4123 |
      epoch_s 0.52 | lr 0.05 | skipped_steps 0 | peak_mem_mib 1234.5``
      (val_acc only for classification; tokens/s only for a task whose
      samples count tokens, flop/s where the model's FLOPs per sample are
      known (every built-in task: counted at start), mfu on a GPU of known
      peak, the record's mfu_precision naming the peak's precision:
      ``throughput_figures``; skipped_steps
      only under fp16, peak_mem_mib only on CUDA); under --eval_every_steps
    one line per evaluation instead (``StepEvaluations.record``):
      ``step 25/80 | epoch 1/2 | train_loss 3.856027 | val_loss 3.663554 |
      best_val_loss 3.663554 | best_step 25 | samples/s 1161.2 | tokens/s
      18579.5 | flop/s 1.7e+09 | interval_s 0.34 | lr 0.000914058`` (the
      same parts, val_acc and mfu included, over the steps since the last evaluation,
      and the lowest validation loss so far with its step; no speed parts on
      an evaluation a resumed run redoes before training); the final test record:
    ``test | loss 0.012345 | acc 0.9600``.
    Units: samples/s is global training samples per second over the training
    part of the epoch; tokens/s the same in tokens; flop/s the model FLOPs
    per second that makes; mfu that over the GPUs' peak FLOP/s (a fraction);
    epoch_s is that part's wall-clock seconds; lr the learning rate of the
    epoch's last optimizer step; skipped_steps
    the optimizer steps the fp16 loss scaler skipped (inf/nan gradients); peak_mem_mib
    the epoch's peak GPU memory held by tensors, MiB, the maximum over ranks.
    """
    if "epoch" not in record:
        parts = ["test", f"loss {record['test_loss']:.6f}"]
        if record.get("test_accuracy") is not None:
            parts.append(f"acc {record['test_accuracy']:.4f}")
        return " | ".join(parts)
    if "step" in record:
        return " | ".join([f"step {record['step']}/{record['total_steps']}",
                           f"epoch {record['epoch']}/{record['total_epochs']}"]
                          + [f"{label} {_formatted(record[key], spec)}" for key, label, spec in STEP_LINE_PARTS
                             if record.get(key) is not None])
    return " | ".join([f"epoch {record['epoch']}/{record['total_epochs']}"]
                      + [f"{label} {_formatted(record[key], spec)}" for key, label, spec in EPOCH_LINE_PARTS
                         if record.get(key) is not None])


class RunLog:
    """One training run's outputs: the epoch line on stdout, and where asked
    for, JSON lines (``metrics_path``, --metrics_path), TensorBoard
    (``tensorboard_dir``, --tensorboard_dir) and W&B (``wandb_project``,
    --wandb_project: ``wandb``). Made once per run, first thing, on every
    rank; only the rank that logs (rank 0) calls ``log``.

    ``run`` is this run's id in the JSON lines (start time and process id);
    ``resumed_from`` the snapshot position it resumed at (``resumed``; None
    for a fresh start); ``started_at`` its start record's time (Unix seconds).
    """

    def __init__(self, metrics_path: Optional[str] = None, tensorboard_dir: Optional[str] = None,
                 wandb_project: Optional[str] = None, started_at: Optional[float] = None) -> None:
        self.metrics_path, self.tensorboard_dir = metrics_path, tensorboard_dir
        self.config: dict = {}  # the run's, from ``start``: the start record's "config"
        self.started_at = time.time() if started_at is None else started_at
        self.run = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(self.started_at))}-{os.getpid()}"
        self.resumed_from: Optional[str] = None
        self.wandb = WandbRun(wandb_project)
        self._last_epoch = 0  # the last epoch (or evaluation step) logged: TensorBoard's step for the test figures
        self._wrote_start = False  # the start record is in --metrics_path
        self._writer = None  # TensorBoard's SummaryWriter, made at the first record

    def start(self, config: dict) -> None:
        """Collective: the run starts training (after the snapshot, if any, is
        loaded), ``config`` its configuration (``RunConfig.as_dict``): rank 0
        writes the start record to --metrics_path now, so a run stopped
        before its first epoch ends leaves one, and every rank starts the W&B
        run (``WandbRun.start``: rank 0's, after a resume the snapshot's)."""
        self.config = config
        if self.metrics_path and dist.get_rank() == 0:
            self._append_json(None)
        self.wandb.start(config)

    def log(self, record: dict) -> None:
        """Print ``metrics_line(record)``; append ``record`` as JSON to
        --metrics_path, write it to TensorBoard and to the W&B run.

        Each JSON line also carries ``run``, ``time`` (Unix seconds) and
        ``resumed_from``; a run's first line is ``{"event": "start", ...,
        "config": {the flags}}`` whose ``time`` is ``started_at``. A resumed
        run repeats the epochs after its snapshot: for a curve keep the last
        record of each epoch."""
        print_line(metrics_line(record))
        if self.metrics_path:
            self._append_json(record)
        if self.tensorboard_dir:
            self._tensorboard(record)
        self.wandb.log(record)  # a no-op unless wandb.start() started a run here

    def resumed(self, path: str, position: str, note: str = "") -> None:
        """Print ``resuming from snapshot PATH POSITION[NOTE]`` (e.g. "after epoch
        2", "in epoch 3 after step 40"; FSDP's resharding ``note``), and stamp
        every later record with ``resumed_from`` = ``position``."""
        self.resumed_from = position
        print_line(f"resuming from snapshot {path} {position}{note}")

    def close(self, failed: bool = False) -> None:
        """The run's end: finish the W&B run (``failed``: marked as failed, an
        exception ended the run), close the TensorBoard writer."""
        self.wandb.finish(failed)
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _append_json(self, record: Optional[dict]) -> None:
        """Append ``record`` with the stamp, after the run's start record if
        that is not written yet; None: the start record alone."""
        stamp = {"run": self.run, "time": time.time(), "resumed_from": self.resumed_from}
        with open(self.metrics_path, "a") as f:
            if not self._wrote_start:  # each run opens with its settings
                f.write(json.dumps({"event": "start", **stamp, "time": self.started_at,
                                    "config": self.config}) + "\n")
                self._wrote_start = True
            if record is not None:
                f.write(json.dumps({**record, **stamp}) + "\n")

    def _tensorboard(self, record: dict) -> None:
        """Write ``record``'s figures as TensorBoard scalars, step = epoch (an
        evaluation's record under --eval_every_steps: step = its optimizer step).

        The writer is made at this run's first record, with ``purge_step`` =
        that record's epoch: TensorBoard then hides points an earlier run wrote
        at that epoch or later (a run killed after its last snapshot, resumed
        from there), so a resumed run continues its curves with no duplicated or
        missing points, and a fresh run in the same folder replaces them.
        """
        from torch.utils.tensorboard import SummaryWriter  # optional: checked before training

        step = record.get("step", record.get("epoch", self._last_epoch))  # test: at the end
        self._last_epoch = step
        if self._writer is None:
            self._writer = SummaryWriter(self.tensorboard_dir, purge_step=step)
        for key, tag in TENSORBOARD_TAGS.items():
            if record.get(key) is not None:
                self._writer.add_scalar(tag, record[key], step)
        self._writer.flush()


class StepLog:
    """--log_every_steps N: a progress line on rank 0 every N optimizer steps,
    in a log file as on a terminal (the progress bar shows on terminals only)::

        step 200 | epoch 1 | tokens 2,457,600 | loss 2.412345 | lr 0.000998 | tokens/s 10345.2 | ms/step 74.2

    ``step``: optimizer steps of the run so far; ``samples`` (``tokens``
    for a task whose samples count ``tokens_per_sample`` tokens): those the
    run has trained so far, on every rank and before a resume (the
    evaluations' ``samples_run`` and ``carried_samples``, plus rank 0's count
    in this start's interval x the world size); ``loss``: rank 0's mean
    training loss over the micro-batches since the last line (its own: no
    collective); ``lr``: the last step's learning rate; ``samples/s`` (or
    ``tokens/s`` for a task whose samples count ``tokens_per_sample`` tokens):
    every rank's over the same interval (rank 0's count x the world size,
    ranks training equal batches); ``ms/step``: wall-clock milliseconds per
    optimizer step over the interval, evaluation and snapshots included
    when they fall in it. A line reads the loss from the device, waiting for
    it once per N steps (nanoGPT's ``log_interval`` does the same). N 0, and
    every rank but 0: nothing.
    """

    def __init__(self, every: int, tokens_per_sample: int = 0) -> None:
        self.every = every if dist.get_rank() == 0 else 0
        self.tokens_per_sample, self.world_size = tokens_per_sample, dist.get_world_size()
        self._interval = None  # the evaluation interval of the line's start (Evaluations.interval_id)
        self._start = (0.0, 0.0, 0.0, 0)  # (loss sum, samples, perf_counter seconds, step) then

    def step(self, step: int, epoch: int, evaluations, lr: float) -> None:
        """Optimizer step ``step`` (of the run) of epoch ``epoch`` (0-based) is
        done; ``evaluations`` (``Evaluations``) holds the training loss since
        the last evaluation, ``lr`` is the step's learning rate. Prints every
        ``every`` steps."""
        if not self.every:
            return
        if evaluations.interval_id is not self._interval:  # an evaluation (or a start): count from its interval
            self._interval, self._start = evaluations.interval_id, (0.0, 0.0, evaluations.started, step - 1)
        if step % self.every:
            return
        loss_sum, samples = evaluations.local_totals().tolist()  # waits for the device
        now = time.perf_counter()
        loss_before, samples_before, then, step_before = self._start
        self._start = (loss_sum, samples, now, step)
        new = samples - samples_before
        if not new:
            return
        per_s = new * self.world_size / (now - then)
        trained = int(evaluations.samples_run) + evaluations.carried_samples + round(samples) * self.world_size
        if self.tokens_per_sample:
            count, speed = f"tokens {trained * self.tokens_per_sample:,}", f"tokens/s {rate(per_s * self.tokens_per_sample)}"
        else:
            count, speed = f"samples {trained:,}", f"samples/s {rate(per_s)}"
        print_line(f"step {step} | epoch {epoch + 1} | {count} | loss {(loss_sum - loss_before) / new:.6f} | "
                   f"lr {lr:.6g} | {speed} | ms/step {1000 * (now - then) / (step - step_before):.1f}")
