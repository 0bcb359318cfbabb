"""What the GPU check's parts share (benchmarks/gpu_check.py runs them): how
big each part runs (``Sizes``), the time it has (``Budget``), where it runs
(``Setting``), and how it runs train.py and nanoGPT's train.py: in a folder
of their own, stamped line by line (``harness.run_stamped``), each run killed
at the earlier of its own limit and the check's end."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

import torch

from benchmarks import REPO, harness  # noqa: F401  (REPO: the parts' repository root; tests/ on sys.path)
from support.runs import TORCHRUN, script_env

CHECK_FOLDER = REPO / ".gpu_check"  # ignored (.gitignore): what the check needs that is not the project's
WARMUP_STEPS = 50  # steps left out of a program's ms a step: compilation, the first evaluation
SPENT = "the time budget is spent"
MIN_RUN_S = 5.0  # a run given less than this is not started


class Sizes:
    """How big each part runs: on the GPU the recipes themselves; ``--dry_run``
    shrinks every part to seconds on a CPU. ``needs``: the seconds each part
    (or group of parts) is expected to take; a part starts only where
    they fit before the check's end, less what the diagnosis parts after it
    need (``gpu_check.DIAGNOSIS``)."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        if dry_run:
            self.gpt = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=8, dropout=0.0)
            self.pair_steps, self.pairs, self.short_steps, self.resume_steps, self.stop_at = 100, 1, 40, 40, 20
            self.warmup, self.rung_epochs, self.run_limit = 30, 1, 400
            self.warm_steps, self.ab_pairs, self.trace_steps = 20, 1, 12
            self.snapshot_gpt = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=512)
            self.resnet_batch, self.resnet_steps, self.resnet_reps = 8, 2, 2
            self.gpt2 = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, batch_size=4)
            self.gpt2_steps, self.gpt2_tokens = 60, 200_000
        else:  # docs/language-model.md's GPU recipe: nanoGPT's config/train_shakespeare_char.py
            self.gpt = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, dropout=0.2)
            self.pair_steps, self.pairs, self.short_steps, self.resume_steps, self.stop_at = 300, 3, 200, 150, 70
            self.warmup, self.rung_epochs, self.run_limit = WARMUP_STEPS, 2, 150
            self.warm_steps, self.ab_pairs, self.trace_steps = 30, 2, 40
            self.snapshot_gpt = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)
            self.resnet_batch, self.resnet_steps, self.resnet_reps = 256, 20, 6
            # GPT-2 small on nanoGPT's train.py defaults (a batch of 12 windows of 1,024 tokens),
            # one micro-batch a step
            self.gpt2 = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=12)
            self.gpt2_steps, self.gpt2_tokens = 150, 50_000_000
        if dry_run:  # on 2 CPU cores
            self.needs = dict(probe=1, compiled=40, ab=30, trace=15, yes_no=160, eager=15, kit_runs=20,
                              gpt2_tokens=40, snapshot=5, resnet=10)
        else:  # the warm compiles and one pair; one A/B pair; a compiled start and 40 steps
            self.needs = dict(probe=10, compiled=170, ab=70, trace=45, yes_no=100, eager=80, kit_runs=40,
                              gpt2_tokens=300, snapshot=25, resnet=15)
        self.probe_sleep_s = 0.15  # the GPU's queued sleep the probe's copies are timed behind

    @property
    def tokens_per_step(self) -> int:
        return self.gpt["batch_size"] * self.gpt["block_size"]


class Budget:
    """The check's time: ``end`` (``time.monotonic()``), which no run outlives
    (``timeout``), and ``soft``, before which a part plans to finish
    (``fits``): the end less what later parts keep for themselves
    (``keeping``)."""

    def __init__(self, end: float, soft: Optional[float] = None) -> None:
        self.end, self.soft = end, end if soft is None else soft

    def keeping(self, seconds: float) -> "Budget":
        """This budget with ``seconds`` more kept back for what comes after."""
        return Budget(self.end, self.soft - seconds)

    def left(self) -> float:
        """Seconds until ``soft``."""
        return self.soft - time.monotonic()

    def fits(self, seconds: float) -> bool:
        return self.left() >= seconds

    def timeout(self, limit: float) -> float:
        """A run's time limit: ``limit``, or the seconds to the check's end where fewer."""
        return max(0.0, min(limit, self.end - time.monotonic()))


@dataclasses.dataclass
class Setting:
    """What every part runs with: the sizes, the device, a scratch folder
    (``work``), the corpus and train.py's copy of it (``data``, None without
    it), nanoGPT (None, and why, without it), the JSON's path (``out``)."""

    sizes: Sizes
    device: torch.device
    work: Path
    out: Path
    corpus: Optional[Path]
    data: Optional[Path]
    nanogpt: Optional[Path]
    nanogpt_missing: str

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def missing(self, needs: tuple) -> str:
        """Why a part needing ``needs`` ("corpus", "nanogpt") cannot run; '' when it can."""
        if "corpus" in needs and self.corpus is None:
            return "no Tiny Shakespeare corpus: pass --corpus, set TINYSHAKESPEARE_FILE, or --prepare"
        if "nanogpt" in needs and self.nanogpt is None:
            return self.nanogpt_missing
        return ""


def run_stamped(cmd: list, cwd: Path, budget: Budget, limit: float, **env: str) -> tuple[int, list, float]:
    """``harness.run_stamped`` in the scripts' environment (helpers.script_env),
    plus ``env``, killed at ``budget.timeout(limit)``; not started where that
    is under ``MIN_RUN_S`` (status -1, its one line says why)."""
    timeout = budget.timeout(limit)
    if timeout < MIN_RUN_S:
        return -1, [(0.0, f"not started: {SPENT}")], 0.0
    status, lines, seconds = harness.run_stamped(cmd, cwd, timeout, script_env(**env))
    if timeout < limit and lines and lines[-1][1].startswith("[killed"):
        lines.append((seconds, f"[{SPENT}]"))
    return status, lines, seconds


def kit_command(nproc: int = 1, script: Path = REPO / "train.py", launcher: Optional[Path] = None) -> list:
    """torchrun of ``script`` (train.py), through ``launcher`` (a script that
    patches, then runs the one it is given) where one is given."""
    return TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}", *([launcher] if launcher else []), script]


def kit_gpt_flags(sizes: Sizes, data: Path, steps: int, *extra: str) -> list:
    """train.py on the GPU recipe (``sizes.gpt``) for ``steps`` steps, a progress line every 10."""
    flags = ["--dataset", "shakespeare_char", "--data_dir", data, "--max_steps", steps, "--log_every_steps", 10]
    for name, value in sizes.gpt.items():
        flags += [f"--{name}", value]
    return flags + list(extra)


def amp_flags(sizes: Sizes) -> list:
    """bf16 autocast on the GPU (the recipe's); none on a CPU (slower there)."""
    return [] if sizes.dry_run else ["--amp", "bf16"]


def records(path: Path) -> list:
    """The epoch records of a --metrics_path file ([] where there is none)."""
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "epoch" in r]


def error_of(exc: BaseException) -> str:
    """What a part that raised records: its type and message, at most 500 characters."""
    return f"{type(exc).__name__}: {exc}"[:500]
