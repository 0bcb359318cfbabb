"""The task: what you replace with your own datasets, model and loss.

Every script trains a ``Task`` (three datasets, a model, a loss, whether it
is a classification) built by a task function ``(args, download) -> Task``,
and an optimizer from ``build_optimizer``. Built in (``--dataset``):

  synthetic  seeded regression, 20 features -> 1 target, MLP or linear model,
             MSE loss. No download; the default everywhere.
  mnist      torchvision MNIST, the 2-conv/2-fc CNN with dropout, cross-entropy.
  cifar10    torchvision CIFAR10 with crop+flip augmentation, torchvision
             resnet18 (default) or resnet50, cross-entropy.

Your own: write a task function (``synthetic_task`` is the smallest) and
add it to ``TASKS``, or pass ``--dataset my_module:my_task``; see
docs/custom-task.md. The scripts and train_utils.py need no edit.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, default_collate

from train_utils import ConfigError

# Per-channel mean/std of the training images, the values the torchvision
# references use (MNIST: pytorch/examples mnist/main.py; CIFAR-10: the
# widely used kuangliu/pytorch-cifar numbers, as in the seed tutorials).
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
VAL_FRACTION = 0.1  # of the official train split, seeded, the same on every rank


def identity(source: torch.Tensor) -> torch.Tensor:
    """The default batch transform: the inputs already are the model's input."""
    return source


@dataclass
class Task:
    """Everything a script needs to train one dataset.

    Items of the datasets are (input, target) pairs, collated into batches by
    ``collate``. ``loss_fn(output, targets, reduction="mean"|"sum")`` returns
    the mean (training) or the sum (evaluation, so every sample counts once)
    of the per-sample losses, as ``F.mse_loss`` and ``F.cross_entropy`` do
    (``functools.partial(F.cross_entropy, label_smoothing=0.1)`` too).
    ``classification``: the model outputs (N, classes) logits and targets are
    int64 (N,) class indices; evaluation then also reports accuracy.
    ``train_transform``/``eval_transform`` turn a batch's inputs, once on the
    device, into the model's input (see ``DeviceTransform``).
    """

    train_set: Dataset
    val_set: Dataset
    test_set: Dataset
    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    classification: bool
    train_transform: Callable[[torch.Tensor], torch.Tensor] = field(default=identity)
    eval_transform: Callable[[torch.Tensor], torch.Tensor] = field(default=identity)


def build_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer every script uses: SGD, momentum 0.9, learning rate ``lr``.

    Swap it here for your own; snapshots save and restore whatever optimizer
    this returns (its ``state_dict``), and a resumed run sets ``lr`` anew.
    """
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def load_task(args: argparse.Namespace, download: bool) -> Task:
    """The task named by ``args.dataset``: a name in ``TASKS`` or a
    ``module:function`` importable from the current folder or PYTHONPATH.

    The task function reads what it needs from ``args`` (data_dir, seed,
    model, input_path) and sets ``args.model`` to the model it chose; it
    downloads missing files only when ``download`` (see
    ``train_utils.downloaders_first``). Raises ConfigError (one line) for an
    unknown task or model, or missing data.
    """
    if args.dataset in TASKS:
        task_fn = TASKS[args.dataset]
    else:
        module_name, _, function = args.dataset.partition(":")
        try:
            task_fn = getattr(importlib.import_module(module_name), function)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"--dataset {args.dataset}: cannot load task function "
                              f"{function!r} from module {module_name!r} ({exc})") from None
    return task_fn(args, download)


def choose_model(args: argparse.Namespace, choices: tuple[str, ...]) -> str:
    """Set and return ``args.model``: its value, or the first of ``choices``.

    Raises ConfigError when the model is not one of ``choices``.
    """
    if args.model is None:
        args.model = choices[0]
    if args.model not in choices:
        raise ConfigError(f"--model {args.model} is not available for --dataset {args.dataset}; "
                          f"choose one of {', '.join(choices)}")
    return args.model


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded (train, val) split of range(n): the same on every rank.

    Uses a private generator, so the global RNG is untouched.
    """
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = int(n * val_fraction)
    return perm[n_val:], perm[:n_val]


