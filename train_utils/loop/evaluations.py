"""When the run evaluates (after every epoch, or every --eval_every_steps
optimizer steps and after its last) and what each evaluation's record
holds: the training loss of the interval since the last evaluation, summed
in one accumulator, the speed, the best validation loss so far; and what a
snapshot keeps of them, so that a resumed run goes on with the same figures.
"""

from __future__ import annotations

import time
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from .epoch import check_finite
from ..distributed import peak_memory_mib


class Evaluations:
    """The run's evaluations and the interval of training each one reports.

    ``every``: --eval_every_steps; 0 evaluates after every epoch (an epoch is
    then the interval), N > 0 after every N optimizer steps of the run and
    after its last, ``last_step`` (--max_steps, or --total_epochs x steps
    per epoch), however the steps fall into epochs (``by_steps``; nanoGPT's
    eval_interval). ``due(step, epoch_end)`` is the one rule. Per rank,
    ``add`` counts each training micro-batch into the interval: its loss sum
    stays on the device (one in-place add a micro-batch: a read of it would
    make the host wait for the GPU at every step), its sample count on the
    host. ``summary`` reduces the interval over the ranks (``global_totals``,
    the one place the training loss is summed over ranks), before the
    evaluation runs; ``record`` makes the evaluation's record of it and
    starts the next interval. ``epoch``: the 0-based epoch being trained;
    ``evaluated``: the step of the last evaluation by steps (0: none);
    ``best_loss``/``best_step``: the lowest validation loss so far and its
    step (by steps; None before the first); ``samples_run``: the samples
    trained by the run up to the last record, over all its starts (the sum
    of the records' "samples").

    As a snapshot's part (``state_dict``/``load_state_dict``, ``KEYS``) it
    keeps the interval's global totals ("epoch_totals" by epochs, inside an
    epoch; "interval_totals" by steps) and, by steps, the last evaluation
    and the best: an evaluation that a stop cut short (or never started) is
    done by the resumed run first, with the training loss the uninterrupted
    run reports.
    """

    KEYS = ("epoch_totals", "eval_step", "best_val_loss", "best_step", "interval_totals", "samples_run")

    def __init__(self, every: int, last_step: int, total_epochs: int, device: torch.device) -> None:
        self.every, self.last_step, self.total_epochs, self.device = every, last_step, total_epochs, device
        self.epoch = 0
        self.evaluated = 0
        self.best_loss: Optional[float] = None
        self.best_step: Optional[int] = None
        self.samples_run = 0
        self._carried = torch.zeros(2, dtype=torch.float64)  # global (loss sum, samples) before this start
        self._restart()

    @property
    def by_steps(self) -> bool:
        """Whether the run evaluates by steps (--eval_every_steps > 0), else after every epoch."""
        return bool(self.every)

    def _restart(self) -> None:
        """A new interval (or this start's part of one): its sums, its clock and, on CUDA, its peak memory."""
        self._loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._samples = 0
        self.interval_id = object()  # a new one for each interval: StepLog starts its count there
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.started = time.perf_counter()

    def start_epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` (0-based) starts training. By epochs its interval
        starts now: the clock (and the peak memory) from here, the epoch
        before having been recorded (or, resumed inside it, its totals
        carried)."""
        self.epoch = epoch
        if not self.by_steps:
            self.started = time.perf_counter()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)

    def add(self, loss: torch.Tensor, samples: int) -> None:
        """Count one micro-batch: its mean ``loss`` (0-dim, on the device) over
        ``samples`` samples (the product in the loss's dtype, summed in float64)."""
        self._loss.add_(loss * samples)
        self._samples += samples

    def running_loss(self) -> float:
        """This rank's mean training loss of the interval so far (a read from the device)."""
        return (self._loss / max(1, self._samples)).item()

    @property
    def carried_samples(self) -> int:
        """The samples of the interval trained before this start, on every
        rank (a resumed snapshot's; 0 in a fresh start or a new interval)."""
        return round(float(self._carried[1]))

    def local_totals(self) -> torch.Tensor:
        """This rank's (loss sum, samples) of the interval in this start: a new
        float64 (2,) tensor on the device, made without waiting for it."""
        return torch.stack([self._loss, torch.full((), self._samples, dtype=torch.float64, device=self.device)])

    def due(self, step: int, epoch_end: bool) -> bool:
        """Whether an evaluation is due after optimizer step ``step`` of the run,
        ``epoch_end`` when the epoch's training steps are done: by epochs at
        every epoch's end; by steps every ``every`` steps and at the last, once each."""
        if not self.by_steps:
            return epoch_end
        return step > self.evaluated and (step % self.every == 0 or step >= self.last_step)

    def _reduced(self) -> torch.Tensor:
        """Collective: this start's (loss sum, samples) of the interval summed
        over all ranks, float64 (2,) on the CPU: the one place the training
        loss is reduced."""
        totals = self.local_totals()
        dist.all_reduce(totals)
        return totals.cpu()

    def _with_carried(self, reduced: torch.Tensor) -> torch.Tensor:
        """``reduced`` with the part before this start added; raises ConfigError
        when their loss is not finite."""
        totals = reduced + self._carried
        if totals[1]:
            check_finite(totals[0].item() / totals[1].item(), self.epoch)
        return totals

    def global_totals(self) -> torch.Tensor:
        """Collective: (loss sum, samples) of the interval so far over all
        ranks, the part before this start included, float64 (2,) on the CPU.
        Raises ConfigError when the loss is not finite (nothing saved yet)."""
        return self._with_carried(self._reduced())

    def summary(self) -> dict:
        """Collective, before the evaluation runs: the interval's training
        figures (``record`` completes them). "train_loss" (the mean over every
        sample trained in the interval; None for none), "samples" (how many,
        all ranks: full batches only), "samples_per_s" (those of this start
        over the interval's training seconds; by steps left out when this
        start trained none of them: an evaluation redone at a resume), the seconds under
        "epoch_seconds" (by epochs) or "interval_seconds" (by steps), and
        "peak_gpu_memory_mib" on CUDA. Raises ConfigError when the training
        loss is not finite."""
        reduced = self._reduced()  # waits for the device, so the time is honest
        seconds = time.perf_counter() - self.started
        loss_sum, samples = self._with_carried(reduced).tolist()
        figures = {"train_loss": loss_sum / samples if samples else None, "samples": round(samples),
                   ("interval_seconds" if self.by_steps else "epoch_seconds"): seconds,
                   **peak_memory_mib(self.device)}
        if reduced[1].item() or not self.by_steps:  # an epoch's line always has its speed
            figures["samples_per_s"] = reduced[1].item() / seconds
        return figures

    def record(self, step: int, summary: dict, scores: tuple) -> dict:
        """The record of the evaluation after optimizer step ``step`` (by
        steps) or of epoch ``self.epoch`` (by epochs), from the interval's
        ``summary`` and the validation ``scores`` (loss, accuracy or None); the
        next interval starts. By epochs: {"epoch" (1-based), "total_epochs",
        the summary's figures, "samples_run" (``samples_run`` with the
        interval's), "val_loss", "val_accuracy"}; by steps the same
        and first "step", "total_steps", then "best_val_loss" and
        "best_step" (this evaluation's when it is the lowest so far). The kit
        adds the recipe's and the speed figures."""
        val_loss, val_accuracy = scores
        self.samples_run += summary["samples"]
        record = {"epoch": self.epoch + 1, "total_epochs": self.total_epochs, **summary,
                  "samples_run": self.samples_run, "val_loss": val_loss, "val_accuracy": val_accuracy}
        if self.by_steps:
            if self.best_loss is None or val_loss < self.best_loss:
                self.best_loss, self.best_step = val_loss, step
            record = {"step": step, "total_steps": self.last_step, **record, "best_val_loss": self.best_loss,
                      "best_step": self.best_step}
            self.evaluated = step
        self._carried = torch.zeros(2, dtype=torch.float64)
        self._restart()
        return record

    def state_dict(self) -> dict:
        """Collective: {"samples_run"} and by epochs {"epoch_totals":
        ``global_totals``, or None when the interval holds nothing (an
        epoch's end)}; by steps {"eval_step": the last evaluation's step,
        "best_val_loss", "best_step", "interval_totals": ``global_totals``}."""
        totals = self.global_totals()
        if not self.by_steps:
            return {"epoch_totals": totals if totals[1] else None, "samples_run": self.samples_run}
        return {"eval_step": self.evaluated, "best_val_loss": self.best_loss, "best_step": self.best_step,
                "interval_totals": totals, "samples_run": self.samples_run}

    def load_state_dict(self, snapshot: Mapping) -> None:
        """Go on from a snapshot's ``state_dict``: the interval's totals before
        this start and, by steps, the last evaluation and the best so far. A
        snapshot of a run that evaluated by epochs holds no evaluation by
        steps: by steps the interval then starts at the resumed step; one
        that evaluated by steps holds no epoch's totals: by epochs the
        resumed epoch's figures count the steps after the resume. A snapshot
        without "samples_run" (an older kit's) counts from this start."""
        self.samples_run = snapshot.get("samples_run", 0)
        totals = snapshot.get("interval_totals" if self.by_steps else "epoch_totals")
        self._carried = torch.zeros(2, dtype=torch.float64) if totals is None else totals.to(torch.float64).cpu()
        if self.by_steps:
            self.evaluated = snapshot.get("eval_step", 0)
            self.best_loss, self.best_step = snapshot.get("best_val_loss"), snapshot.get("best_step")
