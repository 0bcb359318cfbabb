"""--wandb_project, offline (WANDB_MODE=offline, in the test's folder or in
docs/runs.md's, as the newcomer's walk runs it): what wandb wrote is read
back from its run file, run-<id>.wandb, and must hold the flags, one row per
epoch with the run's own figures, and the test figures; a stopped and
resumed run continues the same W&B run."""

import json
import re
import signal
import struct

import pytest
import torch

from helpers import (FAULTY_TRAIN, REPO, PODS, check, epochs, error_lines, held_at_step, one_process, run,
                     signal_when, without_package)
from walk import walked_blocks


wandb = pytest.importorskip("wandb", reason="pip install wandb (requirements-test.txt)")


def wandb_records(path):
    """The protobuf Records (wandb.proto.wandb_internal_pb2.Record) of a
    run-<id>.wandb file, in order. The file is LevelDB's log format with its
    own 7-byte header (":W&B", magic 0xBEE1, version): 32 KiB blocks of
    chunks, each a 7-byte header (CRC32, length, type: 1 whole, 2 first,
    3 middle, 4 last) and its bytes; a block's tail shorter than a header is
    zero padding. (wandb 0.31 ships no Python reader of it.)"""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    position, block, pieces = 7, 32768, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if (length, kind) == (0, 0):  # zero padding up to the next block
            position += left
            continue
        pieces += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def name(item) -> str:
    """The key of a history or summary item: ``key``, or its ``nested_key`` path joined by "/"."""
    return item.key or "/".join(item.nested_key)


def wandb_runs(wandb_dir):
    """One dict per start of a script, in the order they ran: the run's id,
    config {flag: value}, rows [{key: value}] (history, in order) and summary."""
    found = []
    for folder in sorted((wandb_dir / "wandb").glob("offline-run-*")):
        (file,) = folder.glob("run-*.wandb")
        start = {"id": None, "config": {}, "rows": [], "summary": {}}
        for record in wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                start["id"] = record.run.run_id
                start["config"] = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "history":
                row = {name(item): json.loads(item.value_json) for item in record.history.item}
                assert row["_step"] == record.history.step.num
                start["rows"].append(row)
            elif kind == "summary":
                start["summary"].update({name(item): json.loads(item.value_json) for item in record.summary.update})
        assert file.name == f"run-{start['id']}.wandb"
        found.append(start)
    return found


def offline(tmp_path) -> dict:
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}


