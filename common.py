"""What every script of the ladder shares: the command line, the three tasks
(datasets + model + loss), the data download rule, and small I/O helpers.

The distributed training logic itself (process groups, DDP, samplers,
reductions, snapshots) is *not* here: it lives in each script, so that
`diff singlegpu.py multigpu_spawn.py` shows it.

Tasks (``--dataset``):
  synthetic  seeded regression, 20 features -> 1 target, MLP or linear model,
             MSE loss. No download; the default everywhere.
  mnist      torchvision MNIST, the 2-conv/2-fc CNN with dropout, cross-entropy.
  cifar10    torchvision CIFAR10 with crop+flip augmentation, torchvision
             resnet18 (default) or resnet50, cross-entropy.

Speed (``--input_path``, ``--amp``, ``--compile``, ``--grad_accum_steps``):
the fast input path (images decoded once into uint8 tensors, whole batches
moved to the device, augmentation batched there), the autocast and compile
choices, and peak GPU memory. How a step uses them is in each script.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import glob
import json
import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
# Imported before any process group exists, on purpose: torch.distributed.nn
# binds group.WORLD into its functions' default arguments at import time, and
# DDP imports it lazily. Imported after init_process_group, it would keep the
# process group alive past destroy_process_group, its gloo threads still
# running at interpreter exit, where the process then sometimes aborts
# ("terminate called without an active exception") after a successful run.
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, default_collate

# Model choices per dataset; the first one is the default.
MODELS = {
    "synthetic": ("mlp", "linear"),
    "mnist": ("cnn",),
    "cifar10": ("resnet18", "resnet50"),
}

INPUT_PATHS = ("fast", "torchvision")

SYNTHETIC_FEATURES = 20
SYNTHETIC_TRAIN_SAMPLES = 2048
SYNTHETIC_TEST_SAMPLES = 512
SYNTHETIC_NOISE_STD = 0.1

# Per-channel mean/std of the training images, the values the torchvision
# references use (MNIST: pytorch/examples mnist/main.py; CIFAR-10: the
# widely used kuangliu/pytorch-cifar numbers, as in the seed tutorials).
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)


class ConfigError(Exception):
    """A mistake in the user's input or environment (bad flag, missing data,
    incompatible snapshot). The scripts print it as one line and exit non-zero,
    without a traceback."""


def exit_on_config_error(fn: Callable) -> Callable:
    """Decorator for a script's ``main``: a ConfigError becomes one line on
    stderr (``error: ...``) and exit status 2, without a traceback.

    Under a process group only rank 0 prints, since such errors are raised on
    every rank alike (see ``prepare_data``); the other ranks exit quietly.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as exc:
            if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
                say(f"error: {exc}", sys.stderr)
            sys.exit(2)

    return wrapper


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------

