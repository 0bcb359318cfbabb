"""Where a run writes, and what it reads back: every output path checked
before training with one wording, files that are not the run's never
overwritten, damaged snapshots refused by their zip archive's CRCs, and the
--help text a user reads around them.

Every run is train.py, the kit, on the CPU, from a folder other than the
repository: one process of a launcher's job (``helpers.one_process``) where
what is checked is the run's, whatever launched it; the rest in process."""

import io
import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from helpers import REPO, check, error_lines, one_process, run, task_args

import common
from train_utils.cli import task_models
from train_utils.distributed.devices import torch_version
from train_utils.distributed.fsdp import GLOO_AVG_REDUCE_SCATTER
from train_utils.snapshots.sharded import ShardedSnapshots
from train_utils.output import output_path_error
from train_utils.snapshots.file import read_snapshot

def refused_before_training(result: subprocess.CompletedProcess) -> str:
    """The one error line of a run that stopped before its first epoch; run
    without torchrun (whose own report follows it), that line is all of stderr."""
    assert result.returncode != 0, result.stdout
    errors = error_lines(result.stderr)
    assert len(errors) == 1, result.stderr
    assert "epoch 1/" not in result.stdout
    if "Root Cause" not in result.stderr:
        assert result.stderr.strip() == errors[0]
    return errors[0]


# --------------------------------------------------------------------------
# Output paths: checked up front, one wording
# --------------------------------------------------------------------------

def test_a_folder_given_as_an_output_file_is_refused_before_training(tmp_path):
    """train.py's checks before training, end to end: one line, nothing written."""
    (tmp_path / "runs").mkdir()
    result = one_process(["--total_epochs", "1", "--metrics_path", "runs"], tmp_path)
    assert refused_before_training(result) == (
        "error: cannot write --metrics_path runs: it is a folder, where a file is expected; pass another "
        "--metrics_path")
    assert os.listdir(tmp_path / "runs") == []


def test_a_folder_given_as_a_snapshot_file_is_refused_before_training(tmp_path):
    """DDP's --snapshot_path is a file (FSDP's is a folder): the snapshot's
    claim, end to end: one line, the folder left as it is."""
    (tmp_path / "snapshot.pt").mkdir()
    error = refused_before_training(one_process(["--total_epochs", "1", "--snapshot_path", "snapshot.pt"],
                                                tmp_path))
    assert error == ("error: cannot write --snapshot_path snapshot.pt: it is a folder, where a snapshot "
                     "file is expected; pass another --snapshot_path")
    assert os.listdir(tmp_path / "snapshot.pt") == []


def test_missing_folders_of_the_output_paths_are_created(tmp_path):
    check(one_process(["--total_epochs", "1", "--snapshot_path", "runs/a/snapshot.pt",
                       "--metrics_path", "runs/exp2/m.jsonl"], tmp_path))
    assert (tmp_path / "runs" / "a" / "snapshot.pt").exists()
    assert (tmp_path / "runs" / "exp2" / "m.jsonl").read_text().count('"epoch": 1') == 1


@pytest.mark.parametrize("flag, path, folder, made, line", [
    # FSDP's --snapshot_path is a folder
    ("snapshot_path", "snapshot.pt", True, "file", "cannot write --snapshot_path snapshot.pt: it is a file, where a "
                                                   "snapshot folder is expected; pass another --snapshot_path"),
    ("tensorboard_dir", "tb", True, "file", "cannot write --tensorboard_dir tb: it is a file, where a folder is "
                                            "expected; pass another --tensorboard_dir"),
    ("snapshot_path", "notes/run1/snapshot.pt", False, "notes", "cannot write --snapshot_path "
                                                                "notes/run1/snapshot.pt: notes is a file, not a "
                                                                "folder; pass another --snapshot_path"),
    # /proc exists and is listable; creating a file there fails with ENOENT, not "not writable"
    ("snapshot_path", "/proc/x.pt", False, None, "cannot write --snapshot_path /proc/x.pt: folder /proc takes no new "
                                                 "files (creating one fails: No such file or directory); pass "
                                                 "another --snapshot_path"),
], ids=["fsdp-snapshot-file", "tensorboard-file", "file-in-the-path", "proc"])
def test_what_stands_in_an_output_paths_way_is_named(flag, path, folder, made, line, tmp_path, monkeypatch):
    """The line each output path that cannot be written gets (the check the
    runs above make before training, and the snapshot's claim), and what was
    in the way is left as it was."""
    if path.startswith("/proc") and not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux's /proc")
    monkeypatch.chdir(tmp_path)
    if made == "file":
        (tmp_path / path).write_text("notes")
    elif made:
        (tmp_path / made).write_text("notes")
    assert output_path_error(flag, path, folder) == line
    if made:
        assert (tmp_path / (path if made == "file" else made)).read_text() == "notes"