# --------------------------------------------------------------------------
# synthetic: a seeded regression, no download
# --------------------------------------------------------------------------

SYNTHETIC_FEATURES = 20


class SyntheticRegression(Dataset):
    """y = x @ w + b + noise, drawn from a private ``torch.Generator``.

    The global RNG is never touched, so every rank that builds it with the same
    ``seed`` and ``split`` holds identical tensors. Train (2,048 samples) and
    test (512) share w and b (the relation to learn) but have independent x
    and noise. w ~ N(0, 1/20) makes Var(y) about 1, so the MSE of a zero
    predictor is ~1 and the best achievable is the noise variance, 0.01.

    Items: (x float32 (20,), y float32 (1,)).
    """

    def __init__(self, seed: int, split: str) -> None:
        relation = torch.Generator().manual_seed(seed)
        w = torch.randn(SYNTHETIC_FEATURES, 1, generator=relation) / SYNTHETIC_FEATURES ** 0.5
        b = torch.randn(1, generator=relation)
        n = 2048 if split == "train" else 512
        g = torch.Generator().manual_seed(seed + (1 if split == "train" else 2))
        self.x = torch.randn(n, SYNTHETIC_FEATURES, generator=g)
        self.y = self.x @ w + b + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


def synthetic_task(args: argparse.Namespace, download: bool) -> Task:
    """The default task: ``SyntheticRegression``, an MLP (or ``--model linear``)
    float32 (N, 20) -> (N, 1), MSE loss. Needs no files, so ``download`` is unused."""
    model = choose_model(args, ("mlp", "linear"))
    full, test = SyntheticRegression(args.seed, "train"), SyntheticRegression(args.seed, "test")
    train_idx, val_idx = split_indices(len(full), VAL_FRACTION, args.seed)
    return Task(Subset(full, train_idx), Subset(full, val_idx), test,
                build_model("synthetic", model), F.mse_loss, classification=False)


# --------------------------------------------------------------------------
# mnist and cifar10: torchvision datasets
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
    """A freshly initialized model (from the global torch RNG) of a built-in task.

    synthetic: float32 (N, 20) -> (N, 1). mnist: (N, 1, 28, 28) -> (N, 10)
    logits. cifar10: (N, 3, 32, 32) -> (N, 10) logits.
    """
    if dataset == "synthetic" and model == "linear":
        return nn.Linear(SYNTHETIC_FEATURES, 1)
    if dataset == "synthetic":
        return nn.Sequential(nn.Linear(SYNTHETIC_FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))
    if dataset == "mnist":
        return MnistCNN()
    import torchvision

    return getattr(torchvision.models, model)(weights=None, num_classes=10)


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


def prepare_data(dataset: str, data_dir: str, download: bool) -> None:
    """Make sure the files of ``dataset`` (mnist, cifar10) are in ``data_dir``.

    With ``download``, torchvision downloads what is missing; without, this
    only looks for the files (parsing them is the task's job). Raises
    ConfigError with a one-line message naming the folder, the files expected
    and how to pre-stage them.
    """
    cls = _torchvision_class(dataset)
    folder, names = expected_files(dataset, data_dir)
    try:
        if download:
            for train in (True, False):
                cls(data_dir, train=train, download=True)
            return
        missing = [name for name in names if not os.path.isfile(os.path.join(folder, name))]
        if not missing:
            return
        reason = f"missing: {', '.join(missing)}"
    except Exception as exc:  # torchvision raises RuntimeError/URLError/OSError
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = lines[-1] if lines else type(exc).__name__  # torchvision's last line says why
    raise ConfigError(
        f"{dataset} not found in {os.path.abspath(folder)} (expected {', '.join(names)}; "
        f"{'download failed: ' if download else ''}{reason}). Pre-stage it on a machine with "
        f"network: python -c \"from torchvision import datasets; datasets.{cls.__name__}"
        f"('{data_dir}', download=True)\" and copy the folder here, or point --data_dir at an "
        f"existing copy")