def positive(kind: type) -> Callable[[str], object]:
    """argparse type: a ``kind`` (int or float) > 0, else a one-line usage error."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}")
        if not value > 0:  # also rejects NaN
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0, else a one-line usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser(description: Optional[str]) -> argparse.ArgumentParser:
    """The flags every script shares, in the same order everywhere.

    Each script adds its own (``--checkpoint_path``, ``--world_size``,
    ``--snapshot_path``) after these. Invalid values (zero or negative epochs,
    batch size, lr, save interval; unknown dataset) are refused by argparse with
    one line on stderr and exit status 2.
    """
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--total_epochs", type=positive(int), default=10,
                        help="epochs to train (default: 10)")
    parser.add_argument("--save_every", type=positive(int), default=5,
                        help="save every N epochs; the last epoch is always saved (default: 5)")
    parser.add_argument("--batch_size", type=positive(int), default=32,
                        help="samples per step *per process*; the global batch size is "
                             "batch_size x grad_accum_steps x world_size (default: 32)")
    parser.add_argument("--lr", type=positive(float), default=0.05,
                        help="SGD learning rate, momentum 0.9 (default: 0.05)")
    parser.add_argument("--dataset", choices=tuple(MODELS), default="synthetic",
                        help="task to train (default: synthetic, needs no download)")
    parser.add_argument("--model", default=None,
                        help="model for the dataset: synthetic {mlp,linear}, mnist {cnn}, "
                             "cifar10 {resnet18,resnet50} (default: the first)")
    parser.add_argument("--data_dir", default=os.environ.get("DATA_DIR", "data"),
                        help="dataset root, as torchvision expects it "
                             "(default: $DATA_DIR or ./data)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed for data split, model init, shuffling (default: 0)")
    parser.add_argument("--num_workers", type=non_negative_int, default=0,
                        help="DataLoader worker processes per training process (default: 0)")
    parser.add_argument("--metrics_path", default=None,
                        help="also write each epoch's summary as one JSON object per line here")
    parser.add_argument("--input_path", choices=INPUT_PATHS, default="fast",
                        help="mnist/cifar10 input: 'fast' holds the decoded images in memory "
                             "as uint8, moves whole batches to the device and augments them "
                             "there; 'torchvision' is the per-sample Dataset + transforms "
                             "path, for comparison (default: fast; synthetic ignores it)")
    parser.add_argument("--amp", action="store_true",
                        help="bf16 autocast for the training forward pass (CUDA; on a CPU only "
                             "where it was measured to help, see the README)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the training model (saved weights stay loadable "
                             "without it)")
    parser.add_argument("--grad_accum_steps", type=positive(int), default=1,
                        help="micro-batches of --batch_size per optimizer step; the global "
                             "batch size is batch_size x grad_accum_steps x world_size (default: 1)")
    return parser


def resolve_model(dataset: str, model: Optional[str]) -> str:
    """Return the model name for ``dataset``: ``model`` or the dataset's default.

    Raises ConfigError when the model does not exist for that dataset.
    """
    choices = MODELS[dataset]
    if model is None:
        return choices[0]
    if model not in choices:
        raise ConfigError(f"--model {model} is not available for --dataset {dataset}; "
                          f"choose one of {', '.join(choices)}")
    return model


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------

class MnistCNN(nn.Module):
    """The 2-conv/2-fc CNN with dropout of pytorch/examples mnist/main.py.

    Input: float32 (N, 1, 28, 28) normalized images. Output: float32 (N, 10)
    logits (not log-probabilities: pair it with ``F.cross_entropy``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)


def build_model(dataset: str, model: str) -> nn.Module:
    """A freshly initialized model (from the global torch RNG) for the task.

    synthetic: float32 (N, 20) -> (N, 1). mnist: (N, 1, 28, 28) -> (N, 10)
    logits. cifar10: (N, 3, 32, 32) -> (N, 10) logits.
    """
    if dataset == "synthetic":
        if model == "linear":
            return nn.Linear(SYNTHETIC_FEATURES, 1)
        return nn.Sequential(nn.Linear(SYNTHETIC_FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))
    if dataset == "mnist":
        return MnistCNN()
    import torchvision

    return getattr(torchvision.models, model)(weights=None, num_classes=10)


# --------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------

class SyntheticRegression(Dataset):
    """y = x @ w + b + noise, drawn from a private ``torch.Generator``.

    The global RNG is never touched, so every rank that builds it with the same
    ``seed`` and ``split`` holds identical tensors. Train and test splits share
    w and b (the relation to learn) but have independent x and noise.
    w ~ N(0, 1/20) makes Var(y) about 1, so the MSE of a zero predictor is ~1
    and the best achievable is the noise variance, 0.01.

    Items: (x float32 (20,), y float32 (1,)).
    """

    def __init__(self, seed: int, split: str) -> None:
        relation = torch.Generator().manual_seed(seed)
        w = torch.randn(SYNTHETIC_FEATURES, 1, generator=relation) / SYNTHETIC_FEATURES ** 0.5
        b = torch.randn(1, generator=relation)
        n = SYNTHETIC_TRAIN_SAMPLES if split == "train" else SYNTHETIC_TEST_SAMPLES
        g = torch.Generator().manual_seed(seed + (1 if split == "train" else 2))
        self.x = torch.randn(n, SYNTHETIC_FEATURES, generator=g)
        self.y = self.x @ w + b + SYNTHETIC_NOISE_STD * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


