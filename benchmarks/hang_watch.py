"""Section 1c, hang_watch: what the time-out report costs the training loop.

The report's parts that run while training: torch's flight recorder, which
train.py switches on (TORCH_FR_BUFFER_SIZE=2000: each collective noted in a
ring buffer, gloo's as well as NCCL's), and each rank's answering thread,
which sleeps in the launcher's store until a time-out asks it. train.py at
2 processes of one thread trains the synthetic task's MLP, a step so small
that the loop and its collectives (DDP's all-reduce, the stop signal's) are
most of it, with the recorder off (TORCH_FR_BUFFER_SIZE=0) and on, in
alternating rounds; CPU seconds per step of both processes together, a run
of a fifth of the steps subtracted (start-up drops out).

Reading the table: "on / off" is the step's CPU time with the recorder over
without it (1.0: no cost); the rounds' spread is the noise to read it against.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness import table
from benchmarks.language_model import _per_step_cpu, _timed_run
from support.runs import REPO, TORCHRUN

SETTINGS = {"recorder off (TORCH_FR_BUFFER_SIZE=0)": "0", "recorder on (train.py's default, 2000)": "2000"}


def section_hang_watch(steps: int = 1500, reps: int = 3) -> dict:
    """``reps`` rounds of train.py --dataset synthetic --max_steps ``steps`` at
    2 processes with the flight recorder off and on, each round in another
    order; returns CPU microseconds per step (both processes) per setting and
    the table."""
    root = Path(tempfile.mkdtemp(prefix="hang-watch-"))

    def runner(buffer: str):
        def run_for(n: int) -> tuple:
            cwd = Path(tempfile.mkdtemp(dir=root))
            cmd = TORCHRUN + ["--standalone", "--nproc_per_node=2", REPO / "train.py", "--dataset", "synthetic",
                              "--max_steps", str(n), "--batch_size", "8", "--snapshot_path", "s.pt"]
            _, cpu = _timed_run(cmd, cwd, 1, TORCH_FR_BUFFER_SIZE=buffer)
            shutil.rmtree(cwd, ignore_errors=True)
            return None, cpu
        return run_for

    per_step = {name: [] for name in SETTINGS}
    names = list(SETTINGS)
    try:
        for round_ in range(reps):
            for name in names[round_ % 2:] + names[:round_ % 2]:
                _, cpu = _per_step_cpu(runner(SETTINGS[name]), steps)
                per_step[name].append(cpu * 1e6)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    off, on = (statistics.median(per_step[name]) for name in names)
    rows = [[name, ", ".join(f"{v:,.0f}" for v in values), f"{statistics.median(values):,.0f}"]
            for name, values in per_step.items()]
    rows.append(["on / off", "", f"{on / off:.3f}"])
    return {"cpu_us_per_step": per_step, "on_over_off": on / off,
            "table": table(f"1c. the time-out report's cost: train.py, 2 processes x 1 thread, the synthetic "
                           f"MLP, {steps} steps less {steps // 5}, {reps} rounds, each in another order",
                           ["setting", "CPU us per step (both processes), each round", "median"], rows)}
