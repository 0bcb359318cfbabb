"""Each script end to end from the command line, on the default synthetic task,
launched the way its docstring and the README say."""

import json
import socket
import sys

import pytest
import torch

from helpers import REPO, TORCHRUN, check, epochs, error_lines, free_port, parse_test, run, stdout_lines

LAUNCHES = {
    "singlegpu": lambda: [[sys.executable, REPO / "singlegpu.py"], {}],
    "spawn": lambda: [[sys.executable, REPO / "multigpu_spawn.py", "--world_size", "2"],
                      {"MASTER_PORT": str(free_port())}],
    "torchrun": lambda: [TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "multigpu_torchrun.py"], {}],
    "multinode": lambda: [TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "multinode.py"], {}],
}


@pytest.mark.parametrize("script", LAUNCHES)
def test_script_trains_synthetic_task(script, tmp_path):
    cmd, env = LAUNCHES[script]()
    result = check(run(cmd + ["--total_epochs", "6", "--save_every", "3",
                                       "--metrics_path", "metrics.jsonl"], tmp_path, **env))
    lines = epochs(result.stdout)
    assert [int(e["epoch"]) for e in lines] == [1, 2, 3, 4, 5, 6]
    # Loss falls clearly: Var(y) is about 1, the noise floor 0.01.
    assert lines[-1]["train_loss"] < 0.2 * lines[0]["train_loss"]
    assert lines[-1]["val_loss"] < 0.05
    assert parse_test(result.stdout)["loss"] < 0.05
    assert all(e["samples_per_s"] > 0 and e["epoch_s"] > 0 for e in lines)

    # The metrics file holds the same numbers, one JSON object per line.
    start, *records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert start["event"] == "start" and start["resumed_from"] is None
    assert [r["epoch"] for r in records[:-1]] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["test_loss"] == pytest.approx(parse_test(result.stdout)["loss"], abs=1e-6)
    for record, line in zip(records, lines):
        assert record["train_loss"] == pytest.approx(line["train_loss"], abs=1e-6)
        assert record["val_loss"] == pytest.approx(line["val_loss"], abs=1e-6)
        assert record["val_accuracy"] is None  # regression: no accuracy

    # Only rank 0 prints the summary: one line per epoch, not one per rank.
    assert result.stdout.count("test | loss") == 1
    # The first line says what runs where.
    world_size, backend = (1, "none") if script == "singlegpu" else (2, "gloo")
    assert stdout_lines(result.stdout)[0] == (
        f"device cpu | backend {backend} | world_size {world_size} | global batch size "
        f"{32 * world_size} = batch_size 32 x grad_accum_steps 1 x world_size {world_size}")

    # What was saved loads into a plain model (no DDP prefixes).
    import common
    saved = tmp_path / {"singlegpu": "checkpoint_singlegpu.pt", "spawn": "checkpoint_multigpu_spawn.pt",
                        "torchrun": "snapshot_multigpu_torchrun.pt", "multinode": "snapshot_multinode.pt"}[script]
    state = torch.load(saved, weights_only=True)
    model = common.synthetic_model("mlp")
    model.load_state_dict(state["model"] if "model" in state else state)
    if "epochs_run" in state:
        assert state["epochs_run"] == 6
        assert len(state["rng_states"]) == 2  # one per rank
        assert state["config"]["world_size"] == 2


def test_multinode_prints_one_line_per_rank_and_epoch(tmp_path):
    result = check(run(TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "multinode.py",
                                   "--total_epochs", "2", "--batch_size", "16"], tmp_path))
    for rank in (0, 1):
        for epoch in (1, 2):
            assert (f"[rank {rank} | local_rank {rank} | host " in result.stdout
                    and f"] epoch {epoch} | batch_size 16 | steps 57" in result.stdout), result.stdout
    # 1844 training samples -> 922 per rank -> 57 full batches of 16
    assert result.stdout.count("] epoch 1 | batch_size 16") == 2


def test_torchrun_script_refuses_plain_python(tmp_path):
    result = run([sys.executable, REPO / "multigpu_torchrun.py"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "torchrun" in result.stderr
    # The GPU command and, next to it, the one that works on a CPU; and srun's launch.
    assert "--nproc_per_node=gpu multigpu_torchrun.py; --nproc_per_node=2 on a CPU)" in result.stderr
    assert "or with srun, one task per GPU (srun --ntasks-per-node=GPUS python multigpu_torchrun.py)" \
        in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--total_epochs", "0"], "--total_epochs: must be > 0"),
    (["--batch_size", "-4"], "--batch_size: must be > 0"),
    (["--lr", "nan"], "--lr: must be > 0"),
    (["--save_every", "0"], "--save_every: must be > 0"),
    (["--dataset", "imagenet"], "invalid choice: 'imagenet'"),
])
def test_bad_flags_give_usage_error(flags, message, tmp_path):
    result = run([sys.executable, REPO / "singlegpu.py"] + flags, tmp_path)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_unknown_model_is_one_line(tmp_path):
    result = run([sys.executable, REPO / "singlegpu.py", "--model", "resnet18"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: --model resnet18 is not available for --dataset "
                                     "synthetic; choose one of mlp, linear")


def test_batch_larger_than_dataset_is_one_line(tmp_path):
    result = run([sys.executable, REPO / "singlegpu.py", "--batch_size", "5000"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: the training split gives each process 1844 samples")
    assert not (tmp_path / "checkpoint_singlegpu.pt").exists()


def test_missing_dataset_names_folder_files_and_fix(tmp_path):
    """No network here: the download fails, every rank stops, rank 0 says why in one line."""
    result = run(TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "multigpu_torchrun.py",
                             "--dataset", "mnist", "--data_dir", tmp_path / "nothing"], tmp_path,
                 timeout=120)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 1, result.stderr
    assert str(tmp_path / "nothing" / "MNIST" / "raw") in errors[0]
    assert "train-images-idx3-ubyte" in errors[0] and "Pre-stage" in errors[0]
    assert "Traceback (most recent call last)" not in result.stderr.split("error: ")[0]


def test_spawn_reports_busy_master_port(tmp_path):
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run([sys.executable, REPO / "multigpu_spawn.py"], tmp_path, MASTER_PORT=str(port))
    assert result.returncode != 0
    assert result.stderr.strip() == (
        f"error: MASTER_PORT {port} is already in use on this machine (another job?); set the "
        f"MASTER_PORT environment variable to a free port, e.g. MASTER_PORT={port + 1} "
        f"python multigpu_spawn.py")
