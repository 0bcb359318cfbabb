"""The built-in image tasks, mnist and cifar10: torchvision's datasets, a CNN or a ResNet.

A task module like yours (docs/custom-task.md): ``common.TASKS`` names its
functions as ``"vision_tasks:mnist_task"`` and ``"vision_tasks:cifar10_task"``,
and ``common.load_task`` imports them the way it imports
``--dataset my_module:my_task``.

  mnist    torchvision MNIST, the 2-conv/2-fc CNN with dropout (``--model
           cnn``), cross-entropy.
  cifar10  torchvision CIFAR10 with crop+flip augmentation, a ResNet-18
           (default) or ResNet-50 with the CIFAR stem (``cifar_resnet``), or
           torchvision's ImageNet-stem one by name (``resnet18_imagenet``),
           cross-entropy.

Each task also gives its recipe's defaults (``Task.recipe``; docs/recipes.md).

Both read the files from ``--data_dir`` (``prepare_data`` downloads them, or
names what is missing) and, with ``--input_path fast`` (the default), keep
them decoded in memory (fast_images.py).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Subset

from common import VAL_FRACTION, ConfigError, Task, choose_model, split_indices
from fast_images import DeviceTransform, decode

# Per-channel mean/std of the training images, the values the torchvision
# references use (MNIST: pytorch/examples mnist/main.py; CIFAR-10: the
# widely used kuangliu/pytorch-cifar numbers, as in the seed tutorials).
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)


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


# --model for cifar10: the CIFAR-stem ResNets first (the default), then torchvision's own.
CIFAR10_MODELS = ("resnet18", "resnet50", "resnet18_imagenet", "resnet50_imagenet")
# --model: the models each task function of this module accepts, the default first (train.py's --help).
MODELS = {"mnist_task": ("cnn",), "cifar10_task": CIFAR10_MODELS}
# The flags this module's tasks read, as argparse's add_argument takes them (train.py adds them to
# its own; the rungs have none, and read the files the fast way).
FLAGS = {"input_path": {"choices": ("fast", "torchvision"), "default": "fast",
                        "help": "'fast' holds decoded uint8 images in memory and augments whole batches on the "
                                "device; 'torchvision' is the per-sample Dataset + transforms path (default: fast)"}}
# The recipes the built-in tasks train with unless a flag says otherwise (docs/recipes.md).
# MNIST: SGD with momentum, half an epoch of warm-up, x0.7 per epoch (the decay of
# pytorch/examples mnist/main.py). CIFAR-10: the widely reproduced ResNet recipe of
# kuangliu/pytorch-cifar: SGD 0.1, momentum 0.9, weight decay 5e-4, cosine to 0.
MNIST_RECIPE = {"optimizer": "sgd", "lr": 0.05, "warmup_epochs": 0.5, "lr_schedule": "step",
                "lr_step_epochs": 1, "lr_gamma": 0.7}
CIFAR10_RECIPE = {"optimizer": "sgd", "lr": 0.1, "weight_decay": 5e-4, "lr_schedule": "cosine"}


def cifar_resnet(name: str) -> nn.Module:
    """A torchvision ResNet (``resnet18``, ``resnet50``) for 32x32 images, 10 classes:
    float32 (N, 3, 32, 32) -> (N, 10) logits.

    The ImageNet stem (7x7 stride-2 convolution, then a stride-2 max-pool)
    shrinks a 32x32 image to 8x8 before the first block; the CIFAR stem of He
    et al. 2016 (section 4.2) and of the published CIFAR-10 ResNet-18/50
    results (kuangliu/pytorch-cifar) is one 3x3 stride-1 convolution and no
    max-pool, so the blocks see 32x32. Parameters: 11,173,962 (resnet18) and
    23,520,842 (resnet50), those of kuangliu's ResNet18 and ResNet50.
    Raises AttributeError for a name torchvision.models does not have.
    """
    import torchvision

    model = getattr(torchvision.models, name)(weights=None, num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision's
    model.maxpool = nn.Identity()
    return model


def build_model(dataset: str, model: str) -> nn.Module:
    """A freshly initialized model (from the global torch RNG) of an image task.

    mnist, ``cnn``: float32 (N, 1, 28, 28) -> (N, 10) logits. cifar10
    (``CIFAR10_MODELS``): float32 (N, 3, 32, 32) -> (N, 10) logits,
    ``resnet18``/``resnet50`` with the CIFAR stem (``cifar_resnet``),
    ``resnet18_imagenet``/``resnet50_imagenet`` torchvision's as they are.
    """
    if dataset == "mnist":
        return MnistCNN()
    if not model.endswith("_imagenet"):
        return cifar_resnet(model)
    import torchvision

    return getattr(torchvision.models, model.removesuffix("_imagenet"))(weights=None, num_classes=10)


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


def _missing_folders(folder: str) -> list[str]:
    """``folder`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    folder = os.path.abspath(folder)
    while not os.path.exists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    return missing


def _remove_if_empty(folders: list[str]) -> None:
    """Remove each of ``folders`` (deepest first) that exists and is empty:
    a failed download leaves no empty ``MNIST/raw`` that looks like data."""
    for folder in folders:
        try:
            os.rmdir(folder)  # only an empty folder; a partial file keeps it, for a retry to see
        except OSError:
            return


def prepare_data(dataset: str, data_dir: str, download: bool) -> None:
    """Make sure the files of ``dataset`` (mnist, cifar10) are in ``data_dir``.

    With ``download``, torchvision downloads what is missing; without, this
    only looks for the files (parsing them is the task's job). Raises
    ConfigError with a one-line message naming the folder, the files expected
    and how to pre-stage them.
    """
    cls = _torchvision_class(dataset)
    folder, names = expected_files(dataset, data_dir)
    created = _missing_folders(folder)  # what a failed download must not leave behind
    try:
        if download:
            try:
                for train in (True, False):
                    cls(data_dir, train=train, download=True)
            except Exception:
                _remove_if_empty(created)
                raise
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
        f"existing copy" + (
            "; with only MNIST's test split files at hand (t10k-images-idx3-ubyte.gz, "
            "t10k-labels-idx1-ubyte.gz), python vision_tasks.py THEIR_FOLDER mnist_t10k writes a "
            "--data_dir of their 10,000 digits" if dataset == "mnist" else ""))


def vision_task(dataset: str, args: argparse.Namespace, download: bool) -> Task:
    """mnist or cifar10 (``dataset``) from torchvision's classes.

    Validation: a seeded 10% of the official train split, read with the
    *eval* transform (no augmentation); test: the official test split.
    ``--input_path torchvision``: per-sample normalized float32 images
    (augmented for CIFAR-10 training); ``fast``: ``InMemoryImages`` uint8
    batches that the task's device transforms normalize (and for CIFAR-10
    training crop and flip) on the device. ResNets are channels-last on CUDA.
    """
    from torchvision import transforms

    model_name = choose_model(args, MODELS[f"{dataset}_task"])
    prepare_data(dataset, args.data_dir, download)
    cls = _torchvision_class(dataset)
    stats = (MNIST_MEAN, MNIST_STD) if dataset == "mnist" else (CIFAR10_MEAN, CIFAR10_STD)
    normalize = [transforms.ToTensor(), transforms.Normalize(*stats)]
    augment = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
    fast = getattr(args, "input_path", "fast") == "fast"  # the rungs have no --input_path
    if fast:  # the files as they are; DeviceTransform does the rest per batch
        train_tf = eval_tf = None
    else:
        eval_tf = transforms.Compose(normalize)
        train_tf = eval_tf if dataset == "mnist" else transforms.Compose(augment + normalize)
    try:
        train_view = cls(args.data_dir, train=True, transform=train_tf)
        # Same decoded images, other transform: a shallow copy, not a second read.
        eval_view = copy.copy(train_view)
        eval_view.transform = eval_tf
        test = cls(args.data_dir, train=False, transform=eval_tf)
    except RuntimeError as exc:
        prepare_data(dataset, args.data_dir, download=False)  # names what is missing
        raise ConfigError(str(exc)) from None
    train_idx, val_idx = split_indices(len(train_view), VAL_FRACTION, args.seed)
    model = build_model(dataset, model_name)
    # Tensor cores read convolution inputs fastest in NHWC; on a CPU it does not pay.
    channels_last = model_name.startswith("resnet") and torch.cuda.is_available()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    train_transform = eval_transform = DeviceTransform(channels_last=channels_last)
    if fast:
        train_view = eval_view = decode(train_view)  # one copy, two views (Subsets)
        test = decode(test)
        padding = 4 if dataset == "cifar10" else 0  # MNIST: no augmentation
        train_transform = DeviceTransform(stats, padding, channels_last)
        eval_transform = DeviceTransform(stats, 0, channels_last)
    return Task(Subset(train_view, train_idx), Subset(eval_view, val_idx), test, model,
                F.cross_entropy, True, train_transform, eval_transform,
                recipe=MNIST_RECIPE if dataset == "mnist" else CIFAR10_RECIPE,
                identity={"input_path": "fast" if fast else "torchvision"})


def mnist_task(args: argparse.Namespace, download: bool) -> Task:
    """``--dataset mnist``: 54,000/6,000/10,000 (train/val/test) digits, uint8
    (fast) or normalized float32 (N, 1, 28, 28) images, int64 labels 0-9;
    ``MnistCNN``, cross-entropy; ``MNIST_RECIPE``."""
    return vision_task("mnist", args, download)


def cifar10_task(args: argparse.Namespace, download: bool) -> Task:
    """``--dataset cifar10``: 45,000/5,000/10,000 (train/val/test) uint8 (fast)
    or normalized float32 (N, 3, 32, 32) images, int64 labels 0-9, training
    images cropped and flipped; a ResNet (``CIFAR10_MODELS``), cross-entropy;
    ``CIFAR10_RECIPE``."""
    return vision_task("cifar10", args, download)


# --------------------------------------------------------------------------
# A MNIST folder from MNIST's published test split alone (10,000 digits)
# --------------------------------------------------------------------------

def stage_mnist_t10k(source: str, root: str, n_train: int = 8000, n_test: int = 2000) -> str:
    """Write a torchvision MNIST folder at ``root`` (``root/MNIST/raw``, what
    ``--data_dir root`` reads) made of the 10,000 real digits of MNIST's test
    split, t10k-images-idx3-ubyte(.gz) and t10k-labels-idx1-ubyte(.gz) in
    ``source``: the first ``n_train`` as its train split (which --dataset
    mnist splits 90/10 into train and validation), the last ``n_test`` as its
    test split, uint8 IDX files. For a machine that has those two files and no
    download (docs/recipes.md). Returns ``root``. Raises ConfigError when a
    file is missing or not 10,000 digits, or when ``root`` already holds MNIST."""
    import gzip
    import struct

    def read(name: str, magic: int) -> torch.Tensor:
        for path in (os.path.join(source, name + ".gz"), os.path.join(source, name)):
            if os.path.isfile(path):
                with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
                    data = f.read()
                ndim = magic & 0xFF
                shape = struct.unpack(f">{ndim}i", data[4:4 + 4 * ndim])
                if struct.unpack(">i", data[:4])[0] != magic or shape[0] != 10000:
                    raise ConfigError(f"{path} is not MNIST's 10,000-digit test split (IDX magic {magic})")
                return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).reshape(shape)
        raise ConfigError(f"no {name}.gz (or {name}) in {source}; give the folder holding MNIST's "
                          f"test split files")

    raw = os.path.join(root, "MNIST", "raw")
    if os.path.exists(raw):
        raise ConfigError(f"{raw} exists already; give another folder, or remove it")
    images, labels = read("t10k-images-idx3-ubyte", 2051), read("t10k-labels-idx1-ubyte", 2049)
    os.makedirs(raw)
    for split, first, last in (("train", 0, n_train), ("t10k", 10000 - n_test, 10000)):
        for name, tensor, magic in (("images-idx3", images, 2051), ("labels-idx1", labels, 2049)):
            part = tensor[first:last].contiguous()
            with open(os.path.join(raw, f"{split}-{name}-ubyte"), "wb") as f:
                f.write(struct.pack(">i", magic) + struct.pack(f">{part.dim()}i", *part.shape))
                f.write(part.numpy().tobytes())
    return root


if __name__ == "__main__":
    import sys

    parser = argparse.ArgumentParser(description="Write a --data_dir for --dataset mnist from MNIST's "
                                     "test split alone: 8,000 digits to train (7,200 train, 800 "
                                     "validation), 2,000 held out.")
    parser.add_argument("source", help="folder holding t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz")
    parser.add_argument("data_dir", help="the folder to write; pass it as --data_dir")
    options = parser.parse_args()
    try:
        print(f"MNIST from {options.source}: 8000 train and 2000 test digits in "
              f"{stage_mnist_t10k(options.source, options.data_dir)}; train with --dataset mnist "
              f"--data_dir {options.data_dir}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
