"""One training epoch's bookkeeping: loss sum and samples on the device, time,
peak memory, the progress bar, and the finite-loss check.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm import tqdm

from common import ConfigError
from .speed import peak_memory_mib


class EpochMeter:
    """The running loss sum and sample count of one training epoch, its time
    and its peak GPU memory.

    ``totals`` is a float64 (2,) tensor on the device, (loss sum, samples) of
    this rank: the loss sum stays there, since a ``.item()`` per step would
    make the CPU wait for the GPU at every step, and the samples, which the
    host knows, are counted on the host (a step adds two small kernels to
    the GPU's queue, not five). The kit passes ``summary`` its sum over
    the ranks (a copy, all-reduced), so that the meter keeps this rank's own. ``carried`` is the global totals of
    the steps trained before a mid-epoch resume (None: none), so a resumed
    epoch's summary still covers the whole epoch. Making one starts the
    epoch's measurements: its clock, and on CUDA its peak memory.
    """

    def __init__(self, epoch: int, max_epochs: int, device: torch.device,
                 carried: Optional[torch.Tensor] = None) -> None:
        self.epoch, self.max_epochs, self.device = epoch, max_epochs, device
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._samples = 0
        self.carried = carried
        self.steps = self.steps_left = 0  # this start's training steps in the epoch; those still to come
        self._bar, self._bar_loss_at = None, 0.0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.start = time.perf_counter()

    def batches(self, loader: DataLoader, grad_accum_steps: int, limit: Optional[int] = None) -> Iterator:
        """The epoch's batches: whole optimizer steps of ``grad_accum_steps``
        micro-batches only (a last group of fewer is dropped, as ``drop_last``
        drops a short batch), at most ``limit`` of them (--max_steps' last
        epoch), with a progress bar on rank 0 when stderr is a terminal (not
        in logs). ``steps_left`` counts the batches still to come. No
        collective runs in here: the training loop makes those."""
        steps = len(loader) - len(loader) % grad_accum_steps
        steps = steps if limit is None else max(0, min(steps, limit))
        self.steps, self.steps_left = steps, steps  # known at once, before the first batch
        return self._counted(loader)

    def _counted(self, loader: DataLoader) -> Iterator:
        """``batches``' generator: ``self.steps`` batches of ``loader``, counted down in ``steps_left``."""
        self.start = time.perf_counter()
        self._bar = progress_bar(itertools.islice(loader, self.steps), f"epoch {self.epoch + 1}/{self.max_epochs}",
                                 total=self.steps)
        for batch in self._bar:
            self.steps_left -= 1
            yield batch

    @property
    def steps_done(self) -> int:
        """The batches ``batches`` has given so far (1 while the first is trained)."""
        return self.steps - self.steps_left

    @property
    def totals(self) -> torch.Tensor:
        """(loss sum, samples) of this rank so far: a new float64 (2,) tensor
        on the device, made there without waiting for it."""
        samples = torch.full((), self._samples, dtype=torch.float64, device=self.device)
        return torch.stack((self._loss_sum, samples))

    def add(self, loss: torch.Tensor, samples: int) -> None:
        """Count one batch: its mean ``loss`` (0-dim tensor) over ``samples``
        (the product in the loss's dtype, summed in float64). Where the
        progress bar shows, it also shows this rank's running mean loss, read
        from the device at most every ``BAR_LOSS_EVERY_S`` seconds."""
        self._loss_sum.add_(loss * samples)
        self._samples += samples
        bar = self._bar
        if bar is not None and not bar.disable and time.perf_counter() - self._bar_loss_at > BAR_LOSS_EVERY_S:
            self._bar_loss_at = time.perf_counter()
            bar.set_postfix_str(f"rank 0 loss {(self._loss_sum / self._samples).item():.4f}")

    def global_totals(self) -> torch.Tensor:
        """Collective: (loss sum, samples) over all ranks so far, carried part
        included, float64 (2,) on the CPU (what a mid-epoch snapshot holds).
        Raises ConfigError when the loss is not finite."""
        totals = self.totals.clone()
        dist.all_reduce(totals)
        totals = totals.cpu() + (self.carried.cpu() if self.carried is not None else 0)
        check_finite(totals[0].item() / totals[1].item(), self.epoch)
        return totals

    def summary(self, totals: torch.Tensor) -> dict:
        """The epoch's record: epoch, total_epochs, train_loss (mean over every
        sample trained in the epoch), samples (how many: full batches only, so
        a last partial batch of each rank's shard is not among them),
        samples_per_s (samples trained since the epoch
        (re)started / seconds), epoch_seconds, and peak_gpu_memory_mib on
        CUDA (the kit adds the recipe's figures: ``Recipe.epoch_figures``).
        ``totals``: ``self.totals`` summed over every rank (float64 (2,), on
        the device). Raises ConfigError when the loss is not finite, before
        anything is saved."""
        new_samples = totals[1].item()  # waits for the device, so the time is honest
        seconds = time.perf_counter() - self.start
        loss_sum, samples = (totals.cpu() + (self.carried.cpu() if self.carried is not None else 0)).tolist()
        check_finite(loss_sum / samples, self.epoch)
        return {"epoch": self.epoch + 1, "total_epochs": self.max_epochs,
                "train_loss": loss_sum / samples, "samples": round(samples),
                "samples_per_s": new_samples / seconds,
                "epoch_seconds": seconds, **peak_memory_mib(self.device)}


# The bar's running loss costs a device-to-host copy (a wait for the GPU): rarely.
BAR_LOSS_EVERY_S = 1.0


def progress_bar(iterable: Iterable, desc: str, total: Optional[int] = None) -> tqdm:
    """``iterable`` wrapped in a tqdm bar labelled ``desc``, shown on global
    rank 0 only and only when stderr is a terminal (a log file gets none);
    the bar is removed when the loop ends (the epoch line says the rest)."""
    rank0 = dist.get_rank() == 0
    return tqdm(iterable, total=total, desc=desc, leave=False, disable=None if rank0 else True)


def evaluating(batches: Iterable) -> Iterable:
    """An evaluation loop's ``batches``, with a progress bar labelled
    "evaluating" (``progress_bar``: rank 0, terminals only)."""
    return progress_bar(batches, "evaluating", total=len(batches) if hasattr(batches, "__len__") else None)


def check_finite(loss: float, epoch: int) -> None:
    """Raise ConfigError when the training loss is NaN or infinite.

    Called before anything is saved, so a diverged run never overwrites its
    last good snapshot, from which it resumes with a lower --lr.
    """
    if not math.isfinite(loss):
        raise ConfigError(f"training loss became {loss} in epoch {epoch + 1}; stopping without "
                          f"saving (the last saved state is kept). Lower --lr and resume")
