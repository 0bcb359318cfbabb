"""A task of one's own, as a newcomer writes and names it: its own batching
(``Task.collate_fn``, for items of different sizes), ``--dataset`` given as a
file name or path, a task function that returns something else, a dataset
loader workers cannot be sent; and the non-resuming rungs' note when they
replace a checkpoint. All in-process: the rungs' and the kit's own loader
functions, on a world of one for the kit (a real gloo group), and
singlegpu.py's ``main`` end to end. The kit's whole run with such a task is
docs/custom-task.md's command, run by tests/test_docs.py."""

import argparse
import os
import re
import sys

import pytest
import torch
import torch.distributed as dist

import common
from helpers import REPO, task_args

RUNGS = ["singlegpu.py", "multigpu_spawn.py", "multigpu_torchrun.py", "multinode.py", "multinode_fsdp.py"]

# A task module with variable-length items: the shape of docs/custom-task.md's example, small.
SEQUENCE_TASK = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
import common


def pad_batch(items):
    """[(int64 (L_i,), int64 ()), ...] -> (int64 (N, max L_i) zero-padded, int64 (N,))."""
    sequences, labels = zip(*items)
    return nn.utils.rnn.pad_sequence(list(sequences), batch_first=True), torch.stack(labels)


class MeanOfTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4, padding_idx=0)
        self.out = nn.Linear(4, 2)

    def forward(self, tokens):
        mask = (tokens != 0).unsqueeze(-1)
        return self.out((self.embed(tokens) * mask).sum(1) / mask.sum(1))


def build(args, download):
    g = torch.Generator().manual_seed(args.seed)
    labels = torch.randint(0, 2, (40,), generator=g)
    items = [(torch.randint(1, 4, (int(n),), generator=g) + 4 * int(y), y)
             for n, y in zip(torch.randint(2, 9, (40,), generator=g), labels)]
    return common.Task(items[:24], items[24:32], items[32:], MeanOfTokens(), F.cross_entropy,
                       classification=True, COLLATE)
