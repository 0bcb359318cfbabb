"""Metrics people can use: JSON lines that say which run and when, and
TensorBoard curves that a killed and resumed run continues without
duplicated or missing points, read back with tensorboard's own reader."""

import json
import sys

import pytest

from helpers import FAULTY_TRAIN, REPO, TORCHRUN, check, epochs, error_lines, free_port, run, without_package


def test_tensorboard_and_metrics_continue_across_a_restart(tmp_path):
    """Rank 0 is killed in epoch 4, after epoch 3 was logged but with the
    last snapshot after epoch 2; torchrun restarts, the run resumes after
    epoch 2 and logs epochs 3 and 4 again. TensorBoard shows each epoch once,
    with the resumed run's values; the JSON lines mark the resumed records."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags = ["--total_epochs", "4", "--save_every", "2", "--tensorboard_dir", "tb",
             "--metrics_path", "m.jsonl"]
    # 2 ranks x 28 steps of 32 per epoch: step 89 is the 5th of epoch 4.
    result = check(run(TORCHRUN + ["--standalone", "--nproc_per_node=2", "--max-restarts=1",
                                   FAULTY_TRAIN, *flags], tmp_path,
                       DDP_TEST_FAULT="step:0:89:kill_once_saved"))
    assert "resuming from snapshot snapshot_train.pt after epoch 2" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    starts = [r for r in records if r.get("event") == "start"]
    assert [s["resumed_from"] for s in starts] == [None, "after epoch 2"]
    assert len({s["run"] for s in starts}) == 2
    # A start record's time is its run's start, before the first epoch it logged ended.
    for start in starts:
        first = next(r for r in records if r.get("run") == start["run"] and "epoch" in r)
        assert start["time"] < first["time"], (start, first)
    # Each rank's 922 samples make 28 full batches of 32; the last 26 are not trained.
    assert {r["samples"] for r in records if "epoch" in r} == {2 * 28 * 32}
    per_epoch = [(r["epoch"], r["resumed_from"]) for r in records if "epoch" in r]
    assert per_epoch == [(1, None), (2, None), (3, None), (3, "after epoch 2"), (4, "after epoch 2")]
    last = {r["epoch"]: r for r in records if "epoch" in r}  # the curve: the last record per epoch

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for tag, key in (("loss/train", "train_loss"), ("loss/val", "val_loss"), ("lr", "lr"),
                     ("speed/samples_per_s", "samples_per_s")):
        points = events.Scalars(tag)
        assert [p.step for p in points] == [1, 2, 3, 4], tag  # each epoch once
        assert [p.value for p in points] == pytest.approx([last[e][key] for e in (1, 2, 3, 4)],
                                                          rel=1e-6), tag
    assert [p.step for p in events.Scalars("loss/test")] == [4]


def test_missing_tensorboard_is_one_line(tmp_path):
    """tensorboard is optional: without it --tensorboard_dir stops at start, in one line."""
    # One process, given torchrun's variables by hand: its own exit status and stderr.
    one_process = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = run([sys.executable, REPO / "train.py", "--tensorboard_dir", "tb"], tmp_path,
                 **one_process, **without_package(tmp_path, "tensorboard"))
    assert result.returncode == 2
    assert error_lines(result.stderr) == [result.stderr.strip()]
    assert "--tensorboard_dir needs the tensorboard package" in result.stderr
    assert "pip install tensorboard" in result.stderr
    assert not epochs(result.stdout)
