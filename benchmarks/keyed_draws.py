"""Section 2b, keyed_draws: what keying the data's random draws by (seed,
epoch, sample) costs a fetch.

train.py seeds torch's default generator around each fetch of a task that
draws from it while loading (``train_utils.SeededFetches``: a fork of the
generator's state, ``torch.manual_seed`` of ``common.draw_key``), and the
language-model windows key their own offsets (``text_tasks.TokenWindows``
after ``set_epoch``). Timed in this process, one thread, the median of 5
rounds, each case against the same fetch without the keys:

- a CIFAR-10-shaped item (uint8 3x32x32) through torchvision's RandomCrop(32,
  padding=4) and RandomHorizontalFlip in ``__getitem__``, as a task of the
  user's augments: microseconds per item;
- a batch of 64 GPT windows of 1,024 tokens (``__getitems__``), offsets
  drawn from torch's generator or keyed: microseconds per batch;
- a whole batch cut at once by a task without draws (the MNIST and CIFAR-10
  fast paths' ``__getitems__``): the seeding's microseconds per batch.

Reading the table: "plain" is the fetch as the rungs make it, "keyed" as
train.py makes it; the last column is the difference.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.harness import table
from text_tasks import TokenWindows
from train_utils import SeededFetches


class _AugmentedImages(torch.utils.data.Dataset):
    """CIFAR-10-shaped uint8 images, cropped and flipped in ``__getitem__``."""

    def __init__(self, n: int = 4096) -> None:
        from torchvision import transforms

        self.images = torch.randint(256, (n, 3, 32, 32), dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(0))
        self.augment = transforms.Compose([transforms.RandomCrop(32, padding=4),
                                           transforms.RandomHorizontalFlip()])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        return self.augment(self.images[index]), index


class _WholeBatches(torch.utils.data.Dataset):
    """A task that cuts whole batches without drawing (as the image fast paths do)."""

    def __init__(self, n: int = 4096) -> None:
        self.images = torch.zeros(n, 3, 32, 32, dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self.images)

    def __getitems__(self, indices: list):
        return self.images[indices], torch.tensor(indices)


def _per_call_us(fetch, calls: list, rounds: int = 5) -> float:
    """Median over ``rounds`` of the microseconds per call of ``fetch(c)`` over ``calls``."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for call in calls:
            fetch(call)
        times.append((time.perf_counter() - start) / len(calls) * 1e6)
    return statistics.median(times)


def section_keyed_draws() -> dict:
    """Microseconds per fetch, plain and keyed, for the three cases above."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        order = torch.randperm(4096, generator=torch.Generator().manual_seed(1)).tolist()
        images = _AugmentedImages()
        keyed_images = SeededFetches(images, seed=1337)
        keyed_images.set_epoch(3)
        crop = (_per_call_us(images.__getitem__, order), _per_call_us(keyed_images.__getitem__, order))

        tokens = torch.randint(50257, (2_000_000,), generator=torch.Generator().manual_seed(2))
        plain, keyed = (TokenWindows(tokens, 1024, shift=True, seed=1337) for _ in range(2))
        keyed.set_epoch(3)
        window_order = torch.randperm(len(plain), generator=torch.Generator().manual_seed(1)).tolist()
        batches = [window_order[i:i + 64] for i in range(0, len(plain) - 63, 64)]
        windows = (_per_call_us(plain.__getitems__, batches), _per_call_us(keyed.__getitems__, batches))

        whole = _WholeBatches()
        seeded = SeededFetches(whole, seed=1337)
        batches = [order[i:i + 256] for i in range(0, 4096, 256)]
        cut = (_per_call_us(whole.__getitems__, batches), _per_call_us(seeded.__getitems__, batches))
    finally:
        torch.set_num_threads(threads)
    rows = [[name, f"{a:.1f}", f"{b:.1f}", f"{b - a:+.1f}"]
            for name, (a, b) in (("RandomCrop + flip in __getitem__ (per item)", crop),
                                 ("64 GPT windows of 1,024 tokens (per batch)", windows),
                                 ("a batch of 256 cut whole, no draws (per batch)", cut))]
    return {"us": {"crop_item": crop, "gpt_windows_batch": windows, "whole_batch": cut},
            "table": table("2b. keyed draws: microseconds per fetch, 1 thread (plain: as the rungs fetch; "
                           "keyed: as train.py fetches)", ["fetch", "plain us", "keyed us", "keyed - plain"],
                           rows)}
