"""One training epoch's batches: how many this start trains, the progress bar,
and the finite-loss check.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Callable, Iterable, Iterator, Optional

import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm import tqdm

from common import ConfigError


class EpochBatches:
    """The batches epoch ``epoch`` (0-based, of ``total_epochs``) trains in
    this start: whole optimizer steps of ``grad_accum_steps`` micro-batches
    of ``loader`` (a last group of fewer is dropped, as ``drop_last`` drops
    a short batch), at most ``limit`` of them (--max_steps' last epoch),
    with a progress bar on rank 0 when stderr is a terminal (not in logs)
    that shows rank 0's running loss (``running_loss``: () -> float, read
    from the device at most every ``BAR_LOSS_EVERY_S`` seconds). ``total``:
    the batches this start trains, known at once; ``left``: those still to
    come; ``done``: those given so far. No collective runs in here: the
    training loop makes those."""

    def __init__(self, loader: DataLoader, epoch: int, total_epochs: int, grad_accum_steps: int,
                 limit: Optional[int] = None, running_loss: Optional[Callable[[], float]] = None) -> None:
        total = len(loader) - len(loader) % grad_accum_steps
        self.total = total if limit is None else max(0, min(total, limit))
        self.left = self.total
        self.loader, self.epoch, self.total_epochs, self.running_loss = loader, epoch, total_epochs, running_loss

    @property
    def done(self) -> int:
        """The batches given so far (1 while the first is trained)."""
        return self.total - self.left

    def __iter__(self) -> Iterator:
        bar = progress_bar(itertools.islice(self.loader, self.total), f"epoch {self.epoch + 1}/{self.total_epochs}",
                           total=self.total)
        shown_at = 0.0
        for batch in bar:
            self.left -= 1
            if self.running_loss and not bar.disable and time.perf_counter() - shown_at > BAR_LOSS_EVERY_S:
                shown_at = time.perf_counter()
                bar.set_postfix_str(f"rank 0 loss {self.running_loss():.4f}")
            yield batch


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
