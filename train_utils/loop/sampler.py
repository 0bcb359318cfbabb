"""The training sampler: each rank's share of an epoch's permutation, which
can start part-way, at the world size that stopped or another.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way, at any world size.

    An epoch's permutation of the whole dataset (seed + epoch) does not depend
    on the world size; rank r takes positions r, r + W, r + 2W, ... of it
    (padded to a multiple of W with its first samples; cut to one with
    ``drop_last``), so after k batches of B on every rank the first k x B x W
    positions are trained. ``set_epoch(epoch, start=k x B x W)`` makes this
    sampler split the rest of the permutation, positions ``start`` to its
    end, over this sampler's world size the same way (padded, or cut, as
    above): no sample repeated, none skipped, at the same world size or
    another. At the same world size it is exactly the rest of each rank's
    share (``DistributedSampler``'s indices past the first k x B).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.offset = 0  # positions of this epoch's permutation trained before (by any world size)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Epoch ``epoch``'s permutation (seed + epoch: a new shuffle each
        epoch), from its position ``start`` on (0: the whole epoch; after a
        mid-epoch resume, the positions trained before this start)."""
        super().set_epoch(epoch)
        self.offset = start

    def _rest_size(self) -> int:
        """Positions this epoch still splits over the ranks (a multiple of the world size)."""
        left = max(0, len(self.dataset) - self.offset)
        if self.drop_last:
            return left // self.num_replicas * self.num_replicas
        return math.ceil(left / self.num_replicas) * self.num_replicas

    def __iter__(self):
        # A tensor, not DistributedSampler's list: 8 bytes a sample, where a list of
        # Python ints takes 36 and its slices and padding copy it (a corpus of billions
        # of tokens is millions of windows); the same order, its ints made as taken.
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=g)
        else:
            order = torch.arange(len(self.dataset))
        rest, size, ranks = order[self.offset:], self._rest_size(), self.num_replicas
        if size <= len(rest):
            return _ints(rest[:size][self.rank::ranks])
        # Padded with the epoch's first samples, as DistributedSampler pads, without a
        # copy of the order: this rank's positions of rest, then of the padding after it.
        padding = order[torch.arange(size - len(rest)) % len(order)]
        return itertools.chain(_ints(rest[self.rank::ranks]), _ints(padding[(self.rank - len(rest)) % ranks::ranks]))

    def __len__(self) -> int:
        return self._rest_size() // self.num_replicas


def _ints(indices: torch.Tensor, chunk: int = 1 << 16):
    """The values of the 1-D integer tensor ``indices`` as Python ints, in
    order, made ``chunk`` at a time."""
    for first in range(0, len(indices), chunk):
        yield from indices[first:first + chunk].tolist()


def batches_per_epoch(loader: DataLoader, world_size: int) -> int:
    """The batches (micro-batches) each rank takes in one epoch from ``loader``,
    a training DataLoader over a ``DistributedSampler``, were the world size
    ``world_size``: the sampler's share per rank (``ceil(N / world_size)``,
    padded; ``N // world_size`` with its ``drop_last``), in batches of
    ``loader.batch_size`` (a partial last one dropped with the loader's
    ``drop_last``). At this run's world size, ``len(loader)`` at an epoch's start."""
    samples = len(loader.sampler.dataset)
    share = samples // world_size if loader.sampler.drop_last else math.ceil(samples / world_size)
    return share // loader.batch_size if loader.drop_last else math.ceil(share / loader.batch_size)
