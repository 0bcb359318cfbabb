"""train.py --plan NODESxPROCS: a job's run checked in one process (fake
process group, the model on the meta device), as users run it: GPT-2 small
on 8 nodes x 8 under HSDP; the training state per rank exactly as the real
run's memory line prints it (a 2-rank FSDP run of a tiny GPT with AdamW,
shared with tests/test_token_files.py); the resume line of a snapshot at
another world size, as the real resumed run prints it (tests/test_fsdp.py);
a plan the run would refuse ends in its one line; nothing is written."""

import os
import sys
import time

import numpy as np
import pytest

from helpers import REPO, run, stdout_lines, tiny_gpt_run
import test_fsdp
from test_fsdp import MEMORY_LINE, expected_state_bytes

import common

TRAIN = REPO / "train.py"
pytestmark = test_fsdp.pytestmark  # FSDP on gloo: torch 2.10
GPT2_SMALL = ["--n_layer", "12", "--n_head", "12", "--n_embd", "768", "--block_size", "1024"]


def plan(folder, *flags):
    """``python train.py --plan ...`` in ``folder``, one process as a user runs it."""
    return run([sys.executable, TRAIN, "--plan", *map(str, flags)], folder)


def files_in(folder) -> dict:
    """{path: (size, mtime)} of everything under ``folder``."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_plan_of_gpt2_small_on_8_nodes_of_8_under_hsdp(tmp_path):
    """GPT-2 small (124 M parameters) as 64 ranks, HSDP over 8 nodes: the mesh
    a node's 8 ranks per replica, the global batch, 1/8 of the training state
    per rank, a peak estimate, the launch lines; the token files (4 M random
    GPT-2 ids, made here) and the folder untouched."""
    data = tmp_path / "tokens"
    data.mkdir()
    ids = np.random.default_rng(0).integers(0, 50257, size=4_000_000, dtype=np.uint16)
    ids.tofile(data / "train.bin")
    ids[:50_000].tofile(data / "val.bin")
    before = files_in(tmp_path)
    started = time.perf_counter()
    result = plan(tmp_path, "8x8", "--strategy", "hsdp", "--dataset", "tokens", "--data_dir", data, *GPT2_SMALL,
                  "--batch_size", 12, "--global_batch_size", 1536, "--amp", "bf16")
    print(f"GPT-2 small --plan 8x8 HSDP: {time.perf_counter() - started:.1f} s wall\n{result.stdout}")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = stdout_lines(result.stdout)
    assert lines[0] == ("plan: 8 nodes x 8 processes = world_size 64 | strategy hsdp | mesh HSDP replicate 8 x "
                        "shard 8 | amp bf16")
    assert lines[1].startswith("global batch size 1536 = batch_size 12 x grad_accum_steps 2 x world_size 64 | "
                               "steps per epoch 2 |")  # 3,906 windows of 1,024: 62 per rank, 5 batches
    assert "model: 124,373,760 parameters" in lines
    memory = MEMORY_LINE.search(result.stdout).groupdict()
    # fp32 parameters, gradients and AdamW's two moments, each rank 1/8 of every one (all divide by 8 but the
    # 1-D ones, padded), plus AdamW's 0-dim step per parameter; DDP holds the full size of each.
    assert (memory["rank"], memory["world"], float(memory["ratio"])) == ("0", "64", 8.0)
    assert 124_373_760 * 16 / 8 < int(memory["bytes"]) < 124_373_760 * 16 / 8 * 1.001
    assert any(line.startswith("peak memory per rank (estimate): ") for line in lines)
    assert "starts afresh: no snapshot at --snapshot_path snapshot_train_fsdp" in lines
    assert any(line.strip().startswith("torchrun --nnodes=8 --nproc_per_node=8 ") for line in lines)
    assert any(line.strip().startswith("sbatch --nodes=8 --gres=gpu:8 slurm/multi_node.sh --strategy hsdp")
               for line in lines)
    assert files_in(tmp_path) == before


def test_plan_prints_the_real_runs_state_per_rank(kit_run, tiny_corpus, tmp_path):
    """--plan 1x2 with the flags of a real 2-rank FSDP run of a tiny GPT
    (AdamW: two moments and a step tensor per parameter; shapes that 2 does
    not all divide) prints the very memory line that run printed."""
    flags = [*tiny_gpt_run("tokens", tiny_corpus["tokens"]), "--strategy", "fsdp"]
    _, real = kit_run("fsdp", *tiny_gpt_run("tokens", tiny_corpus["tokens"]))
    result = plan(tmp_path, "1x2", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    real_line = MEMORY_LINE.search(real).group(0)
    assert MEMORY_LINE.search(result.stdout).group(0) == real_line, result.stdout
    assert not os.listdir(tmp_path)  # no snapshot, no claim, no metrics file


def test_plan_reads_the_snapshot_it_would_resume(finished_run, tmp_path):
    """A 2-rank FSDP snapshot after epoch 1 (synthetic MLP), planned for 3
    ranks: the resume line the real resumed run prints (tests/test_fsdp.py's
    test_resume_with_another_world_size), the state per rank of 3 uneven
    shards as computed from the shapes, and the snapshot untouched."""
    snapshot = finished_run(tmp_path, "snapshot_train_fsdp", strategy="fsdp")
    (snapshot / "epoch-0-step-3").mkdir()  # an incomplete folder: the real run deletes it, a plan leaves it
    before = files_in(tmp_path)
    result = plan(tmp_path, "1x3", "--strategy", "fsdp", "--total_epochs", 2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("resuming from snapshot snapshot_train_fsdp/epoch-1 after epoch 1 (saved by world_size 2, "
            "resharded to 3: weights and optimizer state exact; global batch size 64 -> 96 at the same --lr, "
            "steps per epoch 28 -> 19; random streams restored on ranks 0-1, rank 2 starts from its "
            "seed)") in stdout_lines(result.stdout), result.stdout
    memory = MEMORY_LINE.search(result.stdout).groupdict()
    assert (int(memory["bytes"]), int(memory["ddp"])) == expected_state_bytes(common.synthetic_model("mlp"), 3)
    assert files_in(tmp_path) == before
    # Asked for no more epochs than it holds: the finished run's line.
    done = plan(tmp_path, "1x2", "--strategy", "fsdp", "--total_epochs", 1)
    assert done.returncode == 0 and "nothing to train" in done.stdout, done.stdout


@pytest.mark.parametrize("flags, line", [
    (["8x8", "--global_batch_size", 500], "error: --global_batch_size 500 is not a multiple of --batch_size 32 x "
                                          "world_size 64 = 2048;"),
    (["2x4", "--strategy", "hsdp", "--shard_size", 3], "error: --shard_size 3 does not divide world_size 8;"),
    (["8y8"], "train.py: error: --plan takes NODESxPROCS, e.g. --plan 8x8 for 8 nodes of 8 processes, got '8y8'"),
])
def test_a_plan_that_cannot_run_ends_in_one_line(flags, line, tmp_path):
    """What the real run refuses (its own configuration's checks), the plan
    refuses with the same one line, exit status 2, writing nothing."""
    result = plan(tmp_path, *flags)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith(line), result.stderr
    assert not os.listdir(tmp_path)
