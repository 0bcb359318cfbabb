"""Focused tests of the task modules (common.py, vision_tasks.py): the contract and how
--dataset finds a task, splits, models, the missing-data message."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import common
import train_utils
from common import ConfigError
from train_utils.cli import task_models
import vision_tasks
from helpers import load_task, task_args


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
    built = (common.synthetic_model(model) if dataset == "synthetic"
             else vision_tasks.build_model(dataset, model))
    assert built(torch.randn(shape)).shape == out


def test_unknown_model_for_dataset_is_a_config_error():
    assert common.choose_model(task_args("mnist"), ("cnn",)) == "cnn"
    with pytest.raises(ConfigError, match="choose one of resnet18, resnet50"):
        common.choose_model(task_args("cifar10", model="cnn"), ("resnet18", "resnet50"))


def test_mnist_task_reads_the_real_digits(mnist_root):
    task = load_task("mnist", mnist_root)
    assert (len(task.train_set), len(task.val_set), len(task.test_set)) == (7200, 800, 2000)
    image, label = task.test_set[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32 and 0 <= label <= 9
    # Normalized with the MNIST mean/std: the training images average about 0, std about 1.
    batch = torch.stack([task.train_set[i][0] for i in range(500)])
    assert abs(batch.mean().item()) < 0.1 and abs(batch.std().item() - 1) < 0.1


def test_missing_files_message_is_one_line_with_folder_files_and_fix(tmp_path):
    with pytest.raises(ConfigError) as info:
        vision_tasks.prepare_data("cifar10", str(tmp_path), download=False)
    message = str(info.value)
    assert "\n" not in message
    assert str(tmp_path / "cifar-10-batches-py") in message
    assert "data_batch_1" in message and "test_batch" in message and "batches.meta" in message
    assert "datasets.CIFAR10(" in message and "--data_dir" in message


def test_built_in_tasks_are_found_the_way_a_users_task_is(tmp_path, monkeypatch):
    """TASKS maps each short name to a "module:function" string, and load_task
    imports it through the code path of --dataset my_module:my_task: pointing
    a built-in name at another module's function makes --dataset mnist build that."""
    assert common.TASKS == {"synthetic": "common:synthetic_task", "mnist": "vision_tasks:mnist_task",
                            "cifar10": "vision_tasks:cifar10_task",
                            "shakespeare_char": "text_tasks:shakespeare_char_task",
                            "tokens": "token_tasks:token_file_task"}
    assert list(common.TASKS)[0] == "synthetic"  # the default of --dataset
    assert common.task_function(common.TASKS["mnist"]) is vision_tasks.mnist_task
    assert common.task_function(common.TASKS["cifar10"]) is vision_tasks.cifar10_task
    assert common.task_function(common.TASKS["synthetic"]) is common.synthetic_task
    (tmp_path / "probe_task.py").write_text(
        "import common\n"
        "def build(args, download):\n"
        "    return common.Task(None, None, None, None, None, classification=download)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(common.TASKS, "mnist", "probe_task:build")
    assert load_task("mnist").classification is False  # built by probe_task.build, download=False
    assert load_task("probe_task:build").classification is False


def test_each_task_module_says_its_models_and_the_help_reads_them(tmp_path, monkeypatch):
    """The kit's task_models (--model's help) reads each registered task's
    models from its module's MODELS, keyed by the task function; a task whose
    module lists none, or is not there, is left out rather than stopping the command line."""
    assert task_models() == {"synthetic": ("mlp", "linear"), "mnist": ("cnn",),
                             "cifar10": vision_tasks.CIFAR10_MODELS, "shakespeare_char": ("gpt",),
                             "tokens": ("gpt",)}
    (tmp_path / "listed_task.py").write_text("MODELS = {'build': ('small', 'large')}\ndef build(args, download): pass\n"
                                             "def other(args, download): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(common, "TASKS", {"listed": "listed_task:build", "unlisted": "listed_task:other",
                                          "missing": "no_such_task_module:build"})
    assert task_models() == {"listed": ("small", "large")}


def test_dataset_flag_accepts_the_task_names_and_module_function(monkeypatch):
    for given in ("synthetic", "mnist", "cifar10", "my_task:build_task"):
        monkeypatch.setattr(sys, "argv", ["train.py", "--dataset", given])
        assert train_utils.parse_args(None, common.TASKS).dataset == given
    monkeypatch.setattr(sys, "argv", ["train.py"])
    assert train_utils.parse_args(None, common.TASKS).dataset == "synthetic"


def test_the_contract_imports_no_machinery():
    """A task module imports common alone: no train_utils, no torchvision, no
    image task comes with it (the built-ins are imported when named)."""
    probe = ("import sys, common\n"
             "loaded = {'train_utils', 'vision_tasks', 'fast_images', 'torchvision'} & set(sys.modules)\n"
             "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=os.path.dirname(common.__file__),
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_failed_download_leaves_no_empty_dataset_folder(tmp_path, monkeypatch):
    """torchvision makes MNIST/raw before it downloads; when every mirror fails
    (here: a closed local port, whatever network the machine has), the error
    is one line and no empty folder is left to look like a data set."""
    from torchvision import datasets

    monkeypatch.setattr(datasets.MNIST, "mirrors", ["http://127.0.0.1:9/"])
    data_dir = tmp_path / "data"
    with pytest.raises(ConfigError) as info:
        vision_tasks.prepare_data("mnist", str(data_dir), download=True)
    assert "\n" not in str(info.value) and "download failed" in str(info.value)
    assert not data_dir.exists(), sorted(str(p) for p in data_dir.rglob("*"))
    # A folder the user made stays, with what is in it.
    data_dir.mkdir()
    (data_dir / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError):
        vision_tasks.prepare_data("mnist", str(data_dir), download=True)
    assert sorted(p.name for p in data_dir.iterdir()) == ["notes.txt"]


def test_staging_mnist_from_its_test_split_refuses_in_one_line(tmp_path):
    """docs/recipes.md's one command (vision_tasks.py SOURCE DATA_DIR; the
    tests' MNIST folders are made by it too): a folder without the files, or
    a target that already holds MNIST, is one line, and nothing is written."""
    with pytest.raises(common.ConfigError) as info:
        vision_tasks.stage_mnist_t10k(str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert "no t10k-images-idx3-ubyte.gz" in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()
    (tmp_path / "taken" / "MNIST" / "raw").mkdir(parents=True)
    with pytest.raises(common.ConfigError, match="exists already"):
        vision_tasks.stage_mnist_t10k(str(tmp_path / "nothing"), str(tmp_path / "taken"))