def _torchvision_class(dataset: str):
    from torchvision import datasets

    return {"mnist": datasets.MNIST, "cifar10": datasets.CIFAR10}[dataset]


def expected_files(dataset: str, data_dir: str) -> tuple[str, list[str]]:
    """(folder, file names) that torchvision reads for ``dataset`` under ``data_dir``."""
    cls = _torchvision_class(dataset)
    if dataset == "mnist":
        folder = os.path.join(data_dir, "MNIST", "raw")
        names = [os.path.splitext(name)[0] for name, _md5 in cls.resources]
    else:
        folder = os.path.join(data_dir, cls.base_folder)
        names = [name for name, _md5 in cls.train_list + cls.test_list] + [cls.meta["filename"]]
    return folder, names


def _fetch(dataset: str, data_dir: str, download: bool) -> str:
    """Make sure the files are there; return '' on success, else a one-line error.

    Without ``download`` this only looks for the files (parsing them is
    ``load_task``'s job); with it, torchvision downloads what is missing.
    """
    if dataset == "synthetic":
        return ""
    cls = _torchvision_class(dataset)
    folder, names = expected_files(dataset, data_dir)
    try:
        if download:
            for train in (True, False):
                cls(data_dir, train=train, download=True)
            return ""
        missing = [name for name in names if not os.path.isfile(os.path.join(folder, name))]
        if not missing:
            return ""
        reason = f"missing: {', '.join(missing)}"
    except Exception as exc:  # torchvision raises RuntimeError/URLError/OSError
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = lines[-1] if lines else type(exc).__name__  # torchvision's last line says why
    return (f"{dataset} not found in {os.path.abspath(folder)} (expected "
            f"{', '.join(names)}; {'download failed: ' if download else ''}{reason}). "
            f"Pre-stage it on a machine with network: python -c \"from torchvision import "
            f"datasets; datasets.{cls.__name__}('{data_dir}', download=True)\" and copy "
            f"the folder here, or point --data_dir at an existing copy")


def prepare_data(dataset: str, data_dir: str, download: bool) -> None:
    """Make sure the dataset's files are in ``data_dir``.

    Processes called with ``download=True`` fetch missing files; the others
    only check. When a process group is initialized this is a collective
    (every rank must call it): the all-gather of error messages doubles as the
    barrier at which non-downloading ranks wait for the downloaders, and it
    makes *every* rank raise when any rank failed, instead of leaving the
    others hanging at the next collective.

    Raises ConfigError with a one-line message naming the folder, the files
    expected and how to pre-stage them.
    """
    error = _fetch(dataset, data_dir, download=True) if download else ""
    error = _first_error(error)  # the barrier: non-downloaders wait here
    if not error:  # then the others check what the downloaders left
        error = _first_error("" if download else _fetch(dataset, data_dir, download=False))
    if error:
        raise ConfigError(error)