def test_a_file_torch_save_did_not_write_is_never_overwritten(tmp_path):
    """A snapshot path is read before it is written: a file that is not a
    snapshot is refused, never replaced by a fresh start."""
    (tmp_path / "notes.txt").write_text("my notes\n")
    error = refused_before_training(one_process(["--total_epochs", "1", "--snapshot_path", "notes.txt"], tmp_path))
    assert error.startswith("error: cannot read snapshot notes.txt (not a zip archive as torch.save writes")
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"


# --------------------------------------------------------------------------
# Snapshots: damage found by the zip archive's CRCs, one short line
# --------------------------------------------------------------------------

def zero_inside_largest_tensor(data: bytearray, start: int = 0, length: int = 0) -> str:
    """Zero 8 bytes in the middle of the largest tensor of the torch.save
    archive at ``data[start:start + length]`` (all of ``data`` by default),
    as a bad disk block or a broken copy does; return that entry's name. Its
    bytes follow its local header: 30 bytes, the name, and an extra field
    (torch's alignment), whose lengths the header holds."""
    with zipfile.ZipFile(io.BytesIO(bytes(data[start:start + length] if length else data))) as archive:
        entry = max((info for info in archive.infolist() if "/data/" in info.filename),
                    key=lambda info: info.file_size)
    header = start + entry.header_offset
    name_length, extra_length = (int.from_bytes(data[header + at:header + at + 2], "little") for at in (26, 28))
    middle = header + 30 + name_length + extra_length + entry.compress_size // 2
    data[middle:middle + 8] = bytes(8)
    return entry.filename


def zero_inside_largest_tensor_of(path) -> str:
    """``zero_inside_largest_tensor`` of the file ``path``, written back."""
    data = bytearray(open(path, "rb").read())
    entry = zero_inside_largest_tensor(data)
    open(path, "wb").write(data)
    return entry


# A damaged snapshot stops train.py before training, in one line, and is kept:
# tests/test_fault_tolerance.py (a truncated one, end to end). What the line
# says of each kind of damage, in process (a sharded snapshot read as FSDP's
# Checkpointer reads it, this process a group of one):

def test_a_snapshot_damaged_inside_its_tensors_is_refused_naming_the_entry(finished_run, tmp_path, monkeypatch):
    path = finished_run(tmp_path, "snapshot.pt")
    entry = zero_inside_largest_tensor_of(path)
    saved = torch.load(path, weights_only=True)  # torch alone loads it, damaged tensor and all
    damaged = path.read_bytes()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(common.ConfigError) as info:
        read_snapshot("snapshot.pt", saved["config"])
    assert str(info.value) == (f"cannot read snapshot snapshot.pt (damaged: its entry {entry} fails its CRC-32 "
                               f"check); move it away to start afresh (or put back a good copy), or pass another "
                               f"--snapshot_path")
    assert path.read_bytes() == damaged


def read_sharded(root: Path, folder: str) -> dict:
    """``ShardedSnapshots.read`` of ``root``/``folder``, as --strategy fsdp's
    Checkpointer reads a snapshot to resume (this process a group of one),
    with the config it was saved with."""
    meta = torch.load(root / folder / ShardedSnapshots.META, weights_only=True)
    return ShardedSnapshots(str(root)).read(str(root / folder), meta["config"])


@pytest.mark.skipif(torch_version() < GLOO_AVG_REDUCE_SCATTER,
                    reason="FSDP on gloo needs torch 2.10")
