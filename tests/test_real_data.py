"""Real input: the CIFAR-10 path through torchvision's own CIFAR10 class
reading files in CIFAR-10's on-disk format: its views. (Trained end to end
through it: tests/test_recipes.py's default recipe; the CNN on real MNIST
digits: tests/test_performance.py, through both input paths.)"""

import pytest
import torch

from dataset_files import build_cifar10_root
from helpers import load_task


@pytest.fixture
def cifar_root(tmp_path):
    return build_cifar10_root(tmp_path / "cifar")


def test_cifar10_views(cifar_root, monkeypatch):
    """Train items are augmented (crop with padding 4, flip); validation items
    come from the same train files with the plain eval transform; the test split
    is the official test batch."""
    import pickle

    import torchvision.datasets.cifar as cifar

    import vision_tasks

    monkeypatch.setattr(cifar, "check_integrity", lambda path, md5=None: __import__("os").path.isfile(path))
    task = load_task("cifar10", cifar_root)
    assert (len(task.train_set), len(task.val_set), len(task.test_set)) == (54, 6, 20)

    raw = []
    for i in range(1, 6):
        with open(cifar_root / "cifar-10-batches-py" / f"data_batch_{i}", "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        raw += list(zip(torch.tensor(entry["data"]).reshape(-1, 3, 32, 32), entry["labels"]))
    mean = torch.tensor(vision_tasks.CIFAR10_MEAN).view(3, 1, 1)
    std = torch.tensor(vision_tasks.CIFAR10_STD).view(3, 1, 1)

    def normalized(pixels):
        return (pixels.float() / 255 - mean) / std

    # Validation: exactly the normalized original pixels, every time.
    for j, index in enumerate(task.val_set.indices):
        image, label = task.val_set[j]
        assert label == raw[index][1]
        assert torch.allclose(image, normalized(raw[index][0]), atol=1e-6)

    # Training: same label, same shape, but shifted and/or flipped copies.
    torch.manual_seed(0)
    index = task.train_set.indices[0]
    plain = normalized(raw[index][0])
    draws = [task.train_set[0] for _ in range(40)]
    assert all(label == raw[index][1] and image.shape == (3, 32, 32) for image, label in draws)
    assert sum(not torch.allclose(image, plain) for image, _ in draws) >= 30
    # Some draw is an unshifted horizontal flip, or a shift of the original by <= 4 pixels.
    assert any(torch.allclose(image, plain.flip(-1)) for image, _ in draws) or any(
        torch.allclose(image[:, 4:-4, 4:-4], plain[:, 4 + dy:28 + dy, 4 + dx:28 + dx])
        for image, _ in draws for dy in range(-4, 5) for dx in range(-4, 5))