def _first_error(error: str) -> str:
    """The first non-empty error of any rank ('' if none); collective under a process group."""
    if dist.is_available() and dist.is_initialized():
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), "")
    return error


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded (train, val) split of range(n): the same on every rank.

    Uses a private generator, so the global RNG is untouched.
    """
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = int(n * val_fraction)
    return perm[n_val:], perm[:n_val]


# --------------------------------------------------------------------------
# The fast input path: decoded uint8 images in memory, batches augmented on the device
# --------------------------------------------------------------------------

class Batch(tuple):
    """A batch a dataset assembled itself, (images, labels); ``collate`` passes it through."""


def collate(batch):
    """DataLoader ``collate_fn`` for every loader of the scripts.

    A ``Batch`` (from ``InMemoryImages.__getitems__``) is already one batch
    and passes through as (images, labels); a list of per-sample items (the
    torchvision and synthetic datasets) is stacked by ``default_collate``.
    """
    if isinstance(batch, Batch):
        return tuple(batch)
    return default_collate(batch)


class InMemoryImages(Dataset):
    """A whole image dataset decoded once: uint8 (N, C, H, W) images, int64 (N,) labels.

    ``dataset[i]`` is one (uint8 (C, H, W), int64 ()) pair. The DataLoader
    calls ``__getitems__`` with a batch's indices when a dataset has it (and
    ``Subset`` forwards it, mapping the indices), so a batch is one indexing
    operation, not ``batch_size`` Python calls and a stack; conversion to
    float, normalization and augmentation happen later, batched on the device
    (``DeviceTransform``). Any sampler works unchanged, DistributedSampler
    included: it still decides which indices each rank gets.
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


def _decode(view) -> InMemoryImages:
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


# --------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------

@dataclass
class Task:
    """Everything a script needs to train one dataset.

    loss_fn(output, target, reduction=...) is ``F.mse_loss`` (targets float32
    (N, 1)) or ``F.cross_entropy`` (targets int64 (N,), outputs logits).
    ``train_transform``/``eval_transform`` turn a batch's inputs, once on the
    device, into the model's input (see ``DeviceTransform``).
    """

    train_set: Dataset
    val_set: Dataset
    test_set: Dataset
    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    train_transform: Callable[[torch.Tensor], torch.Tensor] = DeviceTransform()
    eval_transform: Callable[[torch.Tensor], torch.Tensor] = DeviceTransform()


def load_task(dataset: str, model: Optional[str], data_dir: str, seed: int,
              val_fraction: float = 0.1, input_path: str = "torchvision") -> Task:
    """Build datasets and model for ``dataset``.

    The validation set is a seeded ``val_fraction`` of the official train split
    (same on every rank); the test set is the official test split. For
    CIFAR-10 the validation images come from a second view of the train split
    with the *eval* transform, so augmentation never leaks into validation.
    Files must already be present (see ``prepare_data``).

    ``input_path`` (mnist, cifar10): "torchvision" gives per-sample datasets
    yielding normalized float32 images (augmented for CIFAR-10 training);
    "fast" gives ``InMemoryImages`` yielding uint8 batches, and the task's
    device transforms normalize (and for CIFAR-10 training, crop and flip)
    them on the device. ResNets get channels-last memory on CUDA.

    Raises ConfigError for an unknown model or missing files.
    """
    model_name = resolve_model(dataset, model)
    if dataset == "synthetic":
        full, test = SyntheticRegression(seed, "train"), SyntheticRegression(seed, "test")
        train_idx, val_idx = split_indices(len(full), val_fraction, seed)
        return Task(Subset(full, train_idx), Subset(full, val_idx), test,
                    build_model(dataset, model_name), F.mse_loss)

    from torchvision import transforms

    cls = _torchvision_class(dataset)
    stats = (MNIST_MEAN, MNIST_STD) if dataset == "mnist" else (CIFAR10_MEAN, CIFAR10_STD)
    fast = input_path == "fast"
    if fast:  # the files as they are; DeviceTransform does the rest per batch
        train_tf = eval_tf = None
    elif dataset == "mnist":
        train_tf = eval_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(*stats)])
    else:
        normalize = [transforms.ToTensor(), transforms.Normalize(*stats)]
        train_tf = transforms.Compose(
            [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] + normalize)
        eval_tf = transforms.Compose(normalize)
    try:
        train_view = cls(data_dir, train=True, transform=train_tf)
        # Same decoded images, other transform: a shallow copy, not a second read.
        eval_view = copy.copy(train_view)
        eval_view.transform = eval_tf
        test = cls(data_dir, train=False, transform=eval_tf)
    except RuntimeError as exc:
        raise ConfigError(_fetch(dataset, data_dir, download=False) or str(exc)) from None
    train_idx, val_idx = split_indices(len(train_view), val_fraction, seed)
    model = build_model(dataset, model_name)
    # Tensor cores read convolution inputs fastest in NHWC; on a CPU it does not pay.
    channels_last = model_name.startswith("resnet") and torch.cuda.is_available()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if fast:
        train_view = eval_view = _decode(train_view)  # one copy, two views (Subsets)
        test = _decode(test)
        padding = 4 if dataset == "cifar10" else 0  # MNIST: no augmentation, as before
        return Task(Subset(train_view, train_idx), Subset(eval_view, val_idx), test, model,
                    F.cross_entropy, DeviceTransform(stats, padding, channels_last),
                    DeviceTransform(stats, 0, channels_last))
    return Task(Subset(train_view, train_idx), Subset(eval_view, val_idx), test, model,
                F.cross_entropy, DeviceTransform(channels_last=channels_last),
                DeviceTransform(channels_last=channels_last))


