"""The kit is the lesson plus machinery, never another algorithm: for the same
flags, world size (2) and seed, rungs 2-4 print the per-epoch train and
validation losses that ``train.py`` (DDP) prints, and the FSDP rung those of
``train.py --strategy fsdp``, digit for digit, on the synthetic task (and
rungs 2 and 5 on real MNIST digits too), each with its task's default recipe."""

import sys

import pytest
import torch

from dataset_files import build_mnist_root
from helpers import REPO, TORCHRUN, check, free_port, run

RUNGS = {"multigpu_spawn.py": "ddp", "multigpu_torchrun.py": "ddp", "multinode.py": "ddp",
         "multinode_fsdp.py": "fsdp"}
# Few epochs, small: the synthetic task for 3 epochs; MNIST (2,500 real digits) for 1
# epoch of 64 a step and process, a few seconds of training.
FLAGS = {"synthetic": ["--total_epochs", "3", "--seed", "3"],
         "mnist": ["--dataset", "mnist", "--total_epochs", "1", "--batch_size", "64"]}
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
def parity_mnist(tmp_path_factory):
    """2,000 real digits to train, 500 held out."""
    return build_mnist_root(tmp_path_factory.mktemp("parity_mnist"), n_train=2000, n_test=500)


@pytest.fixture(scope="module")
def data_flags(request):
    """--data_dir for MNIST (parity_mnist, made when first asked for); none for the synthetic task."""
    def flags(dataset: str) -> list:
        if dataset == "mnist":
            return ["--data_dir", str(request.getfixturevalue("parity_mnist"))]
        return []
    return flags


@pytest.fixture(scope="module")
def kit_losses(tmp_path_factory, data_flags):
    """train.py's epoch losses per (dataset, strategy), each run once."""
    cache = {}

    def losses(dataset: str, strategy: str) -> list[str]:
        if (dataset, strategy) not in cache:
            folder = tmp_path_factory.mktemp(f"kit-{dataset}-{strategy}")
            cmd = TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "train.py", "--strategy", strategy]
            result = check(run(cmd + FLAGS[dataset] + data_flags(dataset), folder, **ENV))
            cache[dataset, strategy] = epoch_losses(result.stdout)
        return cache[dataset, strategy]
    return losses


# Every rung on the synthetic task; on MNIST the first DDP rung and the FSDP rung (rungs 3
# and 4 feed the same digits to the same DDP arithmetic as rung 2, launched as on the
# synthetic task).
CASES = [(script, "synthetic") for script in RUNGS] + [("multigpu_spawn.py", "mnist"),
                                                         ("multinode_fsdp.py", "mnist")]


@pytest.mark.parametrize("script,dataset", CASES)
def test_rung_prints_the_losses_the_kit_prints(script, dataset, kit_losses, data_flags, tmp_path):
    if RUNGS[script] == "fsdp" and not torch.cuda.is_available() and torch.__version__ < "2.10":
        pytest.skip("FSDP on the CPU needs torch 2.10 (gloo's reduce_scatter sums before): both refuse")
    cmd, env = launch(script)
    result = check(run(cmd + FLAGS[dataset] + data_flags(dataset), tmp_path, **env))
    rung = epoch_losses(result.stdout)
    expected = kit_losses(dataset, RUNGS[script])
    assert len(rung) == int(FLAGS[dataset][FLAGS[dataset].index("--total_epochs") + 1]), result.stdout
    assert rung == expected
