"""The training sampler: each rank's share of an epoch's order of the
samples, which can start part-way, at the world size that stopped or another.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

# Datasets of more samples than this are ordered by a keyed bijection of the
# positions (``keyed_order``), computed as the ranks take them: torch.randperm
# (DistributedSampler's order, the rungs') would hold 8 bytes a sample in every
# rank, 128 MiB at this size, 2.5 GiB for a corpus of 10 billion tokens cut into
# windows of 32. Up to it, the epoch's order is DistributedSampler's.
KEYED_ORDER_FROM = 1 << 24
FEISTEL_ROUNDS = 6
_MASK32 = 0xFFFFFFFF


def order_kind(samples: int) -> str:
    """The order an epoch of ``samples`` samples takes: "randperm"
    (``torch.randperm``, DistributedSampler's) up to ``KEYED_ORDER_FROM``
    samples, else "keyed" (``keyed_order``)."""
    return "keyed" if samples > KEYED_ORDER_FROM else "randperm"


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of each value of ``x`` (int64, 0 <= x < 2**32),
    in 0 .. 2**32 - 1: two multiply-xorshift rounds with the constant
    0x45d9f3b (the "hash32" of Thomas Mueller's integer-hash analysis); every
    product stays below 2**59, so no int64 overflows."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def _round_keys(seed: int, epoch: int) -> list[int]:
    """The Feistel rounds' 32-bit keys of (``seed``, ``epoch``): SHA-256 of
    both, the same on every machine and torch."""
    digest = hashlib.sha256(f"keyed_order:{seed}:{epoch}".encode()).digest()
    return [int.from_bytes(digest[4 * i:4 * i + 4], "little") for i in range(FEISTEL_ROUNDS)]


def keyed_order(positions: torch.Tensor, samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The samples at ``positions`` (int64, each in 0 .. ``samples`` - 1) of
    epoch ``epoch``'s order under ``seed``: a bijection of 0 .. samples - 1
    onto itself, computed for the positions asked only (memory and time
    grow with them, not with ``samples``). Returns int64, ``positions``'
    shape.

    A balanced Feistel network of ``FEISTEL_ROUNDS`` rounds over the
    smallest domain of 4**h values holding ``samples`` (a permutation of the
    domain whatever the round function: Luby and Rackoff 1988), round
    function ``_mix32`` keyed by ``_round_keys``; a value that lands outside
    0 .. samples - 1 is mapped again until it lands inside ("cycle walking",
    Black and Rogaway 2002), which keeps it a bijection of the samples; the
    domain is under 4 x ``samples``, so few values walk more than once. The
    order of the keyed shuffles Grain and tf.data use in constant memory."""
    half = max(1, (max(1, samples - 1).bit_length() + 1) // 2)  # bits of each half
    mask = (1 << half) - 1
    keys = _round_keys(seed, epoch)

    def permute(x: torch.Tensor) -> torch.Tensor:
        left, right = x >> half, x & mask
        for key in keys:
            left, right = right, left ^ (_mix32(right ^ key) & mask)
        return (left << half) | right

    out = permute(positions.to(torch.int64))
    outside = out >= samples
    while bool(outside.any()):
        out[outside] = permute(out[outside])
        outside = out >= samples
    return out


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way, at any world size.

    An epoch's order of the whole dataset (seed + epoch) does not depend on
    the world size; rank r takes positions r, r + W, r + 2W, ... of it
    (padded to a multiple of W with its first samples; cut to one with
    ``drop_last``), so after k batches of B on every rank the first k x B x W
    positions are trained. ``set_epoch(epoch, start=k x B x W)`` makes this
    sampler split the rest of the order, positions ``start`` to its end, over
    this sampler's world size the same way (padded, or cut, as above): no
    sample repeated, none skipped, at the same world size or another. At the
    same world size it is exactly the rest of each rank's share
    (``DistributedSampler``'s indices past the first k x B).

    The order (``order``, per epoch): DistributedSampler's own,
    ``torch.randperm`` seeded with seed + epoch, for a dataset of up to
    ``KEYED_ORDER_FROM`` samples; for a larger one ``keyed_order``, computed
    a chunk at a time as the loader takes the indices, so that memory and
    start-up do not grow with the dataset.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.offset = 0  # positions of this epoch's order trained before (by any world size)
        self.order = order_kind(len(self.dataset))  # this epoch's: "randperm" or "keyed"

    def set_epoch(self, epoch: int, start: int = 0, order: Optional[str] = None) -> None:
        """Epoch ``epoch``'s order (seed + epoch: a new shuffle each epoch),
        from its position ``start`` on (0: the whole epoch; after a mid-epoch
        resume, the positions trained before this start). ``order``:
        "randperm" or "keyed", that of the snapshot whose epoch this start
        goes on with (``Progress.start_order``); None: the dataset's own
        (``order_kind``). Raises ValueError for another name."""
        if order not in (None, "randperm", "keyed"):
            raise ValueError(f"order must be 'randperm' or 'keyed', not {order!r}")
        super().set_epoch(epoch)
        self.offset = start
        self.order = order or order_kind(len(self.dataset))

    def _rest_size(self) -> int:
        """Positions this epoch still splits over the ranks (a multiple of the world size)."""
        left = max(0, len(self.dataset) - self.offset)
        if self.drop_last:
            return left // self.num_replicas * self.num_replicas
        return math.ceil(left / self.num_replicas) * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        samples = len(self.dataset)
        if not self.shuffle:
            samples_at = None  # the positions are the samples
        elif self.order == "randperm":
            # A tensor, not DistributedSampler's list: 8 bytes a sample, where a list of
            # Python ints takes 36 and its slices and padding copy it; the same order.
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            permutation = torch.randperm(samples, generator=g)
            samples_at = permutation.__getitem__
        else:
            def samples_at(positions: torch.Tensor) -> torch.Tensor:
                return keyed_order(positions, samples, self.seed, self.epoch)
        return _shares(self.offset, self._rest_size(), self.rank, self.num_replicas, samples, samples_at)

    def __len__(self) -> int:
        return self._rest_size() // self.num_replicas


def _shares(offset: int, size: int, rank: int, ranks: int, samples: int, samples_at,
            chunk: int = 1 << 16) -> Iterator[int]:
    """Rank ``rank``'s samples of positions ``offset`` .. ``offset + size`` - 1
    of the order (every ``ranks``-th, from ``offset + rank``), as Python ints
    made ``chunk`` at a time. A position past the last sample stands for the
    order's first positions again (DistributedSampler's padding: position
    ``samples + j`` is position ``j mod samples``). ``samples_at``: a
    position tensor (int64) to its samples; None: the positions are the
    samples (no shuffle)."""
    for first in range(offset + rank, offset + size, chunk * ranks):
        positions = torch.arange(first, min(first + chunk * ranks, offset + size), ranks)
        past = positions >= samples
        if bool(past.any()):
            positions[past] = (positions[past] - samples) % samples
        yield from (positions if samples_at is None else samples_at(positions)).tolist()


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
