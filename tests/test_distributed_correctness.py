"""The distributed logic is exact, not approximately right: DDP equals a single
process with the global batch (the spawn rung's lesson), sharded evaluation
equals a single process's (the spawn rung and the kit), and the kit resumes
bitwise from a snapshot. (Rungs 3-5 resume at an epoch's end: test_ladder.py;
they compute what the kit computes: test_parity.py.)"""

import os
import re
import sys

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from helpers import N_EVAL, README, REPO, plain_task, PODS, check, error_lines, eval_problem, free_port, run, snapshot_tensors

import common
import multigpu_spawn
import singlegpu
import train
from train_utils.distributed.devices import torch_version
from train_utils.distributed.fsdp import GLOO_AVG_REDUCE_SCATTER
from train_utils.ending import end_process


def _weights(path):
    state = torch.load(path, weights_only=True)
    return state["model"] if "model" in state else state


# --------------------------------------------------------------------------
# 4. DDP parity: 2 processes x batch B == 1 process x batch 2B
# --------------------------------------------------------------------------

def test_ddp_matches_single_process_with_the_global_batch(tmp_path):
    """DistributedSampler splits each global batch of the one-process run between
    the two ranks, and DDP averages their gradients, so after every SGD step
    (here 2 epochs x 115 steps) the weights agree up to float rounding."""
    finals = {}
    for world_size, batch_size in ((1, 16), (2, 8)):
        out = tmp_path / f"w{world_size}"
        out.mkdir()
        common_flags = ["--total_epochs", "2", "--batch_size", str(batch_size)]
        cmd = [sys.executable, REPO / "multigpu_spawn.py", "--world_size", str(world_size)]
        check(run(cmd + common_flags, out, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1"))
        finals[world_size] = _weights(out / "checkpoint_multigpu_spawn.pt")
    assert finals[1].keys() == finals[2].keys()
    start = singlegpu.common.synthetic_model("mlp").state_dict()
    for name in finals[1]:
        difference = (finals[1][name] - finals[2][name]).abs().max().item()
        assert difference <= 1e-5, (name, difference)
        # ...and training did move them, so the comparison means something
        assert not torch.allclose(finals[1][name], start[name], atol=1e-3)


# --------------------------------------------------------------------------
# 5. Exact evaluation over uneven shards
# --------------------------------------------------------------------------



def _eval_worker(rank, world_size, port, out_dir):
    """Each way of evaluating over a process group, on the same problem: the
    rungs' (multigpu_spawn.evaluate), the kit's (train.evaluate), and the
    kit's over an FSDP-sharded copy of the model (torch 2.10 on gloo)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    import train_utils

    results = {}
    for way in EVALUATIONS:
        dataset, model = eval_problem()
        if rank != 0:  # other ranks drifted; rank 0's buffers are the ones saved
            model.norm.running_mean.add_(rank)
        if way == "spawn":  # the rungs 2-4 share this code; the kit has its own
            loader = multigpu_spawn.prepare_dataloader(dataset, 8, False, 0, common.collate)
            scores = multigpu_spawn.evaluate(model, loader, plain_task(F.cross_entropy, True), torch.device("cpu"))
        else:
            loader = train.prepare_dataloader(dataset, 8, 0, False, 0, common.collate)
            if way == "train fsdp":
                if FSDP_TOO_OLD:
                    continue
                model = train_utils.shard_model(model, torch.device("cpu"), dtype=None)
            scores = train.evaluate(model, loader, plain_task(F.cross_entropy, True), torch.device("cpu"),
                                    fsdp=way == "train fsdp")
        results[way] = {"scores": scores, "counted": sum(len(y) for _, y in loader), "batches": len(loader)}
    torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
    end_process(0)  # as train.py's runs end: the process group destroyed; FSDP: no interpreter teardown


EVALUATIONS = ("spawn", "train", "train fsdp")
FSDP_TOO_OLD = torch_version() < GLOO_AVG_REDUCE_SCATTER


def test_sharded_evaluation_equals_single_process(tmp_path):
    """97 samples over 2 ranks, batch 8: shards of 49 and 48 (7 and 6
    batches), each sample counted once, no padding; the rungs', the kit's
    and the kit's FSDP evaluation (where the rank with fewer batches runs
    extra forwards, counted nowhere, to join the others' all-gathers) return
    on every rank the single-process loss and accuracy of rank 0's model."""
    world_size = 2
    dataset, model = eval_problem()
    loader = singlegpu.prepare_dataloader(dataset, 8, False, 0, common.collate)
    expected_loss, expected_accuracy = singlegpu.evaluate(model, loader, plain_task(F.cross_entropy, True),
                                                          torch.device("cpu"))
    # Cross-check the reference itself against a plain full-batch computation.
    with torch.no_grad():
        model.eval()
        logits = model(dataset.tensors[0])
    assert expected_loss == pytest.approx(F.cross_entropy(logits, dataset.tensors[1]).item(), abs=1e-6)
    assert expected_accuracy == (logits.argmax(1) == dataset.tensors[1]).sum().item() / N_EVAL

    mp.spawn(_eval_worker, args=(world_size, free_port(), str(tmp_path)), nprocs=world_size)
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(world_size)]
    ways = [way for way in EVALUATIONS if not (way == "train fsdp" and FSDP_TOO_OLD)]
    for way in ways:
        assert sum(r[way]["counted"] for r in results) == N_EVAL, way  # every sample once: no padding
        assert len({r[way]["batches"] for r in results}) == 2, way  # uneven shards
        for r in results:  # every rank returns the same, exact values
            loss, accuracy = r[way]["scores"]
            assert abs(loss - expected_loss) <= 1e-6 and abs(accuracy - expected_accuracy) <= 1e-6, way


# --------------------------------------------------------------------------
# 6. The kit's resume from a snapshot == an uninterrupted run, bitwise
# --------------------------------------------------------------------------

def test_resume_equals_uninterrupted_run(newcomer_walk, kit_run):
    """train.py stopped after epoch 2, started again asking for 4 (the README's
    block, in the newcomer's walk): the result is bitwise the 4-epoch run's
    (weights, optimizer, every rank's RNG state). A model with dropout, which
    needs those RNG states, resumes bitwise in test_fault_tolerance.py's
    killed-worker test (MNIST's CNN, mid-epoch)."""
    number = next(number for number, block in enumerate(re.findall(r"```bash\n(.*?)```", README.read_text(), re.S))
                  if "train.py --total_epochs 2" in block)
    block = newcomer_walk.block("README.md", number)
    first, second = block.stdout.split("\ndevice ")[:2] if block.stdout.startswith("device ") else (None, None)
    assert first is not None and "resuming" not in first, block.stdout
    assert "resuming from snapshot snapshot_train.pt after epoch 2" in second
    assert "epoch 1/4" not in second and "epoch 3/4" in second

    straight_folder, _ = kit_run("ddp", "--total_epochs", 4)  # the same run, never stopped
    epochs_a, straight = snapshot_tensors(straight_folder / "snapshot_train.pt", rng=True)
    epochs_b, resumed = snapshot_tensors(newcomer_walk.saved("README.md", number, "snapshot_train.pt"), rng=True)
    assert epochs_a == epochs_b == 4
    assert straight.keys() == resumed.keys()
    unequal = [name for name in straight if not torch.equal(straight[name], resumed[name])]
    assert not unequal


def test_resume_refuses_a_snapshot_from_another_run(finished_run, tmp_path):
    launch = PODS + ["--nproc_per_node=2", REPO / "train.py"]
    finished_run(tmp_path)  # train.py --total_epochs 1, every other default
    before = (tmp_path / "snapshot_train.pt").read_bytes()
    result = run(launch + ["--total_epochs", "2", "--batch_size", "64", "--model", "linear"], tmp_path)
    assert result.returncode != 0
    assert error_lines(result.stderr) == [
        "error: snapshot snapshot_train.pt comes from a different run (model mlp -> linear, "
        "batch_size 32 -> 64); resume with its settings, or delete it or pass another --snapshot_path to start afresh"]
    assert (tmp_path / "snapshot_train.pt").read_bytes() == before  # untouched