def check_steps(train_data, grad_accum_steps: int = 1) -> None:
    """Raise ConfigError when a training DataLoader (drop_last=True) yields no
    batch, or fewer than the ``grad_accum_steps`` one optimizer step needs."""
    if len(train_data) == 0:
        raise ConfigError(f"the training split gives each process {len(train_data.sampler)} "
                          f"samples, fewer than --batch_size {train_data.batch_size}: "
                          f"no full batch to train on; lower --batch_size")
    if len(train_data) < grad_accum_steps:
        raise ConfigError(f"the training split gives each process {len(train_data)} batches "
                          f"of --batch_size {train_data.batch_size}, fewer than "
                          f"--grad_accum_steps {grad_accum_steps}: no optimizer step to take; "
                          f"lower --grad_accum_steps or --batch_size")


def check_writable(path: str, check: bool) -> None:
    """Make sure ``path``'s folder exists and takes files, before any training.

    Processes with ``check=True`` (the ones that will save) create the folder
    if needed and write and delete a probe file beside ``path``; ``path``
    itself is never touched. Collective under a process group, like
    ``prepare_data``: every rank raises ConfigError (one line) when any check
    failed, so no rank trains for hours and then cannot save.
    """
    error = ""
    if check:
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as exc:
            error = (f"cannot save to {path}: folder {folder} is not writable "
                     f"({exc.strerror or type(exc).__name__}); choose another path")
    error = _first_error(error)
    if error:
        raise ConfigError(error)


def check_finite(loss: float, epoch: int) -> None:
    """Raise ConfigError when the training loss is NaN or infinite.

    Called before anything is saved, so a diverged run never overwrites the
    last good checkpoint or snapshot.
    """
    if not math.isfinite(loss):
        raise ConfigError(f"training loss became {loss} in epoch {epoch + 1}; stopping without "
                          f"saving (the last saved state is kept). Lower --lr and resume")


_fault_counts: dict = {}
_fault_spec: Optional[str] = None  # DDP_TEST_FAULT as read at the first call ("" when off)


