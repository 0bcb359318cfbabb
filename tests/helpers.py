"""Shared test helpers: run the scripts the way users do, parse their output,
read their snapshots, and build train.py's Trainer. Plain functions, no pytest
fixtures or hooks (those are in conftest.py); the datasets written in the real
on-disk formats are in dataset_files.py."""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # so tests can import common and the scripts

IN_CI = os.environ.get("CI", "").lower() == "true"

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the `torchrun` entry point

# train.py with a fault injected from the test side: launch it where train.py
# is launched, with the same arguments, and DDP_TEST_FAULT="POINT:RANK:N:ACTION"
# in the environment (its docstring says more). The kit holds no test hook, so
# a test that sets DDP_TEST_FAULT must launch this, not train.py.
FAULTY_TRAIN = REPO / "tests" / "train_with_fault.py"
# The same under a Slurm wrapper (or in a container that binds the project
# folder): slurm/env.sh runs $PROJECT/$SCRIPT_NAME (train.py by default), so a
# job given DDP_TEST_FAULT gets this in its environment too.
FAULTY_TRAIN_JOB_ENV = {"SCRIPT_NAME": str(FAULTY_TRAIN.relative_to(REPO))}

EPOCH_LINE = re.compile(
    r"^epoch (?P<epoch>\d+)/(?P<total>\d+) \| train_loss (?P<train_loss>\S+) \| "
    r"val_loss (?P<val_loss>\S+)(?: \| val_acc (?P<val_acc>\S+))? \| "
    r"samples/s (?P<samples_per_s>\S+)(?: \| tokens/s (?P<tokens_per_s>\S+))?"  # tokens: LM tasks
    r"(?: \| flop/s (?P<flop_per_s>\S+))?(?: \| mfu (?P<mfu>\S+))? \| epoch_s (?P<epoch_s>\S+)"
    r"(?: \| lr (?P<lr>\S+))?(?: \| skipped_steps (?P<skipped_steps>\d+))?"  # skipped: fp16 only
    r"(?: \| peak_mem_mib (?P<peak_mem_mib>\S+))?$", re.M)  # peak memory: CUDA only
TEST_LINE = re.compile(r"^test \| loss (?P<loss>\S+)(?: \| acc (?P<acc>\S+))?$", re.M)
# An evaluation's line under --eval_every_steps (train_utils.metrics.STEP_LINE_PARTS), as
# the tiny GPTs of the tests print it on a CPU: no val_acc, no mfu; no speed figures on an
# evaluation a resumed run redoes before training.
STEP_LINE = re.compile(
    r"^step (?P<step>\d+)/(?P<total_steps>\d+) \| epoch (?P<epoch>\d+)/(?P<total>\d+) \| "
    r"train_loss (?P<train_loss>\S+) \| val_loss (?P<val_loss>\S+) \| best_val_loss (?P<best_val_loss>\S+) \| "
    r"best_step (?P<best_step>\d+)(?: \| samples/s \S+ \| tokens/s \S+ \| flop/s \S+)? \| interval_s \S+ \| "
    r"lr (?P<lr>\S+)$", re.M)


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def without_package(folder: Path, name: str) -> dict:
    """Environment entries under which importing the package ``name`` raises
    ImportError, as where it is not installed: a stand-in package in
    ``folder``/shim, first on PYTHONPATH. Pass them to ``run``."""
    shim = folder / "shim" / name
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(f"raise ImportError(\"No module named '{name}'\")\n")
    return {"PYTHONPATH": str(folder / "shim")}