def test_a_damaged_fsdp_meta_file_is_refused_naming_the_entry(finished_run, tmp_path, one_process_group):
    finished_run(tmp_path, "snapshot.pt", strategy="fsdp")
    (folder,) = os.listdir(tmp_path / "snapshot.pt")
    meta = tmp_path / "snapshot.pt" / folder / ShardedSnapshots.META
    config = torch.load(meta, weights_only=True)["config"]
    entry = zero_inside_largest_tensor_of(meta)
    damaged = meta.read_bytes()
    with pytest.raises(common.ConfigError) as info:
        ShardedSnapshots(str(tmp_path / "snapshot.pt")).read(str(meta.parent), config)
    assert str(info.value).startswith(f"cannot read snapshot {meta} (damaged: its entry {entry} fails its "
                                      f"CRC-32 check)")
    assert meta.read_bytes() == damaged


@pytest.mark.skipif(torch_version() < GLOO_AVG_REDUCE_SCATTER,
                    reason="FSDP on gloo needs torch 2.10")
def test_a_damaged_fsdp_shard_is_refused_naming_the_file_and_item(finished_run, tmp_path, one_process_group):
    """DCP keeps no checksum; each tensor in its .distcp files is a torch.save
    archive, whose CRCs catch what dcp.load would load without a word."""
    from torch.distributed.checkpoint import FileSystemReader

    finished_run(tmp_path, "snapshot.pt", strategy="fsdp")
    (folder,) = os.listdir(tmp_path / "snapshot.pt")
    read_sharded(tmp_path / "snapshot.pt", folder)  # whole: read without a word
    model = tmp_path / "snapshot.pt" / folder / "model"
    index, item = max(FileSystemReader(str(model)).read_metadata().storage_data.items(),
                      key=lambda pair: pair[1].length)
    shard = model / item.relative_path
    data = bytearray(shard.read_bytes())
    entry = zero_inside_largest_tensor(data, item.offset, item.length)
    shard.write_bytes(bytes(data))
    with pytest.raises(common.ConfigError) as info:
        read_sharded(tmp_path / "snapshot.pt", folder)
    assert str(info.value) == (f"cannot read snapshot {tmp_path / 'snapshot.pt' / folder} (a damaged shard: model/"
                               f"{item.relative_path} item {index.fqn}: its entry {entry} fails its CRC-32 "
                               f"check); move it away to start afresh (or put back a good copy), or pass another "
                               f"--snapshot_path")
    assert shard.read_bytes() == bytes(data)


def test_random_bytes_as_a_snapshot_give_one_short_line_without_unsafe_advice(tmp_path, monkeypatch):
    (tmp_path / "snapshot.pt").write_bytes(os.urandom(36_000))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(common.ConfigError) as info:
        read_snapshot("snapshot.pt", {})
    assert str(info.value) == ("cannot read snapshot snapshot.pt (not a zip archive as torch.save writes: "
                               "truncated, or another kind of file); move it away to start afresh (or put back "
                               "a good copy), or pass another --snapshot_path")


# --------------------------------------------------------------------------
# Advice and help that fit the script
# --------------------------------------------------------------------------

def test_help_keeps_the_launch_command_as_written(tmp_path):
    """The torchrun line and its backslash continuation, each on its own
    line: pasted into a shell, it is the documented command."""
    script = "train.py"
    result = check(run([sys.executable, REPO / script, "--help"], tmp_path))
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("torchrun --nnodes"))
    assert lines[start].endswith(" \\") and lines[start + 1].startswith("        --rdzv-endpoint")
    command = shlex.split(lines[start][:-1] + lines[start + 1], comments=True)
    assert command[0] == "torchrun" and command[-1] == script and "--rdzv-id=JOB_ID" in command


def test_help_sends_your_task_to_its_own_file_and_lists_each_tasks_models(tmp_path):
    text = " ".join(check(run([sys.executable, REPO / "train.py", "--help"], tmp_path)).stdout.split())
    assert "common.py" not in text and "docs/custom-task.md" in text
    assert ("model for the task: synthetic mlp, linear; mnist cnn; cifar10 resnet18, resnet50, "
            "resnet18_imagenet, resnet50_imagenet; shakespeare_char gpt; tokens gpt; your own task: what its "
            "task function "
            "accepts") in text


@pytest.mark.parametrize("task", list(common.TASKS))
def test_the_models_in_help_are_those_each_task_accepts(task):
    """--model's help (task_models(), each task module's MODELS) against the task itself:
    an unknown model's error lists the task's choices, before any data is read."""
    with pytest.raises(common.ConfigError) as info:
        common.load_task(task_args(task, model="no_such_model"), download=False)
    assert str(info.value).endswith(f"choose one of {', '.join(task_models()[task])}")
