"""Evaluation across ranks: as many forwards on every rank where the forward
is a collective (FSDP); which held-out samples are scored (--eval_windows).
(Rank 0's BatchNorm statistics everywhere: ``distributed.broadcast_buffers``.)
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Subset

from common import ConfigError


def most_batches(loader: DataLoader, device: torch.device) -> int:
    """Collective: the most batches any rank's ``loader`` gives (evaluation
    shards differ by up to one sample, so by up to one batch).

    Raises ConfigError on every rank when some rank has no batch at all while
    another has (fewer samples than processes): FSDP's evaluation forward is
    a collective, and such a rank would have no input to run it with.
    """
    counts = torch.tensor([len(loader), -len(loader)], device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # (most, -fewest) over ranks
    most, fewest = counts[0].item(), -counts[1].item()
    if fewest == 0 < most:
        raise ConfigError(f"an evaluation split has fewer samples than the {dist.get_world_size()} "
                          f"processes; start fewer processes")
    return most


def fewest_batches(loader: DataLoader, device: torch.device) -> int:
    """Collective: the fewest batches any rank's ``loader`` gives (evaluation
    shards differ by up to one sample, so by up to one batch)."""
    count = torch.tensor(len(loader), device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count.item())


def batches_for_every_rank(loader: DataLoader, device: torch.device) -> Iterator[tuple]:
    """Collective: ``loader``'s (source, targets, counted) batches, as many on
    every rank as the longest shard has (``most_batches``).

    Where a model's forward is itself a collective (FSDP all-gathers each
    block's parameters), every rank must run as many forwards; evaluation
    shards differ by one sample at most, so by one batch. A rank past its
    last batch gets that batch again with ``counted`` False: run the forward,
    count nothing. ``counted`` is True for every real batch.
    """
    batches, last = iter(loader), None
    for _ in range(most_batches(loader, device)):
        batch = next(batches, None)
        if batch is None:  # this shard is done (most_batches refuses an empty one)
            yield (*last, False)
        else:
            last = batch
            yield (*batch, True)


def eval_subset(dataset: Dataset, count: int, seed: int) -> Dataset:
    """--eval_windows: ``count`` samples of the held-out ``dataset``, drawn
    from ``seed`` (a private generator) without replacement and kept in the
    dataset's order, as a Subset: the same samples in every evaluation, on
    every rank, in every run of the same --seed, so one evaluation's loss
    compares with the next (nanoGPT's estimate_loss draws new random batches,
    eval_iters of them, each time). ``dataset`` itself when ``count`` is 0
    or not below its size."""
    if not count or count >= len(dataset):
        return dataset
    chosen = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:count]
    return Subset(dataset, chosen.sort().values.tolist())