def run(cmd: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run a command as a user would; return it with stdout/stderr as text."""
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=script_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Assert exit status 0, showing the output tail when not."""
    assert result.returncode == 0, (
        f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}")
    return result


def epochs(stdout: str) -> list[dict]:
    """The epoch summary lines of a run, as dicts of floats."""
    return [{k: float(v) for k, v in m.groupdict().items() if v is not None}
            for m in EPOCH_LINE.finditer(stdout)]


def evaluations(stdout: str) -> list[dict]:
    """The evaluation lines of a run under --eval_every_steps, as dicts of their
    figures but for speed (strings as printed: equal lines, equal dicts)."""
    return [m.groupdict() for m in STEP_LINE.finditer(stdout)]


def parse_test(stdout: str) -> dict:
    m = TEST_LINE.search(stdout)
    assert m, f"no test line in:\n{stdout[-2000:]}"
    return {k: float(v) for k, v in m.groupdict().items() if v is not None}


def stdout_lines(stdout: str) -> list[str]:
    """A run's stdout lines, less gloo's "[Gloo] Rank 0 is connected to 1 peer
    ranks. Expected number of connected peer ranks is : 1" banner, which torch
    2.8 prints there in some cases, each rank in pieces: two ranks' banners can
    interleave into lines that start mid-banner, or leave an empty line."""
    return [line for line in stdout.splitlines()
            if line and "[Gloo] " not in line and "connected peer ranks is" not in line]


def error_lines(stderr: str) -> list[str]:
    """The scripts' one-line errors ("error: ...") in a run's stderr."""
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


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


def assert_same_snapshot(path_a: Path, path_b: Path) -> None:
    """Two snapshots hold the same training: epochs run, and weights, optimizer
    state, learning rates, schedule step and loss scale bitwise equal."""
    epochs_a, a = snapshot_tensors(path_a)
    epochs_b, b = snapshot_tensors(path_b)
    assert epochs_a == epochs_b
    assert a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


def signal_when(launch: list, cwd: Path, line, signum: int, start_s: float = 120,
                stop_s: float = 60, **env: str) -> str:
    """Run ``launch`` in ``cwd`` (stdout and stderr to cwd/log.txt; ``env``
    added to the environment), send it ``signum`` once ``line`` (a string, or
    a tuple of strings: all of them) appears in its output (within
    ``start_s`` seconds), wait up to ``stop_s`` seconds for it to end; return
    the whole log."""
    log = cwd / "log.txt"
    lines = (line,) if isinstance(line, str) else tuple(line)
    with open(log, "w") as out:
        agent = subprocess.Popen([str(part) for part in launch], cwd=cwd, env=script_env(**env),
                                 stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + start_s
            while not all(wanted in log.read_text() for wanted in lines):
                assert agent.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            agent.send_signal(signum)
            agent.wait(timeout=stop_s)
        finally:
            if agent.poll() is None:
                agent.kill()
    return log.read_text()


def held_at_step(step: int) -> tuple[dict, str]:
    """For ``signal_when``: the environment under which ``FAULTY_TRAIN`` (launch
    it, not train.py) holds rank 0 before its ``step``-th training step
    (micro-batches, counted from 1 over the run's first attempt) until a stop
    signal comes, and the line it prints there. A signal sent on that line
    lands mid-run however fast the machine trains, with rank 0 held and the
    other ranks already in that step, waiting for it in a collective: the
    ranks get the signal at different points and must still agree on one
    step to stop after."""
    return ({"DDP_TEST_FAULT": f"step:0:{step}:wait_signal_once"},
            f"DDP_TEST_FAULT: wait_signal_once at step {step} on rank 0")


def wrapper_snapshot(job_name: str, args: list = (), array_index=None) -> str:
    """The --snapshot_path a resumable Slurm wrapper gives a submission
    (slurm/stop_and_requeue.sh's snapshot_for): snapshot-<job name>[-<array
    index>][-<first 8 hex digits of the SHA-256 of the training arguments,
    each followed by a NUL byte>].pt."""
    name = f"snapshot-{job_name}" + (f"-{array_index}" if array_index is not None else "")
    if args:
        name += "-" + hashlib.sha256("".join(f"{arg}\0" for arg in args).encode()).hexdigest()[:8]
    return name + ".pt"


def run_together(cmds: list[list], cwds: list[Path], env: dict, timeout: float = 300) -> list[tuple]:
    """Start every command at once, each in its folder (torchrun agents of one
    job, say), wait for all; return (returncode, stdout, stderr) per command.
    On a timeout, kills those still running before raising."""
    procs = [subprocess.Popen([str(part) for part in cmd], cwd=cwd, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for cmd, cwd in zip(cmds, cwds)]
    outputs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            outputs.append((proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return outputs


def task_args(dataset: str, data_dir="data", input_path: str = "torchvision", seed: int = 0,
              model=None, **flags) -> argparse.Namespace:
    """The parsed command line a script would pass to ``common.load_task``
    (the task's fields), plus any other ``flags``."""
    return argparse.Namespace(dataset=dataset, data_dir=str(data_dir), input_path=input_path,
                              seed=seed, model=model, **flags)


def load_task(dataset: str, data_dir="data", input_path: str = "torchvision", seed: int = 0):
    """``common.load_task`` as a script calls it, without downloading (the
    per-sample torchvision path by default)."""
    import common

    return common.load_task(task_args(dataset, data_dir, input_path, seed), download=False)


def plain_task(loss_fn, classification: bool, model=None):
    """A ``common.Task`` with no data: a loss, whether it is a classification,
    and ``model`` (None unless given)."""
    import common

    return common.Task(None, None, None, model, loss_fn, classification)


def kit_trainer(model: torch.nn.Module, optimizer, loss_fn, out_dir: str, local_rank: int = 0,
                grad_accum_steps: int = 1, device: torch.device = torch.device("cpu"), amp=None,
                train_data=None, **recipe):
    """train.py's Trainer (DDP) around ``model`` on ``device`` (the CPU unless
    given), under --amp ``amp``, with no data (or ``train_data``, a loader of
    ``train.prepare_dataloader``'s making) and no snapshot to resume: for calling
    its ``_run_batch`` (or ``_run_epoch``) directly. Needs a process
    group (DDP wraps the model; the rank is the group's), ``local_rank`` this
    process's index on its node. ``optimizer``'s type and lr, ``grad_accum_steps``
    and ``recipe`` (recipe flags, e.g. ``clip_grad_norm=0.05``) are the run's flags.
    The snapshot path does not exist: its Checkpointer (not claimed) finds
    nothing to load. Raises AssertionError where train.Trainer takes a
    parameter this does not give."""
    import recipes
    import train
    import train_utils

    args = argparse.Namespace(
        strategy="ddp", grad_accum_steps=grad_accum_steps, amp=amp, compile=False, save_every=1,
        total_epochs=1, metrics_path=None, tensorboard_dir=None, wandb_project=None, profile_dir=None,
        snapshot_path=os.path.join(out_dir, "absent.pt"), snapshot_every_steps=0, snapshot_every_s=0,
        snapshot_sync=False, pg_timeout_s=600,
        **{**recipes.RECIPE_DEFAULTS, "lr": optimizer.param_groups[0]["lr"], "clip_grad_norm": None,
           "optimizer": type(optimizer).__name__.lower(), **recipe})
    checkpointer = train_utils.Checkpointer(args.snapshot_path, False, asynchronous=not args.snapshot_sync,
                                            every_s=args.snapshot_every_s, every_steps=args.snapshot_every_steps,
                                            timeout_s=args.pg_timeout_s)
    available = dict(task=plain_task(loss_fn, False, model), train_data=train_data, val_data=None,
                     recipe=train_utils.Recipe(optimizer, args, steps_per_epoch=1, device=device),
                     checkpointer=checkpointer, log=train_utils.RunLog(args), device=device,
                     local_rank=local_rank, args=args)
    parameters = inspect.signature(train.Trainer).parameters
    missing = [name for name in parameters if name not in available]
    assert not missing, f"train.Trainer takes {missing}, which kit_trainer does not give"
    return train.Trainer(**available)


# Sharded (FSDP) snapshots, gathered for comparison

def snapshot_folder(root) -> str:
    """The one snapshot folder a finished run leaves under ``root`` (older ones are removed)."""
    folders = sorted(os.listdir(root))
    assert len(folders) == 1, folders
    return os.path.join(root, folders[0])


def full_state(folder, out_dir) -> tuple[dict, dict]:
    """(weights, everything) of a sharded snapshot folder, gathered into plain tensors with
    DCP's converter: model state_dict, momentum buffers ("optimizer.<name>") or other
    optimizer state ("optimizer.<name>.<key>"), and from its meta file every rank's CPU
    RNG state ("rng.<rank>"), the lr schedule's step and the loss scaler's state."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from train_utils.sharded_snapshots import ShardedSnapshots

    os.makedirs(out_dir, exist_ok=True)
    for part in ("model", "optimizer"):
        dcp_to_torch_save(os.path.join(folder, part), os.path.join(out_dir, f"{part}.pt"))
    weights = torch.load(os.path.join(out_dir, "model.pt"), weights_only=True)
    optimizer = torch.load(os.path.join(out_dir, "optimizer.pt"), weights_only=True)
    meta = torch.load(os.path.join(folder, ShardedSnapshots.META), weights_only=True)
    tensors = dict(weights)
    for name, state in optimizer["state"].items():
        for key, value in state.items():  # SGD's momentum_buffer; AdamW's exp_avg, exp_avg_sq, step
            tensors[f"optimizer.{name}" + ("" if key == "momentum_buffer" else f".{key}")] = torch.as_tensor(value)
    for rank, states in enumerate(meta["rng_states"]):
        tensors[f"rng.{rank}"] = states["cpu"]
    tensors["position"] = torch.tensor([meta["epochs_run"], meta["steps_run"]])
    tensors["lr_schedule.step"] = torch.tensor(meta["lr_schedule"]["last_epoch"])
    for key, value in (meta["loss_scaler"] or {}).items():
        tensors[f"loss_scaler.{key}"] = torch.as_tensor(value)
    return weights, tensors


def assert_bitwise(a: dict, b: dict) -> None:
    """Two ``full_state`` dicts hold the same names and bitwise equal tensors."""
    assert a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


# A small evaluation problem, for the tests of sharded evaluation (DDP's and FSDP's)

N_EVAL = 97  # divisible by neither 2 nor 3 nor the batch size


class BatchNormClassifier(torch.nn.Module):
    """A linear classifier behind a BatchNorm, whose running statistics a
    test sets, as they differ per rank after training."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(5)
        self.fc = torch.nn.Linear(5, 4)

    def forward(self, x):
        return self.fc(self.norm(x))


def eval_problem():
    """(``N_EVAL`` samples of 5 features in 4 classes, a BatchNormClassifier
    with set BatchNorm statistics), the same at every call."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N_EVAL, 5, generator=g)
    y = torch.randint(0, 4, (N_EVAL,), generator=g)
    torch.manual_seed(3)
    model = BatchNormClassifier()
    model.norm.running_mean.copy_(torch.randn(5, generator=g))
    model.norm.running_var.copy_(torch.rand(5, generator=g) + 0.5)
    return torch.utils.data.TensorDataset(x, y), model
