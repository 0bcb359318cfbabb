"""DataLoader workers (issue #24): started at every epoch by a fork server,
never forked from a rank that runs threads, so no epoch's start can deadlock;
a rank stuck in its loader before the first optimizer step is named within
--pg_timeout_s, not waited for over --startup_timeout_s (docs/pitfalls.md,
docs/fault-tolerance.md)."""

import os
import signal
import socket
import subprocess
import time

import pytest
import torch

import train_utils
from train_utils.loop.stop import STOP_SIGNALS
from helpers import REPO, PODS, epochs, error_lines, script_env

# Where a rank waits for its loader's next batch: the line the time-out report names.
LOADER_WAIT = (REPO / "train_utils" / "loop" / "epoch.py").read_text().splitlines().index("        for batch in bar:") + 1

# A user's task module, as docs/custom-task.md has one: a dataset class of its
# own, with hooks for these tests. Every DataLoader worker writes, at its first
# item, a file named by its pid in $WORKER_LOG saying whether its parent is the
# rank that built the dataset; on rank $HANG_RANK every item hangs (a
# __getitem__ that never returns, or a worker that never starts, look alike
# to the rank).
TINY_TASK = '''
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import common


class Tiny(Dataset):
    """48 items (float32 (4,), float32 (1,)): two batches of 8 per rank at 3 ranks."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(48, 4, generator=g)
        self.y = self.x.sum(1, keepdim=True)
        self.built_by = os.getpid()
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        global _noted
        if os.environ.get("HANG_RANK") == str(self.rank):
            time.sleep(3600)
        if not _noted and os.environ.get("WORKER_LOG") and torch.utils.data.get_worker_info():
            _noted = True
            with open(os.path.join(os.environ["WORKER_LOG"], str(os.getpid())), "w") as f:
                f.write("the rank" if os.getppid() == self.built_by else "another process")
        return self.x[index], self.y[index]


_noted = False


def build_task(args, download):
    return common.Task(Tiny(1), Tiny(2), Tiny(3), torch.nn.Linear(4, 1), F.mse_loss, classification=False)
'''


def run_job(cmd: list, cwd, timeout: float, **env: str) -> tuple:
    """Run ``cmd``; return (exit status, or None when it was still running after
    ``timeout`` seconds; stdout; stderr; seconds; the pids of its processes,
    loader workers and fork servers included, still there 30 s after it ended).
    Every process it started carries JOB_TAG in its environment: all are
    killed at the end."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    start = time.monotonic()
    # Not from the tests' fork server: a process it forks has the server's environment block in /proc.
    env = script_env(JOB_TAG=tag, FORKSERVER_SOCKET="", **env)
    job = subprocess.Popen([str(part) for part in cmd], cwd=cwd, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = job.communicate(timeout=timeout)
        status = job.returncode
    except subprocess.TimeoutExpired:
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)
        stdout, stderr = job.communicate()
        status = None
    seconds = time.monotonic() - start
    deadline = time.monotonic() + 30  # a bound for a busy machine: the wait ends when none is left
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = tagged(tag)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return status, stdout, stderr, seconds, left


def tagged(tag: str) -> list:
    """The pids of the processes whose environment holds JOB_TAG=``tag``."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and f"JOB_TAG={tag}".encode() in open(f"/proc/{name}/environ", "rb").read():
                pids.append(int(name))
        except OSError:
            pass  # gone meanwhile, or not ours
    return pids


def tiny_job(tmp_path, nproc: int, *flags: str) -> list:
    (tmp_path / "tiny_task.py").write_text(TINY_TASK)
    return PODS + [f"--nproc_per_node={nproc}", REPO / "train.py",
                       "--dataset", "tiny_task:build_task", "--batch_size", "8", *flags]


@pytest.mark.parametrize("nproc,total_epochs", [(3, 40)])
def test_loader_workers_started_every_epoch_never_hang(tmp_path, nproc, total_epochs):
    """Each epoch starts 2 new workers per rank for training and 2 for
    evaluation: 40 epochs at 3 ranks start 486 (the test split's included).
    The run must finish, and no worker may be a fork of its rank, which runs
    gloo's threads by then: such a fork could deadlock
    (docs/pitfalls.md; seen once on torch 2.8 with Python 3.9), rarely enough
    that only the parentage shows the cause every time."""
    log = tmp_path / "workers"
    log.mkdir()
    cmd = tiny_job(tmp_path, nproc, "--num_workers", "2", "--total_epochs", str(total_epochs),
                   "--save_every", "1000")
    status, stdout, stderr, seconds, left = run_job(cmd, tmp_path, 240, PYTHONPATH=str(tmp_path),
                                                    WORKER_LOG=str(log))
    print(f"{nproc} ranks, {total_epochs} epochs: {seconds:.1f} s")
    assert status == 0, f"exit {status}\n{stdout[-2000:]}\n{stderr[-4000:]}"
    assert left == []
    assert [int(e["epoch"]) for e in epochs(stdout)] == list(range(1, total_epochs + 1))
    parents = [(log / name).read_text() for name in os.listdir(log)]
    assert len(parents) == nproc * 2 * (2 * total_epochs + 1)
    assert set(parents) == {"another process"}


