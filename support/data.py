"""Small datasets in the real on-disk formats torchvision and nanoGPT read:
MNIST from the real t10k digits written back as IDX files, Tiny Shakespeare
as --dataset shakespeare_char reads it and as nanoGPT's token files, and a
tiny CIFAR-10 in its python-pickle layout. Used by the tests (through
tests/dataset_files.py, where absent shared data skips a test) and by the
benchmark (benchmarks/run.py, benchmarks/input_pipeline.py)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

# The real MNIST test set (10,000 digits) lives beside the project; see its README.
MNIST_T10K = Path(os.environ.get("MNIST_T10K_DIR", REPO.parent / "shared" / "data" / "mnist-t10k"))


# --------------------------------------------------------------------------
# MNIST from the real t10k files, written back in IDX format
# --------------------------------------------------------------------------

class Absent(Exception):
    """Shared data this needs is not there (its message says which and where to put it)."""


def require_shared(present: bool, message: str) -> None:
    """Raise Absent(``message``) where shared data is absent (``present`` False)."""
    if not present:
        raise Absent(message)


def require_mnist_t10k() -> Path:
    require_shared((MNIST_T10K / "t10k-images-idx3-ubyte.gz").exists(),
                   f"real MNIST fixture absent: {MNIST_T10K}/t10k-images-idx3-ubyte.gz "
                   f"(set MNIST_T10K_DIR or place ../shared beside the repo)")
    return MNIST_T10K


def build_mnist_root(root: Path, n_train: int = 8000, n_test: int = 2000) -> Path:
    """A torchvision MNIST root made of the real t10k digits: the first
    ``n_train`` as the train split, the last ``n_test`` as the test split,
    written by the command docs/recipes.md gives users (``python
    vision_tasks.py SOURCE DATA_DIR``, ``vision_tasks.stage_mnist_t10k``)."""
    import vision_tasks

    return Path(vision_tasks.stage_mnist_t10k(str(require_mnist_t10k()), str(root), n_train, n_test))


# --------------------------------------------------------------------------
# Tiny Shakespeare, as --dataset shakespeare_char reads it
# --------------------------------------------------------------------------

# The corpus (1,115,394 bytes) lives beside the project; see its README.
TINYSHAKESPEARE = Path(os.environ.get("TINYSHAKESPEARE_FILE",
                                      REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"))


def require_tinyshakespeare() -> Path:
    """The corpus file; skips the test where it is absent (fails under CI=true)."""
    require_shared(TINYSHAKESPEARE.is_file(), f"Tiny Shakespeare absent: {TINYSHAKESPEARE} (set "
                   f"TINYSHAKESPEARE_FILE or place ../shared beside the repo)")
    return TINYSHAKESPEARE


def build_shakespeare_root(root: Path, chars: int = 0) -> Path:
    """A --data_dir for --dataset shakespeare_char: ``root/shakespeare_char/input.txt``,
    the whole corpus (a link to it), or its first ``chars`` characters."""
    corpus = require_tinyshakespeare()
    (root / "shakespeare_char").mkdir(parents=True)
    target = root / "shakespeare_char" / "input.txt"
    if chars:
        target.write_text(corpus.read_text(encoding="utf-8")[:chars], encoding="utf-8")
    else:
        target.symlink_to(corpus)
    return root


def build_token_files(folder: Path, chars: int = 0) -> Path:
    """``folder`` holding Tiny Shakespeare (its first ``chars`` characters, or
    all) as nanoGPT's ``data/shakespeare_char/prepare.py`` writes it, for
    --dataset tokens: the sorted set of the text's characters numbered from
    0 (``stoi``/``itos``), the first 90% of the text as ``train.bin`` and the
    rest as ``val.bin`` (each part encoded alone, as prepare.py does), uint16
    ids in native byte order (numpy's ``tofile``; Python's array "H" writes
    the same bytes), and ``meta.pkl`` = {"vocab_size", "itos", "stoi"}."""
    import array
    import pickle

    text = require_tinyshakespeare().read_text(encoding="utf-8")
    data = text[:chars] if chars else text
    chars_sorted = sorted(set(data))
    stoi = {ch: i for i, ch in enumerate(chars_sorted)}
    itos = {i: ch for i, ch in enumerate(chars_sorted)}
    n = len(data)
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.bin", data[:int(n * 0.9)]), ("val.bin", data[int(n * 0.9):])):
        with open(folder / name, "wb") as f:
            array.array("H", [stoi[c] for c in part]).tofile(f)
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars_sorted), "itos": itos, "stoi": stoi}, f)
    return folder


def write_token_shard(path: Path, ids, header: bool = True, version: int = 1, count=None) -> None:
    """A token file at ``path``: uint16 ``ids`` (ints 0..65535), after llm.c's
    header where ``header`` (256 little-endian int32: magic 20240520,
    ``version``, the token count, ``count`` where given, else len(ids); as
    llm.c's dev/data/data_common.py writes its shards), else alone, as
    nanoGPT's prepare.py writes train.bin."""
    import array

    with open(path, "wb") as f:
        if header:
            array.array("i", [20240520, version, len(ids) if count is None else count] + [0] * 253).tofile(f)
        array.array("H", ids).tofile(f)


# --------------------------------------------------------------------------
# CIFAR-10 in its real python-pickle format
# --------------------------------------------------------------------------

def build_cifar10_root(root: Path, per_batch: int = 12, n_test: int = 20, seed: int = 0) -> Path:
    """A tiny CIFAR-10 in the layout of cifar-10-python.tar.gz, unpacked:
    cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}, each a pickle
    of a dict with "data" uint8 (N, 3072) rows (R, G, B planes of 32x32) and
    "labels" list[int], as https://www.cs.toronto.edu/~kriz/cifar.html describes
    (the originals were pickled by Python 2; torchvision reads them with
    encoding="latin1", which yields the same str keys as these).
    Each image is a flat color (its class's hue) plus noise, so it is learnable."""
    g = torch.Generator().manual_seed(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    palette = torch.randint(0, 256, (10, 3, 1), generator=g)

    def batch(n: int, name: str) -> None:
        labels = torch.randint(0, 10, (n,), generator=g)
        noise = torch.randint(-30, 31, (n, 3, 1024), generator=g)
        data = (palette[labels] + noise).clamp(0, 255).to(torch.uint8).reshape(n, 3072)
        with open(folder / name, "wb") as f:
            pickle.dump({"batch_label": name, "labels": labels.tolist(),
                         "data": data.numpy(), "filenames": ["x.png"] * n}, f)

    for i in range(1, 6):
        batch(per_batch, f"data_batch_{i}")
    batch(n_test, "test_batch")
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": names, "num_cases_per_batch": per_batch, "num_vis": 3072}, f)
    return root
