"""Focused tests of common.py: tasks, splits, the output format, atomic saves."""

import json

import pytest
import torch
import torch.nn.functional as F

import common
from conftest import EPOCH_LINE, TEST_LINE


def test_synthetic_data_is_identical_for_the_same_seed_and_ignores_global_rng():
    torch.manual_seed(1)
    a = common.SyntheticRegression(0, "train")
    torch.manual_seed(2)
    b = common.SyntheticRegression(0, "train")
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, common.SyntheticRegression(1, "train").x)
    assert (len(a), a.x.dtype, a[0][0].shape, a[0][1].shape) == (2048, torch.float32, (20,), (1,))


def test_synthetic_relation_is_learnable_and_shared_by_train_and_test():
    """Least squares on train reaches the noise floor (0.01) on test; a zero
    predictor does not. (The upstream tutorial's 1-output Linear trained with
    cross-entropy has a constant loss of 0 and learns nothing.)"""
    train, test = common.SyntheticRegression(0, "train"), common.SyntheticRegression(0, "test")
    design = torch.cat([train.x, torch.ones(len(train), 1)], 1)
    solution = torch.linalg.lstsq(design, train.y).solution
    predicted = torch.cat([test.x, torch.ones(len(test), 1)], 1) @ solution
    assert F.mse_loss(predicted, test.y).item() < 0.012
    assert F.mse_loss(torch.zeros_like(test.y), test.y).item() > 0.5
    # The mistake the tutorial makes: single-logit cross-entropy is identically 0.
    assert F.cross_entropy(torch.randn(8, 1), torch.zeros(8, dtype=torch.long)).item() == 0


def test_validation_split_is_seeded_disjoint_and_complete():
    train, val = common.split_indices(100, 0.1, seed=5)
    assert (train, val) == common.split_indices(100, 0.1, seed=5)
    assert len(val) == 10 and sorted(train + val) == list(range(100))
    assert common.split_indices(100, 0.1, seed=6)[1] != val


@pytest.mark.parametrize("dataset, model, shape, out", [
    ("synthetic", "mlp", (4, 20), (4, 1)),
    ("synthetic", "linear", (4, 20), (4, 1)),
    ("mnist", "cnn", (4, 1, 28, 28), (4, 10)),
    ("cifar10", "resnet18", (2, 3, 32, 32), (2, 10)),
    ("cifar10", "resnet50", (2, 3, 32, 32), (2, 10)),
])
def test_models_have_the_documented_shapes(dataset, model, shape, out):
    assert common.build_model(dataset, model)(torch.randn(shape)).shape == out


def test_unknown_model_for_dataset_is_a_config_error():
    assert common.resolve_model("mnist", None) == "cnn"
    with pytest.raises(common.ConfigError, match="choose one of resnet18, resnet50"):
        common.resolve_model("cifar10", "cnn")


def test_mnist_task_reads_the_real_digits(mnist_root):
    task = common.load_task("mnist", None, str(mnist_root), seed=0)
    assert (len(task.train_set), len(task.val_set), len(task.test_set)) == (7200, 800, 2000)
    image, label = task.test_set[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32 and 0 <= label <= 9
    # Normalized with the MNIST mean/std: the training images average about 0, std about 1.
    batch = torch.stack([task.train_set[i][0] for i in range(500)])
    assert abs(batch.mean().item()) < 0.1 and abs(batch.std().item() - 1) < 0.1


def test_log_metrics_prints_the_parsable_line_and_writes_json(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    record = {"epoch": 3, "total_epochs": 10, "train_loss": 0.5, "samples_per_s": 1234.5,
              "epoch_seconds": 2.25, "val_loss": 0.25, "val_accuracy": 0.875}
    common.log_metrics(record, str(path))
    common.log_metrics({"test_loss": 0.3, "test_accuracy": None}, str(path))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("epoch 3/10 | train_loss 0.500000 | val_loss 0.250000 | val_acc 0.8750 | "
                      "samples/s 1234.5 | epoch_s 2.25")
    assert EPOCH_LINE.match(out[0]) and TEST_LINE.match(out[1]) and out[1] == "test | loss 0.300000"
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        record, {"test_loss": 0.3, "test_accuracy": None}]


def test_atomic_save_replaces_whole_files_and_leaves_no_temp(tmp_path):
    path = tmp_path / "snap.pt"
    common.atomic_save({"a": torch.arange(3)}, str(path))
    common.atomic_save({"a": torch.arange(5)}, str(path))
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.arange(5))
    assert [p.name for p in tmp_path.iterdir()] == ["snap.pt"]


def test_atomic_save_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "snap.pt"
    common.atomic_save({"a": torch.arange(3)}, str(path))

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        common.atomic_save({"a": Unpicklable()}, str(path))
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.arange(3))
    assert [p.name for p in tmp_path.iterdir()] == ["snap.pt"]


def test_missing_files_message_is_one_line_with_folder_files_and_fix(tmp_path):
    with pytest.raises(common.ConfigError) as info:
        common.prepare_data("cifar10", str(tmp_path), download=False)
    message = str(info.value)
    assert "\n" not in message
    assert str(tmp_path / "cifar-10-batches-py") in message
    assert "data_batch_1" in message and "test_batch" in message and "batches.meta" in message
    assert "datasets.CIFAR10(" in message and "--data_dir" in message