def vision_task(args: argparse.Namespace, download: bool) -> Task:
    """mnist or cifar10 (``args.dataset``) from torchvision's classes.

    Validation: a seeded 10% of the official train split, read with the
    *eval* transform (no augmentation); test: the official test split.
    ``--input_path torchvision``: per-sample normalized float32 images
    (augmented for CIFAR-10 training); ``fast``: ``InMemoryImages`` uint8
    batches that the task's device transforms normalize (and for CIFAR-10
    training crop and flip) on the device. ResNets are channels-last on CUDA.
    """
    from torchvision import transforms

    model_name = choose_model(args, ("cnn",) if args.dataset == "mnist" else ("resnet18", "resnet50"))
    prepare_data(args.dataset, args.data_dir, download)
    cls = _torchvision_class(args.dataset)
    stats = (MNIST_MEAN, MNIST_STD) if args.dataset == "mnist" else (CIFAR10_MEAN, CIFAR10_STD)
    normalize = [transforms.ToTensor(), transforms.Normalize(*stats)]
    augment = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
    fast = args.input_path == "fast"
    if fast:  # the files as they are; DeviceTransform does the rest per batch
        train_tf = eval_tf = None
    else:
        eval_tf = transforms.Compose(normalize)
        train_tf = eval_tf if args.dataset == "mnist" else transforms.Compose(augment + normalize)
    try:
        train_view = cls(args.data_dir, train=True, transform=train_tf)
        # Same decoded images, other transform: a shallow copy, not a second read.
        eval_view = copy.copy(train_view)
        eval_view.transform = eval_tf
        test = cls(args.data_dir, train=False, transform=eval_tf)
    except RuntimeError as exc:
        prepare_data(args.dataset, args.data_dir, download=False)  # names what is missing
        raise ConfigError(str(exc)) from None
    train_idx, val_idx = split_indices(len(train_view), VAL_FRACTION, args.seed)
    model = build_model(args.dataset, model_name)
    # Tensor cores read convolution inputs fastest in NHWC; on a CPU it does not pay.
    channels_last = model_name.startswith("resnet") and torch.cuda.is_available()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    train_transform = eval_transform = DeviceTransform(channels_last=channels_last)
    if fast:
        train_view = eval_view = decode(train_view)  # one copy, two views (Subsets)
        test = decode(test)
        padding = 4 if args.dataset == "cifar10" else 0  # MNIST: no augmentation
        train_transform = DeviceTransform(stats, padding, channels_last)
        eval_transform = DeviceTransform(stats, 0, channels_last)
    return Task(Subset(train_view, train_idx), Subset(eval_view, val_idx), test, model,
                F.cross_entropy, True, train_transform, eval_transform)


# The tasks --dataset names; the first is the default. Add yours here.
TASKS: dict[str, Callable[[argparse.Namespace, bool], Task]] = {
    "synthetic": synthetic_task,
    "mnist": vision_task,
    "cifar10": vision_task,
}


# --------------------------------------------------------------------------
# The fast input path: decoded uint8 images in memory, batches augmented on the device
# --------------------------------------------------------------------------

class Batch(tuple):
    """A batch a dataset assembled itself, (images, labels); ``collate`` passes it through."""


def collate(batch):
    """DataLoader ``collate_fn`` of the scripts: a ``Batch`` (from
    ``InMemoryImages.__getitems__``) passes through as (images, labels); a list
    of per-sample items is stacked by ``default_collate``."""
    if isinstance(batch, Batch):
        return tuple(batch)
    return default_collate(batch)


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