def fault_point(point: str) -> None:
    """Test hook: a no-op unless the environment variable DDP_TEST_FAULT is set.

    DDP_TEST_FAULT="POINT:RANK:N:ACTION" makes rank RANK, on the N-th call
    (1-based) of ``fault_point(POINT)`` in this process, do ACTION: ``kill``
    (SIGKILL itself), ``raise`` (RuntimeError) or ``hang`` (sleep an hour).
    Points: ``step`` (each training step) and ``save`` (inside atomic_save,
    after the temporary file is written, before the rename). It fires only
    in a job's first attempt (TORCHELASTIC_RESTART_COUNT unset or 0), so a
    torchrun restart runs clean. The fault-tolerance tests use it. The
    environment is read once per process: two os.environ lookups per step cost
    a small model ~3% of its step time.
    """
    global _fault_spec
    if _fault_spec is None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        _fault_spec = os.environ.get("DDP_TEST_FAULT", "") if first_attempt else ""
    spec = _fault_spec
    if not spec:
        return
    _fault_counts[point] = count = _fault_counts.get(point, 0) + 1
    want_point, want_rank, want_count, action = spec.split(":")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if (point, rank, count) != (want_point, int(want_rank), int(want_count)):
        return
    say(f"DDP_TEST_FAULT: {action} at {point} {count} on rank {rank}", sys.stderr)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        raise RuntimeError(f"DDP_TEST_FAULT: injected failure at {point} {count} on rank {rank}")
    elif action == "hang":
        time.sleep(3600)


def get_device(index: int) -> torch.device:
    """``cuda:index`` when CUDA is available, else the CPU (every index)."""
    if torch.cuda.is_available():
        return torch.device("cuda", index)
    return torch.device("cpu")


# --------------------------------------------------------------------------
# Speed: how a training step runs
# --------------------------------------------------------------------------

# Models for which bf16 autocast was measured to speed up training on a CPU
# with native bf16 instructions (AVX512-BF16/AMX). Here (2-core AMD EPYC,
# torch 2.15), samples/s with --amp over without: cnn x1.35-1.7, mlp x0.57,
# resnet18 x0.9-1.2 (noise around no gain); see the README, Performance.
AMP_HELPS_ON_CPU = ("cnn",)


@dataclass
class TrainOptions:
    """How the Trainer runs a step; from --grad_accum_steps, --amp, --compile
    and the task's device transforms (see ``train_options``)."""

    grad_accum_steps: int = 1
    amp: bool = False
    compile: bool = False
    train_transform: Callable[[torch.Tensor], torch.Tensor] = DeviceTransform()
    eval_transform: Callable[[torch.Tensor], torch.Tensor] = DeviceTransform()


def train_options(args, task: Task) -> TrainOptions:
    """The Trainer's options for this run, from its flags and ``task``."""
    return TrainOptions(args.grad_accum_steps, args.amp, args.compile,
                        task.train_transform, task.eval_transform)


