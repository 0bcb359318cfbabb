"""Evaluation by optimizer steps (--eval_every_steps), for runs whose epoch
is longer than a job: when the next evaluation is due, the training loss of
the steps since the last one, the best validation loss so far, and what a
snapshot keeps of them so that a resumed run goes on with the same figures.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from .epoch import check_finite
from .speed import peak_memory_mib


class StepEvaluations:
    """The evaluations of a run evaluated every ``every`` optimizer steps
    (--eval_every_steps N > 0; 0: ``on`` is False and the kit evaluates
    after each epoch instead, nothing here is used) and after its last step,
    ``last_step`` (--max_steps, or --total_epochs x steps per epoch).

    Steps are the run's optimizer steps (the lr schedule's count, the
    ``step`` of the --log_every_steps line), so evaluation k falls after step
    k x N however the steps fall into epochs, and an interval between two
    evaluations may span an epoch's end. Per rank: ``add`` counts each
    training micro-batch of the interval (its loss sum stays on the device,
    one in-place add a micro-batch; its sample count on the host).
    ``epoch``: the 0-based epoch being trained (the kit sets it as each
    starts); ``evaluated``: the step of the last evaluation done (0: none);
    ``best_loss``/``best_step``: the lowest validation loss so far and the
    step it was measured at (None before the first). ``state_dict`` /
    ``load_state_dict`` carry these and the interval's global totals through
    a snapshot: an evaluation that a stop cut short (or never started) is
    done by the resumed run before its first step (``due``, asked then),
    with the same training loss as the uninterrupted run's.
    """

    def __init__(self, every: int, last_step: int, device: torch.device) -> None:
        self.every, self.last_step, self.device = every, last_step, device
        self.epoch = 0
        self.evaluated = 0
        self.best_loss: Optional[float] = None
        self.best_step: Optional[int] = None
        self._carried = torch.zeros(2, dtype=torch.float64)  # global (loss sum, samples) before this start
        self._restart()

    @property
    def on(self) -> bool:
        """Whether the run evaluates by steps (--eval_every_steps > 0)."""
        return bool(self.every)

    def _restart(self) -> None:
        """A new interval (or this start's part of one): its sums, its clock and, on CUDA, its peak memory."""
        self._loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._samples = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._start = time.perf_counter()

    def add(self, loss: torch.Tensor, samples: int) -> None:
        """Count one micro-batch of the interval: its mean ``loss`` (0-dim, on
        the device) over ``samples`` samples. Nothing when not ``on``."""
        if not self.on:
            return
        self._loss.add_(loss, alpha=samples)
        self._samples += samples

    def due(self, step: int) -> bool:
        """Whether an evaluation is due after optimizer step ``step`` (of the run):
        every ``every`` steps and at the last, once each."""
        return self.on and step > self.evaluated and (step % self.every == 0 or step >= self.last_step)

    def _reduced(self) -> torch.Tensor:
        """Collective: this start's (loss sum, samples) of the interval over all
        ranks, float64 (2,) on the CPU."""
        totals = torch.stack([self._loss, torch.tensor(float(self._samples), dtype=torch.float64,
                                                       device=self.device)])
        dist.all_reduce(totals)
        return totals.cpu()

    def _checked(self, totals: torch.Tensor) -> torch.Tensor:
        """``totals`` with the part before this start added; raises ConfigError
        when their loss is not finite."""
        totals = totals + self._carried
        if totals[1]:
            check_finite(totals[0].item() / totals[1].item(), self.epoch)
        return totals

    def global_totals(self) -> torch.Tensor:
        """Collective: (loss sum, samples) of the interval so far over all
        ranks, the part before this start included, float64 (2,) on the CPU.
        Raises ConfigError when the loss is not finite (nothing saved yet)."""
        return self._checked(self._reduced())

    def record(self, step: int, total_epochs: int, scores: tuple) -> dict:
        """Collective: the evaluation after ``step`` is done (``scores``: the
        validation (loss, accuracy or None)); its metrics record, and a new
        interval from here.

        {"step", "total_steps", "epoch" (1-based: the epoch ``step`` fell in),
        "total_epochs", "train_loss" (the mean over every sample trained
        since the last evaluation), "val_loss", "val_accuracy" (a
        classification task; else None), "best_val_loss", "best_step" (this
        evaluation's when it is the lowest so far), "samples" (trained in the
        interval, all ranks), "samples_per_s" (those of this start over the
        interval's training seconds; left out when this start trained none
        of them: an evaluation redone at a resume), "interval_seconds", and
        "peak_gpu_memory_mib" on CUDA}; the kit adds the recipe's and the
        speed figures. Raises ConfigError when the training loss is not
        finite."""
        new = self._reduced()
        seconds = time.perf_counter() - self._start
        loss_sum, samples = self._checked(new).tolist()
        val_loss, val_accuracy = scores
        if self.best_loss is None or val_loss < self.best_loss:
            self.best_loss, self.best_step = val_loss, step
        record = {"step": step, "total_steps": self.last_step, "epoch": self.epoch + 1, "total_epochs": total_epochs,
                  "train_loss": loss_sum / samples if samples else None, "val_loss": val_loss,
                  "val_accuracy": val_accuracy, "best_val_loss": self.best_loss, "best_step": self.best_step,
                  "samples": round(samples), "interval_seconds": seconds, **peak_memory_mib(self.device)}
        if new[1].item():
            record["samples_per_s"] = new[1].item() / seconds
        self.evaluated, self._carried = step, torch.zeros(2, dtype=torch.float64)
        self._restart()
        return record

    def state_dict(self) -> dict:
        """Collective when ``on``: {"eval_step": the last evaluation's step,
        "best_val_loss", "best_step", "interval_totals": ``global_totals``};
        {} when not (the snapshot holds nothing of this)."""
        if not self.on:
            return {}
        return {"eval_step": self.evaluated, "best_val_loss": self.best_loss, "best_step": self.best_step,
                "interval_totals": self.global_totals()}

    def load_state_dict(self, state: dict) -> None:
        """Go on from a snapshot's ``state_dict``: the last evaluation's step,
        the best so far and the interval's totals before this start. A
        snapshot of a run that evaluated by epochs holds none of it: the
        interval then starts at the resumed step."""
        self.evaluated = state.get("eval_step", 0)
        self.best_loss, self.best_step = state.get("best_val_loss"), state.get("best_step")
        totals = state.get("interval_totals")
        self._carried = torch.zeros(2, dtype=torch.float64) if totals is None else totals.to(torch.float64).cpu()