def metrics(path) -> tuple[dict, dict]:
    """(the last record of each epoch, the test record) of a --metrics_path file."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return ({r["epoch"]: r for r in records if "epoch" in r},
            next(r for r in records if "test_loss" in r))


FIGURES = ("train_loss", "val_loss", "lr", "samples_per_s", "epoch_seconds")


def test_a_run_logs_its_flags_each_epoch_and_the_test_figures_and_a_resume_goes_on_in_it(newcomer_walk):
    """docs/runs.md's two commands, offline (the newcomer's walk): one W&B run
    for both, the flags as its config, one row per epoch at step = epoch
    holding the figures of the epoch line, the test figures in each start's
    summary; the resumed start logs epochs 3 and 4 to the same run."""
    number = next(number for doc, number, block in walked_blocks()
                  if doc == "docs/runs.md" and "--wandb_project" in block)
    block = newcomer_walk.block("docs/runs.md", number)
    first, second = wandb_runs(newcomer_walk.saved("docs/runs.md", number, "wandb").parent)
    assert first["id"] == second["id"]
    for logged in (first, second):
        assert logged["config"]["wandb_project"] == "ladder" and logged["config"]["dataset"] == "synthetic"
        assert logged["config"]["world_size"] == 2
    assert (first["config"]["total_epochs"], second["config"]["total_epochs"]) == (2, 4)
    assert [row["_step"] for row in first["rows"] + second["rows"]] == [1, 2, 3, 4]
    for row, line in zip(first["rows"] + second["rows"], epochs(block.stdout)):
        assert row["epoch"] == line["epoch"]
        assert set(FIGURES) <= set(row)
        for key in ("train_loss", "val_loss", "lr"):
            assert row[key] == pytest.approx(line[key], abs=1e-6), key
        assert "val_accuracy" not in row  # None (regression) is left out
    tests = [float(loss) for loss in re.findall(r"^test \| loss (\S+)$", block.stdout, re.M)]
    assert [logged["summary"]["test_loss"] for logged in (first, second)] == pytest.approx(tests, abs=1e-6)


# DDP resumes at an epoch's end in docs/runs.md's commands (above); the W&B run's id comes from the
# snapshot alike inside an epoch.
@pytest.mark.parametrize("strategy, snapshot", [("fsdp", "snapshot_train_fsdp")])
def test_a_stopped_and_resumed_run_continues_the_same_wandb_run(strategy, snapshot, newcomer_walk, tmp_path,
                                                                 monkeypatch):
    """SIGTERM (a preemption, a requeue) stops the run inside an epoch after a
    snapshot; the same command resumes it. Both starts log to one W&B run,
    and between them every epoch once, with the figures the metrics file
    holds. --strategy fsdp ends its process with os._exit: the rows must
    be written all the same. Another run gets another W&B run."""
    for name, value in offline(tmp_path).items():
        monkeypatch.setenv(name, value)  # signal_when runs with this environment
    total = 3
    flags = ["--strategy", strategy, "--total_epochs", str(total),
             "--batch_size", "8", "--wandb_project", "ladder", "--metrics_path", "m.jsonl"]
    launch = PODS + ["--nproc_per_node=2", str(REPO / "train.py"), *flags]
    hold_env, held = held_at_step(150)  # epoch 2's 35th of 115 steps
    text = signal_when(PODS + ["--nproc_per_node=2", str(FAULTY_TRAIN), *flags], tmp_path,
                       held, signal.SIGTERM, **hold_env)
    assert text.count("stopped by SIGTERM") == 1 and "test | loss" not in text, text
    stopped_after = int(epochs(text)[-1]["epoch"])
    assert stopped_after < total
    resumed = check(run(launch, tmp_path))
    assert f"resuming from snapshot {snapshot}" in resumed.stdout

    first, second = wandb_runs(tmp_path)
    assert first["id"] == second["id"]
    assert [row["_step"] for row in first["rows"]] == list(range(1, stopped_after + 1))
    assert [row["_step"] for row in second["rows"]] == list(range(stopped_after + 1, total + 1))
    per_epoch, test = metrics(tmp_path / "m.jsonl")
    for row in first["rows"] + second["rows"]:
        assert {key: row[key] for key in FIGURES} == {key: per_epoch[row["epoch"]][key] for key in FIGURES}
    assert "test_loss" not in first["summary"] and second["summary"]["test_loss"] == test["test_loss"]
    assert second["config"]["world_size"] == 2
    number = next(number for doc, number, block in walked_blocks()
                  if doc == "docs/runs.md" and "--wandb_project" in block)
    (another, _) = wandb_runs(newcomer_walk.saved("docs/runs.md", number, "wandb").parent)
    assert another["id"] != first["id"]  # another run (docs/runs.md's), another W&B run


def test_a_snapshot_without_a_wandb_id_resumes_into_a_new_wandb_run(finished_run, tmp_path):
    """Snapshots written before the id was kept (a 1-epoch run's, that key
    removed) still resume; their run gets a fresh W&B run."""
    path = finished_run(tmp_path)
    snapshot = torch.load(path, weights_only=True)
    snapshot.pop("wandb_run_id", None)
    torch.save(snapshot, path)
    resumed = check(one_process(["--wandb_project", "ladder", "--total_epochs", "2"], tmp_path, **offline(tmp_path)))
    assert "resuming from snapshot snapshot_train.pt after epoch 1" in resumed.stdout
    (fresh,) = wandb_runs(tmp_path)
    assert fresh["id"] and [row["_step"] for row in fresh["rows"]] == [2]


def test_missing_wandb_is_one_line(tmp_path):
    """wandb is optional: without it --wandb_project stops before training, in one line."""
    result = one_process(["--wandb_project", "ladder"], tmp_path, **without_package(tmp_path, "wandb"))
    assert result.returncode != 0
    assert len(error_lines(result.stderr)) == 1, result.stderr
    assert "--wandb_project needs the wandb package" in result.stderr
    assert "pip install wandb, or leave the flag out" in result.stderr
    assert not epochs(result.stdout)


def test_no_wandb_login_stops_every_rank_before_training_in_one_line(tmp_path):
    """Online without an API key, wandb.init fails on rank 0: every rank stops
    before training, with one line that says what to do."""
    result = run(PODS + ["--nproc_per_node=2", REPO / "train.py",
                             "--wandb_project", "ladder"], tmp_path,
                 WANDB_MODE="online", WANDB_API_KEY="", HOME=str(tmp_path), WANDB_DIR=str(tmp_path),
                 NETRC=str(tmp_path / "netrc"))
    assert result.returncode != 0
    (line,) = error_lines(result.stderr)
    assert line.startswith("error: --wandb_project ladder: wandb could not start its run (")
    assert "run `wandb login` or set WANDB_API_KEY, or set WANDB_MODE=offline" in line
    assert not epochs(result.stdout) and not (tmp_path / "snapshot_train.pt").exists()