def check_amp(amp: bool, device: torch.device, model: str) -> None:
    """Raise ConfigError for --amp on a CPU where bf16 autocast makes training slower.

    On CUDA, --amp is bf16 autocast (no loss scaling needed, unlike fp16). On
    a CPU it only helps with native bf16 instructions, and only for some
    models (``AMP_HELPS_ON_CPU``, measured); elsewhere it would silently cost
    speed and precision, so it is refused in one line.
    """
    if not amp or device.type == "cuda":
        return
    if model not in AMP_HELPS_ON_CPU:
        raise ConfigError(f"--amp on a CPU: bf16 autocast does not speed up --model {model} "
                          f"on a CPU (measured, see the README's Performance section); "
                          f"--amp is for CUDA GPUs. Run without --amp")
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise ConfigError("--amp on a CPU: this CPU has no native bf16 instructions "
                          "(AVX512-BF16 or AMX), so bf16 autocast would be slower; "
                          "--amp is for CUDA GPUs. Run without --amp")


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast on ``device`` when ``enabled`` (the forward pass and the
    loss; backward follows the forward's dtypes), else a context that does nothing.

    Reusable, one ``with`` after another (not nested): make it once, not per step.
    """
    if not enabled:
        return contextlib.nullcontext()  # cheaper than an autocast(enabled=False) per step
    return torch.autocast(device.type, dtype=torch.bfloat16)


def compile_model(model: nn.Module, enabled: bool) -> nn.Module:
    """``torch.compile(model)`` when ``enabled``, else ``model`` itself.

    The compiled module shares ``model``'s parameters; the scripts call it for
    the training forward only, and keep saving ``model`` (or its DDP
    ``.module``), so saved state_dicts have no ``_orig_mod.`` prefix and load
    without compile. For DDP, pass the DDP-wrapped model: compiling after
    wrapping lets TorchDynamo's DDP optimizer split the graph at the gradient
    buckets, so all-reduce still overlaps with backward.
    """
    return torch.compile(model) if enabled else model


def global_batch_line(batch_size: int, grad_accum_steps: int, world_size: int) -> str:
    """The one line printed at start: samples per optimizer step, over all processes."""
    return (f"global batch size {batch_size * grad_accum_steps * world_size} = batch_size "
            f"{batch_size} x grad_accum_steps {grad_accum_steps} x world_size {world_size}")


def reset_peak_memory(device: torch.device) -> None:
    """Start counting ``peak_memory_mib`` afresh (CUDA; nothing on a CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> dict:
    """{"peak_gpu_memory_mib": MiB} on CUDA, {} on a CPU.

    The most memory tensors held on ``device`` since ``reset_peak_memory``
    (``torch.cuda.max_memory_allocated``, MiB = 2**20 bytes), the maximum over
    all ranks under a process group: a collective on CUDA, so every rank
    must call it.
    """
    if device.type != "cuda":
        return {}
    peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**20, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"peak_gpu_memory_mib": peak.item()}


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------

def say(line: str, stream=None) -> None:
    """Print ``line`` and its newline in one write, then flush.

    Several ranks often share one terminal or log file; a plain ``print``
    writes the text and the newline separately, so lines of different ranks
    can run into each other. One write of under 4 KiB to a pipe is atomic.
    """
    stream = stream or sys.stdout
    stream.write(line + "\n")
    stream.flush()


def log_metrics(record: dict, metrics_path: Optional[str]) -> None:
    """Print one fixed-format line and append ``record`` as JSON to ``metrics_path``.

    Epoch records print as
      ``epoch 3/10 | train_loss 0.012345 | val_loss 0.012345 | val_acc 0.9512 |
      samples/s 12345.6 | epoch_s 0.52 | peak_mem_mib 1234.5``  (val_acc only for
    classification, peak_mem_mib only on CUDA); the final test record as
    ``test | loss 0.012345 | acc 0.9600``.
    Units: samples/s is global training samples per second over the training
    part of the epoch; epoch_s is that part's wall-clock seconds; peak_mem_mib
    the epoch's peak GPU memory held by tensors, MiB, the maximum over ranks.
    """
    if "epoch" in record:
        parts = [f"epoch {record['epoch']}/{record['total_epochs']}",
                 f"train_loss {record['train_loss']:.6f}", f"val_loss {record['val_loss']:.6f}"]
        if record.get("val_accuracy") is not None:
            parts.append(f"val_acc {record['val_accuracy']:.4f}")
        parts += [f"samples/s {record['samples_per_s']:.1f}", f"epoch_s {record['epoch_seconds']:.2f}"]
        if record.get("peak_gpu_memory_mib") is not None:
            parts.append(f"peak_mem_mib {record['peak_gpu_memory_mib']:.1f}")
    else:
        parts = ["test", f"loss {record['test_loss']:.6f}"]
        if record.get("test_accuracy") is not None:
            parts.append(f"acc {record['test_accuracy']:.4f}")
    say(" | ".join(parts))
    if metrics_path:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")


def atomic_save(obj: object, path: str) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename.

    A crash at any moment leaves either the old file or the new one, never a
    torn file (POSIX rename is atomic within a filesystem). After a successful
    save, temporary files left beside ``path`` by killed writers are removed;
    only one process may save to a given ``path``.
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        fault_point("save")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    # Temporary files of writers killed before their rename are garbage now.
    for stale in glob.glob(os.path.join(folder, glob.escape(os.path.basename(path)) + ".*.tmp")):
        os.remove(stale)
