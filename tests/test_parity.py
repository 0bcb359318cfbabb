"""The kit is the lesson plus machinery, never another algorithm: for the same
flags, world size (2) and seed, the FSDP rung prints the per-epoch train and
validation losses and accuracy that ``train.py --strategy fsdp`` prints,
digit for digit, on real MNIST digits with the task's default recipe: the
CNN's dropout draws from each rank's stream (seeded seed + rank once the
model is built, the same lines in every rung from step 2 on) and the fast
input path's batches. (Every rung on the synthetic task, against the kit's
DDP or FSDP: tests/test_ladder.py, on the README's own steps.)"""

import pytest
import torch

from dataset_files import build_mnist_root
from helpers import REPO, TORCHRUN, check, run

RUNGS = {"multinode_fsdp.py": "fsdp"}  # each rung and the kit's --strategy
# Few epochs, small: MNIST (2,500 real digits) for 1 epoch of 64 a step and process, a
# few seconds of training.
FLAGS = ["--dataset", "mnist", "--total_epochs", "1", "--batch_size", "64"]
ENV = {"OMP_NUM_THREADS": "1"}  # what torchrun sets for 2 processes, whatever the environment holds


def epoch_losses(stdout: str) -> list[str]:
    """Each epoch line's 'epoch E/N | train_loss X | val_loss Y[ | val_acc Z]' part, as printed."""
    found = []
    for line in stdout.splitlines():
        if line.startswith("epoch ") and " | train_loss " in line:
            parts = line.split(" | ")
            found.append(" | ".join(part for part in parts if part.split(" ")[0] in
                                    ("epoch", "train_loss", "val_loss", "val_acc")))
    return found


@pytest.fixture(scope="module")
def parity_mnist(tmp_path_factory) -> list:
    """--data_dir of 2,000 real digits to train, 500 held out."""
    return ["--data_dir", str(build_mnist_root(tmp_path_factory.mktemp("parity_mnist"), n_train=2000, n_test=500))]


@pytest.mark.parametrize("script", RUNGS)
def test_rung_prints_the_losses_the_kit_prints(script, kit_run, parity_mnist, tmp_path):
    if RUNGS[script] == "fsdp" and not torch.cuda.is_available() and torch.__version__ < "2.10":
        pytest.skip("FSDP on the CPU needs torch 2.10 (gloo's reduce_scatter sums before): the rung is not run, "
                    "train.py refuses")
    launch = TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / script]
    rung = epoch_losses(check(run(launch + FLAGS + parity_mnist, tmp_path, **ENV)).stdout)
    assert len(rung) == 1 and rung == epoch_losses(kit_run(RUNGS[script], *FLAGS, *parity_mnist)[1])