'''


def write_task(folder, name="seq_task.py", collate="collate_fn=pad_batch"):
    (folder / name).write_text(SEQUENCE_TASK.replace("COLLATE", collate))
    return folder / name


def pad_batch(items):
    sequences, labels = zip(*items)
    return torch.nn.utils.rnn.pad_sequence(list(sequences), batch_first=True), torch.tensor(labels)


VARIABLE = [(torch.arange(1, n + 1), n % 2) for n in range(1, 11)]  # lengths 1..10


def test_a_tasks_collate_fn_batches_its_items_in_the_rungs_and_the_kit():
    """Every rung's prepare_dataloader and the kit's take the task's collate_fn;
    the kit's needs a process group (a real one, world size 1)."""
    import train

    task = common.Task(VARIABLE, VARIABLE, VARIABLE, None, None, True, collate_fn=pad_batch)
    assert common.Task(VARIABLE, VARIABLE, VARIABLE, None, None, True).collate_fn is common.collate
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        loaders = [__import__(rung[:-3]).prepare_dataloader(task.train_set, 4, True, 0, task.collate_fn)
                   for rung in RUNGS]
        loaders.append(train.prepare_dataloader(task.train_set, 4, 0, True, 0, task.collate_fn))
        for loader in loaders:
            batches = list(loader)
            assert len(batches) == 2  # 10 items, batches of 4: the last 2 dropped
            for inputs, targets in batches:
                assert inputs.shape[0] == 4 and inputs.shape[1] == int((inputs != 0).sum(1).max())
                assert targets.dtype == torch.int64
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dataset,input_path", [("synthetic", "fast"), ("mnist", "fast"), ("mnist", "torchvision"),
                                                ("cifar10", "fast"), ("cifar10", "torchvision"),
                                                ("shakespeare_char", "fast"), ("tokens", "fast")])
def test_every_built_in_tasks_training_batches_are_dense(dataset, input_path, tmp_path, monkeypatch):
    """Each built-in task's training batches, as its own collate_fn makes them
    (the rungs' loaders, and the kit's before it makes them dense), hold
    contiguous tensors. The loader pins what the collate function returns,
    and pinning keeps strides: a strided view (the (x, y) windows cut as two
    slices of one (B, T + 1) gather) would be copied to a GPU through a
    pageable temporary, which waits for the GPU at every step."""
    import torchvision.datasets.cifar as cifar

    from dataset_files import build_cifar10_root, build_mnist_root, build_shakespeare_root, build_token_files

    monkeypatch.setattr(cifar, "check_integrity", lambda path, md5=None: os.path.isfile(path))  # files of ours

    data_dir = {"mnist": lambda: build_mnist_root(tmp_path, n_train=64, n_test=16),
                "cifar10": lambda: build_cifar10_root(tmp_path),
                "shakespeare_char": lambda: build_shakespeare_root(tmp_path, chars=20000),
                "tokens": lambda: build_token_files(tmp_path, chars=20000)}.get(dataset, lambda: tmp_path)()
    task = common.load_task(task_args(dataset, data_dir, input_path, n_layer=None, n_head=None, n_embd=None,
                                      block_size=16, dropout=None), download=False)
    loader = torch.utils.data.DataLoader(task.train_set, batch_size=4, shuffle=True, collate_fn=task.collate_fn)
    for _, batch in zip(range(3), loader):
        assert all(part.is_contiguous() for part in batch), [part.stride() for part in batch]


def test_the_kits_loader_makes_a_strided_batch_dense_and_a_gpu_copy_would_name_one():
    """A task whose collate_fn returns views with gaps: the kit's loader makes
    each tensor dense once (channels-last images, dense already, stay as
    they are); what the first batch's check on a GPU would say of a strided
    or an unpinned batch."""
    import train
    from train_utils.loop.loaders import host_batch_problem

    rows = torch.arange(4 * 9).reshape(4, 9)
    images = torch.zeros(4, 3, 5, 5).contiguous(memory_format=torch.channels_last)

    def strided_views(items):
        return rows[:, :-1], rows[:, 1:], images

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x, y, pictures = next(iter(train.prepare_dataloader(list(range(8)), 4, 0, True, 0, strided_views)))
    finally:
        dist.destroy_process_group()
    assert x.is_contiguous() and y.is_contiguous() and torch.equal(y, rows[:, 1:])
    assert pictures.is_contiguous(memory_format=torch.channels_last) and not pictures.is_contiguous()
    assert host_batch_problem({"inputs": rows[:, :-1]}, pinned=False) == \
        "inputs are a strided view (strides (9, 1), shape (4, 8))"
    assert host_batch_problem({"inputs": x, "targets": y}, pinned=True) == "inputs are not pinned"
    assert host_batch_problem({"inputs": x, "images": pictures}, pinned=False) == ""


def test_each_rung_passes_the_tasks_collate_fn_to_its_loaders():
    for rung in RUNGS:
        source = (REPO / rung).read_text()
        calls = re.findall(r"prepare_dataloader\(task\.\w+_set, .*\)", source)
        assert len(calls) == 3 and all(call.endswith(", task.collate_fn)") for call in calls), (rung, calls)


def test_items_of_different_sizes_without_a_collate_fn_are_one_line():
    """The default batching stacks items: different sizes are refused in one
    line that names the way out, not torch's stack traceback."""
    import singlegpu

    loader = singlegpu.prepare_dataloader(VARIABLE, 4, False, 0, common.collate)
    with pytest.raises(common.ConfigError) as info:
        next(iter(loader))
    message = str(info.value)
    assert "\n" not in message and "collate_fn" in message and "docs/custom-task.md" in message, message
    with pytest.raises(common.ConfigError, match="give the Task a collate_fn"):  # lists of different lengths
        common.collate([([1, 2], 0), ([1], 1)])


def test_singlegpu_trains_a_variable_length_task_named_by_its_file(tmp_path, monkeypatch, capsys):
    """The first rung, end to end in this process: --dataset seq_task.py:build
    from the current folder, batches padded by the task's collate_fn."""
    import singlegpu

    write_task(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    args = argparse.Namespace(**vars(task_args("seq_task.py:build")), total_epochs=2, save_every=5,
                              batch_size=4, checkpoint_path=str(tmp_path / "seq.pt"))
    singlegpu.main(args)
    printed = capsys.readouterr().out
    assert re.findall(r"^epoch (\d)/2 ", printed, re.M) == ["1", "2"] and "test | loss" in printed
    assert "acc" in printed and (tmp_path / "seq.pt").is_file()
    assert "replacing" not in printed
    # Run again: this rung never resumes, and says once that it replaces the earlier checkpoint.
    singlegpu.main(args)
    printed = capsys.readouterr().out
    replacing = [line for line in printed.splitlines() if "replacing" in line]
    assert replacing == [f"epoch 2 | checkpoint saved at {args.checkpoint_path} (replacing an earlier "
                         f"run's: this script does not resume)"], printed


def test_the_non_resuming_rungs_say_the_same_when_they_replace_a_checkpoint():
    """multigpu_spawn.py saves on rank 0 with singlegpu.py's lines (tested above)."""
    def replacing_lines(rung):
        source = (REPO / rung).read_text()
        return [line for line in source.splitlines() if "replac" in line]

    assert len(replacing_lines("singlegpu.py")) == 3
    assert replacing_lines("multigpu_spawn.py") == replacing_lines("singlegpu.py")


# --------------------------------------------------------------------------
# --dataset as a file name or a path
# --------------------------------------------------------------------------

@pytest.mark.parametrize("given", ["seq_task.py:build", "tasks/seq_task.py:build", "./tasks/seq_task.py:build",
                                   "ABSOLUTE/tasks/seq_task.py:build"],
                         ids=["file", "relative-path", "dot-relative-path", "absolute-path"])  # no '/' in ids
def test_dataset_names_a_task_file_by_name_or_path(given, tmp_path, monkeypatch):
    write_task(tmp_path)
    (tmp_path / "tasks").mkdir()
    write_task(tmp_path / "tasks")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "seq_task", raising=False)
    given = given.replace("ABSOLUTE", str(tmp_path))
    task = common.load_task(task_args(given), download=False)
    assert len(task.train_set) == 24 and task.collate_fn.__name__ == "pad_batch"
    folder = tmp_path / "tasks" if "tasks/" in given else tmp_path
    assert os.path.samefile(sys.modules["seq_task"].__file__, folder / "seq_task.py")


def test_a_task_file_that_is_not_there_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(common.ConfigError) as info:
        common.load_task(task_args("tasks/no_such_task.py:build"), download=False)
    message = str(info.value)
    assert "\n" not in message and "no file tasks/no_such_task.py" in message, message
    assert str(tmp_path) in message  # where a relative path was looked for


def test_the_task_files_folder_is_where_loader_workers_import_it_from(tmp_path, monkeypatch):
    """A fork server's workers import the task's module (its collate_fn, its
    dataset classes) by name: the folder of a task given as dir/file.py is on
    their import path."""
    from train_utils.loop import loaders

    (tmp_path / "tasks").mkdir()
    write_task(tmp_path / "tasks")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "seq_task", raising=False)
    common.load_task(task_args("tasks/seq_task.py:build"), download=False)
    assert loaders._import_folders()[0] == str(tmp_path / "tasks")
    common.TASK_FILE_FOLDERS.remove(str(tmp_path / "tasks"))


# --------------------------------------------------------------------------
# A task function that returns something else
# --------------------------------------------------------------------------

@pytest.mark.parametrize("returned", ["None", "(train, val, test)", "common.Task"])
def test_a_task_function_that_returns_no_task_is_one_line(returned, tmp_path, monkeypatch):
    (tmp_path / "wrong_task.py").write_text(
        "import common\ntrain = val = test = []\ndef build(args, download):\n    return " + returned + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "wrong_task", raising=False)
    with pytest.raises(common.ConfigError) as info:
        common.load_task(task_args("wrong_task:build"), download=False)
    message = str(info.value)
    assert "\n" not in message and "--dataset wrong_task:build" in message, message
    assert "not a common.Task" in message and "return common.Task(" in message, message
