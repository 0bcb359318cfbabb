"""The kit is the lesson plus machinery, never another algorithm: for the same
flags, world size (2) and seed, the first DDP rung prints the per-epoch train
and validation losses (and accuracy) that ``train.py`` prints, and the FSDP
rung those of ``train.py --strategy fsdp``, digit for digit, on real MNIST
digits, each with its task's default recipe. (Every rung on the synthetic
task: tests/test_ladder.py, in the same run that checks it stands alone.)"""

import sys

import pytest
import torch

from dataset_files import build_mnist_root
from helpers import REPO, TORCHRUN, check, free_port, run

RUNGS = {"multigpu_spawn.py": "ddp", "multinode_fsdp.py": "fsdp"}  # each rung and the kit's --strategy
# Few epochs, small: MNIST (2,500 real digits) for 1 epoch of 64 a step and process, a
# few seconds of training.
FLAGS = ["--dataset", "mnist", "--total_epochs", "1", "--batch_size", "64"]
ENV = {"OMP_NUM_THREADS": "1"}  # what torchrun sets for 2 processes; mp.spawn sets nothing


def epoch_losses(stdout: str) -> list[str]:
    """Each epoch line's 'epoch E/N | train_loss X | val_loss Y[ | val_acc Z]' part, as printed."""
    found = []
    for line in stdout.splitlines():
        if line.startswith("epoch ") and " | train_loss " in line:
            parts = line.split(" | ")
            found.append(" | ".join(part for part in parts if part.split(" ")[0] in
                                    ("epoch", "train_loss", "val_loss", "val_acc")))
    return found


def launch(script: str) -> tuple[list, dict]:
    if script == "multigpu_spawn.py":
        return [sys.executable, REPO / script, "--world_size", "2"], dict(ENV, MASTER_PORT=str(free_port()))
    return TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / script], ENV


@pytest.fixture(scope="module")
def parity_mnist(tmp_path_factory) -> list:
    """--data_dir of 2,000 real digits to train, 500 held out."""
    return ["--data_dir", str(build_mnist_root(tmp_path_factory.mktemp("parity_mnist"), n_train=2000, n_test=500))]


# The first DDP rung and the FSDP rung (rungs 3 and 4 feed the same digits to the same DDP
# arithmetic as rung 2, launched as on the synthetic task in tests/test_ladder.py).
@pytest.mark.parametrize("script", RUNGS)
def test_rung_prints_the_losses_the_kit_prints(script, kit_run, parity_mnist, tmp_path):
    if RUNGS[script] == "fsdp" and not torch.cuda.is_available() and torch.__version__ < "2.10":
        pytest.skip("FSDP on the CPU needs torch 2.10 (gloo's reduce_scatter sums before): the rung is not run, "
                    "train.py refuses")
    cmd, env = launch(script)
    rung = epoch_losses(check(run(cmd + FLAGS + parity_mnist, tmp_path, **env)).stdout)
    assert len(rung) == 1 and rung == epoch_losses(kit_run(RUNGS[script], *FLAGS, *parity_mnist)[1])
