"""Shared test helpers: run the scripts the way users do, parse their output,
and build small datasets in the real on-disk formats torchvision reads."""

from __future__ import annotations

import argparse
import gzip
import os
import pickle
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # so tests can import common and the scripts

# The real MNIST test set (10,000 digits) lives beside the project; see its README.
MNIST_T10K = Path(os.environ.get("MNIST_T10K_DIR", REPO.parent / "shared" / "data" / "mnist-t10k"))
IN_CI = os.environ.get("CI", "").lower() == "true"

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the `torchrun` entry point

EPOCH_LINE = re.compile(
    r"^epoch (?P<epoch>\d+)/(?P<total>\d+) \| train_loss (?P<train_loss>\S+) \| "
    r"val_loss (?P<val_loss>\S+)(?: \| val_acc (?P<val_acc>\S+))? \| "
    r"samples/s (?P<samples_per_s>\S+) \| epoch_s (?P<epoch_s>\S+)"
    r"(?: \| peak_mem_mib (?P<peak_mem_mib>\S+))?$", re.M)  # peak memory: CUDA only
TEST_LINE = re.compile(r"^test \| loss (?P<loss>\S+)(?: \| acc (?P<acc>\S+))?$", re.M)


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
    """(epochs_run, {name: tensor}) of a snapshot: model weights, momentum
    buffers and, with ``rng``, every rank's CPU RNG state."""
    snapshot = torch.load(path, weights_only=True)
    tensors = dict(snapshot["model"])
    for key, state in snapshot["optimizer"]["state"].items():
        tensors[f"optimizer.{key}"] = state["momentum_buffer"]
    if rng:
        for rank, states in enumerate(snapshot["rng_states"]):
            tensors[f"rng.{rank}"] = states["cpu"]
    return snapshot["epochs_run"], tensors



def assert_same_snapshot(path_a: Path, path_b: Path) -> None:
    """Two snapshots hold the same training: epochs run, and weights and momentum
    buffers bitwise equal."""
    epochs_a, a = snapshot_tensors(path_a)
    epochs_b, b = snapshot_tensors(path_b)
    assert epochs_a == epochs_b
    assert a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


def signal_when(launch: list, cwd: Path, line: str, signum: int, start_s: float = 120,
                stop_s: float = 60) -> str:
    """Run ``launch`` in ``cwd`` (stdout and stderr to cwd/log.txt), send it
    ``signum`` once ``line`` appears in its output (within ``start_s`` seconds),
    wait up to ``stop_s`` seconds for it to end; return the whole log."""
    log = cwd / "log.txt"
    with open(log, "w") as out:
        agent = subprocess.Popen([str(part) for part in launch], cwd=cwd, env=script_env(),
                                 stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + start_s
            while line not in log.read_text():
                assert agent.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            agent.send_signal(signum)
            agent.wait(timeout=stop_s)
        finally:
            if agent.poll() is None:
                agent.kill()
    return log.read_text()


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


def plain_task(loss_fn, classification: bool):
    """A ``common.Task`` with no data: a loss, and whether it is a classification."""
    import common

    return common.Task(None, None, None, None, loss_fn, classification)


def script_trainer(module, model: torch.nn.Module, optimizer, loss_fn, out_dir: str, rank: int = 0,
                   grad_accum_steps: int = 1):
    """The Trainer of script ``module`` (singlegpu, multigpu_spawn, multigpu_torchrun,
    multinode) around ``model`` on the CPU, with no data and no snapshot to resume:
    for calling its ``_run_batch`` directly. All but singlegpu need a process group."""
    args = argparse.Namespace(
        grad_accum_steps=grad_accum_steps, amp=False, compile=False, save_every=1, lr=0.1,
        metrics_path=None, checkpoint_path=os.path.join(out_dir, "unused.pt"),
        snapshot_path=os.path.join(out_dir, "absent.pt"), snapshot_every_steps=0)
    positional = [model, None, None, optimizer, plain_task(loss_fn, False), torch.device("cpu")]
    name = module.__name__
    if name != "singlegpu":
        positional.append(rank)
    if name == "multinode":
        positional.append(rank)  # local_rank
    return module.Trainer(*positional, args)

# --------------------------------------------------------------------------
# MNIST from the real t10k files, written back in IDX format
# --------------------------------------------------------------------------

def read_idx(path: Path) -> torch.Tensor:
    """Read a (gzipped) IDX file (http://yann.lecun.com/exdb/mnist/ format) as uint8."""
    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">i", data[:4])
    ndim = magic & 0xFF
    shape = struct.unpack(f">{ndim}i", data[4:4 + 4 * ndim])
    return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).reshape(shape)