def test_a_rank_stuck_in_its_loader_in_the_first_epoch_is_named_within_pg_timeout(tmp_path):
    """Rank 1's dataset never returns an item (its loader workers never give
    one), in the first epoch, before any optimizer step, whose collectives wait
    --startup_timeout_s (30 min). Rank 0 waits --pg_timeout_s (10 s here) from
    its own first batch, names rank 1 and exits; the launcher then stops the
    others with SIGTERM, which the stuck rank notes for a stop after its step, and
    SIGKILL 30 s later. No loader worker or fork server outlives its rank."""
    cmd = tiny_job(tmp_path, 3, "--num_workers", "2", "--total_epochs", "2", "--pg_timeout_s", "10")
    status, stdout, stderr, seconds, left = run_job(cmd, tmp_path, 120, PYTHONPATH=str(tmp_path), HANG_RANK="1")
    print(f"ended after {seconds:.1f} s")
    assert status is not None, f"still running after 120 s\n{stdout[-2000:]}\n{stderr[-4000:]}"
    assert status != 0
    assert left == []
    assert error_lines(stderr) == [
        f"error: rank 0 waited 10 s during epoch 1, training step 1 of this start for ranks [1] to have their "
        f"batch too (rank 1 (host {socket.gethostname()}) is at {REPO}/train_utils/loop/epoch.py:{LOADER_WAIT} in "
        f"__iter__): a rank stuck in its data loader (a loader worker that never started, a dataset's "
        f"__getitem__ that does not return) holds up all; every live rank's stack: {tmp_path}/stacks_rank*_*.txt "
        f"(--pg_timeout_s sets the wait); no snapshot is written yet, so a restart trains from the beginning"], \
        stderr[-5000:]
    assert sorted(path.name for path in tmp_path.glob("stacks_*.txt")) == [
        f"stacks_rank{rank}_{socket.gethostname()}.txt" for rank in range(3)]
    assert "epoch 1/2 |" not in stdout


def test_a_dataset_workers_cannot_receive_is_one_line(tmp_path):
    """With --num_workers, the dataset travels to each worker pickled: a lambda
    in it is refused before training, naming the fix."""
    (tmp_path / "lambda_task.py").write_text(
        "import torch, torch.nn.functional as F\n"
        "from torch.utils.data import Dataset\n"
        "import common\n\n"
        "class Mapped(Dataset):\n"
        "    def __init__(self, fn):\n"
        "        self.fn, self.x = fn, torch.randn(64, 4)\n"
        "    def __len__(self):\n"
        "        return 64\n"
        "    def __getitem__(self, i):\n"
        "        return self.fn(self.x[i]), self.x[i].sum(0, keepdim=True)\n\n"
        "def build_task(args, download):\n"
        "    data = Mapped(lambda x: 2 * x)\n"
        "    return common.Task(data, data, data, torch.nn.Linear(4, 1), F.mse_loss, classification=False)\n")
    cmd = PODS + ["--nproc_per_node=1", REPO / "train.py", "--dataset", "lambda_task:build_task",
                      "--num_workers", "2", "--total_epochs", "1"]
    status, stdout, stderr, _, _ = run_job(cmd, tmp_path, 120, PYTHONPATH=str(tmp_path))
    assert status != 0
    (line,) = error_lines(stderr)
    assert "Mapped cannot be pickled" in line and "--num_workers 0" in line
    assert not (tmp_path / "snapshot_train.pt").exists()


def test_worker_seeds_still_come_from_the_saved_loader_generator(tmp_path):
    """The fork server changes where workers start, not what they draw: each
    epoch's worker seeds come from the loader's generator in the rank, so the
    same generator state gives the same worker draws."""
    import common

    def draws(generator_state):
        loader = torch.utils.data.DataLoader(common.SyntheticRegression(0, "test"), batch_size=256,
                                             generator=torch.Generator(), collate_fn=_worker_draw,
                                             **train_utils.loader_workers(2, common.SyntheticRegression(0, "test")))
        loader.generator.set_state(generator_state)
        return torch.cat(list(loader))

    state = torch.Generator().manual_seed(7).get_state()
    first, again = draws(state), draws(state)
    assert torch.equal(first, again) and len(first.unique()) == len(first)


def _worker_draw(batch):
    return torch.rand(1)


class _Pids(torch.utils.data.Dataset):
    """Items: the pid of the process that loads them."""

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return os.getpid()


def test_workers_from_the_fork_server_never_act_on_a_stop_signal():
    """torchrun signals a rank's whole process group, Slurm every process of a
    step: a worker from loader_workers has SIGUSR1, SIGTERM and SIGINT blocked
    from its first instruction (the fork server was started with them blocked)
    and ignored once it runs (read from the kernel's record of the worker)."""
    loader = torch.utils.data.DataLoader(_Pids(), batch_size=1, **train_utils.loader_workers(1, _Pids()))
    iterator = iter(loader)
    worker = int(next(iterator))
    status = dict(line.split(":\t", 1) for line in open(f"/proc/{worker}/status").read().splitlines())
    del iterator
    assert worker != os.getpid() and os.getppid() != worker
    blocked, ignored = int(status["SigBlk"], 16), int(status["SigIgn"], 16)
    assert [signum for signum in STOP_SIGNALS if not blocked >> (signum - 1) & 1] == []
    assert [signum for signum in STOP_SIGNALS if not ignored >> (signum - 1) & 1] == []
