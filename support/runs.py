"""Running the scripts as a user does, and reading what they print and save:
what the tests and the benchmarks both need."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch

from .ports import free_port  # noqa: F401 - the tests and the benchmark take it from here

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the `torchrun` entry point
# Each rank its own process with the plain environment, as a Kubernetes Job's
# pods (support/pods.py): where the launcher is not what a run tests, it
# saves torchrun's agent (about 2 CPU-seconds a start). PODS + ["--nproc_per_node=2", script, *flags].
PODS = [sys.executable, str(REPO / "support" / "pods.py")]

EPOCH_LINE = re.compile(
    r"^epoch (?P<epoch>\d+)/(?P<total>\d+) \| train_loss (?P<train_loss>\S+) \| "
    r"val_loss (?P<val_loss>\S+)(?: \| val_acc (?P<val_acc>\S+))? \| "
    r"samples/s (?P<samples_per_s>\S+)(?: \| tokens/s (?P<tokens_per_s>\S+))?"  # tokens: LM tasks
    r"(?: \| flop/s (?P<flop_per_s>\S+))?(?: \| mfu (?P<mfu>\S+))? \| epoch_s (?P<epoch_s>\S+)"
    r"(?: \| lr (?P<lr>\S+))?(?: \| skipped_steps (?P<skipped_steps>\d+))?"  # skipped: fp16 only
    r"(?: \| peak_mem_mib (?P<peak_mem_mib>\S+))?$", re.M)  # peak memory: CUDA only


# What a launcher (torchrun, srun) tells a script; a test's scripts never
# inherit them from the environment pytest runs in.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RESTART_COUNT", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID")


def script_env(**extra: str) -> dict:
    """This environment without inherited launcher variables, then ``extra``
    (a test's own MASTER_PORT, say, survives)."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def epochs(stdout: str) -> list[dict]:
    """The epoch summary lines of a run, as dicts of floats."""
    return [{k: float(v) for k, v in m.groupdict().items() if v is not None}
            for m in EPOCH_LINE.finditer(stdout)]


def snapshot_tensors(path: Path, rng: bool = False) -> tuple[int, dict]:
    """(epochs_run, {name: tensor}) of a snapshot: model weights, the
    optimizer's state (SGD's momentum buffers, AdamW's moments and step
    counts, ...), the learning rate of each parameter group, the lr schedule's
    and the loss scaler's state, and with ``rng`` every rank's CPU RNG state."""
    snapshot = torch.load(path, weights_only=True)
    tensors = dict(snapshot["model"])
    for key, state in snapshot["optimizer"]["state"].items():
        for name, value in state.items():
            tensors[f"optimizer.{key}.{name}"] = torch.as_tensor(value)
    for index, group in enumerate(snapshot["optimizer"]["param_groups"]):
        tensors[f"optimizer.lr.{index}"] = torch.tensor(group["lr"], dtype=torch.float64)
    schedule = snapshot.get("lr_schedule") or {}
    tensors["lr_schedule.step"] = torch.tensor(schedule.get("last_epoch", -1))
    for name, value in (snapshot.get("loss_scaler") or {}).items():
        tensors[f"loss_scaler.{name}"] = torch.as_tensor(value)
    if rng:
        for rank, states in enumerate(snapshot["rng_states"]):
            tensors[f"rng.{rank}"] = states["cpu"]
    return snapshot["epochs_run"], tensors