def write_idx(path: Path, tensor: torch.Tensor) -> None:
    """Write uint8 images (N, 28, 28) (magic 2051) or labels (N,) (magic 2049)."""
    magic = 2051 if tensor.dim() == 3 else 2049
    with open(path, "wb") as f:
        f.write(struct.pack(">i", magic))
        f.write(struct.pack(f">{tensor.dim()}i", *tensor.shape))
        f.write(tensor.contiguous().numpy().tobytes())


def require_mnist_t10k() -> Path:
    if not (MNIST_T10K / "t10k-images-idx3-ubyte.gz").exists():
        message = (f"real MNIST fixture absent: {MNIST_T10K}/t10k-images-idx3-ubyte.gz "
                   f"(set MNIST_T10K_DIR or place ../shared beside the repo)")
        if IN_CI:
            pytest.fail(message + "; CI must run this test")
        pytest.skip(message)
    return MNIST_T10K


def build_mnist_root(root: Path, n_train: int = 8000, n_test: int = 2000) -> Path:
    """A torchvision MNIST root made of the real t10k digits: the first
    ``n_train`` as the train split, the last ``n_test`` as the test split."""
    source = require_mnist_t10k()
    images = read_idx(source / "t10k-images-idx3-ubyte.gz")
    labels = read_idx(source / "t10k-labels-idx1-ubyte.gz")
    assert images.shape == (10000, 28, 28) and labels.shape == (10000,)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    write_idx(raw / "train-images-idx3-ubyte", images[:n_train])
    write_idx(raw / "train-labels-idx1-ubyte", labels[:n_train])
    write_idx(raw / "t10k-images-idx3-ubyte", images[-n_test:])
    write_idx(raw / "t10k-labels-idx1-ubyte", labels[-n_test:])
    return root


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory) -> Path:
    """8,000 real digits to train on, the last 2,000 held out as the test split."""
    return build_mnist_root(tmp_path_factory.mktemp("mnist"))


# --------------------------------------------------------------------------
# CIFAR-10 in its real python-pickle format
# --------------------------------------------------------------------------

def build_cifar10_root(root: Path, per_batch: int = 12, n_test: int = 20, seed: int = 0) -> Path:
    """A tiny CIFAR-10 in the layout of cifar-10-python.tar.gz, unpacked:
    cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}, each a pickle
    of a dict with "data" uint8 (N, 3072) rows (R, G, B planes of 32x32) and
    "labels" list[int], as https://www.cs.toronto.edu/~kriz/cifar.html describes
    (the originals were pickled by Python 2; torchvision reads them with
    encoding="latin1", which yields the same str keys as these).
    Each image is a flat color (its class's hue) plus noise, so it is learnable."""
    g = torch.Generator().manual_seed(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    palette = torch.randint(0, 256, (10, 3, 1), generator=g)

    def batch(n: int, name: str) -> None:
        labels = torch.randint(0, 10, (n,), generator=g)
        noise = torch.randint(-30, 31, (n, 3, 1024), generator=g)
        data = (palette[labels] + noise).clamp(0, 255).to(torch.uint8).reshape(n, 3072)
        with open(folder / name, "wb") as f:
            pickle.dump({"batch_label": name, "labels": labels.tolist(),
                         "data": data.numpy(), "filenames": ["x.png"] * n}, f)

    for i in range(1, 6):
        batch(per_batch, f"data_batch_{i}")
    batch(n_test, "test_batch")
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": names, "num_cases_per_batch": per_batch, "num_vis": 3072}, f)
    return root


# --------------------------------------------------------------------------
# One Slurm cluster per test session
# --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real Slurm cluster (tests/slurm_cluster.py: munged, slurmctld, three
    slurmd, two network-namespace hosts), started once for the whole session
    and shared by every module that submits jobs; stopped, and checked to
    leave nothing behind, at the end. Skips with the reason where it cannot
    run; under CI=true that fails instead."""
    import time

    from slurm_cluster import SlurmCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        if IN_CI:
            pytest.fail(f"Slurm tests must run in CI, but: {reason}")
        pytest.skip(f"no Slurm cluster here: {reason}")
    started = time.monotonic()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    print(f"Slurm cluster up in {time.monotonic() - started:.1f} s")
    try:
        yield cluster
    finally:
        cluster.stop()
    # The harness promises to leave the machine as it found it.
    assert cluster.leftovers() == []


# --------------------------------------------------------------------------
# Each test file's time, printed at the end of the run
# --------------------------------------------------------------------------

_FILE_SECONDS: dict = {}


def pytest_runtest_logreport(report) -> None:
    """Add each test phase's duration (setup, call, teardown) to its file's total."""
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the seconds each test file took, longest first (fixtures included)."""
    terminalreporter.section("seconds per test file")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f} s  in all")
