"""The fast image input path: decoded uint8 images in memory, batches augmented on the device.

Used by the built-in image tasks (vision_tasks.py) with ``--input_path fast``;
any task whose images fit in memory can use it the same way:

- ``InMemoryImages`` holds a whole dataset as one uint8 (N, C, H, W) tensor
  and hands the DataLoader a whole batch per indexing operation (a
  ``common.Batch``, which ``common.collate`` passes through);
- ``decode`` makes one from a torchvision MNIST/CIFAR10 object;
- ``DeviceTransform`` is a ``Task.train_transform``/``eval_transform``: on
  the device, it crops and flips the batch (``random_crop_flip``) and
  normalizes it to the floats ToTensor + Normalize would give.

See docs/performance.md for what it saves.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from common import Batch


class InMemoryImages(Dataset):
    """A whole image dataset decoded once: uint8 (N, C, H, W) images, int64 (N,) labels.

    ``dataset[i]`` is one (uint8 (C, H, W), int64 ()) pair. The DataLoader
    calls ``__getitems__`` with a batch's indices (``Subset`` forwards it), so
    a batch is one indexing operation, not ``batch_size`` Python calls and a
    stack; normalization and augmentation happen later, batched on the device
    (``DeviceTransform``). Any sampler, DistributedSampler included, still
    decides which indices each rank gets.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4 or len(labels) != len(images):
            raise ValueError(f"expected uint8 (N, C, H, W) images and N labels, got "
                             f"{images.dtype} {tuple(images.shape)} and {len(labels)} labels")
        self.images, self.labels = images, labels.to(torch.int64)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]) -> Batch:
        index = torch.as_tensor(indices, dtype=torch.int64)
        return Batch((self.images[index], self.labels[index]))


def decode(view) -> InMemoryImages:
    """The images and labels a torchvision MNIST/CIFAR10 object read from disk, as tensors.

    Both classes decode their files when built (MNIST: uint8 (N, 28, 28)
    tensor; CIFAR10: uint8 (N, 32, 32, 3) numpy array, channels last); this
    only reshapes them to (N, C, H, W), without going through PIL per image.
    """
    images = view.data if isinstance(view.data, torch.Tensor) else torch.from_numpy(view.data)
    images = images.unsqueeze(1) if images.dim() == 3 else images.permute(0, 3, 1, 2)
    return InMemoryImages(images.contiguous(), torch.as_tensor(view.targets, dtype=torch.int64))


def random_crop_flip(images: torch.Tensor, padding: int) -> torch.Tensor:
    """torchvision's RandomCrop(size, padding) + RandomHorizontalFlip, for a whole batch.

    images: (N, C, H, W), any dtype, on any device. Each image is zero-padded
    by ``padding`` pixels on every side, cut back to H x W at an offset drawn
    uniformly from the (2 * padding + 1)^2 positions, and mirrored left-right
    with probability 1/2, independently per image (the distribution of the
    per-sample transforms). One gather over the flattened padded image does
    crop and flip together (a 4-tensor advanced index was 60x slower on a
    CPU). Random numbers come from the default generator of ``images.device``,
    so a snapshot's saved RNG states replay the same augmentations on resume.
    Returns a new (N, C, H, W) tensor of ``images.dtype``.
    """
    n, c, h, w = images.shape
    device = images.device
    padded = F.pad(images, (padding,) * 4)  # zeros, as RandomCrop's fill=0
    padded_w = w + 2 * padding
    dy = torch.randint(0, 2 * padding + 1, (n,), device=device)
    dx = torch.randint(0, 2 * padding + 1, (n,), device=device)
    flip = torch.rand(n, device=device) < 0.5
    rows = dy[:, None] + torch.arange(h, device=device)  # (N, H)
    cols = torch.arange(w, device=device).expand(n, w)
    cols = dx[:, None] + torch.where(flip[:, None], cols.flip(1), cols)  # (N, W)
    index = (rows[:, :, None] * padded_w + cols[:, None, :]).view(n, 1, h * w).expand(n, c, h * w)
    return padded.view(n, c, -1).gather(2, index).view(n, c, h, w)


class DeviceTransform:
    """What happens to a batch after it reached the device, before the model.

    Called with the batch's inputs (N, ...) on the device. With ``normalize``
    = (mean, std) per channel, the input is uint8 (N, C, H, W) pixels
    (``InMemoryImages``): optionally ``random_crop_flip`` with ``padding``,
    then float32 x / 255, minus mean, over std (the arithmetic of ToTensor +
    Normalize, so the same image gives the same floats). Without it the input
    is already what the model takes and passes unchanged. ``channels_last``
    then reorders (N, C, H, W) floats to channels-last memory (same shape and
    values), which tensor cores prefer (CUDA ResNets).
    """

    def __init__(self, normalize: Optional[tuple[tuple, tuple]] = None, padding: int = 0,
                 channels_last: bool = False) -> None:
        self.normalize, self.padding, self.channels_last = normalize, padding, channels_last
        self._stats: dict = {}  # device -> (mean, std) tensors, made once, not per batch

    def __call__(self, source: torch.Tensor) -> torch.Tensor:
        if self.normalize is not None:
            if self.padding:
                source = random_crop_flip(source, self.padding)
            if source.device not in self._stats:  # a copy to the GPU per batch would wait for it
                self._stats[source.device] = tuple(torch.tensor(v, device=source.device).view(-1, 1, 1)
                                                   for v in self.normalize)
            mean, std = self._stats[source.device]
            source = source.float().div(255).sub_(mean).div_(std)
        if self.channels_last:
            source = source.contiguous(memory_format=torch.channels_last)
        return source
