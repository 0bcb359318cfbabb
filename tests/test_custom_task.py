"""Your own task, plugged in the documented way (docs/custom-task.md): the
guide's own my_task.py, trained through the real command line under torchrun."""

import json
import re
import sys

import torch

from helpers import REPO, check, epochs, error_lines, one_process, parse_test, run
from walk import commands



def guide_task_module(folder) -> None:
    """Write the guide's task files (my_task.py, my_seq_task.py), as printed
    there, into ``folder``: each ```python block, named by its docstring's first word."""
    guide = (REPO / "docs" / "custom-task.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    names = [re.match(r'"""(\w+\.py): ', block).group(1) for block in blocks]
    assert names == ["my_task.py", "my_seq_task.py"], names
    for name, block in zip(names, blocks):
        assert "def build_task(args, download)" in block, name
        (folder / name).write_text(block)


def test_custom_task_trains_under_torchrun_with_accuracy_from_the_task(newcomer_walk):
    """The guide's own command (its first block, in the newcomer's walk): a loss
    that is not F.cross_entropy itself (label smoothing) still gets accuracy,
    because the task says it is a classification."""
    block = newcomer_walk.block("docs/custom-task.md", 0)
    command = next(command for command in commands(block.text) if "train.py" in command)
    assert "--nproc_per_node=2" in command and "--dataset my_task:build_task" in command
    kit = block.stdout[block.stdout.index("\ndevice "):]  # the kit's run, after the rung's
    lines = epochs(kit)
    assert [int(e["epoch"]) for e in lines] == [1, 2, 3]
    assert all("val_acc" in e for e in lines)
    assert lines[-1]["train_loss"] < lines[0]["train_loss"]
    assert parse_test(kit)["acc"] >= 0.9
    assert "world_size 2" in kit
    path = re.search(r"--snapshot_path (\S+)", command).group(1)
    snapshot = torch.load(newcomer_walk.saved("docs/custom-task.md", 0, path), weights_only=True)
    assert snapshot["config"]["dataset"] == "my_task:build_task"
    assert snapshot["model"]["2.weight"].shape == (3, 32)  # the guide's model, 3 classes


RUNGS = ["singlegpu.py", "multigpu_spawn.py", "multigpu_torchrun.py", "multinode.py", "multinode_fsdp.py"]


def test_a_task_without_a_test_split_trains_and_prints_no_test_line(tmp_path):
    """Task.test_set None (docs/custom-task.md's table): the first rung and
    train.py train it, validate every epoch and print no test line (the kit's
    metrics file holds no test record); every rung skips the test the same way."""
    (tmp_path / "no_test_task.py").write_text(
        "import common\n"
        "def build(args, download):\n"
        "    task = common.synthetic_task(args, download)\n"
        "    task.test_set = None  # no test split\n"
        "    return task\n")
    task = ["--dataset", "no_test_task.py:build", "--total_epochs", "1"]
    rung = check(run([sys.executable, REPO / "singlegpu.py", *task], tmp_path))
    kit = check(one_process([*task, "--metrics_path", "metrics.jsonl"], tmp_path))
    for result in (rung, kit):
        assert [e["epoch"] for e in epochs(result.stdout)] == [1] and "test |" not in result.stdout, result.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if "epoch" in r] == [1] and not any("test_loss" in r for r in records)
    for script in RUNGS:
        assert "    if task.test_set is not None:" in (REPO / script).read_text(), script


def test_unknown_task_module_is_one_line(tmp_path):
    """The line names where the module was looked for."""
    result = one_process(["--dataset", "no_such_module:build"], tmp_path, PYTHONPATH="")
    assert result.returncode != 0
    assert len(error_lines(result.stderr)) == 1, result.stderr
    assert "cannot load task function 'build' from module 'no_such_module'" in result.stderr
    assert (f"no no_such_module.py beside the scripts ({REPO}), in the current folder ({tmp_path.resolve()}) or on "
            f"PYTHONPATH (not set); put it in one of them") in result.stderr


def test_task_module_in_the_current_folder_needs_no_pythonpath(tmp_path):
    """torchrun ... /path/to/train.py --dataset my_task:build_task, run from the
    folder holding my_task.py: found, though Python searches only the script's folder."""
    guide_task_module(tmp_path)
    result = check(one_process(["--dataset", "my_task:build_task", "--total_epochs", "1"], tmp_path,
                       PYTHONPATH=""))
    assert [int(e["epoch"]) for e in epochs(result.stdout)] == [1]
    assert "val_acc" in result.stdout  # the guide's task: a classification


def test_module_that_fails_to_import_is_named_without_the_placement_hint(tmp_path):
    """A task module that is there but imports something missing: the error
    names what is missing, not where to put the task module."""
    (tmp_path / "broken_task.py").write_text("import no_such_dependency\n")
    result = one_process(["--dataset", "broken_task:build"], tmp_path)
    assert result.returncode != 0
    assert "No module named 'no_such_dependency'" in result.stderr
    assert "beside the scripts" not in result.stderr
