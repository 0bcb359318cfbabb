"""Where a run writes, and what it reads back: every output path checked
before training with one wording, files that are not the run's never
overwritten, damaged snapshots refused by their zip archive's CRCs, and the
--help text a user reads around them.

Every run is train.py, the kit, under torchrun on the CPU, from a folder other than the repository."""

import io
import os
import shlex
import subprocess
import sys
import zipfile

import pytest
import torch

from helpers import REPO, TORCHRUN, check, error_lines, run, task_args

import common
from train_utils.cli import task_models
from train_utils.distributed.devices import torch_version
from train_utils.distributed.fsdp import GLOO_AVG_REDUCE_SCATTER
from train_utils.snapshots.sharded import ShardedSnapshots
from train_utils.snapshots.file import read_snapshot

ONE_RANK = TORCHRUN + ["--standalone", "--nproc_per_node=1", REPO / "train.py", "--total_epochs", "1"]
# Both with the snapshot path spelled out, so the messages below read the same for DDP and FSDP.
TORCHRUN_SCRIPT = TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "train.py",
                              "--snapshot_path", "snapshot.pt"]
FSDP_SCRIPT = TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "train.py", "--strategy", "fsdp",
                          "--snapshot_path", "snapshot.pt"]


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

@pytest.mark.parametrize("flag", ["--metrics_path"])  # --snapshot_path: the next test
def test_a_folder_given_as_an_output_file_is_refused_before_training(flag, tmp_path):
    (tmp_path / "runs").mkdir()
    result = run(ONE_RANK + [flag, "runs"], tmp_path)
    assert refused_before_training(result) == (
        f"error: cannot write {flag} runs: it is a folder, where a file is expected; pass another {flag}")
    assert os.listdir(tmp_path / "runs") == []


def test_a_folder_given_as_a_snapshot_file_is_refused_before_training(tmp_path):
    """DDP's --snapshot_path is a file (FSDP's is a folder)."""
    (tmp_path / "snapshot.pt").mkdir()
    error = refused_before_training(run(TORCHRUN_SCRIPT + ["--total_epochs", "1"], tmp_path))
    assert error == ("error: cannot write --snapshot_path snapshot.pt: it is a folder, where a snapshot "
                     "file is expected; pass another --snapshot_path")


@pytest.mark.skipif(torch_version() < GLOO_AVG_REDUCE_SCATTER,
                    reason="FSDP on gloo needs torch 2.10")
def test_a_file_where_the_fsdp_snapshot_folder_goes_is_refused_and_kept(tmp_path):
    (tmp_path / "snapshot.pt").write_bytes(b"a DDP snapshot file")
    error = refused_before_training(run(FSDP_SCRIPT + ["--total_epochs", "1"], tmp_path))
    assert error == ("error: cannot write --snapshot_path snapshot.pt: it is a file, where a snapshot "
                     "folder is expected; pass another --snapshot_path")
    assert (tmp_path / "snapshot.pt").read_bytes() == b"a DDP snapshot file"


def test_a_file_given_as_the_tensorboard_folder_is_refused_before_training(tmp_path):
    (tmp_path / "tb").write_text("notes")
    error = refused_before_training(run(ONE_RANK + ["--tensorboard_dir", "tb"], tmp_path))
    assert error == ("error: cannot write --tensorboard_dir tb: it is a file, where a folder is expected; "
                     "pass another --tensorboard_dir")
    assert (tmp_path / "tb").read_text() == "notes"


def test_a_file_in_the_path_is_named_as_a_file_not_an_unwritable_folder(tmp_path):
    (tmp_path / "notes").write_text("not a folder")
    error = refused_before_training(run(ONE_RANK + ["--snapshot_path", "notes/run1/snapshot.pt"], tmp_path))
    assert error == ("error: cannot write --snapshot_path notes/run1/snapshot.pt: notes is a file, "
                     "not a folder; pass another --snapshot_path")
    assert (tmp_path / "notes").read_text() == "not a folder"


def test_missing_folders_of_the_output_paths_are_created(tmp_path):
    check(run(ONE_RANK + ["--total_epochs", "1", "--snapshot_path", "runs/a/snapshot.pt",
                          "--metrics_path", "runs/exp2/m.jsonl"], tmp_path))
    assert (tmp_path / "runs" / "a" / "snapshot.pt").exists()
    assert (tmp_path / "runs" / "exp2" / "m.jsonl").read_text().count('"epoch": 1') == 1


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_folder_that_takes_no_files_says_what_fails(tmp_path):
    """/proc exists and is listable; creating a file there fails with ENOENT,
    not with 'not writable'."""
    error = refused_before_training(run(ONE_RANK + ["--snapshot_path", "/proc/x.pt"], tmp_path))
    assert error == ("error: cannot write --snapshot_path /proc/x.pt: folder /proc takes no new files "
                     "(creating one fails: No such file or directory); pass another --snapshot_path")


def test_a_file_torch_save_did_not_write_is_never_overwritten(tmp_path):
    """A snapshot path is read before it is written: a file that is not a
    snapshot is refused, never replaced by a fresh start."""
    (tmp_path / "notes.txt").write_text("my notes\n")
    error = refused_before_training(run(ONE_RANK + ["--snapshot_path", "notes.txt"], tmp_path))
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
# says of each kind of damage, in process:

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


@pytest.mark.skipif(torch_version() < GLOO_AVG_REDUCE_SCATTER,
                    reason="FSDP on gloo needs torch 2.10")
def test_a_damaged_fsdp_meta_file_is_refused_naming_the_entry(finished_run, tmp_path):
    finished_run(tmp_path, "snapshot.pt", strategy="fsdp")
    (folder,) = os.listdir(tmp_path / "snapshot.pt")
    meta = tmp_path / "snapshot.pt" / folder / ShardedSnapshots.META
    entry = zero_inside_largest_tensor_of(meta)
    damaged = meta.read_bytes()
    error = refused_before_training(run(FSDP_SCRIPT + ["--total_epochs", "2"], tmp_path))
    assert error.startswith(f"error: cannot read snapshot snapshot.pt/{folder}/meta.pt (damaged: its entry "
                            f"{entry} fails its CRC-32 check)")
    assert meta.read_bytes() == damaged


@pytest.mark.skipif(torch_version() < GLOO_AVG_REDUCE_SCATTER,
                    reason="FSDP on gloo needs torch 2.10")
def test_a_damaged_fsdp_shard_is_refused_naming_the_file_and_item(finished_run, tmp_path):
    """DCP keeps no checksum; each tensor in its .distcp files is a torch.save
    archive, whose CRCs catch what dcp.load would load without a word."""
    from torch.distributed.checkpoint import FileSystemReader

    finished_run(tmp_path, "snapshot.pt", strategy="fsdp")
    (folder,) = os.listdir(tmp_path / "snapshot.pt")
    model = tmp_path / "snapshot.pt" / folder / "model"
    index, item = max(FileSystemReader(str(model)).read_metadata().storage_data.items(),
                      key=lambda pair: pair[1].length)
    shard = model / item.relative_path
    data = bytearray(shard.read_bytes())
    entry = zero_inside_largest_tensor(data, item.offset, item.length)
    shard.write_bytes(bytes(data))
    error = refused_before_training(run(FSDP_SCRIPT + ["--total_epochs", "2"], tmp_path))
    assert error == (f"error: cannot read snapshot snapshot.pt/{folder} (a damaged shard: model/"
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
