"""What the benchmark's sections share: the machine the numbers were measured
on, the markdown table each section prints, a process group set up as the
scripts' ``ddp_setup`` does, a bare training step, and the timing (seconds per
step, interleaved repetitions; a whole program's milliseconds a step from its
progress lines).

Timing conventions of every section: ``timed`` returns seconds per call
(wall time by default, CPU time where a section passes
``clock=time.process_time``), with a GPU's queued work finished before and
after; ``interleaved`` runs the variants in ABBA order so that a shared
machine's drifting load falls on each alike. A section's headline figure is
the best or the median of those repetitions, as its table's title says.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import signal
import statistics
import subprocess
import threading
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist

# First: importing the package puts the repository (and its support package) on sys.path.
from benchmarks import REPO  # noqa: F401  (the repository root, for the sections)
import common
import train_utils
import vision_tasks

CPU = torch.device("cpu")


def build_model(dataset: str, model_name: str) -> torch.nn.Module:
    """A fresh model of a built-in task (synthetic, mnist, cifar10), from the global RNG."""
    if dataset == "synthetic":
        return common.synthetic_model(model_name)
    return vision_tasks.build_model(dataset, model_name)


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "cpu_cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "os": platform.platform(),
            "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")}
    try:
        load = os.getloadavg()[0]
        info["load_avg_1min_at_start"] = round(load, 2)
    except OSError:
        pass
    return info


def table(title: str, header: list[str], rows: list[list]) -> str:
    """A markdown table (also readable as plain text)."""
    def cell(v):
        return f"{v:,.3f}" if isinstance(v, float) and abs(v) < 10 else (
            f"{v:,.0f}" if isinstance(v, float) else str(v))
    lines = [f"**{title}**", "", "| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------
# What the sections share: the process group, a training step, the timing
# --------------------------------------------------------------------------

def backend_for(device: torch.device = None) -> str:
    """The process-group backend the scripts use on ``device`` (default: this
    machine's first GPU where CUDA works, else its CPU): nccl on a GPU, gloo on a CPU."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def process_group(rank: int, world_size: int, port: int, device: torch.device):
    """Be ``rank`` of a ``world_size``-process group on this machine for a with
    block, set up as the scripts' ``ddp_setup`` does: this rank's GPU selected
    first, the CPU cores shared between the processes
    (``train_utils.share_cpu_cores``: the usable cores over the world size,
    unless OMP_NUM_THREADS is set), the device's backend. After the block the
    group is gone and torch's thread count is what it was."""
    threads = torch.get_num_threads()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    train_utils.share_cpu_cores(device, world_size)
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` (on ``device``) in DistributedDataParallel, as the DDP scripts wrap it."""
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)


def train_step(model, optimizer, loss_fn, x, y, autocast=contextlib.nullcontext(), transform=None):
    """One bare training step on the batch (``x``, ``y``), as a function of no
    arguments: zero_grad, forward and loss under ``autocast`` (made once, as in
    the scripts), backward, optimizer step. ``transform`` runs on ``x`` each step."""
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(model(x if transform is None else transform(x)), y)
        loss.backward()
        optimizer.step()
    return step


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` to finish (a GPU's; a CPU has none)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, steps: int, device: torch.device = CPU, clock=time.perf_counter,
          barrier: bool = False) -> float:
    """Seconds per call of ``step()`` over ``steps`` calls, by ``clock``, with the
    GPU's queued work finished before and after; with ``barrier``, every rank
    of the process group starts together."""
    synchronize(device)
    if barrier:
        dist.barrier()
    start = clock()
    for _ in range(steps):
        step()
    synchronize(device)
    return (clock() - start) / steps


def interleaved(blocks: dict, reps: int) -> dict:
    """{name: [what ``blocks[name]()`` returned, per repetition]}: each block once
    per repetition, in ABBA order (reversed every other repetition): on a shared
    machine the load drifts over seconds, and every block sees the same drift."""
    results = {name: [] for name in blocks}
    for rep in range(reps):
        for name in (list(blocks) if rep % 2 == 0 else list(reversed(blocks))):
            results[name].append(blocks[name]())
    return results


class Position:
    """A snapshot's position, the one part a benchmark's snapshots hold (a
    ``train_utils.Checkpointer`` part: ``KEYS``, ``state_dict``,
    ``load_state_dict``); ``steps_run`` raised before each save gives each a
    new position (under FSDP a new folder), as in training."""

    KEYS = ("epochs_run", "steps_run")

    def __init__(self) -> None:
        self.steps_run = 0

    def state_dict(self) -> dict:
        return {"epochs_run": 0, "steps_run": self.steps_run}

    def load_state_dict(self, snapshot: dict) -> None:
        self.steps_run = snapshot["steps_run"]


# --------------------------------------------------------------------------
# A whole program's milliseconds a step, from its progress lines
# --------------------------------------------------------------------------

# train.py's progress line (--log_every_steps) and nanoGPT's (its log_interval): group 1 is the step.
KIT_STEP = re.compile(r"^step (\d+) \| epoch", re.M)
NANOGPT_ITER = re.compile(r"^iter (\d+): loss \S+, time (\S+)ms", re.M)


def process_tree(pid: int) -> list:
    """``pid`` and every process below it, children after their parent
    (Linux's /proc; elsewhere ``pid`` alone)."""
    children = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state
                children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop(0))
        todo += children.get(tree[-1], [])
    return tree


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL to ``process`` (started in a session of its own), every process
    below it, the deepest first (torchrun starts each worker in a session of
    its own), and its process group."""
    for pid in reversed(process_tree(process.pid)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def run_stamped(cmd: list, cwd, timeout: float, env: dict) -> tuple[int, list, float]:
    """Run ``cmd`` in ``cwd`` with environment ``env``: (exit status, [(seconds
    since start, line)] of stdout and stderr as each line arrived, wall
    seconds). At ``timeout`` seconds, printing or not, it is killed with
    every process below it (``kill_tree``: torchrun's workers too), and a
    last line says so; so is it when this process is interrupted."""
    start = time.monotonic()
    lines, killed = [], []

    def kill(process: subprocess.Popen) -> None:
        killed.append(time.monotonic() - start)
        kill_tree(process)

    with subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True) as process:
        timer = threading.Timer(timeout, kill, (process,))
        timer.start()
        try:
            for line in process.stdout:
                lines.append((time.monotonic() - start, line.rstrip("\n")))
            process.wait()
        finally:
            timer.cancel()
            if process.poll() is None:
                kill(process)
                process.wait()
    if killed:
        lines.append((killed[0], f"[killed: still running after {timeout:.0f} s]"))
    return process.returncode, lines, time.monotonic() - start


def ms_per_step(lines: list, pattern: re.Pattern, warmup: int) -> tuple:
    """(median ms a step, number of intervals) over the progress lines
    ``pattern`` finds in ``run_stamped``'s ``lines`` (group 1: the step),
    from step ``warmup`` on: each interval's arrival time over its steps. One
    clock for every program, whatever each prints of its own time; the
    median leaves out the few intervals that hold an evaluation or a
    snapshot, and ``warmup`` the compilation."""
    stamps = [(t, int(m.group(1))) for t, line in lines for m in [pattern.match(line)] if m]
    intervals = [1000 * (t2 - t1) / (s2 - s1) for (t1, s1), (t2, s2) in zip(stamps, stamps[1:])
                 if s1 >= warmup and s2 > s1]
    return (statistics.median(intervals) if intervals else None), len(intervals)


def text_of(lines: list) -> str:
    """``run_stamped``'s lines as one text."""
    return "\n".join(line for _, line in lines)


def tail(lines: list, count: int = 6) -> str:
    """The last ``count`` of ``run_stamped``'s lines, on one line (at most 600 characters): what a failure shows."""
    return " / ".join(line for _, line in lines[-count:])[-600:]
